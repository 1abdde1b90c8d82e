"""Every random key of a run, as `jax.random.fold_in` chains from the run seed.

  key(seed) -> stream -> step (training rollouts) or first item of the batch (evaluation,
               retention, generation) or call (simulator) or epoch (profile order)
            -> agent turn -> row -> token

The first links are here; the sampler folds in the last two itself: each row's
global id (`BatchSampler.start(row_ids=...)`, so a dialogue draws the same tokens
whichever host or batch runs it) and then each token's position. A chain
never meets another: different runs, streams, steps and turns fold in
different values, where sums of integers (`seed * 1000 + turn`) meet at
other seeds.
"""

from __future__ import annotations

import jax

# Streams: one per job that draws; values are part of every key below and never change.
ROLLOUT = 0  # training rollouts: step, turn
SIMULATOR = 1  # the in-process simulator (sim_user.backend=flax), which folds in its call count
EVALUATION = 2  # benchmark dialogues: batch, turn
RETENTION = 3  # retention answers: batch
GENERATION = 4  # rlver_jax.generate: batch or chat turn
PROFILE_ORDER = 5  # the trainer's order of the training profiles: epoch


def stream(seed: int, name: int) -> jax.Array:
  """The root of one stream of run `seed`."""
  return jax.random.fold_in(jax.random.key(seed), name)


def rollout_step(seed: int, step: int) -> jax.Array:
  """Training step `step`'s rollout; its turns fold in on top (`turn`)."""
  return jax.random.fold_in(stream(seed, ROLLOUT), step)


def batch(seed: int, name: int, first_item: int) -> jax.Array:
  """The batch of stream `name` that starts at item `first_item` (eval, retention, generation)."""
  return jax.random.fold_in(stream(seed, name), first_item)


def turn(dialogues_key: jax.Array, agent_turn: int) -> jax.Array:
  """Agent turn `agent_turn` of a batch of dialogues (counted from 0)."""
  return jax.random.fold_in(dialogues_key, agent_turn)


def profile_order(seed: int, epoch: int, num_profiles: int) -> jax.Array:
  """The permutation of the training profiles that epoch `epoch` goes through."""
  return jax.random.permutation(jax.random.fold_in(stream(seed, PROFILE_ORDER), epoch),
                                num_profiles)
