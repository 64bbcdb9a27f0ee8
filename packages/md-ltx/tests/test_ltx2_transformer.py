"""LTX-2 transformer against diffusers' outputs (tests/fixtures/ltx2_transformer), the original single file,
the real checkpoint's key manifests, sharding, and input/config/weight errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import md_core
import md_sharding as mds
from md_core.testing import fixture_path, load_arrays, load_manifest, repo_root
from md_ltx._ltx2_config import LTX2_VARIANTS, LTX2Config
from md_ltx._ltx2_transformer import (
  LTX2Transformer,
  ltx2_audio_coords,
  ltx2_rope_frequencies,
  ltx2_video_coords,
)
from md_ltx._ltx2_weights import (
  load_ltx2_transformer,
  ltx2_convert_key,
  ltx2_convert_original_key,
  ltx2_original_config,
  ltx2_original_to_diffusers,
)

T = md_core.Target
TOL = 1e-4
ROOT = fixture_path("ltx2_transformer")
# case → the model folder it runs on
CASES = {
  "t2v": "transformer",
  "i2v": "transformer",
  "stg": "transformer_2.3",
  "isolate": "transformer_2.3",
}
_FLAGS = (
  "coords_given",
  "isolate_modalities",
  "use_cross_timestep",
)  # sorted, as the generator saves them
_OPTIONAL = ("audio_timestep", "sigma", "audio_sigma", "perturbation_mask", "video_keyframes_mask")


@jax.jit(static_argnames=("static",))
def _apply(graphdef, state, arrays, static):
  return nnx.merge(graphdef, state)(**arrays, **dict(static))


def run(model, ref):
  """The forward pass on a fixture case: positions passed in where the reference got them, else built."""
  flags = dict(zip(_FLAGS, (bool(f) for f in ref["flags"])))
  f, h, w, fa = (int(n) for n in ref["grid"])
  names = (
    "hidden_states",
    "audio_hidden_states",
    "encoder_hidden_states",
    "audio_encoder_hidden_states",
    "timestep",
    "encoder_attention_mask",
    "audio_encoder_attention_mask",
  ) + _OPTIONAL
  arrays = {k: jnp.asarray(ref[k]) for k in names if k in ref}
  static = dict(
    isolate_modalities=flags["isolate_modalities"], use_cross_timestep=flags["use_cross_timestep"]
  )
  if flags["coords_given"]:
    arrays.update(video_coords=jnp.asarray(ref["video_coords"]), audio_coords=ref["audio_coords"])
  else:
    static.update(num_frames=f, height=h, width=w, fps=float(ref["fps"]), audio_num_frames=fa)
  if "stg_blocks" in ref:
    static["spatio_temporal_guidance_blocks"] = tuple(int(i) for i in ref["stg_blocks"])
  graphdef, state = nnx.split(model)
  return _apply(graphdef, state, arrays, tuple(sorted(static.items())))


@pytest.fixture(scope="module")
def models():
  return {sub: load_ltx2_transformer(ROOT, subfolder=sub) for sub in set(CASES.values())}


# isolate_modalities compiles a fourth program; it runs with the slow tests.
PARITY = [pytest.param(c, marks=pytest.mark.slow) if c == "isolate" else c for c in sorted(CASES)]


@pytest.mark.parametrize("case", PARITY)
def test_matches_diffusers(models, case):
  ref = load_arrays(ROOT / f"{case}.npz")
  video, audio = run(models[CASES[case]], ref)
  chex.assert_shape(video, ref["sample"].shape)
  chex.assert_shape(audio, ref["audio_sample"].shape)
  chex.assert_trees_all_close(video, ref["sample"], atol=TOL, rtol=0)
  chex.assert_trees_all_close(audio, ref["audio_sample"], atol=TOL, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_positions_match_the_reference(models, case):
  """The coordinates md builds from the grid equal the ones diffusers' rotary module prepares."""
  ref = load_arrays(ROOT / f"{case}.npz")
  cfg = models[CASES[case]].cfg
  f, h, w, fa = (int(n) for n in ref["grid"])
  got = ltx2_video_coords(cfg, f, h, w, float(ref["fps"]))
  np.testing.assert_array_equal(
    np.broadcast_to(got, ref["video_coords"].shape), ref["video_coords"]
  )
  got = ltx2_audio_coords(cfg, fa)
  np.testing.assert_array_equal(
    np.broadcast_to(got, ref["audio_coords"].shape), ref["audio_coords"]
  )


