"""The CLI in a real pseudo-terminal, and a small terminal screen to read what it drew.

``run_in_pty`` starts the command as a terminal's foreground job would run (its own session, the pty as its
controlling terminal, so a typed Ctrl-C is the line discipline's: echoed as ``^C`` and sent as SIGINT to the
process group). ``Screen`` plays the output back the way a VT100-style terminal shows it: the characters, carriage
return, line feed, auto-wrap (with the pending wrap at the last column), cursor up, erase line, and scrolling; it
ignores colours and the other escape sequences. ``Screen.frames`` holds the screen as it stood each time the live
display began to redraw, that is, each frame as the user saw it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

from rich.cells import cell_len

# a live display's redraw starts at its last line: back to column 0, erase, then up and erase once per line
REDRAW = "\r\x1b[2K\x1b[1A"
_ESCAPE = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")
TIMEOUT_S = 120  # the longest wait for the next output, then for the exit


def run_in_pty(args: list[str], *, env: dict[str, str], cwd: Path, cols: int, rows: int,
               type_after: bytes | None = None, release: Path | None = None,
               stdout_to: Path | None = None) -> tuple[int, bytes]:
    """Run ``python -m ardiff_cli ARGS`` in ``cwd`` on a ``cols`` x ``rows`` pty (the size only the pty gives: no
    COLUMNS or LINES); type Ctrl-C once ``type_after`` appeared in its output, then make the file ``release`` (a
    ``held_step`` fault waits for it, so that the run cannot end before the Ctrl-C however late this process
    reads). ``stdout_to``: standard output to that file and standard input from /dev/null, only stderr the pty.
    Returns the exit code and every byte it wrote to the pty."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    environ = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
    environ["TERM"] = "xterm-256color"

    def controlling_terminal() -> None:
        os.setsid()
        fcntl.ioctl(2, termios.TIOCSCTTY, 0)

    data = None if stdout_to is None else open(stdout_to, "w")
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *args], stdin=slave if data is None else
                            subprocess.DEVNULL, stdout=data or slave, stderr=slave, env=environ, cwd=cwd,
                            preexec_fn=controlling_terminal)
    os.close(slave)
    if data is not None:
        data.close()
    output = bytearray()
    try:
        while True:
            ready, _, _ = select.select([master], [], [], TIMEOUT_S)
            assert ready, f"no output for {TIMEOUT_S} s; so far: {bytes(output[-2000:])!r}"
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every process holding the pty's other end has exited
                break
            if not chunk:
                break
            output += chunk
            if type_after is not None and type_after in output:
                os.write(master, b"\x03")
                type_after = None
                if release is not None:
                    release.touch()
    finally:
        os.close(master)
    return proc.wait(timeout=TIMEOUT_S), bytes(output)


def held_step(env: dict[str, str], request: str, release: Path) -> tuple[list[str], dict[str, str]]:
    """The --pipeline option and the environment that hold the forward of ``request``, a step well into the run,
    until the file ``release`` exists (faulty_pipelines' ``sleep`` fault): a run typed Ctrl-C once its output showed
    something ran to its end (exit 0) where this process, on a busy machine, read that output late."""
    fault = {"request": request, "site": "block", "layer": 1, "action": "sleep", "seconds": 600,
             "marker": str(release.with_name(release.name + ".held")), "release": str(release)}
    return ["--pipeline", "faulty_pipelines:FaultyDreamZero"], {**env, "ARDIFF_TEST_FAULTS": json.dumps([fault])}


class Screen:
    """A ``cols`` x ``rows`` terminal: its lines (``display``), those scrolled off its top (``history``) and the
    ``frames`` of a live display (see the module)."""

    def __init__(self, cols: int, rows: int) -> None:
        self.cols, self.rows = cols, rows
        self.cells: list[list[str]] = [[] for _ in range(rows)]  # per line, a string per cell ("" after a wide one)
        self.x = self.y = 0
        self.pending_wrap = False  # the last column was written: the next character goes to the next line
        self.frames: list[list[str]] = []
        self.history: list[str] = []

    def feed(self, data: bytes) -> Screen:
        text = data.decode("utf-8", errors="replace")
        i = 0
        while i < len(text):
            if text.startswith(REDRAW, i):
                self.frames.append(self.display())
            match = _ESCAPE.match(text, i)
            if match:
                self._escape(match.group(1), match.group(2))
                i = match.end()
                continue
            self._char(text[i])
            i += 1
        return self

    def display(self) -> list[str]:
        return ["".join(row).rstrip() for row in self.cells]

    def _escape(self, params: str, command: str) -> None:
        if command == "A":
            self.y = max(0, self.y - int(params or 1))
            self.pending_wrap = False
        elif command == "K" and params == "2":
            self.cells[self.y] = []

    def _char(self, char: str) -> None:
        if char == "\r":
            self.x, self.pending_wrap = 0, False
        elif char == "\n":
            self._line_feed()
        elif char >= " ":
            width = cell_len(char)
            if self.pending_wrap or self.x + width > self.cols:
                self.x = 0
                self._line_feed()
            row = self.cells[self.y]
            row.extend(" " * (self.x + width - len(row)))
            row[self.x:self.x + width] = [char] + [""] * (width - 1)
            self.x += width
            self.pending_wrap = self.x >= self.cols
            if self.pending_wrap:
                self.x = self.cols - 1

    def _line_feed(self) -> None:
        self.pending_wrap = False
        if self.y == self.rows - 1:
            self.history.append("".join(self.cells[0]).rstrip())
            self.cells = self.cells[1:] + [[]]
        else:
            self.y += 1
