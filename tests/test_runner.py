"""ARDiffusionModelRunner with a small real torch pipeline: sessions, LRU, lifecycle, failures, warmup, events."""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings
from collections import OrderedDict
from contextlib import contextmanager

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tiny_pipeline import TinyPipeline, WarmTinyPipeline, request, tiny_spec

from ardiff_cli.runtime.capability import ARDiffusionKVBranchSpec
from ardiff_cli.runtime.events import (
    CapacityPlanned,
    HookFailed,
    RequestFinished,
    SessionAdmitted,
    SessionClosed,
    SessionEvicted,
    SessionReset,
    WarmupFinished,
)
from ardiff_cli.runtime.errors import (
    PIPELINE_HINT,
    ArdiffError,
    ArdiffWarning,
    ConfigError,
    EngineStateError,
    ObservationError,
    PipelineError,
    RequestError,
    RequestModeError,
    StopRequested,
)
from ardiff_cli.runtime.forward_errors import MissingInputError
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.request import DEFAULT_SESSION_ID, ARDiffusionRequest
from ardiff_cli.runtime.runner import (
    WARMUP_SESSION_ID,
    ARDiffusionModelRunner,
    LifecycleHookError,
    PipelineContractError,
)

BUDGET = 64 << 20


def make_runner(pipeline=None, *, capacity=2, events=None, **kwargs) -> ARDiffusionModelRunner:
    runner = ARDiffusionModelRunner(
        pipeline or TinyPipeline(), memory_budget=BUDGET, session_capacity=capacity, **kwargs
    )
    if events is not None:
        runner.subscribe(events.append)
    runner.load()
    return runner


def held_pages(runner) -> dict[str, set[int]]:
    return {
        sid: {p for b in runner.spec.branch_names for p in s.state._adapter(b).page_ids}
        for sid, s in runner._sessions.items()
    }


def test_session_reuse_keeps_history_between_requests():
    runner = make_runner()
    for step in range(5):
        runner.execute_model(request("a", step))
    (view,) = runner.sessions()
    assert view.session_id == "a"
    assert view.committed_frames == {"main": 10}  # 5 requests x 2 frames, positions keep growing
    assert view.pages_per_branch == {"main": 4}  # 1 sink + 3 window frames, 1 page each
    assert view.num_requests == 5
    assert runner.pipeline.model_state == {"a": 5}


def test_resident_session_equals_uninterrupted_single_session_run():
    """Interleaving another session never changes a session's outputs (no shared pages)."""
    alone = make_runner(TinyPipeline(seed=3), capacity=2)
    mixed = make_runner(TinyPipeline(seed=3), capacity=2)
    for step in range(6):
        expected = alone.execute_model(request("a", step))["main"]
        mixed.execute_model(request("b", step))
        got = mixed.execute_model(request("a", step))["main"]
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        pages = held_pages(mixed)
        assert not pages["a"] & pages["b"]


def test_missing_session_id_uses_documented_default():
    runner = make_runner()
    runner.execute_model(ARDiffusionRequest("r", {"frames": torch.zeros(8, 16)}))
    assert runner.session_ids == [DEFAULT_SESSION_ID]


def test_lru_eviction_at_capacity_and_event_order():
    events = []
    runner = make_runner(capacity=2, events=events)
    runner.execute_model(request("a", 0))
    runner.execute_model(request("b", 0))
    runner.execute_model(request("a", 1))  # a is now most recent
    runner.execute_model(request("c", 0))  # evicts b
    assert runner.session_ids == ["a", "c"]
    assert ("close", "b") in runner.pipeline.hook_calls
    kinds = [(type(e).__name__, getattr(e, "session_id", None)) for e in events]
    assert kinds == [
        ("CapacityPlanned", None),
        ("SessionAdmitted", "a"),
        ("RequestFinished", "a"),
        ("SessionAdmitted", "b"),
        ("RequestFinished", "b"),
        ("RequestFinished", "a"),
        ("SessionEvicted", "b"),
        ("SessionAdmitted", "c"),
        ("RequestFinished", "c"),
    ]
    evicted = next(e for e in events if isinstance(e, SessionEvicted))
    assert evicted.reason == "lru_eviction" and evicted.by_session_id == "c"
    finished = [e for e in events if isinstance(e, RequestFinished)]
    assert all(e.total_s >= e.forward_s > 0 for e in finished)
    assert all(abs(e.bind_s + e.forward_s + e.commit_s - e.total_s) < 1e-6 for e in finished)
    times = [e.time for e in events]
    assert times == sorted(times)


@pytest.mark.parametrize("reset_at_boundary", [False, True])
def test_the_runtime_never_restarts_a_window_by_itself_whatever_reset_at_boundary_says(reset_at_boundary):
    """README, 'Where ardiff differs from the upstream contract': the field is recorded, not acted on; a pipeline
    that restarts at the boundary calls state.reset itself. Past sink (1) + window (3) frames the window slides:
    positions go on, the oldest window frames go back to the pool, no hook runs."""
    events = []
    runner = make_runner(TinyPipeline(tiny_spec(reset_at_boundary=reset_at_boundary)), events=events)
    for step in range(5):  # 10 frames, 2 per request
        runner.execute_model(request("a", step))
    (view,) = runner.sessions()
    assert view.committed_frames == {"main": 10} and view.pages_per_branch == {"main": 1 + 3}
    assert runner.pipeline.hook_calls == [] and not [e for e in events if isinstance(e, SessionReset)]


def test_evicted_session_restarts_from_scratch():
    runner = make_runner(capacity=1)
    runner.execute_model(request("a", 0))
    runner.execute_model(request("b", 0))
    runner.execute_model(request("a", 1))
    (view,) = runner.sessions()
    assert view.session_id == "a" and view.committed_frames == {"main": 2}


def test_request_reset_and_close_session_flags():
    events = []
    runner = make_runner(events=events)
    free0 = runner.kv_cache.num_free_pages
    runner.execute_model(request("a", 0))
    runner.execute_model(request("a", 1))
    runner.execute_model(request("a", 2, reset=True))
    assert runner.sessions()[0].committed_frames == {"main": 2}
    assert runner.pipeline.hook_calls == [("reset", "a")]
    assert any(isinstance(e, SessionReset) and e.reason == "request_reset" for e in events)
    runner.execute_model(request("a", 3, close_session=True))
    assert runner.session_ids == []
    assert runner.pipeline.hook_calls[-1] == ("close", "a")
    assert runner.kv_cache.num_free_pages == free0
    closed = [e for e in events if isinstance(e, SessionClosed)]
    assert [e.reason for e in closed] == ["close_session"]


def test_one_request_with_both_reset_and_close_session_runs_afresh_and_leaves_nothing():
    """The contract's two flags on one request (a stateless one-off on a session id): ``reset`` replaces the
    session before the forward, ``close_session`` releases it after. The forward sees no history, the reset hook
    runs before it and the close hook after, and the pool is back where it started."""
    events = []
    runner = make_runner(events=events)
    free0 = runner.kv_cache.num_free_pages
    fresh = make_runner().execute_model(request("a", 2))  # what a session without history outputs
    runner.execute_model(request("a", 0))
    runner.execute_model(request("a", 1))
    output = runner.execute_model(request("a", 2, reset=True, close_session=True))
    assert all(torch.equal(output[k], fresh[k]) for k in fresh)
    assert runner.pipeline.hook_calls == [("reset", "a"), ("close", "a")]
    assert runner.session_ids == [] and runner.kv_cache.num_free_pages == free0
    assert runner.pipeline.model_state == {}
    lifecycle = [(type(e).__name__, e.reason) for e in events if isinstance(e, (SessionReset, SessionClosed))]
    assert lifecycle == [("SessionReset", "request_reset"), ("SessionClosed", "close_session")]


def test_a_request_is_routed_by_its_flags_as_it_came_in():
    """``check()`` reads the session id and the two flags once, and the runner routes by what it read: a forward
    that wrote ``close_session`` into its request's ``extra_args`` closed its session once it returned (the runner
    read the flag again after the forward), and one that wrote a value that is no flag failed its finished request
    and released the session."""

    class Rewrites(TinyPipeline):
        def forward(self, request):
            output = super().forward(request)
            request.extra_args["close_session"] = self.written
            return output

    assert request("a", 0, reset=True).check() == ("a", True, False)
    for written in (True, "yes"):
        pipeline = Rewrites()
        pipeline.written = written
        runner = make_runner(pipeline)
        runner.execute_model(request("a", 0))
        assert runner.session_ids == ["a"] and runner.sessions()[0].num_requests == 1
        assert pipeline.hook_calls == []


