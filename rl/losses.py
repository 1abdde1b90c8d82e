"""PPO / GRPO losses over [B, T] token arrays (pure, jittable), as verl's core_algos.

Every loss takes a 0/1 `mask` of the tokens it covers (the agent's own
tokens) and an aggregation mode (verl's `loss_agg_mode`):
  token-mean           sum(loss * mask) / (tokens with mask 1)
  seq-mean-token-sum   sum over sequences of sum(loss * mask) / (sequences with any token)
  seq-mean-token-mean  sum over sequences of the per-sequence token mean / (sequences with any)
The denominators default to this batch's; with gradient accumulation a
`Normaliser` passes the whole mini-batch's, so that the micro-batches' losses
(and every metric here) add up to the mini-batch's, as verl's `agg_loss` does.

The aggregation modes, the KL estimators and the policy losses are registries
(`infra.registry`): a variant registers itself under its config name next to
its code, and `RLConfig.check` accepts exactly the registered names.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from infra import config_section
from infra.registry import Registry

TOKEN_MEAN = "token-mean"
SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"


ALGORITHMS = ("ppo", "grpo")
REWARDS = ("final", "turn")
# What PPO's GAE steps over: each agent token (verl's) or each reply (an ablation).
GAE_UNITS = ("token", "reply")
OLD_LOGPROBS = ("sampler", "learner")
ROLLOUT_CORRECTIONS = ("none", "token_tis")


@dataclasses.dataclass(frozen=True)
class RLConfig(config_section.Section):
  """The `rl` section: the algorithm, its advantages and its losses (verl's names).

  Attributes:
    algorithm: ppo (GAE with a critic) | grpo (group-normalised, no critic).
    gamma: GAE discount (per step of `gae_unit`).
    lam: GAE lambda (per step of `gae_unit`).
    gae_unit: PPO: what GAE steps over: token (verl's: each agent token an action, valued by
      the critic at each) | reply (each reply one action, valued at its first token, all its
      tokens taking its advantage: `advantages.reply_gae_advantages`; in the demo it garbled
      twice as many replies as by token, docs/demo.md).
    whiten_advantages: PPO: whiten the batch's advantages (GRPO's group-normalised
      advantages never are).
    grpo_normalize_std: GRPO: divide by the group's reward std, not only centre.
    clip_ratio: PPO's clip of the probability ratio: 1 +- this.
    clip_ratio_high: the ratio's upper clip is 1 + this (None: clip_ratio).
    dual_clip: a negative-advantage token's loss is capped at this x |advantage| (verl's
      clip_ratio_c; None: off).
    value_clip: the critic's loss also clips its values to the rollout's +- this.
    entropy_coef: weight of the entropy bonus.
    kl_coef: weight of the KL to the initial policy; 0 (released): no reference pass.
    kl_estimator: k1 | k2 | k3 (`KL_ESTIMATORS`; verl accepts these names too, beside its
      kl, mse and low_var_kl).
    kl_in_reward: the KL as a per-token reward penalty, not a loss term.
    loss_agg: token-mean | seq-mean-token-sum | seq-mean-token-mean (`AGGREGATIONS`, verl's
      loss_agg_mode).
    policy_loss: vanilla, the clipped surrogate with dual clip (`POLICY_LOSSES`, verl's
      policy_loss.loss_mode).
    reward: final (the last emotion) | turn (each reply's change; an ablation).
    old_logprobs: the PPO ratio's old log-probs: sampler (the sampler's own, drawn with the
      tokens; verl's bypass mode) | learner (one forward pass of the policy at the step's
      starting weights, as the authors' release: the trust region then spends nothing on the
      sampler's numerics; the step's first update, whose weights have not moved, takes its
      own log-probs, detached, as verl's on-policy shortcut: in bf16 the compiler rounds the
      gradient program's forward differently from the forward-only pass).
    log_mismatch: measure the sampler-learner mismatch every step (mismatch/*, rl/mismatch.py)
      with that forward pass; learner takes it anyway.
    rollout_correction: none | token_tis: with old_logprobs=learner, each token's policy loss
      times the detached weight min(p_old / p_sampler, rollout_is_threshold) (verl's
      rollout_correction, Tunix's sampler_is="token"); it also corrects the one update a
      sampler lags with rollout.off_policy_steps=1.
    rollout_is_threshold: token_tis's truncation of the importance weight.
  """
  algorithm: str = "ppo"
  gamma: float = 1.0
  lam: float = 1.0
  gae_unit: str = "token"
  whiten_advantages: bool = True
  grpo_normalize_std: bool = True
  clip_ratio: float = 0.2
  clip_ratio_high: float | None = None
  dual_clip: float | None = 3.0
  value_clip: float | None = 0.5
  entropy_coef: float = 0.001
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  kl_in_reward: bool = False
  loss_agg: str = TOKEN_MEAN
  policy_loss: str = "vanilla"
  reward: str = "final"
  old_logprobs: str = "sampler"
  log_mismatch: bool = True
  rollout_correction: str = "none"
  rollout_is_threshold: float = 2.0

  @property
  def learner_logprobs_pass(self) -> bool:
    """Whether a step scores its tokens with the policy at its starting weights."""
    return self.old_logprobs == "learner" or self.log_mismatch

  @property
  def first_update_takes_own_logprobs(self) -> bool:
    """Whether a step's first update, at unmoved weights, takes its own log-probs (detached)
    as the old ones (`TrainBatch.old_is_own_b`): with the learner's old log-probs."""
    return self.old_logprobs == "learner"

  @property
  def weights_policy_loss(self) -> bool:
    """Whether the rollout correction weights each token's policy loss (`is_weights_bt`)."""
    return self.rollout_correction != "none"

  @property
  def clip_range(self) -> tuple[float, float]:
    """The PPO ratio's (low, high) clip: it is clipped to [1 - low, 1 + high]."""
    high = self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high
    return self.clip_ratio, high

  @property
  def uses_critic(self) -> bool:
    """PPO learns a value model (the critic); GRPO needs none."""
    return self.algorithm == "ppo"

  @property
  def uses_reference(self) -> bool:
    """A KL penalty scores tokens under the frozen initial policy (the reference)."""
    return bool(self.kl_coef)

  @property
  def adv_estimator(self) -> str:
    """verl's name for the advantage estimator: gae (PPO) or grpo."""
    return {"ppo": "gae", "grpo": "grpo"}.get(self.algorithm, self.algorithm)

  def check(self, p: config_section.Problems) -> None:
    p.one_of("algorithm", ALGORITHMS)
    p.one_of("reward", REWARDS)
    p.one_of("gae_unit", GAE_UNITS)
    p.one_of("loss_agg", AGGREGATIONS)
    p.one_of("kl_estimator", KL_ESTIMATORS)
    p.one_of("policy_loss", POLICY_LOSSES)
    p.one_of("old_logprobs", OLD_LOGPROBS)
    p.one_of("rollout_correction", ROLLOUT_CORRECTIONS)
    p.require("rollout_is_threshold", lambda v: v >= 1.0, "must be >= 1 (a weight of 1 is "
              "an exact match)")
    if self.rollout_correction != "none":
      p.require("old_logprobs", lambda v: v == "learner", "must be learner with "
                f"rollout_correction={self.rollout_correction} (its weight is p_old / "
                "p_sampler; with the sampler's log-probs as the old ones it is 1)")
    p.require("gamma", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
    p.require("lam", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1]")
    p.require("clip_ratio", config_section.positive, "must be > 0")
    p.require("clip_ratio_high", lambda v: v is None or v > 0, "must be > 0 or None")
    p.require("dual_clip", lambda v: v is None or v > 1.0,
              "must be > 1 (verl's clip_ratio_c, 3.0: the dual clip caps losses at "
              "dual_clip * |advantage|) or None to turn it off")
    p.require("value_clip", lambda v: v is None or v > 0, "must be > 0 or None")
    p.require("entropy_coef", config_section.at_least(0.0), "must be >= 0")
    p.require("kl_coef", config_section.at_least(0.0), "must be >= 0")
    if self.algorithm == "grpo":
      p.require("reward", lambda v: v == "final",
                "per-turn rewards are a PPO ablation; GRPO normalises final rewards")


# exp(20) ~ 4.9e8 is finite in float32 (exp overflows past 88, and then 0 * inf makes NaN
# gradients even where the loss never uses the value); verl clamps the same way.
LOG_RATIO_LIMIT = 20.0


class Normaliser(NamedTuple):
  """Denominators of the aggregations: loss tokens, and sequences with any loss token."""
  tokens: jax.Array
  sequences: jax.Array


def normaliser(mask_bt) -> Normaliser:
  """The denominators of a whole (mini-)batch, from its [B, T] loss mask (host numpy)."""
  mask_bt = np.asarray(mask_bt, np.float32)
  return Normaliser(tokens=np.float32(max(mask_bt.sum(), 1.0)),
                    sequences=np.float32(max((mask_bt.sum(axis=1) > 0).sum(), 1)))


# A mode: ([B, T] per-token losses, [B, T] float 0/1 mask, the denominators or None for this
# batch's) -> the scalar loss. verl's `agg_loss` modes.
Aggregation = Callable[[jax.Array, jax.Array, Normaliser | None], jax.Array]
AGGREGATIONS: Registry[Aggregation] = Registry("loss aggregation")


@AGGREGATIONS.register(TOKEN_MEAN)
def _agg_token_mean(loss_bt, mask_bt, norm: Normaliser | None):
  tokens = jnp.maximum(jnp.sum(mask_bt), 1.0) if norm is None else norm.tokens
  return jnp.sum(loss_bt * mask_bt) / tokens


def _sequence_mean(per_seq_b, tokens_b, norm: Normaliser | None):
  """The mean of `per_seq_b` over the sequences with any loss token."""
  has_tokens_b = (tokens_b > 0).astype(jnp.float32)
  sequences = jnp.maximum(jnp.sum(has_tokens_b), 1.0) if norm is None else norm.sequences
  return jnp.sum(per_seq_b * has_tokens_b) / sequences


@AGGREGATIONS.register(SEQ_MEAN_TOKEN_SUM)
def _agg_seq_mean_token_sum(loss_bt, mask_bt, norm: Normaliser | None):
  return _sequence_mean(jnp.sum(loss_bt * mask_bt, axis=1), jnp.sum(mask_bt, axis=1), norm)


@AGGREGATIONS.register(SEQ_MEAN_TOKEN_MEAN)
def _agg_seq_mean_token_mean(loss_bt, mask_bt, norm: Normaliser | None):
  tokens_b = jnp.sum(mask_bt, axis=1)
  per_seq_b = jnp.sum(loss_bt * mask_bt, axis=1) / jnp.maximum(tokens_b, 1.0)
  return _sequence_mean(per_seq_b, tokens_b, norm)


def aggregate(loss_bt, mask_bt, mode: str = TOKEN_MEAN, norm: Normaliser | None = None):
  """[B, T] per-token losses -> scalar by the registered `mode`; `norm` (default: this
  batch's) gives the denominators."""
  return AGGREGATIONS.lookup(mode)(loss_bt, mask_bt.astype(jnp.float32), norm)


def _token_mean(x_bt, mask_bt, norm: Normaliser | None):
  return aggregate(x_bt.astype(jnp.float32), mask_bt, TOKEN_MEAN, norm)


# A policy loss: ([B, T] log-probs, old log-probs, advantages, loss mask, and keywords
# clip_ratio, clip_ratio_high, dual_clip, agg, norm, is_weights as `policy_loss`'s) ->
# (scalar loss, metrics). verl's registry and its names (`core_algos.register_policy_loss`).
PolicyLoss = Callable[..., tuple[jax.Array, dict]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register
get_policy_loss_fn = POLICY_LOSSES.lookup


@register_policy_loss("vanilla")
def policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_ratio: float = 0.2,
                clip_ratio_high: float | None = None, dual_clip: float | None = 3.0,
                agg: str = TOKEN_MEAN, norm: Normaliser | None = None, is_weights=None):
  """verl's clipped surrogate with dual clip, over [B, T] arrays; with `is_weights` (the
  rollout correction's truncated importance weights, [B, T]) each token's loss is weighted by
  its own after the clips, as verl's `pg_losses * rollout_is_weights`.

  The log-ratio is clamped to +-LOG_RATIO_LIMIT before `exp`. With
  `dual_clip` = c > 1 (verl's clip_ratio_c), a negative-advantage token's
  loss is capped at c * |A|; None turns the cap off. Returns (loss, metrics):
  clip_frac (tokens whose clipped surrogate was taken), pg_clipfrac_lower
  (tokens capped by the dual clip; with dual_clip only), approx_kl =
  mean(old - new logprob) and ratio_mean, all token means over `norm`.
  """
  high = clip_ratio if clip_ratio_high is None else clip_ratio_high
  log_ratio_bt = jnp.clip(logprobs - old_logprobs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
  ratio_bt = jnp.exp(log_ratio_bt)
  unclipped_bt = -advantages * ratio_bt
  clipped_bt = -advantages * jnp.clip(ratio_bt, 1.0 - clip_ratio, 1.0 + high)
  loss_bt = jnp.maximum(unclipped_bt, clipped_bt)
  metrics = {
      "clip_frac": _token_mean(clipped_bt > unclipped_bt, mask, norm),
      "approx_kl": _token_mean(-log_ratio_bt, mask, norm),
      "ratio_mean": _token_mean(ratio_bt, mask, norm),
  }
  if dual_clip is not None:
    cap_bt = -advantages * dual_clip
    capped_bt = (advantages < 0) & (loss_bt > cap_bt)
    loss_bt = jnp.where(capped_bt, cap_bt, loss_bt)
    metrics["pg_clipfrac_lower"] = _token_mean(capped_bt, mask, norm)
  if is_weights is not None:
    loss_bt = loss_bt * jax.lax.stop_gradient(is_weights)
  return aggregate(loss_bt, mask, agg, norm), metrics


def value_loss(values, old_values, returns, mask, *, clip: float | None = 0.5,
               agg: str = TOKEN_MEAN, norm: Normaliser | None = None):
  """0.5 * max((v - R)^2, (v_clipped - R)^2), v_clipped = clip(v, old - clip, old + clip).

  Clipping `v` itself (as verl) keeps every value inside the band exactly
  equal to v, so value_clip_frac counts only tokens whose clipped loss was
  taken; old + clip(v - old) would round some of those and count them. Without
  `clip` there is no value_clip_frac.
  """
  values, old_values, returns = (jnp.asarray(x, jnp.float32)
                                 for x in (values, old_values, returns))
  unclipped_bt = (values - returns) ** 2
  if clip is None:
    return 0.5 * aggregate(unclipped_bt, mask, agg, norm), {}
  clipped_values_bt = jnp.clip(values, old_values - clip, old_values + clip)
  clipped_bt = (clipped_values_bt - returns) ** 2
  loss_bt = jnp.maximum(unclipped_bt, clipped_bt)
  clip_frac = _token_mean(clipped_bt > unclipped_bt, mask, norm)
  return 0.5 * aggregate(loss_bt, mask, agg, norm), {"value_clip_frac": clip_frac}


def entropy_from_logits(logits):
  """Entropy of softmax(logits) along the last axis, in fp32."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  probs = jax.nn.softmax(logits, axis=-1)
  return log_z - jnp.sum(probs * logits, axis=-1)


# An estimator: the [B, T] log-ratio log p - log q of the sampled tokens -> [B, T] estimates
# of KL(policy || reference). Our names are Schulman's k1, k2, k3, which verl accepts too,
# beside its own: kl (k1), mse (k2), low_var_kl (k3). One name each, so that runs and sweeps
# name an estimator one way.
KLEstimator = Callable[[jax.Array], jax.Array]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def _kl_k1(log_ratio):
  """log p - log q: unbiased, negative for some tokens."""
  return log_ratio


@KL_ESTIMATORS.register("k2")
def _kl_k2(log_ratio):
  """(log p - log q)^2 / 2: biased, low variance, always >= 0."""
  return 0.5 * log_ratio ** 2


@KL_ESTIMATORS.register("k3")
def _kl_k3(log_ratio):
  """q/p - 1 - log(q/p): unbiased, always >= 0; as verl's low_var_kl, its log-ratio is clamped
  to +-LOG_RATIO_LIMIT before exp and the estimate to [-10, 10]."""
  log_ratio = jnp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
  return jnp.clip(jnp.exp(-log_ratio) - 1.0 + log_ratio, -10.0, 10.0)


def kl_penalty(logprobs, ref_logprobs, estimator: str = "k3"):
  """Per-token KL(policy || reference) estimates from sampled-token logprobs by the registered
  `estimator` (`KL_ESTIMATORS`). [B, T] in, [B, T] out."""
  return KL_ESTIMATORS.lookup(estimator)(logprobs - ref_logprobs)


def token_logprobs(logits_btv, tokens_bt, temperature: float = 1.0):
  """log softmax(logits / T) of the given tokens: [B, T, V], [B, T] -> [B, T]."""
  logprobs_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
  return jnp.take_along_axis(logprobs_btv, tokens_bt[..., None], axis=-1)[..., 0]
