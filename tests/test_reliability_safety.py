"""Safety: nothing is unpickled, names that reach file names are sanitised, only the command line imports code."""

from __future__ import annotations

import ast
import json
import os
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ardiff_cli.app import app
from ardiff_cli.io import write_episode
from ardiff_cli.io.demo import demo_step
from ardiff_cli.io.episode import MAX_NAME_BYTES, MAX_NAME_CHARS, discover_episodes, safe_name
from ardiff_cli.io.run import RunFolder
from ardiff_cli.runtime import registry
from ardiff_cli.runtime.config import load_config
from ardiff_cli.runtime.errors import ArdiffWarning, ConfigError, PipelineError

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("ardiff_cli", "pipelines")  # what users install; tests and benchmarks are not shipped
runner = CliRunner()

# -- nothing is unpickled -------------------------------------------------------------------------------------

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
UNSAFE_CALLS = {  # (module alias, attribute) -> why
    ("torch", "load"): "torch.load unpickles",
    ("jit", "load"): "torch.jit.load unpickles",
    ("yaml", "load"): "yaml.load constructs arbitrary objects; use yaml.safe_load",
    ("yaml", "unsafe_load"): "yaml.unsafe_load",
    ("yaml", "full_load"): "yaml.full_load",
    ("yaml", "load_all"): "yaml.load_all; use yaml.safe_load_all",
}
DYNAMIC_IMPORT_ALLOWED = {
    "ardiff_cli/runtime/registry.py",  # the one place that imports a name from outside (config, --pipeline)
    "ardiff_cli/runtime/__init__.py",  # lazy exports: its own submodules, names fixed in the file
    "ardiff_cli/runtime/kv/backends.py",  # vLLM's helper, at module paths fixed in the file
}


def unsafe_uses(source: str, filename: str) -> list[str]:
    """Every unsafe deserialisation or dynamic import in ``source``, as 'file:line: why'."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: imports {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where}: imports from {node.module}")
        elif isinstance(node, ast.Call):
            func = node.func
            keywords = {k.arg: k.value for k in node.keywords}
            allow = keywords.get("allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append(f"{where}: allow_pickle other than False")
            if isinstance(func, ast.Name) and func.id in ("eval", "exec", "__import__"):
                found.append(f"{where}: {func.id}()")
            if isinstance(func, ast.Attribute):
                owner = func.value.attr if isinstance(func.value, ast.Attribute) else getattr(func.value, "id", "")
                why = UNSAFE_CALLS.get((owner, func.attr))
                if why:
                    found.append(f"{where}: {why}")
                if owner in ("np", "numpy") and func.attr == "load" and allow is None:
                    found.append(f"{where}: np.load without allow_pickle=False")
                if func.attr == "import_module" and filename not in DYNAMIC_IMPORT_ALLOWED:
                    found.append(f"{where}: importlib.import_module outside the registry")
            if isinstance(func, ast.Name) and func.id == "import_module" and filename not in DYNAMIC_IMPORT_ALLOWED:
                found.append(f"{where}: import_module outside the registry")
    return found


def test_the_scanner_finds_what_it_looks_for():
    bad = """
