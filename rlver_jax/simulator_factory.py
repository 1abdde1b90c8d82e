"""Builds the simulated user named by a `sim_user` config section."""

from __future__ import annotations

from infra.errors import UserInputError
from infra.registry import Registry
from models.sampling import SamplingParams
from rl import keys
from sim_user import dynamics
from sim_user.backends.flax_llm import FlaxLLMBackend
from sim_user.backends.openai_http import OpenAIChatBackend
from sim_user.backends.scripted import ScriptedBackend
from sim_user.config import ON_FAILURE
from sim_user.simulator import SimulatedUser
from sim_user.templates import PromptSet


# sim_user.backend -> its builder (section, mesh, the run's seed) -> a backend. Its keys are
# sim_user/config.py's BACKENDS, which the section's check reads (a test holds the two equal).
BACKEND_BUILDERS: Registry = Registry("sim_user.backend")


@BACKEND_BUILDERS.register("scripted")
def _scripted(cfg, mesh, seed) -> ScriptedBackend:
  del cfg, mesh, seed  # rule-based: nothing to reach, nothing to sample
  return ScriptedBackend()


@BACKEND_BUILDERS.register("openai")
def _openai(cfg, mesh, seed) -> OpenAIChatBackend:
  del mesh, seed  # the server samples
  return OpenAIChatBackend(cfg.base_url, cfg.model, api_key_env=cfg.api_key_env,
                           max_concurrency=cfg.max_concurrency, timeout_s=cfg.timeout_s,
                           max_retries=cfg.http_retries, backoff_s=cfg.backoff_s,
                           temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                           max_reply_chars=cfg.max_reply_chars)


@BACKEND_BUILDERS.register("flax")
def _flax(cfg, mesh, seed) -> FlaxLLMBackend:
  if not cfg.checkpoint:
    raise ValueError("sim_user.backend=flax needs --config.sim_user.checkpoint=DIR "
                     "(an HF Qwen2 checkpoint for the simulator)")
  sampling = SamplingParams(max_new_tokens=cfg.max_tokens, temperature=cfg.temperature)
  return FlaxLLMBackend.from_checkpoint(cfg.checkpoint, sampling,
                                        keys.stream(seed, keys.SIMULATOR), mesh)


def make_rules(cfg) -> dynamics.EmotionRules:
  """The rule set `cfg.rules` names, with `cfg.max_agent_turns` applied.

  `max_agent_turns` 0 keeps the rule set's own limit: `sage_benchmark` ends
  with the agent's 10th reply, unjudged (SAGE); `rlver_train` with the agent's
  9th reply, judged (the release's `turn_count > 8`; the paper says 8: set 8).
  """
  name = cfg.rules
  if name not in dynamics.RULES:
    raise UserInputError(f"sim_user.rules={name!r}; expected one of {sorted(dynamics.RULES)}")
  if cfg.max_agent_turns < 0:
    raise UserInputError(f"sim_user.max_agent_turns={cfg.max_agent_turns}; expected a positive "
                         "number of agent replies, or 0 for the rule set's own")
  return dynamics.with_max_agent_turns(dynamics.get_rules(name), cfg.max_agent_turns)


def describe(cfg) -> str:
  """The simulator a `sim_user` section names, for error messages: its URL or backend."""
  if cfg.backend == "openai":
    return f"{cfg.base_url} (model {cfg.model})"
  if cfg.backend == "flax":
    return f"the flax simulator {cfg.checkpoint}"
  return f"the {cfg.backend} simulator"


def make_simulated_user(cfg, mesh=None, seed: int = 0) -> SimulatedUser:
  """The simulated user of a `sim_user` section; `seed` is the run's (an in-process simulator
  draws from its stream of it)."""
  if cfg.on_failure not in ON_FAILURE:
    raise UserInputError(f"sim_user.on_failure={cfg.on_failure!r}; expected one of {ON_FAILURE}")
  rule_set = make_rules(cfg)
  prompts = PromptSet.load(cfg.templates or None, language=cfg.language, variant=cfg.variant)
  backend = BACKEND_BUILDERS.lookup(cfg.backend)(cfg, mesh, seed)
  target_header = "Reason" if rule_set.name == "rlver_train" else "TargetCompletion"
  return SimulatedUser(backend, rule_set, prompts,
                       max_retries=cfg.parse_retries, on_failure=cfg.on_failure,
                       target_header=target_header,
                       # The scripted user's changes come from its own rules, not a prompt.
                       max_change=None if cfg.backend == "scripted" else cfg.max_change,
                       max_message_chars=cfg.max_message_chars)
