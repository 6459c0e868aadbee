"""Fault injection into the real DreamZero pipeline, for the reliability tests.

Nothing here is shipped: the faults are context managers that wrap one real
component of a loaded pipeline for the duration of one request (a transformer
block, the sampler, a cross-attention projection, the KV allocator,
``torch.empty``), and ``FaultyDreamZero`` applies them to the requests an
environment variable names, so a real ``ardiff rollout`` subprocess can fail
at a chosen episode, step and layer::

    ARDIFF_TEST_FAULTS='[{"request": "arm_b/000001", "site": "block", "layer": 1}]' \\
        ardiff rollout fast.yaml data/ --pipeline faulty_pipelines:FaultyDreamZero

Each fault is a JSON object:

- ``request``: the request id it fires on (``EPISODE/NNNNNN``, or ``EPISODE/NNNNNN/replay`` for the replay
  of that step while an evicted session is rebuilt);
- ``site``: ``block`` (``layer``, ``call``), ``sampler`` (``call``), ``projection`` (``name``: text or image,
  ``after`` layers), ``cross_oom`` (``torch.empty`` inside ``populate_cross_attention`` raises
  ``torch.OutOfMemoryError``), ``page_shortage`` (the KV allocator is emptied for the request, or ``pages`` of its
  free pages are held), ``close_hook`` (``session``, or ``*`` for every one: its close hook raises, or with
  ``action`` ``ulimit`` lowers this process's limit on open files to 3 (``ulimit -n 3``): every later open is
  EMFILE; no ``request``),
  ``corrupt_swap`` (every swap snapshot file in ``dir``, once written, is overwritten with bytes that are no
  safetensors file, as a failing disk would leave them), ``pools`` (no ``request``: allocating the KV cache pools as
  the model loads raises a bare ``MemoryError()``; with ``pool_over``, only a pool of more pages than that);
- ``action`` (block and sampler): ``raise`` (default), ``oom`` (allocate 1 PiB on the host: torch's CPU allocator
  raises its own RuntimeError), ``memory_error`` (a bare ``MemoryError()``, as Python's allocator raises), ``exit``
  (``typer.Exit(0)``: an exception whose ``exit_code`` is 0), ``emfile`` (``OSError`` EMFILE), ``torch_oom``
  (``torch.OutOfMemoryError``), ``runtime_error`` (a ``RuntimeError`` of the fault's ``message``), ``sleep`` (touch
  ``marker``, then sleep ``seconds``, or until the file ``release``
  exists: for signals that must arrive in the middle of a forward), ``torch_wait`` (touch ``marker``, then wait in
  one torch call, ``torch.futures.Future.wait``, until the file ``release`` exists: signals that come meanwhile are
  handled together as it returns, in the order of their numbers), ``linger`` (a thread keeps the process from
  exiting until ``release`` exists, and touches ``marker`` once the process waits for it; the main thread takes no
  SIGINT or SIGTERM from then on), ``swallow_signal`` (send the process SIGTERM
  twice inside ``try: ... except Exception: pass`` and go on, as a pipeline or library that catches everything
  would: the first only asks the step to finish, the second is raised there) or ``wrap_signal`` (the same, then
  raise its own error ``from`` what it caught);
- ``note`` (block and sampler, action ``raise`` or ``observation_error``, an ``ObservationError`` of the request's
  inputs, as a pipeline's own input check raises): a note (``add_note``) on the error raised;
- ``remove`` (block and sampler): before the action, delete the folder at that path (a recorder's cleanup while
  the run goes on);
- ``pool_over`` (any site): the fault fires only while the KV page pool has more pages than that (memory that runs out
  beside a large pool only, as a lower ``--session-capacity`` would avoid);
- ``probe`` (block and sampler): also keep a weak reference to the first argument (a tensor), and site ``probe`` on
  a later request writes to ``path`` which of those tensors are still alive (after ``gc.collect()``): a failed
  episode must not keep its forward's tensors alive for the rest of the run.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import gc
import json
import logging
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pipelines.dreamzero.pipeline import DreamZeroPipeline

FAULTS_ENV = "ARDIFF_TEST_FAULTS"


PROBES: list[weakref.ref] = []  # input tensors of probed failing blocks


class InjectedFault(RuntimeError):
    """What an injected ``raise`` fault raises (an unexpected exception, as far as ardiff knows)."""


def _act(fault: dict[str, Any], message: str) -> None:
    if "remove" in fault:
        shutil.rmtree(fault["remove"])
    if fault.get("action") in ("swallow_signal", "wrap_signal"):
        try:
            signal.raise_signal(signal.SIGTERM)  # the handler runs before this returns, in the main thread
            signal.raise_signal(signal.SIGTERM)  # and a second one, as a user who wants the run stopped now
        except Exception as exc:  # noqa: BLE001 - the catch-all under test
            if fault["action"] == "wrap_signal":
                raise InjectedFault(message) from exc
        return
    if fault.get("action") == "torch_wait":  # the main thread in one torch call that checks no signal meanwhile
        done = torch.futures.Future()
        threading.Thread(target=_complete_when, args=(done, fault["release"]), daemon=True).start()
        # the marker once the thread is started: a signal the test sends then, handled as Thread.start() ran, stopped
        # the step there and left that thread without its bookkeeping (a KeyError traceback as it began)
        Path(fault["marker"]).write_text(message)
        done.wait()  # Python runs the handlers of the signals that came meanwhile once it returns
        return
    if fault.get("action") == "linger":
        _linger(fault)
        return
    if fault.get("action", "raise") == "sleep":
        Path(fault["marker"]).write_text(message)
        deadline, release = time.monotonic() + float(fault.get("seconds", 120)), fault.get("release")
        while time.monotonic() < deadline and not (release and Path(release).exists()):
            time.sleep(0.02)
        return
    if fault.get("action") == "oom":  # a real host allocation torch's CPU allocator refuses (1 PiB)
        torch.empty(1 << 50, dtype=torch.uint8)
    if fault.get("action") == "memory_error":  # what Python's own allocator raises: no message
        raise MemoryError()
    if fault.get("action") == "exit":  # a library built on click or Typer ending "its" command: exit_code 0
        import typer

        raise typer.Exit(0)
    if fault.get("action") == "emfile":  # the limit on open files reached by a library the forward calls
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), "/tmp/kernel-cache.lock")
    if fault.get("action") == "torch_oom":  # what CUDA's caching allocator raises on a full GPU
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    if fault.get("action") == "observation_error":  # the pipeline's own input check refusing the step's inputs
        from ardiff_cli.runtime.errors import ObservationError

        refused = ObservationError(f"request inputs: {message}")
        if "note" in fault:
            refused.add_note(fault["note"])
        raise refused
    if fault.get("action") == "runtime_error":  # a library's own words for its failure (`std::bad_alloc`, cuBLAS's)
        raise RuntimeError(fault["message"])
    if fault.get("action") == "cuda_oom":  # what a kernel allocating outside torch's allocator raises on a full GPU
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some "
                           "other API call, so the stacktrace below might be incorrect.")
    error = InjectedFault(message)
    if "note" in fault:  # what a library adds to its error (PEP 678), as torch's compiler or pydantic do
        error.add_note(fault["note"])
    raise error


def _complete_when(done: torch.futures.Future, release: str) -> None:
    while not Path(release).exists():
        time.sleep(0.02)
    done.set_result(None)


def _linger(fault: dict[str, Any]) -> None:
    """Keep the process from exiting until ``release`` exists, with a thread that never ends before (a snapshot
    written to a hung disk), which touches ``marker`` once the main thread waits for it as the process exits. The
    main thread takes no SIGINT or SIGTERM from here on: they come to that thread, so the wait for that one is not
    cut short and the handlers of those that came meanwhile run together as it ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

    def linger() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # a new thread has its maker's
        while threading.main_thread().is_alive():  # until the interpreter's exit marks it stopped, then waits
            time.sleep(0.02)
        Path(fault["marker"]).write_text("exiting")
        while not Path(fault["release"]).exists():
            time.sleep(0.02)

    threading.Thread(target=linger, name="lingering", daemon=False).start()


