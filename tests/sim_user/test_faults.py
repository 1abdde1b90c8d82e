"""Fault injection: every hostile answer is one dialogue's problem, never the run's.

A fake OpenAI-compatible server on 127.0.0.1 (tests/fake_openai.py) sends
truncated, trickled, huge, malformed, surrogate-laden and key-echoing answers;
the client retries each, then fails that dialogue with its reason, within its
deadline, and no key reaches a log, a metric, a result or an error.
"""

import json
import logging
import socket
import time

import pytest

from infra.errors import UserInputError
from rlver_jax import tiny
from sim_user import dynamics, profiles, templates
from sim_user.backends.base import BackendError, SimulatorUnavailable
from sim_user.backends.openai_http import HEALTH_PROMPT, OpenAIChatBackend
from sim_user.backends.scripted import ScriptedBackend
from sim_user.config import SimUserConfig
from sim_user.redact import REDACTED, redact
from sim_user.simulator import SimulatedUser
from tests.fake_openai import (BAD_BODIES, HUGE_BODY_BYTES, REPLY_ANSWER, SECRET, backend_for,
                               requests_for)

FAULT_REASONS = {
    "truncated": "truncated", "disconnect": "connection", "reset": "connection",
    "trickle": "timeout", "trickle_body": "timeout", "huge": "too_long", "long": "too_long",
    "echo_auth": "http_500", **{bad: "malformed" for bad in BAD_BODIES},
}


def user_for(backend, parse_retries=0):
  return SimulatedUser(backend, dynamics.RLVER_TRAIN, templates.PromptSet.load(language="en"),
                       max_retries=parse_retries)


def cohort_with(faults):
  """A healthy profile, then one whose every simulator call gets each fault."""
  demo = profiles.load_profiles(profiles.DEMO_PROFILES)
  return [demo[0]] + [profiles.Profile(**{**demo[1].__dict__, "id": fault,
                                          "player": f"{demo[1].player} ALWAYS_{fault}"})
                      for fault in faults]


@pytest.mark.parametrize("fault", sorted(FAULT_REASONS))
def test_each_fault_is_retried_then_answered(serve, monkeypatch, fault):
  server = serve([fault])
  backend = backend_for(server, monkeypatch, timeout_s=1.0)
  start = time.monotonic()
  [result] = backend.complete(requests_for(["hello"]))
  assert result == REPLY_ANSWER
  assert time.monotonic() - start < 3.0
  assert backend.stats[FAULT_REASONS[fault]] == 1
  assert backend.stats["retries_succeeded"] == 1


def test_every_fault_fails_only_its_dialogue_with_a_reason(serve, monkeypatch):
  server = serve([])
  # Time enough for a loaded machine to read the first MiB of the huge answer; a trickled
  # answer would take ~40 s.
  user = user_for(backend_for(server, monkeypatch, timeout_s=1.5))
  dialogues = user.start(cohort_with(FAULT_REASONS))
  user.respond(dialogues, ["I hear you, tell me more."] * len(dialogues))
  healthy, *broken = dialogues
  assert healthy.failure is None and healthy.history[-1]["content"] == "I see. Go on."
  for d in broken:
    assert d.done and f"backend {FAULT_REASONS[d.profile.id]}" in d.failure, d.failure
  assert user.metrics["sim/failed_dialogues"] == len(broken)


def test_timeout_is_a_deadline_for_the_whole_request(serve, monkeypatch):
  # A byte every 0.25 s never trips a per-read timeout; the answer would take ~40 s.
  for fault in ("trickle", "trickle_body"):
    server = serve([fault])
    backend = backend_for(server, monkeypatch, timeout_s=1.0, max_retries=0)
    start = time.monotonic()
    [result] = backend.complete(requests_for(["hello"]))
    elapsed = time.monotonic() - start
    assert isinstance(result, BackendError) and result.reason == "timeout", fault
    assert 0.9 < elapsed < 2.0, (fault, elapsed)


def test_a_huge_body_is_never_read_in_full(serve, monkeypatch):
  server = serve(["huge"])
  backend = backend_for(server, monkeypatch, timeout_s=5.0, max_retries=0)
  start = time.monotonic()
  [result] = backend.complete(requests_for(["hello"]))
  assert isinstance(result, BackendError) and result.reason == "too_long"
  assert time.monotonic() - start < 3.0
  assert backend.max_body_bytes == 1 << 20
  assert server.sent_bytes < HUGE_BODY_BYTES // 4  # the client hung up after ~1 MiB


def test_a_reply_longer_than_max_reply_chars_is_a_fault(serve, monkeypatch):
  server = serve([])
  backend = backend_for(server, monkeypatch, max_reply_chars=len(REPLY_ANSWER) - 1)
  [result] = backend.complete(requests_for(["hello"]))
  assert result.reason == "too_long" and "sim_user.max_reply_chars" in str(result)
  backend.max_reply_chars = len(REPLY_ANSWER)
  assert backend.complete(requests_for(["hello"])) == [REPLY_ANSWER]


def test_a_lone_surrogate_is_replaced_and_the_dialogue_goes_on(serve, monkeypatch):
  server = serve([])
  user = user_for(backend_for(server, monkeypatch))
  [d] = user.start(cohort_with(["surrogate"])[1:])
  user.respond([d], ["I hear you."])
  assert d.failure is None
  reply = d.history[-1]["content"]
  assert reply == "I see.\ufffd Go on."
  text = json.dumps(d.history, ensure_ascii=False)
  text.encode("utf-8")  # no surrogate left anywhere: strict UTF-8 encodes it
  tokenizer = tiny.load_tokenizer()
  ids = tokenizer.apply_chat_template(d.messages(), tokenize=True)
  assert len(ids) > 0 and tokenizer(reply)["input_ids"]


