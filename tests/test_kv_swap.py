"""Swapping a session's KV off the device and back: ARDiffusionKVState.export / restore on every pool layout.

A session swapped out and restored (into other page ids, after another session took its pages) must read exactly
what it read before: the same page contents in the same attention order, the same caches, the same positions.
"""

from __future__ import annotations

import os
import platform

import pytest
import torch
from test_backends import _vllm_cpu_ready

from ardiff_cli.runtime.capability import ARDiffusionCrossAttentionKVSpec, ARDiffusionKVBranchSpec
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.kv.layout import KVLayout
from ardiff_cli.runtime.kv.state import KVSnapshot
from ardiff_cli.runtime.kv.vllm_attention import TorchPagedKernel

CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))
CROSS = (ARDiffusionCrossAttentionKVSpec("text", 3),)


def make(make_spec, backend, *, dtype=torch.float32, **overrides):
    spec = make_spec(kv_branches=CFG, cross_attention=CROSS, max_scratch_tokens_per_branch=2, **overrides)
    return ARDiffusionKVCache(spec, KVLayout.from_spec(spec).managed_pages(2), dtype=dtype,
                              attention_backend=backend)


def block(state, branch, seed, *, commit=True, num_registers=1):
    """One forward of ``branch`` over every layer with K/V drawn from ``seed``; returns the attention outputs."""
    spec = state.spec
    dtype = state._cache.pool.dtype
    gen = torch.Generator().manual_seed(seed)
    seq_len = spec.frames_per_block * spec.tokens_per_frame
    outs = []
    for ctx in state.get_kv_caches(branch, seq_len=seq_len, commit_current=commit):
        q, k, v = (torch.randn(spec.num_kv_heads, seq_len + num_registers, spec.head_size, generator=gen).to(dtype)
                   for _ in range(3))
        outs.append(ctx.attend(q, k, v))
    state.commit(branch)
    return outs


def publish(state, branch, seed):
    heads, tokens, head_size = state.spec.cross_geometry("text")
    gen = torch.Generator().manual_seed(seed)
    dtype = state._cache.pool.dtype
    state.populate_cross_attention(branch, "text", [
        (torch.randn(heads, tokens, head_size, generator=gen).to(dtype),
         torch.randn(heads, tokens, head_size, generator=gen).to(dtype)) for _ in range(state.spec.num_layers)])


def history(state, blocks):
    publish(state, "positive", 1)
    publish(state, "negative", 2)
    for i in range(blocks):
        for branch in ("positive", "negative"):
            block(state, branch, 100 * i + len(branch))


def assert_same_snapshot(a: KVSnapshot, b: KVSnapshot) -> None:
    assert a.metadata == b.metadata
    assert sorted(a.tensors) == sorted(b.tensors)
    for key in a.tensors:
        assert a.tensors[key].dtype == b.tensors[key].dtype, key
        assert torch.equal(a.tensors[key], b.tensors[key]), key


