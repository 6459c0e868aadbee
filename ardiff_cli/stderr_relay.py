"""File descriptor 2 relayed above a live display: what native code writes there (a C library's message, torch's C++
log lines from threads of its own, a child process handed stderr) is printed above the display, as Python's text is.

While the display runs, descriptor 2 is the write end of a pipe that a relay *process* reads, not a thread of this
one; the relay sends what it reads to this process over a socket pair, where a thread prints it (``show``) and
acknowledges it, and keeps every byte until acknowledged::

    native write(2) --pipe--> relay process --socket--> reader thread --show--> console, above the display
                                   |  <------- ack (bytes shown) -------'
                                   '--> the terminal itself: what is unacknowledged once this process is gone

Why a process: a writer that holds the GIL (a C extension writing to stderr inside one call) blocked on a full pipe
until a thread of this process read it, which needed the GIL: a deadlock. The relay buffers without limit, so a
writer never waits on this process. And a crash (``abort()`` after a C++ ``terminate called ...``, a segfault's
``faulthandler`` dump, the OOM killer) loses nothing: the socket's end tells the relay this process is gone, and it
writes what was not shown to the terminal, then copies the pipe there until its last writer (a child that outlived
this process) closes it. It runs in a session of its own, so a typed Ctrl-C or a hangup does not stop it first.

At the display's end descriptor 2 is the terminal again, and the relay sends what the pipe still holds, to be shown
above the display; what a child still running writes to the pipe after that goes to the terminal as it is. A relay
killed meanwhile (the OOM killer) loses what it read and did not send; what the pipe still holds is shown here. No wait
on a silent relay is unbounded: one that says nothing for ``TIMEOUT_S`` once asked to finish (stopped: ``kill -STOP``, a
debugger) is given up on, which costs the display's end ``TIMEOUT_S`` to twice that; one that answers is waited for
however long its text takes to show (given up on, it writes to the terminal what it sent and was not yet
acknowledged: shown twice); where it cannot start (a frozen executable: ``sys.executable`` is no Python) there is
no relay, and descriptor 2 stays as it was. While the display runs, though, a stopped relay holds up each native write
once the pipe is full (64 KiB), until it runs again: no thread here can read the pipe in its stead where the writer
keeps the GIL (the case the relay is a process for), as every thread of this process waits for it then.
"""

from __future__ import annotations

import codecs
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_ACK = struct.Struct("<Q")  # to the relay: a count of bytes shown, or STOP
STOP = 2**64 - 1  # the display ends: descriptor 2 is the terminal again, send what the pipe still holds and close
# to the relay, then back from it before anything it read: it runs. A random token of this run, which a program that
# is no relay (a frozen executable's own CLI, whose complaint goes to stdout: the socket) does not say by chance
HELLO_SIZE = 16
TIMEOUT_S = 5  # the longest silence of the relay, to start or to finish: it replies within milliseconds when it runs
_OUTLIVING: list[subprocess.Popen[bytes]] = []  # relays not yet ended at close(): polled (reaped) by the next

# The relay, run as `python -I -S -c CODE FD`: fd 0 the pipe, fd 1 its end of the socket pair, fd 2 /dev/null until it
# runs (what an executable that is no Python says of its arguments is not shown), then FD, the terminal.
_RELAY = r"""
import os, select, socket, struct, sys
ACK, STOP = struct.Struct("<Q"), %d
os.dup2(int(sys.argv[1]), 2)
os.close(int(sys.argv[1]))
sock = socket.socket(fileno=os.dup(1))
os.close(1)
hello = b""  # the parent's token, echoed: this runs
while len(hello) < %d and (data := sock.recv(%d - len(hello))):
    hello += data
sock.sendall(hello)
pending = bytearray()  # read from the pipe, not yet sent
unacked = bytearray()  # sent, not yet shown by the parent
acks = bytearray()
direct = False  # the display ended, or the parent is gone: the pipe goes to the terminal as it is


def to_terminal(data):
    try:
        view = memoryview(bytes(data))
        while view:
            view = view[os.write(2, view):]
    except OSError:  # the terminal is gone: nothing can be shown
        pass


def take_acks(data):  # True once the parent asks to stop
    acks.extend(data)
    stop = False
    while len(acks) >= ACK.size:
        count = ACK.unpack_from(acks)[0]
        del acks[:ACK.size]
        if count == STOP:
            stop = True
        else:
            del unacked[:count]
    return stop


def finish():  # what the pipe holds now goes to the parent, which shows it, acknowledges, and closes its end
    if pipe_open:
        os.set_blocking(0, False)
        try:
            while data := os.read(0, 65536):
                pending.extend(data)
        except BlockingIOError:
            pass
        os.set_blocking(0, True)
    sock.sendall(pending)
    unacked.extend(pending)
    pending.clear()
    sock.shutdown(socket.SHUT_WR)
    while data := sock.recv(4096):
        take_acks(data)


pipe_open = True  # until its last writer closes it: descriptor 2 restored, children gone
while pipe_open or not direct:
    readable, writable, _ = select.select(([0] if pipe_open else []) + ([] if direct else [sock]),
                                          [sock] if pending and not direct else [], [])
    if 0 in readable:
        data = os.read(0, 65536)
        if not data:  # the parent still shows what it was sent: the socket says when it is done
            pipe_open = False
        elif direct:
            to_terminal(data)
        else:
            pending.extend(data)
    if direct:
        continue
    try:
        if sock in readable:
            data = sock.recv(4096)
            if not data:  # the parent is gone
                raise ConnectionResetError
            if take_acks(data):
                finish()
                raise ConnectionResetError
        if sock in writable:
            sent = sock.send(pending)
            unacked.extend(pending[:sent])
            del pending[:sent]
    except OSError:  # what the parent did not show goes to the terminal, and from now on the pipe too
        to_terminal(unacked + pending)
        unacked.clear(), pending.clear()
        direct = True
""" % (STOP, HELLO_SIZE, HELLO_SIZE)


