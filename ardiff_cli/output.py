"""The one output sink every command writes through (never ``print``).

Streams: data (results, tables, JSON objects) goes to stdout; progress, logs,
warnings, errors and hints go to stderr, so ``ardiff ... > result.json`` keeps
a clean file while a human still sees what happens.

Formats:

- ``rich``: colours, tables and a live panel on stderr (only when both streams are terminals).
- ``plain``: no escape codes at all; one line per event on stderr.
- ``json``: stdout carries only JSON objects, one per line; humans read stderr.

``--quiet`` silences progress and warnings (errors and data stay), and holds what the code a command runs prints
(``chatter``) until an error is reported, which shows it first: nothing when all goes well. ``NO_COLOR``
is honoured by every format (Rich reads it; plain and json never colour).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import errno
import io
import json
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO, Any

from ardiff_cli.entry import raise_dropped_stop


class Format(str, enum.Enum):
    """Values of ``--format``."""

    auto = "auto"
    rich = "rich"
    plain = "plain"
    json = "json"


def resolve_format(requested: Format | str, *, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> Format:
    """``auto`` is rich when stdout and stderr are both terminals that take Unicode (and TERM is not dumb), plain
    otherwise."""
    requested = Format(requested)
    if requested is not Format.auto:
        return requested
    streams = (stdout or sys.stdout, stderr or sys.stderr)
    tty = all(_isatty(stream) and _takes_unicode(stream) for stream in streams)
    return Format.rich if tty and os.environ.get("TERM") != "dumb" else Format.plain


def _takes_unicode(stream: IO[str]) -> bool:
    """Whether ``stream`` encodes every character (UTF-8, as Rich assumes of a stream with no encoding). The panels'
    ``·``, ``→`` and names such as ``日本`` went to an ASCII one (PYTHONIOENCODING=ascii, a C locale without Python's
    UTF-8 mode) as ``\\xb7`` escapes, longer than Rich had measured them: rows wrapped and every redraw left the
    last frame's top on the screen."""
    return (getattr(stream, "encoding", None) or "utf-8").lower().startswith("utf")


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def to_jsonable(value: Any) -> Any:
    """Make dataclass dicts, tuples, paths and numpy scalars JSON-serialisable."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return value.item()
    return str(value)


HELD_CHARS = 64 * 1024  # of what code prints under --quiet, the most kept for an error's report (Output.chatter)
# Of the Python warnings of the code a command runs (held), the most a result's `warnings` lists: one whose text changes
# each time (a count, a step) passes Python's default filter each time, and a long run's summary.json grew with it
CODE_WARNINGS_LISTED = 100
_HELD_LINE_CHARS = 4096  # a line not yet ended, held apart while its \r redraws are dropped (Output._hold)


class Output:
    """Where a command's output goes. Build one per command with :meth:`create`."""

    errors_reported = 0  # by any sink of this process (``error``): a command's exit code has its message

    def __init__(
        self,
        format: Format,
        *,
        quiet: bool = False,
        verbose: bool = False,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
    ) -> None:
        assert format is not Format.auto, "resolve the format before building the sink"
        self.format = format  # resolved format: rich, plain or json
        self.quiet = quiet  # progress, events and warnings silenced
        self.verbose = verbose  # debug lines and tracebacks shown
        self._stdout = stdout or sys.stdout  # data stream
        self._stderr = stderr or sys.stderr  # human stream
        self._consoles: dict[str, Any] = {}  # Rich consoles, built on first use (Rich import is lazy)
        # Why stdout can no longer be written: its reader went away (`| head`: BrokenPipeError), or the file or
        # device it goes to failed (a full disk: ENOSPC). Nothing more is written to it from then on.
        self.stdout_lost: OSError | None = None
        # Called once when stdout is lost, with the error: a rollout stops at its next safe point. Whatever the
        # command, stdout lost to anything but a reader that went away ends it with exit 1 (handle_errors).
        self.on_stdout_lost: Callable[[OSError], None] | None = None
        self._stderr_lost = False  # progress lines are for a human: once stderr fails they are dropped
        # While a live display redraws the terminal, that display, whose console prints what code prints above it
        # (None: the text goes to stderr as it is), and that text after its last newline, printed once its line ends
        self._live: Any = None
        self._unfinished = ""
        # code printed a line and did not end it (print(..., end="")): ardiff's next line of its own starts a line
        self._line_open = False
        self._chatter_lock = threading.RLock()  # a pipeline's threads print too, and the live display ends meanwhile
        self.warnings: list[str] = []  # every warning of the command, shown or silenced: a result may list them
        self._code_warnings = 0  # the held ones (Python's) given, listed or not
        self._more_at: int | None = None  # the entry counting those past CODE_WARNINGS_LISTED
        # --quiet: what code printed (chatter), held until an error is reported, which shows it first; its last
        # HELD_CHARS characters only (an error's cause is printed just before it), and how many went before them
        self._held: collections.deque[str] = collections.deque()
        self._held_chars = 0  # in _held; the line not yet ended (_held_line) counts too
        self._held_dropped = 0
        self._held_line = ""  # the line not yet ended, as a terminal shows it (its \r redraws dropped): _hold

    @classmethod
    def create(cls, format: Format | str = Format.auto, *, quiet: bool = False, verbose: bool = False) -> Output:
        return cls(resolve_format(format), quiet=quiet, verbose=verbose)

    # -- consoles -----------------------------------------------------------------------------------------

    def console(self, stream: str = "stderr"):
        """The Rich console of ``stream`` ("stdout" or "stderr"); colourless unless the format is rich."""
        console = self._consoles.get(stream)
        if console is None:
            from rich.console import Console

            file = self._stdout if stream == "stdout" else self._stderr
            if self.format is Format.rich:
                # no emoji codes: a path such as data/arm:robot:1 read "data/arm🤖1" in an error
                console = Console(file=file, highlight=False, soft_wrap=False, emoji=False)
            else:
                # No colour, no cursor movement, no terminal features: plain text only.
                console = Console(file=file, color_system=None, force_terminal=False, force_interactive=False,
                                  highlight=False, emoji=False, width=_plain_width())
            # Rich's own answer to a reader that went away points fd 1 at /dev/null and raises SystemExit(1), for
            # either stream: the stream's error goes to this sink instead (_to_stdout, _print_err, live).
            console.on_broken_pipe = _raise_again
            self._consoles[stream] = console
        return console

    @property
    def is_rich(self) -> bool:
        return self.format is Format.rich

    @property
    def is_json(self) -> bool:
        return self.format is Format.json

    # -- data (stdout) ------------------------------------------------------------------------------------

    def json(self, obj: Mapping[str, Any]) -> None:
        """One JSON object on one stdout line (json format only)."""
        text = json.dumps(to_jsonable(obj), separators=(",", ":"), allow_nan=False) + "\n"
        self._to_stdout(lambda: self._stdout.write(text))

    def result(self, data: Mapping[str, Any], human: Callable[[bool], Any]) -> None:
        """A command's result: ``data`` as JSON, or ``human(plain)`` (a renderable or text) on stdout. Not the result
        of a command that a signal stopped before it took the signals, where Python dropped the stop
        (``entry.raise_dropped_stop``): inspect-capacity, which never takes them, ran on to print it, exit 0."""
        raise_dropped_stop()
        if self.is_json:
            self.json(data)
            return
        renderable = human(not self.is_rich)
        if self.is_rich:  # not cropped: a line marked no_wrap (overflow "ignore") stays whole, the terminal wraps it
            self._to_stdout(lambda: self.console("stdout").print(renderable, crop=False))
            return
        self._to_stdout(lambda: self._stdout.write(_plain_text(self.console("stdout"), renderable)))

    def _to_stdout(self, write: Callable[[], object]) -> None:
        """Run ``write`` and flush; once stdout is lost (its reader gone, its disk full), write nothing more."""
        if self.stdout_lost is not None:
            return
        try:
            write()
            self._stdout.flush()
        except OSError as exc:
            self.stdout_lost = exc
            to_devnull(self._stdout)  # so that the interpreter's own flush at exit does not fail on it again
            if self.on_stdout_lost is not None:
                self.on_stdout_lost(exc)

    # -- events -------------------------------------------------------------------------------------------

    def event(self, data: Mapping[str, Any], line: str) -> None:
        """A runtime or rollout event: a JSON line on stdout (json), one text line on stderr (plain).

        In rich format the live panel shows events, so nothing is printed here.
        """
        if self.is_json:
            self.json(data)
        elif self.format is Format.plain and not self.quiet:
            self._write_err(one_line(line))

    # -- human stream (stderr) ----------------------------------------------------------------------------

    def info(self, message: str) -> None:
        """Progress and logs (stderr), one line each (``one_line``: the paths they quote are the user's; in a
        terminal not broken at its width, as an ``Error:`` line); silenced by --quiet."""
        if not self.quiet:
            self._print_err("", one_line(message), soft_wrap=True)

    def debug(self, message: str) -> None:
        if self.verbose:
            self._print_err("[dim]debug:[/dim] ", one_line(message), plain_prefix="debug: ")

    def warning(self, message: str, *, held: bool = False) -> None:
        """A ``warning:`` line (stderr), kept in ``warnings`` for a result. ``held``: a warning of the code the command
        runs (Python's, a pipeline's), which --quiet holds for an error's report as it holds what that code prints;
        past the first ``CODE_WARNINGS_LISTED`` of those, one entry of ``warnings`` counts the rest."""
        with self._chatter_lock:  # a pipeline's threads warn too
            self._code_warnings += held
            past = self._code_warnings - CODE_WARNINGS_LISTED if held else 0
            if past <= 0:
                self.warnings.append(message)
            else:  # one entry counts them, where the first went (ardiff's own warnings may come after it)
                if self._more_at is None:
                    self._more_at = len(self.warnings)
                    self.warnings.append("")
                self.warnings[self._more_at] = (f"and {past} more Python warnings of the code the command ran, left "
                                                "out of this list")
        if not self.quiet:
            self._print_err("[yellow]warning:[/yellow] ", one_line(message), plain_prefix="warning: ", soft_wrap=True)
        elif held:
            with self._chatter_lock:
                self._hold(f"warning: {visible(one_line(message))}\n")

    def error(self, message: str, hint: str | None = None, *, exit_code: int | None = None,
              kind: str = "error", episode: str | None = None, notes: Sequence[str] = ()) -> None:
        """'Error: ...', an indented '  note: ...' for each of ``notes`` (the exception's ``__notes__``: what else
        went wrong, as a close hook failing after the error) and 'hint: ...' on stderr (never silenced); json also
        gets an error object on stdout, with the ``episode`` it is of, if any (a script reads which episode failed
        from it, not from the message), and its ``notes``, if any."""
        Output.errors_reported += 1
        self._show_held()
        # not wrapped by Rich, as a warning: a path or command it broke in two was two when copied from a terminal
        self._print_err("[bold red]Error:[/bold red] ", one_line(message), plain_prefix="Error: ", soft_wrap=True)
        for note in notes:
            self._print_err("  [dim]note:[/dim] ", one_line(note), plain_prefix="  note: ", soft_wrap=True)
        if hint:
            self._print_err("[cyan]hint:[/cyan] ", one_line(hint), plain_prefix="hint: ", soft_wrap=True)
        if self.is_json:
            self.json({"kind": kind, "message": message, "hint": hint, "exit_code": exit_code,
                       **({"episode": episode} if episode is not None else {}),
                       **({"notes": list(notes)} if notes else {})})

    def traceback(self, exc: BaseException) -> None:
        """Through the console in rich format: written to stderr beside a live display, a failed step's traceback
        (``--verbose``) began on the progress line and the display's next frame drew over its end."""
        self._show_held()
        self._print_err("", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip("\n"))

    @contextlib.contextmanager
    def live(self, get_renderable: Callable[[], Any]) -> Iterator[None]:
        """A live display on stderr in rich format, redrawn 4 times a second (a no-op otherwise)."""
        if not self.is_rich or self.quiet:
            yield
            return
        from rich.live import Live

        self._end_open_line()  # the display's first line is a line of its own
        relay = None

        def frame() -> Any:
            if relay is not None:
                relay.measure(live.console)
            return get_renderable()

        live = Live(get_renderable=frame, console=self.console("stderr"), refresh_per_second=4,
                    transient=False, redirect_stdout=False, redirect_stderr=False)
        # A stderr that fails (its disk full, its reader gone) drops the display, never the command.
        try:
            live.start()
        except OSError:
            self._lose_stderr()
        if live.console.is_interactive:  # redrawn in place: what code prints goes above it (chatter)
            self._live = live
            relay = self._relay_stderr(live)
        try:
            yield
        finally:
            if relay is not None:  # what native code wrote shows above the last frame, before the display ends
                try:
                    relay.stop()
                finally:
                    with _lock_of(live):
                        live.console.file = self._stderr
                        if relay.measured:  # Rich measures the terminal again: descriptor 2 is one
                            live.console.size = (None, None)
                    relay.close()
                    if self._stderr_lost:  # descriptor 2 is the failed one again
                        to_devnull(self._stderr)
            # a thread's text waits for the last frame, then goes below it as it is; the display's lock first, as
            # in chatter (its refresh thread holds it while a frame draws, and whatever that writes comes to chatter)
            with _lock_of(live), self._chatter_lock:
                if self._unfinished:  # a line left unfinished, or lines a stop cut off (chatter): shown, not lost
                    self._print_above(*self._unfinished.removesuffix("\n").split("\n"))
                self._live, self._unfinished = None, ""
                try:
                    live.stop()
                except OSError:
                    self._lose_stderr()

    def _relay_stderr(self, live: Any) -> Any:
        """While the display runs, what is written to descriptor 2 itself (native code, a child process) is shown
        above it too (``stderr_relay``), and the display writes to the terminal through a descriptor of its own.
        None where stderr is not descriptor 2 or the relay cannot start: that text lands in the display then."""
        from ardiff_cli.stderr_relay import StderrRelay

        try:
            if self._stderr.fileno() != 2 or os.name != "posix":
                return None
            self._stderr.flush()
            relay = StderrRelay(self.chatter, getattr(self._stderr, "encoding", None) or "utf-8",
                                getattr(self._stderr, "errors", None))
        except (OSError, ValueError, AttributeError):
            return None
        with _lock_of(live):
            live.console.file = relay.terminal
            relay.measure(live.console)  # for what prints above the display before its first frame
        return relay

    def _print_err(self, rich_prefix: str, message: str, *, plain_prefix: str = "", soft_wrap: bool = False) -> None:
        """``message`` is never read as markup; only the fixed prefix carries Rich styles. ``soft_wrap``: one line
        however long, that the terminal wraps (Rich breaks a line at its width with a newline)."""
        self._end_open_line()
        if not self.is_rich:
            self._write_err(plain_prefix + message)
            return
        from rich.markup import escape

        # Under the live display's lock, as chatter prints: Rich moves up over the display and writes the line in
        # two steps, and a frame its refresh thread drew between them was left above the line (a warning's, from
        # the main thread or a pipeline's own), a second title line
        with _lock_of(self._live):
            if not self._stderr_lost:
                try:
                    self.console("stderr").print(rich_prefix + escape(visible(message)), markup=True,
                                                 soft_wrap=soft_wrap)
                except OSError:
                    self._lose_stderr()

    def _write_err(self, line: str) -> None:
        self._end_open_line()
        self._write_err_raw(visible(line) + "\n")

    def _end_open_line(self) -> None:
        """Before a line of ardiff's own: a line code printed and left open ends, so that the line begins its own (a
        script reading ``^Error:`` lines missed one written after a pipeline's ``print(..., end="")``)."""
        with self._chatter_lock:
            if self._line_open:
                self._line_open = False
                self._write_err_raw("\n")

    def _write_err_raw(self, text: str) -> None:
        if self._stderr_lost:
            return
        try:
            self._stderr.write(text)
            self._stderr.flush()
        except OSError:
            self._lose_stderr()

    @contextlib.contextmanager
    def chatter_to_stderr(self) -> Iterator[None]:
        """While a command runs, what the code it calls prints (a pipeline's ``print()``, a library's banner) goes to
        stderr: stdout holds only the command's data. ardiff writes to the stream it was given, never ``sys.stdout``.
        ``sys.stderr`` is the same stand-in (``print(file=sys.stderr)``, warnings, the handlers ``logging`` makes):
        beside a live display, written to the terminal as it is, that text landed in the region the next frame
        redrew."""
        with contextlib.redirect_stdout(_Chatter(self)), contextlib.redirect_stderr(_Chatter(self)):
            yield

    def chatter(self, text: str) -> None:
        """Text that code printed (``_Chatter``): to stderr as it is, dropped once that failed; while a live display
        runs, each line, once it ends, above the display, as the console prints ardiff's own lines. Under --quiet it
        is held, and shown only before an error (``_show_held``): a pipeline's print, a library's warning at every
        run, wrote to the mail of a cron job that runs ``ardiff -q`` to hear only of failures."""
        if self.quiet:  # no live display then
            with self._chatter_lock:
                self._hold(text)
            return
        while True:
            # Under the display's lock, the one its refresh thread draws under, taken before ours by every thread:
            # a frame drawn between the console's move up over the display and the write of these lines left the
            # top of the display behind (a second title line), and the opposite order deadlocked with a refresh
            # thread whose frame wrote to sys.stderr (a library's warning) while another thread printed.
            live = self._live
            with _lock_of(live), self._chatter_lock:
                if self._live is not live:  # the display started or stopped meanwhile
                    continue
                if live is None:
                    self._write_err_raw(text)
                    if text:
                        self._line_open = not text.endswith("\n")
                    return
                *lines, unfinished = (self._unfinished + text).split("\n")
                # out of the buffer before they print: a frame drawn under them may write to stderr, back to here
                self._unfinished = _as_shown(unfinished)  # a progress bar's updates: its last only
                if lines:
                    try:
                        self._print_above(*lines)
                    except BaseException:  # a stop raised meanwhile (Ctrl-C): the display's end shows them
                        self._unfinished = "\n".join([*lines, self._unfinished])
                        raise
                return

    def _hold(self, text: str) -> None:
        """Under --quiet (and ``_chatter_lock``), ``text`` kept for an error's report, each line as a terminal shows
        it (``_as_shown``): a progress bar that redraws its line with \\r 2000 times filled the HELD_CHARS with its
        redraws, and the line printed before it, the error's cause, was left out. The line not yet ended waits in
        ``_held_line`` (its redraws dropped as they come), the rest in ``_held``, its last ``HELD_CHARS`` only."""
        *lines, line = (self._held_line + text).split("\n")
        kept = "".join(_as_shown(done) + "\n" for done in lines)
        line = _as_shown(line)
        if len(line) > _HELD_LINE_CHARS:  # a line that does not end (dots, one a write): kept as it comes
            kept, line = kept + line, ""
        self._held_line = line
        if kept:
            self._held.append(kept)
            self._held_chars += len(kept)
        while self._held_chars + len(line) > HELD_CHARS:  # the oldest text goes, the end of a long write kept
            first = self._held.popleft()
            cut = min(len(first), self._held_chars + len(line) - HELD_CHARS)
            if cut < len(first):
                self._held.appendleft(first[cut:])
            self._held_chars -= cut
            self._held_dropped += cut

    def _show_held(self) -> None:
        """Under --quiet, what code printed so far (``chatter``), before the error it may explain."""
        with self._chatter_lock:
            text = "".join(self._held) + self._held_line
            if not text:
                return
            dropped = self._held_dropped
            self._held.clear()
            self._held_line = ""
            self._held_chars = self._held_dropped = 0
        if dropped:
            self._write_err(f"({dropped} earlier characters of what the code printed are left out: --quiet keeps "
                            f"the last {HELD_CHARS})")
        self._write_err_raw(text if text.endswith("\n") else text + "\n")

    def _print_above(self, *lines: str) -> None:
        """``lines`` above the live display: their colours kept, other escape sequences dropped (they moved the
        cursor inside the display), any control character left written as ``\\xNN``."""
        from rich.text import Text

        shown = [Text.from_ansi(_as_shown(line).rstrip("\r")) for line in lines]
        shown = [text if visible(text.plain) == text.plain else Text(visible(text.plain)) for text in shown]
        if not self._stderr_lost:  # the caller holds the display's lock (chatter)
            try:
                self._live.console.print(Text("\n").join(shown))
            except OSError:
                self._lose_stderr()

    def _lose_stderr(self) -> None:
        """As coreutils do, a stderr that fails (its disk full) does not stop the work it reports on: its lines are
        dropped from then on. The results, the files and the exit code say how the command went."""
        self._stderr_lost = True
        to_devnull(self._stderr)


