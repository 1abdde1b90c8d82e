"""The simulator failure guard (rlver_jax/simulator_guard.py) on its own: which steps are trained
on, when the run stops; the whole trainer with a dead simulator: tests/rlver_jax/test_trainer.py."""

import pytest

from configs import demo
from rlver_jax import sections, simulator_guard

dialogues = lambda *failures: list(failures)  # each dialogue's failure reason or None


def test_simulator_guard_skips_mostly_failed_steps_and_stops_after_k_in_a_row():
  guard = simulator_guard.SimulatorFailureGuard(0.5, 2, "http://sim:8000/v1")
  assert guard.trainable(1, dialogues(None, "a", "b", None))  # half failed: trained on
  assert not guard.trainable(2, dialogues("c", "d", None))
  guard.raise_if_down()  # one bad step: not yet
  assert guard.trainable(3, dialogues(None))  # a good step resets the count
  assert not guard.trainable(4, dialogues("e", "f", None))
  guard.raise_if_down()
  assert not guard.trainable(5, dialogues("g", "h"))
  with pytest.raises(simulator_guard.SimulatorFailing,
                     match=r"http://sim:8000/v1 .* 2 steps in a row.*last failures: f; g; h"):
    guard.raise_if_down()


def test_a_run_that_trained_on_too_few_of_its_steps_is_not_done():
  guard = simulator_guard.SimulatorFailureGuard(0.5, 10, "sim", min_trained_share=0.5)
  guard.raise_if_mostly_untrained()  # no step yet: nothing to judge
  assert guard.trainable(1, dialogues(None))
  assert not guard.trainable(2, dialogues("x"))
  guard.raise_if_mostly_untrained()  # 1 of 2: half, enough
  assert not guard.trainable(3, dialogues("y"))
  with pytest.raises(simulator_guard.SimulatorFailing,
                     match=r"trained on 1 of the 3 steps .*min_trained_share=0.5.*x; y"):
    guard.raise_if_mostly_untrained()


def test_the_guard_of_a_run_reads_its_sim_user_section():
  config = demo.get_config()
  config.sim_user.max_failed_share, config.sim_user.max_failed_steps_in_a_row = 0.25, 4
  config.sim_user.min_trained_share = 0.75
  guard = simulator_guard.for_run(sections.train_run(config).sim_user)
  assert (guard.max_share, guard.max_in_a_row, guard.min_trained_share) == (0.25, 4, 0.75)
  assert guard.simulator == "the scripted simulator"
