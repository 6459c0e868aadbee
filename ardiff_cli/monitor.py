"""The CLI side of runtime events: keeps the live snapshot and echoes events in plain and json formats.

``RunMonitor.on_event`` is subscribed to the engine (``engine.subscribe``);
the command calls ``refresh(runner)`` after each request so the snapshot holds
the runner's session and pool views. ``snapshot()`` may be called from Rich's
refresh thread at any time.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from ardiff_cli.errors_cli import Interrupted
from ardiff_cli.output import Output
from ardiff_cli.panels import EventRow, SessionRow, Snapshot
from ardiff_cli.runtime.capacity import format_bytes
from ardiff_cli.runtime.errors import plural

# runtime event kind -> short name shown in the event log and in plain lines
SHORT_KINDS = {
    "session_admitted": "admitted",
    "session_evicted": "evicted",
    "session_restored": "restored",
    "session_reset": "reset",
    "session_closed": "closed",
    "hook_failed": "hook_failed",
    "swap_failed": "swap_failed",
    "snapshot_dropped": "dropped",
    "warmup_finished": "warmup",
    "capacity_planned": "planned",
    "request_finished": "request",
}

# Events after which the resident sessions have changed: the views are read again at once, or the sessions panel
# showed an evicted session as resident, beside the event saying it was evicted, for the whole of the next step
# (seconds with a large model), and a stopped run's last frame kept the sessions it had swapped out. Not a finished
# request: a step's row is read once its outputs are written and counted, so its steps and pages agree.
VIEW_KINDS = frozenset({"session_admitted", "session_evicted", "session_restored", "session_reset", "session_closed"})


def describe_event(data: dict[str, Any]) -> str:
    """One line of detail for an event dict (runtime ``to_dict()`` or a CLI event)."""
    kind = data.get("kind")
    if kind == "session_evicted":
        by = data.get("by_session_id")
        swapped = f", swapped out ({format_bytes(data['swap_bytes'])})" if data.get("swapped") else ""
        return f"{data.get('reason', '')}" + (f" (by {by})" if by else "") + swapped
    if kind == "session_restored":
        seconds = data.get("seconds", 0)
        return f"from its swap snapshot ({format_bytes(data.get('swap_bytes', 0))}) in {seconds * 1000:.1f} ms"
    if kind in ("session_reset", "session_closed"):
        error = data.get("error")  # one line: the message of an episode_failed line may have more
        return str(data.get("reason", "")) + (f": {error.splitlines()[0]}" if error else "")
    if kind == "hook_failed":
        return f"{data.get('hook')}: {data.get('error')}"
    if kind == "swap_failed":
        return f"{'snapshot lost' if data.get('background', True) else 'not written'}: {data.get('error')}"
    if kind == "snapshot_dropped":
        return (f"swap snapshot ({format_bytes(data.get('swap_bytes', 0))}) deleted to make room for "
                f"{data.get('by_session_id')}'s")
    if kind == "warmup_finished":
        restored = "pool restored" if data.get("restored") else "POOL NOT RESTORED"
        return f"{plural(data.get('num_requests'), 'request')} in {data.get('seconds', 0):.3f}s, {restored}"
    if kind == "capacity_planned":
        plan = data.get("plan", {})
        attention = f", attention {data['attention_backend']}" if data.get("attention_backend") else ""
        return (f"{plural(plan.get('session_capacity'), 'session')}, "
                f"{plural(plan.get('num_managed_pages'), 'page')} of "
                f"{format_bytes(plan.get('bytes_per_page', 0))}, budget {format_bytes(plan.get('budget_bytes', 0))}"
                + attention)
    if kind == "request_finished":
        return f"{data.get('request_id')} {data.get('total_s', 0) * 1000:.1f} ms"
    return str(data.get("detail", ""))


class RunMonitor:
    """Collects what the live panels show; echoes events to the output sink."""

    def __init__(self, out: Output, title: str, *, echo_requests: bool = False, noun: str = "step",
                 counted_phases: tuple[str, ...] = ("running", "following")) -> None:
        self.out = out  # where plain/json event lines go
        self.echo_requests = echo_requests  # also echo request_finished in plain format (warmup)
        self.counted_phases = counted_phases  # the phases whose work set_progress counts: the rate is of their time
        self._counted_since: float | None = None  # monotonic time the counted phases began (None: not yet)
        self._counted_until: float | None = None  # and ended (None: not yet)
        self._lock = threading.Lock()  # the refresh thread reads while the main thread writes
        self._t0 = time.time()  # wall clock of the run's start (event times are relative to it)
        self._start = time.monotonic()
        self._events: deque[EventRow] = deque(maxlen=8)  # the newest events, for the events panel
        self._episodes: dict[str, tuple[int, int | None]] = {}  # session (its episode's name) -> (done, total)
        self._views: tuple[Any, ...] = ()  # the runner's session views at the last refresh, least recently used first
        self._runner: Any = None  # the runner of the last refresh: its views are read again after VIEW_KINDS events
        self._snapshot = Snapshot(title=title, noun=noun)
        self._kept: tuple[int, int] | None = None  # (snapshots, bytes) a stopped run keeps for --resume

    # -- inputs --------------------------------------------------------------------------------------------

    def on_event(self, event: Any) -> None:
        """Engine subscriber: every runtime event, in order."""
        data = event.to_dict()
        kind = data["kind"]
        with self._lock:
            if kind == "capacity_planned":
                plan = event.plan
                self._snapshot = replace(
                    self._snapshot, device=event.device, dtype=plan.dtype, budget_bytes=plan.budget_bytes,
                    available_bytes=plan.available_bytes, page_size=plan.page_size, bytes_per_page=plan.bytes_per_page,
                    pages_total=plan.num_managed_pages, session_capacity=plan.session_capacity,
                    attention=event.attention_backend)
            elif kind == "session_evicted" and event.reason == "lru_eviction":  # not a stopped run's swap-outs
                self._snapshot = replace(self._snapshot, evictions=self._snapshot.evictions + 1)
            elif kind == "session_restored":
                self._snapshot = replace(self._snapshot, restores=self._snapshot.restores + 1)
            if kind not in ("request_finished", "capacity_planned"):
                self._events.append(EventRow(at_s=data["time"] - self._t0, kind=SHORT_KINDS.get(kind, kind),
                                             session_id=str(data.get("session_id", "")), detail=describe_event(data)))
        if kind in VIEW_KINDS and self._runner is not None:  # delivered outside the runner's lock: safe to read
            self.refresh(self._runner)
        if kind == "request_finished" and not self.echo_requests:
            if self.out.is_json:
                self.out.json(data)
            return
        self.emit(data)

    def emit(self, data: dict[str, Any]) -> None:
        """Echo one event: a JSON line (json) or a text line on stderr (plain)."""
        at = data.get("time", time.time()) - self._t0
        kind = SHORT_KINDS.get(data["kind"], data["kind"])
        session = data.get("session_id") or ""
        self.out.event(data, f"+{at:8.3f}s {kind:<11} {session} {describe_event(data)}".rstrip())

    def log(self, kind: str, session_id: str, detail: str, *, echo: bool = True, **data: Any) -> None:
        """A CLI event (episode ended, replay, ...): into the event log, and echoed unless ``echo`` is False."""
        now = time.time()
        with self._lock:
            self._events.append(EventRow(at_s=now - self._t0, kind=kind, session_id=session_id, detail=detail))
        if echo:
            self.emit({"kind": kind, "session_id": session_id, "detail": detail, "time": now, **data})

    def set_phase(self, phase: str) -> None:
        with self._lock:
            if phase in self.counted_phases and self._counted_since is None:
                self._counted_since = time.monotonic()
            elif phase not in (*self.counted_phases, "stopping") and self._counted_since is not None and (
                    self._counted_until is None):
                # done, interrupted or failed: the rate stays that of the work. Not at "stopping": the step in
                # flight still runs and is counted, and the last frame's rate was above the summary's.
                self._counted_until = time.monotonic()
            self._snapshot = replace(self._snapshot, phase=phase)

    def end_counting(self) -> None:
        """The counted work is over, however it ended: the rate stays that of its time, as the summary's, not of
        the teardown after it (a stopped run swaps its sessions out, then sets its phase to "interrupted")."""
        with self._lock:
            if self._counted_since is not None and self._counted_until is None:
                self._counted_until = time.monotonic()

    @contextlib.contextmanager
    def ending(self) -> Iterator[None]:
        """Inside the live display: a block left by an exception sets the phase to "interrupted" (a signal) or
        "failed", so that the display's last frame, which stays on the screen, says so (it said "running", with an
        ETA, above the summary of a run stopped by Ctrl-C)."""
        try:
            yield
        except (Interrupted, KeyboardInterrupt):
            self.set_phase("interrupted")
            raise
        except BaseException:
            self.set_phase("failed")
            raise

    def set_episode(self, session_id: str, done: int, total: int | None) -> None:
        with self._lock:
            self._episodes[session_id] = (done, total)

    def set_progress(self, *, done: int | None = None, total: int | None | str = "keep", failed: int | None = None,
                     replayed: int | None = None) -> None:
        with self._lock:
            s = self._snapshot
            self._snapshot = replace(
                s,
                steps_done=s.steps_done if done is None else done,
                steps_total=s.steps_total if total == "keep" else total,
                steps_failed=s.steps_failed if failed is None else failed,
                steps_replayed=s.steps_replayed if replayed is None else replayed,
            )

    def refresh(self, runner: Any) -> None:
        """Read the runner's session and pool views (call from the thread that runs requests). Their rows are built
        by :meth:`snapshot`, for the live display only, not after every step for every resident session."""
        views = tuple(runner.sessions())
        usage = runner.pool_usage()
        with self._lock:
            self._runner = runner
            self._views = views
            swapped, swapped_bytes = (usage.num_swapped, usage.swapped_bytes) if self._kept is None else self._kept
            self._snapshot = replace(self._snapshot, pages_used=usage.num_used, pages_total=usage.num_pages,
                                     swapped=swapped, swapped_bytes=swapped_bytes,
                                     swap_budget_bytes=usage.swap_budget_bytes)

    def keep_snapshots(self, count: int, nbytes: int) -> None:
        """A stopped run keeps ``count`` snapshots (``nbytes``) for --resume: the swap line shows them from here on,
        though the runner's store has let go of them (and the sessions it then closes refresh the views)."""
        with self._lock:
            self._kept = (count, nbytes)
            self._snapshot = replace(self._snapshot, swapped=count, swapped_bytes=nbytes, swap_kept=True)

    # -- output --------------------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def snapshot(self) -> Snapshot:
        with self._lock:
            rows = []
            for view in self._views:
                done, total = self._episodes.get(view.session_id, (view.num_requests, None))
                rows.append(SessionRow(session_id=view.session_id, steps_done=done, steps_total=total,
                                       pages_per_branch=dict(view.pages_per_branch),
                                       cross_attention_bytes=view.cross_attention_bytes,
                                       last_latency_s=view.last_latency_s))
            since, until = self._counted_since, self._counted_until
            counting = 0.0 if since is None else (time.monotonic() if until is None else until) - since
            return replace(self._snapshot, sessions=tuple(rows), events=tuple(self._events), elapsed_s=self.elapsed(),
                           counting_s=counting)
