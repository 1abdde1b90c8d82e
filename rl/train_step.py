"""Batches, advantages and jitted PPO / GRPO updates for the policy and the critic.

Models are split into a graphdef and a parameter state; the jitted steps are
pure functions of (params, optimizer state, batch) with the old state
donated. Token arrays of a batch live on the "target" grid: entry t belongs
to token t + 1 of `input_ids` (the token predicted from position t).

An update runs over one mini-batch given as k micro-batches: each
micro-batch's loss is normalised by the whole mini-batch's token (or sequence)
count, so the summed gradients equal one pass over the mini-batch (verl's
gradient accumulation). An update whose loss or gradient is not finite leaves
the parameters and the optimizer state untouched and reports `finite = 0`;
the trainer counts those and stops past a limit.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import partitioning
from models.errors import UserInputError
from models.sampler import bucket_size
from rl import advantages as adv_lib
from rl import losses
from rl.rollout import Sample


@dataclasses.dataclass(frozen=True)
class LossConfig:
  advantage: str = "gae"  # "gae" (PPO) or "grpo"
  gamma: float = 1.0
  lam: float = 1.0
  whiten_advantages: bool = True  # GAE only: GRPO's group-normalised advantages never are
  grpo_normalize_std: bool = True
  clip_ratio: float = 0.2
  clip_ratio_high: float | None = None
  dual_clip: float | None = 3.0  # verl's clip_ratio_c; None turns it off
  value_clip: float | None = 0.5
  entropy_coef: float = 0.001
  kl_coef: float = 0.0  # 0 skips the reference model entirely
  kl_estimator: str = "k3"
  kl_in_reward: bool = False  # True: per-token reward penalty; False: loss term
  loss_agg: str = losses.TOKEN_MEAN
  temperature: float = 1.0  # logprobs of softmax(logits / T), as the sampler draws

  def __post_init__(self):
    if self.dual_clip is not None and self.dual_clip <= 1.0:
      raise UserInputError(f"rl.dual_clip={self.dual_clip}: the dual clip caps losses at "
                           "dual_clip * |advantage| and must be > 1 (verl's clip_ratio_c, 3.0), "
                           "or None to turn it off")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """AdamW with gradient clipping; the schedule's steps are training steps, not updates."""
  lr: float = 1e-6
  warmup_steps: int = 0
  schedule: str = "constant"  # or "cosine"
  total_steps: int = 1
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.999
  grad_clip: float = 1.0


def learning_rate(cfg: OptimConfig, step: int) -> float:
  """The learning rate of every update in training step `step` (0-based).

  As verl, which steps its LR scheduler once per training step: a step that
  makes several updates (mini-batches, thinking-mode turn samples) uses one
  rate for all of them, and warm-up counts steps whatever the update count.
  """
  if cfg.schedule == "cosine":
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1),
                                                  max(cfg.total_steps, cfg.warmup_steps + 1))
  elif cfg.schedule == "constant":
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1)),
         optax.constant_schedule(cfg.lr)], [cfg.warmup_steps]) if cfg.warmup_steps else (
             lambda _: cfg.lr)
  else:
    raise ValueError(f"unknown lr schedule {cfg.schedule!r}; expected constant or cosine")
  return float(schedule(step))


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  """Clipped AdamW whose learning rate is a hyperparameter (`Learner.update` sets it)."""
  learning_rate(cfg, 0)  # an unknown schedule fails here, at start-up

  def clipped_adamw(learning_rate):
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(learning_rate, b1=cfg.b1, b2=cfg.b2,
                                   weight_decay=cfg.weight_decay))

  return optax.inject_hyperparams(clipped_adamw)(learning_rate=cfg.lr)


# Batches.

