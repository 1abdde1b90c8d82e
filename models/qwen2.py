"""Qwen2 / Qwen2.5 decoder in Flax NNX: causal LM, value model, KV cache.

Weight layout (ours, not HF's): projections are stored input-major so the
forward pass is a plain einsum, and attention projections keep the head axis
separate so tensor parallelism over heads is explicit in the sharding spec.

  embed       [V, D]        ("vocab", "embed")
  q_proj      [D, N, H]     ("embed", "q_heads", "head_dim")   + bias [N, H]
  k_proj/v    [D, K, H]     ("embed", "kv_heads", "head_dim")  + bias [K, H]
  o_proj      [N, H, D]     ("q_heads", "head_dim", "embed")
  gate/up     [D, F]        ("embed", "mlp")
  down        [F, D]        ("mlp", "embed")
  lm_head     [V, D]        ("vocab", "embed")   (absent when tied)

The decoder layers' weights (q_proj ... down_proj, the layer norms) are
stacked with a leading [L] axis ("layers", never sharded) and run under
`lax.scan`; the KV cache is stacked the same way ([L, B, K, S, H]: each kv head's slots
contiguous, so decode attention reads them without a transposed copy).

Shape letters: B batch, T new tokens, S cache slots, D model width, N query
heads, K key/value heads, G = N // K query heads per kv head, H head width,
F MLP width, V vocabulary, L layers.

Masking is by position: every key slot carries the position of the token in
it (-1 for padding or empty), and a query at position p sees the slots with
0 <= position <= p. That one rule covers left and right padding, prefill,
decode and multi-turn continuation alike.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from infra.errors import UserInputError
from models import attention, partitioning
from models import checkpoint_io
from models.partitioning import constrain

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  """Architecture of one Qwen2 model; the fields of HF's `config.json` we use."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int | None = None  # None: hidden_size // num_heads, as HF does.
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  bos_token_id: int | None = 151643
  eos_token_id: int | list[int] | None = 151645
  initializer_range: float = 0.02

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} is not a multiple of "
          f"num_kv_heads={self.num_kv_heads}")

  @property
  def head_size(self) -> int:
    return self.head_dim or self.hidden_size // self.num_heads

  @classmethod
  def from_hf_dict(cls, hf: dict[str, Any], source: str = "config") -> "Qwen2Config":
    """Builds a config from a parsed HF `config.json`; `source` names it in errors."""
    model_type = hf.get("model_type")
    architectures = hf.get("architectures") or []
    if model_type != "qwen2" or any("Qwen2" not in a for a in architectures):
      raise ValueError(
          f"{source}: not a Qwen2 architecture (model_type={model_type!r}, "
          f"architectures={architectures!r}); expected model_type 'qwen2'")
    if hf.get("use_sliding_window"):
      raise NotImplementedError(
          f"{source}: use_sliding_window=true is not supported (Qwen2.5 "
          "checkpoints ship with it off)")
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
      raise NotImplementedError(f"{source}: rope_scaling={rope_scaling!r} is not supported")
    if hf.get("hidden_act", "silu") != "silu":
      raise NotImplementedError(f"{source}: hidden_act={hf['hidden_act']!r} is not supported")
    required = ("vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in hf]
    if missing:
      raise ValueError(f"{source}: missing fields {missing}")
    return cls(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
        head_dim=hf.get("head_dim"),
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        initializer_range=hf.get("initializer_range", 0.02),
    )

  def to_hf_dict(self, torch_dtype: str) -> dict[str, Any]:
    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "hidden_act": "silu",
        "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": self.eos_token_id,
        "initializer_range": self.initializer_range,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "torch_dtype": torch_dtype,
    }
    if self.head_dim is not None:
      hf["head_dim"] = self.head_dim
    return hf


def _qwen25(hidden, inter, layers, heads, kv_heads, eps, tied):
  return Qwen2Config(
      vocab_size=151936 if tied else 152064, hidden_size=hidden,
      intermediate_size=inter, num_layers=layers, num_heads=heads,
      num_kv_heads=kv_heads, rms_norm_eps=eps, tie_word_embeddings=tied)


# Shapes of the released Qwen2.5(-Instruct) models, for planning and benchmarks
# with abstract or random weights; real runs read the checkpoint's config.json.
PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, 1e-6, True),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, 1e-6, True),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2, 1e-6, True),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, 1e-6, False),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8, 1e-5, False),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8, 1e-5, False),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8, 1e-5, False),
}


