"""The simulated user: profiles, templates, parser, dynamics, simulator, replay."""

import collections
import dataclasses
import json
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim_user import dynamics, parser, profiles, replay, templates
from sim_user.backends.base import BackendError
from sim_user.backends.scripted import ScriptedBackend, judge
from sim_user.jsonl import iter_jsonl
from sim_user.simulator import DROP, SIMULATOR_ERROR, SimulatedUser
from sim_user.thinking import split_thinking, strip_thinking

# Profiles.

def test_released_profiles_load_with_their_known_gaps(shared_data):
  train = profiles.load_profiles(shared_data("rlver", "train_profile.jsonl"))
  test = profiles.load_profiles(shared_data("rlver", "test_profile.jsonl"))
  assert (len(train), len(test)) == (500, 100)
  assert all(p.topic is None and p.first_talk is None for p in train)  # no topic, no opener
  assert all(p.first_talk for p in test)
  assert {p.intention for p in test} == set(profiles.INTENTIONS)
  assert all(p.intention for p in train) and test[0].language == "zh"


def test_demo_profiles_cover_every_intention_in_english():
  demo = profiles.load_profiles(profiles.DEMO_PROFILES)
  assert sorted(p.intention for p in demo) == sorted(profiles.INTENTIONS)
  assert all(p.language == "en" and p.first_talk for p in demo)


@pytest.mark.parametrize("line,message", [
    ('{"id": "a", "player": "p", "scene": "s", "main_cha": "m"}', "2: field 'task': missing"),
    ('{"id": "a", "player": "p", "scene": "s", "main_cha": "m", "task": 3}',
     "2: field 'task': must be a non-empty string"),
    ('{"id": "a", "player": "p", "scene": "s", "main_cha": "m", "task": "be praised", '
     '"cha_group": [1]}',
     "2: field 'cha_group': must be a list of strings"),
    ('{"id": "a", "player": "p", "scene": "s", "main_cha": "m", "task": "be praised", '
     '"first_talk": 5}',
     "2: field 'first_talk': must be a string"),
    ('{"id": "a", ', "2: invalid JSON"),
    # json's own message ends in "at" (the newline is the control character): "at" once.
    ('{"id": "a', "2: invalid JSON: Invalid control character at column 10"),
    ('["a"]', "2: expected a JSON object"),
])
def test_malformed_profile_lines_name_file_line_and_field(tmp_path, line, message):
  good = {"id": "ok", "player": "p", "scene": "s", "main_cha": "m", "task": "be praised"}
  path = tmp_path / "profiles.jsonl"
  path.write_text(json.dumps(good) + "\n" + line + "\n")
  with pytest.raises(profiles.ProfileError, match=re.escape(f"{path}:{message}")):
    profiles.load_profiles(str(path))


def test_duplicate_ids_and_missing_files_are_errors(tmp_path):
  good = json.dumps({"id": "x", "player": "p", "scene": "s", "main_cha": "m", "task": "be praised"})
  path = tmp_path / "dup.jsonl"
  path.write_text(good + "\n" + good + "\n")
  with pytest.raises(profiles.ProfileError, match="'x' appears twice"):
    profiles.load_profiles(str(path))
  with pytest.raises(profiles.ProfileError, match="no such file"):
    profiles.load_profiles(str(tmp_path / "none.jsonl"))


# Templates.

