"""Config sections shared by the training and evaluation recipes."""

import os

import ml_collections


def mesh_config() -> ml_collections.ConfigDict:
  # Axis sizes; -1 takes the remaining devices.
  return ml_collections.ConfigDict({
      "data": 1,  # splits the batch; each chip along it holds the whole weights
      "fsdp": -1,  # splits the batch and the weights (gathered layer by layer)
      "tensor": 1,  # splits attention heads, MLP columns and the vocabulary
  })


def policy_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.checkpoint = ""  # an HF Qwen2 directory
  c.tiny_init = False  # demo only: write and use a tiny checkpoint
  c.tiny_warmup_steps = 0  # with tiny_init: supervised steps on rlver_jax/assets/tiny_warmup.json
  c.tiny_warmup_helpfulness = 0.0  # in its warm-up chats, the share of replies that serve the need
  c.dtype = "bfloat16"  # compute dtype
  c.param_dtype = "float32"  # the weights' dtype; empty: the compute dtype
  c.remat = True  # recompute activations in the backward pass instead of storing them
  c.remat_policy = "full"  # with remat: full | save_dots | offload (TPU/GPU)
  c.attention = "auto"  # auto | einsum | blockwise | cudnn (GPU) | splash (TPU)
  return c


def sim_user_config(rules: str, on_failure: str = "") -> ml_collections.ConfigDict:
  """`on_failure` empty: "drop" under the training rules (a dialogue the simulator failed is
  left out of the batch, not trained on as reward 0), "end_failed" under the benchmark's (the
  evaluator lists it, unscored)."""
  c = ml_collections.ConfigDict()
  c.backend = "openai"  # openai (an HTTP server) | flax (in process) | scripted (rule-based)
  c.base_url = ""  # openai: the server's OpenAI-compatible URL, e.g. http://localhost:8000/v1
  c.model = "deepseek-v3"  # openai: the model name sent with each request
  c.api_key_env = "OPENAI_API_KEY"  # the environment variable that holds the key (not the key)
  c.max_concurrency = 32  # openai: requests in flight at once
  c.timeout_s = 120.0  # openai: seconds to wait for one answer
  c.http_retries = 4  # openai: retries of a failed request (no answer, 429, 5xx, bad body)
  c.backoff_s = 1.0  # first retry delay; doubles each retry, capped at 30 s
  c.temperature = 0.7  # the simulator's sampling temperature
  c.max_tokens = 1024  # the simulator's tokens per answer
  c.max_reply_chars = 20000  # openai: a longer reply is a fault (retried, then a failed dialogue)
  c.checkpoint = ""  # flax backend: the simulator's HF checkpoint
  c.rules = rules  # the emotion rules: rlver_train | sage_benchmark
  c.variant = "vanilla"  # the user's prompts: vanilla | challenging
  c.language = "zh"  # the simulator's language: zh | en (the released profiles are Chinese)
  c.templates = ""  # a directory of your own templates; empty: ours
  c.parse_retries = 2  # re-asks of a call whose answer failed or did not parse
  # A dialogue the simulator failed: drop (left out) | end_failed (ended, listed unscored).
  c.on_failure = on_failure or ("drop" if rules == "rlver_train" else "end_failed")
  c.max_agent_turns = 0  # 0: the rules' own (rlver_train: 9, last judged; sage: 10, last not)
  return c


def compile_cache_dir() -> str:
  """The default persistent compilation cache: per user, shared by the runs on one machine."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "rlver_jax", "xla")


def inference_config() -> ml_collections.ConfigDict:
  """The top of every evaluation config: where to write, which policy, which mesh."""
  c = ml_collections.ConfigDict()
  c.workdir = ""  # where the results are written (W)
  c.seed = 0  # random draws: the policy's sampling (none at temperature 0), a flax simulator's
  # Compiled programs are kept here for the next run (on a pod: a path every host reads); "": off.
  c.compile_cache_dir = compile_cache_dir()
  c.mesh = mesh_config()
  c.policy = policy_config()
  c.policy.remat = False  # no backward pass: nothing to recompute
  return c
