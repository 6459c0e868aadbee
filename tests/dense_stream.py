"""A dense reference for paged attention, and a stream of random K/V that checks every layer against it.

The reference never touches the cache: :class:`Stream` keeps its own record of every committed frame's K/V per
layer, concatenates what the visible set must contain (sink frames, the newest window frames, the current block,
the registers) and runs ``scaled_dot_product_attention`` with grouped-query heads expanded by
``repeat_interleave``, in float32.

Tolerances: max abs error <= 1e-5 in float32; <= 2e-2 in bfloat16 and 5e-3 in float16 (the reference runs in
float32 on the same low-precision inputs, so the bound covers their rounding of the paged path's output and scores).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def dense_reference(q, keys, values, scale=None):
    """Non-causal attention of q (Hq, L, D) over keys/values (Hkv, S, D), in float32, no cache."""
    group = q.shape[0] // keys.shape[0]
    k = keys.float().repeat_interleave(group, dim=0)  # (Hq, S, D)
    v = values.float().repeat_interleave(group, dim=0)
    return F.scaled_dot_product_attention(q.float()[None], k[None], v[None], scale=scale)[0]


class Stream:
    """One (session, branch) of a rollout, with its own record of every committed frame's K/V per layer."""

    def __init__(self, state, branch: str, num_q_heads: int, dtype: torch.dtype, seed: int | torch.Generator):
        self.state, self.branch, self.num_q_heads, self.dtype = state, branch, num_q_heads, dtype
        self.generator = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
        self.frames: list = []  # frames[f][layer] = (k, v), each (Hkv, tokens_per_frame, D)
        self.worst = 0.0  # largest abs error seen
        self.num_checked = 0  # layers checked against the reference

    def visible_history(self, layer: int) -> list:
        spec = self.state.spec
        n = len(self.frames)
        kept = list(range(min(n, spec.sink_frames))) + list(range(max(spec.sink_frames, n - spec.window_frames), n))
        return [self.frames[f][layer] for f in kept]

    def forward(self, num_frames, *, commit, num_registers, scale=None, store_last=False):
        """A generator that runs one layer per ``next()`` and checks it; commits after the last layer.

        ``store_last``: the last layer of this commit pass writes its K/V with ``store`` (no attention), as a
        commit pass whose outputs nobody reads does; later passes check that it wrote what ``attend`` would.
        """
        spec = self.state.spec
        seq_len = num_frames * spec.tokens_per_frame
        length = seq_len + num_registers
        contexts = self.state.get_kv_caches(self.branch, seq_len=seq_len, commit_current=commit)
        new_frames = [[None] * spec.num_layers for _ in range(num_frames)]
        for layer, ctx in enumerate(contexts):
            shape = (spec.num_kv_heads, length, spec.head_size)
            q = torch.randn((self.num_q_heads, length, spec.head_size), generator=self.generator).to(self.dtype)
            k = torch.randn(shape, generator=self.generator).to(self.dtype)
            v = torch.randn(shape, generator=self.generator).to(self.dtype)
            history = self.visible_history(layer)
            if store_last and layer == spec.num_layers - 1:
                assert ctx.store(k, v) is None
            else:
                keys = torch.cat([hk for hk, _ in history] + [k], dim=1)
                values = torch.cat([hv for _, hv in history] + [v], dim=1)
                out = ctx.attend(q, k, v, scale=scale) if scale is not None else ctx.attend(q, k, v)
                assert out.shape == q.shape and out.dtype == self.dtype
                error = (out.float() - dense_reference(q, keys, values, scale)).abs().max().item()
                self.worst = max(self.worst, error)
                self.num_checked += 1
                assert error <= TOLERANCE[self.dtype], (
                    f"{self.branch} layer {layer}: max abs error {error} with {len(history)} history frames")
            for f in range(num_frames):
                tokens = slice(f * spec.tokens_per_frame, (f + 1) * spec.tokens_per_frame)
                new_frames[f][layer] = (k[:, tokens].clone(), v[:, tokens].clone())
            yield layer
        assert self.state.commit(self.branch) == (num_frames if commit else 0)
        if commit:
            self.frames.extend(new_frames)
        assert self.state.adapter(self.branch).num_committed_frames == len(self.frames)

    def run(self, num_frames, *, commit, num_registers, scale=None, store_last=False):
        for _ in self.forward(num_frames, commit=commit, num_registers=num_registers, scale=scale,
                              store_last=store_last):
            pass


def interleave(*forwards):
    """Advance several forwards one layer at a time, round robin."""
    active = list(forwards)
    while active:
        for fwd in list(active):
            try:
                next(fwd)
            except StopIteration:
                active.remove(fwd)
