"""A rollout left running for hours: what it holds in memory must not grow with the number of steps run.

Each test measures a structure's size or the Python heap's peak (tracemalloc) on a real run, never time.
"""

from __future__ import annotations

import json
import tracemalloc

import pytest
from typer.testing import CliRunner

from ardiff_cli.app import app
from ardiff_cli.io import write_episode
from ardiff_cli.io.demo import demo_step

runner = CliRunner()
FAST_CONFIG = """\
pipeline: dreamzero
model: {preset: tiny, num_inference_steps: 1, guidance_scale: 1.0}
runtime: {device: cpu, session_capacity: 2}
"""


@pytest.fixture(autouse=True)
def _env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "soak-rollout-cache"))


def _data(root, episodes: dict[str, int]):
    from pipelines.dreamzero import observation_schema

    (root / "fast.yaml").write_text(FAST_CONFIG)
    for i, (name, n) in enumerate(episodes.items()):
        steps = [demo_step(observation_schema(), (16, 16), i, s, 1 if s == 0 else 4) for s in range(n)]
        write_episode(root / "eps" / name, steps, prompt=f"task {name}")
    return root


def _rollout(data, out, *extra):
    return runner.invoke(app, ["rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(out),
                               "--no-warmup", "--format", "plain", *extra])


def test_resume_and_summary_of_a_long_run_never_hold_its_results_lines(tmp_path):
    """--resume reads results.jsonl for the steps done, and every run's end reads it again for summary.json.
    100,000 lines held as dicts took 220 MiB of Python heap (and the process's RSS kept it: 19 -> 426 MiB)."""
    data = _data(tmp_path, {"arm": 3})
    out = tmp_path / "run"
    assert _rollout(data, out).exit_code == 0
    lines = (out / "results.jsonl").read_text().splitlines()
    n = 20_000  # an overnight run's lines: the same three steps again and again (each ran again on a resume)
    (out / "results.jsonl").write_text("".join(lines[i % 3] + "\n" for i in range(n)))

    tracemalloc.start()
    try:
        result = runner.invoke(app, ["rollout", "--resume", "--out", str(out), "--no-warmup", "--format", "plain"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"]["ok"] == 3 and summary["steps"]["skipped_done"] == 3
    assert summary["latency_s"]["total"]["count"] == n
    held = len((out / "results.jsonl").read_bytes())  # 8 MiB of text; as dicts, 44 MiB
    assert peak < held, f"the resume's Python heap peaked at {peak >> 20} MiB for {held >> 20} MiB of results lines"
