"""Test set-up: 8 fake CPU devices for sharding tests, tiny HF checkpoints."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402


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
