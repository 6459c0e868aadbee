"""Seeded fuzz of paged attention against a dense *masked* reference written from the definitions, on geometries
and lifecycles the other dense tests do not draw.

The reference (``masked_dense``) shares nothing with ardiff: it keeps every frame a branch ever committed (not
only the retained ones), lays them out in one long sequence followed by the current tokens, and masks each history
column by the README's rule (frame ``f`` of ``n`` committed is visible iff ``f < sink_frames`` or
``f >= n - window_frames``; the current block and its registers always are), then runs softmax attention by hand in
float64 with query head ``h`` reading KV head ``h // (Hq / Hkv)``. The other dense tests (``dense_stream``,
``test_kv_numerics``) concatenate the retained frames and call ``scaled_dot_product_attention``: a bug shared by a
frame-selection rule or by SDPA would pass both; here it would not.

What is drawn that the others do not: head sizes 24, 40 and 5 (their random draws take 1 to 16), GQA ratio 4 with
two or three KV heads (theirs go up to 3, or 4 with one KV head), frames of up to 20 tokens cut into pages of 1 to 20
tokens, windows of one frame behind multi-frame blocks, sink 0; a pool sized for exactly one to three sessions with
an LRU policy over four sessions that swaps the least recently used out (export, close) and back in (restore into
other page ids) between passes, so several snapshots are out at once and come back in any order; resets, a session
id closed and reopened; both CFG branches, and passes of two sessions, interleaved layer by layer; commit passes
ending with ``store``; one or several blocks of scratch for registers. And the same through the runner
(``ARDiffusionModelRunner``) with a pipeline that is attention only, so that its outputs are the attention outputs
themselves: sessions at capacity with LRU evictions to a swap folder (ample, tight or none), ``reset=True`` and
``close_session`` between requests. Last, the mask the built-in pipelines' dense recompute uses
(``wan.block_causal_mask``) is held to the same rule.

Tolerances (max abs error of the output against the float64 reference on the same rounded inputs):
- float32: 1e-5 (outputs are convex combinations of V rows of magnitude ~3, accumulated in float32 over at most a
  few hundred keys; measured up to 1.5e-6 over 400 draws);
- bfloat16: 2e-2. The output is stored in bfloat16, whose spacing is 2**-7 = 7.8e-3 for values in [1, 2) and
  1.6e-2 in [2, 4): its rounding alone is up to 3.9e-3 and 7.8e-3 there, and the kernel rounds scores and weights
  too (measured up to 9.8e-3 over 400 draws); the same bound as ``dense_stream.TOLERANCE``. A window or sink one frame
  off moves outputs by more than ten times that (``test_the_reference_tells_a_window_one_frame_off``).
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from contextlib import contextmanager

import pytest
import torch

from ardiff_cli.runtime.capability import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.kv.layout import KVLayout
from ardiff_cli.runtime.kv.vllm_attention import TorchPagedKernel
from ardiff_cli.runtime.request import ARDiffusionRequest
from ardiff_cli.runtime.runner import ARDiffusionModelRunner
from pipelines import wan

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny ops: a second thread only adds contention

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))
BRANCHES = tuple(b.name for b in CFG)
DRAWS = {"cache": 24, "runner": 8}  # seeded draws of each test (about 2 s each on one core)


# ------------------------------------------------------------------------------------------------ the reference
def masked_dense(q, frames, k, v, *, sink, window, scale=None):
    """Attention of ``q`` (Hq, L, D) over every committed frame of ``frames`` (a list of (k, v), each
    (Hkv, tokens_per_frame, D)) followed by the current ``k``/``v`` (Hkv, L, D), history masked by sink + window.
    Float64, by hand."""
    n = len(frames)
    keys = torch.cat([fk for fk, _ in frames] + [k], dim=1).double()  # (Hkv, S, D)
    values = torch.cat([fv for _, fv in frames] + [v], dim=1).double()
    tokens_per_frame = frames[0][0].shape[1] if frames else 1
    frame_of = [f for f in range(n) for _ in range(tokens_per_frame)]
    visible = torch.tensor([f < sink or f >= n - window for f in frame_of] + [True] * k.shape[1])
    num_q_heads, _, head_size = q.shape
    group = num_q_heads // k.shape[0]
    kv_head = torch.arange(num_q_heads) // group
    scores = q.double() @ keys[kv_head].transpose(1, 2) * (head_size ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values[kv_head]  # (Hq, L, D)


def draw_qkv(spec, seed: int, length: int, num_q_heads: int, dtype: torch.dtype):
    """Per layer (q, k, v) of one pass, from ``seed``: what the pass attends with, rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(spec.num_layers):
        q = torch.randn((num_q_heads, length, spec.head_size), generator=gen).to(dtype)
        k, v = (torch.randn((spec.num_kv_heads, length, spec.head_size), generator=gen).to(dtype) for _ in range(2))
        out.append((q, k, v))
    return out


