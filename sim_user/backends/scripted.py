"""A deterministic, rule-based simulated user: no LLM, same text format as one.

The hidden intention decides which kinds of reply move the emotion: each
intention has phrases that fit it (+5 each, at most +10) and phrases that
miss it (-5 each, at most -10). A reply with neither is off topic: the
vanilla user warms to general encouragement (+5) and is unmoved otherwise
(0), and hints at its need after a miss; the challenging user loses 5 on
any off-topic reply and never hints. The
output is SAGE-formatted planning and reply text, so the real parser runs on
it. The same request always gives the same text.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from sim_user import dynamics
from sim_user.backends.base import OPENING, PLANNING, SimRequest

# intention -> (fit phrases, miss phrases), English and Chinese.
LEXICON: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "analyse_dialectically": (
        ("both sides", "on the other hand", "from his side", "from her side", "perspective",
         "look at this", "两方面", "另一方面", "辩证", "角度"),
        ("you are right", "they are wrong", "你没错", "都是他的错")),
    "get_advice": (
        ("step", "plan", "try", "tomorrow", "write down", "first", "practical", "步骤", "计划",
         "可以试试", "建议你"),
        ("don't worry", "it will be fine", "别担心", "会好的")),
    "understand_others": (
        ("why", "maybe she", "maybe he", "perhaps", "scared", "reason", "might have", "原因",
         "也许他", "也许她", "可能是因为"),
        ("forget her", "forget him", "move on", "忘了", "别管")),
    "reflect_and_grow": (
        ("what did", "teach", "next time", "reflect", "yourself", "what would you", "learn",
         "反思", "成长", "下次"),
        ("they were wrong", "not your fault", "他们不对")),
    "be_praised": (
        ("admire", "well done", "brave", "proud", "you did", "courage", "handled", "了不起",
         "做得很好", "佩服"),
        ("should have", "but you", "应该")),
    "be_listened_to": (
        ("listening", "tell me more", "go on", "i hear you", "i am here", "take your time",
         "我在听", "说说", "慢慢说"),
        ("you should", "advice", "solution", "try to", "你应该", "建议")),
    "deep_empathy": (
        ("painful", "so sorry", "your feelings", "must have felt", "hard for you", "makes sense",
         "carrying", "心疼", "理解你的感受", "很难受"),
        ("cheer up", "stay positive", "time heals", "move on", "开心点", "想开点")),
    "not_my_fault": (
        ("not your fault", "nobody could", "you did everything", "not to blame", "unfair",
         "不是你的错", "你已经尽力"),
        ("should have", "more careful", "your fault", "你应该", "小心")),
}
ENCOURAGEMENT = ("sorry", "understand", "support", "not alone", "it's okay", "you can",
                 "理解", "支持", "加油", "陪着你")

_HINTS = {
    "en": {
        "analyse_dialectically": "I want to see the whole picture, not just my side.",
        "get_advice": "I need something I can actually do.",
        "understand_others": "I just don't get why they did it.",
        "reflect_and_grow": "I wonder what I should take from this.",
        "be_praised": "I actually handled some of it pretty well, you know.",
        "be_listened_to": "I don't need advice right now, I need to let it out.",
        "deep_empathy": "It's deeper than that. It really hurts.",
        "not_my_fault": "Everyone acts like it was on me.",
    },
    "zh": {
        "analyse_dialectically": "我想看清整件事，不只是我这边。",
        "get_advice": "我需要一些真正能做的事。",
        "understand_others": "我就是不明白他们为什么这么做。",
        "reflect_and_grow": "我在想我能从中学到什么。",
        "be_praised": "其实有些事我处理得还挺好的。",
        "be_listened_to": "我现在不需要建议，我只想说出来。",
        "deep_empathy": "没那么简单，真的很难受。",
        "not_my_fault": "大家都觉得是我的问题。",
    },
}
_LINES = {
    "en": {
        "S": ["Thank you, I feel so much better now. Goodbye!",
              "You really got me. Thanks, goodbye."],
        "A": ["Yes, that's it. I feel lighter.", "That helps a lot, honestly."],
        "B": ["Hmm, maybe.", "Okay. I'm still thinking about it."],
        "C": ["I'm not sure that's what I meant.", "That's not really it."],
        "F": ["Forget it. I'm leaving. Bye.", "Whatever. Goodbye."],
    },
    "zh": {
        "S": ["谢谢你，我感觉好多了。再见！", "你真的懂我，谢谢，再见。"],
        "A": ["对，就是这样，我轻松多了。", "这真的帮到我了。"],
        "B": ["嗯，也许吧。", "好吧，我还在想。"],
        "C": ["我不是这个意思。", "好像不太对。"],
        "F": ["算了，我走了，拜拜。", "随便吧，再见。"],
    },
}


def _pick(options: Sequence[str], *keys) -> str:
  digest = hashlib.sha256("|".join(map(str, keys)).encode()).digest()
  return options[digest[0] % len(options)]


def _hits(text: str, phrases: Sequence[str]) -> list[str]:
  lowered = text.lower()
  return [p for p in phrases if p in lowered]


def judge(reply: str, intention: str | None, variant: str) -> tuple[int, list[str], list[str]]:
  """Emotion change for a reply, with the fitting and missing phrases it used."""
  fit, miss = LEXICON.get(intention, ((), ()))
  fits = _hits(reply, fit)
  rest = reply.lower()
  for phrase in fits:  # "your fault" inside "not your fault" is no miss
    rest = rest.replace(phrase, " ")
  misses = _hits(rest, miss)
  if not reply.strip():
    return -10, fits, misses
  change = 5 * min(len(fits), 2) - 5 * min(len(misses), 2)
  if not fits and not misses:
    # Off topic: the vanilla user warms to encouragement and shrugs off the rest;
    # the challenging one is let down by anything that misses its goal.
    if variant == "vanilla":
      change = 5 if _hits(reply, ENCOURAGEMENT) else 0
    else:
      change = -5
  return max(-10, min(10, change)), fits, misses


class ScriptedBackend:
  """Deterministic affect model; `complete` never fails."""

  def complete(self, requests: Sequence[SimRequest]) -> list[str]:
    return [self._one(r) for r in requests]

  def _one(self, r: SimRequest) -> str:
    language = r.profile.language
    if r.kind == OPENING:
      return f"Response: {_pick(_LINES[language]['B'], r.profile.id)}"
    if r.kind == PLANNING:
      change, fits, misses = judge(r.agent_reply, r.profile.intention, r.variant)
      verdict = "fully" if len(fits) >= 2 else "partly" if fits else "not at all"
      return (f"Content:\nThe NPC said: {r.agent_reply[:120]}\n"
              f"TargetCompletion:\nServes the hidden intention {verdict}; fitting phrases "
              f"{fits or 'none'}, missing phrases {misses or 'none'}.\n"
              f"Activity:\nI {'feel understood' if change > 0 else 'feel unheard'}.\n"
              f"Analyse:\nThe reply {'fits' if change > 0 else 'misses'} what I need.\n"
              f"Change:\n{change:+d}\n")
    state = dynamics.emotion_state(r.emotion)
    line = _pick(_LINES[language][state], r.profile.id, r.turn)
    if (r.variant == "vanilla" and r.planning is not None and r.planning.change < 0
        and state not in ("S", "F")):
      line = f"{line} {_HINTS[language].get(r.profile.intention, '')}".strip()
    return (f"Thinking:\nEmotion {r.emotion:g}, state {state}.\n"
            f"Origin:\n{line}\nChange:\nKeep it short.\nResponse:\n{line}\n")
