"""`ardiff rollout` as a user sees it: a real process on a pseudo-terminal, its output played back on a screen.

A terminal of 80 x 40 shows the whole live layout; one of 12 lines does not. Typing Ctrl-C (not sending SIGINT)
matters: the terminal echoes it, as ``^C``, where the live display's cursor is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fast_run import write_fast_data
from terminal import Screen, held_step, run_in_pty

STATUS = re.compile(r"^\d+(/\d+)? steps · ")  # the live display's status line, under its progress bar


def test_a_typed_ctrl_c_leaves_the_last_frame_whole_and_saying_interrupted(tmp_path, cli_env):
    """The status line filled the terminal's width: the echoed ^C wrapped onto a new line, and every later frame
    was drawn one line lower, leaving a copy of the title above it. The last frame, which stays on the screen
    above the summary, said "stopping" with an ETA (or "running", after a second Ctrl-C)."""
    write_fast_data(tmp_path, {f"ep_{i}": 40 for i in range(3)})
    release = tmp_path / "release"
    pipeline, env = held_step(cli_env, "ep_1/000020", release)
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "out", "--no-warmup", *pipeline], env=env,
                              cwd=tmp_path, cols=80, rows=40, type_after=b"running", release=release)
    screen = Screen(80, 40).feed(output)
    lines = [line for line in screen.history + screen.display() if line]
    text = "\n".join(lines)
    assert code == 130, text
    assert b"^C" in output  # the terminal echoed it, as a user's terminal does (the next frame erased it)
    assert lines.count("ardiff rollout · fast.yaml → out") == 1, text
    last = max(i for i, line in enumerate(lines) if STATUS.match(line))  # the last frame's status line (it may wrap)
    summary = lines.index(next(line for line in lines if line.startswith("rollout interrupted: ")))
    status = " ".join(lines[last:summary])
    assert status.endswith(" interrupted") and "ETA" not in status, text
    assert "rollout interrupted: " in text and "outputs: out (results.jsonl, summary.json, episodes/)" in text
    error, hint = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode()).rstrip("\r\n").split("\r\n")[-2:]
    assert error == "Error: interrupted by SIGINT" and hint.startswith("hint: continue with: ") and hint.endswith(
        " ardiff rollout --resume --out out --pipeline faulty_pipelines:FaultyDreamZero"), text
    assert output.rindex(b"\x1b[?25h") > output.rindex(b"\x1b[?25l")  # the cursor is shown again


def test_a_typed_ctrl_c_in_the_warmup_gives_the_resume_that_skips_it(tmp_path, cli_env):
    """Ctrl-C typed as the live display shows a warmup that goes on too long (faulty_pipelines.EndlessWarmup): the
    hint under the last frame gave the resume that runs that warmup again; it skips it now."""
    write_fast_data(tmp_path, {"ep_0": 2})
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "out", "--pipeline",
                               "faulty_pipelines:EndlessWarmup"], env=cli_env, cwd=tmp_path, cols=100, rows=40,
                              type_after=b"__ardiff_warmup__")  # its session's row, or the event that admitted it
    screen = Screen(100, 40).feed(output)
    text = "\n".join(line for line in screen.history + screen.display() if line)
    assert code == 130, text
    error, hint = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode()).rstrip("\r\n").split("\r\n")[-2:]
    assert error == "Error: interrupted by SIGINT" and hint.startswith("hint: continue with: ") and hint.endswith(
        " ardiff rollout --resume --out out --pipeline faulty_pipelines:EndlessWarmup --no-warmup"), text


def test_on_a_short_terminal_every_frame_shows_the_title_and_the_progress(tmp_path, cli_env):
    """The live display cut what did not fit from the bottom: on 12 lines the progress line never showed, nor did
    the events (a run of several resident sessions on a 24-line terminal lost them too)."""
    # 240 steps, over a second: the live display draws four times a second, its first frame a quarter second in, so
    # 24 steps (0.2 s on an idle machine) could end before any redraw, leaving no frame to check
    write_fast_data(tmp_path, {f"ep_{i}": 40 for i in range(6)})
    (tmp_path / "fast.yaml").write_text((tmp_path / "fast.yaml").read_text().replace("session_capacity: 2",
                                                                                      "session_capacity: 4"))
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "out", "--no-warmup"], env=cli_env,
                              cwd=tmp_path, cols=80, rows=12)
    screen = Screen(80, 12).feed(output)
    assert code == 0, "\n".join(screen.history + screen.display())
    frames = [frame for frame in screen.frames if "ardiff rollout · fast.yaml → out" in frame]
    assert frames, "\n".join(screen.history + screen.display())
    for frame in frames:
        shown = "\n".join(frame)
        assert any(STATUS.match(line) for line in frame) and "..." not in frame, shown
        assert "events" in shown, shown  # the newest event, at least
    assert "outputs: out (results.jsonl, summary.json, episodes/)" in screen.display()


def test_on_a_short_narrow_terminal_that_only_stderr_goes_to_every_frame_fits_it(tmp_path, cli_env):
    """`--format rich < /dev/null > FILE`: Rich measures the terminal on descriptors 0, 1 and 2, and 2 is the stderr
    relay's pipe while the display runs, so it measured none and drew 80 x 25 on a terminal of 60 x 12: each frame
    wrapped and ran off the screen, and was left there (30 title lines)."""
    write_fast_data(tmp_path, {f"ep_{i}": 40 for i in range(6)})
    (tmp_path / "fast.yaml").write_text((tmp_path / "fast.yaml").read_text().replace("session_capacity: 2",
                                                                                      "session_capacity: 4"))
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "out", "--no-warmup", "--format", "rich"],
                              env=cli_env, cwd=tmp_path, cols=60, rows=12, stdout_to=tmp_path / "stdout.txt")
    screen = Screen(60, 12).feed(output)
    lines = screen.history + screen.display()
    text = "\n".join(lines)
    assert code == 0, text
    assert lines.count("ardiff rollout · fast.yaml → out") == 1, text
    assert "rollout ok: 240 steps in " in (tmp_path / "stdout.txt").read_text()


def test_inspect_capacity_on_a_narrow_terminal_breaks_long_words_and_cuts_none(tmp_path, cli_env):
    """At 40 columns the item and detail columns cut long words: "model-ow…", "gpu_memory…" and the hint
    "pip install 'ardiff[vl…" lost what they were there to say."""
    code, output = run_in_pty(["inspect-capacity", "dreamzero-14b", "--available", "80GiB", "--device", "cuda"],
                              env=cli_env, cwd=tmp_path, cols=40, rows=120)
    screen = Screen(40, 120).feed(output)
    text = "\n".join(screen.history + screen.display())
    assert code == 0, text
    assert "…" not in text and "'ardiff[vl" in text and "gpu_memory_" in text, text


def test_warmup_on_a_narrow_terminal_shows_every_input_shape_whole(tmp_path, cli_env):
    """At 40 columns the inputs column cut its shapes: "joint_position(7…", "gripper_position…"; then, with the
    time column a digit wider (a request of 100 ms or more), folded "joint_position(7" from ",),". Names and shapes
    are now separate words, which a line breaks between."""
    code, output = run_in_pty(["warmup", "--device", "cpu"], env=cli_env, cwd=tmp_path, cols=40, rows=120)
    screen = Screen(40, 120).feed(output)
    lines = screen.history + screen.display()
    text = "\n".join(lines)
    assert code == 0, text
    result = "\n".join(lines[max(i for i, line in enumerate(lines) if line.startswith("warmup: ")):])  # not the panel
    assert "…" not in result, text
    for word in ("exterior_image_0", "exterior_image_1", "wrist_image", "joint_position", "(7,),", "gripper_position",
                 "(1,),"):
        assert word in result, text


def test_the_last_frame_of_a_stopped_run_agrees_with_its_summary(tmp_path, cli_env):
    """A stopped run swaps its resident sessions out, then ends: its last frame, left above the summary, still
    showed them resident with their pages (the views were read only after a step), beside the events saying they
    were swapped out."""
    write_fast_data(tmp_path, {f"ep_{i}": 40 for i in range(3)})
    release = tmp_path / "release"
    pipeline, env = held_step(cli_env, "ep_1/000020", release)
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "out", "--no-warmup", *pipeline], env=env,
                              cwd=tmp_path, cols=100, rows=40, type_after=" restored · ".encode(), release=release)
    lines = [line for line in Screen(100, 40).feed(output).display() if line]
    text = "\n".join(lines)
    assert code == 130, text
    summary = re.search(r"rollout interrupted: (\d+) steps? in [\d.]+ s \(([\d.]+) steps/s\)", text)
    frame = re.findall(r"^(\d+)/\d+ steps · ([\d.]+) steps/s · ", text, re.MULTILINE)
    assert summary and frame, text
    assert frame[-1][0] == summary.group(1), text  # its rate: test_the_live_rate_counts_the_steps_time_not_...
    assert re.search(r"evicted +ep_\d +run_stopped, swapped out", text), text  # the stop swapped a session out
    assert re.search(r"sessions +0/2 resident", text) and re.search(r"pages +\S+ 0/\d+, \d+ free", text), text
    assert re.search(r"^│ none ", text, re.MULTILINE), text


def test_the_last_frame_of_a_stopped_run_counts_the_snapshots_it_keeps(tmp_path, cli_env):
    """A swap space with room for one snapshot (52,672 bytes here: each session one step in): the first eviction's
    swap-out sends SIGINT, and the stop keeps that snapshot, then closes the two resident sessions it has no room to
    swap out. The frame that close redrew read "swap  0 out, 0 B of 60.00 KiB" above a summary whose --resume
    restores the one OUT/.swap/kept.json names."""
    from ardiff_cli.runtime.capacity import format_bytes

    write_fast_data(tmp_path, {f"ep_{i}": 3 for i in range(3)})
    env = {**cli_env, "ARDIFF_TEST_SIGNAL_IN": "export", "ARDIFF_TEST_SIGNALS": "1"}
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "out", "--no-warmup", "--swap-space", "60KiB",
                               "--pipeline", "faulty_pipelines:SignalWhileSwapping"], env=env, cwd=tmp_path,
                              cols=100, rows=40)
    text = "\n".join(line for line in Screen(100, 40).feed(output).display() if line)
    assert code == 130, text
    swap = tmp_path / "out" / ".swap"
    kept = json.loads((swap / "kept.json").read_text())["sessions"]
    assert list(kept) == ["ep_0"], text
    assert re.search(r"closed +ep_\d +run_stopped", text), text  # what redrew the frame after the snapshots were kept
    size = (swap / kept["ep_0"]["file"]).stat().st_size
    assert re.search(rf"swap +1 kept, {re.escape(format_bytes(size))} of 60.00 KiB", text), text


def test_the_last_frame_of_a_fail_fast_run_counts_the_failure_its_summary_counts(tmp_path, cli_env):
    """With --fail-fast the run stopped at the failure before the progress line was updated: the last frame, left
    above the summary, read "... · 0:00:01 failed" without the "1 failed" that summary.json's steps.failed has."""
    write_fast_data(tmp_path, {"ep_a": 3, "ep_b": 3})
    (tmp_path / "eps" / "ep_b" / "step_000001.safetensors").write_bytes(b"garbage")
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "out", "--no-warmup", "--fail-fast"],
                              env=cli_env, cwd=tmp_path, cols=100, rows=40)
    lines = [line for line in Screen(100, 40).feed(output).display() if line]
    text = "\n".join(lines)
    assert code == 2, text
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"]["failed"] == 1
    last = [line for line in lines if STATUS.match(line)][-1]
    assert " · 1 failed · " in last and last.endswith(" failed"), text


