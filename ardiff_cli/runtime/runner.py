"""ARDiffusionModelRunner: the KV cache of one worker and every session on it.

The runner is model-neutral. It plans capacity from the device, preallocates
the pools once, keeps sessions in LRU order, binds a session's KV state to the
pipeline around exactly one forward, and releases sessions through one path
(reset, explicit close, LRU eviction, failed forward).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import inspect
import json
import logging
import os
import sys
import threading
import time
import traceback
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ardiff_cli.runtime.capability import (
    PIPELINE_CALL_ARGUMENTS,
    PIPELINE_METHODS,
    ARDiffusionKVCacheSpec,
    SupportsARDiffusionSwap,
    SupportsARDiffusionWarmup,
)
from ardiff_cli.runtime.capacity import (
    CapacityPlan,
    as_int,
    available_host_memory,
    checked_bytes,
    format_bytes,
    plan_capacity,
    total_host_memory,
)
from ardiff_cli.runtime.errors import (
    AFRESH,
    DIVERGED_IN_WARMUP,
    PIPELINE_HINT,
    UNTOUCHED,
    ArdiffError,
    ArdiffWarning,
    BudgetBeyondDeviceError,
    CapacityError,
    EngineStateError,
    ObservationError,
    PipelineError,
    RequestError,
    RequestModeError,
    RequestTypeError,
    SessionNotResident,
    StopRequested,
    SwapRestoreError,
    as_pipeline_error,
    joined,
    plural,
    shown,
)
from ardiff_cli.runtime.events import (
    CALLER_REASONS,
    RUNNER_REASONS,
    CapacityPlanned,
    HookFailed,
    RequestFinished,
    RuntimeEvent,
    SessionAdmitted,
    SessionClosed,
    SessionEvicted,
    SessionReset,
    SessionRestored,
    SnapshotDropped,
    SwapFailed,
    WarmupFinished,
)
from ardiff_cli.runtime.forward_errors import missing_input, name_kv_misuse
from ardiff_cli.runtime.kv.backends import select_attention_backend
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache, kv_dtype
from ardiff_cli.runtime.kv.layout import KVLayout
from ardiff_cli.runtime.kv.state import ARDiffusionKVState
from ardiff_cli.runtime.observation import ObservationSchema, describe_shape, validate_observation
from ardiff_cli.runtime.outputs import FLOAT16_OVERFLOW, host_arrays, output_differences, output_problem
from ardiff_cli.runtime.request import RUNNER_KEYS, ARDiffusionRequest, require_request
from ardiff_cli.runtime.swap import (
    SNAPSHOT_FILE,
    SwapStore,
    check_exported,
    check_swap_arguments,
    decode_snapshot,
    encode_exported,
    encode_snapshot,
    free_disk_bytes,
)

logger = logging.getLogger("ardiff.runtime")

WARMUP_SESSION_ID = "__ardiff_warmup__"  # reserved; user requests may not name it
MAX_HOOK_ERRORS = 16  # runner.hook_errors keeps the latest: each holds its traceback, so the failing hook's locals

REQUEST_MODE_ONLY = (
    "ARDiffusionModelRunner supports request-mode execution only (max_num_seqs=1, one request per forward, "
    "no step execution): batching or stepping requests would bypass bind_ar_diffusion_state(), which binds "
    "exactly one session's KV state around one forward"
)
ONE_REQUEST_AT_A_TIME = "run each request with execute_model(request), one at a time"


def _require_session_id(method: str, session_id: Any) -> None:
    """A session id argument is a non-empty str: a list or dict raised a plain ``TypeError: unhashable type``."""
    if not isinstance(session_id, str) or not session_id:
        raise RequestError(f"{method}() takes a session id (a non-empty string), got {shown(session_id)} "
                           f"({type(session_id).__name__})", hint="name a session by the id its requests give")


def _require_reason(method: str, reason: Any) -> None:
    """A caller's reason for its sessions' events is one of those ``method`` takes (``CALLER_REASONS``): the
    ``RequestError`` (a ``ValueError``) names them, and which calls take the one given, if any does."""
    allowed = CALLER_REASONS[method]
    if isinstance(reason, str) and reason in allowed:
        return
    takers = [f"{name}()" for name, reasons in CALLER_REASONS.items() if isinstance(reason, str) and reason in reasons]
    if takers:
        hint = f"{reason!r} is what {joined(takers, 'and')} take{'s' if len(takers) == 1 else ''}"
    elif isinstance(reason, str) and reason in RUNNER_REASONS:
        hint = f"{reason!r} is the runner's own word ({RUNNER_REASONS[reason]}), never a caller's"
    else:
        hint = "leave it out for 'explicit'"
    raise RequestError(f"{method}() takes reason {joined([repr(r) for r in allowed], 'or')}, got {shown(reason)}",
                       hint=hint)


class LifecycleHookError(PipelineError):
    """A pipeline reset/close hook raised. The session's KV was released regardless. A ``PipelineError`` (and so a
    ``RuntimeError``): the pipeline's code failed, as a forward that raises in warmup does (the CLI's
    ``pipeline_error``, exit 1)."""


def _as_a_step(schema: ObservationSchema, request: ARDiffusionRequest, where: str, name: str) -> ARDiffusionRequest:
    """``request`` with the schema's fields and prompt in its inputs as a rollout step hands them to the forward
    (``validate_observation``: canonical keys, numpy arrays in the fields' dtypes), so that warmup runs the path the
    steps take; other keys (a seed) are the pipeline's own, passed as given. A new request: the pipeline may give its
    request, or its inputs mapping, again. A ``PipelineError`` when the schema refuses them."""
    request.check()  # inputs that are no mapping: the request's own error, as a step's (not 'no attribute items')
    prompt_keys = (schema.prompt_key, *schema.prompt_aliases) if schema.prompt_key else ()
    fields = {key: value for key, value in request.inputs.items()
              if isinstance(key, str) and (key in prompt_keys or schema.field(key) is not None)}
    try:
        valid = validate_observation(schema, fields, where=where)
    except ObservationError as exc:
        raise PipelineError(
            f"{where}: its inputs do not match the pipeline's observation_schema: "
            f"{str(exc).removeprefix(f'{where}: ')}",
            hint=f"make ar_diffusion_warmup_requests() give inputs like a step's, which rollout checks against "
                 f"{name}'s observation_schema ({exc.hint}): README, 'Adding a pipeline'") from None
    own = {key: value for key, value in request.inputs.items() if key not in fields}
    converted = copy.copy(request)  # its type kept, its constructor not called: a subclass may take other arguments
    converted.inputs = {**valid, **own}
    return converted


# The hint of a BudgetBeyondDeviceError, in the runner's own terms (the engine's and the CLI's name their own)
BEYOND_DEVICE_HINT = ("pass ARDiffusionModelRunner a lower memory_budget or session_capacity, or memory_budget=None "
                      "to plan with the free memory; ardiff_cli.runtime.plan_capacity() plans for any amount")


class PipelineContractError(PipelineError, TypeError):
    """The pipeline lacks a capability method, or its spec is not an ``ARDiffusionKVCacheSpec`` (refused at load)."""


class PipelineModeError(PipelineError, ValueError):
    """The pipeline declares request batching or step execution, which the runner never does (refused at load)."""


def _one_at_a_time(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` alone: calls from other threads wait for the request in progress; a call from inside
    it (an event callback, the pipeline's forward) would corrupt it and raises instead of deadlocking."""

    @functools.wraps(method)
    def exclusive(self: ARDiffusionModelRunner, *args: Any, **kwargs: Any) -> Any:
        me = threading.get_ident()
        if self._request_owner == me:
            raise RuntimeError(
                f"{method.__name__}() called from inside a request on the same thread (an event callback or the "
                "pipeline's forward?): requests and session calls run one at a time; make it after the request"
            )
        with self._request_lock:
            try:  # owner set inside the try: a signal right after it cannot leave a stale owner behind
                self._request_owner = me
                return method(self, *args, **kwargs)
            finally:
                self._request_owner = None

    return exclusive


def _let_go(exc: BaseException) -> None:
    """None, once the locals of the frames ``exc`` unwound are cleared: a failed restore's error kept the snapshot's
    tensors there, views of a mapping of its file (deleted then), and a caller keeping the error (a server's last
    error) kept that file's disk space and a file descriptor as long. Its frames still show in a traceback."""
    traceback.clear_frames(exc.__traceback__)  # the frame still running (the caller's) is left: it sets its own
    return None


def _is_stop(exc: BaseException) -> bool:
    """A deliberate stop, which a signal raises wherever the main thread is: the CLI's ``Interrupted`` (a
    ``StopRequested``), a ``KeyboardInterrupt``, a ``SystemExit`` from a server's SIGTERM handler."""
    return isinstance(exc, StopRequested) or not isinstance(exc, Exception)


def _tensors_of(exported: Any) -> list[torch.Tensor] | None:
    """The tensors of what a pipeline's ``export_ar_diffusion_session`` returned (None: it returned no dict)."""
    return [v for v in exported.values() if isinstance(v, torch.Tensor)] if isinstance(exported, dict) else None


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    """The memory ``tensors`` hold: tensors sharing one storage (a buffer and views of it) count it once, and at most
    their own bytes (a slice of a larger buffer counts the slice)."""
    storages: dict[tuple[str, int], tuple[int, int]] = {}  # (device, storage address) -> (its bytes, its views')
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        size, views = storages.get(key, (storage.nbytes(), 0))
        storages[key] = (size, views + tensor.nbytes)
    return sum(min(size, views) for size, views in storages.values())


def _defined_at(method: Any) -> str:
    """Where ``method`` is defined, as ``file:line`` (relative to the working folder when under it); "defined in
    native code" when Python cannot say."""
    target = inspect.unwrap(getattr(method, "__func__", method))
    while isinstance(target, functools.partial):  # a partial of a Python function is defined where that is
        target = inspect.unwrap(target.func)
    code = getattr(target, "__code__", None)
    if code is None and not isinstance(target, type):  # a callable object: where its class defines __call__
        call = getattr(type(target), "__call__", None)
        code = getattr(inspect.unwrap(getattr(call, "__func__", call)), "__code__", None)
    if code is None:
        return "defined in native code"
    path = code.co_filename
    with contextlib.suppress(ValueError):  # another drive (Windows)
        relative = os.path.relpath(path)
        path = path if relative.startswith("..") else relative
    return f"{path}:{code.co_firstlineno}"


def _caller_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel``, in the function that calls this, for the first frame outside the runtime
    package: a warning about a request points at the caller's ``engine.execute(...)`` (or ``execute_model``), not
    at the wrappers between it and the runner."""
    package = str(Path(__file__).parent)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def require_subscriber(callback: Any, where: str) -> None:
    """Refuse a subscriber that is not callable at once: it was taken, then failed on every event as a warning."""
    if not callable(callback):
        raise RequestTypeError(f"{where} takes a callable, called with each RuntimeEvent, got {shown(callback)} "
                               f"({type(callback).__name__})",
                               hint="pass the function itself, not what calling it returns: subscribe(on_event), "
                               "not subscribe(on_event())")


def _once(function: Callable[[], None]) -> Callable[[], None]:
    """``function`` that runs on the first call only (an unsubscribe function a caller may call twice)."""
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            function()

    return call


@dataclass(frozen=True, slots=True)
class SessionView:
    """What the CLI shows of one resident session (a snapshot taken after its last request)."""

    session_id: str
    pages_per_branch: dict[str, int]  # resident self-attention pages per logical branch
    committed_frames: dict[str, int]  # absolute committed frames per logical branch
    cross_attention_bytes: int
    num_requests: int
    last_latency_s: float | None
    admitted_at: float


@dataclass(frozen=True, slots=True)
class PoolUsage:
    num_pages: int  # allocatable pages
    num_free: int
    num_used: int
    bytes_per_page: int
    num_swapped: int = 0  # evicted sessions whose snapshot is in the swap store
    swapped_bytes: int = 0  # bytes of those snapshot files
    swap_budget_bytes: int = 0  # the swap store's budget (0: no swap store)


@dataclass(frozen=True)
class WarmupReport:
    skipped: bool  # the pipeline has no warmup provider
    timings: list[tuple[str, str, float]] = field(default_factory=list)  # (request_id, shape, seconds)
    # each request's inputs as the forward got them, by name: a tensor's shape, None for an input that has none
    input_shapes: list[dict[str, list[int] | None]] = field(default_factory=list)
    restored: bool = True  # free-page count back where it started
    seconds: float = 0.0


@dataclass
class _Session:
    state: ARDiffusionKVState
    admitted_at: float
    num_requests: int = 0
    last_latency_s: float | None = None
    view: SessionView | None = None
    # Its last request (or restore) ended: its KV and pipeline state are that request's, and ``num_requests`` counts
    # them. False from admission, and while a request runs on it (a stop inside one releases the session); still
    # False between requests only when a stop came between its admission and its forward: ``swap_out_sessions``
    # leaves it then.
    settled: bool = False




def input_shapes(inputs: dict[str, Any]) -> dict[str, list[int] | None]:
    """Each input's shape as a list of ints (``[]`` for a 0-d tensor), ``None`` for one that has none (a prompt)."""
    shapes: dict[str, list[int] | None] = {}
    for key, value in inputs.items():
        shape = getattr(value, "shape", None)
        shapes[key] = None if shape is None else [int(n) for n in shape]
    return shapes


class ARDiffusionModelRunner:
    """Owns the paged KV of one worker and the sessions that live in it."""

    def __init__(
        self,
        pipeline: Any,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_num_seqs: int = 1,
        step_execution: bool = False,
        memory_budget: int | str | None = None,
        gpu_memory_fraction: float = 0.9,
        session_capacity: int | None = None,
        attention_backend: str = "auto",
        swap_dir: str | Path | None = None,
        swap_space: int | str | None = None,
    ) -> None:
        self.pipeline = pipeline  # the model; sees KV only through bind_ar_diffusion_state
        self.device = torch.device(device)
        # KV dtype, equal to the model's activation dtype (a name as plan_capacity takes it: 'bfloat16' was a TypeError
        # from torch.zeros at load, after the plan had taken it)
        self.dtype = kv_dtype(dtype, "ARDiffusionModelRunner()")
        self.max_num_seqs = max_num_seqs  # must be 1: request mode only
        self.step_execution = step_execution  # must be False: request mode only
        # explicit "available" bytes (an int, or text such as '2GiB'); None = measure the device
        self.memory_budget = (None if memory_budget is None
                              else checked_bytes(memory_budget, "ARDiffusionModelRunner(): memory_budget"))
        self.gpu_memory_fraction = gpu_memory_fraction  # soft budget for sessions beyond the first
        self.session_capacity_override = session_capacity  # replaces the pipeline's session_capacity
        self.attention_backend_setting = attention_backend  # auto | torch | vllm (kv/backends.py)
        self.attention_backend: str | None = None  # the backend chosen at load: "torch" or "vllm"
        self.attention_backend_reason = ""  # why, in words (logged and emitted with the plan)
        self.spec: ARDiffusionKVCacheSpec | None = None  # the pipeline's spec, read at load
        self.capacity_plan: CapacityPlan | None = None
        self.kv_cache: ARDiffusionKVCache | None = None  # pools, preallocated once at load
        # Where LRU-evicted sessions are swapped (None: no swapping; they are released, as a close), and the most
        # bytes of snapshots kept there (None: the plan's KV budget, at most half the folder's free disk at load).
        self.swap_dir, self.swap_space = check_swap_arguments(swap_dir, swap_space, where="ARDiffusionModelRunner()")
        self.swap: SwapStore | None = None  # built at load, when the pipeline can export its sessions
        # what swapping warned about once: ("SwapSpace", None) for a snapshot larger than the whole swap space, else
        # (exception type, errno) of a failed write, as every later eviction would say the same (_swap_failed)
        self._swap_causes_warned: set[tuple[str, Any]] = set()
        self._disk_full = False  # a snapshot failed for a full disk: the next ones check the free space first
        # a session's export held more tensor bytes than the spec's model_owned_state_bytes_per_session: warned once
        self._model_owned_warned = False
        self._export_warned = False  # a warmup session's export failed, or held a value a snapshot cannot: warned once
        # >0 while warmup runs a request again on its rebuilt session (_check_rerun): its events are dropped, since
        # for every subscriber it is the one request it already saw. Runner-wide: warmup holds the request lock
        # (_one_at_a_time), so no other thread's request or session call runs meanwhile, but another session's
        # background swap write that fails meanwhile has its event dropped too (Python API only: the CLI warms up
        # before any session of its own exists)
        self._muted = 0
        self._muted_hook_errors: list[LifecycleHookError] = []  # hooks that failed meanwhile: _check_rerun warns
        self._warned_keys: set[str] = set()  # misspelt extra_args keys reported (``ARDiffusionRequest.misspelt_keys``)
        self._closed = False  # close() ran: pools and pipeline dropped, every later request refused
        # Resident sessions, least recently used first.
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        # Guards the session table and views; the forward itself runs outside it.
        self._lock = threading.RLock()
        # One request (or lifecycle call) at a time: a forward uses the pool's shared workspace and its session,
        # which a second thread's request could evict. Held by _one_at_a_time; its owner is the running thread.
        self._request_lock = threading.Lock()
        self._request_owner: int | None = None
        self._subscribers: list[Callable[[RuntimeEvent], None]] = []
        # Events emitted while the request in progress holds _lock, or before it holds its session, delivered once
        # both are over (_locked, _events_held): a subscriber must never run under the lock that the views take, and
        # sees the table as the request left it. Only the request's thread touches these.
        self._outbox: deque[RuntimeEvent] = deque()
        self._hold_depth = 0
        # The latest MAX_HOOK_ERRORS hook failures, oldest first (each is also emitted as a HookFailed event).
        self.hook_errors: deque[LifecycleHookError] = deque(maxlen=MAX_HOOK_ERRORS)

    # ------------------------------------------------------------------ load
    def load(self) -> CapacityPlan:
        """Check the pipeline and execution mode, plan capacity, preallocate the pools. When it fails, no pool stays
        allocated and it may run again."""
        self._require_open()
        if self.kv_cache is not None:
            raise EngineStateError("ARDiffusionModelRunner.load() ran already: its pools are allocated",
                                   hint="load a runner once; close() it and make a new one to reload")
        if self.max_num_seqs != 1:
            raise RequestModeError(f"{REQUEST_MODE_ONLY}; got max_num_seqs={self.max_num_seqs}",
                                   hint=f"leave max_num_seqs out (or 1); {ONE_REQUEST_AT_A_TIME}")
        if self.step_execution:
            raise RequestModeError(f"{REQUEST_MODE_ONLY}; step execution was requested",
                                   hint=f"leave step_execution out (or False); {ONE_REQUEST_AT_A_TIME}")
        for flag in ("supports_request_batch", "supports_step_execution"):
            if getattr(self.pipeline, flag, False):
                raise PipelineModeError(
                    f"{REQUEST_MODE_ONLY}; the pipeline {type(self.pipeline).__name__} declares {flag}=True",
                    hint=f"leave {flag} out (or False): ardiff runs one request per forward, its session's KV state "
                         "bound around it")
        missing = [name for name in (*PIPELINE_METHODS, "forward") if not callable(getattr(self.pipeline, name, None))]
        if missing:
            raise PipelineContractError(
                f"{type(self.pipeline).__name__} does not implement the AR-Diffusion pipeline capability: "
                f"missing {', '.join(missing)}",
                hint="see README, 'Adding a pipeline', for the methods a pipeline class implements",
            )
        self._check_signatures()
        try:
            spec = self.pipeline.ar_diffusion_kv_cache_spec()
        except Exception as exc:
            error = as_pipeline_error(f"{type(self.pipeline).__name__}.ar_diffusion_kv_cache_spec()", exc)
            if error is None:
                raise
            raise error from exc
        if not isinstance(spec, ARDiffusionKVCacheSpec):
            raise PipelineContractError(
                f"{type(self.pipeline).__name__}.ar_diffusion_kv_cache_spec() must return an ARDiffusionKVCacheSpec, "
                f"got {type(spec).__name__}",
                hint="build it with ardiff_cli.runtime.ARDiffusionKVCacheSpec(...)",
            )
        self.spec = spec
        plan, self.kv_cache = self._plan_and_allocate(spec)
        self.capacity_plan = plan
        try:
            if self.swap_dir is not None and isinstance(self.pipeline, SupportsARDiffusionSwap):
                space = self.swap_space
                if space is None:
                    space = min(plan.budget_bytes, free_disk_bytes(self.swap_dir) // 2)
                self.swap = SwapStore(self.swap_dir, space) if space > 0 else None
            self._emit(
                CapacityPlanned(
                    plan=plan,
                    device=str(self.device),
                    attention_backend=self.attention_backend,
                    attention_detail=f"{self.attention_backend_reason}; {self.kv_cache.attention_description}",
                )
            )
        except BaseException:
            # Not loaded (a subscriber's stop, the swap folder's disk that could not be looked at): the pools go back
            # now and load() may run again, as after a failed plan. They stayed, and a retry "ran already".
            self.kv_cache.release()
            self.kv_cache = self.capacity_plan = self.swap = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise
        return plan

    def _check_signatures(self) -> None:
        """Refuse a capability method that cannot take the arguments the runner passes it: it loaded, and failed
        with a TypeError at its first request, or (a hook) at the first session released. One that takes them as
        ``*args``/``**kwargs`` (a pass-through) takes anything: if what it hands them to cannot, that fails where it
        is first called, as any exception of the pipeline's code there (warmup's ``PipelineError``, a request's
        ``TypeError``, a hook's ``LifecycleHookError``)."""
        name = type(self.pipeline).__name__
        for method, arguments in PIPELINE_CALL_ARGUMENTS.items():
            bound = getattr(self.pipeline, method, None)
            if bound is None:  # a missing optional method (or one set to None): the pipeline lacks it
                continue
            if not callable(bound):  # `check_ar_diffusion_request = True`: it loaded, and failed at its first request
                raise PipelineContractError(
                    f"{name}.{method} is {shown(bound)} ({type(bound).__name__}), not a method: ardiff calls it as "
                    f"{method}({', '.join(arguments)})",
                    hint=f"define it as `def {method}({', '.join(('self', *arguments))})`, or leave it out (README, "
                         "'Adding a pipeline')",
                )
            try:
                signature = inspect.signature(bound)
            except (TypeError, ValueError):  # a builtin without a signature: nothing to check it by
                continue
            try:  # a functools.wraps decorator's own signature: one that names the arguments takes them, whatever
                # it passes the function it wraps (`def wrapper(self, request): return forward(self, request, seed)`)
                own = inspect.signature(bound, follow_wrapped=False)
            except (TypeError, ValueError):  # a wrapper in C (functools.lru_cache): the function it wraps says
                own = signature
            hands_on = False  # a wrapper that takes them as *args and hands them on, to the function it wraps
            with contextlib.suppress(TypeError):
                taken = own.bind(*arguments).arguments
                if own != signature:
                    if all(own.parameters[key].kind not in (
                            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for key in taken):
                        continue
                    hands_on = True
            try:  # handed on, they may come with arguments of the wrapper's own (`forward(self, *args, seed=0)`): then
                # only more than the function can take refuses it (it was "missing a required argument: 'seed'")
                taken = (signature.bind_partial if hands_on else signature.bind)(*arguments).arguments
            except TypeError as exc:
                raise PipelineContractError(
                    f"{name}.{method}() ({_defined_at(bound)}) cannot take the arguments ardiff passes it: "
                    f"expected {method}({', '.join(arguments)}), got {method}{signature}: {exc}",
                    hint=f"define it as `def {method}({', '.join(('self', *arguments))})` (README, 'Adding a "
                         "pipeline')",
                ) from None
            if hands_on and not inspect.ismethod(bound) and next(iter(taken), None) == "self":
                # a wrapper that is no method (a class with __call__ and no __get__) hands the function it wraps no
                # self: the first argument lands there, and the function misses its last one at every call
                raise PipelineContractError(
                    f"{name}.{method}() ({_defined_at(bound)}) cannot take the arguments ardiff passes it: its "
                    f"decorator, a {type(bound).__name__}, is not bound to the pipeline as a method is (its class "
                    f"defines no __get__), so it hands {method}{signature} no self, and {arguments[0]} in its place",
                    hint=f"give {type(bound).__name__} a __get__ that binds it (`return types.MethodType(self, "
                         "instance)`), or write the decorator as a function (functools.wraps)",
                )

    def _plan_and_allocate(self, spec: ARDiffusionKVCacheSpec) -> tuple[CapacityPlan, ARDiffusionKVCache]:
        """Pick the attention backend (kv/backends.py), plan for it, and allocate the pools in its layout.

        The backend comes first because it decides where the uncommitted block lives (torch: the
        gather workspace; paged kernels: scratch pages), which the plan counts.
        """
        layout = KVLayout.from_spec(spec)
        setting = self.attention_backend_setting
        name, reason = select_attention_backend(setting, self.device, dtype=self.dtype, layout=layout)
        available, total = self._available_bytes()

        def allocate(backend: str) -> tuple[CapacityPlan, ARDiffusionKVCache]:
            try:
                plan = plan_capacity(
                    spec,
                    self.dtype,
                    available,
                    self.gpu_memory_fraction,
                    session_capacity=self.session_capacity_override,
                    attention_backend=backend,
                )
            except CapacityError as exc:
                if self.memory_budget is None:  # the plan had the free memory: a budget past it does not add any
                    exc.hint = (f"use a smaller {'window, model' if exc.window_helps else 'model'} or dtype, or a "
                                f"device with more free memory (no --memory-budget was given: the plan had the free "
                                f"memory of {self._memory_owner()}, and a larger budget would not fit in it)")
                raise
            planned = plan.required_bytes(plan.session_capacity)
            if self.memory_budget is not None and planned > total:
                # The pools would be allocated (and zeroed) for it: on CPU that is the OOM killer, not an error.
                raise BudgetBeyondDeviceError(
                    f"the memory budget ({format_bytes(self.memory_budget)}, {self.memory_budget} bytes) plans "
                    f"{format_bytes(planned)} of KV memory, more than {self._memory_owner()}'s "
                    f"{format_bytes(total)} of memory",
                    hint=BEYOND_DEVICE_HINT,
                )
            try:
                cache = ARDiffusionKVCache(
                    spec, plan.num_managed_pages, dtype=self.dtype, device=self.device, attention_backend=backend,
                )
            except BaseException as exc:  # the plan whose pools did not fit: what a hint's lower --session-capacity
                with contextlib.suppress(MemoryError):  # goes below (its dict may find no memory either)
                    exc.ardiff_plan = plan
                raise
            return plan, cache

        try:
            plan, cache = allocate(name)
        except (torch.OutOfMemoryError, ArdiffError):
            # the plan did not fit (the smaller torch layout would hide that, not fix it), or the user's budget or
            # geometry is refused (a ConfigError is a ValueError): neither is the kernel's failure
            raise
        except (ImportError, RuntimeError, ValueError) as exc:
            if name == "torch" or setting != "auto":
                raise
            reason = f"vLLM kernel failed to initialise ({type(exc).__name__}: {exc}); using torch"
            # The user asked for the fast path (auto) and gets the slow one: a warning, not a log record.
            warnings.warn(f"attention backend: {reason}", ArdiffWarning, stacklevel=_caller_stacklevel())
            name = "torch"
            plan, cache = allocate(name)
        self.attention_backend, self.attention_backend_reason = name, reason
        logger.info("attention backend: %s (%s; %s)", name, reason, cache.attention_description)
        return plan, cache

    def _memory_owner(self) -> str:
        """Whose memory the plan takes, in words: "this host" on CPU ("cpu has" read as a device named cpu), else the
        GPU (cuda:0)."""
        return "this host" if self.device.type == "cpu" else str(self.device)

    def _available_bytes(self) -> tuple[int, int]:
        """(what the plan may use: the budget, else free memory; the device's memory in all)."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)  # after the model's weights are resident
        else:
            free, total = available_host_memory(), total_host_memory()
        return (free if self.memory_budget is None else self.memory_budget), total

    @property
    def closed(self) -> bool:
        return self._closed

    def _require_open(self) -> None:
        if self._closed:
            raise EngineStateError("the runner is closed (ARDiffusionEngine.close()): its KV pools and pipeline "
                                   "were released", hint="load the engine again (engine.load()) to serve requests")

    def _require_loaded(self) -> ARDiffusionKVCache:
        self._require_open()
        if self.kv_cache is None:
            raise EngineStateError("ARDiffusionModelRunner.load() must run before requests",
                                   hint="call engine.load() (runner.load()) first")
        return self.kv_cache

    # ---------------------------------------------------------------- events
    def subscribe(self, callback: Callable[[RuntimeEvent], None]) -> Callable[[], None]:
        """Deliver every later event to ``callback`` in order; returns a function that unsubscribes it (once:
        calling it again does nothing)."""
        require_subscriber(callback, "ARDiffusionModelRunner.subscribe()")
        self._subscribers.append(callback)
        return _once(lambda: self._unsubscribe(callback))

    def _unsubscribe(self, callback: Callable[[RuntimeEvent], None]) -> None:
        """Drop one subscription of ``callback``, if there is one."""
        for index, subscribed in enumerate(self._subscribers):
            if subscribed is callback:
                del self._subscribers[index]
                return

    @contextlib.contextmanager
    def _events_held(self) -> Iterator[None]:
        """Queue the events emitted meanwhile, and deliver them in order when the outermost such block ends: the
        evictions, restore and admission of one request are delivered together, once it holds its session."""
        self._hold_depth += 1
        try:
            yield
        finally:
            self._hold_depth -= 1
            if not self._hold_depth:
                self._deliver()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the session-table lock; the events emitted meanwhile are delivered once it is released, so a
        subscriber may wait for a lock that a thread reading ``sessions()`` holds (it deadlocked)."""
        with self._events_held(), self._lock:
            yield

    def _emit(self, event: RuntimeEvent) -> None:
        """Deliver ``event`` now, or when the session-table lock is released and the request holds its session
        (``_locked``, ``_events_held``). Dropped while warmup checks a rerun (``_muted``)."""
        if self._muted:
            return
        self._outbox.append(event)
        if not self._hold_depth:
            self._deliver()

    def _deliver(self) -> None:
        """Deliver the queued events, in order, to every subscriber. A subscriber observes: one that raises is a
        warning, and the request (or load) goes on, since its effects are committed by now. A ``StopRequested`` is
        a deliberate stop (the CLI's ``Interrupted``, raised by its signal handler wherever the main thread is), as
        a ``KeyboardInterrupt`` is: it propagates once every queued event reached every subscriber (the ones after
        the stopped one missed the event, and the rest waited for the next request: a session admitted or evicted
        that a subscriber never heard of)."""
        stop: BaseException | None = None
        while self._outbox:
            stopped = self._notify(self._outbox.popleft())
            stop = stop or stopped
        if stop is not None:
            raise stop

    def _notify(self, event: RuntimeEvent) -> BaseException | None:
        """``event`` to every subscriber; the first stop one raised (``_deliver``), or None."""
        stop: BaseException | None = None
        for callback in list(self._subscribers):
            try:
                callback(event)
            except StopRequested as exc:
                stop = stop or exc
            except Exception as exc:  # noqa: BLE001 - reported, never allowed to fail a request
                name = getattr(callback, "__qualname__", None) or repr(callback)
                code = getattr(callback, "__code__", None)  # functions and bound methods: point at the subscriber
                try:
                    said = f": {exc}"
                except Exception:  # noqa: BLE001 - its __str__ raised: that failed the request
                    said = " (which cannot be shown as text)"
                # A throwaway registry: warn() would remember each distinct message (they name the error) in this
                # module's __warningregistry__ for the process's life, one entry per failing request.
                warnings.warn_explicit(
                    f"event subscriber {name} raised {type(exc).__name__}{said} (on a {event.kind} event); ignored: "
                    "a subscriber cannot fail a request", ArdiffWarning,
                    code.co_filename if code else __file__, code.co_firstlineno if code else 0, registry={})
            except BaseException as exc:  # a KeyboardInterrupt: a stop too
                stop = stop or exc
        return stop

    # ------------------------------------------------------------- execution
    @_one_at_a_time
    def execute_model(self, request: ARDiffusionRequest) -> Any:
        """Run one request on its session; see ``ARDiffusionRequest`` for the lifecycle flags."""
        return self._execute(request, internal=False)

    def _refuse_autocast(self, request: ARDiffusionRequest | None) -> None:
        """Under ``torch.autocast`` to another dtype than the engine's, the forward would make K/V the pools cannot
        take and fail half way, releasing the session: refused before it is touched instead (``request`` None:
        before warmup runs a request, so that it is the caller's error, not the pipeline's)."""
        kind = self.device.type
        try:
            if not torch.is_autocast_enabled(kind) or torch.get_autocast_dtype(kind) == self.dtype:
                return
        except RuntimeError:  # a device type autocast does not know (meta): nothing to cast
            return
        what = "warmup" if request is None else f"request {shown(request.request_id)}"
        untouched = "" if request is None else f": the session {shown(request.session_id)} is as it was"
        raise RequestError(
            f"{what} runs under torch.autocast({kind!r}, dtype={torch.get_autocast_dtype(kind)}), and this engine "
            f"computes and keeps its KV cache in {self.dtype}{untouched}",
            hint="run requests outside the autocast block; for another dtype, set runtime.dtype in the config")

    def execute_model_batch(self, *args: Any, **kwargs: Any) -> Any:
        raise RequestModeError(f"{REQUEST_MODE_ONLY}; execute_model_batch() is not available",
                               hint=ONE_REQUEST_AT_A_TIME)

    def execute_stepwise(self, *args: Any, **kwargs: Any) -> Any:
        raise RequestModeError(f"{REQUEST_MODE_ONLY}; execute_stepwise() is not available",
                               hint=f"{ONE_REQUEST_AT_A_TIME}: it runs the request's whole forward")

    def _execute(self, request: ARDiffusionRequest, *, internal: bool) -> Any:
        self._require_loaded()
        require_request(request, "ARDiffusionModelRunner.execute_model()")
        # before the session is touched: a malformed request leaves it as it was
        session_id, reset, close_session = request.check()
        for key, meant in request.misspelt_keys():
            if key not in self._warned_keys:  # once a key: every request of a client would say the same
                self._warned_keys.add(key)
                routed = f", and the request to session {session_id!r}" if meant == "session_id" else ""
                warnings.warn(f"request {shown(request.request_id)}: extra_args key {key!r} is not one the runner "
                              f"reads ({', '.join(RUNNER_KEYS)}): it goes to the pipeline as is{routed}; did you mean "
                              f"{meant!r}?", ArdiffWarning, stacklevel=_caller_stacklevel())
        if session_id == WARMUP_SESSION_ID and not internal:
            raise RequestError(f"session id {WARMUP_SESSION_ID!r} is reserved for warmup",
                               hint="name the session otherwise")
        self._refuse_autocast(request)
        start = time.perf_counter()
        check = getattr(self.pipeline, "check_ar_diffusion_request", None)
        if check is not None:  # inputs the forward would refuse: nobody is evicted, restored, reset or released
            try:
                check(request)
            except Exception as exc:
                if not internal:
                    exc.add_note(f"request {shown(request.request_id)} was refused before session "
                                 f"{shown(session_id)} was touched: {UNTOUCHED}")
                raise
        with self._events_held():
            if reset and session_id in self._sessions:
                with self._locked():
                    errors = self._release(session_id, reason="request_reset", hook="reset")
                if errors:  # as reset_session() raises: the forward would run on what the hook failed to drop
                    if not internal:
                        errors[0].add_note(f"request {shown(request.request_id)} did not run: the reset it asked for "
                                           f"failed in the pipeline's hook; session {shown(session_id)} was released, "
                                           f"so {AFRESH}")
                    raise errors[0]
            elif reset:  # swapped out: its snapshot goes, with the event a resident one's reset sends
                self._discard_swapped(session_id, "reset", reason="request_reset")
            if not reset and self._has_snapshot(session_id):
                self._restore(session_id)  # swapped out: it goes on where it was (reset=True discards it instead)
            self._make_room(session_id)
            with self._locked():
                session = self._admit(session_id)
        session.settled = False  # until the request's bookkeeping below is done
        state = session.state
        bound = time.perf_counter()
        forward_end = None
        try:
            state.bound = True  # until the binding's context exits: a state the pipeline kept is refused after it
            binding = self.pipeline.bind_ar_diffusion_state(session_id, state)
            if not (hasattr(binding, "__enter__") and hasattr(binding, "__exit__")):
                raise PipelineContractError(
                    f"{type(self.pipeline).__name__}.bind_ar_diffusion_state() returned {type(binding).__name__}, "
                    "expected a context manager inside which the forward uses the state",
                    hint="decorate it with @contextlib.contextmanager and yield once, in a try/finally")
            with binding:
                forward_start = time.perf_counter()
                try:
                    output = self.pipeline.forward(request)
                except KeyError as exc:  # inputs['obs'] where the request holds 'image': say so
                    missing = missing_input(self.pipeline, request, exc, warmup=session_id == WARMUP_SESSION_ID)
                    if missing is None:
                        if not internal:  # a warmup's error names the pipeline already ("of P failed: ...")
                            name_kv_misuse(self.pipeline, exc)
                        raise
                    raise missing from exc
                except Exception as exc:
                    if not internal:
                        name_kv_misuse(self.pipeline, exc)
                    raise
                if self.device.type == "cuda":  # its kernels run after it returns: for outputs left on the GPU,
                    # forward_s timed their launch only, and an error of theirs surfaced at the next use of the device
                    torch.cuda.synchronize(self.device)
                forward_end = time.perf_counter()
            state.bound = False
            if forward_end is None:  # the forward raised and the pipeline's context manager swallowed it
                raise RuntimeError(
                    f"{type(self.pipeline).__name__}.bind_ar_diffusion_state() suppressed an exception raised by "
                    f"the forward of request {request.request_id!r}: the context manager must let exceptions "
                    "propagate (use try/finally, never a bare except), so the runner can release the session"
                )
            dangling = state.uncommitted_branches()
            if dangling:
                raise RuntimeError(
                    f"{type(self.pipeline).__name__}.forward() of request {request.request_id!r} returned with "
                    f"uncommitted commit passes on branches {dangling}: call state.commit(branch) after each commit "
                    "pass"
                )
            written = state.cross_attention_written()
            if written:
                raise RuntimeError(
                    f"{type(self.pipeline).__name__}.forward() of request {request.request_id!r} wrote the "
                    f"cross-attention cache {', '.join(written)} in place: the tensors state.cross_attention() "
                    "gives are the session's cache, kept for its later requests, and only populate_cross_attention "
                    "may change them; write into a copy (k = k * scale, not k.mul_(scale)), or publish the changed "
                    "cache with state.populate_cross_attention"
                )
            state.end_request()
            with self._locked():  # in the try: a stop before the request is counted must not leave it uncounted
                session.num_requests += 1
                if close_session:
                    # A failing close hook must not cost the caller this forward's output: the
                    # error is recorded in hook_errors and emitted as HookFailed instead.
                    self._release(session_id, reason="close_session", hook="close")
                else:
                    session.last_latency_s = time.perf_counter() - start
                    session.view = self._snapshot(session_id, session)
                    session.settled = True
                end = time.perf_counter()
        except BaseException as exc:
            state.bound = False
            with self._locked():
                if self._sessions.get(session_id) is session:
                    errors = self._release(session_id, reason="forward_exception", hook="close", error=exc)
                    # The pipeline's error ("request inputs: ...") names neither: a server's log must say which
                    # robot's history is gone (warmup's reserved session is nobody's).
                    if not internal:
                        exc.add_note(f"request {shown(request.request_id)} failed, so session {shown(session_id)} "
                                     f"was released: its history is gone, and {AFRESH}")
                    for hook_error in errors:
                        exc.add_note(str(hook_error))
            raise
        bind_s = (bound - start) + (forward_start - bound)
        self._emit(
            RequestFinished(
                request_id=request.request_id,
                session_id=session_id,
                bind_s=bind_s,
                forward_s=forward_end - forward_start,
                commit_s=end - forward_end,
                total_s=end - start,
            )
        )
        return output

    def _make_room(self, session_id: str) -> None:
        """Evict least recently used sessions until ``session_id`` can be admitted. Its own snapshot, if it had
        one, is gone already: both callers discard it first (a reset request through ``_discard_swapped``,
        ``_restore`` once it has read it). A victim's snapshot is written before the session-table lock is
        taken: for a large session that takes seconds, and the views (``sessions()``, ``pool_usage()``) must not
        wait for it. Every other call that changes the table waits on the request lock meanwhile."""
        if session_id in self._sessions:
            return
        assert self.capacity_plan is not None
        while len(self._sessions) >= self.capacity_plan.session_capacity:
            self._evict(next(iter(self._sessions)), by_session_id=session_id)

    def _evict(self, session_id: str, *, by_session_id: str | None = None, evicting: bool = True,
               reason: str = "lru_eviction") -> int | None:
        """Swap ``session_id`` out (``_swap_out``), then release it with the close hook: an LRU eviction by
        ``by_session_id``, or (not ``evicting``) ``swap_out_sessions``'s, for its caller's ``reason``, which leaves the
        session resident when it got no snapshot. The snapshot's bytes, or None. A stop before the release took it
        leaves the session resident, so no snapshot of it."""
        try:
            swap_bytes = self._swap_out(session_id, self._sessions[session_id], evicting=evicting)
            if swap_bytes is None and not evicting:
                return None
            with self._locked():
                self._release(session_id, reason=reason, hook="close", by_session_id=by_session_id,
                              swap_bytes=swap_bytes)
        except BaseException:
            if session_id in self._sessions and self.swap is not None:
                self.swap.discard(session_id)
            raise
        return swap_bytes

    def _admit(self, session_id: str) -> _Session:
        """The resident session ``session_id``, most recently used now (``_make_room`` made room for a new one)."""
        session = self._sessions.get(session_id)
        if session is not None:
            self._sessions.move_to_end(session_id)
            return session
        assert self.capacity_plan is not None and len(self._sessions) < self.capacity_plan.session_capacity
        session = _Session(state=self.kv_cache.new_state(session_id), admitted_at=time.time())
        session.state.bound = False  # the model may use it only while a request binds it
        self._sessions[session_id] = session
        session.view = self._snapshot(session_id, session)
        self._emit(SessionAdmitted(session_id=session_id))
        return session

    # ------------------------------------------------------------- lifecycle
    @_one_at_a_time
    def reset_session(self, session_id: str) -> None:
        """Release ``session_id`` and call the pipeline's reset hook; the next request starts fresh."""
        self._end_session(session_id, "reset")

    @_one_at_a_time
    def close_session(self, session_id: str, *, reason: str = "explicit", error: str | None = None) -> None:
        """Release ``session_id`` and call the pipeline's close hook. ``reason``: its ``session_closed`` event's, the
        caller's word for why: ``explicit``, ``episode_ended`` or ``episode_failed`` (``rollout``'s, as an episode
        ends or fails); ``error``: the event's, the caller's error that made it close the session
        (``episode_failed``'s)."""
        _require_reason("close_session", reason)
        if error is not None and not isinstance(error, str):
            raise RequestError(f"close_session() takes an error as a string, got {shown(error)} "
                               f"({type(error).__name__})", hint="pass str(exc), or leave it out")
        self._end_session(session_id, "close", reason, error)

    def _end_session(self, session_id: str, hook: str, reason: str = "explicit", error: str | None = None) -> None:
        """``reset_session`` / ``close_session`` (``hook``): a swapped-out session is discarded, a resident one
        released; the first hook error is raised."""
        self._require_loaded()
        _require_session_id(f"{hook}_session", session_id)
        if self._discard_swapped(session_id, hook, reason=reason, error=error):
            return
        with self._locked():
            self._require_resident(session_id)
            errors = self._release(session_id, reason=reason, hook=hook, error=error)
        if errors:
            raise errors[0]

    @_one_at_a_time
    def close_all(self, *, reason: str = "explicit") -> list[LifecycleHookError]:
        """Close every session, resident or swapped out; returns hook errors. The runner goes on serving.
        ``reason``: their ``session_closed`` events', as ``close()`` takes it."""
        _require_reason("close_all", reason)
        return self._close_sessions(reason)

    @_one_at_a_time
    def close(self, *, reason: str = "explicit") -> list[LifecycleHookError]:
        """Close every session, resident or swapped out, then release the KV pools and the pipeline: their memory
        goes back now, even while something still references the runner. Later requests raise
        ``EngineStateError``; the final views (``pool_usage()``, ``capacity_plan``, ``hook_errors``) stay readable.
        ``reason``: the sessions' ``session_closed`` events', the caller's word for why it closes them:
        ``explicit``, or ``run_stopped`` / ``run_failed`` (rollout's, for the sessions a stopped or failed run does
        not keep). Returns hook errors; a second call does nothing."""
        _require_reason("close", reason)
        if self._closed:
            return []
        errors = self._close_sessions(reason)
        if self.kv_cache is not None:
            self.kv_cache.release()
        self.pipeline = None
        self._closed = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the device, so the next engine's plan sees it free
        return errors

    def _close_sessions(self, reason: str) -> list[LifecycleHookError]:
        errors: list[LifecycleHookError] = []
        if self.swap is not None:
            self.swap.flush()  # the write in flight ends first, outside the lock the views take
            self._warn_about_failed_writes(warn=False)  # their sessions are closed below: nothing is rebuilt
        with self._locked():
            for session_id in list(self._sessions):
                errors += self._release(session_id, reason=reason, hook="close")
            if self.swap is not None:
                for session_id in self.swap.session_ids:  # closed too, with the event close_session sends
                    self._discard_swapped(session_id, "close", reason=reason)
                self.swap.clear()  # and the folder goes
        return errors

    def _discard_swapped(self, session_id: str, hook: str, *, reason: str = "explicit",
                         error: str | None = None) -> bool:
        """A swapped-out session is reset or closed by deleting its snapshot (its pipeline state left with it); the
        same event as for a resident one (after a ``swap_failed`` if the write of its snapshot failed). Called
        without the session-table lock: the deletion waits for a write of the snapshot in flight, and the views
        must not."""
        if session_id in self._sessions or self.swap is None or not self.swap.discard(session_id, report=True):
            return False
        self._warn_about_failed_writes(warn=False)  # closed or reset: nothing is rebuilt
        if hook == "reset":
            self._emit(SessionReset(session_id=session_id, reason=reason))
        else:
            self._emit(SessionClosed(session_id=session_id, reason=reason, error=error))
        return True

    def _require_resident(self, session_id: str) -> None:
        if session_id not in self._sessions:
            raise SessionNotResident(
                f"no resident session {shown(session_id)} (never admitted, or evicted, closed or released since); "
                f"{len(self._sessions)} resident: {shown(list(self._sessions))}",
                hint="LRU eviction may release any session between requests: catch SessionNotResident (a "
                "KeyError), or check runner.session_ids, where that is expected",
            )

    def _release(
        self,
        session_id: str,
        *,
        reason: str,
        hook: str,
        error: BaseException | str | None = None,
        by_session_id: str | None = None,
        swap_bytes: int | None = None,
    ) -> list[LifecycleHookError]:
        """The one release path: free pages and cross-attention, then call the pipeline's hook.

        ``error``: the failed forward's exception (``forward_exception``), or a caller's error as ``close_session``
        takes it; the ``session_closed`` event's ``error`` (an exception's ``repr``).

        Hook failures are returned (and recorded and emitted), never swallowed. A stop (a ``StopRequested``, the
        CLI's ``Interrupted`` raised by its signal handler, or a ``KeyboardInterrupt``) as the KV is freed or from the
        hook is deliberate: raised once the release is done. ``swap_bytes``: the size of the snapshot that
        ``_swap_out`` wrote before an LRU eviction or a ``swap_out_sessions`` (None: none).
        """
        cache = self._require_loaded()
        session = self._sessions[session_id]
        stop: BaseException | None = None
        try:
            del self._sessions[session_id]  # no call between the lookup and the try: a stop cannot land there
            session.state._close()  # the runner's own: close() refuses a state the runner holds
        except BaseException as exc:
            if not _is_stop(exc):
                raise
            stop = exc  # half way through freeing its pages: they are taken back below, and the hook still runs
        method = f"{hook}_ar_diffusion_session"  # named so: a callable object set as the hook has no __name__
        callback = getattr(self.pipeline, method)
        errors: list[LifecycleHookError] = []
        try:
            callback(session_id)
        except StopRequested as exc:  # the CLI's Interrupted: raised once the release is complete
            stop = stop or exc
        except Exception as exc:  # noqa: BLE001 - collected, emitted and returned to the caller
            hook_error = LifecycleHookError(
                f"{type(self.pipeline).__name__}.{method}({session_id!r}) raised "
                f"{type(exc).__name__}: {exc}; the session's KV was released",
                hint=PIPELINE_HINT,
            )
            hook_error.__cause__ = exc
            errors.append(hook_error)
            self.hook_errors.append(hook_error)
            if self._muted:  # its event is dropped: warned of instead
                self._muted_hook_errors.append(hook_error)
            self._emit(HookFailed(session_id=session_id, hook=method, error=str(exc)))
        except BaseException as exc:  # a KeyboardInterrupt too: raised once the release is complete, its event sent
            stop = stop or exc
        used = sum(s.state.num_pages for s in self._sessions.values())
        if cache.allocator.num_used != used and (stop is not None or isinstance(error, BaseException)
                                                  and _is_stop(error)):
            # A stop (Ctrl-C: a KeyboardInterrupt, or the CLI's Interrupted) lands wherever the forward is, also
            # half way through the KV's page bookkeeping (a commit that had taken the block's pages from its
            # forward but not yet into the history): pages nobody held any more. The other sessions hold what
            # they held, and one request runs at a time: the rest go back. Else this assert failed in place of
            # the stop, and at every release after it, engine.close() too.
            cache.allocator.reclaim(page for s in self._sessions.values() for page in s.state.page_ids())
        assert cache.allocator.num_used == used, (
            f"page leak: allocator holds {cache.allocator.num_used} pages, resident sessions {used}"
        )
        if reason == "lru_eviction" or swap_bytes is not None:  # the latter: swap_out_sessions, its caller's reason
            self._emit(SessionEvicted(session_id=session_id, reason=reason, by_session_id=by_session_id,
                                      swapped=swap_bytes is not None, swap_bytes=swap_bytes or 0))
        elif hook == "reset":
            self._emit(SessionReset(session_id=session_id, reason=reason))
        else:
            said = error if error is None or isinstance(error, str) else repr(error)
            self._emit(SessionClosed(session_id=session_id, reason=reason, error=said))
        if stop is not None:
            raise stop
        return errors

    # ------------------------------------------------------------------ swap
    def _swap_out(self, session_id: str, session: _Session, *, evicting: bool = True) -> int | None:
        """Write the snapshot of a session being evicted (``evicting``), or swapped out by ``swap_out_sessions``,
        before its KV is released; its bytes, or None (no swap store, the session is over the budget, or the write
        failed: a warning, and it is evicted as before, or stays resident). Not ``evicting``, it takes only the swap
        space left: no other snapshot is dropped for it. A stop (``StopRequested``, the CLI's ``Interrupted``, or
        ``KeyboardInterrupt``) propagates: the caller deletes the snapshot, since the session stays resident."""
        if self.swap is None or session_id == WARMUP_SESSION_ID:
            return None
        exported = None  # the tensors of the pipeline's export, once it is encoded
        try:
            if self._disk_full:
                self._check_disk_room(session)
            state = self.pipeline.export_ar_diffusion_session(session_id)
            tensors, metadata = encode_snapshot(
                session.state._export(), state, session.num_requests,
                where=f"{type(self.pipeline).__name__}.export_ar_diffusion_session({session_id!r})")
            exported = _tensors_of(state)
            # in the background; waits for the last one
            written = self.swap.write(session_id, tensors, metadata, drop_older=evicting)
        except StopRequested:  # the CLI's Interrupted, not a failure to swap
            raise
        except Exception as exc:  # noqa: BLE001 - swapping is an optimisation: the eviction goes on without it
            self.swap.discard(session_id)
            then = "it is evicted without a snapshot" if evicting else "it stays resident"
            self._swap_failed(session_id, exc, background=False, then=then)
            return None
        finally:
            self._warn_about_failed_writes()
            self._report_dropped(session_id)
        self._check_model_owned(exported, f"swapping session {shown(session_id)} out")
        if written is None and evicting:  # larger than the whole swap space: a swap_failed event each, so that
            # the counts of evictions add up (summary.json's swapped_out + swap_failed), a warning for the first
            self._emit(SwapFailed(session_id=session_id, background=False,
                                  error=f"the snapshot ({self.swap.refused_bytes:,} bytes) is larger than the whole "
                                        f"swap space ({self.swap.budget_bytes:,} bytes)"))
        if written is None and evicting and ("SwapSpace", None) not in self._swap_causes_warned:
            self._swap_causes_warned.add(("SwapSpace", None))
            size, space = format_bytes(self.swap.refused_bytes), format_bytes(self.swap.budget_bytes)
            if size == space:  # a few bytes over: "(50.78 KiB) is larger than ... (50.78 KiB)" said nothing
                size, space = f"{self.swap.refused_bytes:,} bytes", f"{self.swap.budget_bytes:,} bytes"
            warnings.warn(f"the snapshot of session {shown(session_id)} ({size}) is larger than the whole swap space "
                          f"({space}): sessions this large are evicted without one (a larger swap space keeps them)",
                          ArdiffWarning, stacklevel=_caller_stacklevel())
        return written

    def _check_model_owned(self, tensors: list[torch.Tensor] | None, when: str) -> None:
        """Warn once per runner when the tensors a session's export holds (``tensors``, exported ``when``) are more
        bytes than the spec's ``model_owned_state_bytes_per_session``: the plan counts the declared bytes for each
        session, so sessions admitted within its budget hold more memory than planned. It looks only at what warmup
        or a swap-out exported anyway: no step pays for it."""
        if not tensors or self._model_owned_warned:
            return
        actual, declared = _distinct_bytes(tensors), self.spec.model_owned_state_bytes_per_session
        if actual <= declared:
            return
        self._model_owned_warned = True
        name = type(self.pipeline).__name__
        warnings.warn(f"{name}: a session keeps {format_bytes(actual)} ({actual:,} bytes) of tensors outside the KV "
                      f"pools ({name}.export_ar_diffusion_session() when {when}), but its KV spec declares "
                      f"model_owned_state_bytes_per_session = {declared:,} bytes: the capacity plan undercounts every "
                      f"session by at least {format_bytes(actual - declared)}, and sessions admitted within budget use "
                      "more memory than planned; declare the most a session keeps in the spec (README, 'Adding a "
                      "pipeline')", ArdiffWarning, stacklevel=_caller_stacklevel())

    def _check_disk_room(self, session: _Session) -> None:
        """After a snapshot failed for a full disk: ``OSError(ENOSPC)`` before anything is exported while the swap
        folder's disk has less free space than the session's KV (a lower bound of its file), so that on a full disk
        every eviction of a long run does not copy its session's KV out only for the write to fail."""
        self.swap.flush()  # the write in flight takes its space first
        needed = session.state.num_pages * self.capacity_plan.bytes_per_page + session.state.cross_attention_bytes
        free = free_disk_bytes(self.swap.directory)
        if needed > free:
            raise OSError(errno.ENOSPC, f"No space left on device: {format_bytes(free)} free, the snapshot needs at "
                                        f"least {format_bytes(needed)} (not exported)")
        self._disk_full = False

    @_one_at_a_time
    def swap_out_sessions(self, session_ids: Iterable[str], *, reason: str = "explicit") -> dict[str, int]:
        """Swap the resident sessions ``session_ids`` out, in that order, as an LRU eviction does (the snapshot
        written, then the KV released with the close hook and a ``session_evicted`` event, ``swapped``, whose reason
        is ``reason``, the caller's word for why: ``explicit`` or ``run_stopped``), so that ``detach_snapshots``
        leaves them too to a later process: what the CLI does when a signal stops a rollout (``run_stopped``).
        Returns {session id: snapshot bytes} of those swapped out. A session stays resident when its snapshot does
        not fit in the swap space left (no other snapshot is dropped for it), when its export fails (an
        ``ArdiffWarning``), and when a stop or an error cut its last request or restore short: its state is no
        request's. Ids that are not resident are skipped; without a swap store nothing is done."""
        self._require_loaded()
        _require_reason("swap_out_sessions", reason)
        if isinstance(session_ids, (str, bytes)) or not isinstance(session_ids, Iterable):
            # a str is an iterable of one-letter ids: swap_out_sessions("robot-a") swapped nothing out, silently
            raise RequestTypeError(f"swap_out_sessions() takes an iterable of session ids, got {shown(session_ids)} "
                                   f"({type(session_ids).__name__})",
                                   hint=f"pass a list, even of one: swap_out_sessions([{shown(session_ids)}])"
                                   if isinstance(session_ids, str) else "pass a list of session ids")
        session_ids = list(session_ids)
        for session_id in session_ids:
            _require_session_id("swap_out_sessions", session_id)
        swapped: dict[str, int] = {}
        if self.swap is None:
            return swapped
        for session_id in session_ids:
            session = self._sessions.get(session_id)
            if session is None or not session.settled or session_id == WARMUP_SESSION_ID:
                continue
            written = self._evict(session_id, evicting=False, reason=reason)
            if written is not None:
                swapped[session_id] = written
        return swapped

    @_one_at_a_time
    def restore_session(self, session_id: str, *, num_requests: int | None = None) -> bool:
        """Admit ``session_id`` from its swap snapshot (which may evict, so swap out, the least recently used
        session), deleting the snapshot; False when it has none. A snapshot that cannot be restored (missing,
        unreadable or corrupt file; another geometry, dtype or pipeline record; not the ``num_requests`` requests
        the caller counts, when given) raises ``SwapRestoreError``: the
        snapshot is deleted and no part of the session stays resident. A ``StopRequested`` (such as
        the CLI's ``Interrupted``) or a ``KeyboardInterrupt`` meanwhile leaves it so too, and propagates as itself.
        A request for a swapped-out session (without ``reset``) restores it so first. A ``num_requests`` that is not
        a non-negative integer is a ``RequestError``, raised before the snapshot is touched."""
        self._require_loaded()
        _require_session_id("restore_session", session_id)
        count = None if num_requests is None else as_int(num_requests)
        if num_requests is not None and (count is None or count < 0):
            # a count of another type ('1' from a JSON file) was told apart from the snapshot's, which was deleted
            error = RequestError if count is not None else RequestTypeError  # -1, or another type
            raise error(f"restore_session(): num_requests must be a non-negative integer or None, got "
                        f"{shown(num_requests)} ({type(num_requests).__name__})",
                        hint="pass the number of requests the session had run (an int), or leave it out")
        if session_id == WARMUP_SESSION_ID:
            raise RequestError(f"session id {WARMUP_SESSION_ID!r} is reserved for warmup, which is never swapped",
                               hint="name a session that was evicted")
        if session_id in self._sessions or not self._has_snapshot(session_id):
            return False
        self._restore(session_id, num_requests)
        return True

    @_one_at_a_time
    def detach_snapshots(self) -> dict[str, str]:
        """Forget every swapped-out session but leave its snapshot file in ``swap_dir``: {session id: file name}.
        A runner of a later process with the same ``swap_dir`` takes one back with ``adopt_snapshot`` (the CLI's
        ``--resume`` does, instead of replaying the session's steps). The files are flushed to the disk first, so that
        a power loss after the caller records them cannot leave files whose data was lost. Resident sessions stay as
        they are. A snapshot whose write failed, or that the disk would not flush, is a ``swap_failed`` event, and
        not in the result."""
        if self.swap is None:
            return {}
        self.swap.flush()  # the write in flight ends first, outside the lock the views take
        with self._locked():
            kept = self.swap.detach()
        self._warn_about_failed_writes(warn=False)  # not rebuilt by this runner: nothing to warn about
        return kept

    @_one_at_a_time
    def adopt_snapshot(self, session_id: str, name: str) -> bool:
        """Take the snapshot file ``name`` that ``detach_snapshots`` of an earlier runner left in ``swap_dir`` as
        swapped-out session ``session_id``: its next request (or ``restore_session``) restores it. False when this
        runner does not swap, the session is resident, or the file is larger than the whole swap space (deleted
        then). What the file holds is checked when it is restored (``SwapRestoreError``, as for any snapshot)."""
        self._require_loaded()
        if not isinstance(session_id, str) or not session_id or session_id == WARMUP_SESSION_ID:
            raise RequestError(f"adopt_snapshot() takes a session id (a non-empty string, not "
                               f"{WARMUP_SESSION_ID!r}), got {shown(session_id)}", hint="name the detached session")
        if not isinstance(name, str) or not SNAPSHOT_FILE.fullmatch(name):
            raise RequestError(f"adopt_snapshot(): {shown(name)} is not the name of a swap snapshot file (32 hex "
                               "digits, then .safetensors, in swap_dir)",
                               hint="pass a file name that detach_snapshots() returned, as it returned it")
        if self.swap is None or session_id in self._sessions:
            return False
        self.swap.flush()  # the write in flight ends before the views' lock is taken: they must not wait for it
        with self._locked():
            try:
                return self.swap.adopt(session_id, name)
            except FileNotFoundError as exc:
                raise RequestError(f"adopt_snapshot(): no file {name} in {self.swap.directory}",
                                   hint="pass a file that detach_snapshots() left in this swap_dir") from exc
            except ValueError as exc:  # one of this store's own files
                raise RequestError(f"adopt_snapshot(): {exc}",
                                   hint="pass a file that detach_snapshots() of an earlier runner left") from exc
            finally:
                self._report_dropped(session_id)

    def _report_dropped(self, by_session_id: str) -> None:
        """A ``snapshot_dropped`` event for each snapshot the swap store deleted to make room for ``by_session_id``'s
        (written or adopted just now)."""
        dropped, self.swap.dropped = self.swap.dropped, []
        for session_id, nbytes in dropped:
            self._emit(SnapshotDropped(session_id=session_id, swap_bytes=nbytes, by_session_id=by_session_id))

    def _has_snapshot(self, session_id: str) -> bool:
        """Whether ``session_id`` has a swap snapshot; warns first about snapshots whose write failed meanwhile."""
        if self.swap is None:
            return False
        has = self.swap.has(session_id)
        self._warn_about_failed_writes()
        return has

    def _warn_about_failed_writes(self, *, warn: bool = True) -> None:
        """A ``swap_failed`` event and a warning for each snapshot whose background write failed: the eviction that
        started it had said it was swapped; its session is rebuilt as one evicted without a snapshot. ``warn=False``:
        their sessions are being closed or reset, so there is nothing to warn about; the event still says the
        snapshot was lost (summary.json must not count it as swapped out)."""
        failures, self.swap.failures = self.swap.failures, []
        for session_id, error in failures:
            self._swap_failed(session_id, error, background=True, warn=warn,
                              then="its snapshot is lost, so it is rebuilt as one evicted without a snapshot")

    def _swap_failed(self, session_id: str, error: BaseException, *, background: bool, then: str,
                     warn: bool = True) -> None:
        """A ``swap_failed`` event for every snapshot that could not be written; a warning for the first of each
        cause only: a swap folder made read-only or a full disk fails every later eviction alike, and a long run
        printed one identical warning per eviction."""
        self._emit(SwapFailed(session_id=session_id, error=f"{type(error).__name__}: {error}", background=background))
        if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            self._disk_full = True
        cause = (type(error).__name__, getattr(error, "errno", None))
        if not warn or cause in self._swap_causes_warned:
            return
        self._swap_causes_warned.add(cause)
        warnings.warn(f"cannot swap session {shown(session_id)} out to {self.swap.directory} "
                      f"({type(error).__name__}: {error}); {then} (later snapshots that fail alike are not warned "
                      "about: each is a swap_failed event, counted in summary.json's swap.swap_failed)",
                      ArdiffWarning, stacklevel=_caller_stacklevel())

    def _restore(self, session_id: str, expected: int | None = None) -> None:
        """``restore_session`` of a session that has a snapshot and is not resident (``expected``: its requests)."""
        start = time.perf_counter()
        path = self.swap.path_for(session_id)
        hint = "its history must be rebuilt (the CLI replays its earlier steps); the snapshot was deleted"
        try:
            tensors, metadata, nbytes = self.swap.read(session_id)
            kv, state, num_requests = decode_snapshot(tensors, metadata)
            if expected is not None and num_requests != expected:
                raise ValueError(f"it holds {plural(num_requests, 'request')}, not the {expected} expected")
            self.kv_cache.new_state(session_id).check_snapshot(kv)  # before anyone is evicted for it
        except BaseException as exc:  # noqa: BLE001 - any unreadable file is this one error; a stop is itself
            tensors = kv = _let_go(exc)  # a stop's too: Ctrl-C (no Exception) once the file was read kept its tensors
            if _is_stop(exc):  # the CLI's Interrupted, Ctrl-C, SIGTERM's SystemExit: not an unreadable file
                raise
            raise SwapRestoreError(f"cannot restore session {shown(session_id)} from {path}: "
                                   f"{type(exc).__name__}: {exc}", hint=hint) from exc
        finally:
            self.swap.discard(session_id, wait=False)  # read from memory if its write is in flight: no waiting
        with self._events_held():  # the eviction it may cause is delivered once it is admitted
            self._make_room(session_id)
            with self._locked():
                step = "its admission"
                try:  # from the admission on: a stop anywhere in it leaves no part of the session resident
                    session = self._admit(session_id)
                    step = "its KV"
                    session.state._restore(kv)
                    step = f"{type(self.pipeline).__name__}.import_ar_diffusion_session()"
                    self.pipeline.import_ar_diffusion_session(session_id, state)
                    step = "the runner's count of its requests"  # in the try: a stop must not leave it uncounted
                    session.num_requests = num_requests
                    session.view = self._snapshot(session_id, session)
                    session.settled = True
                except BaseException as exc:  # released whole, then raised as one error (a stop as itself)
                    if session_id in self._sessions:
                        self._release(session_id, reason="restore_failed", hook="close", error=exc)
                    tensors = kv = _let_go(exc)
                    if _is_stop(exc):
                        raise
                    raise SwapRestoreError(f"cannot restore session {shown(session_id)} from {path}: {step} "
                                           f"raised {type(exc).__name__}: {exc}", hint=hint) from exc
        self._emit(SessionRestored(session_id=session_id, swap_bytes=nbytes, seconds=time.perf_counter() - start))

    # ---------------------------------------------------------------- warmup
    @_one_at_a_time
    def warmup(self, schema: ObservationSchema | None = None) -> WarmupReport:
        """Run the pipeline's warmup requests under a reserved session; always release it. With ``schema`` (the
        pipeline's observation schema, which the engine gives), each request's inputs are checked against it and
        converted first, as a rollout step's are: a request unlike any step warms up another path than the steps take.
        """
        cache = self._require_loaded()
        if not isinstance(self.pipeline, SupportsARDiffusionWarmup):
            return WarmupReport(skipped=True)
        with self._locked():
            resident = [sid for sid in self._sessions if sid != WARMUP_SESSION_ID]
            assert self.capacity_plan is not None
            if len(resident) >= self.capacity_plan.session_capacity:
                # Its reserved session would evict one of them: warmup must never cost a user session.
                raise EngineStateError(
                    f"warmup needs a free session slot, and all {len(resident)} are taken: {shown(resident)}",
                    hint="warm up before serving, or free a slot first (runner.close_session(id))",
                )
        self._refuse_autocast(None)
        free_before = cache.allocator.num_free
        timings: list[tuple[str, str, float]] = []
        shapes: list[dict[str, list[int] | None]] = []
        start = time.perf_counter()
        # the close hooks of the warmup session (at its end, or a request's close_session), as close_session raises
        hook_errors: list[LifecycleHookError] = []
        provider = f"{type(self.pipeline).__name__}.ar_diffusion_warmup_requests()"
        where = provider  # what ran when something raised: the provider, or one of its requests
        went_on = committed = False  # a request went on with the session's history; a frame was committed
        rerun = False  # a request was run again on its session rebuilt from its export (_check_rerun): once a warmup
        last_export: tuple[bool, Any] = (False, None)  # _warmup_export after the last request: a rerun's snapshot
        failure: BaseException | None = None  # what the warmup raises, if anything: the failed close hooks' notes
        try:
            requests = self.pipeline.ar_diffusion_warmup_requests(WARMUP_SESSION_ID)
            if not isinstance(requests, Iterable):
                raise PipelineError(f"{provider} must return an iterable of ARDiffusionRequest, "
                                    f"got {type(requests).__name__}", hint=PIPELINE_HINT)
            for index, request in enumerate(requests):
                if not isinstance(request, ARDiffusionRequest):
                    raise PipelineError(f"{provider} yielded {type(request).__name__} as request {index}, "
                                        "expected an ARDiffusionRequest", hint=PIPELINE_HINT)
                where = f"warmup request {request.request_id!r} of {type(self.pipeline).__name__}"
                if request.session_id != WARMUP_SESSION_ID:
                    raise PipelineError(
                        f"warmup request {request.request_id!r} names session {request.session_id!r}, "
                        f"expected {WARMUP_SESSION_ID!r} (the session_id {provider} is given)",
                        hint=PIPELINE_HINT,
                    )
                if schema is not None:  # from here on, the request as the forward gets it
                    request = _as_a_step(schema, request, where, type(self.pipeline).__name__)
                _, reset, closes = request.check()  # as _execute routes it: its forward may rewrite extra_args
                with self._locked():
                    goes_on = WARMUP_SESSION_ID in self._sessions and not reset
                before = None  # (the session as a swap-out writes it, the request as run) before it ran
                if goes_on and not rerun and last_export[0]:
                    rerun, before = True, self._warmup_snapshot(request, last_export[1])
                t0 = time.perf_counter()
                latest = self.hook_errors[-1] if self.hook_errors else None
                output = self._execute(request, internal=True)
                if closes and self.hook_errors and self.hook_errors[-1] is not latest:
                    # its close_session released the warmup session, and the close hook failed: as below
                    hook_errors.append(self.hook_errors[-1])
                problem = output_problem(output)  # else warmup passed and every real step failed
                if problem is not None:
                    kind, what = problem
                    overflow = FLOAT16_OVERFLOW if self.dtype == torch.float16 else ""
                    raise PipelineError(f"{where}: {type(self.pipeline).__name__}.forward() returned {what}",
                                        hint=PIPELINE_HINT if kind != "non_finite" else DIVERGED_IN_WARMUP + overflow)
                shape = input_shapes(request.inputs)
                timings.append((request.request_id, describe_shape(shape), time.perf_counter() - t0))
                shapes.append(shape)
                where = provider
                frames = self._warmup_committed_frames()  # None: the request closed the session
                went_on |= goes_on and frames is not None
                committed |= bool(frames)
                last_export = self._warmup_export() if frames is not None else (False, None)
                if last_export[0]:
                    self._check_model_owned(_tensors_of(last_export[1]), "warming up")
                if before is not None:  # last: the counts above are of the request as it ran, not of its rerun
                    hook_errors += self._check_rerun(output, *before)
            if last_export[0] and not rerun:  # no rerun encoded an export: one request, or each reset its session
                self._check_encoding(last_export[1])
            if went_on and not committed:
                self._warn_nothing_committed(len(timings))
        except BaseException as exc:
            # The caller gives warmup no input: its own requests refused as malformed are the pipeline's mistake (an
            # ObservationError was exit 2 with a hint about episode files).
            failure = as_pipeline_error(where, exc, also=(ObservationError, RequestError)) or exc
            if failure is exc:
                raise
            raise failure from exc
        finally:
            with self._locked():
                if WARMUP_SESSION_ID in self._sessions:
                    hook_errors += self._release(WARMUP_SESSION_ID, reason="warmup_ended", hook="close")
            if failure is not None:  # the first error is the one raised; a close hook failing too is its note, as
                for hook_error in hook_errors:  # a failed forward's is (it was dropped without a word)
                    failure.add_note(str(hook_error))
        seconds = time.perf_counter() - start
        restored = cache.allocator.num_free == free_before
        self._emit(WarmupFinished(num_requests=len(timings), seconds=seconds, restored=restored))
        if not restored:
            raise RuntimeError(
                f"warmup leaked KV pages: {free_before} free before, {cache.allocator.num_free} after"
            )
        if hook_errors:  # the pool is restored, but the pipeline's own cleanup failed: its sessions would too
            first, *others = hook_errors  # each close of the session that failed: the first raised, the others its
            for other in others:  # notes, as on a failed request's error (a note: line each after its Error line)
                first.add_note(str(other))
            raise first
        return WarmupReport(skipped=False, timings=timings, restored=restored, seconds=seconds, input_shapes=shapes)

    def _warmup_committed_frames(self) -> int | None:
        """The frames the warmup session has committed, over its branches; None once a request closed it."""
        with self._locked():
            session = self._sessions.get(WARMUP_SESSION_ID)
        if session is None:
            return None
        state = session.state
        return sum(state._adapter(branch).num_committed_frames for branch in state.spec.branch_names)

    def _warmup_export(self) -> tuple[bool, Any]:
        """(True, the warmup session's export) when it is what a swap-out can write; (False, None) when the pipeline
        cannot export, or its export raised or held a value a snapshot cannot keep (a tuple, a numpy array): one
        warning (``_export_failed``)."""
        if self._export_warned or not isinstance(self.pipeline, SupportsARDiffusionSwap):
            return False, None
        try:
            state = self.pipeline.export_ar_diffusion_session(WARMUP_SESSION_ID)
            check_exported(state, self._warmup_export_name())
        except Exception as exc:  # noqa: BLE001 - the check is advisory; a stop propagates
            self._export_failed(exc)
            return False, None
        return True, state

    def _warmup_export_name(self) -> str:
        return f"{type(self.pipeline).__name__}.export_ar_diffusion_session({WARMUP_SESSION_ID!r})"

    def _export_failed(self, exc: Exception) -> None:
        """Warn, once, at warmup, of an export every swap-out of the run would fail alike (each evicted session
        without a snapshot, replayed); those swap-outs are not warned about again. A stop propagates."""
        if _is_stop(exc):
            raise exc
        where = self._warmup_export_name()
        self._export_warned = True
        self._swap_causes_warned.add((type(exc).__name__, getattr(exc, "errno", None)))
        said = str(exc) if str(exc).startswith(where) else f"{where} raised {type(exc).__name__}: {exc}"
        warnings.warn(f"{said}: swapping its sessions out will fail alike (each evicted session is then replayed "
                      "from its first step, and --resume replays a stopped run's sessions; the swap-outs that "
                      "fail so are not warned about again) (README, 'Adding a pipeline')",
                      ArdiffWarning, stacklevel=_caller_stacklevel())

    def _check_encoding(self, state: Any) -> None:
        """Copy the tensors of ``state``, the warmup session's export after its last request, to the host as a
        swap-out does, when no rerun has (``_warmup_snapshot``): ``check_exported`` does not copy, and a tensor that
        cannot be (on the meta device) failed the run's first swap-out instead of the warmup (``_export_failed``).
        The copy costs the bytes of the export's tensors, once; not its session's KV."""
        try:
            encode_exported(state, self._warmup_export_name())
        except Exception as exc:  # noqa: BLE001 - as in _warmup_export
            self._export_failed(exc)

    def _warmup_snapshot(self, request: ARDiffusionRequest,
                         state: Any) -> tuple[tuple[Any, Any], ARDiffusionRequest] | None:
        """The warmup session as a swap-out writes it (tensors, and metadata as its file gives it back), from
        ``state``, its export after the last request (nothing ran since), and a copy of ``request`` for a rerun (a
        forward may change its inputs); None when the export cannot be written (a tensor that cannot be copied to the
        host: ``_export_failed``)."""
        session = self._sessions[WARMUP_SESSION_ID]
        try:
            tensors, metadata = encode_snapshot(session.state._export(), state, session.num_requests,
                                                where=self._warmup_export_name())
        except Exception as exc:  # noqa: BLE001 - as in _warmup_export
            self._export_failed(exc)
            return None
        try:
            again = copy.deepcopy(request)
        except Exception:  # noqa: BLE001 - inputs that cannot be copied: the request itself
            again = request
        return (tensors, json.loads(json.dumps(metadata))), again

    def _check_rerun(self, output: Any, snapshot: tuple[Any, Any],
                     request: ARDiffusionRequest) -> list[LifecycleHookError]:
        """Rebuild the warmup session from ``snapshot`` (taken before ``request`` ran) as a swap restore does (the
        close hook, a fresh session, its KV restored and its export imported), run ``request`` again, and warn
        unless it returns ``output`` again bit for bit: replayed, swapped and resumed sessions rest on that. The
        events of all this are dropped: it is one request to subscribers (a hook of the rebuilt session that fails
        meanwhile is a warning instead). The session is left as the rerun left it, or released when rebuilding or
        rerunning failed (a warning too; a stop propagates once it is released). Returned: the failure of the
        session's own close hook, which closes it before it is rebuilt: no rerun is checked then, and it is the
        warmup's to raise, as the close at its end (a close hook that always fails was a warning, and the warmup
        passed, when a rerun's close came first); subscribers are told of that close as it went."""
        name = type(self.pipeline).__name__
        expected = host_arrays(output)
        with self._locked():
            closed = WARMUP_SESSION_ID not in self._sessions  # by the request: subscribers were told so
        step, failure = f"{name}.close_ar_diffusion_session()", None
        own_close: list[LifecycleHookError] = []  # the session's own close hook failed
        self._muted += 1
        try:
            with self._locked():
                if WARMUP_SESSION_ID in self._sessions:  # not when the request closed it
                    own_close = self._release(WARMUP_SESSION_ID, reason="warmup_ended", hook="close")
                    if own_close:
                        raise own_close[0]
                kv, state, num_requests = decode_snapshot(*snapshot)
                step = "its KV"
                session = self._admit(WARMUP_SESSION_ID)
                session.state._restore(kv)
                step = f"{name}.import_ar_diffusion_session()"
                self.pipeline.import_ar_diffusion_session(WARMUP_SESSION_ID, state)
                session.num_requests = num_requests
                session.view = self._snapshot(WARMUP_SESSION_ID, session)
                session.settled = True
            step = "the request run again"
            again = self._execute(request, internal=True)
        except BaseException as exc:  # a stop too: the session goes first, as subscribers are told
            failure = exc
        finally:
            self._muted -= 1
        unheard, self._muted_hook_errors = self._muted_hook_errors, []
        if own_close and failure is own_close[0]:  # the session is gone, released as the warmup's end releases it
            with self._locked():
                self._emit(HookFailed(session_id=WARMUP_SESSION_ID, hook="close_ar_diffusion_session",
                                      error=str(failure.__cause__)))
                self._emit(SessionClosed(session_id=WARMUP_SESSION_ID, reason="warmup_ended"))
            return own_close
        if failure is not None:
            self._drop_rebuilt(failure, closed=closed)
            unheard += self._muted_hook_errors
            self._muted_hook_errors = []
        for hook_error in unheard:  # a hook of the rebuilt session that failed: its hook_failed event was dropped
            if hook_error is not failure:  # not the close that came first: said below, as what failed
                warnings.warn(f"{name}: warmup request {shown(request.request_id)}, run again on its session rebuilt "
                              f"from the session's export as a swapped-out session is restored: {hook_error} "
                              "(README, 'Adding a pipeline')", ArdiffWarning, stacklevel=_caller_stacklevel())
        # Said so that it holds with no swap space too (--swap-space 0, `ardiff warmup`): nothing is swapped then,
        # and every evicted session is replayed, which only the forward's own noise can make differ.
        if failure is not None:
            if _is_stop(failure) or not isinstance(failure, Exception):
                raise failure
            warnings.warn(f"{name}: warmup request {shown(request.request_id)} could not run again on its session "
                          f"rebuilt from the session's export, as a swapped-out session is restored: {step} raised "
                          f"{type(failure).__name__}: {failure}; swapped-out sessions will fail as they are restored "
                          "or at their next step; with no swap space none is, and evicted sessions are replayed "
                          "(README, 'Adding a pipeline')", ArdiffWarning, stacklevel=_caller_stacklevel())
            return []
        differences = output_differences(expected, again)
        if differences:
            others = f" (and {plural(len(differences) - 1, 'other output')} too)" if len(differences) > 1 else ""
            warnings.warn(f"{name}: warmup request {shown(request.request_id)} returned other outputs when run again "
                          f"on its session rebuilt from the session's export, as a swapped-out session is restored: "
                          f"{differences[0][1]}{others}; swapped-out and resumed sessions will not reproduce the run, "
                          "nor will replayed ones (with no swap space, every evicted session is) if the forward's "
                          "noise is what differs. Draw the forward's noise from a generator seeded from the request or "
                          "its session (never torch's global generator or the clock), and export all the state a "
                          "session keeps (README, 'Adding a pipeline')", ArdiffWarning, stacklevel=_caller_stacklevel())
        return []

    def _drop_rebuilt(self, failure: BaseException, *, closed: bool) -> None:
        """Release the warmup session a failed ``_check_rerun`` rebuilt, telling subscribers it went as they saw it:
        closed, unless the request had closed it already (``closed``: they were told then, and a second
        ``session_closed`` counted one session twice)."""
        with self._locked():
            self._muted += closed
            try:
                if WARMUP_SESSION_ID in self._sessions:  # imported half way: nobody's state
                    self._release(WARMUP_SESSION_ID, reason="restore_failed", hook="close", error=failure)
                elif not closed:  # released while muted (a failed rerun, a close hook of the rebuilt session)
                    self._emit(SessionClosed(session_id=WARMUP_SESSION_ID, reason="restore_failed",
                                             error=repr(failure)))
            finally:
                self._muted -= closed

    def _warn_nothing_committed(self, num_requests: int) -> None:
        """A warmup whose forwards committed no frame, though a request went on with its session's history: a model
        that never ends a block with a commit pass keeps no history, and every step attends to its own block alone,
        silently (a spec's window then costs only memory). Only then: a pipeline may commit a block at the start of
        the next request of its session, as DreamZero does, so one request, or requests that each reset the session
        (a fresh episode), tell nothing."""
        warnings.warn(f"{type(self.pipeline).__name__}: its {plural(num_requests, 'warmup request')} committed no "
                      "frame to the KV cache: if its forwards never commit, its sessions keep no history and each "
                      "step attends to its own block alone; end each block with get_kv_caches(branch, seq_len, "
                      "commit_current=True) and state.commit(branch) (README, 'Adding a pipeline')",
                      ArdiffWarning, stacklevel=2)

    # ----------------------------------------------------------------- views
    def _snapshot(self, session_id: str, session: _Session) -> SessionView:
        state = session.state
        adapters = [state._adapter(name) for name in state.spec.branch_names]  # unbound: adapter() refuses it
        return SessionView(
            session_id=session_id,
            pages_per_branch={a.branch: len(a.page_ids) for a in adapters},
            committed_frames={a.branch: a.num_committed_frames for a in adapters},
            cross_attention_bytes=state.cross_attention_bytes,
            num_requests=session.num_requests,
            last_latency_s=session.last_latency_s,
            admitted_at=session.admitted_at,
        )

    def sessions(self) -> list[SessionView]:
        """Resident sessions, least recently used first. Safe from any thread."""
        with self._lock:
            return [s.view for s in self._sessions.values() if s.view is not None]

    @property
    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def pool_usage(self) -> PoolUsage:
        """Pages of the pool, used and free (after ``close()``: its final counts, if it was loaded). Safe from any
        thread."""
        cache = self.kv_cache if self._closed and self.kv_cache is not None else self._require_loaded()
        allocator = cache.allocator
        num_free = allocator.num_free  # read once: a request may run on another thread
        swap = self.swap
        return PoolUsage(
            num_pages=allocator.num_allocatable,
            num_free=num_free,
            num_used=allocator.num_allocatable - num_free,
            bytes_per_page=self.capacity_plan.bytes_per_page,
            num_swapped=0 if swap is None else swap.num_snapshots,
            swapped_bytes=0 if swap is None else swap.nbytes,
            swap_budget_bytes=0 if swap is None else swap.budget_bytes,
        )
