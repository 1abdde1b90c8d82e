"""The trainer end to end on the demo config (its learning: tests/rlver_jax/test_demo.py): resume
after a kill, 8 devices; a dead simulator; metrics and config files across resumes. Its rooms
on their own: test_checkpoints.py, test_simulator_guard.py, test_rollout_source.py."""

import json
import os
import signal
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import ppo, grpo
from infra.errors import UserInputError
from rlver_jax import metrics as metrics_lib
from rlver_jax import run_config, simulator_guard, trainer
from sim_user import profiles as profiles_lib
from tests import ROOT, processes
from tests.runs import profiles_file, read_metrics, small_demo

REQUIRED_METRICS = ("step", "reward/mean", "emotion/final_mean", "success_rate", "failure_rate",
                    "turns/mean", "response_len/mean", "kl", "entropy", "clip_frac", "value_loss",
                    "grad_norm", "time/rollout", "time/simulator", "time/train", "tokens_per_s")


@pytest.mark.heavy
def test_short_ppo_run_writes_metrics_checkpoints_plot_and_export(tmp_path, caplog, capsys):
  caplog.set_level("INFO")
  # Per-turn rewards: the untrained policy's dialogues all end at emotion 0 (final reward 0),
  # but each of its turns still has an emotion change for the critic to fit.
  trainer.Trainer.from_config(
      small_demo(tmp_path, log_dialogues_every=2, **{"rl.reward": "turn"})).run()
  assert sum("step 1 compiles" in m for m in caplog.messages) == 1  # not a silent wait
  records = read_metrics(tmp_path)
  assert [r["step"] for r in records] == [1, 2, 3]
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["steps"] == 3
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
  # What the policy says: whole dialogues of step 2, its replies per hidden intention, and
  # where everything is, printed at the end.
  logged = [json.loads(line) for line in open(tmp_path / "dialogues.jsonl")]
  assert [r["step"] for r in logged] == [1, 1, 2, 2] and all(r["turns"] for r in logged)
  intentions = {p.intention for p in profiles_lib.load_profiles(profiles_lib.DEMO_PROFILES)}
  per_intention = {k.split("/")[-1] for k in records[-1] if k.startswith("emotion/final/")}
  assert len(per_intention) >= 2 and per_intention <= intentions  # 4 profiles a step
  table = json.load(open(tmp_path / "replies_by_intention.json"))
  assert len(table) >= 2 and set(table) <= intentions
  printed = capsys.readouterr().out
  assert "done: 3/3 steps" in printed and str(tmp_path / "export") in printed


@pytest.mark.heavy
def test_grpo_and_thinking_modes_run(tmp_path):
  """Three short runs (GRPO, thinking PPO, thinking GRPO), each compiling its own program
  set: about a minute on 2 cores."""
  config = small_demo(tmp_path / "grpo", **{"rl.algorithm": "grpo", "rl.reward": "final",
                                            "rollout.samples_per_profile": 2})
  config.steps = 2
  trainer.Trainer.from_config(config).run()
  grpo_records = read_metrics(tmp_path / "grpo")
  assert len(grpo_records) == 2
  for r in grpo_records:  # GRPO has no critic: its value metrics are absent, not 0
    assert np.isfinite(r["pg_loss"]) and "value_loss" not in r and "value_clip_frac" not in r
  think = small_demo(tmp_path / "think", **{"rollout.thinking": True, "rl.kl_coef": 0.01})
  think.steps = 2
  trainer.Trainer.from_config(think).run()
  records = read_metrics(tmp_path / "think")
  assert len(records) == 2
  # A random policy does not write <think>...</think>: every turn is badly formatted.
  assert records[0]["format_ok_rate"] == 0.0 and records[0]["reward/mean"] == 0.0
  assert records[0]["samples"] > 4  # one sample per agent turn


