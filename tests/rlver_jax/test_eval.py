"""The Sentient Benchmark evaluator and its summary math."""

import json

import pytest

from configs import eval as eval_config
from infra.errors import UserInputError
from rl import rollout as rollout_lib
from rlver_jax import eval as evaluator
from rlver_jax import metrics as metrics_lib
from sim_user import dynamics, profiles, replay


def test_summary_math_on_the_recorded_benchmark(shared_data):
  expected = {"deepseek-v3-1227_result.jsonl": (37.55, 5, 39),
              "qwen2.5-72b_result.jsonl": (19.1, 4, 70), "claude3.7_result.jsonl": (54.8, 19, 24)}
  for name, (score, success, failure) in expected.items():
    with open(shared_data("sage", name)) as f:
      finals = [json.loads(line)["emo_point"] for line in f]
    summary = dynamics.summarize(finals)
    assert (summary["n"], summary["success_rate"], summary["failure_rate"]) == (100, success,
                                                                                failure)
    assert summary["score"] == pytest.approx(score)


def _write_profiles(path, cohort):
  path.write_text("".join(json.dumps({**p.__dict__, "cha_group": list(p.cha_group)}) + "\n"
                          for p in cohort))
  return str(path)


def _config(tmp_path, server, profile_file, checkpoint):
  config = eval_config.get_config()
  config.workdir = str(tmp_path / "eval")
  config.policy.checkpoint = checkpoint
  config.policy.dtype = "float32"
  config.mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  config.eval.profiles = str(profile_file)
  config.eval.max_new_tokens = 6
  config.eval.batch_size = 2
  config.sim_user.base_url = server.url
  config.sim_user.language = "en"
  config.sim_user.http_retries = 3
  config.sim_user.backoff_s = 0.01
  config.sim_user.timeout_s = 5.0
  return config


def _varied_demo_profiles():
  demo = profiles.load_profiles(profiles.DEMO_PROFILES)
  return [profiles.Profile(**{**p.__dict__, "player": p.player + " VARY"}) for p in demo]


def _count_collected(monkeypatch):
  """The ids of the profiles evaluate() runs dialogues for, in order."""
  ran, collect = [], rollout_lib.collect
  def counting(sampler, formatter, user, batch, *args, **kwargs):
    ran.extend(p.id for p in batch)
    return collect(sampler, formatter, user, batch, *args, **kwargs)
  monkeypatch.setattr(rollout_lib, "collect", counting)
  return ran


def _read_results(workdir):
  return [json.loads(line) for line in (workdir / "results.jsonl").read_text().splitlines()]


def test_results_with_a_lone_surrogate_are_written_and_read_back(tmp_path):
  records = [{"id": "a", "history": [{"role": "user", "content": "bad \ud800 text"}]}]
  evaluator._write_records(str(tmp_path / "results.jsonl"), records)
  assert metrics_lib.read_appended_jsonl(str(tmp_path / "results.jsonl")) == records


