"""ARDiffusionKVState: retention, bounded storage, scratch, laziness, lifecycle errors, cross-attention."""

from __future__ import annotations

import itertools
import tracemalloc

import numpy as np
import pytest
import torch

from ardiff_cli.runtime.capability import ARDiffusionCrossAttentionKVSpec, ARDiffusionKVBranchSpec
from ardiff_cli.runtime.errors import ConfigError
from ardiff_cli.runtime.kv import attention
from ardiff_cli.runtime.kv.allocator import KVCacheExhaustedError
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.kv.layout import SCRATCH_ENV, KVLayout, scratch_blocks_from_env

MAIN = (ARDiffusionKVBranchSpec("main", 0),)
CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))
SHARED_SLOT = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 0))
CROSS = (
    ARDiffusionCrossAttentionKVSpec("text", 3),
    ARDiffusionCrossAttentionKVSpec("image", 2, num_kv_heads=1, head_size=4),
)


def forward(state, branch, num_frames, *, commit, num_registers=0, do_commit=True):
    """One branch forward over every layer with random K/V; optionally commit it. Returns the frames committed."""
    spec = state.spec
    seq_len = num_frames * spec.tokens_per_frame
    length = seq_len + num_registers
    contexts = state.get_kv_caches(branch, seq_len=seq_len, commit_current=commit)
    assert len(contexts) == spec.num_layers
    for ctx in contexts:
        q = torch.randn(spec.num_kv_heads, length, spec.head_size)
        k = torch.randn(spec.num_kv_heads, length, spec.head_size)
        v = torch.randn(spec.num_kv_heads, length, spec.head_size)
        assert ctx.attend(q, k, v).shape == q.shape
    return state.commit(branch) if do_commit else None


def attend_once(ctx, spec, length):
    t = torch.randn(spec.num_kv_heads, length, spec.head_size)
    return ctx.attend(t, t, t)


def cross_pairs(spec, name, *, seed=0):
    heads, tokens, head_size = spec.cross_geometry(name)
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(heads, tokens, head_size, generator=gen), torch.randn(heads, tokens, head_size, generator=gen))
        for _ in range(spec.num_layers)
    ]


def assert_names(excinfo, *parts):
    message = str(excinfo.value)
    for part in parts:
        assert part in message, f"{part!r} missing from {message!r}"


# ------------------------------------------------------------------ retention
@pytest.mark.parametrize("frames_per_block", [1, 2, 3])
@pytest.mark.parametrize("sink_frames, window_frames", [(0, 2), (1, 3), (2, 1)])
def test_sink_and_window_retention(make_spec, make_cache, frames_per_block, sink_frames, window_frames):
    spec = make_spec(
        num_layers=1, num_kv_heads=1, head_size=4, tokens_per_frame=2, kv_branches=MAIN,
        frames_per_block=frames_per_block, sink_frames=sink_frames, window_frames=window_frames,
    )
    cache = make_cache(spec, num_sessions=1)
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    for _ in range(8):
        before = state.adapter("main")
        n0 = before.num_committed_frames
        # Every token of frame f carries the value f, so a page's content names its frame.
        marks = torch.arange(n0, n0 + frames_per_block, dtype=torch.float32).repeat_interleave(2)
        k = marks.view(1, -1, 1).expand(1, -1, 4).contiguous()
        contexts = state.get_kv_caches("main", seq_len=frames_per_block * 2, commit_current=True)
        contexts[0].attend(k, k, k)
        # The block is in flight: allocated, not yet history, nothing evicted yet.
        assert cache.num_free_pages == free0 - len(before.page_ids) - frames_per_block
        assert state.num_pages == len(before.page_ids) + frames_per_block
        assert state.adapter("main") == before
        assert state.commit("main") == frames_per_block
        after = state.adapter("main")
        n = after.num_committed_frames
        assert n == n0 + frames_per_block
        expected_frames = list(range(min(n, sink_frames))) + list(range(max(sink_frames, n - window_frames), n))
        frames = [int(cache.pool.kv[0, 0, 0, page, 0, 0]) for page in after.page_ids]
        assert frames == expected_frames
        assert after.num_resident_frames == len(expected_frames)
        assert len(set(after.page_ids)) == len(after.page_ids)
        # Evicted pages went back to the free list at commit time; resident ones are owned.
        assert cache.num_free_pages == free0 - len(expected_frames)
        assert state.num_pages == len(expected_frames)
        assert all(cache.allocator.is_owned(page) for page in after.page_ids)
        assert not any(cache.allocator.is_owned(page) for page in set(before.page_ids) - set(after.page_ids))
    state.close()
    assert cache.num_free_pages == free0


def test_positions_are_absolute_and_reset_restarts_them(make_spec, make_cache):
    spec = make_spec(window_frames=2, sink_frames=1)
    cache = make_cache(spec)
    state = cache.new_state("s")
    for block in range(1, 6):
        forward(state, "positive", 2, commit=True)
        assert state.adapter("positive").num_committed_frames == 2 * block
        assert state.adapter("positive").num_resident_frames == min(2 * block, 3)
    assert state.adapter("negative").num_committed_frames == 0
    forward(state, "positive", 1, commit=False)  # denoising passes do not advance positions
    assert state.adapter("positive").num_committed_frames == 10
    state.reset()
    assert state.adapter("positive").num_committed_frames == 0
    assert state.adapter("positive").page_ids == ()


def test_adapter_snapshot(make_spec, make_cache):
    cache = make_cache(make_spec())
    state = cache.new_state("sess-7")
    forward(state, "negative", 2, commit=True)
    adapter = state.adapter("negative")
    assert adapter.request_id == "sess-7/negative"
    assert (adapter.branch, adapter.local_index) == ("negative", 1)
    assert adapter.num_committed_frames == 2 and len(adapter.page_ids) == 2
    with pytest.raises(AttributeError):
        adapter.num_committed_frames = 0  # frozen snapshot


def test_storage_stays_bounded_over_10000_frames(make_spec, make_cache):
    spec = make_spec(
        num_layers=1, num_kv_heads=1, head_size=4, tokens_per_frame=2, frames_per_block=2,
        window_frames=4, sink_frames=1, kv_branches=MAIN,
    )
    cache = make_cache(spec, num_sessions=1)
    state = cache.new_state("long")
    q = torch.randn(1, 4, 4)
    resident = (spec.sink_frames + spec.window_frames) * cache.layout.pages_per_frame
    steady_free = None
    traced_at_warm = None
    tracemalloc.start()
    try:
        for block in range(5000):
            contexts = state.get_kv_caches("main", seq_len=4, commit_current=True)
            contexts[0].attend(q, q, q)
            state.commit("main")
            adapter = state.adapter("main")
            assert adapter.num_committed_frames == 2 * (block + 1)
            if adapter.num_committed_frames >= spec.sink_frames + spec.window_frames:
                assert len(adapter.page_ids) == resident
                assert state.num_pages == resident
                if steady_free is None:
                    steady_free = cache.num_free_pages
                assert cache.num_free_pages == steady_free
            if block == 1000:
                traced_at_warm = tracemalloc.get_traced_memory()[0]
        grown = tracemalloc.get_traced_memory()[0] - traced_at_warm
    finally:
        tracemalloc.stop()
    assert state.adapter("main").num_committed_frames == 10_000
    assert steady_free == cache.num_managed_pages - resident
    # 4000 further commits; any per-commit bookkeeping that grows would show up as tens of KiB here.
    assert grown < 16 * 1024, f"traced Python memory grew by {grown} bytes over 4000 commits"


