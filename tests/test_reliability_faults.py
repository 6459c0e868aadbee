"""Faults injected into the real DreamZero pipeline, through ARDiffusionEngine: one session fails, the rest do not.

Each fault wraps one real component for one request (a transformer block, the
sampler, a cross-attention projection, ``torch.empty``, the page allocator,
a lifecycle hook; see ``faulty_pipelines``). After it, the test checks:

- the failed session is released (runner and pipeline), with a ``session_closed`` event carrying the error;
- the free-page count is exact: what the failed session held comes back, nothing else moves;
- every other session is untouched: same pages, same KV bytes in them, same cross-attention caches, same
  model-owned state, and its next step is bit-identical to a run in which the fault never happened;
- the failed session restarts cleanly: its steps rerun from scratch equal the fault-free reference.
"""

from __future__ import annotations

import contextlib
import errno
import os
import zlib

import pytest
import torch
from faulty_pipelines import (
    InjectedFault,
    block_fault,
    cross_attention_oom,
    last_block_kv_fault,
    projection_fault,
    sampler_fault,
)

from ardiff_cli.runtime.engine import ARDiffusionEngine
from ardiff_cli.runtime.events import HookFailed, SessionClosed
from ardiff_cli.runtime.kv.allocator import KVCacheExhaustedError
from ardiff_cli.runtime.request import ARDiffusionRequest
from ardiff_cli.runtime.runner import LifecycleHookError

pytestmark = pytest.mark.usefixtures("single_thread", "ardiff_cache")

# Two CFG branches (positive, negative), text + image caches, two sampling steps: every kind of KV in play.
CONFIG = {
    "pipeline": "dreamzero",
    "model": {"preset": "tiny", "num_inference_steps": 2, "guidance_scale": 3.0},
    "runtime": {"device": "cpu", "session_capacity": 4, "memory_budget": "256MiB"},
}
BYSTANDERS = ("a", "b")  # sessions that must not notice anything


def make_engine() -> tuple[ARDiffusionEngine, list]:
    engine = ARDiffusionEngine.from_config(CONFIG)
    events: list = []
    engine.subscribe(events.append)
    engine.load()
    return engine, events


def inputs(engine, session: str, step: int) -> dict:
    seed = zlib.crc32(f"{session}/{step}".encode())
    return engine.pipeline.example_inputs(1 if step == 0 else 4, prompt=f"task {session}", seed=seed)


def run(engine, session: str, step: int, **extra) -> dict:
    request = ARDiffusionRequest(f"{session}/{step}", inputs(engine, session, step), {"session_id": session, **extra})
    return engine.execute(request)


@pytest.fixture(scope="module")
def reference(ardiff_cache, single_thread):
    """Outputs of steps 0..2 of every session, fault-free (sessions are independent: order does not matter)."""
    engine, _ = make_engine()
    outputs = {(s, step): run(engine, s, step) for s in ("a", "b", "c", "d") for step in range(3)}
    engine.close()
    return outputs


def snapshot(engine, session: str) -> dict:
    """Everything of ``session`` a fault elsewhere must not change: pages, their K/V, caches, model state."""
    runner = engine.runner
    state = runner._sessions[session].state
    kv = runner.kv_cache.pool.kv  # (layers, 2, H, pages, page_size, D)
    out: dict = {"model": engine.pipeline.sessions[session].anchor_latent.clone()}
    for branch in runner.spec.branch_names:
        adapter = state._adapter(branch)  # the runner's view: adapter() is the forward's only
        pages = torch.tensor(adapter.page_ids, dtype=torch.long)
        out[branch] = (adapter.page_ids, adapter.num_committed_frames)
        out[(branch, "kv")] = kv.index_select(3, pages).clone()  # every layer's K and V of these pages
        for name in ("text", "image"):
            out[(branch, name)] = [(k.clone(), v.clone()) for k, v in state._cross[(branch, name)]]
    return out


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(after[key], value, rtol=0, atol=0)
        elif isinstance(value, list):
            for (k0, v0), (k1, v1) in zip(value, after[key], strict=True):
                torch.testing.assert_close(k1, k0, rtol=0, atol=0)
                torch.testing.assert_close(v1, v0, rtol=0, atol=0)
        elif isinstance(value, tuple) and isinstance(value[0], torch.Tensor):
            torch.testing.assert_close(after[key][0], value[0], rtol=0, atol=0)
            torch.testing.assert_close(after[key][1], value[1], rtol=0, atol=0)
        else:
            assert after[key] == value, key


def assert_outputs_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def held(engine, session: str) -> int:
    state = engine.runner._sessions[session].state
    return sum(len(state._adapter(b).page_ids) for b in engine.runner.spec.branch_names)


