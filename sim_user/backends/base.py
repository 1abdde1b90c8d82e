"""The one interface every simulator backend implements."""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from infra.errors import UserInputError
from sim_user.profiles import Profile

OPENING = "opening"
PLANNING = "planning"
REPLY = "reply"


@dataclasses.dataclass(frozen=True)
class SimRequest:
  """One simulator LLM call.

  LLM backends send `prompt` (the rendered template). The scripted backend
  reads the structured context instead: the same information, no LLM.
  """

  kind: str  # OPENING, PLANNING or REPLY
  prompt: str
  profile: Profile
  variant: str
  emotion: float
  history: tuple  # ({"role", "content"}, ...) so far, the agent's replies as the user saw them
  agent_reply: str = ""  # PLANNING: the reply being judged
  planning: object = None  # REPLY: the parsed Planning of this turn
  turn: int = 0  # agent replies so far


class BackendError(Exception):
  """A call that failed after the backend's own retries; `reason` is for metrics."""

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = reason


class SimulatorUnavailable(UserInputError):
  """The simulator's server gives no well-formed answer to a test request at start-up.

  Most often the URL, model name or key in the config is wrong, or the server
  is down: the CLIs report it as one line naming the URL and the error.
  """


class Backend(Protocol):
  """What every backend implements. A backend that talks to a server also has
  `health_check()` (raises `SimulatorUnavailable`). A backend may count its own
  events in `stats` (a Counter: a server's attempts and retries, the scripted
  user's unreadable replies), which the simulator copies into its metrics as
  sim/<`stats_family`>/<event>."""

  def complete(self, requests: Sequence[SimRequest]) -> list[str | BackendError]:
    """One text (or the error that replaced it) per request, in order. Never raises for
    a single request's failure."""
    ...
