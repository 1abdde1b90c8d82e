"""The typed config of every run: its sections, their defaults, meanings and checks.

A run's config is a tree of typed sections (`infra/config_section.py`): the
room that uses a section defines it (`rl.losses.RLConfig`,
`rl.rollout_config.RolloutConfig`, `rl.learner.OptimConfig`,
`sim_user.config.SimUserConfig`), and this module defines the wiring's own (mesh,
policy, checkpoints, evaluation, retention) and assembles them into `TrainRun`, `EvalRun` and
`RetentionRun`, each a `RunBase` (workdir, seed, compilation cache, mesh). The files in `configs/` are ml-collections configs built from
these defaults (`config_dict`), overriding only what a recipe changes; an
entry point reads one back as its typed run (`train_run`, `eval_run`,
`retention_run`), which checks every section at start-up and names each field
that cannot work. `python -m rlver_jax.fields` lists the fields with the
meanings written here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing

import ml_collections

from infra.config_section import Problems, Section, at_least, positive, share
from infra.errors import UserInputError
from rl import system_prompts
from rl.learner import OptimConfig
from rl.losses import RLConfig
from rl.rollout_config import DecodingConfig, RolloutConfig
from sim_user.config import SimUserConfig

RETENTION_TASKS = ("math", "ifeval")  # rlver_jax/retention.py scores each


def default_compile_cache_dir() -> str:
  """The default persistent compilation cache: per user, shared by the runs on one machine."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "rlver_jax", "xla")


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
  """The `mesh` section: the device mesh's axis sizes; -1 takes the remaining devices.

  Attributes:
    data: splits the batch; each chip along it holds the whole weights.
    fsdp: splits the batch and the weights (gathered layer by layer).
    tensor: splits attention heads, MLP columns and the vocabulary.
  """
  data: int = 1
  fsdp: int = -1
  tensor: int = 1


@dataclasses.dataclass(frozen=True)
class PolicyConfig(Section):
  """The `policy` section: the model trained or evaluated, and how it computes.

  Attributes:
    checkpoint: an HF Qwen2 directory.
    tiny_init: demo only: write and use a tiny checkpoint.
    tiny_warmup_steps: with tiny_init: supervised steps on rlver_jax/assets/tiny_warmup.json.
    tiny_warmup_helpfulness: in its warm-up chats, the share of replies that serve the need.
    dtype: compute dtype.
    param_dtype: the weights' dtype; empty: the compute dtype.
    remat: recompute activations in the backward pass instead of storing them.
    remat_policy: with remat: full | save_dots | offload (TPU/GPU).
    attention: auto | einsum | blockwise | cudnn (GPU) | splash (TPU).
  """
  checkpoint: str = ""
  tiny_init: bool = False
  tiny_warmup_steps: int = 0
  tiny_warmup_helpfulness: float = 0.0
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: bool = True
  remat_policy: str = "full"
  attention: str = "auto"

  @property
  def remat_name(self) -> str:
    """The remat policy the learners' models run (`qwen2.REMAT_POLICIES`): "none" without
    remat."""
    return self.remat_policy if self.remat else "none"


@dataclasses.dataclass(frozen=True)
class CriticConfig(Section):
  """The `critic` section (PPO).

  Attributes:
    checkpoint: where the critic starts; default: the policy's checkpoint.
  """
  checkpoint: str = ""


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
  """The `data` section.

  Attributes:
    train_profiles: the training profiles, e.g. RLVER's train_profile.jsonl.
  """
  train_profiles: str = ""


