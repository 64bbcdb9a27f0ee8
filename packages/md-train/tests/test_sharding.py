"""The same 4 training steps of the tiny Wan 2.1 transformer on 8 virtual devices (fsdp 8; data 2 × fsdp 4;
fsdp 2 × context 2 × tensor 2) equal one device within 1e-5, with parameters, Adam moments and the EMA
sharded by md-sharding's rules and kept so across steps."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import md_sharding as mds
import md_train as mdt
import md_train.families as mtf
import md_wan
from md_core.testing import fixture_path

STEPS, TOL = 4, 1e-5


def _batch():
  k1, k2 = jax.random.split(jax.random.key(1))
  return {
    "latents": jax.random.normal(k1, (8, 2, 4, 4, 4)),  # [B, F, H, W, C]
    "encoder_hidden_states": jax.random.normal(k2, (8, 6, 16)),
  }


def _train(mesh):
  model = md_wan.load_transformer(fixture_path("wan_transformer") / "t2v", mesh=mesh)
  frozen, params = mdt.split_trainable(model)
  opt = mdt.make_optimizer(learning_rate=1e-3, warmup_steps=1, ema_decay=0.9)
  state = mdt.init_state(params, opt, rng=0)
  batch, batch_sharding, shardings = _batch(), None, None
  if mesh is not None:
    batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    batch = jax.device_put(batch, batch_sharding)
    shardings = mdt.state_shardings(state)
  step = mdt.make_train_step(
    mtf.wan_loss(frozen), opt, state_sharding=shardings, batch_sharding=batch_sharding
  )
  losses = []
  for _ in range(STEPS):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return state, np.asarray(losses), shardings


@pytest.fixture(scope="module")
def single():
  state, losses, _ = _train(None)
  return jax.tree.map(np.asarray, (state.params, mdt.ema_of(state.opt_state))), losses


def _specs(tree):
  return [leaf.sharding.spec for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize(
  "mesh_config",
  [
    # fsdp 8 alone is in the slow suite: the other two meshes cover the data, fsdp, context and tensor axes.
    pytest.param(dict(ici_fsdp_parallelism=8), marks=pytest.mark.slow),
    dict(ici_data_parallelism=2, ici_fsdp_parallelism=4),
    dict(ici_fsdp_parallelism=2, ici_context_parallelism=2, ici_tensor_parallelism=2),
  ],
  ids=["fsdp8", "data2_fsdp4", "fsdp2_context2_tensor2"],
)
def test_sharded_steps_equal_one_device(single, mesh_config):
  (want_params, want_ema), want_losses = single
  mesh = mds.make_mesh(mds.MeshConfig(**mesh_config))
  state, losses, shardings = _train(mesh)
  np.testing.assert_allclose(losses, want_losses, atol=TOL, rtol=0)
  got = jax.tree.map(np.asarray, (state.params, mdt.ema_of(state.opt_state)))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves((want_params, want_ema))):
    np.testing.assert_allclose(g, w, atol=TOL, rtol=0)
  # Parameters are sharded (over fsdp at least), and the state keeps its shardings across steps.
  specs = _specs(state.params)
  assert any("fsdp" in str(s) for s in specs)
  assert jax.tree.leaves(state.params)[0].sharding.mesh.shape == mesh.shape
  assert specs == [s.spec for s in jax.tree.leaves(shardings.params)]
  # Adam's moments and the EMA are sharded like their parameters.
  adam = [
    s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
    if isinstance(s, optax.ScaleByAdamState)
  ]  # fmt: skip
  assert _specs(adam[0].mu) == specs and _specs(adam[0].nu) == specs
  assert _specs(mdt.ema_of(state.opt_state)) == specs
  assert isinstance(state.params, nnx.State)
