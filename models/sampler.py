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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from models import partitioning
from models.qwen2 import KV_CACHE_AXES, KVCache, Qwen2

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


class Sampler:
  """Generation engine for one Qwen2 policy.

  `stop_token_ids` end a row (the stop token is returned as its last token);
  `pad_id` fills padding. With a `mesh`, batch rows shard over the data axes
  and the cache's kv heads over the tensor axis, like the weights.
  """

  def __init__(self, model: Qwen2, *, stop_token_ids: Sequence[int], pad_id: int = 0,
               mesh: Mesh | None = None, cache_dtype=None,
               min_chunk_bucket: int = 16, min_cache_bucket: int = 256):
    self.config = model.config
    self.graphdef, self.state = nnx.split(model)
    self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
    self.pad_id = int(pad_id)
    self.mesh = mesh
    self.cache_dtype = jnp.dtype(cache_dtype or model.backbone.dtype)
    self.min_chunk_bucket = min_chunk_bucket
    self.min_cache_bucket = min_cache_bucket
    self.state = partitioning.place_state(self.state, mesh)
    self._prefill = jax.jit(functools.partial(_prefill, self.graphdef), donate_argnums=(1,))
    self._decode = jax.jit(
        functools.partial(_decode, self.graphdef, self.stop_token_ids, self.pad_id),
        donate_argnums=(1,), static_argnames=("max_new_tokens", "greedy", "top_k", "use_top_p"))

  def update_weights(self, model_or_state) -> None:
    """Uses new weights (a model or its state) without recompiling."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    self.state = state

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
    return partitioning.place(array, logical_axes, self.mesh)

  def _place_cache(self, cache: KVCache) -> KVCache:
    if self.mesh is None:
      return cache
    return KVCache(k=self._put(cache.k, KV_CACHE_AXES), v=self._put(cache.v, KV_CACHE_AXES),
                   kv_positions_bs=self._put(cache.kv_positions_bs, ("batch", "cache_seq")),
                   length=self._put(cache.length, ()))

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
    cache = KVCache.init(self.config, batch, slots, self.cache_dtype)
    return Conversations(cache=self._place_cache(cache), row_ids=row_ids,
                         reply_ended=[True] * num_rows)

  def _grow(self, convs: Conversations, needed_slots: int) -> None:
    slots = bucket_size(needed_slots, self.min_cache_bucket)
    extra = slots - convs.capacity
    cache = convs.cache
    pad_kv = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0), (0, 0)))
    convs.cache = self._place_cache(KVCache(
        k=pad_kv(cache.k), v=pad_kv(cache.v),
        kv_positions_bs=jnp.pad(cache.kv_positions_bs, ((0, 0), (0, extra)), constant_values=-1),
        length=cache.length))

  def select(self, convs: Conversations, rows: Sequence[int]) -> None:
    """Keeps the given rows, in that order, in a batch of the smallest bucket."""
    rows = list(rows)
    if not rows:
      raise ValueError("select needs at least one row")
    if any(not 0 <= r < convs.num_rows for r in rows):
      raise IndexError(f"rows {rows} out of range for {convs.num_rows} dialogues")
    batch = self._batch_bucket(len(rows))
    index = jnp.asarray(rows + [rows[0]] * (batch - len(rows)), jnp.int32)
    cache = convs.cache
    cache = KVCache(k=cache.k[:, index], v=cache.v[:, index],
                    kv_positions_bs=cache.kv_positions_bs[index], length=cache.length)
    # Filler rows duplicate a real row; they are marked done and never read.
    convs.cache = self._place_cache(cache)
    convs.row_ids = [convs.row_ids[r] for r in rows]
    convs.reply_ended = [convs.reply_ended[r] for r in rows]

  def extend(self, convs: Conversations, new_tokens: Sequence[Sequence[int]],
             params: SamplingParams, key: jax.Array | None = None) -> Completions:
    """Appends each row's new tokens to its dialogue, then samples a continuation per row.

    Row r draws its tokens with `key` folded with its row id (see `start`);
    greedy decoding (temperature 0) needs no key.
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
    if needed > convs.capacity:
      self._grow(convs, needed)

    batch = convs.batch_size
    tokens_bt = np.full((batch, chunk), self.pad_id, np.int32)
    mask_bt = np.zeros((batch, chunk), np.bool_)
    for row, tokens in enumerate(new_tokens):
      tokens_bt[row, chunk - len(tokens):] = tokens
      mask_bt[row, chunk - len(tokens):] = True
    done_b = np.arange(batch) >= convs.num_rows
    row_ids_b = np.zeros((batch,), np.int32)
    row_ids_b[:convs.num_rows] = convs.row_ids

    with partitioning.mesh_context(self.mesh):
      logits_bv, convs.cache = self._prefill(
          self.state, convs.cache, self._put(tokens_bt, ("batch", None)),
          self._put(mask_bt, ("batch", None)))
      out_tokens, out_logprobs, lengths, stopped, convs.cache = self._decode(
          self.state, convs.cache, logits_bv, self._put(done_b, ("batch",)),
          key, self._put(row_ids_b, ("batch",)),
          jnp.float32(params.temperature or 1.0),
          jnp.float32(params.top_p), max_new_tokens=params.max_new_tokens,
          greedy=params.temperature == 0, top_k=params.top_k, use_top_p=params.top_p < 1.0)

    out_tokens, out_logprobs, lengths, stopped = jax.device_get(
        (out_tokens, out_logprobs, lengths, stopped))
    rows = range(convs.num_rows)
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


