"""The `rollout` section (what a rollout is asked to do), its decoding fields that the
evaluation's section shares (`DecodingConfig`), and the rule that ends a dialogue on its token
budget.

Its own module because `rl.rollout` (which dispatches to an engine) and both
engines (`rl.lockstep`, `rl.engine`) read it: the engines import it, not the
rollout, so no import runs back from an engine to its dispatcher.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from infra import config_section
from models import partitioning
from sim_user.simulator import Dialogue

TOKEN_BUDGET = "token_budget"  # Dialogue.end_reason of a dialogue over max_dialogue_tokens
ENGINES = ("continuous", "lockstep")
SAMPLING_DTYPES = ("", "bfloat16")  # "": the sampler decodes from the training weights
OFF_POLICY_STEPS = (0, 1)  # on-policy, or one step ahead (rlver_jax/off_policy.py)
AUTO = "auto"  # rollout.sampler_hosts: the fewest hosts per sampler group whose plan fits


@dataclasses.dataclass(frozen=True)
class DecodingConfig(config_section.Section):
  """How the policy decodes its replies: the fields the `rollout` section (training) and the
  `eval` section (`rlver_jax.sections.EvalConfig`) share.

  Attributes:
    system_prompt: the policy's system prompt: a preset of rl/system_prompts.py ("rlver":
      the paper's prompt for `thinking` and sim_user.language; "sage": SAGE's prompt for
      tested models) or the text itself. The builder hands the engines the resolved text.
    thinking: reason in <think>...</think> before each reply.
    max_new_tokens: the policy's tokens per reply (a turn).
    temperature: the policy's sampling temperature.
    top_p: nucleus sampling (1: off).
    top_k: top-k sampling (0: off).
    engine: continuous (rl/engine.py: batching across turns) | lockstep (rl/lockstep.py: one
      sampler call per round, the benchmark's baseline).
  """
  # Whether temperature 0 (greedy) may be asked for: not where a learner scores the tokens.
  greedy_ok: ClassVar[bool] = True
  system_prompt: str = "rlver"
  thinking: bool = False
  max_new_tokens: int = 5000
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  engine: str = "continuous"

  def check(self, p: config_section.Problems) -> None:
    if self.greedy_ok:
      p.require("temperature", config_section.at_least(0.0), "must be >= 0 (0 is greedy)")
    else:
      p.require("temperature", config_section.positive,
                "must be > 0: the learner scores tokens under softmax(logits / temperature)")
    p.require("top_p", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
    p.require("top_k", config_section.at_least(0), "must be >= 0 (0: no top-k)")
    p.require("max_new_tokens", config_section.at_least(1), "must be >= 1")
    p.one_of("engine", ENGINES)


@dataclasses.dataclass(frozen=True)
class RolloutConfig(DecodingConfig):
  """The `rollout` section: how a step's dialogues are collected, and how the policy decodes
  them (the `DecodingConfig` fields).

  Attributes:
    samples_per_profile: dialogues per profile per step (GRPO's group size).
    format_penalty_reward: thinking: the reward of a badly formatted turn.
    max_dialogue_tokens: the policy's tokens per dialogue; beyond, it ends.
    temperature: the policy's sampling temperature (the loss's logprobs use it).
    sampling_dtype: the sampler's own copy of the policy, refreshed in place after each
      update: "bfloat16", or "" to decode from the fp32 training weights (cast on every step).
    sampling_layout: that copy's layout: "train" shards it over fsdp like the training
      weights (a decode step gathers bf16 shards); "decode" keeps it whole on every chip of a
      sampler group (no gather per token, but +10.6 GiB per chip for 7B on a v5p-16);
      "tensor" splits it by heads over the group's chips, tensor-parallel up to the model's
      kv heads, data-parallel beyond (no gather per token, 1/tensor of the copy per chip).
      `python -m rlver_jax.plan --config=... --topology=...` shows each, and which is
      fastest where it fits.
    sampler_hosts: hosts that sample on one mesh (a sampler group): 1 (each host its own),
      2, 4, ... (a group's lowest host runs its dialogues and the simulator calls, the
      others dispatch the same programs; dialogues are shared over groups), or "auto": the
      fewest whose plan fits the chips' memory (rlver_jax/plan/; 1 where devices report
      no memory limit, as CPUs).
    release_sampler_weights: free the sampler's copy of the weights while the update runs and
      make it anew before the next rollout: the update's peak memory loses the copy, each
      step makes it from scratch instead of rewriting it in place (on-policy only).
    off_policy_steps: updates the rollout runs ahead of training: 0 (on-policy, as published)
      | 1 (step n+1's dialogues are collected, in a background thread, with the weights before
      step n's update while that update runs: faster steps, samples one update stale; the
      losses' ratio uses the sampler's log-probs; one process only).
  """
  greedy_ok: ClassVar[bool] = False
  samples_per_profile: int = 1
  format_penalty_reward: float = 0.0
  max_dialogue_tokens: int = 10000
  sampling_dtype: str = "bfloat16"
  sampling_layout: str = "train"
  sampler_hosts: str = "1"
  release_sampler_weights: bool = False
  off_policy_steps: int = 0

  def check(self, p: config_section.Problems) -> None:
    super().check(p)
    p.require("samples_per_profile", config_section.at_least(1), "must be >= 1")
    p.require("max_dialogue_tokens", config_section.at_least(1), "must be >= 1")
    p.require("sampling_dtype", lambda v: v in SAMPLING_DTYPES,
              f"the sampler's copy of the weights: expected one of {SAMPLING_DTYPES} (empty: "
              "decode from the training weights)")
    p.one_of("sampling_layout", tuple(partitioning.SAMPLING_LAYOUTS))
    p.require("sampler_hosts", lambda v: v == AUTO or (v.isdigit() and int(v) >= 1 and
                                                       int(v) & (int(v) - 1) == 0),
              f"hosts per sampler group: 1, 2, 4, ... or {AUTO!r}")
    if self.release_sampler_weights:
      p.require("off_policy_steps", lambda v: v == 0,
                "rollout.release_sampler_weights frees the sampler's copy during the update, where "
                "an off-policy rollout decodes from it: choose one")
    p.require("off_policy_steps", lambda v: v in OFF_POLICY_STEPS,
              f"expected one of {OFF_POLICY_STEPS}: 0 collects each step's dialogues with the "
              "weights it trains (on-policy), 1 collects the next step's while this step's "
              "update runs; more steps ahead are not supported")

  @classmethod
  def decoding_as(cls, decoding: DecodingConfig, **fields) -> RolloutConfig:
    """A rollout that decodes as `decoding` (another section's, e.g. the evaluation's), with
    `fields` (a decoding field among them overrides `decoding`'s) and the defaults."""
    shared = {f.name: getattr(decoding, f.name) for f in dataclasses.fields(DecodingConfig)}
    return cls(**{**shared, **fields})

  @property
  def groups_span_hosts(self) -> bool:
    """Whether a sampler group may span several hosts (sampler_hosts other than 1)."""
    return self.sampler_hosts != "1"


def end_if_over_budget(dialogue: Dialogue, agent_tokens: int, config: RolloutConfig) -> None:
  """The token budget rule, once the dialogue's user turn is in."""
  if not dialogue.done and agent_tokens >= config.max_dialogue_tokens:
    dialogue.end_reason = TOKEN_BUDGET
