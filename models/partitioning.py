"""Logical axis names to mesh axes.

Every weight declares logical axes (`nnx.Param(..., logical_axes=(...))`);
a rule table maps each logical name to zero or more mesh axes. Resolution is
shape-aware: a mesh axis is dropped from a dimension it does not divide (for
example 2 kv heads on a tensor axis of 4 stay replicated), and no mesh axis is
used twice in one spec.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Mapping[str, Sequence[str] | str | None]

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    # activations and caches
    "batch": ("data", "fsdp"),
    "seq": (),
    "cache_seq": (),
    # weights ("layers": the stacked decoder-layer axis, scanned over, never split)
    "layers": (),
    "vocab": ("tensor",),
    "embed": ("fsdp",),
    "mlp": ("tensor",),
    "q_heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "norm": (),
}


def decode_rules(rules: Rules | None = None) -> dict:
  """Rules for sampling weights: split over tensor only, whole on every data/fsdp shard,
  so a decode step gathers no weights."""
  rules = dict(DEFAULT_RULES if rules is None else rules)
  batch_axes = set(_as_tuple(rules.get("batch")))
  return {name: tuple(a for a in _as_tuple(axes) if a not in batch_axes and a != "fsdp")
          if name not in ("batch", "seq", "cache_seq") else axes
          for name, axes in rules.items()}


def _as_tuple(axes) -> tuple[str, ...]:
  if axes is None:
    return ()
  if isinstance(axes, str):
    return (axes,)
  return tuple(axes)


def logical_to_spec(logical_axes: Iterable[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Rules | None = None) -> PartitionSpec:
  """PartitionSpec for an array of `shape` whose dimensions carry `logical_axes`."""
  rules = DEFAULT_RULES if rules is None else rules
  logical_axes = tuple(logical_axes)
  if len(logical_axes) != len(shape):
    raise ValueError(f"logical axes {logical_axes} do not match shape {tuple(shape)}")
  used: set[str] = set()
  spec = []
  for name, size in zip(logical_axes, shape):
    if name is not None and name not in rules:
      raise KeyError(f"no sharding rule for logical axis {name!r}; rules cover {sorted(rules)}")
    chosen = []
    for axis in _as_tuple(None if name is None else rules[name]):
      if axis not in mesh.shape or axis in used or mesh.shape[axis] == 1:
        continue
      if size % (int(np.prod([mesh.shape[a] for a in chosen])) * mesh.shape[axis]):
        continue
      chosen.append(axis)
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return PartitionSpec(*spec)


def mesh_axes(logical_name: str, mesh: Mesh, rules: Rules | None = None) -> tuple[str, ...]:
  """The mesh axes (of size > 1) that a logical axis maps to, ignoring divisibility."""
  rules = DEFAULT_RULES if rules is None else rules
  return tuple(a for a in _as_tuple(rules.get(logical_name)) if mesh.shape.get(a, 1) > 1)


def named_sharding(logical_axes, shape, mesh: Mesh, rules: Rules | None = None) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def batch_sharding(shape, mesh: Mesh, rules: Rules | None = None) -> NamedSharding:
  """Shards the leading (batch) axis over the data axes, replicates the rest."""
  return named_sharding(("batch",) + (None,) * (len(shape) - 1), shape, mesh, rules)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules | None = None):
  """`state` with each variable's value replaced by its NamedSharding."""

  def leaf_sharding(variable: nnx.Variable):
    axes = variable.get_metadata().get("logical_axes")
    shape = variable.get_value().shape
    if axes is None:  # not annotated: replicate
      return variable.replace(NamedSharding(mesh, PartitionSpec()))
    return variable.replace(named_sharding(axes, shape, mesh, rules))

  return jax.tree.map(leaf_sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer_state_shardings(tx, params, mesh: Mesh | None):
  """Shardings for `tx.init(params)`: moment trees like `params`, anything else replicated.

  None without a mesh. (Left to itself, `jax.jit(tx.init)` puts the whole
  state, which does not depend on the parameter values, on one device.)
  """
  if mesh is None:
    return None
  params_def = jax.tree.structure(params)
  params_shardings = jax.tree.map(lambda x: x.sharding, params)
  replicated = NamedSharding(mesh, PartitionSpec())
  like_params = lambda node: jax.tree.structure(node) == params_def
  return jax.tree.map(lambda node: params_shardings if like_params(node) else replicated,
                      jax.eval_shape(tx.init, params), is_leaf=like_params)


def to_host(array) -> np.ndarray:
  """The whole value of a (possibly multi-host) array as numpy on every host."""
  if isinstance(array, jax.Array) and not (array.is_fully_addressable or
                                           array.is_fully_replicated):
    from jax.experimental import multihost_utils
    array = multihost_utils.process_allgather(array, tiled=True)
  return np.asarray(jax.device_get(array))


def put_host_value(value, sharding: NamedSharding) -> jax.Array:
  """Places a host value that every process holds identically (e.g. a collated batch).

  Each process fills only its own devices' shards; unlike `jax.device_put`,
  no all-gather checks that the processes agree.
  """
  if jax.process_count() == 1:
    return jax.device_put(value, sharding)
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def mesh_context(mesh: Mesh | None):
  """Context under which `constrain` applies: trace and run jitted code inside it."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def constrain(x, logical_axes, rules: Rules | None = None):
  """Pins an activation's sharding by logical axes when traced under `mesh_context`.

  Without a mesh it is the identity, so model code calls it unconditionally.
  Weights and activations share mesh axes (embed and batch both use fsdp);
  without these pins the partitioner may gather the batch instead of the
  weights, replicating vocabulary-sized activations on every device.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh, rules))