@struct.dataclass
class KVCache:
  """Static-shape decoding cache shared by all layers, in one of two layouts.

  Shared length (`length` is a scalar): every call appends its T new tokens
  (padding included) at slots [length, length + T) of every row; padding
  slots get position -1 and are never attended. The caller keeps
  length + T <= S (the sampler checks it).

  Per-row lengths (`length` is [B], from `init_rows`): each row holds its own
  tokens contiguously, slot = position, and `length[b]` of them. A call's
  new tokens are right-padded (real tokens first); row b's are written from
  slot length[b] on and its length grows by its real-token count, so padding
  and rows with no new tokens leave no holes. Writes past S are dropped; the
  caller keeps length[b] + (real tokens) <= S.

  Keys and values are one stack [L, B, K, S, H] for a model that scans its
  layers, or, for one whose layers are a list (`unscanned`), L arrays
  [B, K, S, H] of their own (`layers_as_list`): a layer then attends over its
  keys where they lie, where reading a layer out of a stack copies it (the
  CPU backend copies both, every layer and token). Work on every layer's
  arrays alike goes through `map_kv`, with axes counted from the end.
  """

  k: Array | tuple[Array, ...]  # [L, B, K, S, H], or L arrays [B, K, S, H]
  v: Array | tuple[Array, ...]  # as k
  kv_positions_bs: Array  # int32 [B, S], -1 where empty or padding
  length: Array  # int32 [] slots written so far, or int32 [B] tokens held per row

  @classmethod
  def init(cls, config: Qwen2Config, batch_size: int, max_len: int, dtype=jnp.bfloat16,
           layers_as_list: bool = False) -> "KVCache":
    shape = (batch_size, config.num_kv_heads, max_len, config.head_size)
    # Distinct buffers for k and v (and each layer's, as a list), so each can be donated.
    if layers_as_list:
      new = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    else:
      new = lambda: jnp.zeros((config.num_layers, *shape), dtype)
    return cls(k=new(), v=new(), kv_positions_bs=jnp.full((batch_size, max_len), -1, jnp.int32),
               length=jnp.zeros((), jnp.int32))

  @classmethod
  def init_rows(cls, config: Qwen2Config, batch_size: int, max_len: int, dtype=jnp.bfloat16,
                layers_as_list: bool = False) -> "KVCache":
    """An empty cache in the per-row layout."""
    cache = cls.init(config, batch_size, max_len, dtype, layers_as_list)
    return cache.replace(length=jnp.zeros((batch_size,), jnp.int32))

  def map_kv(self, fn) -> "KVCache":
    """The cache with `fn` applied to each array of keys and values ([L, B, K, S, H] or
    [B, K, S, H]: B is axis -4, S axis -2)."""
    return self.replace(k=jax.tree.map(fn, self.k), v=jax.tree.map(fn, self.v))

  @property
  def per_row(self) -> bool:
    return self.length.ndim == 1

  @property
  def max_len(self) -> int:
    return self.kv_positions_bs.shape[1]

  @property
  def next_positions_b(self) -> Array:
    """Position the next real token of each row gets."""
    return jnp.max(self.kv_positions_bs, axis=1) + 1


# Logical axes of the cache arrays, for placing them on a mesh.
KV_CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")
# ... and of activations (see partitioning.constrain).
_RESIDUAL_AXES = ("batch", "seq", None)
_HEADS_AXES = {"q": ("batch", "seq", "q_heads", "head_dim"),
               "kv": ("batch", "seq", "kv_heads", "head_dim")}
_MLP_AXES = ("batch", "seq", "mlp")
_LOGITS_AXES = ("batch", "seq", "vocab")


def _param(rngs: nnx.Rngs, shape, axes, param_dtype, std: float | None):
  if std is None:
    value = jnp.ones(shape, param_dtype)
  elif std == 0.0:
    value = jnp.zeros(shape, param_dtype)
  else:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(param_dtype)
  return nnx.Param(value, logical_axes=axes)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, *, param_dtype, rngs: nnx.Rngs):
    self.eps = eps
    self.scale = _param(rngs, (dim,), ("norm",), param_dtype, std=None)

  def __call__(self, x):
    # Normalise in fp32, then scale in the compute dtype, as HF does.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


