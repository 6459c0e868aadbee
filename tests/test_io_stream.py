"""Validation against a schema, the step scheduler (orders, follow, resume) and demo generation."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from ardiff_cli.io import write_episode, write_step
from ardiff_cli.io.demo import demo_step, ensure_demo_episodes
from ardiff_cli.io.episode import EpisodeSource, discover_episodes, is_temporary_name, step_number
from ardiff_cli.io.step_file import RawStep, step_sha256
from ardiff_cli.io import stream
from ardiff_cli.io.stream import EpisodeEnded, StepScheduler, StepTask
from ardiff_cli.io.validate import validate_step
from ardiff_cli.runtime.errors import ObservationError
from ardiff_cli.runtime.observation import ObservationField, ObservationSchema
from fake_clock import FakeClock

SCHEMA = ObservationSchema(
    fields=(
        ObservationField("camera", "uint8", ((None, None, 3), (None, None, None, 3)), aliases=("cam_left",)),
        ObservationField("joints", "float32", ((7,),)),
        ObservationField("extra", "float32", ((2,),), required=False),
    ),
    prompt_key="prompt",
    prompt_aliases=("language_instruction",),
)


# the error of a step file under a writer's temporary name still there (its writer killed before the rename)
TEMPORARY_LEFT = ("{}: looks like a writer's temporary file that was never renamed (tempfile's tmpXXXXXXXX name, or "
                  ".tmp, .temp, .part or .partial in its name), not a step file")


def good(step: int = 0) -> dict[str, np.ndarray]:
    return {"camera": np.zeros((8, 8, 3), np.uint8), "joints": np.zeros(7, np.float32) + step}


class _FrozenWall:
    """``stream``'s ``time`` with the wall clock stopped at ``now_ns``: the follower takes a writer's temporary file
    first seen at the idle timeout for one at work if its mtime is within --idle-timeout of the wall clock, real time,
    while these tests' timeouts are a ``FakeClock``'s seconds (2). A machine slow for 2 s between the write and that
    look made the file a stray one and ended its episode early; stopped, every file the test writes is new."""

    def __init__(self, now_ns: int) -> None:
        self.now_ns = now_ns

    def time_ns(self) -> int:
        return self.now_ns

    def __getattr__(self, name: str):
        return getattr(time, name)  # monotonic stays real: the listings' timestamp ticks are real time


@pytest.fixture
def frozen_wall(monkeypatch):
    monkeypatch.setattr(stream, "time", _FrozenWall(time.time_ns()))


def test_valid_step_uses_canonical_keys_and_the_prompt_fallbacks(tmp_path):
    raw = RawStep(arrays={"cam_left": np.zeros((2, 8, 8, 3), np.uint8), "joints": np.zeros(7, np.float64),
                          "timestamp": np.zeros(1)}, metadata={})
    valid = validate_step(raw, SCHEMA, path=tmp_path / "s.npz", episode_metadata={"prompt": "from yaml"})
    assert set(valid.inputs) == {"camera", "joints", "prompt"}
    assert valid.inputs["joints"].dtype == np.float32  # float64 recordings are converted
    assert valid.inputs["prompt"] == "from yaml"
    assert list(valid.warnings) == ["timestamp"] and "'timestamp'" in valid.warnings["timestamp"]
    raw.metadata["language_instruction"] = "from the file"
    assert validate_step(raw, SCHEMA, path=tmp_path / "s.npz",
                         episode_metadata={"prompt": "from yaml"}).inputs["prompt"] == "from the file"


def test_invalid_step_names_path_key_expected_and_got(tmp_path):
    raw = RawStep(arrays={"camera": np.zeros((8, 8, 4), np.uint8), "joints": np.zeros(7, np.int64)}, metadata={})
    with pytest.raises(ObservationError) as info:
        validate_step(raw, SCHEMA, path=tmp_path / "ep" / "step_3.npz", episode_metadata={})
    message = str(info.value)
    assert "step_3.npz" in message
    assert "'camera'" in message and "(8, 8, 4)" in message and "(*, *, 3)" in message
    assert "'joints'" in message and "int64" in message and "float32" in message
    assert "prompt" in message  # missing too: every problem at once


def _following(folder, clock: FakeClock, **kwargs) -> StepScheduler:
    """A follower of the episode folder ``folder`` on ``clock``: idle timeout 2 s, a look each second."""
    return StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=2, poll_interval=1, clock=clock,
                         sleep=clock.sleep, **kwargs)


def _drain(scheduler: StepScheduler) -> list[tuple[str, int]]:
    items = []
    while (item := scheduler.next()) is not None:
        if isinstance(item, StepTask):
            items.append((item.episode.name, item.file.step))
        else:
            items.append((item.episode.name, item.reason))
    return items


def _ran(*steps: int, first: int = 0) -> dict[int, int]:
    """``done`` of an episode whose ``steps`` ran (results.jsonl) when its folder started at step ``first``."""
    return {step: step - first for step in steps}


def _episodes(tmp_path, sizes: dict[str, int]) -> list[EpisodeSource]:
    for name, n in sizes.items():
        write_episode(tmp_path / name, [good(i) for i in range(n)], prompt="p")
    return discover_episodes([tmp_path / name for name in sizes])


@pytest.mark.parametrize("order", ["round-robin", "sequential"])
def test_pending_steps_and_history_while_resuming_with_done_steps_in_between(tmp_path, order):
    """num_pending counts by bisection and history copies only the asked slice: both must equal the plain count."""
    episodes = _episodes(tmp_path, {"a": 7, "b": 4})
    done = {"a": _ran(0, 1, 4, 6), "b": _ran(2)}
    scheduler = StepScheduler(episodes, order=order, done=done)
    handed = {"a": set(), "b": set()}
    while True:
        expected = sum(1 for name, n in (("a", 7), ("b", 4)) for step in range(n)
                       if step not in done[name] and step not in handed[name])
        assert scheduler.num_pending() == expected
        item = scheduler.next()
        if item is None:
            break
        if isinstance(item, StepTask):
            name = item.episode.name
            handed[name].add(item.file.step)
            assert [f.step for f in scheduler.history(name)] == list(range(item.ordinal))
            assert [f.step for f in scheduler.history(name, 2)] == list(range(2, item.ordinal))
    assert handed == {"a": {2, 3, 5}, "b": {0, 1, 3}}


@pytest.mark.parametrize("order", ["round-robin", "sequential"])
def test_handing_out_steps_never_searches_the_other_episodes(tmp_path, order, monkeypatch):
    """A lab's folder of 1,000 episodes: every lookup of an episode by name compared it with the others (the
    rollout looks its episode up at every step), and each step found its turn with list.index, comparing tracks
    field by field. Counted here in comparisons: a step must cost the same for 10 episodes or 10,000."""
    import ardiff_cli.io.stream as stream_module

    compared = [0]

    class Name(str):  # an episode name that counts the comparisons made with it
        __hash__ = str.__hash__

        def __eq__(self, other):
            compared[0] += 1
            return str.__eq__(self, other)

    real_eq = stream_module._Track.__eq__
    monkeypatch.setattr(stream_module._Track, "__eq__",
                        lambda a, b: compared.__setitem__(0, compared[0] + 1) or real_eq(a, b))
    write_episode(tmp_path / "ep", [good(0), good(1)], prompt="p")
    n = 200  # every episode reads the same folder: what is counted is the scheduler's work, not the files
    episodes = [EpisodeSource(name=Name(f"ep_{i}"), path=tmp_path / "ep") for i in range(n)]
    scheduler = StepScheduler(episodes, order=order)
    steps = 0
    while (item := scheduler.next()) is not None:
        if isinstance(item, StepTask):  # what the rollout asks at every step
            steps += 1
            scheduler.history(item.episode.name, 0)
            scheduler.num_known(item.episode.name)
    assert steps == 2 * n
    assert compared[0] == 0, f"{compared[0]} comparisons for {steps} steps of {n} episodes"  # was 100,000 and more


def test_round_robin_interleaves_and_sequential_does_not(tmp_path):
    episodes = _episodes(tmp_path, {"a": 3, "b": 1, "c": 2})
    # An episode's end comes right after its last step, not one turn later (live panels, --preview, summary).
    assert _drain(StepScheduler(episodes, order="round-robin")) == [
        ("a", 0), ("b", 0), ("b", "complete"), ("c", 0), ("a", 1), ("c", 1), ("c", "complete"), ("a", 2),
        ("a", "complete")]
    assert _drain(StepScheduler(episodes, order="sequential")) == [
        ("a", 0), ("a", 1), ("a", 2), ("a", "complete"), ("b", 0), ("b", "complete"), ("c", 0), ("c", 1),
        ("c", "complete")]


def test_an_episode_whose_last_step_failed_gets_no_end(tmp_path):
    """Its end is queued with its last step; the caller's drop() (the step failed) takes it back."""
    scheduler = StepScheduler(_episodes(tmp_path, {"a": 1, "b": 2}), order="round-robin")
    task = scheduler.next()
    assert (task.episode.name, task.file.step, task.is_last) == ("a", 0, True)
    scheduler.drop("a")
    assert _drain(scheduler) == [("b", 0), ("b", 1), ("b", "complete")]


def test_last_step_flag_history_and_resume_skips(tmp_path):
    episodes = _episodes(tmp_path, {"a": 4})
    scheduler = StepScheduler(episodes, done={"a": _ran(0, 1)})
    task = scheduler.next()
    assert (task.file.step, task.ordinal, task.is_last) == (2, 2, False)
    assert [f.step for f in scheduler.history("a")] == [0, 1]
    task = scheduler.next()
    assert (task.file.step, task.ordinal, task.is_last) == (3, 3, True)
    assert [f.step for f in scheduler.history("a")] == [0, 1, 2]
    assert isinstance(scheduler.next(), EpisodeEnded) and scheduler.next() is None


@pytest.mark.parametrize("follow", [False, True])
def test_an_episode_whose_first_done_step_files_are_gone_fails_instead_of_running_on_a_shorter_history(tmp_path,
                                                                                                       follow):
    # Its next step was handed out as chunk 0 (nothing to replay: a fresh session) or, after a resume that had kept
    # its swapped-out session, with a session ahead of its episode (an AssertionError). Done ones end as before.
    episodes = _episodes(tmp_path, {"a": 4, "b": 3, "c": 2})
    for name, step in (("a", 0), ("a", 1), ("c", 0)):
        (tmp_path / name / f"step_{step:06d}.safetensors").unlink()
    for name in "abc":
        (tmp_path / name / "END").write_text("")
    done = {"a": _ran(0, 1), "b": _ran(0), "c": _ran(0, 1)}
    scheduler = StepScheduler(episodes, follow=follow, poll_interval=0, done=done)
    items = []
    while (item := scheduler.next()) is not None:
        items.append((item.episode.name, item.file.step, item.ordinal) if isinstance(item, StepTask) else item)
    (failed,) = [i for i in items if isinstance(i, EpisodeEnded) and i.reason == "error"]
    assert failed.episode.name == "a" and "steps 0..1 ran (results.jsonl) but their files are gone" in str(failed.error)
    assert [i for i in items if isinstance(i, tuple)] == [("b", 1, 1), ("b", 2, 2)]
    assert sorted(i.episode.name for i in items if isinstance(i, EpisodeEnded) and i.reason != "error") == ["b", "c"]


@pytest.mark.parametrize("follow", [False, True])
def test_a_resume_fails_an_episode_whose_done_steps_are_no_longer_where_they_ran(tmp_path, follow):
    # "a": steps 1 and 2 ran as chunks 0 and 1 (the robot wrote step 0 after them); a resume ran step 0 and kept
    # step 1's output, made without step 0. "b": step 0's output and file were deleted, so steps 1 and 2 are chunks
    # 0 and 1 now. "c" ran from step 0 (its chunks match) and goes on; "d"'s chunks are unknown (a line without one).
    episodes = _episodes(tmp_path, {"a": 4, "b": 4, "c": 4, "d": 3})
    (tmp_path / "b" / "step_000000.safetensors").unlink()
    for name in "abcd":
        (tmp_path / name / "END").write_text("")
    done = {"a": _ran(1, 2, first=1), "b": _ran(1, 2), "c": _ran(0, 1), "d": dict.fromkeys([0, 1])}
    scheduler = StepScheduler(episodes, follow=follow, poll_interval=0, done=done)
    items = []
    while (item := scheduler.next()) is not None:
        items.append((item.episode.name, item.file.step, item.ordinal) if isinstance(item, StepTask) else item)
    errors = {i.episode.name: str(i.error) for i in items if isinstance(i, EpisodeEnded) and i.reason == "error"}
    assert errors == {
        "a": f"{tmp_path / 'a'}: step 1 ran (results.jsonl) as chunk 0 of the episode, but it is chunk 1 now that the "
             "folder starts at step 0: step 0 was written after it ran (out of step order), so its outputs were "
             "made without it",
        "b": f"{tmp_path / 'b'}: step 1 ran (results.jsonl) as chunk 1 of the episode, but it is chunk 0 now that the "
             "folder starts at step 1: the files of step 0 before it are gone",
    }
    assert sorted(i for i in items if isinstance(i, tuple)) == [("c", 2, 2), ("c", 3, 3), ("d", 2, 2)]
    error = next(i.error for i in items if isinstance(i, EpisodeEnded) and i.episode.name == "a")
    assert error.hint.startswith("run the episode again from its first step in a new --out")


@pytest.mark.parametrize("follow", [False, True])
def test_a_resume_completes_an_episode_that_ran_every_step_though_a_done_steps_file_was_deleted_since(tmp_path,
                                                                                                     follow):
    """A lab's cleanup deleting step files that ran, between others, must not fail an episode with nothing left to
    run (as deleting its first one does not): "a" ran every step and completes. "b" has step 3 left, whose session
    history lacks step 1: it fails as a gap, and step 3 does not run."""
    episodes = _episodes(tmp_path, {"a": 4, "b": 4})
    for name in "ab":
        (tmp_path / name / "step_000001.safetensors").unlink()
    done = {"a": _ran(0, 1, 2, 3), "b": _ran(0, 1, 2)}
    scheduler = StepScheduler(episodes, follow=follow, poll_interval=0, done=done)
    items = []
    while (item := scheduler.next()) is not None:
        items.append((item.episode.name, item.file.step) if isinstance(item, StepTask) else item)
    assert [i for i in items if isinstance(i, tuple)] == []
    ends = {i.episode.name: i for i in items if isinstance(i, EpisodeEnded)}
    assert ends["a"].reason == ("end_marker" if follow else "complete")
    assert ends["b"].reason == "error"
    assert str(ends["b"].error).startswith(f"{tmp_path / 'b'}: step 1 missing: the episode has steps 0..3 with a gap")


def test_dropped_episode_gets_no_more_steps(tmp_path):
    episodes = _episodes(tmp_path, {"a": 3, "b": 2})
    scheduler = StepScheduler(episodes)
    assert scheduler.next().episode.name == "a"
    scheduler.drop("a")
    assert _drain(scheduler) == [("b", 0), ("b", 1), ("b", "complete")]


def test_unreadable_episode_folder_becomes_an_error_item(tmp_path):
    episodes = _episodes(tmp_path, {"a": 1, "b": 1})
    (tmp_path / "b" / "nonumber.npz").write_bytes(b"x")
    scheduler = StepScheduler(episodes)
    first = scheduler.next()
    assert isinstance(first, EpisodeEnded) and first.reason == "error" and "nonumber.npz" in str(first.error)
    assert _drain(scheduler) == [("a", 0), ("a", "complete")]


def test_follow_takes_files_as_they_arrive_until_the_end_marker(tmp_path):
    folder = tmp_path / "live"
    folder.mkdir()
    clock = FakeClock()
    writes = [lambda: write_step(folder, 0, good(0), prompt="p"), lambda: None,
              lambda: write_step(folder, 1, good(1)), lambda: (folder / "END").write_bytes(b"")]
    clock.actions = list(writes)
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    first = scheduler.next()
    assert (first.file.step, first.is_last) == (0, False)
    second = scheduler.next()
    assert second.file.step == 1
    end = scheduler.next()
    assert isinstance(end, EpisodeEnded) and end.reason == "end_marker"
    assert scheduler.next() is None


def test_follow_a_step_is_not_last_while_a_newer_file_is_still_settling(tmp_path):
    """END and a new step file appear while the step before runs: the new file is seen for the first time by the
    check for END, so it is not taken yet, but the step handed out is not the last one either (a step flagged
    last closes its session, and the next step would replay the whole episode to rebuild it)."""
    folder = tmp_path / "live"
    write_episode(folder, [good(0), good(1)], prompt="p", end=False)
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    first = scheduler.next()
    assert (first.file.step, first.is_last) == (0, False)
    write_step(folder, 2, good(2))  # the robot writes its last step and END while step 0 runs
    (folder / "END").write_bytes(b"")
    second = scheduler.next()
    assert (second.file.step, second.is_last) == (1, False)
    third = scheduler.next()
    assert (third.file.step, third.is_last) == (2, True)
    end = scheduler.next()
    assert isinstance(end, EpisodeEnded) and end.reason == "end_marker"


