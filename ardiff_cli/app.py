"""The `ardiff` command: wiring only. Commands live one per module and import torch lazily."""

from __future__ import annotations

from typing import Annotated

import typer

from ardiff_cli import __version__
from ardiff_cli.commands import inspect_capacity, rollout, warmup
from ardiff_cli.errors_cli import EXIT_CODES_HELP

app = typer.Typer(
    name="ardiff",
    help="Run autoregressive video-diffusion world models with persistent paged-KV sessions.",
    epilog=f"Start with: ardiff rollout (a demo in seconds).\n\n{EXIT_CODES_HELP}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("rollout", help=rollout.HELP, epilog=rollout.EPILOG)(rollout.rollout)
app.command("warmup", help=warmup.HELP, epilog=warmup.EPILOG)(warmup.warmup)
app.command("inspect-capacity", help=inspect_capacity.HELP, epilog=inspect_capacity.EPILOG)(
    inspect_capacity.inspect_capacity
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ardiff {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version.")] = False,
) -> None:
    """Run autoregressive video-diffusion world models with persistent paged-KV sessions."""


def main() -> None:
    app()
