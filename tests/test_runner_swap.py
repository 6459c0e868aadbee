"""Swapping LRU-evicted sessions to disk (ARDiffusionModelRunner with a swap store), with both real pipelines.

A session swapped out and restored must go on exactly as if it had stayed resident: outputs bit-identical, the
pool's page counts exact, its files deleted once restored, and nothing half-restored after a bad file.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_pipeline import TinyPipeline, request, tiny_spec

from ardiff_cli.runtime.config import load_config
from ardiff_cli.runtime.engine import ARDiffusionEngine
from ardiff_cli.runtime.errors import (ArdiffWarning, ConfigError, ObservationError, RequestError, RequestTypeError,
                                      SwapRestoreError)
from ardiff_cli.runtime.request import ARDiffusionRequest
from ardiff_cli.runtime.runner import ARDiffusionModelRunner
from pipelines.dreamzero.pipeline import DreamZeroPipeline
from pipeline_helpers import CONFIGS, UntimedFutex

pytestmark = pytest.mark.usefixtures("single_thread", "ardiff_cache")


def engine_for(name: str, *, capacity: int, swap_dir=None, swap_space=None,
               dtype: str | None = None) -> tuple[ARDiffusionEngine, list]:
    engine = ARDiffusionEngine.from_config(CONFIGS / f"{name}.yaml", device="cpu", memory_budget="1GiB",
                                           attention_backend="torch", session_capacity=capacity,
                                           swap_dir=swap_dir, swap_space=swap_space, dtype=dtype)
    events: list = []
    engine.subscribe(events.append)
    engine.load()
    return engine, events


def inputs_for(pipe, session: str, step: int) -> dict:
    seed = 10 * (ord(session[-1]) % 10) + step
    if hasattr(pipe, "image_encoder"):  # DreamZero: one frame first, then four
        return pipe.example_inputs(1 if step == 0 else 4, prompt=f"task {session}", seed=seed)
    return pipe.example_inputs(prompt=f"task {session}", seed=seed)


def run(engine, session: str, step: int) -> dict:
    pipe = engine.pipeline
    return engine.execute(ARDiffusionRequest(f"{session}/{step}", inputs_for(pipe, session, step),
                                             {"session_id": session}))


def assert_same(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs"


def a_swapped_out(tmp_path) -> tuple[ARDiffusionEngine, list]:
    """A causal-world-tiny engine with one resident session: "a" ran step 0, then "b" did, swapping "a" out (its
    file written)."""
    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    run(engine, "a", 0)
    run(engine, "b", 0)
    engine.runner.swap.flush()
    return engine, events


def pages_held(engine) -> int:
    return engine.runner.pool_usage().num_used


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name, steps", [("dreamzero-tiny", 5), ("causal-world-tiny", 5)])
def test_a_swapped_and_restored_session_runs_on_bit_identical_to_an_uninterrupted_one(tmp_path, name, steps, dtype):
    reference, _ = engine_for(name, capacity=1, dtype=dtype)
    want = {session: [run(reference, session, step) for step in range(steps)] for session in ("a", "b")}
    assert reference.runner.kv_cache.pool.dtype == getattr(torch, dtype)
    reference.close()

    engine, events = engine_for(name, capacity=1, swap_dir=tmp_path / "swap", dtype=dtype)
    runner = engine.runner
    got: dict[str, list] = {"a": [], "b": []}
    for step in range(steps):
        for session, other in (("a", "b"), ("b", "a")):
            if session == "a" and step == 0:
                got[session].append(run(engine, session, step))
                continue
            if step:  # swapped out by the other's step: back without replay
                assert runner.restore_session(session) is True
            got[session].append(run(engine, session, step))
            # capacity 1: the other session was swapped out to make room
            evicted = [e for e in events if e.kind == "session_evicted"][-1]
            assert evicted.session_id == other and evicted.swapped and evicted.swap_bytes > 0
            if step % 2:  # its file written (else the next restore may take it from memory, its write in flight)
                runner.swap.flush()
                usage = runner.pool_usage()  # the file's size, within the bytes the eviction planned for it
                assert usage.swapped_bytes == runner.swap.path_for(other).stat().st_size <= evicted.swap_bytes
                assert len(list((tmp_path / "swap").glob("*.safetensors"))) == 1  # a restored file is deleted
            usage = runner.pool_usage()
            assert usage.num_swapped == 1
            assert usage.num_used == sum(sum(v.pages_per_branch.values()) for v in runner.sessions())
    for session in ("a", "b"):
        for step, (g, w) in enumerate(zip(got[session], want[session])):
            assert_same(g, w, f"{name} session {session} step {step}")
    restored = [e for e in events if e.kind == "session_restored"]
    assert len(restored) == 2 * (steps - 1) and all(e.swap_bytes > 0 for e in restored)
    engine.close()
    assert not (tmp_path / "swap").exists(), "close() deletes the swap files and their folder"
    assert runner.pool_usage().num_free == runner.pool_usage().num_pages


def test_page_accounting_is_exact_after_swap_out_and_restore(tmp_path):
    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    for step in range(4):
        run(engine, "a", step)
    held = pages_held(engine)
    (view,) = runner.sessions()
    run(engine, "b", 0)
    held_by_b = pages_held(engine)
    runner.close_session("b")
    assert pages_held(engine) == 0
    assert runner.restore_session("a")
    assert pages_held(engine) == held
    (restored,) = runner.sessions()
    assert restored.pages_per_branch == view.pages_per_branch and restored.committed_frames == view.committed_frames
    assert restored.num_requests == view.num_requests == 4
    assert restored.cross_attention_bytes == view.cross_attention_bytes
    assert held_by_b < held
    engine.close()


@pytest.mark.parametrize("name", ["dreamzero-tiny", "causal-world-tiny"])
def test_a_restored_sessions_view_is_the_one_it_had_before_it_was_swapped_out(tmp_path, name):
    # Two CFG branches with text and image caches (DreamZero), a window past its sink (causal-world): the view a
    # panel or a /status handler reads must not change because the session went to disk and back.
    engine, _ = engine_for(name, capacity=1, swap_dir=tmp_path)
    for step in range(4):
        run(engine, "a", step)
    (before,) = engine.runner.sessions()
    run(engine, "b", 0)  # a swapped out
    assert engine.runner.restore_session("a")  # b swapped out for it
    (after,) = engine.runner.sessions()
    assert len(before.pages_per_branch) == (2 if name == "dreamzero-tiny" else 1)
    assert before.cross_attention_bytes > 0 and before.num_requests == 4
    # but when it was admitted and its last request's latency: this admission ran none yet
    assert after.last_latency_s is None and after.admitted_at >= before.admitted_at
    assert dataclasses.replace(after, admitted_at=before.admitted_at, last_latency_s=before.last_latency_s) == before
    engine.close()


def test_a_snapshot_of_another_request_count_than_the_caller_counts_is_not_restored(tmp_path):
    # The CLI restores a kept snapshot of fewer steps than its episode has done and replays the rest: the count in
    # the index it trusts must be the snapshot's own, or a session a step ahead would go on as if it were not.
    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    for step in range(2):
        run(engine, "a", step)
    run(engine, "b", 0)  # a swapped out after 2 requests
    with pytest.raises(SwapRestoreError, match=r"ValueError: it holds 2 requests, not the 1 expected"):
        runner.restore_session("a", num_requests=1)
    assert runner.session_ids == ["b"] and not runner.swap.has("a")  # deleted, as any snapshot that cannot restore
    run(engine, "a", 0)  # b swapped out after 1 request: the right count restores it
    assert runner.restore_session("b", num_requests=1) and runner.sessions()[-1].num_requests == 1
    with pytest.raises(SwapRestoreError, match=r"ValueError: it holds 1 request, not the 2 expected"):  # not "1 requests"
        runner.restore_session("a", num_requests=2)  # a swapped out after its 1 request since
    engine.close()


def test_a_request_count_of_another_type_is_a_request_error_and_keeps_the_snapshot(tmp_path):
    # '1' read from a JSON file: it was compared with the snapshot's 1, "it holds 1 requests, not the 1 expected",
    # and the snapshot deleted, the session's history lost to a caller's type mistake
    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    first = run(engine, "a", 0)
    run(engine, "b", 0)  # a swapped out after 1 request
    for bad in ("1", 1.0, True, -1, [1]):
        with pytest.raises(RequestError, match=r"restore_session\(\): num_requests must be a non-negative") as e:
            runner.restore_session("a", num_requests=bad)
        assert isinstance(e.value, TypeError) is (bad != -1)  # a RequestTypeError for a count of another type
        assert runner.swap.has("a") and runner.session_ids == ["b"]
    assert runner.restore_session("a", num_requests=np.int64(1))  # a numpy count is an integer
    second = run(engine, "a", 1)
    engine.close()
    alone, _ = engine_for("causal-world-tiny", capacity=1)
    assert_same(run(alone, "a", 0), first, "first step")
    assert_same(run(alone, "a", 1), second, "the step after the restore")
    alone.close()


def test_over_budget_drops_the_least_recently_swapped_snapshot(tmp_path):
    engine, events = a_swapped_out(tmp_path)
    runner = engine.runner
    one = runner.pool_usage().swapped_bytes
    runner.swap.budget_bytes = int(one * 1.5)  # room for one snapshot of this size, not two
    del events[:]
    run(engine, "c", 0)  # b swapped out: a's snapshot, the oldest, goes
    assert runner.pool_usage().num_swapped == 1 and runner.swap.num_dropped == 1
    # An API caller is told, as the eviction had told it the snapshot was there (no event came)
    assert [(e.kind, e.session_id) for e in events][:3] == [
        ("snapshot_dropped", "a"), ("session_evicted", "b"), ("session_admitted", "c")]
    assert events[0].to_dict() == {"kind": "snapshot_dropped", "session_id": "a", "swap_bytes": one,  # its file's
                                   "by_session_id": "b", "time": events[0].time}
    assert runner.restore_session("a") is False  # replay is the caller's fallback
    assert runner.restore_session("b") is True
    runner.swap.budget_bytes = one // 2  # a snapshot larger than the whole budget is not written, and said once
    with pytest.warns(ArdiffWarning, match=r"larger than the whole swap space"):
        run(engine, "d", 0)
    last = [e for e in events if e.kind == "session_evicted"][-1]
    assert last.session_id in ("b", "c") and not last.swapped and last.swap_bytes == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(engine, "e", 0)  # d evicted without a snapshot too, and no second warning
    evicted = [e for e in events if e.kind == "session_evicted"]
    last = evicted[-1]
    assert last.session_id == "d" and not last.swapped
    # each is a swap_failed event (not background) before its session_evicted: counted, as a write that failed
    failed = [(i, e) for i, e in enumerate(events) if e.kind == "swap_failed"]
    assert [e.session_id for _, e in failed] == [evicted[-2].session_id, "d"]
    assert not any(e.background for _, e in failed)
    assert all("is larger than the whole swap space" in e.error for _, e in failed)
    assert all(events[i + 1] is e for (i, _), e in zip(failed, evicted[-2:])), events
    engine.close()


def test_a_snapshot_over_the_swap_space_is_said_to_be_larger_with_the_size_its_file_takes(tmp_path):
    """The warning gave the bytes of the tensors alone, without the file's header: a snapshot of 99.00 KiB was
    "larger than the whole swap space (100.00 KiB)"."""
    engine, _ = a_swapped_out(tmp_path)
    runner = engine.runner
    one = runner.pool_usage().swapped_bytes  # a's file; b's, with the same history, takes as much
    runner.swap.budget_bytes = one - 256
    with pytest.warns(ArdiffWarning, match=r"larger than the whole swap space") as caught:
        run(engine, "c", 0)  # b is evicted, over the budget
    (message,) = [str(w.message) for w in caught if "larger than the whole" in str(w.message)]
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
    snapshot, space = [float(n) * units[u] for n, u in re.findall(r"\(([0-9.]+) (B|KiB|MiB)\)", message)]
    assert snapshot > space, message
    engine.close()


def test_a_snapshot_a_few_bytes_over_the_swap_space_is_said_to_be_larger_in_bytes(tmp_path):
    # A swap space one byte short of the snapshot: both sizes rounded to "50.78 KiB", "larger than" an equal size.
    engine, events = a_swapped_out(tmp_path)
    runner = engine.runner
    run(engine, "c", 0)  # b swapped out: its planned bytes are c's too (the same history)
    planned = [e.swap_bytes for e in events if e.kind == "session_evicted" and e.session_id == "b"][-1]
    runner.swap.budget_bytes = planned - 1
    with pytest.warns(ArdiffWarning, match=r"larger than the whole swap space") as caught:
        run(engine, "d", 0)  # c is evicted, one byte over the budget
    (message,) = [str(w.message) for w in caught if "larger than the whole" in str(w.message)]
    assert (f"the snapshot of session 'c' ({planned:,} bytes) is larger than the whole swap space "
            f"({planned - 1:,} bytes)") in message, message
    engine.close()


def test_a_reset_request_discards_the_snapshot_of_its_id(tmp_path):
    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    run(engine, "a", 1)
    run(engine, "b", 0)  # a swapped out
    assert runner.pool_usage().num_swapped == 1
    pipe = engine.pipeline
    before = len(events)
    engine.execute(ARDiffusionRequest("a/again", inputs_for(pipe, "a", 0), {"session_id": "a", "reset": True}))
    # a new history for "a" (b swapped out now), after the event a resident session's reset request sends
    assert [(e.kind, e.session_id) for e in events[before:]][:3] == [
        ("session_reset", "a"), ("session_evicted", "b"), ("session_admitted", "a")]
    assert events[before].reason == "request_reset"
    assert runner.pool_usage().num_swapped == 1 and runner.swap.has("b") and not runner.swap.has("a")
    assert not [e for e in events if e.kind == "session_restored"]
    assert runner.restore_session("a") is False
    (view,) = runner.sessions()
    assert view.committed_frames == {"main": 3}  # one block: the old history never came back
    runner.close_session("b")  # closing a swapped-out session deletes its snapshot, with the event a close has
    assert runner.pool_usage().num_swapped == 0 and not list(tmp_path.glob("*.safetensors"))
    last = events[-1]
    assert (last.kind, last.session_id, last.reason) == ("session_closed", "b", "explicit")
    run(engine, "b", 0)  # a swapped out again; a reset of it deletes its snapshot too, with a reset event
    runner.reset_session("a")
    last = events[-1]
    assert (last.kind, last.session_id, last.reason) == ("session_reset", "a", "explicit")
    assert runner.pool_usage().num_swapped == 0 and runner.restore_session("a") is False
    engine.close()


@pytest.mark.parametrize("name", ["dreamzero-tiny", "causal-world-tiny"])
def test_a_request_for_a_swapped_out_session_restores_it_first(tmp_path, name):
    # It used to start the session afresh and delete the snapshot: the Python API lost the history that the
    # swap space was there to keep, unless the caller knew to call restore_session first.
    reference, _ = engine_for(name, capacity=1)
    want = [run(reference, "a", step) for step in range(3)]
    reference.close()
    engine, events = engine_for(name, capacity=1, swap_dir=tmp_path)
    got = []
    for step in range(3):
        got.append(run(engine, "a", step))
        run(engine, "b", step)  # a swapped out
    for step, (a, b) in enumerate(zip(got, want)):
        assert_same(a, b, f"step {step}")
    restored = [e.session_id for e in events if e.kind == "session_restored"]
    assert restored == ["a", "b", "a", "b"] and engine.runner.pool_usage().num_swapped == 1
    engine.close()


@pytest.mark.parametrize("name", ["dreamzero-tiny", "causal-world-tiny"])
def test_a_request_with_bad_inputs_touches_no_session(tmp_path, name):
    # It used to be refused only by the forward: for a new session after the least recently used one was evicted,
    # for a swapped-out one after it was restored (its history then released with the failed forward), for a
    # resident one after its history was released. A bad frame from one client cost another its session.
    reference, _ = engine_for(name, capacity=2)
    want = {session: [run(reference, session, step) for step in range(2)] for session in "abc"}
    reference.close()
    engine, events = engine_for(name, capacity=2, swap_dir=tmp_path)
    got = {session: [run(engine, session, 0)] for session in "abc"}  # "c" swapped "a" out
    engine.runner.swap.flush()
    before = (engine.runner.session_ids, engine.runner.pool_usage(), len(events))
    for session, reset in [("new", False), ("a", False), ("b", False), ("c", True)]:
        bad = dict(inputs_for(engine.pipeline, session, 1), prompt=3)
        with pytest.raises(ObservationError, match="prompt 'prompt' must be a string") as caught:
            engine.execute(ARDiffusionRequest(f"{session}/bad", bad, {"session_id": session, "reset": reset}))
        assert f"session '{session}' was touched: the session is as it was" in "".join(caught.value.__notes__)
    assert (engine.runner.session_ids, engine.runner.pool_usage(), len(events)) == before
    for session in "abc":
        got[session].append(run(engine, session, 1))
        for step, (a, b) in enumerate(zip(got[session], want[session])):
            assert_same(a, b, f"{session} step {step}")
    engine.close()


def test_a_request_for_a_session_whose_snapshot_is_corrupt_raises_and_does_not_run(tmp_path):
    engine, events = a_swapped_out(tmp_path)
    runner = engine.runner
    path = runner.swap.path_for("a")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SwapRestoreError, match="cannot restore session 'a' from"):
        run(engine, "a", 1)
    assert runner.session_ids == ["b"] and not path.exists() and runner.pool_usage().num_swapped == 0
    assert not [e for e in events if e.kind == "request_finished" and e.request_id == "a/1"]
    run(engine, "a", 0)  # the caller rebuilds it: a fresh session
    assert [v.committed_frames for v in runner.sessions()] == [{"main": 3}]
    engine.close()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing", "other-geometry", "other-dtype",
                                    "other-record", "other-fields", "flipped-bit"])
def test_a_corrupt_swap_file_is_a_clear_error_and_leaves_the_runner_consistent(tmp_path, damage):
    engine, events = engine_for("dreamzero-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    run(engine, "b", 0)  # a swapped out
    runner.swap.flush()  # its file written
    path = runner.swap.path_for("a")
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif damage == "missing":
        path.unlink()
    elif damage == "flipped-bit":  # one bit of its KV data changed on the disk: the header and its size are whole
        data = bytearray(path.read_bytes())
        data[-100] ^= 1
        path.write_bytes(bytes(data))
    else:
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        from ardiff_cli.runtime.swap import CRC_KEY, data_crc32

        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(path))
        if damage == "other-geometry":  # a readable snapshot of another geometry: one layer less in every KV tensor
            tensors = {k: t[:-1].clone() if k.startswith("kv/") else t for k, t in tensors.items()}
        elif damage == "other-dtype":  # the same geometry in half precision (a run with another --dtype, say)
            tensors = {k: t.half() if k.startswith("kv/") else t for k, t in tensors.items()}
        else:  # a pipeline record whose counter is not a number, or is named otherwise (another release's record)
            header = metadata["ardiff_swap"]
            given = '"num_requests": "1"' if damage == "other-record" else '"requests_done": 1'
            metadata["ardiff_swap"] = re.sub(r'"num_requests": 1(?=[,}])', given, header, count=1)
            assert given in metadata["ardiff_swap"]
        metadata[CRC_KEY] = str(data_crc32(tensors))  # a whole file of its own: its data as written
        save_file(tensors, str(path), metadata=metadata)
    free = runner.pool_usage().num_free
    with pytest.raises(SwapRestoreError, match=r"cannot restore session 'a' from .*\.safetensors: ") as info:
        runner.restore_session("a")
    assert "snapshot was deleted" in info.value.hint
    if damage == "other-geometry":
        assert ", expected torch.float32 (2, 2," in str(info.value)  # checked before anyone is evicted for it
    if damage == "flipped-bit":  # it was restored, silently, as another history
        assert re.search(r"its data is damaged \(CRC-32 \d+, written as '\d+'\): its bytes changed on the disk",
                         str(info.value)), str(info.value)
    if damage == "other-dtype":
        # the dtype alone differs: the shape is this cache's
        assert re.search(r"'[\w/]+' is torch\.float16 (\([\d, ]+\)), expected torch\.float32 \1 ", str(info.value))
    if damage in ("other-record", "other-fields"):  # found by the pipeline once admitted: released whole, b was
        # swapped for it
        assert "DreamZeroPipeline.import_ar_diffusion_session() raised ValueError: " in str(info.value)
        assert ("field 'num_requests' is str, expected int" if damage == "other-record" else
                "'requests_done'], expected those of DreamZeroSession: [") in str(info.value)
        assert [e.reason for e in events if e.kind == "session_closed"] == ["restore_failed"]
        assert runner.session_ids == [] and runner.pool_usage().num_used == 0 and runner.restore_session("b")
    else:
        assert runner.session_ids == ["b"] and runner.pool_usage().num_free == free  # b untouched
    assert "a" not in engine.pipeline.sessions and runner.pool_usage().num_swapped == 0 and not path.exists()
    assert runner.restore_session("a") is False
    run(engine, "a", 0)  # the session starts afresh
    engine.close()


def test_a_snapshot_file_deleted_after_its_write_ended_is_a_failed_restore_before_the_runner_looked_too(tmp_path):
    # Deleted once its background write had ended but before the runner's next call looked at it, it was taken for
    # a write that failed: "cannot swap session 'a' out ... its snapshot is lost", a swap_failed event, and no warning
    # for any later write failing with FileNotFoundError; deleted a moment later, it was a failed restore, as here.
    engine, events = engine_for("dreamzero-tiny", capacity=1, swap_dir=tmp_path)
    run(engine, "a", 0)
    run(engine, "b", 0)  # a swapped out, its file written in the background
    writes_ended()
    engine.runner.swap.path_for("a").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ArdiffWarning)
        with pytest.raises(SwapRestoreError, match=r"cannot restore session 'a' from .*: FileNotFoundError: "):
            engine.runner.restore_session("a")
    assert not [e for e in events if e.kind == "swap_failed"]
    assert engine.runner.pool_usage().num_swapped == 0 and engine.runner.restore_session("a") is False
    engine.close()


@pytest.mark.parametrize("where", ["import", "count"])
def test_ctrl_c_while_a_session_is_restored_leaves_no_part_of_it_resident(tmp_path, monkeypatch, where):
    # It used to stay resident with its KV restored but no pipeline record (and 0 requests): its next request
    # would have silently started another history on top of the old KV. A stop once the pipeline took its record
    # back, before the runner counted its requests, left it resident with a count of 0.
    engine, events = engine_for("dreamzero-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    run(engine, "b", 0)  # a swapped out

    def ctrl_c(session_id, snapshot):
        raise KeyboardInterrupt

    if where == "import":
        monkeypatch.setattr(engine.pipeline, "import_ar_diffusion_session", ctrl_c)
    else:  # the view, taken as the requests are counted: once the pipeline took its record back (not at admission)
        imported, real_import, real_snapshot = [], engine.pipeline.import_ar_diffusion_session, runner._snapshot
        monkeypatch.setattr(engine.pipeline, "import_ar_diffusion_session",
                            lambda *args: imported.append(True) or real_import(*args))
        monkeypatch.setattr(runner, "_snapshot", lambda *args: ctrl_c(*args) if imported else real_snapshot(*args))
    with pytest.raises(KeyboardInterrupt):  # as itself, not a SwapRestoreError
        runner.restore_session("a")
    assert runner.session_ids == [] and runner.pool_usage().num_used == 0 and "a" not in engine.pipeline.sessions
    runner.swap.flush()
    assert not runner.swap.has("a") and not runner.swap.path_for("a").exists()  # deleted as it was read
    assert [(e.session_id, e.reason) for e in events if e.kind == "session_closed"] == [("a", "restore_failed")]
    engine.close()


def test_a_stop_while_a_snapshot_is_read_is_the_stop_not_an_unreadable_snapshot(tmp_path, monkeypatch):
    """The CLI's Interrupted (a StopRequested, an Exception) raised while a snapshot file is read propagates as
    itself: not taken for an unreadable file (a SwapRestoreError, whose episode fails) or for a pipeline's error;
    nobody is evicted for the session, and its snapshot goes, as in a stop while the pipeline takes it back."""
    from ardiff_cli.runtime.errors import StopRequested

    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    run(engine, "b", 0)  # a swapped out
    runner.swap.flush()

    def stop(session_id):
        raise StopRequested("interrupted while reading")

    monkeypatch.setattr(runner.swap, "read", stop)
    with pytest.raises(StopRequested) as info:
        runner.restore_session("a")
    assert type(info.value) is StopRequested and info.value.__cause__ is None
    monkeypatch.undo()
    assert runner.session_ids == ["b"] and not [e for e in events if e.kind in ("session_restored", "swap_failed")]
    assert not runner.swap.has("a") and not runner.swap.path_for("a").exists()
    engine.close()


def test_ctrl_c_just_after_a_snapshot_was_written_leaves_the_session_resident_without_it(tmp_path, monkeypatch):
    # The snapshot used to stay: the session was resident and swapped out at once, and its next request restored
    # the stale snapshot into it, which failed and released it (its history lost).
    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    write = runner.swap.write

    def write_then_ctrl_c(session_id, tensors, metadata, **options):
        write(session_id, tensors, metadata, **options)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.swap, "write", write_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run(engine, "b", 0)
    assert runner.session_ids == ["a"] and not runner.swap.has("a") and not list(tmp_path.glob("*.safetensors"))
    monkeypatch.undo()
    got = run(engine, "a", 1)  # goes on where it was
    reference, _ = engine_for("causal-world-tiny", capacity=1)
    run(reference, "a", 0)
    assert_same(got, run(reference, "a", 1), "step 1")
    assert not [e for e in events if e.kind in ("session_restored", "session_closed")]
    reference.close()
    engine.close()


def test_a_swap_write_failure_is_a_warning_and_the_eviction_goes_on(tmp_path):
    blocker = tmp_path / "not-a-folder"
    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=blocker / "swap", swap_space=1 << 30)
    blocker.write_text("a file where the swap folder should go")  # after the engine was made: it refuses one at once
    run(engine, "a", 0)
    with pytest.warns(ArdiffWarning, match=r"cannot swap session 'a' out to .*not-a-folder/swap \(.*Error") as said:
        run(engine, "b", 0)
        run(engine, "a", 0)  # every eviction fails alike: one warning, not one each
        run(engine, "b", 0)
    assert len(said) == 1 and "later snapshots that fail alike are not warned about" in str(said[0].message)
    evicted = [e for e in events if e.kind == "session_evicted"]
    assert [(e.session_id, e.swapped) for e in evicted] == [("a", False), ("b", False), ("a", False)]
    # each failure is an event (before its eviction's), not after an eviction said swapped: not background
    failed = [(e.kind, e.session_id, getattr(e, "background", None)) for e in events
              if e.kind in ("swap_failed", "session_evicted")]
    assert failed == [("swap_failed", "a", False), ("session_evicted", "a", None), ("swap_failed", "b", False),
                      ("session_evicted", "b", None), ("swap_failed", "a", False), ("session_evicted", "a", None)]
    assert engine.runner.restore_session("a") is False and engine.runner.session_ids == ["b"]
    engine.close()


def test_a_swap_dir_linked_to_a_folder_removed_meanwhile_is_named_as_such(tmp_path):
    # It said "FileExistsError: [Errno 17] File exists: '.../swap'" (mkdir of a link that leads nowhere) for every
    # eviction after a scratch disk's folder that OUT/.swap links to was removed or unmounted mid-run.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / "swap").symlink_to(scratch)
    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "swap", swap_space=1 << 30)
    run(engine, "a", 0)
    scratch.rmdir()
    with pytest.warns(ArdiffWarning, match=r"cannot swap session 'a' out to .*swap \(FileNotFoundError: \[Errno 2\] "
                      r".*swap is a link to .*scratch, which does not exist\); it is evicted without a snapshot"):
        run(engine, "b", 0)
    assert [e.error for e in events if e.kind == "swap_failed"] == [
        f"FileNotFoundError: [Errno 2] {tmp_path / 'swap'} is a link to {scratch}, which does not exist"]
    engine.close()


def test_a_swap_dir_linked_through_another_link_to_a_removed_folder_names_the_folder(tmp_path):
    # OUT/.swap -> hop -> scratch: it said "OUT/.swap is a link to hop, which does not exist" while hop, a link, was
    # there for `ls` to show; what was missing was scratch, which it did not name.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / "hop").symlink_to("scratch")
    (tmp_path / "swap").symlink_to("hop")
    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "swap", swap_space=1 << 30)
    run(engine, "a", 0)
    scratch.rmdir()
    with pytest.warns(ArdiffWarning, match=r"cannot swap session 'a' out to .*swap \(FileNotFoundError: "):
        run(engine, "b", 0)
    assert [e.error for e in events if e.kind == "swap_failed"] == [
        f"FileNotFoundError: [Errno 2] {tmp_path / 'swap'} is a link to hop, a link that leads to "
        f"{os.path.realpath(scratch)}, which does not exist"]
    engine.close()


def test_the_views_stay_readable_from_another_thread_while_a_snapshot_is_written(tmp_path, monkeypatch):
    # The CLI's status thread reads sessions() and pool_usage() on every refresh. The swap file of a large session
    # takes seconds to write; it used to be written under the session-table lock, freezing the panels meanwhile.
    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    seen: list = []
    write = runner.swap.write

    def write_while_another_thread_reads(session_id, tensors, metadata, **options):
        reader = threading.Thread(target=lambda: seen.append(
            ([v.session_id for v in runner.sessions()], runner.pool_usage().num_used)), daemon=True)
        reader.start()
        reader.join(timeout=30)  # a liveness bound, not a timing: the old code blocked until the write was done
        seen.append("reader done" if not reader.is_alive() else "reader blocked")
        return write(session_id, tensors, metadata, **options)

    monkeypatch.setattr(runner.swap, "write", write_while_another_thread_reads)
    used = runner.pool_usage().num_used
    run(engine, "b", 0)  # evicts a, swapping it out
    assert seen == [(["a"], used), "reader done"]  # a is still resident, whole, while its snapshot is written
    assert runner.session_ids == ["b"] and runner.restore_session("a") is True
    engine.close()


class ViewsOfOneBuffer(DreamZeroPipeline):
    """A third-party pipeline whose exported state holds a tensor and a view of it (a buffer and its first row)."""

    def export_ar_diffusion_session(self, session_id):
        state = super().export_ar_diffusion_session(session_id)
        return state and {**state, "first_row": state["anchor_latent"][0]}

    def import_ar_diffusion_session(self, session_id, snapshot):
        first_row = snapshot.pop("first_row")
        assert torch.equal(first_row, snapshot["anchor_latent"][0])
        super().import_ar_diffusion_session(session_id, snapshot)


class TupleInItsState(DreamZeroPipeline):
    """A third-party pipeline whose exported state holds a tuple, which JSON would give back as a list."""

    def export_ar_diffusion_session(self, session_id):
        state = super().export_ar_diffusion_session(session_id)
        return state and {**state, "grid": (2, 2)}

    def import_ar_diffusion_session(self, session_id, snapshot):
        assert snapshot.pop("grid") == (2, 2)
        super().import_ar_diffusion_session(session_id, snapshot)


def third_party_engine(pipeline: str, swap_dir) -> tuple[ARDiffusionEngine, list]:
    config = load_config(CONFIGS / "dreamzero-tiny.yaml", pipeline=f"test_runner_swap:{pipeline}")
    engine = ARDiffusionEngine(config.with_runtime(where="test", device="cpu", memory_budget="1GiB",
                                                   attention_backend="torch", session_capacity=1),
                               swap_dir=swap_dir)
    events: list = []
    engine.subscribe(events.append)
    engine.load()
    return engine, events


def test_an_exported_state_of_views_of_one_buffer_is_swapped_and_restored(tmp_path):
    # safetensors refuses tensors that share memory: every eviction used to warn 'Some tensors share memory ...
    # use save_model' and replay instead.
    engine, events = third_party_engine("ViewsOfOneBuffer", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(engine, "a", 0)
        run(engine, "b", 0)
    assert [e.swapped for e in events if e.kind == "session_evicted"] == [True]
    assert engine.runner.restore_session("a") is True
    engine.close()


def test_an_exported_value_that_json_would_change_is_refused_with_a_warning_naming_it(tmp_path):
    # It used to be written as JSON and given back as a list: a silently different session after a restore.
    engine, events = third_party_engine("TupleInItsState", tmp_path)
    run(engine, "a", 0)
    with pytest.warns(ArdiffWarning, match=r"cannot swap session 'a' out to .*\(TypeError: TupleInItsState\."
                      r"export_ar_diffusion_session\('a'\)\['grid'\] is a tuple \(\(2, 2\)\), which JSON gives "
                      r"back as another type or not at all: .*\); it is evicted without a snapshot"):
        run(engine, "b", 0)
    assert [e.swapped for e in events if e.kind == "session_evicted"] == [False]
    assert engine.runner.restore_session("a") is False  # the caller replays
    engine.close()


@pytest.mark.parametrize("value", [torch.zeros(2), 0], ids=["tensor", "plain"])
def test_an_exported_name_that_is_no_str_is_refused_as_the_snapshot_would_give_it_back_as_one(value):
    """{1: value}: a plain value came back under '1', a tensor's snapshot could not be restored (and replayed)."""
    from ardiff_cli.runtime.kv.state import KVSnapshot
    from ardiff_cli.runtime.swap import encode_snapshot

    with pytest.raises(TypeError, match=r"^P.export_ar_diffusion_session\('a'\) has the key 1, a int, which a "
                                        r"snapshot gives back as a str$"):
        encode_snapshot(KVSnapshot({}, {}), {1: value}, 0, where="P.export_ar_diffusion_session('a')")


