"""Will it fit, and how fast might it run? Compile every program of a PPO/GRPO step, no weights.

  python -m rlver_jax.plan --topology=v5p-16 --model=qwen2.5-7b \
      --mesh=data=1,fsdp=8,tensor=1 --batch=8 --seq_len=16384 --out=plan.json
  python -m rlver_jax.plan --config=configs/ppo.py --topology=v5p-16 [--config.x=y ...]
  python -m rlver_jax.plan --model=qwen2.5-0.5b --fake_devices=8      # CPU devices

Devices: `--topology=ACCELERATOR_TYPE` (v4-8, v5litepod-16, v5p-16, v6e-8, ...)
compiles for a Cloud TPU slice with no TPU present (libtpu's compiler,
deviceless: `pip install -e .[tpu]`), every host of it; `--fake_devices=N`
plans for N CPU devices; neither plans for the devices at hand.

Programs: the learner programs of `rl/step.py` (value and reference passes,
updates; with gradient accumulation its `gradients`, `accumulate_gradients`
and `apply_gradients`), the sampler's weight refresh (`WeightCopy`) and the
rollout engine's row programs (`Sampler.prefill_rows` / `decode_rows`), on
host 0's devices as the sampler runs on each host's own. The row programs
are a fixed set of at most 12 widths and attended slots at one capacity
(`row_programs.row_program_set`, what the sampler compiles before a rollout);
`--row_programs=all` compiles each, the default `bounding` only the largest
of each kind (the others need less memory) and counts the rest.

Each program is lowered with abstract arrays carrying their shardings and
compiled; its memory analysis gives bytes per device. What stays resident
(policy and critic weights and optimizer states, the reference copy, the
sampler's copy) is counted once; the peak is resident plus the most any one
program adds on top. Each program's kernels are the custom-call targets in
its compiled HLO (splash attention shows as a Mosaic `tpu_custom_call`).
Time estimates come from `rlver_jax/costs.py`: an analytic roofline, not a
measurement.
"""

from __future__ import annotations

import os
import sys


def _flag_from_argv(argv, name: str) -> str:
  """A flag's value read before absl parses the command line (JAX must be set up first)."""
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return ""


if __name__ == "__main__" and _flag_from_argv(sys.argv, "topology"):
  from models import topology as _topology  # the deviceless compiler's environment
  _topology.prepare_environment(_flag_from_argv(sys.argv, "topology"))

if __name__ == "__main__" and int(_flag_from_argv(sys.argv, "fake_devices") or 0):
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={_flag_from_argv(sys.argv, 'fake_devices')}").strip()

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from models import attention, batch_sampler, partitioning, programs, qwen2  # noqa: E402
from models import row_programs, topology, weight_copy  # noqa: E402
from models.errors import UserInputError  # noqa: E402
from models.programs import Program  # noqa: E402
from models.sampling import MIN_CACHE_BUCKET, SamplingParams, bucket_size  # noqa: E402
from rl import engine, learner, step, updates  # noqa: E402
from rl.losses import RLConfig  # noqa: E402
from rlver_jax import costs, simulator_factory  # noqa: E402

