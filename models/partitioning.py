"""Placement on the mesh: meshes, logical axis names to mesh axes, and every device_put.

A mesh config names axes and sizes, e.g. `{"data": 1, "fsdp": -1, "tensor": 2}`;
one size may be -1 for "all remaining devices" (`make_mesh`).

Every weight declares logical axes (`nnx.Param(..., logical_axes=(...))`);
`SHARDING_RULES` maps each logical name to zero or more mesh axes, for
weights, batches, KV caches and the activation pins (`constrain`) alike.
Resolution is shape-aware: a mesh axis is dropped from a dimension it does
not divide (for example 2 kv heads on a tensor axis of 4 stay replicated),
and no mesh axis is used twice in one spec. Weights (`place_state`,
`place_checkpoint_tensor`), training batches (`place_batch`) and sampler
arrays and caches (`place`) go onto the devices here and nowhere else.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DEFAULT_MESH_AXES = {"data": 1, "fsdp": -1, "tensor": 1}

SHARDING_RULES: dict[str, tuple[str, ...]] = {
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


def _as_tuple(axes) -> tuple[str, ...]:
  if axes is None:
    return ()
  if isinstance(axes, str):
    return (axes,)
  return tuple(axes)


# Sampling weights: split over tensor only, whole on every data/fsdp shard, so a
# decode step gathers no weights. Activations and caches keep the training rules.
DECODE_SHARDING_RULES: dict[str, tuple[str, ...]] = {
    name: axes if name in ("batch", "seq", "cache_seq")
    else tuple(a for a in axes if a not in SHARDING_RULES["batch"] and a != "fsdp")
    for name, axes in SHARDING_RULES.items()}
# Layouts of the sampler's own copy of the weights (`Sampler(sampling_layout=...)`): "train"
# shards it like the training weights (a decode step gathers the fsdp shards, at the copy's
# dtype); "decode" holds it whole on every data/fsdp shard (no gather per token, but the
# whole model in every fsdp shard's memory); "tensor" splits it by heads over a sampler mesh
# of tensor parallelism up to the kv heads, data-parallel beyond
# (`models/slice_meshes.py:sampler_axes`, which gives each layout its mesh).
SAMPLING_LAYOUTS = {"train": SHARDING_RULES, "decode": DECODE_SHARDING_RULES,
                    "tensor": DECODE_SHARDING_RULES}


def logical_to_spec(logical_axes: Iterable[str | None], shape: Sequence[int],
                    mesh: Mesh, rules=SHARDING_RULES) -> PartitionSpec:
  """PartitionSpec for an array of `shape` whose dimensions carry `logical_axes`."""
  logical_axes = tuple(logical_axes)
  if len(logical_axes) != len(shape):
    raise ValueError(f"logical axes {logical_axes} do not match shape {tuple(shape)}")
  used: set[str] = set()
  spec = []
  for name, size in zip(logical_axes, shape):
    if name is not None and name not in rules:
      raise KeyError(f"no sharding rule for logical axis {name!r}; rules cover "
                     f"{sorted(rules)}")
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


def mesh_axes(logical_name: str, mesh: Mesh) -> tuple[str, ...]:
  """The mesh axes (of size > 1) that a logical axis maps to, ignoring divisibility."""
  return tuple(a for a in _as_tuple(SHARDING_RULES.get(logical_name)) if mesh.shape.get(a, 1) > 1)


def named_sharding(logical_axes, shape, mesh: Mesh, rules=SHARDING_RULES) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def batch_sharding(shape, mesh: Mesh) -> NamedSharding:
  """Shards the leading (batch) axis over the data axes, replicates the rest."""
  return named_sharding(("batch",) + (None,) * (len(shape) - 1), shape, mesh)


def abstract_rows(mesh: Mesh, shape, dtype) -> jax.ShapeDtypeStruct:
  """An abstract array sharded over its leading (batch) axis, for a program's arguments."""
  return jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(shape, mesh))


