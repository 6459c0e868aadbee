"""The swap snapshots a stopped rollout leaves for ``--resume``: ``OUT/.swap/kept.json``.

A run that stops (a signal, a failure) with sessions swapped out keeps their snapshot files and writes this index:
episode -> the file and how many of the episode's steps its session had consumed. Stopped by a signal, it swaps its
resident sessions out first (``_swap_out_resident`` in ``commands/rollout.py``), so they are kept too. ``--resume``
reads it, adopts each snapshot of at most the episode's done steps (fewer: a run stopped while it rebuilt the session
keeps the steps replayed so far), and restores those sessions instead of replaying those steps (once their step files
are found unchanged, as a replay would check them: else the episode fails and its snapshot goes); the others are
replayed as before. The index is deleted once its snapshots are
adopted: a resume that stops before (a signal or ``kill -9`` while the model loads, a refused ``--device``) leaves
it, and its files, to the next; one stopped after (a signal as it lists the episode folders) writes it again for
those it took back, as any stopped run does. Without the index (a ``kill -9`` of the run), every leftover file is
removed and every session replayed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

KEPT_FILE = "kept.json"
FORMAT = "ardiff-kept-1"


def write_kept(swap_dir: Path, kept: dict[str, tuple[str, int]], *, run: float) -> None:
    """Write the index of ``kept``: {episode: (file name, steps its session had consumed)}, as :func:`read_kept`
    gives it back to the run that started at ``run`` (run.json's ``started``)."""
    from ardiff_cli.io.atomic import atomic_write_json

    sessions = {name: {"file": file, "steps": steps} for name, (file, steps) in kept.items()}
    atomic_write_json(swap_dir / KEPT_FILE, {"format": FORMAT, "run": run, "sessions": sessions})


def read_kept(swap_dir: Path, *, run: float, warn: Callable[[str], None] | None = None) -> dict[str, tuple[str, int]]:
    """The index as {episode: (file name, steps)}, left in place (:func:`drop_kept` deletes it). {} when there is
    none, it is not one this version wrote whole, or another run wrote it (its sessions are then replayed): two runs
    whose ``.swap`` folders are links to one folder each wrote kept.json there, and a resume restored the other run's
    snapshot of an episode of the same name and steps, silently. ``run`` is the run's start (run.json's
    ``started``), which a copy of the run folder keeps with its snapshots. The temporary file of a write of it that
    a ``kill -9`` cut short goes with the run folder's others (``RunFolder.remove_stale_temporaries``).

    ``warn`` is told, once, why an index file there, or some of its entries, is not taken: without it an older
    ardiff's index (one that names no run) had every session replay with not a word of why."""
    from ardiff_cli.runtime.swap import SNAPSHOT_FILE

    why: list[str] = []
    data = _read_index(swap_dir, why)
    sessions = None if data is None else data.get("sessions")
    if data is not None and data.get("run") != run:
        why.append("it names no run: an older ardiff wrote it" if "run" not in data else "it names another run")
    elif data is not None and not isinstance(sessions, dict):
        why.append("its sessions are not a mapping")
    if data is None or why:
        if warn is not None and why:
            warn(f"{swap_dir / KEPT_FILE} is ignored ({why[0]}): the swap snapshots a stopped run kept there are "
                 "deleted, and an episode still to run replays its done steps instead")
        return {}
    kept, ignored = {}, []
    for name, entry in sessions.items():
        file, steps = (entry.get("file"), entry.get("steps")) if isinstance(entry, dict) else (None, None)
        if isinstance(file, str) and SNAPSHOT_FILE.fullmatch(file) and type(steps) is int and steps > 0:
            kept[name] = (file, steps)
        else:
            ignored.append(name)
    if warn is not None and ignored:
        from ardiff_cli.io.episode import listed
        from ardiff_cli.runtime.errors import plural

        warn(f"{swap_dir / KEPT_FILE}: the entries of {plural(len(ignored), 'episode')} ({listed(ignored)}) name no "
             "snapshot file and step count this version reads: those episodes replay their done steps instead")
    return kept


def kept_for(swap_dir: Path) -> float | None:
    """The start (run.json's ``started``) of the run the index in ``swap_dir`` keeps snapshots for; None when there is
    no index this version wrote whole."""
    run = (_read_index(swap_dir) or {}).get("run")
    return run if isinstance(run, (int, float)) and not isinstance(run, bool) else None


def _read_index(swap_dir: Path, why: list[str] | None = None) -> dict | None:
    """The index as written, when it is one of this version's; else None, and ``why`` (when given) gets the reason
    when there is an index file that is not (no file: no reason)."""
    from ardiff_cli.io.atomic import TooLarge, open_file, parse_json, read_capped
    from ardiff_cli.runtime.errors import shown

    path, why = swap_dir / KEPT_FILE, [] if why is None else why
    try:  # bytes: a file that is not UTF-8 is a ValueError too, not a crash of every resume
        with open_file(path) as f:
            data = parse_json(read_capped(f))
    except (FileNotFoundError, IsADirectoryError):  # none; a folder in its way, which the stopped run warned of
        return None
    except OSError as exc:
        why.append(f"cannot read it: {exc.strerror or exc}")
        return None
    except TooLarge as exc:
        why.append(str(exc))
        return None
    except ValueError as exc:
        why.append(f"not JSON: {exc}")
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else None
        why.append(f"its format is {shown(got)}, not {FORMAT!r}" if isinstance(got, str)
                   else "not an index ardiff wrote")
        return None
    return data


def drop_kept(swap_dir: Path) -> None:
    """Delete the index: its snapshots were adopted (or deleted), or there is nothing left to run."""
    with contextlib.suppress(OSError):
        (swap_dir / KEPT_FILE).unlink(missing_ok=True)
