"""Crash-safe writes: a reader never sees a partial file or a partial line.

Files are written to a temporary name in the same folder, flushed to disk and
renamed over the target (``os.replace`` is atomic on POSIX). JSON-lines logs
are appended one whole line per ``os.write`` call and flushed to disk; on
open, a trailing partial line (only possible after a power loss mid-write) is
cut off, so the log always ends at a line boundary. Files get the mode a plain
``open(path, "w")`` would give them (0666 minus the umask).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from ardiff_cli.output import to_jsonable
from ardiff_cli.runtime.errors import ConfigError, link_to_nothing, too_many_open_files


def _read_umask() -> int:
    """The process umask. ``os.umask`` can only be read by setting it, which is process-global and races with
    other threads creating files, so this runs once, at import, before ardiff starts any thread."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _read_umask()
# mkstemp creates files 0600 whatever the umask; outputs get the mode a plain open(path, "w") would give them.
FILE_MODE = 0o666 & ~UMASK
DIR_MODE = 0o777 & ~UMASK  # likewise for folders made with mkdtemp (0700)


def open_file(path: str | os.PathLike) -> BinaryIO:
    """``open(path, "rb")`` of a regular file; a folder is ``IsADirectoryError``, and a FIFO, socket or device an
    ``OSError`` saying what it is, without waiting: opening a FIFO waited for a writer, forever (a signal only marks
    a stop, so the run hung through SIGTERM), and a device never ends."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting for a writer
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "it is a FIFO, socket or device, not a file", str(path))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


# run.json, summary.json and .swap/kept.json are a few KiB (run.json lists the episodes, about 200 bytes each), and a
# results.jsonl line is one step's: a file past this (a sparse 8 GB one) was read whole, a MemoryError naming no file.
MAX_RUN_FILE_BYTES = 64 << 20


class TooLarge(ValueError):
    """A file, or a line of one, past the size ardiff reads of it."""


def read_capped(f: BinaryIO, limit: int = MAX_RUN_FILE_BYTES) -> bytes:
    """The whole of ``f`` when it holds at most ``limit`` bytes, else :class:`TooLarge`. Read in pieces: ``read(n)``
    allocates its ``n`` first, and a 64 MiB buffer per file read multiplied a resume's heap."""
    pieces, size = [], 0
    while size <= limit and (piece := f.read(min(limit + 1 - size, 1 << 20))):
        pieces.append(piece)
        size += len(piece)
    if size > limit:
        raise TooLarge(f"it takes more than {limit >> 20} MiB, which no file ardiff writes there does")
    return b"".join(pieces)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (ardiff writes no NaN or infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):  # 1e999: the infinity Python's json would read it as
        raise ValueError(f"{text} is beyond the range of a float")
    return value


