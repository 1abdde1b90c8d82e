"""The row-level sampler against the batch sampler; the continuous rollout engine against
the lockstep one."""

import dataclasses
import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import partitioning, pretrained, qwen2
from models.row_programs import row_program_set
from models.sampler import Sampler
from models.sampling import SamplingParams, ladder
from rl import rollout as rollout_lib
from rl import engine
from rl.engine import rows_to_decode
from rl.rollout_config import RolloutConfig
from sim_user import dynamics, profiles, templates
from sim_user.backends.base import BackendError
from sim_user.backends.scripted import ScriptedBackend
from sim_user.simulator import SimulatedUser

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
CONFIG = qwen2.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2)
STOP = 9  # row 2 hits it on its 4th token, the others run to their budget


@pytest.fixture(scope="module")
def model():
  return qwen2.init_random(CONFIG, seed=0)


@pytest.fixture(scope="module")
def reference(model):
  return Sampler(model, stop_token_ids=[STOP])


@pytest.fixture(scope="module")
def row_sampler(model):
  """Chunks of 3 steps, prefills of 4 tokens and a 16-slot cache to start with: several
  chunks per reply and per prompt, growth."""
  return Sampler(model, stop_token_ids=[STOP], min_cache_bucket=16, decode_chunk_steps=3,
                 prefill_chunk=4)


def decode_all(sampler, rb, rows, params, width, key=None, row_ids=None):
  """Decodes `rows` to the end, `width` rows per chunk in rotation; returns tokens, logprobs."""
  row_id = dict(zip(rows, row_ids or rows))
  tokens, logprobs = {r: [] for r in rows}, {r: [] for r in rows}
  live = list(rows)
  while live:
    chosen = live[:width]
    chunk = sampler.rows.decode_rows(
        rb, chosen, [params.max_new_tokens - len(tokens[r]) for r in chosen], params,
        keys=None if key is None else [key] * len(chosen), row_ids=[row_id[r] for r in chosen],
        offsets=[len(tokens[r]) for r in chosen])
    for r, new, lp, finished in zip(chosen, chunk.tokens, chunk.logprobs, chunk.finished):
      tokens[r] += new
      logprobs[r] += lp
      live.remove(r)
      if not finished:
        live.append(r)  # to the back: the next chunk decodes other rows first
  return [tokens[r] for r in rows], [logprobs[r] for r in rows]


@pytest.mark.heavy
def test_rows_decoded_in_chunks_equal_the_batch_sampler(reference, row_sampler):
  expected = reference.batch.generate(PROMPTS, GREEDY)
  assert [len(t) for t in expected.tokens] == [10, 10, 4, 10]
  sampler = row_sampler
  rb = sampler.rows.start_rows(len(PROMPTS))
  sampler.rows.prefill_rows(rb, [2, 0], [PROMPTS[2], PROMPTS[0]])
  sampler.rows.prefill_rows(rb, [1, 3], [PROMPTS[1], PROMPTS[3]])
  tokens, logprobs = decode_all(sampler, rb, [0, 1, 2, 3], GREEDY, width=3)
  assert tokens == expected.tokens
  np.testing.assert_allclose(np.concatenate(logprobs), np.concatenate(expected.logprobs),
                             atol=1e-5)
  # Each row holds exactly its own tokens: the last one fed, the prompt and reply.
  assert rb.lengths[:4].tolist() == [len(p) + len(t) for p, t in zip(PROMPTS, tokens)]


def test_rows_continue_restart_and_match_a_full_forward_pass(model, reference, row_sampler):
  sampler = row_sampler
  rb = sampler.rows.start_rows(len(PROMPTS))
  sampler.rows.prefill_rows(rb, [0, 1, 2, 3], PROMPTS)
  turn1, _ = decode_all(sampler, rb, [0, 1, 2, 3], GREEDY, width=3)
  user = {3: [60, 61, 62], 1: [63]}
  # Rows 3 and 1 get a user turn at their own offsets (outgrowing the 16-slot cache); row 0
  # starts over with a new prompt, as a thinking-mode turn does; row 2 waits.
  sampler.rows.prefill_rows(rb, [3, 1], [user[3], user[1]])
  sampler.rows.prefill_rows(rb, [0], [[70, 71, 72]], restart=True)
  turn2, logprobs2 = decode_all(sampler, rb, [3, 1, 0], GREEDY, width=2)
  assert rb.capacity >= 32
  histories = [PROMPTS[3] + turn1[3] + user[3], PROMPTS[1] + turn1[1] + user[1], [70, 71, 72]]
  assert turn2 == reference.batch.generate(histories, GREEDY).tokens
  # The sampler's log-probs are those of one forward pass over the whole sequences.
  sequences = [h + r for h, r in zip(histories, turn2)]
  width = max(len(q) for q in sequences)
  ids_bt = np.array([q + [0] * (width - len(q)) for q in sequences], np.int32)
  mask_bt = np.arange(width)[None] < np.array([len(q) for q in sequences])[:, None]
  logp_btv = jax.nn.log_softmax(jax.jit(lambda i, m: model(i, attention_mask=m))(ids_bt, mask_bt))
  for b, (history, reply, logprobs) in enumerate(zip(histories, turn2, logprobs2)):
    steps = np.arange(len(history) - 1, len(history) + len(reply) - 1)
    np.testing.assert_allclose(logprobs, logp_btv[b, steps, reply], atol=1e-4)


