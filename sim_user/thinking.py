"""Thinking agents: `<think>...</think>` then the reply the user sees."""

from __future__ import annotations

import dataclasses
import re

_THINK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ThinkingSplit:
  thought: str
  reply: str
  well_formed: bool  # exactly one leading think block and a non-empty reply


def split_thinking(text: str) -> ThinkingSplit:
  """Separates a thinking agent's reasoning from its reply.

  Well formed means: the text starts (after white space) with one
  `<think>...</think>` block, no other think tags follow, and a reply does.
  """
  stripped = text.lstrip()
  match = _THINK_RE.match(stripped)
  if not match:
    return ThinkingSplit(thought="", reply=strip_thinking(text), well_formed=False)
  reply = stripped[match.end():].strip()
  stray_tags = "<think>" in reply or "</think>" in reply
  return ThinkingSplit(thought=match.group(1).strip(), reply=strip_thinking(reply),
                       well_formed=bool(reply) and not stray_tags)


def strip_thinking(text: str) -> str:
  """What the simulated user sees: the text without any think blocks or stray tags."""
  text = _THINK_RE.sub("", text)
  # An unclosed <think> hides everything after it.
  text = text.split("<think>")[0]
  return text.replace("</think>", "").strip()
