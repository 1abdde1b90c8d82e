"""Where a step's rollout comes from (rlver_jax/rollout_source.py) on its own: the profile order,
the sampler's refresh, a follower's empty rollout, the rollout's metrics; the rollout collected
ahead in a whole run: tests/rlver_jax/test_off_policy.py."""

from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from configs import demo
from rl import rollout as rollout_lib
from rlver_jax import off_policy, preemption, rollout_source, sections


def test_the_profile_order_goes_through_every_profile_each_epoch_and_resumes_from_its_position():
  order = rollout_source.ProfileOrder(5, seed=3)
  assert order.peek(3) == (order.peek(3)[0], 3) and order.position == 0  # peek does not move
  drawn = order.take(3) + order.take(4) + order.take(3)  # two epochs of 5
  assert order.position == 10
  assert sorted(drawn[:5]) == sorted(drawn[5:]) == list(range(5))
  assert drawn[:5] != drawn[5:]  # each epoch its own permutation
  resumed = rollout_source.ProfileOrder(5, seed=3, position=3)
  assert resumed.take(7) == drawn[3:]
  assert rollout_source.ProfileOrder(5, seed=4).take(10) != drawn


def _rollout(dialogues: int) -> rollout_lib.Rollout:
  return rollout_lib.Rollout(samples=[], dialogues=[object()] * dialogues,
                             metrics={"tokens/generated": 30, "time/rollout": 2.0})


def test_a_rollout_reports_its_policy_lag_its_wait_and_its_tokens_per_second():
  ahead = rollout_source.Collected(_rollout(2), position=8, weights_step=3, waited_s=0.5)
  assert ahead.metrics(trained_step=4) == {"tokens/generated": 30, "time/rollout": 2.0,
                                           "rollout/policy_lag": 1, "rollout/wait_s": 0.5,
                                           "tokens_per_s": 15.0}
  follower = rollout_source.Collected(_rollout(0), position=8, weights_step=4, waited_s=0.0)
  assert "tokens_per_s" not in follower.metrics(trained_step=4)  # no dialogues of its own
  assert follower.metrics(trained_step=4)["rollout/policy_lag"] == 0


class _FollowingSampler:
  """A sampler group follower's sampler: it counts weight refreshes and follows."""

  def __init__(self):
    self.refreshed, self.followed = [], 0
    self.weights = SimpleNamespace(weight_copy=None, state=None, update=self._update)
    self.rows = SimpleNamespace(follow=self._follow)

  def _update(self, params):
    self.refreshed.append(params)
    self.weights.state = params

  def _follow(self):
    self.followed += 1


def _source(off_policy_steps: int):
  config = demo.get_config()
  config.rollout.off_policy_steps = off_policy_steps
  run = sections.train_run(config)
  policy = SimpleNamespace(params={"w": jnp.ones(3)})
  models = SimpleNamespace(sampler=_FollowingSampler(), policy=policy, formatter=None)
  hosts = SimpleNamespace(leads_group=False)
  return rollout_source.RolloutSource(
      run, rollout_cfg=None, models=models, hosts=hosts, user=None, profiles=[None] * 8,
      turns=off_policy.DeviceTurns(enabled=False), signals=preemption.StopSignals())


@pytest.mark.parametrize("off_policy_steps", [0, 1])
def test_the_sampler_is_refreshed_once_per_step_and_a_follower_has_no_dialogues(
    off_policy_steps):
  source = _source(off_policy_steps)
  sampler = source.models.sampler
  collected = source.rollout(1)
  assert collected.rollout.dialogues == [] and sampler.followed == 1
  assert collected.position == source.config.batch_size and source.order.position == 0
  assert collected.weights_step == 0 and len(sampler.refreshed) == 1
  source.rollout(1)  # the same step again (a retry): the sampler has its weights
  assert len(sampler.refreshed) == 1
  source.rollout(2)
  assert len(sampler.refreshed) == 2 and source.sampler_step == 1
  # Off-policy, the update beside the next rollout donates the training weights: a copy.
  copied = sampler.refreshed[-1]["w"] is not source.models.policy.params["w"]
  assert copied == bool(off_policy_steps)


def test_a_stop_signal_before_the_rollout_drops_it():
  source = _source(0)
  source.signals.received = "SIGTERM"
  assert source.rollout(1) is None
