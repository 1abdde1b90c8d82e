"""rlver_jax.sweep and rlver_jax.compare: the grid, its checks, the statistics, the comparison's
table, CSV, plot and HParams, and a real sweep stopped midway and run again."""

import csv
import io
import json
import math
import os
import signal
import subprocess
import sys

import pytest

from infra.errors import UserInputError
from rlver_jax import compare, preemption, sweep
from tests import ROOT, processes
from tests.runs import read_metrics


def test_the_grid_is_every_arm_seed_by_seed_with_the_first_values_arm_first():
  axes = [sweep.parse_axis("rl.kl_coef=0,0.05"),
          sweep.parse_axis("config.optim.actor_lr=1e-3, 2e-3")]
  runs = sweep.grid(axes, seeds=2)
  assert [r.name for r in runs[:4]] == [
      "rl.kl_coef=0,optim.actor_lr=1e-3/seed=0", "rl.kl_coef=0,optim.actor_lr=2e-3/seed=0",
      "rl.kl_coef=0.05,optim.actor_lr=1e-3/seed=0", "rl.kl_coef=0.05,optim.actor_lr=2e-3/seed=0"]
  assert [r.seed for r in runs] == [0] * 4 + [1] * 4 and runs[4].arm == runs[0].arm
  assert [r.name for r in sweep.grid([], seeds=2)] == ["base/seed=0", "base/seed=1"]
  assert sweep.run_flags(["--config=configs/demo.py"], runs[5], "/w") == [
      "--config=configs/demo.py", "--config.rl.kl_coef=0", "--config.optim.actor_lr=2e-3",
      "--config.seed=1", "--config.workdir=/w/rl.kl_coef=0,optim.actor_lr=2e-3/seed=1"]


@pytest.mark.parametrize("spec,says", [
    ("rl.kl_coef", "write FIELD=V1,V2"), ("rl.kl_coef=", "write FIELD=V1,V2"),
    ("rl.kl_coef=0,,1", "write FIELD=V1,V2"), ("seed=0,1", "use --seeds"),
    ("workdir=a,b", "use --workdir"), ("rl.kl_coef=0,0", "listed twice")])
def test_a_bad_axis_is_one_line_naming_it(spec, says):
  with pytest.raises(UserInputError, match=f"--sweep={spec}: .*{says}"):
    sweep.parse_axis(spec)


def test_a_swept_path_names_one_directory():
  [run] = sweep.grid([sweep.parse_axis("data.train_profiles=/d/a%b.jsonl")], seeds=1)
  assert run.arm == "data.train_profiles=/d/a%b.jsonl"
  assert run.name == "data.train_profiles=%2Fd%2Fa%25b.jsonl/seed=0"


def test_an_axis_named_twice_is_refused():
  with pytest.raises(UserInputError, match="names rl.kl_coef twice"):
    sweep.grid([sweep.parse_axis("rl.kl_coef=0,1"), sweep.parse_axis("rl.kl_coef=2")], 1)


def test_the_config_flags_are_split_from_the_sweeps_own():
  ours, others = sweep.split_config_flags(
      ["--config", "configs/ppo.py", "--seeds=3", "--config.rl.kl_coef=0.1", "--print"])
  assert ours == ["--config=configs/ppo.py", "--config.rl.kl_coef=0.1"]
  assert others == ["--seeds=3", "--print"]


@pytest.mark.parametrize("config_flags,axis,says", [
    ([], "rl.kl_coeff=0,0.1",
     "run rl.kl_coeff=0/seed=0: no field rl.kl_coeff in .*demo.py; did you mean rl.kl_coef?"),
    ([], "rl.kl_coef=0,x", r"run rl.kl_coef=x/seed=0: --config.rl.kl_coef must be of type float"),
    ([], "rl.kl_coef=0,-1", r"run rl.kl_coef=-1/seed=0: training config cannot run: .*kl_coef"),
    (["--config.seed=3"], "rl.kl_coef=0", "--config.seed: the sweep sets it for each run"),
    (["--config=configs/ppo.py:bogus"], "rl.kl_coef=0", "unknown config variant 'bogus'")])
def test_every_runs_command_line_is_checked_before_any_starts(config_flags, axis, says):
  runs = sweep.grid([sweep.parse_axis(axis)], seeds=1)
  with pytest.raises(UserInputError, match=says):
    sweep.check_runs(config_flags, runs, "/w")


