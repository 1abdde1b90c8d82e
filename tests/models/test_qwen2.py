"""Qwen2 in Flax against transformers' PyTorch Qwen2 on the same weights."""

import collections
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from infra.errors import UserInputError
from models import attention as attention_lib
from models import qwen2
from tests.hf_fixtures import hf_logits, make_hf_qwen2

# bf16 against the fp32 reference: max abs logit diff at most this share of
# the largest reference logit. Measured on these fixtures: 0.6-0.7% with bf16
# weights and compute, 0.3-0.4% with bf16 weights and fp32 compute.
BF16_RELATIVE_BOUND = 0.02


def assert_within_bf16_bound(ours, ref):
  diff = np.abs(ours - ref).max()
  assert diff <= BF16_RELATIVE_BOUND * np.abs(ref).max(), (diff, np.abs(ref).max())


def random_ids(shape, vocab=128, seed=0):
  return np.random.RandomState(seed).randint(0, vocab, shape).astype(np.int32)


@pytest.fixture(scope="module")
def untied_checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("untied")
  return path, make_hf_qwen2(path, tied=False, heads=4, kv_heads=2)


@pytest.mark.parametrize("tied,heads,kv_heads,attention", [
    (False, 4, 2, "einsum"),     # GQA 2:1
    (True, 4, 4, "einsum"),      # plain multi-head
    (False, 8, 1, "einsum"),     # multi-query
    (True, 6, 2, "einsum"),      # GQA 3:1
    (False, 8, 1, "blockwise"),
    (True, 6, 2, "blockwise"),
])
def test_logits_match_transformers_fp32(tmp_path, monkeypatch, tied, heads, kv_heads, attention):
  # Blocks of 4 on any platform: 11 tokens make three blocks, a ragged tail.
  monkeypatch.setattr(attention_lib, "default_block", lambda: 4)
  hf = make_hf_qwen2(tmp_path, tied=tied, heads=heads, kv_heads=kv_heads, hidden=16 * heads)
  model = qwen2.from_pretrained(tmp_path, dtype="float32", attention=attention)
  assert model.config.tie_word_embeddings == tied
  assert hasattr(model, "lm_head") != tied
  ids = random_ids((3, 11))
  ours = np.asarray(model(jnp.asarray(ids)))
  assert ours.dtype == np.float32 and ours.shape == (3, 11, 128)
  np.testing.assert_allclose(ours, hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("side,attention", [("left", "einsum"), ("right", "einsum"),
                                            ("left", "blockwise"), ("right", "blockwise")])
def test_padded_batch_matches_transformers(untied_checkpoint, monkeypatch, side, attention):
  monkeypatch.setattr(attention_lib, "default_block", lambda: 4)
  path, hf = untied_checkpoint
  model = qwen2.from_pretrained(path, dtype="float32", attention=attention)
  lengths = [9, 4, 6]
  width = max(lengths)
  ids = random_ids((3, width), seed=1)
  mask = np.zeros((3, width), np.int32)
  for row, n in enumerate(lengths):
    if side == "left":
      mask[row, width - n:] = 1
    else:
      mask[row, :n] = 1
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  ours = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
  # Each row alone, unpadded, through HF: the reference for its real tokens.
  for row, n in enumerate(lengths):
    real = mask[row].astype(bool)
    ref = hf_logits(hf, ids[row:row + 1, real])[0]
    np.testing.assert_allclose(ours[row, real], ref, atol=1e-4, rtol=0)
  # And the padded batch through HF with the same mask and positions.
  ref_batch = hf_logits(hf, ids, attention_mask=mask, position_ids=positions)
  real = mask.astype(bool)
  np.testing.assert_allclose(ours[real], ref_batch[real], atol=1e-4, rtol=0)
  assert np.isfinite(ours).all()  # padding rows attend nothing but stay finite


def test_explicit_positions_match_transformers(untied_checkpoint):
  path, hf = untied_checkpoint
  model = qwen2.from_pretrained(path)
  ids = random_ids((2, 5), seed=2)
  positions = np.array([[3, 4, 5, 6, 7], [10, 11, 12, 13, 14]], np.int32)
  ours = np.asarray(model(jnp.asarray(ids), positions=jnp.asarray(positions)))
  np.testing.assert_allclose(ours, hf_logits(hf, ids, position_ids=positions), atol=1e-4, rtol=0)


def test_logits_bf16_within_bound(untied_checkpoint):
  path, hf = untied_checkpoint
  model = qwen2.from_pretrained(path, dtype="bfloat16")
  assert model.backbone.embed.get_value().dtype == jnp.bfloat16
  ids = random_ids((2, 16), seed=3)
  ours = np.asarray(model(jnp.asarray(ids)))
  assert ours.dtype == np.float32
  assert_within_bf16_bound(ours, hf_logits(hf, ids))


def test_param_dtype_and_compute_dtype_are_separate(untied_checkpoint):
  path, hf = untied_checkpoint
  model = qwen2.from_pretrained(path, dtype="float32", param_dtype="bfloat16")
  assert model.backbone.layers.mlp.up_proj.get_value().dtype == jnp.bfloat16
  ids = random_ids((1, 8), seed=4)
  assert_within_bf16_bound(np.asarray(model(jnp.asarray(ids))), hf_logits(hf, ids))


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_through_transformers(tmp_path, tied):
  hf = make_hf_qwen2(tmp_path / "in", tied=tied)
  model = qwen2.from_pretrained(tmp_path / "in")
  qwen2.save_pretrained(model, tmp_path / "out")
  reloaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "out").eval()
  ids = random_ids((2, 9), seed=5)
  np.testing.assert_allclose(hf_logits(reloaded, ids), hf_logits(hf, ids), atol=1e-6, rtol=0)
  np.testing.assert_allclose(hf_logits(reloaded, ids), np.asarray(model(jnp.asarray(ids))),
                             atol=1e-4, rtol=0)
  with open(tmp_path / "out" / "config.json") as f:
    assert json.load(f)["tie_word_embeddings"] == tied


