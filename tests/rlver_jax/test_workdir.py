"""A run's workdir and secrets: one run per workdir, a stale lock taken over, a workdir that cannot
be one refused in one line, keys and URL credentials in no output or file of a failing run."""

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from configs import demo
from infra.errors import UserInputError
from rlver_jax import run_config, sections, workdir
from tests import ROOT
from tests import cli_run
from tests.cli_run import run_main
from tests.processes import cpu_env
from tests.runs import read_metrics

HOLD_LOCK = ("import sys, time\nfrom rlver_jax import workdir\n"
             "lock = workdir.RunLock.acquire(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(120)\n")


def hold_lock(path):
  holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], cwd=ROOT, env=cpu_env(),
                            stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == "held"
  return holder


def test_a_second_run_is_refused_naming_the_holder_and_a_dead_ones_lock_is_taken_over(
    tmp_path, caplog):
  holder = hold_lock(tmp_path)
  try:
    start = time.monotonic()
    second = run_main(tmp_path, "--config.steps=1")
    seconds = time.monotonic() - start
  finally:
    holder.send_signal(signal.SIGKILL)  # as `kill -9`: the lock file stays behind
    holder.wait()
  assert second.returncode == 1, second.stderr[-2000:]
  last = second.stderr.strip().splitlines()[-1]
  assert last.startswith(f"error: {tmp_path} is in use by another run (host "
                         f"{socket.gethostname()}, PID {holder.pid}, started "), last
  assert "Traceback" not in second.stderr
  assert seconds < 60  # refused at start-up, before any model is built
  assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "config.json").exists()

  caplog.set_level("WARNING")
  lock = workdir.RunLock.acquire(str(tmp_path))  # the dead holder's file is taken over
  try:
    assert any(f"PID {holder.pid}" in m and "taking over" in m for m in caplog.messages)
    assert f'"pid": {os.getpid()}' in (tmp_path / workdir.LOCK_FILE).read_text()
    with pytest.raises(UserInputError, match=f"PID {os.getpid()}"):
      workdir.RunLock.acquire(str(tmp_path))  # one holder, even within one process
  finally:
    lock.release()
  workdir.RunLock.acquire(str(tmp_path)).release()  # a released lock is free, with no warning
  assert (tmp_path / workdir.LOCK_FILE).read_text() == ""


def test_a_workdir_that_cannot_be_one_is_refused_in_one_line(tmp_path):
  a_file = tmp_path / "file"
  a_file.write_text("x")
  with pytest.raises(UserInputError, match=f"workdir={a_file}: {a_file} is a file, not a dir"):
    workdir.prepare(str(a_file))
  with pytest.raises(UserInputError, match=f"{a_file} is a file, so no directory can be made"):
    workdir.prepare(str(a_file / "run"))
  with pytest.raises(UserInputError, match="cannot create it: No such file or directory"):
    workdir.prepare("/proc/rlver_no_such_dir/run")  # a file system where nothing can be made
  run = run_main(a_file / "run", "--config.steps=1")
  assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
  assert run.stderr.strip().splitlines()[-1] == (
      f"error: --config.workdir={a_file}/run: {a_file} is a file, so no directory can be made "
      "under it; choose another workdir")


def test_a_checkpoint_under_the_tiny_demo_policy_is_refused(tmp_path):
  config = demo.get_config()
  config.workdir = str(tmp_path)
  config.policy.checkpoint = "/ckpt/Qwen2.5-7B-Instruct"
  with pytest.raises(UserInputError, match=r"policy.checkpoint='/ckpt/Qwen2.5-7B-Instruct' with "
                     r"policy.tiny_init=True .*--config.policy.tiny_init=False"):
    sections.train_run(config)


PLANTED_KEY = "sk-PLANTEDKEY0123456789"
PLANTED_PASSWORD = "PLANTEDPASSWORD987"


def _planted(text):
  return "PLANTED" in text


def test_no_planted_secret_in_any_output_or_file_of_a_failing_run(tmp_path):
  # A key given the documented way, on a simulator that is down: the run fails at its health
  # check, before the demo policy's warm-up.
  env = cpu_env(RLVER_TEST_KEY=PLANTED_KEY)
  simulator = ("--config.sim_user.backend=openai", "--config.sim_user.http_retries=0",
               "--config.sim_user.api_key_env=RLVER_TEST_KEY")
  first = run_main(tmp_path / "run", *simulator, "--config.sim_user.base_url=http://127.0.0.1:9/v1",
                   env=env)
  assert first.returncode == 1
  assert first.stderr.strip().splitlines()[-1].startswith(
      "error: the simulator at http://127.0.0.1:9/v1/chat/completions did not answer")
  assert "cannot schedule new futures" not in first.stderr and "Traceback" not in first.stderr
  assert not (tmp_path / "run" / "init_policy").exists()  # the health check came first
  assert (tmp_path / "run" / "config.json").exists()
  # The key itself where its variable's name belongs: refused without being repeated.
  second = run_main(tmp_path / "run2", f"--config.sim_user.api_key_env={PLANTED_KEY}", env=env)
  assert second.returncode == 1
  assert "sim_user.api_key_env must name the environment variable" in second.stderr
  # A password inside the URL: refused, redacted, before anything runs.
  third = run_main(tmp_path / "run3", *simulator,
                   f"--config.sim_user.base_url=http://user:{PLANTED_PASSWORD}@127.0.0.1:9/v1",
                   env=env)
  assert third.returncode == 1 and "Traceback" not in third.stderr
  assert "sim_user.base_url='http://[REDACTED]@127.0.0.1:9/v1': credentials" in third.stderr
  for run in (first, second, third):
    assert not _planted(run.stdout + run.stderr)
  for directory, _, files in os.walk(tmp_path):
    for name in files:
      with open(os.path.join(directory, name), "rb") as f:
        assert b"PLANTED" not in f.read(), os.path.join(directory, name)