BACKENDS = {"torch": lambda: "torch", "torch-paged": lambda: TorchPagedKernel(4)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("blocks", [1, 4])  # within the window, and past it (pages evicted, sink + window split)
def test_a_restored_session_reads_exactly_what_it_read_before(make_spec, backend, dtype, blocks):
    # 6-token frames on 4-token kernel blocks: one body block and a 2-token tail per page (torch-paged).
    cache = make(make_spec, BACKENDS[backend](), dtype=dtype, tokens_per_frame=6)
    reference = make(make_spec, BACKENDS[backend](), dtype=dtype, tokens_per_frame=6).new_state("a")
    state = cache.new_state("a")
    history(state, blocks)
    history(reference, blocks)
    free_before = cache.num_free_pages
    held = state.num_pages
    snapshot = state.export()
    assert snapshot.metadata["branches"]["positive"]["num_committed_frames"] == blocks * 2
    assert all(t.device.type == "cpu" for t in snapshot.tensors.values())
    state.close()  # swapped out: every page back
    assert cache.num_free_pages == free_before + held
    other = cache.new_state("b")  # another session takes the pages "a" had
    history(other, 1)
    restored = cache.new_state("a")
    free = cache.num_free_pages
    restored.restore(snapshot)
    assert cache.num_free_pages == free - held  # exactly the pages it held, no more
    for branch in ("positive", "negative"):
        before, after = reference.adapter(branch), restored.adapter(branch)
        assert after.num_committed_frames == before.num_committed_frames
        assert after.num_resident_frames == before.num_resident_frames
    assert restored.cross_attention_bytes == reference.cross_attention_bytes
    assert_same_snapshot(snapshot, restored.export())  # byte-identical round trip
    # Run on: a denoising pass and a commit pass give bit-identical attention to the never-swapped session.
    for seed, commit in ((7, False), (8, True), (9, False)):
        for branch in ("positive", "negative"):
            got, want = block(restored, branch, seed, commit=commit), block(reference, branch, seed, commit=commit)
            for layer, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g, w), f"{branch} layer {layer} differs after the restore"
    restored.close()
    other.close()
    assert cache.num_free_pages == cache.num_managed_pages


def exported(make_spec, blocks):
    """A torch-backend cache, the snapshot of a session of ``blocks`` blocks taken from it (the session closed
    then), and the cache's free page count after."""
    cache = make(make_spec, "torch")
    state = cache.new_state("a")
    history(state, blocks)
    snapshot = state.export()
    state.close()
    return cache, snapshot, cache.num_free_pages


def test_a_snapshot_that_does_not_fit_is_refused_and_leaves_the_state_empty(make_spec):
    cache, snapshot, free = exported(make_spec, 2)
    # Another dtype, another geometry, another layout: each named, nothing allocated.
    cases = {
        "dtype": (KVSnapshot({k: t.double() for k, t in snapshot.tensors.items()}, snapshot.metadata),
                  "is torch.float64 (2, 2, 2, 4, 4, 8), expected torch.float32"),
        "branches": (KVSnapshot(snapshot.tensors, {"branches": {"main": {}}}), "branches ['main'], expected"),
        "counts": (KVSnapshot(snapshot.tensors, {"branches": {
            **snapshot.metadata["branches"], "positive": {"num_committed_frames": 4, "num_sink_pages": 1,
                                                          "num_window_pages": 9}}}), "holds 1 sink and 9 window"),
        "count types": (KVSnapshot(snapshot.tensors, {"branches": {
            **snapshot.metadata["branches"], "positive": {"num_committed_frames": "4", "num_sink_pages": True,
                                                          "num_window_pages": 1}}}), "expected non-negative integers"),
        "layout": (KVSnapshot({**{k: t for k, t in snapshot.tensors.items() if "/kv" not in k},
                               "self/positive/blocks": torch.zeros(1), "self/negative/blocks": torch.zeros(1)},
                              snapshot.metadata), "expected ['cross/negative/text'"),
    }
    for name, (bad, message) in cases.items():
        state = cache.new_state("a")
        with pytest.raises(ValueError, match="KV snapshot of session 'a'") as info:
            state.restore(bad)
        assert message in str(info.value), (name, str(info.value))
        assert cache.num_free_pages == free and state.num_pages == 0 and state.cross_attention_bytes == 0
        state.close()
    paged = make(make_spec, TorchPagedKernel(4)).new_state("a")  # the other pool's layout
    with pytest.raises(ValueError, match="expected .*self/negative/blocks"):
        paged.restore(snapshot)


