"""Per-session KV: sink + window bookkeeping per branch, and the state the model binds.

``BranchKV`` is the one place that maps frames to pages. ``ARDiffusionKVState``
is what a pipeline sees for the duration of one forward.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ardiff_cli.runtime.capacity import as_int
from ardiff_cli.runtime.errors import plural
from ardiff_cli.runtime.kv.allocator import KVCacheExhaustedError, PageAllocator
from ardiff_cli.runtime.kv.attention import ARDiffusionForwardContext, ARDiffusionLayerContext

if TYPE_CHECKING:
    from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache


@dataclass(frozen=True, slots=True)
class BranchAdapter:
    """A read-only snapshot of one branch of one session."""

    request_id: str  # "<session_id>/<branch>": stable for the session's lifetime
    branch: str  # logical branch name
    local_index: int  # worker-local storage slot
    num_committed_frames: int  # absolute index of the next frame to commit (RoPE position)
    num_resident_frames: int  # sink + window frames currently held
    page_ids: tuple[int, ...]  # resident pages in attention order (sink first, then oldest to newest)


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """The committed KV of one session, off the device: what swapping a session out keeps.

    ``tensors`` (CPU, the pool's dtype): ``self/<branch>/<part>`` the raw contents of the branch's pages in
    attention order (sink first, then oldest to newest; parts as the pool names them), ``cross/<branch>/<name>``
    a published cross-attention cache stacked ``(layers, 2, heads, tokens, dim)``. ``metadata`` (JSON-able): per
    branch ``num_committed_frames``, ``num_sink_pages`` and ``num_window_pages``.
    """

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]


class BranchKV:
    """Sink + sliding-window retention of one branch of one session.

    Layout of the block table after ``n`` committed frames, with ``s`` sink
    frames, ``w`` window frames and ``p`` pages per frame::

        absolute frame:  0 .. s-1        n-w .. n-1
                         +-----------+   +---------------------+
        block table:     | sink      |   | window (newest w)   |
                         +-----------+   +---------------------+
        pages:           s * p            <= w * p
                         kept forever     oldest frame freed when a commit overflows it

    Frames ``s .. n-w-1`` are gone: their pages went back to the allocator the
    moment they left the window. The table holds at most ``(s + w) * p`` ids
    and ``num_committed_frames`` (an int) is the only thing that grows.
    """

    __slots__ = ("name", "local_index", "_sink", "_window", "_sink_capacity", "_window_capacity",
                 "_pages_per_frame", "num_committed_frames", "adapter_snapshot", "history_ids")

    def __init__(self, name: str, local_index: int, sink_frames: int, window_frames: int, pages_per_frame: int):
        self.name = name
        self.local_index = local_index
        self._sink: list[int] = []  # pages of the first sink_frames frames
        self._window: deque[int] = deque()  # pages of the newest frames, oldest at the left
        self._sink_capacity = sink_frames * pages_per_frame
        self._window_capacity = window_frames * pages_per_frame
        self._pages_per_frame = pages_per_frame
        self.num_committed_frames = 0  # absolute frame count; grows without bound
        self.adapter_snapshot: BranchAdapter | None = None  # the state's last adapter(), until the next change
        # page_ids() as a tensor for the torch gather, until the next change: every pass of a block reads it.
        self.history_ids: torch.Tensor | None = None

    def page_ids(self) -> list[int]:
        return self._sink + list(self._window)

    @property
    def num_pages(self) -> int:
        return len(self._sink) + len(self._window)

    def commit(self, pages: list[int], allocator: PageAllocator) -> None:
        """Append the pages of whole new frames; free what falls out of the window."""
        assert len(pages) % self._pages_per_frame == 0, "commit of a partial frame: page count not frame-aligned"
        self.adapter_snapshot = self.history_ids = None
        fill = min(len(pages), self._sink_capacity - len(self._sink))
        self._sink.extend(pages[:fill])
        self._window.extend(pages[fill:])
        evicted = [self._window.popleft() for _ in range(max(0, len(self._window) - self._window_capacity))]
        if evicted:
            allocator.free(evicted)
        self.num_committed_frames += len(pages) // self._pages_per_frame

    def restore(self, num_committed_frames: int, sink: list[int], window: list[int]) -> None:
        """Take ``sink`` and ``window`` pages (already allocated and written) as the history of an empty branch."""
        assert not self.num_pages and not self.num_committed_frames, "restore into a branch that holds history"
        self.adapter_snapshot = self.history_ids = None
        self._sink.extend(sink)
        self._window.extend(window)
        self.num_committed_frames = num_committed_frames

    def split(self) -> tuple[int, int]:
        """(sink pages, window pages) held now."""
        return len(self._sink), len(self._window)

    def release(self, allocator: PageAllocator) -> None:
        """Free every page and forget the history (positions restart at frame 0)."""
        pages = self.page_ids()
        self.adapter_snapshot = self.history_ids = None
        self._sink.clear()
        self._window.clear()
        self.num_committed_frames = 0
        if pages:
            allocator.free(pages)


_AS_IT_IS = contextlib.nullcontext()  # enters nothing; reusable, so the hot path makes no object


class ARDiffusionKVState:
    """The runner-owned KV of one session, bound to the pipeline for one forward.

    Branch names index everything. Self-attention goes through the per-layer
    contexts of :meth:`get_kv_caches`; cross-attention through named caches
    published with :meth:`populate_cross_attention`.
    """

    def __init__(self, cache: ARDiffusionKVCache, session_id: str) -> None:
        spec = cache.spec
        self._cache = cache  # pools, allocator and geometry shared by all sessions of the worker
        self.session_id = session_id
        # Retention bookkeeping per logical branch; pages are taken lazily on commit passes.
        self._branches = {
            b.name: BranchKV(b.name, b.local_index, spec.sink_frames, spec.window_frames, cache.layout.pages_per_frame)
            for b in spec.kv_branches
        }
        # The live forward context of each branch, if any.
        self._pending: dict[str, ARDiffusionForwardContext | None] = dict.fromkeys(self._branches)
        # Published cross-attention caches: (branch, name) -> one (k, v) per layer.
        self._cross: dict[tuple[str, str], tuple[tuple[torch.Tensor, torch.Tensor], ...]] = {}
        # The version counter of each cache's tensors as published: cross_attention() hands out the cache itself, and
        # a forward writing it in place (a rotary embedding or a scale applied with k.mul_) changed the session's
        # history without a word, further at each request. Its tensors are made outside inference mode to have one.
        self._cross_versions: dict[tuple[str, str], tuple[int, ...]] = {}
        # Bumped by reset and close so contexts handed out earlier fail loudly.
        self._generation = 0
        self._closed = False
        # The runner's states are bound to the pipeline around one forward (True) and not between requests (False),
        # when the forward's calls raise, reads (adapter, cross_attention) as well as changes: the contract says the
        # pipeline must not retain the state, and one kept read this session's KV into another session's forward.
        # The runner's own calls on a state it holds go through _adapter, _export, _restore and _close; the public
        # export, restore and close refuse it. None: a state made with ARDiffusionKVCache.new_state and driven
        # directly (tests, tools), refused nothing until it is closed.
        self.bound: bool | None = None

    # ------------------------------------------------------------------ views
    @property
    def spec(self):
        return self._cache.spec

    @property
    def closed(self) -> bool:
        return self._closed

    def _branch(self, branch: str) -> BranchKV:
        try:
            return self._branches[branch]
        except KeyError:
            raise KeyError(
                f"unknown AR-Diffusion KV branch {branch!r}; valid branches: {list(self._branches)}"
            ) from None

    def _check_open(self, method: str) -> None:
        if self._closed:
            self._refuse(method)

    def _check_bound(self, method: str) -> None:
        """The forward's calls, reads as well as changes, on a state the runner holds between requests: kept past
        its forward (into another session's forward, a lifecycle hook), it read the session's KV into another
        session's outputs, or freed, extended or overwrote it outside any request of it."""
        if self._closed or self.bound is False:
            self._refuse(method)

    def _refuse(self, method: str) -> None:
        where = f"{method}() on the AR-Diffusion KV state of session {self.session_id!r}"
        keep = ("the pipeline must not retain it; use the state the binding gives each request, and drop it when the "
                "context exits")
        if self._closed and self.bound is None:
            raise RuntimeError(f"{where}: the state is closed")
        if self._closed:
            raise RuntimeError(
                f"{where}: the state is closed: the runner released the session (closed, reset, evicted or swapped "
                "out) and freed its pages, which may hold another session's KV now (a session swapped back in gets "
                f"a new state); {keep}")
        raise RuntimeError(
            f"{where} outside its request: the runner binds a session's state only around one forward "
            f"(bind_ar_diffusion_state), and {keep}")

    def _check_unheld(self, method: str) -> None:
        """export, restore and close of a state the runner holds are the runner's (``_export``, ``_restore``,
        ``_close``): a pipeline's close freed a resident session's pages under the runner, its restore wrote KV the
        session never computed, and its export read a session outside its request."""
        self._check_open(method)  # a state the runner released is closed: no longer held
        if self.bound is not None:
            raise RuntimeError(
                f"{method}() on the AR-Diffusion KV state of session {self.session_id!r}, which the runner holds: "
                "the runner exports, restores and closes its sessions' KV itself; a pipeline uses only the state "
                "its binding gives, through the forward's calls (a session ends with reset_session or "
                "close_session, or a request's reset or close_session)")

    def adapter(self, branch: str) -> BranchAdapter:
        """A snapshot of ``branch``: committed frames and resident pages."""
        self._check_bound("adapter")
        return self._adapter(branch)

    def _adapter(self, branch: str) -> BranchAdapter:
        """``adapter`` of a state the runner holds, bound or not: its views of the session."""
        self._check_open("adapter")
        kv = self._branch(branch)
        if kv.adapter_snapshot is None:  # immutable, so one snapshot serves until the branch changes
            pages = tuple(kv.page_ids())
            kv.adapter_snapshot = BranchAdapter(
                request_id=f"{self.session_id}/{kv.name}",
                branch=kv.name,
                local_index=kv.local_index,
                num_committed_frames=kv.num_committed_frames,
                num_resident_frames=len(pages) // self._cache.layout.pages_per_frame,
                page_ids=pages,
            )
        return kv.adapter_snapshot

    @property
    def num_pages(self) -> int:
        """Managed pages held now: resident history plus any in-flight block."""
        held = sum(kv.num_pages for kv in self._branches.values())
        return held + sum(len(fc.inflight_pages or ()) for fc in self._pending.values() if fc is not None)

    def page_ids(self) -> list[int]:
        """The managed pages counted by ``num_pages``: every branch's history, then any in-flight block."""
        held = [page_id for kv in self._branches.values() for page_id in kv.page_ids()]
        inflight = [fc.inflight_pages or () for fc in self._pending.values() if fc is not None]
        return held + [page_id for pages in inflight for page_id in pages]

    @property
    def cross_attention_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for pairs in self._cross.values() for k, v in pairs)

    def uncommitted_branches(self) -> list[str]:
        """Branches whose commit pass allocated pages that ``commit`` has not yet taken."""
        return [
            name
            for name, forward in self._pending.items()
            if forward is not None and forward.commit_current and forward.allocated and not forward.finished
        ]

    def end_request(self) -> None:
        """The forward is over (the runner calls this after checking ``uncommitted_branches``): its contexts go
        stale and what only they used goes, each branch's gather index included, so that a session at rest holds
        exactly the bytes the capacity plan counts."""
        self._finish_forwards()
        for kv in self._branches.values():
            kv.history_ids = None

    def _finish_forwards(self) -> None:
        """Every pending forward's contexts go stale and are forgotten (in-flight pages are the caller's)."""
        for name, forward in self._pending.items():
            if forward is not None:
                forward.finished = True
                self._pending[name] = None

    def has_cross_attention(self, branch: str, name: str) -> bool:
        self._check_bound("has_cross_attention")
        kv = self._branch(branch)
        self.spec.cross_geometry(name)  # KeyError for unknown names
        return (kv.name, name) in self._cross

    # ---------------------------------------------------------- self-attention
    def get_kv_caches(
        self, branch: str, seq_len: int, commit_current: bool = False
    ) -> list[ARDiffusionLayerContext]:
        """One context per layer for one forward of ``branch`` over ``seq_len`` video tokens.

        ``seq_len`` is a whole number of frames, at most one block. With
        ``commit_current`` the current block is written into managed pages and
        :meth:`commit` makes it history; otherwise it lives in scratch and is
        forgotten. Nothing is allocated until a layer attends.
        """
        self._check_bound("get_kv_caches")
        kv = self._branch(branch)
        layout = self._cache.layout
        tokens_per_frame = layout.spec.tokens_per_frame
        given, seq_len = seq_len, as_int(seq_len)  # numpy's int64 too, as the runtime's other integers
        if seq_len is None or seq_len <= 0 or seq_len % tokens_per_frame:
            raise ValueError(
                f"seq_len must be a positive whole number of frames (multiple of tokens_per_frame="
                f"{tokens_per_frame}), got {given!r}"
            )
        if seq_len > layout.block_tokens:
            raise ValueError(
                f"seq_len={seq_len} exceeds one block ({plural(layout.spec.frames_per_block, 'frame')} = "
                f"{plural(layout.block_tokens, 'token')})"
            )
        pending = self._pending[kv.name]
        if pending is not None and pending.commit_current and pending.allocated and not pending.finished:
            raise RuntimeError(
                f"AR-Diffusion KV context of branch {kv.name!r} replaced before its current block was committed; "
                f"call commit({kv.name!r}) after the commit pass"
            )
        if pending is not None:
            pending.finished = True
        forward = ARDiffusionForwardContext(self, kv, seq_len, bool(commit_current))
        self._pending[kv.name] = forward
        return [ARDiffusionLayerContext(i, forward) for i in range(layout.spec.num_layers)]

    def _claim_slot(self, kv: BranchKV) -> None:
        """A local slot holds one branch's pages per session: capacity counts one window per slot."""
        for other in self._branches.values():
            forward = self._pending[other.name]
            busy = other.num_pages > 0 or (forward is not None and forward.allocated and not forward.finished)
            if other is not kv and other.local_index == kv.local_index and busy:
                raise RuntimeError(
                    f"branches {other.name!r} and {kv.name!r} share local_index {kv.local_index} and cannot both "
                    f"hold KV in session {self.session_id!r} on one worker; give them distinct local_index values"
                )

    def commit(self, branch: str) -> int:
        """Make the current block of ``branch`` history; return the frames committed.

        A no-op (0) when the last forward was not a commit pass or never ran.
        """
        self._check_bound("commit")
        kv = self._branch(branch)
        forward = self._pending[kv.name]
        self._pending[kv.name] = None
        if forward is None or forward.finished:
            return 0
        # Whatever the pass was, its contexts are stale from here on: a commit pass that had not
        # attended yet would otherwise allocate in-flight pages no state tracks (a leak).
        forward.finished = True
        if not forward.commit_current or not forward.allocated:
            return 0
        written = forward.num_layers_written
        if written != len(forward.layers_written):
            self._cache.allocator.free(forward.inflight_pages)
            raise RuntimeError(
                f"commit of branch {kv.name!r} after a partial forward: {written} of "
                f"{plural(len(forward.layers_written), 'layer')} wrote their K/V; the block was discarded"
            )
        kv.commit(forward.inflight_pages, self._cache.allocator)
        return forward.seq_len // self._cache.spec.tokens_per_frame

    # --------------------------------------------------------- cross-attention
    def populate_cross_attention(
        self, branch: str, name: str, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Publish cache ``name`` of ``branch`` from exactly one ``(k, v)`` per layer.

        Each ``k``/``v`` is ``(num_kv_heads, num_tokens, head_size)`` of the
        cache's geometry, in the pool's dtype and device. The cache becomes
        readable only once the iterable completes; on any failure the
        previous complete cache (or its absence) is left as it was.
        """
        self._check_bound("populate_cross_attention")
        kv = self._branch(branch)
        heads, tokens, head_size = self.spec.cross_geometry(name)
        expected = (heads, tokens, head_size)
        pool = self._cache.pool
        num_layers = self.spec.num_layers
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        where = f"cross-attention {name!r} of branch {kv.name!r} (session {self.session_id!r})"
        try:
            for layer, pair in enumerate(pairs):
                if layer >= num_layers:
                    raise ValueError(f"{where}: more than num_layers={num_layers} (k, v) pairs")
                if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                    raise ValueError(f"{where}: layer {layer} yielded {type(pair).__name__}, expected a (k, v) pair")
                copies = []
                # The copies are made outside inference mode, for a version counter (see _cross_versions), and with no
                # graph: inference_mode(False) turns grad mode on, even under the caller's no_grad(). A forward under
                # no_grad() (the pipelines' usual) is both already: entering the two for each pair doubled the
                # publish's cost for nothing. Asked for each pair: a generator that yields inside its own
                # inference_mode() block hands its mode to this loop with each pair. Entered around none of the
                # pipeline's code (its iterable runs as it was called).
                outside = not torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
                with (_AS_IT_IS if outside else torch.inference_mode(False)), (
                        _AS_IT_IS if outside else torch.no_grad()):
                    for label, t in zip("kv", pair):
                        if not isinstance(t, torch.Tensor) or tuple(t.shape) != expected:
                            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                            raise ValueError(f"{where}: layer {layer} {label} must be shaped (num_kv_heads, "
                                             f"num_tokens, head_size) {expected}, got {got}"
                                             f"{self._cross_declared(name, got)}")
                        if t.dtype != pool.dtype or t.device != pool.device:
                            raise ValueError(
                                f"{where}: layer {layer} {label} must be {pool.dtype} on {pool.device} like the KV "
                                f"pool (the dtype and device from_config was given), got {t.dtype} on {t.device}"
                            )
                        if t.requires_grad:  # its copy would hold the graph that made it for the session's life
                            raise ValueError(f"{where}: layer {layer} {label} requires grad, but the KV cache is "
                                             "inference-only; run the pipeline's forward under torch.no_grad() or "
                                             "torch.inference_mode()")
                        try:
                            copies.append(torch.empty(expected, dtype=pool.dtype, device=pool.device).copy_(t))
                        except torch.OutOfMemoryError as exc:
                            raise KVCacheExhaustedError(
                                f"{where}: out of memory allocating layer {layer} "
                                f"({2 * t.nbytes * num_layers} bytes for the whole cache)"
                            ) from exc
                staged.append((copies[0], copies[1]))
            if len(staged) != num_layers:
                raise ValueError(f"{where}: got {len(staged)} (k, v) pairs, expected num_layers={num_layers}")
        except BaseException:
            staged.clear()  # drop the partial copies now; the published cache is untouched
            raise
        self._check_open("populate_cross_attention")  # the iterable may have closed us re-entrantly
        self._publish((kv.name, name), tuple(staged))

    def _publish(self, key: tuple[str, str], pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> None:
        self._cross[key] = pairs
        self._cross_versions[key] = tuple(t._version for pair in pairs for t in pair)

    def cross_attention_written(self) -> list[str]:
        """The published caches whose tensors were written in place since they were published, each as
        ``"'text' of branch 'main' (layer 0 k)"`` naming its first written tensor (the runner checks this after
        each forward: only populate_cross_attention may change a cache)."""
        written = []
        for key, pairs in self._cross.items():
            versions, now = self._cross_versions[key], tuple(t._version for pair in pairs for t in pair)
            if now != versions:  # a host-side counter: no device sync
                first = next(i for i, (a, b) in enumerate(zip(now, versions)) if a != b)
                written.append(f"{key[1]!r} of branch {key[0]!r} (layer {first // 2} {'kv'[first % 2]})")
        return written

    def _cross_declared(self, name: str, got: object) -> str:
        """Where the sizes of cache ``name`` that ``got`` (a tensor's shape) differs in come from: the fields of the
        pipeline's spec that declare them (a text encoder's 77 tokens published to a cache declared with 64 read only
        "must be shaped (2, 64, 8), got (2, 77, 8)", naming neither num_tokens nor where it is set)."""
        if not isinstance(got, tuple) or len(got) != 3:
            return ""
        cache = next(c for c in self.spec.cross_attention if c.name == name)
        said = []
        for size, field in zip(got, ("num_kv_heads", "num_tokens", "head_size")):
            own = getattr(cache, field)
            declared = own if own is not None else getattr(self.spec, field)
            if size != declared:
                said.append(f"{field}={declared}" if own is not None else
                            f"no {field} (so the spec's own {field}={declared})")
        return (f": the pipeline's ar_diffusion_kv_cache_spec() declares cross_attention {name!r} with "
                f"{' and '.join(said)}" if said else "")

    def cross_attention(self, branch: str, name: str) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Per-layer ``(k, v)`` of a published cache; reading an unpublished cache raises."""
        if self._closed or self.bound is False:  # the hot path (every layer of every denoising step): flags only
            self._refuse("cross_attention")
        pairs = self._cross.get((branch, name))
        if pairs is not None:
            return pairs
        kv = self._branch(branch)  # KeyError for unknown branches
        self.spec.cross_geometry(name)  # KeyError for unknown names
        raise RuntimeError(
            f"cross-attention {name!r} of branch {kv.name!r} (session {self.session_id!r}) read before "
            "populate_cross_attention completed; the runner never recomputes it silently"
        )

    # ------------------------------------------------------------------ swap
    def export(self) -> KVSnapshot:
        """A copy of the committed state on the CPU: every branch's pages (all layers, K and V, as attention
        reads them) and every published cross-attention cache. :meth:`restore` of it into a fresh state of a
        cache with the same geometry and dtype gives the same state, bit for bit. Refused on a state the runner
        holds (its swap-out calls ``_export``)."""
        self._check_unheld("export")
        return self._export()

    def _export(self) -> KVSnapshot:
        self._check_open("export")
        assert not self.uncommitted_branches(), "export of a state with a commit pass in flight"
        pool = self._cache.pool
        tensors: dict[str, torch.Tensor] = {}
        branches: dict[str, dict[str, int]] = {}
        for name, kv in self._branches.items():
            num_sink, num_window = kv.split()
            branches[name] = {"num_committed_frames": kv.num_committed_frames, "num_sink_pages": num_sink,
                              "num_window_pages": num_window}
            for part, contents in pool.read_page_contents(kv.page_ids()).items():
                tensors[f"self/{name}/{part}"] = contents
        for (branch, name), pairs in self._cross.items():
            # stacked on the host, pair by pair: no device copy of every layer's cache at an eviction
            tensors[f"cross/{branch}/{name}"] = torch.stack([torch.stack([k.cpu(), v.cpu()]) for k, v in pairs])
        return KVSnapshot(tensors=tensors, metadata={"branches": branches, "spec": self._cache.spec_record,
                                                     "block_format": pool.block_format})

    def restore(self, snapshot: KVSnapshot) -> None:
        """Load ``snapshot`` (from :meth:`export`) into this fresh state: allocate pages, write their contents,
        rebuild each branch's sink and window, publish the cross-attention caches. A snapshot that does not fit
        this cache (branches, page counts, shapes, dtype) is a ``ValueError`` naming what differs; on any
        failure the state is left empty, its pages freed. Refused on a state the runner holds (its swap-in calls
        ``_restore``)."""
        self._check_unheld("restore")
        self._restore(snapshot)

    def _restore(self, snapshot: KVSnapshot) -> None:
        self._check_open("restore")
        if self.num_pages or self._cross:
            raise RuntimeError(f"restore into KV state of session {self.session_id!r}, which holds KV already")
        plan = self.check_snapshot(snapshot)
        pool, allocator = self._cache.pool, self._cache.allocator
        try:
            for name, (frames, num_sink, num_window) in plan.items():
                pages = allocator.allocate(num_sink + num_window)
                self._branches[name].restore(frames, pages[:num_sink], pages[num_sink:])  # owned by the branch now
                if pages:
                    pool.write_page_contents(pages, {key.split("/")[2]: t for key, t in snapshot.tensors.items()
                                                     if key.startswith(f"self/{name}/")})
            for key, stacked in snapshot.tensors.items():
                kind, branch, name = key.split("/")
                if kind == "cross":  # (L, 2, H, T, D) -> one (k, v) per layer, each its own storage
                    with torch.inference_mode(False), torch.no_grad():  # as populate_cross_attention's copies
                        self._publish((branch, name), tuple(
                            (layer[0].to(pool.device, copy=True), layer[1].to(pool.device, copy=True))
                            for layer in stacked.unbind(0)))
        except BaseException:
            self._release_self_attention()
            self._cross.clear()
            raise

    def check_snapshot(self, snapshot: KVSnapshot) -> dict[str, tuple[int, int, int]]:
        """Branch -> (committed frames, sink pages, window pages) of a snapshot that fits; else ``ValueError``."""
        where = f"KV snapshot of session {self.session_id!r}"
        if not isinstance(snapshot, KVSnapshot):
            raise ValueError(f"{where}: expected a KVSnapshot, got {type(snapshot).__name__}")
        branches = snapshot.metadata.get("branches")
        if not isinstance(branches, dict) or sorted(branches) != sorted(self._branches):
            got = sorted(branches) if isinstance(branches, dict) else branches
            raise ValueError(f"{where}: branches {got}, expected {sorted(self._branches)}")
        recorded, mine = snapshot.metadata.get("spec"), self._cache.spec_record  # None: not recorded (older files)
        if recorded is not None and recorded != mine:
            fields = (sorted(k for k in {*recorded, *mine} if recorded.get(k) != mine.get(k))
                      if isinstance(recorded, dict) else ["all"])
            raise ValueError(f"{where}: written under another KV spec ({', '.join(fields)} differ): another model "
                             "config's session")
        pool, layout, spec = self._cache.pool, self._cache.layout, self.spec
        per_frame = layout.pages_per_frame
        plan: dict[str, tuple[int, int, int]] = {}
        expected: dict[str, tuple[int, ...]] = {}
        for name, record in branches.items():
            counts = [record.get(k) if isinstance(record, dict) else None
                      for k in ("num_committed_frames", "num_sink_pages", "num_window_pages")]
            if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
                raise ValueError(f"{where}: branch {name!r} has counts {record!r}, expected non-negative integers "
                                 "num_committed_frames, num_sink_pages, num_window_pages")
            frames, num_sink, num_window = counts
            # What BranchKV.commit leaves after `frames` frames: the sink fills first, the window keeps the newest.
            # Another split would attend to other frames than the session did and put a later frame in the sink.
            want_sink = min(frames, spec.sink_frames) * per_frame
            want_window = min(frames - want_sink // per_frame, spec.window_frames) * per_frame
            if (num_sink, num_window) != (want_sink, want_window):
                raise ValueError(
                    f"{where}: branch {name!r} holds {num_sink} sink and {num_window} window pages after {frames} "
                    f"frames, expected {want_sink} and {want_window} ({plural(per_frame, 'page')} per frame, "
                    f"sink_frames={spec.sink_frames}, window_frames={spec.window_frames})")
            plan[name] = (frames, num_sink, num_window)
            for part, shape in pool.page_content_shapes(num_sink + num_window).items():
                expected[f"self/{name}/{part}"] = shape
        for key in snapshot.tensors:
            kind, _, rest = key.partition("/")
            branch, _, cross_name = rest.partition("/")
            if kind == "cross" and branch in self._branches and cross_name in {c.name for c in spec.cross_attention}:
                heads, tokens, head_size = spec.cross_geometry(cross_name)
                expected[key] = (spec.num_layers, 2, heads, tokens, head_size)
        if sorted(snapshot.tensors) != sorted(expected):
            raise ValueError(f"{where}: tensors {sorted(snapshot.tensors)}, expected {sorted(expected)} for this "
                             "cache's geometry")
        for key, tensor in snapshot.tensors.items():
            if tuple(tensor.shape) != expected[key] or tensor.dtype != pool.dtype:
                raise ValueError(f"{where}: {key!r} is {tensor.dtype} {tuple(tensor.shape)}, expected "
                                 f"{pool.dtype} {expected[key]} (this cache's geometry, dtype and attention backend)")
        recorded = snapshot.metadata.get("block_format")  # None: not recorded (older files)
        if recorded is not None and recorded != pool.block_format:
            # Same shapes, other bytes: vLLM's CPU kernel lays blocks out per ISA (AMX or not), so another machine's
            # snapshot would be read as other keys and values, silently.
            raise ValueError(f"{where}: its KV blocks are in the format {recorded!r}, this cache reads "
                             f"{pool.block_format!r}: written by another attention kernel or instruction set")
        if recorded is None and not getattr(getattr(pool, "kernel", None), "token_major", True):
            # an older file of opaque blocks (vLLM's CPU kernel): which ISA laid them out is unknown, so a replay
            raise ValueError(f"{where}: it does not record its KV block format (written by an earlier ardiff), and "
                             f"this cache's blocks ({pool.block_format!r}) are laid out per instruction set")
        return plan

    # --------------------------------------------------------------- lifecycle
    def reset(self, keep_cross_attention: Iterable[str] = ()) -> None:
        """Free all self-attention KV and cross-attention caches except the ``keep_cross_attention`` names.

        Used by pipelines at a window boundary (keep the text cache, re-project
        the image cache). Contexts handed out before become invalid.
        """
        self._check_bound("reset")
        keep = {keep_cross_attention} if isinstance(keep_cross_attention, str) else set(keep_cross_attention)
        for name in keep:
            self.spec.cross_geometry(name)  # KeyError names the valid caches
        self._release_self_attention()
        self._cross = {key: pairs for key, pairs in self._cross.items() if key[1] in keep}

    def close(self) -> None:
        """Free everything; every later call raises except ``close`` and the counts (``num_pages``, ``page_ids``,
        ``cross_attention_bytes``: nothing held). Idempotent. Refused on an open state the runner holds (its release
        calls ``_close``)."""
        if self._closed:
            return
        self._check_unheld("close")
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._release_self_attention()
        self._cross.clear()
        self._closed = True

    def _release_self_attention(self) -> None:
        allocator = self._cache.allocator
        self._generation += 1
        for forward in self._pending.values():
            if forward is not None and forward.allocated and not forward.finished:
                allocator.free(forward.inflight_pages)
        self._finish_forwards()
        for kv in self._branches.values():
            kv.release(allocator)

