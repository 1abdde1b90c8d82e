"""Config sections shared by the training and evaluation recipes."""

import ml_collections


def mesh_config() -> ml_collections.ConfigDict:
  # Axis sizes; -1 takes the remaining devices.
  return ml_collections.ConfigDict({"data": 1, "fsdp": -1, "tensor": 1})


def policy_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.checkpoint = ""  # an HF Qwen2 directory
  c.tiny_init = False  # demo only: write and use a tiny checkpoint
  c.tiny_warmup_steps = 0  # with tiny_init: supervised steps on rlver_jax/assets/tiny_warmup.json
  c.tiny_warmup_helpfulness = 0.0  # in them, the share of replies that serve the user's need
  c.dtype = "bfloat16"  # compute dtype
  c.param_dtype = "float32"
  c.remat = True
  c.remat_policy = "full"  # with remat: full | save_dots | offload (TPU/GPU)
  c.attention = "auto"  # auto | einsum | blockwise | cudnn (GPU) | splash (TPU)
  return c


def sim_user_config(rules: str, on_failure: str = "") -> ml_collections.ConfigDict:
  """`on_failure` empty: "drop" under the training rules (a dialogue the simulator failed is
  left out of the batch, not trained on as reward 0), "end_failed" under the benchmark's (the
  evaluator lists it, unscored)."""
  c = ml_collections.ConfigDict()
  c.backend = "openai"  # openai | flax | scripted
  c.base_url = ""
  c.model = "deepseek-v3"
  c.api_key_env = "OPENAI_API_KEY"
  c.max_concurrency = 32
  c.timeout_s = 120.0
  c.http_retries = 4
  c.backoff_s = 1.0  # first retry delay; doubles each retry, capped at 30 s
  c.temperature = 0.7
  c.max_tokens = 1024
  c.max_reply_chars = 20000  # openai: a longer reply is a fault (retried, then a failed dialogue)
  c.checkpoint = ""  # flax backend: the simulator's HF checkpoint
  c.rules = rules  # rlver_train | sage_benchmark
  c.variant = "vanilla"  # vanilla | challenging
  c.language = "zh"  # the released profiles are Chinese
  c.templates = ""  # a directory of your own templates; empty: ours
  c.parse_retries = 2
  c.on_failure = on_failure or ("drop" if rules == "rlver_train" else "end_failed")
  c.max_agent_turns = 0  # 0: the rules' own (rlver_train: 9, last judged; sage: 10, last not)
  return c


def inference_config() -> ml_collections.ConfigDict:
  """The top of every evaluation config: where to write, which policy, which mesh."""
  c = ml_collections.ConfigDict()
  c.workdir = ""
  c.seed = 0
  c.mesh = mesh_config()
  c.policy = policy_config()
  c.policy.remat = False
  return c
