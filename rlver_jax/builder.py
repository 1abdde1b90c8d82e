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

import jax
from absl import logging
from jax.sharding import Mesh

from models import partitioning, pretrained, qwen2, slice_meshes
from models.chat import ChatFormatter
from models.sampler import Sampler
from models.slice_meshes import SliceMeshes
from rl import learner as learner_lib
from rl import step as step_lib
from rl import system_prompts, updates
from rl.rollout_config import RolloutConfig
from rlver_jax import multihost, simulator_factory, tiny
from rlver_jax import workdir as workdir_lib
from sim_user.simulator import SimulatedUser


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
  """A rollout that decodes as the `eval` section (its system prompt resolved to the text):
  one dialogue per profile, no token budget."""
  e = config.eval
  return RolloutConfig.decoding_as(
      e, samples_per_profile=1, max_dialogue_tokens=10**9,
      system_prompt=_system_prompt(e.system_prompt, "eval.system_prompt",
                                   config.sim_user.language, e.thinking))


def simulated_user(config, mesh: Mesh | None) -> SimulatedUser:
  """The `sim_user` section's simulated user, after one health check (a dead one fails fast)."""
  user = simulator_factory.make_simulated_user(config.sim_user, mesh, seed=config.seed)
  user.check_health()
  return user


def policy_path(config) -> str:
  """The checkpoint directory a training run's policy starts from: `policy.checkpoint`, or with
  `policy.tiny_init` (the demo) its tiny policy, written on the run's first start."""
  return tiny.demo_policy(config) if config.policy.tiny_init else config.policy.checkpoint


def inference_policy(config, mesh: Mesh | None) -> pretrained.Policy:
  """The `policy` section's checkpoint with tokenizer, formatter and sampler, for generation.

  An empty `policy.param_dtype` stores the weights in the compute dtype.
  """
  workdir_lib.refuse_training_workdir(config.policy.checkpoint, "policy.checkpoint")
  return pretrained.load_policy(config.policy.checkpoint, dtype=config.policy.dtype,
                                param_dtype=config.policy.param_dtype or None, mesh=mesh)


def generation_policy(checkpoint: str, dtype: str, mesh_axes: dict | None,
                      stops: Sequence[str], require_chat_template: bool) -> pretrained.Policy:
  """A checkpoint for the generate CLI, on a mesh of `mesh_axes` (None: one device)."""
  mesh = partitioning.make_mesh(mesh_axes) if mesh_axes else None
  return pretrained.load_policy(checkpoint, dtype=dtype, mesh=mesh, stops=stops,
                                require_chat_template=require_chat_template)


