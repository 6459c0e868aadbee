"""Pipeline configs: presets, YAML files, published geometries, errors, and the torch-free entry modules."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

import pipelines.causal_world as causal_world
import pipelines.dreamzero as dreamzero
from ardiff_cli.runtime.config import builtin_configs, load_config
from ardiff_cli.runtime.errors import ArdiffWarning, ConfigError
from pipeline_helpers import CONFIGS, REPO


def test_entry_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import pipelines.dreamzero as d, pipelines.causal_world as w\n"
        "for m in (d, w):\n"
        "    cfg = m.Config.from_dict({'preset': 'tiny'}, where='x')\n"
        "    cfg.kv_cache_spec(); m.observation_schema(); cfg.observation_schema()\n"
        "assert 'torch' not in sys.modules, sorted(k for k in sys.modules if k.startswith('torch'))\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env=_env())
    assert result.returncode == 0, result.stderr
    importtime = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import pipelines.dreamzero; "
         "pipelines.dreamzero.Config.from_dict({'preset':'tiny'}, where='x').kv_cache_spec()"],
        cwd=REPO, capture_output=True, text=True, timeout=60, env=_env())
    assert importtime.returncode == 0, importtime.stderr
    assert "torch" not in importtime.stderr


def _env():
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _inspect_capacity(config, tmp_path):
    """`ardiff inspect-capacity CONFIG --format plain` in ``tmp_path``, with a cache of its own."""
    import os

    return subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", str(config), "--format", "plain"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "ARDIFF_CACHE_DIR": str(tmp_path / "cache")})


def test_dreamzero_tiny_spec():
    spec = dreamzero.Config.from_dict({"preset": "tiny"}, where="x").kv_cache_spec()
    assert [(b.name, b.local_index) for b in spec.kv_branches] == [("positive", 0), ("negative", 1)]
    assert spec.cross_attention_lengths == {"text": 16, "image": 17}
    assert spec.max_scratch_tokens_per_branch == 8 + 1  # action register + state token
    assert spec.tokens_per_frame == 16 and spec.frames_per_block == 1 and spec.reset_at_boundary
    assert spec.model_owned_state_bytes_per_session == 4 * 8 * 8 * 4  # anchor latent, float32


def test_dreamzero_without_guidance_has_one_branch():
    spec = dreamzero.Config.from_dict({"preset": "tiny", "guidance_scale": 1}, where="x").kv_cache_spec()
    assert spec.branch_names == ("positive",)


def test_causal_world_tiny_spec():
    spec = causal_world.Config.from_dict({"preset": "tiny"}, where="x").kv_cache_spec()
    assert spec.branch_names == ("main",)
    assert spec.cross_attention_lengths == {"text": 16}
    assert (spec.sink_frames, spec.window_frames, spec.frames_per_block) == (3, 6, 3)
    assert spec.max_scratch_tokens_per_branch == 1
    assert spec.model_owned_state_bytes_per_session == 0
    spec = causal_world.Config.from_dict({"preset": "tiny", "cond_dim": 0}, where="x").kv_cache_spec()
    assert spec.max_scratch_tokens_per_branch == 0


@pytest.mark.parametrize(
    "name, pipeline, layers, heads, head, tokens, block, window, sink, dtype",
    [
        ("dreamzero-tiny", "dreamzero", 2, 4, 16, 16, 1, 4, 0, "float32"),
        ("causal-world-tiny", "causal_world", 2, 4, 16, 16, 3, 6, 3, "float32"),
        ("dreamzero-14b", "dreamzero", 40, 40, 128, 220, 1, 9, 0, "bfloat16"),
        ("self-forcing-1.3b", "causal_world", 30, 12, 128, 1560, 3, 18, 0, "bfloat16"),
        ("lingbot-world-14b", "causal_world", 40, 40, 128, 1560, 3, 18, 3, "bfloat16"),
    ],
)
def test_config_files(name, pipeline, layers, heads, head, tokens, block, window, sink, dtype):
    config = load_config(CONFIGS / f"{name}.yaml")
    assert config.pipeline_name == pipeline and config.runtime.dtype == dtype
    spec = config.kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size) == (layers, heads, head)
    assert (spec.tokens_per_frame, spec.frames_per_block, spec.window_frames, spec.sink_frames) == (
        tokens, block, window, sink)


def test_tiny_config_evicts_in_a_three_episode_demo():
    assert load_config(CONFIGS / "dreamzero-tiny.yaml").runtime.session_capacity == 2


@pytest.mark.parametrize("name, module, preset", [
    ("dreamzero-14b", dreamzero, "14b"),
    ("self-forcing-1.3b", causal_world, "self-forcing-1.3b"),
    ("lingbot-world-14b", causal_world, "lingbot-world-14b"),
])
def test_published_yaml_matches_preset(name, module, preset):
    model = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["model"]
    from_yaml = module.Config.from_dict(model, where=name)
    from_preset = module.Config.from_dict({"preset": preset, "session_capacity": model["session_capacity"]},
                                          where=name)
    assert from_yaml == from_preset


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"unknown preset 'tny' \(did you mean 'tiny'\?\)") as err:
        dreamzero.Config.from_dict({"preset": "tny"}, where="cfg.yaml")
    assert "tiny, small, 14b" in err.value.hint
    with pytest.raises(ConfigError, match=r"cfg.yaml: unknown key 'model.windw_frames' \(did you mean 'window_frames'"):
        dreamzero.Config.from_dict({"windw_frames": 3}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"field 'model.num_layers': expected an integer, got '2'"):
        causal_world.Config.from_dict({"num_layers": "2"}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"field 'model.num_heads': expected a divisor of dim=64, got 5"):
        causal_world.Config.from_dict({"num_heads": 5}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"'model.tokens_per_frame' is derived"):
        causal_world.Config.from_dict({"tokens_per_frame": 5}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"field 'model.denoising_timesteps': expected a decreasing list"):
        causal_world.Config.from_dict({"denoising_timesteps": [250, 500]}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"field 'model.frames_per_request'"):
        dreamzero.Config.from_dict({"frames_per_request": 8}, where="cfg.yaml")  # 2 latent frames > 1 per block
    with pytest.raises(ConfigError, match=r"field 'model.frames_per_request': expected at least 2 \(a one-frame "
                                          r"request starts a session's window\), got 1"):
        dreamzero.Config.from_dict({"frames_per_request": 1, "temporal_stride": 1}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"field 'model.reset_at_window': expected true or false"):
        dreamzero.Config.from_dict({"reset_at_window": "yes"}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"field 'model.seed': expected a non-negative integer below 2\*\*64"):
        causal_world.Config.from_dict({"seed": 1 << 64}, where="cfg.yaml")  # torch.manual_seed's limit
    assert causal_world.Config.from_dict({"seed": (1 << 64) - 1}, where="cfg.yaml").seed == (1 << 64) - 1


@pytest.mark.parametrize("pipeline", ["dreamzero", "causal_world"])
def test_a_vae_stride_the_frame_size_does_not_take_is_named_not_the_height(tmp_path, pipeline):
    """`vae_stride: 3` with the preset's 32 x 32 frames was "field 'model.height': expected a multiple of vae_stride *
    patch = 6, got 32": the user never set a height. The field the config set is named, with the strides that do;
    a height the config set is still named as it was."""
    config = tmp_path / "stride.yaml"
    config.write_text(f"pipeline: {pipeline}\nmodel:\n  preset: tiny\n  vae_stride: 3\n")
    proc = _inspect_capacity(config, tmp_path)
    assert proc.returncode == 2, proc.stderr
    wanted = ("a value for which height=32 and width=32 are multiples of vae_stride * patch (2 x 2): one of 1, 2, 4, "
              "8, 16")
    assert proc.stderr == (f"Error: {config}: field 'model.vae_stride': expected {wanted}, got 3\n"
                           f"hint: set 'model.vae_stride' to {wanted}\n"), proc.stderr
    module = {"dreamzero": dreamzero, "causal_world": causal_world}[pipeline]
    with pytest.raises(ConfigError, match=r"field 'model.height': expected a multiple of vae_stride \* patch = 8, "
                                          r"got 36$"):
        module.Config.from_dict({"preset": "tiny", "height": 36}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"field 'model.vae_stride': expected .*\(32 x 1\): only 1, got 2$"):
        module.Config.from_dict({"preset": "tiny", "vae_stride": 2, "patch_size": [1, 32, 1]}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"field 'model.height': expected a multiple of vae_stride \* patch = 9, "
                                          r"got 32$"):  # no stride would do: the height is named
        module.Config.from_dict({"preset": "tiny", "vae_stride": 3, "patch_size": [1, 3, 3]}, where="cfg.yaml")


@pytest.mark.parametrize("pipeline", ["dreamzero", "causal_world"])
def test_a_patch_size_the_latent_frame_does_not_take_is_named_not_the_height(tmp_path, pipeline):
    """`patch_size: [1, 3, 3]` with the preset's 32 x 32 frames (8 x 8 latent) was "field 'model.height': expected a
    multiple of vae_stride * patch = 12, got 32": the user set neither the height nor vae_stride. The field the config
    set is named, with the patch rows and cols that would do."""
    config = tmp_path / "patch.yaml"
    config.write_text(f"pipeline: {pipeline}\nmodel:\n  preset: tiny\n  patch_size: [1, 3, 3]\n")
    proc = _inspect_capacity(config, tmp_path)
    assert proc.returncode == 2, proc.stderr
    wanted = ("[1, rows, cols] for which height=32 and width=32 are multiples of vae_stride * patch (vae_stride 4): "
              "rows and cols each one of 1, 2, 4, 8")
    assert proc.stderr == (f"Error: {config}: field 'model.patch_size': expected {wanted}, got [1, 3, 3]\n"
                           f"hint: set 'model.patch_size' to {wanted}\n"), proc.stderr
    module = {"dreamzero": dreamzero, "causal_world": causal_world}[pipeline]
    with pytest.raises(ConfigError, match=r"field 'model.patch_size': expected .*: rows one of 1, 2, 4, 8 and cols "
                                          r"one of 1, 2, 4, 8, 16, got \[1, 16, 2\]$"):
        module.Config.from_dict({"preset": "tiny", "width": 64, "patch_size": [1, 16, 2]}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"field 'model.height': expected a multiple of vae_stride \* patch = 12, "
                                          r"got 32$"):  # the height the config set is still named
        module.Config.from_dict({"preset": "tiny", "height": 32, "patch_size": [1, 3, 3]}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"field 'model.vae_stride': expected .*\(2 x 2\): one of 1, 2, 4, 8, 16, "
                                          r"got 3$"):  # both set: vae_stride, as before
        module.Config.from_dict({"preset": "tiny", "vae_stride": 3, "patch_size": [1, 2, 2]}, where="cfg.yaml")
    with pytest.raises(ConfigError, match=r"field 'model.height': expected a multiple of vae_stride \* patch = 12, "
                                          r"got 30$"):  # 30 / vae_stride 4 is no latent height: no patch would do
        module.Config.from_dict({"preset": "tiny", "height": 30, "patch_size": [1, 3, 3]}, where="cfg.yaml")


@pytest.mark.parametrize("key", ["Preset", "presets", "prest"])
def test_a_misspelt_preset_key_is_named_with_a_did_you_mean(key):
    """`model: {Preset: tiny}` or `presets:` said only "unknown key" (the suggestion looked among the model's
    fields, which `preset` is not one of), though every other misspelt model key gets a did-you-mean."""
    with pytest.raises(ConfigError, match=rf"^cfg.yaml: unknown key 'model.{key}' \(did you mean 'preset'\?\)$"):
        dreamzero.Config.from_dict({key: "tiny"}, where="cfg.yaml")


def test_yaml_ints_are_accepted_for_floats_and_lists_for_tuples():
    config = causal_world.Config.from_dict({"timestep_shift": 3, "patch_size": [1, 2, 2]}, where="x")
    assert config.timestep_shift == 3.0 and config.patch_size == (1, 2, 2)


BUILT_IN_PYTHON = {  # field: a value of another type, what the error says was expected
    "guidance_scale_text": ("guidance_scale", "7.5", "a number"),
    "guidance_scale_list": ("guidance_scale", [7.5], "a number"),
    "guidance_scale_true": ("guidance_scale", True, "a number"),  # passed as 1: guidance silently off
    "guidance_scale_none": ("guidance_scale", None, "a number"),
    "timestep_shift_true": ("timestep_shift", True, "a number"),
    "num_inference_steps_float": ("num_inference_steps", 2.5, "an integer"),  # built, then failed in a request
    "dim_float": ("dim", 64.0, "an integer"),  # torch: empty(): argument 'size' must be tuple of ints
    "reset_at_window_text": ("reset_at_window", "no", "true or false"),  # a non-empty string: true
}


@pytest.mark.parametrize(("name", "value", "expected"), list(BUILT_IN_PYTHON.values()), ids=list(BUILT_IN_PYTHON))
def test_a_config_built_in_python_refuses_a_field_of_another_type_naming_it(name, value, expected):
    """A config built in Python (``Config(...)``, ``dataclasses.replace`` of a loaded config's model), not by
    ``from_dict``, skipped its type checks: a quoted guidance_scale failed ``__post_init__``'s range check as an
    unnamed TypeError, True passed as 1.0, and a float size reached torch. Each is refused as from_dict refuses it."""
    import dataclasses

    from pipelines.config import InvalidField

    with pytest.raises(InvalidField, match=rf"^field '{name}': expected {expected}, got "):
        dreamzero.Config(**{name: value})
    model = load_config("dreamzero-tiny").model
    with pytest.raises(InvalidField, match=rf"^field '{name}': expected {expected}, got "):
        dataclasses.replace(model, **{name: value})
    converted = dreamzero.Config(guidance_scale=7, patch_size=[1, 2, 2])  # as from_dict converts YAML's
    assert (converted.guidance_scale, converted.patch_size) == (7.0, (1, 2, 2))
    assert isinstance(converted.guidance_scale, float) and converted == dreamzero.Config(guidance_scale=7.0)


def test_a_config_built_in_python_takes_numpy_numbers_as_plain_ones():
    """A size or scale from numpy (``np.arange`` of a sweep, a value read from an ``.npz``) built a config before its
    fields were checked in Python, and is refused since (`expected an integer, got np.int64(2)`): each is converted
    to the plain number YAML gives, so ``to_dict`` (a checkpoint's metadata) stays JSON (an ``np.int64`` made
    ``json.dumps`` fail there). A numpy bool is no number, as a Python one is not."""
    import json

    import numpy as np

    from pipelines.config import InvalidField

    config = dreamzero.Config(num_layers=np.int64(3), dim=np.int32(64), guidance_scale=np.float32(7.5),
                              timestep_shift=np.int64(3), patch_size=[np.int64(1), 2, np.uint8(2)])
    assert config == dreamzero.Config(num_layers=3, dim=64, guidance_scale=7.5, timestep_shift=3.0)
    assert [type(getattr(config, name)) for name in ("num_layers", "dim", "guidance_scale", "timestep_shift")] == [
        int, int, float, float]
    assert [type(size) for size in config.patch_size] == [int, int, int]
    json.dumps(config.to_dict())
    with pytest.raises(InvalidField, match=r"^field 'num_layers': expected an integer, got "):
        dreamzero.Config(num_layers=np.bool_(True))
    with pytest.raises(InvalidField, match=r"^field 'guidance_scale': expected a finite number, got "):
        dreamzero.Config(guidance_scale=np.float32("nan"))


def test_a_config_subclass_whose_annotations_name_what_only_type_checkers_import_is_built():
    """``__post_init__`` checks fields by their resolved types (``typing.get_type_hints``): a subclass of a module
    with ``from __future__ import annotations`` whose field names a type imported under ``TYPE_CHECKING`` (or a local
    one) raised ``NameError`` at every construction, which built before. Its inherited fields are still checked."""
    import textwrap

    from pipelines.config import InvalidField

    namespace: dict = {}
    exec(compile(textwrap.dedent("""\
        from __future__ import annotations
        from dataclasses import dataclass
        from typing import TYPE_CHECKING
        from pipelines.config import BackboneConfig
        if TYPE_CHECKING:
            from pathlib import Path

        @dataclass(frozen=True)
        class Geometry(BackboneConfig):
            dim: int = 80
            num_heads: int = 2
            weights: Path | None = None
        """), "lab_geometry.py", "exec"), namespace)
    geometry = namespace["Geometry"](num_layers=3)
    assert (geometry.dim, geometry.num_layers, geometry.weights) == (80, 3, None)
    with pytest.raises(InvalidField, match=r"^field 'num_layers': expected an integer, got 2.0"):
        namespace["Geometry"](num_layers=2.0)


def _scalars():
    """(id, pipeline, field, value given, the plain value the config keeps): each built a config only as a plain
    number, and was refused as 'expected a number, got tensor(7.5000)' (or np.True_ as 'true or false')."""
    import numpy as np
    import torch

    return [
        ("tensor_float", dreamzero, "guidance_scale", torch.tensor(7.5), 7.5),
        ("tensor_int_for_float", dreamzero, "timestep_shift", torch.tensor(3), 3.0),
        ("tensor_float16", dreamzero, "guidance_scale", torch.tensor(2.5, dtype=torch.float16), 2.5),
        ("tensor_requires_grad", dreamzero, "guidance_scale", torch.tensor(7.5, requires_grad=True), 7.5),
        ("parameter", dreamzero, "timestep_shift", torch.nn.Parameter(torch.tensor(4.0)), 4.0),
        ("tensor_int", dreamzero, "num_layers", torch.tensor(3), 3),
        ("tensor_uint8", dreamzero, "dim", torch.tensor(64, dtype=torch.uint8), 64),
        ("tensor_bool", dreamzero, "reset_at_window", torch.tensor(False), False),
        ("numpy_bool", dreamzero, "reset_at_window", np.bool_(False), False),
        ("numpy_bool_true", causal_world, "qk_norm", np.True_, True),
        ("numpy_0d_array", causal_world, "timestep_shift", np.array(2.5), 2.5),
        ("numpy_0d_int_array", causal_world, "cond_dim", np.array(0), 0),
        ("tensor_seed", causal_world, "seed", torch.tensor(2**62), 2**62),
        ("tuple_of_tensors", causal_world, "denoising_timesteps", [torch.tensor(1000), np.int64(500), np.array(250)],
         (1000, 500, 250)),
        # a 1-d tensor or array is the list of the values it holds, as a list of 0-d ones is (above)
        ("tensor_1d_for_tuple", dreamzero, "patch_size", torch.tensor([1, 2, 2]), (1, 2, 2)),
        ("numpy_1d_for_tuple", causal_world, "denoising_timesteps", np.array([1000, 500, 250], dtype=np.int32),
         (1000, 500, 250)),
        ("tensor_1d_from_linspace", causal_world, "denoising_timesteps", torch.linspace(1000, 250, 3).long(),
         (1000, 625, 250)),
    ]


@pytest.mark.parametrize(("module", "name", "value", "plain"), [case[1:] for case in _scalars()],
                         ids=[case[0] for case in _scalars()])
def test_a_config_built_in_python_takes_a_0d_tensor_or_numpy_scalar_as_the_number_it_holds(module, name, value,
                                                                                          plain):
    """A scale read back from a tensor (a sweep's ``torch.linspace``, a learned value) or a numpy 0-d array is an
    honest number, and a numpy bool (``np.True_`` from a mask) a bool: each is kept as the plain value it holds
    (``.item()``), its type the field's, so ``to_dict`` (a checkpoint's metadata) stays JSON. The rule after that is
    the plain number's: a float tensor for an int field is refused as 64.0 is (below)."""
    import dataclasses
    import json

    config = module.Config(**{name: value})
    expected = module.Config(**{name: plain})
    assert config == expected and type(getattr(config, name)) is type(getattr(expected, name))
    assert [type(item) for item in getattr(config, name)] == [int] * 3 if isinstance(plain, tuple) else True
    json.dumps(config.to_dict())
    model = load_config(f"{module.__name__.rpartition('.')[2].replace('_', '-')}-tiny").model
    assert dataclasses.replace(model, **{name: value}) == dataclasses.replace(model, **{name: plain})


def _not_numbers():
    """(id, field, value, what the error says was expected): what holds no one number of the field's kind."""
    import numpy as np
    import torch

    return [
        ("tensor_1d", "guidance_scale", torch.tensor([7.5]), "a number"),
        ("numpy_1d", "guidance_scale", np.array([7.5]), "a number"),
        ("tensor_fraction_for_int", "num_layers", torch.tensor(2.5), "an integer"),
        ("tensor_float_for_int", "num_layers", torch.tensor(3.0), "an integer"),  # as 3.0 is
        ("numpy_bool_for_int", "num_layers", np.bool_(True), "an integer"),
        ("tensor_bool_for_float", "guidance_scale", torch.tensor(True), "a number"),
        ("tensor_int_for_bool", "reset_at_window", torch.tensor(1), "true or false"),
        ("tensor_complex", "guidance_scale", torch.tensor(7.5 + 1j), "a number"),
        ("tensor_nan", "guidance_scale", torch.tensor(float("nan")), "a finite number"),
        ("tensor_2d_for_tuple", "patch_size", torch.tensor([[1, 2, 2]]), "a list of ints"),  # holds no list of ints
        ("meta_tensor", "guidance_scale", torch.tensor(7.5, device="meta"), "a number"),  # holds no value
        # a time, not a number: .item() of a nanosecond one is a plain int, and num_layers=3 built
        ("numpy_timedelta_ns", "num_layers", np.timedelta64(3, "ns"), "an integer"),
        ("numpy_datetime_ns", "num_layers", np.datetime64(3, "ns"), "an integer"),
    ]


@pytest.mark.parametrize(("name", "value", "expected"), [case[1:] for case in _not_numbers()],
                         ids=[case[0] for case in _not_numbers()])
def test_a_config_built_in_python_refuses_a_tensor_that_holds_no_number_of_the_fields_kind(name, value, expected):
    from pipelines.config import InvalidField

    with pytest.raises(InvalidField, match=rf"^field '{name}': expected {expected}, got (tensor|array|np|\[1, np)"):
        dreamzero.Config(**{name: value})


def _bad_items():
    """(id, field, value, the item named, what the error says was expected of it, what it says was given)."""
    import numpy as np
    import torch

    return [
        ("text", "patch_size", [1, "2", 2], 1, "an integer", "'2'"),
        ("float", "patch_size", [1, 2, 2.5], 2, "an integer", "2.5"),
        ("bool", "patch_size", [True, 2, 2], 0, "an integer", "True"),
        ("numpy_timedelta", "patch_size", [1, np.timedelta64(2, "ns"), 2], 1, "an integer", "np.timedelta64"),
        ("float_tensor_1d", "patch_size", torch.tensor([1.0, 2.0, 2.0]), 0, "an integer", r"tensor\(1\.\)"),
        ("numpy_float_1d", "patch_size", np.array([1, 2, 2.5]), 0, "an integer", r"np.float64\(1.0\)"),
        ("beyond_int64", "patch_size", [1, 2**63, 2], 1, "an integer below 2\\*\\*63", "9223372036854775808"),
        ("nested", "patch_size", [1, [2], 2], 1, "an integer", r"\[2\]"),
    ]


@pytest.mark.parametrize(("name", "value", "index", "expected", "got"), [case[1:] for case in _bad_items()],
                         ids=[case[0] for case in _bad_items()])
def test_a_list_field_names_the_item_that_is_not_of_its_type(name, value, index, expected, got):
    """Every item of a list field is checked as a field of the item's type is (a 1-d tensor's or array's too, each
    the value it holds), and the error names the item: "expected a list of ints, got [1, '2', 2]" left the user to
    find which one, and said nothing of a quoted number. From YAML the item's path is the one the YAML has."""
    from pipelines.config import InvalidField

    with pytest.raises(InvalidField, match=rf"^field '{name}\[{index}\]': expected {expected}, got {got}"):
        dreamzero.Config(**{name: value})
    if not hasattr(value, "ndim"):  # YAML gives lists
        with pytest.raises(ConfigError, match=rf"^cfg.yaml: field 'model.{name}\[{index}\]': expected {expected}, "
                                              rf"got {got}"):
            dreamzero.Config.from_dict({"preset": "tiny", name: value}, where="cfg.yaml")


def test_a_list_item_quoted_in_the_yaml_is_named_with_its_path_and_the_number_hint(tmp_path):
    """`denoising_timesteps: [1000, '500', 250]` was "expected a list of ints, got [1000, '500', 250]": the item, by
    the path YAML gives it, and the hint a quoted number gets as any other field's value."""
    config = tmp_path / "quoted.yaml"
    config.write_text("pipeline: causal_world\nmodel:\n  preset: tiny\n  denoising_timesteps: [1000, '500', 250]\n")
    proc = _inspect_capacity(config, tmp_path)
    assert proc.returncode == 2, proc.stderr
    error, hint = proc.stderr.splitlines()
    assert error == f"Error: {config}: field 'model.denoising_timesteps[1]': expected an integer, got '500'"
    assert hint == "hint: '500' is text (quoted), not a number: remove the quotes"  # it said: set it to a list of ints


LAB_PAIRS = """\
from dataclasses import dataclass

from pipelines.config import BackboneConfig


@dataclass(frozen=True)
class Pairs(BackboneConfig):
    crop: tuple[int, int] = (0, 0)  # a fixed length: two ints
    label: tuple[str, float] = ("x", 1.0)  # an item type each
    ranks: tuple[int, ...] = ()
    grid: tuple[list[int], ...] = ()  # a tuple of other types: taken as given
"""


@pytest.mark.parametrize(("name", "value", "message"), [
    ("crop", [1, 2, 3], r"field 'crop': expected a list of 2 ints, got \[1, 2, 3\]"),
    ("crop", [1], r"field 'crop': expected a list of 2 ints, got \[1\]"),
    ("crop", [1, "2"], r"field 'crop\[1\]': expected an integer, got '2'"),
    ("label", ["x", "y"], r"field 'label\[1\]': expected a number, got 'y'"),
    ("label", [2.0, 2.0], r"field 'label\[0\]': expected a string, got 2.0"),
    ("label", "x", r"field 'label': expected a list of 2 items \(str, float\), got 'x'"),
    ("ranks", [1, 2.5], r"field 'ranks\[1\]': expected an integer, got 2.5"),
], ids=["too_long", "too_short", "text_item", "text_for_float", "float_for_str", "text_for_list", "variadic"])
def test_a_tuple_field_checks_each_item_by_its_own_type_and_a_fixed_length(tmp_path, monkeypatch, name, value,
                                                                            message):
    """``tuple[str, float]`` was checked as a list of strs (its first type, for every item: ("x", 1.0) refused),
    ``tuple[int, int]`` took any number of ints, and ``tuple[list[int], ...]`` failed every build (``TypeError:
    isinstance() argument 2 cannot be a parameterized generic``): a tuple of types ``_coerce`` does not convert is
    taken as given, as a field of such a type is."""
    import importlib

    import numpy as np

    from pipelines.config import InvalidField, config_from_dict

    (tmp_path / "lab_pairs.py").write_text(LAB_PAIRS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lab_pairs", raising=False)
    pairs = importlib.import_module("lab_pairs").Pairs
    built = pairs(crop=[np.int64(4), 8], label=("y", 2), ranks=np.arange(3))
    assert (built.crop, built.label, built.ranks) == ((4, 8), ("y", 2.0), (0, 1, 2))
    assert type(built.label[1]) is float
    assert pairs(grid=([1], [2, 3])).grid == ([1], [2, 3])
    assert config_from_dict(pairs, {"grid": [[1]]}, where="lab.yaml", presets={}).grid == [[1]]
    with pytest.raises(InvalidField, match=rf"^{message}$"):
        pairs(**{name: value})
    with pytest.raises(ConfigError, match="^lab.yaml: " + message.replace("field '", "field 'model.", 1)):
        config_from_dict(pairs, {name: value}, where="lab.yaml", presets={})


LAB_GEOMETRY = '''\
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipelines.config import BackboneConfig

if TYPE_CHECKING:
    from pathlib import Path

Seconds = float  # an alias of the module's


@dataclass(frozen=True)
class Geometry(BackboneConfig):
    dim: int = 80
    num_heads: int = 2
    weights: Path | None = None  # resolves only for a type checker
    rank: int = 4
    frame_time: Seconds = 0.1
    tags: tuple[str, ...] = ()
'''


@pytest.fixture
def lab_geometry(tmp_path, monkeypatch):
    import importlib

    (tmp_path / "lab_geometry.py").write_text(LAB_GEOMETRY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lab_geometry", raising=False)
    return importlib.import_module("lab_geometry").Geometry


@pytest.mark.parametrize(("name", "value", "expected"), [
    ("rank", 2.5, "an integer"),
    ("rank", "4", "an integer"),
    ("frame_time", "0.1", "a number"),  # a module alias: resolved in the module's namespace
    ("frame_time", True, "a number"),
    ("tags", "ab", "a list of strs"),
    ("num_layers", 2.0, "an integer"),  # inherited, checked before too
])
def test_a_config_subclass_with_an_unresolvable_annotation_checks_its_other_fields(lab_geometry, name, value,
                                                                                  expected):
    """One annotation that resolves only for a type checker (``weights: Path | None``, Path imported under
    TYPE_CHECKING) made ``typing.get_type_hints`` fail for the whole class, and only the fields inherited from
    BackboneConfig were checked: the subclass's own ``rank=2.5`` built. Each field is resolved alone now."""
    from pipelines.config import InvalidField

    with pytest.raises(InvalidField, match=rf"^field '{name}': expected {expected}, got "):
        lab_geometry(**{name: value})


def test_a_config_subclass_with_a_quoted_type_inside_a_tuple_is_checked_beside_an_unresolvable_one(tmp_path,
                                                                                                   monkeypatch):
    """Without ``from __future__ import annotations`` a field's annotation is an object, ``tuple["str", ...]``, that
    holds a string: taken as it was, beside an annotation that does not resolve, it failed every build with
    ``TypeError: isinstance() arg 2 must be a type``. It is resolved as ``typing.get_type_hints`` resolves it."""
    import importlib

    (tmp_path / "lab_tagged.py").write_text(
        "from dataclasses import dataclass\nfrom typing import TYPE_CHECKING\n\n"
        "from pipelines.config import BackboneConfig\n\nif TYPE_CHECKING:\n    from pathlib import Path\n\n\n"
        "@dataclass(frozen=True)\nclass Tagged(BackboneConfig):\n"
        "    weights: 'Path | None' = None\n    tags: tuple['str', ...] = ()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lab_tagged", raising=False)
    tagged = importlib.import_module("lab_tagged").Tagged
    with pytest.warns(ArdiffWarning, match="field 'weights'"):
        assert tagged(tags=["a"]).tags == ("a",)
    from pipelines.config import InvalidField

    with pytest.raises(InvalidField, match=r"^field 'tags': expected a list of strs, got 'ab'"):
        tagged(tags="ab")


def test_a_config_subclass_with_an_unresolvable_annotation_warns_once_naming_what_is_not_checked(lab_geometry):
    import numpy as np

    with pytest.warns(ArdiffWarning) as warned:
        geometry = lab_geometry(rank=np.int64(3), frame_time=np.float32(0.5), tags=["a"])
    assert [str(w.message) for w in warned] == [
        "lab_geometry.Geometry: field 'weights' (annotation 'Path | None') is not checked when the config is built: "
        "its annotation does not resolve at run time (name 'Path' is not defined)"]
    assert (geometry.rank, geometry.frame_time, geometry.tags) == (3, 0.5, ("a",))
    assert (type(geometry.rank), type(geometry.frame_time)) == (int, float)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class: a sweep builds thousands
        lab_geometry(rank=5).replace(rank=6)


@pytest.mark.parametrize("build", ["init", "replace", "config_from_dict"])
def test_a_config_subclass_with_an_unresolvable_annotation_warns_at_the_line_that_builds_it(lab_geometry, build):
    """The warning's place is the user's line (a fixed stacklevel=4 pointed at dataclasses.py for ``.replace``, at
    the caller's caller for ``config_from_dict``)."""
    import pipelines.config
    from pipelines.config import config_from_dict

    built = lab_geometry() if build == "replace" else None
    pipelines.config._WARNED_UNRESOLVED.discard(lab_geometry)  # once per class: warn again
    with pytest.warns(ArdiffWarning) as warned:
        if build == "init":
            lab_geometry(rank=3)
        elif build == "replace":
            built.replace(rank=3)
        else:
            config_from_dict(lab_geometry, {"rank": 3}, where="lab.yaml", presets={})
    assert [w.filename for w in warned] == [__file__]


BUILT_IN_SUBCLASS = '''\
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipelines.{pipeline} import Config

if TYPE_CHECKING:
    from pathlib import Path


@dataclass(frozen=True)
class MyConfig(Config):
    weights: Path | None = None  # resolves only for a type checker
'''


@pytest.mark.parametrize("pipeline", ["dreamzero", "causal_world"])
@pytest.mark.parametrize("build", ["init", "replace"])
def test_a_subclass_of_a_built_in_config_with_an_unresolvable_annotation_warns_at_the_line_that_builds_it(
        tmp_path, monkeypatch, pipeline, build):
    """A built-in pipeline's ``Config`` has a ``__post_init__`` of its own that calls its base's: the warning named
    that call's line in the built-in's config.py (``super().__post_init__()``), not the user's."""
    import importlib
    import warnings

    import pipelines.config

    (tmp_path / f"lab_{pipeline}.py").write_text(BUILT_IN_SUBCLASS.format(pipeline=pipeline))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, f"lab_{pipeline}", raising=False)
    my_config = importlib.import_module(f"lab_{pipeline}").MyConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = my_config()
    pipelines.config._WARNED_UNRESOLVED.discard(my_config)  # once per class: warn again
    with pytest.warns(ArdiffWarning, match="field 'weights'") as warned:
        if build == "init":
            my_config(weights="w.safetensors")
        else:
            built.replace(weights="w.safetensors")
    assert [w.filename for w in warned] == [__file__]


def test_a_config_subclass_with_an_unresolvable_annotation_is_read_from_yaml_checking_its_other_fields(lab_geometry):
    """``config_from_dict`` (a pipeline's ``Config.from_dict``, the YAML's ``model:``) resolved every annotation at
    once too: such a subclass failed to load with the NameError ("name 'Path' is not defined"), whatever the YAML."""
    from pipelines.config import config_from_dict

    with pytest.warns(ArdiffWarning, match="field 'weights'"):
        geometry = config_from_dict(lab_geometry, {"rank": 3, "frame_time": 1, "weights": "w.safetensors"},
                                    where="lab.yaml", presets={})
    assert (geometry.rank, geometry.frame_time, geometry.weights) == (3, 1.0, "w.safetensors")
    assert type(geometry.frame_time) is float
    with pytest.raises(ConfigError, match=r"^lab.yaml: field 'model.rank': expected an integer, got 2.5"):
        config_from_dict(lab_geometry, {"rank": 2.5}, where="lab.yaml", presets={})


def test_a_config_subclass_with_a_field_of_another_type_is_read_from_yaml_taking_it_as_given(tmp_path, monkeypatch):
    """A field whose annotation resolves to a type ``_coerce`` does not convert (``weights: Path | None``, Path
    imported for real) is taken as given, as ``__post_init__`` takes it: ``config_from_dict`` converted every key's
    value, and such a key in the YAML was an ``AssertionError`` traceback ("unsupported type ...; extend _coerce"),
    while the same subclass built in Python, or with Path imported only for a type checker, loaded."""
    import importlib
    from pathlib import Path

    from pipelines.config import config_from_dict

    (tmp_path / "lab_weighted.py").write_text(LAB_GEOMETRY.replace("if TYPE_CHECKING:\n    from pathlib", "if True:\n"
                                                                   "    from pathlib"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lab_weighted", raising=False)
    weighted = importlib.import_module("lab_weighted").Geometry
    assert weighted(weights=Path("w.safetensors")).weights == Path("w.safetensors")
    geometry = config_from_dict(weighted, {"rank": 3, "weights": "w.safetensors"}, where="lab.yaml", presets={})
    assert (geometry.rank, geometry.weights) == (3, "w.safetensors")
    with pytest.raises(ConfigError, match=r"^lab.yaml: field 'model.rank': expected an integer, got 2.5"):
        config_from_dict(weighted, {"rank": 2.5, "weights": None}, where="lab.yaml", presets={})


def test_config_from_dict_checks_each_value_once(monkeypatch):
    """A value of the model: section is checked and converted by ``__post_init__`` alone, as in Python: ``from_dict``
    converted each given key's value too, then built the config, which converted it again."""
    import pipelines.config
    from pipelines.dreamzero.config import Config

    checked = []
    coerce = pipelines.config._coerce
    monkeypatch.setattr(pipelines.config, "_coerce", lambda name, hint, value: checked.append(name)
                        or coerce(name, hint, value))
    config = Config.from_dict({"preset": "tiny", "dim": 64, "guidance_scale": 2, "patch_size": [1, 2, 2]},
                              where="x.yaml")
    assert (config.dim, config.guidance_scale, config.patch_size) == (64, 2.0, (1, 2, 2))
    # each settable field once (a list field's items are checked each under its own name: patch_size[0])
    assert sorted(name for name in checked if "[" not in name) == sorted(pipelines.config.checked_fields(Config))
    with pytest.raises(ConfigError, match=r"^x.yaml: field 'model.dim': expected an integer, got 2.5$"):
        Config.from_dict({"dim": 2.5}, where="x.yaml")


@pytest.mark.parametrize("name", sorted(builtin_configs()))
def test_every_shipped_config_declares_the_tensors_its_sessions_keep(name):
    """The plan counts the spec's model_owned_state_bytes_per_session for each session (and the runner warns when an
    export holds more): a shipped config must declare at least what its session record holds. DreamZero's record
    holds its anchor latent, whose shape the VAE gives on the meta device (no weights, no compute, the 14B configs
    too); CausalWorld's holds no tensor."""
    import typing

    import torch

    from pipelines.checkpoint import build_config_on_meta

    config = load_config(name)
    cls, model = config.entry.pipeline_class(), config.model
    declared = config.kv_cache_spec().model_owned_state_bytes_per_session
    hints = typing.get_type_hints(cls.session_record)
    tensors = sorted(field for field, hint in hints.items() if hint is torch.Tensor)
    if cls.name == "causal_world":
        assert tensors == [] and declared == 0
    else:  # a new tensor field in the record is counted here, or this fails
        assert cls.name == "dreamzero" and tensors == ["anchor_latent"], (cls.name, tensors)
        frame = torch.zeros((1, model.height, model.width, 3), dtype=torch.uint8, device="meta")
        anchor = build_config_on_meta(cls, model).vae.encode(frame)[:, 0]  # (C, h, w), as _step keeps it
        assert anchor.nbytes == declared > 0, (anchor.shape, declared)


def test_the_built_in_configs_whose_schema_takes_a_step_file_are_told_from_the_configs_alone():
    """A run's closing hint names the built-in config whose observation schema takes a recording made for another
    pipeline (`builtin_schemas`, `takes_layout`): read from the configs, without torch or a model, and without a false
    match, which would paste into a run that fails again or runs the wrong model."""
    code = (
        "import sys\n"
        "from ardiff_cli.runtime.config import builtin_schemas\n"
        "from ardiff_cli.runtime.observation import takes_layout\n"
        "schemas = builtin_schemas()\n"
        "assert 'torch' not in sys.modules, sorted(k for k in sys.modules if k.startswith('torch'))\n"
        "def taking(layout): return [n for n, s in schemas.items() if takes_layout(s, layout)]\n"
        "cam = ('uint8', (32, 48, 3))\n"
        "robot = {'exterior_image_0': cam, 'observation/exterior_image_1_left': cam, 'wrist_image': cam,\n"
        "         'joint_position': ('float32', (7,)), 'gripper_position': ('float64', ())}\n"
        "cases = [\n"
        "    ({'conditioning': ('float32', (8,))}, ['causal-world-tiny']),\n"
        "    ({'camera': ('float64', (12,))}, ['lingbot-world-14b']),  # an alias, a float of another precision\n"
        "    ({'conditioning': ('float32', (8,)), 'action': ('float32', (8,))}, []),  # one field given twice\n"
        "    ({'conditioning': ('int64', (8,))}, []),\n"
        "    ({'conditioning': ('float32', (2, 8))}, []),\n"
        "    ({'conditioning': ('float32', (8,)), 'timestamp': ('float64', (1,))}, []),  # a key of no schema\n"
        "    ({}, []),  # no array: self-forcing-1.3b takes none, but tells no recording by it\n"
        "    (robot, ['dreamzero-14b', 'dreamzero-tiny']),\n"
        "    ({**robot, 'cartesian_position': ('float32', (6,))}, ['dreamzero-14b', 'dreamzero-tiny']),\n"
        "    # a key of no schema beside every required field of one (a timestamp): a run ignores it, warning\n"
        "    ({**robot, 'timestamp': ('float64', (1,))}, ['dreamzero-14b', 'dreamzero-tiny']),\n"
        "    ({k: v for k, v in robot.items() if k != 'wrist_image'}, []),  # a required field missing\n"
        "    ({**robot, 'wrist_image': ('uint8', (0, 48, 3))}, []),  # an empty image\n"
        "]\n"
        "for layout, expected in cases:\n"
        "    assert taking(layout) == expected, (layout, taking(layout), expected)\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env=_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"