@dataclasses.dataclass(frozen=True)
class TrainSimUserConfig(SimUserConfig):
  """The `sim_user` section of training: a step where more than `max_failed_share` of the
  dialogues failed in the simulator is not trained on, and `max_failed_steps_in_a_row`
  such steps stop the run.

  Attributes:
    max_failed_share: more of a step's dialogues failed: not trained on.
    max_failed_steps_in_a_row: steps in a row over max_failed_share that stop the run.
    min_trained_share: a run that trained on fewer of the steps it ran ends with an error
      (exit status 1) and exports nothing; its checkpoints stay.
  """
  max_failed_share: float = 0.5
  max_failed_steps_in_a_row: int = 3
  min_trained_share: float = 0.5

  def check(self, p: Problems) -> None:
    super().check(p)
    p.require("max_failed_share", share, "must be a share in [0, 1]")
    p.require("max_failed_steps_in_a_row", at_least(1), "must be >= 1")
    p.require("min_trained_share", share, "must be a share in [0, 1]")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Section):
  """The `checkpoint` section. Saving is asynchronous (the files are written while the next
  step runs). A 7B PPO state (policy, critic, Adam moments) is ~180 GB, so the recipes save
  by time; with every=1 a run killed mid-step redoes only that step.

  Attributes:
    every: steps between checkpoints (0: by time only).
    every_minutes: minutes between checkpoints (0: by steps only).
    keep: checkpoints kept (older ones are deleted).
    export_at_end: write the policy as an HF checkpoint to W/export at the end.
  """
  every: int = 0
  every_minutes: float = 10.0
  keep: int = 3
  export_at_end: bool = True

  def check(self, p: Problems) -> None:
    p.require("every", at_least(0), "steps between saves; must be >= 0 (0: off)")
    p.require("every_minutes", at_least(0.0), "minutes between saves; must be >= 0 (0: off)")
    p.require("keep", at_least(1), "must be >= 1")


def _check_system_prompt(p: Problems, field: str, setting: str, language: str) -> None:
  """A preset needs a language it is written in."""
  if setting in system_prompts.PRESETS and language not in system_prompts.LANGUAGES:
    p.add(f"sim_user.language={language!r}: {field}={setting!r} has no prompt in this "
          f"language; expected one of {system_prompts.LANGUAGES}")


@dataclasses.dataclass(frozen=True)
class RunBase(Section):
  """What every run has: where it writes, its seed, its compilation cache and its mesh.

  Attributes:
    workdir: where the run writes (W): training its checkpoints, metrics and dialogues,
      evaluation its records (both resume from them), retention its answers and scores.
    seed: every random draw: the policy's sampling (none at temperature 0), a flax
      simulator's, and in training the profile order and the tiny policy's initialisation.
    compile_cache_dir: compiled programs are kept here for the next run (on a pod: a path
      every host reads); "": off.
    mesh: the device mesh (evaluation and retention: each host runs its own share on its
      devices).
  """
  workdir: str = ""
  seed: int = 0
  compile_cache_dir: str = dataclasses.field(default_factory=default_compile_cache_dir)
  mesh: MeshConfig = MeshConfig()

  def check(self, p: Problems) -> None:
    p.given("workdir", "--config.workdir=DIR")


