"""The typed config sections: one home per knob (default, meaning, check), the configs built
from them, and the builder passing sections rather than copies of their fields."""

import dataclasses
import typing

import pytest

from configs import demo, eval as eval_config, grpo, ppo, retention
from infra.config_section import Section
from infra.errors import UserInputError
from rl.losses import RLConfig
from rl import system_prompts
from rl.rollout_config import RolloutConfig
from rlver_jax import builder, sections


def _all_sections(cls, seen=None):
  """`cls` and every section class it holds, however deep."""
  seen = set() if seen is None else seen
  seen.add(cls)
  for hint in typing.get_type_hints(cls).values():
    if isinstance(hint, type) and issubclass(hint, Section) and hint not in seen:
      _all_sections(hint, seen)
  return seen


@pytest.mark.parametrize("run", sections.RUNS, ids=lambda run: run.__name__)
def test_every_field_has_one_documented_meaning_and_every_entry_a_field(run):
  for cls in _all_sections(run):
    fields = {field.name for field in dataclasses.fields(cls)}
    meanings = sections.attribute_meanings(cls)
    assert sorted(fields - set(meanings)) == [], f"{cls.__name__}: fields without a meaning"
    assert sorted(set(meanings) - fields) == [], f"{cls.__name__}: entries of no field"
    assert all(len(meaning) > 8 for meaning in meanings.values())


@pytest.mark.parametrize("run", sections.RUNS, ids=lambda run: run.__name__)
def test_a_config_dict_of_the_defaults_reads_back_as_the_defaults(run):
  assert sections.typed(run, sections.config_dict(run())) == run()


def test_the_recipes_are_the_defaults_with_their_own_changes():
  # The PPO recipe's one change: sampler groups sized by the plan at start-up.
  defaults = sections.TrainRun()
  defaults = dataclasses.replace(defaults, rollout=dataclasses.replace(defaults.rollout,
                                                                       sampler_hosts="auto"))
  assert sections.typed(sections.TrainRun, ppo.base_config()) == defaults
  assert sections.typed(sections.TrainRun, ppo.base_config("think")) == dataclasses.replace(
      defaults, rollout=dataclasses.replace(defaults.rollout, thinking=True))
  grpo_run = sections.typed(sections.TrainRun, grpo.get_config())
  assert (grpo_run.rl.algorithm, grpo_run.rollout.samples_per_profile) == ("grpo", 4)
  assert sections.typed(sections.EvalRun, eval_config.get_config()) == sections.EvalRun()
  assert sections.typed(sections.RetentionRun, retention.get_config()) == sections.RetentionRun()
  assert sections.run_type(eval_config.get_config()) is sections.EvalRun
  assert sections.run_type(retention.get_config()) is sections.RetentionRun
  assert sections.run_type(demo.get_config()) is sections.TrainRun


def test_a_field_that_may_be_none_takes_an_override_of_its_type():
  config = ppo.get_config()
  assert config.rl.clip_ratio_high is None
  config.rl.clip_ratio_high = 0.28
  config.rl.dual_clip = None
  run = sections.typed(sections.TrainRun, config)
  assert (run.rl.clip_ratio_high, run.rl.dual_clip) == (0.28, None)
  with pytest.raises(TypeError):
    config.rl.clip_ratio_high = "high"


def test_a_field_no_section_defines_is_named():
  config = ppo.get_config()
  config.rl.kl_coeff = 0.1  # ml-collections lets a config grow; the typed run does not
  with pytest.raises(UserInputError, match=r"rl\.kl_coeff: no such field of the rl section "
                     r"\(RLConfig\)"):
    sections.typed(sections.TrainRun, config)


def test_a_check_names_the_field_with_its_section_and_each_knob_is_checked_once():
  run = dataclasses.replace(sections.TrainRun(), rl=RLConfig(dual_clip=1.0, gamma=2.0))
  problems = run.problems()
  assert [p for p in problems if p.startswith("rl.dual_clip=1.0: ")]
  assert [p for p in problems if p.startswith("rl.gamma=2.0: must be in [0, 1]")]
  assert sum("dual_clip" in p for p in problems) == 1
  RLConfig(dual_clip=1.0)  # a section is built first and checked as a whole, not on its own


def test_the_builder_passes_the_rollout_section_with_only_its_prompt_resolved():
  config = demo.get_config()
  run = sections.train_run(config)
  rollout = builder.train_rollout_config(run)
  assert isinstance(rollout, RolloutConfig)
  assert rollout == dataclasses.replace(run.rollout, system_prompt=rollout.system_prompt)
  assert rollout.system_prompt == "You are a caring listener."
  thinking = builder.train_rollout_config(sections.train_run(demo.get_config("think")))
  assert thinking.system_prompt not in ("", "rlver")  # the preset's text


def test_the_evaluation_decodes_as_its_section_one_dialogue_per_profile_without_a_budget():
  config = eval_config.get_config()
  config.eval.temperature, config.eval.top_k, config.eval.engine = 0.7, 5, "lockstep"
  run = sections.typed(sections.EvalRun, config)
  rollout = builder.eval_rollout_config(run)
  assert rollout == RolloutConfig(
      system_prompt=system_prompts.resolve("rlver", language=run.sim_user.language,
                                           thinking=False),
      max_new_tokens=1024, temperature=0.7, top_k=5, engine="lockstep", samples_per_profile=1,
      max_dialogue_tokens=10**9)
  # Greedy decoding scores the benchmark; a rollout's learner divides by its temperature.
  assert sections.EvalConfig(profiles="p.jsonl", temperature=0.0).problems() == []
  assert RolloutConfig(temperature=0.0).problems() == [
      "temperature=0.0: must be > 0: the learner scores tokens under softmax(logits / "
      "temperature)"]


def test_a_retention_run_names_every_missing_input_and_a_bad_task_at_once():
  config = retention.get_config()
  config.retention.task = "gsm8k"
  with pytest.raises(UserInputError) as raised:
    sections.retention_run(config)
  message = str(raised.value)
  for expected in ("workdir is not set", "policy.checkpoint is not set",
                   "retention.data is not set", "retention.task='gsm8k': expected one of "
                   "('math', 'ifeval')"):
    assert expected in message
  config.workdir, config.policy.checkpoint = "/tmp/w", "/ckpt"
  config.retention.task, config.retention.data = "math", "items.jsonl"
  assert sections.retention_run(config).retention.data == "items.jsonl"
