"""Every shipped recipe runs as shipped, with only its sizes shrunk; bad settings fail at start-up.

Each config file in configs/ declares its variants (`VARIANTS`); RUNNERS maps
every (file, variant) to the test runner that runs it end to end: the
trainer for training recipes, the evaluators for evaluation recipes. A
config added later without a runner fails `test_every_shipped_recipe_has_a_runner`.

A runner keeps the recipe's settings (remat, dtypes, algorithm, rules, mesh
axes, simulator backend and retries) and changes only the fields in
SIZE_FIELDS: a tiny checkpoint and profile file, batch, tokens, steps (also the
tiny policy's warm-up steps), and the simulator's address (the local fake
OpenAI-compatible server, which fails every prompt twice, with a 500 and a
malformed answer, before it answers) and its first back-off delay.
"""

import importlib
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import eval as eval_config
from configs import grpo, ppo
from infra.errors import UserInputError
from models import partitioning, qwen2
from models import pretrained
from models.chat import ChatFormatter
from models.sampling import LENGTH, STOP, Completions, DecodeStats
from rl import learner as learner_lib
from rl import system_prompts, updates
from rl.batch import TrainBatch
from rl.losses import RLConfig
from rlver_jax import sections
from rlver_jax import eval as evaluator
from rlver_jax import metrics as metrics_lib
from rlver_jax import retention, tiny, trainer
from sim_user import profiles
from tests import ROOT, cli_run

CONFIGS = os.path.join(ROOT, "configs")
NOT_RECIPES = ("__init__.py",)
FAULTS = ["500", "malformed"]  # the fake server's answers to every prompt's first two attempts

# What a runner may change: sizes, inputs and where the simulator is.
SIZE_FIELDS = {
    "workdir", "steps", "batch_size", "policy.checkpoint", "data.train_profiles",
    "rollout.max_new_tokens", "rollout.max_dialogue_tokens", "eval.profiles", "eval.batch_size",
    "eval.max_new_tokens", "retention.data", "retention.max_new_tokens", "sim_user.base_url",
    "sim_user.backoff_s", "policy.tiny_warmup_steps",
}


def load_config(name: str, variant: str):
  module = importlib.import_module(f"configs.{name}")
  return module.get_config(variant) if variant else module.get_config()


def shrink(config, **sizes):
  """Sets `sizes` (dotted names written with "__") and nothing else."""
  for key, value in sizes.items():
    field = key.replace("__", ".")
    assert field in SIZE_FIELDS, f"{field} is a setting, not a size: recipes run as shipped"
    *parents, leaf = field.split(".")
    node = config
    for name in parents:
      node = node[name]
    node[leaf] = value
  return config


def write_profiles(path, cohort):
  path.write_text("".join(json.dumps({**p.__dict__, "cha_group": list(p.cha_group)}) + "\n"
                          for p in cohort))
  return str(path)


@pytest.fixture
def profile_file(tmp_path):
  """Two demo profiles; VARY makes the fake simulator's emotion changes differ by dialogue."""
  demo = profiles.load_profiles(profiles.DEMO_PROFILES)[:2]
  return write_profiles(tmp_path / "profiles.jsonl", [
      profiles.Profile(**{**p.__dict__, "player": p.player + " VARY"}) for p in demo])


def assert_faults_were_survived(server):
  assert server.attempts, "the simulator was never called"
  assert min(server.attempts.values()) == len(FAULTS) + 1  # each prompt: 2 faults, 1 answer


