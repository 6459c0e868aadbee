"""A rollout left running for hours: what it holds in memory must not grow with the number of steps run, nor what
a step costs with the number of episodes or resident sessions.

Each test measures a structure's size, the Python heap's peak (tracemalloc) or the calls a step makes on a real run,
never time.
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


def test_a_steps_progress_update_looks_at_its_own_episode_only(tmp_path, monkeypatch):
    """A folder of 1,000 episodes: after every step the progress of every episode was set again, each looked up
    among all of them (12.6 ms of overhead per step at 1,000 episodes, 0.7 ms at 10). Now one episode per step;
    the progress total shown stays steps done plus steps left, through a failed episode."""
    import numpy as np

    import ardiff_cli.rollout as rollout_module
    from ardiff_cli.io import write_step
    from ardiff_cli.io.demo import demo_step
    from ardiff_cli.monitor import RunMonitor
    from pipelines.dreamzero import observation_schema

    n = 5  # (the demo's colours hold 5 episodes)
    data = write_fast_data(tmp_path, {f"arm_{i}": 2 for i in range(n)})
    bad = demo_step(observation_schema(), (16, 16), 3, 1, 4)
    bad["joint_position"] = np.zeros(5, np.float32)
    write_step(data / "eps" / "arm_3", 1, bad)  # arm_3 fails at its last step
    updates, real_set = [0], RunMonitor.set_episode
    monkeypatch.setattr(RunMonitor, "set_episode",
                        lambda self, *args: updates.__setitem__(0, updates[0] + 1) or real_set(self, *args))
    totals, real_show = [], rollout_module.Rollout._show_progress

    def show(self, *args, **kwargs):
        real_show(self, *args, **kwargs)
        totals.append((self.monitor.snapshot().steps_total, self.stats.steps + self.scheduler.num_pending()))

    monkeypatch.setattr(rollout_module.Rollout, "_show_progress", show)
    result = rollout(data, tmp_path / "run")
    assert result.exit_code == 4, result.output
    assert len(totals) == 1 + 2 * n  # the start, then each step (the failed one included)
    assert updates[0] == n + 2 * n, f"{updates[0]} episode updates for {2 * n} steps of {n} episodes"  # was 55
    assert [shown for shown, _ in totals] == [expected for _, expected in totals]
    assert totals[0][0] == 2 * n and totals[-1][0] == 2 * n - 1


def test_a_step_builds_no_row_for_each_resident_session_when_nothing_draws_them(tmp_path, monkeypatch):
    """With a small model hundreds of sessions are resident: after every step (and every replayed one) a row was
    built for each of them, in every format, though only the live display (4 times a second) shows them (1,000
    resident sessions: 3 ms per step). Rows are built when a snapshot is taken, and show the same."""
    import ardiff_cli.monitor as monitor_module

    built, real_row = [0], monitor_module.SessionRow
    monkeypatch.setattr(monitor_module, "SessionRow",
                        lambda *args, **kwargs: built.__setitem__(0, built[0] + 1) or real_row(*args, **kwargs))
    in_refresh, shown, real_refresh = [0], [], monitor_module.RunMonitor.refresh

    def refresh(self, runner):
        before = built[0]
        real_refresh(self, runner)
        in_refresh[0] += built[0] - before
        rows = self.snapshot().sessions  # what the live display would draw now
        assert [r.session_id for r in rows] == runner.session_ids
        shown.extend((r.session_id, r.steps_done, r.steps_total) for r in rows)

    monkeypatch.setattr(monitor_module.RunMonitor, "refresh", refresh)
    data = write_fast_data(tmp_path, {f"arm_{i}": 2 for i in range(3)})
    result = rollout(data, tmp_path / "run", "--session-capacity", "3")
    assert result.exit_code == 0, result.output
    assert in_refresh[0] == 0, f"{in_refresh[0]} session rows built after steps"
    assert ("arm_0", 1, 2) in shown and ("arm_2", 1, 2) in shown  # session, steps done and total, as before


def test_previews_read_the_results_lines_once_not_once_per_episode(tmp_path, monkeypatch):
    """--preview drew each episode from results.jsonl, read whole for every episode that ended: 1,000 episodes of
    5 steps parsed 5,000,000 lines (3.6 ms more per step than without --preview, 0.3 ms at 100 episodes). A run
    now reads it for the previews once, at the start (the lines of earlier runs, on --resume), and for the
    summary; each preview is what it was."""
    from ardiff_cli.io.run import RunFolder

    reads, real_iter = [0], RunFolder.iter_records
    monkeypatch.setattr(RunFolder, "iter_records", lambda self: reads.__setitem__(0, reads[0] + 1) or real_iter(self))
    data = write_fast_data(tmp_path, {f"arm_{i}": 2 for i in range(4)})
    out = tmp_path / "run"
    result = rollout(data, out, "--preview")
    assert result.exit_code == 0, result.output
    assert reads[0] == 2, f"results.jsonl read {reads[0]} times for 4 episodes"  # was 5: once per episode, summary
    previews = {p.name: p.read_bytes() for p in (out / "previews").iterdir()}
    assert len(previews) == 4

    # A step whose output went missing runs again on --resume: its episode has two ok lines for it, and the preview
    # draws each step once, in step order, earlier runs' lines included: the picture of an uninterrupted run (it
    # used to draw step 0 again after step 1).
    (out / "episodes" / "arm_1" / "step_000000.safetensors").unlink()
    reads[0] = 0
    result = runner.invoke(app, ["rollout", "--resume", "--out", str(out), "--no-warmup", "--format", "plain"])
    assert result.exit_code == 0, result.output
    assert reads[0] == 3  # resume's done steps, the previews' earlier lines, the summary
    again = {p.name: p.read_bytes() for p in (out / "previews").iterdir()}
    assert again == previews
