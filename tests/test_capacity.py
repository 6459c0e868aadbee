"""The capacity planner against hand-computed arithmetic and published geometries."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import re

import pytest
import torch

from ardiff_cli.runtime.capability import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
)
from test_backends import needs_vllm_cpu

from ardiff_cli.runtime.capacity import MAX_SESSIONS, format_bytes, parse_bytes, plan_capacity
from ardiff_cli.runtime.errors import CapacityError, ConfigError
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache

GIB = 1 << 30
CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))


def wan14b_dreamzero(**overrides) -> ARDiffusionKVCacheSpec:
    fields = dict(
        num_layers=40, num_kv_heads=40, head_size=128, tokens_per_frame=220, frames_per_block=4,
        window_frames=12, kv_branches=CFG, session_capacity=16,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 512), ARDiffusionCrossAttentionKVSpec("image", 257)),
        max_scratch_tokens_per_branch=17,
    )
    fields.update(overrides)
    return ARDiffusionKVCacheSpec(**fields)


def self_forcing_13b() -> ARDiffusionKVCacheSpec:
    return ARDiffusionKVCacheSpec(
        num_layers=30, num_kv_heads=12, head_size=128, tokens_per_frame=1560, frames_per_block=3,
        window_frames=18, kv_branches=(ARDiffusionKVBranchSpec("main", 0),), session_capacity=4,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 512),),
    )


def test_published_bytes_per_token():
    assert plan_capacity(wan14b_dreamzero(), "bfloat16", 200 * GIB).bytes_per_token == 819_200
    assert plan_capacity(self_forcing_13b(), "bfloat16", 200 * GIB).bytes_per_token == 184_320
    assert plan_capacity(self_forcing_13b(), torch.float32, 200 * GIB).bytes_per_token == 368_640


def test_dreamzero_14b_plan_by_hand():
    plan = plan_capacity(wan14b_dreamzero(), "bfloat16", 80 * GIB, 0.9, attention_backend="vllm")
    bpp = 819_200 * 220  # one frame per page
    assert plan.bytes_per_page == bpp
    assert plan.managed_pages_per_session == 2 * 12  # two local slots x (0 sink + 12 window)
    assert plan.self_attention_bytes_per_branch == 12 * bpp
    assert plan.inflight_pages == 2 * 4
    scratch_pages_per_slot = -(-(4 * 220 + 17) // 220)  # one block + 17 registers, rounded up to pages = 5
    assert plan.scratch_pages == 2 * scratch_pages_per_slot == 10
    text = 2 * 40 * 40 * 512 * 128 * 2
    image = 2 * 40 * 40 * 257 * 128 * 2
    assert plan.cross_attention_bytes == {"text": text, "image": image}
    assert plan.cross_attention_bytes_per_session == 2 * (text + image)  # both CFG branches
    workspace = 2 * 40 * (12 + scratch_pages_per_slot) * 220 * 128 * 2
    assert plan.workspace_bytes == workspace
    assert plan.fixed_bytes == (1 + 8 + 10) * bpp + workspace
    per_session = 24 * bpp + 2 * (text + image)
    assert plan.bytes_per_session == per_session
    budget = int(80 * GIB * 0.9)
    assert plan.budget_bytes == budget
    assert plan.session_capacity == (budget - plan.fixed_bytes) // per_session
    assert plan.required_bytes(plan.session_capacity) <= budget < plan.required_bytes(plan.session_capacity + 1)
    assert plan.total_pages == 1 + plan.session_capacity * 24 + 8 + 10


def test_capacity_bounded_by_session_capacity_and_override():
    assert plan_capacity(self_forcing_13b(), "bfloat16", 1000 * GIB).session_capacity == 4
    assert plan_capacity(self_forcing_13b(), "bfloat16", 1000 * GIB, session_capacity=2).session_capacity == 2


def test_a_plan_says_whether_its_session_bound_or_its_budget_limits_it():
    """``bound_limits``: a smaller budget leaves the pool as it is only while the bound, not the budget, limits it
    (the memory hint of a step offers a smaller budget only then)."""
    spec = self_forcing_13b()
    assert plan_capacity(spec, "bfloat16", 1000 * GIB, session_capacity=2).bound_limits  # the budget holds more
    per_session = plan_capacity(spec, "bfloat16", 1000 * GIB).bytes_per_session
    exact = plan_capacity(spec, "bfloat16", 1000 * GIB).required_bytes(2)
    assert not plan_capacity(spec, "bfloat16", exact, 1.0, session_capacity=2).bound_limits  # both: 2 sessions
    assert plan_capacity(spec, "bfloat16", exact + per_session, 1.0, session_capacity=2).bound_limits
    assert not plan_capacity(spec, "bfloat16", exact, 1.0).bound_limits  # the spec's 4: the budget limits it


def test_one_session_admitted_when_it_fits_even_with_tiny_fraction():
    spec = self_forcing_13b()
    one = plan_capacity(spec, "bfloat16", 1000 * GIB).required_bytes_one_session
    plan = plan_capacity(spec, "bfloat16", one, 0.01)
    assert plan.session_capacity == 1 and plan.budget_bytes == one
    more = plan_capacity(spec, "bfloat16", 3 * one, 1.0)
    assert more.session_capacity == 3


def test_one_session_that_does_not_fit_fails_with_both_numbers():
    spec = wan14b_dreamzero()
    one = plan_capacity(spec, "bfloat16", 1000 * GIB).required_bytes_one_session
    with pytest.raises(CapacityError) as info:
        plan_capacity(spec, "bfloat16", 4 * GIB)
    message = str(info.value)
    assert format_bytes(one) in message and "4.00 GiB" in message and str(one) in message
    assert info.value.exit_code == 3


def test_model_owned_state_counts_per_session():
    base = plan_capacity(self_forcing_13b(), "bfloat16", 100 * GIB)
    spec = ARDiffusionKVCacheSpec(**{**self_forcing_13b().__dict__, "model_owned_state_bytes_per_session": 12345})
    owned = plan_capacity(spec, "bfloat16", 100 * GIB)
    assert owned.bytes_per_session - base.bytes_per_session == 12345
    assert owned.model_owned_bytes_per_session == 12345


def test_cross_attention_geometry_override():
    spec = wan14b_dreamzero(cross_attention=(ARDiffusionCrossAttentionKVSpec("image", 257, num_kv_heads=8,
                                                                              head_size=64),))
    plan = plan_capacity(spec, "bfloat16", 200 * GIB)
    assert plan.cross_attention_bytes == {"image": 2 * 40 * 8 * 257 * 64 * 2}


def test_page_size_split_keeps_capacity_exact():
    whole = plan_capacity(wan14b_dreamzero(), "bfloat16", 200 * GIB)
    split = plan_capacity(wan14b_dreamzero(tokens_per_frame=224), "bfloat16", 200 * GIB, page_size=16)
    assert split.pages_per_frame == 14 and split.page_size == 16
    assert split.managed_pages_per_session == 2 * 12 * 14
    assert split.bytes_per_page * split.pages_per_frame == 819_200 * 224
    assert whole.pages_per_frame == 1


def held_storage_bytes(obj, seen: dict[int, int] | None = None) -> int:
    """Bytes of every tensor storage ``obj`` holds in its attributes (views of one storage count once)."""
    seen = {} if seen is None else seen
    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else [obj]
    while values:
        value = values.pop()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, (tuple, list)):
            values.extend(value)
        elif isinstance(value, dict):
            values.extend(value.values())
    return sum(seen.values())


def fill_every_session(cache, plan, dtype, *, num_registers=0):
    """Commit four blocks on every branch of ``session_capacity`` sessions and populate their text caches."""
    spec = cache.spec
    seq_len = spec.frames_per_block * spec.tokens_per_frame
    states = [cache.new_state(str(i)) for i in range(plan.session_capacity)]
    for state in states:
        for branch in ("positive", "negative"):
            for _ in range(4):
                for ctx in state.get_kv_caches(branch, seq_len, commit_current=True):
                    q = torch.randn(spec.num_kv_heads, seq_len + num_registers, spec.head_size, dtype=dtype)
                    ctx.attend(q, q, q)
                state.commit(branch)
            state.populate_cross_attention(branch, "text", (
                (torch.zeros(spec.num_kv_heads, 5, spec.head_size, dtype=dtype),) * 2 for _ in range(spec.num_layers)))
    return states


@pytest.mark.parametrize("page_size", [None, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planned_bytes_equal_allocated_bytes(page_size, dtype):
    spec = ARDiffusionKVCacheSpec(
        num_layers=2, num_kv_heads=2, head_size=8, tokens_per_frame=4, frames_per_block=2, window_frames=3,
        sink_frames=1, kv_branches=CFG, session_capacity=3, max_scratch_tokens_per_branch=3,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 5),),
    )
    plan = plan_capacity(spec, dtype, 1 << 30, page_size=page_size)
    cache = ARDiffusionKVCache(spec, plan.num_managed_pages, dtype=dtype, page_size=page_size)
    assert cache.pool.nbytes == plan.pool_bytes
    assert cache.pool.kv.shape[3] == plan.total_pages
    # fill every session: pages + cross caches match the per-session figure
    states = fill_every_session(cache, plan, dtype)
    assert cache.allocator.num_free == plan.inflight_pages  # only the in-flight reserve is left
    allocated = cache.allocator.num_used * plan.bytes_per_page + sum(s.cross_attention_bytes for s in states)
    assert allocated == plan.session_capacity * plan.bytes_per_session
    assert held_storage_bytes(cache.pool) == plan.pool_bytes  # pages, workspace, and nothing the plan misses


def test_planned_bytes_count_the_cross_attention_of_every_branch_sharing_a_slot():
    """Branches on one local slot share self-attention storage, never cross-attention caches: each holds its own,
    and the plan must count them all, or more sessions are admitted than the memory holds."""
    spec = ARDiffusionKVCacheSpec(
        num_layers=2, num_kv_heads=2, head_size=8, tokens_per_frame=4, frames_per_block=2, window_frames=3,
        sink_frames=1, session_capacity=3, cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 5),),
        kv_branches=(ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 0)),
    )
    plan = plan_capacity(spec, torch.float32, 1 << 30)
    cache = ARDiffusionKVCache(spec, plan.num_managed_pages)
    seq_len = spec.frames_per_block * spec.tokens_per_frame
    states = [cache.new_state(str(i)) for i in range(plan.session_capacity)]
    for state in states:
        for _ in range(4):  # the slot's pages: sink + a full window
            for ctx in state.get_kv_caches("positive", seq_len, commit_current=True):
                q = torch.randn(spec.num_kv_heads, seq_len, spec.head_size)
                ctx.attend(q, q, q)
            state.commit("positive")
        for branch in ("positive", "negative"):
            state.populate_cross_attention(branch, "text", (
                (torch.zeros(spec.num_kv_heads, 5, spec.head_size),) * 2 for _ in range(spec.num_layers)))
    assert cache.allocator.num_free == plan.inflight_pages
    allocated = cache.allocator.num_used * plan.bytes_per_page + sum(s.cross_attention_bytes for s in states)
    assert allocated == plan.session_capacity * plan.bytes_per_session
    assert plan.cross_attention_bytes_per_session == 2 * plan.cross_attention_bytes["text"]


@pytest.mark.vllm
@needs_vllm_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_cpu_planned_bytes_equal_every_tensor_the_pool_holds(dtype):
    # 40-token pages under 32-token blocks: each forward packs 8-token tails and 3 registers for the kernel.
    spec = ARDiffusionKVCacheSpec(
        num_layers=2, num_kv_heads=2, head_size=32, tokens_per_frame=40, frames_per_block=2, window_frames=3,
        sink_frames=1, kv_branches=CFG, session_capacity=3, max_scratch_tokens_per_branch=3,
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 5),),
    )
    plan = plan_capacity(spec, dtype, 1 << 30, attention_backend="vllm")
    cache = ARDiffusionKVCache(spec, plan.num_managed_pages, dtype=dtype, attention_backend="vllm")
    pool = cache.pool
    assert pool.kernel.name == "vllm-cpu-attn"
    # The staging of those tails and registers is allocated once, sized for the largest forward, inside the
    # planned workspace (it used to be a torch.empty on every attend call, outside the plan).
    geometry = pool.geometry
    # the largest: a one-frame forward, 5 visible tails and the 83 - 40 scratch tokens left for registers
    assert geometry.tail_tokens == 8 and geometry.max_loose_tokens == (1 + 3 + 1) * 8 + (80 + 3 - 40)
    assert tuple(pool._staging.shape) == (2, geometry.max_loose_tokens, 2, 32)
    assert held_storage_bytes(pool) == pool.nbytes == plan.pool_bytes
    states = fill_every_session(cache, plan, dtype, num_registers=3)
    assert held_storage_bytes(pool) == plan.pool_bytes
    allocated = cache.allocator.num_used * plan.bytes_per_page + sum(s.cross_attention_bytes for s in states)
    assert allocated == plan.session_capacity * plan.bytes_per_session


def test_invalid_planner_inputs():
    """Each a ConfigError with a hint, as the README promises every error a caller can cause."""
    for kwargs, message, hint in (
            ({"gpu_memory_fraction": 1.5}, "gpu_memory_fraction must be in \\(0, 1\\], got 1.5", "such as 0.9"),
            ({"dtype": "int3"}, "unsupported KV dtype 'int3'", "'bfloat16'"),
            ({"session_capacity": 0}, "session_capacity must be a positive integer up to 2147483647, got 0",
             "whole number of sessions"),
            ({"attention_backend": "auto"}, "attention_backend must be 'torch' or 'vllm' for planning",
             "select_attention_backend")):
        with pytest.raises(ConfigError, match=message) as info:
            plan_capacity(self_forcing_13b(), kwargs.pop("dtype", "bfloat16"), GIB, **kwargs)
        assert hint in info.value.hint
    # a budget as text, as the engine takes it, was a TypeError ('<=' between str and int); True was 1 byte
    assert plan_capacity(self_forcing_13b(), "bfloat16", "64GiB") == plan_capacity(self_forcing_13b(), "bfloat16",
                                                                               64 * GIB)
    for budget, why in ((True, "cannot read a bool as a byte size"), (0, "a byte size must be positive, got 0"),
                        ("lots", "cannot read 'lots' as a byte size")):
        with pytest.raises(ConfigError, match=f"^available_bytes: {why}") as info:
            plan_capacity(self_forcing_13b(), "bfloat16", budget)
        assert "512MiB" in info.value.hint


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512MiB", 512 << 20), ("2 GiB", 2 << 30), ("1.5G", int(1.5 * GIB)), (1000, 1000), ("10kb", 10_000),
     ("1.7GiB", 1_825_361_100),  # 1825361100.8 bytes: with a unit, the fraction of a byte is dropped
     ("9007199254740993", 2**53 + 1), ("3GiB", 3 << 30),  # digits exactly: through a float, the first lost its 1
     ("007", 7), ("1e3", 1000), ("2.0", 2), ("1.5 gb", 15 * 10**8),
     ("0.999999999999999999999999999999999KiB", 1023)],  # exactly too: a float reads 0.99..9 as 1, 1024 bytes
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["lots", "-5", "0", "12XB", "inf", "1e400", "nan"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ConfigError):
        parse_bytes(text)


@pytest.mark.parametrize(("text", "why"), [
    ("", "it is empty"), ("GiB", "no number before 'GiB'"), ("inf", "not a finite number"),
    ("-inf", "not a finite number"), ("nan", "not a finite number"),
    ("1e400", "'1e400' as a byte size: too large (at most 16EiB, all that a 64-bit address space holds)"),
    ("10ZiB", "unknown unit 'ZiB'"), ("1e", "unknown unit 'e'"), ("1.2.3GiB", "'1.2.3' is not a plain number"),
    ("1e305", "too large (at most 16EiB"), (10**400, "a 1329-bit integer as a byte size: too large (at most 16EiB"),
    ("1e30", "too large (at most 16EiB"), ("16.01EiB", "too large"), (2**64 + 1, "a 65-bit integer"),
    ("\u0661\u0660\u0660", "is not a plain number"),  # Arabic-Indic 100: float() read it, --device refuses such digits
    ("1" * 5000, "too large (at most 16EiB"),  # int() refuses over 4300 digits: it said "is not a number"
    # read as a number option's value is (read_number): int() and float() took these
    ("1_000", "'1_000' is not a plain number"), ("\uff11GiB", "'\uff11' is not a plain number"),
    (" 1GiB", "a space or line break around or in it"), ("1GiB\n", "a space or line break around or in it"),
    ("1  GiB", "a space or line break around or in it"), ("1G B", "'1G' is not a plain number"),
    ("1e-400GiB", "less than one byte"),  # a float read it as 0 bytes
    ("1e9999999999999999999GiB", "too large (at most 16EiB"),
    ("caf\udce9", "cannot read 'caf\\xe9' as a byte size: 'caf\\xe9' is not a plain number"),  # not repr's \udce9
], ids=lambda value: str(value)[:12])
def test_parse_bytes_says_what_is_wrong(text, why):
    """Every unreadable size was 'cannot read X as a byte size', whatever was wrong; a YAML int past a float's range
    (10**400) passed, and the plan's float arithmetic raised OverflowError: 'a bug in ardiff'."""
    with pytest.raises(ConfigError, match=re.escape(why)) as caught:
        parse_bytes(text)
    assert "as a byte size: " in str(caught.value) and "KiB .. EiB" in caught.value.hint


