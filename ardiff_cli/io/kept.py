"""The swap snapshots a stopped rollout leaves for ``--resume``: ``OUT/.swap/kept.json``.

A run that stops (a signal, a failure) with sessions swapped out keeps their snapshot files and writes this index:
episode -> the file and how many of the episode's steps its session had consumed. Stopped by a signal, it swaps its
resident sessions out first (``_swap_out_resident`` in ``commands/rollout.py``), so they are kept too. ``--resume``
reads it, adopts each snapshot of at most the episode's done steps (fewer: a run stopped while it rebuilt the session
keeps the steps replayed so far), and restores those sessions instead of replaying those steps (once their step files
are found unchanged, as a replay would check them: else the episode fails and its snapshot goes); the others are
replayed as before. The index is deleted once its snapshots are
adopted: a resume that stops before (a signal or ``kill -9`` while the model loads, a refused ``--device``) leaves
it, and its files, to the next. Without the index (a ``kill -9`` of the run), every leftover file is removed and
every session replayed.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

KEPT_FILE = "kept.json"
FORMAT = "ardiff-kept-1"


def write_kept(swap_dir: Path, kept: dict[str, tuple[str, int]], *, run: float) -> None:
    """Write the index of ``kept``: {episode: (file name, steps its session had consumed)}, as :func:`read_kept`
    gives it back to the run that started at ``run`` (run.json's ``started``)."""
    from ardiff_cli.io.atomic import atomic_write_json

    sessions = {name: {"file": file, "steps": steps} for name, (file, steps) in kept.items()}
    atomic_write_json(swap_dir / KEPT_FILE, {"format": FORMAT, "run": run, "sessions": sessions})


def read_kept(swap_dir: Path, *, run: float) -> dict[str, tuple[str, int]]:
    """The index as {episode: (file name, steps)}, left in place (:func:`drop_kept` deletes it). {} when there is
    none, it is not one this version wrote whole, or another run wrote it (its sessions are then replayed): two runs
    whose ``.swap`` folders are links to one folder each wrote kept.json there, and a resume restored the other run's
    snapshot of an episode of the same name and steps, silently. ``run`` is the run's start (run.json's
    ``started``), which a copy of the run folder keeps with its snapshots. The temporary file of a write of it that
    a ``kill -9`` cut short goes with the run folder's others (``RunFolder.remove_stale_temporaries``)."""
    from ardiff_cli.runtime.swap import SNAPSHOT_FILE

    data = _read_index(swap_dir)
    sessions = data.get("sessions") if data is not None and data.get("run") == run else None
    if not isinstance(sessions, dict):
        return {}
    kept = {}
    for name, entry in sessions.items():
        file, steps = (entry.get("file"), entry.get("steps")) if isinstance(entry, dict) else (None, None)
        if isinstance(file, str) and SNAPSHOT_FILE.fullmatch(file) and type(steps) is int and steps > 0:
            kept[name] = (file, steps)
    return kept


def kept_for(swap_dir: Path) -> float | None:
    """The start (run.json's ``started``) of the run the index in ``swap_dir`` keeps snapshots for; None when there is
    no index this version wrote whole."""
    run = (_read_index(swap_dir) or {}).get("run")
    return run if isinstance(run, (int, float)) and not isinstance(run, bool) else None


def _read_index(swap_dir: Path) -> dict | None:
    """The index as written, when it is one of this version's; else None."""
    from ardiff_cli.io.atomic import open_file, parse_json

    try:  # bytes: a file that is not UTF-8 is a ValueError too, not a crash of every resume
        with open_file(swap_dir / KEPT_FILE) as f:
            data = parse_json(f.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def drop_kept(swap_dir: Path) -> None:
    """Delete the index: its snapshots were adopted (or deleted), or there is nothing left to run."""
    with contextlib.suppress(OSError):
        (swap_dir / KEPT_FILE).unlink(missing_ok=True)
