"""Advantages and losses against plain-numpy formulas."""

import jax
import numpy as np
import pytest

import rl
from rl import advantages, forward, learner, losses, mismatch, updates
from rl import batch as batch_lib
from rl.batch import Sample, TrainBatch
from rl.losses import RLConfig


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


def test_reply_gae_takes_each_reply_as_one_step():
  # Two replies: each reply's reward is its tokens' sum, its value its first token's.
  mask = np.array([[1, 1, 0, 0, 1, 1, 1, 0]], np.float32)
  rewards = np.array([[0, 0.5, 0, 0, 0, 0.25, 1.0, 0]])
  values = np.array([[0.2, 0.3, 9.0, 9.0, 0.5, 0.7, 0.1, 9.0]])
  adv, ret = advantages.reply_gae_advantages(rewards, values, mask, 1.0, 1.0)
  # Reply 1: 0.5 + (1.25) - 0.2 = 1.55; reply 2: 1.25 - 0.5 = 0.75, on each of their tokens.
  np.testing.assert_allclose(adv[0], [1.55, 1.55, 0, 0, 0.75, 0.75, 0.75, 0], atol=1e-6)
  np.testing.assert_allclose(ret[0], [1.75, 1.75, 0, 0, 1.25, 1.25, 1.25, 0], atol=1e-6)
  gamma, lam = 0.9, 0.5
  adv, _ = advantages.reply_gae_advantages(rewards, values, mask, gamma, lam)
  late = 1.25 - 0.5
  early = 0.5 + gamma * 0.5 - 0.2 + gamma * lam * late
  np.testing.assert_allclose(adv[0], [early] * 2 + [0, 0] + [late] * 3 + [0], atol=1e-6)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_reply_gae_of_one_token_replies_is_token_gae(gamma, lam):
  rng = np.random.RandomState(1)
  mask = np.zeros((3, 12), np.float32)
  mask[:, ::2] = rng.rand(3, 6) < 0.7  # replies of one token, a user token between
  rewards, values = rng.randn(3, 12) * mask, rng.randn(3, 12)
  for got, want in zip(advantages.reply_gae_advantages(rewards, values, mask, gamma, lam),
                       rl.gae_advantages(rewards, values, mask, gamma, lam)):
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_gae_unit_picks_the_estimator_and_is_checked():
  samples = [_sample(5, 1.0, 0), _sample(3, 0.0, 1)]
  batch = batch_lib.collate(samples)
  batch = batch.replace(old_values_bt=np.linspace(
      0, 1, batch.loss_mask_bt.size, dtype=np.float32).reshape(batch.loss_mask_bt.shape))
  out = advantages.compute_advantages(batch, RLConfig(gae_unit="reply", whiten_advantages=False))
  want, _ = advantages.reply_gae_advantages(batch.token_rewards_bt, batch.old_values_bt,
                                            batch.loss_mask_bt)
  np.testing.assert_allclose(out.advantages_bt, want, atol=1e-6)
  assert RLConfig(gae_unit="turn").problems() == [
      "gae_unit='turn': expected one of ('token', 'reply')"]
  assert tuple(advantages.GAE_BY_UNIT) == losses.GAE_UNITS


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


def _sample(length, reward, group):
  """A prompt token, then `length` agent tokens scored `reward`."""
  return Sample(tokens=list(range(1, length + 2)), loss_mask=[0] + [1] * length,
                logprobs=[0.0] + [-1.0] * length, reward=reward, group=group, dialogue=0,
                token_rewards=[(length, reward)])


def test_grpo_advantages_are_not_whitened_across_the_batch():
  # Group 0: a long high-scoring dialogue and a short low one; group 1: three short ones.
  # Whitening over the batch's tokens subtracts a mean that the long dialogue dominates,
  # which turned group 1's above-average second dialogue negative.
  samples = [_sample(40, 1.0, 0), _sample(2, 0.0, 0), _sample(2, 0.6, 1), _sample(2, 0.5, 1),
             _sample(2, 0.1, 1)]
  batch = batch_lib.collate(samples)
  out = advantages.compute_advantages(batch, RLConfig(algorithm="grpo"))
  assert RLConfig().whiten_advantages  # on by default, for GAE only
  expected = np.zeros(len(samples))  # verl's compute_grpo_outcome_advantage
  for group in (0, 1):
    scores = np.array([s.reward for s in samples if s.group == group])
    rows = [i for i, s in enumerate(samples) if s.group == group]
    expected[rows] = (scores - scores.mean()) / (scores.std(ddof=1) + 1e-6)
  assert expected[3] > 0 and np.all(out.advantages_bt[3][batch.loss_mask_bt[3] > 0] > 0)
  np.testing.assert_allclose(out.advantages_bt, expected[:, None] * batch.loss_mask_bt, atol=1e-5)


