"""Packaging: the explicit package list in pyproject.toml covers every package folder of the source tree; the sdist
holds the source tree, the wheel built from it holds the packages and runs on its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

import ardiff_cli

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("ardiff_cli", "pipelines")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found - listed == set(), "package folders missing from [tool.setuptools] packages"
    assert config["package-dir"] == {"ardiff_cli.configs": "configs"}
    assert "ardiff_cli.configs" in listed and (ROOT / "configs" / "__init__.py").is_file()


# --- built distributions ------------------------------------------------------------------------------------------
# CI installs the project editable, where every file of the source tree is importable; these tests build the sdist
# and, from it, the wheel (as pip does), so a file the installed package needs but does not ship fails here.

RELEASE_PATHS = ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", ".ci", "ardiff_cli", "pipelines", "configs",
                 "tests", "docs", "benchmarks")  # the source tree of a release; local files (venvs, runs) are not
BUILT_IN_CONFIGS = ("causal-world-tiny", "dreamzero-14b", "dreamzero-tiny", "lingbot-world-14b", "self-forcing-1.3b")
# Files a developer leaves beside the code: a converted checkpoint next to the config that names it, a cache dump.
STRAYS = ("configs/converted.safetensors", "pipelines/dreamzero/notes.json")
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")


def _build(hook: str, source: Path, out: Path) -> Path:
    """Run setuptools' PEP 517 ``hook`` in ``source`` (in a subprocess, as a build frontend does)."""
    code = f"import setuptools.build_meta as b; print(b.{hook}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{hook} failed in {source}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out / done.stdout.strip().splitlines()[-1]


def _tree(root: Path) -> set[str]:
    return {path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file()}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(source copy, sdist names, wheel path): the sdist built from a copy of the source tree with STRAYS added, the
    wheel built from the unpacked sdist."""
    tmp = tmp_path_factory.mktemp("release")
    source = tmp / "source"
    source.mkdir()
    for name in RELEASE_PATHS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=SKIPPED)
        elif (ROOT / name).is_file():
            shutil.copy2(ROOT / name, source / name)
    for stray in STRAYS:
        (source / stray).write_bytes(b"\0" * 64)
    sdist = _build("build_sdist", source, tmp / "dist")
    with tarfile.open(sdist) as tar:
        top = sdist.name.removesuffix(".tar.gz")
        sdist_names = {name.removeprefix(f"{top}/") for name in tar.getnames() if tar.getmember(name).isfile()}
        tar.extractall(tmp / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    wheel = _build("build_wheel", tmp / "unpacked" / top, tmp / "dist")
    return source, sdist_names, wheel


def test_sdist_holds_the_source_tree_and_no_stray_files(release):
    source, sdist_names, _ = release
    missing = _tree(source) - set(STRAYS) - sdist_names
    assert missing == set(), f"files of the source tree missing from the sdist (MANIFEST.in): {sorted(missing)}"
    assert set(STRAYS) & sdist_names == set(), "untracked-looking files next to the code were shipped"


def test_wheel_ships_the_packages_and_nothing_else(release):
    source, _, wheel = release
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(name.split("/")[0] for name in names if name.endswith(".dist-info/METADATA"))
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    expected = {name for name in _tree(source)
                if name.startswith(("ardiff_cli/", "pipelines/")) and name.endswith(".py")}
    expected |= {f"ardiff_cli/configs/{name.removeprefix('configs/')}" for name in _tree(source)
                 if name.startswith("configs/") and name.endswith((".py", ".yaml"))}
    shipped = {name for name in names if not name.startswith(f"{info}/")}
    assert shipped == expected, (f"wheel: missing {sorted(expected - shipped)}, "
                                 f"not expected {sorted(shipped - expected)}")
    assert f"{info}/licenses/LICENSE" in names, "the license text is not in the wheel"
    headers = dict(line.split(": ", 1) for line in metadata.split("\n\n")[0].splitlines() if ": " in line)
    assert headers["Version"] == ardiff_cli.__version__, "wheel version differs from ardiff --version"
    assert headers.get("License-Expression") == "Apache-2.0", f"METADATA: {metadata.split(chr(10) * 2)[0]}"
    assert headers["Requires-Python"] == ">=3.11"
    assert "ardiff = ardiff_cli.entry:main" in entry_points


def test_unpacked_wheel_runs_from_another_folder(release, tmp_path):
    """The wheel's files alone (no source tree on the path), from a folder that is not the repository: the built-in
    configs resolve, the demo rollout builds its checkpoint and data and runs."""
    _, _, wheel = release
    site, cwd = tmp_path / "site", tmp_path / "elsewhere"
    cwd.mkdir()
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NO_COLOR", "FORCE_COLOR", "COLUMNS")}
    env.update(PYTHONPATH=str(site), ARDIFF_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")

    def run(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stderr[-3000:]}"
        return done

    where = run("-c", "import ardiff_cli, pipelines; print(ardiff_cli.__file__); print(pipelines.__file__)")
    assert all(Path(line).is_relative_to(site) for line in where.stdout.split()), where.stdout
    assert run("-m", "ardiff_cli", "--version").stdout.strip() == f"ardiff {ardiff_cli.__version__}"
    for name in BUILT_IN_CONFIGS:
        plan = json.loads(run("-m", "ardiff_cli", "inspect-capacity", name, "--available", "80GiB",
                              "--format", "json").stdout.splitlines()[-1])
        assert plan["config"] == name
    result = json.loads(run("-m", "ardiff_cli", "rollout", "-o", "run", "--format", "json").stdout.splitlines()[-1])
    assert (result["kind"], result["status"], result["episodes"]["completed"]) == ("summary", "ok", 3), result
