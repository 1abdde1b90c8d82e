"""Run metrics: one JSON object per step in W/metrics.jsonl, TensorBoard events in W, plots."""

from __future__ import annotations

import json
import math
import os

from absl import logging

from infra.errors import UserInputError

TB_EVENTS_PREFIX = "events.out.tfevents"
CURVE_KEYS = ("reward/mean", "emotion/final_mean", "success_rate", "replies/garbled_rate")
# In percent (rl/rollout.py), drawn with a %.
PERCENT_KEYS = ("success_rate", "failure_rate", "replies/garbled_rate")
# Per-step simulator counters drawn together in one panel; a step without one had none.
SIMULATOR_FAILURE_KEYS = ("dialogues/simulator_failed", "dialogues/dropped")
SIMULATOR_RETRY_PREFIX = "sim/retries"  # sim/retries, sim/retries_succeeded, ...
INTENTION_PREFIX = "emotion/final/"  # emotion/final/<hidden intention>, drawn in one panel
INTENTION_SUCCESS_PREFIX = "success_rate/"  # success_rate/<hidden intention>, in percent


class MetricsWriter:
  """Appends step records to W/metrics.jsonl and TensorBoard events in W.

  On resume the records past the restored step (and a last line torn by a
  kill) are dropped, a step recorded twice keeps its last record, and the
  TensorBoard events are rewritten from the kept records, so a redone step
  appears once in both.
  """

  def __init__(self, workdir: str, resume_step: int = 0, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.workdir = workdir
    self._primary = _is_primary()
    self._tb = None
    if not self._primary:
      return
    # One record per step, the last written (a step redone after a kill, or written twice
    # by two runs on one workdir before the workdir lock), in step order.
    kept = sorted({r["step"]: r for r in read_appended_jsonl(self.path)
                   if r["step"] <= resume_step}.values(), key=lambda r: r["step"])
    rewrite_jsonl(self.path, kept)
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
      except ImportError:
        logging.warning("tensorboardX not installed: no TensorBoard events")
        return
      for name in os.listdir(workdir):
        if name.startswith(TB_EVENTS_PREFIX):
          os.remove(os.path.join(workdir, name))
      self._tb = SummaryWriter(workdir)
      for record in kept:
        self._add_scalars(record)
      self._tb.flush()

  def write(self, step: int, metrics: dict) -> None:
    if not self._primary:
      return
    record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      self._add_scalars(record)
      self._tb.flush()

  def _add_scalars(self, record: dict) -> None:
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)):
        self._tb.add_scalar(key, value, record["step"])

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def _is_primary() -> bool:
  import jax
  return jax.process_index() == 0


def _plain(value):
  try:
    return float(value) if not isinstance(value, (int, str, bool)) else value
  except (TypeError, ValueError):
    return str(value)


def rewrite_jsonl(path: str, records: list[dict]) -> None:
  """Replaces the file's records with `records` (a resumed run's kept ones)."""
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


def read_appended_jsonl(path: str) -> list[dict]:
  """The records of a JSONL file a run appends to (metrics.jsonl, results.jsonl).

  A torn last line (the run was killed while writing it) is dropped with a warning.
  """
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
  records = []
  for index, (number, line) in enumerate(lines):
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as e:
      if index < len(lines) - 1:
        raise UserInputError(f"{path}:{number}: not a JSON record ({e}); repair or delete "
                             "the line") from None
      logging.warning("%s:%d: dropping a torn last line (the run was killed while writing "
                      "it): %.80r", path, number, line)
  return records


