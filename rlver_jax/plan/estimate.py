"""Time estimates of a plan from the cost model's figures (`rlver_jax/costs.py`): the step's
seconds, decode tokens/s and MFU (`step_estimate`), the sampler layouts side by side
(`compare_layouts`), and what they assume (`assumptions`)."""

from __future__ import annotations

from infra import programs, topology
from models import partitioning
from rlver_jax import costs
from rlver_jax.plan.compile import Compiler
from rlver_jax.plan.planner import Planner
from rlver_jax.plan.spec import ROLLOUT, UPDATE, PlanSpec


def assumptions(chip: topology.Generation) -> dict:
  return {"peak_tflops_bf16": chip.peak_tflops, "hbm_gbps": chip.hbm_gbps,
          "ici_gbps_one_way": chip.ici_gbps, "source": chip.source,
          "model": "roofline: max(FLOPs / peak, HBM bytes / bandwidth, ICI bytes / bandwidth) "
                   "per program, as if all three overlapped (rlver_jax/costs.py); "
                   "the simulator's latency and host work are not counted",
          "note": "compiler figures and cost-model estimates, not measurements on hardware"}


def step_estimate(spec: PlanSpec, planner: Planner, compiled: dict,
                   chip: topology.Generation) -> dict:
  """Seconds of one step from each program's estimate times its calls per step, the
  rollout's decode tokens/s per chip, and the updates' MFU."""
  seconds = {name: p["estimated_s"] * p["calls"] for name, p in compiled.items()}
  in_rollout = lambda name: compiled[name]["phase"] == ROLLOUT
  rollout = sum(s for name, s in seconds.items() if in_rollout(name))
  learn = sum(s for name, s in seconds.items() if not in_rollout(name))
  update = sum(s for name, s in seconds.items() if name.startswith(("policy/", "critic/"))
               and not name.endswith("/values"))
  shape = planner.shape
  tokens = shape.micro_batch * shape.grad_accum * shape.minibatches * shape.seq_len
  model_flops = tokens * costs.model_flops_per_token(spec.model)
  if spec.critic:
    model_flops += tokens * costs.model_flops_per_token(spec.model, value_model=True)
  decode = [p for name, p in compiled.items()
            if name.startswith("sampler/") and p["work"]["kind"] == programs.DecodeRows.kind]
  out = {"step_s": rollout + learn, "rollout_s": rollout, "learner_s": learn,
         "update_mfu": model_flops / max(update, 1e-12) / (
             chip.peak_tflops * 1e12 * planner.mesh.devices.size),
         "dialogue_tokens": spec.dialogue_tokens}
  if decode:  # the widest chunk over the full cache: the rollout's slowest tokens
    chunk = max(decode, key=lambda p: (p["work"]["slots"], p["work"]["rows"]))
    out["decode_tokens_per_s_per_chip"] = (chunk["work"]["rows"] * chunk["work"]["tokens"] /
                                           chunk["estimated_s"] / chunk["chips"])
  return out


def compare_layouts(planner: Planner, hosts_per_group: int, compile_one: Compiler,
                     compiled: dict, phases: dict, resident_gib: float, fits) -> dict:
  """The sampler layouts on groups of `hosts_per_group` hosts: the copy's memory, the widest
  decode chunk's memory and estimated time, and the rollout phase's peak with it;
  `recommended` is the faster one whose phases both fit."""
  out = {}
  learner_extra = max((compiled[n]["extra_gib"] for n, p in phases.items() if p == UPDATE),
                      default=0.0)
  for layout in partitioning.SAMPLING_LAYOUTS:
    sampler = planner.sampler_plan(hosts_per_group, layout, "bounding")
    (name, program), = [(n, p) for n, p in sampler.programs.items()
                        if isinstance(p.work, programs.DecodeRows)]
    decode = compile_one((hosts_per_group, layout, name), name, program, layout == "train")
    copy_gib = programs.device_gib(sampler.copy)
    rollout = resident_gib + copy_gib + decode["extra_gib"]
    update = resident_gib + copy_gib + learner_extra
    out[layout] = {"sampler_mesh": dict(sampler.group_mesh.shape), "copy_gib": copy_gib,
                   "decode_program": name, "decode_extra_gib": decode["extra_gib"],
                   "decode_chunk_estimated_s": decode["estimated_s"],
                   "decode_bound": decode["bound"], "rollout_gib": rollout,
                   "peak_gib": max(rollout, update), "fits": fits(max(rollout, update))}
  fitting = [layout for layout, v in out.items() if v["fits"]]
  out["recommended"] = min(fitting, key=lambda l: out[l]["decode_chunk_estimated_s"]) if (
      fitting) else None
  return out
