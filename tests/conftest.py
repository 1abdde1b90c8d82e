"""Test set-up: 8 fake CPU devices for sharding tests, XLA:CPU's fast-compile flags
(`tests.processes.FAST_COMPILE_FLAGS`), one compilation cache for the whole
test session (this process and every process it starts), the `fast` subset (every test not
marked `heavy` or `slow`), and the set-ups many tests share, each built once per session."""

import fcntl
import os
import shutil
import tempfile

import pytest

# The shared helpers' asserts report their values, as the tests' own do.
pytest.register_assert_rewrite("tests.cli_run", "tests.processes", "tests.runs")

from tests.processes import cpu_xla_flags  # noqa: E402

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + cpu_xla_flags(8)).strip()


def pytest_addoption(parser):
  parser.addoption("--run-slow", action="store_true", default=False,
                   help="also run tests marked slow")


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: long-running; run with --run-slow")
  config.addinivalue_line(
      "markers", "heavy: over 8 s on a loaded 2-core machine (a training run, a subprocess, "
      "a deviceless compile); runs in the full suite, not in `-m fast`")
  config.addinivalue_line(
      "markers", "fast: set on every test neither heavy nor slow: the subset a developer "
      "runs after each change (`pytest -n 2 -m fast tests`); it touches every room")
  _use_the_sessions_compile_cache(config)


def pytest_collection_modifyitems(config, items):
  for item in items:  # the fast subset: every test that is neither heavy nor slow
    if "heavy" not in item.keywords and "slow" not in item.keywords:
      item.add_marker(pytest.mark.fast)
  if config.getoption("--run-slow"):
    return
  skip_slow = pytest.mark.skip(reason="slow: pass --run-slow to run")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip_slow)


def pytest_unconfigure(config):
  if getattr(config, "_rlver_throwaway_cache", None):
    shutil.rmtree(config._rlver_throwaway_cache, ignore_errors=True)


def _use_the_sessions_compile_cache(config) -> None:
  """Every program the tests compile, in this process or in any process they start, goes
  through one persistent compilation cache, so that a program compiled once (a sampler's, a
  learner's: each test builds them from fresh closures, which JAX's in-memory cache cannot
  match) is loaded the next time.

  The cache is pytest's own (.pytest_cache/d/xdg_cache/rlver_jax/xla, kept between runs and
  emptied by `pytest --cache-clear`; a temporary directory when pytest's cache is off), never
  the user's home: XDG_CACHE_HOME points there, so the CLIs the tests start take it as their
  default `compile_cache_dir`, and JAX_COMPILATION_CACHE_DIR gives it to any other process.
  """
  if getattr(config, "cache", None) is not None:
    xdg_cache = str(config.cache.mkdir("xdg_cache"))
  else:
    xdg_cache = config._rlver_throwaway_cache = tempfile.mkdtemp(prefix="rlver_jax_tests_")
  os.environ["XDG_CACHE_HOME"] = xdg_cache
  from rlver_jax import compile_cache, sections
  cache_dir = sections.default_compile_cache_dir()
  os.environ["JAX_COMPILATION_CACHE_DIR"] = cache_dir
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  compile_cache.enable(cache_dir)


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


# The set-ups many tests read and none changes, each built once per session.

def _built_once(tmp_path_factory, name: str, build) -> str:
  """`build(directory)`'s result, built once for the whole test run: with pytest-xdist's
  workers too, the first to ask builds it under a lock in their shared base directory and the
  others wait for it and read it."""
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent  # shared by the workers
  directory, done = base / name, base / f"{name}.done"
  with open(base / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not done.exists():
      shutil.rmtree(directory, ignore_errors=True)
      directory.mkdir()
      done.write_text(build(str(directory)))
    return done.read_text()


@pytest.fixture(scope="session")
def tokenizer():
  """The shipped tiny tokenizer (rlver_jax/assets/tiny_tokenizer)."""
  from rlver_jax import tiny
  return tiny.load_tokenizer()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
  """A tiny random Qwen2 (seed 0) with the shipped tokenizer, in HF layout. Shared: read it,
  never write into it (copy it first)."""
  from rlver_jax import tiny

  def build(directory: str) -> str:
    tiny.write_checkpoint(directory, seed=0)
    return directory

  return _built_once(tmp_path_factory, "tiny_checkpoint", build)


@pytest.fixture(scope="session")
def demo_init_policy(tmp_path_factory) -> str:
  """The policy the demo's RL run starts from (`tiny.demo_policy` of configs/demo.py as
  shipped: its seed, its 300 warm-up steps, its resolved system prompt). The demo writes it
  into its workdir as init_policy on its first start; `with_demo_init_policy(workdir)` puts
  this copy there instead, so the warm-up runs once per test run. Read it, never write it."""
  from configs import demo
  from rlver_jax import tiny

  def build(directory: str) -> str:
    config = demo.get_config()
    config.workdir = directory
    return tiny.demo_policy(config)

  return _built_once(tmp_path_factory, "demo_init", build)


@pytest.fixture
def with_demo_init_policy(demo_init_policy):
  """`with_demo_init_policy(workdir)`: the demo's warmed-up start copied into `workdir`, where
  a demo run finds it and skips its warm-up."""
  def copy_into(workdir) -> None:
    shutil.copytree(demo_init_policy, os.path.join(workdir, "init_policy"))

  return copy_into