@pytest.mark.parametrize("language", ["en", "zh"])
@pytest.mark.parametrize("variant", ["vanilla", "challenging"])
def test_our_templates_load_and_keep_sage_sections(language, variant):
  prompts = templates.PromptSet.load(language=language, variant=variant)
  profile = profiles.load_profiles(profiles.DEMO_PROFILES)[0]
  text = prompts.render("planning", **prompts.profile_fields(profile), emotion="40",
                        emotion_state="B", history="-", agent_reply="hi",
                        target_header="TargetCompletion")
  for header in ("Content:", "TargetCompletion:", "Activity:", "Analyse:", "Change:"):
    assert header in text
  reply = prompts.render("reply", **prompts.profile_fields(profile), emotion="40",
                         emotion_state="B", state_meanings=prompts.state_meanings(),
                         state_guidance=prompts.state_guidance("B"), history="-",
                         target_header="TargetCompletion", target_completion="-", activity="-",
                         analyse="-")
  for header in ("Thinking:", "Origin:", "Change:", "Response:"):
    assert header in reply
  assert "Activity:" not in reply  # the fake server tells a planning prompt by this header
  assert prompts.variant_rules in text and profile.main_cha in text + reply
  # The release's rule: a reply that is not natural language is very negative.
  assert ("natural language" if language == "en" else "自然语言") in text


def test_a_bad_placeholder_in_a_user_template_names_the_file(tmp_path):
  for name in os.listdir(templates.DEFAULT_DIR):
    (tmp_path / name).write_text(open(os.path.join(templates.DEFAULT_DIR, name)).read())
  (tmp_path / "reply_en.txt").write_text("Hello $player, $mood")
  with pytest.raises(templates.TemplateError, match=r"reply_en.txt: unknown placeholder \$mood"):
    templates.PromptSet.load(str(tmp_path))
  with pytest.raises(templates.TemplateError, match="variant 'harsh'"):
    templates.PromptSet.load(variant="harsh")


# Parser.

PLANNING = """Let me think about this first.
**Content：** The NPC wants to comfort me.
[TargetCompletion]: partly, it misses what I want.
- Activity: 我觉得他没听懂。
The Analyse below
Analyse：有点失望。
Change：
[人物情绪变化]
－５
"""


def test_parser_tolerates_sage_style_noise():
  planning = parser.parse_planning(PLANNING)
  assert planning.change == -5
  assert planning.content == "The NPC wants to comfort me."
  # A header name inside a line, without a colon, is no header: it stays in the monologue.
  assert planning.activity == "我觉得他没听懂。\nThe Analyse below"
  assert planning.analyse == "有点失望。"
  assert parser.parse_planning(PLANNING.replace("[TargetCompletion]", "Reason")).change == -5
  reply = parser.parse_reply("Thinking: be curt\nOrigin: whatever\nChange: shorter\n"
                             "**Response**：“算了，再说吧。”")
  assert reply.response == "算了，再说吧。"


def test_numbered_and_colonless_headers():
  text = ("1. Content: comfort\n2) Reason: partly\n### 3. Activity\nhmm, fine\n**Analyse**\n"
          "not bad\n5、Change：\n+5")
  planning = parser.parse_planning(text)
  assert (planning.content, planning.target_completion, planning.activity, planning.analyse,
          planning.change) == ("comfort", "partly", "hmm, fine", "not bad", 5)
  assert parser.parse_reply("Thinking\nbe curt\n4. Response\n算了。").response == "算了。"


def test_planning_needs_only_change():
  planning = parser.parse_planning("Analyse: it helps\nChange: -5")
  assert (planning.change, planning.analyse, planning.content, planning.activity) == (
      -5, "it helps", "", "")
  with pytest.raises(parser.MissingSectionError) as err:
    parser.parse_planning("Content: x\nReason: y\nActivity: y\nAnalyse: z")
  assert err.value.section == "change"


@pytest.mark.parametrize("change_text", [
    "从40到35", "40 -> 35", "40到35", "-5 (40 → 35)", "+5 or +10", "-10~+10"])
def test_a_change_with_two_numbers_is_a_parse_error(change_text):
  with pytest.raises(parser.BadChangeError, match="instead of one emotion change"):
    parser.parse_change(change_text)
  with pytest.raises(parser.SimulatorParseError):
    parser.parse_planning(f"Content: x\nChange: {change_text}")