def rope(x_btnh: Array, positions_bt: Array, theta: float) -> Array:
  """Rotary embedding, HF's rotate-half convention, angles in fp32."""
  head = x_btnh.shape[-1]
  inv_freq_h2 = 1.0 / (theta ** (jnp.arange(0, head, 2, dtype=jnp.float32) / head))
  angles_bth2 = positions_bt.astype(jnp.float32)[..., None] * inv_freq_h2
  cos = jnp.cos(angles_bth2)[:, :, None, :]
  sin = jnp.sin(angles_bth2)[:, :, None, :]
  x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_btnh.dtype)


def write_slots(cache, new_btkh, write_index, layer) -> Array:
  """Writes new keys or values [B, T, K, H] into layer `layer` of a stacked cache
  [L, B, K, S, H], or (`layer` None) into one layer's own cache [B, K, S, H].

  `write_index`: one slot for every row (a scalar, shared layout) or each
  row's own first slot ([B], per-row layout; writes past S are dropped).
  """
  at_layer = () if layer is None else (layer,)
  if jnp.ndim(write_index) == 0:
    new = new_btkh.swapaxes(1, 2)[(None,) * len(at_layer)]
    return jax.lax.dynamic_update_slice(cache, new, (*at_layer, 0, 0, write_index, 0))
  b, t, k = new_btkh.shape[:3]
  slots_bt1 = (write_index[:, None] + jnp.arange(t, dtype=jnp.int32)[None])[:, :, None]
  rows_b11 = jnp.arange(b, dtype=jnp.int32)[:, None, None]
  heads_11k = jnp.arange(k, dtype=jnp.int32)[None, None, :]
  # Each (row, slot, kv head) is an index, so the scatter's window is one head's H values:
  # the cache keeps its [..., S, H] row-major layout, the one the TPU decode kernel reads
  # (with K and H as the window, XLA:TPU laid the cache out K-minor and copied all of it
  # back for the kernel, every layer and token).
  return cache.at[(*at_layer, rows_b11, heads_11k, slots_bt1)].set(new_btkh, mode="drop")


@struct.dataclass
class LayerCache:
  """What one decoder layer of a cached pass reads and writes: the stacked keys and values of
  every layer and its own index among them (or its own keys and values), and the slot its
  new tokens start at."""

  k: Array  # [L, B, K, S, H] (a stack), or [B, K, S, H] (the layer's own: `layer` None)
  v: Array  # as k
  layer: Array | int | None  # int32 [] under a scan, an int in a Python loop
  write_index: Array  # int32 [] (shared layout) or [B] (per-row layout); see `write_slots`
  lengths: Array | None = None  # int32 [B]: each row's length after this pass (per-row)

  @classmethod
  def of(cls, k, v, layer, write_index, lengths=None) -> "LayerCache":
    """Layer `layer`'s part of a cache's keys and values (`KVCache.k`, `KVCache.v`)."""
    if isinstance(k, tuple):
      if not isinstance(layer, int):
        raise ValueError("a cache of one array per layer (layers_as_list) needs a model whose "
                         "layers are a list (qwen2.unscanned); this one scans them")
      return cls(k[layer], v[layer], None, write_index, lengths)
    return cls(k, v, layer, write_index, lengths)

  def into(self, k, v, layer) -> tuple:
    """The cache's keys and values `k`, `v` with this layer's part written back."""
    if isinstance(k, tuple):
      put = lambda arrays, new: arrays[:layer] + (new,) + arrays[layer + 1:]
      return put(k, self.k), put(v, self.v)
    return self.k, self.v

  def written(self, k_btkh, v_btkh) -> tuple["LayerCache", Array, Array]:
    """The cache with the new keys and values written in, and this layer's keys and values
    [B, S, K, H] read back from it. Writing first and reading after lets XLA update the
    stack in place; attending over a copy of the old slice made it copy the whole stack
    in every layer (4 copies of the cache per layer and token on the CPU backend)."""
    k = write_slots(self.k, k_btkh.astype(self.k.dtype), self.write_index, self.layer)
    v = write_slots(self.v, v_btkh.astype(self.v.dtype), self.write_index, self.layer)
    layer_of = lambda x: x if self.layer is None else x[self.layer]
    # Viewed as [B, S, K, H]; attention's contraction takes the kv heads as a batch dim, so
    # XLA folds the swap back into the dot instead of copying.
    return (self.replace(k=k, v=v), layer_of(k).swapaxes(1, 2), layer_of(v).swapaxes(1, 2))


