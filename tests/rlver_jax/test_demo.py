"""The demo's scripted user rewards intention-aware replies and not the reward hack, and the
demo policy learns them."""

import collections
import json
import os

import jax
import numpy as np
import pytest

from configs import demo
from configs import eval as eval_config
from rlver_jax import eval as evaluator
from models.sampling import SamplingParams
from rlver_jax import metrics as metrics_lib
from models import pretrained
from rlver_jax import tiny, trainer
from sim_user import dynamics, profiles, templates
from sim_user.backends import scripted
from sim_user.backends.scripted import HINTS, KEY_WORDS, ScriptedBackend, is_natural_language, judge
from sim_user.simulator import SimulatedUser

DEMO = profiles.load_profiles(profiles.DEMO_PROFILES)
TRAIN_STEPS = 40  # of the demo's 80


def user_for(variant="vanilla"):
  return SimulatedUser(ScriptedBackend(), dynamics.RLVER_TRAIN,
                       templates.PromptSet.load(language="en", variant=variant))


def play(profile, reply_for_turn, variant="vanilla"):
  """A whole dialogue under the training rules; `reply_for_turn(turn)` gives each reply."""
  user = user_for(variant)
  [d] = user.start([profile])
  while not d.done:
    user.respond([d], [reply_for_turn(d.agent_turns)])
  return d


def fitting_reply(profile):
  first, second = KEY_WORDS[profile.intention][:2]
  return f"I {first} you, {second}."


@pytest.mark.parametrize("reply,natural", [
    ("I listen to you.", True), ("listen hear", True), ("Hmm, okay.", True),
    ("", False), ("   ", False), ("listen", False), ("sorry sorry sorry", False),
    ("sorry sorry understand", False), ("ingthe xqzt listen", False),
    ("我在听你说。", True), ("好好", False)])
def test_natural_language_check(reply, natural):
  assert is_natural_language(reply) == natural


def test_key_words_are_whole_tokens_of_the_shipped_tokenizer_and_serve_one_intention_each():
  vocab = tiny.load_tokenizer().get_vocab()
  assert set(KEY_WORDS) == set(profiles.INTENTIONS)
  words = [w for pair in KEY_WORDS.values() for w in pair]
  assert len(set(words)) == len(words)
  for word in words:
    # One token, with its leading space (the user reads words case-blind).
    assert {"\u0120" + word, "\u0120" + word.capitalize()} & set(vocab), word
    assert word in scripted.KNOWN_WORDS


def test_the_user_hints_at_its_need_in_its_opening_and_every_reply_with_its_own_words():
  for profile in DEMO:
    hint = scripted.HINTS["en"][profile.intention]
    verdict = judge(hint, profile.intention, "vanilla")
    assert len(verdict.fits) >= 3 and not verdict.other_needs and verdict.natural, (profile.id,
                                                                                     hint)
    first = KEY_WORDS[profile.intention][0]  # +10 and -5 by turns: the user stays in between
    d = play(profile, lambda turn: f"I {first} you." if turn % 2 else "Okay, I see.")
    user_lines = [m["content"] for m in d.history if m["role"] == "user"]
    assert len(user_lines) == 10  # the opening and nine replies
    assert all(hint in line for line in user_lines), profile.id


def test_fit_encouragement_off_topic_miss_and_non_language_in_that_order():
  intention = "be_listened_to"
  fit = judge("I listen and I hear you.", intention, "vanilla").change
  encourage = judge("I am sorry, I understand.", intention, "vanilla").change
  again = judge("I am sorry, I understand.", intention, "vanilla", encouraged_before=True).change
  off_topic = judge("Okay, I see.", intention, "vanilla").change
  another_need = judge("Why is that?", intention, "vanilla")
  miss = judge("You should get some advice.", intention, "vanilla").change  # its miss phrases
  two_needs = judge("Why not try a step?", intention, "vanilla")  # two other needs' words
  garbled = judge("ingthe xqzt listen", intention, "vanilla").change
  assert (fit, encourage, again, off_topic, another_need.change, miss, two_needs.change,
          garbled) == (20, 5, -5, -5, -5, -10, -10, -10)
  assert another_need.other_needs == ["understand_others"]
  assert two_needs.other_needs == ["get_advice", "understand_others"]
  assert judge("I am listening.", intention, "vanilla").change == 10  # one fitting phrase
  assert judge("I hear you. Why?", intention, "vanilla").change == 15  # another need: -5