# -------------------------------------------------------------------- scratch
def test_scratch_is_one_block_plus_registers(make_spec, make_cache):
    spec = make_spec(max_scratch_tokens_per_branch=5)  # block = 2 frames * 4 tokens = 8
    cache = make_cache(spec)
    assert cache.layout.scratch_tokens == 8 + 5
    assert cache.layout.scratch_pages_per_slot == 4  # ceil(13 / 4)
    # torch backend: the block and its registers are staged in the gather workspace, sized for them
    assert cache.pool.num_pages == 1 + cache.num_managed_pages
    assert cache.layout.max_visible_pages == cache.layout.retained_frames * cache.layout.pages_per_frame + 4
    state = cache.new_state("s")
    forward(state, "positive", 2, commit=False, num_registers=5)
    forward(state, "positive", 2, commit=True, num_registers=5)
    contexts = state.get_kv_caches("positive", seq_len=8)
    with pytest.raises(ValueError, match="register"):
        attend_once(contexts[0], spec, 8 + 6)
    # A shorter block leaves more room for registers.
    contexts = state.get_kv_caches("positive", seq_len=4)
    attend_once(contexts[0], spec, 4 + 9)


@pytest.mark.parametrize("blocks, expected", [("1", 8 + 5), ("3", 8 + 5), ("4", 16), ("5", 20), (" 8 ", 32)])
def test_scratch_env_raises_never_lowers(monkeypatch, make_spec, make_cache, blocks, expected):
    """The variable counts paged KV blocks of tokens_per_frame = 4 tokens (the spec's block size); the derived
    minimum is a 2-frame block + 5 registers = 13 tokens, 4 blocks."""
    monkeypatch.setenv(SCRATCH_ENV, blocks)
    cache = make_cache(make_spec(max_scratch_tokens_per_branch=5))
    assert cache.layout.scratch_tokens == expected
    assert cache.layout.scratch_pages_per_slot == max(4, int(blocks))
    state = cache.new_state("s")
    forward(state, "negative", 2, commit=False, num_registers=expected - 8)  # all of it is usable


@pytest.mark.parametrize("blocks, expected_blocks", [(None, 8), ("1", 8), ("7", 8), ("8", 8), ("10", 10)])
def test_scratch_env_counts_kv_blocks_of_one_frame(monkeypatch, make_spec, blocks, expected_blocks):
    """The spec's own example: 6 frames per block and one register token more than a KV block need 6 + 2 = 8
    scratch blocks per branch; the variable raises that count, in the same unit, and never lowers it (7 read as
    model blocks of 6 frames gave 42 blocks)."""
    if blocks is not None:
        monkeypatch.setenv(SCRATCH_ENV, blocks)
    spec = make_spec(frames_per_block=6, window_frames=6, max_scratch_tokens_per_branch=4 + 1)
    layout = KVLayout.from_spec(spec, attention_backend="vllm")
    assert layout.scratch_pages_per_slot == expected_blocks
    assert layout.scratch_pages == spec.num_local_kv_branches * expected_blocks


@pytest.mark.parametrize("value", ["0", "-1", "abc", "1.5"])
def test_scratch_env_bad_value(monkeypatch, make_spec, make_cache, value):
    monkeypatch.setenv(SCRATCH_ENV, value)
    with pytest.raises(ValueError) as excinfo:
        make_cache(make_spec())
    assert_names(excinfo, SCRATCH_ENV, repr(value))


def test_cache_needs_room_for_one_session(make_spec):
    spec = make_spec()
    needed = KVLayout.from_spec(spec).managed_pages(1)
    ARDiffusionKVCache(spec, needed)
    with pytest.raises(ValueError, match=str(needed)):
        ARDiffusionKVCache(spec, needed - 1)
    with pytest.raises(TypeError):
        ARDiffusionKVCache("spec", needed)


# -------------------------------------------------------------- laziness
def test_get_kv_caches_allocates_nothing(make_spec, make_cache):
    cache = make_cache(make_spec())
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    for branch in ("positive", "negative"):
        for commit in (False, True):
            state.get_kv_caches(branch, seq_len=8, commit_current=commit)
            assert cache.num_free_pages == free0
    assert state.num_pages == 0
    assert state.commit("positive") == 0 and state.commit("negative") == 0
    assert cache.num_free_pages == free0


def test_branch_that_never_runs_allocates_nothing(make_spec, make_cache):
    cache = make_cache(make_spec())
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    state.get_kv_caches("negative", seq_len=8, commit_current=True)  # built, never run
    forward(state, "positive", 2, commit=False)  # denoising pass: scratch only
    assert cache.num_free_pages == free0
    forward(state, "positive", 2, commit=True)
    assert cache.num_free_pages == free0 - 2
    assert state.adapter("negative").page_ids == ()
    assert state.commit("negative") == 0
    assert cache.num_free_pages == free0 - 2


# ------------------------------------------------------------ context lifecycle
def test_context_replaced_before_commit_raises(make_spec, make_cache):
    cache = make_cache(make_spec())
    state = cache.new_state("s")
    forward(state, "positive", 2, commit=True, do_commit=False)
    for commit in (False, True):
        with pytest.raises(RuntimeError, match="replaced before"):
            state.get_kv_caches("positive", seq_len=8, commit_current=commit)
    # The pending block is intact and still commits; the other branch is unaffected.
    forward(state, "negative", 1, commit=True)
    assert state.commit("positive") == 2
    assert state.adapter("positive").num_committed_frames == 2


def test_end_request_leaves_only_what_the_plan_counts(make_spec, make_cache):
    """After a request, a session holds its pages and nothing per request: the forward's contexts are stale and
    no branch keeps the index tensor its gathers read (the capacity plan does not count it)."""
    cache = make_cache(make_spec())
    state = cache.new_state("s")
    forward(state, "positive", 2, commit=True)
    contexts = state.get_kv_caches("positive", seq_len=8)  # a sampling step over that history: not committed
    attend_once(contexts[0], state.spec, 8)
    assert state._branches["positive"].history_ids is not None
    pages = state.num_pages
    state.end_request()
    assert state._branches["positive"].history_ids is None and state.num_pages == pages == 2
    with pytest.raises(RuntimeError, match="stale"):
        attend_once(contexts[1], state.spec, 8)
    assert state.uncommitted_branches() == [] and state.commit("positive") == 0


def test_uncommitted_non_commit_context_may_be_replaced(make_spec, make_cache):
    cache = make_cache(make_spec())
    state = cache.new_state("s")
    old = state.get_kv_caches("positive", seq_len=8)
    attend_once(old[0], state.spec, 8)
    state.get_kv_caches("positive", seq_len=8)
    with pytest.raises(RuntimeError, match="stale"):
        attend_once(old[1], state.spec, 8)


def test_commit_pass_replaced_before_running_is_harmless(make_spec, make_cache):
    cache = make_cache(make_spec())
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    old = state.get_kv_caches("positive", seq_len=8, commit_current=True)
    state.get_kv_caches("positive", seq_len=8)
    with pytest.raises(RuntimeError, match="stale"):
        attend_once(old[0], state.spec, 8)
    assert cache.num_free_pages == free0


