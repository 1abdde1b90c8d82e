"""Advantages and losses against plain-numpy formulas."""

import numpy as np
import pytest

import rl
from rl import losses
from rl import train_step
from rl.rollout import Sample


def numpy_gae(rewards, values, mask, gamma, lam):
  """verl's multi-turn GAE, written out with loops."""
  b, t = rewards.shape
  adv = np.zeros((b, t))
  for row in range(b):
    next_value, last = 0.0, 0.0
    for i in reversed(range(t)):
      delta = rewards[row, i] + gamma * next_value - values[row, i]
      gae = delta + gamma * lam * last
      if mask[row, i]:
        next_value, last = values[row, i], gae
      adv[row, i] = last
  returns = adv + values
  return adv * mask, returns * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_matches_numpy(gamma, lam):
  rng = np.random.RandomState(0)
  rewards = rng.randn(3, 12) * (rng.rand(3, 12) < 0.3)
  values = rng.randn(3, 12)
  mask = (rng.rand(3, 12) < 0.6).astype(np.float32)
  adv, ret = rl.gae_advantages(rewards, values, mask, gamma, lam)
  ref_adv, ref_ret = numpy_gae(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(adv, ref_adv, atol=1e-5)
  np.testing.assert_allclose(ret, ref_ret, atol=1e-5)


def test_gae_with_unit_discount_gives_reward_to_go_minus_value():
  # Two agent turns separated by a user turn; reward 1 on the last agent token.
  mask = np.array([[1, 1, 0, 0, 1, 1]], np.float32)
  rewards = np.array([[0, 0, 0, 0, 0, 1.0]])
  values = np.array([[0.2, 0.3, 9.0, 9.0, 0.5, 0.7]])  # values on user tokens are ignored
  adv, ret = rl.gae_advantages(rewards, values, mask, 1.0, 1.0)
  np.testing.assert_allclose(adv[0], [0.8, 0.7, 0, 0, 0.5, 0.3], atol=1e-6)
  np.testing.assert_allclose(ret[0], [1, 1, 0, 0, 1, 1], atol=1e-6)


def test_grpo_advantages_match_numpy():
  scores = np.array([0.1, 0.5, 0.9, 0.3, 0.3, 0.8, 0.2])
  groups = np.array([7, 7, 7, 2, 2, 5, 9])
  out = np.asarray(rl.grpo_advantages(scores, groups))
  expected = np.zeros_like(scores)
  for g in np.unique(groups):
    idx = groups == g
    if idx.sum() == 1:
      expected[idx] = scores[idx]  # mean 0, std 1, as verl
    else:
      expected[idx] = (scores[idx] - scores[idx].mean()) / (scores[idx].std(ddof=1) + 1e-6)
  np.testing.assert_allclose(out, expected, atol=1e-5)
  no_std = np.asarray(rl.grpo_advantages(scores, groups, normalize_std=False))
  np.testing.assert_allclose(no_std[:3], scores[:3] - scores[:3].mean(), atol=1e-6)


def test_masked_whiten():
  rng = np.random.RandomState(1)
  x, mask = rng.randn(4, 6), (rng.rand(4, 6) < 0.5).astype(np.float32)
  out = np.asarray(rl.masked_whiten(x, mask))
  sel = x[mask > 0]
  np.testing.assert_allclose(out[mask > 0], (sel - sel.mean()) / sel.std(ddof=1), atol=1e-4)
  assert np.all(out[mask == 0] == 0)


def _arrays(seed=2):
  rng = np.random.RandomState(seed)
  shape = (3, 7)
  old = rng.randn(*shape) * 0.3 - 2
  new = old + rng.randn(*shape) * 0.4
  adv = rng.randn(*shape)
  mask = (rng.rand(*shape) < 0.7).astype(np.float32)
  return new, old, adv, mask


def numpy_agg(loss, mask, mode):
  if mode == "token-mean":
    return (loss * mask).sum() / mask.sum()
  per_seq = (loss * mask).sum(1)
  if mode == "seq-mean-token-mean":
    per_seq = per_seq / mask.sum(1)
  return per_seq.mean()


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_matches_numpy(mode, dual_clip):
  new, old, adv, mask = _arrays()
  loss, metrics = rl.policy_loss(new, old, adv, mask, clip_ratio=0.2, dual_clip=dual_clip,
                                 agg=mode)
  ratio = np.exp(new - old)
  per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.2))
  if dual_clip:
    per_token = np.where(adv < 0, np.minimum(per_token, -adv * dual_clip), per_token)
  np.testing.assert_allclose(loss, numpy_agg(per_token, mask, mode), rtol=1e-5)
  clipped = (-adv * np.clip(ratio, 0.8, 1.2)) > (-adv * ratio)
  np.testing.assert_allclose(metrics["clip_frac"], (clipped * mask).sum() / mask.sum(), rtol=1e-5)


def test_dual_clip_caps_negative_advantage_losses():
  new, old = np.array([[3.0]]), np.array([[0.0]])  # ratio e^3 = 20
  adv, mask = np.array([[-1.0]]), np.array([[1.0]])
  plain, _ = rl.policy_loss(new, old, adv, mask)
  capped, _ = rl.policy_loss(new, old, adv, mask, dual_clip=3.0)
  np.testing.assert_allclose([plain, capped], [np.exp(3.0), 3.0], rtol=1e-5)


