"""The row-level sampler against the batch sampler; the continuous rollout engine against
the lockstep one."""

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import qwen2
from models.sampler import Sampler, SamplingParams, row_bucket_sizes
from rl import rollout as rollout_lib
from rlver_jax import policy as policy_lib
from rlver_jax import tiny
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


def decode_all(sampler, rb, rows, params, width, budgets=None, key=None):
  """Decodes `rows` to the end, `width` rows per chunk in rotation; returns tokens, logprobs."""
  budgets = budgets or {r: params.max_new_tokens for r in rows}
  tokens, logprobs = {r: [] for r in rows}, {r: [] for r in rows}
  live = list(rows)
  while live:
    chosen = live[:width]
    chunk = sampler.decode_rows(rb, chosen, [budgets[r] - len(tokens[r]) for r in chosen], params,
                                keys=None if key is None else [key] * len(chosen), row_ids=chosen,
                                offsets=[len(tokens[r]) for r in chosen])
    for r, new, lp, finished in zip(chosen, chunk.tokens, chunk.logprobs, chunk.finished):
      tokens[r] += new
      logprobs[r] += lp
      live.remove(r)
      if not finished:
        live.append(r)  # to the back: the next chunk decodes other rows first
  return [tokens[r] for r in rows], [logprobs[r] for r in rows]


def test_rows_decoded_in_chunks_equal_the_batch_sampler(model):
  reference = Sampler(model, stop_token_ids=[STOP]).generate(PROMPTS, GREEDY)
  assert [len(t) for t in reference.tokens] == [10, 10, 4, 10]
  sampler = Sampler(model, stop_token_ids=[STOP], min_cache_bucket=16, decode_chunk_steps=3)
  rb = sampler.start_rows(len(PROMPTS))
  sampler.prefill_rows(rb, [2, 0], [PROMPTS[2], PROMPTS[0]], reserve=10)
  sampler.prefill_rows(rb, [1, 3], [PROMPTS[1], PROMPTS[3]], reserve=10)
  tokens, logprobs = decode_all(sampler, rb, [0, 1, 2, 3], GREEDY, width=3)
  assert tokens == reference.tokens
  np.testing.assert_allclose(np.concatenate(logprobs), np.concatenate(reference.logprobs),
                             atol=1e-5)
  # Each row holds exactly its own tokens: the last one fed, the prompt and reply.
  assert rb.lengths[:4].tolist() == [len(p) + len(t) for p, t in zip(PROMPTS, tokens)]


def test_rows_continue_restart_and_match_a_full_forward_pass(model):
  sampler = Sampler(model, stop_token_ids=[STOP], min_cache_bucket=16, decode_chunk_steps=4)
  rb = sampler.start_rows(len(PROMPTS))
  sampler.prefill_rows(rb, [0, 1, 2, 3], PROMPTS, reserve=10)
  turn1, _ = decode_all(sampler, rb, [0, 1, 2, 3], GREEDY, width=4)
  user = {3: [60, 61, 62], 1: [63]}
  # Rows 3 and 1 get a user turn at their own offsets (growing the 16-slot cache); row 0
  # starts over with a new prompt, as a thinking-mode turn does; row 2 waits.
  sampler.prefill_rows(rb, [3, 1], [user[3], user[1]], reserve=10)
  sampler.prefill_rows(rb, [0], [[70, 71, 72]], reserve=10, restart=True)
  assert rb.capacity >= 32
  turn2, logprobs2 = decode_all(sampler, rb, [3, 1, 0], GREEDY, width=2)
  histories = [PROMPTS[3] + turn1[3] + user[3], PROMPTS[1] + turn1[1] + user[1], [70, 71, 72]]
  full = Sampler(model, stop_token_ids=[STOP]).generate(histories, GREEDY)
  assert turn2 == full.tokens
  # The sampler's log-probs are those of one forward pass over the whole sequences.
  sequences = [h + r for h, r in zip(histories, turn2)]
  width = max(len(q) for q in sequences)
  ids_bt = np.array([q + [0] * (width - len(q)) for q in sequences], np.int32)
  mask_bt = np.arange(width)[None] < np.array([len(q) for q in sequences])[:, None]
  logp_btv = jax.nn.log_softmax(jax.jit(lambda i, m: model(i, attention_mask=m))(ids_bt, mask_bt))
  for b, (history, reply, logprobs) in enumerate(zip(histories, turn2, logprobs2)):
    steps = np.arange(len(history) - 1, len(history) + len(reply) - 1)
    np.testing.assert_allclose(logprobs, logp_btv[b, steps, reply], atol=1e-4)


def test_sampled_rows_draw_the_batch_samplers_tokens(model):
  params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20)
  key = jax.random.key(7)
  reference = Sampler(model, stop_token_ids=[STOP]).generate(PROMPTS, params, key,
                                                             row_ids=[4, 5, 6, 7])
  sampler = Sampler(model, stop_token_ids=[STOP], min_cache_bucket=16, decode_chunk_steps=5)
  rb = sampler.start_rows(8)
  rows = [4, 5, 6, 7]  # row ids double as the rows' sampling ids
  sampler.prefill_rows(rb, rows, PROMPTS, reserve=12)
  tokens, _ = decode_all(sampler, rb, rows, params, width=3, key=key)
  assert tokens == reference.tokens


def test_bf16_sampling_weights_refresh_without_recompiling(model):
  sampler = Sampler(model, stop_token_ids=[STOP], sampling_dtype=jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(sampler.state))
  cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), nnx_state(model))
  expected = Sampler(with_state(model, cast), stop_token_ids=[STOP]).generate(PROMPTS, GREEDY)
  assert sampler.generate(PROMPTS, GREEDY).tokens == expected.tokens
  other = qwen2.init_random(CONFIG, seed=1)
  sampler.update_weights(other)
  compiled = sampler._decode._cache_size()
  refreshed = sampler.generate(PROMPTS, GREEDY).tokens
  assert sampler._decode._cache_size() == compiled
  assert refreshed != expected.tokens