import pickle
from dill import loads
import joblib, marshal, shelve
import torch, yaml, numpy as np, importlib
torch.load("x.pt")
yaml.load(text)
np.load("a.npz")
np.load("a.npz", allow_pickle=True)
eval("1")
exec("x = 1")
importlib.import_module("os")
"""
    found = unsafe_uses(bad, "example.py")
    assert [line.split(": ", 1)[1] for line in found] == [
        "imports pickle", "imports from dill", "imports joblib", "imports marshal", "imports shelve",
        "torch.load unpickles", "yaml.load constructs arbitrary objects; use yaml.safe_load",
        "np.load without allow_pickle=False", "allow_pickle other than False", "eval()", "exec()",
        "importlib.import_module outside the registry"], found
    assert not unsafe_uses("np.load(p, allow_pickle=False)\nyaml.safe_load(t)\nsafetensors.torch.load_file(p)\n",
                           "ok.py")


def test_shipped_code_never_unpickles_or_imports_by_name():
    found = []
    files = [p for package in SHIPPED for p in sorted((REPO / package).rglob("*.py"))]
    assert len(files) > 20
    for path in files:
        found += unsafe_uses(path.read_text(), path.relative_to(REPO).as_posix())
    assert found == []


def test_an_npz_holding_an_object_array_is_refused_not_unpickled(tmp_path):
    from ardiff_cli.io.step_file import load_step
    from ardiff_cli.runtime.errors import ObservationError

    class Boom:
        def __reduce__(self):
            return (Path(tmp_path / "pwned").write_text, ("unpickled",))

    path = tmp_path / "step_000000.npz"
    np.savez(path, joint_position=np.array([Boom()], dtype=object))
    with pytest.raises(ObservationError, match="cannot read .npz without pickle"):
        load_step(path)
    assert not (tmp_path / "pwned").exists()


# -- names that reach file names ------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "expected"), [
    ("pick_cube", "pick_cube"),
    ("pick cube 2", "pick cube 2"),  # spaces are harmless
    ("機械腕", "機械腕"),
    ("..", "_."),
    (".", "_"),
    (".hidden", "_hidden"),
    ("../../etc/passwd", "_._.._etc_passwd"),
    ("/abs/path", "_abs_path"),
    ("C:\\evil", "C__evil"),
    ("arm\x1b[31m red\x1b[0m", "arm_[31m red_[0m"),  # no terminal escapes in logs either
    ("two\nlines\ttab\x00nul", "two_lines_tab_nul"),
    ("line\u2028paragraph\u2029end", "line_paragraph_end"),  # separators splitlines() splits at, as \n
    ("\u202eevil", "_evil"),  # bidi override (a format character)
    ("", "episode"),
    ("   ", "episode"),
])
def test_safe_name(name, expected):
    assert safe_name(name) == expected
    assert Path(expected).name == expected and expected not in (".", "..")


def test_safe_name_caps_the_length():
    assert len(safe_name("x" * 1000)) == MAX_NAME_CHARS
    cjk = safe_name("日" * 84)  # 252 bytes in UTF-8: its preview's temporary name would pass NAME_MAX
    assert cjk == "日" * 50 and len(cjk.encode()) == MAX_NAME_BYTES
    # characters that do not divide the cap evenly: cut to the last whole one within it, never a byte over
    assert safe_name("a" + "日" * 99) == "a" + "日" * 49  # 148 bytes: a 50th character would make 151
    assert safe_name("é" * 100) == "é" * 75  # 2-byte characters: exactly 150


def test_a_long_non_ascii_episode_name_gets_its_outputs_and_preview(tmp_path, monkeypatch):
    monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path / "cache"))
    steps = [demo_step(_schema(), (16, 16), 0, s, 1 if s == 0 else 4) for s in range(2)]
    write_episode(tmp_path / "data" / ("日" * 84), steps, prompt="p")
    config = tmp_path / "fast.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny, num_inference_steps: 1, guidance_scale: 1.0}\n"
                      "runtime: {device: cpu}\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["rollout", str(config), str(tmp_path / "data" / ("日" * 84)), "--out", str(out),
                                 "--no-warmup", "--preview", "--format", "plain"])
    assert result.exit_code == 0, result.stderr
    assert "warning" not in result.stderr  # the preview was written, not refused with ENAMETOOLONG
    assert (out / "previews" / ("日" * 50 + ".png")).is_file()


def test_discovered_names_are_safe_and_unique(tmp_path):
    steps = [demo_step(_schema(), (16, 16), 0, 0, 1)]
    for folder in ("a:b", "a_b", "evil\x1b]0;title\x07\nname", ".dot"):
        write_episode(tmp_path / "set" / folder, steps, prompt="p")
    names = [e.name for e in discover_episodes([tmp_path / "set"])]
    # ".dot" is a hidden folder inside a dataset folder: skipped; given explicitly it is an episode
    assert names == ["a_b", "a_b-2", "evil_]0;title__name"]
    assert [e.name for e in discover_episodes([tmp_path / "set" / ".dot"])] == ["_dot"]


def test_folders_whose_names_differ_only_in_case_or_normalisation_get_names_unique_in_both(tmp_path):
    """Pick/pick and a composed and a decomposed é were four names: on an output folder's case-insensitive file system
    (macOS, exFAT, a Windows share) two episodes wrote their steps, over each other's, into one episodes/ folder."""
    steps = [demo_step(_schema(), (16, 16), 0, 0, 1)]
    for folder in ("Pick", "pick", "caf\u00e9", "cafe\u0301"):
        write_episode(tmp_path / "set" / folder, steps, prompt="p")
    names = [e.name for e in discover_episodes([tmp_path / "set"])]
    assert names == ["Pick", "cafe\u0301", "caf\u00e9-2", "pick-2"]
    folded = {unicodedata.normalize("NFC", name).casefold() for name in names}
    assert len(folded) == len(names)