def test_the_reward_hack_scores_low_and_only_fitting_replies_succeed():
  hacks = ["sorry sorry sorry", "I am sorry, I understand.", "I support you, it's okay.",
           "you you you you"]
  for profile in DEMO:
    for hack in hacks:
      assert play(profile, lambda turn: hack).emotion <= 35, (profile.id, hack)
    # Every intention's words at once serve no one.
    everything = " ".join(words[0] for words in KEY_WORDS.values())
    assert play(profile, lambda turn: everything).end_reason == dynamics.FAILURE
    d = play(profile, lambda turn: fitting_reply(profile))
    assert d.emotions == [30, 50, 70, 90, 100] and d.end_reason == dynamics.GOODBYE, profile.id
    # Another intention's fitting reply lets this user down, turn after turn.
    other = next(p for p in DEMO if p.intention != profile.intention)
    d = play(profile, lambda turn: fitting_reply(other))
    assert d.emotions == [30, 25, 20, 15, 10, 5] and d.end_reason == dynamics.GOODBYE  # it leaves


def test_success_needs_the_intention_served_turn_after_turn():
  profile = DEMO[0]
  fit = fitting_reply(profile)
  # Three fully fitting turns, encouragement (+5 once, then off topic) in between: not enough.
  d = play(profile, lambda turn: fit if turn in (2, 4, 6) else "I am sorry, I understand.")
  assert d.emotions == [30, 35, 30, 50, 45, 65, 60, 80, 75, 70]
  assert d.end_reason == dynamics.MAX_TURNS
  # One fitting phrase a turn gets there too, in seven turns.
  first = KEY_WORDS[profile.intention][0]
  d = play(profile, lambda turn: f"I {first} you.")
  assert d.emotion == 100 and d.agent_turns == 7


def test_the_challenging_user_neither_hints_nor_warms_to_encouragement():
  profile = DEMO[5]
  d = play(profile, lambda turn: "I am sorry, I understand.", variant="challenging")
  assert d.emotion < 10  # -5 a turn until the user leaves
  hint = scripted.HINTS["en"][profile.intention]
  assert not any(hint in m["content"] for m in d.history[1:] if m["role"] == "user")
  assert play(profile, lambda turn: fitting_reply(profile), "challenging").emotion == 100


def train_demo(workdir, steps, with_demo_init_policy):
  """The README's main command (shortened to `steps`); its metrics and replies table. It starts
  from the session's copy of the demo's warmed-up policy, the one it would write itself."""
  with_demo_init_policy(workdir)
  config = demo.get_config()
  config.workdir = str(workdir)
  config.mesh = {"data": 1, "fsdp": 1, "tensor": 1}  # one device, as the README's command runs
  config.steps = steps
  config.checkpoint.every = steps
  config.checkpoint.export_at_end = False
  trainer.Trainer(config).run()
  records = metrics_lib.read_appended_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert len(records) == steps
  with open(os.path.join(workdir, "replies_by_intention.json")) as f:
    return records, json.load(f)


def mean_of(rows, key):
  return float(np.mean([r[key] for r in rows]))


def learned_intentions(records, rise):
  """Intentions whose final emotion over the last 5 steps rose by `rise` over the first 5."""
  return [i for i in profiles.INTENTIONS
          if mean_of(records[-5:], f"emotion/final/{i}") >= mean_of(records[:5],
                                                                   f"emotion/final/{i}") + rise]


