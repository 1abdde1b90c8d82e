"""The embedded default: a tiny random-init Qwen2 learns to comfort a scripted user, on CPU.

  python -m rlver_jax.main                      # this config
  python -m rlver_jax.main --config=configs/demo.py --config.steps=20 --config.workdir=/tmp/d

The policy is a 2-layer, 64-wide Qwen2 with the small tokenizer we ship,
written to W/init_policy on the first run and then loaded like any HF
checkpoint. The simulated user is the scripted (rule-based) one on our eight
English demo profiles with RLVER's training rules. The whole run takes a
few minutes on two CPU cores; watch W/reward_curve.png.
"""

from configs import ppo
from sim_user import profiles

VARIANTS = ppo.VARIANTS


def get_config(arg: str = ""):
  c = ppo.base_config(arg)
  c.workdir = "/tmp/rlver_demo"
  c.steps = 60
  c.batch_size = 16

  c.policy.tiny_init = True
  c.policy.dtype = "float32"
  c.policy.remat = False
  c.rollout.sampling_dtype = ""  # float32 throughout: the sampler reads the training weights

  c.data.train_profiles = profiles.DEMO_PROFILES
  c.sim_user.backend = "scripted"
  c.sim_user.language = "en"
  c.sim_user.rules = "rlver_train"

  # Short replies: a fitting one needs only a key word and one more word (sim_user/backends/
  # scripted.py), and the fewer tokens a reply has, the smaller the space the policy searches.
  c.rollout.max_new_tokens = 8
  c.rollout.max_dialogue_tokens = 400
  if not c.rollout.thinking:  # the demo's own prompt; :think keeps the "rlver" preset
    c.rollout.system_prompt = "You are a caring listener."

  c.optim.actor_lr = 1e-2
  c.optim.critic_lr = 1e-2
  c.optim.ppo_epochs = 2
  c.optim.warmup_steps = 2
  c.rl.entropy_coef = 0.01  # keeps sampling the words it has not yet tried
  c.rl.lam = 0.95  # a reply's advantage weighs the values of the turns just after it most
  c.rl.reward = "turn"  # each reply's own emotion change: which reply served the intention

  c.log_dialogues_every = 10
  c.checkpoint.every = 10
  c.checkpoint.keep = 2
  return c
