"""The trainer on several JAX processes (127.0.0.1, gloo on CPU) against one process."""

import ast
import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from infra import host_metrics
from models import qwen2
from models.sampler import Sampler
from models.sampling import SamplingParams
from rl import updates
from rl.rollout import Rollout
from rlver_jax import multihost, watchdog
from sim_user import profiles
from tests import ROOT
from tests.processes import (SMALL_DEMO_FLAGS, communicate_all, distributed_envs, launch, log_of,
                             logs_of, run_all, wait)
from tests.runs import read_metrics


def test_hosts_split_rows_into_contiguous_blocks():
  assert [list(multihost.block(5, i, 2)) for i in range(2)] == [[0, 1, 2], [3, 4]]
  assert [list(multihost.block(2, i, 3)) for i in range(3)] == [[0], [1], []]


def test_a_rows_tokens_follow_its_id_not_its_batch():
  model = qwen2.init_random(qwen2.Qwen2Config(vocab_size=64, hidden_size=32,
                                              intermediate_size=64, num_layers=1, num_heads=2,
                                              num_kv_heads=1), seed=0)
  sampler = Sampler(model, stop_token_ids=[1])
  params, key = SamplingParams(max_new_tokens=6, temperature=1.0), jax.random.key(7)
  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
  together = sampler.batch.generate(prompts, params, key, row_ids=[10, 11, 12, 13])
  for row in range(4):
    alone = sampler.batch.generate([prompts[row]], params, key, row_ids=[10 + row])
    assert alone.tokens[0] == together.tokens[row]
    np.testing.assert_allclose(alone.logprobs[0], together.logprobs[row], rtol=1e-5)
  other_ids = sampler.batch.generate(prompts, params, key, row_ids=[20, 21, 22, 23])
  assert other_ids.tokens != together.tokens


TWO_STEPS = ("--config.steps=2",)


@pytest.fixture(scope="module")
def one_process_of_four(tmp_path_factory):
  """The demo's metrics on one process of four devices."""
  one = str(tmp_path_factory.mktemp("one") / "run")
  run_all(one, 1, 4, *TWO_STEPS)
  return read_metrics(one)


def project_functions() -> set[str]:
  """The names of the functions (not methods) the project defines: a compiled program named
  like one is the project's; others are JAX's own (eager operations, `jax.random`'s)."""
  names = set()

  def visit(node, in_class: bool) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.FunctionDef):
        if not in_class:
          names.add(child.name)
        visit(child, False)
      else:
        visit(child, in_class or isinstance(child, ast.ClassDef))

  for room in ("models", "rl", "rlver_jax", "sim_user"):
    for path in glob.glob(os.path.join(ROOT, room, "*.py")):
      with open(path) as f:
        visit(ast.parse(f.read()), False)
  return names


@pytest.mark.heavy
@pytest.mark.parametrize("sampler_hosts", ["1", "2"],
                         ids=["a sampler group per host", "one sampler group over both"])
def test_two_processes_of_two_devices_match_one_of_four(tmp_path, one_process_of_four,
                                                        sampler_hosts):
  """Two processes of two devices train two steps of the small demo, against one process of
  four devices: 1.5 minutes on a loaded 2-core machine, most of it the processes' start-up
  and compiles (the two layouts of sampler groups decode with programs of their own; the
  comparison of each with one process is the test)."""
  two, compiles = str(tmp_path / "two"), tmp_path / "compiles.json"
  procs = launch(two, 2, 2, *TWO_STEPS, f"--config.rollout.sampler_hosts={sampler_hosts}",
                 program=("tests.rlver_jax.recording_main", *SMALL_DEMO_FLAGS),
                 extra_env={"RLVER_COMPILES": str(compiles)})
  codes = wait(procs)
  assert codes == [0, 0], logs_of(two, 2)
  a, b = one_process_of_four, read_metrics(two)
  assert [r["step"] for r in b] == [1, 2]  # one metrics file, written once
  for ra, rb in zip(a, b):
    for key in ("samples", "tokens/generated"):
      assert ra[key] == rb[key], (ra["step"], key)
    # The same dialogues; a mean over two hosts is a weighted sum of theirs, added in
    # another order than one host's, so it may differ in the last bit.
    for key in ("reward/mean", "emotion/final_mean", "turns/mean", "response_len/mean"):
      assert ra[key] == pytest.approx(rb[key], rel=1e-12, abs=1e-12), (ra["step"], key)
    end_counts = lambda r: {k: v for k, v in r.items() if k.startswith("sim/end/")}
    assert end_counts(ra) == end_counts(rb) != {}, ra["step"]  # how the dialogues ended
    for key in ("value_loss", "pg_loss", "grad_norm", "entropy"):
      np.testing.assert_allclose(ra[key], rb[key], rtol=1e-3, atol=1e-7,
                                 err_msg=f"step {ra['step']} {key}")
  assert os.path.exists(os.path.join(two, "export", "config.json"))
  assert os.listdir(os.path.join(two, "checkpoints"))
  # The guard: every program of the project the steps compiled is one the planner compiles
  # for the same config on the same devices.
  record = json.loads(compiles.read_text())
  assert record["hosts_per_group"] == int(sampler_hosts)
  dispatched = set(record["trained"]) & project_functions()
  expected = {"update", "critic_values", "_prefill_rows", "_decode_rows", "empty_rows"}
  expected |= {"_group_broadcast"} if sampler_hosts == "2" else {"rewritten"}
  assert expected <= dispatched, dispatched  # the record sees the step's programs
  assert not dispatched - set(record["planned"]), (
      f"the trainer compiled {sorted(dispatched - set(record['planned']))}, which the planner "
      f"does not plan (it compiles {record['planned']})")


