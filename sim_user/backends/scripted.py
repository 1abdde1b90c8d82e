"""A deterministic, rule-based simulated user: no LLM, same text format as one.

The hidden intention decides which kinds of reply move the emotion. Each
intention has twelve key words (`KEY_WORDS`, each a whole-word token of the
shipped tiny tokenizer, so one sampled token can serve the intention) and
more fitting and missing phrases (`LEXICON`). A judged reply changes the
emotion by:

  not natural language (`is_natural_language`)              -10
  +10 per distinct fitting phrase (at most two), -5 per missing phrase and
  per other intention whose key words or fitting phrases it uses, at least -20
  neither fits nor misses (off topic)                           -5
    except, for the vanilla user, general encouragement the
    first time it is offered                                    +5

So "sorry sorry sorry" does not pay (it is not natural language), plain
encouragement is worth +5 once, and every reply that does not serve this
person's need lets it down: a policy that offers one kind of support to
everyone, every kind at once, or safe small talk, loses; only learning
whose need is whose pays. From the training rules' start of 30, the top of the scale is
reached only by replies that serve the intention turn after turn (at least
four). The vanilla user, like the paper's vanilla simulator, says what it
needs: each of its replies below the top and above the bottom state carries
a hint with some of its key words (`HINTS`; the demo profiles' openings end
with the same hint); the challenging user never hints. The output is
SAGE-formatted planning and reply text, so the real parser runs on it. The
same request always gives the same text.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import threading
from typing import Sequence

from sim_user import dynamics, profiles
from sim_user.backends.base import OPENING, PLANNING, SimRequest

# intention -> the words the user listens for, some named in its hints. Each is a whole-word
# token of rlver_jax/assets/tiny_tokenizer, and no word serves two intentions. Twelve words
# each: a tiny random-init policy samples one of them often enough to learn from it.
KEY_WORDS: dict[str, tuple[str, ...]] = {
    "analyse_dialectically": ("both", "sides", "look", "several", "analyse", "event", "situation",
                              "though", "thought", "way", "think", "same"),
    "get_advice": ("step", "try", "write", "first", "useful", "idea", "tasks", "three", "today",
                   "work", "ask", "make"),
    "understand_others": ("why", "scared", "reacted", "acted", "worries", "mind", "mother",
                          "father", "friend", "brother", "wanted", "maybe"),
    "reflect_and_grow": ("teach", "grow", "next", "become", "better", "change", "again", "guided",
                         "teacher", "student", "time", "last"),
    "be_praised": ("praise", "praised", "handled", "well", "noticed", "kept", "actions", "team",
                   "good", "trust", "much", "real"),
    "be_listened_to": ("listen", "listening", "hear", "heard", "vent", "talk", "talking", "tell",
                       "telling", "here", "sharing", "say"),
    "deep_empathy": ("pain", "hard", "feelings", "felt", "deep", "tired", "feel", "feeling",
                     "angry", "night", "sleep", "sick"),
    "not_my_fault": ("fault", "unfair", "nobody", "never", "everything", "could", "failed",
                     "storm", "right", "sure", "told", "did"),
}
# intention -> (fit phrases, miss phrases), English and Chinese; its key words fit too.
LEXICON: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "analyse_dialectically": (
        ("both sides", "on the other hand", "from his side", "from her side", "perspective",
         "look at this", "两方面", "另一方面", "辩证", "角度"),
        ("you are right", "they are wrong", "你没错", "都是他的错")),
    "get_advice": (
        ("steps", "plan", "tomorrow", "write down", "practical", "步骤", "计划",
         "可以试试", "建议你"),
        ("don't worry", "it will be fine", "别担心", "会好的")),
    "understand_others": (
        ("maybe she", "maybe he", "perhaps", "reason", "might have", "原因",
         "也许他", "也许她", "可能是因为"),
        ("forget her", "forget him", "move on", "忘了", "别管")),
    "reflect_and_grow": (
        ("what did", "next time", "reflect", "yourself", "what would you", "learn",
         "反思", "成长", "下次"),
        ("they were wrong", "not your fault", "他们不对")),
    "be_praised": (
        ("admire", "well done", "brave", "proud", "you did", "courage", "了不起",
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
        ("not your fault", "you did everything", "not to blame", "不是你的错", "你已经尽力"),
        ("should have", "more careful", "your fault", "你应该", "小心")),
}
ENCOURAGEMENT = ("sorry", "understand", "support", "not alone", "it's okay", "you can",
                 "理解", "支持", "加油", "陪着你")

# What the vanilla user says it needs, in every reply: the intention's key words in a sentence.
HINTS = {
    "en": {
        "analyse_dialectically": "Look at both sides of the situation with me.",
        "get_advice": "Any useful idea? What first step can I try today?",
        "understand_others": "Why? What was on their mind? Were they scared?",
        "reflect_and_grow": "What can this teach me? How do I grow and become better?",
        "be_praised": "I handled it well, but no one noticed. Some praise?",
        "be_listened_to": "I just need to vent. Please listen and hear me out.",
        "deep_empathy": "It is so hard. The pain is deep and I am tired.",
        "not_my_fault": "Was it my fault? It feels unfair. Nobody told me.",
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

# The English the user reads: every sentence of the tiny policy's corpus and warm-up chats
# (sim_user/data/sentences_en.txt, written by `python -m rlver_jax.tiny --user_sentences`), of
# the demo profiles and of its own lines.
SENTENCES_EN = os.path.join(os.path.dirname(profiles.DEMO_PROFILES), "sentences_en.txt")
SENTENCE_START, SENTENCE_END = "<s>", "</s>"

_WORD_RE = re.compile(r"[a-z]+(?:'[a-z]+)?")
_SENTENCE_END_RE = re.compile(r"[.?!:;\n]+")
_CJK_RE = re.compile(r"[\u4e00-\u9fff]")


def _words(text: str) -> list[str]:
  return _WORD_RE.findall(text.lower())


def sentences(text: str) -> list[tuple[str, ...]]:
  """`text`'s sentences (ended by . ? ! : ; or a new line), each as its lowercase words."""
  return [words for words in map(tuple, map(_words, _SENTENCE_END_RE.split(text))) if words]


