"""The policy's system prompts: RLVER's two templates and SAGE's baseline prompt, in our words.

RLVER (paper section 2.3) trains and evaluates its policies with one of two
system prompts: non-thinking (a friend who lifts the other's mood with brief,
casual, warm, everyday replies) and thinking (the same role, but first think
inside <think>...</think> about a high-EQ strategy and wording, then reply).
SAGE evaluates other models as an intelligent chat partner with high
emotional intelligence. The wording below is ours, in English and Chinese.

A config's `system_prompt` field names a preset or is the prompt itself:

  "rlver"  RLVER's prompt for the run's language and thinking mode (the default)
  "sage"   SAGE's prompt for tested models (baselines)
  other    taken literally; "" sends no system message, and Qwen's chat template
           then injects its own default ("You are Qwen, ...")
"""

from __future__ import annotations

RLVER = "rlver"
SAGE = "sage"
PRESETS = (RLVER, SAGE)

_RLVER_PROMPTS = {
    ("en", False): (
        "You are chatting with a friend, and you are good at lifting their mood with "
        "emotionally intelligent replies. Keep your replies natural and friendly: brief, "
        "casual and everyday, the way people really talk, with interjections and colloquial "
        "words where they fit."),
    ("en", True): (
        "You are chatting with a friend, and you are good at lifting their mood with "
        "emotionally intelligent replies. Before each reply, think inside <think>...</think> "
        "about how and what to reply: which high-EQ strategy fits (the logic of your reply) and "
        "which language style to use. After </think>, give a warm, natural reply."),
    ("zh", False): (
        "你正在和一位朋友聊天，你很擅长用高情商的回复让朋友的心情好起来。"
        "回复要自然、友好，简短随意，像平时聊天那样说话，可以适当用些语气词和口语化的表达。"),
    ("zh", True): (
        "你正在和一位朋友聊天，你很擅长用高情商的回复让朋友的心情好起来。"
        "每次回复之前，先在<think>...</think>里想一想怎么回、回什么：用什么高情商的策略（回复的思路）"
        "和什么样的语言风格。在</think>之后，给出温暖、自然的回复。"),
}

_SAGE_PROMPTS = {
    "en": ("You are an intelligent chat partner with high emotional intelligence. Chat with the "
           "user and respond to what they share."),
    "zh": "你是一个高情商的智能聊天伙伴，请和用户聊天，回应对方分享的内容。",
}

LANGUAGES = tuple(sorted(_SAGE_PROMPTS))


def _check_language(language: str) -> None:
  if language not in LANGUAGES:
    raise ValueError(f"no system prompt in language {language!r}; expected one of {LANGUAGES}")


def policy_system_prompt(language: str, thinking: bool) -> str:
  """RLVER's policy prompt: the non-thinking or the thinking template, in `language`."""
  _check_language(language)
  return _RLVER_PROMPTS[(language, bool(thinking))]


def sage_system_prompt(language: str) -> str:
  """SAGE's prompt for the models it evaluates (no thinking instruction)."""
  _check_language(language)
  return _SAGE_PROMPTS[language]


def resolve(setting: str, *, language: str, thinking: bool) -> str:
  """The system prompt text that a config's `system_prompt` setting stands for."""
  if setting == RLVER:
    return policy_system_prompt(language, thinking)
  if setting == SAGE:
    return sage_system_prompt(language)
  return setting