def learning_summary(records: list[dict], window: int = 5) -> list[str]:
  """What a run learned, for its end-of-run summary: the mean final emotion and success over
  its first `window` steps against its last (fewer when the run is short), and the final
  emotion per hidden intention where the profiles have them. Steps without a metric (no
  scored dialogue) are left out of its means. No lines for fewer than two steps."""
  n = min(window, len(records) // 2)
  if not n:
    return []
  first, last = records[:n], records[-n:]

  def mean(rows, key):
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else math.nan

  span = lambda rows: (f"step {rows[0]['step']}" if len(rows) == 1 else
                       f"steps {rows[0]['step']}-{rows[-1]['step']}")
  lines = [f"learned: final emotion {mean(first, 'emotion/final_mean'):.1f} -> "
           f"{mean(last, 'emotion/final_mean'):.1f}, success "
           f"{mean(first, 'success_rate'):.0f}% -> {mean(last, 'success_rate'):.0f}% "
           f"({span(first)} against {span(last)})"]
  intentions = sorted({k for r in records for k in r if k.startswith(INTENTION_PREFIX)})
  if intentions:
    lines.append("  final emotion by hidden intention: " + ", ".join(
        f"{k[len(INTENTION_PREFIX):]} {mean(first, k):.1f} -> {mean(last, k):.1f}"
        for k in intentions))
  return lines


def moving_mean(values: list[float], window: int) -> list[float]:
  """The mean of each value and the `window - 1` before it, gaps (NaN) left out; NaN where
  the window holds only gaps."""
  out = []
  for i in range(len(values)):
    seen = [v for v in values[max(0, i - window + 1):i + 1] if not math.isnan(v)]
    out.append(sum(seen) / len(seen) if seen else math.nan)
  return out


def curve_panels(records: list[dict], keys=CURVE_KEYS) -> list[tuple[str, dict]]:
  """(title, {key: (steps, values)}) per panel: one per metric present, then the final
  emotion per hidden intention, then the simulator's.

  The simulator panel shows failed and dropped dialogues and every retry
  counter per step (absent from a record: none that step).
  """
  panels = []
  series = lambda key: ([r["step"] for r in records if key in r],
                        [r[key] for r in records if key in r])
  for key in keys:  # a step without the metric (no scored dialogue) is a gap in its line
    if any(key in r for r in records):
      panels.append((key, {key: ([r["step"] for r in records],
                                 [r.get(key, math.nan) for r in records])}))
  intentions = sorted({k for r in records for k in r if k.startswith(INTENTION_PREFIX)})
  if intentions:
    panels.append(("final emotion by hidden intention",
                   {k[len(INTENTION_PREFIX):]: series(k) for k in intentions}))
  simulator_keys = list(SIMULATOR_FAILURE_KEYS) + sorted(
      {k for r in records for k in r if k.startswith(SIMULATOR_RETRY_PREFIX)})
  if any(k in r for r in records for k in simulator_keys):
    steps = [r["step"] for r in records]
    panels.append(("simulator events per step",
                   {k: (steps, [r.get(k, 0) for r in records]) for k in simulator_keys}))
  return panels


def plot_curves(metrics_path: str, out_path: str, keys=CURVE_KEYS) -> str | None:
  """A PNG of the given metrics and the simulator's events against step; its path (None
  without data). With several hosts, process 0 draws it."""
  records = read_appended_jsonl(metrics_path)
  if not records or not _is_primary():
    return None
  run_name = os.path.basename(os.path.dirname(os.path.abspath(metrics_path))) or "run"
  curve_figure(records, run_name, keys).savefig(out_path, dpi=110)
  return out_path


def curve_figure(records: list[dict], run_name: str, keys=CURVE_KEYS):
  """The matplotlib Figure that `plot_curves` saves: one panel per `curve_panels` entry."""
  # A Figure made without pyplot draws with Agg and is freed with its last reference, so a
  # run that redraws its curve every few steps neither needs a display nor keeps old figures.
  from matplotlib.figure import Figure
  from matplotlib.ticker import MaxNLocator, PercentFormatter
  panels = curve_panels(records, keys)
  fig = Figure(figsize=(7, 2.6 * len(panels)))
  axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)
  for ax, (title, lines) in zip(axes[:, 0], panels):
    for label, (steps, values) in lines.items():
      ax.plot(steps, values, marker=".", linewidth=1, label=label if len(lines) > 1 else None)
    if len(lines) == 1 and len(values) >= 5:  # a moving average makes the trend readable
      window = max(2, len(values) // 10)
      ax.plot(steps, moving_mean(values, window), linewidth=2, label=f"mean of last {window}")
    if ax.get_legend_handles_labels()[0]:
      ax.legend(loc="best", fontsize=8)
    if title in PERCENT_KEYS:
      ax.yaxis.set_major_formatter(PercentFormatter(xmax=100))
    ax.set_ylabel(title if len(lines) == 1 else "")
    ax.set_title(title if len(lines) > 1 else "", fontsize=9)
    ax.grid(alpha=0.3)
  axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))  # shared by every panel
  axes[-1, 0].set_xlabel("step")
  fig.suptitle(run_name)
  fig.tight_layout()
  return fig
