"""Keeps a training step whose dialogues mostly failed in the simulator out of training, and
stops a run whose simulator is down (`sim_user.max_failed_share`,
`sim_user.max_failed_steps_in_a_row`, `sim_user.min_trained_share`)."""

from __future__ import annotations

import collections

from absl import logging

from rl.step import TrainingError
from rlver_jax import sections, simulator_factory


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


def for_run(sim_user: sections.TrainSimUserConfig) -> SimulatorFailureGuard:
  """The guard of a training run's `sim_user` section."""
  return SimulatorFailureGuard(sim_user.max_failed_share, sim_user.max_failed_steps_in_a_row,
                               simulator_factory.describe(sim_user),
                               min_trained_share=sim_user.min_trained_share)
