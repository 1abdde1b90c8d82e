"""Re-score recorded SAGE result files with our parser and rule sets.

  python -m sim_user.replay FILE.jsonl [FILE ...] [--rules sage_benchmark]

For each recorded user turn the planning text is rebuilt in SAGE's header
format from the recorded fields, parsed with our parser, and the named rule
set is re-run. Each dialogue is also re-driven through our `SimulatedUser`,
its backend answering from the recording, to check that our simulator ends it
where the recording ends (the same agent replies and judged turns). Prints one
JSON object per file:
{"file", "n", "score", "success_rate", "failure_rate", "mismatched_turns",
 "mismatched_ends"}
(rates in percent); a mismatched turn is one whose recomputed emotion
differs from the recorded `emotion-point`; a mismatched end is a dialogue our
simulator would end elsewhere (or would continue past the recording).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from typing import Sequence

from sim_user import dynamics, parser
from sim_user.backends.base import PLANNING, REPLY, BackendError, SimRequest
from sim_user.jsonl import iter_jsonl
from sim_user.profiles import Profile
from sim_user.simulator import SimulatedUser
from sim_user.templates import PromptSet


# A later section's header inside a recorded body: SAGE splits on "TargetCompletion:\n", so
# when the model wrote "Content:  \n" (spaces before the newline) the split missed and the
# recorded body runs on to the end of the output.
_RUN_ON_HEADER = re.compile(r"^[ \t]*(?:TargetCompletion|Activity|Analyse|Change)[ \t]*:", re.M)


def planning_text(planning: dict) -> str:
  """SAGE's planning output as its headers lay it out, from a recorded `planning` dict.

  The recorded bodies keep SAGE's bracketed sub-headers without the opening
  bracket (e.g. "心理活动]\\n..."); the rebuilt text restores it. A body that
  ran on into later sections is cut where they begin.
  """
  def body(key):
    value = str(planning.get(key, ""))
    run_on = _RUN_ON_HEADER.search(value)
    value = (value[:run_on.start()] if run_on else value).strip()
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


class RecordedBackend:
  """Answers a simulator's calls from one recorded dialogue.

  The planning call after agent reply k gets the k-th judged user turn's
  planning (in SAGE's header layout), the reply call that turn's message. A
  call the recording does not hold is a `BackendError("past_recording")`.
  """

  def __init__(self, judged_turns: Sequence[dict]):
    self.judged_turns = judged_turns

  def complete(self, requests: Sequence[SimRequest]) -> list:
    return [self._one(r) for r in requests]

  def _one(self, r: SimRequest):
    if r.kind not in (PLANNING, REPLY) or not 1 <= r.turn <= len(self.judged_turns):
      return BackendError("past_recording", f"{r.kind} call after agent reply {r.turn}")
    turn = self.judged_turns[r.turn - 1]
    return planning_text(turn["planning"]) if r.kind == PLANNING else f"Response:\n{turn['content']}"


@functools.cache
def _prompts() -> PromptSet:
  return PromptSet.load(language="zh")  # rendered for the backend, which ignores them


def ends_as_recorded(record: dict, rules: dynamics.EmotionRules) -> bool:
  """Whether our simulator, fed the recorded agent replies and simulator outputs, ends the
  dialogue exactly where the recording ends: same agent replies, same judged turns."""
  history = record["history"]
  judged = [t for t in history if t.get("role") == "user" and "planning" in t]
  agent_replies = [t["content"] for t in history if t.get("role") == "assistant"]
  profile = Profile(id=str(record.get("id", "")), player=str(record.get("player", "")),
                    scene=str(record.get("scene", "")), main_cha=str(record.get("character", "")),
                    cha_group=(), task=str(record.get("task", "")),
                    first_talk=str(history[0].get("content", "")) if history else None)
  user = SimulatedUser(RecordedBackend(judged), rules, _prompts(), max_retries=0)
  [dialogue] = user.start([profile])
  for reply in agent_replies:
    if dialogue.done:
      return False  # ours ended before the recorded agent replied again
    user.respond([dialogue], [reply])
  return (dialogue.done and dialogue.failure is None
          and len(dialogue.emotions) - 1 == len(judged))


def replay_file(path: str, rules: dynamics.EmotionRules) -> dict:
  finals, mismatched, mismatched_ends = [], 0, 0
  for line_no, record in iter_jsonl(path):
    final, mismatches = replay_dialogue(record, rules, f"{path}:{line_no}")
    finals.append(final)
    mismatched += mismatches
    mismatched_ends += not ends_as_recorded(record, rules)
  summary = dynamics.summarize(finals, failure_below=10.0)
  return {"file": path, "n": summary["n"], "score": round(summary["score"], 4),
          "success_rate": summary["success_rate"], "failure_rate": summary["failure_rate"],
          "mismatched_turns": mismatched, "mismatched_ends": mismatched_ends}


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
