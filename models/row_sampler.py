"""The row engine: dialogues handled one row at a time (continuous batching).

A `RowBatch` is the device state of such dialogues: a per-row-length cache
(each row holds its own tokens contiguously, see `KVCache`) and each row's
next-token logits. `prefill_rows` writes new tokens into chosen rows at their
own offsets; `decode_rows` runs one jitted chunk of at most
`decode_chunk_steps` steps for chosen rows (per-row token budgets, keys and
stop tokens) and hands back what each produced. Rows not chosen keep their
cache and cost nothing: a call gathers its rows into a small batch, runs, and
scatters them back. On a mesh each data shard gathers the chosen rows it holds
(no cache row crosses devices) and a call decodes as many rows on every shard,
so callers choose rows spread evenly over the shards (`RowBatch.shard`).

Row programs come from a fixed set per `RowBatch`, known before the first
call (`models/row_programs.py`, with their bodies), whatever order dialogues
become ready in: the
capacity is fixed when the rows start; a call takes one of three widths
(`RowBatch.widths`) and a decode chunk attends over one of three slot counts
(`RowBatch.slot_levels`); a prefill feeds `prefill_chunk` tokens per row
(longer feeds take several calls) and attends over the whole capacity.
`compile_rows` compiles the set in parallel ahead of the first call.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import time
from typing import Sequence

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh

from models import group_channel, partitioning, row_programs
from models.qwen2 import KVCache
from models.row_programs import (DECODE_CHUNK_STEPS, PREFILL_CHUNK, RowCall,
                                 attended_slot_levels, key_data_shape, row_program, row_widths)
from models.sampler_weights import SamplerWeights
from models.sampling import MIN_CACHE_BUCKET, SamplingParams, bucket_size


@dataclasses.dataclass
class RowBatch:
  """Device state of dialogue rows handled one at a time (see `RowSampler.prefill_rows`).

  `lengths` mirrors the cache's per-row lengths on the host (tokens each row holds).
  The B rows are split over `shards` data shards in blocks: shard s holds rows
  [s * B / shards, (s + 1) * B / shards).
  """

  cache: KVCache  # per-row layout
  logits_bv: jax.Array  # float32 [B, V]: each row's next-token logits
  lengths: np.ndarray  # int [B]
  num_rows: int
  shards: int = 1
  min_slots: int = MIN_CACHE_BUCKET  # the fewest slots a decode chunk attends over

  @property
  def rows_per_shard(self) -> int:
    return self.batch_size // self.shards

  def shard(self, row: int) -> int:
    """The data shard that holds `row`."""
    return row // self.rows_per_shard

  @property
  def capacity(self) -> int:
    return self.cache.max_len

  @property
  def batch_size(self) -> int:
    return self.cache.kv_positions_bs.shape[0]

  @property
  def widths(self) -> tuple[int, ...]:
    return row_widths(self.batch_size, self.shards)

  @property
  def slot_levels(self) -> tuple[int, ...]:
    return attended_slot_levels(self.capacity, self.min_slots)

  def width_for(self, rows: int) -> int:
    """The width a call on `rows` rows (spread evenly over the shards) is padded to."""
    return next(w for w in self.widths if w >= rows)

  def slots_for(self, tokens: int) -> int:
    """The slot count a decode chunk whose rows hold up to `tokens` tokens attends over."""
    return next((s for s in self.slot_levels if s >= tokens), self.capacity)

  def call_index(self, rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where a row call reads and writes `rows`: (index_k, rows_k, place of each row in them).

    Each data shard gathers rows of its own only (no cache row crosses
    shards), so `index_k` is laid out per shard: of its `width` entries, block
    s (width / shards of them, the batch axis's split) holds the local ids in
    shard s of the rows it holds, padded with an out-of-range id (read
    clamped, written nowhere). `rows_k` holds the same rows' global ids, padded
    with the batch size, for what every device holds whole (the lengths). The
    width is `width_for(shards x the most rows any one shard holds)`: rows
    spread evenly over the shards pad least.
    """
    if len(set(rows)) != len(rows) or any(not 0 <= r < self.num_rows for r in rows):
      raise IndexError(f"rows {list(rows)}: need distinct rows in [0, {self.num_rows})")
    by_shard = [[] for _ in range(self.shards)]
    for place, row in enumerate(rows):
      by_shard[self.shard(row)].append(place)
    width = self.width_for(self.shards * max(len(places) for places in by_shard))
    per_shard = width // self.shards
    index_k = np.full(width, self.rows_per_shard, np.int32)
    rows_k = np.full(width, self.batch_size, np.int32)
    slot_of_row = np.empty(len(rows), np.int64)
    for shard, places in enumerate(by_shard):
      for i, place in enumerate(places):
        slot = shard * per_shard + i
        slot_of_row[place] = slot
        rows_k[slot] = rows[place]
        index_k[slot] = rows[place] - shard * self.rows_per_shard
    return index_k, rows_k, slot_of_row