def state_shardings(state: nnx.State, mesh: Mesh, rules=SHARDING_RULES):
  """`state` with each variable's value replaced by its NamedSharding under `rules`."""

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


def _as_jit_writes_it(sharding: NamedSharding) -> NamedSharding:
  """The same placement without trailing None axes, as jit returns updated state.

  P("fsdp", None) and P("fsdp") place alike but are different jit cache keys;
  written the same way, the second update reuses the first one's trace.
  """
  spec = tuple(sharding.spec)
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def place_state(state: nnx.State, mesh: Mesh | None) -> nnx.State:
  """Training weights on `mesh` by their logical axes, as a jitted update writes them back.

  Unchanged without a mesh.
  """
  if mesh is None:
    return state
  return jax.device_put(state, jax.tree.map(_as_jit_writes_it, state_shardings(state, mesh)))


def place_batch(batch, mesh: Mesh | None):
  """Every array of a host batch (any pytree) on the device, sharded over its leading axis."""
  if mesh is None:
    return jax.tree.map(jnp.asarray, batch)
  return jax.tree.map(lambda x: put_host_value(x, batch_sharding(np.shape(x), mesh)), batch)


def place(value, logical_axes, mesh: Mesh | None) -> jax.Array:
  """One host or device array on `mesh` by its logical axes (() replicates a scalar); a host
  value on a mesh of several processes is one that each of them holds alike."""
  if mesh is None:
    return jnp.asarray(value)
  sharding = named_sharding(logical_axes, np.shape(value), mesh)
  if isinstance(value, jax.Array):
    return jax.device_put(value, sharding)
  return put_host_value(value, sharding)


