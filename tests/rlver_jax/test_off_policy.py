"""One-step off-policy overlap (`rollout.off_policy_steps=1`, rlver_jax/off_policy.py): which
weights sample each step, the behaviour policy's log-probs in the losses, a stop signal
during the rollout collected ahead, resume, an error in the background, the config checks."""

import json
import os
import signal
import threading
import time
import types

import jax
import numpy as np
import pytest

from bench.rollout import LatencyServer
from configs import demo, grpo, ppo
from infra.errors import UserInputError
from rl import advantages as advantages_lib
from rl import forward
from rl import rollout as rollout_lib
from rlver_jax import off_policy, preemption, run_config, sections, trainer
from tests import ROOT, cli_run
from tests.runs import NO_ROUTINE_SAVES, profiles_file, read_metrics, small_demo

OFF = {"rollout.off_policy_steps": 1}
BACKGROUND = "rollout-step-"  # the name of a background rollout's thread, before its step


def _record_collects(monkeypatch, before=None):
  """Records every `rollout.collect`: its thread, profiles and the sampler's weights; calls
  `before(record)` first, if given."""
  calls = []
  real = rollout_lib.collect

  def recording(sampler, formatter, user, profiles, config, key, **kwargs):
    record = {"thread": threading.current_thread().name, "profiles": [p.id for p in profiles],
              "weights": jax.device_get(sampler.weights.state), "finished": False}
    calls.append(record)
    if before is not None:
      before(record)
    out = real(sampler, formatter, user, profiles, config, key, **kwargs)
    record["finished"] = True
    return out

  monkeypatch.setattr(rollout_lib, "collect", recording)
  return calls


def _same_weights(a, b, dtype=None) -> bool:
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  cast = (lambda x: np.asarray(x)) if dtype is None else (
      lambda x: np.asarray(np.asarray(x).astype(dtype), np.float32))
  return len(leaves_a) == len(leaves_b) and all(
      np.array_equal(cast(x), np.asarray(y, np.float32) if dtype else np.asarray(y))
      for x, y in zip(leaves_a, leaves_b))


def _no_background_thread() -> bool:
  return not any(t.name.startswith(BACKGROUND) for t in threading.enumerate())


@pytest.mark.parametrize("steps_ahead, sampling_dtype, fsdp", [
    (0, "", 1),  # on-policy: each step samples with the weights it trains
    (1, "", 1),  # the sampler decodes from a copy of the training weights
    (1, "bfloat16", 2),  # its own bf16 copy, on a mesh of two devices (turns on the devices)
])
@pytest.mark.heavy
def test_each_rollout_is_sampled_with_the_weights_one_update_back(
    tmp_path, monkeypatch, steps_ahead, sampling_dtype, fsdp):
  config = small_demo(tmp_path, **{"rollout.off_policy_steps": steps_ahead,
                                   "rollout.sampling_dtype": sampling_dtype,
                                   "optim.warmup_steps": 0},  # update 1 changes the weights
                      mesh={"data": 1, "fsdp": fsdp, "tensor": 1})
  run = trainer.Trainer.from_config(config)
  assert run.turns.enabled == (steps_ahead and fsdp > 1)
  weights = [jax.device_get(run.models.policy.params)]  # weights[k]: after step k
  real_step = run.run_step

  def step_and_keep_weights():
    out = real_step()
    weights.append(jax.device_get(run.models.policy.params))
    return out

  run.run_step = step_and_keep_weights
  batches = []  # each step's training batch, with the rollout's log-probs
  real_advantages = advantages_lib.compute_advantages
  monkeypatch.setattr(advantages_lib, "compute_advantages",
                      lambda batch, cfg: batches.append(batch) or real_advantages(batch, cfg))
  calls = _record_collects(monkeypatch)
  run.run()

  assert all(not _same_weights(weights[k], weights[k + 1]) for k in range(3))
  sampled_with = [0, 1, 2] if steps_ahead == 0 else [0, 0, 1]  # step s: weights[s - 1] - lag
  for step, (call, k) in enumerate(zip(calls, sampled_with), start=1):
    assert _same_weights(weights[k], call["weights"], jax.numpy.bfloat16 if sampling_dtype
                         else None), (step, k)
    assert call["thread"] == ("MainThread" if step == 1 or not steps_ahead
                              else f"{BACKGROUND}{step}")
  records = read_metrics(tmp_path)
  assert [r["rollout/policy_lag"] for r in records] == [0, steps_ahead, steps_ahead]
  assert all(np.isfinite(r["pg_loss"]) for r in records)
  assert _no_background_thread()

  if sampling_dtype:  # the bf16 sampler's log-probs differ from fp32 ones as much as an update
    return
  # The losses' ratio is taken against the behaviour policy: step 3's old_logprobs_bt are
  # those of the weights that sampled it, not of the weights it trains.
  batch = batches[2]
  mask = batch.loss_mask_bt > 0
  logprobs = lambda params: np.asarray(forward.sequence_logprobs(
      run.models.policy.graphdef, jax.device_put(params), batch.model_inputs(),
      temperature=config.rollout.temperature))[mask]
  behaviour, trained = weights[sampled_with[2]], weights[2]
  np.testing.assert_allclose(batch.old_logprobs_bt[mask], logprobs(behaviour), atol=2e-4)
  if steps_ahead:
    assert np.abs(batch.old_logprobs_bt[mask] - logprobs(trained)).max() > 1e-2


