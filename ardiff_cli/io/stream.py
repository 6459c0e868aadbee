"""Which step runs next: round-robin or sequential over episodes, optionally following live folders.

Each episode is one persistent session. Round-robin interleaves one step of
each active episode in turn, the way several robots share one model;
sequential finishes an episode before starting the next. With ``follow``, an
episode's folder is rescanned for new step files until its END marker appears
(and every step before it ran) or no new file arrived for ``idle_timeout``
seconds. END counts once the folder's names stayed the same for ``_END_SETTLE``
seconds after it was seen: a copy of a finished episode may make it first.

A follower only takes a file once its size and mtime were the same at two polls
and its bytes are whole (a safetensors file as long as its header says, an .npz
ending in its zip directory), so a writer that does not rename, even one that
pauses mid-file, never hands over half a file; one that sizes the file first and
then fills it in place is waited for while it writes (its mtime changes), but not
through a pause mid-fill, which looks like a whole file. A file still growing or
being written keeps its episode from idling out; one that stays incomplete is
taken anyway when the END marker appears or the idle timeout passes, and then
fails its episode as truncated instead of being skipped; one deleted before it
was taken (a writer cleaning up the step it was cut short in) is forgotten.

Step numbers must be consecutive: a session's outputs depend on every earlier
step, so a gap is never skipped. Without ``follow`` a gap (or a folder with no
step files at all) fails the episode before its first step runs; while
following, a step beyond a gap waits for the missing one, and the episode
fails if its END marker or the idle timeout comes first; an episode that
ends (END or idle timeout) before any step file arrived fails too. A step file
that arrives in a followed episode after it ended (its END marker, or the idle
timeout) does not run; when every episode has ended, a warning names each such
file (``--resume`` runs them).

A followed folder of episodes (``watch``) is listed at each poll too: an
episode folder a robot starts in it (once it holds a step file, ``END`` or
``episode.yaml``) becomes an episode of the run, and the run ends only when
every episode has ended and no new one came for ``idle_timeout`` seconds. An episode folder renamed in it (a
recorder publishing ``ep1.part`` as ``ep1``, before or after its END) is followed at its new name as the same
episode, not taken for a new one.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import re
import stat
import time
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ardiff_cli.io.atomic import temporary_pattern
from ardiff_cli.io.episode import (STEP_SUFFIXES, EpisodeNames, EpisodeSource, StepFile, episode_entries,
                                   episode_folders_inside, gap_error, in_other_case, is_run_output, listed,
                                   missing_steps, names_in, new_episode_folders, number_in_lower_case, other_case_error,
                                   other_step_formats, step_number, unreadable_folder)
from ardiff_cli.io.step_file import looks_whole, step_sha256
from ardiff_cli.io.run import episode_folder_path
from ardiff_cli.runtime.errors import (ObservationError, as_typed, dangling_link, first_of, link_to_nothing,
                                      shell_word)

# Activity for the idle timer: write_step's temporary file of a step file being written (atomic_write_bytes), and
# rsync's of one it copies (".step_000001.safetensors.Ab3dE9": "." + name + "." + mkstemp's 6 characters)
_STEP_NAME = "[^.].*(?:" + "|".join(map(re.escape, STEP_SUFFIXES)) + ")"
_STEP_TEMPORARY = temporary_pattern(_STEP_NAME)
_RSYNC_TEMPORARY = re.compile(rf"\.{_STEP_NAME}\.[A-Za-z0-9]{{6}}")
# follow: how long after its folder's timestamps were first seen a listing of it is trusted to hold every name they
# stand for (longer than a timestamp's tick: 2 s on FAT, 1 s on ext4 with small inodes; a few ms with sub-second
# stamps), and how often a folder whose timestamps did not change is listed anyway (see StepScheduler._listing)
_SETTLE, _SETTLE_COARSE, _RELIST = 0.5, 3.0, 5.0
# follow: how long an episode folder's names must stay the same, once its END file was seen, for END to end it: a copy
# of a finished episode may make END before the step files (rsync sends names sorted, END first; cp -r and copytree in
# listing order), each file right after the one before
_END_SETTLE = 0.5


@dataclass(frozen=True, slots=True)
class StepTask:
    """One step to run."""

    episode: EpisodeSource
    file: StepFile
    ordinal: int  # position of the step in its episode (the chunk index), counting steps already done
    is_last: bool  # known to be the episode's last step: its session is closed after it


@dataclass(frozen=True, slots=True)
class EpisodeEnded:
    """An episode has no more steps to run."""

    episode: EpisodeSource
    reason: str  # "complete", "end_marker", "idle_timeout", or "error" (its folder could not be read)
    error: ObservationError | None = None  # for reason "error"


@dataclass
class _Track:
    """Scheduling state of one episode."""

    source: EpisodeSource
    done: dict[int, int | None]  # resume: step -> its chunk when it ran (results.jsonl): skipped, part of the history
    done_sorted: list[int] = field(default_factory=list)  # ``done`` in order: counts pending steps by bisection
    files: list[StepFile] = field(default_factory=list)  # known step files, in step order
    taken: set[str] = field(default_factory=set)  # follow: names of ``files``, not looked at again by a poll
    cursor: int = 0  # index in ``files`` of the next step to consider
    current: int = 0  # ordinal of the step handed out last: ``files[:current]`` is its history
    looks: dict[str, tuple[int, int]] = field(default_factory=dict)  # follow: unready files' size, mtime at last poll
    last_activity: float = 0.0  # follow: when a step last arrived or was handed out (idle timer)
    history_checked: bool = False  # resume: the done steps were checked to be where they ran in the episode
    ended: bool = False
    end_reason: str | None = None  # follow: "end_marker" or "idle_timeout" once it ended cleanly (late files?)
    gap: tuple[int, int] | None = None  # follow: (last taken step, next step present) while steps between are missing
    writing: dict[str, tuple[int, int]] = field(default_factory=dict)  # follow: temporary files' size, mtime last seen
    lost: list[int] = field(default_factory=list)  # resume: done steps whose files are gone, between present ones
    identity: int | None = None  # follow: its folder's inode number at the first poll (not st_dev: a remount)
    unready: list[StepFile] = field(default_factory=list)  # follow: the files of ``looks``, as last listed
    stamp: tuple[int, ...] | None = None  # follow: its folder's device, inode, mtime and ctime at the last poll
    stamp_seen: float = 0.0  # follow: when ``stamp`` was first seen (time.monotonic)
    listed_at: float = -float("inf")  # follow: when its folder was last listed (time.monotonic)
    trusted: bool = False  # follow: listed once ``stamp`` was settled: nothing was added or removed while it holds
    stamp_unreliable: bool = False  # follow: a file came in its folder without changing ``stamp``: listed every poll
    inside: frozenset[str] = frozenset()  # follow: episode folders in it at its first poll, when it held no step file
    # follow: files named like steps but without a step number, or under a writer's temporary name (is_temporary_name)
    unnumbered: list[Path] = field(default_factory=list)
    first_file: tuple[str, int, int, int] | None = None  # follow: name, inode, mtime, size of its first step file taken
    first_sha256: str | None = None  # follow: the SHA-256 of that file when it ran (input_sha256), once known
    # follow: the file under that name last hashed (inode, mtime, ctime, size) and whether it was another: read once
    first_judged: tuple[tuple[int, int, int, int], bool] | None = None
    # follow: since when its folder held these names (END one), none of its unready step files growing, and their looks
    end_seen: tuple[float, frozenset[str], dict[str, tuple[int, int]]] | None = None
    end_gone: bool = False  # follow: its folder was removed once END was seen there and every step file taken
    # follow: its folder is itself a link (live/cam -> .rec/arm_a), which a rename there is followed to (cam -> cam2)
    link: bool = False
    link_inode: int | None = None  # follow: the link's own inode number (lstat): a rename keeps it, another link not

    def __post_init__(self) -> None:
        self.link, self.link_inode = _link_inode(self.source.path)


@dataclass
class _Watched:
    """Follow: a folder of episodes whose new episode folders join the run, and what its last listing found."""

    folder: Path
    settled: set[str] = field(default_factory=set)  # names that are episodes, or never can be (files, run outputs)
    waiting: list[str] = field(default_factory=list)  # its other visible names at the last listing (empty folders)
    names: frozenset[str] = frozenset()  # every name of that listing
    stamp: tuple[int, ...] | None = None  # its device, inode, mtime and ctime at the last poll
    stamp_seen: float = 0.0  # when ``stamp`` was first seen (time.monotonic)
    listed_at: float = -float("inf")  # when it was last listed (time.monotonic)
    trusted: bool = False  # listed once ``stamp`` was settled: nothing was added or removed while it holds
    stamp_unreliable: bool = False  # a name came without changing ``stamp``: listed at every poll
    folder_inode: int | None = None  # its inode number at the last listing: another one is another folder there
    # its links that lead to no folder (to nothing, to a file), by the way their lookup goes: the folders it reads
    # names in, each with its stamp when they were last looked at; not looked at again while those stamps hold
    held: dict[tuple[tuple[str, tuple[int, ...]], ...], set[str]] = field(default_factory=dict)
    # the stamp of each folder on such a way, and when it was first seen (time.monotonic): held once settled; only
    # those on the ways of the links there at the last poll that looked at one
    seen: dict[str, tuple[tuple[int, ...], float]] = field(default_factory=dict)


def _step_order(name: str) -> tuple[bool, int]:
    """Where a step file's ``name`` sorts among its episode's: by its step number, one in capitals by that of its
    name in lower case (:func:`number_in_lower_case`), one with none (STEP.SAFETENSORS, a writer's temporary name
    step_000001.tmp.SAFETENSORS) last."""
    number = number_in_lower_case(name)
    return (number is None, number or 0)


class StepScheduler:
    """Hands out :class:`StepTask` and :class:`EpisodeEnded` items; ``None`` when every episode ended.

    The caller reports a failed episode with :meth:`drop`; its remaining steps are skipped.
    """

    def __init__(self, episodes: list[EpisodeSource], *, order: str = "round-robin", follow: bool = False,
                 idle_timeout: float = 60.0, poll_interval: float = 0.1,
                 done: Mapping[str, Mapping[int, int | None]] | None = None,
                 digests: Mapping[str, Mapping[int, str]] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 warn: Callable[[str], None] = lambda message: None, watch: Sequence[Path] = (),
                 on_new_episode: Callable[[EpisodeSource], None] = lambda episode: None,
                 on_moved: Callable[[EpisodeSource, Path, str], None] = lambda episode, old, how: None,
                 go_on: str = "continue with --resume") -> None:
        self.order = order
        self.follow = follow  # rescan folders for new step files
        self.idle_timeout = idle_timeout  # follow: an episode idle this long (no new file) ends
        self.poll_interval = poll_interval  # follow: pause between rescans when nothing is ready
        self._clock = clock
        self._sleep = sleep
        self._warn = warn  # follow: step files that arrived after their episode ended
        self.late: dict[str, list[str]] = {}  # follow: those files by episode (the run's summary lists them)
        # follow: the folders of episodes to watch for episode folders made in them since, each with the names in it
        # settled (episodes, files), and what to call with each new episode before its first step is handed out
        # (once each: one given twice, or as a link too, named each folder made in it twice)
        self._watch = [_Watched(folder) for folder in _once_each(watch)] if follow else []
        self._on_new_episode = on_new_episode
        self._on_moved = on_moved  # follow: an episode's folder renamed in its watched folder, with its old path
        # how the hints of an episode that a resume goes on with once its files are back end: the rollout's gives the
        # run's resume command to paste (errors_cli.continue_with)
        self._go_on = go_on
        self._names = EpisodeNames(episodes)
        self._all_ended_at: float | None = None  # follow: when the last episode ended (watching: the idle timer)
        self._done = done = done or {}
        # follow, resume: episode -> (its first step that ran, the SHA-256 of its file then: input_sha256 in
        # results.jsonl), what its first step file taken had when it ran (see ``ran``)
        self._ran_first = {name: min(steps.items()) for name, steps in (digests or {}).items()
                           if steps and follow}
        now = clock()
        self._tracks = [_Track(source=e, done=dict(done.get(e.name, {})), done_sorted=sorted(done.get(e.name, ())),
                               last_activity=now) for e in episodes]
        self._by_name: dict[str, _Track] = {}  # episode name -> its track: every step looks its episode up
        for track in self._tracks:
            self._by_name.setdefault(track.source.name, track)
        # the episodes not ended yet, in order (ended ones are dropped at the next poll or pick): what a poll and a
        # step look at, so that a followed folder of episodes' finished ones cost nothing (2,000: 1.2 ms a poll)
        self._live = list(self._tracks)
        self._turn = 0  # round-robin: index in ``_live`` of the episode whose turn is next
        self._polled_at = -float("inf")  # follow: when the folders of caught-up episodes were last polled
        self._slept = False  # follow: a pause came since that poll (the folders are polled again after each)
        self._pending_ends: list[EpisodeEnded] = []  # items to hand out before any further step
        self._named_another: set[tuple[Path, int]] = set()  # follow: folders named by _warn_another_folder, by inode
        if not follow:
            for track in self._tracks:
                self._guarded_scan(track)

    # -- queries -------------------------------------------------------------------------------------------

    def history(self, episode_name: str, start: int = 0) -> list[StepFile]:
        """Steps of ``episode_name`` from ordinal ``start`` to the one handed out last (excluded), in order: what
        rebuilding its session replays; once its end was handed out, to its last step (included), as the preview
        draws. Only that slice is copied, so each step costs what it replays."""
        track = self._track(episode_name)
        return track.files[start:track.current]

    def num_known(self, episode_name: str) -> int:
        """Step files of ``episode_name`` known so far (all of them unless following)."""
        return len(self._track(episode_name).files)

    def num_pending(self) -> int:
        """Steps known and not yet handed out (grows while following). Constant time per episode (it runs after
        every step): the files ahead of the cursor are consecutive steps, less the done ones among them."""
        pending = 0
        for t in self._tracks:
            if t.ended or t.cursor >= len(t.files):
                continue
            first, last = t.files[t.cursor].step, t.files[-1].step
            done = bisect.bisect_right(t.done_sorted, last) - bisect.bisect_left(t.done_sorted, first)
            pending += len(t.files) - t.cursor - done
        return pending

    def relocate(self, episode_name: str) -> bool:
        """Whether ``episode_name``'s folder was renamed in its watched folder of episodes since it was last looked
        at; it is followed at its new path from now on (its ``source.path`` and step files). For a step handed out
        before the rename, whose file is no longer where the task says."""
        return self._follow_rename(self._track(episode_name))

    def ran(self, episode_name: str, step_file: StepFile, sha256: str) -> None:
        """``step_file`` of ``episode_name`` was read to run, and its bytes' SHA-256 is ``sha256``. Kept for the
        episode's first step file taken: a file there later with another inode number or mtime (touched, copied over
        in place) is still the episode's own while it has these bytes (``_another_first_file``)."""
        track = self._by_name.get(episode_name)
        if track is not None and track.first_file is not None and track.first_file[0] == step_file.path.name:
            track.first_sha256 = sha256

    # -- control -------------------------------------------------------------------------------------------

    def forget(self, episode_name: str) -> None:
        """The caller is done with ``episode_name``, which ended (its end handled, its preview drawn) or failed: its
        step files, the names its folder held at END and its done steps are let go (350 B per step, held for the rest
        of a run that follows episodes for days). The names taken from its folder stay (125 B per step): the late
        files named as the run ends, and its folder renamed after its END, are told by them. Its :meth:`history`
        is empty from here on."""
        track = self._track(episode_name)
        assert track.ended, f"episode {episode_name!r} is still scheduled"
        track.files, track.unready, track.lost, track.cursor, track.current = [], [], [], 0, 0
        track.done, track.done_sorted, track.end_seen, track.looks, track.writing = {}, [], None, {}, {}

    @property
    def ending(self) -> bool:
        """An episode's end, not a failure, is among what ``next()`` hands out now, before any step (a step it ran was
        its last; a poll may have queued another episode's failure ahead of it)."""
        return any(end.reason != "error" for end in self._pending_ends)

    def drop(self, episode_name: str) -> None:
        """Stop scheduling ``episode_name`` (it failed); no EpisodeEnded follows."""
        track = self._track(episode_name)
        track.ended, track.end_reason = True, None
        self._pending_ends = [e for e in self._pending_ends if e.episode.name != episode_name]

    def next(self) -> StepTask | EpisodeEnded | None:
        """The next item; in follow mode this waits (polling) for files to arrive."""
        while True:
            if self._pending_ends:
                end = self._pending_ends.pop(0)
                if end.reason != "error":  # every step ran: its history is all of them (--preview draws it)
                    track = self._track(end.episode.name)
                    track.current = len(track.files)
                return end
            if self.follow:
                # Poll after each pause, and while steps keep running at most once per poll_interval: every step
                # polled every caught-up folder (100 robots: a listing of 99 folders per step).
                now = self._clock()
                if self._slept or now - self._polled_at >= self.poll_interval:
                    self._polled_at, self._slept = now, False
                    self._adopt_new_episodes()
                    self._drop_ended()
                    for track in self._live:
                        if not track.ended and track.cursor >= len(track.files):  # a backlog needs no poll
                            self._guarded_scan(track)
                            # END there as its steps are taken, or as it waits for more: its folder's names are
                            # looked at now, not first at its turn (then 0.5 s more: each episode in turn in
                            # sequential order, a round of the others' steps more in round-robin)
                            if track.end_seen is None and not track.ended and track.source.has_end_marker():
                                self._end_settled(track)
                if all(t.ended for t in self._live) and not self._pending_ends:
                    # Every episode ended. A watched folder of episodes ends too once no episode folder was made in
                    # it for idle_timeout seconds since: a robot starts its next episode there after a pause.
                    self._all_ended_at = now if self._all_ended_at is None else self._all_ended_at
                    if not self._watch or now - self._all_ended_at >= self.idle_timeout:
                        self._warn_late_files()
                        self._warn_unjoined()
                        return None
                    self._sleep(self.poll_interval)
                    self._slept = True
                    continue
            item = self._pick()
            if item is not None:
                return item
            if not self._pending_ends:
                if not self.follow:  # every episode ended: one not ended would have given a step or its end
                    return None
                self._sleep(self.poll_interval)
                self._slept = True

    # -- internals -----------------------------------------------------------------------------------------

    def _track(self, name: str) -> _Track:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"unknown episode {name!r}") from None

    def _adopt_new_episodes(self) -> None:
        """Follow the episode folders a robot has started in a watched folder of episodes since the last poll."""
        for watched in self._watch:
            for path in self._new_episode_folders(watched):
                if self._renamed_episode(path):  # an episode's folder under a new name: not another episode
                    continue
                source = self._names.add(path)
                if source is None:  # an episode already: given as EPISODE too, or a link to one
                    if not self._warn_another_path(path):
                        self._warn_another_folder(path)  # or another folder where an episode of the run was read
                    continue
                self._on_new_episode(source)  # the run records it before any of its steps is handed out
                done = self._done.get(source.name, {})
                track = _Track(source=source, done=dict(done), done_sorted=sorted(done), last_activity=self._clock())
                self._tracks.append(track)
                self._live.append(track)
                self._by_name[source.name] = track
                self._all_ended_at = None

    def _drop_ended(self) -> None:
        """Drop the ended episodes from ``_live``, the round-robin turn staying on the episode it was on. Called where
        the episodes are looked at anyway (a poll), or once an ended one was met (a pick)."""
        if any(t.ended for t in self._live):
            self._turn = sum(not t.ended for t in self._live[:self._turn])
            self._live = [t for t in self._live if not t.ended]

    @staticmethod
    def _new_episode_folders(watched: _Watched) -> list[Path]:
        """``new_episode_folders`` of a watched folder of episodes, listed only when its timestamps changed (a name
        made, deleted or renamed in it), as an episode's folder is (``_listing``): its finished episodes piled up in
        a long run, and each poll listed them all (2,000: 0.9 ms, 10 polls a second). Its subfolders still empty are
        looked into at each poll; its links to no folder when a folder on their way changed (``_look_at``)."""
        try:
            st = os.stat(watched.folder)
        except OSError:  # gone or unreadable: as new_episode_folders
            return []
        stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        now = time.monotonic()
        if stamp != watched.stamp:
            watched.stamp, watched.stamp_seen, watched.trusted = stamp, now, False
        elif watched.trusted and now - watched.listed_at < _RELIST:
            return StepScheduler._look_at(watched, watched.waiting, now)
        try:
            names = frozenset(os.listdir(watched.folder))
        except OSError:
            return []
        if watched.trusted and names != watched.names:
            watched.stamp_unreliable = True  # a name came (or went) without the timestamps changing
        # A name gone since the last listing, or every name of a folder put in the watched one's place (renamed away
        # and made again: a recorder starting a new day's folder), is looked at again when a folder comes there: it
        # stayed settled, and an episode folder made under a finished episode's name was passed over without a word.
        if watched.folder_inode in (None, st.st_ino):
            watched.settled -= watched.names - names
        else:
            watched.settled.clear()
        watched.folder_inode = st.st_ino
        watched.held.clear()  # every link looked at again at a listing: every _RELIST seconds at least
        found = StepScheduler._look_at(watched, names, now)
        watched.trusted = not watched.stamp_unreliable and now - watched.stamp_seen >= _settle(stamp)
        watched.names, watched.listed_at = names, now
        watched.waiting = [name for name in names if name not in watched.settled and not name.startswith(".")]
        return found

    @staticmethod
    def _look_at(watched: _Watched, names: Iterable[str], now: float) -> list[Path]:
        """``new_episode_folders`` of ``names`` in the watched folder of episodes ``watched``, less its links that
        lead to no folder (to nothing, to a file) while each folder their lookup reads a name in keeps the stamp
        (device, inode number, mtime, ctime) it had as they were last looked at: what a link leads to changes only
        with one of those (``ln -sfn`` renames a new link over it, in its folder or over a link further on; a
        recording made, renamed or deleted where it leads; a disk mounted on the way). 2,000 links to files were
        looked at (2 stats each) at every poll, 11-33 ms; now each folder on their ways is stat'ed once. A link is
        held only once the stamps on its way were seen ``_SETTLE`` before (as ``_listing``: a change in the same
        timestamp tick leaves them as they were), and never in a folder whose timestamps proved unreliable."""
        stamps: dict[str, tuple[int, ...] | None] = {}  # this poll's, each folder stat'ed once
        held: set[str] = set()
        for way, links in list(watched.held.items()):
            if all(_folder_stamp(folder, stamps) == stamp for folder, stamp in way):
                held |= links
            else:
                del watched.held[way]
        look = [name for name in names if name not in held]
        found = new_episode_folders(watched.folder, watched.settled, look)
        assert watched.stamp is not None, "a watched folder looked into before its stamp was taken"
        look = [name for name in look if name not in watched.settled and not name.startswith(".")]
        if not look or watched.stamp_unreliable or now - watched.stamp_seen < _settle(watched.stamp):
            return found  # its own stamp is on every link's way: none could be held (and no way is read for nothing)
        real = os.path.realpath(watched.folder)
        for name in look:
            if (way := _lookup_way(real, name)) is None:
                continue  # no link (a folder still empty), or a link to a folder: looked into at each poll
            stamped, settled = [], True
            for folder in way:  # each one's stamp seen now, settled or not: held at a later poll
                if (stamp := _folder_stamp(folder, stamps)) is None:
                    settled = False
                    continue
                if (seen := watched.seen.get(folder)) is None or seen[0] != stamp:
                    watched.seen[folder] = seen = (stamp, now)
                settled = settled and now - seen[1] >= _settle(stamp)
                stamped.append((folder, stamp))
            if settled:
                watched.held.setdefault(tuple(stamped), set()).add(name)
        # this poll stat'ed every folder on the way of a link still there (held or looked at): those of links gone
        # are let go (they were kept for the rest of the run, a folder a link to a recording not made yet)
        watched.seen = {folder: seen for folder, seen in watched.seen.items() if folder in stamps}
        return found

    def _renamed_episode(self, path: Path) -> bool:
        """Whether ``path``, new in a watched folder of episodes, is an episode's folder renamed there (a recorder
        publishing it under its final name, ``ep1.part`` -> ``ep1``); that episode is then followed at ``path``."""
        if self._names.of(path) is not None:
            return False
        try:
            identity = path.stat().st_ino
        except OSError:
            return False
        parent = path.parent.resolve()
        # identity: at its first poll, else when found (renamed while the model loaded). Each episode with that inode
        # number is tried: an ended one's deleted folder may have given it to the folder renamed (ext4 reuses them).
        for track in self._tracks:
            if (_identity(track) == identity and track.source.path.parent.resolve() == parent
                    and self._follow_rename(track)):
                return True
        return False

    def _warn_another_path(self, path: Path) -> bool:
        """Whether ``path``, found in a watched folder of episodes, is another path to an episode's folder (a link to
        nothing there that came to lead to it: ``live/cam -> ../rec/latest``, pointed at ``live/arm_a``), named in a
        warning unless discover_episodes named it: it does not join, the recording running once, at the path it was
        found at first. It joined without a word; and at the folder's first listing (the model loading since the
        episodes were found) it was passed over unnamed. False for the episode's own path (another folder there,
        perhaps)."""
        track = self._by_name.get(self._names.of(path) or "")
        if track is None:
            return False
        read, named = track.source.path, episode_folder_path(path)
        if named == episode_folder_path(read):
            return False
        if named in track.source.named_again:  # a link to it as the run started: named then
            return True
        if os.path.islink(read):
            why = f"{'a link to ' if os.path.islink(path) else ''}the folder {as_typed(read)} links to"
        else:
            why = f"{'a link' if os.path.islink(path) else 'another path'} to {as_typed(read)}"
        self._warn(f"{as_typed(path)} is episode {track.source.name!r} again ({why}): it does not join the run, which "
                   f"reads that recording at {as_typed(read)} (a recording runs once in a run; to run it again, give "
                   f"{shell_word(path)} as EPISODE in a new --out, where it is {track.source.name!r} too)")
        return True

    def _warn_another_folder(self, path: Path) -> None:
        """``path``, an episode folder in a watched folder of episodes, is where an episode of the run was read, but
        another folder (that one deleted or moved away, or the watched folder replaced, and a folder made again under
        its name): it does not join the run, which has an episode at that path already (its outputs, run.json and
        --resume name episodes by their folder), and is named instead of passed over."""
        track = self._by_name.get(self._names.of(path) or "")
        try:
            inode = path.stat().st_ino
        except OSError:
            return
        # the episode's own folder (given twice, or a link): its inode number, and not another file under its first
        # step file's name, by its bytes (ext4 gives a folder deleted and made again its inode number, and its files')
        if (track is None or _identity(track) is None
                or (_identity(track) == inode and not _another_first_file(path, track))):
            return
        if (path, inode) in self._named_another:  # named as a poll found it, and again as the run ended
            return
        self._named_another.add((path, inode))
        # a name free there and not read by the run (robots/ep1-2 may be yesterday's ep1, renamed so: `mv` into it
        # put this one inside that episode)
        free, count = path.parent / f"{path.name}-2", 2
        while os.path.lexists(free) or self._names.of(free) is not None:
            count += 1
            free = path.parent / f"{path.name}-{count}"
        self._warn(f"{as_typed(path)} did not join the run: episode {track.source.name!r} of this run was read from "
                   "that path, and this is another folder (the one it read was deleted or moved away, or the folder of "
                   f"episodes replaced), so its steps do not run (rename it to a name this run has not used, such as "
                   f"{shell_word(free)}, and it joins; or run it in a new --out)")

    def _follow_rename(self, track: _Track) -> bool:
        """Follow ``track`` at its folder's new name, if the folder was renamed in a watched folder of episodes to a
        name that is watched (not hidden): the same inode beside where it was, holding the step files taken from it
        and the first one unchanged (a folder deleted and another made that got its inode number is not it). Its
        episode keeps its name (its session, its outputs, results.jsonl); the old name is free for a new episode
        folder. Unchanged by inode number and mtime, not by content as ``_another_first_file`` tells its own folder:
        taken for a rename, another folder with the same first step (a simulator's reset frame) would never run as
        an episode of its own (its steps left unrun), where a renamed folder whose first file was touched runs again as
        an episode of its own (one followed fails, ``_gone`` saying why)."""
        old, identity = track.source.path, _identity(track)
        # ended having taken no step file (it failed): a folder made since that got its inode number is not it
        if identity is None or (track.ended and not track.taken) or not self._watched(old):
            return False
        try:
            st = _folder_stat(old)
        except OSError:
            return False
        if st is not None and st.st_ino == identity:  # still there
            return False
        renamed = _renamed_to(old, identity, track.taken, link=track.link)
        if renamed is None or renamed.name.startswith(".") or not _holds_first_file(renamed, track.first_file):
            return False
        new = old.parent / renamed.name  # as the run names it: relative where it was given so
        how = _how_moved(old, new, track.link_inode if track.link else None)
        track.source.path = new
        track.link, track.link_inode = _link_inode(new)
        track.files = [StepFile(path=new / f.path.name, step=f.step) for f in track.files]
        track.unready, track.unnumbered, track.stamp, track.trusted = [], [], None, False
        self._names.move(track.source.name, old, new)
        for watched in self._watch:
            if watched.folder.resolve() == old.parent.resolve():
                watched.settled.discard(old.name)  # another folder made under the old name is a new episode
                watched.settled.add(new.name)
        self._on_moved(track.source, old, how)
        return True

    def _watched(self, folder: Path) -> bool:
        """Whether ``folder`` is in a watched folder of episodes."""
        parent = Path(os.path.abspath(folder)).parent.resolve()
        return any(parent == watched.folder.resolve() for watched in self._watch)

    def _pick(self) -> StepTask | None:
        """The next step, by index from the turn (sequential: from the first episode not ended), looking at no
        more episodes than it skips: a step costs the same for 10 episodes or 10,000."""
        if self.order == "sequential" and self._live and self._live[0].ended:
            self._drop_ended()  # an ended episode never runs again
        n = len(self._live)
        indices = range(min(1, n)) if self.order == "sequential" else ((self._turn + i) % n for i in range(n))
        task, ended = None, False
        for index in indices:
            track = self._live[index]
            if track.ended:
                ended = True
                continue
            task = self._advance(track)
            if task is not None or self._pending_ends:  # a step, or this episode just ended
                self._turn = (index + 1) % n
                break
        if ended:  # once per episode that ended: the next picks skip it no more
            self._drop_ended()
        return task

    def _advance(self, track: _Track) -> StepTask | None:
        """The next undone step of ``track`` (done ones are skipped); queues its end when it has none."""
        while track.cursor < len(track.files):
            step_file = track.files[track.cursor]
            ordinal = track.cursor
            track.cursor += 1
            if step_file.step in track.done:
                continue
            if track.lost and track.lost[0] < step_file.step:  # its history lacks a done step's file: cannot run
                track.ended = True
                lost = [step for step in track.lost if step < step_file.step]
                present = [f.step for f in track.files if f.step not in track.lost]
                self._pending_ends.append(EpisodeEnded(episode=track.source, reason="error",
                                                       error=gap_error(track.source.path, present, lost, len(lost))))
                return None
            if not track.history_checked:  # once: the first step file cannot change after one was taken
                track.history_checked = True
                changed = _changed_history(track, self._go_on)
                if changed is not None:  # its session cannot be what it was: fail the episode, never run the step
                    track.ended = True
                    self._pending_ends.append(EpisodeEnded(episode=track.source, reason="error", error=changed))
                    return None
            track.current = ordinal
            track.last_activity = self._clock()
            is_last = self._is_last(track)
            if is_last:  # its end comes right after this step, not on the episode's next turn
                track.ended = True
                track.end_reason = "end_marker" if self.follow else None
                self._pending_ends.append(
                    EpisodeEnded(episode=track.source, reason="end_marker" if self.follow else "complete"))
            # as listed now: its END's scan may have found the folder renamed (a recorder publishing it right then)
            return StepTask(episode=track.source, file=track.files[ordinal], ordinal=ordinal, is_last=is_last)
        try:
            reason = self._end_reason(track)
        except ObservationError as exc:  # the episode cannot end cleanly: a step is missing
            track.ended = True
            self._pending_ends.append(EpisodeEnded(episode=track.source, reason="error", error=exc))
            return None
        if reason is not None:
            track.ended = True
            track.end_reason = reason if self.follow else None
            self._pending_ends.append(EpisodeEnded(episode=track.source, reason=reason))
        return None

    def _warn_late_files(self) -> None:
        """Once per episode, when every episode has ended: the step files that arrived after their episode ended
        (END seen, or the idle timeout) and so never ran, instead of leaving them unrun without a word."""
        for track in self._tracks:
            reason, track.end_reason = track.end_reason, None
            if reason is None:
                continue
            try:
                st = _folder_stat(track.source.path)
                if st is not None and (st.st_ino != _identity(track)
                                       or _another_first_file(track.source.path, track)):
                    # another folder there now: not its late files. Made as the old one went, between two listings
                    # of the watched folder (a step's forward long), no poll found it: named now
                    if self._watched(track.source.path) and episode_entries(track.source.path):
                        self._warn_another_folder(track.source.path)
                    continue
                # a writer's temporary name there (tmpabcdefgh.safetensors) hid the numbered ones: passed over; one
                # in capitals (step_000001.SAFETENSORS) is a step file all the same, named with the rename it needs
                unnumbered: list[Path] = []
                late = [f.path.name for f in track.source.scan(skip=track.taken, unnumbered=unnumbered)]
                capitals = [path.name for path in unnumbered if in_other_case(path.name)]
            except (ObservationError, OSError):  # the folder is gone or unreadable now: nothing to name
                continue
            # in step order, as summary.json's late_steps lists them: one in capitals by its number, one with none last
            late = sorted(late + capitals, key=_step_order)
            if late:
                self.late[track.source.name] = late
                when = "its END file was seen" if reason == "end_marker" else "it ended at --idle-timeout"
                rename = "" if not capitals else (
                    f"; first, as {first_of(capitals, 2)} {'is' if len(capitals) == 1 else 'are'} in capitals, "
                    f"{other_case_error(track.source.path, capitals).hint}")
                self._warn(f"episode {track.source.name!r}: {', '.join(late)} arrived in {track.source.path} after "
                           f"{when} and did not run (--resume runs {'it' if len(late) == 1 else 'them'}{rename})")

    def _warn_unjoined(self) -> None:
        """When a followed run ends: what a robot wrote in a watched folder of episodes that never ran, instead of
        leaving it unrun without a word. A subfolder that holds something but never a step file, END or
        episode.yaml (a robot writing its episodes one level deeper, robots/2026-12-03/ep1; an empty one is a robot
        that has not started), and step files in the watched folder itself (a writer given the folder of episodes
        for an episode's)."""
        for watched in self._watch:
            folder, settled = watched.folder, watched.settled
            try:
                names = sorted(name for name in os.listdir(folder) if not name.startswith("."))
            except OSError:  # gone or unreadable now: its episodes said so
                continue
            # an episode of the run is not one: one that held no step file failed, its error naming why
            idle = [name for name in names if name not in settled and _holds_something(folder / name)
                    and not is_run_output(folder / name) and self._names.of(folder / name) is None]
            steps = [name for name in names if name.endswith(STEP_SUFFIXES)]
            deeper = dict(_folders_of_episodes(folder, idle))
            idle = [name for name in idle if name not in deeper]
            for name, inside in deeper.items():
                self._warn(f"{as_typed(folder)}: {name} never joined the run: its sub-folders {listed(inside)} look "
                           "like episode folders, one level deeper than a folder of episodes is watched (give "
                           f"{shell_word(folder / name)} as EPISODE)")
            if idle:
                self._warn(f"{as_typed(folder)}: {listed(idle)} never joined the run: no step file, END or "
                           "episode.yaml came in it, only other files or folders (a folder of episodes is watched "
                           "for episode folders in it, not deeper: give a deeper folder of episodes as EPISODE)")
            for name in names:  # looked at each poll, never led to an episode folder: not passed over unsaid
                if name not in settled and (found := dangling_link(folder / name)):
                    (dangling, loops), link = found, shell_word(folder / name)
                    # a loop, or more links than the system follows, leads nowhere whatever is recorded: "the
                    # recording ... never appeared" sent one waiting
                    why = (f"point it at a recording (ln -sfn RECORDING {link}), then" if loops else
                           "the recording it links to never appeared while the run watched; once it is there,")
                    self._warn(f"{as_typed(folder / name)} never joined the run: it is {dangling} ({why} run it with "
                               f"{link} as EPISODE in a new --out, or --resume this run)")
            if steps:
                self._warn(f"{as_typed(folder)}: {listed(steps)} did not run: a followed folder of episodes runs the "
                           "step files of the episode folders in it, not its own")

    def _is_last(self, track: _Track) -> bool:
        if track.cursor < len(track.files):
            return False
        if not self.follow:
            return True
        if not track.source.has_end_marker() or not self._end_settled(track):
            return False
        self._guarded_scan(track, force=True)  # a step written just before the marker
        return track.cursor >= len(track.files) and not track.looks and not track.ended

    def _end_reason(self, track: _Track) -> str | None:
        if not self.follow:
            return "complete"
        if track.end_gone or track.source.has_end_marker():
            if not self._end_settled(track):
                return None
            self._guarded_scan(track, force=True)
            if track.ended:  # the scan failed it: its error is queued, not an end_marker too
                return None
            self._raise_gap(track)
            if track.cursor < len(track.files) or track.looks:
                return None
            self._raise_empty(track, "its END marker came before any step file",
                              "write END after the episode's last step file")
            return "end_marker"
        if self._clock() - track.last_activity >= self.idle_timeout:
            if self._still_writing(track, self.idle_timeout):
                track.last_activity = self._clock()
                return None
            known = len(track.files)
            self._guarded_scan(track, force=True)  # an incomplete file that stopped changing: its error, not a skip
            if len(track.files) > known or track.ended:
                return None
            self._raise_gap(track)
            self._raise_empty(track, f"no step file arrived within --idle-timeout {self.idle_timeout:g} s",
                              "check that the robot writes step_000000.safetensors, ... into this folder, "
                              "or raise --idle-timeout")
            return "idle_timeout"
        return None

    def _end_settled(self, track: _Track) -> bool:
        """Whether ``track``'s END file ends it now: its folder's names stayed the same for ``_END_SETTLE`` seconds
        since END was seen, and no step file is being written under a temporary name, nor grew in place (cp -r),
        meanwhile. A copy of a finished episode may make END first (rsync sends names in sorted order, END before
        episode.yaml and step_*; cp -r and shutil.copytree in the order the folder lists them): ended at once, its
        step files came after it and never ran, or it failed as an END with no step file."""
        try:
            names = frozenset(os.listdir(track.source.path))
        except OSError:  # gone or unreadable: the scan says so
            return True
        now = self._clock()
        writing = self._still_writing(track, self.idle_timeout)
        # END's scan takes a file unchanged for one poll, whole or not: one copied in place under its own name keeps
        # the names the same, and a copy pausing for a poll handed it over half written (failed as truncated)
        looks = dict(track.looks)
        grew = track.end_seen is not None and any(track.end_seen[2].get(name, look) != look
                                                  for name, look in looks.items())
        if track.end_seen is None or track.end_seen[1] != names or writing or grew:
            track.end_seen = (now, names, looks)
            # other files made there all along (a camera's frames): END counts once no step came for the idle timeout
            return not writing and now - track.last_activity >= self.idle_timeout
        track.end_seen = (track.end_seen[0], names, looks)
        return now - track.end_seen[0] >= _END_SETTLE

    @staticmethod
    def _still_writing(track: _Track, idle_timeout: float) -> bool:
        """Whether a step file is being written under a temporary name: ``write_step``'s
        (``.step_000001.safetensors.XXXX.tmp``), rsync's (``.step_000001.safetensors.Ab3dE9``), or one without a step
        number or under another writer's temporary name (tempfile's ``tmpk3jx9a1b.safetensors``) that the follower
        waits to see renamed. One that appeared, or
        whose size or mtime changed (a writer that sizes the file first), since the last look is activity, and the
        idle timer starts again; one first seen only if written within the last ``idle_timeout`` seconds (a stray
        ``calibration.npz`` there for longer keeps no episode waiting). Looked at only when the timer runs out: a
        writer killed mid-write leaves a file that stops changing, and the episode then ends one timeout later."""
        names = names_in(track.source.path)  # [] when gone: the scan says so
        unnumbered = {path.name for path in track.unnumbered}
        looks = {}
        for name in names:
            if _STEP_TEMPORARY.fullmatch(name) or _RSYNC_TEMPORARY.fullmatch(name) or name in unnumbered:
                with contextlib.suppress(OSError):
                    st = (track.source.path / name).stat()
                    looks[name] = (st.st_size, st.st_mtime_ns)
        recent = time.time_ns() - idle_timeout * 1e9
        changed = any(track.writing[name] != look if name in track.writing else look[1] > recent
                      for name, look in looks.items())
        track.writing = looks
        return changed

    def _gone(self, track: _Track) -> ObservationError:
        """The error of an episode whose folder is gone: renamed in its folder (a recorder publishing a finished
        episode under its final name) is named as such, as is the new name joining a watched folder's run."""
        folder, arrived = track.source.path, f"{len(track.files)} of its steps had arrived"
        renamed = _renamed_to(folder, track.identity, track.taken, link=track.link)
        dangling = link_to_nothing(folder) if renamed is None and track.link else None
        if dangling:  # the link is there: its recording was moved or deleted (a folder "gone" sent looking for it)
            return ObservationError(
                f"{as_typed(folder)}: the episode folder is {dangling} (its recording was deleted or moved while it "
                f"was followed); {arrived}",
                hint=f"point the link at where the recording is now (or put it back), then {self._go_on}")
        if renamed is None:
            return ObservationError(
                f"{as_typed(folder)}: the episode folder is gone (deleted or renamed while it was followed); {arrived}",
                hint="keep an episode's folder in place until its END file is written; to run it again, put the "
                     f"folder back, then {self._go_on}")
        # a hidden name (`.trash-ep1`) is not looked at in a watched folder: that one is not followed, nor joins
        if not self._watched(folder) or renamed.name.startswith("."):
            if track.link and not (how := _how_moved(folder, renamed, track.link_inode)).startswith("renamed"):
                # the link still there (its recording moved into place beside it), or deleted or pointed elsewhere
                # with another link there to its recording: it was "renamed to cam2", of a link not renamed
                try:
                    target = os.readlink(renamed)
                except OSError:  # the recording itself, moved beside the link
                    target = renamed.name
                return ObservationError(
                    f"{as_typed(folder)}: the episode folder {how}, while it was followed; {arrived}",
                    hint=f"point the link at its recording again (ln -sfn {shell_word(target)} {shell_word(folder)}), "
                         f"then {self._go_on}")
            return ObservationError(f"{as_typed(folder)}: the episode folder was renamed to {renamed.name} while it "
                                    f"was followed; {arrived}",
                                    hint="keep an episode's folder in place until its END file is written")
        # renamed in a watched folder of episodes, and not followed there: its first step file is another one now
        first = track.first_file[0] if track.first_file else "its first step file"
        return ObservationError(
            f"{as_typed(folder)}: the episode folder was renamed to {renamed.name} while it was followed; {arrived}; "
            f"in the watched {as_typed(folder.parent)} it joins the run as an episode of its own, from its first step "
            f"({first} in it is not the file that ran)",
            hint=f"its steps run again as episode {renamed.name}: keep an episode's step files as they are when its "
                 "folder is renamed (a renamed folder goes on as the same episode while its first step file is the "
                 "one that ran)")

    def _repointed(self, track: _Track) -> ObservationError:
        """The error of an episode whose folder is a link that leads to another folder now than when the run found it
        (``ln -sfn``: a recorder pointing ``latest`` at its next recording)."""
        folder = track.source.path
        try:
            target = os.readlink(folder)
            now = f", now to {target}"
            # a link to a link (live/cam -> rec/latest -> arm_b): the one pointed elsewhere may be the last, so the
            # first hop alone named the path the link always led to
            if os.path.islink(os.path.join(os.path.dirname(folder), target)):
                now += f", a link that leads to {as_typed(os.path.realpath(folder))}"
        except OSError:
            now = ""
        return ObservationError(
            f"{as_typed(folder)}: the episode folder is a link{now}, another folder than the one it led to when the "
            f"run found it (pointed elsewhere, or that folder deleted and made again, while it was followed); "
            f"{len(track.files)} of its steps had arrived",
            hint=f"the episode is the recording the link led to, which names it ({track.source.name}): run the "
                 "folder the link leads to now as an episode of its own, in a new --out; to finish this one, point the "
                 f"link back at its recording, then {self._go_on}")

    def _raise_empty(self, track: _Track, what: str, hint: str) -> None:
        """An episode that ends with no step file at all failed, as it does without ``follow``. A folder given as
        EPISODE that was empty at the start was taken for an episode: if episode folders were made in it since (the
        run started before the robots' first episodes), the error says so. Episode folders one level down of one
        that held them at its first poll (a folder of episodes given one level too high), or of an episode of a
        watched folder of episodes (``data/run1/episode_000``, ``data`` given: whenever they were made), are named
        with the folder to give, as without ``follow``; so are episode folders two levels down."""
        if track.files:
            return
        folder = track.source.path
        made = [child.name for child in new_episode_folders(folder, set())]
        there = made if self._watched(folder) else [name for name in made if name in track.inside]
        if there:
            raise ObservationError(f"{as_typed(folder)}: {what}; its sub-folders {listed(there)} look like episode "
                                   "folders, one level down", hint=_one_level_down_hint(folder))
        deeper = [] if made else _folders_of_episodes(folder)
        if deeper:
            name, inside = deeper[0]
            raise ObservationError(f"{as_typed(folder)}: {what}; its sub-folder {name} holds episode folders "
                                   f"({listed(inside)}), two levels down", hint=_one_level_down_hint(folder / name))
        if made:
            what += (f"; episode folders were made in it since ({listed(made)}): it was empty when the run started, "
                     "so it was followed as one episode")
            hint = (f"make one episode folder in it before the run (mkdir -p {shell_word(folder / made[0])}): "
                    "--follow then takes it for a folder of episodes, and follows each episode folder made in it")
        raise ObservationError(f"{as_typed(folder)}: {what}", hint=hint)

    def _raise_gap(self, track: _Track) -> None:
        if track.gap is not None:
            last, present = track.gap
            steps = [f.step for f in track.files] + [present]
            raise gap_error(track.source.path, steps, list(range(last + 1, min(present, last + 6))),
                            present - last - 1)

    def _guarded_scan(self, track: _Track, *, force: bool = False) -> None:
        """Scan ``track``'s folder; an unreadable folder ends the episode with an error item. ``force``: take a
        file that stopped changing even if it looks incomplete (END or the idle timeout came)."""
        if track.ended:
            return
        try:
            self._scan(track, force=force)
        except (ObservationError, OSError) as exc:  # OSError: its folder, or one above, made unenterable meanwhile
            # unreadable_folder raises the limit on open files again: failing every episode in turn as its folder is
            # listed would bury the cause; the run stops (exit 1, the limit's hint)
            error = exc if isinstance(exc, ObservationError) else unreadable_folder(track.source.path, exc)
            track.ended = True
            self._pending_ends.append(EpisodeEnded(episode=track.source, reason="error", error=error))

    def _scan(self, track: _Track, *, force: bool = False) -> None:
        if not self.follow:
            files = track.source.scan()
            if not files and track.done_sorted:  # emptied since they ran
                raise _lost_history(track, None, self._go_on)
            if not files:
                raise _no_step_files(track.source.path)
            # the five an error shows, or one more than the done steps: then not all of them are done
            missing, count = missing_steps([f.step for f in files], limit=max(5, len(track.done) + 1))
            later = [f.step for f in files if f.step > missing[0]] if missing else []
            if missing and not all(step in track.done for step in [*missing, *later]):  # else: lost done steps
                raise gap_error(track.source.path, [f.step for f in files], missing, count)
            track.files = _with_lost(track, files, missing)
            return
        st = _folder_stat(track.source.path)
        # gone, or another folder in its place: renamed in its watched folder? (not at every first poll: only then)
        if (st is None or st.st_ino != _identity(track)) and self._follow_rename(track):
            st = _folder_stat(track.source.path)
        identity = st.st_ino if st is not None else None
        if identity is None:  # it existed at the start (discover_episodes): deleted or renamed since
            if (track.end_seen is not None and track.files and track.cursor >= len(track.files) and not track.looks
                    and not track.unnumbered):
                # removed (or moved away) once its END was seen, every step file in it handed out: a recorder's
                # cleanup of a finished episode while END counted its 0.5 s. It ends by END (``_end_reason``).
                track.end_gone = True
                return
            raise self._gone(track)
        then = _identity(track)
        if then is not None and identity != then and (track.files or track.link):
            # Another folder put in its place between two polls (a recorder restarting its episode): its steps are
            # another episode's, not the session's history; a poll between the two would have found it gone. A link
            # pointed at another folder, even before a step came (files is empty at the first poll): the episode is
            # named after the folder the link led to when the run found it, and would run another recording's steps.
            if track.link and os.path.islink(track.source.path):  # a folder moved in place of the link: replaced
                raise self._repointed(track)
            raise ObservationError(
                f"{track.source.path}: the episode folder was replaced (deleted or renamed, and another folder put "
                f"in its place, while it was followed); {len(track.files)} of its steps had arrived from the old one",
                hint="keep an episode's folder in place until its END file is written, and start a new episode in a "
                     "folder of its own; run this one again in a new --out",
            )
        first_poll, track.identity = track.identity is None, identity
        last = track.files[-1].step if track.files else -1
        blocked = False  # an earlier new file is not stable yet: later ones wait for it
        track.gap = None
        present: set[str] = set()  # the unready names still there: a file deleted before it was taken is forgotten
        try:
            listed = self._listing(track, st, force=force)  # only new names: a poll stats no taken file
        except ObservationError:
            now = _folder_stat(track.source.path)
            if now is None or now.st_ino != identity:  # renamed (a recorder publishing ep1.part as ep1) or deleted
                return  # since the look above: the next poll follows it there, or says it is gone
            raise
        other_case = [path.name for path in track.unnumbered if in_other_case(path.name)]
        if other_case:  # no writer's temporary name: failed now, not after a later step ran as the first
            raise other_case_error(track.source.path, other_case)
        for step_file in listed:
            name = step_file.path.name
            try:
                file_st = step_file.path.stat()
                size, look = file_st.st_size, (file_st.st_size, file_st.st_mtime_ns)
            except FileNotFoundError:
                file_st = None
                if not step_file.path.is_symlink():
                    continue  # deleted since the listing
                # A link to nothing (a recording's disk not mounted): waited for as an empty file, then taken at END
                # or the idle timeout, where reading it names the link, as without follow; never skipped silently.
                size, look = 0, (0, 0)
            present.add(name)
            # Its size or mtime changed: the writer is not idle, and the file not done (one sized first, then filled
            # in place, keeps its size: its header may say it is whole while its data is still being written)
            if track.looks.get(name) != look:
                track.last_activity = self._clock()
            stable = track.looks.get(name) == look and (size > 0 or force)
            if stable and not force and not looks_whole(step_file.path, size):
                stable = False  # a writer paused mid-file: wait for the rest
            if blocked or not stable:
                track.looks[name] = look
                blocked = True
                continue
            if track.files and track.files[0].step <= step_file.step <= last:  # taken steps are consecutive
                taken = track.files[step_file.step - track.files[0].step].path.name
                raise ObservationError(f"{track.source.path}: two files for step {step_file.step}: {taken} and {name}",
                                       hint="keep one file per step")
            if step_file.step <= last:
                raise ObservationError(
                    f"{step_file.path}: step {step_file.step} arrived after step {last} had already run",
                    hint="write the steps of an episode in increasing step order",
                )
            if track.files and step_file.step != last + 1 and all(
                    step in track.done for step in range(last + 1, step_file.step + 1)):
                track.files = _with_lost(track, track.files, list(range(last + 1, step_file.step)))
                last = step_file.step - 1
            if track.files and step_file.step != last + 1:  # a gap: wait for the missing steps
                track.looks[name] = look
                track.gap = (last, step_file.step)
                blocked = True
                continue
            del track.looks[name]
            if not track.files and file_st is not None:
                track.first_file = (name, file_st.st_ino, file_st.st_mtime_ns, file_st.st_size)
                ran = self._ran_first.get(track.source.name)  # resume: it ran in an earlier run
                track.first_sha256 = ran[1] if ran is not None and ran[0] == step_file.step else None
            track.files.append(step_file)
            track.taken.add(name)
            last = step_file.step
            track.last_activity = self._clock()
        # A file seen unready and then deleted (a writer's cleanup of the step it was cut short in) would be waited
        # for forever: its episode never ended, not at END, which waits for every unready file, nor at the idle
        # timeout, which END comes before.
        for name in [n for n in track.looks if n not in present]:
            del track.looks[name]
        track.unready = [f for f in track.unready if f.path.name in track.looks]
        # A name without a step number (tempfile's tmpk_ohzexq.safetensors) failed the episode at the poll that saw
        # it, though renamed to its step's name a moment later; a writer's temporary name with a digit in it
        # (tmpk3jx9a1b.safetensors, step_000001.tmp.safetensors) was taken for a step. Either is waited for like an
        # unready file, forgotten once gone, and fails the episode (as without follow) if still there at END or the
        # idle timeout. One there at the first poll too: the run may start while the recorder is mid-write.
        track.unnumbered = [path for path in track.unnumbered if os.path.lexists(path)]
        if track.unnumbered and force:
            step_number(track.unnumbered[0])  # raises, naming it
        if first_poll and not track.files and not track.looks:  # episodes one level down, or a folder still empty
            track.inside = frozenset(episode_folders_inside(track.source.path))

    @staticmethod
    def _listing(track: _Track, st: os.stat_result, *, force: bool) -> list[StepFile]:
        """The step files of ``track``'s folder not taken yet, in step order. A caught-up folder is polled 10 times
        a second, and listing one of 1,500 step files costs 0.8 ms: while the folder's timestamps (mtime and ctime:
        a name added, removed or renamed, or its permissions changed) are the same as at a listing, the files still
        unready at it are all there is (each is still stat'ed: growth, deletion). A file made in the same timestamp
        tick as the listing would leave them unchanged, so they are trusted only for a listing made well after they
        were first seen (``_SETTLE``: longer than any tick). The folder is listed anyway every ``_RELIST`` seconds
        and at END and the idle timeout, so a file system whose folder timestamps do not change is caught (and then
        listed at every poll), never followed blind."""
        stamp = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        now = time.monotonic()  # not the scheduler's clock: a tick is real time
        if stamp != track.stamp:
            track.stamp, track.stamp_seen, track.trusted = stamp, now, False
        elif track.trusted and not force and now - track.listed_at < _RELIST:
            return list(track.unready)
        unnumbered: list[Path] = []
        files = track.source.scan(skip=track.taken, unnumbered=unnumbered)
        track.unnumbered = unnumbered
        if track.trusted and {f.path.name for f in files} != {f.path.name for f in track.unready}:
            track.stamp_unreliable = True  # a file came (or went) without the timestamps changing
        track.trusted = not track.stamp_unreliable and now - track.stamp_seen >= _settle(stamp)
        track.listed_at = now
        track.unready = files
        return files


