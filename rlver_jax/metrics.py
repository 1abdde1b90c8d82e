"""Run metrics: one JSON object per step in W/metrics.jsonl, TensorBoard events in W, plots."""

from __future__ import annotations

import json
import os

from absl import logging


class MetricsWriter:
  """Appends step records; on resume, drops records past the restored step first."""

  def __init__(self, workdir: str, resume_step: int = 0, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.workdir = workdir
    if _is_primary():
      kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
      with open(self.path, "w") as f:
        for record in kept:
          f.write(json.dumps(record) + "\n")
    self._tb = None
    if tensorboard and _is_primary():
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(workdir)
      except ImportError:
        logging.warning("tensorboardX not installed: no TensorBoard events")

  def write(self, step: int, metrics: dict) -> None:
    if not _is_primary():
      return
    record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)):
          self._tb.add_scalar(key, value, step)
      self._tb.flush()

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


def read_metrics(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_curves(metrics_path: str, out_path: str,
                keys=("reward/mean", "emotion/final_mean", "success_rate")) -> str | None:
  """A PNG of the given metrics against step; returns its path (None without data).

  With several hosts, process 0 draws it."""
  records = read_metrics(metrics_path)
  if not records or not _is_primary():
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  keys = [k for k in keys if any(k in r for r in records)]
  fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), sharex=True, squeeze=False)
  for ax, key in zip(axes[:, 0], keys):
    steps = [r["step"] for r in records if key in r]
    values = [r[key] for r in records if key in r]
    ax.plot(steps, values, marker=".", linewidth=1)
    if len(values) >= 5:  # a moving average makes the trend readable
      window = max(2, len(values) // 10)
      smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                for i in range(len(values))]
      ax.plot(steps, smooth, linewidth=2, label=f"mean of last {window}")
      ax.legend(loc="best", fontsize=8)
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
  axes[-1, 0].set_xlabel("step")
  fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(metrics_path))) or "run")
  fig.tight_layout()
  fig.savefig(out_path, dpi=110)
  plt.close(fig)
  return out_path
