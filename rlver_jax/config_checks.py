"""Start-up checks of training and evaluation configs: a setting that cannot work fails here.

Each problem is reported with the field that causes it, as one
`UserInputError` listing all of them, before any checkpoint is loaded or
any dialogue is run (a run that would divide logits by a zero temperature
otherwise skips every update, hours in).
"""

from __future__ import annotations

from models import partitioning
from models.errors import UserInputError
from rl import losses
from rl import rollout_config
from rl import system_prompts
from rlver_jax import off_policy, simulator_factory
from sim_user import dynamics, redact, templates

ALGORITHMS = ("ppo", "grpo")
REWARDS = ("final", "turn")
KL_ESTIMATORS = ("k1", "k2", "k3")
LR_SCHEDULES = ("constant", "cosine")
SAMPLING_DTYPES = ("", "bfloat16")  # "": the sampler decodes from the training weights


class _Problems:
  """Collects "field=value: why" lines."""

  def __init__(self, config):
    self.config = config
    self.lines: list[str] = []

  def value(self, field: str):
    node = self.config
    for name in field.split("."):
      node = node[name]
    return node

  def require(self, field: str, ok, why: str) -> None:
    """Records a problem unless `ok(value)` holds."""
    value = self.value(field)
    if not ok(value):
      self.lines.append(f"{field}={value!r}: {why}")

  def one_of(self, field: str, choices) -> None:
    self.require(field, lambda v: v in choices, f"expected one of {tuple(choices)}")

  def given(self, field: str, how: str) -> None:
    if not self.value(field):
      self.lines.append(f"{field} is not set: give {how}")

  def raise_if_any(self, what: str) -> None:
    if self.lines:
      raise UserInputError(f"{what} config cannot run: " + "; ".join(self.lines))


def _at_least(bound):
  return lambda v: v is not None and v >= bound


def _positive(v) -> bool:
  return v is not None and v > 0