# SIGKILL: the lost host's sockets close; SIGSTOP: it hangs, its sockets stay open and
# only the missing heartbeat tells (the survivor may be in a rollout, making no collective call).
@pytest.mark.heavy
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_host_stops_the_other_and_a_relaunch_resumes(tmp_path, how):
  """Two launches of two processes (the second resumes) and a 20 s heartbeat timeout to wait
  out: about 1.5 minutes on 2 cores."""
  workdir = str(tmp_path / "run")
  procs = launch(workdir, 2, 2, "--config.steps=3", heartbeat_s=20)
  try:
    deadline = time.monotonic() + 400
    first_checkpoint = os.path.join(workdir, "checkpoints", "1")
    while not os.path.isdir(first_checkpoint) and time.monotonic() < deadline:
      assert all(p.poll() is None for p in procs), log_of(workdir, 0)[-3000:]
      time.sleep(0.5)
    assert os.path.isdir(first_checkpoint), "step 1 was not checkpointed"
    procs[1].send_signal(how)
    lost_at = time.monotonic()
    assert procs[0].wait(timeout=120) == watchdog.LOST_HOST_EXIT_CODE, log_of(workdir, 0)[-3000:]
    assert time.monotonic() - lost_at < 60
  finally:
    procs[1].kill()
    wait(procs, 1)
  assert "process 0 of 2: stopping: process(es) [1] did not answer" in log_of(workdir, 0)
  checkpointed = max(int(n) for n in os.listdir(os.path.join(workdir, "checkpoints"))
                     if n.isdigit())

  run_all(workdir, 2, 2, "--config.steps=3")
  assert f"at step {checkpointed}" in log_of(workdir, 0)
  assert [r["step"] for r in read_metrics(workdir)] == [1, 2, 3]


@pytest.mark.heavy
def test_the_evaluator_on_two_processes_writes_the_results_of_one(tmp_path, tiny_checkpoint):
  """Two whole evaluations of the eight demo profiles, on one process of one device and on two
  processes of one device each: the comparison is the test, and each needs its own start-up
  and compiles."""
  program = ("rlver_jax.eval", f"--config={ROOT}/configs/eval.py",
             f"--config.policy.checkpoint={tiny_checkpoint}", "--config.policy.dtype=float32",
             f"--config.eval.profiles={profiles.DEMO_PROFILES}", "--config.eval.batch_size=5",
             "--config.eval.max_new_tokens=6", "--config.eval.temperature=1.0",
             "--config.sim_user.backend=scripted", "--config.sim_user.language=en")
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  run_all(one, 1, 1, program=program)
  run_all(two, 2, 1, program=program)
  for name in ("results.jsonl", "summary.json"):
    with open(os.path.join(one, name)) as a, open(os.path.join(two, name)) as b:
      assert a.read() == b.read(), name


def test_the_tpu_launcher_variable_starts_jax_distributed(monkeypatch):
  from rlver_jax import sharding
  calls = []
  monkeypatch.setattr(sharding.jax.distributed, "initialize", lambda **kw: calls.append(kw))
  for name in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("RLVER_HEARTBEAT_TIMEOUT_S", "15")
  assert not sharding.maybe_initialize_distributed()
  monkeypatch.setenv("RLVER_MULTIHOST", "1")
  assert sharding.maybe_initialize_distributed()
  assert calls == [{"heartbeat_timeout_seconds": 15, "shutdown_timeout_seconds": 15}]