@pytest.mark.parametrize("commit", [False, True])
def test_contexts_are_stale_after_commit(make_spec, make_cache, commit):
    cache = make_cache(make_spec())
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    contexts = state.get_kv_caches("positive", seq_len=8, commit_current=commit)
    for ctx in contexts:
        attend_once(ctx, state.spec, 8)
    state.commit("positive")
    with pytest.raises(RuntimeError, match="stale"):
        attend_once(contexts[0], state.spec, 8)
    assert cache.num_free_pages == free0 - (2 if commit else 0)


def test_commit_before_attend_then_attend_does_not_leak(make_spec, make_cache):
    """A commit pass committed before any layer ran must not allocate pages afterwards."""
    cache = make_cache(make_spec())
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    contexts = state.get_kv_caches("positive", seq_len=8, commit_current=True)
    assert state.commit("positive") == 0
    with pytest.raises(RuntimeError, match="stale"):
        attend_once(contexts[0], state.spec, 8)
    assert cache.num_free_pages == free0
    state.close()
    assert cache.num_free_pages == free0


@pytest.mark.parametrize("commit", [False, True])
def test_a_layer_attending_twice_in_one_forward_is_refused(make_spec, make_cache, commit):
    """A model reusing one layer's context would replace that layer's current K/V: refused, nothing leaked."""
    cache = make_cache(make_spec())
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    forward(state, "positive", 2, commit=True)  # some history
    contexts = state.get_kv_caches("positive", seq_len=8, commit_current=commit)
    attend_once(contexts[0], state.spec, 8)
    with pytest.raises(RuntimeError, match="layer 0 of branch 'positive' attended twice in one forward"):
        attend_once(contexts[0], state.spec, 8)
    state.close()
    assert cache.num_free_pages == free0


@pytest.mark.parametrize("keep", [(), ("text",)])
def test_contexts_are_stale_after_reset(make_spec, make_cache, keep):
    cache = make_cache(make_spec(cross_attention=CROSS))
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    forward(state, "positive", 2, commit=True)
    pending = state.get_kv_caches("positive", seq_len=8, commit_current=True)
    attend_once(pending[0], state.spec, 8)  # half-done commit pass holds in-flight pages
    denoise = state.get_kv_caches("negative", seq_len=8)
    assert cache.num_free_pages == free0 - 4
    state.reset(keep_cross_attention=keep)
    assert cache.num_free_pages == free0
    for ctx in (pending[1], denoise[0]):
        with pytest.raises(RuntimeError, match="stale"):
            attend_once(ctx, state.spec, 8)
    forward(state, "positive", 2, commit=True)  # usable again after reset
    assert state.adapter("positive").num_committed_frames == 2


def test_partial_commit_pass_is_discarded(make_spec, make_cache):
    cache = make_cache(make_spec())
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    contexts = state.get_kv_caches("positive", seq_len=8, commit_current=True)
    attend_once(contexts[0], state.spec, 8)  # layer 1 of 2 never ran
    with pytest.raises(RuntimeError, match="1 of 2 layers"):
        state.commit("positive")
    assert cache.num_free_pages == free0
    assert state.adapter("positive").num_committed_frames == 0


def test_closed_state_refuses_every_call(make_spec, make_cache):
    spec = make_spec(cross_attention=CROSS)
    cache = make_cache(spec)
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    forward(state, "positive", 2, commit=True)
    state.populate_cross_attention("positive", "text", cross_pairs(spec, "text"))
    pending = state.get_kv_caches("negative", seq_len=8, commit_current=True)
    attend_once(pending[0], spec, 8)
    state.close()
    assert state.closed
    assert cache.num_free_pages == free0
    assert state.num_pages == 0 and state.cross_attention_bytes == 0
    calls = [
        lambda: state.adapter("positive"),
        lambda: state.get_kv_caches("positive", seq_len=8),
        lambda: state.commit("negative"),
        lambda: state.populate_cross_attention("positive", "text", cross_pairs(spec, "text")),
        lambda: state.cross_attention("positive", "text"),
        lambda: state.has_cross_attention("positive", "text"),
        lambda: state.reset(),
        lambda: state.reset(keep_cross_attention=("text",)),
        lambda: attend_once(pending[1], spec, 8),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match="closed"):
            call()
    state.close()  # idempotent
    assert cache.num_free_pages == free0


def test_populate_that_closes_the_state_publishes_nothing(make_spec, make_cache):
    spec = make_spec(cross_attention=CROSS)
    cache = make_cache(spec)
    state = cache.new_state("s")

    def pairs():
        yield from cross_pairs(spec, "text")
        state.close()

    with pytest.raises(RuntimeError, match="closed"):
        state.populate_cross_attention("positive", "text", pairs())
    assert state.cross_attention_bytes == 0


def test_populate_refuses_tensors_that_require_grad_and_keeps_the_published_cache(make_spec, make_cache):
    # Its copy held the graph that made it (CopyBackwards) for the session's life, memory no plan counts, where
    # attend and store refuse such K/V
    spec = make_spec(cross_attention=CROSS)
    state = make_cache(spec).new_state("s")
    published = cross_pairs(spec, "text")
    state.populate_cross_attention("positive", "text", published)
    weight = torch.ones((), requires_grad=True)
    with pytest.raises(ValueError, match="layer 1 v requires grad, but the KV cache is inference-only.*no_grad"):
        pairs = cross_pairs(spec, "text", seed=1)
        state.populate_cross_attention("positive", "text", [(k, v * weight if i == 1 else v)
                                                            for i, (k, v) in enumerate(pairs)])
    for (k, v), (k0, v0) in zip(state.cross_attention("positive", "text"), published):
        assert torch.equal(k, k0) and torch.equal(v, v0) and not k.requires_grad and not v.requires_grad


# -------------------------------------------------------------- names and sizes
def test_unknown_branch_names_valid_ones(make_spec, make_cache):
    spec = make_spec(cross_attention=CROSS)
    state = make_cache(spec).new_state("s")
    calls = [
        lambda: state.adapter("neutral"),
        lambda: state.get_kv_caches("neutral", seq_len=8),
        lambda: state.commit("neutral"),
        lambda: state.populate_cross_attention("neutral", "text", cross_pairs(spec, "text")),
        lambda: state.cross_attention("neutral", "text"),
        lambda: state.has_cross_attention("neutral", "text"),
    ]
    for call in calls:
        with pytest.raises(KeyError) as excinfo:
            call()
        assert_names(excinfo, "neutral", "positive", "negative")


@pytest.mark.parametrize("seq_len", [0, -4, 3, 6, 12, 16, 8.0, "8", True, None])
def test_seq_len_must_be_whole_frames_within_one_block(make_spec, make_cache, seq_len):
    state = make_cache(make_spec()).new_state("s")  # tokens_per_frame 4, block 8 tokens
    with pytest.raises(ValueError) as excinfo:
        state.get_kv_caches("positive", seq_len=seq_len)
    assert_names(excinfo, "seq_len", str(seq_len))


def test_seq_len_may_be_a_numpy_integer(make_spec, make_cache):
    # np.int64(4), a whole frame, was refused as not "a positive whole number of frames"
    import numpy as np

    state = make_cache(make_spec()).new_state("s")
    layers = state.get_kv_caches("positive", seq_len=np.int64(4))
    assert type(layers[0].seq_len) is int and layers[0].seq_len == 4


