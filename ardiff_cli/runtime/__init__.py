"""The model-neutral AR-Diffusion runtime.

Names are exported lazily (PEP 562): ``from ardiff_cli.runtime import plan_capacity``
does not import torch, so the CLI starts fast; the KV core, runner and engine
import it when first used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ARDiffusionKVBranchSpec": "capability",
    "ARDiffusionCrossAttentionKVSpec": "capability",
    "ARDiffusionKVCacheSpec": "capability",
    "SupportsARDiffusionPipeline": "capability",
    "SupportsARDiffusionWarmup": "capability",
    "SupportsARDiffusionSwap": "capability",
    "SupportsARDiffusionRequestCheck": "capability",
    "CapacityPlan": "capacity",
    "plan_capacity": "capacity",
    "ARDiffusionRequest": "request",
    "DEFAULT_SESSION_ID": "request",
    "ObservationField": "observation",
    "ObservationSchema": "observation",
    "validate_observation": "observation",
    "ARDiffusionKVCache": "kv.cache",
    "ARDiffusionKVState": "kv.state",
    "ARDiffusionLayerContext": "kv.attention",
    "BranchAdapter": "kv.state",
    "KVCacheExhaustedError": "kv.allocator",
    "ARDiffusionModelRunner": "runner",
    "LifecycleHookError": "runner",
    "ArdiffError": "errors",
    "ArdiffWarning": "errors",
    "ConfigError": "errors",
    "ObservationError": "errors",
    "CapacityError": "errors",
    "PipelineError": "errors",
    "RequestError": "errors",
    "RequestTypeError": "errors",
    "RequestModeError": "errors",
    "SessionNotResident": "errors",
    "EngineStateError": "errors",
    "SwapRestoreError": "errors",
    "StopRequested": "errors",
    "SessionView": "runner",
    "PoolUsage": "runner",
    "WarmupReport": "runner",
    "ARDiffusionEngine": "engine",
    "EngineConfig": "config",
    "load_config": "config",
    "RuntimeEvent": "events",
    "CapacityPlanned": "events",
    "SessionAdmitted": "events",
    "SessionEvicted": "events",
    "SessionRestored": "events",
    "SessionReset": "events",
    "SessionClosed": "events",
    "RequestFinished": "events",
    "HookFailed": "events",
    "SnapshotDropped": "events",
    "SwapFailed": "events",
    "WarmupFinished": "events",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
