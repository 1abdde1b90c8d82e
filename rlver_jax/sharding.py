"""Meshes and multi-host start-up.

A mesh config names axes and sizes, e.g. `{"data": 1, "fsdp": -1, "tensor": 2}`;
one size may be -1 for "all remaining devices". What goes where on a mesh is
`models.partitioning`'s job.
"""

from __future__ import annotations

import math
import os
from typing import Mapping

import jax
from absl import logging
from jax.sharding import AxisType, Mesh

from models.errors import UserInputError

DEFAULT_MESH_AXES = {"data": 1, "fsdp": -1, "tensor": 1}


def maybe_initialize_distributed(force: bool = False) -> bool:
  """Calls `jax.distributed.initialize` on multi-host launches; returns whether it did.

  Multi-host is recognised from a multi-worker TPU VM or SLURM with several
  tasks (JAX reads those environments itself), `RLVER_MULTIHOST=1` (set by
  run_tpu.sh on every worker), or from a launch by hand:
  `JAX_COORDINATOR_ADDRESS=host:port`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`
  in every process's environment (a GPU cluster without SLURM, or several
  processes on one machine in tests). On CPU the gloo collectives are selected,
  so a process group of CPU hosts can run cross-process computations. A host
  silent for `RLVER_HEARTBEAT_TIMEOUT_S` seconds (default 60) stops the others.
  Must run before any other JAX call; calling it again is a no-op.
  """
  if jax.distributed.is_initialized():
    return True
  multi_worker_tpu = len(os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",")) > 1
  slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
  coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
  launcher = os.environ.get("RLVER_MULTIHOST") == "1"  # run_tpu.sh: JAX reads the TPU metadata
  if not (force or coordinator or multi_worker_tpu or slurm or launcher):
    return False
  kwargs = {}
  if coordinator and "JAX_NUM_PROCESSES" in os.environ:
    try:
      kwargs = dict(coordinator_address=coordinator,
                    num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                    process_id=int(os.environ["JAX_PROCESS_ID"]))
    except (KeyError, ValueError) as e:
      raise UserInputError(
          "a launch by hand needs JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES=N and "
          f"JAX_PROCESS_ID=0..N-1 in every process's environment ({e!r})") from None
  if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # A host that stops sending heartbeats for this long stops every other host.
  heartbeat_s = heartbeat_timeout_s()
  jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=heartbeat_s,
                             shutdown_timeout_seconds=heartbeat_s)
  logging.info("jax.distributed: process %d of %d, %d local / %d global devices",
               jax.process_index(), jax.process_count(), jax.local_device_count(),
               jax.device_count())
  return True


def heartbeat_timeout_s() -> int:
  """Seconds of silence after which JAX's coordination service aborts every host."""
  return _positive_int_env("RLVER_HEARTBEAT_TIMEOUT_S", 60)


def _positive_int_env(name: str, default: int) -> int:
  value = os.environ.get(name, str(default))
  if not value.isdigit() or int(value) < 1:
    raise UserInputError(f"{name}={value!r}: expected a positive number of seconds")
  return int(value)


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


def make_mesh(axes: Mapping[str, int] | None = None, devices=None) -> Mesh:
  """A mesh over `devices` (default: all). Without a -1 axis the mesh may use
  fewer devices than there are: the first prod(sizes) of them."""
  devices = jax.devices() if devices is None else list(devices)
  axes = dict(axes or DEFAULT_MESH_AXES)
  if -1 not in axes.values() and math.prod(axes.values()) < len(devices):
    devices = devices[:math.prod(axes.values())]
  sizes = resolve_mesh_shape(axes, len(devices))
  # Auto axes: shardings propagate through the model as in pjit.
  return jax.make_mesh(tuple(sizes.values()), tuple(sizes), devices=devices,
                       axis_types=(AxisType.Auto,) * len(sizes))
