"""Engine config parsing: built-in names, runtime settings and their validation, applied at load."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from ardiff_cli.runtime.capacity import plan_capacity
from ardiff_cli.runtime.config import MAX_CONFIG_BYTES, RuntimeConfig, builtin_configs, load_config, resolve_config
from ardiff_cli.runtime.engine import ARDiffusionEngine
from ardiff_cli.runtime.errors import ConfigError


def test_builtin_configs_resolve_by_name():
    names = builtin_configs()
    assert {"dreamzero-tiny", "causal-world-tiny", "dreamzero-14b", "self-forcing-1.3b"} <= set(names)
    assert resolve_config("dreamzero-tiny") == names["dreamzero-tiny"]
    assert load_config(None).pipeline_name == "dreamzero"


def test_unknown_config_name_suggests_a_builtin():
    with pytest.raises(ConfigError, match="unknown config 'dreamzero-tny' \\(did you mean 'dreamzero-tiny'\\?\\)"):
        resolve_config("dreamzero-tny")


@pytest.mark.parametrize(
    ("runtime", "message"),
    [
        ({"device": "tpu"}, "field 'runtime.device': expected auto, cpu, cuda or cuda:N \\(N from 0 to 127\\), got "
                            "'tpu'"),
        # torch keeps the index in 8 bits: cuda:256 was cuda:0, and cuda:2147483648 "a bug in ardiff"
        ({"device": "cuda:256"}, "field 'runtime.device': expected auto, .*, got 'cuda:256'"),
        ({"dtype": "int8"}, "field 'runtime.dtype': expected float32 \\| bfloat16 \\| float16, got 'int8'$"),
        # YAML reads `device: 0` and `dtype: 16` as numbers: the same error, not an AttributeError on .strip()
        ({"device": 0}, "field 'runtime.device': expected auto, cpu, cuda or cuda:N \\(N from 0 to 127\\), got 0$"),
        ({"dtype": 16}, "field 'runtime.dtype': expected float32 \\| bfloat16 \\| float16, got 16$"),
        ({"session_capacity": 0}, "field 'runtime.session_capacity': expected a positive integer up to 2147483647, "
                                  "got 0"),
        ({"session_capacity": 10**400}, "field 'runtime.session_capacity': expected a positive integer up to "
                                        "2147483647, got 1000000000000000000000000000...00000000000000000000000000000"),
        ({"gpu_memory_fraction": 1.5}, "field 'runtime.gpu_memory_fraction': expected a number in \\(0, 1\\]"),
        ({"memory_budget": "lots"}, "field 'runtime.memory_budget': expected a byte size"),
        ({"num_threads": 0}, "field 'runtime.num_threads': expected a positive integer"),
        ({"attention_backend": "triton"}, "field 'runtime.attention_backend': expected auto \\| torch \\| vllm"),
        ({"sesion_capacity": 2}, "unknown key 'runtime.sesion_capacity' \\(did you mean 'session_capacity'\\?\\)"),
    ],
)
def test_runtime_values_are_validated(runtime, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"pipeline": "causal_world", "model": {"preset": "tiny"}, "runtime": runtime})


def test_overrides_apply_over_the_file():
    cfg = load_config("causal-world-tiny").with_runtime(session_capacity=5, memory_budget="64MiB", dtype=None)
    assert cfg.runtime.session_capacity == 5 and cfg.runtime.memory_budget == 64 << 20
    assert cfg.runtime.dtype == "float32"  # None keeps the file's value


def test_num_threads_is_applied_at_load():
    before = torch.get_num_threads()
    try:
        engine = ARDiffusionEngine.from_config("causal-world-tiny", memory_budget="64MiB", num_threads=1)
        engine.load()
        assert torch.get_num_threads() == 1
        assert engine.runner.capacity_plan.session_capacity == 2
    finally:
        torch.set_num_threads(before)


def test_the_memory_fraction_and_attention_backend_settings_are_what_load_plans_and_runs_with():
    """runtime.gpu_memory_fraction sizes the pools (the plan's budget and the sessions it admits) and
    runtime.attention_backend picks the kernel: load() passing neither on would plan 0.9 of the memory and run
    ``auto``'s choice whatever the config or --attention-backend said."""
    events: list = []
    engine = ARDiffusionEngine.from_config("causal-world-tiny", memory_budget="64MiB", gpu_memory_fraction=0.25,
                                           attention_backend="torch")
    engine.subscribe(events.append)
    plan = engine.load()
    try:
        assert plan.gpu_memory_fraction == 0.25 and plan.available_bytes == 64 << 20
        assert plan.budget_bytes == max(int((64 << 20) * 0.25), plan.fixed_bytes + plan.bytes_per_session)
        (planned,) = [e for e in events if e.kind == "capacity_planned"]
        assert planned.attention_backend == "torch" and planned.attention_detail.startswith("requested;")
    finally:
        engine.close()


def test_an_empty_or_null_model_or_runtime_section_means_the_defaults(tmp_path):
    """`model:` left empty (YAML's null) is the pipeline's defaults, as no `model:` at all; `model: []` or
    `runtime: false` are refused (test_reliability_input.py)."""
    defaults = load_config({"pipeline": "causal_world"})
    for text in ("pipeline: causal_world\nmodel:\nruntime:\n", "pipeline: causal_world\nmodel: null\nruntime: ~\n"):
        path = tmp_path / "config.yaml"
        path.write_text(text)
        config = load_config(path)
        assert (config.model, config.runtime) == (defaults.model, defaults.runtime), text


def test_numpy_integers_are_accepted_where_integers_are_and_bools_and_fractions_are_not():
    """A budget or capacity computed with numpy (np.int64) used to be refused: 'expected a byte size', 'expected a
    positive integer'. Any integer but a bool is taken, as a plain int (the plan goes to JSON output)."""
    engine = ARDiffusionEngine.from_config("causal-world-tiny", memory_budget=np.int64(64 << 20),
                                           session_capacity=np.int64(1), num_threads=np.int32(1))
    plan = engine.load()
    assert (plan.available_bytes, plan.session_capacity) == (64 << 20, 1)
    assert type(engine.config.runtime.memory_budget) is int and type(plan.session_capacity) is int
    json.dumps(plan.to_dict())
    spec = engine.config.kv_cache_spec()
    assert plan_capacity(spec, "float32", 64 << 20, session_capacity=np.uint8(1)).session_capacity == 1
    config = load_config("causal-world-tiny")
    for bad in (True, np.bool_(True), np.float64(2.0), float("nan")):
        with pytest.raises(ConfigError, match="field 'runtime.session_capacity': expected a positive integer"):
            config.with_runtime(session_capacity=bad)
        with pytest.raises(ConfigError, match="session_capacity must be a positive integer"):
            plan_capacity(spec, "float32", 64 << 20, session_capacity=bad)
    for bad in (True, np.bool_(True), 1.5, np.float64(1.5), float("nan"), np.int64(0)):
        with pytest.raises(ConfigError, match="field 'runtime.memory_budget': expected a byte size"):
            config.with_runtime(memory_budget=bad)


def test_numpy_numbers_are_accepted_as_the_gpu_memory_fraction_and_stored_as_a_float():
    """np.float32(0.5) and np.int64(1) used to be refused ('expected a number in (0, 1]') while np.float64 passed
    (a float subclass). Any real number but a bool is taken, as a plain float (the plan goes to JSON output)."""
    config = load_config("causal-world-tiny")
    spec = config.kv_cache_spec()
    for given, expected in ((np.float32(0.5), 0.5), (np.int64(1), 1.0), (np.float16(0.25), 0.25), (1, 1.0)):
        runtime = config.with_runtime(gpu_memory_fraction=given).runtime
        assert type(runtime.gpu_memory_fraction) is float and runtime.gpu_memory_fraction == expected
        from_dict = load_config({"pipeline": "causal_world", "runtime": {"gpu_memory_fraction": given}}).runtime
        assert type(from_dict.gpu_memory_fraction) is float and from_dict.gpu_memory_fraction == expected
        plan = plan_capacity(spec, "float32", 64 << 20, given)
        assert type(plan.gpu_memory_fraction) is float and plan.gpu_memory_fraction == expected
        json.dumps(plan.to_dict())
    for bad in (True, np.bool_(True), np.float32("nan"), np.float64("inf"), np.int64(0), np.float32(1.5), 10**400,
                "0.5"):
        with pytest.raises(ConfigError, match="field 'runtime.gpu_memory_fraction': expected a number in"):
            config.with_runtime(gpu_memory_fraction=bad)
        with pytest.raises(ConfigError, match="gpu_memory_fraction must be in"):
            plan_capacity(spec, "float32", 64 << 20, bad)


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("session_capacity", torch.tensor(2), 2),
    ("session_capacity", np.array(2), 2),
    ("num_threads", torch.tensor(1, dtype=torch.int32), 1),
    ("memory_budget", torch.tensor(64 << 20), 64 << 20),
    ("gpu_memory_fraction", torch.tensor(0.5), 0.5),
    ("gpu_memory_fraction", np.array(0.25, dtype=np.float32), 0.25),
], ids=["session_capacity_tensor", "session_capacity_numpy_0d", "num_threads_int32", "memory_budget",
        "gpu_memory_fraction_tensor", "gpu_memory_fraction_numpy_0d"])
