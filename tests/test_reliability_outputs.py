"""Faults while writing outputs, and faults that stop a run. Nothing partial, nothing lost.

A step whose output file cannot be written fails its episode (the others go on, exit 4); a line that
cannot be appended to results.jsonl stops the run (exit 1), because nothing else could record what
happened, and so does a broken internal invariant (an AssertionError: a bug). Either way results.jsonl
holds whole lines naming complete files, and --resume finishes the run.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from fast_run import rollout, runner, write_fast_data
from pipeline_helpers import outputs as load_outputs, records

import ardiff_cli.io.atomic as atomic
from ardiff_cli.app import app
from ardiff_cli.runtime.errors import ResumeCommand



@pytest.fixture(autouse=True)
def _env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "reliability-cache"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_fast_data(tmp_path_factory.mktemp("data"), {"arm_a": 3, "arm_b": 3})


def resume(out):
    return runner.invoke(app, ["rollout", "--resume", "--out", str(out), "--no-warmup", "--format", "plain"])


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "run"
    result = rollout(data, out)
    assert result.exit_code == 0, result.stderr
    return load_outputs(out)


def assert_complete(out, reference) -> None:
    """Every ok line names a complete file; after --resume every output equals the reference run's."""
    got = load_outputs(out)
    assert sorted(got) == sorted(reference)
    for name, arrays in reference.items():
        for key, value in arrays.items():
            np.testing.assert_array_equal(got[name][key], value, err_msg=f"{name}:{key}")


def test_an_output_that_cannot_be_written_fails_its_episode_only(data, reference, tmp_path):
    out = tmp_path / "run"
    (out / "episodes").mkdir(parents=True)
    (out / "episodes" / "arm_b").write_text("in the way")  # arm_b's output folder cannot be created
    result = rollout(data, out)
    assert result.exit_code == 4, result.stderr
    assert ("Error: episode 'arm_b' failed at step 0 while writing its outputs: FileExistsError: [Errno 17] File "
            f"exists: '{out / 'episodes' / 'arm_b'}'") in result.stderr
    assert ("hint: check free space and permissions of the output folder, then continue with: "
            f"{ResumeCommand(out)}\n") in result.stderr  # the run's folder: it said --out OUT
    assert "Traceback" not in result.stderr
    lines = records(out)
    assert [(r["episode"], r["step"], r["status"]) for r in lines] == [
        ("arm_a", 0, "ok"), ("arm_b", 0, "failed"), ("arm_a", 1, "ok"), ("arm_a", 2, "ok")]
    assert lines[1]["phase"] == "write" and lines[1]["error_type"] == "FileExistsError"
    assert all((out / r["output"]).is_file() for r in lines if r["status"] == "ok")

    (out / "episodes" / "arm_b").unlink()  # the user fixes the folder
    result = resume(out)
    assert result.exit_code == 0, result.stderr
    assert_complete(out, reference)



@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS], ids=["disk-full", "quota", "read-only"])
def test_a_full_disk_refusing_a_steps_outputs_stops_the_run_instead_of_failing_every_episode(data, reference,
                                                                                              tmp_path, monkeypatch,
                                                                                              code):
    """The disk of --out fills at the 3rd step's outputs and stays full (or the quota is reached, or it is remounted
    read-only). Each episode failed in turn at its next write ('episode 'arm_b' failed at step 1 while writing its
    outputs: OSError: [Errno 28] No space left on device', then arm_a's, ...): its session released, to be replayed in
    full by --resume, and the cause buried under one failure per episode. The run stops at the first, as for
    results.jsonl."""
    out = tmp_path / "run"
    real_fsync = atomic.os.fsync
    outputs = 0

    def fsync(fd):  # the kernel reports a full disk at the latest when the written data is flushed
        nonlocal outputs
        written = os.readlink(f"/proc/self/fd/{fd}")  # an output's temporary file (not its folder)
        if written.startswith(str(out / "episodes")) and written.endswith(".tmp"):
            outputs += 1
            if outputs >= 3:
                raise OSError(code, os.strerror(code))
        return real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    result = rollout(data, out)
    monkeypatch.undo()
    assert result.exit_code == 1, result.stderr
    refused = out / "episodes" / "arm_a" / "step_000001.safetensors"
    # the hint of a step's output that cannot be written, word for word (the two had two wordings)
    assert (f"Error: cannot write {refused}: {os.strerror(code)}\nhint: check free space and permissions of the output "
            f"folder, then continue with: {ResumeCommand(out)}\n") in result.stderr, result.stderr
    assert "failed at step" not in result.stderr and "Traceback" not in result.stderr
    lines = records(out)  # the refused step has no line: --resume runs it
    assert [(r["episode"], r["step"], r["status"]) for r in lines] == [("arm_a", 0, "ok"), ("arm_b", 0, "ok")]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["episodes"]["failed"] == 0
    assert not refused.exists()
    assert not [p.relative_to(out) for p in out.rglob("*") if p.name.endswith(".tmp")]  # nor its temporary file

    result = resume(out)
    assert result.exit_code == 0, result.stderr
    assert "2 steps already done" in result.stderr
    assert_complete(out, reference)

