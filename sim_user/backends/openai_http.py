"""OpenAI-compatible chat-completions client (vLLM, SGLang, DeepSeek's API, ...).

Bounded concurrency (a thread pool), a timeout per attempt, retries with
exponential backoff on 429, 5xx, connection errors, timeouts and malformed
answers; other 4xx fail at once. The API key comes from an environment
variable and never appears in logs or errors. A request that still fails
comes back as a `BackendError` in its place; `complete` itself never raises
for one request.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Sequence

from absl import logging

from sim_user.backends.base import BackendError, SimRequest

_RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class OpenAIChatBackend:

  def __init__(self, base_url: str, model: str, *, api_key_env: str = "OPENAI_API_KEY",
               max_concurrency: int = 8, timeout_s: float = 120.0, max_retries: int = 4,
               backoff_s: float = 1.0, max_backoff_s: float = 30.0, temperature: float = 0.7,
               max_tokens: int = 1024, seed: int = 0):
    if not base_url:
      raise ValueError("sim_user.base_url is empty; give the server's URL, e.g. "
                       "http://localhost:8000/v1")
    self.url = base_url.rstrip("/") + "/chat/completions"
    self.model = model
    self.api_key_env = api_key_env
    self.max_concurrency = max_concurrency
    self.timeout_s = timeout_s
    self.max_retries = max_retries
    self.backoff_s = backoff_s
    self.max_backoff_s = max_backoff_s
    self.temperature = temperature
    self.max_tokens = max_tokens
    self._rng = random.Random(seed)
    self._lock = threading.Lock()
    self.stats: collections.Counter = collections.Counter()

  def _headers(self) -> dict:
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(self.api_key_env)
    if key:
      headers["Authorization"] = f"Bearer {key}"
    return headers

  def complete(self, requests: Sequence[SimRequest]) -> list[str | BackendError]:
    if not requests:
      return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
      return list(pool.map(self._complete_one, [r.prompt for r in requests]))

  def _count(self, key: str) -> None:
    with self._lock:
      self.stats[key] += 1

  def _sleep_before_retry(self, attempt: int, retry_after: str | None) -> None:
    delay = self.backoff_s * 2 ** attempt
    if retry_after and retry_after.strip().isdigit():
      delay = max(delay, float(retry_after))
    with self._lock:
      jitter = self._rng.uniform(0, 0.1 * delay)
    time.sleep(min(delay + jitter, self.max_backoff_s))

  def _complete_one(self, prompt: str) -> str | BackendError:
    body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}],
                       "temperature": self.temperature, "max_tokens": self.max_tokens}).encode()
    last = BackendError("unknown")
    for attempt in range(self.max_retries + 1):
      retry_after = None
      try:
        request = urllib.request.Request(self.url, data=body, headers=self._headers(),
                                         method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
          raw = response.read()
        text = _content(raw)
        self._count("ok")
        return text
      except urllib.error.HTTPError as e:
        detail = e.read(200).decode("utf-8", "replace") if e.fp else ""
        last = BackendError(f"http_{e.code}", detail)
        if e.code not in _RETRYABLE_STATUS:
          self._count(f"http_{e.code}")
          return last
        retry_after = e.headers.get("Retry-After") if e.headers else None
      except (TimeoutError, socket.timeout):
        last = BackendError("timeout", f"no answer within {self.timeout_s}s")
      except (urllib.error.URLError, ConnectionError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, (TimeoutError, socket.timeout)):
          last = BackendError("timeout", f"no answer within {self.timeout_s}s")
        else:
          last = BackendError("connection", str(reason))
      except _MalformedAnswer as e:
        last = BackendError("malformed", str(e))
      self._count(last.reason)
      if attempt < self.max_retries:
        logging.warning("simulator call failed (%s), retry %d/%d", last, attempt + 1,
                        self.max_retries)
        self._sleep_before_retry(attempt, retry_after)
    return last


class _MalformedAnswer(Exception):
  pass


def _content(raw: bytes) -> str:
  try:
    answer = json.loads(raw)
    content = answer["choices"][0]["message"]["content"]
  except (json.JSONDecodeError, UnicodeDecodeError, KeyError, IndexError, TypeError) as e:
    raise _MalformedAnswer(f"unexpected answer ({type(e).__name__}): {raw[:120]!r}") from None
  if not isinstance(content, str):
    raise _MalformedAnswer(f"message content is {type(content).__name__}, not text")
  return content
