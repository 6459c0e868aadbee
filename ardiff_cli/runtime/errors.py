"""Typed errors that reach users. The CLI maps each class to a message, a hint and an exit code.

No torch import: the CLI and config parsing use these before loading anything.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import math
import os
import re
import reprlib
import shlex
import stat
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

try:  # now, at start: under a tight `ulimit -v`, importing it (a shared library) once memory ran out would fail too
    import resource
except ImportError:  # not POSIX
    resource = None


class ArdiffError(Exception):
    """Base of every expected failure. ``hint`` says how to fix it."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


class StopRequested(ArdiffError):
    """A deliberate stop raised into the runtime from outside it (the CLI's ``Interrupted``, raised by its signal
    handler wherever the main thread is). The runner never takes it for a failing subscriber, hook or swap: it
    finishes its own bookkeeping and lets it propagate. Any other exception there is a failure of that part."""


class ArdiffWarning(UserWarning):
    """Something the user should know that is not an error (a Python warning; the CLI shows it as ``warning:``)."""


class ConfigError(ArdiffError, ValueError):
    """A config file or value is invalid (exit 2)."""

    exit_code = 2


class BudgetBeyondDeviceError(ConfigError):
    """A memory budget whose plan needs more KV memory than the device has in all (exit 2): the pools would be
    allocated (and zeroed) for it, on CPU an end by the OOM killer. The CLI's hint names what set the budget."""


class CheckpointError(ConfigError):
    """A checkpoint is missing, unreadable, or does not match the config (exit 2)."""

    def __init__(self, message: str, *, hint: str | None = None, details: Iterable[str] = ()) -> None:
        super().__init__(message, hint=hint)
        self.details = tuple(details)  # one line per mismatched key, where the message names only the first few


class NonFiniteWeightsError(CheckpointError):
    """A checkpoint's weights hold NaN or inf in the model's dtype (exit 2): a resume, which keeps the run's dtype and
    checkpoint, says to start a new run instead."""


class ObservationError(ArdiffError, ValueError):
    """An observation file does not match the pipeline's schema (exit 2)."""

    exit_code = 2


class CapacityError(ArdiffError, MemoryError):
    """One session of the configured model does not fit in the memory available (exit 3). ``window_helps`` says
    whether a smaller window could make it fit (False: the rest of the session alone is too large)."""

    exit_code = 3

    def __init__(self, message: str, *, hint: str | None = None, window_helps: bool = True) -> None:
        super().__init__(message, hint=hint)
        self.window_helps = window_helps


class RequestError(ArdiffError, ValueError):
    """A request or runtime call that cannot run as made: a malformed ``ARDiffusionRequest`` (inputs or extra_args
    that are not mappings, a session id that is not a non-empty string, a lifecycle flag that is not a bool)."""

    exit_code = 2


class RequestTypeError(RequestError, TypeError):
    """A runtime call given an object of the wrong type: a dict (or anything else) where an ``ARDiffusionRequest``
    goes, a subscriber that is not callable. A ``TypeError`` too, as Python's own would be; the hint says how to
    build the right object."""


class RequestModeError(RequestError, RuntimeError):
    """A runner set up or called to run more than one request per forward, which it never does: ``max_num_seqs``
    other than 1 or ``step_execution=True`` (refused at load), ``execute_model_batch()`` or ``execute_stepwise()``.
    The hint says what to call instead: ``execute_model(request)``, one request at a time. A ``ValueError`` (as a
    ``RequestError``) and a ``RuntimeError`` too, as the load refusal and the calls raised before."""


class SwapRestoreError(ArdiffError, RuntimeError):
    """A swapped-out session's snapshot could not be restored (a missing, unreadable or corrupt file, or one that
    does not fit this pool or pipeline). The snapshot is deleted and no part of the session stays resident: its
    history must be rebuilt another way (the CLI replays it)."""


class SessionNotResident(RequestError, KeyError):
    """``reset_session`` / ``close_session`` named a session that is not resident: never admitted, or evicted
    (LRU), closed or released since. A ``KeyError`` too."""

    __str__ = Exception.__str__  # the message as written, not KeyError's repr of it


class EngineStateError(ArdiffError, RuntimeError):
    """A call the engine or runner cannot take in its state: a request before ``load()`` or after ``close()``, a
    second ``load()`` of a loaded engine."""


class PipelineError(ArdiffError, RuntimeError):
    """The pipeline raised, or broke the AR-Diffusion contract, while loading or warming up (exit 1).

    The message names the pipeline class and what it did; the pipeline's own exception is the
    ``__cause__`` (its traceback is printed with ``--verbose``). Not a bug in ardiff's runtime.
    """

    exit_code = 1


# a warmup request's non-finite outputs: what to fix is the config, the dtype or the checkpoint, which --resume keeps
DIVERGED_IN_WARMUP = ("the model diverged on the warmup's inputs (every step would fail alike): check the "
                      "config's sampling settings (a guidance scale too large) and the checkpoint")
# the ends of the runtime's notes on a failed request's error that say what became of its session (``add_note``),
# for a caller that goes on with it: released (the forward or the reset it asked for failed), or untouched (its
# inputs refused). A rollout's step error leaves them out, its hint saying what comes next for the episode, which
# does not go on
AFRESH = "its next request starts afresh"
UNTOUCHED = "the session is as it was"
SESSION_NOTES = (AFRESH, UNTOUCHED)
PIPELINE_HINT = ("the pipeline's code (or its use of the AR-Diffusion contract: README, 'Adding a pipeline') "
                 "failed; --verbose prints the traceback. If it is one of ardiff's built-in pipelines, please "
                 "report it")


# What a plain RuntimeError says when memory ran out: CUDA itself and the cuBLAS/cuDNN handles (raised as RuntimeError,
# not OutOfMemoryError, by kernels that allocate outside torch's caching allocator); on the host, torch's CPU allocator,
# or C++'s std::bad_alloc as torch passes it on (importing torch under a tight `ulimit -v`: it was a bug in ardiff).
_GPU_OUT_OF_MEMORY_MESSAGES = ("CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
_OUT_OF_MEMORY_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "std::bad_alloc",
                           *_GPU_OUT_OF_MEMORY_MESSAGES)