@pytest.mark.parametrize("backend", ["torch", "torch-paged-kernel"])
def test_device_spelled_with_an_index_accepts_tensors_on_it(make_spec, backend):
    # torch.device("cuda") != torch.device("cuda:0"), the device CUDA tensors report; "cpu:0" vs "cpu"
    # is the same mismatch on this machine. The pools compare inputs with the device their storage is on.
    from ardiff_cli.runtime.kv.vllm_attention import TorchPagedKernel

    spec = make_spec(cross_attention=CROSS)
    layout = KVLayout.from_spec(spec)
    cache = ARDiffusionKVCache(spec, layout.managed_pages(1), device="cpu:0",
                               attention_backend="torch" if backend == "torch" else TorchPagedKernel(4))
    assert cache.pool.device == torch.empty(0).device
    state = cache.new_state("s")
    assert forward(state, "positive", 2, commit=True) == 2
    state.populate_cross_attention("positive", "text", cross_pairs(spec, "text"))


def test_attend_validates_inputs(make_spec, make_cache):
    spec = make_spec()
    state = make_cache(spec).new_state("s")
    ctx = state.get_kv_caches("positive", seq_len=8)[0]
    good = torch.randn(2, 8, 8)
    bad_inputs = [
        (torch.randn(2, 8, 8, 1), good, good),  # 4-d q
        (good, torch.randn(1, 8, 8), good),  # wrong kv heads
        (good, good, torch.randn(2, 7, 8)),  # v length differs
        (torch.randn(3, 8, 8), good, good),  # q heads not a multiple of kv heads
        (torch.randn(2, 8, 4), good, good),  # q head size
        (good.double(), good, good),  # dtype
        (good, good.to("meta"), good),  # device
        (torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)),  # fewer tokens than seq_len
    ]
    for q, k, v in bad_inputs:
        with pytest.raises(ValueError):
            ctx.attend(q, k, v)
    ctx.attend(good, good, good)
    contexts = state.get_kv_caches("positive", seq_len=4)
    attend_once(contexts[0], spec, 4)  # no registers
    with pytest.raises(ValueError, match="register"):  # later layers must agree on the register count
        attend_once(contexts[1], spec, 5)


def test_a_seq_len_past_a_one_frame_block_says_1_frame(make_spec, make_cache):
    """A block of one frame (DreamZero's default) was "exceeds one block (1 frames = 4 tokens)"."""
    state = make_cache(make_spec(frames_per_block=1)).new_state("s")
    with pytest.raises(ValueError, match=r"^seq_len=8 exceeds one block \(1 frame = 4 tokens\)$"):
        state.get_kv_caches("positive", seq_len=8)


def test_inputs_that_passed_the_checks_in_an_earlier_forward_are_still_checked_against_this_one(make_spec, make_cache,
                                                                                               monkeypatch):
    """The cache remembers inputs that passed the full checks (shapes, dtypes, devices, grad flags, with seq_len) and
    skips those checks for them in later forwards; what depends on the forward is checked all the same."""
    spec = make_spec()
    cache = make_cache(spec)
    state = cache.new_state("s")
    for registers in (0, 1):  # each register count passes the checks as a forward's first layer
        for ctx in state.get_kv_caches("positive", seq_len=4):
            attend_once(ctx, spec, 4 + registers)
    contexts = state.get_kv_caches("positive", seq_len=4)
    attend_once(contexts[0], spec, 4)
    with pytest.raises(ValueError, match="^layer 1 has 1 register token, earlier layers of this forward had 0$"):
        attend_once(contexts[1], spec, 5)
    # 4 tokens passed for seq_len 4; for seq_len 8 they are fewer tokens than the block
    with pytest.raises(ValueError, match="^attend got 1 token for seq_len=4: expected the video tokens followed by"):
        attend_once(state.get_kv_caches("positive", seq_len=4)[0], spec, 1)
    with pytest.raises(ValueError, match="^attend got 4 tokens for seq_len=8: expected the video tokens followed by"):
        attend_once(state.get_kv_caches("positive", seq_len=8)[0], spec, 4)
    good = torch.randn(2, 4, 8)
    for q, k in ((good.double(), good), (good, good.clone().requires_grad_())):  # not the inputs that passed
        with pytest.raises(ValueError, match="must be torch.float32|require grad"):
            state.get_kv_caches("positive", seq_len=4)[0].attend(q, k, good)
    for ctx in state.get_kv_caches("positive", seq_len=4):  # and the session goes on
        ctx.attend(good, good, good)
    assert len(cache.validated_inputs) == 2
    monkeypatch.setattr(attention, "MAX_VALIDATED", 2)  # bounded: a third signature starts the set afresh
    attend_once(state.get_kv_caches("positive", seq_len=4)[0], spec, 6)
    assert len(cache.validated_inputs) == 1


def test_register_tokens_the_spec_does_not_declare_name_the_layer_branch_and_spec_field(make_spec, make_cache):
    """A model that adds register tokens its spec does not declare (max_scratch_tokens_per_branch 0, a full block)
    was told only "attend got 10 tokens for seq_len=8: ... followed by 0..0 scratch register tokens": not where, nor
    which field of its spec to raise."""
    spec = make_spec()
    state = make_cache(spec).new_state("s")
    with pytest.raises(ValueError, match=r"^attend got 10 tokens for seq_len=8: expected the video tokens followed by "
                                         r"0\.\.0 scratch register tokens \(layer 0 of branch 'negative'; the spec "
                                         r"declares max_scratch_tokens_per_branch=0\)$"):
        attend_once(state.get_kv_caches("negative", seq_len=8)[0], spec, 10)
    for ctx in state.get_kv_caches("negative", seq_len=8):  # the session goes on
        attend_once(ctx, spec, 8)


def test_attend_given_tokens_before_heads_says_the_layout_it_expects(make_spec, make_cache):
    """(L, H, D) instead of (H, L, D) used to read `k and v must be shaped (2, 2, 8), got (8, 2, 8)`: a token count
    taken from q's heads, with no word of the layout, the layer or seq_len."""
    state = make_cache(make_spec()).new_state("s")
    ctx = state.get_kv_caches("positive", seq_len=8)[0]
    tokens_first = torch.randn(8, 2, 8)
    with pytest.raises(ValueError) as caught:
        ctx.attend(tokens_first, tokens_first, tokens_first)
    assert str(caught.value) == (
        "layer 0 of branch 'positive': attend takes q (heads, tokens, head_size) and k, v (2, tokens, 8), with "
        "tokens = seq_len 8 (+ up to 0 register tokens) and q's heads a positive multiple of 2; got q (8, 2, 8), "
        "k (8, 2, 8), v (8, 2, 8)")


@pytest.mark.parametrize(("heads", "head_size", "said"), [
    (2, 16, "head_size=8 where the model's k has 16"),
    (4, 8, "num_kv_heads=2 where the model's k has 4"),
    (1, 4, "num_kv_heads=2 where the model's k has 1 and head_size=8 where the model's k has 4"),
])
def test_attend_of_a_model_whose_sizes_the_spec_misstates_names_the_spec_fields(make_spec, make_cache, heads,
                                                                                 head_size, said):
    """A model of another head size than its spec declares read "attend takes ... (2, tokens, 8) ...; got q (2, 5,
    16), ...", the same words as a layout mistake: not that ar_diffusion_kv_cache_spec() was what to fix."""
    state = make_cache(make_spec(max_scratch_tokens_per_branch=1)).new_state("s")
    ctx = state.get_kv_caches("positive", seq_len=8)[0]
    q = torch.randn(2 * heads, 9, head_size)  # grouped-query: twice k's heads; one register token
    k = torch.randn(heads, 9, head_size)
    with pytest.raises(ValueError) as caught:
        ctx.attend(q, k, k)
    assert str(caught.value).endswith(
        f"; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(k.shape)}: the pipeline's "
        f"ar_diffusion_kv_cache_spec() declares {said}; make the spec (its Config.kv_cache_spec(), which "
        "inspect-capacity plans from) give the model's sizes"), caught.value