def test_short_rows_in_a_long_cache_attend_over_their_own_bucket(model, reference):
  row_sampler = Sampler(model, stop_token_ids=[STOP], min_cache_bucket=16, decode_chunk_steps=3)
  long_prompt = list(range(30, 70))
  expected = reference.batch.generate([long_prompt, PROMPTS[1]], GREEDY)
  rb = row_sampler.rows.start_rows(2, capacity=256)
  row_sampler.rows.prefill_rows(rb, [0, 1], [long_prompt, PROMPTS[1]])
  assert rb.slot_levels == (16, 64, 256)
  # Row 1 alone: its chunks attend over 16 slots (its level), not the cache's 256.
  assert rb.slots_for(len(PROMPTS[1]) + 3) == 16 and rb.slots_for(len(long_prompt) + 3) == 64
  short, _ = decode_all(row_sampler, rb, [1], GREEDY, width=1)
  long, _ = decode_all(row_sampler, rb, [0], GREEDY, width=1)
  assert [long[0], short[0]] == expected.tokens


def test_sampled_rows_draw_the_batch_samplers_tokens(reference, row_sampler):
  params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20)
  key = jax.random.key(7)
  expected = reference.batch.generate(PROMPTS, params, key, row_ids=[4, 5, 6, 7])
  rb = row_sampler.rows.start_rows(len(PROMPTS))
  row_sampler.rows.prefill_rows(rb, [0, 1, 2, 3], PROMPTS)
  tokens, _ = decode_all(row_sampler, rb, [0, 1, 2, 3], params, width=3, key=key,
                         row_ids=[4, 5, 6, 7])
  assert tokens == expected.tokens