@pytest.mark.parametrize("frames, num_sink, num_window", [(2, 0, 2), (3, 1, 1), (1, 0, 1)])
def test_a_snapshot_whose_sink_and_window_disagree_with_its_frame_count_is_refused(make_spec, frames, num_sink,
                                                                                   num_window):
    """Sink 1, window 3, one page per frame: after n frames a branch holds min(n, 1) sink pages and then
    min(n - 1, 3) window pages, nothing else. Restored, any other split would attend to other frames than the
    session did (no sink frame, a missing window frame) and fill the sink with a later frame."""
    cache, snapshot, free = exported(make_spec, 1)  # 2 frames per branch: 1 sink page, 1 window page
    assert snapshot.metadata["branches"]["positive"] == {"num_committed_frames": 2, "num_sink_pages": 1,
                                                         "num_window_pages": 1}
    tensors = dict(snapshot.tensors)
    tensors["self/positive/kv"] = tensors["self/positive/kv"][:, :, :, : num_sink + num_window]  # shapes agree
    bad = KVSnapshot(tensors, {"branches": {**snapshot.metadata["branches"], "positive": {
        "num_committed_frames": frames, "num_sink_pages": num_sink, "num_window_pages": num_window}}})
    state = cache.new_state("a")
    with pytest.raises(ValueError, match=f"branch 'positive' holds {num_sink} sink and {num_window} window pages "
                                         f"after {frames} frames, expected"):
        state.restore(bad)
    assert cache.num_free_pages == free and state.num_pages == 0 and state.cross_attention_bytes == 0


def test_a_restore_that_fails_midway_frees_what_it_took(make_spec, monkeypatch):
    cache, snapshot, free = exported(make_spec, 3)

    def broken(page_ids, contents):
        raise OSError("device lost")

    monkeypatch.setattr(cache.pool, "write_page_contents", broken)
    state = cache.new_state("a")
    with pytest.raises(OSError, match="device lost"):
        state.restore(snapshot)
    assert cache.num_free_pages == free and state.num_pages == 0
    assert state.adapter("positive").num_committed_frames == 0


@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_cpu_ready(), reason="vLLM's CPU attention kernels (vllm-cpu) not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_restored_session_reads_exactly_what_it_read_before_with_vllms_cpu_kernel(make_spec, dtype):
    """vLLM's CPU blocks are in an ISA-specific format: whole blocks are copied as they are."""
    overrides = dict(head_size=32, tokens_per_frame=40)  # one 32-token block + an 8-token tail per page
    cache = make(make_spec, "vllm", dtype=dtype, **overrides)
    assert cache.pool.kernel.name == "vllm-cpu-attn"
    reference = make(make_spec, "vllm", dtype=dtype, **overrides).new_state("a")
    state = cache.new_state("a")
    history(state, 3)
    history(reference, 3)
    snapshot = state.export()
    state.close()
    other = cache.new_state("b")
    history(other, 1)
    restored = cache.new_state("a")
    restored.restore(snapshot)
    assert_same_snapshot(snapshot, restored.export())
    for seed, commit in ((7, False), (8, True), (9, False)):
        for branch in ("positive", "negative"):
            got, want = block(restored, branch, seed, commit=commit), block(reference, branch, seed, commit=commit)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), branch


@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_cpu_ready() or platform.machine() != "x86_64",
                    reason="vLLM's x86 CPU attention kernels (vllm-cpu) not installed")
