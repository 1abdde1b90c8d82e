"""Attention over position-masked keys: one interface, several implementations.

    out_btnh = attend(q_btnh, k_bskh, v_bskh, q_positions_bt, kv_positions_bs,
                      implementation="auto")

Shape letters: B batch, T queries, S key/value slots, N query heads, K key/value
heads, G = N // K query heads per kv head (grouped-query attention), H head width.

Masking is by position (see models/qwen2.py): a key slot is visible to a query
iff 0 <= kv_position <= query position. Queries that see no key at all
(padding) get a zero output from the blockwise kernel and a uniform average
from the einsum one; callers never read them.

Implementations (`ATTENTION_IMPLEMENTATIONS`):
  einsum     materialises fp32 scores [B, K, G, T, S]: the reference, and the
             cheapest for single-token decode steps.
  blockwise  flash-style online softmax in plain JAX on every backend: query
             blocks x key blocks in while loops, a custom VJP that keeps only
             the output and the log-sum-exp, so forward and backward memory is
             linear in T and S. Key blocks no query of a block can see are skipped.
  cudnn      `jax.nn.dot_product_attention(implementation="cudnn")`, GPU only;
             the position mask goes in as a boolean [B, 1, T, S] (one byte an
             entry, not the fp32 scores of every head).
  splash     the Pallas splash-attention kernel, TPU only, under `shard_map`
             over the mesh (batch over the data axes, heads over tensor). Its
             mask is static, so it serves uncached passes (T == S, the training
             passes) where it is causal by slot plus segment ids for padding;
             this equals the position mask when positions increase with the
             slot among real tokens, as every caller here builds them.
  auto       einsum for short queries (decode, small chunks); otherwise splash on
             TPU for uncached passes, cudnn on GPU, blockwise elsewhere. On CPU an
             uncached pass of 2 x `CPU_BLOCK` queries or more is blockwise in
             `CPU_BLOCK` blocks: einsum's [B, K, G, T, S] fp32 scores are memory
             traffic there (written, masked, normalised and kept for the backward
             pass), and the blocks skip the keys no query of theirs sees.
A single-token decode step over a per-row cache on TPU (`decodes_paged`) runs
the Pallas paged-attention kernel instead (`paged_decode_attention`): each
row's keys are read up to its own length, where einsum reads every slot of
the attended window and masks the rest.
All take bf16 (or fp32) inputs, multiply in that dtype and keep softmax
statistics in fp32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from infra.errors import UserInputError
from models import partitioning

Array = jax.Array

ATTENTION_IMPLEMENTATIONS = ("auto", "einsum", "blockwise", "cudnn", "splash")
# einsum's scores stay small below this many query x key entries per row and head.
EINSUM_MAX_SCORES = 1 << 18
DEFAULT_BLOCK = 512  # the blockwise kernel's blocks on accelerators: big matrix-unit tiles
# ... and on CPU, where small blocks keep each block's scores in cache: the demo's update
# (T = 512, 8 rows) ran 2.1x faster than with einsum, 1.5x than with 256, 1.2x than with 64.
CPU_BLOCK = 128
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def visible(q_positions_bt: Array, kv_positions_bs: Array) -> Array:
  """Boolean [B, T, S]: which key slots each query sees."""
  kv_b1s = kv_positions_bs[:, None, :]
  return (kv_b1s >= 0) & (kv_b1s <= q_positions_bt[:, :, None])


def default_block() -> int:
  """The blockwise kernel's query and key block on the platform being traced for."""
  return CPU_BLOCK if partitioning.target_platform() == "cpu" else DEFAULT_BLOCK