class Timeline:
    """Every frame one (session, branch) committed since its history began, per layer: frames[layer][f] = (k, v)."""

    def __init__(self, spec) -> None:
        self.spec = spec
        self.frames: list[list] = [[] for _ in range(spec.num_layers)]

    def clear(self) -> None:
        for layer in self.frames:
            layer.clear()

    def check(self, layer: int, q, k, v, out, scale, what: str) -> float:
        spec = self.spec
        want = masked_dense(q, self.frames[layer], k, v, sink=spec.sink_frames, window=spec.window_frames,
                            scale=scale)
        assert out.shape == q.shape and out.dtype == q.dtype, what
        error = (out.double() - want).abs().max().item()
        assert error <= TOLERANCE[q.dtype], f"{what}: layer {layer} max abs error {error} > {TOLERANCE[q.dtype]}"
        return error

    def commit(self, layer: int, k, num_frames: int, v) -> None:
        t = self.spec.tokens_per_frame
        self.frames[layer].extend((k[:, f * t:(f + 1) * t].clone(), v[:, f * t:(f + 1) * t].clone())
                                  for f in range(num_frames))


def random_spec(rng: random.Random, *, num_layers=(1, 2)) -> tuple[ARDiffusionKVCacheSpec, int, int]:
    """A spec with the unusual geometries, its page size, and the GQA ratio of its queries."""
    tokens_per_frame = rng.choice([1, 3, 5, 6, 8, 12, 20])
    page_size = rng.choice([d for d in range(1, tokens_per_frame + 1) if tokens_per_frame % d == 0])
    frames_per_block = rng.randint(1, 4)
    window = rng.choice([1, frames_per_block - 1, frames_per_block, frames_per_block + 1, rng.randint(1, 6)])
    spec = ARDiffusionKVCacheSpec(
        num_layers=rng.randint(*num_layers), num_kv_heads=rng.choice([1, 2, 3]), head_size=rng.choice([24, 40, 5]),
        tokens_per_frame=tokens_per_frame, frames_per_block=frames_per_block, window_frames=max(1, window),
        sink_frames=rng.choice([0, 0, 1, 2, 3]), kv_branches=CFG, session_capacity=4,
        max_scratch_tokens_per_branch=rng.choice([0, 1, 7]))
    return spec, page_size, rng.choice([1, 2, 4])


# ------------------------------------------------------------------------------------------ the bare KV cache
class LRUPool:
    """Sessions over a cache with room for ``capacity`` of them: the least recently used is swapped out (exported
    and closed) to make room, and swapped back in (restored into whatever pages are free) when used again."""

    def __init__(self, cache: ARDiffusionKVCache, capacity: int) -> None:
        self.cache, self.capacity = cache, capacity
        self.resident: OrderedDict[str, object] = OrderedDict()  # least recently used first
        self.out: dict[str, object] = {}  # session -> snapshot
        self.swaps = 0

    def swap_out(self, session: str) -> None:
        state = self.resident.pop(session)
        self.out[session] = state.export()
        state.close()
        self.swaps += 1

    def get(self, session: str):
        if session in self.resident:
            self.resident.move_to_end(session)
            return self.resident[session]
        while len(self.resident) >= self.capacity:
            self.swap_out(next(iter(self.resident)))
        state = self.cache.new_state(session)
        if session in self.out:
            state.restore(self.out.pop(session))
        self.resident[session] = state
        return state

    def drop(self, session: str) -> None:
        """Close the session: its next use starts it afresh."""
        self.out.pop(session, None)
        state = self.resident.pop(session, None)
        if state is not None:
            state.close()