def assert_learns_intentions(records, replies, *, rise, success, learned_at_least):
  """Mean final emotion up by `rise`, success over the last 5 steps above `success`, and at
  least `learned_at_least` intentions up by 30, each most often told a reply that serves it
  (so the replies differ by intention)."""
  first, last = records[:5], records[-5:]
  assert mean_of(last, "emotion/final_mean") >= mean_of(first, "emotion/final_mean") + rise
  assert mean_of(last, "success_rate") > max(success, mean_of(first, "success_rate"))
  learned = learned_intentions(records, rise=30)
  assert len(learned) >= learned_at_least, [(i, [r[f"emotion/final/{i}"] for r in records])
                                            for i in profiles.INTENTIONS]
  for intention in learned:
    assert judge(replies[intention]["top"][0]["reply"], intention, "vanilla").change > 0, (
        intention, replies[intention])


@pytest.mark.heavy
def test_the_demo_learns_whom_to_offer_which_support(tmp_path, with_demo_init_policy):
  """Shortened: success and the emotion of several intentions rise, each served its own way.

  About 2.2 minutes on 2 cores with nothing beside it (131 s): 40 RL steps are the fewest in
  which the demo learns several intentions over its seed noise (its warm-up is the session's,
  shared)."""
  records, replies = train_demo(tmp_path, TRAIN_STEPS, with_demo_init_policy)
  assert_learns_intentions(records, replies, rise=30, success=40, learned_at_least=4)


@pytest.mark.heavy
@pytest.mark.slow
def test_the_whole_demo_reaches_the_issues_targets(tmp_path, with_demo_init_policy):
  """The README's main command as shipped: mean final emotion up by 30 or more, success above
  50% by its end, and most intentions served each their own way."""
  records, replies = train_demo(tmp_path, demo.get_config().steps, with_demo_init_policy)
  assert_learns_intentions(records, replies, rise=30, success=50, learned_at_least=5)


@pytest.mark.heavy
def test_eval_with_a_baseline_prints_before_and_after(tmp_path, capsys, tiny_checkpoint):
  checkpoint = tiny_checkpoint
  config = eval_config.get_config()
  config.policy.checkpoint = config.eval.baseline_checkpoint = checkpoint
  config.policy.dtype = "float32"
  config.workdir = str(tmp_path / "eval")
  config.eval.profiles = profiles.DEMO_PROFILES
  config.eval.limit = 2
  config.eval.max_new_tokens = 4
  config.sim_user.backend = "scripted"
  config.sim_user.language = "en"
  after = evaluator.evaluate_with_baseline(config)
  with open(tmp_path / "eval" / "baseline" / "summary.json") as f:
    before = json.load(f)
  assert before["n"] == after["n"] == 2 and before["score"] == after["score"]
  printed = capsys.readouterr().out
  assert f"before: {checkpoint}" in printed
  score_line = next(line for line in printed.splitlines() if line.startswith("score (mean"))
  assert score_line.split()[-2:] == [f"{after['score']:.1f}"] * 2
  assert sum(line.startswith("score: ") for line in printed.splitlines()) == 2  # 2 intentions


def warmup_corpus():
  with open(tiny.WARMUP) as f:
    return json.load(f)


def test_the_warmup_corpus_offers_every_kind_of_support_and_its_users_say_their_needs_their_way():
  """Each reply serves its own intention fully and lets every other down; small-talk lines
  hint at nothing; need lines name their own need only, in other words than the scripted
  user's hints; every reply fits the demo's reply length with its end-of-turn token."""
  corpus, tokenizer = warmup_corpus(), tiny.load_tokenizer()
  assert set(corpus["replies"]) == set(profiles.INTENTIONS) | {"encouragement"}
  for kind, replies in corpus["replies"].items():
    for reply in replies:
      assert len(tokenizer.encode(reply)) < demo.get_config().rollout.max_new_tokens, reply
      for intention in profiles.INTENTIONS:
        change = judge(reply, intention, "vanilla").change
        expected = 5 if kind == "encouragement" else 20 if kind == intention else -5
        assert change == expected if expected > 0 else change <= expected, (reply, intention)
  for line in corpus["user_lines"]:
    for intention in profiles.INTENTIONS:
      verdict = judge(line, intention, "vanilla")
      assert not (verdict.fits or verdict.other_needs or verdict.misses), (line, intention)
  assert set(corpus["need_lines"]) == set(profiles.INTENTIONS)
  for need, lines in corpus["need_lines"].items():
    for line in lines:
      assert not any(line in hint or hint in line for hint in HINTS["en"].values()), line
      assert judge(line, need, "vanilla").fits and not judge(line, need, "vanilla").other_needs


