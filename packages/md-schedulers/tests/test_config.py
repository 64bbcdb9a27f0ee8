"""Building schedulers from the configs the supported models ship, switching by name, and bad input."""

import json
import math

import numpy as np
import pytest

import md_schedulers as mdsch
from md_core import testing

FIXTURES = testing.fixture_path("schedulers")
BUILT = json.loads((FIXTURES / "built.json").read_text())
SIGNATURES = json.loads((FIXTURES / "signatures.json").read_text())


def _config(model):
  return json.loads((FIXTURES / "configs" / f"{model}.json").read_text())


def _same(a, b):
  if isinstance(b, str) and b in ("inf", "-inf"):
    b = float(b)
  if isinstance(a, float) or isinstance(b, float):
    if a is None or b is None:
      return a is b
    return math.isclose(float(a), float(b), rel_tol=1e-12) or (math.isinf(a) and a == b)
  return a == b


@pytest.mark.parametrize("model", sorted(BUILT))
def test_shipped_config_builds_what_the_reference_builds(model):
  sched = mdsch.from_config(_config(model))
  want = BUILT[model]
  assert sched.name == want["class"]
  # The reference keeps options its class ignores in `.config` too; compare the ones it uses.
  used = SIGNATURES[want["class"]]
  for key, value in want["config"].items():
    if key not in used:
      continue
    assert key in sched.config, f"{model}: reference option {key!r} missing from md's config"
    assert _same(sched.config[key], value), (
      f"{model}: {key}={sched.config[key]!r}, reference {value!r}"
    )


@pytest.mark.parametrize("cls", sorted(SIGNATURES))
def test_every_reference_option_is_known_with_its_default(cls):
  factory_defaults = mdsch.SCHEDULERS[cls][1]
  ref = SIGNATURES[cls]
  assert set(factory_defaults) == set(ref), (
    f"{cls}: md lacks {sorted(set(ref) - set(factory_defaults))}, "
    f"has extra {sorted(set(factory_defaults) - set(ref))}"
  )
  for key, value in ref.items():
    assert _same(factory_defaults[key], value), (
      f"{cls}.{key}: md {factory_defaults[key]!r}, ref {value!r}"
    )