def forward(pool: LRUPool, timelines: dict, session: str, branch: str, *, num_frames: int, commit: bool,
            num_registers: int, num_q_heads: int, seed: int, scale, what: str, errors: list, store_last=False):
    """One pass, a layer per ``next()``, every layer checked against the masked reference."""
    state = pool.get(session)
    spec = pool.cache.spec
    timeline = timelines[(session, branch)]
    seq_len = num_frames * spec.tokens_per_frame
    layers = state.get_kv_caches(branch, seq_len=seq_len, commit_current=commit)
    for layer, (ctx, (q, k, v)) in enumerate(zip(layers, draw_qkv(spec, seed, seq_len + num_registers, num_q_heads,
                                                                   pool.cache.pool.dtype))):
        if store_last and layer == spec.num_layers - 1:  # a commit pass whose last output nobody reads
            ctx.store(k, v)
        else:
            out = ctx.attend(q, k, v, scale)
            errors.append(timeline.check(layer, q, k, v, out, scale, f"{what}, {len(timeline.frames[layer])} "
                                         f"frames committed, pass of {num_frames} frames + {num_registers} registers"))
        if commit:
            timeline.commit(layer, k, num_frames, v)
        yield
    assert state.commit(branch) == (num_frames if commit else 0), what
    assert state.adapter(branch).num_committed_frames == len(timeline.frames[0]), what


def run_together(*passes) -> None:
    """Advance passes one layer at a time, round robin (their sessions must all be resident: nothing is swapped out
    while a pass is in flight)."""
    active = list(passes)
    while active:
        for p in list(active):
            try:
                next(p)
            except StopIteration:
                active.remove(p)


