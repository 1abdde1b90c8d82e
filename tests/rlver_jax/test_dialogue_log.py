"""What the policy says: logged dialogues, replies per intention, where a run's outputs are."""

import io
import json
import math
import os

import pytest

from rlver_jax import dialogue_log
from rlver_jax import metrics as metrics_lib
from sim_user import dynamics, profiles, templates
from sim_user.backends.scripted import ScriptedBackend
from sim_user.simulator import SimulatedUser

DEMO = profiles.load_profiles(profiles.DEMO_PROFILES)


def make_user():
  return SimulatedUser(ScriptedBackend(), dynamics.RLVER_TRAIN,
                       templates.PromptSet.load(language="en"))


def test_dialogue_log_writes_dialogues_tensorboard_text_and_the_replies_table(tmp_path):
  log = dialogue_log.DialogueLog(str(tmp_path), every=2, count=2)
  user = make_user()
  replies = ["I am so sorry, that sounds painful.", "sorry sorry sorry", "Tell me more."]
  for step in (1, 2):
    dialogues = user.start(DEMO[:3])
    user.respond(dialogues, replies)
    log.observe(step, dialogues)
  records = [json.loads(line) for line in open(tmp_path / "dialogues.jsonl")]
  assert [r["step"] for r in records] == [1, 1, 2, 2]  # step 1 and logging steps, two each
  best, worst = records[2:]
  assert best["final_emotion"] >= worst["final_emotion"]  # best and worst of the step
  for record in records:
    user_turn = record["turns"][2]
    assert record["turns"][1]["role"] == "assistant" and user_turn["role"] == "user"
    assert user_turn["emotion"] == record["final_emotion"]
    assert "change" in user_turn["planning"] and record["reward"] == record["final_emotion"] / 100
    assert f"**policy:** {record['turns'][1]['content']}" in dialogue_log.dialogue_markdown(record)
  log.close()
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))
  table = log.replies_by_intention()
  assert table[DEMO[1].intention] == {"top": [{"reply": "sorry sorry sorry", "share": 1.0}],
                                      "replies": 2}
  text = dialogue_log.report_outputs(str(tmp_path), 2, 10, log, out=io.StringIO())
  assert "stopped at step 2/10" in text and "dialogues.jsonl" in text
  assert "sorry sorry sorry" in open(tmp_path / "replies_by_intention.md").read()


def test_interrupted_run_reports_where_its_outputs_are(tmp_path):
  out = io.StringIO()
  with pytest.raises(KeyboardInterrupt):
    try:
      raise KeyboardInterrupt
    finally:
      dialogue_log.report_outputs(str(tmp_path), 3, 10, out=out)
  assert "interrupted at step 3/10" in out.getvalue()


def test_only_the_primary_process_writes_dialogues(tmp_path):
  log = dialogue_log.DialogueLog(str(tmp_path), every=1, count=2, primary=False)
  user = make_user()
  dialogues = user.start(DEMO[:2])
  user.respond(dialogues, ["Tell me more.", "Tell me more."])
  log.observe(1, dialogues)
  assert log.write_table() is None and not os.listdir(tmp_path)


def read_logged_steps(workdir):
  return [json.loads(line)["step"] for line in open(workdir / "dialogues.jsonl")]


def observe_steps(log, steps):
  user = make_user()
  for step in steps:
    dialogues = user.start(DEMO[:2])
    user.respond(dialogues, ["Tell me more.", "Tell me more."])
    log.observe(step, dialogues)


def test_a_run_shorter_than_the_logging_interval_logs_its_first_step(tmp_path):
  observe_steps(dialogue_log.DialogueLog(str(tmp_path), every=20, count=1), [1, 2, 3])
  assert read_logged_steps(tmp_path) == [1]
  observe_steps(dialogue_log.DialogueLog(str(tmp_path / "never"), every=0), [1, 2])
  assert not os.path.exists(tmp_path / "never")


