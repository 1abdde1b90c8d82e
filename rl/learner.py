"""One model's training state and its jitted passes: the Learner, its optimizer and schedule.

Models are split into a graphdef and a parameter state; the jitted updates
(`rl.updates.UpdatePrograms`) are pure functions of (params, optimizer state,
batch) with the old state donated.
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

from infra import programs
from models import partitioning
from rl import losses, updates
from rl.batch import TrainBatch
from rl.losses import RLConfig


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
  """AdamW with gradient clipping; the schedule's steps are training steps, not updates."""
  lr: float = 1e-6
  warmup_steps: int = 0
  schedule: str = "constant"  # or "cosine"
  total_steps: int = 1
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.999
  grad_clip: float = 1.0


def learning_rate(cfg: AdamWConfig, step: int) -> float:
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


def make_optimizer(cfg: AdamWConfig) -> optax.GradientTransformation:
  """Clipped AdamW whose learning rate is a hyperparameter (`Learner.update` sets it)."""
  learning_rate(cfg, 0)  # an unknown schedule fails here, at start-up

  def clipped_adamw(learning_rate):
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                       optax.adamw(learning_rate, b1=cfg.b1, b2=cfg.b2,
                                   weight_decay=cfg.weight_decay))

  return optax.inject_hyperparams(clipped_adamw)(learning_rate=cfg.lr)


class Learner:
  """Holds one model's graphdef, params and optimizer state, and its jitted updates.

  With a mesh, params and optimizer state are placed by their logical axes
  and every batch array is sharded over the batch axes.
  """

  def __init__(self, model: nnx.Module, tx: optax.GradientTransformation | None = None,
               loss_fn=None, cfg: RLConfig | None = None, mesh=None,
               metric_prefix: str = ""):
    """Without `tx` the model is frozen (a reference policy): `apply` only.

    `loss_fn` is `updates.policy_loss` (its `temperature` bound with functools.partial)
    or `updates.critic_loss`; `metric_prefix` goes before the grad_norm and finite
    metrics (the critic's are critic_grad_norm, critic_finite).
    """
    graphdef, params = nnx.split(model)
    params = partitioning.place_state(params, mesh)
    opt_state = None if tx is None else jax.jit(
        tx.init, out_shardings=partitioning.optimizer_state_shardings(tx, params, mesh))(params)
    self._hold(graphdef, params, opt_state, tx, loss_fn, cfg, mesh, metric_prefix)

  @classmethod
  def abstract(cls, model: nnx.Module, tx: optax.GradientTransformation | None = None,
               loss_fn=None, cfg: RLConfig | None = None, mesh=None,
               metric_prefix: str = "") -> "Learner":
    """A Learner of an abstract model (`nnx.eval_shape`) on `mesh`, whose params and
    optimizer state are abstract arrays placed as a real one's: its programs compile
    (`rl.step`) with no memory behind them (the planner)."""
    graphdef, state = nnx.split(model)
    params = programs.abstract(state, partitioning.state_shardings(state, mesh))
    opt_state = None if tx is None else programs.abstract(
        jax.eval_shape(tx.init, params), partitioning.optimizer_state_shardings(tx, params, mesh))
    learner = cls.__new__(cls)
    learner._hold(graphdef, params, opt_state, tx, loss_fn, cfg, mesh, metric_prefix)
    return learner

  def _hold(self, graphdef, params, opt_state, tx, loss_fn, cfg, mesh, metric_prefix):
    self.graphdef, self.params, self.opt_state = graphdef, params, opt_state
    self.mesh = mesh
    self.metric_prefix = metric_prefix
    self.programs = None if tx is None else updates.UpdatePrograms(loss_fn, graphdef, tx, cfg)
    self._forward = {}

  def update(self, micro_batches: Sequence[TrainBatch],
             learning_rate: float | None = None) -> dict:
    """One optimizer update from a mini-batch given as micro-batches; returns its metrics.

    Every micro-batch's loss is normalised by the whole mini-batch's counts and
    the gradients are summed, so k micro-batches give the update of one big
    batch (verl's gradient accumulation); the metrics are the mini-batch's, as
    device arrays: the caller fetches them when it needs them, without waiting here.
    """
    norm = losses.normaliser(np.concatenate([m.loss_mask_bt for m in micro_batches]))
    with partitioning.mesh_context(self.mesh):
      if len(micro_batches) == 1:
        self.params, self.opt_state, metrics = self.programs.update(
            self.params, self.opt_state, partitioning.place_batch(micro_batches[0], self.mesh),
            norm, learning_rate)
        return self._named(metrics)
      grads, parts = None, []
      for micro in micro_batches:
        (loss, metrics), micro_grads = self.programs.gradients(
            self.params, partitioning.place_batch(micro, self.mesh), norm)
        grads = (micro_grads if grads is None else
                 self.programs.accumulate_gradients(grads, micro_grads))
        if jax.default_backend() == "cpu":
          # XLA:CPU runs each fake device's share of a collective on a shared thread pool;
          # with several sharded programs in flight on few cores they can deadlock (seen in
          # tests/rlver_jax/test_recipes.py on 2 cores), so CPU runs one micro-batch at a time.
          jax.block_until_ready(grads)
        parts.append({**metrics, "loss": loss})
      metrics = jax.tree.map(lambda *values: sum(values), *parts)
      self.params, self.opt_state, grad_norm, finite = self.programs.apply_gradients(
          self.params, self.opt_state, grads, metrics.pop("loss"), learning_rate)
    return self._named({**metrics, "grad_norm": grad_norm, "finite": finite.astype(jnp.float32)})

  def _named(self, metrics: dict) -> dict:
    for key in ("grad_norm", "finite"):
      metrics[self.metric_prefix + key] = metrics.pop(key)
    return metrics

  def forward(self, fn, **static):
    """Jitted `fn(graphdef, params, batch, **static)` without gradients (`rl.step`)."""
    key = (fn, tuple(sorted(static.items())))
    if key not in self._forward:
      self._forward[key] = jax.jit(functools.partial(fn, self.graphdef, **static))
    return self._forward[key]

  def apply(self, fn, batch: TrainBatch, **static):
    """`forward(fn, **static)` on this learner's params and `batch`."""
    with partitioning.mesh_context(self.mesh):
      return self.forward(fn, **static)(self.params, partitioning.place_batch(batch, self.mesh))

  def apply_in_micro_batches(self, fn, batch: TrainBatch, rows: int, **static) -> np.ndarray:
    """`apply` over slices of `rows` rows (the update's micro-batch), concatenated on the host.

    The value and reference passes then never hold more rows than an update does.
    """
    inputs = batch.model_inputs()
    return np.concatenate([
        partitioning.to_host(self.apply(fn, inputs.select_rows(i, i + rows), **static))
        for i in range(0, inputs.rows, rows)])

  def model(self) -> nnx.Module:
    return nnx.merge(self.graphdef, self.params)
