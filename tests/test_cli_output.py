"""The output sink, the error table and the live layout (rendered on a recorded console)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import signal
import sys
import threading
import time

import pytest
import typer
from rich.console import Console

from ardiff_cli.errors_cli import EpisodesFailed, Interrupted, exit_code_for, handle_errors
from ardiff_cli.output import Format, Output, resolve_format
from ardiff_cli.panels import EventRow, SessionRow, Snapshot, render
from ardiff_cli.runtime.errors import CapacityError, CheckpointError, ConfigError, ObservationError, PipelineError
from ardiff_cli.signals import HANDLED, StopSignals, give_back

ESC = re.compile(r"\x1b\[")


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def sink(fmt: Format, **kw) -> tuple[Output, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return Output(fmt, stdout=out, stderr=err, **kw), out, err


def test_auto_is_rich_only_when_both_streams_are_terminals(monkeypatch):
    monkeypatch.delenv("TERM", raising=False)
    assert resolve_format("auto", stdout=Tty(), stderr=Tty()) is Format.rich
    assert resolve_format("auto", stdout=io.StringIO(), stderr=Tty()) is Format.plain
    assert resolve_format("auto", stdout=Tty(), stderr=io.StringIO()) is Format.plain
    assert resolve_format("json", stdout=Tty(), stderr=Tty()) is Format.json
    monkeypatch.setenv("TERM", "dumb")
    assert resolve_format("auto", stdout=Tty(), stderr=Tty()) is Format.plain


class AsciiTty(Tty):
    encoding = "ascii"  # PYTHONIOENCODING=ascii, or a C locale without Python's UTF-8 mode


def test_auto_is_plain_on_a_terminal_that_cannot_take_the_panels_characters(monkeypatch):
    """The live panel's `·` went to an ASCII terminal as `\\xb7`, three columns wider than Rich had laid the row out:
    rows wrapped and every redraw left the last frame's top on the screen."""
    monkeypatch.delenv("TERM", raising=False)
    assert resolve_format("auto", stdout=AsciiTty(), stderr=Tty()) is Format.plain
    assert resolve_format("auto", stdout=Tty(), stderr=AsciiTty()) is Format.plain
    assert resolve_format("rich", stdout=AsciiTty(), stderr=AsciiTty()) is Format.rich  # asked for: as asked


@pytest.mark.parametrize("fmt", [Format.plain, Format.json, Format.rich])
def test_data_goes_to_stdout_and_messages_to_stderr(fmt):
    out, stdout, stderr = sink(fmt)
    out.info("loading [model]")
    out.warning("odd key [x]")
    out.event({"kind": "session_admitted", "session_id": "a"}, "admitted a")
    out.result({"kind": "thing", "value": 1}, lambda plain: "value 1")
    out.error("it broke [badly]", "fix it", exit_code=2)
    if fmt is Format.json:
        lines = [json.loads(line) for line in stdout.getvalue().splitlines()]
        assert [line["kind"] for line in lines] == ["session_admitted", "thing", "error"]
        assert lines[2]["exit_code"] == 2 and lines[2]["hint"] == "fix it"
    else:
        assert stdout.getvalue().strip() == "value 1"
    text = stderr.getvalue()
    assert "loading [model]" in text and "odd key [x]" in text  # user text is never read as markup
    assert "Error: it broke [badly]" in text and "hint: fix it" in text
    assert ("admitted a" in text) == (fmt is Format.plain)


def test_plain_has_no_escape_codes_even_with_tables():
    from rich.table import Table

    out, stdout, stderr = sink(Format.plain)
    table = Table("a", "b", box=None)  # as the command tables are: no border to end a line
    table.add_row("[bold]1[/bold]", "2")
    table.add_row("3", "a much longer cell")
    out.result({}, lambda plain: table)
    out.warning("w")
    assert not ESC.search(stdout.getvalue() + stderr.getvalue())
    lines = stdout.getvalue().splitlines()
    assert "2" in lines[-2] and "a much longer cell" in lines[-1]
    assert [line for line in lines if line != line.rstrip()] == []  # no cell padding at line ends (diff, grep $)


@pytest.mark.parametrize("fmt", [Format.plain, Format.rich])
def test_control_characters_in_messages_are_shown_not_sent_to_the_terminal(fmt):
    out, _, stderr = sink(fmt)
    out.error("data/ev\x1b[31mil\x07/step_000001.safetensors: bad", None)
    out.warning("tab\tand\nnewline")  # one line a record: a newline in a quoted path made a line of its own
    out.info("writing runs/a\nhint: x")  # a progress line quotes the user's paths too: `--out $'a\nhint: x'`
    text = stderr.getvalue()
    assert "data/ev\\x1b[31mil\\x07/step_000001.safetensors" in text
    assert "\x07" not in text and ("\x1b" not in text if fmt is Format.plain else True)
    assert "and\\x0anewline" in text and "writing runs/a\\x0ahint: x" in text
    # and a tab as \x09, as other control characters: it read as spaces (Rich expands it) or split a tab-cut line
    assert "tab\\x09and" in text and "\t" not in text
    out.warning("del\x7f csi\x9b2J")  # DEL, and C1's one-byte CSI, which some terminals obey as ESC [ does
    assert "del\\x7f csi\\x9b2J" in stderr.getvalue()
    out.error("line\u2028paragraph\u2029nel\x85", "vt\x0bff\x0cfs\x1c")  # what str.splitlines() splits at
    assert "line\\u2028paragraph\\u2029nel\\x85" in stderr.getvalue() and "vt\\x0bff\\x0cfs\\x1c" in stderr.getvalue()
    assert len(stderr.getvalue().splitlines()) == stderr.getvalue().count("\n")


@pytest.mark.parametrize("fmt", [Format.plain, Format.rich])
def test_lone_surrogates_in_messages_are_shown_as_the_bytes_they_stand_for(fmt):
    """A byte of a name the locale could not decode is a lone surrogate in Python (``caf\\udce9``): every line writes
    it ``\\xe9``, the byte a hint's ``$'caf\\xe9'`` names; another lone surrogate (JSON's ``\\ud800``) ``\\ud800``."""
    out, _, stderr = sink(fmt)
    out.error("caf\udce9 already holds a run", "x\udcc3\udca9 y\ud800")
    out.warning("writing caf\udce9")
    assert "caf\\xe9 already holds a run" in stderr.getvalue() and "x\\xc3\\xa9 y\\ud800" in stderr.getvalue()
    assert "writing caf\\xe9" in stderr.getvalue() and stderr.getvalue().isascii()


@pytest.mark.parametrize("fmt", [Format.plain, Format.rich])
def test_emoji_codes_in_names_are_shown_as_written(fmt):
    """Rich replaced ``:name:`` with its emoji: an error naming data/arm:robot:1/step_000003.safetensors (a colon is
    legal in a Linux file name) read "data/arm🤖1/...", a path the user could neither find nor paste; the summary's
    outputs line and the results table likewise."""
    out, stdout, stderr = sink(fmt)
    out.error("data/arm:robot:1/step_000003.safetensors: bad", "see :warning: here")
    out.result({}, lambda plain: "outputs: runs/a:fire:b (results.jsonl)")
    assert "data/arm:robot:1/step_000003.safetensors" in stderr.getvalue() and ":warning:" in stderr.getvalue()
    assert "runs/a:fire:b" in stdout.getvalue()


def test_quiet_keeps_data_and_errors_only():
    out, stdout, stderr = sink(Format.plain, quiet=True)
    out.info("progress")
    out.warning("warn")
    out.event({"kind": "x"}, "event line")
    out.result({}, lambda plain: "data")
    out.error("bad")
    assert stdout.getvalue() == "data\n"
    assert stderr.getvalue() == "Error: bad\n"


def test_quiet_holds_what_code_prints_for_an_error_and_only_its_last_64_kib():
    """Under --quiet what a pipeline prints (through ``chatter_to_stderr``) waits for an error; a run that prints on
    and on (`--follow` for days) keeps its last 64 Ki characters (README), the end of one long write included."""
    kept = 64 * 1024
    out, stdout, stderr = sink(Format.plain, quiet=True)
    with out.chatter_to_stderr():
        print("first")
        assert stderr.getvalue() == ""
        out.error("bad")
        print("a" * 10 + "b" * kept, end="")  # one write longer than what is kept: its end stays
        sys.stderr.write("c\n")
        out.error("worse")
    assert stdout.getvalue() == ""
    dropped = 10 + 2  # the a's, and the b's that made room for "c\n"
    assert stderr.getvalue() == ("first\nError: bad\n"
                                 f"({dropped} earlier characters of what the code printed are left out: --quiet "
                                 f"keeps the last {kept})\n" + "b" * (kept - 2) + "c\nError: worse\n")


def test_quiet_holds_a_line_redrawn_with_a_carriage_return_as_it_shows():
    """A progress bar's redraws (\\r) are held as their last state, as a terminal shows them, across writes: they
    filled the 64 Ki characters kept. A Windows line end stays, and a line that never ends is kept as it comes."""
    out, _, stderr = sink(Format.plain, quiet=True)
    with out.chatter_to_stderr():
        print("cause")
        for i in range(3):
            sys.stderr.write(f"\r{i}/2")
        sys.stderr.write("\n")
        sys.stdout.write("a\r\nhalf\r")
        sys.stdout.write("done")
        for _ in range(5000):
            sys.stdout.write(".")
        out.error("bad")
    assert stderr.getvalue() == "cause\n2/2\na\r\ndone" + "." * 5000 + "\nError: bad\n"


WINDOWS_LINE_ABOVE_THE_DISPLAY = r"""
import io, os, pty, re, sys, threading
from rich.text import Text
from ardiff_cli.output import Format, Output

{terminal}

with out.chatter_to_stderr():
    with out.live(lambda: Text("frame")):
        sys.stdout.write("a windows line\r\r\n")
        print("the line after")
{shown}print([line.strip() for line in text.replace("\r", "\n").split("\n") if "line" in line])
"""


def test_a_line_ending_in_two_carriage_returns_keeps_its_text_under_quiet_and_above_the_live_display(tmp_path):
    """A line ending in \\r\\r\\n (a Windows tool's \\r\\n written through a Windows text stream; a log of it that a
    pipeline prints as it is) was read as redrawn by its second \\r, with nothing: --quiet held \\r\\r\\n alone and
    the live display showed an empty line, the line's text lost. The returns that end a line are its end."""
    out, _, stderr = sink(Format.plain, quiet=True)
    with out.chatter_to_stderr():
        sys.stdout.write("weights not found\r\r\n")
        sys.stdout.write("50%\r")
        sys.stdout.write("100%\r")
        sys.stdout.write("\r\n")  # a bar's last state, ended so
        out.error("bad")
    assert stderr.getvalue() == "weights not found\r\r\n100%\r\r\nError: bad\n"
    assert on_a_terminal(tmp_path, WINDOWS_LINE_ABOVE_THE_DISPLAY) == ["a windows line", "the line after"]


