"""Simulator backends: the HTTP client against a faulty local server, and the Flax LLM."""

import http.server
import logging
import threading
import types

import jax
import pytest

from models import qwen2
from models.sampler import Sampler
from models.sampling import SamplingParams
from rlver_jax import simulator_factory
from sim_user import dynamics, profiles, templates
from sim_user.backends.base import BackendError
from sim_user.backends.flax_llm import FlaxLLMBackend
from sim_user.backends.openai_http import OpenAIChatBackend
from sim_user.simulator import SimulatedUser
from tests.fake_openai import REPLY_ANSWER, SECRET, backend_for, requests_for


def test_http_client_retries_every_injected_fault(serve, monkeypatch, caplog):
  server = serve(["500", "429", "timeout", "malformed", "empty", "slow"])
  # "slow" answers after 0.15 s and "timeout" after 1 s: a 0.8 s deadline tells them apart
  # with room for a loaded machine.
  backend = backend_for(server, monkeypatch, max_retries=6, max_concurrency=3, timeout_s=0.8)
  with caplog.at_level(logging.DEBUG):
    results = backend.complete(requests_for([f"prompt {i}" for i in range(5)]))
  assert results == [REPLY_ANSWER] * 5
  for reason in ("http_500", "http_429", "timeout"):
    assert backend.stats[reason] == 5, reason
  assert backend.stats["malformed"] == 10  # invalid JSON, then no choices
  assert backend.stats["ok"] == 5
  assert server.max_in_flight <= 3  # bounded concurrency
  assert server.auth_headers == {f"Bearer {SECRET}"}
  assert SECRET not in caplog.text


def test_http_client_gives_up_after_bounded_retries(serve, monkeypatch):
  server = serve([])
  backend = backend_for(server, monkeypatch, max_retries=2)
  [result] = backend.complete(requests_for(["ALWAYS_500 please"]))
  assert isinstance(result, BackendError) and result.reason == "http_500"
  assert server.attempts["ALWAYS_500 please"] == 3
  assert SECRET not in str(result)


def test_http_client_does_not_retry_a_client_error(monkeypatch):
  class BadRequest(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
      pass

    def do_POST(self):
      self.rfile.read(int(self.headers["Content-Length"]))
      self.send_response(400)
      self.end_headers()
      self.wfile.write(b"bad model name")

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BadRequest)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  try:
    backend = OpenAIChatBackend(f"http://127.0.0.1:{server.server_address[1]}/v1", "m",
                                backoff_s=0.01)
    [result] = backend.complete(requests_for(["x"]))
    assert result.reason == "http_400" and "bad model name" in str(result)
    assert backend.stats["http_400"] == 1
  finally:
    server.shutdown()
    server.server_close()


def test_connection_refused_is_reported_not_raised():
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # closed again: nothing listens there
  backend = OpenAIChatBackend(f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff_s=0.01)
  [result] = backend.complete(requests_for(["x"]))
  assert result.reason == "connection"


def test_every_dialogue_completes_or_fails_with_a_reason(serve, monkeypatch):
  server = serve(["500", "timeout", "malformed", "slow"])
  backend = backend_for(server, monkeypatch, max_retries=5)
  demo = profiles.load_profiles(profiles.DEMO_PROFILES)
  broken = profiles.Profile(**{**demo[1].__dict__, "id": "broken",
                               "player": demo[1].player + " ALWAYS_500"})
  cohort = [demo[0], broken, demo[2], demo[3]]
  user = SimulatedUser(backend, dynamics.RLVER_TRAIN,
                       templates.PromptSet.load(language="en"), max_retries=1)
  dialogues = user.start(cohort)
  for _ in range(2):
    user.respond(dialogues, ["I hear you, tell me more."] * len(dialogues))
  assert len(dialogues) == len(cohort)
  for d in dialogues:
    if d.profile.id == "broken":
      assert d.done and d.failure and "http_500" in d.failure
    else:
      assert d.failure is None and d.emotions == [30, 35, 40]
      assert d.history[-1]["content"] == "I see. Go on."
  assert user.metrics["sim/failed_dialogues"] == 1