@pytest.mark.heavy
def test_killed_run_redoes_only_the_step_in_flight(tmp_path):
  args = [sys.executable, "-m", "rlver_jax.main", f"--config={ROOT}/configs/demo.py",
          f"--config.workdir={tmp_path}", "--config.steps=4", "--config.batch_size=4",
          "--config.rollout.max_new_tokens=8", "--config.checkpoint.every=1",
          "--config.mesh.fsdp=1", "--config.policy.tiny_warmup_steps=2"]
  env = processes.cpu_env()
  with open(tmp_path / "first.log", "w") as log:
    first = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=log)
    try:  # SIGKILL in step 3, once step 2 is logged and its checkpoint written
      processes.wait_until(lambda: (tmp_path / "checkpoints" / "2").is_dir() and
                           len(read_metrics(tmp_path)) >= 2, [first])
    finally:
      first.kill()
      first.wait()
  assert first.returncode == -signal.SIGKILL
  before = read_metrics(tmp_path)
  assert [r["step"] for r in before] == list(range(1, len(before) + 1)), before

  # The workdir's saved config refuses a different recipe, naming the field.
  with pytest.raises(UserInputError, match=r"rl.clip_ratio: 0.2 -> 0.3.*resume_mismatch_ok"):
    trainer.Trainer.from_config(small_demo(tmp_path, **{"rl.clip_ratio": 0.3}))

  second = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert second.returncode == 0, second.stderr[-2000:]
  resumed_at = int(second.stderr.split("resumed from")[1].split("at step ")[1].split()[0])
  assert resumed_at >= 2
  after = read_metrics(tmp_path)
  assert [r["step"] for r in after] == [1, 2, 3, 4]
  assert after[:resumed_at] == before[:resumed_at]  # steps before the checkpoint: kept, not redone


# Two steps whose dialogues all fail: the second stops the run (two in a row), or the run
# ends after them and is not done (it trained on none of its steps).
@pytest.mark.parametrize("steps,in_a_row,why", [
    (5, 2, r"in 2 steps in a row"), (2, 3, r"trained on 0 of the 2 steps this run ran")],
    ids=["down", "ended untrained"])
def test_dead_simulator_stops_training_without_an_update_or_export(tmp_path, serve, capsys,
                                                                   steps, in_a_row, why):
  server = serve([])
  config = small_demo(tmp_path / "run", **{
      "data.train_profiles": profiles_file(tmp_path / "profiles.jsonl", " ALWAYS_500"),
      "sim_user.backend": "openai", "sim_user.base_url": server.url, "sim_user.http_retries": 0,
      "sim_user.backoff_s": 0.01, "sim_user.timeout_s": 5.0, "sim_user.parse_retries": 0,
      "sim_user.max_failed_steps_in_a_row": in_a_row})
  config.steps = steps
  run = trainer.Trainer.from_config(config)
  initial = np.asarray(jax.tree.leaves(run.models.policy.params)[0])
  with pytest.raises(simulator_guard.SimulatorFailing, match=why) as error:
    run.run()
  assert server.url in str(error.value) and "http_500" in str(error.value)
  printed = capsys.readouterr()
  assert "sim_fail=4" in printed.err  # the progress bar
  assert "stopped by SimulatorFailing at step 2/" in printed.out  # not "run done"
  records = read_metrics(tmp_path / "run")
  assert [r["step"] for r in records] == [1, 2]
  assert all(r["untrained/simulator"] == 1 and "pg_loss" not in r and
             r["dialogues/simulator_failed"] + r["dialogues/dropped"] == 4 for r in records)
  # Nothing was scored: no reward or emotion (gaps in the curves), not zeros.
  assert not any(key in r for r in records for key in metrics_lib.CURVE_KEYS)
  np.testing.assert_array_equal(np.asarray(jax.tree.leaves(run.models.policy.params)[0]), initial)
  assert not (tmp_path / "run" / "export").exists()


def _tensorboard_points(workdir):
  """(tag, step) of every scalar in the TFRecord event files of `workdir`."""
  from tensorboardX.proto import event_pb2
  points = []
  for name in os.listdir(workdir):
    if not name.startswith(metrics_lib.TB_EVENTS_PREFIX):
      continue
    data = (workdir / name).read_bytes()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
      offset += 12 + length + 4
      points += [(value.tag, event.step) for value in event.summary.value]
  return points


def test_resume_drops_a_torn_line_and_tensorboard_keeps_one_point_per_step(tmp_path, caplog):
  writer = metrics_lib.MetricsWriter(str(tmp_path))
  for step in (1, 2, 3):
    writer.write(step, {"reward/mean": float(step)})
  writer.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 4, "reward/me')  # killed while writing step 4
  writer = metrics_lib.MetricsWriter(str(tmp_path), resume_step=2)  # the checkpoint had step 2
  assert "torn last line" in caplog.text
  for step in (3, 4):
    writer.write(step, {"reward/mean": 10.0 * step})
  writer.close()
  records = read_metrics(tmp_path)
  assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0),
                                                              (4, 40.0)]
  assert sorted(_tensorboard_points(tmp_path)) == [("reward/mean", s) for s in (1, 2, 3, 4)]


