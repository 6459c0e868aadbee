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
