"""DreamZero config, presets, KV spec and robot observation schema. No torch import."""

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

MASK_CHANNELS = 4  # Wan I2V marks the conditioning frame with 4 mask channels (one per RGB frame of a latent)
JOINTS, GRIPPER, CARTESIAN = 7, 1, 6  # DROID / RoboArena proprioception sizes
FLOAT32_BYTES = 4
MAX_INFERENCE_STEPS = 1000  # sampler steps per request (the published 14B model uses 16)
MAX_MODEL_LEN = ARDiffusionKVCacheSpec.max_model_len  # tokens one attention call may see (the spec's default)


@dataclass(frozen=True)
class Config(BackboneConfig):
    """A DreamZero-style world-action model. Defaults are the ``tiny`` preset (CPU, milliseconds per request).

    One latent frame is the paging unit. Each request commits the latent frame(s)
    of its observation, then predicts ``frames_per_block`` future latent frames
    and an action chunk. The camera views are tiled 2 x 2 into one
    ``height x width`` frame: exterior 0 | exterior 1 over wrist | black.
    """

    # -- KV retention, in latent frames
    frames_per_block: int = 1  # latent frames predicted per request (also the largest observation commit)
    window_frames: int = 4  # history frames kept after the sink
    sink_frames: int = 0  # DreamZero restarts its window instead of sliding, so no sink by default
    session_capacity: int = 4  # upper bound on resident sessions (runtime.session_capacity replaces it)
    reset_at_window: bool = True  # restart the window (keep text, re-anchor) when history would overflow it
    # -- image conditioning (a CLIP-ViT-shaped encoder)
    image_dim: int = 32  # image encoder width (CLIP ViT-H/14: 1280)
    image_size: int = 16  # encoder input resolution (CLIP: 224)
    image_patch: int = 4  # encoder patch (CLIP ViT-H/14: 14)
    # -- robot
    action_dim: int = 8  # joint velocities (7) + gripper (1)
    action_horizon: int = 8  # actions per chunk = action register tokens
    frames_per_request: int = 4  # RGB frames per camera in every request after a session's first
    # -- sampler
    num_inference_steps: int = 4  # flow-matching Euler steps
    guidance_scale: float = 5.0  # classifier-free guidance; 1.0 disables it and the negative branch
    timestep_shift: float = 5.0  # Wan's flow shift of the noise schedule
    negative_prompt: str = ""  # text of the negative (unconditional) branch

    # -- derived
    image_tokens: int = field(init=False)  # 1 class token + patches: the image cache length
    state_dim: int = field(init=False)  # joint + gripper + cartesian
    num_registers: int = field(init=False)  # action tokens + 1 state token: scratch tokens per branch
    guided: bool = field(init=False)  # whether the negative branch exists
    model_owned_bytes: int = field(init=False)  # the per-session anchor latent, float32

    # Fields that decide the tensors of a fresh checkpoint (its cache key).
    WEIGHT_FIELDS: ClassVar[tuple[str, ...]] = (
        "dim", "ffn_dim", "freq_dim", "num_heads", "num_layers", "qk_norm", "cross_attn_norm", "latent_channels",
        "patch_size", "vae_stride", "temporal_stride", "text_dim", "text_len", "image_dim", "image_size",
        "image_patch", "action_dim", "action_horizon", "seed",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("image_dim", "image_size", "image_patch", "action_dim", "action_horizon"):
            value = getattr(self, name)
            require(value >= 1, name, "a positive integer", value)
        # Each action is a register token in every attention call, with the state's: past max_model_len the span
        # check could only blame "the pipeline's register tokens" (2**62 of them), naming no field.
        require(self.action_horizon < MAX_MODEL_LEN, "action_horizon",
                f"a positive integer below max_model_len={MAX_MODEL_LEN} (one attention call sees every action "
                "token and the state token)", self.action_horizon)
        # Each step is a forward per branch, and the schedule is built as a list first: 10**8 steps would hold
        # gigabytes and never end. 1000 matches causal_world, whose steps are distinct timesteps in (0, 1000].
        require(1 <= self.num_inference_steps <= MAX_INFERENCE_STEPS, "num_inference_steps",
                f"an integer from 1 to {MAX_INFERENCE_STEPS}", self.num_inference_steps)
        # A one-frame request is a session's first (its anchor): with 1 here every request would restart the window.
        require(self.frames_per_request >= 2, "frames_per_request",
                "at least 2 (a one-frame request starts a session's window)", self.frames_per_request)
        require(self.image_size % self.image_patch == 0, "image_size",
                f"a multiple of image_patch={self.image_patch}", self.image_size)
        require(self.guidance_scale >= 1.0, "guidance_scale", "a number >= 1 (1 disables guidance)",
                self.guidance_scale)
        require(self.timestep_shift > 0, "timestep_shift", "a positive number", self.timestep_shift)
        for name in ("height", "width"):
            require(getattr(self, name) % 2 == 0, name, "an even number (2 x 2 camera tiles)", getattr(self, name))
        require(self.frames_per_request % self.temporal_stride == 0, "frames_per_request",
                f"a multiple of temporal_stride={self.temporal_stride}", self.frames_per_request)
        latents = self.frames_per_request // self.temporal_stride
        require(latents <= self.frames_per_block, "frames_per_request",
                f"at most frames_per_block * temporal_stride = {self.frames_per_block * self.temporal_stride} "
                "(one request's observation must fit one block)", self.frames_per_request)
        require(latents <= self.sink_frames + self.window_frames, "window_frames",
                f"room for one request's observation ({latents} latent frames) with sink_frames={self.sink_frames}",
                self.window_frames)
        derive(self, "in_dim", 2 * self.latent_channels + MASK_CHANNELS)  # noisy latents | mask | anchor latent
        derive(self, "image_tokens", 1 + (self.image_size // self.image_patch) ** 2)
        derive(self, "state_dim", JOINTS + GRIPPER + CARTESIAN)
        derive(self, "num_registers", self.action_horizon + 1)
        derive(self, "guided", self.guidance_scale != 1.0)
        derive(self, "model_owned_bytes", self.latent_channels * self.latent_height * self.latent_width * FLOAT32_BYTES)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str) -> Config:
        return config_from_dict(cls, data, where=where, presets=PRESETS)

    @property
    def latent_frames_per_request(self) -> int:
        return self.frames_per_request // self.temporal_stride

    @property
    def branch_names(self) -> tuple[str, ...]:
        return ("positive", "negative") if self.guided else ("positive",)

    def observation_schema(self) -> ObservationSchema:
        """The robot schema; the same for every DreamZero config."""
        return SCHEMA

    def kv_cache_spec(self) -> ARDiffusionKVCacheSpec:
        """KV geometry: two CFG branches (one without guidance), text and image caches, action/state scratch."""
        return self.backbone_kv_spec(
            kv_branches=tuple(ARDiffusionKVBranchSpec(name, i) for i, name in enumerate(self.branch_names)),
            reset_at_boundary=self.reset_at_window,
            cross_attention=(
                ARDiffusionCrossAttentionKVSpec("text", self.text_len),
                ARDiffusionCrossAttentionKVSpec("image", self.image_tokens),
            ),
            max_scratch_tokens_per_branch=self.num_registers,
            model_owned_state_bytes_per_session=self.model_owned_bytes,
        )


PRESETS: dict[str, dict[str, Any]] = {
    # A CPU model: 16 tokens per frame, 2 layers of width 64; a request is a few milliseconds.
    "tiny": {},
    # Still CPU-friendly, with a realistic token count per frame for benchmarks.
    "small": dict(dim=128, ffn_dim=512, freq_dim=64, num_heads=4, num_layers=4, latent_channels=16,
                  height=64, width=128, vae_stride=8, text_dim=64, text_len=32, image_dim=64, image_size=32,
                  image_patch=8, action_horizon=16, window_frames=8),
    # DreamZero on the Wan2.1-I2V-14B backbone (see configs/dreamzero-14b.yaml for sources).
    "14b": dict(dim=5120, ffn_dim=13824, freq_dim=256, num_heads=40, num_layers=40, latent_channels=16,
                patch_size=(1, 2, 2), height=176, width=320, vae_stride=8, temporal_stride=4, text_dim=4096,
                text_len=512, image_dim=1280, image_size=224, image_patch=14, action_horizon=24,
                frames_per_block=1, window_frames=9, sink_frames=0, num_inference_steps=16, guidance_scale=5.0,
                timestep_shift=5.0),
}


CAMERA_SHAPES = ((None, None, 3), (None, None, None, 3))  # one frame, or T frames
CAMERAS = ("exterior_image_0", "exterior_image_1", "wrist_image")

SCHEMA = ObservationSchema(
    fields=(
        # Canonical names follow RoboArena without its "observation/" prefix and "_left" suffix. DROID numbers its
        # exterior cameras from 1, so DROID's exterior_image_1_left is camera 0.
        ObservationField("exterior_image_0", "uint8", CAMERA_SHAPES,
                         aliases=("observation/exterior_image_0_left", "exterior_image_1_left"),
                         description="exterior camera 0, RGB (H, W, 3) or (T, H, W, 3)"),
        ObservationField("exterior_image_1", "uint8", CAMERA_SHAPES,
                         aliases=("observation/exterior_image_1_left", "exterior_image_2_left"),
                         description="exterior camera 1, RGB (H, W, 3) or (T, H, W, 3)"),
        ObservationField("wrist_image", "uint8", CAMERA_SHAPES,
                         aliases=("observation/wrist_image_left", "wrist_image_left"),
                         description="wrist camera, RGB (H, W, 3) or (T, H, W, 3)"),
        ObservationField("joint_position", "float32", ((JOINTS,), (None, JOINTS)),
                         aliases=("observation/joint_position",),
                         description="7 joint angles (rad); with T rows the last is current"),
        ObservationField("gripper_position", "float32", ((), (GRIPPER,), (None, GRIPPER)),
                         aliases=("observation/gripper_position",),
                         description="gripper opening in [0, 1]; with T rows the last is current"),
        ObservationField("cartesian_position", "float32", ((CARTESIAN,), (None, CARTESIAN)),
                         aliases=("observation/cartesian_position",), required=False,
                         description="end-effector xyz + rpy (optional)"),
    ),
    prompt_key="prompt",
    prompt_aliases=("language_instruction",),
)


def observation_schema() -> ObservationSchema:
    return SCHEMA