def test_a_failed_steps_traceback_with_verbose_shows_whole_above_the_live_display(tmp_path, cli_env):
    """--verbose prints a failed step's traceback while the run goes on: written to stderr beside the live display,
    it began on the progress line ("... runningTraceback (most recent call last):") and the display's next frame,
    drawn over the lines it thought were its own, erased the traceback's end, the exception it was printed for."""
    write_fast_data(tmp_path, {"ep_a": 3, "ep_b": 3})
    env = {**cli_env, "ARDIFF_TEST_FAULTS": json.dumps([{"request": "ep_a/000001", "site": "block", "layer": 0}])}
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "out", "--no-warmup", "-v",
                               "--pipeline", "faulty_pipelines:FaultyDreamZero"], env=env, cwd=tmp_path, cols=100,
                              rows=40)
    screen = Screen(100, 40).feed(output)
    lines = screen.history + screen.display()
    text = "\n".join(lines)
    assert code == 4, text
    assert lines.count("Traceback (most recent call last):") == 2, text  # the step's, then the run's at exit
    error = next(i for i, line in enumerate(lines)  # one line, that the terminal wraps at its 100th column
                 if line.startswith("Error: episode 'ep_a' failed at step 1 in the model's forward: InjectedFault: "))
    assert "faulty_pipelines.InjectedFault: injected fault in transformer block 0 (call 1)" in lines[:error], text