@pytest.mark.parametrize(("text", "why"), [
    ("1.5", "a byte size without a unit is a whole number of bytes, got '1.5'"),
    ("1.5B", "a byte size in B is a whole number of bytes, got '1.5B'"),  # it said "without a unit" of 'B'
    ("0.5 b", "a byte size in B is a whole number of bytes, got '0.5 b'"),
])
def test_parse_bytes_of_a_fraction_of_a_byte_names_its_unit(text, why):
    with pytest.raises(ConfigError, match=re.escape(why)):
        parse_bytes(text)


def test_parse_bytes_takes_up_to_16_eib_in_any_form():
    """16EiB (2**64 bytes) is the most a byte size may be: 1e30 was a budget of '8.67e+11 EiB', planned on."""
    assert parse_bytes("16EiB") == 2**64 and parse_bytes(str(2**64)) == 2**64 and parse_bytes("18EB") == 18 * 10**18
    for text in ("16.01EiB", "1e30", str(2**64 + 1)):
        with pytest.raises(ConfigError, match=r"too large \(at most 16EiB, all that a 64-bit address space holds\)"):
            parse_bytes(text)


def test_format_bytes_reaches_eib_then_three_digits_and_parse_bytes_reads_each_unit_back():
    """A 1e30-byte budget showed as '909494701772928256.00 TiB': TiB was the largest unit."""
    assert format_bytes(1023) == "1023 B" and format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 << 40) == "3.00 TiB" and format_bytes(3 << 50) == "3.00 PiB"
    assert format_bytes(10 << 60) == "10.00 EiB" and format_bytes(1023 << 60) == "1023.00 EiB"
    assert format_bytes(10**30) == "8.67e+11 EiB" and format_bytes(-(10**30)) == "-8.67e+11 EiB"
    for size in (1536, 3 << 40, 3 << 50, 10 << 60):
        assert parse_bytes(format_bytes(size).replace(" ", "")) == size
    assert parse_bytes("1.5PB") == 1_500 * 1000**4 and parse_bytes("2 eb") == 2 * 1000**6


