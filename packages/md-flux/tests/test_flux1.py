"""Flux.1 transformer: parity with diffusers (diffusers layout and BFL's single file), errors, config."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_attention as mda
import md_core
import md_flux
import md_sharding as mds
from md_core.testing import fixture_path, load_arrays, load_manifest

INPUTS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids")
ATOL = 1e-4


@pytest.fixture(scope="module")
def io():
  return load_arrays(fixture_path("flux_transformer") / "io.npz")


def inputs(io, guidance=True):
  kw = {k: jnp.asarray(io[k]) for k in INPUTS + ("txt_ids",)}
  if guidance:
    kw["guidance"] = jnp.asarray(io["guidance"])
  return kw


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, kw):
  return nnx.merge(graphdef, state)(**kw)


def run(model, kw):
  """The model under jit as a pure function of its state: models with the same structure (diffusers
  and BFL loads) and inputs of the same shapes share one compile."""
  graphdef, state = nnx.split(model)
  return _apply(graphdef, state, kw)


@pytest.fixture(scope="module")
def dev():
  return md_flux.load_flux(fixture_path("flux_transformer") / "dev")


def tiny_config():
  return md_flux.FluxConfig.from_json(fixture_path("flux_transformer") / "dev" / "config.json")


def test_dev_matches_diffusers(io, dev):
  chex.assert_trees_all_close(run(dev, inputs(io)), io["out_dev"], atol=ATOL, rtol=0)


def test_schnell_matches_diffusers(io):
  model = md_flux.load_flux(fixture_path("flux_transformer") / "schnell")
  assert model.time_text_embed.guidance_embedder is None
  out = run(model, inputs(io, guidance=False))
  chex.assert_trees_all_close(out, io["out_schnell"], atol=ATOL, rtol=0)


def test_bfl_single_file_matches_diffusers(io):
  path = fixture_path("flux_transformer") / "dev_bfl.safetensors"
  cfg = md_flux.config_from_bfl(
    {k: v.shape for k, v in md_core.open_checkpoint(path).items()}, axes_dims_rope=(2, 2, 4)
  )
  assert cfg == tiny_config()
  model = md_flux.load_flux(path, config=cfg)
  chex.assert_trees_all_close(run(model, inputs(io)), io["out_dev"], atol=ATOL, rtol=0)


def test_bfl_prefixed_names(tmp_path, dev):
  """Files saved from the reference trainer carry `model.diffusion_model.` in front of every name."""
  ckpt = md_core.open_checkpoint(fixture_path("flux_transformer") / "dev_bfl.safetensors")
  md_core.save_safetensors(
    tmp_path / "prefixed.safetensors", {f"model.diffusion_model.{k}": ckpt[k] for k in ckpt}
  )
  model = md_flux.load_flux(tmp_path / "prefixed.safetensors", config=tiny_config())
  chex.assert_trees_all_equal(nnx.state(model), nnx.state(dev))


def test_block_kv_and_batched_ids(io, dev):
  kw = inputs(io)
  out, kv = jax.jit(lambda kw: dev(**kw, return_kv=True))(kw)
  cfg = dev.cfg
  s = io["txt_ids"].shape[0] + io["img_ids"].shape[0]
  b = io["hidden_states"].shape[0]
  shape = (b, s, cfg.num_attention_heads, cfg.attention_head_dim)
  chex.assert_shape([kv.double_k, kv.double_v], (cfg.num_layers, *shape))
  chex.assert_shape([kv.single_k, kv.single_v], (cfg.num_single_layers, *shape))
  chex.assert_trees_all_close(out, io["out_dev"], atol=ATOL, rtol=0)
  # Per-sample ids [B, S, 3] give the same result as shared [S, 3] ones.
  kw["img_ids"] = jnp.broadcast_to(kw["img_ids"][None], (b,) + kw["img_ids"].shape)
  chex.assert_trees_all_close(run(dev, kw), io["out_dev"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("implementation", ["ulysses", "ring"])
def test_context_parallel_matches_one_device(io, implementation):
  mesh = mds.make_mesh(
    mds.MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_context_parallelism=4)
  )
  model = md_flux.load_flux(
    fixture_path("flux_transformer") / "dev",
    mesh=mesh,
    attention=mda.AttentionConfig(implementation=implementation),
  )
  assert model.cfg.attention.implementation == implementation
  # Stacked q kernels: (layers, embed, heads) → layers whole, embed over fsdp (heads: no tensor axis).
  spec = model.transformer_blocks.attn.to_q.kernel[...].sharding.spec
  assert tuple(spec) == (None, "fsdp", None), spec
  kw = inputs(io)
  with jax.sharding.set_mesh(mesh):
    out = run(model, kw)
  assert out.sharding.mesh.shape == mesh.shape
  chex.assert_trees_all_close(out, io["out_dev"], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_remat_keeps_gradients(io):
  """Recomputing blocks in the backward pass (every `md_core.REMAT_POLICIES`) changes no gradient."""
  kw = inputs(io)
  grads = []
  for policy in md_core.REMAT_POLICIES:
    model = md_flux.load_flux(fixture_path("flux_transformer") / "dev", remat=policy)
    graphdef, state = nnx.split(model)

    def loss(s, kw, graphdef=graphdef):
      return jnp.mean(jnp.square(nnx.merge(graphdef, s)(**kw)))

    grads.append(jax.jit(jax.grad(loss))(state, kw))
  chex.assert_tree_all_finite(grads[0])
  for g in grads[1:]:
    chex.assert_trees_all_close(g, grads[0], atol=1e-6, rtol=0)


def test_input_errors(io, dev):
  kw = inputs(io)
  cases = [
    (dict(hidden_states=kw["hidden_states"][..., :8]), r"hidden_states must be \[B, S, 16\]"),
    (dict(img_ids=kw["img_ids"][:-1]), r"img_ids must be \[S, 3\] or \[B, S, 3\] with S=16"),
    (dict(txt_ids=kw["txt_ids"][:, :2]), r"txt_ids must be \[S, 3\] .* with S=8"),
    (dict(pooled_projections=kw["pooled_projections"][:1]), r"pooled_projections must be"),
    (dict(guidance=None), r"guidance-distilled .* pass guidance="),
    (dict(timestep=jnp.zeros(3)), r"timestep must be a scalar or \[B\] = \[2\]"),
  ]
  for change, match in cases:
    with pytest.raises(ValueError, match=match):
      dev(**{**kw, **change})
  schnell = nnx.eval_shape(
    lambda: md_flux.FluxTransformer(
      dataclasses.replace(tiny_config(), guidance_embeds=False), rngs=nnx.Rngs(0)
    )
  )
  with pytest.raises(ValueError, match=r"no guidance embedder .* pass guidance=None"):
    schnell(**kw)


def test_unknown_single_file_layout(tmp_path):
  md_core.save_safetensors(
    tmp_path / "x.safetensors", {"model.layers.0.w": np.zeros(2, np.float32)}
  )
  with pytest.raises(ValueError, match=r"unknown Flux.1 single-file layout: .*model.layers.0.w"):
    md_flux.load_flux(tmp_path / "x.safetensors")
  md_core.save_safetensors(
    tmp_path / "d.safetensors",
    {
      "x_embedder.weight": np.zeros((2, 2), np.float32),
      "transformer_blocks.0.a.weight": np.zeros(1),
    },
  )
  with pytest.raises(ValueError, match=r"diffusers' layout carries no config"):
    md_flux.load_flux(tmp_path / "d.safetensors")


def test_pipeline_folder_and_mismatched_config(tmp_path):
  src = fixture_path("flux_transformer") / "dev"
  (tmp_path / "transformer").mkdir()
  (tmp_path / "model_index.json").write_text("{}")
  for f in src.iterdir():
    (tmp_path / "transformer" / f.name).write_bytes(f.read_bytes())
  model = md_flux.load_flux(tmp_path)
  ckpt = md_core.open_checkpoint(src)
  np.testing.assert_array_equal(model.proj_out.kernel[...], np.asarray(ckpt["proj_out.weight"]).T)
  np.testing.assert_array_equal(
    model.transformer_blocks.attn.to_q.kernel[...][1],
    np.asarray(ckpt["transformer_blocks.1.attn.to_q.weight"]).T,
  )
  schnell = dataclasses.replace(tiny_config(), guidance_embeds=False)
  with pytest.raises(
    md_core.WeightLoadError,
    match=r"(?s)4 problem.*'time_text_embed.guidance_embedder.linear_1.weight' maps to "
    r"'time_text_embed/guidance_embedder/linear_1/kernel', which the model does not have",
  ):
    md_flux.load_flux(src, config=schnell)


def test_key_maps():
  T = md_core.Target
  assert md_flux.convert_key("transformer_blocks.3.attn.to_out.0.weight") == T(
    ("transformer_blocks", "attn", "to_out", "kernel"), "linear", layer=3
  )
  assert md_flux.convert_key("single_transformer_blocks.0.attn.norm_k.weight") == T(
    ("single_transformer_blocks", "attn", "norm_k", "scale"), layer=0
  )
  assert md_flux.convert_key("norm_out.linear.bias") == [
    T(("norm_out", "scale", "bias"), split=(0, 2, 0)),
    T(("norm_out", "shift", "bias"), split=(1, 2, 0)),
  ]
  assert md_flux.convert_key("single_transformer_blocks.0.attn.norm_added_q.weight") is None
  assert md_flux.convert_key("pos_embed.freqs") is None
  assert md_flux.convert_key_bfl("final_layer.adaLN_modulation.1.weight") == [
    T(("norm_out", "shift", "kernel"), "linear", split=(0, 2, 0)),
    T(("norm_out", "scale", "kernel"), "linear", split=(1, 2, 0)),
  ]
  assert md_flux.convert_key_bfl("double_blocks.1.txt_attn.qkv.bias")[2] == T(
    ("transformer_blocks", "attn", "add_v_proj", "bias"), split=(2, 3, 0), layer=1
  )
  assert md_flux.convert_key_bfl("single_blocks.2.linear1.weight[mlp]") == T(
    ("single_transformer_blocks", "proj_mlp", "kernel"), "linear", layer=2
  )
  assert md_flux.convert_key_bfl("single_blocks.2.linear1.weight") is None  # only its two views
  names = md_flux.bfl_virtual_names(
    {"model.diffusion_model.single_blocks.0.linear1.weight": (7 * 8, 8), "img_in.bias": (8,)}, 8
  )
  assert names["single_blocks.0.linear1.weight[qkv]"][2] == (24, 8)
  assert names["single_blocks.0.linear1.weight[mlp]"][2] == (32, 8)
  assert names["img_in.bias"][0] == "img_in.bias"


def test_config():
  cfg = tiny_config()
  assert (cfg.num_attention_heads, cfg.attention_head_dim, cfg.guidance_embeds) == (4, 8, True)
  assert cfg.axes_dims_rope == (2, 2, 4)
  with pytest.raises(ValueError, match=r"unsupported config keys \['qk_norm'\]"):
    md_flux.FluxConfig.from_dict({"qk_norm": "rms_norm"})
  with pytest.raises(ValueError, match=r"patch_size=2 is not supported"):
    md_flux.FluxConfig.from_dict({"patch_size": 2})
  with pytest.raises(ValueError, match=r"axes_dims_rope=\(16, 56, 50\) must sum to"):
    md_flux.FluxConfig(axes_dims_rope=(16, 56, 50))
  with pytest.raises(ValueError, match=r"_class_name='Flux2Transformer2DModel'"):
    md_flux.FluxConfig.from_dict({"_class_name": "Flux2Transformer2DModel"})
  assert md_flux.FLUX_VARIANTS["dev"].inner_dim == 3072


def _manifest(name):
  data = load_manifest(name)
  return {k: v["shape"] for k, v in data["tensors"].items()}, data


@pytest.mark.parametrize(
  "name, variant",
  [("flux1_dev_transformer", "dev"), ("flux1_schnell_transformer", "schnell")],
)
def test_manifest_diffusers_layout(name, variant):
  shapes, _ = _manifest(name)
  cfg = md_flux.FLUX_VARIANTS[variant]
  factory = lambda: md_flux.FluxTransformer(cfg, rngs=nnx.Rngs(0))  # noqa: E731
  assert md_core.coverage(shapes, factory, md_flux.convert_key) == []


def test_manifest_bfl_single_file():
  shapes, data = _manifest("flux1_dev_bfl")
  assert data["num_tensors"] == 780
  cfg = md_flux.config_from_bfl(shapes)
  assert cfg == md_flux.FLUX_VARIANTS["dev"]
  names = md_flux.bfl_virtual_names(shapes, cfg.inner_dim)
  virtual = {k: shape for k, (_, _, shape) in names.items()}
  factory = lambda: md_flux.FluxTransformer(cfg, rngs=nnx.Rngs(0))  # noqa: E731
  assert md_core.coverage(virtual, factory, md_flux.convert_key_bfl) == []
  # schnell's file is the same without guidance_in.
  real = {k: v for k, v in shapes.items() if not k.startswith("guidance_in.")}
  assert len(real) == 776
  cfg = md_flux.config_from_bfl(real)
  assert cfg == md_flux.FLUX_VARIANTS["schnell"]
  schnell = {k: v for k, v in virtual.items() if not k.startswith("guidance_in.")}
  factory = lambda: md_flux.FluxTransformer(cfg, rngs=nnx.Rngs(0))  # noqa: E731
  assert md_core.coverage(schnell, factory, md_flux.convert_key_bfl) == []