def test_quiet_draws_no_live_panel_and_a_failing_stderr_loses_the_panel_not_the_command():
    """--quiet in rich format silences the live panel too; a stderr that fails (its disk full) drops the panel and
    the progress lines, never the command: its result still reaches stdout and its warnings are still listed."""
    import errno

    out, stdout, stderr = sink(Format.rich, quiet=True)
    with out.live(lambda: "FRAME"):
        out.info("progress")
    out.result({}, lambda plain: "data")
    assert (stdout.getvalue(), stderr.getvalue()) == ("data\n", "")

    class Full(Tty):  # a terminal: the live display draws (and fails) from its start
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    stdout = io.StringIO()
    out = Output(Format.rich, stdout=stdout, stderr=Full())
    with out.live(lambda: "FRAME"):
        out.info("progress")
        out.warning("odd key")
    out.result({}, lambda plain: "data")
    assert stdout.getvalue() == "data\n" and out.warnings == ["odd key"]


def test_json_lines_carry_numpy_scalars_as_numbers_and_never_nan():
    """A result's numbers may be numpy scalars: they are JSON numbers, not strings; NaN is not JSON (a reader's
    json.loads of the line would fail), so it never reaches stdout."""
    from pathlib import Path

    import numpy as np

    out, stdout, _ = sink(Format.json)
    out.json({"ms": np.float32(0.5), "pages": np.int64(3), "shape": (1, None), "path": Path("a")})
    assert json.loads(stdout.getvalue()) == {"ms": 0.5, "pages": 3, "shape": [1, None], "path": "a"}
    with pytest.raises(ValueError):
        out.json({"loss": float("nan")})
    assert stdout.getvalue().count("\n") == 1


def test_plain_tables_are_never_cut_narrower_than_40_columns(monkeypatch):
    """A tiny $COLUMNS (a narrow pane, a script's setting) does not split a plain table's rows into pieces."""
    from rich.table import Table

    monkeypatch.setenv("COLUMNS", "10")
    out, stdout, _ = sink(Format.plain)
    table = Table("name", "value", box=None)
    table.add_row("page_size", "16 tokens")
    out.result({}, lambda plain: table)
    assert stdout.getvalue().splitlines()[-1].split() == ["page_size", "16", "tokens"]


def test_rich_respects_no_color(monkeypatch):
    """On a colour terminal the rich format colours 'Error:' and 'hint:'; NO_COLOR takes the colours away (bold
    may stay: NO_COLOR is about colour). The streams are terminals from the start, as Rich picks its colours
    when the console is made (forcing a terminal afterwards left it colourless with or without NO_COLOR)."""
    colour = re.compile(r"\x1b\[(?:[0-9]+;)*(?:3[0-9]|9[0-7])(?:;[0-9]+)*m")  # an SGR that sets a foreground colour
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    said = {}
    for no_color in ("", "1"):
        monkeypatch.setenv("NO_COLOR", no_color)  # Rich reads an empty NO_COLOR as unset
        stderr = Tty()
        Output(Format.rich, stdout=Tty(), stderr=stderr).error("bad", "hint")
        said[no_color] = stderr.getvalue()
    assert colour.search(said[""]), said  # the control: colours where NO_COLOR is not set
    assert not colour.search(said["1"]), said
    assert re.sub(r"\x1b\[[0-9;]*m", "", said["1"]) == "Error: bad\nhint: hint\n", said


@pytest.mark.parametrize(("exc", "code"), [
    (ConfigError("c"), 2), (CheckpointError("k"), 2), (ObservationError("o"), 2), (CapacityError("m"), 3),
    (EpisodesFailed("e"), 4), (Interrupted(signal.SIGINT), 130), (Interrupted(signal.SIGTERM), 143),
    (KeyboardInterrupt(), 130), (RuntimeError("bug"), 1),
    (EpisodesFailed("every episode failed", exit_code=2), 2),  # a run whose episodes all failed: their errors' code
    (RuntimeError("CUDA error: out of memory"), 3),  # the CUDA allocator says so in a plain RuntimeError
])
def test_exit_code_table(exc, code):
    assert exit_code_for(exc) == code


def test_a_failed_step_names_its_episode_step_and_file_and_takes_its_causes_exit_code_and_hint():
    """A failed step's message says which episode, step and file; its exit code and hint are its cause's (a bad
    step file: 2 and the file's hint), else 1 and where to look; a write that failed says how to continue."""
    from ardiff_cli.errors_cli import StepFailed, report

    cause = ObservationError("'rgb': expected (H, W, 3), got (3, 64, 64)", hint="see the episode format")
    load = StepFailed("arm_a", 3, "load", cause, path="eps/arm_a/step_000003.safetensors")
    assert str(load) == ("episode 'arm_a' failed at step 3 while reading eps/arm_a/step_000003.safetensors: "
                         "'rgb': expected (H, W, 3), got (3, 64, 64)")
    assert (exit_code_for(load), load.hint) == (2, "see the episode format")
    forward = StepFailed("arm_b", 0, "forward", ValueError("shape mismatch"))
    assert exit_code_for(forward) == 1 and "fix the pipeline" in forward.hint
    write = StepFailed("arm_c", 1, "write", OSError(28, "No space left on device"))
    assert "ardiff rollout --resume --out OUT" in write.hint
    # an error without a hint of its own gets its table row's; Ctrl-C's JSON error object has the exit code too
    out, stdout, stderr = sink(Format.json)
    assert report(out, ObservationError("step_000000.safetensors: no field 'rgb'")) == 2
    assert report(out, KeyboardInterrupt()) == 130
    assert "hint: see the episode format: ardiff rollout --help" in stderr.getvalue()
    errors = [json.loads(line) for line in stdout.getvalue().splitlines()]
    assert [(e["kind"], e["exit_code"]) for e in errors] == [("observation_error", 2), ("interrupted", 130)]


@pytest.mark.parametrize("fmt", [Format.plain, Format.json, Format.rich])
def test_an_errors_notes_are_indented_lines_after_it_and_a_list_in_its_json_object(fmt):
    """An exception's notes (PEP 678: a close hook that failed too, as the warmup then released its session) showed
    only in --verbose's traceback: each is an indented `note:` line between the Error and hint lines, one line, its
    control characters written \\xNN as the Error line's; JSON's error object lists them in `notes`, as given. An
    error without notes has no `notes` key, as before; a bug's notes show too."""
    out, stdout, stderr = sink(fmt)
    error = PipelineError("warmup request 'w1' failed", hint="fix the pipeline")
    error.add_note("W.close_ar_diffusion_session('__ardiff_warmup__') raised KeyError: 'x'")
    error.add_note("a second\nline, and \x1b[31mred")
    with pytest.raises(typer.Exit) as info, handle_errors(out):
        raise error
    assert info.value.exit_code == 1
    with pytest.raises(typer.Exit), handle_errors(out):
        raise CapacityError("one session needs 2 GiB")
    bug = ValueError("oops")
    bug.add_note("while reading the step")
    with pytest.raises(typer.Exit), handle_errors(out):
        raise bug
    text = stderr.getvalue()
    assert ("Error: warmup request 'w1' failed\n"
            "  note: W.close_ar_diffusion_session('__ardiff_warmup__') raised KeyError: 'x'\n"
            "  note: a second\\x0aline, and \\x1b[31mred\n"
            "hint: fix the pipeline\n") in text, text
    assert "Error: one session needs 2 GiB\nhint: " in text and "Error: unexpected ValueError: oops\n" \
        "  note: while reading the step\nhint: this is a bug" in text, text
    assert "\x1b" not in text if fmt is not Format.rich else text.count("\x1b[31mred") == 0
    if fmt is Format.json:
        errors = [json.loads(line) for line in stdout.getvalue().splitlines()]
        assert [e.get("notes") for e in errors] == [
            ["W.close_ar_diffusion_session('__ardiff_warmup__') raised KeyError: 'x'",
             "a second\nline, and \x1b[31mred"], None, ["while reading the step"]], errors
    error.__notes__ = "not a list"  # a plain attribute: what Python's traceback prints, its repr
    out, _, stderr = sink(Format.plain)
    with pytest.raises(typer.Exit), handle_errors(out):
        raise error
    assert "Error: warmup request 'w1' failed\n  note: 'not a list'\nhint: " in stderr.getvalue()


def test_handle_errors_hint_traceback_only_with_verbose_and_always_for_bugs():
    out, _, stderr = sink(Format.plain)
    with pytest.raises(typer.Exit) as info, handle_errors(out):
        raise CapacityError("one session needs 2 GiB", hint="use a smaller window")
    assert info.value.exit_code == 3
    assert stderr.getvalue() == "Error: one session needs 2 GiB\nhint: use a smaller window\n"
    out, _, stderr = sink(Format.plain, verbose=True)
    with pytest.raises(typer.Exit), handle_errors(out):
        raise ConfigError("bad key")
    assert "Traceback" in stderr.getvalue()
    out, _, stderr = sink(Format.plain)
    with pytest.raises(typer.Exit) as info, handle_errors(out):
        raise ZeroDivisionError("oops")
    assert info.value.exit_code == 1
    assert "Traceback" in stderr.getvalue() and "this is a bug" in stderr.getvalue()


def _warn_twice_and_from_a_thread() -> int:
    """A library's UserWarning, twice from one place, once from a thread; ardiff's own; the first's line number."""
    import warnings

    from ardiff_cli.runtime.errors import ArdiffWarning

    for _ in range(2):
        warnings.warn("a library says so", UserWarning)
    thread = threading.Thread(target=lambda: warnings.warn("a thread says so", RuntimeWarning))
    thread.start()
    thread.join()
    warnings.warn("ardiff says so", ArdiffWarning)
    source, first = inspect.getsourcelines(_warn_twice_and_from_a_thread)
    return first + next(i for i, text in enumerate(source) if '"a library says so"' in text)


