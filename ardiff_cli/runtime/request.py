"""The unit of work the engine executes. No torch import."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ardiff_cli.runtime.errors import RequestError, RequestTypeError, shown

DEFAULT_SESSION_ID = "default"  # used by requests whose extra_args name no session
RUNNER_KEYS = ("session_id", "reset", "close_session")  # the extra_args keys the runner reads
_FOLDED = {key.replace("_", ""): key for key in RUNNER_KEYS}  # sessionid -> session_id: sessionId, session-id
_FIELDS = ("request_id", "inputs", "extra_args")  # ARDiffusionRequest's fields, in order
_BUILD = ("ARDiffusionRequest('r0', inputs={...}, extra_args={'session_id': 'robot-a'}) "
          "(from ardiff_cli.runtime import ARDiffusionRequest)")


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

    The runner refuses a request whose ``request_id`` is not a string, whose ``inputs`` or ``extra_args`` is not a
    mapping, or whose ``session_id`` or flags have another type, with a ``RequestError`` before it touches the
    session (``check``).

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
        if not isinstance(self.request_id, str):
            # ARDiffusionRequest(inputs, extra_args) took the inputs for the id, extra_args for the inputs: the
            # forward refused them as an observation with an unknown 'session_id', and released session 'default'.
            left_out = isinstance(self.request_id, Mapping)
            got = "a mapping: was the request id left out?" if left_out else \
                f"{shown(self.request_id)} ({type(self.request_id).__name__})"
            raise RequestError(
                f"request_id must be a string, got {got}",
                hint="the request id comes first: ARDiffusionRequest(request_id, inputs, extra_args)"
                + ("" if left_out else "; str() a numbered id"))
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


def require_request(value: Any, where: str) -> ARDiffusionRequest:
    """``value`` if it is an ``ARDiffusionRequest``, else a ``RequestTypeError`` for ``where`` (the method called)
    whose hint says how to build one from what was passed."""
    if isinstance(value, ARDiffusionRequest):
        return value
    kind = type(value)
    got = f"{shown(value)} ({kind.__name__})"
    hint = f"build one: {_BUILD}"
    if isinstance(value, Mapping):
        keys = list(value)
        got = f"a {kind.__name__} with keys {shown(keys)}"
        if "request_id" in keys and set(keys) <= set(_FIELDS):
            hint = "its keys are a request's fields: pass ARDiffusionRequest(**that_dict)"
        else:
            hint = ("a dict is the pipeline's inputs (the observation): wrap it in a request, "
                    + _BUILD.replace("inputs={...}", "inputs=that_dict"))
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, ARDiffusionRequest) for v in value):
        got = f"a {kind.__name__} of {len(value)} ARDiffusionRequest"
        hint = "requests run one at a time (request mode, no batches): make one call per request"
    elif kind.__name__ == "ARDiffusionRequest":
        got = f"an ARDiffusionRequest of another module ({kind.__module__}, not {__name__}: a reloaded module?)"
        hint = "import ARDiffusionRequest from ardiff_cli.runtime, as the engine does"
    raise RequestTypeError(f"{where} takes an ARDiffusionRequest, got {got}", hint=hint)
