"""The persistent compilation cache: a second run on the same machine loads its programs, and
the tests compile each program once."""

import os
import subprocess
import sys
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import demo, eval as eval_config, retention
from rlver_jax import sections
from tests import ROOT, processes
from tests.runs import read_metrics

CACHE_HITS, CACHE_MISSES = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def test_every_config_caches_compiled_programs_per_user_by_default(monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", "/cache/home")
  assert demo.get_config().compile_cache_dir == "/cache/home/rlver_jax/xla"
  assert eval_config.get_config().compile_cache_dir == "/cache/home/rlver_jax/xla"
  assert retention.get_config().compile_cache_dir == "/cache/home/rlver_jax/xla"


@pytest.mark.heavy
def test_a_second_run_compiles_its_first_step_in_under_a_quarter_of_the_time(tmp_path):
  """Two CLI runs with a cache of their own (not the session's: the first must compile cold),
  about a minute on 2 cores."""
  env = processes.cpu_env()
  cache = tmp_path / "xla_cache"
  compile_s = []
  for run in ("first", "second"):  # new workdirs: only the cache is shared
    done = subprocess.run(
        [sys.executable, "-m", "rlver_jax.main", f"--config.workdir={tmp_path / run}",
         f"--config.compile_cache_dir={cache}", "--config.steps=1", "--config.batch_size=4",
         "--config.rollout.max_new_tokens=8", "--config.policy.tiny_warmup_steps=2",
         "--config.mesh.fsdp=1", "--config.checkpoint.export_at_end=False"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compile_s.append(read_metrics(tmp_path / run)[0]["time/compile_s"])
  assert os.listdir(cache)
  first, second = compile_s
  assert first > 1.0 and second <= 0.25 * first, compile_s


def test_the_test_session_compiles_a_program_once_whoever_builds_it_and_wherever():
  """The session's cache (tests/conftest.py): not in the user's home, given to every process
  the tests start, and a program rebuilt from a new closure (as each Sampler and Learner
  builds its own) is loaded from it instead of compiled again."""
  cache_dir = jax.config.jax_compilation_cache_dir
  assert cache_dir and not cache_dir.startswith(os.path.expanduser("~") + os.sep + ".cache")
  assert sections.default_compile_cache_dir() == cache_dir  # the CLIs' default in the tests
  child = subprocess.run(
      [sys.executable, "-c", "import jax; from rlver_jax import sections; "
       "print(jax.config.jax_compilation_cache_dir, sections.default_compile_cache_dir())"],
      cwd=ROOT, env=processes.cpu_env(), capture_output=True, text=True, timeout=120)
  assert child.stdout.split() == [cache_dir, cache_dir], child.stderr[-2000:]

  events = []
  jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
  # A constant of this run's own: the first build cannot have been cached by an earlier run.
  unique = np.float32(uuid.uuid4().int % 10**6)

  def build():
    return jax.jit(lambda x: jnp.tanh(x * unique) + unique)

  x = np.arange(8, dtype=np.float32)  # on the host: no program of its own
  first = build()(x)
  assert events.count(CACHE_HITS) == 0 and events.count(CACHE_MISSES) == 1, events
  np.testing.assert_array_equal(build()(x), first)  # a new closure: JAX's memory cache misses
  assert events.count(CACHE_HITS) == 1 and events.count(CACHE_MISSES) == 1, events