@contextlib.contextmanager
def _filtered(action: str):
    """Python's warning filters set to ``action`` as -W or PYTHONWARNINGS set them: before the command runs."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter(action)
        yield


@pytest.mark.parametrize("fmt", [Format.plain, Format.json, Format.rich])
def test_a_warning_that_is_not_ardiffs_is_a_warning_line_named_by_its_category_and_listed_once(fmt):
    """A library's or a pipeline's warning (torch's UserWarning, say) went to stderr as Python writes it, and a result's
    `warnings` (`warmup --format json`) never listed it. It is a `warning:` line now, as Python's first line writes
    it (where, its category), once as Python's default filter shows it, from any thread, and listed."""
    out, stdout, stderr = sink(fmt)
    with _filtered("default"), handle_errors(out):  # Python's own: once per place (pytest's may differ)
        line = _warn_twice_and_from_a_thread()
    assert out.warnings == [f"{__file__}:{line}: UserWarning: a library says so",
                            f"{__file__}:{line + 1}: RuntimeWarning: a thread says so", "ardiff says so"]
    assert stderr.getvalue() == "".join(f"warning: {w}\n" for w in out.warnings) and stdout.getvalue() == ""


def test_a_warning_that_is_not_ardiffs_is_held_under_quiet_and_the_users_filters_decide():
    """--quiet holds a library's warning as it holds what that code prints, for an error's report (it may explain
    it), and writes nothing when all goes well; ardiff's own is silenced. A filter that ignores a warning leaves it
    out; one that makes it an error raises it where it was issued."""
    out, _, stderr = sink(Format.plain, quiet=True)
    with _filtered("default"), handle_errors(out):
        line = _warn_twice_and_from_a_thread()
    assert len(out.warnings) == 3 and stderr.getvalue() == ""
    out, _, stderr = sink(Format.plain, quiet=True)
    with pytest.raises(typer.Exit), _filtered("default"), handle_errors(out):
        _warn_twice_and_from_a_thread()
        raise ConfigError("bad key", hint="fix it")
    assert stderr.getvalue() == (f"warning: {__file__}:{line}: UserWarning: a library says so\n"
                                 f"warning: {__file__}:{line + 1}: RuntimeWarning: a thread says so\n"
                                 "Error: bad key\nhint: fix it\n")
    out, _, stderr = sink(Format.plain)
    with _filtered("ignore"), handle_errors(out):
        _warn_twice_and_from_a_thread()
    assert out.warnings == ["ardiff says so"]  # ardiff's own, whatever the filters say
    with pytest.raises(typer.Exit) as info, _filtered("error"), handle_errors(out):
        _warn_twice_and_from_a_thread()
    assert info.value.exit_code == 1 and "Error: unexpected UserWarning: a library says so" in stderr.getvalue()


def test_signal_inside_a_critical_section_waits_for_its_end():
    with StopSignals() as signals:
        written = []
        with pytest.raises(Interrupted) as info:
            with signals.critical():
                signal.raise_signal(signal.SIGTERM)
                written.append("whole write")
        assert written == ["whole write"] and info.value.exit_code == 143
    with StopSignals(), pytest.raises(Interrupted) as info:
        signal.raise_signal(signal.SIGINT)
    assert info.value.exit_code == 130


def test_the_notice_of_a_first_signal_says_the_step_finishes_and_the_live_panel_says_stopping():
    """What a rollout shows when a first signal lands in a step: a line on stderr that says the step finishes, how
    to stop at once, and the live panel's phase 'stopping'."""
    from ardiff_cli.commands.rollout import _stop_notice
    from ardiff_cli.monitor import RunMonitor

    output, _, stderr = sink(Format.plain)
    monitor = RunMonitor(output, "ardiff rollout · fast.yaml → out")
    monitor.set_phase("running")
    for signum in (signal.SIGINT, signal.SIGTERM):
        _stop_notice(output, monitor)(signum)
    assert stderr.getvalue().splitlines() == [
        "SIGINT: finishing the step in flight, then stopping (Ctrl-C again to stop at once; that step's episode then "
        "replays on --resume)",
        "SIGTERM: finishing the step in flight, then stopping (SIGTERM again to stop at once; that step's episode "
        "then replays on --resume)"]
    console = Console(record=True, width=110, color_system=None, file=io.StringIO())
    console.print(render(monitor.snapshot()))
    assert re.search(r" · \S+ stopping$", console.export_text(), re.M), console.export_text()


@pytest.mark.parametrize("second", [None, "in the step", "as the notice's thread is made", "as the notice starts",
                                    "as the step's end waits"])
def test_the_notice_of_a_first_signal_comes_out_before_the_lines_of_the_stop(monkeypatch, second):
    """The notice ('SIGTERM: finishing the step in flight, then stopping') is shown from a thread of its own: the
    handler interrupted the main thread, which may hold the lock of the panel or of the stream the notice takes.
    When the step held such a lock as the signal came, the main thread went on to stop the run, and its own lines
    ('saving 2 resident sessions for --resume ...') came out before the notice (about 1 run in 10 of a real rollout
    SIGTERMed as its steps ran): a user, and a script reading stderr, read that a step was being finished after the
    run had said it was stopping. Now the step's end waits for the notice. So too when a second signal stops the step
    at once, even one that comes while the handler of the first starts the notice's thread (SIGHUP sent twice, to the
    process group and by a shell): raised there, it left the step unaware of the thread; or as that handler makes the
    thread, before it starts it (SIGINT then SIGTERM while a loaded CI ran the first's handler: no notice at all); and
    one that comes as the step's end waits for the notice (raised at once: it cut that wait short, the thread
    forgotten)."""
    from ardiff_cli.commands.rollout import _stop_notice
    from ardiff_cli.monitor import RunMonitor

    start = threading.Thread.start

    def start_then_signal(thread: threading.Thread) -> None:
        start(thread)
        if thread.name == "ardiff-stop-notice":
            signal.raise_signal(signal.SIGTERM)  # the handler of the first signal has not returned yet

    init = threading.Thread.__init__

    def make_then_signal(thread: threading.Thread, *args, **kwargs) -> None:
        init(thread, *args, **kwargs)
        if thread.name == "ardiff-stop-notice":
            signal.raise_signal(signal.SIGTERM)  # the handler of the first signal has not started the thread yet

    join = threading.Thread.join
    waited: list[threading.Thread] = []

    def signal_then_join(thread: threading.Thread, timeout: float | None = None) -> None:
        if thread.name == "ardiff-stop-notice" and not waited:  # Ctrl-C again as the step's end waits for the notice
            waited.append(thread)
            signal.raise_signal(signal.SIGTERM)  # raised at once (the step is over): it cut that wait short
        join(thread, timeout)

    if second == "as the notice's thread is made":
        monkeypatch.setattr(threading.Thread, "__init__", make_then_signal)
    elif second == "as the notice starts":
        monkeypatch.setattr(threading.Thread, "start", start_then_signal)
    elif second == "as the step's end waits":
        monkeypatch.setattr(threading.Thread, "join", signal_then_join)

    output, _, stderr = sink(Format.plain)
    monitor = RunMonitor(output, "ardiff rollout · fast.yaml → out")
    previous = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # the main thread keeps the GIL while it runs on, as between two of its own lines
    try:
        with StopSignals(notice=_stop_notice(output, monitor)) as signals, pytest.raises(Interrupted) as info:
            try:
                with signals.step():
                    with monitor._lock:  # the step updates the panel (its progress, its sessions) as the signal comes
                        signal.raise_signal(signal.SIGTERM)
                    output.info("the step's line")
                    if second == "in the step":
                        signal.raise_signal(signal.SIGTERM)  # raised at once: the step is cut short
                signals.check()
            finally:
                output.info("saving 2 resident sessions for --resume")  # the stopped run's teardown
    finally:
        sys.setswitchinterval(previous)
    assert info.value.exit_code == 143
    assert stderr.getvalue().splitlines() == [
        # those cut the step as the signal came
        *["the step's line"] * (second not in ("as the notice's thread is made", "as the notice starts")),
        "SIGTERM: finishing the step in flight, then stopping (SIGTERM again to stop at once; that step's episode "
        "then replays on --resume)",
        "saving 2 resident sessions for --resume"]
    assert monitor.snapshot().phase == "stopping"


def test_the_first_signal_in_a_step_lets_it_finish_and_a_second_stops_it_at_once():
    # A signal in a rollout's step cut its forward short: its session held half a step, so the stopped run could not
    # keep it, and --resume replayed its episode.
    noticed = threading.Event()
    notices = []

    def notice(signum: int) -> None:
        notices.append((signum, threading.current_thread() is threading.main_thread()))
        noticed.set()

    with StopSignals(notice=notice) as signals:
        done = []
        with signals.step():
            signal.raise_signal(signal.SIGTERM)
            with signals.critical():  # a write's end inside the step does not raise it either
                done.append("write")
            done.append("rest of the step")
        assert done == ["write", "rest of the step"]
        assert noticed.wait(60) and notices == [(signal.SIGTERM, False)]  # on a thread of its own
        with pytest.raises(Interrupted) as info:
            signals.check()  # the caller's next safe point
        assert info.value.exit_code == 143
    with StopSignals(notice=notice) as signals, pytest.raises(Interrupted) as info:
        with signals.step():
            signal.raise_signal(signal.SIGINT)
            with signals.critical():
                signal.raise_signal(signal.SIGINT)  # a second one never cuts a write either: recorded
                done.append("second write")
            signal.raise_signal(signal.SIGINT)  # and one outside it is raised
            done.append("not reached")
    assert info.value.exit_code == 130 and done[-1] == "second write"
    with StopSignals() as signals, pytest.raises(Interrupted):  # outside a step: at once, as before
        signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize(("first", "second"), [(signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGTERM),
                                               (signal.SIGHUP, signal.SIGTERM)])
def test_a_second_different_signal_as_the_step_waits_for_the_notice_stops_as_the_first(first, second):
    # The second stopped the run at once with its own code: SIGTERM, then Ctrl-C as the step's end waited for the
    # notice of the SIGTERM, exited 130.
    main = threading.main_thread()

    def waiting_for_the_notice() -> bool:
        frame = sys._current_frames().get(main.ident)
        while frame is not None and frame.f_code.co_name != "_noticed":
            frame = frame.f_back
        return frame is not None

    def notice(signum: int) -> None:
        notices.append(signum)
        # A liveness bound: a thread left polling after its test gave up would signal the main thread in a later test
        deadline = time.monotonic() + 60
        while not waiting_for_the_notice():  # the main thread has left the step and waits for this thread
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)
        signal.pthread_kill(main.ident, second)  # to the main thread: it cuts that wait short

    notices: list[int] = []
    with StopSignals(notice=notice) as signals, pytest.raises(Interrupted) as info:
        with signals.step():
            signal.raise_signal(first)
    assert info.value.exit_code == 128 + first and notices == [first]