def test_warmup_dialogues_train_on_the_replies_and_their_end_of_turn_only():
  tokenizer = tiny.load_tokenizer()
  tokens_bt, reply_mask_bt = tiny.warmup_dialogues(tokenizer, "Be kind.", count=6, seed=0,
                                                   helpfulness=0.3)
  replies = {r for rs in warmup_corpus()["replies"].values() for r in rs}
  for tokens, mask in zip(tokens_bt, reply_mask_bt):
    text = tokenizer.decode(tokens[mask])
    said = text.split("<|im_end|>")
    assert said[-1] == "" and set(said[:-1]) <= replies, text
    assert tokenizer.decode(tokens[~mask]).startswith("<|im_start|>system\nBe kind.<|im_end|>")


def warmup_chats(helpfulness: float, count: int = 400) -> list[tuple[str | None, list[str]]]:
  """Each warm-up chat's need (from its opening line; None: small talk) and reply kinds."""
  corpus, tokenizer = warmup_corpus(), tiny.load_tokenizer()
  need_of = {line: need for need, lines in corpus["need_lines"].items() for line in lines}
  kind_of = {reply: kind for kind, replies in corpus["replies"].items() for reply in replies}
  tokens_bt, reply_mask_bt = tiny.warmup_dialogues(tokenizer, "", count=count, seed=1,
                                                   helpfulness=helpfulness)
  chats = []
  for tokens, mask in zip(tokens_bt, reply_mask_bt):
    opening = tokenizer.decode(tokens[~mask]).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    said = tokenizer.decode(tokens[mask]).split("<|im_end|>")[:-1]
    chats.append((need_of.get(opening), [kind_of[reply] for reply in said]))
  return chats


def test_the_warmup_serves_a_stated_need_as_often_as_its_helpfulness_says():
  """Helpfulness 1: every reply to a user with a need serves it; 0: kinds are uniform, needs
  are ignored; small talk always gets uniform kinds. Both kinds of chat occur."""
  for helpfulness, lowest, highest in ((1.0, 1.0, 1.0), (0.0, 0.0, 0.25), (0.3, 0.3, 0.5)):
    chats = warmup_chats(helpfulness)
    served = [kind == need for need, kinds in chats if need for kind in kinds]
    assert lowest <= np.mean(served) <= highest, (helpfulness, np.mean(served))
    small_talk = collections.Counter(kind for need, kinds in chats if need is None
                                     for kind in kinds)
    expected = sum(small_talk.values()) / 9
    assert len(small_talk) == 9 and 0.5 * expected < min(small_talk.values()) and (
        max(small_talk.values()) < 2 * expected), small_talk


@pytest.mark.heavy
def test_the_warmed_up_policy_speaks_every_kind_of_support_to_anyone(demo_init_policy):
  """RLVER starts from an instruct model: the demo's starts from one that writes sentences,
  of every kind, whoever it talks to (the RL run then learns whom to give which)."""
  policy = pretrained.load_policy(demo_init_policy)
  prompts = [policy.formatter.prompt_ids([{"role": "system", "content": "You are a caring listener."},
                                   {"role": "user", "content": p.first_talk}])
             for p in DEMO for _ in range(8)]
  texts = policy.sampler.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0),
                           key=jax.random.key(0)).texts(policy.tokenizer, skip_special_tokens=True)
  assert np.mean([is_natural_language(t) for t in texts]) >= 0.9, texts
  served = {intention for t in texts for intention in profiles.INTENTIONS
            if judge(t, intention, "vanilla").change == 20}
  assert len(served) >= 6, texts
