"""Advantage estimators (pure, jittable) and the host-side step that applies them to a batch:
a registry of verl's names (gae, grpo), each a function of the batch and the `rl` section."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from infra.registry import Registry
from rl import losses
from rl.batch import TrainBatch


def gae_advantages(rewards, values, mask, gamma: float = 1.0, lam: float = 1.0):
  """Generalised advantage estimation over [B, T] token arrays.

  As in verl's multi-turn GAE, the recursion runs over the masked (agent)
  tokens only: at a position with mask 0 (a user turn, a role header) the
  next value and the running advantage are carried through unchanged, so
  the last agent token of one turn bootstraps from the first agent token of
  the next. Returns (advantages, returns), both zero where mask is 0; not
  whitened (see `masked_whiten`).
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  values = jnp.asarray(values, jnp.float32)
  mask = jnp.asarray(mask, jnp.float32)

  def step(carry, xs):
    next_value_b, last_gae_b = carry
    reward_b, value_b, mask_b = xs
    delta_b = reward_b + gamma * next_value_b - value_b
    gae_b = delta_b + gamma * lam * last_gae_b
    next_value_b = value_b * mask_b + (1 - mask_b) * next_value_b
    last_gae_b = gae_b * mask_b + (1 - mask_b) * last_gae_b
    return (next_value_b, last_gae_b), last_gae_b

  zeros_b = jnp.zeros(rewards.shape[0], jnp.float32)
  xs = (rewards.T[::-1], values.T[::-1], mask.T[::-1])
  _, advantages_tb = jax.lax.scan(step, (zeros_b, zeros_b), xs)
  advantages = advantages_tb[::-1].T * mask
  returns = (advantages + values) * mask
  return advantages, returns


