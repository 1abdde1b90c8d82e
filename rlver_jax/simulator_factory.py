"""Builds the simulated user named by a `sim_user` config section."""

from __future__ import annotations

from models.sampler import SamplingParams
from rlver_jax import policy as policy_lib
from sim_user import dynamics
from sim_user.backends.flax_llm import FlaxLLMBackend
from sim_user.backends.openai_http import OpenAIChatBackend
from sim_user.backends.scripted import ScriptedBackend
from sim_user.simulator import SimulatedUser
from sim_user.templates import PromptSet

BACKENDS = ("openai", "flax", "scripted")


def make_backend(cfg, mesh=None):
  if cfg.backend == "scripted":
    return ScriptedBackend()
  if cfg.backend == "openai":
    return OpenAIChatBackend(cfg.base_url, cfg.model, api_key_env=cfg.api_key_env,
                             max_concurrency=cfg.max_concurrency, timeout_s=cfg.timeout_s,
                             max_retries=cfg.http_retries, backoff_s=cfg.backoff_s,
                             temperature=cfg.temperature,
                             max_tokens=cfg.max_tokens)
  if cfg.backend == "flax":
    if not cfg.checkpoint:
      raise ValueError("sim_user.backend=flax needs --config.sim_user.checkpoint=DIR "
                       "(an HF Qwen2 checkpoint for the simulator)")
    simulator = policy_lib.load_policy(cfg.checkpoint,
                                       dtype="float32" if mesh is None else "bfloat16", mesh=mesh)
    return FlaxLLMBackend(simulator.sampler, simulator.tokenizer, SamplingParams(
        max_new_tokens=cfg.max_tokens, temperature=cfg.temperature))
  raise ValueError(f"sim_user.backend={cfg.backend!r}; expected one of {BACKENDS}")


def describe(cfg) -> str:
  """The simulator a `sim_user` section names, for error messages: its URL or backend."""
  if cfg.backend == "openai":
    return f"{cfg.base_url} (model {cfg.model})"
  if cfg.backend == "flax":
    return f"the flax simulator {cfg.checkpoint}"
  return f"the {cfg.backend} simulator"


def make_simulated_user(cfg, mesh=None, rules: str | None = None) -> SimulatedUser:
  prompts = PromptSet.load(cfg.templates or None, language=cfg.language, variant=cfg.variant)
  rule_set = dynamics.get_rules(rules or cfg.rules)
  target_header = "Reason" if rule_set.name == "rlver_train" else "TargetCompletion"
  return SimulatedUser(make_backend(cfg, mesh), rule_set, prompts,
                       max_retries=cfg.parse_retries, on_failure=cfg.on_failure,
                       target_header=target_header)