@dataclasses.dataclass(frozen=True)
class TrainRun(RunBase):
  """A training run (`python -m rlver_jax.main`): the PPO recipe's settings by default.

  `batch_size` counts profiles per step, as verl's batch size counts prompts: a
  step runs batch_size x rollout.samples_per_profile dialogues.

  Attributes:
    steps: training steps (each: rollout, then updates).
    batch_size: profiles per step; dialogues = batch_size x rollout.samples_per_profile.
    log_every: steps between progress lines in the log.
    log_dialogues_every: steps between whole dialogues in W/dialogues.jsonl (0: never).
    max_skipped_updates: non-finite steps tolerated before the run stops.
    resume_mismatch_ok: resume even though the config differs from W/config.json.
    policy: the policy trained.
    critic: PPO's value model.
    data: the training profiles.
    sim_user: the simulated user and its failure limits.
    rollout: how a step's dialogues are collected.
    rl: the algorithm and its losses.
    optim: the optimizers and the updates' schedule.
    checkpoint: when the run saves, and what it keeps.
  """
  steps: int = 1000
  batch_size: int = 32
  log_every: int = 1
  log_dialogues_every: int = 20
  max_skipped_updates: int = 10
  resume_mismatch_ok: bool = False
  policy: PolicyConfig = PolicyConfig()
  critic: CriticConfig = CriticConfig()
  data: DataConfig = DataConfig()
  sim_user: TrainSimUserConfig = TrainSimUserConfig()
  rollout: RolloutConfig = RolloutConfig()
  rl: RLConfig = RLConfig()
  optim: OptimConfig = OptimConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()

  def check(self, p: Problems) -> None:
    super().check(p)
    if self.policy.tiny_init and self.policy.checkpoint:
      p.add(f"policy.checkpoint={self.policy.checkpoint!r} with policy.tiny_init=True (the "
            "demo's own tiny policy): pass --config.policy.tiny_init=False to train that "
            "checkpoint")
    if not self.policy.tiny_init:
      p.nested(self.policy, "policy").given(
          "checkpoint", "--config.policy.checkpoint=/path/to/Qwen2.5-7B-Instruct (an HF "
          "directory with config.json, safetensors and tokenizer files)")
    p.nested(self.data, "data").given(
        "train_profiles", "--config.data.train_profiles=FILE.jsonl (RLVER's "
        "train_profile.jsonl, or sim_user/data/demo_profiles.jsonl)")
    p.require("steps", at_least(1), "must be >= 1")
    p.require("batch_size", at_least(1), "profiles per step; must be >= 1")
    p.require("max_skipped_updates", at_least(0), "must be >= 0")
    p.require("log_dialogues_every", at_least(0),
              "steps between logged dialogues; >= 0 (0: never)")
    if self.rl.algorithm == "grpo":
      p.nested(self.rollout, "rollout").require(
          "samples_per_profile", at_least(2),
          "GRPO compares the samples of one profile; a group of one has advantage 0")
    if self.rl.uses_critic:
      p.nested(self.optim, "optim").require("critic_lr", positive, "must be > 0")
    _check_system_prompt(p, "rollout.system_prompt", self.rollout.system_prompt,
                         self.sim_user.language)
    if self.rollout.groups_span_hosts:  # a group's followers mirror the row engine only
      rollout = p.nested(self.rollout, "rollout")
      rollout.require("engine", lambda v: v == "continuous",
                      f"rollout.sampler_hosts={self.rollout.sampler_hosts!r}: a sampler group "
                      "of several hosts runs the continuous engine only")
      if self.sim_user.backend == "flax":
        p.add(f"sim_user.backend='flax' with rollout.sampler_hosts="
              f"{self.rollout.sampler_hosts!r}: the in-process simulator runs on each host's "
              "own chips, beside a sampler of its own; give rollout.sampler_hosts='1' or a "
              "server-backed simulator")


@dataclasses.dataclass(frozen=True)
class EvalConfig(DecodingConfig):
  """The `eval` section: the Sentient Benchmark's dialogues and how the policy decodes them
  (the `DecodingConfig` fields, greedy by default).

  Attributes:
    profiles: the profiles: RLVER's test_profile.jsonl (100, with first_talk).
    baseline_checkpoint: another checkpoint (e.g. the untrained policy) evaluated the same way
      first, in W/baseline; its scores are printed beside the policy's. Empty: none.
    batch_size: dialogues run side by side.
    limit: the first N profiles only (0: all).
    min_scored_share: fewer profiles scored (the rest failed in the simulator): error.
    max_new_tokens: the policy's tokens per reply; thinking: the training budget.
    temperature: 0, greedy: the score does not depend on a seed.
  """
  profiles: str = ""
  baseline_checkpoint: str = ""
  batch_size: int = 16
  limit: int = 0
  min_scored_share: float = 0.9
  max_new_tokens: int = 1024
  temperature: float = 0.0

  def check(self, p: Problems) -> None:
    p.given("profiles", "--config.eval.profiles=FILE.jsonl (RLVER's test_profile.jsonl for "
            "the Sentient Benchmark)")
    p.require("batch_size", at_least(1), "must be >= 1")
    p.require("limit", at_least(0), "must be >= 0 (0: every profile)")
    p.require("min_scored_share", share, "must be a share in [0, 1]")
    super().check(p)


@dataclasses.dataclass(frozen=True)
class InferencePolicyConfig(PolicyConfig):
  """The `policy` section of evaluation: no backward pass, so nothing to recompute.

  Attributes:
    remat: no backward pass: nothing to recompute.
  """
  remat: bool = False


