"""Test set-up: 8 fake CPU devices for sharding tests, tiny HF checkpoints."""

import os



def fake_cpu_devices(count: int) -> str:
  """XLA_FLAGS for `count` fake CPU devices.

  XLA aborts the process when a collective's devices have not all joined it
  within a timeout of its own; on a loaded 2-core machine the threads
  of 8 fake devices can take longer than that, so the tests allow 15 minutes.
  """
  return (f"--xla_force_host_platform_device_count={count}"
          " --xla_cpu_collective_call_terminate_timeout_seconds=900")


os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + fake_cpu_devices(8)).strip()

import pytest  # noqa: E402

# The shared helpers' asserts report their values, as the tests' own do.
pytest.register_assert_rewrite("tests.demo_run")


def pytest_addoption(parser):
  parser.addoption("--run-slow", action="store_true", default=False,
                   help="also run tests marked slow")


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: long-running; run with --run-slow")


def pytest_collection_modifyitems(config, items):
  if config.getoption("--run-slow"):
    return
  skip_slow = pytest.mark.skip(reason="slow: pass --run-slow to run")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip_slow)


# The authors' released data: RLVER's profiles (data/rlver) and SAGE's recorded benchmark
# dialogues (data/sage), in the project's shared/ folder beside the repository.
SHARED_DIR = os.environ.get("RLVER_SHARED_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared")


@pytest.fixture
def shared_data():
  """`shared_data("rlver", "train_profile.jsonl")`: that path under shared/data, or a skip.

  The tests that need the released data run whenever it is present (CI always has it) and
  say where to get it when it is not.
  """
  def path(*parts: str) -> str:
    full = os.path.normpath(os.path.join(SHARED_DIR, "data", *parts))
    if not os.path.exists(full):
      pytest.skip(f"needs {full}: the authors' released RLVER profiles (data/rlver) and SAGE "
                  "results (data/sage) from Tencent's digitalhuman repository (MIT); put the "
                  "project's shared/ folder beside this repository or set RLVER_SHARED_DIR")
    return full

  return path


@pytest.fixture
def serve():
  """Starts FaultyServer(script) instances on 127.0.0.1; all are shut down after the test."""
  import threading
  from tests.fake_openai import FaultyServer
  servers = []

  def start(script):
    server = FaultyServer(script)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    servers.append(server)
    return server

  yield start
  for server in servers:
    server.shutdown()
    server.server_close()
