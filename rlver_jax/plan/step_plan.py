"""The plan of one step (`plan`): every program compiled, each phase's peak per chip against
the chips' memory, the sampler group size and layout that fit, the estimates; and the group
size a run with `rollout.sampler_hosts='auto'` takes from it (`hosts_per_group`)."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from absl import logging

from infra import programs, topology
from infra.errors import UserInputError
from infra.programs import GIB
from models import attention, partitioning
from rl.rollout_config import AUTO
from rlver_jax import costs
from rlver_jax.plan import estimate
from rlver_jax.plan.compile import Compiler
from rlver_jax.plan.planner import Planner, SamplerPlan
from rlver_jax.plan.spec import ROLLOUT, UPDATE, Overrides, PlanSpec, spec_from_config


def _phase_peaks(resident_gib: float, copy_gib: float, compiled: dict, phases: dict, *,
                 drop_copy: bool, rows_gib_in_update: float) -> dict:
  """Each phase's peak per chip: what stays resident through it plus the most one of its
  programs adds. The rollout holds the sampler's copy; the update holds it too unless it is
  dropped (then its making is the movement's own output), and with an off-policy rollout
  also the rollout's row cache (`rows_gib_in_update`)."""
  extra = lambda phase: max((compiled[n]["extra_gib"] for n, p in phases.items() if p == phase),
                            default=0.0)
  return {"rollout_gib": resident_gib + copy_gib + extra(ROLLOUT),
          "update_gib": resident_gib + (0.0 if drop_copy else copy_gib) + rows_gib_in_update +
                        extra(UPDATE)}


# A plan fits when each phase's peak is at most this share of a chip's memory. The compiler's
# memory analysis counts a program's own buffers, not the runtime's: its allocator's
# fragmentation, transfer buffers, the next program's arguments arriving while one runs. So a
# plan at 99% of HBM may not run; vLLM leaves the same tenth (gpu_memory_utilization=0.9).
USABLE_MEMORY_FRACTION = 0.9


def plan(spec: PlanSpec, devices=None, chip: topology.Generation | None = None,
         group_devices=None, memory_gib: float | None = None,
         memory_fraction: float = USABLE_MEMORY_FRACTION) -> dict:
  """Per-device memory, compile seconds, kernels and estimated costs of every program of one
  step on `devices` (default: all at hand), with the sampler on groups of 1, 2 and 4 hosts
  side by side (`group_devices(k)`: the devices of a k-host slice, `Planner`); `chip` (a TPU
  or GPU generation) adds times and the step estimate. The verdict is against `memory_gib`
  (default: the chip's HBM): a peak fits when it is at most `memory_fraction` of it. The
  headline (`programs`, the peaks) is the run's group size, or with
  `rollout.sampler_hosts='auto'` the fewest hosts that fit (`recommended_hosts`)."""
  planner = Planner(spec, devices, group_devices)
  mesh = planner.mesh
  memory_gib = memory_gib or (chip.hbm_gib if chip is not None else None)
  device = mesh.devices.flat[0]
  dtype_bytes = lambda name: jnp.dtype(name).itemsize
  result = {"model": spec.model_name, "model_config": dataclasses.asdict(spec.model),
            "platform": device.platform, "device_kind": device.device_kind,
            "devices": mesh.devices.size, "hosts": planner.hosts, "mesh": dict(mesh.shape),
            "micro_batch": planner.shape.micro_batch, "seq_len": spec.seq_len,
            "grad_accum": spec.grad_accum, "minibatches": spec.minibatches,
            "dialogues": spec.dialogues, "cache_len": spec.cache_len,
            "prefill_chunk": spec.prefill_chunk, "dtype": spec.dtype,
            "param_dtype": spec.param_dtype, "remat": spec.remat, "attention": spec.attention,
            "sampling_dtype": spec.sampling_dtype if spec.sampler else "",
            "release_sampler_weights": spec.run.rollout.release_sampler_weights,
            "parameters": sum(x.size for x in jax.tree.leaves(planner.learners.policy.params))}
  result["unsharded_weights_gib"] = (result["parameters"] * dtype_bytes(spec.param_dtype) /
                                     GIB)
  result["padded_rows"] = planner.shape.micro_batch * spec.grad_accum * (
      spec.run.optim.num_minibatches)
  resident = planner.resident()
  with partitioning.mesh_context(mesh):  # the uncached passes' attention on these devices
    uncached = attention.resolve(spec.attention, spec.seq_len, spec.seq_len, cached=False)
  cost_args = costs.CostArgs(
      compute_bytes=dtype_bytes(spec.dtype), param_bytes=dtype_bytes(spec.param_dtype),
      sampling_bytes=dtype_bytes(spec.sampling_dtype or spec.param_dtype),
      cache_bytes=dtype_bytes(spec.dtype), remat=spec.remat, causal_half=uncached != "einsum")
  compile_one = Compiler(spec, chip, cost_args)
  compiled, phases = {}, {}
  for name, program in planner.learner_programs().items():
    compiled[name], phases[name] = compile_one(name, name, program, True), UPDATE
  if spec.simulator is not None:
    simulator_programs, simulator_weights = planner.simulator_programs()
    for name, program in simulator_programs.items():
      compiled[name], phases[name] = compile_one(name, name, program, True), ROLLOUT
    resident.append(simulator_weights)
  result["resident_gib"] = programs.device_gib(resident)
  budget_gib = None if memory_gib is None else memory_gib * memory_fraction
  fits = lambda peak: budget_gib is None or peak <= budget_gib
  result["sampler_hosts"] = {}
  hosts_per_group = planner.configured_hosts or 1
  if spec.sampler:
    layout = "train" if spec.sampling_layout == "auto" else spec.sampling_layout
    if spec.sampling_layout == "auto" and chip is not None and spec.sampling_dtype:
      # The layout first, at the run's group size (the fewest hosts with 'auto').
      comparison = estimate.compare_layouts(planner, hosts_per_group, compile_one, compiled,
                                            phases, result["resident_gib"], fits)
      result["sampling_layouts"] = comparison
      layout = comparison["recommended"] or "train"
    sizes = {}
    for k in planner.group_sizes():
      sampler = planner.sampler_plan(k, layout, spec.row_programs if k == hosts_per_group
                                     else "bounding")
      sizes[k] = (sampler, _sampler_results(sampler, k, layout, compile_one))
    rows_in_update = lambda sampler_results: (max(
        (r["output_gib"] for n, r in sampler_results.items() if "empty_rows" in n),
        default=0.0) if spec.run.rollout.off_policy_steps else 0.0)
    for k, (sampler, sampler_results) in sizes.items():
      peaks = _phase_peaks(result["resident_gib"], programs.device_gib(sampler.copy),
                           {**compiled, **sampler_results}, {**phases, **sampler.phases},
                           drop_copy=spec.run.rollout.release_sampler_weights,
                           rows_gib_in_update=rows_in_update(sampler_results))
      peak = max(peaks.values())
      result["sampler_hosts"][k] = {
          "groups": planner.hosts // k, "sampler_mesh": dict(sampler.group_mesh.shape),
          "copy_gib": programs.device_gib(sampler.copy), **peaks, "peak_gib": peak,
          "fits": fits(peak),
          "copy_weights": {key: sampler_results["sampler/copy_weights"][key] for key in (
              "argument_gib", "temp_gib", "extra_gib")} if (
              "sampler/copy_weights" in sampler_results) else None}
    fitting = [k for k, v in result["sampler_hosts"].items() if v["fits"]]
    result["recommended_hosts"] = min(fitting) if fitting else None
    if planner.configured_hosts is None:  # 'auto': what the trainer would choose
      hosts_per_group = result["recommended_hosts"] or min(
          result["sampler_hosts"], key=lambda k: result["sampler_hosts"][k]["peak_gib"])
    sampler, sampler_results = sizes[hosts_per_group]
    compiled.update(sampler_results)
    phases.update(sampler.phases)
    result.update(sampling_layout=layout, sampler_mesh=dict(sampler.group_mesh.shape),
                  sampling_copy_gib=programs.device_gib(sampler.copy),
                  row_programs={"possible": sampler.possible_row_programs, "compiled": sum(
                      "_rows[" in name and "empty_rows" not in name for name in sampler_results)})
  else:
    result.update(sampling_layout="", sampler_mesh={}, sampling_copy_gib=0.0)
  result["hosts_per_group"] = hosts_per_group
  result["programs"] = {name: {**out, "phase": phases[name]} for name, out in compiled.items()}
  peaks = (result["sampler_hosts"][hosts_per_group] if spec.sampler else _phase_peaks(
      result["resident_gib"], 0.0, compiled, phases, drop_copy=False, rows_gib_in_update=0.0))
  result["rollout_peak_gib"] = peaks["rollout_gib"]
  result["update_peak_gib"] = peaks["update_gib"]
  result["peak_gib"] = max(peaks["rollout_gib"], peaks["update_gib"])
  result["compile_s"] = sum(p["compile_s"] for p in compile_one.done.values())
  # What the trainer compiles for this plan, by function name (tests/rlver_jax/test_multihost.py
  # holds a run to it).
  result["compiled_functions"] = sorted({f for p in compiled.values() for f in p["functions"]})
  if memory_gib is not None:
    result.update(memory_gib=memory_gib, memory_fraction=memory_fraction,
                  budget_gib=budget_gib, fits=fits(result["peak_gib"]))
  if chip is not None:
    result["hbm_gib"] = chip.hbm_gib
    result["assumptions"] = estimate.assumptions(chip)
    result["estimate"] = estimate.step_estimate(spec, planner, result["programs"], chip)
  return result


def _sampler_results(sampler: SamplerPlan, hosts_per_group: int, layout: str,
                     compile_one: Compiler) -> dict:
  """Each of a sampler plan's programs compiled ({name: result})."""
  return {name: compile_one((hosts_per_group, layout, name), name, program,
                            layout == "train" or name == "sampler/copy_weights")
          for name, program in sampler.programs.items()}


def fewest_sampler_hosts(config, policy_path: str, devices, memory_gib: float) -> int:
  """The fewest hosts per sampler group (1, 2, 4, ...) whose plan of the training run
  `config` with the policy of checkpoint directory `policy_path` fits `memory_gib` per chip
  (`USABLE_MEMORY_FRACTION` of it) on `devices`: what `rollout.sampler_hosts='auto'` runs.
  UserInputError where none fits."""
  spec = spec_from_config(config, Overrides(hf_config=os.path.join(policy_path, "config.json")))
  auto = dataclasses.replace(spec.run, rollout=dataclasses.replace(spec.run.rollout,
                                                                   sampler_hosts=AUTO))
  result = plan(dataclasses.replace(spec, run=auto), devices, memory_gib=memory_gib)
  if result["recommended_hosts"] is None:
    misses = {k: round(v["peak_gib"] - result["budget_gib"], 2)
              for k, v in result["sampler_hosts"].items()}
    raise UserInputError(f"rollout.sampler_hosts='auto': no sampler group size fits "
                         f"{result['budget_gib']:.4g} GiB per chip ({result['memory_fraction']:.0%} "
                         f"of {memory_gib:.4g}; GiB over, by hosts per group: {misses}); see "
                         "python -m rlver_jax.plan")
  return result["recommended_hosts"]


def hosts_per_group(config, policy_path: str) -> int:
  """`rollout.sampler_hosts` as a number: "auto" is the fewest hosts per sampler group whose
  plan of this run fits the chips' memory (`fewest_sampler_hosts`), 1 on devices that report
  no memory limit (CPUs)."""
  hosts = jax.process_count()
  if config.rollout.sampler_hosts != AUTO:
    return int(config.rollout.sampler_hosts)
  # This process's own chip: another process's devices report no memory statistics.
  limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
  if not limit or hosts == 1:
    return 1
  k = fewest_sampler_hosts(config, policy_path, jax.devices(), limit / 2**30)
  logging.info("rollout.sampler_hosts='auto': %d host(s) per sampler group (the fewest whose "
               "plan fits %.1f GiB per chip)", k, limit / 2**30)
  return k
