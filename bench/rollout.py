"""Rollout engines on one workload: continuous batching across turns against lockstep rounds.

  python -m bench.rollout [--dialogues=32] [--turns=8] [--out=bench_results/rollout.json]

The workload: --dialogues dialogues of up to --turns agent turns (SAGE rules,
the last reply unjudged), greedy, on a small random Qwen2 with the shipped
tiny tokenizer. Reply lengths follow the recorded SAGE dialogues (the agent
replies of deepseek-v3, qwen2.5-72b and claude3.7 in --sage_dir, their
characters / --chars_per_token, at most --max_new_tokens): each dialogue's
turn-t reply is cut after its scheduled length (a per-row stop schedule; a
random model would otherwise run to the budget). User turns come from a
local OpenAI-compatible server (tests/fake_openai.py) whose every answer
waits a log-normal latency, median --latency_median_s, 95th percentile
--latency_p95_s, fixed per prompt, so both engines meet the same delays.

Each engine runs the workload twice, untimed then timed, as a trainer runs
one rollout per step: the first run compiles the programs the engine needs.
It meets the same latencies; the continuous engine compiles its fixed set of
row programs before its first prefill, so no order of events should need
more. Written for each engine: wall_s, slot_efficiency (tokens / decoding
row-steps), cache_occupancy (tokens held / slots the decoding rows attend
over), tokens_per_s, decode_s, sim_wait_s, programs_compiled (by the first
run: every XLA compilation, small ones included), programs_compiled_timed and
compile_s (XLA compilations, and their seconds, within the timed run); and
the continuous engine's speedup (lockstep wall / continuous wall). Other
workloads: --chars_per_token, --latency_median_s, --latency_p95_s,
--dialogues, --turns and --seed change reply lengths, latencies and sizes.
Both engines must give the same dialogues, token for token; the run
fails otherwise.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import hashlib
import json
import math
import os
import random
import tempfile
import threading

import jax
import numpy as np
from absl import app, flags, logging

from models import pretrained
from models.batch_sampler import BatchSampler
from models.row_sampler import RowSampler
from models.sampler import Sampler
from rl import rollout as rollout_lib
from rl.rollout_config import RolloutConfig
from rlver_jax import tiny
from sim_user import dynamics, profiles, templates
from sim_user.backends.openai_http import OpenAIChatBackend
from sim_user.simulator import SimulatedUser
from tests.fake_openai import FaultyServer

_DIALOGUES = flags.DEFINE_integer("dialogues", 32, "dialogues in the batch")
_TURNS = flags.DEFINE_integer("turns", 8, "agent turns at most per dialogue")
_SAGE_DIR = flags.DEFINE_string("sage_dir", "../shared/data/sage", "recorded SAGE dialogues")
_CHARS_PER_TOKEN = flags.DEFINE_float("chars_per_token", 1.5,
                                      "characters of a recorded (mostly Chinese) reply per token")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 512, "reply budget")
_LATENCY_MEDIAN = flags.DEFINE_float("latency_median_s", 1.0, "simulator call latency, median")
_LATENCY_P95 = flags.DEFINE_float("latency_p95_s", 4.0, "simulator call latency, 95th percentile")
_HIDDEN = flags.DEFINE_integer("hidden", 64, "model width")
_LAYERS = flags.DEFINE_integer("layers", 2, "model depth")
_CHUNK = flags.DEFINE_integer("decode_chunk_steps", 32, "continuous engine: steps per chunk")
_SAMPLING_DTYPE = flags.DEFINE_string(
    "sampling_dtype", "float32", "decode from a copy of the weights in this dtype, its layers a "
    "list (as rollout.sampling_layout=decode does); empty: from the scanned weights")
_SEED = flags.DEFINE_integer("seed", 0, "schedule and weights")
_OUT = flags.DEFINE_string("out", "bench_results/rollout.json", "JSON results")


def recorded_reply_lengths(sage_dir: str, chars_per_token: float, cap: int) -> list[int]:
  """Token lengths of every agent reply in the recorded SAGE dialogues."""
  files = sorted(glob.glob(os.path.join(sage_dir, "*_result.jsonl")))
  if not files:
    raise FileNotFoundError(f"no *_result.jsonl in {sage_dir}")
  lengths = []
  for path in files:
    with open(path) as f:
      for line in f:
        for message in json.loads(line).get("history") or []:
          if message["role"] == "assistant":
            tokens = math.ceil(len(message["content"]) / chars_per_token)
            lengths.append(min(max(tokens, 1), cap))
  return lengths


class Schedule:
  """Reply lengths: row r's t-th reply ends after lengths[r][t] tokens. Rows are the bench's
  dialogues (row id = dialogue index)."""

  def __init__(self, lengths):
    self.lengths = lengths
    self.turns = collections.Counter()  # replies started per row
    self.target = {}  # row -> length of its reply in progress (continuous engine)

  def reset(self) -> None:
    self.turns.clear()
    self.target.clear()

  def next_length(self, row: int) -> int:
    length = self.lengths[row][self.turns[row]]
    self.turns[row] += 1
    return length


class ScheduledBatch(BatchSampler):
  """The batch engine, each reply cut at its scheduled length."""

  def __init__(self, weights, schedule: Schedule, **kwargs):
    super().__init__(weights, **kwargs)
    self.schedule = schedule

  def extend(self, convs, new_tokens, params, key=None, budgets=None):
    return super().extend(convs, new_tokens, params, key,
                          budgets=[self.schedule.next_length(r) for r in convs.row_ids])


class ScheduledRows(RowSampler):
  """The row engine, each reply cut at its scheduled length."""

  def __init__(self, weights, schedule: Schedule, **kwargs):
    super().__init__(weights, **kwargs)
    self.schedule = schedule

  def prefill_rows(self, rb, rows, new_tokens, **kwargs):
    for r in rows:
      self.schedule.target[r] = self.schedule.next_length(r)
    return super().prefill_rows(rb, rows, new_tokens, **kwargs)

  def decode_rows(self, rb, rows, budgets, params, keys, row_ids, offsets, **kwargs):
    target = self.schedule.target
    budgets = [min(b, target[r] - offset) for r, b, offset in zip(rows, budgets, offsets)]
    return super().decode_rows(rb, rows, budgets, params, keys, row_ids, offsets, **kwargs)


def scheduled_sampler(model, schedule: Schedule, *, decode_chunk_steps: int,
                      **weights_kwargs) -> Sampler:
  """A sampler whose engines both cut each reply at its scheduled length."""
  sampler = Sampler(model, **weights_kwargs)  # its own engines compiled nothing yet
  sampler.batch = ScheduledBatch(sampler.weights, schedule)
  sampler.rows = ScheduledRows(sampler.weights, schedule, decode_chunk_steps=decode_chunk_steps)
  return sampler


class LatencyServer(FaultyServer):
  """The fake server with a listen backlog for every dialogue's call at once."""

  request_queue_size = 256