def test_t_intervals_and_welch_differences_match_their_formulas():
  stat = compare.Stat.of([1.0, 2.0, 3.0])
  assert (stat.n, stat.mean, stat.std) == (3, 2.0, 1.0)
  assert stat.interval == pytest.approx((2 - 4.303 / math.sqrt(3), 2 + 4.303 / math.sqrt(3)))
  assert compare.Stat.of([5.0]) == compare.Stat(1, 5.0, 0.0, None)
  # Welch: var/n 1/3 and 4/3, df = (5/3)^2 / ((1/3)^2/2 + (4/3)^2/2) = 2.94 -> t(2) = 4.303.
  base, arm = compare.Stat.of([1.0, 2.0, 3.0]), compare.Stat.of([8.0, 10.0, 12.0])
  diff = compare.Difference.between(arm, base)
  assert diff.value == 8.0 and diff.half_width == pytest.approx(4.303 * math.sqrt(5 / 3))
  assert diff.beyond_noise  # 8 > 5.56
  near = compare.Difference.between(compare.Stat.of([2.0, 4.0, 6.0]), base)
  assert near.value == 2.0 and not near.beyond_noise
  assert compare.Difference.between(compare.Stat.of([9.0]), base).half_width is None
  assert [compare.t_975(df) for df in (1, 2.9, 30, 31, 45, 1000)] == [
      12.706, 4.303, 2.042, 2.021, 2.000, 1.960]


def write_sweep(root, finals: dict[str, list[float]], steps=6, done=True):
  """A sweep of one axis (`rl.kl_coef`, an arm per key of `finals`), one seed per value: each
  run's emotion/final_mean is its value at every step (other metrics follow from it)."""
  runs = []
  for arm_value, per_seed in finals.items():
    for seed, final in enumerate(per_seed):
      run = sweep.Run((("rl.kl_coef", arm_value),), seed)
      runs.append(run)
      run_dir = root / run.name
      run_dir.mkdir(parents=True)
      (run_dir / "metrics.jsonl").write_text("".join(json.dumps({
          "step": s, "emotion/final_mean": final, "success_rate": final / 2,
          "emotion/final/listen": final + 1, "success_rate/listen": final / 4,
          **({"reward/mean": final / 100} if s != steps else {})}) + "\n"
          for s in range(1, steps + 1)))
      if done:
        (run_dir / sweep.DONE_FILE).write_text("{}")
  axes = [sweep.Axis("rl.kl_coef", tuple(finals))]
  sweep.write_grid(str(root), ["--config=configs/demo.py"], axes,
                   max(len(v) for v in finals.values()), runs)


def test_the_comparison_marks_only_the_arm_beyond_the_seed_noise(tmp_path):
  write_sweep(tmp_path, {"0": [60.0, 62.0, 64.0], "0.05": [70.0, 72.0, 74.0],
                         "0.1": [58.0, 63.0, 68.0]})
  written = compare.write_comparison(str(tmp_path), last=5)
  assert [os.path.basename(p) for p in written] == list(compare.OUTPUTS)
  table = (tmp_path / "compare.md").read_text()
  rows = {}  # each arm's row of the first table (the headline metrics)
  for line in table.splitlines():
    if line.startswith("| rl.kl_coef"):
      rows.setdefault(line.split(" | ")[0].lstrip("| "), line)
  half = 4.303 * 2 / math.sqrt(3)  # std 2 over 3 seeds
  assert f"62.0 ± 2.0 [{62 - half:.1f}, {62 + half:.1f}]" in rows["rl.kl_coef=0 (baseline)"]
  assert "(+10.0*)" in rows["rl.kl_coef=0.05"]  # 10 against a Welch half width of 4.5
  assert "63.0 ± 5.0" in rows["rl.kl_coef=0.1"] and "(+1.0)" in rows["rl.kl_coef=0.1"]
  assert "## Final emotion by hidden intention" in table and "| listen |" in table
  assert "## Success (%) by hidden intention" in table
  assert "| rl.kl_coef=0.05 | 3 | 73.0 ± 2.0 (+10.0*) |" in table  # listen: no interval
  # Each run on its own: the headline metrics, then the final emotion by intention.
  assert "| rl.kl_coef=0.05/seed=1 | 6 | 72.0 | 36.0 | 0.720 | 73.0 |" in table
  assert "0.620 ± 0.020 [0.570, 0.670]" in rows["rl.kl_coef=0 (baseline)"]  # a reward
  assert "Not finished" not in table
  lines = list(csv.DictReader(io.StringIO((tmp_path / "compare.csv").read_text())))
  by = {(r["arm"], r["metric"]): r for r in lines}
  assert {r["metric"] for r in lines} == {"emotion/final_mean", "success_rate", "reward/mean",
                                          "emotion/final/listen", "success_rate/listen"}
  reward = by[("rl.kl_coef=0.05", "reward/mean")]  # the last step has none: a gap, not a 0
  assert float(reward["mean"]) == pytest.approx(0.72) and reward["beyond_seed_noise"] == "True"
  assert by[("rl.kl_coef=0.05", "emotion/final_mean")]["rl.kl_coef"] == "0.05"
  assert by[("rl.kl_coef=0", "emotion/final_mean")]["beyond_seed_noise"] == ""  # the baseline
  assert float(by[("rl.kl_coef=0.1", "success_rate/listen")]["std"]) == pytest.approx(1.25)
  assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
  events = [f for _, _, files in os.walk(tmp_path / "hparams") for f in files
            if f.startswith("events.out.tfevents")]
  assert len(events) >= 9  # one per run, and the view's own