def test_folders_whose_names_differ_only_past_the_length_cap_get_safe_unique_names(tmp_path):
    """The second was named the capped name plus "-2": one character over the cap, it was refused as unsafe when its
    first output was written, and that episode failed "while writing its outputs"."""
    steps = [demo_step(_schema(), (16, 16), 0, 0, 1)]
    prefix = "pick_cube_" + "x" * (MAX_NAME_CHARS + 10)
    for end in ("0042", "0043", "0044"):
        write_episode(tmp_path / "set" / (prefix + end), steps, prompt="p")
    names = [e.name for e in discover_episodes([tmp_path / "set"])]
    assert names == [prefix[:MAX_NAME_CHARS], prefix[:MAX_NAME_CHARS - 2] + "-2", prefix[:MAX_NAME_CHARS - 2] + "-3"]
    assert all(safe_name(name) == name for name in names)
    run = RunFolder(tmp_path / "out")
    for name in names:  # what refused the second one
        run.step_output(name, 0)
        run.preview_path(name)


@pytest.mark.parametrize("name", ["../escape", "/abs", "a/b", "..", "line\nbreak", ""])
def test_run_folder_refuses_unsafe_names(tmp_path, name):
    run = RunFolder(tmp_path / "run")
    with pytest.raises(ValueError, match="unsafe episode name"):
        run.step_output(name, 0)
    with pytest.raises(ValueError, match="unsafe episode name"):
        run.preview_path(name)


def _schema():
    from pipelines.dreamzero import observation_schema

    return observation_schema()


def test_rollout_of_a_hostile_folder_name_writes_inside_out_only(tmp_path, monkeypatch):
    monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path / "cache"))
    hostile = "..\x1b[2J\x1b]0;owned\x07\nfake line"
    steps = [demo_step(_schema(), (16, 16), 0, s, 1 if s == 0 else 4) for s in range(2)]
    write_episode(tmp_path / "data" / hostile, steps, prompt="p")
    config = tmp_path / "fast.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny, num_inference_steps: 1, guidance_scale: 1.0}\n"
                      "runtime: {device: cpu}\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["rollout", str(config), str(tmp_path / "data" / hostile), "--out", str(out),
                                 "--no-warmup", "--preview", "--format", "plain"])
    assert result.exit_code == 0, result.stderr
    safe = safe_name(hostile)
    assert safe == "_._[2J_]0;owned__fake line"
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == sorted([
        ".lock", "run.json", "results.jsonl", "summary.json", f"episodes/{safe}/step_000000.safetensors",
        f"episodes/{safe}/step_000001.safetensors", f"previews/{safe}.png"])
    assert "\x1b" not in result.stdout + result.stderr
    assert {json.loads(line)["episode"] for line in (out / "results.jsonl").read_text().splitlines()} == {safe}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "data", "fast.yaml", "out"]
    # an --out holding an escape: the summary's outputs line printed it raw, on stdout
    other = tmp_path / "o\x1b[31mut"
    result = runner.invoke(app, ["rollout", str(config), str(tmp_path / "data" / hostile), "--out", str(other),
                                 "--no-warmup", "--format", "plain"])
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stdout + result.stderr and "o\\x1b[31mut (results.jsonl" in result.stdout
    # a long --out: the plain summary was wrapped at 120 columns, cutting the path in two
    deep = tmp_path / ("x" * 60) / ("y" * 70)
    result = runner.invoke(app, ["rollout", str(config), str(tmp_path / "data" / hostile), "--out", str(deep),
                                 "--no-warmup", "--format", "plain"])
    assert result.exit_code == 0, result.stderr
    assert f"\noutputs: {deep} (results.jsonl, summary.json, episodes/)\n" in result.stdout, result.stdout


