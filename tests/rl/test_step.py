"""The training step (rl/step.py) on its own: learners and samples, no trainer, hosts or user."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import partitioning, qwen2
from models.sampler import Sampler
from models.sampling import SamplingParams
from rl import forward, learner, losses, mismatch, step, updates
from rl.agent import Sample
from rl.batch import TrainBatch
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
  optim = learner.OptimConfig(actor_lr=1e-2, warmup_steps=0, ppo_epochs=2, num_minibatches=2,
                              grad_accum=2)
  policy = learner.Learner(qwen2.init_random(MODEL), learner.make_optimizer(optim, 1e-2),
                           updates.policy_loss, cfg, mesh)
  before = jax.device_get(policy.params)
  algorithm = step.AlgorithmStep(policy, None, None, cfg, step.StepConfig(optim=optim))
  metrics = algorithm.run(1, _samples(8))
  assert metrics["updates"] == 4 and metrics["samples"] == 8  # 2 epochs x 2 mini-batches
  assert metrics["lr"] == pytest.approx(1e-2) and metrics["skipped_updates"] == 0
  assert np.isfinite(metrics["pg_loss"]) and "value_loss" not in metrics  # GRPO: no critic
  assert not all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(before), jax.tree.leaves(jax.device_get(policy.params))))
  shape = step.StepShape(micro_batch=2, seq_len=32, grad_accum=2, minibatches=4, critic=False)
  assert list(algorithm.programs(shape)) == [
      "policy/logprobs", "policy/gradients", "policy/accumulate_gradients",
      "policy/apply_gradients"]


# Peaked logits (a wide initialisation), as a trained model's: where bf16 moves them most.
PEAKED = dataclasses.replace(MODEL, num_layers=2, initializer_range=0.5)


def _sampled(model, sampling_dtype, count: int = 8) -> list[Sample]:
  """`count` replies of 16 tokens the sampler drew (with their log-probs) from `model`."""
  sampler = Sampler(model, stop_token_ids=[PEAKED.vocab_size], sampling_dtype=sampling_dtype)
  prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(count)]
  out = sampler.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0),
                         jax.random.key(0))
  return [Sample(tokens=prompt + list(tokens), loss_mask=[0] * len(prompt) + [1] * len(tokens),
                 logprobs=[0.0] * len(prompt) + list(logprobs), reward=float(i % 2),
                 group=i // 2, dialogue=i)
          for i, (prompt, tokens, logprobs) in enumerate(zip(prompts, out.tokens, out.logprobs))]


def _step_at_unmoved_weights(dtype, sampling_dtype, old_logprobs, correction="none",
                             minibatches=2):
  """The first step's metrics (learning rate 0: every update at the weights that sampled)."""
  mesh = partitioning.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  model = qwen2.init_random(PEAKED, seed=1, dtype=dtype, param_dtype="float32")
  # A clip of 2%: this small model's bf16 gap (|d log p| 0.01 on average, 0.06 at most) then
  # puts tokens outside it, as a 4-layer Qwen2-shaped one's does outside 0.2.
  cfg = RLConfig(algorithm="grpo", old_logprobs=old_logprobs, clip_ratio=0.02,
                 rollout_correction=correction)
  optim = learner.OptimConfig(actor_lr=0.0, warmup_steps=0, num_minibatches=minibatches)
  samples = _sampled(model, sampling_dtype)
  policy = learner.Learner(model, learner.make_optimizer(optim, 0.0), updates.policy_loss, cfg,
                           mesh)
  algorithm = step.AlgorithmStep(policy, None, None, cfg, step.StepConfig(optim=optim))
  return algorithm.run(1, samples)


@pytest.mark.heavy
def test_the_mismatch_is_measured_every_step_nil_in_fp32_and_gone_from_the_ratio_with_learner():
  exact = _step_at_unmoved_weights("float32", None, "sampler")
  assert exact["mismatch/abs_logp_diff_max"] < 1e-5 and exact["mismatch/outside_clip"] == 0
  assert exact["mismatch/probs_pearson"] > 0.99999
  bf16 = _step_at_unmoved_weights("bfloat16", "bfloat16", "sampler")
  assert bf16["mismatch/abs_logp_diff_mean"] > 1e-3, bf16  # the bf16 decode against the pass
  assert bf16["mismatch/abs_logp_diff_p99"] <= bf16["mismatch/abs_logp_diff_max"]
  assert bf16["mismatch/outside_clip"] > 0 and bf16["clip_frac"] > 0  # clipped before moving
  assert bf16["mismatch/first_update_clip_frac"] > 0
  # The ratio against the learner's own log-probs: nothing clipped at unmoved weights.
  learner_old = _step_at_unmoved_weights("bfloat16", "bfloat16", "learner")
  assert learner_old["clip_frac"] == 0 and learner_old["mismatch/outside_clip"] > 0
  assert learner_old["mismatch/first_update_clip_frac"] == 0
  # One update a step: it takes its own log-probs, so its ratio is 1 to the bit.
  own = _step_at_unmoved_weights("bfloat16", "bfloat16", "learner", minibatches=1)
  assert own["ratio_mean"] == 1.0 and own["approx_kl"] == 0.0, own
  assert "mismatch/is_weight_mean" not in learner_old
  # With the truncated IS correction: weights near 1 (nothing past 2 at this gap).
  corrected = _step_at_unmoved_weights("bfloat16", "bfloat16", "learner", "token_tis")
  assert corrected["clip_frac"] == 0 and corrected["mismatch/is_truncated"] == 0
  assert abs(corrected["mismatch/is_weight_mean"] - 1) < 0.05
  assert corrected["mismatch/is_weight_max"] > 1
  assert corrected["pg_loss"] != learner_old["pg_loss"]  # the weights entered the loss


