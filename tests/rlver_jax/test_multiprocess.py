"""Several JAX processes on 127.0.0.1, started by hand from the environment (gloo on CPU)."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import fake_cpu_devices

WORKER = textwrap.dedent("""
    import jax, numpy as np
    from jax.experimental import multihost_utils
    from rlver_jax import sharding
    assert sharding.maybe_initialize_distributed()
    ids = multihost_utils.process_allgather(np.array([jax.process_index()]))
    print("RESULT", jax.process_count(), jax.device_count(), sorted(ids.ravel().tolist()))
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_processes_started_by_hand_form_one_group():
  coordinator = f"127.0.0.1:{_free_port()}"
  procs = []
  for pid in range(2):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": coordinator,
           "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid),
           "XLA_FLAGS": fake_cpu_devices(2)}
    procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE))
  outputs = []  # (stdout, stderr): gloo writes to stderr, unsynchronised with our prints
  for p in procs:
    try:
      outputs.append(p.communicate(timeout=120))
    finally:
      p.kill()
  for p, (out, err) in zip(procs, outputs):
    assert p.returncode == 0, out + err
    assert "RESULT 2 4 [0, 1]" in out, out + err


def test_a_launch_by_hand_names_the_missing_variable(monkeypatch):
  from models.errors import UserInputError
  from rlver_jax import sharding
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
  with pytest.raises(UserInputError, match="JAX_PROCESS_ID"):
    sharding.maybe_initialize_distributed()
