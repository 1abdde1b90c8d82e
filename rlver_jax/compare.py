"""A sweep's runs compared: each arm's final metrics over its seeds, and which differ from the
baseline by more than the seed noise.

  python -m rlver_jax.compare /runs/kl [--last=5]    # also run when rlver_jax.sweep ends

Reads W/sweep.json (the grid rlver_jax.sweep wrote) and each run's metrics.jsonl, and writes:
- W/compare.md: one row per arm, each metric as mean ± std over the seeds [95% interval], where
  a run's value is its mean over its last `--last` steps; with the demo's hidden intentions, a
  table of the final emotion and one of the success per intention;
- W/compare.csv: the same figures, one line per arm and metric;
- W/compare.png: each arm's curve (the mean over its seeds) in a band of ± one std;
- W/hparams: the runs in TensorBoard's HParams view (`tensorboard --logdir W/hparams`).

The baseline is the grid's first arm (each --sweep's first value). An arm is marked `*` where
its difference from the baseline lies beyond the seed noise: the 95% interval of the
difference (Welch's t over the two arms' seeds) excludes 0. That needs two seeds an arm or more.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os
import shutil

from absl import app, flags

from infra.errors import UserInputError
from rlver_jax import metrics as metrics_lib
from rlver_jax import workdir as workdir_lib

DEFAULT_LAST = 5
# replies/garbled_rate: the share of replies the scripted user could not read (rl/rollout.py).
HEADLINE_KEYS = ("emotion/final_mean", "success_rate", "replies/garbled_rate", "reward/mean")
# Per hidden intention (the demo's profiles): the title of its table and its metric family.
INTENTION_TABLES = (("Final emotion by hidden intention", metrics_lib.INTENTION_PREFIX),
                    ("Success (%) by hidden intention", metrics_lib.INTENTION_SUCCESS_PREFIX))
OUTPUTS = ("compare.md", "compare.csv", "compare.png", "hparams")
# Student's t at 0.975 (a two-sided 95% interval) for 1..30 degrees of freedom; then by rows.
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
          2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
          2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_T_975_BEYOND = ((40, 2.021), (60, 2.000), (120, 1.980))


def t_975(degrees_of_freedom: float) -> float:
  """Student's t quantile for a two-sided 95% interval; a fractional df is rounded down (the
  wider interval)."""
  df = int(math.floor(degrees_of_freedom))
  if df < 1:
    raise ValueError(f"degrees of freedom {degrees_of_freedom} < 1")
  if df <= len(_T_975):
    return _T_975[df - 1]
  return next((t for limit, t in _T_975_BEYOND if df <= limit), 1.960)


@dataclasses.dataclass(frozen=True)
class Stat:
  """One arm's metric over its seeds: n values, their mean, sample std (ddof 1; 0 for one
  value) and the 95% t interval of the mean (None for one value)."""
  n: int
  mean: float
  std: float
  interval: tuple[float, float] | None

  @classmethod
  def of(cls, values: list[float]) -> "Stat":
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    half = t_975(n - 1) * std / math.sqrt(n) if n > 1 else None
    return cls(n, mean, std, None if half is None else (mean - half, mean + half))


@dataclasses.dataclass(frozen=True)
class Difference:
  """An arm's mean minus the baseline's, and the half width of its 95% interval (Welch)."""
  value: float
  half_width: float | None

  @property
  def beyond_noise(self) -> bool:
    return self.half_width is not None and abs(self.value) > self.half_width

  @classmethod
  def between(cls, arm: Stat, base: Stat) -> "Difference":
    value = arm.mean - base.mean
    if arm.n < 2 or base.n < 2:
      return cls(value, None)
    a, b = arm.std ** 2 / arm.n, base.std ** 2 / base.n
    if a + b == 0:  # no spread at all: any difference is beyond it
      return cls(value, 0.0)
    df = (a + b) ** 2 / (a ** 2 / (arm.n - 1) + b ** 2 / (base.n - 1))
    return cls(value, t_975(df) * math.sqrt(a + b))


@dataclasses.dataclass(frozen=True)
class SweepRun:
  """One run of the grid and the records of its finished steps (none yet: [])."""
  name: str
  arm: str
  seed: int
  overrides: dict[str, str]
  records: list[dict]
  done: bool


def load_runs(root: str) -> tuple[dict, list[SweepRun]]:
  """(W/sweep.json's grid, its runs with their metrics); a UserInputError names what is missing."""
  path = os.path.join(root, "sweep.json")
  if not os.path.isfile(path):
    raise UserInputError(f"{path}: no sweep here (rlver_jax.sweep writes it); give the sweep's "
                         "--workdir")
  with open(path) as f:
    grid = json.load(f)
  runs = []
  for run in grid["runs"]:
    run_dir = os.path.join(root, run["name"])
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    records = metrics_lib.read_appended_jsonl(metrics_path) if os.path.exists(
        metrics_path) else []
    runs.append(SweepRun(run["name"], run["arm"], run["seed"], run["overrides"], records,
                         os.path.exists(os.path.join(run_dir, "sweep_done.json"))))
  return grid, runs


def final_value(records: list[dict], key: str, last: int) -> float | None:
  """The mean of `key` over the run's last `last` steps (a step without it, a gap, left out);
  None if none of them has it."""
  values = [r[key] for r in records[-last:] if key in r]
  return sum(values) / len(values) if values else None


def arms_in_order(runs: list[SweepRun]) -> list[str]:
  return list(dict.fromkeys(run.arm for run in runs))


def metric_keys(runs: list[SweepRun]) -> tuple[list[str], dict[str, list[str]]]:
  """(the headline metrics the runs have, {intention table prefix: its intentions})."""
  present = {k for run in runs for r in run.records for k in r}
  headline = [k for k in HEADLINE_KEYS if k in present]
  intentions = {prefix: sorted(k[len(prefix):] for k in present if k.startswith(prefix))
                for _, prefix in INTENTION_TABLES}
  return headline, intentions


def arm_stats(runs: list[SweepRun], keys: list[str], last: int) -> dict[str, dict[str, Stat]]:
  """{arm: {metric: its Stat over the arm's seeds}}, for the metrics an arm's runs have."""
  table = {}
  for arm in arms_in_order(runs):
    table[arm] = {}
    for key in keys:
      values = [v for run in runs if run.arm == arm
                for v in [final_value(run.records, key, last)] if v is not None]
      if values:
        table[arm][key] = Stat.of(values)
  return table


def decimals(key: str) -> int:
  """An emotion (0-100) or a percentage with 1 decimal; any other metric (a reward) with 3."""
  return 1 if key.startswith(("emotion/", *metrics_lib.PERCENT_KEYS)) else 3


def _cell(stat: Stat | None, base: Stat | None, is_base: bool, interval: bool, d: int) -> str:
  """`mean ± std [interval] (difference from the baseline, * beyond the noise)`, with `d`
  decimals."""
  if stat is None:
    return "-"
  text = f"{stat.mean:.{d}f} ± {stat.std:.{d}f}"
  if interval and stat.interval:
    text += f" [{stat.interval[0]:.{d}f}, {stat.interval[1]:.{d}f}]"
  if base is not None and not is_base:
    diff = Difference.between(stat, base)
    text += f" ({diff.value:+.{d}f}{'*' if diff.beyond_noise else ''})"
  return text


def _markdown_table(arms: list[str], columns: list[tuple[str, str]],
                    stats: dict[str, dict[str, Stat]], seeds: dict[str, int],
                    interval: bool = True) -> list[str]:
  """`columns`: (header, metric key); without `interval`, the cells leave out the 95% interval
  (the per-intention tables, eight columns wide)."""
  base = arms[0]
  lines = ["| arm | seeds | " + " | ".join(header for header, _ in columns) + " |",
           "|---|---|" + "---|" * len(columns)]
  for arm in arms:
    cells = [_cell(stats[arm].get(key), stats[base].get(key), arm == base, interval,
                   decimals(key)) for _, key in columns]
    label = f"{arm} (baseline)" if arm == base else arm
    lines.append(f"| {label} | {seeds[arm]} | " + " | ".join(cells) + " |")
  return lines


def all_stats(runs: list[SweepRun], last: int):
  """(the arms in grid order, the headline metrics, {intention table prefix: its intentions},
  every metric key, {arm: {metric: Stat}}): what the table and the CSV show."""
  headline, intentions = metric_keys(runs)
  keys = headline + [p + i for p, names in intentions.items() for i in names]
  return arms_in_order(runs), headline, intentions, keys, arm_stats(runs, keys, last)


def _runs_table(runs: list[SweepRun], headline: list[str], intentions: dict[str, list[str]],
                last: int) -> list[str]:
  """One row per run with steps: its headline metrics and final emotion by intention, each
  its mean over its last `last` steps (the seed-to-seed spread the tables above summarise)."""
  columns = headline + [metrics_lib.INTENTION_PREFIX + i
                        for i in intentions[metrics_lib.INTENTION_PREFIX]]
  headers = headline + intentions[metrics_lib.INTENTION_PREFIX]
  lines = ["| run | steps | " + " | ".join(headers) + " |", "|---|---|" + "---|" * len(columns)]
  for run in runs:
    if run.records:
      cells = ["-" if v is None else f"{v:.{decimals(key)}f}"
               for key in columns for v in [final_value(run.records, key, last)]]
      lines.append(f"| {run.name} | {len(run.records)} | " + " | ".join(cells) + " |")
  return lines


def markdown(root: str, grid: dict, runs: list[SweepRun], last: int) -> str:
  arms, headline, intentions, _, stats = all_stats(runs, last)
  seeds = {arm: sum(1 for run in runs if run.arm == arm and run.records) for arm in arms}
  lines = [f"# Sweep {root}", "",
           f"{len(arms)} arm(s) x {grid['seeds']} seed(s); each run's value is its mean over "
           f"its last {last} steps; each cell is the mean ± std over the seeds [95% interval "
           f"of the mean] (the difference from the baseline). Baseline: {arms[0]}. `*`: the "
           "difference lies beyond the seed noise (its 95% interval, Welch's t, excludes 0).",
           ""]
  if grid.get("config_flags"):
    lines += [f"Every run: `{' '.join(grid['config_flags'])}`.", ""]
  lines += _markdown_table(arms, [(k, k) for k in headline], stats, seeds)
  for title, prefix in INTENTION_TABLES:
    if intentions[prefix]:
      lines += ["", f"## {title}", ""]
      lines += _markdown_table(arms, [(i, prefix + i) for i in intentions[prefix]], stats, seeds,
                               interval=False)
  lines += ["", "## Each run", ""] + _runs_table(runs, headline, intentions, last)
  unfinished = [run.name for run in runs if not run.done]
  if unfinished:
    lines += ["", f"Not finished ({len(unfinished)} of {len(runs)} runs; counted with the steps "
              f"they have): {', '.join(unfinished)}."]
  return "\n".join(lines) + "\n"


def csv_text(grid: dict, runs: list[SweepRun], last: int) -> str:
  """One line per arm and metric: the arm's overrides, n, mean, std, interval, difference."""
  arms, _, _, keys, stats = all_stats(runs, last)
  fields = [axis["field"] for axis in grid["axes"]]
  overrides = {run.arm: run.overrides for run in runs}
  out = io.StringIO()
  writer = csv.writer(out)
  writer.writerow(["arm", *fields, "metric", "seeds", "mean", "std", "ci95_low", "ci95_high",
                   "diff_vs_baseline", "diff_ci95_half_width", "beyond_seed_noise"])
  for arm in arms:
    for key in keys:
      stat = stats[arm].get(key)
      if stat is None:
        continue
      base = stats[arms[0]].get(key)
      diff = Difference.between(stat, base) if base is not None else None
      low, high = stat.interval or ("", "")
      writer.writerow([arm, *(overrides[arm].get(f, "") for f in fields), key, stat.n,
                       stat.mean, stat.std, low, high,
                       "" if diff is None else diff.value,
                       "" if diff is None or diff.half_width is None else diff.half_width,
                       "" if diff is None or arm == arms[0] else diff.beyond_noise])
  return out.getvalue()


def curve_figure(runs: list[SweepRun]):
  """One panel per headline metric: each arm's mean curve over its seeds (each seed's curve a
  moving mean over a tenth of its steps) in a band of ± one std."""
  from matplotlib.figure import Figure
  from matplotlib.ticker import MaxNLocator, PercentFormatter
  headline, _ = metric_keys(runs)
  fig = Figure(figsize=(7, 2.8 * max(1, len(headline))))
  axes = fig.subplots(max(1, len(headline)), 1, sharex=True, squeeze=False)[:, 0]
  for ax, key in zip(axes, headline):
    for arm in arms_in_order(runs):
      curves = {}
      for run in runs:
        if run.arm != arm or not run.records:
          continue
        values = [r.get(key, math.nan) for r in run.records]
        smooth = metrics_lib.moving_mean(values, max(1, len(values) // 10))
        for r, v in zip(run.records, smooth):
          if not math.isnan(v):
            curves.setdefault(r["step"], []).append(v)
      if not curves:
        continue
      steps = sorted(curves)
      stats = [Stat.of(curves[s]) for s in steps]
      mean = [s.mean for s in stats]
      line, = ax.plot(steps, mean, linewidth=1.5, label=arm)
      ax.fill_between(steps, [s.mean - s.std for s in stats], [s.mean + s.std for s in stats],
                      color=line.get_color(), alpha=0.2, linewidth=0)
    if key in metrics_lib.PERCENT_KEYS:
      ax.yaxis.set_major_formatter(PercentFormatter(xmax=100))
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
  axes[0].legend(loc="best", fontsize=7)
  axes[0].set_title("mean over seeds, band ± 1 std", fontsize=9)
  axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
  axes[-1].set_xlabel("step")
  fig.tight_layout()
  return fig


def _hparam(value: str):
  """A swept value as TensorBoard sorts it: a number where it reads as one."""
  try:
    return float(value)
  except ValueError:
    return value


def write_hparams(directory: str, runs: list[SweepRun], last: int) -> None:
  """Each run with its overrides and seed as hyperparameters and its final metrics, for
  TensorBoard's HParams view; rewritten whole."""
  from tensorboardX import SummaryWriter
  shutil.rmtree(directory, ignore_errors=True)
  headline, _ = metric_keys(runs)
  with SummaryWriter(directory) as writer:
    for run in runs:
      finals = {f"final/{k}": v for k in headline
                for v in [final_value(run.records, k, last)] if v is not None}
      if finals:
        writer.add_hparams({**{f: _hparam(v) for f, v in run.overrides.items()},
                            "seed": run.seed}, finals, name=run.name)


def write_comparison(root: str, last: int = DEFAULT_LAST) -> list[str]:
  """Writes W/compare.md, .csv, .png and W/hparams (see the module docstring); their paths."""
  grid, runs = load_runs(root)
  if not any(run.records for run in runs):
    raise UserInputError(f"{root}: none of the sweep's {len(runs)} runs has finished a step yet")
  md, csv_path, png, hparams = (os.path.join(root, name) for name in OUTPUTS)
  workdir_lib.write_text_atomically(md, markdown(root, grid, runs, last))
  workdir_lib.write_text_atomically(csv_path, csv_text(grid, runs, last))
  curve_figure(runs).savefig(png, dpi=110)
  write_hparams(hparams, runs, last)
  return [md, csv_path, png, hparams]


# Also rlver_jax.sweep's --last (the comparison it writes when it ends).
LAST = flags.DEFINE_integer("last", DEFAULT_LAST, "each run's value: its mean over its last N "
                            "steps", lower_bound=1)


def main(argv: list[str]) -> None:
  if len(argv) != 2:
    raise app.UsageError("give one sweep directory: python -m rlver_jax.compare W [--last=5]")
  try:
    written = write_comparison(os.path.abspath(argv[1]), last=LAST.value)
  except UserInputError as e:
    raise SystemExit(f"error: {e}") from None
  with open(written[0]) as f:
    print(f.read(), end="")
  print(f"written: {', '.join(written)}")


if __name__ == "__main__":
  app.run(main)