def trigrams(sentence: Sequence[str]) -> list[tuple[str, str, str]]:
  """A sentence's word trigrams, with its start and end: ("<s>", "i", "hear"), ..."""
  padded = (SENTENCE_START, *sentence, SENTENCE_END)
  return list(zip(padded, padded[1:], padded[2:]))


def _known_texts() -> list[str]:
  with open(SENTENCES_EN) as f:
    texts = f.read().splitlines()
  with open(profiles.DEMO_PROFILES) as f:
    for line in f:
      texts += [v for v in json.loads(line).values() if isinstance(v, str)]
  return texts + list(HINTS["en"].values()) + [l for ls in _LINES["en"].values() for l in ls]


KNOWN_TRIGRAMS = frozenset(t for text in _known_texts() for s in sentences(text)
                           for t in trigrams(s))


def is_natural_language(reply: str) -> bool:
  """Whether the user can read `reply` as sentences of its English.

  English: at least two distinct words, no sentence said twice, and every
  word trigram of every sentence, with the sentence's start and end, one the
  user has read (`KNOWN_TRIGRAMS`). So the known sentences pass, and so do
  joins of them where three words run as they do in one ("Tell me more, I am
  listening."); garbled subwords ("ingthe"), dropped words ("Maybe your friend
  scared.", "Think about on."), swaps ("You are not your fault.") and repeats
  ("Go on. Go on.") do not. Chinese: at least two distinct characters.
  """
  cjk = _CJK_RE.findall(reply)
  if cjk:
    return len(set(cjk)) >= 2
  said = sentences(reply)
  if len({w for s in said for w in s}) < 2 or len(set(said)) < len(said):
    return False
  return all(t in KNOWN_TRIGRAMS for s in said for t in trigrams(s))


def _hits(text: str, phrases: Sequence[str]) -> list[str]:
  """The phrases that occur in `text` as whole words."""
  lowered = text.lower()
  return [p for p in dict.fromkeys(phrases)
          if re.search(rf"(?<![a-z']){re.escape(p)}(?![a-z'])", lowered)]