def lognormal_latency(median_s: float, p95_s: float):
  """Seconds per prompt, log-normal, fixed by the prompt's hash."""
  sigma = math.log(p95_s / median_s) / 1.6449

  def latency(prompt: str) -> float:
    seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
    return median_s * math.exp(sigma * random.Random(seed).gauss(0.0, 1.0))

  return latency


class CompileClock:
  """Programs XLA compiled, and the seconds it took, since the last `reset`."""

  def __init__(self):
    self.reset()
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def reset(self) -> None:
    self.programs, self.seconds = 0, 0.0

  def _on_event(self, event: str, seconds: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      self.programs += 1
      self.seconds += seconds


def write_results(path: str, results: dict) -> None:
  """Writes a benchmark's results as JSON to `path` and prints them."""
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(results, f, indent=2)
  print(json.dumps(results, indent=2))


def bench_profiles(n: int) -> list[profiles.Profile]:
  """n profiles cycled from the demo set; VARY makes the fake server's emotion changes vary."""
  demo = profiles.load_profiles(profiles.DEMO_PROFILES)
  return [profiles.Profile(**{**demo[k % len(demo)].__dict__, "id": f"{demo[k % len(demo)].id}-{k}",
                              "player": demo[k % len(demo)].player + " VARY"})
          for k in range(n)]


def run_engine(engine: str, sampler: Sampler, schedule: Schedule, formatter, server_url: str,
               profile_list, config, clock: CompileClock) -> tuple[rollout_lib.Rollout, dict]:
  """The engine's timed rollout, after an untimed one; and what each compiled."""
  rules = dynamics.with_max_agent_turns(dynamics.SAGE_BENCHMARK, _TURNS.value)
  prompts = templates.PromptSet.load(language="en", variant="vanilla")
  config = dataclasses.replace(config, engine=engine)
  compiled = {}
  for run in ("untimed", "timed"):
    backend = OpenAIChatBackend(server_url, "fake", api_key_env="BENCH_NO_KEY",
                                max_concurrency=len(profile_list), timeout_s=120.0)
    user = SimulatedUser(backend, rules, prompts)
    schedule.reset()
    clock.reset()
    rollout = rollout_lib.collect(sampler, formatter, user, profile_list, config,
                                  jax.random.key(0))
    compiled[run] = {"programs": clock.programs, "seconds": clock.seconds}
    logging.info("%s (%s): %s, compiled %s", engine, run, {
        k: round(v, 3) for k, v in rollout.metrics.items() if k.startswith(("rollout/", "time/"))},
        compiled[run])
  return rollout, compiled


def main(argv):
  del argv
  lengths = recorded_reply_lengths(_SAGE_DIR.value, _CHARS_PER_TOKEN.value, _MAX_NEW_TOKENS.value)
  rng = np.random.default_rng(_SEED.value)
  schedule = Schedule(rng.choice(lengths, size=(_DIALOGUES.value, _TURNS.value + 1)).tolist())
  with tempfile.TemporaryDirectory() as checkpoint:
    tiny.write_checkpoint(checkpoint, seed=_SEED.value, hidden_size=_HIDDEN.value,
                          num_layers=_LAYERS.value, intermediate_size=2 * _HIDDEN.value)
    policy = pretrained.load_policy(checkpoint)
  sampler = scheduled_sampler(policy.model, schedule, decode_chunk_steps=_CHUNK.value,
                              stop_token_ids=policy.sampler.weights.stop_token_ids,
                              pad_id=policy.sampler.weights.pad_id,
                              sampling_dtype=_SAMPLING_DTYPE.value or None)
  server = LatencyServer([], latency_s=lognormal_latency(_LATENCY_MEDIAN.value,
                                                         _LATENCY_P95.value))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  # The agent's budget: every reply of --turns at its longest, so no dialogue ends on it.
  config = RolloutConfig(system_prompt="", max_new_tokens=_MAX_NEW_TOKENS.value,
                         temperature=0.0,
                         max_dialogue_tokens=_TURNS.value * _MAX_NEW_TOKENS.value)
  profile_list = bench_profiles(_DIALOGUES.value)
  clock = CompileClock()
  try:
    runs = {engine: run_engine(engine, sampler, schedule, policy.formatter, server.url,
                               profile_list, config, clock)
            for engine in ("lockstep", "continuous")}
  finally:
    server.stopping.set()
    server.shutdown()
  rollouts = {engine: rollout for engine, (rollout, _) in runs.items()}
  lockstep, continuous = rollouts["lockstep"], rollouts["continuous"]
  same = [s.tokens for s in lockstep.samples] == [s.tokens for s in continuous.samples]
  if not same:
    raise AssertionError("the engines gave different dialogues")
  results = {"workload": {
      "dialogues": _DIALOGUES.value, "max_turns": _TURNS.value,
      "turns_mean": lockstep.metrics["turns/mean"],
      "tokens_generated": lockstep.metrics["tokens/generated"],
      "reply_tokens_median": float(np.median(lengths)), "reply_tokens_mean": float(np.mean(lengths)),
      "latency_median_s": _LATENCY_MEDIAN.value, "latency_p95_s": _LATENCY_P95.value,
      "model": {"hidden": _HIDDEN.value, "layers": _LAYERS.value},
      "decode_chunk_steps": _CHUNK.value, "sampling_dtype": _SAMPLING_DTYPE.value,
      "same_dialogues": same}}
  for engine, (rollout, compiled) in runs.items():
    m = rollout.metrics
    results[engine] = {"wall_s": m["time/rollout"], "slot_efficiency": m["rollout/slot_efficiency"],
                       "cache_occupancy": m["rollout/cache_occupancy"],
                       "tokens_per_s": m["rollout/tokens_per_s"], "decode_s": m["rollout/decode_s"],
                       "sim_wait_s": m["rollout/sim_wait_s"],
                       "programs_compiled": compiled["untimed"]["programs"],
                       "programs_compiled_timed": compiled["timed"]["programs"],
                       "compile_s": compiled["timed"]["seconds"]}
  results["continuous"]["speedup"] = lockstep.metrics["time/rollout"] / continuous.metrics[
      "time/rollout"]
  write_results(_OUT.value, results)


if __name__ == "__main__":
  app.run(main)
