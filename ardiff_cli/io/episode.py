"""Episode folders: finding them and listing their step files (reading one: :mod:`ardiff_cli.io.step_file`).

An episode is a folder of step files ordered by their step number (the last
integer in the file name: ``step_000012.safetensors`` is step 12)::

    pick_cube/
      episode.yaml              # optional: prompt and other metadata (yaml.safe_load)
      step_000000.safetensors   # observation arrays under the pipeline's schema keys
      step_000001.safetensors   #   (+ "prompt" etc. in the safetensors metadata)
      step_000002.npz           # .npz works too (np.load, allow_pickle=False)
      END                       # optional end marker (what --follow waits for)

Files whose names start with ``.`` or end in ``.tmp``/``.partial`` are
ignored, so a writer can create a step under a temporary name and rename it.
Other writers' temporary names with a step suffix (:func:`is_temporary_name`:
tempfile's ``tmpk3jx9a1b.safetensors``, ``step_000001.tmp.safetensors``) are no
step files either, though they hold a digit: a follower waits for them to be
renamed, and one left there fails its episode, naming it.
"""

from __future__ import annotations

import contextlib
import os
import re
import unicodedata
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ardiff_cli.io.step_file import METADATA_FILE, MOUNT_HINT, RERUN, going_on, read_episode_yaml
from ardiff_cli.runtime.capacity import split_unit_hint
from ardiff_cli.runtime.errors import (ConfigError, ObservationError, ResumeCommand, as_typed, first_of,
                                       link_to_nothing, shell_word, too_many_open_files)

STEP_SUFFIXES = (".safetensors", ".npz")
END_MARKER = "END"
_IGNORED_SUFFIXES = (".tmp", ".partial")
_NUMBER = re.compile(r"(\d+)")
# A writer's temporary name for a step file: tempfile's (NamedTemporaryFile(dir=episode, suffix=".safetensors"): "tmp"
# and 8 random characters), or one whose stem ends in one of these as a dot-separated part (step_000001.tmp.safetensors,
# np.savez's step_000001.npz.tmp.npz). Either may hold a digit, which would number it as a step.
_TEMPFILE_STEM = re.compile(r"tmp[a-z0-9_]{8}")
TEMPORARY_MARKERS = frozenset({"tmp", "temp", "part", "partial"})
_UNSAFE_CHARS = frozenset('/\\:*?"<>|')  # separators, and characters some file systems refuse
# Episode names become folder and file names: keep them well under NAME_MAX (255 bytes on Linux and macOS), with
# room for a collision suffix, ".png" and an atomic write's temporary name around them.
MAX_NAME_CHARS = 100
MAX_NAME_BYTES = 150  # UTF-8: 100 CJK characters would take 300 bytes


@dataclass(frozen=True, slots=True)
class StepFile:
    """One step file of an episode."""

    path: Path
    step: int  # the step number from the file name (ordering key)


@dataclass
class EpisodeSource:
    """One episode folder. ``name`` is unique in a run: it is the session id and the output folder name."""

    name: str
    path: Path
    _metadata: dict[str, Any] | None = field(default=None, repr=False)  # episode.yaml, read once
    # its folder's inode number when it was found (None: not a folder then): --follow knows it renamed before its
    # first poll (the model loading) by it
    inode: int | None = field(default=None, repr=False, compare=False)
    # its folder is a link (eps/cam -> ../rec/arm_a): the folder it led to when found (links resolved) and that
    # folder's device number; without --follow a step read through the link pointed elsewhere since is told by them
    led_to: tuple[Path, int] | None = field(default=None, repr=False, compare=False)
    # the other paths discover_episodes found its folder at and named in a warning (a second link to it in a folder of
    # episodes), as episode_folder_path gives them: a --follow poll finding one there does not name it again
    named_again: set[str] = field(default_factory=set, repr=False, compare=False)

    def scan(self, *, skip: Container[str] = (), unnumbered: list[Path] | None = None) -> list[StepFile]:
        """The step files present now, in step order; duplicate step numbers are an error. ``skip``: names not
        to look at again (the steps a follower has taken), so a poll costs one listing, not a stat per file.
        ``unnumbered``: see :func:`scan_steps`."""
        return scan_steps(self.path, skip=skip, unnumbered=unnumbered)

    def has_end_marker(self) -> bool:
        return present(self.path / END_MARKER) is True  # None (a folder it may not enter): the scan names why

    def metadata(self, go_on: str | None = None) -> dict[str, Any]:
        """``episode.yaml`` as a mapping ({} when absent); re-read until it exists (it may arrive late). ``go_on``:
        how a hint ends that says to go on once the file is fixed (``going_on``)."""
        if self._metadata is None:
            meta_path = self.path / METADATA_FILE
            if present(meta_path) is False:  # None (a folder it may not enter): reading the file says why
                dangling = link_to_nothing(meta_path)  # linked from a disk not mounted: not the same as none at all
                if dangling:
                    raise ObservationError(f"{meta_path}: cannot read episode metadata: it is {dangling}",
                                           hint=going_on(f"{MOUNT_HINT}, {RERUN}", go_on))
                return {}
            try:
                self._metadata = read_episode_yaml(meta_path)
            except ObservationError as exc:
                exc.hint = going_on(exc.hint, go_on)
                raise
        return self._metadata