def test_follow_warns_once_per_episode_about_step_files_that_arrived_after_it_ended(tmp_path):
    """A step file written after its episode's END was seen (or after its idle timeout) never runs: that used to
    happen without a word, and the run reported every episode completed."""
    write_episode(tmp_path / "a", [good(0)], prompt="p")  # step 0 and END
    write_episode(tmp_path / "b", [good(0)], prompt="p", end=False)  # followed until its idle timeout
    write_episode(tmp_path / "c", [good(0)], prompt="p")
    clock = FakeClock([lambda: None, lambda: (write_step(tmp_path / "a", 1, good(1)),
                                              write_step(tmp_path / "a", 2, good(2)))])
    warnings: list[str] = []
    scheduler = StepScheduler(discover_episodes([tmp_path / n for n in "abc"]), follow=True, idle_timeout=5,
                              poll_interval=1, clock=clock, sleep=clock.sleep, warn=warnings.append)
    items = []
    while (item := scheduler.next()) is not None:
        items.append(item)
        if isinstance(item, StepTask) and item.episode.name == "b":  # b's step ran: b idles out at 5 s
            write_step(tmp_path / "b", 2, good(2))  # a gap, never filled: b fails, and is not warned about
    ran = [(i.episode.name, i.file.step) for i in items if isinstance(i, StepTask)]
    assert ran == [("a", 0), ("b", 0), ("c", 0)]
    assert [(i.episode.name, i.reason) for i in items if isinstance(i, EpisodeEnded)] == [
        ("a", "end_marker"), ("c", "end_marker"), ("b", "error")]
    assert warnings == [f"episode 'a': step_000001.safetensors, step_000002.safetensors arrived in {tmp_path / 'a'} "
                        "after its END file was seen and did not run (--resume runs them)"]
    assert scheduler.next() is None and len(warnings) == 1  # once
    assert scheduler.late == {"a": ["step_000001.safetensors", "step_000002.safetensors"]}  # for the summary

    write_step(tmp_path / "d", 0, good(0), prompt="p")  # ends at its idle timeout; a file arrives after that
    clock = FakeClock()
    warnings.clear()
    scheduler = _following(tmp_path / "d", clock, warn=warnings.append)
    assert scheduler.next().file.step == 0
    assert scheduler.next().reason == "idle_timeout"
    write_step(tmp_path / "d", 1, good(1))
    assert scheduler.next() is None
    assert warnings == [f"episode 'd': step_000001.safetensors arrived in {tmp_path / 'd'} after it ended at "
                        "--idle-timeout and did not run (--resume runs it)"]
    assert scheduler.late == {"d": ["step_000001.safetensors"]}


def test_late_files_are_listed_in_step_order_and_a_temporary_name_in_any_case_is_none(tmp_path):
    """The late files are listed in step order, one in capitals by its step number; a writer's temporary name is no
    late step file, in capitals as in lower case: step_000001.tmp.SAFETENSORS was listed first, as step 1 (its last
    integer), with a hint to rename it to step_000001.tmp.safetensors, which a resume then refused."""
    write_step(tmp_path / "d", 0, good(0), prompt="p")  # ends at its idle timeout; four files arrive after that
    clock = FakeClock()
    warnings: list[str] = []
    scheduler = _following(tmp_path / "d", clock, warn=warnings.append)
    assert scheduler.next().file.step == 0
    assert scheduler.next().reason == "idle_timeout"
    write_step(tmp_path / "d", 3, good(3))
    for name in ("step_000001.tmp.SAFETENSORS", "step_000001.tmp.safetensors", "step_000002.SAFETENSORS"):
        (tmp_path / "d" / name).write_bytes((tmp_path / "d" / "step_000003.safetensors").read_bytes())
    assert scheduler.next() is None
    assert scheduler.late == {"d": ["step_000002.SAFETENSORS", "step_000003.safetensors"]}, warnings
    assert len(warnings) == 1 and ".tmp." not in warnings[0], warnings


def test_follow_ends_cleanly_when_an_ended_episodes_folder_is_taken_away_before_the_others_end(tmp_path):
    """An episode folder moved away once its END was seen (an uploader archiving it) while another is still
    followed: the look for step files that came after END, once every episode ended, has nothing to say of it,
    rather than failing the whole run as it ends."""
    write_episode(tmp_path / "a", [good(0)], prompt="p")  # step 0 and END
    write_episode(tmp_path / "b", [good(0)], prompt="p", end=False)
    clock = FakeClock([lambda: None] * 3 + [lambda: (tmp_path / "b" / "END").write_bytes(b"")])
    warnings: list[str] = []
    scheduler = StepScheduler(discover_episodes([tmp_path / "a", tmp_path / "b"]), follow=True, idle_timeout=10,
                              poll_interval=1, clock=clock, sleep=clock.sleep, warn=warnings.append)
    items = []
    while (item := scheduler.next()) is not None:
        items.append((item.episode.name, item.file.step if isinstance(item, StepTask) else item.reason))
        if items[-1] == ("a", "end_marker"):
            shutil.move(tmp_path / "a", tmp_path / "archived")
    assert items == [("a", 0), ("a", "end_marker"), ("b", 0), ("b", "end_marker")]
    assert warnings == [] and scheduler.late == {}


def test_an_episodes_end_after_its_last_step_is_ending_behind_another_episodes_failure(tmp_path):
    """The poll that hands out b's last step found a's folder gone: a's failure is queued ahead of b's end. The
    rollout takes a signal that came in b's last step only once ``ending`` is False: it looked at the first queued end
    alone, so the run stopped before b's end was taken (summary.json counted b incomplete with every step done)."""
    write_episode(tmp_path / "a", [good(0)], prompt="p", end=False)
    write_episode(tmp_path / "b", [good(0), good(1)], prompt="p")
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([tmp_path / "a", tmp_path / "b"]), follow=True, idle_timeout=100,
                              poll_interval=1, clock=clock, sleep=clock.sleep)
    assert [(item.episode.name, item.file.step) for item in (scheduler.next(), scheduler.next())] == [("a", 0),
                                                                                                     ("b", 0)]
    shutil.rmtree(tmp_path / "a")  # while b's step 0 runs, which takes long enough for the next pick to poll
    clock.now += 2
    last = scheduler.next()
    assert (last.episode.name, last.file.step, last.is_last) == ("b", 1, True)
    assert scheduler.ending  # b's end is to be taken before the run stops
    assert [(item.episode.name, item.reason) for item in (scheduler.next(), scheduler.next())] == [
        ("a", "error"), ("b", "end_marker")]
    assert not scheduler.ending and scheduler.next() is None


def test_a_step_written_under_its_temporary_name_keeps_its_episode_from_the_idle_timeout(tmp_path, frozen_wall):
    # write_step writes `.step_000001.safetensors.XXXX.tmp`, then renames it: a step slower to write than
    # --idle-timeout ended its episode, the step never ran, and the run said ok
    write_step(tmp_path / "e", 0, good(0), prompt="p")
    partial = tmp_path / "e" / ".step_000001.safetensors.abcd1234.tmp"

    def grow() -> None:
        with open(partial, "ab") as f:
            f.write(b"x")

    clock = FakeClock([lambda: None, lambda: partial.write_bytes(b""), grow, lambda: None, grow, lambda: None,
                       lambda: (partial.unlink(), write_step(tmp_path / "e", 1, good(1)))])
    scheduler = _following(tmp_path / "e", clock)
    assert scheduler.next().file.step == 0
    assert scheduler.next().file.step == 1  # written for 5 s, 2.5 times the idle timeout
    assert scheduler.next().reason == "idle_timeout"
    # a writer killed mid-write leaves one that stops changing: the episode ends one idle timeout later
    write_step(tmp_path / "k", 0, good(0), prompt="p")
    (tmp_path / "k" / ".step_000001.safetensors.dead0000.tmp").write_bytes(b"half")
    clock = FakeClock()
    scheduler = _following(tmp_path / "k", clock)
    assert scheduler.next().file.step == 0
    assert scheduler.next().reason == "idle_timeout" and clock.now >= 2 * 2  # not at 2 or 3 s: one timeout more


def test_a_step_written_under_a_name_without_a_step_number_keeps_its_episode_from_the_idle_timeout(tmp_path,
                                                                                                     frozen_wall):
    """A recorder writing a large step slowly into tempfile's tmpabcdefgh.safetensors, then renaming it: the file was
    waited for, but its growth was no activity, so a write slower than --idle-timeout failed the episode ("step file
    name has no step number") though the writer was at work. A change of its size or of its mtime (a writer that
    sized the file first) keeps the episode going; one that stops changing ends it one idle timeout later."""
    write_step(tmp_path / "e", 0, good(0), prompt="p")
    temporary = tmp_path / "e" / "tmpabcdefgh.safetensors"

    def grow() -> None:
        with open(temporary, "ab") as f:
            f.write(b"x")

    def touch() -> None:  # same size, later mtime
        st = temporary.stat()
        os.utime(temporary, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))

    def rename() -> None:
        write_step(tmp_path / "e", 1, good(1))
        os.replace(tmp_path / "e" / "step_000001.safetensors", temporary)
        os.rename(temporary, tmp_path / "e" / "step_000001.safetensors")

    clock = FakeClock([lambda: None, lambda: temporary.write_bytes(b""), grow, lambda: None, grow, lambda: None,
                       touch, lambda: None, touch, lambda: None, rename])
    scheduler = _following(tmp_path / "e", clock)
    assert scheduler.next().file.step == 0
    assert scheduler.next().file.step == 1  # written for 9 s, 4.5 times the idle timeout
    assert scheduler.next().reason == "idle_timeout"

    # a writer killed mid-write leaves one that stops changing: it fails its episode one idle timeout later
    write_step(tmp_path / "k", 0, good(0), prompt="p")
    clock = FakeClock([lambda: (tmp_path / "k" / "tmpabcdefgh.safetensors").write_bytes(b"half")])
    scheduler = _following(tmp_path / "k", clock)
    assert scheduler.next().file.step == 0
    ended = scheduler.next()
    assert isinstance(ended, EpisodeEnded) and ended.reason == "error", ended
    assert str(ended.error) == TEMPORARY_LEFT.format(tmp_path / "k" / "tmpabcdefgh.safetensors")
    assert clock.now >= 2 * 2  # not at 2 or 3 s: one timeout more

    # one written long before (a stray calibration.npz) is no writer at work: it fails its episode at the timeout
    write_step(tmp_path / "s", 0, good(0), prompt="p")
    stray = tmp_path / "s" / "calibration.npz"
    stray.write_bytes(b"old")
    os.utime(stray, (time.time() - 3600, time.time() - 3600))
    clock = FakeClock()
    scheduler = _following(tmp_path / "s", clock)
    assert scheduler.next().file.step == 0
    ended = scheduler.next()
    assert isinstance(ended, EpisodeEnded) and ended.reason == "error", ended
    assert str(ended.error) == f"{stray}: step file name has no step number"
    assert clock.now < 2 * 2  # it took two timeouts: its first look counted as a writer's


def test_a_step_copied_slowly_by_rsync_keeps_its_episode_from_the_idle_timeout(tmp_path, frozen_wall):
    """rsync copies a step into a hidden temporary name (".step_000001.safetensors.Ab3dE9") and renames it: the name
    is passed over as a step (hidden), but its growth was no activity either, so a copy slower than --idle-timeout
    ended the episode (idle_timeout) mid-copy and the step arrived late, never run. A killed copy's leftover stops
    changing and the episode ends one idle timeout later."""
    write_step(tmp_path / "e", 0, good(0), prompt="p")
    temporary = tmp_path / "e" / ".step_000001.safetensors.Ab3dE9"

    def grow() -> None:
        with open(temporary, "ab") as f:
            f.write(b"x")

    def rename() -> None:
        write_step(tmp_path / "e", 1, good(1))
        os.replace(tmp_path / "e" / "step_000001.safetensors", temporary)
        os.rename(temporary, tmp_path / "e" / "step_000001.safetensors")

    clock = FakeClock([lambda: None, lambda: temporary.write_bytes(b""), grow, lambda: None, grow, lambda: None,
                       grow, lambda: None, rename])
    scheduler = _following(tmp_path / "e", clock)
    assert scheduler.next().file.step == 0
    assert scheduler.next().file.step == 1  # copied for 7 s, 3.5 times the idle timeout
    assert scheduler.next().reason == "idle_timeout"

    write_step(tmp_path / "k", 0, good(0), prompt="p")
    clock = FakeClock([lambda: (tmp_path / "k" / ".step_000001.safetensors.Zz09aB").write_bytes(b"half")])
    scheduler = _following(tmp_path / "k", clock)
    assert scheduler.next().file.step == 0
    ended = scheduler.next()
    assert isinstance(ended, EpisodeEnded) and ended.reason == "idle_timeout", ended
    assert clock.now >= 2 * 2  # one timeout more for the copy that stopped
    # without --follow, that leftover of an interrupted copy is passed over: the episode's step files run
    assert _drain(StepScheduler(discover_episodes([tmp_path / "k"]))) == [("k", 0), ("k", "complete")]


def test_follow_waits_for_a_file_to_stop_growing(tmp_path):
    folder = tmp_path / "live"
    folder.mkdir()
    clock = FakeClock()
    partial = folder / "step_000000.npz"
    partial.write_bytes(b"PK")  # a writer that does not rename, caught mid-write
    clock.actions = [lambda: write_step(folder, 0, good(0), prompt="p", format="npz"),
                      lambda: None, lambda: (folder / "END").write_bytes(b"")]
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    task = scheduler.next()
    assert task.file.step == 0 and task.file.path.stat().st_size > 2


def test_follow_idle_timeout_ends_an_episode(tmp_path):
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=5, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert _drain(scheduler) == [("live", 0), ("live", "idle_timeout")]
    assert clock.now >= 5


def test_follow_rejects_a_step_older_than_one_already_run(tmp_path):
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False, first_step=5)
    clock = FakeClock()
    clock.actions = [lambda: None, lambda: write_step(folder, 2, good(2)), lambda: None, lambda: None]
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert scheduler.next().file.step == 5
    item = scheduler.next()
    assert isinstance(item, EpisodeEnded) and item.reason == "error" and "arrived after step 5" in str(item.error)


def test_demo_episodes_are_deterministic_valid_and_cached(tmp_path):
    root = ensure_demo_episodes("toy", SCHEMA, (16, 24), root=tmp_path)
    again = ensure_demo_episodes("toy", SCHEMA, (16, 24), root=tmp_path)
    assert root == again
    episodes = discover_episodes([root])
    assert len(episodes) >= 3
    for episode in episodes:
        steps = episode.scan()
        assert 5 <= len(steps) <= 8
        for step_file in steps:
            from ardiff_cli.io.step_file import load_step

            valid = validate_step(load_step(step_file.path), SCHEMA, path=step_file.path,
                                  episode_metadata=episode.metadata())
            assert valid.inputs["camera"].shape == (16, 24, 3) and not valid.warnings
    a, b = demo_step(SCHEMA, (16, 24), 0, 1), demo_step(SCHEMA, (16, 24), 0, 1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["camera"], demo_step(SCHEMA, (16, 24), 0, 2)["camera"])  # it moves
    assert not [p for p in (tmp_path / "demo").iterdir() if p.name.startswith(".")]  # no temp folder left


def test_demo_steps_of_a_pipeline_that_takes_several_frames_a_request_have_them_after_the_first(tmp_path,
                                                                                                   monkeypatch):
    """DreamZero takes one frame on a session's first request and frames_per_request after: the demo set has those
    shapes (a one-frame demo failed its second step), in its own cache folder (not a one-frame set's), under a
    $ARDIFF_CACHE_DIR given as ~/... (no shell expanded it), readable as any folder the user makes."""
    from types import SimpleNamespace

    from ardiff_cli.io.atomic import DIR_MODE
    from ardiff_cli.io.step_file import load_step

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ARDIFF_CACHE_DIR", "~/cache")
    single = ensure_demo_episodes("toy", SCHEMA, (16, 24))
    multi = ensure_demo_episodes("toy", SCHEMA, (16, 24), model_config=SimpleNamespace(frames_per_request=4))
    assert single.parent == multi.parent == tmp_path / "home" / "cache" / "demo" and single != multi
    assert (multi.stat().st_mode & 0o777) == DIR_MODE
    steps = discover_episodes([multi])[0].scan()
    shapes = [load_step(step.path).arrays["camera"].shape for step in steps]
    assert shapes[:3] == [(16, 24, 3), (4, 16, 24, 3), (4, 16, 24, 3)], shapes


