"""Processes the tests start: their environment, ports, launches of several JAX processes on
127.0.0.1 (gloo on CPU), bounded waits, and their logs when they fail.

Every environment built here starts from `os.environ`, so each process inherits the test
session's compilation cache (tests/conftest.py sets it up).
"""

import os
import socket
import subprocess
import sys
import time

from tests import ROOT

# The demo trainer, shrunk to what the multi-process tests need. One mini-batch a step: with
# the demo's two, each host's half of the rows makes up the mini-batches differently from one
# host's order, and a run on two processes could not match one on one. Every launch of two
# processes of two devices with these flags runs the same programs: compiled once a session.
SMALL_DEMO_FLAGS = (f"--config={ROOT}/configs/demo.py", "--config.batch_size=4",
                    "--config.rollout.max_new_tokens=8", "--config.checkpoint.every=1",
                    "--config.policy.tiny_warmup_steps=2", "--config.optim.num_minibatches=1")


# XLA:CPU compiles the tests' programs in about half the CPU time (the small demo's learner
# and row programs: 14.9 s -> 8.0 s of CPU, measured in the issue 34 note) and runs them
# within a few percent: the legacy elemental emitters instead of the MLIR fusion emitters
# (same run time, 31% less compile) and LLVM's -O1 instead of -O2 (another 22%, 5% slower
# runs). The tests compile far more than they run: most of a small test's time is compiles.
FAST_COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=1"


def cpu_xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test process on the CPU: the fast-compile flags, and `devices` fake CPU
  devices (None: XLA's default of one).

  XLA aborts the process when a collective's devices have not all joined it
  within a timeout of its own; on a loaded 2-core machine the threads
  of 8 fake devices can take longer than that, so the tests allow 15 minutes.
  """
  if not devices:
    return FAST_COMPILE_FLAGS
  return (f"{FAST_COMPILE_FLAGS} --xla_force_host_platform_device_count={devices}"
          " --xla_cpu_collective_call_terminate_timeout_seconds=900")


def cpu_env(devices: int | None = None, **extra: str) -> dict[str, str]:
  """This process's environment for a child on the CPU: `devices` fake devices (None: XLA's
  default of one), plus `extra`."""
  return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_xla_flags(devices), **extra}


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now (for a JAX coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def distributed_envs(processes: int, devices: int, **extra: str) -> list[dict[str, str]]:
  """One environment per process of a JAX group started by hand (JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES, JAX_PROCESS_ID), each with `devices` fake CPU devices."""
  coordinator = f"127.0.0.1:{free_port()}"
  return [cpu_env(devices, JAX_COORDINATOR_ADDRESS=coordinator,
                  JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(pid), **extra)
          for pid in range(processes)]


def launch(workdir: str, processes: int, devices: int, *flags: str, heartbeat_s: int = 60,
           program=("rlver_jax.main", *SMALL_DEMO_FLAGS),
           extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
  """Starts `python -m program --config.workdir=workdir flags` (the small demo trainer) as
  `processes` processes of `devices` CPU devices, with `extra_env` in their environment;
  process i logs to `workdir.i.log`. Each writes what it compiles into the session's cache
  (`tests.group_member`), so a relaunch compiles nothing."""
  extra = {"RLVER_HEARTBEAT_TIMEOUT_S": str(heartbeat_s), **(extra_env or {})}
  if processes > 1:
    envs = distributed_envs(processes, devices, **extra)
  else:
    envs = [cpu_env(devices, **extra)]
  procs = []
  for pid, env in enumerate(envs):
    with open(f"{workdir}.{pid}.log", "w") as log:  # the child keeps its own descriptor
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "tests.group_member", *program, f"--config.workdir={workdir}",
           *flags],
          cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
  return procs


def wait(procs: list[subprocess.Popen], timeout_s: float = 600) -> list[int]:
  """The exit codes of `procs`, all within `timeout_s` in all; any still running is killed."""
  deadline = time.monotonic() + timeout_s
  try:
    return [p.wait(timeout=max(1, deadline - time.monotonic())) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def wait_until(condition, procs: list[subprocess.Popen], timeout_s: float = 600) -> None:
  """Polls `condition()` until it holds; fails if a process of `procs` ends first or
  `timeout_s` passes."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert all(p.poll() is None for p in procs), "a process ended early"
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.05)


def log_of(workdir: str, pid: int) -> str:
  """What process `pid` of a `launch` on `workdir` printed."""
  with open(f"{workdir}.{pid}.log") as f:
    return f.read()


def logs_of(workdir: str, processes: int, tail: int = 3000) -> str:
  """The last `tail` characters of each process's log, for a failed assertion's message."""
  return "\n".join(f"--- process {pid} ---\n{log_of(workdir, pid)[-tail:]}"
                   for pid in range(processes))


def run_all(workdir: str, processes: int, devices: int, *flags: str, **launch_args) -> None:
  """`launch`, then `wait`; fails with every process's log unless all of them exit 0."""
  codes = wait(launch(workdir, processes, devices, *flags, **launch_args))
  assert codes == [0] * processes, f"exit codes {codes}\n{logs_of(workdir, processes)}"


def communicate_all(procs: list[subprocess.Popen], timeout_s: float = 120) -> list[str]:
  """Each process's stdout (stderr merged into it where the process was started so), after
  all of them ended within `timeout_s` each; any still running is killed."""
  outputs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout_s)
      outputs.append(out + (err or ""))
  finally:
    for p in procs:
      p.kill()
  return outputs
