"""The `ardiff` command's entry point (console script and ``python -m ardiff_cli``): standard library only.

Ctrl-C in the first tenth of a second, while Typer, Rich and the commands import, raised KeyboardInterrupt out of
the import: a traceback. Nothing has started then, so it is reported as a later one is (``app`` reports one while
Typer builds the command): ``Error: interrupted``, the error object on stdout under ``--format json``, exit 130.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    # A stdout that cannot encode a character (PYTHONIOENCODING=ascii, a latin-1 locale) writes it as \uXXXX, as
    # stderr does: a name in the output was a UnicodeEncodeError traceback after the work had succeeded.
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    try:
        from ardiff_cli.app import main as run
    except KeyboardInterrupt:
        try:  # a closed stream (`>&-`) is None; one whose reader is gone raises: the exit code says it all then
            report_interrupted(sys.argv[1:])
            sys.stdout.flush()
        except (AttributeError, OSError):
            pass
        os._exit(130)  # not sys.exit: the interpreter's own flush of a stdout whose reader is gone would print more
    run()


def report_interrupted(args: list[str]) -> None:
    """Ctrl-C before a command began, reported as a command reports a later one."""
    from ardiff_cli.output import Output, resolve_format  # standard library only, as this module

    Output(resolve_format(requested_format(args))).error("interrupted", None, exit_code=130, kind="interrupted")


def requested_format(args: list[str]) -> str:
    """The --format a command line asks for (the last one wins, as Typer takes it), if it is one, else auto."""
    from ardiff_cli.output import Format

    requested = "auto"
    for arg, following in zip(args, [*args[1:], ""]):
        if arg.lower().startswith("--format="):
            requested = arg.split("=", 1)[1]
        elif arg == "--format":
            requested = following
    requested = requested.lower()
    return requested if requested in {f.value for f in Format} else "auto"
