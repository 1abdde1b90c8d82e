"""The RLVER training loop: rollouts against the simulated user, PPO or GRPO updates.

Per step: collect `batch_size` profiles' dialogues (`rlver_jax/rollout_source.py`, also ahead
in the background with `rollout.off_policy_steps=1`); update (`rl.step.AlgorithmStep`) unless
too many failed in the simulator (`rlver_jax/simulator_guard.py`); log to W/metrics.jsonl,
TensorBoard and W/reward_curve.png; save (`rlver_jax/checkpoints.py`) or stop on a signal. A
restarted run resumes from the latest checkpoint (its config in W/config.json); a rollout
collected ahead is dropped by a stop and collected again. The final policy goes to W/export.
"""

from __future__ import annotations

import os
import time

from absl import logging
from tqdm import tqdm

from infra import host_metrics
from models import pretrained, qwen2
from rl import rollout as rollout_lib
from rl.step import TrainingError
from rlver_jax import builder, compile_cache, dialogue_log
from rlver_jax import checkpoints as checkpoints_lib
from rlver_jax import metrics as metrics_lib
from rlver_jax import multihost, off_policy, plan, preemption, rollout_source, run_start
from rlver_jax import simulator_guard

# Steps between redraws of W/reward_curve.png (also redrawn at every checkpoint and the end):
# a few seconds of drawing against steps of seconds (the demo) to minutes (the recipes).
PLOT_EVERY_STEPS = 5

# How hosts combine the metric a step adds to its rollout's and updates' (infra/host_metrics.py).
host_metrics.declare({"untrained/simulator": host_metrics.MEAN})