def test_sharded_safetensors_with_index(tmp_path, untied_checkpoint):
  path, hf = untied_checkpoint
  model = qwen2.from_pretrained(path)
  qwen2.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=40_000)
  files = sorted(os.listdir(tmp_path / "sharded"))
  assert "model.safetensors.index.json" in files
  assert sum(f.endswith(".safetensors") for f in files) > 2
  ids = random_ids((2, 6), seed=6)
  by_hf = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "sharded").eval()
  np.testing.assert_allclose(hf_logits(by_hf, ids), hf_logits(hf, ids), atol=1e-6, rtol=0)
  by_us = qwen2.from_pretrained(tmp_path / "sharded")
  np.testing.assert_allclose(np.asarray(by_us(jnp.asarray(ids))), hf_logits(hf, ids),
                             atol=1e-4, rtol=0)


def test_save_in_bfloat16_loads_in_transformers(tmp_path, untied_checkpoint):
  path, _ = untied_checkpoint
  model = qwen2.from_pretrained(path)
  qwen2.save_pretrained(model, tmp_path / "bf16", dtype="bfloat16")
  reloaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
  assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
  ours = qwen2.from_pretrained(tmp_path / "bf16", dtype="float32")
  assert ours.backbone.embed.get_value().dtype == jnp.float32
  ref = np.asarray(model.backbone.embed.get_value())
  np.testing.assert_allclose(np.asarray(ours.backbone.embed.get_value()), ref, atol=1e-2)


@pytest.mark.parametrize("attention", ["einsum", "blockwise"])
def test_kv_cache_prefill_then_decode_matches_full_forward(untied_checkpoint, monkeypatch,
                                                          attention):
  monkeypatch.setattr(attention_lib, "default_block", lambda: 4)
  path, _ = untied_checkpoint
  model = qwen2.from_pretrained(path, attention=attention)
  ids = random_ids((2, 10), seed=7)
  mask = np.ones((2, 10), np.int32)
  mask[1, :3] = 0  # row 1 is left-padded
  full = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))

  cache = qwen2.KVCache.init(model.config, batch_size=2, max_len=16, dtype=jnp.float32)
  logits, cache = model(jnp.asarray(ids[:, :6]), attention_mask=jnp.asarray(mask[:, :6]),
                        cache=cache)
  pieces = [np.asarray(logits)]
  for t in range(6, 10):
    logits, cache = model(jnp.asarray(ids[:, t:t + 1]), attention_mask=jnp.asarray(mask[:, t:t + 1]),
                          cache=cache)
    pieces.append(np.asarray(logits))
  stepped = np.concatenate(pieces, axis=1)
  real = mask.astype(bool)
  np.testing.assert_allclose(stepped[real], full[real], atol=1e-5, rtol=0)
  assert int(cache.length) == 10
  np.testing.assert_array_equal(np.asarray(cache.kv_positions_bs[1, :10]),
                                [-1, -1, -1, 0, 1, 2, 3, 4, 5, 6])


@pytest.mark.heavy
@pytest.mark.parametrize("remat", [True, "full", "save_dots"])
def test_remat_gives_same_logits_and_gradients(untied_checkpoint, remat):
  path, _ = untied_checkpoint
  plain = qwen2.from_pretrained(path)
  remat = qwen2.from_pretrained(path, remat=remat)
  ids = jnp.asarray(random_ids((2, 8), seed=8))

  def loss(model):
    return jnp.mean(jax.nn.log_softmax(model(ids))[..., 0])

  loss_plain, grads_plain = nnx.value_and_grad(loss)(plain)
  loss_remat, grads_remat = nnx.value_and_grad(loss)(remat)
  np.testing.assert_allclose(loss_plain, loss_remat, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads_plain), jax.tree.leaves(grads_remat)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def _small_config(layers):
  return qwen2.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_layers=layers, num_heads=4, num_kv_heads=2)


