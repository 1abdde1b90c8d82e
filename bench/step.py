"""Whole training steps on-policy against one-step off-policy (`rollout.off_policy_steps=1`).

  python -m bench.step [--steps=10] [--compile_steps=2] [--out=bench_results/step.json]

The workload: the demo's PPO recipe (configs/demo.py: its tiny Qwen2 and optimizer settings,
--batch_size dialogues a step) against an HTTP simulator: the fake OpenAI-compatible
server of bench/rollout.py (`LatencyServer`, tests/fake_openai.py), whose every answer
waits a log-normal latency fixed by its prompt (median --latency_median_s, 95th percentile
--latency_p95_s), on profiles whose emotion changes vary by prompt (`bench_profiles`).
Both runs start from the same warmed-up tiny policy, in this one process, one after the
other: the on-policy run (a step is its rollout, then its update) and the off-policy run
(step n+1's rollout runs in the background while step n's update runs).

Each run makes --compile_steps + --steps steps; the first --compile_steps (where XLA
compiles the sampler's and the update's programs: the off-policy run's second step still
compiles) are not timed. Written for each run: step_s (mean seconds per timed step; the
median and each step's too), rollout_s, wait_s (seconds a step waited for its dialogues:
all of the rollout on-policy), train_s, compile_s (XLA compile seconds inside the timed
steps), the mean reward and final emotion, the policy lag; and the speedup (on-policy
step_s / off-policy step_s) beside the most overlap can give, (rollout + train) /
max(rollout, train) of the on-policy run.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

import numpy as np
from absl import app, flags, logging

from bench.rollout import LatencyServer, bench_profiles, lognormal_latency, write_results
from configs import demo
from rlver_jax import metrics as metrics_lib
from rlver_jax import tiny, trainer
from rl import system_prompts

_STEPS = flags.DEFINE_integer("steps", 10, "timed steps per run")
_COMPILE_STEPS = flags.DEFINE_integer("compile_steps", 2, "first steps of each run, not timed")
_BATCH = flags.DEFINE_integer("batch_size", 16, "dialogues per step")
_WARMUP = flags.DEFINE_integer("tiny_warmup_steps", 300,
                               "supervised warm-up steps of the tiny policy (the demo's)")
# bench.rollout's flags, shared (importing it defines them): the simulator's latency, the
# seed (profile order, sampling, the tiny policy) and the output file, with this bench's
# defaults.
FLAGS = flags.FLAGS
FLAGS.set_default("latency_median_s", 0.06)
FLAGS.set_default("latency_p95_s", 0.25)
FLAGS.set_default("out", "bench_results/step.json")

TIMED = ("time/step", "time/rollout", "rollout/wait_s", "time/train", "time/compile_s")


def run_config(workdir: str, checkpoint: str, profiles_file: str, server_url: str,
               off_policy_steps: int):
  c = demo.get_config()
  c.workdir = workdir
  c.seed = FLAGS.seed
  c.steps = _COMPILE_STEPS.value + _STEPS.value
  c.batch_size = _BATCH.value
  c.mesh = {"data": 1, "fsdp": 1, "tensor": 1}
  c.policy.tiny_init = False
  c.policy.checkpoint = checkpoint
  c.data.train_profiles = profiles_file
  c.sim_user.backend = "openai"
  c.sim_user.base_url = server_url
  c.sim_user.api_key_env = "BENCH_NO_KEY"
  c.sim_user.max_concurrency = _BATCH.value
  c.rollout.off_policy_steps = off_policy_steps
  c.checkpoint.every = 0
  c.checkpoint.every_minutes = 0.0
  c.checkpoint.export_at_end = False
  c.log_dialogues_every = 0
  c.compile_cache_dir = ""  # each run compiles for itself; compiling is not what is timed
  return c


def summary(records: list[dict]) -> dict:
  timed = records[_COMPILE_STEPS.value:]
  mean = lambda key: float(np.mean([r[key] for r in timed]))
  return {
      "step_s": mean("time/step"),
      "step_s_median": float(np.median([r["time/step"] for r in timed])),
      "rollout_s": mean("time/rollout"), "wait_s": mean("rollout/wait_s"),
      "train_s": mean("time/train"), "compile_s": float(sum(r["time/compile_s"] for r in timed)),
      "steps_timed": len(timed), "compile_steps": _COMPILE_STEPS.value,
      "compile_steps_s": [round(r["time/step"], 3) for r in records[:_COMPILE_STEPS.value]],
      "reward_mean": mean("reward/mean"), "emotion_final_mean": mean("emotion/final_mean"),
      "turns_mean": mean("turns/mean"), "policy_lag": mean("rollout/policy_lag"),
      "per_step_s": [round(r["time/step"], 3) for r in timed],
  }


def main(argv):
  del argv
  trainer.PLOT_EVERY_STEPS = 10**9  # no curve drawn between steps (the off-policy run's
  # background rollout would go on meanwhile, outside any step's time)
  server = LatencyServer([], latency_s=lognormal_latency(FLAGS.latency_median_s,
                                                         FLAGS.latency_p95_s))
  threading.Thread(target=server.serve_forever, daemon=True).start()
  results = {}
  try:
    with tempfile.TemporaryDirectory() as tmp:
      checkpoint = os.path.join(tmp, "policy")
      logging.info("warming up the tiny policy (%d steps)", _WARMUP.value)
      tiny.write_checkpoint(checkpoint, seed=FLAGS.seed, warmup_steps=_WARMUP.value,
                            warmup_helpfulness=demo.get_config().policy.tiny_warmup_helpfulness,
                            system_prompt=system_prompts.resolve(
                                demo.get_config().rollout.system_prompt, language="en",
                                thinking=False))
      profiles_file = os.path.join(tmp, "profiles.jsonl")
      with open(profiles_file, "w") as f:
        for p in bench_profiles(_BATCH.value):
          f.write(json.dumps({**p.__dict__, "cha_group": list(p.cha_group)}) + "\n")
      for name, steps_ahead in (("on_policy", 0), ("off_policy", 1)):
        workdir = os.path.join(tmp, name)
        start = time.perf_counter()
        trainer.Trainer.from_config(run_config(workdir, checkpoint, profiles_file, server.url,
                                               steps_ahead)).run()
        records = metrics_lib.read_appended_jsonl(os.path.join(workdir, "metrics.jsonl"))
        results[name] = {**summary(records), "run_s": time.perf_counter() - start}
        logging.info("%s: %s", name, results[name])
  finally:
    server.shutdown()
  on, off = results["on_policy"], results["off_policy"]
  results["speedup"] = on["step_s"] / off["step_s"]
  results["speedup_bound"] = (on["rollout_s"] + on["train_s"]) / max(on["rollout_s"],
                                                                     on["train_s"])
  results["workload"] = {
      "config": "configs/demo.py (PPO, tiny Qwen2: 2 layers, width 64; float32)",
      "batch_size": _BATCH.value, "simulator": "bench.rollout.LatencyServer (HTTP)",
      "latency_median_s": FLAGS.latency_median_s, "latency_p95_s": FLAGS.latency_p95_s,
      "tiny_warmup_steps": _WARMUP.value, "seed": FLAGS.seed}
  write_results(FLAGS.out, results)


if __name__ == "__main__":
  app.run(main)
