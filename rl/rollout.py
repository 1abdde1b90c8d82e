"""Batched multi-turn dialogues between the policy and the simulated user.

`collect` runs a batch of dialogues to their end: the agent (`rl.agent`)
takes each live dialogue's turn, the simulator answers it, and the end
checks run (the simulator's rule set, the dialogue's token budget). GRPO
groups (n samples of one profile) share persona and opening line. The
agent's strategy, cached dialogues or thinking turns, is picked once per
batch by `make_agent`.

`RolloutConfig.engine` (`rl.rollout_config`) picks how turns are batched:
"continuous" (default, `rl.engine`: each dialogue moves on as soon as its own
reply or user turn is done) or "lockstep" (`rl.lockstep`: rounds of one
sampler call for every live dialogue, then one simulator call for all of
them; the benchmark's baseline). Both give the same dialogues.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Sequence

import jax
import numpy as np

from infra import host_metrics
from models.chat import ChatFormatter
from models.sampler import Sampler
from models.sampling import SamplingParams
from rl import engine, keys, lockstep
from rl.agent import Agent, CachedDialogues, ThinkingTurns
from rl.batch import Sample
from rl.rollout_config import RolloutConfig
from sim_user import dynamics
from sim_user.profiles import Profile
from sim_user.simulator import Dialogue, SimulatedUser


@dataclasses.dataclass
class Rollout:
  """One batch of finished dialogues (this host's share) and what training takes from them."""

  samples: list[Sample]  # [samples]: one per dialogue, or one per agent turn when thinking
  dialogues: list[Dialogue]  # [profiles * samples_per_profile], group after group
  metrics: dict  # rollout metrics (rewards, emotions, turns, tokens, times)


def make_agent(config: RolloutConfig, sampler: Sampler, formatter: ChatFormatter,
               row_ids: Sequence[int]) -> Agent:
  """The agent strategy `config` asks for, over dialogues with global ids `row_ids`."""
  sampling = SamplingParams(max_new_tokens=config.max_new_tokens,
                            temperature=config.temperature, top_p=config.top_p,
                            top_k=config.top_k)
  if config.thinking:
    return ThinkingTurns(sampler, formatter, config.system_prompt, sampling, row_ids,
                         format_penalty_reward=config.format_penalty_reward)
  return CachedDialogues(sampler, formatter, config.system_prompt, sampling, row_ids)


def collect(sampler: Sampler, formatter: ChatFormatter, user: SimulatedUser,
            profiles: Sequence[Profile], config: RolloutConfig, key: jax.Array,
            first_profile: int = 0, reward: str = "final") -> Rollout:
  """Runs one batch of dialogues to their end and returns the training samples.

  `config.system_prompt` is the prompt's text (`system_prompts.resolve` of a
  preset). `reward` (`rl.reward`): the samples' rewards, "final" (the
  dialogue's score) or "turn" (each agent turn's emotion change).
  `key` is the batch's (rl/keys.py); turn t draws with `keys.turn(key, t)`.
  `profiles` may be one host's share of a larger batch, starting at global
  profile `first_profile`: groups and sampling keys follow the global index, so
  each dialogue is the same whichever host runs it.
  """
  start_time = time.perf_counter()
  t0 = time.perf_counter()
  openers = user.start(profiles)  # one opening per profile, shared by its group
  sim_seconds = time.perf_counter() - t0
  n = config.samples_per_profile
  dialogues = [copy.deepcopy(opener) for opener in openers for _ in range(n)]
  groups = [first_profile + i // n for i in range(len(dialogues))]
  agent = make_agent(config, sampler, formatter,
                     row_ids=[first_profile * n + i for i in range(len(dialogues))])

  turn_key = lambda turn: keys.turn(key, turn)
  stats_before = copy.copy(sampler.weights.stats)
  sim_events_before = dict(user.metrics)
  if config.engine == "continuous":
    sim_seconds += engine.run(sampler, agent, user, dialogues, config, turn_key)
  else:
    sim_seconds += lockstep.run(agent, user, dialogues, config, turn_key)

  samples = agent.samples(dialogues, groups, reward)
  metrics = rollout_metrics(samples, dialogues, user.emotion_rules)
  wall = time.perf_counter() - start_time
  agent_metrics = agent.metrics()
  metrics.update(simulator_events(user.metrics, sim_events_before))
  metrics.update({"time/rollout": wall, "time/simulator": sim_seconds, **agent_metrics,
                  **sampler.weights.stats.since(stats_before).metrics(),
                  "rollout/sim_wait_s": sim_seconds,
                  "rollout/tokens_per_s": agent_metrics["tokens/generated"] / max(wall, 1e-9)})
  return Rollout(samples=samples, dialogues=dialogues, metrics=metrics)


# How hosts combine the metrics of `collect` and `rollout_metrics` (infra/host_metrics.py): means
# over samples or dialogues weigh by each host's, counts sum, a step waits for the slowest host.
host_metrics.declare({
    "reward/mean": host_metrics.weighted("samples"),
    "response_len/mean": host_metrics.weighted("samples"),
    "emotion/final_mean": host_metrics.weighted("kept_dialogues"),
    "success_rate": host_metrics.weighted("kept_dialogues"),
    "failure_rate": host_metrics.weighted("kept_dialogues"),
    "turns/mean": host_metrics.weighted("dialogues"),
    "dialogues/simulator_failed": host_metrics.SUM, "dialogues/dropped": host_metrics.SUM,
    "time/rollout": host_metrics.MAX, "time/simulator": host_metrics.MAX,
    "rollout/sim_wait_s": host_metrics.MAX,
    "rollout/tokens_per_s": host_metrics.ratio("tokens/generated", "time/rollout")})
# emotion/final/<intention> and success_rate/<intention> weigh by the host's kept dialogues of
# that intention (counted as emotion/final/<intention>).
host_metrics.declare_family("emotion/final/", host_metrics.weighted("emotion/final/"))
host_metrics.declare_family("success_rate/", host_metrics.weighted("emotion/final/"))


# The replies the scripted user could not read (its counts, sim_user/backends/scripted.py), in
# percent.
REPLIES_JUDGED = "sim/scripted/replies_judged"
REPLIES_UNREADABLE = "sim/scripted/replies_unreadable"
host_metrics.declare({"replies/garbled_rate": host_metrics.ratio(
    REPLIES_UNREADABLE, REPLIES_JUDGED, 100.0)})


def simulator_events(counts: dict, before: dict) -> dict:
  """The simulator's event counts since `before` (the batch's), and the share of the agent's
  replies its user could not read where the user counts them (the scripted one does)."""
  events = {key: count - before.get(key, 0) for key, count in counts.items()}
  judged = events.get(REPLIES_JUDGED)
  if judged:
    events["replies/garbled_rate"] = 100.0 * events.get(REPLIES_UNREADABLE, 0) / judged
  return events


def rollout_metrics(samples: Sequence[Sample], dialogues: Sequence[Dialogue],
                    rules: dynamics.EmotionRules) -> dict:
  """Rewards, emotions and lengths of a finished batch (dropped dialogues not scored). A mean
  over nothing (no sample, no kept dialogue) is left out, not 0: the curves show a gap."""
  kept = [d for d in dialogues if not d.dropped]
  metrics = {
      "dialogues/simulator_failed": sum(1 for d in dialogues if d.failure and not d.dropped),
      "dialogues/dropped": sum(1 for d in dialogues if d.dropped),
  }
  if samples:
    metrics["reward/mean"] = float(np.mean([s.reward for s in samples]))
    metrics["response_len/mean"] = float(np.mean([sum(s.loss_mask) for s in samples]))
  if dialogues:
    metrics["turns/mean"] = float(np.mean([d.agent_turns for d in dialogues]))
  if kept:
    finals = np.array([d.emotion for d in kept])
    metrics["emotion/final_mean"] = float(np.mean(finals))
    metrics["success_rate"] = 100.0 * float(np.mean(finals >= 100))
    metrics["failure_rate"] = 100.0 * float(np.mean([dynamics.is_failure(rules, e)
                                                     for e in finals]))
  for intention in sorted({d.profile.intention for d in kept if d.profile.intention}):
    intention_finals = np.array([d.emotion for d in kept if d.profile.intention == intention])
    metrics[f"emotion/final/{intention}"] = float(np.mean(intention_finals))
    metrics[f"success_rate/{intention}"] = 100.0 * float(np.mean(intention_finals >= 100))
  return metrics