def place_checkpoint_tensor(logical_axes, shape, dtype,
                            parts: Sequence[Callable[[], np.ndarray]], stacked: bool,
                            mesh: Mesh | None) -> jax.Array:
  """A weight read from host `parts` (one per layer when `stacked`) straight into its sharding.

  With a mesh, stacked layers are read one at a time into host buffers of
  the shards this process's devices hold.
  """
  if mesh is None:
    return jax.device_put(np.stack([read() for read in parts]) if stacked else parts[0]())
  sharding = named_sharding(logical_axes, shape, mesh)
  if not stacked:
    host = parts[0]()
    return jax.make_array_from_callback(shape, sharding, lambda idx: host[idx])
  # Host buffers for the distinct shards this process holds, filled layer by layer.
  index_map = sharding.addressable_devices_indices_map(shape)
  key = lambda idx: tuple(s.indices(n) for s, n in zip(idx, shape))
  buffers = {}
  for idx in index_map.values():
    if key(idx) not in buffers:
      buffers[key(idx)] = (idx, np.empty([len(range(*k)) for k in key(idx)], dtype))
  for layer, read in enumerate(parts):
    host = read()
    for idx, buffer in buffers.values():
      first, stop, _ = idx[0].indices(shape[0])
      if first <= layer < stop:
        buffer[layer - first] = host[idx[1:]]
  arrays = [jax.device_put(buffers[key(idx)][1], device) for device, idx in index_map.items()]
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


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
  if sharding.is_fully_addressable:
    return jax.device_put(value, sharding)
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def mesh_context(mesh: Mesh | None):
  """Context under which `constrain` applies: trace and run jitted code inside it."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def constrain_state(state: nnx.State) -> nnx.State:
  """Pins every variable of `state` (e.g. gradients) to its weights' placement, by its logical
  axes, when traced under `mesh_context`; the identity without a mesh. Left unpinned, the
  gradients a jitted program returns came out whole on every device (7B: 28 GiB each)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return state

  def pin(variable: nnx.Variable):
    axes = variable.get_metadata().get("logical_axes")
    value = variable.get_value()
    spec = PartitionSpec() if axes is None else logical_to_spec(axes, value.shape, mesh)
    return variable.replace(jax.lax.with_sharding_constraint(value, spec))

  return jax.tree.map(pin, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def target_platform() -> str:
  """The platform the code being traced will run on: that of the mesh set by `mesh_context`
  (a TPU slice's devices when compiling ahead of time on a CPU host), else the default
  backend's."""
  device = jax.sharding.get_abstract_mesh().abstract_device
  return jax.default_backend() if device is None else device.platform


def constrain(x, logical_axes):
  """Pins an activation's sharding by logical axes when traced under `mesh_context`.

  Without a mesh it is the identity, so model code calls it unconditionally.
  Weights and activations share mesh axes (embed and batch both use fsdp);
  without these pins the partitioner may gather the batch instead of the
  weights, replicating vocabulary-sized activations on every device.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))


def resolve_mesh_shape(axes: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Fills the one -1 axis so the sizes multiply to `num_devices`."""
  sizes = dict(axes)
  unknown = [name for name, size in sizes.items() if size == -1]
  if len(unknown) > 1:
    raise ValueError(f"mesh {sizes}: at most one axis may be -1, got {unknown}")
  known = math.prod(size for size in sizes.values() if size != -1)
  if any(size == 0 or size < -1 for size in sizes.values()):
    raise ValueError(f"mesh {sizes}: sizes must be positive or -1")
  if unknown:
    if num_devices % known:
      raise ValueError(f"mesh {sizes}: {num_devices} devices do not divide by {known}")
    sizes[unknown[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(f"mesh {sizes} needs {math.prod(sizes.values())} devices, "
                     f"{num_devices} are available")
  return sizes


def parse_mesh(spec: str) -> dict[str, int] | None:
  """A mesh from the command line: `data=1,fsdp=-1,tensor=2`; None for an empty spec."""
  if not spec:
    return None
  axes = {}
  for part in spec.split(","):
    name, _, size = part.partition("=")
    if not name or not size.lstrip("-").isdigit():
      raise ValueError(f"--mesh: cannot read {part!r}; expected name=size, e.g. fsdp=-1")
    axes[name.strip()] = int(size)
  return axes


def per_group_axes(axes: Mapping[str, int], groups: int) -> dict[str, int]:
  """The axes of one group's own mesh (a host's, or a sampler group's) for a run whose mesh
  `axes` span `groups` such groups: a -1 axis takes the group's remaining devices; else the
  batch axes (data first, then fsdp) give up the factor `groups`, as each group samples its
  own share of the batch."""
  axes = dict(axes)
  if groups == 1 or -1 in axes.values():
    return axes
  left = groups
  for name in SHARDING_RULES["batch"]:
    factor = math.gcd(axes.get(name, 1), left)
    if factor > 1:
      axes[name] //= factor
      left //= factor
  if left != 1:
    raise ValueError(f"mesh {axes}: its batch axes (data x fsdp) do not split over {groups} "
                     "groups of hosts; give one axis as -1")
  return axes


def make_mesh(axes: Mapping[str, int] | None = None, devices=None) -> Mesh:
  """A mesh over `devices` (default: all). Without a -1 axis the mesh may use
  fewer devices than there are: the first prod(sizes) of them."""
  devices = jax.devices() if devices is None else list(devices)
  axes = dict(axes or DEFAULT_MESH_AXES)
  if -1 not in axes.values() and math.prod(axes.values()) < len(devices):
    devices = devices[:math.prod(axes.values())]
  sizes = resolve_mesh_shape(axes, len(devices))
  # Auto axes: shardings propagate through the model as in pjit.
  axis_types = (AxisType.Auto,) * len(sizes)
  try:
    return jax.make_mesh(tuple(sizes.values()), tuple(sizes), devices=devices,
                         axis_types=axis_types)
  except NotImplementedError:
    # An axis that is no product of the chip grid's sides (fsdp=8 on a 4x4 v6e-16): split a
    # physical axis rather than refuse the mesh.
    from jax.experimental import mesh_utils
    grid = mesh_utils.create_device_mesh(tuple(sizes.values()), devices,
                                         allow_split_physical_axes=True)
    return Mesh(grid, tuple(sizes), axis_types=axis_types)
