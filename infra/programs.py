"""A jitted program with the abstract arguments of one call: what the planner compiles.

The code that runs a program (the sampler, a learner) also lists it as a
`Program`, with `jax.ShapeDtypeStruct` arguments that carry their shardings,
so `rlver_jax/plan/` compiles exactly what a run compiles, for any devices
(fake CPU devices, or a TPU slice without a TPU), with no memory behind it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, ClassVar

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

GIB = 2 ** 30


# What one call of a program computes, with the sizes the analytic cost model
# (`rlver_jax/costs.py`, one cost function registered per type) needs. `kind` names the type
# in the planner's report. `model` is the model whose weights it runs: policy, critic (a
# value head instead of the LM head) or reference.


@dataclasses.dataclass(frozen=True)
class Forward:
  """An uncached forward pass over [rows, tokens] (a log-prob or value pass)."""
  kind: ClassVar[str] = "forward"
  rows: int
  tokens: int
  model: str


@dataclasses.dataclass(frozen=True)
class Update:
  """A micro-batch's forward and backward pass over [rows, tokens]; with `apply`, the
  optimizer's update too (else the gradients alone, for gradient accumulation)."""
  kind: ClassVar[str] = "update"
  rows: int
  tokens: int
  model: str
  apply: bool = True


@dataclasses.dataclass(frozen=True)
class AccumulateGradients:
  """One micro-batch's gradients added to the running sum."""
  kind: ClassVar[str] = "accumulate"
  model: str


@dataclasses.dataclass(frozen=True)
class ApplyGradients:
  """The optimizer's update of every weight from accumulated gradients."""
  kind: ClassVar[str] = "apply"
  model: str


@dataclasses.dataclass(frozen=True)
class CopyWeights:
  """The sampler's weight refresh: `copy_bytes` of the sampler's copy land on each chip."""
  kind: ClassVar[str] = "copy_weights"
  copy_bytes: float


@dataclasses.dataclass(frozen=True)
class EmptyRows:
  """Zeroing a rollout's per-row cache and logits once."""
  kind: ClassVar[str] = "empty_rows"


@dataclasses.dataclass(frozen=True)
class GroupBroadcast:
  """A sampler group leader's announcement to its hosts (a few hundred words)."""
  kind: ClassVar[str] = "group_broadcast"


@dataclasses.dataclass(frozen=True)
class RowPass:
  """A pass of `rows` rows, `tokens` tokens each, over a cache of `capacity` slots per row of
  which `slots` are attended."""
  rows: int
  tokens: int
  slots: int
  capacity: int


@dataclasses.dataclass(frozen=True)
class PrefillRows(RowPass):
  """A prefill chunk: `tokens` new tokens per row in one pass."""
  kind: ClassVar[str] = "prefill_rows"


@dataclasses.dataclass(frozen=True)
class DecodeRows(RowPass):
  """A decode loop of `tokens` steps, one token per row each."""
  kind: ClassVar[str] = "decode_rows"


Work = (Forward | Update | AccumulateGradients | ApplyGradients | CopyWeights | EmptyRows |
        GroupBroadcast | PrefillRows | DecodeRows)


def work_as_dict(work: Work) -> dict:
  """`work` for the planner's JSON report: {"kind": ..., and its sizes}."""
  return {"kind": work.kind, **dataclasses.asdict(work)}


@dataclasses.dataclass(frozen=True)
class Program:
  """One call of a jitted program: `fn(*args, **static)` on the mesh `mesh`.

  `resident` is the part of `args` that stays in memory between steps
  (weights, optimizer states, the sampler's copy), counted once by the
  planner; `calls` is how many times one training step runs it (for time
  estimates); `work` is what the call computes, for the analytic cost model.
  """
  fn: Callable
  args: tuple
  mesh: Mesh
  static: dict = dataclasses.field(default_factory=dict)
  resident: Any = ()
  calls: float = 1.0
  work: Work = dataclasses.field(kw_only=True)


def abstract(tree, shardings):
  """Abstract arrays of `tree`'s shapes and dtypes, placed by `shardings` (a like tree)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def replicated(mesh: Mesh, shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def device_gib(tree) -> float:
  """Per-device GiB of a pytree of sharded abstract arrays."""
  total = 0
  for x in jax.tree.leaves(tree):
    total += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize  # keys too
  return total / GIB
