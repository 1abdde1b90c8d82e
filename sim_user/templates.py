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

_PROFILE_FIELDS = ("player", "character", "scene", "task", "variant_rules")
FIELDS = {
    "planning": _PROFILE_FIELDS + ("emotion", "emotion_state", "history", "agent_reply",
                                   "target_header"),
    # The reply call gets what SAGE gives it: the meaning of the emotion levels and of the
    # current one, and the planning call's judgement of the hidden intention, inner monologue
    # and analysis.
    "reply": _PROFILE_FIELDS + ("emotion", "emotion_state", "state_meanings", "state_guidance",
                                "history", "target_header", "target_completion", "activity",
                                "analyse"),
    "opening": _PROFILE_FIELDS,
}

_SPEAKERS = {"en": ("You", "NPC"), "zh": ("你", "NPC")}
# What each emotion state means for the reply (SAGE's five levels, our wording). S and F
# name the goodbye words the simulator listens for.
STATE_MEANINGS = {
    "en": {"S": "You feel fully understood: thank the NPC and say goodbye (\"goodbye\" or "
                "\"bye\"), ending the conversation.",
           "A": "High: the conversation feels good; your feedback is positive.",
           "B": "Medium: you feel neither positive nor negative.",
           "C": "Low: the conversation feels bad; your feedback is negative.",
           "F": "You have had enough and do not want to go on: say goodbye (\"goodbye\" or "
                "\"bye\") and leave."},
    "zh": {"S": "你感到被完全理解：感谢NPC，并用“再见”或“拜拜”告别，结束对话。",
           "A": "高：对话感受比较正面，你的反馈也比较正面。",
           "B": "中：你没有明显正面或负面的感受。",
           "C": "低：对话感受比较负面，你的反馈也比较负面。",
           "F": "你的情绪已到最低，不想再聊：用“再见”或“拜拜”告别，离开对话。"},
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
    traits = "、".join(profile.cha_group) if self.language == "zh" else ", ".join(profile.cha_group)
    character = f"{profile.main_cha} ({traits})" if traits else profile.main_cha
    return {"player": profile.player, "character": character, "scene": profile.scene,
            "task": profile.task, "variant_rules": self.variant_rules}

  def state_guidance(self, state: str) -> str:
    """What the current emotion state (S, A, B, C or F) means for the reply."""
    return STATE_MEANINGS[self.language][state]

  def state_meanings(self) -> str:
    """All five states and their meanings, one per line."""
    return "\n".join(f"{state}: {meaning}"
                     for state, meaning in STATE_MEANINGS[self.language].items())


def _read(path: str) -> str:
  if not os.path.exists(path):
    raise TemplateError(f"{path}: template file not found")
  with open(path, encoding="utf-8") as f:
    return f.read()