@contextlib.contextmanager
def _fail_on_call(owner: Any, attr: str, call: int, fault: dict[str, Any] | None, message: str) -> Iterator[None]:
    """``owner.attr`` (a callable) acts out ``fault`` on its ``call``-th call; restored on exit."""
    fault = fault or {}
    original = getattr(owner, attr)
    calls = 0

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == call:
            if fault.get("probe"):
                PROBES.append(weakref.ref(args[0]))
            _act(fault, message)
        return original(*args, **kwargs)

    setattr(owner, attr, wrapped)
    try:
        yield
    finally:
        delattr(owner, attr)


def block_fault(pipeline: Any, layer: int, *, call: int = 1, fault: dict[str, Any] | None = None):
    """Transformer block ``layer`` fails on its ``call``-th forward (1: the first commit pass, but for the last
    block, which a commit pass runs only as far as its K/V: its first forward is the first sampling pass)."""
    return _fail_on_call(pipeline.transformer.blocks[layer], "forward", call, fault,
                         f"injected fault in transformer block {layer} (call {call})")


def last_block_kv_fault(pipeline: Any, *, call: int = 1):
    """The last transformer block fails projecting its K/V in the ``call``-th commit pass, after every other
    layer wrote its K/V into the pass's pages."""
    return _fail_on_call(pipeline.transformer.blocks[-1], "key_values", call, None,
                         f"injected fault in the last block's K/V projection (commit pass {call})")


