"""Episode files and run folders under outside damage and odd setups: each case ends in a typed error naming
the file, or simply works (file modes, run folders next to episodes, live writers that give the prompt once)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ardiff_cli.io import read_step, write_episode, write_step
from ardiff_cli.io.atomic import atomic_write_bytes
from ardiff_cli.io.demo import ensure_demo_episodes
from ardiff_cli.io.episode import discover_episodes, new_episode_folders
from ardiff_cli.io.step_file import looks_whole
from ardiff_cli.io.run import RunFolder
from ardiff_cli.io.validate import validate_step
from ardiff_cli.runtime.errors import ConfigError, ObservationError
from ardiff_cli.runtime.observation import ObservationField, ObservationSchema

REPO = Path(__file__).resolve().parents[1]
SCHEMA = ObservationSchema(fields=(ObservationField("joints", "float32", ((7,),)),), prompt_key="prompt",
                           prompt_aliases=("language_instruction",))


def good(step: int) -> dict[str, np.ndarray]:
    return {"joints": np.zeros(7, np.float32) + step}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def ardiff(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-m", "ardiff_cli", *args, "--format", "json"], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=120)


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# -- file modes ------------------------------------------------------------------------------------------------

def test_atomic_writes_get_the_mode_of_a_plain_open(tmp_path):
    path = atomic_write_bytes(tmp_path / "out.bin", b"x")
    assert mode(path) == 0o666 & ~current_umask()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002], ids=oct)
def test_every_written_file_follows_the_umask(tmp_path, umask):
    # A fresh process, because the umask is read once when ardiff_cli.io.atomic is imported.
    script = f"""
import os, sys
os.umask({umask})
import numpy as np
from pathlib import Path
from ardiff_cli.io import write_step, write_episode
from ardiff_cli.io.run import RunFolder
from ardiff_cli.io.demo import ensure_demo_episodes
from ardiff_cli.runtime.observation import ObservationField, ObservationSchema
root = Path(sys.argv[1])
write_step(root / "live", 0, {{"x": np.zeros(2, np.float32)}}, prompt="p")
write_episode(root / "rec", [{{"x": np.zeros(2, np.float32)}}], prompt="p")
run = RunFolder(root / "run")
run.start({{"config": "x"}})
run.write_step_outputs("ep", 0, {{"x": np.zeros(2, np.float32)}}, {{}})
run.append_result({{"step": 0}})
run.close()
run.write_summary({{"status": "ok"}})
schema = ObservationSchema(fields=(ObservationField("joints", "float32", ((7,),)),), prompt_key="prompt")
ensure_demo_episodes("toy", schema, (4, 4), root=root / "cache")
from pipelines.checkpoint import main
main(["init", "causal-world-tiny", str(root / "weights" / "init.safetensors")])
"""
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, cwd=REPO, timeout=120)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 10 and {p.name for p in files} >= {"episode.yaml", "run.json", "results.jsonl", "END"}
    assert {str(p.relative_to(tmp_path)): oct(mode(p)) for p in files} == {
        str(p.relative_to(tmp_path)): oct(0o666 & ~umask) for p in files}
    demo_sets = list((tmp_path / "cache" / "demo").iterdir())
    assert [oct(mode(p)) for p in demo_sets] == [oct(0o777 & ~umask)]


# -- run folders are not episodes ------------------------------------------------------------------------------

def test_run_folders_next_to_episodes_are_not_episodes(tmp_path):
    data = tmp_path / "data"
    for name in ("a", "b"):
        write_episode(data / name, [good(0)], prompt="p")
    for out in (data / "ardiff-runs" / "20250601-101500", data / "ardiff-runs" / "20250601-101501", data / "eval1"):
        run = RunFolder(out)
        run.start({"config": "x"})
        run.write_step_outputs("a", 0, good(0), {})
        run.append_result({"episode": "a", "step": 0, "status": "ok", "output": "episodes/a/step_000000.safetensors"})
        run.close()
    assert [e.name for e in discover_episodes([data])] == ["a", "b"]
    # Given as EPISODE, one is refused: its episodes/ folder used to be taken for an episode with no step files, and
    # a run that wrote no step (every episode failed at its scan) for one episode itself.
    empty = RunFolder(tmp_path / "empty-run")
    empty.start({"config": "x"})
    empty.close()
    assert sorted(p.name for p in empty.root.iterdir() if not p.name.startswith(".")) == ["results.jsonl", "run.json"]
    (empty.root / "results.jsonl").unlink()  # as an older ardiff left it: run.json alone
    for given, what in ((data / "eval1", "an ardiff run folder"), (empty.root, "an ardiff run folder"),
                        (data / "ardiff-runs", "a folder of ardiff run folders")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(given))} is {what} \(what a rollout wrote\), not an "
                                              "episode$") as info:
            discover_episodes([data / "a", given])
        # a run holding run.json: its own resume to paste; a folder of runs (or one that holds none): one of them
        again = (f"ardiff rollout --resume --out {given}" if (given / "run.json").exists() else
                 "ardiff rollout --resume -o RUN")
        assert info.value.hint.endswith(f"to finish a stopped run: {again}"), info.value.hint
    # Only ardiff's own folders are skipped: a folder holding a run folder and anything else is still an episode.
    (data / "ardiff-runs" / "notes").mkdir()
    assert [e.name for e in discover_episodes([data])] == ["a", "ardiff-runs", "b"]
    # ./ardiff-runs emptied by hand (`rm -rf ardiff-runs/*`) is still the default runs' folder, not an episode with no
    # step files that failed the next `ardiff rollout CFG .`; another empty folder still is one (--follow fills it).
    shutil.rmtree(data / "ardiff-runs")
    (data / "ardiff-runs").mkdir()
    (data / "c").mkdir()
    assert [e.name for e in discover_episodes([data])] == ["a", "b", "c"]


def test_a_run_folder_holding_only_its_lock_is_a_run_folder_not_an_episode(tmp_path):
    """A rollout takes its folder's lock before the model loads and writes run.json after: meanwhile (or for good,
    when it was stopped then) the folder holds only .lock. A second rollout of the folder above took it for an
    episode with no step files, which failed (exit 4); given as EPISODE, it was run as one."""
    data = tmp_path / "data"
    write_episode(data / "a", [good(0)], prompt="p")
    loading = RunFolder(data / "ardiff-runs" / "20250601-101500")
    loading.root.mkdir(parents=True)
    loading.lock()  # held, as by a rollout still loading its model
    try:
        assert [e.name for e in discover_episodes([data])] == ["a"]
        assert not loading.holds_run() and loading.is_run_folder()
        with pytest.raises(ConfigError, match=r" is an ardiff run folder \(what a rollout wrote\), not an episode$"):
            discover_episodes([loading.root])
    finally:
        loading.close()
    assert [e.name for e in discover_episodes([data])] == ["a"]  # one stopped while loading leaves the same
    # A robot's folder holding a file named .lock beside anything visible is still an episode.
    write_step(loading.root, 0, good(0), prompt="p")
    assert not loading.is_run_folder()
    assert [e.name for e in discover_episodes([data])] == ["a", "ardiff-runs"]


# opens every descriptor this process may have: the next open is EMFILE
HOLD_EVERY_DESCRIPTOR = """
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
"""

READ_AT_THE_LIMIT = """
import os, sys
from pathlib import Path
from ardiff_cli.io.episode import EpisodeSource
from ardiff_cli.io.step_file import load_step
""" + HOLD_EVERY_DESCRIPTOR + """
for read in (lambda: load_step(Path(sys.argv[1]) / "step_000000.safetensors"),
             lambda: EpisodeSource(name="e", path=Path(sys.argv[1])).metadata()):
    try:
        read()
    except Exception as exc:
        print(type(exc).__name__, getattr(exc, "errno", None))