@pytest.mark.parametrize("manifest", ['{"files": [1, 2]}', '{"sizes": {}}', '[]'])
def test_a_demo_set_whose_manifest_is_not_a_file_list_is_built_again(tmp_path, manifest):
    """A manifest edited or written wrong is a damaged set (built again with a warning), not a crash of every run."""
    root = ensure_demo_episodes("toy", SCHEMA, (16, 24), root=tmp_path)
    (root / ".manifest.json").write_text(manifest)
    warnings: list[str] = []
    assert ensure_demo_episodes("toy", SCHEMA, (16, 24), root=tmp_path, warn=warnings.append) == root
    assert len(warnings) == 1 and "were damaged" in warnings[0], warnings
    assert '"files"' in (root / ".manifest.json").read_text()


@pytest.mark.parametrize("damage", ["cut short", "deleted", "episode deleted", "added"])
def test_a_damaged_demo_set_is_built_again_and_an_intact_one_is_not(tmp_path, damage):
    # A demo step file cut short in the cache failed its episode in every run after (exit 4), naming a cache file
    # the user never made; a deleted episode folder quietly left the demo with two episodes.
    root = ensure_demo_episodes("toy", SCHEMA, (16, 24), root=tmp_path)
    built = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    step = root / "demo_1" / "step_000003.safetensors"
    warnings: list[str] = []
    assert ensure_demo_episodes("toy", SCHEMA, (16, 24), root=tmp_path, warn=warnings.append) == root
    assert warnings == []  # intact: used as it is
    if damage == "cut short":
        step.write_bytes(step.read_bytes()[:100])
    elif damage == "deleted":
        step.unlink()
    elif damage == "episode deleted":
        shutil.rmtree(root / "demo_2")
    else:
        write_step(root / "demo_0", 9, good(9))
    assert ensure_demo_episodes("toy", SCHEMA, (16, 24), root=tmp_path, warn=warnings.append) == root
    what = {"cut short": f"demo_1/step_000003.safetensors has 100 bytes, {len(built[step.relative_to(root)])} when "
                         "built",
            "deleted": "demo_1/step_000003.safetensors is missing",
            "episode deleted": "demo_2/END is missing",
            "added": "demo_0/step_000009.safetensors was not in it"}[damage]
    assert warnings == [f"the demo episodes in {root} were damaged ({what}): building them again"]
    assert {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()} == built
    assert [p.name for p in (tmp_path / "demo").iterdir()] == [root.name]  # no temporary or old folder left


def test_a_demo_set_another_run_made_meanwhile_or_an_earlier_version_made_is_used_as_it_is(tmp_path):
    # Runs started together each build the set: one that finished later moved the set another had returned aside
    # and deleted it, under that run's reads. A set without a manifest (made before there was one) was "damaged".
    from ardiff_cli.io import demo

    root = ensure_demo_episodes("toy", SCHEMA, (16, 24), root=tmp_path)
    (root / ".manifest.json").unlink()
    inode = root.stat().st_ino
    warnings: list[str] = []
    assert ensure_demo_episodes("toy", SCHEMA, (16, 24), root=tmp_path, warn=warnings.append) == root
    frames = tuple(demo.frames_per_step(None, step) for step in range(max(demo.DEMO_STEPS)))
    demo._generate(root, SCHEMA, (16, 24), frames)  # as a concurrent run that found no set, finishing second
    assert warnings == [] and root.stat().st_ino == inode and not (root / ".manifest.json").exists()
    assert [p.name for p in (tmp_path / "demo").iterdir()] == [root.name]


def test_a_demo_set_a_killed_run_was_building_is_removed_once_an_hour_old(tmp_path):
    root = ensure_demo_episodes("toy", SCHEMA, (16, 24), root=tmp_path)
    stale = [tmp_path / "demo" / f".{root.name}.k1ll3d_x", tmp_path / "demo" / f".{root.name}.r3pl4c3d.old"]
    fresh, other = tmp_path / "demo" / f".{root.name}.b0ild1ng", tmp_path / "demo" / ".mine.abcdefgh"
    for folder in (*stale, fresh, other):
        write_step(folder / "demo_0", 0, good(0))
        os.utime(folder, (time.time() - 7200, time.time() - 7200) if folder != fresh else None)
    assert ensure_demo_episodes("toy", SCHEMA, (16, 24), root=tmp_path) == root
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == sorted([root.name, fresh.name, other.name])


@pytest.mark.parametrize("how", ["deleted", "moved", "renamed"])
def test_follow_fails_an_episode_whose_folder_is_deleted_or_renamed(tmp_path, how):
    """Not an idle timeout (which would count the episode as completed): the folder is gone, and that is an error.
    One renamed beside where it was is named with its new name."""
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    (tmp_path / "elsewhere").mkdir()
    away = {"deleted": lambda: shutil.rmtree(folder), "moved": lambda: folder.rename(tmp_path / "elsewhere" / "live"),
            "renamed": lambda: folder.rename(tmp_path / "live_done")}[how]
    clock = FakeClock()
    clock.actions = [lambda: None, away]
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert scheduler.next().file.step == 0
    item = scheduler.next()
    assert isinstance(item, EpisodeEnded) and item.reason == "error", item
    what = ("was renamed to live_done while it was followed" if how == "renamed"
            else "is gone (deleted or renamed while it was followed)")
    assert str(item.error) == f"{folder}: the episode folder {what}; 1 of its steps had arrived"
    assert clock.now < 100 and scheduler.next() is None


def _items(scheduler: StepScheduler) -> list[tuple]:
    items = []
    while (item := scheduler.next()) is not None:
        items.append((item.episode.name, item.file.step, item.file.path.parent.name) if isinstance(item, StepTask)
                     else (item.episode.name, item.reason, str(item.error) if item.error else None))
    return items


def _moves(scheduler: StepScheduler) -> list[tuple[str, str, str]]:
    moved: list[tuple[str, str, str]] = []
    scheduler._on_moved = lambda episode, old, how: moved.append((episode.name, old.name, episode.path.name))
    return moved


def test_an_episode_folder_renamed_in_a_watched_folder_is_followed_there_as_the_same_episode(tmp_path):
    """A recorder that publishes each episode by renaming its folder (robots/ep1.part -> robots/ep1) before its
    END: the episode goes on at the new name, under the name it joined with, each step once; the new name is not
    another episode, and the old name is free for the recorder's next episode."""
    data = tmp_path / "robots"
    write_episode(data / "ep1.part", [good(0)], prompt="p", end=False)

    def publish() -> None:
        (data / "ep1.part").rename(data / "ep1")
        write_step(data / "ep1", 1, good(1))
        (data / "ep1" / "END").touch()

    clock = FakeClock([lambda: None, publish, lambda: None, lambda: write_episode(data / "ep1.part", [good(0)])])
    added: list = []
    scheduler = _watching(data, clock, added=added)
    moved = _moves(scheduler)
    assert _items(scheduler) == [("ep1.part", 0, "ep1.part"), ("ep1.part", 1, "ep1"), ("ep1.part", "end_marker", None),
                                 ("ep1.part-2", 0, "ep1.part"), ("ep1.part-2", "end_marker", None)]
    assert moved == [("ep1.part", "ep1.part", "ep1")] and [e.name for e in added] == ["ep1.part-2"]
    assert [f.path for f in scheduler.history("ep1.part")] == [data / "ep1" / "step_000000.safetensors",
                                                               data / "ep1" / "step_000001.safetensors"]


def test_an_episode_folder_renamed_between_a_polls_look_at_it_and_its_listing_is_followed_there(tmp_path,
                                                                                                 monkeypatch):
    """The rename can come after a poll found the folder in place and before it listed it: the listing's ENOENT
    failed the episode, `cannot list the episode folder: No such file or directory` (exit 4; CI caught it), where a
    poll a moment later would have followed it to its new name. That poll lists nothing; the next follows it."""
    data = tmp_path / "robots"
    write_episode(data / "ep1.part", [good(0)], prompt="p", end=False)
    listing = StepScheduler._listing

    def published_as_it_lists(track, st, *, force):
        if track.files and (data / "ep1.part").exists():  # the poll after step 0's
            (data / "ep1.part").rename(data / "ep1")
            write_step(data / "ep1", 1, good(1))
            (data / "ep1" / "END").touch()
        return listing(track, st, force=force)

    monkeypatch.setattr(StepScheduler, "_listing", staticmethod(published_as_it_lists))
    scheduler = _watching(data, FakeClock())
    moved = _moves(scheduler)
    assert _items(scheduler) == [("ep1.part", 0, "ep1.part"), ("ep1.part", 1, "ep1"), ("ep1.part", "end_marker", None)]
    assert moved == [("ep1.part", "ep1.part", "ep1")]


def test_an_episode_folder_renamed_after_its_end_is_not_another_episode(tmp_path):
    """The usual recorder: END, then the rename. The episode ran; its folder's new name does not run it again."""
    data = tmp_path / "robots"
    write_episode(data / "ep1.part", [good(0), good(1)], prompt="p")
    clock = FakeClock([lambda: None, lambda: (data / "ep1.part").rename(data / "ep1")])
    scheduler = _watching(data, clock)
    moved = _moves(scheduler)
    assert _items(scheduler) == [("ep1.part", 0, "ep1.part"), ("ep1.part", 1, "ep1.part"),
                                 ("ep1.part", "end_marker", None)]
    assert moved == [("ep1.part", "ep1.part", "ep1")]


def test_a_step_handed_out_before_its_folder_was_renamed_is_found_at_the_new_name(tmp_path):
    """The rename can come between a step being handed out and its file being read (``relocate``)."""
    data = tmp_path / "robots"
    write_episode(data / "ep1.part", [good(0), good(1)], prompt="p")
    scheduler = _watching(data, FakeClock())
    moved = _moves(scheduler)
    assert scheduler.next().file.path == data / "ep1.part" / "step_000000.safetensors"
    assert not scheduler.relocate("ep1.part")  # still there
    (data / "ep1.part").rename(data / "ep1")
    assert scheduler.relocate("ep1.part") and moved == [("ep1.part", "ep1.part", "ep1")]
    assert scheduler.history("ep1.part", 0) == []
    assert _items(scheduler) == [("ep1.part", 1, "ep1"), ("ep1.part", "end_marker", None)]


def test_a_last_step_handed_out_as_its_folder_is_renamed_is_at_the_new_name(tmp_path):
    """The rename can come between END being seen and the scan that checks for a step written just before it: the
    scan follows the folder to its new name, and the last step was handed out at the old one (its file gone there),
    so reading it failed the episode."""
    data = tmp_path / "robots"
    write_episode(data / "ep1.part", [good(0)], prompt="p")

    seen_before = []

    class Publishing(EpisodeSource):  # the recorder renames the folder right after END is seen with its step taken
        def has_end_marker(self) -> bool:
            seen = super().has_end_marker()
            if seen and self.path.name == "ep1.part" and seen_before:  # the first look: its step not taken yet
                self.path.rename(self.path.parent / "ep1")
            seen_before.append(seen)
            return seen

    scheduler = StepScheduler([Publishing(name="ep1.part", path=data / "ep1.part")], follow=True, idle_timeout=5,
                              poll_interval=1, clock=(clock := FakeClock()), sleep=clock.sleep, watch=[data])
    moved = _moves(scheduler)
    task = scheduler.next()
    assert task.is_last and moved == [("ep1.part", "ep1.part", "ep1")]
    assert task.file.path == data / "ep1" / "step_000000.safetensors" and task.file.path.is_file()


def test_a_renamed_folder_whose_first_step_file_is_another_is_not_taken_for_the_episode(tmp_path):
    """The same inode number beside where the folder was is not enough (a folder deleted, and another made that got
    its number): the first step file taken must be there, the same file. Else the old name fails, naming the new
    one, which joins the run as an episode of its own."""
    data = tmp_path / "robots"
    write_episode(data / "ep1.part", [good(0)], prompt="p", end=False)

    def rename_and_rewrite() -> None:
        (data / "ep1.part").rename(data / "ep1")
        write_step(data / "ep1", 0, good(5))  # a new file (atomic: another inode) under the first step's name

    clock = FakeClock([lambda: None, rename_and_rewrite])
    scheduler = _watching(data, clock, idle_timeout=5)
    hints = []
    items = []
    while (item := scheduler.next()) is not None:
        items.append((item.episode.name, item.file.step) if isinstance(item, StepTask) else
                     (item.episode.name, item.reason, str(item.error) if item.error else None))
        if isinstance(item, EpisodeEnded) and item.error:
            hints.append(item.error.hint)
    assert items == [("ep1.part", 0),
                     ("ep1.part", "error", f"{data / 'ep1.part'}: the episode folder was renamed to ep1 while it was "
                                           f"followed; 1 of its steps had arrived; in the watched {data} it joins the "
                                           "run as an episode of its own, from its first step (step_000000."
                                           "safetensors in it is not the file that ran)"),
                     ("ep1", 0), ("ep1", "idle_timeout", None)]
    assert hints[0].startswith("its steps run again as episode ep1: keep an episode's step files as they are")


def test_an_episode_folder_renamed_while_the_model_loads_is_followed_there_as_the_same_episode(tmp_path):
    """Renamed after the episodes were found and before the first poll (the model loading, its warmup: minutes): the
    old name failed as gone and the new one joined as an episode of its own (exit 4, and --resume exited 2)."""
    data = tmp_path / "robots"
    write_episode(data / "ep1.part", [good(0)], prompt="p", end=False)
    episodes = discover_episodes([data])
    (data / "ep1.part").rename(data / "ep1")  # while the model loads
    write_step(data / "ep1", 1, good(1))
    (data / "ep1" / "END").touch()
    added: list = []
    scheduler = StepScheduler(episodes, follow=True, idle_timeout=5, poll_interval=1, clock=(clock := FakeClock()),
                              sleep=clock.sleep, watch=[data], on_new_episode=added.append)
    moved = _moves(scheduler)
    assert _items(scheduler) == [("ep1.part", 0, "ep1"), ("ep1.part", 1, "ep1"), ("ep1.part", "end_marker", None)]
    assert moved == [("ep1.part", "ep1.part", "ep1")] and added == []


def _deleted_and_given_its_inode_number(folder: Path) -> Path:
    """``folder`` deleted and a hidden folder made beside it given its inode number back, as ext4 often does (tmpfs
    never, and a parallel test may take it first: these tests skipped there): made so on any file system, the folder
    moved to the new name and emptied. Between two polls, what the follower sees is the same: the old path gone, a
    new one of its inode number holding none of its files."""
    made = folder.parent / ".new0"
    folder.rename(made)
    for entry in made.iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    return made


def test_a_folder_given_the_inode_number_of_an_episode_that_failed_without_a_step_is_a_new_episode(tmp_path):
    """An episode that ended with no step file (END first: it failed), its folder deleted, and the next folder made
    given its inode number back (ext4): that folder holds every step file taken from it (none), and was followed as
    the failed episode renamed, so its steps never ran, without a word."""
    data = tmp_path / "robots"
    (data / "ep1").mkdir(parents=True)
    (data / "ep1" / "episode.yaml").write_text("prompt: p\n")
    write_episode(data / "ep0", [good(0)], prompt="p", end=False)  # keeps the run going

    def replace() -> None:
        folder = _deleted_and_given_its_inode_number(data / "ep1")
        write_step(folder, 0, good(0))
        (folder / "END").touch()
        folder.rename(data / "ep2")

    clock = FakeClock([lambda: None, lambda: (data / "ep1" / "END").touch(), lambda: None, replace,
                       lambda: (data / "ep0" / "END").touch()])
    scheduler = _watching(data, clock)
    moved = _moves(scheduler)
    items = _items(scheduler)
    assert ("ep2", 0, "ep2") in items and ("ep2", "end_marker", None) in items and moved == []


def test_an_episode_folder_given_a_deleted_episodes_inode_number_and_renamed_runs_once(tmp_path):
    """A recorder that deletes each episode's folder once it ran and publishes the next by renaming it: ext4 gives
    the next folder the deleted one's inode number, and the rename was matched to the deleted episode only, so the
    new name joined as an episode of its own and the renamed one went on there too: each step ran twice."""
    data = tmp_path / "robots"
    write_episode(data / "ep1", [good(0)], prompt="p")

    def replace() -> None:
        folder = _deleted_and_given_its_inode_number(data / "ep1")
        write_step(folder, 0, good(0))
        folder.rename(data / "ep2.part")

    def publish() -> None:
        (data / "ep2.part").rename(data / "ep2")
        write_step(data / "ep2", 1, good(1))
        (data / "ep2" / "END").touch()

    scheduler = _watching(data, FakeClock([lambda: None, replace, lambda: None, lambda: None, publish]))
    moved = _moves(scheduler)
    items = _items(scheduler)
    assert items == [("ep1", 0, "ep1"), ("ep1", "end_marker", None), ("ep2.part", 0, "ep2.part"),
                     ("ep2.part", 1, "ep2"), ("ep2.part", "end_marker", None)]
    assert moved == [("ep2.part", "ep2.part", "ep2")]


