"""A run's meshes from one order of its devices: the training mesh and the sampler groups'.

Training spans every device of the slice; sampling runs on groups of `hosts_per_group`
hosts, each group on a mesh of its own hosts' chips (`SliceMeshes.sampler_mesh`), so
hosts of different groups never wait for each other during a rollout. The weights move
from the training mesh onto every group's mesh in one jitted program
(`models/weight_copy.py`), and `jax.jit` takes arguments and outputs only where their
meshes order the same devices alike: on a TPU slice `jax.make_mesh` orders chips by
the physical grid (v5p-16: ids 0, 4, 2, 6, 1, 5, 3, 7), where stacking per-host meshes
orders them host by host, and jit refuses the pair. So every mesh here is a reshape of
one flat device order (`SliceMeshes.order`):

- one group (one host, or a group spanning every host): the training mesh's own order,
  `jax.make_mesh` over the whole slice, as training has always used;
- several groups: group after group, each group's chips in `jax.make_mesh`'s physical
  order for the sampler's mesh shape (a tensor-parallel group keeps its tensor axis on
  neighbouring chips). The training mesh is that order reshaped: its rings run host
  block by host block. A collective over all chips of one axis (FSDP's gathers and
  reductions) moves the same bytes in any order.

`groups` is that order as one mesh with a leading "groups" axis: a sharding that names
only the sampler's axes is replicated over groups, so each group holds the whole copy
laid out as its own mesh holds it, and each host's shards of it are its group's array.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from infra.errors import UserInputError
from models import partitioning

GROUPS_AXIS = "groups"


def tensor_parallel_size(chips: int, kv_heads: int) -> int:
  """The tensor-parallel size of a sampler group of `chips` chips: the largest size that
  splits both the chips and the model's kv heads (q heads, a multiple of them, split too)."""
  return math.gcd(chips, kv_heads)