# (name, target session, target step, fault factory, expected exception, message pattern)
FAULTS = [
    ("block0-commit-pass", "c", 2, lambda e: block_fault(e.pipeline, 0, call=1), InjectedFault,
     "transformer block 0"),
    ("block1-while-sampling", "c", 2, lambda e: block_fault(e.pipeline, 1, call=3), InjectedFault,
     "transformer block 1"),
    # the negative branch's commit pass: the positive branch's block is history, this one's pages are in flight
    ("last-block-kv-in-commit-pass", "c", 2, lambda e: last_block_kv_fault(e.pipeline, call=2), InjectedFault,
     "last block's K/V projection"),
    ("sampler", "c", 2, lambda e: sampler_fault(e.pipeline, call=2), InjectedFault, "in the sampler"),
    ("text-projection-midway", "d", 0, lambda e: projection_fault(e.pipeline, "text", after=1), InjectedFault,
     "text projection at layer 1"),
    ("image-projection", "d", 0, lambda e: projection_fault(e.pipeline, "image", after=1), InjectedFault,
     "image projection"),
    ("cross-attention-oom", "d", 0, lambda e: cross_attention_oom(), KVCacheExhaustedError,
     r"cross-attention 'text' of branch 'positive' \(session 'd'\): out of memory allocating layer 0 "
     r"\(\d+ bytes for the whole cache\)"),
]


@pytest.mark.parametrize(("target", "step", "make_fault", "error", "match"), [f[1:] for f in FAULTS],
                         ids=[f[0] for f in FAULTS])
def test_fault_releases_only_the_failing_session(reference, target, step, make_fault, error, match):
    engine, events = make_engine()
    check_fault(engine, events, reference, target, step, lambda: make_fault(engine), error, match)


def check_fault(engine, events, reference, target, step, make_fault, error, match) -> None:
    """Sessions a, b, c run two steps; ``target`` fails at ``step``; everything else must be as if it had not."""
    runner, pipe = engine.runner, engine.pipeline
    total = runner.pool_usage().num_pages
    for s in ("a", "b", "c"):
        for k in range(2):
            assert_outputs_equal(run(engine, s, k), reference[(s, k)])
    bystanders = [s for s in ("a", "b", "c") if s != target]
    before = {s: snapshot(engine, s) for s in bystanders}
    free_without_target = total - sum(held(engine, s) for s in bystanders)

    with make_fault(), pytest.raises(error, match=match):
        run(engine, target, step)

    assert runner.session_ids == bystanders and set(pipe.sessions) == set(bystanders)
    closed = [e for e in events if isinstance(e, SessionClosed) and e.session_id == target]
    assert closed[-1].reason == "forward_exception" and closed[-1].error
    assert runner.pool_usage().num_free == free_without_target  # exact
    for s in bystanders:
        assert_same(before[s], snapshot(engine, s))
    # The run goes on: the bystanders' next steps are exactly what they would have been without the fault,
    # and the failed session restarts from scratch.
    for s in bystanders:
        assert_outputs_equal(run(engine, s, 2), reference[(s, 2)])
        engine.runner.close_session(s)
    for k in range(3):
        assert_outputs_equal(run(engine, target, k), reference[(target, k)])
    engine.close()
    assert runner.pool_usage().num_free == total and pipe.sessions == {}


def test_page_shortage_names_session_branch_and_numbers(reference, monkeypatch):
    """A pool deliberately short of pages (a plan that promises four sessions, pages for three at rest)."""
    import dataclasses

    import ardiff_cli.runtime.runner as runner_module

    plan_capacity = runner_module.plan_capacity
    pages = 12  # a, b and c after two steps: 1 latent frame per step, per CFG branch

    def short_plan(*args, **kwargs):
        return dataclasses.replace(plan_capacity(*args, **kwargs), num_managed_pages=pages)

    monkeypatch.setattr(runner_module, "plan_capacity", short_plan)
    engine, events = make_engine()
    assert engine.runner.capacity_plan.session_capacity == 4
    check_fault(engine, events, reference, "c", 2, contextlib.nullcontext, KVCacheExhaustedError,
                rf"session 'c', branch 'positive': KV page pool exhausted: 1 page requested, 0 free of {pages}")