def _check_sampling(p: _Problems, section: str, *, greedy_ok: bool) -> None:
  if greedy_ok:
    p.require(f"{section}.temperature", _at_least(0.0), "must be >= 0 (0 is greedy)")
  else:
    p.require(f"{section}.temperature", _positive,
              "must be > 0: the learner scores tokens under softmax(logits / temperature)")
  p.require(f"{section}.top_p", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
  p.require(f"{section}.top_k", _at_least(0), "must be >= 0 (0: no top-k)")
  p.require(f"{section}.max_new_tokens", _at_least(1), "must be >= 1")
  p.one_of(f"{section}.engine", rollout_config.ENGINES)


def _check_sim_user(p: _Problems) -> None:
  p.one_of("sim_user.backend", simulator_factory.BACKENDS)
  p.one_of("sim_user.rules", sorted(dynamics.RULES))
  p.one_of("sim_user.variant", templates.VARIANTS)
  p.one_of("sim_user.language", templates.LANGUAGES)
  p.one_of("sim_user.on_failure", simulator_factory.ON_FAILURE)
  p.require("sim_user.parse_retries", _at_least(0), "must be >= 0")
  p.require("sim_user.max_agent_turns", _at_least(0),
            "agent replies per dialogue; must be >= 0 (0: the rule set's own limit)")
  if not redact.is_env_var_name(p.value("sim_user.api_key_env")):
    p.lines.append(redact.api_key_env_error())  # the value is likely the key: never echoed
  if p.value("sim_user.backend") == "openai":
    p.given("sim_user.base_url", "the simulator's OpenAI-compatible endpoint, e.g. "
            "--config.sim_user.base_url=http://localhost:8000/v1")
    p.require("sim_user.http_retries", _at_least(0), "must be >= 0")
    p.require("sim_user.max_concurrency", _at_least(1), "must be >= 1")
    p.require("sim_user.timeout_s", _positive, "must be > 0")
    p.require("sim_user.max_reply_chars", _at_least(1), "must be >= 1")
  if p.value("sim_user.backend") == "flax":
    p.given("sim_user.checkpoint", "--config.sim_user.checkpoint=DIR (an HF Qwen2 checkpoint "
            "for the simulator)")


def _check_system_prompt(p: _Problems, field: str) -> None:
  """A preset needs a language it is written in."""
  if p.value(field) in system_prompts.PRESETS:
    p.require("sim_user.language", lambda v: v in system_prompts.LANGUAGES,
              f"{field}={p.value(field)!r} has no prompt in this language; "
              f"expected one of {system_prompts.LANGUAGES}")


def check_train_config(config) -> None:
  """Raises UserInputError naming every field of a training config that cannot train."""
  p = _Problems(config)
  p.given("workdir", "--config.workdir=DIR")
  if config.policy.tiny_init and config.policy.checkpoint:
    p.lines.append(f"policy.checkpoint={config.policy.checkpoint!r} with policy.tiny_init=True "
                   "(the demo's own tiny policy): pass --config.policy.tiny_init=False to train "
                   "that checkpoint")
  if not config.policy.tiny_init:
    p.given("policy.checkpoint", "--config.policy.checkpoint=/path/to/Qwen2.5-7B-Instruct (an "
            "HF directory with config.json, safetensors and tokenizer files)")
  p.given("data.train_profiles", "--config.data.train_profiles=FILE.jsonl (RLVER's "
          "train_profile.jsonl, or sim_user/data/demo_profiles.jsonl)")
  p.require("steps", _at_least(1), "must be >= 1")
  p.require("batch_size", _at_least(1), "profiles per step; must be >= 1")
  p.require("checkpoint.every", _at_least(0), "steps between saves; must be >= 0 (0: off)")
  p.require("checkpoint.every_minutes", _at_least(0.0),
            "minutes between saves; must be >= 0 (0: off)")
  p.require("checkpoint.keep", _at_least(1), "must be >= 1")
  p.require("max_skipped_updates", _at_least(0), "must be >= 0")
  p.require("log_dialogues_every", _at_least(0), "steps between logged dialogues; >= 0 (0: never)")

  p.one_of("rl.algorithm", ALGORITHMS)
  p.require("rollout.samples_per_profile", _at_least(1), "must be >= 1")
  if config.rl.algorithm == "grpo":
    p.require("rollout.samples_per_profile", _at_least(2),
              "GRPO compares the samples of one profile; a group of one has advantage 0")
    p.require("rl.reward", lambda v: v == "final",
              "per-turn rewards are a PPO ablation; GRPO normalises final rewards")
  _check_sampling(p, "rollout", greedy_ok=False)
  p.require("rollout.max_dialogue_tokens", _at_least(1), "must be >= 1")
  p.require("rollout.sampling_dtype", lambda v: v in SAMPLING_DTYPES,
            f"the sampler's copy of the weights: expected one of {SAMPLING_DTYPES} "
            "(empty: decode from the training weights)")
  p.one_of("rollout.sampling_layout", partitioning.SAMPLING_LAYOUTS)
  p.require("rollout.off_policy_steps", lambda v: v in off_policy.CHOICES,
            f"expected one of {off_policy.CHOICES}: 0 collects each step's dialogues with the "
            "weights it trains (on-policy), 1 collects the next step's while this step's update "
            "runs; more steps ahead are not supported")
  _check_system_prompt(p, "rollout.system_prompt")

  p.one_of("rl.reward", REWARDS)
  p.one_of("rl.loss_agg", losses.AGGREGATIONS)
  p.one_of("rl.kl_estimator", KL_ESTIMATORS)
  p.require("rl.gamma", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
  p.require("rl.lam", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
  p.require("rl.clip_ratio", _positive, "must be > 0")
  p.require("rl.clip_ratio_high", lambda v: v is None or v > 0, "must be > 0 or None")
  p.require("rl.dual_clip", lambda v: v is None or v > 1.0,
            "must be > 1 (verl's clip_ratio_c) or None to turn dual clip off")
  p.require("rl.value_clip", lambda v: v is None or v > 0, "must be > 0 or None")
  p.require("rl.entropy_coef", _at_least(0.0), "must be >= 0")
  p.require("rl.kl_coef", _at_least(0.0), "must be >= 0")

  p.require("optim.actor_lr", _positive, "must be > 0")
  if config.rl.algorithm == "ppo":
    p.require("optim.critic_lr", _positive, "must be > 0")
  p.one_of("optim.schedule", LR_SCHEDULES)
  p.require("optim.warmup_steps", _at_least(0), "must be >= 0")
  p.require("optim.grad_clip", _positive, "must be > 0")
  p.require("optim.ppo_epochs", _at_least(1), "must be >= 1")
  p.require("optim.num_minibatches", _at_least(1), "must be >= 1")
  p.require("optim.grad_accum", _at_least(1), "must be >= 1")
  _check_sim_user(p)
  p.require("sim_user.max_failed_share", lambda v: 0.0 <= v <= 1.0, "must be a share in [0, 1]")
  p.require("sim_user.max_failed_steps_in_a_row", _at_least(1), "must be >= 1")
  p.raise_if_any("training")


def check_eval_config(config) -> None:
  """Raises UserInputError naming every field of an evaluation config that cannot run."""
  p = _Problems(config)
  p.given("workdir", "--config.workdir=DIR")
  p.given("policy.checkpoint", "--config.policy.checkpoint=DIR")
  p.given("eval.profiles", "--config.eval.profiles=FILE.jsonl (RLVER's test_profile.jsonl for "
          "the Sentient Benchmark)")
  p.require("eval.batch_size", _at_least(1), "must be >= 1")
  p.require("eval.limit", _at_least(0), "must be >= 0 (0: every profile)")
  p.require("eval.min_scored_share", lambda v: 0.0 <= v <= 1.0, "must be a share in [0, 1]")
  _check_sampling(p, "eval", greedy_ok=True)
  _check_system_prompt(p, "eval.system_prompt")
  _check_sim_user(p)
  p.raise_if_any("evaluation")