def test_a_pipeline_without_the_protocol_is_evicted_as_before(tmp_path):
    runner = ARDiffusionModelRunner(TinyPipeline(tiny_spec()), memory_budget=64 << 20, session_capacity=1,
                                    swap_dir=tmp_path)
    runner.load()
    assert runner.swap is None
    runner.execute_model(request("a", 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runner.execute_model(request("b", 0))
    assert runner.restore_session("a") is False and not list(tmp_path.iterdir())
    assert runner.swap_out_sessions(["b"]) == {} and runner.session_ids == ["b"]  # nothing to swap it out to
    runner.close()


class _KVOnly(TinyPipeline):
    """Swaps its sessions, and keeps nothing of them outside the KV: its export is None, as the README allows."""

    def __init__(self) -> None:
        super().__init__(tiny_spec())
        self.imported: list[tuple[str, object]] = []

    def export_ar_diffusion_session(self, session_id):
        return None

    def import_ar_diffusion_session(self, session_id, snapshot):
        self.imported.append((session_id, snapshot))


def test_a_pipeline_that_exports_none_is_swapped_and_restored_bit_identical(tmp_path):
    reference = ARDiffusionModelRunner(_KVOnly(), memory_budget=64 << 20, session_capacity=2)
    runner = ARDiffusionModelRunner(_KVOnly(), memory_budget=64 << 20, session_capacity=1, swap_dir=tmp_path)
    for r in (reference, runner):
        r.load()
    for step in range(3):
        for session in "ab":
            expected = reference.execute_model(request(session, step))
            got = runner.execute_model(request(session, step))
            assert all(torch.equal(got[k], expected[k]) for k in expected), (session, step)
    assert runner.pipeline.imported[:3] == [("a", None), ("b", None), ("a", None)]
    usage = runner.pool_usage()
    assert usage.num_swapped == 1 and usage.num_used == sum(sum(v.pages_per_branch.values()) for v in runner.sessions())
    runner.close()
    assert not tmp_path.exists() or not list(tmp_path.iterdir())


@pytest.mark.parametrize("metadata", [None, {"ardiff_swap": "{not json"}, {"ardiff_swap": "[1]"},
                                      {"ardiff_swap": "[" * 100_000 + "]" * 100_000},
                                      {"ardiff_swap": '{"format": "ardiff-swap-2", "session_id": "a"}'}],
                         ids=["no-metadata", "not-json", "not-a-mapping", "nested-too-deep", "older-format"])
def test_an_adopted_safetensors_file_that_is_no_snapshot_is_refused_when_restored(tmp_path, metadata):
    """A file in the swap folder whose name fits but which ardiff did not write (another tool's safetensors file) is
    a SwapRestoreError naming it, its format expected; nothing of it is resident and the file is gone."""
    from safetensors.torch import save_file

    name = "0" * 32 + ".safetensors"
    save_file({"x": torch.zeros(2)}, str(tmp_path / name), metadata=metadata)
    runner = ARDiffusionModelRunner(_KVOnly(), memory_budget=64 << 20, session_capacity=1, swap_dir=tmp_path)
    runner.load()
    assert runner.adopt_snapshot("a", name) is True
    older = metadata is not None and "ardiff-swap-2" in metadata["ardiff_swap"]
    expected = (re.escape("a swap snapshot in an older ardiff's format ('ardiff-swap-2'; this version reads "
                          "'ardiff-swap-3')") if older else
                r"not an ardiff swap snapshot \(format 'ardiff-swap-3' expected\)")
    with pytest.raises(SwapRestoreError, match=expected):
        runner.execute_model(request("a", 0))
    usage = runner.pool_usage()
    assert runner.session_ids == [] and usage.num_used == 0 and usage.num_swapped == 0
    assert not list(tmp_path.iterdir()) and runner.pipeline.imported == []
    runner.execute_model(request("a", 0))  # afresh
    runner.close()


def test_swapping_is_off_by_default_in_the_python_api():
    engine, events = engine_for("causal-world-tiny", capacity=1)
    run(engine, "a", 0)
    run(engine, "b", 0)
    assert engine.runner.swap is None and engine.runner.restore_session("a") is False
    assert [e.swapped for e in events if e.kind == "session_evicted"] == [False]
    engine.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"swap_space": -1}, r"swap_space must be a number of bytes >= 0 \(0: no swapping\) or None, got -1"),
    ({"swap_space": True}, r"swap_space must be a number of bytes >= 0 \(0: no swapping\) or None, got True"),
    ({"swap_space": 1.5}, r"swap_space must be a number of bytes >= 0 \(0: no swapping\) or None, got 1.5"),
    ({"swap_space": "lots"}, r"swap_space: cannot read 'lots' as a byte size"),
    ({"swap_dir": 3}, r"swap_dir must be a folder path \(str or os.PathLike\) or None, got 3"),
    ({"swap_dir": None, "swap_space": 1 << 20}, r"swap_space=1048576 without swap_dir: nothing would be swapped"),
])
def test_bad_swap_arguments_are_a_config_error_at_once(tmp_path, kwargs, message):
    # They used to pass until load(), after the weights were built: a bare TypeError ('>' not supported between
    # 'str' and 'int'), a ValueError without the argument's name, or (-1, or a size without a folder) no swapping.
    kwargs = {"swap_dir": tmp_path, **kwargs}
    with pytest.raises(ConfigError, match=r"^ARDiffusionEngine\(\): " + message) as info:
        ARDiffusionEngine.from_config(CONFIGS / "causal-world-tiny.yaml", device="cpu", **kwargs)
    assert info.value.hint
    with pytest.raises(ConfigError, match=r"^ARDiffusionModelRunner\(\): " + message):
        ARDiffusionModelRunner(TinyPipeline(tiny_spec()), memory_budget=64 << 20, **kwargs)