def test_lru_sessions_on_unusual_geometries_match_a_masked_dense_reference():
    """Four sessions over a pool with room for one to three, both CFG branches, ~60 passes a draw; every layer of
    every pass checked (float32 and bfloat16, the torch backend and the block-table layout)."""
    sessions = ("a", "b", "c", "d")
    totals = dict(checked=0, swaps=0, restores_into_other_pages=0, wraps=0, interleaved=0)
    drawn: set[str] = set()
    for draw in range(DRAWS["cache"]):
        rng = random.Random(f"masked dense {draw}")
        spec, page_size, ratio = random_spec(rng)
        dtype = (torch.float32, torch.bfloat16)[draw % 2]
        capacity = rng.choice([1, 2, 3])
        backend = "torch" if draw % 3 else TorchPagedKernel(rng.randint(1, page_size))
        scratch_blocks = rng.choice([1, 1, 2 * spec.frames_per_block + 1])  # more room for registers
        pages = KVLayout.from_spec(spec, page_size=page_size, scratch_blocks=scratch_blocks).managed_pages(capacity)
        cache = ARDiffusionKVCache(spec, pages, dtype=dtype, page_size=page_size, scratch_blocks=scratch_blocks,
                                   attention_backend=backend)
        where = f"draw {draw}: {spec}, page_size={page_size}, GQA {ratio}, {cache.attention_description}, {dtype}"
        features = {"no sink": spec.sink_frames == 0, "window < block": spec.window_frames < spec.frames_per_block,
                    "pages per frame > 1": page_size < spec.tokens_per_frame, "kernel blocks": backend != "torch"}
        drawn.update({f"head {spec.head_size}", f"GQA {ratio}", f"capacity {capacity}",
                      *(name for name, present in features.items() if present)})
        pool = LRUPool(cache, capacity)
        timelines = {(s, b): Timeline(spec) for s in sessions for b in BRANCHES}
        errors: list[float] = []

        def random_pass(session, step):
            frames = rng.randint(1, spec.frames_per_block)
            room = cache.layout.scratch_tokens - frames * spec.tokens_per_frame
            commit = rng.random() < 0.6
            return dict(num_frames=frames, commit=commit, num_registers=rng.randint(0, room),
                        store_last=commit and rng.random() < 0.3,
                        num_q_heads=spec.num_kv_heads * ratio, seed=rng.randrange(1 << 30),
                        scale=rng.choice([None, None, 0.2]), what=f"{where}, step {step}, session {session!r}")

        for step in range(60):
            roll = rng.random()
            session = rng.choice(sessions)
            if roll < 0.04:
                pool.get(session).reset()
                for b in BRANCHES:
                    timelines[(session, b)].clear()
            elif roll < 0.07:  # the same id closed and opened again: positions from 0, any snapshot gone
                pool.drop(session)
                for b in BRANCHES:
                    timelines[(session, b)].clear()
            elif roll < 0.12 and session in pool.resident:  # an explicit swap-out between blocks
                before = set(pool.get(session).page_ids())
                pool.swap_out(session)
                pool.get(rng.choice([s for s in sessions if s != session]))  # another one takes pages meanwhile
                after = set(pool.get(session).page_ids())
                totals["restores_into_other_pages"] += bool(before) and before != after
            elif roll < 0.2 and capacity > 1:  # passes of two resident sessions, layer by layer
                other = rng.choice([s for s in sessions if s != session])
                pool.get(session), pool.get(other)
                branches = [rng.choice(BRANCHES) for _ in range(2)]
                args = [random_pass(s, step) for s in (session, other)]
                run_together(*(forward(pool, timelines, s, b, errors=errors, **a)
                               for s, b, a in zip((session, other), branches, args)))
                totals["interleaved"] += 1
            elif roll < 0.35:  # both CFG branches of one session, layer by layer
                args = [random_pass(session, step) for _ in BRANCHES]
                run_together(*(forward(pool, timelines, session, b, errors=errors, **a)
                               for b, a in zip(BRANCHES, args)))
            else:
                branch = rng.choice(BRANCHES)
                for _ in forward(pool, timelines, session, branch, errors=errors, **random_pass(session, step)):
                    pass
        for session in sessions:
            pool.drop(session)
        assert cache.num_free_pages == cache.num_managed_pages, f"{where}: pages leaked"
        totals["checked"] += len(errors)
        totals["swaps"] += pool.swaps
        totals["wraps"] += any(len(t.frames[0]) > spec.sink_frames + spec.window_frames for t in timelines.values())
    # what the draws are for (fixed by the seeds)
    assert totals["checked"] >= 2000 and totals["swaps"] >= 150, totals
    assert totals["restores_into_other_pages"] >= 10 and totals["wraps"] >= 20 and totals["interleaved"] >= 50, totals
    assert drawn >= {"head 24", "head 40", "head 5", "GQA 1", "GQA 2", "GQA 4", "capacity 1", "capacity 3", "no sink",
                     "window < block", "pages per frame > 1", "kernel blocks"}, drawn


def test_the_reference_tells_a_window_one_frame_off():
    """The masked reference is sharp enough for the tolerances above: a window one frame longer or shorter, or a
    sink frame dropped, moves outputs far beyond the bfloat16 bound."""
    gen = torch.Generator().manual_seed(0)
    frames = [(torch.randn(2, 4, 24, generator=gen), torch.randn(2, 4, 24, generator=gen)) for _ in range(9)]
    q, k, v = torch.randn(8, 6, 24, generator=gen), torch.randn(2, 6, 24, generator=gen), torch.randn(2, 6, 24,
                                                                                                      generator=gen)
    want = masked_dense(q, frames, k, v, sink=1, window=3)
    for sink, window in ((1, 2), (1, 4), (0, 3), (2, 3)):
        got = masked_dense(q, frames, k, v, sink=sink, window=window)
        assert (got - want).abs().max().item() > 10 * TOLERANCE[torch.bfloat16], (sink, window)
    # and with a window covering everything it is plain attention over the whole sequence
    full = masked_dense(q, frames, k, v, sink=0, window=9)
    keys = torch.cat([fk for fk, _ in frames] + [k], dim=1).double().repeat_interleave(4, 0)
    values = torch.cat([fv for _, fv in frames] + [v], dim=1).double().repeat_interleave(4, 0)
    plain = torch.softmax(q.double() @ keys.transpose(1, 2) / 24 ** 0.5, -1) @ values
    assert torch.allclose(full, plain, atol=1e-12)