def test_shipped_schedules_for_the_families():
  # Flux.1 dev at 1024² (4096 tokens), 28 steps: the state feeds timesteps = 1000 * shifted sigma.
  cfg = _config("flux1_dev")
  sched = mdsch.from_config(cfg)
  n = 28
  mu = mdsch.calculate_shift(
    4096, cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"], cfg["max_shift"]
  )
  assert mu == pytest.approx(1.15)
  state = sched.init(sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
  s = np.linspace(1.0, 1 / n, n).astype(np.float32)
  want = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
  np.testing.assert_allclose(np.asarray(state.sigmas[:-1]), want, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(state.timesteps), want * 1000, rtol=1e-6)
  assert float(state.sigmas[-1]) == 0.0
  # LTX-Video: terminal stretch puts the last nonzero sigma at shift_terminal.
  ltx = mdsch.from_config(_config("ltx_video"))
  state = ltx.init(sigmas=mdsch.ltx_uniform_sigmas(30), mu=mdsch.ltx_mu(4 * 16 * 24, ltx.config))
  assert float(state.sigmas[-2]) == pytest.approx(0.1, rel=1e-6)


def test_flux2_and_ltx_helpers_match_the_reference_pipelines():
  cases = json.loads((FIXTURES / "cases.json").read_text())
  for n in (4, 25, 50):
    assert mdsch.flux2_empirical_mu(4096, n) == pytest.approx(
      cases[f"fm_flux2_klein_{n}"]["init"]["mu"], rel=1e-12
    )
    cfg = _config("flux1_dev")
    assert mdsch.calculate_shift(
      4096, cfg["base_image_seq_len"], cfg["max_image_seq_len"], cfg["base_shift"], cfg["max_shift"]
    ) == pytest.approx(cases[f"fm_flux_dev_{n}"]["init"]["mu"], rel=1e-12)
  lq = testing.load_arrays(FIXTURES / "ltx_schedules.npz")
  for key, ref in lq.items():
    np.testing.assert_allclose(mdsch.linear_quadratic_sigmas(int(key[1:])), ref, rtol=0, atol=1e-7)
  np.testing.assert_allclose(
    mdsch.ltx_uniform_sigmas(8)[:3], [1.0, 1 - 0.875 / 7, 1 - 2 * 0.875 / 7], rtol=1e-12
  )


def test_switch_scheduler_by_name_with_overrides():
  sdxl = _config("sdxl")
  sched = mdsch.from_config(
    sdxl,
    name="DPMSolverMultistepScheduler",
    use_karras_sigmas=True,
    algorithm_type="sde-dpmsolver++",
  )
  assert sched.name == "DPMSolverMultistepScheduler"
  assert sched.config["beta_schedule"] == "scaled_linear"
  assert sched.config["use_karras_sigmas"] and sched.stochastic
  lightning = mdsch.from_config(sdxl, timestep_spacing="trailing")
  state = lightning.init(4)
  np.testing.assert_array_equal(np.asarray(state.timesteps), [999.0, 749.0, 499.0, 249.0])


def test_load_from_a_local_checkpoint_folder(tmp_path):
  (tmp_path / "scheduler").mkdir()
  cfg = _config("wan21")
  (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(cfg))
  (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
  sched = mdsch.load(tmp_path)
  assert sched.name == "UniPCMultistepScheduler"
  assert sched.config["flow_shift"] == 3.0
  again = mdsch.load(tmp_path / "scheduler", subfolder=None, flow_shift=5.0)
  assert again.config["flow_shift"] == 5.0
  with pytest.raises(FileNotFoundError):
    mdsch.load(tmp_path / "missing")


@pytest.mark.parametrize(
  ("config", "overrides", "match"),
  [
    ({"_class_name": "KarrasVeScheduler"}, {}, "unknown scheduler 'KarrasVeScheduler'"),
    ({"num_train_timesteps": 1000}, {}, "no '_class_name'"),
    (
      {"_class_name": "DDIMScheduler", "beta_shedule": "linear"},
      {},
      r"unknown options \['beta_shedule'\]",
    ),
    (
      {"_class_name": "DDIMScheduler"},
      {"flow_shift": 3.0},
      "DDIMScheduler has no option 'flow_shift'",
    ),
    ({"_class_name": "DDPMScheduler", "variance_type": "learned_range"}, {}, "variance_type"),
    (
      {"_class_name": "EulerDiscreteScheduler", "interpolation_type": "log_linear"},
      {},
      "interpolation_type",
    ),
    ({"_class_name": "DDIMScheduler", "beta_schedule": "sigmoid"}, {}, "beta_schedule='sigmoid'"),
    (
      {"_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "dpmsolver"},
      {},
      "final_sigmas_type='zero'",
    ),
    (
      {
        "_class_name": "EulerDiscreteScheduler",
        "use_karras_sigmas": True,
        "use_exponential_sigmas": True,
      },
      {},
      "only one of",
    ),
    ({"_class_name": "DDIMScheduler", "prediction_type": "flow_prediction"}, {}, "prediction_type"),
    ({"_class_name": "UniPCMultistepScheduler", "solver_order": 4}, {}, "solver_order=4"),
  ],
)
def test_bad_config_is_a_clear_error(config, overrides, match):
  with pytest.raises((ValueError, TypeError), match=match):
    mdsch.from_config(config, **overrides)


def test_bad_init_is_a_clear_error():
  with pytest.raises(ValueError, match="cannot exceed num_train_timesteps=1000"):
    mdsch.ddim().init(1001)
  for make in (mdsch.ddim, mdsch.ddpm):  # SD's leading spacing with steps_offset=1
    with pytest.raises(ValueError, match="starts at timestep 1000, .* at most 999 steps"):
      make(timestep_spacing="leading", steps_offset=1).init(1000)
    assert make(timestep_spacing="leading", steps_offset=1).init(999).timesteps[0] == 999
  with pytest.raises(ValueError, match="positive int"):
    mdsch.euler().init(0)
  with pytest.raises(ValueError, match="needs init\\(..., mu=...\\)"):
    mdsch.from_config(_config("flux1_dev")).init(28)
  with pytest.raises(ValueError, match="pass init\\(..., shape=sample.shape\\)"):
    mdsch.unipc_multistep().init(10)
  with pytest.raises(ValueError, match="must descend"):
    mdsch.ddpm().init(timesteps=[10, 500])
  with pytest.raises(ValueError, match="exceeds original_inference_steps=50"):
    mdsch.lcm().init(60)
  with pytest.raises(ValueError, match="4 sigmas given for num_inference_steps=5"):
    mdsch.flow_match_euler().init(5, sigmas=[1.0, 0.7, 0.4, 0.1])
  with pytest.raises(TypeError, match="unknown options"):
    mdsch.euler(timestep_spacings="trailing")