def test_a_swap_dir_that_is_a_file_or_under_one_is_a_config_error_at_once(tmp_path):
    """README: the runner refuses bad swap arguments at once. A swap_dir that is a file (or under one) was taken:
    every eviction then failed to make the folder, one warning, and every evicted session restarted from nothing.
    With swap_space=0 (no swapping) it is never used, so it is not looked at."""
    (tmp_path / "config.yaml").write_text("a file")
    for swap_dir in (tmp_path / "config.yaml", tmp_path / "config.yaml" / "swap"):
        message = rf"^ARDiffusionEngine\(\): swap_dir {swap_dir}: {tmp_path / 'config.yaml'} is not a folder$"
        with pytest.raises(ConfigError, match=message) as info:
            ARDiffusionEngine.from_config(CONFIGS / "causal-world-tiny.yaml", device="cpu", swap_dir=swap_dir)
        assert info.value.hint
        with pytest.raises(ConfigError, match=r"^ARDiffusionModelRunner\(\): swap_dir "):
            ARDiffusionModelRunner(TinyPipeline(tiny_spec()), memory_budget=64 << 20, swap_dir=str(swap_dir))
        ARDiffusionModelRunner(TinyPipeline(tiny_spec()), memory_budget=64 << 20, swap_dir=swap_dir, swap_space=0)


