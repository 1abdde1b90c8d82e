"""Sentient Benchmark evaluation: a policy against the simulated user under SAGE's rules.

  python -m rlver_jax.eval --config=configs/eval.py --config.policy.checkpoint=DIR \
      --config.eval.profiles=FILE --config.workdir=W [--config.sim_user.backend=openai ...]

Writes W/results.jsonl (SAGE's result format: id, emo_point, emo_state,
history with per-turn emotion and planning, ..., plus `failure`, the reason
a dialogue failed for infrastructure reasons, or null), one line appended as
each batch of dialogues ends; W/summary.json (n, score, success_rate,
failure_rate in percent, per-intention and per-character breakdowns, decoding
settings and the exact system prompt, the share of agent turns cut off by
max_new_tokens (cut_off_rate, percent), simulator events, and the failed
dialogues, which are listed and not scored), and PNG plots of the emotion
trajectories and the final-score histogram. Rerun in the same workdir, it
resumes: profiles with a scored record are skipped, failed ones are run again.
It raises EvaluationError when fewer than `eval.min_scored_share` of the
profiles were scored. With `eval.baseline_checkpoint` (e.g. the untrained
policy) that checkpoint is evaluated the same way first, in W/baseline, and
both scores are printed side by side.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Sequence

import jax
from absl import logging
from tqdm import tqdm

from infra.errors import RunStopped
from rl import keys
from rl import rollout as rollout_lib
from rlver_jax import builder, cli, multihost, run_config, sections, sharding, watchdog
from rlver_jax import metrics as metrics_lib
from rlver_jax import simulator_factory
from rlver_jax import workdir as workdir_lib
from sim_user import dynamics, profiles as profiles_lib
from sim_user.simulator import Dialogue


class EvaluationError(RunStopped):
  """Too few profiles were scored for the score to mean anything."""


RESULTS_FILE = "results.jsonl"
SIMULATOR_EVENTS_FILE = "simulator_events.json"  # sim/* counters summed over resumed runs
# Text from a server may hold a lone surrogate, which UTF-8 cannot encode: it is written as the
# JSON escape `\ud800`, which reads back as the same text.
WRITE_TEXT = dict(encoding="utf-8", errors="backslashreplace")
RETRIES_SUCCEEDED = "sim/retries_succeeded"


def sage_record(d: Dialogue) -> dict:
  p = d.profile
  return {"id": p.id, "emo_point": d.emotion,
          "emo_state": f"Emotion-{dynamics.emotion_state(d.emotion)}", "target": "eq",
          "player": p.player, "scene": p.scene, "character": p.main_cha, "topic": p.topic,
          "task": p.task, "end_reason": d.end_reason, "history": d.history,
          "failure": d.failure, "agent_turns_cut_off": d.replies_cut_off}


def emotion_trajectory(record: dict) -> list[float]:
  """The user's emotion after each of its turns, the opening's (initial) value first."""
  return [turn["emotion-point"] for turn in record["history"] if turn["role"] == "user"]


def summarize(records: Sequence[dict], profiles_by_id: dict, settings: dict,
              simulator_events: dict) -> dict:
  """The benchmark summary of SAGE records (failed ones listed, not scored)."""
  scored = [r for r in records if not r.get("failure")]
  summary = dynamics.summarize([r["emo_point"] for r in scored])
  group_of = {"by_intention": lambda r: profiles_by_id[r["id"]].intention,
              "by_character": lambda r: r["character"]}
  for key, group in group_of.items():
    groups: dict[str, list[float]] = {}
    for r in scored:
      groups.setdefault(str(group(r)), []).append(r["emo_point"])
    summary[key] = {name: dynamics.summarize(values) for name, values in sorted(groups.items())}
  summary["end_reasons"] = dict(collections.Counter(r["end_reason"] for r in scored))
  agent_turns = [sum(turn["role"] == "assistant" for turn in r["history"]) for r in scored]
  summary["mean_agent_turns"] = (sum(agent_turns) / len(scored)) if scored else 0
  # Agent turns that hit max_new_tokens (stop reason "length"), of the scored dialogues.
  summary["agent_turns_generated"] = sum(agent_turns)
  summary["agent_turns_cut_off"] = sum(r.get("agent_turns_cut_off", 0) for r in scored)
  summary["cut_off_rate"] = 100.0 * summary["agent_turns_cut_off"] / max(sum(agent_turns), 1)
  summary["failed"] = [{"id": r["id"], "reason": r["failure"]} for r in records if r.get("failure")]
  summary["n_failed"] = len(summary["failed"])
  summary["retries_succeeded"] = simulator_events.get(RETRIES_SUCCEEDED, 0)
  summary["simulator_events"] = simulator_events
  summary["settings"] = settings
  return summary


def plot(records: Sequence[dict], workdir: str) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  scored = [r for r in records if not r.get("failure")]
  trajectories = [emotion_trajectory(r) for r in scored]
  paths = []
  fig, ax = plt.subplots(figsize=(7, 4))
  for emotions in trajectories:
    ax.plot(range(len(emotions)), emotions, alpha=0.25, linewidth=1)
  longest = max((len(emotions) for emotions in trajectories), default=0)
  if longest:
    mean = [sum(e[min(t, len(e) - 1)] for e in trajectories) / len(trajectories)
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
  finals = [r["emo_point"] for r in scored]
  ax.hist(finals, bins=list(range(-10, 111, 10)), edgecolor="black")
  ax.set(xlabel="final emotion", ylabel="dialogues",
         title=f"Final scores, mean {dynamics.summarize(finals)['score']:.1f}")
  fig.tight_layout()
  paths.append(os.path.join(workdir, "final_scores.png"))
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths


def evaluate(config) -> dict:
  """Runs the benchmark; every host runs its block of each batch, process 0 writes the files.

  The workdir is shared by the hosts (as the checkpoints are): all read the
  results of an earlier run to resume, only process 0 writes.
  """
  run = sections.eval_run(config)
  sharding.maybe_initialize_distributed()
  with workdir_lib.claim(run.workdir):  # one evaluation per workdir, as one training run
    return _evaluate(run, config)


def _evaluate(config: sections.EvalRun, config_dict) -> dict:
  """`evaluate` of the typed run `config`; `config_dict`, as given, goes to W/config.json."""
  primary = jax.process_index() == 0
  e = config.eval
  profiles = profiles_lib.load_profiles(config.eval.profiles,
                                        config.sim_user.max_message_chars)[:e.limit or None]
  results_path = os.path.join(config.workdir, RESULTS_FILE)
  previous = metrics_lib.read_appended_jsonl(results_path)
  run_config.check_and_save(config_dict, config.workdir, resuming=bool(previous))
  by_id = {r["id"]: r for r in previous if not r.get("failure")}  # failed ones run again
  events_path = os.path.join(config.workdir, SIMULATOR_EVENTS_FILE)
  earlier_events = _read_json(events_path) if previous else {}
  todo = [p for p in profiles if p.id not in by_id]
  if previous:
    logging.info("resuming %s: %d of %d profiles already scored", results_path,
                 len(profiles) - len(todo), len(profiles))

  # each host runs its own dialogues
  mesh = multihost.local_mesh(dataclasses.asdict(config.mesh))
  policy = builder.inference_policy(config, mesh)
  user = builder.simulated_user(config, mesh)
  rollout_cfg = builder.eval_rollout_config(config)

  if primary:
    _write_records(results_path, list(by_id.values()))
  events = dict(earlier_events)
  results_file = open(results_path, "a", **WRITE_TEXT) if primary else None
  with tqdm(total=len(profiles), initial=len(profiles) - len(todo), unit="dialogue",
            desc="eval", disable=not primary) as bar:
    for start in range(0, len(todo), e.batch_size):
      batch = todo[start:start + e.batch_size]
      share = multihost.share_of(len(batch))  # this host's block of the batch
      mine = rollout_lib.collect(policy.sampler, policy.formatter, user,
                                 batch[share.start:share.stop], rollout_cfg,
                                 keys.batch(config.seed, keys.EVALUATION, start),
                                 first_profile=share.start
                                 ) if share else None
      records = multihost.gather_records([sage_record(d) for d in mine.dialogues] if mine else [])
      events = dict(collections.Counter(earlier_events)
                    + collections.Counter(multihost.sum_counts(user.metrics)))
      for record in records:
        by_id[record["id"]] = record
      if primary:  # on disk as soon as the batch ends: a kill loses no more
        results_file.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        results_file.flush()
        _write_json(events_path, events)
      bar.update(len(batch))
      scored = [r["emo_point"] for r in by_id.values() if not r["failure"]]
      bar.set_postfix(score=f"{dynamics.summarize(scored)['score']:.1f}",
                      sim_fail=sum(1 for r in by_id.values() if r["failure"]))
  if not primary:
    return {}
  results_file.close()

  selected = {p.id for p in profiles}
  records = [by_id[p.id] for p in profiles]
  _write_records(results_path, records + [r for r in by_id.values() if r["id"] not in selected])
  settings = {"checkpoint": config.policy.checkpoint, "profiles": config.eval.profiles,
              "limit": e.limit, "rules": user.emotion_rules.name,
              "simulator": config.sim_user.backend,
              "simulator_model": config.sim_user.model, "variant": config.sim_user.variant,
              "thinking": e.thinking, "system_prompt_setting": e.system_prompt,
              "system_prompt": rollout_cfg.system_prompt,
              "temperature": e.temperature, "top_p": e.top_p, "top_k": e.top_k,
              "max_new_tokens": e.max_new_tokens, "dtype": config.policy.dtype,
              "seed": config.seed}
  # From the records, resumed ones included: a rerun changes only what it recomputed.
  summary = summarize(records, {p.id: p for p in profiles}, settings, events)
  summary_path = os.path.join(config.workdir, "summary.json")
  _write_json(summary_path, summary)
  summary["plots"] = plot(records, config.workdir)
  print(f"evaluation of {len(records)} profiles written to {os.path.abspath(config.workdir)}:\n"
        + "\n".join(f"  {name + ':':9s}{os.path.abspath(path)}" for name, path in (
            ("results", results_path), ("summary", summary_path),
            *(("plot", path) for path in summary["plots"]))), flush=True)
  logging.info("score %.2f, success %.1f%%, failure %.1f%% over %d dialogues (%d failed for "
               "infrastructure reasons, not scored); %.1f%% of agent turns cut off at "
               "max_new_tokens", summary["score"], summary["success_rate"],
               summary["failure_rate"], summary["n"], summary["n_failed"], summary["cut_off_rate"])
  if summary["n"] < e.min_scored_share * len(profiles):
    reasons = "; ".join(f["reason"] for f in summary["failed"][-3:])
    raise EvaluationError(
        f"scored {summary['n']} of {len(profiles)} profiles, fewer than eval.min_scored_share="
        f"{e.min_scored_share}: the simulator {simulator_factory.describe(config.sim_user)} "
        f"failed {summary['n_failed']} dialogues (last: {reasons}). Rerun the same command to "
        f"run the failed ones again; the scored ones are kept in {results_path}")
  return summary


def evaluate_with_baseline(config) -> dict:
  """`evaluate`; with eval.baseline_checkpoint set, that checkpoint is evaluated the same way
  first (in W/baseline) and both scores are printed side by side: a before/after."""
  if not config.eval.baseline_checkpoint:
    return evaluate(config)
  baseline = config.copy_and_resolve_references()
  baseline.policy.checkpoint = config.eval.baseline_checkpoint
  baseline.eval.baseline_checkpoint = ""
  baseline.workdir = os.path.join(config.workdir, "baseline")
  before = evaluate(baseline)
  after = evaluate(config)
  if after:  # process 0
    print(comparison_table(before, after, config.eval.baseline_checkpoint,
                           config.policy.checkpoint))
  return after


def comparison_table(before: dict, after: dict, before_name: str, after_name: str) -> str:
  """Score, success rate and score per hidden intention of two summaries, side by side."""
  rows = [("score (mean final emotion)", before["score"], after["score"]),
          ("success rate (%)", before["success_rate"], after["success_rate"])]
  for intention, summary in after["by_intention"].items():
    rows.append((f"score: {intention}", before["by_intention"].get(intention, {}).get(
        "score", float("nan")), summary["score"]))
  lines = [f"before: {before_name}", f"after:  {after_name}",
           f"{'':<34}{'before':>8}{'after':>8}"]
  lines += [f"{name:<34}{b:>8.1f}{a:>8.1f}" for name, b, a in rows]
  return "\n".join(lines)


def _read_json(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _write_json(path: str, value: dict) -> None:
  workdir_lib.write_text_atomically(path, json.dumps(value, indent=2, ensure_ascii=False))


def _write_records(path: str, records: Sequence[dict]) -> None:
  """Replaces a JSONL file whole (a kill leaves the old one or the new one)."""
  workdir_lib.write_text_atomically(
      path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def evaluate_from_cli(config) -> dict:
  """`evaluate_with_baseline`, whose full disk says what a rerun keeps: an evaluation has no
  checkpoints, its scored records are what it resumes from."""
  try:
    return evaluate_with_baseline(config)
  except Exception as e:
    if workdir_lib.no_space_error(e) is None:
      raise
    raise workdir_lib.NoSpaceLeft(
        config.workdir, "to resume: the profiles already scored are kept") from e


if __name__ == "__main__":
  cli.run("eval.py", "evaluation config file[:variant]", watchdog.guarded(evaluate_from_cli))