def test_value_loss_matches_numpy():
  rng = np.random.RandomState(3)
  values, old, returns = rng.randn(2, 5), rng.randn(2, 5), rng.randn(2, 5)
  mask = np.ones((2, 5), np.float32)
  loss, _ = rl.value_loss(values, old, returns, mask, clip=0.5)
  clipped = old + np.clip(values - old, -0.5, 0.5)
  expected = 0.5 * np.maximum((values - returns) ** 2, (clipped - returns) ** 2).mean()
  np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_entropy_and_kl_estimators():
  logits = np.random.RandomState(4).randn(2, 3, 11)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(rl.entropy_from_logits(logits), -(p * np.log(p)).sum(-1), rtol=1e-5)
  logp, ref = np.array([-1.0, -2.0]), np.array([-1.5, -1.0])
  np.testing.assert_allclose(rl.kl_penalty(logp, ref, "k1"), logp - ref)
  np.testing.assert_allclose(rl.kl_penalty(logp, ref, "k2"), 0.5 * (logp - ref) ** 2)
  np.testing.assert_allclose(rl.kl_penalty(logp, ref, "k3"),
                             np.exp(ref - logp) - (ref - logp) - 1, rtol=1e-6)
  with pytest.raises(ValueError, match="k4"):
    rl.kl_penalty(logp, ref, "k4")


def test_collate_places_masks_and_rewards_on_the_target_grid():
  # prompt (3 tokens), reply (2 tokens), user (2), reply (2): reward on the last reply token.
  sample = Sample(tokens=[10, 11, 12, 20, 21, 30, 31, 22, 23],
                  loss_mask=[0, 0, 0, 1, 1, 0, 0, 1, 1],
                  logprobs=[0, 0, 0, -0.5, -0.6, 0, 0, -0.7, -0.8], reward=0.75, group=0,
                  dialogue=0, token_rewards=[(8, 0.75)])
  batch = train_step.collate([sample], batch_multiple=2)
  assert batch["input_ids"].shape == (2, 32)
  np.testing.assert_array_equal(batch["loss_mask"][0, :8], [0, 0, 1, 1, 0, 0, 1, 1])
  np.testing.assert_allclose(batch["old_logprobs"][0, :8], [0, 0, -0.5, -0.6, 0, 0, -0.7, -0.8])
  assert batch["token_rewards"][0, 7] == 0.75 and batch["token_rewards"].sum() == 0.75
  assert batch["loss_mask"][1].sum() == 0  # filler row


def test_a_non_finite_update_leaves_params_and_optimizer_state_untouched():
  import jax.numpy as jnp
  import optax
  tx = optax.adamw(0.1)
  params = {"w": jnp.ones(3)}
  opt_state = tx.init(params)
  new_params, new_opt, grad_norm, finite = train_step._apply_if_finite(
      jnp.float32(1.0), {"w": jnp.array([1.0, jnp.nan, 0.0])}, params, opt_state, tx)
  assert not bool(finite) and not np.isfinite(grad_norm)
  np.testing.assert_array_equal(new_params["w"], params["w"])
  assert int(new_opt[0].count) == 0
  good_params, _, _, ok = train_step._apply_if_finite(
      jnp.float32(1.0), {"w": jnp.ones(3)}, params, opt_state, tx)
  assert bool(ok) and not np.allclose(good_params["w"], 1.0)


def test_trainer_stops_after_too_many_skipped_updates(monkeypatch, tmp_path):
  from rlver_jax import trainer
  from tests.test_trainer import small_demo
  config = small_demo(tmp_path, max_skipped_updates=1)
  run = trainer.Trainer(config)
  real_update = run.policy.update

  def nan_update(batch):
    metrics = real_update(batch)
    return {**metrics, "finite": np.float32(0.0)}  # as a NaN loss reports it

  monkeypatch.setattr(run.policy, "update", nan_update)
  run.train_step()  # one skipped update is tolerated
  with pytest.raises(trainer.TrainingError, match="2 non-finite updates skipped"):
    run.train_step()


@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_sliced_logprobs_and_entropy_equal_the_full_softmax(chunk):
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from models import qwen2
  config = qwen2.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1,
                             num_heads=4, num_kv_heads=2)
  model = qwen2.init_random(config, seed=0)
  rng = np.random.RandomState(5)
  batch = {"input_ids": jnp.asarray(rng.randint(0, 50, (3, 13)), jnp.int32),
           "attention_mask": jnp.ones((3, 13), bool)}
  graphdef, params = nnx.split(model)
  logprobs, entropy = train_step.token_logprobs_and_entropy(graphdef, params, batch, 0.7, chunk)
  logits = np.asarray(model(batch["input_ids"]))[:, :-1] / 0.7
  full = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  targets = np.asarray(batch["input_ids"])[:, 1:, None]
  np.testing.assert_allclose(logprobs, np.take_along_axis(full, targets, -1)[..., 0], atol=1e-5)
  np.testing.assert_allclose(entropy, -(np.exp(full) * full).sum(-1), atol=1e-4)

  def loss(params, sliced):
    if sliced:
      lp, _ = train_step.token_logprobs_and_entropy(graphdef, params, batch, 0.7, chunk)
    else:
      out = nnx.merge(graphdef, params)(batch["input_ids"])[:, :-1] / 0.7
      lp = losses.token_logprobs(out, batch["input_ids"][:, 1:])
    return lp.sum()

  g_sliced = jax.grad(loss)(params, True)
  g_full = jax.grad(loss)(params, False)
  for a, b in zip(jax.tree.leaves(g_sliced), jax.tree.leaves(g_full)):
    np.testing.assert_allclose(a, b, atol=1e-4)
