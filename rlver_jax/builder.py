"""Config to objects: every model, sampler, simulated user, loss, optimizer and rollout
setting that training, evaluation, retention and generation build, in one place.

A new config knob is read here once; the entry points (trainer, eval,
retention, generate) only run loops over what this module hands them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from absl import logging
from jax.sharding import Mesh

from models import partitioning, pretrained, qwen2
from models.chat import ChatFormatter
from models.sampler import Sampler
from rl import learner as learner_lib
from rl import step as step_lib
from rl import system_prompts, updates
from rl.losses import LossConfig
from rl.rollout_config import RolloutConfig
from rlver_jax import multihost, simulator_factory
from sim_user.simulator import SimulatedUser


def loss_config(config) -> LossConfig:
  rl = config.rl  # checked by config_checks.check_train_config
  return LossConfig(
      advantage="gae" if rl.algorithm == "ppo" else "grpo", gamma=rl.gamma, lam=rl.lam,
      whiten_advantages=rl.whiten_advantages, grpo_normalize_std=rl.grpo_normalize_std,
      clip_ratio=rl.clip_ratio, clip_ratio_high=rl.clip_ratio_high, dual_clip=rl.dual_clip,
      value_clip=rl.value_clip, entropy_coef=rl.entropy_coef, kl_coef=rl.kl_coef,
      kl_estimator=rl.kl_estimator, kl_in_reward=rl.kl_in_reward, loss_agg=rl.loss_agg,
      temperature=config.rollout.temperature)


def optim_config(config, lr: float) -> learner_lib.OptimConfig:
  o = config.optim
  return learner_lib.OptimConfig(
      lr=lr, warmup_steps=o.warmup_steps, schedule=o.schedule, total_steps=config.steps,
      weight_decay=o.weight_decay, grad_clip=o.grad_clip)


def _system_prompt(setting: str, knob: str, language: str, thinking: bool) -> str:
  """The policy's system prompt for a preset name or literal text, logged once."""
  prompt = system_prompts.resolve(setting, language=language, thinking=thinking)
  logging.info("policy system prompt (%s=%r): %r", knob, setting, prompt)
  return prompt


def train_rollout_config(config) -> RolloutConfig:
  """How one step's dialogues are collected. `rollout.off_policy_steps` is not among them: it
  is when they are collected, the trainer's affair (`rlver_jax/off_policy.py`)."""
  r = config.rollout
  return RolloutConfig(
      samples_per_profile=r.samples_per_profile,
      system_prompt=_system_prompt(r.system_prompt, "rollout.system_prompt",
                                   config.sim_user.language, r.thinking),
      thinking=r.thinking, format_penalty_reward=r.format_penalty_reward,
      max_new_tokens=r.max_new_tokens, max_dialogue_tokens=r.max_dialogue_tokens,
      temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, reward=config.rl.reward,
      engine=r.engine)


def eval_rollout_config(config) -> RolloutConfig:
  """One dialogue per profile, no token budget: the benchmark's settings."""
  e = config.eval
  return RolloutConfig(
      samples_per_profile=1,
      system_prompt=_system_prompt(e.system_prompt, "eval.system_prompt",
                                   config.sim_user.language, e.thinking),
      thinking=e.thinking, max_new_tokens=e.max_new_tokens, max_dialogue_tokens=10**9,
      temperature=e.temperature, top_p=e.top_p, top_k=e.top_k, engine=e.engine)


def simulated_user(config, mesh: Mesh | None) -> SimulatedUser:
  """The `sim_user` section's simulated user, after one health check (a dead one fails fast)."""
  user = simulator_factory.make_simulated_user(config.sim_user, mesh, seed=config.seed)
  user.check_health()
  return user


def inference_policy(config, mesh: Mesh | None) -> pretrained.Policy:
  """The `policy` section's checkpoint with tokenizer, formatter and sampler, for generation.

  An empty `policy.param_dtype` stores the weights in the compute dtype.
  """
  return pretrained.load_policy(config.policy.checkpoint, dtype=config.policy.dtype,
                                param_dtype=config.policy.param_dtype or None, mesh=mesh)