def test_a_forward_that_rewrote_its_session_id_and_read_an_input_it_lacks_is_named_as_such():
    """The error of a forward reading an input its request lacks read the request's ``session_id`` again (to say
    "warmup request" or "request"): one the forward had rewritten into a value that is no id raised that
    RequestError in place of the forward's own error."""

    class RewritesThenMisreads(TinyPipeline):
        def forward(self, request):
            request.extra_args["session_id"] = 7
            return request.inputs["obs"]

    runner = make_runner(RewritesThenMisreads())
    with pytest.raises(MissingInputError, match="the inputs of request 'a:0' do not hold"):
        runner.execute_model(request("a", 0))
    assert runner.session_ids == []


class _WarmupRewritesItsClose(WarmTinyPipeline):
    """Its forward writes ``written`` into its warmup request's ``close_session`` once it has run; the first request
    asks to close the session (``asks``)."""

    def __init__(self, asks, written) -> None:
        super().__init__()
        self.asks, self.written = asks, written

    def ar_diffusion_warmup_requests(self, session_id):
        for i, warmup in enumerate(super().ar_diffusion_warmup_requests(session_id)):
            yield request(session_id, i, close_session=self.asks) if i == 0 else warmup

    def forward(self, request):
        output = super().forward(request)
        request.extra_args["close_session"] = self.written
        return output


@pytest.mark.parametrize(("asks", "written"), [(False, "yes"), (True, False)])
def test_a_warmup_request_is_told_closed_by_the_flag_it_came_in_with(asks, written):
    """The warmup read a request's ``close_session`` again after its forward (the runner routes by what ``check()``
    read as it came in): a forward that wrote a value that is no flag failed the warmup the runner had run, and one
    that wrote False over the True it came with lost the close hook's failure of the session the runner closed."""
    runner = make_runner(_WarmupRewritesItsClose(asks, written))
    if asks:
        runner.pipeline.fail_in_hook = "close"
        with pytest.raises(LifecycleHookError, match="close hook failed") as info:
            runner.warmup()
        # the close of its first request and the one at the warmup's end: each failed
        assert [note for note in getattr(info.value, "__notes__", []) if "close hook failed" in note], info.value
    else:
        assert not runner.warmup().skipped
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0


def test_explicit_reset_and_close_release_everything():
    runner = make_runner()
    free0 = runner.kv_cache.num_free_pages
    runner.execute_model(request("a", 0))
    runner.execute_model(request("b", 0))
    runner.reset_session("a")
    runner.close_session("b")
    assert runner.session_ids == []
    assert runner.pipeline.hook_calls == [("reset", "a"), ("close", "b")]
    assert runner.kv_cache.num_free_pages == free0
    assert runner.pipeline.model_state == {}
    with pytest.raises(KeyError, match="no resident session 'zz'"):
        runner.close_session("zz")


@pytest.mark.parametrize("layer", [0, 1, 2])
def test_forward_failure_at_any_layer_releases_only_that_session(layer):
    events = []
    runner = make_runner(events=events)
    free0 = runner.kv_cache.num_free_pages
    runner.execute_model(request("a", 0))
    before_a = held_pages(runner)["a"]
    runner.execute_model(request("b", 0))
    runner.pipeline.fail_at_layer = layer
    with pytest.raises(RuntimeError, match=f"injected failure at layer {layer}") as caught:
        runner.execute_model(request("b", 1))
    assert caught.value.__notes__ == ["request 'b:1' failed, so session 'b' was released: its history is gone, and "
                                      "its next request starts afresh"]
    assert runner.session_ids == ["a"]
    assert held_pages(runner)["a"] == before_a
    assert runner.kv_cache.allocator.num_used == len(before_a)
    assert ("close", "b") in runner.pipeline.hook_calls
    closed = [e for e in events if isinstance(e, SessionClosed)]
    assert closed[-1].reason == "forward_exception" and "injected failure" in closed[-1].error
    runner.pipeline.fail_at_layer = None
    runner.close_session("a")
    assert runner.kv_cache.num_free_pages == free0


