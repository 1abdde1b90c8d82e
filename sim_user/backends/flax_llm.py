"""In-process simulator: a Qwen2.5 checkpoint on the same mesh, through the project's sampler."""

from __future__ import annotations

from typing import Sequence

import jax

from models import pretrained
from models.chat import ChatFormatter
from models.sampler import Sampler
from models.sampling import SamplingParams
from sim_user.backends.base import BackendError, SimRequest


class FlaxLLMBackend:
  """Each request's prompt is one user message, rendered with the checkpoint's chat template.

  Sampler call c draws with `key` folded with c (see rl/keys.py).
  """

  def __init__(self, sampler: Sampler, tokenizer, params: SamplingParams, key: jax.Array,
               max_batch_size: int = 64, max_prompt_tokens: int = 8192):
    self.sampler = sampler
    self.tokenizer = tokenizer
    self.formatter = ChatFormatter(tokenizer)
    self.params = params
    self.key = key
    self.max_batch_size = max_batch_size
    self.max_prompt_tokens = max_prompt_tokens
    self._calls = 0

  @classmethod
  def from_checkpoint(cls, checkpoint: str, params: SamplingParams, key: jax.Array,
                      mesh=None) -> FlaxLLMBackend:
    """The simulator of HF checkpoint directory `checkpoint`: float32 on one device, bfloat16
    over `mesh` (there it shares the devices with the policy being trained)."""
    simulator = pretrained.load_policy(checkpoint, dtype="float32" if mesh is None else "bfloat16",
                                       mesh=mesh)
    return cls(simulator.sampler, simulator.tokenizer, params, key)

  def complete(self, requests: Sequence[SimRequest]) -> list[str | BackendError]:
    prompts = [self.formatter.prompt_ids([{"role": "user", "content": r.prompt}])
               for r in requests]
    results: list[str | BackendError | None] = [None] * len(requests)
    fits = [i for i, p in enumerate(prompts) if len(p) <= self.max_prompt_tokens]
    for i in set(range(len(requests))) - set(fits):
      results[i] = BackendError("prompt_too_long", f"{len(prompts[i])} tokens")
    for start in range(0, len(fits), self.max_batch_size):
      chunk = fits[start:start + self.max_batch_size]
      self._calls += 1
      out = self.sampler.batch.generate([prompts[i] for i in chunk], self.params,
                                  jax.random.fold_in(self.key, self._calls))
      for i, text in zip(chunk, out.texts(self.tokenizer, skip_special_tokens=True)):
        results[i] = text
    return results
