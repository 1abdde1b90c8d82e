"""The Sentient Benchmark evaluator and its summary math."""

import json

import pytest

from configs import eval as eval_config
from rlver_jax import eval as evaluator
from rlver_jax import tiny
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


def test_evaluator_end_to_end_against_a_local_server(tmp_path, serve):
  server = serve(["500", "malformed"])  # every prompt fails twice before it is answered
  checkpoint = tmp_path / "policy"
  tiny.write_checkpoint(str(checkpoint), seed=3)
  demo = profiles.load_profiles(profiles.DEMO_PROFILES)[:3]
  cohort = [profiles.Profile(**{**p.__dict__, "player": p.player + " VARY"}) for p in demo]
  cohort.append(profiles.Profile(**{**demo[0].__dict__, "id": "broken",
                                    "player": demo[0].player + " ALWAYS_500"}))
  profile_file = tmp_path / "profiles.jsonl"
  profile_file.write_text("".join(json.dumps({**p.__dict__, "cha_group": list(p.cha_group)}) + "\n"
                                  for p in cohort))
  config = eval_config.get_config()
  config.workdir = str(tmp_path / "eval")
  config.policy.checkpoint = str(checkpoint)
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
  summary = evaluator.evaluate(config)

  workdir = tmp_path / "eval"
  records = [json.loads(line) for line in (workdir / "results.jsonl").read_text().splitlines()]
  assert [r["id"] for r in records] == [p.id for p in cohort]
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
  with open(workdir / "summary.json") as f:
    assert json.load(f)["score"] == summary["score"]
