"""The row engine's programs: the fixed set a `RowBatch` runs, and their jitted bodies.

A row call takes one of three widths (the batch, a quarter, a sixteenth: a
multiple of the data shards) and a decode chunk attends over one of three
slot counts (the capacity, a quarter, a sixteenth); a prefill feeds
`PREFILL_CHUNK` tokens a row over the whole capacity. `row_program_set` lists
the set for a batch, `row_program` is one of them with abstract arguments (as
`models/row_sampler.py` compiles it ahead of a rollout, and the planner for
any devices). The bodies gather each data shard's chosen rows on that shard,
run, and scatter them back: no cache row crosses devices.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from infra import programs
from models import partitioning, qwen2
from models.qwen2 import KV_CACHE_AXES, KVCache
from models.sampler_weights import abstract_cache, decode_loop
from models.sampling import MIN_CACHE_BUCKET, ladder, sampler_fn

DECODE_CHUNK_STEPS = 32  # steps of one `decode_rows` call, by default
PREFILL_CHUNK = 128  # tokens one `prefill_rows` call feeds a row; a longer feed takes several
# A row call takes one of LADDER_RUNGS widths (the batch, a quarter of it, a sixteenth) and a
# decode chunk attends over one of LADDER_RUNGS slot counts (the capacity, a quarter, ...).
WIDTH_RATIO = 4
SLOT_RATIO = 4


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
                rows: int, cache_dtype, layers_as_list: bool, decode_static: dict,
                stop_token_ids: Sequence[int] = (0,), pad_id: int = 0,
                steps: int = DECODE_CHUNK_STEPS) -> programs.Program:
  """`call` of the row programs (`row_programs`) that decode from `params` (abstract,
  placed on `mesh`, or on one device with `mesh` None) for a `RowBatch` of `rows` rows, as
  the sampler and the planner compile it; `decode_static`: the decode programs' sampling
  statics (`SamplingParams.static`)."""
  cache = abstract_cache(config, mesh, rows, call.capacity, cache_dtype, layers_as_list,
                         per_row=True)
  on_rows = lambda shape, dtype: _placed(mesh, shape, dtype, ("batch",))
  logits_bv = on_rows((rows, config.vocab_size), jnp.float32)
  width = call.width
  index_k, rows_k = on_rows((width,), jnp.int32), on_rows((width,), jnp.int32)
  prefill, decode = row_programs(graphdef, stop_token_ids, pad_id)
  if call.kind == "prefill_rows":
    args = (params, cache, logits_bv, index_k, rows_k, on_rows((width, call.chunk), jnp.int32),
            on_rows((width, call.chunk), jnp.bool_), on_rows((width,), jnp.bool_))
    return programs.Program(prefill, args, mesh, {"slots": call.slots}, resident=params,
                            work=programs.PrefillRows(rows=width, tokens=call.chunk,
                                                      slots=call.slots, capacity=call.capacity))
  scalar = lambda dtype: _placed(mesh, (), dtype, ())
  key_data_kd = on_rows((width,) + key_data_shape(), jnp.uint32)
  per_row = lambda: on_rows((width,), jnp.int32)  # budgets, row ids, offsets
  args = (params, cache, logits_bv, index_k, rows_k, per_row(), key_data_kd, per_row(),
          per_row(), scalar(jnp.float32), scalar(jnp.float32), scalar(jnp.int32))
  static = {"steps": steps, "slots": call.slots, **decode_static}
  return programs.Program(decode, args, mesh, static, resident=params,
                          work=programs.DecodeRows(rows=width, tokens=steps, slots=call.slots,
                                                   capacity=call.capacity))


def empty_rows(config: qwen2.Qwen2Config, rows: int, capacity: int, cache_dtype,
               layers_as_list: bool):
  """An empty `RowBatch`'s device state: its per-row cache and every row's logits."""
  cache = KVCache.init_rows(config, rows, capacity, cache_dtype, layers_as_list)
  return cache, jnp.zeros((rows, config.vocab_size), jnp.float32)


def empty_rows_program(config: qwen2.Qwen2Config, mesh: Mesh | None, rows: int, capacity: int,
                       cache_dtype, layers_as_list: bool) -> programs.Program:
  """The program that starts a `RowBatch` (no arguments), its outputs placed where the row
  programs take them, as the sampler and the planner compile it."""
  fn = functools.partial(empty_rows, config, rows, capacity, cache_dtype, layers_as_list)
  if mesh is None:
    return programs.Program(jax.jit(fn), (), mesh, work=programs.EmptyRows())
  cache = abstract_cache(config, mesh, rows, capacity, cache_dtype, layers_as_list,
                         per_row=True)
  logits = partitioning.abstract_rows(mesh, (rows, config.vocab_size), jnp.float32)
  shardings = jax.tree.map(lambda x: x.sharding, (cache, logits))
  return programs.Program(jax.jit(fn, out_shardings=shardings), (), mesh,
                          work=programs.EmptyRows())


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
  # Per-row lengths are whole on every device (`SamplerWeights.place_cache` places them
  # so): taken by global id.
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
  # What the host reads, whole on every chip: a sampler group's leader reads it from its own
  # chips, which hold only their rows of the cache (`models/group_channel.py`).
  whole = lambda x: partitioning.constrain(x, (None,) * x.ndim)
  return (whole(tokens_kn), whole(logprobs_kn), whole(counts_k), whole(stopped_k), step, cache,
          logits_bv)
