"""Sentient Benchmark evaluation: a policy against the simulated user under SAGE's rules.

  python -m rlver_jax.eval --config=configs/eval.py --config.policy.checkpoint=DIR \
      --config.eval.profiles=FILE --config.workdir=W [--config.sim_user.backend=openai ...]

Writes W/results.jsonl (SAGE's result format: id, emo_point, emo_state,
history with per-turn emotion and planning, ...), W/summary.json (n, score,
success_rate, failure_rate in percent, per-intention and per-character
breakdowns, decoding settings, and the dialogues that failed for
infrastructure reasons, which are listed and not scored), and PNG plots of
the emotion trajectories and the final-score histogram.
"""

from __future__ import annotations

import collections
import json
import os

import jax
from absl import logging
from tqdm import tqdm

from rl import rollout as rollout_lib
from rlver_jax import cli, multihost, sharding, simulator_factory
from rlver_jax import policy as policy_lib
from sim_user import dynamics, profiles as profiles_lib
from sim_user.simulator import Dialogue


def sage_record(d: Dialogue) -> dict:
  p = d.profile
  return {"id": p.id, "emo_point": d.emotion,
          "emo_state": f"Emotion-{dynamics.emotion_state(d.emotion)}", "target": "eq",
          "player": p.player, "scene": p.scene, "character": p.main_cha, "topic": p.topic,
          "task": p.task, "end_reason": d.end_reason, "history": d.history}


def summarize(dialogues: list[Dialogue], settings: dict) -> dict:
  scored = [d for d in dialogues if not d.failure]
  summary = dynamics.summarize([d.emotion for d in scored])
  for key, field in (("by_intention", "intention"), ("by_character", "main_cha")):
    groups: dict[str, list[float]] = {}
    for d in scored:
      groups.setdefault(str(getattr(d.profile, field)), []).append(d.emotion)
    summary[key] = {name: dynamics.summarize(values) for name, values in sorted(groups.items())}
  summary["end_reasons"] = dict(collections.Counter(d.end_reason for d in scored))
  summary["mean_agent_turns"] = (sum(d.agent_turns for d in scored) / len(scored)) if scored else 0
  summary["failed"] = [{"id": d.profile.id, "reason": d.failure} for d in dialogues if d.failure]
  summary["n_failed"] = len(summary["failed"])
  summary["settings"] = settings
  return summary


def plot(dialogues: list[Dialogue], workdir: str) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  scored = [d for d in dialogues if not d.failure]
  paths = []
  fig, ax = plt.subplots(figsize=(7, 4))
  for d in scored:
    ax.plot(range(len(d.emotions)), d.emotions, alpha=0.25, linewidth=1)
  longest = max((len(d.emotions) for d in scored), default=0)
  if longest:
    mean = [sum(d.emotions[min(t, len(d.emotions) - 1)] for d in scored) / len(scored)
            for t in range(longest)]
    ax.plot(range(longest), mean, color="black", linewidth=2.5, label="mean (final value carried)")
    ax.legend(loc="best")
  for level in (10, 40, 70, 100):
    ax.axhline(level, color="grey", linestyle=":", linewidth=0.8)
  ax.set(xlabel="user turn", ylabel="emotion", title=f"Emotion trajectories ({len(scored)} dialogues)")
  fig.tight_layout()
  paths.append(os.path.join(workdir, "emotion_trajectories.png"))
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 4))
  ax.hist([d.emotion for d in scored], bins=list(range(-10, 111, 10)), edgecolor="black")
  ax.set(xlabel="final emotion", ylabel="dialogues",
         title=f"Final scores, mean {dynamics.summarize([d.emotion for d in scored])['score']:.1f}")
  fig.tight_layout()
  paths.append(os.path.join(workdir, "final_scores.png"))
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths


def evaluate(config) -> dict:
  if not config.workdir:
    raise ValueError("no workdir: set --config.workdir=DIR")
  if not config.policy.checkpoint:
    raise ValueError("no policy checkpoint: set --config.policy.checkpoint=DIR")
  if not config.eval.profiles:
    raise ValueError("no profiles: set --config.eval.profiles=FILE.jsonl (RLVER's "
                     "test_profile.jsonl for the Sentient Benchmark)")
  os.makedirs(config.workdir, exist_ok=True)
  sharding.maybe_initialize_distributed()
  mesh = multihost.local_mesh(dict(config.mesh))  # each host runs its own dialogues
  profiles = profiles_lib.load_profiles(config.eval.profiles)
  policy = policy_lib.load_policy(config.policy.checkpoint, dtype=config.policy.dtype,
                                 param_dtype=config.policy.param_dtype, mesh=mesh)
  user = simulator_factory.make_simulated_user(config.sim_user, mesh)
  e = config.eval
  rollout_cfg = rollout_lib.RolloutConfig(
      samples_per_profile=1, system_prompt=e.system_prompt, thinking=e.thinking,
      max_new_tokens=e.max_new_tokens, max_dialogue_tokens=10**9, temperature=e.temperature,
      top_p=e.top_p, top_k=e.top_k)

  dialogues: list[Dialogue] = []
  with tqdm(total=len(profiles), unit="dialogue", desc="eval",
            disable=jax.process_index() != 0) as bar:
    for start in range(0, len(profiles), e.batch_size):
      batch = profiles[start:start + e.batch_size]
      share = multihost.share_of(len(batch))  # this host's block of the batch
      mine = rollout_lib.collect(policy.sampler, policy.formatter, user,
                                 batch[share.start:share.stop], rollout_cfg,
                                 seed=config.seed + start, first_profile=share.start
                                 ).dialogues if share else []
      dialogues += multihost.gather_dialogues(mine)
      bar.update(len(batch))
      scored = [d.emotion for d in dialogues if not d.failure]
      bar.set_postfix(score=f"{dynamics.summarize(scored)['score']:.1f}")

  simulator_events = multihost.sum_counts(user.metrics)
  if jax.process_index() != 0:  # process 0 writes every host's results
    return {}
  with open(os.path.join(config.workdir, "results.jsonl"), "w") as f:
    for d in dialogues:
      f.write(json.dumps(sage_record(d), ensure_ascii=False) + "\n")
  settings = {"checkpoint": config.policy.checkpoint, "profiles": config.eval.profiles,
              "rules": user.rules.name, "simulator": config.sim_user.backend,
              "simulator_model": config.sim_user.model, "variant": config.sim_user.variant,
              "thinking": e.thinking, "system_prompt": e.system_prompt,
              "temperature": e.temperature, "top_p": e.top_p, "top_k": e.top_k,
              "max_new_tokens": e.max_new_tokens, "dtype": config.policy.dtype,
              "seed": config.seed, "simulator_events": simulator_events}
  summary = summarize(dialogues, settings)
  with open(os.path.join(config.workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2, ensure_ascii=False)
  summary["plots"] = plot(dialogues, config.workdir)
  logging.info("score %.2f, success %.1f%%, failure %.1f%% over %d dialogues (%d failed for "
               "infrastructure reasons, not scored)", summary["score"], summary["success_rate"],
               summary["failure_rate"], summary["n"], summary["n_failed"])
  return summary


if __name__ == "__main__":
  cli.run("eval.py", "evaluation config file[:variant]", multihost.guarded(evaluate))