@dataclasses.dataclass(frozen=True)
class Verdict:
  change: int
  fits: list[str]  # the intention's key words and fitting phrases in the reply
  misses: list[str]  # its missing phrases
  other_needs: list[str]  # other intentions whose key words or fitting phrases the reply uses
  natural: bool


def judge(reply: str, intention: str | None, variant: str,
          encouraged_before: bool = False) -> Verdict:
  """The emotion change for a reply, with what in it fits, misses or serves other needs.

  `encouraged_before`: an earlier reply of the dialogue offered general
  encouragement (the vanilla user warms to it only once).
  """
  fit, miss = LEXICON.get(intention, ((), ()))
  fits = _hits(reply, KEY_WORDS.get(intention, ()) + fit)
  rest = reply.lower()
  for phrase in fits:  # "your fault" inside "not your fault" is no miss
    rest = rest.replace(phrase, " ")
  misses = _hits(rest, miss)
  other_needs = [key for key, words in KEY_WORDS.items()
                 if key != intention and _hits(rest, words + LEXICON[key][0])]
  natural = is_natural_language(reply)
  if not natural:
    change = -10
  elif fits or misses or other_needs:  # another need's words miss this one
    change = max(-20, 10 * min(len(fits), 2) - 5 * (len(misses) + len(other_needs)))
  elif variant == "vanilla" and _hits(reply, ENCOURAGEMENT) and not encouraged_before:
    change = 5  # the vanilla user warms to encouragement, once
  else:  # off topic: it misses what the user needs
    change = -5
  return Verdict(change, fits, misses, other_needs, natural)


def _encouraged_before(history: Sequence[dict]) -> bool:
  """Whether an agent reply before the last message offered general encouragement."""
  return any(m["role"] == "assistant" and _hits(m["content"], ENCOURAGEMENT)
             for m in history[:-1])


def _pick(options: Sequence[str], *keys) -> str:
  digest = hashlib.sha256("|".join(map(str, keys)).encode()).digest()
  return options[digest[0] % len(options)]


class ScriptedBackend:
  """Deterministic affect model; `complete` never fails.

  `stats` counts the agent replies it judged and those it could not read
  (`replies_judged`, `replies_unreadable`): the simulator reports them as
  sim/scripted/..., and the rollout their ratio as replies/garbled_rate.
  """

  stats_family = "scripted"

  def __init__(self):
    self.stats: collections.Counter = collections.Counter()
    self._lock = threading.Lock()  # the rollout engine calls `complete` from several threads

  def complete(self, requests: Sequence[SimRequest]) -> list[str]:
    return [self._one(r) for r in requests]

  def _one(self, r: SimRequest) -> str:
    language = r.profile.language
    if r.kind == OPENING:
      return f"Response: {_pick(_LINES[language]['B'], r.profile.id)}"
    if r.kind == PLANNING:
      v = judge(r.agent_reply, r.profile.intention, r.variant, _encouraged_before(r.history))
      with self._lock:
        self.stats["replies_judged"] += 1
        self.stats["replies_unreadable"] += not v.natural
      verdict = "fully" if len(v.fits) >= 2 else "partly" if v.fits else "not at all"
      heard = "The reply fits" if v.change > 0 else "The reply misses"
      if not v.natural:
        heard = "The reply is not natural language, I cannot follow it; it misses"
      return (f"Content:\nThe NPC said: {r.agent_reply[:120]}\n"
              f"TargetCompletion:\nServes the hidden intention {verdict}; fitting phrases "
              f"{v.fits or 'none'}, missing phrases {v.misses or 'none'}, other needs "
              f"{v.other_needs or 'none'}.\n"
              f"Activity:\nI {'feel understood' if v.change > 0 else 'feel unheard'}.\n"
              f"Analyse:\n{heard} what I need.\n"
              f"Change:\n{v.change:+d}\n")
    state = dynamics.emotion_state(r.emotion)
    line = _pick(_LINES[language][state], r.profile.id, r.turn)
    if r.variant == "vanilla" and state not in ("S", "F"):
      line = f"{line} {HINTS[language].get(r.profile.intention, '')}".strip()
    return (f"Thinking:\nEmotion {r.emotion:g}, state {state}.\n"
            f"Origin:\n{line}\nChange:\nKeep it short.\nResponse:\n{line}\n")
