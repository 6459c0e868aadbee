"""A single-branch causal DMD world model (Self-Forcing / LingBot style) over paged KV.

One request (``forward``) generates one block::

    inputs: {"prompt": str, "conditioning": (cond_dim,) float32 (optional), "seed": int (optional)}

    noise (C, frames_per_block, h, w)
      └─ for t in denoising_timesteps (e.g. 1000/750/500/250, shifted):
             v = transformer(x_t, t)          history: sink + sliding window, read-only
             x0 = x_t - sigma_t * v           (flow matching: x_t = (1 - sigma) x0 + sigma noise)
             x_t' = (1 - sigma') x0 + sigma' fresh_noise      re-noise to the next level (DMD)
    commit pass at t = 0 on x0: the clean block is written into the KV pages
    ──► {"latents": (C, frames_per_block, h, w) float32}      decode_latents -> RGB frames

The conditioning vector (an action or camera pose for this block) becomes one
register token: visible to the block's denoising and commit passes, never
committed, so later blocks see its effect only through the frames it shaped.
Without conditioning a zero vector stands in.

Sessions keep no tensors (``model_owned_state_bytes_per_session = 0``): the
prompt and a block counter (it numbers the noise draws). A new prompt on a
live session re-projects the text cache and keeps the video history, the
prompt switching of interactive world models; ``extra_args["reset"]``
starts over.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ardiff_cli.runtime.request import ARDiffusionRequest
from pipelines.base import ARPipeline, noise_generator, shift_sigma
from pipelines.causal_world.config import SCHEMA, Config
from pipelines.causal_world.config import observation_schema as module_observation_schema
from pipelines.encoders import LatentCodec, TextEncoder
from pipelines.wan import Segment, WanTransformer


class CausalWorldTransformer(WanTransformer):
    """Wan T2V transformer plus an optional per-block conditioning token."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if config.cond_dim:
            self.cond_embedding = nn.Sequential(nn.Linear(config.cond_dim, config.dim), nn.SiLU(),
                                                nn.Linear(config.dim, config.dim))

    def registers(self, cond: torch.Tensor) -> torch.Tensor:
        """(cond_dim,) -> one register token (1, dim)."""
        weight = self.cond_embedding[0].weight
        return self.cond_embedding(cond[None].to(weight.dtype))


class CausalWorldModules(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.transformer = CausalWorldTransformer(config)
        self.vae = LatentCodec(config.latent_channels, config.vae_stride, config.temporal_stride)
        self.text_encoder = TextEncoder(config.text_dim, config.text_len, config.eps)


@dataclass
class WorldSession:
    prompt: str  # text the cache was projected from
    num_blocks: int = 0  # blocks generated; numbers the noise draws


class CausalWorldPipeline(ARPipeline):
    name = "causal_world"
    # What the entry module carries, so the class alone is a pipeline for
    # `--pipeline pipelines.causal_world.pipeline:CausalWorldPipeline` (and for subclasses of it).
    Config = Config
    observation_schema = staticmethod(module_observation_schema)
    cross_names = ("text",)
    session_record = WorldSession

    @classmethod
    def build_modules(cls, config: Config) -> CausalWorldModules:
        return CausalWorldModules(config)

    def _parse(self, inputs: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        # The config's exact schema: conditioning of length cond_dim, or an unknown key when cond_dim is 0.
        return self._seed_and_observation(inputs, self.config.observation_schema())

    def _step(self, session_id: str, rollout, parsed: tuple[int, dict[str, Any]]) -> dict[str, Any]:
        c = self.config
        seed, obs = parsed
        prompt = obs[SCHEMA.prompt_key]
        cond = obs.get("conditioning")  # (cond_dim,) float32 or None

        session = self.sessions.pop(session_id, None)  # re-stored only when the request succeeds
        if session is None:
            if rollout.num_frames("main") or rollout.has_cross("main", "text"):
                rollout.reset()  # a record-less session must not inherit anything
            session = WorldSession(prompt=prompt)
            rollout.set_cross("main", "text", self._text_kv(prompt))
        elif prompt != session.prompt:
            rollout.set_cross("main", "text", self._text_kv(prompt))  # prompt switch: history stays
            session.prompt = prompt

        registers = register_t = None
        if c.cond_dim:
            vector = (torch.zeros(c.cond_dim, dtype=torch.float32) if cond is None
                      else torch.from_numpy(np.ascontiguousarray(cond)))
            registers = self.transformer.registers(vector.to(self.device))  # (1, dim)
            register_t = torch.zeros(1, dtype=torch.float32, device=self.device)  # conditioning is clean
        first = rollout.num_frames("main")
        frames = c.frames_per_block

        def segment(x: torch.Tensor, t: float) -> Segment:
            return Segment(latents=x.to(self.dtype),
                           timesteps=torch.full((frames,), t, dtype=torch.float32, device=self.device),
                           first_frame=first, registers=registers, register_timesteps=register_t)

        gen = noise_generator(seed, session.num_blocks)
        shape = (c.latent_channels, frames, c.latent_height, c.latent_width)
        x = torch.randn(shape, generator=gen, dtype=torch.float32).to(self.device)  # (C, F, h, w) at sigma = 1
        sigmas = [shift_sigma(t / 1000.0, c.timestep_shift) for t in c.denoising_timesteps]
        x0 = x
        for i, sigma in enumerate(sigmas):
            v = rollout.run("main", segment(x, sigma * 1000.0), commit=False).video  # (C, F, h, w)
            x0 = x - sigma * v
            if i + 1 < len(sigmas):
                noise = torch.randn(shape, generator=gen, dtype=torch.float32).to(self.device)
                x = (1.0 - sigmas[i + 1]) * x0 + sigmas[i + 1] * noise
        # Commit pass: the clean block, at timestep 0, becomes history.
        rollout.commit("main", segment(x0, 0.0))
        session.num_blocks += 1
        self.sessions[session_id] = session
        return {"latents": x0.cpu()}

    # ------------------------------------------------------------------ warmup
    def ar_diffusion_warmup_requests(self, session_id: str) -> Iterator[ARDiffusionRequest]:
        """Blocks until sink + window are full, plus one that slides the window."""
        c = self.config
        num = -(-(c.sink_frames + c.window_frames) // c.frames_per_block) + 1
        for i in range(num):
            yield ARDiffusionRequest(f"warmup-{i}", self.example_inputs(seed=i), {"session_id": session_id})

    def example_inputs(self, *, prompt: str = "warmup", seed: int = 0) -> dict[str, Any]:
        inputs: dict[str, Any] = {"prompt": prompt, "seed": seed}
        if self.config.cond_dim:
            inputs["conditioning"] = np.random.default_rng(seed).standard_normal(self.config.cond_dim).astype(
                np.float32)
        return inputs
