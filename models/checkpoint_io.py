"""HF checkpoint directories to NNX models and back.

Model-agnostic: a model module supplies the list of `TensorMapping`s between
HF tensor names and its own state paths; this module does the file handling,
validation and placement. Loading never builds random weights: the model is
created abstractly (`nnx.eval_shape`) and each tensor is read, converted and
placed straight into its target sharding, one at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from models import partitioning
from models import safetensors_io
from models.errors import MissingInputError, UserInputError

Path = tuple  # a path into an nnx state, e.g. ("backbone", "layers", 0, "attn", "q_proj")


@dataclasses.dataclass(frozen=True)
class TensorMapping:
  hf_name: str
  path: Path
  to_ours: Callable[[np.ndarray], np.ndarray] = lambda x: x
  to_hf: Callable[[np.ndarray], np.ndarray] = lambda x: x


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
         mesh=None, rules=None) -> nnx.Module:
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

  def place(variable: nnx.Variable, host_array: np.ndarray):
    if mesh is None:
      return jax.device_put(host_array)
    sharding = partitioning.named_sharding(variable.get_metadata()["logical_axes"],
                                           host_array.shape, mesh, rules)
    return jax.make_array_from_callback(host_array.shape, sharding, lambda idx: host_array[idx])

  for mapping in mappings:
    variable = flat[mapping.path]
    expected = variable.get_value()
    st = tensors[mapping.hf_name]
    expected_hf_shape = jax.eval_shape(mapping.to_hf, expected).shape
    if st.shape(mapping.hf_name) != tuple(expected_hf_shape):
      raise UserInputError(
          f"{st.path}: tensor {mapping.hf_name} has shape {st.shape(mapping.hf_name)}, "
          f"the config in {path}/config.json implies {tuple(expected_hf_shape)}")
    host = np.asarray(mapping.to_ours(st.read(mapping.hf_name))).astype(expected.dtype)
    variable.set_value(place(variable, host))
  for state_path in zero_init:
    variable = flat[state_path]
    abstract_value = variable.get_value()
    variable.set_value(place(variable, np.zeros(abstract_value.shape, abstract_value.dtype)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _to_host(array: jax.Array) -> np.ndarray:
  if not array.is_fully_addressable:
    array = multihost_utils.process_allgather(array, tiled=True)
  return np.asarray(jax.device_get(array))


def save(model: nnx.Module, out_dir: str, *, mappings: Sequence[TensorMapping], hf_config: dict,
         dtype: str | None, max_shard_bytes: int) -> None:
  """Writes `config.json` and safetensors; with several hosts, process 0 writes."""
  flat = dict(nnx.to_flat_state(nnx.state(model)))
  save_dtype = None if dtype is None else jnp.dtype(dtype)

  def tensors():
    for mapping in mappings:
      host = _to_host(flat[mapping.path].get_value())
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
