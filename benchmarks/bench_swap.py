"""swap: two sessions taking turns on one session slot (every request restores one and swaps the other out) vs both
resident, and the swap file written in the background vs on the request's path.

The DreamZero geometry of ``bench_resume`` (``small``, 12-frame window, 2 CFG
branches, 4 sampling steps), two sessions, requests alternating between
them. DreamZero restarts a full window (``reset_at_window``), so over the
timed requests a session holds 1 to 12 frames (6.5 on average), and so does
each snapshot restored and written. Three engines get the same requests:

- ``resident``: ``session_capacity=2``; both sessions stay resident.
- ``swap`` (the runtime): ``session_capacity=1`` with a swap folder: each request
  restores its session from its snapshot and evicts the other, whose file is
  written by the store's background thread while the next request computes.
- ``swap_sync`` (the baseline: how the runtime swapped before its writes went to
  the background): the same, but each request also waits for its eviction's file.

Each contender runs blocks of consecutive requests, timed whole; a block ends
by waiting for the last file, so no write is hidden in another contender's
block. Blocks change order every repetition (``turn_order``). Wall clock: a background write
overlaps the next request on another core, which CPU time (all threads) would
count as if it did not. All three must return bit-identical outputs. Reported,
no target: ``ratio`` = swap/resident per request (what swapping costs at
capacity 1), ``sync_over_async`` = swap_sync/swap (what the background write
saves), and the snapshot's bytes.

    python -m benchmarks.bench_swap            # dreamzero "small" geometry, blocks of 8 requests, 6 repetitions
    python -m benchmarks.bench_swap --quick    # tiny model, 2 repetitions
"""

from __future__ import annotations

import statistics
import sys
import tempfile

import torch

from benchmarks.common import attention_backend, check_swapped, cli, swap_failures, timed, turn_order

WINDOW_FRAMES = 12
SESSIONS = ("robot-a", "robot-b")
FULL = dict(model={"preset": "small", "window_frames": WINDOW_FRAMES, "sink_frames": 0}, block=8, repetitions=6)
QUICK = dict(model={"preset": "tiny", "window_frames": WINDOW_FRAMES, "sink_frames": 0}, block=2, repetitions=2)


def build(model_overrides: dict, swap_root: str):
    """The pipeline (fresh weights) and its three runners: resident, swap and swap_sync."""
    from ardiff_cli.runtime.runner import ARDiffusionModelRunner
    from pipelines.dreamzero import Config, pipeline_class

    config = Config.from_dict(model_overrides, where="bench_swap")
    pipe = pipeline_class().fresh(config)

    def runner(capacity: int, swap_dir: str | None):
        r = ARDiffusionModelRunner(pipe, device="cpu", dtype=pipe.dtype, memory_budget=1 << 30,
                                   session_capacity=capacity, attention_backend=attention_backend(), swap_dir=swap_dir,
                                   swap_space=None if swap_dir is None else 1 << 30)
        r.load()
        return r

    return config, pipe, {"resident": runner(2, None), "swap": runner(1, f"{swap_root}/swap"),
                          "swap_sync": runner(1, f"{swap_root}/swap_sync")}


def run(quick: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="ardiff-bench-swap-") as swap_root:
        return _run(quick, swap_root)


def _run(quick: bool, swap_root: str) -> dict:
    from ardiff_cli.runtime.request import ARDiffusionRequest

    geometry = QUICK if quick else FULL
    config, pipe, runners = build(geometry["model"], swap_root)
    failures = [swap_failures(runners[name]) for name in ("swap", "swap_sync")]

    def inputs(seed: int) -> dict:
        frames = 1 if seed < len(SESSIONS) else config.frames_per_request  # each session starts with one frame
        return pipe.example_inputs(frames, prompt="put the red block in the bowl", seed=seed)

    def request(name: str, number: int, payload: dict):
        # the runners share the pipeline, which keeps a record per session id: each runner has ids of its own
        session = f"{name}:{SESSIONS[number % len(SESSIONS)]}"
        return runners[name].execute_model(ARDiffusionRequest(f"{session}/{number}", payload,
                                                              {"session_id": session}))

    def block(name: str, first: int, payloads: list[dict]) -> list[dict]:
        runner = runners[name]
        outputs = []
        for offset, payload in enumerate(payloads):
            outputs.append(request(name, first + offset, payload))
            if name == "swap_sync":
                runner.swap.flush()  # the eviction's file written before the request returns
        if runner.swap is not None:
            runner.swap.flush()  # the block's last file: not left to overlap the next contender's block
        return outputs

    # Untimed: fill both sessions' windows once, and warm every path up (the timed requests then restart them).
    history = [inputs(seed) for seed in range(2 * WINDOW_FRAMES)]
    for name in runners:
        block(name, 0, history)
    turn = len(history)  # the next request's number: every runner gets the same inputs for it
    times: dict[str, list[float]] = {name: [] for name in runners}
    identical = True
    names = list(runners)
    for rep in range(geometry["repetitions"]):
        payloads = [inputs(turn + k) for k in range(geometry["block"])]
        outputs = {}
        for name in turn_order(names, rep):
            outputs[name], timing = timed(lambda: block(name, turn, payloads))
            times[name].append(timing.wall / len(payloads))
        turn += len(payloads)
        identical &= all(torch.equal(a[key], b[key]) for other in ("swap", "swap_sync")
                         for a, b in zip(outputs[other], outputs["resident"]) for key in a)
    usage = runners["swap"].pool_usage()
    for runner in runners.values():
        runner.close()
    for failed in failures:
        check_swapped(failed, swap_root)

    ratio = statistics.median(s / r for s, r in zip(times["swap"], times["resident"]))
    sync_over_async = statistics.median(y / s for y, s in zip(times["swap_sync"], times["swap"]))
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return {
        "id": "swap",
        "target": "report (swap/resident; swap_sync/swap)",
        "passed": bool(identical),  # no speed threshold: the figures are the result
        "measured": f"{ms['swap']:.1f} ms/request swapping, {ms['swap_sync']:.1f} ms with the write on its path "
                    f"({sync_over_async:.2f}x)",
        "baseline": f"{ms['resident']:.1f} ms/request resident",
        "ratio": ratio,
        "sync_over_async": sync_over_async,
        **{f"{name}_ms": value for name, value in ms.items()},
        "snapshot_bytes": usage.swapped_bytes,
        "outputs_identical": identical,
        "clock": "wall",
        "block": geometry["block"],
        "repetitions": geometry["repetitions"],
        "window_frames": WINDOW_FRAMES,
        "attention_backend": runners["swap"].attention_backend,
        "threads": torch.get_num_threads(),
        "quick": quick,
    }


if __name__ == "__main__":
    sys.exit(cli(run, __doc__, attention=True))
