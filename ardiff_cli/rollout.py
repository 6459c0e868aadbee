"""The rollout loop: episode steps -> validated requests -> engine -> crash-safe outputs.

Each episode is one persistent session (session id = episode name). The
resident session of an episode must have consumed exactly the steps before
the current one. An evicted session that the runtime swapped to disk is
restored from its snapshot, as it was; when there is none (swapping is off, the
snapshot was dropped or cannot be restored, a resumed run whose stopped run kept none), the
episode's earlier steps are replayed first with their outputs discarded. So
an episode's outputs depend only on its own steps: not on the order, the
session capacity or an interruption. Each step's results line
records the SHA-256 of its file (``input_sha256``); a replayed file must still
have it, or its episode fails: a step file rewritten after it ran would rebuild
another history than the one behind the outputs already written. The files a
snapshot kept by a stopped run was made from are checked the same way before
it is restored on ``--resume``.

Failures are per episode. A step that cannot be read or validated, whose
forward raises (the runner has already released the session), or whose
outputs cannot be written, fails its episode: a ``failed`` line in
results.jsonl names the step, the phase and the error (with the traceback of
an unexpected exception), the session is released, and the other episodes go
on unless ``--fail-fast``. A step's outputs are written before its session is
closed, so a failing close hook never loses the last step (it is a warning).
Signals, failures to append to results.jsonl, outputs that a full disk (or a
quota, or a file system gone read-only) refuses, where every later step would
fail alike, and broken internal invariants (an ``AssertionError`` raised in ardiff's own code: a bug) stop the run; a
pipeline's own assert fails its step, as any other exception there. A first signal lets the step in
flight finish (``StopSignals.step``), or, while a session is rebuilt, the
restore or replayed step in flight; a second stops it at once.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ardiff_cli.errors_cli import (Interrupted, OutputError, StepFailed, carry_notes, continue_with, notes_of,
                                   write_hint)
from ardiff_cli.io.episode import METADATA_FILE, EpisodeSource, StepFile, listed, present
from ardiff_cli.io.step_file import file_signature, load_step, step_sha256
from ardiff_cli.io.run import RunFolder, episode_folder_path
from ardiff_cli.io.stream import EpisodeEnded, StepScheduler, StepTask
from ardiff_cli.io.validate import ForeignRecording, validate_step
from ardiff_cli.monitor import RunMonitor
from ardiff_cli.output import Output
from ardiff_cli.runtime.errors import (
    PIPELINE_HINT,
    ArdiffError,
    ObservationError,
    PipelineError,
    ResumeCommand,
    SwapRestoreError,
    WriteHint,
    is_broken_invariant,
    link_to_nothing,
    plural,
    shell_word,
    too_many_open_files,
)
from ardiff_cli.runtime.observation import ObservationSchema
from ardiff_cli.runtime.outputs import (FLOAT16_OVERFLOW, layout_changes, output_differences, output_layout,
                                        output_problem, unwritten_arrays)
from ardiff_cli.signals import StopSignals


@dataclass(frozen=True)
class RolloutOptions:
    order: str  # "round-robin" or "sequential"
    follow: bool
    idle_timeout: float  # with follow: seconds without a new step file before an episode ends
    fail_fast: bool
    preview: bool
    watch: tuple[Path, ...] = ()  # with follow: folders of episodes whose new episode folders join the run
    # what set the KV memory budget (``_Prepared.budget_source``; None: the free memory), which the hint of a step
    # that ran out of memory names
    budget_source: str | None = None
    # the run's resume command to paste (``_Prepared.resume``: its --pipeline, the options given to this resume); None
    # where not known
    resume: ResumeCommand | None = None


@dataclass
class RolloutStats:
    steps: int = 0  # steps run and written by this run
    skipped: int = 0  # steps found done in results.jsonl (resume)
    replayed: int = 0  # steps rerun to rebuild an evicted or resumed session
    evictions: int = 0  # LRU evictions
    swapped_out: int = 0  # sessions swapped out with a snapshot: evicted, or resident when a signal stopped the run
    swap_failed: int = 0  # snapshots that could not be written (in the background or as they started): replayed
    restored: int = 0  # sessions restored from their swap snapshot instead of replayed
    restore_failed: int = 0  # snapshots that could not be restored (replayed instead, with a warning)
    failed: dict[str, str] = field(default_factory=dict)  # episode -> error message
    errors: dict[str, Exception] = field(default_factory=dict)  # episode -> ObservationError or StepFailed
    # of the failed episodes, those whose folder is gone (deleted or renamed away) when the run ends
    folders_gone: set[str] = field(default_factory=set)
    # of the failed episodes, those whose folder is not there when the run ends, whatever they failed of (a recorder
    # that deleted it after a bad file): a resume has nothing to fix there
    folders_missing: set[str] = field(default_factory=set)
    # of the failed episodes, those whose first step file held none of the pipeline's arrays (a recording made for
    # another pipeline): a resume, which keeps the run's config, fails them alike
    foreign: set[str] = field(default_factory=set)
    completed_episodes: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)  # of those, the ones --idle-timeout ended (no END came)
    # follow: step files that arrived after their episode ended and did not run, by episode (--resume runs them)
    late_steps: dict[str, list[str]] = field(default_factory=dict)
    # step files written again after they ran, by episode (their outputs are of the file as it was read)
    rewritten_steps: dict[str, list[str]] = field(default_factory=dict)
    hook_errors: list[dict[str, Any]] = field(default_factory=list)  # pipeline reset/close hooks that raised

    @classmethod
    def before_any_step(cls, done: dict[str, dict[int, int | None]], names: Iterable[str], **counts: Any
                        ) -> RolloutStats:
        """The counts of a run over the episodes ``names`` before it ran a step: their steps in ``done``
        (results.jsonl's, on resume) are skipped. A driver starts from them; so does the summary of a run that
        stopped, or had nothing left to run, before a driver was made."""
        return cls(skipped=sum(len(done.get(name, ())) for name in names), **counts)


# errno values that refuse every later write to --out alike: the run stops instead of failing each episode. EFBIG:
# a file past the process's size limit (ulimit -f), which every step's outputs, about one size, reach alike
_DISK_FULL = {errno.ENOSPC, errno.EROFS, errno.EFBIG, *([errno.EDQUOT] if hasattr(errno, "EDQUOT") else [])}


def _size(path: Path) -> int | None:
    """The bytes of file ``path`` now, None if it cannot be told."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _written_outputs(path: Path) -> dict[str, Any] | None:
    """The arrays of the step output file ``path``, or None when it is gone or unreadable (a cleanup of the
    outputs): what a replay or the layout check compares a step's outputs with, if it can."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        return load(path.read_bytes())
    except (OSError, ValueError, SafetensorError):
        return None


def recorded_folder(episode: EpisodeSource, recorded: str | None) -> str:
    """The episode's folder as run.json records it (``recorded``), where that is the folder the run reads it from
    (directly, or through a link above it or at its path); else its path now as :func:`episode_folder_path` gives it
    (a resume given the folder where it moved, or the link it is read through)."""
    here = episode_folder_path(episode.path)
    if recorded is not None and (recorded in (str(episode.path), here) or not os.path.islink(episode.path)
                                 and str(Path(recorded).resolve()) == str(episode.path.resolve())):
        return recorded
    return here


def log_episode_end(monitor: RunMonitor, name: str, reason: str, steps: int) -> None:
    """An episode's end (reason: complete, end_marker or idle_timeout), in the log and as a JSON object."""
    monitor.log("episode", name, f"ended ({reason}) after {plural(steps, 'step')}", episode=name,
                reason=reason, steps=steps)


class Rollout:
    """Runs every episode's pending steps through ``engine``; see the module docstring."""

    def __init__(self, engine: Any, schema: ObservationSchema, episodes: list[EpisodeSource], run: RunFolder,
                 out: Output, monitor: RunMonitor, signals: StopSignals, options: RolloutOptions,
                 done: dict[str, dict[int, int | None]], *, digests: dict[str, dict[int, str]],
                 swapped: dict[str, int] | None = None) -> None:
        self.engine = engine
        self.schema = schema  # what every step file must hold
        self.episodes = episodes
        self.run_folder = run
        self.out = out
        self.monitor = monitor
        self.signals = signals
        self.options = options
        self.stats = RolloutStats.before_any_step(done, (e.name for e in episodes))
        # how a hint ends that says to go on once files are back: the run's resume to paste (once, not per step read)
        self._go_on = continue_with(self._resume_command())
        self.scheduler = StepScheduler(episodes, order=options.order, follow=options.follow,
                                       idle_timeout=options.idle_timeout, done=done, digests=digests,
                                       warn=out.warning, watch=options.watch, on_new_episode=self._new_episode,
                                       on_moved=self._episode_moved, go_on=self._go_on)
        self.stats.late_steps = self.scheduler.late  # filled as it warns of them, when every episode has ended
        # session id -> steps of its episode the resident session has consumed (absent: not resident)
        self._resident: dict[str, int] = {}
        # session id -> steps its session had consumed when it was swapped out (absent: no snapshot to restore);
        # on --resume, the snapshots the stopped run kept
        self._swapped: dict[str, int] = dict(swapped or {})
        # the episodes of those kept snapshots: their done step files were not read since the stopped run, so they
        # are checked against results.jsonl before the snapshot is restored, as a replay checks them (``_restore``)
        self._kept: set[str] = set(self._swapped)
        self._captured: list[Any] = []  # runtime events of the request in flight
        self._event_error: Exception | None = None  # the first error of _record_event (a bug): stops the run
        self._steps_done = {e.name: len(done.get(e.name, ())) for e in episodes}  # per episode, incl. earlier runs
        # episode -> its folder as run.json records it (links resolved), which results.jsonl's paths name too, so a
        # script joins them (and the events) by path: a link there leading elsewhere since (a dataset moved) keeps
        # its recorded path; an episode a resume was given where it is now is named there
        recorded = run.episode_paths()  # as the run wrote run.json (no second read of it and the journal)
        self._folders = {e.name: recorded_folder(e, recorded.get(e.name)) for e in episodes}
        # episode -> step -> SHA-256 of its file when it ran (this run, and results.jsonl on resume): replays check it
        self._digests = {name: dict(steps) for name, steps in digests.items()}
        # episode -> step -> (file, its signature when read) of the steps this run read: checked at the episode's end
        # (by name: its folder may be renamed meanwhile)
        self._read_as: dict[str, dict[int, tuple[str, tuple[int, ...] | None]]] = {}
        self._warned: set[tuple[str, str]] = set()  # (episode, ignored key): said once, not for every step
        # episode -> {output: (dtype, shape)} of its last step this run wrote: a step whose outputs differ is a warning
        # (a script stacking the episode's step files fails or converts there), once a run for each output name
        self._layouts: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
        self._layout_warned: set[str] = set()
        # episode -> steps done by earlier runs (results.jsonl on --resume): their outputs, which a replay is compared
        # with, came from another process, which may round otherwise (resume_changes)
        self._done_before = done
        # a replayed step returned other outputs than those written for it: said once a run, then no more compared
        self._replay_differed = False
        # failed episodes whose folder, or the step file their failure names, was gone as they failed: only these may
        # close the run as "their folders are gone" (one that failed on its input and was deleted after is not)
        self._vanished: set[str] = set()
        # (phase, step file, its chunk) of the work in progress, for errors: the step's own, or in phase replay the
        # earlier step's being replayed (or checked before a kept snapshot made from it is restored)
        self._at: tuple[str, StepFile, int] | None = None
        self._running: StepTask | None = None  # the step in progress
        self._steps_total: int | None = None  # steps done and left in this run, for the progress bar (None: following)
        # --preview: episode -> (step, output) of its ok lines in results.jsonl, in order (earlier runs' read once
        # here): what its preview draws when it ends, without reading every episode's lines again for each episode
        self._ok_outputs: dict[str, list[tuple[int, str]]] = {}
        if options.preview:
            for record in run.iter_records(self._go_on):
                if record["status"] == "ok":
                    self._ok_outputs.setdefault(record["episode"], []).append((record["step"], record["output"]))
        engine.subscribe(self._on_event)

    def swapped_steps(self) -> dict[str, int]:
        """{episode: steps its session had consumed} of the sessions swapped out now (a stopped run keeps them)."""
        return dict(self._swapped)

    def resident_steps(self) -> dict[str, int]:
        """{episode: steps its session has consumed} of the resident sessions with steps behind them (a run stopped by
        a signal swaps them out to keep them too); {} when an event could not be recorded: the counts may be wrong."""
        if self._event_error is not None:
            return {}
        return {name: steps for name, steps in self._resident.items() if steps > 0}

    def _new_episode(self, episode: EpisodeSource) -> None:
        """A robot started an episode folder in a followed folder of episodes: the run folder lists it (a line of
        episodes.jsonl) before any of its steps runs (``--resume`` finds its outputs' episode), then it is one of the
        run's episodes."""
        try:
            recorded = self.run_folder.add_episode(episode.name, episode.path)
        except OSError as exc:
            if too_many_open_files(exc):  # the process's limit, not the disk's or the folder's
                raise
            raise OutputError(f"cannot add episode {episode.name!r} ({episode.path}) to "
                              f"{self.run_folder.journal_path}: {exc.strerror or exc}",
                              hint=write_hint(self._resume_command())) from exc
        self.episodes.append(episode)
        self._folders[episode.name] = recorded
        self._steps_done[episode.name] = 0
        self.monitor.log("episode_added", episode.name, f"new episode folder {episode.path}: following it",
                         episode=episode.name, path=recorded)
        self._show_progress([episode], recount=False)

    def _episode_moved(self, episode: EpisodeSource, old: Path, how: str) -> None:
        """An episode's folder was renamed in its followed folder of episodes (``ep1.part`` -> ``ep1``): it goes on
        there under its name, and the run folder records the new path (a line of episodes.jsonl), where ``--resume``
        reads it. ``how``: what became of the old one (``renamed to ep1``; of a link, its recording moved into place,
        or it deleted or pointed elsewhere with another link there to the recording), for the event's line."""
        try:
            before, recorded = self.run_folder.move_episode(episode.name, episode.path)
        except OSError as exc:
            if too_many_open_files(exc):
                raise
            # --resume reads the folder the run records, the old one: a link there to the new one resumes it
            raise OutputError(f"cannot record the new folder {episode.path} of episode {episode.name!r} in "
                              f"{self.run_folder.journal_path}: {exc.strerror or exc}",
                              hint=WriteHint(f"check free space and permissions of {self.run_folder.root}",
                                             "(the run still records the episode's old folder) link it to the new one "
                                             f"and continue: ln -s {shell_word(episode.path.name)} {shell_word(old)}; "
                                             f"{self._resume_command()}")) from exc
        # the paths as run.json records them (links resolved: a watched folder given through a link, an episode
        # folder that was a link), the old one as it was recorded: the old name is gone and resolves to nothing
        self._folders[episode.name] = recorded
        self.monitor.log("episode_moved", episode.name, f"episode folder {old} {how}: following it there",
                         episode=episode.name, path=recorded, old_path=before)

    # -- events --------------------------------------------------------------------------------------------

    def _on_event(self, event: Any) -> None:
        """Engine subscriber. The runner makes a subscriber that raises a warning and goes on; here that would be a
        bug in ardiff leaving the resident-session bookkeeping wrong (a step skipping the replay its session needs
        writes wrong outputs), so the error is kept and stops the run before the next step (``run``)."""
        try:
            self._record_event(event)
        except Interrupted:  # raised by the signal handler wherever it finds the main thread: stop now
            raise
        except Exception as exc:  # noqa: BLE001 - raised by run(), with its traceback
            self._event_error = self._event_error or exc

    def _record_event(self, event: Any) -> None:
        kind = event.kind
        if kind == "session_admitted":
            self._resident[event.session_id] = 0
            self._swapped.pop(event.session_id, None)  # a fresh session: the runtime dropped any snapshot
        elif kind in ("session_evicted", "session_closed"):
            consumed = self._resident.pop(event.session_id, None)
            if kind == "session_evicted" and event.swapped and consumed is not None:
                self._swapped[event.session_id] = consumed
        if kind == "session_evicted":
            self.stats.evictions += event.reason == "lru_eviction"  # not the sessions a stopped run swaps out
            self.stats.swapped_out += bool(event.swapped)
        if kind == "snapshot_dropped":  # to make room for a newer one: its episode replays
            self._swapped.pop(event.session_id, None)
        if kind == "swap_failed":
            self.stats.swap_failed += 1
            if event.background:  # after its eviction said swapped: no snapshot after all
                self.stats.swapped_out -= 1
                self._swapped.pop(event.session_id, None)
        if kind == "hook_failed":
            self._hook_failed(event)
        self._captured.append(event)

    def _hook_failed(self, event: Any) -> None:
        """A reset/close hook raised: the runner released the KV regardless. A warning, never lost."""
        task = self._running
        record = {"session": event.session_id, "hook": event.hook, "error": event.error,
                  "during": None if task is None else {"episode": task.episode.name, "step": task.file.step}}
        self.stats.hook_errors.append(record)
        if task is None:
            when = ""
        elif task.episode.name == event.session_id:
            when = f" at its step {task.file.step}"
        else:
            when = f" when evicted for episode {task.episode.name!r} step {task.file.step}"
        self.out.warning(f"episode {event.session_id!r}: the pipeline's {event.hook} raised{when}: {event.error}; "
                         "its KV was released and its written outputs are complete")

    # -- the loop ------------------------------------------------------------------------------------------

    def run(self) -> RolloutStats:
        self._show_progress(self.episodes, recount=True)
        while True:
            # a signal let the step in flight finish: when that was its episode's last, the episode ends before the
            # run stops (summary.json counts it completed, its `episode` event and preview are written), and so do
            # the ends queued ahead of it
            if not self.scheduler.ending:
                self.signals.check()
            if self._event_error is not None:
                raise self._event_error
            item = self.scheduler.next()
            if item is None:
                # looked at now, not as each failed: a folder being deleted (rm -rf) fails its episode at its first
                # file gone, while the folder is still there; whatever that error said, the closing hint is this
                # a link that leads nowhere is there, not gone (its recording moved): its error says to point it again
                missing = {e.name for e in self.episodes if (e.name in self._vanished or e.name in self.stats.failed)
                           and present(e.path) is False and not os.path.islink(e.path)}  # a stat each of those only
                self.stats.folders_gone = missing & self._vanished
                self.stats.folders_missing = missing & self.stats.failed.keys()
                return self.stats
            if isinstance(item, EpisodeEnded):
                self._end_episode(item)
                continue
            self._running = item
            # a first signal lets the step finish (or fail): its session holds whole steps, and its failure is
            # recorded whole; the next check() raises it
            with self.signals.step():
                try:
                    self._run_step(item)
                except (Interrupted, OutputError):
                    # The run stops: a signal, or results.jsonl that cannot record anything. Outputs so far are
                    # complete; --resume.
                    raise
                except Exception as exc:  # noqa: BLE001 - the step's episode fails; the others go on
                    if is_broken_invariant(exc):  # ardiff's own assert (a bug): going on could corrupt the pool
                        raise
                    # unless it failed because a stop raised into it was caught there (and perhaps wrapped): the run
                    # stops as the signal asked, and the step, not failed by its input, runs again on --resume
                    self.signals.reraise()
                    failure = self._step_failure(item, exc)
                    phase, step_file, chunk = self._at or ("load", item.file, item.ordinal)
                    self._fail_episode(item.episode, item.file, item.ordinal, failure, phase=phase,
                                       replayed=(step_file, chunk) if phase == "replay" else None)
                    if self.options.fail_fast:
                        raise naming_episode(failure, item.episode.name) from (None if failure is exc else exc)
                finally:
                    self._at = self._running = None
                # Only this episode's counts changed, and the total only if it failed (its other steps left it).
                # Inside the step: a signal raised as it shows them left the last frame a step short of the summary.
                self._show_progress([item.episode], recount=item.episode.name in self.stats.failed)

    def _step_failure(self, task: StepTask, exc: Exception) -> ArdiffError:
        """An invalid file stays an ``ObservationError``; anything else becomes a ``StepFailed`` naming the step."""
        phase, step_file, _ = self._at or ("forward", task.file, task.ordinal)
        if isinstance(exc, ObservationError):
            if str(step_file.path) in str(exc) or str(task.episode.path / METADATA_FILE) in str(exc):
                return exc  # it names its file: the step's, or the episode's episode.yaml
            # Raised by the pipeline's own input checks, which know no files: name the step's.
            named = ObservationError(f"{step_file.path}: {exc}", hint=exc.hint)
            carry_notes(named, exc)
            return named
        return StepFailed(task.episode.name, task.file.step, phase, exc, path=str(step_file.path),
                          replayed=step_file.step if phase == "replay" else None, budget=self.options.budget_source,
                          plan=self.engine.runner.capacity_plan, resume=self._resume_command())

    def _load(self, episode: EpisodeSource, step_file: StepFile) -> tuple[dict[str, Any], str]:
        """The step's validated inputs and the SHA-256 of its file. A step that ran before (replayed, or run again
        on --resume because its output file went missing: later steps' outputs were made after it) must find the
        file it ran with (when that was recorded), checked before anything else about it."""
        step_file = self._where(episode, step_file)
        try:
            raw = load_step(step_file.path, go_on=self._go_on)
        except ObservationError:
            if (repointed := _repointed_while_read(episode, step_file, self._resume_command())) is not None:
                raise repointed from None  # another recording's folder lacks the step: not "gone"
            # listed, then gone (a link to nothing: reading it named the link): not a permission problem
            if present(step_file.path) is False and not step_file.path.is_symlink():
                raise _gone_while_read(episode, step_file, self._resume_command()) from None
            raise
        # looked at after the read: a link pointed elsewhere just before it read another recording's step file
        if (repointed := _repointed_while_read(episode, step_file, self._resume_command())) is not None:
            raise repointed
        self._check_unchanged(episode, step_file, raw.sha256)
        self._read_as.setdefault(episode.name, {})[step_file.step] = (step_file.path.name, raw.signature)
        valid = validate_step(raw, self.schema, path=step_file.path, episode_metadata=episode.metadata(self._go_on),
                              midway=bool(self._steps_done.get(episode.name)))
        for key, warning in valid.warnings.items():
            if (episode.name, key) not in self._warned:
                self._warned.add((episode.name, key))
                self.out.warning(f"{warning} (said once for the episode)")
        return valid.inputs, raw.sha256

    def _where(self, episode: EpisodeSource, step_file: StepFile) -> StepFile:
        """``step_file``, in its episode's folder as it is named now: one handed out (or listed for a replay) before
        the folder was renamed in its followed folder of episodes is read at the new name."""
        # only a followed folder of episodes renames its episodes: no stat per step otherwise
        if self.options.watch and present(step_file.path) is False and self.scheduler.relocate(episode.name):
            return StepFile(path=episode.path / step_file.path.name, step=step_file.step)
        return step_file

    def _check_unchanged(self, episode: EpisodeSource, step_file: StepFile, sha256: str | None = None) -> None:
        """A step that ran must still have the file it ran with (its ``input_sha256``, where recorded): the
        session's history. ``sha256``: of the file just read (else the file is hashed, not parsed)."""
        ran_with = self._digests.get(episode.name, {}).get(step_file.step)
        if ran_with is None:
            return
        now = step_sha256(step_file.path) if sha256 is None else sha256
        if ran_with != now:
            restore = "restore the file as it was when it ran"
            try:  # read through the link run.json records (data/latest): pointed at another recording since?
                restore = (f"{episode.path} is a link, now to {os.readlink(episode.path)}: point it back at the "
                           f"recording that ran (or {restore})")
            except OSError:  # not a link
                pass
            raise ObservationError(
                f"{step_file.path}: step {step_file.step} changed since it ran (sha256 {ran_with[:12]}... then, "
                f"{now[:12]}... now): the session cannot be rebuilt as it was",
                hint=f"{restore}, or run the episode again from its first step in a new --out; a session's outputs "
                     "depend on every earlier step, so a rewritten one is never replayed",
            )

    def _execute(self, request_id: str, session_id: str, inputs: dict[str, Any]) -> Any:
        """One request of the episode's session. Sessions are closed by ``_close_session``, after their outputs
        are written, never by the request's ``close_session`` flag (a failing hook would lose the output)."""
        from ardiff_cli.runtime.request import ARDiffusionRequest

        return self.engine.execute(ARDiffusionRequest(request_id=request_id, inputs=inputs,
                                                      extra_args={"session_id": session_id}))

    def _restore(self, episode: EpisodeSource) -> bool:
        """Bring a swapped-out session back from its snapshot; False (replay) when it has none or it cannot be
        restored (a warning naming the episode and the error). A snapshot a stopped run kept is restored only
        while the step files it was made from are unchanged: else the episode fails, in phase replay as a replay
        of them would, and its snapshot is deleted with its session (``_fail_episode``)."""
        name = episode.name
        if name in self._kept and name in self._swapped and name not in self._resident:
            for chunk, step_file in enumerate(self.scheduler.history(name)[: self._swapped[name]]):
                self._at = ("replay", step_file, chunk)
                self._check_unchanged(episode, step_file)
            self._kept.discard(name)
        consumed = self._swapped.pop(name, None)
        if consumed is None or name in self._resident:
            return False
        try:
            restored = self.engine.runner.restore_session(name, num_requests=consumed)
        except SwapRestoreError as exc:
            self.stats.restore_failed += 1
            self.out.warning(f"episode {name!r}: {exc}; replaying its earlier steps instead")
            return False
        if restored:
            self._resident[name] = consumed
            self.stats.restored += 1
        return restored

    def _rebuild_session(self, episode: EpisodeSource, ordinal: int) -> int:
        """Restore the session from its swap snapshot, else (or for what it lacks) replay the steps before
        ``ordinal`` that the resident session lacks; returns how many ran."""
        self._restore(episode)
        self.signals.check()  # a signal during the restore: stop with the session resident, to be kept again
        start = self._resident.get(episode.name, 0)
        assert start <= ordinal, f"session {episode.name!r} is ahead of its episode ({start} > {ordinal})"
        history = self.scheduler.history(episode.name, start)[: ordinal - start]
        if history:
            earlier = plural(len(history), "earlier step")
            self.monitor.log("replay", episode.name, f"rebuilding the session from {earlier}",
                             steps=[f.step for f in history])
        for chunk, step_file in enumerate(history, start):
            step_file = self._where(episode, step_file)
            self._at = ("replay", step_file, chunk)
            # else "cannot read the step file", hinting at its permissions (a link to nothing: reading it names it)
            if present(step_file.path) is False and not step_file.path.is_symlink():
                raise ObservationError(
                    f"{step_file.path}: step {step_file.step} ran, but its file is gone (deleted since): the session "
                    f"of episode {episode.name!r} is rebuilt by replaying its earlier steps (it was evicted, or the "
                    "run resumed, and no swap snapshot restored it)",
                    hint="keep an episode's step files until it has ended (a robot's cleanup of the steps that ran "
                         "breaks this), and leave --swap-space on; run the episode again in a new --out, or put the "
                         f"file back, then {self._go_on}")
            inputs, _ = self._load(episode, step_file)
            output = self._execute(f"{episode.name}/{step_file.step:06d}/replay", episode.name, inputs)
            self._check_replayed(episode, step_file.step, output)
            self._resident[episode.name] = self._resident.get(episode.name, 0) + 1
            self.stats.replayed += 1
            self.monitor.set_progress(replayed=self.stats.replayed)
            self.monitor.refresh(self.engine.runner)
            self.signals.check()  # not after the whole replay: the steps replayed so far are kept
        return len(history)

    def _check_replayed(self, episode: EpisodeSource, step: int, output: Any) -> None:
        """Warn, once a run, when a replayed step returned other outputs than its output file holds (written when it
        ran): the pipeline's forward is not deterministic, and the session rebuilt from it is not the one behind
        the outputs written. One read of a file that is there anyway, beside a forward; nothing to compare with
        when it is gone or unreadable (a cleanup of the outputs)."""
        if self._replay_differed:
            return
        path = self.run_folder.step_output(episode.name, step)
        written = _written_outputs(path)
        if written is None:
            return
        differences = output_differences(written, output)
        if not differences:
            return
        self._replay_differed = True
        others = f" (and {plural(len(differences) - 1, 'other output')} too)" if len(differences) > 1 else ""
        cause = "its forward is not deterministic"
        if step in self._done_before.get(episode.name, ()):  # or this process rounds otherwise than that run's
            cause += (", or rounds otherwise than in the earlier run that wrote them (another torch, ardiff or CPU "
                      "thread count: summary.json's resume_changes)")
        self.out.warning(
            f"{type(self.engine.pipeline).__name__}: episode {episode.name!r} step {step}, replayed to rebuild its "
            f"session, returned other outputs than {self.run_folder.relative(path)} holds, written when it ran: "
            f"{differences[0][1]}{others}; {cause}, so a replayed session may not be the one the episode's outputs "
            "so far were made on, nor its later outputs (from the results.jsonl lines with \"replayed\" above 0) "
            "those of an uninterrupted run. Draw the forward's noise from a generator seeded by the session's request "
            "counter, never from torch's global generator, the clock or the request id (a replay's ends in "
            "'/replay'): README, 'Adding a pipeline'; said once a run")

    def _check_layout(self, episode: EpisodeSource, step: int, output: Any) -> None:
        """Warn when the step's outputs are not of the dtypes and shapes of the episode's step before it (this run's,
        or the output file of an earlier run's on --resume), or an output is missing or new: they are written as
        returned (no output schema), and a script that stacks the episode's step files fails or converts there; and
        when an output that is no array holds arrays (a list of tensors), which is not written. Once a run for each
        output name: a pipeline whose first step returns fewer frames is not told so for every episode."""
        pipeline = type(self.engine.pipeline).__name__
        for name, kind in unwritten_arrays(output).items():
            if name not in self._layout_warned:
                self._layout_warned.add(name)
                self.out.warning(
                    f"{pipeline}: episode {episode.name!r} step {step}: output {name!r} is a {kind} holding arrays, "
                    "not an array, and a step file holds arrays only: it is not written; return it as one array "
                    "(torch.stack) or each array under a name of its own (said once a run for each output)")
        layout = output_layout(output)
        before, self._layouts[episode.name] = self._layouts.get(episode.name), layout
        if before is None:  # the episode's first step this run: on --resume, its step before is an earlier run's
            earlier = [done for done in self._done_before.get(episode.name, ()) if done < step]
            written = earlier and _written_outputs(self.run_folder.step_output(episode.name, max(earlier)))
            before = output_layout(written) if written else None
        if before is None:
            return
        for name, now, was in layout_changes(before, layout):
            if name in self._layout_warned:
                continue
            self._layout_warned.add(name)
            self.out.warning(
                f"{pipeline}: episode {episode.name!r} step {step}: output {name!r} is "
                f"{now}, {was} at the episode's step before it; written as returned, so a script that stacks the "
                f"episode's {name!r} fails or converts at this step (said once a run for each output)")

    def _run_step(self, task: StepTask) -> None:
        episode, step = task.episode, task.file.step
        self._at = ("load", task.file, task.ordinal)
        inputs, digest = self._load(episode, task.file)
        self.scheduler.ran(episode.name, task.file, digest)  # its first step file's: told from another folder's
        self._captured = events = []  # what the rebuild and the step itself cause (evictions)
        restores = self.stats.restored
        replayed = self._rebuild_session(episode, task.ordinal)
        restored = self.stats.restored > restores
        request_id = f"{episode.name}/{step:06d}"
        self._at = ("forward", task.file, task.ordinal)
        output = self._execute(request_id, episode.name, inputs)
        problem = output_problem(output)
        if problem is not None:
            kind, what = problem
            name = type(self.engine.pipeline).__name__
            if kind != "non_finite":
                raise PipelineError(f"{name}.forward() returned {what}", hint=PIPELINE_HINT)
            # NaN actions sent to a robot: the step fails instead, and its session (NaN in its KV) goes
            overflow = FLOAT16_OVERFLOW if self.engine.config.runtime.dtype == "float16" else ""
            raise PipelineError(f"{name}.forward() returned {what}; nothing of this step was written",
                                hint="the model diverged: check the config's sampling settings (a guidance scale "
                                     f"too large) and the checkpoint{overflow}; the episode's session was released")
        if episode.name in self._resident:
            self._resident[episode.name] = task.ordinal + 1
        finished = next((e for e in events if e.kind == "request_finished" and e.request_id == request_id), None)
        evicted = [e.session_id for e in events if e.kind == "session_evicted"]
        latency = None if finished is None else {
            "bind_s": finished.bind_s, "forward_s": finished.forward_s, "commit_s": finished.commit_s,
            "total_s": finished.total_s}
        self._at = ("write", task.file, task.ordinal)
        with self.signals.critical():
            self._check_folder()
            fresh = not os.path.lexists(self.run_folder.step_output(episode.name, step))
            try:
                path = self.run_folder.write_step_outputs(
                    episode.name, step, output,
                    metadata={"episode": episode.name, "step": str(step), "request_id": request_id})
            except OSError as exc:
                if exc.errno not in _DISK_FULL:  # a path in the way (a file named like the episode's folder)
                    raise
                # not this episode's problem: failing every episode in turn at its next write would release every
                # session (all replayed by --resume) and bury the cause under as many failures
                raise OutputError(f"cannot write {self.run_folder.step_output(episode.name, step)}: "
                                  f"{exc.strerror or exc}", hint=write_hint(self._resume_command())) from exc
            record = {
                "episode": episode.name, "step": step, "chunk": task.ordinal, "session": episode.name,
                "request_id": request_id, "status": "ok", "output": self.run_folder.relative(path),
                "input_sha256": digest,
                "latency": latency, "evictions": len(evicted), "evicted": evicted, "replayed": replayed,
                "restored": restored, "closed": task.is_last, "time": time.time(),
            }
            self._append(record, output=path if fresh else None)
        self._check_layout(episode, step, output)
        if self.options.preview:
            self._ok_outputs.setdefault(episode.name, []).append((step, record["output"]))
        self._digests.setdefault(episode.name, {})[step] = digest  # what a replay of this step must find
        self.stats.steps += 1
        self._steps_done[episode.name] += 1
        total_ms = f"{latency['total_s'] * 1000:.1f} ms" if latency else "-"
        self.monitor.emit({"kind": "step", **record, "session_id": episode.name,
                           "detail": f"step {step} (chunk {task.ordinal}) {total_ms} -> {record['output']}"})
        if task.is_last:  # after the outputs are safe (a failing close hook cannot lose them) and reported
            self._close_session(episode.name)

    def _append(self, record: dict[str, Any], output: Path | None = None) -> None:
        """One whole line in results.jsonl; failing to write it stops the run (nothing else can record it). The caller
        checked the folder is still this run's (``_check_folder``). ``output``: the step's output file, new, that the
        line names: removed when the line is not written (a full disk, ``ulimit -f``), so that the run's folder holds
        no output of a step that results.jsonl does not say is done. One a line may already name (a resume running a
        step again for its missing or damaged output) is kept: it is whole."""
        results = self.run_folder.results_path
        before = _size(results)
        try:
            self.run_folder.append_result(record)
        except BaseException as exc:
            if output is not None and _size(results) == before:  # no part of the line is there (it is cut off)
                with contextlib.suppress(OSError):
                    os.unlink(output)
            if not isinstance(exc, OSError):
                raise
            if too_many_open_files(exc):  # the process's limit, not the disk's or the folder's
                raise
            raise OutputError(f"cannot append to {results}: {exc.strerror or exc}",
                              hint=write_hint(self._resume_command())) from exc

    def _resume_command(self) -> ResumeCommand:
        """The ``ardiff rollout --resume`` of this run that a hint prints to paste (its folder, its --pipeline)."""
        return self.options.resume or ResumeCommand(self.run_folder.root)

    def _check_folder(self) -> None:
        """Stop the run (``OutputError``) when its --out folder was removed or replaced since it started: its
        results.jsonl is gone, and writing on would re-create the folder with only part of the run in it."""
        if self.run_folder.moved():
            raise OutputError(f"{self.run_folder.root} was removed or replaced while this run wrote it",
                              hint="its results.jsonl went with it: run the command again, without --resume")

    def _close_session(self, session_id: str, reason: str = "episode_ended", error: str | None = None) -> None:
        """Close a resident session; a hook failure was reported through its ``hook_failed`` event. ``reason`` and
        ``error``: its ``session_closed`` event's (``episode_ended``, or ``episode_failed`` with the failed line's
        ``error``)."""
        if session_id in self._resident or self._swapped.pop(session_id, None) is not None:
            try:  # a swapped-out session is closed by deleting its snapshot
                self.engine.runner.close_session(session_id, reason=reason, error=error)
            except Interrupted:  # a signal while the pipeline's close hook ran: the session is released, the run stops
                raise
            except ArdiffError:  # LifecycleHookError: the KV is released; _hook_failed warned. Or its snapshot was
                pass  # dropped to make room: nothing is left to close

    def _fail_episode(self, episode: EpisodeSource, step_file: StepFile | None, ordinal: int | None,
                      exc: ArdiffError, *, phase: str, replayed: tuple[StepFile, int] | None = None) -> None:
        """Record the failure, release the episode's session, skip its remaining steps.

        ``phase``: scan (the folder: no ``step_file``, and the line's step and chunk are null), load, replay,
        forward or write (see ``StepFailed``). The line's step, chunk and path are always those of the step that
        failed (``step_file``, ``ordinal``: it has no ok line, and runs again on --resume); in phase replay,
        ``replayed`` is the (file, chunk) of the earlier step whose replay (or check) failed: its ok line and
        output stay, and the line names it in ``replay_step``, ``replay_chunk`` and ``replay_path``.
        """
        message = str(exc)
        cause = exc.cause if isinstance(exc, StepFailed) else exc
        step, path = (None, episode.path) if step_file is None else (step_file.step, step_file.path)
        record = {"episode": episode.name, "step": step, "chunk": ordinal, "session": episode.name,
                  "status": "failed", "error": message, "path": self._as_recorded(episode, path), "phase": phase,
                  "error_type": type(cause).__name__, "time": time.time()}
        if notes := notes_of(exc):  # what else went wrong as it failed, as the Error line's note: lines
            record["notes"] = notes
        if replayed is not None:
            record.update(replay_step=replayed[0].step, replay_chunk=replayed[1],
                          replay_path=self._as_recorded(episode, replayed[0].path))
        files = [f.path for f in (step_file, replayed and replayed[0]) if f]
        if any(present(path) is False for path in (episode.path, *files)):  # deleted under it: rm -rf, a rename
            self._vanished.add(episode.name)
        if not isinstance(cause, ArdiffError):  # unexpected: keep the traceback, the run is unattended
            record["traceback"] = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
        with self.signals.critical():
            self._check_folder()
            self._append(record)
        if self.out.is_json:  # the same step object as an ok line's; plain and rich show the Error: lines below
            self.out.json({"kind": "step", **record, "session_id": episode.name,
                           "detail": ("episode" if step is None else f"step {step} (chunk {ordinal})")
                                     + f" failed in {phase}"
                                     + ("" if replayed is None else f" of step {replayed[0].step}")
                                     + f": {message.splitlines()[0]}"})
        self.stats.failed[episode.name] = message
        self.stats.errors[episode.name] = exc
        if isinstance(exc, ForeignRecording):
            self.stats.foreign.add(episode.name)
        self.monitor.set_progress(failed=len(self.stats.failed))  # --fail-fast stops before the next progress update
        self.scheduler.drop(episode.name)
        self.scheduler.forget(episode.name)  # its step files: never replayed, nor drawn
        self._digests.pop(episode.name, None)  # never replayed again: a long run holds only live episodes' digests
        self._read_as.pop(episode.name, None)
        self._layouts.pop(episode.name, None)
        self._ok_outputs.pop(episode.name, None)  # and draws no preview
        self._close_session(episode.name, "episode_failed", message)
        self.monitor.log("failed", episode.name, message.splitlines()[0], echo=False)
        if not self.options.fail_fast:  # else the run stops with this error, and it is shown once, at exit
            if self.out.verbose and isinstance(exc, StepFailed):
                self.out.traceback(exc.cause)
            self.out.error(str(naming_episode(exc, episode.name)), exc.hint, kind="episode_failed",
                           episode=episode.name, notes=notes_of(exc))
        # The traceback's frames hold the failed forward's locals (activations, the released session's caches):
        # drop them now, not at the end of the run. A traceback printed later needs only code and line numbers.
        traceback.clear_frames(cause.__traceback__)

    def _as_recorded(self, episode: EpisodeSource, path: Path) -> str:
        """``path``, the episode's folder or a step file in it, as run.json names that folder (links resolved); a
        step file that is a link is named in its folder, where it is to be put back, not by its target."""
        folder = Path(self._folders[episode.name])
        if path == episode.path:
            return str(folder)
        if path.parent == episode.path:
            return str(folder / path.name)
        return str(path.absolute().parent.resolve() / path.name)  # not in its folder as the run names it

    def _report_rewritten(self, episode: EpisodeSource) -> None:
        """Warn of the episode's step files written since they ran (a restarted recorder writing a step again, two
        writers, a copy that preallocated the file and filled it after it looked whole): its outputs were made from
        what was read, which no rerun over the files now would give. One stat per step file; one hash of each file
        whose size, mtime or inode changed, so a file touched or copied over with the same bytes is not one."""
        name = episode.name
        ran = self._read_as.pop(name, {})
        digests = self._digests.get(name, {})
        rewritten = []
        for step, (file_name, signature) in sorted(ran.items()):
            path = episode.path / file_name  # where it is now: its folder may have been renamed since it was read
            now = file_signature(path)
            if now is None or now == signature or step not in digests:  # deleted since: not rewritten
                continue
            try:
                if step_sha256(path) != digests[step]:
                    rewritten.append(path.name)
            except ObservationError:  # emptied, unreadable: another version than the one that ran
                rewritten.append(path.name)
        if rewritten:
            self.stats.rewritten_steps[name] = rewritten
            they = "it" if len(rewritten) == 1 else "they"
            self.out.warning(f"episode {name!r}: {listed(rewritten)} changed after {they} ran (written again): the "
                             "outputs of its steps from there were made from the files as they were read "
                             "(input_sha256 in results.jsonl); run the episode again in a new --out for the new ones")

    def _end_episode(self, item: EpisodeEnded) -> None:
        name = item.episode.name
        if item.reason == "error":
            assert item.error is not None
            self._fail_episode(item.episode, None, None, item.error, phase="scan")
            if self.options.fail_fast:
                raise naming_episode(item.error, item.episode.name)
            return
        self._close_session(name)  # following: the end was learnt after the last step ran
        self._report_rewritten(item.episode)
        self._digests.pop(name, None)  # never replayed again: a long run holds only live episodes' digests
        self._layouts.pop(name, None)
        self.stats.completed_episodes.append(name)
        if item.reason == "idle_timeout":
            self.stats.timed_out.append(name)
        log_episode_end(self.monitor, name, item.reason, self._steps_done[name])
        if self.options.preview:
            try:
                self._write_preview(item.episode)
            except (Interrupted, OutputError):
                raise
            except Exception as exc:  # noqa: BLE001 - a preview is a convenience; its outputs are complete
                self.out.warning(f"episode {name!r}: cannot write its preview: {type(exc).__name__}: {exc}")
        self.scheduler.forget(name)  # its step files were its history, never replayed again once it ended
        self.monitor.refresh(self.engine.runner)

    # -- progress and previews -----------------------------------------------------------------------------

    def _show_progress(self, episodes: list[EpisodeSource], *, recount: bool) -> None:
        """Progress of ``episodes`` (all at the start, then the one that ran a step: a step's update costs the same
        for 10 episodes or 10,000) and of the run. ``recount``: count the steps left again (at the start, and after
        a failure); a step that succeeds moves one from left to done, so the total stays."""
        for episode in episodes:
            total = None if self.options.follow else self.scheduler.num_known(episode.name)
            self.monitor.set_episode(episode.name, self._steps_done[episode.name], total)
        if recount and not self.options.follow:
            self._steps_total = self.stats.steps + self.scheduler.num_pending()
        self.monitor.set_progress(done=self.stats.steps, total=self._steps_total, failed=len(self.stats.failed))
        self.monitor.refresh(self.engine.runner)

    def _write_preview(self, episode: EpisodeSource) -> None:
        """One column per step, in step order, from its ok lines (earlier runs' included; a step run twice, its
        output having gone missing before a --resume, is drawn once); at most ``MAX_COLUMNS`` evenly spaced
        ones, so an episode of 10,000 steps reads 64 step files and draws a picture a viewer can open."""
        from ardiff_cli.io.png import MAX_COLUMNS, as_rgb_frame, evenly_spaced, preview_strip

        observed, predicted = [], []
        step_files = {f.step: f for f in self.scheduler.history(episode.name)}
        outputs = dict(self._ok_outputs.pop(episode.name, ()))  # step -> its last ok line's output
        steps = sorted(outputs)
        for step in (steps[i] for i in evenly_spaced(len(steps), MAX_COLUMNS)):
            output = outputs[step]
            step_file = step_files.get(step)
            try:  # a step file moved away or emptied since it ran (its outputs stand) is a grey frame, not no preview
                arrays = {} if step_file is None else load_step(step_file.path).arrays
            except ObservationError:
                arrays = {}
            frame = next((f for f in map(as_rgb_frame, arrays.values()) if f is not None), None)
            observed.append(frame)
            predicted.append(self._predicted_frame(self.run_folder.root / output))
        if not any(f is not None for f in (*observed, *predicted)):
            raise ValueError("no image to show: neither its step files nor its outputs hold a uint8 (H, W, 3) "
                             "frame, and the pipeline's decode_latents is missing or returned no such frame")
        self._check_folder()
        self.run_folder.write_preview(episode.name, preview_strip(observed, predicted, min_height=96))

    def _predicted_frame(self, path) -> Any:
        from safetensors.numpy import load

        from ardiff_cli.io.png import as_rgb_frame
        from ardiff_cli.io.writer import to_numpy

        # its bytes read, then parsed: load_file mapped the file, and one truncated as its arrays were copied out of
        # the mapping (an outputs folder cleared, a sync tool) killed the run with SIGBUS and no summary
        arrays = load(path.read_bytes())
        for value in arrays.values():
            frame = as_rgb_frame(value)
            if frame is not None:
                return frame
        decode = getattr(self.engine.pipeline, "decode_latents", None)
        if decode is None:
            return None
        if "latents" not in arrays:  # a decoder never given anything: the row would be blank without a word
            if ("", "latents") not in self._warned:
                self._warned.add(("", "latents"))
                self.out.warning(f"{type(self.engine.pipeline).__name__} has decode_latents, but its forward's "
                                 f"outputs ({', '.join(sorted(arrays)) or 'none'}) hold no 'latents', which --preview "
                                 "decodes: previews show no predicted frame; return them as 'latents', or a uint8 "
                                 "(..., H, W, 3) frame")
            return None
        decoded = to_numpy(decode(arrays["latents"]))
        frame = as_rgb_frame(decoded)
        if frame is None and ("", "decode_latents") not in self._warned:  # the row would be blank without a word
            self._warned.add(("", "decode_latents"))
            self.out.warning(f"{type(self.engine.pipeline).__name__}.decode_latents() returned {decoded.dtype} "
                             f"{tuple(decoded.shape)}, expected uint8 (T, H, W, 3): previews show no predicted frame")
        return frame


def naming_episode(exc: ArdiffError, episode: str) -> ArdiffError:
    """``exc`` as it is shown: its message starts with the episode it failed, the same words whether the run goes
    on (an ``episode_failed`` line) or ``--fail-fast`` stops with it. A ``StepFailed`` names it already; an invalid
    file (``ObservationError``) names only its path, so a copy of the same class (exit code, JSON kind, hint) and
    traceback says ``episode 'arm_b' failed: PATH: ...``."""
    if isinstance(exc, StepFailed):
        return exc
    named = copy.copy(exc)
    named.args = (f"episode {episode!r} failed: {exc}",)
    return named.with_traceback(exc.__traceback__)


def _repointed_while_read(episode: EpisodeSource, step_file: StepFile, resume: ResumeCommand
                          ) -> ObservationError | None:
    """The error of a step read through an episode folder that is a link (``eps/cam -> ../rec/arm_a``) pointed at
    another folder since the run found it (``ln -sfn ../rec/arm_b eps/cam``): its step files are another recording's,
    which ran in this episode's session without a word. None while it leads to the folder it led to then (by device
    and inode number: moved, and the link pointed at it again, it is the same recording), or to nothing
    (:func:`_gone_while_read` names that). A stat a step, of an episode read through a link only."""
    if episode.led_to is None:
        return None
    then, device = episode.led_to
    try:
        st = os.stat(episode.path)
    except OSError:
        return None
    if (st.st_dev, st.st_ino) == (device, episode.inode):
        return None
    link = shell_word(episode.path)
    fix = (f"the episode is the recording the link led to, which names it ({episode.name}): point the link back at "
           f"it (ln -sfn {shell_word(then)} {link}), then {continue_with(resume)}; run the folder there now as an "
           "episode of its own, in a new --out")
    try:
        target = os.readlink(episode.path)
    except OSError:  # EINVAL: a folder put in the link's place
        return ObservationError(
            f"{step_file.path}: cannot read the step file: the episode folder {episode.path} was a link to {then} when "
            "the run found it, and is another folder now (put in its place while the run read it)",
            hint=f"move that folder away first; {fix}")
    now = f"now to {target}"
    # a link to a link (eps/cam -> ../rec/latest -> arm_b): the last one may be the one pointed elsewhere
    if os.path.islink(os.path.join(os.path.dirname(episode.path), target)):
        now += f", a link that leads to {os.path.realpath(episode.path)}"
    return ObservationError(
        f"{step_file.path}: cannot read the step file: the episode folder {episode.path} is a link, {now}, another "
        f"folder than {then}, where it led when the run found it (pointed elsewhere while the run read it)", hint=fix)


def _gone_while_read(episode: EpisodeSource, step_file: StepFile, resume: ResumeCommand) -> ObservationError:
    """The error of a step file listed and gone before it was read: its episode folder deleted (rm -rf, which takes
    the files first) or renamed while the run read it, or the file alone deleted. ``resume``: the run's resume
    command, to paste once they are back."""
    what = "it is gone (deleted or renamed since the episode folder was listed)"
    if present(episode.path) is False:
        if dangling := link_to_nothing(episode.path):  # the link is there (ls shows it): its recording moved
            return ObservationError(
                f"{step_file.path}: cannot read the step file: the episode folder {episode.path} is {dangling} (its "
                "recording was deleted or moved while the run read it)",
                hint=f"point the link at where the recording is now (ln -sfn NEW {shell_word(episode.path)}), or put "
                     f"the recording back, then {continue_with(resume)}")
        what = f"the episode folder {episode.path} is gone (deleted or renamed while the run read it)"
    return ObservationError(f"{step_file.path}: cannot read the step file: {what}",
                            hint="keep an episode's folder and its step files in place while a run reads them; put "
                                 f"them back, then {continue_with(resume)}")
