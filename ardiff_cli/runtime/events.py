"""Runtime events: plain frozen dataclasses delivered to subscribers in order.

The runtime never imports Rich; the CLI subscribes and keeps its own snapshot.
Every event has ``kind`` (a stable string for JSON consumers) and ``time``
(``time.time()`` at emission).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar


def _now() -> float:
    return time.time()


# Why a session was released: the reason its session_evicted, session_reset or session_closed event gives, one of a
# closed set (scripts match them). The runner's own, for what it did by itself, and what each says happened:
RUNNER_REASONS = {
    "lru_eviction": "an LRU eviction",
    "request_reset": "a request's reset=True",
    "close_session": "a request's close_session=True",
    "forward_exception": "a forward that raised",
    "restore_failed": "a restore that failed",
    "warmup_ended": "the warmup's own session",
}
# A caller's, by the runner call that takes them, its default first. A caller may not give the runner's own: it
# would say the runner did what it did not (close_session(reason="lru_eviction") sent a session_evicted event).
CALLER_REASONS = {
    "close_session": ("explicit", "episode_ended", "episode_failed"),  # rollout's: an episode's end or failure
    "close": ("explicit", "run_stopped", "run_failed"),  # rollout's: the sessions a stopped or failed run does not keep
    "close_all": ("explicit", "run_stopped", "run_failed"),
    "swap_out_sessions": ("explicit", "run_stopped"),  # rollout's: those a stopped run keeps for --resume
}


@dataclass(frozen=True)
class RuntimeEvent:
    kind: ClassVar[str] = "event"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind
        return data


@dataclass(frozen=True)
class CapacityPlanned(RuntimeEvent):
    kind: ClassVar[str] = "capacity_planned"
    plan: Any  # CapacityPlan
    device: str
    time: float = field(default_factory=_now)
    attention_backend: str = "torch"  # the backend that runs: "torch" or "vllm"
    attention_detail: str = ""  # why it was chosen, and the kernel's block geometry

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "plan": self.plan.to_dict(),
            "device": self.device,
            "time": self.time,
            "attention_backend": self.attention_backend,
            "attention_detail": self.attention_detail,
        }


@dataclass(frozen=True)
class SessionAdmitted(RuntimeEvent):
    kind: ClassVar[str] = "session_admitted"
    session_id: str
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class SessionEvicted(RuntimeEvent):
    kind: ClassVar[str] = "session_evicted"
    session_id: str
    # "lru_eviction", or swap_out_sessions' reason: "explicit" (its default) or "run_stopped" (the CLI's)
    reason: str = "lru_eviction"
    by_session_id: str | None = None  # the session whose admission caused the eviction
    time: float = field(default_factory=_now)
    swapped: bool = False  # its snapshot went to the swap store: its next request brings it back without replay
    swap_bytes: int = 0  # bytes of that snapshot file


@dataclass(frozen=True)
class SessionRestored(RuntimeEvent):
    """A swapped-out session was admitted again from its snapshot (``runner.restore_session`` or its next request)."""

    kind: ClassVar[str] = "session_restored"
    session_id: str
    swap_bytes: int  # bytes of the snapshot file read
    seconds: float  # reading the file and restoring the KV and the pipeline's state
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class SwapFailed(RuntimeEvent):
    """A session's snapshot could not be written. ``background``: its write failed in the background (a full disk),
    after its ``session_evicted`` said ``swapped``: the snapshot is lost, and the session is rebuilt as one evicted
    without a snapshot. Not ``background``: it failed as it started (a swap folder that cannot be written, a
    pipeline state that cannot be saved, an evicted session's snapshot larger than the whole swap space), and the
    ``session_evicted`` that follows says not ``swapped`` (or, for ``swap_out_sessions``, the session stays
    resident)."""

    kind: ClassVar[str] = "swap_failed"
    session_id: str
    error: str
    background: bool = True
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class SnapshotDropped(RuntimeEvent):
    """A swapped-out session's snapshot was deleted to make room in the swap space for a newer one (the least
    recently swapped go first): the session is one evicted without a snapshot from now on (``restore_session``
    returns False, and its next request starts it afresh; the CLI replays its episode's steps)."""

    kind: ClassVar[str] = "snapshot_dropped"
    session_id: str
    swap_bytes: int  # bytes of the file deleted
    by_session_id: str  # the session whose snapshot needed the room
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class SessionReset(RuntimeEvent):
    kind: ClassVar[str] = "session_reset"
    session_id: str
    reason: str  # "request_reset" or "explicit"
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class SessionClosed(RuntimeEvent):
    kind: ClassVar[str] = "session_closed"
    session_id: str
    # a caller's: "explicit" (the default), or close_session's "episode_ended" / "episode_failed", or close() and
    # close_all()'s "run_stopped" / "run_failed" (CALLER_REASONS); or the runner's own: "close_session",
    # "forward_exception", "restore_failed" or "warmup_ended" (the warmup's own session, released by the warmup)
    reason: str
    # the forward's exception (its repr), for forward_exception; the caller's error given to close_session (rollout's
    # episode_failed: the failed line's "error"); else None
    error: str | None = None
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class RequestFinished(RuntimeEvent):
    kind: ClassVar[str] = "request_finished"
    request_id: str
    session_id: str
    bind_s: float  # admission + state binding
    forward_s: float  # the pipeline's forward
    commit_s: float  # unbinding, lifecycle flags, bookkeeping after the forward
    total_s: float
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class HookFailed(RuntimeEvent):
    """A pipeline reset/close hook raised; the KV was released regardless."""

    kind: ClassVar[str] = "hook_failed"
    session_id: str
    hook: str
    error: str
    time: float = field(default_factory=_now)


@dataclass(frozen=True)
class WarmupFinished(RuntimeEvent):
    kind: ClassVar[str] = "warmup_finished"
    num_requests: int
    seconds: float
    restored: bool  # free-page count back where it started
    time: float = field(default_factory=_now)