def test_a_resume_keeps_each_step_once_even_from_a_file_with_repeated_steps(tmp_path):
  # As two runs on one workdir left it before the workdir lock: 13, 13, 14, 14.
  (tmp_path / "metrics.jsonl").write_text("".join(
      json.dumps({"step": step, "run": run}) + "\n" for step, run in
      [(12, "a"), (13, "a"), (13, "b"), (14, "a"), (14, "b")]))
  metrics_lib.MetricsWriter(str(tmp_path), resume_step=14, tensorboard=False).close()
  assert [(r["step"], r["run"]) for r in read_metrics(tmp_path)] == [(12, "a"), (13, "b"),
                                                                     (14, "b")]


def test_a_corrupt_line_before_the_last_is_an_error_naming_it(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"st\n{"step": 3}\n')
  with pytest.raises(UserInputError, match=r"metrics.jsonl:2: not a JSON record"):
    metrics_lib.MetricsWriter(str(tmp_path), resume_step=3)


def test_reward_curve_has_a_panel_of_simulator_failures_and_retries(tmp_path):
  records = [{"step": 1, "reward/mean": 0.1, "dialogues/simulator_failed": 0,
              "dialogues/dropped": 0},
             {"step": 2, "reward/mean": 0.2, "dialogues/simulator_failed": 3,
              "dialogues/dropped": 1, "sim/retries": 5, "sim/retries_succeeded": 4}]
  panels = dict(metrics_lib.curve_panels(records))
  assert list(panels) == ["reward/mean", "simulator events per step"]
  assert panels["simulator events per step"] == {
      "dialogues/simulator_failed": ([1, 2], [0, 3]), "dialogues/dropped": ([1, 2], [0, 1]),
      "sim/retries": ([1, 2], [0, 5]), "sim/retries_succeeded": ([1, 2], [0, 4])}
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  out = metrics_lib.plot_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "curve.png"))
  assert os.path.getsize(out) > 1000


def test_resuming_with_a_different_config_is_refused_listing_the_fields(tmp_path):
  workdir = str(tmp_path)
  run_config.check_and_save(ppo.get_config(), workdir, resuming=False)
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["rl"]["algorithm"] == "ppo"
  extended = ppo.get_config()
  extended.steps, extended.checkpoint.every, extended.sim_user.base_url = 2000, 1, "http://b/v1"
  run_config.check_and_save(extended, workdir, resuming=True)  # allowed differences

  changed = ppo.get_config()
  changed.rl.algorithm, changed.policy.checkpoint = "grpo", "/ckpt/other"
  with pytest.raises(UserInputError) as error:
    run_config.check_and_save(changed, workdir, resuming=True)
  message = str(error.value)
  assert "rl.algorithm: 'ppo' -> 'grpo'" in message
  assert "policy.checkpoint: '' -> '/ckpt/other'" in message
  assert "steps:" not in message and "checkpoint.every" not in message
  assert "--config.resume_mismatch_ok=True" in message
  run_config.check_and_save(changed, workdir, resuming=False)  # a fresh run: no check
  changed.rl.algorithm = "ppo"
  changed.resume_mismatch_ok = True
  run_config.check_and_save(changed, workdir, resuming=True)  # the override
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["rl"]["algorithm"] == "ppo"


@pytest.mark.heavy
def test_eight_devices_match_one(tmp_path):
  """A step of two runs, one on 8 fake devices: on 2 cores the 8-device run's collectives are
  slow (a minute); the comparison is the test. One step: its dialogues and its update are
  what the two runs compare."""
  one = small_demo(tmp_path / "one")
  eight = small_demo(tmp_path / "eight", mesh={"data": 2, "fsdp": 2, "tensor": 2})
  one.steps = eight.steps = 1
  eight.batch_size = one.batch_size = 8
  trainer.Trainer.from_config(one).run()
  trainer.Trainer.from_config(eight).run()
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
    trainer.Trainer.from_config(config)
