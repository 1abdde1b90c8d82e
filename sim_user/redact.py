"""Keeps API keys out of logs, metrics, results and error messages.

A server may echo the request's headers in its answer (some error pages do),
so any text that comes from a simulator server, or that names its URL, goes
through `redact` before it reaches a log line, a `BackendError` or a
dialogue.
"""

from __future__ import annotations

import re
from typing import Iterable

REDACTED = "[REDACTED]"

# Values shorter than this are not keys anyone issues (vLLM users often set
# OPENAI_API_KEY=EMPTY); replacing them everywhere would garble the text.
MIN_SECRET_CHARS = 8

_PATTERNS = (
    # An Authorization header's token, whatever the key.
    (re.compile(r"\b(Bearer\s+)[A-Za-z0-9._~+/=-]{%d,}" % MIN_SECRET_CHARS),
     rf"\1{REDACTED}"),
    # OpenAI-style keys (sk-..., sk-proj-...), also when cut short by a truncated echo.
    (re.compile(r"\bsk-[A-Za-z0-9_-]{4,}"), REDACTED),
    # Credentials in a URL: scheme://user:password@host.
    (re.compile(r"(?<=://)[^/@\s]+@"), f"{REDACTED}@"),
)


_ENV_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_env_var_name(text: str) -> bool:
  """Whether `text` can name an environment variable (a key pasted in its place cannot)."""
  return bool(_ENV_VAR_NAME.fullmatch(text))


def api_key_env_error(field: str = "sim_user.api_key_env") -> str:
  """The refusal of a value that is no variable name; it never repeats the value, which is
  likely the key itself."""
  return (f"{field} must name the environment variable that holds the API key (e.g. "
          "OPENAI_API_KEY, the default: `export OPENAI_API_KEY=...`), not the key itself; its "
          "value is not a variable name and is not shown here")


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
  """`text` with every value in `secrets`, Bearer token, sk- key and URL password replaced."""
  for secret in secrets:
    if secret and len(secret) >= MIN_SECRET_CHARS:
      text = text.replace(secret, REDACTED)
  for pattern, replacement in _PATTERNS:
    text = pattern.sub(replacement, text)
  return text
