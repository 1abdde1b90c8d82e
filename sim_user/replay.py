"""Re-score recorded SAGE result files with our parser and rule sets.

  python -m sim_user.replay FILE.jsonl [FILE ...] [--rules sage_benchmark]

For each recorded user turn the planning text is rebuilt in SAGE's header
format from the recorded fields, parsed with our parser, and the named rule
set is re-run. Prints one JSON object per file:
{"file", "n", "score", "success_rate", "failure_rate", "mismatched_turns"}
(rates in percent); a mismatched turn is one whose recomputed emotion
differs from the recorded `emotion-point`.
"""

from __future__ import annotations

import argparse
import json
import sys

from sim_user import dynamics, parser
from sim_user.jsonl import iter_jsonl


def planning_text(planning: dict) -> str:
  """SAGE's planning output as its headers lay it out, from a recorded `planning` dict.

  The recorded bodies keep SAGE's bracketed sub-headers without the opening
  bracket (e.g. "心理活动]\\n..."); the rebuilt text restores it.
  """
  def body(key):
    value = str(planning.get(key, "")).strip()
    return f"[{value}" if value and "]" in value.split("\n", 1)[0] else value

  return (f"Content:\n{body('content')}\n"
          f"TargetCompletion:\n{body('TargetCompletion')}\n"
          f"Activity:\n{body('activity')}\n"
          f"Analyse:\n{body('analyse')}\n"
          f"Change:\n{planning.get('change', '')}\n")


def replay_dialogue(record: dict, rules: dynamics.EmotionRules, where: str) -> tuple[float, int]:
  """(final emotion, mismatched turns) of one recorded dialogue."""
  history = record.get("history")
  if not isinstance(history, list):
    raise ValueError(f"{where}: no 'history' list")
  emotion, mismatches = rules.initial, 0
  for turn_no, turn in enumerate(history):
    if turn.get("role") != "user" or "planning" not in turn:
      continue
    try:
      planning = parser.parse_planning(planning_text(turn["planning"]))
    except parser.SimulatorParseError as e:
      raise ValueError(f"{where}: history[{turn_no}]: {e}") from None
    emotion = dynamics.update(rules, emotion, planning.change)
    if "emotion-point" in turn and turn["emotion-point"] != emotion:
      mismatches += 1
  return emotion, mismatches


def replay_file(path: str, rules: dynamics.EmotionRules) -> dict:
  finals, mismatched = [], 0
  for line_no, record in iter_jsonl(path):
    final, mismatches = replay_dialogue(record, rules, f"{path}:{line_no}")
    finals.append(final)
    mismatched += mismatches
  summary = dynamics.summarize(finals, failure_below=10.0)
  return {"file": path, "n": summary["n"], "score": round(summary["score"], 4),
          "success_rate": summary["success_rate"], "failure_rate": summary["failure_rate"],
          "mismatched_turns": mismatched}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m sim_user.replay", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("files", nargs="+")
  p.add_argument("--rules", default="sage_benchmark", choices=sorted(dynamics.RULES))
  args = p.parse_args(argv)
  rules = dynamics.get_rules(args.rules)
  status = 0
  for path in args.files:
    try:
      print(json.dumps(replay_file(path, rules), ensure_ascii=False))
    except (OSError, ValueError) as e:
      print(f"error: {e}", file=sys.stderr)
      status = 2
  return status


if __name__ == "__main__":
  sys.exit(main())