def sampler_axes(layout: str, train_axes: Mapping[str, int], groups: int, group_chips: int,
                 kv_heads: int) -> dict[str, int]:
  """The axes of one sampler group's mesh in sampling `layout` (`partitioning.SAMPLING_LAYOUTS`).

  "train" and "decode": the run's mesh axes with the batch axes split over the `groups`
  (each group samples its share of the batch), as training shards them; "tensor": the
  group's chips split by attention heads (`tensor_parallel_size`), the rest data-parallel.
  """
  if layout not in partitioning.SAMPLING_LAYOUTS:
    raise ValueError(f"sampling_layout={layout!r}: expected one of "
                     f"{tuple(partitioning.SAMPLING_LAYOUTS)}")
  if layout == "tensor":
    tensor = tensor_parallel_size(group_chips, kv_heads)
    return {"data": group_chips // tensor, "fsdp": 1, "tensor": tensor}
  return partitioning.per_group_axes(train_axes, groups)


@dataclasses.dataclass(frozen=True)
class SliceMeshes:
  """The training mesh and the sampler groups' meshes, reshapes of one device order.

  `group` is the sampler group whose mesh this process samples on (the planner, process 0,
  takes group 0); `leader` is the lowest process of that group: it runs the group's
  dialogues and schedule, the others dispatch what it dispatches (`models/group_channel.py`).
  """
  train: Mesh
  groups: Mesh  # axes ("groups", *the sampler's axes): group g's mesh is groups.devices[g]
  group: int = 0

  @property
  def order(self) -> list:
    """The one device order of every mesh here."""
    return list(self.train.devices.flat)

  @property
  def num_groups(self) -> int:
    return self.groups.shape[GROUPS_AXIS]

  def group_mesh(self, group: int) -> Mesh:
    names = self.groups.axis_names[1:]
    return Mesh(self.groups.devices[group], names, axis_types=(AxisType.Auto,) * len(names))

  @property
  def sampler_mesh(self) -> Mesh:
    """This process's group's mesh: where its sampler decodes."""
    return self.group_mesh(self.group)

  def processes(self, group: int) -> list[int]:
    return sorted({d.process_index for d in self.groups.devices[group].flat})

  @property
  def hosts_per_group(self) -> int:
    return len(self.processes(0))

  @property
  def leader(self) -> int:
    return self.processes(self.group)[0]

  @property
  def sampler_is_training_mesh(self) -> bool:
    """One group whose mesh is the training mesh itself (same axes, same devices): the sampler
    may decode from the training weights as they lie."""
    mesh = self.sampler_mesh
    return (self.num_groups == 1 and dict(mesh.shape) == dict(self.train.shape) and
            list(mesh.devices.flat) == self.order)


def single(mesh: Mesh) -> SliceMeshes:
  """One mesh that trains and samples (one group, the sampler's axes the training mesh's)."""
  names = (GROUPS_AXIS,) + tuple(mesh.axis_names)
  return SliceMeshes(train=mesh, groups=Mesh(mesh.devices[None], names,
                                             axis_types=(AxisType.Auto,) * len(names)))


def slice_meshes(train_axes: Mapping[str, int], sampler_axes: Mapping[str, int],
                 hosts_per_group: int = 1, devices: Sequence | None = None,
                 process: int | None = None) -> SliceMeshes:
  """The meshes of a run over `devices` (default: all) whose sampler groups are blocks of
  `hosts_per_group` consecutive processes, each on a mesh of `sampler_axes` (one size may be
  -1: the group's remaining chips); `process` (default: this one) picks `group`."""
  devices = list(jax.devices() if devices is None else devices)
  hosts = sorted({d.process_index for d in devices})
  if hosts_per_group < 1 or len(hosts) % hosts_per_group:
    raise UserInputError(f"rollout.sampler_hosts={hosts_per_group}: the {len(hosts)} hosts do "
                         "not split into groups of that many (give 1, 2, 4, ... dividing "
                         f"{len(hosts)})")
  process = jax.process_index() if process is None else process
  host_groups = [hosts[i:i + hosts_per_group] for i in range(0, len(hosts), hosts_per_group)]
  group = next(g for g, members in enumerate(host_groups) if process in members)
  names = (GROUPS_AXIS,) + ("data", "fsdp", "tensor")
  axis_types = (AxisType.Auto,) * len(names)
  if len(host_groups) == 1:
    train = partitioning.make_mesh(train_axes, devices)
    order = np.array(list(train.devices.flat), dtype=object)
    shape = partitioning.resolve_mesh_shape(_axes(sampler_axes), order.size)
    groups = Mesh(order.reshape((1,) + tuple(shape.values())), names, axis_types=axis_types)
    return SliceMeshes(train=train, groups=groups, group=group)
  per_group = [partitioning.make_mesh(_axes(sampler_axes),
                                      [d for d in devices if d.process_index in members])
               for members in host_groups]
  if len({m.devices.shape for m in per_group}) != 1:
    raise UserInputError(f"the sampler groups' meshes differ in shape "
                         f"({[dict(m.shape) for m in per_group]}): every group needs as many chips")
  order = np.concatenate([m.devices.reshape(-1) for m in per_group])
  train_shape = partitioning.resolve_mesh_shape(dict(train_axes), order.size)
  train = Mesh(order.reshape(tuple(train_shape.values())), tuple(train_shape),
               axis_types=(AxisType.Auto,) * len(train_shape))
  groups = Mesh(np.stack([m.devices for m in per_group]), names, axis_types=axis_types)
  return SliceMeshes(train=train, groups=groups, group=group)


def _axes(axes: Mapping[str, int]) -> dict[str, int]:
  """A sampler mesh's axes in the order every mesh here names them."""
  unknown = set(axes) - {"data", "fsdp", "tensor"}
  if unknown:
    raise ValueError(f"mesh axes {sorted(unknown)}: expected data, fsdp and tensor")
  return {name: axes.get(name, 1) for name in ("data", "fsdp", "tensor")}
