"""A config section's typed home: its fields, their defaults, meanings and checks.

Each section of a run's config (`rl`, `rollout`, `sim_user`, ...) is a frozen
dataclass in the room that uses it, built on `Section`:
  - a field's default is the recipes' default;
  - its meaning is the class's `Attributes:` docstring entry (what
    `python -m rlver_jax.fields` lists);
  - `check(problems)` records each value that cannot work, as "field=value: why".
`rlver_jax/sections.py` assembles the sections into the run configs and checks
them all at start-up, before any checkpoint is loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


class Problems:
  """Collects "field=value: why" lines about one section, its fields named with `prefix`."""

  def __init__(self, section, prefix: str = ""):
    self.section, self.prefix = section, prefix
    self.lines: list[str] = []

  def add(self, line: str) -> None:
    self.lines.append(line)

  def require(self, field: str, ok: Callable[[object], bool], why: str) -> None:
    """Records a problem unless `ok(value)` holds."""
    value = getattr(self.section, field)
    if not ok(value):
      self.add(f"{self.prefix}{field}={value!r}: {why}")

  def one_of(self, field: str, choices) -> None:
    self.require(field, lambda v: v in choices, f"expected one of {tuple(choices)}")

  def given(self, field: str, how: str) -> None:
    if not getattr(self.section, field):
      self.add(f"{self.prefix}{field} is not set: give {how}")

  def nested(self, section, name: str) -> "Problems":
    """The problems of a sub-section `name`, recorded into these lines."""
    inner = Problems(section, f"{self.prefix}{name}.")
    inner.lines = self.lines
    return inner


def at_least(bound) -> Callable[[object], bool]:
  return lambda v: v is not None and v >= bound


def positive(v) -> bool:
  return v is not None and v > 0


def share(v) -> bool:
  return v is not None and 0.0 <= v <= 1.0


@dataclasses.dataclass(frozen=True)
class Section:
  """Base of the typed config sections: `check` records problems; the default has none."""

  def check(self, problems: Problems) -> None:
    del problems

  def problems(self) -> list[str]:
    """This section's problems (and its sub-sections'), as "field=value: why" lines."""
    found = Problems(self)
    check_all(self, found)
    return found.lines


def check_all(section: Section, problems: Problems) -> None:
  """Runs `section.check` and then every sub-section's, each with its dotted prefix."""
  section.check(problems)
  for field in dataclasses.fields(section):
    value = getattr(section, field.name)
    if isinstance(value, Section):
      check_all(value, problems.nested(value, field.name))
