"""A local OpenAI-compatible chat-completions server that injects faults (127.0.0.1 only)."""

import hashlib
import http.server
import json
import re
import socket
import struct
import threading
import time

from sim_user import profiles
from sim_user.backends.base import SimRequest
from sim_user.backends.openai_http import OpenAIChatBackend

PLANNING_ANSWER = ("Content: comfort\nTargetCompletion: partly\nActivity: hmm\n"
                   "Analyse: fine\nChange: +5")
REPLY_ANSWER = "Thinking: t\nOrigin: o\nChange: c\nResponse: I see. Go on."
SECRET = "sk-test-secret-123"
TRICKLE_INTERVAL_S = 0.25
LONG_REPLY_CHARS = 30_000  # more than sim_user.max_reply_chars' default
HUGE_BODY_BYTES = 50 << 20

# Faults whose answer is a 200 with this body.
BAD_BODIES = {
    "malformed": b'{"choices": [ {"message": ',  # invalid JSON
    "empty": b'{"choices": []}',
    "not_object": b'["choices"]',
    "bad_choices": b'{"choices": {"message": {"content": "hi"}}}',
    "null_content": b'{"choices": [{"message": {"role": "assistant", "content": null}}]}',
    "number_content": b'{"choices": [{"message": {"content": 5}}]}',
    "bad_utf8": b'{"choices": [{"message": {"content": "\xff\xfe"}}]}',
    "deep_json": b"[" * 100_000,
    "bigint": b'{"id": ' + b"9" * 5000 + b"}",
}


def planning_answer(prompt: str) -> str:
  """+5 by default; prompts mentioning VARY get a change chosen by their hash."""
  if "VARY" not in prompt:
    return PLANNING_ANSWER
  change = (10, 5, -5, -10, 5)[hashlib.sha256(prompt.encode()).digest()[0] % 5]
  return PLANNING_ANSWER.replace("Change: +5", f"Change: {change:+d}")


class FaultyServer(http.server.ThreadingHTTPServer):
  """Answers chat completions; faults are chosen per prompt and attempt.

  A prompt containing "ALWAYS_<fault>" always gets that fault. Otherwise the
  n-th attempt of a prompt gets `script[n]` while there is one, then a real
  answer. Faults:
    500, 429: that status (429 with Retry-After: 0);
    timeout: answers after 1 s, past the tests' timeouts; slow: after 0.15 s, in time;
    any key of BAD_BODIES: a 200 with that body;
    truncated: a body shorter than its Content-Length; disconnect: closes without
      a word; reset: a TCP reset;
    trickle, trickle_body: the whole answer (or its body) one byte every 0.25 s;
    huge: a 50 MB answer, streamed (`sent_bytes` counts what the client accepted);
    long: a legal answer of LONG_REPLY_CHARS characters;
    gibberish: a legal answer whose text the simulator cannot parse;
    surrogate: a legal answer whose text holds a lone surrogate (\\ud800);
    echo_auth: a 500 whose body echoes the Authorization header;
    echo_auth_reply: a legal answer whose text echoes it.
  """

  daemon_threads = True

  def __init__(self, script, latency_s=None):
    """`latency_s(prompt)`: seconds to wait before answering a prompt (None: at once)."""
    super().__init__(("127.0.0.1", 0), _Handler)
    self.script = script
    self.latency_s = latency_s
    self.attempts = {}
    self.lock = threading.Lock()
    self.in_flight = 0
    self.max_in_flight = 0
    self.auth_headers = set()
    self.sent_bytes = 0
    self.stopping = threading.Event()  # ends trickles and streams when the test is over

  @property
  def url(self):
    return f"http://127.0.0.1:{self.server_address[1]}/v1"

  def serve_forever(self, poll_interval=0.05):  # a short poll: shutdown() returns at once
    super().serve_forever(poll_interval)

  def shutdown(self):
    self.stopping.set()
    super().shutdown()