def test_configs_read_from_the_fixture_and_the_real_file(models):
  assert models["transformer"].cfg == LTX2_VARIANTS["tiny"]
  cfg = LTX2Config.from_json(repo_root() / "tools/configs/ltx/ltx2_transformer.json")
  assert cfg == LTX2_VARIANTS["2.0"]
  assert (cfg.dim, cfg.audio_dim, cfg.num_layers, cfg.rope_type) == (4096, 2048, 48, "split")
  late = models["transformer_2.3"]
  assert late.caption_projection is None and late.prompt_adaln is not None
  assert late.blocks.attn1.to_gate_logits.kernel[...].shape == (2, 32, 2)
  assert late.blocks.ff.proj_in.bias is None and late.blocks.audio_ff.proj_in.bias is not None


def test_original_single_file_gives_the_same_weights(models):
  single = load_ltx2_transformer(
    ROOT / "ltx-2-tiny.safetensors", num_attention_heads=4, audio_num_attention_heads=2
  )
  assert single.cfg == models["transformer"].cfg
  chex.assert_trees_all_equal(nnx.state(single), nnx.state(models["transformer"]))


def test_convert_key_alone():
  ck = ltx2_convert_key
  assert ck("transformer_blocks.3.audio_to_video_attn.to_q.weight") == T(
    ("blocks", "audio_to_video_attn", "to_q", "kernel"), "linear", layer=3
  )
  assert ck("transformer_blocks.0.video_to_audio_attn.to_out.0.bias") == T(
    ("blocks", "video_to_audio_attn", "to_out", "bias"), layer=0
  )
  assert ck("transformer_blocks.1.audio_attn1.norm_k.weight") == T(
    ("blocks", "audio_attn1", "norm_k", "scale"), layer=1
  )
  assert ck("transformer_blocks.2.audio_ff.net.0.proj.weight") == T(
    ("blocks", "audio_ff", "proj_in", "kernel"), "linear", layer=2
  )
  assert ck("transformer_blocks.5.video_a2v_cross_attn_scale_shift_table") == T(
    ("blocks", "video_a2v_cross_attn_scale_shift_table"), layer=5
  )
  assert ck("av_cross_attn_audio_v2a_gate.emb.timestep_embedder.linear_2.weight") == T(
    ("av_cross_attn_audio_v2a_gate", "timestep_embedder", "linear_2", "kernel"), "linear"
  )
  assert ck("audio_caption_projection.linear_1.bias") == T(
    ("audio_caption_projection", "proj_in", "bias")
  )
  assert ck("audio_scale_shift_table") == T(("audio_scale_shift_table",))
  assert ck("transformer_blocks.0.attn1.to_out.1.weight") is None
  assert ck("vae.decoder.conv_in.conv.bias") is None


def test_original_names_alone():
  o = ltx2_original_to_diffusers
  assert o("model.diffusion_model.audio_patchify_proj.bias") == "audio_proj_in.bias"
  assert o("model.diffusion_model.adaln_single.linear.weight") == "time_embed.linear.weight"
  assert o("model.diffusion_model.audio_adaln_single.emb.timestep_embedder.linear_1.bias") == (
    "audio_time_embed.emb.timestep_embedder.linear_1.bias"
  )
  assert o("model.diffusion_model.av_ca_v2a_gate_adaln_single.linear.weight") == (
    "av_cross_attn_audio_v2a_gate.linear.weight"
  )
  assert o("model.diffusion_model.transformer_blocks.4.scale_shift_table_a2v_ca_audio") == (
    "transformer_blocks.4.audio_a2v_cross_attn_scale_shift_table"
  )
  assert o("model.diffusion_model.video_embeddings_connector.learnable_registers") is None
  assert o("vocoder.conv_pre.weight") is None
  assert ltx2_convert_original_key(
    "model.diffusion_model.transformer_blocks.4.attn2.k_norm.weight"
  ) == T(("blocks", "attn2", "norm_k", "scale"), layer=4)


