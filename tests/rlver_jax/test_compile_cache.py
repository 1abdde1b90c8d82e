"""The persistent compilation cache: a second run on the same machine loads its programs."""

import os
import subprocess
import sys

from configs import demo, eval as eval_config, retention
from tests import ROOT
from tests.rlver_jax.test_trainer import read_metrics


def test_every_config_caches_compiled_programs_per_user_by_default(monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", "/cache/home")
  assert demo.get_config().compile_cache_dir == "/cache/home/rlver_jax/xla"
  assert eval_config.get_config().compile_cache_dir == "/cache/home/rlver_jax/xla"
  assert retention.get_config().compile_cache_dir == "/cache/home/rlver_jax/xla"


def test_a_second_run_compiles_its_first_step_in_under_a_quarter_of_the_time(tmp_path):
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
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
