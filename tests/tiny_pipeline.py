"""A tiny but real AR-Diffusion pipeline for runner tests.

A few torch attention layers that implement the capability: per-session
model-owned state, a text cross-attention cache, an optional second CFG
branch, a commit pass per request, fault injection at any layer, and hook
recording. Small enough that thousands of requests run in seconds.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager

import torch

from ardiff_cli.runtime.capability import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
)
from ardiff_cli.runtime.request import ARDiffusionRequest

D_MODEL = 16


def tiny_spec(**overrides) -> ARDiffusionKVCacheSpec:
    fields = dict(
        num_layers=3,
        num_kv_heads=2,
        head_size=8,
        tokens_per_frame=4,
        frames_per_block=2,
        window_frames=3,
        sink_frames=1,
        kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 3),),
        max_scratch_tokens_per_branch=2,
        session_capacity=2,
    )
    fields.update(overrides)
    return ARDiffusionKVCacheSpec(**fields)


class TinyPipeline:
    """Each request carries ``frames`` (n_frames * tokens_per_frame, D_MODEL) and a ``prompt`` seed."""

    def __init__(self, spec: ARDiffusionKVCacheSpec | None = None, seed: int = 0) -> None:
        self.spec = spec or tiny_spec()
        gen = torch.Generator().manual_seed(seed)
        s = self.spec
        inner = s.num_kv_heads * s.head_size
        self.w_q = torch.randn(s.num_layers, D_MODEL, 2 * inner, generator=gen) / D_MODEL**0.5  # GQA: 2x heads
        self.w_kv = torch.randn(s.num_layers, D_MODEL, 2 * inner, generator=gen) / D_MODEL**0.5
        self.w_o = torch.randn(s.num_layers, 2 * inner, D_MODEL, generator=gen) / inner**0.5
        self.w_text = torch.randn(s.num_layers, D_MODEL, 2 * inner, generator=gen) / D_MODEL**0.5
        self.model_state: dict[str, int] = {}  # session -> requests seen (model-owned state)
        self.hook_calls: list[tuple[str, str]] = []  # (hook, session_id) in call order
        self.fail_at_layer: int | None = None  # raise inside this layer's forward
        self.fail_with: type[Exception] = RuntimeError  # what it raises there (AssertionError: a model's own check)
        self.fail_in_hook: str | None = None  # "reset" or "close": that hook raises
        self.skip_commit = False  # forget state.commit (a pipeline bug the runner must catch)
        # A pipeline bug: keep the first state bound (kept_state) and read the text cache through it in every later
        # forward, whichever session's it is ("the prompt's cache, computed once").
        self.keep_state = False
        self.kept_state = None
        self._state = None
        self._session_id: str | None = None

    # -- capability
    def ar_diffusion_kv_cache_spec(self) -> ARDiffusionKVCacheSpec:
        return self.spec

    @contextmanager
    def bind_ar_diffusion_state(self, session_id, state):
        self._state, self._session_id = state, session_id
        try:
            yield
        finally:
            self._state, self._session_id = None, None

    def reset_ar_diffusion_session(self, session_id: str) -> None:
        self.hook_calls.append(("reset", session_id))
        self.model_state.pop(session_id, None)
        if self.fail_in_hook == "reset":
            raise RuntimeError("reset hook failed")

    def close_ar_diffusion_session(self, session_id: str) -> None:
        self.hook_calls.append(("close", session_id))
        self.model_state.pop(session_id, None)
        if self.fail_in_hook == "close":
            raise RuntimeError("close hook failed")

    # -- model
    def _text_kv(self, prompt: int, branch: str):
        s = self.spec
        gen = torch.Generator().manual_seed(prompt * 7 + len(branch))
        text = torch.randn(3, D_MODEL, generator=gen)
        for layer in range(s.num_layers):
            kv = (text @ self.w_text[layer]).view(3, 2, s.num_kv_heads, s.head_size)
            yield kv[:, 0].transpose(0, 1).contiguous(), kv[:, 1].transpose(0, 1).contiguous()

    def forward(self, request: ARDiffusionRequest) -> dict[str, torch.Tensor]:
        state, s = self._state, self.spec
        assert state is not None, "forward outside bind_ar_diffusion_state"
        x = request.inputs["frames"]  # (T, D_MODEL)
        registers = request.inputs.get("registers")  # (R, D_MODEL) or None
        prompt = int(request.inputs.get("prompt", 0))
        outputs = {}
        if self.keep_state and self.kept_state is None:
            self.kept_state = state
        for branch in s.branch_names:
            if not state.has_cross_attention(branch, "text"):
                state.populate_cross_attention(branch, "text", self._text_kv(prompt, branch))
            text = (self.kept_state if self.keep_state else state).cross_attention(branch, "text")
            h = x if registers is None else torch.cat([x, registers])  # (L, D_MODEL)
            contexts = state.get_kv_caches(branch, x.shape[0], commit_current=True)
            for layer, ctx in enumerate(contexts):
                if layer == self.fail_at_layer:
                    raise self.fail_with(f"injected failure at layer {layer}")
                q = (h @ self.w_q[layer]).view(-1, 2 * s.num_kv_heads, s.head_size).transpose(0, 1)
                kv = (h @ self.w_kv[layer]).view(-1, 2, s.num_kv_heads, s.head_size)
                k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)
                attn = ctx.attend(q.contiguous(), k.contiguous(), v.contiguous())  # (2*Hkv, L, D)
                tk, tv = text[layer]
                q_text = q.reshape(s.num_kv_heads, -1, s.head_size)  # same grouping as attend
                cross = torch.nn.functional.scaled_dot_product_attention(q_text[None], tk[None], tv[None])[0]
                attn = attn + cross.view_as(attn)
                h = h + attn.transpose(0, 1).reshape(h.shape[0], -1) @ self.w_o[layer]
            if not self.skip_commit:
                state.commit(branch)
            outputs[branch] = h
        self.model_state[request.session_id] = self.model_state.get(request.session_id, 0) + 1
        return outputs


class WarmTinyPipeline(TinyPipeline):
    """TinyPipeline with a warmup provider: one one-frame request, then two-frame requests."""

    def ar_diffusion_warmup_requests(self, session_id: str):
        tpf = self.spec.tokens_per_frame
        for i, frames in enumerate([1] + [self.spec.frames_per_block] * 3):
            yield ARDiffusionRequest(
                f"warmup-{i}",
                {"frames": torch.zeros(frames * tpf, D_MODEL)},
                {"session_id": session_id},
            )


def request(session: str, step: int, *, frames: int = 2, seed: int = 0, tokens_per_frame: int = 4,
            **extra) -> ARDiffusionRequest:
    """A deterministic request for ``session`` at ``step`` (inputs depend on both)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{session}/{step}/{seed}".encode()))
    inputs = {"frames": torch.randn(frames * tokens_per_frame, D_MODEL, generator=gen)}
    return ARDiffusionRequest(f"{session}:{step}", inputs, {"session_id": session, **extra})