def test_a_runtime_setting_given_as_a_0d_tensor_is_the_number_it_holds(key, value, expected):
    """``from_config(session_capacity=...)`` took numpy's numbers but refused a 0-d tensor or numpy array
    ('expected a positive integer, got tensor(2)'): each is the plain number it holds, as a Config's fields are."""
    runtime = load_config("causal-world-tiny").with_runtime(**{key: value}).runtime
    assert getattr(runtime, key) == expected and type(getattr(runtime, key)) is type(expected)


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("session_capacity", torch.tensor(2.0), "a positive integer"),  # as 2.0 is
    ("session_capacity", torch.tensor([2]), "a positive integer"),
    ("num_threads", torch.tensor(True), "a positive integer"),
    ("memory_budget", torch.tensor(1.5), "a byte size"),
    ("gpu_memory_fraction", torch.tensor([0.5]), "a number in"),
], ids=["float_tensor_for_int", "tensor_1d", "bool_tensor", "fraction_tensor_for_bytes", "tensor_1d_fraction"])
def test_a_runtime_setting_given_as_a_tensor_that_holds_no_such_number_is_refused(key, value, expected):
    with pytest.raises(ConfigError, match=rf"field 'runtime.{key}': expected {expected}.*, got tensor"):
        load_config("causal-world-tiny").with_runtime(**{key: value})