@pytest.mark.parametrize(("name", "why"), [("a\0b", "embedded null byte"), ("x" * 300, "File name too long")],
                         ids=["nul", "too-long"])
@pytest.mark.parametrize("swap_space", [None, "1MiB"])
def test_a_swap_dir_that_cannot_be_a_folder_is_a_config_error_at_once(tmp_path, name, why, swap_space):
    """A swap_dir with a NUL or a name longer than the file system takes was taken: load() raised a bare ValueError or
    OSError (with the default swap space, which looks at the disk), or every eviction warned and close() raised the
    ValueError, leaving the engine unclosed."""
    swap_dir = tmp_path / name / "swap"
    with pytest.raises(ConfigError, match=rf"^ARDiffusionEngine\(\): swap_dir .*: cannot be a folder \({why}\)$") \
            as info:
        ARDiffusionEngine.from_config(CONFIGS / "causal-world-tiny.yaml", device="cpu", swap_dir=swap_dir,
                                      swap_space=swap_space)
    assert info.value.hint
    with pytest.raises(ConfigError, match=r"^ARDiffusionModelRunner\(\): swap_dir "):
        ARDiffusionModelRunner(TinyPipeline(tiny_spec()), memory_budget=64 << 20, swap_dir=str(swap_dir),
                               swap_space=swap_space)
    ARDiffusionModelRunner(TinyPipeline(tiny_spec()), memory_budget=64 << 20, swap_dir=swap_dir, swap_space=0)


def test_the_default_swap_space_is_the_kv_budget_at_most_half_the_free_disk(tmp_path, monkeypatch):
    # swap_dir without swap_space (the CLI's default --swap-space): the KV budget, but at most half the free space of
    # the swap folder's disk at load, so that swapping alone never fills it. The free space is the one thing faked
    # here (no test can size a real disk); the engine, its plan and its swap store are real.
    import ardiff_cli.runtime.runner as runner_module

    spaces = []
    for free in (1 << 50, 3 << 20):  # a disk with room for far more than the KV budget; one with 3 MiB free
        monkeypatch.setattr(runner_module, "free_disk_bytes", lambda directory, free=free: free)
        engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
        spaces.append((engine.runner.pool_usage().swap_budget_bytes, engine.runner.capacity_plan.budget_bytes))
        engine.close()
    (roomy, budget), (full, _) = spaces
    assert budget > 3 << 20 and roomy == budget and full == (3 << 20) // 2


def test_swap_space_takes_a_byte_size_like_memory_budget(tmp_path):
    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path, swap_space="2MiB")
    assert engine.runner.pool_usage().swap_budget_bytes == 2 << 20
    engine.close()
    import numpy as np  # and numpy's integers, as memory_budget takes them

    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path, swap_space=np.int64(3 << 20))
    assert engine.runner.pool_usage().swap_budget_bytes == 3 << 20 and type(engine.runner.swap_space) is int
    engine.close()


def test_restore_session_of_the_warmup_id_says_it_is_reserved(tmp_path):
    # It said "takes a session id (a non-empty string), got '__ardiff_warmup__'": a non-empty string.
    from ardiff_cli.runtime.errors import RequestError
    from ardiff_cli.runtime.runner import WARMUP_SESSION_ID

    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    with pytest.raises(RequestError, match=rf"^session id '{WARMUP_SESSION_ID}' is reserved for warmup") as info:
        engine.runner.restore_session(WARMUP_SESSION_ID)
    assert info.value.hint == "name a session that was evicted"
    with pytest.raises(RequestError, match=r"^restore_session\(\) takes a session id \(a non-empty string\), got ''"):
        engine.runner.restore_session("")
    engine.close()


def test_two_engines_sharing_a_swap_dir_never_restore_each_others_sessions(tmp_path):
    # Two replicas of one model in a process (or two processes) given the same swap_dir, as in the README's
    # swap_dir="swap": the second one's snapshot of session 'robot' used to replace the first one's file, and the
    # first restored the other's history (same geometry: no error) and went on with silently different outputs.
    def robot_inputs(engine, seed):
        return engine.pipeline.example_inputs(prompt="task robot", seed=seed)

    reference, _ = engine_for("causal-world-tiny", capacity=1)
    want = [reference.execute(ARDiffusionRequest(f"robot/{step}", robot_inputs(reference, step),
                                                 {"session_id": "robot"})) for step in range(2)]
    reference.close()
    first, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "swap")
    second, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "swap")
    got = [first.execute(ARDiffusionRequest("robot/0", robot_inputs(first, 0), {"session_id": "robot"}))]
    run(first, "other", 0)  # first's robot swapped out
    second.execute(ARDiffusionRequest("robot/0", robot_inputs(second, 7), {"session_id": "robot"}))
    run(second, "other", 0)  # second's robot swapped out, into the same folder
    assert first.runner.restore_session("robot") is True
    got.append(first.execute(ARDiffusionRequest("robot/1", robot_inputs(first, 1), {"session_id": "robot"})))
    for step, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"robot step {step}")
    assert second.runner.restore_session("robot") is True  # swaps the second's 'other' out
    second.runner.swap.flush()  # its file written
    first.close()
    assert len(list((tmp_path / "swap").glob("*.safetensors"))) == 1  # the second's 'other' stays
    second.close()
    assert not (tmp_path / "swap").exists()


@pytest.mark.parametrize("how", ["in place", "adopted"])
def test_another_stores_snapshot_of_the_same_session_put_in_place_of_its_file_is_refused(tmp_path, how):
    # The same session id, geometry, dtype and request count, another history: a file copied from another run's (or
    # engine's) swap folder over this one's, between the eviction and the restore, or over a file a stopped run
    # kept for --resume. It used to be restored as this session's history: silently different outputs.
    def robot(engine, step, seed):
        return engine.execute(ARDiffusionRequest(f"robot/{step}", engine.pipeline.example_inputs(
            prompt="task robot", seed=seed), {"session_id": "robot"}))

    first, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "first")
    other, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "other")
    for engine, seed in ((first, 0), (other, 7)):
        robot(engine, 0, seed)
        run(engine, "b", 0)  # robot swapped out
        engine.runner.swap.flush()
    foreign = other.runner.swap.path_for("robot")
    if how == "adopted":
        kept = first.runner.detach_snapshots()
        first.close()
        first, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "first")
        shutil.copyfile(foreign, tmp_path / "first" / kept["robot"])
        assert first.runner.adopt_snapshot("robot", kept["robot"]) is True
        written_as = kept["robot"]
    else:
        written_as = first.runner.swap.path_for("robot").name
        shutil.copyfile(foreign, first.runner.swap.path_for("robot"))
    with pytest.raises(SwapRestoreError, match=re.escape(
            f"was written as {foreign.name!r}, expected {written_as!r}: another swap store's snapshot of this "
            "session (another run's, or another engine's) put in its place")):
        first.runner.restore_session("robot", num_requests=1)
    assert first.runner.pool_usage().num_swapped == 0 and first.runner.restore_session("robot") is False
    first.close()
    other.close()


def test_an_older_snapshot_of_the_session_put_back_in_place_of_its_file_is_refused(tmp_path):
    # Same store, same session, same file name: only the write differs. It was restored, one request behind.
    engine, _ = a_swapped_out(tmp_path)
    older = tmp_path / "older.safetensors"
    shutil.copyfile(engine.runner.swap.path_for("a"), older)
    run(engine, "a", 1)  # restored; b swapped out
    run(engine, "b", 1)  # a swapped out again, after 2 requests
    engine.runner.swap.flush()
    shutil.copyfile(older, engine.runner.swap.path_for("a"))
    with pytest.raises(SwapRestoreError, match="is not the snapshot last written of this session .* an older one "
                                               "put back in its place"):
        engine.runner.restore_session("a")
    assert engine.runner.session_ids == ["b"] and engine.runner.pool_usage().num_swapped == 0
    engine.close()


def test_adopting_a_file_this_store_holds_or_one_that_is_missing_is_a_request_error(tmp_path):
    engine, _ = a_swapped_out(tmp_path)
    runner = engine.runner
    own = runner.swap.path_for("a").name
    with pytest.raises(RequestError, match=f"{own} is this store's snapshot of session 'a', not one another store "
                                           "left"):
        runner.adopt_snapshot("c", own)  # took a's file as c's: a's history was lost
    with pytest.raises(RequestError, match=r"no file 0{32}\.safetensors in "):
        runner.adopt_snapshot("a", "0" * 32 + ".safetensors")  # a FileNotFoundError, after a's own was deleted
    assert runner.restore_session("a") is True and runner.pool_usage().num_swapped == 1  # b's, swapped out for it
    engine.close()


@pytest.mark.parametrize("started", [True, False])
def test_a_stop_as_a_snapshot_write_starts_leaves_no_file_behind(tmp_path, monkeypatch, started):
    # A signal landing in Thread.start() after the writer had started: the write went on, its file renamed into place,
    # and the store knew nothing of it, so close() left it (and the folder) on disk for good.
    import ardiff_cli.runtime.swap as swap_module

    class StoppedThread(threading.Thread):
        def start(self):
            if started:
                super().start()
            raise KeyboardInterrupt

    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "swap")
    run(engine, "a", 0)
    monkeypatch.setattr(swap_module, "threading", type("Threading", (), {"Thread": StoppedThread}))
    with pytest.raises(KeyboardInterrupt):
        run(engine, "b", 0)  # evicts a: its snapshot's write is stopped as it starts
    monkeypatch.undo()
    engine.runner.swap.flush()
    assert engine.runner.session_ids == ["a"] and engine.runner.pool_usage().num_swapped == 0
    for thread in threading.enumerate():  # a writer that no store waits for, too
        if thread.name == "ardiff-swap-writer":
            thread.join()
    assert sorted(p.name for p in (tmp_path / "swap").iterdir()) == []
    run(engine, "b", 0)  # the next eviction swaps a out as usual
    assert engine.runner.restore_session("a") is True
    engine.close()
    assert not (tmp_path / "swap").exists()


class HeldWrites:
    """Swap files are written (by the real ``safetensors.torch.save_file``) only once the test calls ``release()``:
    ``started`` counts the writes that began and wait. ``fail_with`` makes every write raise instead, after
    leaving a partial temporary file as a full disk would."""

    def __init__(self, monkeypatch) -> None:
        import safetensors.torch

        self.started = 0
        self.fail_with: BaseException | None = None
        self._gate = threading.Event()
        self._began = threading.Condition()
        real = safetensors.torch.save_file

        def held_save_file(tensors, filename, metadata=None):
            with self._began:
                self.started += 1
                self._began.notify_all()
            assert self._gate.wait(timeout=60), "a test never released the swap writes"
            if self.fail_with is not None:
                with open(filename, "wb") as f:
                    f.write(b"\x00" * 100)
                raise self.fail_with
            return real(tensors, filename, metadata=metadata)

        monkeypatch.setattr(safetensors.torch, "save_file", held_save_file)

    def release(self) -> None:
        self._gate.set()

    def began(self, count: int) -> bool:
        """Whether exactly ``count`` writes have begun, once ``count`` have or 60 s went by: the writer is a thread
        of its own, so a request that handed it a snapshot can return before its write begins."""
        with self._began:
            self._began.wait_for(lambda: self.started >= count, timeout=60)
            return self.started == count