"""


def test_a_step_file_read_at_the_open_files_limit_is_not_taken_for_invalid_input(tmp_path):
    """At the limit on open files, reading a step file or episode.yaml was an ObservationError (`cannot read the step
    file: Too many open files`, hint: permissions), invalid input, exit 2: the OSError goes on, as the limit's."""
    write_episode(tmp_path / "e", [good(0)], prompt="p")
    proc = subprocess.run([sys.executable, "-c", READ_AT_THE_LIMIT, str(tmp_path / "e")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.split("\n")[:2] == ["OSError 24", "OSError 24"], proc.stdout + proc.stderr


LIST_AT_THE_LIMIT = """
import os, resource, sys
from pathlib import Path
from types import SimpleNamespace
from ardiff_cli.errors_cli import exit_code_for, rule_for
from ardiff_cli.io.episode import discover_episodes, scan_steps
from ardiff_cli.io.run import RunFolder
from ardiff_cli.io.stream import StepScheduler
from ardiff_cli.rollout import Rollout
data, out = Path(sys.argv[1]), Path(sys.argv[2])
episodes = discover_episodes([data])
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))  # ulimit -n 64
""" + HOLD_EVERY_DESCRIPTOR + """
for call in (lambda: scan_steps(data / "a"), lambda: StepScheduler(episodes),
             lambda: StepScheduler(episodes, follow=True).next(),
             lambda: Rollout._append(SimpleNamespace(run_folder=RunFolder(out)), {"step": 0}),
             lambda: list(RunFolder(out).iter_records()), lambda: RunFolder(out).read_info(),
             lambda: RunFolder(out).lock()):
    try:
        call()
        print("no error")
    except Exception as exc:
        print(exit_code_for(exc), rule_for(exc).label)
"""


def test_an_episode_folder_listed_or_a_run_file_opened_at_the_open_files_limit_is_the_limits_error(tmp_path):
    """Under `ulimit -n`, listing an episode folder was `cannot list the episode folder: Too many open files` (exit 2,
    a permissions hint), appending to results.jsonl an output_error with the disk-space hint, and reading
    results.jsonl or run.json or taking the run's lock a config_error (exit 2): each is the limit's error now (exit 1,
    kind too_many_open_files, the `ulimit -n` hint), as when a step file is read there."""
    for name in ("a", "b"):
        write_episode(tmp_path / "data" / name, [good(0)], prompt="p")
    RunFolder(tmp_path / "run").start({"config": "x"})
    (tmp_path / "run" / "results.jsonl").write_text("")
    proc = subprocess.run([sys.executable, "-c", LIST_AT_THE_LIMIT, str(tmp_path / "data"), str(tmp_path / "run")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == ["1 too_many_open_files"] * 7, proc.stdout + proc.stderr


def test_a_folder_of_episodes_with_a_stray_step_file_warns_that_its_episodes_do_not_run(tmp_path):
    # A step file copied into the data folder makes it one episode: its episode folders used to be passed over
    # without a word (a run of one stray step, exit 0, for a whole dataset).
    data = tmp_path / "data"
    for name in ("a", "b"):
        write_episode(data / name, [good(0)], prompt="p")
    write_step(data, 0, good(0), prompt="p")
    warnings: list[str] = []
    assert [e.name for e in discover_episodes([data], warn=warnings.append)] == ["data"]
    assert warnings == [f"{data} is one episode (it holds episode.yaml, step_000000.safetensors); its folders a, b "
                        "hold episodes that do not run: pass them as EPISODE, or move the stray files out"]
    warnings.clear()  # an episode folder with other folders (camera frames, notes) is not warned about
    (data / "a").rename(tmp_path / "a")
    (data / "b" / "step_000000.safetensors").rename(data / "b" / "frame.png")
    (data / "b" / "episode.yaml").unlink()
    (data / "b" / "END").unlink()
    assert [e.name for e in discover_episodes([data], warn=warnings.append)] == ["data"] and warnings == []


def test_resume_of_a_misspelt_folder_says_it_does_not_exist_rather_than_to_start_a_run_there(tmp_path):
    RunFolder(tmp_path / "eval1").start({"config": "x"})
    result = ardiff("rollout", "--resume", "--out", "evall", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout.splitlines()[-1])
    assert error["message"] == "nothing to resume: there is no folder evall"
    assert "run without --resume" not in error["hint"] and "eval1" in error["hint"]
    (tmp_path / "empty").mkdir()  # a folder without a run: starting one there is the way on
    error = json.loads(ardiff("rollout", "--resume", "--out", "empty", cwd=tmp_path).stdout.splitlines()[-1])
    assert error["message"] == f"nothing to resume: {Path('empty', 'run.json')} does not exist"
    assert error["hint"] == "run without --resume to start a run in this folder"


def test_resume_of_a_run_whose_run_json_is_gone_does_not_send_the_user_back_to_a_new_run(tmp_path):
    """A run copied without its run.json (or one deleted by hand): --resume said to run without --resume, and that
    new run was refused as one over a folder that already holds a run, with a hint to --resume: a loop."""
    RunFolder(tmp_path / "eval1").start({"config": "x"})
    (tmp_path / "eval1" / "results.jsonl").write_text("")
    (tmp_path / "eval1" / "run.json").unlink()
    error = json.loads(ardiff("rollout", "--out", "eval1", cwd=tmp_path).stdout.splitlines()[-1])
    assert error["message"] == "eval1 already holds a run" and "--resume" in error["hint"]
    result = ardiff("rollout", "--resume", "--out", "eval1", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout.splitlines()[-1])
    assert error["message"] == (f"nothing to resume: {Path('eval1', 'run.json')} does not exist, though results.jsonl "
                                "does (run.json was deleted, or not copied with the run)")
    assert error["hint"] == "restore run.json from where the run was copied, or start a new run in another --out"


def test_resume_of_a_misspelt_folder_names_the_closest_run_among_many(tmp_path):
    """The hint lists the last five runs by name (the newest of timestamped ones): the run the typo was meant for
    is named too when it is not among them."""
    for name in ("eval1", "sweep1", "sweep2", "sweep3", "sweep4", "sweep5", "sweep6"):
        RunFolder(tmp_path / name).start({"config": "x"})
    error = json.loads(ardiff("rollout", "--resume", "--out", "evall", cwd=tmp_path).stdout.splitlines()[-1])
    assert error["hint"].endswith("runs in .: sweep2, sweep3, sweep4, sweep5, sweep6 and 2 more "
                                  "(did you mean 'eval1'?)"), error


def test_resume_of_a_folder_with_its_digits_swapped_is_offered_no_other_run_of_the_count(tmp_path):
    """`--out sweep21` beside sweep12 ... sweep16 was offered 'sweep12' (digits swapped counted as the same number,
    as `bfloat61` is 'bfloat16'): another run, which a pasted resume would have continued. Among numbered runs the
    number names the run; a letter mistyped is still offered the run."""
    for number in range(12, 17):
        RunFolder(tmp_path / f"sweep{number}").start({"config": "x"})
    error = json.loads(ardiff("rollout", "--resume", "--out", "sweep21", cwd=tmp_path).stdout.splitlines()[-1])
    assert error["hint"] == ("check the path (a run prints it as 'outputs: DIR'); runs in .: sweep12, sweep13, "
                             "sweep14, sweep15, sweep16"), error
    error = json.loads(ardiff("rollout", "--resume", "--out", "swep12", cwd=tmp_path).stdout.splitlines()[-1])
    assert error["hint"].endswith("sweep16 (did you mean 'sweep12'?)"), error


def test_resume_of_a_missing_folder_says_how_many_runs_are_not_listed(tmp_path):
    """The last five runs by name were listed as if they were all: 12 runs here read as five."""
    for number in range(1, 13):
        RunFolder(tmp_path / f"run{number:02}").start({"config": "x"})
    error = json.loads(ardiff("rollout", "--resume", "--out", "nothere", cwd=tmp_path).stdout.splitlines()[-1])
    assert error["hint"] == ("check the path (a run prints it as 'outputs: DIR'); runs in .: run08, run09, run10, "
                             "run11, run12 and 7 more"), error
    for number in range(6, 13):  # five: all of them, no count
        shutil.rmtree(tmp_path / f"run{number:02}")
    error = json.loads(ardiff("rollout", "--resume", "--out", "nothere", cwd=tmp_path).stdout.splitlines()[-1])
    assert error["hint"].endswith("runs in .: run01, run02, run03, run04, run05"), error


def test_resume_of_an_empty_run_json_says_it_is_empty(tmp_path):
    """A 0-byte run.json (a disk that filled as it was copied) was read as JSON: "cannot read run info: Expecting
    value: line 1 column 1 (char 0)", the parser's words for what is no text at all."""
    from ardiff_cli.io.run import RUN_INFO_HINT

    RunFolder(tmp_path / "run").start({"config": "x"})
    (tmp_path / "run" / "run.json").write_bytes(b"")
    result = ardiff("rollout", "--resume", "--out", "run", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout.splitlines()[-1])
    assert error["message"] == f"{Path('run', 'run.json')}: cannot read run info: it is empty (0 bytes)", error
    assert error["hint"] == RUN_INFO_HINT, error

# -- unreadable input files ------------------------------------------------------------------------------------

def test_binary_episode_yaml_is_named_as_not_utf8(tmp_path):
    write_step(tmp_path / "ep", 0, good(0))
    (tmp_path / "ep" / "episode.yaml").write_bytes(b"prompt: \xff\xfe\x00\x01")
    (episode,) = discover_episodes([tmp_path / "ep"])
    with pytest.raises(ObservationError, match=r"ep/episode.yaml: episode metadata is not UTF-8 text \(byte 0xff"):
        episode.metadata()


@pytest.mark.parametrize("text", ["", "# the prompt comes with the first step\n"])
def test_an_empty_episode_yaml_holds_no_metadata_and_takes_a_steps_prompt(tmp_path, text):
    """An episode.yaml with nothing in it yet (`touch`, or only comments) is no metadata, not "must be a YAML mapping,
    got NoneType"; the first step written with a prompt records it there."""
    (tmp_path / "ep").mkdir()
    (tmp_path / "ep" / "episode.yaml").write_text(text)
    (episode,) = discover_episodes([tmp_path / "ep"])
    assert episode.metadata() == {}
    write_step(tmp_path / "ep", 0, good(0), prompt="pick")
    assert (tmp_path / "ep" / "episode.yaml").read_text() == "prompt: pick\n"


@pytest.mark.parametrize(("text", "fault", "hint"), [
    ("prompt: " + "[" * 5000 + "]" * 5000, "lists or mappings are nested too deeply", "runaway brackets"),
    ("prompt: pick\nrecorded: 2024-13-45\n", "month must be in 1..12", "quote the value"),  # Python cannot hold it
    # a data file saved as episode.yaml: read whatever its size, it stalled every episode of the run for minutes
    ("prompt: pick\n# " + "x" * (1 << 20), "it takes more than 1 MiB, which no episode metadata does",
     "per-step data goes in the step files"),
])
def test_episode_yaml_the_parser_cannot_hold_is_named(tmp_path, text, fault, hint):
    """The first two were taken for a failure of the pipeline reading the first step file ('fix the pipeline'). They
    are the episode's bad input: with a hint, and exit 2 when it is the only episode."""
    write_step(tmp_path / "ep", 0, good(0))
    (tmp_path / "ep" / "episode.yaml").write_text(text)
    (episode,) = discover_episodes([tmp_path / "ep"])
    with pytest.raises(ObservationError, match=rf"ep/episode.yaml: cannot read episode metadata: {fault}$") as info:
        episode.metadata()
    assert hint in info.value.hint
    result = ardiff("rollout", "dreamzero-tiny", "ep", "-o", "run", "--no-warmup", cwd=tmp_path,
                    ARDIFF_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 2, result.stderr
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    (failed,) = [o for o in objects if o["kind"] == "episode_failed"]
    # named as run.json names the episode's folder (absolute), though given as `ep`: its resume names it alike
    assert failed["message"] == f"episode 'ep' failed: {tmp_path / 'ep' / 'episode.yaml'}: cannot read episode " + (
        f"metadata: {fault}")
    assert failed["hint"] == info.value.hint and objects[-1]["kind"] == "observation_error", objects[-1]


@pytest.mark.parametrize(("text", "where"), [("prompt: pick\nextra:\n\tcamera: wrist\n", "line 3, column 1"),
                                             ("prompt:\tpick up the cube\n", "line 1, column 8")])
def test_a_tab_in_episode_yaml_is_named_as_a_config_tab_is(tmp_path, text, where):
    """A tab (an editor's indentation, or after a colon) got the generic hint "check the indentation, quotes and
    brackets", which a config's tab no longer gets: the hint says where the tab is, as a config's does."""
    write_step(tmp_path / "ep", 0, good(0))
    (tmp_path / "ep" / "episode.yaml").write_text(text)
    result = ardiff("rollout", "dreamzero-tiny", "ep", "-o", "run", "--no-warmup", cwd=tmp_path,
                    ARDIFF_CACHE_DIR=str(tmp_path / "cache"))
    assert result.returncode == 2, result.stderr
    (failed,) = [o for o in map(json.loads, result.stdout.splitlines()) if o["kind"] == "episode_failed"]
    assert failed["message"].startswith(f"episode 'ep' failed: {tmp_path / 'ep' / 'episode.yaml'}: cannot read "
                                        f"episode metadata: not valid YAML at {where}: found character '\\t'"), failed
    assert failed["hint"] == (f"YAML indents with spaces, never tabs: replace the tab at {where} with spaces; "
                              "episode.yaml holds `key: value` lines, e.g. `prompt: pick up the red cube`"), failed


def test_an_episode_yaml_or_episode_folder_linked_to_itself_is_named_a_loop_not_a_link_to_nothing(tmp_path):
    """Both read "a link to episode.yaml, which does not exist", with a hint to mount a disk."""
    write_step(tmp_path / "ep", 0, good(0))
    (tmp_path / "ep" / "episode.yaml").symlink_to("episode.yaml")
    (episode,) = discover_episodes([tmp_path / "ep"])
    with pytest.raises(ObservationError, match=r"ep/episode.yaml: cannot read episode metadata: it is a link to "
                                               r"episode.yaml, which leads back to itself \(a loop of links\)$"):
        episode.metadata()
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(ConfigError, match=r"episode folder not found: .*loop is a link to loop, which leads back to "
                                          r"itself"):
        discover_episodes([tmp_path / "loop"])


def test_a_loop_of_links_further_down_a_chain_is_named_by_the_link_that_loops(tmp_path):
    """eps/cam -> latest -> b, b -> c -> b: cam was "a link to latest, which leads back to itself (a loop of
    links)", of a link that does not (a loop further down). The link that loops is named; a link in the loop
    itself still leads back to itself."""
    from ardiff_cli.runtime.errors import link_to_nothing

    eps = tmp_path / "eps"
    eps.mkdir()
    for link, target in [("cam", "latest"), ("latest", "b"), ("b", "c"), ("c", "b"), ("self", "self")]:
        (eps / link).symlink_to(target)
    assert link_to_nothing(eps / "self") == "a link to self, which leads back to itself (a loop of links)"
    assert link_to_nothing(eps / "b") == "a link to c, which leads back to itself (a loop of links)"
    assert link_to_nothing(eps / "latest") == "a link to b, a link that leads back to itself (a loop of links)"
    assert link_to_nothing(eps / "cam") == (f"a link to latest, which leads to {eps.resolve() / 'b'}, a link that "
                                            "leads back to itself (a loop of links)")
    with pytest.raises(ConfigError, match=rf"episode folder not found: .*cam is a link to latest, which leads to "
                                          rf"{re.escape(str(eps.resolve() / 'b'))}, a link that leads back to itself"):
        discover_episodes([eps / "cam"])


def test_a_chain_of_links_longer_than_the_system_follows_is_not_named_a_loop(tmp_path):
    """eps/cam -> l25 -> ... -> l69 -> rec, no link twice: the system gives up at 40 links (ELOOP), and cam was "a link
    to l25, which leads through more links than the system follows (a loop of links)", of a chain that loops nowhere
    (and past 64 links, of any chain). It is named by its length; a loop in a folder above a link is still a loop."""
    from ardiff_cli.runtime.errors import link_to_nothing

    eps = tmp_path / "eps"
    (eps / "rec").mkdir(parents=True)
    for i in range(1, 70):
        (eps / f"l{i}").symlink_to(f"l{i + 1}" if i < 69 else "rec")
    (eps / "cam").symlink_to("l25")
    assert link_to_nothing(eps / "cam") == "a link to l25, the first of 46 links in a row, more than the system follows"
    (eps / "long").symlink_to("l1")
    assert link_to_nothing(eps / "long") == "a link to l1, the first of 70 links in a row, more than the system follows"
    (eps / "up").symlink_to("up")
    (eps / "above").symlink_to("up/x")
    assert link_to_nothing(eps / "above") == ("a link to up/x, which leads through more links than the system "
                                              "follows (a loop of links)")


def test_a_link_to_nothing_says_whether_a_target_made_later_can_end_it(tmp_path):
    """``dangling_link``'s flag, not its wording: a follow run read "which does not exist" at the end of the words
    to tell a recording not there yet from a loop (or a chain longer than the system follows), which none ends."""
    from ardiff_cli.runtime.errors import dangling_link, link_to_nothing

    eps = tmp_path / "eps"
    eps.mkdir()
    for link, target in [("cam", "../rec/arm_a"), ("via", "cam"), ("self", "self"), ("b", "c"), ("c", "b")]:
        (eps / link).symlink_to(target)
    for i in range(1, 46):
        (eps / f"l{i}").symlink_to(f"l{i + 1}" if i < 45 else "cam")
    for name, loops in [("cam", False), ("via", False), ("self", True), ("b", True), ("l1", True)]:
        assert dangling_link(eps / name) == (link_to_nothing(eps / name), loops), name
    assert dangling_link(eps) is None and dangling_link(eps / "absent") is None


def test_write_episode_refuses_metadata_that_rollout_would_refuse_for_its_size(tmp_path):
    with pytest.raises(ValueError, match=r"metadata: episode.yaml would take \d+ bytes, more than the 1 MiB rollout "
                                         r"reads"):
        write_episode(tmp_path / "ep", [good(0)], prompt="pick", metadata={"timestamps": list(range(200_000))})
    assert not (tmp_path / "ep").exists()


@pytest.mark.parametrize("format", ["safetensors", "npz"])
def test_write_step_refuses_a_step_that_rollout_would_refuse_for_its_size(tmp_path, monkeypatch, format):
    """The writer wrote a step file over the reader's MAX_STEP_BYTES (1 GiB), which rollout then refused; both now
    read one limit, lowered here to 1 MiB so that the test holds a few MiB, not GiBs."""
    from ardiff_cli.io import step_file

    monkeypatch.setattr(step_file, "MAX_STEP_BYTES", 1 << 20)
    small = {"image": np.zeros((1, 64, 64, 3), np.uint8)}
    write_step(tmp_path / "ep", 0, small, format=format)
    assert read_step(tmp_path / "ep" / f"step_000000.{format}").arrays["image"].shape == (1, 64, 64, 3)
    big = {"image": np.zeros((4, 256, 256, 3), np.uint8)}  # 786,432 bytes: taken; twice that: refused
    write_step(tmp_path / "ep", 1, big, format=format)
    with pytest.raises(ValueError, match=r"^step 2: its file would take \d+ bytes, more than the 1.00 MiB rollout "
                                         r"reads"):
        write_step(tmp_path / "ep", 2, {"image": np.zeros((8, 256, 256, 3), np.uint8)}, format=format)
    assert sorted(p.name for p in (tmp_path / "ep").iterdir()) == [f"step_000000.{format}", f"step_000001.{format}"]


def test_npz_member_that_is_not_an_array_is_named(tmp_path):
    path = tmp_path / "step_000000.npz"
    np.savez(path, joints=np.zeros(7, np.float32))
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("notes.txt", "recorded on robot 3")
    with pytest.raises(ObservationError, match=r"step_000000.npz: expected only .npy arrays .* got other files: "
                                               r"'notes.txt'"):
        read_step(path)


def test_an_npz_of_no_arrays_is_read_as_a_step_of_none_as_an_empty_safetensors_step_is(tmp_path):
    """numpy.savez(path) with no arrays (a writer given an empty dict) writes an empty zip archive, which starts with
    its end record (`PK\\x05\\x06`): it was 'neither a zip archive nor a known format'. Read as a step holding no
    arrays, it fails validation naming the keys it lacks, as the same step written as safetensors does."""
    np.savez(tmp_path / "step_000000.npz")
    write_step(tmp_path / "st", 0, {}, format="safetensors")
    empty = read_step(tmp_path / "st" / "step_000000.safetensors")
    assert read_step(tmp_path / "step_000000.npz").arrays == empty.arrays == {}


def _safetensors_bytes(dtype: str, shape: list[int], data: bytes) -> bytes:
    header = json.dumps({"x": {"dtype": dtype, "shape": shape, "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data


def test_bfloat16_safetensors_is_named_not_called_corrupt(tmp_path):
    path = tmp_path / "step_000000.safetensors"
    path.write_bytes(_safetensors_bytes("BF16", [2], b"\x80\x3f\x00\x40"))  # 1.0, 2.0
    with pytest.raises(ObservationError) as info:
        read_step(path)
    assert str(info.value) == (f"{path}: tensor 'x' is bfloat16, which the numpy reader cannot hold; "
                               "store float32 or float16")
    assert "write_step" in info.value.hint


def test_truncated_safetensors_whose_header_length_starts_with_0x80_is_not_called_a_pickle(tmp_path):
    """A header of 128 (384, 640, ...) bytes makes the file's first byte 0x80, the first byte of a pickle."""
    from ardiff_cli.io.writer import encode_arrays

    data = b""
    for length in range(0, 64):  # metadata of growing length until the header is 128 bytes long
        data = encode_arrays({"x": np.zeros(4, np.float32)}, metadata={"k": "v" * length})
        if data[0] == 0x80:
            break
    assert data[0] == 0x80
    path = tmp_path / "step_000000.safetensors"
    path.write_bytes(data[:-4])  # a writer cut short
    with pytest.raises(ObservationError, match="truncated") as info:
        read_step(path)
    assert "pickle" not in str(info.value) and "pickle" not in info.value.hint


def test_a_one_byte_step_file_is_said_to_hold_1_byte(tmp_path):
    """A step file cut short after its first byte: "truncated or corrupt (1 bytes)"."""
    path = tmp_path / "step_000000.safetensors"
    path.write_bytes(write_step(tmp_path / "ep", 0, {"x": np.zeros(4, np.float32)}).read_bytes()[:1])
    with pytest.raises(ObservationError, match=r"truncated or corrupt \(1 byte\): ") as info:
        read_step(path)
    assert "1 bytes" not in str(info.value)


def test_a_safetensors_file_named_npz_is_named_as_safetensors_not_as_a_pickle(tmp_path):
    """A safetensors step saved under .npz: it was called 'a pickle (torch.save / pickle.dump)' when its header's
    length began with byte 0x80 (384 bytes, a DreamZero step's), and 'neither a zip archive nor a known format'
    otherwise; the error says what it is and which suffix reads it."""
    from ardiff_cli.io.writer import encode_arrays

    def step(length: int) -> bytes:
        return encode_arrays({"joints": np.zeros(7, np.float32)}, metadata={"prompt": "p" * length})

    starts_as_pickle = next(step(n) for n in range(64) if step(n)[0] == 0x80)  # a header of 128 bytes
    for data in (step(0), starts_as_pickle):
        path = tmp_path / "step_000000.npz"
        path.write_bytes(data)
        with pytest.raises(ObservationError) as info:
            read_step(path)
        assert str(info.value) == f"{path}: cannot read .npz file: it is a safetensors file, not an .npz"
        assert info.value.hint == "give it the .safetensors suffix"


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_a_torch_save_file_under_a_step_suffix_is_named_as_one(tmp_path, suffix):
    """torch.save writes a zip holding a pickle: under .safetensors it was taken for an .npz ('give it the .npz
    suffix', after which it failed again listing data.pkl), under .npz its members were listed one by one."""
    torch = pytest.importorskip("torch")
    path = tmp_path / f"step_000000{suffix}"
    torch.save({"joints": torch.zeros(7)}, path)
    with pytest.raises(ObservationError) as info:
        read_step(path)
    kind = "safetensors file" if suffix == ".safetensors" else ".npz file"
    assert str(info.value) == f"{path}: cannot read {kind}: it is a torch.save file (a zip holding a pickle), not " + (
        "safetensors" if suffix == ".safetensors" else "an .npz")
    assert "never unpickles" in info.value.hint and "safetensors.torch.save_file" in info.value.hint


def test_an_npz_object_array_is_refused_naming_its_array(tmp_path):
    """np.savez pickles an object array (a dict of calibration, a list of mixed values): the error names which
    array, never unpickling it."""
    path = tmp_path / "step_000000.npz"
    np.savez(path, joints=np.zeros(7, np.float32), calibration=np.array([{"fx": 1.0}], dtype=object))
    with pytest.raises(ObservationError) as info:
        read_step(path)
    assert str(info.value).startswith(f"{path}: cannot read .npz without pickle: ")
    assert str(info.value).endswith(" (array 'calibration')")


def test_an_npz_holding_a_key_twice_is_refused_naming_it(tmp_path):
    """A zip may hold two members of one name (numpy.savez never writes it, zipfile warns 'Duplicate name'): the step
    ran with one of them silently, while episode.yaml giving a key twice is refused."""
    path = tmp_path / "step_000000.npz"
    np.savez(path, joints=np.zeros(7, np.float32))
    with zipfile.ZipFile(path, "a") as archive, pytest.warns(UserWarning, match="Duplicate name"):
        with archive.open("joints.npy", "w") as member:
            np.lib.format.write_array(member, np.ones(7, np.float32))
    with pytest.raises(ObservationError, match=r"step_000000.npz: key 'joints' is given twice in the .npz") as info:
        read_step(path)
    assert "keep one of them" in info.value.hint


def _in_a_small_address_space(code: str, cwd: Path) -> str:
    """What ``code`` prints in a child whose address space is 2 GiB (ulimit -v): a file read whole is MemoryError."""
    import resource

    limit = 2 << 30
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO),
                                                                              os.environ.get("PYTHONPATH", "")])},
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_huge_safetensors_step_is_refused_from_its_header_without_reading_it(tmp_path):
    """A 100 GB step file (sparse: all zeros, or a valid header before a huge tail) was read whole before its header
    was checked: MemoryError, exit 3 with a hint to lower --session-capacity, the file not always named."""
    from ardiff_cli.io.writer import encode_arrays

    zeros, tailed = tmp_path / "zeros.safetensors", tmp_path / "tailed.safetensors"
    zeros.touch()
    tailed.write_bytes(encode_arrays(good(0), metadata={"prompt": "p"}))
    for path in (zeros, tailed):
        os.truncate(path, 100 << 30)
    code = ("from ardiff_cli.io import read_step\n"
            "for name in ('zeros.safetensors', 'tailed.safetensors'):\n"
            "    try:\n        read_step(name)\n"
            "    except BaseException as exc:\n        print(type(exc).__name__, exc)\n")
    lines = _in_a_small_address_space(code, tmp_path).splitlines()
    assert lines[0].startswith("ObservationError zeros.safetensors: cannot read safetensors file: truncated or "
                               "corrupt (107374182400 bytes)"), lines
    assert re.match(r"ObservationError tailed.safetensors: cannot read safetensors file: it has 107374182400 bytes, "
                    r"\d+ more than its header declares \(\d+\); safetensors refuses data after the last tensor$",
                    lines[1]), lines


def test_a_safetensors_step_with_data_after_its_last_tensor_is_named_so(tmp_path):
    from ardiff_cli.io.writer import encode_arrays

    path = tmp_path / "step_000000.safetensors"
    data = encode_arrays(good(0), metadata={"prompt": "p"})
    path.write_bytes(data + b"\0" * 16)
    with pytest.raises(ObservationError) as info:
        read_step(path)
    assert str(info.value) == (f"{path}: cannot read safetensors file: it has {len(data) + 16} bytes, 16 more than "
                               f"its header declares ({len(data)}); safetensors refuses data after the last tensor")
    path.write_bytes(data[:-4])  # cut short: named as before
    with pytest.raises(ObservationError, match="truncated or corrupt"):
        read_step(path)


def _npy_header(shape: tuple[int, ...], descr: str = "|u1") -> bytes:
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def _one_member_zip(path: Path, name: str, head: bytes, zeros: int, *, deflated: bool) -> None:
    """A zip of one member, ``head`` then ``zeros`` zero bytes, its sizes and CRC honest, built without those zeros in
    memory: stored, the file is sparse; deflated, each MiB of zeros is the same few bytes (a full flush before it)."""
    import struct
    import zlib

    block = bytes(1 << 20)
    crc = zlib.crc32(head)
    for _ in range(zeros >> 20):
        crc = zlib.crc32(block, crc)
    usize = len(head) + zeros
    if deflated:
        packer = zlib.compressobj(9, zlib.DEFLATED, -15)
        first = packer.compress(head) + packer.flush(zlib.Z_FULL_FLUSH)
        packed_block = packer.compress(block) + packer.flush(zlib.Z_FULL_FLUSH)
        last = packer.flush()
        csize = len(first) + len(packed_block) * (zeros >> 20) + len(last)
    else:
        csize = usize
    method, raw_name = 8 if deflated else 0, name.encode()
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0, crc, csize, usize, len(raw_name), 0)
    with open(path, "wb") as f:
        f.write(local + raw_name)
        if deflated:
            f.write(first)
            for _ in range(zeros >> 20):
                f.write(packed_block)
            f.write(last)
        else:
            f.write(head)
            f.seek(zeros, os.SEEK_CUR)
        directory_at = f.tell()
        entry = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc, csize, usize, len(raw_name),
                            0, 0, 0, 0, 0, 0) + raw_name
        f.write(entry + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(entry), directory_at, 0))


def test_a_huge_npz_step_is_refused_before_it_is_read_or_unpacked(tmp_path):
    """An .npz of 3 GiB of zeros (sparse, sizes honest) was read whole, and one of 2.5 GiB of zeros deflated to 2.5 MB
    (a zip bomb) unpacked whole, before anything was checked: MemoryError (exit 3, a hint to lower
    --session-capacity). A torch.save checkpoint too large to read, renamed to a step suffix, was 'a zip archive (an
    .npz?)' under .safetensors: it is named as one from its first member, as a smaller one is. A safetensors step as
    long as its header declares, 2.5 GiB, was read whole too."""
    torch = pytest.importorskip("torch")
    zeros = 2560 << 20
    _one_member_zip(tmp_path / "stored.npz", "joints.npy", _npy_header((zeros + (512 << 20),)), zeros + (512 << 20),
                    deflated=False)
    _one_member_zip(tmp_path / "bomb.npz", "joints.npy", _npy_header((zeros,)), zeros, deflated=True)
    assert (tmp_path / "bomb.npz").stat().st_size < 4 << 20
    header = json.dumps({"x": {"dtype": "U8", "shape": [zeros], "data_offsets": [0, zeros]}}).encode()
    honest = len(header).to_bytes(8, "little") + header  # a safetensors header declaring 2.5 GiB, all there
    (tmp_path / "honest.safetensors").write_bytes(honest)
    os.truncate(tmp_path / "honest.safetensors", len(honest) + zeros)
    for suffix in (".safetensors", ".npz"):
        torch.save({"joints": torch.zeros(7)}, tmp_path / f"checkpoint{suffix}")
        os.truncate(tmp_path / f"checkpoint{suffix}", (1 << 30) + 1)  # as long as a real one, never read
    code = ("from ardiff_cli.io import read_step\n"
            "for name in ('stored.npz', 'bomb.npz', 'honest.safetensors', 'checkpoint.safetensors', "
            "'checkpoint.npz'):\n"
            "    try:\n        read_step(name)\n"
            "    except BaseException as exc:\n        print(type(exc).__name__, exc)\n")
    assert _in_a_small_address_space(code, tmp_path).splitlines() == [
        "ObservationError stored.npz: cannot read .npz file: it takes 3221225718 bytes, more than the 1 GiB a step "
        "file may take",
        "ObservationError bomb.npz: cannot read .npz file: its members take 2684354688 bytes unpacked ('joints.npy': "
        "2684354688), more than the 1 GiB a step file may take",
        f"ObservationError honest.safetensors: cannot read safetensors file: it takes {len(honest) + zeros} bytes, "
        "more than the 1 GiB a step file may take",
        "ObservationError checkpoint.safetensors: cannot read safetensors file: it is a torch.save file (a zip holding "
        "a pickle), not safetensors",
        "ObservationError checkpoint.npz: cannot read .npz file: it is a torch.save file (a zip holding a pickle), not "
        "an .npz"]


def test_an_npz_array_whose_header_numpy_will_not_read_is_named_without_a_word_of_pickle(tmp_path):
    """numpy refuses an .npy header over 10,000 bytes, and its message says to pass allow_pickle=True, which ardiff
    never does; a damaged header failed the step as an error in the pipeline (tokenize's TokenError, exit 1)."""
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (7,), }"
    long = header.ljust(12_000) + "\n"
    cut = "{'descr': '<f4', 'fortran_order': False, 'shape': (7,".ljust(117) + "\n"
    for name, text in (("long", long), ("cut", cut)):
        with zipfile.ZipFile(tmp_path / f"{name}.npz", "w") as archive:
            archive.writestr("joints.npy", b"\x93NUMPY\x02\x00" + len(text).to_bytes(4, "little") + text.encode()
                             + np.zeros(7, np.float32).tobytes())
    with pytest.raises(ObservationError) as info:
        read_step(tmp_path / "long.npz")
    assert str(info.value) == (f"{tmp_path / 'long.npz'}: cannot read .npz file: array 'joints' has a .npy header of "
                               "12001 bytes, more than the 10000 numpy reads (numpy.savez writes about 120)")
    assert "pickle" not in info.value.hint and "numpy.savez" in info.value.hint
    with pytest.raises(ObservationError, match=r"cut.npz: cannot read .npz file: array 'joints' has a .npy header "
                                               r"numpy cannot read: "):
        read_step(tmp_path / "cut.npz")