def test_a_change_of_thousands_of_digits_is_a_parse_error():
  with pytest.raises(parser.BadChangeError, match="emotion change of 5000 digits"):
    parser.parse_planning("Change: -" + "7" * 5000)
  assert parser.parse_change("-" + "9" * parser.MAX_CHANGE_DIGITS) == -int("9" * 6)


@pytest.mark.parametrize("change_text,value", [
    ("+10", 10), ("-10", -10), ("5", 5), ("＋５", 5), ("\u22125", -5), ("Change of -5 points", -5),
    ("[情绪变化]\n+5 (更放松了)", 5), ("-0", 0),
])
def test_change_values(change_text, value):
  assert parser.parse_change(change_text) == value


def test_missing_sections_raise_typed_errors():
  with pytest.raises(parser.BadChangeError):
    parser.parse_planning("Content: x\nReason: y\nActivity: y\nAnalyse: z\nChange: a lot")
  with pytest.raises(parser.MissingSectionError):
    parser.parse_reply("Thinking: only thinking")
  with pytest.raises(parser.MissingSectionError):
    parser.parse_reply("Response:   ")
  assert issubclass(parser.MissingSectionError, parser.SimulatorParseError)


_body = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r:："),
                min_size=1, max_size=40).filter(lambda s: s.strip().strip("*").strip())
_decorations = st.sampled_from(["{h}:", "{h}：", "**{h}:**", "**{h}**：", "[{h}]:", "【{h}】：",
                                "### {h}:", "- {h}:", "{h_lower}:", "1. {h}:", "2) {h}：",
                                "{h}\n", "**{h}**\n", "### 3. {h}\n"])


@settings(max_examples=200, deadline=None)
@given(bodies=st.lists(_body, min_size=4, max_size=4), change=st.integers(-10, 10),
       decoration=_decorations, prose=st.text(max_size=30).filter(lambda s: ":" not in s),
       plus=st.booleans())
def test_fuzzed_planning_round_trips(bodies, change, decoration, prose, plus):
  def header(name):
    return decoration.format(h=name, h_lower=name.lower())

  # Bodies are single lines that cannot be mistaken for a header.
  bodies = [" ".join(b.split()) or "x" for b in bodies]
  sign = "+" if plus and change >= 0 else ""
  text = "\n".join([prose.replace("\n", " "),
                    f"{header('Content')} {bodies[0]}", f"{header('TargetCompletion')} {bodies[1]}",
                    f"{header('Activity')} {bodies[2]}", f"{header('Analyse')} {bodies[3]}",
                    f"{header('Change')} {sign}{change}"])
  planning = parser.parse_planning(text)
  assert planning.change == change
  assert planning.content.strip("*").strip() == bodies[0].strip("*").strip()


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_parser_never_crashes_outside_its_error_types(text):
  for parse in (parser.parse_planning, parser.parse_reply):
    try:
      parse(text)
    except parser.SimulatorParseError:
      pass


# Dynamics.

def test_sage_benchmark_rules():
  r = dynamics.SAGE_BENCHMARK
  assert r.initial == 40
  assert dynamics.update(r, 40, 25) == 50  # clipped to +10
  assert dynamics.update(r, 95, 10) == 100  # capped
  assert dynamics.update(r, 12, -30) == 2
  assert dynamics.end_reason(r, 100, 3) == dynamics.SUCCESS
  assert dynamics.end_reason(r, 9.5, 3) == dynamics.FAILURE
  assert dynamics.end_reason(r, 10, 3) is None
  assert dynamics.end_reason(r, 50, 3, said_goodbye=True) == dynamics.GOODBYE
  assert dynamics.end_reason(r, 50, 9) is None
  # SAGE: the agent's 10th reply ends the dialogue before any judgement.
  assert not r.judge_last_reply and dynamics.last_reply_unjudged(r, 10)
  assert not dynamics.last_reply_unjudged(r, 9)


