"""capacity: bytes the planner predicts for N sessions vs bytes actually allocated.

For each N, an engine on a built-in config is loaded with ``session_capacity=N``
and N sessions are driven until every window is full and every cross-attention
cache is populated (the warmup convention of each pipeline). Then:

- ``planned`` = ``capacity_plan.required_bytes(N)`` (the pure planner, no torch);
- ``actual`` = the sum of the storage sizes of every tensor alive in the process
  (found by the garbage collector) that was not alive before the engine was made,
  the model's weights excepted. It is split into the KV pools (``kv_cache.pool``:
  pages, scratch and gather workspace), each session's cross-attention K/V, the
  pipeline's own per-session tensors (DreamZero keeps an anchor latent per
  session) and ``other``: whatever else is held, which the plan does not count.
  Storages are counted once each, by their storage pointer, so a view can never
  be counted twice.

Target: ``|planned - actual| / actual <= 1%`` for every N on every config.

    python -m benchmarks.bench_capacity            # dreamzero-tiny (fp32, bf16), causal-world-tiny; N = 1, 2, 4, 8
    python -m benchmarks.bench_capacity --quick    # dreamzero-tiny, N = 1, 2
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import warnings

import torch

from benchmarks.common import cli, private_cache

TARGET = 0.01
FULL = dict(configs=(("dreamzero-tiny", "float32"), ("dreamzero-tiny", "bfloat16"), ("causal-world-tiny", "float32")),
            sessions=(1, 2, 4, 8))
QUICK = dict(configs=(("dreamzero-tiny", "float32"),), sessions=(1, 2))


def _storages(tensors) -> dict[int, int]:
    """Storage pointer -> storage bytes, for every tensor given."""
    out: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    return out


def live_tensors() -> list[torch.Tensor]:
    """Every strided tensor alive in this process off the meta device (the garbage collector tracks them all)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every object touches deprecated module attributes
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and o.layout == torch.strided and o.device.type != "meta"]


def actual_bytes(engine) -> dict[str, int]:
    """Bytes of tensor storage held by the pools, the sessions' cross-attention caches and the pipeline's records."""
    runner, pipe = engine.runner, engine.pipeline
    pool = runner.kv_cache.pool
    pool_tensors = [value for value in vars(pool).values() if isinstance(value, torch.Tensor)]
    seen = _storages(pool_tensors)
    pool_bytes = sum(seen.values())
    assert pool_bytes == pool.nbytes, f"pool tensors hold {pool_bytes} bytes but pool.nbytes says {pool.nbytes}"
    cross_bytes = model_bytes = 0
    for session_id in runner.session_ids:
        # read-only look at the runner's table: its states refuse the forward's reads outside a request
        for pairs in runner._sessions[session_id].state._cross.values():
            new = {k: v for k, v in _storages(t for pair in pairs for t in pair).items() if k not in seen}
            seen.update(new)
            cross_bytes += sum(new.values())
        record = pipe.sessions.get(session_id)
        if record is not None:
            tensors = [getattr(record, f.name) for f in dataclasses.fields(record)]
            new = {k: v for k, v in _storages(t for t in tensors if isinstance(t, torch.Tensor)).items()
                   if k not in seen}
            seen.update(new)
            model_bytes += sum(new.values())
    return {"pool": pool_bytes, "cross_attention": cross_bytes, "model_owned": model_bytes,
            "total": pool_bytes + cross_bytes + model_bytes}


def fill_sessions(engine, num_sessions: int) -> None:
    """Drive every session through the pipeline's warmup sequence until its window is full, every cache populated
    (DreamZero's sequence goes on with one request that restarts the window: it is not run here)."""
    from ardiff_cli.runtime.request import ARDiffusionRequest

    pipe, runner = engine.pipeline, engine.runner
    plan = runner.capacity_plan
    full = plan.managed_pages_per_session // plan.num_local_branches
    for index in range(num_sessions):
        session_id = f"session-{index}"
        for step, request in enumerate(pipe.ar_diffusion_warmup_requests(session_id)):
            inputs = dict(request.inputs, prompt=f"task {index}")
            engine.execute(ARDiffusionRequest(f"{session_id}/{step}", inputs, {"session_id": session_id}))
            (view,) = [view for view in runner.sessions() if view.session_id == session_id]
            if all(pages == full for pages in view.pages_per_branch.values()):
                break


def measure(config: str, dtype: str, num_sessions: int) -> dict:
    from ardiff_cli.runtime.engine import ARDiffusionEngine

    before = live_tensors()  # held until the count: no storage of theirs can be freed and its address reused
    engine = ARDiffusionEngine.from_config(config, device="cpu", dtype=dtype, memory_budget="4GiB",
                                           session_capacity=num_sessions, attention_backend="torch",
                                           num_threads=torch.get_num_threads())  # the config's own is 1
    plan = engine.load()
    assert plan.session_capacity == num_sessions, f"{config}: {num_sessions} sessions do not fit the 4 GiB budget"
    fill_sessions(engine, num_sessions)
    views = engine.runner.sessions()
    assert len(views) == num_sessions, f"{len(views)} resident sessions, expected {num_sessions}"
    full = all(n == plan.managed_pages_per_session // plan.num_local_branches for v in views
               for n in v.pages_per_branch.values())
    actual = actual_bytes(engine)
    modules = engine.pipeline.modules
    known = {**_storages(before), **_storages([*modules.parameters(), *modules.buffers()])}
    live = {k: v for k, v in _storages(live_tensors()).items() if k not in known}
    del before
    actual["other"] = sum(live.values()) - actual["total"]
    actual["total"] = sum(live.values())
    planned = plan.required_bytes(num_sessions)
    engine.close()
    return {"config": config, "dtype": dtype, "sessions": num_sessions, "planned_bytes": planned,
            "actual_bytes": actual["total"],
            "actual": actual, "error": abs(planned - actual["total"]) / actual["total"], "windows_full": full}


def run(quick: bool = False) -> dict:
    geometry = QUICK if quick else FULL
    with private_cache():
        rows = [measure(config, dtype, n) for config, dtype in geometry["configs"] for n in geometry["sessions"]]
    worst = max(rows, key=lambda row: row["error"])
    return {
        "id": "capacity",
        "target": f"|planned - actual| / actual <= {TARGET:.0%}",
        "passed": bool(worst["error"] <= TARGET and all(row["windows_full"] for row in rows)),
        "measured": f"{worst['planned_bytes']} B planned ({worst['config']} {worst['dtype']}, N={worst['sessions']})",
        "baseline": f"{worst['actual_bytes']} B allocated",
        "ratio": worst["planned_bytes"] / worst["actual_bytes"],
        "max_error": worst["error"],
        "rows": rows,
        "threads": torch.get_num_threads(),
        "quick": quick,
    }


if __name__ == "__main__":
    sys.exit(cli(run, __doc__))
