"""Tiny random Qwen2 checkpoints with the small tokenizer we ship.

The demo config, the README's first command and the tests run on these: an
HF checkpoint directory like any real one (config.json, safetensors,
tokenizer with a ChatML chat template), just small and random.

  python -m rlver_jax.tiny --out=/tmp/tiny_qwen2            # write a checkpoint
  python -m rlver_jax.tiny --build_tokenizer                # rebuild the shipped tokenizer
"""

from __future__ import annotations

import os
import shutil

from absl import app, flags, logging

from models import qwen2

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
TOKENIZER_DIR = os.path.join(ASSETS, "tiny_tokenizer")
CORPUS = os.path.join(ASSETS, "tiny_corpus.txt")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML, as Qwen2.5 uses it (without Qwen's default system prompt and tools).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def build_tokenizer(out_dir: str = TOKENIZER_DIR, vocab_size: int = 1024) -> None:
  """Trains a byte-level BPE on our corpus and saves it as an HF fast tokenizer."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  with open(CORPUS) as f:
    lines = f.read().splitlines()
  tokenizer.train_from_iterator(lines, trainer)
  fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", bos_token=None)
  fast.chat_template = CHAT_TEMPLATE
  fast.save_pretrained(out_dir)
  logging.info("tokenizer with %d tokens written to %s", len(fast), out_dir)


def tiny_config(vocab_size: int, *, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=128, eos_token_id: int, bos_token_id: int | None = None,
                tie_word_embeddings=True) -> qwen2.Qwen2Config:
  return qwen2.Qwen2Config(
      vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
      num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
      rope_theta=10000.0, tie_word_embeddings=tie_word_embeddings, max_position_embeddings=8192,
      bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def load_tokenizer():
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def write_checkpoint(out_dir: str, *, seed: int = 0, **config_overrides) -> qwen2.Qwen2Config:
  """A random-init Qwen2 sized for the shipped tokenizer, saved with it in HF layout."""
  tokenizer = load_tokenizer()
  vocab = -(-len(tokenizer) // 64) * 64  # padded like real checkpoints' embeddings
  config = tiny_config(vocab, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                       **config_overrides)
  model = qwen2.init_random(config, seed=seed)
  qwen2.save_pretrained(model, out_dir)
  for name in os.listdir(TOKENIZER_DIR):
    shutil.copy(os.path.join(TOKENIZER_DIR, name), os.path.join(out_dir, name))
  return config


def main(argv):
  del argv
  out, seed, build = flags.FLAGS.out, flags.FLAGS.seed, flags.FLAGS.build_tokenizer
  if build:
    build_tokenizer()
  if out:
    config = write_checkpoint(out, seed=seed)
    logging.info("tiny Qwen2 (%d layers, width %d, vocab %d) written to %s",
                 config.num_layers, config.hidden_size, config.vocab_size, out)
  if not (build or out):
    raise app.UsageError("give --out=DIR and/or --build_tokenizer")


if __name__ == "__main__":
  # Flags are defined only when run as a program, so importing this module adds none.
  flags.DEFINE_string("out", None, "directory for a tiny random checkpoint")
  flags.DEFINE_integer("seed", 0, "init seed")
  flags.DEFINE_bool("build_tokenizer", False, "rebuild the shipped tokenizer")
  app.run(main)
