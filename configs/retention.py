"""Capability retention of a policy: math (exact answers) or instruction following.

  python -m rlver_jax.retention --config=configs/retention.py --config.policy.checkpoint=DIR \
      --config.retention.task=math --config.retention.data=math500.jsonl --config.workdir=W
"""

import ml_collections

from rlver_jax import sections

VARIANTS = ("",)  # no variants


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  """`rlver_jax/sections.py:RetentionRun`'s defaults."""
  if arg not in VARIANTS:
    raise ValueError(f"unknown config variant {arg!r}; this config has none: drop ':{arg}'")
  return sections.config_dict(sections.RetentionRun())
