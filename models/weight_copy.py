"""The sampler's own copy of the policy's weights, in the dtype and layout it decodes from.

Training keeps float32 weights laid out for the update (a stack of layers, FSDP-sharded on a
mesh); decoding wants them in bf16, often laid out otherwise. `WeightCopy` makes that copy
once and rewrites it in place after every training step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from models import partitioning, programs, qwen2

def layers_as_list(sampling_layout: str, mesh: Mesh | None) -> bool:
  """Whether the sampler's weight copy holds the decoder layers as a list (`qwen2.unscanned`).

  A list decodes from each layer's own arrays, where a scan slices them out of the stack
  (the CPU backend copies every slice, every token). But FSDP-sharded weights (the "train"
  layout on a mesh) stay a stack under a scan: each layer's all-gather then lives one layer
  at a time, where XLA gathers a list's layers all at once (7B at 16k on fsdp=8: row
  prefill +36.0 GiB against +9.6).
  """
  return mesh is None or sampling_layout == "decode"


def decoding_copy(graphdef, state, dtype, as_list: bool):
  """The sampler's copy of a model's weights, to decode from: floating weights in `dtype`;
  with `as_list`, the decoder layers a list of modules with arrays of their own.

  `state` may be abstract. Returns the copy's graphdef, its abstract state and
  `copy(state)`, which makes the copy from the model's weights (jit it: the layers'
  slices are then its outputs, not eager copies).
  """
  graphdefs = []

  def copy(state):
    cast = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, state)
    model = nnx.merge(graphdef, cast)
    copy_graphdef, copy_state = nnx.split(qwen2.unscanned(model) if as_list else model)
    graphdefs.append(copy_graphdef)  # static: the same at every trace
    return copy_state

  abstract_copy = jax.eval_shape(copy, state)
  return graphdefs[0], abstract_copy, copy


class WeightCopy:
  """The sampler's resident copy of the policy's weights in `dtype` and `layout`
  (`partitioning.SAMPLING_LAYOUTS`): its graphdef, abstract placed state and jitted programs.

  `make(state)` builds the copy; `refresh(old_copy, state)` rewrites it in place from new
  training weights (the old copy is donated, and kept though unread: jit drops unused
  arguments, and their donation with them), once per training step.
  """

  def __init__(self, graphdef, state, dtype, layout: str, mesh: Mesh | None):
    if layout not in partitioning.SAMPLING_LAYOUTS:
      raise ValueError(f"sampling_layout={layout!r}: expected one of "
                       f"{tuple(partitioning.SAMPLING_LAYOUTS)}")
    self.as_list = layers_as_list(layout, mesh)
    self.graphdef, abstract_copy, copy = decoding_copy(graphdef, state, dtype, self.as_list)
    shardings = (None if mesh is None else partitioning.state_shardings(
        abstract_copy, mesh, partitioning.SAMPLING_LAYOUTS[layout]))
    self.abstract = abstract_copy if mesh is None else programs.abstract(abstract_copy,
                                                                          shardings)
    self.make = jax.jit(copy, out_shardings=shardings)
    self.refresh = jax.jit(lambda old, new: copy(new), donate_argnums=(0,), keep_unused=True,
                           out_shardings=shardings)

  def refresh_program(self, mesh: Mesh, abstract_state) -> programs.Program:
    """The refresh from training weights `abstract_state`, as the planner compiles it."""
    return programs.Program(self.refresh, (self.abstract, abstract_state), mesh,
                            resident=(self.abstract, abstract_state),
                            work={"kind": "copy_weights"})
