"""Tiny random Qwen2 checkpoints written by `transformers` itself."""

import torch
import transformers


def make_hf_qwen2(out_dir, *, tied=False, heads=4, kv_heads=2, hidden=64, layers=2,
                  vocab=128, intermediate=96, seed=0, rope_theta=10000.0):
  """Saves a random Qwen2ForCausalLM to `out_dir` and returns it (eval mode, fp32).

  Norm scales and q/k/v biases are perturbed so they are not the identity and
  zero that HF initialises them to; a wrong mapping of either then shows.
  """
  config = transformers.Qwen2Config(
      vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
      tie_word_embeddings=tied, rope_theta=rope_theta, max_position_embeddings=256,
      bos_token_id=1, eos_token_id=2)
  torch.manual_seed(seed)
  model = transformers.Qwen2ForCausalLM(config).eval()
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        param.add_(0.1 * torch.randn_like(param))
  model.save_pretrained(out_dir)
  return model


def hf_logits(model, input_ids, attention_mask=None, position_ids=None):
  with torch.no_grad():
    kwargs = {}
    if attention_mask is not None:
      kwargs["attention_mask"] = torch.tensor(attention_mask, dtype=torch.long)
    if position_ids is not None:
      kwargs["position_ids"] = torch.tensor(position_ids, dtype=torch.long)
    return model(torch.tensor(input_ids, dtype=torch.long), **kwargs).logits.float().numpy()