def in_a_thread(call) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def writes_ended() -> None:
    """Wait for the background writes started so far to end, without the store taking them in (its next call does):
    a write ``HeldWrites.release()`` let go runs on a thread of its own, which may not even have begun when the test
    goes on (a close then dropped the snapshot before its write began: nothing failed, nothing to say)."""
    for thread in threading.enumerate():
        if thread.name == "ardiff-swap-writer":
            thread.join(timeout=60)  # a bound on a hang, not a timing
            assert not thread.is_alive(), "a swap write never ended"


@pytest.mark.parametrize("name", ["dreamzero-tiny", "causal-world-tiny"])
def test_an_eviction_does_not_wait_for_its_file_and_a_restore_meanwhile_takes_the_snapshot_from_memory(
        tmp_path, monkeypatch, name):
    # The swap file of a 14B session takes seconds to write: the request that evicted the session used to wait
    # for it, and so did every session behind it.
    reference, _ = engine_for(name, capacity=1)
    want = [run(reference, "a", step) for step in range(2)]
    reference.close()
    engine, events = engine_for(name, capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    got = [run(engine, "a", 0)]
    writes = HeldWrites(monkeypatch)
    request = in_a_thread(lambda: run(engine, "b", 0))  # evicts a: its file is held
    request.join(timeout=60)  # a liveness bound: the old code waited for the file, which is never written here
    assert not request.is_alive(), "the eviction waited for the swap file"
    assert writes.began(1)
    assert runner.session_ids == ["b"] and runner.pool_usage().num_swapped == 1
    assert not list(tmp_path.glob("*.safetensors"))  # not written yet
    runner.close_session("b")  # a free slot: restoring a evicts (writes) nothing
    got.append(run(engine, "a", 1))  # restored from the snapshot in memory, its file still unwritten
    assert_same(got[1], want[1], "step 1 after a restore from memory")
    assert [e.session_id for e in events if e.kind == "session_restored"] == ["a"]
    writes.release()
    runner.swap.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the restored snapshot's file went once written
    assert runner.pool_usage().num_swapped == 0 and runner.pool_usage().swapped_bytes == 0
    engine.close()


@pytest.mark.parametrize("how", ["reset_session", "close_session", "reset request"])
def test_a_swapped_out_session_discarded_while_its_file_is_written_leaves_the_views_readable(tmp_path, monkeypatch,
                                                                                            how):
    # Its snapshot is deleted once its write ends (the file is gone when the call returns); that wait held the
    # session-table lock, so sessions() and pool_usage() from the CLI's status thread waited for the file too.
    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    writes = HeldWrites(monkeypatch)
    run(engine, "b", 0)  # evicts a: its file is held
    assert writes.began(1)
    again = ARDiffusionRequest("a/again", inputs_for(engine.pipeline, "a", 0), {"session_id": "a", "reset": True})
    call = {"reset_session": lambda: runner.reset_session("a"), "close_session": lambda: runner.close_session("a"),
            "reset request": lambda: engine.execute(again)}[how]
    discarding = in_a_thread(call)
    discarding.join(timeout=0.5)
    assert discarding.is_alive(), "it did not wait for the file it deletes"
    reader = in_a_thread(lambda: (runner.sessions(), runner.pool_usage()))
    reader.join(timeout=30)  # a liveness bound: the old code blocked until the write was released
    blocked = reader.is_alive()
    writes.release()
    discarding.join(timeout=60)
    assert not blocked, "the views waited for the file of a discarded snapshot"
    assert not discarding.is_alive() and not runner.swap.has("a")
    said = next((e.kind, e.reason) for e in events
                if e.kind in ("session_reset", "session_closed") and e.session_id == "a")
    assert said == {"reset_session": ("session_reset", "explicit"), "close_session": ("session_closed", "explicit"),
                    "reset request": ("session_reset", "request_reset")}[how]
    engine.close()


def test_one_write_is_in_flight_at_a_time_and_close_waits_for_it(tmp_path, monkeypatch):
    # A second eviction waits for the first file: at most one snapshot is held in memory beyond the sessions.
    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "swap")
    run(engine, "a", 0)
    writes = HeldWrites(monkeypatch)
    run(engine, "b", 0)  # a's file is held
    assert writes.began(1)
    second = in_a_thread(lambda: run(engine, "c", 0))  # evicts b: waits for a's file
    second.join(timeout=0.5)
    assert second.is_alive() and writes.began(1), "b's snapshot did not wait for a's file"
    writes.release()
    second.join(timeout=60)
    assert not second.is_alive() and writes.began(2)
    assert [(e.session_id, e.swapped) for e in events if e.kind == "session_evicted"] == [("a", True), ("b", True)]
    engine.runner.swap.flush()
    assert len(list((tmp_path / "swap").glob("*.safetensors"))) == 2
    writes._gate.clear()  # held again: close waits for the write in flight, then deletes every file
    run(engine, "d", 0)  # evicts c
    closing = in_a_thread(engine.close)
    closing.join(timeout=0.5)
    assert closing.is_alive(), "close did not wait for the write in flight"
    writes.release()
    closing.join(timeout=60)
    assert not closing.is_alive() and not (tmp_path / "swap").exists()


def test_a_write_that_fails_in_the_background_is_a_warning_and_its_session_is_rebuilt(tmp_path, monkeypatch):
    # A full disk while the file is written: the eviction had already said "swapped", so the failure comes with
    # the next call on the runner, and the session is one without a snapshot (the CLI replays it).
    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    writes = HeldWrites(monkeypatch)
    writes.fail_with = OSError(28, "No space left on device")
    run(engine, "b", 0)  # evicts a; its write fails once released
    assert [(e.session_id, e.swapped) for e in events if e.kind == "session_evicted"] == [("a", True)]
    writes.release()
    runner.swap.flush()  # the write ends (failed); the runner says so at its next call
    with pytest.warns(ArdiffWarning, match=r"cannot swap session 'a' out to .* \(OSError: \[Errno 28\] No space "
                                           r"left on device\); its snapshot is lost, so it is rebuilt as one "
                                           r"evicted without a snapshot"):
        assert runner.restore_session("a") is False
    # and an event, for a subscriber that counts swapped sessions (the CLI's summary.json) or streams them (JSON)
    lost = [e for e in events if e.kind == "swap_failed"]
    assert [(e.session_id, e.error) for e in lost] == [("a", "OSError: [Errno 28] No space left on device")]
    assert runner.pool_usage().num_swapped == 0 and runner.pool_usage().swapped_bytes == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the partial temporary file went too
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        run(engine, "a", 0)  # the caller rebuilds it: a fresh session
    engine.close()


def after_a_full_disk(tmp_path, monkeypatch):
    """A causal-world-tiny engine whose eviction of "a" (by "b") failed for a full disk: (engine, events, the ids
    exported, [the free bytes the runner sees], the held writes, failing)."""
    import ardiff_cli.runtime.runner as runner_module

    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    pipe = engine.pipeline
    exported, real_export = [], pipe.export_ar_diffusion_session
    monkeypatch.setattr(pipe, "export_ar_diffusion_session", lambda sid: exported.append(sid) or real_export(sid))
    free = [10 << 30]
    monkeypatch.setattr(runner_module, "free_disk_bytes", lambda directory: free[0])
    run(engine, "a", 0)
    writes = HeldWrites(monkeypatch)
    writes.fail_with = OSError(28, "No space left on device")
    run(engine, "b", 0)  # evicts a, whose write fails: the disk is full
    writes.release()
    engine.runner.swap.flush()
    return engine, events, exported, free, writes


def test_after_a_full_disk_an_eviction_exports_nothing_until_the_disk_has_room_for_its_snapshot(tmp_path,
                                                                                                 monkeypatch):
    # Every eviction on a full disk copied its session's KV out (gigabytes for a 14B session) only for the write to
    # fail. After a snapshot fails for a full disk, the next ones check the folder's free space first. The free
    # space is the one thing faked here (no test can fill a real disk); the writes and the exports are real.
    engine, events, exported, free, writes = after_a_full_disk(tmp_path, monkeypatch)
    runner = engine.runner
    free[0] = 1024  # still full
    with pytest.warns(ArdiffWarning, match=r"cannot swap session 'a' out .* No space left on device"):
        run(engine, "c", 0)  # evicts b: nothing exported, said once (the cause is the same)
    assert exported == ["a"]
    lost = [(e.session_id, e.error) for e in events if e.kind == "swap_failed"]
    assert lost[0] == ("a", "OSError: [Errno 28] No space left on device")
    assert lost[1][0] == "b" and re.fullmatch(r"OSError: \[Errno 28\] No space left on device: 1\.00 KiB free, "
                                              r"the snapshot needs at least \d+\.\d\d KiB \(not exported\)",
                                              lost[1][1]), lost[1]
    evicted = [(e.session_id, e.swapped) for e in events if e.kind == "session_evicted"]
    assert evicted == [("a", True), ("b", False)]  # a said swapped before its background write failed
    free[0] = 10 << 30  # room again: the next eviction is swapped out, and restored bit for bit
    writes.fail_with = None
    run(engine, "c", 1)  # c stays resident; the next request evicts it
    run(engine, "d", 0)
    assert exported == ["a", "c"] and runner.restore_session("c") is True
    engine.close()


def test_a_write_safetensors_fails_is_reported_as_the_oserror_it_says_it_was(tmp_path):
    # safetensors raises SafetensorError("... I/O error: No space left on device (os error 28)"), with no errno: a
    # real full disk never turned the full-disk check above on. A file size limit makes its write fail for real.
    script = """if True:
        import resource, signal, sys, torch
        from ardiff_cli.runtime.swap import SwapStore
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        store = SwapStore(sys.argv[1], 1 << 30)
        store.write("a", {"k": torch.zeros(1 << 16)}, {})
        store.flush()
        print([(sid, type(e).__name__, e.errno, str(e.__cause__)[-39:]) for sid, e in store.failures])
    """
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "swap")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[('a', 'OSError', 27, 'I/O error: File too large (os error 27)')]"