def _prefill(graphdef, state, cache, tokens_bt, mask_bt):
  """Writes the new tokens into the cache; returns the last column's logits [B, V]."""
  model = nnx.merge(graphdef, state)
  hidden_btd, cache = model.backbone(tokens_bt, attention_mask=mask_bt, cache=cache)
  return model.logits(hidden_btd[:, -1:])[:, 0], cache


def _decode(graphdef, stop_token_ids, pad_id, state, cache, logits_bv, done_b, key, row_ids_b,
            temperature, top_p, *, max_new_tokens, greedy, top_k, use_top_p):
  """Samples until every row hit a stop token or `max_new_tokens` were drawn.

  Each step samples from the current logits, then feeds the sampled token
  through the model, so the cache ends holding every returned token.
  """
  model = nnx.merge(graphdef, state)
  batch = logits_bv.shape[0]
  stop_ids = jnp.asarray(stop_token_ids, jnp.int32)
  row_keys_b = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, row_ids_b)

  def cond(carry):
    step, _, _, _, _, done_b, _, _ = carry
    return (step < max_new_tokens) & ~jnp.all(done_b)

  def body(carry):
    step, tokens_bn, logprobs_bn, lengths_b, stopped_b, done_b, logits_bv, cache = carry
    step_keys_b = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys_b, step)
    token_b, logprob_b = sample_logits(logits_bv, step_keys_b, temperature, top_p,
                                       greedy=greedy, top_k=top_k, use_top_p=use_top_p)
    live_b = ~done_b
    token_b = jnp.where(live_b, token_b, pad_id)
    tokens_bn = jax.lax.dynamic_update_slice(tokens_bn, token_b[:, None], (0, step))
    logprobs_bn = jax.lax.dynamic_update_slice(
        logprobs_bn, jnp.where(live_b, logprob_b, 0.0)[:, None], (0, step))
    lengths_b = lengths_b + live_b
    hit_stop_b = live_b & jnp.any(token_b[:, None] == stop_ids[None, :], axis=-1)
    stopped_b = stopped_b | hit_stop_b
    hidden_btd, cache = model.backbone(token_b[:, None], attention_mask=live_b[:, None],
                                       cache=cache)
    logits_bv = model.logits(hidden_btd)[:, 0]
    return (step + 1, tokens_bn, logprobs_bn, lengths_b, stopped_b, done_b | hit_stop_b,
            logits_bv, cache)

  carry = (jnp.int32(0), jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
           jnp.zeros((batch, max_new_tokens), jnp.float32), jnp.zeros((batch,), jnp.int32),
           jnp.zeros((batch,), jnp.bool_), done_b, logits_bv, cache)
  _, tokens_bn, logprobs_bn, lengths_b, stopped_b, _, _, cache = jax.lax.while_loop(
      cond, body, carry)
  return tokens_bn, logprobs_bn, lengths_b, stopped_b, cache