def generation_policy(checkpoint: str, dtype: str, mesh_axes: dict | None,
                      stops: Sequence[str], require_chat_template: bool) -> pretrained.Policy:
  """A checkpoint for the generate CLI, on a mesh of `mesh_axes` (None: one device)."""
  mesh = partitioning.make_mesh(mesh_axes) if mesh_axes else None
  return pretrained.load_policy(checkpoint, dtype=dtype, mesh=mesh, stops=stops,
                                require_chat_template=require_chat_template)


@dataclasses.dataclass
class TrainingModels:
  """What a training run learns with and samples from."""
  tokenizer: object
  formatter: ChatFormatter
  policy: learner_lib.Learner
  policy_optim: learner_lib.OptimConfig
  critic: learner_lib.Learner | None  # PPO only
  critic_optim: learner_lib.OptimConfig | None
  reference: learner_lib.Learner | None  # with a KL penalty only
  sampler: Sampler  # the policy's weights on this host's local mesh


def training_models(config, policy_path: str, loss_cfg: LossConfig,
                    hosts: multihost.Hosts) -> TrainingModels:
  """Policy, critic (PPO) and reference (KL) learners on the training mesh, and the sampler;
  the policy (and by default the critic) from checkpoint directory `policy_path`."""
  tokenizer = pretrained.load_tokenizer(policy_path)
  load = dict(dtype=config.policy.dtype, param_dtype=config.policy.param_dtype,
              mesh=hosts.train_mesh, remat=config.policy.remat_policy if config.policy.remat else "none",
              attention=config.policy.attention)
  model = qwen2.from_pretrained(policy_path, **load)
  policy_optim = optim_config(config, config.optim.actor_lr)
  policy = learner_lib.Learner(model, learner_lib.make_optimizer(policy_optim),
                               updates.policy_loss, loss_cfg, hosts.train_mesh)
  critic = critic_optim = None
  if config.rl.algorithm == "ppo":
    value_model = qwen2.value_model_from_pretrained(config.critic.checkpoint or policy_path,
                                                    **load)
    critic_optim = optim_config(config, config.optim.critic_lr)
    critic = learner_lib.Learner(value_model, learner_lib.make_optimizer(critic_optim),
                                 updates.critic_loss, loss_cfg, hosts.train_mesh,
                                 metric_prefix="critic_")
  reference = None
  if config.rl.kl_coef:
    reference = learner_lib.Learner(
        qwen2.from_pretrained(policy_path, **{**load, "remat": False}), mesh=hosts.train_mesh)
  sampler = Sampler(hosts.local_model(model), stop_token_ids=pretrained.stop_token_ids(
                        tokenizer, eos_token_id=model.config.eos_token_id),
                    pad_id=tokenizer.pad_token_id or 0, mesh=hosts.local_mesh,
                    sampling_dtype=config.rollout.sampling_dtype or None,
                    sampling_layout=config.rollout.sampling_layout)
  return TrainingModels(tokenizer=tokenizer, formatter=ChatFormatter(tokenizer), policy=policy,
                        policy_optim=policy_optim, critic=critic, critic_optim=critic_optim,
                        reference=reference, sampler=sampler)


def algorithm_step(config, loss_cfg: LossConfig, models: TrainingModels, hosts: multihost.Hosts,
                   turns) -> step_lib.AlgorithmStep:
  """The PPO/GRPO step of `models`' learners: their updates' schedule, and the global batch
  collated over `hosts`; `turns` (`off_policy.DeviceTurns`) shares the devices with a
  rollout collected beside the update."""
  o = config.optim
  step_config = step_lib.StepConfig(
      ppo_epochs=o.ppo_epochs, num_minibatches=o.num_minibatches, grad_accum=o.grad_accum,
      data_parallel=hosts.train_data_parallel_size, thinking=config.rollout.thinking,
      dialogues=config.batch_size * config.rollout.samples_per_profile,
      max_skipped_updates=config.max_skipped_updates, policy_optim=models.policy_optim,
      critic_optim=models.critic_optim)
  pad_id = models.tokenizer.pad_token_id or 0
  return step_lib.AlgorithmStep(
      models.policy, models.critic, models.reference, loss_cfg, step_config,
      collate=lambda samples, batch_multiple: hosts.collate(samples, batch_multiple, pad_id),
      turns=turns)