def check_implementation(implementation: str) -> str:
  if implementation not in ATTENTION_IMPLEMENTATIONS:
    raise UserInputError(f"attention implementation {implementation!r} (policy.attention); "
                         f"expected one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
  return implementation


def resolve(implementation: str, num_queries: int, num_keys: int, *, cached: bool) -> str:
  """The concrete implementation `auto` (or an explicit choice) runs on this backend."""
  if check_implementation(implementation) != "auto":
    return implementation
  backend = partitioning.target_platform()
  if backend == "cpu" and not cached and num_queries >= 2 * CPU_BLOCK:
    return "blockwise"
  if num_queries * num_keys <= EINSUM_MAX_SCORES:
    return "einsum"
  if backend == "tpu" and not cached and num_queries == num_keys:
    return "splash"
  if backend == "gpu":
    return "cudnn"
  return "blockwise"


def attend(q_btnh: Array, k_bskh: Array, v_bskh: Array, q_positions_bt: Array,
           kv_positions_bs: Array, *, implementation: str = "auto", cached: bool = False,
           block_size: int | None = None) -> Array:
  """softmax(q k^T / sqrt(H), position-masked) v, as [B, T, N, H] in q's dtype.

  `cached`: the keys include a cache (slots are not the queries' own), which
  rules out the static-mask splash kernel. `block_size` (default
  `default_block()`) is the blockwise kernel's query and key block.
  """
  block_size = block_size or default_block()
  impl = resolve(implementation, q_btnh.shape[1], k_bskh.shape[1], cached=cached)
  if impl == "einsum":
    return einsum_attention(q_btnh, k_bskh, v_bskh, q_positions_bt, kv_positions_bs)
  if impl == "blockwise":
    return blockwise_attention(q_btnh, k_bskh, v_bskh, q_positions_bt, kv_positions_bs,
                               block_q=block_size, block_k=block_size)
  if impl == "cudnn":
    return cudnn_attention(q_btnh, k_bskh, v_bskh, q_positions_bt, kv_positions_bs)
  if cached or q_btnh.shape[1] != k_bskh.shape[1]:
    raise ValueError("splash attention serves uncached passes only (queries == keys); "
                     "use auto, blockwise or einsum")
  return splash_attention(q_btnh, k_bskh, v_bskh, kv_positions_bs)


def decodes_paged(implementation: str, num_queries: int, head_size: int,
                  per_row_lengths) -> bool:
  """Whether a cached pass runs `paged_decode_attention`: `auto`, one query per row, heads of
  a multiple of 128 (the kernel's lanes; every Qwen2.5 size has 128), a per-row-length cache
  (`per_row_lengths` given), compiled for TPU."""
  return (implementation == "auto" and num_queries == 1 and head_size % 128 == 0 and
          per_row_lengths is not None and partitioning.target_platform() == "tpu")


# Pages of the paged kernel: a row's slots (a power of two >= 256 in the sampler) split into
# pages of PAGE_SIZE, PAGES_PER_BLOCK of them per kernel step.
PAGE_SIZE = 128
PAGES_PER_BLOCK = 4


def paged_decode_attention(q_b1nh: Array, k_cache: Array, v_cache: Array, layer,
                           lengths_b: Array) -> Array:
  """One query token per row over the first `lengths_b[b]` slots of row b's cache, with the
  Pallas TPU paged-attention kernel (jax.experimental.pallas.ops.tpu.paged_attention).

  `k_cache`, `v_cache`: a stack [L, B, K, S, H] with `layer` the traced layer index, or one
  layer's [B, K, S, H] (`layer` None). The cache is never copied: flattened to pages of
  PAGE_SIZE slots, (layer, row, kv head) is one sequence of S / PAGE_SIZE pages, read by
  DMA only as far as the row's length. Row b's tokens sit in slots [0, lengths_b[b]) (the
  per-row layout), which is the position mask of a decode step. Under a mesh it runs per
  shard, rows over the batch axes and kv heads over tensor, as splash does.
  """
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

  def kernel_call(q_b1nh, k_cache, v_cache, lengths_b, layer_index):
    b, _, n, h = q_b1nh.shape
    kv_heads, slots = k_cache.shape[-3], k_cache.shape[-2]
    page = min(PAGE_SIZE, slots)
    pages = slots // page
    first_row = layer_index * b  # rows of the layers before this one, in the flat pages
    sequences_bk = ((first_row + jnp.arange(b, dtype=jnp.int32))[:, None] * kv_heads +
                    jnp.arange(kv_heads, dtype=jnp.int32)[None])
    page_indices_qp = (sequences_bk.reshape(-1, 1) * pages +
                       jnp.arange(pages, dtype=jnp.int32)[None])
    as_pages = lambda x: x.reshape(1, -1, page, h)  # one "kv head": every sequence's pages
    q_qgh = (q_b1nh[:, 0] * (h ** -0.5)).reshape(b * kv_heads, n // kv_heads, h)
    # An empty row (padding in a row program) would leave its output unwritten; it attends
    # to slot 0 instead, and its output is never read.
    lengths_q = jnp.repeat(jnp.maximum(lengths_b, 1).astype(jnp.int32), kv_heads)
    out_qgh = paged_attention(q_qgh, as_pages(k_cache), as_pages(v_cache.astype(k_cache.dtype)),
                              lengths_q, page_indices_qp,
                              pages_per_compute_block=math.gcd(pages, PAGES_PER_BLOCK))
    return out_qgh.reshape(b, 1, n, h).astype(q_b1nh.dtype)

  layer_index = jnp.asarray(0 if layer is None else layer, jnp.int32)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return kernel_call(q_b1nh, k_cache, v_cache, lengths_b, layer_index)
  cache_spec = partitioning.logical_to_spec(
      ("layers", "batch", "kv_heads", None, None)[-k_cache.ndim:], k_cache.shape, mesh)
  heads_spec = jax.sharding.PartitionSpec(cache_spec[-4], None, cache_spec[-3], None)
  rows_spec = jax.sharding.PartitionSpec(cache_spec[-4])
  return jax.shard_map(kernel_call, mesh=mesh,
                       in_specs=(heads_spec, cache_spec, cache_spec, rows_spec,
                                 jax.sharding.PartitionSpec()),
                       out_specs=heads_spec, check_vma=False)(
                           q_b1nh, k_cache, v_cache, lengths_b, layer_index)


def _grouped(q_btnh: Array, kv_heads: int) -> Array:
  b, t, n, h = q_btnh.shape
  return q_btnh.reshape(b, t, kv_heads, n // kv_heads, h)


def einsum_attention(q_btnh, k_bskh, v_bskh, q_positions_bt, kv_positions_bs):
  """The reference: fp32 scores [B, K, G, T, S] in memory."""
  dtype = q_btnh.dtype
  b, t, n, h = q_btnh.shape
  q_btkgh = _grouped(q_btnh, k_bskh.shape[2])
  logits_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh.astype(dtype),
                            preferred_element_type=jnp.float32) * (h ** -0.5)
  mask_bts = visible(q_positions_bt, kv_positions_bs)
  logits_bkgts = jnp.where(mask_bts[:, None, None], logits_bkgts, _MASK_VALUE)
  probs_bkgts = jax.nn.softmax(logits_bkgts, axis=-1).astype(dtype)
  out_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v_bskh.astype(dtype))
  return out_btkgh.reshape(b, t, n, h)


# Blockwise (flash) attention in plain JAX.

def _blocks(x, block: int, fill):
  """[B, L, ...] -> [L / block, B, block, ...], padding L up with `fill`."""
  pad = -x.shape[1] % block
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
  return x.reshape(x.shape[0], -1, block, *x.shape[2:]).swapaxes(0, 1)


def _unblock(x_nb, length: int):
  """[n, B, block, ...] -> [B, length, ...]."""
  x = x_nb.swapaxes(0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _block_scores(q_bqkgh, k_bckh, q_pos_bq, kv_pos_bc, scale):
  """fp32 scores [B, K, G, q, c] and visibility [B, 1, 1, q, c] of one block pair."""
  s = jnp.einsum("bqkgh,bckh->bkgqc", q_bqkgh, k_bckh,
                 preferred_element_type=jnp.float32) * scale
  mask = visible(q_pos_bq, kv_pos_bc)[:, None, None]
  return s, mask


def _any_visible(q_pos_bq, kv_pos_bc):
  """Whether any query of the block sees any key of the block (else skip it)."""
  kv_valid = jnp.where(kv_pos_bc >= 0, kv_pos_bc, jnp.iinfo(jnp.int32).max)
  return jnp.min(kv_valid) <= jnp.max(q_pos_bq)


def _loop_scan(body, init, xs):
  """`lax.scan(body, init, xs)` as a while loop.

  The flash kernels are never differentiated (their VJP is custom), yet when
  they run inside the scanned decoder layers, JAX's partial evaluation of a
  `lax.scan` nested there keeps every block's scores as stacked [nq, nk, ...]
  buffers; a while loop has no such residuals.
  """
  n = jax.tree.leaves(xs)[0].shape[0]
  _, y_shapes = jax.eval_shape(body, init, jax.tree.map(lambda x: x[0], xs))
  ys = jax.tree.map(lambda y: jnp.zeros((n,) + y.shape, y.dtype), y_shapes)

  def step(state):
    i, carry, ys = state
    carry, y = body(carry, jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False),
                                        xs))
    ys = jax.tree.map(lambda acc, v: jax.lax.dynamic_update_index_in_dim(acc, v, i, 0), ys, y)
    return i + 1, carry, ys

  _, carry, ys = jax.lax.while_loop(lambda state: state[0] < n, step, (jnp.int32(0), init, ys))
  return carry, ys