def _lock_of(live: Any) -> Any:
    """The lock a Rich ``Live`` draws its frames under (private, in every Rich this supports; a Rich without it
    risks a garbled frame only), or none for no display."""
    return getattr(live, "_lock", None) or contextlib.nullcontext()


def _as_shown(line: str) -> str:
    """``line`` as a terminal shows it: from its last carriage return on (a progress bar redraws its line so), the
    returns that end it aside (a Windows line end, or ``\\r\\r\\n`` as a Windows text stream writes one: its
    second return, taken for a redraw, left the line empty and its text was lost)."""
    return line[line.rfind("\r", 0, len(line.rstrip("\r"))) + 1:]


def _raise_again() -> None:
    """A Rich console's ``on_broken_pipe``, called inside its ``except BrokenPipeError``: raise that error again."""
    raise  # the BrokenPipeError the caller is handling


def _plain_text(console: Any, renderable: Any) -> str:
    """``renderable`` as lines of text (a table without the cell padding at line ends), ending in a newline. Text
    keeps its own lines: wrapped at the console's width, a long path in a file was cut in two."""
    from rich.text import Text

    if isinstance(renderable, Text):
        renderable = renderable.plain
    if not isinstance(renderable, str):
        with console.capture() as captured:
            console.print(renderable)
        renderable = "\n".join(line.rstrip() for line in captured.get().splitlines())
    return renderable.rstrip("\n") + "\n"


