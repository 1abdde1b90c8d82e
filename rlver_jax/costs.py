"""An analytic cost model of each program of a step: FLOPs, HBM bytes and ICI bytes per chip.

Why analytic: XLA's cost analysis of a compiled program counts a loop body
once (a scanned 28-layer update reports about one layer's FLOPs, and the
sampler's decode loop one token's), and a Pallas kernel (splash) not at all.
The FLOP counts here are checked against XLA's on programs without loops
(`tests/rlver_jax/test_costs.py`); bytes are estimates of the dominant traffic.

Every figure is per chip for one call of a program (`infra.programs.Program`,
whose `work` says what it computes; `COST_FNS` holds one cost function per work
type). Time is a roofline: the largest of FLOPs / peak, HBM bytes / HBM
bandwidth and ICI bytes / ICI bandwidth, as if the three overlapped perfectly;
real programs are slower. These are cost-model estimates from the compiler's
shapes, not measurements.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from infra import programs
from infra.registry import Registry
from infra.topology import Generation
from models import qwen2

# Activation traffic of one layer, bytes per token per model-width element (read + write
# of the residual stream, norms, projections' inputs and outputs): a rough constant.
ACTIVATION_BYTES_PER_TOKEN_WIDTH = 24


@dataclasses.dataclass(frozen=True)
class Cost:
  """Per chip, one call."""
  flops: float = 0.0
  hbm_bytes: float = 0.0
  ici_bytes: float = 0.0

  def __add__(self, other: "Cost") -> "Cost":
    return Cost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes,
                self.ici_bytes + other.ici_bytes)

  def scaled(self, factor: float) -> "Cost":
    return Cost(self.flops * factor, self.hbm_bytes * factor, self.ici_bytes * factor)

  def seconds(self, chip: Generation) -> float:
    """Roofline time on one chip of `chip`'s generation."""
    return max(self.flops / (chip.peak_tflops * 1e12), self.hbm_bytes / (chip.hbm_gbps * 1e9),
               self.ici_bytes / (chip.ici_gbps * 1e9))

  def bound(self, chip: Generation) -> str:
    """Which roofline term sets `seconds`: compute, hbm or ici."""
    terms = {"compute": self.flops / (chip.peak_tflops * 1e12),
             "hbm": self.hbm_bytes / (chip.hbm_gbps * 1e9),
             "ici": self.ici_bytes / (chip.ici_gbps * 1e9)}
    return max(terms, key=terms.get)


def matmul_params(config: qwen2.Qwen2Config, value_model: bool = False) -> int:
  """Weights that take part in a matmul per token: the decoder layers and the output head
  (the LM head, or the value head); the embedding is a lookup."""
  d, h = config.hidden_size, config.head_size
  layer = (d * config.num_heads * h * 2 + d * config.num_kv_heads * h * 2 +
           3 * d * config.intermediate_size)
  head = d if value_model else config.vocab_size * d
  return config.num_layers * layer + head


