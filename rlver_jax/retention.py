"""Capability retention: exact-answer math and verifiable instruction following.

  python -m rlver_jax.retention --config=configs/retention.py --config.policy.checkpoint=DIR \
      --config.retention.task=math --config.retention.data=gsm8k_test.jsonl --config.workdir=W

Tasks:
  math    JSONL with "question" (or "problem") and "answer": GSM8K's "... #### 42" or
          MATH500's final answer. The model is asked for \\boxed{...}; its last boxed
          answer (else its last number) must equal the reference (numerically when
          both are numbers, else after light LaTeX normalisation).
  ifeval  JSONL with "prompt" and "instructions": a list of checks, e.g.
          {"type": "max_words", "value": 50}; a response scores only if every check
          passes (strict accuracy). Check types: see CHECKS.
Instead of a file, `retention.tfds_name` (with `tfds_data_dir`, `split`) reads a
prepared TensorFlow Datasets copy, e.g. gsm8k, without downloading.
Writes W/retention_TASK.jsonl (one line per item) and W/retention_TASK_summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable

import jax
from absl import logging
from tqdm import tqdm

from infra.errors import UserInputError
from models.sampling import SamplingParams
from rl import keys
from rlver_jax import builder, cli, multihost, sections, sharding, watchdog
from rlver_jax import workdir as workdir_lib
from sim_user.jsonl import iter_jsonl
from sim_user.thinking import strip_thinking

MATH_INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."


class RetentionDataError(UserInputError):
  """A retention data file or item that cannot be used; the message names file, line and field."""


# Math answers.

def last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} (braces balanced), or None."""
  start = text.rfind("\\boxed{")
  if start < 0:
    return None
  depth, i = 0, start + len("\\boxed")
  for j in range(i, len(text)):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i + 1:j]
  return None


_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
  boxed = last_boxed(text)
  if boxed is not None:
    return boxed
  numbers = _NUMBER_RE.findall(text)
  return numbers[-1] if numbers else None


def reference_answer(answer: str) -> str:
  """GSM8K references end with '#### 42'; others are the answer itself."""
  return answer.split("####")[-1].strip() if "####" in answer else answer.strip()


def normalise(answer: str) -> str:
  a = answer.strip().strip("$").strip()
  a = re.sub(r"\\(left|right|!|,|;|:|displaystyle)", "", a)
  a = re.sub(r"\\text\{([^}]*)\}", r"\1", a)
  a = a.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace(" ", "")
  return a.rstrip(".")


def _as_number(answer: str) -> float | None:
  a = normalise(answer).replace(",", "")
  match = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", a)
  try:
    if match:
      return float(match.group(1)) / float(match.group(2))
    return float(a.rstrip("%"))
  except (ValueError, ZeroDivisionError):
    return None


def answers_match(predicted: str | None, reference: str) -> bool:
  if predicted is None:
    return False
  p, r = _as_number(predicted), _as_number(reference)
  if p is not None and r is not None:
    return abs(p - r) <= 1e-6 * max(1.0, abs(r))
  return normalise(predicted) == normalise(reference)


# Instruction-following checks: name -> (response, check dict) -> bool.

def _words(text):
  return re.findall(r"\b\w+\b", text)


def _paragraphs(text):
  return [p for p in re.split(r"\n\s*\n", text.strip()) if p.strip()]


def _is_json(text):
  body = text.strip()
  if body.startswith("```"):
    body = body.strip("`").removeprefix("json").strip()
  try:
    json.loads(body)
    return True
  except json.JSONDecodeError:
    return False


CHECKS: dict[str, Callable[[str, dict], bool]] = {
    "max_words": lambda r, c: len(_words(r)) <= c["value"],
    "min_words": lambda r, c: len(_words(r)) >= c["value"],
    "contains": lambda r, c: c["value"].lower() in r.lower(),
    "not_contains": lambda r, c: c["value"].lower() not in r.lower(),
    "lowercase": lambda r, c: r == r.lower(),
    "uppercase": lambda r, c: r == r.upper(),
    "no_commas": lambda r, c: "," not in r,
    "starts_with": lambda r, c: r.strip().startswith(c["value"]),
    "ends_with": lambda r, c: r.strip().endswith(c["value"]),
    "num_bullets": lambda r, c: len(re.findall(r"^\s*[*-]\s", r, re.MULTILINE)) == c["value"],
    "num_paragraphs": lambda r, c: len(_paragraphs(r)) == c["value"],
    "json": lambda r, c: _is_json(r),
    "title": lambda r, c: re.search(r"<<[^>\n]+>>", r) is not None,
}
# The checks that read c["value"], and the type it must have.
CHECK_VALUE_TYPES: dict[str, type] = {
    "max_words": int, "min_words": int, "num_bullets": int, "num_paragraphs": int,
    "contains": str, "not_contains": str, "starts_with": str, "ends_with": str,
}


def check_instructions(response: str, instructions: list[dict]) -> list[bool]:
  return [CHECKS[i["type"]](response, i) for i in instructions]


# Data.

def read_items(path: str, task: str) -> list[dict]:
  items = [_validate(obj, task, f"{path}:{line_no}")
           for line_no, obj in iter_jsonl(path, RetentionDataError)]
  if not items:
    raise RetentionDataError(f"{path}: no items")
  return items


