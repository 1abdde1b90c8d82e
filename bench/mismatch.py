"""The sampler-learner mismatch at unmoved weights, and what each choice of old log-probs clips.

  python -m bench.mismatch [--layers=4] [--dtype=bfloat16] [--out=bench_results/mismatch.json]

The workload: a Qwen2.5-0.5B-shaped policy (hidden 896, 14 query / 2 KV heads, MLP 4864, the
151,936-token vocabulary; --layers of them) with random weights drawn wide
(--initializer_range), so that its next-token distributions are peaked as a trained model's
are; bf16 compute with a bf16 sampling copy, as the recipes run. The sampler draws --samples
replies of --reply_tokens tokens at temperature 1; one training step then runs on them at
learning rate 0 (every update at the weights that sampled, as step 1 of a warm-up), with the
recipes' PPO clip of 0.2, once for each `rl.old_logprobs`:
- `sampler` (verl's bypass mode): the ratio against the sampler's log-probs;
- `learner` (decoupled PPO, as the authors' release recomputes them): against the learner's
  own pass, which the step runs anyway while it measures the mismatch (`rl.log_mismatch`);
  the first update, at unmoved weights, against its own log-probs.
Written for each: the step's mismatch figures (|d log p| mean, p99, max; the probabilities'
Pearson correlation; the share of tokens outside the clip), the share of tokens the PPO clip
cut in its first update (first_update_clip_frac) and in both (clip_frac), before the weights
moved. Then, on the first update micro-batch, the gaps between the three log-probs the ratio
could use: the sampler's, the learner's forward-only pass, and the forward inside the update's
gradient program, which is the ratio's numerator (in bf16 XLA fuses and rounds the two passes
differently). The recipes' choice of old log-probs rests on these figures (configs/ppo.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from models import partitioning, qwen2
from models.sampler import Sampler
from models.sampling import SamplingParams
from rl import batch as batch_lib
from rl import forward, learner, step, updates
from rl.agent import Sample
from rl.losses import RLConfig

_LAYERS = flags.DEFINE_integer("layers", 4, "decoder layers of the Qwen2.5-0.5B shape")
_INIT = flags.DEFINE_float("initializer_range", 0.1,
                           "std of the random weights (wide: peaked next-token distributions)")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "compute and sampling dtype (float32: exact)")
_SAMPLES = flags.DEFINE_integer("samples", 8, "replies sampled")
_REPLY = flags.DEFINE_integer("reply_tokens", 64, "tokens a reply")
_OUT = flags.DEFINE_string("out", "bench_results/mismatch.json", "the results file")

QWEN25_05B = qwen2.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                               num_layers=24, num_heads=14, num_kv_heads=2,
                               tie_word_embeddings=True)
FIGURES = ("mismatch/abs_logp_diff_mean", "mismatch/abs_logp_diff_p99",
           "mismatch/abs_logp_diff_max", "mismatch/probs_pearson", "mismatch/outside_clip",
           "mismatch/ratio_mean", "mismatch/first_update_clip_frac", "clip_frac", "ratio_mean",
           "approx_kl")


def sampled(model, sampling_dtype, count: int, reply_tokens: int) -> list[Sample]:
  """`count` replies the sampler drew from `model`, with its log-probs, after 8-token prompts."""
  # No stop token (one past the vocabulary): every reply is reply_tokens long.
  sampler = Sampler(model, stop_token_ids=[model.config.vocab_size], sampling_dtype=sampling_dtype)
  prompts = [[1000 + 8 * i + j for j in range(8)] for i in range(count)]
  out = sampler.generate(prompts, SamplingParams(max_new_tokens=reply_tokens, temperature=1.0),
                         jax.random.key(0))
  return [Sample(tokens=prompt + list(tokens), loss_mask=[0] * len(prompt) + [1] * len(tokens),
                 logprobs=[0.0] * len(prompt) + list(logprobs), reward=float(i % 2),
                 group=i // 2, dialogue=i)
          for i, (prompt, tokens, logprobs) in enumerate(zip(prompts, out.tokens, out.logprobs))]


def policy_model(shape: qwen2.Qwen2Config, dtype: str):
  """The policy: the same random weights (seed 1) at every call; fp32 weights, `dtype` compute."""
  return qwen2.init_random(shape, seed=1, dtype=dtype, param_dtype="float32")


def step_at_unmoved_weights(model, samples: list[Sample], old_logprobs: str) -> dict:
  """One step's metrics at learning rate 0 (the learner takes `model`'s weights over)."""
  mesh = partitioning.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  cfg = RLConfig(algorithm="grpo", old_logprobs=old_logprobs, clip_ratio=0.2)
  optim = learner.OptimConfig(actor_lr=0.0, warmup_steps=0, num_minibatches=2)
  policy = learner.Learner(model, learner.make_optimizer(optim, 0.0), updates.policy_loss, cfg,
                           mesh)
  algorithm = step.AlgorithmStep(policy, None, None, cfg, step.StepConfig(optim=optim))
  return algorithm.run(1, samples)


def update_pass_gaps(shape, dtype: str, samples: list[Sample]) -> dict:
  """|d log p| (mean, p99, max) and the share of ratios outside [0.8, 1.2] between the three
  log-probs of the first update micro-batch's tokens: the sampler's decode, the learner's
  forward-only pass (`rl.old_logprobs=learner`'s), and the forward inside the gradient
  program (the update's own, which the PPO ratio's numerator is)."""
  graphdef, params = nnx.split(policy_model(shape, dtype))
  full = batch_lib.collate(samples, 2)
  rows = full.rows // 2  # the step's first mini-batch (num_minibatches=2, no accumulation)
  inputs = full.model_inputs().select_rows(0, rows)
  mask = np.asarray(full.loss_mask_bt[:rows]) > 0
  logprobs = lambda p, b: forward.sequence_logprobs(graphdef, p, b, 1.0)
  forward_only = np.asarray(jax.jit(logprobs)(params, inputs))

  def loss_and_logprobs(p, b):  # the gradient flows through these log-probs, as the update's do
    logprobs_bt = logprobs(p, b)
    return jnp.sum(logprobs_bt), logprobs_bt

  (_, in_update), _ = jax.jit(jax.value_and_grad(loss_and_logprobs, has_aux=True))(params, inputs)
  passes = {"sampler": np.asarray(full.old_logprobs_bt[:rows]), "learner": forward_only,
            "update": np.asarray(in_update)}

  def gap(a: str, b: str) -> dict:
    d = (passes[a] - passes[b])[mask]
    return {"abs_mean": float(np.abs(d).mean()), "abs_p99": float(np.quantile(np.abs(d), 0.99)),
            "abs_max": float(np.abs(d).max()),
            "outside_clip": float(np.mean((np.exp(d) > 1.2) | (np.exp(d) < 0.8)))}

  return {"update_vs_sampler": gap("update", "sampler"),
          "update_vs_learner": gap("update", "learner"),
          "learner_vs_sampler": gap("learner", "sampler")}


def main(argv):
  del argv
  shape = dataclasses.replace(QWEN25_05B, num_layers=_LAYERS.value,
                              initializer_range=_INIT.value)
  dtype = _DTYPE.value
  start = time.perf_counter()
  samples = sampled(policy_model(shape, dtype), None if dtype == "float32" else dtype,
                    _SAMPLES.value, _REPLY.value)
  logging.info("sampled %d replies in %.0f s", len(samples), time.perf_counter() - start)
  results = {"shape": dataclasses.asdict(shape), "dtype": dtype, "samples": len(samples),
             "reply_tokens": _REPLY.value, "clip_ratio": 0.2, "runs": {}}
  for old_logprobs in ("sampler", "learner"):
    metrics = step_at_unmoved_weights(policy_model(shape, dtype), samples, old_logprobs)
    results["runs"][old_logprobs] = {k: float(metrics[k]) for k in FIGURES}
    print(f"old_logprobs={old_logprobs}: " + ", ".join(
        f"{k.removeprefix('mismatch/')} {metrics[k]:.4g}" for k in FIGURES), flush=True)
  results["gaps"] = update_pass_gaps(shape, dtype, samples)
  for name, figures in results["gaps"].items():
    print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in figures.items()), flush=True)
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=2)
  print(f"written: {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