CHATTY = ("bytes", "print", "stderr", "logging", "handler")  # faulty_pipelines.ChattyDreamZero's lines, in order


def chatty_run(tmp_path, cli_env) -> tuple[dict[str, str], list[str], str]:
    """3 episodes of 12 steps, each step's forward printing its lines; the environment, the ardiff arguments, and
    the line its last step leaves unfinished."""
    write_fast_data(tmp_path, {f"ep_{i}": 12 for i in range(3)})
    env = {**cli_env, "ARDIFF_TEST_UNFINISHED": "ep_2/000011"}
    args = ["rollout", "fast.yaml", "eps", "-o", "out", "--no-warmup", "--pipeline", "faulty_pipelines:ChattyDreamZero"]
    return env, args, "chatty: unfinished ep_2/000011"


def chatter(out) -> list[str]:
    """The lines ChattyDreamZero printed, in the order its steps ran (results.jsonl)."""
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    ran = [record.get("request_id", f"{record['episode']}/{record['step']:06d}") for record in records]  # or failed
    return [f"chatty: {kind} {request}" for request in ran for kind in CHATTY]


def test_what_a_pipeline_prints_shows_above_the_live_display_whole_and_in_order(tmp_path, cli_env):
    """Written to the terminal as it was, beside the live display, the text landed in the region its next frame
    redrew: lines were erased, and the frames' tops they pushed up were left behind (more title lines). A line the
    display's end left unfinished is shown too, above its last frame."""
    env, args, unfinished = chatty_run(tmp_path, cli_env)
    code, output = run_in_pty(args, env=env, cwd=tmp_path, cols=100, rows=40)
    screen = Screen(100, 40).feed(output)
    lines = screen.history + screen.display()
    text = "\n".join(lines)
    assert code == 0, text
    printed = [i for i, line in enumerate(lines) if line.startswith("chatty: ")]
    assert [lines[i] for i in printed] == [*chatter(tmp_path / "out"), unfinished], text
    assert lines.count("ardiff rollout · fast.yaml → out") == 1, text
    assert lines.index("ardiff rollout · fast.yaml → out") > printed[-1], text  # the last frame, under them all


def test_what_a_pipeline_prints_under_quiet_is_held_and_shown_whole_and_in_order_before_an_error(tmp_path, cli_env):
    """--quiet (no live display, no line of ardiff's): what the pipeline wrote is held, and shown as it was written,
    in order, before the error it may explain (a line left unfinished ends there); then ardiff's Error: lines."""
    env, args, unfinished = chatty_run(tmp_path, cli_env)
    env["ARDIFF_TEST_CHATTY_FAIL"] = "ep_2/000011"
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args, "--quiet"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 4, proc.stderr  # some episodes failed
    printed = "".join(f"{line}\n" for line in chatter(tmp_path / "out")) + unfinished + "\n"
    assert proc.stderr.startswith(printed + "Error: episode 'ep_2' failed at step 11 in the model's forward: "
                                  "InjectedFault: injected fault in ep_2/000011\n"), proc.stderr
    assert proc.stderr.count("chatty: ") == printed.count("chatty: "), proc.stderr  # shown once


def test_a_line_a_pipeline_leaves_unfinished_ends_before_ardiffs_next_line(tmp_path, cli_env):
    """`print(..., end="")` in a forward, then ardiff's own line (plain events, the failed step's `Error:`): it began
    after the pipeline's text on the same line, and a script reading `^Error:` lines missed it. The open line ends
    first; the pipeline's text is kept as it was written."""
    env, args, _ = chatty_run(tmp_path, cli_env)
    env["ARDIFF_TEST_UNFINISHED"] = "ep_2/000005"
    env["ARDIFF_TEST_CHATTY_FAIL"] = "ep_2/000005"  # fails right after leaving its line open
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args, "--format", "plain"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 4, proc.stderr
    lines = proc.stderr.splitlines()
    assert "chatty: unfinished ep_2/000005" in lines, proc.stderr
    assert any(line.startswith("Error: episode 'ep_2' failed at step 5 in the model's forward: InjectedFault")
               for line in lines), proc.stderr