def attention_flops(config: qwen2.Qwen2Config, queries: float, keys: float) -> float:
  """Scores and the weighted sum over `keys` keys for `queries` query tokens, all layers."""
  return 4.0 * config.num_layers * config.num_heads * config.head_size * queries * keys


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one program's mesh splits the work: rows over `data` x `fsdp`, weights over `fsdp`
  and `tensor` (FSDP weights are all-gathered where used) or over `tensor` only."""
  data: int
  fsdp: int
  tensor: int
  weights_fsdp_sharded: bool = True

  @property
  def chips(self) -> int:
    return self.data * self.fsdp * self.tensor

  @property
  def row_shards(self) -> int:
    return self.data * self.fsdp


def _gather_bytes(weight_bytes: float, layout: Layout) -> float:
  """Bytes one chip receives to all-gather FSDP-sharded weights of `weight_bytes` in all."""
  if not layout.weights_fsdp_sharded or layout.fsdp == 1:
    return 0.0
  return weight_bytes / layout.tensor * (layout.fsdp - 1) / layout.fsdp


def forward_cost(config, layout: Layout, rows: int, tokens: int, compute_bytes: int,
                 value_model: bool = False, causal_half: bool = True) -> Cost:
  """One forward pass over [rows, tokens], uncached (a value or reference pass)."""
  params = matmul_params(config, value_model)
  all_tokens = rows * tokens
  keys = tokens / 2 if causal_half else tokens
  flops = 2.0 * params * all_tokens + attention_flops(config, all_tokens, keys)
  weights = params * compute_bytes
  activations = (ACTIVATION_BYTES_PER_TOKEN_WIDTH * config.num_layers * config.hidden_size *
                 all_tokens / layout.row_shards / layout.tensor)
  return Cost(flops / layout.chips, weights / layout.tensor + activations,
              _gather_bytes(weights, layout))


def update_cost(config, layout: Layout, rows: int, tokens: int, compute_bytes: int,
                param_bytes: int, remat: str, value_model: bool = False,
                apply: bool = True, causal_half: bool = True) -> Cost:
  """A micro-batch's forward and backward pass (3 forward passes' FLOPs, a 4th recomputed
  under full remat) and, with `apply`, the optimizer's update of every weight."""
  forward = forward_cost(config, layout, rows, tokens, compute_bytes, value_model, causal_half)
  passes = 4 if remat == "full" else 3
  cost = Cost(forward.flops * 3 + (forward.flops if passes == 4 else 0.0),
              forward.hbm_bytes * passes, forward.ici_bytes * (passes - 1))
  params = matmul_params(config, value_model)
  # Gradients leave the step reduce-scattered over fsdp (and summed over data).
  grads = params * param_bytes / layout.tensor
  cost += Cost(0.0, grads / layout.fsdp, grads * ((layout.fsdp - 1) / layout.fsdp +
                                                   2 * (layout.data - 1) / layout.data))
  return cost + (apply_cost(config, layout, param_bytes, value_model) if apply else Cost())


def apply_cost(config, layout: Layout, param_bytes: int, value_model: bool = False) -> Cost:
  """AdamW on every weight shard: read params, grads, two moments; write params, moments."""
  shard = matmul_params(config, value_model) * param_bytes / (layout.fsdp * layout.tensor)
  return Cost(12.0 * shard / param_bytes, 7.0 * shard, 0.0)


def accumulate_cost(config, layout: Layout, param_bytes: int, value_model: bool = False) -> Cost:
  shard = matmul_params(config, value_model) * param_bytes / (layout.fsdp * layout.tensor)
  return Cost(shard / param_bytes, 3.0 * shard, 0.0)


def cached_pass_cost(config, layout: Layout, rows: int, tokens: int, slots: int,
                     weight_bytes_per_param: int, cache_bytes: int) -> Cost:
  """`tokens` new tokens for each of `rows` rows over a cache of which `slots` are attended
  (the sampler's row prefill, or one decode step with tokens = 1); the logits of each row's
  last token."""
  params = matmul_params(config)
  head = config.vocab_size * config.hidden_size  # applied to each row's last token only
  flops = (2.0 * (params - head) * rows * tokens + 2.0 * head * rows +
           attention_flops(config, rows * tokens, slots))
  weights = params * weight_bytes_per_param
  kv_per_row = (2 * config.num_layers * config.num_kv_heads * config.head_size * cache_bytes)
  kv = kv_per_row * (slots + tokens) * rows / layout.row_shards / layout.tensor
  return Cost(flops / layout.chips, weights / layout.tensor + kv,
              _gather_bytes(weights, layout))


def copy_cost(config, layout: Layout, copy_bytes: float, from_bytes: int) -> Cost:
  """The sampler's weight refresh (`models/weight_copy.py`) over the training `layout`: each
  chip reads its shards of the training weights and casts them, then receives its share of
  the copy (`copy_bytes` a chip) from the chips that held it."""
  read = matmul_params(config) * from_bytes / layout.chips
  return Cost(0.0, read + copy_bytes, copy_bytes)