def is_out_of_memory(exc: BaseException) -> bool:
    """Host or device out of memory: ``MemoryError`` (the KV page pool's included), torch's ``OutOfMemoryError``
    (CUDA), a ``RuntimeError`` saying so (``_OUT_OF_MEMORY_MESSAGES``), or a library that an address-space limit
    left no room to load (``unmappable_library``)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    if unmappable_library(exc) is not None:
        return True
    return isinstance(exc, RuntimeError) and any(message in str(exc) for message in _OUT_OF_MEMORY_MESSAGES)


# What ran as a model's load sized and allocated its KV pools (``running_out_of_memory_names``): memory running out
# there, unlike as the weights load before, is what a smaller budget or session capacity helps
KV_POOLS_PHASE = "planning and allocating the KV cache pools"
# What ran before them: the weights, which a smaller dtype or model helps, and no KV pool change
WEIGHTS_PHASE = "loading the model's weights (from_config())"


@contextlib.contextmanager
def running_out_of_memory_names(what: str) -> Iterator[None]:
    """Memory running out in the block is told as having run out while ``what`` ran ("loading the weights"): a bare
    ``MemoryError`` said only `Error: MemoryError`. The innermost block names it (``out_of_memory_message``)."""
    try:
        yield
    except BaseException as exc:
        if is_out_of_memory(exc) and not hasattr(exc, "ardiff_while"):
            with contextlib.suppress(MemoryError):  # the attribute's dict may find no memory either: told without it
                exc.ardiff_while = what
        raise


def out_of_memory_message(exc: BaseException) -> str | None:
    """``out of host memory while loading the weights: MemoryError``: which memory ran out (a CUDA device's, or the
    host's), while what ran where ``running_out_of_memory_names`` said, and what was raised. None for what is not
    memory running out, or is told in its own words: the KV page pool's shortage (a ``MemoryError`` subclass), a
    library an address-space limit left no room to load."""
    if not is_out_of_memory(exc) or type(exc) is not MemoryError and isinstance(exc, MemoryError) or (
            unmappable_library(exc) is not None):
        return None
    said = str(exc)
    device = type(exc).__name__ == "OutOfMemoryError" or any(m in said for m in _GPU_OUT_OF_MEMORY_MESSAGES)
    where = getattr(exc, "ardiff_while", None)
    return (f"out of {'GPU' if device else 'host'} memory" + (f" while {where}" if where else "")
            + f": {type(exc).__name__}" + (f": {said}" if said else ""))


_MAP_FAILED = "failed to map segment from shared object"  # the loader's words for an mmap it was refused


def process_limit(name: str) -> int | None:
    """This process's soft limit ``name`` (``"AS"``: its address space in bytes, ``ulimit -v``; ``"NOFILE"``: open
    files, ``ulimit -n``; ``"FSIZE"``: the bytes of a file it writes, ``ulimit -f``), or None when there is none."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(getattr(resource, f"RLIMIT_{name}"))
    return None if soft == resource.RLIM_INFINITY else soft


def unmappable_library(exc: BaseException) -> str | None:
    """The loader's line for a shared library (torch's, numpy's) that could not be mapped under an address-space
    limit (``libtorch_cpu.so: failed to map segment from shared object``), else None. Importing torch under
    ``ulimit -v`` fails so, as an ``ImportError`` (numpy's wraps the line in a page of advice); the loader says
    the same of a ``noexec`` mount, so without a limit it is left to be what it is."""
    if not isinstance(exc, (ImportError, OSError)) or process_limit("AS") is None:
        return None
    line = next((line for line in str(exc).splitlines() if _MAP_FAILED in line), None)
    return None if line is None else line.strip().removeprefix("Original error was: ")


def too_many_open_files(exc: BaseException) -> bool:
    """This process's (``ulimit -n``, RLIMIT_NOFILE) or the system's limit on open files was reached: an ``OSError``
    EMFILE or ENFILE, or a library's error saying so in its text (torch's ``unable to open file <...>: Too many open
    files (24)`` as it reads a checkpoint). The environment's limit, not a failure of the code that opened the file."""
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        return True
    return isinstance(exc, Exception) and os.strerror(errno.EMFILE) in str(exc)  # ENFILE's says it too


def file_too_large(exc: BaseException | None) -> bool:
    """A write refused for its file's size (EFBIG: past this process's ``ulimit -f``, Python ignoring SIGXFSZ, or
    the file system's largest file), in ``exc`` or what caused it. Every later file of that size fails alike."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
            return True
        exc = exc.__cause__
    return False


def file_size_hint(hint: str) -> str:
    """``hint``, of an error this process's file-size limit (``ulimit -f``) caused (EFBIG), saying the limit: no disk
    is full, and every file that size fails alike until it is raised. The limit is the fix of a write's hint
    (``WriteHint``: free space, permissions), which keeps its go-on; any other hint (standard output's, what it says to
    check) is kept whole after it. The limit is said in bytes: ``ulimit -f`` counts blocks (1024 bytes in bash, 512 in
    a POSIX shell), and a limit set in bytes (``prlimit``, a supervisor) is no whole number of them: 2,805 bytes read
    "ulimit -f 2", which is 2,048 in bash and 1,024 in dash."""
    limit = process_limit("FSIZE")
    if limit is None:  # the file system's largest file
        return hint
    raise_it = f"a file reached this process's file-size limit of {limit:,} bytes (ulimit -f): raise it (ulimit -f " \
               "unlimited)"
    return WriteHint(raise_it, hint.go_on) if isinstance(hint, WriteHint) else f"{raise_it}; {hint}"


_ARDIFF_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../ardiff_cli/


def is_broken_invariant(exc: BaseException) -> bool:
    """An ``AssertionError`` raised in ardiff's own code (``ardiff_cli/``): a runtime invariant is broken, a bug.
    One raised elsewhere, in a pipeline's model code (which asserts shapes freely) or a library it calls, is that
    pipeline's failure, as any other exception there."""
    if not isinstance(exc, AssertionError):
        return False
    tb = exc.__traceback__
    if tb is None:  # never raised: no place to tell by
        return True
    while tb.tb_next is not None:  # the innermost frame: where it was raised
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_ARDIFF_PACKAGE)