def sampler_fault(pipeline: Any, *, call: int = 2, fault: dict[str, Any] | None = None):
    """The sampler's velocity evaluation fails on its ``call``-th use (after the commit pass wrote KV)."""
    return _fail_on_call(pipeline, "_velocity", call, fault, f"injected fault in the sampler (velocity call {call})")


@contextlib.contextmanager
def projection_fault(pipeline: Any, name: str = "text", *, after: int = 1) -> Iterator[None]:
    """The ``name`` cross-attention projection iterable raises after yielding ``after`` layers' (k, v)."""
    attr = f"project_{name}"
    original = getattr(pipeline.transformer, attr)

    def project(states: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for layer, pair in enumerate(original(states)):
            if layer == after:
                raise InjectedFault(f"injected fault in the {name} projection at layer {layer}")
            yield pair

    setattr(pipeline.transformer, attr, project)
    try:
        yield
    finally:
        delattr(pipeline.transformer, attr)


@contextlib.contextmanager
def cross_attention_oom() -> Iterator[None]:
    """``torch.empty`` raises ``torch.OutOfMemoryError`` when ``populate_cross_attention`` copies a layer."""
    real = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        if sys._getframe(1).f_code.co_name == "populate_cross_attention":
            raise torch.OutOfMemoryError("injected: CUDA out of memory. Tried to allocate 2.00 MiB")
        return real(*args, **kwargs)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


@contextlib.contextmanager
def corrupt_swap(directory: str) -> Iterator[None]:
    for thread in threading.enumerate():  # the snapshot written in the background lands first
        if thread.name == "ardiff-swap-writer":
            thread.join(timeout=60)
    for path in Path(directory).glob("*.safetensors"):
        path.write_bytes(b"not a snapshot: the disk lost it")
    yield


@contextlib.contextmanager
def swap_folder_replaced(directory: str) -> Iterator[None]:
    """The swap folder turns into a file (as good as read-only to root): every later snapshot fails as it starts."""
    for thread in threading.enumerate():  # the snapshot written in the background lands first
        if thread.name == "ardiff-swap-writer":
            thread.join(timeout=60)
    shutil.rmtree(directory, ignore_errors=True)
    Path(directory).write_text("not a folder: no snapshot can be written here")
    yield


@contextlib.contextmanager
def page_shortage(allocator: Any, pages: int | None = None) -> Iterator[list[int]]:
    """Hold every free page (a leak elsewhere, or a plan too small), or ``pages`` of them where fewer are free (a
    plan short of that many pages: a pool of more sessions has them to spare); give them back after."""
    stolen = allocator.allocate(allocator.num_free if pages is None else min(pages, allocator.num_free))
    try:
        yield stolen
    finally:
        allocator.free(stolen)


@contextlib.contextmanager
def _probe(path: str) -> Iterator[None]:
    gc.collect()
    Path(path).write_text(json.dumps([ref() is not None for ref in PROBES]))
    yield


def _pools_fault(pool_over: int) -> None:
    """Memory that runs out as the runner allocates KV cache pools of more than ``pool_over`` pages."""
    from ardiff_cli.runtime import runner

    allocate = runner.ARDiffusionKVCache

    def pools(spec: Any, num_pages: int, *args: Any, **kwargs: Any) -> Any:
        if num_pages > pool_over:
            raise MemoryError()
        return allocate(spec, num_pages, *args, **kwargs)

    runner.ARDiffusionKVCache = pools


class HeldClock:
    """``time.monotonic`` that stands still while the file ``hold`` exists, ahead by the seconds written in it (none:
    0), and goes on from its last reading once the file is gone. It never goes back.

    A --follow run's windows (END settles after ``_END_SETTLE``, an episode or a watched folder idles out after
    --idle-timeout) are real time: a test that had to write a file before one closed failed whenever it was paused
    that long (a busy CI machine). Held, a window closes only as the test says, however long the test takes."""

    def __init__(self, hold: str) -> None:
        self.hold = Path(hold)  # the test's file: the clock stands still while it exists
        self._offset = 0.0  # the clock's reading minus time.monotonic(), while not held
        self._held_from: float | None = None  # the clock's reading as the hold in progress began (None: not held)
        self._last = -float("inf")  # its last reading

    def __call__(self) -> float:
        try:
            ahead = float(self.hold.read_text() or 0)  # empty as the test rewrites it: the max below keeps it
        except FileNotFoundError:
            if self._held_from is not None:  # the hold ended: the clock goes on from where it stood
                self._held_from, self._offset = None, self._last - time.monotonic()
            reading = time.monotonic() + self._offset
        else:
            if self._held_from is None:
                self._held_from = time.monotonic() + self._offset
            reading = self._held_from + ahead
        self._last = max(self._last, reading)
        return self._last


def _hold_the_clock(hold: str, after: str | None) -> None:
    """The run's ``StepScheduler`` with a ``HeldClock`` of ``hold``; with ``after`` (``EPISODE ended``), one that
    makes ``hold`` as it hands out that episode's end (the run says it after: the test that reads it finds the clock
    held already)."""
    from ardiff_cli import rollout
    from ardiff_cli.io.stream import EpisodeEnded, StepScheduler

    clock = HeldClock(hold)

    class HeldScheduler(StepScheduler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, clock=clock, **kwargs)

        def next(self) -> Any:
            item = super().next()
            if isinstance(item, EpisodeEnded) and f"{item.episode.name} ended" == after:
                clock.hold.touch()
            return item

    rollout.StepScheduler = HeldScheduler


def _hold_swap_write(fault: dict[str, Any]) -> None:
    """``save_file`` of safetensors (the swap writer imports it as it writes) held half way through the first
    snapshot's temporary file: a test kills the process there, where a poll for a partial file had to catch a write
    that lasts a moment (a test process not scheduled meanwhile missed every one)."""
    import safetensors.torch

    save_file, held = safetensors.torch.save_file, []

    def save(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str] | None = None) -> None:
        if not held:
            held.append(filename)
            data = safetensors.torch.save(tensors, metadata=metadata)
            descriptor, temporary = tempfile.mkstemp(prefix=".tmp", dir=os.path.dirname(filename))
            with os.fdopen(descriptor, "wb") as f:
                f.write(data[:len(data) // 2])
                f.flush()
                Path(fault["marker"]).write_text(filename)
                while not Path(fault["release"]).exists():
                    time.sleep(0.02)
            os.unlink(temporary)
        save_file(tensors, filename, metadata=metadata)

    safetensors.torch.save_file = save


def load_faults() -> list[dict[str, Any]]:
    return json.loads(os.environ.get(FAULTS_ENV) or "[]")


class FaultyDreamZero(DreamZeroPipeline):
    """DreamZero with the faults of ``$ARDIFF_TEST_FAULTS`` (none: exactly DreamZero, same checkpoint).

    Site ``clock`` (no ``request``): the follow scheduler's clock stands still while the file ``hold`` exists,
    ahead by the seconds written in it (``HeldClock``); with ``after`` (``EPISODE ended``), the scheduler makes
    ``hold`` itself as it hands out that episode's end, before the run says so. Site ``swap_write`` (no
    ``request``): the first swap snapshot's write stops half way through its temporary file (``.tmpXXXXXX`` beside
    the file, as safetensors writes one), touches ``marker`` and waits there until ``release`` exists, then writes
    the file. Site ``load`` (no ``request``) sleeps while the pipeline loads, after touching ``marker`` (or
    takes the ``action`` given: ``swallow_signal``, ``wrap_signal``, ``raise``). Site ``import`` (no
    ``request``) imports ``interrupted_dependency`` while it loads, as an optional dependency: what the import
    raises is taken for the module's absence. Site ``free_memory`` (no ``request``): the host has ``bytes`` free
    from then on, as the runner reads it to plan without a budget (another process took the rest).
    """

    @classmethod
    def from_config(cls, config, **kwargs):
        for fault in load_faults():
            if fault["site"] == "load":
                _act({"action": "sleep", **fault}, "loading")
            if fault["site"] == "free_memory":
                from ardiff_cli.runtime import runner

                runner.available_host_memory = lambda: int(fault["bytes"])
            if fault["site"] == "pools":
                _pools_fault(fault.get("pool_over", -1))
            if fault["site"] == "swap_write":
                _hold_swap_write(fault)
            if fault["site"] == "clock":
                _hold_the_clock(fault["hold"], fault.get("after"))
            if fault["site"] == "import":
                try:
                    import interrupted_dependency  # noqa: F401
                except Exception:  # noqa: BLE001 - as libraries import their optional dependencies
                    pass
        return super().from_config(config, **kwargs)

    def forward(self, request):
        with contextlib.ExitStack() as stack:
            for fault in load_faults():
                if fault.get("request") == request.request_id and self._pool_over(fault):
                    stack.enter_context(self._install(fault))
            return super().forward(request)

    def _pool_over(self, fault: dict[str, Any]) -> bool:
        """Whether the fault fires with this KV pool: always, or with ``pool_over`` only while the pool has more pages
        than that (the activations of a step fit beside a smaller pool, as on a device short of memory)."""
        if "pool_over" not in fault:
            return True
        _session_id, state = self._bound
        return state._cache.allocator.num_pages > int(fault["pool_over"])

    def _install(self, fault: dict[str, Any]):
        site = fault["site"]
        if site == "block":
            return block_fault(self, int(fault.get("layer", 0)), call=int(fault.get("call", 1)), fault=fault)
        if site == "sampler":
            return sampler_fault(self, call=int(fault.get("call", 2)), fault=fault)
        if site == "projection":
            return projection_fault(self, fault.get("name", "text"), after=int(fault.get("after", 1)))
        if site == "cross_oom":
            return cross_attention_oom()
        if site == "probe":
            return _probe(fault["path"])
        if site == "corrupt_swap":
            return corrupt_swap(fault["dir"])
        if site == "swap_folder_replaced":
            return swap_folder_replaced(fault["dir"])
        if site == "page_shortage":
            _session_id, state = self._bound
            return page_shortage(state._cache.allocator, fault.get("pages"))
        raise ValueError(f"unknown fault site {site!r}")

    def close_ar_diffusion_session(self, session_id: str) -> None:
        super().close_ar_diffusion_session(session_id)
        for fault in load_faults():
            if fault["site"] != "close_hook" or fault.get("session") not in (session_id, "*"):
                continue
            if fault.get("action") == "ulimit":  # every open from here on is EMFILE: three descriptors are stdio's
                resource.setrlimit(resource.RLIMIT_NOFILE, (3, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
                continue
            raise InjectedFault(f"injected fault in the close hook of {session_id!r}")


# A handler made as the module is imported (inside the command, as a pipeline's module is): it keeps the sys.stderr
# of that moment, as torch's loggers do
_CHATTY_LOG = logging.getLogger("faulty_pipelines.chatty")
_CHATTY_LOG.addHandler(logging.StreamHandler())
_CHATTY_LOG.propagate = False


class ChattyDreamZero(DreamZeroPipeline):
    """DreamZero that prints in its forward as pipelines do, each line naming the request: bytes to
    ``sys.stdout.buffer`` (first: with stderr's reader gone, the first write meets the broken pipe), ``print()``, a
    line to ``sys.stderr``, a ``logging`` warning through Python's default handler and one through a handler made at
    import. The request ``$ARDIFF_TEST_UNFINISHED`` names then leaves a line unfinished (no newline), and the one
    ``$ARDIFF_TEST_CHATTY_FAIL`` names then fails (``InjectedFault``)."""

    def forward(self, request):
        name = request.request_id
        sys.stdout.buffer.write(f"chatty: bytes {name}\n".encode())
        sys.stdout.buffer.flush()
        print(f"chatty: print {name}")
        print(f"chatty: stderr {name}", file=sys.stderr)
        logging.getLogger("chatty").warning("chatty: logging %s", name)
        _CHATTY_LOG.warning("chatty: handler %s", name)
        if name == os.environ.get("ARDIFF_TEST_UNFINISHED"):
            print(f"chatty: unfinished {name}", end="", flush=True)
        if name == os.environ.get("ARDIFF_TEST_CHATTY_FAIL"):
            raise InjectedFault(f"injected fault in {name}")
        return super().forward(request)


class StrayDreamZero(DreamZeroPipeline):
    """DreamZero whose forward writes what a live display does not expect, each line naming the request, by the ways
    ``$ARDIFF_TEST_STRAY`` lists (comma-separated): ``warn`` (``warnings.warn``), ``thread_warn`` (``warnings.warn``
    from a thread of its own, which the forward waits for), ``fd2`` (``os.write`` to file descriptor 2, as native
    code writes: a C library's message, torch's C++ log lines from threads of its own), ``child`` (a child process
    handed descriptor 2 writes a line there, then holds it 2 s more, past the step), ``flood`` (in the first
    request only, 5000 lines, 100 KiB, more than a pipe holds, in one C call that keeps the GIL) and ``abort`` (in
    request ep_0/000003, a C++ runtime's last words to descriptor 2, then ``abort()``) and ``kill_relay`` (in request
    ep_0/000001, the relay process that reads descriptor 2 under a live display is killed, as the OOM killer may) and
    ``stop_relay`` (in request ep_0/000001, the relay is stopped, ``kill -STOP``, until this process has exited)."""

    def forward(self, request):
        name = request.request_id
        ways = os.environ.get("ARDIFF_TEST_STRAY", "").split(",")
        if "warn" in ways:
            warnings.warn(f"stray: warn {name}")
        if "thread_warn" in ways:
            thread = threading.Thread(target=warnings.warn, args=(f"stray: thread_warn {name}",))
            thread.start()
            thread.join()
        if "fd2" in ways:
            os.write(2, f"stray: fd2 {name}\n".encode())
        if "child" in ways:  # `cmd 2>&1 &` from a pipeline: a child handed descriptor 2 that outlives the step
            subprocess.Popen(["sh", "-c", 'echo "stray: child $0" >&2; exec sleep 2', name], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL)
        if "flood" in ways and not getattr(self, "_flooded", False):
            self._flooded = True
            flood = b"".join(b"stray: flood %05d\n" % i for i in range(5000))
            ctypes.PyDLL(None).write(2, flood, len(flood))  # PyDLL: the call keeps the GIL
        if "kill_relay" in ways and name == "ep_0/000001":
            _kill_relay()
        if "stop_relay" in ways and name == "ep_0/000001":
            _stop_relay()
        if "abort" in ways and name == "ep_0/000003":
            os.write(2, b"terminate called after throwing an instance of 'stray::Error'\n")
            os.abort()
        return super().forward(request)


def _relay_pid() -> int:
    """This process's stderr relay (``ardiff_cli.stderr_relay``, a child running ``python -I -S -c``)."""
    children = [int(pid) for task in os.listdir("/proc/self/task")
                for pid in Path(f"/proc/self/task/{task}/children").read_text().split()]
    relays = [pid for pid in children if b"\0-I\0-S\0-c\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(relays) == 1, f"not one relay among the children {children}"
    return relays[0]


def _state(pid: int) -> str:
    """A process's state letter in /proc (R, S, T stopped, Z a zombie)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


# Run apart from the CLI (a session of its own, no terminal): SIGSTOP the relay, SIGCONT it once the CLI (argv[2]) has
# exited (a zombie, or gone). A CLI that waits on the relay never exits: it is SIGKILLed after 120 s (its exit code
# says so), and the relay continued, so that the test ends
_STOP_UNTIL_EXIT = r"""
import os, signal, sys, time
from pathlib import Path
relay, cli = int(sys.argv[1]), int(sys.argv[2])
os.kill(relay, signal.SIGSTOP)
deadline = time.monotonic() + 120
while True:
    try:
        if Path(f"/proc/{cli}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
    except FileNotFoundError:
        break
    if time.monotonic() > deadline:
        os.kill(cli, signal.SIGKILL)
        break
    time.sleep(0.05)
os.kill(relay, signal.SIGCONT)
"""


def _stop_relay() -> None:
    """SIGSTOP this process's stderr relay until this process has exited (``_STOP_UNTIL_EXIT``); return once it is
    stopped."""
    relay = _relay_pid()
    subprocess.Popen([sys.executable, "-c", _STOP_UNTIL_EXIT, str(relay), str(os.getpid())],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True)
    while _state(relay) != "T":
        time.sleep(0.01)


def _kill_relay() -> None:
    """SIGKILL this process's stderr relay, and wait until it is dead (a zombie: its descriptors are closed)."""
    relays = [_relay_pid()]
    os.kill(relays[0], signal.SIGKILL)
    while _state(relays[0]) != "Z":
        time.sleep(0.01)
    for _ in range(1000):  # until ardiff saw it go (descriptor 2 no longer its pipe), 10 s at most
        if not stat.S_ISFIFO(os.fstat(2).st_mode):
            break
        time.sleep(0.01)


class EndlessWarmup(DreamZeroPipeline):
    """DreamZero whose ``ar_diffusion_warmup_requests`` never ends: its own requests, then four-frame ones for ever
    in the same session (the window slides), as a provider with a bug in its loop yields them."""

    def ar_diffusion_warmup_requests(self, session_id: str) -> Iterator[Any]:
        import itertools

        from ardiff_cli.runtime.request import ARDiffusionRequest

        yield from super().ar_diffusion_warmup_requests(session_id)
        for i in itertools.count():
            yield ARDiffusionRequest(f"warmup-again-{i}", self.example_inputs(self.config.frames_per_request),
                                     {"session_id": session_id})


class NoSwapDreamZero(DreamZeroPipeline):
    """DreamZero as a third-party pipeline without the swap protocol: its evicted sessions are replayed."""

    export_ar_diffusion_session = None
    import_ar_diffusion_session = None


class ChangingOutputsDreamZero(DreamZeroPipeline):
    """DreamZero whose outputs also hold a uint8 ``frame`` (8, 8, 3), and change at the requests
    ``$ARDIFF_TEST_OUTPUTS`` names (a JSON object: request id -> change), as a pipeline's bug would: ``nan_actions``
    (one action NaN), ``inf_actions`` (one inf), ``actions_shape`` (actions (8, 7)), ``actions_dtype`` (float64),
    ``frame_shape`` (a frame (6, 8, 3)), ``no_actions`` (no actions), ``actions_list`` (a list of one tensor per
    action step), ``metrics`` (a ``metrics`` dict of scalars: numpy's, a 0-d tensor, an int), ``big_endian``
    (actions as a big-endian numpy array, as one read from a file may be: a step file holds them little-endian).
    With ``$ARDIFF_TEST_NOISE`` set, noise from torch's global generator is added to the actions: a forward that no
    replay reproduces."""

    def forward(self, request):
        outputs = dict(super().forward(request))
        outputs["frame"] = torch.full((8, 8, 3), 7, dtype=torch.uint8)
        if os.environ.get("ARDIFF_TEST_NOISE"):
            outputs["actions"] = outputs["actions"] + torch.randn(outputs["actions"].shape)
        change = json.loads(os.environ.get("ARDIFF_TEST_OUTPUTS") or "{}").get(request.request_id)
        actions = outputs["actions"].clone()
        if change == "nan_actions":
            actions[0, 0] = float("nan")
        elif change == "inf_actions":
            actions[-1, -1] = float("inf")
        elif change == "actions_shape":
            actions = actions[:, :7]
        elif change == "actions_dtype":
            actions = actions.double()
        elif change == "frame_shape":
            outputs["frame"] = outputs["frame"][:6]
        elif change == "metrics":
            outputs["metrics"] = {"loss": torch.tensor(0.5), "norm": actions.norm().numpy()[()], "steps": 3}
        elif change == "big_endian":
            actions = actions.numpy().astype(">f4")
        outputs["actions"] = list(actions) if change == "actions_list" else actions
        if change == "no_actions":
            del outputs["actions"]
        return outputs


class ChangingOutputsNoSwap(ChangingOutputsDreamZero):
    """ChangingOutputsDreamZero without the swap protocol: its evicted sessions are replayed."""

    export_ar_diffusion_session = None
    import_ar_diffusion_session = None


class SignalWhileSwapping(DreamZeroPipeline):
    """DreamZero that sends its own process SIGINT from inside the first session export (``ARDIFF_TEST_SIGNAL_IN``
    = ``export``: a session being swapped out), import (``import``: being restored) or close hook (``close``: an
    evicted session released), the way a Ctrl-C lands at any moment. Twice, unless ``ARDIFF_TEST_SIGNALS`` = 1:
    inside a step the CLI's signal handler only records the first and raises the second there. ``exit``: SIGTERM
    from an ``atexit`` callback, as the process exits with its status decided; ``result``: SIGINT twice as the
    command's result starts to print; ``summary``: SIGINT twice as summary.json starts to be written; ``report``:
    SIGINT from the first forward (a warmup request, or with --no-warmup a rollout's first step), then again as the
    stop's error starts to print and once it is printed (a second Ctrl-C while the stop is reported)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if os.environ.get("ARDIFF_TEST_SIGNAL_IN") == "exit":
            atexit.register(os.kill, os.getpid(), signal.SIGTERM)
        if os.environ.get("ARDIFF_TEST_SIGNAL_IN") == "result":
            from ardiff_cli.output import Output

            def result(output: Output, *args: Any, _print: Any = Output.result, **kwargs: Any) -> None:
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)
                _print(output, *args, **kwargs)

            Output.result = result
        if os.environ.get("ARDIFF_TEST_SIGNAL_IN") == "summary":
            from ardiff_cli.io.run import RunFolder

            def write_summary(run: RunFolder, *args: Any, _write: Any = RunFolder.write_summary, **kwargs: Any) -> Any:
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)
                return _write(run, *args, **kwargs)

            RunFolder.write_summary = write_summary
        if os.environ.get("ARDIFF_TEST_SIGNAL_IN") == "report":
            from ardiff_cli.output import Output

            def error(output: Output, *args: Any, _error: Any = Output.error, **kwargs: Any) -> None:
                signal.raise_signal(signal.SIGINT)
                _error(output, *args, **kwargs)
                signal.raise_signal(signal.SIGINT)

            Output.error = error

    def forward(self, request):
        self._signal_once("report")
        return super().forward(request)

    def close_ar_diffusion_session(self, session_id: str) -> None:
        self._signal_once("close")
        super().close_ar_diffusion_session(session_id)

    def export_ar_diffusion_session(self, session_id: str) -> Any:
        self._signal_once("export")
        return super().export_ar_diffusion_session(session_id)

    def import_ar_diffusion_session(self, session_id: str, snapshot: Any) -> None:
        self._signal_once("import")
        super().import_ar_diffusion_session(session_id, snapshot)

    def _signal_once(self, where: str) -> None:
        if os.environ.get("ARDIFF_TEST_SIGNAL_IN") == where and not getattr(self, "_signalled", False):
            self._signalled = True
            for _ in range(int(os.environ.get("ARDIFF_TEST_SIGNALS", "2"))):
                signal.raise_signal(signal.SIGINT)  # the handler runs before this returns


class _ConfigEditedWhileParsed(DreamZeroPipeline.Config):
    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str) -> Any:
        # called by load_config after it has read the file: an edit in the same instant, as an editor's save lands
        with open(os.environ["ARDIFF_TEST_EDIT_CONFIG"], "a") as file:
            file.write("# saved by an editor while ardiff read the config\n")
        return super().from_dict(data, where=where)


class ConfigEditedWhileParsed(DreamZeroPipeline):
    """DreamZero whose Config, while the config is being loaded, appends a comment to the file
    ``ARDIFF_TEST_EDIT_CONFIG`` names: what the run parsed is no longer what the file holds."""

    Config = _ConfigEditedWhileParsed
