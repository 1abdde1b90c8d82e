"""The RLVER training loop: rollouts against the simulated user, PPO or GRPO updates.

Per step: sample `batch_size` profiles (a seeded order that survives restarts),
run `rollout.samples_per_profile` dialogues with each, score them, compute
values / reference logprobs where the algorithm needs them, advantages,
then `ppo_epochs` passes of mini-batch updates (with gradient accumulation).
A step where too many dialogues failed for infrastructure reasons is not
trained on, and too many such steps in a row stop the run. Orbax checkpoints
(written asynchronously, every `checkpoint.every` steps and/or
`checkpoint.every_minutes`) hold the policy, critic, optimizer states, step
and data position; a restarted run resumes from the latest one, with the
config saved in W/config.json. Metrics go to W/metrics.jsonl and TensorBoard,
the reward curve to W/reward_curve.png, the final policy to W/export.
"""

from __future__ import annotations

import collections
import functools
import os
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from tqdm import tqdm

from models import qwen2
from models.chat import ChatFormatter
from models.errors import RunStopped
from models.sampler import Sampler
from rl import keys
from rl import rollout as rollout_lib
from rl import system_prompts
from rl import train_step
from rlver_jax import config_checks, dialogue_log
from rlver_jax import metrics as metrics_lib
from rlver_jax import policy as policy_lib
from rlver_jax import multihost, run_config, sharding, simulator_factory, tiny
from sim_user import profiles as profiles_lib


class TrainingError(RunStopped):
  """The run cannot go on: too many non-finite updates, or no dialogue left to train on."""


class SimulatorFailing(TrainingError):
  """Too many steps in a row lost too many dialogues to simulator failures."""


class SimulatorFailureGuard:
  """Keeps a step whose dialogues mostly failed for infrastructure reasons out of training.

  A step is trainable when at most `max_share` of its dialogues failed (ended
  as failed or dropped by the simulator); `max_in_a_row` untrainable steps in a
  row mean the simulator is down, and `raise_if_down` stops the run.
  """

  def __init__(self, max_share: float, max_in_a_row: int, simulator: str, reasons_kept: int = 3):
    self.max_share, self.max_in_a_row, self.simulator = max_share, max_in_a_row, simulator
    self.in_a_row = 0
    self.recent_reasons = collections.deque(maxlen=reasons_kept)

  def trainable(self, step: int, failure_reasons: list) -> bool:
    """`failure_reasons`: each dialogue's failure reason, None where it did not fail."""
    failures = [reason for reason in failure_reasons if reason]
    share = len(failures) / max(len(failure_reasons), 1)
    if share <= self.max_share:
      self.in_a_row = 0
      return True
    self.in_a_row += 1
    self.recent_reasons.extend(failures)
    logging.warning("step %d not trained on: %d of %d dialogues failed in the simulator %s "
                    "(more than %.0f%%; %d such step(s) in a row); last: %s", step, len(failures),
                    len(failure_reasons), self.simulator, 100 * self.max_share, self.in_a_row,
                    failures[-1])
    return False

  def raise_if_down(self) -> None:
    if self.in_a_row >= self.max_in_a_row:
      raise SimulatorFailing(
          f"the simulator {self.simulator} failed more than {self.max_share:.0%} of the "
          f"dialogues in {self.in_a_row} steps in a row (sim_user.max_failed_steps_in_a_row="
          f"{self.max_in_a_row}); last failures: {'; '.join(self.recent_reasons)}")


class ProfileOrder:
  """Epoch-wise seeded permutations of the profiles; `position` is all the state there is."""

  def __init__(self, num_profiles: int, seed: int, position: int = 0):
    self.num_profiles, self.seed, self.position = num_profiles, seed, position

  def take(self, count: int) -> list[int]:
    out = []
    while len(out) < count:
      epoch, offset = divmod(self.position, self.num_profiles)
      out.append(int(self._order(epoch)[offset]))
      self.position += 1
    return out

  @functools.lru_cache(maxsize=1)
  def _order(self, epoch: int) -> np.ndarray:
    return np.asarray(keys.profile_order(self.seed, epoch, self.num_profiles))


def checkpoint_due(step: int, final_step: int, every: int, every_minutes: float,
                   seconds_since_save: float) -> bool:
  """Save after `step`? At the final step, every `every` steps and `every_minutes` after the
  last save (0 turns either rule off)."""
  return (step == final_step or (every > 0 and step % every == 0) or
          (every_minutes > 0 and seconds_since_save >= 60 * every_minutes))