def test_the_oserror_a_safetensors_message_names_is_about_the_file_written(tmp_path):
    """The errno in safetensors' text becomes an OSError naming the file, which the warning shows; an OSError, or an
    error naming no errno, is left as it is."""
    from ardiff_cli.runtime.errors import os_error

    path = tmp_path / "a.safetensors"
    error = os_error(Exception("I/O error: No space left on device (os error 28)"), path)
    assert type(error) is OSError and (error.errno, error.strerror, error.filename) == (28, os.strerror(28), str(path))
    assert str(error) == f"[Errno 28] {os.strerror(28)}: '{path}'"
    for same in (OSError(5, "Input/output error (os error 28)"), ValueError("no errno here")):
        assert os_error(same, path) is same


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small disk needs root")
def test_a_real_full_disk_turns_the_full_disk_check_on(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("this machine does not let tmpfs be mounted")
    try:
        engine, events = engine_for("dreamzero-tiny", capacity=1, swap_dir=disk / "swap", swap_space="64MiB")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ArdiffWarning)
            for session in "abcd":  # each evicts the one before: a snapshot is larger than the disk
                run(engine, session, 0)
                engine.runner.swap.flush()
        lost = [e.error for e in events if e.kind == "swap_failed"]
        assert lost[0].startswith("OSError: [Errno 28] No space left on device"), lost
        assert lost[1:] and all(error.endswith("(not exported)") for error in lost[1:]), lost
        engine.close()
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def mapped_files(folder) -> list[str]:
    """The files under ``folder`` that this process has memory-mapped (deleted ones too), from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split(maxsplit=5)[5].strip() for line in maps
                       if len(line.split(maxsplit=5)) == 6 and str(folder) in line})


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_a_restored_snapshot_file_gives_its_disk_space_back_once_deleted(tmp_path):
    # The pipeline kept the tensors of its restored state as they were read: views of the whole snapshot file's
    # memory map, which kept the deleted file's space taken on the disk as long as the session stayed resident. The
    # swap folder's disk then held a snapshot per resident session beyond the swap space, and with the default swap
    # space (half the free disk) a small disk filled up: snapshots were lost to "No space left on device".
    swap = tmp_path / "swap"
    engine, events = engine_for("dreamzero-tiny", capacity=1, swap_dir=swap)
    for step in range(2):
        for session in "ab":  # each evicts the other; from step 1 on, each is restored from its file
            run(engine, session, step)
            engine.runner.swap.flush()
    assert [e.session_id for e in events if e.kind == "session_restored"] == ["a", "b"]
    assert engine.pipeline.sessions["b"] is not None  # its restored state, kept by the pipeline
    assert len(list(swap.iterdir())) == 1  # a's snapshot, swapped out as b was restored; b's file is deleted
    assert mapped_files(swap) == []  # it was b's deleted file: '.../swap/NAME.safetensors (deleted)'
    engine.close()


def _a_swapped_out(tmp_path, config: str):
    """An engine of capacity 1 whose session 'a' was swapped out to a file (as 'b' ran), and that file's path."""
    engine, _ = engine_for(config, capacity=1, swap_dir=tmp_path / "swap")
    run(engine, "a", 0)
    run(engine, "b", 0)  # a swapped out
    engine.runner.swap.flush()
    return engine, engine.runner.swap.path_for("a")


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="reads /proc/self/maps and /proc/self/fd")
@pytest.mark.parametrize("damage", ["flipped-bit", "other-count", "other-record"])
def test_a_failed_restores_error_kept_by_the_caller_holds_no_mapping_of_the_deleted_snapshot(tmp_path, damage):
    # The error's traceback kept the frames of the restore, whose locals held the snapshot's tensors: views of a
    # mapping of its file, deleted as the restore failed. A server that kept the error (a status page's last error,
    # a log list) kept the deleted file's disk space taken, and an open file descriptor (the mapping's), as long as
    # it kept the error. Damaged as the file is read (a flipped bit), as its count is checked, or as the pipeline
    # imports its state (a record of another release's fields), once admitted.
    import gc

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ardiff_cli.runtime.swap import CRC_KEY, data_crc32

    swap = tmp_path / "swap"
    engine, path = _a_swapped_out(tmp_path, "dreamzero-tiny")
    runner = engine.runner
    if damage == "flipped-bit":
        data = bytearray(path.read_bytes())
        data[-100] ^= 1
        path.write_bytes(bytes(data))
    elif damage == "other-record":
        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(path))
        metadata["ardiff_swap"] = re.sub(r'"num_requests": 1(?=[,}])', '"num_requests": "1"', metadata["ardiff_swap"],
                                         count=1)
        metadata[CRC_KEY] = str(data_crc32(tensors))
        save_file(tensors, str(path), metadata=metadata)
        del tensors
    gc.collect()
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(SwapRestoreError, match=r"cannot restore session 'a' from ") as info:
        runner.restore_session("a", num_requests=2 if damage == "other-count" else 1)
    kept = info.value  # as a caller that keeps the error does
    gc.collect()
    assert not path.exists() and kept.__traceback__ is not None
    assert mapped_files(swap) == []  # it was '.../swap/NAME.safetensors (deleted)'
    assert len(os.listdir("/proc/self/fd")) == descriptors
    engine.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps and /proc/self/fd")
def test_ctrl_c_while_a_snapshot_is_decoded_keeps_no_mapping_of_it_in_the_kept_error(tmp_path, monkeypatch):
    # Ctrl-C (Python's KeyboardInterrupt, no Exception) once the file was read, before its KV was checked, passed by
    # both of the read's handlers: the restore's frame, kept by the error's traceback (a notebook's last error, a
    # server that logs it), held the tensors read, views of a mapping of the deleted file.
    import gc
    import signal

    import ardiff_cli.runtime.runner as runner_module

    swap = tmp_path / "swap"
    engine, path = _a_swapped_out(tmp_path, "causal-world-tiny")
    runner = engine.runner
    gc.collect()
    descriptors = len(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(runner_module, "decode_snapshot", lambda *_: signal.raise_signal(signal.SIGINT))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as info:  # as itself
            runner.restore_session("a")
    finally:
        signal.signal(signal.SIGINT, previous)
    kept = info.value
    gc.collect()
    assert not path.exists() and kept.__traceback__ is not None
    assert mapped_files(swap) == []
    assert len(os.listdir("/proc/self/fd")) == descriptors
    engine.close()


def test_a_write_that_fails_before_its_session_is_closed_is_a_swap_failed_event_without_a_warning(tmp_path,
                                                                                                  monkeypatch):
    # close_all (the CLI's end of a run, also an interrupted one), close_session of a swapped-out session and a
    # request that resets it took the failed write in silently: no event, so summary.json counted the lost
    # snapshot as swapped out.
    def reset_request(engine) -> None:
        engine.execute(ARDiffusionRequest("a/0", inputs_for(engine.pipeline, "a", 0), {"session_id": "a",
                                                                                       "reset": True}))

    for close in ("close_all", "close_session", "reset request"):
        engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / close)
        run(engine, "a", 0)
        writes = HeldWrites(monkeypatch)
        writes.fail_with = OSError(28, "No space left on device")
        run(engine, "b", 0)  # evicts a; its write fails once released
        writes.release()
        writes_ended()  # the write failed before the close
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # its session is closed: nothing is rebuilt, nothing to warn about
            {"close_all": lambda: engine.runner.close_all(), "close_session": lambda: engine.runner.close_session("a"),
             "reset request": lambda: reset_request(engine)}[close]()
        kinds = [(e.kind, e.session_id) for e in events if e.kind in ("session_evicted", "swap_failed")]
        then = [("session_evicted", "b")] if close == "reset request" else []  # made room for the fresh a
        assert kinds == [("session_evicted", "a"), ("swap_failed", "a"), *then], close
        engine.close()


def test_the_planned_bytes_of_a_snapshot_file_bound_its_size(tmp_path):
    # The eviction's swap_bytes and the budget are planned before the background write: never under the file.
    import json
    import random

    from safetensors.torch import save

    from ardiff_cli.runtime.swap import FORMAT, file_bytes_at_most, file_metadata

    rng = random.Random(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]
    for _ in range(200):
        tensors = {}
        for i in range(rng.randint(0, 5)):
            shape = [rng.choice([0, 1, 3, 17, 1000]) for _ in range(rng.randint(0, 4))]
            name = rng.choice(["kv/self/positive/k", "pipeline/anchor", 'é"\\', "x" * 60]) + str(i)
            tensors[name] = torch.zeros(shape, dtype=rng.choice(dtypes))
        header = json.dumps({"format": FORMAT, "session_id": rng.choice(["a", 'ü/\n"x']),
                             "file": "0" * 32 + ".safetensors", "kv": {"n": [1]}})
        size = len(save(tensors, metadata=file_metadata(header, tensors)))
        assert size <= file_bytes_at_most(tensors, header) <= size + 128, (sorted(tensors), header)


def test_ctrl_c_while_a_close_waits_for_the_snapshot_file_leaves_no_file_behind(tmp_path, monkeypatch):
    # Closing a swapped-out session waits for its file, to delete it; a Ctrl-C in that wait must not leave the
    # file to land afterwards, forgotten by the store.
    import os
    import signal

    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    writes = HeldWrites(monkeypatch)
    run(engine, "b", 0)  # evicts a: its file is held
    main, done = threading.main_thread(), threading.Event()
    # made here: on a machine whose futex is not known it skips the test, which in the sender's thread would only end
    # that thread, and the close below would wait for ever
    blocked = UntimedFutex(Path(f"/proc/self/task/{main.native_id}/syscall"))
    waits_otherwise: list[AssertionError] = []

    def ctrl_c_in_the_wait() -> None:
        # once the main thread waits for a's file: inside Condition.wait, blocked in its lock (an untimed futex:
        # x86-64's syscall 202, aarch64's 98, with no timeout). A timer (0.3 s) sent it wherever the close was: on a
        # loaded machine before the discard (a's snapshot stayed known), or as its last check was done but its futex
        # not begun (its C handler ran there, and the wait went on for the write this test holds: a hang)
        # A main thread that waits otherwise (a futex with a timeout, another Python or C library) is named, and
        # its wait cut short all the same: it waited for ever, a write this test holds
        # in the close's wait: a Condition.wait called by the store's discard, before and after the futex is seen
        # (sender.start() waits in a Condition.wait too: a SIGINT sent there escaped pytest.raises, and CI's worker)
        def in_the_close() -> bool:
            frame = sys._current_frames().get(main.ident)
            if frame is None or frame.f_code is not threading.Condition.wait.__code__:
                return False
            while frame is not None and frame.f_code.co_name != "discard":
                frame = frame.f_back
            return frame is not None

        try:
            while not done.is_set():
                if in_the_close() and blocked() and in_the_close():
                    break
                done.wait(0.001)
            else:
                return
        except AssertionError as exc:
            waits_otherwise.append(exc)
        os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=ctrl_c_in_the_wait)
    sender.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.close_session("a")  # waits for a's file
    finally:
        done.set()  # a close that did not wait must not leave a SIGINT for the rest of the session
        sender.join()
    writes.release()
    assert not waits_otherwise, waits_otherwise[0]
    runner.swap.flush()
    assert not runner.swap.has("a") and not list(tmp_path.glob("*safetensors*"))  # the write deleted its file
    engine.close()


@pytest.mark.parametrize("cut", ["forgotten", "known"])
def test_ctrl_c_as_a_snapshot_is_discarded_leaves_no_file_after_close_and_a_known_one_for_detach(tmp_path, cut):
    # discard() forgets a snapshot, then deletes its file. A Ctrl-C between the two (a real SIGINT, found by sending
    # one at every point a request or close_session can take it) left the file, which the store no longer knew, in
    # the swap folder after close(), and the folder with it ("forgotten"). One that lands after the file was marked
    # for deletion but before the snapshot was forgotten leaves it known ("known"): restorable, or kept whole by
    # detach_snapshots for --resume, so close() after a detach must not delete it.
    import signal

    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    run(engine, "b", 0)  # evicts a to a file
    runner.swap.flush()
    assert runner.swap.has("a") and len(list(tmp_path.glob("*.safetensors"))) == 1
    armed = [True]

    def interrupt_once():
        if armed:
            armed.clear()
            signal.raise_signal(signal.SIGINT)  # Python's handler raises KeyboardInterrupt before this returns

    class Owners(dict):
        def pop(self, *args):  # the first thing discard() does once the snapshot is forgotten
            interrupt_once()
            return dict.pop(self, *args)

    class Unlinking(set):
        def add(self, item):  # the last thing discard() does before it forgets the snapshot
            set.add(self, item)
            interrupt_once()

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if cut == "forgotten":
            runner.swap._owners = Owners(runner.swap._owners)
        else:
            runner.swap._unlinking = Unlinking()
        with pytest.raises(KeyboardInterrupt):
            runner.close_session("a")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert runner.swap.has("a") is (cut == "known")
    kept = runner.detach_snapshots()
    assert list(kept) == (["a"] if cut == "known" else [])
    engine.close()
    left = [path.name for path in tmp_path.iterdir()] if tmp_path.exists() else []
    assert left == list(kept.values())


def test_a_writer_thread_that_cannot_start_is_a_warning_and_the_eviction_goes_on(tmp_path, monkeypatch):
    # Under a process limit (ulimit -u) a thread may not start: the snapshot must be forgotten at once, not left
    # waiting for a write that never begins (the eviction that discards it used to wait forever).
    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    start = threading.Thread.start

    def writer_cannot_start(self):
        if self.name == "ardiff-swap-writer":
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", writer_cannot_start)
    cannot = r"cannot swap session 'a' out to .* \(RuntimeError: can't start new thread\)"
    with pytest.warns(ArdiffWarning, match=cannot):
        request = in_a_thread(lambda: run(engine, "b", 0))
        request.join(timeout=60)  # a liveness bound, not a timing
    assert not request.is_alive(), "the eviction waits for a write that never began"
    monkeypatch.undo()
    assert [(e.session_id, e.swapped) for e in events if e.kind == "session_evicted"] == [("a", False)]
    assert runner.pool_usage().num_swapped == 0 and runner.pool_usage().swapped_bytes == 0
    engine.close()
    assert not tmp_path.exists() or not list(tmp_path.glob("*safetensors*"))


def test_another_engine_closing_while_a_snapshot_is_written_to_the_shared_folder_does_not_lose_it(tmp_path,
                                                                                                   monkeypatch):
    # The other engine's close() removes the shared folder when it looks empty; the file of a snapshot whose
    # write had not begun then failed (FileNotFoundError: a warning, and the session rebuilt from scratch).
    first, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "swap")
    second, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "swap")
    run(first, "a", 0)
    writes = HeldWrites(monkeypatch)
    run(first, "b", 0)  # a swapped out: its file is held
    second.close()
    writes.release()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first.runner.swap.flush()
        assert first.runner.restore_session("a") is True
    first.close()
    assert not (tmp_path / "swap").exists()


def test_another_engine_removing_the_shared_folder_as_a_write_begins_does_not_lose_the_snapshot(tmp_path,
                                                                                                 monkeypatch):
    # Its clear() removed the folder, empty then, between the write's making it and making its staging folder in
    # it: FileNotFoundError, the snapshot lost (4 of 715 in a 20 s run with one engine closed and loaded in a loop)
    import pathlib

    first, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path / "swap")
    run(first, "a", 0)
    mkdir, raced = pathlib.Path.mkdir, []

    def mkdir_then_lose_it(self, *args, **kwargs):
        mkdir(self, *args, **kwargs)
        if self == tmp_path / "swap" and not raced:
            raced.append(self)
            self.rmdir()  # the other engine's clear(), right then

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir_then_lose_it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(first, "b", 0)  # a swapped out
        first.runner.swap.flush()
        assert raced and first.runner.restore_session("a") is True
    first.close()


