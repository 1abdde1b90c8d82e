"""What a rollout is asked to do, and the rule that ends a dialogue on its token budget.

Its own module because `rl.rollout` (which dispatches to an engine) and both
engines (`rl.lockstep`, `rl.engine`) read it: the engines import it, not the
rollout, so no import runs back from an engine to its dispatcher.
"""

from __future__ import annotations

import dataclasses

from sim_user.simulator import Dialogue

TOKEN_BUDGET = "token_budget"  # Dialogue.end_reason of a dialogue over max_dialogue_tokens
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
  # continuous: rl.engine's continuous batching across turns; lockstep: rl.lockstep, every
  # live dialogue's turn in one sampler call per round (the benchmark's baseline)
  engine: str = "continuous"

  def __post_init__(self):
    if self.reward not in ("final", "turn"):
      raise ValueError(f"rollout reward {self.reward!r}; expected final or turn")
    if self.engine not in ENGINES:
      raise ValueError(f"rollout engine {self.engine!r}; expected one of {', '.join(ENGINES)}")


def end_if_over_budget(dialogue: Dialogue, agent_tokens: int, config: RolloutConfig) -> None:
  """The token budget rule, once the dialogue's user turn is in."""
  if not dialogue.done and agent_tokens >= config.max_dialogue_tokens:
    dialogue.end_reason = TOKEN_BUDGET
