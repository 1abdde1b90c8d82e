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
call (`row_program_set`), whatever order dialogues become ready in: the
capacity is fixed when the rows start; a call takes one of three widths
(`RowBatch.widths`) and a decode chunk attends over one of three slot counts
(`RowBatch.slot_levels`); a prefill feeds `prefill_chunk` tokens per row
(longer feeds take several calls) and attends over the whole capacity.
`compile_rows` compiles the set in parallel ahead of the first call.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from models import partitioning, programs, qwen2
from models.qwen2 import KV_CACHE_AXES, KVCache
from models.sampler_base import SamplerBase, abstract_cache, decode_loop
from models.sampling import (MIN_CACHE_BUCKET, SamplingParams, bucket_size, ladder,
                             sampler_fn)

DECODE_CHUNK_STEPS = 32  # steps of one `decode_rows` call, by default
PREFILL_CHUNK = 128  # tokens one `prefill_rows` call feeds a row; a longer feed takes several
# A row call takes one of LADDER_RUNGS widths (the batch, a quarter of it, a sixteenth) and a
# decode chunk attends over one of LADDER_RUNGS slot counts (the capacity, a quarter, ...).
WIDTH_RATIO = 4
SLOT_RATIO = 4


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


@dataclasses.dataclass(frozen=True)
class RowCall:
  """The shapes one row-program compile is keyed by: `width` rows over a cache of
  `capacity` slots per row, attending over the first `slots`; a prefill writes `chunk`
  tokens per row (0 for a decode chunk)."""
  kind: str  # "prefill_rows" or "decode_rows"
  width: int
  capacity: int
  slots: int
  chunk: int = 0

  @property
  def name(self) -> str:
    chunk = f",t={self.chunk}" if self.chunk else ""
    return f"sampler/{self.kind}[w={self.width}{chunk},s={self.slots},c={self.capacity}]"


def row_widths(batch_rows: int, shards: int) -> tuple[int, ...]:
  """The row counts a row call on `batch_rows` rows takes (padded up to): multiples of the
  data shards."""
  return ladder(batch_rows, WIDTH_RATIO, shards, shards)


def attended_slot_levels(capacity: int, min_slots: int) -> tuple[int, ...]:
  """The slot counts a decode chunk over rows of `capacity` slots attends over (every row's
  first slots)."""
  return ladder(capacity, SLOT_RATIO, min(min_slots, capacity))


