"""One PPO/GRPO training step after its rollout, and the learner programs it runs.

`AlgorithmStep.run` takes a step's collected samples through the algorithm:
collation into the global batch; the policy's log-prob pass at the step's
starting weights (the sampler-learner mismatch, `rl.mismatch`, and with
`rl.old_logprobs=learner` the ratio's old log-probs), the critic's value pass
(PPO) and the reference policy's log-prob pass (with a KL penalty), each in
micro-batches of the update's size; the advantages; then, for each of `ppo_epochs x
num_minibatches` mini-batches, the policy's and the critic's updates, an
update with a non-finite loss or gradient skipped (too many stop the run);
it returns the step's algorithm metrics. A mini-batch of one micro-batch is
one program (`update`); with gradient accumulation (`grad_accum`
micro-batches) it is `gradients` per micro-batch, `accumulate_gradients`
between them, and `apply_gradients` once (`rl.updates.UpdatePrograms`, which
the `Learner`s run).

`AlgorithmStep.programs` lists those programs, with abstract arguments of a
step's shapes, for the planner (`rlver_jax/plan/`): what is planned is what
runs. The loop around the step (rollouts, the simulator failure guard,
checkpoints) is `rlver_jax/trainer.py`'s, each in a room of its own; what the step needs of the hosts and
of a rollout running beside it comes in as hooks (`collate`, `turns`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh

from infra import host_metrics, programs
from infra.errors import RunStopped
from infra.programs import Program
from models import partitioning
from rl import advantages as advantages_lib
from rl import batch as batch_lib
from rl import forward, learner, losses, mismatch, updates
from rl.batch import TrainBatch
from rl.losses import RLConfig

# How hosts combine the metrics a step adds to its updates' (`updates.UPDATE_METRICS`).
host_metrics.declare({"updates": host_metrics.MEAN, "lr": host_metrics.MEAN,
                      "skipped_updates": host_metrics.SUM, "samples": host_metrics.SUM,
                      "time/train": host_metrics.MAX})


class TrainingError(RunStopped):
  """The run cannot go on: too many non-finite updates, or no dialogue left to train on."""


@dataclasses.dataclass(frozen=True)
class StepShape:
  """The shapes a step's learner programs run at.

  `micro_batch` rows of `seq_len` tokens per micro-batch (the update's, and
  the value and reference passes'); `grad_accum` micro-batches per
  mini-batch; `minibatches` mini-batch updates per step (ppo_epochs x
  num_minibatches); `critic` (PPO) and `reference` (a KL penalty) say which
  models the step has; `is_weights`, whether the policy's updates read the rollout
  correction's weights; `old_is_own`, whether they read which rows take their own log-probs
  as the old ones (`rl.old_logprobs=learner`).
  """
  micro_batch: int
  seq_len: int
  grad_accum: int = 1
  minibatches: int = 1
  critic: bool = True
  reference: bool = False
  is_weights: bool = False
  old_is_own: bool = False


def abstract_batch(mesh: Mesh, shape: StepShape, *, targets: bool) -> TrainBatch:
  """A micro-batch of abstract arrays sharded over the batch axes, with the fields an update
  reads (`TrainBatch.for_update` after the advantages) where `targets`, else only the model
  inputs."""
  rows = lambda dtype, width: partitioning.abstract_rows(mesh, (shape.micro_batch, width), dtype)
  batch = TrainBatch(tokens_bt=rows(jnp.int32, shape.seq_len),
                     attention_mask_bt=rows(jnp.bool_, shape.seq_len))
  if not targets:
    return batch
  target = lambda: rows(jnp.float32, shape.seq_len - 1)
  batch = batch.replace(loss_mask_bt=target(), old_logprobs_bt=target(),
                        advantages_bt=target(), returns_bt=target())
  if shape.critic:
    batch = batch.replace(old_values_bt=target())
  if shape.reference:
    batch = batch.replace(ref_logprobs_bt=target())
  if shape.is_weights:
    batch = batch.replace(is_weights_bt=target())
  if shape.old_is_own:
    batch = batch.replace(
        old_is_own_b=partitioning.abstract_rows(mesh, (shape.micro_batch,), jnp.bool_))
  return batch


def _normaliser(mesh: Mesh) -> losses.Normaliser:
  scalar = programs.replicated(mesh, (), jnp.float32)
  return losses.Normaliser(tokens=scalar, sequences=scalar)


def update_programs(name: str, learner, shape: StepShape) -> dict[str, Program]:
  """`learner`'s update programs (an `rl.learner.Learner`, abstract or not) as one step
  runs them: `name/update`, or `name/gradients`, `name/accumulate_gradients` and
  `name/apply_gradients` with gradient accumulation."""
  mesh, run = learner.mesh, learner.programs
  params, opt = learner.params, learner.opt_state
  batch = abstract_batch(mesh, shape, targets=True)
  rate = jax.ShapeDtypeStruct((), jnp.float32, weak_type=True)
  resident = (params, opt)
  work = programs.Update(rows=shape.micro_batch, tokens=shape.seq_len, model=name)
  if shape.grad_accum == 1:
    return {f"{name}/update": Program(run.update, (params, opt, batch, _normaliser(mesh), rate),
                                      mesh, resident=resident, calls=shape.minibatches,
                                      work=work)}
  (loss, _), grads = jax.eval_shape(run.gradients, params, batch, _normaliser(mesh))
  # As the gradient program leaves them: placed like the parameters.
  grads = jax.tree.map(lambda g, p: jax.ShapeDtypeStruct(g.shape, g.dtype, sharding=p.sharding),
                       grads, params)
  loss = programs.replicated(mesh, (), loss.dtype)
  return {
      f"{name}/gradients": Program(run.gradients, (params, batch, _normaliser(mesh)), mesh,
                                   resident=params,
                                   calls=shape.minibatches * shape.grad_accum,
                                   work=dataclasses.replace(work, apply=False)),
      # Both gradient sums live only within the step: nothing of its arguments is resident.
      f"{name}/accumulate_gradients": Program(run.accumulate_gradients, (grads, grads), mesh,
                                              calls=shape.minibatches * (shape.grad_accum - 1),
                                              work=programs.AccumulateGradients(name)),
      f"{name}/apply_gradients": Program(run.apply_gradients, (params, opt, grads, loss, rate),
                                         mesh, resident=resident, calls=shape.minibatches,
                                         work=programs.ApplyGradients(name)),
  }


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """How a step makes its updates (verl's names where verl has them).

  `optim` (the `optim` section, `rl.learner.OptimConfig`): `ppo_epochs` passes over
  `num_minibatches` mini-batches of `grad_accum` micro-batches, at learning rates that follow
  its schedule by training step, of `total_steps` (the run's steps). A batch has a multiple
  of `data_parallel` (the training mesh's batch shards) x grad_accum x num_minibatches rows,
  so that it splits evenly. With `thinking` every agent turn is a sample, many per dialogue:
  mini-batches hold the step's `dialogues` (its dialogue count) over num_minibatches samples,
  as the release's ppo_mini_batch_size, so a step makes as many updates as the release's.
  More than `max_skipped_updates` non-finite updates in the run stop it. The value and
  reference passes score tokens under the sampler's `temperature`, as the policy's loss does.
  """
  optim: learner.OptimConfig = learner.OptimConfig()
  total_steps: int = 1
  data_parallel: int = 1
  thinking: bool = False
  dialogues: int = 0
  max_skipped_updates: int = 0
  temperature: float = 1.0

  @property
  def micro_multiple(self) -> int:
    """The rows of a micro-batch are a multiple of this: it splits over the batch shards."""
    return self.data_parallel * self.optim.grad_accum


class _Alone:
  """The devices to the step alone, no rollout running beside it: a turn is free and nothing
  waits (`rlver_jax.off_policy.DeviceTurns` shares them with one)."""

  def turn(self):
    return contextlib.nullcontext()

  def settle(self, *values) -> None:
    del values


class AlgorithmStep:
  """The PPO/GRPO step of the `policy`, `critic` (PPO) and `reference` (a KL penalty)
  `Learner`s, the last two None where the step has none, and the programs it runs.

  `collate(samples, batch_multiple)` makes the global `TrainBatch` of this
  host's samples (`rl.batch.collate` on one host); `turns` hands the step the
  devices in turns where a rollout runs beside it (`turn()`, a context, and
  `settle(*values)`, which waits for them). `skipped_updates` counts the run's
  non-finite updates (a checkpoint keeps it).
  """

  def __init__(self, policy, critic, reference, loss_cfg: RLConfig,
               config: StepConfig = StepConfig(), *, collate=batch_lib.collate,
               turns=_Alone()):
    self.policy, self.critic, self.reference = policy, critic, reference
    self.loss_cfg, self.config = loss_cfg, config
    self.collate, self.turns = collate, turns
    self.skipped_updates = 0

  def run(self, step: int, samples: Sequence[batch_lib.Sample]) -> dict:
    """Trains on this host's `samples` of training step `step` (1-based); returns the step's
    algorithm metrics, this host's."""
    start = time.perf_counter()
    with self.turns.turn():  # on several devices, a rollout's turns come between these
      batch, mismatch_metrics = self._scored_batch(samples)
    # old_logprobs_bt are the sampler's log-probs of the tokens it drew: the behaviour policy's,
    # also when it is a step behind (off_policy_steps=1), so the losses' ratio corrects for it.
    minibatches = self._minibatches(batch.for_update(), len(samples))
    c, o = self.config, self.config.optim
    policy_lr = learner.learning_rate(o, o.actor_lr, c.total_steps, step - 1)
    critic_lr = (learner.learning_rate(o, o.critic_lr, c.total_steps, step - 1) if self.critic
                 else None)
    update_metrics = self._update(minibatches, policy_lr, critic_lr)
    train_seconds = time.perf_counter() - start
    skipped = self._skip_non_finite(step, update_metrics)
    finite = [m for m in update_metrics if m["finite"] >= 1] or update_metrics
    # A metric the step's losses do not make (GRPO's value loss, the dual clip's share
    # without a dual clip) is absent, not 0.
    out = {key: float(np.mean([m[key] for m in finite]))
           for key in updates.UPDATE_METRICS if key in finite[0]}
    out.update({"updates": len(update_metrics), "lr": policy_lr, "skipped_updates": skipped,
                "time/train": train_seconds, "samples": len(samples), **mismatch_metrics})
    if mismatch_metrics:  # the trust region the mismatch costs before any update moved
      out[mismatch.FIRST_UPDATE_CLIP_FRAC] = float(update_metrics[0]["clip_frac"])
    return out

  def _scored_batch(self, samples: Sequence[batch_lib.Sample]) -> tuple[TrainBatch, dict]:
    """The global batch with the critic's values, the reference log-probs and advantages,
    and the sampler-learner mismatch (`rl.mismatch`; {} without the policy's pass). The
    policy's, value and reference passes run in micro-batches of the update's rows; with
    `rl.old_logprobs=learner` the policy's log-probs become the ratio's old ones."""
    c, o, cfg = self.config, self.config.optim, self.loss_cfg
    batch = self.collate(samples, c.micro_multiple * o.num_minibatches)
    micro_rows = batch.rows // (o.num_minibatches * o.grad_accum)
    mismatch_metrics = {}
    if cfg.learner_logprobs_pass:
      learner_logprobs_bt = self.policy.apply_in_micro_batches(
          forward.sequence_logprobs, batch, micro_rows, temperature=c.temperature)
      mismatch_metrics = mismatch.measure(batch.old_logprobs_bt, learner_logprobs_bt,
                                          batch.loss_mask_bt, *cfg.clip_range)
      if cfg.weights_policy_loss:  # token_tis, the one correction
        is_weights_bt, is_metrics = mismatch.truncated_is_weights(
            batch.old_logprobs_bt, learner_logprobs_bt, batch.loss_mask_bt,
            cfg.rollout_is_threshold)
        batch = batch.replace(is_weights_bt=is_weights_bt)
        mismatch_metrics.update(is_metrics)
      if cfg.old_logprobs == "learner":
        batch = batch.replace(old_logprobs_bt=learner_logprobs_bt)
    if self.critic is not None:
      batch = batch.replace(old_values_bt=self.critic.apply_in_micro_batches(
          forward.critic_values, batch, micro_rows))
    if self.reference is not None:
      batch = batch.replace(ref_logprobs_bt=self.reference.apply_in_micro_batches(
          forward.sequence_logprobs, batch, micro_rows, temperature=self.config.temperature))
    return advantages_lib.compute_advantages(batch, self.loss_cfg), mismatch_metrics

  def _minibatches(self, batch: TrainBatch, real_rows: int) -> list[TrainBatch]:
    """One epoch's mini-batches: `num_minibatches` equal ones, or in thinking mode the first
    `real_rows` (this host's samples) in mini-batches of the step's dialogue count."""
    c, o = self.config, self.config.optim
    if not c.thinking:
      return batch_lib.split(batch, o.num_minibatches)
    return batch_lib.chunks(batch.select_rows(0, real_rows),
                            -(-c.dialogues // o.num_minibatches), c.micro_multiple)

  def _update(self, minibatches: list[TrainBatch], policy_lr: float,
              critic_lr: float | None) -> list[dict]:
    """`ppo_epochs` passes of policy (and critic) updates over `minibatches`; each update's
    metrics, fetched from the device once at the end."""
    policy, critic, turns = self.policy, self.critic, self.turns
    update_metrics = []
    for epoch in range(self.config.optim.ppo_epochs):
      for index, minibatch in enumerate(minibatches):
        if self.loss_cfg.first_update_takes_own_logprobs:  # its weights alone are unmoved
          minibatch = minibatch.replace(
              old_is_own_b=np.full(minibatch.rows, epoch == index == 0, np.bool_))
        micro_batches = batch_lib.split(minibatch, self.config.optim.grad_accum)
        with turns.turn():
          m = policy.update(micro_batches, learning_rate=policy_lr)
          if critic is not None:
            m.update(critic.update(micro_batches, learning_rate=critic_lr))
          turns.settle(m, policy.params, critic.params if critic is not None else None)
        update_metrics.append(m)
    return jax.device_get(update_metrics)  # the one wait for the device this step

  def _skip_non_finite(self, step: int, update_metrics: list[dict]) -> int:
    """This step's updates with a non-finite loss or gradient (the update left the weights as
    they were), counted into `skipped_updates`; TrainingError past `max_skipped_updates`."""
    skipped = sum(1 for m in update_metrics
                  if m["finite"] < 1 or m.get("critic_finite", 1.0) < 1)
    if skipped:
      self.skipped_updates += skipped
      logging.warning("step %d: %d update(s) with non-finite loss or gradient skipped "
                      "(%d so far)", step, skipped, self.skipped_updates)
      if self.skipped_updates > self.config.max_skipped_updates:
        raise TrainingError(f"{self.skipped_updates} non-finite updates skipped, more than "
                            f"max_skipped_updates={self.config.max_skipped_updates}; stopping")
    return skipped

  def programs(self, shape: StepShape) -> dict[str, Program]:
    """Every learner program of one step at `shape`, in the order `run` runs them, with
    abstract arguments (the learners may be abstract: `Learner.abstract`)."""
    policy, critic, reference = self.policy, self.critic, self.reference
    inputs = lambda model: abstract_batch(model.mesh, shape, targets=False)
    passes = shape.minibatches * shape.grad_accum  # micro-batches of the value and ref passes
    pass_work = lambda model: programs.Forward(rows=shape.micro_batch, tokens=shape.seq_len,
                                               model=model)
    out = {}
    if self.loss_cfg.learner_logprobs_pass:
      out["policy/logprobs"] = Program(
          policy.forward(forward.sequence_logprobs, temperature=self.config.temperature),
          (policy.params, inputs(policy)), policy.mesh, resident=policy.params, calls=passes,
          work=pass_work("policy"))
    if critic is not None:
      out["critic/values"] = Program(
          critic.forward(forward.critic_values), (critic.params, inputs(critic)), critic.mesh,
          resident=critic.params, calls=passes,
          work=pass_work("critic"))
    if reference is not None:
      out["reference/logprobs"] = Program(
          reference.forward(forward.sequence_logprobs, temperature=self.config.temperature),
          (reference.params, inputs(reference)), reference.mesh, resident=reference.params,
          calls=passes,
          work=pass_work("reference"))
    out.update(update_programs("policy", policy, shape))
    if critic is not None:
      out.update(update_programs("critic", critic, shape))
    return out
