"""The `ardiff` command: wiring only. Commands live one per module and import torch lazily."""

from __future__ import annotations

import typer

from ardiff_cli import __version__

app = typer.Typer(
    name="ardiff",
    help="Run autoregressive video-diffusion world models with persistent paged-KV sessions.",
    no_args_is_help=True,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ardiff {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Run autoregressive video-diffusion world models with persistent paged-KV sessions."""


def main() -> None:
    app()
