"""Simulated-user profiles (RLVER / SAGE JSONL) with validation that names file, line and field."""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

from absl import logging

from infra.errors import UserInputError
from sim_user.jsonl import iter_jsonl

DEMO_PROFILES = os.path.join(os.path.dirname(__file__), "data", "demo_profiles.jsonl")

# The eight hidden intentions. Keys are ours; each lists phrases that identify
# it in the released Chinese profiles and in English ones.
INTENTIONS: dict[str, tuple[str, ...]] = {
    "analyse_dialectically": ("辩证地分析", "analyse the event from several sides",
                              "analyze the event dialectically"),
    "get_advice": ("真实帮助你解决", "useful, concrete advice", "useful advice"),
    "understand_others": ("其他人物这么做的原因", "understand why"),
    "reflect_and_grow": ("自我反思", "reflect and grow"),
    "be_praised": ("夸奖", "praised"),
    "be_listened_to": ("倾听你的情绪宣泄", "listened to", "listen while"),
    "deep_empathy": ("深刻共情", "deep empathy"),
    "not_my_fault": ("没有任何责任和错误", "not their fault", "not my fault", "not your fault"),
}
RATIONAL = ("analyse_dialectically", "get_advice", "understand_others", "reflect_and_grow")
EMOTIONAL = ("be_praised", "be_listened_to", "deep_empathy", "not_my_fault")

_REQUIRED_TEXT = ("id", "player", "scene", "main_cha", "task")
_OPTIONAL_TEXT = ("first_talk", "topic")
# Every field a profile may carry (the authors' train and test files carry only these);
# any other is likely a misspelling, warned about once per file.
KNOWN_FIELDS = _REQUIRED_TEXT + _OPTIONAL_TEXT + ("cha_group",)
_CUTS_NAMED = 5  # the cut texts a warning names; it counts the rest
# The texts `max_chars` cuts: not the id, nor the task (its words name the hidden intention).
_CUT_FIELDS = ("player", "scene", "main_cha", "first_talk", "topic")


class ProfileError(UserInputError):
  """A profile file or line that cannot be used; the message names where and why."""


@dataclasses.dataclass(frozen=True)
class Profile:
  id: str
  player: str  # persona
  scene: str  # background, reactions by emotion level, hidden theme
  main_cha: str  # main personality type
  cha_group: tuple[str, ...]  # sub-traits
  task: str  # the hidden intention, in the profile's own words
  first_talk: str | None = None  # preset opening line (test set only)
  topic: str | None = None

  @property
  def intention(self) -> str | None:
    return intention_of(self.task)

  @property
  def language(self) -> str:
    text = self.task + self.player[:200]
    return "zh" if any("\u4e00" <= ch <= "\u9fff" for ch in text) else "en"


def intention_of(task: str) -> str | None:
  """Our key for a hidden-intention text, or None if it is none of the eight."""
  lowered = task.lower()
  for key, phrases in INTENTIONS.items():
    if any(p.lower() in lowered for p in phrases):
      return key
  return None


def _field_error(path, line_no, field, message) -> ProfileError:
  return ProfileError(f"{path}:{line_no}: field {field!r}: {message}")


def parse_profile(obj, path: str = "<profile>", line_no: int = 0) -> Profile:
  if not isinstance(obj, dict):
    raise ProfileError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
  values = {}
  for field in _REQUIRED_TEXT:
    if field not in obj:
      raise _field_error(path, line_no, field, "missing")
    value = obj[field]
    if not isinstance(value, str) or not value.strip():
      raise _field_error(path, line_no, field, "must be a non-empty string")
    values[field] = value
  for field in _OPTIONAL_TEXT:
    value = obj.get(field)
    if value is not None and not isinstance(value, str):
      raise _field_error(path, line_no, field, "must be a string when present")
    values[field] = value or None
  if intention_of(values["task"]) is None:
    raise _field_error(path, line_no, "task", "names none of the eight hidden intentions; it must "
                       "contain one of these phrases: " + "; ".join(
                           f"{key}: {' / '.join(map(repr, phrases))}"
                           for key, phrases in INTENTIONS.items()))
  group = obj.get("cha_group", [])
  if isinstance(group, str):
    group = [group]
  if not isinstance(group, list) or not all(isinstance(g, str) for g in group):
    raise _field_error(path, line_no, "cha_group", "must be a list of strings")
  return Profile(cha_group=tuple(group), **values)


def iter_profiles(path: str, max_chars: int | None = None) -> Iterator[Profile]:
  """The file's profiles; fields outside KNOWN_FIELDS are warned about once, at its end.

  With `max_chars` (`sim_user.max_message_chars`), a text field longer than that is cut to
  it, and the cuts are reported once for the file, with their lines and fields: a megabyte
  opening would otherwise be the policy's prompt at every turn of its dialogues.
  """
  unknown_first_line: dict[str, int] = {}
  cuts = []  # (line, field, length)
  for line_no, obj in iter_jsonl(path, ProfileError):
    profile = parse_profile(obj, path, line_no)
    for field in obj:
      if field not in KNOWN_FIELDS:
        unknown_first_line.setdefault(field, line_no)
    if max_chars is not None:
      long_texts = {field: text for field in _CUT_FIELDS
                    if len(text := getattr(profile, field) or "") > max_chars}
      cuts += [(line_no, field, len(text)) for field, text in long_texts.items()]
      profile = dataclasses.replace(profile, **{field: text[:max_chars]
                                                for field, text in long_texts.items()})
    yield profile
  if unknown_first_line:
    logging.warning("%s: ignoring unknown field(s) %s; known fields: %s", path,
                    ", ".join(f"{field!r} (line {line_no})"
                              for field, line_no in unknown_first_line.items()),
                    ", ".join(KNOWN_FIELDS))
  if cuts:
    named = ", ".join(f"line {line} {field!r} ({length} chars)"
                      for line, field, length in cuts[:_CUTS_NAMED])
    more = f" and {len(cuts) - _CUTS_NAMED} more" if len(cuts) > _CUTS_NAMED else ""
    logging.warning("%s: %d text(s) longer than sim_user.max_message_chars=%d cut to it: %s%s",
                    path, len(cuts), max_chars, named, more)


def load_profiles(path: str, max_chars: int | None = None) -> list[Profile]:
  """All profiles of a JSONL file; duplicate ids are an error. With `max_chars`, a text
  longer than that is cut to it (`iter_profiles`)."""
  profiles = list(iter_profiles(path, max_chars))
  if not profiles:
    raise ProfileError(f"{path}: no profiles")
  seen = {}
  for index, profile in enumerate(profiles):
    if profile.id in seen:
      raise ProfileError(f"{path}: profile id {profile.id!r} appears twice "
                         f"(profiles {seen[profile.id] + 1} and {index + 1})")
    seen[profile.id] = index
  return profiles

