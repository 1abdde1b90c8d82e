"""Will it fit? Compile every program of a PPO step for a model size and mesh, with no weights.

  python -m rlver_jax.plan --model=qwen2.5-7b --mesh=data=1,fsdp=8,tensor=1 \
      --batch=8 --seq_len=16384 --device_memory_gib=80 [--fake_devices=8]

Each program is lowered with abstract arrays (`jax.ShapeDtypeStruct` carrying
their shardings), compiled by XLA for the devices at hand, and its memory
analysis gives bytes per device. The programs: the policy and critic
updates, the critic's value pass and the reference log-prob pass (run before
the updates in micro-batches of the update's size), and the sampler's row
prefill and decode chunk over a KV cache of `cache_len` slots. What stays
resident (policy and critic weights and optimizer states, the sampler's copy
of the weights in `--sampling_dtype`) is counted once; the peak is
resident plus the largest of what any one program adds on top (its other
arguments such as the batch or the KV cache, temporaries and new outputs).
Compile seconds are reported per program. `--fake_devices=N` plans for N
devices on the host CPU (it must come before JAX starts, so this module
reads it first).
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
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from models import partitioning, qwen2  # noqa: E402
from models import sampler as sampler_lib  # noqa: E402
from models.errors import UserInputError  # noqa: E402
from rl import forward, learner, updates  # noqa: E402
from rl.batch import TrainBatch  # noqa: E402
from rl.losses import LossConfig  # noqa: E402
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


def _rows(mesh, shape, dtype):
  """An abstract array sharded over its leading (batch) axis."""
  return jax.ShapeDtypeStruct(shape, dtype, sharding=partitioning.batch_sharding(shape, mesh))


def _batch(mesh, batch: int, seq_len: int, *, targets: bool, with_values: bool) -> TrainBatch:
  """An abstract sharded TrainBatch: the model inputs, with `targets` what an update reads."""
  spec = functools.partial(_rows, mesh)
  out = TrainBatch(tokens_bt=spec((batch, seq_len), jnp.int32),
                   attention_mask_bt=spec((batch, seq_len), jnp.bool_))
  if targets:
    target = lambda: spec((batch, seq_len - 1), jnp.float32)
    out = out.replace(loss_mask_bt=target(), old_logprobs_bt=target(), advantages_bt=target())
    if with_values:
      out = out.replace(returns_bt=target(), old_values_bt=target())
  return out


def _device_gib(tree) -> float:
  """Per-device GiB of a pytree of sharded abstract arrays."""
  total = 0
  for x in jax.tree.leaves(tree):
    total += math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
  return total / GIB


def _compile(fn, args, mesh, resident, **static) -> dict:
  """Compiles `fn(*args, **static)`; `resident` are the arguments that stay in memory
  between steps."""
  with partitioning.mesh_context(mesh):
    lowered = fn.lower(*args, **static)
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
  stats = compiled.memory_analysis()
  argument_gib = stats.argument_size_in_bytes / GIB
  temp_gib = stats.temp_size_in_bytes / GIB
  # Donated inputs alias outputs: new memory = temporaries + outputs not aliased to inputs.
  new_outputs_gib = (stats.output_size_in_bytes - stats.alias_size_in_bytes) / GIB
  resident_gib = _device_gib(resident)
  return {"compile_s": seconds, "argument_gib": argument_gib, "temp_gib": temp_gib,
          "output_gib": stats.output_size_in_bytes / GIB,
          "peak_gib": argument_gib + temp_gib + new_outputs_gib,
          # What this program needs beyond the resident weights and optimizer states.
          "extra_gib": argument_gib - resident_gib + temp_gib + new_outputs_gib}


class _Model:
  """One abstract model on the mesh: graphdef, sharded abstract params (and optimizer)."""

  def __init__(self, model_cls, config, mesh, dtype, param_dtype, remat, attention):
    abstract = nnx.eval_shape(lambda: model_cls(config, dtype=dtype, param_dtype=param_dtype,
                                                remat=remat, attention=attention,
                                                rngs=nnx.Rngs(0)))
    self.graphdef, state = nnx.split(abstract)
    self.param_shardings = partitioning.state_shardings(state, mesh)
    self.params = _abstract(state, self.param_shardings)
    self.num_params = sum(x.size for x in jax.tree.leaves(state))
    self.tx = learner.make_optimizer(learner.OptimConfig())
    abstract_opt = jax.eval_shape(self.tx.init, self.params)
    self.opt = _abstract(abstract_opt, _opt_shardings(self.tx, abstract_opt,
                                                      self.param_shardings, mesh))

  def sampling_copy(self, mesh, dtype, layout: str):
    """The sampler's copy of the weights (`sampler.decoding_copy`) in `dtype` and `layout`
    (partitioning.SAMPLING_LAYOUTS): its graphdef and sharded abstract weights."""
    graphdef, abstract_copy, _ = sampler_lib.decoding_copy(
        self.graphdef, self.params, dtype, sampler_lib.layers_as_list(layout, mesh))
    shardings = partitioning.state_shardings(abstract_copy, mesh,
                                             partitioning.SAMPLING_LAYOUTS[layout])
    return graphdef, _abstract(abstract_copy, shardings)


def sampler_row_programs(graphdef, params, config, mesh, batch, cache_len, prefill_len,
                         dtype, layers_as_list: bool = False) -> dict:
  """The sampler's row programs as the rollout engine runs them, from the weights `params`
  it decodes with (`layers_as_list`: their layers are a list, and so is the cache): a
  prefill of `prefill_len` tokens into every row, and one decode chunk of every row.
  Name -> (jitted program, abstract arguments, static arguments)."""
  cache = jax.eval_shape(lambda: qwen2.KVCache.init_rows(config, batch, cache_len, dtype,
                                                         layers_as_list))
  replicated = NamedSharding(mesh, PartitionSpec())
  kv_sharding = lambda x: partitioning.named_sharding(qwen2.KV_CACHE_AXES[-x.ndim:], x.shape,
                                                      mesh)
  cache = cache.map_kv(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=kv_sharding(x)))
  cache = cache.replace(
      kv_positions_bs=_rows(mesh, cache.kv_positions_bs.shape, jnp.int32),
      length=jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=replicated))
  rows = functools.partial(_rows, mesh)
  logits_bv = rows((batch, config.vocab_size), jnp.float32)
  index_k, rows_k = rows((batch,), jnp.int32), rows((batch,), jnp.int32)  # local, global ids
  prefill, decode = sampler_lib.row_programs(graphdef, (0,), 0)
  scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype, sharding=replicated)
  key_k = rows((batch,), jax.eval_shape(lambda: jax.random.key(0)).dtype)
  per_row = lambda: rows((batch,), jnp.int32)  # budgets, row ids, offsets
  return {
      "sampler_prefill": (prefill, (params, cache, logits_bv, index_k, rows_k,
                                    rows((batch, prefill_len), jnp.int32),
                                    rows((batch, prefill_len), jnp.bool_), rows((batch,), jnp.bool_)),
                          {"slots": cache_len}),
      "sampler_decode": (decode, (params, cache, logits_bv, index_k, rows_k, per_row(), key_k,
                                  per_row(), per_row(), scalar(jnp.float32),
                                  scalar(jnp.float32), scalar(jnp.int32)),
                         {"steps": sampler_lib.DECODE_CHUNK_STEPS, "slots": cache_len,
                          "greedy": False, "top_k": 0, "use_top_p": False})}


def kv_cache_gib(config: qwen2.Qwen2Config, mesh, batch: int, cache_len: int, dtype) -> float:
  """Per-device bytes of the sampler's k and v caches, all layers, in GiB."""
  shape = (config.num_layers, batch, config.num_kv_heads, cache_len, config.head_size)
  shard = partitioning.named_sharding(qwen2.KV_CACHE_AXES, shape, mesh).shard_shape(shape)
  return 2 * math.prod(shard) * jnp.dtype(dtype).itemsize / GIB