def test_each_algorithm_takes_its_estimator_from_the_registry(monkeypatch):
  assert set(advantages.ADV_ESTIMATORS) == {"gae", "grpo"}  # verl's names
  for algorithm in losses.ALGORITHMS:
    estimator = RLConfig(algorithm=algorithm).adv_estimator
    assert advantages.get_adv_estimator_fn(estimator) is advantages.ADV_ESTIMATORS[estimator]
  with pytest.raises(ValueError, match=r"unknown advantage estimator 'rloo'; expected one of "
                     r"\['gae', 'grpo'\]"):
    advantages.get_adv_estimator_fn("rloo")
  with pytest.raises(ValueError, match="'gae' is registered twice"):
    advantages.register_adv_est("gae")(advantages.gae_batch)
  # A registered estimator is what compute_advantages runs for its name.
  batch = batch_lib.collate([_sample(3, 1.0, 0)])
  monkeypatch.setitem(advantages.ADV_ESTIMATORS, "gae", lambda b, cfg: b.replace(
      advantages_bt=np.full(b.loss_mask_bt.shape, 7.0, np.float32)))
  assert np.all(advantages.compute_advantages(batch, RLConfig()).advantages_bt == 7.0)


def test_the_losses_take_their_variants_and_the_config_its_names_from_the_registries(
    monkeypatch):
  # verl's names for the modes and the policy loss; Schulman's (which verl accepts) for KL.
  assert list(losses.AGGREGATIONS) == ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
  assert list(losses.KL_ESTIMATORS) == ["k1", "k2", "k3"]
  assert losses.get_policy_loss_fn("vanilla") is losses.policy_loss
  assert RLConfig(kl_estimator="low_var_kl", policy_loss="gspo").problems() == [
      "kl_estimator='low_var_kl': expected one of ('k1', 'k2', 'k3')",
      "policy_loss='gspo': expected one of ('vanilla',)"]
  with pytest.raises(ValueError, match=r"unknown loss aggregation 'sum'; expected one of "
                     r"\['token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean'\]"):
    rl.aggregate(np.ones((1, 2)), np.ones((1, 2)), "sum")
  with pytest.raises(ValueError, match="policy loss 'vanilla' is registered twice"):
    losses.register_policy_loss("vanilla")(losses.policy_loss)
  # A variant a peer registers is one the config accepts and the losses run.
  monkeypatch.setitem(losses.KL_ESTIMATORS, "abs", abs)
  monkeypatch.setitem(losses.AGGREGATIONS, "sum", lambda loss_bt, mask_bt, norm: (
      (loss_bt * mask_bt).sum()))
  assert RLConfig(kl_estimator="abs", loss_agg="sum").problems() == []
  logp, ref = np.array([[-1.0, -2.0]]), np.array([[-1.5, -1.0]])
  np.testing.assert_allclose(rl.kl_penalty(logp, ref, "abs"), [[0.5, 1.0]])
  assert float(rl.aggregate(logp, np.array([[1, 0]]), "sum")) == -1.0


def test_gae_advantages_are_whitened():
  samples = [_sample(5, 1.0, 0), _sample(3, 0.0, 1)]
  batch = batch_lib.collate(samples)
  batch = batch.replace(old_values_bt=np.full(batch.loss_mask_bt.shape, 0.25, np.float32))
  out = advantages.compute_advantages(batch, RLConfig())
  raw, _ = rl.gae_advantages(batch.token_rewards_bt, batch.old_values_bt, batch.loss_mask_bt)
  np.testing.assert_allclose(out.advantages_bt, rl.masked_whiten(raw, batch.loss_mask_bt),
                             atol=1e-5)


def _arrays(seed=2):
  rng = np.random.RandomState(seed)
  shape = (3, 7)
  old = rng.randn(*shape) * 0.3 - 2
  new = old + rng.randn(*shape) * 0.4
  adv = rng.randn(*shape)
  mask = (rng.rand(*shape) < 0.7).astype(np.float32)
  return new, old, adv, mask


