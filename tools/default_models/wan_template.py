"""The default video model's starting folder: a tiny Wan 2.1 T2V diffusers pipeline at random init.

    tools/.venv/bin/python tools/default_models/wan_template.py OUT_DIR

Writes a `WanPipeline` folder (model_index.json, transformer/, vae/, text_encoder/, tokenizer/, scheduler/) with
the sizes of models/shapes-wan (see its README). md's train app then trains the VAE and the transformer and
replaces their safetensors (`md_train.shapes_models`); the UMT5 text encoder stays as made here (frozen). The
tokenizer is a sentencepiece Unigram model trained on the shapes captions (md_data's vocabulary), so every word
of the grammar is one token. No downloads.
"""

import io
import itertools
import pathlib
import sys

import sentencepiece as spm
import torch
import transformers as tf
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

# The caption grammar's words (md_data.vocabulary(), without md_data so this runs in the reference venv).
COLOURS = ("red", "green", "blue", "yellow", "purple")
SHAPES = ("circle", "square", "triangle", "diamond", "star")
BACKGROUNDS = ("black", "white", "gray")
DIRECTIONS = ("left", "right", "up", "down")
POSITIONS = (
  "in the top left", "at the top", "in the top right", "on the left", "in the center",
  "on the right", "in the bottom left", "at the bottom", "in the bottom right",
)  # fmt: skip

TEXT_DIM = 32
UMT5 = dict(
  vocab_size=64,
  d_model=TEXT_DIM,
  d_kv=8,
  d_ff=64,
  num_layers=2,
  num_heads=4,
  relative_attention_num_buckets=8,
  relative_attention_max_distance=16,
  dropout_rate=0.0,
  feed_forward_proj="gated-gelu",
)
Z_DIM = 8
# 4x space, 4x time (64x64x9 frames -> 16x16x3 latents): at 8x a 12-17 px shape falls on 2x2 latent pixels.
VAE = dict(
  base_dim=16,
  z_dim=Z_DIM,
  dim_mult=[1, 2, 4],
  num_res_blocks=1,
  temperal_downsample=[True, True],
  scale_factor_spatial=4,
)
TRANSFORMER = dict(
  patch_size=(1, 2, 2),
  num_attention_heads=6,
  attention_head_dim=32,
  in_channels=Z_DIM,
  out_channels=Z_DIM,
  text_dim=TEXT_DIM,
  freq_dim=64,
  ffn_dim=512,
  num_layers=6,
  eps=1e-6,
  cross_attn_norm=True,
  rope_max_seq_len=64,
)
SCHEDULER = dict(
  prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0
)


def _sentences() -> list[str]:
  out = []
  for c, s, b in itertools.product(COLOURS, SHAPES, BACKGROUNDS):
    for place in POSITIONS + tuple(f"moving {d}" for d in DIRECTIONS):
      out.append(f"a {c} {s} {place} on a {b} background")
  return out


def tokenizer(folder: pathlib.Path) -> None:
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(_sentences()),
    model_writer=model,
    vocab_size=48,
    model_type="word",
    pad_id=0,
    eos_id=1,
    unk_id=2,
    bos_id=-1,
    character_coverage=1.0,
    hard_vocab_limit=False,
    minloglevel=2,
  )
  sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
  vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
  assert len(vocab) <= UMT5["vocab_size"], len(vocab)
  tf.T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512).save_pretrained(folder)


# The frozen random UMT5's residual branches (attention and feed-forward outputs) start this small, so each
# output state is mostly its own word: at the default init the colour word's share of the shape word's state
# is 0.037x the variance between shapes, at 0.05x it is 8e-5x (models/shapes-sd's CLIP does the same).
BRANCH_SCALE = 0.05


def small_branches(text_encoder: tf.UMT5EncoderModel, scale: float = BRANCH_SCALE) -> None:
  """Scales the output projections of every block's self-attention and feed-forward."""
  with torch.no_grad():
    for block in text_encoder.encoder.block:
      block.layer[0].SelfAttention.o.weight.mul_(scale)
      block.layer[1].DenseReluDense.wo.weight.mul_(scale)


def main(out: pathlib.Path) -> None:
  torch.manual_seed(0)
  tokenizer(out / "_tok")
  tok = tf.AutoTokenizer.from_pretrained(out / "_tok")
  cfg = dict(VAE, latents_mean=[0.0] * Z_DIM, latents_std=[1.0] * Z_DIM)
  pipe = WanPipeline(
    tokenizer=tok,
    text_encoder=tf.UMT5EncoderModel(tf.UMT5Config(**UMT5)).eval(),
    vae=AutoencoderKLWan(**cfg).eval(),
    scheduler=UniPCMultistepScheduler(**SCHEDULER),
    transformer=WanTransformer3DModel(**TRANSFORMER).eval(),
  )
  small_branches(
    pipe.text_encoder
  )  # after every module is made, so the others' draws are unchanged
  pipe.save_pretrained(out)
  for p in (out / "_tok").iterdir():
    p.unlink()
  (out / "_tok").rmdir()
  words = tok("a red circle moving right on a black background").input_ids
  print(f"wrote {out}; a caption is {len(words)} tokens: {words}")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))