@pytest.mark.heavy
@pytest.mark.parametrize("signal_lands_in", ["update", "wait"])
def test_a_stop_signal_during_the_rollout_collected_ahead_loses_nothing(
    tmp_path, monkeypatch, signal_lands_in):
  """SIGTERM from inside step 3's background rollout: while step 2's update runs, or while
  step 3 waits for that rollout. Step 2 is saved with its own data position, the rollout
  ahead is dropped, and the resumed run collects step 3 again with the same profiles."""
  config = small_demo(tmp_path, **OFF, **NO_ROUTINE_SAVES)
  config.steps = 4
  run = trainer.Trainer.from_config(config)
  waiting = threading.Event()  # the main thread waits for step 3's background rollout
  real_result = off_policy.BackgroundRollout.result
  monkeypatch.setattr(off_policy.BackgroundRollout, "result",
                      lambda self: (self.step == 3 and waiting.set()) or real_result(self))

  def signal_from_step_3(record):
    if record["thread"] != f"{BACKGROUND}3":
      return
    if signal_lands_in == "wait":
      assert waiting.wait(120)
      time.sleep(0.2)  # into the wait itself
    os.kill(os.getpid(), signal.SIGTERM)
    if signal_lands_in == "wait":  # held until the stop drops this rollout
      deadline = time.monotonic() + 120
      while run.rollouts.prefetch is not None and time.monotonic() < deadline:
        time.sleep(0.01)

  calls = _record_collects(monkeypatch, before=signal_from_step_3)
  with pytest.raises(preemption.Preempted, match=r"^SIGTERM: stopped at step 2/4; step 2's "
                     r"checkpoint is saved\. Run the same command again to resume"):
    run.run()
  assert [c["thread"] for c in calls] == ["MainThread", f"{BACKGROUND}2", f"{BACKGROUND}3"]
  if signal_lands_in == "wait":
    assert not calls[2]["finished"]  # cancelled at its next sampler or simulator call
  assert _no_background_thread()
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
  dropped_profiles = calls[2]["profiles"]
  monkeypatch.undo()

  resumed = trainer.Trainer.from_config(config)
  assert resumed.step == 2
  assert resumed.rollouts.position == 2 * config.batch_size  # step 2's, not the rollout ahead's
  again = _record_collects(monkeypatch)
  resumed.run()
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
  assert [c["thread"] for c in again] == ["MainThread", f"{BACKGROUND}4"]
  assert again[0]["profiles"] == dropped_profiles


@pytest.mark.heavy
def test_an_error_in_the_background_rollout_is_raised_in_the_main_thread(tmp_path, monkeypatch):
  config = small_demo(tmp_path, **OFF)
  config.steps = 4
  run = trainer.Trainer.from_config(config)

  def fail_in_step_3(record):
    if record["thread"] == f"{BACKGROUND}3":
      raise RuntimeError("simulator exploded in the background")

  _record_collects(monkeypatch, before=fail_in_step_3)
  with pytest.raises(RuntimeError, match="simulator exploded in the background"):
    run.run()
  assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
  assert "2" in os.listdir(tmp_path / "checkpoints")  # the steps before are kept
  assert _no_background_thread() and run.lock is None  # closed: the workdir is free


