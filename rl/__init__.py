"""Rollouts, the typed batch, advantages, losses, forward passes, updates, learners and the
training step."""

from rl.advantages import gae_advantages, grpo_advantages, masked_whiten
from rl.losses import aggregate, entropy_from_logits, kl_penalty, policy_loss, value_loss

__all__ = ["gae_advantages", "grpo_advantages", "masked_whiten", "aggregate",
           "entropy_from_logits", "kl_penalty", "policy_loss", "value_loss"]
