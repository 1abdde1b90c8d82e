"""Continuous batching across turns: the rollout engine that keeps the decoding batch full.

Every dialogue owns one row of a per-row-length KV cache (`Sampler.start_rows`)
and moves through: ready (its next tokens are known) -> decoding (prefilled,
its reply in progress) -> with the simulator -> ready again, or done. The host
loop, between jitted decode chunks:

  1. takes the user turns the simulator has answered (their dialogues are ready);
  2. prefills every ready dialogue's new tokens into its row, at its own offset;
  3. decodes one chunk for the dialogues decoding, longest-waiting first: the
     largest compiled row count that they fill (none is padding; the few left
     over go first next chunk), ending the chunk as soon as one reply is done;
  4. hands each finished reply to the simulator without waiting for it.

A dialogue with the simulator keeps its cache and costs no decode work. With
a server-backed simulator (one with `max_concurrency`: the HTTP backend) user
turns run in a bounded thread pool while decoding goes on; an in-process one
(scripted, Flax) answers the finished replies between chunks. Only when no
dialogue can decode does the host wait, for the first user turn to come back.

Each dialogue draws its turn-t reply with the same seed and row id as the
lockstep engine, so greedy dialogues are the same token for token, and
sampled ones the same in distribution (and in tokens, on equal arithmetic).
"""

from __future__ import annotations

import collections
import concurrent.futures
import time

from models.chat import ChatFormatter
from models.sampler import Sampler, row_bucket_sizes
from rl.rollout import Book


def run(sampler: Sampler, formatter: ChatFormatter, book: Book) -> None:
  """Drives every dialogue of `book` to its end."""
  pool_size = getattr(book.user.backend, "max_concurrency", 0)
  pool = concurrent.futures.ThreadPoolExecutor(pool_size) if pool_size else None
  try:
    _Engine(sampler, formatter, book, pool).run()
  finally:
    if pool is not None:
      pool.shutdown(wait=True, cancel_futures=True)


class _Engine:

  def __init__(self, sampler: Sampler, formatter: ChatFormatter, book: Book, pool):
    self.sampler, self.formatter, self.book, self.pool = sampler, formatter, book, pool
    self.config = book.config
    self.rows = sampler.start_rows(len(book.dialogues))
    self.ready = collections.deque(book.live())  # need a prefill
    self.decoding = collections.deque()  # prefilled, reply in progress; longest-waiting first
    self.replies = {}  # dialogue -> (tokens, logprobs) of the reply in progress
    self.prompts = {}  # dialogue -> thinking-mode prompt of the reply in progress
    self.with_user = {}  # future -> dialogue, with a server-backed simulator
    self.answered = []  # (dialogue, reply text) for an in-process simulator, between chunks

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
      future = self.pool.submit(self.book.user.respond, [self.book.dialogues[i]], [text])
      self.with_user[future] = i

  def _answer_in_process(self) -> None:
    if not self.answered:
      return
    t0 = time.perf_counter()
    self.book.user.respond([self.book.dialogues[i] for i, _ in self.answered],
                           [text for _, text in self.answered])
    self.book.sim_seconds += time.perf_counter() - t0
    for i, _ in self.answered:
      self._user_turn_done(i)
    self.answered = []

  def _take_user_turns(self, block: bool) -> None:
    if not self.with_user:
      return
    t0 = time.perf_counter()
    done, _ = concurrent.futures.wait(
        list(self.with_user), timeout=None if block else 0,
        return_when=concurrent.futures.FIRST_COMPLETED)
    if block:
      self.book.sim_seconds += time.perf_counter() - t0
    for future in done:
      future.result()  # respond never raises for a failed call; anything else is a bug
      self._user_turn_done(self.with_user.pop(future))

  def _user_turn_done(self, i: int) -> None:
    self.book.after_user_turn(i)
    if not self.book.dialogues[i].done:
      self.ready.append(i)

  # Device.

  def _prefill(self) -> None:
    rows = list(self.ready)
    self.ready.clear()
    feeds = [self.book.feed(self.formatter, i) for i in rows]
    t0 = time.perf_counter()
    limit = self.sampler.row_bucket(len(self.book.dialogues))
    for start in range(0, len(rows), limit):
      self.sampler.prefill_rows(self.rows, rows[start:start + limit], feeds[start:start + limit],
                                reserve=self.config.max_new_tokens, restart=self.config.thinking)
    self.book.decode_seconds += time.perf_counter() - t0
    for i, feed in zip(rows, feeds):
      self.replies[i] = ([], [])
      if self.config.thinking:
        self.prompts[i] = feed
      self.decoding.append(i)

  def _decode_chunk(self) -> None:
    sampler, book = self.sampler, self.book
    sizes = [s for s in row_bucket_sizes(len(self.decoding), sampler.data_parallel_size())
             if s <= len(self.decoding)]
    width = sizes[-1] if sizes else len(self.decoding)
    chosen = [self.decoding.popleft() for _ in range(min(width, len(self.decoding)))]
    drawn = [len(self.replies[i][0]) for i in chosen]
    t0 = time.perf_counter()
    chunk = sampler.decode_rows(
        self.rows, chosen, [self.config.max_new_tokens - n for n in drawn], book.params(chosen[0]),
        seeds=[book.params(i).seed for i in chosen], row_ids=[book.row_id(i) for i in chosen],
        offsets=drawn, stop_after_finished=1)
    held = sum(int(self.rows.lengths[i]) for i in chosen)
    book.count_decode(time.perf_counter() - t0, chunk.width * chunk.steps, held,
                      chunk.width * self.rows.capacity)
    for i, tokens, logprobs, finished, stopped in zip(chosen, chunk.tokens, chunk.logprobs,
                                                     chunk.finished, chunk.stopped):
      self.replies[i][0].extend(tokens)
      self.replies[i][1].extend(logprobs)
      if not finished:
        self.decoding.append(i)
        continue
      reply_tokens, reply_logprobs = self.replies.pop(i)
      text = book.take_reply(self.formatter, i, reply_tokens, reply_logprobs, stopped,
                             self.prompts.pop(i, ()))
      self._to_user(i, text)

