"""The RLVER training loop: rollouts against the simulated user, PPO or GRPO updates.

Per step: sample a batch of profiles (a seeded order that survives restarts),
run the dialogues, score them, compute values / reference logprobs where
the algorithm needs them, advantages, then `ppo_epochs` passes of
mini-batch updates (with gradient accumulation). Orbax checkpoints hold the
policy, critic, optimizer states, step and data position; a restarted run
resumes from the latest one. Metrics go to W/metrics.jsonl and TensorBoard,
the reward curve to W/reward_curve.png, the final policy to W/export.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from tqdm import tqdm

from models import qwen2
from models.chat import ChatFormatter
from models.sampler import Sampler
from rl import losses
from rl import rollout as rollout_lib
from rl import train_step
from rlver_jax import metrics as metrics_lib
from rlver_jax import policy as policy_lib
from rlver_jax import multihost, sharding, simulator_factory, tiny
from sim_user import profiles as profiles_lib


class TrainingError(RuntimeError):
  pass


class ProfileOrder:
  """Epoch-wise seeded permutations of the profiles; `position` is all the state there is."""

  def __init__(self, num_profiles: int, seed: int, position: int = 0):
    self.num_profiles, self.seed, self.position = num_profiles, seed, position

  def take(self, count: int) -> list[int]:
    out = []
    while len(out) < count:
      epoch, offset = divmod(self.position, self.num_profiles)
      order = np.random.RandomState(self.seed + epoch).permutation(self.num_profiles)
      out.append(int(order[offset]))
      self.position += 1
    return out


def _require(value, message):
  if not value:
    raise ValueError(message)
  return value


def resolve_policy_checkpoint(config) -> str:
  if config.policy.tiny_init:
    path = os.path.join(config.workdir, "init_policy")
    if jax.process_index() == 0 and not os.path.exists(os.path.join(path, "config.json")):
      tiny.write_checkpoint(path, seed=config.seed)
    multihost.barrier("tiny init policy written")  # the other hosts read process 0's files
    return path
  return _require(config.policy.checkpoint,
                  "no policy checkpoint: set --config.policy.checkpoint=/path/to/Qwen2.5-7B-Instruct "
                  "(an HF directory with config.json, safetensors and tokenizer files)")


def loss_config(config) -> train_step.LossConfig:
  rl = config.rl
  if rl.algorithm not in ("ppo", "grpo"):
    raise ValueError(f"rl.algorithm={rl.algorithm!r}; expected ppo or grpo")
  if rl.loss_agg not in losses.AGGREGATIONS:
    raise ValueError(f"rl.loss_agg={rl.loss_agg!r}; expected one of {losses.AGGREGATIONS}")
  return train_step.LossConfig(
      advantage="gae" if rl.algorithm == "ppo" else "grpo", gamma=rl.gamma, lam=rl.lam,
      whiten_advantages=rl.whiten_advantages, grpo_normalize_std=rl.grpo_normalize_std,
      clip_ratio=rl.clip_ratio, clip_ratio_high=rl.clip_ratio_high, dual_clip=rl.dual_clip,
      value_clip=rl.value_clip, entropy_coef=rl.entropy_coef, kl_coef=rl.kl_coef,
      kl_estimator=rl.kl_estimator, kl_in_reward=rl.kl_in_reward, loss_agg=rl.loss_agg,
      temperature=config.rollout.temperature)


def optim_config(config, lr: float) -> train_step.OptimConfig:
  o = config.optim
  updates_per_step = o.ppo_epochs * o.num_minibatches
  return train_step.OptimConfig(
      lr=lr, warmup_steps=o.warmup_steps * updates_per_step, schedule=o.schedule,
      total_steps=config.steps * updates_per_step, weight_decay=o.weight_decay,
      grad_clip=o.grad_clip, grad_accum=o.grad_accum)


def _split(batch: dict, parts: int) -> list[dict]:
  rows = len(batch["input_ids"])
  if rows % parts:
    raise ValueError(f"{rows} rows do not split into {parts} mini/micro-batches")
  size = rows // parts
  return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(parts)]


class Trainer:

  def __init__(self, config):
    self.config = config
    _require(config.workdir, "no workdir: set --config.workdir=DIR")
    os.makedirs(config.workdir, exist_ok=True)
    sharding.maybe_initialize_distributed()
    self.mesh = sharding.make_mesh(dict(config.mesh))
    self.hosts = multihost.Hosts(self.mesh, dict(config.mesh))
    self.loss_cfg = loss_config(config)
    self.rollout_cfg = rollout_lib.RolloutConfig(
        samples_per_profile=config.rollout.samples_per_profile,
        system_prompt=config.rollout.system_prompt, thinking=config.rollout.thinking,
        format_penalty_reward=config.rollout.format_penalty_reward,
        max_new_tokens=config.rollout.max_new_tokens,
        max_dialogue_tokens=config.rollout.max_dialogue_tokens,
        temperature=config.rollout.temperature, top_p=config.rollout.top_p,
        top_k=config.rollout.top_k, reward=config.rl.reward)
    if config.rl.algorithm == "grpo" and config.rl.reward != "final":
      raise ValueError("rl.reward='turn' is a PPO ablation; GRPO normalises final rewards")
    if config.batch_size % config.rollout.samples_per_profile:
      raise ValueError(f"batch_size={config.batch_size} is not a multiple of "
                       f"rollout.samples_per_profile={config.rollout.samples_per_profile}")

    self.profiles = profiles_lib.load_profiles(_require(
        config.data.train_profiles,
        "no training profiles: set --config.data.train_profiles=FILE.jsonl "
        "(RLVER's train_profile.jsonl, or sim_user/data/demo_profiles.jsonl)"))
    policy_path = resolve_policy_checkpoint(config)
    from transformers import AutoTokenizer
    self.tokenizer = AutoTokenizer.from_pretrained(policy_path)
    self.formatter = ChatFormatter(self.tokenizer)
    load = dict(dtype=config.policy.dtype, param_dtype=config.policy.param_dtype, mesh=self.mesh,
                remat=config.policy.remat)
    policy = qwen2.from_pretrained(policy_path, **load)
    self.policy = train_step.Learner(policy, train_step.make_optimizer(
        optim_config(config, config.optim.actor_lr)), train_step.policy_update, self.loss_cfg,
        self.mesh)
    self.critic = None
    if config.rl.algorithm == "ppo":
      critic = qwen2.value_model_from_pretrained(config.critic.checkpoint or policy_path, **load)
      self.critic = train_step.Learner(critic, train_step.make_optimizer(
          optim_config(config, config.optim.critic_lr)), train_step.critic_update, self.loss_cfg,
          self.mesh)
    self.reference = None
    if config.rl.kl_coef:
      reference = qwen2.from_pretrained(policy_path, **{**load, "remat": False})
      self.reference = train_step.Learner(reference, mesh=self.mesh)
    self.sampler = Sampler(self.hosts.local_model(policy), stop_token_ids=policy_lib.stop_token_ids(
                               self.tokenizer, eos_token_id=policy.config.eos_token_id),
                           pad_id=self.tokenizer.pad_token_id or 0, mesh=self.hosts.local_mesh)
    self.user = simulator_factory.make_simulated_user(config.sim_user, self.hosts.local_mesh)
    self.batch_multiple = self.hosts.train_data_parallel_size * (
        config.optim.num_minibatches * config.optim.grad_accum)

    self.checkpoints = ocp.CheckpointManager(
        os.path.abspath(os.path.join(config.workdir, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=config.checkpoint.keep,
                                             enable_async_checkpointing=False))
    self.step, self.order, self.skipped_updates = 0, ProfileOrder(len(self.profiles), config.seed), 0
    self._restore()
    self.metrics = metrics_lib.MetricsWriter(config.workdir, resume_step=self.step)

  # Checkpoints.

  def _state(self) -> dict:
    state = {"policy": self.policy.params, "policy_opt": self.policy.opt_state}
    if self.critic is not None:
      state.update(critic=self.critic.params, critic_opt=self.critic.opt_state)
    return state

  def _save(self) -> None:
    meta = {"step": self.step, "data_position": self.order.position, "seed": self.config.seed,
            "skipped_updates": self.skipped_updates}
    args = {k: ocp.args.StandardSave(v) for k, v in self._state().items()}
    self.checkpoints.save(self.step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args))
    self.checkpoints.wait_until_finished()

  def _restore(self) -> None:
    latest = self.checkpoints.latest_step()
    if latest is None:
      return
    targets = {k: ocp.args.StandardRestore(v) for k, v in self._state().items()}
    restored = self.checkpoints.restore(
        latest, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **targets))
    meta = restored["meta"]
    self.policy.params, self.policy.opt_state = restored["policy"], restored["policy_opt"]
    if self.critic is not None:
      self.critic.params, self.critic.opt_state = restored["critic"], restored["critic_opt"]
    self.step = meta["step"]
    self.order.position = meta["data_position"]
    self.skipped_updates = meta["skipped_updates"]
    logging.info("resumed from %s at step %d", self.checkpoints.directory, self.step)

  # One step.

  def train_step(self) -> dict:
    config = self.config
    step = self.step + 1
    num_profiles = config.batch_size // config.rollout.samples_per_profile
    chosen = [self.profiles[i] for i in self.order.take(num_profiles)]
    share = self.hosts.share(len(chosen))  # this host's dialogues
    sim_counts_before = dict(self.user.metrics)
    self.sampler.update_weights(self.hosts.local_params(self.policy.params))
    rollout = rollout_lib.collect(self.sampler, self.formatter, self.user,
                                  chosen[share.start:share.stop], self.rollout_cfg,
                                  seed=config.seed * 100_003 + step, first_profile=share.start)
    if step == config.crash_at_step:
      logging.warning("crash_at_step=%d: killing the process mid-step", step)
      os.kill(os.getpid(), 9)
    if not self.hosts.total(len(rollout.samples)):  # a host may have dropped all of its own
      raise TrainingError(f"step {step}: every dialogue was dropped by the simulator")

    start = time.perf_counter()
    batch = self.hosts.collate(rollout.samples, self.batch_multiple,
                               pad_id=self.tokenizer.pad_token_id or 0)
    if self.critic is not None:
      batch["old_values"] = multihost.to_host(self.critic.apply(train_step.critic_values, batch))
    if self.reference is not None:
      batch["ref_logprobs"] = multihost.to_host(self.reference.apply(
          train_step.sequence_logprobs, batch, temperature=self.loss_cfg.temperature))
    batch = train_step.compute_advantages(batch, self.loss_cfg)
    update_metrics = []
    arrays = {k: v for k, v in batch.items() if k not in ("scores", "groups", "token_rewards")}
    for _ in range(config.optim.ppo_epochs):
      for minibatch in _split(arrays, config.optim.num_minibatches):
        for micro in _split(minibatch, config.optim.grad_accum):
          m = self.policy.update(micro)
          if self.critic is not None:
            m.update(self.critic.update(micro))
          update_metrics.append(jax.device_get(m))
    train_seconds = time.perf_counter() - start

    skipped = sum(1 for m in update_metrics
                  if m["finite"] < 1 or m.get("critic_finite", 1.0) < 1)
    if skipped:
      self.skipped_updates += skipped
      logging.warning("step %d: %d update(s) with non-finite loss or gradient skipped "
                      "(%d so far)", step, skipped, self.skipped_updates)
      if self.skipped_updates > config.max_skipped_updates:
        raise TrainingError(f"{self.skipped_updates} non-finite updates skipped, more than "
                            f"max_skipped_updates={config.max_skipped_updates}; stopping")
    finite = [m for m in update_metrics if m["finite"] >= 1] or update_metrics
    mean = lambda key: float(np.mean([m[key] for m in finite])) if key in finite[0] else 0.0
    out = dict(rollout.metrics)
    out.update({
        "kl": mean("kl"), "approx_kl": mean("approx_kl"), "entropy": mean("entropy"),
        "clip_frac": mean("clip_frac"), "pg_loss": mean("pg_loss"),
        "value_loss": mean("value_loss"), "grad_norm": mean("grad_norm"),
        "skipped_updates": skipped, "time/train": train_seconds,
        "tokens_per_s": rollout.metrics["tokens/generated"] / max(
            rollout.metrics["time/rollout"], 1e-9),
        "samples": len(rollout.samples),
    })
    for key, count in self.user.metrics.items():  # this step's simulator events
      out[key] = count - sim_counts_before.get(key, 0)
    self.step = step
    return self.hosts.reduce_step_metrics(out, rollout)

  def run(self) -> None:
    config = self.config
    bar = tqdm(total=config.steps, initial=self.step, unit="step", desc="train",
               disable=not self.hosts.primary)
    while self.step < config.steps:
      step_start = time.perf_counter()
      step_metrics = self.train_step()
      step_metrics["time/step"] = time.perf_counter() - step_start
      self.metrics.write(self.step, step_metrics)
      if self.step % config.checkpoint.every == 0 or self.step == config.steps:
        self._save()
        metrics_lib.plot_curves(self.metrics.path, os.path.join(config.workdir, "reward_curve.png"))
      bar.update(1)
      bar.set_postfix(reward=f"{step_metrics['reward/mean']:.2f}",
                      emotion=f"{step_metrics['emotion/final_mean']:.1f}",
                      s_per_step=f"{step_metrics['time/step']:.1f}")
      if self.step % config.log_every == 0:
        logging.info("step %d: reward %.3f, final emotion %.1f, turns %.1f, %.1f tok/s",
                     self.step, step_metrics["reward/mean"], step_metrics["emotion/final_mean"],
                     step_metrics["turns/mean"], step_metrics["tokens_per_s"])
    bar.close()
    self.metrics.close()
    plot = metrics_lib.plot_curves(self.metrics.path,
                                   os.path.join(config.workdir, "reward_curve.png"))
    if config.checkpoint.export_at_end:
      export = os.path.join(config.workdir, "export")
      qwen2.save_pretrained(self.policy.model(), export)
      if jax.process_index() == 0:
        self.tokenizer.save_pretrained(export)
      logging.info("policy exported to %s", export)
    logging.info("done: %d steps, metrics %s, plot %s", self.step, self.metrics.path, plot)