class Attention(nnx.Module):

  def __init__(self, config: Qwen2Config, *, param_dtype, implementation: str = "auto",
               rngs: nnx.Rngs):
    d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_size
    std = config.initializer_range
    self.theta = config.rope_theta
    self.implementation = attention.check_implementation(implementation)
    self.q_proj = _param(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), param_dtype, std)
    self.q_bias = _param(rngs, (n, h), ("q_heads", "head_dim"), param_dtype, 0.0)
    self.k_proj = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), param_dtype, std)
    self.k_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), param_dtype, 0.0)
    self.v_proj = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), param_dtype, std)
    self.v_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), param_dtype, 0.0)
    self.o_proj = _param(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), param_dtype, std)

  def __call__(self, x_btd, positions_bt, kv_positions_bs, cache: LayerCache | None = None):
    """Returns the attention output and `cache` with this call's keys and values written in.

    `kv_positions_bs` are the positions of the key slots (the cache's, with
    this call's tokens written in), -1 where empty; see `attention.visible`.
    """
    dtype = x_btd.dtype
    q_btnh = jnp.einsum("btd,dnh->btnh", x_btd, self.q_proj[...].astype(dtype))
    q_btnh = q_btnh + self.q_bias[...].astype(dtype)
    k_btkh = jnp.einsum("btd,dkh->btkh", x_btd, self.k_proj[...].astype(dtype))
    k_btkh = k_btkh + self.k_bias[...].astype(dtype)
    v_btkh = jnp.einsum("btd,dkh->btkh", x_btd, self.v_proj[...].astype(dtype))
    v_btkh = v_btkh + self.v_bias[...].astype(dtype)
    q_btnh = constrain(rope(q_btnh, positions_bt, self.theta), _HEADS_AXES["q"])
    k_btkh = constrain(rope(k_btkh, positions_bt, self.theta), _HEADS_AXES["kv"])
    v_btkh = constrain(v_btkh, _HEADS_AXES["kv"])

    if cache is None:
      out_btnh = attention.attend(q_btnh, k_btkh, v_btkh, positions_bt, kv_positions_bs,
                                  implementation=self.implementation)
    else:
      cache, k_bskh, v_bskh = cache.written(k_btkh, v_btkh)
      if attention.decodes_paged(self.implementation, q_btnh.shape[1], q_btnh.shape[3],
                                 cache.lengths):
        out_btnh = attention.paged_decode_attention(q_btnh, cache.k, cache.v, cache.layer,
                                                    cache.lengths)
      else:
        out_btnh = attention.attend(q_btnh, k_bskh, v_bskh, positions_bt, kv_positions_bs,
                                    implementation=self.implementation, cached=True)
    # One contraction over the flattened heads: contracting (n, h) as two dims let the CPU
    # backend pick an (h, n) order and copy the whole o_proj weight transposed, every call.
    b, t, n, h = out_btnh.shape
    o_proj_fd = self.o_proj[...].astype(dtype).reshape(n * h, -1)
    out_btd = jnp.einsum("btf,fd->btd", out_btnh.reshape(b, t, n * h), o_proj_fd)
    return out_btd, cache


class MLP(nnx.Module):

  def __init__(self, config: Qwen2Config, *, param_dtype, rngs: nnx.Rngs):
    d, f, std = config.hidden_size, config.intermediate_size, config.initializer_range
    self.gate_proj = _param(rngs, (d, f), ("embed", "mlp"), param_dtype, std)
    self.up_proj = _param(rngs, (d, f), ("embed", "mlp"), param_dtype, std)
    self.down_proj = _param(rngs, (f, d), ("mlp", "embed"), param_dtype, std)

  def __call__(self, x_btd):
    dtype = x_btd.dtype
    gate_btf = constrain(jnp.einsum("btd,df->btf", x_btd, self.gate_proj[...].astype(dtype)),
                         _MLP_AXES)
    up_btf = constrain(jnp.einsum("btd,df->btf", x_btd, self.up_proj[...].astype(dtype)),
                       _MLP_AXES)
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate_btf) * up_btf,
                      self.down_proj[...].astype(dtype))


