"""A training run's start: what the Trainer is given, and a start that fails leaves the workdir
free (its lock and checkpoint manager released)."""

import os

import pytest

from infra.errors import UserInputError
from rlver_jax import run_start, trainer, workdir
from tests.runs import small_demo


def test_a_start_resolves_the_prompt_and_the_demo_policy_and_hands_them_to_the_trainer(tmp_path):
  start = run_start.start(small_demo(tmp_path))
  assert start.rollout.system_prompt == "You are a caring listener."  # the resolved text
  assert start.policy_path == os.path.join(tmp_path, "init_policy")
  assert os.path.exists(os.path.join(start.policy_path, "config.json"))
  assert len(start.profiles) == 8 and start.checkpoints.latest_step() is None
  run = trainer.Trainer(start)
  try:
    assert run.lock is start.lock and run.checkpoints is start.checkpoints
    assert run.policy_path == start.policy_path
  finally:
    run.close()
  trainer.Trainer.from_config(small_demo(tmp_path)).close()  # the workdir is free again


def test_a_failed_start_frees_the_workdir(tmp_path):
  missing = str(tmp_path / "no_such_profiles.jsonl")
  with pytest.raises(UserInputError, match="no_such_profiles.jsonl: no such file") as failure:
    run_start.start(small_demo(tmp_path / "run", **{"data.train_profiles": missing}))
  # Released, not only dropped: the failure's traceback still holds the lock object, and a
  # released lock file is empty (a held one names its holder).
  assert (tmp_path / "run" / workdir.LOCK_FILE).read_text() == "", failure
  assert not (tmp_path / "run" / "init_policy").exists()  # the profiles came first
  trainer.Trainer.from_config(small_demo(tmp_path / "run")).close()