def test_saved_and_printed_configs_are_redacted():
  config = demo.get_config()
  config.sim_user.base_url = f"https://me:{PLANTED_PASSWORD}@sim.example/v1"
  config.sim_user.api_key_env = PLANTED_KEY
  tree = run_config.as_json(config)
  assert tree["sim_user"]["base_url"] == "https://[REDACTED]@sim.example/v1"
  assert tree["sim_user"]["api_key_env"] == "[REDACTED]"
  printed = run_config.printable(config)
  assert "[REDACTED]@sim.example" in printed and not _planted(printed)
  config.sim_user.api_key_env = "OPENAI_API_KEY"  # a variable's name is kept as it is
  assert run_config.as_json(config)["sim_user"]["api_key_env"] == "OPENAI_API_KEY"


def test_an_evaluation_takes_the_workdir_lock_too(tmp_path):
  from configs import eval as eval_config
  from rlver_jax import eval as eval_lib
  config = eval_config.get_config()
  config.workdir = str(tmp_path)
  config.policy.checkpoint = str(tmp_path / "policy")  # refused before it is read
  config.eval.profiles = str(tmp_path / "profiles.jsonl")
  config.sim_user.backend = "scripted"
  with workdir.RunLock.acquire(str(tmp_path)):
    with pytest.raises(UserInputError, match=f"{tmp_path} is in use by another run .*PID "
                       f"{os.getpid()}"):
      eval_lib.evaluate(config)


@pytest.mark.heavy
def test_an_early_failure_ends_in_its_one_line_with_no_checkpointing_traceback(tmp_path):
  # A failure just after the checkpoint manager starts (here: no profiles file) used to exit
  # under orbax's clean-up thread, which then printed "cannot schedule new futures after
  # interpreter shutdown" with a traceback, in 3-4 runs of 8 on the CI machine's kind of VM.
  for attempt in range(6):
    run = run_main(tmp_path / str(attempt),
                   "--config.data.train_profiles=/no/such/profiles.jsonl")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == "error: /no/such/profiles.jsonl: no such file"
    assert "Traceback" not in run.stderr and "cannot schedule" not in run.stderr, run.stderr


def test_a_no_space_error_is_found_anywhere_in_an_exception_chain():
  full = OSError(errno.ENOSPC, "No space left on device")
  assert workdir.no_space_error(full) is full
  over_quota = OSError(errno.EDQUOT, "Disk quota exceeded")
  try:
    try:
      raise over_quota
    except OSError:
      raise RuntimeError("a save failed")  # the quota error is its __context__
  except RuntimeError as e:
    assert workdir.no_space_error(ExceptionGroup("writes", [ValueError("x"), e])) is over_quota
  # Orbax's array writes fail as tensorstore's ValueError, which names the OS error's number.
  tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing "x" in OCDBT database: Failed to '
                           "write 269258 bytes to file 14: No space left on device "
                           "[os_error_code='28']")
  assert workdir.no_space_error(RuntimeError("wrapped")) is None
  wrapped = RuntimeError("save failed")
  wrapped.__cause__ = tensorstore
  assert workdir.no_space_error(wrapped) is tensorstore
  assert workdir.no_space_error(OSError(errno.EACCES, "Permission denied")) is None
  assert workdir.no_space_error(ValueError("[os_error_code='13']")) is None


def _full_disk_run(write, *flags):
  """The training CLI whose `write` fails for lack of space (tests/rlver_jax/full_disk_main.py)."""
  return cli_run.run_module("tests.rlver_jax.full_disk_main", *flags,
                            env=cpu_env(RLVER_FULL_DISK=write))


def _no_space_line(run, workdir_path, rerun_to):
  assert run.returncode == workdir.NO_SPACE_EXIT_CODE, run.stderr[-3000:]
  last = cli_run.last_line_only_error(run.stderr)
  assert re.fullmatch(rf"error: no space left on device under {re.escape(str(workdir_path))} "
                      rf"\(\d+ MiB free\); free space and rerun the same command "
                      rf"{re.escape(rerun_to)}", last), last


def test_a_full_disk_at_start_up_ends_in_one_line_with_its_own_exit_status(tmp_path):
  run = _full_disk_run("lock", f"--config.workdir={tmp_path}", "--config.steps=1")
  _no_space_line(run, tmp_path, "to start from the beginning (no checkpoint was complete)")
  assert not (tmp_path / "config.json").exists()  # stopped before anything was written


@pytest.mark.heavy
def test_a_full_disk_in_a_checkpoint_save_names_the_step_to_resume_at_and_the_rerun_loses_nothing(
    tmp_path):
  flags = [f"--config.workdir={tmp_path}", "--config.steps=3", "--config.batch_size=4",
           "--config.rollout.max_new_tokens=8", "--config.checkpoint.every=1",
           "--config.policy.tiny_warmup_steps=2", "--config.mesh.fsdp=1"]
  run = _full_disk_run("checkpoint:2", *flags)
  _no_space_line(run, tmp_path, "to resume at step 1")
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]  # the last complete one, whole
  assert (tmp_path / workdir.LOCK_FILE).read_text() == ""  # released
  before = read_metrics(tmp_path)

  rerun = cli_run.rerun(flags)
  assert "at step 1" in rerun.stderr.split("resumed from")[1].splitlines()[0]
  after = read_metrics(tmp_path)
  assert [r["step"] for r in after] == [1, 2, 3]
  assert after[0] == before[0]  # step 1 kept, not redone