def test_a_snapshot_of_vllms_cpu_blocks_laid_out_for_another_isa_is_refused_not_read_as_other_keys(make_spec):
    """vLLM lays its bfloat16 CPU blocks out for AMX on a CPU that has it, and for "vec" on one without: a run's
    kept snapshot resumed on the other machine has the same shapes and dtype, and was restored as it was, so
    attention read other keys and values (max abs error 0.66 against the dense reference, bfloat16 tolerance 2e-2).
    Blocks are written here with the ISA's reshape op only (``store``): AMX's attention needs an AMX CPU."""
    from ardiff_cli.runtime.kv.vllm_attention import CpuAttentionKernel

    overrides = dict(head_size=32, tokens_per_frame=64)  # two 32-token blocks per page, no tail
    caches = {isa: make(make_spec, CpuAttentionKernel(32, torch.bfloat16, 32, isa=isa), dtype=torch.bfloat16,
                        **overrides) for isa in ("amx", "vec")}
    snapshots = {}
    for isa, cache in caches.items():
        state, gen = cache.new_state("a"), torch.Generator().manual_seed(0)
        spec = state.spec
        for _ in range(2):  # the same K/V into both
            for ctx in state.get_kv_caches("positive", seq_len=spec.frames_per_block * 64, commit_current=True):
                k, v = (torch.randn(spec.num_kv_heads, spec.frames_per_block * 64, 32, generator=gen).bfloat16()
                        for _ in range(2))
                ctx.store(k, v)
            state.commit("positive")
        snapshots[isa] = state.export()
    amx, vec = snapshots["amx"], snapshots["vec"]
    assert amx.tensors["self/positive/blocks"].shape == vec.tensors["self/positive/blocks"].shape
    assert not torch.equal(amx.tensors["self/positive/blocks"], vec.tensors["self/positive/blocks"])  # other bytes
    free = caches["vec"].num_free_pages
    state = caches["vec"].new_state("b")
    with pytest.raises(ValueError, match=r"KV snapshot of session 'b': its KV blocks are in the format "
                                         r"'vllm-cpu-attn amx', this cache reads 'vllm-cpu-attn vec'"):
        state.restore(amx)
    assert caches["vec"].num_free_pages == free and state.num_pages == 0
    unrecorded = KVSnapshot(vec.tensors, {k: v for k, v in vec.metadata.items() if k != "block_format"})
    with pytest.raises(ValueError, match=r"does not record its KV block format \(written by an earlier ardiff\)"):
        state.restore(unrecorded)  # an older file: which ISA laid it out is unknown
    assert caches["vec"].num_free_pages == free and state.num_pages == 0
    state.restore(vec)  # its own format
    assert_same_snapshot(vec, state.export())


def test_a_snapshot_of_another_block_format_is_refused_and_an_older_torch_one_restored(make_spec):
    """The block format check on the torch backend (no vLLM needed): a snapshot recording another format is refused
    before any page is taken; one recording none (written before formats were recorded) restores, since the torch
    backend's pages are plain heads-first rows on every machine."""
    cache, snapshot, free = exported(make_spec, 2)
    assert snapshot.metadata["block_format"] == "torch"
    state = cache.new_state("b")
    other = KVSnapshot(snapshot.tensors, {**snapshot.metadata, "block_format": "vllm-cpu-attn amx"})
    with pytest.raises(ValueError, match=r"its KV blocks are in the format 'vllm-cpu-attn amx', this cache reads "
                                         r"'torch'"):
        state.restore(other)
    assert cache.num_free_pages == free and state.num_pages == 0
    state.restore(KVSnapshot(snapshot.tensors, {k: v for k, v in snapshot.metadata.items() if k != "block_format"}))
    assert_same_snapshot(snapshot, state.export())


def test_a_snapshot_with_a_cross_cache_of_an_unknown_branch_is_refused(make_spec):
    """check_snapshot must refuse cross/<branch>/<name> for a branch the cache does not have."""
    cache, snapshot, free = exported(make_spec, 2)
    tensors = {**snapshot.tensors, "cross/ghost/text": snapshot.tensors["cross/positive/text"].clone()}
    state = cache.new_state("a")
    with pytest.raises(ValueError, match=r"KV snapshot of session 'a': tensors .*cross/ghost/text"):
        state.restore(KVSnapshot(tensors, snapshot.metadata))
    assert cache.num_free_pages == free and state.num_pages == 0 and state.cross_attention_bytes == 0


def test_swap_store_makes_room_by_dropping_the_least_recently_swapped_first(tmp_path):
    """with three snapshots and room for two, the oldest goes, not the newest."""
    from ardiff_cli.runtime.swap import SwapStore

    tensors = {"kv/x": torch.zeros(256)}
    store = SwapStore(tmp_path / "swap", 1 << 20)
    one = store.write("p", tensors, {})  # same-length ids: same planned size
    store.discard("p")
    store.budget_bytes = 2 * one + one // 2  # room for two snapshots, not three
    for sid in ("a", "b", "c"):
        assert store.write(sid, tensors, {}) == one
    store.flush()
    assert store.session_ids == ["b", "c"]
    assert [sid for sid, _ in store.dropped] == ["a"] and store.num_dropped == 1
    assert store.nbytes <= store.budget_bytes
    store.clear()