def stdout_error(exc: OSError, then: str | None = None) -> Exception:
    """The error a command ends with when its standard output could not be written (exit 1); not for a reader
    that went away (``BrokenPipeError``), which wanted no more. ``then``: how to go on once it is fixed (a rollout's
    resume to paste), if not by running the command again."""
    from ardiff_cli.errors_cli import OutputError
    from ardiff_cli.runtime.errors import WriteHint, file_size_hint

    hint: str = "check the file or device standard output goes to (free space, permissions)"
    if exc.errno == errno.EFBIG:  # `> file` past this process's file-size limit (ulimit -f): no disk is full, and
        # the limit is named as a file's write names it (it read "free space" of a disk with room)
        hint = file_size_hint(WriteHint(hint, then or "run the same command again"))
    elif then is not None:
        hint = WriteHint(hint, then)
    error = OutputError(f"cannot write to standard output: {exc.strerror or exc}", hint=hint)
    error.__cause__ = exc
    return error


def lost_stdout_stop(exc: OSError, then: str | None = None) -> int | Exception:
    """How a command that stops at safe points (``StopSignals.defer``: rollout, warmup) stops once stdout is lost: as
    SIGPIPE when its reader went away (exit 141, as a shell's writer killed by it), else with the write's error
    (``stdout_error``'s, ``then`` its way on)."""
    import signal

    return signal.SIGPIPE if isinstance(exc, BrokenPipeError) else stdout_error(exc, then)