def test_visible_tokens_over_max_model_len_are_refused_by_plan_and_cache():
    # sink 1 + window 3 frames + one 2-frame block = 6 frames of 4 tokens: 24 visible tokens
    spec = ARDiffusionKVCacheSpec(num_layers=1, num_kv_heads=1, head_size=4, tokens_per_frame=4, frames_per_block=2,
                                  window_frames=3, sink_frames=1, kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
                                  session_capacity=1, max_model_len=23)
    message = "one attention call can see 24 tokens .* more than max_model_len=23"
    with pytest.raises(ConfigError, match=message):  # inspect-capacity says what loading will say
        plan_capacity(spec, "float32", GIB)
    with pytest.raises(ConfigError, match=message):
        ARDiffusionKVCache(spec, 64)
    assert plan_capacity(dataclasses.replace(spec, max_model_len=24), "float32", GIB).session_capacity == 1


def test_max_model_len_counts_the_tokens_a_call_sees_not_the_pages_scratch_rounds_up_to():
    """Registers that do not fill a page: the longest call is 2 window frames + a 1-frame block + 1 register = 13
    tokens, but the check counted the scratch as whole pages (16 tokens) and refused max_model_len=13, saying the call
    could see 16 (lingbot-world-14b's geometry, 1,560-token frames and 1 register, was told of 1,559 tokens too
    many)."""
    spec = ARDiffusionKVCacheSpec(num_layers=1, num_kv_heads=1, head_size=4, tokens_per_frame=4, frames_per_block=1,
                                  window_frames=2, kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
                                  session_capacity=1, max_scratch_tokens_per_branch=1, max_model_len=13)
    assert plan_capacity(spec, "float32", GIB).session_capacity == 1
    cache = ARDiffusionKVCache(spec, 64)
    state = cache.new_state("s")
    longest = 0
    for _ in range(4):  # past the window: every later call sees the whole window, the block and its register
        layer = state.get_kv_caches("main", 4, commit_current=True)[0]
        x = torch.randn(1, 5, 4)
        layer.attend(x, x, x)
        longest = max(longest, state.adapter("main").num_resident_frames * 4 + 5)
        state.commit("main")
        with pytest.raises(ValueError, match="0..1 scratch register tokens"):  # no call sees more
            state.get_kv_caches("main", 4)[0].attend(*(torch.randn(1, 6, 4),) * 3)
    assert longest == 13
    with pytest.raises(ConfigError, match=r"one attention call can see 13 tokens .* more than max_model_len=12$"):
        plan_capacity(dataclasses.replace(spec, max_model_len=12), "float32", GIB)


