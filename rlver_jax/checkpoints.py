"""A training run's orbax checkpoints in W/checkpoints: when they are due, saving (asynchronous),
restoring the latest, and closing; and its policy's export at the end.

A checkpoint holds the learners' parameters and optimizer states and a JSON `Meta`: the step,
the data position, the seed and the skipped updates.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import orbax.checkpoint as ocp
from absl import logging

from models import qwen2
from rlver_jax import builder, sections


def checkpoint_due(step: int, final_step: int, every: int, every_minutes: float,
                   seconds_since_save: float) -> bool:
  """Save after `step`? At the final step, every `every` steps and `every_minutes` after the
  last save (0 turns either rule off)."""
  return (step == final_step or (every > 0 and step % every == 0) or
          (every_minutes > 0 and seconds_since_save >= 60 * every_minutes))


@dataclasses.dataclass(frozen=True)
class Meta:
  """What a checkpoint holds besides the arrays (its JSON item, these keys)."""
  step: int  # the last finished step
  data_position: int  # the profile order's position after that step's profiles
  seed: int
  skipped_updates: int  # non-finite updates skipped so far (`rl.step.AlgorithmStep`)


def _learner_state(models: builder.TrainingModels) -> dict:
  """The arrays a checkpoint holds, by name: the policy's (and the critic's) parameters and
  optimizer states."""
  state = {"policy": models.policy.params, "policy_opt": models.policy.opt_state}
  if models.critic is not None:
    state.update(critic=models.critic.params, critic_opt=models.critic.opt_state)
  return state


class Checkpoints:
  """The checkpoint manager of `workdir`/checkpoints, saving and keeping as `section` says
  in a run of `final_step` steps."""

  def __init__(self, workdir: str, section: sections.CheckpointConfig, final_step: int):
    self.section, self.final_step = section, final_step
    self.manager = ocp.CheckpointManager(
        os.path.abspath(os.path.join(workdir, "checkpoints")),
        options=ocp.CheckpointManagerOptions(max_to_keep=section.keep,
                                             enable_async_checkpointing=True,
                                             cleanup_tmp_directories=True))
    # The constructor cleans up temporary directories in a thread that orbax's close() does not
    # wait for: a run that fails moments later would exit under it, and the thread dies with
    # "cannot schedule new futures after interpreter shutdown" (half the time, on this VM).
    getattr(self.manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
    self._last_save = time.monotonic()

  @property
  def directory(self):
    return self.manager.directory

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def seconds_since_save(self) -> float:
    """Since the last save or `restore_latest` (or this manager's making, before either)."""
    return time.monotonic() - self._last_save

  def due(self, step: int) -> bool:
    """Save after `step`? (`checkpoint_due` by this host's clock.)"""
    return checkpoint_due(step, self.final_step, self.section.every, self.section.every_minutes,
                          self.seconds_since_save())

  def save(self, meta: Meta, models: builder.TrainingModels) -> None:
    """Saves `models`' learners at `meta.step`. Returns once the arrays are copied off the
    device; the files are written in the background (`wait` waits for them)."""
    args = {name: ocp.args.StandardSave(value) for name, value in _learner_state(models).items()}
    self.manager.save(meta.step, args=ocp.args.Composite(
        meta=ocp.args.JsonSave(dataclasses.asdict(meta)), **args))
    self._last_save = time.monotonic()

  def restore_latest(self, models: builder.TrainingModels) -> Meta | None:
    """Restores the latest checkpoint into `models`' learners and returns its meta; None
    (`models` as they are) when there is none."""
    # The clock of time-based saves starts here, once the learners are built (minutes, for a
    # 7B policy): from the manager's making the first save would come that much early.
    self._last_save = time.monotonic()
    latest = self.latest_step()
    if latest is None:
      return None
    targets = {name: ocp.args.StandardRestore(value)
               for name, value in _learner_state(models).items()}
    restored = self.manager.restore(
        latest, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **targets))
    policy, critic = models.policy, models.critic
    policy.params, policy.opt_state = restored["policy"], restored["policy_opt"]
    if critic is not None:
      critic.params, critic.opt_state = restored["critic"], restored["critic_opt"]
    return Meta(**restored["meta"])

  def wait(self) -> None:
    """Until the checkpoint being written is whole."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.wait()
    self.manager.close()


def export_policy(models: builder.TrainingModels, directory: str) -> None:
  """The policy as an HF checkpoint with its tokenizer (`checkpoint.export_at_end`)."""
  qwen2.save_pretrained(models.policy.model(), directory)
  if jax.process_index() == 0:
    models.tokenizer.save_pretrained(directory)
  logging.info("policy exported to %s", directory)
