"""The worker's KV cache: allocator + pools, and the factory of per-session states.

This is the layer the runner talks to; it never sees tensors of a session
except through :class:`ARDiffusionKVState`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

import torch

from ardiff_cli.runtime.capability import ARDiffusionKVCacheSpec
from ardiff_cli.runtime.capacity import MODEL_DTYPES, model_dtype_name
from ardiff_cli.runtime.errors import ConfigError
from ardiff_cli.runtime.kv.allocator import PageAllocator
from ardiff_cli.runtime.kv.layout import KVLayout, as_int
from ardiff_cli.runtime.kv.pool import KVPagePool
from ardiff_cli.runtime.kv.state import ARDiffusionKVState

if TYPE_CHECKING:
    from ardiff_cli.runtime.kv.vllm_attention import PagedKernel


KV_DTYPES = {name: getattr(torch, name) for name in MODEL_DTYPES}


def kv_dtype(dtype: object, where: str) -> torch.dtype:
    """The torch dtype of the KV pools for ``dtype``, a torch dtype or any name ``model_dtype_name`` reads
    ('bfloat16', 'fp16'); a ``ConfigError`` naming ``where`` for any other. The planner sizes float8 too, but attention
    does not run in it: a float8 pool failed at the first commit ("index_copy_cpu" not implemented), a float64 or
    int32 one was taken, and a name was a TypeError from torch.zeros."""
    name = model_dtype_name(dtype)
    if name is None:
        raise ConfigError(f"{where}: unsupported KV dtype {dtype!r}; expected one of {', '.join(MODEL_DTYPES)}",
                          hint="pass a torch.dtype or its name, such as torch.bfloat16 or 'bfloat16' (the model's "
                               "activation dtype)")
    return KV_DTYPES[name]


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
        attention_backend: str | PagedKernel = "torch",
    ) -> None:
        if not isinstance(spec, ARDiffusionKVCacheSpec):
            raise TypeError(f"spec must be an ARDiffusionKVCacheSpec, got {type(spec).__name__}")
        dtype = kv_dtype(dtype, "ARDiffusionKVCache()")
        given, num_managed_pages = num_managed_pages, as_int(num_managed_pages)
        if num_managed_pages is None:
            raise ValueError(f"num_managed_pages must be an integer, got {given!r}")
        # Any paged-kernel backend reads the uncommitted block from scratch pages; torch stages it.
        backend_kind = "torch" if isinstance(attention_backend, str) and attention_backend == "torch" else "vllm"
        layout = KVLayout.from_spec(spec, page_size=page_size, scratch_blocks=scratch_blocks,
                                    attention_backend=backend_kind)
        if num_managed_pages < layout.managed_pages(1):
            raise ValueError(
                f"num_managed_pages={num_managed_pages} cannot hold one session: it needs "
                f"{layout.managed_pages(1)} ({layout.pages_per_session} resident + {layout.inflight_pages} in flight)"
            )
        self.spec = spec  # geometry and policy from the pipeline
        # the spec as a session's snapshot records it (JSON's types): restored only under the same spec
        self.spec_record = json.loads(json.dumps(dataclasses.asdict(spec)))
        self.layout = layout  # pages per frame, scratch size, byte arithmetic
        self.allocator = PageAllocator(1 + num_managed_pages)  # managed ids 1..M; 0 is the null page
        # The tensors, in the layout the attention backend reads: "torch" = heads-first pages + gather
        # workspace (KVPagePool); "vllm" = blocks of vLLM's kernel for this device; a PagedKernel instance
        # = that kernel's block layout (tests use vllm_attention.TorchPagedKernel). Same bytes either way.
        # Normal tensors even when built under torch.inference_mode() (an engine loaded in a server's
        # inference-mode start-up): every forward writes them in place, which torch refuses for inference
        # tensors outside inference mode, so every request made without it failed.
        with torch.inference_mode(False):
            if isinstance(attention_backend, str) and attention_backend == "torch":
                self.pool = KVPagePool(layout, num_managed_pages, dtype, device)
            else:
                from ardiff_cli.runtime.kv import vllm_attention

                if attention_backend == "vllm":
                    kernel = vllm_attention.vllm_kernel_for(layout, dtype, torch.device(device))
                elif isinstance(attention_backend, vllm_attention.PagedKernel):
                    kernel = attention_backend
                else:
                    raise ValueError(
                        f"attention_backend must be 'torch', 'vllm' or a PagedKernel, got {attention_backend!r}"
                    )
                self.pool = vllm_attention.PagedKernelPool(layout, num_managed_pages, dtype, device, kernel)
        # "torch" or "vllm" (a PagedKernel instance is named by the kernel).
        self.attention_backend = attention_backend if isinstance(attention_backend, str) else attention_backend.name
        # Layer inputs (shapes, dtypes, devices, grad flags, seq_len) that passed the full checks of attend or store:
        # they depend on nothing else, so a forward whose first layer has these skips them (2% of a tiny request).
        self.validated_inputs: set[tuple] = set()

    def release(self) -> None:
        """Drop the pool's tensors (its runner is closing): their memory goes back now, even while something still
        references the cache. The allocator stays, for the pool's final counts; no state may be used after this."""
        self.pool = None

    @property
    def attention_description(self) -> str:
        """The backend, and for paged kernels their block geometry, in words."""
        if self.attention_backend == "torch":
            return f"torch (gather + scaled_dot_product_attention, {self.layout.page_size}-token pages)"
        return f"{self.attention_backend}: {self.pool.description}"

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def num_managed_pages(self) -> int:
        return self.allocator.num_allocatable

    def new_state(self, session_id: str) -> ARDiffusionKVState:
        """A fresh, empty state for ``session_id``; it allocates nothing until used."""
        return ARDiffusionKVState(self, session_id)
