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
from rl import rollout as rollout_lib
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
  """The warm-up corpus's first reply of the profile's intention: it serves it fully (+20)."""
  return warmup_corpus()["replies"][profile.intention][0]


GARBLED = "Think about on."  # known words, but no sentence of the user's English: -10


@pytest.mark.parametrize("reply,natural", [
    ("I hear you. Go on.", True), ("Hmm, maybe.", True), ("Think of both sides", True),
    ("Tell me more, I am listening. Go on.", True),  # known sentences, joined
    ("", False), ("   ", False), ("listen", False), ("Okay.", False), ("sorry sorry sorry", False),
    ("ingthe xqzt listen", False), ("I am sorry itn.", False), (GARBLED, False),
    ("You are not your fault.", False), ("Maybe your friend scared.", False),
    ("Try a they change?", False), ("You handled actions were really good.", False),
    ("Think about the same the same the other way.", False), ("Go on. Go on.", False),
    ("我在听你说。", True), ("好好", False)])
def test_natural_language_check(reply, natural):
  """The user reads sentences of its English (every word trigram one it has read, no sentence
  twice); the garbled replies of earlier demo runs (issue 46) are not."""
  assert is_natural_language(reply) == natural


def test_the_scripted_user_reads_the_english_the_tiny_policy_learns():
  """sim_user/data/sentences_en.txt is the corpus's and the warm-up's lines as they are now
  (after editing either: python -m rlver_jax.tiny --user_sentences); each line reads."""
  with open(scripted.SENTENCES_EN) as f:
    assert f.read().splitlines() == tiny.user_sentences()
  for kind in warmup_corpus()["replies"].values():
    assert all(is_natural_language(reply) for reply in kind), kind


def test_the_user_counts_the_replies_it_cannot_read_and_the_rollout_their_share():
  user = user_for()
  [d] = user.start([DEMO[0]])
  for reply in (fitting_reply(DEMO[0]), GARBLED, GARBLED, "Do you have a minute?"):
    user.respond([d], [reply])
  assert user.metrics["sim/scripted/replies_judged"] == 4
  assert user.metrics["sim/scripted/replies_unreadable"] == 2
  before = {"sim/scripted/replies_judged": 1, "sim/scripted/replies_unreadable": 0}
  events = rollout_lib.simulator_events(user.metrics, before)
  assert events["sim/scripted/replies_judged"] == 3
  assert events["replies/garbled_rate"] == pytest.approx(100 * 2 / 3)


def test_key_words_are_whole_tokens_of_the_shipped_tokenizer_and_serve_one_intention_each():
  vocab = tiny.load_tokenizer().get_vocab()
  assert set(KEY_WORDS) == set(profiles.INTENTIONS)
  words = [w for pair in KEY_WORDS.values() for w in pair]
  assert len(set(words)) == len(words)
  for word in words:
    # One token, with its leading space (the user reads words case-blind).
    assert {"\u0120" + word, "\u0120" + word.capitalize()} & set(vocab), word
    assert any(word in trigram for trigram in scripted.KNOWN_TRIGRAMS), word


def test_the_user_hints_at_its_need_in_its_opening_and_every_reply_with_its_own_words():
  for profile in DEMO:
    hint = scripted.HINTS["en"][profile.intention]
    verdict = judge(hint, profile.intention, "vanilla")
    assert len(verdict.fits) >= 3 and not verdict.other_needs and verdict.natural, (profile.id,
                                                                                     hint)
    # +20 and -10 by turns (a fitting reply, one it cannot read): the user stays in between.
    d = play(profile, lambda turn: fitting_reply(profile) if turn % 2 else GARBLED)
    user_lines = [m["content"] for m in d.history if m["role"] == "user"]
    assert len(user_lines) == 10  # the opening and nine replies
    assert all(hint in line for line in user_lines), profile.id


def test_fit_encouragement_off_topic_miss_and_non_language_in_that_order():
  intention = "be_listened_to"
  fit = judge("Tell me more, I am listening.", intention, "vanilla").change
  encourage = judge("I am sorry.", intention, "vanilla").change
  again = judge("I am sorry.", intention, "vanilla", encouraged_before=True).change
  off_topic = judge("Do you have a minute?", intention, "vanilla").change
  another_need = judge("Maybe they were scared?", intention, "vanilla")
  # A missing phrase ("advice") and another need's word ("sure").
  miss = judge("I am not sure that advice works for someone like me.", intention, "vanilla")
  two_needs = judge("How are you feeling right now?", intention, "vanilla")
  garbled = judge("ingthe xqzt listen", intention, "vanilla").change
  assert (fit, encourage, again, off_topic, another_need.change, miss.change, two_needs.change,
          garbled) == (20, 5, -5, -5, -5, -10, -10, -10)
  assert another_need.other_needs == ["understand_others"] and miss.misses == ["advice"]
  assert two_needs.other_needs == ["deep_empathy", "not_my_fault"]
  assert judge("I am listening.", intention, "vanilla").change == 10  # one fitting phrase
  # Two fitting phrases, and "work" (advice): -5.
  assert judge("Tell me more about what happened at work today.", intention,
               "vanilla").change == 15


def test_the_reward_hack_scores_low_and_only_fitting_replies_succeed():
  hacks = ["sorry sorry sorry", "I am sorry.", "I understand you. You are not alone.",
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
  d = play(profile, lambda turn: fit if turn in (2, 4, 6) else "I am sorry.")
  assert d.emotions == [30, 35, 30, 50, 45, 65, 60, 80, 75, 70]
  assert d.end_reason == dynamics.MAX_TURNS
  # One fitting phrase a turn gets there too, in seven turns.
  one_fit = "I think I will go now."  # "think"
  assert judge(one_fit, profile.intention, "vanilla").change == 10, profile.intention
  d = play(profile, lambda turn: one_fit)
  assert d.emotion == 100 and d.agent_turns == 7


def test_the_challenging_user_neither_hints_nor_warms_to_encouragement():
  profile = DEMO[5]
  d = play(profile, lambda turn: "I am sorry.", variant="challenging")
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
  trainer.Trainer.from_config(config).run()
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
  texts = policy.sampler.batch.generate(
      prompts, SamplingParams(max_new_tokens=12, temperature=1.0),
      key=jax.random.key(0)).texts(policy.tokenizer, skip_special_tokens=True)
  assert np.mean([is_natural_language(t) for t in texts]) >= 0.9, texts
  served = {intention for t in texts for intention in profiles.INTENTIONS
            if judge(t, intention, "vanilla").change == 20}
  assert len(served) >= 6, texts
