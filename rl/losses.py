"""PPO / GRPO losses over [B, T] token arrays (pure, jittable).

Every loss takes a 0/1 `mask` of the tokens it covers (the agent's own
tokens) and an aggregation mode:
  token-mean           sum(loss * mask) / sum(mask)
  seq-mean-token-sum   mean over sequences of sum(loss * mask)
  seq-mean-token-mean  mean over sequences of the per-sequence token mean
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

TOKEN_MEAN = "token-mean"
SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
AGGREGATIONS = (TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_MEAN)


def aggregate(loss_bt, mask_bt, mode: str = TOKEN_MEAN):
  mask_bt = mask_bt.astype(jnp.float32)
  if mode == TOKEN_MEAN:
    return jnp.sum(loss_bt * mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1.0)
  per_seq_b = jnp.sum(loss_bt * mask_bt, axis=1)
  if mode == SEQ_MEAN_TOKEN_MEAN:
    per_seq_b = per_seq_b / jnp.maximum(jnp.sum(mask_bt, axis=1), 1.0)
  elif mode != SEQ_MEAN_TOKEN_SUM:
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")
  has_tokens_b = (jnp.sum(mask_bt, axis=1) > 0).astype(jnp.float32)
  return jnp.sum(per_seq_b * has_tokens_b) / jnp.maximum(jnp.sum(has_tokens_b), 1.0)


def _masked_mean(x, mask):
  return aggregate(x, mask, TOKEN_MEAN)


def policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_ratio: float = 0.2,
                clip_ratio_high: float | None = None, dual_clip: float | None = None,
                agg: str = TOKEN_MEAN):
  """Clipped surrogate; with `dual_clip` = c > 1, negative-advantage losses are capped at c * |A|.

  Returns (loss, metrics) with clip_frac, the share of tokens whose ratio was
  clipped, and approx_kl = mean(old - new logprob).
  """
  high = clip_ratio if clip_ratio_high is None else clip_ratio_high
  log_ratio = logprobs - old_logprobs
  ratio = jnp.exp(log_ratio)
  unclipped = -advantages * ratio
  clipped = -advantages * jnp.clip(ratio, 1.0 - clip_ratio, 1.0 + high)
  loss_bt = jnp.maximum(unclipped, clipped)
  if dual_clip is not None:
    loss_bt = jnp.where(advantages < 0, jnp.minimum(loss_bt, -advantages * dual_clip), loss_bt)
  metrics = {
      "clip_frac": _masked_mean((clipped > unclipped).astype(jnp.float32), mask),
      "approx_kl": _masked_mean(-log_ratio, mask),
      "ratio_mean": _masked_mean(ratio, mask),
  }
  return aggregate(loss_bt, mask, agg), metrics


def value_loss(values, old_values, returns, mask, *, clip: float | None = 0.5,
               agg: str = TOKEN_MEAN):
  """0.5 * max((v - R)^2, (v_clipped - R)^2), v_clipped = old + clip(v - old, +-clip)."""
  unclipped = (values - returns) ** 2
  if clip is None:
    loss_bt = unclipped
    clip_frac = jnp.zeros(())
  else:
    clipped_values = old_values + jnp.clip(values - old_values, -clip, clip)
    clipped = (clipped_values - returns) ** 2
    loss_bt = jnp.maximum(unclipped, clipped)
    clip_frac = _masked_mean((clipped > unclipped).astype(jnp.float32), mask)
  return 0.5 * aggregate(loss_bt, mask, agg), {"value_clip_frac": clip_frac}


def entropy_from_logits(logits):
  """Entropy of softmax(logits) along the last axis, in fp32."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  probs = jax.nn.softmax(logits, axis=-1)
  return log_z - jnp.sum(probs * logits, axis=-1)


def kl_penalty(logprobs, ref_logprobs, estimator: str = "k3"):
  """Per-token KL(policy || reference) estimates from sampled-token logprobs.

  k1 = log p - log q; k2 = (log p - log q)^2 / 2; k3 = q/p - 1 - log(q/p)
  (unbiased, always >= 0; verl's "low_var_kl" also clips it to [-10, 10]).
  """
  log_ratio = logprobs - ref_logprobs
  if estimator == "k1":
    return log_ratio
  if estimator == "k2":
    return 0.5 * log_ratio ** 2
  if estimator == "k3":
    return jnp.clip(jnp.exp(-log_ratio) - 1.0 + log_ratio, -10.0, 10.0)
  raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def token_logprobs(logits_btv, tokens_bt, temperature: float = 1.0):
  """log softmax(logits / T) of the given tokens: [B, T, V], [B, T] -> [B, T]."""
  logprobs_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
  return jnp.take_along_axis(logprobs_btv, tokens_bt[..., None], axis=-1)[..., 0]
