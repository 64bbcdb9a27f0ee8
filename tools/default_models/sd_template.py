"""The default image model's starting folder: a tiny Stable Diffusion 1.5 diffusers pipeline at random init.

    tools/.venv/bin/python tools/default_models/sd_template.py OUT_DIR

Writes a `StableDiffusionPipeline` folder (model_index.json, unet/, vae/, text_encoder/, tokenizer/,
scheduler/; no safety checker) with the sizes of models/shapes-sd (see its README). md's train app then trains
the VAE and the UNet and replaces their safetensors (`md_train.shapes_sd`); the CLIP text encoder stays as
made here (frozen; its residual branches start small, see BRANCH_SCALE). The tokenizer is a CLIP BPE
vocabulary (vocab.json + merges.txt) whose merges spell every word of the shapes grammar, so each word is one
token. No downloads.
"""

import json
import pathlib
import sys

import torch
import transformers as tf
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

# The caption grammar's words (md_data.vocabulary(), aliases too, without md_data so this runs in the
# reference venv).
WORDS = (
  "a", "an", "red", "green", "blue", "yellow", "purple", "circle", "square", "triangle", "diamond",
  "star", "in", "at", "on", "the", "top", "bottom", "left", "right", "center", "moving", "up", "down",
  "black", "white", "gray", "background", "grey", "centre", "middle",
)  # fmt: skip
MAX_LENGTH = 16  # tokens per prompt: the longest caption is 11 words + start and end

TEXT_DIM = 32
CLIP = dict(
  hidden_size=TEXT_DIM,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  max_position_embeddings=MAX_LENGTH,
  hidden_act="quick_gelu",
)
LATENT = 4
# Two halvings: 64x64 images -> 16x16 latents (a shape of 12-17 pixels spans 3-4 latents).
VAE = dict(
  in_channels=3,
  out_channels=3,
  down_block_types=("DownEncoderBlock2D",) * 3,
  up_block_types=("UpDecoderBlock2D",) * 3,
  block_out_channels=(16, 32, 64),
  layers_per_block=1,
  latent_channels=LATENT,
  norm_num_groups=8,
  sample_size=64,
  scaling_factor=1.0,  # replaced by the measured value when the sd-vae stage exports
)
UNET = dict(
  sample_size=16,
  in_channels=LATENT,
  out_channels=LATENT,
  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
  block_out_channels=(64, 128),  # (32, 64) until 2026-12-06: 0.79 M parameters, shape 76%
  layers_per_block=1,
  norm_num_groups=8,
  cross_attention_dim=TEXT_DIM,
  attention_head_dim=4,  # heads per attention (diffusers' SD 1.x naming)
)
# SD 1.5's scheduler_config.json (DDIM, scaled-linear betas, epsilon).
SCHEDULER = dict(
  num_train_timesteps=1000,
  beta_start=0.00085,
  beta_end=0.012,
  beta_schedule="scaled_linear",
  clip_sample=False,
  set_alpha_to_one=False,
  steps_offset=1,
  prediction_type="epsilon",
)


def _bytes_to_unicode() -> dict[int, str]:
  """CLIP's (GPT-2's) printable stand-in for every byte."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  chars, extra = list(keep), 0
  for b in range(256):
    if b not in keep:
      keep.append(b)
      chars.append(256 + extra)
      extra += 1
  return dict(zip(keep, map(chr, chars)))


def _chain(word: str) -> list[tuple[str, str]]:
  """The merges that spell `word` left to right ("a</w>" is a byte symbol already)."""
  parts = list(word[:-1]) + [word[-1] + "</w>"]
  return [("".join(parts[:i]), parts[i]) for i in range(1, len(parts))]


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
  """CLIP's BPE of one word: merge the lowest-ranked adjacent pair until none is known."""
  parts = list(word[:-1]) + [word[-1] + "</w>"]
  while len(parts) > 1:
    pairs = [(ranks.get(p, len(ranks)), i) for i, p in enumerate(zip(parts, parts[1:]))]
    rank, i = min(pairs)
    if rank == len(ranks):
      break
    parts[i : i + 2] = [parts[i] + parts[i + 1]]
  return parts