@pytest.mark.parametrize("backend", ["torch", "paged"])
def test_attend_and_store_given_no_tensors_name_the_layer_and_the_layout(make_spec, make_cache, backend):
    """A None, a numpy array or a list for q, k or v read "AttributeError: 'NoneType' object has no attribute 'shape'"
    (or 'requires_grad'), and q of no heads passed the checks to fail in the model after attention (torch's "shape
    '[L, 0]' is invalid"): neither named the layer, the branch nor what attend takes."""
    from ardiff_cli.runtime.kv.vllm_attention import TorchPagedKernel

    state = make_cache(make_spec(), attention_backend="torch" if backend == "torch" else TorchPagedKernel(4)
                       ).new_state("s")
    good = torch.randn(2, 8, 8)
    attend = "attend takes q (heads, tokens, head_size) and k, v (2, tokens, 8) as torch tensors (torch.float32 on cpu"
    for (q, k, v), got in [((good, good, None), "v None"), ((good.numpy(), good, good), "q numpy.ndarray"),
                           ((good, good.tolist(), good.numpy()), "k list, v numpy.ndarray")]:
        with pytest.raises(ValueError) as caught:
            state.get_kv_caches("positive", seq_len=8)[1].attend(q, k, v)
        assert str(caught.value) == (f"layer 1 of branch 'positive': {attend}, like the KV pool); got {got}")
        assert caught.value.__context__ is None or caught.value.__suppress_context__
    with pytest.raises(ValueError, match=r"^layer 1 of branch 'positive': store takes k, v \(2, tokens, 8\) as torch "
                                         r"tensors \(torch.float32 on cpu, like the KV pool\); got k None$"):
        state.get_kv_caches("positive", seq_len=8, commit_current=True)[1].store(None, good)
    with pytest.raises(ValueError, match=r"q's heads a positive multiple of 2; got q \(0, 8, 8\), k \(2, 8, 8\)"):
        state.get_kv_caches("positive", seq_len=8)[0].attend(good[:0], good, good)
    contexts = state.get_kv_caches("positive", seq_len=8, commit_current=True)  # and the session goes on
    for ctx in contexts:
        ctx.attend(good, good, good)
    assert state.commit("positive") == 2


def test_a_cross_attention_cache_of_another_size_names_the_spec_field_it_is_declared_by(make_spec, make_cache):
    """A text encoder's tokens published to a cache declared with another num_tokens read only "layer 0 k must be
    shaped (2, 3, 8), got (2, 5, 8)": not which size differs, nor which field of the pipeline's spec sets it (the
    cache's own, or the spec's where the cache gives none)."""
    spec = make_spec(cross_attention=CROSS)
    state = make_cache(spec).new_state("s")
    longer = [(torch.zeros(2, 5, 8), torch.zeros(2, 5, 8))] * spec.num_layers
    with pytest.raises(ValueError) as caught:
        state.populate_cross_attention("positive", "text", longer)
    assert str(caught.value) == (
        "cross-attention 'text' of branch 'positive' (session 's'): layer 0 k must be shaped (num_kv_heads, "
        "num_tokens, head_size) (2, 3, 8), got (2, 5, 8): the pipeline's ar_diffusion_kv_cache_spec() declares "
        "cross_attention 'text' with num_tokens=3")
    other = [(torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))] * spec.num_layers  # heads and head_size of its own
    with pytest.raises(ValueError) as caught:
        state.populate_cross_attention("positive", "image", other)
    assert str(caught.value).endswith(
        "got (2, 2, 8): the pipeline's ar_diffusion_kv_cache_spec() declares cross_attention 'image' with "
        "num_kv_heads=1 and head_size=4"), str(caught.value)
    wider = [(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))] * spec.num_layers
    with pytest.raises(ValueError) as caught:
        state.populate_cross_attention("positive", "text", wider)
    assert str(caught.value).endswith(
        "got (2, 3, 4): the pipeline's ar_diffusion_kv_cache_spec() declares cross_attention 'text' with no "
        "head_size (so the spec's own head_size=8)"), str(caught.value)
    assert not state.has_cross_attention("positive", "text")
    state.populate_cross_attention("positive", "text", cross_pairs(spec, "text"))


# ---------------------------------------------------------- sharing and capacity
def test_shared_local_index_never_shares_cross_attention(make_spec, make_cache):
    spec = make_spec(kv_branches=SHARED_SLOT, cross_attention=CROSS)
    cache = make_cache(spec)
    state = cache.new_state("s")
    positive = cross_pairs(spec, "text", seed=1)
    state.populate_cross_attention("positive", "text", positive)
    assert state.has_cross_attention("positive", "text")
    assert not state.has_cross_attention("negative", "text")
    with pytest.raises(RuntimeError, match="before populate"):
        state.cross_attention("negative", "text")
    negative = cross_pairs(spec, "text", seed=2)
    state.populate_cross_attention("negative", "text", negative)
    for layer in range(spec.num_layers):
        for which in (0, 1):
            assert torch.equal(state.cross_attention("positive", "text")[layer][which], positive[layer][which])
            assert torch.equal(state.cross_attention("negative", "text")[layer][which], negative[layer][which])
            got_p = state.cross_attention("positive", "text")[layer][which]
            got_n = state.cross_attention("negative", "text")[layer][which]
            assert got_p.data_ptr() != got_n.data_ptr()


def test_shared_local_index_refuses_two_resident_branches(make_spec, make_cache):
    spec = make_spec(kv_branches=SHARED_SLOT)
    cache = make_cache(spec)
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    forward(state, "positive", 2, commit=True)
    forward(state, "negative", 2, commit=False)  # a denoising pass needs no managed pages
    with pytest.raises(RuntimeError, match="share local_index"):
        forward(state, "negative", 2, commit=True)
    assert cache.num_free_pages == free0 - 2
    assert state.commit("negative") == 0
    state.close()
    assert cache.num_free_pages == free0


def test_exhaustion_is_loud_and_leaks_nothing(make_spec, make_cache):
    spec = make_spec(kv_branches=MAIN, window_frames=2, sink_frames=0)
    cache = make_cache(spec, num_sessions=1)  # one session's window + one in-flight block
    free0 = cache.num_free_pages
    a, b = cache.new_state("a"), cache.new_state("b")
    forward(a, "main", 2, commit=True)
    forward(b, "main", 2, commit=True)
    assert cache.num_free_pages == 0
    with pytest.raises(KVCacheExhaustedError):
        forward(a, "main", 1, commit=True)
    assert cache.num_free_pages == 0
    assert a.commit("main") == 0
    b.close()
    forward(a, "main", 2, commit=True)
    a.close()
    assert cache.num_free_pages == free0


# ------------------------------------------------------------ cross-attention
def saved(state, branch, name):
    return [(k.clone(), v.clone()) for k, v in state.cross_attention(branch, name)]


