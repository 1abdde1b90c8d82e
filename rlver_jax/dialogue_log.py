"""What the policy says: sampled whole dialogues during training, and its replies per intention.

At step 1 and every `log_dialogues_every` steps (config; 0 = never) a few of
the step's dialogues, both sides with per-turn emotion, the simulator's
planning notes and the reward, go to W/dialogues.jsonl and to TensorBoard's
text tab, so a reward hack is visible the step it starts. At the end of a run
the policy's three most frequent replies for each hidden intention over its
last steps are written to W/replies_by_intention.md and .json, and the paths of
everything the run wrote are printed, however the run ended.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from typing import Collection, Sequence

from absl import logging

from rlver_jax.metrics import read_appended_jsonl, rewrite_jsonl
from rlver_jax.preemption import Preempted
from sim_user.simulator import Dialogue

DIALOGUES = "dialogues.jsonl"
REPLIES_TABLE = "replies_by_intention"
RECENT_STEPS = 5  # the replies table describes the policy of the run's last steps


def dialogue_record(step: int, d: Dialogue) -> dict:
  """A dialogue as one JSON-able object: turns in order, user turns with emotion and notes."""
  turns = []
  for m in d.history:
    turn = {"role": m["role"], "content": m["content"]}
    if m["role"] == "user":
      turn["emotion"] = m.get("emotion-point")
      if "planning" in m:
        turn["planning"] = m["planning"]
    turns.append(turn)
  return {"step": step, "profile": d.profile.id, "intention": d.profile.intention,
          "end_reason": d.end_reason, "failure": d.failure, "final_emotion": d.emotion,
          "reward": d.reward, "turns": turns}


def dialogue_markdown(record: dict) -> str:
  """The record as TensorBoard text: one line per turn, notes and change under user turns."""
  lines = [f"**{record['profile']}** (intention {record['intention']}): final emotion "
           f"{record['final_emotion']:g}, reward {record['reward']}, ended by "
           f"{record['end_reason']}", ""]
  for turn in record["turns"]:
    if turn["role"] == "assistant":
      lines.append(f"- **policy:** {turn['content']}")
      continue
    lines.append(f"- **user** [{turn['emotion']:g}]: {turn['content']}")
    planning = turn.get("planning")
    if planning:
      lines.append(f"    - *{planning.get('TargetCompletion', '')}* "
                   f"(change {planning.get('change', 0):+d})")
  return "\n".join(lines)


def _pick(dialogues: Sequence[Dialogue], count: int) -> list[Dialogue]:
  """`count` kept dialogues from best to worst final emotion, evenly spaced."""
  kept = sorted((d for d in dialogues if not d.dropped), key=lambda d: -d.emotion)
  if len(kept) <= count:
    return kept
  return [kept[round(i * (len(kept) - 1) / max(count - 1, 1))] for i in range(count)]


class DialogueLog:
  """Sampled dialogues to W/dialogues.jsonl and TensorBoard; recent replies per intention.

  On resume the records past the restored step (and a last line torn by a
  kill) are dropped, so a redone step appears once.
  """

  def __init__(self, workdir: str, every: int = 0, count: int = 2, primary: bool = True,
               resume_step: int = 0):
    """`primary`: this process writes files (one process of a multi-host run does).
    `resume_step`: the step the run restored (0 from scratch)."""
    self.workdir, self.every, self.count, self.primary = workdir, every, count, primary
    self.path = os.path.join(workdir, DIALOGUES)
    self._recent: collections.deque = collections.deque(maxlen=RECENT_STEPS)
    self.wrote = False  # whether this run logged any dialogue
    self._tb = None
    if not primary:
      return
    kept = self._drop_records_after(resume_step)
    if every > 0:
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(workdir)
      except ImportError:
        logging.warning("tensorboardX not installed: dialogues only in %s", self.path)
        return
      # MetricsWriter, made before this log, rewrote W's event files without the text tab.
      self._add_text(kept)

  def _drop_records_after(self, resume_step: int) -> list[dict]:
    """Drops W/dialogues.jsonl's records past `resume_step` (the file too when none is left);
    returns those kept."""
    if not os.path.exists(self.path):
      return []
    kept = [r for r in read_appended_jsonl(self.path) if r["step"] <= resume_step]
    if not kept:
      os.remove(self.path)
      return []
    rewrite_jsonl(self.path, kept)
    return kept

  def _add_text(self, records: Sequence[dict]) -> None:
    """The records to TensorBoard's text tab, numbered within their step."""
    index_in_step = collections.Counter()
    for record in records:
      step = record["step"]
      self._tb.add_text(f"dialogues/{index_in_step[step]}", dialogue_markdown(record), step)
      index_in_step[step] += 1
    self._tb.flush()

  def observe(self, step: int, dialogues: Sequence[Dialogue]) -> None:
    """Remembers this step's replies; on logging steps writes a few dialogues."""
    self._recent.append([(d.profile.intention, d.emotion, m["content"])
                         for d in dialogues if not d.dropped
                         for m in d.history if m["role"] == "assistant"])
    # Step 1 too: a run shorter than `every` steps still shows what its policy says.
    if not self.primary or not self.every or (step % self.every and step != 1):
      return
    records = [dialogue_record(step, d) for d in _pick(dialogues, self.count)]
    self.wrote = True
    with open(self.path, "a") as f:
      for record in records:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
    if self._tb is not None:
      self._add_text(records)

  def replies_by_intention(self, top: int = 3) -> dict:
    """intention -> the `top` most frequent replies of the recent steps with their shares,
    and the count of replies: {"top": [{"reply", "share"}, ...], "replies": n}."""
    replies = collections.defaultdict(collections.Counter)
    for step in self._recent:
      for intention, _, reply in step:
        replies[intention or "unknown"][reply.strip()] += 1
    table = {}
    for intention, counter in sorted(replies.items()):
      total = sum(counter.values())
      table[intention] = {"top": [{"reply": reply, "share": count / total}
                                  for reply, count in counter.most_common(top)],
                          "replies": total}
    return table

  def write_table(self) -> str | None:
    """W/replies_by_intention.md and .json; the .md path, or None before any step."""
    table = self.replies_by_intention()
    if not table or not self.primary:
      return None
    with open(os.path.join(self.workdir, REPLIES_TABLE + ".json"), "w") as f:
      json.dump(table, f, indent=1, ensure_ascii=False)
    lines = [f"The policy's most frequent replies per hidden intention, last {len(self._recent)} "
             "steps", "", "| intention | replies | most frequent (share) |", "| --- | --- | --- |"]
    for intention, row in table.items():
      top = "; ".join(f"{r['reply']} ({100 * r['share']:.0f}%)" for r in row["top"])
      top = top.replace("|", "\\|").replace("\n", " ")
      lines.append(f"| {intention} | {row['replies']} | {top} |")
    path = os.path.join(self.workdir, REPLIES_TABLE + ".md")
    with open(path, "w") as f:
      f.write("\n".join(lines) + "\n")
    return path

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def _ending(step: int, steps: int) -> str:
  error = sys.exc_info()[1]
  if isinstance(error, Preempted):
    return f"preempted ({error.signal_name}) at step {step}/{steps}; resume with the same command"
  if isinstance(error, KeyboardInterrupt):
    return f"interrupted at step {step}/{steps}"
  if error is not None:
    return f"stopped by {type(error).__name__} at step {step}/{steps}"
  return f"done: {step}/{steps} steps" if step >= steps else f"stopped at step {step}/{steps}"