class _Handler(http.server.BaseHTTPRequestHandler):

  def log_message(self, *args):
    pass

  def do_POST(self):
    server = self.server
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    prompt = body["messages"][0]["content"]
    with server.lock:
      attempt = server.attempts.get(prompt, 0)
      server.attempts[prompt] = attempt + 1
      always = re.search(r"ALWAYS_(\w+)", prompt)
      fault = always.group(1) if always else (
          server.script[attempt] if attempt < len(server.script) else None)
      # A timed-out request outlives the client's wait; only the others show its concurrency.
      counted = fault != "timeout"
      server.in_flight += counted
      server.max_in_flight = max(server.max_in_flight, server.in_flight)
      server.auth_headers.add(self.headers.get("Authorization"))
    try:
      if server.latency_s is not None:
        time.sleep(server.latency_s(prompt))
      self._answer(fault, prompt)
    except (BrokenPipeError, ConnectionResetError):  # the client gave up on this answer
      self.close_connection = True
    finally:
      with server.lock:
        server.in_flight -= counted

  def _answer(self, fault, prompt):
    auth = self.headers.get("Authorization", "")
    if fault in ("500", "429"):
      self._send(int(fault), b'{"error": "injected"}',
                 {"Retry-After": "0"} if fault == "429" else {})
    elif fault == "echo_auth":
      self._send(500, json.dumps({"error": "upstream failed", "request_headers": {
          "Authorization": auth, "Content-Type": "application/json"}}).encode())
    elif fault == "disconnect":
      self.close_connection = True
    elif fault == "reset":
      self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
      self.connection.close()
      self.close_connection = True
    elif fault in BAD_BODIES:
      self._send(200, BAD_BODIES[fault])
    elif fault == "huge":
      self._stream_huge()
    else:
      if fault == "timeout":
        time.sleep(1.0)
      if fault == "slow":
        time.sleep(0.15)
      payload = json.dumps({"choices": [{"message": {
          "role": "assistant", "content": _answer_text(prompt, fault, auth)}}]}).encode()
      if fault == "truncated":
        self._send(200, payload[:len(payload) // 2], content_length=len(payload))
        self.close_connection = True
      elif fault == "trickle":
        self._trickle(_status_and_headers(200, len(payload)) + payload)
      elif fault == "trickle_body":
        self._send(200, b"", content_length=len(payload))
        self._trickle(payload)
      else:
        self._send(200, payload)

  def _send(self, status, payload, headers=None, content_length=None):
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(payload) if content_length is None
                                           else content_length))
    for name, value in (headers or {}).items():
      self.send_header(name, value)
    self.end_headers()
    self.wfile.write(payload)

  def _trickle(self, data):
    for i in range(len(data)):
      if self.server.stopping.wait(TRICKLE_INTERVAL_S):
        break
      self.wfile.write(data[i:i + 1])
    self.close_connection = True

  def _stream_huge(self):
    head = b'{"choices": [{"message": {"content": "'
    tail = b'"}}]}'
    chunk = b"a" * (1 << 16)
    self.wfile.write(_status_and_headers(200, HUGE_BODY_BYTES) + head)
    for _ in range((HUGE_BODY_BYTES - len(head) - len(tail)) // len(chunk)):
      if self.server.stopping.is_set():
        break
      self.wfile.write(chunk)
      with self.server.lock:
        self.server.sent_bytes += len(chunk)
    self.close_connection = True


def _answer_text(prompt, fault, auth):
  """The simulator's planning or reply text, with the fault's addition inside it."""
  if fault == "long":
    return REPLY_ANSWER + " " + "x" * LONG_REPLY_CHARS
  if fault == "gibberish":
    return "no sections here"
  extra = {"surrogate": "\ud800", "echo_auth_reply": f" You sent {auth}."}.get(fault, "")
  if "Activity:" in prompt:
    return planning_answer(prompt).replace("Analyse: fine", "Analyse: fine" + extra)
  return REPLY_ANSWER.replace("I see.", "I see." + extra)


def _status_and_headers(status, content_length):
  return (f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\n"
          f"Content-Length: {content_length}\r\n\r\n").encode()


def backend_for(server, monkeypatch, **kwargs):
  """A client of `server` with the test key, short timeouts and backoffs; `kwargs` override."""
  monkeypatch.setenv("SIM_KEY", SECRET)
  options = dict(api_key_env="SIM_KEY", timeout_s=0.5, backoff_s=0.01, max_backoff_s=0.05,
                 max_retries=1, max_concurrency=16)
  options.update(kwargs)
  return OpenAIChatBackend(server.url, "sim-model", **options)


def requests_for(prompts):
  profile = profiles.load_profiles(profiles.DEMO_PROFILES)[0]
  return [SimRequest(kind="reply", prompt=p, profile=profile, variant="vanilla", emotion=30,
                     history=()) for p in prompts]