def test_a_signal_during_an_import_is_raised_at_the_next_check_not_inside_the_import(tmp_path, monkeypatch):
    # Raised inside an import, it left the module half-imported (torch's numpy: "module 'numpy' has no attribute
    # 'void'" later) or was caught by the import machinery's and libraries' error handling around it.
    (tmp_path / "interrupted_module.py").write_text(
        "import signal, time\nsignal.raise_signal(signal.SIGTERM)\ntime.sleep(0.01)\nWHOLE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with StopSignals() as signals:
        import interrupted_module

        assert interrupted_module.WHOLE
        with pytest.raises(Interrupted) as info:
            signals.check()
    assert info.value.exit_code == 143


def test_a_stop_caught_on_its_way_out_is_raised_again_at_the_next_check():
    # A pipeline's (or a library's) `except Exception` caught the Interrupted the handler raised: the run went on,
    # and, the handler stopping only once, no later signal could stop it.
    with StopSignals() as signals:
        try:
            signal.raise_signal(signal.SIGINT)
        except Exception as exc:  # noqa: BLE001 - the catch-all under test
            caught = exc
        assert isinstance(caught, Interrupted)
        with pytest.raises(Interrupted) as info:
            signals.check()
        assert info.value.exit_code == 130
        wrapped = RuntimeError("the pipeline's own error")
        assert isinstance(signals.outcome(wrapped), Interrupted) and signals.outcome(caught) is caught
    with StopSignals() as signals:  # no signal: nothing raised, and an error stays itself
        signals.check()
        assert signals.outcome(wrapped) is wrapped
    # leaving the block with an error after a caught stop: the stop is what ended it (--verbose shows the error)
    with pytest.raises(Interrupted) as info, StopSignals():
        try:
            signal.raise_signal(signal.SIGTERM)
        except Exception:  # noqa: BLE001 - the catch-all under test
            pass
        raise wrapped
    assert info.value.exit_code == 143 and info.value.__cause__ is wrapped
    with pytest.raises(RuntimeError), StopSignals():  # and without one, the error itself
        raise wrapped


SNAPSHOT = Snapshot(
    title="ardiff rollout · dreamzero-tiny", phase="running", device="cpu", dtype="float32", budget_bytes=3 << 20,
    available_bytes=8 << 30, page_size=16, bytes_per_page=8192, pages_used=18, pages_total=36, session_capacity=2,
    sessions=(SessionRow("demo_2", 2, 7, {"positive": 3, "negative": 3}, 65536, 0.04),
              SessionRow("demo_1", 4, 5, {"positive": 4, "negative": 4}, 65536, 0.0321)),
    events=(EventRow(0.41, "admitted", "demo_2", ""), EventRow(0.412, "evicted", "demo_0", "lru_eviction (by demo_2)")),
    steps_done=12, steps_total=18, evictions=3, steps_replayed=4, elapsed_s=2.0)


def test_the_progress_line_counts_failures_shows_hours_and_minutes_and_no_eta_once_all_steps_ran():
    """A long run's clock reads 1:15:00 (not 1:75:00), failed steps are counted, a run whose steps all ran shows no
    ETA; exactly SESSION_ROWS sessions leave no "… and 0 more" line; swapping on shows its row before anything is
    swapped out."""
    from dataclasses import replace

    from ardiff_cli.panels import SESSION_ROWS

    rows = tuple(SessionRow(f"demo_{i}", 1, 5, {"positive": 1}, 0, None) for i in range(SESSION_ROWS))
    console = Console(record=True, width=110, height=200, color_system=None, file=io.StringIO())
    console.print(render(replace(SNAPSHOT, steps_done=18, steps_failed=2, elapsed_s=4500.0, sessions=rows,
                                 session_capacity=SESSION_ROWS, swap_budget_bytes=1 << 20)))
    text = console.export_text()
    progress = text.splitlines()[-1]
    assert "18/18 steps" in progress and "2 failed" in progress and "1:15:00" in progress, progress
    assert "ETA" not in progress and "more" not in text and "0 out, 0 B of 1.00 MiB" in text, text


def test_the_pages_column_tells_apart_branches_whose_names_start_alike():
    """A pipeline of three CFG branches, cond_text, cond_image and uncond: the pages read "con:3 con:0 unc:3", which
    "con" held no pages? Each name is cut only as far as it stays apart from its session's other branches."""
    from dataclasses import replace

    rows = (SessionRow("arm_a", 2, 7, {"cond_text": 3, "cond_image": 0, "uncond": 3}, 65536, 0.04),
            SessionRow("arm_b", 2, 7, {"positive": 3, "negative": 3}, 65536, 0.04))
    console = Console(record=True, width=110, color_system=None, file=io.StringIO())
    console.print(render(replace(SNAPSHOT, sessions=rows)))
    text = console.export_text()
    assert "cond_t:3 cond_i:0 unc:3" in text and "pos:3 neg:3" in text, text


def test_live_layout_shows_swapped_sessions_and_restores():
    from dataclasses import replace

    console = Console(record=True, width=110, color_system=None, file=io.StringIO())
    console.print(render(replace(SNAPSHOT, restores=5, swapped=1, swapped_bytes=200_786, swap_budget_bytes=3 << 20,
                                 events=(EventRow(0.5, "restored", "demo_1", "from its swap snapshot (196.08 KiB)"),))))
    text = console.export_text()
    for expected in ("swap", "1 out, 196.08 KiB of 3.00 MiB", "5 restored", "restored", "from its swap snapshot"):
        assert expected in text, expected
    off = Console(record=True, width=110, color_system=None, file=io.StringIO())
    off.print(render(SNAPSHOT))  # swapping off: no swap row, no restores
    assert " out, " not in off.export_text() and "restored" not in off.export_text()


def test_the_live_rate_counts_the_steps_time_not_the_teardown_of_a_stopped_run(monkeypatch):
    """A stopped run swaps its resident sessions out and closes its engine before its phase becomes "interrupted":
    the last frame's steps/s counted that teardown too, below the summary's rate of the same steps (27.0 against
    40.1). The counted time ends where the steps end (``end_counting``), as the summary's does."""
    import types

    import ardiff_cli.monitor as monitor_module
    from fake_clock import FakeClock

    clock = FakeClock()
    monkeypatch.setattr(monitor_module, "time", types.SimpleNamespace(monotonic=clock, time=time.time))
    output, _, _ = sink(Format.plain)
    monitor = monitor_module.RunMonitor(output, "test")
    clock.now = 3.0  # loading and warmup: not counted
    monitor.set_phase("running")
    clock.now = 5.0
    monitor.end_counting()  # the steps are over
    clock.now = 12.0  # the teardown: sessions swapped out, the engine closed
    monitor.set_phase("interrupted")
    assert monitor.snapshot().counting_s == 2.0
    monitor.end_counting()  # once ended, it stays ended
    assert monitor.snapshot().counting_s == 2.0


def test_the_live_eviction_count_leaves_out_the_sessions_a_stopped_run_swaps_out():
    # A run stopped by a signal swaps its resident sessions out to keep them (session_evicted, reason run_stopped;
    # explicit from runner.swap_out_sessions called without a reason): the panel's count, like summary.json's
    # evictions_this_run, is of LRU evictions.
    from ardiff_cli.monitor import RunMonitor
    from ardiff_cli.runtime.events import SessionEvicted

    output, _, err = sink(Format.plain)
    monitor = RunMonitor(output, "test")
    monitor.on_event(SessionEvicted(session_id="a", by_session_id="b", swapped=True, swap_bytes=2048))
    monitor.on_event(SessionEvicted(session_id="b", reason="run_stopped", swapped=True, swap_bytes=2048))
    monitor.on_event(SessionEvicted(session_id="c", reason="explicit", swapped=True, swap_bytes=2048))
    assert monitor.snapshot().evictions == 1
    assert re.search(r"evicted +b run_stopped, swapped out \(2\.00 KiB\)", err.getvalue()), err.getvalue()


def test_a_closed_sessions_error_is_one_line_of_its_event_line():
    # rollout's episode_failed close carries its failed line's error, whose message may run over several lines: the
    # event line (plain, and the events panel's row) shows its first, as the failed line's own log row does.
    from ardiff_cli.monitor import RunMonitor
    from ardiff_cli.runtime.events import SessionClosed

    output, _, err = sink(Format.plain)
    monitor = RunMonitor(output, "test")
    monitor.on_event(SessionClosed(session_id="a", reason="episode_failed", error="step 3: bad file\nnote: more"))
    assert re.search(r"closed +a episode_failed: step 3: bad file\n$", err.getvalue()), err.getvalue()
    assert monitor.snapshot().events[-1].detail == "episode_failed: step 3: bad file"


def test_the_monitor_counts_and_describes_every_kind_of_event_and_echoes_what_each_format_shows():
    """The live panel's counters and event log, and the plain lines, say what happened with its numbers: restores
    counted, swap and restore sizes and times, who evicted whom, a warmup that did not restore its pool; the plan
    and per-request timings stay out of the log, and json carries every request while plain echoes them only
    where asked (warmup)."""
    from ardiff_cli.monitor import RunMonitor
    from ardiff_cli.runtime import events

    output, _, err = sink(Format.plain)
    monitor = RunMonitor(output, "test")
    t0 = monitor._t0
    monitor.on_event(events.SessionEvicted(session_id="a", by_session_id="b", time=t0 + 1.5))
    monitor.on_event(events.SessionRestored(session_id="a", swap_bytes=4096, seconds=0.0125))
    monitor.on_event(events.SwapFailed(session_id="c", error="disk full"))
    monitor.on_event(events.WarmupFinished(num_requests=3, seconds=0.5, restored=False))
    monitor.on_event(events.RequestFinished(request_id="r1", session_id="a", bind_s=0, forward_s=0, commit_s=0,
                                            total_s=0.25))
    monitor.log("episode", "a", "done", echo=False)
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("+   1.500s evicted") and lines[0].endswith("a lru_eviction (by b)"), lines
    assert lines[1].endswith("a from its swap snapshot (4.00 KiB) in 12.5 ms"), lines
    assert lines[2].endswith("c snapshot lost: disk full"), lines
    assert lines[3].endswith("3 requests in 0.500s, POOL NOT RESTORED"), lines
    assert len(lines) == 4  # the request is not echoed in a rollout; the logged episode was not to be
    snapshot = monitor.snapshot()
    assert (snapshot.evictions, snapshot.restores) == (1, 1)
    assert [e.kind for e in snapshot.events] == ["evicted", "restored", "swap_failed", "warmup", "episode"]
    for i in range(10):
        monitor.log("episode", f"e{i}", "done", echo=False)
    assert [e.session_id for e in monitor.snapshot().events] == [f"e{i}" for i in range(2, 10)]  # the newest 8

    output, stdout, err = sink(Format.json)
    monitor = RunMonitor(output, "test")
    monitor.on_event(events.RequestFinished(request_id="r1", session_id="a", bind_s=0, forward_s=0, commit_s=0,
                                            total_s=0.25))
    assert json.loads(stdout.getvalue())["request_id"] == "r1" and monitor.snapshot().events == ()
    output, _, err = sink(Format.plain)
    monitor = RunMonitor(output, "warmup", echo_requests=True, noun="request")
    monitor.on_event(events.RequestFinished(request_id="r1", session_id="a", bind_s=0, forward_s=0, commit_s=0,
                                            total_s=0.25))
    assert err.getvalue().rstrip().endswith("request     a r1 250.0 ms"), err.getvalue()


def test_the_monitor_shows_a_real_runners_plan_pages_and_sessions_with_their_episodes_progress():
    """The capacity panel's plan and page counts and the sessions panel's rows come from the runner: an episode's
    steps are its own count of its episode (done/total), a session without one shows its requests; the plan is in
    the panel, not in the event log."""
    from tiny_pipeline import TinyPipeline, request

    from ardiff_cli.monitor import RunMonitor
    from ardiff_cli.runtime.runner import ARDiffusionModelRunner

    monitor = RunMonitor(sink(Format.plain)[0], "test")
    runner = ARDiffusionModelRunner(TinyPipeline(), memory_budget=64 << 20, session_capacity=2)
    runner.subscribe(monitor.on_event)
    runner.load()
    for step in range(2):
        runner.execute_model(request("ep_a", step))
    runner.execute_model(request("ep_b", 0))
    monitor.set_episode("ep_a", 2, 6)
    monitor.refresh(runner)
    snapshot, usage = monitor.snapshot(), runner.pool_usage()
    assert snapshot.session_capacity == 2 and snapshot.attention == "torch"
    assert (snapshot.pages_used, snapshot.pages_total) == (usage.num_used, usage.num_pages)
    assert 0 < usage.num_used < usage.num_pages
    assert [(r.session_id, r.steps_done, r.steps_total) for r in snapshot.sessions] == [("ep_a", 2, 6),
                                                                                         ("ep_b", 1, None)]
    assert "planned" not in [e.kind for e in snapshot.events]


def test_the_sessions_and_pages_follow_every_admission_eviction_and_close_not_only_the_next_refresh():
    """The views were read only after a step: while the next one ran (seconds with a large model), the sessions panel
    showed the session just evicted as resident, beside the event saying it was evicted, and the newly admitted one
    not at all; a stopped run's last frame kept the sessions it had swapped out, and warmup never showed its own."""
    from tiny_pipeline import TinyPipeline, request

    from ardiff_cli.monitor import RunMonitor
    from ardiff_cli.runtime.runner import ARDiffusionModelRunner

    monitor = RunMonitor(sink(Format.plain)[0], "test")
    runner = ARDiffusionModelRunner(TinyPipeline(), memory_budget=64 << 20, session_capacity=1)
    runner.subscribe(monitor.on_event)
    runner.load()
    monitor.refresh(runner)  # once, after the load, as the commands do
    seen = []
    runner.subscribe(lambda event: seen.append((event.kind, [r.session_id for r in monitor.snapshot().sessions],
                                                monitor.snapshot().pages_used)))
    runner.execute_model(request("ep_a", 0))
    runner.execute_model(request("ep_b", 0))  # evicts ep_a
    runner.close_session("ep_b")
    # each as the runner's table stood when the event was delivered (after the request that caused it)
    assert [(kind, ids) for kind, ids, _ in seen if kind != "request_finished"] == [
        ("session_admitted", ["ep_a"]), ("session_evicted", ["ep_b"]), ("session_admitted", ["ep_b"]),
        ("session_closed", [])], seen
    assert seen[-1][2] == 0, seen  # the closed session's pages are free


def test_a_block_that_fails_leaves_the_last_frame_saying_failed_and_the_rate_of_its_first_counted_phase():
    from ardiff_cli.monitor import RunMonitor

    monitor = RunMonitor(sink(Format.plain)[0], "test")
    monitor.set_phase("running")
    since = monitor._counted_since
    monitor.set_phase("following")  # still the counted work: its rate is over both phases
    assert monitor._counted_since == since
    with pytest.raises(ValueError), monitor.ending():
        raise ValueError("the pipeline failed")
    assert monitor.snapshot().phase == "failed"


def test_live_layout_renders_every_panel():
    console = Console(record=True, width=110, color_system=None, file=io.StringIO())
    console.print(render(SNAPSHOT))
    text = console.export_text()
    for expected in ("capacity", "cpu · float32", "3.00 MiB of 8.00 GiB", "16 tokens · 8.00 KiB", "18/36, 18 free",
                     "2/2 resident", "sessions (least recently used first)", "pos:3 neg:3", "64.00 KiB", "32 ms",
                     "events", "evicted", "lru_eviction (by demo_2)", "12/18 steps", "6.0 steps/s", "ETA 0:00:01",
                     "3 evictions", "4 replayed"):
        assert expected in text, expected
    assert text.index("demo_2") < text.index("demo_1")  # LRU order kept
    one = Console(record=True, width=110, color_system=None, file=io.StringIO())
    one.print(render(dataclasses.replace(SNAPSHOT, evictions=1)))
    assert "· 1 eviction ·" in one.export_text()  # it said "1 evictions"
    for total, said in [(1, "1/1 step · 1.0 steps/s"), (None, "1 step · 1.0 steps/s")]:  # it said "1/1 steps"
        step = Console(record=True, width=110, color_system=None, file=io.StringIO())
        step.print(render(dataclasses.replace(SNAPSHOT, steps_done=1, steps_total=total, elapsed_s=1.0)))
        assert said in step.export_text(), step.export_text()
    empty = Console(record=True, width=80, file=io.StringIO())
    empty.print(render(Snapshot(title="warmup")))
    text = empty.export_text()
    assert "no events yet" in text and "none" in text and "0/0 resident" in text


def test_the_rate_and_eta_are_of_the_counted_phase_and_the_noun_is_the_commands():
    """The rate was steps over the whole run, the model's load and warmup included: a 14B model loading for
    minutes showed a fraction of the real rate and an ETA many times too long. It is of the counted phase (running
    or following; warmup's own requests for warmup), frozen when that phase ends."""
    from dataclasses import replace

    from ardiff_cli.monitor import RunMonitor

    console = Console(record=True, width=110, color_system=None, file=io.StringIO())
    console.print(render(replace(SNAPSHOT, elapsed_s=100.0, counting_s=2.0)))  # 12 steps in 2 s of 100
    assert "12/18 steps · 6.0 steps/s · ETA 0:00:01" in console.export_text()
    console = Console(record=True, width=110, color_system=None, file=io.StringIO())
    console.print(render(replace(SNAPSHOT, noun="request", steps_total=None, elapsed_s=100.0, counting_s=0.5)))
    text = console.export_text()
    assert "12 requests · 24.0 requests/s" in text and re.search(r"session +requests +pages", text)
    assert "steps" not in text

    output, _, _ = sink(Format.plain)
    monitor = RunMonitor(output, "test")
    monitor.set_phase("loading")
    monitor.set_phase("warmup")
    assert monitor.snapshot().counting_s == 0.0  # nothing counted yet: no rate, whatever the time loading took
    monitor.set_phase("running")
    monitor.set_phase("stopping")  # the step in flight still runs: its time counts, as the summary's does
    stopping = monitor.snapshot().counting_s
    time.sleep(0.01)
    monitor.set_phase("interrupted")
    first = monitor.snapshot().counting_s
    assert first > stopping
    time.sleep(0.01)
    monitor.set_phase("done")
    assert monitor.snapshot().counting_s == first  # frozen: the rate stays that of the steps' time
    warmup = RunMonitor(output, "test", noun="request", counted_phases=("warmup",))
    warmup.set_phase("warmup")
    warmup.set_phase("done")
    done = warmup.snapshot()
    assert done.noun == "request" and warmup.snapshot().counting_s == done.counting_s


def test_many_resident_sessions_leave_room_for_the_events_and_the_progress_line():
    """A small model keeps hundreds of sessions resident: a row for each pushed the events and the progress line
    off a 50-line terminal (the live display crops its bottom), and drawing 1,000 rows took 0.4 s a frame, 4 frames
    a second (100 resident sessions: a run at 45 steps/s instead of 95). The 16 least recently used, then a count."""
    from dataclasses import replace

    rows = tuple(SessionRow(f"ep_{i:04d}", 1, 5, {"main": 3}, 0, 0.01) for i in range(1000))
    console = Console(record=True, width=120, height=50, file=io.StringIO())
    console.print(render(replace(SNAPSHOT, sessions=rows, session_capacity=1000)))
    text = console.export_text()
    assert len(text.splitlines()) < 50
    assert "ep_0000" in text and "ep_0015" in text and "ep_0016" not in text and "… and 984 more" in text
    assert "1000/1000 resident" in text and "lru_eviction (by demo_2)" in text and "12/18 steps" in text


def test_live_layout_shows_names_and_details_as_text_never_as_markup_or_escapes():
    # Episode names come from folder names and details quote paths and exception messages.
    hostile = Snapshot(
        title="ardiff rollout · x → runs/\x1b[2Jout", session_capacity=2,
        sessions=(SessionRow("[bold]loud", 1, 2, {"positive": 1}, 0, None),),
        events=(EventRow(0.1, "admitted", "[bold]loud", ""),
                EventRow(0.2, "failed", "ep\x1b[31mred", "data/ep\x1b[31mred: bad [/oops]")))
    console = Console(record=True, width=140, color_system="truecolor", force_terminal=True, file=io.StringIO())
    console.print(render(hostile))
    text = console.export_text(styles=False)
    assert text.count("[bold]loud") == 2  # the sessions and the events panels
    assert "data/ep\\x1b[31mred: bad [/oops]" in text and "ep\\x1b[31mred" in text and "runs/\\x1b[2Jout" in text
    assert "\x1b" not in text


def test_live_layout_while_following_has_no_eta():
    console = Console(record=True, width=100, file=io.StringIO())
    console.print(render(Snapshot(title="t", phase="following", steps_done=3, steps_total=None, elapsed_s=1.0)))
    text = console.export_text()
    assert "3 steps · 3.0 steps/s" in text and "following" in text and "ETA" not in text


def test_event_details_say_1_session_1_page_and_1_request_in_the_singular():
    from ardiff_cli.monitor import describe_event

    plan = {"session_capacity": 1, "num_managed_pages": 1, "bytes_per_page": 1024, "budget_bytes": 4096}
    assert describe_event({"kind": "capacity_planned", "plan": plan}).startswith("1 session, 1 page of 1.00 KiB")
    assert describe_event({"kind": "warmup_finished", "num_requests": 1, "seconds": 0.5, "restored": True}) == (
        "1 request in 0.500s, pool restored")


def test_long_event_details_are_cut_not_the_time_kind_or_session():
    long = "/data/robot_b/step_000001.safetensors: 'joint_position' has shape (5,), expected (7,)" * 3
    console = Console(record=True, width=80, file=io.StringIO())
    console.print(render(Snapshot(title="t", events=(EventRow(1.5, "failed", "robot_b", long),))))
    row = next(line for line in console.export_text().splitlines() if "failed" in line)
    assert "+1.500s" in row and "robot_b" in row and row.rstrip(" │").endswith("…")


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_a_stdout_that_fails_is_lost_once_and_the_hook_decides_when_the_command_stops():
    import errno

    with open("/dev/full", "w") as full:
        out = Output(Format.json, stdout=full, stderr=io.StringIO())
        lost: list[OSError] = []
        out.on_stdout_lost = lost.append
        out.json({"kind": "a"})  # an event: inside the runner, where raising would cut its bookkeeping short
        out.json({"kind": "b"})
        assert [e.errno for e in lost] == [errno.ENOSPC] and out.stdout_lost is lost[0]
    signals = StopSignals()
    error = ConfigError("stop with me")
    signals.defer(error)
    signals.check_signal()  # the rollout's check once its model is loaded: it has no summary to record an error in
    with pytest.raises(ConfigError) as raised:
        signals.check()  # the rollout's next safe point
    assert raised.value is error
    signals.check()  # once
    signals = StopSignals()
    signals.defer(signal.SIGPIPE)  # stdout's reader gone: stopped as a signal would, at check_signal too
    with pytest.raises(Interrupted) as stopped:
        signals.check_signal()
    assert stopped.value.exit_code == 141


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_a_command_whose_stdout_failed_ends_with_exit_1_and_one_error_on_stderr():
    with open("/dev/full", "w") as full:
        err = io.StringIO()
        out = Output(Format.json, stdout=full, stderr=err)
        with pytest.raises(typer.Exit) as raised, handle_errors(out):
            out.result({"x": 1}, lambda plain: "x")
    assert raised.value.exit_code == 1
    assert err.getvalue() == ("Error: cannot write to standard output: No space left on device\n"
                              "hint: check the file or device standard output goes to (free space, permissions)\n")


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_a_command_that_fails_after_stdout_failed_says_both_and_exits_with_its_own_code():
    # `ardiff rollout > summary.txt` on a full disk with a failed episode: exit 4, and stdout's loss was not said
    with open("/dev/full", "w") as full:
        err = io.StringIO()
        out = Output(Format.plain, stdout=full, stderr=err)
        with pytest.raises(typer.Exit) as raised, handle_errors(out):
            out.result({"x": 1}, lambda plain: "x")
            raise ConfigError("model.preset: expected one of tiny, 14b, got 'huge'")
    assert raised.value.exit_code == 2
    assert err.getvalue() == ("warning: cannot write to standard output: No space left on device either\n"
                              "Error: model.preset: expected one of tiny, 14b, got 'huge'\n")


@pytest.mark.parametrize("width", [40, 60, 80, 120, 250])
def test_the_live_layout_fits_any_terminal_height_keeping_the_title_and_the_progress(width):
    """What the layout holds is counted, not drawn and measured: check the count against the drawing, for every
    height from too short for anything but the title and the progress line to room for everything."""
    from dataclasses import replace

    rows = tuple(SessionRow(f"ep_{i:04d}", 1, 5, {"main": 3}, 0, 0.01) for i in range(40))
    events = tuple(EventRow(i / 10, "evicted", f"ep_{i:04d}", "lru_eviction") for i in range(8))
    snapshot = replace(SNAPSHOT, sessions=rows, session_capacity=40, events=events, swap_budget_bytes=1 << 30)
    full = None
    for height in range(4, 60):
        console = Console(record=True, width=width, height=height, file=io.StringIO())
        console.print(render(snapshot))
        lines = console.export_text().splitlines()
        status = next(i for i, line in enumerate(lines) if line.startswith("12/18 steps"))  # it may wrap
        assert lines[0] == "ardiff rollout · dreamzero-tiny" and lines[status - 1].startswith("━"), (height, lines)
        assert lines[-1].endswith("running"), (height, lines)
        assert len(lines) <= max(height, 1 + len(lines) - status + 1), (height, lines)  # all but the fixed lines fit
        if height >= 8:  # room for the newest event
            assert any("evicted   ep_0007" in line for line in lines), (height, lines)
        full = full or (lines if "… and 24 more" in "\n".join(lines) and "ep_0000  lru" in "\n".join(lines) else None)
    assert full is not None  # a tall terminal shows everything: 16 sessions, then the count, and every event


def test_a_narrow_sessions_panel_drops_its_last_columns_instead_of_cutting_every_one():
    """At 40 columns the six columns were cut to "ses…", "epi…", "s…" and "pos:1 n…", and the episode column
    repeated the session's name: now the session and its steps always show, then the pages, the last latency and
    the cross-attention bytes while they fit whole."""
    from dataclasses import replace

    def sessions_panel(snapshot, width):
        console = Console(record=True, width=width, height=60, file=io.StringIO())
        console.print(render(snapshot))
        text = console.export_text()
        return text[text.index("╭─ sessions"):text.index("╭─ events")].splitlines()

    all_columns = ["session", "steps", "pages", "last", "x-attn"]
    for width, kept in ((30, 2), (34, 3), (40, 4), (50, 5), (100, 5)):  # one above the other below 110
        header, *rows, _ = sessions_panel(SNAPSHOT, width)[1:]
        assert header.split("│")[1].split() == all_columns[:kept], (width, header)
        shown = (("demo_2", "2/7", "pos:3 neg:3"), ("demo_1", "4/5", "pos:4 neg:4"))
        for row, (name, steps, pages) in zip(rows, shown):
            expected = [name, steps, *pages.split(), "40 ms" if name == "demo_2" else "32 ms", "64.00 KiB"]
            assert " ".join(row.split("│")[1].split()) == " ".join(expected[:kept + (kept > 2)]), (width, row)
    names = [f"pick_cube_2025-06-01_episode_{i:04d}" for i in range(2)]  # cut in the middle, the steps kept whole
    long = replace(SNAPSHOT, sessions=tuple(SessionRow(n, 1, 5, {"main": 3}, 0, 0.01) for n in names))
    for width in (30, 40):
        rows = sessions_panel(long, width)[2:4]
        for i, row in enumerate(rows):
            assert re.search(rf"│ pick_\S*…\S*_000{i} +1/5", row), (width, row)
    # a branch name of up to four letters whole, not "mai:3"
    assert re.search(r"│ pick_\S*_0000 +1/5 +main:3 ", sessions_panel(long, 60)[2])
    empty = sessions_panel(replace(SNAPSHOT, sessions=()), 40)
    assert empty[1].split("│")[1].split() == all_columns and "none" in empty[2]  # the headers alone fit


def test_a_narrow_capacity_panel_drops_whole_parts_of_a_value_and_keeps_its_labels():
    """At 40 columns the swap row read "1 out, 160.58 KiB of 19.61" (the unit cut off) and the last label
    "attenti…"; a value now loses whole parts from its end, and the labels show whole."""
    from dataclasses import replace

    snapshot = replace(SNAPSHOT, swapped=1, swapped_bytes=164434, swap_budget_bytes=21056048250, attention="torch")

    def capacity_panel(width):
        console = Console(record=True, width=width, height=60, file=io.StringIO())
        console.print(render(snapshot))
        text = console.export_text()
        lines = text[text.index("╭─ capacity"):text.index("╰")].splitlines()[1:]
        words = [line.strip("│ ").split() for line in lines]
        return {label: " ".join(w for w in rest if "━" not in w) for label, *rest in words}  # the bar's cells not

    full = {"device": "cpu · float32", "budget": "3.00 MiB of 8.00 GiB", "page": "16 tokens · 8.00 KiB",
            "pages": "18/36, 18 free", "sessions": "2/2 resident",
            "swap": "1 out, 160.58 KiB of 19.61 GiB", "attention": "torch"}
    assert capacity_panel(80) == capacity_panel(44) == full
    assert capacity_panel(40) == {**full, "pages": "18/36", "swap": "1 out, 160.58 KiB"}
    assert capacity_panel(30) == {**full, "budget": "3.00 MiB", "page": "16 tokens", "pages": "18/36", "swap": "1 out"}


def test_long_names_that_share_a_prefix_are_cut_in_the_middle_so_they_stay_apart():
    """Names were cut at their end: 50 episodes named pick_cube_2025-06-01_episode_NNNN all read
    "pick_cube_2025-06…" in the sessions and the events panels. Wide and combining characters are cut whole."""
    from dataclasses import replace

    names = [f"pick_cube_2025-06-01_episode_{i:04d}" for i in range(3)]
    snapshot = replace(SNAPSHOT, sessions=tuple(SessionRow(n, 1, 5, {"main": 3}, 0, 0.01) for n in names),
                       events=tuple(EventRow(0.1, "admitted", n, "") for n in names))
    for width in (60, 80, 120):
        console = Console(record=True, width=width, height=60, file=io.StringIO())
        console.print(render(snapshot))
        text = console.export_text()
        for i in range(3):
            assert re.search(rf"pick_\S*…\S*_000{i}\b", text), (width, text)
    # At 40 columns Rich cropped event rows at the border, the names' ends first ("pick_cub…sion_00" for all):
    # there the detail goes and the name takes its room, cut in its middle.
    evicted = replace(snapshot, events=tuple(EventRow(1.0, "evicted", n, "lru_eviction (by ep_1), swapped out "
                                                                         "(164.08 KiB)") for n in names))
    for width, detail in ((40, False), (50, False), (60, True), (120, True)):
        console = Console(record=True, width=width, height=60, file=io.StringIO())
        console.print(render(evicted))
        text = console.export_text()
        rows = [line for line in text.splitlines() if "evicted" in line]
        assert len(rows) == 3 and all(len(row) <= width for row in rows), (width, text)
        for i, row in enumerate(rows):
            assert re.search(rf"evicted +pick_\S*…\S*_000{i} ", row), (width, row)
            assert ("lru_eviction" in row) == detail, (width, row)
    from ardiff_cli.panels import middle_cut

    assert middle_cut("机器人_抓取_红色方块_0001", 10) == "机器…_0001"
    assert middle_cut("e\u0301" * 8 + "_01", 6) == "e\u0301e\u0301…_01"  # never a mark without its letter
    assert middle_cut("short", 10) == "short"
    assert (middle_cut("pick_cube_0001", 1), middle_cut("pick_cube_0001", 0)) == ("…", "")  # never wider than given


def test_leaving_the_block_puts_back_the_handlers_it_replaced():
    # A library caller (or a test) that runs a command in-process gets its own Ctrl-C back afterwards.
    before = {signum: signal.getsignal(signum) for signum in HANDLED}
    with StopSignals() as signals:
        assert all(signal.getsignal(signum) == signals._handle for signum in HANDLED)
    assert {signum: signal.getsignal(signum) for signum in HANDLED} == before


def test_the_first_of_two_signals_in_a_critical_section_is_the_one_raised():
    with StopSignals() as signals, pytest.raises(Interrupted) as info:
        with signals.critical():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
    assert info.value.exit_code == 143  # SIGTERM's, not the later SIGINT's


def test_the_first_deferred_stop_is_the_one_raised():
    # The disk filled (an OutputError deferred), then stdout's reader went away (SIGPIPE): the run stops for the disk.
    signals = StopSignals()
    first = ConfigError("disk full")
    signals.defer(first)
    signals.defer(signal.SIGPIPE)
    with pytest.raises(ConfigError) as raised:
        signals.check()
    assert raised.value is first


def test_a_steps_end_waits_for_the_notice_however_late_its_thread_begins(monkeypatch):
    """A step's end waited NOTICE_WAIT_S (5 s) for the notice's thread from the moment it was started: a loaded
    machine (a CI's 2 shared cores) that ran the thread later than that let the stop's lines come before the notice,
    or the process exit with none. Only the notice itself is bounded now (a stderr that blocks), from the moment its
    thread begins: here it begins a second after the bound."""
    import ardiff_cli.signals as signals_module

    run = threading.Thread.run

    def late(thread: threading.Thread) -> None:
        if thread.name == "ardiff-stop-notice":
            time.sleep(signals_module.NOTICE_WAIT_S + 1)  # the thread is not scheduled yet
        run(thread)

    monkeypatch.setattr(threading.Thread, "run", late)
    lines: list[str] = []
    with StopSignals(notice=lambda signum: lines.append("SIGTERM: finishing the step in flight")) as signals:
        with pytest.raises(Interrupted):
            try:
                with signals.step():
                    signal.raise_signal(signal.SIGTERM)
                signals.check()
            finally:
                lines.append("saving 2 resident sessions for --resume")  # the stopped run's teardown
    assert lines == ["SIGTERM: finishing the step in flight", "saving 2 resident sessions for --resume"]


def test_a_step_announces_only_its_first_signal():
    notices = []
    with StopSignals(notice=notices.append) as signals, pytest.raises(Interrupted):
        with signals.step():
            signal.raise_signal(signal.SIGINT)
            with signals.critical():
                signal.raise_signal(signal.SIGINT)  # the second one, recorded inside the write: no second notice
            signals.check()
    assert notices == [signal.SIGINT]  # the step's end waited for its notice


def test_after_hold_a_signal_is_only_recorded():
    with StopSignals() as signals:
        signals.hold()
        signal.raise_signal(signal.SIGTERM)
        signals.check()  # the command's outcome is decided: nothing is raised
    assert signals.pending == signal.SIGTERM
    assert signals.after_stop == [signal.SIGTERM]  # for the teardown's optional work to stop at


@pytest.fixture(autouse=True)
def _signal_handlers_given_back():
    """Tests here run StopSignals outside a command: a stopped one keeps its handlers (they only record a signal)
    until the command's end gives them back (``handle_errors``); here the test's end does."""
    yield
    give_back()


def test_a_signal_while_a_stop_is_reported_is_only_recorded_and_the_command_gives_the_handlers_back():
    # Ctrl-C again as the stop's error is written: Python's own handler, given back as the block was left, raised
    # KeyboardInterrupt into the report (the error printed twice, or cut short) or after it (killed by SIGINT)
    before = {signum: signal.getsignal(signum) for signum in HANDLED}

    class CtrlCAgain(io.StringIO):
        def write(self, text: str) -> int:
            signal.raise_signal(signal.SIGINT)
            return super().write(text)

    stderr = CtrlCAgain()
    try:
        with pytest.raises(typer.Exit) as info, handle_errors(Output(Format.plain, stdout=io.StringIO(),
                                                                     stderr=stderr)):
            with StopSignals() as signals:
                signal.raise_signal(signal.SIGINT)  # between steps: raised at once
    except KeyboardInterrupt:
        pytest.fail(f"the second Ctrl-C was raised into the report: {stderr.getvalue()!r}")
    assert info.value.exit_code == 130
    assert stderr.getvalue() == ("Error: interrupted by SIGINT\n"
                                 "hint: run the same command with --resume to continue\n")
    assert signals.after_stop and set(signals.after_stop) == {signal.SIGINT}  # recorded, nothing more
    assert {signum: signal.getsignal(signum) for signum in HANDLED} == before  # a caller in-process gets its own back


@pytest.mark.parametrize("outer_stops", [False, True])
def test_nested_stop_signals_give_back_the_handlers_from_before_the_outer_one(outer_stops):
    # The inner one, stopped, kept the outer one's handler as the one to give back: the command's end then installed
    # it, a handler of a finished StopSignals, for good. Stopped too, it only recorded every later Ctrl-C (a caller
    # in-process could no longer interrupt anything); else it raised Interrupted where KeyboardInterrupt was due.
    before = {signum: signal.getsignal(signum) for signum in HANDLED}
    with contextlib.suppress(Interrupted), StopSignals() as outer:
        with contextlib.suppress(Interrupted), StopSignals():
            signal.raise_signal(signal.SIGINT)  # the inner one raises it
        assert signal.getsignal(signal.SIGINT) == outer._handle  # the outer block goes on under its own handler
        if outer_stops:
            signal.raise_signal(signal.SIGINT)
    give_back()
    assert {signum: signal.getsignal(signum) for signum in HANDLED} == before
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("at", ["_listen", "_drain"])
def test_a_signal_as_stop_signals_takes_the_signals_stops_it_and_leaves_nothing_of_it_set(at):
    # One handled inside __enter__ (its handlers installed; before or after it made its pipe the wakeup fd) raised
    # the stop out of it: no __exit__, so the wakeup fd stayed set to the pipe, and the handler, never held for
    # give_back, stayed installed for good (a caller in-process could no longer interrupt anything).
    from ardiff_cli.signals import _drain

    code = {"_listen": StopSignals._listen.__code__, "_drain": _drain.__code__}[at]
    before = {signum: signal.getsignal(signum) for signum in HANDLED}
    tracing = sys.gettrace()

    def deliver(frame, event, arg):  # a real signal, as the setup reaches ``at``
        if event == "call" and frame.f_code is code:
            sys.settrace(tracing)
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(Interrupted) as info:
        sys.settrace(deliver)
        try:
            with StopSignals():
                pytest.fail("the block ran")
        finally:
            sys.settrace(tracing)
    give_back()  # as the command's end does (handle_errors)
    assert info.value.exit_code == 130
    assert signal.set_wakeup_fd(-1) == -1
    assert {signum: signal.getsignal(signum) for signum in HANDLED} == before


def test_a_signal_a_forked_worker_takes_is_not_taken_for_one_that_came_to_the_command():
    # A child forked in the block (a pipeline's worker process) kept the pipe the signal module writes the number of
    # each signal to as it arrives: one that stops cleanly on SIGTERM wrote 15 there as it was stopped, and a Ctrl-C
    # later stopped the command as the SIGTERM, `Error: interrupted by SIGTERM`, exit 143.
    import os

    with pytest.raises(Interrupted) as info, StopSignals():
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: never back into pytest
            try:
                signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
                os.write(write, b"r")
                for _ in range(3000):  # short sleeps: a SIGTERM before one began is handled as it ends
                    time.sleep(0.02)
            finally:
                os._exit(1)
        os.close(write)
        os.read(read, 1)  # its handler is set
        os.close(read)
        os.kill(pid, signal.SIGTERM)
        assert os.waitpid(pid, 0)[1] == 0  # it took the SIGTERM
        signal.raise_signal(signal.SIGINT)
    assert info.value.exit_code == 130


def test_signals_after_the_stop_are_listed_but_not_the_stop_itself():
    with StopSignals() as signals:
        with pytest.raises(Interrupted):
            signal.raise_signal(signal.SIGINT)  # between steps: raised at once
        assert signals.after_stop == []
        signal.raise_signal(signal.SIGTERM)  # the stop is on its way: recorded
        signal.raise_signal(signal.SIGINT)
    assert signals.after_stop == [signal.SIGTERM, signal.SIGINT]


def test_outside_the_main_thread_it_installs_nothing_and_does_not_fail():
    before = {signum: signal.getsignal(signum) for signum in HANDLED}
    errors = []

    def worker():
        try:
            with StopSignals() as signals:
                with signals.critical():
                    pass
                signals.check()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert errors == []
    assert {signum: signal.getsignal(signum) for signum in HANDLED} == before


LIVE_LOCK_ORDER = r'''
import io, os, pty, sys, threading, time
from ardiff_cli.output import Format, Output

master, slave = pty.openpty()  # a terminal: the live display redraws in place
terminal = io.TextIOWrapper(os.fdopen(slave, "wb", buffering=0), encoding="utf-8", write_through=True)
threading.Thread(target=lambda: [None for _ in iter(lambda: os.read(master, 65536), b"")], daemon=True).start()
out = Output(Format.rich, stdout=io.StringIO(), stderr=terminal)
stop = threading.Event()


def printer():  # a pipeline's thread printing all along
    i = 0
    while not stop.is_set():
        print(f"thread line {i}")
        i += 1


def frame():  # a frame whose drawing writes to sys.stderr, as a library's warning or log line does
    print("drawing", file=sys.stderr)
    from rich.text import Text
    return Text(f"frame {time.monotonic():.3f}")


with out.chatter_to_stderr():
    thread = threading.Thread(target=printer, daemon=True)
    thread.start()
    for _ in range(8):
        with out.live(frame):
            time.sleep(0.6)  # two or three frames drawn by the refresh thread
    stop.set()
    thread.join()
print("done", file=sys.__stderr__)
'''


def test_a_frame_that_writes_to_stderr_while_a_thread_prints_does_not_deadlock_the_live_display(tmp_path):
    """Rich's refresh thread draws a frame under the display's lock; what that frame writes to sys.stderr (ardiff's
    stand-in) came to chatter, which took its own lock and then the display's, while a pipeline's thread printing
    held ours and waited for the display's: both hung, the command never ended. Every thread now takes the display's
    lock first."""
    import subprocess
    import sys

    script = tmp_path / "lock_order.py"
    script.write_text(LIVE_LOCK_ORDER)
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the live display and a printing thread deadlocked (8 displays of 0.6 s did not end in 120 s)")
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith("done"), done.stderr


# The start and the end of a script run on a pseudo-terminal (on_a_terminal): ``out``'s stderr is the terminal, whose
# reader thread takes all that is shown; ``text`` is what was shown, without the display's escape codes.
ON_A_TERMINAL = ('''master, slave = pty.openpty()  # a terminal: the live display redraws in place, code's lines go above it
terminal = io.TextIOWrapper(os.fdopen(slave, "wb", buffering=0), encoding="utf-8", write_through=True)
shown = bytearray()


def read_the_terminal():
    try:
        while chunk := os.read(master, 65536):
            shown.extend(chunk)
    except OSError:  # EIO: the terminal closed, and all it was given has been read
        pass


reader = threading.Thread(target=read_the_terminal, daemon=True)
reader.start()
out = Output(Format.rich, stdout=io.StringIO(), stderr=terminal)
''', r'''terminal.close()  # its reader takes all that was written, then ends: no sleep a loaded machine may outlast
reader.join(timeout=60)
text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", shown.decode("utf-8", "replace"))  # the display's escape codes
''')


def on_a_terminal(tmp_path, script: str):
    """Run ``script`` (ON_A_TERMINAL's parts in its {terminal} and {shown}) in a Python of its own: what it printed,
    read as a Python literal."""
    import ast
    import subprocess
    import sys

    path = tmp_path / "on_a_terminal.py"
    path.write_text(script.replace("{terminal}", ON_A_TERMINAL[0]).replace("{shown}", ON_A_TERMINAL[1]))
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout)


