"""Will it fit, and how fast might it run? Compile every program of a PPO/GRPO step, no weights.

  python -m rlver_jax.plan --topology=v5p-16 --model=qwen2.5-7b \
      --mesh=data=1,fsdp=8,tensor=1 --batch=8 --seq_len=16384 --out=plan.json
  python -m rlver_jax.plan --config=configs/ppo.py --topology=v5p-16 [--config.x=y ...]
  python -m rlver_jax.plan --model=qwen2.5-0.5b --fake_devices=8      # CPU devices

Devices: `--topology=ACCELERATOR_TYPE` (v4-8, v5litepod-16, v5p-16, v6e-8, ...)
compiles for a Cloud TPU slice with no TPU present (libtpu's compiler,
deviceless: `pip install -e .[tpu]`), every host of it; `--fake_devices=N`
plans for N CPU devices; neither plans for the devices at hand.

Programs: the learner programs of `rl/step.py` (value and reference passes,
updates; with gradient accumulation its `gradients`, `accumulate_gradients`
and `apply_gradients`), the sampler's weight refresh (`WeightCopy`) and the
rollout engine's row programs (`RowSampler.prefill_rows` / `decode_rows`), on
host 0's devices as the sampler runs on each host's own. The row programs
are a fixed set of at most 12 widths and attended slots at one capacity
(`row_programs.row_program_set`, what the sampler compiles before a rollout);
`--row_programs=all` compiles each, the default `bounding` only the largest
of each kind (the others need less memory) and counts the rest.

Each program is lowered with abstract arrays carrying their shardings and
compiled; its memory analysis gives bytes per device. What stays resident
(policy and critic weights and optimizer states, the reference copy, the
sampler's copy) is counted once; the peak is resident plus the most any one
program adds on top. Each program's kernels are the custom-call targets in
its compiled HLO (splash attention shows as a Mosaic `tpu_custom_call`).
Time estimates come from `rlver_jax/costs.py`: an analytic roofline, not a
measurement.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from infra import topology


def _flag_from_argv(argv, name: str) -> str:
  """A flag's value read before absl parses the command line (JAX must be set up first)."""
  for i, arg in enumerate(argv):
    if arg.startswith(f"--{name}="):
      return arg.split("=", 1)[1]
    if arg == f"--{name}" and i + 1 < len(argv):
      return argv[i + 1]
  return ""


def _prepare_environment(argv) -> None:
  """The environment `--topology` (the deviceless compiler's) and `--fake_devices` need: JAX
  reads it as it starts, so it is set before anything imports JAX."""
  accelerator_type = _flag_from_argv(argv, "topology")
  if accelerator_type:
    topology.prepare_environment(accelerator_type)
  fake_devices = _flag_from_argv(argv, "fake_devices")
  if int(fake_devices or 0):
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={fake_devices}").strip()


def main() -> None:
  _prepare_environment(sys.argv)
  from rlver_jax.plan import cli  # JAX starts with this import, in that environment
  cli.define_flags()
  flags.adopt_module_key_flags(cli)  # --help lists the main module's flags: these
  app.run(cli.main)


if __name__ == "__main__":
  main()