def test_a_stop_between_the_forward_and_its_bookkeeping_releases_the_session(monkeypatch):
    """A KeyboardInterrupt (a signal) just after the forward committed its frames, before the request was counted,
    left the session resident with one more step in its KV than its request count said: a retry of the step ran it
    twice, and a snapshot of it restored with the wrong count (a CLI --resume reran the step on top of itself)."""
    from ardiff_cli.runtime.kv.state import ARDiffusionKVState

    runner = make_runner()
    runner.execute_model(request("a", 0))
    runner.execute_model(request("b", 0))
    pages_of_a = held_pages(runner)["a"]
    armed = []
    end_request, locked = ARDiffusionKVState.end_request, ARDiffusionModelRunner._locked

    def ended(state):
        end_request(state)
        armed.append(True)

    @contextmanager
    def interrupted_once(self):
        if armed:
            armed.clear()
            raise KeyboardInterrupt
        with locked(self):
            yield

    monkeypatch.setattr(ARDiffusionKVState, "end_request", ended)
    monkeypatch.setattr(ARDiffusionModelRunner, "_locked", interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        runner.execute_model(request("b", 1))
    assert runner.session_ids == ["a"] and held_pages(runner) == {"a": pages_of_a}
    assert runner.kv_cache.allocator.num_used == len(pages_of_a)


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler (a KeyboardInterrupt) for the test, whatever the process had; put back after."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("python_sigint")
@pytest.mark.parametrize("where", ["commit", "release"])
def test_a_ctrl_c_in_the_kv_page_bookkeeping_takes_the_pages_back_and_stays_a_keyboard_interrupt(monkeypatch, where):
    """A real SIGINT that lands inside the KV's page bookkeeping: a commit that had taken the block's pages from its
    forward but not yet into the history (``commit``), or the freeing of an evicted session's pages (``release``).
    Those pages were held by nobody: the release of the interrupted session failed its page-leak assert, so the
    caller got an ``AssertionError`` in place of the ``KeyboardInterrupt``, and every later release (eviction,
    ``close_session``, ``close()``) failed it again. Found with an outside process sending SIGINT during requests."""
    import signal

    from ardiff_cli.runtime.kv.allocator import PageAllocator
    from ardiff_cli.runtime.kv.state import BranchKV

    reference = make_runner()
    runner = make_runner()
    for r in (reference, runner):
        r.execute_model(request("a", 0))
        r.execute_model(request("b", 0))
    pages_of_a = held_pages(runner)["a"]
    armed = [True]
    patched, name = (BranchKV, "commit") if where == "commit" else (PageAllocator, "free")
    original = getattr(patched, name)

    def interrupted(self, *args):
        if armed:  # the first call: a Ctrl-C as it starts, after its caller took the pages it passes
            armed.clear()
            signal.raise_signal(signal.SIGINT)  # the handler raises KeyboardInterrupt before this returns
        return original(self, *args)

    monkeypatch.setattr(patched, name, interrupted)
    with pytest.raises(KeyboardInterrupt):  # commit: b's own request; release: c's, as it evicts a
        runner.execute_model(request("b", 1) if where == "commit" else request("c", 0))
    monkeypatch.undo()
    kept = {"commit": ["a"], "release": ["b"]}[where]
    assert runner.session_ids == kept
    assert runner.kv_cache.allocator.num_used == sum(len(held_pages(runner)[sid]) for sid in kept)
    if where == "commit":
        assert held_pages(runner) == {"a": pages_of_a}
    # the sessions left go on as if nothing happened, and one started afresh equals a fresh one
    reference.close_session("b" if where == "commit" else "a")  # the interrupted request released it
    for sid, step in (("a", 1), ("b", 1), ("c", 0)):
        expected, got = reference.execute_model(request(sid, step)), runner.execute_model(request(sid, step))
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert runner.close() == [] and runner.kv_cache.allocator.num_used == 0


def test_failed_forward_of_a_closing_request_closes_its_session_once():
    """``close_session=True`` on a request whose forward fails: the failure releases the session, and the request's
    own close does not release it a second time (one close hook call, one ``session_closed`` event)."""
    events = []
    runner = make_runner(events=events)
    runner.execute_model(request("a", 0))
    runner.pipeline.fail_at_layer = 1
    with pytest.raises(RuntimeError, match="injected failure at layer 1"):
        runner.execute_model(request("a", 1, close_session=True))
    assert runner.pipeline.hook_calls.count(("close", "a")) == 1
    assert [e.reason for e in events if isinstance(e, SessionClosed)] == ["forward_exception"]
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0


def test_forward_failure_on_new_session_mid_commit_pass_frees_inflight_pages():
    runner = make_runner()
    free0 = runner.kv_cache.num_free_pages
    runner.pipeline.fail_at_layer = 2  # layers 0 and 1 already wrote into freshly allocated pages
    with pytest.raises(RuntimeError):
        runner.execute_model(request("a", 0))
    assert runner.kv_cache.num_free_pages == free0 and runner.session_ids == []


def test_forgotten_commit_is_a_failed_forward():
    runner = make_runner()
    runner.pipeline.skip_commit = True
    with pytest.raises(RuntimeError, match=r"^TinyPipeline\.forward\(\) of request 'a:0' returned with uncommitted "
                                            r"commit passes on branches \['main'\]"):
        runner.execute_model(request("a", 0))
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0


def test_hook_errors_are_reported_not_swallowed():
    events = []
    runner = make_runner(events=events)
    runner.execute_model(request("a", 0))
    runner.pipeline.fail_in_hook = "close"
    with pytest.raises(LifecycleHookError, match="close_ar_diffusion_session\\('a'\\) raised RuntimeError") as info:
        runner.close_session("a")
    assert info.value.hint == PIPELINE_HINT  # as the README promises of every error a caller sees
    assert runner.kv_cache.allocator.num_used == 0  # KV released regardless
    assert any(isinstance(e, HookFailed) for e in events)
    # a failed forward whose close hook also fails: the original error wins, the hook error is noted
    runner.pipeline.fail_at_layer = 0
    with pytest.raises(RuntimeError, match="injected failure") as info:
        runner.execute_model(request("b", 0))
    assert any("close hook failed" in note for note in info.value.__notes__)
    assert len(runner.hook_errors) == 2


def test_a_hook_that_is_a_callable_object_and_raises_is_a_hook_error_naming_the_hook():
    """A hook set to a callable object (a telemetry wrapper: no ``__name__``) that raised was an AttributeError
    about ``__name__``, raised from the runner's handling of the hook's error, in place of the LifecycleHookError."""

    class Reporting:  # calls the pipeline's own hook, then fails to report it
        def __init__(self, hook):
            self.hook = hook

        def __call__(self, session_id):
            self.hook(session_id)
            raise RuntimeError("telemetry unreachable")

    events = []
    runner = make_runner(events=events)
    for hook in ("reset", "close"):
        name = f"{hook}_ar_diffusion_session"
        setattr(runner.pipeline, name, Reporting(getattr(runner.pipeline, name)))
    runner.execute_model(request("a", 0))
    with pytest.raises(LifecycleHookError, match=r"^TinyPipeline\.reset_ar_diffusion_session\('a'\) raised "
                                                 r"RuntimeError: telemetry unreachable; the session's KV was released"):
        runner.reset_session("a")
    runner.execute_model(request("a", 0))
    with pytest.raises(LifecycleHookError, match=r"^TinyPipeline\.close_ar_diffusion_session\('a'\) raised"):
        runner.close_session("a")
    assert [e.hook for e in events if isinstance(e, HookFailed)] == ["reset_ar_diffusion_session",
                                                                     "close_ar_diffusion_session"]
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0


def test_an_ardiff_error_from_a_hook_or_a_subscriber_is_their_failure_not_a_stop():
    """Only ``StopRequested`` (the CLI's Interrupted) passes through the runner's isolation of hooks and subscribers;
    a pipeline's own ``PipelineError`` in its close hook is a failing hook like any other exception."""

    class PickyHook(TinyPipeline):
        def close_ar_diffusion_session(self, session_id):
            super().close_ar_diffusion_session(session_id)
            raise PipelineError("bookkeeping of the hook broke")

    events = []
    runner = make_runner(PickyHook(), capacity=1, events=events)
    runner.execute_model(request("a", 0))
    out = runner.execute_model(request("b", 0))  # evicts a: its close hook raises, the request still returns
    assert out is not None and runner.session_ids == ["b"]
    (failed,) = [e for e in events if isinstance(e, HookFailed)]
    assert failed.session_id == "a" and "bookkeeping of the hook broke" in failed.error
    assert len(runner.hook_errors) == 1
    assert runner.kv_cache.allocator.num_used == sum(runner.sessions()[0].pages_per_branch.values())

    def picky_subscriber(event):
        raise PipelineError("metrics schema changed")

    unsubscribe = runner.subscribe(picky_subscriber)
    with pytest.warns(ArdiffWarning, match="picky_subscriber raised PipelineError: metrics schema changed"):
        runner.execute_model(request("b", 1))
    unsubscribe()

    def stopping_subscriber(event):  # the CLI's signal handler raising Interrupted while a subscriber runs
        if event.kind == "request_finished":
            raise StopRequested("interrupted by SIGINT")

    runner.subscribe(stopping_subscriber)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # propagated, not a warning
        with pytest.raises(StopRequested, match="interrupted by SIGINT"):
            runner.execute_model(request("b", 2))


class _InterruptedHook(TinyPipeline):
    """Its reset or close hook is where a stop lands: Ctrl-C (a KeyboardInterrupt, in a server) or the CLI's
    Interrupted (a StopRequested)."""

    interrupt: str | None = None  # "reset" or "close"
    stop: type[BaseException] = KeyboardInterrupt

    def reset_ar_diffusion_session(self, session_id):
        super().reset_ar_diffusion_session(session_id)
        if self.interrupt == "reset":
            raise self.stop("interrupted")

    def close_ar_diffusion_session(self, session_id):
        super().close_ar_diffusion_session(session_id)
        if self.interrupt == "close":
            raise self.stop("interrupted")


def test_close_session_gives_its_event_the_callers_reason_and_refuses_one_that_is_not_a_name():
    """A caller says why it closed a session (rollout: its episode ended or failed), and the error that made it
    (rollout: the failed line's); every close said `explicit`, with no error."""
    events = []
    runner = make_runner(TinyPipeline(), events=events)
    free0 = runner.kv_cache.num_free_pages
    runner.execute_model(request("a", 0))
    runner.execute_model(request("b", 0))
    for reason in ("", None, ["episode_failed"]):
        with pytest.raises(RequestError, match=r"^close_session\(\) takes reason 'explicit', 'episode_ended' or "
                                               r"'episode_failed', got "):
            runner.close_session("a", reason=reason)
    with pytest.raises(RequestError, match=r"^close_session\(\) takes an error as a string, got ValueError\('x'\) "):
        runner.close_session("a", reason="episode_failed", error=ValueError("x"))
    assert sorted(runner.session_ids) == ["a", "b"]  # a refused call releases nothing
    events.clear()
    runner.close_session("a", reason="episode_failed", error="step 1: not a safetensors file")
    runner.close_session("b")
    assert [(e.kind, e.session_id, e.reason, e.error) for e in events] == [
        ("session_closed", "a", "episode_failed", "step 1: not a safetensors file"),
        ("session_closed", "b", "explicit", None)]
    assert runner.session_ids == [] and runner.kv_cache.num_free_pages == free0


@pytest.mark.parametrize(("call", "reason", "hint"), [
    # close_session("a", reason="lru_eviction") sent a session_evicted event: a closed session counted as evicted
    ("close_session", "lru_eviction", "'lru_eviction' is the runner's own word (an LRU eviction), never a caller's"),
    ("close_session", "run_stopped", "'run_stopped' is what close(), close_all() and swap_out_sessions() take"),
    ("close_session", "robot_lost", "leave it out for 'explicit'"),
    ("swap_out_sessions", "episode_failed", "'episode_failed' is what close_session() takes"),
    ("swap_out_sessions", "lru_eviction", "'lru_eviction' is the runner's own word (an LRU eviction), never a "
                                          "caller's"),
    ("close", "episode_ended", "'episode_ended' is what close_session() takes"),
    ("close_all", "warmup_ended", "'warmup_ended' is the runner's own word (the warmup's own session), never a "
                                  "caller's"),
])
def test_each_runner_call_takes_only_the_reasons_that_fit_it(call, reason, hint):
    """A reason is one of a closed set (a script matches them), each call taking those that fit it: any string went,
    so close_session(reason="lru_eviction") sent session_evicted, and a typo was a new reason. A refused call
    releases nothing and sends no event."""
    events = []
    runner = make_runner(TinyPipeline(), events=events)
    runner.execute_model(request("a", 0))
    events.clear()
    args = {"close_session": ("a",), "swap_out_sessions": (["a"],)}.get(call, ())
    with pytest.raises(ValueError) as refused:
        getattr(runner, call)(*args, reason=reason)
    assert isinstance(refused.value, RequestError) and refused.value.hint == hint, refused.value.hint
    takes = {"close_session": "'explicit', 'episode_ended' or 'episode_failed'",
             "swap_out_sessions": "'explicit' or 'run_stopped'"}.get(call, "'explicit', 'run_stopped' or 'run_failed'")
    assert str(refused.value) == f"{call}() takes reason {takes}, got {reason!r}"
    assert events == [] and runner.session_ids == ["a"] and not runner.closed
    runner.close()


@pytest.mark.parametrize("reason", ["run_stopped", "run_failed"])
def test_close_gives_the_sessions_it_closes_the_callers_reason(reason):
    # rollout closes the sessions a stopped or failed run does not keep with close(reason=...): they said `explicit`,
    # as if a script had closed them one by one
    events = []
    runner = make_runner(TinyPipeline(), events=events)
    runner.execute_model(request("a", 0))
    runner.execute_model(request("b", 0))
    events.clear()
    assert runner.close(reason=reason) == []
    assert [(e.kind, e.session_id, e.reason, e.error) for e in events] == [
        ("session_closed", "a", reason, None), ("session_closed", "b", reason, None)]


@pytest.mark.parametrize(("how", "hook", "event"), [
    ("close_session", "close", ("session_closed", "explicit")),
    ("reset_session", "reset", ("session_reset", "explicit")),
    ("close_session flag", "close", ("session_closed", "close_session")),
    ("reset flag", "reset", ("session_reset", "request_reset")),
    ("eviction", "close", ("session_evicted", "lru_eviction")),
    ("failed forward", "close", ("session_closed", "forward_exception")),
])
@pytest.mark.parametrize("stop", [KeyboardInterrupt, StopRequested])
def test_a_stop_in_a_hook_propagates_once_the_release_is_done_and_its_event_sent(how, hook, event, stop):
    """A KeyboardInterrupt from a hook left the release without its event (a StopRequested had it): a subscriber
    tracking sessions saw the released session live on. Its pages go back, the other session stays, and the runner
    goes on serving."""
    events = []
    runner = make_runner(_InterruptedHook(), events=events)
    runner.execute_model(request("a", 0))
    runner.execute_model(request("b", 0))
    pages_of_b = held_pages(runner)["b"]
    runner.pipeline.interrupt, runner.pipeline.stop = hook, stop
    events.clear()
    with pytest.raises(stop):
        if how == "close_session":
            runner.close_session("a")
        elif how == "reset_session":
            runner.reset_session("a")
        elif how == "close_session flag":
            runner.execute_model(request("a", 1, close_session=True))
        elif how == "reset flag":
            runner.execute_model(request("a", 1, reset=True))
        elif how == "eviction":
            runner.execute_model(request("c", 0))
        else:
            runner.pipeline.fail_at_layer = 1
            runner.execute_model(request("a", 1))
    assert [(e.kind, e.reason) for e in events if e.kind != "request_finished"] == [event]
    assert events[0].session_id == "a" and runner.pipeline.hook_calls[-1] == (hook, "a")
    assert runner.session_ids == ["b"] and held_pages(runner) == {"b": pages_of_b}
    assert runner.kv_cache.allocator.num_used == len(pages_of_b)
    runner.pipeline.interrupt = runner.pipeline.fail_at_layer = None
    runner.execute_model(request("a", 0))
    assert runner.close() == [] and runner.kv_cache.allocator.num_used == 0


@pytest.mark.parametrize("stop", [KeyboardInterrupt, StopRequested])
def test_a_stop_in_a_subscriber_propagates_once_every_subscriber_has_every_event(stop):
    """A stop raised inside one subscriber (the CLI's second Ctrl-C landing in its live panel's callback) cut the
    delivery short: the subscribers after it never got that event (the rollout's bookkeeping missed an eviction),
    and the request's later events waited for the next request. Now each one gets every event, in order, first."""
    runner = make_runner()
    runner.execute_model(request("a", 0))
    runner.execute_model(request("b", 0))
    seen, armed = [], [True]

    def panel(event):  # the first subscriber: where the signal lands
        if armed and event.kind == "session_evicted":
            armed.clear()
            raise stop("interrupted")

    runner.subscribe(panel)
    runner.subscribe(seen.append)
    with pytest.raises(stop, match="interrupted"):
        runner.execute_model(request("c", 0))  # evicts a, admits c
    assert [(e.kind, e.session_id) for e in seen] == [("session_evicted", "a"), ("session_admitted", "c")]
    assert runner.session_ids == ["b", "c"] and runner.sessions()[-1].num_requests == 0  # stopped before its forward
    seen.clear()
    runner.execute_model(request("c", 0))
    assert [(e.kind, e.session_id) for e in seen] == [("request_finished", "c")]  # nothing left over


class _NoHooks:
    def ar_diffusion_kv_cache_spec(self):
        return tiny_spec()

    def forward(self, request):
        return {}


class _WrongSpec(TinyPipeline):
    def ar_diffusion_kv_cache_spec(self):
        return {"num_layers": 2}


class _Batching(TinyPipeline):
    supports_request_batch = True


class _Stepping(TinyPipeline):
    supports_step_execution = True


@pytest.mark.parametrize(
    ("pipeline", "kwargs", "error", "match"),
    [
        (TinyPipeline(), {"max_num_seqs": 4}, RequestModeError, "request-mode execution only.*max_num_seqs=4"),
        (TinyPipeline(), {"max_num_seqs": 0}, RequestModeError, "request-mode execution only.*max_num_seqs=0"),
        (TinyPipeline(), {"step_execution": True}, RequestModeError, "request-mode execution only.*step execution"),
        (_Batching(), {}, ValueError, "request-mode execution only.*supports_request_batch"),
        (_Stepping(), {}, ValueError, "request-mode execution only.*supports_step_execution"),
        (
            _NoHooks(),
            {},
            TypeError,
            "missing bind_ar_diffusion_state, reset_ar_diffusion_session, close_ar_diffusion_session",
        ),
        (_WrongSpec(), {}, TypeError, "must return an ARDiffusionKVCacheSpec, got dict"),
    ],
)
def test_load_refusals(pipeline, kwargs, error, match):
    runner = ARDiffusionModelRunner(pipeline, memory_budget=BUDGET, **kwargs)
    with pytest.raises(error, match=match):
        runner.load()
    assert runner.kv_cache is None


def test_a_memory_budget_is_a_byte_size_as_the_engine_takes_it():
    """'64MiB' was a TypeError at load ('<=' between str and int), and True planned with 1 byte."""
    runner = ARDiffusionModelRunner(TinyPipeline(), memory_budget="64MiB")
    runner.load()
    assert runner.capacity_plan.available_bytes == BUDGET == 64 << 20
    with pytest.raises(ConfigError, match=r"^ARDiffusionModelRunner\(\): memory_budget: cannot read a bool as a byte "):
        ARDiffusionModelRunner(TinyPipeline(), memory_budget=True)


def test_a_dtype_is_a_name_or_a_torch_dtype_as_the_planner_takes_it():
    """dtype='float32' was planned, then failed at load with a TypeError from torch.zeros (the planner's own hint for a
    wrong dtype says to pass its name); a float8 dtype, which the planner sizes, loaded and failed in the KV core."""
    runner = make_runner(dtype="float32")
    assert runner.dtype is torch.float32 and runner.kv_cache.pool.kv.dtype == torch.float32
    runner.execute_model(request("a", 0))
    assert runner.pool_usage().num_used > 0
    for dtype in (torch.float8_e4m3fn, torch.float64, "int8"):
        with pytest.raises(ConfigError, match=r"^ARDiffusionModelRunner\(\): unsupported KV dtype .*; expected one of "
                                              r"float32, bfloat16, float16$"):
            ARDiffusionModelRunner(TinyPipeline(), dtype=dtype, memory_budget=BUDGET)


def test_a_session_past_the_free_memory_is_not_told_to_raise_a_budget_it_was_not_given():
    """Without a memory budget the plan has the device's free memory; its CapacityError said "a larger
    --memory-budget" all the same (`ardiff warmup` of a config too large for the host), which would plan past
    the free memory. With a budget, raising it stays the first fix."""
    from ardiff_cli.runtime.capability import ARDiffusionCrossAttentionKVSpec
    from ardiff_cli.runtime.errors import CapacityError

    spec = tiny_spec(cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 10**15),))  # 341 PiB a session
    with pytest.raises(CapacityError) as free:
        ARDiffusionModelRunner(TinyPipeline(spec)).load()
    assert "--memory-budget" not in free.value.hint.partition("(")[0], free.value.hint
    assert "no --memory-budget was given: the plan had the free memory of this host," in free.value.hint
    with pytest.raises(CapacityError) as budget:
        ARDiffusionModelRunner(TinyPipeline(spec), memory_budget=BUDGET).load()
    assert "a larger --memory-budget" in budget.value.hint