def test_decode_snapshot_refuses_tensors_it_cannot_have_written():
    """a snapshot file holding a tensor outside kv/ and pipeline/ is not one encode_snapshot wrote."""
    from ardiff_cli.runtime.swap import decode_snapshot, encode_snapshot

    tensors, metadata = encode_snapshot(KVSnapshot({}, {"branches": {}}), {"step": 3}, 1)
    kv, state, num_requests = decode_snapshot(tensors, metadata)
    assert state == {"step": 3} and num_requests == 1
    with pytest.raises(ValueError, match=r"cannot have written: \['junk/x'\]"):
        decode_snapshot({**tensors, "junk/x": torch.zeros(1)}, metadata)


def test_a_pipeline_state_of_nested_plain_values_comes_back_equal_and_one_json_would_change_is_refused(tmp_path):
    """A pipeline's exported state of dicts and lists (str keys, plain items) comes back from the file equal; a
    dict key JSON would give back as a str, or a state that is no dict, is a TypeError naming where it is, before
    any file is written. Decoding refuses metadata it cannot have written, naming what is wrong."""
    from ardiff_cli.runtime.swap import SwapStore, decode_snapshot, encode_snapshot

    kv = KVSnapshot({}, {"branches": {}})
    plain = {"steps": [1, 2.5, None, ["a", {"b": 3}]], "record": {"task": "pick", "ids": []}}
    store = SwapStore(tmp_path / "swap", 1 << 20)
    store.write("a", *encode_snapshot(kv, {**plain, "latent": torch.ones(2)}, 4))
    store.flush()
    tensors, metadata, _ = store.read("a")
    _, state, num_requests = decode_snapshot(tensors, metadata)
    assert num_requests == 4 and torch.equal(state.pop("latent"), torch.ones(2)) and state == plain
    store.clear()
    with pytest.raises(TypeError, match=r"^export\(\)\['record'\]\['by_step'\]\[0\] has the key 3, a int, which "
                       "JSON gives back as a str$"):
        encode_snapshot(kv, {"record": {"by_step": [{3: "x"}]}}, 1, where="export()")
    with pytest.raises(TypeError, match=r"^export\(\) returned list, expected a dict"):
        encode_snapshot(kv, [("step", 3)], 1, where="export()")
    with pytest.raises(ValueError, match=r"metadata is malformed \(kv, pipeline, num_requests\)"):
        decode_snapshot(tensors, {**metadata, "num_requests": "4"})
    with pytest.raises(ValueError, match=r"pipeline tensors are \['latent'\], its metadata lists \[\]"):
        decode_snapshot(tensors, {**metadata, "pipeline": {**metadata["pipeline"], "tensors": []}})


def test_a_new_snapshot_of_a_session_replaces_its_old_one_in_the_byte_count(tmp_path):
    """writing a session's snapshot again must drop the older one first, not count both."""
    from ardiff_cli.runtime.swap import SwapStore

    store = SwapStore(tmp_path / "swap", 1 << 20)
    tensors = {"kv/x": torch.zeros(256)}
    store.write("a", tensors, {})
    store.flush()
    one = store.nbytes
    store.write("a", {"kv/x": torch.ones(256)}, {})
    store.flush()
    assert store.num_snapshots == 1 and store.nbytes == one == store.path_for("a").stat().st_size
    store.clear()


