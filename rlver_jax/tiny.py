"""Tiny Qwen2 checkpoints with the small tokenizer we ship.

The demo config, the README's first command and the tests run on these: an
HF checkpoint directory like any real one (config.json, safetensors,
tokenizer with a ChatML chat template), just small: random, or, with
`warmup_steps`, a tiny "instruct model" (`warm_up`).

  python -m rlver_jax.tiny --out=/tmp/tiny_qwen2            # write a checkpoint
  python -m rlver_jax.tiny --out=/tmp/tiny_qwen2 --warmup_steps=300   # the demo's start
  python -m rlver_jax.tiny --build_tokenizer                # rebuild the shipped tokenizer
  python -m rlver_jax.tiny --user_sentences   # rewrite the scripted user's English from both
"""

from __future__ import annotations

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx

from models import chat, qwen2
from rl import system_prompts
from rlver_jax import multihost
from sim_user.backends import scripted

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
TOKENIZER_DIR = os.path.join(ASSETS, "tiny_tokenizer")
CORPUS = os.path.join(ASSETS, "tiny_corpus.txt")
WARMUP = os.path.join(ASSETS, "tiny_warmup.json")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# ChatML, as Qwen2.5 uses it (without Qwen's default system prompt and tools).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def build_tokenizer(out_dir: str = TOKENIZER_DIR, vocab_size: int = 1024) -> None:
  """Trains a byte-level BPE on the English the demo's user reads and saves it as an HF fast
  tokenizer.

  Trained on `user_sentences()` (not the corpus alone), the policy's warm-up replies split into
  fewer subword joins, each a place for a sampled reply to slip ("Whyight", "changege"). One line
  of the scripted user's key words, each with its leading space, makes each of them one token,
  which `scripted.KEY_WORDS` promises."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  key_words = [word for words in scripted.KEY_WORDS.values() for word in words]
  tokenizer.train_from_iterator(user_sentences() + [" " + " ".join(key_words)], trainer)
  fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", bos_token=None)
  fast.chat_template = CHAT_TEMPLATE
  fast.save_pretrained(out_dir)
  logging.info("tokenizer with %d tokens written to %s", len(fast), out_dir)


def user_sentences() -> list[str]:
  """Every line of the corpus and of the warm-up chats (user lines, need lines, replies), once
  each and sorted: the English the demo's scripted user reads (`scripted.SENTENCES_EN`), so the
  sentences the tiny policy learns to write are ones its user can read."""
  with open(CORPUS) as f:
    lines = f.read().splitlines()
  with open(WARMUP) as f:
    corpus = json.load(f)
  lines += corpus["user_lines"]
  for group in ("need_lines", "replies"):
    lines += [line for kind in corpus[group].values() for line in kind]
  return sorted({line.strip() for line in lines if line.strip()})


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


# Warm-up chats in which the user has a need; the rest are small talk, which keeps replies to
# a user who names no need uniform over the kinds.
WARMUP_NEED_SHARE = 0.75
# Rounds of a warm-up chat, at most: as many as a training dialogue has replies (RLVER's rules
# judge 9). Warmed up on chats of at most 3, the policy garbled 8% of its first replies and 32%
# of its sixth (positions and contexts it had never read; issue 46).
WARMUP_MAX_ROUNDS = 9
# A warm-up batch is padded to its longest chat, rounded up to this: a few shapes to compile.
WARMUP_WIDTH_STEP = 64


def warmup_dialogues(tokenizer, system_prompt: str, count: int, seed: int, helpfulness: float,
                     max_rounds: int = WARMUP_MAX_ROUNDS) -> tuple[np.ndarray, np.ndarray]:
  """`count` chats of everyday user lines and supportive replies, as tokens and a loss mask.

  Returns `tokens_bt` (right-padded with the pad id) and `reply_mask_bt`, True
  on every reply token and its end-of-turn token. Replies come in kinds
  (`tiny_warmup.json`: one kind per hidden intention of the demo's user, plus
  general encouragement). Some chats (1 - `WARMUP_NEED_SHARE`) are small
  talk (`user_lines`) answered with kinds drawn uniformly. In the others the
  user has a need: it opens with one of that need's `need_lines` (in its own
  words, not the scripted user's hints) and later says one again or makes
  small talk; each reply serves that need with probability `helpfulness` and
  is otherwise of a uniformly drawn kind. So the warmed-up policy speaks
  every kind of support and is only weakly aware of whose need is whose, as
  an instruct model is before RLVER; RL has to make that awareness reliable.
  """
  with open(WARMUP) as f:
    corpus = json.load(f)
  kinds = sorted(corpus["replies"])
  needs = sorted(corpus["need_lines"])
  formatter = chat.ChatFormatter(tokenizer)
  end_of_turn = tokenizer.convert_tokens_to_ids(formatter.end_of_turn)
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(count):
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    tokens, mask = [], []
    need = needs[rng.integers(len(needs))] if rng.random() < WARMUP_NEED_SHARE else None
    for round_ in range(rng.integers(1, max_rounds + 1)):
      # Needs stated later too, or only at the opening: the policy learns to look back to it.
      says_need = need is not None and (round_ == 0 or rng.random() < 0.5)
      line = rng.choice(corpus["need_lines"][need] if says_need else corpus["user_lines"])
      messages.append({"role": "user", "content": str(line)})
      # The dialogue so far renders as a prefix: only its new part is added.
      prompt = formatter.prompt_ids(messages)[len(tokens):]
      helps = need is not None and rng.random() < helpfulness
      kind = need if helps else kinds[rng.integers(len(kinds))]
      reply = str(rng.choice(corpus["replies"][kind]))
      reply_ids = formatter.encode(reply) + [end_of_turn]
      tokens += prompt + reply_ids
      mask += [False] * len(prompt) + [True] * len(reply_ids)
      messages.append({"role": "assistant", "content": reply})
    rows.append((tokens, mask))
  width = max(len(t) for t, _ in rows)
  tokens_bt = np.full((count, width), tokenizer.pad_token_id, np.int32)
  reply_mask_bt = np.zeros((count, width), bool)
  for i, (tokens, mask) in enumerate(rows):
    tokens_bt[i, :len(tokens)] = tokens
    reply_mask_bt[i, :len(mask)] = mask
  return tokens_bt, reply_mask_bt


def warm_up(model: qwen2.Qwen2, tokenizer, *, steps: int, helpfulness: float,
            system_prompt: str = "", seed: int = 0, batch_size: int = 32,
            learning_rate: float = 3e-3) -> float:
  """Fine-tunes `model` in place on `warmup_dialogues`; returns the last batch's loss.

  A random-init model emits garbled subwords, and an RL run from there spends
  its first steps learning to speak. RLVER starts from an instruct model that
  already offers every kind of support; this gives the tiny demo policy that
  start, so its RL run is about whom to offer which kind.
  """
  tokens_nt, mask_nt = warmup_dialogues(tokenizer, system_prompt, steps * batch_size, seed,
                                       helpfulness)
  graphdef, params = nnx.split(model)
  tx = optax.adam(learning_rate)

  @jax.jit
  def step(params, opt_state, tokens_bt, mask_bt):
    def loss_fn(params):
      model = nnx.merge(graphdef, params)
      hidden_btd, _ = model.backbone(tokens_bt[:, :-1])
      logits_btv = model.logits(hidden_btd)
      nll_bt = optax.softmax_cross_entropy_with_integer_labels(logits_btv, tokens_bt[:, 1:])
      return jnp.sum(nll_bt * mask_bt[:, 1:]) / jnp.sum(mask_bt[:, 1:])
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  start = time.perf_counter()
  logging.info("warming up the tiny policy: %d supervised steps (a minute or so on CPU)", steps)
  # Each chat ends with a reply: its length is its last reply token's position + 1.
  lengths_n = mask_nt.shape[1] - np.argmax(mask_nt[:, ::-1], axis=1)
  for i in range(steps):
    rows = slice(i * batch_size, (i + 1) * batch_size)
    width = min(-(-int(lengths_n[rows].max()) // WARMUP_WIDTH_STEP) * WARMUP_WIDTH_STEP,
                tokens_nt.shape[1])
    params, opt_state, loss = step(params, opt_state, tokens_nt[rows, :width],
                                   mask_nt[rows, :width])
    # One step at a time: Python runs signal handlers only between its own instructions, and
    # with every step dispatched at once a Ctrl-C or SIGTERM would wait out the whole warm-up.
    loss.block_until_ready()
  loss = float(loss)
  logging.info("warm-up: %d steps of %d chats in %.1f s, reply loss %.3f", steps, batch_size,
               time.perf_counter() - start, loss)
  nnx.update(model, params)
  return loss


def write_checkpoint(out_dir: str, *, seed: int = 0, warmup_steps: int = 0,
                     warmup_helpfulness: float = 0.0, system_prompt: str = "",
                     **config_overrides) -> qwen2.Qwen2Config:
  """A tiny Qwen2 sized for the shipped tokenizer, saved with it in HF layout.

  Random-init, then `warmup_steps` of `warm_up` (with `warmup_helpfulness`
  and `system_prompt`, the one its RL run will use).
  """
  tokenizer = load_tokenizer()
  vocab = -(-len(tokenizer) // 64) * 64  # padded like real checkpoints' embeddings
  config = tiny_config(vocab, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                       **config_overrides)
  model = qwen2.init_random(config, seed=seed)
  if warmup_steps:
    warm_up(model, tokenizer, steps=warmup_steps, helpfulness=warmup_helpfulness,
            system_prompt=system_prompt, seed=seed)
  qwen2.save_pretrained(model, out_dir)
  for name in os.listdir(TOKENIZER_DIR):
    shutil.copy(os.path.join(TOKENIZER_DIR, name), os.path.join(out_dir, name))
  return config


def demo_policy(config) -> str:
  """W/init_policy, the policy a run with `policy.tiny_init` (the demo) starts from: written
  by process 0 on the run's first start, a tiny model warmed up (`policy.tiny_warmup_steps`,
  `policy.tiny_warmup_helpfulness`) with the run's own system prompt.

  Here with the demo's model: the builder (`builder.policy_path`) only calls it.
  """
  path = os.path.join(config.workdir, "init_policy")
  if jax.process_index() == 0 and not os.path.exists(os.path.join(path, "config.json")):
    system_prompt = system_prompts.resolve(config.rollout.system_prompt,
                                           language=config.sim_user.language,
                                           thinking=config.rollout.thinking)
    write_checkpoint(path, seed=config.seed, warmup_steps=config.policy.tiny_warmup_steps,
                     warmup_helpfulness=config.policy.tiny_warmup_helpfulness,
                     system_prompt=system_prompt)
  multihost.barrier("tiny init policy written")  # the other hosts read process 0's files
  return path


def main(argv):
  del argv
  out, seed, build = flags.FLAGS.out, flags.FLAGS.seed, flags.FLAGS.build_tokenizer
  if build:
    build_tokenizer()
  if flags.FLAGS.user_sentences:
    with open(scripted.SENTENCES_EN, "w") as f:
      f.write("".join(line + "\n" for line in user_sentences()))
    logging.info("the scripted user's English written to %s", scripted.SENTENCES_EN)
  if out:
    config = write_checkpoint(out, seed=seed, warmup_steps=flags.FLAGS.warmup_steps,
                              warmup_helpfulness=flags.FLAGS.warmup_helpfulness,
                              system_prompt=flags.FLAGS.system_prompt)
    logging.info("tiny Qwen2 (%d layers, width %d, vocab %d) written to %s",
                 config.num_layers, config.hidden_size, config.vocab_size, out)
  if not (build or out or flags.FLAGS.user_sentences):
    raise app.UsageError("give --out=DIR, --build_tokenizer and/or --user_sentences")


if __name__ == "__main__":
  # Flags are defined only when run as a program, so importing this module adds none.
  flags.DEFINE_string("out", None, "directory for a tiny random checkpoint")
  flags.DEFINE_integer("seed", 0, "init seed")
  flags.DEFINE_integer("warmup_steps", 0, "supervised warm-up steps (rlver_jax/assets/"
                       "tiny_warmup.json); 0: random weights")
  flags.DEFINE_float("warmup_helpfulness", 0.3, "in the warm-up, the share of replies to a "
                     "user with a need that serve it")
  flags.DEFINE_string("system_prompt", "You are a caring listener.",
                      "the system prompt of the warm-up chats")
  flags.DEFINE_bool("build_tokenizer", False, "rebuild the shipped tokenizer")
  flags.DEFINE_bool("user_sentences", False, "rewrite the demo's scripted user's English "
                    "(sim_user/data/sentences_en.txt) from the corpus and the warm-up chats")
  app.run(main)