class RowSampler(SamplerBase):
  """Samples dialogues one row at a time (`start_rows`, `prefill_rows`, `decode_rows`,
  `compile_rows`)."""

  def __init__(self, model: qwen2.Qwen2, *, decode_chunk_steps: int = DECODE_CHUNK_STEPS,
               prefill_chunk: int = PREFILL_CHUNK, **kwargs):
    """`decode_chunk_steps`: the most steps one `decode_rows` call runs; `prefill_chunk`: the
    tokens one prefill call feeds a row; `kwargs` go to `SamplerBase`."""
    super().__init__(model, **kwargs)
    self.decode_chunk_steps = decode_chunk_steps
    self.prefill_chunk = prefill_chunk
    self.row_capacity = 0  # the largest capacity a RowBatch has had (see `start_rows`)
    self._row_executables = {}  # (rows, RowCall, decode static args) -> compiled program
    self._empty_rows_programs = {}  # (rows, capacity) -> jitted empty RowBatch

  def start_rows(self, num_rows: int, capacity: int = 0) -> RowBatch:
    """`num_rows` empty rows of `capacity` slots each (a bucket size).

    The sampler keeps the largest capacity its rows have had and starts every
    `RowBatch` with at least that many slots, so a run's rollouts share one
    set of row programs (`row_program_set`). A row that outgrows the capacity
    grows the cache and compiles the set for the new capacity (logged).
    """
    shards = self.data_parallel_size()
    batch = math.lcm(num_rows, shards)
    self.row_capacity = max(self.row_capacity, bucket_size(capacity, self.min_cache_bucket))
    cache, logits_bv = self._empty_rows(batch, self.row_capacity)()
    return RowBatch(cache=cache, logits_bv=logits_bv, lengths=np.zeros(batch, np.int64),
                    num_rows=num_rows, shards=shards, min_slots=self.min_cache_bucket)

  def _empty_rows(self, batch: int, capacity: int):
    """One jitted program making an empty row cache and logits, placed where they live."""
    if (batch, capacity) not in self._empty_rows_programs:
      self._empty_rows_programs[batch, capacity] = self._empty_rows_program(batch, capacity)
    return self._empty_rows_programs[batch, capacity]

  def _empty_rows_program(self, batch: int, capacity: int):
    def empty():
      cache = KVCache.init_rows(self.config, batch, capacity, self.cache_dtype,
                                self.cache_layers_as_list)
      return cache, jnp.zeros((batch, self.config.vocab_size), jnp.float32)
    if self.mesh is None:
      return jax.jit(empty)
    abstract = abstract_cache(self.config, self.mesh, batch, capacity, self.cache_dtype,
                              self.cache_layers_as_list, per_row=True)
    logits = programs.rows(self.mesh, (batch, self.config.vocab_size), jnp.float32)
    return jax.jit(empty, out_shardings=jax.tree.map(lambda x: x.sharding, (abstract, logits)))

  def _fit(self, rb: RowBatch, needed: int) -> None:
    """Grows `rb`'s cache to hold `needed` tokens a row, when it does not."""
    if needed <= rb.capacity:
      return
    rb.cache = self._grown(rb.cache, needed)
    self.row_capacity = max(self.row_capacity, rb.capacity)
    logging.warning("a dialogue needs %d cache slots: the row cache grew to %d, and its row "
                    "programs compile again for that capacity", needed, rb.capacity)

  def row_program_set(self, rb: RowBatch) -> list[RowCall]:
    """The row programs calls on `rb` run (`row_program_set`)."""
    return row_program_set(rb.batch_size, rb.capacity, rb.shards, rb.min_slots,
                           self.prefill_chunk)

  def compile_rows(self, rb: RowBatch, params: SamplingParams) -> int:
    """Compiles every row program calls on `rb` with `params` can run, in parallel threads
    (XLA compiles them side by side), skipping those compiled before; returns how many it
    compiled. Calls compile what they need on their own: this only brings it forward."""
    missing = [call for call in self.row_program_set(rb)
               if self._row_key(rb, call, params) not in self._row_executables]
    if missing:
      with concurrent.futures.ThreadPoolExecutor(min(len(missing), 8)) as pool:
        list(pool.map(lambda call: self._row_executable(rb, call, params), missing))
    return len(missing)

  def _row_key(self, rb: RowBatch, call: RowCall, params: SamplingParams) -> tuple:
    return (rb.batch_size, call) + (tuple(sorted(params.static().items()))
                                    if call.kind == "decode_rows" else ())

  def _row_executable(self, rb: RowBatch, call: RowCall, params: SamplingParams):
    """The compiled program of `call` (compiled now if it is not yet)."""
    key = self._row_key(rb, call, params)
    if key not in self._row_executables:
      with partitioning.mesh_context(self.mesh):
        program = row_program(self.graphdef, _abstract_like(self.state, self.mesh), self.config,
                              self.mesh,
                              call, rb.batch_size, self.cache_dtype, self.cache_layers_as_list,
                              params, self.stop_token_ids, self.pad_id, self.decode_chunk_steps)
        self._row_executables[key] = program.fn.lower(*program.args, **program.static).compile()
    return self._row_executables[key]

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
    tokens_kt = np.full((len(index), call.chunk), self.pad_id, np.int32)
    mask_kt = np.zeros((len(index), call.chunk), np.bool_)
    for k, tokens in zip(slot_of_row, new_tokens):
      tokens_kt[k, :len(tokens)] = tokens  # right-padded: the row's tokens stay contiguous
      mask_kt[k, :len(tokens)] = True
    restart_k = np.full(len(index), restart)
    program = self._row_executable(rb, call, SamplingParams())
    start = time.perf_counter()
    with partitioning.mesh_context(self.mesh):
      rb.cache, rb.logits_bv = program(
          self.state, rb.cache, rb.logits_bv, self._put(index, ("batch",)),
          self._put(global_index, ("batch",)), self._put(tokens_kt, ("batch", None)),
          self._put(mask_kt, ("batch", None)), self._put(restart_k, ("batch",)))
      jax.block_until_ready(rb.logits_bv)
    self.stats.seconds += time.perf_counter() - start
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
    program = self._row_executable(rb, call, params)
    with partitioning.mesh_context(self.mesh):
      out = program(
          self.state, rb.cache, rb.logits_bv, self._put(index, ("batch",)),
          self._put(global_index, ("batch",)), self._put(pad(budgets), ("batch",)),
          self._put(key_data_kd, ("batch", None)), self._put(pad(row_ids), ("batch",)),
          self._put(pad(offsets), ("batch",)),
          self._put(np.float32(params.temperature or 1.0), ()),
          self._put(np.float32(params.top_p), ()),
          self._put(np.int32(stop_after_finished or width + 1), ()))
      tokens_kn, logprobs_kn, counts_k, stopped_k, steps_run, rb.cache, rb.logits_bv = out
    tokens_kn, logprobs_kn, counts_k, stopped_k, steps_run = jax.device_get(
        (tokens_kn, logprobs_kn, counts_k, stopped_k, steps_run))
    # Back in the order of `rows`.
    tokens_kn, logprobs_kn, counts_k, stopped_k = (
        x[slot_of_row] for x in (tokens_kn, logprobs_kn, counts_k, stopped_k))
    finished = [bool(stopped) or count >= budget
                for stopped, count, budget in zip(stopped_k, counts_k, budgets)]
    rb.lengths[list(rows)] += counts_k
    self.stats.add(time.perf_counter() - start, width, int(steps_run), int(counts_k.sum()),
                   int(rb.lengths[list(rows)].sum()), width * call.slots)
    return RowChunk(tokens=[t[:count].tolist() for t, count in zip(tokens_kn, counts_k)],
                    logprobs=[lp[:count].tolist() for lp, count in zip(logprobs_kn, counts_k)],
                    finished=finished, stopped=[bool(stopped) for stopped in stopped_k],
                    steps=int(steps_run), width=width)


