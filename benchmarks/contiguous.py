"""The baseline KV cache: contiguous per-layer K/V that shift on every eviction (Self-Forcing / CausVid style).

This is how the public Self-Forcing and CausVid inference code keeps history:
one preallocated K and one V tensor per layer, history at the front, the
current block written right after it, attention over one contiguous slice,
and on overflow the surviving window copied left over the evicted frames
(a clone, then an assignment). Written here from that description, for the
benchmarks only; it is not part of ``ardiff``.

Layout of one branch (all layers in one tensor, heads first so a slice is
already what ``scaled_dot_product_attention`` wants)::

    k[layer, head, token, dim]
          token:  0 ............ s*p ............. r*p ......... r*p + n ....... cap
                  | sink (s fr.) | window (<= w fr.) | current block | registers |
                  `------------ r resident frames --'
    commit:  r += block frames; if r > s + w, frames s .. s+e-1 are dropped by
             copying tokens (s+e)*p .. r*p to s*p (e = r - s - w): the shift.

:class:`ContiguousRollout` exposes the six operations of ``pipelines.rollout``
(``num_frames``, ``has_cross``/``set_cross``/``cross``, ``run``, ``commit``, ``reset``), so
a pipeline's own sampler (``pipeline.step``) runs unchanged on top of it and
does exactly the math it does over the paged KV.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from pipelines.wan import Segment, SegmentOutput


class ContiguousKV:
    """Sink + sliding-window K/V of one branch in contiguous tensors, shifted on eviction."""

    def __init__(self, *, num_layers: int, num_heads: int, head_size: int, tokens_per_frame: int, sink_frames: int,
                 window_frames: int, max_segment_frames: int, max_registers: int, dtype: torch.dtype) -> None:
        self.tokens_per_frame = tokens_per_frame  # tokens of one latent frame
        self.sink_frames = sink_frames  # first frames kept forever
        self.window_frames = window_frames  # newest frames kept after the sink
        # history + the largest segment one forward writes + its registers
        capacity = (sink_frames + window_frames + max_segment_frames) * tokens_per_frame + max_registers
        shape = (num_layers, num_heads, capacity, head_size)
        self.k = torch.zeros(shape, dtype=dtype)  # (layers, H, capacity, D), on the CPU
        self.v = torch.zeros(shape, dtype=dtype)
        self.resident_frames = 0  # frames held: sink first, then the window, oldest to newest
        self.committed_frames = 0  # absolute frames committed (RoPE position of the next frame)
        self.num_shifts = 0  # evictions so far (each one copies the surviving window)

    @property
    def nbytes(self) -> int:
        return self.k.untyped_storage().nbytes() + self.v.untyped_storage().nbytes()

    def attend_fns(self, seg_frames: int, *, frame_causal: bool = False) -> list:
        """One ``attend(q, k, v)`` per layer for a segment of ``seg_frames`` frames after the history.

        ``frame_causal`` masks the segment block-causally by frame (a multi-frame prefill that must equal
        one commit pass per frame); otherwise the segment is non-causal, as one block is.
        """
        start = self.resident_frames * self.tokens_per_frame
        tokens_per_frame = self.tokens_per_frame
        masks: dict[int, torch.Tensor] = {}

        def mask_for(length: int) -> torch.Tensor | None:
            if not frame_causal:
                return None
            if length not in masks:
                video = seg_frames * tokens_per_frame
                frame = torch.arange(length, device=self.k.device) // tokens_per_frame
                frame = torch.where(torch.arange(length, device=self.k.device) < video, frame, seg_frames)
                seg = frame[:, None] >= frame[None, :]  # (L, L): a frame sees itself and earlier frames
                history = torch.ones(length, start, dtype=torch.bool, device=self.k.device)
                masks[length] = torch.cat([history, seg], dim=1)  # (L, start + L)
            return masks[length]

        def make(layer: int):
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                end = start + q.shape[1]
                self.k[layer, :, start:end].copy_(k)  # the current segment's K/V, after the history
                self.v[layer, :, start:end].copy_(v)
                keys = self.k[layer, None, :, :end]  # (1, H, S, D): one contiguous slice per head
                values = self.v[layer, None, :, :end]
                return F.scaled_dot_product_attention(q[None], keys, values, attn_mask=mask_for(q.shape[1]))[0]

            return attend

        return [make(layer) for layer in range(self.k.shape[0])]

    def store_fn(self, seg_frames: int):
        """``store(k, v)`` of the last layer: the segment's K/V written after the history, nothing attended."""
        start, layer = self.resident_frames * self.tokens_per_frame, self.k.shape[0] - 1
        end = start + seg_frames * self.tokens_per_frame

        def store(k: torch.Tensor, v: torch.Tensor) -> None:
            self.k[layer, :, start:end].copy_(k[:, : end - start])
            self.v[layer, :, start:end].copy_(v[:, : end - start])

        return store

    def commit(self, num_frames: int) -> None:
        """The segment just written becomes history; frames past sink + window are shifted out."""
        self.resident_frames += num_frames
        self.committed_frames += num_frames
        overflow = self.resident_frames - self.sink_frames - self.window_frames
        if overflow > 0:
            p = self.tokens_per_frame
            keep_from, keep_to = (self.sink_frames + overflow) * p, self.resident_frames * p
            dest = self.sink_frames * p
            for cache in (self.k, self.v):
                # clone first: source and destination overlap (Self-Forcing's rolling update does the same)
                cache[:, :, dest:dest + keep_to - keep_from] = cache[:, :, keep_from:keep_to].clone()
            self.resident_frames -= overflow
            self.num_shifts += 1

    def clear(self) -> None:
        self.resident_frames = 0
        self.committed_frames = 0