@dataclasses.dataclass(frozen=True)
class EvalRun(RunBase):
  """A Sentient Benchmark evaluation (`python -m rlver_jax.eval`), SAGE's rules.

  Attributes:
    resume_mismatch_ok: resume W/results.jsonl even though the config differs.
    policy: the policy evaluated.
    sim_user: the simulated user, under the benchmark's rules.
    eval: the benchmark's profiles and the policy's decoding.
  """
  resume_mismatch_ok: bool = False
  policy: InferencePolicyConfig = InferencePolicyConfig()
  sim_user: SimUserConfig = SimUserConfig(rules="sage_benchmark", on_failure="end_failed")
  eval: EvalConfig = EvalConfig()

  def check(self, p: Problems) -> None:
    super().check(p)
    p.nested(self.policy, "policy").given("checkpoint", "--config.policy.checkpoint=DIR")
    _check_system_prompt(p, "eval.system_prompt", self.eval.system_prompt,
                         self.sim_user.language)


@dataclasses.dataclass(frozen=True)
class RetentionConfig(Section):
  """The `retention` section: which capability is scored, on what, and how the policy answers.

  Attributes:
    task: math | ifeval.
    data: a local JSONL file.
    tfds_name: or a prepared TFDS dataset (no download).
    tfds_data_dir: with tfds_name: the directory it was prepared in.
    split: with tfds_name: the split to score.
    question_field: with tfds_name: the feature holding the question.
    answer_field: with tfds_name: the feature holding the answer.
    limit: the first N items only (0: all).
    batch_size: items answered side by side.
    max_new_tokens: the policy's tokens per answer.
    temperature: 0: greedy.
    system_prompt: the policy's system prompt; empty: none.
    strip_thinking: score thinking models on their answer only.
  """
  task: str = "math"
  data: str = ""
  tfds_name: str = ""
  tfds_data_dir: str = ""
  split: str = "test"
  question_field: str = "question"
  answer_field: str = "answer"
  limit: int = 0
  batch_size: int = 16
  max_new_tokens: int = 2048
  temperature: float = 0.0
  system_prompt: str = ""
  strip_thinking: bool = True

  def check(self, p: Problems) -> None:
    p.one_of("task", RETENTION_TASKS)
    if not (self.data or self.tfds_name):
      p.add(f"{p.prefix}data is not set: give --config.retention.data=FILE.jsonl or "
            "--config.retention.tfds_name=NAME with --config.retention.tfds_data_dir")
    p.require("limit", at_least(0), "must be >= 0 (0: every item)")
    p.require("batch_size", at_least(1), "must be >= 1")
    p.require("max_new_tokens", at_least(1), "must be >= 1")
    p.require("temperature", at_least(0.0), "must be >= 0 (0 is greedy)")


@dataclasses.dataclass(frozen=True)
class RetentionPolicyConfig(InferencePolicyConfig):
  """The `policy` section of retention: no optimizer, so the weights in the compute dtype.

  Attributes:
    param_dtype: weights in the compute dtype: no optimizer, half the memory.
  """
  param_dtype: str = ""


@dataclasses.dataclass(frozen=True)
class RetentionRun(RunBase):
  """A capability-retention run (`python -m rlver_jax.retention`): math or instruction
  following.

  Attributes:
    policy: the policy scored.
    retention: the task, its data and the policy's decoding.
  """
  policy: RetentionPolicyConfig = RetentionPolicyConfig()
  retention: RetentionConfig = RetentionConfig()

  def check(self, p: Problems) -> None:
    super().check(p)
    p.nested(self.policy, "policy").given("checkpoint", "--config.policy.checkpoint=DIR")


# ml-collections configs from the typed defaults, and back.

def config_dict(section: Section) -> ml_collections.ConfigDict:
  """`section` as an ml-collections config (sub-sections nested): what `configs/*.py` start
  from. A field that may be None is a typed placeholder, so `--config.rl.dual_clip=2.0`
  overrides it as a float."""
  config = ml_collections.ConfigDict()
  hints = typing.get_type_hints(type(section))
  for field in dataclasses.fields(section):
    value = getattr(section, field.name)
    if isinstance(value, Section):
      config[field.name] = config_dict(value)
    elif _optional_type(hints[field.name]) is not None:
      config[field.name] = ml_collections.FieldReference(
          value, field_type=_optional_type(hints[field.name]))
    else:
      config[field.name] = value
  return config