def _manifest(name):
  data = load_manifest(name)
  return {k: v["shape"] for k, v in data["tensors"].items()}


def test_real_checkpoint_is_covered():
  """Every tensor of the real LTX-2 transformer (diffusers layout and original single file) is mapped with
  the right shape, and the single file's shapes give back the real config."""
  cfg = LTX2_VARIANTS["2.0"]
  model = nnx.eval_shape(lambda: LTX2Transformer(cfg, rngs=nnx.Rngs(0)))
  assert md_core.coverage(_manifest("ltx2_transformer"), model, ltx2_convert_key) == []
  original = _manifest("ltx2_transformer_original")
  assert md_core.coverage(original, model, ltx2_convert_original_key) == []

  class Shapes(dict):
    def shape(self, key):
      return tuple(self[key])

  assert ltx2_original_config(Shapes(original)) == cfg


def test_real_ltx23_checkpoint_is_covered():
  """LTX-2.3 (gates, modulated text cross-attention with its sigma adaLN-single, no caption projections)."""
  cfg = LTX2Config.from_json(repo_root() / "tools/configs/ltx/ltx2_transformer_2.3.json")
  assert cfg == LTX2_VARIANTS["2.3"]
  model = nnx.eval_shape(lambda: LTX2Transformer(cfg, rngs=nnx.Rngs(0)))
  assert md_core.coverage(_manifest("ltx2_transformer_2.3"), model, ltx2_convert_key) == []


@pytest.mark.slow
def test_bf16_keeps_modulation_tables_f32():
  """bf16 weights and activations, float32 modulation tables; the result stays near the f32 reference."""
  model = load_ltx2_transformer(ROOT, subfolder="transformer_2.3", dtype=jnp.bfloat16)
  assert model.blocks.attn1.to_q.kernel[...].dtype == jnp.bfloat16
  for table in (
    model.scale_shift_table,
    model.blocks.audio_scale_shift_table,
    model.blocks.prompt_scale_shift_table,
    model.blocks.video_a2v_cross_attn_scale_shift_table,
  ):
    assert table[...].dtype == jnp.float32
  ref = load_arrays(ROOT / "stg.npz")
  video, audio = run(model, ref)
  assert video.dtype == audio.dtype == jnp.bfloat16
  for got, want in ((video, ref["sample"]), (audio, ref["audio_sample"])):
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
    assert err < 0.1 * float(np.max(np.abs(want))), err


def test_sharded_matches_single_device(models):
  """Loaded onto a (data 1, fsdp 2, context 2, tensor 2) mesh with ring attention: weights sharded by
  their logical axes (layer axis whole), tokens over `context`; the result equals the single-device one."""
  mesh = mds.make_mesh(
    mds.MeshConfig(ici_fsdp_parallelism=2, ici_context_parallelism=2, ici_tensor_parallelism=2)
  )
  assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "context": 2, "tensor": 2}
  sharded = load_ltx2_transformer(ROOT, subfolder="transformer_2.3", mesh=mesh, attention="ring")
  spec = sharded.blocks.audio_to_video_attn.to_q.kernel[...].sharding.spec
  assert tuple(spec) == (None, "fsdp", "tensor")
  assert tuple(sharded.blocks.audio_ff.proj_out.kernel[...].sharding.spec) == (
    None,
    "tensor",
    "fsdp",
  )
  ref = load_arrays(ROOT / "stg.npz")
  want = run(models["transformer_2.3"], ref)
  with jax.set_mesh(mesh):
    got = run(sharded, ref)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=0)


