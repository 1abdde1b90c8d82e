"""The command line of `python -m rlver_jax.plan` (`__main__.py` sets up JAX's environment
first): its flags and main."""

from __future__ import annotations

import json

from absl import app, flags

from infra import topology
from infra.errors import UserInputError
from models import qwen2, row_programs
from rlver_jax.plan import report
from rlver_jax.plan.spec import ROW_PROGRAM_CHOICES, Overrides, spec_from_config, spec_from_flags
from rlver_jax.plan.step_plan import USABLE_MEMORY_FRACTION, plan


def define_flags() -> None:
  from ml_collections import config_flags
  config_flags.DEFINE_config_file("config", None, "plan a recipe as shipped "
                                  "(configs/ppo.py[:variant]), with --config.x=y overrides")
  flags.DEFINE_string("topology", None, "compile for a Cloud TPU slice (v4-8, v5litepod-16, "
                      "v5p-16, v6e-8, ...), no TPU needed (pip install -e .[tpu])")
  flags.DEFINE_string("model", "qwen2.5-7b", f"one of {sorted(qwen2.PRESETS)}; with --config, "
                      "used when policy.checkpoint has no config.json")
  flags.DEFINE_string("hf_config", None, "an HF config.json instead of --model")
  flags.DEFINE_string("sim_model", "qwen2.5-7b", "with --config and sim_user.backend=flax: the "
                      "in-process simulator's preset, used when sim_user.checkpoint has no "
                      "config.json")
  flags.DEFINE_integer("layers", None, "override the layer count (quick what-ifs)")
  flags.DEFINE_string("mesh", None, "mesh axes, e.g. data=1,fsdp=8,tensor=1 (default: the "
                      "config's, else data=1,fsdp=-1,tensor=1)")
  flags.DEFINE_integer("batch", None, "sequences per micro-batch (default 32; with --config, "
                       "its dialogues per micro-batch)")
  flags.DEFINE_integer("seq_len", None, "tokens per sequence (default 8192; with --config, "
                       "rollout.max_dialogue_tokens rounded up to a power of two)")
  flags.DEFINE_integer("grad_accum", None, "micro-batches per update (default 1, or the "
                       "config's optim.grad_accum)")
  flags.DEFINE_integer("cache_len", None, "sampler cache slots per row (default seq_len)")
  flags.DEFINE_integer("prefill_chunk", None, "tokens one sampler prefill call feeds a row (default "
                       f"{row_programs.PREFILL_CHUNK})")
  flags.DEFINE_integer("dialogue_tokens", None, "the policy's tokens per dialogue, for the "
                       "time estimate (default cache/2)")
  flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
  flags.DEFINE_string("param_dtype", "float32", "parameter dtype")
  flags.DEFINE_string("remat", "full", f"remat policy, one of {qwen2.REMAT_POLICIES}")
  flags.DEFINE_string("attention", "auto", "attention implementation (models/attention.py)")
  flags.DEFINE_bool("critic", True, "also plan the critic (PPO)")
  flags.DEFINE_bool("reference", False, "also plan a reference policy (KL penalty)")
  flags.DEFINE_bool("sampler", True, "also plan the sampler's refresh and row programs")
  flags.DEFINE_string("sampling_dtype", "bfloat16", "the sampler's resident copy of the "
                      "weights (rollout.sampling_dtype); empty: it decodes from the training "
                      "weights")
  flags.DEFINE_string("sampling_layout", "auto", "that copy's layout "
                      "(rollout.sampling_layout): train (fsdp-sharded), decode (whole on "
                      "every fsdp shard), tensor (split by heads over a group's chips), or "
                      "auto: with --topology the fastest that fits, else train")
  flags.DEFINE_string("sampler_hosts", "auto", "hosts per sampler group "
                      "(rollout.sampler_hosts): 1, 2, 4, ... or auto, the fewest that fit; "
                      "1, 2 and 4 are planned side by side")
  flags.DEFINE_enum("row_programs", "bounding", list(ROW_PROGRAM_CHOICES), "compile every "
                    "row program a step can meet, or the largest of each kind")
  flags.DEFINE_float("device_memory_gib", None, "memory per device, for a verdict (default "
                     "with --topology: the generation's HBM)")
  flags.DEFINE_float("memory_fraction", USABLE_MEMORY_FRACTION, "the share of that memory a "
                     "plan may fill (the rest is the runtime's)")
  flags.DEFINE_integer("fake_devices", 0, "plan for N fake CPU devices (read before JAX starts)")
  flags.DEFINE_string("out", None, "also write the plan as JSON here")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    _plan_from_flags()
  except UserInputError as e:  # the user's mistake: one line; our bugs keep their traceback
    raise SystemExit(f"error: {e}") from None


def _plan_from_flags():
  FLAGS = flags.FLAGS
  config = FLAGS["config"].value
  spec = (spec_from_flags(FLAGS) if config is None else
          spec_from_config(config, Overrides.from_flags(FLAGS)))
  devices = chip = group_devices = None
  if FLAGS.topology:
    if FLAGS.fake_devices:
      raise UserInputError("--topology and --fake_devices: choose one")
    accelerators = topology.parse_accelerator_type(FLAGS.topology)
    devices, chip = topology.slice_devices(accelerators), accelerators.generation
    group_devices = topology.group_devices(accelerators)
  if not 0 < FLAGS.memory_fraction <= 1:
    raise UserInputError(f"--memory_fraction={FLAGS.memory_fraction}: must be in (0, 1]")
  result = plan(spec, devices, chip, group_devices, memory_gib=FLAGS.device_memory_gib,
                memory_fraction=FLAGS.memory_fraction)
  if FLAGS.topology:
    result["topology"] = FLAGS.topology
  report.print_plan(result, spec)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)
