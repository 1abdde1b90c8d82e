"""Jitted KV-cache sampling for Qwen2: prefill, a `lax.while_loop` decode, multi-turn reuse.

The model is split once into a graphdef (static, closed over by the jitted
functions) and its state (weights, passed as an argument), so new weights
from a train step are used without retracing. The cache is donated to every
call and comes back updated.

Shapes are bucketed so that new prompt lengths rarely recompile: the batch is
padded to a power of two (and a multiple of the data-parallel size), each new
chunk of tokens to a power of two, and the cache to a power of two of slots.
New chunks are left-padded so that the last column holds every row's last
real token; padding slots carry position -1 and are never attended.

A `Conversations` object is the device state of a batch of dialogues. Each
`extend` call prefills only the new tokens of every row (the user's reply and
the next role header) after what the cache already holds, then decodes; a
dialogue of T turns never re-prefills its history. `select` keeps a subset
of rows (finished dialogues drop out) by gathering their cache rows. Both
update the `Conversations` in place: its cache is donated to every call.

Every call returns `Completions`, one continuation per row; a training
sequence (`rl.agent.Sample`) is built from them by the agent.

A `RowBatch` is the device state of dialogues handled one row at a time
(continuous batching): a per-row-length cache (each row holds its own
tokens contiguously, see `KVCache`) and each row's next-token logits.
`prefill_rows` writes new tokens into chosen rows at their own offsets;
`decode_rows` runs one jitted chunk of at most `decode_chunk_steps` steps for
chosen rows (per-row token budgets, keys and stop tokens) and hands back
what each produced. Rows not chosen keep their cache and cost nothing: a call
gathers its rows into a small batch, runs, and scatters them back. On a mesh
each data shard gathers the chosen rows it holds (no cache row crosses
devices) and a call decodes as many rows on every shard, so callers choose
rows spread evenly over the shards (`RowBatch.shard`).

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

from models import host_metrics, partitioning, programs, qwen2
from models.qwen2 import KV_CACHE_AXES, KVCache, Qwen2

DECODE_CHUNK_STEPS = 32  # steps of one `decode_rows` call, by default
MIN_CHUNK_BUCKET = 16  # the fewest tokens a prefill chunk is padded to
MIN_CACHE_BUCKET = 256  # the fewest cache slots a cache holds or a row call attends over
PREFILL_CHUNK = 128  # tokens one `prefill_rows` call feeds a row; a longer feed takes several
# A row call takes one of LADDER_RUNGS widths (the batch, a quarter of it, a sixteenth) and a
# decode chunk attends over one of LADDER_RUNGS slot counts (the capacity, a quarter, ...).
LADDER_RUNGS = 3
WIDTH_RATIO = 4
SLOT_RATIO = 4
STOP = "stop"
LENGTH = "length"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  max_new_tokens: int = 256
  temperature: float = 1.0  # 0: greedy
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  def static(self) -> dict:
    """The static arguments of the decode programs these settings compile."""
    return {"greedy": self.temperature == 0, "top_k": self.top_k, "use_top_p": self.top_p < 1.0}


@dataclasses.dataclass
class Completions:
  """The sampler's output: one continuation per row, in row order."""

  tokens: list[list[int]]  # [rows][new tokens]: all the cache now holds, the stop token included
  logprobs: list[list[float]]  # [rows][new tokens]: each token's sampling logprob
  stop_reasons: list[str]  # [rows]: STOP (a stop token ends `tokens`) or LENGTH (max_new_tokens)

  @property
  def lengths(self) -> list[int]:
    return [len(t) for t in self.tokens]

  @property
  def ended(self) -> list[bool]:
    """Per row: the continuation ended on a stop token (it was not cut at max_new_tokens)."""
    return [reason == STOP for reason in self.stop_reasons]

  def texts(self, tokenizer, skip_special_tokens: bool = False) -> list[str]:
    """Each row's text without its stop token."""
    return [tokenizer.decode(tokens[:-1] if ended else tokens,
                             skip_special_tokens=skip_special_tokens)
            for tokens, ended in zip(self.tokens, self.ended)]