def test_rlver_train_rules():
  r = dynamics.RLVER_TRAIN
  assert r.initial == 30
  assert dynamics.update(r, 30, 25) == 55  # no clip
  assert dynamics.update(r, 30, -45) == -15
  assert dynamics.end_reason(r, 0, 2) == dynamics.FAILURE
  assert dynamics.end_reason(r, 1, 2) is None
  assert dynamics.end_reason(r, 100, 2) is None  # training does not stop at the top
  # The release's `turn_count > 8` check: the 9th reply is judged, then the dialogue ends.
  assert r.judge_last_reply and not dynamics.last_reply_unjudged(r, 9)
  assert dynamics.end_reason(r, 50, 8) is None
  assert dynamics.end_reason(r, 50, 9) == dynamics.MAX_TURNS
  paper = dynamics.with_max_agent_turns(r, 8)  # the paper's count
  assert dynamics.end_reason(paper, 50, 8) == dynamics.MAX_TURNS and paper.initial == 30
  assert dynamics.with_max_agent_turns(r, 0) is r
  with pytest.raises(ValueError, match="max_agent_turns"):
    dynamics.with_max_agent_turns(r, -1)


def test_rewards_and_states():
  assert dynamics.reward(-15) == 0.0 and dynamics.reward(80) == 0.8
  assert dynamics.turn_rewards([30, 40, 35]) == [0.1, -0.05]
  assert [dynamics.emotion_state(e) for e in (100, 70, 69, 40, 10, 9)] == list("SABBCF")
  assert dynamics.summarize([100, 5, 60]) == {"n": 3, "score": 55.0, "success_rate": 100 / 3,
                                              "failure_rate": 100 / 3}


# Thinking.

def test_thinking_split_and_strip():
  ok = split_thinking("<think>She wants praise.</think> You were brave.")
  assert ok.well_formed and ok.thought == "She wants praise." and ok.reply == "You were brave."
  for bad in ("You were brave.", "<think>unclosed", "<think>x</think>", "<think>a</think> b "
              "<think>c</think>"):
    assert not split_thinking(bad).well_formed
  assert strip_thinking("<think>secret</think>Hello") == "Hello"
  assert strip_thinking("Hi <think>never closed") == "Hi"


# Simulator with the scripted backend.

def demo(intention):
  return next(p for p in profiles.load_profiles(profiles.DEMO_PROFILES)
              if p.intention == intention)


def make_user(backend=None, rules=dynamics.RLVER_TRAIN, variant="vanilla", **kwargs):
  return SimulatedUser(backend or ScriptedBackend(), rules,
                       templates.PromptSet.load(language="en", variant=variant), **kwargs)


def test_fitting_replies_raise_emotion_and_missing_ones_lower_it():
  user = make_user()
  good, bad = user.start([demo("be_listened_to"), demo("be_listened_to")])
  assert good.history[0]["content"] == demo("be_listened_to").first_talk
  # Two fitting phrases or more +20; a missing one ("solution") and two other needs' key
  # words ("ask", advice; "did", not my fault) -15.
  for _ in range(3):
    user.respond([good, bad], ["Tell me more, I am listening.", "I did not ask for a solution."])
  assert good.emotions == [30, 50, 70, 90]
  assert bad.emotions == [30, 15, 0] and bad.end_reason == dynamics.FAILURE
  assert bad.reward == 0.0 and good.reward == pytest.approx(0.9)
  planning = good.history[2]["planning"]
  assert planning["change"] == 20 and "TargetCompletion" in planning


def test_thinking_is_hidden_from_the_simulator():
  user = make_user()
  [d] = user.start([demo("be_praised")])
  user.respond([d], ["<think>praise her</think> You did so well, I admire your courage."])
  assistant = [m for m in d.history if m["role"] == "assistant"][0]
  assert assistant["content"] == "You did so well, I admire your courage."
  assert "<think>" in assistant["raw_content"]