def collate(samples: Sequence[Sample], batch_multiple: int = 1, pad_id: int = 0) -> dict:
  """Right-padded numpy arrays; length bucketed to a power of two, rows to `batch_multiple`.

  Filler rows have an all-zero mask, so they add nothing to any loss.
  """
  rows = -(-len(samples) // batch_multiple) * batch_multiple
  width = bucket_size(max(len(s.tokens) for s in samples), minimum=32)
  input_ids = np.full((rows, width), pad_id, np.int32)
  attention = np.zeros((rows, width), np.bool_)
  loss_mask = np.zeros((rows, width - 1), np.float32)
  old_logprobs = np.zeros((rows, width - 1), np.float32)
  token_rewards = np.zeros((rows, width - 1), np.float32)
  scores = np.zeros((rows,), np.float32)
  groups = np.arange(rows, dtype=np.int32) + 10**6  # fillers: their own groups
  for r, s in enumerate(samples):
    n = len(s.tokens)
    input_ids[r, :n] = s.tokens
    attention[r, :n] = True
    loss_mask[r, :n - 1] = s.loss_mask[1:]
    old_logprobs[r, :n - 1] = s.logprobs[1:]
    for index, reward in s.token_rewards:
      token_rewards[r, index - 1] += reward
    scores[r] = s.reward
    groups[r] = s.group
  return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask,
          "old_logprobs": old_logprobs, "token_rewards": token_rewards, "scores": scores,
          "groups": groups}


def compute_advantages(batch: dict, cfg: LossConfig) -> dict:
  """Adds token rewards, advantages and returns (host numpy in, numpy out)."""
  mask = jnp.asarray(batch["loss_mask"])
  scores = jnp.asarray(batch["scores"])
  out = dict(batch)
  if cfg.advantage == "grpo":
    seq_adv = adv_lib.grpo_advantages(scores, batch["groups"],
                                      normalize_std=cfg.grpo_normalize_std)
    advantages = seq_adv[:, None] * mask
    returns = jnp.zeros_like(advantages)
  elif cfg.advantage == "gae":
    rewards = jnp.asarray(batch["token_rewards"])
    if cfg.kl_coef and cfg.kl_in_reward:
      kl = losses.kl_penalty(jnp.asarray(batch["old_logprobs"]), jnp.asarray(batch["ref_logprobs"]),
                             cfg.kl_estimator)
      rewards = rewards - cfg.kl_coef * kl * mask
    advantages, returns = adv_lib.gae_advantages(rewards, jnp.asarray(batch["old_values"]), mask,
                                                 cfg.gamma, cfg.lam)
    out["token_rewards"] = np.asarray(rewards)  # with any KL penalty
  else:
    raise ValueError(f"unknown advantage estimator {cfg.advantage!r}; expected gae or grpo")
  if cfg.advantage == "gae" and cfg.whiten_advantages:
    # GAE only. GRPO's advantages are already normalised within each group; whitening
    # them again over the batch's tokens (verl and Tunix do not) subtracts a
    # length-weighted mean that turns a short above-average dialogue's advantage negative.
    advantages = adv_lib.masked_whiten(advantages, mask)
  out["advantages"] = np.asarray(advantages)
  out["returns"] = np.asarray(returns)
  return out


# Forward passes.

LOGITS_CHUNK = 512  # target tokens per slice of the unembedding


def token_logprobs_and_entropy(graphdef, params, batch, temperature: float,
                               chunk: int = LOGITS_CHUNK):
  """log softmax(logits / T) of every target token and the entropy there, [B, T - 1] each.

  Full logits ([B, T, V], 152k wide for Qwen2.5) are never held: the
  unembedding, softmax and their gradients run over `chunk`-token slices and
  are recomputed in the backward pass, so memory grows with chunk x V, not T x V.
  """
  model = nnx.merge(graphdef, params)
  hidden_btd, _ = model.backbone(batch["input_ids"], attention_mask=batch["attention_mask"])
  b, t, d = hidden_btd.shape
  targets_bt = jnp.pad(batch["input_ids"][:, 1:], ((0, 0), (0, 1)))  # the last has no target
  chunk = min(chunk, t)
  pad = -t % chunk
  n = (t + pad) // chunk
  hidden_nbcd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d)
  targets_nbc = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, chunk)

  @jax.checkpoint
  def one_slice(hidden_bcd, targets_bc):
    logits_bcv = model.logits(hidden_bcd).astype(jnp.float32) / temperature
    return (losses.token_logprobs(logits_bcv, targets_bc),
            losses.entropy_from_logits(logits_bcv))

  logprobs_nbc, entropy_nbc = jax.lax.map(
      lambda xs: one_slice(*xs), (hidden_nbcd.swapaxes(0, 1), targets_nbc.swapaxes(0, 1)))
  unslice = lambda x_nbc: x_nbc.swapaxes(0, 1).reshape(b, t + pad)[:, :t - 1]
  return unslice(logprobs_nbc), unslice(entropy_nbc)


