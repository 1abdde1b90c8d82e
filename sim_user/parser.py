"""Parsing the simulator's sectioned text: planning (emotion analysis) and reply.

Headers may carry full-width colons, markdown bold or headings, brackets
([Content], 【Content】), bullets, numbering (`1. Content:`, `2) Activity`) and
any case; a header without a colon must stand alone on its line. Prose before
the first header is ignored. Bodies are returned as written (Chinese
punctuation intact); only the emotion change is read after NFKC normalisation
(full-width digits/signs).

Only the sections the simulator needs are required: `Change` in a planning
output (the others feed the reply call and may be empty), `Response` in a
reply. A missing or empty required section raises `MissingSectionError`; a
`Change` that is not exactly one integer (none, two such as `40 -> 35` or
`从40到35`, or an absurd number of digits) raises `BadChangeError`; both are
`SimulatorParseError`, so the simulator retries the call.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata

REPLY_SECTIONS = ("thinking", "origin", "change", "response")

# Header spellings (lower-case, no spaces) -> section key.
_PLANNING_ALIASES = {
    "content": "content", "targetcompletion": "target_completion", "reason": "target_completion",
    "activity": "activity", "analyse": "analyse", "analyze": "analyse", "analysis": "analyse",
    "change": "change",
}
_REPLY_ALIASES = {"thinking": "thinking", "origin": "origin", "change": "change",
                  "response": "response"}

_MINUS_SIGNS = "\u2212\u2012\u2013\u2014\ufe63\uff0d"  # minus, dashes, small and full-width minus
_CHANGE_RE = re.compile(r"(?<![\d.])([+-]?)\s*(\d+)(?![\d.])")
# An emotion change is a few digits (|change| <= 10 in the benchmark); longer is garbage, and
# int() of over 4300 digits raises a ValueError of its own.
MAX_CHANGE_DIGITS = 6


class SimulatorParseError(ValueError):
  """The simulator's text does not have the sections we need."""


class MissingSectionError(SimulatorParseError):

  def __init__(self, section: str, kind: str):
    super().__init__(f"{kind} output has no {section!r} section")
    self.section = section


class BadChangeError(SimulatorParseError):

  def __init__(self, text: str, problem: str = "no integer emotion change"):
    super().__init__(f"{problem} in {text[:80]!r}")


@dataclasses.dataclass(frozen=True)
class Planning:
  content: str
  target_completion: str
  activity: str
  analyse: str
  change: int


@dataclasses.dataclass(frozen=True)
class Reply:
  thinking: str
  origin: str
  change: str
  response: str


def _normalise(text: str) -> str:
  text = unicodedata.normalize("NFKC", text)  # full-width digits and plus
  for sign in _MINUS_SIGNS:
    text = text.replace(sign, "-")
  return text


def _header_pattern(aliases: dict[str, str]) -> re.Pattern:
  names = "|".join(sorted((re.escape(a) for a in aliases), key=len, reverse=True))
  # Optional bullets, '#', numbering ("1.", "2)", "3、"), '*', '_' and brackets around the
  # name; then a colon and the rest of the line, or nothing more on the line.
  return re.compile(
      rf"^[ \t]*(?:[-*>#]+[ \t]*)?(?:\d{{1,2}}[.)、．][ \t]*)?[*_]*[\[【(]?[ \t]*[*_]*"
      rf"(?P<name>{names})[*_]*[ \t]*[\]】)]?[*_]*[ \t]*"
      rf"(?:[:：﹕][*_]*[ \t]*(?P<rest>.*)|[*_]*[ \t]*)$",
      re.IGNORECASE | re.MULTILINE)


_PLANNING_RE = _header_pattern(_PLANNING_ALIASES)
_REPLY_RE = _header_pattern(_REPLY_ALIASES)


def split_sections(text: str, pattern: re.Pattern, aliases: dict[str, str]) -> dict[str, str]:
  """Section key -> body.

  Only the first header of each section splits the text, so a later line
  such as "Reason: ..." inside a monologue stays part of that monologue.
  """
  headers, seen = [], set()
  for match in pattern.finditer(text):
    key = aliases[match.group("name").lower()]
    if key not in seen:
      seen.add(key)
      headers.append((key, match))
  sections: dict[str, str] = {}
  for i, (key, match) in enumerate(headers):
    end = headers[i + 1][1].start() if i + 1 < len(headers) else len(text)
    rest = match.group("rest") or ""
    sections[key] = (rest + text[match.end():end]).strip().strip("*").strip()
  return sections


def parse_change(text: str) -> int:
  """The one signed integer of a `Change:` section.

  Two integers (`40 -> 35`, `从40到35`) are ambiguous, not a change of +40:
  SAGE's first-integer rule would read them so, and the retry is cheap.
  """
  matches = list(_CHANGE_RE.finditer(_normalise(text)))
  if not matches:
    raise BadChangeError(text)
  if len(matches) > 1:
    raise BadChangeError(text, f"{len(matches)} numbers (a range?) instead of one emotion change")
  sign, digits = matches[0].groups()
  if len(digits) > MAX_CHANGE_DIGITS:
    raise BadChangeError(text[:40], f"an emotion change of {len(digits)} digits "
                         f"(at most {MAX_CHANGE_DIGITS})")
  return -int(digits) if sign == "-" else int(digits)


def parse_planning(text: str) -> Planning:
  """Only `Change` is required; a missing judgement section is an empty string."""
  sections = split_sections(text, _PLANNING_RE, _PLANNING_ALIASES)
  if not sections.get("change"):
    raise MissingSectionError("change", "planning")
  return Planning(content=sections.get("content", ""),
                  target_completion=sections.get("target_completion", ""),
                  activity=sections.get("activity", ""), analyse=sections.get("analyse", ""),
                  change=parse_change(sections["change"]))


def parse_reply(text: str, require_all: bool = False) -> Reply:
  """Only `Response:` is required unless `require_all`; the agent sees nothing else."""
  sections = split_sections(text, _REPLY_RE, _REPLY_ALIASES)
  required = REPLY_SECTIONS if require_all else ("response",)
  for key in required:
    if not sections.get(key):
      raise MissingSectionError(key, "reply")
  response = sections["response"].strip().strip('"“”「」').strip()
  if not response:
    raise MissingSectionError("response", "reply")
  return Reply(thinking=sections.get("thinking", ""), origin=sections.get("origin", ""),
               change=sections.get("change", ""), response=response)
