"""Paged attention vs attention over contiguous K/V, on a full sink + window.

What is timed, side by side in one process, interleaved (the order alternates every repetition):

- ``paged``: ``ARDiffusionLayerContext.attend`` of a denoising pass on a session whose window is
  full -- write the current block's K/V into scratch, gather sink + window + current by page table,
  ``scaled_dot_product_attention``. ``get_kv_caches`` is called once per repetition, as a model
  does once per forward.
- ``contiguous``: ``F.scaled_dot_product_attention`` on K/V that are already one contiguous tensor of
  the same visible length (the same values, so the outputs are also compared).

The reported ratio is the median over repetitions of paged/contiguous; the target is <= 1.10, and the
outputs must agree (1e-5 in float32, 2e-2 in lower precision: ``outputs_match``).

    python -m benchmarks.bench_attention            # full geometry
    python -m benchmarks.bench_attention --quick    # tiny geometry, 2 repetitions
    python -m benchmarks.bench_attention --json out.json
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ardiff_cli.runtime.capability import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.kv.layout import KVLayout
from benchmarks.common import cli

TARGET = 1.10
TOLERANCE = {torch.float32: 1e-5}  # paged vs contiguous outputs; other dtypes: LOW_PRECISION_TOLERANCE
LOW_PRECISION_TOLERANCE = 2e-2

FULL = dict(num_heads=12, head_size=64, tokens_per_frame=520, frames_per_block=3, sink_frames=1, window_frames=6,
            repetitions=16, warmup=2)  # even: each side goes first in half the repetitions
QUICK = dict(num_heads=2, head_size=16, tokens_per_frame=8, frames_per_block=3, sink_frames=1, window_frames=2,
             repetitions=2, warmup=1)


def _setup(geometry: dict, dtype: torch.dtype):
    """A one-layer cache with a full window, the current block's q/k/v, and the same visible K/V contiguous."""
    heads, head_size, tpf, fpb = (geometry[k] for k in ("num_heads", "head_size", "tokens_per_frame",
                                                         "frames_per_block"))
    spec = ARDiffusionKVCacheSpec(
        num_layers=1,
        num_kv_heads=heads,
        head_size=head_size,
        tokens_per_frame=tpf,
        frames_per_block=fpb,
        window_frames=geometry["window_frames"],
        sink_frames=geometry["sink_frames"],
        kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
        session_capacity=1,
    )
    layout = KVLayout.from_spec(spec, scratch_blocks=1)
    cache = ARDiffusionKVCache(spec, layout.managed_pages(1), dtype=dtype, scratch_blocks=1)
    state = cache.new_state("bench")
    gen = torch.Generator().manual_seed(0)
    block = fpb * tpf
    frames: list[tuple[torch.Tensor, torch.Tensor]] = []  # every committed frame's (k, v)
    retained = spec.sink_frames + spec.window_frames
    while len(frames) < retained + fpb:  # past the window: eviction has happened
        k = torch.randn(heads, block, head_size, generator=gen).to(dtype)
        v = torch.randn(heads, block, head_size, generator=gen).to(dtype)
        contexts = state.get_kv_caches("main", seq_len=block, commit_current=True)
        contexts[0].attend(k, k, v)
        state.commit("main")
        frames.extend((k[:, f * tpf : (f + 1) * tpf], v[:, f * tpf : (f + 1) * tpf]) for f in range(fpb))
    assert state.adapter("main").num_resident_frames == retained, "window not full"
    visible = frames[: spec.sink_frames] + frames[len(frames) - spec.window_frames :]
    q = torch.randn(heads, block, head_size, generator=gen).to(dtype)
    k = torch.randn(heads, block, head_size, generator=gen).to(dtype)
    v = torch.randn(heads, block, head_size, generator=gen).to(dtype)
    keys = torch.cat([fk for fk, _ in visible] + [k], dim=1)[None].contiguous()  # (1, H, S, D)
    values = torch.cat([fv for _, fv in visible] + [v], dim=1)[None].contiguous()
    return state, block, q, k, v, keys, values


def run(quick: bool = False, *, dtype: torch.dtype = torch.float32) -> dict:
    """Run the benchmark; return ``{id, paged_ms, contiguous_ms, ratio, target, passed, ...}``."""
    geometry = QUICK if quick else FULL
    state, block, q, k, v, keys, values = _setup(geometry, dtype)
    q4 = q[None]  # (1, H, L, D)

    def paged() -> torch.Tensor:
        contexts = state.get_kv_caches("main", seq_len=block, commit_current=False)
        return contexts[0].attend(q, k, v)

    def contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, keys, values)[0]

    max_abs_diff = (paged().float() - contiguous().float()).abs().max().item()
    for _ in range(geometry["warmup"]):
        paged()
        contiguous()

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    paged_ms: list[float] = []
    contiguous_ms: list[float] = []
    for rep in range(geometry["repetitions"]):
        if rep % 2 == 0:
            paged_ms.append(timed(paged))
            contiguous_ms.append(timed(contiguous))
        else:
            contiguous_ms.append(timed(contiguous))
            paged_ms.append(timed(paged))
    ratio = statistics.median(p / c for p, c in zip(paged_ms, contiguous_ms))
    state.close()
    outputs_match = max_abs_diff <= TOLERANCE.get(dtype, LOW_PRECISION_TOLERANCE)
    return {
        "id": "attention",
        "paged_ms": statistics.median(paged_ms),
        "contiguous_ms": statistics.median(contiguous_ms),
        "ratio": ratio,
        "target": TARGET,
        "passed": ratio <= TARGET and outputs_match,
        "measured": f"{statistics.median(paged_ms):.2f} ms paged",
        "baseline": f"{statistics.median(contiguous_ms):.2f} ms contiguous",
        "clock": "wall",
        "quick": quick,
        "repetitions": geometry["repetitions"],
        "visible_tokens": keys.shape[2],
        "query_tokens": block,
        "geometry": {key: geometry[key] for key in ("num_heads", "head_size", "tokens_per_frame",
                                                     "frames_per_block", "sink_frames", "window_frames")},
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "max_abs_diff": max_abs_diff,
        "outputs_match": outputs_match,
    }


def main(argv: list[str] | None = None) -> int:
    return cli(run, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
