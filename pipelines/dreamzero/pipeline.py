"""DreamZero-style world-action model: joint video + action flow matching with CFG over paged KV.

One request (``forward``)::

    cameras (1 or 4 frames) ──tile 2x2──codec──► observation latent(s)
        └─ commit pass at t = 0 on every CFG branch ──► clean history in the KV pages
    noise: next video block (C, frames_per_block, h, w) + action chunk (action_horizon, 8)
        └─ num_inference_steps x [positive (+ negative) forward -> CFG -> Euler step]
    ──► {"actions": (action_horizon, 8) float32, "latents": (C, frames_per_block, h, w) float32}

The predicted frames are never committed: the next request's real
observations take their place in the history (closed-loop teacher forcing).

Sessions. The newest frame of a session's first request is the window's
*anchor*: its latent is channel-concatenated to every frame (the anchor latent
is the model-owned state, declared in the KV spec), and its image features fill
the ``image`` cache. Wan I2V conditions on its first frame the same way, with the
mask marking it, but concatenates the anchor to frame 0 only: its other frames
carry the latent of blank frames. This stand-in repeats the anchor instead.

- a new session (first request, or after the runner evicted, closed or reset
  it; a four-frame request is then treated as fresh, anchored on its newest
  frame), or a prompt change: everything is dropped, text cache included;
- a window boundary (history would outgrow sink + window) or a one-frame
  request on a live session: ``state.reset(keep_cross_attention=("text",))``,
  then re-anchor on the current frame and re-project the image cache.

Model inputs per frame are ``[noisy latent (C) | anchor mask (4) | anchor latent (C)]`` (Wan I2V's 36
channels at C = 16); registers after the video tokens are ``action_horizon`` action tokens and one
state token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ardiff_cli.runtime.errors import ObservationError
from ardiff_cli.runtime.request import ARDiffusionRequest
from pipelines.base import ARPipeline, noise_generator, shifted_sigmas
from pipelines.dreamzero.config import CAMERAS, CARTESIAN, MASK_CHANNELS, SCHEMA, Config
from pipelines.dreamzero.config import observation_schema as module_observation_schema
from pipelines.encoders import ImageEncoder, LatentCodec, TextEncoder
from pipelines.wan import Segment, WanLayerNorm, WanTransformer


class DreamZeroTransformer(WanTransformer):
    """Wan I2V transformer with action and state register tokens (DreamZero's action head in the DiT)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        c = config
        self.action_horizon = c.action_horizon
        self.action_encoder = nn.Sequential(nn.Linear(c.action_dim, c.dim), nn.SiLU(), nn.Linear(c.dim, c.dim))
        self.state_encoder = nn.Sequential(nn.Linear(c.state_dim, c.dim), nn.SiLU(), nn.Linear(c.dim, c.dim))
        # Tells the registers apart: they share one RoPE position, so this is their only order.
        self.register_embedding = nn.Parameter(torch.zeros(c.num_registers, c.dim))
        self.action_decoder = nn.Sequential(WanLayerNorm(c.dim, c.eps), nn.Linear(c.dim, c.action_dim))

    def init_weights(self) -> None:
        super().init_weights()
        nn.init.normal_(self.register_embedding, std=0.02)

    def registers(self, actions: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Noisy actions (H, action_dim) and robot state (state_dim,) -> register tokens (H + 1, dim)."""
        dtype = self.register_embedding.dtype
        tokens = torch.cat([self.action_encoder(actions.to(dtype)), self.state_encoder(state[None].to(dtype))])
        return tokens + self.register_embedding  # (H + 1, dim)

    def decode_actions(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final register states (H + 1, dim) -> action velocity (H, action_dim) float32."""
        return self.action_decoder(hidden[: self.action_horizon]).float()


class DreamZeroModules(nn.Module):
    """Every weight of the pipeline; its state dict is the checkpoint."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.transformer = DreamZeroTransformer(config)
        self.vae = LatentCodec(config.latent_channels, config.vae_stride, config.temporal_stride)
        self.text_encoder = TextEncoder(config.text_dim, config.text_len, config.eps)
        self.image_encoder = ImageEncoder(config.image_dim, config.image_size, config.image_patch, config.eps)


@dataclass
class DreamZeroSession:
    """What the pipeline keeps per session outside the runner's pools."""

    prompt: str  # the task; a different prompt restarts the session
    anchor_latent: torch.Tensor  # (C, h, w) float32: the window's anchor frame, conditioning every frame
    num_requests: int = 0  # requests served; numbers the noise draws


class DreamZeroPipeline(ARPipeline):
    name = "dreamzero"
    # What the entry module carries, so the class alone is a pipeline for
    # `--pipeline pipelines.dreamzero.pipeline:DreamZeroPipeline` (and for subclasses of it).
    Config = Config
    observation_schema = staticmethod(module_observation_schema)
    cross_names = ("text", "image")
    session_record = DreamZeroSession

    def __init__(self, config: Config, modules: DreamZeroModules, **kwargs: Any) -> None:
        super().__init__(config, modules, **kwargs)
        self.image_encoder = modules.image_encoder
        self.branches = config.branch_names  # ("positive", "negative"), or ("positive",) without guidance

    @classmethod
    def build_modules(cls, config: Config) -> DreamZeroModules:
        return DreamZeroModules(config)

    # ------------------------------------------------------------------ inputs
    def _camera_frames(self, obs: dict[str, np.ndarray]) -> torch.Tensor:
        """The three views resized and tiled 2 x 2 -> uint8 (T, height, width, 3)."""
        c = self.config
        th, tw = c.height // 2, c.width // 2
        views = {key: obs[key][None] if obs[key].ndim == 3 else obs[key] for key in CAMERAS}
        counts = {key: v.shape[0] for key, v in views.items()}
        if len(set(counts.values())) != 1:
            raise ObservationError(f"request inputs: cameras carry different frame counts: {counts}",
                                   hint="send the same number of frames for every camera")
        tiles = []
        for key in CAMERAS:
            x = torch.from_numpy(np.ascontiguousarray(views[key])).to(self.device)  # (T, Hc, Wc, 3)
            if x.shape[1:3] != (th, tw):
                x = F.interpolate(x.permute(0, 3, 1, 2).float(), size=(th, tw), mode="bilinear", align_corners=False)
                x = x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)  # (T, th, tw, 3)
            tiles.append(x)
        top = torch.cat([tiles[0], tiles[1]], dim=2)  # (T, th, 2 tw, 3)
        bottom = torch.cat([tiles[2], torch.zeros_like(tiles[2])], dim=2)
        return torch.cat([top, bottom], dim=1)  # (T, height, width, 3)

    def _robot_state(self, obs: dict[str, np.ndarray]) -> torch.Tensor:
        """Current joint, gripper and (optional, else zero) cartesian position -> (state_dim,) float32."""
        def current(array: np.ndarray, size: int) -> np.ndarray:
            return np.asarray(array, dtype=np.float32).reshape(-1, size)[-1]

        parts = [current(obs["joint_position"], 7), current(obs["gripper_position"], 1)]
        cartesian = obs.get("cartesian_position")
        parts.append(np.zeros(CARTESIAN, np.float32) if cartesian is None else current(cartesian, CARTESIAN))
        return torch.from_numpy(np.concatenate(parts)).to(self.device)

    # ------------------------------------------------------------------ conditioning caches
    def _populate_text(self, rollout, prompt: str) -> None:
        texts = {"positive": prompt, "negative": self.config.negative_prompt}
        for branch in self.branches:
            rollout.set_cross(branch, "text", self._text_kv(texts[branch]))

    def _populate_image(self, rollout, frame: torch.Tensor) -> None:
        """Both branches see the same image: CFG drops only the text."""
        pairs = list(self.transformer.project_image(self.image_encoder(frame)))
        for branch in self.branches:
            rollout.set_cross(branch, "image", iter(pairs))

    def _anchor_channels(self, anchor: torch.Tensor, first_frame: int, num_frames: int) -> torch.Tensor:
        """[mask (4) | anchor latent (C)] for frames first_frame.. -> (4 + C, F, h, w); mask = 1 on the anchor."""
        C, h, w = anchor.shape
        is_anchor = (torch.arange(num_frames, device=anchor.device) + first_frame == 0).float()  # (F,)
        mask = is_anchor[None, :, None, None].expand(MASK_CHANNELS, num_frames, h, w)
        return torch.cat([mask, anchor[:, None].expand(C, num_frames, h, w)])

    # ------------------------------------------------------------------ the request
    def _parse(self, inputs: dict[str, Any]) -> tuple[int, torch.Tensor, torch.Tensor, str]:
        """(seed, camera frames (T, H, W, 3) uint8, robot state (state_dim,), prompt)."""
        c = self.config
        seed, obs = self._seed_and_observation(inputs, SCHEMA)
        frames = self._camera_frames(obs)
        if frames.shape[0] not in (1, c.frames_per_request):
            raise ObservationError(
                f"request inputs: cameras carry {frames.shape[0]} frames; expected 1 (a session's first request) or "
                f"{c.frames_per_request}",
                hint=f"each camera's array is (frames, height, width, 3): the first step of an episode holds one "
                     f"frame, each later one {c.frames_per_request}",
            )
        return seed, frames, self._robot_state(obs), obs[SCHEMA.prompt_key]

    def _step(self, session_id: str, rollout, parsed: tuple[int, torch.Tensor, torch.Tensor, str]) -> dict[str, Any]:
        c = self.config
        seed, frames, robot_state, prompt = parsed
        num_rgb = frames.shape[0]
        session = self.sessions.pop(session_id, None)  # re-stored only when the request succeeds

        committed = rollout.num_frames("positive")
        new_frames = 1 if num_rgb == 1 else c.latent_frames_per_request
        if session is None or session.prompt != prompt:
            # A new session or a new task: no history applies, not even the text cache.
            if committed or rollout.has_cross("positive", "text"):
                rollout.reset()
            session = DreamZeroSession(prompt=prompt, anchor_latent=frames.new_empty(0).float())
        elif num_rgb == 1 or (c.reset_at_window and committed + new_frames > c.sink_frames + c.window_frames):
            rollout.reset(keep=("text",))  # window boundary: same task, fresh window
        if rollout.num_frames("positive") == 0:
            # A fresh window: the newest frame alone is its first (anchor) frame.
            anchor = frames[-1:]  # (1, H, W, 3)
            observed = self.vae.encode(anchor)  # (C, 1, h, w)
            session.anchor_latent = observed[:, 0].clone()
            if not rollout.has_cross("positive", "text"):
                self._populate_text(rollout, prompt)
            self._populate_image(rollout, anchor[0])
        else:
            observed = self.vae.encode(frames)  # (C, frames_per_request / temporal_stride, h, w)

        # Commit pass: the observed frames become clean history of every branch.
        for branch in self.branches:
            first = rollout.num_frames(branch)
            cond = self._anchor_channels(session.anchor_latent, first, observed.shape[1])
            seg = Segment(latents=torch.cat([observed, cond]).to(self.dtype),
                          timesteps=torch.zeros(observed.shape[1], dtype=torch.float32, device=self.device),
                          first_frame=first)
            rollout.commit(branch, seg)

        actions, latents = self._sample(rollout, session, robot_state, seed)
        session.num_requests += 1
        self.sessions[session_id] = session
        return {"actions": actions.cpu(), "latents": latents.cpu()}

    def _sample(self, rollout, session: DreamZeroSession, robot_state: torch.Tensor,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flow-matching Euler sampling of the next video block and action chunk, with CFG."""
        c = self.config
        first = rollout.num_frames("positive")
        assert all(rollout.num_frames(b) == first for b in self.branches), "CFG branches out of step"
        gen = noise_generator(seed, session.num_requests)
        shape = (c.latent_channels, c.frames_per_block, c.latent_height, c.latent_width)
        x = torch.randn(shape, generator=gen, dtype=torch.float32).to(self.device)  # (C, F, h, w) float32
        a = torch.randn((c.action_horizon, c.action_dim), generator=gen,
                        dtype=torch.float32).to(self.device)  # (H, action_dim)
        cond = self._anchor_channels(session.anchor_latent, first, c.frames_per_block)  # (4 + C, F, h, w)
        sigmas = shifted_sigmas(c.num_inference_steps, c.timestep_shift)
        for i in range(c.num_inference_steps):
            t = sigmas[i] * 1000.0
            v_x, v_a = self._velocity(rollout, "positive", x, a, cond, robot_state, t, first)
            if c.guided:
                u_x, u_a = self._velocity(rollout, "negative", x, a, cond, robot_state, t, first)
                v_x = u_x + c.guidance_scale * (v_x - u_x)
                v_a = u_a + c.guidance_scale * (v_a - u_a)
            dt = sigmas[i + 1] - sigmas[i]
            x = x + dt * v_x
            a = a + dt * v_a
        return a, x

    def _velocity(self, rollout, branch: str, x: torch.Tensor, a: torch.Tensor, cond: torch.Tensor,
                  robot_state: torch.Tensor, t: float, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        H = self.config.action_horizon
        seg = Segment(
            latents=torch.cat([x, cond]).to(self.dtype),  # (in_dim, F, h, w)
            timesteps=torch.full((x.shape[1],), t, dtype=torch.float32, device=self.device),
            first_frame=first,
            registers=self.transformer.registers(a, robot_state),  # (H + 1, dim)
            # Actions are as noisy as the video; the state token is an observation, clean.
            register_timesteps=torch.cat([torch.full((H,), t, dtype=torch.float32, device=self.device),
                                           torch.zeros(1, dtype=torch.float32, device=self.device)]),
        )
        out = rollout.run(branch, seg, commit=False)
        return out.video, self.transformer.decode_actions(out.registers)

    # ------------------------------------------------------------------ warmup
    def ar_diffusion_warmup_requests(self, session_id: str) -> Iterator[ARDiffusionRequest]:
        """One one-frame request, then four-frame requests until the window is full, and one more, all in
        ``session_id``: the last overflows the window, so the path every later window boundary of a rollout takes
        (the restart: text cache kept, image cache and anchor made again; or, without ``reset_at_window``, the
        window sliding on) first runs here, not in the rollout's first step past its window."""
        c = self.config
        fill = c.sink_frames + c.window_frames - 1  # latent frames after the anchor
        # the four-frame requests the window holds after its anchor, then the one that overflows it (with a window
        # of one frame, full with the anchor, that is the first: each step after the anchor restarts the window)
        num_four = fill // c.latent_frames_per_request + 1
        for i in range(1 + num_four):
            yield ARDiffusionRequest(f"warmup-{i}", self.example_inputs(1 if i == 0 else c.frames_per_request),
                                     {"session_id": session_id})

    def example_inputs(self, num_frames: int, *, prompt: str = "warmup", seed: int = 0) -> dict[str, Any]:
        """A synthetic observation at the tile resolution: random images and proprioception from ``seed``."""
        c = self.config
        rng = np.random.default_rng(seed)
        shape = (c.height // 2, c.width // 2, 3) if num_frames == 1 else (num_frames, c.height // 2, c.width // 2, 3)
        inputs: dict[str, Any] = {key: rng.integers(0, 256, shape, dtype=np.uint8) for key in CAMERAS}
        inputs["joint_position"] = rng.standard_normal(7).astype(np.float32)
        inputs["gripper_position"] = rng.random(1).astype(np.float32)
        inputs["prompt"] = prompt
        return inputs
