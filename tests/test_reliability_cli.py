"""`ardiff rollout` as a real subprocess with faults injected at chosen episodes, steps and layers.

The faults come from ``faulty_pipelines.FaultyDreamZero``, loaded with the explicit ``--pipeline
module:Class`` option and configured through ``$ARDIFF_TEST_FAULTS`` (nothing in the shipped code knows
about them). One resident session (round-robin evicts at every step, so every step after the first
replays its episode's history) and four 3-step episodes keep each run to a few seconds.

Checked: the error reaches the user with the episode and the step (and no traceback without
--verbose), the failed episode's session is released while the others complete with outputs identical to
a fault-free run, results.jsonl holds whole lines only, --fail-fast stops, SIGINT/SIGTERM in the middle of
a forward exit 130/143 with complete outputs, and --resume completes every interrupted or failed run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ardiff_cli.entry import interrupted_message
from ardiff_cli.io import write_episode
from ardiff_cli.io.demo import demo_step
from ardiff_cli.runtime.errors import ResumeCommand
from pipeline_helpers import (HOLD_IMPORT, NOTICE, ardiff_program, on_path, open_to_write, outputs, records,
                              start_with_fault_files, stop_inside_a_fault, stopped_while_reading, syscall_number,
                              wait_blocked, wait_for_marker, wait_reading)

REPO = Path(__file__).resolve().parents[1]
PIPELINE = "faulty_pipelines:FaultyDreamZero"
EPISODES = ("arm_a", "arm_b", "arm_c", "arm_d")
FAST_CONFIG = """\
pipeline: dreamzero
model: {preset: tiny, num_inference_steps: 1, guidance_scale: 2.0}
runtime: {device: cpu, session_capacity: 1}
"""
# the memory hint of a step of FAST_CONFIG, whose plan holds one session: no lower --session-capacity or budget
ONE_SESSION_HINT = ("the KV pool holds one session, the least a plan keeps, and it does not fit with the model's "
                    "activations")


@pytest.fixture(scope="module")
def env(cli_env):
    return cli_env


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from pipelines.dreamzero import observation_schema

    root = tmp_path_factory.mktemp("data")
    (root / "fast.yaml").write_text(FAST_CONFIG)
    for i, name in enumerate(EPISODES):
        steps = [demo_step(observation_schema(), (16, 16), i, s, 1 if s == 0 else 4) for s in range(3)]
        write_episode(root / "eps" / name, steps, prompt=f"task {name}")
    return root


def ardiff(env, *args: str, faults: list | None = None, path: Path | None = None) -> subprocess.CompletedProcess:
    """``ardiff ARGS`` with ``faults``, and ``path`` (a folder of modules) first on PYTHONPATH."""
    env = {**env, "ARDIFF_TEST_FAULTS": json.dumps(faults or [])}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env["PYTHONPATH"]])
    return subprocess.run([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)


def rollout_args(data, out: Path, *extra: str) -> list[str]:
    return ["rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(out), "--pipeline", PIPELINE,
            "--no-warmup", "--format", "plain", *extra]


def assert_matches(run: Path, reference: Path, episodes=EPISODES) -> None:
    got, want = outputs(run), outputs(reference)
    names = [n for n in want if n.split("/")[1] in episodes]
    assert sorted(n for n in got if n.split("/")[1] in episodes) == names
    for name in names:
        for key in want[name]:
            np.testing.assert_array_equal(got[name][key], want[name][key], err_msg=f"{name}:{key}")


@pytest.fixture(scope="module")
def reference(env, data, tmp_path_factory):
    """A fault-free run through --pipeline (the class is DreamZero plus dormant faults)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = ardiff(env, *rollout_args(data, run))
    assert proc.returncode == 0, proc.stderr
    lines = records(run)
    assert len(lines) == 12 and all(r["status"] == "ok" for r in lines)
    assert json.loads((run / "run.json").read_text())["pipeline_option"] == PIPELINE
    return run


def test_faults_fail_their_episode_only_and_name_episode_and_step(env, data, reference, tmp_path):
    run = tmp_path / "run"
    faults = [
        {"request": "arm_b/000001", "site": "block", "layer": 1},  # a transformer block, mid-episode
        {"request": "arm_c/000000", "site": "cross_oom"},  # out of memory copying the text cache
        {"request": "arm_d/000000/replay", "site": "sampler"},  # rebuilding the evicted session
        {"site": "close_hook", "session": "arm_a"},  # closing a completed episode
    ]
    # --swap-space 0: evicted sessions are rebuilt by replay (with swapping, arm_d's would be restored instead).
    proc = ardiff(env, *rollout_args(data, run, "--swap-space", "0"), faults=faults)
    assert proc.returncode == 4, proc.stderr
    err = proc.stderr
    assert "Traceback" not in err  # not without --verbose
    assert ("Error: episode 'arm_b' failed at step 1 in the model's forward: InjectedFault: injected fault in "
            "transformer block 1") in err
    assert ("Error: episode 'arm_c' failed at step 0 in the model's forward: KVCacheExhaustedError: "
            "cross-attention 'text' of branch 'positive' (session 'arm_c'): out of memory allocating layer 0") in err
    assert ("Error: episode 'arm_d' failed at step 1 while replaying its earlier step 0 to rebuild the session: "
            "InjectedFault: injected fault in the sampler") in err
    # arm_a's close hook fails each time its session is evicted, and when it completes: warnings, no loss.
    assert ("warning: episode 'arm_a': the pipeline's close_ar_diffusion_session raised at its step 2: injected "
            "fault in the close hook of 'arm_a'") in err
    assert "warning: episode 'arm_a': the pipeline's close_ar_diffusion_session raised when evicted" in err
    assert "3 of 4 episodes failed: arm_c, arm_b, arm_d; the others completed" in err

    lines = records(run)
    failed = {r["episode"]: r for r in lines if r["status"] == "failed"}
    assert set(failed) == {"arm_b", "arm_c", "arm_d"}
    assert (failed["arm_b"]["step"], failed["arm_b"]["phase"], failed["arm_b"]["error_type"]) == (
        1, "forward", "InjectedFault")
    assert "Traceback" in failed["arm_b"]["traceback"] and "faulty_pipelines.py" in failed["arm_b"]["traceback"]
    assert (failed["arm_c"]["step"], failed["arm_c"]["error_type"]) == (0, "KVCacheExhaustedError")
    # step 1 failed (no ok line, no output) while replaying step 0 (whose ok line and output stay)
    assert ({k: failed["arm_d"][k] for k in ("step", "chunk", "phase", "replay_step", "replay_chunk")}
            == {"step": 1, "chunk": 1, "phase": "replay", "replay_step": 0, "replay_chunk": 0})
    assert failed["arm_d"]["path"].endswith("arm_d/step_000001.safetensors")
    assert failed["arm_d"]["replay_path"].endswith("arm_d/step_000000.safetensors")
    ok = sorted((r["episode"], r["step"]) for r in lines if r["status"] == "ok")
    assert ok == [("arm_a", 0), ("arm_a", 1), ("arm_a", 2), ("arm_b", 0), ("arm_d", 0)]
    assert_matches(run, reference, episodes=("arm_a",))  # the healthy episode did not notice a thing
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "partial" and summary["exit_code"] == 4 and summary["steps"]["failed"] == 3
    assert summary["episodes"]["completed"] == 1 and set(summary["episodes"]["failures"]) == set(failed)
    assert {h["session"] for h in summary["hook_errors"]} == {"arm_a"} and len(summary["hook_errors"]) >= 3

    # Nothing to redo by hand: --resume retries exactly the failed episodes (the faults are gone).
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"]["failed"] == 0  # the retried steps' lines came later
    last = {(r["episode"], r["step"]): r["status"] for r in records(run)}  # a step's last line is the one that counts
    assert set(last.values()) == {"ok"}, last  # arm_d's step 0 was last said failed: its replay is no line of it


@pytest.mark.parametrize(("action", "fail_fast"), [("raise", False), ("raise", True), ("observation_error", False)],
                         ids=["forward_raised", "forward_raised_fail_fast", "input_check_refused"])
def test_a_failed_steps_error_carries_the_notes_of_what_its_forward_raised_everywhere_it_goes(env, data, tmp_path,
                                                                                              action, fail_fast):
    """A step's failure (``StepFailed``, or the ``ObservationError`` naming the step file that a pipeline's own input
    check's becomes) is raised in place of what its forward raised, whose notes (PEP 678: a library's own, a
    close hook that failed as it was) showed only in the --verbose traceback: they are `  note:` lines between its
    Error and hint lines, a `notes` list in its JSON error object and its step object, and in its results.jsonl line,
    whether the run goes on or stops (--fail-fast)."""
    run = tmp_path / "run"
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 1, "action": action,
               "note": "while compiling block 1 for cpu"},
              {"site": "close_hook", "session": "arm_b"}]
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--pipeline",
                  PIPELINE, "--no-warmup", "--format", "json", *(["--fail-fast"] if fail_fast else []), faults=faults)
    assert proc.returncode == (1 if fail_fast else 4), proc.stderr
    # not the runtime's that arm_b's session was released ("its next request starts afresh"): the episode stops
    notes = ["while compiling block 1 for cpu",
             "FaultyDreamZero.close_ar_diffusion_session('arm_b') raised InjectedFault: injected fault in the close "
             "hook of 'arm_b'; the session's KV was released"]
    failed = ("episode 'arm_b' failed at step 1 in the model's forward: InjectedFault: injected fault in transformer "
              "block 1 (call 1)" if action == "raise" else
              f"episode 'arm_b' failed: {data / 'eps' / 'arm_b' / 'step_000001.safetensors'}: request inputs: "
              "injected fault in transformer block 1 (call 1)")
    assert f"Error: {failed}\n" + "".join(f"  note: {note}\n" for note in notes) in proc.stderr, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    errors = [e for e in lines if e["kind"] == ("step_failed" if fail_fast else "episode_failed")]
    assert [(e["message"], e["notes"]) for e in errors] == [(failed, notes)], lines
    steps = [e for e in lines if e["kind"] == "step" and e["status"] == "failed"]
    assert [(e["episode"], e["notes"]) for e in steps] == [("arm_b", notes)], lines
    assert [(r["episode"], r["notes"]) for r in records(run) if r["status"] == "failed"] == [("arm_b", notes)]
    assert all("notes" not in r for r in records(run) if r["status"] == "ok")


# When every episode fails, the exit code is the highest of their causes' codes: out of memory (3) over invalid
# input (2) over anything else (1). ``invalid`` names episodes whose first step file is no safetensors file.
EVERY_EPISODE_FAILS = {
    "exception": ([], [], 1),
    "out_of_memory_and_exception": ([], ["arm_a"], 3),
    "invalid_input_and_exception": (["arm_a"], [], 2),
    # invalid input does not hide that another episode ran out of memory: 3, not the 2 of a run of bad files only
    "invalid_input_and_out_of_memory": (["arm_a"], ["arm_b"], 3),
}


@pytest.mark.parametrize(("invalid", "out_of_memory", "code"), list(EVERY_EPISODE_FAILS.values()),
                         ids=list(EVERY_EPISODE_FAILS))
def test_a_run_whose_every_episode_failed_exits_with_the_highest_code_of_their_causes(env, data, tmp_path, invalid,
                                                                                       out_of_memory, code):
    """The row of docs/reliability.md: without --fail-fast, a step's failure is its episode's; when no episode
    completed, the run's code is its causes' (max), and each failed episode's session was released."""
    eps = tmp_path / "eps"
    shutil.copytree(data / "eps", eps)
    for name in invalid:
        (eps / name / "step_000000.safetensors").write_bytes(b"not a safetensors file")
    faults = [{"request": f"{name}/000000", "site": "page_shortage" if name in out_of_memory else "block",
               "layer": 1} for name in EPISODES if name not in invalid]
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(tmp_path / "run"), "--pipeline",
                  PIPELINE, "--no-warmup", "--format", "plain", faults=faults)
    assert proc.returncode == code, proc.stderr
    assert re.search(r"Error: every episode failed \((arm_[a-d](, )?){4}\)", proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr
    lines = records(tmp_path / "run")
    assert sorted((r["episode"], r["step"], r["status"]) for r in lines) == [(e, 0, "failed") for e in EPISODES]
    for episode in EPISODES:
        if episode not in invalid:  # admitted, then released when its step failed
            assert re.search(rf"closed +{episode} ", proc.stderr), proc.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_a_failing_close_hook_alone_is_a_warning_that_changes_neither_the_exit_code_nor_the_outputs(env, data,
                                                                                                     reference,
                                                                                                     tmp_path):
    """arm_a's close hook raises each time its session is evicted (one resident session) and when its episode ends:
    warnings naming the episode and the step, hook_errors in summary.json, and a run otherwise as a fault-free one."""
    run = tmp_path / "run"
    proc = ardiff(env, *rollout_args(data, run), faults=[{"site": "close_hook", "session": "arm_a"}])
    assert proc.returncode == 0, proc.stderr
    assert ("warning: episode 'arm_a': the pipeline's close_ar_diffusion_session raised at its step 2: injected "
            "fault in the close hook of 'arm_a'; its KV was released and its written outputs are complete") in (
        proc.stderr)
    assert ("warning: episode 'arm_a': the pipeline's close_ar_diffusion_session raised when evicted for episode "
            "'arm_b' step 0: ") in proc.stderr
    assert "Error:" not in proc.stderr and "Traceback" not in proc.stderr
    assert all(r["status"] == "ok" for r in records(run)) and len(records(run)) == 12
    assert_matches(run, reference)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["exit_code"] == 0 and summary["steps"]["failed"] == 0
    hooks = summary["hook_errors"]
    assert len(hooks) == 3 and all(h["session"] == "arm_a" and h["hook"] == "close_ar_diffusion_session"
                                   for h in hooks), hooks
    assert {"episode": "arm_a", "step": 2} in [h["during"] for h in hooks], hooks


def test_a_close_hook_that_always_fails_fails_warmup_and_a_rollouts_warmup_and_the_run_resumes_past_it(env, data,
                                                                                                         tmp_path):
    """With a window of one frame DreamZero warms up with two requests, the second run again on its rebuilt session
    (test_warmup_rerun.py): that rerun closed the session first, so a close hook that always fails was the rerun's
    warning alone, no close was left to fail at the warmup's end, and `ardiff warmup` passed (exit 0), as did a
    rollout's warmup. Now both fail as a pipeline_error naming the hook (exit 1); the rollout, its run.json written,
    says how to go on, and a resume without the warmup completes, each failing close a warning (README)."""
    config = tmp_path / "window1.yaml"
    config.write_text(FAST_CONFIG.replace("guidance_scale: 2.0}", "guidance_scale: 2.0, window_frames: 1}"))
    faults = [{"site": "close_hook", "session": "*"}]
    failed = ("FaultyDreamZero.close_ar_diffusion_session('__ardiff_warmup__') raised InjectedFault: injected fault "
              "in the close hook of '__ardiff_warmup__'; the session's KV was released")
    proc = ardiff(env, "warmup", str(config), "--pipeline", PIPELINE, "--format", "json", faults=faults)
    assert proc.returncode == 1, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert (lines[-1]["kind"], lines[-1]["message"], lines[-1]["exit_code"]) == ("pipeline_error", failed, 1), lines
    assert [(e["kind"], e.get("reason")) for e in lines if e["kind"] in ("hook_failed", "session_closed")] == [
        ("hook_failed", None), ("session_closed", "warmup_ended")], lines
    assert "warning:" not in proc.stderr, proc.stderr  # not the rerun's: the close is the warmup's own failure
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(config), str(data / "eps"), "--out", str(run), "--pipeline", PIPELINE,
                  "--format", "plain", faults=faults)
    assert proc.returncode == 1, proc.stderr
    resume = f"{on_path(env)}{ResumeCommand(run, PIPELINE)}"
    assert f"Error: {failed}\nhint: " in proc.stderr and proc.stderr.endswith(
        f"please report it; once fixed, continue the run with --resume; to paste: {resume}\n"), proc.stderr
    assert records(run) == [] and not (run / "summary.json").exists()  # stopped before its first step
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup", "--format",
                  "plain", faults=faults)
    assert proc.returncode == 0, proc.stderr
    assert "Error:" not in proc.stderr and ("warning: episode 'arm_d': the pipeline's close_ar_diffusion_session "
                                            "raised at its step 2: ") in proc.stderr, proc.stderr
    assert all(r["status"] == "ok" for r in records(run)) and len(records(run)) == 12
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("ok", 0) and len(summary["hook_errors"]) > 4, summary


def test_a_close_hook_failing_as_a_stopped_run_releases_its_resident_session_keeps_the_exit_code_of_the_stop(
        env, data, tmp_path):
    """Stopped by SIGTERM with swapping off, arm_c's session is still resident when the model is released, and its
    close hook raises then: a warning, while the run exits 143 and its summary says interrupted, as any stopped run."""
    run = tmp_path / "run"
    faults = [{"request": "arm_c/000001", "site": "block", "layer": 0, "action": "sleep"},
              {"site": "close_hook", "session": "arm_c"}]
    proc, err = stop_inside_a_fault(env, rollout_args(data, run, "--swap-space", "0"), faults, tmp_path)
    assert proc.returncode == 143, err
    assert "interrupted by SIGTERM" in err and "Traceback" not in err
    assert "warning: " in err and "injected fault in the close hook of 'arm_c'" in err, err
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"


def test_resume_that_retries_an_episodes_last_step_leaves_no_failure_in_the_summary(env, data, reference, tmp_path):
    """The retried step's own ok line resolves its failed line, also for an episode's last step (no later step's
    line comes to resolve it)."""
    run = tmp_path / "run"
    proc = ardiff(env, *rollout_args(data, run), faults=[{"request": "arm_b/000002", "site": "block", "layer": 0}])
    assert proc.returncode == 4, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"]["failed"] == 1
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"]["failed"] == 0 and summary["steps"]["ok"] == 12


def test_verbose_prints_a_failed_episodes_traceback_where_the_run_goes_on(env, data, tmp_path):
    """--verbose is where a pipeline author sees where their forward failed: the failed episode's traceback is
    printed before its error line, also when the run goes on with the other episodes (without --fail-fast)."""
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 1}]
    proc = ardiff(env, *rollout_args(data, tmp_path / "run", "--verbose"), faults=faults)
    assert proc.returncode == 4, proc.stderr
    error = ("Error: episode 'arm_b' failed at step 1 in the model's forward: InjectedFault: injected fault in "
             "transformer block 1")
    before = proc.stderr[:proc.stderr.index(error)]
    assert before.count("Traceback (most recent call last):") == 1, proc.stderr
    assert "faulty_pipelines.py" in before and "InjectedFault: injected fault in transformer block 1" in before


def test_a_failed_episode_does_not_keep_its_forwards_tensors_alive(env, data, tmp_path):
    probe = tmp_path / "alive.json"
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 1, "probe": True},
              {"request": "arm_d/000002", "site": "probe", "path": str(probe)}]  # the run's last request
    proc = ardiff(env, *rollout_args(data, tmp_path / "run"), faults=faults)
    assert proc.returncode == 4, proc.stderr
    assert json.loads(probe.read_text()) == [False]  # on a GPU these would be the caches' and activations' memory


def test_fail_fast_stops_at_the_first_failure_and_resume_completes(env, data, reference, tmp_path):
    run = tmp_path / "run"
    faults = [{"request": "arm_b/000001", "site": "page_shortage"}]
    proc = ardiff(env, *rollout_args(data, run, "--fail-fast", "--verbose"), faults=faults)
    assert proc.returncode == 3, proc.stderr  # out of memory
    err = proc.stderr
    assert ("episode 'arm_b' failed at step 1 in the model's forward: KVCacheExhaustedError: session 'arm_b', "
            "branch 'positive': KV page pool exhausted: 1 page requested, 0 free of") in err
    assert "Traceback" in err and ("hint: the KV page pool, sized by the capacity plan for every resident session, "
                                   "ran short: the pipeline's KV spec or ardiff's plan undercounts") in err
    lines = records(run)
    assert [(r["episode"], r["step"], r["status"]) for r in lines] == [
        ("arm_a", 0, "ok"), ("arm_b", 0, "ok"), ("arm_c", 0, "ok"), ("arm_d", 0, "ok"), ("arm_a", 1, "ok"),
        ("arm_b", 1, "failed")]
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"

    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--no-warmup")  # without --pipeline: refused
    assert proc.returncode == 2 and "resume with --pipeline faulty_pipelines:FaultyDreamZero" in proc.stderr
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert "5 steps already done" in proc.stderr
    assert_matches(run, reference)


def test_a_signal_before_anything_was_written_says_to_run_again_not_to_resume(env, data, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "loading"
    faults = [{"site": "load", "marker": str(marker)}]
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *rollout_args(data, run)], cwd=REPO, text=True,
                            env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_marker(proc, marker, "loading")  # the process is loading the model: no run.json yet
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted by SIGINT" in err and "--resume" not in err
    assert "hint: nothing was written yet: run the same command again" in err
    assert not (run / "run.json").exists()
    proc = ardiff(env, *rollout_args(data, run))  # and that works: the folder holds no run
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("signals", [1, 2])
def test_signal_in_the_middle_of_a_forward_then_resume(env, data, reference, tmp_path, signum, code, signals):
    # One signal lets the step finish (its output and its line are written), then the run stops: the session holds
    # whole steps, so the stop keeps it and --resume replays nothing. The forward used to be cut short, its session
    # released, and its episode replayed. A second signal stops the forward at once.
    run = tmp_path / "run"
    # in block 0 of the negative branch's commit pass, the positive one's committed (call 2: the negative one)
    faults = [{"request": "arm_c/000001", "site": "block", "layer": 0, "call": 2, "action": "sleep"}]
    proc, err = stop_inside_a_fault(env, rollout_args(data, run), faults, tmp_path, signum=signum, second=signals == 2)
    name = signal.Signals(signum).name
    assert proc.returncode == code, err
    again = "Ctrl-C" if signum == signal.SIGINT else name
    assert f"{name}: {NOTICE} ({again} again to stop at once" in err, err
    assert f"interrupted by {name}" in err and "--resume" in err
    lines = records(run)  # whole lines only
    assert [(r["episode"], r["step"]) for r in lines] == [
        ("arm_a", 0), ("arm_b", 0), ("arm_c", 0), ("arm_d", 0), ("arm_a", 1), ("arm_b", 1)] + [("arm_c", 1)] * (
        signals == 1)
    assert all(r["status"] == "ok" for r in lines)
    written, want = outputs(run), outputs(reference)  # every output loads in full, and is what the reference wrote
    assert sorted(written) == sorted(r["output"] for r in lines)
    for name, arrays in written.items():
        for key, value in arrays.items():
            np.testing.assert_array_equal(value, want[name][key], err_msg=f"{name}:{key}")
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"

    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert sorted((r["episode"], r["step"]) for r in records(run)) == sorted(
        (e, s) for e in EPISODES for s in range(3))  # nothing run twice, nothing missing
    assert json.loads((run / "summary.json").read_text())["steps"]["replayed"] == (signals == 2)  # arm_c's step 0
    assert_matches(run, reference)


TWO_SIGNALS = [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGTERM), (signal.SIGHUP, signal.SIGTERM)]


def _default_signals() -> None:
    """In a child before it runs ardiff: SIGINT, SIGTERM and SIGHUP with their default action, none blocked. A child
    inherits an ignored signal (and the mask) from the pytest worker, whatever an earlier test left there, and ardiff
    keeps an ignored signal ignored (nohup): a signal the test sends would then do nothing."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


LEAKS = """\
import signal

def test_ignores():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

def test_blocks():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})