def _trace(model, arrays, **static):
  graphdef, state = nnx.split(model)
  shapes = {
    k: jax.ShapeDtypeStruct(np.shape(v), jnp.float32) for k, v in arrays.items() if v is not None
  }
  return jax.eval_shape(lambda st, a: nnx.merge(graphdef, st)(**a, **static), state, shapes)


def test_input_errors():
  cfg = LTX2_VARIANTS["tiny"]
  model = nnx.eval_shape(lambda: LTX2Transformer(cfg, rngs=nnx.Rngs(0)))
  ok = dict(
    hidden_states=np.zeros((1, 12, 8)),
    audio_hidden_states=np.zeros((1, 4, 6)),
    encoder_hidden_states=np.zeros((1, 5, 20)),
    audio_encoder_hidden_states=np.zeros((1, 5, 20)),
    timestep=np.zeros((1,)),
  )
  grid = dict(num_frames=2, height=2, width=3, audio_num_frames=4)
  video, audio = _trace(model, ok, **grid)
  assert (video.shape, audio.shape) == ((1, 12, 8), (1, 4, 6))

  def fails(match, changes=None, **static):
    with pytest.raises(ValueError, match=match):
      _trace(model, {**ok, **(changes or {})}, **{**grid, **static})

  fails(r"\[B, S_v, in_channels=8\], got \(1, 12, 128\)", {"hidden_states": np.zeros((1, 12, 128))})
  fails(r"audio_in_channels=6\], got \(1, 4, 8\)", {"audio_hidden_states": np.zeros((1, 4, 8))})
  fails(
    r"encoder_hidden_states must be \[B=1, S_text, 20\]",
    {"encoder_hidden_states": np.zeros((1, 5, 32))},
  )
  fails(r"video_coords must be \[B=1, 3, S=12, 2\].*got \(1, 3, 18, 2\)", num_frames=3)
  fails(r"audio_coords must be \[B=1, 1, S=4, 2\]", audio_num_frames=5)
  fails(
    r"timestep must be \[B\]=\(1,\) or per token \[B, S\]=\(1, 12\)", {"timestep": np.zeros((1, 5))}
  )
  fails(
    r"encoder_attention_mask must be \[B, S_text\]=\(1, 5\)",
    {"encoder_attention_mask": np.zeros((1, 6))},
  )
  fails("sigma is required with use_cross_timestep", use_cross_timestep=True)
  fails("the model has 2 blocks", spatio_temporal_guidance_blocks=(2,))
  fails("pass audio_coords or the static audio_num_frames", audio_num_frames=None)
  fails(r"num_frames=0 must be a positive int", num_frames=0)


def test_config_errors():
  with pytest.raises(ValueError, match=r"keys \['use_magic'\] are not supported"):
    LTX2Config.from_dict({"use_magic": True})
  with pytest.raises(ValueError, match="LTXVideoTransformer3DModel, read by LTXConfig"):
    LTX2Config.from_dict({"_class_name": "LTXVideoTransformer3DModel"})
  with pytest.raises(ValueError, match="audio_cross_attention_dim=1024 must equal the audio width"):
    LTX2Config(audio_cross_attention_dim=1024)
  with pytest.raises(ValueError, match="cross_attention_dim=2048 must equal the video width"):
    LTX2Config(cross_attention_dim=2048)
  with pytest.raises(ValueError, match="rope_type='spiral'"):
    LTX2Config(rope_type="spiral")
  with pytest.raises(ValueError, match="qk_norm='rms_norm'"):
    LTX2Config(qk_norm="rms_norm")
  with pytest.raises(ValueError, match=r"split rotary embedding: half the audio<->video width 24"):
    LTX2Config(
      num_attention_heads=5, attention_head_dim=8, cross_attention_dim=40,
      audio_num_attention_heads=2, audio_attention_head_dim=12, audio_cross_attention_dim=24,
      rope_type="split",
    )  # fmt: skip