@pytest.mark.parametrize(("key", "value"), [("session_capacity", np.timedelta64(2, "ns")),
                                            ("memory_budget", np.timedelta64(64 << 20, "ns")),
                                            ("num_threads", np.datetime64(1, "ns")),
                                            ("gpu_memory_fraction", np.timedelta64(1, "ns"))])
def test_a_runtime_setting_given_as_a_numpy_time_is_refused(key, value):
    """A nanosecond numpy time's ``.item()`` is a plain int: it was taken as that number (``session_capacity`` 2)."""
    with pytest.raises(ConfigError, match=rf"field 'runtime.{key}': expected .*, got np\.(timedelta|datetime)64"):
        load_config("causal-world-tiny").with_runtime(**{key: value})


def test_public_surface_resolves_lazily():
    import subprocess
    import sys

    import ardiff_cli.runtime as runtime

    assert all(hasattr(runtime, name) for name in runtime.__all__)
    assert not hasattr(runtime, "ARDiffusionEngin")  # a misspelt name: AttributeError, as for any module
    with pytest.raises(ImportError, match="cannot import name 'ARDiffusionEngin' from 'ardiff_cli.runtime'"):
        exec("from ardiff_cli.runtime import ARDiffusionEngin", {})
    for name in ("ARDiffusionEngine", "ARDiffusionModelRunner", "ARDiffusionKVState", "plan_capacity",
                 "SessionEvicted", "ARDiffusionRequest"):
        assert name in runtime.__all__
    code = ("import sys; from ardiff_cli.runtime import plan_capacity, load_config, ARDiffusionKVCacheSpec; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_runtime_key_is_refused_even_when_null():
    """`runtime: {sesion_capacity: null}` was skipped as 'keep the default' instead of named as a typo."""
    with pytest.raises(ConfigError, match="unknown key 'runtime.sesion_capacity' \\(did you mean 'session_capacity'"):
        load_config({"pipeline": "causal_world", "model": {"preset": "tiny"}, "runtime": {"sesion_capacity": None}})


def test_a_config_of_exactly_the_size_limit_loads_and_one_byte_more_is_refused(tmp_path):
    head = "pipeline: causal_world\nmodel: {preset: tiny}\n#"
    config = tmp_path / "padded.yaml"
    config.write_text(head + "x" * (MAX_CONFIG_BYTES - len(head) - 1) + "\n")
    assert config.stat().st_size == MAX_CONFIG_BYTES
    assert load_config(config).pipeline_name == "causal_world"
    config.write_text(head + "x" * (MAX_CONFIG_BYTES - len(head)) + "\n")
    with pytest.raises(ConfigError, match="more than 64 KiB"):
        load_config(config)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "torch.float8_e5m2"])
