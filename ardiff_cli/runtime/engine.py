"""ARDiffusionEngine: config -> pipeline -> runner, and request execution."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ardiff_cli.runtime.capacity import CapacityPlan
from ardiff_cli.runtime.config import EngineConfig, load_config
from ardiff_cli.runtime.errors import (
    KV_POOLS_PHASE,
    WEIGHTS_PHASE,
    ArdiffWarning,
    BudgetBeyondDeviceError,
    CheckpointError,
    ConfigError,
    EngineStateError,
    PipelineError,
    as_pipeline_error,
    plural,
    running_out_of_memory_names,
    shown,
)
from ardiff_cli.runtime.events import RuntimeEvent
from ardiff_cli.runtime.kv.cache import KV_DTYPES
from ardiff_cli.runtime.registry import called_without_instance
from ardiff_cli.runtime.request import ARDiffusionRequest, require_request
from ardiff_cli.runtime.runner import (ARDiffusionModelRunner, PipelineContractError, WarmupReport, _is_stop,
                                       _once, _require_reason, require_subscriber)
from ardiff_cli.runtime.swap import check_swap_arguments


def resolve_device(name: str) -> torch.device:
    """``auto`` = CUDA when available, else CPU; asking for CUDA without it is a ``ConfigError``.

    A CUDA device comes back indexed (``cuda`` -> ``cuda:0``, the current device), as tensors
    report it, so it compares equal to theirs and run.json records which GPU ran.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available", hint="use --device cpu or auto")
    count = torch.cuda.device_count()
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= count:
        raise ConfigError(f"device {name!r} requested but only {plural(count, 'CUDA device')} visible "
                          f"(cuda:0 .. cuda:{count - 1})", hint="check CUDA_VISIBLE_DEVICES, or use --device cuda")
    return device


def pipeline_class_of(entry: Any) -> Any:
    """``entry.pipeline_class()``, the class whose ``from_config`` builds the pipeline. Its failure is the pipeline's
    (an entry module imports the model code: a dependency it lacks fails here), and so is a result with no
    ``from_config`` (``None``: it forgot to return the class), not "None.from_config() failed: ...". The load and
    rollout's checks before ``--out`` is made both call it."""
    try:
        pipeline_class = entry.pipeline_class()
    except Exception as exc:
        error = as_pipeline_error(f"pipeline {entry.name!r}: pipeline_class()", exc)
        if error is None:
            raise
        raise error from exc
    if not callable(getattr(pipeline_class, "from_config", None)):
        raise PipelineContractError(
            f"pipeline {entry.name!r}: pipeline_class() returned {shown(pipeline_class)}, expected the pipeline class "
            "(with from_config())", hint="end pipeline_class() with `return MyPipeline`")
    return pipeline_class


def _not_a_pipeline(pipeline_class: Any, built: Any) -> PipelineError | None:
    """The error for what ``from_config`` returned when it is no pipeline (``None``: it forgot to return one; the class
    itself), else None. The runner named the returned object's type instead ("NoneType does not implement ...")."""
    duck = (isinstance(pipeline_class, type) and isinstance(built, pipeline_class)
            or callable(getattr(built, "forward", None)))
    if not isinstance(built, type) and duck:
        return None
    name = getattr(pipeline_class, "__qualname__", pipeline_class)
    got = f"the class {built.__qualname__}" if isinstance(built, type) else type(built).__name__
    return PipelineContractError(f"{name}.from_config() returned {got}, expected the pipeline (a {name})",
                                 hint="end from_config with `return cls(...)`: the built pipeline")


