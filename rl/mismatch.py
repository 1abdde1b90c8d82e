"""The sampler-learner mismatch: how far the sampler's log-probs of the tokens it drew lie from
the learner's at the same weights.

The sampler decodes token by token from its own copy of the weights (bf16 in the recipes); the
learner scores whole sequences in its training pass. In exact arithmetic their log-probs agree
at the step's starting weights; in bf16 they do not, and the PPO ratio taken against the
sampler's log-probs (`rl.old_logprobs=sampler`, verl's bypass mode) then spends part of its
trust region on numerical noise before any update. These figures say how much, every step:
at step 1 (learning rate 0 during warm-up) they are the hardware's floor. With
`rollout.off_policy_steps=1` they also hold the one update the sampler's weights lag behind.

The peers log the same: verl's `training/rollout_probs_diff_*` and the probabilities' Pearson
correlation, Tunix's `sampler_trainer/logp_diff_*`.
"""

from __future__ import annotations

import numpy as np

from infra import host_metrics
from rl.losses import LOG_RATIO_LIMIT

PREFIX = "mismatch/"
# The share of tokens the PPO clip cut in a step's first update, at its starting weights: with
# rl.old_logprobs=sampler the mismatch's cost to the trust region, with learner exactly 0.
FIRST_UPDATE_CLIP_FRAC = PREFIX + "first_update_clip_frac"
# Every host computes them from the same global batch: any host's are the step's.
host_metrics.declare_family(PREFIX, host_metrics.MEAN)


def measure(sampler_logprobs_bt: np.ndarray, learner_logprobs_bt: np.ndarray,
            loss_mask_bt: np.ndarray, clip_low: float, clip_high: float) -> dict[str, float]:
  """The mismatch over the agent's tokens (`loss_mask_bt` 1), all [B, T - 1] arrays:

    mismatch/abs_logp_diff_mean, _p99, _max   |log p_learner - log p_sampler|
    mismatch/probs_pearson                     the Pearson correlation of the two probabilities
                                               (1.0 where both are constant and equal)
    mismatch/ratio_mean                        the mean PPO ratio p_learner / p_sampler
    mismatch/outside_clip                      the share of tokens whose ratio lies outside
                                               [1 - clip_low, 1 + clip_high]: clipped before
                                               any update
  """
  mask = np.asarray(loss_mask_bt) > 0
  if not mask.any():
    return {}
  sampler = np.asarray(sampler_logprobs_bt, np.float64)[mask]
  learner = np.asarray(learner_logprobs_bt, np.float64)[mask]
  diff = np.abs(learner - sampler)
  ratio = np.exp(learner - sampler)
  return {
      f"{PREFIX}abs_logp_diff_mean": float(diff.mean()),
      f"{PREFIX}abs_logp_diff_p99": float(np.quantile(diff, 0.99)),
      f"{PREFIX}abs_logp_diff_max": float(diff.max()),
      f"{PREFIX}probs_pearson": pearson(np.exp(sampler), np.exp(learner)),
      f"{PREFIX}ratio_mean": float(ratio.mean()),
      f"{PREFIX}outside_clip": float(np.mean((ratio < 1 - clip_low) | (ratio > 1 + clip_high))),
  }


def truncated_is_weights(sampler_logprobs_bt: np.ndarray, old_logprobs_bt: np.ndarray,
                         loss_mask_bt: np.ndarray, threshold: float
                         ) -> tuple[np.ndarray, dict[str, float]]:
  """`rl.rollout_correction=token_tis`: each token's weight min(p_old / p_sampler, threshold)
  ([B, T - 1] float32, 0 off the agent's tokens), as verl's token-level truncated IS and
  Tunix's sampler_is="token"; and its figures over the agent's tokens:

    mismatch/is_weight_mean   the weights' mean, as applied (truncated)
    mismatch/is_weight_max    the largest weight before the truncation
    mismatch/is_truncated     the share of tokens whose weight was truncated
  """
  mask = np.asarray(loss_mask_bt) > 0
  log_ratio = np.clip(np.asarray(old_logprobs_bt, np.float64) - sampler_logprobs_bt,
                      -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
  raw = np.exp(log_ratio)
  weights_bt = np.where(mask, np.minimum(raw, threshold), 0.0).astype(np.float32)
  if not mask.any():
    return weights_bt, {}
  return weights_bt, {f"{PREFIX}is_weight_mean": float(weights_bt[mask].mean()),
                      f"{PREFIX}is_weight_max": float(raw[mask].max()),
                      f"{PREFIX}is_truncated": float(np.mean(raw[mask] > threshold))}


def pearson(x: np.ndarray, y: np.ndarray) -> float:
  """Pearson's correlation of x and y; 1.0 where both are constant and equal, 0.0 where one
  alone is constant (nothing of it follows the other)."""
  dx, dy = x - x.mean(), y - y.mean()
  scale = np.sqrt((dx * dx).sum() * (dy * dy).sum())
  if scale == 0:
    return 1.0 if np.array_equal(x, y) else 0.0
  return float((dx * dy).sum() / scale)
