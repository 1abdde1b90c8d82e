"""Continuous batching across turns: the rollout engine that keeps the decoding batch full.

Every dialogue owns one row of a per-row-length KV cache (`RowSampler.start_rows`)
and moves through: ready (its next tokens are known) -> decoding (prefilled,
its reply in progress) -> with the simulator -> ready again, or done. The host
loop, between jitted decode chunks:

  1. takes the user turns the simulator has answered (their dialogues are ready);
  2. prefills every ready dialogue's new tokens into its row, at its own offset;
  3. decodes one chunk for the dialogues decoding, longest-waiting first: the
     largest row call width that they fill (none is padding; those left over
     go first next chunk), as many rows from every data shard (a row call
     gathers rows per shard, see `rows_to_decode`), ending the chunk as soon
     as one reply is done;
  4. hands each finished reply to the simulator without waiting for it.

The rows start with room for a whole dialogue (`row_capacity`) and the
engine compiles the sampler's fixed set of row programs for them before the
first prefill (`RowSampler.compile_rows`), so no order of simulator answers
needs a program not compiled yet.

A dialogue with the simulator keeps its cache and costs no decode work. With
a server-backed simulator (one with `max_concurrency`: the HTTP backend) user
turns run in a bounded thread pool while decoding goes on; an in-process one
(scripted, Flax) answers the finished replies between chunks. Only when no
dialogue can decode does the host wait, for the first user turn to come back.

The agent (`rl.agent`) says what each dialogue's row needs and keeps each
finished turn, one dialogue at a time. Dialogue i draws its turn-t reply
with the same key (the turn's, folded with its row id) as the lockstep
engine (`rl.lockstep`), so greedy dialogues are the same token for token,
and sampled ones the same in distribution (and in tokens, on equal
arithmetic).
"""

from __future__ import annotations

import collections
import concurrent.futures
import sys
import time
from typing import Callable, Iterable, Sequence

import jax
from absl import logging

from models.sampler import Sampler
from models.sampling import bucket_size
from rl.agent import Agent
from rl.rollout_config import RolloutConfig, end_if_over_budget
from sim_user.simulator import Dialogue, SimulatedUser


def run(sampler: Sampler, agent: Agent, user: SimulatedUser, dialogues: Sequence[Dialogue],
        config: RolloutConfig, turn_key: Callable[[int], jax.Array]) -> float:
  """Drives every dialogue to its end; returns the time spent waiting only for the simulator."""
  pool_size = getattr(user.backend, "max_concurrency", 0)
  pool = concurrent.futures.ThreadPoolExecutor(pool_size) if pool_size else None
  try:
    engine = _Engine(sampler, agent, user, dialogues, config, turn_key, pool)
    engine.run()
    return engine.sim_seconds
  finally:
    if pool is not None:  # a rollout given up (a stop signal, an error) waits for no reply
      pool.shutdown(wait=sys.exc_info()[0] is None, cancel_futures=True)


# Seconds between the lines that say the rollout waits for the simulator (a slow one would
# otherwise leave the progress bar still for minutes without a word).
WAIT_REPORT_S = 30.0

# The most agent tokens a row starts with room for: evaluation has no token budget
# (max_dialogue_tokens=10**9), and its rows grow from here when a dialogue needs more.
MAX_START_AGENT_TOKENS = 8192


def row_capacity(config: RolloutConfig, first_feed_tokens: int) -> int:
  """Cache slots a dialogue's row starts with: its opening feed, the agent's token budget
  (at most MAX_START_AGENT_TOKENS) and one more reply (the budget is checked after a
  reply), as a bucket size. User turns come out of the same room; a dialogue that still
  outgrows it grows the cache."""
  budget = min(config.max_dialogue_tokens, MAX_START_AGENT_TOKENS)
  return bucket_size(first_feed_tokens + budget + config.max_new_tokens)


