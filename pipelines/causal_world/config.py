"""Causal world model config, presets and KV spec. No torch import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ardiff_cli.runtime.capability import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
)
from ardiff_cli.runtime.observation import ObservationField, ObservationSchema
from pipelines.config import BackboneConfig, config_from_dict, derive, require


@dataclass(frozen=True)
class Config(BackboneConfig):
    """A single-branch causal DMD world model (Self-Forcing / LingBot style). Defaults are the ``tiny`` preset.

    Every request generates one block of ``frames_per_block`` latent frames with
    a few-step schedule, then commits it (a pass at timestep 0) behind
    ``sink_frames`` + a sliding ``window_frames``.
    """

    # -- KV retention, in latent frames
    frames_per_block: int = 3  # latent frames generated and committed per request
    window_frames: int = 6  # sliding window after the sink
    sink_frames: int = 3  # the first block stays visible forever (attention sink)
    session_capacity: int = 4
    # -- per-block conditioning (action / camera), one scratch token; 0 disables it
    cond_dim: int = 8
    # -- sampler
    denoising_timesteps: tuple[int, ...] = (1000, 750, 500, 250)  # DMD few-step schedule, before the shift
    timestep_shift: float = 5.0  # Wan's flow shift applied to the schedule

    # -- derived
    num_registers: int = field(init=False)  # conditioning tokens per block: 1 when cond_dim > 0

    WEIGHT_FIELDS: ClassVar[tuple[str, ...]] = (
        "dim", "ffn_dim", "freq_dim", "num_heads", "num_layers", "qk_norm", "cross_attn_norm", "latent_channels",
        "patch_size", "vae_stride", "temporal_stride", "text_dim", "text_len", "cond_dim", "seed",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.cond_dim >= 0, "cond_dim", "a non-negative integer (0 disables conditioning)", self.cond_dim)
        steps = self.denoising_timesteps
        require(len(steps) >= 1 and all(0 < t <= 1000 for t in steps)
                and all(a > b for a, b in zip(steps, steps[1:])), "denoising_timesteps",
                "a decreasing list of timesteps in (0, 1000]", list(steps))
        require(self.timestep_shift > 0, "timestep_shift", "a positive number", self.timestep_shift)
        derive(self, "num_registers", 1 if self.cond_dim else 0)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str) -> Config:
        return config_from_dict(cls, data, where=where, presets=PRESETS)

    def observation_schema(self) -> ObservationSchema:
        """The module schema made exact for this config: conditioning of length ``cond_dim``, or none."""
        if not self.cond_dim:
            return ObservationSchema(fields=(), prompt_key=SCHEMA.prompt_key, prompt_aliases=SCHEMA.prompt_aliases)
        (cond,) = SCHEMA.fields
        exact = ObservationField(cond.name, cond.dtype, ((self.cond_dim,),), cond.aliases, cond.required,
                                 cond.description)
        return ObservationSchema(fields=(exact,), prompt_key=SCHEMA.prompt_key, prompt_aliases=SCHEMA.prompt_aliases)

    def kv_cache_spec(self) -> ARDiffusionKVCacheSpec:
        return self.backbone_kv_spec(
            kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
            cross_attention=(ARDiffusionCrossAttentionKVSpec("text", self.text_len),),
            max_scratch_tokens_per_branch=self.num_registers,
            model_owned_state_bytes_per_session=0,  # the pipeline keeps only the prompt and a block counter
        )


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "small": dict(dim=128, ffn_dim=512, freq_dim=64, num_heads=4, num_layers=4, latent_channels=16, height=64,
                  width=128, vae_stride=8, text_dim=64, text_len=32, window_frames=9),
    # Self-Forcing on Wan2.1-T2V-1.3B at 480x832 (see configs/self-forcing-1.3b.yaml for sources).
    "self-forcing-1.3b": dict(dim=1536, ffn_dim=8960, freq_dim=256, num_heads=12, num_layers=30, latent_channels=16,
                              patch_size=(1, 2, 2), height=480, width=832, vae_stride=8, temporal_stride=4,
                              text_dim=4096, text_len=512, frames_per_block=3, window_frames=18, sink_frames=0,
                              cond_dim=0, denoising_timesteps=(1000, 750, 500, 250), timestep_shift=5.0),
    # A LingBot-World-like 14B interactive world model (see configs/lingbot-world-14b.yaml for assumptions).
    "lingbot-world-14b": dict(dim=5120, ffn_dim=13824, freq_dim=256, num_heads=40, num_layers=40, latent_channels=16,
                              patch_size=(1, 2, 2), height=480, width=832, vae_stride=8, temporal_stride=4,
                              text_dim=4096, text_len=512, frames_per_block=3, window_frames=18, sink_frames=3,
                              cond_dim=12, denoising_timesteps=(1000, 750, 500, 250), timestep_shift=5.0),
}

# A world model reads no robot observation: its inputs are the prompt, an optional conditioning vector per
# block and a seed. The schema declares the conditioning so the CLI can check step files the same way.
SCHEMA = ObservationSchema(
    fields=(
        ObservationField("conditioning", "float32", ((None,),), aliases=("action", "camera"), required=False,
                         description="per-block action / camera vector of length cond_dim (optional)"),
    ),
    prompt_key="prompt",
    prompt_aliases=("caption",),
)


def observation_schema() -> ObservationSchema:
    return SCHEMA