class DecoderLayer(nnx.Module):

  def __init__(self, config: Qwen2Config, *, param_dtype, attention: str = "auto",
               rngs: nnx.Rngs):
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
    self.attn = Attention(config, implementation=attention, **kw)
    self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
    self.mlp = MLP(config, **kw)

  def __call__(self, x_btd, positions_bt, kv_positions_bs, cache: LayerCache | None = None):
    attn_btd, cache = self.attn(self.input_norm(x_btd), positions_bt, kv_positions_bs, cache)
    x_btd = x_btd + attn_btd
    x_btd = x_btd + self.mlp(self.post_attn_norm(x_btd))
    return x_btd, cache


REMAT_POLICIES = ("none", "full", "save_dots", "offload")


def remat_policy_name(remat: bool | str) -> str:
  """`remat` as a policy name; True and False (older configs) mean full and none."""
  name = ("full" if remat else "none") if isinstance(remat, bool) else remat
  if name not in REMAT_POLICIES:
    raise UserInputError(f"remat policy {remat!r} (policy.remat_policy); expected one of "
                         f"{', '.join(REMAT_POLICIES)}")
  return name


def _checkpointed(fn, policy: str):
  """`fn` under the remat policy: what the backward pass keeps of one layer.

  full keeps only the layer's input; save_dots also keeps the outputs of the
  weight matmuls (projections, MLP) and recomputes attention and elementwise
  ops; offload keeps those matmul outputs in host memory (TPU and GPU).
  """
  if policy == "none":
    return fn
  if policy == "full":
    return jax.checkpoint(fn)
  if policy == "save_dots":
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  if partitioning.target_platform() == "cpu":
    raise UserInputError("remat policy 'offload' (policy.remat_policy) needs host offload, which "
                         "the CPU backend lacks; use save_dots or full")
  return jax.checkpoint(fn, policy=jax.checkpoint_policies.offload_dot_with_no_batch_dims(
      "device", "pinned_host"))


def _stacked_layers(config: Qwen2Config, *, param_dtype, attention: str,
                    rngs: nnx.Rngs) -> DecoderLayer:
  """All decoder layers as one module whose weights have a leading layer axis [L, ...]."""

  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=config.num_layers)
  def make(rngs):
    return DecoderLayer(config, param_dtype=param_dtype, attention=attention, rngs=rngs)

  layers = make(rngs)
  for _, variable in nnx.iter_graph(layers):
    if isinstance(variable, nnx.Variable):
      variable.set_metadata(logical_axes=("layers",) + variable.get_metadata()["logical_axes"])
  return layers


def unscanned(model: nnx.Module) -> nnx.Module:
  """`model` (a Qwen2 or Qwen2Value) with its stacked decoder layers as a list of layer
  modules, each holding its own slices of the weights; the other weights are shared.

  Its passes loop over the layers in Python instead of scanning them. Decoding reads each
  layer's weights straight from their own arrays, where a scan slices them out of the stack
  (the CPU backend copies every slice, every token). Call it under `jit` (as the sampler's
  weight copy does) so the slices are the jitted function's outputs, not eager copies.
  """
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, state)  # a new module tree over the same arrays
  layer_graph, layer_state = nnx.split(model.backbone.layers)
  layers = []
  for i in range(model.config.num_layers):
    layer = nnx.merge(layer_graph, jax.tree.map(lambda x: x[i], layer_state))
    for _, variable in nnx.iter_graph(layer):
      if isinstance(variable, nnx.Variable):  # the reverse of `_stacked_layers`
        variable.set_metadata(logical_axes=variable.get_metadata()["logical_axes"][1:])
    layers.append(layer)
  model.backbone.layers = nnx.List(layers)
  return model


def default_positions(attention_mask_bt: Array, cache: KVCache | None) -> Array:
  """Positions of new tokens: consecutive over real tokens, after the cache's."""
  mask = attention_mask_bt.astype(jnp.int32)
  if cache is None:
    offset_b = 0
  else:
    offset_b = cache.length if cache.per_row else cache.next_positions_b
  positions_bt = jnp.cumsum(mask, axis=1) - 1 + jnp.asarray(offset_b)[..., None]
  return jnp.maximum(positions_bt, 0)