@pytest.mark.heavy
def test_evaluator_end_to_end_against_a_local_server(tmp_path, serve, monkeypatch, capsys,
                                                     tiny_checkpoint):
  server = serve(["500", "malformed"])  # every prompt fails twice before it is answered
  demo = profiles.load_profiles(profiles.DEMO_PROFILES)
  cohort = _varied_demo_profiles()[:3]
  cohort.append(profiles.Profile(**{**demo[0].__dict__, "id": "broken",
                                    "player": demo[0].player + " ALWAYS_500"}))
  config = _config(tmp_path, server, _write_profiles(tmp_path / "profiles.jsonl", cohort),
                   tiny_checkpoint)
  # 3 of 4 scored is fewer than the default eval.min_scored_share=0.9: an error, after the
  # results and summary are written.
  with pytest.raises(evaluator.EvaluationError, match=rf"scored 3 of 4 profiles.*{server.url}"):
    evaluator.evaluate(config)
  workdir = tmp_path / "eval"
  with open(workdir / "summary.json") as f:
    summary = json.load(f)
  printed = capsys.readouterr().out  # where it all is, also when the score does not count
  for name in ("results.jsonl", "summary.json", "emotion_trajectories.png", "final_scores.png"):
    assert f"{workdir / name}\n" in printed, name

  records = _read_results(workdir)
  assert [r["id"] for r in records] == [p.id for p in cohort]
  assert [r["failure"] is None for r in records] == [True, True, True, False]
  assert {"id", "emo_point", "emo_state", "history", "task", "player", "scene"} <= set(records[0])
  user_turns = [t for t in records[0]["history"] if t["role"] == "user" and "planning" in t]
  assert user_turns and {"content", "TargetCompletion", "activity", "analyse", "change"} == set(
      user_turns[0]["planning"])

  # The broken dialogue is listed, not scored.
  assert summary["n"] == 3 and summary["n_failed"] == 1
  assert summary["failed"][0]["id"] == "broken" and "http_500" in summary["failed"][0]["reason"]
  # Our summary equals a replay of our own results under the benchmark rules.
  scored = tmp_path / "scored.jsonl"
  scored.write_text("".join(json.dumps(r) + "\n" for r in records if r["id"] != "broken"))
  replayed = replay.replay_file(str(scored), dynamics.SAGE_BENCHMARK)
  assert replayed["mismatched_turns"] == 0
  assert replayed["score"] == pytest.approx(summary["score"])
  assert (replayed["success_rate"], replayed["failure_rate"]) == (summary["success_rate"],
                                                                  summary["failure_rate"])
  assert set(summary["by_intention"]) == {p.intention for p in cohort[:3]}
  assert summary["settings"]["temperature"] == 0.0 and summary["settings"]["rules"] == (
      "sage_benchmark")
  for name in ("emotion_trajectories.png", "final_scores.png"):
    assert (workdir / name).stat().st_size > 1000
  http_500s = summary["simulator_events"]["sim/backend_errors/http_500"]
  assert http_500s > 0 and summary["retries_succeeded"] == summary["simulator_events"].get(
      "sim/retries_succeeded", 0)

  # Rerun: the scored profiles are kept, only the failed one runs again (and fails again).
  config.eval.min_scored_share = 0.75
  ran = _count_collected(monkeypatch)
  rerun = evaluator.evaluate(config)
  assert ran == ["broken"]
  assert _read_results(workdir) == records  # the same records, in profile order
  assert (rerun["n"], rerun["n_failed"], rerun["score"]) == (3, 1, summary["score"])
  # Recomputed from the kept records, not from this run's turns (none scored): unchanged.
  for key in ("agent_turns_generated", "agent_turns_cut_off", "cut_off_rate"):
    assert rerun[key] == summary[key], key
  assert summary["cut_off_rate"] > 0  # 6 new tokens cut some of the tiny policy's replies
  assert rerun["simulator_events"]["sim/backend_errors/http_500"] == 2 * http_500s  # summed


def test_evaluator_resumes_after_a_kill_and_limit_runs_the_first_n(tmp_path, serve, monkeypatch,
                                                                    caplog, tiny_checkpoint):
  server = serve([])
  cohort = _varied_demo_profiles()
  config = _config(tmp_path, server, _write_profiles(tmp_path / "profiles.jsonl", cohort),
                   tiny_checkpoint)
  config.eval.limit = 2
  ran = _count_collected(monkeypatch)
  assert evaluator.evaluate(config)["n"] == 2
  workdir = tmp_path / "eval"
  first = _read_results(workdir)
  assert [r["id"] for r in first] == [p.id for p in cohort[:2]]
  with open(workdir / "results.jsonl", "a") as f:
    f.write('{"id": "' + cohort[2].id + '", "emo_p')  # killed while writing the third

  config.eval.limit = 3
  summary = evaluator.evaluate(config)
  assert "torn last line" in caplog.text
  assert ran == [p.id for p in cohort[:3]]  # each profile ran once
  assert _read_results(workdir)[:2] == first and summary["n"] == 3

  config.eval.max_new_tokens = 7  # a different evaluation in the same workdir
  with pytest.raises(UserInputError, match=r"eval.max_new_tokens: 6 -> 7"):
    evaluator.evaluate(config)


def test_a_training_workdir_given_as_the_checkpoint_points_to_its_export(tmp_path):
  from rlver_jax import builder
  config = eval_config.get_config()
  config.policy.checkpoint = str(tmp_path)
  (tmp_path / "checkpoints").mkdir()
  (tmp_path / "metrics.jsonl").write_text("")
  with pytest.raises(UserInputError, match=r"is a training workdir, not a checkpoint; it has "
                     r"not exported a policy yet .*export_at_end=True"):
    builder.inference_policy(config, None)
  (tmp_path / "export").mkdir()
  with pytest.raises(UserInputError, match=rf"use the policy it exported: "
                     rf"--config.policy.checkpoint={tmp_path}/export$"):
    builder.inference_policy(config, None)
