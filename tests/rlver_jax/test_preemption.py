"""SIGTERM and SIGINT: the run saves its last finished step, exits with PREEMPTED_EXIT_CODE and one
line, and the same command resumes with no finished step lost and none repeated; on one host
and on two processes, in a rollout and in an update."""

import os
import signal
import subprocess
import sys
import time

import pytest

from rl import rollout as rollout_lib
from rlver_jax import preemption, trainer
from tests import ROOT, cli_run
from tests.processes import cpu_env, launch, log_of, run_all, wait, wait_until
from tests.runs import NO_ROUTINE_SAVES, read_metrics, small_demo


def _signal_self_in(monkeypatch, obj, name, signum, at_step, run):
  """Sends `signum` to this process once, from the first call of `obj.name` in step `at_step`."""
  real = getattr(obj, name)
  sent = []

  def with_signal(*args, **kwargs):
    if run.step + 1 == at_step and not sent:
      sent.append(signum)
      os.kill(os.getpid(), signum)
    return real(*args, **kwargs)

  monkeypatch.setattr(obj, name, with_signal)


@pytest.mark.heavy
def test_a_signal_in_a_rollout_drops_it_and_saves_the_step_before(tmp_path, monkeypatch):
  config = small_demo(tmp_path, **NO_ROUTINE_SAVES)
  run = trainer.Trainer.from_config(config)
  _signal_self_in(monkeypatch, rollout_lib, "collect", signal.SIGINT, at_step=2, run=run)
  monkeypatch.setattr(trainer, "PLOT_EVERY_STEPS", 1)  # the curve is redrawn between checkpoints
  handler_before = signal.getsignal(signal.SIGINT)
  with pytest.raises(preemption.Preempted, match=r"^SIGINT: stopped at step 1/3; step 1's "
                     r"checkpoint is saved\. Run the same command again to resume"):
    run.run()
  assert [r["step"] for r in read_metrics(tmp_path)] == [1]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]
  assert (tmp_path / "reward_curve.png").exists()  # drawn after step 1, saved in step 2
  assert signal.getsignal(signal.SIGINT) == handler_before  # the handlers are restored
  monkeypatch.undo()

  resumed = trainer.Trainer.from_config(config)
  assert resumed.step == 1
  # Step 2's profiles were drawn by the dropped rollout; the resumed run draws them again.
  assert resumed.rollouts.position == config.batch_size
  resumed.run()
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


@pytest.mark.heavy
def test_a_signal_in_an_update_finishes_the_step_and_saves_it(tmp_path, monkeypatch):
  config = small_demo(tmp_path, **NO_ROUTINE_SAVES)
  run = trainer.Trainer.from_config(config)
  _signal_self_in(monkeypatch, run.models.policy, "update", signal.SIGTERM, at_step=2, run=run)
  with pytest.raises(preemption.Preempted, match=r"^SIGTERM: stopped at step 2/3; step 2's "):
    run.run()
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
  assert (tmp_path / "reward_curve.png").exists()  # a stopped run's curve is up to date


ARGS = [f"--config={ROOT}/configs/demo.py", "--config.steps=6", "--config.batch_size=4",
        "--config.rollout.max_new_tokens=8", "--config.checkpoint.every=0",
        "--config.checkpoint.every_minutes=0", "--config.policy.tiny_warmup_steps=2"]


@pytest.mark.heavy
def test_sigterm_mid_step_saves_exits_75_and_the_rerun_resumes(tmp_path):
  """The CLI stopped and run again (two start-ups, six steps in all): about a minute."""
  (tmp_path / "export").mkdir(parents=True)  # a stale export of an earlier run
  flags = [*ARGS, "--config.mesh.fsdp=1", f"--config.workdir={tmp_path}"]
  # SIGTERM in step 3: its rollout is dropped or its update finishes.
  out, before = cli_run.preempt(flags, tmp_path, stop_after=2, steps=6)
  finished = len(before)
  assert [r["step"] for r in before] == list(range(1, finished + 1)) and finished in (2, 3)
  assert f"run preempted (SIGTERM) at step {finished}/6" in out
  assert "export:" not in out  # this run exported nothing

  second = cli_run.rerun(flags)
  assert f"at step {finished}" in second.stderr.split("resumed from")[1].splitlines()[0]
  after = read_metrics(tmp_path)
  assert [r["step"] for r in after] == [1, 2, 3, 4, 5, 6]
  assert after[:finished] == before  # kept, not redone


# The small demo of the multi-process tests (their programs, compiled once a session), saved
# only when stopped.
TWO_PROCESS_FLAGS = ("--config.steps=6", "--config.checkpoint.every=0",
                     "--config.checkpoint.every_minutes=0")


@pytest.mark.heavy
def test_sigterm_on_one_of_two_processes_stops_both_at_one_step(tmp_path):
  """Two trainer processes (JAX start-up, gloo, compiles: about 40 s each way) run twice, the
  second time to the end: the stop must fall between steps of a run that has more after it."""
  workdir = str(tmp_path / "run")
  procs = launch(workdir, 2, 2, *TWO_PROCESS_FLAGS)
  try:
    wait_until(lambda: len(read_metrics(workdir)) >= 2, procs)
    procs[1].send_signal(signal.SIGTERM)  # one host's notice stops both
  finally:
    codes = wait(procs)
  logs = [log_of(workdir, pid) for pid in range(2)]
  assert codes == [preemption.PREEMPTED_EXIT_CODE] * 2, logs[1][-3000:]
  before = read_metrics(workdir)
  finished = len(before)
  assert os.listdir(os.path.join(workdir, "checkpoints")) == [str(finished)]
  for log in logs:
    assert f"preempted: SIGTERM: stopped at step {finished}/6" in log and "Traceback" not in log

  run_all(workdir, 2, 2, *TWO_PROCESS_FLAGS)
  after = read_metrics(workdir)
  assert [r["step"] for r in after] == [1, 2, 3, 4, 5, 6]
  assert after[:finished] == before


@pytest.mark.heavy
def test_sigterm_during_start_up_stops_it_at_once_with_status_75(tmp_path):
  command = [sys.executable, "-m", "rlver_jax.main", f"--config.workdir={tmp_path}",
             "--config.mesh.fsdp=1"]  # the demo's whole warm-up: about a minute
  run = subprocess.Popen(command, cwd=ROOT, env=cpu_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
  try:
    for line in run.stderr:
      if "warming up the tiny policy" in line:
        break
    run.send_signal(signal.SIGTERM)
    start = time.monotonic()
    _, err = run.communicate(timeout=120)
  finally:
    run.kill()
  assert run.returncode == preemption.PREEMPTED_EXIT_CODE, err[-3000:]
  assert time.monotonic() - start < 30  # not after the warm-up's minute
  assert err.strip().splitlines()[-1] == (
      "preempted: SIGTERM: stopped while starting, before any step; nothing to save. Run the "
      "same command again to start")
  assert "Traceback" not in err and not (tmp_path / "init_policy" / "config.json").exists()
