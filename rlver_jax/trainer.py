"""The RLVER training loop: rollouts against the simulated user, PPO or GRPO updates.

Per step: sample `batch_size` profiles (a seeded order that survives restarts),
run `rollout.samples_per_profile` dialogues with each and score them; the
algorithm's step (`rl.step.AlgorithmStep`: values / reference logprobs where
the algorithm needs them, advantages, `ppo_epochs` passes of mini-batch
updates) trains on them. A step where too many dialogues failed for
infrastructure reasons is not trained on, and too many such steps in a row
stop the run. Orbax checkpoints
(written asynchronously, every `checkpoint.every` steps and/or
`checkpoint.every_minutes`) hold the policy, critic, optimizer states, step
and data position; a restarted run resumes from the latest one, with the
config saved in W/config.json. Metrics go to W/metrics.jsonl and TensorBoard,
the reward curve to W/reward_curve.png, the final policy to W/export.

With `rollout.off_policy_steps=1` step n+1's dialogues are collected in a background
thread, with the weights before step n's update, while that update runs
(`rlver_jax/off_policy.py`); a checkpoint still holds its own step's data position, and a
rollout collected ahead is dropped by a stop and collected again on resume.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from tqdm import tqdm

from models import host_metrics, pretrained, qwen2
from rl import keys
from rl import rollout as rollout_lib
from rl.step import TrainingError
from rlver_jax import builder, compile_cache, dialogue_log
from rlver_jax import metrics as metrics_lib
from rlver_jax import multihost, off_policy, preemption, run_config, sections, sharding
from rlver_jax import simulator_factory
from rlver_jax import tiny
from rlver_jax import workdir as workdir_lib
from sim_user import profiles as profiles_lib


class SimulatorFailing(TrainingError):
  """Too many steps in a row lost too many dialogues to simulator failures."""


class SimulatorFailureGuard:
  """Keeps a step whose dialogues mostly failed for infrastructure reasons out of training.

  A step is trainable when at most `max_share` of its dialogues failed (ended
  as failed or dropped by the simulator); `max_in_a_row` untrainable steps in a
  row mean the simulator is down, and `raise_if_down` stops the run; a run that trained on
  fewer than `min_trained_share` of its steps is not done (`raise_if_mostly_untrained`).
  """

  def __init__(self, max_share: float, max_in_a_row: int, simulator: str, reasons_kept: int = 3,
               min_trained_share: float = 0.0):
    self.max_share, self.max_in_a_row, self.simulator = max_share, max_in_a_row, simulator
    self.min_trained_share = min_trained_share
    self.in_a_row = 0
    self.steps, self.trained_steps = 0, 0  # of this run (not counting steps before a resume)
    self.recent_reasons = collections.deque(maxlen=reasons_kept)

  def trainable(self, step: int, failure_reasons: list) -> bool:
    """`failure_reasons`: each dialogue's failure reason, None where it did not fail."""
    failures = [reason for reason in failure_reasons if reason]
    share = len(failures) / max(len(failure_reasons), 1)
    self.steps += 1
    if share <= self.max_share:
      self.in_a_row = 0
      self.trained_steps += 1
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

  def raise_if_mostly_untrained(self) -> None:
    """At the end of a run: raises when it trained on fewer than `min_trained_share` of the
    steps it ran (a run that trained on nothing is not done)."""
    if self.steps and self.trained_steps < self.min_trained_share * self.steps:
      raise SimulatorFailing(
          f"trained on {self.trained_steps} of the {self.steps} steps this run ran (fewer "
          f"than sim_user.min_trained_share={self.min_trained_share:g}): the simulator "
          f"{self.simulator} failed more than {self.max_share:.0%} of the dialogues of the "
          f"others; nothing exported; last failures: {'; '.join(self.recent_reasons)}")


class ProfileOrder:
  """Epoch-wise seeded permutations of the profiles; `position` is all the state there is."""

  def __init__(self, num_profiles: int, seed: int, position: int = 0):
    self.num_profiles, self.seed, self.position = num_profiles, seed, position

  def take(self, count: int) -> list[int]:
    out, self.position = self.peek(count)
    return out

  def peek(self, count: int) -> tuple[list[int], int]:
    """The next `count` profiles and the position after them, without moving."""
    out, position = [], self.position
    while len(out) < count:
      epoch, offset = divmod(position, self.num_profiles)
      out.append(int(self._order(epoch)[offset]))
      position += 1
    return out, position

  @functools.lru_cache(maxsize=1)
  def _order(self, epoch: int) -> np.ndarray:
    return np.asarray(keys.profile_order(self.seed, epoch, self.num_profiles))