def test_a_write_that_failed_before_close_all_is_no_warning_about_a_session_it_closed(tmp_path, monkeypatch):
    # close_all() closes swapped-out sessions too; a snapshot whose write had failed meanwhile used to be reported
    # at the next request, of another session, as "its snapshot is lost, so it is rebuilt".
    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    run(engine, "a", 0)
    writes = HeldWrites(monkeypatch)
    writes.fail_with = OSError(28, "No space left on device")
    run(engine, "b", 0)  # evicts a; its write fails once released
    writes.release()
    writes_ended()  # the write failed before close_all
    engine.runner.close_all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(engine, "c", 0)
    engine.close()


def test_swap_out_sessions_and_the_close_of_a_swapped_out_session_give_their_events_the_callers_words(tmp_path):
    # The CLI swaps a stopped run's sessions out with reason "run_stopped", and closes a failed episode's session,
    # swapped out too, with "episode_failed" and its error: both events said "explicit" (and no error).
    engine, events = a_swapped_out(tmp_path)  # b resident, a swapped out
    runner = engine.runner
    for reason in ("", None, "lru_eviction"):
        with pytest.raises(RequestError, match=r"^swap_out_sessions\(\) takes reason 'explicit' or 'run_stopped', "
                                               r"got "):
            runner.swap_out_sessions(["b"], reason=reason)
    assert runner.session_ids == ["b"]  # a refused call swaps nothing out
    events.clear()
    runner.close_session("a", reason="episode_failed", error="step 1: not a safetensors file")
    swapped = runner.swap_out_sessions(["b"], reason="run_stopped")
    assert [(e.kind, e.session_id, e.reason, getattr(e, "error", None), getattr(e, "swapped", None))
            for e in events if e.kind in ("session_closed", "session_evicted")] == [
        ("session_closed", "a", "episode_failed", "step 1: not a safetensors file", None),
        ("session_evicted", "b", "run_stopped", None, True)]
    assert list(swapped) == ["b"] and runner.session_ids == [] and pages_held(engine) == 0
    engine.close()


@pytest.mark.parametrize("reason", [None, "run_stopped", "run_failed"])
@pytest.mark.parametrize("how", ["close_all", "close"])
def test_closing_every_session_closes_the_swapped_out_ones_with_the_event_close_session_sends(tmp_path, how, reason):
    # close_session of a swapped-out session sends session_closed; close_all() and close() deleted such sessions'
    # snapshots without a word, so a subscriber kept them as evicted forever. With the caller's reason (the engine's
    # close passes it on): a stopped or failed run's closed every session it did not keep as `explicit`.
    engine, events = a_swapped_out(tmp_path)  # b resident, a swapped out
    with pytest.raises(RequestError, match=r"^close\(\) takes reason 'explicit', 'run_stopped' or 'run_failed', got "
                                           r"'lru_eviction'$"):
        engine.close(reason="lru_eviction")
    assert engine.loaded and engine.pipeline is not None  # a refused close changes nothing
    getattr(engine.runner if how == "close_all" else engine, how)(**({} if reason is None else {"reason": reason}))
    closed = sorted((e.session_id, e.reason) for e in events if e.kind == "session_closed")
    assert closed == [("a", reason or "explicit"), ("b", reason or "explicit")]
    assert engine.runner.pool_usage().num_swapped == 0 and not tmp_path.exists()  # the swap folder went
    if how == "close_all":
        engine.close()


def _detached_after_two_steps(name: str, swap_dir) -> tuple[list, dict[str, str]]:
    """Session "a"'s three outputs on an engine that never swaps, and what ``detach_snapshots`` left of it on one
    that swapped it out after two steps (then closed: the detached file stays)."""
    reference, _ = engine_for(name, capacity=2)
    expected = [run(reference, "a", step) for step in range(3)]
    reference.close()
    first, _ = engine_for(name, capacity=1, swap_dir=swap_dir)
    run(first, "a", 0)
    run(first, "a", 1)
    run(first, "b", 0)  # evicts a: swapped out after two steps
    kept = first.runner.detach_snapshots()
    assert list(kept) == ["a"] and first.runner.pool_usage().num_swapped == 0
    first.close()
    assert (swap_dir / kept["a"]).is_file()
    return expected, kept


@pytest.mark.parametrize("name", ["causal-world-tiny", "dreamzero-tiny"])
def test_a_detached_snapshot_adopted_by_a_later_runner_restores_the_same_session(tmp_path, name):
    # An interrupted CLI run leaves its swapped-out sessions' files; the resumed run's runner takes them back
    # instead of replaying their steps. Bit-identical to a session that was never swapped.
    expected, kept = _detached_after_two_steps(name, tmp_path)
    second, events = engine_for(name, capacity=1, swap_dir=tmp_path)
    assert second.runner.adopt_snapshot("a", kept["a"]) is True
    assert second.runner.pool_usage().num_swapped == 1
    assert_same(run(second, "a", 2), expected[2], "adopted snapshot")
    assert [e.session_id for e in events if e.kind == "session_restored"] == ["a"]
    second.close()
    assert not tmp_path.exists()  # adopted, restored and deleted: nothing left, folder included


def test_a_detached_snapshot_is_not_written_over_by_the_runner_that_goes_on_serving(tmp_path):
    # detach_snapshots() leaves the files for a later process, and the runner goes on serving: a new session of the
    # same id, swapped out, was written under the same name over the file left (its history replaced), and
    # close() then deleted it: the later process found no file to adopt
    engine, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    run(engine, "a", 0)
    run(engine, "b", 0)  # a swapped out after step 0
    kept = engine.runner.detach_snapshots()
    left = (tmp_path / kept["a"]).read_bytes()
    run(engine, "a", 5)  # a new session a (the detached one is forgotten); b swapped out
    run(engine, "b", 1)  # b restored; the new a swapped out
    engine.runner.swap.flush()
    assert (tmp_path / kept["a"]).read_bytes() == left
    engine.close()
    later, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    assert later.runner.adopt_snapshot("a", kept["a"]) is True
    resumed = run(later, "a", 1)
    later.close()
    alone, _ = engine_for("causal-world-tiny", capacity=1)
    run(alone, "a", 0)
    assert_same(run(alone, "a", 1), resumed, "the step after the detached snapshot")
    alone.close()


@pytest.mark.parametrize("name", ["causal-world-tiny", "dreamzero-tiny"])
def test_a_snapshot_adopted_then_detached_again_unrestored_is_adopted_by_a_third_runner(tmp_path, name):
    """A run stopped, its --resume stopped too before it restored a kept snapshot, then resumed again: the second
    resume refused that snapshot ("was written as X, expected Y: another swap store's snapshot of this session ...
    put in its place", a warning per episode) and replayed the episode's steps instead of restoring them."""
    expected, kept = _detached_after_two_steps(name, tmp_path)
    second, _ = engine_for(name, capacity=1, swap_dir=tmp_path)
    assert second.runner.adopt_snapshot("a", kept["a"]) is True
    kept = second.runner.detach_snapshots()  # stopped before a's next step: a's snapshot is kept as it was
    second.close()
    assert list(kept) == ["a"] and (tmp_path / kept["a"]).is_file()
    third, events = engine_for(name, capacity=1, swap_dir=tmp_path)
    assert third.runner.adopt_snapshot("a", kept["a"]) is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(run(third, "a", 2), expected[2], "snapshot adopted twice")
    assert [e.session_id for e in events if e.kind == "session_restored"] == ["a"]
    third.close()
    assert not tmp_path.exists()


def test_detached_snapshots_are_flushed_to_the_disk_and_one_the_disk_would_not_flush_is_not_kept(tmp_path,
                                                                                                   monkeypatch):
    """A stopped run's kept.json is written with an fsync; the snapshot files it names were not, so a power loss
    after it could leave them with their data lost, restored on --resume as zeros. Detaching flushes each file and
    the folder first; a file whose flush fails (EIO) is no kept snapshot: deleted, and a swap_failed event."""
    import errno

    from ardiff_cli.runtime import swap

    engine, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    for session in ("a", "b", "c"):  # a, then b, swapped out
        run(engine, session, 0)
    engine.runner.swap.flush()
    failing = engine.runner.swap.path_for("a")
    flushed, real_fsync = [], os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path == str(failing):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        flushed.append(path)
        return real_fsync(fd)

    monkeypatch.setattr(swap.os, "fsync", fsync)
    kept = engine.runner.detach_snapshots()
    monkeypatch.undo()
    assert list(kept) == ["b"] and flushed == [str(tmp_path / kept["b"]), str(tmp_path)]
    assert not failing.exists() and sorted(p.name for p in tmp_path.iterdir()) == [kept["b"]]
    (lost,) = [e for e in events if e.kind == "swap_failed"]
    assert lost.session_id == "a" and "Input/output error" in lost.error
    engine.close()


def kept_by_a_stopped_runner(swap_dir) -> dict[str, str]:
    """The snapshot files a causal-world-tiny runner of one session slot kept when it stopped (detached), after
    step 0 of "a" and then of "b": "a"'s only, as "b" was resident."""
    first, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=swap_dir)
    run(first, "a", 0)
    run(first, "b", 0)
    kept = first.runner.detach_snapshots()
    first.close()
    return kept


def test_an_adopted_file_of_another_session_or_a_bad_name_is_refused(tmp_path):
    kept = kept_by_a_stopped_runner(tmp_path)
    second, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    for name in ("../../etc/passwd", 1, None):  # 1 and None were a bare TypeError from the file-name pattern
        with pytest.raises(RequestError, match=r"^adopt_snapshot\(\): .* is not the name of a swap snapshot file") \
                as info:
            second.runner.adopt_snapshot("b", name)
        assert isinstance(info.value, ValueError) and "detach_snapshots()" in info.value.hint
    assert second.runner.adopt_snapshot("b", kept["a"]) is True  # the index named the wrong session's file
    with pytest.raises(SwapRestoreError, match="holds session 'a', expected 'b'"):
        second.runner.restore_session("b")
    second.close()


def test_a_snapshot_adopted_for_a_resident_session_or_by_a_runner_that_does_not_swap_is_not_taken(tmp_path):
    """adopt_snapshot() is False, leaving the file and the session as they were, when the session is resident (its
    live history must not be replaced by the file's) or the runner does not swap; a session id that is no
    non-empty string, or warmup's reserved one, is a RequestError naming it."""
    from ardiff_cli.runtime.runner import WARMUP_SESSION_ID

    kept = kept_by_a_stopped_runner(tmp_path)
    second, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    for session_id in ("", WARMUP_SESSION_ID, 7):
        with pytest.raises(RequestError, match=r"^adopt_snapshot\(\) takes a session id \(a non-empty string, not "
                           rf"'{WARMUP_SESSION_ID}'\), got {re.escape(repr(session_id))}$"):
            second.runner.adopt_snapshot(session_id, kept["a"])
    run(second, "a", 0)
    run(second, "a", 1)
    assert second.runner.adopt_snapshot("a", kept["a"]) is False
    assert (tmp_path / kept["a"]).is_file() and second.runner.pool_usage().num_swapped == 0
    (view,) = second.runner.sessions()
    assert view.session_id == "a" and view.committed_frames == {"main": 6}  # its own two blocks, not the file's one
    second.close()
    plain, _ = engine_for("causal-world-tiny", capacity=1)
    assert plain.runner.adopt_snapshot("a", kept["a"]) is False and (tmp_path / kept["a"]).is_file()
    plain.close()
    assert not [e for e in events if e.kind == "session_restored"]


@pytest.mark.parametrize("name", ["causal-world-tiny", "dreamzero-tiny"])
def test_resident_sessions_swapped_out_on_request_are_adopted_by_a_later_runner_and_go_on_bit_identical(tmp_path,
                                                                                                       name):
    # A stopped CLI run swaps its resident sessions out too, so that --resume restores them instead of replaying
    # their steps: the same snapshots as an LRU eviction writes, released the same way.
    reference, _ = engine_for(name, capacity=2)
    expected = {"a": [run(reference, "a", step) for step in range(3)], "b": [run(reference, "b", step) for step in
                                                                            range(2)]}
    reference.close()
    first, events = engine_for(name, capacity=2, swap_dir=tmp_path)
    runner = first.runner
    run(first, "a", 0)
    run(first, "b", 0)
    run(first, "a", 1)
    swapped = runner.swap_out_sessions(["b", "a", "not-resident"])
    assert list(swapped) == ["b", "a"] and all(n > 0 for n in swapped.values())
    evicted = [(e.session_id, e.reason, e.swapped, e.swap_bytes) for e in events if e.kind == "session_evicted"]
    assert evicted == [("b", "explicit", True, swapped["b"]), ("a", "explicit", True, swapped["a"])]
    assert runner.session_ids == [] and pages_held(first) == 0 and first.pipeline.sessions == {}
    assert runner.swap_out_sessions(["a"]) == {}  # swapped out already: nothing to do
    kept = runner.detach_snapshots()
    assert sorted(kept) == ["a", "b"]
    first.close()
    second, events = engine_for(name, capacity=1, swap_dir=tmp_path)
    assert all(second.runner.adopt_snapshot(session, file) for session, file in kept.items())
    assert_same(run(second, "a", 2), expected["a"][2], "a, adopted after two steps")
    assert_same(run(second, "b", 1), expected["b"][1], "b, adopted after one step")
    assert [e.session_id for e in events if e.kind == "session_restored"] == ["a", "b"]
    second.close()
    assert not tmp_path.exists()


