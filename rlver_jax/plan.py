"""Will it fit? Compile the PPO train steps for a model size and mesh, with no weights.

  python -m rlver_jax.plan --model=qwen2.5-7b --mesh=data=1,fsdp=8,tensor=1 \
      --batch=32 --seq_len=8192 --device_memory_gib=95 [--fake_devices=8]

The policy and critic updates are lowered with abstract arrays
(`jax.ShapeDtypeStruct` carrying their shardings), compiled by XLA for the
devices at hand, and the compiled executables' memory analysis gives bytes
per device: arguments (weights, optimizer state, batch), outputs, temporaries
(activations, gradients). Add the sampler's KV cache, computed from shapes.
`--fake_devices=N` plans for N devices on the host CPU (it must come before
JAX starts, so this module reads it first).
"""

from __future__ import annotations

import os
import sys


def _fake_devices_from_argv(argv) -> int:
  for i, arg in enumerate(argv):
    if arg.startswith("--fake_devices="):
      return int(arg.split("=", 1)[1])
    if arg == "--fake_devices" and i + 1 < len(argv):
      return int(argv[i + 1])
  return 0


if __name__ == "__main__" and _fake_devices_from_argv(sys.argv):
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={_fake_devices_from_argv(sys.argv)}").strip()

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from models import partitioning, qwen2  # noqa: E402
from models.errors import UserInputError  # noqa: E402
from rl import train_step  # noqa: E402
from rlver_jax import sharding  # noqa: E402
from rlver_jax.generate import parse_mesh  # noqa: E402

GIB = 2 ** 30


def _abstract(state, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)


def _opt_shardings(tx, abstract_opt, param_shardings, mesh):
  replicated = NamedSharding(mesh, PartitionSpec())
  return optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_shardings,
                               transform_non_params=lambda _: replicated,
                               is_leaf=lambda x: isinstance(x, nnx.Variable))


def _batch(mesh, batch: int, seq_len: int, with_values: bool):
  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=partitioning.batch_sharding(shape, mesh))

  targets = (batch, seq_len - 1)
  out = {"input_ids": spec((batch, seq_len), jnp.int32),
         "attention_mask": spec((batch, seq_len), jnp.bool_),
         "loss_mask": spec(targets, jnp.float32), "old_logprobs": spec(targets, jnp.float32),
         "advantages": spec(targets, jnp.float32)}
  if with_values:
    out.update(returns=spec(targets, jnp.float32), old_values=spec(targets, jnp.float32))
  return out


