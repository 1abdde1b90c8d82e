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

from configs import common

VARIANTS = ("", "think")  # --config=configs/ppo.py[:variant]; tests/test_recipes.py runs each


def base_config(arg: str = "") -> ml_collections.ConfigDict:
  if arg not in VARIANTS:
    raise ValueError(f"unknown config variant {arg!r}; use '' or 'think'")
  thinking = arg == "think"
  c = ml_collections.ConfigDict()
  c.workdir = ""  # where the run writes checkpoints, metrics and dialogues (W); resumes from it
  c.seed = 0  # profile order, sampling draws, the tiny policy's initialisation
  c.steps = 1000  # training steps (each: rollout, then updates)
  c.batch_size = 32  # profiles per step; dialogues = batch_size x rollout.samples_per_profile
  c.log_every = 1  # steps between progress lines in the log
  c.log_dialogues_every = 20  # steps between whole dialogues in W/dialogues.jsonl (0: never)

  c.mesh = common.mesh_config()

  c.policy = common.policy_config()

  c.critic = ml_collections.ConfigDict()
  c.critic.checkpoint = ""  # where the critic starts; default: the policy's checkpoint

  c.data = ml_collections.ConfigDict()
  c.data.train_profiles = ""  # the training profiles, e.g. RLVER's train_profile.jsonl

  c.sim_user = common.sim_user_config(rules="rlver_train")
  # A step where more than this share of dialogues failed in the simulator is not trained on;
  # this many such steps in a row stop the run.
  c.sim_user.max_failed_share = 0.5  # more of a step's dialogues failed: not trained on
  c.sim_user.max_failed_steps_in_a_row = 3  # steps in a row over max_failed_share that stop the run

  c.rollout = ml_collections.ConfigDict()
  c.rollout.samples_per_profile = 1  # dialogues per profile per step (GRPO's group size)
  # A preset of rl/system_prompts.py ("rlver": the paper's prompt for rollout.thinking and
  # sim_user.language; "sage") or the prompt itself.
  c.rollout.system_prompt = "rlver"  # the policy's system prompt: a preset or the text
  c.rollout.thinking = thinking  # reason in <think>...</think> before each reply
  c.rollout.format_penalty_reward = 0.0  # thinking: the reward of a badly formatted turn
  c.rollout.max_new_tokens = 5000  # the policy's tokens per turn
  c.rollout.max_dialogue_tokens = 10000  # the policy's tokens per dialogue; beyond, it ends
  c.rollout.temperature = 1.0  # the policy's sampling temperature (the loss's logprobs use it)
  c.rollout.top_p = 1.0  # nucleus sampling (1: off)
  c.rollout.top_k = 0  # top-k sampling (0: off)
  # continuous: batching across turns (rl/engine.py); lockstep: one sampler call per round
  c.rollout.engine = "continuous"  # continuous | lockstep
  # The sampler decodes from its own copy of the policy, refreshed in place after each update:
  # "bfloat16", or "" to decode from the fp32 training weights (cast on every step).
  c.rollout.sampling_dtype = "bfloat16"  # the sampler's copy of the weights: bfloat16 | ""
  # That copy's layout: "train" shards it over fsdp like the training weights (a decode step
  # gathers bf16 shards); "decode" keeps it whole on every chip of a host (no gather per token,
  # but +10.6 GiB per chip for 7B on a v5p-16). `python -m rlver_jax.plan --config=...`
  # `--topology=...` shows both, and which is faster where it fits.
  c.rollout.sampling_layout = "train"  # that copy's layout: train | decode
  # 1: step n+1's dialogues are collected (in a background thread) with the weights before
  # step n's update while that update runs: faster steps, samples one update stale (the
  # losses' ratio uses the sampler's log-probs). One process only. 0: on-policy, as published.
  c.rollout.off_policy_steps = 0  # updates the rollout runs ahead of training: 0 | 1

  c.rl = ml_collections.ConfigDict()
  c.rl.algorithm = "ppo"  # ppo (GAE with a critic) | grpo (group-normalised, no critic)
  c.rl.gamma = 1.0  # GAE discount
  c.rl.lam = 1.0  # GAE lambda
  c.rl.whiten_advantages = True  # PPO: whiten the batch's advantages
  c.rl.grpo_normalize_std = True  # GRPO: divide by the group's reward std, not only centre
  c.rl.clip_ratio = 0.2  # PPO's clip of the probability ratio: 1 +- this
  # The ratio's upper clip is 1 + this (None: clip_ratio).
  c.rl.clip_ratio_high = ml_collections.FieldReference(None, field_type=float)
  # A negative-advantage token's loss is capped at this x |advantage| (verl's clip_ratio_c;
  # None: off).
  c.rl.dual_clip = ml_collections.FieldReference(3.0, field_type=float)
  c.rl.value_clip = 0.5  # the critic's loss also clips its values to the rollout's +- this
  c.rl.entropy_coef = 0.001  # weight of the entropy bonus
  c.rl.kl_coef = 0.0  # weight of the KL to the initial policy; 0 (released): no reference pass
  c.rl.kl_estimator = "k3"  # k1 | k2 | k3
  c.rl.kl_in_reward = False  # the KL as a per-token reward penalty, not a loss term
  c.rl.loss_agg = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean
  c.rl.reward = "final"  # final (the last emotion) | turn (each reply's change; an ablation)

  c.optim = ml_collections.ConfigDict()
  c.optim.actor_lr = 1e-6  # the policy's learning rate (AdamW)
  c.optim.critic_lr = 5e-6  # the critic's learning rate (PPO)
  c.optim.warmup_steps = 50  # steps of linear learning-rate warm-up from 0
  c.optim.schedule = "constant"  # after warm-up: constant | cosine (decays to 0 at `steps`)
  c.optim.weight_decay = 0.01  # AdamW weight decay
  c.optim.grad_clip = 1.0  # global gradient norm clip
  c.optim.ppo_epochs = 1  # passes over a step's batch
  c.optim.num_minibatches = 1  # updates per pass (the batch split in this many)
  c.optim.grad_accum = 1  # micro-batches accumulated per update (memory, not maths)

  c.checkpoint = ml_collections.ConfigDict()
  # Saving is asynchronous (the files are written while the next step runs). A 7B PPO state
  # (policy, critic, Adam moments) is ~180 GB, so the recipes save by time; with every=1 a run
  # killed mid-step redoes only that step.
  c.checkpoint.every = 0  # steps between checkpoints (0: by time only)
  c.checkpoint.every_minutes = 10.0  # minutes between checkpoints (0: by steps only)
  c.checkpoint.keep = 3  # checkpoints kept (older ones are deleted)
  c.checkpoint.export_at_end = True  # write the policy as an HF checkpoint to W/export at the end

  c.max_skipped_updates = 10  # non-finite steps tolerated before the run stops
  c.resume_mismatch_ok = False  # resume even though the config differs from W/config.json
  # Compiled programs are kept here for the next run (on a pod: a path every host reads); "": off.
  c.compile_cache_dir = common.compile_cache_dir()
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