@dataclasses.dataclass
class DecodeStats:
  """What a sampler's calls did, summed from its start (subtract two copies for a span)."""

  seconds: float = 0.0  # wall time of prefill and decode calls, results fetched
  row_steps: int = 0  # decoding rows, padding included, x decode steps run
  tokens: int = 0  # tokens drawn for real rows
  # over decode calls, sum of row_steps x (tokens held / cache slots the decoding rows attend
  # over: the batch cache's, or a row call's attended slots)
  occupancy: float = 0.0

  def add(self, seconds: float, rows: int, steps: int, tokens: int, held: int,
          slots: int) -> None:
    self.seconds += seconds
    self.row_steps += rows * steps
    self.tokens += tokens
    self.occupancy += rows * steps * held / max(slots, 1)

  def since(self, earlier: "DecodeStats") -> "DecodeStats":
    return DecodeStats(*(getattr(self, f.name) - getattr(earlier, f.name)
                         for f in dataclasses.fields(self)))

  # Over hosts: the per-row-step figures weigh by row-steps; a step waits for the slowest decode.
  host_metrics.declare({"rollout/slot_efficiency": host_metrics.weighted("rollout/row_steps"),
                        "rollout/cache_occupancy": host_metrics.weighted("rollout/row_steps"),
                        "rollout/row_steps": host_metrics.SUM,
                        "rollout/decode_s": host_metrics.MAX})

  def metrics(self) -> dict:
    """`rollout/` figures of a span: slot efficiency (tokens / row-steps), cache occupancy of
    the slots the decoding rows attend over (averaged over row-steps), the row-steps (their weight when hosts
    combine them) and decode time."""
    return {"rollout/slot_efficiency": self.tokens / max(self.row_steps, 1),
            "rollout/cache_occupancy": self.occupancy / max(self.row_steps, 1),
            "rollout/row_steps": self.row_steps, "rollout/decode_s": self.seconds}


