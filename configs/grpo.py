"""RLVER GRPO recipe for Qwen2.5-7B-Instruct: n = 4 samples per profile, no critic.

  python -m rlver_jax.main --config=configs/grpo.py --config.policy.checkpoint=... \
      --config.data.train_profiles=... --config.sim_user.base_url=... --config.workdir=...

`--config=configs/grpo.py:think` for the thinking variant. A step runs
batch_size = 32 profiles x 4 samples = 128 dialogues (verl's batch size counts prompts).
"""

from configs import ppo

VARIANTS = ppo.VARIANTS


def get_config(arg: str = ""):
  c = ppo.base_config(arg)
  c.rl.algorithm = "grpo"
  c.rollout.samples_per_profile = 4  # a group shares persona and opening line
  c.batch_size = 32  # profiles: 32 x 4 samples = 128 dialogues per step
  return ppo.planned_memory(c)
