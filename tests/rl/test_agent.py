"""The agent layer: what each strategy feeds the sampler and what it keeps for training."""

import types

import jax
import pytest

from models.chat import ChatFormatter
from models.sampling import LENGTH, STOP, Completions, SamplingParams
from rl.agent import CachedDialogues, ThinkingTurns, agent_view
from rlver_jax import tiny
from sim_user import dynamics, profiles, templates
from sim_user.backends.scripted import ScriptedBackend
from sim_user.simulator import SimulatedUser

SYSTEM = "Be kind."
SAMPLING = SamplingParams(max_new_tokens=16)


class ScriptedBatch:
  """Stands in for the sampler's batch engine (the agent's calls): replies `reply_ids`, cut at
  the length limit on the first turn.

  Records what the agent feeds it; its conversations are plain objects with the
  real ones' row ids and reply ends.
  """

  def __init__(self, reply_ids, stop_id):
    self.reply_ids, self.stop_id = reply_ids, stop_id
    self.calls = []  # (row ids, tokens fed) per sampler call
    self.selections = []

  def start(self, num_rows, capacity=0, row_ids=None):
    return type("Convs", (), {"row_ids": list(row_ids), "reply_ended": [True] * num_rows})()

  def select(self, convs, rows):
    self.selections.append(list(rows))
    convs.row_ids = [convs.row_ids[r] for r in rows]
    convs.reply_ended = [convs.reply_ended[r] for r in rows]

  def extend(self, convs, new_tokens, params, key):
    out = self._replies(new_tokens, convs.row_ids)
    convs.reply_ended = out.ended
    return out

  def generate(self, prompts, params, key, row_ids):
    return self._replies(prompts, row_ids)

  def _replies(self, fed, row_ids):
    first_turn = not self.calls
    self.calls.append((list(row_ids), [list(t) for t in fed]))
    tokens = [self.reply_ids + ([] if first_turn else [self.stop_id]) for _ in fed]
    return Completions(tokens=tokens, logprobs=[[-0.5] * len(t) for t in tokens],
                       stop_reasons=[LENGTH if first_turn else STOP] * len(fed))


@pytest.fixture
def setup():
  tokenizer = tiny.load_tokenizer()
  formatter = ChatFormatter(tokenizer)
  user = SimulatedUser(ScriptedBackend(), dynamics.RLVER_TRAIN, templates.PromptSet.load())
  dialogues = user.start(profiles.load_profiles(profiles.DEMO_PROFILES)[:3])
  return tokenizer, formatter, user, dialogues


def test_cached_dialogues_feed_only_what_the_cache_lacks(setup):
  tokenizer, formatter, user, dialogues = setup
  reply = "I hear you, tell me more."
  stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
  batch = ScriptedBatch(tokenizer.encode(reply), stop_id)
  agent = CachedDialogues(types.SimpleNamespace(batch=batch), formatter, SYSTEM, SAMPLING,
                          row_ids=[10, 11, 12])
  first_prompts = [formatter.prompt_ids(agent_view(d, SYSTEM, raw_replies=True))
                   for d in dialogues]

  assert agent.act(dialogues, [0, 1, 2], jax.random.key(0)) == [reply] * 3
  user.respond(dialogues, [reply] * 3)
  dialogues[1].end_reason = "test"  # dialogue 1 leaves; the others go on
  assert agent.act(dialogues, [0, 2], jax.random.key(1)) == [reply] * 2

  assert batch.calls[0] == ([10, 11, 12], first_prompts)
  assert batch.selections == [[0, 2]]
  row_ids, fed = batch.calls[1]
  assert row_ids == [10, 12]
  for i, new_tokens in zip([0, 2], fed):
    # The first reply was cut at the length limit: the feed closes it before the user's turn.
    assert new_tokens[0] == stop_id
    view = agent_view(dialogues[i], SYSTEM, raw_replies=True)
    assert tokenizer.decode(first_prompts[i] + tokenizer.encode(reply) + new_tokens) == (
        formatter.render(view, add_generation_prompt=True))
  assert agent.agent_tokens == [2 * len(tokenizer.encode(reply)) + 1,
                                len(tokenizer.encode(reply)),
                                2 * len(tokenizer.encode(reply)) + 1]
  assert agent.metrics()["agent_turns/cut_off"] == 3

  for d in dialogues:
    d.end_reason = d.end_reason or "test"
  samples = agent.samples(dialogues, groups=[5, 5, 5], reward="final")
  assert [s.dialogue for s in samples] == [0, 1, 2]
  for sample, d in zip(samples, dialogues):
    assert sum(sample.loss_mask) == agent.agent_tokens[sample.dialogue]
    assert sample.token_rewards == [(len(sample.tokens) - 1, d.reward)]
    assert sample.group == 5


def test_thinking_turns_are_samples_of_their_own_and_hide_thoughts(setup):
  tokenizer, formatter, user, dialogues = setup
  stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
  thought_reply = "<think>she is sad</think>I hear you."
  batch = ScriptedBatch(tokenizer.encode(thought_reply), stop_id)
  agent = ThinkingTurns(types.SimpleNamespace(batch=batch), formatter, SYSTEM, SAMPLING,
                        row_ids=[0, 1, 2], format_penalty_reward=-1.0)

  assert agent.act(dialogues, [0, 1, 2], jax.random.key(0)) == [thought_reply] * 3
  user.respond(dialogues, [thought_reply] * 3)
  agent.act(dialogues, [0, 1, 2], jax.random.key(1))

  _, prompts = batch.calls[1]
  assert all("she is sad" not in tokenizer.decode(p) for p in prompts)
  assert prompts[0] == formatter.prompt_ids(agent_view(dialogues[0], SYSTEM, raw_replies=False))
  for d in dialogues:
    d.end_reason = "test"
  samples = agent.samples(dialogues, groups=[0, 0, 1], reward="final")
  assert len(samples) == 6  # two turns of three dialogues
  for k, sample in enumerate(samples):
    assert sample.dialogue == k % 3 and sample.group == [0, 0, 1][k % 3]
    assert sample.reward == dialogues[sample.dialogue].reward  # well formed: the dialogue's
    second_turn = k >= 3  # its reply ended on the stop token, which is trained on
    assert sum(sample.loss_mask) == len(tokenizer.encode(thought_reply)) + second_turn
  assert agent.metrics()["format_ok_rate"] == 100.0


def test_a_badly_formatted_thinking_turn_gets_the_format_penalty(setup):
  tokenizer, formatter, user, dialogues = setup
  batch = ScriptedBatch(tokenizer.encode("no thoughts here"),
                        tokenizer.convert_tokens_to_ids("<|im_end|>"))
  agent = ThinkingTurns(types.SimpleNamespace(batch=batch), formatter, SYSTEM, SAMPLING,
                        row_ids=[0, 1, 2], format_penalty_reward=-1.0)
  agent.act(dialogues, [0, 1, 2], jax.random.key(0))
  for d in dialogues:
    d.end_reason = "test"
  assert [s.reward for s in agent.samples(dialogues, [0, 1, 2], "final")] == [-1.0] * 3
  assert agent.metrics()["format_ok_rate"] == 0.0
