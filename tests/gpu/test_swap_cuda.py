"""Swapping a session out of GPU memory: the copy to the host must not need the session's size free on the device.

UNVERIFIED: written without a GPU (the session that wrote it had none); skips unless a CUDA device is present.
Run with ``pytest tests/gpu``. The torch pool needs no vLLM.
"""

from __future__ import annotations

import pytest
import torch

from ardiff_cli.runtime.capability import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
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