@dataclasses.dataclass(frozen=True)
class CostArgs:
  """What every cost function may read beside its work: the bytes per element of the
  compute dtype, the parameters, the sampler's weights and its cache, the remat policy, and
  whether the uncached passes' attention skips the masked half (splash, blockwise) or
  computes every score (einsum)."""
  compute_bytes: int
  param_bytes: int
  sampling_bytes: int
  cache_bytes: int
  remat: str
  causal_half: bool = True


# A work type's cost function: (its work, the model config, the layout, CostArgs) -> Cost.
CostFn = Callable[[programs.Work, qwen2.Qwen2Config, Layout, CostArgs], Cost]
COST_FNS: Registry[CostFn] = Registry("program work type")


def _value_model(work) -> bool:
  return work.model == "critic"


@COST_FNS.register(programs.Forward)
def _forward(work: programs.Forward, config, layout: Layout, args: CostArgs) -> Cost:
  return forward_cost(config, layout, work.rows, work.tokens, args.compute_bytes,
                      _value_model(work), args.causal_half)


@COST_FNS.register(programs.Update)
def _update(work: programs.Update, config, layout: Layout, args: CostArgs) -> Cost:
  return update_cost(config, layout, work.rows, work.tokens, args.compute_bytes,
                     args.param_bytes, args.remat, _value_model(work), apply=work.apply,
                     causal_half=args.causal_half)


@COST_FNS.register(programs.ApplyGradients)
def _apply(work: programs.ApplyGradients, config, layout: Layout, args: CostArgs) -> Cost:
  return apply_cost(config, layout, args.param_bytes, _value_model(work))


@COST_FNS.register(programs.AccumulateGradients)
def _accumulate(work: programs.AccumulateGradients, config, layout: Layout,
                args: CostArgs) -> Cost:
  return accumulate_cost(config, layout, args.param_bytes, _value_model(work))


@COST_FNS.register(programs.CopyWeights)
def _copy(work: programs.CopyWeights, config, layout: Layout, args: CostArgs) -> Cost:
  return copy_cost(config, layout, work.copy_bytes, args.param_bytes)


@COST_FNS.register(programs.EmptyRows)
@COST_FNS.register(programs.GroupBroadcast)
def _not_estimated(work, config, layout: Layout, args: CostArgs) -> Cost:
  """Zeroing a rollout's cache once, and a leader's announcement of a few hundred words:
  microseconds next to the row programs they come with."""
  del work, config, layout, args
  return Cost()


@COST_FNS.register(programs.PrefillRows)
def _prefill_rows(work: programs.PrefillRows, config, layout: Layout, args: CostArgs) -> Cost:
  return cached_pass_cost(config, layout, work.rows, work.tokens, work.slots,
                          args.sampling_bytes, args.cache_bytes)


@COST_FNS.register(programs.DecodeRows)
def _decode_rows(work: programs.DecodeRows, config, layout: Layout, args: CostArgs) -> Cost:
  step = cached_pass_cost(config, layout, work.rows, 1, work.slots, args.sampling_bytes,
                          args.cache_bytes)
  return step.scaled(work.tokens)


def program_cost(work: programs.Work, config, layout: Layout, args: CostArgs) -> Cost:
  """The cost of one call of a program from its `work`, by its type's cost function."""
  return COST_FNS.lookup(type(work))(work, config, layout, args)


def model_flops_per_token(config, value_model: bool = False) -> float:
  """Training FLOPs per token without recomputation (6 x matmul weights), for MFU."""
  return 6.0 * matmul_params(config, value_model)


def cost_as_dict(cost: Cost, chip: Generation | None) -> dict:
  out = {"flops": float(np.float64(cost.flops)), "hbm_bytes": float(cost.hbm_bytes),
         "ici_bytes": float(cost.ici_bytes)}
  if chip is not None:
    out.update(estimated_s=cost.seconds(chip), bound=cost.bound(chip))
  return out
