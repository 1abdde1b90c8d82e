"""HF checkpoint directories to NNX models and back.

Model-agnostic: a model module supplies the list of `TensorMapping`s between
HF tensor names and its own state paths; this module does the file handling,
validation and placement. Loading never builds random weights: the model is
created abstractly (`nnx.eval_shape`) and each tensor is read, converted and
placed straight into its target sharding, one at a time.

A mapping with a `layer` fills layer `layer` of a stacked variable ([L, ...]
scanned decoder weights): every HF tensor of that variable is read once and
its slices go to the host buffers of the devices that hold them, so no
device (and no host) ever holds more than its own shards.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infra.errors import MissingInputError, UserInputError
from models import partitioning
from models import safetensors_io

Path = tuple  # a path into an nnx state, e.g. ("backbone", "layers", "attn", "q_proj")


@dataclasses.dataclass(frozen=True)
class TensorMapping:
  hf_name: str
  path: Path
  to_ours: Callable[[np.ndarray], np.ndarray] = lambda x: x
  to_hf: Callable[[np.ndarray], np.ndarray] = lambda x: x
  layer: int | None = None  # index into the leading axis of a stacked variable


def _format_names(names: Sequence[str], limit: int = 20) -> str:
  names = sorted(names)
  shown = ", ".join(names[:limit])
  return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def read_hf_config(path: str) -> dict:
  if not os.path.isdir(path):
    raise MissingInputError(f"checkpoint directory {path!r} does not exist")
  config_path = os.path.join(path, "config.json")
  if not os.path.exists(config_path):
    raise MissingInputError(f"{path}: no config.json (is this an HF checkpoint directory?)")
  with open(config_path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise UserInputError(f"{config_path}: invalid JSON: {e}") from None


def load(path: str, *, build_model: Callable[[], nnx.Module], mappings: Sequence[TensorMapping],
         ignorable: Callable[[str], bool], zero_init: Sequence[Path] = (),
         mesh=None) -> nnx.Module:
  """Builds `build_model()` abstractly and fills it from the safetensors in `path`.

  `zero_init` lists state paths that the checkpoint does not hold and that
  start at zero (a value head, say); every other leaf must be mapped.
  """
  abstract = nnx.eval_shape(build_model)
  graphdef, state = nnx.split(abstract)
  flat = dict(nnx.to_flat_state(state))

  tensors = safetensors_io.open_checkpoint(path)
  mapped = {m.hf_name: m for m in mappings}
  missing = [name for name in mapped if name not in tensors]
  unexpected = [name for name in tensors if name not in mapped and not ignorable(name)]
  if missing or unexpected:
    lines = [f"{path}: checkpoint tensors do not match the model"]
    if missing:
      lines.append(f"missing tensors ({len(missing)}): {_format_names(missing)}")
    if unexpected:
      lines.append(f"unexpected tensors ({len(unexpected)}): {_format_names(unexpected)}")
    raise UserInputError("\n".join(lines))
  unmapped = set(flat) - {m.path for m in mappings} - set(zero_init)
  if unmapped:
    raise AssertionError(f"model state paths with no checkpoint mapping: {sorted(unmapped)}")

  groups: dict[Path, list[TensorMapping]] = {}
  for mapping in mappings:
    groups.setdefault(mapping.path, []).append(mapping)
  for state_path, group in groups.items():
    variable = flat[state_path]
    expected = variable.get_value()
    stacked = group[0].layer is not None
    if stacked and sorted(m.layer for m in group) != list(range(expected.shape[0])):
      raise AssertionError(f"{state_path}: mappings do not cover its {expected.shape[0]} layers")
    one_shape = expected.shape[1:] if stacked else expected.shape
    for mapping in group:
      st = tensors[mapping.hf_name]
      expected_hf_shape = jax.eval_shape(
          mapping.to_hf, jax.ShapeDtypeStruct(one_shape, expected.dtype)).shape
      if st.shape(mapping.hf_name) != tuple(expected_hf_shape):
        raise UserInputError(
            f"{st.path}: tensor {mapping.hf_name} has shape {st.shape(mapping.hf_name)}, "
            f"the config in {path}/config.json implies {tuple(expected_hf_shape)}")

    def read(mapping, dtype=expected.dtype):
      raw = tensors[mapping.hf_name].read(mapping.hf_name)
      return np.asarray(mapping.to_ours(raw)).astype(dtype)

    group = sorted(group, key=lambda m: m.layer or 0)
    variable.set_value(partitioning.place_checkpoint_tensor(
        variable.get_metadata().get("logical_axes"), expected.shape, expected.dtype,
        [functools.partial(read, m) for m in group], stacked, mesh))
  for state_path in zero_init:
    variable = flat[state_path]
    abstract_value = variable.get_value()
    zeros = lambda v=abstract_value: np.zeros(v.shape, v.dtype)
    variable.set_value(partitioning.place_checkpoint_tensor(
        variable.get_metadata().get("logical_axes"), abstract_value.shape, abstract_value.dtype,
        [zeros], False, mesh))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def save(model: nnx.Module, out_dir: str, *, mappings: Sequence[TensorMapping], hf_config: dict,
         dtype: str | None, max_shard_bytes: int) -> None:
  """Writes `config.json` and safetensors; with several hosts, process 0 writes."""
  flat = dict(nnx.to_flat_state(nnx.state(model)))
  save_dtype = None if dtype is None else jnp.dtype(dtype)

  def tensors():
    for mapping in mappings:
      value = flat[mapping.path].get_value()
      host = partitioning.to_host(value if mapping.layer is None else value[mapping.layer])
      host = np.asarray(mapping.to_hf(host))
      yield mapping.hf_name, host if save_dtype is None else host.astype(save_dtype)

  if jax.process_index() != 0:
    for _ in tensors():  # every process joins the gathers
      pass
    return
  os.makedirs(out_dir, exist_ok=True)
  safetensors_io.write_checkpoint(out_dir, tensors(), max_shard_bytes)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