def run_meshes(config, kv_heads: int, hosts_per_group: int, devices=None,
               process: int | None = None) -> SliceMeshes:
  """The training run's meshes (`models/slice_meshes.py`): training over every device of
  `devices` (default: all), sampling on groups of `hosts_per_group` hosts in
  `rollout.sampling_layout` (a model of `kv_heads` kv heads). The one place the trainer and
  the planner make them; `process` (default: this one) picks the sampler group."""
  devices = list(jax.devices() if devices is None else devices)
  train_axes = dataclasses.asdict(config.mesh)
  groups = len({d.process_index for d in devices}) // hosts_per_group
  axes = slice_meshes.sampler_axes(config.rollout.sampling_layout, train_axes, max(groups, 1),
                                   len(devices) // max(groups, 1), kv_heads)
  return slice_meshes.slice_meshes(train_axes, axes, hosts_per_group, devices, process)


@dataclasses.dataclass
class Learners:
  """The learners a training step updates or reads (`rl.step.AlgorithmStep`)."""
  policy: learner_lib.Learner
  critic: learner_lib.Learner | None  # PPO only
  reference: learner_lib.Learner | None  # with a KL penalty only


def learners(config, make_model, mesh: Mesh, *, abstract: bool = False) -> Learners:
  """Policy, critic (PPO: `rl.uses_critic`) and reference (a KL penalty: `rl.uses_reference`)
  learners on `mesh`. `make_model(model_cls, role, remat)` makes each model: loaded from a
  checkpoint (the trainer) or abstract (`nnx.eval_shape`, the planner, with `abstract`:
  `Learner.abstract` then places abstract arrays). The reference is frozen, without remat."""
  make = learner_lib.Learner.abstract if abstract else learner_lib.Learner
  remat, optim = config.policy.remat_name, config.optim
  policy_loss = functools.partial(updates.policy_loss, temperature=config.rollout.temperature)
  policy = make(make_model(qwen2.Qwen2, "policy", remat),
                learner_lib.make_optimizer(optim, optim.actor_lr), policy_loss, config.rl, mesh)
  critic = None
  if config.rl.uses_critic:
    critic = make(make_model(qwen2.Qwen2Value, "critic", remat),
                  learner_lib.make_optimizer(optim, optim.critic_lr), updates.critic_loss,
                  config.rl, mesh, metric_prefix="critic_")
  reference = None
  if config.rl.uses_reference:
    reference = make(make_model(qwen2.Qwen2, "reference", "none"), mesh=mesh)
  return Learners(policy=policy, critic=critic, reference=reference)


@dataclasses.dataclass
class TrainingModels:
  """What a training run learns with and samples from."""
  tokenizer: object
  formatter: ChatFormatter
  learners: Learners
  sampler: Sampler  # decodes on this host's sampler group's mesh

  @property
  def policy(self) -> learner_lib.Learner:
    return self.learners.policy

  @property
  def critic(self) -> learner_lib.Learner | None:
    return self.learners.critic


def training_models(config, policy_path: str, hosts: multihost.Hosts,
                    tokenizer) -> TrainingModels:
  """The learners on the training mesh and the sampler on this host's sampler group's mesh;
  the policy (and by default the critic) from checkpoint directory `policy_path`, whose
  checked tokenizer (`pretrained.load_tokenizer`) is `tokenizer`."""
  p = config.policy

  def load(model_cls, role, remat):
    path = (config.critic.checkpoint or policy_path) if role == "critic" else policy_path
    loader = qwen2.value_model_from_pretrained if model_cls is qwen2.Qwen2Value else (
        qwen2.from_pretrained)
    return loader(path, dtype=p.dtype, param_dtype=p.param_dtype, mesh=hosts.train_mesh,
                  remat=remat, attention=p.attention)

  learner_set = learners(config, load, hosts.train_mesh)
  policy = learner_set.policy.model()
  sampler = Sampler(policy, stop_token_ids=pretrained.stop_token_ids(
                        tokenizer, eos_token_id=policy.config.eos_token_id),
                    pad_id=tokenizer.pad_token_id or 0, meshes=hosts.meshes,
                    sampling_dtype=config.rollout.sampling_dtype or None,
                    sampling_layout=config.rollout.sampling_layout)
  return TrainingModels(tokenizer=tokenizer, formatter=ChatFormatter(tokenizer),
                        learners=learner_set, sampler=sampler)


def algorithm_step(config, models: TrainingModels, hosts: multihost.Hosts,
                   turns) -> step_lib.AlgorithmStep:
  """The PPO/GRPO step of `models`' learners: the `optim` section's updates and schedule over
  the run's steps, and the global batch collated over `hosts`; `turns`
  (`off_policy.DeviceTurns`) shares the devices with a rollout collected beside the update."""
  learner_set = models.learners
  step_config = step_lib.StepConfig(
      optim=config.optim, total_steps=config.steps,
      data_parallel=hosts.train_data_parallel_size, thinking=config.rollout.thinking,
      dialogues=config.batch_size * config.rollout.samples_per_profile,
      max_skipped_updates=config.max_skipped_updates, temperature=config.rollout.temperature)
  pad_id = models.tokenizer.pad_token_id or 0
  return step_lib.AlgorithmStep(
      learner_set.policy, learner_set.critic, learner_set.reference, config.rl, step_config,
      collate=lambda samples, batch_multiple: hosts.collate(samples, batch_multiple, pad_id),
      turns=turns)
