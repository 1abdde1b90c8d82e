"""OpenAI-compatible chat-completions client (vLLM, SGLang, DeepSeek's API, ...).

Bounded concurrency (a thread pool); `timeout_s` is a deadline for each
attempt as a whole (connecting, headers and body), not for each socket read,
so a server that trickles bytes cannot hold a call for long. Retries with
exponential backoff on 429, 5xx, connection errors, timeouts, truncated or
oversized bodies and malformed answers; other 4xx fail at once. A request that
still fails comes back as a `BackendError` in its place: `complete` itself
never raises for one request, whatever the server sends.

What reaches the caller is safe to use: replies are valid text (lone
surrogates replaced) of at most `max_reply_chars` characters, and at most a
bounded number of bytes is ever read. The API key comes from an environment
variable; it, any Bearer token and any sk- key are redacted from every reply,
error and log line.
"""

from __future__ import annotations

import collections
import concurrent.futures
import http.client
import json
import os
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Sequence

from absl import logging

from infra.errors import UserInputError
from sim_user.backends.base import BackendError, SimRequest, SimulatorUnavailable
from sim_user.redact import api_key_env_error, is_env_var_name, redact

_RETRYABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
# A body holds more than the reply (JSON escapes take up to 6 bytes a
# character, reasoning text, usage): the byte cap only stops a runaway body.
_BODY_BYTES_PER_REPLY_CHAR = 16
_MIN_BODY_BYTES = 1 << 20
_ERROR_BODY_BYTES = 4096  # read of an error body; 200 characters of it are shown
_SHOWN_CHARS = 200
_READ_CHUNK_BYTES = 1 << 16
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
HEALTH_PROMPT = "This is a connection test. Reply with the single word OK."


