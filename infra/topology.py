"""Accelerators without the accelerator: the devices of a TPU slice or GPU host, to compile for.

`slice_devices(parse_accelerator_type("v5p-16"))` gives the 8 devices of a
v5p-16 slice (2 hosts) as the TPU compiler sees them
(`jax.experimental.topologies`), on a machine with no TPU, only `libtpu`
(`pip install -e .[tpu]`). Programs lowered onto a mesh of those devices
compile with the real TPU compiler, deviceless (as MaxText's
`train_compile.py`); their memory analysis is the TPU's.

`h100-8`, `h200-16` (8 GPUs a host) do the same for NVIDIA GPUs through the
CUDA plugin (`pip install -e .[gpu]`), given XLA's target description of the
GPU (`infra/assets/gpu_target_configs`); no GPU or driver is needed. Without
a device there is no autotuning: the compiled kernels are XLA's defaults, so
memory and kernels are the GPU's, speed is not.

`GENERATIONS` holds each generation's published per-chip figures, the
assumptions of every time estimate (`rlver_jax/plan/`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from infra.errors import UserInputError

_TARGET_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets",
                               "gpu_target_configs")


@dataclasses.dataclass(frozen=True)
class Generation:
  """A TPU generation's per-chip figures (Cloud TPU documentation, bf16).

  `ici_gbps` is the one-way inter-chip bandwidth a collective can use per
  chip: half the documented bidirectional figure.
  """
  name: str  # the topology name's prefix ("v5p")
  device_kind: str  # what the compiler's devices report
  hbm_gib: float
  peak_tflops: float  # bf16 matmul peak
  hbm_gbps: float
  ici_gbps: float
  dims: int  # 3: a 3D torus (v4, v5p); 2: a 2D torus (v5e, v6e)
  cores_per_chip_in_name: int  # v4-8 and v5p-8 count TensorCores (4 chips); v6e-8 counts chips
  chip_config: str = "default"
  source: str = ""
  platform: str = "tpu"
  target_config: str = ""  # GPUs: the GpuTargetConfigProto file in assets/gpu_target_configs


GENERATIONS: dict[str, Generation] = {g.name: g for g in (
    Generation("v4", "TPU v4", 32, 275, 1200, 300, 3, 2, chip_config="megacore",
               source="cloud.google.com/tpu/docs/v4 (ICI: 6 links x 50 GB/s, the v4 paper)"),
    Generation("v5e", "TPU v5 lite", 16, 197, 819, 200, 2, 1,
               source="cloud.google.com/tpu/docs/v5e (400 GB/s bidirectional ICI)"),
    Generation("v5p", "TPU v5", 95, 459, 2765, 600, 3, 2,
               source="cloud.google.com/tpu/docs/v5p (1200 GB/s bidirectional ICI)"),
    Generation("v6e", "TPU v6 lite", 32, 918, 1638, 400, 2, 1,
               source="cloud.google.com/tpu/docs/v6e (800 GB/s bidirectional ICI)"),
    # NVLink within a host (900 GB/s bidirectional); across hosts the network is slower, and
    # the estimates do not model it.
    Generation("h100", "NVIDIA H100 80GB HBM3", 79.1, 989, 3352, 450, 1, 1, platform="gpu",
               target_config="h100_sxm.txtpb",
               source="NVIDIA H100 SXM datasheet (dense bf16), XLA's h100_sxm target config"),
    Generation("h200", "NVIDIA H200 141GB HBM3e", 141.0, 989, 4800, 450, 1, 1, platform="gpu",
               target_config="h200.txtpb",
               source="NVIDIA H200 SXM datasheet (dense bf16), XLA's h200 target config"),
)}
GPUS_PER_HOST = 8
# Accelerator-type prefixes as Cloud TPU spells them.
_ALIASES = {"v4": "v4", "v5e": "v5e", "v5litepod": "v5e", "v5lite": "v5e", "v5p": "v5p",
            "v6e": "v6e", "h100": "h100", "h200": "h200"}


@dataclasses.dataclass(frozen=True)
class Slice:
  """One accelerator type: its generation, chip grid and hosts."""
  accelerator_type: str
  generation: Generation
  shape: tuple[int, ...]  # chips along each torus axis
  chips_per_host: tuple[int, ...]

  @property
  def chips(self) -> int:
    return math.prod(self.shape)

  @property
  def hosts(self) -> int:
    return self.chips // math.prod(self.chips_per_host)

  @property
  def topology_name(self) -> str:
    if self.generation.platform == "gpu":  # slices x hosts x devices per host
      return f"1x{self.hosts}x{math.prod(self.chips_per_host)}"
    return f"{self.generation.name}:{'x'.join(map(str, self.shape))}"


def _grid(chips: int, dims: int) -> tuple[int, ...]:
  """Cloud TPU's slice shape for `chips`: 3D grows 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, ...;
  2D grows 1x1, 2x2 (4), 2x4, 4x4, 4x8, 8x8, ..."""
  if dims == 2:
    shape = [1, 1]
    while math.prod(shape) < chips:
      smallest = min(shape)
      shape[max(i for i, n in enumerate(shape) if n == smallest)] *= 2
    if shape == [1, 2]:  # no 2-chip slices
      raise UserInputError("no 2-chip slice")
    return tuple(shape)
  shape = [2, 2, 1] if chips >= 4 else [1, 1, 1]
  while math.prod(shape) < chips:
    smallest = min(shape)
    shape[max(i for i, n in enumerate(shape) if n == smallest)] *= 2
  return tuple(shape)


def parse_accelerator_type(name: str) -> Slice:
  """`v4-8`, `v5litepod-16`, `v5p-16`, `v6e-8`, ... as a Slice; UserInputError otherwise."""
  match = re.fullmatch(r"([vh]\d+[a-z]*)-(\d+)", name.strip())
  known = "v4-N, v5litepod-N (v5e-N), v5p-N, v6e-N; h100-N, h200-N GPUs"
  if not match or match.group(1) not in _ALIASES:
    raise UserInputError(f"--topology={name}: not an accelerator type ({known}, e.g. v5p-16 "
                         "or h200-8)")
  generation = GENERATIONS[_ALIASES[match.group(1)]]
  count = int(match.group(2))
  if generation.platform == "gpu":
    per_host = min(count, GPUS_PER_HOST)
    if count < 1 or count % per_host:
      raise UserInputError(f"--topology={name}: {generation.name} hosts hold "
                           f"{GPUS_PER_HOST} GPUs; give 1-8 or a multiple of 8")
    return Slice(name, generation, (count,), (per_host,))
  chips, rest = divmod(count, generation.cores_per_chip_in_name)
  if rest or chips < 1 or chips & (chips - 1):
    unit = "TensorCores (2 per chip)" if generation.cores_per_chip_in_name == 2 else "chips"
    raise UserInputError(f"--topology={name}: {generation.name} slices count {unit} in "
                         "powers of two (e.g. " +
                         ("v5p-8, v5p-16, v5p-64" if generation.dims == 3 else
                          "v6e-8, v6e-16, v6e-64") + ")")
  shape = _grid(chips, generation.dims)
  if generation.dims == 3:
    per_host = (min(shape[0], 2), min(shape[1], 2), 1)
  else:  # one 8-chip host up to 8 chips; 4-chip hosts in larger slices
    per_host = (min(shape[0], 2), min(shape[1], 4 if chips <= 8 else 2), 1)
  return Slice(name, generation, shape, per_host)


def prepare_environment(accelerator_type: str) -> None:
  """Environment for compiling deviceless, set before JAX starts (`rlver_jax/plan/__main__.py`)."""
  # Compiling needs no TPU, so planners may run side by side (libtpu otherwise locks itself
  # to one process per machine).
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # The programs run on no device here: the host's CPU backend is the only one to start (an
  # installed CUDA plugin otherwise fails its driver check without a GPU) ...
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if accelerator_type.startswith("h"):
    # ... and the CUDA plugin's compiler, which needs no driver, skips that check.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def slice_devices(accelerators: Slice) -> list:
  """The slice's devices, from libtpu's or the CUDA plugin's compiler (no device needed);
  their `process_index` says which host each sits on."""
  prepare_environment(accelerators.accelerator_type)
  generation = accelerators.generation
  try:
    from jax.experimental import topologies
    if generation.platform == "gpu":
      with open(os.path.join(_TARGET_CONFIGS, generation.target_config)) as f:
        description = topologies.get_topology_desc(
            platform="cuda", target_config=f.read(), topology=accelerators.topology_name)
    else:
      description = topologies.get_topology_desc(
          platform="tpu", topology_name=accelerators.topology_name,
          chip_config_name=generation.chip_config,
          chips_per_host_bounds=accelerators.chips_per_host, wrap=(False,) * 3)
  except Exception as e:  # no libtpu / CUDA plugin, or one that does not know this device
    extra = "tpu" if generation.platform == "tpu" else "gpu"
    raise UserInputError(f"cannot compile for {accelerators.accelerator_type}: "
                         f"{str(e).splitlines()[0]} (the compiler comes with "
                         f"pip install -e .[{extra}])") from e
  return list(description.devices)


def sub_slice(accelerators: Slice, hosts: int) -> Slice:
  """`hosts` hosts of a slice as a slice of their own: the chips a program of one sampler
  group compiles for. (The deviceless compiler rejects a program over some hosts' devices of
  a larger slice whose device ids are not 0..n-1, as v6e-16's host 0 holds 0, 1, 4 and 5.)"""
  if hosts < 1 or accelerators.hosts % hosts:
    raise UserInputError(f"{hosts} host(s) of {accelerators.accelerator_type} "
                         f"({accelerators.hosts} hosts): give a divisor of {accelerators.hosts}")
  if hosts == accelerators.hosts:
    return accelerators
  per_host = accelerators.chips_per_host
  chips = hosts * math.prod(per_host)
  if accelerators.generation.platform == "gpu":
    return dataclasses.replace(accelerators, shape=(chips,))
  shape = _grid(chips, accelerators.generation.dims)
  if hosts == 1:  # a host's own grid (an 8-chip v6e host is 2x4)
    shape = per_host[:len(accelerators.shape)]
  return dataclasses.replace(accelerators, shape=tuple(shape))


def group_devices(accelerators: Slice):
  """`hosts -> devices`: the chips of a sub-slice of that many hosts (`sub_slice`), which the
  planner compiles one sampler group's programs for."""
  return lambda hosts: slice_devices(sub_slice(accelerators, hosts))
