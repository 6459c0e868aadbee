"""How a run and its --resume name paths: a failed step's file alike on both, a link that leads nowhere as such
(checkpoint, --out, an episode folder), and the run.json a resume checks being the one it goes on with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn as nn

from ardiff_cli.runtime.errors import CheckpointError
from fast_run import rollout, write_fast_data
from pipelines.checkpoint import load_checkpoint


def ardiff(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ardiff_cli", *args, "--no-warmup", "--format", "json"], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_a_failed_step_file_is_named_by_its_absolute_path_on_the_run_that_started_it_as_on_its_resume(
        cli_env, tmp_path):
    """A run given `eps/bad` named the failed step `eps/bad/step_000001.safetensors` (as typed) in its Error: line,
    the failed line's `error` and summary.json's `failures`, and its --resume (which reads run.json's absolute
    paths) named the same file `/.../eps/bad/step_000001.safetensors`: a script matching failures across the runs
    saw two files. Both now name it as run.json and the failed line's `path` do."""
    write_fast_data(tmp_path, {"good": 2, "bad": 3})
    step = tmp_path / "eps" / "bad" / "step_000001.safetensors"
    step.write_bytes(step.read_bytes()[:100])  # cut short: the episode fails there, on each run
    runs = {"first": ardiff(cli_env, "rollout", "fast.yaml", "eps/good", "eps/bad", "--out", "run", cwd=tmp_path),
            "resume": ardiff(cli_env, "rollout", "--resume", "--out", "run", cwd=tmp_path)}
    failed = [r for r in json_lines((tmp_path / "run" / "results.jsonl").read_text()) if r["status"] == "failed"]
    assert len(failed) == 2 and {r["path"] for r in failed} == {str(step)}
    for (which, proc), line in zip(runs.items(), failed):
        assert proc.returncode == 4, (which, proc.stderr)
        objects = json_lines(proc.stdout)
        (episode_failed,) = [o for o in objects if o["kind"] == "episode_failed"]
        (summary,) = [o for o in objects if o["kind"] == "summary"]
        said = f"{step}: cannot read safetensors file: truncated"
        assert episode_failed["message"].startswith(f"episode 'bad' failed: {said}"), (which, episode_failed)
        assert line["error"].startswith(said), (which, line)
        assert summary["episodes"]["failures"]["bad"].startswith(said), (which, summary)
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["episodes"]["failures"] == \
            summary["episodes"]["failures"]


def test_a_checkpoint_that_is_a_link_to_nothing_is_named_a_link_with_where_it_leads(tmp_path):
    """load_checkpoint (from_config's checkpoint=, a config built in Python) said `checkpoint not found` of a link
    `ls` lists, where the config's `checkpoint:` field says where it leads."""
    link = tmp_path / "w.safetensors"
    link.symlink_to(tmp_path / "unmounted" / "w.safetensors")
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(nn.Linear(2, 2), link)
    assert str(raised.value) == (f"checkpoint {link} is a link to {tmp_path / 'unmounted' / 'w.safetensors'}, "
                                 "which does not exist")
    assert raised.value.hint == "mount or restore what it links to, or give the .safetensors file's own path"