GIB = programs.GIB
ROW_PROGRAM_CHOICES = ("bounding", "all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSpec(step.StepShape):
  """What one step runs, from flags or a recipe (`spec_from_config`): the learner programs'
  shapes (`rl.step.StepShape`), and the models, mesh, sampler and rollout around them.

  `dialogues` is the step's dialogue count over all hosts (the rollout rows);
  `cache_len` the slots of a dialogue's cache row (a bucket size); `prefill_chunk`
  the tokens one prefill call feeds a row; `dialogue_tokens` the policy's tokens
  per dialogue assumed by the time estimate.
  """
  model: qwen2.Qwen2Config
  model_name: str
  mesh_axes: dict
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: str = "full"
  attention: str = "auto"
  sampler: bool = True
  sampling_dtype: str = "bfloat16"
  sampling_layout: str = "train"
  dialogues: int = 0  # 0: micro_batch x grad_accum
  cache_len: int = 0  # 0: seq_len
  prefill_chunk: int = 0  # 0: the sampler's PREFILL_CHUNK
  dialogue_tokens: int = 0  # 0: cache_len // 2
  sampling: SamplingParams = SamplingParams()
  temperature: float = 1.0
  row_programs: str = "bounding"
  # The in-process simulator (sim_user.backend=flax): its model, None without one; each of its
  # calls generates `simulator_sampling.max_new_tokens` for up to `simulator_batch` prompts of
  # up to `simulator_prompt_tokens` tokens.
  simulator: qwen2.Qwen2Config | None = None
  simulator_batch: int = 64
  simulator_prompt_tokens: int = 8192
  simulator_sampling: SamplingParams = SamplingParams(max_new_tokens=1024)
  simulator_turns: int = 9  # user turns a dialogue (the rules' agent replies)

  def __post_init__(self):
    if self.row_programs not in ROW_PROGRAM_CHOICES:
      raise UserInputError(f"--row_programs={self.row_programs}: expected one of "
                           f"{', '.join(ROW_PROGRAM_CHOICES)}")
    cache_len = self.cache_len or self.seq_len
    object.__setattr__(self, "cache_len", cache_len)
    object.__setattr__(self, "prefill_chunk", self.prefill_chunk or row_programs.PREFILL_CHUNK)
    object.__setattr__(self, "dialogue_tokens", self.dialogue_tokens or cache_len // 2)
    object.__setattr__(self, "dialogues", self.dialogues or self.micro_batch * self.grad_accum)
    object.__setattr__(self, "remat", qwen2.remat_policy_name(self.remat))


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
  FLOP count (loop bodies counted once)."""
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
  # Donated inputs alias outputs: new memory = temporaries + outputs not aliased to inputs.
  new_outputs_gib = (stats.output_size_in_bytes - stats.alias_size_in_bytes) / GIB
  analysis = compiled.cost_analysis() or {}
  if isinstance(analysis, list):
    analysis = analysis[0] if analysis else {}
  return {"compile_s": seconds, "argument_gib": argument_gib, "temp_gib": temp_gib,
          "output_gib": stats.output_size_in_bytes / GIB,
          "peak_gib": argument_gib + temp_gib + new_outputs_gib,
          # What this program needs beyond the resident weights and optimizer states.
          "extra_gib": argument_gib - programs.device_gib(program.resident) + temp_gib +
                       new_outputs_gib,
          "kernels": kernels_of(compiled.as_text()),
          "xla_flops_loop_bodies_once": float(analysis.get("flops", 0.0))}


def _out_of_memory(error, program: Program, seconds: float) -> dict:
  """A program the TPU compiler refused because its temporaries exceed the chip's HBM: what it
  said it needs, so the plan reports the program as not fitting (other errors are raised)."""
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


def _abstract_model(model_cls, spec: PlanSpec, mesh, remat: str):
  with partitioning.mesh_context(mesh):
    return nnx.eval_shape(lambda: model_cls(spec.model, dtype=jnp.dtype(spec.dtype),
                                            param_dtype=jnp.dtype(spec.param_dtype),
                                            remat=remat, attention=spec.attention,
                                            rngs=nnx.Rngs(0)))


def _row_programs_to_compile(calls: list, choice: str) -> list:
  """All row calls, or the bounding ones: the widest decode chunk and the widest, longest
  prefill at the full capacity, attending over all of it."""
  if choice == "all":
    return calls
  top = lambda kind: max((c for c in calls if c.kind == kind),
                         key=lambda c: (c.capacity, c.slots, c.width, c.chunk))
  return [top("prefill_rows"), top("decode_rows")]


class _Planner:
  """The abstract models of one step on its meshes, and the programs they run."""

  def __init__(self, spec: PlanSpec, devices, host_devices=None):
    self.spec = spec
    self.mesh = partitioning.make_mesh(spec.mesh_axes, devices)
    self.hosts = len({d.process_index for d in self.mesh.devices.flat})
    # The sampler runs on each host's own devices (rlver_jax/multihost.py): one host's.
    if self.hosts > 1 and host_devices is None:
      host_devices = [d for d in self.mesh.devices.flat if d.process_index == 0]
    self.local_mesh = self.mesh if self.hosts == 1 else partitioning.make_mesh(
        partitioning.per_host_axes(spec.mesh_axes, self.hosts), host_devices)
    self.loss_cfg = RLConfig(kl_coef=1.0 if spec.reference else 0.0)
    tx = learner.make_optimizer(learner.AdamWConfig())
    self.policy_model = _abstract_model(qwen2.Qwen2, spec, self.mesh, spec.remat)
    policy_loss = functools.partial(updates.policy_loss, temperature=spec.temperature)
    self.policy = learner.Learner.abstract(self.policy_model, tx, policy_loss, self.loss_cfg,
                                           self.mesh)
    self.critic = self.reference = None
    if spec.critic:
      self.critic = learner.Learner.abstract(
          _abstract_model(qwen2.Qwen2Value, spec, self.mesh, spec.remat), tx,
          updates.critic_loss, self.loss_cfg, self.mesh, metric_prefix="critic_")
    if spec.reference:  # frozen, no remat (builder.training_models)
      self.reference = learner.Learner.abstract(
          _abstract_model(qwen2.Qwen2, spec, self.mesh, "none"), mesh=self.mesh)

  @property
  def rows_per_host(self) -> int:
    return -(-self.spec.dialogues // self.hosts)

  def learner_programs(self) -> dict[str, Program]:
    """What the training step of these learners runs (`rl.step.AlgorithmStep.programs`)."""
    return step.AlgorithmStep(self.policy, self.critic, self.reference, self.loss_cfg,
                              step.StepConfig(temperature=self.spec.temperature)
                              ).programs(self.spec)

  @functools.cached_property
  def policy_on_host(self):
    """The policy's graphdef and its weights placed on host 0's mesh (`Hosts.local_params`),
    abstract: what the sampler's copy is made from."""
    graphdef, state = nnx.split(self.policy_model)
    return graphdef, programs.abstract(state, partitioning.state_shardings(state,
                                                                            self.local_mesh))

  def sampling_weights(self, layout: str):
    """(graphdef, abstract weights, layers as a list, the copy or None) the sampler decodes
    from on host 0's mesh in `layout`."""
    graphdef, local = self.policy_on_host
    if not self.spec.sampling_dtype:
      return graphdef, local, False, None
    copy = weight_copy.WeightCopy(graphdef, local, jnp.dtype(self.spec.sampling_dtype), layout,
                                  self.local_mesh)
    return copy.graphdef, copy.abstract, copy.as_list, copy

  def sampler_programs(self, layout: str, choice: str) -> tuple[dict[str, Program], int, object]:
    """The refresh and the row programs to compile, the count of row programs a step may
    compile, and the copy's abstract weights (resident)."""
    spec = self.spec
    graphdef, weights, as_list, copy = self.sampling_weights(layout)
    out = {}
    if copy is not None:
      out["sampler/refresh_weights"] = copy.refresh_program(self.local_mesh,
                                                            self.policy_on_host[1])
    shards = math.prod(self.local_mesh.shape[a]
                       for a in partitioning.mesh_axes("batch", self.local_mesh))
    calls = row_programs.row_program_set(
        math.lcm(self.rows_per_host, shards), bucket_size(spec.cache_len, MIN_CACHE_BUCKET),
        shards, prefill_chunk=spec.prefill_chunk)
    bounding = _row_programs_to_compile(calls, "bounding")
    for call in _row_programs_to_compile(calls, choice):
      program = row_programs.row_program(graphdef, weights, spec.model, self.local_mesh, call,
                                        math.lcm(self.rows_per_host, shards),
                                        jnp.dtype(spec.dtype), as_list, spec.sampling)
      # Which smaller shapes a rollout meets depends on its events: the estimate charges
      # every call to the bounding programs (an upper bound) and none to the others.
      out[call.name] = dataclasses.replace(program, calls=_row_calls_per_step(
          call, spec, self.rows_per_host) if call in bounding else 0.0)
    return out, len(calls), (weights if copy is not None else ())


  def simulator_programs(self) -> tuple[dict[str, Program], object]:
    """The in-process simulator's generate programs on host 0's mesh (its bf16 weights placed
    like the policy's, `builder.simulated_user`), and those weights (resident)."""
    spec = self.spec
    model = _abstract_model(qwen2.Qwen2, dataclasses.replace(
        spec, model=spec.simulator, dtype="bfloat16", param_dtype="bfloat16"), self.local_mesh,
                            "none")
    graphdef, state = nnx.split(model)
    weights = programs.abstract(state, partitioning.state_shardings(state, self.local_mesh))
    rows = min(spec.simulator_batch, self.rows_per_host)
    listed = batch_sampler.generate_programs(graphdef, weights, spec.simulator,
                                             self.local_mesh, rows, spec.simulator_prompt_tokens,
                                             spec.simulator_sampling, jnp.bfloat16)
    # Two calls (emotion analysis, then the reply) per user turn, for every dialogue.
    calls = 2 * spec.simulator_turns * -(-self.rows_per_host // rows)
    return {f"sim_user/{name}[b={p.work['rows']},t={p.work['tokens']},c={p.work['capacity']}]":
            dataclasses.replace(p, calls=calls) for name, p in listed.items()}, weights


def _row_calls_per_step(call, spec: PlanSpec, rows: int) -> float:
  """How often a step runs a bounding row program, for the estimate: every decode chunk of
  `dialogue_tokens` tokens, and the prefill of the rest of `seq_len` in full chunks."""
  if call.kind == "decode_rows":
    return spec.dialogue_tokens / row_programs.DECODE_CHUNK_STEPS * rows / call.width
  fed = max(spec.seq_len - spec.dialogue_tokens, 0)
  return fed / call.chunk * rows / call.width


def plan(spec: PlanSpec, devices=None, chip: topology.Generation | None = None,
         host_devices=None) -> dict:
  """Per-device memory, compile seconds, kernels and estimated costs of every program of one
  step on `devices` (default: all at hand); `chip` (a TPU or GPU generation) adds times, a
  verdict against its HBM and the step estimate. Host-local programs (the sampler's) compile
  for `host_devices` (default: the devices of process 0)."""
  planner = _Planner(spec, devices, host_devices)
  mesh, local_mesh = planner.mesh, planner.local_mesh
  device = mesh.devices.flat[0]
  dtype_bytes = lambda name: jnp.dtype(name).itemsize
  result = {"model": spec.model_name, "model_config": dataclasses.asdict(spec.model),
            "platform": device.platform, "device_kind": device.device_kind,
            "devices": mesh.devices.size, "hosts": planner.hosts, "mesh": dict(mesh.shape),
            "sampler_mesh": dict(local_mesh.shape), "micro_batch": spec.micro_batch,
            "seq_len": spec.seq_len, "grad_accum": spec.grad_accum,
            "minibatches": spec.minibatches, "dialogues": spec.dialogues,
            "cache_len": spec.cache_len, "prefill_chunk": spec.prefill_chunk,
            "dtype": spec.dtype, "param_dtype": spec.param_dtype, "remat": spec.remat,
            "attention": spec.attention, "sampling_dtype": spec.sampling_dtype if spec.sampler
            else "", "sampling_layout": spec.sampling_layout,
            "parameters": sum(x.size for x in jax.tree.leaves(planner.policy.params))}
  result["unsharded_weights_gib"] = (result["parameters"] * dtype_bytes(spec.param_dtype) /
                                     GIB)
  resident = [(planner.policy.params, planner.policy.opt_state)]
  if planner.critic is not None:
    resident.append((planner.critic.params, planner.critic.opt_state))
  if planner.reference is not None:
    resident.append(planner.reference.params)
  with partitioning.mesh_context(mesh):  # the uncached passes' attention on these devices
    uncached = attention.resolve(spec.attention, spec.seq_len, spec.seq_len, cached=False)
  cost_args = dict(compute_bytes=dtype_bytes(spec.dtype), param_bytes=dtype_bytes(
      spec.param_dtype), sampling_bytes=dtype_bytes(spec.sampling_dtype or spec.param_dtype),
                   cache_bytes=dtype_bytes(spec.dtype), remat=spec.remat,
                   causal_half=uncached != "einsum")
  compiled = {}

  def compile_all(listed: dict, sampling_layout: str = "train") -> None:
    for name, program in listed.items():
      if name not in compiled:
        compiled[name] = _compiled_with_cost(program, name, spec, sampling_layout, cost_args,
                                             chip)

  compile_all(planner.learner_programs())
  if spec.simulator is not None:
    simulator_programs, simulator_weights = planner.simulator_programs()
    compile_all(simulator_programs)
    resident.append(simulator_weights)
  result["sampling_copy_gib"] = 0.0
  if spec.sampler:
    layout = spec.sampling_layout
    if chip is not None and spec.sampling_dtype:
      comparison, decode_programs = _compare_layouts(spec, planner, resident, compiled, chip,
                                                     cost_args)
      result["sampling_layouts"] = comparison
      if layout == "auto":  # the faster layout that fits
        layout = comparison["recommended"] or "train"
      compiled.update(decode_programs[layout])
    layout = "train" if layout == "auto" else layout
    sampler_programs, possible, copy = planner.sampler_programs(layout, spec.row_programs)
    compile_all(sampler_programs, layout)
    resident.append(copy)
    result.update(sampling_layout=layout, sampling_copy_gib=programs.device_gib(copy),
                  row_programs={"possible": possible, "compiled": sum(
                      "_rows[" in name for name in sampler_programs)})
  result["programs"] = compiled
  result["resident_gib"] = programs.device_gib(resident)
  result["compile_s"] = sum(p["compile_s"] for p in compiled.values())
  result["peak_gib"] = result["resident_gib"] + max(p["extra_gib"] for p in compiled.values())
  if chip is not None:
    result["hbm_gib"] = chip.hbm_gib
    result["fits"] = result["peak_gib"] <= chip.hbm_gib
    result["assumptions"] = _assumptions(chip)
    result["estimate"] = _step_estimate(spec, planner, compiled, chip)
  return result


def _compiled_with_cost(program: Program, name: str, spec: PlanSpec, sampling_layout: str,
                        cost_args: dict, chip) -> dict:
  """`compile_program` plus the cost model's estimate of one call and the calls per step."""
  out = compile_program(program)
  weights_fsdp_sharded = sampling_layout == "train" or not name.startswith("sampler/")
  cost = costs.program_cost(program.work, spec.model,
                            _layout(program.mesh, weights_fsdp_sharded), **cost_args)
  out.update(calls=program.calls, work=program.work, **costs.cost_as_dict(cost, chip))
  return out


def _assumptions(chip: topology.Generation) -> dict:
  return {"peak_tflops_bf16": chip.peak_tflops, "hbm_gbps": chip.hbm_gbps,
          "ici_gbps_one_way": chip.ici_gbps, "source": chip.source,
          "model": "roofline: max(FLOPs / peak, HBM bytes / bandwidth, ICI bytes / bandwidth) "
                   "per program, as if all three overlapped (rlver_jax/costs.py); "
                   "the simulator's latency and host work are not counted",
          "note": "compiler figures and cost-model estimates, not measurements on hardware"}


def _step_estimate(spec: PlanSpec, planner: _Planner, compiled: dict,
                   chip: topology.Generation) -> dict:
  """Seconds of one step from each program's estimate times its calls per step, the
  rollout's decode tokens/s per chip, and the updates' MFU."""
  seconds = {name: p["estimated_s"] * p["calls"] for name, p in compiled.items()}
  in_rollout = lambda name: name.startswith(("sampler/", "sim_user/"))
  rollout = sum(s for name, s in seconds.items() if in_rollout(name))
  learn = sum(s for name, s in seconds.items() if not in_rollout(name))
  update = sum(s for name, s in seconds.items() if name.startswith(("policy/", "critic/"))
               and not name.endswith("/values"))
  tokens = spec.micro_batch * spec.grad_accum * spec.minibatches * spec.seq_len
  model_flops = tokens * costs.model_flops_per_token(spec.model)
  if spec.critic:
    model_flops += tokens * costs.model_flops_per_token(spec.model, value_model=True)
  decode = [p for name, p in compiled.items()
            if name.startswith("sampler/") and p["work"]["kind"] == "decode_rows"]
  out = {"step_s": rollout + learn, "rollout_s": rollout, "learner_s": learn,
         "update_mfu": model_flops / max(update, 1e-12) / (
             chip.peak_tflops * 1e12 * planner.mesh.devices.size),
         "dialogue_tokens": spec.dialogue_tokens}
  if decode:  # the widest chunk over the full cache: the rollout's slowest tokens
    chunk = max(decode, key=lambda p: (p["work"]["slots"], p["work"]["rows"]))
    out["decode_tokens_per_s_per_chip"] = (chunk["work"]["rows"] * chunk["work"]["tokens"] /
                                           chunk["estimated_s"] / planner.local_mesh.devices.size)
  return out


def _compare_layouts(spec, planner, resident, compiled, chip, cost_args) -> tuple[dict, dict]:
  """Both sampler layouts: the copy's memory, the widest decode chunk's memory and estimated
  time, and whether the step fits with it (besides what is `resident` and the learner
  programs `compiled` so far); `recommended` is the faster one that fits. Also returns each
  layout's compiled decode program, {layout: {name: result}}."""
  out, decode_programs = {}, {}
  learner_extra = max(p["extra_gib"] for p in compiled.values())
  for layout in partitioning.SAMPLING_LAYOUTS:
    listed, _, copy = planner.sampler_programs(layout, "bounding")
    (name, program), = [(n, p) for n, p in listed.items() if p.work["kind"] == "decode_rows"]
    result = _compiled_with_cost(program, name, spec, layout, cost_args, chip)
    decode_programs[layout] = {name: result}
    copy_gib = programs.device_gib(copy)
    peak = programs.device_gib(resident) + copy_gib + max(learner_extra, result["extra_gib"])
    out[layout] = {"copy_gib": copy_gib, "decode_program": name,
                   "decode_extra_gib": result["extra_gib"],
                   "decode_chunk_estimated_s": result["estimated_s"],
                   "decode_bound": result["bound"], "peak_gib": peak,
                   "fits": peak <= chip.hbm_gib}
  fitting = [layout for layout, v in out.items() if v["fits"]]
  out["recommended"] = min(fitting, key=lambda l: out[l]["decode_chunk_estimated_s"]) if (
      fitting) else None
  return out, decode_programs


# Command line.

def _define_flags() -> None:
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "plan a recipe as shipped "
                                  "(configs/ppo.py[:variant]), with --config.x=y overrides")
  flags.DEFINE_string("topology", None, "compile for a Cloud TPU slice (v4-8, v5litepod-16, "
                      "v5p-16, v6e-8, ...), no TPU needed (pip install -e .[tpu])")
  flags.DEFINE_string("model", "qwen2.5-7b", f"one of {sorted(qwen2.PRESETS)}; with --config, "
                      "used when policy.checkpoint has no config.json")
  flags.DEFINE_string("hf_config", None, "an HF config.json instead of --model")
  flags.DEFINE_string("sim_model", "qwen2.5-7b", "with --config and sim_user.backend=flax: the "
                      "in-process simulator's preset, used when sim_user.checkpoint has no "
                      "config.json")
  flags.DEFINE_integer("layers", None, "override the layer count (quick what-ifs)")
  flags.DEFINE_string("mesh", None, "mesh axes, e.g. data=1,fsdp=8,tensor=1 (default: the "
                      "config's, else data=1,fsdp=-1,tensor=1)")
  flags.DEFINE_integer("batch", None, "sequences per micro-batch (default 32; with --config, "
                       "its dialogues per micro-batch)")
  flags.DEFINE_integer("seq_len", None, "tokens per sequence (default 8192; with --config, "
                       "rollout.max_dialogue_tokens rounded up to a power of two)")
  flags.DEFINE_integer("grad_accum", None, "micro-batches per update (default 1, or the "
                       "config's optim.grad_accum)")
  flags.DEFINE_integer("cache_len", None, "sampler cache slots per row (default seq_len)")
  flags.DEFINE_integer("prefill_chunk", None, "tokens one sampler prefill call feeds a row (default "
                       f"{row_programs.PREFILL_CHUNK})")
  flags.DEFINE_integer("dialogue_tokens", None, "the policy's tokens per dialogue, for the "
                       "time estimate (default cache/2)")
  flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
  flags.DEFINE_string("param_dtype", "float32", "parameter dtype")
  flags.DEFINE_string("remat", "full", f"remat policy, one of {qwen2.REMAT_POLICIES}")
  flags.DEFINE_string("attention", "auto", "attention implementation (models/attention.py)")
  flags.DEFINE_bool("critic", True, "also plan the critic (PPO)")
  flags.DEFINE_bool("reference", False, "also plan a reference policy (KL penalty)")
  flags.DEFINE_bool("sampler", True, "also plan the sampler's refresh and row programs")
  flags.DEFINE_string("sampling_dtype", "bfloat16", "the sampler's resident copy of the "
                      "weights (rollout.sampling_dtype); empty: it decodes from the training "
                      "weights")
  flags.DEFINE_string("sampling_layout", "auto", "that copy's layout "
                      "(rollout.sampling_layout): train (fsdp-sharded), decode (whole on "
                      "every fsdp shard), or auto: with --topology the faster that fits, "
                      "else train")
  flags.DEFINE_enum("row_programs", "bounding", list(ROW_PROGRAM_CHOICES), "compile every "
                    "row program a step can meet, or the largest of each kind")
  flags.DEFINE_float("device_memory_gib", None, "memory per device, for a verdict (default "
                     "with --topology: the generation's HBM)")
  flags.DEFINE_integer("fake_devices", 0, "plan for N fake CPU devices (read before JAX starts)")
  flags.DEFINE_string("out", None, "also write the plan as JSON here")


def preset(name: str) -> qwen2.Qwen2Config:
  """The named model preset; UserInputError listing the known ones otherwise."""
  if name not in qwen2.PRESETS:
    known = ", ".join(sorted(qwen2.PRESETS))
    raise UserInputError(f"--model={name}: unknown preset; known: {known} "
                         "(or give --hf_config=config.json)")
  return qwen2.PRESETS[name]


@dataclasses.dataclass(frozen=True)
class Overrides:
  """What the command line sets over a recipe (`spec_from_config`); None keeps the recipe's."""
  model: str = "qwen2.5-7b"  # used where the recipe's checkpoint has no config.json
  hf_config: str | None = None
  layers: int | None = None
  mesh: str | None = None
  batch: int | None = None
  seq_len: int | None = None
  grad_accum: int | None = None
  cache_len: int | None = None
  prefill_chunk: int | None = None
  dialogue_tokens: int | None = None
  row_programs: str = "bounding"
  sim_model: str = "qwen2.5-7b"  # the in-process simulator's, where its checkpoint has none

  @classmethod
  def from_flags(cls, FLAGS) -> "Overrides":
    return cls(**{field.name: FLAGS[field.name].value for field in dataclasses.fields(cls)})

  def model_config(self, checkpoint: str = "") -> tuple[qwen2.Qwen2Config, str]:
    """--hf_config, else the checkpoint's config.json, else --model; --layers over it."""
    path = self.hf_config or (os.path.join(checkpoint, "config.json") if checkpoint else "")
    if path and os.path.exists(path):
      with open(path) as f:
        config, name = qwen2.Qwen2Config.from_hf_dict(json.load(f), source=path), path
    elif self.hf_config:
      raise UserInputError(f"--hf_config={self.hf_config}: no such file")
    else:
      config, name = preset(self.model), self.model
    if self.layers:
      config = dataclasses.replace(config, num_layers=self.layers)
    return config, name

  def mesh_axes(self) -> dict | None:
    try:
      return partitioning.parse_mesh(self.mesh) if self.mesh else None
    except ValueError as e:
      raise UserInputError(str(e)) from None


def spec_from_config(config, overrides: Overrides = Overrides()) -> PlanSpec:
  """A recipe as shipped: its mesh, models, micro-batch, accumulation, sampler and sampling;
  `overrides` (--mesh, --batch, --seq_len and the like) still apply."""
  o = overrides
  model, name = o.model_config("" if config.policy.tiny_init else config.policy.checkpoint)
  optim, rollout = config.optim, config.rollout
  dialogues = config.batch_size * rollout.samples_per_profile
  micro = o.batch or max(dialogues // (optim.num_minibatches * optim.grad_accum), 1)
  return PlanSpec(
      model=model, model_name=name, mesh_axes=o.mesh_axes() or dict(config.mesh),
      micro_batch=micro, seq_len=o.seq_len or bucket_size(rollout.max_dialogue_tokens),
      grad_accum=o.grad_accum or optim.grad_accum,
      minibatches=optim.ppo_epochs * optim.num_minibatches,
      critic=config.rl.algorithm == "ppo", reference=bool(config.rl.kl_coef),
      dtype=config.policy.dtype, param_dtype=config.policy.param_dtype,
      remat=config.policy.remat_policy if config.policy.remat else "none",
      attention=config.policy.attention, sampling_dtype=rollout.sampling_dtype,
      sampling_layout=rollout.sampling_layout, dialogues=dialogues,
      # The rows' capacity as the engine sets it, less the opening feed (a bucket's slack).
      cache_len=o.cache_len or engine.row_capacity(rollout, 0),
      prefill_chunk=o.prefill_chunk or 0,
      dialogue_tokens=o.dialogue_tokens or 0,
      sampling=SamplingParams(temperature=rollout.temperature, top_k=rollout.top_k,
                              top_p=rollout.top_p),
      temperature=rollout.temperature, row_programs=o.row_programs,
      **_simulator_from_config(config.sim_user, o))


def _simulator_from_config(sim_user, o: Overrides) -> dict:
  """PlanSpec fields of an in-process simulator (sim_user.backend=flax); none otherwise."""
  if sim_user.backend != "flax":
    return {}
  path = os.path.join(sim_user.checkpoint, "config.json") if sim_user.checkpoint else ""
  if path and os.path.exists(path):
    with open(path) as f:
      model = qwen2.Qwen2Config.from_hf_dict(json.load(f), source=path)
  else:
    model = preset(o.sim_model)
  return {"simulator": model, "simulator_sampling": SamplingParams(
      max_new_tokens=sim_user.max_tokens, temperature=sim_user.temperature),
          "simulator_turns": simulator_factory.make_rules(sim_user).max_agent_turns}


def spec_from_flags(FLAGS) -> PlanSpec:
  """A step described by flags alone (no --config)."""
  o = Overrides.from_flags(FLAGS)
  model, name = o.model_config()
  return PlanSpec(
      model=model, model_name=name,
      mesh_axes=o.mesh_axes() or dict(partitioning.DEFAULT_MESH_AXES),
      micro_batch=o.batch or 32, seq_len=o.seq_len or 8192, grad_accum=o.grad_accum or 1,
      critic=FLAGS.critic, reference=FLAGS.reference, dtype=FLAGS.dtype,
      param_dtype=FLAGS.param_dtype, remat=FLAGS.remat, attention=FLAGS.attention,
      sampler=FLAGS.sampler, sampling_dtype=FLAGS.sampling_dtype,
      sampling_layout=FLAGS.sampling_layout, cache_len=o.cache_len or 0,
      prefill_chunk=o.prefill_chunk or 0, dialogue_tokens=o.dialogue_tokens or 0,
      row_programs=o.row_programs)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    _plan_from_flags()
  except UserInputError as e:  # the user's mistake: one line; our bugs keep their traceback
    raise SystemExit(f"error: {e}") from None


def _plan_from_flags():
  FLAGS = flags.FLAGS
  config = FLAGS["config"].value
  spec = (spec_from_flags(FLAGS) if config is None else
          spec_from_config(config, Overrides.from_flags(FLAGS)))
  devices = chip = host_devices = None
  if FLAGS.topology:
    if FLAGS.fake_devices:
      raise UserInputError("--topology and --fake_devices: choose one")
    accelerators = topology.parse_accelerator_type(FLAGS.topology)
    devices, chip = topology.slice_devices(accelerators), accelerators.generation
    if accelerators.hosts > 1:
      host_devices = topology.slice_devices(topology.one_host(accelerators))
  result = plan(spec, devices, chip, host_devices)
  if FLAGS.topology:
    result["topology"] = FLAGS.topology
  memory = FLAGS.device_memory_gib or (chip.hbm_gib if chip else None)
  _print(result, spec, memory)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)


def _print(result: dict, spec: PlanSpec, memory_gib: float | None) -> None:
  where = result.get("topology", result["platform"])
  print(f"{result['model']}: {result['parameters'] / 1e9:.2f}B parameters on {where} "
        f"({result['device_kind']}, {result['devices']} devices, {result['hosts']} host(s)), "
        f"mesh {result['mesh']}, micro-batch {spec.micro_batch} x {spec.seq_len} tokens "
        f"(x{spec.grad_accum} accumulated), {spec.dtype} compute / {spec.param_dtype} "
        f"weights, remat {spec.remat}, attention {spec.attention}")
  timed = "estimated_s" in next(iter(result["programs"].values()))
  print(f"{'per device, GiB':<44}{'args':>7}{'temps':>7}{'+resident':>10}{'compile s':>10}"
        + (f"{'est. s':>9}{'x calls':>9}  bound" if timed else "") + "  kernels")
  for name, r in result["programs"].items():
    times = (f"{r['estimated_s']:>9.4f}{r['calls']:>9.1f}  {r['bound']:<7}" if timed else "")
    kernels = r.get("error") or ",".join(r["kernels"]) or "-"
    print(f"{name:<44}{r['argument_gib']:>7.2f}{r['temp_gib']:>7.2f}{r['extra_gib']:>10.2f}"
          f"{r['compile_s']:>10.1f}{times}  {kernels}")
  if "row_programs" in result:
    rows = result["row_programs"]
    print(f"row programs: {rows['compiled']} compiled of the {rows['possible']} shapes a step "
          f"can meet (--row_programs=all compiles every one)")
  copy = (f", the sampler's {result['sampling_dtype']} copy ({result['sampling_layout']} "
          f"layout) {result['sampling_copy_gib']:.2f}" if result["sampling_copy_gib"] else "")
  print(f"resident          {result['resident_gib']:.2f} GiB per device (policy and critic "
        f"weights and optimizer states{copy})")
  print(f"estimated peak    {result['peak_gib']:.2f} GiB per device (resident plus the largest "
        f"'+resident' column); compile {result['compile_s']:.1f} s in all")
  for layout, v in result.get("sampling_layouts", {}).items():
    if layout != "recommended":
      print(f"sampler layout {layout:<7} copy {v['copy_gib']:.2f} GiB, decode chunk "
            f"+{v['decode_extra_gib']:.2f} GiB, est. {v['decode_chunk_estimated_s']:.3f} s "
            f"({v['decode_bound']}-bound), peak {v['peak_gib']:.2f} GiB: "
            f"{'fits' if v['fits'] else 'does NOT fit'}")
  if "sampling_layouts" in result:
    print(f"sampler layout recommended: {result['sampling_layouts']['recommended']}")
  if "estimate" in result:
    e = result["estimate"]
    tokens = (f", decode {e['decode_tokens_per_s_per_chip']:.0f} tokens/s per chip"
              if "decode_tokens_per_s_per_chip" in e else "")
    print(f"estimated step    {e['step_s']:.1f} s (rollout {e['rollout_s']:.1f} s at "
          f"{e['dialogue_tokens']} policy tokens a dialogue, learner {e['learner_s']:.1f} s), "
          f"update MFU {e['update_mfu']:.0%}{tokens}: a roofline cost model "
          f"(rlver_jax/costs.py), not a measurement")
  if memory_gib:
    verdict = "fits" if result["peak_gib"] <= memory_gib else "does NOT fit"
    print(f"verdict: {verdict} in {memory_gib:g} GiB per device")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
