"""Capability retention of a policy: math (exact answers) or instruction following.

  python -m rlver_jax.retention --config=configs/retention.py --config.policy.checkpoint=DIR \
      --config.retention.task=math --config.retention.data=math500.jsonl --config.workdir=W
"""

import ml_collections

from rlver_jax import sections

VARIANTS = ("",)  # no variants: get_config takes no argument


def get_config() -> ml_collections.ConfigDict:
  """`rlver_jax/sections.py:RetentionRun`'s defaults."""
  return sections.config_dict(sections.RetentionRun())
