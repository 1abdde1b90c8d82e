"""Chat formatting with a checkpoint's own chat template, turn by turn.

A dialogue's KV cache holds the rendered prompt plus the tokens the model
generated. For the next turn only the difference is fed: whatever the
template puts after the assistant's end-of-turn token, the new messages, and
the next generation prompt. The difference is taken on rendered text, so it
works for any template that renders a dialogue as a prefix of its extension
(ChatML and Qwen's templates do).
"""

from __future__ import annotations

from typing import Sequence

from infra.errors import UserInputError

Message = dict  # {"role": str, "content": str}


class MissingChatTemplate(UserInputError):
  """Chat messages were given to a tokenizer that has no chat template."""


class ChatFormatter:
  """Renders chat messages with the tokenizer's template; `encode` needs no template.

  With `require_template` (the default) a tokenizer without a chat template is
  refused at once; without it, only rendering messages fails.
  """

  def __init__(self, tokenizer, end_of_turn: str = "<|im_end|>", require_template: bool = True):
    self.tokenizer = tokenizer
    self.end_of_turn = end_of_turn
    if require_template:
      self.check_template()

  @property
  def has_template(self) -> bool:
    return bool(getattr(self.tokenizer, "chat_template", None))

  def check_template(self) -> None:
    if not self.has_template:
      raise MissingChatTemplate(
          "the tokenizer has no chat template (no chat_template in tokenizer_config.json, no "
          "chat_template.jinja), so chat messages cannot be rendered; plain text and token ids "
          "need none")

  def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    self.check_template()
    return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                              add_generation_prompt=add_generation_prompt)

  def encode(self, text: str) -> list[int]:
    return self.tokenizer.encode(text, add_special_tokens=False)

  def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
    """The whole dialogue so far plus the assistant's generation prompt."""
    return self.encode(self.render(messages, add_generation_prompt=True))

  def continuation_ids(self, history: Sequence[Message], reply_ended: bool,
                       new_messages: Sequence[Message]) -> list[int]:
    """Tokens to feed after the model's last reply (the last message of `history`).

    `reply_ended` says whether that reply ended with the end-of-turn token
    (it is in the cache then); a reply cut at the length limit did not.
    """
    if not history or history[-1]["role"] != "assistant":
      raise ValueError("history must end with the assistant reply the model generated")
    before = self.render(history, add_generation_prompt=False)
    after = self.render(list(history) + list(new_messages), add_generation_prompt=True)
    if not after.startswith(before):
      raise ValueError("the chat template does not render a dialogue as a prefix of its "
                       "extension; re-prefill the dialogue instead")
    end = before.rfind(self.end_of_turn)
    if end < 0:
      raise ValueError(f"the rendered reply has no end-of-turn marker {self.end_of_turn!r}")
    closing = before[end + len(self.end_of_turn):]
    text = ("" if reply_ended else self.end_of_turn) + closing + after[len(before):]
    return self.encode(text)
