"""What sampling is, apart from any engine: its settings, drawing a token from logits, the
bucket sizes shapes are padded to, what a call returns and what the calls did.

Shapes are bucketed so that new lengths rarely recompile: a batch is padded to a power of
two, each new chunk of tokens to a power of two, and a cache to a power of two of slots
(`bucket_size`); row calls take one of a few sizes (`ladder`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from infra import host_metrics

MIN_CHUNK_BUCKET = 16  # the fewest tokens a prefill chunk is padded to
MIN_CACHE_BUCKET = 256  # the fewest cache slots a cache holds or a row call attends over
LADDER_RUNGS = 3  # the sizes of a `ladder`
STOP = "stop"
LENGTH = "length"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  max_new_tokens: int = 256
  temperature: float = 1.0  # 0: greedy
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  def static(self) -> dict:
    """The static arguments of the decode programs these settings compile."""
    return {"greedy": self.temperature == 0, "top_k": self.top_k, "use_top_p": self.top_p < 1.0}


@dataclasses.dataclass
class Completions:
  """The sampler's output: one continuation per row, in row order."""

  tokens: list[list[int]]  # [rows][new tokens]: all the cache now holds, the stop token included
  logprobs: list[list[float]]  # [rows][new tokens]: each token's sampling logprob
  stop_reasons: list[str]  # [rows]: STOP (a stop token ends `tokens`) or LENGTH (max_new_tokens)

  @property
  def lengths(self) -> list[int]:
    return [len(t) for t in self.tokens]

  @property
  def ended(self) -> list[bool]:
    """Per row: the continuation ended on a stop token (it was not cut at max_new_tokens)."""
    return [reason == STOP for reason in self.stop_reasons]

  def texts(self, tokenizer, skip_special_tokens: bool = False) -> list[str]:
    """Each row's text without its stop token."""
    return [tokenizer.decode(tokens[:-1] if ended else tokens,
                             skip_special_tokens=skip_special_tokens)
            for tokens, ended in zip(self.tokens, self.ended)]


@dataclasses.dataclass
class DecodeStats:
  """What a sampler's calls did, summed from its start (subtract two copies for a span)."""

  seconds: float = 0.0  # wall time of prefill and decode calls, results fetched
  row_steps: int = 0  # decoding rows, padding included, x decode steps run
  tokens: int = 0  # tokens drawn for real rows
  # over decode calls, sum of row_steps x (tokens held / cache slots the decoding rows attend
  # over: the batch cache's, or a row call's attended slots)
  occupancy: float = 0.0

  def add(self, seconds: float, rows: int, steps: int, tokens: int, held: int,
          slots: int) -> None:
    self.seconds += seconds
    self.row_steps += rows * steps
    self.tokens += tokens
    self.occupancy += rows * steps * held / max(slots, 1)

  def since(self, earlier: "DecodeStats") -> "DecodeStats":
    return DecodeStats(*(getattr(self, f.name) - getattr(earlier, f.name)
                         for f in dataclasses.fields(self)))

  # Over hosts: the per-row-step figures weigh by row-steps; a step waits for the slowest decode.
  host_metrics.declare({"rollout/slot_efficiency": host_metrics.weighted("rollout/row_steps"),
                        "rollout/cache_occupancy": host_metrics.weighted("rollout/row_steps"),
                        "rollout/row_steps": host_metrics.SUM,
                        "rollout/decode_s": host_metrics.MAX})

  def metrics(self) -> dict:
    """`rollout/` figures of a span: slot efficiency (tokens / row-steps), cache occupancy of
    the slots the decoding rows attend over (averaged over row-steps), the row-steps (their weight when hosts
    combine them) and decode time."""
    return {"rollout/slot_efficiency": self.tokens / max(self.row_steps, 1),
            "rollout/cache_occupancy": self.occupancy / max(self.row_steps, 1),
            "rollout/row_steps": self.row_steps, "rollout/decode_s": self.seconds}


def bucket_size(n: int, minimum: int = 1) -> int:
  """The power of two >= n (and >= minimum) that shapes of size n are padded to."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def ladder(top: int, ratio: int, bottom: int = 1, multiple: int = 1) -> tuple[int, ...]:
  """Up to LADDER_RUNGS sizes, ascending: `top`, top / ratio, top / ratio^2 (rounded up),
  each at least `bottom` and a multiple of `multiple`; `top` must be one."""
  sizes = {-(-max(bottom, -(-top // ratio ** rung)) // multiple) * multiple
           for rung in range(LADDER_RUNGS)}
  return tuple(sorted(sizes))


def sample_logits(logits_bv, key, temperature, top_p, *, greedy: bool, top_k: int,
                  use_top_p: bool):
  """Samples one token per row; returns (tokens [B], logprobs [B]).

  `key` is one key for the batch, or one key per row ([B]): then a row's draw
  does not depend on which batch it is in.

  Log-probabilities are of the sampled token under softmax(logits / T) before
  top-k/top-p truncation (raw logits when greedy): the policy's own
  distribution, as RL needs it.
  """
  logits_bv = logits_bv.astype(jnp.float32)
  if greedy:
    tokens_b = jnp.argmax(logits_bv, axis=-1)
    logprobs_bv = jax.nn.log_softmax(logits_bv, axis=-1)
  else:
    logits_bv = logits_bv / temperature
    logprobs_bv = jax.nn.log_softmax(logits_bv, axis=-1)
    filtered_bv = logits_bv
    if top_k:
      kth_b1 = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
      filtered_bv = jnp.where(logits_bv < kth_b1, -jnp.inf, filtered_bv)
    if use_top_p:
      sorted_bv = -jnp.sort(-filtered_bv, axis=-1)
      probs_bv = jax.nn.softmax(sorted_bv, axis=-1)
      # Keep the smallest prefix whose mass reaches top_p (at least one token).
      kept_b = jnp.sum(jnp.cumsum(probs_bv, axis=-1) - probs_bv < top_p, axis=-1)
      threshold_b1 = jnp.take_along_axis(sorted_bv, kept_b[:, None] - 1, axis=-1)
      filtered_bv = jnp.where(filtered_bv < threshold_b1, -jnp.inf, filtered_bv)
    if jnp.ndim(key):
      tokens_b = jax.vmap(jax.random.categorical)(key, filtered_bv)
    else:
      tokens_b = jax.random.categorical(key, filtered_bv, axis=-1)
  logprob_b = jnp.take_along_axis(logprobs_bv, tokens_b[:, None], axis=-1)[:, 0]
  return tokens_b.astype(jnp.int32), logprob_b


def sampler_fn(temperature, top_p, greedy, top_k, use_top_p):
  """`sample_logits` with these settings bound: a decode loop's `sample(logits, keys)`."""
  return functools.partial(sample_logits, temperature=temperature, top_p=top_p,
                           greedy=greedy, top_k=top_k, use_top_p=use_top_p)