def test_an_npz_whose_deflated_data_is_damaged_is_named_corrupt(tmp_path):
    """zlib's own error (`Error -3 while decompressing data`) failed the step as an error in the pipeline (exit 1)."""
    path = tmp_path / "step_000000.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("joints.npy", "w") as member:
            np.lib.format.write_array(member, np.arange(7, dtype=np.float32))
    data = bytearray(path.read_bytes())
    data[30 + len("joints.npy")] = 0xFF  # the first deflate block's type: 3, which no deflate stream has
    path.write_bytes(bytes(data))
    with pytest.raises(ObservationError) as info:
        read_step(path)
    assert str(info.value) == (f"{path}: cannot read .npz file: truncated or corrupt: Error -3 while decompressing "
                               "data: invalid block type")


@pytest.mark.parametrize("flag_offsets, message", [
    ((6, 8), "is encrypted, password required for extraction"),  # the 'encrypted' bit of each header's flags
    ((8, 10), "That compression method is not supported"),  # each header's method: 99, which zipfile does not know
])
def test_an_npz_member_zipfile_cannot_unpack_is_bad_input_not_a_pipeline_error(tmp_path, flag_offsets, message):
    """zipfile's RuntimeError (a password) and NotImplementedError (another packing) failed the step as an error in
    the pipeline: exit 1, 'fix the pipeline'."""
    path = tmp_path / "step_000000.npz"
    np.savez(path, joints=np.arange(7, dtype=np.float32))
    data = bytearray(path.read_bytes())
    local, central = data.find(b"PK\x03\x04"), data.find(b"PK\x01\x02")
    if message.startswith("That"):
        data[local + flag_offsets[0]], data[central + flag_offsets[1]] = 99, 99
    else:
        data[local + flag_offsets[0]] |= 1
        data[central + flag_offsets[1]] |= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ObservationError) as info:
        read_step(path)
    assert str(info.value).startswith(f"{path}: cannot read .npz file: ") and message in str(info.value)
    assert "without a password" in info.value.hint