def checkpoint_due(step: int, final_step: int, every: int, every_minutes: float,
                   seconds_since_save: float) -> bool:
  """Save after `step`? At the final step, every `every` steps and `every_minutes` after the
  last save (0 turns either rule off)."""
  return (step == final_step or (every > 0 and step % every == 0) or
          (every_minutes > 0 and seconds_since_save >= 60 * every_minutes))


# Steps between redraws of W/reward_curve.png (also redrawn at every checkpoint and the end):
# a few seconds of drawing against steps of seconds (the demo) to minutes (the recipes).
PLOT_EVERY_STEPS = 5

# How hosts combine the metrics a step adds to its rollout's and updates' (models/host_metrics.py).
host_metrics.declare({
    "tokens_per_s": host_metrics.ratio("tokens/generated", "time/rollout"),
    "rollout/policy_lag": host_metrics.MEAN, "rollout/wait_s": host_metrics.MAX,
    "untrained/simulator": host_metrics.MEAN})


class Trainer:

  def __init__(self, config):
    """`config`: an ml-collections training config, read as its typed, checked run."""
    self.config_dict = config  # as given, for W/config.json
    self.config = config = sections.train_run(config)
    sharding.maybe_initialize_distributed()
    self.lock = workdir_lib.claim(config.workdir)  # before anything is written there
    self.checkpoints = self.metrics = self.dialogue_log = None
    self.prefetch: off_policy.BackgroundRollout | None = None  # the next step's, collected ahead
    self.signals = preemption.STOP_SIGNALS  # installed while `run` runs, or by the CLI
    self.outputs: set[str] = set()  # what this run wrote, for the summary at its end
    try:
      with self.signals.abortable():  # loading and warming up: nothing to save yet
        self._build()
    except BaseException:
      self.close()
      raise

  def _build(self) -> None:
    config = self.config
    self.checkpoints = ocp.CheckpointManager(
        os.path.abspath(os.path.join(config.workdir, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=config.checkpoint.keep,
                                             enable_async_checkpointing=True,
                                             cleanup_tmp_directories=True))
    # The constructor cleans up temporary directories in a thread that orbax's close() does not
    # wait for: a run that fails moments later would exit under it, and the thread dies with
    # "cannot schedule new futures after interpreter shutdown" (half the time, on this VM).
    getattr(self.checkpoints, "_maybe_await_cleanup_tmp_directory", lambda: None)()
    run_config.check_and_save(self.config_dict, config.workdir,
                              resuming=self.checkpoints.latest_step() is not None)
    self.off_policy_steps = config.rollout.off_policy_steps
    off_policy.check_supported(self.off_policy_steps, jax.process_count())
    self.rollout_cfg = builder.train_rollout_config(config)
    self.profiles = profiles_lib.load_profiles(config.data.train_profiles,
                                               config.sim_user.max_message_chars)
    # The simulator's health check comes before the policy's warm-up and loading: a dead
    # simulator fails the run in seconds, not after minutes of preparing a policy. (An
    # in-process simulator runs on its host's own chips.)
    self.user = builder.simulated_user(
        config, multihost.local_mesh(dataclasses.asdict(config.mesh)))
    self.policy_path = policy_path = (tiny.demo_policy(config) if config.policy.tiny_init
                                      else config.policy.checkpoint)
    # The tokenizer first: a checkpoint without one fails naming it, before its config.json
    # is read for the meshes.
    tokenizer = pretrained.load_tokenizer(policy_path)
    self.hosts = multihost.Hosts(builder.run_meshes(
        config, qwen2.read_config(policy_path).num_kv_heads,
        builder.hosts_per_group(config, policy_path)))
    # On several devices, the background rollout and the update take turns on them.
    self.turns = off_policy.DeviceTurns(
        enabled=bool(self.off_policy_steps) and self.hosts.train_mesh.devices.size > 1)
    self.models = builder.training_models(config, policy_path, self.hosts, tokenizer)
    self.simulator_guard = SimulatorFailureGuard(
        config.sim_user.max_failed_share, config.sim_user.max_failed_steps_in_a_row,
        simulator_factory.describe(config.sim_user),
        min_trained_share=config.sim_user.min_trained_share)
    self.algorithm = builder.algorithm_step(config, self.models, self.hosts, self.turns)

    self.step, self.order = 0, ProfileOrder(len(self.profiles), config.seed)
    self.sampler_step = None  # the step whose weights the sampler holds (0: the initial ones)
    self._last_save = time.monotonic()
    self._restore()
    self.metrics = metrics_lib.MetricsWriter(config.workdir, resume_step=self.step)
    self.dialogue_log = dialogue_log.DialogueLog(
        config.workdir, every=config.log_dialogues_every, primary=self.hosts.primary,
        resume_step=self.step)

  def close(self) -> None:
    """Waits for the checkpoint being written, closes the writers and frees the workdir.

    Also after a failure: an open checkpoint manager left to the interpreter's
    shutdown fails there with a traceback of its own.
    """
    self._drop_prefetch()
    if self.checkpoints is not None:
      self.checkpoints.wait_until_finished()
      self.checkpoints.close()
      self.checkpoints = None
    for writer in (self.metrics, self.dialogue_log):
      if writer is not None:
        writer.close()
    if self.lock is not None:
      self.lock.release()
      self.lock = None

  # Checkpoints.

  def _state(self) -> dict:
    state = {"policy": self.models.policy.params, "policy_opt": self.models.policy.opt_state}
    if self.models.critic is not None:
      state.update(critic=self.models.critic.params, critic_opt=self.models.critic.opt_state)
    return state

  def _save(self) -> None:
    meta = {"step": self.step, "data_position": self.order.position, "seed": self.config.seed,
            "skipped_updates": self.algorithm.skipped_updates}
    args = {k: ocp.args.StandardSave(v) for k, v in self._state().items()}
    # Returns once the arrays are copied off the device; the files are written in the background.
    with self.turns.turn():
      self.checkpoints.save(self.step,
                            args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args))
    self._last_save = time.monotonic()
    self.outputs.add("checkpoints")

  def _decide(self) -> tuple[bool, str | None]:
    """(save now?, the signal that asks the run to stop, if any), the same on every host: the
    first host's clock decides the time-based saves; a signal on any host stops them all."""
    c = self.config.checkpoint
    due = checkpoint_due(self.step, self.config.steps, c.every, c.every_minutes,
                         seconds_since_save=time.monotonic() - self._last_save)
    hosts = multihost.allgather_json([due, self.signals.received])
    return hosts[0][0], next((received for _, received in hosts if received), None)

  def _stop(self, signal_name: str) -> None:
    """Saves the last finished step (unless saved) and raises Preempted."""
    self._drop_prefetch()  # the next step's dialogues: collected again on resume
    if self.step and self.checkpoints.latest_step() != self.step:
      self._save()
    self.checkpoints.wait_until_finished()
    saved = (f"step {self.step}'s checkpoint is saved" if self.step else
             "no step had finished, nothing to save")
    raise preemption.Preempted(
        signal_name, f"stopped at step {self.step}/{self.config.steps}; {saved}. Run the "
        f"same command again to resume (exit status {preemption.PREEMPTED_EXIT_CODE})")

  def _restore(self) -> None:
    latest = self.checkpoints.latest_step()
    if latest is None:
      return
    targets = {k: ocp.args.StandardRestore(v) for k, v in self._state().items()}
    restored = self.checkpoints.restore(
        latest, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **targets))
    meta = restored["meta"]
    policy, critic = self.models.policy, self.models.critic
    policy.params, policy.opt_state = restored["policy"], restored["policy_opt"]
    if critic is not None:
      critic.params, critic.opt_state = restored["critic"], restored["critic_opt"]
    self.step = meta["step"]
    self.order.position = meta["data_position"]
    self.algorithm.skipped_updates = meta["skipped_updates"]
    logging.info("resumed from %s at step %d", self.checkpoints.directory, self.step)

  # Rollouts.

  def _refresh_sampler(self) -> None:
    """The sampler to the weights of the last finished step, unless it holds them already."""
    if self.sampler_step == self.step:
      return
    assert self.prefetch is None, "the sampler's weights change under a rollout in flight"
    sampler, params = self.models.sampler, self.models.policy.params
    if self.off_policy_steps and sampler.weights.weight_copy is None:
      # This sampler decodes from the weights it is given, and the update that runs beside the
      # next rollout donates the training weights: it gets a copy of its own.
      params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    sampler.weights.update(params)  # cast and moved onto every sampler group's mesh
    if self.off_policy_steps:  # ready before the update that may donate what it was read from
      jax.block_until_ready(self.models.sampler.weights.state)
    self.sampler_step = self.step

  def _collect(self, step: int, profile_ids: list[int], sampler, user):
    """`step`'s rollout of these profiles (this host's share). A host that follows its sampler
    group's leader dispatches the leader's programs and has no dialogues of its own."""
    if not self.hosts.leads_group:
      sampler.rows.follow()
      return rollout_lib.Rollout(samples=[], dialogues=[], metrics={})
    chosen = [self.profiles[i] for i in profile_ids]
    share = self.hosts.share(len(chosen))  # this host's dialogues
    with sampler.rows.leading():
      return rollout_lib.collect(
          sampler, self.models.formatter, user, chosen[share.start:share.stop],
          self.rollout_cfg, keys.rollout_step(self.config.seed, step),
          first_profile=share.start, reward=self.config.rl.reward)

  def _start_prefetch(self, step: int) -> None:
    """Starts collecting `step`'s dialogues in the background with the current weights."""
    self._refresh_sampler()
    profile_ids, position = self.order.peek(self.config.batch_size)
    self.prefetch = off_policy.BackgroundRollout(
        step, functools.partial(self._collect, step, profile_ids), self.models.sampler,
        self.user, self.turns, user_in_turns=self.config.sim_user.backend == "flax",
        position=position, weights_step=self.step)

  def _drop_prefetch(self) -> None:
    prefetch, self.prefetch = self.prefetch, None
    if prefetch is not None:
      prefetch.cancel()

  def _rollout(self, step: int):
    """(rollout, data position after it, the step whose weights sampled
    it, seconds waited for it), or None when a stop signal came first. The rollout is the
    one collected ahead in the background, if any, else collected now."""
    if self.prefetch is not None and self.prefetch.step != step:
      self._drop_prefetch()  # not this step's (cannot happen in `run`): collected anew
    prefetch = self.prefetch
    if prefetch is None:
      self._refresh_sampler()
    start = time.perf_counter()
    try:
      with self.signals.abortable():  # a signal drops the rollout: the update would be long
        if prefetch is not None:
          rollout = prefetch.result()  # the background rollout's error, raised here
          self.prefetch = None
          return (rollout, prefetch.info["position"], prefetch.info["weights_step"],
                  time.perf_counter() - start)
        profile_ids, position = self.order.peek(self.config.batch_size)
        rollout = self._collect(step, profile_ids, self.models.sampler, self.user)
        return rollout, position, self.sampler_step, time.perf_counter() - start
    except preemption.StopRequested:
      return None  # a prefetch still running is dropped by `_stop`

  # One step.

  def run_step(self) -> dict:
    config = self.config
    step = self.step + 1
    # batch_size counts profiles (verl's batch size counts prompts); each is sampled n times.
    collected = self._rollout(step)
    signal_name = self.signals.agreed()  # every host, after its rollout
    if signal_name:
      self._stop(signal_name)  # the data position stays step `self.step`'s: drawn again
    rollout, position, weights_step, waited = collected
    self.order.position = position
    if self.off_policy_steps and step < config.steps:
      self._start_prefetch(step + 1)  # beside this step's update, with the weights before it
    self.dialogue_log.observe(step, rollout.dialogues)
    rollout_metrics = {**rollout.metrics,
                       # Updates between the weights that sampled this step and those it
                       # trains (0: on-policy), and the seconds the step waited for them.
                       "rollout/policy_lag": self.step - weights_step, "rollout/wait_s": waited}
    if rollout.dialogues:  # a sampler group's follower has none (combined over hosts)
      rollout_metrics["tokens_per_s"] = rollout.metrics["tokens/generated"] / max(
          rollout.metrics["time/rollout"], 1e-9)
    if self.config.rollout.release_sampler_weights:
      self.models.sampler.weights.drop()  # the update has its memory; made anew after it
    if not self.simulator_guard.trainable(
        step, multihost.gather_records([d.failure for d in rollout.dialogues])):
      self.step = step
      return self.hosts.reduce_step_metrics({**rollout_metrics, "untrained/simulator": 1},
                                            rollout)
    if not self.hosts.total(len(rollout.samples)):  # a host may have dropped all of its own
      raise TrainingError(f"step {step}: every dialogue was dropped by the simulator")

    metrics = {**rollout_metrics, **self.algorithm.run(step, rollout.samples),
               "untrained/simulator": 0}
    self.step = step
    return self.hosts.reduce_step_metrics(metrics, rollout)

  def run(self) -> None:
    """Trains to `steps`; on SIGTERM/SIGINT saves and raises Preempted (see preemption.py)."""
    try:
      with self.signals:
        self._run()
    finally:  # also when stopped or interrupted: where the plot, metrics, dialogues, export are
      try:
        if self.hosts.primary:
          dialogue_log.report_outputs(
              self.config.workdir, self.step, self.config.steps, self.dialogue_log,
              written=self.outputs, learned=metrics_lib.learning_summary(
                  metrics_lib.read_appended_jsonl(self.metrics.path) if self.metrics else []))
      finally:  # the replies table fails on a full disk too: the checkpoints still close
        self.close()

  def _plot(self) -> str | None:
    plot = metrics_lib.plot_curves(self.metrics.path,
                                   os.path.join(self.config.workdir, "reward_curve.png"))
    if plot:
      self.outputs.add("reward curve")
    return plot

  def _run(self) -> None:
    config = self.config
    if self.step < config.steps:  # the first step's jit compilation is otherwise a silent wait
      logging.info("step %d compiles the sampler and the update steps first: it is the slow one",
                   self.step + 1)
    bar = tqdm(total=config.steps, initial=self.step, unit="step", desc="train",
               disable=not self.hosts.primary)
    try:
      compile_seconds = compile_cache.compile_seconds()
      while self.step < config.steps:
        step_start = time.perf_counter()
        compile_seconds.take()
        step_metrics = self.run_step()
        step_metrics["time/step"] = time.perf_counter() - step_start
        step_metrics["time/compile_s"] = compile_seconds.take()  # this host's XLA compiles
        self.metrics.write(self.step, step_metrics)
        self.outputs.add("metrics")
        save, signal_name = self._decide()
        if save:
          self._save()
        if save or signal_name or self.step % PLOT_EVERY_STEPS == 0:
          self._plot()
        if signal_name:
          self._stop(signal_name)
        sim_failed = step_metrics["dialogues/simulator_failed"] + step_metrics["dialogues/dropped"]
        bar.update(1)
        # A step without scored dialogues has no reward or emotion (a gap, not a 0).
        shown = lambda key, spec: format(step_metrics[key], spec) if key in step_metrics else "-"
        bar.set_postfix(reward=shown("reward/mean", ".2f"),
                        emotion=shown("emotion/final_mean", ".1f"),
                        sim_fail=sim_failed, s_per_step=f"{step_metrics['time/step']:.1f}")
        if self.step % config.log_every == 0:
          logging.info("step %d: reward %s, final emotion %s, turns %s, %s tok/s, "
                       "%d simulator failure(s)", self.step, shown("reward/mean", ".3f"),
                       shown("emotion/final_mean", ".1f"), shown("turns/mean", ".1f"),
                       shown("tokens_per_s", ".1f"), sim_failed)
        self.simulator_guard.raise_if_down()
    finally:  # a run that stops still leaves its last checkpoint whole
      self._drop_prefetch()  # a failed run's rollout collected ahead (a finished run has none)
      bar.close()
      self.checkpoints.wait_until_finished()
    plot = self._plot()
    self.simulator_guard.raise_if_mostly_untrained()  # before the export: nothing learned
    if config.checkpoint.export_at_end:
      export = os.path.join(config.workdir, "export")
      qwen2.save_pretrained(self.models.policy.model(), export)
      if jax.process_index() == 0:
        self.models.tokenizer.save_pretrained(export)
      self.outputs.add("export")
      logging.info("policy exported to %s", export)
    logging.info("done: %d steps, metrics %s, plot %s", self.step, self.metrics.path, plot)
