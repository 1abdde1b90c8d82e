"""Reading JSONL files whose errors name the file and line."""

from __future__ import annotations

import codecs
import json
import os
from typing import Iterator


def json_error_at(e: json.JSONDecodeError) -> str:
  """What went wrong, and at which column of the line: "Expecting value at column 7"."""
  # Some of json's messages end in "at" ("Unterminated string starting at"): one "at" only.
  return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def iter_jsonl(path: str, error: type[Exception] = ValueError) -> Iterator[tuple[int, object]]:
  """(line number, parsed object) for every non-blank line; `error` for a missing file or bad JSON."""
  if not os.path.exists(path):
    raise error(f"{path}: no such file")
  with open(path, "rb") as f:  # decoded line by line, so a bad byte names its line
    for line_no, raw in enumerate(f, 1):
      if line_no == 1:  # editors on Windows save UTF-8 with a byte order mark first
        raw = raw.removeprefix(codecs.BOM_UTF8)
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise error(f"{path}:{line_no}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte "
                    f"{e.start + 1} of the line)") from None
      if not line.strip():
        continue
      try:
        yield line_no, json.loads(line)
      except json.JSONDecodeError as e:
        raise error(f"{path}:{line_no}: invalid JSON: {json_error_at(e)}") from None