def test_token_tis_needs_the_learners_old_logprobs():
  [problem] = RLConfig(rollout_correction="token_tis").problems()
  assert problem.startswith("old_logprobs='sampler': must be learner with "
                            "rollout_correction=token_tis"), problem
  assert not RLConfig(rollout_correction="token_tis", old_logprobs="learner").problems()


def test_the_mismatch_figures_on_numbers_worked_by_hand():
  sampler_p = np.array([[0.5, 0.5, 0.2, 0.9]])
  learner_p = np.array([[0.5, 0.6, 0.1, 0.1]])  # the last token is not the agent's
  figures = mismatch.measure(np.log(sampler_p), np.log(learner_p), np.array([[1, 1, 1, 0]]),
                             0.2, 0.25)
  diffs = np.abs(np.log([1.0, 1.2, 0.5]))
  assert figures["mismatch/abs_logp_diff_mean"] == pytest.approx(diffs.mean())
  assert figures["mismatch/abs_logp_diff_max"] == pytest.approx(np.log(2))
  assert figures["mismatch/abs_logp_diff_p99"] == pytest.approx(np.quantile(diffs, 0.99))
  assert figures["mismatch/ratio_mean"] == pytest.approx((1.0 + 1.2 + 0.5) / 3)
  assert figures["mismatch/outside_clip"] == pytest.approx(1 / 3)  # 0.5 < 0.8; 1.2 <= 1.25
  assert figures["mismatch/probs_pearson"] == pytest.approx(
      np.corrcoef([0.5, 0.5, 0.2], [0.5, 0.6, 0.1])[0, 1])
  assert mismatch.measure(sampler_p, learner_p, np.zeros((1, 4)), 0.2, 0.2) == {}
  assert mismatch.pearson(np.ones(3), np.ones(3)) == 1.0
  assert mismatch.pearson(np.ones(3), np.arange(3.0)) == 0.0


def test_the_first_updates_rows_take_their_own_logprobs_as_the_old_ones():
  """`old_is_own_b` rows: ratio 1 whatever old log-probs they carry, and the gradient of the
  plain policy gradient -A * grad log p; the other rows keep the batch's old log-probs."""
  model = qwen2.init_random(MODEL, seed=3)
  graphdef, params = nnx.split(model)
  rng = np.random.RandomState(1)
  tokens = rng.randint(0, MODEL.vocab_size, (2, 8)).astype(np.int32)
  mask = np.ones((2, 7), np.float32)
  batch = TrainBatch(tokens_bt=tokens, attention_mask_bt=np.ones((2, 8), bool),
                     loss_mask_bt=mask, old_logprobs_bt=np.full((2, 7), -9.0, np.float32),
                     advantages_bt=rng.randn(2, 7).astype(np.float32),
                     old_is_own_b=np.array([True, False]))
  cfg = RLConfig(algorithm="grpo", old_logprobs="learner", entropy_coef=0.0)
  loss_of = lambda b: lambda p: updates.policy_loss(graphdef, cfg, p, b, None)
  (_, metrics), grads = jax.value_and_grad(loss_of(batch), has_aux=True)(params)
  logprobs = np.asarray(forward.sequence_logprobs(graphdef, params, batch, 1.0))
  ratios = np.concatenate([np.ones(7), np.exp(np.clip(logprobs[1] + 9.0, -20, 20))])
  assert float(metrics["ratio_mean"]) == pytest.approx(ratios.mean(), rel=1e-5)

  def reference(p):  # row 0: -A log p / n (ratio 1, no clip); row 1: the batch's old ones
    lp = forward.sequence_logprobs(graphdef, p, batch, 1.0)
    row0 = -jnp.sum(batch.advantages_bt[0] * lp[0])
    row1, _ = losses.policy_loss(lp[1:], batch.old_logprobs_bt[1:], batch.advantages_bt[1:],
                                 mask[1:], clip_ratio=cfg.clip_ratio)
    return row0 / 14 + row1 * 7 / 14

  expected = jax.grad(reference)(params)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6)
