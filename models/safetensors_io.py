"""Minimal safetensors reader and writer on numpy (bf16 via ml_dtypes).

Reading memory-maps the file, so a tensor costs host memory only while it is
being placed; no framework tensors are built.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np

from infra.errors import MissingInputError, UserInputError

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
  """One .safetensors file: `names()`, `shape(name)`, `read(name)` (a read-only view).

  The header is checked against the file's size on opening, so a truncated
  file or a corrupt header is reported (UserInputError) before any tensor is read.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    with open(self.path, "rb") as f:
      file_size = os.fstat(f.fileno()).st_size
      if file_size < 8:
        raise UserInputError(f"{self.path}: not a safetensors file ({file_size} bytes, shorter "
                             "than its 8-byte header length)")
      (header_len,) = struct.unpack("<Q", f.read(8))
      if header_len > file_size - 8:
        raise UserInputError(f"{self.path}: header claims {header_len} bytes but the file has "
                             f"{file_size} (truncated or not a safetensors file)")
      try:
        header = json.loads(f.read(header_len))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(f"{self.path}: unreadable safetensors header: {e}") from None
      if not isinstance(header, dict):
        raise UserInputError(f"{self.path}: safetensors header is not a JSON object")
      self.metadata = header.pop("__metadata__", None) or {}
      self._entries = header
      self._data_start = 8 + header_len
      for name, entry in header.items():
        self._check_entry(name, entry, file_size - self._data_start)
      self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

  def _check_entry(self, name: str, entry, data_size: int) -> None:
    """A tensor's header entry must be well formed and lie inside the file's data section."""
    where = f"{self.path}: tensor {name}"
    fields = entry if isinstance(entry, dict) else {}
    shape, offsets, dtype_code = (fields.get(k) for k in ("shape", "data_offsets", "dtype"))
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets) and isinstance(dtype_code, str)):
      raise UserInputError(f"{where}: malformed header entry {json.dumps(entry)[:200]}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
      raise UserInputError(f"{where}: data_offsets [{begin}, {end}] lie outside the file's "
                           f"{data_size} data bytes (truncated file?)")
    dtype = _DTYPES.get(dtype_code)
    if dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
      raise UserInputError(f"{where}: data_offsets span {end - begin} bytes but shape {shape} "
                           f"of {dtype_code} needs {math.prod(shape) * dtype.itemsize}")

  def names(self) -> list[str]:
    return list(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entries[name]["shape"])

  def dtype(self, name: str) -> np.dtype:
    code = self._entries[name]["dtype"]
    if code not in _DTYPES:
      raise UserInputError(f"{self.path}: tensor {name} has unsupported dtype {code}")
    return _DTYPES[code]

  def read(self, name: str) -> np.ndarray:
    entry = self._entries[name]
    begin, end = entry["data_offsets"]
    dtype = self.dtype(name)
    count = (end - begin) // dtype.itemsize
    array = np.frombuffer(self._mmap, dtype=dtype, count=count, offset=self._data_start + begin)
    return array.reshape(entry["shape"])


def write(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
          metadata: Mapping[str, str] | None = None) -> None:
  header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
  offset = 0
  arrays = []
  for name, array in tensors.items():
    array = np.ascontiguousarray(array)
    if array.dtype not in _NAMES:
      raise ValueError(f"tensor {name}: dtype {array.dtype} cannot be written to safetensors")
    header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                    "data_offsets": [offset, offset + array.nbytes]}
    offset += array.nbytes
    arrays.append(array)
  header_bytes = json.dumps(header, separators=(",", ":")).encode()
  header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned
  tmp = f"{os.fspath(path)}.tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(header_bytes)))
    f.write(header_bytes)
    for array in arrays:
      f.write(array.tobytes())
  os.replace(tmp, path)


def open_checkpoint(directory: str) -> dict[str, SafetensorsFile]:
  """Maps every tensor name of an HF checkpoint directory to the file holding it."""
  index_path = os.path.join(directory, "model.safetensors.index.json")
  if os.path.exists(index_path):
    with open(index_path) as f:
      try:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
      except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise UserInputError(f"{index_path}: not a safetensors index with a 'weight_map' "
                             f"({type(e).__name__}: {e})") from None
    files = {}
    for filename in sorted(set(weight_map.values())):
      file_path = os.path.join(directory, filename)
      if not os.path.exists(file_path):
        raise MissingInputError(f"{index_path} names {filename}, which is not in {directory}")
      files[filename] = SafetensorsFile(file_path)
    return {name: files[filename] for name, filename in weight_map.items()}
  paths = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
  if not paths:
    others = [p for p in os.listdir(directory) if p.endswith((".bin", ".pt", ".pth"))]
    hint = (f" (found {others}; convert them with transformers' save_pretrained("
            "safe_serialization=True))") if others else ""
    raise MissingInputError(f"{directory}: no .safetensors weights{hint}")
  by_name = {}
  for p in paths:
    st = SafetensorsFile(os.path.join(directory, p))
    for name in st.names():
      by_name[name] = st
  return by_name


def write_checkpoint(directory: str, tensors: Iterable[tuple[str, np.ndarray]],
                     max_shard_bytes: int) -> list[str]:
  """Writes tensors as one file or as HF-style shards with an index; returns file names."""
  shards: list[dict[str, np.ndarray]] = [{}]
  shard_bytes = 0
  for name, array in tensors:
    if shards[-1] and shard_bytes + array.nbytes > max_shard_bytes:
      shards.append({})
      shard_bytes = 0
    shards[-1][name] = array
    shard_bytes += array.nbytes
  if len(shards) == 1:
    write(os.path.join(directory, "model.safetensors"), shards[0])
    return ["model.safetensors"]
  filenames = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  total = 0
  for filename, shard in zip(filenames, shards):
    write(os.path.join(directory, filename), shard)
    weight_map.update({name: filename for name in shard})
    total += sum(a.nbytes for a in shard.values())
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return filenames