def test_an_episode_folder_deleted_and_a_new_one_given_its_inode_number_is_not_said_to_be_renamed(tmp_path):
    """A robot that deletes a followed episode's folder and starts its next one beside it: ext4 hands the freed inode
    number to the next folder made, and the error said the episode "was renamed to ep2" and that ep2's "steps run
    again", of another episode. A renamed folder holds the step files taken from it; this one holds none of them."""
    data = tmp_path / "robots"
    write_episode(data / "ep1", [good(0), good(1)], prompt="p", end=False)

    def replace() -> None:
        _deleted_and_given_its_inode_number(data / "ep1").rename(data / "ep2")
        write_step(data / "ep2", 0, good(0))  # its first step: a name taken from ep1 too

    clock = FakeClock([lambda: None, replace])
    items = list(iter(_watching(data, clock).next, None))
    error = next(item.error for item in items if isinstance(item, EpisodeEnded) and item.episode.name == "ep1")
    assert str(error) == (f"{data / 'ep1'}: the episode folder is gone (deleted or renamed while it was followed); 2 "
                          "of its steps had arrived")
    assert [item.file.step for item in items if isinstance(item, StepTask) and item.episode.name == "ep2"] == [0]


def test_an_episode_folder_renamed_to_a_hidden_name_in_a_watched_folder_is_not_said_to_join_the_run(tmp_path):
    """A folder renamed to a hidden name (moved aside, `.trash-ep1`) is not watched: the error said it "joins the run
    as an episode of its own", hinting that its steps run again as episode .trash-ep1 and to use a hidden name."""
    data = tmp_path / "robots"
    write_episode(data / "ep1", [good(0)], prompt="p", end=False)
    clock = FakeClock([lambda: None, lambda: (data / "ep1").rename(data / ".trash-ep1")])
    items = list(iter(_watching(data, clock).next, None))
    assert [(item.episode.name, item.reason) for item in items if isinstance(item, EpisodeEnded)] == [("ep1", "error")]
    error = items[-1].error
    assert str(error) == (f"{data / 'ep1'}: the episode folder was renamed to .trash-ep1 while it was followed; 1 of "
                          "its steps had arrived")
    assert error.hint == "keep an episode's folder in place until its END file is written"


def test_follow_fails_an_episode_whose_folder_is_replaced_by_another_between_two_polls(tmp_path):
    """Another episode's folder moved in place of a followed one (a recorder restarting its episode): its later steps
    must not run on the first episode's session, and the outcome must not depend on whether a poll fell between the
    old folder's removal and the new one's arrival (the folder is gone then)."""
    folder = tmp_path / "live"
    write_episode(folder, [good(0), good(1)], prompt="p", end=False)

    def restart() -> None:
        write_episode(tmp_path / "staged", [good(10 + step) for step in range(3)], prompt="p")
        shutil.rmtree(folder)
        (tmp_path / "staged").rename(folder)

    clock = FakeClock([lambda: None, restart])
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert [scheduler.next().file.step for _ in range(2)] == [0, 1]
    item = scheduler.next()
    assert isinstance(item, EpisodeEnded) and item.reason == "error", item
    assert str(item.error) == (f"{folder}: the episode folder was replaced (deleted or renamed, and another folder "
                               "put in its place, while it was followed); 2 of its steps had arrived from the old one")
    assert scheduler.next() is None


