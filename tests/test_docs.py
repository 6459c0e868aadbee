"""The README and docs/reliability.md against the code: every command-line option is documented, and every
test the reliability page cites exists."""

from __future__ import annotations

import re
from pathlib import Path

import typer

from ardiff_cli.app import app

REPO = Path(__file__).resolve().parents[1]


def _mentioned(option: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def test_every_option_of_every_command_is_in_the_readme():
    readme = (REPO / "README.md").read_text()
    group = typer.main.get_command(app)
    commands = {"ardiff": group, **{f"ardiff {name}": cmd for name, cmd in group.commands.items()}}
    missing = []
    for name, command in commands.items():
        for param in command.params:
            if param.param_type_name != "option" or "--help" in param.opts:
                continue
            # A flag pair (--warmup/--no-warmup) is documented by either of its forms.
            if not any(_mentioned(opt, readme) for opt in (*param.opts, *param.secondary_opts) if opt.startswith("--")):
                missing.append(f"{name} {'/'.join(param.opts + param.secondary_opts)}")
    assert missing == []


def test_every_test_the_reliability_page_cites_exists():
    import ast

    names, strings = set(), set()
    for path in (REPO / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):  # TestEngineChurn = ....TestCase
                names.add(node.id)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    cited = [ref for line in (REPO / "docs" / "reliability.md").read_text().splitlines() if line.startswith("|")
             for ref in re.findall(r"`([^`]*)`", line)
             if re.match(r"(test_\w+\.py::|\.\.\.|test_|Test)", ref)]
    assert len(cited) > 50
    unknown = []
    for ref in cited:
        unknown += [name for name in re.findall(r"\b(test_\w+|Test\w+)\b(?!\.py)", ref) if name not in names]
        unknown += [param for param in re.findall(r"\[([^\]]+)\]", ref)
                    if not re.fullmatch(r"[\d-]+", param) and param not in strings]  # [1-129]: pytest's own id
    assert unknown == []


def test_every_error_the_readme_says_is_importable_from_the_runtime_is():
    import ardiff_cli.runtime as runtime
    from ardiff_cli.runtime import errors

    readme = (REPO / "README.md").read_text()
    paragraph = readme[readme.index("Errors a caller can cause"):].split("\n\n")[0]
    named = [name for name in re.findall(r"`([A-Z]\w+)`", paragraph) if isinstance(getattr(errors, name, None), type)]
    assert "ArdiffError" in named and "EngineStateError" in named
    missing = [name for name in named if getattr(runtime, name, None) is not getattr(errors, name)]
    assert missing == []