def test_after_them():
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not signal.pthread_sigmask(signal.SIG_BLOCK, [])
"""


def test_a_test_that_leaves_a_signal_ignored_or_blocked_fails_and_the_tests_after_it_do_not_inherit_it(tmp_path):
    # What the signals tests' CLI subprocesses inherit from their pytest worker: an earlier test that left SIGTERM
    # ignored or SIGHUP blocked there made the signal a later test sent do nothing (conftest's check of every test)
    (tmp_path / "test_leaks.py").write_text(LEAKS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)])}
    # started as the checks expect, whatever this pytest inherited: under a runner that ignores SIGTERM or blocks
    # SIGHUP, the inner pytest began so, saw no change where a test made none, and test_after_them failed
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
                           "test_leaks.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=_default_signals)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # the tests pass, the teardown of the two that leak fails, and the one after them finds them put back
    assert "3 passed, 2 errors" in proc.stdout, proc.stdout
    left = "the test left the worker's signal handling changed (restored now): "
    assert (f"ERROR at teardown of test_ignores _\n{left}SIGTERM: <Handlers.SIG_DFL: 0> -> <Handlers.SIG_IGN: 1>;"
            in re.sub("_+\n", "_\n", proc.stdout)), proc.stdout
    assert (f"ERROR at teardown of test_blocks _\n{left}blocked: [] -> [<Signals.SIGHUP: 1>];"
            in re.sub("_+\n", "_\n", proc.stdout)), proc.stdout


def send_and_wait_delivered(proc: subprocess.Popen, signum: int) -> None:
    """``signum`` to ``proc``, then wait until a thread of it took the signal (its C handler ran: the bit left
    the process's pending set, /proc/PID/status ShdPnd), even while Python waits to run the handler's Python half.
    Sent before, the next signal would be pending with it, and the kernel hands two pending signals to a thread
    together: their C handlers ran in no order the test chose."""
    proc.send_signal(signum)
    deadline = time.monotonic() + 300
    while True:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        if not int(re.search(r"^ShdPnd:\s*([0-9a-f]+)", status, re.M).group(1), 16) & (1 << (signum - 1)):
            return
        assert proc.poll() is None and time.monotonic() < deadline, f"signal {signum} never delivered"
        time.sleep(0.001)


def two_signals(env, args: list[str], faults: list[dict], tmp_path: Path, first: int, second: int, *,
                notice: bool = False) -> tuple[subprocess.Popen, str]:
    """``ardiff ARGS`` with ``faults`` (a ``sleep`` or ``torch_wait`` one given this test's marker and release
    files): ``first`` then ``second`` once the process waits in that fault; after the first's notice for a ``sleep``
    in a step (``notice``: its handler ran), both inside the one torch call for a ``torch_wait``, which then ends.
    (The exited process, its stderr.)"""
    proc, marker, release, log = start_with_fault_files(env, args, faults, tmp_path)
    try:
        wait_for_marker(proc, marker, "the fault")
        if any(fault.get("action") == "torch_wait" for fault in faults):
            wait_blocked(proc)  # inside the torch call: the marker is made just before it
        send_and_wait_delivered(proc, first)
        if notice:
            wait_for_marker(proc, log, "the notice of the first signal", text=NOTICE)
        send_and_wait_delivered(proc, second)
        release.touch()  # a torch_wait returns, and its signals are handled; a sleep was cut short already
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    return proc, log.read_text()


@pytest.mark.parametrize("wait", ["sleep", "torch_wait"])
@pytest.mark.parametrize(("first", "second"), TWO_SIGNALS)
def test_two_different_signals_in_a_step_exit_with_the_first_ones_code(env, data, tmp_path, first, second, wait):
    # The second stopped the step at once and its code was the exit code: SIGTERM then Ctrl-C exited 130. Two that
    # came inside one torch op were handled in the order of their numbers (SIGINT's first), not as they came: the
    # notice named SIGINT and the run exited 143, or (SIGHUP then SIGTERM) 143 for 129.
    run = tmp_path / "run"
    faults = [{"request": "arm_c/000001", "site": "block", "layer": 0, "call": 2, "action": wait}]
    proc, err = two_signals(env, rollout_args(data, run), faults, tmp_path, first, second, notice=wait == "sleep")
    name = signal.Signals(first).name
    assert proc.returncode == 128 + first, err
    assert f"{name}: {NOTICE}" in err and err.count(NOTICE) == 1, err
    assert f"interrupted by {name}" in err and f"interrupted by {signal.Signals(second).name}" not in err, err
    assert ("arm_c", 1) not in [(r["episode"], r["step"]) for r in records(run)]  # the second stopped it at once
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_same_signal_twice_in_one_torch_op_of_a_step_stops_it_at_once(env, data, tmp_path, signum):
    # Ctrl-C pressed twice while a step was in one torch op: both delivered (two bytes on the wakeup fd), but Python
    # ran the handler once, so the step finished as for one signal (arm_c's step 1 written), not stopped at once.
    run = tmp_path / "run"
    faults = [{"request": "arm_c/000001", "site": "block", "layer": 0, "call": 2, "action": "torch_wait"}]
    proc, err = two_signals(env, rollout_args(data, run), faults, tmp_path, signum, signum)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, err
    assert f"{name}: {NOTICE}" in err and err.count(NOTICE) == 1, err
    assert err.count("Error:") == 1 and "Traceback" not in err, err
    assert ("arm_c", 1) not in [(r["episode"], r["step"]) for r in records(run)]  # the second stopped it at once
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"


# imported first of all as ardiff imports its commands: this one waits in a read of the FIFO HOLD (no one writes it)
SLOW_SHLEX = """\
import importlib.util, os, sys, sysconfig
hold = os.environ.pop("HOLD", None)
if hold:
    with open(hold) as held:
        held.read()
spec = importlib.util.spec_from_file_location("shlex", os.path.join(sysconfig.get_paths()["stdlib"], "shlex.py"))
sys.modules["shlex"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules["shlex"])
"""


@pytest.mark.parametrize("phase", ["import", "resume"])
@pytest.mark.parametrize(("first", "second"), [(signal.SIGINT, signal.SIGINT), *TWO_SIGNALS])
def test_a_second_signal_while_a_signal_before_the_command_took_them_is_reported_changes_nothing(
        env, tmp_path, first, second, phase):
    # Before a command installs its handlers (ardiff imports its commands, held here by a slow import, or a resume
    # reads a run.json that blocks: a FIFO no one writes yet), the second signal was raised into the report of the
    # first (held here by a full stderr): its Error line and JSON object were lost, or a traceback printed instead,
    # and the exit code was 130 (or 1) whatever the signals (SIGTERM then SIGINT: 130, not 143).
    run = tmp_path / "run"
    run.mkdir()
    if phase == "import":
        hold, shim = tmp_path / "hold", tmp_path / "shim"
        shim.mkdir()
        (shim / "shlex.py").write_text(SLOW_SHLEX)
        env = {**env, "HOLD": str(hold), "PYTHONPATH": os.pathsep.join([str(shim), env.get("PYTHONPATH", "")])}
    else:
        hold = run / "run.json"
    os.mkfifo(hold)
    read_end, write_end = os.pipe()
    inherited = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with open(read_end, "rb") as err_pipe:
        proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run),
                                 "--format", "json"], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                stderr=write_end, preexec_fn=_default_signals)
        # the pipe filled through a file description of its own: the process's stderr stays blocking
        filler = os.open(f"/proc/self/fd/{write_end}", os.O_WRONLY | os.O_NONBLOCK)
        os.close(write_end)
        writer = None
        try:
            writer = open_to_write(proc, hold)
            deadline = time.monotonic() + 300
            filled = 0
            for size in (4096, 1):  # full to the last byte
                with contextlib.suppress(BlockingIOError):
                    while True:
                        filled += os.write(filler, b"." * size)
            assert "Threads:\t1\n" in Path(f"/proc/{proc.pid}/status").read_text()  # the main thread takes them
            wait_reading(proc, hold)  # a read the first signal interrupts
            send_and_wait_delivered(proc, first)
            write = syscall_number("write")
            while True:  # the report of the first waits in its write to stderr (write(2) on fd 2)
                call = Path(f"/proc/{proc.pid}/syscall").read_text().split()
                if call[:2] == [write, "0x2"]:
                    break
                assert proc.poll() is None and time.monotonic() < deadline, (
                    proc.poll(), call[:2], inherited, re.findall(r"^Sig\w+:.*$", Path(f"/proc/{proc.pid}/status")
                                                                 .read_text(), re.M))
                time.sleep(0.001)
            send_and_wait_delivered(proc, second)
            os.close(filler)
            filler = None
            with ThreadPoolExecutor(1) as pool:  # stderr read meanwhile: the report waits for room in it
                err_read = pool.submit(err_pipe.read)
                stdout, _ = proc.communicate(timeout=120)
                err = err_read.result(timeout=120).decode()
        finally:
            proc.kill()
            for fd in (filler, writer):
                if fd is not None:
                    os.close(fd)
    assert "." * filled in err
    err = err.replace("." * filled, "", 1)
    code = 128 + first
    # a resume's folder is known: its stop says so as a later one does, with the resume to paste
    message, hint = (interrupted_message(first), None) if phase == "import" else (
        f"interrupted by {signal.Signals(first).name}", f"continue with: ardiff rollout --resume --out {run}")
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.count("Error:") == 1 and f"Error: {message}\n" in err, err
    assert json.loads(stdout.splitlines()[-1]) == {"kind": "interrupted", "message": message, "hint": hint,
                                                   "exit_code": code}


@pytest.mark.parametrize("phase", ["load", "warmup", "warmup command"])
@pytest.mark.parametrize(("first", "second"), TWO_SIGNALS)
def test_two_different_signals_in_one_torch_op_as_the_model_loads_or_warms_up_exit_with_the_first_ones_code(
        env, data, tmp_path, first, second, phase):
    # There the first is raised at once, and the handlers of two that came inside one torch op run in the order of
    # their numbers: SIGTERM then Ctrl-C raised SIGINT's stop first, exit 130.
    run = tmp_path / "run"
    if phase == "load":
        faults, args = [{"site": "load", "action": "torch_wait"}], rollout_args(data, run)
    else:
        faults = [{"request": "warmup-0", "site": "block", "layer": 0, "action": "torch_wait"}]
        args = [a for a in rollout_args(data, run) if a != "--no-warmup"]
        if phase == "warmup command":
            args = ["warmup", str(data / "fast.yaml"), "--pipeline", PIPELINE, "--format", "plain"]
    proc, err = two_signals(env, args, faults, tmp_path, first, second)
    assert proc.returncode == 128 + first, err
    # lines that begin so: the fault's helper thread, started as the process exits, may print a KeyError of its own
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert f"interrupted by {signal.Signals(first).name}" in err and len(errors) == 1, err


def test_signals_that_come_together_as_a_stopped_run_exits_keep_its_exit_code(env, data, tmp_path):
    # As the process exits, a signal cuts short its wait for a thread that does not end; one more handled just
    # after (two came together: the second's handler ran as the first's stop was caught) left _end_process with a
    # traceback, and the process was killed by SIGINT (-2) instead of exiting 143.
    run = tmp_path / "run"
    exiting, let_go = tmp_path / "exiting", tmp_path / "let-go"
    faults = [{"request": "arm_a/000000", "site": "block", "layer": 0, "action": "linger", "marker": str(exiting),
               "release": str(let_go)},
              {"request": "arm_b/000001", "site": "block", "layer": 0, "action": "sleep"}]
    marker, release, log = tmp_path / "in-fault", tmp_path / "release", tmp_path / "stderr"
    faults[1].update(marker=str(marker), release=str(release))
    with log.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *rollout_args(data, run)], cwd=REPO, text=True,
                                env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)}, stdout=subprocess.PIPE,
                                stderr=stderr)
    try:
        wait_for_marker(proc, marker, "the fault")
        proc.send_signal(signal.SIGTERM)  # the step finishes, then the run stops: exit 143
        wait_for_marker(proc, log, "the notice of the first signal", text=NOTICE)
        release.touch()
        wait_for_marker(proc, exiting, "the wait for the lingering thread")
        wait_blocked(proc)  # in that wait: the marker is made as it begins
        send_and_wait_delivered(proc, signal.SIGINT)  # both handled as that thread ends: the main thread takes
        send_and_wait_delivered(proc, signal.SIGTERM)  # neither, nor is its wait cut short
        let_go.touch()
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = log.read_text()
    assert proc.returncode == 143, err
    assert "Traceback" not in err and err.count("Error: interrupted by SIGTERM") == 1, err


def test_a_step_that_fails_after_the_first_signal_is_recorded_whole_then_the_run_stops(env, data, reference, tmp_path):
    # The failure's line was written, then the stop was raised before the run counted it: summary.json said no
    # episode failed while results.jsonl had a failed line.
    run = tmp_path / "run"
    # asleep in the last block of the positive branch's sampling pass, then failing in the negative one's
    faults = [{"request": "arm_c/000001", "site": "block", "layer": 1, "call": 1, "action": "sleep"},
              {"request": "arm_c/000001", "site": "block", "layer": 0, "call": 4}]  # the next pass
    proc, err = stop_inside_a_fault(env, rollout_args(data, run), faults, tmp_path)
    assert proc.returncode == 143, err  # the stop, not the failure, ends the run
    assert "Error: episode 'arm_c' failed at step 1" in err and "injected fault in transformer block 0" in err, err
    assert [(r["episode"], r["step"], r["status"]) for r in records(run)][-1] == ("arm_c", 1, "failed")
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["episodes"]["failed"]) == ("interrupted", 1), summary
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_a_signal_in_an_episodes_last_step_still_ends_that_episode(env, data, reference, tmp_path):
    # The step in flight finished, its line saying its session closed, but the stop was raised before the episode's
    # end was taken: summary.json counted the episode incomplete with every step done, and no `episode` event (line,
    # or --format json object) said it ended (a nightly script found the episode both done and not).
    run = tmp_path / "run"
    faults = [{"request": "arm_a/000002", "site": "block", "layer": 1, "action": "sleep"}]  # arm_a's last step
    proc, err = stop_inside_a_fault(env, rollout_args(data, run), faults, tmp_path)
    assert proc.returncode == 143, err
    assert [(r["episode"], r["step"], r["closed"]) for r in records(run)][-1] == ("arm_a", 2, True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert {k: summary["episodes"][k] for k in ("completed", "incomplete")} == {"completed": 1, "incomplete": 3}
    assert [line.split(None, 3)[3] for line in err.splitlines() if " episode  " in line] == [
        "arm_a ended (complete) after 3 steps"], err
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_a_signal_while_a_session_is_rebuilt_keeps_the_steps_replayed_so_far(env, data, reference, tmp_path):
    # A run without swap space stops with every episode 2 steps in (--fail-fast at arm_a's step 2), so its resume
    # (with swap space) rebuilds arm_a's session by replaying steps 0 and 1. A signal in the first replay lets that
    # replay finish, then the run stops with the session 1 step in: it is kept, and the next resume restores it and
    # replays step 1 only. The signal used to cut the replay short, and a kept snapshot of fewer steps than done
    # was deleted.
    run = tmp_path / "run"
    failed = ardiff(env, *rollout_args(data, run, "--swap-space", "0", "--fail-fast"),
                    faults=[{"request": "arm_a/000002", "site": "block", "layer": 1}])
    assert failed.returncode == 1 and len(records(run)) == 9, failed.stderr
    faults = [{"request": "arm_a/000000/replay", "site": "block", "layer": 1, "action": "sleep"}]
    resume = ["rollout", "--resume", "--out", str(run), "--swap-space", "16MiB", "--pipeline", PIPELINE, "--no-warmup",
              "--format", "plain"]
    proc, err = stop_inside_a_fault(env, resume, faults, tmp_path)
    assert proc.returncode == 143, err
    index = json.loads((run / ".swap" / "kept.json").read_text())["sessions"]
    assert {name: entry["steps"] for name, entry in index.items()} == {"arm_a": 1}
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--swap-space", "16MiB", "--pipeline", PIPELINE,
                  "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"]["replayed"] == 1 + 2 * 3, proc.stderr  # arm_a's step 1; the others' 2 steps
    assert_matches(run, reference)


@pytest.mark.parametrize("action", ["swallow_signal", "wrap_signal"])
def test_a_signal_that_a_pipelines_catch_all_caught_still_stops_the_run_then_resume(env, data, reference, tmp_path,
                                                                                   action):
    # A second signal in a step is raised as Interrupted (an Exception) wherever the main thread is (before the
    # first asked the step to finish, the first was). A pipeline's `except Exception` caught it: the run went on
    # to exit 0 with the signal lost, or (wrapped in the pipeline's own error) the episode failed as if its input
    # were bad, and no later signal could stop the run.
    run = tmp_path / "run"
    faults = [{"request": "arm_c/000001", "site": "block", "layer": 1, "action": action}]
    proc = ardiff(env, *rollout_args(data, run), faults=faults)
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.splitlines()[-2:] == [  # the pipeline's error is in the event log, not the verdict
        "Error: interrupted by SIGTERM",
        f"hint: continue with: {on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE}"], proc.stderr
    lines = records(run)
    assert [(r["episode"], r["step"]) for r in lines][:6] == [
        ("arm_a", 0), ("arm_b", 0), ("arm_c", 0), ("arm_d", 0), ("arm_a", 1), ("arm_b", 1)]
    assert len(lines) <= 7 and all(r["status"] == "ok" for r in lines)  # arm_c's step 1 at most, done in full
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["exit_code"] == 143 and not summary["episodes"]["failed"]
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert sorted((r["episode"], r["step"]) for r in records(run)) == sorted(
        (e, s) for e in EPISODES for s in range(3))
    assert_matches(run, reference)


def test_a_signal_that_a_pipelines_catch_all_wraps_while_it_loads_stops_the_run_as_interrupted(env, data, tmp_path):
    """The stop raised inside the pipeline's from_config, caught there and wrapped in the pipeline's own error: the
    run is reported as stopped (exit 143, its hint that nothing was written), not as a pipeline that failed to load
    (exit 1, "fix the pipeline")."""
    run = tmp_path / "run"
    proc = ardiff(env, *rollout_args(data, run), faults=[{"site": "load", "action": "wrap_signal"}])
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.splitlines()[-2:] == [
        "Error: interrupted by SIGTERM", "hint: nothing was written yet: run the same command again"], proc.stderr
    assert not (run / "run.json").exists() and not (run / "summary.json").exists()


def test_a_signal_while_the_pipeline_imports_a_dependency_stops_the_run_before_it_writes_anything(env, data, reference,
                                                                                                  tmp_path):
    # The Interrupted raised inside the import (half way through the module's body) was taken for the optional
    # dependency's absence: the run went on to exit 0, the signal lost (torch's own import of numpy did the same,
    # or left numpy half-imported). Inside an import the handler now only records the signal, and the rollout raises
    # it once the model is loaded: before, it waited for the first step, after warmup (a minute on a large model).
    run = tmp_path / "run"
    proc = ardiff(env, *rollout_args(data, run), "--warmup", faults=[{"site": "import"}])
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.splitlines()[-2:] == [
        "Error: interrupted by SIGTERM", "hint: nothing was written yet: run the same command again"], proc.stderr
    assert "warmup" not in proc.stderr
    assert not (run / "run.json").exists() and not (run / "summary.json").exists()
    proc = ardiff(env, *rollout_args(data, run))
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)
    proc = ardiff(env, "warmup", str(data / "fast.yaml"), "--pipeline", PIPELINE, "--format", "plain",
                  faults=[{"site": "import"}])
    assert proc.returncode == 143 and "Error: interrupted by SIGTERM" in proc.stderr, proc.stderr


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_a_signal_inside_a_warmup_request_stops_warmup_with_its_exit_code(env, data, tmp_path, signum, code):
    """The README's 130 row for `warmup`: Ctrl-C (130) and a closed terminal (SIGHUP, 129) in a warmup request, as
    SIGTERM (143) is below: `Error: interrupted by ...` (its JSON object too), and nothing to resume."""
    marker = tmp_path / "in-fault"
    faults = [{"request": "warmup-1", "site": "block", "layer": 0, "action": "sleep", "marker": str(marker)}]
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "warmup", str(data / "fast.yaml"), "--pipeline",
                             PIPELINE, "--format", "json"], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)})
    try:
        wait_for_marker(proc, marker, "the warmup request")
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    name = signal.Signals(signum).name
    assert proc.returncode == code, stderr
    assert json.loads(stdout.splitlines()[-1]) == {"kind": "interrupted", "message": f"interrupted by {name}",
                                                   "hint": "warmup keeps nothing: run the same command again",
                                                   "exit_code": code}
    assert "Traceback" not in stderr


def test_a_rollouts_warmup_shows_each_request_as_warmup_does(env, data, tmp_path):
    # `ardiff rollout --format plain` showed its warmup as "admitted __ardiff_warmup__" and nothing else until the
    # first step: a provider of many requests (minutes on a large model) looked hung
    warmup = ardiff(env, "warmup", str(data / "fast.yaml"), "--pipeline", PIPELINE, "--format", "json")
    assert warmup.returncode == 0, warmup.stderr
    ids = [request["request_id"] for request in json.loads(warmup.stdout.splitlines()[-1])["requests"]]
    proc = ardiff(env, *rollout_args(data, tmp_path / "run", "--warmup"))
    assert proc.returncode == 0, proc.stderr
    shown = re.findall(r"^\+ *[0-9.]+s request +__ardiff_warmup__ (\S+) [0-9.]+ ms$", proc.stderr, re.MULTILINE)
    assert shown == ids and len(ids) > 1, proc.stderr
    assert "request     arm_a" not in proc.stderr  # the steps are not: their episodes' lines say how they went


@pytest.mark.parametrize(("command", "signum"), [("warmup", signal.SIGINT), ("rollout", signal.SIGTERM)])
def test_a_warmup_that_never_ends_shows_its_progress_and_stops_on_a_signal(env, data, tmp_path, command, signum):
    """A provider that never stops yielding (faulty_pipelines.EndlessWarmup): each request a line, then the signal
    stops it with its exit code and one Error line, the warmup's session released; the rollout ran no step."""
    run, err = tmp_path / "run", tmp_path / "stderr"
    args = rollout_args(data, run, "--warmup") if command == "rollout" else [
        "warmup", str(data / "fast.yaml"), "--pipeline", PIPELINE, "--format", "plain"]
    args[args.index(PIPELINE)] = "faulty_pipelines:EndlessWarmup"
    with err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=stderr, env=env)
        try:
            wait_for_marker(proc, err, "the endless warmup's fourth request past its own", text=" warmup-again-3 ")
            proc.send_signal(signum)
            stdout, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
    lines = err.read_text().splitlines()
    assert proc.returncode == 128 + signum, lines
    assert [line for line in lines if line.startswith("Error:")] == [
        f"Error: interrupted by {signal.Signals(signum).name}"], lines
    assert any(re.search(r"closed +__ardiff_warmup__ ", line) for line in lines), lines  # its pages given back
    if command == "rollout":
        assert records(run) == [], lines


def stop_in_the_warmup(env, args: list[str], tmp_path: Path, signum: int) -> tuple[subprocess.Popen, str, str]:
    """``ardiff ARGS`` (a rollout of faulty_pipelines.EndlessWarmup, whose warmup never ends) sent ``signum`` once it
    showed the warmup past its own requests (a line on stderr, or in --format json a request_finished object on
    stdout): a warmup that goes on too long. (The exited process, its stdout, its stderr.)"""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, text=True, stdout=stdout,
                                stderr=stderr, env=env)
        try:
            wait_for_marker(proc, out if args[-1] == "json" else err, "the endless warmup's second request past its "
                            "own", text="warmup-again-1")
            proc.send_signal(signum)
            proc.wait(timeout=120)
        finally:
            proc.kill()
    return proc, out.read_text(), err.read_text()


@pytest.mark.parametrize(("signum", "skips"), [(signal.SIGINT, True), (signal.SIGTERM, False),
                                               (signal.SIGHUP, False)], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_in_a_rollouts_warmup_gives_the_resume_that_skips_it(env, data, reference, tmp_path, signum, skips):
    """Ctrl-C in a warmup that goes on too long: the resume to paste ran the same warmup again (the README said to add
    --no-warmup by hand). It gives --no-warmup now, and so does a resume stopped so in its own warmup; pasted, the
    steps run without one warmup request. SIGTERM and SIGHUP (a scheduler's preemption, a closed terminal) are no
    verdict on the warmup, and a resume on a fresh machine wants its check: theirs is the run's resume as before."""
    run, name = tmp_path / "run", signal.Signals(signum).name
    args = rollout_args(data, run, "--warmup")
    args[args.index(PIPELINE)] = "faulty_pipelines:EndlessWarmup"
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline faulty_pipelines:EndlessWarmup" + (
        " --no-warmup" if skips else "")
    resume = ["rollout", "--resume", "--out", str(run), "--pipeline", "faulty_pipelines:EndlessWarmup", "--format"]
    for i, command in enumerate([args, [*resume, "plain"], [*resume, "json"]]):  # the run, then two resumes of it
        (tmp_path / str(i)).mkdir()
        proc, stdout, stderr = stop_in_the_warmup(env, command, tmp_path / str(i), signum)
        lines = stderr.splitlines()
        assert proc.returncode == 128 + signum, lines
        assert lines[-2:] == [f"Error: interrupted by {name}", f"hint: continue with: {again}"], lines
        if command[-1] == "json":
            assert json.loads(stdout.splitlines()[-1])["hint"] == f"continue with: {again}", stdout
        assert records(run) == [], lines
    if skips:
        from test_cli_rollout import pasted

        proc = pasted(env, again, REPO)
        assert proc.returncode == 0, proc.stderr
        assert "__ardiff_warmup__" not in proc.stderr, proc.stderr  # no warmup request ran
        assert_matches(run, reference)


@pytest.mark.parametrize("skip", [True, False], ids=["no_warmup", "warmup"])
def test_a_resume_stopped_as_its_model_loads_gives_the_resume_with_the_warmup_it_was_given(env, data, tmp_path, skip):
    """A resume given --no-warmup (the hint of a Ctrl-C in the warmup, pasted) and stopped before its steps, as its
    model loads: the resume to paste ran the warmup it was given to skip. It skips it now; one not given --no-warmup
    runs it. Once past the warmup (a step) a resume's hint is the run's resume alone
    (test_a_stopped_runs_hint_gives_its_resume_which_pasted_completes_the_run): --no-warmup given to one resume does
    not make every later one skip the warmup, and run.json does not record it."""
    run, loading = tmp_path / "run", tmp_path / "loading"
    faults = [{"request": "arm_c/000001", "site": "block", "layer": 0, "call": 2, "action": "sleep"}]
    proc, err = stop_inside_a_fault(env, rollout_args(data, run), faults, tmp_path, signum=signal.SIGTERM)
    assert proc.returncode == 143, err
    recorded = json.loads((run / "run.json").read_text())
    faults = [{"site": "load", "action": "sleep", "seconds": 600, "marker": str(loading)}]
    resume = ["rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--format", "plain"]
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *resume, *(["--no-warmup"] if skip else [])],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)})
    try:
        wait_for_marker(proc, loading, "the resume's model load")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE}"
    assert stderr.splitlines()[-2:] == [
        "Error: interrupted by SIGINT", f"hint: continue with: {again}{' --no-warmup' if skip else ''}"], stderr
    assert json.loads((run / "run.json").read_text()) == recorded  # stopped before it wrote its own