@pytest.mark.parametrize("steps_first", [0, 2], ids=["before-its-first-step", "after-two"])
def test_follow_fails_an_episode_whose_link_is_replaced_by_a_folder_as_replaced_not_as_a_link(tmp_path, steps_first):
    """cam -> rec/arm_a, and a folder moved in place of the link between two polls: the episode fails, and its error
    said "the episode folder is a link, another folder than the one it led to" of a path that is no link now."""
    write_episode(tmp_path / "rec" / "arm_a", [good(s) for s in range(steps_first)], prompt="p", end=False)
    folder = tmp_path / "cam"
    folder.symlink_to(Path("rec") / "arm_a")

    def replace() -> None:
        write_episode(tmp_path / "staged", [good(10 + step) for step in range(3)], prompt="p")
        folder.unlink()
        (tmp_path / "staged").rename(folder)

    clock = FakeClock([lambda: None, replace])
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert [scheduler.next().file.step for _ in range(steps_first)] == list(range(steps_first))
    item = scheduler.next()
    assert isinstance(item, EpisodeEnded) and item.reason == "error", item
    assert str(item.error) == (f"{folder}: the episode folder was replaced (deleted or renamed, and another folder "
                               f"put in its place, while it was followed); {steps_first} of its steps had arrived "
                               "from the old one")
    assert scheduler.next() is None


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_follow_waits_for_a_writer_that_pauses_mid_file(tmp_path, fmt):
    """A robot writing in place (no rename) that stalls for several polls halfway through a step file."""
    from ardiff_cli.io.writer import encode_arrays

    folder = tmp_path / "live"
    folder.mkdir()
    path = folder / f"step_000000.{fmt}"
    data = encode_arrays(good(0), format=fmt, metadata={"prompt": "p"})
    path.write_bytes(data[: len(data) // 2])
    clock = FakeClock()
    clock.actions = [lambda: None, lambda: None, lambda: None, lambda: path.write_bytes(data)]
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    task = scheduler.next()
    assert task.file.step == 0 and task.file.path.read_bytes() == data


@pytest.mark.parametrize("end", [True, False], ids=["end-marker", "idle-timeout"])
def test_follow_hands_over_a_file_that_stays_incomplete_instead_of_skipping_it(tmp_path, end):
    """A writer that died mid-file: at END (or the idle timeout) the file is handed out, and reading it fails the
    episode as truncated; the episode never ends as if that step did not exist."""
    from ardiff_cli.io.step_file import load_step
    from ardiff_cli.io.writer import encode_arrays

    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    data = encode_arrays(good(1))
    clock = FakeClock()
    clock.actions = [lambda: None, lambda: (folder / "step_000001.safetensors").write_bytes(data[:-10]),
                     lambda: (folder / "END").write_bytes(b"") if end else None]
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=5, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert scheduler.next().file.step == 0
    task = scheduler.next()
    assert isinstance(task, StepTask) and task.file.step == 1, task
    with pytest.raises(ObservationError, match="truncated"):
        load_step(task.file.path)


def test_follow_forgets_a_file_deleted_before_it_was_taken(tmp_path):
    """A writer in place cut short mid-file, whose cleanup deletes the partial step file, then writes END: the
    episode ends after the steps that ran. It used to wait for the deleted file forever (END waited for every file
    seen unready, and with END there the idle timeout never came)."""
    from ardiff_cli.io.writer import encode_arrays

    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    partial = folder / "step_000001.safetensors"
    data = encode_arrays(good(1))

    class Clock(FakeClock):
        def sleep(self, seconds: float) -> None:
            assert self.now < 100, "still waiting 100 s after the partial file was deleted"
            super().sleep(seconds)

    clock = Clock([lambda: partial.write_bytes(data[: len(data) // 2]), lambda: None, partial.unlink,
                   lambda: (folder / "END").write_bytes(b"")])
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=5, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert _drain(scheduler) == [("live", 0), ("live", "end_marker")]


def test_follow_a_file_still_growing_keeps_its_episode_from_idling_out(tmp_path):
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    path = folder / "step_000001.safetensors"
    from ardiff_cli.io.writer import encode_arrays

    data = encode_arrays(good(1))
    chunks = [data[: len(data) * i // 8] for i in range(1, 9)]  # one more piece at every poll, 8 polls in all
    clock = FakeClock()
    clock.actions = [lambda: None] + [lambda c=c: path.write_bytes(c) for c in chunks]
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=3, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert scheduler.next().file.step == 0
    task = scheduler.next()
    assert isinstance(task, StepTask) and task.file.path.read_bytes() == data, task


def test_follow_waits_for_a_writer_that_sizes_a_step_file_first_then_fills_it_in_place(tmp_path):
    """A recorder that makes step_000001.safetensors at its full size (truncate) and then writes it in place: the
    size never changes, so the header, once written, said the file was whole and it was taken with its data still
    zeros; and the fill did not count as activity, so a slow one idled its episode out. A change of mtime is the
    writer at work as a change of size is."""
    from ardiff_cli.io.writer import encode_arrays

    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    path = folder / "step_000001.safetensors"
    data = encode_arrays({"camera": np.full((8, 8, 3), 7, np.uint8), "joints": np.arange(7, dtype=np.float32) + 1})

    def fill(upto: int) -> None:
        time.sleep(0.01)  # a later mtime than the last write's, on any file system with sub-second stamps
        with path.open("r+b") as f:
            f.write(data[:upto])

    pieces = [len(data) * i // 8 for i in range(1, 9)]  # the header first, then one more piece at every poll
    clock = FakeClock()
    clock.actions = [lambda: path.write_bytes(bytes(len(data)))] + [lambda n=n: fill(n) for n in pieces]
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=3, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert scheduler.next().file.step == 0
    task = scheduler.next()
    assert isinstance(task, StepTask) and task.file.step == 1, task
    assert task.file.path.read_bytes() == data  # taken once whole, not while its data was still zeros
    assert clock.now >= len(pieces)


def test_follow_polls_look_at_each_step_file_once_not_at_every_step(tmp_path, monkeypatch):
    """A follower left running for hours: its folder holds thousands of step files. A poll must not stat and
    parse every one of them again (20,000 files took 170 ms per step), nor list the folder while steps that
    arrived earlier still wait to run."""
    import ardiff_cli.io.episode as episode_module

    n = 300
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    data = (folder / "step_000000.safetensors").read_bytes()
    for step in range(1, n):
        (folder / f"step_{step:06d}.safetensors").write_bytes(data)
    parsed, listings = [0], [0]
    real_step_number, real_scan = episode_module.step_number, EpisodeSource.scan
    monkeypatch.setattr(episode_module, "step_number", lambda path: parsed.__setitem__(0, parsed[0] + 1)
                        or real_step_number(path))
    monkeypatch.setattr(EpisodeSource, "scan", lambda self, **kw: listings.__setitem__(0, listings[0] + 1)
                        or real_scan(self, **kw))
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=5, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    for step in range(n):  # the backlog
        assert scheduler.next().file.step == step
    write_step(folder, n, good(n))  # then live: one more file
    assert scheduler.next().file.step == n
    (folder / "END").touch()
    assert isinstance(scheduler.next(), EpisodeEnded)
    assert parsed[0] <= 3 * (n + 1), f"{parsed[0]} step-number parses for {n + 1} files"  # was n per step: 90,000
    assert listings[0] <= 10, f"{listings[0]} folder listings for {n + 1} steps"


def test_follow_polls_the_caught_up_folders_once_per_interval_not_after_every_step(tmp_path, monkeypatch):
    """100 robots, each writing a step every few seconds: after every step the follower listed the folder of each
    robot that had no step waiting (up to 99 listings per step, each as long as its folder; 2 ms of a 7 ms
    step). Between pauses, a poll now comes at most once per poll interval; what is taken, and when, is unchanged
    where time moves only while the follower pauses (this clock)."""
    n = 40
    folders = [tmp_path / f"robot_{i}" for i in range(n)]
    for folder in folders:
        write_episode(folder, [good(0)], prompt="p", end=False)
    listings, real_scan = [0], EpisodeSource.scan
    monkeypatch.setattr(EpisodeSource, "scan", lambda self, **kw: listings.__setitem__(0, listings[0] + 1)
                        or real_scan(self, **kw))

    def robots_write(step):
        return lambda: [write_step(folder, step, good(step)) for folder in folders]

    clock = FakeClock([lambda: None, robots_write(1), lambda: None, lambda: [(f / "END").touch() for f in folders]])
    scheduler = StepScheduler(discover_episodes(folders), follow=True, idle_timeout=60, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert _drain(scheduler) == [(f"robot_{i}", item) for item in (0, 1, "end_marker") for i in range(n)]
    assert listings[0] <= 8 * n, f"{listings[0]} folder listings for {2 * n} steps of {n} robots"  # was 2,660


def test_follow_polls_pass_over_other_files_by_name(tmp_path, monkeypatch):
    """A robot's folder may hold thousands of other files (camera frames, logs) next to its steps: every poll, 10
    a second, made each of them a Path and checked it again (20,000 of them: 39 ms per folder per poll, now 8 ms,
    the listing itself). A name without a step file's suffix is passed over as a string."""
    import ardiff_cli.io.episode as episode_module

    folder = tmp_path / "robot"
    write_episode(folder, [good(0)], prompt="p", end=False)
    for i in range(300):
        (folder / f"cam_{i:06d}.jpg").touch()
    checked, real_check = [0], episode_module.is_step_file
    monkeypatch.setattr(episode_module, "is_step_file", lambda path: checked.__setitem__(0, checked[0] + 1)
                        or real_check(path))
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=3, poll_interval=0.5,
                              clock=clock, sleep=clock.sleep)
    assert _drain(scheduler) == [("robot", 0), ("robot", "idle_timeout")]
    assert checked[0] <= 5, f"{checked[0]} names checked as step files"  # was 2,711


def test_follow_waits_for_a_step_file_named_without_a_step_number_to_be_renamed(tmp_path):
    """A writer that saves into tempfile.NamedTemporaryFile(dir=episode, suffix=".safetensors") and then renames it
    to step_000001.safetensors (tmpabcdefgh.safetensors: about one name in 12 has no digit) failed its episode with
    "step file name has no step number" at the poll that saw the temporary file. It is now waited for and forgotten
    once renamed; one still there at END fails the episode naming it, as without --follow."""
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    temporary = folder / "tmpabcdefgh.safetensors"
    clock = FakeClock([lambda: write_step(folder, 1, good(1)) and os.rename(folder / "step_000001.safetensors",
                                                                               temporary),
                       lambda: None, lambda: os.rename(temporary, folder / "step_000001.safetensors"),
                       lambda: (folder / "END").touch()])
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert _drain(scheduler) == [("live", 0), ("live", 1), ("live", "end_marker")]

    stray = tmp_path / "stray"
    write_episode(stray, [good(0)], prompt="p", end=False)
    clock = FakeClock([lambda: write_step(stray, 1, good(1)) and os.rename(stray / "step_000001.safetensors",
                                                                              stray / "notes.safetensors"),
                       lambda: (stray / "END").touch()])
    scheduler = StepScheduler(discover_episodes([stray]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert isinstance(scheduler.next(), StepTask)
    ended = scheduler.next()
    assert isinstance(ended, EpisodeEnded) and ended.reason == "error", ended
    assert str(ended.error) == f"{stray / 'notes.safetensors'}: step file name has no step number"
    assert scheduler.next() is None

    # one there when the run starts is waited for too, and fails the episode once END counts (its folder the same
    # for a moment: a copy may make END before the step files), whole steps there running until then
    scheduler = StepScheduler(discover_episodes([stray]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    stray_error = f"{stray / 'notes.safetensors'}: step file name has no step number"
    assert _items(scheduler) == [("stray", 0, "stray"), ("stray", "error", stray_error)]


def test_follow_waits_for_a_temporary_name_already_there_when_the_run_starts(tmp_path):
    """A run started while the recorder was mid-write of step 1 under tempfile's name (tmpabcdefgh.safetensors):
    the first poll took the file for a stray one and failed the episode before any step ran, though the same file
    seen at a later poll was waited for until renamed. It is waited for as at any poll; one never renamed fails its
    episode at the idle timeout, naming it, as at END."""
    folder = tmp_path / "live"
    write_episode(folder, [good(0), good(1)], prompt="p", end=False)
    temporary = folder / "tmpabcdefgh.safetensors"
    os.rename(folder / "step_000001.safetensors", temporary)
    clock = FakeClock([lambda: None, lambda: os.rename(temporary, folder / "step_000001.safetensors"),
                       lambda: (folder / "END").touch()])
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert _drain(scheduler) == [("live", 0), ("live", 1), ("live", "end_marker")]

    stuck = tmp_path / "stuck"
    write_episode(stuck, [good(0)], prompt="p", end=False)
    (stuck / "tmpabcdefgh.safetensors").write_bytes(b"half")  # a writer killed mid-write before the run started
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([stuck]), follow=True, idle_timeout=5, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert isinstance(scheduler.next(), StepTask)
    ended = scheduler.next()
    assert isinstance(ended, EpisodeEnded) and ended.reason == "error", ended
    assert str(ended.error) == TEMPORARY_LEFT.format(stuck / "tmpabcdefgh.safetensors")


def test_an_episode_joining_a_watched_folder_with_its_first_step_under_a_temporary_name_waits_for_it(tmp_path):
    """A robot that starts its next episode in a watched folder of episodes by writing step 0 under tempfile's name
    (robots/b/tmpabcdefgh.safetensors) and renaming it: the folder joins the run at that file, and the episode's first
    poll took it for a stray file there from the start, failing the episode with "step file name has no step
    number". It is waited for as in an episode that was there from the start; one still there at END fails it."""
    data = tmp_path / "robots"
    write_episode(data / "a", [good(0)], prompt="p")
    temporary = data / "b" / "tmpabcdefgh.safetensors"

    def start_b() -> None:
        (data / "b").mkdir()
        write_step(data / "b", 0, good(0))
        os.rename(data / "b" / "step_000000.safetensors", temporary)

    clock = FakeClock([start_b, lambda: None, lambda: os.rename(temporary, data / "b" / "step_000000.safetensors"),
                       lambda: (data / "b" / "END").touch()])
    assert _drain(_watching(data, clock)) == [("a", 0), ("a", "end_marker"), ("b", 0), ("b", "end_marker")]

    stray = data / "c" / "notes.safetensors"  # joining with a file that is never renamed: it fails at END

    def start_c() -> None:
        (data / "c").mkdir()
        write_step(data / "c", 0, good(0))
        os.rename(data / "c" / "step_000000.safetensors", stray)

    clock = FakeClock([start_c, lambda: None, lambda: (data / "c" / "END").touch()])
    scheduler = _watching(data, clock)
    ended = [item for item in iter(scheduler.next, None) if item.episode.name == "c"]
    assert [(item.reason, str(item.error)) for item in ended] == [
        ("error", f"{stray}: step file name has no step number")]


@pytest.mark.parametrize("temporary", ["tmpk3jx9a1b.safetensors", "step_000001.tmp.safetensors",
                                       "step_000001.npz.tmp.npz", "tmpqzxk_wa0.safetensors"])
def test_follow_waits_for_a_temporary_name_holding_a_digit_until_renamed(tmp_path, temporary):
    """A recorder that writes a step under a temporary name and renames it, the whole file sitting there for a few
    polls first (an fsync on slow storage): tempfile's tmpk3jx9a1b.safetensors (11 names in 12 hold a digit),
    step_000001.tmp.safetensors, np.savez's step_000001.npz.tmp.npz. The name was numbered by its last integer and
    the file taken as a step, so the rename made "two files for step 1" (tmpqzxk_wa0, numbered 0: "two files for step
    0" at once; in an episode that starts at a later step, "step 0 arrived after step N had already run"). It is waited for until renamed, as a name without a step number is."""
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    suffix = "." + temporary.rsplit(".", 1)[1]
    final = folder / f"step_000001{suffix}"

    def write() -> None:
        write_step(folder, 1, good(1), format=suffix[1:])
        os.rename(final, folder / temporary)

    clock = FakeClock([write, lambda: None, lambda: None, lambda: None, lambda: os.rename(folder / temporary, final),
                       lambda: write_step(folder, 2, good(2)), lambda: (folder / "END").touch()])
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert _drain(scheduler) == [("live", 0), ("live", 1), ("live", 2), ("live", "end_marker")]


def test_a_temporary_name_in_capitals_is_a_temporary_name_not_a_step_to_rename(tmp_path):
    """step_000001.tmp.SAFETENSORS, a writer's temporary name with its suffix in capitals, was taken for a step file in
    other case: with --follow it failed its episode at once, and without it the hint said to rename it to
    step_000001.tmp.safetensors, which is then refused as a temporary name. It is a temporary name in any case:
    waited for until renamed, and left in an episode, refused as one."""
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    temporary = folder / "step_000001.tmp.SAFETENSORS"

    def write() -> None:
        write_step(folder, 1, good(1))
        os.rename(folder / "step_000001.safetensors", temporary)

    clock = FakeClock([write, lambda: None, lambda: os.rename(temporary, folder / "step_000001.safetensors"),
                       lambda: (folder / "END").touch()])
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert _drain(scheduler) == [("live", 0), ("live", 1), ("live", "end_marker")]

    left = tmp_path / "left"
    write_episode(left, [good(0), good(1)], prompt="p")
    os.rename(left / "step_000001.safetensors", left / temporary.name)
    ended = StepScheduler(discover_episodes([left])).next()
    assert isinstance(ended, EpisodeEnded) and ended.reason == "error", ended
    assert str(ended.error) == TEMPORARY_LEFT.format(left / temporary.name), ended.error


def test_a_temporary_name_holding_a_digit_left_in_an_episode_fails_it_naming_it(tmp_path, frozen_wall):
    """A recorder killed between writing a step under tempfile's name and renaming it leaves tmpk3jx9a1b.safetensors:
    without --follow it ran as step 1 (its last integer), silently; with --follow it was taken as step 1 too. It
    fails its episode saying it looks like a writer's temporary file, without --follow and with it at END or the idle
    timeout (once it stopped changing)."""
    message = TEMPORARY_LEFT
    left = tmp_path / "left"
    write_episode(left, [good(0), good(1)], prompt="p")
    os.rename(left / "step_000001.safetensors", left / "tmpk3jx9a1b.safetensors")
    ended = StepScheduler(discover_episodes([left])).next()
    assert isinstance(ended, EpisodeEnded) and ended.reason == "error", ended
    assert str(ended.error) == message.format(left / "tmpk3jx9a1b.safetensors")
    assert "delete it, or rename it" in ended.error.hint

    # following: at END (once it counts: step 0 runs first), and at the idle timeout (its growth kept the episode
    # going until it stopped)
    scheduler = StepScheduler(discover_episodes([left]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=(clock := FakeClock()), sleep=clock.sleep)
    assert scheduler.next().file.step == 0
    ended = scheduler.next()
    assert isinstance(ended, EpisodeEnded) and ended.reason == "error", ended
    assert str(ended.error) == message.format(left / "tmpk3jx9a1b.safetensors")
    stuck = tmp_path / "stuck"
    write_episode(stuck, [good(0)], prompt="p", end=False)
    temporary = stuck / "step_000001.part.safetensors"

    def grow() -> None:
        with open(temporary, "ab") as f:
            f.write(b"x")

    clock = FakeClock([lambda: None, grow, lambda: None, grow, lambda: None, grow])
    scheduler = StepScheduler(discover_episodes([stuck]), follow=True, idle_timeout=2, poll_interval=1, clock=clock,
                              sleep=clock.sleep)
    assert scheduler.next().file.step == 0
    ended = scheduler.next()
    assert isinstance(ended, EpisodeEnded) and ended.reason == "error", ended
    assert str(ended.error) == message.format(temporary)
    assert clock.now >= 6 + 2  # not before it stopped growing


def test_step_names_stay_step_files_and_temporary_names_do_not(tmp_path):
    """Every step name read so far keeps its number; tempfile's exact pattern, and a .tmp/.temp/.part/.partial part
    in the stem, are temporary (tmp00000001.npz too: tempfile's pattern)."""
    for name, step in [("step_000001.safetensors", 1), ("cam2.npz", 2), ("frame12.npz", 12), ("0001.safetensors", 1),
                       ("tmp_000003.npz", 3), ("template07.npz", 7), ("step_4.partition.npz", 4),
                       ("tmpk3jx9a1bc.safetensors", 1), ("parts.5.npz", 5),
                       # a marker that does not end the stem is no writer's: a temperature sensor's, an episode's name
                       ("temp.000001.npz", 1), ("ep1.part.000003.safetensors", 3), ("cam.TMP.7.npz", 7)]:
        assert not is_temporary_name(name) and step_number(tmp_path / name) == step, name
    for name in ["tmpk3jx9a1b.safetensors", "tmp00000001.npz", "tmpabcdefgh.safetensors", "step_000001.tmp.safetensors",
                 "step_000001.npz.tmp.npz", "step_1.TEMP.npz", "step_1.part.safetensors", "step_1.partial.npz"]:
        assert is_temporary_name(name), name
        with pytest.raises(ObservationError, match="looks like a writer's temporary file"):
            step_number(tmp_path / name)
    for step in range(3):  # write_step's own names
        assert not is_temporary_name(write_step(tmp_path / "e", step, good(step), format="npz").name)
    assert [f.step for f in EpisodeSource("e", tmp_path / "e").scan()] == [0, 1, 2]


def test_a_step_file_that_arrived_after_its_episode_ended_is_named_beside_a_temporary_name(tmp_path):
    """The late-file warning (and summary.json's late_steps) scanned the ended episode's folder as without --follow:
    a writer's temporary file there (tmpabcdefgh.safetensors, its next step under way) raised "no step number", and
    the step file that arrived after END went unnamed."""
    a, b = tmp_path / "a", tmp_path / "b"
    write_episode(a, [good(0)], prompt="p")
    write_episode(b, [good(0)], prompt="p", end=False)

    def late() -> None:
        write_step(a, 1, good(1))
        write_step(a, 2, good(2))
        os.rename(a / "step_000002.safetensors", a / "tmpabcdefgh.safetensors")

    clock, warnings = FakeClock([lambda: None, late, lambda: None, lambda: (b / "END").touch()]), []
    scheduler = StepScheduler(discover_episodes([a, b]), follow=True, idle_timeout=100, poll_interval=1, clock=clock,
                              sleep=clock.sleep, warn=warnings.append)
    assert _drain(scheduler) == [("a", 0), ("a", "end_marker"), ("b", 0), ("b", "end_marker")]
    assert scheduler.late == {"a": ["step_000001.safetensors"]}
    assert warnings == [f"episode 'a': step_000001.safetensors arrived in {a} after its END file was seen and did not "
                        "run (--resume runs it)"]


def test_follow_a_second_file_for_a_step_already_taken_fails_the_episode(tmp_path):
    folder = tmp_path / "live"
    write_episode(folder, [good(0), good(1)], prompt="p", end=False)
    clock = FakeClock()
    clock.actions = [lambda: None, lambda: write_step(folder, 1, good(1), format="npz"), lambda: None, lambda: None]
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    assert [scheduler.next().file.step for _ in range(2)] == [0, 1]
    item = scheduler.next()
    assert isinstance(item, EpisodeEnded) and item.reason == "error", item
    assert "two files for step 1: step_000001.safetensors and step_000001.npz" in str(item.error)


def test_an_empty_folder_followed_as_an_episode_says_so_when_episode_folders_are_made_in_it(tmp_path):
    # `--follow data/` started before the robots made their first episode folders: data/ was empty, so it was
    # followed as one episode, and its idle timeout failed it with "no step file arrived" while robot_a/ held
    # steps. The error now names the folders made in it and how to follow them.
    data = tmp_path / "data"
    data.mkdir()
    clock = FakeClock()
    clock.actions = [lambda: write_episode(data / "robot_a", [good(0)], prompt="p", end=False)]
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=3, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    (ended,) = [scheduler.next()]
    assert isinstance(ended, EpisodeEnded) and ended.reason == "error"
    message = f"{ended.error}\n{ended.error.hint}"
    assert f"{data}: no step file arrived within --idle-timeout 3 s; episode folders were made in it since " \
           "(robot_a): it was empty when the run started, so it was followed as one episode" in message
    assert f"make one episode folder in it before the run (mkdir -p {data / 'robot_a'}): --follow then takes it " \
           "for a folder of episodes, and follows each episode folder made in it" in message
    assert scheduler.next() is None

    # an empty folder that stays empty (a robot that never wrote) keeps the plain message
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    clock = FakeClock()
    clock.actions = [lambda: (quiet / "notes").mkdir()]  # a folder without step files is no episode
    scheduler = StepScheduler(discover_episodes([quiet]), follow=True, idle_timeout=3, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    ended = scheduler.next()
    assert ended.episode.path == quiet and ended.reason == "error" and "made in it" not in str(ended.error)
    assert "check that the robot writes step_000000.safetensors" in ended.error.hint


def test_episodes_one_level_down_of_a_followed_folder_are_named_as_there_from_the_start(tmp_path):
    """`--follow data` of data/run1/episode_000/step_*: run1 failed at the idle timeout saying its episode folders
    "were made in it since ...: it was empty when the run started" (they were there before), and the run's end
    warned that run1 "never joined the run", of the episode it had just failed. As without --follow, the error names
    them one level down and the folder to give."""
    data = tmp_path / "data"
    for name in ("episode_000", "episode_001"):
        write_episode(data / "run1" / name, [good(0)], prompt="p")
    clock, warnings = FakeClock(), []
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=3, poll_interval=1, clock=clock,
                              sleep=clock.sleep, watch=[data], warn=warnings.append)
    ended = scheduler.next()
    assert isinstance(ended, EpisodeEnded) and ended.reason == "error", ended
    assert str(ended.error) == (f"{data / 'run1'}: no step file arrived within --idle-timeout 3 s; its sub-folders "
                                "episode_000, episode_001 look like episode folders, one level down")
    assert ended.error.hint.startswith(f"give {data / 'run1'} as EPISODE: a folder of episode folders runs each")
    assert scheduler.next() is None and warnings == []


def test_episodes_nested_in_a_followed_folder_after_the_start_are_named_with_the_folder_to_give(tmp_path):
    """Episode folders one or two levels too deep that a robot made after the run's first poll: `--follow data` of
    data/run1 (empty) gaining run1/episode_000 failed run1 saying they "were made in it since ...: it was empty when
    the run started", hinting to mkdir one before the run (which fails as one level down); an empty data/ gaining
    data/run1/episode_000 said only "no step file arrived". Each now names the folder to give, as the first poll
    does."""
    data = tmp_path / "data"
    (data / "run1").mkdir(parents=True)
    write_episode(data / "arm_a", [good(0)], prompt="p")
    clock, warnings = FakeClock(), []
    clock.actions = [lambda: write_episode(data / "run1" / "episode_000", [good(0)], prompt="p")]
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=3, poll_interval=1, clock=clock,
                              sleep=clock.sleep, watch=[data], warn=warnings.append)
    items = []
    while (item := scheduler.next()) is not None:
        items.append(item)
        if isinstance(item, EpisodeEnded) and item.reason == "error":
            error = item.error
    assert [(i.episode.name, getattr(i, "reason", None)) for i in items] == [
        ("arm_a", None), ("arm_a", "end_marker"), ("run1", "error")]
    assert str(error) == (f"{data / 'run1'}: no step file arrived within --idle-timeout 3 s; its sub-folders "
                          "episode_000 look like episode folders, one level down")
    assert error.hint.startswith(f"give {data / 'run1'} as EPISODE: a folder of episode folders runs each")
    assert warnings == []  # run1, an episode of the run, is not said to have never joined it

    empty = tmp_path / "empty"
    empty.mkdir()
    clock = FakeClock([lambda: write_episode(empty / "run1" / "episode_000", [good(0)], prompt="p")])
    scheduler = StepScheduler(discover_episodes([empty]), follow=True, idle_timeout=3, poll_interval=1, clock=clock,
                              sleep=clock.sleep)
    ended = scheduler.next()
    assert isinstance(ended, EpisodeEnded) and ended.reason == "error", ended
    assert str(ended.error) == (f"{empty}: no step file arrived within --idle-timeout 3 s; its sub-folder run1 holds "
                                "episode folders (episode_000), two levels down")
    assert ended.error.hint.startswith(f"give {empty / 'run1'} as EPISODE")
    assert scheduler.next() is None


def _watching(data, clock, *, idle_timeout=5, added=None):
    """A follower of the folder of episodes ``data`` that watches it for new episode folders."""
    return StepScheduler(discover_episodes([data]), follow=True, idle_timeout=idle_timeout, poll_interval=1,
                         clock=clock, sleep=clock.sleep, watch=[data],
                         on_new_episode=(added if added is not None else []).append)


def test_an_episode_folder_made_in_a_watched_folder_of_episodes_joins_the_run(tmp_path):
    # `--follow robots/`: a robot starting its next episode in robots/ while the run follows it used to be left out
    # (named in a warning at the end). Its folder is now an episode of the run, announced before its first step.
    data = tmp_path / "robots"
    write_episode(data / "arm_a", [good(0)], prompt="p", end=False)
    clock = FakeClock()
    clock.actions = [lambda: write_episode(data / "arm_a", [good(1)], first_step=1),
                     lambda: (data / "arm_b").mkdir(),  # made, nothing in it yet: not an episode yet
                     lambda: (data / ".cache").mkdir() or write_episode(data / ".cache" / "x", [good(0)]),  # hidden
                     lambda: write_episode(data / "arm_b", [good(0), good(1)], prompt="p")]
    added: list[EpisodeSource] = []
    scheduler = _watching(data, clock, added=added)
    items = []
    while (item := scheduler.next()) is not None:
        name = item.episode.name
        items.append((name, item.file.step if isinstance(item, StepTask) else item.reason))
        if name == "arm_b":
            assert [e.name for e in added] == ["arm_b"]  # announced before any of its items
    assert items == [("arm_a", 0), ("arm_a", 1), ("arm_a", "end_marker"), ("arm_b", 0), ("arm_b", 1),
                     ("arm_b", "end_marker")]
    assert [(e.name, e.path) for e in added] == [("arm_b", data / "arm_b")]


@pytest.mark.parametrize("renamed", [True, False])
@pytest.mark.parametrize("replaced", ["the_folder_of_episodes", "the_episode_folder", "the_episode_folder_deleted",
                                      "by_a_folder_of_its_inode_number"])
def test_a_folder_made_where_a_finished_episode_of_a_watched_folder_was_read_is_named_and_joins_once_renamed(
        tmp_path, replaced, renamed):
    """robots/ renamed away and made again (a recorder's new day), or a finished robots/ep1 moved away and, a poll
    later, an episode folder made under its name (a robot numbering from ep1 again): it never joined, without a word,
    and the run's end said its step 1 "arrived after its END file was seen" and that --resume runs it (on the old
    ep1's history). It is named as another folder where episode ep1 was read, and joins once renamed."""
    data = tmp_path / "robots"
    write_episode(data / "ep1", [good(0)], prompt="p")

    def make():
        write_episode(data / "ep1", [good(0), good(1)], prompt="p")

    def rotate():
        data.rename(tmp_path / "robots.old")
        data.mkdir()
        make()

    if replaced == "the_folder_of_episodes":  # at once: the new folder's names are all looked at
        away = [rotate]
    elif replaced == "the_episode_folder":  # moved (its inode number stays its own), a poll later one made there
        away = [lambda: (data / "ep1").rename(tmp_path / "ep1.done"), make]
    elif replaced == "the_episode_folder_deleted":  # ext4 often gives the folder made next its inode number
        away = [lambda: shutil.rmtree(data / "ep1"), make]
    else:  # as ext4 reusing it does, every time: it was taken for ep1's own folder, its step 1 for a late file
        def refill():
            for file in (tmp_path / "ep1.done").iterdir():
                file.unlink()
            write_episode(tmp_path / "ep1.done", [good(0), good(1)], prompt="p")
            (tmp_path / "ep1.done").rename(data / "ep1")

        away = [lambda: (data / "ep1").rename(tmp_path / "ep1.done"), refill]
    clock = FakeClock([lambda: None, *away, lambda: None] + [lambda: (data / "ep1").rename(data / "ep1-2")] * renamed)
    warnings: list[str] = []
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=5, poll_interval=1, clock=clock,
                              sleep=clock.sleep, watch=[data], warn=warnings.append)
    joined = [("ep1-2", 0), ("ep1-2", 1), ("ep1-2", "end_marker")] if renamed else []
    assert _drain(scheduler) == [("ep1", 0), ("ep1", "end_marker"), *joined]
    assert warnings == [
        f"{data / 'ep1'} did not join the run: episode 'ep1' of this run was read from that path, and this is another "
        "folder (the one it read was deleted or moved away, or the folder of episodes replaced), so its steps do not "
        f"run (rename it to a name this run has not used, such as {data / 'ep1-2'}, and it joins; or run it in a new "
        "--out)"]  # not its step 1 as a late file of episode ep1
    assert scheduler.late == {}


def test_a_folder_made_as_a_finished_episode_went_no_poll_between_is_named_once_when_the_run_ends(tmp_path):
    """ep1 moved away and another ep1 made at once (no listing of robots/ between: a step's forward ran), robots/
    watched twice (given also as a link to it): the new ep1 was passed over without a word, and a folder found by a
    poll was named once per time its folder of episodes was given."""
    data = tmp_path / "robots"
    write_episode(data / "ep1", [good(0)], prompt="p")
    (tmp_path / "link").symlink_to(data)

    def swap():
        (data / "ep1").rename(tmp_path / "ep1.done")
        write_episode(data / "ep1", [good(0), good(1)], prompt="p")

    clock = FakeClock([lambda: None, swap])
    warnings: list[str] = []
    watch = [data, tmp_path / "link", data]
    scheduler = StepScheduler(discover_episodes(watch), follow=True, idle_timeout=5, poll_interval=1, clock=clock,
                              sleep=clock.sleep, watch=watch, warn=warnings.append)
    assert _drain(scheduler) == [("ep1", 0), ("ep1", "end_marker")]
    assert [w.split(":")[0] for w in warnings] == [f"{data / 'ep1'} did not join the run"], warnings
    assert scheduler.late == {}


def test_a_folder_made_where_a_finished_episode_was_read_is_told_a_name_free_in_its_folder(tmp_path):
    """Yesterday's ep1 renamed to ep1-2 as told, today's ep1 was told ep1-2 too: `mv robots/ep1 robots/ep1-2` put it
    inside that episode's folder, where it never joins."""
    data = tmp_path / "robots"
    for name in ("ep1", "ep1-2"):
        write_episode(data / name, [good(0)], prompt="p")
    clock = FakeClock([lambda: None, lambda: (data / "ep1").rename(tmp_path / "ep1.done"),
                       lambda: write_episode(data / "ep1", [good(0)], prompt="p")])
    warnings: list[str] = []
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=5, poll_interval=1, clock=clock,
                              sleep=clock.sleep, watch=[data], warn=warnings.append)
    _drain(scheduler)
    assert len(warnings) == 1 and f"such as {data / 'ep1-3'}, and it joins" in warnings[0], warnings


def test_a_finished_episode_whose_first_step_file_was_cleaned_up_is_still_its_own_folder(tmp_path):
    """A cleanup of the steps that ran deleting ep1's step 0, then a late step 1: the same folder (inode number, and
    no other file under its first step file's name), whose late file is named, not another folder."""
    data = tmp_path / "robots"
    write_episode(data / "ep1", [good(0)], prompt="p")
    clock = FakeClock([lambda: None, lambda: ((data / "ep1" / "step_000000.safetensors").unlink(),
                                              write_step(data / "ep1", 1, good(1)))])
    warnings: list[str] = []
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=5, poll_interval=1, clock=clock,
                              sleep=clock.sleep, watch=[data], warn=warnings.append)
    assert _drain(scheduler) == [("ep1", 0), ("ep1", "end_marker")]
    assert scheduler.late == {"ep1": ["step_000001.safetensors"]}
    assert [w.split(":")[0] for w in warnings] == ["episode 'ep1'"], warnings


def _running(scheduler: StepScheduler) -> list[tuple[str, int | str]]:
    """``_drain``, telling the scheduler the SHA-256 of each step file handed out, as the rollout does once it read
    the file to run it."""
    items = []
    while (item := scheduler.next()) is not None:
        if isinstance(item, StepTask):
            scheduler.ran(item.episode.name, item.file, step_sha256(item.file.path))
            items.append((item.episode.name, item.file.step))
        else:
            items.append((item.episode.name, item.reason))
    return items


@pytest.mark.parametrize("resumed", [False, True], ids=["ran", "resumed"])
@pytest.mark.parametrize("change", ["touched", "copied_over_in_place", "rewritten_as_a_new_file"])
def test_a_finished_episode_whose_first_step_file_has_the_bytes_that_ran_is_still_its_own_folder(
        tmp_path, change, resumed):
    """ep1's step 0 touched (`touch`), copied over in place with the same bytes (`cp -r` over the folder), or
    rewritten the same as a new file (a sync tool's temporary file renamed over it) once ep1 ended, then a late
    step 1: its inode number or mtime changed, and the run said ep1 "did not join the run: ... this is another
    folder ... rename it", of the episode's own folder. It holds the bytes that ran (their SHA-256 when the step ran,
    or on --resume results.jsonl's input_sha256): its late file is named instead."""
    data = tmp_path / "robots"
    write_episode(data / "ep1", [good(0)], prompt="p")
    first = data / "ep1" / "step_000000.safetensors"
    ran_with = step_sha256(first)

    def change_it():
        st, raw = first.stat(), first.read_bytes()
        if change == "copied_over_in_place":
            first.write_bytes(raw)
        elif change == "rewritten_as_a_new_file":
            (data / "ep1" / ".step_000000.safetensors.Ab3dE9").write_bytes(raw)
            os.replace(data / "ep1" / ".step_000000.safetensors.Ab3dE9", first)
        os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched: a later mtime, on any clock
        write_step(data / "ep1", 1, good(1))

    clock = FakeClock([lambda: None, change_it])
    warnings: list[str] = []
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=5, poll_interval=1, clock=clock,
                              sleep=clock.sleep, watch=[data], warn=warnings.append,
                              done={"ep1": {0: 0}} if resumed else None,
                              digests={"ep1": {0: ran_with}} if resumed else None)
    assert _running(scheduler) == ([] if resumed else [("ep1", 0)]) + [("ep1", "end_marker")]
    assert scheduler.late == {"ep1": ["step_000001.safetensors"]}
    assert warnings == [f"episode 'ep1': step_000001.safetensors arrived in {data / 'ep1'} after its END file was "
                        "seen and did not run (--resume runs it)"]


@pytest.mark.parametrize("reused", [False, True], ids=["deleted", "given_its_inode_number"])
def test_a_folder_made_where_a_finished_episode_was_read_with_another_first_step_is_named_its_digest_known(
        tmp_path, reused):
    """The SHA-256 of ep1's first step file is known (it ran); ep1 deleted and another ep1 made there, whose first
    step holds other bytes (as ext4 reusing the inode numbers does every time, given its folder's): another folder,
    named as one, and its step 1 is not a late file of ep1's."""
    data = tmp_path / "robots"
    write_episode(data / "ep1", [good(0)], prompt="p")

    def remake():
        if not reused:
            shutil.rmtree(data / "ep1")
            write_episode(data / "ep1", [good(7), good(1)], prompt="p")
            return
        (data / "ep1").rename(tmp_path / "ep1.done")
        for file in (tmp_path / "ep1.done").iterdir():
            file.unlink()
        write_episode(tmp_path / "ep1.done", [good(7), good(1)], prompt="p")
        (tmp_path / "ep1.done").rename(data / "ep1")

    clock = FakeClock([lambda: None, remake])
    warnings: list[str] = []
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=5, poll_interval=1, clock=clock,
                              sleep=clock.sleep, watch=[data], warn=warnings.append)
    assert _running(scheduler) == [("ep1", 0), ("ep1", "end_marker")]
    assert [w.split(":")[0] for w in warnings] == [f"{data / 'ep1'} did not join the run"], warnings
    assert scheduler.late == {}


def _bytes_read() -> int:
    """What this process read so far (/proc/self/io's rchar): how much of a file a check read, without timing it."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's /proc/self/io")
@pytest.mark.parametrize("size", ["another_size", "its_size"])
def test_a_finished_episodes_first_step_file_replaced_is_read_at_most_once_and_not_at_another_size(tmp_path, size):
    """ep1 ended, and another file was put under its first step file's name (a folder made again there, or a step
    written again). A file of another size than the one taken cannot hold the bytes that ran: a 256 MiB one was read
    whole, twice, as the run ended (it names the folder as another, whose check read it again); one of its size is
    read once, however many times the folder is looked at."""
    data = tmp_path / "robots"
    camera = np.zeros((2048, 2048, 4), np.uint8)  # a 16 MiB first step
    write_episode(data / "ep1", [{"camera": camera, "joints": np.zeros(7, np.float32)}], prompt="p")
    first = data / "ep1" / "step_000000.safetensors"
    taken_size = first.stat().st_size
    read_at_change = []

    def replace():
        first.unlink()
        with open(first, "wb") as f:
            if size == "another_size":
                f.truncate(256 << 20)  # sparse: nothing on disk, all of it to read
            else:
                f.write(os.urandom(1024) + bytes(taken_size - 1024))
        read_at_change.append(_bytes_read())

    clock = FakeClock([lambda: None, replace])
    warnings: list[str] = []
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=5, poll_interval=1, clock=clock,
                              sleep=clock.sleep, watch=[data], warn=warnings.append)
    assert _running(scheduler) == [("ep1", 0), ("ep1", "end_marker")]
    read = _bytes_read() - read_at_change[0]
    assert [w.split(":")[0] for w in warnings] == [f"{data / 'ep1'} did not join the run"], warnings
    if size == "another_size":
        assert read < 1 << 20, f"{read >> 20} MiB read"
    else:
        assert taken_size <= read < 2 * taken_size, f"{read >> 20} MiB read"


def test_what_never_joined_a_watched_folder_of_episodes_is_named_when_the_run_ends(tmp_path):
    """A robot writing its episodes one level deeper (robots/2026-12-03/ep1) or its steps into robots/ itself: the
    followed run ended ok with none of them run and no word (a run without --follow fails such a folder). Each is
    named in a warning at the end; a folder of ardiff's own runs there, hidden ones and empty ones are not."""
    data = tmp_path / "robots"
    write_episode(data / "arm_a", [good(0)], prompt="p")
    write_episode(data / "old-runs" / "r1" / "episodes" / "arm_a", [good(0)], prompt="p")
    (data / "old-runs" / "r1" / "run.json").write_text("{}")
    clock = FakeClock([lambda: write_episode(data / "2026-12-03" / "ep1", [good(0)], prompt="p"),
                       lambda: write_step(data, 0, good(0), prompt="p"),
                       lambda: (data / ".staging").mkdir(),
                       lambda: (data / "arm_c").mkdir(),  # a robot that has not started: no word
                       lambda: (data / "notes" / "old").mkdir(parents=True)])
    warnings: list[str] = []
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=5, poll_interval=1, clock=clock,
                              sleep=clock.sleep, watch=[data], warn=warnings.append)
    assert _drain(scheduler) == [("arm_a", 0), ("arm_a", "end_marker")]
    assert warnings == [
        f"{data}: 2026-12-03 never joined the run: its sub-folders ep1 look like episode folders, one level deeper "
        f"than a folder of episodes is watched (give {data / '2026-12-03'} as EPISODE)",
        f"{data}: notes never joined the run: no step file, END or episode.yaml came in it, only other files or "
        "folders (a folder of episodes is watched for episode folders in it, not deeper: give a deeper folder of "
        "episodes as EPISODE)",
        f"{data}: step_000000.safetensors did not run: a followed folder of episodes runs the step files of the "
        "episode folders in it, not its own"]


def test_the_folders_a_followed_run_says_to_make_or_give_are_one_shell_word_whatever_their_names(tmp_path,
                                                                                                  monkeypatch):
    # A folder of episodes given relative, named with a leading '-' (and a space, a quote, a $, a non-ASCII letter):
    # `mkdir -p '-r ü/robot_a'` was refused by mkdir as options, and `give '-r ü/2026-12-03' as EPISODE` by ardiff
    monkeypatch.chdir(tmp_path)
    data = Path("-r ü $x 'q")  # as the command line gave it
    data.mkdir()
    clock = FakeClock([lambda: write_episode(data / "robot_a", [good(0)], prompt="p", end=False)])
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=3, poll_interval=1, clock=clock,
                              sleep=clock.sleep)
    (ended,) = [scheduler.next()]
    mkdir = re.search(r"\(mkdir -p (.*)\): --follow then", ended.error.hint)
    assert mkdir is not None, ended.error.hint
    assert shlex.split(mkdir.group(1)) == [f"./{data / 'robot_a'}"]  # one word, not an option

    shutil.rmtree(data / "robot_a")
    write_episode(data / "arm_a", [good(0)], prompt="p")
    clock = FakeClock([lambda: write_episode(data / "2026-12-03" / "ep1", [good(0)], prompt="p")])
    warnings: list[str] = []
    scheduler = StepScheduler(discover_episodes([data]), follow=True, idle_timeout=5, poll_interval=1, clock=clock,
                              sleep=clock.sleep, watch=[data], warn=warnings.append)
    assert _drain(scheduler) == [("arm_a", 0), ("arm_a", "end_marker")]
    give = re.search(r"\(give (.*) as EPISODE\)$", warnings[0])
    assert give is not None, warnings
    assert shlex.split(give.group(1)) == [f"./{data / '2026-12-03'}"]


def test_a_watched_folder_of_episodes_taken_away_ends_the_run_naming_its_episodes_not_crashing_it(tmp_path):
    """`--follow robots/`, and robots/ is moved away (an uploader archiving it) while followed: its episodes fail as
    gone, and watching it for new episode folders stops finding any; the run ends an --idle-timeout later."""
    data = tmp_path / "robots"
    write_episode(data / "arm_a", [good(0)], prompt="p", end=False)
    clock = FakeClock([lambda: shutil.move(data, tmp_path / "archived")])
    scheduler = _watching(data, clock, idle_timeout=5)
    items = []
    while (item := scheduler.next()) is not None:
        items.append((item.episode.name, item.reason, str(item.error)))
    assert items == [("arm_a", "error", f"{data / 'arm_a'}: the episode folder is gone (deleted or renamed while it "
                                        "was followed); 0 of its steps had arrived")]
    assert clock.now == 6  # the move at 1 s, then 5 s with no episode folder made


def test_a_watched_folder_of_episodes_ends_idle_timeout_after_its_last_episode_ended(tmp_path):
    # The run waits --idle-timeout after its last episode ended for a robot to start another; one that starts
    # within it runs (and restarts the wait), and the run ends a whole --idle-timeout after the last end.
    data = tmp_path / "robots"
    write_episode(data / "arm_a", [good(0)], prompt="p")
    clock = FakeClock()
    ends, made = {}, []
    clock.actions = [lambda: None] * 3 + [lambda: made.append(clock.now) or write_episode(data / "arm_b", [good(0)])]
    scheduler = _watching(data, clock, idle_timeout=5)
    while (item := scheduler.next()) is not None:
        if isinstance(item, EpisodeEnded):
            ends[item.episode.name] = clock.now
    assert list(ends) == ["arm_a", "arm_b"]
    assert 2 <= made[0] - ends["arm_a"] < 5  # arm_b came seconds after arm_a ended, within its idle timeout
    assert clock.now == ends["arm_b"] + 5  # then nothing came for 5 s


def test_watching_takes_each_folder_once_and_skips_what_is_not_an_episode(tmp_path):
    # A link to an episode already run is that episode; a file or a run's output folder is no episode. Over many
    # polls, each new folder is announced once.
    data = tmp_path / "robots"
    write_episode(data / "arm_a", [good(0)], prompt="p")
    clock = FakeClock()

    def a_run_folder() -> None:  # an --out made in robots/, holding an END of its own
        (data / "run").mkdir()
        for name in ("run.json", "END"):
            (data / "run" / name).write_text("{}")

    clock.actions = [lambda: (data / "arm_a_link").symlink_to(data / "arm_a"),
                     lambda: (data / "notes.txt").write_text("x"), a_run_folder,
                     lambda: write_episode(data / "arm_b", [good(0)], prompt="p")]
    added: list[EpisodeSource] = []
    assert [item for item in _drain(_watching(data, clock, idle_timeout=8, added=added))] == [
        ("arm_a", 0), ("arm_a", "end_marker"), ("arm_b", 0), ("arm_b", "end_marker")]
    assert [e.name for e in added] == ["arm_b"]


def test_a_new_episode_folder_takes_a_name_no_episode_of_the_run_has(tmp_path):
    # Names are session ids and output folders: a new robots/pick beside an episode `pick` from another folder
    # is `pick-2`, as two EPISODE arguments of one name are.
    other, data = tmp_path / "other", tmp_path / "robots"
    write_episode(other / "pick", [good(0)], prompt="p")
    write_episode(data / "arm_a", [good(0)], prompt="p")
    clock = FakeClock([lambda: write_episode(data / "pick", [good(0)], prompt="p")])
    added: list[EpisodeSource] = []
    scheduler = StepScheduler(discover_episodes([other / "pick", data]), follow=True, idle_timeout=5,
                              poll_interval=1, clock=clock, sleep=clock.sleep, watch=[data],
                              on_new_episode=added.append)
    assert ("pick-2", 0) in _drain(scheduler)
    assert [(e.name, e.path) for e in added] == [("pick-2", data / "pick")]


def test_without_a_watched_folder_a_followed_run_ends_when_its_episodes_end(tmp_path):
    # EPISODE arguments that are episodes themselves: nothing to wait for once they ended.
    write_episode(tmp_path / "a", [good(0)], prompt="p")
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([tmp_path / "a"]), follow=True, idle_timeout=50, poll_interval=1,
                              clock=clock, sleep=clock.sleep, watch=[])
    assert _drain(scheduler) == [("a", 0), ("a", "end_marker")]
    assert clock.now < 50


def test_a_dropped_episodes_steps_are_no_longer_pending(tmp_path):
    """The progress total is recounted after a failure as done + num_pending(): the failed episode's remaining
    steps never run, so they must leave the count."""
    scheduler = StepScheduler(_episodes(tmp_path, {"a": 5, "b": 3}), order="round-robin")
    assert scheduler.num_pending() == 8
    first = scheduler.next()
    assert isinstance(first, StepTask) and (first.episode.name, first.file.step) == ("a", 0)
    assert scheduler.num_pending() == 7
    scheduler.drop("a")  # its step 0 failed: steps 1..4 never run
    assert scheduler.num_pending() == 3
    names = []
    while (item := scheduler.next()) is not None:
        names.append((item.episode.name, item.file.step if isinstance(item, StepTask) else item.reason))
        if isinstance(item, StepTask):
            assert scheduler.num_pending() == 3 - item.file.step - 1
    assert names == [("b", 0), ("b", 1), ("b", 2), ("b", "complete")]


def test_follow_sequential_waits_for_the_first_episodes_next_step_instead_of_starting_the_next_episode(tmp_path):
    """--order sequential finishes an episode before starting the next, also while following: when the first
    episode's next step has not arrived yet, the scheduler waits for it; it does not run the next episode's
    steps meanwhile (which would be round-robin by another name)."""
    from ardiff_cli.io import end_episode, write_step
    from fake_clock import FakeClock

    write_episode(tmp_path / "a", [good(0)], prompt="p", end=False)  # the robot is still recording
    write_episode(tmp_path / "b", [good(0), good(1)], prompt="p")  # complete, with END
    arrive = [lambda: None, lambda: None, lambda: write_step(tmp_path / "a", 1, good(1)), lambda: None,
              lambda: None, lambda: end_episode(tmp_path / "a")]
    clock = FakeClock(arrive)
    scheduler = StepScheduler(discover_episodes([tmp_path / "a", tmp_path / "b"]), order="sequential", follow=True,
                              idle_timeout=100, poll_interval=1, clock=clock, sleep=clock.sleep)
    items = []
    while (item := scheduler.next()) is not None:
        items.append((item.episode.name, item.file.step if isinstance(item, StepTask) else item.reason))
    assert items == [("a", 0), ("a", 1), ("a", "end_marker"), ("b", 0), ("b", 1), ("b", "end_marker")]


def test_follow_an_end_copied_before_the_step_files_waits_for_them(tmp_path):
    """A copy of a finished episode made END before its step files (rsync sends names sorted, END first; cp -r in
    listing order): the episode failed (its END marker came before any step file), or ended after the steps there,
    the others late. END counts once the folder's names stayed the same for a moment: each step runs once, in order."""
    recorded, folder = tmp_path / "recorded", tmp_path / "copy"
    write_episode(recorded, [good(0), good(1), good(2)], prompt="p")
    folder.mkdir()
    for name in ("END", "episode.yaml"):
        shutil.copy2(recorded / name, folder / name)
    clock = FakeClock([lambda step=step: shutil.copy2(recorded / f"step_{step:06d}.safetensors", folder)
                       for step in range(3)])  # a file at each poll
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=0.2,
                              clock=clock, sleep=clock.sleep)
    assert _drain(scheduler) == [("copy", 0), ("copy", 1), ("copy", 2), ("copy", "end_marker")]
    assert scheduler.late == {}


def test_follow_an_end_copied_first_waits_for_a_step_file_copied_in_place_through_a_pause(tmp_path):
    """cp -r makes END first and writes each step file in place under its own name: the folder's names stay the same
    while a big file is copied. Once they had for 0.5 s, END counted and each poll's look at the file was END's, which
    takes a file unchanged for one poll whole or not: a copy pausing that long (a slow source) handed the step over
    half written, and it failed its episode as truncated. A step file still growing is a copy going on too."""
    recorded, folder = tmp_path / "recorded", tmp_path / "copy"
    write_episode(recorded, [good(0), good(1)], prompt="p")
    folder.mkdir()
    for name in ("END", "episode.yaml", "step_000000.safetensors"):
        shutil.copy2(recorded / name, folder / name)
    data = (recorded / "step_000001.safetensors").read_bytes()
    cuts = [len(data) * i // 5 for i in range(6)]

    def write(i: int) -> None:
        with open(folder / "step_000001.safetensors", "ab") as f:
            f.write(data[cuts[i]:cuts[i + 1]])

    # a part at each poll, but none at the fifth (the source paused for a poll)
    actions = [lambda: None, lambda: write(0), lambda: write(1), lambda: write(2), lambda: write(3), lambda: None,
               lambda: write(4)]
    clock = FakeClock(actions)
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=0.2,
                              clock=clock, sleep=clock.sleep)
    items = []
    while (item := scheduler.next()) is not None:
        if isinstance(item, StepTask):
            items.append((item.file.step, item.file.path.read_bytes() == (recorded / item.file.path.name).read_bytes()))
        else:
            items.append(item.reason)
    assert items == [(0, True), (1, True), "end_marker"]


def test_follow_sequential_finished_episodes_do_not_each_wait_for_their_end_to_count(tmp_path):
    """END counts once its folder's names stayed the same for 0.5 s: they were first looked at as the episode's last
    step was handed out, so in sequential order each finished episode waited 0.5 s after its steps (a folder of 1,000
    took 500 s more) and none closed its session with its last step. They are looked at as its steps are taken."""
    for name in "abc":
        write_episode(tmp_path / name, [good(0), good(1)], prompt="p")
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([tmp_path]), order="sequential", follow=True, idle_timeout=100,
                              poll_interval=0.1, clock=clock, sleep=clock.sleep)
    items = []
    while (item := scheduler.next()) is not None:
        if isinstance(item, StepTask):
            items.append((item.episode.name, item.file.step, item.is_last))
            clock.now += 0.2  # the model runs the step
        else:
            items.append((item.episode.name, item.reason))
    assert items == [("a", 0, False), ("a", 1, False), ("a", "end_marker"),
                     ("b", 0, False), ("b", 1, True), ("b", "end_marker"),
                     ("c", 0, False), ("c", 1, True), ("c", "end_marker")]
    assert clock.now < 2  # 6 steps of 0.2 s, and 0.5 s for a


