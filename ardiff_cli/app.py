"""The `ardiff` command: wiring only. Commands live one per module and import torch lazily."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ardiff_cli import __version__
from ardiff_cli.commands import inspect_capacity, rollout, warmup
from ardiff_cli.errors_cli import EXIT_CODES_HELP
from ardiff_cli.output import Format, Output

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
    args = sys.argv[1:]
    if not _asks_for_json(args):
        app()
        return
    # Typer reports usage errors (a bad option value, an unknown option) itself, as text. With --format json
    # a script reading stdout gets them as the same JSON error object as every other error.
    try:
        code = app(args=args, standalone_mode=False)
    except typer.TyperException as exc:
        Output(Format.json).error(exc.format_message(), f"see ardiff {args[0]} --help", exit_code=exc.exit_code,
                                  kind="usage_error")
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    sys.exit(code or 0)


def _asks_for_json(args: list[str]) -> bool:
    return any(arg.lower() == "--format=json" or (arg == "--format" and following.lower() == "json")
               for arg, following in zip(args, [*args[1:], ""]))
