"""Sampling throughput: ours against transformers' generate and Tunix's sampler.

  python -m bench.sampling [--preset=qwen2.5-0.5b] [--batch=8] [--prompt_len=128]
      [--new_tokens=128] [--peers=transformers,tunix] [--out=bench_results/sampling.json]

One random model (Qwen2.5-0.5B shaped by default) is saved in HF layout and
loaded by all three, so they run the same weights. Greedy decoding with no
reachable stop token, so every engine generates exactly --new_tokens.
Ours runs twice: batch calls (`generate`, "ours") and the row API the
continuous rollout engine uses ("ours_rows": per-row cache, decode in chunks
of `decode_chunk_steps`), each compared with every peer. For each engine:
compile (first call) time, prefill throughput (prompt tokens/s of a
one-token generation) and decode throughput (new tokens/s of the rest:
B * (N - 1) / (t_N - t_1)). The engines' timed calls take turns, round by
round, so a shared machine that slows down for a while slows every engine
alike. Also the memory-bandwidth floor of a decode step (weight bytes /
measured copy bandwidth) and a multi-turn comparison: an --turns-turn dialogue
batch with cache reuse against re-prefilling the whole history every turn.
Needs `pip install -e .[bench]`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import numpy as np
from absl import app, flags, logging
from flax import nnx

from models import qwen2
from models.sampler import Sampler
from models.sampling import SamplingParams

_PRESET = flags.DEFINE_string("preset", "qwen2.5-0.5b", "model shape from qwen2.PRESETS")
_BATCH = flags.DEFINE_integer("batch", 8, "prompts per batch")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "prompt tokens")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "new tokens per prompt")
_REPEATS = flags.DEFINE_integer("repeats", 2, "timed runs per measurement (best is kept)")
_PEERS = flags.DEFINE_list("peers", ["transformers", "tunix"], "peers to run beside ours")
_TURNS = flags.DEFINE_integer("turns", 8, "turns of the multi-turn benchmark (0 skips it)")
_TURN_TOKENS = flags.DEFINE_integer("turn_tokens", 16, "user tokens and reply tokens per turn")
_TURN_BATCH = flags.DEFINE_integer("turn_batch", 4, "dialogues in the multi-turn benchmark")
_TURN_PROMPT = flags.DEFINE_integer("turn_prompt", 64, "opening tokens per dialogue")
_OUT = flags.DEFINE_string("out", "bench_results/sampling.json", "JSON results")


def best_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def throughput(engines: dict, batch, prompt_len, new_tokens, repeats) -> tuple[dict, dict]:
  """Name -> throughput of each engine in `engines` (name -> generate(n), which must
  return n new tokens for every row of the batch), and name -> the tokens of its first
  `new_tokens` call.

  The engines take turns: every round times each of them once, so a shared machine that
  slows down for a while slows them all alike; each keeps its best round.
  """
  first_calls, tokens = {}, {}
  for name, generate in engines.items():
    start = time.perf_counter()
    generate(1)
    tokens[name] = generate(new_tokens)  # compiles both shapes where an engine compiles
    first_calls[name] = time.perf_counter() - start
  t_one = {name: float("inf") for name in engines}
  t_all = dict(t_one)
  for _ in range(repeats):
    for name, generate in engines.items():
      t_one[name] = min(t_one[name], best_time(lambda: generate(1), 1))
      t_all[name] = min(t_all[name], best_time(lambda: generate(new_tokens), 1))
      logging.info("%s: best so far %.1f s for %d new tokens, %.1f s for 1", name,
                   t_all[name], new_tokens, t_one[name])
  return {name: {
      "first_calls_s": first_calls[name],
      "prefill_s": t_one[name],
      "prefill_tokens_per_s": batch * prompt_len / t_one[name],
      "decode_s": t_all[name] - t_one[name],
      "decode_tokens_per_s": batch * (new_tokens - 1) / (t_all[name] - t_one[name]),
      "total_s": t_all[name],
  } for name in engines}, tokens


def copy_bandwidth_bytes_per_s(megabytes: int = 512) -> float:
  """Bytes read plus written per second by a large host memory copy."""
  src = np.ones(megabytes * 2**20 // 4, np.float32)
  dst = np.empty_like(src)
  seconds = best_time(lambda: np.copyto(dst, src), 5)
  return 2 * src.nbytes / seconds


def run_ours(path, prompts, unreachable_stop):
  """Our batch calls: generate(n) -> each row's n new tokens, and the sampler."""
  model = qwen2.from_pretrained(path, dtype="float32")
  # Decoding from the sampler's own copy of the weights, as the recipes do
  # (rollout.sampling_dtype), in fp32 like the peers.
  sampler = Sampler(model, stop_token_ids=[unreachable_stop], sampling_dtype="float32")

  def generate(n):
    out = sampler.batch.generate(prompts, SamplingParams(max_new_tokens=n, temperature=0.0))
    assert all(length == n for length in out.lengths)
    return out.tokens

  return generate, sampler