def test_huge_run_files_are_refused_naming_them_not_read_whole(tmp_path):
    """A sparse 8 GB run.json, results.jsonl or .swap/kept.json in --out: `Error: MemoryError`, naming no file."""
    for name in ("run", "results", "kept"):
        run = RunFolder(tmp_path / name)
        run.start({"config": "x", "started": 1.5})
        path = {"run": run.root / "run.json", "results": run.results_path,
                "kept": run.root / ".swap" / "kept.json"}[name]
        path.parent.mkdir(exist_ok=True)
        path.touch()
        os.truncate(path, 8 << 30)
    code = ("from pathlib import Path\n"
            "from ardiff_cli.io.kept import read_kept\n"
            "from ardiff_cli.io.run import RunFolder\n"
            "for read in (lambda: RunFolder(Path('run')).read_info(), lambda: list(RunFolder(Path('results'))"
            ".iter_records()), lambda: read_kept(Path('kept/.swap'), run=1.5, warn=print)):\n"
            "    try:\n        read()\n"
            "    except BaseException as exc:\n        print(type(exc).__name__, exc)\n")
    assert _in_a_small_address_space(code, tmp_path).splitlines() == [
        "ConfigError run/run.json: cannot read run info: it takes more than 64 MiB, which no file ardiff writes there "
        "does",
        "ConfigError results/results.jsonl, line 1: it takes more than 64 MiB, which no line ardiff writes does",
        "kept/.swap/kept.json is ignored (it takes more than 64 MiB, which no file ardiff writes there does): the swap "
        "snapshots a stopped run kept there are deleted, and an episode still to run replays its done steps instead"]