def test_a_kv_only_dtype_is_refused_as_the_model_dtype(dtype):
    """float8 is a KV cache dtype the planner knows, not one a model runs in."""
    expected = f"field 'runtime.dtype': expected float32 \\| bfloat16 \\| float16, got '{dtype}'"
    with pytest.raises(ConfigError, match=expected):
        load_config({"pipeline": "causal_world", "model": {"preset": "tiny"}, "runtime": {"dtype": dtype}})


def test_runtime_overrides_take_torch_dtypes_and_devices():
    """from_config(..., dtype=torch.bfloat16) was refused as "expected float32 | bfloat16 | float16, got
    torch.bfloat16", and device=torch.device('cpu') as "expected auto, cpu, cuda or cuda:N"; numpy's numbers were
    taken already."""
    import torch

    cfg = load_config("causal-world-tiny").with_runtime(dtype=torch.bfloat16, device=torch.device("cpu"))
    assert (cfg.runtime.dtype, cfg.runtime.device) == ("bfloat16", "cpu")
    assert load_config("causal-world-tiny").with_runtime(device=torch.device("cuda", 1)).runtime.device == "cuda:1"
    assert load_config("causal-world-tiny").with_runtime(device=torch.device("cpu", 0)).runtime.device == "cpu"
    with pytest.raises(ConfigError, match="field 'runtime.dtype': expected float32 \\| bfloat16 \\| float16, got "
                                          "torch.float64"):
        load_config("causal-world-tiny").with_runtime(dtype=torch.float64)


@pytest.mark.parametrize("config_pipeline", ["causal_world", None])
def test_a_model_error_blames_pipeline_only_when_the_config_names_another(config_pipeline):
    """--pipeline naming the config's own pipeline (or a config without `pipeline:`) is no mismatch to hint at."""
    data = {"model": {"preset": "no-such-preset"}}
    if config_pipeline:
        data["pipeline"] = config_pipeline
    with pytest.raises(ConfigError) as caught:
        load_config(data, pipeline="causal_world")
    assert "the config is for pipeline" not in (caught.value.hint or "")
    with pytest.raises(ConfigError) as caught:
        load_config({"pipeline": "dreamzero", "model": {"preset": "no-such-preset"}}, pipeline="causal_world")
    assert "the config is for pipeline 'dreamzero', but --pipeline causal_world" in caught.value.hint


def test_the_largest_device_index_and_thread_count_a_config_may_name_are_taken():
    """The limits the messages state (cuda:N with N up to 127, num_threads up to 1024) are themselves valid: a
    config naming the 128th GPU or 1024 threads loads, as the refusals 'from 0 to 127' and 'up to 1024' promise."""
    cfg = load_config({"pipeline": "causal_world", "model": {"preset": "tiny"},
                       "runtime": {"device": "cuda:127", "num_threads": 1024}})
    assert (cfg.runtime.device, cfg.runtime.num_threads) == ("cuda:127", 1024)