def test_a_resumed_run_logs_a_redone_step_once(tmp_path):
  observe_steps(dialogue_log.DialogueLog(str(tmp_path), every=2, count=1), [1, 2, 3, 4])
  with open(tmp_path / "dialogues.jsonl", "a") as f:
    f.write('{"step": 5, "turns": [')  # torn by the kill
  log = dialogue_log.DialogueLog(str(tmp_path), every=2, count=1, resume_step=2)
  assert read_logged_steps(tmp_path) == [1, 2]
  observe_steps(log, [3, 4])
  assert read_logged_steps(tmp_path) == [1, 2, 4]
  dialogue_log.DialogueLog(str(tmp_path), every=2, count=1)  # from scratch: nothing kept
  assert not os.path.exists(tmp_path / "dialogues.jsonl")


def test_reward_curve_has_whole_steps_and_percent_rates():
  records = [{"step": step, "reward/mean": 0.1 * step, "success_rate": 25.0 * step,
              "failure_rate": 100.0 - 25.0 * step} for step in range(1, 4)]
  fig = metrics_lib.curve_figure(records, "run", keys=metrics_lib.CURVE_KEYS + ("failure_rate",))
  fig.draw_without_rendering()  # sets the tick labels
  axes = {ax.get_ylabel(): ax for ax in fig.axes}
  steps = [label.get_text() for label in fig.axes[-1].get_xticklabels()]
  assert steps and all(text.isdigit() for text in steps), steps
  for key in ("success_rate", "failure_rate"):
    rates = [label.get_text() for label in axes[key].get_yticklabels()]
    assert rates and all(text.endswith("%") for text in rates), rates
  assert "%" not in "".join(label.get_text() for label in axes["reward/mean"].get_yticklabels())


def test_reward_curve_has_a_panel_of_final_emotion_per_intention(tmp_path):
  records = [{"step": step, "reward/mean": 0.1 * step, "success_rate": 10.0 * step,
              "emotion/final/get_advice": 10.0 * step, "emotion/final/be_praised": 5.0 * step}
             for step in range(1, 7)]
  panels = dict(metrics_lib.curve_panels(records))
  assert set(panels["final emotion by hidden intention"]) == {"get_advice", "be_praised"}
  assert "success_rate" in panels
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  assert metrics_lib.plot_curves(str(path), str(tmp_path / "curve.png"))
  assert os.path.getsize(tmp_path / "curve.png") > 0


def test_a_step_without_scored_dialogues_is_a_gap_in_the_curves_not_a_zero(tmp_path):
  records = [{"step": 1, "reward/mean": 0.1}, {"step": 2}, {"step": 3, "reward/mean": 0.3}]
  [(title, lines)] = metrics_lib.curve_panels(records, keys=("reward/mean",))
  steps, values = lines["reward/mean"]
  assert steps == [1, 2, 3] and values[0] == 0.1 and math.isnan(values[1]) and values[2] == 0.3
  assert metrics_lib.moving_mean([1.0, math.nan, 3.0, math.nan], 2) == [1.0, 1.0, 3.0, 3.0]
  assert math.isnan(metrics_lib.moving_mean([math.nan], 2)[0])


def test_the_summary_says_what_the_run_learned_first_steps_against_last():
  records = [{"step": s, "emotion/final_mean": 10.0 * s, "success_rate": 5.0 * s,
              "emotion/final/get_advice": 20.0 * s} for s in range(1, 13)]
  records[-1] = {"step": 12}  # no scored dialogue: left out of the means
  [overall, by_intention] = metrics_lib.learning_summary(records)
  assert overall == ("learned: final emotion 30.0 -> 95.0, success 15% -> 48% "
                     "(steps 1-5 against steps 8-12)")
  assert by_intention == "  final emotion by hidden intention: get_advice 60.0 -> 190.0"
  assert metrics_lib.learning_summary(records[:1]) == []
  assert metrics_lib.learning_summary(records[:2])[0].endswith("(step 1 against step 2)")
