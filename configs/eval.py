"""Sentient Benchmark evaluation of a policy checkpoint (SAGE rules: start 40, clip +-10, 10 replies).

  python -m rlver_jax.eval --config=configs/eval.py --config.policy.checkpoint=DIR \
      --config.eval.profiles=/data/rlver/test_profile.jsonl --config.workdir=W \
      --config.sim_user.base_url=http://localhost:8000/v1 --config.sim_user.model=deepseek-v3

`:think` evaluates a thinking policy (its <think> blocks are hidden from the
simulated user) with the training budget of 5000 new tokens a turn. Decoding
settings, the system prompt and the share of turns cut off by the budget are
recorded in W/summary.json. `--config.eval.system_prompt=sage` evaluates a
baseline with SAGE's prompt for tested models.
"""

import ml_collections

from rlver_jax import sections

VARIANTS = ("", "think")


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  """`rlver_jax/sections.py:EvalRun`'s defaults (greedy, 1024 tokens a reply)."""
  if arg not in VARIANTS:
    raise ValueError(f"unknown config variant {arg!r}; use '' or 'think'")
  c = sections.config_dict(sections.EvalRun())
  if arg == "think":
    c.eval.thinking = True
    c.eval.max_new_tokens = 5000  # the training budget: a reply's reasoning needs room
  return c
