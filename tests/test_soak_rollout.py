"""A rollout left running for hours: what it holds in memory must not grow with the number of steps run.

Each test measures a structure's size or the Python heap's peak (tracemalloc) on a real run, never time.
"""

from __future__ import annotations

import json
import tracemalloc

import pytest
from fast_run import rollout, runner, write_fast_data

from ardiff_cli.app import app


@pytest.fixture(autouse=True)
def _env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "soak-rollout-cache"))


def test_resume_and_summary_of_a_long_run_never_hold_its_results_lines(tmp_path):
    """--resume reads results.jsonl for the steps done, and every run's end reads it again for summary.json.
    100,000 lines held as dicts took 220 MiB of Python heap (and the process's RSS kept it: 19 -> 426 MiB)."""
    data = write_fast_data(tmp_path, {"arm": 3})
    out = tmp_path / "run"
    assert rollout(data, out).exit_code == 0
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


def test_a_finished_episode_leaves_nothing_per_step_behind(tmp_path, monkeypatch):
    """The SHA-256 of every step that ran is kept to check replays; once its episode ended none is replayed, so
    over a folder of many episodes the run holds the digests of the live ones only (was 200 bytes per step run)."""
    import ardiff_cli.rollout as rollout_module

    data = write_fast_data(tmp_path, {f"arm_{i}": 6 for i in range(4)})
    drivers, real_run = [], rollout_module.Rollout.run
    monkeypatch.setattr(rollout_module.Rollout, "run", lambda self: drivers.append(self) or real_run(self))
    held = []  # digests held when each step starts
    real_step = rollout_module.Rollout._run_step
    monkeypatch.setattr(rollout_module.Rollout, "_run_step", lambda self, task: held.append(
        sum(map(len, self._digests.values()))) or real_step(self, task))
    result = rollout(data, tmp_path / "run", "--order", "sequential")
    assert result.exit_code == 0, result.output
    assert drivers[0].stats.steps == 24
    assert max(held) <= 6, f"{max(held)} digests held for episodes of 6 steps"  # was 23 at the last step
    assert sum(map(len, drivers[0]._digests.values())) == 0