def test_an_episode_yaml_linked_to_nothing_is_named_not_taken_for_no_metadata(tmp_path):
    """episode.yaml linked from a disk not mounted: it read as absent, so a step without its own prompt failed
    with 'missing prompt ... put `prompt: ...` in episode.yaml', the file the user had put it in."""
    folder = tmp_path / "ep"
    write_step(folder, 0, good(0))
    (folder / "episode.yaml").symlink_to(tmp_path / "nas" / "episode.yaml")
    (episode,) = discover_episodes([folder])
    with pytest.raises(ObservationError) as info:
        episode.metadata()
    assert str(info.value) == (f"{folder / 'episode.yaml'}: cannot read episode metadata: it is a link to "
                               f"{tmp_path / 'nas' / 'episode.yaml'}, which does not exist")
    assert "mount the disk" in info.value.hint


def test_an_episode_folder_linked_to_nothing_is_named_as_a_link(tmp_path):
    """An EPISODE that is a link to a folder on a disk not mounted read 'episode folder not found', with the hint to
    create it with mkdir -p, which fails on the link ('File exists')."""
    link = tmp_path / "pick_cube"
    link.symlink_to(tmp_path / "nas" / "pick_cube")
    with pytest.raises(ConfigError) as info:
        discover_episodes([link])
    assert str(info.value) == (f"episode folder not found: {link} is a link to {tmp_path / 'nas' / 'pick_cube'}, "
                               "which does not exist")
    assert info.value.hint == "mount the disk the link points to (or fix the link)"


@pytest.mark.parametrize("where", ["step", "episode.yaml"])
def test_a_prompt_given_twice_differently_in_one_place_is_refused_not_one_silently_taken(tmp_path, where):
    """`prompt` and `language_instruction` with different tasks in one step's metadata or one episode.yaml: one was
    taken silently (a Python request giving both is refused too); the same text under both keys runs."""
    folder = tmp_path / "ep"
    both = {"prompt": "pick the cup", "language_instruction": "place the cup"}
    if where == "step":
        write_step(folder, 0, good(0), metadata=both)
    else:
        write_episode(folder, [good(0)], metadata=both)
    (episode,) = discover_episodes([folder])
    (step,) = episode.scan()
    with pytest.raises(ObservationError) as info:
        validate_step(read_step(step.path), SCHEMA, path=step.path, episode_metadata=episode.metadata())
    named = step.path if where == "step" else folder / "episode.yaml"
    assert str(info.value) == (f"{named}: prompt given twice, differently: 'prompt' is 'pick the cup', "
                               "'language_instruction' is 'place the cup'")
    write_step(folder, 0, good(0), metadata={"prompt": "pick", "language_instruction": "pick"})
    valid = validate_step(read_step(step.path), SCHEMA, path=step.path, episode_metadata={})
    assert valid.inputs["prompt"] == "pick"


# -- damaged run folder and cache ------------------------------------------------------------------------------

def test_damaged_results_line_is_named_with_its_line(tmp_path):
    run = RunFolder(tmp_path)
    run.append_result({"episode": "ep", "step": 0, "status": "failed", "error": "x"})
    run.close()
    with open(run.results_path, "ab") as f:
        f.write(b'{"episode": garbage\n[1, 2]\n')
    with pytest.raises(ConfigError, match=r"results.jsonl, line 2: expected one JSON object per line, "
                                          r"got '\{\"episode\": garbage'") as info:
        list(run.iter_records())
    assert "delete line 2" in info.value.hint


# -- episodes a --follow run adds or moves: episodes.jsonl -------------------------------------------------------

def started_run(root: Path, names=("arm_a", "arm_b")) -> RunFolder:
    """A run folder as a rollout starts it, listing ``names`` (folders under /data/robots)."""
    run = RunFolder(root)
    run.start({"config": "dreamzero-tiny", "dtype": "float32", "started": 1796379443.5, "demo": False,
               "episodes": [{"name": name, "path": f"/data/robots/{name}"} for name in names]})
    return run


def file_state(path: Path) -> tuple[int, int, int, bytes]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns, path.read_bytes()


def test_episodes_a_followed_run_adds_or_moves_are_appended_to_episodes_jsonl_and_resume_reads_them(tmp_path):
    """Each add or move rewrote run.json whole (temp file, fsync, rename): O(episodes) bytes per episode, 156 ms an
    add at 10,000. Now run.json is left as written and each is one line of episodes.jsonl; the run's episodes, as
    --resume reads them, are those run.json held before: in the same order, with the same names and paths."""
    run = started_run(tmp_path / "run")
    before = file_state(run.root / "run.json")
    assert not run.journal_path.exists()  # a run that adds none has none
    assert run.add_episode("arm_c", Path("/data/robots/arm_c.part")) == "/data/robots/arm_c.part"
    assert run.move_episode("arm_a", Path("/data/robots/arm_a.done")) == ("/data/robots/arm_a",
                                                                        "/data/robots/arm_a.done")
    assert run.move_episode("arm_c", Path("/data/robots/arm_c")) == ("/data/robots/arm_c.part", "/data/robots/arm_c")
    assert run.add_episode("arm_d", Path("/data/robots/arm_d")) == "/data/robots/arm_d"
    run.close()
    assert file_state(run.root / "run.json") == before  # not written again: the same file, byte for byte
    assert [json.loads(line) for line in run.journal_path.read_text().splitlines()] == [
        {"kind": "added", "name": "arm_c", "path": "/data/robots/arm_c.part"},
        {"kind": "moved", "name": "arm_a", "path": "/data/robots/arm_a.done"},
        {"kind": "moved", "name": "arm_c", "path": "/data/robots/arm_c"},
        {"kind": "added", "name": "arm_d", "path": "/data/robots/arm_d"}]
    expected = [{"name": "arm_a", "path": "/data/robots/arm_a.done"}, {"name": "arm_b", "path": "/data/robots/arm_b"},
                {"name": "arm_c", "path": "/data/robots/arm_c"}, {"name": "arm_d", "path": "/data/robots/arm_d"}]
    resumed = RunFolder(run.root)
    assert resumed.resume_info()["episodes"] == resumed.read_info()["episodes"] == expected
    # a resume writes run.json back as it reads it: every episode in it, and the journal's lines counted as held
    info = resumed.read_info()
    assert (info["format"], info["journal_lines"]) == (2, 4)
    (run.root / "run.json").write_text(json.dumps(info))
    assert RunFolder(run.root).read_info()["episodes"] == expected  # not each journal line's change twice
    again = RunFolder(run.root)
    again.add_episode("arm_e", Path("/data/robots/arm_e"))  # appended after the lines run.json holds: read
    again.close()
    assert RunFolder(run.root).read_info()["episodes"] == [*expected, {"name": "arm_e", "path": "/data/robots/arm_e"}]


