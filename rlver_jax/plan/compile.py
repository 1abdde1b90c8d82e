"""Compiling a program with abstract arguments (`compile_program`: its memory per device,
compile seconds, kernels and XLA's FLOP count), and a plan's programs once each with the cost
model's estimate and the jitted functions compiled (`Compiler`)."""

from __future__ import annotations

import contextlib
import re
import time

import jax

from infra import programs
from infra.programs import GIB, Program
from models import partitioning
from rlver_jax import costs
from rlver_jax.plan.spec import PlanSpec


def kernels_of(hlo_text: str) -> list[str]:
  """The custom-call targets of a compiled program's HLO; a Mosaic kernel
  (`tpu_custom_call`) with the instruction's name, which is the kernel's
  (`tpu_custom_call:splash_mha_fwd_segmented_no_residuals`)."""
  found = set()
  for line in hlo_text.splitlines():
    target = re.search(r'custom_call_target="([^"]+)"', line)
    if not target:
      continue
    name = re.match(r"\s*(?:ROOT\s+)?%?([A-Za-z_][\w\-]*?)(?:\.\d+)*\s*=", line)
    found.add(f"{target.group(1)}:{name.group(1)}" if target.group(1) == "tpu_custom_call" and
              name else target.group(1))
  return sorted(found)


def compile_program(program: Program) -> dict:
  """Compiles `program`; its memory (GiB per device), compile seconds, kernels and XLA's own
  FLOP count (loop bodies counted once). `extra_gib` is what it needs beyond its `resident`
  arguments: its other arguments, its temporaries and its outputs not aliased to donated
  inputs."""
  with partitioning.mesh_context(program.mesh):
    lowered = program.fn.lower(*program.args, **program.static)
    start = time.perf_counter()
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      return _out_of_memory(e, program, time.perf_counter() - start)
    seconds = time.perf_counter() - start
  stats = compiled.memory_analysis()
  argument_gib = stats.argument_size_in_bytes / GIB
  temp_gib = stats.temp_size_in_bytes / GIB
  new_outputs_gib = (stats.output_size_in_bytes - stats.alias_size_in_bytes) / GIB
  analysis = compiled.cost_analysis() or {}
  if isinstance(analysis, list):
    analysis = analysis[0] if analysis else {}
  return {"compile_s": seconds, "argument_gib": argument_gib, "temp_gib": temp_gib,
          "output_gib": stats.output_size_in_bytes / GIB,
          "peak_gib": argument_gib + temp_gib + new_outputs_gib,
          "extra_gib": argument_gib - programs.device_gib(program.resident) + temp_gib +
                       new_outputs_gib,
          "kernels": kernels_of(compiled.as_text()),
          "xla_flops_loop_bodies_once": float(analysis.get("flops", 0.0))}


def _out_of_memory(error, program: Program, seconds: float) -> dict:
  """A program the TPU compiler refused because its temporaries exceed the chip's HBM: what it
  said it needs, so the plan reports the program as not fitting (other errors are raised).
  Its outputs are unknown; they are counted as none."""
  needed = re.search(r"RESOURCE_EXHAUSTED: .*?temporaries \(([\d.]+)G\)", str(error))
  if not needed:
    raise error
  arguments = programs.device_gib(program.args)
  temp = float(needed.group(1))
  return {"compile_s": seconds, "argument_gib": arguments, "temp_gib": temp, "output_gib": 0.0,
          "peak_gib": arguments + temp,
          "extra_gib": arguments - programs.device_gib(program.resident) + temp,
          "kernels": [], "xla_flops_loop_bodies_once": 0.0,
          "error": str(error).splitlines()[0]}


def _layout(mesh, weights_fsdp_sharded: bool = True) -> costs.Layout:
  size = lambda axis: mesh.shape.get(axis, 1)
  return costs.Layout(size("data"), size("fsdp"), size("tensor"), weights_fsdp_sharded)


class Compiler:
  """Compiles programs once each (a name may recur between group sizes), recording what
  every compile costs and the names of the jitted functions it compiled (`functions`)."""

  def __init__(self, spec: PlanSpec, chip, cost_args: costs.CostArgs):
    self.spec, self.chip, self.cost_args = spec, chip, cost_args
    self.done = {}

  def __call__(self, key, name: str, program: Program, weights_fsdp_sharded: bool) -> dict:
    if key not in self.done:
      functions = set()
      with _recording_compiles(functions):
        out = compile_program(program)
      out["functions"] = sorted(functions)
      cost = costs.program_cost(program.work, self.spec.model,
                                _layout(program.mesh, weights_fsdp_sharded), self.cost_args)
      out.update(calls=program.calls, work=programs.work_as_dict(program.work),
                 chips=program.mesh.devices.size,
                 **costs.cost_as_dict(cost, self.chip))
      self.done[key] = out
    return self.done[key]


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def _recording_compiles(names: set):
  """Adds the function name of every program compiled inside to `names`."""
  def record(event, seconds, **kwargs):
    del seconds
    if event == COMPILE_EVENT and kwargs.get("fun_name"):
      names.add(function_name(kwargs["fun_name"]))
  jax.monitoring.register_event_duration_secs_listener(record)
  try:
    yield
  finally:
    jax.monitoring.unregister_event_duration_listener(record)


def function_name(fun_name: str) -> str:
  """The jitted function's own name in a compile event's `fun_name` ("jit(update)": update)."""
  match = re.fullmatch(r"jit\((.*)\)", fun_name)
  return match.group(1) if match else fun_name
