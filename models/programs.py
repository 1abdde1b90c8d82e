"""A jitted program with the abstract arguments of one call: what the planner compiles.

The code that runs a program (the sampler, a learner) also lists it as a
`Program`, with `jax.ShapeDtypeStruct` arguments that carry their shardings,
so `rlver_jax/plan.py` compiles exactly what a run compiles, for any devices
(fake CPU devices, or a TPU slice without a TPU), with no memory behind it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import partitioning

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Program:
  """One call of a jitted program: `fn(*args, **static)` on the mesh `mesh`.

  `resident` is the part of `args` that stays in memory between steps
  (weights, optimizer states, the sampler's copy), counted once by the
  planner; `calls` is how many times one training step runs it (for time
  estimates); `work` names what the call computes, for the analytic cost
  model (`rlver_jax/costs.py`): {"kind": ..., and the kind's sizes}.
  """
  fn: Callable
  args: tuple
  mesh: Mesh
  static: dict = dataclasses.field(default_factory=dict)
  resident: Any = ()
  calls: float = 1.0
  work: dict = dataclasses.field(default_factory=dict)


def abstract(tree, shardings):
  """Abstract arrays of `tree`'s shapes and dtypes, placed by `shardings` (a like tree)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def rows(mesh: Mesh, shape, dtype) -> jax.ShapeDtypeStruct:
  """An abstract array sharded over its leading (batch) axis."""
  return jax.ShapeDtypeStruct(shape, dtype, sharding=partitioning.batch_sharding(shape, mesh))


def replicated(mesh: Mesh, shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def device_gib(tree) -> float:
  """Per-device GiB of a pytree of sharded abstract arrays."""
  total = 0
  for x in jax.tree.leaves(tree):
    total += math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize  # keys too
  return total / GIB