def _merges() -> list[tuple[str, str]]:
  """Every word's chain, ordered so BPE spells each word whole: a word split by another word's pair
  ("tr" of "triangle" inside "centre") has its chain moved to the front, until none is split."""
  order = sorted(WORDS, key=len, reverse=True)
  for _ in range(10 * len(WORDS)):
    merges = list(dict.fromkeys(m for w in order for m in _chain(w)))
    ranks = {m: i for i, m in enumerate(merges)}
    split = [w for w in order if len(_bpe(w, ranks)) > 1]
    if not split:
      return merges
    order.remove(split[0])
    order.insert(0, split[0])
  raise RuntimeError(f"no merge order spells every word whole; split: {split}")


def tokenizer_files(folder: pathlib.Path) -> None:
  """vocab.json and merges.txt: every byte (alone and word-final), the merges that spell each grammar word,
  and the two specials last (end-of-text the largest id, as in OpenAI's vocabulary)."""
  symbols = list(_bytes_to_unicode().values())
  vocab = symbols + [s + "</w>" for s in symbols]
  merges = _merges()
  vocab += [a + b for a, b in merges if a + b not in vocab]
  vocab += ["<|startoftext|>", "<|endoftext|>"]
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
  (folder / "merges.txt").write_text(
    "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
  )


# The frozen random text encoder's residual branches (attention and MLP outputs) start this small, so each
# output state is mostly its own word (and position): with CLIP's default init the branches are ~10x the 0.02
# word embeddings and every state is a blend of the words before it, which ties "circle" to the colour
# before it and leaves the held-out colour x shape pairs unseen states.
BRANCH_SCALE = 0.02


def small_branches(text_encoder: tf.CLIPTextModel, scale: float = BRANCH_SCALE) -> None:
  """Scales the output projections of every layer's attention and MLP (their biases start at zero)."""
  with torch.no_grad():
    for layer in text_encoder.encoder.layers:
      layer.self_attn.out_proj.weight.mul_(scale)
      layer.mlp.fc2.weight.mul_(scale)


def main(out: pathlib.Path) -> None:
  torch.manual_seed(0)
  tmp = out / "_tok"
  tokenizer_files(tmp)
  tok = tf.CLIPTokenizer(
    str(tmp / "vocab.json"), str(tmp / "merges.txt"), model_max_length=MAX_LENGTH
  )
  for word in WORDS:
    ids = tok(word, add_special_tokens=False).input_ids
    assert len(ids) == 1, f"{word!r} is {len(ids)} tokens"
  vocab = len(tok)
  eos = tok.convert_tokens_to_ids("<|endoftext|>")
  text = tf.CLIPTextConfig(
    vocab_size=vocab, bos_token_id=vocab - 2, eos_token_id=eos, pad_token_id=eos, **CLIP
  )
  vae = AutoencoderKL(**VAE).eval()
  text_encoder = tf.CLIPTextModel(text).eval()
  pipe = StableDiffusionPipeline(
    vae=vae,
    text_encoder=text_encoder,
    tokenizer=tok,
    unet=UNet2DConditionModel(**UNET).eval(),
    scheduler=DDIMScheduler(**SCHEDULER),
    safety_checker=None,
    feature_extractor=None,
    requires_safety_checker=False,
  )
  small_branches(text_encoder)  # after every module is made, so the others' draws are unchanged
  pipe.save_pretrained(out)
  # Keep the slow-tokenizer files beside tokenizer.json, as the hub's SD tokenizer folders do.
  for f in tmp.iterdir():
    f.replace(out / "tokenizer" / f.name)
  tmp.rmdir()
  words = tok("a red circle in the top left on a black background").input_ids
  print(f"wrote {out}; vocabulary {vocab}; a caption is {len(words)} tokens: {words}")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))