def _settle(stamp: tuple[int, ...]) -> float:
    """How long after a folder's stamp (device, inode number, mtime, ctime) was first seen a look at it holds every
    change the stamp stands for: longer than its mtime's tick."""
    return _SETTLE if stamp[2] % 1_000_000_000 else _SETTLE_COARSE


def _folder_stamp(folder: str, stamps: dict[str, tuple[int, ...] | None]) -> tuple[int, ...] | None:
    """``folder``'s device, inode number, mtime and ctime (None where it cannot be stat'ed), kept in ``stamps``."""
    if folder not in stamps:
        try:
            st = os.stat(folder)
            stamps[folder] = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        except OSError:
            stamps[folder] = None
    return stamps[folder]


def _lookup_way(folder: str, name: str) -> list[str] | None:
    """The folders, as real paths, whose names decide what the system's lookup of the link ``name`` in the folder
    ``folder`` (a real path) leads to: each one it meets a link in (``folder``, one further on), goes up from
    (``..``) or ends in (a name not there, a file). What the link leads to changes only with one of their stamps: a
    folder it only passes through on the way down to one of them, replaced or a disk mounted on it, gives that one
    another device and inode number. None where ``name`` is no link or leads to a folder."""
    try:
        if not stat.S_ISLNK(os.lstat(os.path.join(folder, name)).st_mode):
            return None
    except OSError:
        return None
    way: list[str] = []
    parts, here, hops = [name], folder, 0  # the names to look up, the next last: ".." not collapsed
    while parts:
        name = parts.pop()
        if name in ("", "."):
            continue
        if name == "..":  # ``here`` is a real path: its parent is the folder above while ``here`` is that folder
            if here not in way:  # (the lookup into it a link's since, ``..`` leads elsewhere: another inode number)
                way.append(here)
            here = os.path.dirname(here)
            continue
        there = os.path.join(here, name)
        try:
            mode = os.lstat(there).st_mode
        except OSError:  # not there (or not to be looked at): the lookup ends in ``here``
            return [*way, here]
        if stat.S_ISDIR(mode):
            here = there
            continue
        if here not in way:
            way.append(here)
        if not stat.S_ISLNK(mode):  # a file: the lookup ends at it
            return way
        hops += 1
        if hops > 40:  # a loop, or more links than the system follows: until one on the way is pointed on
            return way
        try:
            target = os.readlink(there)
        except OSError:
            return way
        parts += target.split(os.sep)[::-1]
        here = os.sep if target.startswith(os.sep) else here
    return None