def run_training(config, tmp_path, checkpoint, profile_file, serve):
  server = serve(FAULTS) if config.sim_user.backend == "openai" else None
  sizes = dict(workdir=str(tmp_path / "run"), steps=2, batch_size=2,
               rollout__max_new_tokens=8, rollout__max_dialogue_tokens=24)
  if config.policy.tiny_init:
    sizes["policy__tiny_warmup_steps"] = min(config.policy.tiny_warmup_steps, 2)
  else:
    sizes["policy__checkpoint"] = checkpoint
  if not config.data.train_profiles:
    sizes["data__train_profiles"] = profile_file
  if server:
    sizes.update(sim_user__base_url=server.url, sim_user__backoff_s=0.01)
  shipped_prompt = config.rollout.system_prompt
  run = trainer.Trainer.from_config(shrink(config, **sizes))
  if shipped_prompt == system_prompts.RLVER:
    assert run.rollouts.rollout_cfg.system_prompt == system_prompts.policy_system_prompt(
        config.sim_user.language, config.rollout.thinking)
  else:
    assert run.rollouts.rollout_cfg.system_prompt == shipped_prompt
  run.run()

  # The recipes decode from the sampler's bf16 copy (the demo, fp32, from the training weights).
  sampler_weights = jax.tree.leaves(run.models.sampler.weights.state)
  assert {x.dtype for x in sampler_weights} == {
      jnp.dtype(config.rollout.sampling_dtype or config.policy.param_dtype)}
  if config.rollout.sampling_dtype and config.rollout.sampling_layout == "train":
    assert all(copy.sharding.is_equivalent_to(trained.sharding, trained.ndim) for copy, trained
               in zip(sampler_weights, jax.tree.leaves(run.models.policy.params), strict=True))
  records = metrics_lib.read_appended_jsonl(os.path.join(config.workdir, "metrics.jsonl"))
  assert [r["step"] for r in records] == [1, 2]
  for r in records:
    assert r["skipped_updates"] == 0, r  # the update is finite in the recipe's dtypes
    assert r["samples"] > 0 and r["dialogues/simulator_failed"] == 0
    for key in ("reward/mean", "pg_loss", "grad_norm", "entropy", "agent_turns/cut_off_rate"):
      assert np.isfinite(r[key]), key
    if config.rl.entropy_coef:  # else equal rewards (the demo's here) leave no gradient
      assert r["grad_norm"] > 0
    if config.rl.algorithm == "ppo":
      assert np.isfinite(r["value_loss"])
    if run.config.rl.learner_logprobs_pass:  # the sampler-learner mismatch, every step
      assert 0 <= r["mismatch/abs_logp_diff_mean"] <= r["mismatch/abs_logp_diff_max"], r
  # batch_size counts profiles; each is sampled samples_per_profile times.
  assert run.rollouts.position == 2 * config.batch_size
  assert records[0]["agent_turns/generated"] >= (config.batch_size *
                                                 config.rollout.samples_per_profile)
  assert os.path.exists(os.path.join(config.workdir, "export", "config.json"))
  if server:
    assert_faults_were_survived(server)


def run_sentient_eval(config, tmp_path, checkpoint, profile_file, serve):
  server = serve(FAULTS)
  summary = evaluator.evaluate(shrink(
      config, workdir=str(tmp_path / "eval"), policy__checkpoint=checkpoint,
      eval__profiles=profile_file, eval__batch_size=2, eval__max_new_tokens=8,
      sim_user__base_url=server.url, sim_user__backoff_s=0.01))
  assert summary["n"] == 2 and summary["n_failed"] == 0
  settings = summary["settings"]
  assert (settings["rules"], settings["thinking"], settings["dtype"]) == (
      "sage_benchmark", config.eval.thinking, "bfloat16")
  assert settings["system_prompt"] == system_prompts.policy_system_prompt(
      config.sim_user.language, config.eval.thinking)
  with open(os.path.join(config.workdir, "results.jsonl")) as f:
    replies = sum(m["role"] == "assistant" for line in f for m in json.loads(line)["history"])
  assert summary["agent_turns_generated"] == replies
  assert 0 <= summary["agent_turns_cut_off"] <= replies
  assert summary["cut_off_rate"] == pytest.approx(100 * summary["agent_turns_cut_off"] / replies)
  with open(os.path.join(config.workdir, "summary.json")) as f:
    assert json.load(f)["settings"]["system_prompt"] == settings["system_prompt"]
  assert_faults_were_survived(server)