def test_follow_an_end_in_a_folder_that_keeps_getting_other_files_ends_it_by_the_idle_timeout(tmp_path):
    """END counts once its folder's names stayed the same for a moment; a camera writing frames there all along
    must not keep the episode waiting forever: END then counts once no step came for the idle timeout."""
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p")
    clock = FakeClock([lambda i=i: (folder / f"frame_{i}.png").touch() for i in range(1000)])
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=3, poll_interval=0.2,
                              clock=clock, sleep=clock.sleep)
    assert _drain(scheduler) == [("live", 0), ("live", "end_marker")]
    assert 3 <= clock.now < 4


def test_follow_end_marker_waits_for_a_step_file_first_seen_with_it(tmp_path):
    """END and a new step file appear while a step runs, and the next look (no poll is due yet) is the check for END:
    the file, seen for the first time, is not settled yet. The episode must wait for it and run it, not end at END
    and leave it behind as a late file (a step of a recorded episode that never runs)."""
    from ardiff_cli.io import end_episode, write_step
    from fake_clock import FakeClock

    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    clock = FakeClock()
    warnings: list[str] = []
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep, warn=warnings.append)
    first = scheduler.next()
    assert (first.file.step, first.is_last) == (0, False)
    write_step(folder, 1, good(1))  # the robot writes its last step and END while step 0 runs
    end_episode(folder)
    second = scheduler.next()
    assert isinstance(second, StepTask) and (second.file.step, second.is_last) == (1, True), second
    end = scheduler.next()
    assert end.reason == "end_marker" and scheduler.next() is None
    assert warnings == [] and scheduler.late == {}