class Qwen2Backbone(nnx.Module):
  """Embedding, decoder stack and final norm: token ids to hidden states.

  The decoder layers are one stacked module (weights [L, ...], logical axis
  "layers") run under `lax.scan`, so the program holds one layer body
  whatever the depth (`unscanned` makes them a list, for decoding). `remat` (a policy in REMAT_POLICIES, or a bool) applies
  to that body on uncached (training) passes; cached sampling passes take
  no gradients and skip it.
  """

  def __init__(self, config: Qwen2Config, *, dtype=jnp.float32, param_dtype=None,
               remat: bool | str = False, attention: str = "auto", rngs: nnx.Rngs):
    param_dtype = param_dtype or dtype
    self.config = config
    self.dtype = jnp.dtype(dtype)
    self.remat = remat_policy_name(remat)
    kw = dict(param_dtype=param_dtype, rngs=rngs)
    self.embed = _param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"),
                        param_dtype, config.initializer_range)
    self.layers = _stacked_layers(config, attention=attention, **kw)
    self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

  def __call__(self, input_ids_bt, *, positions=None, attention_mask=None, cache=None):
    """Returns hidden states [B, T, D] and the updated cache (or None)."""
    if attention_mask is None:
      attention_mask = jnp.ones(input_ids_bt.shape, jnp.bool_)
    attention_mask_bt = attention_mask.astype(jnp.bool_)
    positions_bt = (default_positions(attention_mask_bt, cache) if positions is None
                    else positions.astype(jnp.int32))
    new_kv_positions_bt = jnp.where(attention_mask_bt, positions_bt, -1)
    new_length_b = None
    if cache is None:
      kv_positions_bs = new_kv_positions_bt
    elif cache.per_row:
      # Slot = position; a row sees its first new_length slots, whatever was there before.
      new_length_b = cache.length + jnp.sum(attention_mask_bt, axis=1, dtype=jnp.int32)
      slots_1s = jnp.arange(cache.max_len, dtype=jnp.int32)[None]
      kv_positions_bs = jnp.where(slots_1s < new_length_b[:, None], slots_1s, -1)
    else:
      kv_positions_bs = jax.lax.dynamic_update_slice(
          cache.kv_positions_bs, new_kv_positions_bt, (0, cache.length))

    x_btd = constrain(self.embed[...][input_ids_bt].astype(self.dtype), _RESIDUAL_AXES)

    if cache is None:
      def body(layer_graph, x_btd, xs):
        layer = nnx.merge(layer_graph, xs[0])
        x_btd, _ = layer(x_btd, positions_bt, kv_positions_bs)
        return constrain(x_btd, _RESIDUAL_AXES), None

      x_btd = self._through_layers(body, x_btd, checkpointed=True)
      return self.final_norm(x_btd), None

    # The cache rides in the carry, so each layer's new keys and values are
    # written in place; the layer reads its own part back.
    def cached_body(layer_graph, carry, xs):
      x_btd, k, v = carry
      state, i = xs
      layer = nnx.merge(layer_graph, state)
      x_btd, layer_cache = layer(x_btd, positions_bt, kv_positions_bs,
                                 LayerCache.of(k, v, i, cache.length, new_length_b))
      return (constrain(x_btd, _RESIDUAL_AXES), *layer_cache.into(k, v, i)), None

    x_btd, k, v = self._through_layers(cached_body, (x_btd, cache.k, cache.v),
                                       checkpointed=False)
    written = (jnp.sum(attention_mask_bt, axis=1, dtype=jnp.int32) if cache.per_row
               else input_ids_bt.shape[1])
    new_cache = KVCache(k=k, v=v, kv_positions_bs=kv_positions_bs,
                        length=cache.length + written)
    return self.final_norm(x_btd), new_cache

  def _through_layers(self, body, carry, *, checkpointed: bool):
    """`carry` through every decoder layer: body(layer_graph, carry, (layer state, layer
    index)) -> (carry, None), under `lax.scan` for stacked layers or a Python loop over a
    layer list (`unscanned`); `checkpointed` applies the remat policy to each layer."""
    if isinstance(self.layers, nnx.List):
      for i, layer in enumerate(self.layers):
        layer_graph, state = nnx.split(layer)
        step = functools.partial(body, layer_graph)
        carry, _ = (_checkpointed(step, self.remat) if checkpointed else step)(carry, (state, i))
      return carry
    layer_graph, layer_state = nnx.split(self.layers)
    step = functools.partial(body, layer_graph)
    layer_index = jnp.arange(self.config.num_layers, dtype=jnp.int32)
    carry, _ = jax.lax.scan(_checkpointed(step, self.remat) if checkpointed else step, carry,
                            (layer_state, layer_index))
    return carry


