"""DreamZero-style world-action model (torch-free entry module).

``Config`` and ``observation_schema()`` need no torch, so ``ardiff inspect-capacity``
and observation validation stay fast; ``pipeline_class()`` imports the model.
"""

from __future__ import annotations

from pipelines.dreamzero.config import PRESETS, SCHEMA, Config, observation_schema

__all__ = ["Config", "PRESETS", "SCHEMA", "observation_schema", "pipeline_class"]


def pipeline_class() -> type:
    """``DreamZeroPipeline`` (imports torch and the model code)."""
    from pipelines.dreamzero.pipeline import DreamZeroPipeline

    return DreamZeroPipeline
