"""RLVER PPO recipe for Qwen2.5-7B-Instruct (the paper's setting).

  python -m rlver_jax.main --config=configs/ppo.py \
      --config.policy.checkpoint=/ckpt/Qwen2.5-7B-Instruct \
      --config.data.train_profiles=/data/rlver/train_profile.jsonl \
      --config.sim_user.base_url=http://localhost:8000/v1 --config.sim_user.model=deepseek-v3 \
      --config.workdir=/runs/ppo

`--config=configs/ppo.py:think` trains the thinking variant (reason in
<think>...</think>, then reply; each agent turn is its own sample).

`batch_size` counts profiles per step, as verl's batch size counts prompts:
a step runs batch_size x rollout.samples_per_profile dialogues (PPO: 32 x 1).
"""

import ml_collections

from rlver_jax import sections

# --config=configs/ppo.py[:variant]; tests/rlver_jax/test_recipes.py runs each
VARIANTS = ("", "think")


def base_config(arg: str = "") -> ml_collections.ConfigDict:
  """The paper's PPO setting: `rlver_jax/sections.py:TrainRun`'s defaults, with sampler
  groups sized by the plan (`rollout.sampler_hosts='auto'`); each field's meaning written
  there (`python -m rlver_jax.fields --config=configs/ppo.py` lists them)."""
  if arg not in VARIANTS:
    raise ValueError(f"unknown config variant {arg!r}; use '' or 'think'")
  c = sections.config_dict(sections.TrainRun())
  c.rollout.thinking = arg == "think"
  # The PPO ratio's old log-probs: the sampler's (verl's bypass mode), measured every step
  # (rl.log_mismatch). `python -m bench.mismatch --layers=8` (bf16, a Qwen2.5-0.5B shape of 8
  # layers, XLA:CPU, unmoved weights): the update's own forward lies nearer the sampler's
  # log-probs (|d log p| 0.046 on average, 0.4% of ratios outside [0.8, 1.2]) than the
  # learner's forward-only pass that `learner` takes (0.072, 2.0%; clip_frac 0 against 1.4%:
  # 0 in its first update, which takes its own log-probs, 2.7% in its second): the compiler
  # rounds a gradient program's forward and a forward-only program differently.
  c.rl.old_logprobs = "sampler"
  # Sampler groups: the fewest hosts whose plan fits 90% of a chip's memory, planned at
  # start-up on a multi-host slice (one host, or chips that report no memory: 1). Qwen2.5-72B
  # at 8k on a v5p-128 needs 2: a host's own chips hold the bf16 copy whole, and the update
  # peaks at 94.2 GiB of 95 (`python -m rlver_jax.plan --config=configs/ppo.py
  # --topology=v5p-128 --model=qwen2.5-72b --seq_len=8192`: 58.4 / 77.3 GiB with 2).
  c.rollout.sampler_hosts = "auto"
  return c


def planned_memory(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """What the memory plan (`python -m rlver_jax.plan --batch=8`) assumed for Qwen2.5-7B on
  8 chips: updates, value and reference passes in micro-batches of 8 sequences (one per
  chip: 32 dialogues = 4 accumulated), each decoder layer rematerialised in full."""
  c.optim.grad_accum = 4
  c.policy.remat_policy = "full"
  return c


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  return planned_memory(base_config(arg))
