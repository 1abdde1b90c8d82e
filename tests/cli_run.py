"""The command-line programs (`python -m rlver_jax.main`, `.eval`, `.plan`, ...) run as the
tests' subprocesses on the CPU: one run to its end, and a training run stopped with SIGTERM and
run again (tests/rlver_jax/test_preemption.py and test_off_policy.py share that one)."""

import os
import signal
import subprocess
import sys

from rlver_jax import preemption
from tests import ROOT, processes, runs


def run_module(module: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
  """`python -m module args` in the repository root, on one CPU device (or in `env`), to its
  end within `timeout` seconds; its output is captured as text."""
  return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT,
                        env=processes.cpu_env() if env is None else env, capture_output=True,
                        text=True, timeout=timeout)


def run_main(workdir, *flags: str, **run_args) -> subprocess.CompletedProcess:
  """The training CLI on `workdir` with `flags` (the demo unless they name a config)."""
  return run_module("rlver_jax.main", *flags, f"--config.workdir={workdir}", **run_args)


def last_line_only_error(stderr: str) -> str:
  """The error line a CLI ends with, after checking that no traceback came before it."""
  assert "Traceback" not in stderr, stderr[-3000:]
  last = stderr.strip().splitlines()[-1]
  assert last.startswith("error: "), stderr[-3000:]
  return last


def preempt(flags, workdir, *, stop_after: int, steps: int, timeout_s: float = 600):
  """Runs the training CLI with `flags` in the repository root, sends it SIGTERM once `workdir`
  holds the metrics of `stop_after` steps, and checks that it stopped as a preempted run does:
  exit status 75, one last line naming its last finished step of `steps`, no traceback, and
  that step's checkpoint alone. Returns its stdout and the metrics of its finished steps."""
  run = subprocess.Popen([sys.executable, "-m", "rlver_jax.main", *flags], cwd=ROOT,
                         env=processes.cpu_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
  try:
    processes.wait_until(lambda: len(runs.read_metrics(workdir)) >= stop_after, [run], timeout_s)
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=300)
  finally:
    run.kill()
  assert run.returncode == preemption.PREEMPTED_EXIT_CODE, err[-3000:]
  finished = runs.read_metrics(workdir)
  assert err.strip().splitlines()[-1] == (
      f"preempted: SIGTERM: stopped at step {len(finished)}/{steps}; step {len(finished)}'s "
      "checkpoint is saved. Run the same command again to resume (exit status 75)")
  assert "Traceback" not in err
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [str(len(finished))]
  return out, finished


def rerun(flags) -> subprocess.CompletedProcess:
  """Runs the training CLI with `flags` again, to its end; checks that it succeeded."""
  done = run_module("rlver_jax.main", *flags, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done