@pytest.mark.heavy
def test_rows_spread_unevenly_over_data_shards_equal_the_batch_sampler(model, reference):
  # 8 rows over 4 data shards (2 each): a call gathers each shard's rows on that shard, padding
  # shards that hold fewer of the chosen rows than others.
  mesh = partitioning.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sampler = Sampler(model, stop_token_ids=[STOP], mesh=mesh, min_cache_bucket=16,
                    decode_chunk_steps=3)
  prompts = PROMPTS + [p[::-1] for p in PROMPTS]
  expected = reference.batch.generate(prompts, GREEDY)
  rb = sampler.rows.start_rows(len(prompts))
  assert [rb.shard(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
  sampler.rows.prefill_rows(rb, [1, 0, 5], [prompts[1], prompts[0], prompts[5]])
  sampler.rows.prefill_rows(rb, [7, 2, 3, 4, 6], [prompts[r] for r in [7, 2, 3, 4, 6]])
  # 3 rows a chunk in rotation: some shards give two rows, some none.
  tokens, logprobs = decode_all(sampler, rb, list(range(8)), GREEDY, width=3)
  assert tokens == expected.tokens
  np.testing.assert_allclose(np.concatenate(logprobs), np.concatenate(expected.logprobs),
                             atol=1e-5)
  assert rb.lengths.tolist() == [len(p) + len(t) for p, t in zip(prompts, tokens)]
  # One row of one shard: the others pad (reading their last row), and write nothing back.
  sampler.rows.prefill_rows(rb, [5], [[60, 61, 62]])
  assert rb.lengths[5] == len(prompts[5]) + len(tokens[5]) + 3
  assert np.asarray(rb.cache.length).tolist() == rb.lengths.tolist()


def test_each_chunk_takes_as_many_rows_from_every_data_shard():
  # One shard: the largest width the decoding rows fill, longest-waiting first.
  one = lambda row: 0
  assert rows_to_decode([5, 3, 0, 1, 2, 4, 6, 7, 8], one, 1, (2, 8, 32)) == [5, 3, 0, 1, 2, 4, 6, 7]
  assert rows_to_decode([5, 3, 0], one, 1, (2, 8, 32)) == [5, 3]
  # Fewer rows than the narrowest width: all of them (the call pads).
  assert rows_to_decode([5], one, 1, (2, 8, 32)) == [5]
  # Two shards of 4 rows: shard 1 has 2 rows decoding, so 2 of each, none padding.
  two = lambda row: row // 4
  assert rows_to_decode([5, 0, 1, 6, 2, 3], two, 2, (2, 4, 8)) == [5, 0, 1, 6]
  assert rows_to_decode([4, 0, 5, 1, 6, 2, 7], two, 2, (2, 4, 8)) == [4, 0, 5, 1]
  # Shard 1 has none: shard 0's rows go, shard 1 pads.
  assert rows_to_decode([2, 0, 1], two, 2, (2, 4, 8)) == [2, 0]


@pytest.mark.heavy
@pytest.mark.parametrize("layout", ["decode", "train"])
def test_bf16_sampling_weights_refresh_without_recompiling(model, layout):
  mesh = partitioning.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  sampler = Sampler(model, stop_token_ids=[STOP], sampling_dtype=jnp.bfloat16, mesh=mesh,
                    sampling_layout=layout)
  weights = jax.tree.leaves(sampler.weights.state)
  assert all(x.dtype == jnp.bfloat16 for x in weights)
  assert any("tensor" in x.sharding.spec for x in weights)
  # decode: split over tensor, never over fsdp (no all-gather per token); train: as trained.
  assert any("fsdp" in str(x.sharding.spec) for x in weights) == (layout == "train")
  # decode: the copy's layers are a list, each layer's weights arrays of their own; train:
  # a stack, scanned, so each layer's FSDP all-gather lives one layer at a time.
  layers = nnx.merge(sampler.weights.graphdef, sampler.weights.state).backbone.layers
  assert isinstance(layers, nnx.List) == (layout == "decode")
  graphdef, state = nnx.split(model)
  cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), state)
  expected = Sampler(nnx.merge(graphdef, cast), stop_token_ids=[STOP]).batch.generate(
      PROMPTS, GREEDY)
  assert sampler.batch.generate(PROMPTS, GREEDY).tokens == expected.tokens
  rb = sampler.rows.start_rows(len(PROMPTS))
  sampler.rows.prefill_rows(rb, [0, 1, 2, 3], PROMPTS)
  assert decode_all(sampler, rb, [0, 1, 2, 3], GREEDY, width=4)[0] == expected.tokens

  other = qwen2.init_random(CONFIG, seed=1)
  sampler.weights.update(other)
  assert all(x.is_deleted() for x in weights)  # refreshed into the old copy's buffers
  compiled = sampler.batch._decode._cache_size(), len(sampler.rows._row_executables)
  refreshed = sampler.batch.generate(PROMPTS, GREEDY).tokens
  rb = sampler.rows.start_rows(len(PROMPTS))
  sampler.rows.prefill_rows(rb, [0, 1, 2, 3], PROMPTS)
  assert decode_all(sampler, rb, [0, 1, 2, 3], GREEDY, width=4)[0] == refreshed
  assert (sampler.batch._decode._cache_size(), len(sampler.rows._row_executables)) == compiled
  assert refreshed != expected.tokens
  # rollout.release_sampler_weights: the copy is freed while the update runs, and the next
  # refresh makes it anew, for the same programs.
  held = jax.tree.leaves(sampler.weights.state)
  sampler.weights.drop()
  assert sampler.weights.state is None and all(x.is_deleted() for x in held)
  sampler.weights.update(other)
  assert sampler.batch.generate(PROMPTS, GREEDY).tokens == refreshed
  assert (sampler.batch._decode._cache_size(), len(sampler.rows._row_executables)) == compiled


def test_row_programs_are_a_fixed_set_of_at_most_16():
  assert ladder(32, 4) == (2, 8, 32)
  assert ladder(8192, 4, 256) == (512, 2048, 8192)
  assert ladder(6, 4, 4, 4) == (4, 8)  # multiples of 4 data shards, at least one row each
  assert ladder(512, 4, 256) == (256, 512)
  for rows, capacity, shards in [(32, 8192, 1), (128, 16384, 8), (16, 1024, 2), (3, 256, 1)]:
    calls = row_program_set(rows, capacity, shards)
    assert len(calls) <= 12 and len(set(calls)) == len(calls)
    assert {c.capacity for c in calls} == {capacity}
    assert all(c.width % shards == 0 and c.width <= rows for c in calls)