class CountingBackend(ScriptedBackend):
  """The scripted user, counting calls by kind and keeping the prompts."""

  def __init__(self):
    super().__init__()
    self.calls, self.prompts = collections.Counter(), []

  def complete(self, requests):
    self.calls.update(r.kind for r in requests)
    self.prompts += [r.prompt for r in requests]
    return super().complete(requests)


# To someone who wants praise: "well" +10, two other needs' words ("last"; "sleep", "night") -10.
NEUTRAL = "My girlfriend left last month and I still cannot sleep well at night."


def run_neutral_dialogue(rules):
  """A dialogue of replies whose fit and misses cancel out: only the turn limit ends it."""
  backend = CountingBackend()
  user = make_user(backend, rules=rules)
  [d] = user.start([demo("be_praised")])
  while not d.done:
    user.respond([d], [NEUTRAL])
  judged = [m for m in d.history if m["role"] == "user" and "planning" in m]
  return d, judged, backend


def test_sage_rules_end_with_the_10th_reply_unjudged():
  d, judged, backend = run_neutral_dialogue(dynamics.SAGE_BENCHMARK)
  assert d.end_reason == dynamics.MAX_TURNS and d.agent_turns == 10
  assert len(judged) == 9 and len(d.emotions) == 10
  assert d.history[-1] == {"role": "assistant", "content": NEUTRAL}
  assert backend.calls == {"planning": 9, "reply": 9}  # no call for the 10th reply


def test_training_rules_judge_the_release_s_9_replies_or_the_configured_count():
  d, judged, backend = run_neutral_dialogue(dynamics.RLVER_TRAIN)
  assert d.end_reason == dynamics.MAX_TURNS and d.agent_turns == 9 and len(judged) == 9
  assert d.history[-1]["role"] == "user" and backend.calls == {"planning": 9, "reply": 9}
  d, judged, _ = run_neutral_dialogue(dynamics.with_max_agent_turns(dynamics.RLVER_TRAIN, 8))
  assert d.agent_turns == 8 and len(judged) == 8


def test_recorded_sage_dialogues_end_with_10_replies_and_9_judged_turns(shared_data):
  """Every turn-limited recorded dialogue: 10 agent replies, 9 judged; our simulator, fed the
  recording, ends each of the 300 exactly where SAGE did."""
  turn_limited = 0
  for name in ("deepseek-v3-1227", "qwen2.5-72b", "claude3.7"):
    for _, record in iter_jsonl(shared_data("sage", f"{name}_result.jsonl")):
      history = record["history"]
      replies = sum(m["role"] == "assistant" for m in history)
      judged = sum(m["role"] == "user" and "planning" in m for m in history)
      if history[-1]["role"] == "assistant":  # the turn limit ended it, not the user
        turn_limited += 1
        assert (replies, judged) == (10, 9), record["id"]
      else:
        assert replies == judged <= 9, record["id"]
      assert replay.ends_as_recorded(record, dynamics.SAGE_BENCHMARK), record["id"]
  assert turn_limited == 56 + 25 + 57


def test_the_reply_call_gets_what_sage_gives_it():
  backend = CountingBackend()
  user = make_user(backend, rules=dynamics.SAGE_BENCHMARK)
  [d] = user.start([demo("be_listened_to")])
  user.respond([d], ["I am listening."])  # +10: 40 -> 50, state B
  planning, reply = backend.prompts
  judged = d.history[-1]["planning"]
  for text in (judged["TargetCompletion"], judged["activity"], judged["analyse"]):
    assert text and text in reply
  assert "TargetCompletion" in reply and templates.STATE_MEANINGS["en"]["B"] in reply
  for state in "SABCF":  # the meaning of every level, for the scale
    assert templates.STATE_MEANINGS["en"][state] in reply
  for rule in ("At most two questions", "passive, ask no questions", "Do not repeat",
               "do not change the subject abruptly", "Never state outright"):
    assert rule in reply, rule
  assert f"Personality type: {demo('be_listened_to').main_cha}" in reply
  assert "not natural language" in planning
  user = make_user(CountingBackend(), rules=dynamics.RLVER_TRAIN, target_header="Reason")
  [d] = user.start([demo("be_listened_to")])
  user.respond([d], ["I am listening."])
  assert "(Reason)" in user.backend.prompts[-1]