class OpenAIChatBackend:
  stats_family = "http"  # its `stats` become sim/http/<event>

  def __init__(self, base_url: str, model: str, *, api_key_env: str = "OPENAI_API_KEY",
               max_concurrency: int = 8, timeout_s: float = 120.0, max_retries: int = 4,
               backoff_s: float = 1.0, max_backoff_s: float = 30.0, temperature: float = 0.7,
               max_tokens: int = 1024, max_reply_chars: int = 20000, seed: int = 0):
    scheme = urllib.parse.urlsplit(base_url).scheme
    if scheme not in ("http", "https") or not urllib.parse.urlsplit(base_url).netloc:
      raise UserInputError(f"sim_user.base_url={redact(base_url)!r} is not an http(s) URL; "
                           "give the server's URL, e.g. http://localhost:8000/v1")
    if not is_env_var_name(api_key_env):
      raise UserInputError(api_key_env_error())
    if timeout_s <= 0:
      raise UserInputError(f"sim_user.timeout_s={timeout_s} must be > 0")
    if max_reply_chars <= 0:
      raise UserInputError(f"sim_user.max_reply_chars={max_reply_chars} must be > 0")
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
    self.max_reply_chars = max_reply_chars
    self.max_body_bytes = max(_MIN_BODY_BYTES, _BODY_BYTES_PER_REPLY_CHAR * max_reply_chars)
    self._rng = random.Random(seed)
    self._lock = threading.Lock()
    # Per attempt: "ok" or the fault's reason; "retries_succeeded": calls that
    # failed at first and then got an answer.
    self.stats: collections.Counter = collections.Counter()

  def complete(self, requests: Sequence[SimRequest]) -> list[str | BackendError]:
    if not requests:
      return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
      return list(pool.map(self._complete_one, [r.prompt for r in requests]))

  def health_check(self) -> None:
    """One small request. Raises `SimulatorUnavailable` naming the URL and the error when it
    gets no well-formed answer.

    Nothing listening, no answer in time or a refused key fails at once; a server that is
    up but answers badly for a moment (429, 5xx, a malformed body) gets the usual retries
    with backoff, as any call would.
    """
    body = self._body(HEALTH_PROMPT)
    for attempt in range(self.max_retries + 1):
      try:
        self._attempt(body)
        return
      except _Fault as fault:
        busy = fault.retryable and fault.error.reason not in ("connection", "timeout")
        if not busy or attempt == self.max_retries:
          raise SimulatorUnavailable(
              f"the simulator at {self._clean(self.url)} did not answer a test request "
              f"({fault.error}); check that it is up and sim_user.base_url, sim_user.model "
              f"and ${self.api_key_env}") from None
        self._sleep_before_retry(attempt, fault.retry_after)

  # One request: attempts and retries.

  def _complete_one(self, prompt: str) -> str | BackendError:
    body = self._body(prompt)
    last = BackendError("unknown")
    for attempt in range(self.max_retries + 1):
      try:
        text = self._attempt(body)
      except _Fault as fault:
        self._count(fault.error.reason)
        last = fault.error
        if not fault.retryable:
          return last
        if attempt < self.max_retries:
          logging.warning("simulator call failed (%s), retry %d/%d", last, attempt + 1,
                          self.max_retries)
          self._sleep_before_retry(attempt, fault.retry_after)
        continue
      self._count("ok")
      if attempt:
        self._count("retries_succeeded")
      return text
    return last

  def _body(self, prompt: str) -> bytes:
    return json.dumps({"model": self.model, "messages": [{"role": "user", "content": prompt}],
                       "temperature": self.temperature, "max_tokens": self.max_tokens}).encode()

  def _attempt(self, body: bytes) -> str:
    """The reply's text, or a `_Fault` for whatever went wrong, within `timeout_s` in all."""
    request = urllib.request.Request(self.url, data=body, headers=self._headers(), method="POST")
    deadline = _Deadline(self.timeout_s)
    opener = urllib.request.build_opener(_DeadlineHandler(deadline))
    try:
      with deadline:
        try:
          response = opener.open(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as e:  # an answer too, with a status that is not 2xx
          response = e
        with response:
          if not 200 <= response.status < 300:
            raise self._status_fault(response)
          raw = _read_at_most(response, self.max_body_bytes)
          missing_bytes = response.length  # announced by Content-Length, never received
    except (OSError, http.client.HTTPException) as e:  # URLError and socket errors are OSErrors
      raise self._transport_fault(e, deadline.expired) from None
    if deadline.expired:  # its cut sockets read as an early end of the body
      raise self._timeout_fault()
    if len(raw) > self.max_body_bytes:
      raise _Fault("too_long", f"body over {self.max_body_bytes} bytes; not read further")
    if missing_bytes:
      raise self._truncated_fault()
    return self._reply_text(raw)

  def _status_fault(self, response) -> _Fault:
    excerpt = _read_at_most(response, _ERROR_BODY_BYTES).decode("utf-8", "replace")
    return _Fault(f"http_{response.status}", self._clean(excerpt)[:_SHOWN_CHARS],
                  retryable=response.status in _RETRYABLE_STATUS,
                  retry_after=response.headers.get("Retry-After") if response.headers else None)

  def _transport_fault(self, e: Exception, deadline_expired: bool) -> _Fault:
    reason = getattr(e, "reason", e)  # URLError wraps the socket's error
    if deadline_expired or isinstance(reason, TimeoutError):
      return self._timeout_fault()
    if isinstance(e, http.client.IncompleteRead):  # a chunked body cut short
      return self._truncated_fault()
    detail = f"{type(reason).__name__}: {reason}" if isinstance(reason, Exception) else reason
    return _Fault("connection", self._clean(str(detail)))

  def _timeout_fault(self) -> _Fault:
    return _Fault("timeout", f"no complete answer within {self.timeout_s}s")

  @staticmethod
  def _truncated_fault() -> _Fault:
    return _Fault("truncated", "the body ended before its announced length")

  def _reply_text(self, raw: bytes) -> str:
    """The first choice's message content of an answer body, checked, cleaned and capped."""
    try:
      answer = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, too deep, huge numbers
      raise _Fault("malformed", self._clean(
          f"not JSON ({type(e).__name__}): {raw[:_SHOWN_CHARS]!r}")) from None
    choices = answer.get("choices") if isinstance(answer, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
      shape = (f"message content is {type(content).__name__}" if isinstance(message, dict)
               else "no choices[0].message")
      raise _Fault("malformed", f"{shape}, not text: {self._clean(repr(answer))[:_SHOWN_CHARS]}")
    if len(content) > self.max_reply_chars:
      raise _Fault("too_long", f"reply of {len(content)} characters, more than "
                   f"sim_user.max_reply_chars={self.max_reply_chars}")
    return self._clean(_LONE_SURROGATE.sub("\ufffd", content))

  # Helpers.

  def _api_key(self) -> str | None:
    return os.environ.get(self.api_key_env)

  def _headers(self) -> dict:
    headers = {"Content-Type": "application/json"}
    key = self._api_key()
    if key:
      if not (key.isascii() and key.isprintable()) or " " in key:
        raise UserInputError(f"${self.api_key_env} holds characters an HTTP header cannot "
                             "carry (spaces, line breaks, non-ASCII); set it to the key alone")
      headers["Authorization"] = f"Bearer {key}"
    return headers

  def _clean(self, text: str) -> str:
    return redact(text, [self._api_key()])

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


class _Fault(Exception):
  """One failed attempt: the `BackendError` it would end in, and whether to try again."""

  def __init__(self, reason: str, detail: str, *, retryable: bool = True,
               retry_after: str | None = None):
    super().__init__(reason)
    self.error = BackendError(reason, detail)
    self.retryable = retryable
    self.retry_after = retry_after


def _read_at_most(response, limit: int) -> bytes:
  """Up to `limit` + 1 bytes of the body, in chunks: a longer body is never read in full."""
  chunks, size = [], 0
  while size <= limit:
    chunk = response.read(min(_READ_CHUNK_BYTES, limit + 1 - size))
    if not chunk:
      break
    chunks.append(chunk)
    size += len(chunk)
  return b"".join(chunks)


class _Deadline:
  """Cuts one attempt's connections when its time is up, in whatever phase it is.

  A socket timeout bounds each read, not the request: a server sending a byte
  every 0.25 s never trips it. Shutting the sockets down from a timer does:
  the blocked read returns at once and the attempt fails.
  """

  def __init__(self, seconds: float):
    self.expired = False
    self._lock = threading.Lock()
    self._sockets: list[socket.socket] = []
    self._timer = threading.Timer(seconds, self._expire)
    self._timer.daemon = True

  def __enter__(self) -> _Deadline:
    self._timer.start()
    return self

  def __exit__(self, *exc_info) -> None:
    self._timer.cancel()

  def watch(self, sock: socket.socket) -> None:
    """Cuts `sock` at the deadline; raises TimeoutError if it has passed already."""
    with self._lock:
      if self.expired:
        raise TimeoutError("deadline passed while connecting")
      self._sockets.append(sock)

  def _expire(self) -> None:
    with self._lock:
      self.expired = True
      for sock in self._sockets:
        try:
          sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already
          pass


class _Watched:
  """A connection whose socket its deadline watches (mixed into http.client's classes)."""

  def __init__(self, host, *, deadline: _Deadline, **kwargs):
    super().__init__(host, **kwargs)
    self._deadline = deadline

  def connect(self):
    super().connect()
    self._deadline.watch(self.sock)


class _WatchedHTTP(_Watched, http.client.HTTPConnection):
  pass


class _WatchedHTTPS(_Watched, http.client.HTTPSConnection):
  pass


class _DeadlineHandler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
  """urllib's http and https handlers (proxies from the environment still apply), opening
  connections that `deadline` watches."""

  def __init__(self, deadline: _Deadline):
    urllib.request.HTTPSHandler.__init__(self)
    self._deadline = deadline

  def http_open(self, req):
    return self.do_open(_WatchedHTTP, req, deadline=self._deadline)

  def https_open(self, req):
    return self.do_open(_WatchedHTTPS, req, deadline=self._deadline, context=self._context)