def test_batch_and_step_entry_points_raise():
    """They raised a plain RuntimeError, where the load refusal of max_num_seqs=4 raised a plain ValueError: one
    ardiff error now (with a hint), a RuntimeError and a ValueError still, whose message says what to call instead."""
    runner = make_runner()
    with pytest.raises(RequestModeError, match=r"request-mode execution only.*execute_model_batch\(\) is not "
                                               r"available$") as batch:
        runner.execute_model_batch([request("a", 0)])
    with pytest.raises(RequestModeError, match=r"request-mode execution only.*execute_stepwise\(\) is not "
                                               r"available$") as step:
        runner.execute_stepwise(request("a", 0))
    for caught in (batch, step):
        assert all(isinstance(caught.value, kind) for kind in (ArdiffError, RuntimeError, ValueError))
        assert caught.value.hint.startswith("run each request with execute_model(request), one at a time")
    with pytest.raises(RequestModeError) as load:
        ARDiffusionModelRunner(TinyPipeline(), memory_budget=BUDGET, max_num_seqs=4).load()
    assert load.value.hint == ("leave max_num_seqs out (or 1); run each request with execute_model(request), one at "
                               "a time")


def test_requests_before_load_and_reserved_id_are_refused():
    runner = ARDiffusionModelRunner(TinyPipeline(), memory_budget=BUDGET)
    with pytest.raises(RuntimeError, match="load\\(\\) must run"):
        runner.execute_model(request("a", 0))
    runner.load()
    with pytest.raises(ValueError, match="reserved for warmup"):
        runner.execute_model(request(WARMUP_SESSION_ID, 0))


