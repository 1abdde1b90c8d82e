"""The simulated user: two backend calls per turn, batched over every live dialogue.

Each user turn is (1) planning: the simulator judges the agent's reply and
states an emotion change; (2) reply: it writes its next message given that
judgement. The opening turn is the profile's `first_talk` or a generated
line. The turn limit is the rule set's: under `sage_benchmark` the agent's
10th reply ends the dialogue with no planning or reply call (SAGE never judges
it), under `rlver_train` the 9th reply is judged and answered, then the
dialogue ends (see `dynamics`). Unparsable output is retried a bounded number
of times; after that the dialogue is ended as failed (`end_failed`: listed,
reward 0 if trained on) or dropped from the batch (`drop`: reward None), and
every fallback is counted in `metrics`. Nothing loops forever and no
dialogue is lost: each one ends with an `end_reason`.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
from typing import Callable, Sequence

from absl import logging

from infra import host_metrics
from sim_user import dynamics, parser
from sim_user.backends.base import OPENING, PLANNING, REPLY, Backend, BackendError, SimRequest
from sim_user.profiles import Profile
from sim_user.templates import PromptSet
from sim_user.thinking import strip_thinking

SIMULATOR_ERROR = "simulator_error"
END_FAILED = "end_failed"
DROP = "drop"

# SAGE and the release end a dialogue when the user's message contains 再见 or 拜拜 (the reply
# prompt tells the user to say one of them in states S and F); our English prompts name
# "goodbye" and "bye". Whole words only: "bye" does not fire inside "Byelorussia".
DEFAULT_GOODBYES = ("goodbye", "bye", "再见", "拜拜")


@dataclasses.dataclass
class Dialogue:
  """One simulated conversation. `history` follows the SAGE result format."""

  profile: Profile
  emotion: float
  history: list = dataclasses.field(default_factory=list)
  emotions: list = dataclasses.field(default_factory=list)  # trajectory, initial first
  agent_turns: int = 0
  end_reason: str | None = None
  failure: str | None = None  # infrastructure failure that ended it
  dropped: bool = False  # excluded from training and scoring
  replies_cut_off: int = 0  # agent replies that hit max_new_tokens (counted by the agent)

  @property
  def done(self) -> bool:
    return self.end_reason is not None

  @property
  def reward(self) -> float | None:
    """max(e_T, 0) / 100; 0 for a dialogue the simulator failed; None when dropped."""
    if self.dropped:
      return None
    return 0.0 if self.failure else dynamics.reward(self.emotion)

  def messages(self) -> list[dict]:
    """The conversation as the agent sees it (simulated user = "user")."""
    return [{"role": m["role"], "content": m["content"]} for m in self.history]


class SimulatedUser:

  # Its event counters (`metrics`, sim/...) sum over hosts (infra/host_metrics.py).
  host_metrics.declare_family("sim/", host_metrics.SUM)

  def __init__(self, backend: Backend, emotion_rules: dynamics.EmotionRules, prompts: PromptSet, *,
               max_retries: int = 2, on_failure: str = END_FAILED,
               goodbye_phrases: Sequence[str] = DEFAULT_GOODBYES,
               target_header: str = "TargetCompletion", max_change: int | None = None,
               max_message_chars: int | None = None):
    if on_failure not in (END_FAILED, DROP):
      raise ValueError(f"on_failure must be {END_FAILED!r} or {DROP!r}, got {on_failure!r}")
    if max_retries < 0:
      raise ValueError(f"max_retries must be >= 0, got {max_retries}")
    self.backend = backend
    self.emotion_rules = emotion_rules
    self.prompts = prompts
    self.max_retries = max_retries
    self.on_failure = on_failure
    self.target_header = target_header
    if max_change is not None and max_change < 1:
      raise ValueError(f"max_change must be >= 1 or None, got {max_change}")
    self.max_change = max_change
    self.max_message_chars = max_message_chars
    self._warned = set()  # the once-a-run warnings given
    words = "|".join(re.escape(p) for p in goodbye_phrases)
    self._goodbye_re = re.compile(rf"(?<![A-Za-z])(?:{words})(?![A-Za-z])", re.IGNORECASE)
    self.metrics: collections.Counter = collections.Counter()
    # respond() may run for several dialogues at once (the continuous rollout engine's
    # thread pool): counts go through one lock, and the backend's own event counts are
    # taken as differences from what was already copied, so none is counted twice.
    self._lock = threading.Lock()
    self._backend_events_seen = collections.Counter(dict(getattr(backend, "stats", {})))

  def says_goodbye(self, text: str) -> bool:
    return bool(self._goodbye_re.search(text))

  # Dialogue life cycle.

  def start(self, profiles: Sequence[Profile]) -> list[Dialogue]:
    """New dialogues, each opened by the simulated user."""
    initial = self.emotion_rules.initial
    dialogues = [Dialogue(profile=p, emotion=initial, emotions=[initial])
                 for p in profiles]
    to_generate = [d for d in dialogues if not d.profile.first_talk]
    for d in dialogues:
      if d.profile.first_talk:
        d.history.append({"role": "user", "content": d.profile.first_talk,
                          "emotion-point": d.emotion})
    requests = [self._request(OPENING, d) for d in to_generate]
    for d, result in zip(to_generate, self._call(requests, parser.parse_reply)):
      if isinstance(result, str):
        self._fail(d, result)
      else:
        d.history.append({"role": "user", "content": self._message(result.response),
                          "emotion-point": d.emotion})
    return dialogues

  def respond(self, dialogues: Sequence[Dialogue], agent_replies: Sequence[str]) -> None:
    """Feeds each live dialogue the agent's reply and runs the user's turn on all of them."""
    if len(dialogues) != len(agent_replies):
      raise ValueError(f"{len(agent_replies)} replies for {len(dialogues)} dialogues")
    live = []
    for d, reply in zip(dialogues, agent_replies):
      if d.done:
        continue
      d.agent_turns += 1
      seen = strip_thinking(reply)
      entry = {"role": "assistant", "content": seen}
      if seen != reply:
        entry["raw_content"] = reply
      d.history.append(entry)
      if dynamics.last_reply_unjudged(self.emotion_rules, d.agent_turns):
        # SAGE: the agent's last reply ends the dialogue; no planning or reply call.
        d.end_reason = dynamics.MAX_TURNS
        self._count(f"sim/end/{d.end_reason}")
        continue
      live.append(d)

    plannings = self._call([self._request(PLANNING, d) for d in live], parser.parse_planning)
    judged = []
    for d, planning in zip(live, plannings):
      if isinstance(planning, str):
        self._fail(d, planning)
        continue
      d.emotion = dynamics.update(self.emotion_rules, d.emotion, self._bounded(planning.change))
      d.emotions.append(d.emotion)
      judged.append((d, planning))

    replies = self._call([self._request(REPLY, d, planning=p) for d, p in judged],
                         parser.parse_reply)
    for (d, planning), reply in zip(judged, replies):
      if isinstance(reply, str):
        self._fail(d, reply)
        continue
      d.history.append({
          "role": "user", "content": self._message(reply.response), "emotion-point": d.emotion,
          "thinking": reply.thinking,
          "planning": {"content": planning.content, "TargetCompletion": planning.target_completion,
                       "activity": planning.activity, "analyse": planning.analyse,
                       "change": planning.change}})
      d.end_reason = dynamics.end_reason(self.emotion_rules, d.emotion, d.agent_turns,
                                         self.says_goodbye(reply.response))
      if d.end_reason:
        self._count(f"sim/end/{d.end_reason}")

  def _bounded(self, change: int) -> int:
    """`change` within [-max_change, max_change]: an answer past the range the prompts ask
    for is clamped to it, as SAGE's benchmark clips every change, and counted (a simulator
    answering +250 would otherwise end every dialogue at 100, reward 1.0)."""
    if self.max_change is None or abs(change) <= self.max_change:
      return change
    bounded = max(-self.max_change, min(self.max_change, change))
    self._count_and_warn_once(
        "sim/change_clamped", "the simulator answered an emotion change of %+d, outside the "
        "prompts' range [-%d, %d]: clamped to %+d", change, self.max_change, self.max_change,
        bounded)
    return bounded

  def _message(self, text: str) -> str:
    """A user message the policy will read, cut to `max_message_chars`: a simulator that
    rambles for megabytes would otherwise be the policy's prompt at every later turn."""
    if self.max_message_chars is None or len(text) <= self.max_message_chars:
      return text
    self._count_and_warn_once(
        "sim/messages_cut", "the simulator wrote a message of %d chars, more than "
        "sim_user.max_message_chars=%d: cut to it", len(text), self.max_message_chars)
    return text[:self.max_message_chars]

  def _count_and_warn_once(self, metric: str, message: str, *args) -> None:
    """Counts `metric`; the first time in this simulated user's life, also warns."""
    with self._lock:
      self.metrics[metric] += 1
      first = metric not in self._warned
      self._warned.add(metric)
    if first:
      logging.warning(message + f" (counted in {metric}; this warning is given once)", *args)

  # Calls, retries and fallbacks.

  def _request(self, kind: str, d: Dialogue, planning=None) -> SimRequest:
    fields = self.prompts.profile_fields(d.profile)
    state = dynamics.emotion_state(d.emotion)
    history = tuple(d.messages())
    if kind == OPENING:
      prompt = self.prompts.render(OPENING, **fields)
    elif kind == PLANNING:
      prompt = self.prompts.render(
          PLANNING, **fields, emotion=f"{d.emotion:g}", emotion_state=state,
          history=self.prompts.history_text(history[:-1]), agent_reply=history[-1]["content"],
          target_header=self.target_header)
    else:
      prompt = self.prompts.render(
          REPLY, **fields, emotion=f"{d.emotion:g}", emotion_state=state,
          state_meanings=self.prompts.state_meanings(),
          state_guidance=self.prompts.state_guidance(state),
          history=self.prompts.history_text(history), target_header=self.target_header,
          target_completion=planning.target_completion, activity=planning.activity,
          analyse=planning.analyse)
    return SimRequest(kind=kind, prompt=prompt, profile=d.profile, variant=self.prompts.variant,
                      emotion=d.emotion, history=history,
                      agent_reply=history[-1]["content"] if kind == PLANNING else "",
                      planning=planning, turn=d.agent_turns)

  def _call(self, requests: list[SimRequest], parse: Callable):
    """Parsed result per request, or the failure reason (a str) after bounded retries."""
    results: list = [None] * len(requests)
    pending = list(range(len(requests)))
    for attempt in range(self.max_retries + 1):
      if not pending:
        break
      if attempt:
        self._count("sim/retries", len(pending))
      outputs = self._complete([requests[i] for i in pending])
      if len(outputs) != len(pending):
        raise RuntimeError(f"backend returned {len(outputs)} results for {len(pending)} requests")
      still_pending = []
      for i, output in zip(pending, outputs):
        kind = requests[i].kind
        if isinstance(output, BackendError):
          self._count(f"sim/backend_errors/{output.reason}")
          results[i] = f"backend {output} in {kind}"
          still_pending.append(i)
          continue
        try:
          results[i] = parse(output)
        except parser.SimulatorParseError as e:
          self._count(f"sim/parse_errors/{kind}")
          results[i] = f"unparsable {kind} output: {e}"
          still_pending.append(i)
          continue
        if attempt:
          self._count("sim/retries_succeeded")
      pending = still_pending
    return results

  def _complete(self, requests: list[SimRequest]) -> list:
    """The backend's outputs; its own events (its `stats`: an HTTP backend's attempts and
    retries, the scripted user's judged and unreadable replies) are added to `metrics` as
    sim/<its stats_family>/<event>."""
    outputs = self.backend.complete(requests)
    stats = getattr(self.backend, "stats", None)
    if stats is not None:
      with self._lock:
        now = collections.Counter(dict(stats))  # dict(): one atomic copy
        for event, count in (now - self._backend_events_seen).items():
          self.metrics[f"sim/{self.backend.stats_family}/{event}"] += count
        self._backend_events_seen = now
    return outputs

  def _count(self, key: str, n: int = 1) -> None:
    with self._lock:
      self.metrics[key] += n

  def check_health(self) -> None:
    """Raises `SimulatorUnavailable` when the backend's server does not answer a test request.

    Only backends that talk to a server have a `health_check`; in-process ones
    (scripted, flax) have nothing that can be down.
    """
    health_check = getattr(self.backend, "health_check", None)
    if health_check is not None:
      health_check()

  def _fail(self, d: Dialogue, reason: str) -> None:
    d.end_reason = SIMULATOR_ERROR
    d.failure = reason
    if self.on_failure == DROP:
      d.dropped = True
      self._count("sim/dropped_dialogues")
    else:
      self._count("sim/failed_dialogues")
