"""The analytic cost model (rlver_jax/costs.py) against XLA's own FLOP count.

XLA counts a loop body once, so the check runs programs whose loops run once:
one decoder layer (the layer scan), sequences of one logits chunk, one decode
step. On such programs the compiler's count is the truth the model must meet.
"""

import dataclasses

import jax
import pytest

from models import qwen2
from models.topology import GENERATIONS
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
  planner = plan._Planner(spec, jax.devices()[:1])
  programs = planner.learner_programs()
  programs.update(planner.sampler_plan(1, "train", "bounding").programs)
  layout = costs.Layout(1, 1, 1)
  checked = set()
  for name, program in programs.items():
    if program.work["kind"] == "copy_weights":
      continue  # a cast: no FLOPs to speak of
    if program.work["kind"] == "decode_rows":  # one step of the decode loop
      program = dataclasses.replace(program, static={**program.static, "steps": 1},
                                    work={**program.work, "tokens": 1})
    xla = plan.compile_program(program)["xla_flops_loop_bodies_once"]
    model = costs.program_cost(program.work, MODEL, layout, compute_bytes=4, param_bytes=4,
                               sampling_bytes=4, cache_bytes=4, remat="none",
                               causal_half=False).flops  # einsum attends to every key
    # Sampling's random bits and softmaxes over the vocabulary are not modelled.
    tolerance = 0.12 if program.work["kind"] == "decode_rows" else 0.05
    assert model == pytest.approx(xla, rel=tolerance), (name, model, xla)
    checked.add(program.work["kind"])
  assert checked == {"forward", "update", "prefill_rows", "decode_rows", "empty_rows"}


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
