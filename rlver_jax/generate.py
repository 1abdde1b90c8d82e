"""Batch generation and interactive chat with a Qwen2 checkpoint.

  python -m rlver_jax.generate --checkpoint DIR --prompts IN.jsonl --output OUT.jsonl \\
      [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S] [--batch-size B]
  python -m rlver_jax.generate --checkpoint DIR --chat

Each input line is {"messages": [...]} (rendered with the checkpoint's chat
template), {"prompt": "..."} (plain text, encoded as is) or {"input_ids": [...]};
only "messages" and --chat need a tokenizer with a chat template. Each output line, in
input order, has output_ids, logprobs, text and stop_reason. Temperature 0
is greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
from absl import logging
from tqdm import tqdm

from infra.errors import UserInputError
from models import partitioning, pretrained
from models.chat import ChatFormatter
from models.sampling import SamplingParams
from rl import keys
from rlver_jax import builder, sharding
from sim_user.jsonl import json_error_at


class InputError(UserInputError):
  """A bad input line or file; the message names the line."""


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m rlver_jax.generate", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", required=True, help="HF Qwen2 checkpoint directory")
  p.add_argument("--prompts", help="input JSONL")
  p.add_argument("--output", help="output JSONL")
  p.add_argument("--chat", action="store_true", help="talk to the checkpoint in the terminal")
  p.add_argument("--max-new-tokens", "--max_new_tokens", type=int, default=256)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-p", "--top_p", type=float, default=1.0)
  p.add_argument("--top-k", "--top_k", type=int, default=0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch-size", "--batch_size", type=int, default=8)
  p.add_argument("--dtype", default="float32", help="compute dtype (bfloat16 on accelerators)")
  p.add_argument("--mesh", default="", help="mesh axes, e.g. data=1,fsdp=-1,tensor=2")
  p.add_argument("--stop", default="<|im_end|>,<|endoftext|>",
                 help="comma-separated stop tokens")
  p.add_argument("--system", default=None, help="system prompt for --chat")
  args = p.parse_args(argv)
  if not args.chat and not (args.prompts and args.output):
    p.error("give --prompts and --output, or --chat")
  return args


def read_requests(path: str, formatter: ChatFormatter, vocab_size: int) -> list[list[int]]:
  """Token ids per input line; every bad line is reported with its number."""
  requests, errors = [], []
  with open(path) as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        requests.append(_request_ids(line, formatter, vocab_size))
      except InputError as e:
        errors.append(f"{path}:{line_no}: {e}")
  if errors:
    shown = "\n".join(errors[:20]) + (f"\n... {len(errors) - 20} more" if len(errors) > 20 else "")
    raise InputError(f"{len(errors)} bad input line(s):\n{shown}")
  if not requests:
    raise InputError(f"{path}: no requests")
  return requests


def _request_ids(line: str, formatter: ChatFormatter, vocab_size: int) -> list[int]:
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    raise InputError(f"invalid JSON ({json_error_at(e)})") from None
  if not isinstance(obj, dict):
    raise InputError("expected a JSON object")
  keys = [k for k in ("messages", "prompt", "input_ids") if k in obj]
  if len(keys) != 1:
    raise InputError(f"expected exactly one of 'messages', 'prompt', 'input_ids'; got {keys}")
  if "messages" in obj:
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
      raise InputError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
      if not (isinstance(m, dict) and isinstance(m.get("role"), str)
              and isinstance(m.get("content"), str)):
        raise InputError(f"messages[{i}] needs string 'role' and 'content'")
    if not formatter.has_template:
      raise InputError("'messages' need a chat template and this checkpoint's tokenizer has "
                       "none; give the text as 'prompt' or the tokens as 'input_ids'")
    ids = formatter.prompt_ids(messages)
  elif "prompt" in obj:
    if not isinstance(obj["prompt"], str) or not obj["prompt"]:
      raise InputError("'prompt' must be a non-empty string")
    ids = formatter.encode(obj["prompt"])
  else:
    ids = obj["input_ids"]
    if (not isinstance(ids, list) or not ids
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
      raise InputError("'input_ids' must be a non-empty list of integers")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
      raise InputError(f"'input_ids' has ids outside [0, {vocab_size}): {bad[:5]}")
  if not ids:
    raise InputError("the request renders to no tokens")
  return ids


def load(args) -> pretrained.Policy:
  stops = [name.strip() for name in args.stop.split(",") if name.strip()]
  return builder.generation_policy(args.checkpoint, args.dtype,
                                   partitioning.parse_mesh(args.mesh), stops,
                                   require_chat_template=args.chat)


def sampling_params(args) -> SamplingParams:
  return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p)


def run_batch(args) -> None:
  policy = load(args)
  requests = read_requests(args.prompts, policy.formatter, policy.model.config.vocab_size)
  params = sampling_params(args)
  start, new_tokens = time.perf_counter(), 0
  with open(args.output, "w") as out, tqdm(total=len(requests), unit="prompt") as bar:
    for first in range(0, len(requests), args.batch_size):
      batch = requests[first:first + args.batch_size]
      result = policy.sampler.batch.generate(batch, params,
                                       keys.batch(args.seed, keys.GENERATION, first))
      for tokens, logprobs, text, reason in zip(result.tokens, result.logprobs,
                                                result.texts(policy.tokenizer),
                                                result.stop_reasons):
        out.write(json.dumps({"output_ids": tokens, "logprobs": logprobs, "text": text,
                              "stop_reason": reason}) + "\n")
      new_tokens += sum(result.lengths)
      bar.update(len(batch))
      bar.set_postfix(tok_per_s=f"{new_tokens / (time.perf_counter() - start):.1f}")
  logging.info("%d prompts, %d new tokens in %.1fs -> %s", len(requests), new_tokens,
               time.perf_counter() - start, args.output)


def run_chat(args, stdin=sys.stdin, stdout=sys.stdout) -> None:
  """A terminal conversation; the dialogue's cache is reused from turn to turn."""
  policy = load(args)
  formatter, sampler = policy.formatter, policy.sampler
  messages = [{"role": "system", "content": args.system}] if args.system else []
  params, chat_key = sampling_params(args), keys.batch(args.seed, keys.GENERATION, 0)
  convs, turn = None, 0
  stdout.write("Chat with the checkpoint; an empty line or EOF ends it.\n")
  while True:
    stdout.write("you> ")
    stdout.flush()
    line = stdin.readline()
    if not line.strip():
      break
    user = {"role": "user", "content": line.rstrip("\n")}
    if convs is None:
      ids = formatter.prompt_ids(messages + [user])
      convs = sampler.batch.start(1)
    else:
      ids = formatter.continuation_ids(messages, convs.reply_ended[0], [user])
    result = sampler.batch.extend(convs, [ids], params, keys.turn(chat_key, turn))
    reply = result.texts(policy.tokenizer)[0]
    messages += [user, {"role": "assistant", "content": reply}]
    turn += 1
    stdout.write(f"model> {reply}\n")


def main(argv=None) -> int:
  args = parse_args(argv)
  logging.set_verbosity(logging.INFO)
  sharding.cpu_unless_accelerators()
  logging.info("JAX devices: %s", jax.devices())
  try:
    run_chat(args) if args.chat else run_batch(args)
  except (InputError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
