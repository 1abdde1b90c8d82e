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
rollout engine's row programs (`RowSampler.prefill_rows` / `decode_rows`), on
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
  from infra import topology as _topology  # the deviceless compiler's environment
  _topology.prepare_environment(_flag_from_argv(sys.argv, "topology"))

if __name__ == "__main__" and int(_flag_from_argv(sys.argv, "fake_devices") or 0):
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={_flag_from_argv(sys.argv, 'fake_devices')}").strip()

import contextlib  # noqa: E402
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
from jax.sharding import NamedSharding  # noqa: E402

from infra import programs, topology  # noqa: E402
from infra.errors import UserInputError  # noqa: E402
from infra.programs import Program  # noqa: E402
from models import attention, batch_sampler, group_channel, partitioning  # noqa: E402
from models import qwen2, row_programs, row_sampler, weight_copy  # noqa: E402
from models.sampling import MIN_CACHE_BUCKET, SamplingParams, bucket_size  # noqa: E402
from rl import engine, step  # noqa: E402
from rl.rollout_config import AUTO  # noqa: E402
from rlver_jax import builder, costs, sections, simulator_factory  # noqa: E402

GIB = programs.GIB
ROW_PROGRAM_CHOICES = ("bounding", "all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanSpec(step.StepShape):
  """What one step runs: a checked training run (`run`, from a recipe or from flags:
  `spec_from_config`, `spec_from_flags`), whose learners and meshes the builder makes as the
  trainer makes them, and the shapes its programs run at (`rl.step.StepShape`; `critic` and
  `reference` follow `run.rl`).

  `micro_batch` 0 is the trainer's: the step's `dialogues` (over all hosts) padded to a
  multiple of the training mesh's batch shards x grad_accum x num_minibatches, split into
  num_minibatches x grad_accum micro-batches. `cache_len` is the slots of a dialogue's
  cache row (a bucket size); `prefill_chunk` the tokens one prefill call feeds a row;
  `dialogue_tokens` the policy's tokens per dialogue assumed by the time estimate;
  `sampling_layout` the run's ("": `run.rollout.sampling_layout`) or "auto": with a chip,
  the fastest that fits; without `sampler` no sampler programs are planned.
  """
  run: sections.TrainRun
  model: qwen2.Qwen2Config
  model_name: str
  micro_batch: int = 0
  sampler: bool = True
  sampling_layout: str = ""
  dialogues: int = 0  # 0: micro_batch x grad_accum, or without one the run's
  cache_len: int = 0  # 0: seq_len
  prefill_chunk: int = 0  # 0: the sampler's PREFILL_CHUNK
  dialogue_tokens: int = 0  # 0: cache_len // 2
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
    layouts = tuple(partitioning.SAMPLING_LAYOUTS) + ("auto",)
    layout = self.sampling_layout or self.run.rollout.sampling_layout
    if layout not in layouts:
      raise UserInputError(f"--sampling_layout={layout}: expected one of {layouts}")
    cache_len = self.cache_len or self.seq_len
    set_field = functools.partial(object.__setattr__, self)
    set_field("sampling_layout", layout)
    set_field("critic", self.run.rl.uses_critic)
    set_field("reference", self.run.rl.uses_reference)
    set_field("cache_len", cache_len)
    set_field("prefill_chunk", self.prefill_chunk or row_programs.PREFILL_CHUNK)
    set_field("dialogue_tokens", self.dialogue_tokens or cache_len // 2)
    set_field("dialogues", self.dialogues or self.micro_batch * self.grad_accum or
              self.run.batch_size * self.run.rollout.samples_per_profile)

  @property
  def mesh_axes(self) -> dict:
    return dataclasses.asdict(self.run.mesh)

  @property
  def dtype(self) -> str:
    return self.run.policy.dtype

  @property
  def param_dtype(self) -> str:
    return self.run.policy.param_dtype or self.run.policy.dtype

  @property
  def remat(self) -> str:
    return self.run.policy.remat_name

  @property
  def attention(self) -> str:
    return self.run.policy.attention

  @property
  def sampling_dtype(self) -> str:
    return self.run.rollout.sampling_dtype

  @property
  def temperature(self) -> float:
    return self.run.rollout.temperature

  @property
  def sampling(self) -> SamplingParams:
    r = self.run.rollout
    return SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)


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


def _row_programs_to_compile(calls: list, choice: str) -> list:
  """All row calls, or the bounding ones: the widest decode chunk and the widest, longest
  prefill at the full capacity, attending over all of it."""
  if choice == "all":
    return calls
  top = lambda kind: max((c for c in calls if c.kind == kind),
                         key=lambda c: (c.capacity, c.slots, c.width, c.chunk))
  return [top("prefill_rows"), top("decode_rows")]


def _placed_on(tree, mesh):
  """Abstract arrays of `tree` with their partition specs on `mesh` instead."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, x.sharding.spec)), tree)


ROLLOUT, UPDATE = "rollout", "update"


@dataclasses.dataclass
class SamplerPlan:
  """The sampler of one group size and layout: its programs ({name: Program}, each in a
  phase, `phases`), the count of row programs a step may compile, the group's mesh and its
  copy's abstract weights on it (() where it decodes from the training weights)."""
  programs: dict
  phases: dict
  possible_row_programs: int
  group_mesh: object
  copy: object


class _Planner:
  """A run's abstract learners on its training mesh (`builder.learners`, as the trainer makes
  them), its meshes for a sampler group size (`builder.run_meshes`), and their programs.

  Programs of one sampler group compile for `group_devices(k)`: the devices of a slice of k
  hosts (default: the first k hosts of `devices`), whose ids the deviceless TPU compiler
  takes; the weight movement compiles over every device of `devices`."""

  def __init__(self, spec: PlanSpec, devices=None, group_devices=None):
    self.spec, self.run = spec, spec.run
    self.devices = list(jax.devices() if devices is None else devices)
    self.hosts = len({d.process_index for d in self.devices})
    self.group_devices = group_devices or self._first_hosts
    self.configured_hosts = (None if self.run.rollout.sampler_hosts == AUTO
                             else int(self.run.rollout.sampler_hosts))
    self.mesh = self.meshes(self.configured_hosts or 1).train
    self.learners = builder.learners(self.run, self._abstract_model, self.mesh, abstract=True)
    self.shape = step.StepShape(self._micro_batch(), spec.seq_len, spec.grad_accum,
                                spec.minibatches, spec.critic, spec.reference,
                                is_weights=self.run.rl.weights_policy_loss,
                                old_is_own=self.run.rl.first_update_takes_own_logprobs)

  def _first_hosts(self, hosts: int) -> list:
    first = sorted({d.process_index for d in self.devices})[:hosts]
    return [d for d in self.devices if d.process_index in first]

  def _abstract_model(self, model_cls, role: str, remat: str):
    del role  # every role's model has the policy's shape here
    spec = self.spec
    with partitioning.mesh_context(self.mesh):
      return nnx.eval_shape(lambda: model_cls(spec.model, dtype=jnp.dtype(spec.dtype),
                                              param_dtype=jnp.dtype(spec.param_dtype),
                                              remat=remat, attention=spec.attention,
                                              rngs=nnx.Rngs(0)))

  def _micro_batch(self) -> int:
    """The update's micro-batch rows as the trainer pads the step's batch (`StepConfig`)."""
    if self.spec.micro_batch:
      return self.spec.micro_batch
    optim = self.run.optim
    shards = math.prod(self.mesh.shape[a] for a in partitioning.mesh_axes("batch", self.mesh))
    split = optim.num_minibatches * optim.grad_accum
    multiple = shards * split
    return -(-self.spec.dialogues // multiple) * multiple // split

  def meshes(self, hosts_per_group: int, layout: str | None = None):
    """The run's meshes with sampler groups of `hosts_per_group` hosts in `layout`."""
    run = self.run
    if layout is not None:
      run = dataclasses.replace(run, rollout=dataclasses.replace(run.rollout,
                                                                 sampling_layout=layout))
    return builder.run_meshes(run, self.spec.model.num_kv_heads, hosts_per_group,
                              self.devices, process=0)

  def group_sizes(self) -> list[int]:
    """The sampler group sizes to compare: 1, 2 and 4 hosts where the slice splits into them
    (1 alone with an in-process simulator, which runs beside a one-host sampler), and the
    run's own."""
    if self.spec.simulator is not None:
      return [1]
    sizes = {k for k in (1, 2, 4) if k <= self.hosts and self.hosts % k == 0}
    return sorted(sizes | ({self.configured_hosts} if self.configured_hosts else set()))

  def resident(self) -> list:
    """What stays in memory through both phases: the learners' weights and optimizer
    states."""
    out = [(self.learners.policy.params, self.learners.policy.opt_state)]
    if self.learners.critic is not None:
      out.append((self.learners.critic.params, self.learners.critic.opt_state))
    if self.learners.reference is not None:
      out.append(self.learners.reference.params)
    return out

  def learner_programs(self) -> dict[str, Program]:
    """What the training step of these learners runs (`rl.step.AlgorithmStep.programs`)."""
    l = self.learners
    return step.AlgorithmStep(l.policy, l.critic, l.reference, self.run.rl,
                              step.StepConfig(temperature=self.spec.temperature)
                              ).programs(self.shape)

  def sampler_plan(self, hosts_per_group: int, layout: str, choice: str) -> SamplerPlan:
    """The programs of a sampler on groups of `hosts_per_group` hosts in `layout`: the weight
    movement over the whole slice (update phase), the row programs, the empty rows and the
    group's broadcasts on one group's chips (rollout phase)."""
    spec = self.spec
    meshes = self.meshes(hosts_per_group, layout)
    graphdef = self.learners.policy.graphdef
    params = _placed_on(self.learners.policy.params, meshes.train)
    dtype = jnp.dtype(spec.sampling_dtype) if spec.sampling_dtype else None
    copy = weight_copy.sampler_copy(graphdef, params, dtype, layout, meshes, None)
    listed, phases = {}, {}
    if copy is None:  # it decodes from the training weights where they lie
      group_mesh, weights, resident_copy = meshes.train, params, ()
      as_list, decode_graphdef = weight_copy.layers_as_list(layout, group_mesh), graphdef
    else:
      listed["sampler/copy_weights"] = copy.program(
          params, made=self.run.rollout.release_sampler_weights)
      phases["sampler/copy_weights"] = UPDATE
      group_mesh = partitioning.make_mesh(dict(meshes.sampler_mesh.shape),
                                          self.group_devices(hosts_per_group))
      weights = resident_copy = _placed_on(copy.abstract, group_mesh)
      as_list, decode_graphdef = copy.as_list, copy.graphdef
    shards = math.prod(group_mesh.shape[a] for a in partitioning.mesh_axes("batch", group_mesh))
    group_rows = -(-spec.dialogues // meshes.num_groups)
    rows = math.lcm(group_rows, shards)
    capacity = bucket_size(spec.cache_len, MIN_CACHE_BUCKET)
    cache_dtype = jnp.dtype(spec.dtype)
    calls = row_programs.row_program_set(rows, capacity, shards,
                                         prefill_chunk=spec.prefill_chunk)
    bounding = _row_programs_to_compile(calls, "bounding")
    for call in _row_programs_to_compile(calls, choice):
      program = row_programs.row_program(decode_graphdef, weights, spec.model, group_mesh, call,
                                         rows, cache_dtype, as_list, spec.sampling.static())
      # Which smaller shapes a rollout meets depends on its events: the estimate charges
      # every call to the bounding programs (an upper bound) and none to the others.
      listed[call.name] = dataclasses.replace(program, calls=_row_calls_per_step(
          call, spec, group_rows) if call in bounding else 0.0)
    listed[f"sampler/empty_rows[b={rows},c={capacity}]"] = row_programs.empty_rows_program(
        spec.model, group_mesh, rows, capacity, cache_dtype, as_list)
    if meshes.hosts_per_group > 1:  # the leader's announcements (`models/group_channel.py`)
      lengths = [group_channel.HEADER] + [row_sampler.payload_length(c) for c in calls]
      for words in group_channel.payload_lengths(lengths):
        message = jax.ShapeDtypeStruct((group_mesh.devices.size, words), jnp.int32,
                                       sharding=group_channel.rows_sharding(group_mesh))
        listed[f"sampler/group_broadcast[n={words}]"] = Program(
            group_channel.broadcast_program(group_mesh), (message,), group_mesh, calls=0.0,
            work=programs.GroupBroadcast())
    phases.update({name: ROLLOUT for name in listed if name not in phases})
    return SamplerPlan(listed, phases, len(calls), group_mesh, resident_copy)

  def simulator_programs(self) -> tuple[dict[str, Program], object]:
    """The in-process simulator's generate programs on a host's mesh (its bf16 weights placed
    like the policy's, `builder.simulated_user`), and those weights (resident)."""
    spec = self.spec
    local_mesh = partitioning.make_mesh(partitioning.per_group_axes(spec.mesh_axes, self.hosts),
                                        self.group_devices(1))
    with partitioning.mesh_context(local_mesh):
      model = nnx.eval_shape(lambda: qwen2.Qwen2(spec.simulator, dtype=jnp.bfloat16,
                                                 param_dtype=jnp.bfloat16, remat="none",
                                                 attention=spec.attention, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    weights = programs.abstract(state, partitioning.state_shardings(state, local_mesh))
    rows = min(spec.simulator_batch, -(-spec.dialogues // self.hosts))
    listed = batch_sampler.generate_programs(graphdef, weights, spec.simulator, local_mesh,
                                             rows, spec.simulator_prompt_tokens,
                                             spec.simulator_sampling, jnp.bfloat16)
    # Two calls (emotion analysis, then the reply) per user turn, for every dialogue.
    calls = 2 * spec.simulator_turns * -(-spec.dialogues // self.hosts // rows)
    return {f"sim_user/{name}[b={p.work.rows},t={p.work.tokens},c={p.work.capacity}]":
            dataclasses.replace(p, calls=calls) for name, p in listed.items()}, weights


def _row_calls_per_step(call, spec: PlanSpec, rows: int) -> float:
  """How often a step runs a bounding row program, for the estimate: every decode chunk of
  `dialogue_tokens` tokens, and the prefill of the rest of `seq_len` in full chunks."""
  if call.kind == "decode_rows":
    return spec.dialogue_tokens / row_programs.DECODE_CHUNK_STEPS * rows / call.width
  fed = max(spec.seq_len - spec.dialogue_tokens, 0)
  return fed / call.chunk * rows / call.width


class _Compiler:
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
  side by side (`group_devices(k)`: the devices of a k-host slice, `_Planner`); `chip` (a TPU
  or GPU generation) adds times and the step estimate. The verdict is against `memory_gib`
  (default: the chip's HBM): a peak fits when it is at most `memory_fraction` of it. The
  headline (`programs`, the peaks) is the run's group size, or with
  `rollout.sampler_hosts='auto'` the fewest hosts that fit (`recommended_hosts`)."""
  planner = _Planner(spec, devices, group_devices)
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
  compile_one = _Compiler(spec, chip, cost_args)
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
      comparison = _compare_layouts(planner, hosts_per_group, compile_one, compiled, phases,
                                    result["resident_gib"], fits)
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
    result["assumptions"] = _assumptions(chip)
    result["estimate"] = _step_estimate(spec, planner, result["programs"], chip)
  return result


def _sampler_results(sampler: SamplerPlan, hosts_per_group: int, layout: str,
                     compile_one: _Compiler) -> dict:
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


def _compare_layouts(planner: _Planner, hosts_per_group: int, compile_one: _Compiler,
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
                      "every fsdp shard), tensor (split by heads over a group's chips), or "
                      "auto: with --topology the fastest that fits, else train")
  flags.DEFINE_string("sampler_hosts", "auto", "hosts per sampler group "
                      "(rollout.sampler_hosts): 1, 2, 4, ... or auto, the fewest that fit; "
                      "1, 2 and 4 are planned side by side")
  flags.DEFINE_enum("row_programs", "bounding", list(ROW_PROGRAM_CHOICES), "compile every "
                    "row program a step can meet, or the largest of each kind")
  flags.DEFINE_float("device_memory_gib", None, "memory per device, for a verdict (default "
                     "with --topology: the generation's HBM)")
  flags.DEFINE_float("memory_fraction", USABLE_MEMORY_FRACTION, "the share of that memory a "
                     "plan may fill (the rest is the runtime's)")
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


def checked_run(config) -> sections.TrainRun:
  """A recipe's `TrainRun` (or a `TrainRun`) after its sections' checks, less those about
  inputs a plan does not read (the checkpoint, profiles and simulator a run needs: "... is
  not set")."""
  run = config if isinstance(config, sections.TrainRun) else sections.typed(
      sections.TrainRun, config)
  problems = [line for line in run.problems() if " is not set" not in line]
  if problems:
    raise UserInputError("training config cannot run: " + "; ".join(problems))
  return run


def spec_from_config(config, overrides: Overrides = Overrides()) -> PlanSpec:
  """A recipe as shipped (its checked `TrainRun`): its mesh, models, micro-batch as the
  trainer pads it, accumulation, sampler and sampling; `overrides` (--mesh, --batch,
  --seq_len and the like) still apply."""
  o = overrides
  run = checked_run(config)
  if o.mesh_axes():
    run = dataclasses.replace(run, mesh=sections.MeshConfig(**{
        **dataclasses.asdict(sections.MeshConfig()), **o.mesh_axes()}))
  if o.grad_accum:
    run = dataclasses.replace(run, optim=dataclasses.replace(run.optim, grad_accum=o.grad_accum))
  model, name = o.model_config("" if run.policy.tiny_init else run.policy.checkpoint)
  rollout = run.rollout
  return PlanSpec(
      run=run, model=model, model_name=name, micro_batch=o.batch or 0,
      dialogues=run.batch_size * rollout.samples_per_profile,
      seq_len=o.seq_len or bucket_size(rollout.max_dialogue_tokens),
      grad_accum=run.optim.grad_accum,
      minibatches=run.optim.ppo_epochs * run.optim.num_minibatches,
      # The rows' capacity as the engine sets it, less the opening feed (a bucket's slack).
      cache_len=o.cache_len or engine.row_capacity(rollout, 0),
      prefill_chunk=o.prefill_chunk or 0, dialogue_tokens=o.dialogue_tokens or 0,
      row_programs=o.row_programs, **_simulator_from_config(run.sim_user, o))


def run_from_settings(*, mesh_axes=None, critic: bool = True, reference: bool = False,
                      dtype: str = "bfloat16", param_dtype: str = "float32",
                      remat: str = "full", attention: str = "auto",
                      sampling_dtype: str = "bfloat16", sampler_hosts: str = "1",
                      grad_accum: int = 1) -> sections.TrainRun:
  """The PPO recipe's defaults (`sections.TrainRun`) with these settings: the run a plan
  from flags alone (no --config) plans. Without `critic` it is GRPO; with `reference` it has
  a KL penalty (its weight does not change the programs)."""
  d = sections.TrainRun()
  remat = qwen2.remat_policy_name(remat)
  return dataclasses.replace(
      d, mesh=sections.MeshConfig(**{**dataclasses.asdict(d.mesh), **(mesh_axes or {})}),
      policy=dataclasses.replace(d.policy, dtype=dtype, param_dtype=param_dtype,
                                 remat=remat != "none", attention=attention,
                                 remat_policy=d.policy.remat_policy if remat == "none"
                                 else remat),
      rl=dataclasses.replace(d.rl, algorithm="ppo" if critic else "grpo",
                             kl_coef=0.1 if reference else 0.0),
      rollout=dataclasses.replace(d.rollout, sampling_dtype=sampling_dtype,
                                  sampler_hosts=str(sampler_hosts)),
      optim=dataclasses.replace(d.optim, grad_accum=grad_accum))


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
  run = run_from_settings(
      mesh_axes=o.mesh_axes() or dict(partitioning.DEFAULT_MESH_AXES), critic=FLAGS.critic,
      reference=FLAGS.reference, dtype=FLAGS.dtype, param_dtype=FLAGS.param_dtype,
      remat=FLAGS.remat, attention=FLAGS.attention, sampling_dtype=FLAGS.sampling_dtype,
      sampler_hosts=FLAGS.sampler_hosts, grad_accum=o.grad_accum or 1)
  return PlanSpec(
      run=run, model=model, model_name=name, micro_batch=o.batch or 32,
      seq_len=o.seq_len or 8192, grad_accum=run.optim.grad_accum, sampler=FLAGS.sampler,
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
  devices = chip = group_devices = None
  if FLAGS.topology:
    if FLAGS.fake_devices:
      raise UserInputError("--topology and --fake_devices: choose one")
    accelerators = topology.parse_accelerator_type(FLAGS.topology)
    devices, chip = topology.slice_devices(accelerators), accelerators.generation
    group_devices = topology.group_devices(accelerators)
  if not 0 < FLAGS.memory_fraction <= 1:
    raise UserInputError(f"--memory_fraction={FLAGS.memory_fraction}: must be in (0, 1]")
  result = plan(spec, devices, chip, group_devices, memory_gib=FLAGS.device_memory_gib,
                memory_fraction=FLAGS.memory_fraction)
  if FLAGS.topology:
    result["topology"] = FLAGS.topology
  _print(result, spec)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)


def _print(result: dict, spec: PlanSpec) -> None:
  where = result.get("topology", result["platform"])
  print(f"{result['model']}: {result['parameters'] / 1e9:.2f}B parameters on {where} "
        f"({result['device_kind']}, {result['devices']} devices, {result['hosts']} host(s)), "
        f"mesh {result['mesh']}, micro-batch {result['micro_batch']} x {spec.seq_len} tokens "
        f"(x{spec.grad_accum} accumulated; {result['dialogues']} dialogues padded to "
        f"{result['padded_rows']} rows), {spec.dtype} compute / {spec.param_dtype} weights, "
        f"remat {spec.remat}, attention {spec.attention}")
  timed = "estimated_s" in next(iter(result["programs"].values()))
  print(f"{'per device, GiB':<44}{'phase':>8}{'args':>7}{'temps':>7}{'+resident':>10}"
        f"{'compile s':>10}" + (f"{'est. s':>9}{'x calls':>9}  bound" if timed else "") +
        "  kernels")
  for name, r in result["programs"].items():
    times = (f"{r['estimated_s']:>9.4f}{r['calls']:>9.1f}  {r['bound']:<7}" if timed else "")
    kernels = r.get("error") or ",".join(r["kernels"]) or "-"
    print(f"{name:<44}{r['phase']:>8}{r['argument_gib']:>7.2f}{r['temp_gib']:>7.2f}"
          f"{r['extra_gib']:>10.2f}{r['compile_s']:>10.1f}{times}  {kernels}")
  if "row_programs" in result:
    rows = result["row_programs"]
    print(f"row programs: {rows['compiled']} compiled of the {rows['possible']} shapes a step "
          f"can meet (--row_programs=all compiles every one)")
  copy = (f"; the sampler's {result['sampling_dtype']} copy ({result['sampling_layout']} "
          f"layout, mesh {result['sampler_mesh']}) {result['sampling_copy_gib']:.2f}" +
          (", dropped during the update" if result["release_sampler_weights"] else "")
          if result["sampling_copy_gib"] else "")
  print(f"resident          {result['resident_gib']:.2f} GiB per device (policy and critic "
        f"weights and optimizer states, reference{copy})")
  budget = result.get("budget_gib")
  verdict = lambda ok: "" if budget is None else (": fits" if ok else ": does NOT fit")
  for k, v in result["sampler_hosts"].items():
    mark = " <- planned" if k == result["hosts_per_group"] else ""
    print(f"sampler_hosts={k:<3} {v['groups']:>3} group(s) on mesh {v['sampler_mesh']}, copy "
          f"{v['copy_gib']:.2f} GiB; rollout peak {v['rollout_gib']:.2f}, update peak "
          f"{v['update_gib']:.2f} GiB{verdict(v['fits'])}{mark}")
  if result["sampler_hosts"]:
    print(f"sampler_hosts recommended: {result['recommended_hosts']} (the fewest that fit; "
          "--config.rollout.sampler_hosts=K or 'auto')")
  for layout, v in result.get("sampling_layouts", {}).items():
    if layout != "recommended":
      print(f"sampler layout {layout:<7} copy {v['copy_gib']:.2f} GiB, decode chunk "
            f"+{v['decode_extra_gib']:.2f} GiB, est. {v['decode_chunk_estimated_s']:.3f} s "
            f"({v['decode_bound']}-bound), peak {v['peak_gib']:.2f} GiB{verdict(v['fits'])}")
  if "sampling_layouts" in result:
    print(f"sampler layout recommended: {result['sampling_layouts']['recommended']}")
  print(f"estimated peak    rollout {result['rollout_peak_gib']:.2f}, update "
        f"{result['update_peak_gib']:.2f} GiB per device (resident plus the largest "
        f"'+resident' of the phase); compile {result['compile_s']:.1f} s in all")
  if "estimate" in result:
    e = result["estimate"]
    tokens = (f", decode {e['decode_tokens_per_s_per_chip']:.0f} tokens/s per chip"
              if "decode_tokens_per_s_per_chip" in e else "")
    print(f"estimated step    {e['step_s']:.1f} s (rollout {e['rollout_s']:.1f} s at "
          f"{e['dialogue_tokens']} policy tokens a dialogue, learner {e['learner_s']:.1f} s), "
          f"update MFU {e['update_mfu']:.0%}{tokens}: a roofline cost model "
          f"(rlver_jax/costs.py), not a measurement")
  if budget is not None:
    print(f"verdict: {'fits' if result['fits'] else 'does NOT fit'} in {budget:.4g} GiB per "
          f"device ({result['memory_fraction']:.0%} of {result['memory_gib']:g}; "
          f"sampler_hosts={result['hosts_per_group']})")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