@pytest.mark.parametrize("form", ["plain", "json"])
def test_a_resume_given_no_warmup_stopped_as_it_reads_run_json_keeps_it(env, reference, tmp_path, form):
    """A resume given --no-warmup stopped before it takes the signals, as it reads a run.json that blocks as on a hung
    mount (a FIFO no one writes yet): its hint gave the resume without --no-warmup, where one stopped as its model
    loads keeps it, and pasted it ran the warmup the user had skipped. Pasted once run.json is back, the resume given
    finishes the run with no warmup request."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "run.json").unlink()
    os.mkfifo(run / "run.json")
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))  # its last step runs again
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run),
                             "--pipeline", PIPELINE, "--no-warmup", "--format", form], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdout, stderr = stopped_while_reading(proc, run / "run.json")
    again = f"ardiff rollout --resume --out {run} --pipeline {PIPELINE} --no-warmup"  # run.json not read: no folders
    assert proc.returncode == 130, stderr
    assert stderr.splitlines()[-2:] == ["Error: interrupted by SIGINT", f"hint: continue with: {again}"], stderr
    if form == "json":
        assert json.loads(stdout.splitlines()[-1])["hint"] == f"continue with: {again}", stdout
    (run / "run.json").unlink()
    shutil.copy(reference / "run.json", run / "run.json")
    from test_cli_rollout import pasted

    proc = pasted(env, again, REPO)
    assert proc.returncode == 0, proc.stderr
    assert "__ardiff_warmup__" not in proc.stderr, proc.stderr  # no warmup request ran
    assert len(records(run)) == len(lines) and all(r["status"] == "ok" for r in records(run))


@pytest.mark.parametrize("form", ["plain", "json"])
def test_a_resume_given_no_warmup_whose_run_json_write_fails_keeps_it(env, reference, tmp_path, form):
    """A resume given --no-warmup whose run.json cannot be written (here past a file-size limit, ulimit -f: a full
    disk alike), after its model loaded and before its warmup: its hint gave the resume without --no-warmup, where
    a stop or a failure as its model loads keeps it. Pasted with no limit, the resume given finishes the run with no
    warmup request."""
    import resource

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))  # its last step runs again
    recorded = (run / "run.json").read_bytes()
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run),
                           "--pipeline", PIPELINE, "--no-warmup", "--format", form], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64)))
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --no-warmup"
    hint = (f"hint: a file reached this process's file-size limit of 64 bytes (ulimit -f): raise it (ulimit -f "
            f"unlimited), then continue with: {again}")
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines()[-2:] == [f"Error: cannot write {run}/run.json: File too large", hint], proc.stderr
    if form == "json":
        assert json.loads(proc.stdout.splitlines()[-1])["hint"] == hint.removeprefix("hint: "), proc.stdout
    assert (run / "run.json").read_bytes() == recorded  # the old one, whole
    from test_cli_rollout import pasted

    proc = pasted(env, again, REPO)
    assert proc.returncode == 0, proc.stderr
    assert "__ardiff_warmup__" not in proc.stderr, proc.stderr  # no warmup request ran
    assert len(records(run)) == len(lines) and all(r["status"] == "ok" for r in records(run))


def test_a_resume_given_no_warmup_that_fails_as_its_model_loads_gives_the_resume_with_it(env, data, tmp_path):
    """A resume given --no-warmup (a warmup stopped as too long, its hint pasted) that runs out of memory as its model
    loads: the resume its hint gave to paste ran the warmup it was given to skip, as a stop there did before."""
    run = tmp_path / "run"
    faults = [{"request": "arm_c/000001", "site": "block", "layer": 0, "call": 2, "action": "sleep"}]
    proc, err = stop_inside_a_fault(env, rollout_args(data, run), faults, tmp_path, signum=signal.SIGTERM)
    assert proc.returncode == 143, err
    faults = [{"site": "load", "action": "oom"}]
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run), "--pipeline",
                           PIPELINE, "--format", "plain", "--no-warmup"], cwd=REPO, text=True, capture_output=True,
                          env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)}, timeout=300)
    hint = proc.stderr.splitlines()[-1]
    assert proc.returncode == 3 and hint.startswith("hint: "), proc.stderr
    assert hint.endswith(f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --no-warmup"), hint


@pytest.mark.parametrize("action", ["swallow_signal", "wrap_signal"])
def test_a_signal_caught_inside_a_warmup_request_stops_warmup(env, data, action):
    # warmup reported success (exit 0), or the pipeline's failure, for a warmup the user had stopped. Its hint was
    # the rollout's "--resume", an option warmup does not take
    faults = [{"request": "warmup-0", "site": "block", "layer": 0, "action": action}]
    proc = ardiff(env, "warmup", str(data / "fast.yaml"), "--pipeline", PIPELINE, "--format", "json", faults=faults)
    error = json_error(proc, 143)
    assert error["kind"] == "interrupted" and error["message"] == "interrupted by SIGTERM", error
    assert error["hint"] == "warmup keeps nothing: run the same command again", error


@pytest.mark.parametrize(("pipeline", "message"), [
    ("WrongKVHeads", "Error: warmup request 'warmup-0' of WrongKVHeads failed: ValueError: cross-attention 'text' "
                     "of branch 'main' (session '__ardiff_warmup__'): layer 0 k must be shaped (num_kv_heads, "
                     "num_tokens, head_size) (8, 16, 16), got (4, 16, 16): the pipeline's "
                     "ar_diffusion_kv_cache_spec() declares cross_attention 'text' with no num_kv_heads (so the "
                     "spec's own num_kv_heads=8)"),
    # the expected length was named without the field that sets it, nor where that is declared
    ("WrongCrossTokens", "Error: warmup request 'warmup-0' of WrongCrossTokens failed: ValueError: cross-attention "
                         "'text' of branch 'main' (session '__ardiff_warmup__'): layer 0 k must be shaped "
                         "(num_kv_heads, num_tokens, head_size) (4, 17, 16), got (4, 16, 16): the pipeline's "
                         "ar_diffusion_kv_cache_spec() declares cross_attention 'text' with num_tokens=17"),
    # "AttributeError: 'numpy.ndarray' object has no attribute 'requires_grad'": no layer, no layout, from ardiff
    ("KVAsNumpy", "Error: warmup request 'warmup-0' of KVAsNumpy failed: ValueError: layer 0 of branch 'main': attend "
                  "takes q (heads, tokens, head_size) and k, v (4, tokens, 16) as torch tensors (torch.float32 on "
                  "cpu, like the KV pool); got k numpy.ndarray, v numpy.ndarray"),
    # taken, attended to an empty output: torch's "RuntimeError: shape '[49, 64]' is invalid for input of size 0"
    ("NoQueryHeads", "Error: warmup request 'warmup-0' of NoQueryHeads failed: ValueError: layer 0 of branch 'main': "
                     "attend takes q (heads, tokens, head_size) and k, v (4, tokens, 16), with tokens = seq_len 48 (+ "
                     "up to 1 register tokens) and q's heads a positive multiple of 4; got q (0, 49, 16), "
                     "k (4, 49, 16), v (4, 49, 16)"),
    ("WarmupReturnsNone", "Error: WarmupReturnsNone.ar_diffusion_warmup_requests() must return an iterable of "
                          "ARDiffusionRequest, got NoneType"),
    # exit 2 and "hint: see the episode format": no episode was given, the pipeline's own warmup request was refused
    ("WarmupFailsItsOwnCheck", "Error: warmup request 'warmup-0' of WarmupFailsItsOwnCheck failed: ObservationError: "
                               "request inputs: 'seed' must be a non-negative integer, got -1"),
    ("HooksMissing", "Error: HooksMissing does not implement the AR-Diffusion pipeline capability: missing "
                     "ar_diffusion_kv_cache_spec, bind_ar_diffusion_state"),
    ("BrokenFromConfig", "Error: BrokenFromConfig.from_config() failed: KeyError: 'blocks.0.self_attn.q.weight'"),
    # "Error: NoneType does not implement the AR-Diffusion pipeline capability: missing ar_diffusion_kv_cache_spec,
    # ...": the class does implement them; its from_config returned nothing
    ("FromConfigReturnsNothing", "Error: FromConfigReturnsNothing.from_config() returned NoneType, expected the "
                                 "pipeline (a FromConfigReturnsNothing)"),
    ("FromConfigReturnsClass", "Error: FromConfigReturnsClass.from_config() returned the class FromConfigReturnsClass, "
                               "expected the pipeline (a FromConfigReturnsClass)"),
    ("SpecOtherThanItsConfig", "Error: SpecOtherThanItsConfig.ar_diffusion_kv_cache_spec() differs from its "
                               "Config.kv_cache_spec(): window_frames 60 (the config's 6)"),
    # "Error: unexpected ValueError: ...", "hint: this is a bug in ardiff", and the traceback
    ("DeclaresBatching", "Error: ARDiffusionModelRunner supports request-mode execution only (max_num_seqs=1, one "
                         "request per forward, no step execution): batching or stepping requests would bypass "
                         "bind_ar_diffusion_state(), which binds exactly one session's KV state around one forward; "
                         "the pipeline DeclaresBatching declares supports_request_batch=True"),
    # warmup passed (exit 0), and then every step of a rollout failed
    ("ReturnsTensor", "Error: warmup request 'warmup-0' of ReturnsTensor: ReturnsTensor.forward() returned Tensor, "
                      "expected a dict of arrays"),
    ("ReturnsLists", "Error: warmup request 'warmup-0' of ReturnsLists: ReturnsLists.forward() returned a dict with "
                     "no array in it ('latents': list), expected a dict of arrays"),
    ("ReturnsText", "Error: warmup request 'warmup-0' of ReturnsText: ReturnsText.forward() returned arrays a step "
                    "file cannot hold: 'caption' (<U"),
    # warmup passed, and every step failed "while writing its outputs", with a hint to check free space
    ("ReturnsFloat8", "Error: warmup request 'warmup-0' of ReturnsFloat8: ReturnsFloat8.forward() returned arrays a "
                      "step file cannot hold: 'latents' (torch.float8_e5m2); expected bool, integer or floating "
                      "arrays (float16, bfloat16, float32 or float64)"),
    ("ReturnsNumberedArrays", "Error: warmup request 'warmup-0' of ReturnsNumberedArrays: ReturnsNumberedArrays"
                              ".forward() returned arrays named by keys that are not text: 0 (int); expected a "
                              "dict of arrays"),
    ("ReturnsNaN", "Error: warmup request 'warmup-0' of ReturnsNaN: ReturnsNaN.forward() returned non-finite values: "
                   "'latents': "),
])
def test_a_pipeline_authors_mistake_is_named_as_the_pipelines_not_as_a_bug_in_ardiff(env, tmp_path, pipeline,
                                                                                     message):
    # a missing method's hint names the README section that lists them; any other, that the pipeline's code failed
    hint = {"HooksMissing": "hint: see README, 'Adding a pipeline', for the methods a pipeline class implements",
            "SpecOtherThanItsConfig": "hint: build both from the same config fields, so that inspect-capacity plans "
                                      "what load allocates",
            "ReturnsNaN": "hint: the model diverged on the warmup's inputs",
            "DeclaresBatching": "hint: leave supports_request_batch out (or False)",
            "FromConfigReturnsNothing": "hint: end from_config with `return cls(...)`",
            "FromConfigReturnsClass": "hint: end from_config with `return cls(...)`"}.get(pipeline,
                                                                                         "hint: the pipeline's code")
    commands = {"warmup": ["warmup"], "rollout --warmup": ["rollout", "--warmup", "--out", str(tmp_path / "run")]}
    for name, command in commands.items():
        proc = ardiff(env, *command, "causal-world-tiny", "--device", "cpu", "--format", "plain",
                      "--pipeline", f"author_mistakes:{pipeline}")
        assert proc.returncode == 1, (name, proc.stderr)
        assert message in proc.stderr and hint in proc.stderr, (name, proc.stderr)
        assert "bug in ardiff" not in proc.stderr and "Traceback" not in proc.stderr, (name, proc.stderr)
    verbose = ardiff(env, "warmup", "causal-world-tiny", "--device", "cpu", "--format", "plain", "--verbose",
                     "--pipeline", f"author_mistakes:{pipeline}")
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


@pytest.mark.parametrize(("pipeline", "message"), [
    ("ConfigFromDictRaises", "pipeline 'author_mistakes:ConfigFromDictRaises': ConfigFromDictRaises.Config.from_dict() "
                             "raised ValueError: window_frames must be positive"),
    ("ConfigSpecNotASpec", "pipeline 'author_mistakes:ConfigSpecNotASpec': ConfigSpecNotASpec.Config.kv_cache_spec() "
                           "returned dict, expected an ARDiffusionKVCacheSpec"),
    ("ConfigSpecRefused", "pipeline 'author_mistakes:ConfigSpecRefused': ConfigSpecRefused.Config.kv_cache_spec() "
                          "raised ValueError: AR-Diffusion window_frames must be positive, got 0"),
    ("ConfigWithoutSpec", "pipeline 'author_mistakes:ConfigWithoutSpec': ConfigWithoutSpec.Config.kv_cache_spec() "
                          "raised AttributeError: 'Config' object has no attribute 'kv_cache_spec'"),
    # it read "Config.kv_cache_spec() raised AttributeError: 'dict' object has no attribute 'kv_cache_spec'"
    ("ConfigFromDictReturnsDict", "pipeline 'author_mistakes:ConfigFromDictReturnsDict': "
                                  "ConfigFromDictReturnsDict.Config.from_dict() returned dict, expected a "
                                  "ConfigFromDictReturnsDict.Config"),
])
@pytest.mark.parametrize("command", ["inspect-capacity", "warmup"])
def test_a_pipeline_config_that_raises_is_named_as_the_pipelines_mistake(env, command, pipeline, message):
    """A Config.from_dict or kv_cache_spec raising anything but a ConfigError was 'a bug in ardiff' with a traceback."""
    proc = ardiff(env, command, "causal-world-tiny", "--device", "cpu", "--format", "plain",
                  "--pipeline", f"author_mistakes:{pipeline}")
    assert proc.returncode == 1, proc.stderr
    assert "causal-world-tiny.yaml: " + message in proc.stderr.splitlines()[-2]
    assert "hint: a pipeline's Config raises ardiff_cli.runtime.errors.ConfigError" in proc.stderr
    assert "bug in ardiff" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_capability_method_of_another_signature_is_refused_at_load_naming_its_file(env, tmp_path):
    """`def bind_ar_diffusion_state(self, state)` loaded: `rollout --no-warmup` wrote run.json, then every step
    failed with "TypeError: ... takes 2 positional arguments but 3 were given" (each episode failed, exit 1, and a
    hint to --resume), and warmup failed at its first request. Refused at load, before any step or output."""
    import inspect

    import author_mistakes

    line = inspect.getsourcelines(author_mistakes.BindWithoutSessionId.bind_ar_diffusion_state)[1]
    out = tmp_path / "run"
    for command in (["rollout", "--no-warmup", "--out", str(out)], ["warmup"]):
        proc = ardiff(env, *command, "causal-world-tiny", "--device", "cpu", "--format", "plain",
                      "--pipeline", "author_mistakes:BindWithoutSessionId")
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.splitlines()[-2:] == [
            f"Error: BindWithoutSessionId.bind_ar_diffusion_state() (tests/author_mistakes.py:{line}) cannot take "
            "the arguments ardiff passes it: expected bind_ar_diffusion_state(session_id, state), got "
            "bind_ar_diffusion_state(state): too many positional arguments",
            "hint: define it as `def bind_ar_diffusion_state(self, session_id, state)` (README, 'Adding a pipeline')",
        ], proc.stderr
    assert not (out / "results.jsonl").exists() and not (out / "run.json").exists()


@pytest.mark.parametrize(("pipeline", "raised"), [
    ("ConfigFromDictWithoutWhere", "got an unexpected keyword argument 'where'"),
    ("ConfigFromDictPlainMethod", "missing 1 required positional argument: 'data'"),
])
def test_a_config_from_dict_of_another_signature_is_told_the_one_ardiff_calls(env, pipeline, raised):
    """`def from_dict(cls, data)` (no `where`), or one without @classmethod, was hinted "a pipeline's Config raises
    ConfigError ...; the cause may be a value in the config's model: section": no value was, and the signature
    ardiff calls went unsaid."""
    proc = ardiff(env, "inspect-capacity", "causal-world-tiny", "--format", "plain",
                  "--pipeline", f"author_mistakes:{pipeline}")
    assert proc.returncode == 1, proc.stderr
    assert f"{pipeline}.Config.from_dict() raised TypeError: " in proc.stderr and raised in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"hint: ardiff calls {pipeline}.Config.from_dict(data, where=...) on the class, data the config's model: "
        "mapping and where the config's name, to start a ConfigError's message with: define it as `def "
        "from_dict(cls, data, *, where)` under @classmethod (README, 'Adding a pipeline')"), proc.stderr


@pytest.mark.parametrize("name", ["dreamzeor", "causal-world", "DreamZero"])
def test_a_typo_of_a_registered_pipeline_is_not_told_to_register_a_pipeline_of_its_own(env, tmp_path, name):
    """`pipeline: dreamzeor` was told (did you mean 'dreamzero'?), then how to register a pipeline of one's own under
    an entry point or run it by --pipeline MODULE:CLASS: advice for README's `pipeline: my_world`, not for a typo."""
    config = tmp_path / "typo.yaml"
    config.write_text(f"pipeline: {name}\nmodel: {{}}\nruntime: {{device: cpu}}\n")
    proc = ardiff(env, "inspect-capacity", str(config), "--format", "plain")
    assert proc.returncode == 2 and "(did you mean '" in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == "hint: registered pipelines: causal_world, dreamzero", proc.stderr


def test_a_pipeline_spec_bound_past_what_a_plan_takes_names_the_spec_and_the_runtime_setting(env, tmp_path):
    """A spec's session_capacity of 2**32 ("no limit") was refused as "session_capacity must be a positive integer up
    to 2147483647" with a Python hint ("pass ..., or None for the spec's own bound"): the user passed nothing, and the
    runtime setting that works around it went unsaid."""
    config = tmp_path / "world.yaml"  # no runtime.session_capacity: the spec's bound is the plan's
    config.write_text("pipeline: causal_world\nmodel: {preset: tiny}\nruntime: {device: cpu, num_threads: 1}\n")
    args = [str(config), "--format", "plain", "--pipeline", "author_mistakes:DeclaresNoSessionLimit"]
    for command in (["inspect-capacity", "--available", "1GiB"], ["warmup"]):
        proc = ardiff(env, *command, *args)
        assert proc.returncode == 2, (command, proc.stderr)
        assert proc.stderr.splitlines()[-2:] == [
            "Error: the pipeline's KV spec declares session_capacity=4294967296, more than a plan takes (up to "
            "2147483647: block tables index pages with int32)",
            "hint: set runtime.session_capacity (--session-capacity) to at most 2147483647, or have the pipeline "
            "declare at most that (as many sessions as fit the memory are kept)"], (command, proc.stderr)
    proc = ardiff(env, "inspect-capacity", "--available", "1GiB", "--session-capacity", "3", *args)
    assert proc.returncode == 0 and "limit 3" in proc.stdout, proc.stderr


def test_a_top_level_typo_is_not_sent_to_model_by_a_config_that_takes_any_key(env, tmp_path):
    """A Config.from_dict that drops unknown keys takes `checkpont` too: that proves nothing about the model section
    (the hint was `did you mean 'model.checkpont'?`)."""
    (tmp_path / "c.yaml").write_text("checkpont: weights.safetensors\n")
    proc = ardiff(env, "inspect-capacity", str(tmp_path / "c.yaml"), "--format", "plain",
                  "--pipeline", "author_mistakes:ConfigIgnoresUnknownKeys")
    assert proc.returncode == 2, proc.stderr
    assert "unknown key 'checkpont' (did you mean 'checkpoint'?)" in proc.stderr, proc.stderr
    (tmp_path / "c.yaml").write_text("5: x\n")  # a key YAML reads as a number is probed as such
    proc = ardiff(env, "inspect-capacity", str(tmp_path / "c.yaml"), "--format", "plain",
                  "--pipeline", "author_mistakes:ConfigIgnoresUnknownKeys")
    assert proc.returncode == 2 and "unknown key 5\n" in proc.stderr, proc.stderr


@pytest.mark.parametrize(("pipeline", "message"), [
    ("SchemaNotASchema", "SchemaNotASchema.Config.observation_schema() returned dict, expected an ObservationSchema"),
    ("SchemaRaises", "SchemaRaises.Config.observation_schema() raised KeyError: 'conditioning'"),
    # it was every step file that failed, with "'conditioning' has dtype float32, expected <class 'numpy.float32'>"
    ("SchemaMiswritten", "the schema SchemaMiswritten.Config.observation_schema() returned: field 'conditioning': "
                         "dtype must be the name of one, such as 'uint8' or 'float32' (bool, uint8, uint16, uint32, "
                         "uint64, int8, int16, int32, int64, float16, float32, float64), got <class "
                         "'numpy.float32'>; field 'conditioning': shapes must be a tuple of accepted shapes, each a "
                         "tuple of sizes or None (any size), such as ((None, None, 3),), got (None,)"),
    ("EntrySchemaNotASchema", "EntrySchemaNotASchema.observation_schema() returned dict, expected an "
                              "ObservationSchema"),
])
def test_an_observation_schema_of_another_type_is_named_as_the_pipelines_mistake(env, data, tmp_path, pipeline,
                                                                                 message):
    """It used to fail every episode as if its step files were bad: `while reading .../step_000000.safetensors:
    AttributeError: 'dict' object has no attribute 'prompt_key'`."""
    write_episode(tmp_path / "eps" / "arm", [{"conditioning": np.zeros(8, np.float32)}], prompt="go")
    proc = ardiff(env, "rollout", "causal-world-tiny", str(tmp_path / "eps" / "arm"), "--device", "cpu",
                  "--out", str(tmp_path / "run"), "--format", "plain", "--pipeline", f"author_mistakes:{pipeline}")
    assert proc.returncode == 1, proc.stderr
    assert f"pipeline 'author_mistakes:{pipeline}': {message}" in proc.stderr
    assert "step_000000" not in proc.stderr and "bug in ardiff" not in proc.stderr


@pytest.mark.parametrize(("pipeline", "message"), [
    # It used to print an empty table and exit 0 with no word that nothing was warmed up.
    ("WarmupYieldsNothing", "warning: pipeline 'author_mistakes:WarmupYieldsNothing': ar_diffusion_warmup_requests() "
                            "yielded no requests: nothing was warmed up"),
    # The runtime's own warnings went to stderr only: the JSON result listed none of them.
    ("WarmupMisspeltKey", "warning: request 'warmup-0': extra_args key 'closeSession' is not one the runner reads"),
])
def test_a_warmup_warning_is_on_stderr_and_in_the_results_warnings(env, pipeline, message):
    args = ("warmup", "causal-world-tiny", "--device", "cpu", "--pipeline", f"author_mistakes:{pipeline}")
    plain = ardiff(env, *args, "--format", "plain")
    assert plain.returncode == 0, plain.stderr
    assert message in plain.stderr and "warning" not in plain.stdout
    as_json = ardiff(env, *args, "--format", "json")
    assert as_json.returncode == 0, as_json.stderr
    result = json.loads(as_json.stdout.splitlines()[-1])
    assert (result["kind"], result["restored"]) == ("warmup", True)
    assert (result["requests"] == []) == (pipeline == "WarmupYieldsNothing")
    assert [f"warning: {w}" for w in result["warnings"]] == [line for line in as_json.stderr.splitlines()
                                                             if line.startswith("warning:")]
    assert any(f"warning: {w}".startswith(message) for w in result["warnings"])
    quiet = ardiff(env, *args, "--format", "json", "--quiet")  # silenced on stderr, still in the result
    assert quiet.returncode == 0 and "warning" not in quiet.stderr
    assert json.loads(quiet.stdout.splitlines()[-1])["warnings"] == result["warnings"]
    normal = ardiff(env, "warmup", "causal-world-tiny", "--device", "cpu", "--format", "json")
    assert normal.returncode == 0 and json.loads(normal.stdout.splitlines()[-1])["warnings"] == []
    assert "warning" not in normal.stderr


def test_a_pipeline_without_a_warmup_provider_warms_nothing_and_says_so_without_a_warning(env):
    """The provider is optional: warmup says there is nothing to warm up and exits 0, with no warning (the one for a
    provider that yields no request is for a mistake in the provider)."""
    args = ("warmup", "causal-world-tiny", "--device", "cpu", "--pipeline", "author_mistakes:WithoutWarmup")
    plain = ardiff(env, *args, "--format", "plain")
    assert plain.returncode == 0, plain.stderr
    assert "the pipeline has no warmup provider: nothing to warm up" in plain.stdout
    assert "warning" not in plain.stderr and "first request" not in plain.stdout
    as_json = ardiff(env, *args, "--format", "json")
    assert as_json.returncode == 0, as_json.stderr
    result = json.loads(as_json.stdout.splitlines()[-1])
    assert (result["kind"], result["skipped"], result["requests"], result["warnings"]) == ("warmup", True, [], [])