def _optional_type(hint) -> type | None:
  """X for a hint `X | None`, else None."""
  args = typing.get_args(hint)
  if isinstance(hint, types.UnionType) and len(args) == 2 and type(None) in args:
    return next(arg for arg in args if arg is not type(None))
  return None


def typed(cls: type[Section], config, prefix: str = "") -> Section:
  """The `cls` section that `config` (an ml-collections config or a dict) holds; a field the
  section does not define is a UserInputError naming it."""
  hints = typing.get_type_hints(cls)
  known = {field.name for field in dataclasses.fields(cls)}
  unknown = sorted(set(config.keys()) - known)
  if unknown:
    raise UserInputError(f"{', '.join(prefix + name for name in unknown)}: no such field of "
                         f"the {prefix.rstrip('.') or 'top'} section ({cls.__name__}); "
                         "`python -m rlver_jax.fields` lists them")
  values = {}
  for name in known & set(config.keys()):
    hint = hints[name]
    if isinstance(hint, type) and issubclass(hint, Section):
      values[name] = typed(hint, config[name], f"{prefix}{name}.")
    else:
      values[name] = config[name]
  return cls(**values)


def checked(cls: type[Section], config, what: str) -> Section:
  """`typed(cls, config)` after every section's checks: a UserInputError lists each field
  that cannot work (a run that would divide logits by a zero temperature otherwise skips
  every update, hours in)."""
  run = typed(cls, config)
  problems = run.problems()
  if problems:
    raise UserInputError(f"{what} config cannot run: " + "; ".join(problems))
  return run


def train_run(config) -> TrainRun:
  return checked(TrainRun, config, "training")


def eval_run(config) -> EvalRun:
  return checked(EvalRun, config, "evaluation")


def retention_run(config) -> RetentionRun:
  return checked(RetentionRun, config, "retention")


RUNS = (TrainRun, EvalRun, RetentionRun)


def run_type(config) -> type[Section]:
  """The run type whose sections `config` has (eval and retention have their own)."""
  for cls in (EvalRun, RetentionRun):
    own = {field.name for field in dataclasses.fields(cls)} - {
        field.name for field in dataclasses.fields(TrainRun)}
    if own & set(config.keys()):
      return cls
  return TrainRun


# The meanings: each class's "Attributes:" docstring entries.

_ENTRY = re.compile(r"^(\s+)(\w+): (.*)$")


def attribute_meanings(cls: type) -> dict[str, str]:
  """Field -> meaning, from the `Attributes:` docstrings of `cls` and its bases (a subclass's
  entry wins, as its default does)."""
  meanings: dict[str, str] = {}
  for klass in reversed(cls.__mro__):
    meanings.update(_docstring_attributes(klass.__dict__.get("__doc__") or ""))
  return meanings


def _docstring_attributes(doc: str) -> dict[str, str]:
  entries: dict[str, str] = {}
  lines = doc.expandtabs().splitlines()
  if not any(line.strip() == "Attributes:" for line in lines):
    return entries
  start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:") + 1
  entry_indent, current = None, None
  for line in lines[start:]:
    if not line.strip():
      break
    match = _ENTRY.match(line)
    if match and (entry_indent is None or len(match.group(1)) == entry_indent):
      entry_indent, current = len(match.group(1)), match.group(2)
      entries[current] = match.group(3).strip()
    elif current is not None and len(line) - len(line.lstrip()) > entry_indent:
      entries[current] += " " + line.strip()
    else:
      break
  return entries


def field_meanings(cls: type[Section], prefix: str = "") -> dict[str, str]:
  """Dotted field -> meaning for every field of the run type `cls`, in definition order."""
  meanings = attribute_meanings(cls)
  hints = typing.get_type_hints(cls)
  out: dict[str, str] = {}
  for field in dataclasses.fields(cls):
    hint = hints[field.name]
    if isinstance(hint, type) and issubclass(hint, Section):
      out.update(field_meanings(hint, f"{prefix}{field.name}."))
    else:
      out[prefix + field.name] = meanings.get(field.name, "")
  return out