def _holds_something(path: Path) -> bool:
    """Whether ``path`` is a folder with a visible entry; False for anything this user may not list."""
    try:
        return any(not name.startswith(".") for name in os.listdir(path))
    except OSError:  # a file (ENOTDIR), gone, or locked
        return False


def _link_inode(path: Path) -> tuple[bool, int | None]:
    """Whether ``path`` is a link, and the link's own inode number then (None otherwise, or where it cannot be
    looked at)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False, None
    return (True, st.st_ino) if stat.S_ISLNK(st.st_mode) else (False, None)


def _how_moved(old: Path, new: Path, link_inode: int | None) -> str:
    """How an episode's folder ``old`` came to be followed at ``new``, beside it, for ``episode_moved``'s line:
    renamed (a folder, or the link itself: ``link_inode`` its inode number, None where ``old`` was no link), or,
    of a link, its recording moved into place at ``new`` or ``new`` another link to it (``cam1`` deleted or pointed
    elsewhere, ``cam2`` leading to the same recording)."""
    if link_inode is None or _link_inode(new)[1] == link_inode:
        return f"renamed to {new.name}"
    if not os.path.islink(new):
        return f"is a link whose recording was moved to {new.name}"
    try:
        now = f"was pointed at {os.readlink(old)}"
    except OSError as exc:  # EINVAL: a folder there now
        now = "was deleted" if exc.errno == errno.ENOENT else "was replaced"
    return f"(a link to its recording) {now}, and {new.name} is another link to it"


def _identity(track: _Track) -> int | None:
    """``track``'s folder's inode number: at its first poll, else when it was found (renamed during the model's load,
    before that poll)."""
    return track.identity if track.identity is not None else track.source.inode


def _once_each(folders: Iterable[Path]) -> list[Path]:
    """``folders`` less those that resolve to one before them."""
    first: dict[Path, Path] = {}
    for folder in folders:
        first.setdefault(folder.resolve(), folder)
    return list(first.values())


def _holds_first_file(folder: Path, first: tuple[str, int, int, int] | None) -> bool:
    """Whether ``folder`` holds the file ``first`` (name, inode, mtime, size) of an episode's first step file taken;
    True when none was taken."""
    if first is None:
        return True
    name, inode, mtime, _ = first
    try:
        st = (folder / name).stat()
    except OSError:
        return False
    return (st.st_ino, st.st_mtime_ns) == (inode, mtime)


def _another_first_file(folder: Path, track: _Track) -> bool:
    """Whether ``folder`` holds another file under the name of ``track``'s first step file taken: it is another
    folder, made where the episode's was and given its inode number. False with that name gone (a cleanup of the steps
    that ran) or none taken. A file whose inode number or mtime are not the one taken's is the episode's own if it has
    the bytes that ran (``first_sha256``, when known): touched, copied over in place (``cp -r``), or rewritten the same
    by a sync tool. Not by inode number alone: ext4 often gives a folder deleted and made again, and its first file,
    the old inode numbers. It is read only at the size taken (another size cannot hold those bytes: a huge file is not
    read), and once while it stays the same (the run's end asks twice, a folder made again there once more)."""
    if track.first_file is None:
        return False
    name, inode, mtime, size = track.first_file
    try:
        st = (folder / name).stat()
    except OSError:  # gone (a cleanup): not another; a link to nothing, or unreadable: not the file that ran
        return os.path.lexists(folder / name)
    if (st.st_ino, st.st_mtime_ns) == (inode, mtime):
        return False
    if track.first_sha256 is None:  # it has not run (yet), and did not on --resume either
        return True
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:  # a FIFO, or other bytes
        return True
    looks = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
    if track.first_judged is not None and track.first_judged[0] == looks:
        return track.first_judged[1]
    try:
        another = step_sha256(folder / name) != track.first_sha256
    except ObservationError:  # unreadable or empty: not the file that ran
        another = True
    track.first_judged = (looks, another)
    return another


def _folder_stat(path: Path) -> os.stat_result | None:
    """The stat of the folder ``path``; None when it is not there (or not a folder). Other errors (a folder above it
    locked) propagate: the scan names them."""
    try:
        st = path.stat()
    except OSError as exc:  # as Path.is_dir: only these mean "not there"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP):
            return None
        raise
    return st if stat.S_ISDIR(st.st_mode) else None


def _with_lost(track: _Track, files: list[StepFile], lost: list[int]) -> list[StepFile]:
    """``files`` with a stand-in for each of the ``lost`` steps: steps that ran (results.jsonl) and whose files were
    deleted since (a cleanup of what ran), between step files present. They keep each later step at its chunk and
    are skipped as done, so an episode with nothing left to run completes; one that has a step to run after them
    fails as a gap then (its session's history is gone)."""
    if not lost:
        return files
    track.lost = sorted({*track.lost, *lost})
    suffix = files[0].path.suffix
    stand_ins = [StepFile(path=track.source.path / f"step_{step:06d}{suffix}", step=step) for step in lost]
    track.taken.update(f.path.name for f in stand_ins)  # one put back later is not a second file for its step
    return sorted([*files, *stand_ins], key=lambda f: f.step)


def _changed_history(track: _Track, go_on: str) -> ObservationError | None:
    """Whether the done steps (results.jsonl) are where they ran in the episode, now that a step of it is to run:
    each at its recorded chunk. Not so when the files of the first steps that ran are gone, or when step files
    before the first one that ran were written since (a writer that wrote them out of order: the steps that ran
    took a later step for the episode's first). The step files taken are consecutive from the first, so a step's
    position is its number less the first's."""
    first = track.files[0].step
    if track.done_sorted and track.done_sorted[0] < first:
        return _lost_history(track, first, go_on)
    moved = sorted(step for step, chunk in track.done.items() if chunk is not None and chunk != step - first)
    if not moved:
        return None
    step, chunk = moved[0], track.done[moved[0]]
    began = step - chunk  # the episode's first step when it ran
    again = ("run the episode again from its first step in a new --out (a session's outputs depend on every earlier "
             "step)")
    if began > first:
        why = (f"{_steps(first, began - 1)} {'was' if began - first == 1 else 'were'} written after it ran (out of "
               f"step order), so its outputs were made without {'it' if began - first == 1 else 'them'}")
        hint = f"{again}; have the robot write an episode's steps in increasing step order"
    else:
        why = f"the files of {_steps(began, first - 1)} before it are gone"
        hint = f"{again}, or put the episode's step files back as they were when they ran, then {go_on}"
    return ObservationError(f"{track.source.path}: step {step} ran (results.jsonl) as chunk {chunk} of the episode, "
                            f"but it is chunk {step - first} now that the folder starts at step {first}: {why}",
                            hint=hint)


def _no_step_files(folder: Path) -> ObservationError:
    """An episode folder with no step file: it may hold files in another format, or be a folder of episode folders
    given one level too high (``data`` for ``data/run1/episode_000/step_*``: ``data/run1`` was taken for one)."""
    others = other_step_formats(folder)
    inside = [] if others else episode_folders_inside(folder)
    if inside:
        return ObservationError(f"{as_typed(folder)}: the episode folder holds no step files, but its sub-folders "
                                f"{listed(inside)} look like episode folders, one level down",
                                hint=_one_level_down_hint(folder))
    return ObservationError(
        f"{as_typed(folder)}: the episode folder holds no step files"
        + (f" (it holds {listed(others)}: a step file is .safetensors or .npz)" if others else ""),
        hint="an episode is a folder of step_000000.safetensors, step_000001.safetensors, ... (or .npz); "
             + ("ardiff_cli.io.write_step writes them" if others else
                "for a folder a robot is still writing, use --follow"),
    )


def _renamed_to(folder: Path, identity: int | None, taken: Iterable[str], *, link: bool = False) -> Path | None:
    """The folder beside where ``folder`` was that has its inode number ``identity`` and holds the step files
    ``taken`` from it (it was renamed), or None. The inode number alone named a folder made after ``folder`` was
    deleted (a robot's next episode), which may get it back. ``link``: ``folder`` was a link (``identity`` its
    target's), and a link beside it to that folder is it renamed (``cam`` -> ``cam2``), where no folder is."""
    if identity is None:
        return None
    renamed_link = None
    try:
        with os.scandir(folder.parent) as entries:
            for entry in entries:
                try:  # stat's, not the listing's inode(): overlayfs lists other numbers for folders than stat gives
                    if entry.is_symlink():
                        if (link and renamed_link is None and entry.is_dir() and entry.stat().st_ino == identity
                                and all(os.path.lexists(os.path.join(entry.path, name)) for name in taken)):
                            renamed_link = Path(entry.path)  # a folder with it (moved into place) comes first
                    elif (entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_ino == identity
                            and all(os.path.lexists(os.path.join(entry.path, name)) for name in taken)):
                        return Path(entry.path)
                except OSError:  # a link into a folder this user may not enter
                    continue
    except OSError:
        pass
    return renamed_link


def _folders_of_episodes(folder: Path, names: Container[str] | None = None) -> list[tuple[str, list[str]]]:
    """The sub-folders of ``folder`` (those in ``names`` only, if given) that hold episode folders, each with the
    names of those, in name order: a folder of episodes one level deeper than ``folder`` is read."""
    try:
        with os.scandir(folder) as entries:  # files (a robot's camera frames) are passed over without a listing
            subfolders = sorted(e.name for e in entries if not e.name.startswith(".")
                                and (names is None or e.name in names) and e.is_dir())
    except OSError:
        return []
    found = []
    for name in subfolders:
        inside = episode_folders_inside(folder / name)
        if inside and not episode_entries(folder / name) and not is_run_output(folder / name):
            found.append((name, inside))
    return found


def _one_level_down_hint(folder: Path) -> str:
    """What to give for ``folder``, an episode with no step file whose sub-folders hold episodes."""
    marks = episode_entries(folder)  # episode.yaml or END: taken for an episode, given or not
    if marks:
        return f"move {listed(marks)} out of it, or give its sub-folders as EPISODE"
    return (f"give {shell_word(folder)} as EPISODE: a folder of episode folders runs each of them (one level "
            "deep, not two)")


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}..{last}"


def _lost_history(track: _Track, first: int | None, go_on: str) -> ObservationError:
    """Steps that ran (results.jsonl) before the first step file in the folder (``None``: it holds none): their
    files are gone. ``go_on``: how the hint ends, once they are back (``StepScheduler``'s)."""
    lost = [step for step in track.done_sorted if first is None or step < first]
    others = other_step_formats(track.source.path) if first is None else []  # converted to another format?
    now = (f"the folder starts at step {first}" if first is not None else "the folder holds no step files"
           + (f" (it holds {listed(others)}: a step file is .safetensors or .npz)" if others else ""))
    return ObservationError(
        f"{track.source.path}: {_steps(lost[0], lost[-1])} ran (results.jsonl) but "
        f"{'their files are' if len(lost) > 1 else 'its file is'} gone: {now}, so the "
        f"episode's next step cannot run on the history its earlier outputs were made from",
        hint="run the episode again from its first step in a new --out (a session's outputs depend on every earlier "
             f"step), or put the episode's step files back as they were when they ran, then {go_on}",
    )
