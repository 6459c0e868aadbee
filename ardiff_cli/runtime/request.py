"""The unit of work the engine executes. No torch import."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ardiff_cli.runtime.errors import RequestError, shown

DEFAULT_SESSION_ID = "default"  # used by requests whose extra_args name no session
RUNNER_KEYS = ("session_id", "reset", "close_session")  # the extra_args keys the runner reads
_FOLDED = {key.replace("_", ""): key for key in RUNNER_KEYS}  # sessionid -> session_id: sessionId, session-id


@functools.lru_cache(maxsize=1024)  # every request of a client sends the same keys: a ratio each took ~40 us
def _runner_key_meant(key: str) -> str | None:
    """The runner key that ``key`` (not one) looks like a misspelling of, or None."""
    folded = key.lower().replace("-", "").replace("_", "")
    return _FOLDED.get(folded) or next(iter(difflib.get_close_matches(key, RUNNER_KEYS, n=1, cutoff=0.8)), None)


@dataclass(slots=True)
class ARDiffusionRequest:
    """One request for one session.

    ``extra_args`` keys read by the runner:

    - ``session_id`` (str): the persistent session; ``DEFAULT_SESSION_ID`` when absent.
    - ``reset`` (bool): replace the session before the forward.
    - ``close_session`` (bool): release the session after a successful forward.

    The runner refuses a request whose ``inputs`` or ``extra_args`` is not a mapping, or whose ``session_id`` or
    flags have another type, with a ``RequestError`` before it touches the session (``check``).

    Everything in ``inputs`` (and any other ``extra_args`` key) belongs to the pipeline.
    """

    request_id: str  # caller's id, echoed in events and outputs
    inputs: dict[str, Any] = field(default_factory=dict)  # pipeline-specific inputs (observations, prompt, ...)
    extra_args: dict[str, Any] = field(default_factory=dict)  # session routing and lifecycle flags

    @property
    def session_id(self) -> str:
        self._check_mapping("extra_args", self.extra_args, "session routing and lifecycle flags")
        session_id = self.extra_args.get("session_id", DEFAULT_SESSION_ID)
        if not isinstance(session_id, str) or not session_id:
            raise RequestError(f"request {shown(self.request_id)}: extra_args['session_id'] must be a non-empty "
                               f"string, got {shown(session_id)}", hint="name the session with a string, one per robot")
        return session_id

    @property
    def reset(self) -> bool:
        return self._flag("reset")

    @property
    def close_session(self) -> bool:
        return self._flag("close_session")

    def check(self) -> None:
        """Raise ``RequestError`` if the runner cannot route this request as it is."""
        self._check_mapping("inputs", self.inputs, "the pipeline's inputs")
        _ = (self.session_id, self.reset, self.close_session)  # each raises when malformed

    def misspelt_keys(self) -> list[tuple[str, str]]:
        """``(key, meant)`` for each ``extra_args`` key that looks like a runner key misspelt (``sesion_id``,
        ``sessionId``, ``close-session``): it goes to the pipeline as is, and a misspelt ``session_id`` sends the
        request to the default session, with every other robot whose key is misspelt."""
        return [(key, meant) for key in self.extra_args
                if isinstance(key, str) and len(key) <= 32 and key not in RUNNER_KEYS  # longer: no ratio of 0.8
                and (meant := _runner_key_meant(key)) is not None]

    def _check_mapping(self, name: str, value: Any, what: str) -> None:
        if not isinstance(value, Mapping):
            raise RequestError(f"request {shown(self.request_id)}: {name} must be a mapping (dict) of {what}, "
                               f"got {shown(value)}", hint=f"ARDiffusionRequest(request_id, inputs={{...}}, "
                               "extra_args={'session_id': ...})")

    def _flag(self, key: str) -> bool:
        self._check_mapping("extra_args", self.extra_args, "session routing and lifecycle flags")
        value = self.extra_args.get(key)
        if value is None or isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy's bool too
            return bool(value)
        raise RequestError(f"request {shown(self.request_id)}: extra_args[{key!r}] must be True or False, got "
                           f"{shown(value)} ({type(value).__name__})",
                           hint="a JSON client sends true or false, not a string")