def run_rows(sampler, prompts):
  """Our row API as the continuous rollout engine drives it: rows prefilled into a per-row
  cache, then decoded in chunks of `decode_chunk_steps` steps."""

  def generate(n):
    rows = list(range(len(prompts)))
    rb = sampler.rows.start_rows(len(prompts))
    sampler.rows.prefill_rows(rb, rows, prompts)
    tokens = [[] for _ in rows]
    while len(tokens[0]) < n:
      chunk = sampler.rows.decode_rows(rb, rows, [n - len(t) for t in tokens], SamplingParams(
          max_new_tokens=n, temperature=0.0), keys=None, row_ids=rows,
                                       offsets=[len(t) for t in tokens])
      for t, new in zip(tokens, chunk.tokens):
        t.extend(new)
    return tokens

  return generate


def run_transformers(path, prompts):
  import torch
  import transformers
  model = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  ids = torch.tensor(prompts)

  def generate(n):
    with torch.no_grad():
      out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()

  return generate


class _IdTokenizer:
  """Tunix samples from strings; this one spells token ids as decimal text."""

  def __init__(self, unreachable_stop: int):
    self._stop = unreachable_stop

  def encode(self, text, **_):
    return [int(t) for t in text.split()]

  def decode(self, ids, **_):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return 0

  def eos_id(self):
    return self._stop

  def pad_id(self):
    return 0


def run_tunix(path, config: qwen2.Qwen2Config, prompts, new_tokens, unreachable_stop):
  from tunix.generate import sampler as tunix_sampler
  from tunix.models.qwen2 import model as tunix_model
  from tunix.models.qwen2 import params as tunix_params
  import jax.numpy as jnp

  tunix_config = tunix_model.ModelConfig(
      num_layers=config.num_layers, vocab_size=config.vocab_size, embed_dim=config.hidden_size,
      hidden_dim=config.intermediate_size, num_heads=config.num_heads, head_dim=config.head_size,
      num_kv_heads=config.num_kv_heads, rope_theta=int(config.rope_theta),
      norm_eps=config.rms_norm_eps, use_tied_embedding=config.tie_word_embeddings)
  model = tunix_params.create_model_from_safe_tensors(str(path), tunix_config, dtype=jnp.float32)
  prompt_len = len(prompts[0])
  sampler = tunix_sampler.Sampler(
      model, _IdTokenizer(unreachable_stop),
      tunix_sampler.CacheConfig(cache_size=prompt_len + new_tokens, num_layers=config.num_layers,
                                num_kv_heads=config.num_kv_heads, head_dim=config.head_size))
  texts = [" ".join(map(str, p)) for p in prompts]

  def generate(n):
    out = sampler(texts, max_generation_steps=n, max_prompt_length=prompt_len, temperature=0.0,
                  eos_tokens=[unreachable_stop])
    return [list(map(int, t)) for t in out.tokens]

  return generate


def multi_turn(sampler: Sampler, prompts, turns, turn_tokens, vocab) -> dict:
  """Cache reuse against re-prefilling the whole history, same dialogues, same tokens."""
  rng = np.random.RandomState(1)
  user_turns = [[rng.randint(0, vocab, turn_tokens).tolist() for _ in prompts]
                for _ in range(turns - 1)]
  params = SamplingParams(max_new_tokens=turn_tokens, temperature=0.0)

  def with_reuse():
    convs = sampler.batch.start(len(prompts))
    replies = [sampler.batch.extend(convs, prompts, params).tokens]
    for user in user_turns:
      replies.append(sampler.batch.extend(convs, user, params).tokens)
    return replies

  def with_reprefill():
    histories = [list(p) for p in prompts]
    replies = []
    for turn in range(turns):
      if turn:
        histories = [h + u for h, u in zip(histories, user_turns[turn - 1])]
      out = sampler.batch.generate(histories, params).tokens
      histories = [h + r for h, r in zip(histories, out)]
      replies.append(out)
    return replies

  same = with_reuse() == with_reprefill()  # also compiles every shape both need
  reuse_s = best_time(with_reuse, 1)
  reprefill_s = best_time(with_reprefill, 1)
  return {"turns": turns, "turn_tokens": turn_tokens, "reuse_s": reuse_s,
          "reprefill_s": reprefill_s, "speedup": reprefill_s / reuse_s, "same_tokens": same}


def write(results: dict) -> None:
  """Results so far (a long run that is stopped keeps what it measured)."""
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(results, f, indent=2)