def as_pipeline_error(where: str, exc: BaseException, *,
                      also: tuple[type[ArdiffError], ...] = ()) -> PipelineError | None:
    """``exc``, raised while ``where`` (the pipeline's code) ran, as a ``PipelineError`` naming it; None for what
    is not the pipeline's to answer for: ardiff's own typed errors (but those of the types ``also``, the pipeline's
    there), memory or open files running out (``too_many_open_files``), a broken runtime invariant
    (``is_broken_invariant``), and anything that is not an ``Exception`` (Ctrl-C)."""
    if not isinstance(exc, Exception) or isinstance(exc, ArdiffError) and not isinstance(exc, also) or (
            is_broken_invariant(exc) or is_out_of_memory(exc) or too_many_open_files(exc)):
        return None
    error = PipelineError(f"{where} failed: {type(exc).__name__}: {exc}", hint=PIPELINE_HINT)
    for note in getattr(exc, "__notes__", ()):
        error.add_note(note)
    return error


_SHOWN = reprlib.Repr()  # keyword arguments need Python 3.12
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 2, 80, 60, 80
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 8


LOOP_OF_LINKS = "(a loop of links)"  # how link_to_nothing ends of a loop


def _loop_start(path: os.PathLike | str) -> tuple[int, str] | int | None:
    """Where the chain of links from the link ``path`` comes back to a link it passed: that link's place on the chain
    (0: ``path`` itself) and its path, absolute; where it does not, the number of links on it (``path`` too), a
    chain longer than the system follows (40 on Linux); None for a loop in a folder above a link."""
    seen: dict[str, int] = {}
    hop = os.fspath(path)
    while True:  # ends: each turn passes a link not passed yet, and there are only so many
        here = os.path.join(os.path.realpath(os.path.dirname(hop) or "."), os.path.basename(hop))
        if here in seen:
            return seen[here], here
        try:
            if not stat.S_ISLNK(os.lstat(here).st_mode):
                return len(seen)
        except OSError as exc:
            return None if exc.errno == errno.ELOOP else len(seen)
        seen[here] = len(seen)
        hop = os.path.join(os.path.dirname(here), os.readlink(here))


def link_to_nothing(path: os.PathLike | str) -> str | None:
    """``"a link to TARGET, which does not exist"`` for a link that leads nowhere (a disk not mounted): a path that
    ``ls`` lists, so "not found" of it reads as a false error; None for anything else, or a path this user may not
    look at (the caller's own error names it). A loop of links is named as one, by the link that loops where that is
    not ``path`` (``a -> b``, ``b -> c -> b``: ``b`` leads back to itself, ``a`` does not); a chain of more links than
    the system follows (ELOOP too), by its length."""
    found = dangling_link(path)
    return None if found is None else found[0]


def dangling_link(path: os.PathLike | str) -> tuple[str, bool] | None:
    """:func:`link_to_nothing`'s words for ``path``, and whether no target made later can end it (a loop of links, or
    more links than the system follows: ELOOP); None as there."""
    try:
        if os.path.islink(path) and not os.path.exists(path):
            target = os.readlink(path)
            try:
                os.stat(path)
            except OSError as exc:  # exists() says False of a loop too: it was "a link to x, which does not exist"
                if exc.errno == errno.ELOOP:
                    loop = _loop_start(path)
                    if isinstance(loop, int):  # no loop: it was "(a loop of links)" too
                        said = f"the first of {loop} links in a row, more than the system follows"
                    elif loop is None:
                        said = f"which leads through more links than the system follows {LOOP_OF_LINKS}"
                    elif loop[0] == 0:
                        said = f"which leads back to itself {LOOP_OF_LINKS}"
                    elif loop[0] == 1:
                        said = f"a link that leads back to itself {LOOP_OF_LINKS}"
                    else:
                        said = f"which leads to {loop[1]}, a link that leads back to itself {LOOP_OF_LINKS}"
                    return f"a link to {target}, {said}", True
            # A link to a link (OUT/.swap -> scratch -> /mnt/disk/swap): what is missing is the last one's target,
            # not the link that `ls` shows there (it was "a link to scratch, which does not exist")
            if os.path.islink(os.path.join(os.path.dirname(os.fspath(path)), target)):
                return (f"a link to {target}, a link that leads to {os.path.realpath(path)}, which does not exist",
                        False)
            return f"a link to {target}, which does not exist", False
    except OSError:
        pass
    return None


UTF8_LOCALE_HINT = "run ardiff in a UTF-8 locale (LANG=C.UTF-8), or with PYTHONUTF8=1"


def unencodable(path: os.PathLike | str) -> str | None:
    """Why ``path``, read from a text file (a config's ``checkpoint:``, run.json), cannot be handed to the system:
    this locale's file name encoding (ASCII under ``LC_ALL=C`` with ``PYTHONUTF8=0``, latin-1) has no bytes for one of
    its characters. ``Path.stat`` raised UnicodeEncodeError there (a traceback as a bug in ardiff) and
    ``Path.exists`` said False (a folder that is there "is gone"). None when it can."""
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        return f"this locale's file name encoding ({exc.encoding}) cannot write {exc.object[exc.start:exc.end]!r}"
    return None


def link_to_nothing_on(path: Path) -> tuple[Path, str] | None:
    """The link among ``path`` and its parents that leads nowhere, and :func:`link_to_nothing`'s words for it: why a
    folder cannot be made at ``path`` where mkdir said only "File exists"; None if none does."""
    return next(((p, why) for p in (path, *path.parents) if (why := link_to_nothing(p))), None)