class ARDiffusionEngine:
    """Builds a pipeline from a config and runs requests through ``ARDiffusionModelRunner``."""

    def __init__(self, config: EngineConfig, *, swap_dir: str | Path | None = None,
                 swap_space: int | str | None = None) -> None:
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"ARDiffusionEngine() takes an EngineConfig, got {shown(config)}",
                              hint="for a YAML path, a built-in config name or a dict, use "
                              "ARDiffusionEngine.from_config(source, **runtime_overrides)")
        if config.checkpoint_missing:  # else load() failed in the pipeline's own loader, naming no plan_only
            raise CheckpointError(f"ARDiffusionEngine(): {config.source}: field 'checkpoint': "
                                  f"{config.checkpoint_missing}: the config was loaded with plan_only=True, for a "
                                  "capacity plan, which reads no weights; an engine loads them",
                                  hint="put the checkpoint there, then load the config again without plan_only "
                                       "(load_config(source))")
        self.config = config  # validated config, runtime overrides applied
        self._pipeline: Any = None  # built by load(), dropped by close(): the ``pipeline`` property
        self._runner: ARDiffusionModelRunner | None = None  # built by load(), kept closed by close(): ``runner``
        self.device: torch.device | None = None  # resolved by load()
        self._subscribers: list[Callable[[RuntimeEvent], None]] = []  # attached to the runner at load
        # Swap LRU-evicted sessions to files in swap_dir instead of dropping them (ARDiffusionModelRunner).
        self.swap_dir, self.swap_space = check_swap_arguments(swap_dir, swap_space, where="ARDiffusionEngine()")

    @classmethod
    def from_config(cls, source: str | Path | dict[str, Any] | EngineConfig | None = None, *,
                    swap_dir: str | Path | None = None, swap_space: int | str | None = None, **overrides: Any):
        """An engine for a config file, built-in name or dict; ``overrides`` are runtime settings. ``swap_dir``
        (default: none) turns on swapping evicted sessions to disk, ``swap_space`` bytes at most (default: the
        KV budget, at most half the free disk)."""
        config = source if isinstance(source, EngineConfig) else load_config(source)
        return cls(config.with_runtime(where="ARDiffusionEngine.from_config()", **overrides), swap_dir=swap_dir,
                   swap_space=swap_space)

    def subscribe(self, callback: Callable[[RuntimeEvent], None]) -> Callable[[], None]:
        """Receive runtime events (including the capacity plan at load) in order; returns a function that
        unsubscribes ``callback`` (once: calling it again does nothing)."""
        require_subscriber(callback, "ARDiffusionEngine.subscribe()")
        self._subscribers.append(callback)
        if self._runner is not None:
            self._runner.subscribe(callback)

        def unsubscribe() -> None:
            self._subscribers.remove(callback)
            if self._runner is not None:
                self._runner._unsubscribe(callback)

        return _once(unsubscribe)

    def load(self) -> CapacityPlan:
        """Build the pipeline and its runner: weights, capacity plan, pools. Again after ``close()``, not before.
        When it fails (a ``CapacityError``, say), nothing stays loaded: ``load()`` may be tried again."""
        if self.loaded:
            raise EngineStateError("this ARDiffusionEngine is already loaded",
                                   hint="close() it first to load it again (its sessions are closed)")
        runtime = self.config.runtime
        self.device = resolve_device(runtime.device)
        dtype = KV_DTYPES[runtime.dtype]  # the model computes in its KV dtype
        if runtime.num_threads is not None:
            # Process-wide: the engine owns this process's compute. Small models lose to
            # intra-op parallelism, badly so when other processes share the cores.
            torch.set_num_threads(runtime.num_threads)
        with running_out_of_memory_names(f"importing pipeline {self.config.pipeline_name!r}"):
            pipeline_class = pipeline_class_of(self.config.entry)
        given = dict(device=self.device, dtype=dtype, checkpoint=self.config.checkpoint)
        try:
            with running_out_of_memory_names(WEIGHTS_PHASE):
                self._pipeline = pipeline_class.from_config(self.config.model, **given)
        except Exception as exc:
            # A checkpoint or config the user can fix, or memory, is named as such already.
            error = as_pipeline_error(f"{getattr(pipeline_class, '__qualname__', pipeline_class)}.from_config()", exc)
            if error is None:
                raise
            error.hint = called_without_instance(pipeline_class, "from_config", exc, self.config.model,
                                                 **given) or error.hint
            raise error from exc
        problem = _not_a_pipeline(pipeline_class, self._pipeline)  # no local holds it: a kept error keeps no weights
        if problem is not None:
            self._pipeline = None
            raise problem
        self._runner = ARDiffusionModelRunner(
            self._pipeline,
            device=self.device,
            dtype=dtype,
            memory_budget=runtime.memory_budget,
            gpu_memory_fraction=runtime.gpu_memory_fraction,
            session_capacity=runtime.session_capacity,
            attention_backend=runtime.attention_backend,
            swap_dir=self.swap_dir,
            swap_space=self.swap_space,
        )
        for callback in self._subscribers:
            self._runner.subscribe(callback)
        try:
            with running_out_of_memory_names(KV_POOLS_PHASE):
                try:
                    plan = self._runner.load()
                except BudgetBeyondDeviceError as exc:  # the runner's hint names its own arguments, not the engine's
                    exc.hint = ("lower the config's runtime.memory_budget or runtime.session_capacity (or "
                                "ARDiffusionEngine.from_config()'s memory_budget= or session_capacity=), or set "
                                "memory_budget to None to plan with the free memory; "
                                "ardiff_cli.runtime.plan_capacity() plans for any amount")
                    raise
            self._check_spec(self._runner.spec)
            return plan
        except BaseException:
            # Not loaded: the weights (and any pool) go back now. Held, a server retrying load() until memory
            # frees up planned each try with one more copy of the model resident, and failed again.
            runner, self._runner, self._pipeline = self._runner, None, None
            runner.close()
            raise

    def _check_spec(self, spec: Any) -> None:
        """The loaded pipeline's KV spec must be its config's (``Config.kv_cache_spec()``): ``inspect-capacity`` plans
        from the config alone, and said one plan while load allocated another."""
        expected = self.config.kv_cache_spec()
        differ = [f"{f.name} {shown(getattr(spec, f.name))} (the config's {shown(getattr(expected, f.name))})"
                  for f in dataclasses.fields(expected) if getattr(spec, f.name) != getattr(expected, f.name)]
        if differ:
            raise PipelineError(
                f"{type(self._pipeline).__name__}.ar_diffusion_kv_cache_spec() differs from its "
                f"{type(self.config.model).__qualname__}.kv_cache_spec(): {'; '.join(differ)}",
                hint="build both from the same config fields, so that inspect-capacity plans what load allocates")

    @property
    def loaded(self) -> bool:
        """True from a successful ``load()`` until ``close()``: requests run."""
        runner = self._runner
        return runner is not None and runner.kv_cache is not None and not runner.closed

    @property
    def runner(self) -> ARDiffusionModelRunner:
        """The ``ARDiffusionModelRunner`` that ``load()`` built (sessions, pool usage, swap). After ``close()``, the
        closed runner: its views keep their final values, its requests raise ``EngineStateError``. Before
        ``load()`` there is none: an ``EngineStateError``."""
        return self._require_runner("runner")

    @property
    def pipeline(self) -> Any:
        """The pipeline that ``load()`` built (weights included); ``EngineStateError`` before ``load()`` and after
        ``close()``, which releases it."""
        self._require_runner("pipeline")
        if self._pipeline is None:
            raise EngineStateError("ARDiffusionEngine.pipeline: the engine is closed, and its pipeline (weights "
                                   "included) was released", hint="load the engine again (engine.load())")
        return self._pipeline

    def _require_runner(self, what: str) -> ARDiffusionModelRunner:
        if self._runner is None:
            raise EngineStateError(f"ARDiffusionEngine.{what}: the engine is not loaded, ARDiffusionEngine.load() "
                                   "must run first", hint="call engine.load() first")
        return self._runner

    def warmup(self) -> WarmupReport:
        """Run the pipeline's warmup requests (``ARDiffusionModelRunner.warmup``), each checked against the
        config's observation schema as a rollout step is."""
        runner = self._require_runner("warmup()")
        schema = self.config.observation_schema()
        with running_out_of_memory_names("running the warmup requests"):
            return runner.warmup(schema)

    def execute(self, request: ARDiffusionRequest) -> Any:
        """Run ``request`` on its session (``ARDiffusionModelRunner.execute_model``); the pipeline's output."""
        runner = self._require_runner("execute()")
        return runner.execute_model(require_request(request, "ARDiffusionEngine.execute()"))

    def close(self, *, reason: str = "explicit") -> None:
        """Close every session (close hooks run; their errors are raised after all are released), then release the
        KV pools and the pipeline's weights at once, whatever still references the engine. Requests then raise
        ``EngineStateError`` until ``load()`` runs again; a second ``close()`` does nothing. ``reason``: the
        sessions' ``session_closed`` events' (``ARDiffusionModelRunner.close``: ``explicit``, ``run_stopped`` or
        ``run_failed``)."""
        _require_reason("close", reason)  # before the pipeline is dropped: a refused call changes nothing
        if self._runner is not None:
            # Dropped first: the runner holds the last reference, so the weights are freed before it empties torch's
            # CUDA cache. Dropped after, they stayed in that cache, and the next engine planned without them.
            self._pipeline = None
            errors = self._runner.close(reason=reason)
            if errors:
                raise errors[0]

    def __enter__(self) -> ARDiffusionEngine:
        """``with ARDiffusionEngine.from_config(...) as engine:``: the block loads it (``engine.load()``, after any
        ``subscribe``), and its end closes it, as ``close()`` does, whatever ended the block."""
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: Any) -> None:
        """``close()``, its reason what ended the block: ``explicit`` its end, ``run_stopped`` a stop as the runner
        tells one (``KeyboardInterrupt``, ``SystemExit``, any other ``BaseException`` that is no ``Exception``, the
        CLI's ``StopRequested``), ``run_failed`` any other exception (it said ``explicit`` of those too). An
        exception that ended the block propagates as it is: an error of ``close()`` (a failing close hook) is then an
        ``ArdiffWarning``; without one it is raised, as ``close()`` raises it."""
        if exc is None:
            self.close()
            return
        try:
            self.close(reason="run_stopped" if _is_stop(exc) else "run_failed")
        except Exception as error:  # noqa: BLE001 - the block's own exception is the one the caller must see
            warnings.warn(f"ARDiffusionEngine closed at the end of a `with` block that raised "
                          f"{type(exc).__name__}, and close() failed too: {type(error).__name__}: {error}",
                          ArdiffWarning, stacklevel=2)