def run_retention(config, tmp_path, checkpoint, profile_file, serve):
  del profile_file, serve  # retention has no simulated user
  data = tmp_path / "math.jsonl"
  data.write_text("".join(json.dumps(item) + "\n" for item in (
      {"question": "What is 2 + 3?", "answer": "5"},
      {"problem": "Half of 1?", "answer": "\\frac{1}{2}"})))
  summary = retention.evaluate(shrink(config, workdir=str(tmp_path / "retention"),
                                      policy__checkpoint=checkpoint, retention__data=str(data),
                                      retention__max_new_tokens=8))
  assert summary["n"] == 2


RUNNERS = {
    ("demo", ""): run_training,
    ("demo", "think"): run_training,
    ("demo", "challenging"): run_training,
    ("ppo", ""): run_training,
    ("ppo", "think"): run_training,
    ("grpo", ""): run_training,
    ("grpo", "think"): run_training,
    ("eval", ""): run_sentient_eval,
    ("eval", "think"): run_sentient_eval,
    ("retention", ""): run_retention,
}


def shipped_recipes() -> set[tuple[str, str]]:
  names = sorted(f[:-3] for f in os.listdir(CONFIGS) if f.endswith(".py") and f not in NOT_RECIPES)
  recipes = set()
  for name in names:
    module = importlib.import_module(f"configs.{name}")
    assert hasattr(module, "VARIANTS"), f"configs/{name}.py: declare VARIANTS (its :variants)"
    recipes.update((name, variant) for variant in module.VARIANTS)
  return recipes


def test_every_shipped_recipe_has_a_runner():
  assert shipped_recipes() == set(RUNNERS)
  for name, _ in RUNNERS:  # VARIANTS is complete: any other variant is refused
    with pytest.raises((ValueError, TypeError)):
      importlib.import_module(f"configs.{name}").get_config("no-such-variant")


@pytest.mark.heavy
@pytest.mark.parametrize("recipe", sorted(RUNNERS), ids=lambda r: f"{r[0]}.py:{r[1]}")
def test_recipe_runs_as_shipped(recipe, tmp_path, tiny_checkpoint, profile_file, serve):
  config = load_config(*recipe)
  RUNNERS[recipe](config, tmp_path, tiny_checkpoint, profile_file, serve)


TRAINING_RECIPES = sorted(r for r, runner in RUNNERS.items() if runner is run_training)


@pytest.mark.heavy
@pytest.mark.parametrize("recipe", TRAINING_RECIPES, ids=lambda r: f"{r[0]}.py:{r[1]}")
def test_a_recipe_runs_decoupled_with_its_rollout_correction(recipe, tmp_path, tiny_checkpoint,
                                                             profile_file, serve):
  """Every training recipe with the other choice of old log-probs (the learner's pass) and
  token_tis: PPO's mini-batches, GRPO's groups, thinking mode's updates of a step's dialogue
  count each, and the demo's fp32 policy, whose weights the sampler reads."""
  config = load_config(*recipe)
  config.rl.old_logprobs, config.rl.rollout_correction = "learner", "token_tis"
  run_training(config, tmp_path, tiny_checkpoint, profile_file, serve)
  for r in metrics_lib.read_appended_jsonl(os.path.join(config.workdir, "metrics.jsonl")):
    assert 0 < r["mismatch/is_weight_mean"] <= config.rl.rollout_is_threshold, r
    assert 0 <= r["mismatch/is_truncated"] <= 1
    assert r["mismatch/first_update_clip_frac"] == 0, r  # its own log-probs: ratio 1


def test_shipped_numbers():
  for variant in ppo.VARIANTS:
    p, g = ppo.get_config(variant), grpo.get_config(variant)
    # 32 profiles per step: PPO 32 x 1 = 32 dialogues, GRPO 32 x 4 = 128 (verl counts prompts).
    assert (p.batch_size, p.rollout.samples_per_profile) == (32, 1)
    assert (g.batch_size, g.rollout.samples_per_profile) == (32, 4)
    assert p.rl.dual_clip == g.rl.dual_clip == 3.0  # verl's clip_ratio_c
    assert p.rollout.system_prompt == g.rollout.system_prompt == system_prompts.RLVER
    assert (p.policy.remat, p.policy.dtype, p.policy.param_dtype) == (True, "bfloat16", "float32")
    assert (p.rollout.max_new_tokens, p.rollout.max_dialogue_tokens) == (5000, 10000)
    assert p.rollout.thinking == g.rollout.thinking == (variant == "think")
  plain, think = eval_config.get_config(), eval_config.get_config("think")
  assert think.eval.max_new_tokens == 5000  # a thinking policy gets its training budget
  assert plain.eval.system_prompt == think.eval.system_prompt == system_prompts.RLVER
  assert (plain.eval.thinking, think.eval.thinking) == (False, True)


