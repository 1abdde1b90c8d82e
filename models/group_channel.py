"""Small messages from a sampler group's leader to every host of its group, over its mesh.

A sampler group of several hosts (`models/slice_meshes.py`) decodes on one mesh, and every
host of a multi-controller JAX program must dispatch that mesh's programs in the same order
with the same inputs. One host, the leader, runs the group's dialogues: it talks to the
simulator and decides which rows to prefill or decode next. Before each program it
broadcasts what the program is and its host inputs (row ids, tokens, budgets, keys: a few
KB), and the others, in `RowSampler.follow`, dispatch the same program with the same
inputs. The broadcast is itself a program on the group's mesh: each host contributes its
chips' rows of an int32 array [chips, n], the leader's first chip the message and every
other chip zeros, and their sum comes back on every chip (one all-reduce of n words).

A message is a fixed header (`HEADER` int32: an op code, its fields, and the payload's
length) and then, where the header says so, a payload of that many int32. A stop signal
that lands between the two, or between a message and its program, would leave the followers
waiting on a collective the leader never joins: the leader holds SIGTERM and SIGINT back
while it sends and dispatches (`signals_held`), and they arrive just after.
"""

from __future__ import annotations

import contextlib
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

HEADER = 16  # int32 words of a message's header; the last is the payload's length
_HELD_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@contextlib.contextmanager
def signals_held():
  """SIGTERM and SIGINT held pending for the block (in the main thread; elsewhere a no-op:
  Python delivers signals to the main thread only)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _group_broadcast(rows_cn):
  """The message on one chip's row of `rows_cn` (zeros elsewhere), on every chip."""
  return jnp.sum(rows_cn, axis=0)


def broadcast_program(mesh: Mesh) -> jax.stages.Wrapped:
  """The jitted broadcast over `mesh`: int32 [chips, n] with a row per chip in, [n] on every
  chip out."""
  return jax.jit(_group_broadcast, out_shardings=NamedSharding(mesh, PartitionSpec()))


def rows_sharding(mesh: Mesh) -> NamedSharding:
  """A row per chip of the mesh, in its device order."""
  return NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))


def payload_lengths(lengths) -> list[int]:
  """The distinct payload lengths of a set of messages, as the broadcast compiles them."""
  return sorted(set(int(n) for n in lengths if n))


class GroupChannel:
  """The leader (the lowest process `leader` of `mesh`) `send`s; every other host of the
  mesh `receive`s the same messages in the same order."""

  def __init__(self, mesh: Mesh, leader: int):
    self.mesh = mesh
    self.is_leader = jax.process_index() == leader
    flat = list(mesh.devices.flat)
    self._source = next(i for i, d in enumerate(flat) if d.process_index == leader)
    self._own = [(i, d) for i, d in enumerate(flat) if d.process_index == jax.process_index()]
    self._sharding = rows_sharding(mesh)
    self._broadcast = broadcast_program(mesh)

  def send(self, header: np.ndarray, payload: np.ndarray | None = None) -> None:
    """Sends `header` (up to HEADER - 1 int32 fields) and `payload` (int32, any length)."""
    if not self.is_leader:
      raise RuntimeError("only the group's leader sends")
    payload = np.zeros(0, np.int32) if payload is None else np.ascontiguousarray(
        payload, np.int32).reshape(-1)
    words = np.zeros(HEADER, np.int32)
    words[:len(header)] = header
    words[-1] = payload.size
    self._exchange(words)
    if payload.size:
      self._exchange(payload)

  def receive(self) -> tuple[np.ndarray, np.ndarray]:
    """The next message: its header's fields and its payload."""
    words = self._exchange(np.zeros(HEADER, np.int32))
    length = int(words[-1])
    payload = self._exchange(np.zeros(length, np.int32)) if length else np.zeros(0, np.int32)
    return words[:-1], payload

  def _exchange(self, message: np.ndarray) -> np.ndarray:
    zeros = np.zeros_like(message)
    rows = [jax.device_put((message if i == self._source and self.is_leader else zeros)[None],
                           device) for i, device in self._own]
    rows_cn = jax.make_array_from_single_device_arrays(
        (self.mesh.devices.size, message.size), self._sharding, rows)
    return np.asarray(self._broadcast(rows_cn).addressable_data(0))
