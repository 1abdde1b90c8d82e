"""The sampler's own copy of the policy's weights, in the dtype and layout it decodes from.

Training keeps float32 weights laid out for the update (a stack of layers, FSDP-sharded over
the training mesh); decoding wants them in bf16, laid out for the sampler's mesh, which may
be another shape over other chips (a sampler group's, `models/slice_meshes.py`). `WeightCopy`
makes that copy in one jitted program from the training weights as they lie: each chip casts
its own shards, then the partitioner moves the cast shards to where every group's layout wants
them. No chip gathers float32 weights and no chip holds more than its share of the copy; the
previous copy is donated to the program that rewrites it, after every training step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from infra import programs
from models import partitioning, qwen2, slice_meshes
from models.slice_meshes import SliceMeshes


def layers_as_list(sampling_layout: str, mesh: Mesh | None) -> bool:
  """Whether the sampler's weight copy holds the decoder layers as a list (`qwen2.unscanned`).

  A list decodes from each layer's own arrays, where a scan slices them out of the stack
  (the CPU backend copies every slice, every token). But FSDP-sharded weights (the "train"
  layout on a mesh) stay a stack under a scan: each layer's all-gather then lives one layer
  at a time, where XLA gathers a list's layers all at once (7B at 16k on fsdp=8: row
  prefill +36.0 GiB against +9.6).
  """
  return mesh is None or sampling_layout != "train"


def decoding_copy(graphdef, state, dtype, as_list: bool):
  """The sampler's copy of a model's weights, to decode from: floating weights in `dtype`
  (None keeps theirs); with `as_list`, the decoder layers a list of modules with arrays of
  their own.

  `state` may be abstract. Returns the copy's graphdef, its abstract state and
  `copy(state)`, which makes the copy from the model's weights (jit it: the layers'
  slices are then its outputs, not eager copies).
  """
  graphdefs = []

  def copy(state):
    cast = state if dtype is None else jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    model = nnx.merge(graphdef, cast)
    copy_graphdef, copy_state = nnx.split(qwen2.unscanned(model) if as_list else model)
    graphdefs.append(copy_graphdef)  # static: the same at every trace
    return copy_state

  abstract_copy = jax.eval_shape(copy, state)
  return graphdefs[0], abstract_copy, copy


class WeightCopy:
  """The sampler's resident copy of the policy's weights in `dtype` (None: theirs) and
  `layout` (`partitioning.SAMPLING_LAYOUTS`) on `meshes.sampler_mesh`, made from weights
  placed on `meshes.train` (one mesh that does both: `slice_meshes.single`; None: one device).

  `make(state)` builds the copy; `refresh(state)` rewrites it from new training weights, the
  previous copy donated (kept though unread: jit drops unused arguments, and their donation
  with them); `drop()` frees it until the next `refresh`. All three return or hold this
  process's group's copy; the program (`program`) writes every group's at once.
  """

  def __init__(self, graphdef, state, dtype, layout: str, meshes: SliceMeshes | None):
    if layout not in partitioning.SAMPLING_LAYOUTS:
      raise ValueError(f"sampling_layout={layout!r}: expected one of "
                       f"{tuple(partitioning.SAMPLING_LAYOUTS)}")
    self.meshes = meshes
    mesh = None if meshes is None else meshes.sampler_mesh
    self.as_list = layers_as_list(layout, mesh)
    self.graphdef, abstract_copy, copy = decoding_copy(graphdef, state, dtype, self.as_list)
    if meshes is None:
      self.abstract, every_group = abstract_copy, None
    else:
      rules = partitioning.SAMPLING_LAYOUTS[layout]
      group = partitioning.state_shardings(abstract_copy, mesh, rules)
      self.abstract = programs.abstract(abstract_copy, group)
      # The same specs on the groups mesh: replicated over its "groups" axis, each group's
      # chips hold their group's shards.
      every_group = jax.tree.map(lambda s: NamedSharding(meshes.groups, s.spec), group)
      self._every_group_abstract = programs.abstract(abstract_copy, every_group)
    def rewritten(previous, state):
      """The copy made anew from `state` in the memory of the `previous` one (donated)."""
      del previous
      return copy(state)

    self._make = jax.jit(copy, out_shardings=every_group)
    self._move = jax.jit(rewritten, donate_argnums=(0,), keep_unused=True,
                         out_shardings=every_group)
    self._held = None  # every group's copy, as the programs wrote it

  def make(self, state) -> nnx.State:
    self._held = self._make(state)
    return self._own_group(self._held)

  def refresh(self, state) -> nnx.State:
    if self._held is None:
      return self.make(state)
    self._held = self._move(self._held, state)
    return self._own_group(self._held)

  def drop(self) -> None:
    """Frees the copy (its arrays deleted); the next `refresh` makes it anew."""
    if self._held is not None:
      for array in jax.tree.leaves(self._held):
        array.delete()
      self._held = None

  def _own_group(self, every_group):
    """This process's group's copy: its chips' shards of every group's, as an array on its
    group's mesh (the same buffers)."""
    if self.meshes is None:
      return every_group
    devices = set(self.meshes.sampler_mesh.devices.flat)

    def own(array, abstract):
      shards = [shard.data for shard in array.addressable_shards if shard.device in devices]
      return jax.make_array_from_single_device_arrays(array.shape, abstract.sharding, shards)

    return jax.tree.map(own, every_group, self.abstract)

  def program(self, abstract_state, *, made: bool = False) -> programs.Program:
    """The refresh from training weights `abstract_state` (the make with `made`) over the
    whole slice, as the planner compiles it; `resident`: what stays between steps."""
    args = (abstract_state,) if made else (self._every_group_abstract, abstract_state)
    copy_bytes = programs.device_gib(self.abstract) * programs.GIB
    return programs.Program(self._make if made else self._move, args, self.meshes.train,
                            resident=args, work=programs.CopyWeights(copy_bytes))


def sampler_copy(graphdef, state, dtype, layout: str, meshes: SliceMeshes | None,
                 mesh: Mesh | None) -> WeightCopy | None:
  """The copy a sampler on `meshes` (or on `mesh` alone) needs, or None where it decodes from
  `state` as it lies (no `dtype`, and its mesh the training mesh)."""
  if meshes is None and mesh is not None:
    meshes = slice_meshes.single(mesh)
  if dtype is None and (meshes is None or meshes.sampler_is_training_mesh):
    return None
  return WeightCopy(graphdef, state, dtype, layout, meshes)
