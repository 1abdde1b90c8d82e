"""The `sim_user` section: which simulated user, how it is reached, which rules it keeps."""

from __future__ import annotations

import dataclasses
import urllib.parse

from infra import config_section
from sim_user import dynamics, redact, templates
from sim_user.simulator import DROP, END_FAILED

BACKENDS = ("openai", "flax", "scripted")
ON_FAILURE = (DROP, END_FAILED)


@dataclasses.dataclass(frozen=True)
class SimUserConfig(config_section.Section):
  """The `sim_user` section (rlver_jax/simulator_factory.py builds it).

  Attributes:
    backend: openai (an HTTP server) | flax (in process) | scripted (rule-based).
    base_url: openai: the server's OpenAI-compatible URL, e.g. http://localhost:8000/v1; no
      user:password@ in it (refused: the key goes in the variable api_key_env names).
    model: openai: the model name sent with each request.
    api_key_env: the environment variable that holds the key (not the key).
    max_concurrency: openai: requests in flight at once.
    timeout_s: openai: seconds to wait for one answer.
    http_retries: openai: retries of a failed request (no answer, 429, 5xx, bad body).
    backoff_s: first retry delay; doubles each retry, capped at 30 s.
    temperature: the simulator's sampling temperature.
    max_tokens: the simulator's tokens per answer.
    max_reply_chars: openai: a longer reply is a fault (retried, then a failed dialogue).
    checkpoint: flax backend: the simulator's HF checkpoint.
    rules: the emotion rules: rlver_train | sage_benchmark.
    variant: the user's prompts: vanilla | challenging.
    language: the simulator's language: zh | en (the released profiles are Chinese).
    templates: a directory of your own templates; empty: ours.
    parse_retries: re-asks of a call whose answer failed or did not parse.
    on_failure: a dialogue the simulator failed: drop (left out of the batch, not trained on
      as reward 0; the training rules' choice) | end_failed (ended, listed unscored; the
      benchmark's).
    max_agent_turns: 0: the rules' own (rlver_train: 9, last judged; sage: 10, last not).
    max_change: openai, flax: the largest |Change| the prompts ask for (ours: -10 to +10). A
      larger answer is clamped to it, as SAGE's benchmark clips every change, counted in
      sim/change_clamped and warned about once. The scripted user's rules keep their own
      range (up to +20).
    max_message_chars: the longest user message the policy reads (an opening, a simulator
      reply) and the longest text of a profile (not its task). Longer is cut to it, warned
      about once (profiles: once per file, naming lines and fields) and counted in
      sim/messages_cut. The released profiles' longest text is 2265 chars (a scene); SAGE's
      recorded user messages are at most 150.
  """
  backend: str = "openai"
  base_url: str = ""
  model: str = "deepseek-v3"
  api_key_env: str = "OPENAI_API_KEY"
  max_concurrency: int = 32
  timeout_s: float = 120.0
  http_retries: int = 4
  backoff_s: float = 1.0
  temperature: float = 0.7
  max_tokens: int = 1024
  max_reply_chars: int = 20000
  checkpoint: str = ""
  rules: str = "rlver_train"
  variant: str = "vanilla"
  language: str = "zh"
  templates: str = ""
  parse_retries: int = 2
  on_failure: str = DROP
  max_agent_turns: int = 0
  max_change: int = 10
  max_message_chars: int = 4000

  def check(self, p: config_section.Problems) -> None:
    p.one_of("backend", BACKENDS)
    p.one_of("rules", sorted(dynamics.RULES))
    p.one_of("variant", templates.VARIANTS)
    p.one_of("language", templates.LANGUAGES)
    p.one_of("on_failure", ON_FAILURE)
    p.require("parse_retries", config_section.at_least(0), "must be >= 0")
    p.require("max_agent_turns", config_section.at_least(0),
              "agent replies per dialogue; must be >= 0 (0: the rule set's own limit)")
    p.require("max_change", config_section.at_least(1), "the largest |Change| a simulator "
              "answer may give; must be >= 1")
    p.require("max_message_chars", config_section.at_least(1), "must be >= 1")
    if not redact.is_env_var_name(self.api_key_env):
      p.add(redact.api_key_env_error(f"{p.prefix}api_key_env"))  # likely the key: never echoed
    if self.backend == "openai":
      p.given("base_url", "the simulator's OpenAI-compatible endpoint, e.g. "
              "--config.sim_user.base_url=http://localhost:8000/v1")
      if "@" in urllib.parse.urlsplit(self.base_url).netloc:
        p.add(self._credentials_in_url_error(p.prefix))
      p.require("http_retries", config_section.at_least(0), "must be >= 0")
      p.require("max_concurrency", config_section.at_least(1), "must be >= 1")
      p.require("timeout_s", config_section.positive, "must be > 0")
      p.require("max_reply_chars", config_section.at_least(1), "must be >= 1")
    if self.backend == "flax":
      p.given("checkpoint", "--config.sim_user.checkpoint=DIR (an HF Qwen2 checkpoint for the "
              "simulator)")

  def _credentials_in_url_error(self, prefix: str) -> str:
    """The refusal of user:password@ in base_url, shown redacted: the client sends no basic
    auth, and urllib would take all of user:password@host for the host (a DNS error)."""
    key_variable = (self.api_key_env if redact.is_env_var_name(self.api_key_env)
                    else "OPENAI_API_KEY")  # a pasted key is not echoed
    return (f"{prefix}base_url={redact.redact(self.base_url)!r}: credentials in the URL are "
            f"not sent; give the URL without them and the key in the environment variable "
            f"{prefix}api_key_env names (`export {key_variable}=...`)")