def test_a_second_load_is_refused_and_leaves_the_pools_and_sessions_as_they_were():
    """load() of a loaded runner would allocate a second set of pools under its live sessions: an EngineStateError
    saying it ran already, with the hint to close() it and make a new one; the sessions' KV stays."""
    runner = make_runner()
    runner.execute_model(request("a", 0))
    cache, plan, held = runner.kv_cache, runner.capacity_plan, held_pages(runner)
    with pytest.raises(EngineStateError, match=r"^ARDiffusionModelRunner.load\(\) ran already") as info:
        runner.load()
    assert "close() it" in info.value.hint
    assert runner.kv_cache is cache and runner.capacity_plan is plan and held_pages(runner) == held
    runner.execute_model(request("a", 1))
    runner.close()


class _Swappable(TinyPipeline):  # swap_dir is used: load() looks at its disk's free space
    def export_ar_diffusion_session(self, session_id):
        return None

    def import_ar_diffusion_session(self, session_id, snapshot):
        pass


@pytest.mark.parametrize("failure", ["stop_in_a_subscriber", "free_disk_unknown"])
def test_a_load_that_fails_after_the_pools_are_allocated_leaves_them_free_and_may_run_again(monkeypatch, tmp_path,
                                                                                             failure):
    """A subscriber's stop on capacity_planned, or the swap folder's free space that could not be looked at, failed
    load() with the pools kept: they held their memory, and the next load() was refused as "ran already"."""
    import ardiff_cli.runtime.runner as runner_module

    runner = ARDiffusionModelRunner(_Swappable(), memory_budget=BUDGET, session_capacity=2, swap_dir=tmp_path / "swap")
    failed = []  # the pools of the failed load
    if failure == "stop_in_a_subscriber":
        def stop(event):
            if isinstance(event, CapacityPlanned):
                unsubscribe()
                failed.append(runner.kv_cache)
                raise StopRequested("interrupted by SIGINT")

        unsubscribe = runner.subscribe(stop)
        expected = StopRequested
    else:
        def unknown(directory):
            monkeypatch.undo()
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(runner_module, "free_disk_bytes", unknown)
        expected = OSError
    with pytest.raises(expected):
        runner.load()
    assert runner.kv_cache is None and runner.capacity_plan is None and runner.swap is None
    assert all(cache.pool is None for cache in failed)  # their memory went back
    with pytest.raises(EngineStateError, match=r"^ARDiffusionModelRunner.load\(\) must run before requests"):
        runner.execute_model(request("a", 0))
    plan = runner.load()
    assert runner.capacity_plan is plan and runner.swap is not None
    runner.execute_model(request("a", 0))
    runner.close()


def test_a_runner_closed_before_it_loaded_has_no_pool_to_report():
    """pool_usage() of a runner closed without load() raised AttributeError on its None KV cache."""
    runner = ARDiffusionModelRunner(TinyPipeline(), memory_budget=BUDGET)
    runner.close()
    with pytest.raises(EngineStateError, match=r"^the runner is closed"):
        runner.pool_usage()
    assert runner.sessions() == []


def test_warmup_restores_pool_and_reports_timings():
    events = []
    runner = make_runner(WarmTinyPipeline(), events=events)
    free0 = runner.kv_cache.num_free_pages
    report = runner.warmup()
    assert not report.skipped and report.restored
    assert [t[0] for t in report.timings] == ["warmup-0", "warmup-1", "warmup-2", "warmup-3"]
    assert report.timings[0][1] == "frames (4, 16)" and report.timings[1][1] == "frames (8, 16)"
    assert report.input_shapes[:2] == [{"frames": [4, 16]}, {"frames": [8, 16]}]
    assert runner.kv_cache.num_free_pages == free0 and runner.session_ids == []
    assert runner.pipeline.hook_calls == [("close", WARMUP_SESSION_ID)]
    assert isinstance(events[-1], WarmupFinished) and events[-1].num_requests == 4


def test_warmup_failure_still_releases_the_session():
    runner = make_runner(WarmTinyPipeline())
    runner.pipeline.fail_at_layer = 1
    with pytest.raises(RuntimeError, match="injected"):
        runner.warmup()
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0


def _flat(output) -> torch.Tensor:
    return torch.cat([v.flatten() for v in output.values()]) if isinstance(output, dict) else output