def is_step_file(path: Path) -> bool:
    name = path.name
    return (
        path.suffix in STEP_SUFFIXES
        and not name.startswith(".")
        and not name.endswith(_IGNORED_SUFFIXES)
    )


def is_temporary_name(name: str) -> bool:
    """Whether ``name``, a step file's name (suffix included), is a writer's temporary name for one: tempfile's
    ``tmpXXXXXXXX.safetensors``, or a stem whose last dot-separated part is in :data:`TEMPORARY_MARKERS` (in any
    case)."""
    stem = name.rsplit(".", 1)[0]
    # the part a writer appends, just before the suffix: temp.000001.npz (a sensor's) and ep1.part.000003.npz are steps
    parts = stem.lower().rsplit(".", 1)
    return bool(_TEMPFILE_STEM.fullmatch(stem)) or (len(parts) == 2 and parts[1] in TEMPORARY_MARKERS)


def _suffix_in_other_case(name: str) -> bool:
    """Whether ``name`` ends in a step suffix written in other letter case, a hidden name's aside."""
    return name.lower().endswith(STEP_SUFFIXES) and not name.endswith(STEP_SUFFIXES) and not name.startswith(".")


def in_other_case(name: str) -> bool:
    """Whether ``name`` ends in a step suffix written in other letter case (``step_000001.SAFETENSORS``, ``.Npz``): a
    step file ardiff does not read, which left its step out without a word where it was the first or the last. A
    writer's temporary name is one in any case (``step_000001.tmp.SAFETENSORS``: renamed to lower case, it would be
    refused as one)."""
    return _suffix_in_other_case(name) and not is_temporary_name(name)


# The last letters of a step suffix in any case: a name ending otherwise is no step file in any case (a camera frame)
_STEP_LAST_LETTERS = tuple({c for suffix in STEP_SUFFIXES for c in (suffix[-1], suffix[-1].upper())})


def _number_in(path: Path) -> int | None:
    """The last integer in the file stem; None for a name without one, a writer's temporary name, or a suffix in
    other letter case (:func:`in_other_case`)."""
    if is_temporary_name(path.name) or in_other_case(path.name):
        return None
    numbers = _NUMBER.findall(path.stem)
    return int(numbers[-1]) if numbers else None


def number_in_lower_case(name: str) -> int | None:
    """The step number of a step file named ``name`` as :func:`_number_in` reads it once its suffix is in lower case
    (step_000001.SAFETENSORS: 1, as a rename makes it); None for a name without one or a writer's temporary name."""
    return _number_in(Path(_in_lower_case(name)))


def step_number(path: Path) -> int:
    """The last integer in the file stem; a name without one, or a writer's temporary name (:func:`is_temporary_name`),
    is an error naming the file."""
    number = _number_in(path)
    if number is not None:
        return number
    if in_other_case(path.name):
        raise other_case_error(path.parent, [path.name])
    if is_temporary_name(path.name):
        raise ObservationError(
            f"{as_typed(path)}: looks like a writer's temporary file that was never renamed (tempfile's tmpXXXXXXXX "
            "name, or .tmp, .temp, .part or .partial in its name), not a step file",
            hint="a recorder stopped mid-write leaves one: delete it, or rename it to its step's name "
                 "(step_000001.safetensors) if it is whole; ardiff_cli.io.write_step writes under hidden names",
        )
    raise ObservationError(
        f"{as_typed(path)}: step file name has no step number",
        hint="name step files by their step, e.g. step_000000.safetensors, step_000001.safetensors, ...",
    )


def _in_lower_case(name: str) -> str:
    """``name`` with its suffix in lower case."""
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}.{suffix.lower()}"