def test_a_resume_whose_single_done_steps_file_is_gone_fails_even_when_its_chunk_is_unknown(tmp_path):
    """Step 0 ran (its results line has no chunk: an older line) and its file was deleted: the folder starts at step
    1 now. Step 1 must not run as the first chunk of a fresh session (a shorter history than the outputs' own)."""
    from ardiff_cli.io.stream import EpisodeEnded

    episodes = _episodes(tmp_path, {"a": 3})
    (tmp_path / "a" / "step_000000.safetensors").unlink()
    scheduler = StepScheduler(episodes, done={"a": {0: None}})
    item = scheduler.next()
    assert isinstance(item, EpisodeEnded) and item.reason == "error", item
    assert "step 0 ran (results.jsonl) but its file is gone: the folder starts at step 1" in str(item.error)
    assert scheduler.next() is None


def test_follow_never_takes_a_later_step_before_an_earlier_one_still_being_written(tmp_path):
    """A writer that writes in place paused mid-way through step 0 while step 1 is already whole (two writers, or a
    copy of a recording). Step 1 waits for step 0: taken first, it would run as the episode's first chunk (and
    step 0 would then fail the episode as arriving after step 1 ran)."""
    from ardiff_cli.io.writer import encode_arrays
    from fake_clock import FakeClock

    folder = tmp_path / "live"
    folder.mkdir()
    (folder / "episode.yaml").write_text("prompt: p\n")
    blob = encode_arrays(good(0))
    step0 = folder / "step_000000.safetensors"
    step0.write_bytes(blob[: len(blob) // 2])  # paused mid-file
    (folder / "step_000001.safetensors").write_bytes(encode_arrays(good(1)))
    clock = FakeClock([lambda: None, lambda: None, lambda: step0.write_bytes(blob),
                       lambda: None, lambda: None, lambda: (folder / "END").write_bytes(b"")])
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    items = []
    while (item := scheduler.next()) is not None:
        items.append((item.file.step, item.ordinal) if isinstance(item, StepTask) else item.reason)
    assert items == [(0, 0), (1, 1), "end_marker"]


def test_a_resume_of_an_episode_whose_folder_was_emptied_names_the_steps_that_ran(tmp_path):
    """Without --follow: every step file of an episode that ran is gone. The error says its done steps' files are gone
    (put them back, or run it again), not merely that the folder holds no step files (and to use --follow)."""
    from ardiff_cli.io.stream import EpisodeEnded

    episodes = _episodes(tmp_path, {"a": 2, "b": 1})
    for step in (0, 1):
        (tmp_path / "a" / f"step_{step:06d}.safetensors").unlink()
    scheduler = StepScheduler(episodes, done={"a": {0: 0, 1: 1}})
    items = []
    while (item := scheduler.next()) is not None:
        items.append(item)
    (failed,) = [i for i in items if isinstance(i, EpisodeEnded) and i.reason == "error"]
    assert failed.episode.name == "a"
    message = str(failed.error)
    assert "steps 0..1 ran (results.jsonl) but their files are gone: the folder holds no step files" in message
    assert "--follow" not in failed.error.hint


def test_follow_an_idle_episode_ends_idle_timeout_seconds_after_its_last_step(tmp_path):
    """--idle-timeout N: an episode ends once no new step file came for N seconds, at the first poll N seconds after
    its last step was handed out, not a poll later."""
    from fake_clock import FakeClock

    write_episode(tmp_path / "a", [good(0)], prompt="p", end=False)
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([tmp_path / "a"]), follow=True, idle_timeout=3, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    first = scheduler.next()
    assert isinstance(first, StepTask) and first.file.step == 0
    handed_at = clock.now
    end = scheduler.next()
    assert end.reason == "idle_timeout"
    assert clock.now - handed_at == 3


def test_a_prompt_stored_among_the_arrays_is_checked_as_the_prompt_not_ignored(tmp_path):
    # np.savez(..., prompt=np.array("go")): the file's own prompt, in the wrong form. Ignoring it ran the step with
    # episode.yaml's prompt instead, the file's warning saying nothing of a prompt.
    raw = RawStep(arrays={**good(), "prompt": np.array("go")}, metadata={})
    path = tmp_path / "ep" / "step_000000.npz"
    with pytest.raises(ObservationError) as info:
        validate_step(raw, SCHEMA, path=path, episode_metadata={"prompt": "from yaml"})
    assert str(info.value) == f"{path}: prompt 'prompt' must be a string, got ndarray"


def test_the_warnings_for_ignored_keys_come_in_key_order(tmp_path):
    raw = RawStep(arrays={**good(), "timestamp": np.zeros(1), "battery": np.zeros(1)}, metadata={})
    path = tmp_path / "s.npz"
    valid = validate_step(raw, SCHEMA, path=path, episode_metadata={"prompt": "p"})
    assert list(valid.warnings.values()) == [f"{path}: key 'battery' is not in the pipeline's schema; ignored",
                                             f"{path}: key 'timestamp' is not in the pipeline's schema; ignored"]


def test_a_step_files_own_prompt_of_the_wrong_type_is_blamed_on_the_step_file_not_episode_yaml(tmp_path):
    raw = RawStep(arrays=good(), metadata={"prompt": 5})
    path = tmp_path / "ep" / "step_000000.npz"
    with pytest.raises(ObservationError) as info:
        validate_step(raw, SCHEMA, path=path, episode_metadata={"prompt": "from yaml"})
    assert str(info.value) == f"{path}: prompt 'prompt' must be a string, got int"


# -- a caught-up folder is not listed again while its timestamps stand still -----------------------------------------


def _settle(folder) -> None:
    """Wait (real time) until a listing of ``folder`` made now is trusted: its timestamps older than a tick."""
    coarse = os.stat(folder).st_mtime_ns % 1_000_000_000 == 0
    time.sleep((stream._SETTLE_COARSE if coarse else stream._SETTLE) + 0.1)


def _followed(folder, idle_timeout: float = 100) -> tuple[StepScheduler, FakeClock]:
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=idle_timeout, poll_interval=1,
                              clock=clock, sleep=clock.sleep)
    first = scheduler.next()
    assert isinstance(first, StepTask) and first.file.step == 0
    return scheduler, clock


@pytest.mark.parametrize("tick", ["same mtime", "right after a listing"])
def test_follow_sees_a_step_file_made_in_the_timestamp_tick_of_the_last_listing(tmp_path, tick):
    """A file made in the same timestamp tick as a listing leaves the folder's mtime as it was (a coarse clock: a
    jiffy, or a second on some file systems): the poll must not take the unchanged mtime for "nothing new". "same
    mtime" puts the mtime back by hand, once the listing is trusted; "right after a listing" makes each file right
    after a poll, where a coarse clock gives it the listing's tick."""
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    scheduler, clock = _followed(folder)
    made: list[float] = []

    def make(step: int) -> None:
        before = os.stat(folder)
        write_step(folder, step, good(step))
        if tick == "same mtime":
            os.utime(folder, ns=(before.st_atime_ns, before.st_mtime_ns))
            assert os.stat(folder).st_mtime_ns == before.st_mtime_ns
        made.append(clock.now)

    steps = range(1, 2) if tick == "same mtime" else range(1, 11)
    for step in steps:
        clock.actions = [lambda: _settle(folder), lambda s=step: make(s)] if tick == "same mtime" else \
            [lambda s=step: make(s)]
        item = scheduler.next()
        assert isinstance(item, StepTask) and item.file.step == step
        assert clock.now - made[-1] <= 2  # taken at the second poll after it was made (its size stable), not later


def test_follow_a_skipped_listing_still_sees_a_step_file_grow(tmp_path):
    """While the folder's listing is skipped (its timestamps unchanged), the file still being written is stat'ed
    at each poll: its growth keeps the episode from idling out, and it is taken once whole."""
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    data = write_step(tmp_path / "src", 1, good(1)).read_bytes()
    part = folder / "step_000001.safetensors"
    part.write_bytes(data[:16])
    scheduler, clock = _followed(folder, idle_timeout=3.5)
    track = scheduler._tracks[0]
    skipped = []

    def grow(end: int) -> None:
        skipped.append(track.trusted)  # the polls since the listing was trusted did not list the folder
        with open(part, "ab") as f:
            f.write(data[os.path.getsize(part):end])

    ends = [16 + (len(data) - 16) * i // 8 for i in range(1, 8)]
    clock.actions = [lambda: _settle(folder), *[lambda e=e: grow(e) for e in ends], lambda: grow(len(data))]
    item = scheduler.next()
    assert isinstance(item, StepTask) and item.file.step == 1  # not an idle timeout, nor a truncated file taken
    assert skipped == [True] * 8 and len(clock.actions) == 0


@pytest.mark.parametrize("change", ["deleted", "replaced", "folder gone", "folder replaced"])
def test_follow_a_trusted_listing_still_notices_a_change(tmp_path, change):
    """Once the listing of a caught-up folder is trusted, a file deleted before it was whole is still forgotten
    (END then ends the episode), one replaced is taken anew, and the folder deleted or replaced fails its episode."""
    folder = tmp_path / "live"
    write_episode(folder, [good(0)], prompt="p", end=False)
    data = write_step(tmp_path / "src", 1, good(1)).read_bytes()
    part = folder / "step_000001.safetensors"
    part.write_bytes(data[:16])
    scheduler, clock = _followed(folder)
    track = scheduler._tracks[0]

    def act() -> None:
        assert track.trusted
        if change == "deleted":
            part.unlink()
            (folder / "END").write_bytes(b"")
        elif change == "replaced":
            (tmp_path / "whole").write_bytes(data)
            os.replace(tmp_path / "whole", part)
        elif change == "folder gone":
            shutil.rmtree(folder)
        else:
            folder.rename(tmp_path / "old")
            write_episode(folder, [good(0), good(1)], prompt="p", end=False)

    clock.actions = [lambda: _settle(folder), lambda: None, act]
    item = scheduler.next()
    at = clock.now
    if change == "deleted":
        assert isinstance(item, EpisodeEnded) and item.reason == "end_marker"
    elif change == "replaced":
        assert isinstance(item, StepTask) and item.file.step == 1
    else:
        assert isinstance(item, EpisodeEnded) and item.reason == "error"
        assert ("is gone" if change == "folder gone" else "was replaced") in str(item.error)
    assert at <= 3 + 3  # step 0's polls, the settling, and at most two polls after the change


def test_follow_round_robin_end_of_a_caught_up_episode_counts_from_the_poll_that_sees_it_not_from_its_turn(tmp_path):
    """END written in an episode that ran all its steps, while others run theirs in round-robin: its 0.5 s started
    first at the episode's turn, so it ended a round after that, up to two rounds and 0.5 s after its END. It counts
    from the poll that sees END, and the episode ends at its first turn 0.5 s after."""
    from ardiff_cli.io import end_episode

    write_episode(tmp_path / "a", [good(0)], prompt="p", end=False)
    for name in "bcde":
        write_episode(tmp_path / name, [good(s) for s in range(12)], prompt="p")
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([tmp_path]), follow=True, idle_timeout=100, poll_interval=0.1,
                              clock=clock, sleep=clock.sleep)
    items, ended_at = [], None
    while (item := scheduler.next()) is not None:
        if isinstance(item, StepTask):
            items.append((item.episode.name, item.file.step))
            clock.now += 0.3  # the model runs the step
            if items == [("a", 0), ("b", 0), ("c", 0)]:
                end_episode(tmp_path / "a")  # while c's step 0 runs: a's turn comes after d's and e's steps
                written = clock.now
        elif item.episode.name == "a":
            ended_at = clock.now
    # seen at the poll after c's step; a's turns come after e's step 0 (0.6 s later: ends), not only a round after
    assert ended_at is not None and ended_at - written <= 0.6 + 1e-9, (ended_at - written, items)


def test_follow_an_episode_folder_removed_after_its_end_while_it_settles_ends_by_its_end(tmp_path):
    """A recorder that writes END after the last step file and then removes (or moves away) the finished episode's
    folder, as the README allows: once END had to stay 0.5 s the removal failed the episode (`the episode folder is
    gone`, hint: keep it in place until END is written). Every step file in it ran, so it ends by its END."""
    from ardiff_cli.io import end_episode

    folder = tmp_path / "a"
    write_episode(folder, [good(0), good(1)], prompt="p", end=False)
    # at the first pause once END is there (seen, not yet counted); steps are taken once unchanged for a poll
    clock = FakeClock([lambda: (folder / "END").exists() and shutil.rmtree(folder)] * 100)
    scheduler = StepScheduler(discover_episodes([folder]), follow=True, idle_timeout=100, poll_interval=0.1,
                              clock=clock, sleep=clock.sleep)
    items = []
    while (item := scheduler.next()) is not None:
        if isinstance(item, StepTask):
            items.append((item.episode.name, item.file.step))
            clock.now += 0.2  # the model runs the step
            if item.file.step == 1:
                end_episode(folder)
        else:
            items.append((item.episode.name, item.reason, str(item.error)))
    assert items == [("a", 0), ("a", 1), ("a", "end_marker", "None")], items
    assert clock.now < 2


def _finished_and_live(root: Path, finished: int) -> tuple[StepScheduler, FakeClock, Path]:
    """A scheduler following ``root/robots``, which holds ``finished`` episodes of one step and END, and ``live`` (one
    step, no END), once it handed out every step and end there is."""
    robots = root / "robots"
    for i in range(finished):
        write_episode(robots / f"done_{i:03d}", [good(0)], prompt="p")
    write_episode(robots / "live", [good(0)], prompt="p", end=False)
    clock = FakeClock()
    scheduler = StepScheduler(discover_episodes([robots]), follow=True, idle_timeout=100, poll_interval=1,
                              clock=clock, sleep=clock.sleep, watch=[robots])
    items = [scheduler.next() for _ in range(2 * finished + 1)]
    assert sum(isinstance(item, StepTask) for item in items) == finished + 1
    assert sum(isinstance(item, EpisodeEnded) and item.reason == "end_marker" for item in items) == finished
    return scheduler, clock, robots


def test_follow_a_caught_up_folder_of_episodes_is_not_listed_at_every_poll(tmp_path, monkeypatch):
    """A watched folder of episodes was listed (and its names sorted) at every poll, 10 a second: its finished
    episodes pile up overnight, and 2,000 of them cost 1.2 ms a poll while the run waited for a robot. While its
    timestamps stand still it is not listed again (every 5 s anyway, as an episode's folder is); a folder a robot
    makes in it still joins at the next polls, and so does one made empty once it gets a step file."""
    scheduler, clock, robots = _finished_and_live(tmp_path, 30)
    # the listing every _RELIST seconds is real time: a machine slow for 5 s over the 20 polls made one of them list
    monkeypatch.setattr(stream, "_RELIST", float("inf"))
    listed: list[Path] = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path=".": listed.append(Path(path)) or real_listdir(path))
    counts: list[int] = []

    def count() -> None:  # the listings of the folder of episodes at the poll since the last pause
        counts.append(listed.count(robots))
        listed.clear()

    clock.actions = [lambda: _settle(robots), listed.clear, *[count] * 20,
                     lambda: write_episode(robots / "late", [good(0)], prompt="p", end=False)]
    item = scheduler.next()
    assert isinstance(item, StepTask) and (item.episode.name, item.file.step) == ("late", 0)
    assert sum(counts) == 0, f"the folder of episodes was listed at {sum(counts)} of 20 idle polls"

    counts.clear()
    clock.actions = [lambda: (robots / "empty").mkdir(), lambda: _settle(robots), listed.clear, *[count] * 20,
                     lambda: write_step(robots / "empty", 0, good(0), prompt="p")]
    item = scheduler.next()
    assert isinstance(item, StepTask) and (item.episode.name, item.file.step) == ("empty", 0)
    assert sum(counts) == 0, f"the folder of episodes was listed at {sum(counts)} of 20 idle polls"