def test_adopting_a_snapshot_larger_than_the_whole_budget_is_refused_and_deletes_it(tmp_path):
    """adopt() refuses (False) a file over the budget, and deletes it."""
    from ardiff_cli.runtime.swap import SwapStore

    earlier = SwapStore(tmp_path, 1 << 20)
    assert earlier.write("a", {"kv/x": torch.zeros(1024)}, {})
    names = earlier.detach()
    later = SwapStore(tmp_path, 1000)  # smaller than the 4 KiB file
    assert later.adopt("a", names["a"]) is False
    assert later.num_snapshots == 0 and later.nbytes == 0 and not list(tmp_path.glob("*.safetensors"))


def _kept_by_an_earlier_store(folder, names) -> tuple[dict[str, str], int]:
    """The files a stopped store left of ``names`` (one 4-float tensor each), detached; with the bytes a write of one
    more of a name as long plans (an upper bound of its file)."""
    from ardiff_cli.runtime.swap import SwapStore

    earlier = SwapStore(folder, 1 << 30)
    planned = {name: earlier.write(name, {"kv/x": torch.full((4,), float(i))}, {}) for i, name in enumerate(names)}
    return earlier.detach(), max(planned.values())


def test_a_detach_flushes_only_the_snapshots_not_flushed_already_and_the_folder(tmp_path, monkeypatch):
    """A stopped --resume flushed every snapshot it had adopted again (16 s at 10,000 kept snapshots), though the
    detach that left them flushed each before kept.json named it. One written since (its session restored and swapped
    out again) is flushed, and the folder, for the renames back; the files are whole for a third store."""
    from ardiff_cli.runtime import swap

    kept, _ = _kept_by_an_earlier_store(tmp_path, ["a", "b", "c"])
    later = swap.SwapStore(tmp_path, 1 << 30)
    assert all(later.adopt(name, file) for name, file in kept.items())
    later.write("b", {"kv/x": torch.full((4,), 7.0)}, {})  # b's session went on: a new snapshot of it
    flushed, real_fsync = [], os.fsync

    def fsync(fd):
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(swap.os, "fsync", fsync)
    again = later.detach()
    monkeypatch.undo()
    assert (again["a"], again["c"]) == (kept["a"], kept["c"])  # back under the names their metadata holds
    assert flushed == [str(tmp_path / again["b"]), str(tmp_path)]
    third = swap.SwapStore(tmp_path, 1 << 30)
    for name, value in (("a", 0.0), ("b", 7.0), ("c", 2.0)):
        assert third.adopt(name, again[name])
        assert torch.equal(third.read(name)[0]["kv/x"], torch.full((4,), value))
    third.clear()