def test_snapshots_dropped_while_adopting_a_stopped_runs_snapshots_are_events_then(tmp_path):
    # A resume with a smaller swap space: adopting b's snapshot drops a's. The event came at the next swap-out,
    # naming that session as the one the room was made for, or never.
    first, _ = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path)
    for session in ("a", "b", "c"):
        run(first, session, 0)
    first.runner.swap.flush()
    one = first.runner.pool_usage().swapped_bytes // 2
    kept = first.runner.detach_snapshots()
    first.close()
    second, events = engine_for("causal-world-tiny", capacity=1, swap_dir=tmp_path, swap_space=one * 3 // 2)
    assert second.runner.adopt_snapshot("a", kept["a"]) and second.runner.adopt_snapshot("b", kept["b"])
    assert [(e.kind, e.session_id, e.by_session_id, e.swap_bytes) for e in events if e.kind != "capacity_planned"] \
        == [("snapshot_dropped", "a", "b", one)]  # a's file (a and b ran one step each: their files are alike)
    assert second.runner.restore_session("a") is False and second.runner.restore_session("b") is True
    second.close()


def test_swapping_out_one_session_id_given_as_a_string_is_refused_not_taken_letter_by_letter(tmp_path):
    """swap_out_sessions("robot-a") took the string for an iterable of the ids 'r', 'o', 'b', ...: nothing was
    resident under those, so it swapped nothing out and returned {} without a word; None was a bare TypeError."""
    engine, _ = engine_for("causal-world-tiny", capacity=2, swap_dir=tmp_path)
    run(engine, "robot-a", 0)
    for ids, hint in (("robot-a", "swap_out_sessions(['robot-a'])"), (None, "a list of session ids")):
        with pytest.raises(RequestTypeError, match=r"^swap_out_sessions\(\) takes an iterable of session ids, got ") \
                as info:
            engine.runner.swap_out_sessions(ids)
        assert isinstance(info.value, TypeError) and hint in info.value.hint
    assert engine.runner.session_ids == ["robot-a"]
    assert list(engine.runner.swap_out_sessions(["robot-a"])) == ["robot-a"]  # as the hint says
    engine.close()


def test_swapping_resident_sessions_out_takes_only_the_swap_space_left(tmp_path):
    # Swapping the resident sessions out must not cost the swapped-out ones their snapshots: the LRU path drops the
    # least recently swapped to make room, which would only trade one kept session for another.
    engine, events = a_swapped_out(tmp_path)  # a swapped out, b resident, one step each
    runner = engine.runner
    one = runner.pool_usage().swapped_bytes
    runner.swap.budget_bytes = int(one * 1.5)  # room for b's snapshot alone, not beside a's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a session that does not fit just stays: no warning
        assert runner.swap_out_sessions(["b"]) == {}
    assert runner.session_ids == ["b"] and runner.swap.session_ids == ["a"] and runner.swap.num_dropped == 0
    assert [e.session_id for e in events if e.kind == "session_evicted"] == ["a"]
    runner.close_session("a")  # its snapshot deleted: now b's fits
    assert list(runner.swap_out_sessions(["b"])) == ["b"] and runner.session_ids == []
    engine.close()


def test_a_session_whose_request_a_stop_cut_short_is_not_swapped_out(tmp_path, monkeypatch):
    # Ctrl-C after the forward, before the runner counted the request: the session stayed resident, its KV one
    # step ahead of its count. Swapped out, a later process would restore it as the history before that step. It is
    # released now, as for any stop inside a request.
    engine, _ = engine_for("causal-world-tiny", capacity=2, swap_dir=tmp_path)
    runner = engine.runner
    run(engine, "a", 0)
    run(engine, "b", 0)

    def ctrl_c(session_id, session):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_snapshot", ctrl_c)  # the view taken once the request is counted
    with pytest.raises(KeyboardInterrupt):
        run(engine, "a", 1)
    monkeypatch.undo()
    assert runner.session_ids == ["b"]
    assert list(runner.swap_out_sessions(["a", "b"])) == ["b"]
    assert runner.session_ids == [] and not runner.swap.has("a")
    engine.close()


def test_after_a_full_disk_the_room_check_counts_the_cross_attention_bytes_too(tmp_path, monkeypatch):
    """_check_disk_room's lower bound is the session's pages plus its cross-attention caches. Only the free
    space is faked, as in the full-disk test above; writes and exports are real."""
    engine, events, exported, free, _ = after_a_full_disk(tmp_path, monkeypatch)
    runner = engine.runner
    state = runner._sessions["b"].state
    assert state.cross_attention_bytes > 0
    free[0] = state.num_pages * runner.capacity_plan.bytes_per_page  # room for b's pages, not its caches too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=Warning)
        run(engine, "c", 0)  # evicts b: not exported, as its snapshot cannot fit
    assert exported == ["a"]
    evicted = [(e.session_id, e.swapped) for e in events if e.kind == "session_evicted"]
    assert evicted == [("a", True), ("b", False)]
    engine.close()


def fresh_runner(name: str, swap_dir, **model) -> ARDiffusionModelRunner:
    from pipelines import causal_world, dreamzero

    module = {"dreamzero": dreamzero, "causal_world": causal_world}[name]
    pipe = module.pipeline_class().fresh(module.Config.from_dict({"preset": "tiny", **model}, where="test"))
    runner = ARDiffusionModelRunner(pipe, memory_budget="1GiB", session_capacity=1, attention_backend="torch",
                                    swap_dir=swap_dir)
    runner.load()
    return runner


@pytest.mark.parametrize(("name", "change", "said"), [
    ("causal_world", {}, None),  # the control: the same model takes its session back
    ("causal_world", {"window_frames": 9}, "written under another KV spec (window_frames differ)"),
    ("causal_world", {"seed": 7}, "exported by another model"),  # other weights, the same geometry
    ("causal_world", {"timestep_shift": 3.0}, "exported by another model"),  # its history was sampled otherwise
    # was a shape error in the next forward: its anchor latent is model-owned state of another size
    ("dreamzero", {"latent_channels": 2}, "another KV spec (model_owned_state_bytes_per_session differ)"),
    ("dreamzero", {"num_inference_steps": 2}, "exported by another model"),
])
def test_a_snapshot_adopted_by_a_runner_of_another_model_config_is_refused(tmp_path, name, change, said):
    # The file recorded neither: a session went on with KV another model computed, or crashed in the model.
    first = fresh_runner(name, tmp_path)
    inputs = first.pipeline.example_inputs(1, seed=0) if name == "dreamzero" else first.pipeline.example_inputs()
    first.execute_model(ARDiffusionRequest("a/0", inputs, {"session_id": "a"}))
    assert first.swap_out_sessions(["a"])
    kept = first.detach_snapshots()
    first.close()
    later = fresh_runner(name, tmp_path, **change)
    assert later.adopt_snapshot("a", kept["a"]) is True
    if said is None:
        assert later.restore_session("a") is True
    else:
        with pytest.raises(SwapRestoreError, match=re.escape(said)):
            later.restore_session("a")
        assert later.session_ids == [] and later.pool_usage().num_used == 0
    later.close()


def test_a_kv_state_kept_past_a_swap_out_is_refused_and_the_session_goes_on_in_a_new_one(tmp_path):
    """A pipeline that keeps the first state bound (its text cache read through it ever after): once its session is
    swapped out, the state is closed and its pages free for other sessions, and the session swapped back in gets a
    new state. A read of the kept one, in the session's own forward too, is a RuntimeError that says so; the swap
    itself (the runner's export and restore of the states it holds) goes on bit-identical."""
    reference = ARDiffusionModelRunner(_KVOnly(), memory_budget=64 << 20, session_capacity=2)
    pipe = _KVOnly()
    runner = ARDiffusionModelRunner(pipe, memory_budget=64 << 20, session_capacity=1, swap_dir=tmp_path)
    for r in (reference, runner):
        r.load()
    for session, step in (("a", 0), ("b", 0), ("a", 1)):
        pipe.keep_state = session == "a" and step == 0  # only a's first forward: it reads its own state
        expected = reference.execute_model(request(session, step))
        got = runner.execute_model(request(session, step))  # b swaps a out; a's next request swaps it back in
        assert all(torch.equal(got[k], expected[k]) for k in expected), (session, step)
    kept = pipe.kept_state
    assert kept.closed and runner._sessions["a"].state is not kept and runner.session_ids == ["a"]
    pipe.keep_state = True
    with pytest.raises(RuntimeError, match=r"^_KVOnly\.forward\(\): cross_attention\(\) on the AR-Diffusion KV state "
                                           r"of session 'a': the state is closed: the runner released the session "
                                           r"\(closed, reset, evicted or swapped out\).*a session swapped back in gets "
                                           r"a new state"):
        runner.execute_model(request("a", 2))
    assert runner.session_ids == [] and runner.pool_usage().num_used == 0
    runner.close()
    reference.close()


def open_files() -> set[tuple[str, str]]:
    """This process's open descriptors, each with what it leads to (a number closed and opened again is told)."""
    opened = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            opened.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return opened


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="counts /proc/self/fd")
def test_evict_restore_reset_close_churn_gives_every_page_file_thread_and_fd_back(tmp_path):
    """Hours of a lab's rollout in miniature, through the runtime API: four sessions over capacity 2, so nearly
    every request swaps one out and restores another, with resets, closes on a request and explicit closes of
    resident and swapped-out sessions between them. After every request no page is held twice or by nobody, and the
    swap folder holds one file per swapped-out session; the allocator's peak is the plan's pages, no more (the plan
    covers it) and no less (two full windows and a block in flight take all of them); at the end every page is on
    the free list once and no file, thread or file descriptor is left."""
    import random

    # what is open and running as it starts, not how many: a thread or file a test before this one left may end
    # meanwhile (pytest-xdist runs any test after any other), and a count then read one that this test leaked as none
    fds_before, threads_before = open_files(), set(threading.enumerate())
    swap = tmp_path / "swap"
    engine, events = engine_for("causal-world-tiny", capacity=2, swap_dir=swap)
    runner = engine.runner
    allocator, plan = runner.kv_cache.allocator, runner.capacity_plan
    peak, allocate = [0], allocator.allocate

    def counted(count):
        pages = allocate(count)
        peak[0] = max(peak[0], allocator.num_used)
        return pages

    allocator.allocate = counted
    rng = random.Random(3)
    steps: dict[str, int] = {}
    for i in range(60):
        # the first 8 requests fill two windows (3 frames a block, sink 1 + window 6) then slide one of them
        session = ("a", "b", "a", "b", "a", "b", "a", "a")[i] if i < 8 else rng.choice("abcd")
        reset, close = i >= 8 and rng.random() < 0.1, i >= 8 and rng.random() < 0.1
        step = 0 if reset else steps.get(session, 0)
        engine.execute(ARDiffusionRequest(f"{session}/{i}", inputs_for(engine.pipeline, session, step),
                                          {"session_id": session, "reset": reset, "close_session": close}))
        steps[session] = 0 if close else step + 1
        if i >= 8 and rng.random() < 0.1:
            victim = rng.choice([s for s in "abcd" if steps.get(s)] or ["a"])
            runner.close_session(victim)  # resident or swapped out; unknown ones are a no-op
            steps[victim] = 0
        runner.swap.flush()
        held = [page for s in runner._sessions.values() for page in s.state.page_ids()]
        assert len(held) == len(set(held)) == allocator.num_used, f"request {i}: a page held twice or leaked"
        assert sorted(p.name for p in (swap.iterdir() if swap.exists() else ())) == sorted(
            runner.swap.path_for(s).name for s in runner.swap.session_ids), f"request {i}: swap files"
    kinds = {e.kind for e in events}
    assert {"session_evicted", "session_restored", "session_closed"} <= kinds, kinds
    assert peak[0] == plan.num_managed_pages == allocator.num_allocatable, (peak[0], plan)
    engine.close()
    assert allocator.num_used == 0 and sorted(allocator._free) == list(range(1, allocator.num_pages))
    assert not swap.exists()
    assert set(threading.enumerate()) - threads_before == set()
    assert open_files() - fds_before == set()
