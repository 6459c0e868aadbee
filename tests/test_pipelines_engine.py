"""Both pipelines through ARDiffusionEngine / ARDiffusionModelRunner: warmup, LRU eviction, reset, close."""

from __future__ import annotations

import json

import pytest

from ardiff_cli.runtime.engine import ARDiffusionEngine
from ardiff_cli.runtime.errors import ObservationError
from ardiff_cli.runtime.request import ARDiffusionRequest
from pipeline_helpers import CONFIGS

pytestmark = pytest.mark.usefixtures("single_thread", "ardiff_cache")


def engine_for(name: str) -> tuple[ARDiffusionEngine, list]:
    engine = ARDiffusionEngine.from_config(CONFIGS / f"{name}.yaml", device="cpu", memory_budget="1GiB")
    events: list = []
    engine.subscribe(events.append)
    engine.load()
    return engine, events


def test_dreamzero_warmup_demo_eviction_and_reset():
    engine, events = engine_for("dreamzero-tiny")
    pipe = engine.pipeline
    assert engine.runner.capacity_plan.session_capacity == 2
    assert engine.runner.capacity_plan.model_owned_bytes_per_session == pipe.ar_diffusion_kv_cache_spec(
    ).model_owned_state_bytes_per_session

    report = engine.warmup()
    assert not report.skipped and report.restored
    shapes = [shape for _, shape, _ in report.timings]
    assert len(shapes) == 5  # one one-frame request, three four-frame requests fill the 4-frame window, one restarts it
    assert "exterior_image_0 (16, 16, 3)" in shapes[0]
    assert all("exterior_image_0 (4, 16, 16, 3)" in s for s in shapes[1:])
    usage = engine.runner.pool_usage()
    assert usage.num_free == usage.num_pages and pipe.sessions == {}

    # A 3-episode demo with capacity 2: round-robin steps evict the least recently used episode each time.
    for step in range(3):
        for episode in range(3):
            inputs = pipe.example_inputs(1 if step == 0 else 4, prompt=f"task {episode}", seed=10 * episode + step)
            out = engine.execute(ARDiffusionRequest(f"{episode}:{step}", inputs, {"session_id": f"ep{episode}"}))
            assert out["actions"].shape == (8, 8)
    evicted = [e.session_id for e in events if e.kind == "session_evicted"]
    assert evicted[:3] == ["ep0", "ep1", "ep2"]
    assert len(engine.runner.sessions()) == 2 and set(pipe.sessions) == set(engine.runner.session_ids)
    for view in engine.runner.sessions():
        assert view.committed_frames == {"positive": 1, "negative": 1}  # evicted, then fresh on a four-frame step

    inputs = pipe.example_inputs(4, prompt="task 2", seed=99)
    engine.execute(ARDiffusionRequest("reset", inputs, {"session_id": "ep2", "reset": True}))
    assert any(e.kind == "session_reset" and e.session_id == "ep2" for e in events)
    engine.close()
    usage = engine.runner.pool_usage()
    assert usage.num_free == usage.num_pages and pipe.sessions == {}


def test_causal_world_warmup_and_rollout():
    engine, events = engine_for("causal-world-tiny")
    pipe = engine.pipeline
    report = engine.warmup()
    assert len(report.timings) == 4 and report.restored  # sink 3 + window 6 = 3 blocks, plus one that slides
    for block in range(5):
        out = engine.execute(ARDiffusionRequest(f"b{block}", pipe.example_inputs(seed=block), {"session_id": "w"}))
    assert out["latents"].shape == (4, 3, 8, 8)
    (view,) = engine.runner.sessions()
    assert view.committed_frames == {"main": 15} and view.pages_per_branch == {"main": 9}
    engine.execute(ARDiffusionRequest("last", pipe.example_inputs(seed=9), {"session_id": "w", "close_session": True}))
    assert engine.runner.sessions() == [] and pipe.sessions == {}
    engine.close()


@pytest.mark.parametrize("problem", ["missing joint_position", "two frames", "a prompt that is no text"])
def test_a_request_with_bad_inputs_is_refused_and_the_session_kept(problem):
    engine, events = engine_for("dreamzero-tiny")
    pipe = engine.pipeline
    engine.execute(ARDiffusionRequest("ok", pipe.example_inputs(1), {"session_id": "s"}))
    before = engine.runner.sessions()
    if problem == "two frames":  # the schema takes any number: the pipeline's own check refuses it
        bad, match = pipe.example_inputs(2), "cameras carry 2 frames; expected 1 .* or 4"
    elif problem == "a prompt that is no text":
        # what json.loads gives for a JSON client's "\udcff": the forward's tokenizer raised UnicodeEncodeError,
        # and the session was released with the failed forward
        bad = pipe.example_inputs(4, prompt=json.loads('"pick \\udcff up"'))
        match = r"prompt 'prompt' holds '\\udcff' at position 5, a lone surrogate"
    else:
        bad, match = pipe.example_inputs(4), "missing 'joint_position'"
        bad.pop("joint_position")
    with pytest.raises(ObservationError, match=match) as info:  # typed: the CLI's exit 2
        engine.execute(ARDiffusionRequest("bad", bad, {"session_id": "s"}))
    assert info.value.exit_code == 2
    assert engine.runner.sessions() == before and list(pipe.sessions) == ["s"]
    assert [e.kind for e in events if e.kind.startswith("session_")] == ["session_admitted"]
    engine.close()
