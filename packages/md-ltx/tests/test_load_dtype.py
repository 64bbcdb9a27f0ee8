"""What a loader's `dtype` means, on real files: None gives the model's own float32 (a bfloat16 file is
upcast, exactly), `"stored"` keeps the file's bfloat16, an explicit dtype casts; float32 files stay float32."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import md_core
import md_ltx
from md_core.testing import fixture_path


def _floating(model):
  leaves = jax.tree.leaves(nnx.state(model))
  return {x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)}


def test_bfloat16_file_with_none_stored_and_explicit_dtype():
  path = fixture_path("ltx_upsampler") / "ltx_video"
  ckpt = md_core.open_checkpoint(path / "latent_upsampler")
  assert {np.dtype(ckpt[k].dtype).name for k in ckpt} == {"bfloat16"}
  upcast = md_ltx.load_latent_upsampler(path)
  stored = md_ltx.load_latent_upsampler(path, dtype="stored")
  half = md_ltx.load_latent_upsampler(path, dtype=jnp.bfloat16)
  assert _floating(upcast) == {jnp.dtype(jnp.float32)}
  assert _floating(stored) == _floating(half) == {jnp.dtype(jnp.bfloat16)}
  # The upcast is exact: the same values as the stored bfloat16 ones.
  for a, b in zip(
    jax.tree.leaves(nnx.state(upcast)), jax.tree.leaves(nnx.state(stored)), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32))


def test_float32_file_stays_float32():
  path = fixture_path("ltx_transformer")
  for dtype in (None, "stored"):
    assert _floating(md_ltx.load_transformer(path, dtype=dtype)) == {jnp.dtype(jnp.float32)}