def verl_agg_loss(loss, mask, mode, tokens=None, sequences=None):
  """verl's agg_loss; `tokens` / `sequences` are the global denominators it may be given."""
  if mode == "token-mean":
    return (loss * mask).sum() / (mask.sum() if tokens is None else tokens)
  has_tokens = mask.sum(1) > 0
  per_seq = (loss * mask).sum(1)
  if mode == "seq-mean-token-mean":
    per_seq = per_seq / np.maximum(mask.sum(1), 1e-8)
  return per_seq[has_tokens].sum() / (has_tokens.sum() if sequences is None else sequences)


def verl_policy_loss(new, old, adv, mask, mode, clip=0.2, clip_ratio_c=3.0):
  """verl's compute_policy_loss (dual clip), written out.

  Returns (loss, clipfrac, kl, clipfrac_lower, per-token loss).
  """
  log_ratio = np.clip(new - old, -20.0, 20.0)
  ratio = np.exp(log_ratio)
  losses1 = -adv * ratio
  losses2 = -adv * np.clip(ratio, 1 - clip, 1 + clip)
  clip_losses1 = np.maximum(losses1, losses2)
  clipfrac = ((losses2 > losses1) * mask).sum() / mask.sum()
  losses3 = -adv * clip_ratio_c
  clipfrac_lower = ((clip_losses1 > losses3) * (adv < 0) * mask).sum() / mask.sum()
  per_token = np.where(adv < 0, np.minimum(losses3, clip_losses1), clip_losses1)
  return (verl_agg_loss(per_token, mask, mode), clipfrac, (-log_ratio * mask).sum() / mask.sum(),
          clipfrac_lower, per_token)


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_token_tis_matches_verls_rollout_correction(mode):
  """verl's rollout correction at token level: w = min(exp(old - rollout), threshold), from
  the log-probs, detached; the per-token policy loss (after the dual clip) times w."""
  new, old, adv, mask = _arrays()
  rollout = old + np.random.RandomState(5).randn(*old.shape) * 0.8  # some w past 2
  weights, figures = mismatch.truncated_is_weights(rollout, old, mask, threshold=2.0)
  reference_w = np.minimum(np.exp(np.clip(old - rollout, -20, 20)), 2.0)
  np.testing.assert_allclose(weights, reference_w * (mask > 0), rtol=1e-6)
  loss, _ = rl.policy_loss(new, old, adv, mask, clip_ratio=0.2, agg=mode, is_weights=weights)
  *_, per_token = verl_policy_loss(new, old, adv, mask, mode)
  np.testing.assert_allclose(loss, verl_agg_loss(per_token * reference_w, mask, mode),
                             rtol=1e-5)
  raw = np.exp(old - rollout)[mask > 0]
  assert figures["mismatch/is_truncated"] == pytest.approx(np.mean(raw > 2.0))
  assert figures["mismatch/is_truncated"] > 0
  assert figures["mismatch/is_weight_max"] == pytest.approx(raw.max())
  assert figures["mismatch/is_weight_mean"] == pytest.approx(np.minimum(raw, 2.0).mean())
  # Detached, as verl's: no gradient flows into the weights.
  to_weights = jax.grad(lambda w: rl.policy_loss(new, old, adv, mask, agg=mode,
                                                 is_weights=w)[0])(weights)
  assert not np.any(to_weights)


