"""Attention implementations against the einsum reference: values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infra.errors import UserInputError
from models import attention


def _inputs(b, t, s, n, k, h=8, seed=0, dtype=jnp.float32):
  rng = np.random.RandomState(seed)
  q = jnp.asarray(rng.randn(b, t, n, h), dtype)
  kk = jnp.asarray(rng.randn(b, s, k, h), dtype)
  v = jnp.asarray(rng.randn(b, s, k, h), dtype)
  return q, kk, v


def _padded_positions(lengths, width, side):
  """Positions of a padded uncached batch: consecutive over real tokens, -1 on padding."""
  kv = np.full((len(lengths), width), -1, np.int32)
  for row, n in enumerate(lengths):
    start = width - n if side == "left" else 0
    kv[row, start:start + n] = np.arange(n)
  q = np.maximum(kv, 0)
  return jnp.asarray(q), jnp.asarray(kv)


def _cached_with_holes(b, t, s, seed=0):
  """A cache of S slots as the sampler leaves it: earlier turns with padding holes, then
  T new left-padded tokens, then two empty slots; the queries are the new tokens."""
  rng = np.random.RandomState(seed)
  kv = np.full((b, s), -1, np.int32)
  q = np.zeros((b, t), np.int32)
  written = s - t - 2
  for row in range(b):
    real = rng.rand(written) > 0.3
    kv[row, :written][real] = np.arange(real.sum())
    new = rng.randint(1, t + 1)
    positions = real.sum() + np.arange(new)
    kv[row, written + t - new:written + t] = positions
    q[row, t - new:] = positions
    q[row, :t - new] = real.sum()  # padding queries, as default_positions places them
  return jnp.asarray(q), jnp.asarray(kv)


def _real_queries(q_positions, kv_positions):
  """Queries that see at least one key (only those are compared)."""
  return np.asarray(attention.visible(q_positions, kv_positions).any(-1))


def _check_equal(q, k, v, q_pos, kv_pos, block, atol=1e-5):
  real_bt = _real_queries(q_pos, kv_pos)
  weights = jnp.asarray(np.random.RandomState(7).randn(*q.shape), jnp.float32) * real_bt[
      ..., None, None]

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v, q_pos, kv_pos).astype(jnp.float32) * weights)

  ref = attention.einsum_attention
  blockwise = lambda *a: attention.blockwise_attention(*a, block_q=block, block_k=block)
  np.testing.assert_allclose(np.asarray(blockwise(q, k, v, q_pos, kv_pos))[real_bt],
                             np.asarray(ref(q, k, v, q_pos, kv_pos))[real_bt], atol=atol)
  grads_ref = jax.grad(functools_partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
  grads = jax.jit(jax.grad(functools_partial(loss, blockwise), argnums=(0, 1, 2)))(q, k, v)
  for name, a, b in zip("qkv", grads, grads_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, err_msg=name)


def functools_partial(fn, first):
  return lambda *args: fn(first, *args)


@pytest.mark.parametrize("n,k", [(4, 4), (4, 2), (6, 2), (8, 1)])
def test_blockwise_equals_einsum_for_gqa_ratios(n, k):
  q, kk, v = _inputs(2, 19, 19, n, k)  # 19: not a multiple of the block
  q_pos, kv_pos = _padded_positions([19, 12], 19, "right")
  _check_equal(q, kk, v, q_pos, kv_pos, block=8)


@pytest.mark.parametrize("side", ["left", "right"])
def test_blockwise_equals_einsum_with_padding(side):
  q, kk, v = _inputs(3, 21, 21, 4, 2, seed=1)
  q_pos, kv_pos = _padded_positions([21, 5, 13], 21, side)
  _check_equal(q, kk, v, q_pos, kv_pos, block=4)


def test_blockwise_equals_einsum_on_a_cache_with_holes():
  q, kk, v = _inputs(3, 5, 37, 4, 2, seed=2)
  q_pos, kv_pos = _cached_with_holes(3, 5, 37)
  assert (np.asarray(kv_pos) == -1).any(axis=1).all()  # every row has holes
  _check_equal(q, kk, v, q_pos, kv_pos, block=8)


def test_blockwise_queries_that_see_nothing_are_zero_and_finite():
  q, kk, v = _inputs(1, 6, 6, 2, 1, seed=3)
  kv_pos = jnp.asarray([[-1, -1, 0, 1, 2, 3]])
  q_pos = jnp.asarray([[-1, -1, 0, 1, 2, 3]])  # the first two queries see no key
  out = np.asarray(attention.blockwise_attention(q, kk, v, q_pos, kv_pos, block_q=4, block_k=4))
  np.testing.assert_array_equal(out[0, :2], 0.0)
  grads = jax.grad(lambda q: attention.blockwise_attention(
      q, kk, v, q_pos, kv_pos, block_q=4, block_k=4).sum())(q)
  assert np.isfinite(np.asarray(grads)).all()


def test_blockwise_bf16_matches_fp32_reference_within_bf16_error():
  q, kk, v = _inputs(2, 40, 40, 4, 2, seed=4)
  q_pos, kv_pos = _padded_positions([40, 31], 40, "right")
  ref = np.asarray(attention.einsum_attention(q, kk, v, q_pos, kv_pos))
  bf16 = [x.astype(jnp.bfloat16) for x in (q, kk, v)]
  out = attention.blockwise_attention(*bf16, q_pos, kv_pos, block_q=16, block_k=16)
  assert out.dtype == jnp.bfloat16
  real = _real_queries(q_pos, kv_pos)
  assert np.abs(np.asarray(out.astype(jnp.float32)) - ref)[real].max() < 0.05


def test_blockwise_backward_holds_no_score_matrix():
  """The jitted gradient's temporaries grow linearly in T, not with T x S, also under the
  scanned decoder layers' `lax.scan` (where nested scans would stack every block's scores)."""
  def temp_bytes(t):
    q, kk, v = _inputs(1, t, t, 2, 1, h=16)
    pos = jnp.arange(t, dtype=jnp.int32)[None]

    def two_layers(q, k, v):
      layer = lambda x, _: (attention.blockwise_attention(x, k, v, pos, pos, block_q=64,
                                                          block_k=64), None)
      return jax.lax.scan(layer, q, None, length=2)[0].sum()

    grad = jax.jit(jax.grad(two_layers, argnums=(0, 1, 2)))
    return grad.lower(q, kk, v).compile().memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(512), temp_bytes(2048)
  assert large < 6 * small, (small, large)  # quadratic would be 16x
  assert large < 2048 * 2048 * 2 * 4  # less than one head's fp32 scores


def test_auto_picks_einsum_for_decode_and_blockwise_for_long_cpu_passes():
  assert attention.resolve("auto", 1, 8192, cached=True) == "einsum"
  if jax.default_backend() == "cpu":
    assert attention.resolve("auto", 4096, 4096, cached=False) == "blockwise"
    # A training pass of two CPU blocks or more runs in CPU blocks, though einsum would fit.
    block = attention.CPU_BLOCK
    assert attention.resolve("auto", 2 * block, 2 * block, cached=False) == "blockwise"
    assert attention.default_block() == block
    assert attention.resolve("auto", 2 * block - 1, 2 * block - 1, cached=False) == "einsum"
    assert attention.resolve("auto", 2 * block, 4 * block, cached=True) == "einsum"  # prefill
  with pytest.raises(UserInputError, match="attention implementation 'flash'.*einsum"):
    attention.resolve("flash", 1, 1, cached=False)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")
def test_cudnn_equals_einsum():
  q, kk, v = [x.astype(jnp.bfloat16) for x in _inputs(2, 128, 128, 4, 2, h=64)]
  q_pos, kv_pos = _padded_positions([128, 77], 128, "left")
  real = _real_queries(q_pos, kv_pos)
  out = attention.cudnn_attention(q, kk, v, q_pos, kv_pos).astype(jnp.float32)
  ref = attention.einsum_attention(q, kk, v, q_pos, kv_pos).astype(jnp.float32)
  np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=2e-2)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("axes", [None, {"data": 1, "fsdp": 2, "tensor": 2}])
def test_splash_wrapper_equals_einsum_in_pallas_interpret_mode(side, axes):
  """Our masks, GQA layout, scaling and shard_map around the splash kernel, run by the
  Pallas interpreter on CPU (the compiled kernel itself needs a TPU: next test)."""
  from models import partitioning
  q, kk, v = _inputs(2, 256, 256, 4, 2, h=128, seed=5)
  q_pos, kv_pos = _padded_positions([256, 100], 256, side)
  real_bt = np.asarray(kv_pos) >= 0  # padding queries see padding here, nothing there
  weights = jnp.asarray(real_bt[..., None, None], jnp.float32)
  mesh = None if axes is None else partitioning.make_mesh(axes)

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v) * weights)

  splash = lambda q, k, v: attention.splash_attention(q, k, v, kv_pos, interpret=True)
  ref = lambda q, k, v: attention.einsum_attention(q, k, v, q_pos, kv_pos)
  with partitioning.mesh_context(mesh):
    out = jax.jit(splash)(q, kk, v)
    grads = jax.jit(jax.grad(functools_partial(loss, splash), argnums=(0, 1, 2)))(q, kk, v)
  np.testing.assert_allclose(np.asarray(out)[real_bt], np.asarray(ref(q, kk, v))[real_bt],
                             atol=1e-5)
  grads_ref = jax.grad(functools_partial(loss, ref), argnums=(0, 1, 2))(q, kk, v)
  for name, a, b in zip("qkv", grads, grads_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=name)


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="splash attention needs a TPU")
def test_splash_equals_einsum():
  q, kk, v = [x.astype(jnp.bfloat16) for x in _inputs(2, 512, 512, 4, 2, h=128)]
  q_pos, kv_pos = _padded_positions([512, 300], 512, "right")
  real = np.asarray(kv_pos) >= 0
  out = attention.splash_attention(q, kk, v, kv_pos).astype(jnp.float32)
  ref = attention.einsum_attention(q, kk, v, q_pos, kv_pos).astype(jnp.float32)
  np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=2e-2)


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("axes", [None, {"data": 1, "fsdp": 2, "tensor": 2}])
def test_paged_decode_equals_einsum_in_pallas_interpret_mode(stacked, axes):
  """The TPU decode kernel's wrapper (pages over a per-row cache, a stack's layer index, GQA,
  shard_map) run by the Pallas TPU interpreter on CPU, against einsum over the same rows:
  row b sees its slots [0, lengths[b])."""
  from jax.experimental.pallas import tpu as pltpu
  from models import partitioning
  layers, b, k, g, s, h = 3, 4, 2, 3, 512, 128
  rng = np.random.RandomState(7)
  as_bf16 = lambda *shape: jnp.asarray(rng.randn(*shape), jnp.bfloat16)
  k_cache, v_cache = as_bf16(layers, b, k, s, h), as_bf16(layers, b, k, s, h)
  q = as_bf16(b, 1, k * g, h)
  lengths = jnp.asarray([1, 130, 512, 77], jnp.int32)  # one slot, a page and a bit, all
  layer = 1
  slots = jnp.arange(s)[None]
  kv_pos = jnp.where(slots < lengths[:, None], slots, -1)
  ref = attention.einsum_attention(q.astype(jnp.float32),
                                   k_cache[layer].swapaxes(1, 2).astype(jnp.float32),
                                   v_cache[layer].swapaxes(1, 2).astype(jnp.float32),
                                   (lengths - 1)[:, None], kv_pos)
  args = ((k_cache, v_cache, jnp.int32(layer)) if stacked else
          (k_cache[layer], v_cache[layer], None))
  mesh = None if axes is None else partitioning.make_mesh(axes)
  with pltpu.force_tpu_interpret_mode(), partitioning.mesh_context(mesh):
    out = jax.jit(lambda q, kc, vc, lengths: attention.paged_decode_attention(
        q, kc, vc, args[2], lengths))(q, args[0], args[1], lengths)
  assert out.shape == q.shape and out.dtype == q.dtype
  # The kernel multiplies in bf16.
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=3e-2)


def test_paged_decode_serves_single_token_steps_on_per_row_caches_on_tpu_only():
  lengths = jnp.zeros((2,), jnp.int32)
  assert not attention.decodes_paged("auto", 1, 128, lengths)  # this CPU
  from infra import topology
  from models import partitioning
  try:
    devices = topology.slice_devices(topology.parse_accelerator_type("v5p-8"))
  except UserInputError as e:
    pytest.skip(f"no TPU compiler: {e}")
  with partitioning.mesh_context(partitioning.make_mesh({"fsdp": -1}, devices)):
    assert attention.decodes_paged("auto", 1, 128, lengths)
    assert not attention.decodes_paged("auto", 16, 128, lengths)  # a prefill chunk
    assert not attention.decodes_paged("auto", 1, 64, lengths)  # the kernel's 128 lanes
    assert not attention.decodes_paged("auto", 1, 128, None)  # a shared-length cache
    assert not attention.decodes_paged("einsum", 1, 128, lengths)  # chosen explicitly
