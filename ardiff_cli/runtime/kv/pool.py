"""The torch backend's per-layer K/V page pools and gather workspace, preallocated once.

Layout (one tensor for the whole worker, allocated once)::

    kv[layer, 0 | 1, head, page, token_in_page, dim]        0 = K, 1 = V

    page ids:  0        1 .. M
               null     managed (allocator)

    workspace: one layer's [ gathered sink + window pages | current block | registers ]

The uncommitted block and its registers live in the workspace, right after
the gathered history: that tail is this backend's scratch. Writing them into
scratch pages and gathering them back would cost one more copy per layer
(measured 1% of a rolling block). Paged-kernel backends (vllm_attention.py)
keep scratch pages in their pool instead, since their kernels read pages.

Why heads before pages: the torch attention path gathers a session's pages
with one ``index_select`` over the page axis, and with heads first the result
is already ``(heads, tokens, dim)`` as ``scaled_dot_product_attention`` wants
it, so no transpose copy follows. Measured side by side on 2 CPU cores (12 heads
x 64, 520-token pages, 10 visible frames, float32): heads-first gather + SDPA
ran at 0.98x of SDPA on contiguous K/V, token-major ``(page, token, head, dim)``
gather + transpose at 1.06x in the same run. ``benchmarks/bench_attention.py``
re-measures the heads-first path (1.008 in ``benchmarks/results.json``).
"""

from __future__ import annotations

import torch

from ardiff_cli.runtime.kv.layout import KVLayout


class KVPagePool:
    """The worker's self-attention pages and gather workspace (torch backend)."""

    block_format = "torch"  # plain heads-first pages, recorded in swap snapshots (ARDiffusionKVState.export)

    def __init__(self, layout: KVLayout, num_managed_pages: int, dtype: torch.dtype, device: torch.device | str) -> None:
        spec = layout.spec
        # Geometry this pool was sized for.
        self.layout = layout
        # Pages the allocator may hand out (ids 1 .. num_managed_pages).
        self.num_managed_pages = num_managed_pages
        assert not layout.scratch_in_pages, "the torch pool stages scratch in its workspace; plan it that way"
        # Page count of every layer's pool, null + managed.
        self.num_pages = 1 + num_managed_pages
        self.dtype = dtype
        # All K/V storage, zeroed so the null page reads as zeros.
        self.kv = torch.zeros(
            (spec.num_layers, 2, spec.num_kv_heads, self.num_pages, layout.page_size, spec.head_size),
            dtype=dtype,
            device=device,
        )
        # The storage's own device: "cuda" becomes "cuda:0", which is what input tensors report.
        self.device = self.kv.device
        # One layer's largest visible K and V; reused by every gather (layers run one at a time).
        self._workspace = torch.empty(
            2 * spec.num_kv_heads * layout.max_visible_pages * layout.page_size * spec.head_size,
            dtype=dtype,
            device=self.device,
        )

        # Per-layer views (2, H, pages, P, D): indexing the 6-D tensor on every call costs more than small copies.
        self._layers = self.kv.unbind(0)
        # Workspace views per (history pages, current tokens); the workspace never moves, so they stay valid.
        self._visible_views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of tensor storage this pool holds (pages + workspace)."""
        return self.kv.untyped_storage().nbytes() + self._workspace.untyped_storage().nbytes()

    def write_pages(self, layer: int, page_ids: torch.Tensor, block: torch.Tensor) -> None:
        """Store ``block`` ``(2, H, n, P, D)`` (K and V of n pages, e.g. a workspace view) into ``page_ids``."""
        self._layers[layer].index_copy_(2, page_ids, block)

    def visible_views(self, num_history_pages: int, num_video_tokens: int, num_registers: int) -> tuple:
        """The workspace as one forward's visible K/V: history pages, the current block, its registers.

        Returns ``(history (2, H, n, P, D), current_k (H, T, D), current_v (H, T, D), keys (1, H, S, D),
        values (1, H, S, D), block (2, H, m, P, D))`` with ``T`` = video + register tokens, ``S = n * P + T``
        and ``block`` the current video tokens as whole pages (what a commit pass writes to its pages).
        Views of the shared workspace, cached per shape (the workspace never moves); valid until the next
        layer writes.
        """
        key = (num_history_pages, num_video_tokens, num_registers)
        views = self._visible_views.get(key)
        if views is None:
            spec, page_size = self.layout.spec, self.layout.page_size
            history_tokens = num_history_pages * page_size
            video_end = history_tokens + num_video_tokens
            total = video_end + num_registers
            assert total <= self.layout.max_visible_pages * page_size, "visible set exceeds the workspace"
            ws = self._workspace[: 2 * spec.num_kv_heads * total * spec.head_size].view(
                2, spec.num_kv_heads, total, spec.head_size)  # (2, H, S, D)
            views = (ws[:, :, :history_tokens].unflatten(2, (num_history_pages, page_size)),
                     ws[0, :, history_tokens:], ws[1, :, history_tokens:], ws[0, None], ws[1, None],
                     ws[:, :, history_tokens:video_end].unflatten(2, (num_video_tokens // page_size, page_size)))
            self._visible_views[key] = views
        return views

    def page_content_shapes(self, num_pages: int) -> dict[str, tuple[int, ...]]:
        """Shapes of :meth:`read_page_contents` for ``num_pages`` pages."""
        spec = self.layout.spec
        return {"kv": (spec.num_layers, 2, spec.num_kv_heads, num_pages, self.layout.page_size, spec.head_size)}

    def read_page_contents(self, page_ids: list[int]) -> dict[str, torch.Tensor]:
        """Every layer's K and V of ``page_ids``, in that order, copied to the CPU: what attention reads of them
        (swapping a session out). One layer at a time: on a GPU, a copy of the whole session would need that much
        device memory free at an eviction, when the pool holds nearly all of it."""
        ids = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        out = torch.empty((self.kv.shape[0], *self._layers[0].shape[:2], len(page_ids), *self.kv.shape[4:]),
                          dtype=self.dtype)  # (L, 2, H, n, P, D), on the CPU
        for layer, pages in enumerate(self._layers):
            out[layer].copy_(pages.index_select(2, ids))
        return {"kv": out}

    def write_page_contents(self, page_ids: list[int], contents: dict[str, torch.Tensor]) -> None:
        """Store what :meth:`read_page_contents` returned into ``page_ids`` (restoring a session), bit for bit, one
        layer at a time (as it was read)."""
        ids = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        for layer, pages in enumerate(self._layers):
            pages.index_copy_(2, ids, contents["kv"][layer].to(self.device))

    def gather_into(self, layer: int, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        """K and V of ``page_ids`` of one layer into ``out`` ``(2, H, n, P, D)`` (a view of the workspace)."""
        torch.index_select(self._layers[layer], 2, page_ids, out=out)
