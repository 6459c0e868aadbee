"""churn: requests per second with 64 session ids under Zipf access at capacity 4 vs unlimited capacity.

One request sequence (64 session ids ``robot-1`` .. ``robot-64``, drawn with
probability proportional to ``rank ** -1.1``, seeded) runs on two engines of
the default config (dreamzero-tiny, same weights), request by request,
interleaved (the order alternates every request):

- ``capacity 4``: ``session_capacity=4``; a request for a non-resident
  session evicts the least recently used one and starts that session fresh
  (re-anchored, caches re-projected).
- ``unlimited``: ``session_capacity=64`` with a memory budget that fits all
  64: after its first request a session is never evicted.

A session's first request in the sequence carries one camera frame, every
later one four; both engines get identical inputs. Until capacity 4 first
evicts a session, both engines run the same requests of it on the same
history: their outputs must be equal (checked, ``outputs_match``). Reported: the hit rate
(requests that found their session resident) of each engine, and the ratio
of requests per second capacity-4 / unlimited (CPU time). No target: report.

    python -m benchmarks.bench_churn            # 600 requests
    python -m benchmarks.bench_churn --quick    # 30 requests
"""

from __future__ import annotations

import statistics
import sys

import numpy as np
import torch

from benchmarks.common import cli, private_cache, timed

NUM_SESSIONS = 64
ZIPF_S = 1.1
CAPACITY = 4
FULL = dict(requests=600)
QUICK = dict(requests=30)


def zipf_sequence(num_requests: int) -> list[int]:
    """Session ranks 1..NUM_SESSIONS drawn with probability proportional to rank ** -ZIPF_S, seeded (0)."""
    weights = np.arange(1, NUM_SESSIONS + 1, dtype=np.float64) ** -ZIPF_S
    rng = np.random.default_rng(0)
    ranks = rng.choice(np.arange(1, NUM_SESSIONS + 1), size=num_requests, p=weights / weights.sum())
    return [int(rank) for rank in ranks]


def make_engine(session_capacity: int):
    from ardiff_cli.runtime.engine import ARDiffusionEngine

    engine = ARDiffusionEngine.from_config("dreamzero-tiny", device="cpu", session_capacity=session_capacity,
                                           memory_budget="1GiB", attention_backend="torch",
                                           num_threads=torch.get_num_threads())  # the config's own is 1
    plan = engine.load()
    assert plan.session_capacity == session_capacity, f"capacity {plan.session_capacity}, asked {session_capacity}"
    admitted: list[str] = []
    engine.subscribe(lambda event: admitted.append(event.session_id) if event.kind == "session_admitted" else None)
    engine.warmup()
    admitted.clear()
    return engine, admitted


def run(quick: bool = False) -> dict:
    from ardiff_cli.runtime.request import ARDiffusionRequest

    geometry = QUICK if quick else FULL
    with private_cache():
        engines = {"capacity_4": make_engine(CAPACITY), "unlimited": make_engine(NUM_SESSIONS)}
    pipe = engines["unlimited"][0].pipeline
    sequence = zipf_sequence(geometry["requests"])
    seen: set[int] = set()
    requests = []
    for index, rank in enumerate(sequence):
        frames = 1 if rank not in seen else pipe.config.frames_per_request
        seen.add(rank)
        inputs = pipe.example_inputs(frames, prompt=f"robot {rank} task", seed=index)
        requests.append(ARDiffusionRequest(f"r{index}", inputs, {"session_id": f"robot-{rank}"}))

    cpu = {name: 0.0 for name in engines}
    wall = {name: 0.0 for name in engines}
    hits = {name: 0 for name in engines}
    hit_cpu: list[float] = []  # capacity-4 requests that found their session resident
    miss_cpu: list[float] = []  # ... and those that (re)started it
    max_abs_diff, compared = 0.0, 0  # outputs of the requests both engines ran on the same history
    order = list(engines)
    for index, request in enumerate(requests):
        outputs = {}
        for name in order if index % 2 == 0 else order[::-1]:
            engine, admitted = engines[name]
            before = len(admitted)
            outputs[name], timing = timed(lambda: engine.execute(request))
            cpu[name] += timing.cpu
            wall[name] += timing.wall
            hit = len(admitted) == before  # no admission: the session was resident
            hits[name] += hit
            if name == "capacity_4":
                (hit_cpu if hit else miss_cpu).append(timing.cpu)
        if engines["capacity_4"][1].count(request.session_id) == 1:  # admitted once: never evicted yet
            compared += 1
            for key, value in outputs["unlimited"].items():
                max_abs_diff = max(max_abs_diff, (outputs["capacity_4"][key] - value).abs().max().item())
    for engine, _ in engines.values():
        engine.close()

    num = len(requests)
    rps = {name: num / seconds for name, seconds in cpu.items()}
    hit_rate = {name: count / num for name, count in hits.items()}
    ratio = rps["capacity_4"] / rps["unlimited"]
    outputs_match = compared > 0 and max_abs_diff <= 1e-5
    return {
        "id": "churn",
        "target": "report hit rate and ratio",
        "passed": outputs_match,  # no speed threshold: the figures are the result
        "measured": f"{rps['capacity_4']:.1f} req/s at capacity {CAPACITY}, hit rate {hit_rate['capacity_4']:.0%}",
        "baseline": f"{rps['unlimited']:.1f} req/s unlimited, hit rate {hit_rate['unlimited']:.0%}",
        "ratio": ratio,
        "hit_rate": hit_rate["capacity_4"],
        "hit_rate_unlimited": hit_rate["unlimited"],
        "requests_per_s": rps,
        "requests_per_s_wall": {name: num / seconds for name, seconds in wall.items()},
        "wall_ratio": (num / wall["capacity_4"]) / (num / wall["unlimited"]),
        "outputs_match": outputs_match,
        "compared_requests": compared,
        "max_abs_diff": max_abs_diff,
        "hit_ms": statistics.median(hit_cpu) * 1e3 if hit_cpu else None,
        "miss_ms": statistics.median(miss_cpu) * 1e3 if miss_cpu else None,
        "requests": num,
        "distinct_sessions": len(seen),
        "session_ids": NUM_SESSIONS,
        "zipf_s": ZIPF_S,
        "capacity": CAPACITY,
        "clock": "cpu",
        "threads": torch.get_num_threads(),
        "quick": quick,
    }


if __name__ == "__main__":
    sys.exit(cli(run, __doc__))