@dataclasses.dataclass
class RowChunk:
  """What one `decode_rows` call produced, one entry per requested row."""

  tokens: list[list[int]]  # new tokens (the stop token included when hit)
  logprobs: list[list[float]]
  finished: list[bool]  # hit a stop token or its budget
  stopped: list[bool]  # hit a stop token
  steps: int  # decode steps the chunk ran
  width: int  # rows it decoded, padding included


class RowSampler:
  """Samples dialogues one row at a time (`start_rows`, `prefill_rows`, `decode_rows`,
  `compile_rows`) from `weights`.

  In a sampler group of several hosts (`weights.group`), the leader calls these and every
  other host `follow`s: each of the leader's device programs (the empty rows, a cache grown,
  a prefill or decode chunk) is announced with its host inputs first, and the followers
  dispatch it alike (`models/group_channel.py`). `leading()` brackets a leader's rollout.
  """

  def __init__(self, weights: SamplerWeights, *, decode_chunk_steps: int = DECODE_CHUNK_STEPS,
               prefill_chunk: int = PREFILL_CHUNK):
    """`decode_chunk_steps`: the most steps one `decode_rows` call runs; `prefill_chunk`: the
    tokens one prefill call feeds a row."""
    self.weights = weights
    self.decode_chunk_steps = decode_chunk_steps
    self.prefill_chunk = prefill_chunk
    self.row_capacity = 0  # the largest capacity a RowBatch has had (see `start_rows`)
    self._row_executables = {}  # (rows, RowCall, decode static args) -> compiled program
    self._empty_rows_programs = {}  # (rows, capacity) -> jitted empty RowBatch

  # A sampler group's leader and followers.

  @contextlib.contextmanager
  def leading(self):
    """A leader's rollout: on leaving, the followers are told it ended (also when it fails or
    stops on a signal, so that they do not wait for it)."""
    try:
      yield
    finally:
      if self._leads():
        with group_channel.signals_held():
          self.weights.group.send([_END])

  def follow(self) -> None:
    """A follower's rollout: dispatches the leader's row programs, as the leader announces
    them, until it ends (`leading`)."""
    rb = None
    while True:
      fields, payload = self.weights.group.receive()
      op = int(fields[0])
      if op == _END:
        return
      if op == _START:
        rb = self.start_rows(int(fields[1]), int(fields[2]))
      elif op == _COMPILE:
        self._compile_rows(rb, _decode_static(fields[1:4]))
      elif op == _GROW:
        self._fit(rb, int(fields[1]))
      else:
        kind = "prefill_rows" if op == _PREFILL else "decode_rows"
        call = RowCall(kind, *(int(f) for f in fields[1:5]))
        static = _decode_static(fields[5:8]) if op == _DECODE else {}
        self._dispatch(rb, call, static, _unpack(payload, _input_layout(call)))

  def _leads(self) -> bool:
    group = self.weights.group
    return group is not None and group.is_leader

  @contextlib.contextmanager
  def _announced(self, header, payload=None):
    """A leader's device work, announced to the followers first; no stop signal lands between
    the message and the work (the followers would wait on a collective)."""
    if not self._leads():
      yield
      return
    with group_channel.signals_held():
      self.weights.group.send(header, payload)
      yield

  # Rows.

  def start_rows(self, num_rows: int, capacity: int = 0) -> RowBatch:
    """`num_rows` empty rows of `capacity` slots each (a bucket size).

    The sampler keeps the largest capacity its rows have had and starts every
    `RowBatch` with at least that many slots, so a run's rollouts share one
    set of row programs (`row_program_set`). A row that outgrows the capacity
    grows the cache and compiles the set for the new capacity (logged).
    """
    min_cache_bucket = self.weights.min_cache_bucket
    shards = self.weights.data_parallel_size()
    batch = math.lcm(num_rows, shards)
    self.row_capacity = max(self.row_capacity, bucket_size(capacity, min_cache_bucket))
    with self._announced([_START, num_rows, capacity]):
      cache, logits_bv = self._empty_rows(batch, self.row_capacity)()
    return RowBatch(cache=cache, logits_bv=logits_bv, lengths=np.zeros(batch, np.int64),
                    num_rows=num_rows, shards=shards, min_slots=min_cache_bucket)

  def _empty_rows(self, batch: int, capacity: int):
    """One jitted program making an empty row cache and logits, placed where they live."""
    if (batch, capacity) not in self._empty_rows_programs:
      weights = self.weights
      self._empty_rows_programs[batch, capacity] = row_programs.empty_rows_program(
          weights.config, weights.mesh, batch, capacity, weights.cache_dtype,
          weights.cache_layers_as_list).fn
    return self._empty_rows_programs[batch, capacity]

  def _fit(self, rb: RowBatch, needed: int) -> None:
    """Grows `rb`'s cache to hold `needed` tokens a row, when it does not."""
    if needed <= rb.capacity:
      return
    with self._announced([_GROW, needed]):
      rb.cache = self.weights.grown(rb.cache, needed)
    self.row_capacity = max(self.row_capacity, rb.capacity)
    logging.warning("a dialogue needs %d cache slots: the row cache grew to %d, and its row "
                    "programs compile again for that capacity", needed, rb.capacity)

  def row_program_set(self, rb: RowBatch) -> list[RowCall]:
    """The row programs calls on `rb` run (`row_program_set`)."""
    return row_programs.row_program_set(rb.batch_size, rb.capacity, rb.shards, rb.min_slots,
                                        self.prefill_chunk)

  def compile_rows(self, rb: RowBatch, params: SamplingParams) -> int:
    """Compiles every row program calls on `rb` with `params` can run, in parallel threads
    (XLA compiles them side by side), skipping those compiled before; returns how many it
    compiled. Calls compile what they need on their own: this only brings it forward."""
    static = params.static()
    with self._announced([_COMPILE, *_static_fields(static)]):
      return self._compile_rows(rb, static)

  def _compile_rows(self, rb: RowBatch, decode_static: dict) -> int:
    missing = [call for call in self.row_program_set(rb)
               if self._row_key(rb, call, decode_static) not in self._row_executables]
    if missing:
      with concurrent.futures.ThreadPoolExecutor(min(len(missing), 8)) as pool:
        list(pool.map(lambda call: self._row_executable(rb, call, decode_static), missing))
    return len(missing)

  def _row_key(self, rb: RowBatch, call: RowCall, decode_static: dict) -> tuple:
    return (rb.batch_size, call) + (tuple(sorted(decode_static.items()))
                                    if call.kind == "decode_rows" else ())

  def _row_executable(self, rb: RowBatch, call: RowCall, decode_static: dict):
    """The compiled program of `call` (compiled now if it is not yet)."""
    key = self._row_key(rb, call, decode_static)
    if key not in self._row_executables:
      weights = self.weights
      abstract = (weights.weight_copy.abstract if weights.weight_copy is not None
                  else _abstract_like(weights.state, weights.mesh))
      with partitioning.mesh_context(weights.mesh):
        program = row_program(weights.graphdef, abstract, weights.config, weights.mesh, call,
                              rb.batch_size, weights.cache_dtype, weights.cache_layers_as_list,
                              decode_static, weights.stop_token_ids, weights.pad_id,
                              self.decode_chunk_steps)
        self._row_executables[key] = program.fn.lower(*program.args, **program.static).compile()
    return self._row_executables[key]

  def _dispatch(self, rb: RowBatch, call: RowCall, decode_static: dict, inputs: list):
    """Runs `call` on `rb` with its host `inputs` (`_input_layout`, in order), after
    announcing it to a group's followers; a decode chunk returns its outputs (device arrays
    whole on every chip), a prefill nothing."""
    header = [_PREFILL if call.kind == "prefill_rows" else _DECODE, call.width, call.capacity,
              call.slots, call.chunk, *_static_fields(decode_static)]
    program = self._row_executable(rb, call, decode_static)
    logical = [(("batch",) + (None,) * (np.ndim(x) - 1)) if np.ndim(x) else () for x in inputs]
    weights = self.weights
    with self._announced(header, _pack(inputs)), partitioning.mesh_context(weights.mesh):
      out = program(weights.state, rb.cache, rb.logits_bv,
                    *(weights.put(x, axes) for x, axes in zip(inputs, logical)))
    if call.kind == "prefill_rows":
      rb.cache, rb.logits_bv = out
      return None
    *outputs, rb.cache, rb.logits_bv = out
    return outputs

  def prefill_rows(self, rb: RowBatch, rows: Sequence[int], new_tokens: Sequence[Sequence[int]],
                   restart: bool = False) -> None:
    """Appends each row's new tokens at that row's own length (from 0 with `restart`), in
    calls of `prefill_chunk` tokens a row."""
    if len(rows) != len(new_tokens) or not rows:
      raise ValueError(f"{len(new_tokens)} token lists for {len(rows)} rows")
    if any(not tokens for tokens in new_tokens):
      raise ValueError("every row needs at least one new token")
    if restart:
      rb.lengths[list(rows)] = 0
    self._fit(rb, max(int(rb.lengths[r]) + len(t) for r, t in zip(rows, new_tokens)))
    chunk = self.prefill_chunk
    for start in range(0, max(len(t) for t in new_tokens), chunk):
      fed = [(r, t[start:start + chunk]) for r, t in zip(rows, new_tokens) if len(t) > start]
      self._prefill_chunk(rb, [r for r, _ in fed], [t for _, t in fed], restart and not start)

  def _prefill_chunk(self, rb: RowBatch, rows: Sequence[int],
                     new_tokens: Sequence[Sequence[int]], restart: bool) -> None:
    index, global_index, slot_of_row = rb.call_index(rows)
    call = RowCall("prefill_rows", len(index), rb.capacity, rb.capacity, self.prefill_chunk)
    tokens_kt = np.full((len(index), call.chunk), self.weights.pad_id, np.int32)
    mask_kt = np.zeros((len(index), call.chunk), np.bool_)
    for k, tokens in zip(slot_of_row, new_tokens):
      tokens_kt[k, :len(tokens)] = tokens  # right-padded: the row's tokens stay contiguous
      mask_kt[k, :len(tokens)] = True
    restart_k = np.full(len(index), restart)
    start = time.perf_counter()
    self._dispatch(rb, call, {}, [index, global_index, tokens_kt, mask_kt, restart_k])
    jax.block_until_ready(rb.logits_bv)
    self.weights.stats.seconds += time.perf_counter() - start
    for r, tokens in zip(rows, new_tokens):
      rb.lengths[r] += len(tokens)

  def decode_rows(self, rb: RowBatch, rows: Sequence[int], budgets: Sequence[int],
                  params: SamplingParams, keys: Sequence[jax.Array] | None,
                  row_ids: Sequence[int], offsets: Sequence[int],
                  stop_after_finished: int = 0) -> RowChunk:
    """Decodes up to `decode_chunk_steps` tokens for each given row.

    A row stops at a stop token or after `budgets[r]` tokens. Row r draws step
    i of its reply with keys[r] folded with row_ids[r], then with offsets[r] + i
    (offsets: tokens of this reply drawn by earlier chunks), so its tokens
    equal `extend`'s with the same key and row id, whatever the chunking;
    greedy decoding needs no keys. `stop_after_finished` > 0 ends the chunk
    early once that many rows finished (their places can then be refilled).

    The call decodes `rb.width_for(shards x m)` rows, m the most `rows` any
    one data shard holds (`RowBatch.shard`): choose rows spread evenly over
    the shards, as many as a width (`rb.widths`), and none is padding.
    """
    start = time.perf_counter()
    steps = self.decode_chunk_steps
    if any(b < 1 for b in budgets):
      raise ValueError(f"budgets {list(budgets)}: every row needs at least one token")
    index, global_index, slot_of_row = rb.call_index(rows)
    needed = max(int(rb.lengths[r]) + min(b, steps) for r, b in zip(rows, budgets))
    self._fit(rb, needed)
    width = len(index)
    call = RowCall("decode_rows", width, rb.capacity, rb.slots_for(needed))

    def pad(values):  # each row's value at its slot, 0 (a budget of 0: not decoded) elsewhere
      padded = np.zeros(width, np.int32)
      padded[slot_of_row] = values
      return padded

    if keys is None and params.temperature:
      raise ValueError("sampling at temperature > 0 needs keys")
    # Raw key data, one row per slot (greedy decoding draws from no key: zeros).
    key_data_kd = np.zeros((width,) + key_data_shape(), np.uint32)
    if keys is not None:
      key_data_kd[slot_of_row] = [np.asarray(jax.random.key_data(key)) for key in keys]
    outputs = self._dispatch(rb, call, params.static(), [
        index, global_index, pad(budgets), key_data_kd, pad(row_ids), pad(offsets),
        np.float32(params.temperature or 1.0), np.float32(params.top_p),
        np.int32(stop_after_finished or width + 1)])
    tokens_kn, logprobs_kn, counts_k, stopped_k, steps_run = jax.device_get(outputs)
    # Back in the order of `rows`.
    tokens_kn, logprobs_kn, counts_k, stopped_k = (
        x[slot_of_row] for x in (tokens_kn, logprobs_kn, counts_k, stopped_k))
    finished = [bool(stopped) or count >= budget
                for stopped, count, budget in zip(stopped_k, counts_k, budgets)]
    rb.lengths[list(rows)] += counts_k
    self.weights.stats.add(time.perf_counter() - start, width, int(steps_run), int(counts_k.sum()),
                   int(rb.lengths[list(rows)].sum()), width * call.slots)
    return RowChunk(tokens=[t[:count].tolist() for t, count in zip(tokens_kn, counts_k)],
                    logprobs=[lp[:count].tolist() for lp, count in zip(logprobs_kn, counts_k)],
                    finished=finished, stopped=[bool(stopped) for stopped in stopped_k],
                    steps=int(steps_run), width=width)