CTRL_C_ABOVE_THE_DISPLAY = r'''
import io, os, pty, re, signal, sys, threading
from rich.console import Console
from rich.text import Text
from ardiff_cli.output import Format, Output

{terminal}

def ctrl_c_as_a_line_is_printed_above(frame, event, arg):
    if event == "call" and frame.f_code is Console.print.__code__ and frame.f_back.f_code.co_name == "_print_above":
        sys.setprofile(None)
        signal.raise_signal(signal.SIGINT)  # its handler raises KeyboardInterrupt here, in the main thread


with out.chatter_to_stderr():
    try:
        with out.live(lambda: Text("frame")):
            print("a line before")
            sys.setprofile(ctrl_c_as_a_line_is_printed_above)
            print("the line Ctrl-C interrupted")  # its text, then its newline: the second write prints it
            print("not reached")
    except KeyboardInterrupt:
        pass
{shown}print([line.strip() for line in text.replace("\r", "\n").split("\n") if "line" in line or "reached" in line])
'''


def test_a_line_printed_above_the_live_display_as_ctrl_c_arrives_is_kept(tmp_path):
    """A pipeline's line went to the terminal above the display only once its newline was written: Ctrl-C arriving
    as it was printed (KeyboardInterrupt, or the commands' Interrupted, raised in the main thread) lost it, though
    its text had been written before. It is taken from the buffer once printed now, and the display's end shows it."""
    assert on_a_terminal(tmp_path, CTRL_C_ABOVE_THE_DISPLAY) == ["a line before", "the line Ctrl-C interrupted"]