# The continuous engine against the lockstep one, on a tiny chat model and the scripted user.

@pytest.fixture(scope="module")
def chat_policy(tiny_checkpoint):
  policy = pretrained.load_policy(tiny_checkpoint)
  # Larger random weights than the checkpoint's, so greedy replies do not repeat one token;
  # 40 of the 1024 tokens also end a reply, so replies end at different lengths, by stop
  # token or by budget, and dialogues at different turns.
  config = dataclasses.replace(policy.model.config, initializer_range=0.3)
  stops = list(policy.sampler.weights.stop_token_ids) + list(range(100, 140))
  sampler = Sampler(qwen2.init_random(config, seed=3), stop_token_ids=stops,
                    pad_id=policy.sampler.weights.pad_id, decode_chunk_steps=4)
  return sampler, policy.formatter, profiles.load_profiles(profiles.DEMO_PROFILES)[:3]


def make_user(backend=None):
  return SimulatedUser(backend or ScriptedBackend(), dynamics.RLVER_TRAIN,
                       templates.PromptSet.load(language="en", variant="vanilla"))


def both_engines(chat_policy, user_factory=make_user, reward="final", **config):
  sampler, formatter, demo = chat_policy
  config = RolloutConfig(system_prompt="", max_new_tokens=12, temperature=0.0, **config)
  return [rollout_lib.collect(sampler, formatter, user_factory(), demo, dataclasses.replace(
      config, engine=engine), jax.random.key(1), reward=reward)
          for engine in ("lockstep", "continuous")]


def assert_same_rollouts(lockstep, continuous):
  assert [d.history for d in continuous.dialogues] == [d.history for d in lockstep.dialogues]
  assert [d.end_reason for d in continuous.dialogues] == [d.end_reason for d in lockstep.dialogues]
  for a, b in zip(lockstep.samples, continuous.samples, strict=True):
    assert (b.tokens, b.loss_mask, b.group, b.dialogue, b.reward, b.token_rewards) == (
        a.tokens, a.loss_mask, a.group, a.dialogue, a.reward, a.token_rewards)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)


@pytest.mark.heavy
def test_continuous_dialogues_equal_lockstep_turn_for_turn(chat_policy):
  # GRPO groups of 2, per-turn rewards, dialogues ending at different turns: the demo user
  # cannot read this random policy's replies (-10 each: failure at the third), and the
  # 20-token budget ends four of the six at their second reply (with the shipped tokenizer).
  lockstep, continuous = both_engines(chat_policy, samples_per_profile=2, reward="turn",
                                      max_dialogue_tokens=20)
  assert_same_rollouts(lockstep, continuous)
  assert len({d.agent_turns for d in lockstep.dialogues}) > 1, [
      (sum(s.loss_mask), s.token_rewards) for s in lockstep.samples]
  assert 0 < lockstep.metrics["agent_turns/cut_off"] < lockstep.metrics["agent_turns/generated"]
  assert continuous.metrics["rollout/slot_efficiency"] == 1.0  # no padding row, no tail
  assert lockstep.metrics["rollout/slot_efficiency"] < 1.0


@pytest.mark.heavy
def test_continuous_thinking_turns_equal_lockstep(chat_policy):
  lockstep, continuous = both_engines(chat_policy, thinking=True, max_dialogue_tokens=24)
  assert_same_rollouts(lockstep, continuous)
  assert len(lockstep.samples) == lockstep.metrics["agent_turns/generated"] > len(
      lockstep.dialogues)  # every turn a sample, and some dialogue took more than one


class SlowForOne(ScriptedBackend):
  """A server-like backend (it has max_concurrency): one profile's calls fail, and with
  `hold_for` set they first hang until the other dialogues made that many calls."""

  max_concurrency = 4

  def __init__(self, slow_profile):
    super().__init__()
    self.slow_profile, self.hold_for = slow_profile, None
    self.calls, self.others_went_on = 0, None
    self.progress = threading.Condition()

  def complete(self, requests):
    if any(r.profile.id == self.slow_profile for r in requests):
      if self.hold_for is not None:
        with self.progress:
          self.others_went_on = self.progress.wait_for(lambda: self.calls >= self.hold_for,
                                                       timeout=120)
      return [BackendError("timeout") for _ in requests]
    out = super().complete(requests)
    with self.progress:
      self.calls += len(requests)
      self.progress.notify_all()
    return out


