"""A local OpenAI-compatible chat-completions server that injects faults (127.0.0.1 only)."""

import hashlib
import http.server
import json
import threading
import time

PLANNING_ANSWER = ("Content: comfort\nTargetCompletion: partly\nActivity: hmm\n"
                   "Analyse: fine\nChange: +5")
REPLY_ANSWER = "Thinking: t\nOrigin: o\nChange: c\nResponse: I see. Go on."
SECRET = "sk-test-secret-123"


def planning_answer(prompt: str) -> str:
  """+5 by default; prompts mentioning VARY get a change chosen by their hash."""
  if "VARY" not in prompt:
    return PLANNING_ANSWER
  change = (10, 5, -5, -10, 5)[hashlib.sha256(prompt.encode()).digest()[0] % 5]
  return PLANNING_ANSWER.replace("Change: +5", f"Change: {change:+d}")


class FaultyServer(http.server.ThreadingHTTPServer):
  """Answers chat completions; faults are chosen per prompt and attempt.

  A prompt containing "ALWAYS_500" always fails. Otherwise the n-th attempt
  of a prompt gets `script[n]` while there is one: 500, 429, timeout
  (sleeps past the client's timeout), malformed (invalid JSON), slow
  (answers late but in time), empty (JSON without choices); then a real answer.
  """

  daemon_threads = True

  def __init__(self, script):
    super().__init__(("127.0.0.1", 0), _Handler)
    self.script = script
    self.attempts = {}
    self.lock = threading.Lock()
    self.in_flight = 0
    self.max_in_flight = 0
    self.auth_headers = set()

  @property
  def url(self):
    return f"http://127.0.0.1:{self.server_address[1]}/v1"


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
      fault = "500" if "ALWAYS_500" in prompt else (
          server.script[attempt] if attempt < len(server.script) else None)
      # A timed-out request outlives the client's wait; only the others show its concurrency.
      counted = fault != "timeout"
      server.in_flight += counted
      server.max_in_flight = max(server.max_in_flight, server.in_flight)
      server.auth_headers.add(self.headers.get("Authorization"))
    try:
      if fault in ("500", "429"):
        self.send_response(int(fault))
        if fault == "429":
          self.send_header("Retry-After", "0")
        self.end_headers()
        self.wfile.write(b'{"error": "injected"}')
        return
      if fault == "timeout":
        time.sleep(1.0)
      if fault == "slow":
        time.sleep(0.15)
      if fault == "malformed":
        payload = b'{"choices": [ {"message": '
      elif fault == "empty":
        payload = b'{"choices": []}'
      else:
        text = planning_answer(prompt) if "Activity:" in prompt else REPLY_ANSWER
        payload = json.dumps({"choices": [{"message": {"role": "assistant",
                                                       "content": text}}]}).encode()
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.end_headers()
      try:
        self.wfile.write(payload)
      except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
      with server.lock:
        server.in_flight -= counted