# What a group's leader announces (`models/group_channel.py`): the op, then its fields.
_START, _COMPILE, _GROW, _PREFILL, _DECODE, _END = range(1, 7)


def _static_fields(decode_static: dict) -> list[int]:
  return ([int(decode_static["greedy"]), int(decode_static["top_k"]),
           int(decode_static["use_top_p"])] if decode_static else [])


def _decode_static(fields) -> dict:
  return {"greedy": bool(fields[0]), "top_k": int(fields[1]), "use_top_p": bool(fields[2])}


def _input_layout(call: RowCall) -> list[tuple[tuple[int, ...], np.dtype]]:
  """The shapes and dtypes of a row call's host inputs, in the order `_dispatch` takes them."""
  w = call.width
  if call.kind == "prefill_rows":
    return [((w,), np.int32), ((w,), np.int32), ((w, call.chunk), np.int32),
            ((w, call.chunk), np.bool_), ((w,), np.bool_)]
  return ([((w,), np.int32)] * 3 + [((w,) + key_data_shape(), np.uint32)] +
          [((w,), np.int32)] * 2 + [((), np.float32), ((), np.float32), ((), np.int32)])


def payload_length(call: RowCall) -> int:
  """The int32 words of a row call's announced inputs."""
  return sum(math.prod(shape) for shape, _ in _input_layout(call))


def _pack(inputs) -> np.ndarray:
  """Host inputs as one int32 vector (bools widened, 32-bit words reinterpreted)."""
  words = [np.asarray(x).astype(np.int32) if np.asarray(x).dtype == np.bool_
           else np.ascontiguousarray(x).view(np.int32) for x in inputs]
  return np.concatenate([w.reshape(-1) for w in words])


def _unpack(words: np.ndarray, layout) -> list:
  """`_pack`'s inverse for inputs of `layout`."""
  out, at = [], 0
  for shape, dtype in layout:
    n = math.prod(shape)
    chunk = words[at:at + n]
    at += n
    value = chunk.astype(np.bool_) if dtype == np.bool_ else chunk.view(dtype)
    out.append(value.reshape(shape))
  return out


def _abstract_like(tree, mesh: Mesh | None):
  """Abstract arrays of `tree`'s arrays, with their placement on `mesh` (none without)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=None if mesh is None else x.sharding), tree)
