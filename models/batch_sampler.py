"""The batch engine: a batch of dialogues in lockstep, prefill then a `lax.while_loop` decode,
multi-turn reuse of the KV cache.

A `Conversations` object is the device state of a batch of dialogues. Each
`extend` call prefills only the new tokens of every row (the user's reply and
the next role header) after what the cache already holds, then decodes; a
dialogue of T turns never re-prefills its history. `select` keeps a subset
of rows (finished dialogues drop out) by gathering their cache rows. Both
update the `Conversations` in place: its cache is donated to every call.

The batch is padded to a power of two (and a multiple of the data-parallel
size), each new chunk of tokens to a power of two, and the cache to a power
of two of slots. New chunks are left-padded so that the last column holds
every row's last real token; padding slots carry position -1 and are never
attended.

Every call returns `Completions`, one continuation per row; a training
sequence (`rl.agent.Sample`) is built from them by the agent.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from infra import programs
from models import partitioning, qwen2
from models.qwen2 import KVCache
from models.sampler_weights import SamplerWeights, abstract_cache, decode_loop
from models.sampling import (LENGTH, MIN_CACHE_BUCKET, MIN_CHUNK_BUCKET, STOP, Completions,
                             SamplingParams, bucket_size, sampler_fn)


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


class BatchSampler:
  """Samples batches of dialogues in lockstep (`start`, `select`, `extend`, `generate`) from
  `weights`."""

  def __init__(self, weights: SamplerWeights, *, min_chunk_bucket: int = MIN_CHUNK_BUCKET):
    """`min_chunk_bucket`: the fewest tokens a new chunk is padded to."""
    self.weights = weights
    self.min_chunk_bucket = min_chunk_bucket
    self._prefill, self._decode = batch_programs(weights.graphdef, weights.stop_token_ids,
                                                 weights.pad_id)

  def _batch_bucket(self, num_rows: int) -> int:
    return math.lcm(bucket_size(num_rows), self.weights.data_parallel_size())

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
    weights = self.weights
    batch = self._batch_bucket(num_rows)
    slots = bucket_size(capacity, weights.min_cache_bucket)
    cache = KVCache.init(weights.config, batch, slots, weights.cache_dtype,
                         weights.cache_layers_as_list)
    return Conversations(cache=weights.place_cache(cache), row_ids=row_ids,
                         reply_ended=[True] * num_rows)

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
    convs.cache = self.weights.place_cache(cache)
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
    weights = self.weights
    chunk = bucket_size(max(len(t) for t in new_tokens), self.min_chunk_bucket)
    needed = int(convs.cache.length) + chunk + params.max_new_tokens
    convs.cache = weights.grown(convs.cache, needed)

    batch = convs.batch_size
    tokens_bt = np.full((batch, chunk), weights.pad_id, np.int32)
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
    with partitioning.mesh_context(weights.mesh):
      logits_bv, convs.cache = self._prefill(
          weights.state, convs.cache, weights.put(tokens_bt, ("batch", None)),
          weights.put(mask_bt, ("batch", None)))
      out_tokens, out_logprobs, lengths, stopped, held, convs.cache = self._decode(
          weights.state, convs.cache, logits_bv, weights.put(done_b, ("batch",)),
          weights.put(budget_b, ("batch",)), key, weights.put(row_ids_b, ("batch",)),
          jnp.float32(params.temperature or 1.0),
          jnp.float32(params.top_p), max_new_tokens=params.max_new_tokens,
          **params.static())

    out_tokens, out_logprobs, lengths, stopped, held = jax.device_get(
        (out_tokens, out_logprobs, lengths, stopped, held))
    rows = range(convs.num_rows)
    weights.stats.add(time.perf_counter() - start, batch, int(max(lengths[r] for r in rows)),
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


def batch_programs(graphdef, stop_token_ids: Sequence[int], pad_id: int):
  """The jitted `(prefill, decode)` programs of the batch API (`BatchSampler.extend`); both donate
  the cache."""
  prefill = jax.jit(functools.partial(_prefill, graphdef), donate_argnums=(1,))
  decode = jax.jit(functools.partial(_decode, graphdef, tuple(stop_token_ids), pad_id),
                   donate_argnums=(1,),
                   static_argnames=("max_new_tokens", "greedy", "top_k", "use_top_p"))
  return prefill, decode


def generate_programs(graphdef, params, config: qwen2.Qwen2Config, mesh: Mesh, rows: int,
                      prompt_tokens: int, sampling: SamplingParams, cache_dtype,
                      stop_token_ids: Sequence[int] = (0,),
                      pad_id: int = 0) -> dict[str, programs.Program]:
  """The programs of one `BatchSampler.generate` call on `rows` prompts of up to `prompt_tokens`
  tokens (`batch_programs`), decoding from `params` (abstract, placed on `mesh`): its
  "prefill" and its "decode" of `sampling.max_new_tokens` tokens, as the planner compiles
  them (the in-process simulator runs these)."""
  batch = math.lcm(bucket_size(rows), math.prod(
      mesh.shape[a] for a in partitioning.mesh_axes("batch", mesh)))
  chunk = bucket_size(prompt_tokens, MIN_CHUNK_BUCKET)
  capacity = bucket_size(chunk + sampling.max_new_tokens, MIN_CACHE_BUCKET)
  cache = abstract_cache(config, mesh, batch, capacity, cache_dtype, False, per_row=False)
  on_rows = lambda shape, dtype: partitioning.abstract_rows(mesh, shape, dtype)
  prefill, decode = batch_programs(graphdef, stop_token_ids, pad_id)
  scalar = lambda dtype: programs.replicated(mesh, (), dtype)
  key = programs.replicated(mesh, (), jax.eval_shape(lambda: jax.random.key(0)).dtype)
  return {
      "prefill": programs.Program(
          prefill, (params, cache, on_rows((batch, chunk), jnp.int32),
                    on_rows((batch, chunk), jnp.bool_)), mesh, resident=params,
          work=programs.PrefillRows(rows=batch, tokens=chunk, slots=capacity,
                                    capacity=capacity)),
      "decode": programs.Program(
          decode, (params, cache, on_rows((batch, config.vocab_size), jnp.float32),
                   on_rows((batch,), jnp.bool_), on_rows((batch,), jnp.int32), key,
                   on_rows((batch,), jnp.int32), scalar(jnp.float32), scalar(jnp.float32)),
          mesh, {"max_new_tokens": sampling.max_new_tokens, **sampling.static()}, resident=params,
          work=programs.DecodeRows(rows=batch, tokens=sampling.max_new_tokens, slots=capacity,
                                   capacity=capacity))}


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
  _, tokens_bn, logprobs_bn, lengths_b, stopped_b, _, cache = decode_loop(
      model, stop_token_ids, pad_id, sampler_fn(temperature, top_p, greedy, top_k, use_top_p),
      cache, logits_bv, done_b, budget_b, row_keys_b, jnp.zeros((batch,), jnp.int32),
      batch + 1, steps=max_new_tokens)
  held = jnp.sum((cache.kv_positions_bs >= 0) & ~done_b[:, None])  # real rows' tokens
  return tokens_bn, logprobs_bn, lengths_b, stopped_b, held, cache