DRAWN_UNDER_A_LINE = r'''
import io, os, pty, re, sys, threading
from rich.text import Text
from ardiff_cli.output import Format, Output

{terminal}

class Panel:
    """A panel drawn again under each line printed above the display; drawn under the first, it writes to stderr
    (a library's warning), which comes back to the stand-in while that line is being printed."""

    said = False

    def __rich_console__(self, console, options):
        if printing and not Panel.said:
            Panel.said = True
            print("said while drawing", file=sys.stderr)
        yield Text("frame")


printing, panel = False, Panel()
with out.chatter_to_stderr():
    with out.live(lambda: panel):
        printing = True
        print("a line")
        printing = False
{shown}print([line.count("a line") for line in text.replace("\r", "\n").split("\n") if "a line" in line])
'''


def test_a_line_printed_above_the_live_display_shows_once_when_the_frame_drawn_under_it_writes_to_stderr(tmp_path):
    """A line being printed above the display stayed in the buffer until it was printed (so that Ctrl-C meanwhile
    would not lose it): a frame drawn under it that wrote to stderr (a library's warning) came back to the stand-in,
    which printed the buffered line a second time."""
    assert sum(on_a_terminal(tmp_path, DRAWN_UNDER_A_LINE)) == 1


NOT_UTF8 = {"C.UTF-8": ({"LC_ALL": "C.UTF-8"}, "utf-8"),
            "C-ascii": ({"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}, "ascii")}


@pytest.mark.parametrize(("locale", "name", "shown"), [("C.UTF-8", b"caf\xe9", "caf\\xe9"),
                                                       ("C-ascii", b"caf\xe9", "caf\\xe9"),
                                                       ("C-ascii", b"caf\xc3\xa9", "caf\\xc3\\xa9")])
def test_a_name_in_bytes_the_locale_cannot_decode_is_written_as_xnn_in_every_line_and_kept_in_json(
        tmp_path, cli_env, locale, name, shown):
    """`--out`, EPISODE or CONFIG named in bytes the locale cannot decode (b'caf\\xe9', or b'caf\\xc3\\xa9' under
    LC_ALL=C with PYTHONUTF8=0): the hint's `$'caf\\xe9'` named the bytes, but the `writing OUT:` and `Error:` lines
    said `caf\\udce9` (stderr's escape of Python's lone surrogate), the `outputs:` line wrote the raw byte (stdout's
    surrogateescape), and an error quoting the name said `'caf\\udce9'`. Each writes `caf\\xe9` now; JSON keeps the
    name as Python holds it, which `os.fsencode` turns back into the file's bytes."""
    import subprocess

    from fast_run import write_fast_data

    write_fast_data(tmp_path, {"a": 2})
    environ, encoding = NOT_UTF8[locale]
    env = {**{k: v for k, v in cli_env.items() if not k.startswith(("LC_", "PYTHONUTF8", "PYTHONIOENCODING"))},
           "LANG": "C", **environ}
    held = name.decode(encoding, "surrogateescape")  # the name as ardiff (Python) holds it

    def ardiff(*args: bytes, fmt: str = "plain") -> tuple[int, str, str]:
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *args, b"--format", fmt.encode()], cwd=tmp_path,
                              env=env, capture_output=True, timeout=120)
        return proc.returncode, proc.stdout.decode("ascii"), proc.stderr.decode("ascii")  # ASCII: no raw byte

    rollout = (b"rollout", b"fast.yaml", b"eps/a", b"--no-warmup", b"--out", name)
    code, out, err = ardiff(*rollout)
    assert code == 0 and f"writing {shown}: 1 episode, order round-robin" in err.splitlines(), err
    assert f"outputs: {shown} (results.jsonl, summary.json, episodes/)" in out.splitlines(), out
    code, out, err = ardiff(*rollout)
    assert code == 2 and err.splitlines()[-2:] == [
        f"Error: {shown} already holds a run",
        f"hint: continue it with: ardiff rollout --resume --out $'{shown}'; or choose another --out"], err
    code, out, err = ardiff(*rollout, fmt="json")
    error = json.loads(out.splitlines()[-1])
    assert code == 2 and error["message"] == f"{held} already holds a run", out
    assert f"Error: {shown} already holds a run" in err.splitlines(), err
    with open(os.path.join(os.fsencode(tmp_path), name, b"summary.json"), "rb") as f:
        assert json.load(f)["out"].encode(encoding, "surrogateescape") == name
    code, out, err = ardiff(b"rollout", b"fast.yaml", name + b"/nothing")
    assert code == 2 and f"Error: episode folder not found: {shown}/nothing" in err.splitlines(), err
    code, out, err = ardiff(b"rollout", name, b"eps")  # a name quoted as Python's repr would
    assert code == 2 and f"Error: CONFIG '{shown}' is a folder; the first argument is a config file or a built-in " \
        "config name" in err.splitlines(), err


def test_an_unknown_pipeline_named_in_bytes_the_locale_cannot_decode_is_quoted_with_xnn(tmp_path, cli_env):
    """`--pipeline $'caf\\xe9'`: the error quoted the name as Python's repr, `unknown pipeline 'caf\\udce9'`, where
    every other quoted name (CONFIG, --pipeline MODULE:CLASS) writes the byte `\\xe9`."""
    import subprocess

    env = {**{k: v for k, v in cli_env.items() if not k.startswith(("LC_", "PYTHONUTF8", "PYTHONIOENCODING"))},
           "LC_ALL": "C.UTF-8"}
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", "dreamzero-tiny", "--pipeline",
                           b"caf\xe9", "--format", "plain"], env=env, cwd=tmp_path, capture_output=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.decode("ascii").splitlines()[0] == "Error: --pipeline: field 'pipeline': unknown pipeline " \
        "'caf\\xe9'", proc.stderr
    # and the file named in place of MODULE, in one hint: `'d/caf\\xe9.py' is a file's path ... and 'caf\\udce9' is no
    # Python name`
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", "dreamzero-tiny", "--pipeline",
                           b"d/caf\xe9.py:C", "--format", "plain"], env=env, cwd=tmp_path, capture_output=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.decode("ascii").splitlines()[1] == "hint: 'd/caf\\xe9.py' is a file's path; MODULE is the " \
        "name it is imported by, from a folder on PYTHONPATH, and 'caf\\xe9' is no Python name: rename the file " \
        "(letters, digits and _)", proc.stderr