def test_warmups_live_display_counts_finished_requests_not_the_runtimes_other_events(env):
    """The progress line counts warmup requests: a provider that yields none shows 0, not the count of the plan,
    session and warmup events around them (which equal the requests of the built-in pipelines, 4)."""
    rich = {key: value for key, value in env.items() if key != "NO_COLOR"}
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", "causal-world-tiny", "--device", "cpu",
                           "--pipeline", "author_mistakes:WarmupYieldsNothing", "--format", "rich"], cwd=REPO,
                          env={**rich, "COLUMNS": "120"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", proc.stderr)
    assert re.search(r"^0 requests · ", text, re.M), text


BRACKETED_REQUEST_IDS = """\
from ardiff_cli.runtime.request import ARDiffusionRequest
from pipelines.causal_world.pipeline import CausalWorldPipeline


class BracketedRequestIds(CausalWorldPipeline):
    def ar_diffusion_warmup_requests(self, session_id):
        for i, request in enumerate(super().ar_diffusion_warmup_requests(session_id)):
            yield ARDiffusionRequest(f"warmup[/]{i}\\x1b[31m", request.inputs, request.extra_args)
"""


def test_warmups_table_shows_the_pipelines_request_ids_as_they_are(env, tmp_path):
    """The table read each request id as Rich markup: 'warmup[/]0' failed the warmup that had run (exit 1, a bug in
    ardiff: MarkupError), and an escape code in one reached the terminal of a --format plain run."""
    (tmp_path / "bracketed.py").write_text(BRACKETED_REQUEST_IDS)
    env = {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"}
    proc = ardiff(env, "warmup", "causal-world-tiny", "--device", "cpu", "--format", "plain",
                  "--pipeline", "bracketed:BracketedRequestIds")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("warmup[")]
    assert len(rows) == 4 and all(re.match(rf"warmup\[/\]{i}\\x1b\[31m  prompt", row) for i, row in enumerate(rows))
    assert "\x1b" not in proc.stdout + proc.stderr


CHATTY_PIPELINE = """\
import atexit
import codecs
import subprocess
import sys
import threading
import time

from pipelines.causal_world.pipeline import CausalWorldPipeline

print("chatty: imported")


class Chatty(CausalWorldPipeline):
    def forward(self, *args, **kwargs):
        print("chatty: a forward")
        return super().forward(*args, **kwargs)


class ChattyToTheEnd(CausalWorldPipeline):
    def forward(self, *args, **kwargs):  # a thread that prints as the process ends, and an atexit handler
        if not getattr(self, "started", False):
            self.started = True
            atexit.register(print, "chatty: at exit")
            threading.Thread(target=self.late).start()
        return super().forward(*args, **kwargs)

    @staticmethod
    def late():
        while threading.main_thread().is_alive():  # until the command is over and the process ends
            time.sleep(0.01)
        print("chatty: a thread, late")


class ChattyAsItFails(CausalWorldPipeline):
    def forward(self, *args, **kwargs):  # fails with an error that a thread of the pipeline's prints as it is reported
        raise ToldByAThread("forward failed")


class ToldByAThread(RuntimeError):
    def __str__(self):  # --verbose's traceback reads it as the error is reported, past the command's body
        thread = threading.Thread(target=print, args=("chatty: a thread, as the error is reported",))
        thread.start()
        thread.join()
        return super().__str__()


class ChattyTools(CausalWorldPipeline):
    def forward(self, *args, **kwargs):  # what a tool does with sys.stdout: its descriptor, its encoding, its bytes
        subprocess.run([sys.executable, "-c", "print('chatty: a subprocess')"], stdout=sys.stdout, check=True)
        print(f"chatty: writes {codecs.lookup(sys.stdout.encoding).name}", flush=True)
        sys.stdout.buffer.write(b"chatty: bytes\\n")
        sys.stdout.buffer.flush()
        return super().forward(*args, **kwargs)
"""


@pytest.mark.parametrize("command", ["inspect-capacity", "warmup"])
@pytest.mark.parametrize("fmt", ["json", "plain"])
def test_what_a_pipeline_prints_goes_to_stderr_not_into_the_data_on_stdout(env, tmp_path, command, fmt):
    """A pipeline's print() (at import, in its forward) was a line of stdout: with --format json a script's
    json.loads of each line failed on it, and in plain it sat among the table's rows."""
    (tmp_path / "chatty.py").write_text(CHATTY_PIPELINE)
    env = {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"}
    proc = ardiff(env, command, "causal-world-tiny", "--device", "cpu", "--format", fmt, "--pipeline", "chatty:Chatty")
    assert proc.returncode == 0, proc.stderr
    assert "chatty: " not in proc.stdout
    printed = [line for line in proc.stderr.splitlines() if line.startswith("chatty: ")]
    # warmup: its 4 requests, and one of them again on its session rebuilt from its export
    assert printed == ["chatty: imported"] + ["chatty: a forward"] * (5 if command == "warmup" else 0), proc.stderr
    if fmt == "json":
        assert [json.loads(line)["kind"] for line in proc.stdout.splitlines()][-1] in ("capacity_plan", "warmup")


def test_what_a_pipeline_prints_after_the_command_goes_to_stderr_too(env, tmp_path):
    """A thread of the pipeline's still printing as the process ends, or an atexit handler, wrote after the result:
    a line of `--format json`'s stdout that was no JSON object."""
    (tmp_path / "chatty.py").write_text(CHATTY_PIPELINE)
    env = {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"}
    proc = ardiff(env, "warmup", "causal-world-tiny", "--device", "cpu", "--format", "json",
                  "--pipeline", "chatty:ChattyToTheEnd")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["kind"] for line in proc.stdout.splitlines()][-1] == "warmup", proc.stdout
    printed = [line for line in proc.stderr.splitlines() if line.startswith("chatty: ")]
    assert printed == ["chatty: imported", "chatty: a thread, late", "chatty: at exit"], proc.stderr


def test_what_a_pipeline_prints_while_its_error_is_reported_goes_to_stderr_too(env, tmp_path):
    """The error report ran once the stand-in for sys.stdout was gone: a thread of the pipeline's printing
    meanwhile wrote to stdout, among `--format json`'s objects (before the pipeline_error object)."""
    (tmp_path / "chatty.py").write_text(CHATTY_PIPELINE)
    env = {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"}
    proc = ardiff(env, "warmup", "causal-world-tiny", "--device", "cpu", "--format", "json", "--verbose",
                  "--pipeline", "chatty:ChattyAsItFails")
    assert proc.returncode == 1, proc.stderr
    assert [json.loads(line)["kind"] for line in proc.stdout.splitlines()][-1] == "pipeline_error", proc.stdout
    assert "chatty: a thread, as the error is reported" in proc.stderr.splitlines()
    assert "Error: warmup request 'warmup-0' of ChattyAsItFails failed: ToldByAThread: forward failed" in proc.stderr


def test_a_pipeline_that_hands_sys_stdout_to_a_tool_runs_and_what_it_writes_goes_to_stderr(env, tmp_path):
    """sys.stdout, stderr's stand-in while a command runs, had no descriptor, no encoding and no buffer: a forward
    running a tool with stdout=sys.stdout failed every step (`UnsupportedOperation: fileno`), as did one reading
    sys.stdout.encoding (None), though both had worked before the stand-in."""
    (tmp_path / "chatty.py").write_text(CHATTY_PIPELINE)
    env = {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"}
    proc = ardiff(env, "warmup", "causal-world-tiny", "--device", "cpu", "--format", "json",
                  "--pipeline", "chatty:ChattyTools")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["kind"] for line in proc.stdout.splitlines()][-1] == "warmup"
    printed = [line for line in proc.stderr.splitlines() if line.startswith("chatty: ")]
    assert printed == ["chatty: imported"] + ["chatty: a subprocess", "chatty: writes utf-8", "chatty: bytes"] * 5, \
        proc.stderr  # 4 warmup requests, one run again on its rebuilt session


# The vLLM kernel failing to build under `auto` cannot happen on a CPU machine (its probe and its pool
# agree there); this stands in for it, then runs the real CLI in the same process.
FAILING_VLLM_POOL = """\
import sys
import ardiff_cli.runtime.runner as runner
real = runner.ARDiffusionKVCache
def cache(*args, attention_backend="torch", **kwargs):
    if attention_backend == "vllm":
        raise RuntimeError("kernel build failed")
    return real(*args, attention_backend=attention_backend, **kwargs)
runner.select_attention_backend = lambda *args, **kwargs: ("vllm", "vLLM 0.0 on cpu")
runner.ARDiffusionKVCache = cache
from ardiff_cli.app import main
sys.argv = ["ardiff", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("command", ["warmup", "rollout"])
def test_the_attention_backend_falling_back_is_a_warning_line_that_quiet_silences(env, command, tmp_path):
    """It used to be a bare log line (`attention backend: ...`, no `warning:`) that --quiet still printed."""
    message = ("warning: attention backend: vLLM kernel failed to initialise (RuntimeError: kernel build failed); "
               "using torch")

    def run(*extra: str) -> subprocess.CompletedProcess:
        out = ["-o", str(tmp_path / f"run{len(extra)}")] if command == "rollout" else []
        return subprocess.run([sys.executable, "-c", FAILING_VLLM_POOL, command, "causal-world-tiny", "--device",
                               "cpu", *out, *extra], cwd=REPO, capture_output=True, text=True, env=env, timeout=600)

    as_json = run("--format", "json")
    assert as_json.returncode == 0, as_json.stderr
    assert [line for line in as_json.stderr.splitlines() if "attention backend" in line] == [message]
    events = [json.loads(line) for line in as_json.stdout.splitlines()]  # stdout: JSON lines only
    planned = [e for e in events if e["kind"] == "capacity_planned"]
    assert planned[0]["attention_backend"] == "torch" and "kernel build failed" in planned[0]["attention_detail"]
    quiet = run("-q")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


@pytest.mark.parametrize(("pipeline", "message"), [
    ("ReturnsTensor", "ReturnsTensor.forward() returned Tensor, expected a dict of arrays"),
    # A dict with no array in it used to be an "ok" step with an empty output file, exit 0.
    ("ReturnsLists", "ReturnsLists.forward() returned a dict with no array in it ('latents': list), expected a dict "
                     "of arrays"),
    # safetensors refused it: the step failed "while writing its outputs", with a hint to check the disk
    ("ReturnsText", "ReturnsText.forward() returned arrays a step file cannot hold: 'caption' (<U"),
    # each step was "ok", its arrays written as '0' and '1' (a key None as 'None'; {0: ..} with {'0': ..} one array)
    ("ReturnsNumberedArrays", "ReturnsNumberedArrays.forward() returned arrays named by keys that are not text: 0 "
                              "(int); expected a dict of arrays (name -> tensor or numpy array), each name a str"),
])
def test_a_forward_that_returns_no_arrays_fails_its_steps_instead_of_writing_empty_outputs(env, tmp_path, pipeline,
                                                                                            message):
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", "causal-world-tiny", "--device", "cpu", "--out", str(run), "--no-warmup",
                  "--format", "plain", "--pipeline", f"author_mistakes:{pipeline}")
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr
    assert "bug in ardiff" not in proc.stderr
    lines = records(run)
    assert lines and all(r["status"] == "failed" for r in lines)
    assert not list((run / "episodes").rglob("*.safetensors"))


def test_a_forward_writing_its_cross_attention_cache_in_place_fails_warmup_and_its_steps(env, tmp_path):
    """k.mul_() on the tensors state.cross_attention() gives wrote the session's cache itself: warmup said nothing,
    and each step of a rollout read keys scaled once more than the last, with no error."""
    said = ("ScalesTextKeysInPlace.forward() of request 'warmup-0' wrote the cross-attention cache 'text' of branch "
            "'main' (layer 0 k) in place: the tensors state.cross_attention() gives are the session's cache")
    proc = ardiff(env, "warmup", "causal-world-tiny", "--device", "cpu", "--format", "plain",
                  "--pipeline", "author_mistakes:ScalesTextKeysInPlace")
    assert proc.returncode == 1, proc.stderr
    assert said in proc.stderr and "not k.mul_(scale)" in proc.stderr
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", "causal-world-tiny", "--device", "cpu", "--out", str(run), "--no-warmup",
                  "--format", "plain", "--pipeline", "author_mistakes:ScalesTextKeysInPlace")
    assert proc.returncode == 1, proc.stderr
    assert "wrote the cross-attention cache 'text' of branch 'main' (layer 0 k) in place" in proc.stderr
    lines = records(run)
    assert lines and all(r["status"] == "failed" for r in lines)
    assert not list((run / "episodes").rglob("*.safetensors"))


def test_a_pipeline_that_calls_sys_exit_fails_the_command_with_exit_1(env, tmp_path):
    """sys.exit(0) in a forward ended warmup with exit 0 and no word, and a rollout whose summary said "failed" (exit
    code 1 in summary.json) with exit 0."""
    run = tmp_path / "run"
    for command in (["warmup"], ["rollout", "--no-warmup", "--out", str(run)]):
        proc = ardiff(env, *command, "causal-world-tiny", "--device", "cpu", "--format", "plain",
                      "--pipeline", "author_mistakes:ForwardExits")
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.endswith("Error: the command was ended by SystemExit(0) from the code it ran: a pipeline "
                                    "(or a library it calls) called sys.exit() or exit()\nhint: code that ardiff runs "
                                    "raises an exception to fail; --verbose prints where\n"), proc.stderr
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 1


def test_a_cuda_error_out_of_memory_raised_as_a_plain_runtime_error_is_out_of_memory(env, data, tmp_path):
    """Kernels that allocate outside torch's caching allocator (cuBLAS handles, FlashAttention workspaces) report a
    full GPU as a RuntimeError, not OutOfMemoryError: exit 3 with the memory hint, not "a bug in ardiff"."""
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 0, "action": "cuda_oom"}]
    proc = ardiff(env, *rollout_args(data, tmp_path / "run", "--fail-fast"), faults=faults)
    assert proc.returncode == 3, proc.stderr
    assert "CUDA error: out of memory" in proc.stderr
    assert f"hint: {ONE_SESSION_HINT}" in proc.stderr, proc.stderr
    assert "bug in ardiff" not in proc.stderr


CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


@pytest.mark.parametrize(("fault", "said"), [
    ({"action": "torch_oom"}, "out of GPU memory: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB"),
    ({"action": "runtime_error", "message": CUBLAS}, f"out of GPU memory: RuntimeError: {CUBLAS}"),
    ({"action": "runtime_error", "message": "std::bad_alloc"}, "out of host memory: RuntimeError: std::bad_alloc"),
], ids=["OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED", "bad_alloc"])
def test_each_out_of_memory_error_the_readme_names_stops_a_step_with_exit_3(env, data, tmp_path, fault, said):
    """The README's exit-3 row names torch's `OutOfMemoryError`, `CUBLAS_STATUS_ALLOC_FAILED` and `std::bad_alloc`,
    which only a unit test of their classification raised: each raised in a real step (emulated: no GPU ran it)."""
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 0, **fault}]
    proc = ardiff(env, *rollout_args(data, tmp_path / "run", "--fail-fast"), faults=faults)
    assert proc.returncode == 3, proc.stderr
    error = (f"Error: episode 'arm_b' failed at step 1 in the model's forward: {said}\n"
             f"hint: {ONE_SESSION_HINT}")
    assert error in proc.stderr, proc.stderr
    assert "bug in ardiff" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_pipeline_error_that_carries_an_exit_code_of_its_own_fails_the_run_with_exit_1_not_0(env, data, tmp_path):
    """Only ardiff's own errors (an ObservationError: 2) choose a failed step's exit code: click's and Typer's Exit,
    raised by a library built on them, carries exit_code 0, and the run its failed step stopped exited 0."""
    run = tmp_path / "run"
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 0, "action": "exit"}]
    proc = ardiff(env, *rollout_args(data, run, "--fail-fast"), faults=faults)
    assert proc.returncode == 1, proc.stderr
    assert "Error: episode 'arm_b' failed at step 1 in the model's forward: Exit: 0\n" in proc.stderr, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("failed", 1), summary


def test_the_hosts_allocator_running_out_is_out_of_memory_in_a_step_and_in_warmup(env, data, tmp_path):
    """torch's CPU allocator raises a plain RuntimeError: still exit 3 and its hint, and never blamed on the
    pipeline when warmup hits it."""
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 0, "action": "oom"}]
    proc = ardiff(env, *rollout_args(data, tmp_path / "run", "--fail-fast"), faults=faults)
    assert proc.returncode == 3, proc.stderr
    assert "DefaultCPUAllocator: can't allocate memory" in proc.stderr
    assert f"hint: {ONE_SESSION_HINT}" in proc.stderr, proc.stderr
    assert "bug in ardiff" not in proc.stderr
    faults = [{"request": "warmup-0", "site": "block", "layer": 0, "action": "oom"}]
    proc = ardiff(env, "warmup", str(data / "fast.yaml"), "--pipeline", PIPELINE, "--format", "json", faults=faults)
    error = json_error(proc, 3)
    assert error["kind"] == "out_of_memory" and "DefaultCPUAllocator" in error["message"]
    faults = [{"request": "warmup-0", "site": "block", "layer": 0, "action": "memory_error"}]
    proc = ardiff(env, "warmup", str(data / "fast.yaml"), "--pipeline", PIPELINE, "--format", "json", faults=faults)
    assert proc.returncode == 3, proc.stderr  # Python's MemoryError has no message: it said `Error: MemoryError`
    message = "out of host memory while running the warmup requests: MemoryError"
    assert json.loads(proc.stdout.splitlines()[-1])["message"] == message
    assert f"Error: {message}\nhint: {ONE_SESSION_HINT}" in proc.stderr, proc.stderr  # warmup's, for one session


# the hint of memory running out as torch or a pipeline's module imports: before any model or KV pool
IMPORT_HINT = "free some memory (another process using it?) and run again: it ran out before the model began to load"
def json_error(proc: subprocess.CompletedProcess, code: int) -> dict:
    """The last JSON object a `--format json` command printed (its error), once it exited with ``code``."""
    assert proc.returncode == code, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


STEP_OOM = [{"request": "arm_b/000001", "site": "block", "layer": 0, "action": "memory_error"}]  # arm_b step 1


def four_sessions_config(folder: Path) -> Path:
    """FAST_CONFIG without its `session_capacity: 1`: the spec's bound of 4 sessions, which a budget may limit."""
    path = folder / "sessions.yaml"
    path.write_text(FAST_CONFIG.replace(", session_capacity: 1", ""))
    return path


def step_out_of_memory(env, data, config: Path, out: Path, *extra: str) -> dict:
    """The JSON error of a --fail-fast rollout of CONFIG whose arm_b step 1 runs out of host memory (exit 3)."""
    proc = ardiff(env, "rollout", str(config), str(data / "eps"), "--out", str(out), "--pipeline", PIPELINE,
                  "--no-warmup", "--fail-fast", "--format", "json", *extra, faults=STEP_OOM)
    error = json_error(proc, 3)
    assert error["kind"] == "step_failed" and error["message"] == (
        "episode 'arm_b' failed at step 1 in the model's forward: out of host memory: MemoryError"), error
    return error


def test_a_step_out_of_memory_hints_at_what_set_the_budget_and_never_at_another_dtype_for_the_resume(env, data,
                                                                                                    tmp_path):
    """A step out of memory hinted "lower --session-capacity or --gpu-memory-fraction, or use a smaller dtype or
    model; ...; continue with --resume", whatever set the memory budget: --resume refuses another dtype or config, and
    the option or config field that set the budget went unnamed. It names them now, as the hint of a budget too small
    for one session does: --memory-budget, the config's runtime.memory_budget, the budget a resumed run's run.json
    recorded, or (no budget) --gpu-memory-fraction, the share of the free memory the KV pools take. Each plan here is
    limited by its budget (2 sessions of the spec's 4), where both changes shrink the KV pool."""
    sessions_config = four_sessions_config(tmp_path)
    budget_config = tmp_path / "budget.yaml"
    budget_config.write_text(FAST_CONFIG.replace("session_capacity: 1", "memory_budget: 600KB"))

    def hint(config: Path, out: Path, *extra: str) -> str:
        error = step_out_of_memory(env, data, config, out, *extra)
        assert "--dtype" not in error["hint"] and "use a smaller dtype" not in error["hint"], error
        sessions = json.loads((out / "summary.json").read_text())["capacity_plan"]["session_capacity"]
        assert sessions > 1
        # and the resume to paste, with one session fewer
        assert error["hint"].endswith("--resume keeps the run's dtype and config, so a smaller dtype or model is a "
                                      f"new run (another --out); to paste: {on_path(env)}ardiff rollout --resume "
                                      f"--out {out} --pipeline {PIPELINE} --session-capacity {sessions - 1}"), error
        return error["hint"]

    def resume_with(pool: str) -> str:
        return (f"continue with --resume and a lower --session-capacity or {pool}: a smaller KV pool leaves more "
                "memory to the model's activations (the other sessions were untouched); ")

    given = tmp_path / "given"
    assert hint(sessions_config, given, "--memory-budget", "600KB").startswith(
        resume_with("a smaller --memory-budget"))
    assert hint(budget_config, tmp_path / "field").startswith(resume_with(
        "a smaller --memory-budget (the config's runtime.memory_budget set it)"))
    from ardiff_cli.runtime.capacity import available_host_memory  # a share of the free memory of about 10 sessions

    fraction = str((2 << 20) / available_host_memory())
    free = hint(sessions_config, tmp_path / "free", "--gpu-memory-fraction", fraction, "--session-capacity", "1000")
    assert free.startswith(resume_with("--gpu-memory-fraction (the share of the free memory the KV pools take)"))
    # resumed: the budget run.json recorded, reused; the hint also shows while the other episodes go on
    proc = ardiff(env, "rollout", "--resume", "--out", str(given), "--pipeline", PIPELINE, "--no-warmup", "--format",
                  "plain", faults=STEP_OOM)
    assert proc.returncode == 4, proc.stderr
    recorded = resume_with(f"a smaller --memory-budget (the memory_budget recorded in {given / 'run.json'} set it; "
                           "one given replaces it for that resume only)")
    assert ("Error: episode 'arm_b' failed at step 1 in the model's forward: out of host memory: MemoryError\n"
            f"hint: {recorded}") in proc.stderr, proc.stderr
    assert "--dtype" not in proc.stderr and "use a smaller dtype" not in proc.stderr, proc.stderr


# arm_b's step 1 runs out of memory beside a KV pool of more than 12 pages: two sessions' (19), not one's (11)
LARGE_POOL_OOM = [{**STEP_OOM[0], "pool_over": 12}]


def paste_hint(env, hint: str, faults: list | None = None) -> subprocess.CompletedProcess:
    """The command a hint ends with (``continue with: CMD``, ``to paste: CMD``), pasted into bash as it is printed."""
    from test_cli_rollout import pasted

    command = re.split(r"(?:continue with|to paste): ", hint)[-1]
    return pasted({**env, "ARDIFF_TEST_FAULTS": json.dumps(faults or [])}, f"{command} --no-warmup", REPO)


def last_hint(stderr: str) -> str:
    return stderr.rstrip("\n").rsplit("\nhint: ", 1)[1]


@pytest.mark.parametrize("fail_fast", [False, True], ids=["goes_on", "fail_fast"])
def test_the_resume_a_step_out_of_memory_hints_at_lowers_the_session_capacity_and_pasted_completes_the_run(
        env, data, reference, tmp_path, fail_fast):
    """The step's hint asked for a lower --session-capacity, but the run's closing hint gave the run's resume alone
    (and --fail-fast's, the step's, no command): pasted, it ran into the same out of memory (exit 4 again). Both end
    with one resume, one session fewer than the plan kept, which pasted into bash completes the run."""
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(four_sessions_config(tmp_path)), str(data / "eps"), "--out", str(run),
                  "--pipeline", PIPELINE, "--no-warmup", "--memory-budget", "600KB", "--format", "plain",
                  *(["--fail-fast"] if fail_fast else []), faults=LARGE_POOL_OOM)
    assert proc.returncode == (3 if fail_fast else 4), proc.stderr
    assert json.loads((run / "summary.json").read_text())["capacity_plan"]["session_capacity"] == 2
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --session-capacity 1"
    step = proc.stderr.split("Error: episode 'arm_b' failed at step 1 in the model's forward: out of host memory: "
                             "MemoryError\nhint: ", 1)[1].split("\n", 1)[0]
    assert step.startswith("continue with --resume and a lower --session-capacity or a smaller --memory-budget: ")
    assert step.endswith(f"; to paste: {again}"), step
    hint = last_hint(proc.stderr)
    assert hint == (step if fail_fast else f"fix what is named above, then continue with: {again}"), hint
    proc = paste_hint(env, hint, faults=LARGE_POOL_OOM)  # the same device: memory runs out beside two sessions' pool
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_the_resume_to_paste_after_a_lowered_resume_ran_out_of_memory_keeps_the_lowered_session_capacity(
        env, data, reference, tmp_path):
    """A resume given --session-capacity 1 (the hint's) whose step ran out of memory again: its hint, "the KV pool
    holds one session ... continue with --resume", ended with the run's resume alone, which reads run.json's session
    capacity (the run's, 2 here): pasted, the pool was two sessions' again, and memory ran out as at first."""
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(four_sessions_config(tmp_path)), str(data / "eps"), "--out", str(run),
                  "--pipeline", PIPELINE, "--no-warmup", "--memory-budget", "600KB", "--format", "plain",
                  faults=LARGE_POOL_OOM)
    assert proc.returncode == 4, proc.stderr
    proc = paste_hint(env, last_hint(proc.stderr), faults=STEP_OOM)  # --session-capacity 1: out of memory still
    assert proc.returncode == 4, proc.stderr
    assert ONE_SESSION_HINT in proc.stderr, proc.stderr
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --session-capacity 1"
    assert last_hint(proc.stderr) == f"fix what is named above, then continue with: {again}", proc.stderr
    proc = paste_hint(env, last_hint(proc.stderr), faults=LARGE_POOL_OOM)  # memory freed for one session's pool
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_every_episode_failed_in_the_model_with_a_folder_deleted_since_hints_the_resume_that_goes_on(env, data,
                                                                                                    reference,
                                                                                                    tmp_path):
    """Every episode failed in its forward and one folder was deleted after (a recorder's cleanup): the closing hint
    was the table's "fix what is named above and rerun with --resume", refused without --out, and by the folder's
    absence with it. It says the folder must be back and gives the run's resume, which pasted then completes it."""
    robots, run = tmp_path / "robots", tmp_path / "run"
    for name in ("arm_a", "arm_b"):
        shutil.copytree(data / "eps" / name, robots / name)
    # arm_a fails at its step 0, then its folder is deleted as arm_b's step 0 runs (and fails): no timing involved
    # (it was deleted while --follow waited out an idle timeout of 3 s, which a loaded machine could outrun)
    faults = [{"request": "arm_a/000000", "site": "block", "layer": 0},
              {"request": "arm_b/000000", "site": "block", "layer": 0, "remove": str(robots / "arm_a")}]
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(robots), "--out", str(run), "--pipeline", PIPELINE,
                  "--no-warmup", "--format", "plain", faults=faults)
    stderr = proc.stderr
    assert proc.returncode == 1, stderr
    assert "Error: every episode failed (arm_a, arm_b)\nhint: " in stderr, stderr
    hint = last_hint(stderr)
    assert hint == ("fix what is named above; a resume needs the folder of arm_a back at its path (gone since it "
                    f"failed; moved: a symlink there to where it is now will do), then continue with: {on_path(env)}"
                    f"ardiff rollout --resume --out {run} --pipeline {PIPELINE}"), hint
    shutil.copytree(data / "eps" / "arm_a", robots / "arm_a")  # back, and the pipeline fixed: no faults
    proc = paste_hint(env, hint)
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference, ("arm_a", "arm_b"))


