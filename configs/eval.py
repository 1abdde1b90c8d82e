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

from configs import common

VARIANTS = ("", "think")


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f"unknown config variant {arg!r}; use '' or 'think'")
  c = common.inference_config()
  c.sim_user = common.sim_user_config(rules="sage_benchmark")
  c.resume_mismatch_ok = False  # resume W/results.jsonl even though the config differs

  c.eval = ml_collections.ConfigDict()
  c.eval.profiles = ""  # the profiles: RLVER's test_profile.jsonl (100, with first_talk)
  # Another checkpoint (e.g. the untrained policy) evaluated the same way first, in W/baseline;
  # its scores are printed beside the policy's. Empty: none.
  c.eval.baseline_checkpoint = ""  # evaluated first, in W/baseline; empty: none
  c.eval.batch_size = 16  # dialogues run side by side
  c.eval.limit = 0  # the first N profiles only (0: all)
  c.eval.min_scored_share = 0.9  # fewer profiles scored (the rest failed in the simulator): error
  c.eval.thinking = arg == "think"  # the policy reasons in <think>...</think> before each reply
  # A preset of rl/system_prompts.py ("rlver": the paper's prompt for eval.thinking and
  # sim_user.language; "sage": SAGE's prompt for tested models) or the prompt itself.
  c.eval.system_prompt = "rlver"  # the policy's system prompt: a preset or the text
  # The policy's tokens per reply; thinking: the training budget.
  c.eval.max_new_tokens = 5000 if arg == "think" else 1024
  c.eval.temperature = 0.0  # 0, greedy: the score does not depend on a seed
  c.eval.top_p = 1.0  # nucleus sampling (1: off)
  c.eval.top_k = 0  # top-k sampling (0: off)
  c.eval.engine = "continuous"  # continuous (rl/engine.py) | lockstep (rl/lockstep.py)
  return c