def test_a_window_that_would_fit_if_shorter_is_named_not_the_frame_size():
    """16-token frames, 1 register, max_model_len=40: a 1-frame window and block see 33 tokens, which fits, but the
    config check counted the scratch as whole frames (48) and said to lower the frame size."""
    from types import SimpleNamespace

    from ardiff_cli.runtime.config import _check_attention_span

    spec = ARDiffusionKVCacheSpec(num_layers=1, num_kv_heads=1, head_size=4, tokens_per_frame=16, frames_per_block=1,
                                  window_frames=4, kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
                                  session_capacity=1, max_scratch_tokens_per_branch=1, max_model_len=40)
    with pytest.raises(ConfigError, match=r"^c.yaml: field 'model.window_frames': one attention call can see 81 ") as e:
        _check_attention_span(spec, SimpleNamespace(window_frames=4, sink_frames=0, frames_per_block=1), "c.yaml")
    assert e.value.hint == "lower 'model.window_frames' to at most 1"  # not the pipeline's max_model_len
    assert plan_capacity(dataclasses.replace(spec, window_frames=1), "float32", GIB).session_capacity == 1


def test_planner_imports_no_torch():
    code = (
        "import sys; from ardiff_cli.runtime import plan_capacity, ARDiffusionKVCacheSpec; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_torch_backend_stages_scratch_in_the_workspace():
    vllm = plan_capacity(wan14b_dreamzero(), "bfloat16", 80 * GIB, 0.9, attention_backend="vllm")
    torch_plan = plan_capacity(wan14b_dreamzero(), "bfloat16", 80 * GIB, 0.9)
    assert torch_plan.attention_backend == "torch" and torch_plan.scratch_pages == 0
    assert torch_plan.workspace_bytes == vllm.workspace_bytes  # sized for history + one block + registers
    assert vllm.fixed_bytes - torch_plan.fixed_bytes == 10 * vllm.bytes_per_page
    assert torch_plan.total_pages == 1 + torch_plan.num_managed_pages
    with pytest.raises(ConfigError, match="attention_backend must be 'torch' or 'vllm'"):
        plan_capacity(wan14b_dreamzero(), "bfloat16", 80 * GIB, attention_backend="auto")


def test_plan_never_exceeds_its_budget_when_the_session_limit_is_high():
    """capacity is what fits in budget - fixed, not budget // per_session."""
    for gib in (20, 200):
        plan = plan_capacity(wan14b_dreamzero(), "bfloat16", gib * GIB, 0.9, session_capacity=10_000,
                             attention_backend="vllm")
        assert plan.session_capacity == (plan.budget_bytes - plan.fixed_bytes) // plan.bytes_per_session
        assert plan.required_bytes(plan.session_capacity) <= plan.budget_bytes


def test_a_session_that_does_not_fit_says_where_its_bytes_go():
    # "one session needs 190.74 GiB" and a hint to shrink the window, for a text context of 1e8 tokens: the
    # message now names each part, as the plan that fits counts it
    spec = wan14b_dreamzero(model_owned_state_bytes_per_session=4096)
    plan = plan_capacity(spec, "bfloat16", 1 << 40)
    with pytest.raises(CapacityError) as caught:
        plan_capacity(spec, "bfloat16", 1 << 30)
    assert str(caught.value).endswith(
        f"is available: self-attention (sink + window) "
        f"{format_bytes(plan.managed_pages_per_session * plan.bytes_per_page)}, cross-attention caches "
        f"{format_bytes(plan.cross_attention_bytes_per_session)}, fixed (null page, in-flight block, workspace) "
        f"{format_bytes(plan.fixed_bytes)}, model-owned {format_bytes(plan.model_owned_bytes_per_session)}")


def test_a_smaller_window_is_hinted_at_only_when_a_one_block_window_would_fit():
    spec = wan14b_dreamzero()
    smallest = ARDiffusionKVCacheSpec(**{**spec.__dict__, "window_frames": spec.frames_per_block})
    available = plan_capacity(smallest, "bfloat16", 1 << 50).required_bytes(1)  # that window, exactly
    for memory, helps in ((available, True), (available - 1, False)):
        with pytest.raises(CapacityError) as caught:
            plan_capacity(spec, "bfloat16", memory)
        assert caught.value.window_helps is helps
        assert caught.value.hint.startswith("use a smaller window, model or dtype" if helps else
                                            "use a smaller model or dtype")
    # A text context of 1e8 tokens on an 80 GiB device was told to shrink its window: no window makes it fit.
    huge_text = wan14b_dreamzero(cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 10**8),))
    with pytest.raises(CapacityError) as caught:
        plan_capacity(huge_text, "bfloat16", 80 * GIB)
    assert caught.value.window_helps is False and "window" not in caught.value.hint


