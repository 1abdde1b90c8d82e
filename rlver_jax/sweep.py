"""An ablation sweep: a grid of overrides times seeds, one training run each, then the comparison.

  python -m rlver_jax.sweep --config=configs/demo.py --sweep=rl.kl_coef=0,0.05,0.1 \\
      --sweep=optim.actor_lr=1e-3,2e-3 --seeds=3 --workdir=/runs/kl [--config.x=y ...]
  python -m rlver_jax.sweep ... --print   # the runs' commands, for this machine and for a pod

Each run is `python -m rlver_jax.main` with the sweep's `--config` and fixed `--config.x=y`
flags, its arm's overrides, `--config.seed=S` and its own workdir, `W/<arm>/seed=S` (the arm
named by its overrides: `W/rl.kl_coef=0.05,optim.actor_lr=1e-3/seed=1`; a '/' in a value is
written %2F). The first value of
each `--sweep` makes the baseline arm, the one `rlver_jax.compare` measures the others against.

On one machine the runs go one after another, seed by seed (every arm's seed 0, then every
arm's seed 1, ...: a sweep stopped early has compared every arm). Every run's command line is
checked before the first one starts. A run that ends well leaves `sweep_done.json` in its
workdir and is skipped when the sweep is run again; a stopped run resumes from its last
checkpoint (the training CLI's own resume); a run that fails is reported and the others go on.
SIGTERM or SIGINT is passed to the running run, which saves and exits 75 (its preemption), and
the sweep then exits 75 too: run the same command again to go on. When every run has ended,
the comparison is written (W/compare.md, .csv, .png; `python -m rlver_jax.compare W`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time

from absl import app, flags

from infra.errors import UserInputError
from rlver_jax import cli, compare, preemption, sections, workdir as workdir_lib

TRAIN_MODULE = "rlver_jax.main"
TRAIN_DEFAULT_FILE = "demo.py"  # rlver_jax.main's default --config
SWEEP_FILE = "sweep.json"  # W/sweep.json: the grid, read by rlver_jax.compare
DONE_FILE = "sweep_done.json"  # in a run's workdir once it has ended well
RUN_LOG = "sweep_run.log"  # a run's output, appended by each attempt
BASE_ARM = "base"  # the one arm of a sweep over seeds alone
# Fields the sweep sets itself in every run's command line, and the sweep's flag for each.
OWN_FIELDS = {"seed": "use --seeds", "workdir": "use --workdir"}

_SWEEP = flags.DEFINE_multi_string(
    "sweep", [], "FIELD=V1,V2,...: one axis of the grid (a dotted config field and its values); "
    "repeat for more axes; each axis's first value is the baseline's")
_SEEDS = flags.DEFINE_integer("seeds", 1, "runs per arm, with --config.seed=0, 1, ...",
                              lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", None, "the sweep's directory: one workdir per run")
_PRINT = flags.DEFINE_bool("print", False, "write each run's command (python -m "
                           "rlver_jax.main for this machine, ./run_tpu.sh run for a TPU pod) "
                           "instead of running it")


@dataclasses.dataclass(frozen=True)
class Axis:
  """One `--sweep=FIELD=V1,V2` axis: a dotted config field and its values, as typed."""
  field: str
  values: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Run:
  """One run of the grid: its arm's overrides (field, value as typed), in axis order, and seed."""
  overrides: tuple[tuple[str, str], ...]
  seed: int

  @property
  def arm(self) -> str:
    return ",".join(f"{field}={value}" for field, value in self.overrides) or BASE_ARM

  @property
  def name(self) -> str:
    """Its workdir under the sweep's: `<arm>/seed=<seed>`, a value's '/' (a path swept over)
    written %2F (and '%' %25) so that the arm is one directory."""
    return f"{self.arm.replace('%', '%25').replace('/', '%2F')}/seed={self.seed}"


def parse_axis(spec: str) -> Axis:
  """`rl.kl_coef=0,0.05` -> Axis("rl.kl_coef", ("0", "0.05")); a UserInputError names a bad one."""
  field, sep, values = spec.partition("=")
  field = field.removeprefix("config.")
  listed = tuple(v.strip() for v in values.split(","))
  if not sep or not field or not all(listed):
    raise UserInputError(f"--sweep={spec}: write FIELD=V1,V2,... (a dotted config field and "
                         "its values, e.g. --sweep=rl.kl_coef=0,0.05)")
  if field in OWN_FIELDS:
    raise UserInputError(f"--sweep={spec}: the sweep sets {field} itself ({OWN_FIELDS[field]})")
  if len(set(listed)) != len(listed):
    raise UserInputError(f"--sweep={spec}: a value is listed twice")
  return Axis(field, listed)