@pytest.mark.parametrize("fmt", ["plain", "rich", "json"])
def test_a_newline_in_a_path_stays_inside_its_error_line(tmp_path, monkeypatch, fmt):
    """A folder name holding a newline cut the Error: line quoting its path in two (plain and rich), and what followed
    it was a line of its own: here a `hint:` that ardiff never wrote. A script reading `^Error:` lines got half the
    path. The newline is shown as \\x0a, as every other control character in a message is; JSON keeps it."""
    monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "1000")  # rich: no wrapping of the long line
    folder = tmp_path / "data" / "arm\nhint: nothing failed"
    write_episode(folder, [demo_step(_schema(), (16, 16), 0, 0, 1)], prompt="p")
    (folder / "step_000000.safetensors").write_bytes(b"junk")
    config = tmp_path / "fast.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny, num_inference_steps: 1, guidance_scale: 1.0}\n"
                      "runtime: {device: cpu}\n")
    result = runner.invoke(app, ["rollout", str(config), str(folder), "--out", str(tmp_path / "out"), "--no-warmup",
                                 "--format", fmt])
    assert result.exit_code == 2, result.stderr
    shown = str(folder).replace("\n", "\\x0a")
    assert f"Error: episode 'arm_hint_ nothing failed' failed: {shown}/step_000000.safetensors: cannot read " in (
        result.stderr), result.stderr
    assert "\nhint: nothing failed" not in result.stderr, result.stderr
    if fmt == "json":
        errors = [json.loads(line) for line in result.stdout.splitlines() if '"episode_failed"' in line]
        assert errors and errors[0]["message"].startswith(f"episode 'arm_hint_ nothing failed' failed: {folder}/")


# -- only the command line imports code -----------------------------------------------------------------------