def resolve_policy_checkpoint(config) -> str:
  if config.policy.tiny_init:
    path = os.path.join(config.workdir, "init_policy")
    if jax.process_index() == 0 and not os.path.exists(os.path.join(path, "config.json")):
      tiny.write_checkpoint(path, seed=config.seed)
    multihost.barrier("tiny init policy written")  # the other hosts read process 0's files
    return path
  return config.policy.checkpoint


def loss_config(config) -> train_step.LossConfig:
  rl = config.rl  # checked by config_checks.check_train_config
  return train_step.LossConfig(
      advantage="gae" if rl.algorithm == "ppo" else "grpo", gamma=rl.gamma, lam=rl.lam,
      whiten_advantages=rl.whiten_advantages, grpo_normalize_std=rl.grpo_normalize_std,
      clip_ratio=rl.clip_ratio, clip_ratio_high=rl.clip_ratio_high, dual_clip=rl.dual_clip,
      value_clip=rl.value_clip, entropy_coef=rl.entropy_coef, kl_coef=rl.kl_coef,
      kl_estimator=rl.kl_estimator, kl_in_reward=rl.kl_in_reward, loss_agg=rl.loss_agg,
      temperature=config.rollout.temperature)


def optim_config(config, lr: float) -> train_step.OptimConfig:
  o = config.optim
  return train_step.OptimConfig(
      lr=lr, warmup_steps=o.warmup_steps, schedule=o.schedule, total_steps=config.steps,
      weight_decay=o.weight_decay, grad_clip=o.grad_clip)


def _split(batch: dict, parts: int) -> list[dict]:
  rows = len(batch["input_ids"])
  if rows % parts:
    raise ValueError(f"{rows} rows do not split into {parts} mini/micro-batches")
  size = rows // parts
  return [{k: v[i * size:(i + 1) * size] for k, v in batch.items()} for i in range(parts)]


def _chunks(batch: dict, size: int, row_multiple: int) -> list[dict]:
  """Consecutive mini-batches of `size` rows (the last may have fewer), as verl's split.

  Each is padded with empty rows (loss mask 0) to a multiple of `row_multiple`.
  """
  out = []
  for start in range(0, len(batch["input_ids"]), size):
    chunk = {k: v[start:start + size] for k, v in batch.items()}
    pad = -len(chunk["input_ids"]) % row_multiple
    out.append({k: np.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1)) for k, v in chunk.items()})
  return out


