"""The demo's scripted user rewards intention-aware replies and not the reward hack, and the
demo policy learns them."""

import pytest

from rlver_jax import tiny
from sim_user import dynamics, profiles, templates
from sim_user.backends import scripted
from sim_user.backends.scripted import KEY_WORDS, ScriptedBackend, is_natural_language, judge
from sim_user.simulator import SimulatedUser

DEMO = profiles.load_profiles(profiles.DEMO_PROFILES)


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


def test_the_user_names_its_key_words_in_its_opening_and_its_replies_and_no_one_else_s():
  for profile in DEMO:
    d = play(profile, lambda turn: "Okay, I see.")
    user_lines = [m["content"] for m in d.history if m["role"] == "user"]
    assert len(user_lines) == 10  # the opening and nine replies
    for line in user_lines:
      verdict = judge(line, profile.intention, "vanilla")
      assert set(verdict.fits) >= set(KEY_WORDS[profile.intention]), (profile.id, line)
      others = {w for key, words in KEY_WORDS.items() if key != profile.intention for w in words}
      assert not others & set(verdict.misses), (profile.id, line)
    assert is_natural_language(scripted.HINTS["en"][profile.intention])


def test_fit_encouragement_off_topic_miss_and_non_language_in_that_order():
  intention = "be_listened_to"
  fit = judge("I listen and I hear you.", intention, "vanilla").change
  encourage = judge("I am sorry, I understand.", intention, "vanilla").change
  again = judge("I am sorry, I understand.", intention, "vanilla", encouraged_before=True).change
  off_topic = judge("Okay, I see.", intention, "vanilla").change
  miss = judge("Why not try a step?", intention, "vanilla")  # another need's key words
  garbled = judge("ingthe xqzt listen", intention, "vanilla").change
  assert (fit, encourage, again, off_topic, miss.change, garbled) == (20, 5, 0, 0, -20, -10)
  assert set(miss.misses) == {"why", "try", "step"}
  assert judge("I am listening.", intention, "vanilla").change == 10  # one fitting phrase


def test_the_reward_hack_scores_low_and_only_fitting_replies_succeed():
  hacks = ["sorry sorry sorry", "I am sorry, I understand.", "I support you, it's okay.",
           "you you you you"]
  for profile in DEMO:
    for hack in hacks:
      assert play(profile, lambda turn: hack).emotion <= 35, (profile.id, hack)
    # Every key word of every intention at once misses as much as it fits.
    everything = " ".join(words[0] for words in KEY_WORDS.values())
    assert play(profile, lambda turn: everything).emotion <= 30
    d = play(profile, lambda turn: fitting_reply(profile))
    assert d.emotions == [30, 50, 70, 90, 100] and d.end_reason == dynamics.GOODBYE, profile.id
    # Another intention's fitting reply misses.
    other = next(p for p in DEMO if p.intention != profile.intention)
    assert play(profile, lambda turn: fitting_reply(other)).end_reason == dynamics.FAILURE


def test_success_needs_the_intention_served_turn_after_turn():
  profile = DEMO[0]
  fit = fitting_reply(profile)
  # Three fully fitting turns, encouragement and neutral replies in between: not enough.
  d = play(profile, lambda turn: fit if turn in (2, 4, 6) else "I am sorry, I understand.")
  assert d.emotion == 95 and d.end_reason == dynamics.MAX_TURNS
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