def assert_same(state, branch, name, expected):
    current = state.cross_attention(branch, name)
    assert len(current) == len(expected)
    for (k, v), (k0, v0) in zip(current, expected):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_cross_attention_publish_and_read(make_spec, make_cache):
    spec = make_spec(num_layers=3, cross_attention=CROSS)
    state = make_cache(spec).new_state("s")
    with pytest.raises(RuntimeError, match="before populate"):
        state.cross_attention("positive", "text")
    with pytest.raises(KeyError, match="valid caches"):
        state.cross_attention("positive", "video")
    with pytest.raises(KeyError, match="valid caches"):
        state.populate_cross_attention("positive", "video", [])
    pairs = cross_pairs(spec, "text")
    state.populate_cross_attention("positive", "text", iter(pairs))
    assert state.cross_attention_bytes == 2 * 3 * (2 * 3 * 8) * 4
    assert_same(state, "positive", "text", pairs)
    pairs[0][0].zero_()  # the cache holds copies, not the caller's tensors
    assert not torch.equal(state.cross_attention("positive", "text")[0][0], pairs[0][0])
    image = cross_pairs(spec, "image")
    assert image[0][0].shape == (1, 2, 4)
    state.populate_cross_attention("negative", "image", image)
    assert state.has_cross_attention("negative", "image")
    assert not state.has_cross_attention("positive", "image")
    assert state.cross_attention_bytes == 2 * 3 * (2 * 3 * 8) * 4 + 2 * 3 * (1 * 2 * 4) * 4


def test_a_cross_attention_cache_written_in_place_is_named_published_or_restored(make_spec, make_cache):
    """cross_attention() gives the cache's own tensors: a forward's k.mul_() on them (under inference_mode, where
    tensors made there have no version counter) changed the session's history unseen."""
    spec = make_spec(num_layers=3, cross_attention=CROSS)
    cache = make_cache(spec)
    state = cache.new_state("s")
    with torch.inference_mode():
        state.populate_cross_attention("positive", "text", cross_pairs(spec, "text"))
        state.populate_cross_attention("negative", "image", cross_pairs(spec, "image"))
        state.cross_attention("positive", "text")[0][0].add(1)  # a read, and a copy written: no change
        assert state.cross_attention_written() == []
        state.cross_attention("negative", "image")[2][1].mul_(1.5)
    assert state.cross_attention_written() == ["'image' of branch 'negative' (layer 2 v)"]
    state.populate_cross_attention("negative", "image", cross_pairs(spec, "image"))  # the API's way to change it
    assert state.cross_attention_written() == []
    with torch.inference_mode():
        restored = cache.new_state("t")
        restored.restore(state.export())
    assert restored.cross_attention_written() == []
    with torch.no_grad():
        restored.cross_attention("positive", "text")[1][0][0, 0, 0] = 7.0
    assert restored.cross_attention_written() == ["'text' of branch 'positive' (layer 1 k)"]


@pytest.mark.parametrize("mode", ["no_grad", "grad", "inference_mode", "generator_in_inference_mode",
                                  "inference_tensors_under_no_grad"])
def test_a_cross_attention_cache_published_in_any_grad_mode_has_a_version_counter_and_no_graph(make_spec, make_cache,
                                                                                              mode):
    """Under no_grad() (the pipelines' forward) the copies are made as the caller's mode is, with no context manager
    entered; with grad on, or in inference mode, outside inference mode and under no_grad(): in each, a write in place
    is named, and the cache requires no grad (a pair that requires grad is refused before). A generator that yields
    inside its own inference_mode() block, called under no_grad(), puts the loop in inference mode with each pair.
    Tensors made earlier in inference mode, published under no_grad() (no context manager entered): copies of them
    are no inference tensors."""
    spec = make_spec(num_layers=2, cross_attention=CROSS)
    state = make_cache(spec).new_state("s")
    pairs = cross_pairs(spec, "text")
    if mode == "inference_tensors_under_no_grad":
        with torch.inference_mode():
            pairs = [(k.clone(), v.clone()) for k, v in pairs]
        assert pairs[0][0].is_inference()

    def in_inference_mode(pairs):
        with torch.inference_mode():
            yield from pairs

    around = {"no_grad": torch.no_grad, "grad": torch.enable_grad, "inference_mode": torch.inference_mode,
              "generator_in_inference_mode": torch.no_grad, "inference_tensors_under_no_grad": torch.no_grad}[mode]
    wrap = in_inference_mode if mode == "generator_in_inference_mode" else iter
    with around():
        state.populate_cross_attention("positive", "text", wrap(pairs))
        cache = state.cross_attention("positive", "text")
        assert not any(t.requires_grad or t.is_inference() for pair in cache for t in pair)
        assert state.cross_attention_written() == []
    with torch.no_grad():
        cache[1][1].mul_(2.0)
    assert state.cross_attention_written() == ["'text' of branch 'positive' (layer 1 v)"]
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()  # the caller's modes, as they were


def test_a_restore_under_no_grad_of_a_snapshot_that_requires_grad_keeps_no_graph(make_spec, make_cache):
    """The caches are copied under inference_mode(False) (for their version counter), which turns grad mode back on
    under the caller's no_grad(): a snapshot whose tensors required grad gave caches that did, each holding a graph
    back to the snapshot's tensors (kept alive for the session's life), and the session's later exports did too."""
    spec = make_spec(cross_attention=CROSS)
    cache = make_cache(spec)
    state = cache.new_state("s")
    state.populate_cross_attention("positive", "text", cross_pairs(spec, "text"))
    snapshot = state.export()
    for t in snapshot.tensors.values():
        t.requires_grad_()
    restored = cache.new_state("t")
    with torch.no_grad():
        restored.restore(snapshot)
    assert not any(t.requires_grad for pair in restored.cross_attention("positive", "text") for t in pair)
    assert not any(t.requires_grad for t in restored.export().tensors.values())


def _raise_at(pairs, index):
    for i, pair in enumerate(pairs):
        if i == index:
            raise OSError("encoder failed")
        yield pair


BAD_CASES = (
    "exception-first", "exception-last", "empty", "too-few", "too-many", "shape-k", "shape-v",
    "dtype", "device", "not-a-pair", "triple",
)


def bad_iterable(spec, case):
    """A failing ``pairs`` argument for the 3-layer 'text' cache, and the exception it must raise."""
    heads, tokens, head_size = spec.cross_geometry("text")
    good = cross_pairs(spec, "text", seed=9)
    assert len(good) == 3

    def replace(layer, which, tensor):
        pairs = list(good)
        pair = list(pairs[layer])
        pair[which] = tensor
        pairs[layer] = tuple(pair)
        return pairs

    return {
        "exception-first": (lambda: _raise_at(good, 0), OSError),
        "exception-last": (lambda: _raise_at(good, 2), OSError),
        "empty": (lambda: iter(()), ValueError),
        "too-few": (lambda: good[:2], ValueError),
        "too-many": (lambda: good + good[:1], ValueError),
        "shape-k": (lambda: replace(1, 0, torch.randn(heads, tokens + 1, head_size)), ValueError),
        "shape-v": (lambda: replace(2, 1, torch.randn(heads + 1, tokens, head_size)), ValueError),
        "dtype": (lambda: replace(1, 1, torch.randn(heads, tokens, head_size, dtype=torch.float64)), ValueError),
        "device": (lambda: replace(2, 0, torch.empty(heads, tokens, head_size, device="meta")), ValueError),
        "not-a-pair": (lambda: [good[0], good[1][0], good[2]], ValueError),
        "triple": (lambda: [(*p, p[0]) for p in good], ValueError),
    }[case]


