"""Batched multi-turn dialogues between the policy and the simulated user.

Each round makes one sampler call for every live dialogue's agent turn and
one batched simulator call for every live dialogue's user turn; dialogues
end by the simulator's rule set. GRPO groups (n samples of one profile)
share persona and opening line.

Non-thinking mode: one training sequence per dialogue, the whole
conversation, with the loss mask on the agent's own tokens (reply content
and `<|im_end|>`), not on the system prompt, user turns or role headers. The
dialogue's KV cache is kept between turns; each turn prefills only the new
user message and the next role header.

Thinking mode: the agent writes `<think>...</think>` then its reply; the
simulator sees the reply only. Every agent turn is its own sample (prompt =
the dialogue so far, replies without their thoughts; response = this turn's
tokens), all sharing the dialogue's reward; a turn that breaks the format
gets `format_penalty_reward` instead.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Sequence

import numpy as np

from models.chat import ChatFormatter
from models.sampler import STOP, Sampler, SamplingParams
from sim_user import dynamics
from sim_user.profiles import Profile
from sim_user.simulator import Dialogue, SimulatedUser
from sim_user.thinking import split_thinking

TOKEN_BUDGET = "token_budget"
ENGINES = ("continuous", "lockstep")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  samples_per_profile: int = 1  # GRPO group size n
  system_prompt: str = ""
  thinking: bool = False
  format_penalty_reward: float = 0.0  # thinking mode: reward of a badly formatted turn
  max_new_tokens: int = 512  # per agent turn
  max_dialogue_tokens: int = 10000  # agent tokens per dialogue; beyond, the dialogue ends
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  reward: str = "final"  # or "turn": each agent turn gets its emotion change / 100
  # continuous: rl.engine's continuous batching across turns; lockstep: every live
  # dialogue's turn in one sampler call per round (the benchmark's baseline)
  engine: str = "continuous"

  def __post_init__(self):
    if self.reward not in ("final", "turn"):
      raise ValueError(f"rollout reward {self.reward!r}; expected final or turn")
    if self.engine not in ENGINES:
      raise ValueError(f"rollout engine {self.engine!r}; expected one of {', '.join(ENGINES)}")


@dataclasses.dataclass
class Sample:
  """One training sequence: token ids with per-token loss mask and sampling logprobs."""

  tokens: list[int]
  loss_mask: list[int]  # 1 on tokens the agent generated
  logprobs: list[float]  # sampling logprob on generated tokens, 0 elsewhere
  reward: float  # the dialogue's score (GRPO normalises these within a group)
  group: int  # samples of one profile share a group
  dialogue: int  # index into Rollout.dialogues
  token_rewards: list[tuple[int, float]] = dataclasses.field(default_factory=list)
  # (index into tokens, reward): the final reward on the last generated token, or
  # with reward="turn" each turn's emotion change on that turn's last token


@dataclasses.dataclass
class Rollout:
  samples: list[Sample]
  dialogues: list[Dialogue]
  metrics: dict


class _Sequence:
  """Host-side bookkeeping of one dialogue's token stream (non-thinking mode)."""

  def __init__(self):
    self.tokens, self.loss_mask, self.logprobs = [], [], []
    self.agent_tokens = 0
    self.turn_ends = []  # index of each agent turn's last token

  def feed(self, tokens):
    self.tokens += tokens
    self.loss_mask += [0] * len(tokens)
    self.logprobs += [0.0] * len(tokens)

  def generated(self, tokens, logprobs):
    self.tokens += tokens
    self.loss_mask += [1] * len(tokens)
    self.logprobs += list(logprobs)
    self.agent_tokens += len(tokens)
    self.turn_ends.append(len(self.tokens) - 1)


def _agent_view(dialogue: Dialogue, system_prompt: str, raw_replies: bool) -> list[dict]:
  messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
  for m in dialogue.history:
    content = m.get("raw_content", m["content"]) if raw_replies else m["content"]
    messages.append({"role": m["role"], "content": content})
  return messages