@pytest.mark.parametrize("fail_fast", [False, True], ids=["goes_on", "fail_fast"])
def test_a_failed_episodes_hint_gives_the_runs_resume_which_pasted_completes_the_run(env, data, reference, tmp_path,
                                                                                     fail_fast):
    """An episode failed in its forward hinted "fix the pipeline, then continue with --resume", which without --out
    (and --pipeline) is refused, where the run's closing hint gave its resume to paste. Both give it now: the run's
    folder as one shell word (here it holds a space), its --pipeline; pasted into bash, it completes the run."""
    run = tmp_path / "my run"
    proc = ardiff(env, *rollout_args(data, run, *(["--fail-fast"] if fail_fast else [])),
                  faults=[{"request": "arm_b/000001", "site": "block", "layer": 0}])
    assert proc.returncode == (1 if fail_fast else 4), proc.stderr
    step = proc.stderr.split("Error: episode 'arm_b' failed at step 1 in the model's forward: ", 1)[1]
    step = step.split("\nhint: ", 1)[1].split("\n", 1)[0]
    again = f"{on_path(env)}ardiff rollout --resume --out '{run}' --pipeline {PIPELINE}"
    assert step.endswith(f"fix the pipeline, then continue with: {again}"), step
    assert last_hint(proc.stderr).endswith(f"continue with: {again}"), proc.stderr
    proc = paste_hint(env, step)  # the pipeline fixed: no faults
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def run_failing_in_lab(env: dict, data: Path, lab: Path, elsewhere: Path, run: Path) -> subprocess.CompletedProcess:
    """A rollout into ``run`` started in ``lab`` with ``--pipeline mypipe:Mine``, a module there (found on the working
    folder alone), whose step 1 of arm_b fails (exit 4); ``elsewhere`` made, a folder to paste its hints in."""
    lab.mkdir()
    elsewhere.mkdir()
    (lab / "mypipe.py").write_text("from faulty_pipelines import FaultyDreamZero\n\n\n"
                                   "class Mine(FaultyDreamZero):\n    pass\n")
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 0}]
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(data / "eps"),
                           "--out", str(run), "--pipeline", "mypipe:Mine", "--no-warmup", "--format", "plain"],
                          cwd=lab, env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 4, proc.stderr
    return proc

def pasted_without_pythonpath(env: dict, command: str, cwd: Path) -> subprocess.CompletedProcess:
    """``command`` (a hint) pasted into bash in ``cwd`` with PYTHONPATH unset, as in another shell."""
    from test_cli_rollout import pasted

    return pasted({key: value for key, value in env.items() if key != "PYTHONPATH"}, command, cwd)


def assert_pasted_resume_finishes(env: dict, command: str, cwd: Path, run: Path, reference: Path) -> None:
    """The resume ``command`` (a hint), pasted so with --no-warmup, finishes ``run`` as the uninterrupted one."""
    resumed = pasted_without_pythonpath(env, f"{command} --no-warmup", cwd)
    assert resumed.returncode == 0, resumed.stderr
    assert_matches(run, reference)



def test_a_failed_runs_resume_hint_carries_the_folders_of_its_pipeline_module_and_pastes_from_another_folder(
        env, data, reference, tmp_path):
    """`--pipeline mypipe:Mine`, a module in the folder the rollout was started in: the restart its lock records
    carried the folders Python imported it from (PYTHONPATH=...), but the resume a failed run's hints gave, built
    from run.json, did not: pasted in another folder, in a shell without PYTHONPATH, `No module named 'mypipe'`.
    run.json records those folders too, and every resume hint built from it carries them."""
    lab, elsewhere, run = tmp_path / "lab", tmp_path / "elsewhere", tmp_path / "run"
    proc = run_failing_in_lab(env, data, lab, elsewhere, run)
    again = f"{on_path(env, lab)}ardiff rollout --resume --out {run} --pipeline mypipe:Mine"
    step = proc.stderr.split("Error: episode 'arm_b' failed at step 1 in the model's forward: ", 1)[1]
    assert step.split("\nhint: ", 1)[1].split("\n", 1)[0].endswith(f"then continue with: {again}"), proc.stderr
    assert last_hint(proc.stderr).endswith(f"continue with: {again}"), proc.stderr
    assert_pasted_resume_finishes(env, again, elsewhere, run, reference)


def holding_import(env, tmp_path, module: str, folder, *, every: bool = False) -> tuple[dict[str, str], Path]:
    """(the env, the FIFO) of an `ardiff` whose import of ``module`` (its first, or with ``every`` each lookup of it)
    waits for the FIFO to be written: ``folder`` first on its PYTHONPATH, after a sitecustomize that holds it."""
    shim, hold = tmp_path / "shim", tmp_path / "hold"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        HOLD_IMPORT.replace('os.environ.pop("HOLD")', 'os.environ["HOLD"]') if every else HOLD_IMPORT)
    os.mkfifo(hold)
    return {**env, "HOLD": str(hold), "HOLD_MODULE": module,
            "PYTHONPATH": os.pathsep.join([str(shim), str(folder), env["PYTHONPATH"]])}, hold


@pytest.mark.parametrize("moved", [False, True], ids=["module-in-place", "module-moved"])
def test_a_resume_stopped_before_it_takes_the_signals_carries_the_folders_of_its_pipeline_module(
        env, data, reference, tmp_path, moved):
    """A resume of a run whose --pipeline module was found in the folder the run started in, stopped after it read
    run.json but before the rollout took the signals: its hint was the resume as typed, without the folders run.json
    records (PYTHONPATH=...), where every later stop's carries them; pasted in another folder with PYTHONPATH unset,
    `No module named 'mypipe'`. Stopped as it looks up that module, it carries run.json's folders (not looked up
    yet), and pasted finishes the run.
    Moved: the module moved (the lab's folder renamed), the resume given the new folder on PYTHONPATH and stopped
    once it found the module (as it imports what the module imports, as the config loads): its hint gave run.json's
    folders, the old one, gone (pasted, refused: `... /x/lab is gone`). It gives the folders found here, and pasted
    so, it finishes the run."""
    from test_cli_rollout import stopped_while_held

    lab, elsewhere, run = tmp_path / "lab", tmp_path / "elsewhere", tmp_path / "run"
    run_failing_in_lab(env, data, lab, elsewhere, run)
    if moved:
        lab.rename(tmp_path / "lab2")
        held, hold = holding_import(env, tmp_path, "faulty_pipelines", tmp_path / "lab2")  # mypipe's import
        folders, paste_in = on_path(held, elsewhere), tmp_path
    else:
        held, hold = holding_import(env, tmp_path, "mypipe", lab)
        folders, paste_in = on_path(env, lab), elsewhere
    code, error = stopped_while_held(held, ["rollout", "--resume", "--out", str(run), "--pipeline", "mypipe:Mine"],
                                     hold, elsewhere)
    again = f"{folders}ardiff rollout --resume --out {run} --pipeline mypipe:Mine"
    assert code == 143 and error["hint"] == f"continue with: {again}", error
    assert_pasted_resume_finishes(env, again, paste_in, run, reference)


def test_a_resume_stopped_as_the_lookup_of_its_pipeline_module_hangs_ends_with_run_jsons_folders(
        env, data, reference, tmp_path):
    """A resume stopped (SIGTERM) as the lookup of its --pipeline module hangs (a folder on PYTHONPATH on a hung
    mount; here every lookup of 'mypipe' waits on a FIFO): its stop looked the module up again for its hint, and hung
    there, a second signal ignored (only the first counts), until SIGKILL. It ends at once, its hint the resume with
    the folders run.json records (no lookup was done), which pasted finishes the run."""
    lab, elsewhere, run = tmp_path / "lab", tmp_path / "elsewhere", tmp_path / "run"
    run_failing_in_lab(env, data, lab, elsewhere, run)
    held, hold = holding_import(env, tmp_path, "mypipe", lab, every=True)
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run),
                             "--pipeline", "mypipe:Mine", "--format", "json"], cwd=elsewhere, env=held, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writer = None
    try:
        writer = open_to_write(proc, hold)
        wait_reading(proc, hold)
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("the stopped resume hung (it looked its module up again, on the hung folder)")
    finally:
        proc.kill()
        if writer is not None:
            os.close(writer)
    error = json.loads(stdout.splitlines()[-1])
    again = f"{on_path(env, lab)}ardiff rollout --resume --out {run} --pipeline mypipe:Mine"
    assert proc.returncode == 143 and error["hint"] == f"continue with: {again}", (error, stderr)
    assert_pasted_resume_finishes(env, again, elsewhere, run, reference)


def test_a_resume_from_where_its_pipeline_module_moved_gives_the_folders_it_imported_it_from_to_paste(
        env, data, reference, tmp_path):
    """The --pipeline module of a failed run moved to another folder (the lab's folder renamed), and the run was
    resumed with PYTHONPATH naming the new one: that resume's hints kept run.json's folders, the old one, and pasted
    in another folder with PYTHONPATH unset, `No module named 'mypipe'`. A resume records the folders it imported
    the module from, and its hint, pasted so, finishes the run."""

    lab, elsewhere, run, moved = tmp_path / "lab", tmp_path / "elsewhere", tmp_path / "run", tmp_path / "lab2"
    run_failing_in_lab(env, data, lab, elsewhere, run)
    lab.rename(moved)
    faults = [{"request": "arm_b/000002", "site": "block", "layer": 0}]  # what is left: arm_b's steps 1 and 2
    moved_env = {**env, "PYTHONPATH": os.pathsep.join([str(moved), env["PYTHONPATH"]]),
                 "ARDIFF_TEST_FAULTS": json.dumps(faults)}
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run),
                           "--pipeline", "mypipe:Mine", "--no-warmup", "--format", "plain"], cwd=elsewhere,
                          env=moved_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 4, proc.stderr
    again = f"{on_path(moved_env, elsewhere)}ardiff rollout --resume --out {run} --pipeline mypipe:Mine"
    assert last_hint(proc.stderr).endswith(f"continue with: {again}"), proc.stderr
    assert_pasted_resume_finishes(env, again, tmp_path, run, reference)


def test_a_resume_from_where_its_pipeline_module_moved_gives_those_folders_in_its_moved_episodes_hint(
        env, data, reference, tmp_path):
    """The --pipeline module of a failed run moved (the lab's folder renamed) and so did its folder of episodes; the
    resume, given the module's new folder on PYTHONPATH, is refused for the episodes: its hint gave the resume with
    run.json's folders, the old one, gone, where the resume records those it imported the module from: pasted with
    the episodes' folder in place of NEW, it was refused again (`/x/lab is gone`). It carries the module's folders
    now, and pasted so in another folder with PYTHONPATH unset, it finishes the run."""

    lab, elsewhere, run, eps = tmp_path / "lab", tmp_path / "elsewhere", tmp_path / "run", tmp_path / "eps"
    shutil.copytree(data / "eps", eps)
    lab.mkdir()
    elsewhere.mkdir()
    (lab / "mypipe.py").write_text("from faulty_pipelines import FaultyDreamZero\n\n\n"
                                   "class Mine(FaultyDreamZero):\n    pass\n")
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 0}]
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"), str(eps),
                           "--out", str(run), "--pipeline", "mypipe:Mine", "--no-warmup", "--format", "plain"],
                          cwd=lab, env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 4, proc.stderr
    moved = tmp_path / "lab2"
    lab.rename(moved)
    eps.rename(tmp_path / "eps2")
    moved_env = {**env, "PYTHONPATH": os.pathsep.join([str(moved), env["PYTHONPATH"]])}
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run),
                           "--pipeline", "mypipe:Mine", "--format", "plain"], cwd=elsewhere, env=moved_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    given = (f"{on_path(moved_env, elsewhere)}ardiff rollout --resume --out {run} --pipeline mypipe:Mine "
             f"{data / 'fast.yaml'} NEW")
    assert f"with the run's other EPISODE arguments: {given}; or run" in last_hint(proc.stderr), proc.stderr
    assert_pasted_resume_finishes(env, given.replace("NEW", str(tmp_path / "eps2")), tmp_path, run, reference)


def test_a_resume_whose_recorded_pipeline_folder_is_gone_names_it_and_how_to_give_another(env, data, reference,
                                                                                          tmp_path):
    """The folder a failed run's --pipeline module was imported from is gone (renamed): its resume hint, pasted,
    said only `No module named 'mypipe'` and to check the install. It names the folder run.json recorded, gone, and
    gives the resume to run with the folder that holds the module now on PYTHONPATH; one typed without the folders,
    which are there, is given the run's resume, which carries them."""
    from test_cli_rollout import pasted

    lab, elsewhere, run = tmp_path / "lab", tmp_path / "elsewhere", tmp_path / "run"
    proc = run_failing_in_lab(env, data, lab, elsewhere, run)
    again = last_hint(proc.stderr).split("continue with: ", 1)[1]
    typed = pasted(env, again.split(" ", 1)[1], elsewhere)  # without PYTHONPATH=... (env's: the repository's)
    assert typed.returncode == 2, typed.stderr
    assert last_hint(typed.stderr) == f"continue with the run's resume, which gives them: {again}", typed.stderr
    lab.rename(tmp_path / "lab2")
    resumed = pasted_without_pythonpath(env, f"{again} --no-warmup", elsewhere)
    assert resumed.returncode == 2, resumed.stderr
    assert (f"Error: --pipeline mypipe:Mine: cannot import 'mypipe': the run imported it from one of the folders "
            f"that {run / 'run.json'}'s field 'pythonpath' records, and {lab} is gone\n") in resumed.stderr, \
        resumed.stderr
    # the resume with the folder that holds the module now first, and the --no-warmup it was given (refused before
    # its warmup, the resume pasted skips it too)
    given = again.replace(str(lab), "NEW", 1) + " --no-warmup"
    hint = last_hint(resumed.stderr)
    assert hint.endswith(f"give the folder that holds 'mypipe' now (NEW) on PYTHONPATH: {given}"), resumed.stderr
    assert_pasted_resume_finishes(env, given.replace("NEW", str(tmp_path / "lab2"), 1), elsewhere, run, reference)


@pytest.mark.parametrize("shell", ["bash", "sh"])
def test_a_resume_hint_of_a_module_in_a_folder_named_with_a_colon_takes_options_added_when_pasted(
        env, data, reference, tmp_path, shell):
    """A run whose --pipeline module was in a folder named with ':' (which PYTHONPATH cannot carry) hinted a resume
    in a subshell, `(cd /x/lab:1 && PYTHONPATH=. ardiff rollout --resume ...)`: an option added after it, pasted
    (`--no-warmup`), was a syntax error. The resume is one command that enters the folder (`env -C`), so an option
    added takes effect; pasted into bash and sh in another folder with PYTHONPATH unset, it finishes the run."""
    lab, elsewhere, run = tmp_path / "lab:1", tmp_path / "elsewhere", tmp_path / "run"
    proc = run_failing_in_lab(env, data, lab, elsewhere, run)
    again = last_hint(proc.stderr).split("continue with: ", 1)[1]
    assert again.startswith(f"env -C {shlex.quote(str(lab))} PYTHONPATH=.{os.pathsep}"), again
    unset = {key: value for key, value in env.items() if key != "PYTHONPATH"}
    unset["PATH"] = ardiff_program()  # an installed `ardiff`, which env runs (a shell function is not a program)
    resumed = subprocess.run([shell, "-c", f"{again} --no-warmup"], cwd=elsewhere, env=unset, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert " warmup " not in resumed.stderr, resumed.stderr  # --no-warmup, added after the hint, was taken
    assert_matches(run, reference)


def test_a_stopped_runs_hint_gives_its_resume_which_pasted_completes_the_run(env, data, reference, tmp_path):
    """A signal's stop hinted "run the same command with --resume to continue": the same command (CONFIG and EPISODE
    with --resume) is refused. It gives the run's resume, which pasted completes the run; a resume stopped so gives
    its own, with the options it was given (a --session-capacity)."""
    run = tmp_path / "run"
    faults = [{"request": "arm_c/000001", "site": "block", "layer": 0, "call": 2, "action": "sleep"}]
    proc, err = stop_inside_a_fault(env, rollout_args(data, run), faults, tmp_path, signum=signal.SIGTERM)
    assert proc.returncode == 143, err
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE}"
    assert err.rstrip("\n").endswith(f"Error: interrupted by SIGTERM\nhint: continue with: {again}"), err
    resumed = ["rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--session-capacity", "1",
               "--no-warmup", "--format", "plain"]
    faults = [{"request": "arm_d/000001", "site": "block", "layer": 0, "call": 2, "action": "sleep"}]
    (tmp_path / "again").mkdir()
    proc, err = stop_inside_a_fault(env, resumed, faults, tmp_path / "again", signum=signal.SIGINT)
    assert proc.returncode == 130, err
    assert err.rstrip("\n").endswith(f"hint: continue with: {again} --session-capacity 1"), err
    proc = paste_hint(env, last_hint(err))
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_a_resume_out_of_memory_as_its_kv_pools_allocate_ends_its_hint_with_the_resume_to_paste(env, data,
                                                                                                reference, tmp_path):
    """A resume that ran out of memory as it allocated its KV pools hinted at a lower --session-capacity with no
    command to paste, and under `ulimit -v` the report added its word on the limit after the hint, past where a
    command to paste would end. The hint ends with the resume, one session fewer than the pools that did not fit,
    after the limit's word; pasted into bash on the same device (pools over 12 pages fail), it completes the run."""
    import resource

    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(four_sessions_config(tmp_path)), str(data / "eps"), "--out", str(run),
                  "--pipeline", PIPELINE, "--no-warmup", "--memory-budget", "600KB", "--format", "plain",
                  "--fail-fast", faults=LARGE_POOL_OOM)
    assert proc.returncode == 3, proc.stderr
    assert json.loads((run / "summary.json").read_text())["capacity_plan"]["session_capacity"] == 2
    pools = [{"site": "pools", "pool_over": 12}]  # two sessions' pool (19 pages) no longer fits; one's (11) does
    limit = 16 << 30
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run), "--pipeline",
                           PIPELINE, "--no-warmup", "--format", "plain"], cwd=REPO, capture_output=True, text=True,
                          env={**env, "ARDIFF_TEST_FAULTS": json.dumps(pools)}, timeout=600,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert proc.returncode == 3, proc.stderr
    assert ("Error: out of host memory while planning and allocating the KV cache pools: MemoryError\n" in
            proc.stderr), proc.stderr
    hint = last_hint(proc.stderr)
    assert hint.startswith("continue with --resume and a lower --session-capacity or a smaller --memory-budget "), hint
    assert hint.endswith(f"; or raise this process's address-space limit (now ulimit -v {limit >> 10}); to paste: "
                         f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} "
                         "--no-warmup --session-capacity 1"), hint  # before its warmup: the one it was given skipped
    proc = paste_hint(env, hint, faults=pools)
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_the_options_given_to_a_resume_are_in_the_resume_its_hints_give_to_paste(env, data, reference, tmp_path):
    """A resume's options apply to it alone (run.json keeps the run's own), yet its hints gave the run's resume
    without them: a resume given the lower --session-capacity a hint asked for, failing then for another reason,
    hinted at a resume that went back to the run's two sessions and ran out of memory again. Its hints carry them
    (--memory-budget too), and a lower --session-capacity asked for replaces the one given instead of repeating it."""
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(four_sessions_config(tmp_path)), str(data / "eps"), "--out", str(run),
                  "--pipeline", PIPELINE, "--no-warmup", "--memory-budget", "600KB", "--format", "plain",
                  faults=LARGE_POOL_OOM)
    assert proc.returncode == 4, proc.stderr
    resume = ["rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup", "--format", "plain"]
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE}"
    # given the run's own two sessions again, and another budget: memory runs out again, one session fewer to paste
    proc = ardiff(env, *resume, "--session-capacity", "2", "--memory-budget", "1MiB", faults=LARGE_POOL_OOM)
    assert proc.returncode == 4, proc.stderr
    assert last_hint(proc.stderr) == (f"fix what is named above, then continue with: {again} --memory-budget 1MiB "
                                      "--session-capacity 1"), proc.stderr
    # given the one session asked for, the step fails for another reason: the resume to paste keeps the option
    proc = ardiff(env, *resume, "--session-capacity", "1", faults=[{"request": "arm_b/000001", "site": "block",
                                                                    "layer": 0}])
    assert proc.returncode == 4, proc.stderr
    hint = last_hint(proc.stderr)
    assert hint == f"fix what is named above, then continue with: {again} --session-capacity 1", hint
    proc = paste_hint(env, hint, faults=LARGE_POOL_OOM)  # the same device: two sessions' pool runs out again
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_a_lower_session_capacity_replaces_the_one_given_before_a_quoted_swap_space(env, data, reference, tmp_path):
    """The --session-capacity given to a resume was replaced in the resume to paste only where no quoted word came
    after it: given with --swap-space '1 MiB' (a size with a space, quoted in the command), the command repeated it,
    `--session-capacity 2 --swap-space '1 MiB' --session-capacity 1`, as if two sessions still applied. It is given
    once, the lower; pasted into bash, it completes the run."""
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(four_sessions_config(tmp_path)), str(data / "eps"), "--out", str(run),
                  "--pipeline", PIPELINE, "--no-warmup", "--memory-budget", "600KB", "--format", "plain",
                  faults=LARGE_POOL_OOM)
    assert proc.returncode == 4, proc.stderr
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup", "--format",
                  "plain", "--session-capacity", "2", "--swap-space", "1 MiB", faults=LARGE_POOL_OOM)
    assert proc.returncode == 4, proc.stderr
    hint = last_hint(proc.stderr)
    assert hint == (f"fix what is named above, then continue with: {on_path(env)}ardiff rollout --resume --out {run} "
                    f"--pipeline {PIPELINE} --swap-space '1 MiB' --session-capacity 1"), hint
    proc = paste_hint(env, hint, faults=LARGE_POOL_OOM)
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_a_resume_commands_lower_session_capacity_takes_the_given_ones_place(tmp_path):
    """The lower --session-capacity of the resume a hint gives to paste was edited into the resume's text (a regex
    after its last quote), so the given one had to come after every quoted word, and the --follow after it moved in
    front of it. The command is built from its words: the lower one replaces the given one, the rest as they were."""
    out = tmp_path / "it's a run --session-capacity 3"
    resume = ResumeCommand(out, PIPELINE, ("--swap-space", "1 MiB", "--follow"), session_capacity=3)
    words = shlex.split(str(resume))
    assert words == ["ardiff", "rollout", "--resume", "--out", str(out), "--pipeline", PIPELINE, "--swap-space",
                     "1 MiB", "--follow", "--session-capacity", "3"], words
    lighter = shlex.split(resume.command(session_capacity=2))
    assert lighter == [*words[:-1], "2"] and lighter.count("--session-capacity") == 1, lighter
    assert str(replace(resume, session_capacity=None)) == shlex.join(words[:-2])  # none given: none to paste


