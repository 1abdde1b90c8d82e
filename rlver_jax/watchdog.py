"""Stops every host of a multi-host run, naming the lost one, when one host dies, hangs or
fails alone.

Its own module because it stands on JAX's private coordination client
(`jax._src.distributed`): what leans on a private API is kept in one place,
apart from the hosts' data movement (`rlver_jax/multihost.py`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import jax
from absl import logging
from jax._src import distributed

from rlver_jax import sharding

LOST_HOST_EXIT_CODE = 3


class LostHostError(RuntimeError):
  pass


_EXITED_KEY = "rlver/exited"  # "process N: why", set by a host that stops the run
_BEAT_DIR = "rlver/beat/"  # rlver/beat/N: a counter host N's watcher raises every poll
_FINISHED = "finished"  # the last beat of a host that left the run normally


@contextlib.contextmanager
def stop_when_a_host_is_lost(answer_within_s: float | None = None, poll_s: float = 0.5):
  """Stops every host, with an error naming the lost one, when one host dies, hangs or fails alone.

  JAX's own answer to a lost host is an abort of every other host once the
  coordination service misses its heartbeats for RLVER_HEARTBEAT_TIMEOUT_S
  (SIGABRT, a thread dump, no word on which host). To answer first, a watcher
  thread on every host posts a beat every `poll_s` and reads the others': a
  host whose beat has not moved for `answer_within_s` (default: half the
  heartbeat timeout) is lost, whatever this host is doing meanwhile (a
  rollout that makes no collective call, or a collective that waits for the
  lost host). A host that raises checks in with the others and waits up to
  `answer_within_s` for them: if all check in (an error raised on every host
  alike), the error is re-raised unchanged. Either way a host that finds a
  lost one posts why it stops and exits with LOST_HOST_EXIT_CODE at once
  (JAX's shutdown barrier would wait for the lost host); every other host's
  watcher reads that post within `poll_s` and exits the same way.
  """
  client = distributed.global_state.client
  if client is None or jax.process_count() == 1:
    yield
    return
  if answer_within_s is None:
    answer_within_s = sharding.heartbeat_timeout_s() / 2
  me, count = jax.process_index(), jax.process_count()
  done = threading.Event()

  def stop(lost: list[int], cause: str) -> None:
    done.set()
    why = (f"stopping: process(es) {lost} did not answer within {answer_within_s:g} s; "
           f"here: {cause}")
    try:  # the other hosts' watchers read this and stop too
      client.key_value_set(_EXITED_KEY, f"process {me}: {why}", allow_overwrite=True)
    except Exception:  # the coordinator, in process 0, is gone
      pass
    _exit(f"process {me} of {count}: {why}")

  def watch():
    beat = 0
    last_moved = {peer: (None, time.monotonic()) for peer in range(count) if peer != me}
    unreachable_since = None
    while not done.wait(poll_s):
      now = time.monotonic()
      try:
        client.key_value_set(f"{_BEAT_DIR}{me}", str(beat), allow_overwrite=True)
        posted = dict(client.key_value_dir_get("rlver/"))
      except Exception:  # the coordinator does not answer
        unreachable_since = unreachable_since or now
        if now - unreachable_since > answer_within_s and not done.is_set():
          stop([0], "the coordinator (process 0) does not answer")
        continue
      unreachable_since = None
      beat += 1
      post = posted.get(_EXITED_KEY)
      if post is not None and not post.startswith(f"process {me}:"):
        _exit(f"process {me} of {count}: {post}")
      for peer, (seen, _) in list(last_moved.items()):
        value = posted.get(f"{_BEAT_DIR}{peer}")
        if value == _FINISHED:
          del last_moved[peer]
        elif value != seen:
          last_moved[peer] = (value, now)
      silent = sorted(p for p, (_, since) in last_moved.items() if now - since > answer_within_s)
      if silent and not done.is_set():
        stop(silent, "no heartbeat from them")

  watcher = threading.Thread(target=watch, name="lost-host watcher", daemon=True)
  watcher.start()
  try:
    yield
  except Exception as e:
    cause = f"{type(e).__name__}: {str(e)[:300]}"
    try:
      client.key_value_set(f"rlver/alive_after_error/{me}", "1", allow_overwrite=True)
    except Exception:  # the coordinator, in process 0, is gone
      lost = [0]
    else:
      lost = []
      for peer in range(count):
        try:
          client.blocking_key_value_get(f"rlver/alive_after_error/{peer}",
                                        int(answer_within_s * 1000))
        except Exception:  # the coordinator's timeout: the peer never checked in
          lost.append(peer)
    if lost:
      stop(lost, cause)
    raise
  finally:
    done.set()
    watcher.join()  # no coordinator call may outlive the client's shutdown
    try:  # a host that leaves normally is not lost
      client.key_value_set(f"{_BEAT_DIR}{me}", _FINISHED, allow_overwrite=True)
    except Exception:
      pass


def guarded(fn):
  """`fn(config)` with jax.distributed started and `stop_when_a_host_is_lost` around it."""

  def run(config):
    sharding.maybe_initialize_distributed()
    with stop_when_a_host_is_lost():
      return fn(config)

  return run


def _exit(message: str) -> None:
  error = LostHostError(f"{message}. Relaunch every process with the same command to resume "
                        "from the last checkpoint")
  logging.error("%s", error)
  print(f"error: {error}", file=sys.stderr, flush=True)
  logging.flush()
  os._exit(LOST_HOST_EXIT_CODE)
