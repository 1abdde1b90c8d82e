"""The policy taking its turn in a batch of dialogues, between the rollout and the sampler.

An agent renders each live dialogue as the policy sees it, samples one reply
per dialogue, and keeps what training needs of them. Two strategies; the
rollout picks one per batch (`rl.rollout.make_agent`):

- `CachedDialogues` (non-thinking): one training sequence per dialogue, the
  whole conversation, with the loss mask on the agent's own tokens (reply
  content and `<|im_end|>`), not on the system prompt, user turns or role
  headers. The dialogue's KV cache is kept between turns; each turn prefills
  only the new user message and the next role header.
- `ThinkingTurns`: the agent writes `<think>...</think>` then its reply; the
  simulator sees the reply only (it strips the thoughts itself). Every agent
  turn is its own sample (prompt = the dialogue so far, replies without their
  thoughts; response = this turn's tokens), all sharing the dialogue's
  reward; a turn that breaks the format gets `format_penalty_reward` instead.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax

from infra import host_metrics
from models.chat import ChatFormatter
from models.sampler import Sampler
from models.sampling import SamplingParams
from rl.batch import Sample
from sim_user import dynamics
from sim_user.simulator import Dialogue
from sim_user.thinking import split_thinking


def agent_view(dialogue: Dialogue, system_prompt: str, raw_replies: bool) -> list[dict]:
  """The chat messages the policy sees: its own replies as generated (`raw_replies`) or as the
  simulator keeps them (thoughts stripped)."""
  messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
  for m in dialogue.history:
    content = m.get("raw_content", m["content"]) if raw_replies else m["content"]
    messages.append({"role": m["role"], "content": content})
  return messages


class Agent:
  """What both strategies share: the sampler, the decoding settings and the turn counts.

  Dialogues are named by their index in the batch; `row_ids[i]` is dialogue
  i's global id, which its sampling key is folded with.

  Each engine takes turns through its own methods (the sections below):
  the lockstep engine (`rl.lockstep`) calls `act` for every live dialogue at
  once; the continuous engine (`rl.engine`) decodes on its own cache rows and
  asks one dialogue at a time for `next_tokens`, then hands the reply to
  `record` (reading `restarts_rows`, `sampling` and `row_ids`). A strategy's
  `act` is its `next_tokens` and `record` around one sampler call, so both
  engines keep the same turns. Both read `agent_tokens` for the token
  budget; the rollout takes `samples` and `metrics` once the batch is done.
  """

  def __init__(self, sampler: Sampler, formatter: ChatFormatter, system_prompt: str,
               sampling: SamplingParams, row_ids: Sequence[int]):
    self.sampler, self.formatter = sampler, formatter
    self.system_prompt, self.sampling = system_prompt, sampling
    self.row_ids = list(row_ids)
    self.agent_tokens = [0] * len(self.row_ids)  # per dialogue: tokens the agent generated
    self.generated_turns = 0
    self.cut_off_turns = 0  # turns that hit max_new_tokens (stop reason LENGTH)

  # The lockstep engine (rl.lockstep): every live dialogue's turn in one call.

  def act(self, dialogues: Sequence[Dialogue], live: Sequence[int], key: jax.Array) -> list[str]:
    """One reply per live dialogue (in `live`'s order), thoughts included, stop token cut."""
    raise NotImplementedError

  # The continuous engine (rl.engine): one dialogue at a time, what to prefill into its
  # row, then what came of it.

  # Whether a turn's tokens start the dialogue's cache row over (thinking) or follow it.
  restarts_rows = False

  def next_tokens(self, dialogue: Dialogue, i: int) -> list[int]:
    """What dialogue i's cache row needs before its next turn (see `restarts_rows`)."""
    raise NotImplementedError

  def record(self, dialogue: Dialogue, i: int, fed: Sequence[int], tokens: Sequence[int],
             logprobs: Sequence[float], ended: bool) -> str:
    """Keeps dialogue i's turn (`fed`: its `next_tokens`); returns the reply's text."""
    raise NotImplementedError

  # The finished batch (rl.rollout).

  def samples(self, dialogues: Sequence[Dialogue], groups: Sequence[int],
              reward: str) -> list[Sample]:
    """The training samples of the finished dialogues (none of a dropped one).

    `groups[i]`: dialogue i's GRPO group; `reward`: "final" (the dialogue's
    score) or "turn" (each agent turn's emotion change).
    """
    raise NotImplementedError

  # Over hosts: counts sum; the cut-off rate is the sums' (host_metrics).
  host_metrics.declare({"tokens/generated": host_metrics.SUM,
                        "agent_turns/generated": host_metrics.SUM,
                        "agent_turns/cut_off": host_metrics.SUM,
                        "agent_turns/cut_off_rate": host_metrics.ratio(
                            "agent_turns/cut_off", "agent_turns/generated", scale=100.0)})

  def metrics(self) -> dict:
    return {"tokens/generated": int(sum(self.agent_tokens)),
            "agent_turns/generated": self.generated_turns,
            "agent_turns/cut_off": self.cut_off_turns,
            "agent_turns/cut_off_rate": 100.0 * self.cut_off_turns / max(self.generated_turns, 1)}

  # What the strategies' turns build on.

  def text(self, tokens: Sequence[int], ended: bool) -> str:
    """A reply's text without its stop token; special tokens stay (<think> may be one, and
    the format check needs it)."""
    return self.formatter.tokenizer.decode(list(tokens[:-1] if ended else tokens),
                                           skip_special_tokens=False)

  def _count(self, dialogue: Dialogue, i: int, tokens: Sequence[int], ended: bool) -> None:
    self.agent_tokens[i] += len(tokens)
    self.generated_turns += 1
    self.cut_off_turns += not ended
    dialogue.replies_cut_off += not ended  # the evaluation's record keeps its own


class _Sequence:
  """Host-side bookkeeping of one dialogue's token stream."""

  def __init__(self):
    self.tokens, self.loss_mask, self.logprobs = [], [], []
    self.turn_ends = []  # index of each agent turn's last token

  def feed(self, tokens):
    self.tokens += tokens
    self.loss_mask += [0] * len(tokens)
    self.logprobs += [0.0] * len(tokens)

  def generated(self, tokens, logprobs):
    self.tokens += tokens
    self.loss_mask += [1] * len(tokens)
    self.logprobs += list(logprobs)
    self.turn_ends.append(len(self.tokens) - 1)


class CachedDialogues(Agent):
  """Non-thinking turns: each dialogue is one cache row and one training sequence."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._sequences = [_Sequence() for _ in self.row_ids]
    self._reply_ended = [True] * len(self.row_ids)  # per dialogue: its last reply hit a stop
    self._convs = None  # started by the first turn
    self._rows: list[int] = []  # the dialogue of each cache row

  def act(self, dialogues, live, key):
    if self._convs is None:
      self._convs = self.sampler.batch.start(len(live), row_ids=[self.row_ids[i] for i in live])
    elif list(live) != self._rows:  # finished dialogues leave the cache
      self.sampler.batch.select(self._convs, [self._rows.index(i) for i in live])
    self._rows = list(live)
    feeds = [self.next_tokens(dialogues[i], i) for i in live]
    out = self.sampler.batch.extend(self._convs, feeds, self.sampling, key)
    return [self.record(dialogues[i], i, feed, tokens, logprobs, ended) for i, feed, tokens,
            logprobs, ended in zip(live, feeds, out.tokens, out.logprobs, out.ended)]

  def next_tokens(self, dialogue, i):
    """What the cache row lacks: the whole prompt at first, then the new user turn."""
    view = agent_view(dialogue, self.system_prompt, raw_replies=True)
    if not self._sequences[i].tokens:
      return self.formatter.prompt_ids(view)
    last_agent = max(k for k, m in enumerate(view) if m["role"] == "assistant")
    return self.formatter.continuation_ids(view[:last_agent + 1], self._reply_ended[i],
                                           view[last_agent + 1:])

  def record(self, dialogue, i, fed, tokens, logprobs, ended):
    self._sequences[i].feed(list(fed))
    self._sequences[i].generated(list(tokens), logprobs)
    self._reply_ended[i] = ended
    self._count(dialogue, i, tokens, ended)
    return self.text(tokens, ended)

  def samples(self, dialogues, groups, reward):
    out = []
    for i, (d, seq) in enumerate(zip(dialogues, self._sequences)):
      if d.reward is None or not self.agent_tokens[i]:
        continue
      if reward == "turn":
        token_rewards = list(zip(seq.turn_ends, dynamics.turn_rewards(d.emotions)))
      else:
        token_rewards = [(seq.turn_ends[-1], d.reward)]
      out.append(Sample(tokens=seq.tokens, loss_mask=seq.loss_mask, logprobs=seq.logprobs,
                        reward=d.reward, group=groups[i], dialogue=i,
                        token_rewards=token_rewards))
    return out


@dataclasses.dataclass
class _ThinkingTurn:
  sample: Sample  # reward not yet known
  turn: int  # the dialogue's agent turns before this one
  well_formed: bool


class ThinkingTurns(Agent):
  """Thinking turns: each re-renders the dialogue without earlier thoughts and is its own sample."""

  def __init__(self, *args, format_penalty_reward: float, **kwargs):
    super().__init__(*args, **kwargs)
    self.format_penalty_reward = format_penalty_reward
    self._turns: list[_ThinkingTurn] = []

  restarts_rows = True

  def act(self, dialogues, live, key):
    prompts = [self.next_tokens(dialogues[i], i) for i in live]
    out = self.sampler.batch.generate(prompts, self.sampling, key,
                                row_ids=[self.row_ids[i] for i in live])
    return [self.record(dialogues[i], i, prompt, tokens, logprobs, ended) for i, prompt, tokens,
            logprobs, ended in zip(live, prompts, out.tokens, out.logprobs, out.ended)]

  def next_tokens(self, dialogue, i):
    """The whole dialogue so far, earlier thoughts left out."""
    return self.formatter.prompt_ids(agent_view(dialogue, self.system_prompt, raw_replies=False))

  def record(self, dialogue, i, fed, tokens, logprobs, ended):
    prompt, tokens = list(fed), list(tokens)
    text = self.text(tokens, ended)
    sample = Sample(tokens=prompt + tokens, loss_mask=[0] * len(prompt) + [1] * len(tokens),
                    logprobs=[0.0] * len(prompt) + list(logprobs), reward=0.0, group=0,
                    dialogue=i)
    self._turns.append(_ThinkingTurn(sample, dialogue.agent_turns,
                                     split_thinking(text).well_formed))
    self._count(dialogue, i, tokens, ended)
    return text

  def samples(self, dialogues, groups, reward):
    out = []
    # Turn by turn, dialogue by dialogue, in whatever order an engine took the turns.
    for turn in sorted(self._turns, key=lambda t: (t.turn, t.sample.dialogue)):
      sample, d = turn.sample, dialogues[turn.sample.dialogue]
      if d.reward is None:
        continue  # dropped by the simulator
      if not turn.well_formed:
        value = self.format_penalty_reward
      elif reward == "turn":
        deltas = dynamics.turn_rewards(d.emotions)
        value = deltas[turn.turn] if turn.turn < len(deltas) else 0.0
      else:
        value = d.reward
      out.append(dataclasses.replace(sample, reward=value, group=groups[sample.dialogue],
                                     token_rewards=[(len(sample.tokens) - 1, value)]))
    return out

  host_metrics.declare({"format_ok_rate": host_metrics.weighted("dialogues")})

  def metrics(self):
    return {**super().metrics(), "format_ok_rate": 100.0 * float(
        sum(t.well_formed for t in self._turns) / max(len(self._turns), 1))}
