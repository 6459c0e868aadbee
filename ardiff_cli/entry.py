"""The `ardiff` command's entry point (console script and ``python -m ardiff_cli``): standard library only.

Ctrl-C in the first tenth of a second, while Typer, Rich and the commands import, raised KeyboardInterrupt out of
the import: a traceback. Nothing has started then, so it is reported as a later one is (``app`` reports one while
Typer builds the command): ``Error: interrupted by SIGINT``, the error object on stdout under ``--format json``, exit
130.
SIGTERM and SIGHUP, until a command installs its own handlers (``ardiff_cli.signals``), are raised the same way
(:class:`Stopped`), exit 143 and 129: by their default action they killed the process, with no word and no error
object, for the first second or more of every command (imports, reading the config, a resume's results.jsonl).
Only the first signal is raised, as later: one more raised into the report of the first cut it short (no ``Error:``
line, a traceback) or made the exit code its own (SIGINT then SIGTERM, 143; SIGTERM then SIGINT, 130).
"""

from __future__ import annotations

import io
import os
import signal
import sys
from types import FrameType

# Python's own handler of SIGINT raises KeyboardInterrupt for every one; SIGTERM's and SIGHUP's default action kills
EARLY_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_DEFAULT = {signal.SIGINT: signal.default_int_handler}  # its handling unless the process was started ignoring it
stopped_by: int | None = None  # the first signal, whose Stopped was raised (or held); Typer turns it into its exit 130
_held = False  # stopped_by's Stopped is held (``_stop``, in a ``__set_name__``), not on its way out


