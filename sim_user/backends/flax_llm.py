"""In-process simulator: a Qwen2.5 checkpoint on the same mesh, through the project's sampler."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from models.chat import ChatFormatter
from models.sampler import STOP, Sampler, SamplingParams
from sim_user.backends.base import BackendError, SimRequest


class FlaxLLMBackend:
  """Each request's prompt is one user message, rendered with the checkpoint's chat template."""

  def __init__(self, sampler: Sampler, tokenizer, params: SamplingParams,
               max_batch_size: int = 64, max_prompt_tokens: int = 8192):
    self.sampler = sampler
    self.tokenizer = tokenizer
    self.formatter = ChatFormatter(tokenizer)
    self.params = params
    self.max_batch_size = max_batch_size
    self.max_prompt_tokens = max_prompt_tokens
    self._calls = 0

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
      params = dataclasses.replace(self.params, seed=self.params.seed + self._calls)
      out = self.sampler.generate([prompts[i] for i in chunk], params)
      for i, tokens, reason in zip(chunk, out.tokens, out.stop_reasons):
        body = tokens[:-1] if reason == STOP else tokens
        results[i] = self.tokenizer.decode(body, skip_special_tokens=True)
    return results
