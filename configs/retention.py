"""Capability retention of a policy: math (exact answers) or instruction following.

  python -m rlver_jax.retention --config=configs/retention.py --config.policy.checkpoint=DIR \
      --config.retention.task=math --config.retention.data=math500.jsonl --config.workdir=W
"""

import ml_collections

from configs import common

VARIANTS = ("",)  # no variants: get_config takes no argument


def get_config() -> ml_collections.ConfigDict:
  c = common.inference_config()
  c.policy.param_dtype = ""  # weights in the compute dtype: no optimizer, half the memory

  c.retention = ml_collections.ConfigDict()
  c.retention.task = "math"  # math | ifeval
  c.retention.data = ""  # a local JSONL file
  c.retention.tfds_name = ""  # or a prepared TFDS dataset (no download)
  c.retention.tfds_data_dir = ""  # with tfds_name: the directory it was prepared in
  c.retention.split = "test"  # with tfds_name: the split to score
  c.retention.question_field = "question"  # with tfds_name: the feature holding the question
  c.retention.answer_field = "answer"  # with tfds_name: the feature holding the answer
  c.retention.limit = 0  # the first N items only (0: all)
  c.retention.batch_size = 16  # items answered side by side
  c.retention.max_new_tokens = 2048  # the policy's tokens per answer
  c.retention.temperature = 0.0  # 0: greedy
  c.retention.system_prompt = ""  # the policy's system prompt; empty: none
  c.retention.strip_thinking = True  # score thinking models on their answer only
  return c