@pytest.mark.parametrize("case", BAD_CASES)
@pytest.mark.parametrize("first", [True, False], ids=["first-population", "replacing"])
def test_cross_attention_failures_are_transactional(make_spec, make_cache, case, first):
    spec = make_spec(num_layers=3, cross_attention=CROSS)
    state = make_cache(spec).new_state("s")
    state.populate_cross_attention("negative", "image", cross_pairs(spec, "image"))
    if not first:
        state.populate_cross_attention("positive", "text", cross_pairs(spec, "text", seed=4))
        previous = saved(state, "positive", "text")
        previous_objects = state.cross_attention("positive", "text")
    bytes_before = state.cross_attention_bytes
    factory, error = bad_iterable(spec, case)
    with pytest.raises(error):
        state.populate_cross_attention("positive", "text", factory())
    assert state.cross_attention_bytes == bytes_before
    assert state.has_cross_attention("negative", "image")
    if first:
        assert not state.has_cross_attention("positive", "text")
        with pytest.raises(RuntimeError, match="before populate"):
            state.cross_attention("positive", "text")
    else:
        assert state.cross_attention("positive", "text") is previous_objects
        assert_same(state, "positive", "text", previous)


@pytest.mark.parametrize("first", [True, False], ids=["first-population", "replacing"])
def test_cache_is_unreadable_until_the_iterable_completes(make_spec, make_cache, first):
    """Read while its population is still yielding: absent on a first population, the previous complete cache when
    replacing; never a partly written one."""
    spec = make_spec(num_layers=3, cross_attention=CROSS)
    state = make_cache(spec).new_state("s")
    if not first:
        state.populate_cross_attention("positive", "text", cross_pairs(spec, "text", seed=4))
        previous = saved(state, "positive", "text")
    new = cross_pairs(spec, "text", seed=5)
    seen = []

    def pairs():
        for layer, pair in enumerate(new):
            yield pair
            if first:
                with pytest.raises(RuntimeError, match="before populate"):
                    state.cross_attention("positive", "text")
                assert not state.has_cross_attention("positive", "text")
            else:
                assert_same(state, "positive", "text", previous)
            seen.append(layer)

    state.populate_cross_attention("positive", "text", pairs())
    assert seen == [0, 1, 2]
    assert_same(state, "positive", "text", new)


def test_too_many_pairs_stops_consuming(make_spec, make_cache):
    spec = make_spec(num_layers=3, cross_attention=CROSS)
    state = make_cache(spec).new_state("s")
    one = cross_pairs(spec, "text")[0]
    consumed = itertools.count()

    def endless():
        while True:
            next(consumed)
            yield one

    with pytest.raises(ValueError, match="more than num_layers=3"):
        state.populate_cross_attention("positive", "text", endless())
    assert next(consumed) <= spec.num_layers + 1
    assert not state.has_cross_attention("positive", "text")


def test_cross_attention_of_another_dtype_is_named_as_self_attention_k_v_is(make_spec, make_cache):
    """A model computing in float64 whatever dtype from_config was given: its self-attention K/V were told to be
    "like the KV pool (the dtype and device from_config was given)", its cross-attention pairs only the dtype."""
    spec = make_spec(num_layers=3, cross_attention=CROSS)
    state = make_cache(spec).new_state("s")
    pairs = [(k.double(), v.double()) for k, v in cross_pairs(spec, "text")]
    with pytest.raises(ValueError, match=r"^cross-attention 'text' of branch 'positive' \(session 's'\): layer 0 k "
                       r"must be torch.float32 on cpu like the KV pool \(the dtype and device from_config was "
                       r"given\), got torch.float64 on cpu$"):
        state.populate_cross_attention("positive", "text", pairs)


def test_reset_keeps_named_cross_attention(make_spec, make_cache):
    spec = make_spec(cross_attention=CROSS)
    cache = make_cache(spec)
    free0 = cache.num_free_pages
    state = cache.new_state("s")
    for branch in ("positive", "negative"):
        state.populate_cross_attention(branch, "text", cross_pairs(spec, "text", seed=hash(branch) % 100))
        state.populate_cross_attention(branch, "image", cross_pairs(spec, "image"))
        forward(state, branch, 2, commit=True)
    text = {b: saved(state, b, "text") for b in ("positive", "negative")}
    text_bytes = 2 * sum(k.nbytes + v.nbytes for k, v in text["positive"])

    with pytest.raises(KeyError, match="video"):
        state.reset(keep_cross_attention=("text", "video"))
    assert state.has_cross_attention("positive", "image")  # the failed reset changed nothing
    assert cache.num_free_pages == free0 - 4

    state.reset(keep_cross_attention=("text",))
    assert cache.num_free_pages == free0
    assert state.cross_attention_bytes == text_bytes
    for branch in ("positive", "negative"):
        assert_same(state, branch, "text", text[branch])
        assert not state.has_cross_attention(branch, "image")
        with pytest.raises(RuntimeError, match="before populate"):
            state.cross_attention(branch, "image")

    state.reset()
    assert state.cross_attention_bytes == 0
    assert not state.has_cross_attention("positive", "text")


def _commit_block(state, branch, frames):
    spec = state.spec
    seq_len = frames * spec.tokens_per_frame
    for ctx in state.get_kv_caches(branch, seq_len=seq_len, commit_current=True):
        t = torch.randn(spec.num_kv_heads, seq_len, spec.head_size)
        ctx.attend(t, t, t)
    return state.commit(branch)


def test_reset_keeps_a_cross_attention_cache_named_by_a_plain_string(make_spec, make_cache):
    """reset(keep_cross_attention="text") keeps "text"; a str must not be taken as its letters."""
    spec = make_spec(cross_attention=CROSS)
    cache = make_cache(spec)
    state = cache.new_state("s")
    for name in ("text", "image"):
        state.populate_cross_attention("positive", name, cross_pairs(spec, name))
    _commit_block(state, "positive", 2)
    state.reset(keep_cross_attention="text")
    assert state.has_cross_attention("positive", "text") and not state.has_cross_attention("positive", "image")
    assert state.num_pages == 0 and state.adapter("positive").num_committed_frames == 0
    state.close()


def test_adapter_counts_resident_frames_not_pages_when_a_frame_spans_pages(make_spec, make_cache):
    """with 2-token pages and 4-token frames, num_resident_frames is page_ids // pages_per_frame."""
    spec = make_spec(kv_branches=MAIN)  # sink 1, window 3, 4 tokens per frame, 2-frame blocks
    cache = make_cache(spec, page_size=2)
    assert cache.layout.pages_per_frame == 2
    state = cache.new_state("s")
    for blocks, frames in ((1, 2), (2, 4), (3, 4)):  # the window fills at 1 + 3 frames
        _commit_block(state, "main", 2)
        adapter = state.adapter("main")
        assert adapter.num_committed_frames == 2 * blocks
        assert adapter.num_resident_frames == frames and len(adapter.page_ids) == 2 * frames
    state.close()


@pytest.mark.parametrize("page_size", [0, -4])
def test_a_page_size_that_is_not_positive_is_a_value_error(make_spec, page_size):
    """page_size=0 reached `tokens_per_frame % 0`: a ZeroDivisionError, not the documented ValueError."""
    expected = f"page_size must be a positive divisor of tokens_per_frame=4, got {page_size}"
    with pytest.raises(ValueError, match=expected):
        KVLayout.from_spec(make_spec(), page_size=page_size)


@pytest.mark.parametrize("blocks", [0, -1])
def test_scratch_blocks_that_are_not_positive_are_refused(make_spec, blocks):
    with pytest.raises(ValueError, match=f"scratch_blocks must be positive, got {blocks}"):
        KVLayout.from_spec(make_spec(), scratch_blocks=blocks)