BAR = """\
import sys
from pipelines.dreamzero.pipeline import DreamZeroPipeline
class Bar(DreamZeroPipeline):
    def forward(self, request):
        print(f"bar: cannot find the weights of {request.request_id}: running without them")
        for i in range(1, 2001):  # a progress bar, as tqdm draws one: each update redraws its line
            sys.stderr.write(f"\\rdenoising {i:4d}/2000 |" + "#" * (i // 50) + " " * (40 - i // 50) + "|")
        sys.stderr.write("\\n")
        raise RuntimeError("no weights")
"""


def test_a_progress_bar_under_quiet_is_held_as_it_shows_and_keeps_the_line_before_it(tmp_path, cli_env):
    """--quiet keeps the last 64 Ki characters of what code printed for an error's report: a progress bar that redraws
    its line with \\r 2000 times (126 K characters) filled them, and the line that explained the error, printed before
    the bar, was left out; a cron job's mail got one line of 64 Ki characters of redraws. Its last state is kept, as
    the live display shows it."""
    write_fast_data(tmp_path, {"ep_a": 2})
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "bar.py").write_text(BAR)
    env = {**cli_env, "PYTHONPATH": f"{tmp_path / 'mods'}:{cli_env['PYTHONPATH']}"}
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "fast.yaml", "eps", "-o", "out", "-q",
                           "--no-warmup", "--pipeline", "bar:Bar", "--fail-fast"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("bar: cannot find the weights of ep_a/000000: running without them\n"
                                  "denoising 2000/2000 |" + "#" * 40 + "|\n"
                                  "Error: "), proc.stderr[:2000]
    assert "\r" not in proc.stderr and len(proc.stderr) < 2000, proc.stderr[:2000]


NOISY = """\
import logging, os, sys, warnings
import torch
from pipelines.dreamzero.pipeline import DreamZeroPipeline
print("noisy: import")
def noise(where):
    print(f"noisy: print {where}")
    print(f"noisy: stderr {where}", file=sys.stderr)
    warnings.warn(f"noisy: warning {where}")
    logging.getLogger("x").warning("noisy: logging %s", where)
class Noisy(DreamZeroPipeline):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        noise("load")
        torch.range(0, 1)  # deprecated: torch's own UserWarning
    def ar_diffusion_warmup_requests(self, session_id):
        noise("warmup")
        yield from super().ar_diffusion_warmup_requests(session_id)
    def forward(self, request):
        noise(request.request_id)
        return super().forward(request)
"""


def test_quiet_is_silent_whatever_the_pipeline_prints_when_all_goes_well(tmp_path, cli_env):
    """`ardiff -q rollout ...` from cron, to hear only of failures: a pipeline's print(), its writes to sys.stderr,
    its warnings, logging's and torch's (a deprecated call) reached stderr on every run, while ardiff's own warnings
    were silenced. Each command, with or without a terminal, writes nothing to stderr now; JSON stays pure."""
    write_fast_data(tmp_path, {"ep_a": 2})
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "noisy.py").write_text(NOISY)
    env = {**cli_env, "PYTHONPATH": f"{tmp_path / 'mods'}:{cli_env['PYTHONPATH']}"}
    pipeline = ["--pipeline", "noisy:Noisy", "-q"]
    for i, args in enumerate([["rollout", "fast.yaml", "eps", "-o", "plain"], ["rollout", "fast.yaml", "eps", "-o",
                              "json", "--format", "json"], ["warmup", "fast.yaml"], ["warmup", "fast.yaml", "--format",
                              "json"], ["inspect-capacity", "fast.yaml"], ["inspect-capacity", "fast.yaml",
                              "--format", "json"]]):
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args, *pipeline], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert (proc.returncode, proc.stderr) == (0, ""), (args, proc.stderr)
        data = proc.stdout
        if "json" in args:  # its warnings, silenced, are still the result's (`warnings`), never its prints
            lines = [json.loads(line) for line in proc.stdout.splitlines()]
            listed = [w for line in lines for w in line.pop("warnings", [])]
            assert args[0] == "inspect-capacity" or any("UserWarning: noisy: warning" in w for w in listed), listed
            data = json.dumps(lines)
        assert "noisy: " not in data, (args, data)
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "pty", *pipeline], env=env, cwd=tmp_path,
                              cols=100, rows=40)
    assert code == 0 and b"noisy: " not in output, output.decode()


def stray_run(tmp_path, cli_env, ways: str, steps: int) -> tuple[int, list[str], list[str]]:
    """2 episodes of ``steps`` steps under the live display (200 columns: a warning's path stays on one line), each
    step's forward writing its lines the ``ways`` of faulty_pipelines.StrayDreamZero; the exit code, every line the
    screen shows or scrolled off, and the request ids in the order the steps ran."""
    write_fast_data(tmp_path, {f"ep_{i}": steps for i in range(2)})
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "out", "--no-warmup", "--pipeline",
                               "faulty_pipelines:StrayDreamZero"], env={**cli_env, "ARDIFF_TEST_STRAY": ways},
                              cwd=tmp_path, cols=200, rows=40)
    screen = Screen(200, 40).feed(output)
    records = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    return code, screen.history + screen.display(), [record.get("request_id") for record in records]


def test_a_pipelines_warnings_from_any_thread_show_above_the_live_display_whole_and_in_order(tmp_path, cli_env):
    """Python's warnings, from the forward and from a thread of its own, are ardiff's `warning:` lines, printed
    through the display's console: above it, each whole and in order, and the display drawn once below them."""
    code, lines, ran = stray_run(tmp_path, cli_env, "warn,thread_warn", 30)
    text = "\n".join(lines)
    assert code == 0, text
    shown = [(i, match.group(1)) for i, line in enumerate(lines)
             if (match := re.match(r"warning: .*: UserWarning: (stray: .*)$", line))]
    assert [line for _, line in shown] == [f"stray: {way} {request}" for request in ran
                                          for way in ("warn", "thread_warn")], text
    assert lines.count("ardiff rollout · fast.yaml → out") == 1, text
    assert lines.index("ardiff rollout · fast.yaml → out") > shown[-1][0], text