class ContiguousRollout:
    """``pipelines.rollout``'s six operations over :class:`ContiguousKV` per branch (the baseline path)."""

    def __init__(self, model, spec, *, cross_names: Sequence[str], dtype: torch.dtype,
                 max_segment_frames: int | None = None, lean_commits: bool = False) -> None:
        self.model = model  # the same transformer the paged path runs
        self.cross_names = tuple(cross_names)
        # How ``commit`` runs a sampler's commit pass: every layer, its output thrown away, as the public
        # Self-Forcing and CausVid code does, though without its head (False); or only as far as the last layer's
        # K/V, as ardiff does (True).
        self.lean_commits = lean_commits
        self.tokens_per_frame = spec.tokens_per_frame
        segment_frames = spec.frames_per_block if max_segment_frames is None else max_segment_frames
        self.kv = {
            b.name: ContiguousKV(num_layers=spec.num_layers, num_heads=spec.num_kv_heads, head_size=spec.head_size,
                                 tokens_per_frame=spec.tokens_per_frame, sink_frames=spec.sink_frames,
                                 window_frames=spec.window_frames, max_segment_frames=segment_frames,
                                 max_registers=spec.max_scratch_tokens_per_branch, dtype=dtype)
            for b in spec.kv_branches
        }
        self._cross: dict[tuple[str, str], tuple[tuple[torch.Tensor, torch.Tensor], ...]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage: self-attention buffers plus cross-attention caches."""
        cross = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes()
                    for pairs in self._cross.values() for k, v in pairs)
        return sum(kv.nbytes for kv in self.kv.values()) + cross

    def num_frames(self, branch: str) -> int:
        return self.kv[branch].committed_frames

    def has_cross(self, branch: str, name: str) -> bool:
        return (branch, name) in self._cross

    def set_cross(self, branch: str, name: str, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._cross[(branch, name)] = tuple((k.clone(), v.clone()) for k, v in pairs)

    def cross(self, branch: str, name: str):
        return self._cross[(branch, name)]

    def run(self, branch: str, seg: Segment, *, commit: bool, return_video: bool = True,
            frame_causal: bool = False) -> SegmentOutput:
        kv, cross = self._prepare(branch, seg)
        out = self.model(seg, kv.attend_fns(seg.num_frames, frame_causal=frame_causal), *cross,
                         return_video=return_video)
        if commit:
            kv.commit(seg.num_frames)
        return out

    def commit(self, branch: str, seg: Segment) -> None:
        """A commit pass nobody reads the output of: see ``lean_commits``."""
        if not self.lean_commits:
            self.run(branch, seg, commit=True, return_video=False)  # every layer; the head skipped, as before
            return
        kv, cross = self._prepare(branch, seg)
        self.model.commit_forward(seg, kv.attend_fns(seg.num_frames), kv.store_fn(seg.num_frames), *cross)
        kv.commit(seg.num_frames)

    def _prepare(self, branch: str, seg: Segment) -> tuple[ContiguousKV, tuple]:
        """The branch's K/V and its (text, image or None) caches, for a segment at the next uncommitted frame."""
        kv = self.kv[branch]
        assert seg.first_frame == kv.committed_frames, "a segment must start at the next uncommitted frame"
        image_kv = self.cross(branch, "image") if "image" in self.cross_names else None
        return kv, (self.cross(branch, "text"), image_kv)

    def reset(self, keep: Sequence[str] = ()) -> None:
        for kv in self.kv.values():
            kv.clear()
        self._cross = {key: pairs for key, pairs in self._cross.items() if key[1] in keep}
