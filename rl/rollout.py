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
from models.sampler import LENGTH, STOP, Sampler, SamplingParams
from sim_user import dynamics
from sim_user.profiles import Profile
from sim_user.simulator import Dialogue, SimulatedUser
from sim_user.thinking import split_thinking

TOKEN_BUDGET = "token_budget"


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

  def __post_init__(self):
    if self.reward not in ("final", "turn"):
      raise ValueError(f"rollout reward {self.reward!r}; expected final or turn")


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


def collect(sampler: Sampler, formatter: ChatFormatter, user: SimulatedUser,
            profiles: Sequence[Profile], config: RolloutConfig, seed: int,
            first_profile: int = 0) -> Rollout:
  """Runs one batch of dialogues to their end and returns the training samples.

  `profiles` may be one host's share of a larger batch, starting at global
  profile `first_profile`: groups and sampling keys follow the global index, so
  each dialogue is the same whichever host runs it.
  """
  start_time = time.perf_counter()
  sim_seconds = 0.0
  t0 = time.perf_counter()
  openers = user.start(profiles)  # one opening per profile, shared by its group
  sim_seconds += time.perf_counter() - t0
  dialogues, groups = [], []
  for group, opener in enumerate(openers):
    for _ in range(config.samples_per_profile):
      dialogues.append(copy.deepcopy(opener))
      groups.append(first_profile + group)

  params = lambda turn: SamplingParams(
      max_new_tokens=config.max_new_tokens, temperature=config.temperature,
      top_p=config.top_p, top_k=config.top_k, seed=seed * 1000 + turn)
  sequences = [_Sequence() for _ in dialogues]
  row_offset = first_profile * config.samples_per_profile  # global index of dialogue 0
  thinking_samples: list[Sample] = []
  thinking_turns: list[tuple[int, int, bool]] = []  # (dialogue, turn, well formed) per sample
  live = [i for i, d in enumerate(dialogues) if not d.done]
  convs = sampler.start(len(live)) if live and not config.thinking else None
  reply_ended = [True] * len(dialogues)
  generated_turns, cut_off_turns = 0, 0  # cut off: hit max_new_tokens (stop reason "length")
  turn = 0
  while live:
    if config.thinking:
      prompts = [formatter.prompt_ids(_agent_view(dialogues[i], config.system_prompt, False))
                 for i in live]
      out = sampler.generate(prompts, params(turn), [row_offset + i for i in live])
    else:
      feeds = []
      for i in live:
        d = dialogues[i]
        if not sequences[i].tokens:
          feeds.append(formatter.prompt_ids(_agent_view(d, config.system_prompt, True)))
        else:
          view = _agent_view(d, config.system_prompt, True)
          last_agent = max(k for k, m in enumerate(view) if m["role"] == "assistant")
          feeds.append(formatter.continuation_ids(view[:last_agent + 1], reply_ended[i],
                                                  view[last_agent + 1:]))
      for i, feed in zip(live, feeds):
        sequences[i].feed(feed)
      out = sampler.extend(convs, feeds, params(turn), [row_offset + i for i in live])

    replies = []
    for row, i in enumerate(live):
      tokens, logprobs, reason = out.tokens[row], out.logprobs[row], out.stop_reasons[row]
      reply_ended[i] = reason == STOP
      generated_turns += 1
      cut_off_turns += reason == LENGTH
      body = tokens[:-1] if reason == STOP else tokens
      # Special tokens stay: <think> may be one, and the format check needs it.
      text = formatter.tokenizer.decode(body, skip_special_tokens=False)
      if config.thinking:
        split = split_thinking(text)
        thinking_samples.append(Sample(
            tokens=prompts[row] + tokens, loss_mask=[0] * len(prompts[row]) + [1] * len(tokens),
            logprobs=[0.0] * len(prompts[row]) + list(logprobs), reward=0.0, group=groups[i],
            dialogue=i))
        thinking_turns.append((i, dialogues[i].agent_turns, split.well_formed))
        sequences[i].agent_tokens += len(tokens)
        replies.append(text)  # the simulator strips the thoughts itself
      else:
        sequences[i].generated(tokens, logprobs)
        replies.append(text)

    t0 = time.perf_counter()
    user.respond([dialogues[i] for i in live], replies)
    sim_seconds += time.perf_counter() - t0
    for i in live:
      if not dialogues[i].done and sequences[i].agent_tokens >= config.max_dialogue_tokens:
        dialogues[i].end_reason = TOKEN_BUDGET
    still = [row for row, i in enumerate(live) if not dialogues[i].done]
    if still and convs is not None and len(still) < len(live):
      convs = sampler.select(convs, still)
    live = [live[row] for row in still]
    turn += 1

  samples = []
  if config.thinking:
    for sample, (i, turn_index, well_formed) in zip(thinking_samples, thinking_turns):
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
    for i, (d, seq) in enumerate(zip(dialogues, sequences)):
      if d.reward is None or not seq.agent_tokens:
        continue
      if config.reward == "turn":
        token_rewards = list(zip(seq.turn_ends, dynamics.turn_rewards(d.emotions)))
      else:
        token_rewards = [(seq.turn_ends[-1], d.reward)]
      samples.append(Sample(tokens=seq.tokens, loss_mask=seq.loss_mask, logprobs=seq.logprobs,
                            reward=d.reward, group=groups[i], dialogue=i,
                            token_rewards=token_rewards))

  kept = [d for d in dialogues if not d.dropped]
  finals = np.array([d.emotion for d in kept]) if kept else np.zeros(1)
  response_lens = [sum(s.loss_mask) for s in samples] or [0]
  metrics = {
      "reward/mean": float(np.mean([s.reward for s in samples])) if samples else 0.0,
      "emotion/final_mean": float(np.mean(finals)),
      "success_rate": 100.0 * float(np.mean(finals >= 100)),
      "failure_rate": 100.0 * float(np.mean([dynamics.is_failure(user.rules, e) for e in finals])),
      "turns/mean": float(np.mean([d.agent_turns for d in dialogues])),
      "response_len/mean": float(np.mean(response_lens)),
      "dialogues/simulator_failed": sum(1 for d in dialogues if d.failure and not d.dropped),
      "dialogues/dropped": sum(1 for d in dialogues if d.dropped),
      "time/rollout": time.perf_counter() - start_time,
      "time/simulator": sim_seconds,
      "tokens/generated": int(sum(seq.agent_tokens for seq in sequences)),
      "agent_turns/generated": generated_turns,
      "agent_turns/cut_off": cut_off_turns,
      "agent_turns/cut_off_rate": 100.0 * cut_off_turns / max(generated_turns, 1),
  }
  for intention in sorted({d.profile.intention for d in kept if d.profile.intention}):
    metrics[f"emotion/final/{intention}"] = float(np.mean(
        [d.emotion for d in kept if d.profile.intention == intention]))
  if config.thinking:
    metrics["format_ok_rate"] = 100.0 * float(np.mean([ok for *_, ok in thinking_turns] or [0]))
  return Rollout(samples=samples, dialogues=dialogues, metrics=metrics)
