"""Paged attention: what one self-attention layer sees of the KV core.

The model gets one :class:`ARDiffusionLayerContext` per layer from
``ARDiffusionKVState.get_kv_caches`` and calls :meth:`~ARDiffusionLayerContext.attend`
once per forward with its current ``q, k, v``. The context stages the current
K/V as scratch (the torch backend's gather workspace, or a kernel backend's
scratch pages), writes the block into freshly allocated pages on a commit
pass, and returns attention of the current queries over sink + window history
and the current tokens, non-causal within that visible set. A commit pass
whose outputs nobody reads may end with :meth:`~ARDiffusionLayerContext.store`
instead: the layer's K/V written, no attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ardiff_cli.runtime.errors import plural
from ardiff_cli.runtime.kv.allocator import KVCacheExhaustedError

if TYPE_CHECKING:
    from ardiff_cli.runtime.kv.state import ARDiffusionKVState, BranchKV


def attend_visible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Non-causal attention of ``q`` (Hq, L, D) over ``k``/``v`` (1, Hkv, S, D) -> (Hq, L, D).

    Grouped-query attention without copying K/V: with no mask every query row
    is independent, so the ``Hq / Hkv`` query heads of one group are stacked
    along the sequence axis of their shared KV head.
    """
    num_q_heads, length, head_size = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    q_grouped = q.reshape(1, num_kv_heads, group * length, head_size)  # (1, Hkv, G*L, D)
    out = F.scaled_dot_product_attention(q_grouped, k, v, scale=scale)  # (1, Hkv, G*L, D)
    # reshape, not view: fused kernels (CUDA flash / memory-efficient) return a (1, G*L, Hkv, D)
    # buffer transposed, which cannot be viewed as (Hq, L, D) when G > 1.
    return out.reshape(num_q_heads, length, head_size)


MAX_VALIDATED = 256  # signatures a cache remembers as validated (a few per pipeline: commit, denoise, store)


def _store_signature(k: torch.Tensor, v: torch.Tensor) -> tuple:
    """What the checks of a store's inputs depend on, besides the cache and seq_len: an attend's (``attend`` builds
    its own inline), with no q."""
    return (None, k.shape, v.shape, None, k.dtype, v.dtype, None, k.device, v.device, k.requires_grad,
            v.requires_grad)


