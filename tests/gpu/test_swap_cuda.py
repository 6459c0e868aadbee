"""Swapping a session out of GPU memory: the copy to the host must not need the session's size free on the device.

UNVERIFIED: written without a GPU (the session that wrote it had none); skips unless a CUDA device is present.
Run with ``pytest tests/gpu``. The torch pool needs no vLLM.
"""

from __future__ import annotations

import pytest
import torch

from ardiff_cli.runtime.capability import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
)
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.kv.layout import KVLayout
from ardiff_cli.runtime.kv.pool import KVPagePool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_reading_a_sessions_pages_to_the_host_takes_one_layer_of_device_memory_and_round_trips():
    spec = ARDiffusionKVCacheSpec(num_layers=16, num_kv_heads=8, head_size=128, tokens_per_frame=512,
                                  frames_per_block=1, window_frames=6, sink_frames=1,
                                  kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=1)
    layout = KVLayout.from_spec(spec)
    pool = KVPagePool(layout, layout.managed_pages(1), torch.bfloat16, "cuda")
    pool.kv.normal_()
    pages = list(range(1, pool.num_pages))
    want = pool.kv.index_select(3, torch.tensor(pages, device=pool.device)).cpu()
    session_bytes = want.numel() * want.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = pool.read_page_contents(pages)["kv"]
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert got.device.type == "cpu" and torch.equal(got, want)
    assert extra <= 2 * session_bytes // spec.num_layers, (extra, session_bytes)  # one layer, not all 16
    pool.kv.zero_()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    pool.write_page_contents(pages, {"kv": got})
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= 2 * session_bytes // spec.num_layers
    assert torch.equal(pool.kv.index_select(3, torch.tensor(pages, device=pool.device)).cpu(), want)


def test_exporting_a_sessions_cross_attention_caches_stacks_them_on_the_host():
    spec = ARDiffusionKVCacheSpec(num_layers=16, num_kv_heads=8, head_size=128, tokens_per_frame=64,
                                  frames_per_block=1, window_frames=2, sink_frames=1,
                                  kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=1,
                                  cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 2048),))
    cache = ARDiffusionKVCache(spec, KVLayout.from_spec(spec).managed_pages(1), dtype=torch.bfloat16, device="cuda")
    state = cache.new_state("a")
    pairs = [(torch.randn(8, 2048, 128, device="cuda", dtype=torch.bfloat16),
              torch.randn(8, 2048, 128, device="cuda", dtype=torch.bfloat16)) for _ in range(spec.num_layers)]
    state.populate_cross_attention("main", "text", pairs)
    cross_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in pairs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    snapshot = state.export()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before <= cross_bytes // spec.num_layers  # not a stack of all 16
    stacked = snapshot.tensors["cross/main/text"]
    assert stacked.device.type == "cpu"
    for layer, (k, v) in enumerate(pairs):
        assert torch.equal(stacked[layer, 0], k.cpu()) and torch.equal(stacked[layer, 1], v.cpu())
