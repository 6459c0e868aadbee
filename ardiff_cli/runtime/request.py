"""The unit of work the engine executes. No torch import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_SESSION_ID = "default"  # used by requests whose extra_args name no session


@dataclass(slots=True)
class ARDiffusionRequest:
    """One request for one session.

    ``extra_args`` keys read by the runner:

    - ``session_id`` (str): the persistent session; ``DEFAULT_SESSION_ID`` when absent.
    - ``reset`` (bool): replace the session before the forward.
    - ``close_session`` (bool): release the session after a successful forward.

    Everything in ``inputs`` (and any other ``extra_args`` key) belongs to the pipeline.
    """

    request_id: str  # caller's id, echoed in events and outputs
    inputs: dict[str, Any] = field(default_factory=dict)  # pipeline-specific inputs (observations, prompt, ...)
    extra_args: dict[str, Any] = field(default_factory=dict)  # session routing and lifecycle flags

    @property
    def session_id(self) -> str:
        session_id = self.extra_args.get("session_id", DEFAULT_SESSION_ID)
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"extra_args['session_id'] must be a non-empty string, got {session_id!r}")
        return session_id
