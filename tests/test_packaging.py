"""The explicit package list in pyproject.toml covers every package folder of the source tree."""

from __future__ import annotations

import tomllib
from pathlib import Path

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