def parse_json(data: str | bytes, *,
               object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """``json.loads``, with nesting too deep for the parser (``RecursionError``, from a damaged or hostile file of a
    few kilobytes of brackets) raised as the ``ValueError`` every other undecodable text raises. ``NaN`` and
    ``Infinity`` (which Python's json reads, and ardiff never writes) are refused alike: a file edited to hold one was
    read, then failed to be written back (run.json, summary.json: a traceback after the run's steps).
    ``object_pairs_hook``: as ``json.loads``'s."""
    try:
        return json.loads(data, parse_constant=_no_constant, parse_float=_finite_float,
                          object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable. Not every platform can open a directory; skip quietly there."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


STALE_AFTER_S = 3600.0  # a temporary entry nothing changed for this long is a killed writer's, not a slow one's


def temporary_pattern(name: str = ".+", suffix: str = r"\.tmp") -> re.Pattern[str]:
    """The names tempfile gives the temporary entry of a write of a target matching the regular expression ``name``:
    ".NAME." + 8 random characters + ``suffix`` (a regular expression too), as ``atomic_write_bytes`` makes them."""
    return re.compile(rf"\.(?:{name})\.[a-z0-9_]{{8}}{suffix}")


def remove_temporaries(folder: Path, name: str = ".+", suffix: str = r"\.tmp", *,
                       older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """Delete what writes killed midway (``kill -9``, a power loss) left in ``folder``, and return it: the temporary
    files and folders tempfile named for a target matching the regular expression ``name`` (".NAME." + 8 random
    characters + ``suffix``, a regular expression too), that nothing changed for ``older_than_s`` seconds. A write
    in progress, of another process too, changes its entry far more often than that; 0 where no other process can
    own one (a locked run folder). Errors are ignored: this is housekeeping before the work, which must not fail
    for it."""
    import shutil

    pattern = temporary_pattern(name, suffix)
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    removed = []
    for entry in entries:
        with contextlib.suppress(OSError):
            if pattern.fullmatch(entry.name) and (
                    older_than_s <= 0 or now - entry.stat(follow_symlinks=False).st_mtime > older_than_s):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` so that ``path`` holds either the old content or all of ``data``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, FILE_MODE)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Mapping[str, Any]) -> Path:
    return atomic_write_text(path, json.dumps(to_jsonable(obj), indent=2, allow_nan=False) + "\n")


class JsonlAppender:
    """An append-only JSON-lines file whose every line is whole.

    One ``os.write`` per line on an ``O_APPEND`` descriptor (more only after a
    short one: the part written is cut off if the rest fails), then ``fsync``:
    a kill between two lines leaves whole lines only, and a line a kill cut
    short is cut off when the file is opened again (``truncate_partial_line``).
    Callers must write the files a line refers to *before* the line, so a line
    always names a complete file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)  # the log file
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_partial_line(self.path)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # None once closed

    def append(self, record: Mapping[str, Any]) -> None:
        assert self._fd is not None, "append after close"
        line = (json.dumps(to_jsonable(record), separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")
        written = 0
        try:
            # A regular file takes a short write at a full disk or a file-size limit (ulimit -f): the write of the
            # rest then fails with the kernel's reason (ENOSPC, EFBIG), and the part written is cut off
            while written < len(line):
                chunk = os.write(self._fd, line[written:])
                if chunk == 0:
                    raise OSError(f"short write to {self.path} ({written} of {len(line)} bytes); is the disk full?")
                written += chunk
        except BaseException:  # the kernel's error, or a signal handler's between two writes
            if written:  # never half a line
                os.ftruncate(self._fd, os.lseek(self._fd, 0, os.SEEK_END) - written)
            raise
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def truncate_partial_line(path: Path, chunk: int = 1 << 16) -> None:
    """Cut a trailing partial line (no final newline) off ``path``, if any. Reads back from the end, ``chunk`` bytes
    at a time, to the last newline: a long run's results.jsonl is never read whole."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return
        start = end
        while start > 0:
            start = max(0, start - chunk)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
            end = start
        f.truncate(0)


def read_jsonl(path: str | os.PathLike, problem: Callable[[dict[str, Any]], str | None] | None = None, *,
               go_on: str | None = None) -> Iterator[dict[str, Any]]:
    """The whole lines of a JSON-lines file; a trailing partial line is ignored.

    Lines are written whole (:class:`JsonlAppender`), so a whole line that is not a JSON object (or one
    ``problem`` finds fault with) was damaged outside ardiff: that is a ``ConfigError`` naming the file
    and line, never a guess at what it held. ``go_on``: how its hint ends (results.jsonl's: the run's resume to
    paste, ``errors_cli.continue_with``).
    """
    for _, record in read_numbered_jsonl(path, problem, go_on=go_on):
        yield record


def damaged_results_hint(number: int, go_on: str | None = None) -> str:
    """The hint of results.jsonl's damaged line ``number``: deleting it runs its step again, on the run's resume
    (``go_on``: how to go on with it, its command to paste; None: not known, --resume said)."""
    fix = "ardiff writes each line whole, so the file was changed outside ardiff: restore it, or delete line"
    if go_on is None:
        return f"{fix} {number} (its step then runs again with --resume)"
    return f"{fix} {number} (its step then runs again), then {go_on}"


def read_numbered_jsonl(path: str | os.PathLike, problem: Callable[[dict[str, Any]], str | None] | None = None, *,
                        hint: str | None = None, go_on: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """:func:`read_jsonl`'s lines with their line numbers (from 1; blank lines are counted, not yielded); ``hint``:
    the hint of a damaged line's error, when the file is not results.jsonl (``go_on``: how results.jsonl's ends)."""
    path = Path(path)
    try:  # not Path.exists: it says False of a link looping to itself, whose lines were then taken for none
        f = open_file(path)
    except FileNotFoundError:
        return
    except OSError as exc:  # a folder, a file this user may not read: it was a traceback ('a bug in ardiff')
        if too_many_open_files(exc):  # the process's limit, not the file: no invalid input (exit 2)
            raise
        loop = link_to_nothing(path) if exc.errno == errno.ELOOP else None  # "Too many levels of symbolic links"
        if loop:
            raise ConfigError(f"{path}: cannot read it: it is {loop}",
                              hint="replace that link with the file (restore it from a backup)") from None
        folder = isinstance(exc, IsADirectoryError)
        raise ConfigError(f"{path}: cannot read it: " + ("it is a folder, not a file" if folder else
                                                          exc.strerror or str(exc)),
                          hint="move that folder out of the way and restore the file from a backup" if folder
                          else "check that it is a file the user running ardiff may read (permissions r--)") from None
    with f:
        # by lines read at most MAX_RUN_FILE_BYTES at a time: a sparse 8 GB file is one line of zeros
        for number, raw in enumerate(iter(lambda: f.readline(MAX_RUN_FILE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_RUN_FILE_BYTES:
                raise ConfigError(f"{path}, line {number}: it takes more than {MAX_RUN_FILE_BYTES >> 20} MiB, which "
                                  "no line ardiff writes does",
                                  hint="the file was changed outside ardiff: restore it from a backup, or start a new "
                                       "run in another --out")
            if not raw.endswith(b"\n"):
                break
            if not raw.strip():
                continue
            reason = ""
            try:
                record = parse_json(raw)
            except ValueError as exc:  # JSONDecodeError, bytes that are not UTF-8, or parse_json's own refusal
                record = None
                if type(exc) is ValueError:  # parse_json's own: NaN, Infinity, 1e999, nesting; the line may look fine
                    reason = f": {exc}"
            fault = "expected one JSON object per line" + reason if not isinstance(record, dict) else \
                problem(record) if problem is not None else None
            if fault is not None:
                got = raw.rstrip(b"\n").decode("utf-8", "replace")
                raise ConfigError(
                    f"{path}, line {number}: {fault}, got {got[:80]!r}" + ("..." if len(got) > 80 else ""),
                    hint=hint or damaged_results_hint(number, go_on),
                )
            yield number, record
