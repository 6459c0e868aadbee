"""The unit of work the engine executes. No torch import."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ardiff_cli.runtime.capability import as_scalar
from ardiff_cli.runtime.errors import RequestError, RequestTypeError, did_you_mean, shown

DEFAULT_SESSION_ID = "default"  # used by requests whose extra_args name no session
RUNNER_KEYS = ("session_id", "reset", "close_session")  # the extra_args keys the runner reads
_FOLDED = {key.replace("_", ""): key for key in RUNNER_KEYS}  # sessionid -> session_id: sessionId, session-id
_FIELDS = ("request_id", "inputs", "extra_args")  # ARDiffusionRequest's fields, in order
_FIELD_NAMES = frozenset(_FIELDS)
_BUILD = ("ARDiffusionRequest('r0', inputs={...}, extra_args={'session_id': 'robot-a'}) "
          "(from ardiff_cli.runtime import ARDiffusionRequest)")
_NAMES_ITS_SESSION = ("a request names its session, and its reset and close_session flags, in extra_args: "
                      "ARDiffusionRequest('r0', inputs={...}, extra_args={'session_id': 'robot-a'})")


class ReadOnlyRequestField(RequestError, AttributeError):
    """``request.session_id = ...`` (or ``reset``, ``close_session``): those are read from ``extra_args``. An
    ``AttributeError`` too, as Python's own for a property without a setter."""


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
    - ``reset`` (bool): replace the session before the forward; False when absent (``None`` is refused).
    - ``close_session`` (bool): release the session after a successful forward; False when absent (``None`` is
      refused).

    A flag that is a numpy bool or a 0-d bool tensor or array is the bool it holds (``as_scalar``), as for a
    config's bool field; one that holds an int is refused, as ``1`` is.

    ``session_id``, ``reset`` and ``close_session`` are also read-only properties that read ``extra_args`` (setting
    one is a ``RequestError`` that is an ``AttributeError`` too); a keyword argument of that name
    (``ARDiffusionRequest('r0', obs, session_id='a')``), or any other that is not a field, is a
    ``RequestTypeError`` (a ``TypeError``) whose hint shows where it goes.

    The runner refuses a request whose ``request_id`` is not a string, whose ``inputs`` or ``extra_args`` is not a
    mapping, or whose ``session_id`` or flags have another type, with a ``RequestError`` before it touches the
    session (``check``).

    Everything in ``inputs`` (and any other ``extra_args`` key) belongs to the pipeline.
    """

    request_id: str  # caller's id, echoed in events and outputs
    inputs: dict[str, Any] = field(default_factory=dict)  # pipeline-specific inputs (observations, prompt, ...)
    extra_args: dict[str, Any] = field(default_factory=dict)  # session routing and lifecycle flags

    def __new__(cls, *args: Any, **kwargs: Any) -> ARDiffusionRequest:
        # Before the dataclass's __init__, whose TypeError for session_id=... said nothing of extra_args. Of this
        # class only: a pipeline's subclass (a dataclass with a field of its own) takes what its __init__ takes.
        if cls is ARDiffusionRequest and (len(args) > len(_FIELDS) or not kwargs.keys() <= _FIELD_NAMES):
            raise _misbuilt(args, kwargs)
        return object.__new__(cls)  # not super(): slots=True makes a new class, which zero-argument super() misses

    @property
    def session_id(self) -> str:
        self._check_mapping("extra_args", self.extra_args, "session routing and lifecycle flags")
        session_id = self.extra_args.get("session_id", DEFAULT_SESSION_ID)
        if not isinstance(session_id, str) or not session_id:
            raise RequestError(f"request {shown(self.request_id)}: extra_args['session_id'] must be a non-empty "
                               f"string, got {shown(session_id)}", hint="name the session with a string, one per robot")
        return session_id

    @session_id.setter
    def session_id(self, value: Any) -> None:
        _read_only("session_id", value)

    @property
    def reset(self) -> bool:
        return self._flag("reset")

    @reset.setter
    def reset(self, value: Any) -> None:
        _read_only("reset", value)

    @property
    def close_session(self) -> bool:
        return self._flag("close_session")

    @close_session.setter
    def close_session(self, value: Any) -> None:
        _read_only("close_session", value)

    def check(self) -> tuple[str, bool, bool]:
        """Raise ``RequestError`` if the runner cannot route this request as it is; else ``(session_id, reset,
        close_session)``, read once (the runner routes by them: each read of a property checks ``extra_args`` again)."""
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
        return self.session_id, self.reset, self.close_session  # each raises when malformed

    def misspelt_keys(self) -> list[tuple[str, str]]:
        """``(key, meant)`` for each ``extra_args`` key that looks like a runner key misspelt (``sesion_id``,
        ``sessionId``, ``close-session``): it goes to the pipeline as is, and a misspelt ``session_id`` sends the
        request to the default session, with every other robot whose key is misspelt."""
        return [(key, meant) for key in self.extra_args
                if isinstance(key, str) and len(key) <= 32 and key not in RUNNER_KEYS  # longer: no ratio of 0.8
                and (meant := _runner_key_meant(key)) is not None]

    def _check_mapping(self, name: str, value: Any, what: str) -> None:
        if not isinstance(value, Mapping):
            hint = "ARDiffusionRequest(request_id, inputs={...}, extra_args={'session_id': ...})"
            if name == "extra_args" and isinstance(value, str):  # ARDiffusionRequest('r0', obs, 'robot-a')
                hint = f"a session id goes in extra_args as its 'session_id': extra_args={{'session_id': {value!r}}}"
            raise RequestError(f"request {shown(self.request_id)}: {name} must be a mapping (dict) of {what}, "
                               f"got {shown(value)}", hint=hint)

    def _flag(self, key: str) -> bool:
        self._check_mapping("extra_args", self.extra_args, "session routing and lifecycle flags")
        value = self.extra_args.get(key, False)  # absent is False; None (a JSON null) is refused, as for session_id
        # np.True_ or a 0-d bool tensor or array (`mask[i]`) is the bool it holds, as a config's bool field takes it;
        # one that holds an int is refused as a plain int is
        flag = as_scalar(value)
        if isinstance(flag, bool):
            return flag
        if isinstance(value, str):
            hint = "a JSON client sends true or false, not a string"
        elif value is None:
            hint = "leave the key out for False: None (a JSON null) is refused, not taken for False"
        else:
            hint = "pass True or False"
        raise RequestError(f"request {shown(self.request_id)}: extra_args[{key!r}] must be True or False, got "
                           f"{shown(value)} ({type(value).__name__})", hint=hint)


# help() and editors show the fields (the dataclass's __init__ without self), not __new__'s (*args, **kwargs)
_INIT = inspect.signature(ARDiffusionRequest.__init__)
ARDiffusionRequest.__signature__ = _INIT.replace(parameters=list(_INIT.parameters.values())[1:])  # type: ignore


def _read_only(name: str, value: Any) -> None:
    raise ReadOnlyRequestField(f"ARDiffusionRequest.{name} is read from extra_args[{name!r}] and cannot be set",
                               hint=f"request.extra_args[{name!r}] = {shown(value)}; or build the request with it: "
                               + _NAMES_ITS_SESSION.partition(": ")[2])


def _misbuilt(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> RequestTypeError:
    """The error for ``ARDiffusionRequest(...)`` called with what its fields cannot take: a keyword that is not a
    field (``session_id=``, ``observation=``), or more positional arguments than fields."""
    unexpected = [key for key in kwargs if key not in _FIELDS]
    if not unexpected:
        return RequestTypeError(f"ARDiffusionRequest() takes at most {len(_FIELDS)} arguments "
                                f"({', '.join(_FIELDS)}), got {len(args)} positional",
                                hint=_NAMES_ITS_SESSION + "; everything else the pipeline takes goes in inputs")
    runner_keys = [key for key in unexpected if key in RUNNER_KEYS or _runner_key_meant(key) is not None]
    named = ("argument " if len(unexpected) == 1 else "arguments ") + ", ".join(repr(key) for key in unexpected)
    if runner_keys:
        meant = {key: key if key in RUNNER_KEYS else _runner_key_meant(key) for key in runner_keys}
        example = ", ".join(f"{meant[key]!r}: {shown(kwargs[key])}" for key in runner_keys)
        return RequestTypeError(
            f"ARDiffusionRequest() got an unexpected keyword {named}: a request's fields are "
            f"{', '.join(_FIELDS)}, and {' and '.join(repr(meant[k]) for k in runner_keys)} "
            f"{'go' if len(runner_keys) > 1 else 'goes'} in extra_args",
            hint=f"ARDiffusionRequest(request_id, inputs={{...}}, extra_args={{{example}}})")
    return RequestTypeError(
        f"ARDiffusionRequest() got an unexpected keyword {named}"
        + (did_you_mean(unexpected[0], _FIELDS) if len(unexpected) == 1 else "")
        + f": a request's fields are {', '.join(_FIELDS)}",
        hint="what the pipeline takes (the observation, the prompt) goes in inputs; " + _NAMES_ITS_SESSION)


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