def test_what_native_code_writes_to_fd_2_shows_above_the_live_display_whole_and_in_order(tmp_path, cli_env):
    """Written to the terminal beside the live display, a native write landed in the region the next frame redrew:
    of 60 lines about 20 were erased, and a frame's top pushed up by them was left behind (a second title line)."""
    code, lines, ran = stray_run(tmp_path, cli_env, "fd2", 30)
    text = "\n".join(lines)
    assert code == 0, text
    shown = [i for i, line in enumerate(lines) if line.startswith("stray: ")]
    assert [lines[i] for i in shown] == [f"stray: fd2 {request}" for request in ran], text
    assert lines.count("ardiff rollout · fast.yaml → out") == 1, text
    assert lines.index("ardiff rollout · fast.yaml → out") > shown[-1], text


def test_a_native_write_larger_than_a_pipe_from_a_call_that_keeps_the_gil_neither_blocks_nor_is_lost(tmp_path,
                                                                                                    cli_env):
    """Descriptor 2 is a pipe while the display runs: read by a thread of this process, 100 KiB written in one C call
    that keeps the GIL filled the pipe and waited for that thread, which waited for the GIL. The relay is a process."""
    code, lines, _ = stray_run(tmp_path, cli_env, "flood", 2)
    assert code == 0, "\n".join(lines[-50:])
    assert [line for line in lines if line.startswith("stray: flood ")] == [f"stray: flood {i:05d}"
                                                                           for i in range(5000)]
    assert lines.count("ardiff rollout · fast.yaml → out") == 1, "\n".join(lines[-50:])


def test_native_writes_after_the_relay_was_killed_do_not_fail_the_step(tmp_path, cli_env):
    """The relay process killed (the OOM killer, a `kill`) left descriptor 2 a pipe nobody read: each later native
    write failed (os.write raised BrokenPipeError: the step failed its episode, exit 4; a child handed stderr was
    killed by SIGPIPE). Descriptor 2 is the terminal again, its writes landing in the display as with no relay."""
    code, lines, ran = stray_run(tmp_path, cli_env, "kill_relay,fd2", 4)
    text = "\n".join(lines)
    assert code == 0 and "Error:" not in text, text
    assert sorted(ran) == [f"ep_{i}/{step:06d}" for i in range(2) for step in range(4)], text


def test_children_that_outlive_the_display_holding_fd_2_lose_none_of_its_lines(tmp_path, cli_env):
    """A child process handed descriptor 2 (the relay's pipe) still holds it as the display ends: the end waited up
    to a second for the relay, which copies until the pipe's last writer closes it. It no longer waits (measured, not
    asserted here); what the children wrote still shows, above the display or after it."""
    code, lines, ran = stray_run(tmp_path, cli_env, "child,fd2", 4)
    text = "\n".join(lines)
    assert code == 0 and "Error:" not in text, text
    assert sorted(line for line in lines if line.startswith("stray: ")) == sorted(
        f"stray: {way} {request}" for request in ran for way in ("child", "fd2")), text


def test_a_stopped_relay_does_not_hold_the_display_s_end(tmp_path, cli_env):
    """The relay stopped (`kill -STOP`, a debugger) from the second step until the process exits: the display's end
    waited for it forever. It waits a bounded time now, shows what the pipe held itself, and the run ends with its
    own exit code; the relay, continued once the process is gone, writes what it held to the terminal."""
    code, lines, ran = stray_run(tmp_path, cli_env, "stop_relay,fd2", 4)
    text = "\n".join(lines)
    assert code == 0 and "Error:" not in text, text
    assert sorted(ran) == [f"ep_{i}/{step:06d}" for i in range(2) for step in range(4)], text
    assert sorted(line for line in lines if line.startswith("stray: ")) == sorted(f"stray: fd2 {request}"
                                                                                  for request in ran), text
    assert any(line.startswith("rollout ok: 8 steps in ") for line in lines), text


@pytest.mark.parametrize("frozen, says", [(False, ">&2"), (True, ">&2"), (False, "")],
                         ids=["no_python", "frozen", "no_python_on_stdout"])
def test_an_executable_that_is_no_python_runs_without_a_relay(tmp_path, cli_env, frozen, says):
    """A frozen executable (PyInstaller: sys.executable is the program itself) ran `sys.executable -I -S -c RELAY`:
    the program's own complaint about its arguments landed on the terminal, and descriptor 2 was a pipe that nobody
    read. A frozen one starts no relay now; in any other the relay says it runs, and where it does not (no Python),
    descriptor 2 stays the terminal (native writes land in the display, as with no relay) and the run goes on. The
    relay said it ran with one byte, `R`: a program whose complaint on stdout (the relay's socket) began `Run ...`
    passed for one, and the rest of it showed above the display. It echoes a random token of this run now."""
    fake = tmp_path / "frozen-app"  # what a frozen ardiff says of `-I -S -c ...`, as any CLI would
    fake.write_text(f"#!/bin/sh\necho \"Run frozen-app --help: no such option: $1\" {says}\nexit 2\n")
    fake.chmod(0o755)
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "sitecustomize.py").write_text(f"import sys\nsys.executable = {str(fake)!r}\n"
                                                        + ("sys.frozen = True\n" if frozen else ""))
    env = {**cli_env, "PYTHONPATH": f"{tmp_path / 'mods'}:{cli_env['PYTHONPATH']}"}
    code, lines, ran = stray_run(tmp_path, env, "fd2", 4)
    text = "\n".join(lines)
    assert code == 0 and "Error:" not in text, text
    assert "no such option" not in text, text
    assert sorted(ran) == [f"ep_{i}/{step:06d}" for i in range(2) for step in range(4)], text
    assert any(line.startswith("rollout ok: 8 steps in ") for line in lines), text


