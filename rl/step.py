"""The learner programs of one PPO/GRPO training step, in one place.

A training step (`rlver_jax/trainer.py`) runs, after the rollout: the
critic's value pass (PPO) and the reference policy's log-prob pass (with a
KL penalty), each in micro-batches of the update's size; then, for each of
`ppo_epochs x num_minibatches` mini-batches, the policy's and the critic's
updates. A mini-batch of one micro-batch is one program (`update`); with
gradient accumulation (`grad_accum` micro-batches) it is `gradients` per
micro-batch, `accumulate_gradients` between them, and `apply_gradients` once.

`UpdatePrograms` are those jitted programs (a `Learner` runs them), and
`learner_programs` lists them, with abstract arguments of a step's shapes,
for the planner (`rlver_jax/plan.py`): what is planned is what runs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from models import programs
from models.programs import Program
from rl import forward, losses, updates
from rl.batch import TrainBatch
from rl.losses import LossConfig


class UpdatePrograms:
  """One model's jitted update programs (see the module docstring); the old parameters and
  optimizer state are donated."""

  def __init__(self, loss_fn, graphdef, tx, cfg: LossConfig):
    self.update = jax.jit(functools.partial(updates.update, loss_fn, graphdef, tx, cfg),
                          donate_argnums=(0, 1))
    self.gradients = jax.jit(functools.partial(updates.gradients, loss_fn, graphdef, cfg))
    self.accumulate_gradients = jax.jit(updates.add_gradients, donate_argnums=(0,))
    self.apply_gradients = jax.jit(functools.partial(updates.apply_gradients, tx),
                                   donate_argnums=(0, 1))


def forward_program(fn, graphdef, **static):
  """`fn(graphdef, params, batch, **static)` jitted: a pass without gradients."""
  return jax.jit(functools.partial(fn, graphdef, **static))


@dataclasses.dataclass(frozen=True)
class StepShape:
  """The shapes a step's learner programs run at.

  `micro_batch` rows of `seq_len` tokens per micro-batch (the update's, and
  the value and reference passes'); `grad_accum` micro-batches per
  mini-batch; `minibatches` mini-batch updates per step (ppo_epochs x
  num_minibatches); `critic` (PPO) and `reference` (a KL penalty) say which
  models the step has.
  """
  micro_batch: int
  seq_len: int
  grad_accum: int = 1
  minibatches: int = 1
  critic: bool = True
  reference: bool = False


def abstract_batch(mesh: Mesh, shape: StepShape, *, targets: bool) -> TrainBatch:
  """A micro-batch of abstract arrays sharded over the batch axes, with the fields an update
  reads (`TrainBatch.for_update` after the advantages) where `targets`, else only the model
  inputs."""
  rows = lambda dtype, width: programs.rows(mesh, (shape.micro_batch, width), dtype)
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
  work = {"kind": "update", "rows": shape.micro_batch, "tokens": shape.seq_len,
          "model": name}
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
                                   work={**work, "apply": False}),
      # Both gradient sums live only within the step: nothing of its arguments is resident.
      f"{name}/accumulate_gradients": Program(run.accumulate_gradients, (grads, grads), mesh,
                                              calls=shape.minibatches * (shape.grad_accum - 1),
                                              work={"kind": "accumulate", "model": name}),
      f"{name}/apply_gradients": Program(run.apply_gradients, (params, opt, grads, loss, rate),
                                         mesh, resident=resident, calls=shape.minibatches,
                                         work={"kind": "apply", "model": name}),
  }


def learner_programs(policy, critic, reference, shape: StepShape,
                     temperature: float) -> dict[str, Program]:
  """Every learner program of one step, in the order the trainer runs them (`policy`,
  `critic` and `reference` are `Learner`s; the last two None where the step has none)."""
  inputs = lambda learner: abstract_batch(learner.mesh, shape, targets=False)
  passes = shape.minibatches * shape.grad_accum  # micro-batches of the value and ref passes
  out = {}
  if critic is not None:
    out["critic/values"] = Program(
        critic.forward(forward.critic_values), (critic.params, inputs(critic)), critic.mesh,
        resident=critic.params, calls=passes,
        work={"kind": "forward", "rows": shape.micro_batch, "tokens": shape.seq_len,
              "model": "critic"})
  if reference is not None:
    out["reference/logprobs"] = Program(
        reference.forward(forward.sequence_logprobs, temperature=temperature),
        (reference.params, inputs(reference)), reference.mesh, resident=reference.params,
        calls=passes,
        work={"kind": "forward", "rows": shape.micro_batch, "tokens": shape.seq_len})
  out.update(update_programs("policy", policy, shape))
  if critic is not None:
    out.update(update_programs("critic", critic, shape))
  return out
