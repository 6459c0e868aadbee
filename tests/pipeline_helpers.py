"""Shared pieces of the pipeline tests: tiny pipelines, and a driver that binds KV as the runner does."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.kv.layout import KVLayout
from ardiff_cli.runtime.request import ARDiffusionRequest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def dreamzero(**overrides):
    """A fresh tiny DreamZero pipeline (weights in memory, same as the default checkpoint's)."""
    from pipelines.dreamzero import Config, pipeline_class

    config = Config.from_dict({"preset": "tiny", **overrides}, where="test")
    return pipeline_class().fresh(config)


def causal_world(**overrides):
    from pipelines.causal_world import Config, pipeline_class

    config = Config.from_dict({"preset": "tiny", **overrides}, where="test")
    return pipeline_class().fresh(config)


def make_cache(spec, *, num_sessions: int = 2, dtype: torch.dtype = torch.float32) -> ARDiffusionKVCache:
    return ARDiffusionKVCache(spec, KVLayout.from_spec(spec).managed_pages(num_sessions), dtype=dtype)


class Driver:
    """Binds KV states to a pipeline exactly as the runner does, without the runner."""

    def __init__(self, pipeline, *, num_sessions: int = 2) -> None:
        self.pipeline = pipeline
        self.cache = make_cache(pipeline.ar_diffusion_kv_cache_spec(), num_sessions=num_sessions,
                                dtype=pipeline.dtype)
        self.states = {}
        self._count = 0

    def state(self, session_id: str):
        if session_id not in self.states:
            self.states[session_id] = self.cache.new_state(session_id)
        return self.states[session_id]

    def run(self, session_id: str, inputs: dict) -> dict:
        state = self.state(session_id)
        self._count += 1
        request = ARDiffusionRequest(f"r{self._count}", inputs, {"session_id": session_id})
        with self.pipeline.bind_ar_diffusion_state(session_id, state):
            return self.pipeline.forward(request)

    def close(self, session_id: str) -> None:
        """Eviction / close: release the KV, then the pipeline's close hook."""
        self.states.pop(session_id).close()
        self.pipeline.close_ar_diffusion_session(session_id)

    def reset(self, session_id: str) -> None:
        self.states.pop(session_id).close()
        self.pipeline.reset_ar_diffusion_session(session_id)


class RecordingRollout:
    """The dense reference rollout (the real model, no cache) that also keeps every pass: (branch, segment,
    commit, output). Lets a test check a sampler's update rule against the model's own outputs."""

    def __init__(self, pipeline, *, sink_frames: int, window_frames: int) -> None:
        from pipelines.rollout import DenseReferenceRollout

        self.dense = DenseReferenceRollout(pipeline.transformer, sink_frames=sink_frames,
                                           window_frames=window_frames, cross_names=pipeline.cross_names)
        self.passes: list[tuple[str, object, bool, object]] = []

    def __getattr__(self, name):
        return getattr(self.dense, name)

    def run(self, branch, seg, *, commit):
        out = self.dense.run(branch, seg, commit=commit)
        self.passes.append((branch, seg, commit, out))
        return out

    def commit(self, branch, seg):
        self.dense.commit(branch, seg)
        self.passes.append((branch, seg, True, None))


def wait_for_marker(proc: subprocess.Popen, marker: Path, what: str, *, text: str | None = None) -> None:
    """Poll until a fault of ``faulty_pipelines`` touched ``marker`` (it then sleeps: the process is where the test
    wants its signal to land), or, with ``text``, until the file ``marker`` (the process's stderr, say) holds it.
    Fails if the process exits first, or after 5 minutes; never a timing assertion."""
    deadline = time.monotonic() + 300
    while not (marker.exists() and (text is None or text in marker.read_text())):
        assert proc.poll() is None, proc.communicate()[1] or (marker.read_text() if marker.exists() else "")
        assert time.monotonic() < deadline, f"{what} never started"
        time.sleep(0.02)


def open_to_write(proc: subprocess.Popen, fifo: Path) -> int:
    """A descriptor writing the FIFO ``fifo``, opened once ``proc`` has it open to read (a non-blocking open for
    writing fails with ENXIO until then): ``proc`` then waits there, past its open, until the test writes or closes
    it. Fails if the process exits first, or after 5 minutes."""
    import errno

    deadline = time.monotonic() + 300
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            assert exc.errno == errno.ENXIO and proc.poll() is None and time.monotonic() < deadline, (proc.poll(), exc)
            time.sleep(0.01)



# The numbers of the syscalls the tests watch for, as /proc/PID/syscall writes them, by platform.machine(): x86-64's
# own table, and aarch64's (the kernel's generic one, asm-generic/unistd.h). A test that waits for one skips on a
# machine missing here (``syscall_number``): it would poll /proc for a number that never comes, for 5 minutes.
SYSCALLS = {"x86_64": {"read": "0", "write": "1", "futex": "202"},
            "aarch64": {"read": "63", "write": "64", "futex": "98"}}


def syscall_number(name: str, machine: str | None = None) -> str:
    """The number of syscall ``name`` (``read``, ``write``, ``futex``) on ``machine`` (this one's by default), as
    /proc/PID/syscall writes it; skips the test on a machine ``SYSCALLS`` lacks, naming it."""
    machine = platform.machine() if machine is None else machine
    if machine not in SYSCALLS:
        pytest.skip(f"this test watches /proc/PID/syscall for {name}(2), whose number on {machine!r} is not known: "
                    f"add the machine to SYSCALLS in tests/pipeline_helpers.py")
    return SYSCALLS[machine][name]


def wait_reading(proc: subprocess.Popen, fifo: Path) -> None:
    """Poll until ``proc`` waits in a read(2) of the FIFO ``fifo`` (its syscall ``syscall_number("read")`` in
    /proc/PID/syscall, on a descriptor of that FIFO). A signal sent then interrupts the read and its handler runs; sent
    once the process had opened the FIFO but before its read began, the C half of the handler ran there and the Python
    half waited for the read to return: never, as no one writes the FIFO. Fails if the process exits first, or after 5
    minutes."""
    held = fifo.stat()
    read = syscall_number("read")
    deadline = time.monotonic() + 300
    while True:
        call = Path(f"/proc/{proc.pid}/syscall").read_text().split()
        if call[0] == read:
            with contextlib.suppress(OSError):  # the descriptor closed meanwhile
                at = os.stat(f"/proc/{proc.pid}/fd/{int(call[1], 16)}")
                if (at.st_dev, at.st_ino) == (held.st_dev, held.st_ino):
                    return
        assert proc.poll() is None and time.monotonic() < deadline, (proc.poll(), call[:2])
        time.sleep(0.001)


def stopped_while_reading(proc: subprocess.Popen, fifo: Path, signum: int = signal.SIGINT,
                          timeout: float = 300) -> tuple[str, str]:
    """Send ``signum`` to ``proc`` while it waits to read the FIFO ``fifo`` (a hung mount as a test makes one, no one
    writing it yet) and return its stdout and stderr once it exits; it is killed, and the FIFO's writing end closed,
    whatever happens."""
    writer = None
    try:
        writer = open_to_write(proc, fifo)
        wait_reading(proc, fifo)
        proc.send_signal(signum)
        return proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        if writer is not None:
            os.close(writer)


class UntimedFutex:
    """Whether the thread whose /proc/.../syscall is ``path`` waits in a futex with no timeout (its fourth argument
    NULL): a lock or a torch call's wait that nothing but the test ends. Raises ``AssertionError`` naming the wait
    once the thread has sat ``settle_s`` in one other syscall (the same number and arguments): a Python or C library
    that waits otherwise (a futex with a timeout, another syscall), which was polled for 5 minutes (``wait_blocked``)
    or for ever (a test's own thread, which nothing else stops). Made on a machine whose futex is not known, it skips
    the test (``syscall_number``): make it in the test's own thread."""

    def __init__(self, path: Path, settle_s: float = 30.0) -> None:
        self.futex = syscall_number("futex")
        self.path, self.settle_s = path, settle_s
        self.other: list[str] | None = None  # the other syscall it was last seen in, with its arguments, and since
        self.since = 0.0

    def __call__(self) -> bool:
        call = self.path.read_text().split()
        if call[0:5:4] == [self.futex, "0x0"]:
            return True
        if len(call) >= 7 and call[0] != "-1":  # in a syscall: not "running", nor "-1 SP PC" (stopped outside one)
            if call[:7] != self.other:
                self.other, self.since = call[:7], time.monotonic()
            elif time.monotonic() - self.since > self.settle_s:
                raise AssertionError(f"{self.path}: the thread has waited {self.settle_s:g} s in syscall {call[0]} "
                                     f"(arguments {' '.join(call[1:7])}), not in a futex with no timeout (syscall "
                                     f"{self.futex}, fourth argument 0x0): this Python or C library waits otherwise")
        return False


def wait_blocked(proc: subprocess.Popen, settle_s: float = 30.0) -> None:
    """Poll until ``proc``'s main thread waits in a futex with no timeout (``UntimedFutex``). A signal sent before,
    as a fault's marker appeared, was handled on its way there (its handler ran at once), not inside the wait the
    test is about. Fails if the process exits first, if it waits otherwise (``settle_s`` in one other syscall), or
    after 5 minutes."""
    blocked = UntimedFutex(Path(f"/proc/{proc.pid}/syscall"), settle_s)
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, f"the process exited ({proc.returncode}) before it waited"
        if blocked():
            return
        assert time.monotonic() < deadline, f"the process never waited in a futex with no timeout ({blocked.other})"
        time.sleep(0.001)


# a sitecustomize.py for a CLI subprocess, its folder first on PYTHONPATH: the first import of $HOLD_MODULE waits
# until the FIFO $HOLD is written and closed (once): a rollout held while its model loads, its lock taken
HOLD_IMPORT = """\
import os, sys


class _Hold:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("HOLD_MODULE") and os.environ.get("HOLD"):
            with open(os.environ.pop("HOLD")) as hold:
                hold.read()
        return None


sys.meta_path.insert(0, _Hold())
"""


def records(run: Path) -> list[dict]:
    """The lines of ``run``'s results.jsonl (fails on a partial last line)."""
    text = (run / "results.jsonl").read_text()
    assert text == "" or text.endswith("\n"), "results.jsonl ends in a partial line"
    return [json.loads(line) for line in text.splitlines()]


def outputs(run: Path) -> dict:
    """Every step output file of ``run``, loaded in full (a truncated file would fail here)."""
    from safetensors.numpy import load_file

    assert not list(run.rglob("*.tmp")), "a temporary file was left behind"
    return {p.relative_to(run).as_posix(): load_file(str(p)) for p in sorted((run / "episodes").rglob("*.safetensors"))}


@functools.cache
def ardiff_program(*flags: str) -> str:
    """PATH with a folder first that holds an ``ardiff`` program running this Python's ``-m ardiff_cli`` (``flags``
    before it, ``-P``: as the installed script runs, its working folder not on sys.path): a hint's command that runs
    ``ardiff`` through ``env -C FOLDER ...`` (a folder named with ':') needs a program, not a shell function. The
    folder is removed as the test process ends."""
    folder = Path(tempfile.mkdtemp(prefix="ardiff-bin-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    program = folder / "ardiff"
    program.write_text(f'#!/bin/sh\nexec {shlex.join([sys.executable, *flags])} -m ardiff_cli "$@"\n')
    program.chmod(0o755)
    return os.pathsep.join([str(folder), os.environ.get("PATH", os.defpath)])


def on_path(env: dict[str, str], cwd: Path = REPO) -> str:
    """What a run's resume (or restart) hint starts with where its ``--pipeline`` module was found on ``env``'s
    PYTHONPATH (cli_env's: the repository, tests/, the working folder) by ``python -m ardiff_cli`` run in ``cwd``:
    ``PYTHONPATH=FOLDERS``, the folders Python searched before what is installed, as the run recorded them (the working
    folder, then PYTHONPATH's entries made absolute, an empty one the working folder), each once; then a space."""
    entries = [os.path.abspath(os.path.join(cwd, entry)) for entry in env["PYTHONPATH"].split(os.pathsep)]
    folders = dict.fromkeys([str(cwd), *entries])
    return f"PYTHONPATH={shlex.quote(os.pathsep.join(folders))} "


NOTICE = "finishing the step in flight, then stopping"  # what a rollout says of a first signal in a step


def start_with_fault_files(env, args: list[str], faults: list[dict], tmp_path: Path,
                           waits: Callable[[dict], bool] = lambda fault: True):
    """``ardiff ARGS`` started with ``faults``, those ``waits`` picks given this test's marker and release files (a
    ``sleep`` or ``torch_wait`` one touches the marker, then waits for the release), stderr into a file. (The
    process, the marker, the release and the stderr file.)"""
    marker, release, log = tmp_path / "in-fault", tmp_path / "release", tmp_path / "stderr"
    faults = [{**f, "marker": str(marker), "release": str(release)} if waits(f) else f for f in faults]
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, text=True,
                                env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)}, stdout=subprocess.PIPE,
                                stderr=stderr)
    return proc, marker, release, log


def stop_inside_a_fault(env, args: list[str], faults: list[dict], tmp_path: Path, *, signum: int = signal.SIGTERM,
                        second: bool = False) -> tuple[subprocess.Popen, str]:
    """``ardiff ARGS`` with ``faults`` (a ``sleep`` one given this test's marker and release files): ``signum`` once the
    process sleeps in that fault, then, after the first signal's notice, the same again (``second``) or the fault let
    go on. (The exited process, its stderr.)"""
    proc, marker, release, log = start_with_fault_files(env, args, faults, tmp_path,
                                                        lambda fault: fault.get("action") == "sleep")
    try:
        wait_for_marker(proc, marker, "the fault")
        proc.send_signal(signum)
        wait_for_marker(proc, log, "the notice of the first signal", text=NOTICE)
        if second:
            proc.send_signal(signum)
        else:
            release.touch()  # the forward goes on
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc, log.read_text()