@pytest.mark.parametrize("says", [">&2", ""], ids=["token_unread", "answer_on_stdout"])
def test_an_executable_that_is_no_python_is_said_not_to_start_the_relay(tmp_path, monkeypatch, says):
    """The relay's error where ``sys.executable`` is no Python (the run goes on without a relay, above): it did not
    start, and what it sent. One that ended without reading the token it was sent reset the socket, and its
    ConnectionResetError came out instead, from the wait for the token."""
    from ardiff_cli.stderr_relay import StderrRelay

    fake = tmp_path / "no-python"
    fake.write_text(f"#!/bin/sh\necho \"no-python: no such option: $1\" {says}\nexit 2\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    with pytest.raises(OSError) as raised:
        StderrRelay(lambda text: None, "utf-8", None)
    assert type(raised.value) is OSError and str(raised.value).startswith(
        f"the stderr relay did not start: {fake} -I -S -c ... sent b"), raised.value


# Under a relay (ardiff_cli.stderr_relay) that runs, 20 lines of 70 KB written to descriptor 2, then the display's end
# (stop, close) while the first of them is still being shown: `show` takes 6 s over it, as a slow terminal would
_SLOW_SHOW = r"""
import os, sys, time
from ardiff_cli.stderr_relay import StderrRelay, TIMEOUT_S
shown = []
def show(text):
    if not shown:
        time.sleep(TIMEOUT_S + 1)
    shown.append(text)
relay = StderrRelay(show, "utf-8", None)
for i in range(20):
    os.write(2, b"stray: %02d " % i + b"x" * 70000 + b"\n")
relay.stop()
relay.close()
sys.stdout.write("".join(shown))
"""


def test_a_relay_that_runs_is_waited_for_however_long_its_lines_take_to_show(tmp_path, cli_env):
    """The display's end gave up on the relay after 5 s even where the relay answered at once and only the showing
    was slow: the relay then wrote what it had sent to the terminal itself, and about half the lines showed twice.
    Only a relay silent for that long is given up on now: each line shows once, all above the display."""
    with open(tmp_path / "terminal", "wb") as terminal:
        proc = subprocess.run([sys.executable, "-c", _SLOW_SHOW], env=cli_env, stdout=subprocess.PIPE,
                              stderr=terminal, timeout=120)
    assert proc.returncode == 0, (tmp_path / "terminal").read_bytes()[-2000:]
    shown = [line[:9] for line in proc.stdout.decode().splitlines()]
    assert shown == [f"stray: {i:02d}" for i in range(20)]
    assert b"stray:" not in (tmp_path / "terminal").read_bytes()


# A line left unfinished on descriptor 2, shown above the display; then the relay stopped (`kill -STOP`) and the
# display's end (stop, close); this process exits, printing the relay's pid for the test to continue it
_STOPPED_AFTER_A_PARTIAL_LINE = r"""
import os, signal, sys, time
from ardiff_cli.stderr_relay import StderrRelay
shown = []
relay = StderrRelay(shown.append, "utf-8", None)
os.write(2, b"stray: unfinished")
while not shown:
    time.sleep(0.01)
os.kill(relay._relay.pid, signal.SIGSTOP)
os.write(2, b" stray: after the stop\n")
relay.stop()
relay.close()
print(relay._relay.pid, repr("".join(shown)))
"""


def test_a_stopped_relay_continued_after_the_display_s_end_writes_nothing_shown_again(tmp_path, cli_env):
    """The display's end gives up on a stopped relay and shows what the pipe held itself. The line left unfinished,
    shown then, was not acknowledged (the socket was shut down first): the relay, continued, wrote it to the terminal
    a second time."""
    with open(tmp_path / "terminal", "wb") as terminal:
        proc = subprocess.run([sys.executable, "-c", _STOPPED_AFTER_A_PARTIAL_LINE], env=cli_env,
                              stdout=subprocess.PIPE, stderr=terminal, text=True, timeout=120)
    assert proc.returncode == 0, (tmp_path / "terminal").read_bytes()[-2000:]
    pid, shown = proc.stdout.split(" ", 1)
    assert shown == "'stray: unfinished stray: after the stop\\n'\n"
    os.kill(int(pid), signal.SIGCONT)
    # until the relay has ended (gone, or a zombie); a bound on a hang only: it was 30 s, after which the check below
    # passed however late a relay starved that long then wrote to the terminal
    deadline = time.monotonic() + 300
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        assert time.monotonic() < deadline, f"the continued relay (pid {pid}) has not ended"
        time.sleep(0.01)
    assert (tmp_path / "terminal").read_bytes() == b""


# The relay stopped (it reads nothing more), a line written to descriptor 2 (it waits in the pipe), the display's end
# begun on a thread (stop: descriptor 2 the terminal again, the relay asked to finish), and the relay killed then
# (SIGKILL, the OOM killer); TIMEOUT_S raised so that only the kill ends the wait
_KILLED_AS_THE_DISPLAY_ENDS = r"""
import os, signal, sys, threading, time
from ardiff_cli import stderr_relay
stderr_relay.TIMEOUT_S = 600
shown = []
relay = stderr_relay.StderrRelay(shown.append, "utf-8", None)
os.kill(relay._relay.pid, signal.SIGSTOP)
os.write(2, b"stray: in the pipe\n")
ending = threading.Thread(target=relay.stop)
ending.start()
while not relay._stopped:
    time.sleep(0.01)
os.kill(relay._relay.pid, signal.SIGKILL)
ending.join()
relay.close()
print(repr("".join(shown)))
"""


# A line written to descriptor 2 and shown; a second copy of the pipe's write end kept, as a child handed descriptor 2
# keeps one; then the display's end (stop). The relay finishes: it sends what the pipe holds, shuts its end of the
# socket for writing and waits for this end to close. Shown the end of the text (``show("")`` after the socket's
# end), this process writes a line to the pipe through that copy and SIGKILLs the relay (the OOM killer), so that the
# relay has read everything the pipe held but that line, and is dead before the display's end acknowledges anything
_KILLED_ONCE_IT_FINISHED = r"""
import os, signal, sys
from ardiff_cli import stderr_relay
stderr_relay.TIMEOUT_S = 600
shown = []
def show(text):
    if not text:  # the socket's end, once the relay finished: the one empty text shown
        os.write(held, b"stray: after the relay finished\n")
        os.kill(relay._relay.pid, signal.SIGKILL)
        relay._relay.wait()
        text = "<killed>"
    shown.append(text)
relay = stderr_relay.StderrRelay(show, "utf-8", None)
held = os.dup(2)
os.write(2, b"stray: before the end\n")
relay.stop()
relay.close()
os.close(held)
print(repr("".join(shown)))
"""


@pytest.mark.parametrize("script, shown", [
    (_KILLED_AS_THE_DISPLAY_ENDS, "stray: in the pipe\n"),
    (_KILLED_ONCE_IT_FINISHED, "stray: before the end\n<killed>stray: after the relay finished\n")],
    ids=["as_the_display_ends", "once_it_finished"])
def test_what_the_pipe_holds_shows_when_the_relay_is_killed(tmp_path, cli_env, script, shown):
    """The relay killed once the display's end had asked it to finish: the end saw the socket close, as when the
    relay finishes, and closed its own read end of the pipe, so that the lines waiting there were lost. This process
    sees that the relay is gone (it refuses an acknowledgement) and shows what the pipe holds itself. Killed after it
    finished (what the pipe held sent, its end of the socket shut for writing), the relay reads the same at the
    socket's end as one that finished and waits, but no longer copies the pipe to the terminal: the acknowledgement
    sent last, refused, tells the two apart, and the line a child wrote then is not lost."""
    with open(tmp_path / "terminal", "wb") as terminal:
        proc = subprocess.run([sys.executable, "-c", script], env=cli_env,
                              stdout=subprocess.PIPE, stderr=terminal, text=True, timeout=120)
    assert proc.returncode == 0, (tmp_path / "terminal").read_bytes()[-2000:]
    assert proc.stdout == repr(shown) + "\n"
    assert (tmp_path / "terminal").read_bytes() == b""


def test_a_native_crashs_last_words_reach_the_terminal(tmp_path, cli_env):
    """A C++ runtime writes why to descriptor 2, then aborts: the process dies before any thread of it can show
    that above the display, and the relay, told by its socket's end, writes it to the terminal itself."""
    write_fast_data(tmp_path, {"ep_0": 6})
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "out", "--no-warmup", "--pipeline",
                               "faulty_pipelines:StrayDreamZero"], env={**cli_env, "ARDIFF_TEST_STRAY": "abort"},
                              cwd=tmp_path, cols=100, rows=40)
    assert code == -6, output.decode(errors="replace")  # SIGABRT
    assert b"terminate called after throwing an instance of 'stray::Error'" in output, output.decode(errors="replace")