def verl_value_loss(values, old, returns, mask, clip, mode="token-mean"):
  """verl's compute_value_loss: (loss, vf_clipfrac)."""
  clipped = np.clip(values, old - clip, old + clip)
  losses1, losses2 = (values - returns) ** 2, (clipped - returns) ** 2
  clipfrac = ((losses2 > losses1) * mask).sum() / mask.sum()
  return 0.5 * verl_agg_loss(np.maximum(losses1, losses2), mask, mode), clipfrac


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
@pytest.mark.parametrize("log_ratio_scale", [0.4, 3.0])
def test_policy_loss_matches_verl(mode, log_ratio_scale):
  new, old, adv, mask = _arrays()
  new = old + (new - old) / 0.4 * log_ratio_scale  # 3.0: many ratios past the dual clip
  loss, metrics = rl.policy_loss(new, old, adv, mask, clip_ratio=0.2, agg=mode)
  ref_loss, clipfrac, kl, clipfrac_lower, _ = verl_policy_loss(new, old, adv, mask, mode)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(metrics["clip_frac"], clipfrac, rtol=1e-5)
  np.testing.assert_allclose(metrics["approx_kl"], kl, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(metrics["pg_clipfrac_lower"], clipfrac_lower, rtol=1e-5, atol=1e-7)
  if log_ratio_scale > 1:
    assert metrics["pg_clipfrac_lower"] > 0


def test_dual_clip_is_on_by_default_at_3_and_can_be_turned_off():
  new, old = np.array([[3.0]]), np.array([[0.0]])  # ratio e^3 = 20
  adv, mask = np.array([[-1.0]]), np.array([[1.0]])
  plain, plain_metrics = rl.policy_loss(new, old, adv, mask, dual_clip=None)
  capped, capped_metrics = rl.policy_loss(new, old, adv, mask)
  np.testing.assert_allclose([plain, capped], [np.exp(3.0), 3.0], rtol=1e-5)
  assert "pg_clipfrac_lower" not in plain_metrics and capped_metrics["pg_clipfrac_lower"] == 1.0
  assert RLConfig().dual_clip == 3.0
  assert [line for line in RLConfig(dual_clip=1.0).problems() if "dual_clip=1.0: " in line]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_log_ratio_of_100_gives_finite_losses_and_gradients(sign):
  import jax
  old = np.zeros((2, 3), np.float32)
  new = old + sign * np.array([[100.0, 95.0, 0.1], [100.0, 90.0, -0.1]], np.float32)
  adv = np.array([[1.0, -1.0, 0.5], [-2.0, 2.0, 1.0]], np.float32)
  mask = np.ones_like(old)
  for dual_clip in (None, 3.0):
    loss_fn = lambda lp: rl.policy_loss(lp, old, adv, mask, dual_clip=dual_clip)[0]
    loss, grad = jax.value_and_grad(loss_fn)(new)
    assert np.isfinite(loss) and np.all(np.isfinite(grad)), (dual_clip, loss, grad)
  for estimator in ("k1", "k2", "k3"):
    kl, grad = jax.value_and_grad(lambda lp: rl.kl_penalty(lp, old, estimator).sum())(new)
    assert np.isfinite(kl) and np.all(np.isfinite(grad)), (estimator, kl, grad)
  # The clamp at +-20 is verl's: the k3 estimate is 10 (its own clip) past it.
  np.testing.assert_allclose(rl.kl_penalty(new, old, "k3")[0, :2], [10.0, 10.0])


def test_value_loss_matches_verl():
  rng = np.random.RandomState(3)
  values, old, returns = rng.randn(4, 50), rng.randn(4, 50), rng.randn(4, 50)
  mask = (rng.rand(4, 50) < 0.8).astype(np.float32)
  for mode in losses.AGGREGATIONS:
    loss, metrics = rl.value_loss(values, old, returns, mask, clip=0.5, agg=mode)
    ref_loss, clipfrac = verl_value_loss(values, old, returns, mask, 0.5, mode)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["value_clip_frac"], clipfrac, rtol=1e-5)
  assert 0 < metrics["value_clip_frac"] < 1


def test_an_unclipped_value_loss_reports_no_clip_fraction():
  values, returns = np.array([[0.0, 2.0]]), np.array([[1.0, 1.0]])
  loss, metrics = rl.value_loss(values, values, returns, np.ones((1, 2)), clip=None)
  assert float(loss) == 0.5 and metrics == {}  # absent, not 0