def _from_environ(name: str, measured: int) -> int:
    """$COLUMNS or $LINES where set to a size, as Rich reads them (0 is none: ``measured``)."""
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() and int(value) else measured


class StderrRelay:
    """Descriptor 2 relayed to ``show`` (see the module) from construction to :meth:`stop`; ``terminal``, a text
    stream on what descriptor 2 was (the terminal), is where the display and ``show`` write meanwhile. Raises
    ``OSError`` where the relay cannot start (no descriptors left, a frozen executable, ``sys.executable`` no Python
    or too slow to echo its token within ``TIMEOUT_S``), with descriptor 2 left as it was."""

    def __init__(self, show: Callable[[str], None], encoding: str, errors: str | None) -> None:
        if getattr(sys, "frozen", False):  # PyInstaller and the like: sys.executable is this program, not Python
            raise OSError(f"no stderr relay in a frozen executable ({sys.executable})")
        self._show = show  # prints text above the display; called from the reader thread
        self._saved = os.dup(2)  # the terminal: the relay's stderr, and descriptor 2 again at stop
        self.terminal = open(self._saved, "w", encoding=encoding, errors=errors or "strict", closefd=False)
        self._decoder = codecs.getincrementaldecoder(encoding)(errors="backslashreplace")
        read_end, write_end = os.pipe()
        mine, theirs = socket.socketpair()
        hello = os.urandom(HELLO_SIZE)
        relay = None
        try:
            mine.sendall(hello)  # waits in the socket for the relay to echo it
            relay = subprocess.Popen([sys.executable, "-I", "-S", "-c", _RELAY, str(self._saved)], stdin=read_end,
                                     stdout=theirs.fileno(), stderr=subprocess.DEVNULL, pass_fds=(self._saved,),
                                     start_new_session=True)
            theirs.close()
            mine.settimeout(TIMEOUT_S)
            echoed = b""
            try:  # a byte that differs ends it: a program that is no relay is not waited for byte by byte
                while len(echoed) < HELLO_SIZE and hello.startswith(echoed):
                    if not (data := mine.recv(HELLO_SIZE - len(echoed))):
                        break
                    echoed += data
            except (TimeoutError, ConnectionResetError):  # silent too long, or ended with the token unread
                pass
            if echoed != hello:
                raise OSError(f"the stderr relay did not start: {sys.executable} -I -S -c ... sent {echoed!r}, "
                              f"not the {HELLO_SIZE} bytes it was sent to echo (no Python?)")
        except BaseException:
            if relay is not None:  # not a relay, or one too slow: gone, and reaped
                relay.kill()
                relay.wait()
            os.close(write_end)
            os.close(read_end)
            mine.close()
            self.terminal.close()
            os.close(self._saved)
            raise
        finally:
            theirs.close()
        self._relay = relay
        # what the pipe holds where the relay stops answering (``stop``) or is killed (``_read``): read and shown
        # here, then closed; until then a write to descriptor 2 never fails for want of a reader (EPIPE)
        self._pipe = read_end
        self._sock = mine  # from the relay: what it read; to it: acknowledgements, then STOP
        # the reader acknowledges while stop() sends STOP; and it puts descriptor 2 back (a relay killed) only before
        # stop() or close() does (``_stopped``): after close() ``_saved`` may be another file's number
        self._send_lock = threading.Lock()
        self._stopped = False
        self._stop_at: float | None = None  # when stop() asked the relay to finish: silent TIMEOUT_S since, it is left
        self._pipe_stat = os.fstat(write_end)  # descriptor 2 until stop(), unless a lost stderr made it /dev/null
        os.dup2(write_end, 2)
        os.close(write_end)
        self.measured = False  # measure() gave a console a size, that the display's end takes back
        self._thread = threading.Thread(target=self._read, name="ardiff-stderr-relay", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        """Show what the relay sends; acknowledge what ends a line: a line not yet ended waits in the display's
        buffer, and the relay keeps it until then, for the terminal if this process dies first."""
        received = acked = 0
        silent = False  # the relay said nothing for TIMEOUT_S after stop() asked it to finish: stopped, or starved
        with self._sock:
            try:
                while True:
                    try:
                        data = self._sock.recv(65536)  # times out after TIMEOUT_S (the socket's timeout)
                    except TimeoutError:
                        stop_at = self._stop_at
                        if silent := stop_at is not None and time.monotonic() - stop_at >= TIMEOUT_S:
                            break
                        continue
                    if not data:
                        break
                    self._show(self._decoder.decode(data))
                    received += len(data)
                    newline = data.rfind(b"\n")
                    if newline >= 0:
                        acked = self._ack(received - len(data) + newline + 1, acked)
                self._show(self._decoder.decode(b"", final=True))
                self._ack(received, acked)  # the display's end shows the line left unfinished
                # the relay's end of the socket: shut for writing where it finished (it waits for this end to close,
                # then copies the pipe to the terminal), closed where it was killed, which refuses this ack of nothing
                with self._send_lock:
                    self._sock.sendall(_ACK.pack(0))
            except OSError:  # the relay was killed: what it read is lost with it; what the pipe holds is shown here
                killed = True
            else:
                killed = False
        with self._send_lock:  # a relay killed left descriptor 2 a pipe only this process reads (once, each write
            if not self._stopped and os.path.samestat(os.fstat(2), self._pipe_stat):  # failed: EPIPE, a child handed
                os.dup2(self._saved, 2)  # it died of SIGPIPE). It lands in the display from then on, as with no
                self._take_pipe()  # relay, and what the pipe held is shown
            elif silent or killed:  # what the pipe holds is shown from here (a relay killed as the display ended)
                self._take_pipe()

    def _take_pipe(self) -> None:
        """Show what the pipe holds now, read from this process's own read end, and close that end (the relay no
        longer reads: killed, or stopped). Called once, under ``_send_lock``."""
        if self._pipe < 0:
            return
        data = bytearray()
        os.set_blocking(self._pipe, False)
        try:
            while chunk := os.read(self._pipe, 65536):
                data += chunk
        except BlockingIOError:
            pass
        os.close(self._pipe)
        self._pipe = -1
        if data:
            self._show(self._decoder.decode(bytes(data), final=True))

    def _ack(self, upto: int, acked: int) -> int:
        if upto > acked:
            with self._send_lock:
                self._sock.sendall(_ACK.pack(upto - acked))
        return max(upto, acked)

    def measure(self, console: Any) -> None:
        """Give the Rich ``console`` the terminal's size, where it would measure none: Rich asks descriptors 0, 1
        and 2, the first that is a terminal, and 2 is the pipe now, so with neither 0 nor 1 one (``--format rich <
        /dev/null > FILE``) it drew 80 x 25 on any terminal, each frame larger than the screen left there. $COLUMNS
        and $LINES still win, as in Rich. Called before each frame (the terminal may be resized)."""
        if self._stopped or os.isatty(0) or os.isatty(1):  # stopped: descriptor 2 is the terminal again
            return
        try:
            columns, lines = os.get_terminal_size(self._saved)
        except OSError:
            return
        self.measured = True
        console.size = (_from_environ("COLUMNS", columns), _from_environ("LINES", lines))

    def stop(self) -> None:
        """Descriptor 2 back to the terminal, once what was written before shows above the display (``terminal``
        stays open for that: :meth:`close` closes it). A relay silent for ``TIMEOUT_S`` (stopped, starved) is
        left: what the pipe holds is shown from here, and what the relay read but did not send goes to the terminal if
        it ever runs again (the socket's end tells it, as a crash of this process). One that answers is waited for."""
        with self._send_lock:
            self._stopped = True
            self._stop_at = time.monotonic()
            os.dup2(self._saved, 2)
            try:  # 8 bytes: never partly sent; a full socket is a relay that reads no more, as a gone one
                self._sock.send(_ACK.pack(STOP), socket.MSG_DONTWAIT)
            except OSError:  # the relay is gone (killed): the reader has seen the socket's end, or will
                pass
        self._thread.join()  # the reader ends once the relay closes the socket, or has been silent TIMEOUT_S

    def close(self) -> None:
        with self._send_lock:  # stop() may have been cut short (Ctrl-C) before it put descriptor 2 back
            if not self._stopped:
                self._stopped = True
                os.dup2(self._saved, 2)
            if self._pipe >= 0:
                os.close(self._pipe)
                self._pipe = -1
        self.terminal.close()
        os.close(self._saved)
        # The relay ends as the pipe's last writer closes it: at once, unless a child of this process still holds
        # it; it goes on copying that child's writes to the terminal meanwhile. Not waited for (a child holding it,
        # `sleep 30 &` from a pipeline, cost each display's end a second): reaped now if it ended, or by the next
        # close() here, or none: the process ends
        if self._relay.poll() is None:
            _OUTLIVING.append(self._relay)
        _OUTLIVING[:] = [relay for relay in _OUTLIVING if relay.poll() is None]