def test_a_checkpoint_under_the_home_folder_may_be_written_with_a_tilde(tmp_path, monkeypatch):
    """`checkpoint: ~/weights.safetensors` is the home folder's file, not a folder named `~` next to the config."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "weights.safetensors").write_bytes(b"\x00" * 8)
    config = tmp_path / "configs" / "c.yaml"
    config.parent.mkdir()
    config.write_text("pipeline: causal_world\nmodel: {preset: tiny}\ncheckpoint: ~/weights.safetensors\n")
    assert load_config(config).checkpoint == tmp_path / "home" / "weights.safetensors"


def test_a_relative_checkpoint_not_found_says_it_is_read_from_the_config_files_folder(tmp_path, monkeypatch):
    """`checkpoint: weights/w.safetensors` written from the folder the user runs in, or in a config reached through
    a link from another folder, was only "file not found": the hint now says which folder a relative path is read
    from. An absolute path needs no such note."""
    (tmp_path / "run" / "weights").mkdir(parents=True)
    (tmp_path / "run" / "weights" / "w.safetensors").write_bytes(b"\x00" * 8)
    config = tmp_path / "configs" / "c.yaml"
    config.parent.mkdir()
    config.write_text("pipeline: causal_world\nmodel: {preset: tiny}\ncheckpoint: weights/w.safetensors\n")
    monkeypatch.chdir(tmp_path / "run")
    with pytest.raises(ConfigError, match="'checkpoint': file not found: .*/configs/weights/w.safetensors$") as err:
        load_config(config)
    assert err.value.hint.startswith(f"a relative checkpoint path is read from the config file's folder, "
                                     f"{config.parent.resolve()}; give the .safetensors file's path"), err.value.hint
    config.write_text(f"pipeline: causal_world\ncheckpoint: {tmp_path}/nowhere.safetensors\n")
    with pytest.raises(ConfigError, match="file not found") as err:
        load_config(config)
    assert err.value.hint.startswith("give the .safetensors file's path"), err.value.hint


def test_a_checkpoint_that_is_a_link_to_nothing_is_named_as_such(tmp_path):
    """A checkpoint linked to a disk not mounted was "file not found" while `ls` lists it: as for CONFIG, the error
    says it is a link and to what."""
    (tmp_path / "w.safetensors").symlink_to(tmp_path / "mnt" / "weights.safetensors")
    config = tmp_path / "c.yaml"
    config.write_text("pipeline: causal_world\ncheckpoint: w.safetensors\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert str(err.value) == (f"{config}: field 'checkpoint': {tmp_path}/w.safetensors is a link to "
                              f"{tmp_path}/mnt/weights.safetensors, which does not exist")
    assert err.value.hint.startswith("mount or restore what it links to"), err.value.hint


@pytest.mark.parametrize(("line", "message"), [
    ("pipeline: ''", "field 'pipeline': expected a registered pipeline name, got ''"),
    # Path('') is the config's own folder: it was "field 'checkpoint': a folder, not a file: <the config's folder>"
    ("pipeline: causal_world\ncheckpoint: ''", "field 'checkpoint': expected a .safetensors path or null, got ''"),
])
def test_an_empty_pipeline_or_checkpoint_is_named_as_empty(tmp_path, line, message):
    config = tmp_path / "c.yaml"
    config.write_text(f"{line}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert str(caught.value) == f"{config}: {message}"


def test_a_key_given_twice_in_a_list_deep_in_the_config_is_named_by_its_whole_path(tmp_path):
    """A mapping inside a list is checked too, and the key is named from the top with the item's index
    (model.cameras[0].name), so the user finds the line; YAML would keep the second value silently."""
    config = tmp_path / "c.yaml"
    config.write_text("pipeline: causal_world\nmodel:\n  cameras:\n    - {name: a, name: b}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert str(caught.value) == (f"{config}: key 'model.cameras[0].name' is given twice (line 4, columns 8 and 17); "
                                 "YAML would keep the second silently")


def test_a_config_path_through_a_file_is_not_found(tmp_path):
    """`c.yaml/x.yaml` (a file taken for a folder, ENOTDIR) is a config not found, as a missing path is, not
    'cannot look at' it."""
    (tmp_path / "c.yaml").write_text("pipeline: causal_world\n")
    with pytest.raises(ConfigError, match="^config file not found: .*/c.yaml/x.yaml$"):
        resolve_config(tmp_path / "c.yaml" / "x.yaml")


def test_a_model_setting_at_the_top_of_a_config_without_a_pipeline_is_placed_by_the_pipeline_option():
    """A config may leave `pipeline:` out when --pipeline names it: `preset: tiny` at the top is still recognised
    as a setting of that pipeline's model section, as it is when the config names its pipeline."""
    with pytest.raises(ConfigError, match="^<dict>: unknown key 'preset' \\(did you mean 'model.preset'\\? the "
                                          "pipeline's settings go under `model:`\\)$"):
        load_config({"preset": "tiny"}, pipeline="causal_world")


@pytest.mark.parametrize(("pipeline", "key", "meant"), [
    ("dreamzero", "layers", "model.num_layers"),  # as `model: {layers: 8}` says 'num_layers'
    ("causal_world", "layers", "model.num_layers"),
    ("dreamzero", "steps", "model.num_inference_steps"),
    ("dreamzero", "num_thread", "runtime.num_threads"),  # a typo of a runtime setting: its own section
    ("dreamzero", "modle", "model"),  # a top-level key mistyped stays one
])
def test_a_top_level_key_close_to_a_model_or_runtime_key_is_offered_it_with_its_section(pipeline, key, meant):
    """`layers: 8` at the top of a config got no suggestion, where `model: {layers: 8}` is offered 'num_layers': the
    top level only looked for the key as it is spelt under model: or runtime:."""
    settings = "the pipeline's settings go under `model:`" if meant.startswith("model.") else \
        "runtime settings go under `runtime:`"
    said = f"did you mean {meant!r}?" + ("" if "." not in meant else f" {settings}")
    with pytest.raises(ConfigError) as caught:
        load_config({"pipeline": pipeline, key: 8})
    assert str(caught.value) == f"<dict>: unknown key {key!r} ({said})"