def test_value_clip_frac_counts_no_value_inside_the_clip_band():
  # old + clip(v - old, +-c) rounds v in float32, and (rounded - R)^2 > (v - R)^2 then
  # counted about 1.4% of these tokens as clipped; none of them is.
  rng = np.random.RandomState(4)
  old = rng.randn(64, 256).astype(np.float32)
  values = (old + rng.uniform(-0.49, 0.49, old.shape)).astype(np.float32)
  returns = rng.randn(*old.shape).astype(np.float32)
  mask = np.ones_like(old)
  loss, metrics = rl.value_loss(values, old, returns, mask, clip=0.5)
  assert float(metrics["value_clip_frac"]) == 0.0
  np.testing.assert_allclose(loss, 0.5 * ((values - returns) ** 2).mean(), rtol=1e-5)


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


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_micro_batch_losses_normalised_by_the_mini_batch_add_up_to_its_loss(mode):
  new, old, adv, mask = _arrays(seed=6)
  mask[2] = 0  # a sequence without loss tokens counts in no denominator
  norm = losses.normaliser(mask)
  assert (norm.tokens, norm.sequences) == (mask.sum(), 2)
  per_token = verl_policy_loss(new, old, adv, mask, mode)[4]
  whole, whole_metrics = rl.policy_loss(new, old, adv, mask, agg=mode)
  parts = []
  for rows in (slice(0, 1), slice(1, 3)):
    part = rl.policy_loss(new[rows], old[rows], adv[rows], mask[rows], agg=mode, norm=norm)
    # verl's agg_loss given the mini-batch's token / sequence counts
    np.testing.assert_allclose(part[0], verl_agg_loss(per_token[rows], mask[rows], mode,
                                                      tokens=mask.sum(), sequences=2), rtol=1e-5)
    parts.append(part)
  np.testing.assert_allclose(sum(loss for loss, _ in parts), whole, rtol=1e-5)
  for key, value in whole_metrics.items():
    np.testing.assert_allclose(sum(m[key] for _, m in parts), value, rtol=1e-5, atol=1e-7)


def test_collate_places_masks_and_rewards_on_the_target_grid():
  # prompt (3 tokens), reply (2 tokens), user (2), reply (2): reward on the last reply token.
  sample = Sample(tokens=[10, 11, 12, 20, 21, 30, 31, 22, 23],
                  loss_mask=[0, 0, 0, 1, 1, 0, 0, 1, 1],
                  logprobs=[0, 0, 0, -0.5, -0.6, 0, 0, -0.7, -0.8], reward=0.75, group=0,
                  dialogue=0, token_rewards=[(8, 0.75)])
  batch = batch_lib.collate([sample], batch_multiple=2)
  assert batch.tokens_bt.shape == (2, 32)
  np.testing.assert_array_equal(batch.loss_mask_bt[0, :8], [0, 0, 1, 1, 0, 0, 1, 1])
  np.testing.assert_allclose(batch.old_logprobs_bt[0, :8], [0, 0, -0.5, -0.6, 0, 0, -0.7, -0.8])
  assert batch.token_rewards_bt[0, 7] == 0.75 and batch.token_rewards_bt.sum() == 0.75
  assert batch.loss_mask_bt[1].sum() == 0  # filler row


def test_a_non_finite_update_leaves_params_and_optimizer_state_untouched():
  import jax.numpy as jnp
  import optax
  tx = optax.adamw(0.1)
  params = {"w": jnp.ones(3)}
  opt_state = tx.init(params)
  new_params, new_opt, grad_norm, finite = updates.apply_gradients(
      tx, params, opt_state, {"w": jnp.array([1.0, jnp.nan, 0.0])}, jnp.float32(1.0))
  assert not bool(finite) and not np.isfinite(grad_norm)
  np.testing.assert_array_equal(new_params["w"], params["w"])
  assert int(new_opt[0].count) == 0
  good_params, _, _, ok = updates.apply_gradients(
      tx, params, opt_state, {"w": jnp.ones(3)}, jnp.float32(1.0))
  assert bool(ok) and not np.allclose(good_params["w"], 1.0)


@pytest.mark.heavy
def test_trainer_stops_after_too_many_skipped_updates(monkeypatch, tmp_path):
  """A whole trainer (its compiles: most of its minute on 2 cores) is what decides to stop."""
  from rlver_jax import trainer
  from tests.runs import small_demo
  config = small_demo(tmp_path, max_skipped_updates=1,  # 1 update a step
                      **{"optim.ppo_epochs": 1, "optim.num_minibatches": 1})
  run = trainer.Trainer.from_config(config)
  real_update = run.models.policy.update

  def nan_update(micro_batches, **kwargs):
    metrics = real_update(micro_batches, **kwargs)
    return {**metrics, "finite": np.float32(0.0)}  # as a NaN loss reports it

  monkeypatch.setattr(run.models.policy, "update", nan_update)
  run.run_step()  # one skipped update is tolerated
  with pytest.raises(trainer.TrainingError, match="2 non-finite updates skipped"):
    run.run_step()