def _compiled_gradient(config, remat, batch=2, seq=128):
  """The jitted gradient of a loss over an abstract model: (compile seconds, executable)."""
  model = nnx.eval_shape(lambda: qwen2.Qwen2(config, remat=remat, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(model)

  def loss(state, ids):
    return jnp.mean(nnx.merge(graphdef, state)(ids)[..., 0])

  ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  lowered = jax.jit(jax.grad(loss)).lower(state, ids)
  start = time.perf_counter()
  compiled = lowered.compile()
  return time.perf_counter() - start, compiled


@pytest.mark.heavy
def test_remat_policies_trade_memory_for_recomputation():
  temp = {policy: _compiled_gradient(_small_config(4), policy, seq=256)[1].memory_analysis()
          .temp_size_in_bytes for policy in ("none", "save_dots", "full")}
  assert temp["full"] < temp["save_dots"] < temp["none"], temp


def test_remat_policy_errors_name_the_field():
  with pytest.raises(UserInputError, match=r"remat policy 'some' \(policy.remat_policy\)"):
    qwen2.init_random(_small_config(1), remat="some")
  if jax.default_backend() == "cpu":
    model = qwen2.init_random(_small_config(1), remat="offload")
    with pytest.raises(UserInputError, match="offload.*CPU"):
      model(jnp.zeros((1, 4), jnp.int32))


@pytest.mark.heavy
def test_compile_time_does_not_grow_with_depth():
  """Scanned layers: 28 layers compile in at most twice the time of 4 (forward + backward)."""
  _compiled_gradient(_small_config(2), "full")  # warm-up: first compile pays one-off costs
  four = min(_compiled_gradient(_small_config(4), "full")[0] for _ in range(3))
  deep = min(_compiled_gradient(_small_config(28), "full")[0] for _ in range(3))
  assert deep <= 2 * four, (four, deep)


def test_sharded_load_reads_each_tensor_once_into_stacked_layers(untied_checkpoint, monkeypatch):
  from models import partitioning, safetensors_io
  path, hf = untied_checkpoint
  reads = collections.Counter()
  original = safetensors_io.SafetensorsFile.read

  def counting_read(self, name):
    reads[name] += 1
    return original(self, name)

  monkeypatch.setattr(safetensors_io.SafetensorsFile, "read", counting_read)
  mesh = partitioning.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  model = qwen2.from_pretrained(path, mesh=mesh)
  assert reads and set(reads.values()) == {1}  # 8 devices, yet one read per HF tensor
  up = model.backbone.layers.mlp.up_proj.get_value()  # [L=2, D=64, F] over fsdp and tensor
  assert up.shape[0] == 2 and up.addressable_shards[0].data.shape == (2, 16, up.shape[2] // 2)
  ids = random_ids((4, 7), seed=10)
  with partitioning.mesh_context(mesh):
    ours = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))
  np.testing.assert_allclose(ours, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_value_model_starts_from_policy_backbone(untied_checkpoint):
  path, hf = untied_checkpoint
  critic = qwen2.value_model_from_pretrained(path)
  ids = random_ids((2, 7), seed=9)
  values = np.asarray(critic(jnp.asarray(ids)))
  assert values.shape == (2, 7) and values.dtype == np.float32
  np.testing.assert_array_equal(values, 0.0)  # zero-initialised head
  with torch.no_grad():
    hidden = hf(torch.tensor(ids, dtype=torch.long), output_hidden_states=True).hidden_states[-1]
  ours_hidden, _ = critic.backbone(jnp.asarray(ids))
  np.testing.assert_allclose(np.asarray(ours_hidden), hidden.numpy(), atol=1e-4, rtol=0)
  # A trained head reads the backbone's last hidden state.
  head = np.random.RandomState(0).randn(critic.config.hidden_size).astype(np.float32)
  critic.value_head.set_value(jnp.asarray(head))
  np.testing.assert_allclose(np.asarray(critic(jnp.asarray(ids))), hidden.numpy() @ head,
                             atol=1e-4, rtol=0)


def test_presets_cover_every_qwen25_size():
  assert set(qwen2.PRESETS) == {f"qwen2.5-{s}" for s in
                                ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")}
  seven = qwen2.PRESETS["qwen2.5-7b"]
  assert (seven.num_heads, seven.num_kv_heads, seven.head_size) == (28, 4, 128)
  # Parameter count of Qwen2.5-7B: 7.62B.
  abstract = nnx.eval_shape(lambda: qwen2.Qwen2(seven, rngs=nnx.Rngs(0)))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract)))
  assert abs(n_params / 1e9 - 7.62) < 0.01