GIB = 1 << 30


def small_spec() -> ARDiffusionKVCacheSpec:
    return ARDiffusionKVCacheSpec(num_layers=2, num_kv_heads=2, head_size=8, tokens_per_frame=4, frames_per_block=2,
                                  window_frames=3, sink_frames=1, kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
                                  session_capacity=2)


def test_format_bytes_switches_unit_at_exactly_1024():
    assert format_bytes(1024) == "1.00 KiB" and format_bytes(1 << 20) == "1.00 MiB"
    assert format_bytes(1 << 30) == "1.00 GiB" and format_bytes(1 << 60) == "1.00 EiB"


def test_parse_bytes_takes_exactly_16_eib_and_refuses_a_byte_more():
    assert parse_bytes(2**64) == 2**64  # 16EiB: the documented maximum
    with pytest.raises(ConfigError, match="a 65-bit integer as a byte size: too large"):
        parse_bytes(2**64 + 1)


def test_session_capacity_takes_exactly_max_sessions():
    plan = plan_capacity(small_spec(), "float32", GIB, session_capacity=MAX_SESSIONS)
    assert plan.session_capacity_limit == MAX_SESSIONS == 2**31 - 1
    with pytest.raises(ConfigError, match="session_capacity must be a positive integer up to 2147483647"):
        plan_capacity(small_spec(), "float32", GIB, session_capacity=MAX_SESSIONS + 1)