def main(argv):
  del argv
  config = qwen2.PRESETS[_PRESET.value]
  batch, prompt_len, new_tokens = _BATCH.value, _PROMPT_LEN.value, _NEW_TOKENS.value
  unreachable_stop = config.vocab_size  # an id no model can emit
  prompts = np.random.RandomState(0).randint(0, config.vocab_size, (batch, prompt_len)).tolist()
  results = {"preset": _PRESET.value, "batch": batch, "prompt_len": prompt_len,
             "new_tokens": new_tokens, "devices": [str(d) for d in jax.devices()],
             "cpu_count": os.cpu_count(), "engines": {}}

  with tempfile.TemporaryDirectory() as path:
    logging.info("writing a random %s checkpoint", _PRESET.value)
    model = qwen2.init_random(config, seed=0)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    qwen2.save_pretrained(model, path)
    del model

    logging.info("loading the engines")
    generate_ours, sampler = run_ours(path, prompts, unreachable_stop)
    engines = {"ours": generate_ours, "ours_rows": run_rows(sampler, prompts)}
    if "transformers" in _PEERS.value:
      engines["transformers"] = run_transformers(path, prompts)
    if "tunix" in _PEERS.value:
      engines["tunix"] = run_tunix(path, config, prompts, new_tokens, unreachable_stop)
    results["engines"], tokens = throughput(engines, batch, prompt_len, new_tokens,
                                            _REPEATS.value)
    for name in engines:
      if name != "ours":
        results["engines"][name]["same_tokens_as_ours"] = tokens[name] == tokens["ours"]
    ours = results["engines"]["ours"]
    write(results)
    if _TURNS.value:
      logging.info("multi-turn")
      openings = [p[:_TURN_PROMPT.value] for p in prompts[:_TURN_BATCH.value]]
      results["multi_turn"] = multi_turn(sampler, openings, _TURNS.value, _TURN_TOKENS.value,
                                         config.vocab_size)

  bandwidth = copy_bandwidth_bytes_per_s()
  floor_s = weight_bytes / (bandwidth / 2)  # a decode step reads every weight once
  results["weight_bytes"] = weight_bytes
  results["copy_bandwidth_GBps"] = bandwidth / 1e9
  results["decode_step_floor_s"] = floor_s
  results["decode_tokens_per_s_at_floor"] = batch / floor_s
  ours_rows = results["engines"]["ours_rows"]
  for name, r in results["engines"].items():
    if not name.startswith("ours"):
      r["ours_decode_speedup"] = ours["decode_tokens_per_s"] / r["decode_tokens_per_s"]
      r["ours_prefill_speedup"] = ours["prefill_tokens_per_s"] / r["prefill_tokens_per_s"]
      r["ours_rows_decode_speedup"] = (ours_rows["decode_tokens_per_s"]
                                       / r["decode_tokens_per_s"])
  for r in (ours, ours_rows):
    r["decode_step_s"] = r["decode_s"] / (new_tokens - 1)
    r["decode_step_over_floor"] = r["decode_step_s"] / floor_s

  print(f"\n{_PRESET.value}, batch {batch}, prompt {prompt_len}, {new_tokens} new tokens, "
        f"{os.cpu_count()} CPUs, fp32")
  print(f"{'engine':<14}{'first calls s':>14}{'prefill tok/s':>15}{'decode tok/s':>14}"
        f"{'ours/peer dec':>15}{'rows/peer dec':>15}{'ours/peer pre':>15}")
  for name, r in results["engines"].items():
    print(f"{name:<14}{r['first_calls_s']:>14.1f}{r['prefill_tokens_per_s']:>15.1f}"
          f"{r['decode_tokens_per_s']:>14.1f}{r.get('ours_decode_speedup', 1.0):>15.2f}"
          f"{r.get('ours_rows_decode_speedup', 1.0):>15.2f}"
          f"{r.get('ours_prefill_speedup', 1.0):>15.2f}")
  print(f"decode step floor {floor_s * 1e3:.1f} ms ({weight_bytes / 1e9:.2f} GB weights at "
        f"{bandwidth / 2e9:.1f} GB/s read); ours {ours['decode_step_s'] * 1e3:.1f} ms, "
        f"ours (rows) {ours_rows['decode_step_s'] * 1e3:.1f} ms")
  if "multi_turn" in results:
    mt = results["multi_turn"]
    print(f"multi-turn ({_TURN_BATCH.value} dialogues, {_TURN_PROMPT.value}-token openings, "
          f"{mt['turns']} turns x {mt['turn_tokens']} tokens): reuse {mt['reuse_s']:.1f}s"
          f", re-prefill {mt['reprefill_s']:.1f}s, speedup {mt['speedup']:.2f}x, "
          f"same tokens: {mt['same_tokens']}")
  write(results)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