def row_programs(graphdef, stop_token_ids: Sequence[int], pad_id: int):
  """The jitted `(prefill_rows, decode_rows)` programs of a sampler (the planner compiles
  these too). Both donate the cache and the logits."""
  prefill = jax.jit(functools.partial(_prefill_rows, graphdef), donate_argnums=(1, 2),
                    static_argnames=("slots",))
  decode = jax.jit(functools.partial(_decode_rows, graphdef, tuple(stop_token_ids), pad_id),
                   donate_argnums=(1, 2), static_argnames=("steps", "slots", "greedy", "top_k",
                                                           "use_top_p"))
  return prefill, decode


def row_program_set(batch_rows: int, capacity: int, shards: int,
                    min_slots: int = MIN_CACHE_BUCKET,
                    prefill_chunk: int = PREFILL_CHUNK) -> list[RowCall]:
  """Every row program a `RowBatch` of `batch_rows` rows (a multiple of `shards`, the data
  shards) with `capacity` slots a row runs, whatever order its rows are called in: a decode
  chunk at each width (`RowBatch.widths`) and slot count (`RowBatch.slot_levels`), a
  prefill of `prefill_chunk` tokens at each width over the whole capacity. The planner
  compiles these; `RowSampler.compile_rows` compiles them ahead of a rollout."""
  widths = row_widths(batch_rows, shards)
  return ([RowCall("decode_rows", width, capacity, slots)
           for width in widths for slots in attended_slot_levels(capacity, min_slots)] +
          [RowCall("prefill_rows", width, capacity, capacity, prefill_chunk)
           for width in widths])


def row_program(graphdef, params, config: qwen2.Qwen2Config, mesh: Mesh, call: RowCall,
                rows: int, cache_dtype, layers_as_list: bool, sampling: SamplingParams,
                stop_token_ids: Sequence[int] = (0,), pad_id: int = 0,
                steps: int = DECODE_CHUNK_STEPS) -> programs.Program:
  """`call` of the row programs (`row_programs`) that decode from `params` (abstract,
  placed on `mesh`, or on one device with `mesh` None) for a `RowBatch` of `rows` rows, as
  the sampler and the planner compile it."""
  cache = abstract_cache(config, mesh, rows, call.capacity, cache_dtype, layers_as_list,
                         per_row=True)
  on_rows = lambda shape, dtype: _placed(mesh, shape, dtype, ("batch",))
  logits_bv = on_rows((rows, config.vocab_size), jnp.float32)
  width = call.width
  index_k, rows_k = on_rows((width,), jnp.int32), on_rows((width,), jnp.int32)
  prefill, decode = row_programs(graphdef, stop_token_ids, pad_id)
  work = {"kind": call.kind, "rows": width, "slots": call.slots, "capacity": call.capacity}
  if call.kind == "prefill_rows":
    args = (params, cache, logits_bv, index_k, rows_k, on_rows((width, call.chunk), jnp.int32),
            on_rows((width, call.chunk), jnp.bool_), on_rows((width,), jnp.bool_))
    return programs.Program(prefill, args, mesh, {"slots": call.slots}, resident=params,
                            work={**work, "tokens": call.chunk})
  scalar = lambda dtype: _placed(mesh, (), dtype, ())
  key_data_kd = on_rows((width,) + key_data_shape(), jnp.uint32)
  per_row = lambda: on_rows((width,), jnp.int32)  # budgets, row ids, offsets
  args = (params, cache, logits_bv, index_k, rows_k, per_row(), key_data_kd, per_row(),
          per_row(), scalar(jnp.float32), scalar(jnp.float32), scalar(jnp.int32))
  static = {"steps": steps, "slots": call.slots, **sampling.static()}
  return programs.Program(decode, args, mesh, static, resident=params,
                          work={**work, "tokens": steps})