def test_an_option_value_in_bytes_the_locale_cannot_decode_is_quoted_with_xnn(tmp_path, cli_env):
    """An option's value holding a byte the locale cannot decode (0xff under LC_ALL=C with PYTHONUTF8=0): Click's,
    pydantic's and ardiff's own errors of the value quoted it as Python's repr, `'a\\udcff'`, where a path given in
    the same bytes is written `'a\\xff'` (the hint's `$'a\\xff'` names that byte). Each writes `\\xff` now. A number
    option's said pydantic's "Input should be a valid string, unable to parse raw data as a unicode string": it says
    what the option takes now, as the others do."""
    import subprocess

    environ, _ = NOT_UTF8["C-ascii"]
    env = {**{k: v for k, v in cli_env.items() if not k.startswith(("LC_", "PYTHONUTF8", "PYTHONIOENCODING"))},
           "LANG": "C", **environ}
    cases = [
        (b"rollout", b"--order", "Invalid value for '--order': 'a\\xff' is not one of 'round-robin', 'sequential'."),
        (b"inspect-capacity", b"--format", "Invalid value for '--format': 'a\\xff' is not one of"),
        (b"inspect-capacity", b"--attention-backend", "Invalid value for '--attention-backend': 'a\\xff' is not one"),
        (b"inspect-capacity", b"--device", "Invalid value for '--device': 'a\\xff' is not a device"),
        (b"warmup", b"--dtype", "Invalid value for '--dtype': 'a\\xff' is not a dtype"),
        (b"inspect-capacity", b"--memory-budget", "Invalid value for '--memory-budget': cannot read 'a\\xff' as a "
                                                  "byte size: 'a\\xff' is not a plain number"),
        (b"inspect-capacity", b"--available", "Invalid value for '--available': cannot read 'a\\xff' as a byte"),
        (b"rollout", b"--swap-space", "Invalid value for '--swap-space': cannot read 'a\\xff' as a byte size"),
        (b"inspect-capacity", b"--sessions", "Invalid value for '--sessions': expected a whole number of sessions, 1 "
                                             "or more, got 'a\\xff'"),
        (b"warmup", b"--session-capacity", "Invalid value for '--session-capacity': expected a whole number of "
                                           "sessions, 1 or more, got 'a\\xff'"),
        (b"warmup", b"--gpu-memory-fraction", "Invalid value for '--gpu-memory-fraction': expected a number in (0, 1], "
                                              "got 'a\\xff'"),
        (b"rollout", b"--idle-timeout", "Invalid value for '--idle-timeout': expected a number of seconds, 0 or more, "
                                        "got 'a\\xff'"),
    ]
    for command, option, message in cases:
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, b"--format", b"plain", option, b"a\xff"],
                              env=env, cwd=tmp_path, capture_output=True, timeout=120)
        err = proc.stderr.decode("ascii")  # ASCII: no raw byte
        assert proc.returncode == 2 and err.startswith(f"Error: {message}"), (option, err)
        assert "\\xff" in err.splitlines()[0] and "\\udc" not in err, (option, err)
        assert err.splitlines()[1] == f"hint: see ardiff {command.decode()} --help", err


