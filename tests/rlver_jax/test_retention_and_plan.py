"""Retention scoring, the retention CLI, the memory planner and the TPU launcher."""

import dataclasses
import json
import os
import re
import stat
import subprocess

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import ppo as configs_ppo
from configs import retention as retention_config
from infra.errors import UserInputError
from models import partitioning, qwen2
from rlver_jax import plan, retention, tiny
from tests import ROOT, cli_run


@pytest.mark.parametrize("response,reference,correct", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "\\dfrac{1}{2}", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("We get 1,234 apples.", "Natalia sold 1234 clips. #### 1234", True),
    ("\\boxed{x^{2}+1}", "x^{2} + 1", True),
    ("\\boxed{\\text{(B)}}", "(B)", True),
    ("The total is 18 then 20.", "#### 18", False),  # the last number counts
    ("no idea", "3", False),
])
def test_math_answers(response, reference, correct):
  predicted = retention.extract_answer(response)
  assert retention.answers_match(predicted, retention.reference_answer(reference)) == correct


def test_instruction_checks():
  response = "<<My Title>>\n\n* one\n* two\n\nall lowercase here"
  checks = [{"type": "title"}, {"type": "num_bullets", "value": 2},
            {"type": "num_paragraphs", "value": 3}, {"type": "max_words", "value": 12},
            {"type": "contains", "value": "lowercase"}, {"type": "no_commas"},
            {"type": "lowercase"}]
  assert retention.check_instructions(response, checks) == [True] * 6 + [False]
  assert retention.check_instructions('```json\n{"a": 1}\n```', [{"type": "json"}]) == [True]


def test_retention_data_errors_name_the_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"prompt": "p", "instructions": [{"type": "max_words", "value": 3}]}\n'
                  '{"prompt": "p", "instructions": [{"type": "rhyme"}]}\n')
  with pytest.raises(retention.RetentionDataError, match=r"bad.jsonl:2: instructions\[0\] "
                                                          "has unknown type 'rhyme'"):
    retention.read_items(str(path), "ifeval")
  with pytest.raises(retention.RetentionDataError, match="need string 'question'"):
    path.write_text('{"q": 1}\n')
    retention.read_items(str(path), "math")


@pytest.mark.parametrize("task,lines", [
    ("math", [{"question": "What is 2+2?", "answer": "#### 4"},
              {"problem": "Half of 1?", "answer": "\\frac{1}{2}"}]),
    ("ifeval", [{"prompt": "Say hi in lowercase.", "instructions": [{"type": "lowercase"}]},
                {"prompt": "Write JSON.", "instructions": [{"type": "json"}]}]),
])
def test_retention_cli_end_to_end(tmp_path, task, lines, tiny_checkpoint):
  data = tmp_path / "data.jsonl"
  data.write_text("".join(json.dumps(line) + "\n" for line in lines))
  config = retention_config.get_config()
  config.workdir = str(tmp_path / "w")
  config.policy.checkpoint = tiny_checkpoint
  config.policy.dtype = "float32"
  config.mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  config.retention.task = task
  config.retention.data = str(data)
  config.retention.max_new_tokens = 8
  summary = retention.evaluate(config)
  rows = [json.loads(l) for l in (tmp_path / "w" / f"retention_{task}.jsonl").read_text()
          .splitlines()]
  assert summary["n"] == len(rows) == 2
  # The summary is the share of rows the scorer marks correct, rescored here from the responses.
  rescored = [retention.score(task, retention._validate(line, task, "-"), row["response"])
              for line, row in zip(lines, rows)]
  assert summary["correct"] == sum(r["correct"] for r in rescored) == sum(
      row["correct"] for row in rows)


