"""In-process training runs of the demo config, shrunk for tests, and what they write."""

import json
import os

from configs import demo
from rlver_jax import metrics as metrics_lib
from sim_user import profiles as profiles_lib

# Saved only at the end: no checkpoint between steps.
NO_ROUTINE_SAVES = {"checkpoint.every": 0, "checkpoint.every_minutes": 0.0}


def small_demo(workdir, **overrides):
  """The demo config on one device, 3 steps of 4 profiles with 8-token replies, checkpointed
  every step, from a barely warmed-up policy; `overrides` maps dotted fields to values."""
  config = demo.get_config()
  config.workdir = str(workdir)
  config.steps = 3
  config.batch_size = 4
  config.rollout.max_new_tokens = 8
  config.policy.tiny_warmup_steps = 2  # the warm-up itself is tested in test_demo.py
  config.checkpoint.every = 1
  config.mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  for key, value in overrides.items():
    node = config
    *parents, leaf = key.split(".")
    for name in parents:
      node = node[name]
    node[leaf] = value
  return config


def read_metrics(workdir) -> list[dict]:
  """The records of a run's metrics.jsonl, one per finished step."""
  return metrics_lib.read_appended_jsonl(os.path.join(workdir, "metrics.jsonl"))


def profiles_file(path, suffix: str) -> str:
  """The demo profiles written to `path`, each persona ending in `suffix` (the fake server's
  fault switch)."""
  demo_profiles = profiles_lib.load_profiles(profiles_lib.DEMO_PROFILES)
  path.write_text("".join(json.dumps({**p.__dict__, "player": p.player + suffix,
                                      "cha_group": list(p.cha_group)}) + "\n"
                          for p in demo_profiles))
  return str(path)