@pytest.mark.heavy
def test_optimizer_state_is_sharded_like_the_params_on_the_shipped_mesh(tiny_checkpoint):
  """Found running the recipes: Adam's state sat on one device and step 2 recompiled."""
  mesh = partitioning.make_mesh(dict(ppo.get_config().mesh))  # fsdp over all 8 devices
  model = qwen2.from_pretrained(tiny_checkpoint, dtype="bfloat16", param_dtype="float32", mesh=mesh,
                                remat=True)
  learner = learner_lib.Learner(model, learner_lib.make_optimizer(learner_lib.OptimConfig(), 1e-6),
                                updates.policy_loss, RLConfig(), mesh)
  embed = learner.params["backbone"]["embed"].value
  assert not embed.sharding.is_fully_replicated
  moments = [x for x in jax.tree.leaves(learner.opt_state) if x.shape == embed.shape]
  assert moments and all(m.sharding.is_equivalent_to(embed.sharding, embed.ndim)
                         for m in moments)
  rows, width = 8, 32
  batch = TrainBatch(tokens_bt=np.ones((rows, width), np.int32),
                     attention_mask_bt=np.ones((rows, width), np.bool_),
                     loss_mask_bt=np.ones((rows, width - 1), np.float32),
                     old_logprobs_bt=np.zeros((rows, width - 1), np.float32),
                     advantages_bt=np.ones((rows, width - 1), np.float32))
  for _ in range(2):
    learner.update([batch], learning_rate=1e-3)
  assert learner.programs.update._cache_size() == 1  # the second update reuses the first's compile


# The policy's system prompts.


def test_rlver_prompts_exist_for_each_language_and_mode():
  for language in ("en", "zh"):
    plain = system_prompts.policy_system_prompt(language, thinking=False)
    thinking = system_prompts.policy_system_prompt(language, thinking=True)
    assert plain and "<think>" not in plain
    assert "<think>" in thinking and "</think>" in thinking
    sage = system_prompts.sage_system_prompt(language)
    assert sage not in (plain, thinking)
    assert system_prompts.resolve("rlver", language=language, thinking=True) == thinking
    assert system_prompts.resolve("sage", language=language, thinking=True) == sage
  assert system_prompts.resolve("Be kind.", language="zh", thinking=False) == "Be kind."
  chinese = system_prompts.policy_system_prompt("zh", thinking=False)
  assert all("\u4e00" <= ch <= "\u9fff" or not ch.isalpha() for ch in chinese)
  with pytest.raises(ValueError, match="fr"):
    system_prompts.policy_system_prompt("fr", thinking=False)


class CutOffBatch:
  """Stands in for the sampler's batch engine (the lockstep engine's calls): every reply is
  `reply_ids`; every third one runs out of budget."""

  def __init__(self, reply_ids, stop_id):
    self.reply_ids, self.stop_id = reply_ids, stop_id
    self.turns = self.cut_off = 0

  def start(self, num_rows, capacity=0):
    return None

  def extend(self, convs, new_tokens, params, key=None):
    return self._replies(len(new_tokens))

  def generate(self, prompts, params, key=None, row_ids=None):
    return self._replies(len(prompts))

  def _replies(self, rows):
    tokens, reasons = [], []
    for _ in range(rows):
      cut = self.turns % 3 == 0
      self.turns, self.cut_off = self.turns + 1, self.cut_off + cut
      tokens.append(self.reply_ids + ([] if cut else [self.stop_id]))
      reasons.append(LENGTH if cut else STOP)
    return Completions(tokens=tokens, logprobs=[[0.0] * len(t) for t in tokens],
                       stop_reasons=reasons)