@pytest.mark.heavy
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
  batch = TrainBatch(tokens_bt=jnp.asarray(rng.randint(0, 50, (3, 13)), jnp.int32),
                     attention_mask_bt=jnp.ones((3, 13), bool))
  graphdef, params = nnx.split(model)
  logprobs, entropy = forward.token_logprobs_and_entropy(graphdef, params, batch, 0.7, chunk)
  logits = np.asarray(model(batch.tokens_bt))[:, :-1] / 0.7
  full = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  targets = np.asarray(batch.tokens_bt)[:, 1:, None]
  np.testing.assert_allclose(logprobs, np.take_along_axis(full, targets, -1)[..., 0], atol=1e-5)
  np.testing.assert_allclose(entropy, -(np.exp(full) * full).sum(-1), atol=1e-4)

  def loss(params, sliced):
    if sliced:
      lp, _ = forward.token_logprobs_and_entropy(graphdef, params, batch, 0.7, chunk)
    else:
      out = nnx.merge(graphdef, params)(batch.tokens_bt)[:, :-1] / 0.7
      lp = losses.token_logprobs(out, batch.tokens_bt[:, 1:])
    return lp.sum()

  g_sliced = jax.grad(loss)(params, True)
  g_full = jax.grad(loss)(params, False)
  for a, b in zip(jax.tree.leaves(g_sliced), jax.tree.leaves(g_full)):
    np.testing.assert_allclose(a, b, atol=1e-4)


def _tiny_config():
  from models import qwen2
  return qwen2.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1,
                           num_heads=4, num_kv_heads=2)


def _uneven_batch(seed=7):
  """6 rows: rows 0-1 hold 3 loss tokens each, rows 2-4 30, row 5 none (a filler)."""
  rng = np.random.RandomState(seed)
  rows, width = 6, 33
  mask = np.zeros((rows, width - 1), np.float32)
  mask[:2, 4:7] = 1
  mask[2:5, 1:31] = 1
  return TrainBatch(
      tokens_bt=rng.randint(0, 50, (rows, width)).astype(np.int32),
      attention_mask_bt=np.ones((rows, width), bool), loss_mask_bt=mask,
      old_logprobs_bt=(-4.0 + rng.randn(rows, width - 1)).astype(np.float32),
      advantages_bt=(rng.randn(rows, width - 1) * mask).astype(np.float32),
      returns_bt=(rng.randn(rows, width - 1) + 4.0 * (np.arange(rows) < 2)[:, None]).astype(
          np.float32),  # the short rows' values are far off
      old_values_bt=(0.3 * rng.randn(rows, width - 1)).astype(np.float32))


def _learner(loss_fn, cfg, tx):
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from models import qwen2
  if loss_fn is updates.critic_loss:
    model = qwen2.Qwen2Value(_tiny_config(), rngs=nnx.Rngs(0))
    model.value_head.set_value(jax.random.normal(jax.random.key(1), (32,), jnp.float32))
  else:
    model = qwen2.init_random(_tiny_config(), seed=0)
  prefix = "critic_" if loss_fn is updates.critic_loss else ""
  return learner.Learner(model, tx, loss_fn, cfg, metric_prefix=prefix)


@pytest.mark.heavy
@pytest.mark.parametrize("loss_name,mode", [
    ("policy_loss", "token-mean"), ("policy_loss", "seq-mean-token-mean"),
    ("critic_loss", "token-mean")])
