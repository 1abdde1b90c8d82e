"""What a plan plans: one step of a checked training run (`PlanSpec`), from a recipe
(`spec_from_config`, with the command line's `Overrides`) or from flags alone
(`spec_from_flags`, over `run_from_settings`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

from infra.errors import UserInputError
from models import partitioning, qwen2, row_programs
from models.sampling import SamplingParams, bucket_size
from rl import engine, step
from rlver_jax import sections, simulator_factory

ROW_PROGRAM_CHOICES = ("bounding", "all")
# The phases of a step; each program runs in one.
ROLLOUT, UPDATE = "rollout", "update"


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