def grid(axes: list[Axis], seeds: int) -> list[Run]:
  """Every arm (the product of the axes' values, the first values' arm first) times every
  seed, seed by seed."""
  fields = [axis.field for axis in axes]
  if len(set(fields)) != len(fields):
    twice = sorted({field for field in fields if fields.count(field) > 1})
    raise UserInputError(f"--sweep names {', '.join(twice)} twice")
  arms = [tuple(zip(fields, values)) for values in itertools.product(*(a.values for a in axes))]
  return [Run(arm, seed) for seed in range(seeds) for arm in arms]


def run_flags(config_flags: list[str], run: Run, root: str) -> list[str]:
  """The training CLI's flags for `run`: the sweep's own --config flags, then its arm's."""
  return [*config_flags, *(f"--config.{field}={value}" for field, value in run.overrides),
          f"--config.seed={run.seed}", f"--config.workdir={os.path.join(root, run.name)}"]


def split_config_flags(argv: list[str]) -> tuple[list[str], list[str]]:
  """(the --config and --config.FIELD flags of `argv`, the others); a --config flag given as two
  words (`--config FILE`) is joined into one."""
  ours, others = [], []
  i = 0
  while i < len(argv):
    arg = argv[i]
    if cli.is_config_flag(arg):
      if "=" not in arg and not arg.lstrip("-").startswith("noconfig.") and i + 1 < len(argv) \
          and not argv[i + 1].startswith("-"):
        arg, i = f"{arg}={argv[i + 1]}", i + 1
      ours.append(arg)
    else:
      others.append(arg)
    i += 1
  return ours, others


def check_runs(config_flags: list[str], runs: list[Run], root: str) -> None:
  """Every run's command line, checked as the training CLI checks it (field names, value
  types, the sections' checks), before any starts: a UserInputError names the run."""
  for flag in config_flags:
    field = cli.override_field(flag)
    if field in OWN_FIELDS:
      raise UserInputError(f"--config.{field}: the sweep sets it for each run "
                           f"({OWN_FIELDS[field]})")
  for run in runs:
    try:
      sections.train_run(cli.load_config(run_flags(config_flags, run, root), TRAIN_DEFAULT_FILE))
    except UserInputError as e:
      raise UserInputError(f"run {run.name}: {e}") from None


class _Forwarder:
  """While a run runs, SIGTERM and SIGINT sent to the sweep go to the run (which saves and
  exits 75); the sweep remembers the signal and stops after it."""

  def __init__(self):
    self.child: subprocess.Popen | None = None
    self.received: str | None = None

  def __enter__(self):
    self._before = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
    return self

  def __exit__(self, *exc):
    for s, handler in self._before.items():
      signal.signal(s, handler)

  def _handle(self, signum, frame):
    if self.received is None:
      self.received = signal.Signals(signum).name
      if self.child is not None and self.child.poll() is None:
        self.child.send_signal(signum)


def _die_with_parent():
  """In the run's process before it starts: SIGTERM it if the sweep dies (PR_SET_PDEATHSIG), so
  that a sweep killed outright leaves no orphan training in the background; the run then saves
  and stops as a preempted one does."""
  ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _run_one(command: list[str], run_dir: str, forwarder: _Forwarder) -> int:
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, RUN_LOG), "a") as log:
    log.write(f"$ {shlex.join(command)}\n")
    log.flush()
    # A session of its own: a Ctrl-C at the terminal reaches the run once, through the sweep.
    forwarder.child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, preexec_fn=_die_with_parent)
    try:
      return forwarder.child.wait()
    finally:
      forwarder.child = None


def _last_line(path: str) -> str:
  with open(path, errors="replace") as f:
    lines = [line.strip() for line in f if line.strip()]
  return lines[-1] if lines else ""


def write_grid(root: str, config_flags: list[str], axes: list[Axis], seeds: int,
               runs: list[Run]) -> None:
  """W/sweep.json; a W that holds another sweep's grid is refused (its runs would mix)."""
  grid_record = {"config_flags": config_flags,
                 "axes": [{"field": a.field, "values": list(a.values)} for a in axes],
                 "seeds": seeds,
                 "runs": [{"name": r.name, "arm": r.arm, "seed": r.seed,
                           "overrides": dict(r.overrides)} for r in runs]}
  path = os.path.join(root, SWEEP_FILE)
  if os.path.exists(path):
    with open(path) as f:
      held = json.load(f)
    if held != grid_record:
      raise UserInputError(f"{root} holds another sweep ({path}: other flags, axes or seeds); "
                           "give this one a --workdir of its own")
    return
  workdir_lib.write_text_atomically(path, json.dumps(grid_record, indent=2) + "\n")


