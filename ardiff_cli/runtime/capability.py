"""The typed pipeline contract of the model-neutral AR-Diffusion runtime.

A pipeline opts in by implementing :class:`SupportsARDiffusionPipeline` and
describing its KV geometry and session policy with an immutable
:class:`ARDiffusionKVCacheSpec`. The runner owns every pool and every session;
the pipeline owns its model weights and its own non-KV per-session state.

This module imports neither torch nor any model code, so the capacity planner
and ``ardiff inspect-capacity`` can use it without paying for them.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ardiff_cli.runtime.kv.state import ARDiffusionKVState


def is_number(value: object, kind: type = numbers.Real) -> bool:
    """Whether ``value`` is a number of ``kind`` (numpy's too), not a bool nor a numpy time: ``np.timedelta64`` is a
    numpy integer, and ``np.timedelta64(3, "ns")`` was taken as 3."""
    return (isinstance(value, kind) and not isinstance(value, bool)
            and getattr(getattr(value, "dtype", None), "kind", None) not in ("m", "M"))


def as_int(value: object) -> int | None:
    """``value`` as a Python int when it is an integer of any kind (int, numpy's int64, ...) but not a bool (nor a
    numpy time); else None. Here, in the lowest module of the runtime, so that the spec, the layout and the planner
    read integers alike."""
    if type(value) is int:  # the common case, without the ABC check (every forward's seq_len comes here)
        return value
    if is_number(value, numbers.Integral):
        return int(value)  # type: ignore[call-overload]
    return None


# A number as a user types it (a number option's value, a byte size's number: ``parse_bytes``), as a shell script
# writes a plain number: a sign, ASCII digits with a point, an exponent; or nan and inf, which each option refuses by
# its range. Python's int() and float() read more, which this refuses:
# '1_000', spaces and a line break around it (' 4 ', a line read with its newline), other scripts' digits ('\uff14',
# a wide 4). Hex ('0x10') neither reads. ASCII: a case-blind match takes '\u0131' and '\u0130' for i too ('\u0131nf').
PLAIN_NUMBER = re.compile(r"(?P<mantissa>[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))(?:[eE](?P<exponent>[+-]?[0-9]+))?"
                          r"|[+-]?(?:nan|inf|infinity)", re.IGNORECASE | re.ASCII)
# An exponent of more digits than this is read as this, as far out of every option's range and of what a float holds:
# Decimal reads none past 10**18 ('1e9999999999999999999' was a traceback). An argument holds at most 131072
# characters (Linux's MAX_ARG_STRLEN), too few digits to bring such a number back into a range.
MAX_EXPONENT = 10**9


def read_number(text: str) -> Decimal | None:
    """A typed number exactly as written (``PLAIN_NUMBER``), else None: compared as a float rounds it,
    '2.0000000000000001' was 2 sessions, '1.00000000000000001' a fraction of 1, '1e-400' 0 and '1e400' sessions inf,
    no whole number; '0.99999999999999999999KiB' was 1024 bytes."""
    match = PLAIN_NUMBER.fullmatch(text)
    if match is None:
        return None
    exponent = match["exponent"]
    if exponent is not None and len(exponent.lstrip("+-").lstrip("0")) > len(str(MAX_EXPONENT)):
        return Decimal(f"{match['mantissa']}e{exponent[0] if exponent[0] in '+-' else ''}{MAX_EXPONENT}")
    return Decimal(text)


def array_ndim(value: object) -> int | None:
    """The ``ndim`` of a numpy array or scalar (0) or a torch tensor, without importing torch; None for any other
    value."""
    if type(value).__module__.partition(".")[0] not in ("numpy", "torch"):
        return None
    return getattr(value, "ndim", None)


def as_scalar(value: object) -> object:
    """The Python number (or bool) a numpy scalar or a 0-d numpy array or torch tensor holds (``.item()``:
    ``torch.tensor(7.5)`` is 7.5, ``np.True_`` True, whatever its device or ``requires_grad``); any other value,
    a 1-d tensor or one that holds no value (on the meta device) included, as it is, and so is a numpy time (the
    ``.item()`` of ``np.datetime64(3, "ns")`` is the int 3). Without importing torch."""
    if array_ndim(value) != 0:
        return value
    if getattr(value.dtype, "kind", None) in ("m", "M"):  # type: ignore[attr-defined]  # numpy's; torch's has none
        return value
    try:
        return value.item()  # type: ignore[attr-defined]
    except (RuntimeError, ValueError):  # a meta tensor: "Tensor.item() cannot be called on meta tensors"
        return value


def _require_int(field: str, value: Any, *, minimum: int) -> int:
    """``value`` as a plain int (a numpy integer too: the contract only compares these fields, so a geometry
    computed with numpy is valid); ``ValueError`` naming ``field`` unless it is an integer >= ``minimum``."""
    number = as_int(value)  # None for a bool: `True` as a layer count is always a bug
    if number is None:
        raise ValueError(f"AR-Diffusion {field} must be an integer, got {value!r}")
    if number < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"AR-Diffusion {field} must be {kind}, got {number}")
    return number


def _require_name(field: str, value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a non-empty str without "/" (``field`` is plural: the contract's
    wording). A session's swap snapshot names its tensors ``self/BRANCH/k`` and ``cross/BRANCH/CACHE``."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"AR-Diffusion {field} must be non-empty strings, got {value!r}")
    if "/" in value:
        raise ValueError(f"AR-Diffusion {field} must not contain '/' (it separates the names of a session's tensors "
                         f"in its swap snapshot), got {value!r}")


@dataclass(frozen=True)
class ARDiffusionKVBranchSpec:
    """One logical KV branch (for example a CFG branch) and its worker-local slot.

    Distinct branches may share ``local_index`` only when the deployment
    guarantees that at most one of them runs on a worker (CFG parallelism).
    The index maps self-attention and scratch storage; it never makes two
    branches share a cross-attention cache.
    """

    name: str  # logical branch name used by the model ("positive", "main", ...; no "/")
    local_index: int  # worker-local storage slot, contiguous from zero

    def __post_init__(self) -> None:
        _require_name("KV branch names", self.name)
        object.__setattr__(self, "local_index", _require_int("KV branch local_index", self.local_index, minimum=0))


@dataclass(frozen=True)
class ARDiffusionCrossAttentionKVSpec:
    """A fixed-length, per-layer, named cross-attention KV cache.

    ``num_kv_heads`` and ``head_size`` default (``None``) to the
    self-attention geometry of the enclosing spec; text and image encoders
    often project to a different geometry, so they may be given explicitly.
    """

    name: str  # cache name ("text", "image", ...; no "/")
    num_tokens: int  # fixed number of key/value tokens per layer
    num_kv_heads: int | None = None  # None: the spec's num_kv_heads
    head_size: int | None = None  # None: the spec's head_size

    def __post_init__(self) -> None:
        _require_name("cross-attention cache names", self.name)
        object.__setattr__(self, "num_tokens", _require_int("cross-attention num_tokens", self.num_tokens, minimum=1))
        for field in ("num_kv_heads", "head_size"):
            if getattr(self, field) is not None:
                number = _require_int(f"cross-attention {self.name!r} {field}", getattr(self, field), minimum=1)
                object.__setattr__(self, field, number)


@dataclass(frozen=True)
class ARDiffusionKVCacheSpec:
    """KV geometry and session policy supplied by an AR-Diffusion pipeline.

    Frames are the unit of retention: ``sink_frames`` frames are kept from the
    start of a session, then the newest ``window_frames`` frames. One model
    block commits at most ``frames_per_block`` frames at once. A frame holds
    ``tokens_per_frame`` tokens.

    ``max_scratch_tokens_per_branch`` is the most non-video KV (action or state
    registers) that coexists with an uncommitted block.
    ``model_owned_state_bytes_per_session`` is a conservative bound on the
    per-session state the pipeline keeps outside the runner's pools.
    ``session_capacity`` is the pipeline's upper bound on resident sessions;
    the runner may keep fewer when memory is short.
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    tokens_per_frame: int
    frames_per_block: int
    window_frames: int
    kv_branches: tuple[ARDiffusionKVBranchSpec, ...]
    session_capacity: int
    sink_frames: int = 0
    reset_at_boundary: bool = False
    cross_attention: tuple[ARDiffusionCrossAttentionKVSpec, ...] = ()
    max_model_len: int = 1 << 20
    max_scratch_tokens_per_branch: int = 0
    model_owned_state_bytes_per_session: int = 0

    def __post_init__(self) -> None:
        for field in (
            "num_layers",
            "num_kv_heads",
            "head_size",
            "tokens_per_frame",
            "frames_per_block",
            "window_frames",
            "session_capacity",
            "max_model_len",
        ):
            object.__setattr__(self, field, _require_int(field, getattr(self, field), minimum=1))
        for field in ("sink_frames", "max_scratch_tokens_per_branch", "model_owned_state_bytes_per_session"):
            object.__setattr__(self, field, _require_int(field, getattr(self, field), minimum=0))
        if not isinstance(self.reset_at_boundary, bool):
            raise ValueError(f"AR-Diffusion reset_at_boundary must be a bool, got {self.reset_at_boundary!r}")
        # Lists are accepted for convenience and frozen here, so the spec stays hashable.
        for field in ("kv_branches", "cross_attention"):
            if not isinstance(getattr(self, field), (tuple, list)):
                raise ValueError(f"AR-Diffusion {field} must be a tuple of specs, got {getattr(self, field)!r}")
        object.__setattr__(self, "kv_branches", tuple(self.kv_branches))
        object.__setattr__(self, "cross_attention", tuple(self.cross_attention))
        for branch in self.kv_branches:
            if not isinstance(branch, ARDiffusionKVBranchSpec):
                raise ValueError(f"AR-Diffusion kv_branches must hold ARDiffusionKVBranchSpec, got {branch!r}")
        for cache in self.cross_attention:
            if not isinstance(cache, ARDiffusionCrossAttentionKVSpec):
                raise ValueError(
                    f"AR-Diffusion cross_attention must hold ARDiffusionCrossAttentionKVSpec, got {cache!r}"
                )
        if not self.kv_branches:
            raise ValueError("AR-Diffusion requires at least one KV branch, got kv_branches=()")
        names = [branch.name for branch in self.kv_branches]
        if len(names) != len(set(names)):
            raise ValueError(f"AR-Diffusion KV branch names must be unique, got {names}")
        indices = {branch.local_index for branch in self.kv_branches}
        if indices != set(range(max(indices) + 1)):
            raise ValueError(
                f"AR-Diffusion KV branch local_index values must be contiguous from zero, got {sorted(indices)}"
            )
        cross_names = [cache.name for cache in self.cross_attention]
        if len(cross_names) != len(set(cross_names)):
            raise ValueError(f"AR-Diffusion cross-attention cache names must be unique, got {cross_names}")

    @property
    def num_local_kv_branches(self) -> int:
        """Number of worker-local self-attention and scratch storage slots."""
        return max(branch.local_index for branch in self.kv_branches) + 1

    @property
    def cross_attention_lengths(self) -> dict[str, int]:
        """Token count of each named cross-attention cache."""
        return {cache.name: cache.num_tokens for cache in self.cross_attention}

    @property
    def branch_names(self) -> tuple[str, ...]:
        return tuple(branch.name for branch in self.kv_branches)

    def branch(self, name: str) -> ARDiffusionKVBranchSpec:
        """The branch called ``name``; a ``KeyError`` names the valid ones."""
        for branch in self.kv_branches:
            if branch.name == name:
                return branch
        raise KeyError(f"unknown AR-Diffusion KV branch {name!r}; valid branches: {list(self.branch_names)}")

    def cross_geometry(self, name: str) -> tuple[int, int, int]:
        """``(num_kv_heads, num_tokens, head_size)`` of the named cross-attention cache."""
        for cache in self.cross_attention:
            if cache.name == name:
                return (
                    cache.num_kv_heads or self.num_kv_heads,
                    cache.num_tokens,
                    cache.head_size or self.head_size,
                )
        valid = [cache.name for cache in self.cross_attention]
        raise KeyError(f"unknown cross-attention cache {name!r}; valid caches: {valid}")


@runtime_checkable
class SupportsARDiffusionPipeline(Protocol):
    """The capability :class:`ARDiffusionModelRunner` requires of a pipeline.

    A session begins when the runner first sees its ``session_id`` and lasts
    across requests until reset, explicit close, LRU eviction or a failed
    forward. The runner binds its KV state only around one forward; the
    pipeline must not keep it after the context exits.
    """

    def ar_diffusion_kv_cache_spec(self) -> ARDiffusionKVCacheSpec:
        """Immutable KV geometry and session policy of this worker."""

    def bind_ar_diffusion_state(self, session_id: str, state: ARDiffusionKVState) -> AbstractContextManager[None]:
        """Make ``state`` visible to model execution for one request."""

    def reset_ar_diffusion_session(self, session_id: str) -> None:
        """Reset model-owned state of ``session_id`` after its KV was released."""

    def close_ar_diffusion_session(self, session_id: str) -> None:
        """Drop model-owned state after close, eviction or a failed forward."""


@runtime_checkable
class SupportsARDiffusionWarmup(Protocol):
    """Optional provider of model-valid warmup requests.

    Pipelines without it load normally and skip the rollout warmup.
    """

    def ar_diffusion_warmup_requests(self, session_id: str) -> Iterable[Any]:
        """Yield requests for the shapes worth warming, each carrying ``session_id``."""


@runtime_checkable
class SupportsARDiffusionRequestCheck(Protocol):
    """Optional: refuse a request whose inputs ``forward`` would refuse, before its session is touched.

    Without it the runner learns of bad inputs only when the forward raises: by then a new session has evicted
    the least recently used one, a swapped-out one has been restored, and the failed forward releases either.
    """

    def check_ar_diffusion_request(self, request: Any) -> None:
        """Raise (an ``ObservationError``, say) for inputs the forward would refuse; touch no session state."""


@runtime_checkable
class SupportsARDiffusionSwap(Protocol):
    """Optional: what the pipeline keeps per session outside the runner's pools, out and back in.

    With a swap store, the runner swaps an LRU-evicted session to disk (its KV and this snapshot) and restores it
    on request; pipelines without it have their evicted sessions rebuilt by replay, as before.
    """

    def export_ar_diffusion_session(self, session_id: str) -> dict[str, Any] | None:
        """Name -> CPU tensor or JSON-able plain value (None: nothing kept), read just before an eviction."""

    def import_ar_diffusion_session(self, session_id: str, snapshot: dict[str, Any] | None) -> None:
        """Take back an exported snapshot; raise ``ValueError`` naming what does not fit, keeping nothing."""


PIPELINE_METHODS = ("ar_diffusion_kv_cache_spec", "bind_ar_diffusion_state", "reset_ar_diffusion_session",
                    "close_ar_diffusion_session")
# The arguments the runner passes each method a pipeline has (the optional ones included), all positional: a method
# that cannot take them is refused at load. It loaded, and failed at its first request (a rollout's first step).
PIPELINE_CALL_ARGUMENTS = {
    "ar_diffusion_kv_cache_spec": (),
    "bind_ar_diffusion_state": ("session_id", "state"),
    "reset_ar_diffusion_session": ("session_id",),
    "close_ar_diffusion_session": ("session_id",),
    "forward": ("request",),
    "ar_diffusion_warmup_requests": ("session_id",),
    "check_ar_diffusion_request": ("request",),
    "export_ar_diffusion_session": ("session_id",),
    "import_ar_diffusion_session": ("session_id", "snapshot"),
}