class Stopped(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP before a command took the signals (a KeyboardInterrupt, as Python's Ctrl-C)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: FrameType | None) -> None:
    global stopped_by, _held
    if stopped_by is not None and not _held:  # the first one's stop is on its way out, or being reported
        return  # only that one counts
    stopped_by = stopped_by or signum  # a second raises the held stop of the first (its exit code)
    # Not raised in a __set_name__ (of a class an import defines: pydantic's, platform's cached_property): Python
    # before 3.12 wraps what it raises in a RuntimeError, which was a traceback and exit 1. Held, it is raised at the
    # next check, as one Python dropped (raise_dropped_stop), or by the next signal: one before that check (a resume's
    # run.json on a hung mount) was ignored, and only SIGKILL ended the command
    while frame is not None:
        if frame.f_code.co_name == "__set_name__":
            _held = True
            return
        frame = frame.f_back
    _held = False
    raise Stopped(stopped_by)


def raise_dropped_stop() -> None:
    """Raise again the stop of the first signal if Python dropped it, or raise it if it was held (``_stop``, in a
    ``__set_name__``). Raised in a callback Python runs (importlib's module lock, at each import; a weakref's or a
    ``__del__`` as the garbage collector runs), Python printed it (``Exception ignored in``) and went on: the command
    ran on to its end, exit 0, and its next signal was ignored as one already being reported. Called where the normal
    flow passes before a command takes the signals, where that stop cannot be on its way out (it leaves through an
    ``except``): ``main``, once ardiff is imported; ``app.Command.invoke``, once Typer built the command and read its
    options; ``StopSignals``, as a command takes them; ``Output.result``, before a command that never does writes its
    result (and a rollout's resume with nothing left to run, before it writes run.json and summary.json); ``app._run``,
    before it reports a usage error, and as a command or ``--help``, ``--version`` (which run no command) ends with
    exit 0."""
    global _held
    if stopped_by is not None and signal.getsignal(stopped_by) is _stop:
        _held = False
        raise Stopped(stopped_by)


def release_early_signals() -> None:
    """Give the signals back their default handling (the command is over): as the process ends, SIGTERM or SIGHUP
    kills it as before, rather than raise a KeyboardInterrupt where nothing is left to report it."""
    for signum in EARLY_SIGNALS:
        if signal.getsignal(signum) is _stop:
            signal.signal(signum, _DEFAULT.get(signum, signal.SIG_DFL))


def signal_of(exc: BaseException) -> int:
    """The signal a KeyboardInterrupt stands for: SIGINT, or a :class:`Stopped`'s."""
    return getattr(exc, "signum", signal.SIGINT)


def main() -> None:
    # A stdout that cannot encode a character (PYTHONIOENCODING=ascii, a latin-1 locale) writes it as \uXXXX, as
    # stderr does: a name in the output was a UnicodeEncodeError traceback after the work had succeeded.
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    whole_writes_to_stdout()
    # COLUMNS=0 (`stty size` of a pty nobody sized, exported by a script) made Rich lay everything out 0 columns
    # wide: no help, no live panel, no result and no error message, only the exit code. As for Python's shutil,
    # 0 is unset: the terminal's own width is used.
    if os.environ.get("COLUMNS", "").isdigit() and int(os.environ["COLUMNS"]) == 0:
        del os.environ["COLUMNS"]
    try:
        # in the try: a signal that comes once one handler is set (the next line to run raises it) is reported as
        # any other here; it was raised before the try, a traceback and exit 1
        for signum in EARLY_SIGNALS:  # not one the process was started ignoring (nohup's SIGHUP)
            if signal.getsignal(signum) is _DEFAULT.get(signum, signal.SIG_DFL):
                signal.signal(signum, _stop)
        from ardiff_cli.app import main as run
        raise_dropped_stop()  # one that landed in a callback Python ran as ardiff imported
        # in the try as well: a signal as run() begins, before its own try (as it imports ardiff_cli.signals), was
        # a traceback and exit 1
        run()
    except KeyboardInterrupt as exc:
        try:  # a closed stream (`>&-`) is None; one whose reader is gone raises: the exit code says it all then
            report_interrupted(sys.argv[1:], signal_of(exc))
            sys.stdout.flush()
        except (AttributeError, OSError):
            pass
        # not sys.exit: the interpreter's own flush of a stdout whose reader is gone would print more
        os._exit(128 + signal_of(exc))


def whole_writes_to_stdout() -> None:
    """Give an unbuffered stdout (``python -u``, ``PYTHONUNBUFFERED``: its text written straight to the file, no
    buffer between) a buffer, which writes the whole of every write or raises why not. Straight to the file, a short
    write (the file reaching ``ulimit -f``, a disk filling up) lost the rest of its text without an error: the
    command exited 0 with its output cut short (a JSON object cut in two). Every write ardiff makes to stdout is
    flushed at once (``Output``, Rich, Click), as unbuffered, and the flush raises the error (EFBIG, ENOSPC) that
    ends the command with exit 1; ``line_buffering`` flushes a line anything else prints, as on a terminal."""
    stream = sys.stdout
    if stream is None or not isinstance(getattr(stream, "buffer", None), io.RawIOBase):
        return
    stream.flush()
    # the old wrapper, detached, no longer closes the file as it goes; sys.__stdout__ is this one, as Python's own is
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(stream.detach()), encoding=stream.encoding,
                                                   errors=stream.errors, line_buffering=True, write_through=True)


def report_interrupted(args: list[str], signum: int = signal.SIGINT) -> None:
    """Ctrl-C (or SIGTERM, SIGHUP) before a command began, reported as a command reports a later one."""
    from ardiff_cli.output import Output, resolve_format  # standard library only, as this module

    Output(resolve_format(requested_format(args))).error(interrupted_message(signum), None, exit_code=128 + signum,
                                                         kind="interrupted")


def interrupted_message(signum: int) -> str:
    """A signal's ``Error:`` line, the same however early it came (``interrupted by SIGINT``, as a later one's)."""
    return f"interrupted by {signal.Signals(signum).name}"


def requested_format(args: list[str]) -> str:
    """The --format a command line asks for (the last one wins, as Typer takes it), if it is one, else auto. After
    ``--`` every word is an argument, as Typer takes it: ``warmup -- --format json`` gave a usage error as JSON."""
    from ardiff_cli.output import Format

    requested = "auto"
    args = args[:args.index("--")] if "--" in args else args
    for arg, following in zip(args, [*args[1:], ""]):
        if arg.lower().startswith("--format="):
            requested = arg.split("=", 1)[1]
        elif arg == "--format":
            requested = following
    requested = requested.lower()
    return requested if requested in {f.value for f in Format} else "auto"


def fill_closed_standard_streams() -> None:
    """Open /dev/null on a standard stream the caller closed (`>&-`, `2>&-` in a cron line).

    Python leaves a closed one as ``None``, which the first message would trip over, and the next file opened
    would take its number: a native library's message on stderr would then land in ``.lock`` or
    ``results.jsonl``. Nobody reads a closed stream, so its output is dropped, as with ``>/dev/null``.
    """
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself, as the lower ones are open
        assert null == fd, f"{os.devnull} opened as fd {null}, not the closed {fd}: a lower one was closed meanwhile"
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False, errors="replace"))
