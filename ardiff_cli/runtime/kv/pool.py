"""Per-layer K/V page pools and the scratch region, preallocated once.

Layout (one tensor for the whole worker, allocated once)::

    kv[layer, 0 | 1, head, page, token_in_page, dim]        0 = K, 1 = V

    page ids:  0        1 .. M                 M+1 .. M+S
               null     managed (allocator)    scratch, S/num_slots per local slot

Why heads before pages: the torch attention path gathers a session's pages
with one ``index_select`` over the page axis, and with heads first the result
is already ``(heads, tokens, dim)`` as ``scaled_dot_product_attention`` wants
it, so no transpose copy follows. Measured on 2 CPU cores (12 heads x 64,
520-token pages, 10 visible frames, float32): heads-first gather + SDPA ran at
0.98x of SDPA on contiguous K/V, token-major ``(page, token, head, dim)``
gather + transpose at 1.06x. ``benchmarks/bench_attention.py`` re-measures it.
"""

from __future__ import annotations

import torch

from ardiff_cli.runtime.kv.layout import KVLayout


class KVPagePool:
    """The worker's self-attention pages, scratch pages and gather workspace."""

    def __init__(self, layout: KVLayout, num_managed_pages: int, dtype: torch.dtype, device: torch.device | str) -> None:
        spec = layout.spec
        # Geometry this pool was sized for.
        self.layout = layout
        # Pages the allocator may hand out (ids 1 .. num_managed_pages).
        self.num_managed_pages = num_managed_pages
        # First scratch page id; scratch is never allocated or freed.
        self.scratch_base = 1 + num_managed_pages
        # Page count of every layer's pool, null + managed + scratch.
        self.num_pages = self.scratch_base + layout.scratch_pages
        self.dtype = dtype
        self.device = torch.device(device)
        # All K/V storage, zeroed so the null page and unused scratch read as zeros.
        self.kv = torch.zeros(
            (spec.num_layers, 2, spec.num_kv_heads, self.num_pages, layout.page_size, spec.head_size),
            dtype=dtype,
            device=self.device,
        )
        # One layer's largest visible K and V; reused by every gather (layers run one at a time).
        self._workspace = torch.empty(
            2 * spec.num_kv_heads * layout.max_visible_pages * layout.page_size * spec.head_size,
            dtype=dtype,
            device=self.device,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of tensor storage this pool holds (pages + workspace)."""
        return self.kv.untyped_storage().nbytes() + self._workspace.untyped_storage().nbytes()

    def scratch_page_ids(self, local_index: int) -> range:
        """The scratch pages of one local branch slot, contiguous."""
        per_slot = self.layout.scratch_pages_per_slot
        start = self.scratch_base + local_index * per_slot
        return range(start, start + per_slot)

    def write_pages(self, layer: int, page_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` of shape ``(H, n * page_size, D)`` into pages ``page_ids`` (n of them)."""
        heads, _, head_size = k.shape
        shape = (heads, page_ids.numel(), self.layout.page_size, head_size)
        self.kv[layer, 0].index_copy_(1, page_ids, k.reshape(shape))  # (H, n, P, D)
        self.kv[layer, 1].index_copy_(1, page_ids, v.reshape(shape))

    def write_scratch(self, layer: int, local_index: int, token_offset: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` of shape ``(H, T, D)`` at ``token_offset`` of a slot's scratch."""
        pages = self.scratch_page_ids(local_index)
        end = token_offset + k.shape[1]
        for which, src in ((0, k), (1, v)):
            region = self.kv[layer, which, :, pages.start : pages.stop]  # (H, S, P, D), a view
            region.view(region.shape[0], -1, region.shape[-1])[:, token_offset:end].copy_(src)

    def gather(self, layer: int, page_ids: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``page_ids`` in order, truncated to ``num_tokens``: each ``(1, H, num_tokens, D)``.

        The result lives in the shared workspace and is valid until the next gather.
        """
        spec = self.layout.spec
        n = page_ids.numel()
        assert n <= self.layout.max_visible_pages, f"gather of {n} pages exceeds the workspace sized for visible sets"
        shape = (2, spec.num_kv_heads, n, self.layout.page_size, spec.head_size)
        out = self._workspace[: 2 * spec.num_kv_heads * n * self.layout.page_size * spec.head_size].view(shape)
        torch.index_select(self.kv[layer], 2, page_ids, out=out)  # (2, H, n, P, D)
        flat = out.view(2, 1, spec.num_kv_heads, n * self.layout.page_size, spec.head_size)
        return flat[0, :, :, :num_tokens], flat[1, :, :, :num_tokens]

