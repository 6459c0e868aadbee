"""Shared fixtures: tiny KV geometries and caches sized for a few sessions; the environment of CLI subprocesses."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ardiff_cli.runtime.kv.layout import SCRATCH_ENV


TESTS = Path(__file__).resolve().parent
# Variables of the shell pytest runs in that change what ardiff allocates or how it lays out its tables: unset for
# every test, in process and in CLI subprocesses, unless the test sets them. pytest-xdist's workers here had
# COLUMNS=80 and LINES=24, and 80 columns wrapped the inspect-capacity rows tests look for.
AMBIENT_ENV = (SCRATCH_ENV, "COLUMNS", "LINES")


def pytest_configure(config):
    """pytest started as a background job of a shell script (`python -m pytest tests &`, no job control) ignores
    SIGINT, and every CLI subprocess inherits that (ardiff keeps an ignored signal ignored, as under nohup): the tests
    that stop a rollout with SIGINT waited out their 120 s timeouts and failed. Children of a handled SIGINT start
    with the default action.

    Likewise SIGHUP under `nohup python -m pytest tests`: the SIGHUP test's rollout kept running until its
    --idle-timeout and exited 0. pytest itself goes on ignoring a hangup (a handler that does nothing), while its
    children start with the default action."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        signal.signal(signal.SIGHUP, _hangup_ignored)
    _settled[:] = [_signal_state()]  # what every test starts from: a module that changes it as it imports is told


def _hangup_ignored(signum, frame) -> None:
    """pytest was started under nohup: a hangup still does not stop it."""


# Every signal a handler can be set for (not SIGKILL, SIGSTOP): a CLI subprocess inherits the worker's ignored ones
# and its blocked ones (ardiff keeps an ignored signal ignored, as under nohup), so a test that leaves one ignored or
# blocked makes a signal that a later test in the same worker sends do nothing (CI waited out 300 s twice).
CATCHABLE = tuple(sorted(set(signal.valid_signals())
                          - {getattr(signal, name, None) for name in ("SIGKILL", "SIGSTOP")}))
# the worker's signal state as pytest_configure, then the last test's check, left it: a change found as the next test
# starts was made outside the tests (a module as it imported, a module- or session-scoped fixture)
_settled: list[tuple[dict, frozenset]] = []


def _signal_state() -> tuple[dict, frozenset]:
    """The handler of every catchable signal, and the main thread's blocked set."""
    handlers = {signum: signal.getsignal(signum) for signum in CATCHABLE}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, []) if hasattr(signal, "pthread_sigmask") else set()
    return handlers, frozenset(blocked)


def _restore_and_describe(expected: tuple[dict, frozenset]) -> str:
    """Put back ``expected`` (a handler installed outside Python, ``None``, cannot be) and say what differed."""
    handlers, blocked = _signal_state()
    changes = []
    for signum, handler in expected[0].items():
        if handlers[signum] != handler:
            name = signal.Signals(signum).name if signum in set(signal.Signals) else str(signum)
            changes.append(f"{name}: {handler!r} -> {handlers[signum]!r}")
            if handler is not None:
                signal.signal(signum, handler)
    if blocked != expected[1]:
        changes.append(f"blocked: {sorted(expected[1])} -> {sorted(blocked)}")
        signal.pthread_sigmask(signal.SIG_SETMASK, expected[1])
    return "; ".join(changes)


@pytest.fixture(autouse=True)
def _no_leaked_signal_state():
    """Fail a test that leaves a signal's handler or the blocked set other than it found them (restored, so that one
    leak does not fail or hang the tests after it); fail the first test after a change made between tests."""
    if _settled and (changed := _restore_and_describe(_settled[0])):
        pytest.fail(f"the worker's signal handling changed outside any test (since the previous one, or pytest's "
                    f"start: a test module as it imported, a module- or session-scoped fixture; restored now): "
                    f"{changed}", pytrace=False)
    before = _signal_state()
    yield
    changed = _restore_and_describe(before)
    _settled[:] = [_signal_state()]
    if changed:
        pytest.fail(f"the test left the worker's signal handling changed (restored now): {changed}; hint: a CLI "
                    "subprocess of a later test inherits an ignored or blocked signal, and a signal sent to it "
                    "does nothing", pytrace=False)


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory):
    """For `python -m ardiff_cli` subprocesses: the repo and tests/ importable (faulty_pipelines), one cache per
    module (checkpoints, demo data), no colour hints, no injected faults, one thread."""
    unset = (*AMBIENT_ENV, "NO_COLOR", "FORCE_COLOR", "ARDIFF_TEST_FAULTS")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(ARDIFF_CACHE_DIR=str(tmp_path_factory.mktemp("cache")), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")]))
    return env


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread: tiny ops gain nothing from two, and lose badly when another process holds a core."""
    import torch  # here, not at the top: tests that check a command never imports torch run in this process too

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def ardiff_cache(tmp_path_factory):
    """A private $ARDIFF_CACHE_DIR for each test module, so default checkpoints are built fresh and never touch
    ~/.cache or the shell's cache: for every module, not only those that ask (test_engine_config.py and
    test_backends.py build default checkpoints without asking, and a module-scoped fixture is not left set for the
    modules after it)."""
    path = tmp_path_factory.mktemp("ardiff-cache")
    before = os.environ.get("ARDIFF_CACHE_DIR")
    os.environ["ARDIFF_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("ARDIFF_CACHE_DIR", None)
    else:
        os.environ["ARDIFF_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def _no_ambient_env(monkeypatch):
    """Tests see the derived scratch size and plain tables laid out for a file unless they set AMBIENT_ENV."""
    for name in AMBIENT_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def make_spec():
    """Factory of small valid specs: two CFG branches on distinct slots, sink 1, window 3, 2-frame blocks."""
    from ardiff_cli.runtime.capability import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec

    def make(**overrides) -> ARDiffusionKVCacheSpec:
        fields = dict(
            num_layers=2,
            num_kv_heads=2,
            head_size=8,
            tokens_per_frame=4,
            frames_per_block=2,
            window_frames=3,
            sink_frames=1,
            kv_branches=(ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1)),
            session_capacity=2,
        )
        fields.update(overrides)
        return ARDiffusionKVCacheSpec(**fields)

    return make


@pytest.fixture
def make_cache(make_spec):
    """Factory of ``ARDiffusionKVCache`` with exactly the managed pages ``num_sessions`` sessions need."""
    import torch

    from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
    from ardiff_cli.runtime.kv.layout import KVLayout

    def make(spec=None, *, num_sessions: int = 2, dtype=torch.float32, page_size=None, extra_pages: int = 0,
             attention_backend="torch"):
        spec = make_spec() if spec is None else spec
        layout = KVLayout.from_spec(spec, page_size=page_size)
        pages = layout.managed_pages(num_sessions) + extra_pages
        return ARDiffusionKVCache(spec, pages, dtype=dtype, page_size=page_size, attention_backend=attention_backend)

    return make