@pytest.mark.parametrize("page_size", ["2", 2.0, True])
def test_a_page_size_that_is_not_an_int_is_refused_by_the_planner_and_the_cache(make_spec, page_size):
    """'2' was a TypeError from a comparison (naming no argument); 2.0 planned float byte counts and then failed in
    torch.zeros; True planned one-token pages."""
    from ardiff_cli.runtime.capacity import plan_capacity

    expected = f"page_size must be a positive divisor of tokens_per_frame=4, got {page_size!r} \\(an int"
    with pytest.raises(ValueError, match=expected):
        plan_capacity(make_spec(), "float32", 1 << 30, page_size=page_size)
    with pytest.raises(ValueError, match=expected):
        ARDiffusionKVCache(make_spec(), 100, page_size=page_size)


def test_a_numpy_page_size_plans_python_ints(make_spec):
    """numpy's int64 (a page size computed with numpy) went into the plan as it was: to_dict() was not JSON."""
    import json

    import numpy as np

    from ardiff_cli.runtime.capacity import plan_capacity

    plan = plan_capacity(make_spec(), "float32", 1 << 30, page_size=np.int64(2))
    assert type(plan.page_size) is int and type(plan.bytes_per_page) is int
    assert json.loads(json.dumps(plan.to_dict()))["page_size"] == 2


@pytest.mark.parametrize("blocks", [1.5, "2", True])
def test_scratch_blocks_that_are_not_ints_are_refused(make_spec, blocks):
    """1.5 and True were taken (1.5 blocks of scratch tokens, a float size for the workspace)."""
    with pytest.raises(ValueError, match=f"scratch_blocks must be positive, got {blocks!r} \\(an int"):
        KVLayout.from_spec(make_spec(), scratch_blocks=blocks)


@pytest.mark.parametrize("pages", ["10", 7.5, True])
def test_a_page_count_that_is_not_an_int_is_refused_by_name(make_spec, pages):
    """'10' was a TypeError from a comparison; 7.5 failed in the allocator as 'num_pages ... got 8.5'."""
    with pytest.raises(ValueError, match=f"^num_managed_pages must be an integer, got {pages!r}$"):
        ARDiffusionKVCache(make_spec(), pages)


@pytest.mark.parametrize("name, dtype", [("bfloat16", torch.bfloat16), ("fp16", torch.float16),
                                         ("Float32", torch.float32), (torch.bfloat16, torch.bfloat16),
                                         (np.dtype("float16"), torch.float16), (np.float16, torch.float16),
                                         (np.float32, torch.float32)])
def test_the_cache_takes_a_dtype_by_name_as_the_planner_does(make_spec, name, dtype):
    """plan_capacity takes 'bfloat16'; the cache failed on it with a TypeError from torch.zeros. numpy's dtype was
    taken and its scalar type (np.float16, "<class 'numpy.float16'>") refused."""
    cache = ARDiffusionKVCache(make_spec(), 100, dtype=name)
    assert cache.pool.kv.dtype == dtype
    state = cache.new_state("s")
    q = torch.randn(2, 4, 8).to(dtype)
    out = state.get_kv_caches("positive", 4, commit_current=True)[0].attend(q, q, q)
    assert out.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn, "float8_e5m2", "int8", None])
def test_the_cache_refuses_a_dtype_attention_does_not_run_in(make_spec, dtype):
    """float64 and int32 pools were built (int32 then failed at the first attend: 'expected scalar type Float but
    found Int'), and a float8 one at its first commit ('index_copy_cpu' not implemented)."""
    with pytest.raises(ConfigError, match=r"^ARDiffusionKVCache\(\): unsupported KV dtype .*; expected one of "
                                          r"float32, bfloat16, float16$"):
        ARDiffusionKVCache(make_spec(), 100, dtype=dtype)


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_scratch_env_means_unset(monkeypatch, make_spec, value):
    """An exported but empty variable (`export AR_DIFFUSION_KV_SCRATCH_BLOCKS_PER_BRANCH=`) is the default."""
    monkeypatch.setenv(SCRATCH_ENV, value)
    assert scratch_blocks_from_env() == 1
    assert KVLayout.from_spec(make_spec()) == KVLayout.from_spec(make_spec(), scratch_blocks=1)


def test_a_state_held_outside_its_binding_refuses_the_forwards_calls_and_the_runners(make_spec, make_cache):
    """The runner holds its states with ``bound`` set: True around one forward, False between requests. Outside the
    binding every call of the forward's raises, reads included (a pipeline that kept the state read this session's KV
    into another session's outputs); export, restore and close are the runner's (``_export``, ``_restore``,
    ``_close``) whether bound or not. The counts stay readable. Once the runner closed it, each call says the
    session was released and its pages may hold another session's KV."""
    spec = make_spec(cross_attention=CROSS)
    cache = make_cache(spec)
    state = cache.new_state("s")
    state.bound = True  # as the runner binds it
    forward(state, "positive", 2, commit=True)
    state.populate_cross_attention("positive", "text", cross_pairs(spec, "text"))
    text, adapter = state.cross_attention("positive", "text"), state.adapter("positive")
    snapshot = state._export()
    state.bound = False  # the forward is over
    reads = {
        "adapter": lambda: state.adapter("positive"),
        "has_cross_attention": lambda: state.has_cross_attention("positive", "text"),
        "cross_attention": lambda: state.cross_attention("positive", "text"),
        "get_kv_caches": lambda: state.get_kv_caches("positive", seq_len=8),
        "commit": lambda: state.commit("positive"),
        "reset": lambda: state.reset(),
    }
    for name, call in reads.items():
        with pytest.raises(RuntimeError, match=rf"^{name}\(\) on the AR-Diffusion KV state of session 's' outside its "
                                                r"request: .*bind_ar_diffusion_state.*must not retain it"):
            call()
    other = cache.new_state("t")
    other.restore(snapshot)  # a state the runner does not hold (bound None) takes it
    assert other.export().metadata == snapshot.metadata
    other.close()
    for bound in (False, True):
        state.bound = bound
        for name, call in {"export": state.export, "restore": lambda: state.restore(snapshot),
                           "close": state.close}.items():
            with pytest.raises(RuntimeError, match=rf"^{name}\(\) on the AR-Diffusion KV state of session 's', which "
                                                    "the runner holds"):
                call()
    assert not state.closed and state.num_pages == 2 and state.page_ids() == list(adapter.page_ids)
    assert state.cross_attention_bytes == sum(k.nbytes + v.nbytes for k, v in text)
    assert state.cross_attention("positive", "text") is text and state.adapter("positive") is adapter  # bound again
    state.bound = False
    assert state._adapter("positive") is adapter  # the runner's views
    state._close()  # the runner releases the session
    released = (r"state is closed: the runner released the session \(closed, reset, evicted or swapped out\) and "
                r"freed its pages, which may hold another session's KV now")
    for name, call in {**reads, "export": state.export, "restore": lambda: state.restore(snapshot)}.items():
        with pytest.raises(RuntimeError, match=rf"^{name}\(\) on the AR-Diffusion KV state of session 's': the "
                                                + released):
            call()
    state.close()  # closed already: nothing to do
    assert state.num_pages == state.cross_attention_bytes == 0 and state.page_ids() == []
    assert cache.num_free_pages == cache.num_managed_pages
