"""What the sampler's two engines share: the weights they decode from and where arrays live,
the stop tokens, the statistics, and the one decode loop of every decode program.

The model is split once into a graphdef (static, closed over by the jitted
functions) and its state (weights, passed as an argument), so new weights
from a train step are used without retracing. A cache is donated to every
call and comes back updated. With a mesh, batch rows shard over the data
axes and a cache's kv heads over the tensor axis, like the weights.

The engines, each holding the one `SamplerWeights`: `models.batch_sampler.BatchSampler`
(a batch of dialogues in lockstep) and `models.row_sampler.RowSampler` (dialogues one row
at a time); `models.sampler.Sampler` holds the three.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from infra import programs
from models import group_channel, partitioning, qwen2
from models.qwen2 import KV_CACHE_AXES, KVCache, Qwen2
from models.sampling import MIN_CACHE_BUCKET, DecodeStats, bucket_size
from models.slice_meshes import SliceMeshes
from models.weight_copy import sampler_copy


class SamplerWeights:
  """The weights, placement, stop tokens and statistics of a sampler's engines.

  `stop_token_ids` end a row (the stop token is returned as its last token);
  `pad_id` fills padding. `state` is what the engines decode from now: they read it at
  every call, so `update` gives both new weights.
  """

  def __init__(self, model: Qwen2, *, stop_token_ids: Sequence[int], pad_id: int = 0,
               mesh: Mesh | None = None, cache_dtype=None,
               min_cache_bucket: int = MIN_CACHE_BUCKET, sampling_dtype=None,
               sampling_layout: str = "decode", meshes: SliceMeshes | None = None):
    """`sampling_dtype` (opt-in, e.g. bfloat16): decode from a copy of the weights in
    that dtype (`decoding_copy`; its layers a list where `layers_as_list`), placed by the
    rules of `partitioning.SAMPLING_LAYOUTS[sampling_layout]` ("decode": split over tensor
    only, so no FSDP all-gather per token; "train": sharded like the training weights);
    `update` refreshes it in place.

    `meshes` (training): `model` lies on `meshes.train` and the sampler decodes on
    `meshes.sampler_mesh` (its group's; `mesh` is then ignored), from a copy moved there
    whenever that is another mesh, also without `sampling_dtype`. A group of several hosts
    samples as one: its leader dispatches, the others follow (`models/group_channel.py`).
    """
    self.config = model.config
    self.graphdef, state = nnx.split(model)
    self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
    self.pad_id = int(pad_id)
    self.mesh = mesh = meshes.sampler_mesh if meshes is not None else mesh
    self.group = (group_channel.GroupChannel(mesh, meshes.leader)
                  if meshes is not None and len(meshes.processes(meshes.group)) > 1 else None)
    self.cache_dtype = jnp.dtype(cache_dtype or model.backbone.dtype)
    self.min_cache_bucket = min_cache_bucket
    self.sampling_dtype = None if sampling_dtype is None else jnp.dtype(sampling_dtype)
    self.stats = DecodeStats()
    self.weight_copy = sampler_copy(self.graphdef, state, self.sampling_dtype, sampling_layout,
                                    meshes, mesh)
    # The cache follows the layers it is decoded with: one array per layer for a list.
    self.cache_layers_as_list = isinstance(model.backbone.layers, nnx.List)
    if self.weight_copy is not None:
      self.cache_layers_as_list = self.weight_copy.as_list
      self.graphdef = self.weight_copy.graphdef
      self.state = self.weight_copy.make(state)
    else:
      self.state = partitioning.place_state(state, mesh)

  def update(self, model_or_state) -> None:
    """Uses new weights (a model or its state) without recompiling."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    self.state = state if self.weight_copy is None else self.weight_copy.refresh(state)

  def drop(self) -> None:
    """Frees the sampler's copy of the weights until the next `update` (a sampler that
    decodes from the training weights has none to free)."""
    if self.weight_copy is not None:
      self.weight_copy.drop()
      self.state = None

  # Placement.

  def data_parallel_size(self) -> int:
    """How many ways the batch axis is split (batches are padded to a multiple)."""
    if self.mesh is None:
      return 1
    axes = partitioning.mesh_axes("batch", self.mesh)
    return math.prod(self.mesh.shape[a] for a in axes)

  def put(self, array, logical_axes):
    """A host array placed for a call on the mesh; without one, as it is (a jitted program
    takes host arrays as they are, where making each a device array first compiles a small
    program per shape)."""
    return array if self.mesh is None else partitioning.place(array, logical_axes, self.mesh)

  def place_cache(self, cache: KVCache) -> KVCache:
    if self.mesh is None:
      return cache
    return cache.map_kv(lambda x: self.put(x, KV_CACHE_AXES[-x.ndim:])).replace(
        kv_positions_bs=self.put(cache.kv_positions_bs, ("batch", "cache_seq")),
        # replicated: a scalar, or [B] per-row lengths the host reads
        length=self.put(cache.length, (None,) * cache.length.ndim))

  def grown(self, cache: KVCache, needed_slots: int) -> KVCache:
    """`cache` with room for `needed_slots` slots (a bucket size), in either layout."""
    if needed_slots <= cache.max_len:
      return cache
    extra = bucket_size(needed_slots, self.min_cache_bucket) - cache.max_len
    cache = cache.map_kv(lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, extra), (0, 0)]))
    return self.place_cache(cache.replace(kv_positions_bs=jnp.pad(
        cache.kv_positions_bs, ((0, 0), (0, extra)), constant_values=-1)))


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


def decode_loop(model, stop_token_ids, pad_id, sample, cache, logits_rv, done_r, budget_r,
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


def abstract_cache(config: qwen2.Qwen2Config, mesh: Mesh | None, rows: int, capacity: int,
                   cache_dtype, layers_as_list: bool, per_row: bool) -> KVCache:
  """An empty cache of abstract arrays placed as `SamplerWeights.place_cache` places a real one."""
  init = KVCache.init_rows if per_row else KVCache.init
  cache = jax.eval_shape(lambda: init(config, rows, capacity, cache_dtype, layers_as_list))
  if mesh is None:
    return cache
  kv_sharding = lambda x: partitioning.named_sharding(KV_CACHE_AXES[-x.ndim:], x.shape, mesh)
  cache = cache.map_kv(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=kv_sharding(x)))
  return cache.replace(
      kv_positions_bs=partitioning.abstract_rows(mesh, cache.kv_positions_bs.shape, jnp.int32),
      length=programs.replicated(mesh, cache.length.shape, jnp.int32))