class ARDiffusionForwardContext:
    """Branch-level state of one ``get_kv_caches`` call, shared by its layer contexts.

    Allocation is lazy: in-flight pages are taken when the first layer of a
    commit pass runs, so a branch that never runs allocates nothing.
    """

    __slots__ = ("state", "generation", "branch", "seq_len", "commit_current", "pool", "allocator", "inflight_pages",
                 "num_registers", "_prepared", "_inflight_ids", "_gather_ids", "_views", "_kernel_pool",
                 "_kernel_forward", "layers_written", "finished", "_checked", "_validated")

    def __init__(self, state: ARDiffusionKVState, branch: BranchKV, seq_len: int, commit_current: bool) -> None:
        cache = state._cache
        # Owning state; checked live (not closed, not reset since) on every call.
        self.state = state
        # The state's generation at creation; a reset or close bumps it and orphans this context.
        self.generation = state._generation
        # Per-session, per-branch sink + window bookkeeping.
        self.branch = branch
        # Current video tokens (whole frames) and whether they become history on commit.
        self.seq_len = seq_len
        self.commit_current = commit_current
        self.pool = cache.pool
        self.allocator = cache.allocator
        # Pages holding the current block during a commit pass; None until the first layer runs.
        self.inflight_pages: list[int] | None = None
        # Register tokens after the video tokens; fixed by the first layer that runs.
        self.num_registers: int | None = None
        # Set by the first layer: in-flight pages, history ids and workspace views are ready.
        self._prepared = False
        self._inflight_ids: torch.Tensor | None = None
        # torch path: the history's page ids (None without history) and the workspace views
        # (history, current K, current V, keys, values, block) every layer of this forward uses.
        self._gather_ids: torch.Tensor | None = None
        self._views: tuple[torch.Tensor, ...] | None = None
        # A pool laid out for a paged kernel (vllm_attention.PagedKernelPool) runs attention itself.
        self._kernel_pool = hasattr(self.pool, "plan_forward")
        self._kernel_forward = None
        # Which layers wrote their current K/V; commit requires all of them.
        self.layers_written = bytearray(cache.spec.num_layers)
        # Set by commit (or by the state when it orphans the context).
        self.finished = False
        # The last validated layer's inputs (shapes, dtypes, devices, grad flags): the next layers' with equal ones
        # skip validation.
        self._checked: tuple | None = None
        # Signatures (with seq_len) the cache has seen pass validation, in any forward: the checks are skipped.
        self._validated = cache.validated_inputs

    @property
    def allocated(self) -> bool:
        return self.inflight_pages is not None

    @property
    def num_layers_written(self) -> int:
        return sum(self.layers_written)

    def check_live(self, method: str) -> None:
        state = self.state
        if state._closed:  # the state's own words: a released session's pages may hold another session's KV now
            state._refuse(f"a layer context's {method}")
        if self.finished or self.generation != state._generation:
            if state.bound is False:  # kept past its request (the runner ended its forwards): as a kept state is told
                state._refuse(f"a layer context's {method}")
            raise RuntimeError(
                f"stale AR-Diffusion KV context for branch {self.branch.name!r} of session {state.session_id!r}: it "
                "was committed, replaced, or the state was reset, or it is an earlier request's; call get_kv_caches "
                "again"
            )

    def _prepare(self, num_registers: int, num_q_heads: int) -> None:
        """First layer of this forward: allocate in-flight pages and plan what every layer reads."""
        page_size = self.pool.layout.page_size
        video_pages = self.seq_len // page_size
        if self.commit_current:
            self.state._claim_slot(self.branch)
            try:
                self.inflight_pages = self.allocator.allocate(video_pages)
            except KVCacheExhaustedError as exc:
                raise KVCacheExhaustedError(
                    f"session {self.state.session_id!r}, branch {self.branch.name!r}: {exc}; the capacity plan "
                    "should have reserved these pages, so this is a bug in the plan or a leak"
                ) from exc
            self._inflight_ids = torch.tensor(self.inflight_pages, dtype=torch.long, device=self.pool.device)
        self.num_registers = num_registers
        if self._kernel_pool:  # paged-kernel layout: block tables of every layer, built once per forward
            scratch = self.pool.scratch_page_ids(self.branch.local_index)
            current = self.inflight_pages if self.commit_current else list(scratch[:video_pages])
            self._kernel_forward = self.pool.plan_forward(self.branch.page_ids() + current, current, self.seq_len,
                                                          num_registers, num_q_heads)
        else:
            # torch path: each layer gathers sink + window pages straight into the workspace and stages its
            # current block and registers right after them, the uncommitted block's scratch on this path
            # (one copy fewer per layer than writing scratch pages and gathering them back: 1% per block).
            num_history = self.branch.num_pages
            if num_history:
                if self.branch.history_ids is None:  # every pass of a block reads the same history
                    self.branch.history_ids = torch.tensor(self.branch.page_ids(), dtype=torch.long,
                                                           device=self.pool.device)
                self._gather_ids = self.branch.history_ids
            self._views = self.pool.visible_views(num_history, self.seq_len, num_registers)
        self._prepared = True

    def _validate(self, layer: int, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, signature: tuple) -> None:
        """One layer's inputs (``q`` None: a ``store``) checked, then the forward prepared by its first layer. The
        full checks run once per ``signature`` and seq_len in the cache; the layers after the first with the same
        inputs skip this call (``_checked``)."""
        if (signature, self.seq_len) not in self._validated:
            self._check(layer, q, k, v)
            if len(self._validated) >= MAX_VALIDATED:  # a caller whose shapes never repeat: bounded all the same
                self._validated.clear()
            self._validated.add((signature, self.seq_len))
        queries = k if q is None else q
        num_registers = queries.shape[1] - self.seq_len
        if not self._prepared:
            self._prepare(num_registers, queries.shape[0])
        elif num_registers != self.num_registers:
            raise ValueError(
                f"layer {layer} has {plural(num_registers, 'register token')}, earlier layers of this forward had "
                f"{self.num_registers}"
            )
        if q is not None:  # what the next layers must match to skip this call
            self._checked = signature

    def _check(self, layer: int, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> None:
        """The full checks of one layer's inputs against the pool's spec, dtype and device."""
        pool = self.pool
        spec = pool.layout.spec
        room = pool.layout.scratch_tokens - self.seq_len
        # a numpy array has a shape, a dtype and a device: as q (no requires_grad read) it got here
        self._not_tensors(layer, **({"k": k, "v": v} if q is None else {"q": q, "k": k, "v": v}))
        queries = k if q is None else q  # a store's K/V must have the shape an attend's would
        if (queries.dim() != 3 or tuple(k.shape) != (spec.num_kv_heads, queries.shape[1], spec.head_size)
                or tuple(v.shape) != tuple(k.shape) or queries.shape[2] != spec.head_size
                or queries.shape[0] % spec.num_kv_heads or not queries.shape[0]):
            # One message with the whole layout: tokens passed before heads used to be told a token count taken
            # from q's heads.
            takes = ("store takes k, v" if q is None else "attend takes q (heads, tokens, head_size) and k, v")
            got = f"k {tuple(k.shape)}, v {tuple(v.shape)}" if q is None else \
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            heads = "" if q is None else f" and q's heads a positive multiple of {spec.num_kv_heads}"
            raise ValueError(
                f"layer {layer} of branch {self.branch.name!r}: {takes} ({spec.num_kv_heads}, tokens, "
                f"{spec.head_size}), with tokens = seq_len {self.seq_len} (+ up to {room} register tokens){heads}; "
                f"got {got}{self._spec_disagrees(queries, k, v, room)}"
            )
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t is not None and (t.dtype != pool.dtype or t.device != pool.device):  # a store has no q
                # Named with its layer and branch as a shape error is: a model with one layer in another dtype.
                raise ValueError(
                    f"layer {layer} of branch {self.branch.name!r}: {name} must be {pool.dtype} on {pool.device} "
                    f"like the KV pool (the dtype and device from_config was given), got {t.dtype} on {t.device}"
                )
        if k.requires_grad or v.requires_grad:
            # Copied in place into buffers every session shares: autograd would take them over and fail
            # every later request of every session.
            raise ValueError(
                f"layer {layer}: k and v require grad, but the KV cache is inference-only; run the pipeline's "
                "forward under torch.no_grad() or torch.inference_mode()"
            )
        num_registers = queries.shape[1] - self.seq_len
        if not 0 <= num_registers <= room:
            # Too many: registers the model adds past what its spec declares; name the layer and the field to raise.
            declared = (f" (layer {layer} of branch {self.branch.name!r}; the spec declares "
                        f"max_scratch_tokens_per_branch={spec.max_scratch_tokens_per_branch})" if num_registers > 0
                        else "")
            raise ValueError(
                f"{'attend' if q is not None else 'store'} got {plural(queries.shape[1], 'token')} for "
                f"seq_len={self.seq_len}: "
                f"expected the video tokens followed by 0..{room} scratch register tokens{declared}"
            )

    def _spec_disagrees(self, queries: torch.Tensor, k: torch.Tensor, v: torch.Tensor, room: int) -> str:
        """When ``q``/``k``/``v`` agree with each other (k and v alike, q's head size theirs, q's heads a multiple of
        theirs, whole tokens of this forward) and only their heads or head size differ from the spec: the fields of
        the pipeline's spec that the model contradicts, and the fix ('' for a layout mistake, tokens before heads).
        The shape alone said "(2, tokens, 8) ... got k (2, 5, 16)", not that ar_diffusion_kv_cache_spec() was wrong."""
        spec = self.pool.layout.spec
        if (queries.dim() != 3 or tuple(v.shape) != tuple(k.shape) or queries.shape[1:] != k.shape[1:]
                or not k.shape[0] or not queries.shape[0] or queries.shape[0] % k.shape[0]
                or not self.seq_len <= k.shape[1] <= self.seq_len + room):
            return ""
        said = [f"{field}={declared} where the model's k has {size}"
                for field, declared, size in (("num_kv_heads", spec.num_kv_heads, k.shape[0]),
                                              ("head_size", spec.head_size, k.shape[2])) if declared != size]
        return (f": the pipeline's ar_diffusion_kv_cache_spec() declares {' and '.join(said)}; make the spec "
                "(its Config.kv_cache_spec(), which inspect-capacity plans from) give the model's sizes"
                if said else "")

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        self.check_live("attend")
        try:
            signature = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                         k.requires_grad, v.requires_grad)  # what the checks depend on, as _store_signature
        except AttributeError:  # no cost until raised: a None or numpy array read "has no attribute 'shape'"
            self._not_tensors(layer, q=q, k=k, v=v)
            raise
        if self._checked != signature:
            self._validate(layer, q, k, v, signature)
        if self.layers_written[layer]:  # a second call would replace this layer's current K/V: history lost
            self._written_twice(layer)
        pool = self.pool
        if self._kernel_pool:  # vLLM / paged-kernel backends write, pack and attend in the pool
            out = pool.attend(layer, self._kernel_forward, q, k, v, scale)
            self.layers_written[layer] = 1
            return out
        history, current_k, current_v, keys, values, block = self._views
        if self._gather_ids is not None:
            pool.gather_into(layer, self._gather_ids, history)  # (2, H, n, P, D)
        current_k.copy_(k)  # the current block, then its registers
        current_v.copy_(v)
        if self.commit_current:  # the staged block (not its registers) goes to its pages, K and V at once
            pool.write_pages(layer, self._inflight_ids, block)
        self.layers_written[layer] = 1
        return attend_visible(q, keys, values, scale)

    def _not_tensors(self, layer: int, **given: object) -> None:
        """The ``ValueError`` for inputs that are not torch tensors (None, a numpy array, a list), named with the layer,
        the branch and the shapes expected; returns when all are tensors (an ``AttributeError`` of a tensor subclass
        is left to be raised as it is)."""
        wrong = {name: t for name, t in given.items() if not isinstance(t, torch.Tensor)}
        if not wrong:
            return
        spec = self.pool.layout.spec
        takes = "attend takes q (heads, tokens, head_size) and k, v" if "q" in given else "store takes k, v"
        kinds = {name: type(t) for name, t in wrong.items()}
        got = ", ".join(f"{name} None" if t is type(None) else f"{name} {t.__qualname__}" if t.__module__ == "builtins"
                        else f"{name} {t.__module__}.{t.__qualname__}" for name, t in kinds.items())
        raise ValueError(
            f"layer {layer} of branch {self.branch.name!r}: {takes} ({spec.num_kv_heads}, tokens, {spec.head_size}) "
            f"as torch tensors ({self.pool.dtype} on {self.pool.device}, like the KV pool); got {got}"
        ) from None

    def _written_twice(self, layer: int) -> None:
        raise RuntimeError(
            f"layer {layer} of branch {self.branch.name!r} attended twice in one forward; each self-attention "
            "layer calls attend (or store) once per get_kv_caches (a spec's num_layers counts every such call)"
        )

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``layer``'s current block into its pages without attending (a commit pass only)."""
        self.check_live("store")
        if not self.commit_current:
            raise RuntimeError(
                f"layer {layer} of branch {self.branch.name!r}: store writes a commit pass's K/V, but this forward "
                "was not asked to commit (get_kv_caches(..., commit_current=True)); a denoising pass attends"
            )
        try:
            signature = _store_signature(k, v)
        except AttributeError:
            self._not_tensors(layer, k=k, v=v)
            raise
        self._validate(layer, None, k, v, signature)
        if self.layers_written[layer]:
            self._written_twice(layer)
        pool = self.pool
        if self._kernel_pool:
            pool.write_current(layer, self._kernel_forward, k, v)
        else:  # the block is staged where attend stages it, then written to its pages as attend writes it
            _, current_k, current_v, _, _, block = self._views
            video = slice(0, self.seq_len)
            current_k[:, video].copy_(k[:, video])
            current_v[:, video].copy_(v[:, video])
            pool.write_pages(layer, self._inflight_ids, block)
        self.layers_written[layer] = 1