def test_row_buckets_pad_little():
  sizes = row_bucket_sizes(100)
  assert sizes[:8] == list(range(1, 9)) and sizes[-1] >= 100
  assert all(b <= 1.5 * a for a, b in zip(sizes[7:], sizes[8:]))
  assert row_bucket_sizes(30, multiple=4) == [4, 8, 12, 16, 24, 32]


def nnx_state(model):
  from flax import nnx
  return nnx.state(model)


def with_state(model, state):
  from flax import nnx
  graphdef, _ = nnx.split(model)
  return nnx.merge(graphdef, state)


# The continuous engine against the lockstep one, on a tiny chat model and the scripted user.

@pytest.fixture(scope="module")
def chat_policy(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("engine_policy"))
  tiny.write_checkpoint(path, seed=3)
  policy = policy_lib.load_policy(path)
  # Larger random weights than the checkpoint's, so greedy replies do not repeat one token;
  # 40 of the 1024 tokens also end a reply, so replies end at different lengths, by stop
  # token or by budget, and dialogues at different turns.
  config = dataclasses.replace(policy.model.config, initializer_range=0.3)
  stops = list(policy.sampler.stop_token_ids) + list(range(100, 140))
  sampler = Sampler(qwen2.init_random(config, seed=3), stop_token_ids=stops,
                    pad_id=policy.sampler.pad_id, decode_chunk_steps=4)
  return sampler, policy.formatter, profiles.load_profiles(profiles.DEMO_PROFILES)[:3]


def make_user(backend=None):
  return SimulatedUser(backend or ScriptedBackend(), dynamics.RLVER_TRAIN,
                       templates.PromptSet.load(language="en", variant="vanilla"))


def both_engines(chat_policy, user_factory=make_user, **config):
  sampler, formatter, demo = chat_policy
  config = rollout_lib.RolloutConfig(max_new_tokens=12, temperature=0.0, **config)
  return [rollout_lib.collect(sampler, formatter, user_factory(), demo, dataclasses.replace(
      config, engine=engine), seed=1) for engine in ("lockstep", "continuous")]


def assert_same_rollouts(lockstep, continuous):
  assert [d.history for d in continuous.dialogues] == [d.history for d in lockstep.dialogues]
  assert [d.end_reason for d in continuous.dialogues] == [d.end_reason for d in lockstep.dialogues]
  for a, b in zip(lockstep.samples, continuous.samples, strict=True):
    assert (b.tokens, b.loss_mask, b.group, b.dialogue, b.reward, b.token_rewards) == (
        a.tokens, a.loss_mask, a.group, a.dialogue, a.reward, a.token_rewards)
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)


def test_continuous_dialogues_equal_lockstep_turn_for_turn(chat_policy):
  # GRPO groups of 2, per-turn rewards, a token budget that ends dialogues at different turns.
  lockstep, continuous = both_engines(chat_policy, samples_per_profile=2, reward="turn",
                                      max_dialogue_tokens=20)
  assert_same_rollouts(lockstep, continuous)
  assert len({d.agent_turns for d in lockstep.dialogues}) > 1, [
      (sum(s.loss_mask), s.token_rewards) for s in lockstep.samples]
  assert 0 < lockstep.metrics["agent_turns/cut_off"] < lockstep.metrics["agent_turns/generated"]
  assert continuous.metrics["rollout/slot_efficiency"] == 1.0  # no padding row, no tail
  assert lockstep.metrics["rollout/slot_efficiency"] < 1.0


def test_continuous_thinking_turns_equal_lockstep(chat_policy):
  lockstep, continuous = both_engines(chat_policy, thinking=True, max_dialogue_tokens=30)
  assert_same_rollouts(lockstep, continuous)
  assert len(lockstep.samples) == lockstep.metrics["agent_turns/generated"]


class SlowForOne(ScriptedBackend):
  """A server-like backend (has max_concurrency): one profile's calls hang, then fail."""

  max_concurrency = 4

  def __init__(self, slow_profile, seconds):
    self.slow_profile, self.seconds, self.finished_at = slow_profile, seconds, {}

  def complete(self, requests):
    if any(r.profile.id == self.slow_profile for r in requests):
      time.sleep(self.seconds)
      return [BackendError("timeout") for _ in requests]
    out = super().complete(requests)
    for r in requests:
      self.finished_at[r.profile.id] = time.perf_counter()
    return out


def test_a_slow_failing_simulator_call_does_not_hold_up_other_dialogues(chat_policy):
  sampler, formatter, demo = chat_policy
  config = rollout_lib.RolloutConfig(max_new_tokens=12, temperature=0.0, max_dialogue_tokens=30)
  backend = SlowForOne(demo[0].id, seconds=0)
  rollout_lib.collect(sampler, formatter, make_user(backend), demo, config, seed=1)  # compiles
  backend.seconds = 4.0
  start = time.perf_counter()
  rollout = rollout_lib.collect(sampler, formatter, make_user(backend), demo, config, seed=1)
  slow, *others = rollout.dialogues
  assert slow.end_reason == "simulator_error" and slow.agent_turns == 1
  assert all(d.agent_turns > 1 and d.end_reason != "simulator_error" for d in others)
  # The others' dialogues ran to their end while the slow call hung.
  assert max(backend.finished_at[d.profile.id] for d in others) - start < backend.seconds