def test_the_bytes_an_add_writes_do_not_grow_with_the_number_of_episodes(tmp_path):
    """At 10,000 episodes each add wrote run.json's 0.96 MB again (10,000 adds: 621 s). An add now writes its own
    line, the same number of bytes at 10 episodes as at 2,000, and run.json not at all."""
    run = started_run(tmp_path / "run", names=())
    run_json = file_state(run.root / "run.json")
    written = {}
    for i in range(2000):
        size = run.journal_path.stat().st_size if run.journal_path.exists() else 0
        run.add_episode(f"ep{i:05d}", Path(f"/data/robots/ep{i:05d}"))
        written[i] = run.journal_path.stat().st_size - size
    run.close()
    line = len(json.dumps({"kind": "added", "name": "ep00000", "path": "/data/robots/ep00000"},
                          separators=(",", ":"))) + 1
    assert set(written.values()) == {line}, {n: b for n, b in written.items() if b != line}
    assert file_state(run.root / "run.json") == run_json
    assert len(RunFolder(run.root).read_info()["episodes"]) == 2000


_READS: dict[str, list[str]] = {}  # path -> one entry per open of it for reading, while a test watches it


def _count_reads(event: str, args: tuple) -> None:
    if event == "open" and _READS and isinstance(args[0], (str, os.PathLike)) and isinstance(args[2], int) \
            and not args[2] & (os.O_WRONLY | os.O_RDWR):
        opened = _READS.get(os.path.abspath(os.fspath(args[0])))
        if opened is not None:
            opened.append(event)


sys.addaudithook(_count_reads)


@pytest.fixture
def reads():
    """reads(path): the list of opens of ``path`` for reading from now on (the interpreter's own audit events)."""
    def watch(path: Path) -> list[str]:
        return _READS.setdefault(os.path.abspath(path), [])

    yield watch
    _READS.clear()


def test_run_info_read_before_the_lock_is_read_again_only_where_run_json_or_the_journal_changed(tmp_path, reads):
    """A resume read run.json and episodes.jsonl whole (O(episodes): 0.2 s at 10,000) before the lock and again
    under it, several times. read_info_again() gives back what was read while neither file changed (a copy: the
    caller's changes stay its own); an episode appended, or run.json replaced, is read."""
    run = started_run(tmp_path / "run")
    run.add_episode("arm_c", Path("/data/robots/arm_c"))
    run.close()
    journal = reads(run.journal_path)
    resumed = RunFolder(run.root)
    info = resumed.resume_info()
    assert len(journal) == 1
    info["order"] = "sequential"  # a resume fills in what it was not given again
    info["episodes"][0]["path"] = "/elsewhere"
    again = resumed.read_info_again()
    assert len(journal) == 1 and again == RunFolder(run.root).read_info() and "order" not in again
    assert len(journal) == 2  # that other RunFolder's read
    other = RunFolder(run.root)
    other.add_episode("arm_d", Path("/data/robots/arm_d"))  # another process's run, ended meanwhile
    other.close()
    del journal[:]
    assert [e["name"] for e in resumed.read_info_again()["episodes"]] == ["arm_a", "arm_b", "arm_c", "arm_d"]
    assert len(journal) == 1
    written = {**resumed.read_info_again(), "resumed_at": 1.0}
    assert len(journal) == 1
    (run.root / "run.json").write_text(json.dumps(written))  # replaced: a new file
    assert resumed.read_info_again()["resumed_at"] == 1.0 and len(journal) == 2
    resumed.wrote_info(written)  # as a resume does, under the lock: the episodes recorded are these
    resumed.add_episode("arm_e", Path("/data/robots/arm_e"))  # a followed run's first add reads nothing again
    resumed.close()
    assert len(journal) == 2
    assert [e["name"] for e in RunFolder(run.root).read_info()["episodes"]] == [
        "arm_a", "arm_b", "arm_c", "arm_d", "arm_e"]


def test_the_episode_paths_a_run_wrote_are_read_again_once_it_has_closed(tmp_path):
    """episode_paths() gives what this process wrote (start, wrote_info) without reading run.json again, while it
    holds the run. Once it has closed it, another process's resume may add and move episodes: those are read, not
    the list this one wrote (it kept it after a close that opened no journal)."""
    run = started_run(tmp_path / "run")
    assert run.episode_paths() == {"arm_a": "/data/robots/arm_a", "arm_b": "/data/robots/arm_b"}
    run.close()
    other = RunFolder(run.root)  # a resume, in another process
    other.move_episode("arm_a", Path("/data/moved/arm_a"))
    other.add_episode("arm_c", Path("/data/robots/arm_c"))
    other.close()
    assert run.episode_paths() == RunFolder(run.root).episode_paths() == {
        "arm_a": "/data/moved/arm_a", "arm_b": "/data/robots/arm_b", "arm_c": "/data/robots/arm_c"}


def test_a_loaded_resume_reads_the_runs_journal_once(tmp_path, monkeypatch, reads):
    """A resume read episodes.jsonl whole four times (before the lock, then for the checkpoint check, for run.json's
    rewrite and for the driver's episode paths); each read is O(episodes): 0.3 s at 10,000. Now once, and the run
    goes on as before: the journal's episode is the run's, its step runs, run.json holds it."""
    from fast_run import rollout, write_fast_data

    monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "data").mkdir()
    data = write_fast_data(tmp_path / "data", {"arm_a": 2, "arm_b": 2})
    out = tmp_path / "run"
    assert rollout(data, out).exit_code == 0
    # as a followed run that added arm_b writes it: run.json lists arm_a, episodes.jsonl's line adds arm_b
    info = json.loads((out / "run.json").read_text())
    arm_b = info["episodes"].pop()
    (out / "run.json").write_text(json.dumps(info))
    (out / "episodes.jsonl").write_text(json.dumps({"kind": "added", **arm_b}) + "\n")
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text("".join(lines[:-1]))  # stopped before its last step
    journal = reads(out / "episodes.jsonl")
    result = rollout(data, out, "--resume")
    assert result.exit_code == 0, result.output
    assert len(journal) == 1
    info = json.loads((out / "run.json").read_text())
    assert (info["journal_lines"], [e["name"] for e in info["episodes"]]) == (1, ["arm_a", "arm_b"])
    ok = [(r["episode"], r["step"]) for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())
          if r["status"] == "ok"]
    assert sorted(ok) == [("arm_a", 0), ("arm_a", 1), ("arm_b", 0), ("arm_b", 1)]


def test_a_journal_line_a_kill_cut_short_is_dropped_and_cut_off_by_the_next_add(tmp_path):
    run = started_run(tmp_path / "run")
    run.add_episode("arm_c", Path("/data/robots/arm_c"))
    run.close()
    with open(run.journal_path, "ab") as f:  # kill -9 (a power loss) in the middle of the next line's write
        f.write(b'{"kind":"added","name":"arm_d","pa')
    assert [e["name"] for e in RunFolder(run.root).read_info()["episodes"]] == ["arm_a", "arm_b", "arm_c"]
    assert RunFolder(run.root).read_info()["journal_lines"] == 1
    resumed = RunFolder(run.root)
    resumed.add_episode("arm_d", Path("/data/robots/arm_d"))  # the resume's --follow adds it again, whole
    resumed.close()
    assert run.journal_path.read_text().count("\n") == 2 and '"pa{' not in run.journal_path.read_text()
    assert [e["name"] for e in RunFolder(run.root).read_info()["episodes"]] == ["arm_a", "arm_b", "arm_c", "arm_d"]


@pytest.mark.parametrize(("line", "message"), [
    ('{"kind": "added", "name": "arm_c", "path": "robots/arm_c"}',
     "line 2: field 'path': expected the absolute path of the episode's folder, got 'robots/arm_c'"),
    ('{"kind": "added", "name": "arm_a", "path": "/data/robots/arm_a2"}',
     "line 2: field 'name': expected a name no episode of the run has yet (ardiff adds each once), got 'arm_a'"),
    ('{"kind": "moved", "name": "arm_x", "path": "/data/robots/arm_x"}',
     "line 2: field 'name': expected the name of one of the run's episodes (in run.json or added on an earlier "
     "line), got 'arm_x'"),
    ('{"kind": "added", "name": "../evil", "path": "/data/robots/evil"}',
     "line 2: field 'name': expected an episode name as ardiff records it, one folder name (no '/', no leading "
     "'.'), got '../evil'"),
    ('{"kind": "renamed", "name": "arm_a", "path": "/data/robots/arm_a"}',
     "line 2: field 'kind': expected 'added' or 'moved', got 'renamed'"),
    ('{"kind": "added", "name": "arm_c"}',
     "line 2: field 'path': expected the absolute path of the episode's folder, got nothing (the field is missing)"),
    ('{"kind": "added", "name": garbage',
     "line 2: expected one JSON object per line, got '{\"kind\": \"added\", \"name\": garbage'"),
])
def test_a_damaged_or_hand_edited_journal_line_is_named_with_its_file_line_and_field(tmp_path, line, message):
    run = started_run(tmp_path / "run")
    run.add_episode("arm_c", Path("/data/robots/arm_c"))
    run.close()
    text = run.journal_path.read_text()
    run.journal_path.write_text((text.replace("arm_c", "arm_0") if "arm_c" in line else text) + line + "\n")
    for read in (RunFolder(run.root).read_info, RunFolder(run.root).resume_info):
        with pytest.raises(ConfigError) as info:
            read()
        assert str(info.value) == f"{run.journal_path}, {message}"
        assert "restore the file from a backup, or correct the line" in info.value.hint