class ARDiffusionLayerContext:
    """One self-attention layer's handle on the paged KV of one branch forward."""

    __slots__ = ("layer", "_forward")

    def __init__(self, layer: int, forward: ARDiffusionForwardContext) -> None:
        self.layer = layer  # layer index into the pools
        self._forward = forward  # shared branch-level state of this forward

    @property
    def seq_len(self) -> int:
        return self._forward.seq_len

    @property
    def commit_current(self) -> bool:
        return self._forward.commit_current

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Write the current K/V and attend over history + current.

        ``q`` is ``(Hq, L, D)`` and ``k``/``v`` are ``(Hkv, L, D)`` with ``Hq`` a
        multiple of ``Hkv`` (grouped-query attention). The first ``seq_len``
        tokens are the current video block (already rotated with their
        absolute positions); any remaining tokens are scratch registers that
        are visible to this forward but never committed. Returns ``(Hq, L, D)``.
        """
        return self._forward.attend(self.layer, q, k, v, scale)

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the current K/V without attending: a commit pass's last layer, when nothing reads its output.

        ``k``/``v`` are ``(Hkv, L, D)`` as :meth:`attend` takes them (register tokens, if any, are checked as
        attend checks them, then left out: never committed). Only in a commit pass (``commit_current=True``);
        the layer counts as written, as after ``attend``. What the layer's attention, and everything after it,
        would have computed is skipped.
        """
        self._forward.store(self.layer, k, v)