def reply_gae_advantages(rewards, values, mask, gamma: float = 1.0, lam: float = 1.0):
  """GAE over [B, T] token arrays with each reply (a run of mask-1 tokens) one step.

  A reply's reward is its tokens' rewards summed, its value the critic's at its
  first token; `gae_advantages` runs over the replies of each row, and every
  token of a reply takes the reply's advantage and return. With replies of one
  token each this is `gae_advantages`. Returns (advantages, returns), zero where
  mask is 0; not whitened.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  values = jnp.asarray(values, jnp.float32)
  mask = jnp.asarray(mask, bool)
  batch, width = mask.shape
  starts_bt = mask & ~jnp.pad(mask[:, :-1], ((0, 0), (1, 0)))
  reply_bt = jnp.cumsum(starts_bt, axis=1) - 1  # the reply a token belongs to, where mask
  rows_b1 = jnp.arange(batch)[:, None]
  # Index `width` is past the end: those writes are dropped.
  zeros_bn = jnp.zeros((batch, width), jnp.float32)
  rewards_bn = zeros_bn.at[rows_b1, jnp.where(mask, reply_bt, width)].add(rewards, mode="drop")
  values_bn = zeros_bn.at[rows_b1, jnp.where(starts_bt, reply_bt, width)].set(values,
                                                                              mode="drop")
  replies_bn = jnp.arange(width)[None, :] < jnp.sum(starts_bt, axis=1, keepdims=True)
  advantages_bn, returns_bn = gae_advantages(rewards_bn, values_bn, replies_bn, gamma, lam)
  reply_bt = jnp.maximum(reply_bt, 0)
  advantages = jnp.take_along_axis(advantages_bn, reply_bt, axis=1) * mask
  returns = jnp.take_along_axis(returns_bn, reply_bt, axis=1) * mask
  return advantages, returns


GAE_BY_UNIT = {"token": gae_advantages, "reply": reply_gae_advantages}


def masked_mean(x, mask, axis=None):
  mask = jnp.asarray(mask, jnp.float32)
  return jnp.sum(x * mask, axis=axis) / jnp.maximum(jnp.sum(mask, axis=axis), 1.0)


def masked_whiten(x, mask, eps: float = 1e-8):
  """(x - mean) / std over the masked entries (unbiased variance, as verl); 0 elsewhere."""
  mask = jnp.asarray(mask, jnp.float32)
  mean = masked_mean(x, mask)
  count = jnp.sum(mask)
  variance = jnp.sum(((x - mean) ** 2) * mask) / jnp.maximum(count - 1.0, 1.0)
  return (x - mean) * jax.lax.rsqrt(variance + eps) * mask


def grpo_advantages(scores, group_ids, normalize_std: bool = True, eps: float = 1e-6):
  """Group-normalised advantages: (score - group mean) / (group std + eps).

  `group_ids` may be any integers; samples with equal ids form a group. The
  std is unbiased (ddof 1). A group of one gets mean 0 and std 1, as in verl,
  so its advantage is its score.
  """
  scores = jnp.asarray(scores, jnp.float32)
  group_ids = jnp.asarray(group_ids)
  same_nn = (group_ids[:, None] == group_ids[None, :]).astype(jnp.float32)
  count_n = jnp.sum(same_nn, axis=1)
  mean_n = same_nn @ scores / count_n
  squared_nn = (scores[None, :] - mean_n[:, None]) ** 2 * same_nn
  std_n = jnp.sqrt(jnp.sum(squared_nn, axis=1) / jnp.maximum(count_n - 1.0, 1.0))
  single = count_n == 1
  mean_n = jnp.where(single, 0.0, mean_n)
  std_n = jnp.where(single, 1.0, std_n)
  centred = scores - mean_n
  return centred / (std_n + eps) if normalize_std else centred



# An estimator: (batch, rl config) -> the batch with `advantages_bt` and `returns_bt` (host
# numpy in, numpy out). verl's names and registry (`core_algos.register_adv_est`).
AdvantageEstimator = Callable[[TrainBatch, losses.RLConfig], TrainBatch]
ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")
register_adv_est = ADV_ESTIMATORS.register
get_adv_estimator_fn = ADV_ESTIMATORS.lookup


@register_adv_est("gae")
def gae_batch(batch: TrainBatch, cfg: losses.RLConfig) -> TrainBatch:
  """PPO's: GAE over the critic's `old_values_bt` (by token or by reply, `cfg.gae_unit`),
  whitened over the batch's tokens. With a
  KL penalty in the reward it reads `ref_logprobs_bt`, and the penalised rewards replace
  `token_rewards_bt`."""
  mask = jnp.asarray(batch.loss_mask_bt)
  rewards = jnp.asarray(batch.token_rewards_bt)
  if cfg.kl_coef and cfg.kl_in_reward:
    kl = losses.kl_penalty(jnp.asarray(batch.old_logprobs_bt),
                           jnp.asarray(batch.ref_logprobs_bt), cfg.kl_estimator)
    rewards = rewards - cfg.kl_coef * kl * mask
  advantages, returns = GAE_BY_UNIT[cfg.gae_unit](rewards, jnp.asarray(batch.old_values_bt),
                                                  mask, cfg.gamma, cfg.lam)
  if cfg.whiten_advantages:
    advantages = masked_whiten(advantages, mask)
  return batch.replace(token_rewards_bt=np.asarray(rewards), advantages_bt=np.asarray(advantages),
                       returns_bt=np.asarray(returns))


@register_adv_est("grpo")
def grpo_batch(batch: TrainBatch, cfg: losses.RLConfig) -> TrainBatch:
  """GRPO's: each dialogue's score against its group's (`scores_b`, `groups_b`), on every
  token of its replies; no returns (no critic). Never whitened again over the batch's tokens
  (verl and Tunix do not): a length-weighted mean would turn a short above-average
  dialogue's advantage negative."""
  mask = jnp.asarray(batch.loss_mask_bt)
  seq_adv = grpo_advantages(jnp.asarray(batch.scores_b), batch.groups_b,
                            normalize_std=cfg.grpo_normalize_std)
  advantages = seq_adv[:, None] * mask
  return batch.replace(advantages_bt=np.asarray(advantages),
                       returns_bt=np.zeros(advantages.shape, np.float32))


def compute_advantages(batch: TrainBatch, cfg: losses.RLConfig) -> TrainBatch:
  """`batch` with the advantages of `cfg.adv_estimator` (the registry's)."""
  return get_adv_estimator_fn(cfg.adv_estimator)(batch, cfg)
