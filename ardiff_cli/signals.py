"""SIGINT/SIGTERM/SIGHUP handling that never cuts a write in half.

Inside :meth:`StopSignals.critical` (writing a step's output file and its
results line) a signal is only remembered; it is raised as
:class:`~ardiff_cli.errors_cli.Interrupted` as soon as the write is complete.
Inside :meth:`StopSignals.step` (a rollout's step: the request in flight, and
what it writes) the first signal is remembered too, and announced (on a
thread, out before the step ends): the step finishes, so its session holds
whole steps and a stopped run can keep it, and the caller's next
:meth:`StopSignals.check` raises it. A second one is raised at once. Anywhere
else a signal is raised at once, except inside an import: a module cut off
half way through (torch's numpy, say) is left broken for the rest of the run,
and the import machinery and the libraries around it catch what it raises.
There too it is only remembered, and the next safe point
(:meth:`StopSignals.check`) raises it.

A stop raised from the handler can still be caught on its way out, by a
pipeline's or a library's ``except Exception``. So ``check`` raises it again
if the run comes back to a safe point, and :meth:`StopSignals.outcome` (which
leaving the ``with`` block applies) makes it what ended a command that failed
after it.

Several signals stop the command with the first one's exit code (128 + its number), whichever acts on it: the
second, in a step, stops it at once, but SIGTERM then Ctrl-C exits 143. Python runs the handlers of signals that came
while the main thread was inside one call (a torch op) in the order of their numbers, SIGINT's before SIGTERM's, not
in the order they came: the order they came in is read from the signal module's wakeup file descriptor, where the
process's C handler writes each signal's number as it arrives (``_handle``). Python also runs a signal's handler
once for two of the same number that came inside one call (Ctrl-C twice): the wakeup fd has both, so the second
stops the step at once. A signal that comes while the handler of another runs (Python runs its handler at the
handler's next line) is handled once that one is done, as if it came just after: raised in the middle of the first's
handler, as it made the notice's thread, it stopped the step with no notice at all.

A signal the process was started ignoring stays ignored: ``nohup`` ignores
SIGHUP, and a shell ignores SIGINT for a script's background jobs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from types import FrameType

from ardiff_cli import entry
from ardiff_cli.errors_cli import Interrupted

# Ctrl-C, kill, a closed terminal or ssh session (no SIGHUP on Windows)
HANDLED = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
# The handlers that a stopped command's StopSignals replaced and kept replaced (``__exit__``): once the outcome is
# decided (a stop was raised, or ``hold``), a signal is only recorded up to the end of the command, its error's report
# included. Python's own SIGINT handler given back before that raised KeyboardInterrupt into the report (the error
# printed twice) or as the process exited (killed by SIGINT, not exit 130). ``give_back`` restores them.
_held: dict[int, object] = {}
# Whether the command's end gives them back (``give_back``): a test or a library running a command in-process gets its
# own Ctrl-C back. The `ardiff` process does not (``app.main``): it ends with the command, and ignores them as it exits.
give_back_after_command = True
# the most a step's end waits for the notice of a signal that came in it once the notice's thread has begun, for a
# stderr that blocks (``StopSignals._noticed``); before it begins the wait has no bound
NOTICE_WAIT_S = 5.0
# the pipe the signal module writes each signal's number to as it arrives (its wakeup fd), made once: (read, write)
_arrivals: tuple[int, int] | None = None


class StopSignals:
    """Context manager installing the handlers (main thread only; elsewhere it does nothing)."""

    def __init__(self, notice: Callable[[int], object] | None = None) -> None:
        # A signal that arrived inside a critical section, a step or while stopping, or an error to stop with (defer)
        self.pending: int | Exception | None = None
        self._depth = 0  # nesting of critical sections
        self._steps = 0  # nesting of steps (``step``)
        # called with a signal a step goes on after, on a thread of its own: the main thread, which the handler
        # interrupted, may be in the middle of writing to the stream the notice goes to, or hold the lock of what the
        # notice updates (the live panel's phase), so the handler can neither write nor wait for it there
        self._notice = notice
        # the thread showing that notice: the step waits for it as it ends, so the notice comes out before whatever
        # follows the step (the stop's own lines: "saving N resident sessions", its error), never after them
        self._noticing: threading.Thread | None = None
        self._notice_begun = threading.Event()  # that thread runs the notice (set as its first line)
        # Signals that came while the handler of an earlier one ran (a second, as SIGHUP sent to the group and by a
        # shell comes twice; or any under load): each is handled once that handler is done. Raised inside it, one
        # cut its bookkeeping short: as it made or started the notice's thread, it left no notice at all, or a thread
        # unknown to the step, which went on without it
        self._again: list[int] = []
        self._handling = False  # the handler is running (``_handle``)
        self._stopping = False  # a stop was raised already: later signals are only recorded
        self.raised: int | None = None  # the signal the handler raised as ``Interrupted``
        self.first: int | None = None  # the first signal to arrive: the one a stop is raised for
        self._wakeup: int | None = None  # the wakeup fd this one replaced (``_listen``), to put back
        # signals that arrived once the stop was raised or the outcome held: the teardown may cut its optional work
        # short for one (a stopped rollout saving its resident sessions for --resume)
        self.after_stop: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            entry.raise_dropped_stop()  # a signal's stop that Python dropped before the command took the signals
            # A signal while the handlers and the wakeup fd are being set is only recorded, and raised once they are:
            # raised out of here, with no __exit__ to follow, it left the wakeup fd and the handler set for good
            self._depth += 1
            try:
                try:
                    for signum in HANDLED:
                        if signal.getsignal(signum) is not signal.SIG_IGN:
                            self._previous[signum] = signal.signal(signum, self._handle)
                    self._listen()
                finally:
                    self._depth -= 1
                self._raise_pending()
            except BaseException as exc:  # that stop (or a handler not yet replaced raised): undo, as the end does
                self.__exit__(type(exc), exc, exc.__traceback__)
                raise
        return self

    def _listen(self) -> None:
        """Make ``_arrivals`` the wakeup fd, unless another one is (asyncio's loop, an outer StopSignals' own)."""
        global _arrivals
        try:
            if _arrivals is None:
                read, write = os.pipe()
                os.set_blocking(read, False)
                os.set_blocking(write, False)
                _arrivals = read, write
            previous = signal.set_wakeup_fd(_arrivals[1], warn_on_full_buffer=False)
        except (OSError, ValueError):  # no pipe to be had (no descriptor left), or not one it takes (Windows)
            return
        if previous != -1:  # someone else's: it is theirs, and the order of arrival is not known
            signal.set_wakeup_fd(previous)
        else:
            _drain()  # a signal that came before this command is none of its
            self._wakeup = previous

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        for signum, handler in self._previous.items():
            # a StopSignals' handler (this one's, entered again; an outer one's, whose block goes on) is put back: the
            # one to give back once the command ends is the handler from before the outermost
            if self._stopping and not isinstance(getattr(handler, "__self__", None), StopSignals):
                _held.setdefault(signum, handler)
            else:
                signal.signal(signum, handler)
        self._previous.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._wakeup)
            self._wakeup = None
        stop = exc if exc is None else self.outcome(exc)
        if stop is not exc:  # the block failed after a stop was raised into it: the stop is what ended it
            raise stop from exc

    def defer(self, stop: int | Exception) -> None:
        """Stop at the next safe point (``check``, or the end of a critical section) as if signal ``stop`` had
        arrived, or by raising the error ``stop``: the rollout does this when stdout is lost (SIGPIPE when its
        reader is gone, an ``OutputError`` when its disk is full), from inside whatever was emitting an event,
        where raising would cut the runner's bookkeeping short."""
        self.pending = self.pending or stop

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._handling:  # called inside the handler of an earlier signal: handled next, as if it came after it
            self._again.append(signum)
            return
        self._handling = True
        try:
            self._handle_one(signum, frame)
            while self._again:
                self._handle_one(self._again.pop(0), frame)
        except BaseException:
            self.after_stop.extend(self._again)  # they came after the stop was decided
            self._again.clear()
            raise
        finally:
            self._handling = False

    def _handle_one(self, signum: int, frame: FrameType | None) -> None:
        arrived = [number for number in _drain() if number in self._previous]
        if self.first is None:  # not always this one: of two that came inside one torch op, SIGINT is handled first
            self.first = arrived[0] if arrived else signum
        # Python runs a signal's handler once however often it came since the handler last ran (Ctrl-C twice inside
        # one torch op): the wakeup fd has a byte for each, and those beyond one of a number are signals of their own
        merged = list((Counter(arrived) - Counter(set(arrived))).elements())
        for i, one in enumerate([signum, *merged]):
            try:
                self._act(one, frame)
            except Interrupted:
                self.after_stop.extend(merged[i:])  # after the stop, as if they had come one by one
                raise

    def _act(self, signum: int, frame: FrameType | None) -> None:
        """What signal ``signum`` does, the first to arrive being ``self.first`` (``_handle``)."""
        first = self.pending is None
        if self._stopping:
            self.after_stop.append(signum)
        if self._depth or self._stopping or _importing(frame) or (self._steps and first):
            self.pending = self.pending or self.first
            if first and self._steps and not self._stopping and self._notice is not None:
                self._start_notice(self.first)
            return
        self._stopping = True
        self.raised = self.first  # a second signal stops at once, but as the first: SIGTERM then Ctrl-C exits 143
        raise Interrupted(self.first)

    def _start_notice(self, signum: int) -> None:
        """Show the notice of signal ``signum`` on a thread of its own, which the step's end waits for
        (``_noticed``)."""
        begun = self._notice_begun = threading.Event()

        def notice() -> None:
            begun.set()
            self._notice(signum)

        thread = threading.Thread(target=notice, name="ardiff-stop-notice", daemon=True)
        try:
            thread.start()
            self._noticing = thread
        except RuntimeError:  # can't start new thread (a process limit): the stop itself still comes
            pass

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A section no signal interrupts; a signal that arrived meanwhile is raised at its end."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if not self._depth and not self._steps:
            self._raise_pending()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """A section (a rollout's step) that the first signal lets finish: it is only recorded and announced
        (``notice``), and the caller's next ``check`` raises it. A second signal is raised at once, but inside a
        critical section or an import, where it is only recorded as well. The end of a critical section inside a
        step raises nothing."""
        self._steps += 1
        try:
            yield
        finally:
            self._steps -= 1
            try:
                self._noticed()
            except BaseException:  # a second signal, raised at once as the wait began: the notice still comes first
                self._noticed()  # (a third is only recorded now, as the run stops)
                raise

    def _noticed(self) -> None:
        """Wait for the notice of a first signal in the step to be out: its thread may not have run yet, or wait for
        a lock the step held when the signal came, while the main thread goes on to stop the run and says so. Until
        the thread begins, without a bound: a loaded machine (a CI's 2 shared cores) can leave it unscheduled for
        seconds, and a bound there let the stop's lines come before the notice, or the process exit without it. From
        then on NOTICE_WAIT_S: a stderr that blocks (a full pipe nobody reads) must not keep the run from stopping.
        The thread is forgotten only once waited for: a signal that cuts the wait short leaves it to the next call."""
        thread = self._noticing
        if thread is not None:
            while not self._notice_begun.wait(1.0) and thread.is_alive():  # it cannot block before it begins
                pass
            thread.join(NOTICE_WAIT_S)
            self._noticing = None

    def hold(self) -> None:
        """From now on a signal is only recorded, never raised: the command's outcome is decided, and what is left
        (its summary, releasing the model) must run whole for its files to agree with its exit code."""
        self._stopping = True

    def check(self) -> None:
        """A safe point of the normal flow (between steps or a step's requests, once the model is loaded): raise a
        pending signal (as ``Interrupted``) or deferred error now, or the stop the handler raised again: the run is
        back here, so something between caught it."""
        self.reraise()
        self._raise_pending()

    def check_signal(self) -> None:
        """``check``, but a deferred error (``defer``) waits for the next ``check``: the rollout checks here once its
        model is loaded, before its run has a summary to record an error in."""
        if not isinstance(self.pending, Exception):
            self.check()

    def reraise(self) -> None:
        """Raise again the stop the handler raised, if it did: called where it cannot be on its way out."""
        if self.raised is not None:
            raise Interrupted(self.raised)

    def outcome(self, exc: BaseException) -> BaseException:
        """What ended a command that raised ``exc``: the stop the handler raised before, if ``exc`` is not that
        stop (a pipeline caught it and failed with its own error, or cannot go on without what it cut short)."""
        if self.raised is None or isinstance(exc, (Interrupted, KeyboardInterrupt)):
            return exc
        return Interrupted(self.raised)

    def _raise_pending(self) -> None:
        if self.pending and not self._stopping:
            self._stopping = True
            raise self.pending if isinstance(self.pending, Exception) else Interrupted(self.pending)