class Trainer:

  def __init__(self, start: run_start.RunStart):
    """`start`: the started run (`run_start.start`), this trainer's from now on."""
    self.config = config = start.config
    self.lock, self.checkpoints, self.policy_path = start.lock, start.checkpoints, start.policy_path
    self.rollouts = self.metrics = self.dialogue_log = None
    self.signals = preemption.STOP_SIGNALS  # installed while `run` runs, or by the CLI
    self.outputs: set[str] = set()  # what this run wrote, for the summary at its end
    try:
      with self.signals.abortable():  # loading the models: nothing to save yet
        self._build(start)
    except BaseException:
      self.close()
      raise

  @classmethod
  def from_config(cls, config) -> Trainer:
    """The trainer of an ml-collections training config."""
    return cls(run_start.start(config))

  def _build(self, start: run_start.RunStart) -> None:
    config, policy_path = self.config, self.policy_path
    # The tokenizer first: a checkpoint without one fails naming it, before its config.json
    # is read for the meshes.
    tokenizer = pretrained.load_tokenizer(policy_path)
    self.hosts = multihost.Hosts(builder.run_meshes(
        config, qwen2.read_config(policy_path).num_kv_heads,
        plan.hosts_per_group(config, policy_path)))
    # On several devices, the background rollout and the update take turns on them.
    self.turns = off_policy.DeviceTurns(enabled=bool(config.rollout.off_policy_steps) and
                                        self.hosts.train_mesh.devices.size > 1)
    self.models = builder.training_models(config, policy_path, self.hosts, tokenizer)
    self.simulator_guard = simulator_guard.for_run(config.sim_user)
    self.algorithm = builder.algorithm_step(config, self.models, self.hosts, self.turns)
    self.rollouts = rollout_source.RolloutSource(config, start.rollout, self.models, self.hosts,
                                                 start.user, start.profiles, self.turns,
                                                 self.signals)
    self.step = 0
    self._restore()
    self.metrics = metrics_lib.MetricsWriter(config.workdir, resume_step=self.step)
    self.dialogue_log = dialogue_log.DialogueLog(
        config.workdir, every=config.log_dialogues_every, primary=self.hosts.primary,
        resume_step=self.step)

  def close(self) -> None:
    """Waits for the checkpoint being written, closes the writers and frees the workdir. Also
    after a failure: an open checkpoint manager fails at shutdown with a traceback of its own."""
    if self.rollouts is not None:
      self.rollouts.drop_prefetch()
    if self.checkpoints is not None:
      self.checkpoints.close()
      self.checkpoints = None
    for writer in (self.metrics, self.dialogue_log):
      if writer is not None:
        writer.close()
    if self.lock is not None:
      self.lock.release()
      self.lock = None

  # Checkpoints.

  def _save(self) -> None:
    meta = checkpoints_lib.Meta(step=self.step, data_position=self.rollouts.position,
                                seed=self.config.seed,
                                skipped_updates=self.algorithm.skipped_updates)
    with self.turns.turn():  # copies the arrays off the devices the background rollout uses
      self.checkpoints.save(meta, self.models)
    self.outputs.add("checkpoints")

  def _restore(self) -> None:
    meta = self.checkpoints.restore_latest(self.models)
    if meta is not None:
      self.step, self.algorithm.skipped_updates = meta.step, meta.skipped_updates
      self.rollouts.seek(meta.data_position)
      logging.info("resumed from %s at step %d", self.checkpoints.directory, self.step)

  def _stop(self, signal_name: str) -> None:
    """Saves the last finished step (unless saved) and raises Preempted."""
    self.rollouts.drop_prefetch()  # the next step's dialogues: collected again on resume
    if self.step and self.checkpoints.latest_step() != self.step:
      self._save()
    self.checkpoints.wait()
    saved = (f"step {self.step}'s checkpoint is saved" if self.step else
             "no step had finished, nothing to save")
    raise preemption.Preempted(
        signal_name, f"stopped at step {self.step}/{self.config.steps}; {saved}. Run the "
        f"same command again to resume (exit status {preemption.PREEMPTED_EXIT_CODE})")

  def run_step(self) -> dict:
    """One step, `self.step + 1`: collect its rollout, update on it; its metrics over all hosts."""
    step = self.step + 1
    rollout, metrics = self._collect(step)
    if not self.simulator_guard.trainable(
        step, multihost.gather_records([d.failure for d in rollout.dialogues])):
      metrics["untrained/simulator"] = 1
    elif not self.hosts.total(len(rollout.samples)):  # a host may have dropped all of its own
      raise TrainingError(f"step {step}: every dialogue was dropped by the simulator")
    else:
      metrics = {**metrics, **self.algorithm.run(step, rollout.samples), "untrained/simulator": 0}
    self.step = step
    return self.hosts.reduce_step_metrics(metrics, rollout)

  def _collect(self, step: int) -> tuple[rollout_lib.Rollout, dict]:
    """(`step`'s rollout, its metrics on this host); starts the next step's rollout ahead with
    `rollout.off_policy_steps`. A stop signal in the rollout stops the run."""
    collected = self.rollouts.rollout(step)
    signal_name = self.signals.agreed()  # every host, after its rollout
    if signal_name:
      self._stop(signal_name)  # the data position stays step `self.step`'s: drawn again
    self.rollouts.seek(collected.position)
    if self.config.rollout.off_policy_steps and step < self.config.steps:
      # Beside this step's update, with the weights before it.
      self.rollouts.start_prefetch(step + 1, weights_step=self.step)
    self.dialogue_log.observe(step, collected.rollout.dialogues)
    if self.config.rollout.release_sampler_weights:
      self.models.sampler.weights.drop()  # the update has its memory; made anew after it
    return collected.rollout, collected.metrics(trained_step=self.step)

  # The loop: collect and update, log, save or stop.

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
        self._save_or_stop()
        self._show_progress(bar, step_metrics)
        self.simulator_guard.raise_if_down()
    finally:  # a run that stops still leaves its last checkpoint whole
      self.rollouts.drop_prefetch()  # a failed run's rollout collected ahead (a finished: none)
      bar.close()
      self.checkpoints.wait()
    self._finish()

  def _save_or_stop(self) -> None:
    """Saves and/or stops, the same on every host: the first host's clock decides the
    time-based saves; a signal on any host stops them all."""
    hosts = multihost.allgather_json([self.checkpoints.due(self.step), self.signals.received])
    save, signal_name = hosts[0][0], next((received for _, received in hosts if received), None)
    if save:
      self._save()
    if save or signal_name or self.step % PLOT_EVERY_STEPS == 0:
      self._plot()
    if signal_name:
      self._stop(signal_name)

  def _show_progress(self, bar: tqdm, step_metrics: dict) -> None:
    sim_failed = step_metrics["dialogues/simulator_failed"] + step_metrics["dialogues/dropped"]
    bar.update(1)
    # A step without scored dialogues has no reward or emotion (a gap, not a 0).
    shown = lambda key, spec: format(step_metrics[key], spec) if key in step_metrics else "-"
    bar.set_postfix(reward=shown("reward/mean", ".2f"), emotion=shown("emotion/final_mean", ".1f"),
                    sim_fail=sim_failed, s_per_step=f"{step_metrics['time/step']:.1f}")
    if self.step % self.config.log_every == 0:
      logging.info("step %d: reward %s, final emotion %s, turns %s, %s tok/s, "
                   "%d simulator failure(s)", self.step, shown("reward/mean", ".3f"),
                   shown("emotion/final_mean", ".1f"), shown("turns/mean", ".1f"),
                   shown("tokens_per_s", ".1f"), sim_failed)

  def _plot(self) -> str | None:
    plot = metrics_lib.plot_curves(self.metrics.path,
                                   os.path.join(self.config.workdir, "reward_curve.png"))
    if plot:
      self.outputs.add("reward curve")
    return plot

  def _finish(self) -> None:
    """The last curve, and the export of a run that trained enough."""
    plot = self._plot()
    self.simulator_guard.raise_if_mostly_untrained()  # before the export: nothing learned
    if self.config.checkpoint.export_at_end:
      checkpoints_lib.export_policy(self.models, os.path.join(self.config.workdir, "export"))
      self.outputs.add("export")
    logging.info("done: %d steps, metrics %s, plot %s", self.step, self.metrics.path, plot)