class _Chatter(io.TextIOBase):
    """``sys.stdout`` and ``sys.stderr`` inside ``Output.chatter_to_stderr``: text to the sink (``Output.chatter``).
    What code asks of a real stream is stderr's: its descriptor (``subprocess.run(..., stdout=sys.stdout)``,
    ``faulthandler``), ``encoding``; they raised (``UnsupportedOperation: fileno``) or were None. Its ``buffer``
    takes bytes to the sink too: written to stderr's own, they failed the step once stderr's reader had gone."""

    def __init__(self, out: Output) -> None:
        self._out = out  # the sink whose stderr takes the text
        self.buffer = _ChatterBytes(self)  # bytes, decoded as stderr's encoding, to the same sink

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._out.chatter(text)
        return len(text)

    def fileno(self) -> int:
        return self._out._stderr.fileno()

    def isatty(self) -> bool:
        return _isatty(self._out._stderr)

    @property
    def encoding(self) -> str:
        return getattr(self._out._stderr, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str | None:
        return getattr(self._out._stderr, "errors", None)

    def __getattr__(self, name: str) -> Any:  # buffer, reconfigure, ...: not a TextIOBase's own
        if name.startswith("_"):  # _out itself, before __init__ set it (copy, pickle): no endless recursion
            raise AttributeError(name)
        return getattr(self._out._stderr, name)


class _ChatterBytes(io.BufferedIOBase):
    """``buffer`` of a ``_Chatter``: bytes decoded as stderr's encoding (a character may span writes; bytes it
    cannot decode are written as ``\\xNN``), then as the text it takes."""

    def __init__(self, text: _Chatter) -> None:
        import codecs

        self._text = text  # the text stream whose sink takes the decoded bytes
        self._decoder = codecs.getincrementaldecoder(text.encoding)(errors="backslashreplace")

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self._text.write(self._decoder.decode(bytes(data)))
        return len(data)

    def fileno(self) -> int:
        return self._text.fileno()

    def isatty(self) -> bool:
        return self._text.isatty()


def to_devnull(stream: IO[str]) -> None:
    """Point ``stream``'s file descriptor at /dev/null, and drop what its buffer still holds."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())
        finally:
            os.close(devnull)
        stream.flush()
    except (OSError, ValueError, AttributeError):
        pass


# Control characters but tab and newline (C0, DEL, C1), shown as \xNN: messages quote file names, and a
# name holding ESC [ ... would otherwise recolour or rewrite the terminal reading them. And the line and paragraph
# separators, as \uNNNN: a terminal shows no break there, but Python's str.splitlines() splits at them (as at \x0b,
# \x0c, \x1c-\x1e and \x85), and folders (and the episode names an older safe_name kept) hold them.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x09), *range(0x0b, 0x20), 0x7f, *range(0x80, 0xa0))}
_CONTROLS.update({c: f"\\u{c:04x}" for c in (0x2028, 0x2029)})
# And lone surrogates, which are no characters: stderr wrote them as `\udce9`, stdout as a raw byte (U+DC80-U+DCFF)
# or not at all (UnicodeEncodeError), and Rich measured each as one cell. A byte of a name that the locale could not
# decode (b'caf\xe9' in any locale, b'caf\xc3\xa9' under LC_ALL=C with PYTHONUTF8=0), which Python holds as
# U+DC80-U+DCFF, is `\xNN`, the byte a hint's shell word names (bash's $'caf\xe9'); another (JSON's "\ud800") `\uNNNN`.
_CONTROLS.update({c: f"\\u{c:04x}" for c in range(0xd800, 0xe000)})
_CONTROLS.update({c: f"\\x{c - 0xdc00:02x}" for c in range(0xdc80, 0xdd00)})


def visible(text: str) -> str:
    """``text`` with its control characters (but tab and newline) written as ``\\xNN``, U+2028 and U+2029 (line
    and paragraph separators) as ``\\u2028`` and ``\\u2029``, and a byte the locale could not decode in a name (a
    lone surrogate ``\\udcNN``) as ``\\xNN``, as ``shell_word``'s ``$'...'`` writes it (other lone surrogates as
    ``\\uNNNN``)."""
    return text.translate(_CONTROLS)


def as_text(value: str):
    """User-derived text for a Rich table (episode names, paths, request ids, error messages): never Rich markup
    (``[/]`` in a path was a MarkupError, ``[old]`` vanished), no control characters, one line (``one_line``)."""
    from rich.text import Text

    return Text(one_line(visible(value)))


def one_line(text: str) -> str:
    """``text`` with its newlines and tabs written as ``\\x0a`` and ``\\x09`` too: the one line of an ``Error:``,
    ``hint:``, ``warning:`` or ``debug:`` record, or a plain event. ardiff's messages are one line, but the paths they
    quote are the user's: a folder named ``ep<newline>hint: ...`` cut a record in two, and its second line passed for
    one of ardiff's; a tab in a folder's name read as spaces (Rich expands it), or split a line a script cuts at tabs.
    (The text of another library's exception that spans lines reads on one line too; ``--verbose`` prints it as it
    is.)"""
    return text.replace("\n", "\\x0a").replace("\t", "\\x09")


def _plain_width() -> int:
    """Width for plain tables: $COLUMNS when set, else wide enough that no row wraps (120 split warmup's rows in two
    lines in a file, which a script reading one row a line miscounts)."""
    try:
        return max(40, int(os.environ["COLUMNS"]))
    except (KeyError, ValueError):
        return 10_000