def key_data_shape() -> tuple[int, ...]:
  """The shape of one key's raw data (`jax.random.key_data`) under the default PRNG."""
  return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def _placed(mesh: Mesh | None, shape, dtype, logical_axes) -> jax.ShapeDtypeStruct:
  """An abstract array placed as `partitioning.place` places a real one (the leading
  `logical_axes`, the rest replicated); unplaced without a mesh."""
  if mesh is None:
    return jax.ShapeDtypeStruct(shape, dtype)
  axes = tuple(logical_axes) + (None,) * (len(shape) - len(logical_axes))
  return jax.ShapeDtypeStruct(shape, dtype,
                              sharding=partitioning.named_sharding(axes, shape, mesh))


def _abstract_like(tree, mesh: Mesh | None):
  """Abstract arrays of `tree`'s arrays, with their placement on `mesh` (none without)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=None if mesh is None else x.sharding), tree)


def _batch_mesh_axes() -> tuple[str, ...]:
  """The mesh axes the batch is split over in the program being traced (none without a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  return () if mesh.empty else partitioning.mesh_axes("batch", mesh)


def _on_each_shard(fn, args, batch_dims, out_batch_dims):
  """`fn(*args)` run by every data shard on its own rows: each array of `args` and of fn's
  results (a tuple) is split over the batch mesh axes at its axis in `batch_dims` and
  `out_batch_dims` (counted from the end, so one entry serves a stack of layers' arrays and
  a list of them); other mesh axes are left to the partitioner.

  Each shard's entries of `index_k` are the local ids of rows it holds (see
  `RowBatch.call_index`), so a row call moves no cache row between shards (the
  partitioner, left to take rows by global ids, all-gathers the whole cache).
  """
  axes = _batch_mesh_axes()
  if not axes:
    return fn(*args)
  def specs(trees, dims):
    spec = lambda x, dim: PartitionSpec(*(None,) * (x.ndim + dim), axes)
    return tuple(jax.tree.map(functools.partial(spec, dim=dim), tree)
                 for tree, dim in zip(trees, dims))

  out_specs = specs(jax.eval_shape(fn, *args), out_batch_dims)
  return jax.shard_map(fn, in_specs=specs(args, batch_dims), out_specs=out_specs,
                       axis_names=set(axes))(*args)


# Batch axes, from the end, of (k, v, kv_positions_bs, logits): see `KVCache.map_kv`.
_ROW_ARRAYS_BATCH_DIMS = (-4, -4, -2, -2)


def _gather_rows(cache: KVCache, logits_bv, index_k, rows_k, slots: int):
  """The first `slots` cache slots and the logits of the rows `index_k` names: per data
  shard, local ids of rows in that shard (out-of-range ids read the shard's last row);
  `rows_k` are their global ids (see `RowBatch.call_index`)."""

  def take_local(k, v, kv_positions_bs, logits_bv, index_k):
    take = lambda x, axis: jnp.take(x, index_k, axis=axis, mode="clip")
    take_kv = lambda x: take(x, -4)[..., :slots, :]
    return (jax.tree.map(take_kv, k), jax.tree.map(take_kv, v),
            take(kv_positions_bs, 0)[:, :slots], take(logits_bv, 0))

  k, v, kv_positions_bs, row_logits_kv = _on_each_shard(
      take_local, (cache.k, cache.v, cache.kv_positions_bs, logits_bv, index_k),
      _ROW_ARRAYS_BATCH_DIMS + (-1,), _ROW_ARRAYS_BATCH_DIMS)
  # Per-row lengths are whole on every device (`Sampler` places them so): taken by global id.
  length = jnp.take(cache.length, rows_k, mode="clip")
  return KVCache(k=k, v=v, kv_positions_bs=kv_positions_bs, length=length), row_logits_kv


def _scatter_rows(cache: KVCache, logits_bv, index_k, rows_k, rows: KVCache, row_logits_kv):
  """Writes rows (their first `rows.max_len` slots) back where `index_k` names them (per data
  shard, local ids; out-of-range ids are dropped); `rows_k` are their global ids."""
  slots = rows.max_len

  def put_local(k, v, kv_positions_bs, logits_bv, index_k, row_k, row_v, row_positions,
                row_logits_kv):
    put_slots = lambda x, new: x.at[..., index_k, :, :slots, :].set(new, mode="drop")
    return (jax.tree.map(put_slots, k, row_k), jax.tree.map(put_slots, v, row_v),
            kv_positions_bs.at[index_k, :slots].set(row_positions, mode="drop"),
            logits_bv.at[index_k].set(row_logits_kv, mode="drop"))

  k, v, kv_positions_bs, logits_bv = _on_each_shard(
      put_local, (cache.k, cache.v, cache.kv_positions_bs, logits_bv, index_k, rows.k, rows.v,
                  rows.kv_positions_bs, row_logits_kv),
      _ROW_ARRAYS_BATCH_DIMS + (-1,) + _ROW_ARRAYS_BATCH_DIMS, _ROW_ARRAYS_BATCH_DIMS)
  length = cache.length.at[rows_k].set(rows.length, mode="drop")
  # Pinned where `RowSampler.start_rows` places them: a row program's outputs are its next
  # call's inputs, and a compiled program takes its inputs only where it was compiled for.
  pin_kv = lambda x: partitioning.constrain(x, KV_CACHE_AXES[-x.ndim:])
  return KVCache(k=jax.tree.map(pin_kv, k), v=jax.tree.map(pin_kv, v),
                 kv_positions_bs=partitioning.constrain(kv_positions_bs, ("batch", None)),
                 length=partitioning.constrain(length, (None,))), partitioning.constrain(
                     logits_bv, ("batch", None))


def _prefill_rows(graphdef, state, cache, logits_bv, index_k, rows_k, tokens_kt, mask_kt,
                  restart_k, *, slots):
  """Writes right-padded new tokens into rows `index_k`; keeps each row's last logits.

  Attends over the first `slots` cache slots only (they hold every row's tokens, new ones
  included).
  """
  model = nnx.merge(graphdef, state)
  rows, _ = _gather_rows(cache, logits_bv, index_k, rows_k, slots)
  rows = rows.replace(length=jnp.where(restart_k, 0, rows.length))
  hidden_ktd, rows = model.backbone(tokens_kt, attention_mask=mask_kt, cache=rows)
  last_k = jnp.sum(mask_kt, axis=1) - 1
  hidden_kd = jnp.take_along_axis(hidden_ktd, last_k[:, None, None], axis=1)
  row_logits_kv = model.logits(hidden_kd)[:, 0]
  return _scatter_rows(cache, logits_bv, index_k, rows_k, rows, row_logits_kv)


def _decode_rows(graphdef, stop_token_ids, pad_id, state, cache, logits_bv, index_k, rows_k,
                 budget_k, key_data_kd, row_id_k, offset_k, temperature, top_p,
                 stop_after_finished, *, steps, slots, greedy, top_k, use_top_p):
  """One chunk of decode steps on the gathered rows, written back at the end.

  Attends over the first `slots` cache slots only (enough for every row's tokens after the
  chunk), not the whole capacity. Returns tokens and logprobs [K, steps], tokens drawn [K],
  stopped [K], steps run.
  """
  model = nnx.merge(graphdef, state)
  rows, row_logits_kv = _gather_rows(cache, logits_bv, index_k, rows_k, slots)
  row_keys_k = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data_kd), row_id_k)
  step, tokens_kn, logprobs_kn, counts_k, stopped_k, row_logits_kv, rows = decode_loop(
      model, stop_token_ids, pad_id, sampler_fn(temperature, top_p, greedy, top_k, use_top_p),
      rows, row_logits_kv, budget_k <= 0, budget_k, row_keys_k, offset_k, stop_after_finished,
      steps=steps)
  cache, logits_bv = _scatter_rows(cache, logits_bv, index_k, rows_k, rows, row_logits_kv)
  return tokens_kn, logprobs_kn, counts_k, stopped_k, step, cache, logits_bv