def test_failing_hooks_release_the_kv_and_are_reported(reference, monkeypatch):
    engine, events = make_engine()
    runner, pipe = engine.runner, engine.pipeline
    total = runner.pool_usage().num_pages
    for s in (*BYSTANDERS, "c"):
        run(engine, s, 0)
    before = {s: snapshot(engine, s) for s in BYSTANDERS}
    free_without_c = total - sum(held(engine, s) for s in BYSTANDERS)

    def broken(hook):
        def fail(session_id):
            getattr(type(pipe), hook)(pipe, session_id)  # the real hook runs, then it fails
            raise InjectedFault(f"injected fault in the {hook} of {session_id!r}")
        fail.__name__ = hook
        return fail

    # Explicit close and reset: the caller gets a LifecycleHookError naming the hook; the KV is released.
    monkeypatch.setattr(pipe, "close_ar_diffusion_session", broken("close_ar_diffusion_session"))
    with pytest.raises(LifecycleHookError, match=r"close_ar_diffusion_session\('c'\) raised InjectedFault"):
        runner.close_session("c")
    assert runner.session_ids == [*BYSTANDERS] and runner.pool_usage().num_free == free_without_c
    monkeypatch.setattr(pipe, "reset_ar_diffusion_session", broken("reset_ar_diffusion_session"))
    run(engine, "c", 0)
    with pytest.raises(LifecycleHookError, match=r"reset_ar_diffusion_session\('c'\)"):
        runner.reset_session("c")
    assert runner.pool_usage().num_free == free_without_c

    # A reset flag on a request: as reset_session, the caller gets the LifecycleHookError and the forward does not
    # run (it ran on whatever the failing hook had left of the pipeline's state for the session, the error only an
    # event); the KV is released, and the next request starts afresh.
    run(engine, "c", 0)
    with pytest.raises(LifecycleHookError, match=r"reset_ar_diffusion_session\('c'\)") as info:
        run(engine, "c", 0, reset=True)
    assert any("did not run" in note and "next request starts afresh" in note for note in info.value.__notes__)
    assert runner.session_ids == [*BYSTANDERS] and runner.pool_usage().num_free == free_without_c
    out = run(engine, "c", 0, reset=True)  # not resident: no hook to call
    assert_outputs_equal(out, reference[("c", 0)])
    hook_events = [e for e in events if isinstance(e, HookFailed)]
    assert [e.hook for e in hook_events] == ["close_ar_diffusion_session", "reset_ar_diffusion_session",
                                             "reset_ar_diffusion_session"]
    assert all(e.session_id == "c" and "injected fault" in e.error for e in hook_events)
    assert len(runner.hook_errors) == 3

    for s in BYSTANDERS:
        assert_same(before[s], snapshot(engine, s))
    monkeypatch.undo()
    engine.close()
    assert runner.pool_usage().num_free == total and pipe.sessions == {}


def test_eviction_with_a_failing_close_hook_still_admits(monkeypatch):
    config = {**CONFIG, "runtime": {**CONFIG["runtime"], "session_capacity": 2}}
    engine = ARDiffusionEngine.from_config(config)
    events: list = []
    engine.subscribe(events.append)
    engine.load()
    runner, pipe = engine.runner, engine.pipeline
    total = runner.pool_usage().num_pages
    run(engine, "a", 0)
    run(engine, "b", 0)
    before_b = snapshot(engine, "b")

    def close_ar_diffusion_session(session_id):
        type(pipe).close_ar_diffusion_session(pipe, session_id)
        raise InjectedFault(f"injected fault in the close hook of {session_id!r}")

    monkeypatch.setattr(pipe, "close_ar_diffusion_session", close_ar_diffusion_session)
    run(engine, "c", 0)  # evicts "a": its hook fails, the admission does not
    assert runner.session_ids == ["b", "c"] and set(pipe.sessions) == {"b", "c"}
    assert any(isinstance(e, HookFailed) and e.session_id == "a" for e in events)
    assert_same(before_b, snapshot(engine, "b"))
    assert runner.pool_usage().num_free == total - held(engine, "b") - held(engine, "c")
    monkeypatch.undo()
    engine.close()
    assert runner.pool_usage().num_free == total


def test_a_failure_is_the_pipelines_unless_memory_or_open_files_ran_out_or_an_ardiff_invariant_broke():
    """What decides the exit code and hint of a failed step: memory running out is exit 3 with the memory hint, a
    broken invariant a bug in ardiff, anything else the pipeline's failure naming it. CUDA's own OutOfMemoryError
    and the RuntimeErrors cuBLAS and cuDNN raise on a full GPU are memory; an AssertionError never raised (no
    traceback to place it by) is ardiff's."""
    from ardiff_cli.runtime.errors import (PipelineError, as_pipeline_error, is_broken_invariant, is_out_of_memory,
                                           out_of_memory_message, too_many_open_files)

    for exc in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"), MemoryError(),
                RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
                RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), RuntimeError("std::bad_alloc")):
        assert is_out_of_memory(exc) and as_pipeline_error("Pipe.forward", exc) is None, exc
    # C++'s bad_alloc as torch raises it (importing torch under `ulimit -v 650000`): it was `unexpected RuntimeError`
    assert out_of_memory_message(RuntimeError("std::bad_alloc")) == "out of host memory: RuntimeError: std::bad_alloc"
    assert out_of_memory_message(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")).startswith("out of GPU memory")
    assert not is_out_of_memory(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_broken_invariant(AssertionError("free count out of sync with the free list"))
    assert as_pipeline_error("Pipe.forward", AssertionError("never raised")) is None
    error = as_pipeline_error("Pipe.forward", ValueError("bad shape"))
    assert type(error) is PipelineError and str(error) == "Pipe.forward failed: ValueError: bad shape"
    for exc in (OSError(errno.EMFILE, os.strerror(errno.EMFILE)), OSError(errno.ENFILE, os.strerror(errno.ENFILE)),
                RuntimeError("unable to open file <m.safetensors> in read-only mode: Too many open files (24)")):
        assert too_many_open_files(exc) and as_pipeline_error("Pipe.from_config()", exc) is None, exc
    assert not too_many_open_files(OSError(errno.ENOENT, os.strerror(errno.ENOENT)))