@pytest.mark.parametrize("how", ["config", "load_checkpoint"])
def test_a_checkpoint_under_a_folder_link_to_nothing_names_that_link_and_where_it_leads(cli_env, tmp_path, how):
    """`checkpoint: weights/m.safetensors` where weights is a link to a disk not mounted said `file not found`
    (rollout), and planned with that warning (inspect-capacity): `ls weights` lists the link. The link is named."""
    write_fast_data(tmp_path, {"arm_a": 1})
    target = tmp_path / "unmounted" / "w"
    (tmp_path / "weights").symlink_to(target)
    said = f"weights/m.safetensors cannot be reached: weights is a link to {target}, which does not exist"
    if how == "load_checkpoint":
        with pytest.raises(CheckpointError) as raised:
            load_checkpoint(nn.Linear(2, 2), tmp_path / "weights" / "m.safetensors")
        assert str(raised.value) == (f"checkpoint {tmp_path / 'weights' / 'm.safetensors'} cannot be reached: "
                                     f"{tmp_path / 'weights'} is a link to {target}, which does not exist")
        return
    config = tmp_path / "ck.yaml"
    config.write_text((tmp_path / "fast.yaml").read_text() + "checkpoint: weights/m.safetensors\n")
    proc = ardiff(cli_env, "rollout", "ck.yaml", "eps", "--out", "run", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    error = json_lines(proc.stdout)[-1]
    assert error["message"] == f"ck.yaml: field 'checkpoint': {said}", error
    assert error["hint"] == "mount or restore what it links to, or give the .safetensors file's own path"
    plan = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", "ck.yaml"], cwd=tmp_path,
                          env=cli_env, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert f"warning: ck.yaml: field 'checkpoint': {said}: planned all the same" in plan.stderr, plan.stderr


def linked_episode(root: Path, name: str, steps: int) -> Path:
    """``root/eps/cam``, a link to ``root/rec/<name>``: a recorder's folder of that many steps (write_fast_data's)."""
    write_fast_data(root, {name: steps, "other": 1})
    (root / "rec").mkdir()
    (root / "eps" / name).rename(root / "rec" / name)
    link = root / "eps" / "cam"
    link.symlink_to(root / "rec" / name)
    return link


@pytest.mark.parametrize("given", [["eps"], ["eps/cam", "eps/other"]], ids=["in-a-watched-folder", "given-directly"])
def test_an_episode_folder_that_is_a_link_is_named_by_its_link_on_a_run_and_its_resume(cli_env, tmp_path, given):
    """eps/cam -> rec/arm_a: the Error: line and summary.json named the failed step in eps/cam (the folder read), but
    its failed line's `path` and run.json named it in rec/arm_a, so a script joining them by path found no episode;
    a resume given no EPISODE named it in rec/arm_a everywhere. All name the link's path now, on both runs."""
    link = linked_episode(tmp_path, "arm_a", 3)
    step = link / "step_000001.safetensors"
    step.write_bytes(step.read_bytes()[:100])  # cut short: the episode fails there, on each run
    runs = {"first": ardiff(cli_env, "rollout", "fast.yaml", *given, "--out", "run", cwd=tmp_path),
            "resume": ardiff(cli_env, "rollout", "--resume", "--out", "run", cwd=tmp_path)}
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert {e["name"]: e["path"] for e in info["episodes"]} == {"arm_a": str(link),
                                                                "other": str(tmp_path / "eps" / "other")}
    failed = [r for r in json_lines((tmp_path / "run" / "results.jsonl").read_text()) if r["status"] == "failed"]
    assert [r["path"] for r in failed] == [str(step)] * 2
    said = f"{step}: cannot read safetensors file: truncated"
    for (which, proc), line in zip(runs.items(), failed):
        assert proc.returncode == 4, (which, proc.stderr)
        objects = json_lines(proc.stdout)
        (episode_failed,) = [o for o in objects if o["kind"] == "episode_failed"]
        (summary,) = [o for o in objects if o["kind"] == "summary"]
        assert episode_failed["message"].startswith(f"episode 'arm_a' failed: {said}"), (which, episode_failed)
        assert line["error"].startswith(said), (which, line)
        assert summary["episodes"]["failures"]["arm_a"].startswith(said), (which, summary)


def test_a_resume_reads_an_episode_given_as_a_link_through_the_link(cli_env, tmp_path):
    """An episode given as a link (eps/cam -> rec/take1), not in a watched folder, failed on a step cut short; the
    recorder then put the whole recording in place (the link pointed at rec/take2). A bare --resume read run.json's
    rec/take1, the old target, and failed again: it reads the episode through the link, as run.json records it."""
    link = linked_episode(tmp_path, "take1", 2)
    whole = tmp_path / "rec" / "take2"
    whole.mkdir()
    for file in (tmp_path / "rec" / "take1").iterdir():
        (whole / file.name).write_bytes(file.read_bytes())
    step = tmp_path / "rec" / "take1" / "step_000001.safetensors"
    step.write_bytes(step.read_bytes()[:100])
    first = ardiff(cli_env, "rollout", "fast.yaml", "eps/cam", "--out", "run", cwd=tmp_path)
    assert first.returncode == 2, first.stderr  # its one episode failed
    link.unlink()
    link.symlink_to(whole)
    again = ardiff(cli_env, "rollout", "--resume", "--out", "run", cwd=tmp_path)
    assert again.returncode == 0, again.stdout
    results = json_lines((tmp_path / "run" / "results.jsonl").read_text())
    assert [(r["episode"], r["step"], r["status"]) for r in results] == [
        ("take1", 0, "ok"), ("take1", 1, "failed"), ("take1", 1, "ok")]
    assert results[1]["path"] == str(link / "step_000001.safetensors")
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["episodes"] == [{"name": "take1", "path": str(link)}]


def test_a_resume_through_a_link_pointed_at_another_recording_since_says_so(cli_env, tmp_path):
    """`rollout CFG data/latest` (latest -> d1) stopped at a step cut short; by the --resume, latest -> d2. run.json
    records the link, so the resume reads d2 under d1's name and refuses it (its step 0 is not the one that ran),
    but the hint said to restore a file nobody touched. It names the link and where it leads now; giving the
    recording that ran (d1) in the link's place finishes the run."""
    write_fast_data(tmp_path, {"d1": 3, "d2": 3})
    (tmp_path / "eps" / "latest").symlink_to("d1")
    step = tmp_path / "eps" / "d1" / "step_000002.safetensors"
    whole = step.read_bytes()
    step.write_bytes(whole[:100])
    first = ardiff(cli_env, "rollout", "fast.yaml", "eps/latest", "--out", "run", cwd=tmp_path)
    assert first.returncode == 2, first.stderr  # its one episode failed
    step.write_bytes(whole)
    (tmp_path / "eps" / "latest").unlink()
    (tmp_path / "eps" / "latest").symlink_to("d2")
    again = ardiff(cli_env, "rollout", "--resume", "--out", "run", cwd=tmp_path)
    assert again.returncode == 2, again.stderr
    (failed,) = [o for o in json_lines(again.stdout) if o["kind"] == "episode_failed"]
    assert failed["message"].startswith(f"episode 'd1' failed: {tmp_path / 'eps' / 'latest' / 'step_000000'}"
                                        ".safetensors: step 0 changed since it ran"), failed
    assert failed["hint"].startswith(f"{tmp_path / 'eps' / 'latest'} is a link, now to d2: point it back at the "
                                     "recording that ran (or restore the file as it was when it ran), or run the "
                                     "episode again"), failed
    done = ardiff(cli_env, "rollout", "--resume", "--out", "run", "fast.yaml", "eps/d1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "run" / "run.json").read_text())["episodes"] == [
        {"name": "d1", "path": str(tmp_path / "eps" / "d1")}]


def test_a_resume_of_a_folder_that_is_now_a_link_to_nothing_names_the_link_and_where_it_leads(cli_env, tmp_path):
    """`--resume --out LINK` said `there is no folder LINK`, and a recorded episode folder replaced by a link (as
    the hint of a moved one says) to a disk not mounted said the folder `is gone`: both name the link now."""
    write_fast_data(tmp_path, {"arm_a": 1})
    (tmp_path / "elsewhere").symlink_to(tmp_path / "unmounted" / "run")
    proc = ardiff(cli_env, "rollout", "--resume", "--out", "elsewhere", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    error = json_lines(proc.stdout)[-1]
    assert error["message"] == (f"nothing to resume: elsewhere is a link to {tmp_path / 'unmounted' / 'run'}, which "
                                "does not exist"), error
    assert error["hint"] == "mount the disk the link points to (or fix the link), then resume"
    assert ardiff(cli_env, "rollout", "fast.yaml", "eps", "--out", "run", cwd=tmp_path).returncode == 0
    episode = tmp_path / "eps" / "arm_a"
    episode.rename(tmp_path / "moved")
    episode.symlink_to(tmp_path / "unmounted" / "arm_a")
    proc = ardiff(cli_env, "rollout", "--resume", "--out", "run", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    error = json_lines(proc.stdout)[-1]
    assert error["message"] == (f"episode 'arm_a' of this run: its folder {episode} (recorded in "
                                f"{Path('run', 'run.json')}) is a link to {tmp_path / 'unmounted' / 'arm_a'}, which "
                                "does not exist"), error
    assert error["hint"].startswith("mount the disk the link points to (or fix the link), then resume")


_ON_OPEN: list = []  # (path, action): the action runs once, as this process first opens the path


def _act_on_open(event: str, args: tuple) -> None:
    if event == "open" and _ON_OPEN and isinstance(args[0], (str, os.PathLike)) \
            and os.path.abspath(os.fspath(args[0])) == _ON_OPEN[0][0]:
        _, action = _ON_OPEN.pop()
        action()


sys.addaudithook(_act_on_open)


def test_a_resume_goes_on_with_the_run_json_it_checked_not_one_changed_after(cli_env, tmp_path, monkeypatch):
    """A resume read run.json, checked it against its command line, and only then took the run's lock and read
    run.json again (where it had changed: another resume that ran meanwhile, an edit), going on with that second
    read unchecked: here its `dtype`, written back to run.json though the resume ran (and checked) float32. The
    lock is now taken before run.json is read, once: another resume started while this one reads its config is
    refused, and an edit made then is not what this one goes on with (it writes back the run.json it checked)."""
    monkeypatch.setenv("ARDIFF_CACHE_DIR", cli_env["ARDIFF_CACHE_DIR"])
    data = write_fast_data(tmp_path, {"arm_a": 2, "arm_b": 1})
    out = tmp_path / "run"
    assert rollout(data, out).exit_code == 0
    other: list[subprocess.CompletedProcess] = []

    def meanwhile() -> None:  # as the resume below reads its config, once it has read run.json
        other.append(ardiff(cli_env, "rollout", "--resume", "--out", str(out), cwd=tmp_path))
        info = json.loads((out / "run.json").read_text())
        (out / "run.json").write_text(json.dumps({**info, "dtype": "bfloat16"}))

    _ON_OPEN.append((str(data / "fast.yaml"), meanwhile))
    try:
        result = rollout(data, out, "--resume")
    finally:
        _ON_OPEN.clear()
    assert result.exit_code == 0, result.output
    assert len(other) == 1 and other[0].returncode == 2, other and other[0].stdout
    assert json_lines(other[0].stdout)[-1]["message"].startswith(f"{out} is in use by another ardiff rollout")
    assert json.loads((out / "run.json").read_text())["dtype"] == "float32"
    assert json.loads((out / "summary.json").read_text())["dtype"] == "float32"


def test_a_run_json_changed_between_a_resumes_first_look_and_its_lock_is_checked_as_read_again(
        cli_env, tmp_path, monkeypatch):
    """run.json changed after a resume's first look at it (before the lock, which refuses a folder holding no run
    without writing there) and before it took the lock is read again under the lock, and that is what is checked:
    here a config hash that is not the config's is refused (exit 2, run.json left as it is), where the resume went on
    unchecked with it and wrote it back to run.json (the next resume was then refused as an edited config)."""
    monkeypatch.setenv("ARDIFF_CACHE_DIR", cli_env["ARDIFF_CACHE_DIR"])
    data = write_fast_data(tmp_path, {"arm_a": 1})
    out = tmp_path / "run"
    assert rollout(data, out).exit_code == 0
    info = json.loads((out / "run.json").read_text())
    edited = json.dumps({**info, "config_sha256": "0" * 64})
    _ON_OPEN.append((str(out / ".lock"), lambda: (out / "run.json").write_text(edited)))
    try:
        result = rollout(data, out, "--resume")
    finally:
        _ON_OPEN.clear()
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"Error: config {data / 'fast.yaml'} was edited since the run started "), \
        result.output
    assert (out / "run.json").read_text() == edited


@pytest.mark.parametrize("given", [["eps"], ["eps/arm_a"]], ids=["folder-of-episodes", "episode-folder"])
def test_a_resume_names_a_link_to_nothing_above_a_recorded_episode_folder(cli_env, tmp_path, given):
    """The folder of the episodes moved to another disk, a link left at its path (as the hint of a moved folder says),
    and that disk not mounted: the resume said the folder `is gone`, and hinted `ln -s NEW eps`, of the link `ls`
    lists there. The link, not only one at the episode's own path, is named with where it leads."""
    write_fast_data(tmp_path, {"arm_a": 1})
    assert ardiff(cli_env, "rollout", "fast.yaml", *given, "--out", "run", cwd=tmp_path).returncode == 0
    eps, target = tmp_path / "eps", tmp_path / "unmounted" / "eps"
    eps.rename(tmp_path / "moved")
    eps.symlink_to(target)
    proc = ardiff(cli_env, "rollout", "--resume", "--out", "run", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    error = json_lines(proc.stdout)[-1]
    run_json = Path("run", "run.json")
    assert error["message"] == (
        f"{eps}, a folder of episodes given to this run, is a link to {target}, which does not exist (the folders of "
        f"its episodes arm_a are recorded in {run_json})" if given == ["eps"] else
        f"episode 'arm_a' of this run: its folder {eps / 'arm_a'} (recorded in {run_json}) cannot be reached: {eps} "
        f"is a link to {target}, which does not exist"), error
    assert error["hint"].startswith("mount the disk the link points to (or fix the link), then resume; or "), error


def test_a_resume_hint_for_an_out_named_in_bytes_the_locale_cannot_decode_pastes_into_bash(cli_env, tmp_path):
    """`-o 'runs é'` under LC_ALL=C with PYTHONUTF8=0: Python holds the é's bytes as lone surrogates, and the hint
    to paste read `ardiff rollout --resume --out 'runs \\udcc3\\udca9'`, a folder that does not exist (pasted: exit
    2, `nothing to resume`). It is bash's `$'runs \\xc3\\xa9'` now, which names the run's folder."""
    write_fast_data(tmp_path, {"a": 2})
    env = {**cli_env, "LC_ALL": "C", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    args = ["rollout", "fast.yaml", "eps/a", "--out", "runs é"]
    assert ardiff(env, *args, cwd=tmp_path).returncode == 0
    again = ardiff(env, *args, cwd=tmp_path)
    hint = again.stderr.splitlines()[-1]
    said = "hint: continue it with: ardiff rollout --resume --out $'runs \\xc3\\xa9'; or choose another --out"
    assert again.returncode == 2 and hint == said, again.stderr
    pasted = hint.removeprefix("hint: continue it with: ").split(";")[0]
    pasted = pasted.replace("ardiff", f"'{sys.executable}' -m ardiff_cli", 1)
    proc = subprocess.run(["bash", "-c", pasted], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "nothing left to run" in proc.stderr, proc.stderr


@pytest.mark.parametrize("above", ["folder", "link"])
def test_a_config_given_through_dot_dot_is_recorded_by_where_it_is(cli_env, tmp_path, above):
    """A rollout run from lab/ given `../fast.yaml` recorded `/x/lab/../fast.yaml` in run.json: once lab/ was
    renamed, its --resume said the config is gone, though /x/fast.yaml is there. It records /x/fast.yaml now, but
    through a link (`link/../fast.yaml` is fast.yaml beside the link's target, not beside the link) as given."""
    write_fast_data(tmp_path, {"arm_a": 2})
    config = tmp_path / "fast.yaml"
    if above == "link":  # the file read is beside the link's target: /x/fast.yaml, by name, is another config
        (tmp_path / "far" / "lab").mkdir(parents=True)
        config = config.rename(tmp_path / "far" / "fast.yaml")
        (tmp_path / "fast.yaml").write_text("not: a config\n")
        (tmp_path / "link").symlink_to(tmp_path / "far" / "lab")
    (tmp_path / "lab").mkdir()
    given = "../fast.yaml" if above == "folder" else "../link/../fast.yaml"
    first = ardiff(cli_env, "rollout", given, "../eps", "--out", "../run", cwd=tmp_path / "lab")
    assert first.returncode == 0, first.stderr
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())["config_path"]
    assert os.path.samefile(recorded, config)
    assert recorded == (str(config) if above == "folder" else str(tmp_path / "lab" / ".." / "link" / ".." /
                                                                   "fast.yaml"))
    if above == "folder":
        (tmp_path / "lab").rename(tmp_path / "lab2")
        resumed = ardiff(cli_env, "rollout", "--resume", "--out", "run", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr


def test_a_run_stopped_while_loading_records_a_config_through_a_link_and_dot_dot_as_the_file_it_read(cli_env,
                                                                                                        tmp_path):
    """The lock file's record of a new run's start (all a run stopped while its model loads leaves) wrote
    `../link/../fast.yaml`, typed in lab/, as /x/fast.yaml: '..' dropped by name, though after a link it leads
    beside the link's target. The rollout its hint pastes would read another config, here not one at all."""
    write_fast_data(tmp_path, {"arm_a": 1})
    (tmp_path / "far" / "lab").mkdir(parents=True)
    config = (tmp_path / "fast.yaml").rename(tmp_path / "far" / "fast.yaml")
    (tmp_path / "fast.yaml").write_text("not: a config\n")
    (tmp_path / "link").symlink_to(tmp_path / "far" / "lab")
    (tmp_path / "lab").mkdir()
    proc = ardiff({**cli_env, "ARDIFF_TEST_FAULTS": json.dumps([{"site": "load", "action": "raise"}])}, "rollout",
                  "../link/../fast.yaml", "../eps", "--out", "../run", "--pipeline",
                  "faulty_pipelines:FaultyDreamZero", cwd=tmp_path / "lab")
    assert proc.returncode != 0 and "InjectedFault: loading" in proc.stderr, proc.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock"]
    record = json.loads((tmp_path / "run" / ".lock").read_text().split("\n")[1])
    assert os.path.samefile(record["start"][0], config)
    assert record["start"][1] == str(tmp_path / "eps")  # no link before its '..': by name


def test_a_run_json_that_recorded_its_config_through_dot_dot_is_healed_by_a_resume_and_offered_once_renamed(
        cli_env, tmp_path):
    """A run.json an ardiff before '..' was dropped wrote (`/x/lab/../fast.yaml`, typed in lab/ as ../fast.yaml):
    once lab/ was renamed its --resume said only that the config is gone, and a resume given the config again at
    /x/fast.yaml went on but left run.json as it was, so the next resume was refused alike. A resume records the
    config where it read it ('..' dropped while lab/ is there, kept after a link: absolute_path); with lab/ gone,
    whether a link came before the '..' is not known, so /x/fast.yaml is offered in the hint, not taken."""
    write_fast_data(tmp_path, {"arm_a": 2})
    (tmp_path / "lab").mkdir()
    first = ardiff(cli_env, "rollout", "../fast.yaml", "../eps", "--out", "../run", cwd=tmp_path / "lab")
    assert first.returncode == 0, first.stderr
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    old = str(tmp_path / "lab" / ".." / "fast.yaml")
    (tmp_path / "run" / "run.json").write_text(json.dumps({**info, "config_path": old}))  # as the older ardiff did
    resumed = ardiff(cli_env, "rollout", "--resume", "--out", "run", cwd=tmp_path)  # lab/ still there: healed
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((tmp_path / "run" / "run.json").read_text())["config_path"] == str(tmp_path / "fast.yaml")
    (tmp_path / "run" / "run.json").write_text(json.dumps({**info, "config_path": old}))
    (tmp_path / "lab").rename(tmp_path / "lab2")
    refused = ardiff(cli_env, "rollout", "--resume", "--out", "run", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    error = json_lines(refused.stdout)[-1]
    assert error["message"] == f"the run's config {old} is gone", error
    offered = f"where no link comes before its '..', it is {tmp_path / 'fast.yaml'}: "
    hint = error["hint"]
    # --no-warmup, which `ardiff` gives every command here: refused before its warmup, the resume pasted skips it too
    assert hint == (f"restore it, or pass the same CONFIG again; {offered}ardiff rollout --resume --out run "
                    f"--no-warmup {tmp_path / 'fast.yaml'}"), error
    pasted = hint.split(offered, 1)[1].replace("ardiff", f"'{sys.executable}' -m ardiff_cli", 1)
    proc = subprocess.run(["bash", "-c", pasted], cwd=tmp_path, env=cli_env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    again = ardiff(cli_env, "rollout", "--resume", "--out", "run", cwd=tmp_path)  # run.json records it now
    assert again.returncode == 0, again.stderr


def test_a_config_gone_beside_a_links_target_is_not_offered_by_its_name_without_the_dot_dot(cli_env, tmp_path):
    """`link/../fast.yaml` typed in x/ (link -> deep/sub) is recorded with its '..', the file beside the link's
    target, deep/fast.yaml. That moved, the link still there, its --resume said it is gone and offered x/fast.yaml
    "where no link comes before its '..'" when one does, there for all to see: another config (pasted, refused for
    its SHA-256). Only a '..' after a folder that is gone (a run.json of an older ardiff, lab/ renamed) is offered."""
    (tmp_path / "deep" / "sub").mkdir(parents=True)
    write_fast_data(tmp_path / "deep", {"arm_a": 1})
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "link").symlink_to(tmp_path / "deep" / "sub")
    first = ardiff(cli_env, "rollout", "link/../fast.yaml", "../deep/eps", "--out", "../run", cwd=tmp_path / "x")
    assert first.returncode == 0, first.stderr
    recorded = str(tmp_path / "x" / "link" / ".." / "fast.yaml")
    assert json.loads((tmp_path / "run" / "run.json").read_text())["config_path"] == recorded
    (tmp_path / "deep" / "fast.yaml").rename(tmp_path / "deep" / "moved.yaml")
    (tmp_path / "x" / "fast.yaml").write_text("# another config\n" + (tmp_path / "deep" / "moved.yaml").read_text())
    refused = ardiff(cli_env, "rollout", "--resume", "--out", "run", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    error = json_lines(refused.stdout)[-1]
    assert (error["message"], error["hint"]) == (f"the run's config {recorded} is gone",
                                                 "restore it, or pass the same CONFIG again"), error
