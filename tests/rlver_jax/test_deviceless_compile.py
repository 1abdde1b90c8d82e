"""TPU and GPU lowering, in CI, without a TPU or GPU: a tiny model's whole PPO and GRPO steps
compiled for a two-host v5p-16 slice by libtpu's compiler, and a step for 8 H200s by the
CUDA plugin's (deviceless, `infra/topology.py`).

A change that breaks TPU lowering (a sharding the TPU partitioner rejects, a
Pallas kernel Mosaic cannot lower, a silent fallback from splash attention)
fails here. Without libtpu (`pip install -e .[tpu]`) the TPU tests are skipped
with that reason, and without the CUDA plugin (`.[gpu]`) the GPU test.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from infra import programs, topology
from infra.errors import UserInputError
from models import partitioning, qwen2, weight_copy
from rlver_jax import builder, plan

V5P_16 = topology.parse_accelerator_type("v5p-16")


@pytest.fixture(scope="module")
def v5p_16():
  try:
    return topology.slice_devices(V5P_16)
  except UserInputError as e:
    pytest.skip(f"no TPU compiler: {e}")

# Splash serves uncached passes longer than attention.EINSUM_MAX_SCORES allows einsum for;
# heads of 128, as every Qwen2.5 size has, for the paged decode kernel.
TINY = qwen2.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=2, num_kv_heads=1)
SPLASH_FORWARD = "tpu_custom_call:splash_mha_fwd"
SPLASH_BACKWARD = ("tpu_custom_call:splash_mha_dq", "tpu_custom_call:splash_mha_dkv")
PAGED = "tpu_custom_call:paged_attention"


def _kernels(result, name):
  return result["programs"][name]["kernels"]


def _has(kernels, prefix):
  return any(k.startswith(prefix) for k in kernels)


@pytest.fixture(scope="module")
def ppo_step(v5p_16):
  """The PPO step with a KL penalty and gradient accumulation: every learner program, the
  weight refresh and every row program a step of this shape can meet."""
  run = plan.run_from_settings(mesh_axes={"data": 1, "fsdp": -1, "tensor": 1}, critic=True,
                               reference=True, grad_accum=2)
  spec = plan.PlanSpec(run=run, model=TINY, model_name="tiny", micro_batch=8, seq_len=1024,
                       grad_accum=2, dialogues=16, cache_len=512, prefill_chunk=64,
                       row_programs="all")
  return plan.plan(spec, v5p_16, V5P_16.generation)


@pytest.mark.heavy
def test_ppo_step_compiles_for_a_two_host_tpu_slice(ppo_step):
  result = ppo_step
  assert result["device_kind"] == "TPU v5" and result["platform"] == "tpu"
  assert result["devices"] == 8 and result["hosts"] == 2
  assert result["sampler_mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}  # one host's chips
  # Sampler groups of one host and of both, side by side: each with its movement over the 8
  # chips, its row programs on the group's chips, and its two phases' peaks.
  assert set(result["sampler_hosts"]) == {1, 2} and result["hosts_per_group"] == 1
  for k, group in result["sampler_hosts"].items():
    assert group["groups"] == 2 // k and group["copy_weights"]["argument_gib"] > 0, k
    assert group["peak_gib"] == max(group["rollout_gib"], group["update_gib"]), k
  assert result["sampler_hosts"][2]["sampler_mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
  names = set(result["programs"])
  assert {"critic/values", "reference/logprobs", "policy/gradients",
          "policy/accumulate_gradients", "policy/apply_gradients", "critic/gradients",
          "critic/accumulate_gradients", "critic/apply_gradients",
          "sampler/copy_weights"} <= names
  rows = [n for n in names if n.startswith(("sampler/prefill_rows", "sampler/decode_rows"))]
  assert len(rows) == result["row_programs"]["possible"] == result["row_programs"]["compiled"]
  # 8 rows a host over fsdp=4: widths 4 and 8; decode over 256 or 512 slots; prefill over 512.
  assert len(rows) == 6
  # Splash attention runs the uncached passes and both directions of the updates.
  for name in ("critic/values", "reference/logprobs", "policy/gradients", "critic/gradients"):
    assert _has(_kernels(result, name), SPLASH_FORWARD), (name, _kernels(result, name))
  for name in ("policy/gradients", "critic/gradients"):
    assert all(_has(_kernels(result, name), k) for k in SPLASH_BACKWARD), _kernels(result, name)
  # Decode chunks attend with the paged kernel, each row up to its own length; prefill
  # chunks (several queries per row over a cache) with einsum.
  for name in rows:
    kernels = _kernels(result, name)
    if "decode_rows" in name:
      assert _has(kernels, PAGED) and not _has(kernels, SPLASH_FORWARD), (name, kernels)
    else:
      assert not _has(kernels, "tpu_custom_call"), (name, kernels)
  # Each micro-batch's gradients leave their program sharded like the weights (fsdp=8); left
  # unpinned they came out whole on every chip (7B: 28 GiB per chip).
  weights_per_chip = result["unsharded_weights_gib"] / 8
  assert result["programs"]["policy/gradients"]["output_gib"] < 2 * weights_per_chip
  for name, program in result["programs"].items():
    # Zeroing a rollout's cache rows once is not estimated (`costs.program_cost`).
    assert program["compile_s"] > 0, name
    assert program["estimated_s"] > 0 or name.startswith("sampler/empty_rows"), name
    assert program["calls"] > 0 or name in rows, name
  assert result["peak_gib"] < result["hbm_gib"] == 95 and result["fits"]
  estimate = result["estimate"]
  assert estimate["step_s"] == pytest.approx(estimate["rollout_s"] + estimate["learner_s"])
  assert 0 < estimate["update_mfu"] < 1 and estimate["decode_tokens_per_s_per_chip"] > 0


@pytest.mark.heavy
def test_the_plan_compares_the_sampling_layouts_and_recommends_one_that_fits(v5p_16):
  run = plan.run_from_settings(mesh_axes={"data": 1, "fsdp": -1, "tensor": 1}, critic=False)
  spec = plan.PlanSpec(run=run, model=TINY, model_name="tiny", micro_batch=8, seq_len=1024,
                       dialogues=16, cache_len=512, prefill_chunk=64, sampling_layout="auto")
  result = plan.plan(spec, v5p_16, V5P_16.generation)
  layouts = result["sampling_layouts"]
  assert layouts["recommended"] in ("train", "decode", "tensor")
  assert result["sampling_layout"] == layouts["recommended"]
  # The decode layout holds the whole bf16 copy on every chip of a host (fsdp=4 there); the
  # tensor layout splits heads up to the model's kv heads, which TINY has one of: its host's
  # 4 chips are data-parallel, each with the whole copy.
  assert layouts["decode"]["copy_gib"] == pytest.approx(4 * layouts["train"]["copy_gib"],
                                                        rel=0.05)
  assert layouts["tensor"]["sampler_mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
  assert layouts["tensor"]["copy_gib"] == pytest.approx(layouts["decode"]["copy_gib"], rel=0.05)


@pytest.mark.heavy
def test_grpo_step_compiles_with_one_update_program(v5p_16):
  # v6e-16: four hosts of 2x2 chips, host 0 holding device ids 0, 1, 4 and 5; its sampler
  # programs compile for that host's chips, the weight movement for all 16.
  v6e_16 = topology.parse_accelerator_type("v6e-16")
  run = plan.run_from_settings(mesh_axes={"data": 2, "fsdp": 8, "tensor": 1}, critic=False)
  spec = plan.PlanSpec(run=run, model=TINY, model_name="tiny", micro_batch=16, seq_len=1024,
                       cache_len=512, prefill_chunk=64)
  result = plan.plan(spec, topology.slice_devices(v6e_16), v6e_16.generation,
                     topology.group_devices(v6e_16))
  assert result["device_kind"] == "TPU v6 lite" and result["hosts"] == 4
  assert set(result["programs"]) >= {"policy/update", "sampler/copy_weights"}
  assert not [n for n in result["programs"] if n.startswith(("critic/", "reference/"))]
  kernels = _kernels(result, "policy/update")
  assert _has(kernels, SPLASH_FORWARD) and all(_has(kernels, k) for k in SPLASH_BACKWARD)
  # Bounding row programs only: the widest decode chunk and prefill at full capacity.
  assert result["row_programs"]["compiled"] == 2 < result["row_programs"]["possible"]
  # data=2, fsdp=8 over 4 hosts: each host's sampler mesh keeps fsdp=4.
  assert result["sampler_mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
  assert set(result["sampler_hosts"]) == {1, 2, 4}  # groups of 1, 2 and 4 hosts compared


# Weights whose largest tensors are stacked layers (8 x 1024 x 8192, 128 MiB in bf16) and the
# embedding (32768 x 1024, 64 MiB): a movement that gathered one whole on a chip would show in
# its temporaries, which are a fraction of that when each chip receives only its share.
MOVED = qwen2.Qwen2Config(vocab_size=32768, hidden_size=1024, intermediate_size=8192,
                          num_layers=8, num_heads=8, num_kv_heads=4)


@pytest.mark.heavy
@pytest.mark.parametrize("layout", ["train", "tensor"])
@pytest.mark.parametrize("hosts_per_group", [1, 2])
@pytest.mark.parametrize("accelerator_type", ["v5p-16", "v6e-16"])
def test_the_weights_reach_every_sampler_group_whatever_the_slices_device_order(
    accelerator_type, hosts_per_group, layout):
  """The weight movement (cast on the training mesh, one reshard onto every sampler group's
  mesh: each host's, or two hosts' together) compiled by libtpu over a whole slice: v5p-16
  (2 hosts, jax.make_mesh orders the chips 0, 4, 2, 6, ...) and v6e-16 (4 hosts, a ring). jit
  refused the fp32 gather it replaced on both: "Received incompatible devices for jitted
  computation"."""
  try:
    devices = topology.slice_devices(topology.parse_accelerator_type(accelerator_type))
  except UserInputError as e:
    pytest.skip(f"no TPU compiler: {e}")
  run = plan.run_from_settings(mesh_axes={"data": 1, "fsdp": -1, "tensor": 1}, critic=False)
  run = dataclasses.replace(run, rollout=dataclasses.replace(run.rollout, sampling_layout=layout))
  meshes = builder.run_meshes(run, MOVED.num_kv_heads, hosts_per_group, devices, process=0)
  hosts = len({d.process_index for d in devices})
  groups, group_chips = hosts // hosts_per_group, len(devices) * hosts_per_group // hosts
  assert meshes.num_groups == groups
  assert all(len(meshes.processes(g)) == hosts_per_group for g in range(groups))
  assert sorted(d.id for d in meshes.order) == sorted(d.id for d in devices)
  # train: the group's chips FSDP-shard the copy; tensor: split by heads up to MOVED's 4 kv
  # heads, data-parallel beyond.
  split = group_chips if layout == "train" else 4
  assert dict(meshes.sampler_mesh.shape) == (
      {"data": 1, "fsdp": split, "tensor": 1} if layout == "train" else
      {"data": group_chips // split, "fsdp": 1, "tensor": split})
  with partitioning.mesh_context(meshes.train):
    model = nnx.eval_shape(lambda: qwen2.Qwen2(MOVED, dtype=jnp.bfloat16,
                                               param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)
  params = programs.abstract(state, partitioning.state_shardings(state, meshes.train))
  copy = weight_copy.sampler_copy(graphdef, params, jnp.bfloat16, layout, meshes, None)
  movement = copy.program(params)
  assert movement.mesh.devices.size == len(devices)  # every chip of every host
  result = plan.compile_program(movement)
  parameters = sum(x.size for x in jax.tree.leaves(params))
  share_gib = parameters * 2 / split / 2 ** 30  # a chip's share of its group's bf16 copy
  assert programs.device_gib(copy.abstract) == pytest.approx(share_gib, rel=0.01)
  # In: the chip's fp32 shards of the training weights and its previous copy (donated, so the
  # new copy is written over it).
  assert result["argument_gib"] == pytest.approx(parameters * 4 / len(devices) / 2 ** 30 +
                                                 share_gib, rel=0.01)
  assert result["output_gib"] == pytest.approx(share_gib, rel=0.01)
  # No chip gathers fp32 weights or a whole stacked tensor: the temporaries stay near the
  # chip's share (measured: at most 1.06 of it, on v5p-16 in the train layout). One stacked
  # tensor (128 MiB in bf16) gathered whole would add 0.9 to 1.8 of the share here.
  assert result["temp_gib"] < 1.2 * share_gib, (result["temp_gib"], share_gib)


@pytest.mark.heavy
def test_a_recipe_plans_as_shipped_with_its_overrides(tmp_path, v5p_16):
  # configs/ppo.py as shipped, with a tiny checkpoint's config.json for the model, a shorter
  # dialogue, a KL penalty and decoupled PPO: the accumulation programs of its grad_accum=4
  # are there.
  import json
  from configs import ppo
  checkpoint = tmp_path / "policy"
  checkpoint.mkdir()
  (checkpoint / "config.json").write_text(json.dumps({
      "model_type": "qwen2", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
      "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}))
  config = ppo.get_config()
  config.policy.checkpoint = str(checkpoint)
  config.rollout.max_dialogue_tokens = 1000
  config.rl.kl_coef = 0.01  # an override: the reference pass joins the plan
  # and decoupled PPO: the updates read the rollout correction's weights and their own rows.
  config.rl.old_logprobs, config.rl.rollout_correction = "learner", "token_tis"
  spec = plan.spec_from_config(config)
  assert (spec.model.num_layers, spec.grad_accum, spec.seq_len) == (1, 4, 1024)
  assert spec.critic and spec.reference and spec.sampling_layout == "train"
  result = plan.plan(dataclasses.replace(spec, cache_len=512, prefill_chunk=64), v5p_16,
                     V5P_16.generation)
  assert {"policy/gradients", "policy/accumulate_gradients", "policy/apply_gradients",
          "reference/logprobs", "policy/logprobs"} <= set(result["programs"])
  assert result["programs"]["policy/gradients"]["calls"] == 4
  assert result["micro_batch"] == 8  # the trainer's: 32 dialogues, 4 micro-batches
  # rollout.sampler_hosts='auto': the fewest hosts per sampler group that fit, planned.
  assert result["hosts_per_group"] == result["recommended_hosts"] == 1


@pytest.mark.heavy
def test_an_in_process_simulator_joins_the_plan(v5p_16):
  """The planner compiles every program of a GRPO step and the simulator's for a TPU slice
  with libtpu's deviceless compiler: about a minute on 2 cores, the compiles themselves."""
  # sim_user.backend=flax: the simulator's generate programs run on each host's devices
  # beside the sampler, and its bf16 weights stay resident.
  from configs import grpo
  config = grpo.get_config()
  config.sim_user.backend = "flax"
  config.rollout.sampler_hosts = "1"  # the in-process simulator: one sampler group per host
  config.rollout.max_dialogue_tokens = 1000
  spec = plan.spec_from_config(config)
  spec = dataclasses.replace(spec, model=TINY, simulator=TINY, simulator_prompt_tokens=300,
                             simulator_sampling=dataclasses.replace(
                                 spec.simulator_sampling, max_new_tokens=64),
                             cache_len=512, prefill_chunk=64)
  assert spec.simulator_turns == 9 and not spec.critic  # rlver_train's 9 replies; GRPO
  result = plan.plan(spec, v5p_16, V5P_16.generation)
  simulator = {n: p for n, p in result["programs"].items() if n.startswith("sim_user/")}
  assert sorted(n.split("[")[0] for n in simulator) == ["sim_user/decode", "sim_user/prefill"]
  # 128 dialogues over 2 hosts: 64 prompts at once, 512 tokens of prefill, 64 new tokens.
  assert "sim_user/prefill[b=64,t=512,c=1024]" in simulator
  assert all(p["compile_s"] > 0 and p["calls"] == 2 * 9 for p in simulator.values())
  assert result["estimate"]["rollout_s"] > sum(
      p["estimated_s"] * p["calls"] for p in simulator.values())


@pytest.mark.heavy
def test_a_step_compiles_for_eight_h200s_with_cudnn_attention():
  try:
    h200 = topology.parse_accelerator_type("h200-8")
    devices = topology.slice_devices(h200)
  except UserInputError as e:
    pytest.skip(f"no GPU compiler: {e}")
  run = plan.run_from_settings(mesh_axes={"data": 1, "fsdp": -1, "tensor": 1})
  spec = plan.PlanSpec(run=run, model=TINY, model_name="tiny", micro_batch=8, seq_len=1024,
                       cache_len=512, prefill_chunk=64)
  result = plan.plan(spec, devices, h200.generation)
  assert result["platform"] == "gpu" and result["device_kind"] == "NVIDIA H200 141GB HBM3e"
  for name in ("critic/values", "policy/update", "critic/update"):
    assert _has(_kernels(result, name), "__cudnn$fmha"), (name, _kernels(result, name))
  assert all(p["compile_s"] > 0 for p in result["programs"].values())
  assert result["fits"] and result["hbm_gib"] == 141.0