def test_a_journal_holding_fewer_lines_than_run_json_says_it_folded_is_refused(tmp_path):
    """run.json holds the first journal_lines lines of episodes.jsonl; a journal cut or deleted since would have its
    next lines skipped as held, their episodes lost (--follow would run them again as new ones)."""
    run = started_run(tmp_path / "run")
    run.add_episode("arm_c", Path("/data/robots/arm_c"))
    run.close()
    (run.root / "run.json").write_text(json.dumps(RunFolder(run.root).read_info()))  # as a resume writes it
    run.journal_path.unlink()
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(run.journal_path))}: it holds 0 whole lines, though "
                                          rf"{re.escape(str(run.root / 'run.json'))} holds its first 1 "
                                          r"\(journal_lines\): it was cut, replaced or removed since$"):
        RunFolder(run.root).read_info()
    info = json.loads((run.root / "run.json").read_text())
    (run.root / "run.json").write_text(json.dumps({**info, "journal_lines": "1"}))
    with pytest.raises(ConfigError, match=r"run.json: field 'journal_lines': expected the number of episodes.jsonl's "
                                          r"first lines that 'episodes' holds already \(an integer, 0 or more\), "
                                          r"got '1'$"):
        RunFolder(run.root).read_info()


def test_a_run_folder_of_an_ardiff_before_the_journal_is_read_as_it_was(tmp_path):
    """run.json of format 1 (no journal_lines, no episodes.jsonl) resumes: its episodes are run.json's; written back
    by a resume it is format 2."""
    root = tmp_path / "run"
    root.mkdir()
    old = {"format": 1, "config": "dreamzero-tiny", "dtype": "float32", "started": 1796379443.5, "demo": False,
           "episodes": [{"name": "arm_a", "path": "/data/robots/arm_a"}]}
    (root / "run.json").write_text(json.dumps(old))
    info = RunFolder(root).resume_info()
    assert info == {**old, "format": 2, "journal_lines": 0}
    run = RunFolder(root)
    run.add_episode("arm_b", Path("/data/robots/arm_b"))
    run.close()
    assert [e["name"] for e in RunFolder(root).read_info()["episodes"]] == ["arm_a", "arm_b"]
    (root / "run.json").write_text(json.dumps({**old, "format": 3}))
    with pytest.raises(ConfigError, match=r"run.json: written by an incompatible ardiff \(format 3\)$"):
        RunFolder(root).read_info()


def test_a_folder_holding_only_a_journal_holds_a_run_and_says_what_it_lacks(tmp_path):
    """episodes.jsonl is the run's as run.json and results.jsonl are: a folder left with it alone (run.json not
    copied) is not an empty folder to start a run in (its lines would be taken for the new run's episodes)."""
    run = started_run(tmp_path / "data" / "run")
    run.add_episode("arm_c", Path("/data/robots/arm_c"))
    run.close()
    (run.root / "run.json").unlink()
    run.results_path.unlink()
    assert run.holds_run()
    with pytest.raises(ConfigError, match=r"^nothing to resume: .*run.json does not exist, though episodes.jsonl does "
                                          r"\(run.json was deleted, or not copied with the run\)$"):
        RunFolder(run.root).read_info()
    with pytest.raises(ConfigError, match=r"already holds a run$"):
        RunFolder(run.root).start({"config": "x"})


def test_an_episode_folder_holding_a_file_named_episodes_jsonl_is_still_an_episode(tmp_path):
    """A robot's own log named episodes.jsonl beside its step files made its folder a run folder (the journal's
    name): skipped in a folder of episodes and by --follow, its steps never run. A run writes the journal after
    run.json, so the journal alone does not tell a run folder."""
    data = tmp_path / "data"
    for name in ("a", "b"):
        write_episode(data / name, [good(0)], prompt="p")
    (data / "b" / "episodes.jsonl").write_text('{"frame": 0}\n')
    assert not RunFolder(data / "b").is_run_folder()
    assert [e.name for e in discover_episodes([data])] == ["a", "b"]
    assert [p.name for p in new_episode_folders(data, set())] == ["a", "b"]
    run = started_run(data / "run")  # a run folder beside them, journal and all, is still skipped
    run.add_episode("arm_c", Path("/data/robots/arm_c"))
    run.close()
    assert [e.name for e in discover_episodes([data])] == ["a", "b"]


def test_a_journal_that_is_a_link_to_nothing_is_named_not_read_as_empty(tmp_path):
    """episodes.jsonl linked to a disk not mounted was read as no lines: with journal_lines 0 the episodes it held
    were dropped from the run's (arm_c: 2 episodes, not 3), and past 0 the error said the journal held 0 lines (cut,
    replaced or removed) instead of naming the link."""
    for folded in (False, True):
        run = started_run(tmp_path / f"run{int(folded)}")
        run.add_episode("arm_c", Path("/data/robots/arm_c"))
        run.close()
        if folded:  # as a resume writes it back
            (run.root / "run.json").write_text(json.dumps(RunFolder(run.root).read_info()))
        target = tmp_path / f"disk{int(folded)}" / "episodes.jsonl"
        target.parent.mkdir()
        run.journal_path.rename(target)
        run.journal_path.symlink_to(target)
        assert len(RunFolder(run.root).read_info()["episodes"]) == 3  # through a link: read as a file
        target.parent.rename(tmp_path / f"unmounted{int(folded)}")
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(run.journal_path))}: cannot read it: it is a link "
                                              rf"to {re.escape(str(target))}, which does not exist$") as info:
            RunFolder(run.root).read_info()
        assert "mount what it links to" in info.value.hint


NESTED = "[" * 5000 + "]" * 5000  # a few KiB of brackets: deeper than the JSON parser recurses (RecursionError)


def test_a_results_line_nested_too_deeply_is_named_with_its_line(tmp_path):
    run = RunFolder(tmp_path)
    run.append_result({"episode": "ep", "step": 0, "status": "failed", "error": "x"})
    run.close()
    with open(run.results_path, "a") as f:
        f.write(NESTED + "\n")
    with pytest.raises(ConfigError, match=r"results.jsonl, line 2: expected one JSON object per line: JSON nested too "
                                          r"deeply to read, got '\[\[\["):
        list(run.iter_records())


@pytest.mark.parametrize(("value", "reason"), [("NaN", "NaN is not JSON (ardiff writes no NaN or infinity)"),
                                               ("-Infinity", "-Infinity is not JSON (ardiff writes no NaN or "
                                                             "infinity)"),
                                               ("1e999", "1e999 is beyond the range of a float")])
def test_a_results_line_holding_nan_or_infinity_says_so(tmp_path, value, reason):
    """A line whose only fault is a NaN or an infinity (a hand edit) was refused as "expected one JSON object per
    line", which it looks like: the reason was left out."""
    run = RunFolder(tmp_path)
    run.append_result({"episode": "ep", "step": 0, "status": "failed", "error": "x"})
    run.close()
    with open(run.results_path, "a") as f:
        f.write('{"episode": "ep", "step": 1, "status": "ok", "latency": {"total_s": %s}}\n' % value)
    with pytest.raises(ConfigError, match=rf"results.jsonl, line 2: expected one JSON object per line: "
                                          rf"{re.escape(reason)}, got "):
        list(run.iter_records())


@pytest.mark.parametrize(("text", "fault"), [(NESTED, "JSON nested too deeply to read"),
                                             ("[1]", "expected a JSON object, got list")])
def test_run_info_that_is_not_an_object_is_a_config_error(tmp_path, text, fault):
    RunFolder(tmp_path).start({"config": "x"})
    (tmp_path / "run.json").write_text(text)  # was 'a bug in ardiff': RecursionError, AttributeError
    with pytest.raises(ConfigError, match=rf"run.json: cannot read run info: {re.escape(fault)}$") as info:
        RunFolder(tmp_path).read_info()
    assert "start a new run in another --out" in info.value.hint


def test_resume_of_a_run_another_run_format_wrote_is_refused_and_left_as_it_was(tmp_path):
    """A run folder written by an ardiff with another layout (run.json's "format") is not resumed with this one's
    reading of it: exit 2 naming the file and the format found, a hint naming this one's, and nothing written."""
    RunFolder(tmp_path / "run").start({"config": "dreamzero-tiny", "dtype": "float32", "episodes": []})
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    (tmp_path / "run" / "run.json").write_text(json.dumps({**info, "format": 3}))
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    result = ardiff("rollout", "--resume", "--out", "run", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout.splitlines()[-1])
    assert error["message"] == "run/run.json: written by an incompatible ardiff (format 3)", error
    assert error["hint"] == "resume it with the ardiff that started it (format 2 is this one's)", error
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before == ["results.jsonl", "run.json"]