# (name in the summary, path in the workdir)
OUTPUTS = (("reward curve", "reward_curve.png"), ("metrics", "metrics.jsonl"),
           ("dialogues", DIALOGUES), ("checkpoints", "checkpoints"), ("export", "export"))


def report_outputs(workdir: str, step: int, steps: int, log: DialogueLog | None = None,
                   written: Collection[str] | None = None, out=None,
                   learned: Sequence[str] = ()) -> str:
  """Writes the replies table and prints where the run's outputs are; returns the text.

  `written`: the names (of OUTPUTS) this run wrote; the dialogues count when
  `log` wrote some. None lists every output present in the workdir. `learned`: lines
  that say what the run learned (`metrics.learning_summary`), printed first.
  Call from a `finally:` so that interrupted and failed runs report too.
  """
  table = log.write_table() if log is not None else None
  if log is not None:
    log.close()
  if written is not None:
    written = set(written) | ({"dialogues"} if log is not None and log.wrote else set())
  lines = [*learned, f"run {_ending(step, steps)}; outputs in {os.path.abspath(workdir)}:"]
  for name, relative in OUTPUTS:
    path = os.path.join(workdir, relative)
    if os.path.exists(path) and (written is None or name in written):
      lines.append(f"  {name + ':':15s}{os.path.abspath(path)}")
  if table:
    lines.append(f"  {'replies table:':15s}{os.path.abspath(table)}")
  lines.append(f"  {'tensorboard:':15s}tensorboard --logdir {os.path.abspath(workdir)}")
  text = "\n".join(lines)
  print(text, file=out or sys.stdout, flush=True)
  return text