@pytest.mark.heavy
def test_flax_llm_backend_answers_every_request(tiny_checkpoint, tokenizer):
  sampler = Sampler(qwen2.from_pretrained(tiny_checkpoint),
                    stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])
  backend = FlaxLLMBackend(sampler, tokenizer, SamplingParams(max_new_tokens=8, temperature=1.0),
                           key=jax.random.key(0), max_batch_size=2, max_prompt_tokens=400)
  prompts = ["short prompt", "another one", "third", "x " * 500]
  results = backend.complete(requests_for(prompts))
  assert all(isinstance(r, str) for r in results[:3])
  assert isinstance(results[3], BackendError) and results[3].reason == "prompt_too_long"
  # A random model writes no sections: the simulator fails those dialogues cleanly.
  backend.max_prompt_tokens = 8192
  user = SimulatedUser(backend, dynamics.RLVER_TRAIN, templates.PromptSet.load(), max_retries=1)
  dialogues = user.start(profiles.load_profiles(profiles.DEMO_PROFILES)[:2])
  user.respond(dialogues, ["hello", "hi"])
  assert all(d.end_reason == "simulator_error" and "unparsable" in d.failure for d in dialogues)


def test_the_flax_simulator_loads_its_checkpoint_itself(tiny_checkpoint, tokenizer):
  cfg = types.SimpleNamespace(backend="flax", checkpoint=tiny_checkpoint, max_tokens=8,
                              temperature=0.5)
  backend = simulator_factory.BACKEND_BUILDERS.lookup("flax")(cfg, None, 3)
  assert isinstance(backend, FlaxLLMBackend)  # FlaxLLMBackend.from_checkpoint, through models/
  assert backend.params.max_new_tokens == 8 and backend.params.temperature == 0.5
  assert len(backend.tokenizer) == len(tokenizer)


class DeadBackend:
  """Every call fails, as when nothing listens at the simulator's URL."""

  def complete(self, requests):
    return [BackendError("connection", "refused") for _ in requests]


def test_config_defaults_drop_failed_training_dialogues_and_list_failed_evaluations():
  from configs import eval as eval_config, ppo
  from infra.errors import UserInputError
  from rlver_jax import simulator_factory
  train_cfg, eval_cfg = ppo.get_config().sim_user, eval_config.get_config().sim_user
  assert (train_cfg.on_failure, eval_cfg.on_failure) == ("drop", "end_failed")
  for cfg in (train_cfg, eval_cfg):
    cfg.backend = "scripted"
  train_user = simulator_factory.make_simulated_user(train_cfg)
  eval_user = simulator_factory.make_simulated_user(eval_cfg)
  train_rules, eval_rules = train_user.emotion_rules, eval_user.emotion_rules
  assert (train_rules.max_agent_turns, train_rules.judge_last_reply) == (9, True)
  assert (eval_rules.max_agent_turns, eval_rules.judge_last_reply) == (10, False)
  assert train_user.target_header == "Reason" and eval_user.target_header == "TargetCompletion"

  # A dialogue the simulator fails is left out of training (reward None, not 0), and listed
  # with its reason, unscored, in evaluation (the evaluator scores only dialogues without one).
  profile = profiles.load_profiles(profiles.DEMO_PROFILES)[0]
  failed = []
  for user in (train_user, eval_user):
    user.backend = DeadBackend()
    [d] = user.start([profile])
    user.respond([d], ["hello"])
    assert "backend connection" in d.failure
    failed.append(d)
  assert failed[0].dropped and failed[0].reward is None
  assert not failed[1].dropped
  assert train_user.metrics["sim/dropped_dialogues"] == eval_user.metrics[
      "sim/failed_dialogues"] == 1

  train_cfg.max_agent_turns = 8  # the paper's count
  assert simulator_factory.make_simulated_user(train_cfg).emotion_rules.max_agent_turns == 8
  train_cfg.max_agent_turns = -1
  with pytest.raises(UserInputError, match="sim_user.max_agent_turns=-1"):
    simulator_factory.make_simulated_user(train_cfg)


def test_every_backend_the_section_accepts_has_a_builder_and_no_other():
  from sim_user import config as sim_config
  assert set(simulator_factory.BACKEND_BUILDERS) == set(sim_config.BACKENDS)
  with pytest.raises(ValueError, match=r"unknown sim_user.backend 'vllm'; expected one of"):
    simulator_factory.BACKEND_BUILDERS.lookup("vllm")