def test_no_key_in_any_log_metric_result_or_error(serve, monkeypatch, caplog):
  server = serve([])
  user = user_for(backend_for(server, monkeypatch, max_retries=2))
  with caplog.at_level(logging.DEBUG):
    dialogues = user.start(cohort_with(["echo_auth", "echo_auth_reply"]))
    user.respond(dialogues, ["I hear you."] * len(dialogues))
  assert server.auth_headers == {f"Bearer {SECRET}"}  # the server did see the key
  _, failed, echoed = dialogues
  assert "http_500" in failed.failure and f"Bearer {REDACTED}" in failed.failure
  assert echoed.failure is None and f"You sent Bearer {REDACTED}." in echoed.history[-1]["content"]
  assert "retry 2/2" in caplog.text and "request_headers" in caplog.text
  with pytest.raises(SimulatorUnavailable) as health_error:
    backend_for(serve(["echo_auth"] * 2), monkeypatch).health_check()
  outputs = [caplog.text, json.dumps(user.metrics), str(health_error.value),
             *(json.dumps({"history": d.history, "failure": d.failure}) for d in dialogues)]
  for output in outputs:
    assert SECRET not in output and "sk-test" not in output, output


def test_redact():
  key = "abcdefgh-123456"
  assert redact(f"got {key} back", [key]) == f"got {REDACTED} back"
  assert redact("Authorization: Bearer zyxwvuts9876") == f"Authorization: Bearer {REDACTED}"
  assert redact("key sk-proj-AbC_12-x and sk-te") == f"key {REDACTED} and sk-te"
  assert redact("http://me:pw@host:8000/v1") == f"http://{REDACTED}@host:8000/v1"
  # Short values are not keys (OPENAI_API_KEY=EMPTY); ordinary words stay.
  assert redact("EMPTY bearer of news, risk-free", ["EMPTY"]) == "EMPTY bearer of news, risk-free"


@pytest.mark.parametrize("credentials", ["sim-user:hunter2pw@", "hunter2pw@"])
def test_credentials_in_the_simulator_url_are_refused_without_echoing_them(credentials):
  config = SimUserConfig(base_url=f"http://{credentials}sim.example/v1", api_key_env="SIM_KEY")
  [problem] = config.problems()  # at start-up, not a DNS error at the first request
  assert problem == (f"base_url='http://{REDACTED}@sim.example/v1': credentials in the URL are "
                     "not sent; give the URL without them and the key in the environment "
                     "variable api_key_env names (`export SIM_KEY=...`)")
  assert not SimUserConfig(base_url="http://sim.example:8000/v1").problems()


def test_health_check_names_the_url_and_the_error(serve, monkeypatch):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # closed again: nothing listens there
  dead = OpenAIChatBackend(f"http://127.0.0.1:{port}/v1", "m", timeout_s=1.0)
  start = time.monotonic()
  with pytest.raises(SimulatorUnavailable, match=f"127.0.0.1:{port}/v1/chat/completions.*"
                     "connection"):
    user_for(dead).check_health()
  assert time.monotonic() - start < 1.0
  assert issubclass(SimulatorUnavailable, UserInputError)  # the CLIs print it as one line

  failing = serve(["500"] * 3)
  with pytest.raises(SimulatorUnavailable, match=f"{failing.url}/chat/completions.*http_500"):
    backend_for(failing, monkeypatch, max_retries=1).health_check()
  assert failing.attempts[HEALTH_PROMPT] == 2  # a busy server gets the usual retries

  busy_once = serve(["500"])
  backend_for(busy_once, monkeypatch, max_retries=1).health_check()
  assert busy_once.attempts[HEALTH_PROMPT] == 2

  healthy = serve([])
  user_for(backend_for(healthy, monkeypatch)).check_health()
  assert healthy.attempts[HEALTH_PROMPT] == 1
  user_for(ScriptedBackend()).check_health()  # nothing to check in-process


def test_retries_that_later_succeeded_are_counted(serve, monkeypatch):
  server = serve(["500", "gibberish"])  # an HTTP retry, then a simulator (parse) retry
  user = user_for(backend_for(server, monkeypatch), parse_retries=1)
  dialogues = user.start(cohort_with([])[:1] * 2)
  user.respond(dialogues, ["I hear you.", "Tell me more."])
  assert all(d.failure is None for d in dialogues)
  calls = 4  # two dialogues, planning and reply
  assert user.metrics["sim/http/http_500"] == calls
  assert user.metrics["sim/http/retries_succeeded"] == calls
  assert user.metrics["sim/retries_succeeded"] == calls
  assert user.metrics["sim/http/ok"] == 2 * calls


def test_bad_settings_are_the_users_mistake(monkeypatch):
  for url in ("", "localhost:8000/v1", "ftp://host/v1"):
    with pytest.raises(UserInputError, match="sim_user.base_url"):
      OpenAIChatBackend(url, "m")
  with pytest.raises(UserInputError, match="sim_user.max_reply_chars"):
    OpenAIChatBackend("http://127.0.0.1:1/v1", "m", max_reply_chars=0)
  monkeypatch.setenv("SIM_KEY", SECRET + "\n")
  backend = OpenAIChatBackend("http://127.0.0.1:1/v1", "m", api_key_env="SIM_KEY")
  with pytest.raises(UserInputError, match=r"\$SIM_KEY") as error:
    backend.health_check()
  assert SECRET not in str(error.value)