def rows_to_decode(decoding: Iterable[int], shard: Callable[[int], int], shards: int,
                   widths: Sequence[int]) -> list[int]:
  """The rows one decode chunk takes from `decoding` (longest-waiting first), in that order.

  A row call decodes the same number of rows on each of the `shards` data
  shards (`RowSampler.decode_rows`), so the chunk takes q rows of every shard
  (`shard(row)`): the largest call width per shard (`widths`, `RowBatch.widths`)
  that every shard fills, so no row is padding; when no width is filled (some
  shard has none decoding, or fewer rows decode than the narrowest width), the
  largest that the fullest shard fills, or the narrowest (the others pad).
  """
  decoding = list(decoding)
  per_shard = collections.Counter(shard(row) for row in decoding)
  fullest = max(per_shard.values())
  fill = min(per_shard.values()) if len(per_shard) == shards else fullest
  per_shard_widths = [width // shards for width in widths]
  q = max((w for w in per_shard_widths if w <= fill),
          default=min(per_shard_widths))
  taken = collections.Counter()
  chosen = []
  for row in decoding:
    if taken[shard(row)] < q:
      taken[shard(row)] += 1
      chosen.append(row)
  return chosen


class _Engine:

  def __init__(self, sampler, agent, user, dialogues, config, turn_key, pool):
    self.sampler, self.agent, self.user, self.pool = sampler, agent, user, pool
    self.dialogues, self.config, self.turn_key = dialogues, config, turn_key
    self.rows = None  # started at the first prefill, when the opening feeds are known
    self.turns = [0] * len(dialogues)  # agent turns taken per dialogue
    self.ready = collections.deque(i for i, d in enumerate(dialogues) if not d.done)
    self.decoding = collections.deque()  # prefilled, reply in progress; longest-waiting first
    self.replies = {}  # dialogue -> (tokens fed, tokens drawn, logprobs) of the turn in progress
    self.with_user = {}  # future -> dialogue, with a server-backed simulator
    self.answered = []  # (dialogue, reply text) for an in-process simulator, between chunks
    self.sim_seconds = 0.0

  def run(self) -> None:
    while self.ready or self.decoding or self.with_user or self.answered:
      self._take_user_turns(block=not (self.ready or self.decoding or self.answered))
      if self.ready:
        self._prefill()
      if self.decoding:
        self._decode_chunk()
      self._answer_in_process()

  # Simulator.

  def _to_user(self, i: int, text: str) -> None:
    if self.pool is None:
      self.answered.append((i, text))
    else:
      self.with_user[self.pool.submit(self.user.respond, [self.dialogues[i]], [text])] = i

  def _answer_in_process(self) -> None:
    if not self.answered:
      return
    t0 = time.perf_counter()
    self.user.respond([self.dialogues[i] for i, _ in self.answered],
                      [text for _, text in self.answered])
    self.sim_seconds += time.perf_counter() - t0
    for i, _ in self.answered:
      self._user_turn_done(i)
    self.answered = []

  def _take_user_turns(self, block: bool) -> None:
    if not self.with_user:
      return
    t0 = time.perf_counter()
    while True:  # blocking, it says every WAIT_REPORT_S what it waits for
      done, _ = concurrent.futures.wait(list(self.with_user),
                                        timeout=WAIT_REPORT_S if block else 0,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
      if done or not block:
        break
      finished = sum(d.done for d in self.dialogues)
      logging.info("rollout: %.0f s waiting for the simulator's answer to %d dialogue(s), "
                   "nothing else to decode (%d of %d dialogues done); a call may take up to "
                   "sim_user.timeout_s, with sim_user.http_retries retries",
                   time.perf_counter() - t0, len(self.with_user), finished,
                   len(self.dialogues))
    if block:
      self.sim_seconds += time.perf_counter() - t0
    for future in done:
      future.result()  # respond never raises for a failed call; anything else is a bug
      self._user_turn_done(self.with_user.pop(future))

  def _user_turn_done(self, i: int) -> None:
    end_if_over_budget(self.dialogues[i], self.agent.agent_tokens[i], self.config)
    if not self.dialogues[i].done:
      self.ready.append(i)

  # Device.

  def _prefill(self) -> None:
    rows = list(self.ready)
    self.ready.clear()
    feeds = [self.agent.next_tokens(self.dialogues[i], i) for i in rows]
    if self.rows is None:
      capacity = row_capacity(self.config, max(len(feed) for feed in feeds))
      self.rows = self.sampler.rows.start_rows(len(self.dialogues), capacity)
      self.sampler.rows.compile_rows(self.rows, self.agent.sampling)
    self.sampler.rows.prefill_rows(self.rows, rows, feeds, restart=self.agent.restarts_rows)
    for i, feed in zip(rows, feeds):
      self.replies[i] = (feed, [], [])
      self.decoding.append(i)

  def _decode_chunk(self) -> None:
    sampler, agent = self.sampler, self.agent
    chosen = rows_to_decode(self.decoding, self.rows.shard, self.rows.shards, self.rows.widths)
    taken = set(chosen)
    self.decoding = collections.deque(i for i in self.decoding if i not in taken)
    drawn = [len(self.replies[i][1]) for i in chosen]
    greedy = agent.sampling.temperature == 0
    chunk = sampler.rows.decode_rows(
        self.rows, chosen, [agent.sampling.max_new_tokens - n for n in drawn], agent.sampling,
        keys=None if greedy else [self.turn_key(self.turns[i]) for i in chosen],
        row_ids=[agent.row_ids[i] for i in chosen], offsets=drawn, stop_after_finished=1)
    for i, tokens, logprobs, finished, stopped in zip(chosen, chunk.tokens, chunk.logprobs,
                                                     chunk.finished, chunk.stopped):
      self.replies[i][1].extend(tokens)
      self.replies[i][2].extend(logprobs)
      if not finished:
        self.decoding.append(i)
        continue
      fed, reply, reply_logprobs = self.replies.pop(i)
      self.turns[i] += 1
      self._to_user(i, agent.record(self.dialogues[i], i, fed, reply, reply_logprobs, stopped))
