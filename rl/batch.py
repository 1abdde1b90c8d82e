"""The training batch: what `collate` makes of a rollout's samples, typed.

A `Sample` is one sequence as the agent (`rl.agent`) builds it; it lives
here, with the batch it becomes, so the batch needs nothing of the agent.

Token arrays live on two grids. `tokens_bt` and `attention_mask_bt` are the
sequences themselves, [B, T]; every other per-token array is on the "target"
grid, [B, T - 1]: entry t belongs to token t + 1 (the token predicted from
position t). B counts rows, filler rows included (all-zero masks, groups of
their own), so a batch splits evenly over devices and micro-batches.

The batch fills up along the step: `collate` gives the rollout's fields, the
trainer's model passes add `old_values_bt` (PPO) and `ref_logprobs_bt` (KL),
`rl.advantages.compute_advantages` adds `advantages_bt` and `returns_bt`. A
field not (yet) computed is None and is no pytree leaf, so jit, device_put and
tree maps see only the arrays a batch has.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import struct

from models.sampling import bucket_size

FILLER_GROUP = 10**6  # filler rows get groups FILLER_GROUP + row: groups of their own


@dataclasses.dataclass
class Sample:
  """One training sequence: token ids with per-token loss mask and sampling logprobs.

  Host lists of the sequence's own length T, unpadded: `collate` pads them
  onto a `TrainBatch` row.
  """

  tokens: list[int]  # [T]
  loss_mask: list[int]  # [T]: 1 on tokens the agent generated
  logprobs: list[float]  # [T]: sampling logprob on generated tokens, 0 elsewhere
  reward: float  # the dialogue's score (GRPO normalises these within a group)
  group: int  # samples of one profile share a group
  dialogue: int  # index into Rollout.dialogues
  token_rewards: list[tuple[int, float]] = dataclasses.field(default_factory=list)
  # (index into tokens, reward): the final reward on the last generated token, or
  # with reward="turn" each turn's emotion change on that turn's last token


@struct.dataclass
class TrainBatch:
  """Right-padded numpy (host) or jax (device) arrays of one step's training sequences."""

  tokens_bt: np.ndarray  # [B, T] int32 token ids, pad_id after each sequence
  attention_mask_bt: np.ndarray  # [B, T] bool, True on real tokens
  loss_mask_bt: np.ndarray | None = None  # [B, T-1] float32, 1 on the agent's own tokens
  old_logprobs_bt: np.ndarray | None = None  # [B, T-1] float32, sampling logprobs
  token_rewards_bt: np.ndarray | None = None  # [B, T-1] float32 (GAE: with any KL penalty)
  scores_b: np.ndarray | None = None  # [B] float32, each dialogue's score
  groups_b: np.ndarray | None = None  # [B] int32, GRPO groups (a profile's samples)
  old_values_bt: np.ndarray | None = None  # [B, T-1] float32, the critic's values (PPO)
  ref_logprobs_bt: np.ndarray | None = None  # [B, T-1] float32, the reference policy's
  advantages_bt: np.ndarray | None = None  # [B, T-1] float32
  returns_bt: np.ndarray | None = None  # [B, T-1] float32 (GAE; zeros for GRPO)
  is_weights_bt: np.ndarray | None = None  # [B, T-1] float32, rl.rollout_correction's weights
  # [B] bool (rl.old_logprobs=learner): rows whose ratio takes the update's own log-probs,
  # detached, as the old ones: the first mini-batch's, whose weights have not moved yet.
  old_is_own_b: np.ndarray | None = None

  @property
  def rows(self) -> int:
    return len(self.tokens_bt)

  def model_inputs(self) -> TrainBatch:
    """Only what a forward pass reads: the tokens and their attention mask."""
    return TrainBatch(tokens_bt=self.tokens_bt, attention_mask_bt=self.attention_mask_bt)

  def for_update(self) -> TrainBatch:
    """Without the host-side fields (rewards, scores, groups) that no update step reads."""
    return self.replace(token_rewards_bt=None, scores_b=None, groups_b=None)

  def select_rows(self, start: int, stop: int) -> TrainBatch:
    return jax.tree.map(lambda x: x[start:stop], self)

  def pad_rows(self, count: int) -> TrainBatch:
    """`count` empty rows appended: zeros everywhere, so no loss and no attention."""
    return jax.tree.map(lambda x: np.pad(x, [(0, count)] + [(0, 0)] * (x.ndim - 1)), self)


def collate(samples: Sequence[Sample], batch_multiple: int = 1, pad_id: int = 0) -> TrainBatch:
  """Right-padded numpy arrays; length bucketed to a power of two, rows to `batch_multiple`.

  Filler rows have an all-zero mask, so they add nothing to any loss.
  """
  rows = -(-len(samples) // batch_multiple) * batch_multiple
  width = bucket_size(max(len(s.tokens) for s in samples), minimum=32)
  tokens = np.full((rows, width), pad_id, np.int32)
  attention = np.zeros((rows, width), np.bool_)
  loss_mask = np.zeros((rows, width - 1), np.float32)
  old_logprobs = np.zeros((rows, width - 1), np.float32)
  token_rewards = np.zeros((rows, width - 1), np.float32)
  scores = np.zeros((rows,), np.float32)
  groups = np.arange(rows, dtype=np.int32) + FILLER_GROUP
  for r, s in enumerate(samples):
    n = len(s.tokens)
    tokens[r, :n] = s.tokens
    attention[r, :n] = True
    loss_mask[r, :n - 1] = s.loss_mask[1:]
    old_logprobs[r, :n - 1] = s.logprobs[1:]
    for index, reward in s.token_rewards:
      token_rewards[r, index - 1] += reward
    scores[r] = s.reward
    groups[r] = s.group
  return TrainBatch(tokens_bt=tokens, attention_mask_bt=attention, loss_mask_bt=loss_mask,
                    old_logprobs_bt=old_logprobs, token_rewards_bt=token_rewards,
                    scores_b=scores, groups_b=groups)


def split(batch: TrainBatch, parts: int) -> list[TrainBatch]:
  """`parts` equal consecutive slices of rows (mini- or micro-batches)."""
  if batch.rows % parts:
    raise ValueError(f"{batch.rows} rows do not split into {parts} mini/micro-batches")
  size = batch.rows // parts
  return [batch.select_rows(i * size, (i + 1) * size) for i in range(parts)]


def chunks(batch: TrainBatch, size: int, row_multiple: int) -> list[TrainBatch]:
  """Consecutive mini-batches of `size` rows (the last may have fewer), as verl's split.

  Each is padded with empty rows (loss mask 0) to a multiple of `row_multiple`.
  """
  out = []
  for start in range(0, batch.rows, size):
    chunk = batch.select_rows(start, start + size)
    out.append(chunk.pad_rows(-chunk.rows % row_multiple))
  return out
