"""Several JAX processes on 127.0.0.1, started by hand from the environment (gloo on CPU)."""

import subprocess
import sys
import textwrap

import pytest

from tests.processes import communicate_all, distributed_envs

WORKER = textwrap.dedent("""
    import jax, numpy as np
    from jax.experimental import multihost_utils
    from rlver_jax import sharding
    assert sharding.maybe_initialize_distributed()
    ids = multihost_utils.process_allgather(np.array([jax.process_index()]))
    print("RESULT", jax.process_count(), jax.device_count(), sorted(ids.ravel().tolist()))
""")


def test_processes_started_by_hand_form_one_group():
  procs = [subprocess.Popen([sys.executable, "-c", WORKER], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
           for env in distributed_envs(2, 2)]
  # gloo writes to stderr, unsynchronised with our prints: each output is stdout + stderr
  outputs = communicate_all(procs)
  for p, output in zip(procs, outputs):
    assert p.returncode == 0, output
    assert "RESULT 2 4 [0, 1]" in output, output


def test_a_launch_by_hand_names_the_missing_variable(monkeypatch):
  from infra.errors import UserInputError
  from rlver_jax import sharding
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
  with pytest.raises(UserInputError, match="JAX_PROCESS_ID"):
    sharding.maybe_initialize_distributed()