def test_load_errors_name_the_tensor(tmp_path):
  ckpt = md_core.open_checkpoint(ROOT / "transformer")
  tensors = {k: np.asarray(ckpt[k]) for k in ckpt}
  tensors["transformer_blocks.0.audio_to_video_attn.to_k.weight"] = np.zeros((24, 32), np.float32)
  del tensors["audio_proj_out.bias"]
  tensors["transformer_blocks.0.attn3.to_q.weight"] = np.zeros((4, 4), np.float32)
  folder = tmp_path / "transformer"
  folder.mkdir()
  md_core.save_safetensors(folder / "diffusion_pytorch_model.safetensors", tensors)
  (folder / "config.json").write_text((ROOT / "transformer" / "config.json").read_text())
  with pytest.raises(md_core.WeightLoadError) as e:
    load_ltx2_transformer(folder, subfolder=None)
  msg = str(e.value)
  assert "'transformer_blocks.0.audio_to_video_attn.to_k.weight' has shape (24, 32)" in msg
  assert "'audio_proj_out/bias' (6,) has no tensor" in msg
  assert "transformer_blocks.0.attn3.to_q.weight" in msg


@pytest.mark.slow
def test_static_prompt_tables_equal_zero_sigma_modulation():
  """`use_prompt_adaln_single=False` (KV-cacheable text attention) modulates the text states by the per-block
  tables alone: the same as the sigma-dependent form with a zero sigma modulation."""
  from md_ltx._ltx2_transformer import LTX2Block, LTX2Rope, _Inputs

  cfg = LTX2Config(
    **{**LTX2_VARIANTS["tiny"].__dict__, "cross_attn_mod": True, "use_prompt_embeddings": False},
  )
  block = LTX2Block(cfg, rngs=nnx.Rngs(3))
  keys = iter(jax.random.split(jax.random.key(0), 16))

  def rnd(*shape):
    return jax.random.normal(next(keys), shape, jnp.float32)

  def rope(n, heads, width):
    angles = rnd(1, n, heads, width // (2 * heads))
    return LTX2Rope(jnp.cos(angles), jnp.sin(angles))

  b, s, s_a = 2, 6, 4
  ins = _Inputs(
    rnd(b, 5, 32), rnd(b, 5, 24), None, None, rnd(b, 1, 9, 32), rnd(b, 1, 6, 24), rnd(b, 1, 4, 32),
    rnd(b, 1, 4, 24), rnd(b, 1, 1, 32), rnd(b, 1, 1, 24), None, None, rope(s, 4, 32),
    rope(s_a, 2, 24), rope(s, 4, 24), rope(s_a, 2, 24), None,
  )  # fmt: skip
  v, a = rnd(b, s, 32), rnd(b, s_a, 24)
  graphdef, state = nnx.split(block)
  apply = jax.jit(lambda st, ins: nnx.merge(graphdef, st)(v, a, ins, cross_modal=True))
  static = apply(state, ins)
  zeros = ins._replace(
    prompt_temb=jnp.zeros((b, 1, 2, 32)), audio_prompt_temb=jnp.zeros((b, 1, 2, 24))
  )
  chex.assert_trees_all_close(static, apply(state, zeros), atol=1e-6, rtol=0)
  shifted = zeros._replace(prompt_temb=jnp.ones((b, 1, 2, 32)))
  assert float(jnp.max(jnp.abs(apply(state, shifted)[0] - static[0]))) > 1e-3


def test_rope_frequencies_one_per_axis():
  """A single frequency per position axis is theta**0 * pi / 2 (torch's one-point linspace is [0])."""
  for double in (True, False):
    cfg = LTX2Config(rope_double_precision=double)
    freqs = ltx2_rope_frequencies(cfg, 6, 3)
    assert freqs.dtype == np.float32
    np.testing.assert_array_equal(freqs, np.array([np.pi / 2], np.float32))
