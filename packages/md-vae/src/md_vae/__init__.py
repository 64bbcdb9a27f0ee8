"""md-vae: autoencoders for md (SD/SDXL/Flux KL, Flux.2, Wan 2.1/2.2, LTX, LTX-2) with tiling."""

# FLUX.2 VAE (32 latent channels, 2x2 patches, batch-norm latent statistics).
from md_vae._flux2 import (
  FLUX2_VAE_VARIANTS,
  AutoencoderKLFlux2,
  AutoencoderKLFlux2Config,
  patchify_latents,
  unpatchify_latents,
)
from md_vae._flux2_weights import FLUX2_VAE_ALLOW_UNUSED, load_vae_flux2, vae_flux2_convert_key

# AutoencoderKL (SD 1.x/2.x, SDXL, Flux).
from md_vae._kl import (
  KL_VARIANTS,
  AutoencoderKL,
  AutoencoderKLConfig,
  DiagonalGaussian,
  nchw_to_nhwc,
  nhwc_to_nchw,
)
from md_vae._kl_weights import load_vae_kl, vae_kl_convert_key

# LTX-2 audio VAE (causal mel-spectrogram latents) and vocoders (mel -> waveform, 2.3 with bandwidth extension).
from md_vae._ltx2_audio import (
  LTX2_AUDIO_VAE_VARIANTS,
  LTX2AudioVAE,
  LTX2AudioVAEConfig,
  pack_audio_latents,
  unpack_audio_latents,
)
from md_vae._ltx2_audio_weights import load_vae_ltx2_audio, vae_ltx2_audio_convert_key

# LTX-2 video VAE (the LTX-Video blocks, reflect padding, runtime causality, tiled encode / decode).
from md_vae._ltx2_vae import LTX2_VAE_VARIANTS, LTX2Tiling, LTX2VideoVAE, LTX2VideoVAEConfig
from md_vae._ltx2_vae_weights import (
  VAE_LTX2_ORIGINAL_ALLOW_UNUSED,
  load_vae_ltx2,
  load_vae_ltx2_original,
  vae_ltx2_convert_key,
  vae_ltx2_original_keymap,
  vae_ltx2_original_to_diffusers,
)
from md_vae._ltx2_vocoder import (
  LTX2_VOCODER_VARIANTS,
  LTX2Vocoder,
  LTX2VocoderBWEConfig,
  LTX2VocoderConfig,
  LTX2VocoderWithBWE,
  vocoder_config_from_json,
)
from md_vae._ltx2_vocoder_weights import load_vocoder_ltx2, vocoder_ltx2_convert_key

# LTX-Video causal video VAE (0.9.0, 0.9.1 timestep-conditioned decoder, 0.9.5+ encoder).
from md_vae._ltx_vae import LTX_VAE_VARIANTS, LTXLatentDist, LTXVideoVAE, LTXVideoVAEConfig
from md_vae._ltx_vae_weights import (
  VAE_LTX_ORIGINAL_ALLOW_UNUSED,
  load_vae_ltx,
  load_vae_ltx_original,
  vae_ltx_convert_key,
  vae_ltx_original_keymap,
  vae_ltx_original_to_diffusers,
  vae_ltx_original_version,
)

# Wan 2.1 / 2.2 causal video VAE.
from md_vae._wan import WanLatentDist, WanVAE, inflate_wan_vae, video_to_uint8
from md_vae._wan_config import WAN_VARIANTS, WanVAEConfig
from md_vae._wan_weights import (
  load_vae_wan,
  load_vae_wan_original,
  vae_wan_convert_key,
  wan_original_keymap,
  wan_original_to_diffusers_name,
)

__all__ = [
  # LTX-2 audio VAE and vocoders
  "LTX2_AUDIO_VAE_VARIANTS",
  "LTX2_VOCODER_VARIANTS",
  "LTX2AudioVAE",
  "LTX2AudioVAEConfig",
  "LTX2Vocoder",
  "LTX2VocoderBWEConfig",
  "LTX2VocoderConfig",
  "LTX2VocoderWithBWE",
  "load_vae_ltx2_audio",
  "load_vocoder_ltx2",
  "pack_audio_latents",
  "unpack_audio_latents",
  "vae_ltx2_audio_convert_key",
  "vocoder_config_from_json",
  "vocoder_ltx2_convert_key",
  # AutoencoderKL
  "KL_VARIANTS",
  "AutoencoderKL",
  "AutoencoderKLConfig",
  "DiagonalGaussian",
  "load_vae_kl",
  "nchw_to_nhwc",
  "nhwc_to_nchw",
  "vae_kl_convert_key",
  # Wan VAE
  "WAN_VARIANTS",
  "WanLatentDist",
  "WanVAE",
  "WanVAEConfig",
  "inflate_wan_vae",
  "load_vae_wan",
  "load_vae_wan_original",
  "vae_wan_convert_key",
  "video_to_uint8",
  "wan_original_keymap",
  "wan_original_to_diffusers_name",
  # LTX-Video VAE
  "LTX_VAE_VARIANTS",
  "LTXLatentDist",
  "LTXVideoVAE",
  "LTXVideoVAEConfig",
  "load_vae_ltx",
  "vae_ltx_convert_key",
  "VAE_LTX_ORIGINAL_ALLOW_UNUSED",
  "load_vae_ltx_original",
  "vae_ltx_original_keymap",
  "vae_ltx_original_to_diffusers",
  "vae_ltx_original_version",
  # LTX-2 video VAE
  "LTX2_VAE_VARIANTS",
  "LTX2Tiling",
  "LTX2VideoVAE",
  "LTX2VideoVAEConfig",
  "VAE_LTX2_ORIGINAL_ALLOW_UNUSED",
  "load_vae_ltx2",
  "load_vae_ltx2_original",
  "vae_ltx2_convert_key",
  "vae_ltx2_original_keymap",
  "vae_ltx2_original_to_diffusers",
  # FLUX.2 VAE
  "FLUX2_VAE_ALLOW_UNUSED",
  "FLUX2_VAE_VARIANTS",
  "AutoencoderKLFlux2",
  "AutoencoderKLFlux2Config",
  "load_vae_flux2",
  "patchify_latents",
  "unpatchify_latents",
  "vae_flux2_convert_key",
]