REFRESHED_COPY = textwrap.dedent("""
    import dataclasses, sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from models import qwen2, weight_copy
    from rlver_jax import builder, plan, sharding
    assert sharding.maybe_initialize_distributed()
    path, layout = sys.argv[1:]
    run = plan.run_from_settings(mesh_axes={"data": 1, "fsdp": -1, "tensor": 1}, critic=False)
    run = dataclasses.replace(run, rollout=dataclasses.replace(run.rollout,
                                                               sampling_layout=layout))
    meshes = builder.run_meshes(run, qwen2.read_config(path).num_kv_heads, 1)
    graphdef, state = nnx.split(qwen2.from_pretrained(path, mesh=meshes.train))
    copy = weight_copy.sampler_copy(graphdef, state, jnp.bfloat16, layout, meshes, None)
    copy.make(jax.tree.map(lambda x: x + 1, state))  # the weights before a step
    refreshed = copy.refresh(state)  # as after every step: the previous copy donated
    # What the copy should hold: the training weights gathered whole, cast here.
    whole = jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                         state)
    _, _, cast = weight_copy.decoding_copy(graphdef, whole, jnp.bfloat16, copy.as_list)
    leaves, expected = jax.tree.leaves(refreshed), jax.tree.leaves(cast(whole))
    assert len(leaves) == len(expected) > 0
    for got, want in zip(leaves, expected):
      assert got.sharding.device_set == set(jax.local_devices()), got.sharding  # this host's
      assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want))
    print("bitwise equal:", len(leaves), "arrays on", jax.local_device_count(), "chips")
""")