def other_case_error(folder: Path, names: list[str]) -> ObservationError:
    """The error of the files ``names`` (one or more) in ``folder`` whose step suffix is in other letter case
    (:func:`in_other_case`): the renames to paste, all of them in one command (a recorder that writes capitals writes
    every step so: one a run took as many runs as steps), never over a file of the name in lower case (on a
    case-insensitive file system, macOS's, the two are one file, which lists under one name)."""
    said = "suffix must be in lower case (.safetensors or .npz): ardiff does not read"
    present = set(names_in(folder))
    names = sorted(names)
    for name in names:
        lower = _in_lower_case(name)
        if lower in present:  # "mv" would put the one over the other
            path = folder / name
            return ObservationError(
                f"{as_typed(path)}: a step file's {said} this one, and {lower} is beside it",
                hint=f"keep one file per step: if {lower} is the step, delete this one (rm {shell_word(path)}); if "
                     f"this one is, replace it (mv {shell_word(path)} {shell_word(folder / lower)})")
    # a name with no number (STEP.SAFETENSORS) is refused again once its suffix is lowered: both said at once
    unnumbered = [name for name in names if not _NUMBER.search(name.rsplit(".", 1)[0])]
    if len(names) == 1:
        path, lower = folder / names[0], folder / _in_lower_case(names[0])
        if unnumbered:
            suffix = lower.suffix
            return ObservationError(
                f"{as_typed(path)}: a step file's {said} this one, and its name has no step number, so its step "
                "would be left out of the episode",
                hint=f"rename it by its step, with the suffix in lower case: mv {shell_word(path)} "
                     f"{shell_word(folder)}/step_NNNNNN{suffix} (NNNNNN: its step, e.g. step_000001{suffix})")
        return ObservationError(f"{as_typed(path)}: a step file's {said} this one, so its step would be left out of "
                                "the episode", hint=f"rename it: mv {shell_word(path)} {shell_word(lower)}")
    suffixes = sorted({"." + name.rsplit(".", 1)[1] for name in names})
    renames = "; ".join(f'for f in {shell_word(folder)}/*{suffix}; do mv "$f" "${{f%{suffix}}}{suffix.lower()}"; '
                        "done" for suffix in suffixes)
    # apart, not one more item of the list of names; its example keeps that file's own suffix (an .npz is no
    # .safetensors)
    nameless = (f" ({first_of(unnumbered, 2)} {'has' if len(unnumbered) == 1 else 'have'} no step number either)"
                if unnumbered else "")
    example = "" if not unnumbered else f"step_000001.{unnumbered[0].rsplit('.', 1)[1].lower()}"
    return ObservationError(
        f"{as_typed(folder)}: {len(names)} step files' suffixes must be in lower case (.safetensors or .npz): ardiff "
        f"does not read {first_of(names, 2)}{nameless}, so their steps would be left out of the episode",
        hint=f"rename them: {renames}" + (f"; then name each one without a number by its step ({example})"
                                          if unnumbered else ""))


