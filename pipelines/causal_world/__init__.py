"""Single-branch causal DMD world model (torch-free entry module).

Request inputs: ``prompt`` (str), optional ``conditioning`` (cond_dim,) float32
(an action or camera vector for the block), optional ``seed`` (int). Output:
``{"latents": (C, frames_per_block, h, w)}``; ``decode_latents`` gives RGB.
"""

from __future__ import annotations

from pipelines.causal_world.config import PRESETS, SCHEMA, Config, observation_schema

__all__ = ["Config", "PRESETS", "SCHEMA", "observation_schema", "pipeline_class"]


def pipeline_class() -> type:
    """``CausalWorldPipeline`` (imports torch and the model code)."""
    from pipelines.causal_world.pipeline import CausalWorldPipeline

    return CausalWorldPipeline
