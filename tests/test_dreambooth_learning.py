"""Dreambooth learns a subject (issue #16's check): a Dreambooth-LoRA (`md_train.recipes.dreambooth_sd`, the
same recipe apps/dreambooth_train runs) on md's default image model (models/shapes-sd) from 4 instance
images of one red square in the centre of a black image, captioned with the identifier `sks` where the
shape's name would be, with prior preservation on a red circle in the same place (4 class images the model
generates itself). md_data's analyser reads the shape: for the identifier's prompt the base model draws no
square (measured on the 2026-12-06 model: 4 circles, 3 triangles, 1 diamond of 8; the subject was a
triangle until that model, which already drew 3 for the identifier), after 100 steps it draws the square
(8 of 8), and the class prompt still gives circles (8 of 8 before and after).

Marked slow (77 s, the suite's longest test; `uv run python -m pytest -m slow`): the Dreambooth recipe,
its prior-preservation step's parity with torch and the app stay in the default suite
(tests/test_dreambooth.py, tests/test_dreambooth_app.py)."""

import collections

import ml_collections
import numpy as np
import pytest

import md_data
import md_sd
import md_train as mdt
from md_core import media
from md_core.testing import repo_root
from md_train import recipes

MODEL = repo_root() / "models" / "shapes-sd"
INSTANCE = "a red sks in the center on a black background"
CLASS = "a red circle in the center on a black background"
SUBJECT = "square"


def _instance_images(folder, count=4):
  folder.mkdir()
  rng = np.random.default_rng(0)
  for i in range(count):
    extent = 64 / 3 * rng.uniform(0.7, 0.95)
    center = tuple(32 + rng.uniform(-2, 2, 2))
    image = md_data.render_shape("red", SUBJECT, "black", center=center, extent=extent, size=64)
    media.save_image(folder / f"instance_{i}.png", image)
  return folder


def _shapes(pipe, prompt, n=8):
  images = pipe(
    [prompt] * n, "", height=64, width=64, num_inference_steps=20, guidance_scale=3.0, seed=0,
    progress=False,
  )  # fmt: skip
  return collections.Counter(md_data.analyse(x).shape for x in np.asarray(images))


@pytest.mark.slow
def test_dreambooth_lora_teaches_the_identifier_the_subjects_shape(tmp_path):
  options = dict(
    model=str(MODEL), instance_dir=str(_instance_images(tmp_path / "instance")),
    instance_prompt=INSTANCE, class_dir=str(tmp_path / "class"), class_prompt=CLASS,
    with_prior_preservation=True, prior_loss_weight=1.0, num_class_images=4, class_steps=20,
    class_guidance=3.0, batch_size=2, size=64, learning_rate=5e-3, warmup_steps=0,
    max_grad_norm=1.0, weight_decay=1e-2, snr_gamma=0.0,
    lora=dict(rank=4, alpha=4.0, targets="to_k,to_q,to_v,to_out.0", init="kaiming", seed=0),
  )  # fmt: skip
  config = ml_collections.ConfigDict(dict(seed=0, recipe_options=options))
  pipe = md_sd.load_pipeline(MODEL)
  before = _shapes(pipe, INSTANCE)
  assert before[SUBJECT] <= 2, before
  recipe = recipes.dreambooth_sd(config)
  state = mdt.fit(recipe, steps=100, progress=False)
  file = recipe.export(state, tmp_path / "export")
  pipe.load_lora(file, name="sks")
  after = _shapes(pipe, INSTANCE)
  assert after[SUBJECT] >= 7, (before, after)
  kept = _shapes(pipe, CLASS)
  assert kept["circle"] >= 6, kept
  print(f"identifier prompt: {dict(before)} -> {dict(after)}; class prompt after: {dict(kept)}")