def safe_name(name: str) -> str:
    """``name`` made safe to use as one file or folder name inside the output folder.

    Episode names are session ids and output folder names (``OUT/episodes/<name>/``,
    ``OUT/previews/<name>.png``), and they are printed: path separators and
    characters file systems refuse become ``_``, control characters (terminal
    escapes, newlines) too, and the line and paragraph separators (U+2028, U+2029:
    Python's ``splitlines()`` splits at them), a leading dot becomes ``_`` (so ``.``
    and ``..`` cannot climb out and no output is hidden), and the length is capped
    (characters and UTF-8 bytes). A name with nothing left is ``episode``.
    """
    chars = ["_" if c in _UNSAFE_CHARS or unicodedata.category(c)[0] == "C" or c in "\u2028\u2029" else c
             for c in str(name)]
    cleaned = "".join(chars).strip()[:MAX_NAME_CHARS]
    while len(cleaned.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        cleaned = cleaned[:-1]
    cleaned = cleaned.strip()
    if cleaned.startswith("."):
        cleaned = "_" + cleaned[1:]
    return cleaned or "episode"


_SEPARATORS_MADE_SAFE = {0x2028: "_", 0x2029: "_"}


def is_recorded_name(name: str) -> bool:
    """Whether ``name`` is an episode name as ardiff records it (run.json, ``OUT/episodes/<name>/``): what
    :func:`safe_name` gives, or what it gave before it made U+2028 and U+2029 ``_`` (a run started then is resumed
    under its names: its outputs are in their folders; messages show the separators as ``\\u2028``, ``\\u2029``)."""
    return safe_name(name) in (name, name.translate(_SEPARATORS_MADE_SAFE))


def missing_steps(steps: list[int], limit: int) -> tuple[list[int], int]:
    """The first ``limit`` step numbers absent between the first and the last of ``steps`` (sorted, distinct), and
    how many are absent in all. Never the whole list: steps numbered by a timestamp (``step_1733312345123``) leave
    10**12 numbers out, and listing them filled the memory."""
    missing: list[int] = []
    count = 0
    for before, after in zip(steps, steps[1:]):
        missing.extend(range(before + 1, min(after, before + 1 + limit - len(missing))))
        count += after - before - 1
    return missing, count


def names_in(folder: Path) -> list[str]:
    """``os.listdir(folder)``; [] when it is gone or unreadable."""
    try:
        return os.listdir(folder)
    except OSError:
        return []


def other_step_formats(folder: Path) -> list[str]:
    """Files in ``folder`` named as steps in a format ardiff does not read (``step_000000.npy``, ``.pt``), sorted
    (a step suffix in capitals, ``.SAFETENSORS``, fails the scan first: :func:`in_other_case`)."""
    return sorted(n for n in names_in(folder) if n.lower().startswith("step") and any(c.isdigit() for c in n)
                  and not n.startswith(".") and not n.endswith(STEP_SUFFIXES))


def gap_error(folder: Path, steps: list[int], missing: list[int], count: int) -> ObservationError:
    """``missing``: the first missing steps (five are shown), of ``count`` in all."""
    shown = first_of([str(step) for step in missing], 5, count)
    others = other_step_formats(folder)  # the missing step may be one of them: a .npy, a .pt
    return ObservationError(
        f"{as_typed(folder)}: step{'s' if count > 1 else ''} {shown} missing: the episode has steps "
        f"{steps[0]}..{steps[-1]} with a gap (expected consecutive step numbers)"
        + (f"; it also holds {listed(others)}, which ardiff does not read (a step file ends in .safetensors or "
           ".npz)" if others else ""),
        hint="add the missing step files, or renumber the steps consecutively; outputs of a session depend on "
             "every earlier step, so a gap is never skipped silently",
    )


def present(path: Path) -> bool | None:
    """Whether ``path`` exists; None where this user may not look (EACCES on a folder on its path, which Python
    3.11's Path.exists raises for), so that each caller says what that means for it."""
    try:
        return path.exists()
    except OSError:
        return None


def unreadable_folder(folder: Path, exc: OSError) -> ObservationError:
    """The error of an episode folder that cannot be listed, or looked into (EACCES on it or a folder above). The
    limit on open files is the process's, not the folder's: ``exc`` is raised again as it is (exit 1, not invalid
    input)."""
    if too_many_open_files(exc):
        raise exc
    return ObservationError(f"{as_typed(folder)}: cannot list the episode folder: {exc.strerror or exc}",
                            hint="check that the folder exists and that the user running ardiff may read and enter "
                                 "it (permissions r-x)")


def _list_names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError as exc:
        raise unreadable_folder(folder, exc) from None


def _list_folder(folder: Path) -> list[Path]:
    return [folder / name for name in _list_names(folder)]


def scan_steps(folder: Path, *, skip: Container[str] = (), unnumbered: list[Path] | None = None) -> list[StepFile]:
    """The step files of ``folder`` in step order, except those named in ``skip`` (not even stat'ed). A step file
    whose name has no step number, is a writer's temporary name (:func:`is_temporary_name`) or has its suffix in other
    letter case (:func:`in_other_case`, all named in one error) is an error, unless ``unnumbered`` is given: it is
    appended there (a follower waits to see it renamed to its step's name, but for one in other letter case: it fails
    the episode at that poll)."""
    steps: dict[int, Path] = {}
    other_case: list[str] = []  # names of step files in other letter case: failed all at once
    for name in _list_names(folder):
        # By name first: a follower lists its folders 10 times a second, and a robot's folder may hold thousands
        # of other files (camera frames), each made a Path and checked on every poll (20,000: 39 ms, now 8 ms).
        if name in skip or not name.endswith(_STEP_LAST_LETTERS):
            continue
        if not name.endswith(STEP_SUFFIXES):
            if in_other_case(name):  # a step file all the same: failed, or waited for to be renamed, never passed over
                other_case.append(name)
            elif _suffix_in_other_case(name):  # a writer's temporary name in capitals: as one in lower case
                if unnumbered is None:
                    step_number(folder / name)  # raises: a writer's temporary name
                unnumbered.append(folder / name)
            continue
        path = folder / name
        if not is_step_file(path):
            continue  # a folder, a dangling link or a FIFO is kept: reading it names the problem, not a silent gap
        try:  # in a folder this user may list but not enter (mode 444), EACCES: the caller names the folder
            path.lstat()
        except (FileNotFoundError, NotADirectoryError):
            pass  # deleted since the listing: reading it says so
        number = _number_in(path)
        if number is None:
            if unnumbered is None:
                step_number(path)  # raises, saying which: no step number, or a writer's temporary name
            unnumbered.append(path)
            continue
        if number in steps:
            raise ObservationError(
                f"{as_typed(folder)}: two files for step {number}: {steps[number].name} and {path.name}",
                hint="keep one file per step",
            )
        steps[number] = path
    if other_case and unnumbered is None:
        raise other_case_error(folder, other_case)
    if unnumbered is not None:
        unnumbered.extend(folder / name for name in other_case)
    return [StepFile(path=steps[n], step=n) for n in sorted(steps)]


def episode_entries(folder: Path) -> list[str]:
    """The names in ``folder`` that make it an episode folder (step files, ``episode.yaml``, ``END``), sorted."""
    return sorted(n for n in names_in(folder) if n in (METADATA_FILE, END_MARKER) or is_step_file(folder / n))


def listed(names: list[str], limit: int = 3) -> str:
    """The first ``limit`` names, comma-separated, with ', ...' when there are more."""
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def _holds_episode(folder: Path) -> bool:
    try:  # Path.exists raises PermissionError in a folder this user may not enter (--resume of a folder locked since)
        if (folder / METADATA_FILE).exists() or (folder / END_MARKER).exists():
            return True
        children = list(folder.iterdir())
    except OSError:
        return True  # unreadable: an episode whose error is reported with it, while the others run
    return any(p.is_file() and is_step_file(p) for p in children) or not any(p.is_dir() for p in children)


# the hints' words for the rollout a lock file records, once its load was refused (RunFolder.record_refusal)
REFUSED_AGAIN = "change that in the rollout refused, then run it again"


class FoundRun(NamedTuple):
    """What :func:`run_output` found: ``what`` the folder is, ``again`` the command to paste, and ``why`` (None when
    ``again`` is the resume that finishes its run): why nothing there resumes, ``again`` then the rollout that starts
    the run again (None while the run is loading its model now), which a hint words as :attr:`restart`; ``run``: the
    run folder they are of, where ``what`` is the folder of run folders that holds it alone; ``refused``: that
    rollout's load was refused (:meth:`RunFolder.record_refusal`), so ``again`` is the command to change, not to run
    as it is; ``complete``: its run ended with every step done (:meth:`RunFolder.is_complete`), so its resume runs
    only the steps its episodes got since, which a hint words as :meth:`finish`."""

    what: str
    again: ResumeCommand | str | None
    why: str | None = None
    run: Path | None = None
    refused: bool = False
    complete: bool = False

    def finish(self, which: str) -> str:
        """A hint's words for ``again``, a resume (``why`` None): to finish ``which``, or, its run ``complete``, what
        that resume still does."""
        if self.complete:
            run = "its run" if self.what == "an ardiff run folder" else "its one run"
            return f"{run} is complete (summary.json: status ok); a resume runs only steps added since: {self.again}"
        return f"to finish {which}: {self.again}"

    @property
    def restart(self) -> str:
        """A hint's words for a run with nothing to resume (``why`` set): why, and what to do."""
        which = "it" if self.run is None else f"its one run, {as_typed(self.run)},"
        if self.again is None:
            return f"{which} has no run.json yet: {self.why}"
        if self.refused:
            return f"{which} has no run.json: {self.why}; {REFUSED_AGAIN}: {self.again}"
        return f"{which} has no run.json: {self.why}; to start its run again: {self.again}"


def run_output(folder: Path, *, config: str | None = None, episodes: Iterable[Path] = (),
               asked: ResumeCommand | None = None) -> FoundRun | None:
    """For a folder that :func:`is_run_output` and no episode folder: what it is (``an ardiff run folder``, ``a
    folder of ardiff run folders``) and the resume that finishes its run, to paste (with the ``--pipeline`` the run
    was started with; for a folder of run folders, its one run's, else ``-o RUN``). A run folder holding only the
    ``.lock`` of a run whose model was loading has no run.json, which a resume refuses ("nothing to resume"): its
    command is the rollout that starts that run again there, as its lock file recorded it, else with ``config`` and
    ``episodes`` (the command line's others) where given; none while a process holds that lock (loading it now).
    ``asked``: the resume as given, or the command line's options a resume takes, which a resume found keeps
    (``ResumeCommand.given_as``: `ardiff rollout runs/eval1 --no-warmup` is hinted `... --out runs/eval1
    --no-warmup`). Else None."""
    if not is_run_output(folder) or episode_entries(folder):
        return None
    from ardiff_cli.io.run import LOCK_FILE, RunFolder

    run = RunFolder(folder)
    if not run.is_run_folder():
        with contextlib.suppress(OSError):  # is_run_output listed it: its visible entries are run folders
            runs = [Path(e.path) for e in os.scandir(folder) if not e.name.startswith(".")]
            if len(runs) == 1:  # `--resume ardiff-runs`: its one run's command, to paste as it is
                others = [e for e in episodes if os.path.abspath(e) != os.path.abspath(folder)]
                found = run_output(runs[0], config=config, episodes=others, asked=asked)
                if found is not None:
                    return found._replace(what="a folder of ardiff run folders",
                                          run=runs[0] if found.why is not None else None)
        return FoundRun("a folder of ardiff run folders", "ardiff rollout --resume -o RUN")  # RUN: one in it
    if run.holds_run():
        again = run.resume_command()
        return FoundRun("an ardiff run folder", again if asked is None else again.given_as(asked),
                        complete=run.is_complete())
    holder = run.lock_holder()
    if holder is not None:
        pid, kill = (f" (pid {holder})", f" (kill {holder})") if holder else ("", "")
        return FoundRun("an ardiff run folder", None,
                        why=f"its model is loading now, in another ardiff rollout{pid} that writes run.json once it "
                            f"has loaded; wait for that rollout to end, or stop it{kill}, then give this command again")
    again = run.restart_command()
    refused = None if again is None else run.recorded_refusal()
    if refused is not None:  # the same rollout is refused the same way: what to change in it
        return FoundRun("an ardiff run folder", again, why=refused, refused=True)
    if again is None:
        others = [str(e) for e in episodes if os.path.abspath(e) != os.path.abspath(folder)]
        # a .lock that is no file (a FIFO, a folder) refuses the rollout until it is removed
        lock = folder / LOCK_FILE
        remove = "" if run.lock_file_kind() is None else f"remove its {LOCK_FILE} ({as_typed(lock)}), then "
        if config is None or not others:  # nothing recorded them: a command with CONFIG in it cannot run as pasted
            missing = "episodes" if config is not None else "config and episodes"
            given = "" if config is None else f" {shell_word(config)}"
            return FoundRun("an ardiff run folder", f"{remove}ardiff rollout{given} with its {missing}, and --out "
                            f"{shell_word(folder)}",
                            why="its model was loading when it stopped, so there is nothing to resume, and nothing "
                                f"in the folder records its {missing} ({run.unrecorded()})")
        again = remove + run.restart_command([config, *others])
    return FoundRun("an ardiff run folder", again,
                    why="its model was loading when it stopped, so there is nothing to resume")


def is_run_output(folder: Path) -> bool:
    """An ardiff run folder (holds ``run.json`` or ``results.jsonl``, or only the ``.lock`` of a run still loading:
    :meth:`RunFolder.is_run_folder`), or a folder whose visible entries are all run folders (``./ardiff-runs``, the
    default parent of ``--out``, also once its runs were deleted: it was an episode with no step files)."""
    from ardiff_cli.io.run import RUNS_FOLDER, RunFolder

    if RunFolder(folder).is_run_folder():
        return True
    runs = 0
    try:
        with os.scandir(folder) as entries:  # stops at the first entry that is not a run: a robot's folder of
            for entry in entries:            # 20,000 camera frames is not listed whole for this
                if entry.name.startswith("."):
                    continue
                if not (entry.is_dir() and RunFolder(Path(entry.path)).is_run_folder()):
                    return False
                runs += 1
    except OSError:
        return False  # unreadable: kept as an episode, whose error is then reported with it
    return runs > 0 or folder.name == RUNS_FOLDER


def episode_folders_inside(folder: Path) -> list[str]:
    """The names of ``folder``'s visible subfolders that hold an episode (step files, ``episode.yaml`` or ``END``),
    ardiff's run folders left out, sorted; [] for a folder this user may not list or enter."""
    try:
        return sorted(p.name for p in _list_folder(folder) if p.is_dir() and not p.name.startswith(".")
                      and episode_entries(p) and not is_run_output(p))
    except (ObservationError, OSError):  # readable but not enterable: is_dir raises EACCES
        return []


def _warn_about_episodes_inside(folder: Path, warn: Callable[[str], None] | None) -> None:
    """A folder taken for one episode whose subfolders hold episodes (a stray step file copied into a folder of
    episodes) runs as one episode: say that those do not run."""
    inside = episode_folders_inside(folder)  # unreadable: its episode fails with the reason
    if inside and warn is not None:
        warn(f"{as_typed(folder)} is one episode (it holds {listed(episode_entries(folder))}); its folders "
             f"{listed(inside, limit=5)} hold episodes that do not run: pass them as EPISODE, or move the stray "
             "files out")


def discover_episodes(paths: list[Path], *, warn: Callable[[str], None] | None = None,
                      follow: bool = False, config: str | None = None,
                      asked: ResumeCommand | None = None) -> list[EpisodeSource]:
    """Episode folders from the command line: each path is an episode, or a folder of episode folders.

    A folder of episode folders contributes each visible subfolder, except
    ardiff's own outputs (:func:`is_run_output`): a run folder, or a folder
    holding only run folders. So ``ardiff rollout CFG .`` can run again in a
    folder where its default ``--out`` (``./ardiff-runs/<timestamp>``) landed.

    Names are the folder names made safe (:func:`safe_name`), and unique with a
    numeric suffix when two collide, in case and Unicode normalisation too. A folder
    reached twice (``data/ data/pick_cube``, a symlink to another argument) is one
    episode, run once; ``warn`` is told.
    A path that is one of ardiff's outputs itself is refused; ``follow``: the
    command line has ``--follow`` (a missing folder's hint does not suggest it); ``config``: its CONFIG, for the
    command a run folder's refusal gives to paste; ``asked``: :func:`run_output`'s.
    """
    folders: list[Path] = []
    for path in paths:
        found = present(path)
        if found is None:  # on a path this user may not enter: one episode, which fails saying so
            folders.append(path)
            continue
        dangling = None if found else link_to_nothing(path)  # a recording on a disk not mounted: mkdir -p would fail
        if dangling:
            raise ConfigError(f"episode folder not found: {as_typed(path)} is {dangling}", hint=MOUNT_HINT)
        if not found:
            where = "" if path.is_absolute() else f"it is read relative to {Path.cwd()}; "
            unit = split_unit_hint(str(path))  # `rollout CFG --memory-budget 2 GiB`: the unit was taken for an EPISODE
            where = f"{unit}; {where}" if unit else where
            raise ConfigError(f"episode folder not found: {as_typed(path)}",
                              hint=f"{where}for a robot that has not started writing yet, create its folder first "
                                   "(mkdir -p)" + ("" if follow else " and use --follow"))
        if not path.is_dir():
            raise ConfigError(
                f"{as_typed(path)}: an EPISODE is a folder of step files, not a file",
                hint="pass the folder that holds the step files",
            )
        if (found := run_output(path, config=config, episodes=paths, asked=asked)) is not None:
            # its episodes/ and previews/ were taken for episodes with no step files, or (none) the folder itself
            again = found.restart if found.why is not None else found.finish("a stopped run")
            raise ConfigError(f"{as_typed(path)} is {found.what} (what a rollout wrote), not an episode",
                              hint=f"pass the folders of step files the robots wrote; {again}")
        if _holds_episode(path):
            folders.append(path)
            _warn_about_episodes_inside(path, warn)
        else:
            # --follow looks at a link to nothing again at each poll: named only if it never joins
            folders.extend(_episode_folders_in(path, warn=None if follow else warn))
    from ardiff_cli.io.run import episode_folder_path

    names = EpisodeNames()
    episodes: dict[str, EpisodeSource] = {}
    said: set[str] = set()  # a path reached a third time (`data/ data/pick_cube`, data/cam -> pick_cube): one line
    for folder in folders:
        episode = names.add(folder)
        if episode is None:
            if warn is not None and os.fspath(folder) not in said:
                said.add(os.fspath(folder))
                # the path given or found first is the one the episode is read at and run.json records: a link and
                # its target, or two links to one folder, are two paths, and a script reading run.json sees that one
                known = episodes[names.of(folder)]
                first = known.path
                why, where = "given twice", ""
                if episode_folder_path(folder) != episode_folder_path(first):
                    known.named_again.add(episode_folder_path(folder))
                    if not os.path.islink(first):
                        why = f"a link to {as_typed(first)}"
                    else:
                        why = f"{'a link to ' if os.path.islink(folder) else ''}the folder {as_typed(first)} links to"
                    where = f", read at {as_typed(first)}, the path given or found first"
                warn(f"{as_typed(folder)} is episode {names.of(folder)!r} again ({why}); it runs once{where}")
            continue
        episodes[episode.name] = episode
    return list(episodes.values())


def _with_suffix(base: str, suffix: str) -> str:
    """``base + suffix``, ``base`` cut short enough that the whole is still a :func:`safe_name` (a name at the
    length cap with ``-2`` added was refused when its first output was written)."""
    while safe_name(base + suffix) != base + suffix:
        base = base[:-1]
    return base + suffix


def _folded(name: str) -> str:
    """``name`` as a case-insensitive file system compares it (macOS, exFAT, a Windows share): ``Pick`` and ``pick``,
    or ``é`` composed and decomposed (NFC, NFD), are one folder there."""
    return unicodedata.normalize("NFC", name).casefold()


class EpisodeNames:
    """The episodes of a run by folder: one per folder (resolved, so a symlink to one is that one), named by the
    folder's name made safe (:func:`safe_name`), with ``-2``, ``-3``, ... when another folder took that name, or one
    that differs from it only in case or Unicode normalisation (both would write to one output folder where the
    output folder's file system ignores the difference: :func:`_folded`)."""

    def __init__(self, episodes: list[EpisodeSource] = ()) -> None:
        self._names = {_folded(e.name) for e in episodes}  # the names taken, folded
        self._folders = {e.path.resolve(): e.name for e in episodes}  # resolved folder -> its episode's name

    def add(self, folder: Path) -> EpisodeSource | None:
        """A new episode for ``folder``; None when that folder is an episode already."""
        resolved = folder.resolve()
        if resolved in self._folders:
            return None
        base = safe_name(resolved.name)
        name, count = base, 1
        while _folded(name) in self._names:
            count += 1
            name = _with_suffix(base, f"-{count}")
        self._names.add(_folded(name))
        self._folders[resolved] = name
        try:
            st = folder.stat()
        except OSError:
            return EpisodeSource(name=name, path=folder)
        led_to = (resolved, st.st_dev) if os.path.islink(folder) else None
        return EpisodeSource(name=name, path=folder, inode=st.st_ino, led_to=led_to)

    def move(self, name: str, old: Path, new: Path) -> None:
        """Episode ``name``'s folder ``old`` was renamed to ``new``; its name stays taken."""
        if self._folders.get(old.resolve()) == name:  # gone: its parent resolved, as when it was added
            del self._folders[old.resolve()]
        else:  # given as a link that is gone now, or the links above it changed
            self._folders = {path: taken for path, taken in self._folders.items() if taken != name}
        self._folders[new.resolve()] = name

    def of(self, folder: Path) -> str | None:
        """The name of ``folder``'s episode, if it is one."""
        return self._folders.get(folder.resolve())


def _episode_folders_in(folder: Path, warn: Callable[[str], None] | None = None) -> list[Path]:
    """The episode folders of a folder of episodes: its visible subfolders, but ardiff's own outputs and links to the
    folder itself or one above it (``latest -> .``: it ran as an episode with no step files, and failed the run).
    ``warn`` is told of each visible link there that leads nowhere (``cam -> ../rec/arm_a`` before its recording is
    made, a disk not mounted): it was passed over without a word, the run ending 0 without its episode."""
    around = {folder.resolve(), *folder.resolve().parents}
    found = []
    for path in sorted(_list_folder(folder)):
        if path.name.startswith("."):
            continue
        if path.is_dir():
            if not is_run_output(path) and path.resolve() not in around:
                found.append(path)
        elif warn is not None and (dangling := link_to_nothing(path)):
            warn(f"{as_typed(path)} does not run: it is {dangling} (point it at the episode's folder and give it as "
                 "EPISODE, or use --follow to run it once its recording is there)")
    return found


def new_episode_folders(folder: Path, settled: set[str], names: Iterable[str] | None = None) -> list[Path]:
    """The subfolders of the folder of episodes ``folder`` that a robot has started (they hold step files, ``END``
    or ``episode.yaml``) and whose names are not in ``settled``, in name order. Adds to ``settled`` what it returns
    and what can never be one (files, run outputs), so a call costs one listing of ``folder`` and one of each
    subfolder still empty, and a stat of each link that leads to no folder. Empty when ``folder`` is gone or
    unreadable.
    ``names``: those of ``folder`` to look at, instead of listing it (a follower's, whose listing of it still
    holds)."""
    if names is None:
        names = names_in(folder)
    found = []
    for name in sorted(name for name in names if name not in settled and not name.startswith(".")):
        path = folder / name
        try:
            is_folder = path.is_dir()
        except OSError:  # ``folder`` readable but no longer enterable (EACCES): looked at again on the next poll
            continue
        if not is_folder:
            # a link to nothing (its recording not made yet, a disk not mounted) or to a file (cam -> ../rec/latest,
            # a link pointed at a recording later) is looked at again, as an empty folder is: it joins once it leads
            # to an episode folder (one more stat a poll while it leads to none)
            if not os.path.islink(path):
                settled.add(name)
        elif episode_entries(path):
            settled.add(name)
            if not is_run_output(path):
                found.append(path)
    return found