# In a child whose file-size limit is real (RLIMIT_FSIZE, 4 KiB; Python ignores SIGXFSZ): a write past it fails with
# EFBIG, raised as an OutputError with each hint argv gives (a JSON [fix, go_on]: a WriteHint; a string: that text;
# null: none, the table's), and the hint line the error table prints for it
_FILE_SIZE_REPORT = """
import io, json, os, resource, sys
from ardiff_cli.errors_cli import OutputError, report
from ardiff_cli.output import Format, Output
from ardiff_cli.runtime.errors import WriteHint
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
for given in json.loads(sys.argv[2]):
    try:
        with open(sys.argv[1], "wb") as f:
            f.write(bytes(8192))
    except OSError as exc:
        hint = WriteHint(*given) if isinstance(given, list) else given
        try:
            raise OutputError(f"cannot write {sys.argv[1]}: {exc.strerror}", hint=hint) from exc
        except OutputError as error:
            err = io.StringIO()
            report(Output(Format.plain, stdout=io.StringIO(), stderr=err), error)
            print(json.dumps(err.getvalue().splitlines()[-1]))
"""


def test_a_file_size_limit_replaces_a_write_hints_fix_and_keeps_its_go_on(tmp_path):
    """Under a file-size limit (``ulimit -f``: EFBIG) a write's hint says the limit in place of its fix (free space,
    permissions) and keeps its go-on, from the parts it was made of (``WriteHint``); any other hint is kept whole after
    the limit. The hint was text cut at its first ", then ", and a fix that named a path (the journal's, `check free
    space and permissions of OUT, then ...`, of an --out named `a, then b`) was kept whole, free space and all: it is
    replaced too. Text made from a write's hint (`...; and more`) is no write's: it was cut at its first ", then "."""
    import subprocess

    from ardiff_cli.errors_cli import write_hint
    from ardiff_cli.runtime.errors import ResumeCommand

    limit = "a file reached this process's file-size limit of 4,096 bytes (ulimit -f): raise it (ulimit -f unlimited)"
    resume = str(ResumeCommand("/runs/a, then b"))
    moved = ("(the run still records the episode's old folder) link it to the new one and continue: ln -s ep1 ep0; "
             f"{resume}")
    stdout = "check the file or device standard output goes to (free space, permissions)"
    made = f"{write_hint(resume)}; and more"
    cases = [
        (["check free space and permissions of /runs/a, then b", moved], f"{limit}, then {moved}"),  # the journal's
        ([write_hint(resume).fix, write_hint(resume).go_on], f"{limit}, then continue with: {resume}"),
        (None, f"{limit}, then continue with: ardiff rollout --resume --out OUT"),  # the table's
        (stdout, f"{limit}; {stdout}"),
        (made, f"{limit}; {made}"),
    ]
    proc = subprocess.run([sys.executable, "-c", _FILE_SIZE_REPORT, str(tmp_path / "big"),
                           json.dumps([given for given, _ in cases])], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line) for line in proc.stdout.splitlines()] == [f"hint: {said}" for _, said in cases]