class Qwen2(nnx.Module):
  """Qwen2ForCausalLM: `model(ids)` gives float32 logits [B, T, V].

  With `cache=` it returns `(logits, new_cache)`.
  """

  NOT_IN_CHECKPOINT = ()

  def __init__(self, config: Qwen2Config, *, dtype=jnp.float32, param_dtype=None,
               remat: bool | str = False, attention: str = "auto", rngs: nnx.Rngs):
    self.config = config
    self.backbone = Qwen2Backbone(config, dtype=dtype, param_dtype=param_dtype,
                                  remat=remat, attention=attention, rngs=rngs)
    if not config.tie_word_embeddings:
      self.lm_head = _param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"),
                            param_dtype or dtype, config.initializer_range)

  def unembedding(self) -> Array:
    weight = self.backbone.embed if self.config.tie_word_embeddings else self.lm_head
    return weight[...]

  def logits(self, hidden_btd) -> Array:
    """float32 logits of hidden states (fp32 accumulation also in bf16)."""
    logits_btv = jnp.einsum("btd,vd->btv", hidden_btd,
                            self.unembedding().astype(hidden_btd.dtype),
                            preferred_element_type=jnp.float32)
    return constrain(logits_btv, _LOGITS_AXES)

  def __call__(self, input_ids_bt, *, positions=None, attention_mask=None, cache=None):
    hidden_btd, new_cache = self.backbone(input_ids_bt, positions=positions,
                                          attention_mask=attention_mask, cache=cache)
    logits_btv = self.logits(hidden_btd)
    return logits_btv if cache is None else (logits_btv, new_cache)


class Qwen2Value(nnx.Module):
  """Critic: the Qwen2 backbone plus a scalar head; `model(ids)` gives values [B, T]."""

  NOT_IN_CHECKPOINT = (("value_head",), ("value_bias",))

  def __init__(self, config: Qwen2Config, *, dtype=jnp.float32, param_dtype=None,
               remat: bool | str = False, attention: str = "auto", rngs: nnx.Rngs):
    self.config = config
    self.backbone = Qwen2Backbone(config, dtype=dtype, param_dtype=param_dtype,
                                  remat=remat, attention=attention, rngs=rngs)
    # Zero-initialised so a fresh critic predicts 0 and early updates stay small.
    self.value_head = _param(rngs, (config.hidden_size,), ("embed",), jnp.float32, 0.0)
    self.value_bias = _param(rngs, (), (), jnp.float32, 0.0)

  def __call__(self, input_ids_bt, *, positions=None, attention_mask=None):
    hidden_btd, _ = self.backbone(input_ids_bt, positions=positions,
                                  attention_mask=attention_mask)
    values_bt = jnp.einsum("btd,d->bt", hidden_btd.astype(jnp.float32), self.value_head[...])
    return values_bt + self.value_bias[...]


def hf_tensor_mappings(config: Qwen2Config, *, lm_head: bool) -> list[checkpoint_io.TensorMapping]:
  """HF tensor names and layouts against our state paths.

  HF linear weights are [out, in]; ours are input-major with heads split out.
  """
  d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_size
  tm = checkpoint_io.TensorMapping

  def heads_in(heads):  # HF [heads * H, D] -> ours [D, heads, H]
    return dict(
        to_ours=lambda w: w.T.reshape(d, heads, h),
        to_hf=lambda w: w.reshape(d, heads * h).T)

  dense = dict(to_ours=lambda w: w.T, to_hf=lambda w: w.T)  # HF [out, in] -> ours [in, out]

  mappings = [tm("model.embed_tokens.weight", ("backbone", "embed")),
              tm("model.norm.weight", ("backbone", "final_norm", "scale"))]
  for i in range(config.num_layers):
    hf, ours = f"model.layers.{i}", ("backbone", "layers")
    layer = dict(layer=i)  # our layer weights are stacked: layer i of [L, ...]
    mappings += [
        tm(f"{hf}.input_layernorm.weight", ours + ("input_norm", "scale"), **layer),
        tm(f"{hf}.post_attention_layernorm.weight", ours + ("post_attn_norm", "scale"), **layer),
        tm(f"{hf}.mlp.gate_proj.weight", ours + ("mlp", "gate_proj"), **dense, **layer),
        tm(f"{hf}.mlp.up_proj.weight", ours + ("mlp", "up_proj"), **dense, **layer),
        tm(f"{hf}.mlp.down_proj.weight", ours + ("mlp", "down_proj"), **dense, **layer),
        tm(f"{hf}.self_attn.o_proj.weight", ours + ("attn", "o_proj"),
           to_ours=lambda w: w.T.reshape(n, h, d), to_hf=lambda w: w.reshape(n * h, d).T,
           **layer),
    ]
    for name, heads in (("q", n), ("k", k), ("v", k)):
      mappings += [
          tm(f"{hf}.self_attn.{name}_proj.weight", ours + ("attn", f"{name}_proj"),
             **heads_in(heads), **layer),
          tm(f"{hf}.self_attn.{name}_proj.bias", ours + ("attn", f"{name}_bias"),
             to_ours=lambda b, heads=heads: b.reshape(heads, h),
             to_hf=lambda b, heads=heads: b.reshape(heads * h), **layer),
      ]
  if lm_head:
    mappings.append(tm("lm_head.weight", ("lm_head",)))
  return mappings