def test_eval_reports_the_system_prompt_and_the_share_of_cut_off_turns(tmp_path, monkeypatch):
  tokenizer = tiny.load_tokenizer()
  batch = CutOffBatch(tokenizer.encode("<think>hm</think>I hear you."),
                      tokenizer.convert_tokens_to_ids("<|im_end|>"))
  # The rollout reads the sampler's batch engine and its weights' statistics.
  sampler = types.SimpleNamespace(batch=batch, weights=types.SimpleNamespace(stats=DecodeStats()))
  monkeypatch.setattr(pretrained, "load_policy", lambda *a, **k: pretrained.Policy(
      model=None, tokenizer=tokenizer, formatter=ChatFormatter(tokenizer),
      sampler=sampler))
  config = eval_config.get_config("think")
  config.workdir = str(tmp_path)
  config.policy.checkpoint = "unused"
  config.eval.profiles = profiles.DEMO_PROFILES
  config.mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  config.sim_user.backend = "scripted"
  config.sim_user.language = "en"
  config.eval.system_prompt = "sage"
  config.eval.engine = "lockstep"  # the stand-in sampler has no row API
  summary = evaluator.evaluate(config)
  assert summary["agent_turns_generated"] == batch.turns > 3
  assert summary["agent_turns_cut_off"] == batch.cut_off
  assert summary["cut_off_rate"] == pytest.approx(100 * batch.cut_off / batch.turns)
  with open(tmp_path / "summary.json") as f:
    settings = json.load(f)["settings"]
  assert settings["system_prompt"] == system_prompts.sage_system_prompt("en")
  assert settings["system_prompt_setting"] == "sage"


# Start-up checks.


def trainable_config(name="ppo", variant=""):
  """A recipe with its inputs named (paths need not exist: the checks run before any load)."""
  config = load_config(name, variant)
  config.workdir = "/tmp/never-created"
  config.policy.checkpoint = "/ckpt/qwen"
  config.data.train_profiles = "/data/profiles.jsonl"
  config.sim_user.base_url = "http://127.0.0.1:1/v1"
  return config


BAD_TRAINING_SETTINGS = [
    ("ppo", {"rollout.temperature": 0.0}, "rollout.temperature=0.0: must be > 0"),
    ("ppo", {"rollout.top_p": 1.5}, "rollout.top_p=1.5: must be in (0, 1]"),
    ("ppo", {"rollout.top_p": 0.0}, "rollout.top_p=0.0: must be in (0, 1]"),
    ("ppo", {"rollout.top_k": -1}, "rollout.top_k=-1: must be >= 0"),
    ("ppo", {"rollout.max_new_tokens": 0}, "rollout.max_new_tokens=0: must be >= 1"),
    ("ppo", {"steps": 0}, "steps=0: must be >= 1"),
    ("ppo", {"batch_size": 0}, "batch_size=0: profiles per step; must be >= 1"),
    ("ppo", {"rollout.samples_per_profile": 0}, "rollout.samples_per_profile=0: must be >= 1"),
    ("ppo", {"rl.algorithm": "reinforce"}, "rl.algorithm='reinforce': expected one of"),
    ("ppo", {"rollout.sampling_dtype": "bf16"},
     "rollout.sampling_dtype='bf16': the sampler's copy of the weights: expected one of"),
    ("ppo", {"rollout.sampling_layout": "tp"}, "rollout.sampling_layout='tp': expected one of"),
    ("grpo", {"rollout.samples_per_profile": 1}, "a group of one has advantage 0"),
    ("grpo", {"rl.reward": "turn"}, "rl.reward='turn': per-turn rewards are a PPO ablation"),
    ("ppo", {"rl.loss_agg": "sum"}, "rl.loss_agg='sum': expected one of"),
    ("ppo", {"rl.kl_estimator": "k4"}, "rl.kl_estimator='k4': expected one of"),
    ("ppo", {"rl.dual_clip": 1.0}, "rl.dual_clip=1.0: must be > 1"),
    ("ppo", {"rl.clip_ratio": 0.0}, "rl.clip_ratio=0.0: must be > 0"),
    ("ppo", {"rl.gamma": 1.5}, "rl.gamma=1.5: must be in [0, 1]"),
    ("ppo", {"optim.actor_lr": 0.0}, "optim.actor_lr=0.0: must be > 0"),
    ("ppo", {"optim.critic_lr": 0.0}, "optim.critic_lr=0.0: must be > 0"),
    ("ppo", {"optim.num_minibatches": 0}, "optim.num_minibatches=0: must be >= 1"),
    ("ppo", {"optim.schedule": "linear"}, "optim.schedule='linear': expected one of"),
    ("ppo", {"sim_user.backend": "anthropic"}, "sim_user.backend='anthropic': expected one of"),
    ("ppo", {"sim_user.language": "fr"}, "sim_user.language='fr': expected one of"),
    ("ppo", {"sim_user.rules": "strict"}, "sim_user.rules='strict': expected one of"),
    ("ppo", {"sim_user.on_failure": "ignore"}, "sim_user.on_failure='ignore': expected one of"),
    ("ppo", {"sim_user.base_url": ""}, "sim_user.base_url is not set"),
    ("ppo", {"workdir": ""}, "workdir is not set: give --config.workdir=DIR"),
    ("ppo", {"policy.checkpoint": ""}, "policy.checkpoint is not set: give "
     "--config.policy.checkpoint="),
    ("ppo", {"data.train_profiles": ""}, "data.train_profiles is not set"),
]


