"""Lockstep rounds: the rollout engine that batches one turn of every live dialogue at a time.

Each round is one agent call for every live dialogue (`Agent.act`: one
sampler call), then one simulator call for all of their user turns, then the
end checks; a round waits for its longest reply and its slowest user turn.
It is the benchmark's baseline for the continuous engine (`rl.engine`), and
gives the same dialogues: dialogue i draws its turn-t reply with the turn's
key folded with its row id in both.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax

from rl.agent import Agent
from rl.rollout_config import RolloutConfig, end_if_over_budget
from sim_user.simulator import Dialogue, SimulatedUser


def run(agent: Agent, user: SimulatedUser, dialogues: Sequence[Dialogue],
        config: RolloutConfig, turn_key: Callable[[int], jax.Array]) -> float:
  """Rounds of one agent turn in every live dialogue, then one user turn in every one.
  Returns the time spent waiting for the simulator."""
  sim_seconds = 0.0
  live = [i for i, d in enumerate(dialogues) if not d.done]
  turn = 0
  while live:
    replies = agent.act(dialogues, live, turn_key(turn))
    t0 = time.perf_counter()
    user.respond([dialogues[i] for i in live], replies)
    sim_seconds += time.perf_counter() - t0
    for i in live:
      end_if_over_budget(dialogues[i], agent.agent_tokens[i], config)
    live = [i for i in live if not dialogues[i].done]
    turn += 1
  return sim_seconds