def _validate(obj, task: str, where: str) -> dict:
  if not isinstance(obj, dict):
    raise RetentionDataError(f"{where}: expected a JSON object")
  if task == "math":
    question = obj.get("question", obj.get("problem"))
    if not isinstance(question, str) or not isinstance(obj.get("answer"), str):
      raise RetentionDataError(f"{where}: math items need string 'question' (or 'problem') "
                               "and 'answer'")
    return {"question": question, "answer": obj["answer"]}
  if task == "ifeval":
    instructions = obj.get("instructions")
    if not isinstance(obj.get("prompt"), str) or not isinstance(instructions, list):
      raise RetentionDataError(f"{where}: ifeval items need 'prompt' and an 'instructions' list")
    for k, check in enumerate(instructions):
      if not isinstance(check, dict) or check.get("type") not in CHECKS:
        raise RetentionDataError(f"{where}: instructions[{k}] has unknown type "
                                 f"{check.get('type') if isinstance(check, dict) else check!r}; "
                                 f"known: {sorted(CHECKS)}")
      value_type = CHECK_VALUE_TYPES.get(check["type"])
      value = check.get("value")
      # bool is an int to Python, never a word count.
      if value_type and (not isinstance(value, value_type) or isinstance(value, bool)):
        found = f"has {value!r}" if "value" in check else "has none"
        raise RetentionDataError(f"{where}: instructions[{k}].value: {check['type']} needs a "
                                 f"'value' of type {value_type.__name__}; the item {found}")
    return {"prompt": obj["prompt"], "instructions": instructions}
  raise RetentionDataError(f"unknown retention task {task!r}; expected math or ifeval")


def read_tfds(name: str, data_dir: str, split: str, question_field: str,
              answer_field: str) -> list[dict]:
  """Items from a prepared TFDS copy (no download), e.g. gsm8k's question/answer."""
  import tensorflow_datasets as tfds
  try:
    source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
  except Exception as e:  # tfds raises several types for a missing or unprepared dataset
    raise RetentionDataError(f"tfds {name}/{split} in {data_dir}: {e}") from None
  decode = lambda v: v.decode() if isinstance(v, bytes) else str(v)
  return [{"question": decode(r[question_field]), "answer": decode(r[answer_field])}
          for r in source]


def score(task: str, item: dict, response: str) -> dict:
  if task == "math":
    predicted = extract_answer(response)
    reference = reference_answer(item["answer"])
    return {"predicted": predicted, "reference": reference,
            "correct": answers_match(predicted, reference)}
  passed = check_instructions(response, item["instructions"])
  return {"passed": passed, "correct": all(passed)}


def evaluate(config) -> dict:
  config = sections.retention_run(config)
  r = config.retention
  if r.tfds_name:
    items = read_tfds(r.tfds_name, r.tfds_data_dir, r.split, r.question_field, r.answer_field)
  else:
    items = read_items(r.data, r.task)
  if r.limit:
    items = items[:r.limit]
  sharding.maybe_initialize_distributed()
  workdir_lib.prepare(config.workdir)
  # each host answers its share of the items
  mesh = multihost.local_mesh(dataclasses.asdict(config.mesh))
  policy = builder.inference_policy(config, mesh)
  params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature)

  def prompt(item):
    text = (f"{item['question']}\n\n{MATH_INSTRUCTION}" if r.task == "math" else item["prompt"])
    messages = [{"role": "user", "content": text}]
    if r.system_prompt:
      messages.insert(0, {"role": "system", "content": r.system_prompt})
    return policy.formatter.prompt_ids(messages)

  out_path = os.path.join(config.workdir, f"retention_{r.task}.jsonl")
  correct = 0
  primary = jax.process_index() == 0  # writes every host's rows
  with (open(out_path, "w") if primary else open(os.devnull, "w")) as out, tqdm(
      total=len(items), unit="item", desc=r.task, disable=not primary) as bar:
    for start in range(0, len(items), r.batch_size):
      batch = items[start:start + r.batch_size]
      share = multihost.share_of(len(batch))
      mine = batch[share.start:share.stop]
      result = policy.sampler.batch.generate([prompt(item) for item in mine], params,
                                       keys.batch(config.seed, keys.RETENTION, start),
                                       row_ids=share)
      rows = []
      for item, response, reason in zip(mine, result.texts(policy.tokenizer,
                                                           skip_special_tokens=True),
                                        result.stop_reasons):
        if r.strip_thinking:
          response = strip_thinking(response)
        rows.append({**item, "response": response, "stop_reason": reason,
                     **score(r.task, item, response)})
      for row in multihost.gather_records(rows):
        correct += row["correct"]
        out.write(json.dumps(row, ensure_ascii=False) + "\n")
      bar.update(len(batch))
      bar.set_postfix(accuracy=f"{100.0 * correct / (start + len(batch)):.1f}%")
  summary = {"task": r.task, "n": len(items), "correct": correct,
             "accuracy": 100.0 * correct / len(items),
             "settings": {"checkpoint": config.policy.checkpoint, "temperature": r.temperature,
                          "max_new_tokens": r.max_new_tokens, "data": r.data or r.tfds_name}}
  if primary:
    with open(os.path.join(config.workdir, f"retention_{r.task}_summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  logging.info("%s: %d/%d correct (%.1f%%)", r.task, correct, len(items), summary["accuracy"])
  return summary


if __name__ == "__main__":
  cli.run("retention.py", "retention config file", watchdog.guarded(evaluate))
