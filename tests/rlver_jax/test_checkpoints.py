"""A run's checkpoints (rlver_jax/checkpoints.py) on their own: when they are due, a save and
restore of the learners' state and meta, keeping the last few; a whole run's resume:
tests/rlver_jax/test_trainer.py and test_preemption.py."""

import dataclasses
import os
import time
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np

from rlver_jax import checkpoints, sections


def test_checkpoints_are_due_by_steps_by_minutes_and_at_the_end():
  due = lambda step, every, minutes, seconds: checkpoints.checkpoint_due(step, 100, every, minutes,
                                                                          seconds)
  assert [s for s in range(1, 11) if due(s, 4, 0, 0)] == [4, 8]
  assert due(3, 0, 10, 600) and not due(3, 0, 10, 599) and not due(3, 0, 0, 10**6)
  assert due(100, 0, 0, 0)


def _models(scale: float, critic: bool):
  """Learners as the checkpoints read them: params and optimizer state of a policy (and critic)."""
  learner = lambda offset: SimpleNamespace(
      params={"w": jnp.full((2, 3), scale + offset)},
      opt_state={"mu": jnp.full((2, 3), 10 * scale + offset), "count": jnp.int32(scale)})
  return SimpleNamespace(policy=learner(0.0), critic=learner(0.5) if critic else None)


def _assert_learner(learner, scale: float, offset: float):
  np.testing.assert_array_equal(learner.params["w"], np.full((2, 3), scale + offset))
  np.testing.assert_array_equal(learner.opt_state["mu"], np.full((2, 3), 10 * scale + offset))
  assert int(learner.opt_state["count"]) == int(scale)


def test_a_save_restores_into_fresh_learners_with_its_meta_and_keeps_the_last_two(tmp_path):
  section = sections.CheckpointConfig(every=1, every_minutes=0.0, keep=2)
  run = checkpoints.Checkpoints(str(tmp_path), section, final_step=3)
  assert run.latest_step() is None and run.restore_latest(_models(0, critic=True)) is None
  for step in (1, 2, 3):
    assert run.due(step)
    run.save(checkpoints.Meta(step=step, data_position=4 * step, seed=7, skipped_updates=step - 1),
             _models(step, critic=True))
  run.close()
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]

  again = checkpoints.Checkpoints(str(tmp_path), section, final_step=3)
  fresh = _models(0, critic=True)
  meta = again.restore_latest(fresh)
  assert meta == checkpoints.Meta(step=3, data_position=12, seed=7, skipped_updates=2)
  _assert_learner(fresh.policy, 3, 0.0)
  _assert_learner(fresh.critic, 3, 0.5)
  again.close()


def test_a_run_without_a_critic_saves_and_restores_the_policy_alone(tmp_path):
  section = sections.CheckpointConfig(every=0, every_minutes=0.0, keep=1)
  run = checkpoints.Checkpoints(str(tmp_path), section, final_step=5)
  assert not run.due(4) and run.due(5)  # the final step only
  run.save(checkpoints.Meta(step=5, data_position=20, seed=0, skipped_updates=0),
           _models(5, critic=False))
  run.wait()
  fresh = _models(0, critic=False)
  assert run.restore_latest(fresh).step == 5
  _assert_learner(fresh.policy, 5, 0.0)
  run.close()


def test_time_based_saves_count_from_the_restore_and_then_from_the_last_save(tmp_path):
  section = sections.CheckpointConfig(every=0, every_minutes=1.0, keep=1)
  run = checkpoints.Checkpoints(str(tmp_path), section, final_step=100)
  run._last_save -= 120  # the learners took two minutes to build
  assert run.due(1)
  run.restore_latest(_models(0, critic=False))  # the clock starts once they are built
  assert run.seconds_since_save() < 60 and not run.due(1)
  run._last_save = time.monotonic() - 61
  assert run.due(2)
  run.save(checkpoints.Meta(step=2, data_position=0, seed=0, skipped_updates=0),
           _models(1, critic=False))
  assert not run.due(3)
  run.close()


def test_the_meta_is_the_json_of_the_checkpoints_before_it():
  """Checkpoints written before `Meta` existed hold exactly these keys: they still restore."""
  assert [f.name for f in dataclasses.fields(checkpoints.Meta)] == [
      "step", "data_position", "seed", "skipped_updates"]
