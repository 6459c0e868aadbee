"""The worker's KV cache: allocator + pools, and the factory of per-session states.

This is the layer the runner talks to; it never sees tensors of a session
except through :class:`ARDiffusionKVState`.
"""

from __future__ import annotations

import torch

from ardiff_cli.runtime.capability import ARDiffusionKVCacheSpec
from ardiff_cli.runtime.kv.allocator import PageAllocator
from ardiff_cli.runtime.kv.layout import KVLayout
from ardiff_cli.runtime.kv.pool import KVPagePool
from ardiff_cli.runtime.kv.state import ARDiffusionKVState


class ARDiffusionKVCache:
    """Pages for ``num_managed_pages`` plus scratch, shared by every session of one worker."""

    def __init__(
        self,
        spec: ARDiffusionKVCacheSpec,
        num_managed_pages: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        page_size: int | None = None,
        scratch_blocks: int | None = None,
    ) -> None:
        if not isinstance(spec, ARDiffusionKVCacheSpec):
            raise TypeError(f"spec must be an ARDiffusionKVCacheSpec, got {type(spec).__name__}")
        layout = KVLayout.from_spec(spec, page_size=page_size, scratch_blocks=scratch_blocks)
        visible = layout.max_visible_pages * layout.page_size
        if visible > spec.max_model_len:
            raise ValueError(
                f"one attention call can see {visible} tokens (sink + window + block + scratch), "
                f"more than max_model_len={spec.max_model_len}"
            )
        if num_managed_pages < layout.managed_pages(1):
            raise ValueError(
                f"num_managed_pages={num_managed_pages} cannot hold one session: it needs "
                f"{layout.managed_pages(1)} ({layout.pages_per_session} resident + {layout.inflight_pages} in flight)"
            )
        self.spec = spec  # geometry and policy from the pipeline
        self.layout = layout  # pages per frame, scratch size, byte arithmetic
        self.allocator = PageAllocator(1 + num_managed_pages)  # managed ids 1..M; 0 is the null page
        self.pool = KVPagePool(layout, num_managed_pages, dtype, device)  # the tensors

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def num_managed_pages(self) -> int:
        return self.allocator.num_allocatable

    def new_state(self, session_id: str) -> ARDiffusionKVState:
        """A fresh, empty state for ``session_id``; it allocates nothing until used."""
        return ARDiffusionKVState(self, session_id)
