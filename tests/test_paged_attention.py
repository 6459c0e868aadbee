"""Paged attention equals a dense reference built from an independent record of every committed frame
(``dense_stream``: the reference and its tolerances)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from dense_stream import Stream, interleave

from ardiff_cli.runtime.capability import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
from ardiff_cli.runtime.kv import attention as attention_module
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.kv.layout import KVLayout
from ardiff_cli.runtime.kv.vllm_attention import TorchPagedKernel

CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))


def rollout(stream, num_blocks, frames_per_block, num_registers, denoise_steps=2, scale=None):
    """Blocks of ``denoise_steps`` scratch-only passes followed by one commit pass (every other one ending with
    ``store``)."""
    for block in range(num_blocks):
        for _ in range(denoise_steps):
            stream.run(frames_per_block, commit=False, num_registers=num_registers, scale=scale)
        stream.run(frames_per_block, commit=True, num_registers=num_registers, scale=scale, store_last=block % 2 == 1)


GEOMETRIES = {
    # name: spec overrides, q heads, page_size divisor
    "mha": (dict(num_kv_heads=2, head_size=8, tokens_per_frame=4, frames_per_block=2, sink_frames=1,
                 window_frames=3), 2, 1),
    "gqa2": (dict(num_kv_heads=2, head_size=8, tokens_per_frame=4, frames_per_block=2, sink_frames=1,
                  window_frames=3), 4, 1),
    "gqa4": (dict(num_kv_heads=1, head_size=16, tokens_per_frame=3, frames_per_block=1, sink_frames=2,
                  window_frames=2), 4, 1),
    "half-pages": (dict(num_kv_heads=2, head_size=8, tokens_per_frame=4, frames_per_block=2, sink_frames=1,
                        window_frames=3), 4, 2),
    "no-sink-big-block": (dict(num_kv_heads=2, head_size=4, tokens_per_frame=2, frames_per_block=3, sink_frames=0,
                               window_frames=2), 2, 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_registers", [0, 3])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_rollout_matches_dense_reference(make_spec, make_cache, geometry, num_registers, dtype):
    overrides, num_q_heads, divisor = GEOMETRIES[geometry]
    spec = make_spec(num_layers=2, kv_branches=CFG, max_scratch_tokens_per_branch=3, **overrides)
    page_size = spec.tokens_per_frame // divisor
    cache = make_cache(spec, num_sessions=1, dtype=dtype, page_size=page_size)
    assert cache.layout.pages_per_frame == divisor
    state = cache.new_state("s")
    stream = Stream(state, "positive", num_q_heads, dtype, torch.Generator().manual_seed(0))
    retained = spec.sink_frames + spec.window_frames
    # Enough blocks that the window wraps around several times.
    num_blocks = 3 * retained // spec.frames_per_block + 2
    rollout(stream, num_blocks, spec.frames_per_block, num_registers)
    assert len(stream.frames) > 2 * retained
    assert stream.num_checked == num_blocks * 3 * spec.num_layers - num_blocks // 2  # a store checks nothing
    # Shorter blocks (one frame) after the window is full, and history untouched by denoising passes.
    stream.run(1, commit=False, num_registers=num_registers)
    stream.run(1, commit=True, num_registers=num_registers)
    assert len(state.adapter("positive").page_ids) == retained * cache.layout.pages_per_frame


@pytest.mark.parametrize("num_q_heads", [2, 4, 8])
def test_no_history_equals_plain_attention(make_spec, make_cache, num_q_heads):
    spec = make_spec(num_layers=1, kv_branches=CFG, max_scratch_tokens_per_branch=2)
    state = make_cache(spec).new_state("s")
    stream = Stream(state, "negative", num_q_heads, torch.float32, torch.Generator().manual_seed(1))
    stream.run(2, commit=False, num_registers=2)
    stream.run(1, commit=False, num_registers=0)
    assert stream.frames == [] and stream.num_checked == 2


def test_explicit_scale(make_spec, make_cache):
    spec = make_spec(kv_branches=CFG)
    state = make_cache(spec).new_state("s")
    stream = Stream(state, "positive", 4, torch.float32, torch.Generator().manual_seed(2))
    rollout(stream, 4, spec.frames_per_block, 0, denoise_steps=1, scale=0.37)


def test_denoising_passes_do_not_change_history(make_spec, make_cache):
    """Scratch-only passes with huge K/V must leave no trace in what later passes see."""
    spec = make_spec(num_layers=1, kv_branches=CFG)
    cache = make_cache(spec)
    state = cache.new_state("s")
    stream = Stream(state, "positive", 2, torch.float32, torch.Generator().manual_seed(3))
    rollout(stream, 2, 2, 0, denoise_steps=0)
    pages_before = state.adapter("positive").page_ids
    snapshot = cache.pool.kv[:, :, :, list(pages_before)].clone()
    for _ in range(3):
        contexts = state.get_kv_caches("positive", seq_len=8)
        big = torch.full((2, 8, 8), 50.0)
        contexts[0].attend(big, big, big)
        state.commit("positive")
    assert state.adapter("positive").page_ids == pages_before
    assert torch.equal(cache.pool.kv[:, :, :, list(pages_before)], snapshot)
    rollout(stream, 3, 2, 0, denoise_steps=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sessions_and_branches_interleaved_never_see_each_other(make_spec, make_cache, dtype):
    spec = make_spec(num_layers=3, kv_branches=CFG, max_scratch_tokens_per_branch=2, sink_frames=1,
                     window_frames=2, frames_per_block=2)
    cache = make_cache(spec, num_sessions=2, dtype=dtype)
    free0 = cache.num_free_pages
    states = [cache.new_state("a"), cache.new_state("b")]
    streams = [
        Stream(state, branch, 4, dtype, torch.Generator().manual_seed(10 + i))
        for i, (state, branch) in enumerate((s, b) for s in states for b in ("positive", "negative"))
    ]
    for block in range(6):
        # Denoising passes of all four streams, layer by layer, with different register counts...
        interleave(*(s.forward(2, commit=False, num_registers=i % 3) for i, s in enumerate(streams)))
        # ...then commit passes interleaved with the other streams' denoising passes.
        interleave(
            streams[0].forward(2, commit=True, num_registers=1),
            streams[3].forward(2, commit=False, num_registers=2),
            streams[1].forward(1 + block % 2, commit=True, num_registers=0),
        )
        interleave(
            streams[2].forward(2, commit=True, num_registers=2),
            streams[3].forward(2, commit=True, num_registers=0),
            streams[0].forward(1, commit=False, num_registers=1),
        )
    for s in streams:
        assert len(s.frames) > spec.sink_frames + spec.window_frames
    for state in states:
        state.close()
    assert cache.num_free_pages == free0


def test_gqa_with_fused_kernel_output_layout(make_spec, make_cache, monkeypatch):
    """CUDA flash/memory-efficient SDPA return a transposed (B, L, H, D) buffer; GQA must not assume contiguity."""
    original = F.scaled_dot_product_attention

    def transposed_layout(*args, **kwargs):
        out = original(*args, **kwargs)  # (B, H, L, D)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, L, H, D) memory

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", transposed_layout)
    spec = make_spec(kv_branches=CFG)
    state = make_cache(spec).new_state("s")
    stream = Stream(state, "positive", 4, torch.float32, torch.Generator().manual_seed(4))
    rollout(stream, 3, spec.frames_per_block, 0, denoise_steps=1)


@pytest.mark.parametrize("layout", ["torch", "block"])
def test_seeded_random_geometries_match_dense_reference(layout):
    """Seeded random draws beyond the fixed geometries: one-token pages, several pages per frame, kernel blocks
    that leave a tail in every page, windows shorter than a block, no sink, partial blocks, registers up to the
    scratch room, grouped queries, explicit scales and resets, in float32 and bfloat16. Deterministic (about a
    second each); a failure names the draw and its geometry."""
    for draw in range(25):
        rng = random.Random(draw)
        tokens_per_frame = rng.randint(1, 12)
        page_size = rng.choice([d for d in range(1, tokens_per_frame + 1) if tokens_per_frame % d == 0])
        spec = ARDiffusionKVCacheSpec(
            num_layers=rng.randint(1, 3), num_kv_heads=rng.randint(1, 3), head_size=rng.choice([1, 4, 8, 12]),
            tokens_per_frame=tokens_per_frame, frames_per_block=rng.randint(1, 4), window_frames=rng.randint(1, 5),
            sink_frames=rng.choice([0, 1, 2]), kv_branches=CFG, session_capacity=1,
            max_scratch_tokens_per_branch=rng.choice([0, 3, 9]))
        dtype = rng.choice([torch.float32, torch.bfloat16])
        # Blocks no larger than a page always fit; larger ones only where their workspace holds every token as a
        # tail (test_seeded_kernel_blocks_longer_than_a_page_match_dense_reference).
        backend = "torch" if layout == "torch" else TorchPagedKernel(rng.randint(1, page_size))
        pages = KVLayout.from_spec(spec, page_size=page_size).managed_pages(1)
        cache = ARDiffusionKVCache(spec, pages, dtype=dtype, page_size=page_size, attention_backend=backend)
        state = cache.new_state("s")
        streams = [Stream(state, b.name, spec.num_kv_heads * rng.randint(1, 3), dtype,
                          torch.Generator().manual_seed(draw)) for b in CFG]
        where = f"draw {draw}: {spec}, page_size={page_size}, {cache.attention_description}, {dtype}"
        try:
            for _ in range(12 + 3 * (spec.sink_frames + spec.window_frames)):  # the window wraps several times
                if rng.random() < 0.05:
                    state.reset()
                    for stream in streams:
                        stream.frames.clear()
                    continue
                frames = rng.randint(1, spec.frames_per_block)
                registers = rng.randint(0, cache.layout.scratch_tokens - frames * tokens_per_frame)
                commit = rng.random() < 0.6
                rng.choice(streams).run(frames, commit=commit, num_registers=registers, scale=rng.choice([None, 0.3]),
                                        store_last=commit and rng.random() < 0.5)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from exc
        state.close()
        assert cache.num_free_pages == cache.num_managed_pages, where


def test_seeded_kernel_blocks_longer_than_a_page_match_dense_reference():
    """Kernel blocks longer than a page (vLLM's 16-token blocks over pages of a few tokens): every token of every page
    is a tail, packed with the registers into the workspace's dynamic blocks. A pool is built where those hold the
    largest forward (``KernelGeometry.fits``) and refused otherwise; the built ones match the dense reference over
    sinks, sliding windows, several pages per frame, partial blocks and both CFG branches, in float32 and bfloat16.
    The fixed geometries of test_backends.py have one such case ("all-tail")."""
    built = refused = 0
    for draw in range(40):
        rng = random.Random(f"long blocks {draw}")
        tokens_per_frame = rng.randint(1, 12)
        page_size = rng.choice([d for d in range(1, tokens_per_frame + 1) if tokens_per_frame % d == 0])
        spec = ARDiffusionKVCacheSpec(
            num_layers=rng.randint(1, 2), num_kv_heads=rng.randint(1, 2), head_size=rng.choice([1, 4, 8]),
            tokens_per_frame=tokens_per_frame, frames_per_block=rng.randint(1, 4), window_frames=rng.randint(1, 5),
            sink_frames=rng.choice([0, 1, 3]), kv_branches=CFG, session_capacity=1,
            max_scratch_tokens_per_branch=rng.choice([0, 3, 9]))
        dtype = rng.choice([torch.float32, torch.bfloat16])
        kernel = TorchPagedKernel(rng.randint(page_size + 1, 3 * page_size + 4))
        scratch_blocks = rng.choice([1, 3])  # more scratch: a larger workspace, so more geometries fit
        layout = KVLayout.from_spec(spec, page_size=page_size, scratch_blocks=scratch_blocks)
        where = f"draw {draw}: {spec}, page_size={page_size}, {kernel.block_size}-token blocks, {dtype}"
        try:
            cache = ARDiffusionKVCache(spec, layout.managed_pages(1), dtype=dtype, page_size=page_size,
                                       scratch_blocks=scratch_blocks, attention_backend=kernel)
        except ValueError as exc:
            assert "too small" in str(exc), f"{where}: {exc}"
            refused += 1
            continue
        built += 1
        assert cache.pool.geometry.blocks_per_page == 0, where
        state = cache.new_state("s")
        streams = [Stream(state, b.name, spec.num_kv_heads * rng.randint(1, 3), dtype,
                          torch.Generator().manual_seed(draw)) for b in CFG]
        try:
            for _ in range(8 + 3 * (spec.sink_frames + spec.window_frames)):  # the window wraps several times
                frames = rng.randint(1, spec.frames_per_block)
                registers = rng.randint(0, cache.layout.scratch_tokens - frames * tokens_per_frame)
                commit = rng.random() < 0.6
                rng.choice(streams).run(frames, commit=commit, num_registers=registers,
                                        store_last=commit and rng.random() < 0.5)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from exc
        state.close()
        assert cache.num_free_pages == cache.num_managed_pages, where
    assert built >= 10 and refused >= 10, (built, refused)


@pytest.mark.parametrize("layout", ["torch", "block"])
def test_store_is_a_commit_pass_write_checked_like_attend(make_spec, make_cache, layout):
    """``store`` writes only in a commit pass (the layer's ``commit_current``), once per layer (a second store or
    attend of it is refused), with attend's K/V shapes; a partial forward that stored only some layers is still
    refused at commit, and the session is usable after each refusal."""
    spec = make_spec(num_layers=2, kv_branches=CFG, max_scratch_tokens_per_branch=2)
    backend = "torch" if layout == "torch" else TorchPagedKernel(2)
    cache = make_cache(spec, attention_backend=backend)
    state = cache.new_state("s")
    seq_len = spec.tokens_per_frame
    k = torch.randn(spec.num_kv_heads, seq_len + 1, spec.head_size)  # one register: accepted, not committed
    denoise = state.get_kv_caches("positive", seq_len=seq_len)
    with pytest.raises(RuntimeError, match="not asked to commit"):
        denoise[1].store(k, k)
    contexts = state.get_kv_caches("positive", seq_len=seq_len, commit_current=True)
    wrong_heads = torch.randn(3, seq_len, spec.head_size)
    with pytest.raises(ValueError, match=r"store takes k, v \(2, tokens, 8\).*; got k \(3, 4, 8\), v \(3, 4, 8\): "
                       r"the pipeline's ar_diffusion_kv_cache_spec\(\) declares num_kv_heads=2 where the model's "
                       r"k has 3; make the spec"):
        contexts[1].store(wrong_heads, wrong_heads)
    too_long = torch.randn(2, seq_len + 7, spec.head_size)
    with pytest.raises(ValueError, match="store got 11 tokens for seq_len=4: expected the video tokens followed by 0"):
        contexts[1].store(too_long, too_long)
    with pytest.raises(ValueError, match=r"^layer 1 of branch 'positive': k must be torch.float32 on cpu like the "
                       r"KV pool \(the dtype and device from_config was given\), got torch.float64"):
        contexts[1].store(k.double(), k)  # named as the tensor it is (a store has no q)
    assert contexts[1].commit_current and not denoise[1].commit_current  # how a layer tells store from attend
    contexts[1].store(k, k)
    with pytest.raises(RuntimeError, match="layer 1 of branch 'positive' attended twice"):
        contexts[1].store(k, k)
    with pytest.raises(RuntimeError, match="attended twice"):
        contexts[1].attend(torch.randn(2, seq_len + 1, 8), k, k)
    with pytest.raises(RuntimeError, match="after a partial forward: 1 of 2 layers"):
        state.commit("positive")
    with pytest.raises(RuntimeError, match="stale"):
        contexts[0].store(k, k)
    assert state.adapter("positive").num_committed_frames == 0 and cache.num_free_pages == cache.num_managed_pages
    stream = Stream(state, "positive", 2, torch.float32, torch.Generator().manual_seed(5))
    rollout(stream, 4, 1, 1)