def test_a_resume_command_of_a_module_in_a_folder_named_with_a_colon_is_one_command_run_in_that_folder(tmp_path):
    """A run whose --pipeline module was imported from a folder named with ':' (which PYTHONPATH cannot carry): its
    resume is run in that folder (env -C), --out absolute, as the .lock's restart is; the words a hint adds after the
    resume (a moved folder's CONFIG NEW) are the rollout's, as are those a user adds pasting it."""
    lab, out = tmp_path / "lab:1", Path("runs") / "eval1"
    resume = ResumeCommand(out, "mypipe:Mine", ("--follow",), pythonpath=(str(lab), str(lab / "src"), "/libs"))
    inner = f"ardiff rollout --resume --out {out.absolute()} --pipeline mypipe:Mine --follow"
    assert str(resume) == f"env -C {shlex.quote(str(lab))} PYTHONPATH=.:src:/libs {inner}", str(resume)
    assert resume.command(more=["cfg.yaml", "NEW"]).endswith(f"{inner} cfg.yaml NEW"), resume.command()
    assert str(ResumeCommand(out, "mypipe:Mine")) == f"ardiff rollout --resume --out {out} --pipeline mypipe:Mine"


def test_a_step_out_of_memory_hints_only_at_changes_that_shrink_the_kv_pool(env, data, tmp_path):
    """The hint said "continue with --resume and a lower --session-capacity or a smaller --memory-budget" whatever
    the plan. With one session planned neither can help: --session-capacity takes no fewer, and a budget too small for
    one session is refused (one that holds it plans the same pool). With --session-capacity limiting the plan below
    what the budget holds, a smaller budget plans the same pool. Each hint now offers only what shrinks the pool."""
    sessions_config = four_sessions_config(tmp_path)

    def failed(config: Path, out: Path, *extra: str) -> str:
        return step_out_of_memory(env, data, config, out, *extra)["hint"]

    def pool(out: Path) -> tuple[int, int]:  # (sessions, pages) the last run of OUT planned
        plan = json.loads((out / "summary.json").read_text())["capacity_plan"]
        return plan["session_capacity"], plan["num_managed_pages"]

    def resume(out: Path, *extra: str) -> subprocess.CompletedProcess:
        return ardiff(env, "rollout", "--resume", "--out", str(out), "--pipeline", PIPELINE, "--no-warmup",
                      "--format", "json", *extra)

    # one session (the config's session_capacity: 1): neither change, and what following the old hint did
    one = tmp_path / "one"
    assert failed(data / "fast.yaml", one, "--memory-budget", "64MiB") == (
        "the KV pool holds one session, the least a plan keeps, and it does not fit with the model's activations (the "
        "other sessions were untouched): free memory on the device (another process using it?) and continue with "
        "--resume; --resume keeps the run's dtype and config, so a smaller dtype or model is a new run (another "
        f"--out); to paste: {on_path(env)}ardiff rollout --resume --out {one} --pipeline {PIPELINE}")
    planned = pool(one)
    assert planned[0] == 1, planned
    proc = resume(one, "--session-capacity", "0")
    assert proc.returncode == 2 and "'--session-capacity'" in proc.stdout, proc.stdout
    proc = resume(one, "--memory-budget", "250KB")  # one session takes 297984 bytes
    assert proc.returncode == 3 and json.loads(proc.stdout.splitlines()[-1])["kind"] == "capacity_error", proc.stdout
    proc = resume(one, "--memory-budget", "300KB")
    assert proc.returncode == 0, proc.stderr
    assert pool(one) == planned  # the same pool: nothing left the activations more memory
    # --session-capacity 2 limits the plan (the budget holds hundreds): a smaller budget plans the same pool
    capped = tmp_path / "capped"
    hint = failed(sessions_config, capped, "--memory-budget", "64MiB", "--session-capacity", "2")
    assert hint.startswith("continue with --resume and a --session-capacity below 2 (it, not the budget, limits the "
                           "KV pool): a smaller KV pool leaves more memory to the model's activations"), hint
    assert "budget" not in hint.replace("not the budget", ""), hint
    planned = pool(capped)
    assert planned[0] == 2, planned
    assert resume(capped, "--memory-budget", "1MiB").returncode == 0  # 4 sessions' worth, still above 2
    assert pool(capped) == planned
    # the budget limits the plan (2 of the spec's 4 sessions): both changes, and a smaller budget shrinks the pool
    limited = tmp_path / "limited"
    assert failed(sessions_config, limited, "--memory-budget", "600KB").startswith(
        "continue with --resume and a lower --session-capacity or a smaller --memory-budget: ")
    planned = pool(limited)
    assert planned[0] == 2, planned
    assert resume(limited, "--memory-budget", "450KB").returncode == 0
    assert pool(limited)[0] == 1 and pool(limited)[1] < planned[1], (pool(limited), planned)


def test_memory_running_out_in_a_rollouts_warmup_hints_at_the_resume_not_at_another_dtype(env, data, tmp_path):
    """Warmup runs once run.json is written: the same command is then refused (OUT holds a run) and --resume keeps
    the run's dtype and config, yet the hint said "... or use --dtype bfloat16 or a smaller model". It says what a
    resume can change, as a step's does: the session capacity, or the budget by what set it (here the budget limits
    the plan: 2 of the spec's 4 sessions); with one session planned, neither."""
    faults = [{"request": "warmup-0", "site": "block", "layer": 0, "action": "memory_error"}]
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(tmp_path / "one"),
                  "--pipeline", PIPELINE, "--format", "plain", "--memory-budget", "64MiB", faults=faults)
    assert proc.returncode == 3, proc.stderr
    assert ("Error: out of host memory while running the warmup requests: MemoryError\nhint: the KV pool holds one "
            "session, the least a plan keeps, and it does not fit with the model's activations: free memory on the "
            "device (another process using it?) and continue with --resume; --resume keeps the run's dtype and "
            "config, so a smaller dtype or model is a new run (another --out); to paste: "
            f"{on_path(env)}ardiff rollout --resume --out {tmp_path / 'one'} --pipeline {PIPELINE}\n") in proc.stderr, (
        proc.stderr)
    sessions_config = four_sessions_config(tmp_path)
    run = tmp_path / "run"
    args = ["rollout", str(sessions_config), str(data / "eps"), "--out", str(run), "--pipeline", PIPELINE,
            "--format", "plain"]
    proc = ardiff(env, *args, "--memory-budget", "600KB", faults=faults)
    assert proc.returncode == 3, proc.stderr
    assert ("Error: out of host memory while running the warmup requests: MemoryError\nhint: continue with --resume "
            "and a lower --session-capacity or a smaller --memory-budget: a smaller KV pool leaves more memory to the "
            "model's activations; --resume keeps the run's dtype and config, so a smaller dtype or model is a new run "
            f"(another --out); to paste: {on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} "
            "--session-capacity 1\n") in proc.stderr, proc.stderr
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--format", "plain",
                  faults=faults)
    assert proc.returncode == 3, proc.stderr
    assert (f"hint: continue with --resume and a lower --session-capacity or a smaller --memory-budget (the "
            f"memory_budget recorded in {run / 'run.json'} set it; one given replaces it for that resume only)") in (
        proc.stderr), proc.stderr
    assert "--dtype" not in proc.stderr, proc.stderr
    # before run.json is written (the model's load), the same command may change anything: another dtype or model
    faults = [{"site": "load", "action": "memory_error"}]
    proc = ardiff(env, *args[:4], str(tmp_path / "loading"), *args[5:], faults=faults)
    assert proc.returncode == 3, proc.stderr
    assert ("Error: out of host memory while loading the model's weights (from_config()): MemoryError\nhint: the "
            "model, in float32, needs more memory than is free now (its KV pools come after its weights): free some "
            "(another process using it?) and run again, or use --dtype bfloat16 or a smaller model\n") in (
        proc.stderr), proc.stderr


def test_memory_running_out_in_the_warmup_command_hints_only_at_changes_that_can_help(env, data, tmp_path):
    """`ardiff warmup` out of memory hinted "lower --memory-budget, --session-capacity or --gpu-memory-fraction, or
    use --dtype bfloat16 or a smaller model" whatever the plan: with one session planned no lower capacity or budget
    shrinks the KV pool, and with --session-capacity limiting the plan a smaller budget plans the same pool. It words
    the plan's facts as a step's hint does; with no run to resume, a smaller dtype (from float32) or model stays."""
    faults = [{"request": "warmup-0", "site": "block", "layer": 0, "action": "memory_error"}]
    sessions_config = four_sessions_config(tmp_path)

    def hint(config: Path, *extra: str) -> str:
        proc = ardiff(env, "warmup", str(config), "--pipeline", PIPELINE, "--format", "json", *extra, faults=faults)
        error = json_error(proc, 3)
        assert (error["kind"], error["message"]) == (
            "out_of_memory", "out of host memory while running the warmup requests: MemoryError"), error
        assert "--resume" not in error["hint"], error
        return error["hint"]

    smaller = "or use --dtype bfloat16 or a smaller model"  # the configs' dtype is float32
    assert hint(data / "fast.yaml", "--memory-budget", "64MiB") == (
        "the KV pool holds one session, the least a plan keeps, and it does not fit with the model's activations: free "
        f"memory on the device (another process using it?) and run again; {smaller}")
    assert hint(data / "fast.yaml", "--memory-budget", "64MiB", "--dtype", "bfloat16").endswith(
        "and run again; or use a smaller model")
    capped = hint(sessions_config, "--memory-budget", "64MiB", "--session-capacity", "2")
    assert capped == ("run again with a --session-capacity below 2 (it, not the budget, limits the KV pool): a "
                      f"smaller KV pool leaves more memory to the model's activations; {smaller}"), capped
    assert hint(sessions_config, "--memory-budget", "600KB") == (
        "run again with a lower --session-capacity or a smaller --memory-budget: a smaller KV pool leaves more memory "
        f"to the model's activations; {smaller}")


def test_memory_running_out_as_the_warmup_command_loads_the_weights_hints_at_the_model_not_at_the_kv_pool(env, data,
                                                                                                        tmp_path):
    """`ardiff warmup` out of memory as the model's weights loaded, before its KV pools are planned, kept the table's
    hint whatever the dtype: "lower --memory-budget, --session-capacity or --gpu-memory-fraction, or use --dtype
    bfloat16 or a smaller model": no KV pool is there to shrink yet, and with `--dtype bf16` (or the config's
    `runtime.dtype: bfloat16`) it offered the dtype the model was already loading in."""
    faults = [{"site": "load", "action": "memory_error"}]

    def hint(config: Path, *extra: str) -> str:
        proc = ardiff(env, "warmup", str(config), "--pipeline", PIPELINE, "--format", "json", *extra, faults=faults)
        error = json_error(proc, 3)
        assert (error["kind"], error["message"]) == ("out_of_memory", "out of host memory while loading the model's "
                                                     "weights (from_config()): MemoryError"), error
        return error["hint"]

    assert hint(data / "fast.yaml") == (
        "the model, in float32, needs more memory than is free now (its KV pools come after its weights): free some "
        "(another process using it?) and run again, or use --dtype bfloat16 or a smaller model")
    assert hint(data / "fast.yaml", "--dtype", "bf16") == (
        "the model, in bfloat16, needs more memory than is free now (its KV pools come after its weights): free some "
        "(another process using it?) and run again, or use a smaller model")
    half = tmp_path / "half.yaml"  # the config's dtype, in another spelling
    half.write_text(FAST_CONFIG.replace("device: cpu", "device: cpu, dtype: fp16"))
    assert hint(half) == (
        "the model, in float16, needs more memory than is free now (its KV pools come after its weights): free some "
        "(another process using it?) and run again, or use a smaller model")


def test_memory_running_out_as_a_resume_loads_the_weights_hints_at_no_kv_pool(env, data, tmp_path):
    """A resume holds run.json from its start, so memory running out as it loaded the model's weights got the
    warmup's hint: a lower --session-capacity or a smaller budget, "a smaller KV pool leaves more memory to the
    model's activations", though the pools are sized and allocated only once the weights are loaded."""
    run = tmp_path / "run"
    assert ardiff(env, *rollout_args(data, run, "--fail-fast"), faults=STEP_OOM).returncode == 3
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--format", "plain",
                  faults=[{"site": "load", "action": "memory_error"}])
    assert proc.returncode == 3, proc.stderr
    assert "Error: out of host memory while loading the model's weights (from_config()): MemoryError\n" in (
        proc.stderr), proc.stderr
    assert "KV pool" not in proc.stderr and "--session-capacity" not in proc.stderr, proc.stderr
    assert "--dtype" not in proc.stderr and "continue with --resume" in proc.stderr, proc.stderr


def test_a_resume_without_a_budget_whose_session_no_longer_fits_the_free_memory_hints_at_no_other_dtype(env, data,
                                                                                                      tmp_path):
    """A run started without a memory budget plans with the free memory; resumed when another process took most of it
    (one session no longer fits), its CapacityError kept the runner's hint, "use a smaller window, model or dtype",
    each of which --resume refuses. With a budget the hint said so already (a larger budget)."""
    run = tmp_path / "run"
    assert ardiff(env, *rollout_args(data, run, "--fail-fast"), faults=STEP_OOM).returncode == 3
    assert json.loads((run / "run.json").read_text())["memory_budget"] is None
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--format", "json",
                  faults=[{"site": "free_memory", "bytes": 1 << 10}])
    error = json_error(proc, 3)
    assert error["kind"] == "capacity_error" and error["message"].startswith("one session needs "), error
    assert "use a smaller" not in error["hint"] and "window" not in error["hint"], error["hint"]
    assert "continue with --resume" in error["hint"], error["hint"]  # a dtype only for a new run:
    assert "a new run with a smaller dtype or model (another --out)" in error["hint"], error["hint"]


def test_an_address_space_limit_too_small_for_torch_is_out_of_memory_naming_the_limit(env, data, tmp_path):
    """Under `ulimit -v` the loader cannot map torch's (or numpy's) shared libraries: importing torch raised
    `ImportError: libtorch_cpu.so: failed to map segment from shared object`, shown as `unexpected ImportError` with a
    traceback and "this is a bug in ardiff" (exit 1; numpy's page of advice inside the Error line). A MemoryError
    under the limit said only to lower --session-capacity, with no word of the limit."""
    import resource

    def limited(limit: int, *args: str, faults: list | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, capture_output=True, text=True,
                              env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults or [])}, timeout=600,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))

    small = 256 << 20  # Python, Typer and Rich start in it; torch's library alone is larger
    for args in (["warmup", str(data / "fast.yaml")], rollout_args(data, tmp_path / "run")):
        proc = limited(small, *args[:-2] if args[0] == "rollout" else args, "--format", "json")
        error = json_error(proc, 3)
        assert error["kind"] == "out_of_memory", error
        assert re.fullmatch(r"cannot load a library: \S+\.so\S*: failed to map segment from shared object",
                            error["message"]), error
        assert f"address-space limit (now ulimit -v {small >> 10}) leaves no room to load torch" in error["hint"]
        assert "Traceback" not in proc.stderr and "bug in ardiff" not in proc.stderr
    faults = [{"request": "warmup-0", "site": "block", "layer": 0, "action": "memory_error"}]
    proc = limited(16 << 30, "warmup", str(data / "fast.yaml"), "--pipeline", PIPELINE, "--format", "plain",
                   faults=faults)
    assert proc.returncode == 3, proc.stderr
    assert ("Error: out of host memory while running the warmup requests: MemoryError\nhint: the KV pool holds one "
            "session, the least a plan keeps, and it does not fit with the model's activations: free memory on the "
            "device (another process using it?) and run again; or use --dtype bfloat16 or a smaller model; or raise "
            f"this process's address-space limit (now ulimit -v {16 << 20})\n") in proc.stderr, proc.stderr


def test_memory_running_out_under_an_address_space_limit_names_what_ran_out_and_what_to_do(tmp_path):
    """A real allocation refused under RLIMIT_AS (ulimit -v), set in the child once torch is imported (so it fails
    in loading, not at start): the KV pools of 5000 sessions of 2 GiB. A bare `Error: MemoryError` named neither
    the memory nor the part of the load that ran out of it."""
    child = ("import resource, sys, torch\n"
             "from ardiff_cli.app import main\n"
             "size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
             "resource.setrlimit(resource.RLIMIT_AS, (size + (300 << 20), resource.RLIM_INFINITY))\n"
             "sys.argv = ['ardiff', *sys.argv[1:]]\n"
             "main()\n")
    proc = subprocess.run([sys.executable, "-c", child, "warmup", "--device", "cpu", "--format", "plain",
                           "--memory-budget", "2GiB", "--session-capacity", "5000"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "ARDIFF_CACHE_DIR": str(tmp_path)}, timeout=600)
    assert proc.returncode == 3, proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert error.startswith("Error: out of host memory while planning and allocating the KV cache pools: "), error
    assert re.search(r"^hint: run again with a lower --session-capacity or a smaller --memory-budget: a smaller KV "
                     r"pool leaves more memory to the model's activations; or use --dtype bfloat16 or a smaller "
                     r"model; or raise this process's address-space limit \(now ulimit -v \d+\)$", proc.stderr,
                     re.M), proc.stderr


def test_memory_running_out_as_torch_imports_or_the_weights_load_names_which_in_warmup_and_rollout(env, data,
                                                                                                     tmp_path):
    """The README's exit-3 row names `while importing torch` and `while loading the model's weights
    (from_config())`. A rollout imports torch first to check the config's default checkpoint, outside the block
    that names the import: its MemoryError there read `out of host memory: MemoryError`, naming nothing. (A torch
    package that raises MemoryError as it imports stands for the real one under a host that has run out.)"""
    no_memory = tmp_path / "no_memory"
    (no_memory / "torch").mkdir(parents=True)
    (no_memory / "torch" / "__init__.py").write_text("raise MemoryError()\n")
    rollout = ["rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(tmp_path / "run"), "--no-warmup"]
    for command in (["warmup", str(data / "fast.yaml")], rollout):  # DreamZero: --pipeline's module imports torch
        proc = ardiff(env, *command, "--format", "json", path=no_memory)
        error = json_error(proc, 3)
        assert (error["kind"], error["message"]) == ("out_of_memory", "out of host memory while importing torch: "
                                                     "MemoryError"), (command[0], error)
        assert error["hint"] == IMPORT_HINT, (command[0], error)  # no model or KV pool yet: free memory alone helps
        assert "Traceback" not in proc.stderr
    faults = [{"site": "load", "action": "memory_error"}]
    for command in (["warmup", str(data / "fast.yaml")], rollout):
        proc = ardiff(env, *command, "--pipeline", PIPELINE, "--format", "json", faults=faults)
        error = json_error(proc, 3)
        assert error["message"] == ("out of host memory while loading the model's weights (from_config()): "
                                    "MemoryError"), error
        assert error["kind"] == "out_of_memory" and error["exit_code"] == 3, error
    assert not (tmp_path / "run" / "results.jsonl").exists()


def test_memory_running_out_as_a_new_run_loads_the_weights_hints_at_the_model_not_at_the_kv_pool(env, data, tmp_path):
    """A new run (not --resume) out of memory as the model's weights loaded kept the table's hint, "lower
    --memory-budget, --session-capacity or --gpu-memory-fraction, or use --dtype bfloat16 or a smaller model": its KV
    pools are planned only after the weights, and with `--dtype bf16` it offered the dtype the model was loading in.
    It says what `ardiff warmup` says there, and the same command, run again, runs (nothing was written)."""
    run = tmp_path / "run"
    for extra, dtype, smaller in (((), "float32", "--dtype bfloat16 or a smaller model"),
                                  (("--dtype", "bf16"), "bfloat16", "a smaller model")):
        proc = ardiff(env, *rollout_args(data, run, *extra, "--format", "json"),
                      faults=[{"site": "load", "action": "memory_error"}])
        error = json_error(proc, 3)
        assert error["message"] == ("out of host memory while loading the model's weights (from_config()): "
                                    "MemoryError"), error
        assert error["hint"] == (f"the model, in {dtype}, needs more memory than is free now (its KV pools come "
                                 f"after its weights): free some (another process using it?) and run again, or use "
                                 f"{smaller}"), error
    assert ardiff(env, *rollout_args(data, run, "--dtype", "bf16")).returncode == 0  # "run again": it runs
    assert len(records(run)) == len(EPISODES) * 3


def test_memory_running_out_as_a_pipeline_class_module_imports_names_the_import(env, data, tmp_path):
    """`--pipeline MODULE:CLASS` whose module runs out of memory as it imports said `out of host memory: MemoryError`,
    naming nothing that ran, where the import of torch or of a registered pipeline says `while importing ...`. (A
    module that raises MemoryError at its top level stands for one whose import finds no memory.)"""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "hungry_lab.py").write_text("raise MemoryError()\n")
    run = tmp_path / "run"
    for command in (["warmup", str(data / "fast.yaml")], ["inspect-capacity", str(data / "fast.yaml")],
                    ["rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup"]):
        proc = ardiff(env, *command, "--pipeline", "hungry_lab:MyPipeline", "--format", "json", path=modules)
        error = json_error(proc, 3)
        assert (error["kind"], error["message"]) == ("out_of_memory", "out of host memory while importing pipeline "
                                                     "module 'hungry_lab': MemoryError"), (command[0], error)
        assert error["hint"] == IMPORT_HINT, (command[0], error)  # no model or KV pool yet: free memory alone helps
        assert "Traceback" not in proc.stderr
    assert not run.exists()


def test_memory_running_out_as_a_resume_imports_torch_hints_at_free_memory_alone(env, data, tmp_path):
    """A resume holds run.json from its start: memory running out as torch imported got the hint of its model's load,
    "... or start a new run with a smaller dtype or model", though no model had begun to load."""
    run, episode = tmp_path / "run", tmp_path / "arm_a"  # the built-in pipeline's: --pipeline's module imports torch
    shutil.copytree(data / "eps" / "arm_a", episode)
    (episode / "step_000001.safetensors").write_bytes(b"junk")
    args = ["rollout", str(data / "fast.yaml"), str(episode), "--out", str(run), "--no-warmup", "--format", "json"]
    assert ardiff(env, *args).returncode == 2
    no_memory = tmp_path / "no_memory"
    (no_memory / "torch").mkdir(parents=True)
    (no_memory / "torch" / "__init__.py").write_text("raise MemoryError()\n")
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--format", "json", path=no_memory)
    error = json_error(proc, 3)
    assert error["message"] == "out of host memory while importing torch: MemoryError", error
    # ended with the run's resume, to paste (a bare "--resume" is refused without --out)
    assert error["hint"] == (IMPORT_HINT.replace("run again", "continue with --resume")
                             + f"; to paste: ardiff rollout --resume --out {run}"), error
    shutil.copy(data / "eps" / "arm_a" / "step_000001.safetensors", episode)  # the step fixed, memory free again
    proc = paste_hint(env, error["hint"])
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in records(run) if r["status"] == "ok"] == [0, 1, 2]