@dataclasses.dataclass
class RowBatch:
  """Device state of dialogue rows handled one at a time (see `Sampler.prefill_rows`).

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


@dataclasses.dataclass
class RowChunk:
  """What one `decode_rows` call produced, one entry per requested row."""

  tokens: list[list[int]]  # new tokens (the stop token included when hit)
  logprobs: list[list[float]]
  finished: list[bool]  # hit a stop token or its budget
  stopped: list[bool]  # hit a stop token
  steps: int  # decode steps the chunk ran
  width: int  # rows it decoded, padding included


@dataclasses.dataclass
class Conversations:
  """Device state of a batch of dialogues: the KV cache and what each real row is."""

  cache: KVCache
  row_ids: list[int]  # [rows]: each real row's id, folded into its sampling key
  reply_ended: list[bool]  # [rows]: the row's last continuation ended on a stop token

  @property
  def num_rows(self) -> int:
    return len(self.row_ids)

  @property
  def batch_size(self) -> int:
    return self.cache.kv_positions_bs.shape[0]

  @property
  def capacity(self) -> int:
    return self.cache.max_len


def bucket_size(n: int, minimum: int = 1) -> int:
  """The power of two >= n (and >= minimum) that shapes of size n are padded to."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def ladder(top: int, ratio: int, bottom: int = 1, multiple: int = 1) -> tuple[int, ...]:
  """Up to LADDER_RUNGS sizes, ascending: `top`, top / ratio, top / ratio^2 (rounded up),
  each at least `bottom` and a multiple of `multiple`; `top` must be one."""
  sizes = {-(-max(bottom, -(-top // ratio ** rung)) // multiple) * multiple
           for rung in range(LADDER_RUNGS)}
  return tuple(sorted(sizes))


def row_widths(batch_rows: int, shards: int) -> tuple[int, ...]:
  """The row counts a row call on `batch_rows` rows takes (padded up to): multiples of the
  data shards."""
  return ladder(batch_rows, WIDTH_RATIO, shards, shards)


def attended_slot_levels(capacity: int, min_slots: int) -> tuple[int, ...]:
  """The slot counts a decode chunk over rows of `capacity` slots attends over (every row's
  first slots)."""
  return ladder(capacity, SLOT_RATIO, min(min_slots, capacity))


def sample_logits(logits_bv, key, temperature, top_p, *, greedy: bool, top_k: int,
                  use_top_p: bool):
  """Samples one token per row; returns (tokens [B], logprobs [B]).

  `key` is one key for the batch, or one key per row ([B]): then a row's draw
  does not depend on which batch it is in.

  Log-probabilities are of the sampled token under softmax(logits / T) before
  top-k/top-p truncation (raw logits when greedy): the policy's own
  distribution, as RL needs it.
  """
  logits_bv = logits_bv.astype(jnp.float32)
  if greedy:
    tokens_b = jnp.argmax(logits_bv, axis=-1)
    logprobs_bv = jax.nn.log_softmax(logits_bv, axis=-1)
  else:
    logits_bv = logits_bv / temperature
    logprobs_bv = jax.nn.log_softmax(logits_bv, axis=-1)
    filtered_bv = logits_bv
    if top_k:
      kth_b1 = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
      filtered_bv = jnp.where(logits_bv < kth_b1, -jnp.inf, filtered_bv)
    if use_top_p:
      sorted_bv = -jnp.sort(-filtered_bv, axis=-1)
      probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
      # Keep the smallest prefix whose mass reaches top_p (at least one token).
      kept_b = jnp.sum(jnp.cumsum(probs_bv, axis=-1) - probs_bv < top_p, axis=-1)
      threshold_b1 = jnp.take_along_axis(sorted_bv, kept_b[:, None] - 1, axis=-1)
      filtered_bv = jnp.where(filtered_bv < threshold_b1, -jnp.inf, filtered_bv)
    if jnp.ndim(key):
      tokens_b = jax.vmap(jax.random.categorical)(key, filtered_bv)
    else:
      tokens_b = jax.random.categorical(key, filtered_bv, axis=-1)
  logprob_b = jnp.take_along_axis(logprobs_bv, tokens_b[:, None], axis=-1)[:, 0]
  return tokens_b.astype(jnp.int32), logprob_b


def layers_as_list(sampling_layout: str, mesh: Mesh | None) -> bool:
  """Whether the sampler's weight copy holds the decoder layers as a list (`qwen2.unscanned`).

  A list decodes from each layer's own arrays, where a scan slices them out of the stack
  (the CPU backend copies every slice, every token). But FSDP-sharded weights (the "train"
  layout on a mesh) stay a stack under a scan: each layer's all-gather then lives one layer
  at a time, where XLA gathers a list's layers all at once (7B at 16k on fsdp=8: row
  prefill +36.0 GiB against +9.6).
  """
  return mesh is None or sampling_layout == "decode"


def decoding_copy(graphdef, state, dtype, as_list: bool):
  """The sampler's copy of a model's weights, to decode from: floating weights in `dtype`;
  with `as_list`, the decoder layers a list of modules with arrays of their own.

  `state` may be abstract. Returns the copy's graphdef, its abstract state and
  `copy(state)`, which makes the copy from the model's weights (jit it: the layers'
  slices are then its outputs, not eager copies).
  """
  graphdefs = []

  def copy(state):
    cast = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, state)
    model = nnx.merge(graphdef, cast)
    copy_graphdef, copy_state = nnx.split(qwen2.unscanned(model) if as_list else model)
    graphdefs.append(copy_graphdef)  # static: the same at every trace
    return copy_state

  abstract_copy = jax.eval_shape(copy, state)
  return graphdefs[0], abstract_copy, copy


class WeightCopy:
  """The sampler's resident copy of the policy's weights in `dtype` and `layout`
  (`partitioning.SAMPLING_LAYOUTS`): its graphdef, abstract placed state and jitted programs.

  `make(state)` builds the copy; `refresh(old_copy, state)` rewrites it in place from new
  training weights (the old copy is donated, and kept though unread: jit drops unused
  arguments, and their donation with them), once per training step.
  """

  def __init__(self, graphdef, state, dtype, layout: str, mesh: Mesh | None):
    if layout not in partitioning.SAMPLING_LAYOUTS:
      raise ValueError(f"sampling_layout={layout!r}: expected one of "
                       f"{tuple(partitioning.SAMPLING_LAYOUTS)}")
    self.as_list = layers_as_list(layout, mesh)
    self.graphdef, abstract_copy, copy = decoding_copy(graphdef, state, dtype, self.as_list)
    shardings = (None if mesh is None else partitioning.state_shardings(
        abstract_copy, mesh, partitioning.SAMPLING_LAYOUTS[layout]))
    self.abstract = abstract_copy if mesh is None else programs.abstract(abstract_copy,
                                                                          shardings)
    self.make = jax.jit(copy, out_shardings=shardings)
    self.refresh = jax.jit(lambda old, new: copy(new), donate_argnums=(0,), keep_unused=True,
                           out_shardings=shardings)

  def refresh_program(self, mesh: Mesh, abstract_state) -> programs.Program:
    """The refresh from training weights `abstract_state`, as the planner compiles it."""
    return programs.Program(self.refresh, (self.abstract, abstract_state), mesh,
                            resident=(self.abstract, abstract_state),
                            work={"kind": "copy_weights"})


class Sampler:
  """Generation engine for one Qwen2 policy.

  `stop_token_ids` end a row (the stop token is returned as its last token);
  `pad_id` fills padding. With a `mesh`, batch rows shard over the data axes
  and the cache's kv heads over the tensor axis, like the weights.
  """

  def __init__(self, model: Qwen2, *, stop_token_ids: Sequence[int], pad_id: int = 0,
               mesh: Mesh | None = None, cache_dtype=None,
               min_chunk_bucket: int = MIN_CHUNK_BUCKET,
               min_cache_bucket: int = MIN_CACHE_BUCKET,
               decode_chunk_steps: int = DECODE_CHUNK_STEPS, prefill_chunk: int = PREFILL_CHUNK,
               sampling_dtype=None, sampling_layout: str = "decode"):
    """`sampling_dtype` (opt-in, e.g. bfloat16): decode from a copy of the weights in
    that dtype (`decoding_copy`; its layers a list where `layers_as_list`), placed by the
    rules of `partitioning.SAMPLING_LAYOUTS[sampling_layout]` ("decode": split over tensor
    only, so no FSDP all-gather per token; "train": sharded like the training weights);
    `update_weights` refreshes it in place."""
    self.config = model.config
    self.graphdef, state = nnx.split(model)
    self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
    self.pad_id = int(pad_id)
    self.mesh = mesh
    self.cache_dtype = jnp.dtype(cache_dtype or model.backbone.dtype)
    self.min_chunk_bucket = min_chunk_bucket
    self.min_cache_bucket = min_cache_bucket
    self.decode_chunk_steps = decode_chunk_steps
    self.prefill_chunk = prefill_chunk
    self.row_capacity = 0  # the largest capacity a RowBatch has had (see `start_rows`)
    self._row_executables = {}  # (rows, RowCall, decode static args) -> compiled program
    self._empty_rows_programs = {}  # (rows, capacity) -> jitted empty RowBatch
    self.sampling_dtype = None if sampling_dtype is None else jnp.dtype(sampling_dtype)
    self.stats = DecodeStats()
    self._refresh = None
    # The cache follows the layers it is decoded with: one array per layer for a list.
    self.cache_layers_as_list = isinstance(model.backbone.layers, nnx.List)
    if self.sampling_dtype is not None:
      copy = WeightCopy(self.graphdef, state, self.sampling_dtype, sampling_layout, mesh)
      self.cache_layers_as_list = copy.as_list
      self.graphdef, self._refresh = copy.graphdef, copy.refresh
      self.state = copy.make(state)
    else:
      self.state = partitioning.place_state(state, mesh)
    self._prefill, self._decode = batch_programs(self.graphdef, self.stop_token_ids,
                                                 self.pad_id)

  def update_weights(self, model_or_state) -> None:
    """Uses new weights (a model or its state) without recompiling."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    self.state = state if self._refresh is None else self._refresh(self.state, state)

  # Placement.

  def data_parallel_size(self) -> int:
    """How many ways the batch axis is split (batches are padded to a multiple)."""
    if self.mesh is None:
      return 1
    axes = partitioning.mesh_axes("batch", self.mesh)
    return math.prod(self.mesh.shape[a] for a in axes)

  def _batch_bucket(self, num_rows: int) -> int:
    return math.lcm(bucket_size(num_rows), self.data_parallel_size())

  def _put(self, array, logical_axes):
    """A host array placed for a call on the mesh; without one, as it is (a jitted program
    takes host arrays as they are, where making each a device array first compiles a small
    program per shape)."""
    return array if self.mesh is None else partitioning.place(array, logical_axes, self.mesh)

  def _place_cache(self, cache: KVCache) -> KVCache:
    if self.mesh is None:
      return cache
    return cache.map_kv(lambda x: self._put(x, KV_CACHE_AXES[-x.ndim:])).replace(
        kv_positions_bs=self._put(cache.kv_positions_bs, ("batch", "cache_seq")),
        # replicated: a scalar, or [B] per-row lengths the host reads
        length=self._put(cache.length, (None,) * cache.length.ndim))

  # Conversations.

  def start(self, num_rows: int, capacity: int = 0,
            row_ids: Sequence[int] | None = None) -> Conversations:
    """An empty batch of `num_rows` dialogues (capacity grows on demand).

    Row r draws its tokens with the call's key folded with `row_ids[r]`
    (default r): give rows global ids and their tokens do not depend on the
    batch they are in.
    """
    row_ids = list(range(num_rows) if row_ids is None else row_ids)
    if len(row_ids) != num_rows:
      raise ValueError(f"{len(row_ids)} row ids for {num_rows} rows")
    batch = self._batch_bucket(num_rows)
    slots = bucket_size(capacity, self.min_cache_bucket)
    cache = KVCache.init(self.config, batch, slots, self.cache_dtype, self.cache_layers_as_list)
    return Conversations(cache=self._place_cache(cache), row_ids=row_ids,
                         reply_ended=[True] * num_rows)

  def _grown(self, cache: KVCache, needed_slots: int) -> KVCache:
    """`cache` with room for `needed_slots` slots (a bucket size), in either layout."""
    if needed_slots <= cache.max_len:
      return cache
    extra = bucket_size(needed_slots, self.min_cache_bucket) - cache.max_len
    cache = cache.map_kv(lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, extra), (0, 0)]))
    return self._place_cache(cache.replace(kv_positions_bs=jnp.pad(
        cache.kv_positions_bs, ((0, 0), (0, extra)), constant_values=-1)))

  def select(self, convs: Conversations, rows: Sequence[int]) -> None:
    """Keeps the given rows, in that order, in a batch of the smallest bucket."""
    rows = list(rows)
    if not rows:
      raise ValueError("select needs at least one row")
    if any(not 0 <= r < convs.num_rows for r in rows):
      raise IndexError(f"rows {rows} out of range for {convs.num_rows} dialogues")
    batch = self._batch_bucket(len(rows))
    index = jnp.asarray(rows + [rows[0]] * (batch - len(rows)), jnp.int32)
    cache = convs.cache.map_kv(lambda x: x[..., index, :, :, :])
    cache = cache.replace(kv_positions_bs=cache.kv_positions_bs[index])
    # Filler rows duplicate a real row; they are marked done and never read.
    convs.cache = self._place_cache(cache)
    convs.row_ids = [convs.row_ids[r] for r in rows]
    convs.reply_ended = [convs.reply_ended[r] for r in rows]

  def extend(self, convs: Conversations, new_tokens: Sequence[Sequence[int]],
             params: SamplingParams, key: jax.Array | None = None,
             budgets: Sequence[int] | None = None) -> Completions:
    """Appends each row's new tokens to its dialogue, then samples a continuation per row.

    Row r draws its tokens with `key` folded with its row id (see `start`);
    greedy decoding (temperature 0) needs no key. `budgets[r]` (at most
    `params.max_new_tokens`, the default) caps row r's continuation.
    """
    if key is None:
      if params.temperature:
        raise ValueError("sampling at temperature > 0 needs a key")
      key = jax.random.key(0)  # drawn from by no row: greedy decoding takes the argmax
    if len(new_tokens) != convs.num_rows:
      raise ValueError(f"got {len(new_tokens)} token lists for {convs.num_rows} dialogues")
    for row, tokens in enumerate(new_tokens):
      if not tokens:
        raise ValueError(f"row {row}: no new tokens; every row needs at least one")
    chunk = bucket_size(max(len(t) for t in new_tokens), self.min_chunk_bucket)
    needed = int(convs.cache.length) + chunk + params.max_new_tokens
    convs.cache = self._grown(convs.cache, needed)

    batch = convs.batch_size
    tokens_bt = np.full((batch, chunk), self.pad_id, np.int32)
    mask_bt = np.zeros((batch, chunk), np.bool_)
    for row, tokens in enumerate(new_tokens):
      tokens_bt[row, chunk - len(tokens):] = tokens
      mask_bt[row, chunk - len(tokens):] = True
    done_b = np.arange(batch) >= convs.num_rows
    budget_b = np.zeros((batch,), np.int32)
    budget_b[:convs.num_rows] = params.max_new_tokens if budgets is None else np.minimum(
        budgets, params.max_new_tokens)
    row_ids_b = np.zeros((batch,), np.int32)
    row_ids_b[:convs.num_rows] = convs.row_ids

    start = time.perf_counter()
    with partitioning.mesh_context(self.mesh):
      logits_bv, convs.cache = self._prefill(
          self.state, convs.cache, self._put(tokens_bt, ("batch", None)),
          self._put(mask_bt, ("batch", None)))
      out_tokens, out_logprobs, lengths, stopped, held, convs.cache = self._decode(
          self.state, convs.cache, logits_bv, self._put(done_b, ("batch",)),
          self._put(budget_b, ("batch",)), key, self._put(row_ids_b, ("batch",)),
          jnp.float32(params.temperature or 1.0),
          jnp.float32(params.top_p), max_new_tokens=params.max_new_tokens,
          **params.static())

    out_tokens, out_logprobs, lengths, stopped, held = jax.device_get(
        (out_tokens, out_logprobs, lengths, stopped, held))
    rows = range(convs.num_rows)
    self.stats.add(time.perf_counter() - start, batch, int(max(lengths[r] for r in rows)),
                   int(sum(lengths[r] for r in rows)), int(held), batch * convs.capacity)
    convs.reply_ended = [bool(stopped[r]) for r in rows]
    return Completions(
        tokens=[out_tokens[r, :lengths[r]].tolist() for r in rows],
        logprobs=[out_logprobs[r, :lengths[r]].tolist() for r in rows],
        stop_reasons=[STOP if stopped[r] else LENGTH for r in rows])

  def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
               key: jax.Array | None = None,
               row_ids: Sequence[int] | None = None) -> Completions:
    """Samples one continuation per prompt (a fresh batch of one-turn dialogues)."""
    if not prompts:
      return Completions([], [], [])
    longest = max(len(p) for p in prompts)
    convs = self.start(len(prompts), bucket_size(longest, self.min_chunk_bucket)
                       + params.max_new_tokens, row_ids)
    return self.extend(convs, prompts, params, key)

  # Rows, one dialogue at a time.

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
    abstract = _abstract_cache(self.config, self.mesh, batch, capacity, self.cache_dtype,
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

  def _row_index(self, rb: RowBatch, rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray,
                                                                     np.ndarray]:
    """Where a row call reads and writes `rows`: (index_k, rows_k, place of each row in them).

    Each data shard gathers rows of its own only (no cache row crosses
    shards), so `index_k` is laid out per shard: of its `width` entries, block
    s (width / shards of them, the batch axis's split) holds the local ids in
    shard s of the rows it holds, padded with an out-of-range id (read
    clamped, written nowhere). `rows_k` holds the same rows' global ids, padded
    with the batch size, for what every device holds whole (the lengths). The
    width is `rb.width_for(shards x the most rows any one shard holds)`: rows
    spread evenly over the shards pad least.
    """
    if len(set(rows)) != len(rows) or any(not 0 <= r < rb.num_rows for r in rows):
      raise IndexError(f"rows {list(rows)}: need distinct rows in [0, {rb.num_rows})")
    by_shard = [[] for _ in range(rb.shards)]
    for place, row in enumerate(rows):
      by_shard[rb.shard(row)].append(place)
    width = rb.width_for(rb.shards * max(len(places) for places in by_shard))
    per_shard = width // rb.shards
    index_k = np.full(width, rb.rows_per_shard, np.int32)
    rows_k = np.full(width, rb.batch_size, np.int32)
    slot_of_row = np.empty(len(rows), np.int64)
    for shard, places in enumerate(by_shard):
      for i, place in enumerate(places):
        slot = shard * per_shard + i
        slot_of_row[place] = slot
        rows_k[slot] = rows[place]
        index_k[slot] = rows[place] - shard * rb.rows_per_shard
    return index_k, rows_k, slot_of_row

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
    index, global_index, slot_of_row = self._row_index(rb, rows)
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
    index, global_index, slot_of_row = self._row_index(rb, rows)
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


def row_program_set(batch_rows: int, capacity: int, shards: int,
                    min_slots: int = MIN_CACHE_BUCKET,
                    prefill_chunk: int = PREFILL_CHUNK) -> list[RowCall]:
  """Every row program a `RowBatch` of `batch_rows` rows (a multiple of `shards`, the data
  shards) with `capacity` slots a row runs, whatever order its rows are called in: a decode
  chunk at each width (`RowBatch.widths`) and slot count (`RowBatch.slot_levels`), a
  prefill of `prefill_chunk` tokens at each width over the whole capacity. The planner
  compiles these; `Sampler.compile_rows` compiles them ahead of a rollout."""
  widths = row_widths(batch_rows, shards)
  return ([RowCall("decode_rows", width, capacity, slots)
           for width in widths for slots in attended_slot_levels(capacity, min_slots)] +
          [RowCall("prefill_rows", width, capacity, capacity, prefill_chunk)
           for width in widths])


def batch_programs(graphdef, stop_token_ids: Sequence[int], pad_id: int):
  """The jitted `(prefill, decode)` programs of the batch API (`Sampler.extend`); both donate
  the cache."""
  prefill = jax.jit(functools.partial(_prefill, graphdef), donate_argnums=(1,))
  decode = jax.jit(functools.partial(_decode, graphdef, tuple(stop_token_ids), pad_id),
                   donate_argnums=(1,),
                   static_argnames=("max_new_tokens", "greedy", "top_k", "use_top_p"))
  return prefill, decode


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


def _abstract_cache(config: qwen2.Qwen2Config, mesh: Mesh | None, rows: int, capacity: int,
                    cache_dtype, layers_as_list: bool, per_row: bool) -> KVCache:
  """An empty cache of abstract arrays placed as `Sampler._place_cache` places a real one."""
  init = KVCache.init_rows if per_row else KVCache.init
  cache = jax.eval_shape(lambda: init(config, rows, capacity, cache_dtype, layers_as_list))
  if mesh is None:
    return cache
  kv_sharding = lambda x: partitioning.named_sharding(KV_CACHE_AXES[-x.ndim:], x.shape, mesh)
  cache = cache.map_kv(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=kv_sharding(x)))
  return cache.replace(
      kv_positions_bs=programs.rows(mesh, cache.kv_positions_bs.shape, jnp.int32),
      length=programs.replicated(mesh, cache.length.shape, jnp.int32))


def generate_programs(graphdef, params, config: qwen2.Qwen2Config, mesh: Mesh, rows: int,
                      prompt_tokens: int, sampling: SamplingParams, cache_dtype,
                      stop_token_ids: Sequence[int] = (0,),
                      pad_id: int = 0) -> dict[str, programs.Program]:
  """The programs of one `Sampler.generate` call on `rows` prompts of up to `prompt_tokens`
  tokens (`batch_programs`), decoding from `params` (abstract, placed on `mesh`): its
  "prefill" and its "decode" of `sampling.max_new_tokens` tokens, as the planner compiles
  them (the in-process simulator runs these)."""
  batch = math.lcm(bucket_size(rows), math.prod(
      mesh.shape[a] for a in partitioning.mesh_axes("batch", mesh)))
  chunk = bucket_size(prompt_tokens, MIN_CHUNK_BUCKET)
  capacity = bucket_size(chunk + sampling.max_new_tokens, MIN_CACHE_BUCKET)
  cache = _abstract_cache(config, mesh, batch, capacity, cache_dtype, False, per_row=False)
  on_rows = lambda shape, dtype: programs.rows(mesh, shape, dtype)
  prefill, decode = batch_programs(graphdef, stop_token_ids, pad_id)
  scalar = lambda dtype: programs.replicated(mesh, (), dtype)
  key = programs.replicated(mesh, (), jax.eval_shape(lambda: jax.random.key(0)).dtype)
  work = {"rows": batch, "slots": capacity, "capacity": capacity}
  return {
      "prefill": programs.Program(
          prefill, (params, cache, on_rows((batch, chunk), jnp.int32),
                    on_rows((batch, chunk), jnp.bool_)), mesh, resident=params,
          work={**work, "kind": "prefill_rows", "tokens": chunk}),
      "decode": programs.Program(
          decode, (params, cache, on_rows((batch, config.vocab_size), jnp.float32),
                   on_rows((batch,), jnp.bool_), on_rows((batch,), jnp.int32), key,
                   on_rows((batch,), jnp.int32), scalar(jnp.float32), scalar(jnp.float32)),
          mesh, {"max_new_tokens": sampling.max_new_tokens, **sampling.static()}, resident=params,
          work={**work, "kind": "decode_rows", "tokens": sampling.max_new_tokens})}


def row_program(graphdef, params, config: qwen2.Qwen2Config, mesh: Mesh, call: RowCall,
                rows: int, cache_dtype, layers_as_list: bool, sampling: SamplingParams,
                stop_token_ids: Sequence[int] = (0,), pad_id: int = 0,
                steps: int = DECODE_CHUNK_STEPS) -> programs.Program:
  """`call` of the row programs (`row_programs`) that decode from `params` (abstract,
  placed on `mesh`, or on one device with `mesh` None) for a `RowBatch` of `rows` rows, as
  the sampler and the planner compile it."""
  cache = _abstract_cache(config, mesh, rows, call.capacity, cache_dtype, layers_as_list,
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
  `Sampler._row_index`), so a row call moves no cache row between shards (the
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
  `rows_k` are their global ids (see `Sampler._row_index`)."""

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
  # Pinned where `Sampler.start_rows` places them: a row program's outputs are its next
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


def _decode_step(model, stop_ids, pad_id, sample, step, step_keys_r, budget_r, tokens_rn,
                 logprobs_rn, counts_r, stopped_r, done_r, logits_rv, cache):
  """One token for every live row of a decode loop (rows r, columns n).

  Samples from `logits_rv`, records the token at column `step`, feeds it
  through the model; a row is done at a stop token or its budget, and keeps
  the logits after its last token.
  """
  token_r, logprob_r = sample(logits_rv, step_keys_r)
  live_r = ~done_r
  token_r = jnp.where(live_r, token_r, pad_id)
  tokens_rn = jax.lax.dynamic_update_slice(tokens_rn, token_r[:, None], (0, step))
  logprobs_rn = jax.lax.dynamic_update_slice(
      logprobs_rn, jnp.where(live_r, logprob_r, 0.0)[:, None], (0, step))
  counts_r = counts_r + live_r
  hit_stop_r = live_r & jnp.any(token_r[:, None] == stop_ids[None, :], axis=-1)
  stopped_r = stopped_r | hit_stop_r
  hidden_r1d, cache = model.backbone(token_r[:, None], attention_mask=live_r[:, None],
                                     cache=cache)
  logits_rv = jnp.where(live_r[:, None], model.logits(hidden_r1d)[:, 0], logits_rv)
  done_r = done_r | hit_stop_r | (counts_r >= budget_r)
  return tokens_rn, logprobs_rn, counts_r, stopped_r, done_r, logits_rv, cache


def _decode_loop(model, stop_token_ids, pad_id, sample, cache, logits_rv, done_r, budget_r,
                 row_keys_r, offset_r, stop_after_finished, *, steps):
  """Up to `steps` decode steps for rows r of `cache`; the one loop of every decode program.

  Row r draws step i with `row_keys_r[r]` folded with `offset_r[r] + i`.
  The loop ends early once every row is done (a stop token or its budget)
  or `stop_after_finished` rows with a budget finished. Returns steps run,
  tokens and logprobs [R, steps], tokens drawn [R], stopped [R], each row's
  last logits and the cache.
  """
  width = logits_rv.shape[0]
  stop_ids = jnp.asarray(stop_token_ids, jnp.int32)

  def cond(carry):
    step, _, _, _, _, done_r, _, _ = carry
    finished = jnp.sum(done_r & (budget_r > 0))
    return (step < steps) & ~jnp.all(done_r) & (finished < stop_after_finished)

  def body(carry):
    step, *decoding = carry
    step_keys_r = jax.vmap(jax.random.fold_in)(row_keys_r, offset_r + step)
    return (step + 1, *_decode_step(model, stop_ids, pad_id, sample, step, step_keys_r,
                                    budget_r, *decoding))

  carry = (jnp.int32(0), jnp.full((width, steps), pad_id, jnp.int32),
           jnp.zeros((width, steps), jnp.float32), jnp.zeros((width,), jnp.int32),
           jnp.zeros((width,), jnp.bool_), done_r, logits_rv, cache)
  step, tokens_rn, logprobs_rn, counts_r, stopped_r, _, logits_rv, cache = jax.lax.while_loop(
      cond, body, carry)
  return step, tokens_rn, logprobs_rn, counts_r, stopped_r, logits_rv, cache


def _sampler_fn(temperature, top_p, greedy, top_k, use_top_p):
  return functools.partial(sample_logits, temperature=temperature, top_p=top_p,
                           greedy=greedy, top_k=top_k, use_top_p=use_top_p)


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
  step, tokens_kn, logprobs_kn, counts_k, stopped_k, row_logits_kv, rows = _decode_loop(
      model, stop_token_ids, pad_id, _sampler_fn(temperature, top_p, greedy, top_k, use_top_p),
      rows, row_logits_kv, budget_k <= 0, budget_k, row_keys_k, offset_k, stop_after_finished,
      steps=steps)
  cache, logits_bv = _scatter_rows(cache, logits_bv, index_k, rows_k, rows, row_logits_kv)
  return tokens_kn, logprobs_kn, counts_k, stopped_k, step, cache, logits_bv


def _prefill(graphdef, state, cache, tokens_bt, mask_bt):
  """Writes the new tokens into the cache; returns the last column's logits [B, V]."""
  model = nnx.merge(graphdef, state)
  hidden_btd, cache = model.backbone(tokens_bt, attention_mask=mask_bt, cache=cache)
  return model.logits(hidden_btd[:, -1:])[:, 0], cache


def _decode(graphdef, stop_token_ids, pad_id, state, cache, logits_bv, done_b, budget_b, key,
            row_ids_b, temperature, top_p, *, max_new_tokens, greedy, top_k, use_top_p):
  """Samples until every row hit a stop token or its budget (<= `max_new_tokens`) of tokens.

  Each step samples from the current logits, then feeds the sampled token
  through the model, so the cache ends holding every returned token.
  """
  model = nnx.merge(graphdef, state)
  batch = logits_bv.shape[0]
  row_keys_b = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, row_ids_b)
  _, tokens_bn, logprobs_bn, lengths_b, stopped_b, _, cache = _decode_loop(
      model, stop_token_ids, pad_id, _sampler_fn(temperature, top_p, greedy, top_k, use_top_p),
      cache, logits_bv, done_b, budget_b, row_keys_b, jnp.zeros((batch,), jnp.int32),
      batch + 1, steps=max_new_tokens)
  held = jnp.sum((cache.kv_positions_bs >= 0) & ~done_b[:, None])  # real rows' tokens
  return tokens_bn, logprobs_bn, lengths_b, stopped_b, held, cache