def test_requests_from_several_threads_run_one_at_a_time_and_equal_a_sequential_run():
    """Every request shares the pool's gather workspace: two at once gave other sessions' K/V (37 of 40 wrong)."""
    sessions, steps = ("a", "b", "c"), 12
    reference = make_runner(capacity=len(sessions))  # all resident: a session's outputs depend on its requests only
    expected = {s: [_flat(reference.execute_model(request(s, i))) for i in range(steps)] for s in sessions}
    runner = make_runner(capacity=len(sessions))
    got: dict[str, list] = {s: [] for s in sessions}
    start = threading.Barrier(len(sessions))

    def robot(session):
        start.wait()
        for i in range(steps):
            got[session].append(_flat(runner.execute_model(request(session, i))))

    threads = [threading.Thread(target=robot, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in sessions:
        assert len(got[s]) == steps
        for i, (a, b) in enumerate(zip(got[s], expected[s])):
            assert torch.equal(a, b), f"session {s} step {i}"


def test_a_request_from_inside_a_request_is_refused_not_run_on_the_shared_workspace():
    runner = make_runner()
    seen = []

    def callback(event):
        if isinstance(event, RequestFinished) and not seen:
            with pytest.raises(RuntimeError, match=r"execute_model\(\) called from inside a request"):
                runner.execute_model(request("b", 0))
            with pytest.raises(RuntimeError, match=r"close_session\(\) called from inside a request"):
                runner.close_session("a")
            seen.append(event)

    runner.subscribe(callback)
    runner.execute_model(request("a", 0))
    assert seen and runner.session_ids == ["a"]
    runner.execute_model(request("b", 0))  # after the request: fine
    assert runner.session_ids == ["a", "b"]


def test_warmup_whose_close_hook_fails_raises_like_close_session():
    runner = make_runner(WarmTinyPipeline())
    runner.pipeline.fail_in_hook = "close"
    with pytest.raises(LifecycleHookError, match=rf"close_ar_diffusion_session\('{WARMUP_SESSION_ID}'\) raised"):
        runner.warmup()
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0  # KV released regardless
    runner.pipeline.fail_in_hook = None
    assert runner.warmup().restored


def test_warmup_with_every_slot_taken_is_refused_and_evicts_nobody():
    runner = make_runner(WarmTinyPipeline(), capacity=1)
    runner.execute_model(request("a", 0))
    free = runner.kv_cache.num_free_pages
    with pytest.raises(RuntimeError, match="warmup needs a free session slot.*'a'"):
        runner.warmup()
    assert runner.session_ids == ["a"] and runner.kv_cache.num_free_pages == free
    assert runner.pipeline.hook_calls == []
    runner.close_session("a")
    assert runner.warmup().restored  # with the slot free again it runs and restores the pool


def test_warmup_beside_a_resident_session_keeps_it():
    runner = make_runner(WarmTinyPipeline(), capacity=2)
    runner.execute_model(request("a", 0))
    free = runner.kv_cache.num_free_pages
    assert runner.warmup().restored
    assert runner.session_ids == ["a"] and runner.kv_cache.num_free_pages == free


@pytest.mark.parametrize("failure", [RuntimeError("kernel build failed"), torch.OutOfMemoryError("injected OOM")])
def test_auto_falls_back_to_torch_when_the_vllm_pool_fails_but_not_when_memory_ran_out(monkeypatch, failure):
    # No vLLM here: stand in for its pool failing to build (the CUDA case this guards cannot run on this machine).
    import ardiff_cli.runtime.runner as runner_module

    real_cache = runner_module.ARDiffusionKVCache

    def cache(*args, attention_backend="torch", **kwargs):
        if attention_backend == "vllm":
            raise failure
        return real_cache(*args, attention_backend=attention_backend, **kwargs)

    monkeypatch.setattr(runner_module, "select_attention_backend", lambda *a, **k: ("vllm", "vLLM 0.0 on cpu"))
    monkeypatch.setattr(runner_module, "ARDiffusionKVCache", cache)
    runner = ARDiffusionModelRunner(TinyPipeline(), memory_budget=BUDGET, attention_backend="auto")
    if isinstance(failure, torch.OutOfMemoryError):
        with pytest.raises(torch.OutOfMemoryError):  # a plan that does not fit must not load in another layout
            runner.load()
        return
    with pytest.warns(ArdiffWarning, match=r"attention backend: vLLM kernel failed to initialise"):  # API users too
        runner.load()
    assert runner.attention_backend == "torch"
    assert "vLLM kernel failed to initialise (RuntimeError: kernel build failed)" in runner.attention_backend_reason


def test_pipeline_without_provider_skips_warmup():
    runner = make_runner()
    assert runner.warmup().skipped


def test_capacity_grows_with_fraction_and_one_session_always_fits():
    small = ARDiffusionModelRunner(TinyPipeline(tiny_spec(session_capacity=8)), memory_budget=BUDGET,
                                   gpu_memory_fraction=1e-6)
    assert small.load().session_capacity == 1
    large = ARDiffusionModelRunner(TinyPipeline(tiny_spec(session_capacity=8)), memory_budget=BUDGET,
                                   gpu_memory_fraction=0.9)
    plan = large.load()
    assert plan.session_capacity == 8
    # the pools hold exactly what the plan says
    assert large.kv_cache.pool.nbytes == plan.pool_bytes
    assert large.kv_cache.num_managed_pages == plan.num_managed_pages


def test_views_are_safe_from_another_thread():
    runner = make_runner(capacity=3)
    stop, polling = threading.Event(), threading.Event()
    seen, errors = [], []

    def poll():
        while not stop.is_set():
            try:
                seen.append((runner.sessions(), runner.pool_usage()))
            except Exception as exc:  # pragma: no cover - the assertion below reports it
                errors.append(exc)
            polling.set()
            # Hand the GIL back: spinning without this, the test took 55 s in the suite (0.3 s alone), the runner's
            # thread waiting for the GIL after each torch op that released it. It is still preempted at any
            # bytecode, once per switch interval, while this thread waits for the GIL.
            time.sleep(0)

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        # the requests begin once the thread reads: started late (a loaded machine), it read nothing before they ended
        assert polling.wait(60), "the thread reading the views never read them"  # a bound on a hang, not a timing
        for step in range(30):
            runner.execute_model(request("abcd"[step % 4], step))
    finally:
        stop.set()
        thread.join()
    assert not errors and seen
    for views, usage in seen:
        assert len(views) <= 3 and usage.num_used + usage.num_free == usage.num_pages


def test_two_cfg_branches_each_hold_pages():
    spec = tiny_spec(kv_branches=(ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1)))
    runner = make_runner(TinyPipeline(spec))
    runner.execute_model(request("a", 0))
    view = runner.sessions()[0]
    assert view.pages_per_branch == {"positive": 2, "negative": 2}
    pos = set(runner._sessions["a"].state._adapter("positive").page_ids)
    neg = set(runner._sessions["a"].state._adapter("negative").page_ids)
    assert not pos & neg
    assert view.cross_attention_bytes == 2 * runner.capacity_plan.cross_attention_bytes["text"]


class LRUReferenceMachine(RuleBasedStateMachine):
    """Random requests, resets and closes against a reference LRU model."""

    def __init__(self):
        super().__init__()
        self.capacity = 3
        self.runner = make_runner(capacity=self.capacity)
        self.free0 = self.runner.kv_cache.num_free_pages
        self.reference: OrderedDict[str, int] = OrderedDict()  # session -> requests since admission
        self.step = 0

    @rule(session=st.sampled_from("abcdefg"), reset=st.booleans(), close=st.booleans())
    def execute(self, session, reset, close):
        self.step += 1
        self.runner.execute_model(request(session, self.step, frames=1, reset=reset, close_session=close))
        if reset:
            self.reference.pop(session, None)
        if session in self.reference:
            self.reference.move_to_end(session)
        else:
            if len(self.reference) >= self.capacity:
                self.reference.popitem(last=False)
            self.reference[session] = 0
        self.reference[session] += 1
        if close:
            del self.reference[session]

    @precondition(lambda self: self.reference)
    @rule(data=st.data())
    def close_one(self, data):
        session = data.draw(st.sampled_from(sorted(self.reference)))
        self.runner.close_session(session)
        del self.reference[session]

    @invariant()
    def matches_reference(self):
        assert self.runner.session_ids == list(self.reference)
        assert [v.num_requests for v in self.runner.sessions()] == list(self.reference.values())
        pages = held_pages(self.runner)
        flat = [p for ps in pages.values() for p in ps]
        assert len(flat) == len(set(flat)) == self.runner.kv_cache.allocator.num_used

    def teardown(self):
        self.runner.close_all()
        assert self.runner.kv_cache.num_free_pages == self.free0


TestLRUReference = LRUReferenceMachine.TestCase
TestLRUReference.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)


def test_capacity_planned_event_carries_the_plan():
    events = []
    runner = make_runner(events=events)
    assert isinstance(events[0], CapacityPlanned) and events[0].plan is runner.capacity_plan
    assert events[0].to_dict()["plan"]["session_capacity"] == 2
    assert isinstance(SessionAdmitted("x").to_dict()["time"], float)


def test_close_session_flag_keeps_the_output_when_the_hook_fails():
    events = []
    runner = make_runner(events=events)
    runner.pipeline.fail_in_hook = "close"
    out = runner.execute_model(request("a", 0, close_session=True))
    assert out["main"].shape == (8, 16)
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0
    assert len(runner.hook_errors) == 1 and any(isinstance(e, HookFailed) for e in events)


class _GradPipeline(TinyPipeline):
    """Forgets torch.no_grad() while its weights require grad (a trainable nn.Module would)."""

    def __init__(self) -> None:
        super().__init__()
        self.w_kv.requires_grad_(True)


def test_forward_under_grad_is_refused_without_poisoning_the_shared_buffers():
    runner = make_runner(_GradPipeline())
    with pytest.raises(ValueError, match="layer 0: k and v require grad.*inference-only.*torch.no_grad"):
        runner.execute_model(request("a", 0))
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0
    # The runner stays usable: the same pipeline under no_grad, and other sessions, run and match a fresh runner.
    with torch.no_grad():
        out = runner.execute_model(request("b", 0))
    expected = make_runner().execute_model(request("b", 0))
    torch.testing.assert_close(out["main"], expected["main"])
    # Grad required from a later layer only (the validated fast path) is refused too.
    runner.pipeline.w_kv = [w.detach() for w in runner.pipeline.w_kv]
    runner.pipeline.w_kv[2].requires_grad_(True)
    with pytest.raises(ValueError, match="layer 2: k and v require grad"):
        runner.execute_model(request("c", 0))
    with torch.no_grad():
        runner.execute_model(request("b", 1))


class _SwallowingBind(TinyPipeline):
    """Its bind_ar_diffusion_state catches what the forward raises instead of letting it propagate."""

    @contextmanager
    def bind_ar_diffusion_state(self, session_id, state):
        self._state = state
        try:
            yield
        except Exception:  # the mistake
            pass
        finally:
            self._state = None


@pytest.mark.parametrize("layer", [0, 1])
def test_bind_that_swallows_the_forwards_exception_is_named_and_releases_the_session(layer):
    runner = make_runner(_SwallowingBind())
    runner.pipeline.fail_at_layer = layer
    with pytest.raises(RuntimeError, match=r"_SwallowingBind.bind_ar_diffusion_state\(\) suppressed an exception"):
        runner.execute_model(request("a", 0))
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0
    runner.pipeline.fail_at_layer = None
    runner.execute_model(request("a", 0))
    assert runner.sessions()[0].num_requests == 1


class _BindNotAContextManager(TinyPipeline):
    """Its bind_ar_diffusion_state sets the state and returns (no @contextmanager, no yield)."""

    def bind_ar_diffusion_state(self, session_id, state):
        self._state = state


def test_bind_that_is_not_a_context_manager_is_named_and_releases_the_session():
    runner = make_runner(_BindNotAContextManager())
    with pytest.raises(PipelineContractError, match=r"_BindNotAContextManager.bind_ar_diffusion_state\(\) returned "
                                                    r"NoneType, expected a context manager inside which") as info:
        runner.execute_model(request("a", 0))
    assert info.value.hint == "decorate it with @contextlib.contextmanager and yield once, in a try/finally"
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0


