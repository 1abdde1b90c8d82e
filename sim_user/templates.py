"""Prompt templates of the simulated user: files with `$field` placeholders.

A template set is a directory holding `planning_{lang}.txt`, `reply_{lang}.txt`,
`opening_{lang}.txt` and one `{variant}_{lang}.txt` per simulator variant
(`vanilla`, `challenging`). Ours live in `sim_user/prompts/`; point
`--config.sim_user.templates` at a copy to supply your own. Every
placeholder is checked when the set loads, so a typo fails at start-up with
the file's name, not mid-run.
"""

from __future__ import annotations

import dataclasses
import os
import string

from sim_user.profiles import Profile

DEFAULT_DIR = os.path.join(os.path.dirname(__file__), "prompts")
VARIANTS = ("vanilla", "challenging")
LANGUAGES = ("en", "zh")

FIELDS = {
    "planning": ("player", "scene", "task", "variant_rules", "emotion", "emotion_state",
                 "history", "agent_reply", "target_header"),
    "reply": ("player", "scene", "task", "variant_rules", "emotion", "emotion_state",
              "state_guidance", "history", "planning"),
    "opening": ("player", "scene", "task", "variant_rules"),
}

_SPEAKERS = {"en": ("You", "NPC"), "zh": ("你", "NPC")}
_STATE_GUIDANCE = {
    "en": {"S": "You feel fully understood: thank the NPC warmly and say goodbye.",
           "F": "You have had enough: say goodbye and leave the conversation."},
    "zh": {"S": "你感到被完全理解了：真诚地向NPC道谢并说再见。",
           "F": "你已经受够了：说再见并离开对话。"},
}


class TemplateError(ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class PromptSet:
  language: str
  variant: str
  templates: dict  # kind -> (path, string.Template)
  variant_rules: str

  @classmethod
  def load(cls, directory: str | None = None, language: str = "en",
           variant: str = "vanilla") -> "PromptSet":
    directory = directory or DEFAULT_DIR
    if language not in LANGUAGES:
      raise TemplateError(f"language {language!r}: expected one of {LANGUAGES}")
    if variant not in VARIANTS:
      raise TemplateError(f"variant {variant!r}: expected one of {VARIANTS}")
    templates = {}
    for kind, fields in FIELDS.items():
      path = os.path.join(directory, f"{kind}_{language}.txt")
      template = string.Template(_read(path))
      try:
        template.substitute({f: "" for f in fields})
      except KeyError as e:
        raise TemplateError(f"{path}: unknown placeholder ${e.args[0]}; "
                            f"this template may use {', '.join('$' + f for f in fields)}") from None
      except ValueError as e:
        raise TemplateError(f"{path}: {e} (write $$ for a literal $)") from None
      templates[kind] = (path, template)
    rules = _read(os.path.join(directory, f"{variant}_{language}.txt")).strip()
    return cls(language=language, variant=variant, templates=templates, variant_rules=rules)

  def render(self, kind: str, **fields) -> str:
    return self.templates[kind][1].substitute(fields)

  def history_text(self, history) -> str:
    user, agent = _SPEAKERS[self.language]
    lines = [f"{user if m['role'] == 'user' else agent}: {m['content']}" for m in history]
    return "\n".join(lines) if lines else "(nothing yet)"

  def profile_fields(self, profile: Profile) -> dict:
    return {"player": profile.player, "scene": profile.scene, "task": profile.task,
            "variant_rules": self.variant_rules}

  def state_guidance(self, state: str) -> str:
    return _STATE_GUIDANCE[self.language].get(state, "")


def _read(path: str) -> str:
  if not os.path.exists(path):
    raise TemplateError(f"{path}: template file not found")
  with open(path, encoding="utf-8") as f:
    return f.read()