def plan(config: qwen2.Qwen2Config, mesh_axes: dict, batch: int, seq_len: int, *,
         dtype="bfloat16", param_dtype="float32", remat="full", attention="auto", critic=True,
         reference=False, sampler=True, cache_len: int | None = None,
         prefill_len: int | None = None, sampling_dtype: str = "bfloat16",
         sampling_layout: str = "train") -> dict:
  """Per-device memory and compile seconds of every program of one training step.

  `batch` is the update's micro-batch (the value and reference passes run in
  micro-batches of the same size); `cache_len` the sampler's KV slots
  (default `seq_len`) and `prefill_len` its longest prefill chunk (default
  `cache_len // 2`). The sampler decodes from a resident copy of the policy in
  `sampling_dtype` and `sampling_layout` (the recipes' `rollout.sampling_dtype` and
  `rollout.sampling_layout`; an empty dtype decodes from the training weights).
  """
  mesh = partitioning.make_mesh(mesh_axes)
  dtype, param_dtype = jnp.dtype(dtype), jnp.dtype(param_dtype)
  remat = qwen2.remat_policy_name(remat)
  cache_len = cache_len or seq_len
  prefill_len = prefill_len or cache_len // 2
  loss_cfg = LossConfig()
  result = {"model": dataclasses.asdict(config), "mesh": dict(mesh.shape), "batch": batch,
            "seq_len": seq_len, "cache_len": cache_len, "prefill_len": prefill_len,
            "dtype": dtype.name, "param_dtype": param_dtype.name, "remat": remat,
            "attention": attention, "devices": mesh.devices.size,
            "sampling_dtype": sampling_dtype if sampler else "",
            "sampling_layout": sampling_layout, "sampling_copy_gib": 0.0}
  build = lambda cls: _Model(cls, config, mesh, dtype, param_dtype, remat, attention)
  programs = {}

  def update(model, loss_fn, with_values):
    step = jax.jit(functools.partial(updates.update, loss_fn, model.graphdef, model.tx,
                                     loss_cfg), donate_argnums=(0, 1))
    args = (model.params, model.opt,
            _batch(mesh, batch, seq_len, targets=True, with_values=with_values))
    return _compile(step, args, mesh, (model.params, model.opt))

  def forward_pass(model, fn):
    step = jax.jit(functools.partial(fn, model.graphdef))
    args = (model.params, _batch(mesh, batch, seq_len, targets=False, with_values=False))
    return _compile(step, args, mesh, model.params)

  policy = build(qwen2.Qwen2)
  result["parameters"] = policy.num_params
  result["unsharded_weights_gib"] = policy.num_params * param_dtype.itemsize / GIB
  resident = [(policy.params, policy.opt)]
  programs["policy_update"] = update(policy, updates.policy_loss, False)
  if critic:
    value_model = build(qwen2.Qwen2Value)
    resident.append((value_model.params, value_model.opt))
    programs["critic_values"] = forward_pass(value_model, forward.critic_values)
    programs["critic_update"] = update(value_model, updates.critic_loss, True)
  if reference:
    resident.append(policy.params)  # a frozen copy of the initial policy
    programs["reference_logprobs"] = forward_pass(policy, functools.partial(
        forward.sequence_logprobs, temperature=1.0))
  if sampler:
    sampling_graphdef, sampling_params = policy.graphdef, policy.params
    as_list = False  # the training weights scan their layers
    if sampling_dtype:  # a resident copy for decoding (Sampler(sampling_dtype=...))
      as_list = sampler_lib.layers_as_list(sampling_layout, mesh)
      sampling_graphdef, sampling_params = policy.sampling_copy(
          mesh, jnp.dtype(sampling_dtype), sampling_layout)
      resident.append(sampling_params)
      result["sampling_copy_gib"] = _device_gib(sampling_params)
    for name, (program, args, static) in sampler_row_programs(
        sampling_graphdef, sampling_params, config, mesh, batch, cache_len, prefill_len,
        dtype, as_list).items():
      programs[name] = _compile(program, args, mesh, sampling_params, **static)
  result["programs"] = programs
  result["kv_cache_gib"] = kv_cache_gib(config, mesh, batch, cache_len, dtype)
  result["resident_gib"] = _device_gib(resident)
  result["compile_s"] = sum(p["compile_s"] for p in programs.values())
  result["peak_gib"] = result["resident_gib"] + max(p["extra_gib"] for p in programs.values())
  return result