@pytest.mark.parametrize("text,goodbye", [
    ("Thanks, goodbye!", True), ("Bye.", True), ("好的，谢谢你，再见！", True), ("拜拜~", True),
    ("先这样吧，我再想想。", False), ("I see you care about this.", False),
    ("Farewell parties are the worst.", False), ("He lives in Byelorussia.", False)])
def test_goodbye_words_are_sage_s(text, goodbye):
  assert make_user().says_goodbye(text) == goodbye


def test_challenging_simulator_ignores_general_encouragement():
  assert judge("I support you.", "be_praised", "vanilla").change == 5
  assert judge("I support you.", "be_praised", "challenging").change == -5
  assert judge("You handled it so well.", "be_praised", "challenging").change == 20


def test_vanilla_hints_and_challenging_does_not():
  for variant, hints in (("vanilla", True), ("challenging", False)):
    user = make_user(variant=variant)
    [d] = user.start([demo("be_listened_to")])
    user.respond([d], ["You should get some advice."])
    assert ("listen and hear me out" in d.history[-1]["content"]) == hints


def test_sage_rules_end_on_success_with_a_goodbye():
  user = make_user(rules=dynamics.SAGE_BENCHMARK)
  [d] = user.start([demo("not_my_fault")])
  turns = 0
  while not d.done:
    user.respond([d], ["It was not your fault."])
    turns += 1
  assert d.emotion == 100 and d.end_reason == dynamics.SUCCESS and turns == 6
  assert user.metrics["sim/end/success"] == 1


class FlakyBackend:
  """Fails the first `failures` calls of each request kind per dialogue, then answers."""

  def __init__(self, failures, error=None):
    self.failures, self.error, self.seen, self.inner = failures, error, {}, ScriptedBackend()

  def complete(self, requests):
    out = []
    for r in requests:
      key = (r.profile.id, r.kind, r.turn)
      self.seen[key] = self.seen.get(key, 0) + 1
      if self.seen[key] <= self.failures.get(r.profile.id, 0):
        out.append(self.error or "no sections at all")
      else:
        out.append(self.inner.complete([r])[0])
    return out


def test_bounded_retries_then_end_failed():
  ids = [p.id for p in profiles.load_profiles(profiles.DEMO_PROFILES)[:3]]
  backend = FlakyBackend({ids[0]: 1, ids[1]: 99})
  user = make_user(backend, max_retries=2)
  dialogues = user.start(profiles.load_profiles(profiles.DEMO_PROFILES)[:3])
  user.respond(dialogues, ["I hear you."] * 3)
  recovered, broken, fine = dialogues
  assert not recovered.done and fine.failure is None
  assert broken.end_reason == SIMULATOR_ERROR and "unparsable planning" in broken.failure
  assert broken.reward == 0.0
  assert backend.seen[(ids[1], "planning", 1)] == 3  # 1 try + 2 retries, never more
  assert user.metrics["sim/failed_dialogues"] == 1
  assert user.metrics["sim/parse_errors/planning"] == 1 + 3
  # Planning: 2 retries for the broken one, 1 for the recovering one; its reply fails once too.
  assert user.metrics["sim/retries"] == 2 + 1 + 1
  assert user.metrics["sim/parse_errors/reply"] == 1
  user.respond(dialogues, ["I hear you."] * 3)  # the broken one is skipped
  assert len(broken.history) == 2