def test_accumulated_micro_batches_update_like_one_big_batch(loss_name, mode):
  import jax
  import optax
  loss_fn = getattr(updates, loss_name)
  cfg = RLConfig(loss_agg=mode, entropy_coef=0.01)
  batch = _uneven_batch()
  micro_batches = [batch.select_rows(i, i + 2) for i in (0, 2, 4)]
  assert [m.loss_mask_bt.sum() for m in micro_batches] == [6, 60, 30]
  tx = optax.sgd(0.5)  # plain SGD: the update is the gradient itself
  whole = _learner(loss_fn, cfg, tx)
  # The old accumulation averaged the micro-batches' own means: another objective.
  own_means = [loss_fn(whole.graphdef, cfg, whole.params, m, None)[0] for m in micro_batches]
  whole_loss = loss_fn(whole.graphdef, cfg, whole.params, batch, None)[0]
  assert abs(np.mean(own_means) - whole_loss) > 0.05 * abs(whole_loss)

  whole_metrics = whole.update([batch])
  accumulated = _learner(loss_fn, cfg, tx)
  accumulated_metrics = accumulated.update(micro_batches)
  for a, b in zip(jax.tree.leaves(accumulated.params), jax.tree.leaves(whole.params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  for key, value in whole_metrics.items():
    np.testing.assert_allclose(accumulated_metrics[key], value, rtol=1e-4, atol=1e-6,
                               err_msg=key)
  prefix = "critic_" if loss_fn is updates.critic_loss else ""
  assert accumulated_metrics[prefix + "finite"] == 1.0 and accumulated_metrics[
      prefix + "grad_norm"] > 0


def test_learning_rate_follows_training_steps_and_the_learner_sets_it():
  import jax
  cfg = learner.OptimConfig(warmup_steps=4)
  assert [learner.learning_rate(cfg, 1.0, 10, s) for s in range(6)] == [
      0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
  cosine = learner.OptimConfig(warmup_steps=2, schedule="cosine")
  assert learner.learning_rate(cosine, 1.0, 10, 2) == 1.0 > learner.learning_rate(
      cosine, 1.0, 10, 6) > 0
  with pytest.raises(ValueError, match="linear"):
    learner.make_optimizer(learner.OptimConfig(schedule="linear"), 1.0)
  batch = _uneven_batch()
  policy = _learner(updates.policy_loss, RLConfig(),
                    learner.make_optimizer(learner.OptimConfig(weight_decay=0.1), 0.1))
  before = jax.tree.map(np.asarray, policy.params)
  policy.update([batch], learning_rate=0.0)  # warm-up's first step: nothing moves
  for a, b in zip(jax.tree.leaves(policy.params), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)
  policy.update([batch], learning_rate=0.1)
  assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(policy.params),
                                                   jax.tree.leaves(before)))


def test_thinking_mini_batches_hold_a_steps_dialogue_count_of_samples():
  batch = TrainBatch(tokens_bt=np.arange(10)[:, None] + np.zeros((10, 3), int),
                     attention_mask_bt=np.ones((10, 3), bool),
                     loss_mask_bt=np.ones((10, 2), np.float32))
  chunks = batch_lib.chunks(batch, 4, row_multiple=2)
  assert [c.rows for c in chunks] == [4, 4, 2]
  chunks = batch_lib.chunks(batch, 4, row_multiple=4)
  assert [c.rows for c in chunks] == [4, 4, 4]
  np.testing.assert_array_equal(chunks[2].tokens_bt[:, 0], [8, 9, 0, 0])
  assert chunks[2].loss_mask_bt[2:].sum() == 0  # padding rows carry no loss


@pytest.mark.heavy
def test_a_thinking_step_makes_one_update_per_batch_size_samples(monkeypatch, tmp_path):
  from rlver_jax import trainer
  from tests.runs import small_demo
  config = small_demo(tmp_path, **{"rollout.thinking": True, "optim.warmup_steps": 0,
                                   "optim.ppo_epochs": 1,  # one pass over the mini-batches
                                   "optim.num_minibatches": 1})
  run = trainer.Trainer.from_config(config)
  calls = []
  real_update = run.models.policy.update

  def counting_update(micro_batches, **kwargs):
    calls.append((sum(int((m.loss_mask_bt.sum(1) > 0).sum()) for m in micro_batches),
                  kwargs["learning_rate"]))
    return real_update(micro_batches, **kwargs)

  monkeypatch.setattr(run.models.policy, "update", counting_update)
  metrics = run.run_step()
  samples = metrics["samples"]
  assert samples > config.batch_size  # one sample per agent turn
  assert metrics["updates"] == len(calls) == -(-samples // config.batch_size)
  assert [rows for rows, _ in calls[:-1]] == [config.batch_size] * (len(calls) - 1)
  assert sum(rows for rows, _ in calls) == samples
  assert {lr for _, lr in calls} == {config.optim.actor_lr}  # one rate for the whole step
  for key in ("clip_frac", "pg_clipfrac_lower", "value_clip_frac", "value_loss", "grad_norm",
              "approx_kl", "entropy"):
    assert np.isfinite(metrics[key]), key
