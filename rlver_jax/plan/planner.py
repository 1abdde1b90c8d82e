"""A run's abstract learners and meshes as the trainer makes them, and the programs of its
step (`Planner`): the learners', the sampler's on groups of k hosts in a layout
(`SamplerPlan`), the in-process simulator's."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from infra import programs
from infra.programs import Program
from models import batch_sampler, group_channel, partitioning, qwen2, row_programs, row_sampler
from models import weight_copy
from models.sampling import MIN_CACHE_BUCKET, bucket_size
from rl import step
from rl.rollout_config import AUTO
from rlver_jax import builder
from rlver_jax.plan.spec import ROLLOUT, UPDATE, PlanSpec


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


class Planner:
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