def _define_flags() -> None:
  flags.DEFINE_string("model", "qwen2.5-7b", f"one of {sorted(qwen2.PRESETS)}")
  flags.DEFINE_string("hf_config", None, "an HF config.json instead of --model")
  flags.DEFINE_integer("layers", None, "override the layer count (quick what-ifs)")
  flags.DEFINE_string("mesh", "data=1,fsdp=-1,tensor=1", "mesh axes")
  flags.DEFINE_integer("batch", 32, "sequences per update (one micro-batch)")
  flags.DEFINE_integer("seq_len", 8192, "tokens per sequence")
  flags.DEFINE_integer("cache_len", None, "sampler cache slots (default seq_len)")
  flags.DEFINE_integer("prefill_len", None, "longest sampler prefill chunk (default cache/2)")
  flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
  flags.DEFINE_string("param_dtype", "float32", "parameter dtype")
  flags.DEFINE_string("remat", "full", f"remat policy, one of {qwen2.REMAT_POLICIES}")
  flags.DEFINE_string("attention", "auto", "attention implementation (models/attention.py)")
  flags.DEFINE_bool("critic", True, "also plan the critic (PPO)")
  flags.DEFINE_bool("reference", False, "also plan a reference policy (KL penalty)")
  flags.DEFINE_bool("sampler", True, "also plan the sampler's prefill and decode")
  flags.DEFINE_string("sampling_dtype", "bfloat16", "the sampler's resident copy of the "
                      "weights (rollout.sampling_dtype); empty: it decodes from the training "
                      "weights")
  flags.DEFINE_string("sampling_layout", "train", "that copy's layout "
                      "(rollout.sampling_layout): train (fsdp-sharded) or decode (whole on "
                      "every fsdp shard)")
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
                attention=FLAGS.attention, critic=FLAGS.critic, reference=FLAGS.reference,
                sampler=FLAGS.sampler, cache_len=FLAGS.cache_len, prefill_len=FLAGS.prefill_len,
                sampling_dtype=FLAGS.sampling_dtype, sampling_layout=FLAGS.sampling_layout)
  print(f"{FLAGS.hf_config or FLAGS.model}: {result['parameters'] / 1e9:.2f}B parameters, "
        f"mesh {result['mesh']} on {jax.devices()[0].platform}, batch {FLAGS.batch} x "
        f"{FLAGS.seq_len} tokens, {FLAGS.dtype} compute / {FLAGS.param_dtype} weights, "
        f"remat {result['remat']}, attention {result['attention']}")
  print(f"{'per device, GiB':<20}{'arguments':>11}{'temporaries':>13}{'outputs':>10}"
        f"{'+resident':>11}{'compile s':>11}")
  for name, r in result["programs"].items():
    print(f"{name:<20}{r['argument_gib']:>11.2f}{r['temp_gib']:>13.2f}{r['output_gib']:>10.2f}"
          f"{r['extra_gib']:>11.2f}{r['compile_s']:>11.1f}")
  copy = (f", the sampler's {result['sampling_dtype']} copy ({result['sampling_layout']} "
          f"layout) {result['sampling_copy_gib']:.2f}" if result["sampling_copy_gib"] else "")
  print(f"resident          {result['resident_gib']:.2f} GiB per device (policy and critic "
        f"weights and optimizer states{copy}); sampler KV cache "
        f"{result['kv_cache_gib']:.2f} GiB")
  print(f"estimated peak    {result['peak_gib']:.2f} GiB per device (resident plus the largest "
        f"'+resident' column); compile {result['compile_s']:.1f} s in all")
  if FLAGS.device_memory_gib:
    verdict = "fits" if result["peak_gib"] <= FLAGS.device_memory_gib else "does NOT fit"
    print(f"verdict: {verdict} in {FLAGS.device_memory_gib:g} GiB per device")
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      json.dump(result, f, indent=2)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