class Book:
  """Host-side state of one batch of dialogues, whichever engine drives them.

  An engine asks `feed(i)` for the tokens to prefill before dialogue i's next
  agent turn, hands each finished reply to `take_reply` (which returns the
  text for the simulator), and calls `after_user_turn(i)` once the simulator
  answered; `rollout()` assembles the training samples and metrics.
  """

  def __init__(self, user: SimulatedUser, profiles: Sequence[Profile], config: RolloutConfig,
               seed: int, first_profile: int):
    self.start_time = time.perf_counter()
    self.user, self.config, self.seed = user, config, seed
    t0 = time.perf_counter()
    openers = user.start(profiles)  # one opening per profile, shared by its group
    self.sim_seconds = time.perf_counter() - t0
    self.dialogues, self.groups = [], []
    for group, opener in enumerate(openers):
      for _ in range(config.samples_per_profile):
        self.dialogues.append(copy.deepcopy(opener))
        self.groups.append(first_profile + group)
    self.sequences = [_Sequence() for _ in self.dialogues]
    self.row_offset = first_profile * config.samples_per_profile  # global index of dialogue 0
    self.thinking_samples: list[Sample] = []
    # (dialogue, turn, well formed) per thinking sample
    self.thinking_turns: list[tuple[int, int, bool]] = []
    self.reply_ended = [True] * len(self.dialogues)
    self.turns = [0] * len(self.dialogues)  # agent turns generated per dialogue
    self.generated_turns, self.cut_off_turns = 0, 0  # cut off: stop reason "length"
    # Engine figures: decode (and prefill) wall time, decoding row-steps, cache occupancy.
    self.decode_seconds, self.row_steps = 0.0, 0
    self.occupancy_sum, self.occupancy_weight = 0.0, 0

  def live(self) -> list[int]:
    return [i for i, d in enumerate(self.dialogues) if not d.done]

  def params(self, i: int) -> SamplingParams:
    """Dialogue i's sampling parameters for its next turn (keys follow its turn count)."""
    config = self.config
    return SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                          top_p=config.top_p, top_k=config.top_k,
                          seed=self.seed * 1000 + self.turns[i])

  def row_id(self, i: int) -> int:
    return self.row_offset + i

  def feed(self, formatter: ChatFormatter, i: int) -> list[int]:
    """Tokens to prefill before dialogue i's next turn: in thinking mode the whole prompt
    (thoughts hidden), else what follows the cache (all of it on the first turn)."""
    d, system_prompt = self.dialogues[i], self.config.system_prompt
    if self.config.thinking:
      return formatter.prompt_ids(_agent_view(d, system_prompt, False))
    view = _agent_view(d, system_prompt, True)
    if not self.sequences[i].tokens:
      feed = formatter.prompt_ids(view)
    else:
      last_agent = max(k for k, m in enumerate(view) if m["role"] == "assistant")
      feed = formatter.continuation_ids(view[:last_agent + 1], self.reply_ended[i],
                                        view[last_agent + 1:])
    self.sequences[i].feed(feed)
    return feed

  def take_reply(self, formatter: ChatFormatter, i: int, tokens, logprobs, stopped: bool,
                 prompt: Sequence[int]) -> str:
    """Records dialogue i's reply (`prompt`: its thinking-mode prompt); returns its text."""
    self.reply_ended[i] = stopped
    self.generated_turns += 1
    self.cut_off_turns += not stopped
    self.turns[i] += 1
    body = tokens[:-1] if stopped else tokens
    # Special tokens stay: <think> may be one, and the format check needs it.
    text = formatter.tokenizer.decode(body, skip_special_tokens=False)
    if self.config.thinking:
      prompt = list(prompt)
      self.thinking_samples.append(Sample(
          tokens=prompt + list(tokens), loss_mask=[0] * len(prompt) + [1] * len(tokens),
          logprobs=[0.0] * len(prompt) + list(logprobs), reward=0.0, group=self.groups[i],
          dialogue=i))
      self.thinking_turns.append((i, self.dialogues[i].agent_turns,
                                  split_thinking(text).well_formed))
      self.sequences[i].agent_tokens += len(tokens)
    else:
      self.sequences[i].generated(list(tokens), logprobs)
    return text  # in thinking mode the simulator strips the thoughts itself

  def after_user_turn(self, i: int) -> None:
    """The token budget rule, once dialogue i's user turn is in."""
    d = self.dialogues[i]
    if not d.done and self.sequences[i].agent_tokens >= self.config.max_dialogue_tokens:
      d.end_reason = TOKEN_BUDGET

  def count_decode(self, seconds: float, row_steps: int, tokens_held: int, slots: int) -> None:
    """One decode call: its wall time, rows x steps, and tokens held / slots of its cache."""
    self.decode_seconds += seconds
    self.row_steps += row_steps
    self.occupancy_sum += row_steps * tokens_held / max(slots, 1)
    self.occupancy_weight += row_steps

  def rollout(self) -> Rollout:
    config, user, dialogues = self.config, self.user, self.dialogues
    samples = []
    if config.thinking:
      # Turn by turn, dialogue by dialogue, whatever order the engine finished them in.
      order = sorted(range(len(self.thinking_samples)),
                     key=lambda k: (self.thinking_turns[k][1], self.thinking_turns[k][0]))
      for k in order:
        sample, (i, turn_index, well_formed) = self.thinking_samples[k], self.thinking_turns[k]
        d = dialogues[i]
        if d.reward is None:
          continue  # dropped by the simulator
        if not well_formed:
          reward = config.format_penalty_reward
        elif config.reward == "turn":
          deltas = dynamics.turn_rewards(d.emotions)
          reward = deltas[turn_index] if turn_index < len(deltas) else 0.0
        else:
          reward = d.reward
        sample.reward = reward
        sample.token_rewards = [(len(sample.tokens) - 1, reward)]
        samples.append(sample)
    else:
      for i, (d, seq) in enumerate(zip(dialogues, self.sequences)):
        if d.reward is None or not seq.agent_tokens:
          continue
        if config.reward == "turn":
          token_rewards = list(zip(seq.turn_ends, dynamics.turn_rewards(d.emotions)))
        else:
          token_rewards = [(seq.turn_ends[-1], d.reward)]
        samples.append(Sample(tokens=seq.tokens, loss_mask=seq.loss_mask, logprobs=seq.logprobs,
                              reward=d.reward, group=self.groups[i], dialogue=i,
                              token_rewards=token_rewards))

    kept = [d for d in dialogues if not d.dropped]
    finals = np.array([d.emotion for d in kept]) if kept else np.zeros(1)
    response_lens = [sum(s.loss_mask) for s in samples] or [0]
    wall = time.perf_counter() - self.start_time
    generated = int(sum(seq.agent_tokens for seq in self.sequences))
    metrics = {
        "reward/mean": float(np.mean([s.reward for s in samples])) if samples else 0.0,
        "emotion/final_mean": float(np.mean(finals)),
        "success_rate": 100.0 * float(np.mean(finals >= 100)),
        "failure_rate": 100.0 * float(np.mean([dynamics.is_failure(user.rules, e)
                                               for e in finals])),
        "turns/mean": float(np.mean([d.agent_turns for d in dialogues])),
        "response_len/mean": float(np.mean(response_lens)),
        "dialogues/simulator_failed": sum(1 for d in dialogues if d.failure and not d.dropped),
        "dialogues/dropped": sum(1 for d in dialogues if d.dropped),
        "time/rollout": wall,
        "time/simulator": self.sim_seconds,
        "tokens/generated": generated,
        "agent_turns/generated": self.generated_turns,
        "agent_turns/cut_off": self.cut_off_turns,
        "agent_turns/cut_off_rate": 100.0 * self.cut_off_turns / max(self.generated_turns, 1),
        # generated tokens / decoding row-steps (padding rows and finished rows' steps waste)
        "rollout/slot_efficiency": generated / max(self.row_steps, 1),
        # tokens held / cache slots of the decoding batch, averaged over row-steps
        "rollout/cache_occupancy": self.occupancy_sum / max(self.occupancy_weight, 1),
        "rollout/decode_s": self.decode_seconds,
        "rollout/sim_wait_s": self.sim_seconds,
        "rollout/tokens_per_s": generated / max(wall, 1e-9),
    }
    for intention in sorted({d.profile.intention for d in kept if d.profile.intention}):
      metrics[f"emotion/final/{intention}"] = float(np.mean(
          [d.emotion for d in kept if d.profile.intention == intention]))
    if config.thinking:
      metrics["format_ok_rate"] = 100.0 * float(np.mean(
          [ok for *_, ok in self.thinking_turns] or [0]))
    return Rollout(samples=samples, dialogues=dialogues, metrics=metrics)