def test_a_session_that_does_not_fit_names_only_the_parts_it_has():
    """No cross-attention and no model-owned state: '... 0 B' parts would only be noise in the message."""
    from ardiff_cli.runtime.errors import CapacityError

    plan = plan_capacity(small_spec(), "float32", GIB)
    with pytest.raises(CapacityError) as caught:
        plan_capacity(small_spec(), "float32", plan.required_bytes_one_session - 1)
    assert str(caught.value).endswith(
        "is available: self-attention (sink + window) "
        f"{format_bytes(plan.managed_pages_per_session * plan.bytes_per_page)}"
        f", fixed (null page, in-flight block, workspace) {format_bytes(plan.fixed_bytes)}")
    assert "cross-attention" not in str(caught.value) and "model-owned" not in str(caught.value)


@pytest.mark.parametrize(("dtype", "name", "size"), [
    ("bf16", "bfloat16", 2), ("half", "float16", 2), ("fp32", "float32", 4),
    ("float8_e4m3fn", "float8_e4m3fn", 1), ("float8_e5m2", "float8_e5m2", 1)])
def test_every_kv_dtype_spelling_plans_with_its_name_and_element_size(dtype, name, size):
    plan = plan_capacity(small_spec(), dtype, GIB)
    reference = plan_capacity(small_spec(), "float32", GIB)
    assert (plan.dtype, plan.dtype_size) == (name, size)
    assert plan.bytes_per_token * 4 == reference.bytes_per_token * size


def test_available_host_memory_is_in_bytes():
    """/proc/meminfo counts kB: without the factor 1024 the host looked 1024 times smaller (8 GiB free: 8 MiB)."""
    from ardiff_cli.runtime.capacity import available_host_memory, total_host_memory

    total = total_host_memory()
    assert total // 64 < available_host_memory() <= total
