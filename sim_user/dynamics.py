"""Emotion dynamics: pure functions of the named rule sets.

`sage_benchmark` is the Sentient Benchmark's: start 40, each change clipped
to [-10, 10], e <- min(e + change, 100), ends on goodbye, e >= 100, e < 10 or
with the agent's 10th reply, which is never judged: 10 agent replies, at most
9 judged user turns. SAGE's loop (`test_npc.py`) stops at `turns > 10` after
the agent has replied, and every turn-limited dialogue in its recorded result
files has 10 agent replies and 9 judged turns.

`rlver_train` is RLVER's training simulator: start 30, no clip, same cap,
ends on goodbye, e <= 0 or after the agent's 9th reply, which is judged (9
agent replies, 9 judged turns). The paper's appendix says 8 agent turns; the
release's rollout (`vllm_rollout_spmd.py`) counts a turn before the agent
replies, has the simulator judge and answer, then stops when
`turn_count > max_turns` with max_turns 8, i.e. after the 9th judged reply.
We follow the release; `with_max_agent_turns(RLVER_TRAIN, 8)` (config
`sim_user.max_agent_turns=8`) gives the paper's count.
"""

from __future__ import annotations

import dataclasses

# End reasons.
GOODBYE = "goodbye"
SUCCESS = "success"  # reached the top of the scale
FAILURE = "failure"  # fell through the floor
MAX_TURNS = "max_turns"


@dataclasses.dataclass(frozen=True)
class EmotionRules:
  name: str
  initial: float
  max_agent_turns: int  # the dialogue ends with the agent's reply number max_agent_turns ...
  judge_last_reply: bool  # ... after the simulator judged it (True) or without judging it
  clip: float | None  # |change| bound per turn; None: unclipped
  cap: float = 100.0
  success_at: float | None = 100.0  # ends when e >= this (None: never)
  failure_below: float = 10.0  # ends when e < this ...
  failure_inclusive: bool = False  # ... or e <= this when inclusive


SAGE_BENCHMARK = EmotionRules("sage_benchmark", initial=40.0, max_agent_turns=10,
                              judge_last_reply=False, clip=10.0, success_at=100.0,
                              failure_below=10.0)
RLVER_TRAIN = EmotionRules("rlver_train", initial=30.0, max_agent_turns=9, judge_last_reply=True,
                           clip=None, success_at=None, failure_below=0.0, failure_inclusive=True)
RULES = {r.name: r for r in (SAGE_BENCHMARK, RLVER_TRAIN)}


def get_rules(name: str) -> EmotionRules:
  if name not in RULES:
    raise ValueError(f"unknown emotion rules {name!r}; known: {sorted(RULES)}")
  return RULES[name]


def with_max_agent_turns(rules: EmotionRules, max_agent_turns: int) -> EmotionRules:
  """`rules` with another turn limit; 0 keeps the rule set's own.

  Whether the last reply is judged stays the rule set's: a limit of 8 under
  `rlver_train` is the paper's 8 judged agent turns.
  """
  if max_agent_turns < 0:
    raise ValueError(f"max_agent_turns must be >= 0 (0: the rule set's own), got {max_agent_turns}")
  if not max_agent_turns:
    return rules
  return dataclasses.replace(rules, max_agent_turns=max_agent_turns)


def last_reply_unjudged(rules: EmotionRules, agent_turns: int) -> bool:
  """True when the agent's reply number `agent_turns` ends the dialogue without being judged."""
  return not rules.judge_last_reply and agent_turns >= rules.max_agent_turns


def update(rules: EmotionRules, emotion: float, change: float) -> float:
  if rules.clip is not None:
    change = max(-rules.clip, min(rules.clip, change))
  return min(emotion + change, rules.cap)


def is_failure(rules: EmotionRules, emotion: float) -> bool:
  if rules.failure_inclusive:
    return emotion <= rules.failure_below
  return emotion < rules.failure_below


def end_reason(rules: EmotionRules, emotion: float, agent_turns: int,
               said_goodbye: bool = False) -> str | None:
  """Why the dialogue ends after this judged user turn, or None if it goes on.

  Under rules that do not judge the last reply the turn limit is reached
  before a judgement (`last_reply_unjudged`), never here.
  """
  if rules.success_at is not None and emotion >= rules.success_at:
    return SUCCESS
  if is_failure(rules, emotion):
    return FAILURE
  if said_goodbye:
    return GOODBYE
  if agent_turns >= rules.max_agent_turns:
    return MAX_TURNS
  return None


def emotion_state(emotion: float) -> str:
  """SAGE's letter for an emotion: S >= 100, A >= 70, B >= 40, C >= 10, F below."""
  for letter, floor in (("S", 100), ("A", 70), ("B", 40), ("C", 10)):
    if emotion >= floor:
      return letter
  return "F"


def reward(final_emotion: float) -> float:
  """The RLVER reward: max(e_T, 0) / 100, on the dialogue's last token."""
  return max(final_emotion, 0.0) / 100.0


def turn_rewards(emotions: list[float]) -> list[float]:
  """Per-turn rewards for ablations: each user turn's emotion change / 100.

  `emotions` is the trajectory starting with the initial value; the rewards
  sum to (e_T - e_0) / 100.
  """
  return [(b - a) / 100.0 for a, b in zip(emotions, emotions[1:])]


def is_success(emotion: float) -> bool:
  """Success as the benchmark counts it: e >= 100."""
  return emotion >= 100


def summarize(final_emotions: list[float], failure_below: float = 10.0) -> dict:
  """Benchmark summary: mean final emotion, success and failure rates in percent."""
  n = len(final_emotions)
  if not n:
    return {"n": 0, "score": 0.0, "success_rate": 0.0, "failure_rate": 0.0}
  return {"n": n, "score": sum(final_emotions) / n,
          "success_rate": 100.0 * sum(is_success(e) for e in final_emotions) / n,
          "failure_rate": 100.0 * sum(e < failure_below for e in final_emotions) / n}