@pytest.mark.heavy
def test_plan_compiles_every_program_on_eight_fake_devices():
  config = qwen2.PRESETS["qwen2.5-0.5b"]
  small = dataclasses.replace(config, num_layers=2)
  run = plan.run_from_settings(mesh_axes={"data": 1, "fsdp": 4, "tensor": 2}, reference=True)
  spec = plan.PlanSpec(run=run, model=small, model_name="small", micro_batch=8, seq_len=128)
  sharded = plan.plan(spec)
  single = plan.plan(plan.PlanSpec(
      run=plan.run_from_settings(mesh_axes={"data": 1, "fsdp": 1, "tensor": 1}, critic=False),
      model=small, model_name="small", micro_batch=8, seq_len=128, sampler=False))
  programs = sharded["programs"]
  assert set(programs) == {"policy/logprobs", "policy/update", "critic/values", "critic/update",
                           "reference/logprobs", "sampler/copy_weights",
                           "sampler/prefill_rows[w=8,t=128,s=256,c=256]",
                           "sampler/decode_rows[w=8,s=256,c=256]",
                           "sampler/empty_rows[b=8,c=256]"}
  assert {p["phase"] for n, p in programs.items() if n.startswith("sampler/")} == {
      "rollout", "update"}  # the movement runs after the update, the rows in the rollout
  assert programs["sampler/copy_weights"]["phase"] == "update"
  assert sharded["row_programs"]["compiled"] == 2 < sharded["row_programs"]["possible"]
  assert sharded["devices"] == 8 and sharded["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
  for name, program in programs.items():
    assert program["compile_s"] > 0, name
    assert program["extra_gib"] <= program["peak_gib"], name
  # Each phase's peak: what stays resident plus the most one of its programs adds; the
  # sampler's copy is counted once, in both phases.
  copy = sharded["sampling_copy_gib"]
  for phase in ("rollout", "update"):
    assert sharded[f"{phase}_peak_gib"] == pytest.approx(
        sharded["resident_gib"] + copy + max(p["extra_gib"] for p in programs.values()
                                             if p["phase"] == phase))
  assert sharded["peak_gib"] == max(sharded["rollout_peak_gib"], sharded["update_peak_gib"])
  # The sampler's programs carry the KV cache as an argument on top of the weights:
  # 2 layers of k and v, 8 rows over fsdp=4, 2 kv heads over tensor=2, 256 slots, bf16.
  kv_cache_gib = 2 * 2 * 8 * 2 * 256 * 64 * 2 / 2 ** 30 / 8
  assert programs["sampler/decode_rows[w=8,s=256,c=256]"]["extra_gib"] >= kv_cache_gib
  # Weights and Adam moments (fp32: 3 copies) dominate the arguments; sharding divides them.
  weights = sharded["unsharded_weights_gib"]
  policy = single["programs"]["policy/update"]
  assert policy["argument_gib"] >= 3 * weights
  assert programs["policy/update"]["argument_gib"] < policy["argument_gib"] / 4
  # Policy (+ Adam), critic (+ Adam) and the reference copy stay resident; the sampler's bf16
  # copy is sharded like the weights (train layout: 8 ways).
  assert copy == pytest.approx(weights / 2 / 8, rel=0.05)
  assert sharded["resident_gib"] == pytest.approx(7 * weights / 8, rel=0.05)
  # The names of what it compiled, as a run's compile events name them.
  assert {"update", "critic_values", "sequence_logprobs", "_prefill_rows", "_decode_rows",
          "empty_rows", "rewritten"} <= set(sharded["compiled_functions"])


@pytest.mark.heavy
def test_dropping_the_sampler_copy_frees_it_during_the_update_only():
  small = dataclasses.replace(qwen2.PRESETS["qwen2.5-0.5b"], num_layers=2)
  run = plan.run_from_settings(mesh_axes={"data": 1, "fsdp": 8, "tensor": 1}, critic=False)
  kept = plan.plan(plan.PlanSpec(run=run, model=small, model_name="small", micro_batch=8,
                                 seq_len=128))
  dropped_run = dataclasses.replace(run, rollout=dataclasses.replace(run.rollout,
                                                                     release_sampler_weights=True))
  dropped = plan.plan(plan.PlanSpec(run=dropped_run, model=small, model_name="small",
                                    micro_batch=8, seq_len=128))
  copy = kept["sampling_copy_gib"]
  assert dropped["rollout_peak_gib"] == pytest.approx(kept["rollout_peak_gib"])
  # The update phase loses the copy; making it anew (nothing donated) writes it as an output.
  movement = dropped["programs"]["sampler/copy_weights"]
  assert movement["extra_gib"] >= copy * 0.99
  assert dropped["update_peak_gib"] == pytest.approx(dropped["resident_gib"] + max(
      p["extra_gib"] for p in dropped["programs"].values() if p["phase"] == "update"))
  assert "copy" in movement["functions"] and "rewritten" not in movement["functions"]


@pytest.mark.heavy
def test_a_plan_fits_in_nine_tenths_of_the_chips_memory():
  """The runtime keeps a tenth of the memory (plan.USABLE_MEMORY_FRACTION): a peak at 95% of
  it does not fit, one at 90% does, and `memory_fraction` moves the line."""
  small = dataclasses.replace(qwen2.PRESETS["qwen2.5-0.5b"], num_layers=1)
  run = plan.run_from_settings(mesh_axes={"data": 1, "fsdp": 8, "tensor": 1}, critic=False)
  spec = plan.PlanSpec(run=run, model=small, model_name="small", micro_batch=8, seq_len=64)
  peak = plan.plan(spec)["peak_gib"]
  tight = plan.plan(spec, memory_gib=peak / 0.95)
  assert tight["budget_gib"] == pytest.approx(0.9 * peak / 0.95) and not tight["fits"]
  assert not any(k["fits"] for k in tight["sampler_hosts"].values())
  assert plan.plan(spec, memory_gib=peak / 0.95, memory_fraction=1.0)["fits"]
  assert plan.plan(spec, memory_gib=peak / 0.899)["fits"]


@pytest.mark.heavy
def test_auto_sampler_hosts_names_the_shortfall_where_nothing_fits(tmp_path):
  tiny.write_checkpoint(str(tmp_path), seed=0)
  config = configs_ppo.get_config()
  with pytest.raises(UserInputError, match=r"no sampler group size fits 0.0009 GiB per chip "
                     r"\(90% of 0.001; GiB over"):
    plan.fewest_sampler_hosts(config, str(tmp_path), jax.devices()[:2], 0.001)
  assert plan.fewest_sampler_hosts(config, str(tmp_path), jax.devices()[:2], 64.0) == 1


def test_row_programs_take_rows_within_each_data_shard():
  # The rollout engine's row programs take chosen rows of a KV cache whose batch is split
  # over fsdp. Each shard takes its own rows, so no all-gather carries cache slots (taking
  # them from the whole batch all-gathered the whole cache: +20 GiB per device at 7B, 16k).
  from models import row_programs
  from models.sampling import SamplingParams
  config = qwen2.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2)
  mesh = partitioning.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  graphdef, state = nnx.split(nnx.eval_shape(lambda: qwen2.Qwen2(config, rngs=nnx.Rngs(0))))
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        state, partitioning.state_shardings(state, mesh))
  cache_len = 512  # no other dimension of the programs has this size
  calls = [row_programs.RowCall("prefill_rows", 8, cache_len, cache_len, 16),
           row_programs.RowCall("decode_rows", 8, cache_len, cache_len)]
  for call in calls:
    program = row_programs.row_program(graphdef, params, config, mesh, call, 8, jnp.bfloat16,
                                      False, SamplingParams().static())
    with partitioning.mesh_context(mesh):
      hlo = program.fn.lower(*program.args, **program.static).compile().as_text()
    gathered = [dims.split(",") for dims in
                re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather\(", hlo)]
    assert gathered, call  # the fsdp-split weights are gathered: the pattern finds them
    assert not [dims for dims in gathered if str(cache_len) in dims], (call, gathered)


@pytest.mark.heavy
def test_plan_cli_prints_a_verdict(tmp_path):
  out = cli_run.run_module(
      "rlver_jax.plan", "--model=qwen2.5-0.5b", "--layers=1", "--mesh=data=1,fsdp=2,tensor=2",
      "--fake_devices=4", "--batch=4", "--seq_len=64", "--device_memory_gib=16",
      "--sampling_layout=decode", f"--out={tmp_path / 'plan.json'}")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "verdict: fits in 14.4 GiB per device (90% of 16; sampler_hosts=1)" in out.stdout
  result = json.loads((tmp_path / "plan.json").read_text())
  assert result["budget_gib"] == pytest.approx(0.9 * 16) and result["fits"]
  assert result["mesh"]["tensor"] == 2
  # The decode layout keeps the bf16 copy whole over fsdp, split over tensor=2 only.
  assert "the sampler's bfloat16 copy (decode layout, mesh" in out.stdout
  assert result["sampling_copy_gib"] == pytest.approx(
      result["unsharded_weights_gib"] / 2 / 2, rel=0.05)


def _with_fake_gcloud(tmp_path, script: str) -> dict[str, str]:
  """An environment for run_tpu.sh whose `gcloud` is a shell `script` in tmp_path."""
  fake = tmp_path / "gcloud"
  fake.write_text(f"#!/bin/sh\n{script}\n")
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  return {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "TPU_NAME": "rlver",
          "ZONE": "us-central2-b", "PROJECT": "p"}


def test_run_tpu_sh_drives_gcloud_on_all_workers(tmp_path):
  log = tmp_path / "gcloud.log"
  env = _with_fake_gcloud(tmp_path, f'echo "$@" >> {log}')
  for args in (["create"], ["setup"], ["run", "rlver_jax.main", "--config=configs/ppo.py",
                                       "--config.workdir=gs://b/run 1"], ["delete"]):
    result = subprocess.run(["bash", os.path.join(ROOT, "run_tpu.sh"), *args], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
  calls = log.read_text().splitlines()
  assert calls[0].startswith("compute tpus tpu-vm create rlver --accelerator-type v4-32")
  assert any("scp" in c and "--worker=all" in c for c in calls)
  run = [c for c in calls if "python -m rlver_jax.main" in c]
  assert run and "--worker=all" in run[0] and "run\\ 1" in run[0]
  assert "RLVER_MULTIHOST=1 python -m rlver_jax.main" in run[0]
  assert all("--zone us-central2-b --project p" in c for c in calls)
  assert calls[-1].startswith("compute tpus tpu-vm delete rlver")
  bad = subprocess.run(["bash", os.path.join(ROOT, "run_tpu.sh"), "launch"], env=env,
                       capture_output=True, text=True)
  assert bad.returncode == 2 and "usage" in bad.stderr


def test_run_tpu_sh_has_help_and_a_dry_run_that_calls_no_gcloud(tmp_path):
  called = tmp_path / "gcloud_was_called"
  env = _with_fake_gcloud(tmp_path, f'echo "$@" > {called}\nexit 97')

  def run_tpu(*args, env=env):
    return subprocess.run(["bash", os.path.join(ROOT, "run_tpu.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=60)

  bare = {k: v for k, v in env.items() if k not in ("TPU_NAME", "ZONE")}
  for flag in ("--help", "-h"):
    shown = run_tpu(flag, env=bare)  # help needs no TPU named
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: ") and "--dry-run" in shown.stdout
  commands = {}
  for args in (["--dry-run", "create"], ["--dry-run", "setup"], ["create", "--dry-run"],
               ["--dry-run", "run", "rlver_jax.main", "--config.workdir=gs://b/run 1"],
               ["--dry-run", "run", "rlver_jax.fields"], ["--dry-run", "delete"]):
    result = run_tpu(*args)
    assert result.returncode == 0, result.stderr
    assert not called.exists(), f"{args} ran gcloud {called.read_text()}"
    commands[" ".join(args)] = result.stdout.splitlines()
  assert commands["--dry-run create"] == [
      "gcloud compute tpus tpu-vm create rlver --accelerator-type v4-32 --version "
      "tpu-ubuntu2204-base --zone us-central2-b --project p"]
  assert commands["create --dry-run"] == commands["--dry-run create"]
  setup = commands["--dry-run setup"]
  assert [line.split()[0] for line in setup] == ["tar", "gcloud", "rm", "gcloud"]
  assert "scp" in setup[1] and "--worker=all" in setup[1] and "ssh" in setup[3]
  [run] = commands["--dry-run run rlver_jax.main --config.workdir=gs://b/run 1"]
  assert run.startswith("gcloud compute tpus tpu-vm ssh rlver --worker=all --command ")
  assert "RLVER_MULTIHOST=1\\ python\\ -m\\ rlver_jax.main\\ --config.workdir=gs://b/run" in run
  [bare_run] = commands["--dry-run run rlver_jax.fields"]
  assert "rlver_jax.fields --zone" in bare_run  # no empty '' argument for the module
  assert commands["--dry-run delete"] == [
      "gcloud compute tpus tpu-vm delete rlver --quiet --zone us-central2-b --project p"]
  for args in (["--bogus", "create"], ["create", "now"], ["run"]):
    refused = run_tpu(*args)
    assert refused.returncode == 2 and "usage: " in refused.stderr, args
    assert len(refused.stderr.splitlines()) == 1
  assert not called.exists()


def test_value_pass_runs_in_micro_batches_of_the_update_size():
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from rl import forward, learner as learner_lib
  from rl.batch import TrainBatch
  config = qwen2.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                             num_heads=2, num_kv_heads=1)
  critic = qwen2.Qwen2Value(config, rngs=nnx.Rngs(0))
  critic.value_head.set_value(jnp.ones((32,), jnp.float32))
  learner = learner_lib.Learner(critic)
  rng = np.random.RandomState(0)
  batch = TrainBatch(tokens_bt=rng.randint(0, 64, (8, 12)).astype(np.int32),
                     attention_mask_bt=np.arange(12)[None] < rng.randint(3, 13, (8, 1)),
                     scores_b=np.zeros(8, np.float32))
  seen_rows = []

  def values(graphdef, params, batch):
    seen_rows.append(batch.tokens_bt.shape[0])
    return forward.critic_values(graphdef, params, batch)

  micro = learner.apply_in_micro_batches(values, batch, rows=2)
  assert seen_rows == [2]  # one program, compiled for the micro-batch
  whole = np.asarray(learner.apply(forward.critic_values, batch))
  assert micro.shape == (8, 11)
  np.testing.assert_allclose(micro, whole, atol=1e-5)


def test_recipes_state_the_planned_micro_batch_and_remat_policy():
  from configs import grpo, ppo
  for config in (ppo.get_config(), grpo.get_config()):
    assert config.batch_size // config.optim.grad_accum == 8  # the plan's --batch=8
    assert config.policy.remat and config.policy.remat_policy == "full"
