"""The training step (rl/step.py) on its own: learners and samples, no trainer, hosts or user."""

import jax
import numpy as np
import pytest

from models import partitioning, qwen2
from rl import learner, step, updates
from rl.agent import Sample
from rl.losses import RLConfig

MODEL = qwen2.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1,
                          num_heads=4, num_kv_heads=2)


def _samples(count: int) -> list[Sample]:
  """`count` sequences of a 6-token prompt and a 6-token reply, two to a group, one of each
  group's scored 1 and the other 0."""
  rng = np.random.RandomState(0)
  return [Sample(tokens=rng.randint(0, MODEL.vocab_size, 12).tolist(),
                 loss_mask=[0] * 6 + [1] * 6, logprobs=[0.0] * 6 + (-1 - rng.rand(6)).tolist(),
                 reward=float(i % 2), group=i // 2, dialogue=i) for i in range(count)]


@pytest.mark.heavy
def test_a_grpo_step_trains_on_samples_alone_and_lists_the_programs_it_ran():
  mesh = partitioning.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  cfg = RLConfig(algorithm="grpo")
  optim = learner.AdamWConfig(lr=1e-2)
  policy = learner.Learner(qwen2.init_random(MODEL), learner.make_optimizer(optim),
                           updates.policy_loss, cfg, mesh)
  before = jax.device_get(policy.params)
  algorithm = step.AlgorithmStep(policy, None, None, cfg, step.StepConfig(
      ppo_epochs=2, num_minibatches=2, grad_accum=2, policy_optim=optim))
  metrics = algorithm.run(1, _samples(8))
  assert metrics["updates"] == 4 and metrics["samples"] == 8  # 2 epochs x 2 mini-batches
  assert metrics["lr"] == pytest.approx(1e-2) and metrics["skipped_updates"] == 0
  assert np.isfinite(metrics["pg_loss"]) and "value_loss" not in metrics  # GRPO: no critic
  assert not all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(before), jax.tree.leaves(jax.device_get(policy.params))))
  shape = step.StepShape(micro_batch=2, seq_len=32, grad_accum=2, minibatches=4, critic=False)
  assert list(algorithm.programs(shape)) == [
      "policy/gradients", "policy/accumulate_gradients", "policy/apply_gradients"]
