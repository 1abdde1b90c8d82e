"""Multi-host start-up: joining the process group of a pod slice, SLURM or a launch by hand.

Meshes and what goes where on them are `models.partitioning`'s job.
"""

from __future__ import annotations

import os

import jax
from absl import logging

from infra.errors import UserInputError


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


def cpu_unless_accelerators() -> None:
  """Sets JAX_PLATFORMS=cpu on a machine with no TPU chip and no GPU driver, unless it is set.

  JAX falls back to its CPU backend there anyway, but with libtpu installed (`pip install -e
  .[tpu]`, for the planner's deviceless compiles) it first starts the TPU plugin, which prints
  libtpu's `E0000 ... unexpected worker hostname` and `Failed to find host bounds` lines on
  every run. Call it before JAX starts a backend (the CLIs do, first thing).
  """
  if "JAX_PLATFORMS" in os.environ:
    return
  from jax._src import hardware_utils  # JAX's own test for TPU chips, which libtpu trusts
  tpu_chips, _ = hardware_utils.num_available_tpu_chips_and_device_id()
  gpu_driver = any(os.path.exists(path) for path in ("/proc/driver/nvidia/version", "/dev/kfd"))
  if not tpu_chips and not gpu_driver:
    os.environ["JAX_PLATFORMS"] = "cpu"  # for the processes this one starts
    jax.config.update("jax_platforms", "cpu")  # JAX read the environment at its import


def heartbeat_timeout_s() -> int:
  """Seconds of silence after which JAX's coordination service aborts every host."""
  return _positive_int_env("RLVER_HEARTBEAT_TIMEOUT_S", 60)


def _positive_int_env(name: str, default: int) -> int:
  value = os.environ.get(name, str(default))
  if not value.isdigit() or int(value) < 1:
    raise UserInputError(f"{name}={value!r}: expected a positive number of seconds")
  return int(value)