def top_level_suggestion(pipeline: str, key: str, value: object) -> str | None:
    """What a config of ``pipeline`` with ``key: value`` at its top is offered, or None."""
    with pytest.raises(ConfigError) as caught:
        load_config({"pipeline": pipeline, key: value})
    found = re.search(r"^<dict>: unknown key '[^']*' \(did you mean '([^']+)'\?", str(caught.value))
    return found and found.group(1)


@pytest.mark.parametrize(("pipeline", "key", "value", "meant"), [
    ("causal_world", "reset", True, None),  # 'model.preset', a name, a first letter off: a word of its own
    ("dreamzero", "reset", True, "model.reset_at_window"),  # its first word (`at` joins the rest)
    ("causal_world", "budget", -1, "runtime.memory_budget"),  # its words: named whatever the value (its error next)
    ("causal_world", "threads", 0, "runtime.num_threads"),
    ("causal_world", "type", "causal_world", None),  # no dtype: a pipeline's name
    ("causal_world", "type", "bfloat16", "runtime.dtype"),
    ("causal_world", "gpu", 0.5, None),  # 'runtime.gpu_memory_fraction': one qualifying word of three (a device?)
    ("causal_world", "fraction", 0.5, "runtime.gpu_memory_fraction"),  # its last word
    ("causal_world", "gpu_fraction", 0.5, "runtime.gpu_memory_fraction"),
    ("causal_world", "memory", "16GiB", "runtime.memory_budget"),  # all its words but one
    ("causal_world", "model_path", "w.safetensors", None),  # a path: no model: section
    ("causal_world", "model_name", "tiny", None),
    ("causal_world", "model_type", "causal_world", None),
    ("causal_world", "checkpoint_path", "w.safetensors", "checkpoint"),
    ("causal_world", "pipeline_name", "causal_world", "pipeline"),
    ("causal_world", "runtme", {"dtype": "bfloat16"}, "runtime"),  # a typo of a top-level key: whatever its value
    ("causal_world", "modle", 8, "model"),
    ("causal_world", "untime", {"dtype": "bfloat16"}, "runtime"),
    ("causal_world", "evice", "cuda", "runtime.device"),
    ("causal_world", "sed", 3, "model.seed"),
])
def test_a_top_level_key_is_offered_only_what_its_words_and_value_say_was_meant(pipeline, key, value, meant):
    """`reset: true` at the top of a causal_world config was offered 'model.preset' (a name, where reset is a word of
    its own a letter off it), `gpu: 0.5` 'runtime.gpu_memory_fraction' (a GPU may be the device) and `model_path:
    w.safetensors` 'model' (a section, where a path is the checkpoint): a wrong suggestion misleads where none
    leaves the list of valid keys. A one-letter typo keeps its suggestion."""
    assert top_level_suggestion(pipeline, key, value) == meant


def section_suggestion(pipeline: str, section: str, key: str, value: object) -> str | None:
    """What a config of ``pipeline`` with ``key: value`` under ``section`` is offered, or None."""
    with pytest.raises(ConfigError) as caught:
        load_config({"pipeline": pipeline, section: {key: value}})
    found = re.fullmatch(rf"<dict>: unknown key '{section}\.[^']*'(?: \(did you mean '([^']+)'\?\))?",
                         str(caught.value))
    assert found, caught.value
    return found.group(1)


