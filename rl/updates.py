"""PPO / GRPO loss functions and the jittable update steps built from them.

A loss function maps (graphdef, cfg, params, micro-batch, normaliser) to
(loss, metrics). Its loss and every metric are normalised by the whole
mini-batch's `losses.Normaliser`, so the mini-batch's values are the sums
over its micro-batches (verl's gradient accumulation). An update whose loss
or gradient is not finite leaves the parameters and the optimizer state
untouched and reports `finite = 0`; `rl.step.AlgorithmStep` counts those and
stops past a limit. `UpdatePrograms` are the jitted updates a `Learner` runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from infra import host_metrics
from models import partitioning
from rl import forward, losses
from rl.batch import TrainBatch
from rl.losses import RLConfig

# The update metrics a training step reports, each the mean over the step's finite updates:
# every host updates on the same global batch, so hosts have them alike (their plain mean).
UPDATE_METRICS = ("kl", "approx_kl", "entropy", "clip_frac", "pg_clipfrac_lower", "ratio_mean",
                  "pg_loss", "value_loss", "value_clip_frac", "grad_norm")
host_metrics.declare({name: host_metrics.MEAN for name in UPDATE_METRICS})


def policy_loss(graphdef, cfg: RLConfig, params, batch: TrainBatch,
                norm: losses.Normaliser | None, *, temperature: float = 1.0):
  """The registered `cfg.policy_loss` - entropy bonus (+ KL) of a [B, T] batch; (loss,
  metrics). The policy's log-probs are those of softmax(logits / `temperature`), the
  sampler's temperature."""
  mask = batch.loss_mask_bt
  logprobs, entropy_bt = forward.token_logprobs_and_entropy(graphdef, params, batch,
                                                            temperature)
  old_logprobs = batch.old_logprobs_bt
  if batch.old_is_own_b is not None:
    # At the step's starting weights a gradient program's forward is rounded differently from
    # the forward-only pass that scored the old log-probs (bf16, bench/mismatch.py): its own
    # log-probs make the ratio exactly 1 there, as verl's on-policy `old = log_prob.detach()`.
    old_logprobs = jnp.where(batch.old_is_own_b[:, None], jax.lax.stop_gradient(logprobs),
                             old_logprobs)
  pg_loss, metrics = losses.get_policy_loss_fn(cfg.policy_loss)(
      logprobs, old_logprobs, batch.advantages_bt, mask, clip_ratio=cfg.clip_ratio,
      clip_ratio_high=cfg.clip_ratio_high, dual_clip=cfg.dual_clip, agg=cfg.loss_agg, norm=norm,
      is_weights=batch.is_weights_bt)
  entropy = losses.aggregate(entropy_bt, mask, cfg.loss_agg, norm)
  loss = pg_loss - cfg.entropy_coef * entropy
  kl = jnp.zeros(())
  if cfg.kl_coef:
    kl = losses.aggregate(losses.kl_penalty(logprobs, batch.ref_logprobs_bt, cfg.kl_estimator),
                          mask, cfg.loss_agg, norm)
    if not cfg.kl_in_reward:
      loss = loss + cfg.kl_coef * kl
  metrics.update(pg_loss=pg_loss, entropy=entropy, kl=kl, policy_loss=loss)
  return loss, metrics


def critic_loss(graphdef, cfg: RLConfig, params, batch: TrainBatch,
                norm: losses.Normaliser | None):
  """Clipped value loss of a [B, T] batch; (loss, metrics)."""
  values = forward.critic_values(graphdef, params, batch)
  loss, metrics = losses.value_loss(values, batch.old_values_bt, batch.returns_bt,
                                    batch.loss_mask_bt, clip=cfg.value_clip, agg=cfg.loss_agg,
                                    norm=norm)
  metrics["value_loss"] = loss
  return loss, metrics


def gradients(loss_fn, graphdef, cfg: RLConfig, params, batch: TrainBatch, norm):
  """((loss, metrics), grads) of one micro-batch; the gradients placed like the weights."""
  out, grads = jax.value_and_grad(functools.partial(loss_fn, graphdef, cfg), has_aux=True)(
      params, batch, norm)
  return out, partitioning.constrain_state(grads)


def add_gradients(total, addend):
  """Two gradient trees (or metric dicts) summed leaf by leaf."""
  return jax.tree.map(jnp.add, total, addend)


def apply_gradients(tx, params, opt_state, grads, loss, learning_rate=None):
  """One optimizer update, or none (finite = 0) where the loss or gradient is not finite.

  `learning_rate`, when given, replaces the rate of a `learner.make_optimizer` optimizer.
  Returns (params, opt_state, grad_norm, finite).
  """
  if learning_rate is not None:
    rate = opt_state.hyperparams["learning_rate"]
    opt_state = opt_state._replace(hyperparams={
        **opt_state.hyperparams, "learning_rate": jnp.asarray(learning_rate, rate.dtype)})
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jnp.where(finite, new, old)
  return (jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt_state, opt_state),
          grad_norm, finite)


def update(loss_fn, graphdef, tx, cfg: RLConfig, params, opt_state, batch: TrainBatch,
           norm=None, learning_rate=None):
  """A whole update from a single micro-batch: gradients, then `apply_gradients`.

  Returns (params, opt_state, metrics) with grad_norm and finite added.
  """
  (loss, metrics), grads = gradients(loss_fn, graphdef, cfg, params, batch, norm)
  params, opt_state, grad_norm, finite = apply_gradients(tx, params, opt_state, grads, loss,
                                                         learning_rate)
  return params, opt_state, {**metrics, "grad_norm": grad_norm,
                             "finite": finite.astype(jnp.float32)}


class UpdatePrograms:
  """One model's jitted update programs (`rl/step.py` lists them): `update` from a mini-batch
  of one micro-batch; with gradient accumulation `gradients` per micro-batch,
  `accumulate_gradients` between them and `apply_gradients` once. The old parameters and
  optimizer state are donated."""

  def __init__(self, loss_fn, graphdef, tx, cfg: RLConfig):
    self.update = jax.jit(functools.partial(update, loss_fn, graphdef, tx, cfg),
                          donate_argnums=(0, 1))
    self.gradients = jax.jit(functools.partial(gradients, loss_fn, graphdef, cfg))
    self.accumulate_gradients = jax.jit(add_gradients, donate_argnums=(0,))
    self.apply_gradients = jax.jit(functools.partial(apply_gradients, tx),
                                   donate_argnums=(0, 1))