def test_follow_a_poll_and_a_step_do_not_look_at_the_episodes_that_ended(tmp_path, monkeypatch):
    """Every poll and every step went through every episode of the run, the finished ones too: a followed folder of
    episodes gathers them overnight (2,000: 0.3 ms more a poll and a step). Counted as the reads of their ``ended``
    flag: an idle poll, and a step of the one live episode, look at it alone."""
    scheduler, clock, robots = _finished_and_live(tmp_path, 40)
    reads = [0]

    def get(track):
        reads[0] += 1
        return track.__dict__["ended"]

    monkeypatch.setattr(stream._Track, "ended", property(get, lambda track, value: track.__dict__.update(ended=value)),
                        raising=False)
    per_poll: list[int] = []

    def count() -> None:
        per_poll.append(reads[0])
        reads[0] = 0

    clock.actions = [lambda: _settle(robots), count, *[count] * 10,
                     lambda: write_step(robots / "live", 1, good(1))]
    item = scheduler.next()
    assert isinstance(item, StepTask) and (item.episode.name, item.file.step) == ("live", 1)
    assert max(per_poll[1:]) <= 10, f"{max(per_poll[1:])} looks at episodes' ends in a poll, 41 episodes, 1 live"


# -- a watched folder's links to no folder are not looked at again while the folders on their way stand still --------


def _held(scheduler: StepScheduler) -> set[str]:
    return set().union(*scheduler._watch[0].held.values())


def _repoint(link: Path, target: str) -> None:
    """``ln -sfn target link``: a new link renamed over the old one."""
    (link.parent / ".next").symlink_to(target)
    os.replace(link.parent / ".next", link)


@pytest.mark.parametrize("change", ["ln -sfn arm_b rec/latest", "ln -sfn ../rec/arm_b robots/cam",
                                    "recording made beside", "recording made deeper",
                                    "a folder passed through made a link"])
def test_a_held_link_that_comes_to_lead_to_a_recording_joins_at_the_next_poll(tmp_path, change):
    """robots/cam, a link to a file (through ../rec/latest) or to nothing, is looked at again until it leads to an
    episode folder. Once the folders its lookup reads names in (robots, rec) kept their timestamps past a
    tick, it is no longer stat'ed at each poll (2,000 such links cost 11-33 ms a poll); a change that makes it lead to
    a recording changes one of those folders' timestamps, and it joins at the next poll, not at the next full listing
    (every 5 s) nor never: rec/latest pointed at a recording (rec outside the watched folder), cam itself pointed at
    one, its recording made beside where it leads (rec/arm_c), or deeper (disk/rec/arm_c, disk/rec not there yet),
    or a folder its lookup went down into and back up from (../t/a/sub/../../arm_b) made a link (sub -> rec/deep/x,
    whose ../.. is rec): only t/a, which no lookup from cam ends in, changes."""
    data, rec = tmp_path / "robots", tmp_path / "rec"
    write_episode(data / "arm_a", [good(0)], prompt="p", end=False)
    write_episode(rec / "arm_b", [good(0)], prompt="p", end=False)
    (rec / "notes.txt").write_text("x")
    (rec / "latest").symlink_to("notes.txt")
    target = {"recording made beside": "../rec/arm_c", "recording made deeper": "../disk/rec/arm_c"}.get(change)
    (tmp_path / "disk").mkdir()
    (tmp_path / "t" / "a" / "sub").mkdir(parents=True)
    (rec / "deep" / "x").mkdir(parents=True)
    (data / "cam").symlink_to("../t/a/sub/../../arm_b" if change == "a folder passed through made a link" else
                              target or "../rec/latest")
    clock = FakeClock()
    added: list[EpisodeSource] = []
    scheduler = _watching(data, clock, idle_timeout=100, added=added)
    assert scheduler.next().episode.name == "arm_a"
    held, changed = [], []

    def make_change() -> None:
        held.append(_held(scheduler))
        if change == "ln -sfn arm_b rec/latest":
            _repoint(rec / "latest", "arm_b")
        elif change == "ln -sfn ../rec/arm_b robots/cam":
            _repoint(data / "cam", "../rec/arm_b")
        elif change == "a folder passed through made a link":
            (tmp_path / "t" / "a" / "sub").rmdir()
            (tmp_path / "t" / "a" / "sub").symlink_to(rec / "deep" / "x")
        else:
            write_episode(tmp_path / target.removeprefix("../"), [good(0)], prompt="p", end=False)
        changed.append(clock.now)

    # robots, then rec and disk settled (real time), a poll that holds cam, one that passes it over, then the change
    clock.actions = [lambda: _settle(data), lambda: _settle(rec), lambda: None, make_change]
    item = scheduler.next()
    assert held == [{"cam"}]
    assert isinstance(item, StepTask) and item.episode.path == data / "cam" and item.file.step == 0
    assert [e.path for e in added] == [data / "cam"] and clock.now == changed[0] + 1  # the poll right after it


def test_a_poll_of_held_links_stats_the_folders_on_their_way_not_each_link(tmp_path, monkeypatch):
    """The stats a poll makes do not grow with the links to files in a watched folder once they are held: 10 links or
    200, the folders on their way are stat'ed once each (the cost figure, 2,000 links, is measured, not asserted)."""
    counts = []
    for num_links in (10, 200):
        # the listing every _RELIST seconds is real time: a machine slow for 5 s made the poll counted list them all
        monkeypatch.setattr(stream, "_RELIST", float("inf"))  # undone with the os patches below, set again here
        data, rec = tmp_path / f"robots{num_links}", tmp_path / f"rec{num_links}"
        write_episode(data / "arm_a", [good(0)], prompt="p", end=False)
        rec.mkdir()
        for i in range(num_links):
            (rec / f"f{i}").write_text("x")
            (data / f"cam{i}").symlink_to(Path("..") / rec.name / f"f{i}")
        clock = FakeClock()
        scheduler = _watching(data, clock, idle_timeout=100)
        assert scheduler.next().episode.name == "arm_a"
        scheduler._adopt_new_episodes()
        _settle(data)
        scheduler._adopt_new_episodes()  # listed, the stamps on the links' ways settled: held
        _settle(rec)
        scheduler._adopt_new_episodes()
        calls = []
        for name in ("stat", "lstat", "readlink", "listdir", "scandir"):
            monkeypatch.setattr(os, name, lambda *a, _real=getattr(os, name), _name=name, **k: (
                calls.append(_name), _real(*a, **k))[1])
        scheduler._adopt_new_episodes()
        monkeypatch.undo()
        counts.append(len(calls))
    assert counts[0] == counts[1] and counts[0] < 20, counts


def test_the_folders_on_held_links_ways_are_let_go_once_no_link_leads_through_them(tmp_path):
    """A long run where links to recordings not made yet come and go (live/camN -> ../rec/epN/data, each deleted
    once done with): what is kept of the folders on their ways (their stamps, when first seen) is that of the links
    there now, not of every link the run ever looked at (it grew by a folder a link, for the rest of the run)."""
    data, rec = tmp_path / "live", tmp_path / "rec"
    write_episode(data / "arm_a", [good(0)], prompt="p", end=False)
    scheduler = _watching(data, FakeClock(), idle_timeout=100)
    assert scheduler.next().episode.name == "arm_a"
    kept = []
    for i in range(3):
        (rec / f"ep{i}").mkdir(parents=True)
        (data / f"cam{i}").symlink_to(f"../rec/ep{i}/data")
        scheduler._adopt_new_episodes()
        _settle(data)
        scheduler._adopt_new_episodes()  # cam{i} looked at, the folders on its way seen
        (data / f"cam{i}").unlink()
        scheduler._adopt_new_episodes()
        kept.append(sorted(Path(folder).name for folder in scheduler._watch[0].seen))
    assert kept == [["ep0", "live"], ["ep1", "live"], ["ep2", "live"]], kept
