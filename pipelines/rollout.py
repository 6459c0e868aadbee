"""How a pipeline's sampler reaches the transformer and one session's KV.

A sampler is written once against six operations:

    num_frames(branch)                   committed frames = absolute index of the next frame (RoPE position)
    has_cross / set_cross / cross        named cross-attention caches of one branch
    run(branch, segment, commit=...)     one transformer forward; ``commit=True`` makes the segment history
    commit(branch, segment)              a commit pass with no outputs: only the K/V that become history
    reset(keep=())                       drop all history (positions restart at 0) and the caches not kept

:class:`PagedRollout` maps them onto the bound ``ARDiffusionKVState``: the
production path. :class:`DenseReferenceRollout` keeps the *inputs* of the
committed segments instead of their K/V and recomputes the whole retained
history densely on every call, under the explicit mask of
``pipelines.wan.block_causal_mask``. Running the same sampler through both
must give the same outputs; that is the equivalence test of the paged KV.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch

from pipelines.wan import Segment, SegmentOutput, WanTransformer


class PagedRollout:
    """The bound KV state of one session, for the duration of one forward."""

    def __init__(self, model: WanTransformer, state, cross_names: Sequence[str]) -> None:
        self.model = model  # the transformer; its layers attend through the state's contexts
        self.state = state  # ARDiffusionKVState, owned by the runner; never kept beyond the forward
        self.cross_names = tuple(cross_names)  # caches every forward reads: ("text",) or ("text", "image")
        self.tokens_per_frame = state.spec.tokens_per_frame

    def num_frames(self, branch: str) -> int:
        return self.state.adapter(branch).num_committed_frames

    def has_cross(self, branch: str, name: str) -> bool:
        return self.state.has_cross_attention(branch, name)

    def set_cross(self, branch: str, name: str, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.state.populate_cross_attention(branch, name, pairs)

    def cross(self, branch: str, name: str):
        return self.state.cross_attention(branch, name)

    def run(self, branch: str, seg: Segment, *, commit: bool) -> SegmentOutput:
        contexts = self.state.get_kv_caches(branch, seq_len=seg.num_frames * self.tokens_per_frame,
                                            commit_current=commit)
        out = self.model(seg, [ctx.attend for ctx in contexts], *self._cross_kv(branch))
        if commit:
            self.state.commit(branch)
        return out

    def commit(self, branch: str, seg: Segment) -> None:
        """Make ``seg`` history, computing only its K/V (``WanTransformer.commit_forward``)."""
        contexts = self.state.get_kv_caches(branch, seq_len=seg.num_frames * self.tokens_per_frame,
                                            commit_current=True)
        self.model.commit_forward(seg, [ctx.attend for ctx in contexts], contexts[-1].store, *self._cross_kv(branch))
        self.state.commit(branch)

    def _cross_kv(self, branch: str):
        text_kv = self.cross(branch, "text")
        image_kv = self.cross(branch, "image") if "image" in self.cross_names else None
        return text_kv, image_kv

    def reset(self, keep: Sequence[str] = ()) -> None:
        self.state.reset(keep_cross_attention=tuple(keep))


class DenseReferenceRollout:
    """The same operations with no KV cache: committed segment inputs are kept and recomputed every call."""

    def __init__(self, model: WanTransformer, *, sink_frames: int, window_frames: int,
                 cross_names: Sequence[str]) -> None:
        self.model = model
        self.sink_frames = sink_frames
        self.window_frames = window_frames
        self.cross_names = tuple(cross_names)
        self.history: dict[str, list[Segment]] = defaultdict(list)  # branch -> committed segments, in order
        self._cross: dict[tuple[str, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def num_frames(self, branch: str) -> int:
        return sum(seg.num_frames for seg in self.history[branch])

    def has_cross(self, branch: str, name: str) -> bool:
        return (branch, name) in self._cross

    def set_cross(self, branch: str, name: str, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # History is recomputed with the current caches, which is only what the paged path did if they never
        # changed under it; a mid-history replacement (a prompt switch) is outside what this reference models.
        if self.history[branch] and (branch, name) in self._cross:
            raise ValueError(f"dense reference: cache {name!r} of {branch!r} replaced under live history (not modelled)")
        self._cross[(branch, name)] = [(k.clone(), v.clone()) for k, v in pairs]

    def cross(self, branch: str, name: str):
        return self._cross[(branch, name)]

    def run(self, branch: str, seg: Segment, *, commit: bool) -> SegmentOutput:
        text_kv = self.cross(branch, "text")
        image_kv = self.cross(branch, "image") if "image" in self.cross_names else None
        out = self.model.reference_forward(self.history[branch], seg, sink_frames=self.sink_frames,
                                           window_frames=self.window_frames, text_kv=text_kv, image_kv=image_kv)
        if commit:
            self.history[branch].append(seg)
        return out

    def commit(self, branch: str, seg: Segment) -> None:
        """Nothing to compute: the segment's K/V are recomputed from its inputs whenever a later call needs them."""
        for name in self.cross_names:  # a commit without its caches fails here, as the paged path's does
            self.cross(branch, name)
        self.history[branch].append(seg)

    def reset(self, keep: Sequence[str] = ()) -> None:
        self.history.clear()
        self._cross = {key: pairs for key, pairs in self._cross.items() if key[1] in keep}