def not_a_folder(path: Path) -> tuple[Path, str] | None:
    """The path among ``path`` and its parents that exists and is not a folder, and what it is ("a file", "a pipe",
    ...); None if none is (one that cannot be looked at counts as none: mkdir's own error names it)."""
    for p in (path, *path.parents):
        try:
            mode = p.stat().st_mode
        except OSError:
            continue
        if not stat.S_ISDIR(mode):
            kinds = ((stat.S_ISREG, "a file"), (stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket"))
            return p, next((what for test, what in kinds if test(mode)), "a device")
    return None


def weights_in_folder(folder: Path, written: os.PathLike | str) -> str:
    """What a checkpoint path that names ``folder`` should name instead, for its hint: the ``.safetensors`` file in it
    (``written``, the folder as the user wrote it, joined with the file's name), or one of them where it holds
    several (shards, or checkpoints of several steps); '' when it holds none or cannot be listed."""
    try:
        found = sorted(entry.name for entry in os.scandir(folder)
                       if entry.name.endswith(".safetensors") and entry.is_file())
    except OSError:
        return ""
    if not found:
        return ""
    path = as_typed(Path(written) / found[0])
    if len(found) == 1:
        return f"it holds {found[0]}: give that file's path ({path})"
    return (f"it holds {len(found)} .safetensors files: give the path of the one that holds the model's weights (such "
            f"as {path})")


def expand_home(path: str, where: str, *, hint: str) -> str:
    """``path`` with a leading ``~`` made the home folder, as a shell does; a ``ConfigError`` naming ``where`` when
    there is none to find: HOME not set for a user id with no passwd entry (a container run with ``--user 1234``).
    ``os.path.expanduser`` then keeps the ``~`` (a folder named ``~`` made in the working folder) and
    ``Path.expanduser`` raises a bare ``RuntimeError`` (a traceback as a bug in ardiff)."""
    expanded = os.path.expanduser(path)
    if expanded == path and (path == "~" or path.startswith("~/")):
        raise ConfigError(f"{where}: cannot tell which folder ~ is: HOME is not set and user id {os.getuid()} has no "
                          "entry in the password database", hint=hint)
    return expanded


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 step``, ``2 steps``: a count and its noun, singular for one; ``nouns`` is the plural where adding "s"
    is wrong (``plural(n, "shape mismatch", "shape mismatches")``)."""
    return f"{count} {noun}" if count == 1 else f"{count} {nouns or noun + 's'}"


def joined(words: Sequence[str], last: str) -> str:
    """``a``, ``a or b``, ``a, b or c`` (``last``: "or", "and")."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last} {words[-1]}"


def first_of(words: Sequence[str], shown: int, total: int | None = None) -> str:
    """``a, b, c``: the first ``shown`` of ``words``, and how many more of ``total`` (default: all) there are."""
    more = (len(words) if total is None else total) - shown
    return ", ".join(words[:shown]) + (f" and {more} more" if more > 0 else "")


def shell_word(path: os.PathLike | str) -> str:
    """``path`` as one word of a command a hint prints for the user to paste into a shell: quoted where it holds a
    space, a quote, ``$`` or a non-ASCII letter, and written ``./-x`` where it begins with '-', which the command
    (``ln``, ``touch``, ``mkdir``, ``ardiff --out``) would read as an option, and ``./~`` where it begins with '~':
    a folder named ``~``, which ardiff reads as the home folder when quoted (``Path`` drops the ``./`` the user
    wrote before both). A name holding bytes the locale cannot decode (``é`` typed under ``LC_ALL=C`` with
    ``PYTHONUTF8=0``: Python keeps each as a lone surrogate, printed ``\\udcc3``) is bash's ``$'...'`` of its bytes
    (``$'\\xc3\\xa9'``): quoted as text, the pasted command named a folder that does not exist. So is a name holding
    a control character (a newline): a hint's line writes it ``\\x0a`` (``output.visible``, ``one_line``), which
    quoted as text named ``arm\\x0ab``."""
    text = as_typed(path)
    if not any("\udc80" <= char <= "\udcff" or char < " " or "\x7f" <= char <= "\x9f" or char in "\u2028\u2029"
               for char in text):
        return shlex.quote(text)
    raw = text.encode("utf-8", "surrogateescape")  # the bytes the name had on the command line or on disk
    return "$'" + "".join(chr(b) if 32 <= b < 127 and b not in b"'\\" else f"\\x{b:02x}" for b in raw) + "'"


_REPR_ESCAPE = re.compile(r"\\(udc[89a-f][0-9a-f]|.)")


def quoted(text: os.PathLike | str, *, cut: bool = False) -> str:
    """``repr`` of a name the user gave (``'caf\\xe9'``), but a byte of it the locale could not decode (a lone
    surrogate, which ``repr`` writes ``\\udce9``) written ``\\xNN``, as :func:`shell_word` and the output's lines
    write it (``visible``). ``cut``: cut to a line as :func:`shown` cuts it (an option's value of 401 digits)."""
    written = (_SHOWN.repr if cut else repr)(os.fspath(text))
    return _REPR_ESCAPE.sub(lambda m: "\\x" + m[1][3:] if m[1].startswith("udc") else m[0], written)


def as_typed(path: os.PathLike | str) -> str:
    """``path`` as a line to copy from names it (``outputs: DIR``): ``./`` before a leading '~' or '-', which ``Path``
    dropped: without it ardiff (and a shell) read a folder named ``~`` as the home folder, and ``--out`` refuses
    ``-x`` as an option."""
    text = os.fspath(path)
    return f"./{text}" if text.startswith(("~", "-")) else text


def on_pythonpath(command: str, folders: Sequence[str]) -> str:
    """``command``, a rollout to paste, run where Python imports its ``--pipeline MODULE:CLASS`` module from
    ``folders`` (absolute, in order; none: ``command`` as it is): ``PYTHONPATH=/lab:/libs COMMAND``. A folder whose name
    holds ':' (``os.pathsep``), which PYTHONPATH cannot carry (it split ``/x/lab:1`` into ``/x/lab`` and ``1``), is the
    working folder the command is run in, '.' on PYTHONPATH, and a folder inside it is written relative to it:
    ``env -C /x/lab:1 PYTHONPATH=.:src:/libs COMMAND``, whose paths must then be absolute (:func:`needs_absolute`).
    One command, not a subshell ``(cd /x/lab:1 && ...)``: an option the user adds after it, pasting it, is the
    rollout's (after a ``)`` it was a syntax error). No line carries two such folders apart: those not inside the
    first are named after it, in a comment."""
    if not folders:
        return command
    home = next((folder for folder in folders if os.pathsep in folder), None)
    entries, left = [], []
    for folder in folders:
        inside = home is not None and (folder == home or folder.startswith(home.rstrip(os.sep) + os.sep))
        entry = os.path.relpath(folder, home) if inside else folder  # '.' for the folder entered
        if os.pathsep in entry:
            left.append(folder)
        else:
            entries.append(entry)
    line = f"PYTHONPATH={shell_word(os.pathsep.join(entries))} {command}"
    if home is None:
        return line
    left_out = "" if not left else (f"  # not on PYTHONPATH, which cannot carry a '{os.pathsep}' in a name: "
                                    + ", ".join(map(shell_word, left)))
    return f"env -C {shell_word(home)} {line}{left_out}"


def needs_absolute(folders: Sequence[str]) -> bool:
    """Whether :func:`on_pythonpath` of ``folders`` enters another folder first: the command's paths are absolute."""
    return any(os.pathsep in folder for folder in folders)


def rollout_to_paste(out: os.PathLike | str, folders: Sequence[str], before: Sequence[str] = (),
                     after: Sequence[str] = ()) -> str:
    """``ardiff rollout BEFORE --out OUT AFTER`` (``before`` and ``after``: words quoted already) to paste in any
    shell and folder: run where Python imports its ``--pipeline MODULE:CLASS`` module from ``folders`` (the run's
    recorded ones, :func:`on_pythonpath`; none: the rollout as it is), ``out`` absolute where that enters another
    folder first. The restart a lock file records and a run's resume are both written by it."""
    out = Path(out).absolute() if needs_absolute(folders) else out
    return on_pythonpath(" ".join(["ardiff rollout", *before, "--out", shell_word(out), *after]), folders)


@dataclass(frozen=True)
class ResumeCommand:
    """The ``ardiff rollout --resume`` of the run in ``out`` that a hint prints to paste: with the ``--pipeline`` the
    run was started with (``pipeline``, run.json's ``pipeline_option``), which a resume must be given again, and the
    options given to the resume that prints it, which apply to it alone (run.json keeps the run's own), so that the
    one pasted goes on as it did: ``given`` (argv words, as typed) and ``session_capacity``, which a hint of memory
    running out lowers (``command``'s). ``pythonpath``: the folders the run's ``--pipeline`` module was imported from
    (run.json's, as the lock file's restart carries them, :func:`rollout_to_paste`): pasted in another shell or
    folder, the resume imports it there too."""

    out: os.PathLike | str
    pipeline: str | None = None
    given: tuple[str, ...] = ()
    session_capacity: int | None = None
    pythonpath: tuple[str, ...] = ()

    def command(self, session_capacity: int | None = None, more: Sequence[str] = ()) -> str:
        """The line to paste; ``session_capacity``: the one to give in place of ``self.session_capacity``; ``more``:
        words (quoted already) given after its own."""
        capacity = self.session_capacity if session_capacity is None else session_capacity
        words = [] if self.pipeline is None else ["--pipeline", shell_word(self.pipeline)]  # as every hint's paths
        options = [*self.given, *([] if capacity is None else ["--session-capacity", str(capacity)])]
        return rollout_to_paste(self.out, self.pythonpath, ["--resume"], [*words, *map(shlex.quote, options), *more])

    def given_as(self, asked: ResumeCommand) -> ResumeCommand:
        """This run's resume given the options of ``asked``, a resume given another folder (the run's folder as
        CONFIG, a folder of run folders as --out), which the one pasted goes on with: its ``given`` and
        ``session_capacity``; the --pipeline and its folders stay this run's."""
        return replace(self, given=asked.given, session_capacity=asked.session_capacity)

    __str__ = command  # what a hint's f-string prints


class WriteHint(str):
    """The hint of a write that failed, ``FIX, then GO_ON``, that keeps its two parts: ``fix``, what makes the write
    work again (free space, the folder's permissions), and ``go_on``, what to do then (the run's resume to paste, the
    same command again). Under a file-size limit (``ulimit -f``, EFBIG) the CLI says the limit in place of the fix
    and keeps the go-on (``file_size_hint``). A ``str``, so it is a hint wherever one is: text made from
    it (``f"{hint}; ..."``) is a plain ``str``, no longer a write's two parts."""

    fix: str
    go_on: str

    def __new__(cls, fix: str, go_on: str) -> WriteHint:
        hint = super().__new__(cls, f"{fix}, then {go_on}")
        hint.fix, hint.go_on = str(fix), str(go_on)  # plain text: a ResumeCommand's line, as the hint prints it
        return hint

    def __getnewargs__(self) -> tuple[str, str]:  # copy and pickle make it from its parts
        return self.fix, self.go_on


def shown(value: object) -> str:
    """``repr(value)`` cut to a line: a config value may be a YAML alias bomb (a 10-deep list of lists, 10**9
    strings in all) or hold itself, and an error message must neither take minutes nor fill the terminal."""
    return _SHOWN.repr(value)


# safetensors raises its own SafetensorError for a failed write, the system's error only in its text ("I/O error: No
# space left on device (os error 28)"): without the errno, a full disk was not known as one (os_error).
OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error(exc: BaseException, path: object) -> BaseException:
    """``exc`` as the ``OSError`` whose errno its text names (safetensors'), else ``exc`` itself."""
    match = None if isinstance(exc, OSError) else OS_ERROR.search(str(exc))
    if match is None:
        return exc
    code = int(match.group(1))
    return OSError(code, os.strerror(code), str(path))


def yaml_problem(exc: BaseException, text: str = "") -> str:
    """A PyYAML error in one line: ``not valid YAML at line L, column C: problem (context)``. Its own text spans
    five lines, quotes the source as ``"<unicode string>"`` and draws a caret under it. A character the reader
    refuses (ESC, NUL) has only an offset into ``text``, the source: its line and column come from that."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    position = getattr(exc, "position", None)
    if mark is None and isinstance(position, int) and 0 <= position <= len(text):
        where = f" at line {text.count(chr(10), 0, position) + 1}, column {position - text.rfind(chr(10), 0, position)}"
    if hasattr(exc, "character") and hasattr(exc, "reason"):  # a ReaderError: its str() names "<unicode string>"
        character = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
        problem = f"unacceptable character {character}: {exc.reason}"
    else:
        context = getattr(exc, "context", None)
        problem = (getattr(exc, "problem", None) or str(exc)) + (f" ({context})" if context else "")
    return f"not valid YAML{where}: {problem}"


YAML_SYNTAX_HINT = "check the indentation, quotes and brackets there and on the line before"


def yaml_syntax_hint(exc: BaseException) -> str:
    """The hint for a PyYAML error: where a tab is what it refused (an editor's indentation, or after a colon), the
    tab and where it is; else ``YAML_SYNTAX_HINT``."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is not None and isinstance(problem, str) and problem.startswith("found character '\\t'"):
        return (f"YAML indents with spaces, never tabs: replace the tab at line {mark.line + 1}, column "
                f"{mark.column + 1} with spaces")
    return YAML_SYNTAX_HINT


def close_match(name: str, valid: Iterable[str], cutoff: float = 0.6, *,
                stands_for: Mapping[str, str] | None = None) -> str | None:
    """The one name of ``valid`` that ``name`` looks meant as, or None. ``stands_for`` maps a name to what it names
    (a field's aliases to the field): names of one thing count as one, and the first of them alike is offered.

    The rule, case ignored (`MODEL` 'model'):

    1. Alike: a typo of ``name`` (:func:`_is_typo`), one sharing a word with it or one beginning the other
       (:func:`_related`), and close by difflib's ratio (at least ``cutoff``); at the default cutoff or under, also
       a longer name ``name`` begins or whose words hold each of its own (:func:`_within`: `steps`
       'num_inference_steps', `backend` 'attention_backend'), which the ratio leaves out. Letters in common alone
       are no likeness: `depth` is not 'width', `batch` not 'patch_size'.
    2. The closest kind wins: a typo, the nearest (but a name spelt as a word of ``valid``'s is no typo: `reset` is
       'reset_at_window', not 'preset'), then a name beginning with ``name`` (`window` 'window_frames', not
       'reset_at_window'), then one holding it (:func:`_within`: `bfloat` 'bfloat16', not 'float16'), then the rest.
    3. Of that kind, one thing or nothing: of several (`frames` 'frames_per_block' or 'frames_per_request',
       `dreamzero` 'dreamzero-14b' or 'dreamzero-tiny', `num` 'num_heads' or 'num_layers') any one is a guess, and
       a wrong suggestion misleads where none leaves the user the list of valid names.
    4. Nothing where that one differs from ``name`` in a word that picks one of a pair or of a series
       (:func:`_same_sides`): a side (negative, left, min, ...) added, dropped or changed, or another number.
       `prompt` is not 'negative_prompt' (the prompt meant is the one the negative is against), `float64` not
       'float16', and among numbered runs `sweep21` not 'sweep12'; and as one of several, such a name leaves none:
       `dreamzero-1.3b` gets nothing, not 'dreamzero-tiny'. Nothing either where a word of it is that one's with a
       first letter no finger slips to (:func:`_rhymes`): `batch_size` is not 'patch_size'."""
    folded: dict[str, str] = {}
    for item in valid:
        folded.setdefault(item.casefold(), item)  # of names alike but for case, the first
    key = name.casefold()
    if key in folded:
        return folded[key]
    spelt = key in {word for match in folded for word in _WORDS.findall(match)}  # as a word of the names: no typo
    kinds: dict[str, tuple[int, int]] = {}  # each name alike (1.) -> its kind (2.), the closest the lowest
    for match in folded:
        typo = _is_typo(key, match)
        if not (typo or _related(key, match)):
            continue
        within = _within(key, match)
        if typo and spelt and not within:  # `reset` is no typo of 'preset': 'reset_at_window' holds it
            continue
        if not (within and cutoff <= 0.6) and difflib.SequenceMatcher(None, key, match).ratio() < cutoff:
            continue
        kinds[match] = ((0, _edits(key, match)) if typo and not spelt
                        else (1, 0) if len(key) >= 3 and match.startswith(key) else (2, 0) if within else (3, 0))
    closest = min(kinds.values(), default=None)
    meant: dict[str, str] = {}  # what each of the closest names -> the first name of it
    for match, kind in kinds.items():
        if kind == closest:
            meant.setdefault((stands_for or {}).get(folded[match], folded[match]), match)
    if len(meant) != 1:
        return None
    # checked last, another side or number is one of several: left out first, `dreamzero-1.3b` had only the tiny one
    match = next(iter(meant.values()))
    return folded[match] if _same_sides(key, match, folded) and not _rhymes(key, match) else None


def _within(name: str, match: str) -> bool:
    """Whether ``match`` begins with ``name`` (3 letters at least), or holds each word of it (as it is, or a word of
    4 letters or more a beginning away): `gpu_fraction` is within 'gpu_memory_fraction'; `batch` (a letter off
    'patch') not within 'patch_size'."""
    if len(name) >= 3 and match.startswith(name):
        return True
    others = _WORDS.findall(match)
    return all(any(a == b or (min(len(a), len(b)) >= 4 and (a.startswith(b) or b.startswith(a))) for b in others)
               for a in _WORDS.findall(name))


def meant_key(name: str, keys: Iterable[str], takes: Callable[[str], bool]) -> str | None:
    """The key of ``keys`` (a config's top level or a section's) that ``name``, a key not among them, was meant as, or
    None: :func:`close_match`'s, where ``name`` holds its words (:func:`words_of`: `layers` 'num_layers'), named
    whatever the value (`budget: -1` gets 'memory_budget', then its own error there); or where ``takes(match)``, the
    key takes ``name``'s value, and ``name`` is a typo of it (:func:`one_letter_typo`) or holds its words a letter
    off or a beginning away (``words_of(near=True)``: `layer` 'num_layers', `neg_prompt` 'negative_prompt'):
    `reset: true` is no 'preset', a name. Narrower than close_match, which offers a name merely close: `page_size`
    (two letters off 'image_size') or `gpu` (a word of 'gpu_memory_fraction' that qualifies its last: a GPU may be
    the device) is more likely something else, and a wrong suggestion misleads where none leaves the valid keys."""
    match = close_match(name, keys)
    if match is None:
        return None
    near = one_letter_typo(name, match) or words_of(name, match, near=True)
    return match if words_of(name, match) or near and takes(match) else None


def one_letter_typo(name: str, match: str) -> bool:
    """Whether ``match`` is ``name`` with one letter mistyped (:func:`_is_typo`: added, dropped, replaced, or two side
    by side swapped), case ignored: `num_thread` is 'num_threads', `evice` 'device'."""
    name, match = name.casefold(), match.casefold()
    return _is_typo(name, match) and _edits(name, match, 1) <= 1


def words_of(name: str, match: str, *, near: bool = False) -> bool:
    """Whether ``match`` holds each word of ``name`` as it is, case ignored, with its last word among them or no more
    than one other word (at, per, of not counted): `layers` is 'num_layers', `capacity` 'session_capacity', `memory`
    'memory_budget', `reset` 'reset_at_window'. `page_size` (merely close to 'patch_size') is not; nor is `gpu`, one
    word of 'gpu_memory_fraction' that qualifies its last. ``near``: a word of ``name`` may be one of ``match`` a
    letter off (4 letters at least) or a beginning away (3) instead, and the last word of ``match`` is among them:
    `layer` is 'num_layers', `neg_prompt` 'negative_prompt', `time_shift` 'timestep_shift'; `timesteps` is not
    'timestep_shift' (`timesteps: 4` is rather a count of steps), nor `sessions` 'session_capacity'."""
    words, others = _WORDS.findall(name.casefold()), _WORDS.findall(match.casefold())
    if not near:
        return set(words) <= set(others) and (others[-1] in words or len(set(others) - set(words) - _JOINING) <= 1)

    def held(word: str, among: list[str]) -> bool:
        return any(word == other or min(len(word), len(other)) >= 4 and _edits(word, other, 1) <= 1
                   or min(len(word), len(other)) >= 3 and (word.startswith(other) or other.startswith(word))
                   for other in among)

    return all(held(word, others) for word in words) and held(others[-1], words)


_JOINING = frozenset({"at", "per", "of"})  # words that join a name's others: `reset` is 'reset_at_window'


# Words that pick one of a pair: a name with one is another thing than the name without it or with the other side
_SIDES = frozenset({"negative", "positive", "left", "right", "min", "max", "in", "out", "no", "not", "non"})


def _same_sides(name: str, match: str, names: Container[str] = ()) -> bool:
    """Whether ``name`` and ``match`` pick the same of each pair and series: each word of ``_SIDES`` one has, the
    other has too (as it is, a letter off, or a beginning of it: `neg_prompt` is 'negative_prompt', `output` 'out'),
    and their numbers are the same where both have numbers, but for digits swapped (`exterior_image_2` is not
    'exterior_image_1', nor `float64` 'float16', but `bfloat61` is 'bfloat16', `dreamzero-14` 'dreamzero-14b' and
    `evall` 'eval1'). Not so where ``match`` is one of a count (:func:`_counted` in ``names``): there any number
    names a member, and `sweep21` is another run than 'sweep12' beside 'sweep13'."""
    words, others = _WORDS.findall(name), _WORDS.findall(match)
    numbers, other_numbers = ([w for w in ws if w.isdigit()] for ws in (words, others))
    if numbers and other_numbers and numbers != other_numbers and (  # digits swapped: a typo (`bfloat61`)
            [sorted(w) for w in numbers] != [sorted(w) for w in other_numbers] or _counted(match, names)):
        return False
    return all(any(a.startswith(b) or b.startswith(a) or _edits(a, b) <= 1 for b in theirs)
               for ours, theirs in ((words, others), (others, words)) for a in ours if a in _SIDES)


def _counted(match: str, names: Container[str]) -> bool:
    """Whether ``names`` holds ``match`` with one of its numbers one more or one less, as it is written (`sweep12` and
    'sweep13', 'run_010' and 'run_009', 'sweep10' and 'sweep9'): a count, such as run folders, where a number is all
    that tells one member from another. `bfloat16` and 'float32' or 'fp16' and 'fp32' are no count."""
    for number in re.finditer(r"\d+", match):  # padded with zeros only where it is (`sweep9` is before 'sweep10')
        value, width = int(number.group()), len(number.group()) if number.group().startswith("0") else 0
        if any(match[:number.start()] + str(near).zfill(width) + match[number.end():] in names
               for near in (value - 1, value + 1) if near >= 0):
            return True
    return False


def _is_typo(name: str, match: str) -> bool:
    """Whether ``match`` is ``name`` mistyped: an edit for each 4 letters, one at least; a name of 3 letters or fewer
    only missing or swapping a letter (`gpu` is no typo of 'cpu'). A suffix both have (a file name's) is left out."""
    stem, suffix = os.path.splitext(name)
    other, other_suffix = os.path.splitext(match)
    if suffix and suffix == other_suffix and stem and other:
        name, match = stem, other
    most = max(1, len(name) // 4)
    return abs(len(name) - len(match)) <= most and _edits(name, match, most) <= most and (
        len(name) > 3 or all(name.count(c) <= match.count(c) for c in name))


# The letters beside each on a QWERTY keyboard, itself among them (a row is half a key right of the one above it)
_ROWS = ("qwertyuiop", "asdfghjkl", "zxcvbnm")
_BESIDE = {letter: row[max(0, i - 1):i + 2] + above[i:i + 2] + below[max(0, i - 1):i + 1]
           for above, row, below in zip(("", *_ROWS), _ROWS, (*_ROWS[1:], "")) for i, letter in enumerate(row)}


def _rhymes(name: str, match: str) -> bool:
    """Whether a word of ``name`` is the word of ``match`` in its place with another first letter, one that no finger
    slips to (not beside it on the keyboard): another word, not a typo (`batch_size` is not 'patch_size', nor
    `batchsize`; `bae_stride` is 'vae_stride', `xterior_image` 'exterior_image')."""
    return any(a[0] != b[0] and b[0] not in _BESIDE.get(a[0], "") and a[1:] and b[1:]
               and (a[1:].startswith(b[1:]) or b[1:].startswith(a[1:]))  # `batchsize`: 'patch' run on to 'size'
               for a, b in zip(_WORDS.findall(name), _WORDS.findall(match)) if a.isalpha() and b.isalpha())


def _begins(name: str, match: str) -> bool:
    """Whether one of ``name`` and ``match`` begins the other (3 letters at least): `output` 'out', `ord` 'order'."""
    short, long = sorted((name, match), key=len)
    return len(short) >= 3 and long.startswith(short)


_WORDS = re.compile(r"[^\W\d_]+|\d+")  # the words of a name: runs of letters, runs of digits


def _edits(a: str, b: str, most: int | None = None) -> int:
    """The edits (a letter inserted, deleted, replaced, or two side by side swapped) that make ``a`` into ``b``; with
    ``most``, counted up to it only (more: a number above it, not the count), which spares the rest of the table once
    two rows are past it (a cell comes from its row and the two before): close_match asks it of each of thousands of
    run folders."""
    common = len(os.path.commonprefix((a, b)))  # a prefix both have costs no edit (nor does a suffix)
    a, b = a[common:], b[common:]
    while a and b and a[-1] == b[-1]:
        a, b = a[:-1], b[:-1]
    before, row = None, list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        now = [i]
        for j, y in enumerate(b, 1):
            best = min(row[j] + 1, now[j - 1] + 1, row[j - 1] + (x != y))
            if before is not None and i > 1 and j > 1 and x == b[j - 2] and a[i - 2] == y:
                best = min(best, before[j - 2] + 1)
            now.append(best)
        before, row = row, now
        if most is not None and min(before) > most and min(row) > most:
            return most + 1
    return row[-1]


def _related(name: str, match: str) -> bool:
    """Whether ``match`` (both casefolded) is a suggestion for ``name`` other than a typo of it (:func:`_is_typo`):
    one that is a word of it or has it as a word (`out-dir` 'out'), or one sharing a word of 4 letters or more with
    it, or that word's beginning (`layers` 'num_layers', `patches` 'patch_size'), or one beginning the other
    (:func:`_begins`): `num_step` is not 'num_heads'. A suffix both have (file names') is left out: `.yaml` alone is
    no likeness."""
    stem, suffix = os.path.splitext(name)
    other, other_suffix = os.path.splitext(match)
    if suffix and suffix == other_suffix and stem and other:
        name, match = stem, other
    words, others = _WORDS.findall(name), _WORDS.findall(match)
    if (name in others or match in words) and min(len(name), len(match)) >= 3:  # `out-dir` 'out', `out` 'out_dim'
        return True
    if _begins(name, match):
        return True
    return any(a.startswith(b) or b.startswith(a) or (abs(len(a) - len(b)) <= 1 and _edits(a, b, 1) <= 1)
               for a in words if len(a) >= 4 for b in others if len(b) >= 4)


def did_you_mean(name: str, valid: Iterable[str], *, stands_for: Mapping[str, str] | None = None) -> str:
    """' (did you mean 'x'?)' when ``close_match`` finds one, else ''. Looked for once for a name and its valid names:
    a recording's keys outside the schema are in each of its step files, and each step names them again."""
    return _did_you_mean(name, tuple(valid), tuple((stands_for or {}).items()))


@functools.lru_cache(maxsize=256)
def _did_you_mean(name: str, valid: tuple[str, ...], stands_for: tuple[tuple[str, str], ...]) -> str:
    match = close_match(name, valid, stands_for=dict(stands_for))
    return f" (did you mean {match!r}?)" if match is not None else ""


# What YAML 1.1 (PyYAML's safe_load) reads a plain key as when it is no text: `yes:` under model: was named 'model.True'
_YAML_KEY_SPELLINGS = {True: "yes, on or true", False: "no, off or false", None: "null or ~"}


def yaml_key_note(key: object) -> str:
    """' (a key written yes, on or true, which YAML reads as true)' for a key that YAML read as a boolean or null,
    to follow its name in a message; '' for any other key."""
    if key is None or isinstance(key, bool):
        value = "null" if key is None else str(key).lower()
        return f" (a key written {_YAML_KEY_SPELLINGS[key]}, which YAML reads as {value})"
    return ""


def field_error(where: str, field: str, expected: str, got: object, *, hint: str | None = None) -> ConfigError:
    """A ``ConfigError`` in the one format users see: where, field, expected vs got, and how to fix it."""
    return ConfigError(f"{where}: field {field!r}: expected {expected}, got {shown(got)}",
                       hint=hint or _number_as_text_hint(expected, got) or f"set {field!r} to {expected}"
                       + _bool_note(expected, got))


def _bool_note(expected: str, got: object) -> str:
    """Why a boolean may have come where none is expected: YAML 1.1 reads `on`, `off`, `yes` and `no` unquoted as
    booleans (`attention_backend: off` was "got False", which the user never wrote)."""
    if not isinstance(got, bool) or "true" in expected:
        return ""
    return f"; YAML 1.1 reads {_YAML_KEY_SPELLINGS[got]} unquoted as {str(got).lower()} (quote a word meant as text)"


# A float in YAML 1.1, which PyYAML reads, has a dot before its exponent and a sign in it (1.0e+30, not 1e30)
_EXPONENT = re.compile(r"([-+]?)([0-9][0-9_]*)(\.[0-9_]*)?[eE]([-+]?)([0-9]+)")


def _number_as_text_hint(expected: str, got: object) -> str | None:
    """Why a number came as text, when it did: ``guidance_scale: 1e30`` was refused as "expected a number, got
    '1e30'", which reads as a contradiction."""
    if not isinstance(got, str) or not got.isascii() or not ("number" in expected or "integer" in expected):
        return None  # float() takes other scripts' digits too ('١٢'), which YAML never reads as a number
    try:
        number = float(got.replace("_", ""))
    except ValueError:
        return None
    if not math.isfinite(number):  # nan, inf: YAML's own are .nan and .inf
        return None
    match = _EXPONENT.fullmatch(got.strip())
    if match is None:
        return f"{got!r} is text (quoted), not a number: remove the quotes"
    if "integer" in expected and number.is_integer() and abs(number) < 1e18:
        written = str(int(number))
    else:
        sign, whole, fraction, exponent_sign, exponent = match.groups()
        written = f"{sign}{whole}{fraction if fraction and fraction != '.' else '.0'}e{exponent_sign or '+'}{exponent}"
    return f"YAML (as PyYAML reads it) takes {got!r} for text, not a number: write {written}"