@pytest.mark.parametrize("short_write", [False, True], ids=["disk-full", "short-write"])
def test_a_results_line_that_cannot_be_appended_stops_the_run(data, reference, tmp_path, monkeypatch, short_write):
    """The 3rd line fails: with ENOSPC before writing, or after half of it reached the file (a short write: the write
    of the rest says why). It read 'short write ... is the disk full?', whatever the kernel's reason (EFBIG too)."""
    out = tmp_path / "run"
    real_write = os.write
    appended = 0

    def write(fd, data):
        nonlocal appended
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == "results.jsonl":
            appended += 1
            if appended == 3 and short_write:
                return real_write(fd, data[: len(data) // 2])
            if appended == (4 if short_write else 3):  # the kernel: the rest of a short write fails
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(atomic.os, "write", write)
    result = rollout(data, out)
    monkeypatch.undo()
    assert result.exit_code == 1, result.stderr
    assert f"Error: cannot append to {out / 'results.jsonl'}:" in result.stderr
    assert "No space left on device" in result.stderr
    assert "--resume" in result.stderr and "Traceback" not in result.stderr
    lines = records(out)  # two whole lines, and no partial third
    assert [(r["episode"], r["step"]) for r in lines] == [("arm_a", 0), ("arm_b", 0)]
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"

    result = resume(out)
    assert result.exit_code == 0, result.stderr
    assert "2 steps already done" in result.stderr
    assert sorted((r["episode"], r["step"]) for r in records(out)) == [(e, s) for e in ("arm_a", "arm_b")
                                                                       for s in range(3)]
    assert_complete(out, reference)


def test_a_full_disk_keeps_the_runs_own_error_when_summary_json_cannot_be_written_either(data, reference, tmp_path,
                                                                                           monkeypatch):
    """The disk fills at the 3rd results line: from then on every write fails, summary.json's included. The error
    is still the append's (exit 1, no traceback, not 'a bug in ardiff'), and --resume finishes the run."""
    out = tmp_path / "run"
    real_write, real_mkstemp = os.write, atomic.tempfile.mkstemp
    full = False

    def write(fd, data):
        nonlocal full
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == "results.jsonl" and (
                full or len(records(out)) == 2):
            full = True
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def mkstemp(*args, **kwargs):  # every atomic write (outputs, summary.json) starts here
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(atomic.os, "write", write)
    monkeypatch.setattr(atomic.tempfile, "mkstemp", mkstemp)
    result = rollout(data, out)
    monkeypatch.undo()
    assert result.exit_code == 1, result.stderr
    assert f"Error: cannot append to {out / 'results.jsonl'}: No space left on device" in result.stderr
    assert f"warning: cannot write {out / 'summary.json'}: No space left on device; --resume writes it" in (
        result.stderr)
    assert "Traceback" not in result.stderr and "a bug in ardiff" not in result.stderr
    assert not (out / "summary.json").exists() and len(records(out)) == 2
    assert f"outputs: {out} (results.jsonl, episodes/)\n" in result.stdout  # the files there: no summary.json

    result = resume(out)
    assert result.exit_code == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["status"] == "ok"
    assert_complete(out, reference)


def test_a_summary_json_that_cannot_be_written_after_every_step_ran_is_exit_1_and_resume_writes_it(data, reference,
                                                                                                  tmp_path,
                                                                                                  monkeypatch):
    """Every step done, then the disk refuses summary.json alone: the run must not exit 0 (a script would take it as
    whole, with no summary to read); it says which file and that --resume writes it, which it does without running
    a step again."""
    out = tmp_path / "run"
    real_mkstemp = atomic.tempfile.mkstemp

    def mkstemp(*args, **kwargs):  # every atomic write starts here; summary.json's temporary file is .summary.json.*
        if kwargs.get("prefix") == ".summary.json.":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(atomic.tempfile, "mkstemp", mkstemp)
    result = rollout(data, out)
    monkeypatch.undo()
    assert result.exit_code == 1, result.stderr
    assert result.stderr.endswith(f"Error: cannot write {out / 'summary.json'}: No space left on device\n"
                                  "hint: free some space or fix the folder's permissions, then --resume writes it; "
                                  f"to paste: ardiff rollout --resume --out {out}\n"), result.stderr
    assert not (out / "summary.json").exists() and len(records(out)) == 6
    result = resume(out)
    assert result.exit_code == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["status"] == "ok" and len(records(out)) == 6
    assert_complete(out, reference)


@pytest.mark.parametrize("replaced", [False, True], ids=["removed", "replaced"])
def test_an_out_folder_removed_during_the_run_stops_it_instead_of_re_creating_it(data, tmp_path, monkeypatch,
                                                                                  replaced):
    """A cleanup job removes the run's folder after its 2nd results line (or another run makes a new one there). The
    run went on: it re-created the folder with its later outputs and summary.json ('ok', exit 0) but no results.jsonl
    or run.json, so --resume had nothing to resume, and a second run there took a lock the first no longer held."""
    import shutil

    from ardiff_cli.io.run import RunFolder

    out = tmp_path / "run"
    real_append = RunFolder.append_result

    def append_result(self, record):
        real_append(self, record)
        if len(records(out)) == 2:
            shutil.rmtree(out)
            if replaced:
                (out / "other").mkdir(parents=True)

    monkeypatch.setattr(RunFolder, "append_result", append_result)
    result = rollout(data, out)
    monkeypatch.undo()
    assert result.exit_code == 1, result.stderr
    assert f"Error: {out} was removed or replaced while this run wrote it\n" in result.stderr
    assert f"warning: {out} was removed or replaced while this run wrote it: summary.json not written" in (
        result.stderr)
    assert "Traceback" not in result.stderr
    if replaced:  # the new folder holds only what its owner put there
        assert [p.relative_to(out).as_posix() for p in out.rglob("*")] == ["other"]
    else:
        assert not out.exists()


def test_an_out_folder_removed_after_the_last_step_is_an_error_not_an_ok_run(data, tmp_path, monkeypatch):
    """Removed once every step ran (while the model is released): nothing stopped the run, but its summary.json
    cannot be written where its results.jsonl went. Exit 1 saying so, not an ok run with a warning."""
    import shutil

    from ardiff_cli.runtime.engine import ARDiffusionEngine

    out = tmp_path / "run"
    real_close = ARDiffusionEngine.close

    def close(self, **kwargs):
        shutil.rmtree(out)
        real_close(self, **kwargs)

    monkeypatch.setattr(ARDiffusionEngine, "close", close)
    result = rollout(data, out)
    monkeypatch.undo()
    assert result.exit_code == 1, result.stderr
    assert (f"Error: {out} was removed or replaced while this run wrote it: summary.json not written\nhint: its "
            "results.jsonl went with it: run the command again, without --resume") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_an_out_on_a_file_system_without_locks_runs_and_says_it_is_unlocked(data, reference, tmp_path, monkeypatch):
    # Some network mounts refuse flock: the run went on unlocked without a word, though a second rollout there
    # would then not be refused.
    import fcntl

    real_flock = fcntl.flock

    def flock(fd, operation):
        if operation & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    out = tmp_path / "run"
    result = rollout(data, out)
    monkeypatch.undo()
    assert result.exit_code == 0, result.stderr
    assert (f"warning: --out {out}: its file system cannot lock .lock ({os.strerror(errno.ENOLCK)}): a second rollout "
            "writing this folder would not be refused; run one at a time") in result.stderr
    assert_complete(out, reference)


def test_a_cache_too_full_for_the_default_checkpoint_is_said_so_not_blamed_on_the_pipeline(tmp_path, cli_env):
    """safetensors reports a full disk as its own SafetensorError, not an OSError: building the default checkpoint
    into a full cache was "DreamZeroPipeline.from_config() failed: SafetensorError: ... No space left on device",
    with the hint to report a bug in a built-in pipeline. Here the kernel refuses files past 4 KiB (`ulimit -f 4`):
    the hint names that limit, as a run's files do; it said to set ARDIFF_CACHE_DIR, where the limit refuses a file
    alike. The demo episodes, built next into the same cache, are said so too."""
    import subprocess
    import sys

    def ardiff(cache: Path, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f'{command.replace("ardiff", "$PY -m ardiff_cli", 1)} --format plain'],
                              env={**cli_env, "ARDIFF_CACHE_DIR": str(cache), "PY": sys.executable},
                              capture_output=True, text=True, timeout=300)

    limit = ("hint: a file reached this process's file-size limit of {:,} bytes (ulimit -f): raise it (ulimit -f "
             "unlimited), then run the same command again\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    proc = ardiff(cache, "ulimit -f 4; ardiff warmup")
    assert proc.returncode == 2, proc.stderr
    assert re.search(rf"Error: cannot write the default checkpoint to {re.escape(str(cache))}/dreamzero-\w+"
                     r"\.safetensors: File too large\n", proc.stderr), proc.stderr
    assert proc.stderr.endswith(limit.format(4096)) and "report" not in proc.stderr, proc.stderr
    assert list(cache.iterdir()) == []  # its temporary file removed
    assert ardiff(cache, "ardiff warmup").returncode == 0  # the checkpoint built, with no limit
    proc = ardiff(cache, f"ulimit -f 1; ardiff rollout --out {shlex.quote(str(tmp_path / 'run'))}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.endswith(f"Error: cannot write the demo episodes to {cache}/demo: File too large\n"
                                + limit.format(1024)), proc.stderr
    assert list((cache / "demo").iterdir()) == []  # its temporary folder removed


def test_an_out_whose_lock_or_run_json_cannot_be_written_is_an_error_not_a_bug(data, tmp_path, cli_env):
    """--out on a full disk: writing the lock's pid (before the model loads) or run.json (after) ended in 'Error:
    unexpected OSError: [Errno 28] No space left on device', a traceback and 'this is a bug in ardiff'. Here the
    kernel refuses the writes: files may not grow past 0 bytes, then 64 (RLIMIT_FSIZE; Python ignores SIGXFSZ, so
    the write fails with EFBIG)."""
    import resource
    import subprocess
    import sys

    def ardiff(*args: str, limit: int | None = None) -> subprocess.CompletedProcess:
        cap = None if limit is None else lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        return subprocess.run([sys.executable, "-m", "ardiff_cli", *args, "--format", "plain"],
                              env=cli_env, capture_output=True, text=True, timeout=300, preexec_fn=cap)

    assert ardiff("warmup", str(data / "fast.yaml")).returncode == 0  # the checkpoint cached, with no limit
    for limit, code, said in ((0, 2, "Error: --out {out}: cannot write {out}/.lock: File too large\nhint: a file "
                                     "reached this process's file-size limit of 0 bytes (ulimit -f): raise it (ulimit "
                                     "-f unlimited), then run the same command again\n"),
                              (64, 1, "Error: cannot write {out}/run.json: File too large\nhint: a file reached this "
                                      "process's file-size limit of 64 bytes (ulimit -f): raise it (ulimit -f "
                                      "unlimited), then run the same command again")):
        out = tmp_path / f"run{limit}"
        proc = ardiff("rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(out), "--no-warmup",
                      limit=limit)
        assert proc.returncode == code, proc.stderr
        assert said.format(out=out) in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and "bug in ardiff" not in proc.stderr
        assert not (out / "run.json").exists()
    rerun = ardiff("rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(out), "--no-warmup")
    assert rerun.returncode == 0, rerun.stderr  # as the hint says: the folder holds no run yet
    # nothing left to run: the resume rewrites run.json only
    proc = ardiff("rollout", "--resume", "--out", str(out), "--no-warmup", limit=64)
    assert proc.returncode == 1, proc.stderr
    assert f"Error: cannot write {out}/run.json: File too large" in proc.stderr and (
        f"then continue with: ardiff rollout --resume --out {out}\n") in proc.stderr, proc.stderr
    assert json.loads((out / "run.json").read_text())["format"]  # the old one, whole


def test_a_file_size_limit_stops_the_run_as_a_full_disk_does_and_names_ulimit_f(data, tmp_path, cli_env):
    """Under a file-size limit (`ulimit -f`, RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write fails with EFBIG) that
    a step's outputs exceed, each episode failed in turn at its write ('failed at step 0 while writing its outputs:
    OSError: [Errno 27] File too large', a full disk's hint), until results.jsonl reached the limit too and stopped
    the run as 'short write ... is the disk full?'. It stops at the first refused file, as a full disk does, and the
    hint names the limit (the disk is not full); results.jsonl and summary.json say the same. --resume finishes."""
    import resource
    import subprocess
    import sys

    def ardiff(*args: str, limit: int | None = None) -> subprocess.CompletedProcess:
        cap = None if limit is None else lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        return subprocess.run([sys.executable, "-m", "ardiff_cli", *args, "--no-warmup", "--format", "plain"],
                              env=cli_env, capture_output=True, text=True, timeout=300, preexec_fn=cap)

    def hint(limit: int) -> str:
        return f"hint: a file reached this process's file-size limit of {limit:,} bytes (ulimit -f)"

    whole = tmp_path / "whole"  # sizes the limits (and caches the checkpoint, with no limit)
    assert ardiff("rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(whole)).returncode == 0
    output_bytes = (whole / "episodes" / "arm_a" / "step_000000.safetensors").stat().st_size
    assert (whole / "run.json").stat().st_size < output_bytes < (whole / "results.jsonl").stat().st_size
    assert output_bytes < (whole / "summary.json").stat().st_size
    for name, limit, refused in (("outputs", output_bytes - 1, "episodes/arm_a/step_000000.safetensors"),
                                 ("results", output_bytes + 1, "results.jsonl")):
        out = tmp_path / name
        proc = ardiff("rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(out), limit=limit)
        assert proc.returncode == 1, proc.stderr
        said = "append to" if name == "results" else "write"
        assert f"Error: cannot {said} {out / refused}: File too large\n{hint(limit)}" in proc.stderr, proc.stderr
        assert "failed at step" not in proc.stderr and "Traceback" not in proc.stderr
        assert not [r for r in records(out) if r["status"] != "ok"]  # no episode failed for it
        # every output the stopped run left is one a line says is done: the step whose line was refused left its
        # output file (whole, but no line named it: a reader of the folder took the step for done)
        assert sorted(p.relative_to(out).as_posix() for p in (out / "episodes").rglob("*")) == sorted(
            [r["output"] for r in records(out)] + [p.relative_to(out).as_posix() for p in (out / "episodes").iterdir()])
        resumed = ardiff("rollout", "--resume", "--out", str(out))
        assert resumed.returncode == 0, resumed.stderr
        assert_complete(out, load_outputs(whole))  # one thread here and there: the same bytes
    # nothing left to run: a resume writes run.json and summary.json again, the latter past the limit
    proc = ardiff("rollout", "--resume", "--out", str(whole), limit=output_bytes)
    assert proc.returncode == 1, proc.stderr
    assert (f"Error: cannot write {whole / 'summary.json'}: File too large\n{hint(output_bytes)}: raise it "
            "(ulimit -f unlimited), then --resume writes it; to "
            f"paste: ardiff rollout --resume --out {whole}\n") in proc.stderr, proc.stderr


def test_a_results_jsonl_that_cannot_be_created_leaves_no_run_json_and_names_itself(data, tmp_path, cli_env):
    """results.jsonl is made, empty, right after run.json: when it cannot be (a link named results.jsonl in --out that
    leads nowhere or back to itself), the error named run.json and said to run the same command again, which was then
    refused ("already holds a run") for the run.json left behind. It names results.jsonl and what it is now, and
    leaves no run.json: once the link is removed, the same command runs."""
    import subprocess
    import sys

    def ardiff(out):
        return subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", str(data / "fast.yaml"),
                               str(data / "eps"), "--out", str(out), "--no-warmup", "--format", "plain"],
                              env=cli_env, capture_output=True, text=True, timeout=300)

    for name, target, why in (("dangling", "/nonexistent/results.jsonl", "a link to /nonexistent/results.jsonl, "
                                                                         "which does not exist"),
                              ("loop", "results.jsonl", "a link to results.jsonl, which leads back to itself (a loop "
                                                        "of links)")):
        out = tmp_path / name
        out.mkdir()
        (out / "results.jsonl").symlink_to(target)
        proc = ardiff(out)
        assert proc.returncode == 1, proc.stderr
        assert (f"Error: cannot write {out}/results.jsonl: it is {why}\nhint: remove that link, or make what it "
                "links to, then run the same command again (it has no run yet)\n" in proc.stderr), proc.stderr
        assert "Traceback" not in proc.stderr and not (out / "run.json").exists()
        (out / "results.jsonl").unlink()
        rerun = ardiff(out)
        assert rerun.returncode == 0, rerun.stderr  # as the hint says: the folder holds no run yet


def test_an_assert_in_the_pipelines_code_fails_its_step_not_the_run(data, reference, tmp_path, monkeypatch):
    """Model code asserts shapes freely: one failing was "unexpected AssertionError ... a bug in ardiff", and it
    stopped the whole run. It is the pipeline's failure: its episode fails, the others go on (exit 4)."""
    from pipelines.dreamzero.pipeline import DreamZeroPipeline

    velocity = DreamZeroPipeline._velocity

    def checked(self, rollout, branch, *args):
        assert rollout.state.session_id != "arm_b", "expected a video clip (injected)"
        return velocity(self, rollout, branch, *args)

    monkeypatch.setattr(DreamZeroPipeline, "_velocity", checked)
    out = tmp_path / "run"
    result = rollout(data, out)
    monkeypatch.undo()
    assert result.exit_code == 4, result.stderr
    assert ("Error: episode 'arm_b' failed at step 0 in the model's forward: AssertionError: expected a video clip "
            "(injected)") in result.stderr
    assert "bug in ardiff" not in result.stderr
    lines = records(out)
    assert [(r["step"], r["status"]) for r in lines if r["episode"] == "arm_b"] == [(0, "failed")]
    assert [r["step"] for r in lines if r["episode"] == "arm_a"] == [0, 1, 2]


def test_a_broken_invariant_stops_the_run_as_a_bug(data, reference, tmp_path, monkeypatch):
    """An AssertionError raised in ardiff's own code (a broken internal invariant) is not one episode's problem: the
    run stops, exit 1."""
    from pipelines.dreamzero.pipeline import DreamZeroPipeline

    velocity = DreamZeroPipeline._velocity

    def corrupting(self, rollout, branch, *args):
        if rollout.state.session_id == "arm_b":  # the next page handed out is still owned: the allocator asserts
            allocator = rollout.state._cache.allocator
            allocator._owned[allocator._free[-1]] = 1
        return velocity(self, rollout, branch, *args)

    monkeypatch.setattr(DreamZeroPipeline, "_velocity", corrupting)
    out = tmp_path / "run"
    result = rollout(data, out)
    monkeypatch.undo()
    assert result.exit_code == 1, result.stderr
    assert "Traceback" in result.stderr
    assert "Error: unexpected AssertionError: " in result.stderr  # what it broke next: the release's page count
    assert re.search(r"AssertionError: page \d+ on the free list while owned: free list corrupted", result.stderr)
    assert "this is a bug" in result.stderr
    # arm_b's step 0 had committed its pages before the corruption; the next step to take a page, arm_a's, asserted
    assert [(r["episode"], r["step"], r["status"]) for r in records(out)] == [("arm_a", 0, "ok"), ("arm_b", 0, "ok")]
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"
    result = resume(out)
    assert result.exit_code == 0, result.stderr
    assert_complete(out, reference)


_TRUNCATES_AGAIN_AND_AGAIN = """
import sys

path = sys.argv[1]
with open(path, "rb") as f:
    data = f.read()
while True:  # as a sync tool or a second run writing the same outputs folder would, over and over
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(data)
"""

_PREVIEWS_AGAIN_AND_AGAIN = """
import sys, time
from pathlib import Path

from ardiff_cli.rollout import Rollout

path, reads, errors = Path(sys.argv[1]), 0, 0
deadline = time.monotonic() + float(sys.argv[2])
# and on until it read the file whole and cut short (the race ran), for a minute more at most
while time.monotonic() < deadline or (not (reads and errors) and time.monotonic() < deadline + 60):
    try:
        frame = Rollout._predicted_frame(None, path)  # a uint8 frame: the pipeline is never asked to decode
        reads += frame.shape == (2048, 4096, 3)
    except Exception:  # noqa: BLE001 - cut short or half written again: the preview warns, the run goes on
        errors += 1
print(reads, errors)
"""


def test_an_output_truncated_while_a_preview_reads_it_leaves_the_run_alive(tmp_path):
    """A preview reads each output's bytes, then parses them: it mapped the file (safetensors' load_file), and a
    file truncated while its arrays were copied out of the mapping (an outputs folder cleared or synced as the run
    went on) killed the run with SIGBUS (exit -7) and no summary, within a second or two of this race."""
    import subprocess
    import sys

    from safetensors.numpy import save_file

    path = tmp_path / "000000.safetensors"
    save_file({"frame": np.full((2048, 4096, 3), 7, dtype=np.uint8)}, str(path))  # 24 MiB: a copy takes a while
    other = subprocess.Popen([sys.executable, "-c", _TRUNCATES_AGAIN_AND_AGAIN, str(path)])
    try:
        done = subprocess.run([sys.executable, "-c", _PREVIEWS_AGAIN_AND_AGAIN, str(path), "4"], capture_output=True,
                              text=True, timeout=120)
    finally:
        other.kill()
        other.wait()
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    reads, errors = map(int, done.stdout.split())
    assert reads and errors, done.stdout  # the race ran: it read the file whole, and while it was cut short


def _ardiff(cli_env, *args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ardiff_cli", *args], env=cli_env, capture_output=True, text=True,
                          timeout=300)


def _with_a_bad_step(data, tmp_path):
    """A copy of the episodes whose arm_b step 1 is not a safetensors file (its episode fails in load, its session
    resident, after step 0 ran)."""
    import shutil

    eps = tmp_path / "eps"
    shutil.copytree(data / "eps", eps)
    (eps / "arm_b" / "step_000001.safetensors").write_bytes(b"not a safetensors file")
    return eps


def test_a_session_closed_event_says_whether_its_episode_ended_or_failed(data, tmp_path, cli_env):
    """A script reading `session_closed` tells a failed episode's session from one whose episode ended: both said
    `explicit`, the runtime's word for a caller's close_session, whatever made the rollout close them. The failed
    one carries its failed line's `error`, as a `forward_exception` close carries its exception."""
    eps = _with_a_bad_step(data, tmp_path)
    proc = _ardiff(cli_env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(tmp_path / "run"),
                   "--no-warmup", "--format", "json")
    assert proc.returncode == 4, proc.stderr
    objects = [json.loads(line) for line in proc.stdout.splitlines()]
    failed = next(i for i, o in enumerate(objects) if o["kind"] == "step" and o["status"] == "failed")
    assert objects[failed + 1]["kind"] == "session_closed"  # right after its failed line
    # whose error it carries, as a forward_exception's close carries its exception: it said "error": null
    error = objects[failed]["error"]
    assert "step_000001.safetensors: cannot read safetensors file" in error, error
    closed = {o["session_id"]: (o["reason"], o["error"]) for o in objects if o["kind"] == "session_closed"}
    assert closed == {"arm_a": ("episode_ended", None), "arm_b": ("episode_failed", error)}, closed


def test_a_refused_resume_leaves_the_run_folder_and_its_summary_as_they_were(data, tmp_path, cli_env):
    """A command refused before it runs a step (options that contradict the run, a budget too small for one
    session, a second run into the same --out) writes no summary and leaves the last one: summary.json is the run's
    last invocation that ran, with its own exit_code, and the exit code is this command's result (README)."""
    eps = _with_a_bad_step(data, tmp_path)
    run = tmp_path / "run"
    first = _ardiff(cli_env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), "--no-warmup")
    assert first.returncode == 4, first.stderr

    def files() -> dict[str, bytes]:
        return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
                and p.name != ".lock"}

    before = files()
    assert json.loads(before["summary.json"])["exit_code"] == 4
    for args, code in ((("--resume", "--dtype", "bfloat16"), 2), (("--resume", "--memory-budget", "1KiB"), 3),
                       ((str(data / "fast.yaml"), str(eps)), 2)):
        proc = _ardiff(cli_env, "rollout", "--out", str(run), "--no-warmup", "--format", "json", *args)
        assert proc.returncode == code, (args, proc.stderr)
        assert [json.loads(line)["kind"] for line in proc.stdout.splitlines()][-1] != "summary", proc.stdout
        assert files() == before, args


CHANGING = "faulty_pipelines:ChangingOutputsDreamZero"


@pytest.mark.parametrize("change, output, now, was", [
    ("actions_shape", "actions", "float32 (8, 7)", "float32 (8, 8)"),
    ("actions_dtype", "actions", "float64 (8, 8)", "float32 (8, 8)"),
    ("frame_shape", "frame", "uint8 (6, 8, 3)", "uint8 (8, 8, 3)"),
    ("no_actions", "actions", "missing", "float32 (8, 8)"),
])
def test_outputs_whose_dtype_shape_or_keys_change_midway_are_written_as_returned_with_a_warning(
        data, tmp_path, cli_env, change, output, now, was):
    """A forward whose output changes at one step of an episode (a shape, a dtype, a key missing) had it written
    with exit 0 and not a word: a script stacking the episode's step files met a ValueError, a KeyError or a silent
    upcast there. There is no output schema to refuse it by, so it is written as returned, with one warning (in
    summary.json too) naming the pipeline, episode, step, output, and what it is and was. Once a run for each
    output: arm_b's same change is not said again."""
    run = tmp_path / "run"
    changes = {"arm_a/000001": change, "arm_b/000002": change}
    proc = _ardiff({**cli_env, "ARDIFF_TEST_OUTPUTS": json.dumps(changes)}, "rollout", str(data / "fast.yaml"),
                   str(data / "eps"), "--out", str(run), "--no-warmup", "--format", "plain", "--pipeline", CHANGING)
    assert proc.returncode == 0, proc.stderr
    warning = (f"ChangingOutputsDreamZero: episode 'arm_a' step 1: output {output!r} is {now}, {was} at the episode's "
               f"step before it; written as returned, so a script that stacks the episode's {output!r} fails or "
               "converts at this step (said once a run for each output)")
    assert f"warning: {warning}\n" in proc.stderr, proc.stderr
    assert proc.stderr.count("warning:") == 1, proc.stderr
    assert json.loads((run / "summary.json").read_text())["warnings"] == [warning]
    got = load_outputs(run)
    layouts = {path: {k: (str(v.dtype), v.shape) for k, v in arrays.items()} for path, arrays in got.items()}
    assert layouts["episodes/arm_a/step_000001.safetensors"] != layouts["episodes/arm_a/step_000000.safetensors"]
    assert layouts["episodes/arm_a/step_000002.safetensors"] == layouts["episodes/arm_a/step_000000.safetensors"]


def test_outputs_of_one_layout_at_every_step_are_no_warning(data, tmp_path, cli_env):
    run = tmp_path / "run"
    proc = _ardiff(cli_env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup",
                   "--format", "plain", "--pipeline", CHANGING)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


NO_SWAP = "faulty_pipelines:ChangingOutputsNoSwap"
REPLAYED = ("ChangingOutputsNoSwap: episode 'arm_a' step 0, replayed to rebuild its session, returned other outputs "
            "than episodes/arm_a/step_000000.safetensors holds, written when it ran: 'actions' differs by up to ")


@pytest.mark.parametrize("noise", [True, False], ids=["noisy", "deterministic"])
def test_a_replayed_step_whose_outputs_differ_from_those_written_is_one_warning(data, tmp_path, cli_env, noise):
    """A pipeline that cannot export its sessions has them replayed after an eviction: the replay computes again
    the outputs of steps already written, and threw them away. A forward drawing from torch's global generator
    gave other ones, and the rebuilt session silently differed from the one behind the outputs (exit 0, not a word;
    warmup's rerun check needs an export). Compared with the step's output file: one warning naming the pipeline,
    episode, step and the difference, once a run; a deterministic forward's replays are none."""
    run = tmp_path / "run"
    env = {**cli_env, **({"ARDIFF_TEST_NOISE": "1"} if noise else {})}
    proc = _ardiff(env, "rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(run), "--no-warmup",
                   "--format", "plain", "--session-capacity", "1", "--pipeline", NO_SWAP)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"]["replayed"] == 6
    if not noise:
        assert "warning" not in proc.stderr and summary["warnings"] == [], proc.stderr
        return
    assert proc.stderr.count("warning:") == 1 and f"warning: {REPLAYED}" in proc.stderr, proc.stderr
    [warning] = summary["warnings"]
    assert warning.startswith(REPLAYED) and "(64 of 64 values); its forward is not deterministic, so" in warning
    assert "earlier run" not in warning and warning.endswith("said once a run"), warning
    # a replay's request id is not the step's (it ends in /replay): noise seeded from it differs too
    assert ("Draw the forward's noise from a generator seeded by the session's request counter, never from torch's "
            "global generator, the clock or the request id (a replay's ends in '/replay')") in warning, warning


def test_a_resume_replaying_steps_of_an_earlier_run_that_differ_says_the_run_may_round_otherwise(data, tmp_path,
                                                                                                cli_env):
    """The same check on --resume, against outputs another process wrote: the warning adds that another torch,
    ardiff or thread count may differ too."""
    eps = _with_a_bad_step(data, tmp_path)
    run = tmp_path / "run"
    env = {**cli_env, "ARDIFF_TEST_NOISE": "1"}
    args = ("--no-warmup", "--format", "plain", "--pipeline", NO_SWAP)
    proc = _ardiff(env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), *args)
    assert proc.returncode == 4 and "warning" not in proc.stderr, proc.stderr  # arm_b failed at step 1, as it read
    (eps / "arm_b" / "step_000001.safetensors").write_bytes((data / "eps" / "arm_b" / "step_000001.safetensors")
                                                            .read_bytes())
    proc = _ardiff(env, "rollout", "--resume", "--out", str(run), *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("warning:") == 1, proc.stderr
    assert ("warning: ChangingOutputsNoSwap: episode 'arm_b' step 0, replayed to rebuild its session, returned other "
            "outputs than episodes/arm_b/step_000000.safetensors holds") in proc.stderr, proc.stderr
    assert ("; its forward is not deterministic, or rounds otherwise than in the earlier run that wrote them (another "
            "torch, ardiff or CPU thread count: summary.json's resume_changes), so") in proc.stderr, proc.stderr


def test_an_output_that_holds_arrays_but_is_none_is_not_written_and_says_so(data, tmp_path, cli_env):
    """A step file holds arrays only, and other values are skipped: a forward returning its actions as a list of
    tensors (one per action step) had a step file without them, exit 0, not a word. One warning a run names it."""
    run = tmp_path / "run"
    changes = {f"{name}/{step:06d}": "actions_list" for name in ("arm_a", "arm_b") for step in range(3)}
    proc = _ardiff({**cli_env, "ARDIFF_TEST_OUTPUTS": json.dumps(changes)}, "rollout", str(data / "fast.yaml"),
                   str(data / "eps"), "--out", str(run), "--no-warmup", "--format", "plain", "--pipeline", CHANGING)
    assert proc.returncode == 0, proc.stderr
    warning = ("ChangingOutputsDreamZero: episode 'arm_a' step 0: output 'actions' is a list holding arrays, not an "
               "array, and a step file holds arrays only: it is not written; return it as one array (torch.stack) or "
               "each array under a name of its own (said once a run for each output)")
    assert f"warning: {warning}\n" in proc.stderr and proc.stderr.count("warning:") == 1, proc.stderr
    assert json.loads((run / "summary.json").read_text())["warnings"] == [warning]
    assert all(sorted(arrays) == ["frame", "latents"] for arrays in load_outputs(run).values())


def test_a_resumed_episode_whose_outputs_change_at_its_first_step_of_the_resume_is_a_warning(data, tmp_path,
                                                                                             cli_env):
    """The layout check compared a step with the episode's step before it in the same run only: an episode resumed
    after step 0, whose outputs changed shape from step 1 on (a pipeline edited between the runs), had its step
    files no longer stackable and not a word. The resume's first step of it is compared with the earlier run's
    step file before it."""
    eps = _with_a_bad_step(data, tmp_path)
    run = tmp_path / "run"
    args = ("--no-warmup", "--format", "plain", "--pipeline", CHANGING)
    proc = _ardiff(cli_env, "rollout", str(data / "fast.yaml"), str(eps), "--out", str(run), *args)
    assert proc.returncode == 4 and "warning" not in proc.stderr, proc.stderr  # arm_b failed at step 1, as it read
    (eps / "arm_b" / "step_000001.safetensors").write_bytes((data / "eps" / "arm_b" / "step_000001.safetensors")
                                                            .read_bytes())
    changes = {"arm_b/000001": "actions_shape", "arm_b/000002": "actions_shape"}
    proc = _ardiff({**cli_env, "ARDIFF_TEST_OUTPUTS": json.dumps(changes)}, "rollout", "--resume", "--out", str(run),
                   *args)
    assert proc.returncode == 0, proc.stderr
    warning = ("ChangingOutputsDreamZero: episode 'arm_b' step 1: output 'actions' is float32 (8, 7), float32 (8, 8) "
               "at the episode's step before it; written as returned, so a script that stacks the episode's "
               "'actions' fails or converts at this step (said once a run for each output)")
    assert proc.stderr.count("warning:") == 1 and f"warning: {warning}\n" in proc.stderr, proc.stderr
    assert json.loads((run / "summary.json").read_text())["warnings"] == [warning]


def test_an_output_that_holds_scalars_only_is_not_written_without_a_warning(data, tmp_path, cli_env):
    """A dict of metrics (numpy scalars, a 0-d tensor) is a value that is not written, as a float is: numpy's
    scalars have a shape and a dtype, and it was told to be 'a dict holding arrays', returned as one array
    (torch.stack), at every run."""
    run = tmp_path / "run"
    changes = {f"{name}/{step:06d}": "metrics" for name in ("arm_a", "arm_b") for step in range(3)}
    proc = _ardiff({**cli_env, "ARDIFF_TEST_OUTPUTS": json.dumps(changes)}, "rollout", str(data / "fast.yaml"),
                   str(data / "eps"), "--out", str(run), "--no-warmup", "--format", "plain", "--pipeline", CHANGING)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    assert all(sorted(arrays) == ["actions", "frame", "latents"] for arrays in load_outputs(run).values())


def test_a_deterministic_replay_of_big_endian_outputs_is_no_warning(data, tmp_path, cli_env):
    """A step file holds a big-endian numpy output little-endian, as the same float32 values: the replay's were
    compared with the file's as another dtype ('>f4', was float32), and a deterministic forward was said not to be.
    Every step's actions big-endian: no layout warning either."""
    run = tmp_path / "run"
    changes = {f"{name}/{step:06d}{suffix}": "big_endian" for name in ("arm_a", "arm_b") for step in range(3)
               for suffix in ("", "/replay")}
    proc = _ardiff({**cli_env, "ARDIFF_TEST_OUTPUTS": json.dumps(changes)}, "rollout", str(data / "fast.yaml"),
                   str(data / "eps"), "--out", str(run), "--no-warmup", "--format", "plain", "--session-capacity", "1",
                   "--pipeline", NO_SWAP)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"]["replayed"] == 6