def _ignorable(lm_head_in_model: bool):
  def ignorable(name: str) -> bool:
    # Old exports carry RoPE buffers; tied or critic models may carry an lm_head.
    return name.endswith("rotary_emb.inv_freq") or (
        name == "lm_head.weight" and not lm_head_in_model)
  return ignorable


def read_config(path) -> Qwen2Config:
  """The Qwen2Config of an HF checkpoint directory (its config.json)."""
  path = os.fspath(path)
  return Qwen2Config.from_hf_dict(checkpoint_io.read_hf_config(path),
                                  source=os.path.join(path, "config.json"))


def _load(model_cls, path, dtype, param_dtype, mesh, remat, attention):
  path = os.fspath(path)
  config = read_config(path)
  dtype = jnp.dtype(dtype)
  param_dtype = jnp.dtype(param_dtype or dtype)
  lm_head = model_cls is Qwen2 and not config.tie_word_embeddings
  return checkpoint_io.load(
      path,
      build_model=lambda: model_cls(config, dtype=dtype, param_dtype=param_dtype, remat=remat,
                                    attention=attention, rngs=nnx.Rngs(0)),
      mappings=hf_tensor_mappings(config, lm_head=lm_head),
      ignorable=_ignorable(lm_head),
      zero_init=model_cls.NOT_IN_CHECKPOINT,
      mesh=mesh)


def from_pretrained(path, dtype="float32", param_dtype=None, mesh=None,
                    remat: bool | str = False, attention: str = "auto") -> Qwen2:
  """Loads an HF Qwen2 checkpoint directory (config.json + safetensors).

  `dtype` is the compute dtype, `param_dtype` the storage dtype (default:
  `dtype`). With a `mesh`, each tensor goes straight into its sharding.
  """
  return _load(Qwen2, path, dtype, param_dtype, mesh, remat, attention)


def value_model_from_pretrained(path, dtype="float32", param_dtype=None, mesh=None,
                                remat: bool | str = False,
                                attention: str = "auto") -> Qwen2Value:
  """A critic whose backbone starts from a policy checkpoint; the head starts at 0."""
  return _load(Qwen2Value, path, dtype, param_dtype, mesh, remat, attention)


def save_pretrained(model: Qwen2, out_dir, dtype: str | None = None,
                    max_shard_bytes: int = 5 * 2**30) -> None:
  """Writes `model` in HF layout (config.json + safetensors) that `transformers` loads.

  `dtype` converts on the way out (default: the stored parameter dtype).
  """
  if not isinstance(model, Qwen2):
    raise TypeError(f"save_pretrained writes Qwen2 causal LMs, got {type(model).__name__}")
  config = model.config
  stored = jnp.dtype(model.backbone.embed.get_value().dtype if dtype is None else dtype)
  checkpoint_io.save(
      model, os.fspath(out_dir),
      mappings=hf_tensor_mappings(config, lm_head=not config.tie_word_embeddings),
      hf_config=config.to_hf_dict(torch_dtype=stored.name),
      dtype=dtype, max_shard_bytes=max_shard_bytes)


def init_random(config: Qwen2Config, seed: int = 0, dtype="float32", param_dtype=None,
                remat: bool | str = False, attention: str = "auto") -> Qwen2:
  return Qwen2(config, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(param_dtype or dtype),
               remat=remat, attention=attention, rngs=nnx.Rngs(seed))