def test_drop_policy_and_backend_errors():
  p = profiles.load_profiles(profiles.DEMO_PROFILES)[0]
  backend = FlakyBackend({p.id: 99}, error=BackendError("http_500", "boom"))
  user = make_user(backend, max_retries=1, on_failure=DROP)
  [d] = user.start([p])
  user.respond([d], ["hi"])
  assert d.dropped and d.reward is None and "backend http_500" in d.failure
  assert user.metrics["sim/dropped_dialogues"] == 1
  assert user.metrics["sim/backend_errors/http_500"] == 2


def test_opening_turn_is_generated_without_first_talk():
  # Like RLVER's training profiles, which have no preset opening line.
  no_opener = [dataclasses.replace(p, first_talk=None)
               for p in profiles.load_profiles(profiles.DEMO_PROFILES)[:2]]
  user = make_user()
  dialogues = user.start(no_opener)
  assert all(d.history[0]["role"] == "user" and d.history[0]["content"] for d in dialogues)


# Replay of the recorded benchmark.

def write_recorded(path, dialogues_changes, rules=dynamics.SAGE_BENCHMARK):
  """A SAGE-format result file: one dialogue per list of recorded `Change:` values."""
  with open(path, "w") as f:
    for changes in dialogues_changes:
      emotion, history = rules.initial, []
      for change in changes:
        emotion = dynamics.update(rules, emotion, change)
        history += [{"role": "assistant", "content": "reply"},
                    {"role": "user", "content": "answer", "emotion-point": emotion,
                     "planning": {"content": "c", "TargetCompletion": "t", "activity": "a",
                                  "analyse": "n", "change": f"{change:+d}"}}]
      f.write(json.dumps({"history": history, "emo_point": emotion}) + "\n")
  return str(path)


def test_replay_reproduces_the_published_leaderboard(shared_data):
  expected = {"deepseek-v3-1227_result.jsonl": (37.55, 5, 39),
              "qwen2.5-72b_result.jsonl": (19.1, 4, 70),
              "claude3.7_result.jsonl": (54.8, 19, 24)}
  for name, (score, success, failure) in expected.items():
    result = replay.replay_file(shared_data("sage", name), dynamics.SAGE_BENCHMARK)
    assert result["n"] == 100
    assert result["score"] == pytest.approx(score)
    assert (result["success_rate"], result["failure_rate"]) == (success, failure)
    assert result["mismatched_turns"] == 0
    assert result["mismatched_ends"] == 0  # our simulator ends every dialogue where SAGE did


def test_replay_cli_prints_one_object_per_file(tmp_path, capsys):
  files = [write_recorded(tmp_path / "a.jsonl", [[5, 10], [-10, -10, -10, -5]]),
           write_recorded(tmp_path / "b.jsonl", [[10] * 6])]
  assert replay.main(files) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [line["file"] for line in lines] == files
  assert [(line["n"], line["score"], line["mismatched_turns"]) for line in lines] == [
      (2, 30.0, 0), (1, 100.0, 0)]
  assert set(lines[0]) == {"file", "n", "score", "success_rate", "failure_rate", "mismatched_turns",
                           "mismatched_ends"}


def test_replay_under_training_rules_differs(tmp_path):
  recorded = write_recorded(tmp_path / "r.jsonl", [[5, 30, -5]])  # under the benchmark's rules
  assert replay.replay_file(recorded, dynamics.SAGE_BENCHMARK)["mismatched_turns"] == 0
  result = replay.replay_file(recorded, dynamics.RLVER_TRAIN)
  assert result["mismatched_turns"] == 3 and result["score"] == 60  # starts at 30, unclipped


def test_replay_names_a_broken_record(tmp_path, capsys):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"history": [{"role": "user", "planning": {"change": "lots"}}]}) + "\n")
  assert replay.main([str(path)]) == 2
  assert f"{path}:1: history[0]" in capsys.readouterr().err


class OverreachingBackend:
  """A simulator that judges every reply `Change: +250` (or `-250`), then answers politely."""

  def __init__(self, change: str):
    self.change = change

  def complete(self, requests):
    return [f"Change:\n{self.change}\n" if r.kind == "planning" else "Response:\nI see."
            for r in requests]


