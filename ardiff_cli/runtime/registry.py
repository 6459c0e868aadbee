"""The pipeline registry: names a config may use, resolved lazily. No torch import.

A pipeline is an *entry module* whose import is cheap (no torch) and which
exposes ``Config`` (``from_dict``, ``kv_cache_spec``), ``observation_schema()``
and ``pipeline_class()`` (the one place that imports the model code).

Built-ins are listed here; other packages add theirs through the
``ardiff.pipelines`` entry-point group (``name = "package.module"``). A config
can only name registered pipelines: importing any other module takes an
explicit ``module`` path from the command line (``resolve_entry_module``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ardiff_cli.runtime.errors import ConfigError, did_you_mean

BUILTIN_PIPELINES = {
    "dreamzero": "pipelines.dreamzero",
    "causal_world": "pipelines.causal_world",
}
ENTRY_POINT_GROUP = "ardiff.pipelines"


@dataclass(frozen=True)
class PipelineEntry:
    name: str
    module: ModuleType

    @property
    def config_class(self) -> Any:
        return self.module.Config

    def observation_schema(self) -> Any:
        return self.module.observation_schema()

    def pipeline_class(self) -> type:
        """The pipeline class; this imports torch and the model code."""
        return self.module.pipeline_class()


def registered_pipelines() -> dict[str, str]:
    """Pipeline name -> entry module path, built-ins first."""
    names = dict(BUILTIN_PIPELINES)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        names.setdefault(ep.name, ep.value)
    return names


def resolve_entry_module(module_path: str, *, name: str, where: str) -> PipelineEntry:
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise ConfigError(f"{where}: pipeline {name!r}: cannot import {module_path!r}: {exc}") from None
    missing = [attr for attr in ("Config", "observation_schema", "pipeline_class") if not hasattr(module, attr)]
    if missing:
        raise ConfigError(f"{where}: pipeline module {module_path!r} lacks {', '.join(missing)}")
    return PipelineEntry(name=name, module=module)


def resolve_pipeline(name: str, *, where: str = "config") -> PipelineEntry:
    registry = registered_pipelines()
    if name not in registry:
        raise ConfigError(
            f"{where}: field 'pipeline': unknown pipeline {name!r}{did_you_mean(name, registry)}",
            hint=f"registered pipelines: {', '.join(sorted(registry))}",
        )
    return resolve_entry_module(registry[name], name=name, where=where)