class _BindRaises(TinyPipeline):
    """``bind_ar_diffusion_state`` raises when called (``call``: as one declared without ``session_id`` raises
    TypeError) or as its context is entered (``enter``), once ``fail_bind`` says where."""

    fail_bind: str | None = None

    def bind_ar_diffusion_state(self, session_id, state):
        if self.fail_bind == "call":
            raise TypeError("cannot bind: bind_ar_diffusion_state() takes 2 positional arguments but 3 were given")
        return self._bind(session_id, state)

    @contextmanager
    def _bind(self, session_id, state):
        if self.fail_bind == "enter":
            raise RuntimeError("cannot bind: the model is not ready")
        with TinyPipeline.bind_ar_diffusion_state(self, session_id, state):
            yield


@pytest.mark.parametrize("where", ["call", "enter"])
def test_a_binding_that_raises_is_a_failed_forward_and_releases_only_that_session(where):
    """The binding is part of the request: a bind_ar_diffusion_state that raises, when called or entered, releases
    the session with the close hook as a failed forward does (its history is gone, a bystander keeps its pages), and
    the session's next request starts afresh."""
    events = []
    runner = make_runner(_BindRaises(), events=events)
    runner.execute_model(request("other", 0))
    pages_of_other = held_pages(runner)["other"]
    runner.execute_model(request("a", 0))
    runner.pipeline.fail_bind = where
    with pytest.raises((TypeError, RuntimeError), match="cannot bind") as caught:
        runner.execute_model(request("a", 1))
    assert caught.value.__notes__ == ["request 'a:1' failed, so session 'a' was released: its history is gone, and "
                                      "its next request starts afresh"]
    assert runner.session_ids == ["other"] and held_pages(runner) == {"other": pages_of_other}
    assert runner.kv_cache.allocator.num_used == len(pages_of_other)
    assert runner.pipeline.hook_calls == [("close", "a")] and "a" not in runner.pipeline.model_state
    closed = [(e.session_id, e.reason) for e in events if isinstance(e, SessionClosed)]
    assert closed == [("a", "forward_exception")]
    runner.pipeline.fail_bind = None
    fresh = make_runner().execute_model(request("a", 1))
    output = runner.execute_model(request("a", 1))
    assert all(torch.equal(output[k], fresh[k]) for k in fresh)


class _WarmupYieldsDicts(WarmTinyPipeline):
    def ar_diffusion_warmup_requests(self, session_id):
        yield from super().ar_diffusion_warmup_requests(session_id)
        yield {"frames": torch.zeros(4, 16)}  # forgot to wrap it in an ARDiffusionRequest


class _WarmupNamesAnotherSession(WarmTinyPipeline):
    def ar_diffusion_warmup_requests(self, session_id):
        yield request("robot-a", 0)


class _WarmupFailsItsOwnCheck(WarmTinyPipeline):
    """Its input check refuses a one-frame block, which its own first warmup request is."""

    def check_ar_diffusion_request(self, request):
        if request.inputs["frames"].shape[0] < 2 * self.spec.tokens_per_frame:
            raise ObservationError("request inputs: 'frames' must hold 2 frames")


class _WarmupFlagAsText(WarmTinyPipeline):
    def ar_diffusion_warmup_requests(self, session_id):
        yield request(session_id, 0, reset="false")  # from a JSON file of warmup requests, say


@pytest.mark.parametrize(("pipeline", "match"), [
    (_WarmupYieldsDicts(), r"_WarmupYieldsDicts.ar_diffusion_warmup_requests\(\) yielded dict as request 4, "
                           "expected an ARDiffusionRequest"),
    (_WarmupNamesAnotherSession(), "warmup request 'robot-a:0' names session 'robot-a', expected '__ardiff_warmup__'"),
    # an ObservationError (exit 2, "see the episode format") or a RequestError for inputs nobody but the pipeline gave
    (_WarmupFailsItsOwnCheck(), "warmup request 'warmup-0' of _WarmupFailsItsOwnCheck failed: ObservationError: "
                                "request inputs: 'frames' must hold 2 frames"),
    (_WarmupFlagAsText(), r"warmup request '__ardiff_warmup__:0' of _WarmupFlagAsText failed: RequestError: request "
                          r"'__ardiff_warmup__:0': extra_args\['reset'\] must be True or False"),
])
def test_malformed_warmup_requests_are_pipeline_errors_and_release_the_session(pipeline, match):
    runner = make_runner(pipeline)
    with pytest.raises(PipelineError, match=match):
        runner.warmup()
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0
    runner.execute_model(request("a", 0))  # reusable


def test_warmup_under_autocast_to_another_dtype_is_the_callers_request_error_not_the_pipelines():
    runner = make_runner(WarmTinyPipeline())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RequestError, match=r"warmup runs under torch.autocast\('cpu', dtype=torch.bfloat16\)") \
                as info:
            runner.warmup()
    assert not isinstance(info.value, PipelineError) and "outside the autocast block" in info.value.hint
    assert runner.session_ids == [] and runner.pipeline.hook_calls == []  # no warmup request ran
    assert not runner.warmup().skipped


@pytest.mark.parametrize("failure", [RuntimeError, AssertionError])  # a model's own assert too: not ardiff's bug
def test_a_failing_warmup_forward_is_a_pipeline_error_naming_the_request(failure):
    runner = make_runner(WarmTinyPipeline())
    runner.pipeline.fail_at_layer = 2
    runner.pipeline.fail_with = failure
    runner.pipeline.fail_in_hook = "close"
    with pytest.raises(PipelineError, match=f"warmup request 'warmup-0' of WarmTinyPipeline failed: "
                                            f"{failure.__name__}: injected failure at layer 2") as info:
        runner.warmup()
    assert isinstance(info.value.__cause__, failure)
    assert any("close hook failed" in note for note in info.value.__notes__)
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0


class _HookSeesReleasedKV(WarmTinyPipeline):
    """Records, inside each lifecycle hook, what the runner had released by then (the contract: the hooks reset or
    drop model-owned state *after* the runner released the session's KV)."""

    def __init__(self) -> None:
        super().__init__()
        self.runner: ARDiffusionModelRunner | None = None
        self.states: dict[str, object] = {}  # session -> the KV state last bound to it (test bookkeeping only)
        self.seen: list[tuple[str, str, bool, int, int, bool]] = []

    @contextmanager
    def bind_ar_diffusion_state(self, session_id, state):
        self.states[session_id] = state
        with super().bind_ar_diffusion_state(session_id, state):
            yield

    def _record(self, hook: str, session_id: str) -> None:
        state, runner = self.states[session_id], self.runner
        others = sum(s.state.num_pages for s in runner._sessions.values())
        self.seen.append((hook, session_id, state.closed, state.num_pages + state.cross_attention_bytes,
                          runner.kv_cache.allocator.num_used - others, session_id in runner.session_ids))

    def reset_ar_diffusion_session(self, session_id: str) -> None:
        self._record("reset", session_id)
        super().reset_ar_diffusion_session(session_id)

    def close_ar_diffusion_session(self, session_id: str) -> None:
        self._record("close", session_id)
        super().close_ar_diffusion_session(session_id)


@pytest.mark.parametrize(("path", "hook"), [
    ("request_reset", "reset"), ("reset_session", "reset"), ("close_session", "close"),
    ("close_session_flag", "close"), ("lru_eviction", "close"), ("forward_exception", "close"), ("warmup", "close"),
])
def test_every_release_path_frees_kv_and_cross_attention_before_the_pipeline_hook(path, hook):
    pipeline = _HookSeesReleasedKV()
    runner = make_runner(pipeline, capacity=2)
    pipeline.runner = runner
    runner.execute_model(request("other", 0))  # a resident bystander whose pages must stay
    if path == "warmup":
        runner.warmup()
        target = WARMUP_SESSION_ID
    else:
        target = "a"
        runner.execute_model(request("a", 0))
        runner.execute_model(request("a", 1))  # history and a published text cache
        assert runner.sessions()[-1].cross_attention_bytes > 0
        if path == "request_reset":
            runner.execute_model(request("a", 2, reset=True))
        elif path == "reset_session":
            runner.reset_session("a")
        elif path == "close_session":
            runner.close_session("a")
        elif path == "close_session_flag":
            runner.execute_model(request("a", 2, close_session=True))
        elif path == "lru_eviction":
            runner.execute_model(request("other", 1))  # "a" is least recently used now
            runner.execute_model(request("c", 0))
        else:
            pipeline.fail_at_layer = 1
            with pytest.raises(RuntimeError, match="injected failure"):
                runner.execute_model(request("a", 2))
    calls = [entry for entry in pipeline.seen if entry[1] == target]
    # one hook call; the state closed, holding no pages and no cross-attention; the pool holds only the others'
    # pages; the session no longer resident
    assert calls == [(hook, target, True, 0, 0, False)]