@pytest.mark.parametrize("change,emotions", [("+250", [30, 40, 50]), ("-250", [30, 20, 10])])
def test_a_change_past_the_prompts_range_is_clamped_counted_and_warned_once(change, emotions,
                                                                             caplog):
  from rlver_jax import simulator_factory
  from sim_user.config import SimUserConfig
  cfg = SimUserConfig(base_url="http://127.0.0.1:9/v1", language="en")
  assert simulator_factory.make_simulated_user(cfg).max_change == 10  # the prompts' range
  user = make_user(OverreachingBackend(change), max_change=cfg.max_change)
  [d] = user.start([demo("be_listened_to")])
  for _ in range(2):
    user.respond([d], ["I hear you."])
  assert d.emotions == emotions and not d.done  # not 100 with reward 1.0 at the first reply
  assert d.history[-1]["planning"]["change"] == int(change)  # what it said, kept
  assert user.metrics["sim/change_clamped"] == 2
  warnings = [r for r in caplog.records if "sim/change_clamped" in r.getMessage()]
  assert len(warnings) == 1 and f"{int(change):+d}" in warnings[0].getMessage()


def test_the_scripted_users_own_changes_are_not_bounded_by_the_prompts_range():
  from rlver_jax import simulator_factory
  from sim_user.config import SimUserConfig
  cfg = SimUserConfig(backend="scripted", language="en")
  assert simulator_factory.make_simulated_user(cfg).max_change is None  # it moves up to +20


def test_profile_texts_past_the_budget_are_cut_and_reported_once_with_file_and_line(tmp_path,
                                                                                   caplog):
  profile = json.loads(open(profiles.DEMO_PROFILES).readline())
  long_opening = {**profile, "id": "long", "first_talk": "I " + "x" * 5_200_000}
  long_scene = {**profile, "id": "scene", "scene": "s" * 6000}
  path = tmp_path / "profiles.jsonl"
  path.write_text("\n".join(json.dumps(p) for p in (profile, long_opening, long_scene)) + "\n")
  as_given = profiles.load_profiles(str(path))
  assert len(as_given[1].first_talk) == 5_200_002 and not caplog.records
  kept, opening, scene = profiles.load_profiles(str(path), max_chars=4000)
  assert kept == as_given[0] and len(opening.first_talk) == len(scene.scene) == 4000
  assert opening.task == as_given[1].task and opening.intention == as_given[1].intention
  [warning] = [r.getMessage() for r in caplog.records]
  assert warning == (f"{path}: 2 text(s) longer than sim_user.max_message_chars=4000 cut to it: "
                     "line 2 'first_talk' (5200002 chars), line 3 'scene' (6000 chars)")


class RamblingBackend:
  """A simulator whose every reply (and opening) is `chars` long."""

  def __init__(self, chars: int):
    self.chars = chars

  def complete(self, requests):
    return ["Change:\n+5\n" if r.kind == "planning" else "Response:\n" + "w" * self.chars
            for r in requests]


def test_a_simulator_message_past_the_budget_is_cut_counted_and_warned_once(caplog):
  opener = dataclasses.replace(demo("be_listened_to"), first_talk=None)
  user = make_user(RamblingBackend(9000), max_message_chars=4000)
  [d] = user.start([opener])
  user.respond([d], ["I hear you."])
  assert [len(m["content"]) for m in d.history if m["role"] == "user"] == [4000, 4000]
  assert user.metrics["sim/messages_cut"] == 2
  assert len([r for r in caplog.records if "sim/messages_cut" in r.getMessage()]) == 1
  from rlver_jax import simulator_factory
  from sim_user.config import SimUserConfig
  assert simulator_factory.make_simulated_user(SimUserConfig(
      backend="scripted", language="en")).max_message_chars == 4000  # on by default
