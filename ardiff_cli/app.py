"""The `ardiff` command: wiring only. Commands live one per module and import torch lazily."""

from __future__ import annotations

import atexit
import difflib
import enum
import os
import re
import shlex
import signal
import sys
import threading
from types import FrameType
from typing import Annotated, NoReturn

import typer

from ardiff_cli import __version__, entry
from ardiff_cli.commands import inspect_capacity, rollout, warmup
from ardiff_cli.entry import report_interrupted, requested_format, signal_of
from ardiff_cli.errors_cli import EXIT_SIGINT, exit_codes_help
from ardiff_cli.options import ARGUMENT_KINDS, FLAG, HelpOpt
from ardiff_cli.output import Output, resolve_format, stdout_error
from ardiff_cli.runtime.capacity import split_unit_hint
from ardiff_cli.runtime.errors import close_match, did_you_mean, quoted


class Command(typer.core.TyperCommand):
    """A command whose arguments show what they take in the help's type column (``ARGUMENT_KINDS``), as its options'
    metavars do, instead of a Python annotation, and that stops before it runs for a signal whose stop Python dropped
    as Typer built it or read its options (``entry.raise_dropped_stop``): it ran to its end, exit 0."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            kind = ARGUMENT_KINDS.get(param.metavar) if isinstance(param, typer.core.TyperArgument) else None
            if kind:  # beyond Typer's public API (0.29 reads it); should it stop reading it, the annotation shows
                param.display_type_rich = lambda ctx, kind=kind: kind

    def invoke(self, ctx: typer.Context) -> object:
        entry.raise_dropped_stop()  # one that landed in a callback Python ran as Typer built the command, read options
        return super().invoke(ctx)


app = typer.Typer(
    name="ardiff",
    help="Run autoregressive video-diffusion world models with persistent paged-KV sessions.",
    epilog=f"Start with: ardiff rollout (a demo in seconds).\n\n{exit_codes_help()}",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": []},  # each command declares options.HelpOpt (-h/--help) instead
)
app.command("rollout", cls=Command, help=rollout.HELP, epilog=rollout.EPILOG)(rollout.rollout)
app.command("warmup", cls=Command, help=warmup.HELP, epilog=warmup.EPILOG)(warmup.warmup)
app.command("inspect-capacity", cls=Command, help=inspect_capacity.HELP, epilog=inspect_capacity.EPILOG)(
    inspect_capacity.inspect_capacity
)
COMMANDS = ("rollout", "warmup", "inspect-capacity")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ardiff {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, metavar=FLAG,
                                          help="Print the version.")] = False,
    help_: HelpOpt = False,
) -> None:
    """Run autoregressive video-diffusion world models with persistent paged-KV sessions."""


def main() -> NoReturn:
    """The `ardiff` command (console script and ``python -m ardiff_cli``): run it, then end the process.

    The process ends as the interpreter's own exit would (non-daemon threads joined, ``atexit`` handlers run,
    standard streams flushed) but without tearing down every module: after torch was imported that teardown took
    about 0.5 s, a fifth of the demo rollout (``python -m benchmarks.bench_startup``: ``exit_ratio``), and a SIGTERM
    arriving in it made a finished run exit 143. Every file ardiff writes is closed (or written by ``os.write``)
    before this point. An exception other than ``SystemExit`` (a bug) still leaves through the interpreter, with
    its traceback.
    """
    from ardiff_cli import signals

    signals.give_back_after_command = False  # the process ends with the command: they are ignored as it exits
    try:
        _run(sys.argv[1:])
    except SystemExit as exc:
        _end_process(exc.code)
    except KeyboardInterrupt as exc:  # raised as Typer builds the command, before its own catch: it was a traceback
        report_interrupted(sys.argv[1:], signal_of(exc))
        _end_process(128 + signal_of(exc))


def _given(exc: BaseException, message: str) -> str:
    """``message`` of Typer's own checks of an option's value (a choice; a number option's value is read by its
    parser, ``capability.read_number``), which come from pydantic's validation, with what was given: their messages say
    what was expected but not always what was given (``, got 'x'`` is added). The value is written as ``quoted``
    writes it (a byte the locale could not decode is ``\\xNN``, as in the other lines, not repr's ``\\udcNN``), and a
    choice's message offers the one alike (`--order roundrobin`: did you mean 'round-robin'?). Any other error's
    ``message`` as it is."""
    errors = getattr(exc.__cause__, "errors", None)
    if not callable(errors) or type(exc.__cause__).__name__ != "ValidationError":
        return message
    first = next(iter(errors()), {})
    if "input" not in first:
        return message
    given = first["input"]
    shown = quoted(given) if isinstance(given, str) else repr(given)
    message = message.replace(repr(given), shown)
    if shown not in message:
        message += f", got {shown}"
    # An enum option's choices: Typer (0.29) keeps the annotation there; should it stop, no suggestion is made
    kind = getattr(getattr(getattr(exc, "param", None), "type_descriptor", None), "annotation", None)
    if isinstance(given, str) and isinstance(kind, type) and issubclass(kind, enum.Enum):
        near = did_you_mean(given, [str(choice.value) for choice in kind])
        message = message.removesuffix(".") + near if near else message
    return message


def _path_read_as_an_option(args: list[str], option: str | None) -> str | None:
    """The word of ``args`` that Click read as the unknown ``option`` (``-dash`` as ``-d``, ``--dash``) where a file or
    folder of that name is here: a path that begins with '-', an EPISODE or CONFIG. As ``rm -x`` names ``./-x``, only
    for one that exists: a mistyped option gets no such hint. Words after ``--`` are arguments already."""
    if not option:
        return None
    words = args[: args.index("--")] if "--" in args else args
    return next((word for word in words if word.startswith(option) and os.path.lexists(word)), None)


def _keep_options_alike(exc: BaseException) -> None:
    """The options offered for an unknown one: an option alike but for case alone (`--FOLLOW` --follow); else of
    difflib's picks, with case ignored, those ``close_match`` finds alike, their dashes left out (Click's difflib
    counted the '--' both begin with, and `--gpu` was offered --out, `--model` --help and --order; its cutoff is not
    asked again of the shorter names: `swap` and 'swap-space' fall under it), then every option that a name of 4
    letters or more begins (`--idle` --idle-timeout; `--sess` --sessions and --session-capacity, where there was
    only difflib's --sessions: its ratio leaves such beginnings out, and one was all a single pick could say)."""
    option, ctx = getattr(exc, "option_name", None), getattr(exc, "ctx", None)
    if not isinstance(option, str) or not hasattr(exc, "possibilities"):  # a NoSuchOption only
        return
    names = (exc.possibilities or []) if ctx is None else [
        name for param in ctx.command.get_params(ctx) for name in (*param.opts, *param.secondary_opts)
        if name.startswith("--")]
    typed, folded = option.casefold(), {name.casefold(): name for name in names}
    if typed in folded:
        exc.possibilities = [folded[typed]]
        return
    begun = [name for key, name in folded.items() if key.startswith(typed)]
    picks = [folded[key] for key in difflib.get_close_matches(typed, folded)
             if close_match(option.lstrip("-"), [folded[key].lstrip("-")], cutoff=0.0) is not None]
    picks += begun if len(typed.lstrip("-")) >= 4 else []
    exc.possibilities = list(dict.fromkeys(picks))


def _option_of_the_command_after(exc: BaseException, args: list[str]) -> str | None:
    """The hint of an unknown option given before the command that takes it (`ardiff --format json rollout`): the
    command with the words before it moved after it, as pasted; its help lists the option, where ``ardiff --help``,
    whose hint it was, lists none of a command's. None for any other error."""
    option, ctx = getattr(exc, "option_name", None), getattr(exc, "ctx", None)
    if not isinstance(option, str) or ctx is None or ctx.parent is not None:  # a NoSuchOption of the root only
        return None
    words = args[: args.index("--")] if "--" in args else args  # after it, a command's name is an argument
    at = next((i for i, word in enumerate(words) if word in COMMANDS), None)
    command = ctx.command.get_command(ctx, args[at]) if at is not None else None
    if command is None or option not in {name for param in command.params
                                         for name in (*param.opts, *param.secondary_opts)}:
        return None
    moved = shlex.join(["ardiff", args[at], *args[:at], *args[at + 1:]])
    return f"{option} is an option of ardiff {args[at]}: put it after the command: {moved}"


def _run(args: list[str]) -> None:
    entry.fill_closed_standard_streams()
    # Usage errors (an unknown option, a bad option value) are reported like every other error: `Error:` and
    # `hint:` lines on stderr, or one JSON object on stdout under --format json, never Typer's box.
    try:
        # obj: the command line as given, which a hint giving it again keeps the options of (options_given)
        code = app(args=args, prog_name="ardiff", standalone_mode=False, obj=args)
    except typer.TyperException as exc:
        # a stop held or dropped as Typer read the options (pydantic's import) ends it as one raised there: exit 130
        entry.raise_dropped_stop()
        if not args:  # bare `ardiff`: Typer printed the help already
            sys.exit(exc.exit_code)
        ctx = getattr(exc, "ctx", None)
        command = "ardiff" if ctx is None else ctx.command_path
        if command == "ardiff" and args[0] in COMMANDS:  # an error parsing the command's own options
            command = f"ardiff {args[0]}"
        _keep_options_alike(exc)
        # Typer's choice errors carry pydantic's "Value error, "
        message = _given(exc, exc.format_message().replace(": Value error, ", ": ", 1))
        hint = _option_of_the_command_after(exc, args) or f"see {command} --help"
        path = _path_read_as_an_option(args, getattr(exc, "option_name", None))
        if path is not None:  # `rollout CFG -dash`: "No such option: -d", of an EPISODE (or CONFIG) folder
            hint = (f"{shlex.quote(path)} is a file or folder here, not an option: to name it, put it after -- "
                    f"({command} ... -- {shlex.quote(path)}) or write {shlex.quote('./' + path)}; {hint}")
        extra = re.fullmatch(r"Got unexpected extra argument(?:s|\(s\))? \((.*)\)", message)
        units = [split_unit_hint(arg) for arg in extra.group(1).split()] if extra else []
        if any(units):  # `warmup CFG --memory-budget 2 GiB`: the shell split the size in two
            hint = f"{next(unit for unit in units if unit)}; {hint}"
        Output(resolve_format(requested_format(args))).error(message, hint, exit_code=exc.exit_code, kind="usage_error")
        sys.exit(exc.exit_code)
    except SystemExit as exc:
        # Rich's and Click's own exit for --help or --version written to a reader that went away (`| grep -q`):
        # it wanted no more, as of `inspect-capacity | head` (exit 0), not a failure under `set -o pipefail`. Bare
        # `ardiff` keeps its usage error's 2 (no command given), as when all of its help was read.
        if exc.code == 1 and isinstance(exc.__context__, BrokenPipeError):
            sys.exit(0 if args else 2)
        raise
    except OSError as exc:
        if exc.filename is not None:  # not a stream's write: a bug, with its traceback
            raise
        # Writing --help or --version (a command reports its own errors, stdout's included: handle_errors).
        error = stdout_error(exc)
        Output(resolve_format(requested_format(args))).error(str(error), error.hint, exit_code=1, kind="output_error")
        sys.exit(1)
    if code == EXIT_SIGINT and not Output.errors_reported:  # Typer's exit for a Ctrl-C before a command took it
        signum = entry.stopped_by or signal.SIGINT  # or for SIGTERM, SIGHUP (entry.Stopped): 130 all the same
        report_interrupted(args, signum)
        code = 128 + signum
    if not code:  # --help, --version, whose text came out with exit 0 for a stop Python dropped as they ran
        entry.raise_dropped_stop()
    sys.exit(code or 0)


def _end_process(code: object) -> NoReturn:
    """``sys.exit(code)``, less the teardown of every module (see ``main``)."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # what the interpreter does with sys.exit("message")
        print(code, file=sys.stderr)
        status = 1
    entry.release_early_signals()
    # The command is over, its data written: what a pipeline's thread still running or an atexit handler prints
    # goes to stderr, as it did while the command ran (handle_errors), not after the data (a --format json line)
    stdout, sys.stdout = sys.stdout, sys.stderr
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter's exit calls first: joins threads
    if shutdown is None:  # another Python: let the interpreter exit as usual
        sys.stdout = stdout
        raise SystemExit(status)
    from ardiff_cli.signals import HANDLED

    def cut_the_wait_short(signum: int, frame: FrameType | None) -> None:
        # Raised only inside the wait: one raised anywhere else in this function (two signals came together, the
        # second handled as the first's KeyboardInterrupt was caught) left it, a traceback and exit -2 (killed by
        # SIGINT), not the status
        while frame is not None:
            if frame.f_code is shutdown.__code__:
                raise KeyboardInterrupt
            frame = frame.f_back

    for signum in HANDLED:  # not one the process was started ignoring (nohup's SIGHUP)
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, cut_the_wait_short)
    try:
        shutdown()  # a thread that never ends (a snapshot written to a hung disk) can still be interrupted here
    except KeyboardInterrupt:  # the status is decided: it only cut the wait short (it was a traceback, and exit -2)
        pass
    for signum in HANDLED:  # a signal now (a second Ctrl-C) would only garble or change the status
        signal.signal(signum, signal.SIG_IGN)
    atexit._run_exitfuncs()
    for stream in (stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            status = status or 120  # as the interpreter reports a flush that fails at exit
    os._exit(status & 0xFF)  # as exit() keeps the low byte