@pytest.mark.heavy
def test_sigterm_while_a_rollout_runs_ahead_exits_75_and_the_rerun_resumes(tmp_path):
  """The CLI, with an HTTP simulator slow enough that the rollout collected ahead is in
  flight when step 2 ends; stopped and run again (two start-ups, a slow simulator on purpose):
  about a minute on 2 cores."""
  server = LatencyServer([], latency_s=lambda prompt: 0.1)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  flags = [f"--config={ROOT}/configs/demo.py",
           f"--config.workdir={tmp_path / 'run'}", "--config.steps=4",
           "--config.batch_size=4", "--config.rollout.max_new_tokens=8",
           "--config.checkpoint.every=0", "--config.checkpoint.every_minutes=0",
           "--config.policy.tiny_warmup_steps=2", "--config.mesh.fsdp=1",
           "--config.rollout.off_policy_steps=1", "--config.sim_user.backend=openai",
           f"--config.sim_user.base_url={server.url}",
           "--config.sim_user.api_key_env=TEST_NO_KEY",
           f"--config.data.train_profiles={profiles_file(tmp_path / 'p.jsonl', ' VARY')}"]
  workdir = tmp_path / "run"
  try:
    _, before = cli_run.preempt(flags, workdir, stop_after=2, steps=4)
    finished = len(before)
    assert finished in (2, 3)

    cli_run.rerun(flags)
    after = read_metrics(workdir)
    assert [r["step"] for r in after] == [1, 2, 3, 4]
    assert after[:finished] == before
    assert [r["rollout/policy_lag"] for r in after] == [0, 1, 1, 1][:finished] + (
        [0] + [1] * (3 - finished))  # the resumed run's first step is collected anew
  finally:
    server.shutdown()


def _train_config(tmp_path, **rollout):
  config = ppo.get_config()
  config.workdir = str(tmp_path)
  config.policy.checkpoint = "/ckpt/qwen"
  config.data.train_profiles = "profiles.jsonl"
  config.sim_user.base_url = "http://sim:8000/v1"
  for key, value in rollout.items():
    config.rollout[key] = value
  return config


@pytest.mark.parametrize("engine", ["batch", "rows"])
def test_a_cancelled_background_rollout_stops_at_its_next_call_of_either_engine(engine):
  calls, called, go = [], threading.Event(), threading.Event()

  class Engine:
    def decode(self):
      calls.append(engine)

  def collect(sampler, user):
    getattr(sampler, engine).decode()
    called.set()
    go.wait()
    getattr(sampler, engine).decode()  # cancelled by now: raises
    return "finished"

  sampler = types.SimpleNamespace(batch=Engine(), rows=Engine())
  rollout = off_policy.BackgroundRollout(0, collect, sampler, None, off_policy.DeviceTurns(False),
                                         user_in_turns=False)
  assert called.wait(10)
  rollout.cancel(timeout_s=0)
  go.set()
  with pytest.raises(RuntimeError, match="cancelled"):
    rollout.result()
  assert calls == [engine]


def test_off_policy_steps_is_0_or_1_on_one_process_and_listed(tmp_path):
  for recipe in (ppo.get_config(), grpo.get_config(), demo.get_config()):
    assert recipe.rollout.off_policy_steps == 0  # the published protocol: on-policy
  sections.train_run(_train_config(tmp_path, off_policy_steps=1))
  with pytest.raises(UserInputError, match=r"rollout\.off_policy_steps=2: expected one of "
                     r"\(0, 1\)"):
    sections.train_run(_train_config(tmp_path, off_policy_steps=2))
  off_policy.check_supported(1, process_count=1)
  off_policy.check_supported(0, process_count=4)
  with pytest.raises(UserInputError, match=r"rollout\.off_policy_steps=1 runs in one process "
                     r"only \(this run has 2\).*--config\.rollout\.off_policy_steps=0"):
    off_policy.check_supported(1, process_count=2)
  listing = cli_run.run_module("rlver_jax.fields", f"--config={ROOT}/configs/ppo.py",
                               timeout=120)
  line = next(l for l in listing.stdout.splitlines() if l.startswith("rollout.off_policy_steps"))
  assert "0" in line and "updates the rollout runs ahead of training" in line


def test_a_run_saved_before_the_field_existed_resumes_on_policy_only(tmp_path):
  config = _train_config(tmp_path)
  run_config.check_and_save(config, str(tmp_path), resuming=False)
  saved = json.loads((tmp_path / "config.json").read_text())
  del saved["rollout"]["off_policy_steps"]  # as a run of an earlier version wrote it
  (tmp_path / "config.json").write_text(json.dumps(saved))
  run_config.check_and_save(config, str(tmp_path), resuming=True)  # 0: as that run was
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(UserInputError, match=r"rollout\.off_policy_steps: '\(absent\)' -> 1"):
    run_config.check_and_save(_train_config(tmp_path, off_policy_steps=1), str(tmp_path),
                              resuming=True)
