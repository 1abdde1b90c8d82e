"""The training CLI (`python -m rlver_jax.main`) as a subprocess that is stopped with SIGTERM
and then run again with the same flags: tests/rlver_jax/test_preemption.py and
tests/rlver_jax/test_off_policy.py share it."""

import os
import signal
import subprocess
import sys
import time

from rlver_jax import metrics as metrics_lib
from rlver_jax import preemption
from tests import ROOT

ENV = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


def _metrics(workdir) -> list[dict]:
  return metrics_lib.read_appended_jsonl(os.path.join(workdir, "metrics.jsonl"))


def _command(flags) -> list[str]:
  return [sys.executable, "-m", "rlver_jax.main", *flags]


def preempt(flags, workdir, *, stop_after: int, steps: int, timeout_s: float = 600):
  """Runs the CLI with `flags` in the repository root, sends it SIGTERM once `workdir` holds
  the metrics of `stop_after` steps, and checks that it stopped as a preempted run does: exit
  status 75, one last line naming its last finished step of `steps`, no traceback, and that
  step's checkpoint alone. Returns its stdout and the metrics of its finished steps."""
  run = subprocess.Popen(_command(flags), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + timeout_s
    while len(_metrics(workdir)) < stop_after:
      assert run.poll() is None, "the training process ended early"
      assert time.monotonic() < deadline, "timed out"
      time.sleep(0.05)
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=300)
  finally:
    run.kill()
  assert run.returncode == preemption.PREEMPTED_EXIT_CODE, err[-3000:]
  finished = _metrics(workdir)
  assert err.strip().splitlines()[-1] == (
      f"preempted: SIGTERM: stopped at step {len(finished)}/{steps}; step {len(finished)}'s "
      "checkpoint is saved. Run the same command again to resume (exit status 75)")
  assert "Traceback" not in err
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == [str(len(finished))]
  return out, finished


def rerun(flags) -> subprocess.CompletedProcess:
  """Runs the CLI with `flags` again, to its end; checks that it succeeded."""
  done = subprocess.run(_command(flags), cwd=ROOT, env=ENV, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done
