"""The trainer end to end on the demo config: learning, resume after a kill, 8 devices."""

import os
import subprocess
import sys

import numpy as np
import pytest

from configs import demo, ppo, grpo
from rlver_jax import metrics as metrics_lib
from rlver_jax import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_demo(workdir, **overrides):
  config = demo.get_config()
  config.workdir = str(workdir)
  config.steps = 3
  config.batch_size = 4
  config.rollout.max_new_tokens = 8
  config.checkpoint.every = 1
  config.mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for name in parents:
      node = node[name]
    node[leaf] = value
  return config


def read_metrics(workdir):
  return metrics_lib.read_metrics(os.path.join(workdir, "metrics.jsonl"))


REQUIRED_METRICS = ("step", "reward/mean", "emotion/final_mean", "success_rate", "failure_rate",
                    "turns/mean", "response_len/mean", "kl", "entropy", "clip_frac", "value_loss",
                    "grad_norm", "time/rollout", "time/simulator", "time/train", "tokens_per_s")


def test_short_ppo_run_writes_metrics_checkpoints_plot_and_export(tmp_path, caplog):
  caplog.set_level("INFO")
  trainer.Trainer(small_demo(tmp_path)).run()
  assert sum("step 1 compiles" in m for m in caplog.messages) == 1  # not a silent wait
  records = read_metrics(tmp_path)
  assert [r["step"] for r in records] == [1, 2, 3]
  for key in REQUIRED_METRICS:
    assert all(np.isfinite(r[key]) for r in records), key
  assert records[0]["value_loss"] > 0
  assert os.path.exists(tmp_path / "reward_curve.png")
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3"]  # keep 2
  from models import qwen2
  exported = qwen2.from_pretrained(tmp_path / "export")
  assert exported.config.num_layers == 2
  assert os.path.exists(tmp_path / "export" / "tokenizer.json")


def test_grpo_and_thinking_modes_run(tmp_path):
  config = small_demo(tmp_path / "grpo", **{"rl.algorithm": "grpo",
                                            "rollout.samples_per_profile": 2})
  config.steps = 2
  trainer.Trainer(config).run()
  assert len(read_metrics(tmp_path / "grpo")) == 2
  think = small_demo(tmp_path / "think", **{"rollout.thinking": True, "rl.kl_coef": 0.01})
  think.steps = 2
  trainer.Trainer(think).run()
  records = read_metrics(tmp_path / "think")
  assert len(records) == 2
  # A random policy does not write <think>...</think>: every turn is badly formatted.
  assert records[0]["format_ok_rate"] == 0.0 and records[0]["reward/mean"] == 0.0
  assert records[0]["samples"] > 4  # one sample per agent turn


def test_killed_run_resumes_from_its_last_checkpoint(tmp_path):
  args = [sys.executable, "-m", "rlver_jax.main", f"--config={ROOT}/configs/demo.py",
          f"--config.workdir={tmp_path}", "--config.steps=4", "--config.batch_size=4",
          "--config.rollout.max_new_tokens=8", "--config.checkpoint.every=1",
          "--config.mesh.fsdp=1"]
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  first = subprocess.run(args + ["--config.crash_at_step=3"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
  assert first.returncode == -9, first.stderr[-2000:]
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
  second = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert second.returncode == 0, second.stderr[-2000:]
  assert "resumed from" in second.stderr and "at step 2" in second.stderr
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_eight_devices_match_one(tmp_path):
  one = small_demo(tmp_path / "one")
  eight = small_demo(tmp_path / "eight", mesh={"data": 2, "fsdp": 2, "tensor": 2})
  one.steps = eight.steps = 2
  eight.batch_size = one.batch_size = 8
  trainer.Trainer(one).run()
  trainer.Trainer(eight).run()
  a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "eight")
  for key in ("reward/mean", "emotion/final_mean", "turns/mean", "response_len/mean"):
    assert a[0][key] == b[0][key], key  # same weights, same seeds: the same dialogues
  for key in ("value_loss", "grad_norm", "entropy"):
    np.testing.assert_allclose(a[0][key], b[0][key], rtol=1e-3, err_msg=key)


def test_recipe_configs_carry_the_paper_settings():
  c = ppo.get_config()
  assert (c.batch_size, c.rollout.samples_per_profile, c.rollout.temperature) == (32, 1, 1.0)
  assert (c.optim.actor_lr, c.optim.critic_lr, c.rl.clip_ratio, c.rl.value_clip) == (
      1e-6, 5e-6, 0.2, 0.5)
  assert (c.rl.gamma, c.rl.lam, c.rl.entropy_coef, c.rl.kl_coef) == (1.0, 1.0, 0.001, 0.0)
  g = grpo.get_config("think")
  assert g.rl.algorithm == "grpo" and g.rollout.samples_per_profile == 4 and g.rollout.thinking
  with pytest.raises(ValueError, match="unknown config variant"):
    ppo.get_config("fast")


def test_missing_checkpoint_says_how_to_set_it(tmp_path):
  config = ppo.get_config()
  config.workdir = str(tmp_path)
  config.data.train_profiles = os.path.join(ROOT, "sim_user", "data", "demo_profiles.jsonl")
  config.mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  with pytest.raises(ValueError, match="--config.policy.checkpoint="):
    trainer.Trainer(config)


def test_demo_raises_final_emotion(tmp_path):
  """The embedded default learns: the README's promise, shortened to 30 steps."""
  config = demo.get_config()
  config.workdir = str(tmp_path)
  config.steps = 30
  config.checkpoint.every = 30
  config.checkpoint.export_at_end = False
  trainer.Trainer(config).run()
  emotion = [r["emotion/final_mean"] for r in read_metrics(tmp_path)]
  assert len(emotion) == 30
  assert np.mean(emotion[-5:]) >= np.mean(emotion[:5]) + 15, emotion
