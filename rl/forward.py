"""Forward passes over a `TrainBatch`: token log-probs and entropy, critic values.

Each is a pure function of (graphdef, params, batch) that a `Learner` jits;
outputs are on the batch's target grid, [B, T - 1].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rl import losses
from rl.batch import TrainBatch

LOGITS_CHUNK = 512  # target tokens per slice of the unembedding


def token_logprobs_and_entropy(graphdef, params, batch: TrainBatch, temperature: float,
                               chunk: int = LOGITS_CHUNK):
  """log softmax(logits / T) of every target token and the entropy there, [B, T - 1] each.

  Full logits ([B, T, V], 152k wide for Qwen2.5) are never held: the
  unembedding, softmax and their gradients run over `chunk`-token slices and
  are recomputed in the backward pass, so memory grows with chunk x V, not T x V.
  """
  model = nnx.merge(graphdef, params)
  hidden_btd, _ = model.backbone(batch.tokens_bt, attention_mask=batch.attention_mask_bt)
  b, t, d = hidden_btd.shape
  targets_bt = jnp.pad(batch.tokens_bt[:, 1:], ((0, 0), (0, 1)))  # the last has no target
  chunk = min(chunk, t)
  pad = -t % chunk
  n = (t + pad) // chunk
  hidden_nbcd = jnp.pad(hidden_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d)
  targets_nbc = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, chunk)

  @jax.checkpoint
  def one_slice(hidden_bcd, targets_bc):
    logits_bcv = model.logits(hidden_bcd).astype(jnp.float32) / temperature
    return (losses.token_logprobs(logits_bcv, targets_bc),
            losses.entropy_from_logits(logits_bcv))

  logprobs_nbc, entropy_nbc = jax.lax.map(
      lambda xs: one_slice(*xs), (hidden_nbcd.swapaxes(0, 1), targets_nbc.swapaxes(0, 1)))
  unslice = lambda x_nbc: x_nbc.swapaxes(0, 1).reshape(b, t + pad)[:, :t - 1]
  return unslice(logprobs_nbc), unslice(entropy_nbc)


def critic_values(graphdef, params, batch: TrainBatch):
  """The value model's value at every target position, [B, T - 1]."""
  model = nnx.merge(graphdef, params)
  return model(batch.tokens_bt, attention_mask=batch.attention_mask_bt)[:, :-1]


def sequence_logprobs(graphdef, params, batch: TrainBatch, temperature: float):
  """log softmax(logits / T) of every target token, [B, T - 1]."""
  return token_logprobs_and_entropy(graphdef, params, batch, temperature)[0]
