"""One-step off-policy overlap (`rollout.off_policy_steps=1`): step n+1's dialogues are
collected in a background thread, with the policy of step n (the weights before its update),
while step n's update runs.

The rollout source (`rlver_jax/rollout_source.py`) starts a `BackgroundRollout` once the
trainer has step n's dialogues and before step n's update, from weights the update does not
touch: the sampler's own copy (`rollout.sampling_dtype`, refreshed only between rollouts)
or, where the sampler would decode from the training weights (which the update donates), a
copy of them made for it. Step n+1 then trains on dialogues one update behind the weights it
trains (`rollout/policy_lag` 1); the losses' importance ratio is taken against the
log-probs the sampler drew the tokens with (`TrainBatch.old_logprobs_bt`), i.e. the
behaviour policy's, as verl's one-step-off-policy trainer and Tunix's `off_policy_steps` do.

The background rollout calls the sampler's engines and the simulated user through `_Guarded`
views: each call first checks whether the rollout was cancelled (a stop signal, an error in the
main thread), so a cancelled rollout ends at its next decode chunk or simulator call. On a
mesh of several devices the two threads take turns on the devices (`DeviceTurns`): each
holds the turn for one program call and waits for its result before passing it on, so no
two multi-device programs are ever in flight at once in a different order on different
devices (a deadlock: XLA:CPU's thread pool, NCCL). Only one process: the other hosts'
collectives would have to be issued in one order with the background thread's programs,
which is not arranged (`check_supported`).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from typing import Any, Callable

import jax
from absl import logging

from infra.errors import UserInputError

CANCEL_WAIT_S = 120.0  # how long a stop waits for a cancelled rollout's last call to return


class RolloutCancelled(BaseException):
  """Raised inside a cancelled background rollout, at its next sampler or simulator call (a
  BaseException, so that no `except Exception` on its way holds it up)."""


def check_supported(off_policy_steps: int, process_count: int) -> None:
  """Refuses what the overlap does not run: more than one process."""
  if off_policy_steps and process_count > 1:
    raise UserInputError(
        f"rollout.off_policy_steps={off_policy_steps} runs in one process only (this run has "
        f"{process_count}): each host's background rollout would interleave its programs with "
        "the main thread's cross-host collectives in a different order on each host; pass "
        "--config.rollout.off_policy_steps=0 for a multi-host run")


class DeviceTurns:
  """On a mesh of several devices, the main thread and the background rollout use the devices
  in turns of one program call each, waiting for its result before handing the turn on; on
  one device (`enabled` False) both run freely and XLA overlaps them."""

  def __init__(self, enabled: bool):
    self.enabled = enabled
    self._lock = threading.Lock() if enabled else None

  @contextlib.contextmanager
  def turn(self):
    if self._lock is None:
      yield
      return
    with self._lock:
      yield

  def settle(self, *values: Any) -> None:
    """Waits for `values` (any arrays in them, or in an object's attributes) when enabled."""
    if not self.enabled:
      return
    for value in values:
      jax.block_until_ready(value)
      if hasattr(value, "__dict__"):  # a RowBatch and the like: not a pytree
        jax.block_until_ready(list(vars(value).values()))


class _Guarded:
  """`target` whose method calls raise RolloutCancelled once `cancelled` is set, and run in a
  device turn where `turns` is given; its attributes named in `parts` (a sampler's engines)
  are guarded views too, the others read and written through to `target`."""

  def __init__(self, target, cancelled: threading.Event, turns: DeviceTurns | None,
               parts: tuple[str, ...] = ()):
    object.__setattr__(self, "_target", target)
    object.__setattr__(self, "_cancelled", cancelled)
    object.__setattr__(self, "_turns", turns)
    object.__setattr__(self, "_parts", parts)

  def __getattr__(self, name: str):
    value = getattr(self._target, name)
    cancelled, turns = self._cancelled, self._turns
    if name in self._parts:
      return _Guarded(value, cancelled, turns)
    if not inspect.ismethod(value):
      return value

    def guarded(*args, **kwargs):
      if cancelled.is_set():
        raise RolloutCancelled(name)
      if turns is None:
        return value(*args, **kwargs)
      with turns.turn():
        out = value(*args, **kwargs)
        turns.settle(out, *args)
      return out

    return guarded

  def __setattr__(self, name: str, value) -> None:
    setattr(self._target, name, value)


class BackgroundRollout:
  """`collect(sampler, user)` for one step, run in a daemon thread with both guarded.

  `step` is the step it collects for; `info` what the trainer needs with its result (the
  data position after its profiles, the step whose weights sample it).
  """

  def __init__(self, step: int, collect: Callable[[Any, Any], Any], sampler, user,
               turns: DeviceTurns, user_in_turns: bool, **info):
    self.step, self.info = step, info
    self._cancelled = threading.Event()
    self._done = threading.Event()
    self._result = self._error = None
    self.started = time.perf_counter()
    self.seconds = None  # its wall time, once done
    args = (collect, _Guarded(sampler, self._cancelled, turns if turns.enabled else None,
                              parts=("batch", "rows")),
            _Guarded(user, self._cancelled, turns if turns.enabled and user_in_turns else None))
    self._thread = threading.Thread(target=self._run, args=args, daemon=True,
                                    name=f"rollout-step-{step}")
    self._thread.start()

  def _run(self, collect, sampler, user) -> None:
    try:
      self._result = collect(sampler, user)
    except RolloutCancelled:
      pass
    except BaseException as e:  # handed to the main thread by `result`
      self._error = e
    finally:
      self.seconds = time.perf_counter() - self.started
      self._done.set()

  def done(self) -> bool:
    return self._done.is_set()

  def result(self):
    """Its result, once done (a signal to the main thread interrupts the wait, see
    `preemption.StopSignals.abortable`); its error, raised here, in the main thread."""
    self._done.wait()
    self._thread.join()
    if self._error is not None:
      logging.error("the background rollout of step %d failed: %s: %s", self.step,
                    type(self._error).__name__, self._error)
      raise self._error
    if self._cancelled.is_set() and self._result is None:
      raise RuntimeError(f"the background rollout of step {self.step} was cancelled")
    return self._result

  def cancel(self, timeout_s: float = CANCEL_WAIT_S) -> bool:
    """Asks it to stop at its next call and waits up to `timeout_s` for that; True if it
    ended. One still waiting on the simulator then is left behind (a daemon thread)."""
    self._cancelled.set()
    self._thread.join(timeout_s)
    if self._thread.is_alive():
      logging.warning("the background rollout of step %d did not stop within %.0f s (a "
                      "simulator call in flight?); leaving it behind", self.step, timeout_s)
      return False
    return True