def give_back() -> None:
    """Restore the handlers that stopped commands kept replaced (``_held``)."""
    while _held:
        signum, handler = _held.popitem()
        signal.signal(signum, handler)


def _drain() -> bytes:
    """The numbers of the signals that arrived since the last call, in the order they came (``_arrivals``)."""
    if _arrivals is None:
        return b""
    got = b""
    with contextlib.suppress(OSError):  # empty (BlockingIOError)
        while chunk := os.read(_arrivals[0], 512):
            got += chunk
    return got


def _leave_arrivals() -> None:
    """In a child forked from this process (a pipeline's worker): ``_arrivals`` is the parent's pipe, and the wakeup fd
    the child inherited writes to it. A signal the child took (a worker stopped by SIGTERM) was read by the parent as
    the first of its own, and the child's handler could read the parent's: the child lets go of it."""
    global _arrivals
    if _arrivals is None:
        return
    try:
        previous = signal.set_wakeup_fd(-1)
    except ValueError:  # not this interpreter's main thread: the pipe stays, a number reused must not be written to
        return
    if previous != _arrivals[1]:  # not the pipe: someone else's, put back
        signal.set_wakeup_fd(previous)
    for fd in _arrivals:
        with contextlib.suppress(OSError):
            os.close(fd)
    _arrivals = None


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_leave_arrivals)


def _importing(frame: FrameType | None) -> bool:
    """Whether the main thread is executing an import (a module's body, or the import system itself)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False
