"""Soak: 10,000 requests over 1,000 session ids (Zipf), random resets and closes, capacity 4.

Checks after every request: the session table matches a reference LRU model,
no page is held twice or leaked, committed frames match what the session
itself committed since admission. Every few hundred requests a resident
session is replayed on a fresh runner from its admission: its outputs must be
bit-identical (no session ever sees another's KV). Memory stays flat.
"""

from __future__ import annotations

import random
import resource
import tracemalloc
from collections import OrderedDict, deque

import numpy as np
import pytest
import torch
from tiny_pipeline import TinyPipeline, request, tiny_spec

from ardiff_cli.runtime.runner import ARDiffusionModelRunner

NUM_REQUESTS = 10_000
NUM_SESSIONS = 1_000
CAPACITY = 4


def _runner() -> ARDiffusionModelRunner:
    spec = tiny_spec(num_layers=2, session_capacity=CAPACITY)
    pipeline = TinyPipeline(spec, seed=1)
    pipeline.hook_calls = deque(maxlen=64)  # the test double's own record must not grow over the soak
    runner = ARDiffusionModelRunner(pipeline, memory_budget=64 << 20)
    runner.load()
    return runner


def _replay(history: list[tuple[str, int, bool]], session: str):
    """Outputs of ``session``'s requests since admission, run alone on a fresh runner."""
    runner = _runner()
    out = None
    for sid, step, reset in history:
        out = runner.execute_model(request(sid, step, frames=1, reset=reset))["main"]
    return out


@pytest.mark.usefixtures("single_thread")
def test_soak_zipf_churn_has_no_leaks_and_no_crosstalk():
    rng = random.Random(1234)
    ranks = np.arange(1, NUM_SESSIONS + 1)
    weights = 1.0 / ranks**1.1
    zipf = np.random.default_rng(1234).choice(NUM_SESSIONS, size=NUM_REQUESTS, p=weights / weights.sum())

    runner = _runner()
    allocator = runner.kv_cache.allocator
    pool_bytes = runner.kv_cache.pool.nbytes
    reference: OrderedDict[str, int] = OrderedDict()  # session -> frames committed since admission
    history: dict[str, list[tuple[str, int, bool]]] = {}  # session -> its requests since admission
    hits = 0
    rss_start = 0
    tracemalloc.start()
    for i, index in enumerate(zipf):
        sid = f"s{index}"
        reset = rng.random() < 0.02
        close = rng.random() < 0.02
        if i == NUM_REQUESTS // 10:
            rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            traced_start, _ = tracemalloc.get_traced_memory()
        hits += sid in reference and not reset
        out = runner.execute_model(request(sid, i, frames=1, reset=reset, close_session=close))["main"]

        # reference LRU model
        if reset:
            reference.pop(sid, None)
            history.pop(sid, None)
        if sid in reference:
            reference.move_to_end(sid)
        else:
            if len(reference) >= CAPACITY:
                victim, _ = reference.popitem(last=False)
                history.pop(victim)
            reference[sid] = 0
            history[sid] = []
        reference[sid] += 1
        history[sid].append((sid, i, reset and not history[sid]))
        if close:
            del reference[sid]
            del history[sid]

        assert runner.session_ids == list(reference), f"request {i}: LRU table diverged"
        held = [p for s in runner._sessions.values() for p in s.state._adapter("main").page_ids]
        assert len(held) == len(set(held)) == allocator.num_used, f"request {i}: page held twice or leaked"
        for s, frames in reference.items():
            assert runner._sessions[s].state._adapter("main").num_committed_frames == frames

        if i % 500 == 499 and sid in reference:
            torch.testing.assert_close(_replay(history[sid], sid), out, rtol=0, atol=0)

    runner.close_all()
    assert allocator.num_used == 0 and runner.kv_cache.pool.nbytes == pool_bytes
    traced_end, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_growth_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_start
    assert traced_end - traced_start < 256 * 1024, f"Python heap grew by {traced_end - traced_start} bytes"
    assert rss_growth_kib < 64 * 1024, f"peak RSS grew by {rss_growth_kib} KiB"
    assert 0.05 < hits / NUM_REQUESTS < 0.5  # Zipf over 1,000 ids at capacity 4: both hits and evictions (~15% hits)