def test_a_resume_that_finds_an_episodes_first_step_file_gone_hints_at_the_resume_that_pasted_finishes_it(
        env, data, reference, tmp_path):
    """A done step's file deleted before a resume (a disk cleanup) failed its episode with "put the episode's step
    files back as they were when they ran (--resume then goes on), or ...": a bare --resume, refused without --out
    and the run's --pipeline. The hint ends with the run's resume, which pasted once the file is back finishes it."""
    robots, run = tmp_path / "robots", tmp_path / "run"
    for name in EPISODES:
        shutil.copytree(data / "eps" / name, robots / name)
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(robots), "--out", str(run), "--pipeline", PIPELINE,
                  "--no-warmup", "--format", "plain", "--fail-fast",
                  faults=[{"request": "arm_b/000001", "site": "block", "layer": 0}])
    assert proc.returncode == 1, proc.stderr
    (robots / "arm_a" / "step_000000.safetensors").unlink()
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup", "--format",
                  "plain")
    assert proc.returncode == 4, proc.stderr
    line = proc.stderr.split("Error: episode 'arm_a' failed: ", 1)[1].split("\n", 2)
    assert "step 0 ran (results.jsonl) but its file is gone" in line[0], proc.stderr
    assert line[1] == ("hint: run the episode again from its first step in a new --out (a session's outputs depend on "
                       "every earlier step), or put the episode's step files back as they were when they ran, then "
                       f"continue with: {on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE}"), (
        proc.stderr)
    shutil.copy(data / "eps" / "arm_a" / "step_000000.safetensors", robots / "arm_a")
    proc = paste_hint(env, line[1])
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_memory_running_out_as_a_resume_loads_its_weights_ends_its_hint_with_the_resume_to_paste(env, data,
                                                                                                 reference, tmp_path):
    """A resume that ran out of memory as it loaded the model's weights (before its KV pools) said "free some ... and
    continue with --resume", which without --out (and the run's --pipeline) is refused. The hint ends with the run's
    resume, which pasted into bash once memory is free completes the run."""
    run = tmp_path / "run"
    proc = ardiff(env, *rollout_args(data, run, "--fail-fast"),
                  faults=[{"request": "arm_b/000001", "site": "block", "layer": 0}])
    assert proc.returncode == 1, proc.stderr
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup", "--format",
                  "json", faults=[{"site": "load", "action": "memory_error"}])
    error = json_error(proc, 3)
    assert error["message"] == "out of host memory while loading the model's weights (from_config()): MemoryError"
    # before its warmup: the resume to paste skips it, as this one was given to (run.json keeps no --no-warmup)
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --no-warmup"
    assert error["hint"].startswith("the run's model, in its dtype and config (--resume keeps them), needs more "
                                    "memory than is free now: "), error
    assert error["hint"].endswith(f"(another --out); to paste: {again}"), error
    proc = paste_hint(env, error["hint"])
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_an_episode_folder_deleted_while_the_run_reads_it_hints_at_the_resume_that_pasted_finishes_it(
        env, data, reference, tmp_path):
    """An episode folder deleted mid-run (its step files listed at the start) failed its episode with "put them
    back, then continue with --resume", refused without --out and the run's --pipeline. It gives the run's resume,
    which pasted into bash once the folder is back finishes the run."""
    robots, run = tmp_path / "robots", tmp_path / "run"
    for name in EPISODES:
        shutil.copytree(data / "eps" / name, robots / name)
    # arm_b's folder goes as arm_a's step 1 runs: arm_b's step 1, read next, is gone (no timing involved)
    faults = [{"request": "arm_a/000001", "site": "block", "layer": 0, "action": "sleep", "seconds": 0,
               "marker": str(tmp_path / "marker"), "remove": str(robots / "arm_b")}]
    proc = ardiff(env, "rollout", str(data / "fast.yaml"), str(robots), "--out", str(run), "--pipeline", PIPELINE,
                  "--no-warmup", "--format", "plain", faults=faults)
    assert proc.returncode == 4, proc.stderr
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE}"
    line = proc.stderr.split("Error: episode 'arm_b' failed: ", 1)[1].split("\n", 2)
    assert f"the episode folder {robots / 'arm_b'} is gone (deleted or renamed while the run read it)" in line[0]
    assert line[1] == ("hint: keep an episode's folder and its step files in place while a run reads them; put them "
                       f"back, then continue with: {again}"), proc.stderr
    shutil.copytree(data / "eps" / "arm_b", robots / "arm_b")
    proc = paste_hint(env, line[1])
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_a_failed_runs_json_error_object_says_which_failure_ended_it(env, data, tmp_path):
    """The kinds of the README's list that no test read: `episodes_failed` (some episodes failed, exit 4; or every
    one, the highest of their codes), `step_failed` (--fail-fast stopped at a step: its cause's code, 3 for memory) and
    `checkpoint_error` (a config's `checkpoint:` that holds no weights, exit 2)."""
    raises, no_memory = ({"request": "arm_b/000001", "site": "block", "layer": 0, "action": action}
                         for action in ("raise", "memory_error"))
    cases = [((), raises, 4, "episodes_failed"), (("--fail-fast",), raises, 1, "step_failed"),
             (("--fail-fast",), no_memory, 3, "step_failed")]
    for i, (extra, fault, code, kind) in enumerate(cases):
        args = [*rollout_args(data, tmp_path / str(i))[:-2], "--format", "json", *extra]
        proc = ardiff(env, *args, faults=[fault])
        assert proc.returncode == code, proc.stderr
        error = json.loads(proc.stdout.splitlines()[-1])
        assert (error["kind"], error["exit_code"]) == (kind, code), error
        assert "arm_b" in error["message"], error
        assert json.loads((tmp_path / str(i) / "summary.json").read_text())["exit_code"] == code
    # the README's example of a step's: `failed at step N in the model's forward: out of host memory: ...`
    assert error["message"] == ("episode 'arm_b' failed at step 1 in the model's forward: out of host memory: "
                                "MemoryError")
    checkpoint, config = tmp_path / "weights.safetensors", tmp_path / "checkpoint.yaml"
    checkpoint.write_bytes(b"not weights")
    config.write_text(f"{FAST_CONFIG}checkpoint: {checkpoint}\n")
    proc = ardiff(env, "warmup", str(config), "--format", "json")
    error = json.loads(proc.stdout.splitlines()[-1])
    assert (proc.returncode, error["kind"]) == (2, "checkpoint_error"), proc.stderr
    assert error["message"].startswith(f"cannot read checkpoint {checkpoint}: "), error


@pytest.mark.parametrize("target", ["run.json", "results.jsonl", "summary.json"])
def test_a_run_file_the_system_refuses_to_write_stops_the_run_with_exit_1_naming_it(env, data, reference, tmp_path,
                                                                                   target):
    """The README's exit-1 row: `results.jsonl`, `run.json` or `summary.json` that cannot be written, a real write
    refused (a file-size limit, `ulimit -f`, set to let through every file the run writes before the one named, as
    the reference run's sizes say): `output_error` in JSON, and the file named."""
    import resource

    sizes = {name: (reference / name).stat().st_size for name in ("run.json", "results.jsonl", "summary.json")}
    step = max(path.stat().st_size for path in (reference / "episodes").rglob("*.safetensors"))
    episodes, limit = str(data / "eps"), {"run.json": 64, "results.jsonl": max(sizes["run.json"], step)}.get(target)
    if target == "summary.json":  # one episode: its 3 lines are fewer bytes than the summary
        episodes = str(data / "eps" / "arm_a")
        limit = max(sizes["run.json"], step, sum(len(json.dumps(r)) + 1 for r in records(reference)[:3]))
    assert sizes[target] > limit
    run = tmp_path / "run"
    args = ["rollout", str(data / "fast.yaml"), episodes, "--out", str(run), "--pipeline", PIPELINE, "--no-warmup",
            "--format", "json"]
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    error = json_error(proc, 1)
    verb = "append to" if target == "results.jsonl" else "write"
    assert (error["kind"], error["exit_code"]) == ("output_error", 1), error
    assert error["message"].startswith(f"cannot {verb} {run / target}: "), error
    assert "Traceback" not in proc.stderr and "bug in ardiff" not in proc.stderr


def test_the_hint_of_a_results_line_the_system_refuses_pastes_into_bash_and_finishes_the_run(env, data, reference,
                                                                                             tmp_path):
    """The README: a hint that prints a command to paste writes the run's own folder, as one shell word, and the
    run's `--pipeline MODULE:CLASS` again. A results.jsonl line (or a step's outputs) the system refused hinted
    `continue with: ardiff rollout --resume --out OUT`, the word OUT itself and no --pipeline: pasted, the resume was
    refused. Here a file-size limit (`ulimit -f`) lets run.json and the outputs through, not results.jsonl."""
    import resource
    import shlex

    from test_cli_rollout import pasted

    step = max(path.stat().st_size for path in (reference / "episodes").rglob("*.safetensors"))
    limit = max((reference / "run.json").stat().st_size, step)
    assert (reference / "results.jsonl").stat().st_size > limit
    run = tmp_path / "a run"  # a folder a shell must be given quoted
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *rollout_args(data, run)], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=600,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert proc.returncode == 1, proc.stderr
    assert f"Error: cannot append to {run / 'results.jsonl'}: File too large" in proc.stderr, proc.stderr
    (hint,) = [line for line in proc.stderr.splitlines() if line.startswith("hint: ")]
    command = hint.rpartition("then continue with: ")[2]
    assert shlex.split(command) == [*shlex.split(on_path(env)), "ardiff", "rollout", "--resume", "--out", str(run),
                                    "--pipeline", PIPELINE]
    resumed = pasted(env, command, REPO)
    assert resumed.returncode == 0, resumed.stderr
    assert_matches(run, reference)


def test_a_run_folder_removed_while_the_run_writes_it_stops_the_run_with_exit_1(env, data, tmp_path):
    """The README's exit-1 row, `the run's folder removed while it ran` (a cleanup job's `rm -rf`), in a real
    process: removed while a step's forward runs, the run stops at that step's write and re-creates nothing."""
    run, marker, release = tmp_path / "run", tmp_path / "in-fault", tmp_path / "release"
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 0, "action": "sleep", "marker": str(marker),
               "release": str(release)}]
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *rollout_args(data, run)[:-2], "--format", "json"],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)})
    try:
        wait_for_marker(proc, marker, "the step's forward")
        shutil.rmtree(run)
        release.touch()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    error = json.loads(stdout.splitlines()[-1])
    assert (error["kind"], error["message"]) == ("output_error", f"{run} was removed or replaced while this run "
                                                 "wrote it"), error
    assert not run.exists() and "Traceback" not in stderr



def test_a_run_folder_moved_away_while_the_run_writes_it_is_not_named_as_the_outputs_folder(env, data, tmp_path):
    """The run's folder renamed while a step's forward runs (an archiver moving it away): the run stops at that
    step's write (exit 1), and its summary still ended `outputs: OUT`, the folder a hint says to give --resume, which
    no longer holds the run (it holds nothing, or another run's files). The last line says so instead."""
    run, marker, release = tmp_path / "run", tmp_path / "in-fault", tmp_path / "release"
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 0, "action": "sleep", "marker": str(marker),
               "release": str(release)}]
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *rollout_args(data, run)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)})
    try:
        wait_for_marker(proc, marker, "the step's forward")
        run.rename(tmp_path / "moved")
        release.touch()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    assert f"Error: {run} was removed or replaced while this run wrote it\n" in stderr, stderr
    assert stdout.startswith("rollout failed: "), stdout
    assert not [line for line in stdout.splitlines() if line.startswith("outputs: ")], stdout
    assert stdout.endswith(f"\n{run} no longer holds this run's outputs: it was removed or replaced while the run "
                           "wrote it\n"), stdout
    assert not run.exists() and (tmp_path / "moved" / "results.jsonl").is_file()

def test_the_open_files_limit_reached_while_the_model_loads_is_named_as_the_limit_not_the_pipelines_bug(env, data,
                                                                                                       tmp_path):
    """Under `ulimit -n 5` torch's read of the checkpoint fails with `Too many open files (24)`: it was reported as
    `DreamZeroPipeline.from_config() failed: RuntimeError: ...`, the pipeline's failure, "please report it"."""
    import resource

    limit = 5  # Python, torch and the run's lock start in it; the checkpoint is one file too many
    args = [*rollout_args(data, tmp_path / "run")[:-2], "--format", "json"]
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    error = json_error(proc, 1)
    assert error["kind"] == "too_many_open_files" and "Too many open files" in error["message"], error
    assert error["hint"].startswith(f"this process reached its limit on open files (now ulimit -n {limit})"), error
    assert "from_config() failed" not in proc.stderr and "report" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_open_files_limit_reached_by_a_resume_says_to_continue_with_resume(env, data, tmp_path):
    """The limit's hint said `raise it and run again` of a run that holds run.json, where the same command without
    --resume is refused: a resume that reaches it (here as the model loads) says to continue with --resume."""
    import resource

    run = tmp_path / "run"
    first = ardiff(env, *rollout_args(data, run), faults=[{"request": "arm_b/000001", "site": "sampler"}])
    assert first.returncode == 4, first.stderr  # a run to resume: arm_b failed
    limit = 5
    args = ["rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--format", "json"]
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    error = json_error(proc, 1)
    assert error["kind"] == "too_many_open_files", error
    assert error["hint"] == (f"this process reached its limit on open files (now ulimit -n {limit}), or the system "
                             f"its own: raise it (ulimit -n 1024, say) and continue with: {on_path(env)}ardiff "
                             f"rollout --resume --out {run} --pipeline {PIPELINE}"), error


def test_a_step_that_reaches_the_open_files_limit_is_named_as_the_limit_not_the_pipelines_bug(env, data, tmp_path):
    """A forward (a library it calls) failing with EMFILE mid-run kept the step's hint to fix the pipeline, and with
    --fail-fast the JSON kind `step_failed`: it is the limit, exit 1, as when the model loads."""
    faults = [{"request": "arm_b/000001", "site": "block", "layer": 0, "action": "emfile"}]
    proc = ardiff(env, *rollout_args(data, tmp_path / "run"), faults=faults)
    assert proc.returncode == 4, proc.stderr
    assert ("Error: episode 'arm_b' failed at step 1 in the model's forward: OSError: [Errno 24] Too many open files"
            in proc.stderr)
    assert "hint: this process reached its limit on open files (now ulimit -n " in proc.stderr
    assert "fix the pipeline" not in proc.stderr
    proc = ardiff(env, *rollout_args(data, tmp_path / "stopped")[:-2], "--format", "json", "--fail-fast",
                  faults=faults)
    error = json_error(proc, 1)
    assert error["kind"] == "too_many_open_files" and error["exit_code"] == 1, error
    assert error["hint"].startswith("this process reached its limit on open files"), error
    assert error["hint"].endswith(f"continue with: {on_path(env)}ardiff rollout --resume --out "
                                  f"{tmp_path / 'stopped'} --pipeline {PIPELINE}"), error


def test_the_open_files_limit_that_stops_a_run_keeps_its_error_when_summary_json_cannot_be_made(env, data, tmp_path):
    """At the limit, summary.json's read of results.jsonl fails too: raised in the teardown, that EMFILE replaced the
    run's error (a step's, naming it) and said to `run again`, a command refused once the run holds run.json; the
    same of a run whose every step was done. The run's error stays, summary.json is a warning, --resume writes it."""
    def at_close_of(episode: str) -> list:
        return [{"site": "close_hook", "session": episode, "action": "ulimit"}]  # ulimit -n 3 from there on

    stopped = tmp_path / "stopped"
    proc = ardiff(env, *rollout_args(data, stopped, "--order", "sequential", "--fail-fast"),
                  faults=at_close_of("arm_a"))
    assert proc.returncode == 1, proc.stderr
    assert "Error: episode 'arm_b' failed at step 0 while reading" in proc.stderr, proc.stderr
    again = f"{on_path(env)}ardiff rollout --resume --out {stopped} --pipeline {PIPELINE}"
    assert f"and continue with: {again}" in proc.stderr, proc.stderr
    assert "and run again" not in proc.stderr, proc.stderr
    assert f"warning: cannot write {stopped / 'summary.json'}: Too many open files; --resume writes it" in proc.stderr
    done = tmp_path / "done"
    proc = ardiff(env, *rollout_args(data, done)[:-2], "--format", "json", "--order", "sequential",
                  faults=at_close_of("arm_d"))
    error = json_error(proc, 1)
    assert error["kind"] == "too_many_open_files", error
    assert error["hint"].endswith(f"(ulimit -n 1024, say) and continue with: {on_path(env)}ardiff rollout --resume "
                                  f"--out {done} --pipeline {PIPELINE}"), error
    assert not (done / "summary.json").exists()
    proc = ardiff(env, "rollout", "--resume", "--out", str(done), "--pipeline", PIPELINE, "--format", "plain")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((done / "summary.json").read_text())["status"] == "ok"


# A bug in the rollout's own event subscriber (simulated: KeyError on the first eviction, before any bookkeeping).
BUGGY_SUBSCRIBER = """
import sys
from ardiff_cli import rollout

record = rollout.Rollout._record_event
raised = []

def buggy(self, event):
    if event.kind == "session_evicted" and not raised:
        raised.append(event)
        raise KeyError("simulated bug in the rollout's subscriber")
    record(self, event)

rollout.Rollout._record_event = buggy
sys.argv = ["ardiff", *sys.argv[1:]]
from ardiff_cli.app import main
main()
"""


def test_a_bug_in_the_rollouts_own_event_subscriber_stops_the_run_instead_of_writing_wrong_outputs(
        env, data, reference, tmp_path):
    # The runner makes a raising subscriber a warning (a library user's metrics callback); the rollout's own one
    # tracks which sessions are resident. Ignored, its episode ran on in a fresh session without replaying its
    # history: exit 0 and a wrong output, and with --quiet not a word.
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", BUGGY_SUBSCRIBER, *rollout_args(data, run, "--quiet")], cwd=REPO,
                          capture_output=True, text=True, env={**env, "ARDIFF_TEST_FAULTS": "[]"}, timeout=600)
    assert proc.returncode == 1, proc.stderr
    assert "KeyError: \"simulated bug in the rollout's subscriber\"" in proc.stderr
    assert "this is a bug in ardiff" in proc.stderr
    got, want = outputs(run), outputs(reference)
    assert got and len(got) < len(want)  # it stopped after the step in progress
    for name, arrays in got.items():
        for key in arrays:
            np.testing.assert_array_equal(arrays[key], want[name][key], err_msg=f"{name}:{key}")
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_a_step_whose_outputs_are_not_finite_fails_and_writes_nothing(env, data, tmp_path):
    # A guidance scale of 1e30 makes DreamZero's sampler diverge: every action NaN. They were written as the step's
    # outputs with exit 0, for a robot to execute.
    config = tmp_path / "diverges.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny, guidance_scale: 1.0e+30}\n"
                      "runtime: {device: cpu, session_capacity: 1}\n")
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(config), str(data / "eps"), "--out", str(run), "--no-warmup", "--format",
                  "plain")
    assert proc.returncode == 1, proc.stderr
    lines = records(run)
    assert len(lines) == len(EPISODES) and all(r["status"] == "failed" and r["phase"] == "forward" for r in lines)
    assert ("DreamZeroPipeline.forward() returned non-finite values: 'actions': 64 NaN of 64 values; 'latents': 256 "
            "NaN of 256 values; nothing of this step was written") in lines[0]["error"], lines[0]
    assert "hint: the model diverged" in proc.stderr
    for episode in EPISODES:  # its session, NaN in its KV, is released: the episode's next step would read it
        assert re.search(rf"closed +{episode} ", proc.stderr), proc.stderr
    assert not list((run / "episodes").rglob("*.safetensors"))
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


def test_a_float16_overflow_fails_its_step_with_a_hint_naming_float16s_range(env, tmp_path):
    # A conditioning of 1e6 is a float32 input past float16's range (65504): in float16 every latent is NaN, and the
    # hint sent the user to the guidance scale of a pipeline that has none. bfloat16 runs it (float32's range).
    from ardiff_cli.io import write_step

    episode = tmp_path / "far"
    for step in range(2):
        write_step(episode, step, {"conditioning": np.full(8, 1e6, np.float32)}, prompt="drive on")
    overflow = "in float16 a value past 65504 is inf: runtime.dtype (--dtype) bfloat16 keeps float32's range"
    for dtype in ("float16", "bfloat16"):
        run = tmp_path / dtype
        proc = ardiff(env, "rollout", "causal-world-tiny", str(episode), "--dtype", dtype, "--device", "cpu",
                      "--no-warmup", "--out", str(run), "--format", "plain")
        if dtype == "bfloat16":
            assert proc.returncode == 0 and len(records(run)) == 2, proc.stderr
            continue
        assert proc.returncode == 1, proc.stderr
        assert "CausalWorldPipeline.forward() returned non-finite values: 'latents': 768 NaN" in proc.stderr
        assert "hint: the model diverged: check" in proc.stderr and overflow in proc.stderr, proc.stderr
        assert not list(run.rglob("*.safetensors"))
    # the same words when warmup finds it: DreamZero's guided velocity past 65504 as its block is committed
    config = tmp_path / "guided.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny, guidance_scale: 1.0e+8}\n")
    proc = ardiff(env, "warmup", str(config), "--dtype", "fp16", "--device", "cpu", "--format", "plain")
    assert proc.returncode == 1 and "hint: the model diverged on the warmup's inputs" in proc.stderr, proc.stderr
    assert overflow in proc.stderr, proc.stderr
    proc = ardiff(env, "warmup", str(config), "--dtype", "bf16", "--device", "cpu", "--format", "plain")
    assert proc.returncode == 0, proc.stderr


def test_a_rollout_whose_warmup_diverges_hints_a_new_run_not_a_resume_that_refuses_the_fix(env, tmp_path):
    """A rollout's warmup failing in the pipeline once run.json is written hints its --resume, to paste once the
    pipeline is fixed; but diverged outputs are fixed in the config, the dtype or the checkpoint, which --resume keeps:
    the pasted resume was refused (exit 2) with the guidance scale lowered or --dtype bf16."""
    from ardiff_cli.io import write_step

    write_step(tmp_path / "eps" / "a", 0, {"conditioning": np.zeros(8, np.float32)}, prompt="go")
    config = tmp_path / "guided.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny, guidance_scale: 1.0e+8}\n")
    run = tmp_path / "run"
    proc = ardiff(env, "rollout", str(config), str(tmp_path / "eps"), "--dtype", "fp16", "--device", "cpu", "--out",
                  str(run), "--format", "plain")
    assert proc.returncode == 1 and "hint: the model diverged on the warmup's inputs" in proc.stderr, proc.stderr
    assert "--resume" not in proc.stderr.replace("--resume keeps the run's config", ""), proc.stderr
    assert proc.stderr.endswith("--resume keeps the run's config, dtype and checkpoint: once fixed, start a new run "
                                "in another --out\n"), proc.stderr
    for fix in (["--dtype", "bf16"], []):  # what the hint says to do, through --resume: refused
        if not fix:
            config.write_text("pipeline: dreamzero\nmodel: {preset: tiny, guidance_scale: 2.0}\n")
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), *fix, "--format", "plain")
        assert proc.returncode == 2, proc.stderr


def test_non_finite_outputs_are_counted_by_name_in_torch_and_numpy_arrays_but_not_in_integers():
    import torch

    from ardiff_cli.runtime.outputs import _non_finite

    assert _non_finite({"actions": torch.zeros(3), "frames": np.ones((2, 2), np.float16), "ids": np.arange(3)}) == ""
    actions = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")], dtype=torch.bfloat16)
    frames = np.array([[np.nan, 0.0]], np.float32)
    assert _non_finite({"actions": actions, "ids": torch.arange(3), "frames": frames}) == (
        "'actions': 1 NaN, 2 inf of 4 values; 'frames': 1 NaN of 2 values")
    # a one-value output (a scalar reward): "1 NaN of 1 values"
    assert _non_finite({"reward": torch.tensor([float("nan")])}) == "'reward': 1 NaN of 1 value"


def test_a_forward_may_return_any_mapping_of_bool_integer_or_floating_arrays_beside_other_values():
    """What a step file holds: bool masks, integer ids and floats, numpy or torch, from any mapping, other values
    beside them being left out (not a failed step); an empty dict says so, and a complex tensor is named as
    the pipeline's mistake before safetensors refuses it 'while writing its outputs' with a hint to check the disk."""
    from types import MappingProxyType

    import torch

    from ardiff_cli.runtime.outputs import EXPECTED, STORABLE, output_problem

    assert output_problem(MappingProxyType({"mask": np.ones(3, bool), "ids": torch.arange(3),
                                            "actions": torch.zeros(2), "step": 3})) is None
    assert output_problem({}) == ("contract", f"a dict with no array in it (empty), {EXPECTED}")
    assert output_problem({"x": torch.zeros(2, dtype=torch.complex64)}) == (
        "contract", f"arrays a step file cannot hold: 'x' (torch.complex64); {STORABLE}")
    # float8 has no numpy dtype (numpy() refused it as the step was written), and torch has no isfinite for e4m3fn
    # (a NotImplementedError in the step's check)
    assert output_problem({"x": torch.zeros(2, dtype=torch.float8_e4m3fn), "half": torch.zeros(2, dtype=torch.bfloat16),
                           "u": torch.zeros(2, dtype=torch.uint16), "h": np.zeros(2, np.float16)}) == (
        "contract", f"arrays a step file cannot hold: 'x' (torch.float8_e4m3fn); {STORABLE}")
    if np.dtype(np.longdouble).itemsize > 8:  # float128 on x86-64 Linux, which safetensors refuses
        assert output_problem({"y": np.zeros(2, np.longdouble)}) == (
            "contract", f"arrays a step file cannot hold: 'y' ({np.dtype(np.longdouble)}); {STORABLE}")


def test_a_kept_partly_rebuilt_snapshot_whose_step_lost_its_output_is_replayed_not_a_crash(cli_env, tmp_path):
    """A resume stopped while it rebuilt arm_a's session keeps a snapshot of 1 step (arm_a has 2 done). Then arm_a's
    step 0 output goes missing: the next resume runs step 0 again (README), so the 1-step snapshot (ahead of step 0)
    cannot be restored. It was adopted by count (1 <= 1 done), and the run stopped: "AssertionError: session 'arm_a'
    is ahead of its episode (1 > 0)", exit 1, "a bug in ardiff". Now it is deleted with a warning saying why."""
    from pipelines.dreamzero import observation_schema

    data = tmp_path / "data"
    data.mkdir()
    (data / "fast.yaml").write_text(FAST_CONFIG)
    for i, name in enumerate(EPISODES):
        write_episode(data / "eps" / name, [demo_step(observation_schema(), (16, 16), i, s, 1 if s == 0 else 4)
                                            for s in range(3)], prompt=f"task {name}")

    def ardiff(*args, faults=()):
        return subprocess.run([sys.executable, "-m", "ardiff_cli", *args], cwd=REPO, capture_output=True, text=True,
                              env={**cli_env, "ARDIFF_TEST_FAULTS": json.dumps(list(faults))}, timeout=600)

    run = tmp_path / "run"
    failed = ardiff(*rollout_args(data, run, "--swap-space", "0", "--fail-fast"),
                    faults=[{"request": "arm_a/000002", "site": "block", "layer": 1}])
    assert failed.returncode == 1, failed.stderr
    resume = ["rollout", "--resume", "--out", str(run), "--swap-space", "16MiB", "--pipeline", PIPELINE,
              "--no-warmup", "--format", "plain"]
    proc, err = stop_inside_a_fault(cli_env, resume, [{"request": "arm_a/000000/replay", "site": "block", "layer": 1,
                                                       "action": "sleep"}], tmp_path)
    assert proc.returncode == 143, err
    kept = json.loads((run / ".swap" / "kept.json").read_text())["sessions"]
    assert {name: entry["steps"] for name, entry in kept.items()} == {"arm_a": 1}
    (run / "episodes" / "arm_a" / "step_000000.safetensors").unlink()  # its output goes missing
    proc = ardiff(*resume)
    assert "is ahead of its episode" not in proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert ("episode 'arm_a': the swap snapshot the stopped run kept was deleted (it holds 1 step, and the one at "
            "position 0 in the episode is not done (its output went missing)); its done steps are replayed instead"
            ) in proc.stderr
    assert (run / "episodes" / "arm_a" / "step_000000.safetensors").is_file()


