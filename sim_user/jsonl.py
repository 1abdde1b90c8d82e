"""Reading JSONL files whose errors name the file and line."""

from __future__ import annotations

import json
import os
from typing import Iterator


def iter_jsonl(path: str, error: type[Exception] = ValueError) -> Iterator[tuple[int, object]]:
  """(line number, parsed object) for every non-blank line; `error` for a missing file or bad JSON."""
  if not os.path.exists(path):
    raise error(f"{path}: no such file")
  with open(path, encoding="utf-8") as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield line_no, json.loads(line)
      except json.JSONDecodeError as e:
        raise error(f"{path}:{line_no}: invalid JSON: {e.msg} at column {e.colno}") from None