def test_the_pipelines_block_causal_mask_is_the_sink_window_rule():
    """The built-in pipelines' dense recompute (``DenseReferenceRollout``) attends under ``wan.block_causal_mask``:
    held here, token by token, to the rule ``masked_dense`` applies, for random segment layouts (partial blocks,
    registers in committed segments too, sink 0, windows shorter than a block)."""
    for draw in range(200):
        rng = random.Random(f"mask {draw}")
        tokens_per_frame, sink, window = rng.randint(1, 3), rng.choice([0, 0, 1, 2]), rng.randint(1, 4)
        segments, first = [], 0
        for _ in range(rng.randint(1, 6)):
            frames, registers = rng.randint(1, 3), rng.choice([0, 0, 2])
            segments.append(wan.Segment(torch.zeros(1, frames, 1, 1), torch.zeros(frames), first,
                                        torch.zeros(registers, 1) if registers else None))
            first += frames
        # one entry per token: (segment, frame or None for a register)
        tokens = [(i, seg.first_frame + t // tokens_per_frame if t < seg.num_frames * tokens_per_frame else None)
                  for i, seg in enumerate(segments)
                  for t in range(seg.num_frames * tokens_per_frame + seg.num_registers)]
        want = torch.tensor([[a == b or (f is not None and f < segments[a].first_frame
                                         and (f < sink or f >= segments[a].first_frame - window))
                              for b, f in tokens] for a, _ in tokens])
        got = wan.block_causal_mask(segments, tokens_per_frame, sink, window)
        assert torch.equal(got, want), (draw, tokens_per_frame, sink, window, [(s.first_frame, s.num_frames,
                                                                                 s.num_registers) for s in segments])


# ------------------------------------------------------------------------------------------------- the runner
class AttentionOnlyPipeline:
    """A pipeline whose forward is one pass per branch of pure paged attention: request inputs name the pass
    (``frames``, ``registers``, ``commit`` and a ``seed`` per branch); outputs are each layer's attention output,
    stacked ``(layers, Hq, L, D)`` per branch."""

    def __init__(self, spec, num_q_heads: int, dtype: torch.dtype) -> None:
        self.spec, self.num_q_heads, self.dtype = spec, num_q_heads, dtype
        self._state = None

    def ar_diffusion_kv_cache_spec(self):
        return self.spec

    @contextmanager
    def bind_ar_diffusion_state(self, session_id, state):
        self._state = state
        try:
            yield
        finally:
            self._state = None

    def reset_ar_diffusion_session(self, session_id: str) -> None:
        pass

    def close_ar_diffusion_session(self, session_id: str) -> None:
        pass

    def export_ar_diffusion_session(self, session_id: str) -> dict:  # no state of its own, but swappable
        return {}

    def import_ar_diffusion_session(self, session_id: str, snapshot: dict) -> None:
        pass

    def forward(self, request: ARDiffusionRequest) -> dict[str, torch.Tensor]:
        state, spec, inputs = self._state, self.spec, request.inputs
        seq_len = inputs["frames"] * spec.tokens_per_frame
        outputs = {}
        for branch in spec.branch_names:
            layers = state.get_kv_caches(branch, seq_len=seq_len, commit_current=inputs["commit"])
            qkv = draw_qkv(spec, inputs[f"seed/{branch}"], seq_len + inputs["registers"], self.num_q_heads,
                           self.dtype)
            outputs[branch] = torch.stack([ctx.attend(q, k, v) for ctx, (q, k, v) in zip(layers, qkv)])
            state.commit(branch)
        return outputs


def test_runner_lru_evictions_swaps_resets_and_closes_match_a_masked_dense_reference(tmp_path):
    """Through the runner: four sessions over one or two slots with a swap folder, so that most requests find their
    session swapped out by an LRU eviction and restored; ``reset=True`` and ``close_session`` now and then. Each
    request's attention outputs, every layer and branch, checked against the masked reference of the session's
    history (restarted only where the runner says it lost it)."""
    sessions = ("a", "b", "c", "d")
    seen = Counter()
    for draw in range(DRAWS["runner"]):
        rng = random.Random(f"runner masked dense {draw}")
        spec, _, ratio = random_spec(rng, num_layers=(1, 2))
        dtype = (torch.float32, torch.bfloat16)[draw % 2]
        pipe = AttentionOnlyPipeline(spec, spec.num_kv_heads * ratio, dtype)
        capacity = rng.choice([1, 2])
        swap = ("ample", "ample", "ample", "off", "ample", "ample", "ample", "tight")[draw % 8]
        space = None  # ample: the default, the KV budget
        if swap == "tight":  # room for about one and a half snapshots: some are dropped
            probe = ARDiffusionModelRunner(pipe, dtype=dtype, memory_budget="1GiB", attention_backend="torch")
            space = int(1.5 * probe.load().bytes_per_session)
            probe.close()
        runner = ARDiffusionModelRunner(pipe, dtype=dtype, memory_budget="1GiB", session_capacity=capacity,
                                        attention_backend="torch", swap_space=space,
                                        swap_dir=None if swap == "off" else tmp_path / f"swap-{draw}")
        runner.load()
        layout = runner.kv_cache.layout
        where = (f"draw {draw}: {spec}, page_size={layout.page_size}, GQA {ratio}, capacity {capacity}, swap {swap}, "
                 f"{dtype}")
        timelines = {(s, b): Timeline(spec) for s in sessions for b in BRANCHES}
        lost: set[str] = set()

        def observe(event) -> None:
            if event.kind == "session_evicted":
                seen["swapped" if event.swapped else "evicted not swapped"] += 1
                if not event.swapped:
                    lost.add(event.session_id)
            elif event.kind == "session_restored":
                seen["restored"] += 1
            elif event.kind in ("snapshot_dropped", "swap_failed"):
                seen[event.kind] += 1
                lost.add(event.session_id)

        runner.subscribe(observe)
        for op in range(30):
            session = rng.choice(sessions)
            if rng.random() < 0.06 and session in runner.session_ids:
                runner.close_session(session)
                lost.add(session)
                continue
            reset = rng.random() < 0.06
            frames = rng.randint(1, spec.frames_per_block)
            room = layout.scratch_tokens - frames * spec.tokens_per_frame
            inputs = dict(frames=frames, registers=rng.randint(0, room), commit=rng.random() < 0.7,
                          **{f"seed/{b}": rng.randrange(1 << 30) for b in BRANCHES})
            extra = {"session_id": session, **({"reset": True} if reset else {})}
            out = runner.execute_model(ARDiffusionRequest(f"{session}/{op}", inputs, extra))
            if reset:
                lost.add(session)
            for gone in lost:
                seen["lost"] += 1
                for b in BRANCHES:
                    timelines[(gone, b)].clear()
            lost.clear()
            seq_len = frames * spec.tokens_per_frame
            for branch in BRANCHES:
                timeline = timelines[(session, branch)]
                qkv = draw_qkv(spec, inputs[f"seed/{branch}"], seq_len + inputs["registers"], pipe.num_q_heads,
                               dtype)
                for layer, (q, k, v) in enumerate(qkv):
                    timeline.check(layer, q, k, v, out[branch][layer], None,
                                   f"{where}, op {op}, session {session!r} {branch}")
                    if inputs["commit"]:
                        timeline.commit(layer, k, frames, v)
                seen["checked"] += 1
        runner.close()
    assert seen["checked"] >= 300 and seen["swapped"] >= 40 and seen["restored"] >= 40, seen
    assert seen["evicted not swapped"] >= 5 and seen["snapshot_dropped"] >= 2, seen