def _flash_forward(q_btkgh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, block_q, block_k):
  """Returns out [B, T, K, G, H] (q's dtype) and log-sum-exp [B, T, K, G] (fp32)."""
  b, t, kh, g, h = q_btkgh.shape
  dtype = q_btkgh.dtype
  scale = h ** -0.5
  q_nb = _blocks(q_btkgh, block_q, 0)
  qpos_nb = _blocks(q_pos_bt, block_q, -1)
  k_mb, v_mb = _blocks(k_bskh, block_k, 0), _blocks(v_bskh, block_k, 0)
  kvpos_mb = _blocks(kv_pos_bs, block_k, -1)

  def one_query_block(args):
    q_bqkgh, q_pos_bq = args

    def one_key_block(carry, kv):
      k_bckh, v_bckh, kv_pos_bc = kv

      def update(carry):
        m_bkgq, l_bkgq, acc_bkgqh = carry
        s, mask = _block_scores(q_bqkgh, k_bckh, q_pos_bq, kv_pos_bc, scale)
        s = jnp.where(mask, s, _MASK_VALUE)
        m_new = jnp.maximum(m_bkgq, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m_bkgq - m_new)
        l_new = l_bkgq * correction + jnp.sum(p, axis=-1)
        acc = acc_bkgqh * correction[..., None] + jnp.einsum(
            "bkgqc,bckh->bkgqh", p.astype(dtype), v_bckh, preferred_element_type=jnp.float32)
        return m_new, l_new, acc

      carry = jax.lax.cond(_any_visible(q_pos_bq, kv_pos_bc), update, lambda c: c, carry)
      return carry, None

    q_len = q_bqkgh.shape[1]
    init = (jnp.full((b, kh, g, q_len), _MASK_VALUE, jnp.float32),
            jnp.zeros((b, kh, g, q_len), jnp.float32),
            jnp.zeros((b, kh, g, q_len, h), jnp.float32))
    (m, l, acc), _ = _loop_scan(one_key_block, init, (k_mb, v_mb, kvpos_mb))
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    # Rows that see nothing get +inf so the backward's exp(s - lse) is 0 there.
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    return (jnp.einsum("bkgqh->bqkgh", out).astype(dtype), jnp.einsum("bkgq->bqkg", lse))

  _, (out_nb, lse_nb) = _loop_scan(lambda _, x: ((), one_query_block(x)), (), (q_nb, qpos_nb))
  return _unblock(out_nb, t), _unblock(lse_nb, t)


