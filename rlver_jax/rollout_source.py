"""Where a training step's rollout comes from: its profiles (a seeded order that survives
restarts), the sampler's weights, and the dialogues, collected now or, with
`rollout.off_policy_steps=1`, ahead in a background thread beside the update before
(`rlver_jax/off_policy.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from infra import host_metrics
from rl import keys
from rl import rollout as rollout_lib
from rl.rollout_config import RolloutConfig
from rlver_jax import builder, multihost, off_policy, preemption, sections
from sim_user.profiles import Profile
from sim_user.simulator import SimulatedUser


class ProfileOrder:
  """Epoch-wise seeded permutations of the profiles; `position` is all the state there is."""

  def __init__(self, num_profiles: int, seed: int, position: int = 0):
    self.num_profiles, self.seed, self.position = num_profiles, seed, position

  def take(self, count: int) -> list[int]:
    out, self.position = self.peek(count)
    return out

  def peek(self, count: int) -> tuple[list[int], int]:
    """The next `count` profiles and the position after them, without moving."""
    out, position = [], self.position
    while len(out) < count:
      epoch, offset = divmod(position, self.num_profiles)
      out.append(int(self._order(epoch)[offset]))
      position += 1
    return out, position

  @functools.lru_cache(maxsize=1)
  def _order(self, epoch: int) -> np.ndarray:
    return np.asarray(keys.profile_order(self.seed, epoch, self.num_profiles))


# How hosts combine the metrics `Collected.metrics` adds to its rollout's
# (infra/host_metrics.py).
host_metrics.declare({
    "tokens_per_s": host_metrics.ratio("tokens/generated", "time/rollout"),
    "rollout/policy_lag": host_metrics.MEAN, "rollout/wait_s": host_metrics.MAX})


@dataclasses.dataclass(frozen=True)
class Collected:
  """A step's rollout (this host's share) and where it came from."""
  rollout: rollout_lib.Rollout
  position: int  # the data position after its profiles
  weights_step: int  # the step whose weights sampled it (0: the initial ones)
  waited_s: float  # seconds the step waited for it

  def metrics(self, trained_step: int) -> dict:
    """The rollout's metrics on this host, for an update of the weights of `trained_step`."""
    metrics = {**self.rollout.metrics,
               # Updates between the weights that sampled this step and those it trains
               # (0: on-policy), and the seconds the step waited for them.
               "rollout/policy_lag": trained_step - self.weights_step,
               "rollout/wait_s": self.waited_s}
    if self.rollout.dialogues:  # a sampler group's follower has none (combined over hosts)
      metrics["tokens_per_s"] = self.rollout.metrics["tokens/generated"] / max(
          self.rollout.metrics["time/rollout"], 1e-9)
    return metrics


class RolloutSource:
  """The rollouts of a run's steps, drawn from `profiles` in a `ProfileOrder` from position 0
  (`seek` resumes elsewhere) and sampled by `models.sampler`."""

  def __init__(self, config: sections.TrainRun, rollout_cfg: RolloutConfig,
               models: builder.TrainingModels, hosts: multihost.Hosts, user: SimulatedUser,
               profiles: list[Profile], turns: off_policy.DeviceTurns, signals):
    self.config, self.rollout_cfg, self.models, self.hosts = config, rollout_cfg, models, hosts
    self.user, self.profiles, self.turns, self.signals = user, profiles, turns, signals
    self.off_policy_steps = config.rollout.off_policy_steps
    self.order = ProfileOrder(len(profiles), config.seed)
    self.sampler_step = None  # the step whose weights the sampler holds (0: the initial ones)
    self.prefetch: off_policy.BackgroundRollout | None = None  # the next step's, collected ahead

  @property
  def position(self) -> int:
    """The data position: the profiles the run's accepted rollouts have drawn (a checkpoint
    keeps it)."""
    return self.order.position

  def seek(self, position: int) -> None:
    """The next rollout draws from `position` on: a checkpoint's, or an accepted rollout's
    (`Collected.position`)."""
    self.order.position = position

  def _refresh_sampler(self, weights_step: int) -> None:
    """The sampler to the policy's weights, those of step `weights_step` (the last finished),
    unless it holds them already."""
    if self.sampler_step == weights_step:
      return
    assert self.prefetch is None, "the sampler's weights change under a rollout in flight"
    sampler, params = self.models.sampler, self.models.policy.params
    if self.off_policy_steps and sampler.weights.weight_copy is None:
      # This sampler decodes from the weights it is given, and the update that runs beside the
      # next rollout donates the training weights: it gets a copy of its own.
      params = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    sampler.weights.update(params)  # cast and moved onto every sampler group's mesh
    if self.off_policy_steps:  # ready before the update that may donate what it was read from
      jax.block_until_ready(self.models.sampler.weights.state)
    self.sampler_step = weights_step

  def _collect(self, step: int, profile_ids: list[int], sampler, user):
    """`step`'s rollout of these profiles (this host's share). A host that follows its sampler
    group's leader dispatches the leader's programs and has no dialogues of its own."""
    if not self.hosts.leads_group:
      sampler.rows.follow()
      return rollout_lib.Rollout(samples=[], dialogues=[], metrics={})
    chosen = [self.profiles[i] for i in profile_ids]
    share = self.hosts.share(len(chosen))  # this host's dialogues
    with sampler.rows.leading():
      return rollout_lib.collect(
          sampler, self.models.formatter, user, chosen[share.start:share.stop],
          self.rollout_cfg, keys.rollout_step(self.config.seed, step),
          first_profile=share.start, reward=self.config.rl.reward)

  def start_prefetch(self, step: int, weights_step: int) -> None:
    """Starts collecting `step`'s dialogues in the background with the policy's current
    weights, those of step `weights_step`, from the profiles after the current position."""
    self._refresh_sampler(weights_step)
    profile_ids, position = self.order.peek(self.config.batch_size)
    self.prefetch = off_policy.BackgroundRollout(
        step, functools.partial(self._collect, step, profile_ids), self.models.sampler,
        self.user, self.turns, user_in_turns=self.config.sim_user.backend == "flax",
        position=position, weights_step=weights_step)

  def drop_prefetch(self) -> None:
    prefetch, self.prefetch = self.prefetch, None
    if prefetch is not None:
      prefetch.cancel()

  def rollout(self, step: int) -> Collected | None:
    """`step`'s rollout, or None when a stop signal came first: the one collected ahead in the
    background, if any, else collected now with the weights of step `step - 1`."""
    if self.prefetch is not None and self.prefetch.step != step:
      self.drop_prefetch()  # not this step's (cannot happen in a trainer's run): collected anew
    prefetch = self.prefetch
    if prefetch is None:
      self._refresh_sampler(step - 1)
    start = time.perf_counter()
    try:
      with self.signals.abortable():  # a signal drops the rollout: the update would be long
        if prefetch is not None:
          rollout = prefetch.result()  # the background rollout's error, raised here
          self.prefetch = None
          return Collected(rollout, prefetch.info["position"], prefetch.info["weights_step"],
                           time.perf_counter() - start)
        # batch_size counts profiles (verl's batch size counts prompts); each is sampled n
        # times.
        profile_ids, position = self.order.peek(self.config.batch_size)
        rollout = self._collect(step, profile_ids, self.models.sampler, self.user)
        return Collected(rollout, position, self.sampler_step, time.perf_counter() - start)
    except preemption.StopRequested:
      return None  # a prefetch still running is dropped by the trainer's stop
