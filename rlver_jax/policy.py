"""Loading a checkpoint for generation: model, tokenizer, chat formatter and sampler together."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from models import qwen2
from models.chat import ChatFormatter
from models.sampler import Sampler

DEFAULT_STOPS = ("<|im_end|>", "<|endoftext|>")


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
  from transformers import AutoTokenizer
  model = qwen2.from_pretrained(checkpoint, dtype=dtype, param_dtype=param_dtype, mesh=mesh,
                                remat=remat)
  tokenizer = AutoTokenizer.from_pretrained(checkpoint)
  sampler = Sampler(model, stop_token_ids=stop_token_ids(tokenizer, stops,
                                                         model.config.eos_token_id),
                    pad_id=tokenizer.pad_token_id or 0, mesh=mesh)
  formatter = ChatFormatter(tokenizer, require_template=require_chat_template)
  return Policy(model=model, tokenizer=tokenizer, formatter=formatter, sampler=sampler)
