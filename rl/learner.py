"""One model's training state and its jitted passes: the Learner, its optimizer and schedule
(the `optim` section).

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
from infra.config_section import Problems, Section, at_least, positive
from models import partitioning
from rl import losses, updates
from rl.batch import TrainBatch
from rl.losses import RLConfig


LR_SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimConfig(Section):
  """The `optim` section: AdamW for the policy and the critic, and the updates' schedule.

  The learners' optimizers (`make_optimizer`) and the step (`rl.step.StepConfig`) read it
  whole; AdamW's betas are optax's defaults (0.9, 0.999).

  Attributes:
    actor_lr: the policy's learning rate (AdamW).
    critic_lr: the critic's learning rate (PPO).
    warmup_steps: steps of linear learning-rate warm-up from 0.
    schedule: after warm-up: constant | cosine (decays to 0 at `steps`).
    weight_decay: AdamW weight decay.
    grad_clip: global gradient norm clip.
    ppo_epochs: passes over a step's batch.
    num_minibatches: updates per pass (the batch split in this many).
    grad_accum: micro-batches accumulated per update (memory, not maths).
  """
  actor_lr: float = 1e-6
  critic_lr: float = 5e-6
  warmup_steps: int = 50
  schedule: str = "constant"
  weight_decay: float = 0.01
  grad_clip: float = 1.0
  ppo_epochs: int = 1
  num_minibatches: int = 1
  grad_accum: int = 1

  def check(self, p: Problems) -> None:
    p.require("actor_lr", positive, "must be > 0")
    p.one_of("schedule", LR_SCHEDULES)
    p.require("warmup_steps", at_least(0), "must be >= 0")
    p.require("grad_clip", positive, "must be > 0")
    p.require("ppo_epochs", at_least(1), "must be >= 1")
    p.require("num_minibatches", at_least(1), "must be >= 1")
    p.require("grad_accum", at_least(1), "must be >= 1")


def learning_rate(optim: OptimConfig, peak_lr: float, total_steps: int, step: int) -> float:
  """The learning rate of every update in training step `step` (0-based) of `total_steps`,
  `optim`'s schedule up to `peak_lr` (its actor_lr or critic_lr).

  As verl, which steps its LR scheduler once per training step: a step that
  makes several updates (mini-batches, thinking-mode turn samples) uses one
  rate for all of them, and warm-up counts steps whatever the update count.
  """
  warmup = optim.warmup_steps
  if optim.schedule == "cosine":
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, max(warmup, 1),
                                                  max(total_steps, warmup + 1))
  elif optim.schedule == "constant":
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, peak_lr, max(warmup, 1)),
         optax.constant_schedule(peak_lr)], [warmup]) if warmup else (lambda _: peak_lr)
  else:
    raise ValueError(f"unknown lr schedule {optim.schedule!r}; expected one of {LR_SCHEDULES}")
  return float(schedule(step))


def make_optimizer(optim: OptimConfig, peak_lr: float) -> optax.GradientTransformation:
  """`optim`'s clipped AdamW, starting at `peak_lr`: its rate is a hyperparameter, which
  `Learner.update` sets to `learning_rate` of each step."""
  learning_rate(optim, peak_lr, 1, 0)  # an unknown schedule fails here, at start-up

  def clipped_adamw(learning_rate):
    return optax.chain(optax.clip_by_global_norm(optim.grad_clip),
                       optax.adamw(learning_rate, weight_decay=optim.weight_decay))

  return optax.inject_hyperparams(clipped_adamw)(learning_rate=peak_lr)


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