# Errors name the problem.

def test_error_no_such_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    qwen2.from_pretrained(tmp_path / "nope")


def test_error_no_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    qwen2.from_pretrained(tmp_path)


def test_error_not_qwen2(tmp_path, untied_checkpoint):
  path, _ = untied_checkpoint
  shutil.copytree(path, tmp_path / "llama")
  config_path = tmp_path / "llama" / "config.json"
  config = json.loads(config_path.read_text())
  config.update(model_type="llama", architectures=["LlamaForCausalLM"])
  config_path.write_text(json.dumps(config))
  with pytest.raises(ValueError, match="not a Qwen2 architecture.*llama"):
    qwen2.from_pretrained(tmp_path / "llama")


def _rewrite_tensors(src, dst, edit):
  from models import safetensors_io
  shutil.copytree(src, dst)
  st = safetensors_io.SafetensorsFile(dst / "model.safetensors")
  tensors = {name: np.array(st.read(name)) for name in st.names()}
  del st
  edit(tensors)
  safetensors_io.write(dst / "model.safetensors", tensors)


def test_error_missing_and_unexpected_tensors(tmp_path, untied_checkpoint):
  path, _ = untied_checkpoint

  def edit(tensors):
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["lm_head.weight"]
    tensors["model.layers.0.extra.weight"] = np.zeros(3, np.float32)

  _rewrite_tensors(path, tmp_path / "bad", edit)
  with pytest.raises(ValueError) as err:
    qwen2.from_pretrained(tmp_path / "bad")
  message = str(err.value)
  assert "missing tensors (2): lm_head.weight, model.layers.1.mlp.up_proj.weight" in message
  assert "unexpected tensors (1): model.layers.0.extra.weight" in message


def test_error_shape_mismatch(tmp_path, untied_checkpoint):
  path, _ = untied_checkpoint

  def edit(tensors):
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)

  _rewrite_tensors(path, tmp_path / "bad", edit)
  with pytest.raises(ValueError, match=r"k_proj.weight has shape \(16, 64\).*\(32, 64\)"):
    qwen2.from_pretrained(tmp_path / "bad")


def test_error_no_safetensors(tmp_path, untied_checkpoint):
  path, _ = untied_checkpoint
  (tmp_path / "bin").mkdir()
  shutil.copy(path / "config.json", tmp_path / "bin" / "config.json")
  (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match="no .safetensors.*pytorch_model.bin"):
    qwen2.from_pretrained(tmp_path / "bin")


@pytest.mark.heavy
@pytest.mark.parametrize("remat", ["none", "full"])
def test_unscanned_layers_give_the_scanned_models_logits_and_cache(remat):
  model = qwen2.init_random(_small_config(3), seed=3, remat=remat)
  graphdef, state = nnx.split(model)
  holder = {}

  def unscan(state):  # under jit, as the sampler builds its copy
    holder["graphdef"], loop_state = nnx.split(qwen2.unscanned(nnx.merge(graphdef, state)))
    return loop_state

  loop_state = jax.jit(unscan)(state)
  loop = nnx.merge(holder["graphdef"], loop_state)
  assert isinstance(loop.backbone.layers, nnx.List) and len(loop.backbone.layers) == 3
  q_proj = loop.backbone.layers[1].attn.q_proj
  assert q_proj.get_metadata()["logical_axes"] == ("embed", "q_heads", "head_dim")
  np.testing.assert_array_equal(q_proj[...], model.backbone.layers.attn.q_proj[...][1])

  ids = jnp.asarray(random_ids((2, 9), seed=4))
  np.testing.assert_allclose(loop(ids), model(ids), atol=1e-6, rtol=0)
  for init in (qwen2.KVCache.init, qwen2.KVCache.init_rows):
    caches = []
    # The list of layers decodes with a cache of one array per layer; the scan with a stack.
    for m, as_list in ((model, False), (loop, True)):
      cache = init(m.config, batch_size=2, max_len=16, dtype=jnp.float32, layers_as_list=as_list)
      assert isinstance(cache.k, tuple) == as_list
      logits, cache = m(ids[:, :6], cache=cache)
      step, cache = m(ids[:, 6:7], cache=cache)
      assert isinstance(cache.k, tuple) == as_list
      # A list's arrays stack into the stack's layout.
      caches.append(tuple(map(np.asarray, (logits, step, cache.k, cache.v))))
    for a, b in zip(*caches):
      np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  with pytest.raises(ValueError, match="layers_as_list.*this one scans them"):
    model(ids, cache=qwen2.KVCache.init(model.config, 2, 16, jnp.float32, layers_as_list=True))
