"""XLA compilation across runs: JAX's persistent compilation cache, and the seconds spent compiling.

At 7B a program compiled for a TPU slice takes 12-27 s and the policy update
minutes (`python -m rlver_jax.plan`); a run compiles dozens, and compiled
them all again after every preemption. With `compile_cache_dir` set (the
configs' default, `sections.default_compile_cache_dir()`: a per-user
directory, shared by the runs on one machine; on a pod, a path every host can
read, e.g. gs://bucket/xla_cache) JAX writes
each compiled executable there and the next run with the same programs, on
the same devices and versions, loads it instead of compiling.
"""

from __future__ import annotations

import threading

import jax
from absl import logging

# The event JAX records around each backend compilation (or its load from the cache).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def enable(cache_dir: str) -> None:
  """Turns JAX's persistent compilation cache on in `cache_dir` (empty: leaves it off).

  Every program is cached, however fast it compiled: on CPU the demo's
  programs take under JAX's default threshold of 1 s each, and many small
  ones add up.
  """
  if not cache_dir:
    return
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  logging.info("compiled programs are cached in %s (compile_cache_dir; empty turns it off)",
               cache_dir)


class _CompileSeconds:
  """Seconds of XLA compilation (cache loads included) in this process since the last `take()`.

  Built on JAX's monitoring events, so every compilation counts, whichever
  thread or module triggered it.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._seconds = 0.0
    jax.monitoring.register_event_duration_secs_listener(self._record)

  def _record(self, event: str, seconds: float, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
      with self._lock:
        self._seconds += seconds

  def take(self) -> float:
    """The seconds since the last call (or since construction), and a new count from 0."""
    with self._lock:
      seconds, self._seconds = self._seconds, 0.0
    return seconds


_COUNTER: _CompileSeconds | None = None


def compile_seconds() -> _CompileSeconds:
  """The process's one counter (JAX's listeners cannot be removed: one is registered, once)."""
  global _COUNTER
  if _COUNTER is None:
    _COUNTER = _CompileSeconds()
  return _COUNTER