def test_a_slow_failing_simulator_call_does_not_hold_up_other_dialogues(chat_policy):
  sampler, formatter, demo = chat_policy
  config = RolloutConfig(system_prompt="", max_new_tokens=12, temperature=0.0, max_dialogue_tokens=24)
  backend = SlowForOne(demo[0].id)
  first = rollout_lib.collect(sampler, formatter, make_user(backend), demo, config, jax.random.key(1))
  # Again, the failing call now hanging until the others made every call they made before.
  backend.hold_for, backend.calls = backend.calls, 0
  rollout = rollout_lib.collect(sampler, formatter, make_user(backend), demo, config, jax.random.key(1))
  assert backend.others_went_on  # the other dialogues ran to their end meanwhile
  slow, *others = rollout.dialogues
  assert slow.end_reason == "simulator_error" and slow.agent_turns == 1
  assert all(d.agent_turns > 1 and d.end_reason != "simulator_error" for d in others)
  assert [d.history for d in rollout.dialogues] == [d.history for d in first.dialogues]


class AnswersInRandomOrder(ScriptedBackend):
  """A server-like backend that answers each call after a random delay, so each rollout
  meets its own order of user turns."""

  max_concurrency = 8

  def __init__(self, seed):
    super().__init__()
    self.rng, self.lock = random.Random(seed), threading.Lock()

  def complete(self, requests):
    with self.lock:
      delay = self.rng.uniform(0.0, 0.05)
    time.sleep(delay)
    return super().complete(requests)


COMPILED = []  # programs XLA compiled while a test records (see `compiled_during`)


def _count_compile(event, seconds, **kwargs):
  if event == "/jax/core/compile/backend_compile_duration" and COMPILED:
    COMPILED[-1] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compiled_during(fn):
  COMPILED.append(0)
  try:
    fn()
    return COMPILED[-1]
  finally:
    COMPILED.pop()


@pytest.mark.heavy
def test_the_engine_compiles_its_fixed_program_set_once_whatever_the_order(chat_policy):
  chat, formatter, demo = chat_policy
  sampler = Sampler(nnx.merge(chat.weights.graphdef, chat.weights.state),
                    stop_token_ids=chat.weights.stop_token_ids, pad_id=chat.weights.pad_id,
                    decode_chunk_steps=4)
  config = RolloutConfig(system_prompt="", max_new_tokens=12, temperature=1.0,
                         max_dialogue_tokens=30, samples_per_profile=2)
  rollouts = []
  collect = lambda seed: rollouts.append(rollout_lib.collect(
      sampler, formatter, make_user(AnswersInRandomOrder(seed)), demo, config,
      jax.random.key(seed)))
  first = compiled_during(lambda: collect(0))
  assert len(sampler.rows._row_executables) == len(row_program_set(6, sampler.rows.row_capacity, 1))
  assert first <= 16
  # Other answers in another order, other sampled replies: nothing new to compile.
  assert compiled_during(lambda: collect(1)) == 0
  assert [d.history for d in rollouts[0].dialogues] != [d.history for d in rollouts[1].dialogues]


def test_rows_start_with_room_for_a_dialogue_but_not_for_an_unbounded_budget():
  from rl.engine import row_capacity
  # The recipes: the opening, the 10,000-token budget and one more 5,000-token reply.
  assert row_capacity(RolloutConfig(max_dialogue_tokens=10000, max_new_tokens=5000), 700) == 16384
  # Evaluation has no budget (10**9): rows start at room for 8,192 agent tokens and grow.
  assert row_capacity(RolloutConfig(max_dialogue_tokens=10**9, max_new_tokens=1024), 300) == 16384
  assert row_capacity(RolloutConfig(max_dialogue_tokens=25, max_new_tokens=12), 40) == 128


class Slow(ScriptedBackend):
  """A server-like backend whose every call takes `seconds`."""

  max_concurrency = 4

  def __init__(self, seconds):
    super().__init__()
    self.seconds = seconds

  def complete(self, requests):
    time.sleep(self.seconds)
    return super().complete(requests)


def test_a_rollout_waiting_on_a_slow_simulator_says_so(chat_policy, monkeypatch, caplog):
  sampler, formatter, demo = chat_policy
  monkeypatch.setattr(engine, "WAIT_REPORT_S", 0.05)
  config = RolloutConfig(system_prompt="", max_new_tokens=12, temperature=0.0,
                         max_dialogue_tokens=24)
  with caplog.at_level("INFO"):
    rollout_lib.collect(sampler, formatter, make_user(Slow(0.3)), demo[:2], config,
                        jax.random.key(1))
  waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout: ")]
  assert waits and "s waiting for the simulator's answer to 2 dialogue(s)" in waits[0], waits
  assert "(0 of 2 dialogues done)" in waits[0] and "sim_user.timeout_s" in waits[0]
