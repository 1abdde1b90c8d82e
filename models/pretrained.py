"""Loading a checkpoint for generation: model, tokenizer, chat formatter and sampler together.

Under models/ so that every layer that samples from a checkpoint loads it alike: the
app's policy (`rlver_jax/builder.py`, `rlver_jax/generate.py`) and the in-process
simulator (`sim_user/backends/flax_llm.py`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from infra.errors import MissingInputError, UserInputError
from models import checkpoint_io, qwen2
from models.chat import ChatFormatter
from models.sampler import Sampler

DEFAULT_STOPS = ("<|im_end|>", "<|endoftext|>")
# Any one of these makes a directory hold a tokenizer (fast, BPE, SentencePiece, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt")
# A tokenizer that cannot spell every byte is no LLM's tokenizer (byte-level BPE starts at 256).
MIN_TOKENIZER_SIZE = 256


def load_tokenizer(path: str):
  """The HF tokenizer saved in checkpoint directory `path`, checked before any use.

  Without tokenizer files transformers quietly builds an empty tokenizer from
  config.json, and a tokenizer larger than the model's vocabulary yields ids
  past the embedding table (no error under jit, only wrong embeddings): both
  are UserInputErrors naming the directory.
  """
  from transformers import AutoTokenizer
  if not os.path.isdir(path):
    raise MissingInputError(f"checkpoint directory {path!r} does not exist")
  if not any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES):
    raise MissingInputError(f"{path}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
                            "copy them from the model the checkpoint was trained from")
  tokenizer = AutoTokenizer.from_pretrained(path)
  if len(tokenizer) < MIN_TOKENIZER_SIZE:
    raise UserInputError(f"{path}: the tokenizer has only {len(tokenizer)} tokens; its files are "
                         "incomplete or not an LLM tokenizer's")
  if os.path.exists(os.path.join(path, "config.json")):
    vocab_size = checkpoint_io.read_hf_config(path).get("vocab_size")
    if vocab_size is not None and len(tokenizer) > vocab_size:
      raise UserInputError(f"{path}: the tokenizer has {len(tokenizer)} tokens but config.json's "
                           f"vocab_size is {vocab_size}: tokenizer and weights do not belong "
                           "together")
  return tokenizer


def stop_token_ids(tokenizer, names: Sequence[str] = DEFAULT_STOPS,
                   eos_token_id: int | list[int] | None = None) -> list[int]:
  """Ids of the named stop tokens the tokenizer has, plus the config's eos id(s)."""
  ids = set()
  for name in names:
    token_id = tokenizer.convert_tokens_to_ids(name)
    if token_id is not None and token_id != tokenizer.unk_token_id:
      ids.add(int(token_id))
  if eos_token_id is not None:
    ids.update([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
  if not ids:
    raise ValueError(f"none of the stop tokens {list(names)} is in the tokenizer")
  return sorted(ids)


@dataclasses.dataclass
class Policy:
  model: qwen2.Qwen2
  tokenizer: object
  formatter: ChatFormatter
  sampler: Sampler


def load_policy(checkpoint: str, *, dtype="float32", param_dtype=None, mesh=None,
                remat: bool = False, stops: Sequence[str] = DEFAULT_STOPS,
                require_chat_template: bool = True) -> Policy:
  tokenizer = load_tokenizer(checkpoint)  # first: it fails fast, the weights take a while
  model = qwen2.from_pretrained(checkpoint, dtype=dtype, param_dtype=param_dtype, mesh=mesh,
                                remat=remat)
  sampler = Sampler(model, stop_token_ids=stop_token_ids(tokenizer, stops,
                                                         model.config.eos_token_id),
                    pad_id=tokenizer.pad_token_id or 0, mesh=mesh)
  formatter = ChatFormatter(tokenizer, require_template=require_chat_template)
  return Policy(model=model, tokenizer=tokenizer, formatter=formatter, sampler=sampler)