def _flash_backward(q_btkgh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, out_btkgh, lse_btkg,
                    dout_btkgh, block_q, block_k):
  """Gradients for q, k, v, recomputing each block's probabilities from the lse."""
  b, t, kh, g, h = q_btkgh.shape
  s_len = k_bskh.shape[1]
  dtype = q_btkgh.dtype
  scale = h ** -0.5
  # D = rowsum(dout * out), the softmax backward's correction term.
  delta_btkg = jnp.sum(dout_btkgh.astype(jnp.float32) * out_btkgh.astype(jnp.float32), -1)
  q_nb, qpos_nb = _blocks(q_btkgh, block_q, 0), _blocks(q_pos_bt, block_q, -1)
  do_nb = _blocks(dout_btkgh.astype(dtype), block_q, 0)
  lse_nb, delta_nb = _blocks(lse_btkg, block_q, jnp.inf), _blocks(delta_btkg, block_q, 0)
  k_mb, v_mb = _blocks(k_bskh, block_k, 0), _blocks(v_bskh, block_k, 0)
  kvpos_mb = _blocks(kv_pos_bs, block_k, -1)

  def one_query_block(dkv, args):
    q_bqkgh, q_pos_bq, do_bqkgh, lse_bqkg, delta_bqkg = args
    lse_bkgq = jnp.einsum("bqkg->bkgq", lse_bqkg)
    delta_bkgq = jnp.einsum("bqkg->bkgq", delta_bqkg)

    def one_key_block(dq_bqkgh, kv):
      k_bckh, v_bckh, kv_pos_bc, dk_bckh, dv_bckh = kv

      def update(operands):
        dq_bqkgh, dk_bckh, dv_bckh = operands
        s, mask = _block_scores(q_bqkgh, k_bckh, q_pos_bq, kv_pos_bc, scale)
        p = jnp.where(mask, jnp.exp(s - lse_bkgq[..., None]), 0.0)
        dv_bckh = dv_bckh + jnp.einsum("bkgqc,bqkgh->bckh", p.astype(dtype), do_bqkgh,
                                       preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqkgh,bckh->bkgqc", do_bqkgh, v_bckh,
                        preferred_element_type=jnp.float32)
        ds = (p * (dp - delta_bkgq[..., None]) * scale).astype(dtype)
        dq_bqkgh = dq_bqkgh + jnp.einsum("bkgqc,bckh->bqkgh", ds, k_bckh,
                                         preferred_element_type=jnp.float32)
        dk_bckh = dk_bckh + jnp.einsum("bkgqc,bqkgh->bckh", ds, q_bqkgh,
                                       preferred_element_type=jnp.float32)
        return dq_bqkgh, dk_bckh, dv_bckh

      dq_bqkgh, dk_bckh, dv_bckh = jax.lax.cond(
          _any_visible(q_pos_bq, kv_pos_bc), update, lambda ops: ops,
          (dq_bqkgh, dk_bckh, dv_bckh))
      return dq_bqkgh, (dk_bckh, dv_bckh)

    dk_mb, dv_mb = dkv
    dq0 = jnp.zeros(q_bqkgh.shape, jnp.float32)
    dq, (dk_mb, dv_mb) = _loop_scan(one_key_block, dq0,
                                      (k_mb, v_mb, kvpos_mb, dk_mb, dv_mb))
    return (dk_mb, dv_mb), dq

  dkv0 = (jnp.zeros(k_mb.shape, jnp.float32), jnp.zeros(v_mb.shape, jnp.float32))
  (dk_mb, dv_mb), dq_nb = _loop_scan(one_query_block, dkv0,
                                       (q_nb, qpos_nb, do_nb, lse_nb, delta_nb))
  return (_unblock(dq_nb, t).astype(dtype), _unblock(dk_mb, s_len).astype(k_bskh.dtype),
          _unblock(dv_mb, s_len).astype(v_bskh.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q_btkgh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, block_q, block_k):
  return _flash_forward(q_btkgh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, block_q, block_k)[0]


def _flash_fwd(q_btkgh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, block_q, block_k):
  out, lse = _flash_forward(q_btkgh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, block_q, block_k)
  return out, (q_btkgh, k_bskh, v_bskh, q_pos_bt, kv_pos_bs, out, lse)


def _flash_bwd(block_q, block_k, residuals, dout_btkgh):
  q, k, v, q_pos, kv_pos, out, lse = residuals
  dq, dk, dv = _flash_backward(q, k, v, q_pos, kv_pos, out, lse, dout_btkgh, block_q, block_k)
  zero_positions = lambda x: np.zeros(x.shape, jax.dtypes.float0)
  return dq, dk, dv, zero_positions(q_pos), zero_positions(kv_pos)


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q_btnh, k_bskh, v_bskh, q_positions_bt, kv_positions_bs, *,
                        block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK):
  """Flash attention in plain JAX; memory O(T + S) per head, never [T, S].

  Blocks shrink to the sequence when it is shorter; T and S need not be
  multiples of the blocks (the tails are padded with invisible slots).
  """
  b, t, n, h = q_btnh.shape
  s_len = k_bskh.shape[1]
  block_q, block_k = min(block_q, t), min(block_k, s_len)
  dtype = q_btnh.dtype
  out_btkgh = _flash(_grouped(q_btnh, k_bskh.shape[2]), k_bskh.astype(dtype),
                     v_bskh.astype(dtype), q_positions_bt.astype(jnp.int32),
                     kv_positions_bs.astype(jnp.int32), block_q, block_k)
  return out_btkgh.reshape(b, t, n, h)