@pytest.mark.parametrize(("pipeline", "section", "key", "value", "meant"), [
    ("causal_world", "model", "reset", True, None),  # 'preset', a name, a first letter off: a word of its own
    ("dreamzero", "model", "reset", True, "reset_at_window"),  # its first word (`at` joins the rest)
    ("causal_world", "model", "prest", "tiny", "preset"),  # a typo that takes the value
    ("causal_world", "model", "windw_frames", 6, "window_frames"),
    ("causal_world", "model", "page_size", 2, None),  # merely close to 'patch_size'
    ("dreamzero", "model", "page_size", 2, None),  # two letters off 'image_size'
    ("dreamzero", "model", "hidden_size", 2, None),
    ("causal_world", "model", "steps_per_block", 2, None),  # not 'frames_per_block'
    ("dreamzero", "model", "timesteps", [1000, 750, 500, 250], None),  # no 'timestep_shift': a shift is a number
    ("dreamzero", "model", "timesteps", 4, None),  # nor a count: a word a letter off 'timestep', not its last
    ("dreamzero", "model", "model_path", "w.safetensors", None),  # no 'image_patch'
    ("dreamzero", "model", "neg_prompt", "blurry", "negative_prompt"),  # a word's beginning, with a value it takes
    ("dreamzero", "model", "layer", 2, "num_layers"),  # its last word a letter off, with a value it takes
    ("dreamzero", "model", "layer", "two", None),
    ("causal_world", "model", "time_shift", 5.0, "timestep_shift"),
    ("causal_world", "runtime", "gpu", 0.5, None),  # 'gpu_memory_fraction': one qualifying word of three (a device?)
    ("causal_world", "runtime", "fraction", 0.5, "gpu_memory_fraction"),  # its last word
    ("causal_world", "runtime", "mem_fraction", 0.5, "gpu_memory_fraction"),  # a word's beginning, and its last
    ("causal_world", "runtime", "budget", -1, "memory_budget"),  # its words: named whatever the value (its error next)
    ("causal_world", "runtime", "sessions", 2, None),  # 'session_capacity': a word a letter off, not its last
    ("causal_world", "runtime", "thread", 2, "num_threads"),
    ("causal_world", "runtime", "evice", "cuda", "device"),
    ("causal_world", "runtime", "dtyp", "bfloat16", "dtype"),
])
def test_a_key_in_a_section_is_offered_only_what_its_words_and_value_say_was_meant(pipeline, section, key, value,
                                                                                    meant):
    """Under model: and runtime:, as at the top level: `model: {reset: true}` of a causal_world config was offered
    'preset' (a name), `runtime: {gpu: 0.5}` 'gpu_memory_fraction' (a GPU may be the device), `page_size` 'patch_size'
    and `timesteps: [...]` 'timestep_shift', each merely close. A one-letter typo keeps its suggestion, as does a key
    holding the words of one, or its words a letter off (`layer`) or their beginnings (`neg_prompt`), its last among
    them, with a value the key takes."""
    assert section_suggestion(pipeline, section, key, value) == meant


@pytest.mark.parametrize(("key", "meant"), [("gpu", ""), ("num_thread", " (did you mean 'num_threads'?)")])
def test_a_runtime_override_of_no_setting_is_offered_what_a_config_key_is(key, meant):
    """A Python caller's runtime override (`from_config(..., gpu=0.5)`) is looked for as a key under runtime: is."""
    with pytest.raises(ConfigError) as caught:
        RuntimeConfig().with_overrides(**{key: 0.5 if key == "gpu" else 2})
    assert str(caught.value) == f"command line: unknown key 'runtime.{key}'{meant}"


@pytest.mark.parametrize(("pipeline", "key"), [
    ("dreamzero", "page_size"),  # the KV page: two letters off 'image_size'
    ("causal_world", "page_size"),  # merely close to 'patch_size'
    ("dreamzero", "block_size"),
    ("dreamzero", "hidden_size"),  # not 'image_size'
    ("dreamzero", "timesteps"),  # not 'timestep_shift' (a letter past a word of it)
    ("causal_world", "frames_per_request"),  # dreamzero's, not causal_world's 'frames_per_block'
    ("dreamzero", "stride"),  # 'vae_stride' or 'temporal_stride': one of two is a guess
])
def test_a_top_level_key_merely_close_to_a_model_key_is_offered_none(pipeline, key):
    """A key at the top of a config is offered a model or runtime key only where it is a typo of it or each of its
    words is one of it: one merely close to it is more likely something else, and a wrong suggestion misleads."""
    with pytest.raises(ConfigError) as caught:
        load_config({"pipeline": pipeline, key: 8})
    assert str(caught.value) == f"<dict>: unknown key {key!r}"


@pytest.mark.parametrize("pipeline", ["dreamzero", "causal_world"])
@pytest.mark.parametrize("section", ["top", "runtime"])
def test_a_class_variable_of_the_model_config_is_never_offered_as_a_model_key(pipeline, section):
    """A model config's ClassVar (``WEIGHT_FIELDS``) is in its ``__dataclass_fields__`` but no key of model:. Written
    at the top or under runtime:, it was told "did you mean 'model.WEIGHT_FIELDS'?", which model: then refused."""
    data = {"pipeline": pipeline, **({"WEIGHT_FIELDS": 1} if section == "top" else {"runtime": {"WEIGHT_FIELDS": 1}})}
    with pytest.raises(ConfigError) as caught:
        load_config(data)
    assert "unknown key" in str(caught.value)
    assert "model." not in str(caught.value)
    with pytest.raises(ConfigError, match="unknown key 'model.WEIGHT_FIELDS'"):  # what model: says of it
        load_config({"pipeline": pipeline, "model": {"WEIGHT_FIELDS": 1}})