@pytest.mark.parametrize("name, overrides, message", BAD_TRAINING_SETTINGS,
                         ids=[next(iter(o)) + "-" + n for n, o, _ in BAD_TRAINING_SETTINGS])
def test_a_setting_that_cannot_train_fails_at_start_up(name, overrides, message):
  config = trainable_config(name)
  sections.train_run(config)  # the recipe itself is fine
  for field, value in overrides.items():
    *parents, leaf = field.split(".")
    node = config
    for part in parents:
      node = node[part]
    node[leaf] = value
  with pytest.raises(UserInputError) as raised:
    trainer.Trainer.from_config(config)
  assert message in str(raised.value)
  assert not os.path.exists(config.workdir)  # nothing was created or loaded


def test_every_bad_field_is_named_at_once():
  config = trainable_config("grpo", "think")
  config.rollout.temperature, config.steps = 0.0, 0
  with pytest.raises(UserInputError) as raised:
    sections.train_run(config)
  assert "rollout.temperature=0.0" in str(raised.value) and "steps=0" in str(raised.value)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -1.0, "eval.temperature=-1.0: must be >= 0"),
    ("top_p", 0.0, "eval.top_p=0.0: must be in (0, 1]"),
    ("batch_size", 0, "eval.batch_size=0: must be >= 1"),
    ("max_new_tokens", 0, "eval.max_new_tokens=0: must be >= 1"),
    ("profiles", "", "eval.profiles is not set"),
])
def test_an_evaluation_that_cannot_run_fails_at_start_up(field, value, message):
  config = eval_config.get_config()
  config.workdir, config.policy.checkpoint = "/tmp/never-created", "/ckpt/qwen"
  config.eval.profiles, config.sim_user.base_url = "/data/test.jsonl", "http://127.0.0.1:1/v1"
  sections.eval_run(config)  # greedy decoding (temperature 0) is fine
  config.eval[field] = value
  with pytest.raises(UserInputError, match=message.replace("(", r"\(").replace(")", r"\)")
                     .replace("[", r"\[")):
    evaluator.evaluate(config)


def test_the_cli_reports_a_bad_setting_in_one_line(tmp_path):
  result = cli_run.run_main(
      tmp_path, f"--config={CONFIGS}/ppo.py", "--config.policy.checkpoint=/ckpt/qwen",
      "--config.data.train_profiles=/data/p.jsonl", "--config.sim_user.base_url=http://x/v1",
      "--config.rollout.temperature=0")
  assert result.returncode != 0
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("error: training config cannot run: rollout.temperature=0.0: must be > 0")
  assert "Traceback" not in result.stderr