@pytest.mark.parametrize("layout", ["train", "tensor"])
def test_each_hosts_sampler_holds_the_training_weights_cast_bitwise_after_a_refresh(
    tiny_checkpoint, layout):
  procs = [subprocess.Popen(
      [sys.executable, "-c", REFRESHED_COPY, tiny_checkpoint, layout], cwd=ROOT, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
      for env in distributed_envs(2, 2)]
  outputs = communicate_all(procs)
  assert [p.returncode for p in procs] == [0, 0], outputs
  assert all("bitwise equal:" in out for out in outputs), outputs


ONE_HOST_FAILS = textwrap.dedent("""
    import numpy as np
    from jax.experimental import multihost_utils
    from rlver_jax import sharding, watchdog
    assert sharding.maybe_initialize_distributed()
    import jax
    with watchdog.stop_when_a_host_is_lost(answer_within_s=3):
      if jax.process_index() == 1:
        raise ValueError("no samples here")
      multihost_utils.process_allgather(np.zeros(1))  # process 0 waits in a collective
""")


def test_an_error_on_one_host_stops_the_other_naming_it():
  procs = [subprocess.Popen(
      [sys.executable, "-c", ONE_HOST_FAILS], cwd=ROOT, text=True, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, env=env)
      for env in distributed_envs(2, 1, RLVER_HEARTBEAT_TIMEOUT_S="20")]
  outputs = communicate_all(procs)
  assert [p.returncode for p in procs] == [watchdog.LOST_HOST_EXIT_CODE] * 2, outputs
  assert ("process 0 of 2: process 1: stopping: process(es) [0] did not answer within 3 s; "
          "here: ValueError: no samples here") in outputs[0]
  assert "process 1 of 2: stopping" in outputs[1]


def test_step_metrics_combine_by_kind(monkeypatch):
  hosts = object.__new__(multihost.Hosts)
  hosts.count = 2
  per_host = [
      {"metrics": {"reward/mean": 0.5, "emotion/final_mean": 40.0, "sim/retries": 2,
                   "time/rollout": 3.0, "grad_norm": 1.5},
       "counts": {"samples": 3, "dialogues": 4, "kept_dialogues": 4}},
      {"metrics": {"reward/mean": 0.1, "emotion/final_mean": 10.0, "time/rollout": 5.0,
                   "grad_norm": 1.5},
       "counts": {"samples": 1, "dialogues": 4, "kept_dialogues": 1}}]
  monkeypatch.setattr(multihost, "allgather_json", lambda value: per_host)
  out = hosts.reduce_metrics({}, {})
  assert out["reward/mean"] == pytest.approx((3 * 0.5 + 0.1) / 4)  # weighted by samples
  assert out["emotion/final_mean"] == pytest.approx((4 * 40 + 10) / 5)  # by kept dialogues
  assert out["sim/retries"] == 2 and out["time/rollout"] == 5.0 and out["grad_norm"] == 1.5
  assert "grad_norm" in updates.UPDATE_METRICS  # declared there: alike on every host


def test_a_metric_without_a_declared_reduction_fails_on_one_host_too(monkeypatch):
  hosts = object.__new__(multihost.Hosts)
  hosts.count = 1
  with pytest.raises(host_metrics.UndeclaredMetric, match="'new/metric'"):
    hosts.reduce_metrics({"reward/mean": 0.5, "new/metric": 1.0}, {})
  hosts.count = 2
  monkeypatch.setattr(multihost, "allgather_json", lambda value: [
      {"metrics": {"new/metric": 1.0}, "counts": {}}] * 2)
  with pytest.raises(host_metrics.UndeclaredMetric):  # another host's metric too
    hosts.reduce_metrics({}, {})


def test_a_metric_family_weighs_by_its_family_of_counts():
  assert host_metrics.reduction("emotion/final/listen") == host_metrics.weighted(
      "emotion/final/listen")
  assert host_metrics.reduction("sim/http/attempts") == host_metrics.SUM
  with pytest.raises(ValueError, match="declared twice"):
    host_metrics.declare({"reward/mean": host_metrics.SUM})


def test_rates_and_per_intention_emotions_weigh_each_hosts_share(monkeypatch):
  hosts = object.__new__(multihost.Hosts)
  hosts.count = 2
  per_host = [
      {"metrics": {"agent_turns/generated": 10, "agent_turns/cut_off": 5,
                   "agent_turns/cut_off_rate": 50.0, "emotion/final/listen": 80.0,
                   "time/rollout": 1.0},
       "counts": {"samples": 3, "dialogues": 4, "kept_dialogues": 4,
                  "emotion/final/listen": 3}},
      {"metrics": {"agent_turns/generated": 30, "agent_turns/cut_off": 0,
                   "agent_turns/cut_off_rate": 0.0, "emotion/final/listen": 40.0,
                   "time/rollout": 1.0},
       "counts": {"samples": 1, "dialogues": 4, "kept_dialogues": 1,
                  "emotion/final/listen": 1}}]
  monkeypatch.setattr(multihost, "allgather_json", lambda value: per_host)
  rollout = Rollout(samples=[], dialogues=[], metrics={})
  out = hosts.reduce_step_metrics({}, rollout)
  assert out["agent_turns/generated"] == 40 and out["agent_turns/cut_off"] == 5
  assert out["agent_turns/cut_off_rate"] == pytest.approx(100 * 5 / 40)  # not (50 + 0) / 2
  assert out["emotion/final/listen"] == pytest.approx((3 * 80 + 40) / 4)


def test_rollout_engine_figures_combine_as_sums_over_hosts(monkeypatch):
  hosts = object.__new__(multihost.Hosts)
  hosts.count = 2
  engine = lambda efficiency, occupancy, row_steps, decode_s, tokens: {
      "rollout/slot_efficiency": efficiency, "rollout/cache_occupancy": occupancy,
      "rollout/row_steps": row_steps, "rollout/decode_s": decode_s,
      "rollout/sim_wait_s": 2 * decode_s, "rollout/tokens_per_s": tokens / 4.0,
      "tokens/generated": tokens, "time/rollout": 4.0}
  per_host = [{"metrics": engine(1.0, 0.5, 300, 3.0, 300),
               "counts": {"samples": 1, "dialogues": 1, "kept_dialogues": 1,
                          "rollout/row_steps": 300}},
              {"metrics": engine(0.5, 0.2, 100, 1.0, 50),
               "counts": {"samples": 1, "dialogues": 1, "kept_dialogues": 1,
                          "rollout/row_steps": 100}}]
  monkeypatch.setattr(multihost, "allgather_json", lambda value: per_host)
  out = hosts.reduce_step_metrics({}, Rollout(samples=[], dialogues=[], metrics={}))
  assert out["rollout/slot_efficiency"] == pytest.approx((300 + 50) / 400)  # tokens / row-steps
  assert out["rollout/cache_occupancy"] == pytest.approx((300 * 0.5 + 100 * 0.2) / 400)
  assert out["rollout/row_steps"] == 400
  assert out["rollout/tokens_per_s"] == pytest.approx(350 / 4.0)  # both hosts decode at once
  assert out["rollout/decode_s"] == 3.0 and out["rollout/sim_wait_s"] == 6.0  # the slowest host