def test_a_model_error_under_a_pipeline_class_does_not_blame_a_config_naming_an_unregistered_pipeline():
    """README, 'Adding a pipeline': a config saying `pipeline: my_world` is tried before packaging with
    `--pipeline my_lab.models:MyPipeline`. A mistake in its model: section said "the config is for pipeline
    'my_world' ...: drop --pipeline", and dropping it fails with "unknown pipeline 'my_world'"."""
    reference = "pipelines.causal_world.pipeline:CausalWorldPipeline"
    with pytest.raises(ConfigError) as caught:
        load_config({"pipeline": "my_world", "model": {"preset": "no-such-preset"}}, pipeline=reference)
    assert "field 'model.preset'" in str(caught.value)
    assert "the config is for pipeline" not in (caught.value.hint or "")
    with pytest.raises(ConfigError) as caught:
        load_config({"pipeline": "dreamzero", "model": {"preset": "no-such-preset"}}, pipeline=reference)
    assert f"the config is for pipeline 'dreamzero', but --pipeline {reference}" in caught.value.hint


@pytest.mark.parametrize(("line", "message"), [
    ("model: {preset: tiny, window_frames: 010}",
     "field 'model.window_frames' (line 2): 010 is read as 8: YAML 1.1 takes it as octal"),
    ("runtime: {memory_budget: 0100000000}", "field 'runtime.memory_budget' (line 2): 0100000000 is read as 16777216"),
    ("model: {preset: tiny, window_frames: 1:30}", "field 'model.window_frames' (line 2): 1:30 is read as 90: YAML 1.1 "
                                                   "takes it as base 60"),
    ("model: {preset: tiny, guidance_scale: 1:30.5}", "field 'model.guidance_scale' (line 2): 1:30.5 is read as 90.5"),
    ("model: {preset: tiny, 010: 3}", "key 'model.010' (line 2): 010 is read as 8"),
    # an alias repeats the node: named where its anchor writes it, the line given ('model.sink_frames' was named)
    ("model:\n  window_frames: &w 010\n  sink_frames: *w", "field 'model.window_frames' (line 3): 010 is read as 8"),
    ("model: {window_frames: &w 010}\nruntime: {<<: {num_threads: *w}}",
     "field 'model.window_frames' (line 2): 010 is read as 8"),
])
def test_a_number_yaml_1_1_reads_otherwise_than_it_is_written_is_refused(tmp_path, line, message):
    """PyYAML's YAML 1.1 made `window_frames: 010` 8 and `1:30` 90, silently: the model planned another window."""
    config = tmp_path / "c.yaml"
    config.write_text(f"pipeline: dreamzero\n{line}\n")
    with pytest.raises(ConfigError) as info:
        load_config(config)
    assert str(info.value).startswith(f"{config}: {message}")
    assert "in quotes for text" in info.value.hint


@pytest.mark.parametrize(("line", "field", "value"), [
    ("window_frames: 07", "window_frames", 7), ("window_frames: 0x4", "window_frames", 4),
    ("window_frames: 1_0", "window_frames", 10), ("guidance_scale: 1.0e+1", "guidance_scale", 10.0),
    ("guidance_scale: 010.5", "guidance_scale", 10.5), ("reset_at_window: off", "reset_at_window", False),
])
def test_numbers_yaml_1_1_reads_as_written_and_booleans_in_boolean_fields_load(tmp_path, line, field, value):
    config = tmp_path / "c.yaml"
    config.write_text(f"pipeline: dreamzero\nmodel:\n  preset: tiny\n  {line}\n")
    assert getattr(load_config(config).model, field) == value


def test_a_boolean_where_none_is_expected_says_how_yaml_read_it(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("pipeline: dreamzero\nruntime: {attention_backend: off}\n")
    with pytest.raises(ConfigError, match="expected auto | torch | vllm, got False") as info:
        load_config(config)
    assert info.value.hint == ("set 'runtime.attention_backend' to auto | torch | vllm; YAML 1.1 reads no, off or "
                               "false unquoted as false (quote a word meant as text)")


def test_default_checkpoints_are_built_in_a_cache_of_the_tests_own(tmp_path_factory):
    """This module's from_config("causal-world-tiny") built its default checkpoint in ~/.cache/ardiff (or the shell's
    $ARDIFF_CACHE_DIR): it never asked for ``ardiff_cache``, and once that fixture was module-scoped, no earlier
    module's cache was left set for it either."""
    from ardiff_cli.io.demo import cache_dir

    assert cache_dir().is_relative_to(tmp_path_factory.getbasetemp()), cache_dir()
