"""A run's resolved config, saved as W/config.json, and the check that a resume uses the same.

Resuming a workdir with a different config (PPO resumed as GRPO, another
model, another learning rate) would silently mix two runs; it is refused with
the differing fields listed unless `--config.resume_mismatch_ok=True` says it
is intended. The fields in RESUMABLE_FIELDS may differ: they change how long,
where, how often or how robustly a run works, not what it learns or measures.
"""

from __future__ import annotations

import json
import os

import ml_collections
from absl import logging

from infra.errors import UserInputError
from rlver_jax import workdir as workdir_lib
from sim_user import redact

CONFIG_FILE = "config.json"
OVERRIDE_FLAG = "resume_mismatch_ok"
# Dotted field names; a name ending in "." covers its whole section.
RESUMABLE_FIELDS = (
    OVERRIDE_FLAG, "workdir", "compile_cache_dir", "steps", "log_every", "log_dialogues_every", "max_skipped_updates",
    "checkpoint.",
    "mesh.", "policy.remat",
    "sim_user.base_url", "sim_user.api_key_env", "sim_user.max_concurrency",
    "sim_user.timeout_s", "sim_user.http_retries", "sim_user.backoff_s",
    "sim_user.max_failed_share", "sim_user.max_failed_steps_in_a_row",
    "eval.limit", "eval.min_scored_share", "eval.batch_size",
)


def as_json(config) -> dict:
  """A ConfigDict as the nested dict its JSON file holds, with secrets redacted (`redacted`)."""
  return redacted(json.loads(config.to_json_best_effort()))


def redacted(tree: dict) -> dict:
  """`tree` as it may be printed or saved: credentials in URLs, keys and Bearer tokens in any
  text field, and a `*_env` field that names no variable (a key pasted there) replaced."""
  def clean(key: str, value):
    if isinstance(value, dict):
      return {k: clean(k, v) for k, v in value.items()}
    if isinstance(value, str):
      if key.endswith("_env") and value and not redact.is_env_var_name(value):
        return redact.REDACTED
      return redact.redact(value)
    return value
  return clean("", tree)


def printable(config) -> str:
  """The config as the start-up log shows it (YAML, as ml_collections prints it), redacted."""
  return str(ml_collections.ConfigDict(as_json(config)))


def flatten(tree: dict, prefix: str = "") -> dict:
  """{dotted field: value} of a nested dict."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


# Fields added after runs were saved without them, with the value that those runs had: a
# saved config that lacks one compares as if it held this value.
ADDED_FIELDS = {"rollout.off_policy_steps": 0}


def resumable(field: str) -> bool:
  return any(field == allowed or (allowed.endswith(".") and field.startswith(allowed))
             for allowed in RESUMABLE_FIELDS)


def differing_fields(saved: dict, current: dict) -> list[str]:
  """Fields outside RESUMABLE_FIELDS whose values differ (or exist on one side only)."""
  absent = object()
  saved = {**{k: v for k, v in ADDED_FIELDS.items() if k in current}, **saved}
  return [k for k in sorted(set(saved) | set(current))
          if not resumable(k) and saved.get(k, absent) != current.get(k, absent)]


def check_and_save(config, workdir: str, resuming: bool) -> None:
  """Refuses a resume whose config differs from W/config.json; then saves this one there."""
  path = os.path.join(workdir, CONFIG_FILE)
  tree = as_json(config)
  current = flatten(tree)
  if resuming and os.path.exists(path):
    with open(path) as f:
      saved = flatten(redacted(json.load(f)))  # as a run before redaction wrote it
    differing = differing_fields(saved, current)
    if differing:
      listing = "; ".join(f"{k}: {saved.get(k, '(absent)')!r} -> {current.get(k, '(absent)')!r}"
                          for k in differing)
      if not config.get(OVERRIDE_FLAG, False):
        raise UserInputError(
            f"{path}: this workdir holds a run with a different config ({listing}); use another "
            f"--config.workdir, or pass --config.{OVERRIDE_FLAG}=True to resume it anyway")
      logging.warning("resuming with a different config (%s=True): %s", OVERRIDE_FLAG, listing)
  import jax
  if jax.process_index() == 0:
    workdir_lib.write_text_atomically(path, json.dumps(tree, indent=2, sort_keys=True))
