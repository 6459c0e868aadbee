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
    monkeypatch.setattr(RunFolder, "iter_records",
                        lambda self, *args: reads.__setitem__(0, reads[0] + 1) or real_iter(self, *args))
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


def test_a_followed_run_lets_go_of_its_finished_episodes_step_files(tmp_path, monkeypatch):
    """A --follow run for days: each finished (or failed) episode's step files, the names its folder held at END
    and its done steps stayed in the scheduler for the rest of the run, about 350 bytes per step (350 MB at a
    million steps). What the run keeps of an ended episode no longer grows with those; its preview is still drawn."""
    import numpy as np

    import ardiff_cli.rollout as rollout_module
    from ardiff_cli.io import write_step
    from ardiff_cli.io.demo import demo_step
    from pipelines.dreamzero import observation_schema

    data = write_fast_data(tmp_path, {f"arm_{i}": 4 for i in range(3)})
    bad = demo_step(observation_schema(), (16, 16), 2, 2, 4)
    bad["joint_position"] = np.zeros(5, np.float32)
    write_step(data / "eps" / "arm_2", 2, bad)  # arm_2 fails at its step 2
    for i in range(3):
        (data / "eps" / f"arm_{i}" / "END").write_text("")
    drivers, real_run = [], rollout_module.Rollout.run
    monkeypatch.setattr(rollout_module.Rollout, "run", lambda self: drivers.append(self) or real_run(self))
    held = []  # per step, what the ended episodes' tracks hold: step files, names at END, done steps
    real_step = rollout_module.Rollout._run_step

    def step(self, task):
        ended = [t for t in self.scheduler._tracks if t.ended and t.source.name != task.episode.name]
        held.append(sum(len(t.files) + len(t.end_seen[1] if t.end_seen else ()) + len(t.done) for t in ended))
        real_step(self, task)

    monkeypatch.setattr(rollout_module.Rollout, "_run_step", step)
    out = tmp_path / "run"
    result = rollout(data, out, "--follow", "--idle-timeout", "0.3", "--order", "sequential", "--preview")
    assert result.exit_code == 4, result.output
    scheduler = drivers[0].scheduler
    assert [t.ended for t in scheduler._tracks] == [True] * 3
    left = sum(len(t.files) + len(t.end_seen[1] if t.end_seen else ()) for t in scheduler._tracks)
    assert max(held) == 0 and left == 0, f"ended episodes hold {max(held)} entries at a step, {left} at the end"
    assert sorted(p.name for p in (out / "previews").iterdir()) == ["arm_0.png", "arm_1.png"]
    assert [scheduler.history(f"arm_{i}") for i in range(3)] == [[], [], []]


def test_the_summary_of_a_million_step_run_holds_a_few_bytes_per_step(tmp_path):
    """summary.json's counts and latency percentiles need every ok line's step and latencies: held as a set of
    (episode, step) tuples and two lists of float objects they peaked at 264 bytes per line (264 MB for a million
    steps); per episode sets of steps and arrays of doubles, 147. The numbers are those of every latency, sorted."""
    import random

    from ardiff_cli.io.run import build_summary

    n, rng = 50_000, random.Random(3)
    latencies = [(rng.random() / 10, rng.random() / 20) for _ in range(n)]
    lines = ({"episode": f"ep{i % 50}", "step": i // 50, "status": "ok", "evictions": 0,
              "latency": {"total_s": total, "forward_s": forward}} for i, (total, forward) in enumerate(latencies))
    tracemalloc.start()
    try:
        summary = build_summary(lines, episodes=[f"ep{i}" for i in range(50)], failed={}, info={}, plan=None,
                                this_run={}, wall_s=1.0, running_s=1.0, status="ok", exit_code=0, root=tmp_path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200 * n, f"{peak // n} bytes per ok line"
    totals = sorted(total for total, _ in latencies)
    assert summary["latency_s"]["total"] == {"count": n, "p50": totals[n // 2 - 1], "p90": totals[n * 9 // 10 - 1],
                                             "p99": totals[n * 99 // 100 - 1], "mean": sum(totals) / n,
                                             "max": totals[-1]}
    assert summary["steps"]["ok"] == n and set(summary["episodes"]["steps"].values()) == {n // 50}
