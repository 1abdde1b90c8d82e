"""The config command line: a mistaken override ends in one line that never repeats the value,
and `python -m rlver_jax.fields` lists every field of every shipped config with its meaning."""

import importlib
import os
import re

import pytest

from infra.errors import UserInputError
from rlver_jax import cli, fields
from tests.cli_run import last_line_only_error, run_module

PLANTED_SECRET = "sk-PLANTED123456"


def _shipped_configs() -> list[tuple[str, str]]:
  """(recipe, variant) for every config file in configs/ and every variant it ships."""
  shipped = []
  for name in sorted(os.listdir(cli.CONFIGS_DIR)):
    module = importlib.import_module(f"configs.{name[:-3]}") if name.endswith(".py") else None
    if hasattr(module, "get_config"):
      shipped += [(name[:-3], variant) for variant in module.VARIANTS]
  return shipped


def test_an_override_typo_ends_in_one_line_before_any_training(tmp_path):
  workdir = tmp_path / "run"
  result = run_module("rlver_jax.main", "--config.rl.kl_coeff=0.1",
                      f"--config.workdir={workdir}")
  assert result.returncode == 1
  assert result.stderr == (
      "error: no field rl.kl_coeff in configs/demo.py; did you mean rl.kl_coef?\n")
  assert not workdir.exists()


def test_a_key_typed_into_a_missing_field_is_not_echoed():
  result = run_module("rlver_jax.main", f"--config.sim_user.api_key={PLANTED_SECRET}")
  assert result.returncode == 1
  assert "PLANTED" not in result.stdout + result.stderr
  assert result.stderr.count("\n") == 1
  assert "did you mean sim_user.api_key_env? (it names the environment variable" in result.stderr


def test_a_bad_value_names_the_field_and_its_type_not_the_value():
  result = run_module("rlver_jax.main", "--config=configs/ppo.py",
                      f"--config.steps={PLANTED_SECRET}")
  assert result.returncode == 1
  assert result.stderr == "error: --config.steps must be of type int\n"


@pytest.mark.parametrize("module, config, valid", [
    ("rlver_jax.fields", "configs/ppo.py:bogus", "use '' or 'think'"),
    ("rlver_jax.main", "configs/demo.py:bogus", "use one of ('', 'think', 'challenging')"),
    ("rlver_jax.retention", "configs/retention.py:bogus", "this config has none: drop ':bogus'"),
])
def test_an_unknown_config_variant_is_one_line_naming_the_valid_ones(module, config, valid):
  result = run_module(module, f"--config={config}")
  assert result.returncode != 0
  assert last_line_only_error(result.stderr) == (
      f"error: --config={config}: unknown config variant 'bogus'; {valid}")


def test_a_field_with_no_close_name_points_to_the_listing():
  ppo = os.path.join(cli.CONFIGS_DIR, "ppo.py")
  with pytest.raises(UserInputError) as raised:
    cli.check_override_names(["prog", f"--config={ppo}:think", "--config.zzz.qqq=1"], "demo.py")
  assert str(raised.value) == (f"no field zzz.qqq in {ppo}:think; list its fields with "
                               f"python -m rlver_jax.fields --config={ppo}:think")


def test_training_help_names_the_listing():
  result = run_module("rlver_jax.main", "--help")  # absl's --help exits with status 1
  assert "python -m rlver_jax.fields" in result.stdout


@pytest.mark.parametrize("recipe, variant", _shipped_configs())
def test_every_field_of_a_shipped_config_has_a_meaning(recipe, variant):
  module = importlib.import_module(f"configs.{recipe}")
  config = module.get_config(variant) if variant else module.get_config()
  rows = fields.rows(config, os.path.join(cli.CONFIGS_DIR, f"{recipe}.py"))
  assert len(rows) > 10
  assert [field for field, _, meaning in rows if not meaning] == []


def test_the_listing_shows_each_field_with_its_value_and_meaning():
  result = run_module("rlver_jax.fields", "--config=configs/ppo.py", "--config.steps=7")
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert re.search(r"^rl\.kl_coef +0\.0 +# weight of the KL", result.stdout, re.MULTILINE)
  assert re.search(r"^steps +7 +# ", result.stdout, re.MULTILINE)  # the override's value
  sections = [line.split(".")[0] for line in lines if "." in line.split(" ")[0]]
  assert sections == sorted(sections, key=sections.index)  # each section's fields together