def critic_values(graphdef, params, batch):
  model = nnx.merge(graphdef, params)
  return model(batch["input_ids"], attention_mask=batch["attention_mask"])[:, :-1]


def sequence_logprobs(graphdef, params, batch, temperature: float):
  return token_logprobs_and_entropy(graphdef, params, batch, temperature)[0]


# Updates.
#
# A loss function maps (graphdef, cfg, params, micro-batch, normaliser) to
# (loss, metrics). Its loss and every metric are normalised by the whole
# mini-batch's `losses.Normaliser`, so the mini-batch's values are the sums
# over its micro-batches.

def policy_loss(graphdef, cfg: LossConfig, params, batch, norm: losses.Normaliser | None):
  """Clipped surrogate - entropy bonus (+ KL) of a [B, T] batch; (loss, metrics)."""
  mask = batch["loss_mask"]
  logprobs, entropy_bt = token_logprobs_and_entropy(graphdef, params, batch, cfg.temperature)
  pg_loss, metrics = losses.policy_loss(
      logprobs, batch["old_logprobs"], batch["advantages"], mask, clip_ratio=cfg.clip_ratio,
      clip_ratio_high=cfg.clip_ratio_high, dual_clip=cfg.dual_clip, agg=cfg.loss_agg, norm=norm)
  entropy = losses.aggregate(entropy_bt, mask, cfg.loss_agg, norm)
  loss = pg_loss - cfg.entropy_coef * entropy
  kl = jnp.zeros(())
  if cfg.kl_coef:
    kl = losses.aggregate(losses.kl_penalty(logprobs, batch["ref_logprobs"], cfg.kl_estimator),
                          mask, cfg.loss_agg, norm)
    if not cfg.kl_in_reward:
      loss = loss + cfg.kl_coef * kl
  metrics.update(pg_loss=pg_loss, entropy=entropy, kl=kl, policy_loss=loss)
  return loss, metrics


def critic_loss(graphdef, cfg: LossConfig, params, batch, norm: losses.Normaliser | None):
  """Clipped value loss of a [B, T] batch; (loss, metrics)."""
  values = critic_values(graphdef, params, batch)
  loss, metrics = losses.value_loss(values, batch["old_values"], batch["returns"],
                                    batch["loss_mask"], clip=cfg.value_clip, agg=cfg.loss_agg,
                                    norm=norm)
  metrics["value_loss"] = loss
  return loss, metrics


def gradients(loss_fn, graphdef, cfg: LossConfig, params, batch, norm):
  """((loss, metrics), grads) of one micro-batch."""
  return jax.value_and_grad(functools.partial(loss_fn, graphdef, cfg), has_aux=True)(
      params, batch, norm)