def test_a_layer_context_kept_past_its_request_is_stale():
    """the runner ends every request (state.end_request()): a context the pipeline kept cannot attend later,
    outside any request, into the workspace every session shares. It is told as a kept state is (README: kept past
    its binding, every call raises naming the session): outside its request, the contract; once its session was
    released, that its pages may hold another session's KV (it said 'committed, replaced, or reset', or 'is
    closed'); in its own session's next request, stale, naming the session."""

    class KeepsContexts(TinyPipeline):
        kept = None
        use_kept = False

        def forward(self, req):
            if self.use_kept:  # its own session's next forward: the state is bound, the context an earlier one's
                self.kept[0].attend(*self.qkv)
            out = super().forward(req)  # commit passes, committed
            self.kept = self.kept or self._state.get_kv_caches(self.spec.branch_names[0], req.inputs["frames"].shape[0])
            return out  # a denoising pass's contexts, handed out and never used

    pipe = KeepsContexts()
    runner = make_runner(pipe, capacity=1)
    req = request("a", 0)
    runner.execute_model(req)
    s = pipe.spec
    t = torch.zeros(s.num_kv_heads, req.inputs["frames"].shape[0], s.head_size)
    pipe.qkv = (t, t, t)
    with pytest.raises(RuntimeError, match=r"^a layer context's attend\(\) on the AR-Diffusion KV state of session "
                                           r"'a' outside its request: .*bind_ar_diffusion_state.*must not retain it"):
        pipe.kept[0].attend(t, t, t)
    with pytest.raises(RuntimeError, match=r"^a layer context's store\(\) on the AR-Diffusion KV state of session 'a' "
                                           r"outside its request"):
        pipe.kept[-1].store(t, t)
    pipe.use_kept = True
    with pytest.raises(RuntimeError, match=r"^KeepsContexts\.forward\(\): stale AR-Diffusion KV context for branch "
                                           r"'main' of session 'a': .*call get_kv_caches again"):
        runner.execute_model(request("a", 1))  # a fails and is released: its state is closed
    with pytest.raises(RuntimeError, match=r"^a layer context's attend\(\) on the AR-Diffusion KV state of session "
                                           r"'a': the state is closed: the runner released the session .* may hold "
                                           r"another session's KV now"):
        pipe.kept[0].attend(t, t, t)
    runner.close()


def test_a_kv_state_kept_past_its_request_refuses_changes_and_its_session_is_as_it_was():
    """The contract: the runner binds a session's state around one forward, and the pipeline must not retain it.
    One kept past its request (used in a lifecycle hook, or in another session's forward) freed, extended or
    overwrote that session's KV outside any request of it, the runner's view of the session stale, or read it into
    another session's outputs. Each call of the forward's, reads included, is a RuntimeError naming the session, and
    so are export, restore and close (the runner's: a kept state's close() freed a resident session's pages, and
    its next request failed, its history gone); the kept session is as it was, and its own next request binds it
    again. What it holds (num_pages, cross_attention_bytes) stays readable."""

    class KeepsState(TinyPipeline):
        kept = None
        misuse: str | None = None

        def forward(self, req):
            if self.misuse == "forward":  # a pipeline bug: the state of an earlier request, another session's
                self.kept.populate_cross_attention("main", "text", self._text_kv(9, "main"))
            elif self.misuse == "close":  # "free what the pipeline held": another session's KV, under the runner
                self.kept.close()
            out = super().forward(req)
            self.kept = self.kept or self._state
            return out

        def close_ar_diffusion_session(self, session_id):
            super().close_ar_diffusion_session(session_id)
            if self.misuse == "hook":  # "reset the session's KV" through the state it kept: another session's
                self.kept.reset()

    pipe = KeepsState()
    runner = make_runner(pipe)
    runner.execute_model(request("a", 0))
    kept = pipe.kept
    before = runner.sessions()[0]
    free = runner.pool_usage().num_free
    snapshot = ARDiffusionKVCache(pipe.spec, 16).new_state("a").export()  # an empty session's
    calls = {
        "get_kv_caches": lambda: kept.get_kv_caches("main", 8, commit_current=True),
        "commit": lambda: kept.commit("main"),
        "populate_cross_attention": lambda: kept.populate_cross_attention("main", "text", pipe._text_kv(9, "main")),
        "reset": lambda: kept.reset(),
        "adapter": lambda: kept.adapter("main"),
        "has_cross_attention": lambda: kept.has_cross_attention("main", "text"),
        "cross_attention": lambda: kept.cross_attention("main", "text"),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"{name}\(\) on the AR-Diffusion KV state of session 'a' outside its "
                                                r"request.*bind_ar_diffusion_state"):
            call()
    for name, call in {"export": kept.export, "restore": lambda: kept.restore(snapshot), "close": kept.close}.items():
        with pytest.raises(RuntimeError, match=rf"{name}\(\) on the AR-Diffusion KV state of session 'a', which the "
                                                "runner holds: the runner exports, restores and closes"):
            call()
    pipe.misuse = "forward"  # in session b's forward: b fails (and is released), a is untouched; the pipeline named
    with pytest.raises(RuntimeError, match=r"^KeepsState\.forward\(\): populate_cross_attention\(\) on the "
                                            r"AR-Diffusion KV state of session 'a' outside its request"):
        runner.execute_model(request("b", 0))
    pipe.misuse = "close"
    with pytest.raises(RuntimeError, match=r"close\(\) on the AR-Diffusion KV state of session 'a', which the runner"):
        runner.execute_model(request("b", 0))
    pipe.misuse = "hook"  # b's close hook: b is closed all the same, a is untouched
    runner.execute_model(request("b", 0, close_session=True))
    assert runner.hook_errors and "KV state of session 'a' outside its request" in str(runner.hook_errors[-1])
    pipe.misuse = None
    assert runner.session_ids == ["a"] and runner.pool_usage().num_free == free and not kept.closed
    assert runner.sessions() == [before] and before.committed_frames["main"] == 2
    assert kept.cross_attention_bytes == before.cross_attention_bytes > 0  # counts stay readable
    assert kept.num_pages == sum(before.pages_per_branch.values()) > 0
    runner.execute_model(request("a", 1))  # bound again by its own request: usable as before
    assert runner.sessions()[-1].committed_frames == {"main": 4}
    runner.close()


def _prompted(session: str, step: int, prompt: int) -> ARDiffusionRequest:
    req = request(session, step)
    req.inputs["prompt"] = prompt
    return req


def test_a_kv_state_kept_past_its_request_is_not_read_in_another_sessions_forward():
    """A pipeline that keeps the first state bound and reads its text cache in every later forward computed session
    b's outputs from session a's prompt, silently, while a was resident; once a was evicted, the pages its state
    had named hold another session's KV. Either read is a RuntimeError naming a and the contract: b's forward fails
    (b is released, as after any failed forward), and a is as it was."""
    pipe = TinyPipeline()
    pipe.keep_state = True
    runner = make_runner(pipe, capacity=2)
    runner.execute_model(_prompted("a", 0, prompt=1))
    a_view, a_pages = runner.sessions()[0], held_pages(runner)["a"]
    with pytest.raises(RuntimeError, match=r"^TinyPipeline\.forward\(\): cross_attention\(\) on the AR-Diffusion KV "
                                           r"state of session 'a' outside its request: the runner binds .* must not "
                                           r"retain it"):
        runner.execute_model(_prompted("b", 0, prompt=2))  # it returned b's output of prompt 1, a's
    assert runner.session_ids == ["a"] and runner.sessions() == [a_view]

    pipe.keep_state = False  # c and d run as they should, and d evicts a (least recently used)
    runner.execute_model(_prompted("c", 0, prompt=3))
    runner.execute_model(_prompted("d", 0, prompt=4))
    assert runner.session_ids == ["c", "d"] and pipe.kept_state.closed
    assert a_pages & (held_pages(runner)["c"] | held_pages(runner)["d"])  # a's pages hold another session's KV
    pipe.keep_state = True
    with pytest.raises(RuntimeError, match=r"^TinyPipeline\.forward\(\): cross_attention\(\) on the AR-Diffusion KV "
                                           r"state of session 'a': the state is closed: the runner released the "
                                           r"session \(closed, reset, evicted or swapped out\) and freed its pages, "
                                           r"which may hold another session's KV now"):
        runner.execute_model(_prompted("c", 1, prompt=3))
    assert runner.session_ids == ["d"]
    for call in (lambda: pipe.kept_state.adapter("main"), lambda: pipe.kept_state.has_cross_attention("main", "text"),
                 pipe.kept_state.export):
        with pytest.raises(RuntimeError, match=r"session 'a'.*: the state is closed: the runner released the session"):
            call()
    assert pipe.kept_state.num_pages == pipe.kept_state.cross_attention_bytes == 0  # what it holds: nothing
    runner.close()