class Trainer:

  def __init__(self, config):
    config_checks.check_train_config(config)
    self.config = config
    os.makedirs(config.workdir, exist_ok=True)
    self.checkpoints = ocp.CheckpointManager(
        os.path.abspath(os.path.join(config.workdir, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=config.checkpoint.keep,
                                             enable_async_checkpointing=True,
                                             cleanup_tmp_directories=True))
    run_config.check_and_save(config, config.workdir,
                              resuming=self.checkpoints.latest_step() is not None)
    sharding.maybe_initialize_distributed()
    self.mesh = sharding.make_mesh(dict(config.mesh))
    self.hosts = multihost.Hosts(self.mesh, dict(config.mesh))
    self.loss_cfg = loss_config(config)
    self.system_prompt = system_prompts.resolve(
        config.rollout.system_prompt, language=config.sim_user.language,
        thinking=config.rollout.thinking)
    logging.info("policy system prompt (rollout.system_prompt=%r): %r",
                 config.rollout.system_prompt, self.system_prompt)
    self.rollout_cfg = rollout_lib.RolloutConfig(
        samples_per_profile=config.rollout.samples_per_profile,
        system_prompt=self.system_prompt, thinking=config.rollout.thinking,
        format_penalty_reward=config.rollout.format_penalty_reward,
        max_new_tokens=config.rollout.max_new_tokens,
        max_dialogue_tokens=config.rollout.max_dialogue_tokens,
        temperature=config.rollout.temperature, top_p=config.rollout.top_p,
        top_k=config.rollout.top_k, reward=config.rl.reward, engine=config.rollout.engine)

    self.profiles = profiles_lib.load_profiles(config.data.train_profiles)
    policy_path = resolve_policy_checkpoint(config)
    self.tokenizer = policy_lib.load_tokenizer(policy_path)
    self.formatter = ChatFormatter(self.tokenizer)
    load = dict(dtype=config.policy.dtype, param_dtype=config.policy.param_dtype, mesh=self.mesh,
                remat=config.policy.remat_policy if config.policy.remat else "none",
                attention=config.policy.attention)
    policy = qwen2.from_pretrained(policy_path, **load)
    self.policy_optim = optim_config(config, config.optim.actor_lr)
    self.policy = train_step.Learner(policy, train_step.make_optimizer(self.policy_optim),
                                     train_step.policy_loss, self.loss_cfg, self.mesh)
    self.critic = None
    if config.rl.algorithm == "ppo":
      critic = qwen2.value_model_from_pretrained(config.critic.checkpoint or policy_path, **load)
      self.critic_optim = optim_config(config, config.optim.critic_lr)
      self.critic = train_step.Learner(critic, train_step.make_optimizer(self.critic_optim),
                                       train_step.critic_loss, self.loss_cfg, self.mesh,
                                       metric_prefix="critic_")
    self.reference = None
    if config.rl.kl_coef:
      reference = qwen2.from_pretrained(policy_path, **{**load, "remat": False})
      self.reference = train_step.Learner(reference, mesh=self.mesh)
    self.sampler = Sampler(self.hosts.local_model(policy), stop_token_ids=policy_lib.stop_token_ids(
                               self.tokenizer, eos_token_id=policy.config.eos_token_id),
                           pad_id=self.tokenizer.pad_token_id or 0, mesh=self.hosts.local_mesh)
    self.user = simulator_factory.make_simulated_user(config.sim_user, self.hosts.local_mesh,
                                                      seed=config.seed)
    self.user.check_health()  # one request: a dead simulator fails here, fast
    self.simulator_guard = SimulatorFailureGuard(
        config.sim_user.max_failed_share, config.sim_user.max_failed_steps_in_a_row,
        simulator_factory.describe(config.sim_user))
    self.micro_multiple = self.hosts.train_data_parallel_size * config.optim.grad_accum
    self.batch_multiple = self.micro_multiple * config.optim.num_minibatches

    self.step, self.order, self.skipped_updates = 0, ProfileOrder(len(self.profiles), config.seed), 0
    self._last_save = time.monotonic()
    self._restore()
    self.metrics = metrics_lib.MetricsWriter(config.workdir, resume_step=self.step)
    self.dialogue_log = dialogue_log.DialogueLog(
        config.workdir, every=config.log_dialogues_every, primary=self.hosts.primary)

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
    # Returns once the arrays are copied off the device; the files are written in the background.
    self.checkpoints.save(self.step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args))
    self._last_save = time.monotonic()

  def _checkpoint_due(self) -> bool:
    c = self.config.checkpoint
    due = checkpoint_due(self.step, self.config.steps, c.every, c.every_minutes,
                         seconds_since_save=time.monotonic() - self._last_save)
    if jax.process_count() > 1:  # clocks differ: every host follows the first one's decision
      from jax.experimental import multihost_utils
      due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
    return due

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
    # batch_size counts profiles (verl's batch size counts prompts); each is sampled n times.
    chosen = [self.profiles[i] for i in self.order.take(config.batch_size)]
    share = self.hosts.share(len(chosen))  # this host's dialogues
    sim_counts_before = dict(self.user.metrics)
    self.sampler.update_weights(self.hosts.local_params(self.policy.params))
    rollout = rollout_lib.collect(self.sampler, self.formatter, self.user,
                                  chosen[share.start:share.stop], self.rollout_cfg,
                                  keys.rollout_step(config.seed, step), first_profile=share.start)
    self.dialogue_log.observe(step, rollout.dialogues)
    sim_events = {key: count - sim_counts_before.get(key, 0)  # this step's simulator events
                  for key, count in self.user.metrics.items()}
    rollout_metrics = {**rollout.metrics, **sim_events, "tokens_per_s": rollout.metrics[
        "tokens/generated"] / max(rollout.metrics["time/rollout"], 1e-9)}
    if not self.simulator_guard.trainable(
        step, multihost.gather([d.failure for d in rollout.dialogues])):
      self.step = step
      return self.hosts.reduce_step_metrics({**rollout_metrics, "untrained/simulator": 1},
                                            rollout)
    if not self.hosts.total(len(rollout.samples)):  # a host may have dropped all of its own
      raise TrainingError(f"step {step}: every dialogue was dropped by the simulator")

    start = time.perf_counter()
    batch = self.hosts.collate(rollout.samples, self.batch_multiple,
                               pad_id=self.tokenizer.pad_token_id or 0)
    micro_rows = len(batch["input_ids"]) // (config.optim.num_minibatches
                                             * config.optim.grad_accum)
    if self.critic is not None:
      batch["old_values"] = self.critic.apply_in_micro_batches(train_step.critic_values, batch,
                                                               micro_rows)
    if self.reference is not None:
      batch["ref_logprobs"] = self.reference.apply_in_micro_batches(
          train_step.sequence_logprobs, batch, micro_rows, temperature=self.loss_cfg.temperature)
    batch = train_step.compute_advantages(batch, self.loss_cfg)
    update_metrics = []
    arrays = {k: v for k, v in batch.items() if k not in ("scores", "groups", "token_rewards")}
    if config.rollout.thinking:
      # Every agent turn is a sample, many per dialogue: mini-batches hold the step's
      # dialogue count of samples (over num_minibatches), as the release's
      # ppo_mini_batch_size, so a step makes as many updates as the release's.
      real_rows = {k: v[:len(rollout.samples)] for k, v in arrays.items()}
      dialogues = config.batch_size * config.rollout.samples_per_profile
      minibatches = _chunks(real_rows, -(-dialogues // config.optim.num_minibatches),
                            self.micro_multiple)
    else:
      minibatches = _split(arrays, config.optim.num_minibatches)
    policy_lr = train_step.learning_rate(self.policy_optim, step - 1)
    critic_lr = train_step.learning_rate(self.critic_optim, step - 1) if self.critic else None
    for _ in range(config.optim.ppo_epochs):
      for minibatch in minibatches:
        micro_batches = _split(minibatch, config.optim.grad_accum)
        m = self.policy.update(micro_batches, learning_rate=policy_lr)
        if self.critic is not None:
          m.update(self.critic.update(micro_batches, learning_rate=critic_lr))
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
    out = dict(rollout_metrics)
    out.update({
        "kl": mean("kl"), "approx_kl": mean("approx_kl"), "entropy": mean("entropy"),
        "clip_frac": mean("clip_frac"), "pg_clipfrac_lower": mean("pg_clipfrac_lower"),
        "pg_loss": mean("pg_loss"), "value_loss": mean("value_loss"),
        "value_clip_frac": mean("value_clip_frac"), "grad_norm": mean("grad_norm"),
        "updates": len(update_metrics), "lr": policy_lr,
        "skipped_updates": skipped, "time/train": train_seconds,
        "samples": len(rollout.samples), "untrained/simulator": 0,
    })
    self.step = step
    return self.hosts.reduce_step_metrics(out, rollout)

  def run(self) -> None:
    try:
      self._run()
    finally:  # also when stopped or interrupted: where the plot, metrics, dialogues, export are
      if self.hosts.primary:
        dialogue_log.report_outputs(self.config.workdir, self.step, self.config.steps,
                                    self.dialogue_log)

  def _run(self) -> None:
    config = self.config
    if self.step < config.steps:  # the first step's jit compilation is otherwise a silent wait
      logging.info("step %d compiles the sampler and the update steps first: it is the slow one",
                   self.step + 1)
    bar = tqdm(total=config.steps, initial=self.step, unit="step", desc="train",
               disable=not self.hosts.primary)
    try:
      while self.step < config.steps:
        step_start = time.perf_counter()
        step_metrics = self.train_step()
        step_metrics["time/step"] = time.perf_counter() - step_start
        self.metrics.write(self.step, step_metrics)
        if self._checkpoint_due():
          self._save()
          metrics_lib.plot_curves(self.metrics.path,
                                  os.path.join(config.workdir, "reward_curve.png"))
        sim_failed = step_metrics["dialogues/simulator_failed"] + step_metrics["dialogues/dropped"]
        bar.update(1)
        bar.set_postfix(reward=f"{step_metrics['reward/mean']:.2f}",
                        emotion=f"{step_metrics['emotion/final_mean']:.1f}",
                        sim_fail=sim_failed, s_per_step=f"{step_metrics['time/step']:.1f}")
        if self.step % config.log_every == 0:
          logging.info("step %d: reward %.3f, final emotion %.1f, turns %.1f, %.1f tok/s, "
                       "%d simulator failure(s)", self.step, step_metrics["reward/mean"],
                       step_metrics["emotion/final_mean"], step_metrics["turns/mean"],
                       step_metrics["tokens_per_s"], sim_failed)
        self.simulator_guard.raise_if_down()
    finally:  # a run that stops still leaves its last checkpoint whole
      bar.close()
      self.checkpoints.wait_until_finished()
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
    self.checkpoints.close()
