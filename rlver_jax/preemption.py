"""Stopping on SIGTERM or SIGINT with the work saved, every host at the same step.

A preemptible or spot TPU VM (and a maintenance event) gets SIGTERM and some
seconds of grace; a person stops a run with Ctrl-C (SIGINT). Either asks the
trainer to stop: a rollout in flight is dropped at once (its dialogues are not
trained on, and its profiles are drawn again on resume), an update in flight
finishes; then every host agrees on the step (`StopSignals.agreed`, a
collective at fixed points of each step, so a signal that reached one host
stops all), the last finished step is checkpointed, and the run exits with
PREEMPTED_EXIT_CODE and one line, so a supervisor can tell "preempted, run me
again" (the same command resumes) from "failed" (1) and "a host was lost"
(watchdog.LOST_HOST_EXIT_CODE). A second signal ends the process at once.
A signal while the trainer starts (loading, the demo's warm-up) stops it there
with the same exit status: nothing was trained, so nothing is saved.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

from absl import logging

from infra.errors import RunStopped

PREEMPTED_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: a temporary failure; run again to resume
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(RunStopped):
  """The run stopped on a signal after saving its last finished step: rerun it to resume."""

  def __init__(self, signal_name: str, message: str):
    super().__init__(f"{signal_name}: {message}")
    self.signal_name = signal_name


class StopRequested(BaseException):
  """A signal inside an abortable section. A BaseException, as KeyboardInterrupt is, so that
  no `except Exception` on the way (a simulator's retry loop) holds it up."""


class StopSignals:
  """While installed (`with STOP_SIGNALS:`), SIGTERM and SIGINT ask the run to stop.

  The first signal is recorded in `received` (its name), and raises
  StopRequested if it lands inside `abortable()`; a second one exits at once.
  Installing nests: the outermost `with` installs the handlers and, leaving,
  restores the previous ones and forgets the signal.
  """

  def __init__(self):
    self.received: str | None = None
    self._abortable_depth = 0
    self._installed_depth = 0
    self._previous: dict = {}

  def __enter__(self) -> "StopSignals":
    self._installed_depth += 1
    if self._installed_depth == 1 and threading.current_thread() is threading.main_thread():
      self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
    return self

  def __exit__(self, *exc_info) -> None:
    self._installed_depth -= 1
    if self._installed_depth:
      return
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous, self.received = {}, None

  def _handle(self, signum, frame) -> None:
    name = signal.Signals(signum).name
    if self.received:
      print(f"{name} again: exiting now, without saving", file=sys.stderr, flush=True)
      os._exit(128 + signum)
    self.received = name
    logging.warning("%s received: stopping after saving the last finished step (send it again "
                    "to exit at once, without saving)", name)
    if self._abortable_depth:
      raise StopRequested(name)

  @contextlib.contextmanager
  def abortable(self):
    """A section whose work a signal throws away at once (it raises StopRequested in it)."""
    if self.received:
      raise StopRequested(self.received)
    self._abortable_depth += 1
    try:
      yield
    finally:
      self._abortable_depth -= 1

  def agreed(self) -> str | None:
    """The signal that some host received, or None: the same answer on every host (a
    collective with several processes; call it at the same point on each)."""
    from rlver_jax import multihost
    return next((name for name in multihost.allgather_json(self.received) if name), None)


# The process's one set of handlers. Installed by the training CLI as soon as jax.distributed
# is up (its own SIGTERM handler, JAX's preemption notifier, would otherwise swallow a notice
# that comes during start-up) and by `Trainer.run`.
STOP_SIGNALS = StopSignals()