def _compile_update(model_cls, config, loss_fn, mesh, batch, seq_len, dtype, param_dtype,
                    remat, loss_cfg):
  abstract_model = nnx.eval_shape(lambda: model_cls(config, dtype=dtype, param_dtype=param_dtype,
                                                    remat=remat, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract_model)
  param_shardings = partitioning.state_shardings(state, mesh)
  params = _abstract(state, param_shardings)
  tx = train_step.make_optimizer(train_step.OptimConfig())
  abstract_opt = jax.eval_shape(tx.init, params)
  opt = _abstract(abstract_opt, _opt_shardings(tx, abstract_opt, param_shardings, mesh))
  step = jax.jit(functools.partial(train_step.update, loss_fn, graphdef, tx, loss_cfg),
                 donate_argnums=(0, 1))
  with partitioning.mesh_context(mesh):
    compiled = step.lower(params, opt, _batch(mesh, batch, seq_len,
                                              model_cls is qwen2.Qwen2Value)).compile()
  stats = compiled.memory_analysis()
  n_params = sum(x.size for x in jax.tree.leaves(state))
  devices = mesh.devices.size
  return {
      "parameters": n_params,
      "argument_gib": stats.argument_size_in_bytes / GIB,
      "output_gib": stats.output_size_in_bytes / GIB,
      "temp_gib": stats.temp_size_in_bytes / GIB,
      "alias_gib": stats.alias_size_in_bytes / GIB,
      # Donated inputs alias outputs: peak = arguments + temporaries + non-aliased outputs.
      "peak_gib": (stats.argument_size_in_bytes + stats.temp_size_in_bytes
                   + stats.output_size_in_bytes - stats.alias_size_in_bytes) / GIB,
      "unsharded_weights_gib": n_params * jnp.dtype(param_dtype).itemsize / GIB,
      "devices": devices,
  }


def kv_cache_gib(config: qwen2.Qwen2Config, mesh, batch: int, cache_len: int, dtype) -> float:
  """Per-device bytes of the sampler's k and v caches, all layers, in GiB."""
  shape = (batch, cache_len, config.num_kv_heads, config.head_size)
  shard = partitioning.named_sharding(qwen2.KV_CACHE_AXES, shape, mesh).shard_shape(shape)
  elements = 1
  for size in shard:
    elements *= size
  return 2 * config.num_layers * elements * jnp.dtype(dtype).itemsize / GIB


def plan(config: qwen2.Qwen2Config, mesh_axes: dict, batch: int, seq_len: int, *,
         dtype="bfloat16", param_dtype="float32", remat=True, critic=True,
         cache_len: int | None = None) -> dict:
  mesh = sharding.make_mesh(mesh_axes)
  dtype, param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
  loss_cfg = train_step.LossConfig()
  result = {"model": dataclasses.asdict(config), "mesh": dict(mesh.shape), "batch": batch,
            "seq_len": seq_len, "dtype": dtype.name, "param_dtype": param_dtype.name,
            "remat": remat}
  result["policy_update"] = _compile_update(qwen2.Qwen2, config, train_step.policy_loss, mesh,
                                            batch, seq_len, dtype, param_dtype, remat, loss_cfg)
  if critic:
    result["critic_update"] = _compile_update(qwen2.Qwen2Value, config, train_step.critic_loss,
                                              mesh, batch, seq_len, dtype, param_dtype, remat,
                                              loss_cfg)
  result["kv_cache_gib"] = kv_cache_gib(config, mesh, batch, cache_len or seq_len, dtype)
  # Policy and critic live side by side; the sampler's cache exists during rollouts.
  result["resident_gib"] = (result["policy_update"]["argument_gib"]
                            + result.get("critic_update", {}).get("argument_gib", 0.0))
  result["peak_gib"] = result["resident_gib"] + max(
      result["policy_update"]["temp_gib"],
      result.get("critic_update", {}).get("temp_gib", 0.0), result["kv_cache_gib"])
  return result


def _define_flags() -> None:
  flags.DEFINE_string("model", "qwen2.5-7b", f"one of {sorted(qwen2.PRESETS)}")
  flags.DEFINE_string("hf_config", None, "an HF config.json instead of --model")
  flags.DEFINE_integer("layers", None, "override the layer count (quick what-ifs)")
  flags.DEFINE_string("mesh", "data=1,fsdp=-1,tensor=1", "mesh axes")
  flags.DEFINE_integer("batch", 32, "sequences per update (one micro-batch)")
  flags.DEFINE_integer("seq_len", 8192, "tokens per sequence")
  flags.DEFINE_integer("cache_len", None, "sampler cache slots (default seq_len)")
  flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
  flags.DEFINE_string("param_dtype", "float32", "parameter dtype")
  flags.DEFINE_bool("remat", True, "rematerialise decoder layers")
  flags.DEFINE_bool("critic", True, "also plan the critic (PPO)")
  flags.DEFINE_float("device_memory_gib", None, "memory per device, for a verdict")
  flags.DEFINE_integer("fake_devices", 0, "plan for N fake CPU devices (read before JAX starts)")
  flags.DEFINE_string("out", None, "also write the plan as JSON here")


def preset(name: str) -> qwen2.Qwen2Config:
  """The named model preset; UserInputError listing the known ones otherwise."""
  if name not in qwen2.PRESETS:
    known = ", ".join(sorted(qwen2.PRESETS))
    raise UserInputError(f"--model={name}: unknown preset; known: {known} "
                         "(or give --hf_config=config.json)")
  return qwen2.PRESETS[name]


def main(argv):
  try:
    _plan_from_flags(argv)
  except UserInputError as e:  # the user's mistake: one line; our bugs keep their traceback
    raise SystemExit(f"error: {e}") from None


def _plan_from_flags(argv):
  del argv
  FLAGS = flags.FLAGS
  if FLAGS.hf_config:
    with open(FLAGS.hf_config) as f:
      config = qwen2.Qwen2Config.from_hf_dict(json.load(f), source=FLAGS.hf_config)
  else:
    config = preset(FLAGS.model)
  if FLAGS.layers:
    config = dataclasses.replace(config, num_layers=FLAGS.layers)
  result = plan(config, parse_mesh(FLAGS.mesh), FLAGS.batch, FLAGS.seq_len,
                dtype=FLAGS.dtype, param_dtype=FLAGS.param_dtype, remat=FLAGS.remat,
                critic=FLAGS.critic, cache_len=FLAGS.cache_len)
  print(f"{FLAGS.hf_config or FLAGS.model}: {result['policy_update']['parameters'] / 1e9:.2f}B "
        f"parameters, mesh {result['mesh']} on {jax.devices()[0].platform}, batch {FLAGS.batch} "
        f"x {FLAGS.seq_len} tokens, {FLAGS.dtype} compute / {FLAGS.param_dtype} weights, "
        f"remat {FLAGS.remat}")
  print(f"{'per device, GiB':<18}{'arguments':>11}{'outputs':>10}{'temporaries':>13}{'peak':>8}")
  for name in ("policy_update", "critic_update"):
    if name in result:
      r = result[name]
      print(f"{name:<18}{r['argument_gib']:>11.2f}{r['output_gib']:>10.2f}{r['temp_gib']:>13.2f}"
            f"{r['peak_gib']:>8.2f}")
  print(f"sampler KV cache  {result['kv_cache_gib']:.2f} GiB per device")
  print(f"estimated peak    {result['peak_gib']:.2f} GiB per device (policy + critic resident, "
        "plus the largest of update temporaries and KV cache)")
  if FLAGS.device_memory_gib:
    verdict = "fits" if result["peak_gib"] <= FLAGS.device_memory_gib else "does NOT fit"
    print(f"verdict: {verdict} in {FLAGS.device_memory_gib:g} GiB per device")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