# -- hints that give the command that works for the run --------------------------------------------------------

def pasted_here(env, command: str) -> subprocess.CompletedProcess:
    """``command``, as a hint printed it, run by bash from the repository (``ardiff``: this one)."""
    return subprocess.run(["bash", "-c", f'ardiff() {{ "$PASTE_PYTHON" -m ardiff_cli "$@"; }}\n{command}'], cwd=REPO,
                          env={**env, "PASTE_PYTHON": sys.executable}, capture_output=True, text=True, timeout=600)


def test_a_damaged_results_line_hints_the_runs_own_resume_which_pasted_once_it_is_deleted_finishes_it(
        env, reference, tmp_path):
    """It said "or delete line N (its step then runs again with --resume)": a bare --resume of a run started with
    --pipeline is refused, and the options given to this resume were lost."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:2] + ['{"episode": garbage\n'] + lines[3:]))
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--swap-space", "1 MiB",
                  "--no-warmup", "--format", "plain")
    assert proc.returncode == 2, proc.stderr
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --swap-space '1 MiB' --no-warmup"
    assert proc.stderr.endswith(f"Error: {run / 'results.jsonl'}, line 3: expected one JSON object per line, got "
                                "'{\"episode\": garbage'\nhint: ardiff writes each line whole, so the file was "
                                "changed outside ardiff: restore it, or delete line 3 (its step then runs again), "
                                f"then continue with: {again}\n"), proc.stderr
    (run / "results.jsonl").write_text("".join(lines[:2] + lines[3:]))  # what the hint says
    proc = pasted_here(env, again)
    assert proc.returncode == 0, proc.stderr
    assert "11 steps already done" in proc.stderr
    assert_matches(run, reference)


def test_a_page_shortage_in_a_rollouts_warmup_hints_the_resume_without_it_not_a_dtype_the_run_cannot_change(
        env, data, reference, tmp_path):
    """The KV page pool running short in a warmup request (the warmup session has the pool to itself: the plan
    undercounts its pages) said "lower --memory-budget, --session-capacity or --gpu-memory-fraction, or use --dtype
    bfloat16 or a smaller model": none of them is the fix, a resume refuses --dtype, and the new run's command
    run again is refused (run.json is written before the warmup). The hint gives the resume without the warmup, which
    pasted runs the steps."""
    run = tmp_path / "run"
    faults = [{"request": "warmup-2", "site": "page_shortage"}]
    args = [a for a in rollout_args(data, run) if a != "--no-warmup"]
    hint = ("hint: the KV page pool, sized by the capacity plan, ran short in the pipeline's warmup requests: the "
            "pipeline's KV spec or ardiff's plan undercounts their pages (report it, with the --verbose traceback), "
            "which no memory option or dtype changes; go on without the warmup (a step that runs short then fails "
            "its own episode, and the others go on); to paste: ")
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE}"
    proc = ardiff(env, *args, faults=faults)
    assert proc.returncode == 3, proc.stderr
    assert "KV page pool exhausted" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.endswith(f"{hint}{again} --no-warmup\n"), proc.stderr
    proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--session-capacity", "1",
                  "--format", "plain", faults=faults)  # a resume's: with what it was given
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.endswith(f"{hint}{again} --no-warmup --session-capacity 1\n"), proc.stderr
    proc = pasted_here(env, f"{again} --no-warmup --session-capacity 1")
    assert proc.returncode == 0, proc.stderr
    assert_matches(run, reference)


def test_a_resume_of_a_run_folder_this_user_cannot_write_hints_to_make_it_writable_not_to_choose_another(
        env, reference, tmp_path):
    """It said "choose a folder you can write": a resume cannot, its folder is the run's. The hint names the folder
    to make writable and the resume, which pasted once it is finishes the run (file modes bind as root too:
    ``modes_bind``)."""
    from test_reliability_input import modes_bind

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))  # its last step runs again
    folders = [run, *(path for path in run.rglob("*") if path.is_dir())]
    for path in [*run.rglob("*"), run]:
        path.chmod(path.stat().st_mode & ~0o222)
    try:
        proc = subprocess.run([*modes_bind(), sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out",
                               str(run), "--pipeline", PIPELINE, "--no-warmup", "--format", "plain"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=600)
    finally:
        for path in folders:
            path.chmod(path.stat().st_mode | 0o200)  # for pytest to remove it, whatever failed
    assert proc.returncode == 2, proc.stderr
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --no-warmup"
    assert proc.stderr.endswith(f"Error: --out {run}: cannot write the output folder: Permission denied\nhint: make "
                                "the run's folder and its files writable by this user (chmod -R u+w "
                                f"{run}), then continue with: {again}\n"), proc.stderr
    proc = pasted_here(env, f"chmod -R u+w {run} && {again}")
    assert proc.returncode == 0, proc.stderr
    assert "11 steps already done" in proc.stderr
    assert_matches(run, reference)


def test_a_resume_of_a_run_folder_another_user_owns_hints_to_give_it_to_this_user_not_a_chmod_that_cannot_help(
        env, reference, tmp_path):
    """A run folder owned by another user (here nobody, 0755) said "chmod -R u+w OUT, run as their owner": this user's
    chmod is refused, and the owner's makes it writable by the owner alone, so the resume pasted after it was refused
    again. The hint names the owner and the chown that gives the folder to this user; pasted, the resume finishes the
    run. Run as root without the capabilities that bypass modes and ownership."""
    import pwd

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (chown to another user) and setpriv")
    nobody = pwd.getpwnam("nobody").pw_uid
    drop = "-dac_override,-dac_read_search,-fowner"
    as_user = [shutil.which("setpriv"), f"--bounding-set={drop}", f"--inh-caps={drop}"]
    run = tmp_path / "a run's"
    shutil.copytree(reference, run)
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))  # its last step runs again
    for path in [run, *run.rglob("*")]:
        os.chown(path, nobody, -1)
        path.chmod(0o755)
    command = [*as_user, sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out", str(run), "--pipeline",
               PIPELINE, "--no-warmup", "--format", "plain"]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    word = shlex.quote(str(run))
    again = f"{on_path(env)}ardiff rollout --resume --out {word} --pipeline {PIPELINE} --no-warmup"
    assert proc.stderr.endswith(f"Error: --out {run}: cannot write the output folder: Permission denied\nhint: the "
                                "run's folder is owned by another user (nobody, not root): give it and its files to "
                                f"this user (chown -R root {word}, as root) or resume as nobody, then continue with: "
                                f"{again}\n"), proc.stderr
    assert subprocess.run(["bash", "-c", f"chown -R root {word}"]).returncode == 0  # what the hint says, as root
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "11 steps already done" in proc.stderr
    assert_matches(run, reference)


def test_a_resume_of_a_run_folder_with_an_immutable_lock_hints_chattr_not_a_chmod_that_is_refused(
        env, reference, tmp_path):
    """An immutable .lock (`chattr +i`, a backup tool's) refuses even root with EPERM, and so does chmod: the hint said
    "chmod -R u+w OUT". It names lsattr and the chattr that clears the flag; pasted, the resume finishes the run."""
    run = tmp_path / "-run"
    shutil.copytree(reference, run)
    if os.geteuid() != 0 or shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(run / ".lock")], capture_output=True).returncode != 0:
        pytest.skip("needs root and a file system with immutable files (chattr +i)")
    try:
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--swap-space", "1 MiB",
                      "--no-warmup", "--format", "plain")
        assert proc.returncode == 2, proc.stderr
        again = (f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --swap-space '1 MiB' "
                 "--no-warmup")
        assert proc.stderr.endswith(f"Error: --out {run}: cannot write the output folder: Operation not permitted\n"
                                    "hint: a file there or the folder is immutable or append-only (lsattr -d "
                                    f"{run} {run / '.lock'}): clear it with chattr -R -i -a {run}, as root, then "
                                    f"continue with: {again}\n"), proc.stderr
        proc = pasted_here(env, f"chattr -R -i -a {run} && {again}")
    finally:
        subprocess.run(["chattr", "-i", str(run / ".lock")])  # for pytest to remove it, whatever failed
    assert proc.returncode == 0, proc.stderr
    assert "12 steps already done" in proc.stderr
    assert_matches(run, reference)


def test_a_resume_of_a_run_whose_episode_folder_is_immutable_names_that_folder_to_lsattr(env, reference, tmp_path):
    """An immutable episode's folder (`chattr +i`) is refused under the lock, before the model loads; its hint's
    lsattr named the run's folder and its .lock, whose flags are clear, not the folder that refused the write."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    episode = run / "episodes" / "arm_d"
    if os.geteuid() != 0 or shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", str(episode)], capture_output=True).returncode != 0:
        pytest.skip("needs root and a file system with immutable files (chattr +i)")
    try:
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup",
                      "--format", "plain")
    finally:
        subprocess.run(["chattr", "-i", str(episode)])  # for pytest to remove it, whatever failed
    assert proc.returncode == 2, proc.stderr
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --no-warmup"
    assert proc.stderr.endswith(f"Error: --out {run}: cannot write {episode}: Operation not permitted\nhint: a file "
                                f"there or the folder is immutable or append-only (lsattr -d {run} {episode}): clear "
                                f"it with chattr -R -i -a {run}, as root, then continue with: {again}\n"), proc.stderr
    assert "planned" not in proc.stderr  # before the model loaded


def test_a_new_run_in_a_folder_another_user_owns_names_the_owner_and_a_fix_that_works_not_chmod(env, data, tmp_path):
    """A new run whose --out (or the folder it is made in, or a folder in it) is another user's: this user's chmod is
    refused there, and the owner's makes it theirs alone to write. It said "choose a folder you can write", or of an
    episodes/ folder there "chmod -R u+w OUT", or "resume as" its owner of a run never started. The hint names the
    owner and what root runs to make it this user's; pasted, the run finishes. Run as root without the capabilities
    that bypass modes and ownership (a second user, as far as files go)."""
    import pwd

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (chown to another user) and setpriv")
    nobody = pwd.getpwnam("nobody").pw_uid
    drop = "-dac_override,-dac_read_search,-fowner"
    as_user = [shutil.which("setpriv"), f"--bounding-set={drop}", f"--inh-caps={drop}"]
    theirs, above, mine = tmp_path / "their run", tmp_path / "their runs", tmp_path / "mine"
    theirs.mkdir()
    above.mkdir()
    (mine / "episodes").mkdir(parents=True)  # left by another user's run there, that ended before it wrote a file
    for path in (theirs, above, mine / "episodes"):
        os.chown(path, nobody, -1)
        path.chmod(0o755)
    word, new = shlex.quote(str(theirs)), shlex.quote(str(above / "run"))
    for out, message, fix in (
            (theirs, "cannot write the output folder", f"the run's folder is owned by another user (nobody, not "
             f"root): give it and its files to this user (chown -R root {word}, as root)"),
            (above / "run", "cannot create the output folder", f"{above} is owned by another user (nobody, not "
             f"root): have root make the run's folder this user's (mkdir -p {new} && chown root {new}, as root)"),
            (mine, f"cannot write {mine / 'episodes'}", f"{mine / 'episodes'} is owned by another user (nobody, not "
             f"root): give it and its files to this user (chown -R root {mine}, as root)")):
        command = [*as_user, sys.executable, "-m", "ardiff_cli", *rollout_args(data, out)]
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.endswith(f"Error: --out {out}: {message}: Permission denied\nhint: {fix}, or choose "
                                    "another --out\n"), proc.stderr
        assert "planned" not in proc.stderr  # before the model loaded
        paste = fix.rpartition("(")[2].removesuffix(", as root)")
        assert subprocess.run(["bash", "-c", paste]).returncode == 0  # what the hint says, as root
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr


def test_a_new_run_in_a_folder_another_user_owns_and_this_one_cannot_enter_is_not_hinted_a_chown_of_its_out(
        env, data, tmp_path):
    """--out deep in another user's folder this user cannot enter (mode 0700): the hint said to have root make --out
    and chown it to this user, which pasted changed nothing (the folder above it still cannot be entered: the same
    error again). It says to choose a folder this user can write."""
    import pwd

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (chown to another user) and setpriv")
    drop = "-dac_override,-dac_read_search,-fowner"
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, pwd.getpwnam("nobody").pw_uid, -1)
    out = theirs / "runs" / "eval1"
    proc = subprocess.run([shutil.which("setpriv"), f"--bounding-set={drop}", f"--inh-caps={drop}", sys.executable,
                           "-m", "ardiff_cli", *rollout_args(data, out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: --out {out}: cannot create the output folder: Permission denied\nhint: choose "
                                "a folder you can write, or one that does not exist yet\n"), proc.stderr


def test_hints_run_as_root_name_the_run_folder_by_its_absolute_path(env, data, reference, tmp_path):
    """The chown, chattr and lsattr a hint says to run as root are pasted into a root shell (sudo -i, su -), which
    starts in root's home, not in the folder the rollout ran in: of a relative --out they named a folder there (chown:
    "cannot access 'their run'"), and the rollout was refused again. They name it by its absolute path; pasted from
    another folder, they make the run go on. Run as root without the capabilities that bypass modes and ownership."""
    import pwd

    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("chattr") is None:
        pytest.skip("needs root (chown to another user, chattr), and setpriv")
    nobody = pwd.getpwnam("nobody").pw_uid
    drop = "-dac_override,-dac_read_search,-fowner"
    as_user = [shutil.which("setpriv"), f"--bounding-set={drop}", f"--inh-caps={drop}"]
    (tmp_path / "their run").mkdir()
    (tmp_path / "their runs").mkdir()
    shutil.copytree(reference, tmp_path / "-run")
    for path in (tmp_path / "their run", tmp_path / "their runs"):
        os.chown(path, nobody, -1)
        path.chmod(0o755)
    if subprocess.run(["chattr", "+i", str(tmp_path / "-run" / ".lock")], capture_output=True).returncode != 0:
        pytest.skip("needs a file system with immutable files (chattr +i)")
    theirs, new, frozen = (shlex.quote(str(tmp_path / name)) for name in ("their run", "their runs/run", "-run"))
    resume = ["rollout", "--resume", "--out", "./-run", "--pipeline", PIPELINE, "--no-warmup", "--format", "plain"]
    try:
        for arguments, fix in (
                (rollout_args(data, Path("their run")), f"chown -R root {theirs}"),
                (rollout_args(data, Path("their runs/run")), f"mkdir -p {new} && chown root {new}"),
                (resume, f"lsattr -d {frozen} {tmp_path / '-run' / '.lock'}): clear it with chattr -R -i -a {frozen}")):
            command = [*as_user, sys.executable, "-m", "ardiff_cli", *arguments]
            proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 2, proc.stderr
            assert f"{fix}, as root" in proc.stderr, proc.stderr
            paste = fix.rpartition(" with ")[2] if "chattr" in fix else fix
            assert subprocess.run(["bash", "-c", paste], cwd="/").returncode == 0  # as root, in another folder
            proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr
    finally:
        subprocess.run(["chattr", "-i", str(tmp_path / "-run" / ".lock")])  # for pytest to remove it, whatever failed


@pytest.mark.parametrize(("name", "flag", "what"), [("run.json", "+i", "immutable"),
                                                    ("summary.json", "+a", "append-only")])
def test_a_resume_of_a_run_whose_run_json_is_immutable_is_refused_before_the_model_loads(
        env, reference, tmp_path, name, flag, what):
    """An immutable or append-only run.json or summary.json (`chattr +i`, `+a`: a backup tool's) passed the write
    check, which a folder this user can write passes, and failed once the model had loaded, as the run replaced it:
    "free some space or fix the folder's permissions". It is refused under the lock, before the model loads, with
    the chattr that clears it; pasted, the resume finishes the run."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))  # its last step runs again: the model loads
    if os.geteuid() != 0 or shutil.which("chattr") is None or subprocess.run(
            ["chattr", flag, str(run / name)], capture_output=True).returncode != 0:
        pytest.skip("needs root and a file system with immutable files (chattr +i)")
    try:
        proc = ardiff(env, "rollout", "--resume", "--out", str(run), "--pipeline", PIPELINE, "--no-warmup",
                      "--format", "plain")
        assert proc.returncode == 2, proc.stderr
        again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --no-warmup"
        assert proc.stderr.endswith(f"Error: --out {run}: cannot write {run / name}: Operation not permitted (the "
                                    f"file is {what})\nhint: a file there or the folder is immutable or append-only "
                                    f"(lsattr -d {run} {run / name}): clear it with chattr -R -i -a {run}, as root, "
                                    f"then continue with: {again}\n"), proc.stderr
        assert "planned" not in proc.stderr  # before the model loaded
        proc = pasted_here(env, f"chattr -R -i -a {run} && {again}")
    finally:
        subprocess.run(["chattr", "-i", "-a", str(run / name)])  # for pytest to remove it, whatever failed
    assert proc.returncode == 0, proc.stderr
    assert "11 steps already done" in proc.stderr
    assert_matches(run, reference)


def test_the_syscalls_waited_for_are_this_machines_and_an_unknown_machine_skips():
    """wait_reading and the waits for a write that a full pipe blocks looked for x86-64's read (0) and write (1): on
    aarch64 (63, 64: the kernel's generic table) they polled /proc for 5 minutes, then failed. The numbers are looked
    up by machine; a machine the table lacks skips the test, naming it. Here, a child's real read and write match."""
    assert [syscall_number(name, "x86_64") for name in ("read", "write", "futex")] == ["0", "1", "202"]
    assert [syscall_number(name, "aarch64") for name in ("read", "write", "futex")] == ["63", "64", "98"]
    with pytest.raises(pytest.skip.Exception, match=r"watches /proc/PID/syscall for write\(2\), whose number on "
                                                    r"'riscv64' is not known: add the machine to SYSCALLS in tests/"):
        syscall_number("write", "riscv64")

    code = "import os, sys; sys.stderr.write('r'); sys.stderr.flush(); os.read(0, 1); os.write(1, b'.' * (1 << 20))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)

    def blocked_in(left: str | None = None) -> list[str]:
        """The syscall and its first argument, once the child sleeps in one other than ``left`` (the read it was
        woken from may still show, sleeping, until the scheduler runs it)."""
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
            if Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0] == "S":
                call = Path(f"/proc/{proc.pid}/syscall").read_text().split()[:2]
                if call[0] != left:
                    return call
            time.sleep(0.001)

    try:
        assert proc.stderr.read(1) == b"r"  # next: its read of stdin, the only wait left before its write
        assert blocked_in() == [syscall_number("read"), "0x0"]
        proc.stdin.write(b"x")
        proc.stdin.flush()  # next: its write of 1 MiB to stdout, which the pipe (64 KiB) blocks
        assert blocked_in(left=syscall_number("read")) == [syscall_number("write"), "0x1"]
        assert len(proc.stdout.read()) == 1 << 20
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()


def test_wait_blocked_names_a_wait_with_a_timeout_rather_than_polling_it_for_minutes():
    """wait_blocked polled a process that waits in a futex with a timeout (another glibc or Python's lock, or a
    timed wait) for 5 minutes, then failed naming two fields of /proc/PID/syscall; a test's own thread polling so
    (test_runner_swap's Ctrl-C in a close's wait) waited for ever. One untimed wait is found; a timed one is named."""
    def python(code: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code])

    untimed = python("import threading; lock = threading.Lock(); lock.acquire(); lock.acquire()")
    timed = python("import threading; threading.Event().wait(600)")
    try:
        wait_blocked(untimed)
        with pytest.raises(AssertionError, match=r"has waited 1 s in syscall \d+ \(arguments .*\), not in a futex "
                                                 r"with no timeout .*: this Python or C library waits otherwise"):
            wait_blocked(timed, settle_s=1)
    finally:
        untimed.kill()
        timed.kill()
        untimed.wait()
        timed.wait()


def test_a_run_lock_past_the_file_size_limit_names_the_limit_not_free_space(env, data, reference, tmp_path):
    """Under `ulimit -f 0` (Python ignores SIGXFSZ: the write fails with EFBIG) the lock's pid could not be written,
    and the hint said "free some space in it, or choose another --out" of a disk with room. It names the limit and
    the command to run once it is raised, which pasted (with no limit) finishes the run."""
    fresh, run = tmp_path / "fresh", tmp_path / "run"
    proc = pasted_here(env, f"ulimit -f 0; ardiff {shlex.join(rollout_args(data, fresh))}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: --out {fresh}: cannot write {fresh / '.lock'}: File too large\nhint: a file "
                                "reached this process's file-size limit of 0 bytes (ulimit -f): raise it (ulimit -f "
                                "unlimited), then run the same command again\n"), proc.stderr
    assert "free some space" not in proc.stderr and "planned" not in proc.stderr
    shutil.copytree(reference, run)
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))  # its last step runs again
    (run / ".lock").unlink()
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --no-warmup"
    proc = pasted_here(env, f"ulimit -f 0; {again}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith("(ulimit -f unlimited), then continue with: " + again + "\n"), proc.stderr
    assert "free some space" not in proc.stderr
    proc = pasted_here(env, again)
    assert proc.returncode == 0, proc.stderr
    assert "11 steps already done" in proc.stderr
    assert_matches(run, reference)


@pytest.mark.parametrize("read_only", ["folder", "results", "episode"])
def test_a_run_folder_read_only_but_its_lock_is_refused_before_the_model_loads(env, reference, tmp_path, read_only):
    """`chmod a-w` on the run's folder (or results.jsonl, or an episode's folder) with its .lock still writable: the
    lock was taken, the model loaded, and only then did run.json (or the first step's line or output) fail to be
    written. It is refused under the lock, before the model loads, with the hint that makes it writable and the
    resume, which pasted finishes the run (file modes bind as root too: ``modes_bind``)."""
    from test_reliability_input import modes_bind

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    lines = (run / "results.jsonl").read_text().splitlines(keepends=True)
    (run / "results.jsonl").write_text("".join(lines[:-1]))  # its last step runs again
    target = {"folder": run, "results": run / "results.jsonl", "episode": run / "episodes" / "arm_d"}[read_only]
    target.chmod(target.stat().st_mode & ~0o222)
    try:
        proc = subprocess.run([*modes_bind(), sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "--out",
                               str(run), "--pipeline", PIPELINE, "--no-warmup", "--format", "plain"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=600)
    finally:
        target.chmod(target.stat().st_mode | 0o200)
    assert proc.returncode == 2, proc.stderr
    again = f"{on_path(env)}ardiff rollout --resume --out {run} --pipeline {PIPELINE} --no-warmup"
    assert proc.stderr.endswith(f"Error: --out {run}: cannot write {target}: Permission denied\nhint: make the run's "
                                f"folder and its files writable by this user (chmod -R u+w {run}), then continue "
                                f"with: {again}\n"), proc.stderr
    assert "planned" not in proc.stderr  # before the model loaded
    proc = pasted_here(env, again)
    assert proc.returncode == 0, proc.stderr
    assert "11 steps already done" in proc.stderr
    assert_matches(run, reference)


@pytest.mark.parametrize("budget, fraction", [(None, None), ("300 KiB", None), ("300 KiB", "0.3")])
def test_a_page_shortage_in_ardiff_warmup_hints_a_pool_of_more_sessions_which_pasted_passes(env, data, budget,
                                                                                            fraction):
    """`ardiff warmup` whose requests run short of the KV pool's pages (10 pages fewer than they need, a plan that
    undercounts them) said "lower --memory-budget, --session-capacity or --gpu-memory-fraction, or use --dtype
    bfloat16 or a smaller model": a smaller pool runs shorter still. Its warmup session has the pool to itself, so a
    pool planned for twice the sessions (and, where the budget limits the plan, a budget that holds them) has the
    pages: the hint's warmup, pasted with the same shortage, passes. The budget is the plan's bytes over the
    --gpu-memory-fraction, the share of it the sessions beyond the first take: with 0.3 the plan's bytes as the
    budget planned one session again, and the pasted warmup ran short again with the same hint."""
    faults = [{"request": "warmup-2", "site": "page_shortage", "pages": 10}]
    given = [*([] if budget is None else ["--memory-budget", budget]),
             *([] if fraction is None else ["--gpu-memory-fraction", fraction])]
    proc = ardiff(env, "warmup", str(data / "fast.yaml"), "--pipeline", PIPELINE, *given, "--format", "plain",
                  faults=faults)
    assert proc.returncode == 3, proc.stderr
    assert "KV page pool exhausted" in proc.stderr and "Traceback" not in proc.stderr
    pool = int(re.search(r"free of (\d+)", proc.stderr).group(1))
    assert "--dtype" not in proc.stderr and "lower" not in proc.stderr
    hint = proc.stderr.rpartition("\nhint: ")[2]
    assert hint.startswith("the KV page pool, sized by the capacity plan, ran short in the pipeline's warmup "
                           "requests, which had it to themselves"), hint
    assert "a pool planned for 2 sessions holds more pages: run again with --session-capacity 2" in hint, hint
    assert ("--memory-budget of" in hint) == (budget is not None), hint  # 300 KiB holds one session, not two
    command = hint.rpartition("; to paste: ")[2].strip()
    assert command.startswith(f"ardiff warmup {data / 'fast.yaml'} "), command
    proc = pasted_here({**env, "ARDIFF_TEST_FAULTS": json.dumps(faults)}, f"{command} --format json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])  # the events' lines, then the report's
    assert report["kind"] == "warmup" and report["restored"] and len(report["requests"]) >= 3, report
    assert report["pages_total"] > pool, (report, pool)