def test_resume_of_a_file_says_it_is_a_file_not_that_no_folder_is_there(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    result = ardiff("rollout", "--resume", "--out", "notes.txt", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout.splitlines()[-1])
    assert error["message"] == "nothing to resume: notes.txt is a file, not a run folder", error
    assert "outputs: DIR" in error["hint"]


def test_a_step_file_whose_header_is_nested_too_deeply_is_not_whole_yet(tmp_path):
    """--follow asks whether a step file is whole before it reads it; a header the parser cannot nest that deep
    crashed the run. It waits instead, and a forced read names the file."""
    header = ('{"__metadata__": {"prompt": "p"}, "x": ' + NESTED + "}").encode()
    path = tmp_path / "step_000000.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    assert not looks_whole(path, path.stat().st_size)
    with pytest.raises(ObservationError, match="step_000000.safetensors: cannot read safetensors file"):
        read_step(path)


@pytest.mark.parametrize(("line", "fault"), [
    ({"episode": "ep", "step": 1, "status": "ok"}, "expected an ok line to name its 'output' file"),
    ({"step": 1, "status": "failed"}, "expected a line with an 'episode' name"),
    *[(line, "expected a line with an integer 'step' (null on a failed line of phase scan)") for line in (
        {"episode": "ep", "step": "1", "status": "ok", "output": "x"},
        {"episode": "ep", "step": None, "status": "ok", "output": "x"},
        {"episode": "ep", "step": None, "status": "failed", "phase": "load"},
        {"episode": "ep", "step": None, "status": "ok", "phase": "scan", "output": "x"})],
    ({"episode": "ep", "step": 1, "status": "done", "output": "x"}, "expected a line with 'status' ok or failed"),
    ({"episode": "ep", "step": 1, "status": "ok", "output": "x", "input_sha256": "ab12"},
     "expected 'input_sha256' to be a SHA-256 hex digest (64 hex digits)"),
    ({"episode": "ep", "step": 1, "chunk": "1", "status": "ok", "output": "x"}, "expected 'chunk' to be an integer"),
])
def test_a_results_line_lacking_what_resume_reads_is_named(tmp_path, line, fault):
    """A hand-edited line that parses but lacks a field is a ConfigError naming it, not a KeyError."""
    run = RunFolder(tmp_path)
    run.append_result({"episode": "ep", "step": 0, "status": "ok", "output": "episodes/ep/step_000000.safetensors"})
    run.append_result(line)
    run.close()
    with pytest.raises(ConfigError) as info:
        run.resume_state()
    assert str(info.value).startswith(f"{run.results_path}, line 2: {fault}, got '{{")
    assert "delete line 2" in info.value.hint


def test_resume_with_a_damaged_results_line_exits_2_naming_it(tmp_path):
    write_episode(tmp_path / "ep", [good(0)], prompt="p")
    run = RunFolder(tmp_path / "out")
    run.start({"config": "dreamzero-tiny", "dtype": "float32", "pipeline_option": None, "demo": False,
               "started": 1796379443.5, "episodes": [{"name": "ep", "path": str(tmp_path / "ep")}]})
    with open(run.results_path, "wb") as f:
        f.write(b'{"episode": garbage\n')
    result = ardiff("rollout", "--resume", "-o", "out", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout.splitlines()[-1])
    assert error["kind"] == "config_error" and "out/results.jsonl, line 1" in error["message"]
    assert "Traceback" not in result.stderr


def test_the_demo_rollout_builds_a_damaged_demo_set_again_with_a_warning(tmp_path):
    cache = tmp_path / "cache"
    first = ardiff("rollout", "--no-warmup", "-o", str(tmp_path / "r1"), cwd=tmp_path, ARDIFF_CACHE_DIR=str(cache))
    assert first.returncode == 0, first.stderr
    (step,) = cache.glob("demo/*/demo_1/step_000002.safetensors")
    step.write_bytes(step.read_bytes()[:50])  # a disk that lost the end of a cached file
    again = ardiff("rollout", "--no-warmup", "-o", str(tmp_path / "r2"), cwd=tmp_path, ARDIFF_CACHE_DIR=str(cache))
    assert again.returncode == 0, again.stderr  # its episode failed reading the file: exit 4
    warning = f"the demo episodes in {step.parents[1]} were damaged (demo_1/step_000002.safetensors has 50 bytes"
    assert f"warning: {warning}" in again.stderr, again.stderr
    for output in (tmp_path / "r1" / "episodes").rglob("*.safetensors"):
        assert output.read_bytes() == (tmp_path / "r2" / output.relative_to(tmp_path / "r1")).read_bytes()


def test_cache_folder_that_is_a_file_is_a_config_error(tmp_path):
    cache = tmp_path / "cache"
    cache.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"cannot write the demo episodes to .*cache/demo: .*cache is a file, not a "
                       "folder") as info:
        ensure_demo_episodes("toy", SCHEMA, (4, 4), root=cache)
    assert "ARDIFF_CACHE_DIR" in info.value.hint
    result = ardiff("rollout", cwd=tmp_path, ARDIFF_CACHE_DIR=str(cache))
    assert result.returncode == 2, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["kind"] == "config_error"
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["rollout", "warmup"])
@pytest.mark.parametrize("cache_is", ["a file", "a link to nothing"])
def test_a_cache_folder_that_is_a_file_or_a_link_to_nothing_is_named_so(tmp_path, command, cache_is):
    """ARDIFF_CACHE_DIR on a scratch disk not mounted read "cannot write the demo episodes to CACHE/demo: File
    exists" (and the default checkpoint's the same), and a file there read "File exists" for the checkpoint: as if
    something were in the way of the file itself, where the cache folder is what is missing."""
    cache = tmp_path / "cache"
    if cache_is == "a file":
        cache.write_text("not a folder")
    else:
        cache.symlink_to(tmp_path / "not-mounted" / "cache")
    result = ardiff(command, "causal-world-tiny", cwd=tmp_path, ARDIFF_CACHE_DIR=str(cache))
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout.splitlines()[-1])
    what = "the demo episodes" if command == "rollout" else "the default checkpoint"
    assert error["message"].startswith(f"cannot write {what} to {cache}/"), error
    if cache_is == "a file":
        assert error["message"].endswith(f": {cache} is a file, not a folder"), error
        assert error["hint"] == "set ARDIFF_CACHE_DIR to a writable folder", error
    else:
        assert error["message"].endswith(f": {cache} is a link to {tmp_path / 'not-mounted' / 'cache'}, which does "
                                         "not exist"), error
        assert error["hint"].startswith("mount the disk it links to"), error
    assert "Traceback" not in result.stderr and not (tmp_path / "not-mounted").exists()


@pytest.mark.parametrize("command", ["rollout", "warmup"])
def test_a_cache_folder_named_tilde_is_named_as_typed(tmp_path, command):
    """ARDIFF_CACHE_DIR=./~/x (a folder named "~" here) that cannot be written read "cannot write the demo episodes to
    ~/x/demo: ~ is a file": pasted, ~ is the home folder, not the one in the way. It is written ./~, as every other
    message writes such a path."""
    (tmp_path / "~").write_text("not a folder")
    result = ardiff(command, "causal-world-tiny", cwd=tmp_path, ARDIFF_CACHE_DIR="./~/x")
    assert result.returncode == 2, result.stderr
    error = json.loads(result.stdout.splitlines()[-1])
    what = "the demo episodes" if command == "rollout" else "the default checkpoint"
    assert error["message"].startswith(f"cannot write {what} to ./~/x/"), error
    assert error["message"].endswith(": ./~ is a file, not a folder"), error


def test_the_demo_episodes_go_into_a_cache_folder_named_tilde_not_the_home_folder(tmp_path, monkeypatch):
    """ARDIFF_CACHE_DIR=./~/x (a folder named "~" here, as the README gives it) wrote the demo steps into the home
    folder's ~/x/demo, and into ./~/x/demo only an empty set: `ardiff rollout` then failed its one episode, the set
    itself, `the episode folder holds no step files`, at every run after the first too."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("ARDIFF_CACHE_DIR", "./~/x")
    monkeypatch.chdir(tmp_path)
    folder = ensure_demo_episodes("toy", SCHEMA, (4, 4))
    demo = tmp_path / "~" / "x" / "demo"
    assert (tmp_path / folder).resolve().parent == demo.resolve(), folder
    assert sorted(p.name for p in (tmp_path / folder).iterdir() if p.is_dir()) == ["demo_0", "demo_1", "demo_2"]
    assert (tmp_path / folder / "demo_0" / "step_000000.safetensors").is_file()
    assert list(home.iterdir()) == [] and sorted(p.name for p in demo.iterdir()) == [folder.name]


def test_a_demo_set_whose_manifest_lists_no_files_is_built_again(tmp_path):
    """The set that ARDIFF_CACHE_DIR=./~/x left (its steps written into the home folder) lists no files, and matched
    its manifest: every later rollout reused it and failed its one episode, `the episode folder holds no step
    files`. A demo set always holds files: one that lists none is built again."""
    folder = ensure_demo_episodes("toy", SCHEMA, (4, 4), root=tmp_path)
    for episode in folder.iterdir():
        if episode.is_dir():
            shutil.rmtree(episode)
    (folder / ".manifest.json").write_text('{\n "files": {}\n}')
    said: list[str] = []
    assert ensure_demo_episodes("toy", SCHEMA, (4, 4), root=tmp_path, warn=said.append) == folder
    assert (folder / "demo_0" / "step_000000.safetensors").is_file(), sorted(folder.iterdir())
    assert len(said) == 1 and "lists no files" in said[0], said


# -- a live writer gives the prompt once -----------------------------------------------------------------------

def test_live_writer_gives_the_prompt_on_the_first_step_only(tmp_path):
    folder = tmp_path / "robot_a"
    for step in range(3):  # the README's --follow loop
        write_step(folder, step, good(step), prompt="open the drawer" if step == 0 else None)
    (episode,) = discover_episodes([folder])
    prompts = [validate_step(read_step(f.path), SCHEMA, path=f.path, episode_metadata=episode.metadata())
               .inputs["prompt"] for f in episode.scan()]
    assert prompts == ["open the drawer"] * 3


def test_step_prompt_keeps_episode_yaml_fields_and_its_prompt(tmp_path):
    folder = tmp_path / "ep"
    folder.mkdir()
    (folder / "episode.yaml").write_text("robot: franka\n")
    write_step(folder, 0, good(0), prompt="first")
    write_step(folder, 1, good(1), prompt="second")  # a step's own prompt; the episode's stays
    import yaml

    assert yaml.safe_load((folder / "episode.yaml").read_text()) == {"robot": "franka", "prompt": "first"}
    assert read_step(folder / "step_000001.safetensors").metadata["prompt"] == "second"


def test_write_step_into_an_episode_whose_episode_yaml_is_a_folder_says_so_without_the_rollouts_hint(tmp_path):
    """Recording the prompt raised the rollout's ObservationError, whose hint says to rerun with --resume: an API
    caller has no --resume. It is an IsADirectoryError naming the folder, and no step file is written."""
    folder = tmp_path / "ep"
    (folder / "episode.yaml").mkdir(parents=True)
    with pytest.raises(IsADirectoryError) as caught:
        write_step(folder, 0, good(0), prompt="p")
    assert str(caught.value) == (f"{folder / 'episode.yaml'}: the episode's episode.yaml is a folder, not a file; "
                                 "move it out of the episode folder: write_step records the episode's prompt there")
    assert not isinstance(caught.value, ObservationError) and "--resume" not in str(caught.value)
    assert sorted(p.name for p in folder.iterdir()) == ["episode.yaml"]


def test_demo_steps_exist_for_any_episode_index():
    """Tests and scripts make many episodes with demo_step: the 7th one used to overflow uint8."""
    from ardiff_cli.io.demo import demo_step
    from pipelines.dreamzero import observation_schema

    schema = observation_schema()
    steps = [demo_step(schema, (16, 16), episode, 0, 1) for episode in (0, 6, 40)]
    video = [next(v for v in step.values() if getattr(v, "dtype", None) == np.uint8) for step in steps]
    assert all(v.shape == video[0].shape for v in video)
    assert not np.array_equal(video[0], video[1]) and not np.array_equal(video[1], video[2])
