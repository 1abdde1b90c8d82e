"""The analytic cost model (rlver_jax/costs.py) against XLA's own FLOP count.

XLA counts a loop body once, so the check runs programs whose loops run once:
one decoder layer (the layer scan), sequences of one logits chunk, one decode
step. On such programs the compiler's count is the truth the model must meet.
"""

import dataclasses
import typing

import jax
import pytest

from infra import programs as model_programs
from infra.topology import GENERATIONS
from models import qwen2
from rlver_jax import costs, plan

MODEL = qwen2.Qwen2Config(vocab_size=2048, hidden_size=512, intermediate_size=1536,
                          num_layers=1, num_heads=8, num_kv_heads=2)


@pytest.mark.heavy
def test_analytic_flops_match_xlas_count_on_loop_free_programs():
  # The sampler decodes from the float32 training weights: no per-step cast of them to count.
  # Einsum attention: the blockwise kernel (auto's choice for 256 queries on CPU) loops.
  run = plan.run_from_settings(mesh_axes={"data": 1, "fsdp": 1, "tensor": 1}, reference=True,
                               dtype="float32", remat="none", sampling_dtype="",
                               attention="einsum")
  spec = plan.PlanSpec(run=run, model=MODEL, model_name="one layer", micro_batch=4, seq_len=256,
                       dialogues=4, cache_len=256, prefill_chunk=64)
  planner = plan.Planner(spec, jax.devices()[:1])
  programs = planner.learner_programs()
  programs.update(planner.sampler_plan(1, "train", "bounding").programs)
  layout = costs.Layout(1, 1, 1)
  args = costs.CostArgs(compute_bytes=4, param_bytes=4, sampling_bytes=4, cache_bytes=4,
                        remat="none", causal_half=False)  # einsum attends to every key
  checked = set()
  for name, program in programs.items():
    if isinstance(program.work, model_programs.CopyWeights):
      continue  # a cast: no FLOPs to speak of
    if isinstance(program.work, model_programs.DecodeRows):  # one step of the decode loop
      program = dataclasses.replace(program, static={**program.static, "steps": 1},
                                    work=dataclasses.replace(program.work, tokens=1))
    xla = plan.compile_program(program)["xla_flops_loop_bodies_once"]
    model = costs.program_cost(program.work, MODEL, layout, args).flops
    # Sampling's random bits and softmaxes over the vocabulary are not modelled.
    tolerance = 0.12 if isinstance(program.work, model_programs.DecodeRows) else 0.05
    assert model == pytest.approx(xla, rel=tolerance), (name, model, xla)
    checked.add(type(program.work))
  assert checked == {model_programs.Forward, model_programs.Update, model_programs.PrefillRows,
                     model_programs.DecodeRows, model_programs.EmptyRows}


def test_every_work_type_has_a_cost_function_and_an_unknown_one_is_named():
  assert set(costs.COST_FNS) == set(typing.get_args(model_programs.Work))
  args = costs.CostArgs(compute_bytes=2, param_bytes=4, sampling_bytes=2, cache_bytes=2,
                        remat="full")
  layout = costs.Layout(1, 4, 1)
  # The critic's passes have a value head, not the LM head.
  policy, critic = (costs.program_cost(model_programs.Forward(rows=8, tokens=64, model=m),
                                       MODEL, layout, args) for m in ("policy", "critic"))
  assert policy.flops - critic.flops == pytest.approx(
      2 * 8 * 64 * (MODEL.vocab_size - 1) * MODEL.hidden_size / layout.chips)
  decode = model_programs.DecodeRows(rows=4, tokens=32, slots=256, capacity=512)
  assert costs.program_cost(decode, MODEL, layout, args) == costs.cached_pass_cost(
      MODEL, layout, 4, 1, 256, 2, 2).scaled(32)

  @dataclasses.dataclass(frozen=True)
  class Unmodelled:
    kind = "unmodelled"

  with pytest.raises(ValueError, match=r"unknown program work type 'Unmodelled'; expected one "
                     r"of \['Forward', "):
    costs.program_cost(Unmodelled(), MODEL, layout, args)


def test_full_remat_recomputes_one_forward_pass_and_mfu_counts_none():
  layout = costs.Layout(1, 8, 1)
  forward = costs.forward_cost(MODEL, layout, rows=8, tokens=1024, compute_bytes=2)
  full = costs.update_cost(MODEL, layout, 8, 1024, 2, 4, remat="full", apply=False)
  none = costs.update_cost(MODEL, layout, 8, 1024, 2, 4, remat="none", apply=False)
  assert full.flops == pytest.approx(4 * forward.flops)
  assert none.flops == pytest.approx(3 * forward.flops)
  # FSDP: a forward pass gathers 7/8 of the bf16 weights on each chip; the update gathers
  # them again for the recomputation and the backward pass, and reduce-scatters fp32 grads.
  weights = costs.matmul_params(MODEL) * 2
  assert forward.ici_bytes == pytest.approx(weights * 7 / 8)
  assert full.ici_bytes == pytest.approx(3 * weights * 7 / 8 + 2 * weights * 7 / 8)
  assert costs.model_flops_per_token(MODEL) == 6 * costs.matmul_params(MODEL)


def test_roofline_names_its_bound():
  v5p = GENERATIONS["v5p"]
  compute = costs.Cost(flops=459e12)
  assert compute.seconds(v5p) == pytest.approx(1.0) and compute.bound(v5p) == "compute"
  memory = costs.Cost(flops=1e12, hbm_bytes=2765e9 * 2)
  assert memory.seconds(v5p) == pytest.approx(2.0) and memory.bound(v5p) == "hbm"
  # A decode step reads the whole weights from HBM in both layouts; the train layout first
  # gathers 3/4 of them over ICI, every token.
  train = costs.cached_pass_cost(MODEL, costs.Layout(1, 4, 1, True), 4, 1, 4096, 2, 2)
  decode = costs.cached_pass_cost(MODEL, costs.Layout(1, 4, 1, False), 4, 1, 4096, 2, 2)
  assert train.ici_bytes == pytest.approx(costs.matmul_params(MODEL) * 2 * 3 / 4)
  assert decode.ici_bytes == 0 and decode.hbm_bytes == train.hbm_bytes