@pytest.fixture
def evil_module(tmp_path, monkeypatch):
    """An importable module whose import leaves a trace."""
    trace = tmp_path / "imported"
    (tmp_path / "evil_pipeline_mod.py").write_text(
        f"from pathlib import Path\nPath({str(trace)!r}).write_text('yes')\n\nclass Evil:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "evil_pipeline_mod", raising=False)
    return trace


def test_a_config_cannot_import_code(tmp_path, evil_module):
    config = tmp_path / "c.yaml"
    config.write_text("pipeline: evil_pipeline_mod:Evil\n")
    with pytest.raises(ConfigError, match="is not a registered pipeline; a config names registered pipelines") as info:
        load_config(config)
    assert "--pipeline MODULE:CLASS" in info.value.hint
    assert not evil_module.exists() and "evil_pipeline_mod" not in sys.modules


def test_the_pipeline_option_imports_explicitly_and_checks_the_class(tmp_path, evil_module):
    with pytest.raises(ConfigError, match="'evil_pipeline_mod:Evil' is not a pipeline class: it lacks Config, "
                                          "observation_schema, from_config, forward") as info:
        load_config("dreamzero-tiny", pipeline="evil_pipeline_mod:Evil")
    assert evil_module.exists()  # asked for on the command line: imported
    assert "subclass pipelines.dreamzero.pipeline.DreamZeroPipeline" in info.value.hint
    with pytest.raises(ConfigError, match="has no attribute 'Evill' \\(did you mean 'Evil'\\?\\)"):
        load_config("dreamzero-tiny", pipeline="evil_pipeline_mod:Evill")
    with pytest.raises(ConfigError, match="'evil_pipeline_mod:Path' is a function|is not a pipeline class"):
        load_config("dreamzero-tiny", pipeline="evil_pipeline_mod:Path")


def test_a_pipeline_class_carries_what_an_entry_module_carries():
    cfg = load_config("dreamzero-tiny", pipeline="faulty_pipelines:FaultyDreamZero")
    reference = load_config("dreamzero-tiny")
    assert cfg.pipeline_name == "faulty_pipelines:FaultyDreamZero" and cfg.entry.is_class
    assert cfg.kv_cache_spec() == reference.kv_cache_spec()
    assert cfg.observation_schema() == reference.observation_schema()
    assert cfg.entry.pipeline_class().__name__ == "FaultyDreamZero"
    # a registered name works too, and inspect-capacity answers for a class without loading weights
    assert load_config({"model": {"preset": "tiny"}}, pipeline="causal_world").pipeline_name == "causal_world"
    result = runner.invoke(app, ["inspect-capacity", "--pipeline", "pipelines.dreamzero.pipeline:DreamZeroPipeline",
                                 "--available", "1GiB", "--format", "json"])
    expected = runner.invoke(app, ["inspect-capacity", "--available", "1GiB", "--format", "json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["plan"] == json.loads(expected.stdout)["plan"]


def test_entry_points_register_pipelines_but_never_shadow_builtins(tmp_path, monkeypatch):
    """An installed distribution (a dist-info folder on sys.path, read by the real importlib.metadata)."""
    dist = tmp_path / "third_party_worlds-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: third-party-worlds\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\nmy_world = pipelines.causal_world\n"
                                           "dreamzero = no_such_package.pipeline\nbroken = no_such_package.pipeline\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(ArdiffWarning, match=r"entry point dreamzero = 'no_such_package.pipeline' .*\(distribution "
                                           r"third-party-worlds 1.0\) .* is ignored"):
        assert registry.registered_pipelines() == {
            "dreamzero": "pipelines.dreamzero", "causal_world": "pipelines.causal_world",
            "my_world": "pipelines.causal_world", "broken": "no_such_package.pipeline"}
        cfg = load_config({"pipeline": "my_world", "model": {"preset": "tiny"}})
        assert cfg.pipeline_name == "my_world" and cfg.entry.pipeline_class().__name__ == "CausalWorldPipeline"
        assert load_config({"pipeline": "dreamzero", "model": {"preset": "tiny"}}).entry.module.__name__ == (
            "pipelines.dreamzero")
        with pytest.raises(ConfigError, match="pipeline 'broken': cannot import 'no_such_package.pipeline'") as info:
            load_config({"pipeline": "broken"})
    assert "installed" in info.value.hint


def test_one_module_registered_twice_is_no_conflict_and_a_missing_pipelines_module_is_not_called_shadowed(
        tmp_path, monkeypatch):
    """Two installed distributions (dist-info folders read by the real importlib.metadata) that register the same
    module under one name agree: no warning. And an entry point naming a ``pipelines.`` module that does not exist,
    with ardiff's own ``pipelines`` package imported, is a module not installed, not a folder hiding ardiff's."""
    import importlib
    import warnings

    importlib.import_module("pipelines.causal_world")  # ardiff's own pipelines package, imported as a run imports it

    for name in ("alpha", "beta"):
        dist = tmp_path / f"{name}_world-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-world\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\nshared = pipelines.causal_world\n"
                                               f"gone_{name} = pipelines.no_such_world\nbare_{name} = json\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.registered_pipelines()["shared"] == "pipelines.causal_world"
        assert load_config({"pipeline": "shared", "model": {"preset": "tiny"}}).pipeline_name == "shared"
        with pytest.raises(ConfigError, match="pipeline 'gone_alpha': cannot import 'pipelines.no_such_world': "
                                              "ModuleNotFoundError") as info:
            load_config({"pipeline": "gone_alpha"})
    assert "installed" in info.value.hint and "hides it" not in info.value.hint, info.value.hint
    # a registered module that is no entry module (json) is named with what it lacks, not an AttributeError later
    with pytest.raises(ConfigError, match="pipeline module 'json' lacks Config, observation_schema, pipeline_class"):
        load_config({"pipeline": "bare_beta"})


def test_the_pipeline_option_ignores_surrounding_blanks_and_refuses_a_blank_one():
    """--pipeline " causal_world " (a shell variable's stray space) names the registered pipeline; a blank one says
    what the option takes rather than "unknown pipeline ''"."""
    assert load_config({"model": {"preset": "tiny"}}, pipeline=" causal_world ").pipeline_name == "causal_world"
    for blank in ("", "  "):
        with pytest.raises(ConfigError, match="^--pipeline: expected a registered pipeline name or MODULE:CLASS, got "):
            load_config("dreamzero-tiny", pipeline=blank)


def test_the_pipeline_option_given_an_import_path_says_to_name_the_class_after_a_colon():
    """`--pipeline pipelines.dreamzero.pipeline.DreamZeroPipeline` (a dot where the colon goes, as Python imports
    write it) or a module alone said only "unknown pipeline" and listed the registered names, never the MODULE:CLASS
    form the user was reaching for."""
    with pytest.raises(ConfigError, match="unknown pipeline 'pipelines.dreamzero.pipeline.DreamZeroPipeline'") as info:
        load_config("dreamzero-tiny", pipeline="pipelines.dreamzero.pipeline.DreamZeroPipeline")
    assert info.value.hint.endswith("e.g. --pipeline pipelines.dreamzero.pipeline:DreamZeroPipeline")
    with pytest.raises(ConfigError, match="unknown pipeline 'my_lab.models'") as info:
        load_config("dreamzero-tiny", pipeline="my_lab.models")
    assert "write MODULE:CLASS, e.g. --pipeline my_lab.models:MyPipeline" in info.value.hint
    # a config's own `pipeline:` field names registered pipelines only: its hint offers --pipeline MODULE:CLASS (and
    # registering it) for a pipeline of one's own, not a MODULE:CLASS in the config; a typo is given the names alone
    with pytest.raises(ConfigError, match="unknown pipeline 'dreamzeroo'") as info:
        load_config({"pipeline": "dreamzeroo"})
    assert info.value.hint == "registered pipelines: causal_world, dreamzero"
    with pytest.raises(ConfigError, match="unknown pipeline 'my_world'") as info:
        load_config({"pipeline": "my_world"})
    assert info.value.hint.startswith("registered pipelines: causal_world, dreamzero; a pipeline of your own gets its "
                                      "name from an 'ardiff.pipelines' entry point")
    assert "write MODULE:CLASS" not in info.value.hint


def test_a_pipeline_module_that_raises_as_it_imports_is_not_called_a_package_not_installed(tmp_path, monkeypatch):
    """`--pipeline my_lab_boom:Model` whose module raises at its top level (a RuntimeError, a bad path) was told "is
    the package installed in this environment?": it is, and runs; the hint now says where to look, and the error is
    the pipeline's (exit 1), not a config error. A module that is not there keeps the install hint."""
    (tmp_path / "my_lab_boom.py").write_text("raise RuntimeError('no GPU driver loaded')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_lab_boom", raising=False)
    with pytest.raises(PipelineError,
                       match="importing 'my_lab_boom' raised RuntimeError: no GPU driver loaded$") as info:
        load_config("dreamzero-tiny", pipeline="my_lab_boom:Model")
    assert "installed" not in info.value.hint and "python -c 'import my_lab_boom'" in info.value.hint, info.value.hint
    with pytest.raises(ConfigError, match="cannot import 'my_lab_gone': ModuleNotFoundError") as info:
        load_config("dreamzero-tiny", pipeline="my_lab_gone:Model")
    assert "installed" in info.value.hint, info.value.hint


def test_the_pipeline_option_says_what_it_found_in_place_of_a_class():
    """MODULE:NAME naming a function says so (not that a "class" lacks the pipeline attributes), and a name the
    module lacks lists the classes it has, for the user to pick from."""
    with pytest.raises(ConfigError, match=r"^--pipeline: 'json:dumps' is a function, expected a pipeline class$"):
        load_config("dreamzero-tiny", pipeline="json:dumps")
    with pytest.raises(ConfigError, match=r"^--pipeline: 'json' has no attribute 'JSONDecoderr' \(did you mean "
                                          r"'JSONDecoder'\?\)$") as info:
        load_config("dreamzero-tiny", pipeline="json:JSONDecoderr")
    assert info.value.hint == "classes in json: JSONDecodeError, JSONDecoder, JSONEncoder"


def test_an_installed_entry_point_named_like_a_builtin_is_a_warning_and_the_builtin_runs(tmp_path):
    """A real distribution on sys.path (a dist-info folder) registering `dreamzero`: it used to be dropped
    silently, so its author could not tell why their model never ran."""
    import subprocess

    dist = tmp_path / "shadow_world-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: shadow-world\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ardiff.pipelines]\ndreamzero = shadow_world.model\n"
                                           "shadow_world = pipelines.causal_world\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tmp_path)])
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", "dreamzero-tiny", "--available",
                           "1GiB", "--format", "json"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["pipeline"] == "dreamzero"  # the built-in; shadow_world.model is never imported
    warnings_shown = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert warnings_shown == [
        "warning: entry point dreamzero = 'shadow_world.model' in group 'ardiff.pipelines' (distribution "
        "shadow-world 1.0) has the name of a built-in pipeline and is ignored: 'dreamzero' is the built-in "
        "'pipelines.dreamzero'; register it under another name"], proc.stderr
    quiet = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", "--available", "1GiB", "-q"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert quiet.returncode == 0 and "warning" not in quiet.stderr  # --quiet: only data and errors
    code = ("import warnings; from ardiff_cli.runtime.registry import registered_pipelines\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    names = registered_pipelines()\n"
            "assert names['dreamzero'] == 'pipelines.dreamzero' and names['shadow_world'] == 'pipelines.causal_world'\n"
            "print([type(w.message).__name__ for w in caught])")
    api = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=120)
    assert api.returncode == 0 and api.stdout.strip() == "['ArdiffWarning']", api.stderr


@pytest.mark.parametrize(("body", "message"), [
    # rollout: "Error: unexpected ModuleNotFoundError: ...", "hint: this is a bug in ardiff" and the traceback (warmup
    # named the pipeline): rollout called pipeline_class() before the load, to check the default checkpoint's size
    ("    import flash_attn_that_is_not_installed\n",
     "Error: pipeline 'lab_world': pipeline_class() failed: ModuleNotFoundError: No module named "
     "'flash_attn_that_is_not_installed'"),
    # "Error: None.from_config() failed: AttributeError: 'NoneType' object has no attribute 'from_config'"
    ("    from pipelines.causal_world.pipeline import CausalWorldPipeline\n",
     "Error: pipeline 'lab_world': pipeline_class() returned None, expected the pipeline class (with from_config())"),
])
def test_an_entry_modules_pipeline_class_that_fails_is_the_pipelines_mistake_in_rollout_and_warmup(tmp_path, body,
                                                                                                   message):
    """An installed entry module (a dist-info folder on sys.path) whose pipeline_class() raises (a dependency of the
    model code missing) or returns nothing: exit 1 naming the pipeline (one that raises, before rollout makes
    --out)."""
    import subprocess

    dist = tmp_path / "lab_world-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-world\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ardiff.pipelines]\nlab_world = lab_world_entry\n")
    (tmp_path / "lab_world_entry.py").write_text(
        "from pipelines.causal_world import Config, observation_schema\n\n\ndef pipeline_class():\n" + body)
    config = tmp_path / "lab.yaml"
    config.write_text("pipeline: lab_world\nmodel: {preset: tiny}\nruntime: {device: cpu}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tmp_path)])
    out = tmp_path / "run"
    for command in (["rollout", str(config), "-o", str(out)], ["warmup", str(config)]):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *command, "--format", "plain"],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
        assert proc.returncode == 1, (command, proc.stderr)
        assert message in proc.stderr and "bug in ardiff" not in proc.stderr, (command, proc.stderr)
        assert "Traceback" not in proc.stderr, (command, proc.stderr)
    if "failed:" in message:  # raised where rollout first imports the model code: before --out is made
        assert not out.exists()


def test_two_distributions_registering_one_name_is_a_warning_and_the_choice_does_not_depend_on_the_disk(tmp_path):
    """The first entry point found used to win silently, and entry_points() lists a folder in the file system's
    order (creation order on tmpfs, hash order on ext4): the same two packages ran one model here, the other there."""
    import subprocess

    config = tmp_path / "my_world.yaml"
    config.write_text("pipeline: my_world\nmodel: {preset: tiny}\n")
    warning = ("warning: pipeline 'my_world' is registered by more than one entry point in group 'ardiff.pipelines': "
               "'pipelines.causal_world' (distribution alpha-world 1.0) is used, 'pipelines.dreamzero' (distribution "
               "beta-world 2.0) ignored (the distribution whose name sorts first is used); uninstall one, or register "
               "it under another name")
    for order in (("alpha", "beta"), ("beta", "alpha")):  # written in both orders
        site = tmp_path / "-".join(order)
        for name in order:
            module, version = ("pipelines.causal_world", "1.0") if name == "alpha" else ("pipelines.dreamzero", "2.0")
            dist = site / f"{name}_world-{version}.dist-info"
            dist.mkdir(parents=True)
            (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-world\nVersion: {version}\n")
            (dist / "entry_points.txt").write_text(f"[ardiff.pipelines]\nmy_world = {module}\n")
        env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(site)])
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", str(config), "--available",
                               "1GiB", "--format", "json"], capture_output=True, text=True, cwd=tmp_path, env=env,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["plan"]["num_local_branches"] == 1, order  # causal_world's one branch
        assert [line for line in proc.stderr.splitlines() if line.startswith("warning:")] == [warning], proc.stderr
