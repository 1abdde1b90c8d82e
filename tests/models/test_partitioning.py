"""Meshes and sharded forward passes on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models import partitioning, qwen2
from rlver_jax import sharding
from tests.hf_fixtures import make_hf_qwen2


def jit_batched_apply(model: nnx.Module, mesh, batch_shapes):
  """Jits `model(*batch)` as `apply(state, *batch)` with explicit shardings.

  Weights go in their logical shardings, every batch array and the output
  are sharded over the batch axes. Returns `(apply, state)` with `state`
  already placed.
  """
  graphdef, state = nnx.split(model)
  state_shardings = partitioning.state_shardings(state, mesh)
  batch_shardings = tuple(partitioning.batch_sharding(shape, mesh) for shape in batch_shapes)

  def apply(state, *batch):
    return nnx.merge(graphdef, state)(*batch)

  with partitioning.mesh_context(mesh):  # activation constraints apply while tracing
    out_shape = jax.eval_shape(apply, state,
                               *(jax.ShapeDtypeStruct(s, "int32") for s in batch_shapes))
  jitted = jax.jit(apply, in_shardings=(state_shardings,) + batch_shardings,
                   out_shardings=partitioning.batch_sharding(out_shape.shape, mesh))

  def call(state, *batch):
    with partitioning.mesh_context(mesh):
      return jitted(state, *batch)

  return call, jax.device_put(state, state_shardings)


def test_eight_fake_devices():
  assert jax.device_count() == 8


def test_mesh_fills_the_minus_one_axis():
  assert partitioning.resolve_mesh_shape({"data": 2, "fsdp": -1, "tensor": 2}, 8) == {
      "data": 2, "fsdp": 2, "tensor": 2}
  mesh = partitioning.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  # Without -1 a mesh may take fewer devices than there are.
  assert partitioning.make_mesh({"data": 1, "fsdp": 2, "tensor": 1}).devices.size == 2


@pytest.mark.parametrize("axes,message", [
    ({"data": -1, "fsdp": -1}, "at most one axis"),
    ({"data": 3, "fsdp": -1}, "do not divide"),
    ({"data": 4, "fsdp": 4}, "needs 16 devices, 8 are available"),
    ({"data": 0, "fsdp": -1}, "positive"),
])
def test_mesh_errors(axes, message):
  with pytest.raises(ValueError, match=message):
    partitioning.resolve_mesh_shape(axes, 8)


def test_logical_rules_are_shape_aware():
  mesh = partitioning.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
  # 2 kv heads do not split over tensor=4: replicated on that dim.
  assert partitioning.logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh) == P(
      "fsdp", None, None)
  assert partitioning.logical_to_spec(("embed", "q_heads", "head_dim"), (64, 8, 16), mesh) == P(
      "fsdp", "tensor", None)
  # batch over data and fsdp; data has size 1 so only fsdp remains.
  assert partitioning.logical_to_spec(("batch", None), (6, 3), mesh) == P("fsdp", None)
  # A mesh axis is never used twice in one spec.
  assert partitioning.logical_to_spec(("mlp", "vocab"), (8, 8), mesh) == P("tensor", None)
  with pytest.raises(KeyError, match="no sharding rule for logical axis 'bogus'"):
    partitioning.logical_to_spec(("bogus",), (4,), mesh)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt")
  make_hf_qwen2(path, heads=4, kv_heads=2, hidden=64, intermediate=96, vocab=128)
  return path


@pytest.mark.parametrize("axes", [{"data": 1, "fsdp": 4, "tensor": 2},
                                  {"data": 2, "fsdp": 2, "tensor": 2}])
def test_sharded_forward_equals_unsharded(checkpoint, axes):
  mesh = partitioning.make_mesh(axes)
  reference = qwen2.from_pretrained(checkpoint)
  sharded = qwen2.from_pretrained(checkpoint, mesh=mesh)

  # Each device holds only its shard of a weight loaded with a mesh.
  q_proj = sharded.backbone.layers.attn.q_proj.get_value()  # [L=2, D=64, N=4, H=16]
  assert q_proj.sharding.spec == P(None, "fsdp", "tensor", None)
  shard_shape = q_proj.addressable_shards[0].data.shape
  assert shard_shape == (2, 64 // axes["fsdp"], 4 // axes["tensor"], 16)

  ids = np.random.RandomState(0).randint(0, 128, (8, 12)).astype(np.int32)
  apply, state = jit_batched_apply(sharded, mesh, [ids.shape])
  logits = apply(state, ids)
  assert logits.sharding.spec[0] is not None  # batch stays sharded
  np.testing.assert_allclose(np.asarray(logits), np.asarray(reference(jnp.asarray(ids))),
                             atol=1e-5, rtol=0)


def test_place_state_places_a_loaded_model(checkpoint):
  mesh = partitioning.make_mesh({"data": 1, "fsdp": 4, "tensor": 2})
  model = qwen2.from_pretrained(checkpoint)
  graphdef, state = nnx.split(model)
  placed = nnx.merge(graphdef, partitioning.place_state(state, mesh))
  embed = placed.backbone.embed.get_value()  # [V=128, D=64]: vocab->tensor, embed->fsdp
  assert embed.sharding.spec == P("tensor", "fsdp")
  ids = jnp.asarray(np.random.RandomState(1).randint(0, 128, (4, 5)), jnp.int32)
  np.testing.assert_allclose(np.asarray(jax.jit(lambda m, x: m(x))(placed, ids)),
                             np.asarray(model(ids)), atol=1e-5, rtol=0)


def test_distributed_is_not_initialised_on_one_host(monkeypatch):
  for name in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "SLURM_NTASKS"):
    monkeypatch.delenv(name, raising=False)
  assert sharding.maybe_initialize_distributed() is False


def test_activation_constraints_apply_only_under_a_mesh_context():
  mesh = partitioning.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  double = jax.jit(lambda x: partitioning.constrain(x * 2, ("batch", None, "vocab")))
  x = jnp.ones((4, 3, 8))
  with partitioning.mesh_context(mesh):
    assert double(x).sharding.spec == P(("data", "fsdp"), None, "tensor")
  assert double(x).sharding.is_fully_replicated  # no mesh: the identity