def test_quiet_draws_nothing_through_warmup_swap_restores_and_follow_waits(tmp_path, cli_env):
    """`-q` in a terminal, through every stage that has progress of its own: the warmup, sessions evicted to the swap
    space and restored (one resident session, three episodes), and --follow waiting for steps that never come until
    --idle-timeout. No display, bar or spinner (no hidden cursor, no line redrawn), nothing but the result."""
    write_fast_data(tmp_path, {f"ep_{i}": 3 for i in range(3)})
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", "out", "-q", "--session-capacity", "1",
                               "--swap-space", "10MiB", "--follow", "--idle-timeout", "1"], env=cli_env, cwd=tmp_path,
                              cols=100, rows=40)
    text = output.decode(errors="replace")
    assert code == 0, text
    assert b"\x1b[?25l" not in output and b"\x1b[1A" not in output and b"\r\x1b" not in output, text
    lines = [line for line in Screen(100, 40).feed(output).display() if line]
    assert lines[0].startswith("rollout ok: 9 steps in ") and lines[-1].startswith("outputs: out "), text
    assert re.search(r"sessions: capacity 1, \d+ evictions, [1-9]\d* restored from swap", text), text
    assert len(lines) == 5, text


def test_a_hint_wider_than_the_terminal_is_one_line_to_copy_and_its_command_pastes_into_bash(tmp_path, cli_env):
    """Rich broke a hint at the terminal's width with a newline: the command of `already holds a run`, copied from a
    terminal of 60 columns, pasted as two, `ardiff rollout --resume --out` (its value missing) and the folder alone.
    It is one line now, which the terminal wraps."""
    write_fast_data(tmp_path, {"ep_a": 2})
    run = "-ü $x 'q run"  # a leading '-', a space, '$', a quote, a non-ASCII letter: one shell word all the same
    args = ["rollout", "fast.yaml", "eps", "-o", f"./{run}", "--no-warmup"]
    first = subprocess.run([sys.executable, "-m", "ardiff_cli", *args], cwd=tmp_path, env=cli_env,
                           capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    (tmp_path / run / "results.jsonl").write_text((tmp_path / run / "results.jsonl").read_text().splitlines(
        keepends=True)[0])  # as if stopped after its first step
    code, output = run_in_pty(args, env=cli_env, cwd=tmp_path, cols=60, rows=20)  # a new run into it
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode())
    assert code == 2, text
    hint = next(line for line in text.split("\r\n") if line.startswith("hint: "))
    command = re.fullmatch(r"hint: continue it with: (.*); or choose another --out", hint)
    assert command is not None and len(hint) > 60, text
    pasted = subprocess.run(["bash", "-c", f'ardiff() {{ "$PASTE_PYTHON" -m ardiff_cli "$@"; }}\n{command.group(1)}'],
                            cwd=tmp_path, env={**cli_env, "PASTE_PYTHON": sys.executable}, capture_output=True,
                            text=True)
    assert pasted.returncode == 0, pasted.stderr
    assert len((tmp_path / run / "results.jsonl").read_text().splitlines()) == 2


