"""Derived KV geometry: how a spec maps onto pages, frames and scratch.

Pure arithmetic shared by the pools (which allocate) and the capacity planner
(which must not). No torch import.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ardiff_cli.runtime.capability import ARDiffusionKVCacheSpec, as_int
from ardiff_cli.runtime.errors import ConfigError, plural

SCRATCH_ENV = "AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH"


def scratch_blocks_from_env() -> int:
    """Scratch per branch requested by ``AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH``, in paged KV blocks.

    A block is the spec's paged KV block: ``tokens_per_frame`` tokens (one latent frame), not a model block of
    ``frames_per_block`` frames. The value can only raise the derived minimum (``frames_per_block`` blocks plus
    the blocks the register tokens need), never lower it. Unset means 1 (the derived minimum applies). Anything
    other than a positive integer is a ``ConfigError`` (a ``ValueError``) naming the variable and its value.
    """
    raw = os.environ.get(SCRATCH_ENV)
    if raw is None or raw.strip() == "":
        return 1
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{SCRATCH_ENV} must be a positive integer number of blocks, got {raw!r}",
                          hint="unset it (1 block), or set it to a whole number of blocks such as 2")
    return value


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How one spec is laid out in pages. All counts are per worker.

    A *frame* is the retention unit (sink/window count frames); a *page* is
    the paging unit (``page_size`` tokens). A frame spans ``pages_per_frame``
    whole pages, so eviction frees whole pages and capacity stays exact.
    """

    spec: ARDiffusionKVCacheSpec
    page_size: int  # tokens per page; divides tokens_per_frame
    scratch_tokens: int  # scratch tokens per local branch slot (block + registers, maybe raised)
    # Where the uncommitted block and registers live. Paged kernels (vLLM) read them from scratch
    # pages in the pool, one region per local slot. The torch backend stages them in its gather
    # workspace right after the gathered history (one copy fewer per layer), so it has no scratch
    # pages; the workspace is sized for history + scratch_tokens either way.
    scratch_in_pages: bool = True

    @classmethod
    def from_spec(
        cls,
        spec: ARDiffusionKVCacheSpec,
        *,
        page_size: int | None = None,
        scratch_blocks: int | None = None,
        attention_backend: str = "torch",
    ) -> KVLayout:
        # Whole numbers only (numpy's too, made ints): '2' failed as a TypeError in a comparison, and 2.0 or True
        # were taken, 2.0 giving a plan of float byte counts.
        given = page_size
        page_size = spec.tokens_per_frame if page_size is None else as_int(page_size)
        if page_size is None or page_size <= 0 or spec.tokens_per_frame % page_size:
            raise ValueError(
                f"page_size must be a positive divisor of tokens_per_frame={spec.tokens_per_frame}, got {given!r}"
                + ("" if page_size is not None else " (an int: a whole number of tokens)")
            )
        blocks = scratch_blocks_from_env() if scratch_blocks is None else as_int(scratch_blocks)
        if blocks is None or blocks <= 0:
            raise ValueError(f"scratch_blocks must be positive, got {scratch_blocks!r}"
                             + ("" if blocks is not None else " (an int: a whole number of blocks)"))
        block_tokens = spec.frames_per_block * spec.tokens_per_frame
        derived = block_tokens + spec.max_scratch_tokens_per_branch
        layout = cls(
            spec=spec,
            page_size=page_size,
            # the variable counts paged KV blocks of tokens_per_frame tokens, as the spec's block size is
            scratch_tokens=max(derived, blocks * spec.tokens_per_frame),
            scratch_in_pages=attention_backend != "torch",
        )
        # The longest call: the whole sink + window, the block and every register (tokens, not the pages the scratch
        # rounds up to: a pipeline whose max_model_len was exactly that was refused, told of up to a page more).
        visible = layout.retained_frames * spec.tokens_per_frame + layout.scratch_tokens
        if visible > spec.max_model_len:  # here, so the capacity plan refuses what loading would
            hint = "use a smaller window or fewer sink frames, or raise the pipeline's max_model_len"
            if layout.scratch_tokens > derived:  # the variable raised scratch: name it if the window alone fits
                # (raises the window's own error if it does not; "use a smaller window" sent users to a config
                # that fitted)
                cls.from_spec(spec, page_size=page_size, scratch_blocks=1, attention_backend=attention_backend)
                hint = (f"lower {SCRATCH_ENV} (now {plural(blocks, 'block')} of "
                        f"{plural(spec.tokens_per_frame, 'token')}), or unset it")
            raise ConfigError(
                f"one attention call can see {visible} tokens (sink + window + block + scratch), "
                f"more than max_model_len={spec.max_model_len}",
                hint=hint,
            )
        return layout

    @property
    def pages_per_frame(self) -> int:
        return self.spec.tokens_per_frame // self.page_size

    @property
    def block_tokens(self) -> int:
        return self.spec.frames_per_block * self.spec.tokens_per_frame

    @property
    def retained_frames(self) -> int:
        """Frames one branch keeps between requests: sink + window."""
        return self.spec.sink_frames + self.spec.window_frames

    @property
    def pages_per_session(self) -> int:
        """Managed pages one session holds at rest, over all local branch slots."""
        return self.spec.num_local_kv_branches * self.retained_frames * self.pages_per_frame

    @property
    def inflight_pages(self) -> int:
        """Extra managed pages a commit pass holds before old frames are evicted.

        One block per local slot: a CFG pipeline may run its commit pass on
        every branch before committing any of them.
        """
        return self.spec.num_local_kv_branches * self.spec.frames_per_block * self.pages_per_frame

    @property
    def scratch_pages_per_slot(self) -> int:
        return math.ceil(self.scratch_tokens / self.page_size)

    @property
    def scratch_pages(self) -> int:
        """Scratch pages in the pool, all slots (none when the workspace stages the block)."""
        return self.spec.num_local_kv_branches * self.scratch_pages_per_slot if self.scratch_in_pages else 0

    @property
    def max_visible_pages(self) -> int:
        """Pages one attention call can see: sink + window + current block + registers."""
        return self.retained_frames * self.pages_per_frame + self.scratch_pages_per_slot

    def managed_pages(self, num_sessions: int) -> int:
        """Allocatable pages for ``num_sessions`` resident sessions."""
        return num_sessions * self.pages_per_session + self.inflight_pages

    def total_pages(self, num_sessions: int) -> int:
        """Pages in each layer's pool: null page + managed + scratch."""
        return 1 + self.managed_pages(num_sessions) + self.scratch_pages

    def bytes_per_token(self, dtype_size: int) -> int:
        """Self-attention K and V bytes of one token over all layers, one branch."""
        spec = self.spec
        return 2 * spec.num_layers * spec.num_kv_heads * spec.head_size * dtype_size

    def bytes_per_page(self, dtype_size: int) -> int:
        return self.page_size * self.bytes_per_token(dtype_size)

    def workspace_bytes(self, dtype_size: int) -> int:
        """The gather buffer: K and V of one layer's largest visible set."""
        spec = self.spec
        return 2 * spec.num_kv_heads * self.max_visible_pages * self.page_size * spec.head_size * dtype_size

    def cross_bytes(self, name: str, dtype_size: int) -> int:
        """K and V bytes of one named cross-attention cache, all layers, one branch."""
        heads, tokens, head_size = self.spec.cross_geometry(name)
        return 2 * self.spec.num_layers * heads * tokens * head_size * dtype_size