def test_a_comparison_counts_unfinished_runs_by_the_steps_they_have(tmp_path):
  write_sweep(tmp_path, {"0": [60.0], "0.1": [50.0]}, done=False)
  table = compare.markdown(str(tmp_path), *compare.load_runs(str(tmp_path)), last=5)
  assert "Not finished (2 of 2 runs" in table and "50.0 ± 0.0 (-10.0)" in table  # no interval
  with pytest.raises(UserInputError, match="no sweep here"):
    compare.load_runs(str(tmp_path / "elsewhere"))


def test_a_workdir_holding_another_sweep_is_refused(tmp_path):
  write_sweep(tmp_path, {"0": [60.0]})
  with pytest.raises(UserInputError, match="holds another sweep"):
    sweep.write_grid(str(tmp_path), ["--config=configs/ppo.py"], [], 1,
                     [sweep.Run((), 0)])


def test_print_writes_each_runs_command_for_this_machine_and_a_pod(tmp_path):
  out = subprocess.run(
      [sys.executable, "-m", "rlver_jax.sweep", "--sweep=sim_user.variant=vanilla,challenging",
       "--seeds=2", f"--workdir={tmp_path}", "--print", "--config.steps=2"],
      cwd=ROOT, env=processes.cpu_env(), capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  assert lines[0] == "# 4 runs on this machine" and lines[5].startswith("# 4 runs on a TPU pod")
  assert lines[1] == (f"python -m rlver_jax.main --config.steps=2 "
                      f"--config.sim_user.variant=vanilla --config.seed=0 "
                      f"--config.workdir={tmp_path}/sim_user.variant=vanilla/seed=0")
  assert lines[6].startswith("./run_tpu.sh run rlver_jax.main --config.steps=2 ")
  assert not os.listdir(tmp_path)  # nothing run, nothing written
  bad = subprocess.run([sys.executable, "-m", "rlver_jax.sweep", "--sweep=rl.kl_coeff=0",
                        f"--workdir={tmp_path}", "--print"], cwd=ROOT, env=processes.cpu_env(),
                       capture_output=True, text=True, timeout=120)
  assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith(
      "error: run rl.kl_coeff=0/seed=0: no field rl.kl_coeff")


# Three steps of 4 profiles with 8-token replies; the axes change no compiled program (the
# simulator's prompts and where the reward lands), so the runs after the first load theirs.
SMALL = ["--config.steps=3", "--config.batch_size=4", "--config.rollout.max_new_tokens=8",
         "--config.policy.tiny_warmup_steps=2", "--config.checkpoint.every=1",
         "--config.checkpoint.export_at_end=False"]
AXES = ["--sweep=sim_user.variant=vanilla,challenging", "--sweep=rl.reward=turn,final"]


@pytest.mark.heavy
def test_a_sweep_stopped_midway_and_run_again_runs_each_step_once_and_compares(tmp_path):
  """A 2x2 sweep of 3-step runs, stopped with SIGTERM in its third run's second step (it saves
  that step or the first, and cannot reach the third) and run again to its end. Over 60 s
  (64 s alone, 122 s in CI beside the other worker): five training CLI start-ups, each a
  process that imports JAX and loads its programs. One seed: the statistics over seeds are
  checked on numbers worked by hand above."""
  command = [sys.executable, "-m", "rlver_jax.sweep", *AXES, "--seeds=1",
             f"--workdir={tmp_path}", *SMALL]
  first = subprocess.Popen(command, cwd=ROOT, env=processes.cpu_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  third = tmp_path / "sim_user.variant=challenging,rl.reward=turn" / "seed=0"
  try:
    processes.wait_until(lambda: len(read_metrics(third)) >= 1, [first], 600)
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=300)
  finally:
    first.kill()
  assert first.returncode == preemption.PREEMPTED_EXIT_CODE, err[-3000:]
  assert err.strip().splitlines()[-1].startswith(
      "preempted: SIGTERM: stopped in run 3/4 (sim_user.variant=challenging,rl.reward=turn/"
      "seed=0); 2 of 4 runs done, a stopped one saved its last finished step.")
  assert "[1/4] sim_user.variant=vanilla,rl.reward=turn/seed=0: done in" in out
  done_before = {p: p.stat().st_mtime_ns for p in tmp_path.glob(f"*/*/{sweep.DONE_FILE}")}
  assert len(done_before) == 2 and not (third / sweep.DONE_FILE).exists()
  stopped_at = [r["step"] for r in read_metrics(third)]

  again = subprocess.run(command, cwd=ROOT, env=processes.cpu_env(), capture_output=True,
                         text=True, timeout=900)
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.count("done before, kept") == 2
  assert {p: p.stat().st_mtime_ns for p in done_before} == done_before  # not rerun
  grid = json.loads((tmp_path / sweep.SWEEP_FILE).read_text())
  for run in grid["runs"]:
    assert [r["step"] for r in read_metrics(tmp_path / run["name"])] == [1, 2, 3], run["name"]
  assert stopped_at in ([1], [1, 2])
  assert "resumed from" in (third / sweep.RUN_LOG).read_text()

  table = (tmp_path / "compare.md").read_text()
  assert f"comparison: {tmp_path}/compare.md" in again.stdout
  assert "4 arm(s) x 1 seed(s)" in table and "(baseline) | 1 |" in table
  assert "## Final emotion by hidden intention" in table
  lines = list(csv.DictReader(io.StringIO((tmp_path / "compare.csv").read_text())))
  finals = [r for r in lines if r["metric"] == "emotion/final_mean"]
  assert [(r["sim_user.variant"], r["rl.reward"], r["seeds"]) for r in finals] == [
      ("vanilla", "turn", "1"), ("vanilla", "final", "1"), ("challenging", "turn", "1"),
      ("challenging", "final", "1")]
  assert all(float(r["std"]) == 0 and r["ci95_low"] == "" for r in finals)  # one seed
  assert (tmp_path / "compare.png").stat().st_size > 10_000


@pytest.mark.heavy
def test_a_failed_run_is_reported_and_the_others_go_on(tmp_path):
  """Two 3-step runs; the first one's profile file is missing (its command line passes the
  checks; the run fails as it starts): about 25 s."""
  from sim_user import profiles
  missing = tmp_path / "missing.jsonl"
  done = subprocess.run(
      [sys.executable, "-m", "rlver_jax.sweep",
       f"--sweep=data.train_profiles={missing},{profiles.DEMO_PROFILES}",
       f"--workdir={tmp_path / 'sweep'}", *SMALL],
      cwd=ROOT, env=processes.cpu_env(), capture_output=True, text=True, timeout=600)
  assert done.returncode == 1, done.stderr[-3000:]
  failed, ran = sweep.grid([sweep.Axis("data.train_profiles",
                                       (str(missing), profiles.DEMO_PROFILES))], 1)
  assert f"[1/2] {failed.name}: failed (exit status 1): error: {missing}: no such file" in (
      done.stdout)
  assert f"[2/2] {ran.name}: done in" in done.stdout
  assert done.stderr.strip().splitlines()[-1].startswith(
      f"error: 1 of 2 runs failed: {failed.name}; each one's log is its sweep_run.log.")
  assert [r["step"] for r in read_metrics(tmp_path / "sweep" / ran.name)] == [1, 2, 3]
  assert (tmp_path / "sweep" / "compare.md").exists()