def sweep(config_flags: list[str], axes: list[Axis], seeds: int, root: str,
          last: int = compare.DEFAULT_LAST) -> int:
  """Runs the grid (see the module docstring); the exit status: 0 when every run ended well,
  PREEMPTED_EXIT_CODE when stopped by a signal, 1 when a run failed."""
  runs = grid(axes, seeds)
  check_runs(config_flags, runs, root)
  os.makedirs(root, exist_ok=True)
  write_grid(root, config_flags, axes, seeds, runs)
  failed = []
  with _Forwarder() as forwarder:
    for index, run in enumerate(runs, 1):
      run_dir = os.path.join(root, run.name)
      where = f"[{index}/{len(runs)}] {run.name}"
      if os.path.exists(os.path.join(run_dir, DONE_FILE)):
        print(f"{where}: done before, kept", flush=True)
        continue
      if forwarder.received:  # between two runs
        return _stopped(forwarder.received, f"before run {index}/{len(runs)}", root, runs)
      command = [sys.executable, "-m", TRAIN_MODULE, *run_flags(config_flags, run, root)]
      print(f"{where}: running (log {os.path.join(run_dir, RUN_LOG)})", flush=True)
      start = time.monotonic()
      status = _run_one(command, run_dir, forwarder)
      seconds = time.monotonic() - start
      if status == 0:
        workdir_lib.write_text_atomically(
            os.path.join(run_dir, DONE_FILE),
            json.dumps({"command": command[1:], "seconds": round(seconds, 1)}) + "\n")
        print(f"{where}: done in {seconds:.0f} s", flush=True)
      if forwarder.received or status == preemption.PREEMPTED_EXIT_CODE:
        return _stopped(forwarder.received or "the run was stopped",
                        f"in run {index}/{len(runs)} ({run.name})", root, runs)
      if status != 0:
        failed.append(run.name)
        print(f"{where}: failed (exit status {status}): "
              f"{_last_line(os.path.join(run_dir, RUN_LOG))}", flush=True)
  try:
    print(f"comparison: {', '.join(compare.write_comparison(root, last=last))}", flush=True)
  except UserInputError as e:  # no run finished a step
    print(f"no comparison: {e}", flush=True)
  if failed:
    print(f"error: {len(failed)} of {len(runs)} runs failed: {', '.join(failed)}; each one's "
          f"log is its {RUN_LOG}. Run the same command again to retry them "
          "(the finished runs are kept)", file=sys.stderr, flush=True)
    return 1
  return 0


def _stopped(reason: str, where: str, root: str, runs: list[Run]) -> int:
  done = sum(os.path.exists(os.path.join(root, run.name, DONE_FILE)) for run in runs)
  print(f"preempted: {reason}: stopped {where}; {done} of {len(runs)} runs done, a stopped one "
        "saved its last finished step. Run the same command again to go on (exit status "
        f"{preemption.PREEMPTED_EXIT_CODE})", file=sys.stderr, flush=True)
  return preemption.PREEMPTED_EXIT_CODE


def print_commands(config_flags: list[str], runs: list[Run], root: str) -> None:
  """Each run's command, for this machine and for a TPU pod (./run_tpu.sh starts it on every
  worker), one per line."""
  for pod in (False, True):
    print(f"# {len(runs)} runs on {'a TPU pod (TPU_NAME, ZONE set)' if pod else 'this machine'}")
    for run in runs:
      prefix = ["./run_tpu.sh", "run", TRAIN_MODULE] if pod else ["python", "-m", TRAIN_MODULE]
      print(shlex.join([*prefix, *run_flags(config_flags, run, root)]))


def main(argv: list[str]) -> None:
  config_flags, others = split_config_flags(argv[1:])
  if others:
    raise app.UsageError(f"unexpected arguments: {others}")
  try:
    if not _WORKDIR.value:
      raise UserInputError("--workdir: give the sweep's directory (one workdir per run in it)")
    root = os.path.abspath(_WORKDIR.value)
    axes = [parse_axis(spec) for spec in _SWEEP.value]
    if _PRINT.value:
      runs = grid(axes, _SEEDS.value)
      check_runs(config_flags, runs, root)
      print_commands(config_flags, runs, root)
      return
    status = sweep(config_flags, axes, _SEEDS.value, root, last=compare.LAST.value)
  except UserInputError as e:
    raise SystemExit(f"error: {e}") from None
  raise SystemExit(status)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flags; the --config flags are the runs', kept for them (absl knows none of them)."""
  config_flags, others = split_config_flags(argv[1:])
  try:
    rest = flags.FLAGS(argv[:1] + others, known_only=True)
  except flags.Error as e:
    raise SystemExit(f"error: {e}") from None
  unknown = [arg for arg in rest[1:] if arg.startswith("-")]
  if unknown:
    raise SystemExit(f"error: unknown flag {unknown[0]} (the sweep's flags: --sweep, --seeds, "
                     "--workdir, --print, --last; the runs' are --config and --config.FIELD)")
  return rest[:1] + config_flags + rest[1:]


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