def apply_gradients(tx, params, opt_state, grads, loss, learning_rate=None):
  """One optimizer update, or none (finite = 0) where the loss or gradient is not finite.

  `learning_rate`, when given, replaces the rate of a `make_optimizer` optimizer.
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


def update(loss_fn, graphdef, tx, cfg: LossConfig, params, opt_state, batch, norm=None,
           learning_rate=None):
  """A whole update from a single micro-batch: gradients, then `apply_gradients`.

  Returns (params, opt_state, metrics) with grad_norm and finite added.
  """
  (loss, metrics), grads = gradients(loss_fn, graphdef, cfg, params, batch, norm)
  params, opt_state, grad_norm, finite = apply_gradients(tx, params, opt_state, grads, loss,
                                                         learning_rate)
  return params, opt_state, {**metrics, "grad_norm": grad_norm,
                             "finite": finite.astype(jnp.float32)}


def _add_trees(total, addend):
  return jax.tree.map(jnp.add, total, addend)


def _as_jit_writes_it(sharding: NamedSharding) -> NamedSharding:
  """The same placement without trailing None axes, as jit returns updated state.

  P("fsdp", None) and P("fsdp") place alike but are different jit cache keys;
  written the same way, the second update reuses the first one's trace.
  """
  spec = tuple(sharding.spec)
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return NamedSharding(sharding.mesh, PartitionSpec(*spec))


class Learner:
  """Holds one model's graphdef, params and optimizer state, and its jitted updates.

  With a mesh, params and optimizer state are placed by their logical axes
  and every batch array is sharded over the batch axes.
  """

  def __init__(self, model: nnx.Module, tx: optax.GradientTransformation | None = None,
               loss_fn=None, cfg: LossConfig | None = None, mesh=None, rules=None,
               metric_prefix: str = ""):
    """Without `tx` the model is frozen (a reference policy): `apply` only.

    `loss_fn` is `policy_loss` or `critic_loss`; `metric_prefix` goes before the
    grad_norm and finite metrics (the critic's are critic_grad_norm, critic_finite).
    """
    self.graphdef, params = nnx.split(model)
    self.mesh = mesh
    self.rules = rules
    self.metric_prefix = metric_prefix
    if mesh is not None:
      params = jax.device_put(params, jax.tree.map(
          _as_jit_writes_it, partitioning.state_shardings(params, mesh, rules)))
    self.params = params
    self.opt_state = None if tx is None else jax.jit(
        tx.init, out_shardings=partitioning.optimizer_state_shardings(tx, params, mesh))(params)
    if tx is not None:
      self._update = jax.jit(functools.partial(update, loss_fn, self.graphdef, tx, cfg),
                             donate_argnums=(0, 1))
      self._gradients = jax.jit(functools.partial(gradients, loss_fn, self.graphdef, cfg))
      self._accumulate = jax.jit(_add_trees, donate_argnums=(0,))
      self._apply_gradients = jax.jit(functools.partial(apply_gradients, tx),
                                      donate_argnums=(0, 1))
    self._forward = {}

  def shard_batch(self, batch: dict) -> dict:
    if self.mesh is None:
      return {k: jnp.asarray(v) for k, v in batch.items()}
    return {k: partitioning.put_host_value(
                v, partitioning.batch_sharding(np.shape(v), self.mesh, self.rules))
            for k, v in batch.items()}

  def update(self, micro_batches: Sequence[dict], learning_rate: float | None = None) -> dict:
    """One optimizer update from a mini-batch given as micro-batches; returns its metrics.

    Every micro-batch's loss is normalised by the whole mini-batch's counts and
    the gradients are summed, so k micro-batches give the update of one big
    batch (verl's gradient accumulation); the metrics are the mini-batch's.
    """
    norm = losses.normaliser(np.concatenate([m["loss_mask"] for m in micro_batches]))
    with partitioning.mesh_context(self.mesh):
      if len(micro_batches) == 1:
        self.params, self.opt_state, metrics = self._update(
            self.params, self.opt_state, self.shard_batch(micro_batches[0]), norm, learning_rate)
        return self._named(metrics)
      grads, parts = None, []
      for micro in micro_batches:
        (loss, metrics), micro_grads = self._gradients(self.params, self.shard_batch(micro), norm)
        grads = micro_grads if grads is None else self._accumulate(grads, micro_grads)
        parts.append({**metrics, "loss": loss})
      metrics = jax.tree.map(lambda *values: sum(values), *parts)
      self.params, self.opt_state, grad_norm, finite = self._apply_gradients(
          self.params, self.opt_state, grads, metrics.pop("loss"), learning_rate)
    return self._named({**metrics, "grad_norm": grad_norm, "finite": finite.astype(jnp.float32)})

  def _named(self, metrics: dict) -> dict:
    for key in ("grad_norm", "finite"):
      metrics[self.metric_prefix + key] = metrics.pop(key)
    return metrics

  def apply(self, fn, batch: dict, **static):
    """Jitted `fn(graphdef, params, batch, **static)` without gradients."""
    key = (fn, tuple(sorted(static.items())))
    if key not in self._forward:
      self._forward[key] = jax.jit(functools.partial(fn, self.graphdef, **static))
    with partitioning.mesh_context(self.mesh):
      return self._forward[key](self.params, self.shard_batch(batch))

  def apply_in_micro_batches(self, fn, batch: dict, rows: int, **static) -> np.ndarray:
    """`apply` over slices of `rows` rows (the update's micro-batch), concatenated on the host.

    The value and reference passes then never hold more rows than an update does.
    """
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    total = len(inputs["input_ids"])
    return np.concatenate([
        partitioning.to_host(self.apply(fn, {k: v[i:i + rows] for k, v in inputs.items()},
                                        **static))
        for i in range(0, total, rows)])

  def model(self) -> nnx.Module:
    return nnx.merge(self.graphdef, self.params)