def collect(sampler: Sampler, formatter: ChatFormatter, user: SimulatedUser,
            profiles: Sequence[Profile], config: RolloutConfig, seed: int,
            first_profile: int = 0) -> Rollout:
  """Runs one batch of dialogues to their end and returns the training samples.

  `profiles` may be one host's share of a larger batch, starting at global
  profile `first_profile`: groups and sampling keys follow the global index, so
  each dialogue is the same whichever host runs it. `config.engine` picks the
  engine; both give the same dialogues.
  """
  book = Book(user, profiles, config, seed, first_profile)
  if config.engine == "continuous":
    from rl import engine  # engine builds on this module's Book
    engine.run(sampler, formatter, book)
  else:
    _run_lockstep(sampler, formatter, book)
  return book.rollout()


def _run_lockstep(sampler: Sampler, formatter: ChatFormatter, book: Book) -> None:
  """Rounds: every live dialogue's agent turn in one sampler call, then every user turn in
  one simulator call."""
  config = book.config
  live = book.live()
  convs = sampler.start(len(live)) if live and not config.thinking else None
  while live:
    feeds = [book.feed(formatter, i) for i in live]
    params, row_ids = book.params(live[0]), [book.row_id(i) for i in live]
    t0 = time.perf_counter()
    if config.thinking:
      out = sampler.generate(feeds, params, row_ids)
      batch, slots = sampler._batch_bucket(len(live)), max(len(f) for f in feeds)
    else:
      out = sampler.extend(convs, feeds, params, row_ids)
      batch, slots = convs.batch_size, convs.capacity
    steps = max(out.lengths)
    held = sum(len(f) + n for f, n in zip(feeds, out.lengths)) if config.thinking else sum(
        len(book.sequences[i].tokens) + n for i, n in zip(live, out.lengths))
    book.count_decode(time.perf_counter() - t0, batch * steps, held, batch * (
        slots + steps if config.thinking else slots))
    replies = [book.take_reply(formatter, i, out.tokens[row], out.logprobs[row],
                               out.stop_reasons[row] == STOP, feeds[row])
               for row, i in enumerate(live)]
    t0 = time.perf_counter()
    book.user.respond([book.dialogues[i] for i in live], replies)
    book.sim_seconds += time.perf_counter() - t0
    for i in live:
      book.after_user_turn(i)
    still = [row for row, i in enumerate(live) if not book.dialogues[i].done]
    if still and convs is not None and len(still) < len(live):
      convs = sampler.select(convs, still)
    live = [live[row] for row in still]