def test_a_warning_wider_than_the_terminal_is_one_line_to_copy(tmp_path, cli_env):
    """A warning names paths to copy as a hint does (`give DIR as EPISODE`): Rich broke it at the terminal's width
    with a newline, in the middle of the folder's name. It is one line now, which the terminal wraps."""
    write_fast_data(tmp_path, {"ep_a": 2})
    folder = tmp_path / "eps" / "ep_a"
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", str(folder), "-o", "run", "--no-warmup"], env=cli_env,
                              cwd=tmp_path, cols=60, rows=20)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode())
    assert code == 0, text
    warning = next(line for line in text.split("\r\n") if line.startswith("warning: "))
    assert warning == f"warning: {folder} is episode 'ep_a' again (given twice); it runs once", text


@pytest.mark.parametrize("command", [["rollout", "fast.yaml", "eps/{missing}", "-o", "run"],
                                     ["warmup", "{missing}.yaml"], ["inspect-capacity", "{missing}.yaml"]])
def test_an_error_wider_than_the_terminal_is_one_line_to_copy(tmp_path, cli_env, command):
    """`Error:` names the path that was wrong, to copy as a hint's: Rich broke it at the terminal's width with a
    newline, in the middle of the path, where hint and warning lines were already one line. It is one line now."""
    write_fast_data(tmp_path, {"ep_a": 2})
    missing = "a_folder_with_a_name_long_enough_to_pass_the_terminal_width"
    code, output = run_in_pty([arg.format(missing=missing) for arg in command], env=cli_env, cwd=tmp_path, cols=60,
                              rows=20)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode())
    assert code == 2, text
    error = next(line for line in text.split("\r\n") if line.startswith("Error: "))
    assert len(error) > 60 and error.endswith((f" eps/{missing}", f" {missing}.yaml")), text


def test_the_summarys_outputs_line_wider_than_the_terminal_is_one_line_to_copy(tmp_path, cli_env):
    """`outputs: DIR` names the folder to give --resume --out or to read: Rich broke it at the terminal's width with a
    newline, in the middle of the folder's name, as it did `Error:` lines. It is one line now, which the terminal
    wraps."""
    write_fast_data(tmp_path, {"ep_a": 2})
    run = "a_run_folder_with_a_name_long_enough_to_pass_the_terminal_width"
    code, output = run_in_pty(["rollout", "fast.yaml", "eps", "-o", run, "--no-warmup"], env=cli_env, cwd=tmp_path,
                              cols=60, rows=20)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", output.decode())
    assert code == 0, text
    line = next(line for line in text.split("\r\n") if line.startswith("outputs: "))
    assert line == f"outputs: {run} (results.jsonl, summary.json, episodes/)", text
    # and so the progress line that names it (Rich broke it after `writing`, the folder on a line of its own)
    assert f"writing {run}: 1 episode, order round-robin\r\n" in text, text


def test_an_out_named_in_bytes_the_locale_cannot_decode_is_written_as_xnn_in_every_line_of_the_terminal(
        tmp_path, cli_env):
    """`-o $'caf\\xe9'` in a terminal: the title, the `writing OUT:` line and the `Error:` line said `caf\\udce9`
    (stderr's escape of Python's lone surrogate), and the `outputs:` line sent the raw byte, which a UTF-8 terminal
    shows as `caf�`; the hint's `$'caf\\xe9'` alone named the folder. Every line writes `caf\\xe9` now."""
    import os

    write_fast_data(tmp_path, {"a": 2})
    env = {**{k: v for k, v in cli_env.items() if not k.startswith(("LC_", "PYTHONUTF8", "PYTHONIOENCODING"))},
           "LC_ALL": "C.UTF-8"}
    args = ["rollout", "fast.yaml", "eps/a", "-o", os.fsdecode(b"caf\xe9"), "--no-warmup"]

    def screen_lines(output: bytes) -> list[str]:
        screen = Screen(100, 40).feed(output)
        return [line for line in screen.history + screen.display() if line]

    code, output = run_in_pty(args, env=env, cwd=tmp_path, cols=100, rows=40)
    lines = screen_lines(output)
    assert code == 0 and b"\\udc" not in output and b"caf\xe9" not in output, output
    assert "ardiff rollout · fast.yaml → caf\\xe9" in lines, "\n".join(lines)  # the live display's title
    assert "writing caf\\xe9: 1 episode, order round-robin" in lines, "\n".join(lines)
    assert "outputs: caf\\xe9 (results.jsonl, summary.json, episodes/)" in lines, "\n".join(lines)
    code, output = run_in_pty(args, env=env, cwd=tmp_path, cols=100, rows=40)
    lines = screen_lines(output)
    assert code == 2 and lines[-2:] == ["Error: caf\\xe9 already holds a run",
                                        "hint: continue it with: ardiff rollout --resume --out $'caf\\xe9'; or choose "
                                        "another --out"], "\n".join(lines)