def test_snapshots_adopted_then_written_are_dropped_least_recently_swapped_first(tmp_path):
    """Making room drops the snapshots in the order they were adopted or written, one written again going last;
    adopting does not walk the file list for each snapshot (10,000 adopted walked it 10,000 times: 3.3 s)."""
    from collections import OrderedDict

    from ardiff_cli.runtime.swap import SwapStore

    class Walked(OrderedDict):  # counts the entries iterating the file list visits
        visits = 0

        def __iter__(self):
            for key in super().__iter__():
                Walked.visits += 1
                yield key

    names = [f"s{i:02d}" for i in range(40)]
    kept, planned = _kept_by_an_earlier_store(tmp_path, names)
    sizes = [(tmp_path / file).stat().st_size for file in kept.values()]  # alike, to the 8 bytes of padding
    # the 40 adopted fit, and one more write needs the room of one of them (a rewrite of one, its own)
    store = SwapStore(tmp_path, sum(sizes) + planned - min(sizes) // 2)
    store._files = Walked()
    for name in names:
        assert store.adopt(name, kept[name])
    assert Walked.visits == 0 and store.num_snapshots == 40 and store.num_dropped == 0
    store.write("n00", {"kv/x": torch.zeros(4)}, {})  # drops s00, the first adopted
    store.flush()
    store.write("s01", {"kv/x": torch.ones(4)}, {})  # s01 written again: last, and nothing to drop (its file went)
    store.flush()
    store.write("n01", {"kv/x": torch.zeros(4)}, {})  # drops s02: s01 is no longer the least recently swapped
    store.flush()
    assert [session for session, _ in store.dropped] == ["s00", "s02"] and store.num_dropped == 2
    assert store.session_ids == [*names[3:], "n00", "s01", "n01"]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted(
        store.path_for(name).name for name in store.session_ids)
    store.clear()


def test_reading_a_snapshot_file_again_and_again_holds_no_memory_after_it(tmp_path):
    """A run that restores a session per step reads snapshot files for hours. safetensors' safe_open(...).get_tensor
    (0.8.0) kept two small Python objects per tensor read, about 64 B of RSS per tensor per restore; each read of a
    snapshot now leaves the process's count of allocated blocks as it was (counted, not timed)."""
    import gc
    import sys

    from ardiff_cli.runtime.swap import SwapStore

    tensors = {f"kv/layer{i}/{kv}": torch.randn(2, 8) for i in range(32) for kv in "kv"}  # 64 tensors
    store = SwapStore(tmp_path / "swap", 1 << 20)
    store.write("a", tensors, {})
    store.flush()
    for _ in range(50):  # caches warm (torch's, json's)
        store.read("a")
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(500):
        store.read("a")
    gc.collect()
    grown = sys.getallocatedblocks() - before
    assert grown < 1000, f"{grown} blocks more after 500 reads of 64 tensors"  # the leak: 2 x 64 x 500 = 64,000
    store.clear()


def test_a_snapshot_file_gives_back_every_dtype_shape_and_byte_safetensors_wrote(tmp_path):
    """The snapshot reader (not safetensors' own) gives back each tensor safetensors.torch.save_file wrote, of every
    dtype it writes, 0-d and empty ones too, bit for bit and by name, and the string metadata; and a tensor written
    to leaves the file as it was (a private mapping, as safe_open's)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ardiff_cli.runtime.swap import read_safetensors

    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool,
              *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                                  "float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, name))]
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for dtype in dtypes:
        for shape in [(3, 6), (), (0, 4), (2, 0, 2), (8,)]:
            if dtype == getattr(torch, "float4_e2m1fn_x2", None) and shape == ():
                continue  # packed two values a byte: safetensors writes its last dimension doubled
            count = torch.Size(shape).numel()
            raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=gen)
            tensors[f"{dtype}/{shape}"] = raw.view(dtype).reshape(shape)
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path), metadata={"ardiff_swap": "{}", "other": "x"})
    read, metadata = read_safetensors(path)
    with safe_open(str(path), framework="pt") as f:
        assert metadata == f.metadata() and list(read) == list(f.keys())  # by name, as safe_open lists them
        for name, tensor in read.items():
            expected = f.get_tensor(name)
            assert (tensor.dtype, tensor.shape) == (expected.dtype, expected.shape), name
            assert torch.equal(tensor.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name
    before = path.read_bytes()
    for tensor in read.values():
        tensor.reshape(-1).view(torch.uint8).fill_(7)
    assert path.read_bytes() == before


def test_a_safetensors_file_whose_tensors_are_not_aligned_to_their_dtype_is_read_too(tmp_path):
    """safetensors pads its header to 8 bytes, so each tensor starts aligned to its dtype; a file of another writer
    that does not (a header of 13 bytes) is read alike, those tensors copied out of the mapping."""
    import json

    from ardiff_cli.runtime.swap import read_safetensors

    values = torch.arange(6, dtype=torch.float32)
    header = json.dumps({"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, separators=(",", ":"))
    assert len(header) % 4
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + values.numpy().tobytes())
    tensors, metadata = read_safetensors(path)
    assert metadata == {} and torch.equal(tensors["x"], values.reshape(2, 3))


_DAMAGED = [
    ("empty", r"0 bytes: too short for a header's length"),
    ("truncated", r"\d+ bytes, its header declares \d+\)"),
    ("longer", r"\d+ bytes, its header declares \d+\)"),
    # it was "N bytes: too short for its header (1000000008 bytes)"
    ("header-length", r"its header's length says 1000000000 bytes, more than the 100000000 a safetensors header "
                      r"may take\)$"),
    ("zeros", r"its header is not JSON"),
    # json.loads of bytes takes UTF-16 (and UTF-32): it was read, as safetensors refuses it
    ("utf-16", r"its header holds NUL bytes, which no UTF-8 JSON text does \(zeroed, or UTF-16 or UTF-32 text\?\)\)$"),
    # the header's bytes zeroed (a crash before they reached the disk): it was said to be "not UTF-8 text" (UTF-16?)
    ("zeroed-header", r"its header holds NUL bytes, which no UTF-8 JSON text does \(zeroed, "),
    # JSON that json reads and safetensors refuses: they were read (the last of the two keys, the half character)
    ("duplicate-key", r"its header gives the key '__metadata__' twice\)$"),
    ("lone-surrogate", r"its header holds '\\ud800', half a UTF-16 surrogate pair\)$"),
    ("latin-1", r"its header is not UTF-8 text \(byte 0xe9 at offset \d+\)\)$"),
    ("metadata", r"its header is not a JSON object of tensors and string metadata"),
    ("dtype", r"tensor 'b' is \{.*'X9'.*\}, expected a known dtype, a shape and data_offsets"),
    ("shape", r"tensor 'b' of F32 \[3\] takes 12 bytes, its data_offsets \[16, 32\] give 16"),
    ("gap", r"tensor 'b' starts at byte 20 of the data, expected 16: the tensors' data_offsets leave a gap"),
    ("huge-dimension", r"tensor 'c' has the shape \[0, 9223372036854775808\]: "),
]


@pytest.mark.parametrize("damage, said", _DAMAGED, ids=[damage for damage, _ in _DAMAGED])
def test_a_damaged_snapshot_file_is_a_value_error_naming_it_and_what_is_wrong(tmp_path, damage, said):
    """What safetensors refuses, the snapshot reader refuses too, as a ValueError naming the file: the runner then
    says it cannot restore the session and rebuilds it."""
    import json
    import re

    from safetensors.torch import save

    from ardiff_cli.runtime.swap import read_safetensors

    data = save({"a": torch.ones(4), "b": torch.ones(4), "c": torch.ones(0, 2)}, metadata={"k": "v"})
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])

    def with_header(encoding="utf-8", then="", **changes):
        text = (json.dumps({**header, **changes}, ensure_ascii=encoding == "ascii")[:-1] + then + "}").encode(encoding)
        return len(text).to_bytes(8, "little") + text + data[8 + length:]

    damaged = {"empty": b"", "truncated": data[:-1], "longer": data + b"\0", "zeros": b"\0" * 64,
               "header-length": (10 ** 9).to_bytes(8, "little") + data[8:],
               "utf-16": with_header(encoding="utf-16-le"),
               "latin-1": with_header(encoding="latin-1", __metadata__={"k": "caf\u00e9"}),
               "zeroed-header": data[:8] + bytes(length) + data[8 + length:],
               "duplicate-key": with_header(then=', "__metadata__": {"k": "w"}'),
               "lone-surrogate": with_header(encoding="ascii", __metadata__={"k": "\ud800"}),
               "metadata": with_header(__metadata__={"k": 1}),
               "dtype": with_header(b={**header["b"], "dtype": "X9"}),
               "shape": with_header(b={**header["b"], "shape": [3]}),
               "gap": with_header(b={**header["b"], "data_offsets": [20, 36]}),
               "huge-dimension": with_header(c={**header["c"], "shape": [0, 2 ** 63]})}[damage]
    path = tmp_path / "x.safetensors"
    path.write_bytes(damaged)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: not a readable safetensors file \({said}"):
        read_safetensors(path)
    if damage in ("utf-16", "latin-1", "zeroed-header", "duplicate-key", "lone-surrogate"):  # safetensors refuses it
        from safetensors.torch import load

        with pytest.raises(Exception):
            load(damaged)
