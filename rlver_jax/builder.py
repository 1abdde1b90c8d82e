"""Config to objects: the models, sampler, simulated user, optimizers and rollout that
training, evaluation, retention and generation build from their typed runs
(`rlver_jax/sections.py`), in one place.

The sections that a room defines go to it whole (`rl` to the learners and the
step, `rollout` to the engines, `sim_user` to the simulator factory); the
entry points (trainer, eval, retention, generate) only run loops over what
this module hands them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from absl import logging
from jax.sharding import Mesh

from models import partitioning, pretrained, qwen2
from models.chat import ChatFormatter
from models.sampler import Sampler
from rl import learner as learner_lib
from rl import step as step_lib
from rl import system_prompts, updates
from rl.rollout_config import RolloutConfig
from rlver_jax import multihost, simulator_factory
from sim_user.simulator import SimulatedUser


def optim_config(config, lr: float) -> learner_lib.AdamWConfig:
  """One learner's AdamW: the `optim` section's schedule over `steps`, at rate `lr`."""
  o = config.optim
  return learner_lib.AdamWConfig(
      lr=lr, warmup_steps=o.warmup_steps, schedule=o.schedule, total_steps=config.steps,
      weight_decay=o.weight_decay, grad_clip=o.grad_clip)


def _system_prompt(setting: str, knob: str, language: str, thinking: bool) -> str:
  """The policy's system prompt for a preset name or literal text, logged once."""
  prompt = system_prompts.resolve(setting, language=language, thinking=thinking)
  logging.info("policy system prompt (%s=%r): %r", knob, setting, prompt)
  return prompt


def train_rollout_config(config) -> RolloutConfig:
  """The `rollout` section as the engines take it: its system prompt resolved to the text."""
  r = config.rollout
  return dataclasses.replace(r, system_prompt=_system_prompt(
      r.system_prompt, "rollout.system_prompt", config.sim_user.language, r.thinking))


def eval_rollout_config(config) -> RolloutConfig:
  """The `eval` section's decoding as a rollout: one dialogue per profile, no token budget,
  the benchmark's settings."""
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
  policy_optim: learner_lib.AdamWConfig
  critic: learner_lib.Learner | None  # PPO only
  critic_optim: learner_lib.AdamWConfig | None
  reference: learner_lib.Learner | None  # with a KL penalty only
  sampler: Sampler  # the policy's weights on this host's local mesh


def training_models(config, policy_path: str, hosts: multihost.Hosts) -> TrainingModels:
  """Policy, critic (PPO) and reference (KL) learners on the training mesh, and the sampler;
  the policy (and by default the critic) from checkpoint directory `policy_path`."""
  tokenizer = pretrained.load_tokenizer(policy_path)
  load = dict(dtype=config.policy.dtype, param_dtype=config.policy.param_dtype,
              mesh=hosts.train_mesh, remat=config.policy.remat_policy if config.policy.remat else "none",
              attention=config.policy.attention)
  model = qwen2.from_pretrained(policy_path, **load)
  policy_optim = optim_config(config, config.optim.actor_lr)
  policy_loss = functools.partial(updates.policy_loss, temperature=config.rollout.temperature)
  policy = learner_lib.Learner(model, learner_lib.make_optimizer(policy_optim), policy_loss,
                               config.rl, hosts.train_mesh)
  critic = critic_optim = None
  if config.rl.algorithm == "ppo":
    value_model = qwen2.value_model_from_pretrained(config.critic.checkpoint or policy_path,
                                                    **load)
    critic_optim = optim_config(config, config.optim.critic_lr)
    critic = learner_lib.Learner(value_model, learner_lib.make_optimizer(critic_optim),
                                 updates.critic_loss, config.rl, hosts.train_mesh,
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


def algorithm_step(config, models: TrainingModels, hosts: multihost.Hosts,
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
      critic_optim=models.critic_optim, temperature=config.rollout.temperature)
  pad_id = models.tokenizer.pad_token_id or 0
  return step_lib.AlgorithmStep(
      models.policy, models.critic, models.reference, config.rl, step_config,
      collate=lambda samples, batch_multiple: hosts.collate(samples, batch_multiple, pad_id),
      turns=turns)