# Backend kernels.

def cudnn_attention(q_btnh, k_bskh, v_bskh, q_positions_bt, kv_positions_bs):
  """cuDNN flash attention (GPU); the position mask as a boolean [B, 1, T, S].

  Queries that see no key attend to every slot, as the einsum reference's
  softmax over all-masked scores does, so the kernel never divides by zero.
  """
  dtype = q_btnh.dtype
  mask_bts = visible(q_positions_bt, kv_positions_bs)
  mask_b1ts = (mask_bts | ~jnp.any(mask_bts, axis=-1, keepdims=True))[:, None]
  return jax.nn.dot_product_attention(q_btnh, k_bskh.astype(dtype), v_bskh.astype(dtype),
                                      mask=mask_b1ts, implementation="cudnn")


def splash_attention(q_btnh, k_bskh, v_bskh, kv_positions_bs, *, interpret: bool = False):
  """Pallas splash attention (TPU) for an uncached pass: causal by slot, padding by segment.

  Padding slots (position -1) form their own segment, so real tokens never see
  them and padding queries see only padding (never an empty row).
  Under a mesh the kernel runs per shard: batch over the data axes, heads
  over the tensor axis.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as splash_mask)

  b, t, n, h = q_btnh.shape
  dtype = q_btnh.dtype
  segments_bs = (kv_positions_bs >= 0).astype(jnp.int32)

  def kernel_call(q_btnh, k_bskh, v_bskh, segments_bs):
    heads = q_btnh.shape[2]
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * heads)
    block = min(DEFAULT_BLOCK, t)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block,
                              block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    interpret=interpret)
    one_row = lambda q, k, v, seg: kernel(
        q.swapaxes(0, 1) * (h ** -0.5), k.swapaxes(0, 1), v.swapaxes(0, 1),
        segment_ids=splash.SegmentIds(q=seg, kv=seg)).swapaxes(0, 1)
    return jax.vmap(one_row)(q_btnh, k_bskh.astype(dtype), v_bskh.astype(dtype), segments_bs)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return kernel_call(q_btnh, k_bskh, v_bskh, segments_bs)
  # kv heads split over tensor only where they divide it; q heads follow their kv head.
  heads_spec = partitioning.logical_to_spec(("batch", None, "kv_heads", None), k_bskh.shape,
                                            mesh)
  rows_spec = jax.sharding.PartitionSpec(heads_spec[0], None)
  return jax.shard_map(kernel_call, mesh=mesh, in_specs=(heads_spec,) * 3 + (rows_spec,),
                       out_specs=heads_spec, check_vma=False)(
                           q_btnh, k_bskh, v_bskh, segments_bs)
