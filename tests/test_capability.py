"""The typed contract: validation of every spec field, defaults, derived properties, protocols."""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager

import numpy as np
import pytest

from ardiff_cli.runtime.capability import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
    SupportsARDiffusionPipeline,
    SupportsARDiffusionWarmup,
)

POSITIVE_FIELDS = (
    "num_layers",
    "num_kv_heads",
    "head_size",
    "tokens_per_frame",
    "frames_per_block",
    "window_frames",
    "session_capacity",
    "max_model_len",
)
NON_NEGATIVE_FIELDS = ("sink_frames", "max_scratch_tokens_per_branch", "model_owned_state_bytes_per_session")


def assert_names(excinfo: pytest.ExceptionInfo, *parts: str) -> None:
    message = str(excinfo.value)
    for part in parts:
        assert part in message, f"{part!r} missing from error message {message!r}"


# ----------------------------------------------------------------- branch spec
def test_branch_spec_valid():
    branch = ARDiffusionKVBranchSpec("positive", 1)
    assert (branch.name, branch.local_index) == ("positive", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        branch.local_index = 0  # type: ignore[misc]


# "/" separates the names of a session's tensors in its swap snapshot: a branch 'cam/left' was swapped out and
# could not be restored (SwapRestoreError, its history lost), a cache 'text/en' only after another eviction
@pytest.mark.parametrize("name", ["", None, 3, b"positive", "cam/left"])
def test_branch_spec_bad_name(name):
    with pytest.raises(ValueError) as excinfo:
        ARDiffusionKVBranchSpec(name, 0)
    assert_names(excinfo, "name", repr(name))


@pytest.mark.parametrize("index", [-1, -7, "0", 1.0, True, False, None])
def test_branch_spec_bad_local_index(index):
    with pytest.raises(ValueError) as excinfo:
        ARDiffusionKVBranchSpec("positive", index)
    assert_names(excinfo, "local_index", str(index))


# --------------------------------------------------------- cross-attention spec
def test_cross_spec_defaults_to_self_geometry():
    cache = ARDiffusionCrossAttentionKVSpec("text", 7)
    assert (cache.num_kv_heads, cache.head_size) == (None, None)


@pytest.mark.parametrize("name", ["", None, 5, "text/en"])
def test_cross_spec_bad_name(name):
    with pytest.raises(ValueError) as excinfo:
        ARDiffusionCrossAttentionKVSpec(name, 4)
    assert_names(excinfo, "name", repr(name))


@pytest.mark.parametrize("tokens", [0, -1, "4", 4.0, True, None])
def test_cross_spec_bad_num_tokens(tokens):
    with pytest.raises(ValueError) as excinfo:
        ARDiffusionCrossAttentionKVSpec("text", tokens)
    assert_names(excinfo, "num_tokens", str(tokens))


@pytest.mark.parametrize("field", ["num_kv_heads", "head_size"])
@pytest.mark.parametrize("value", [0, -2, "2", 2.0, True])
def test_cross_spec_bad_geometry(field, value):
    with pytest.raises(ValueError) as excinfo:
        ARDiffusionCrossAttentionKVSpec("image", 4, **{field: value})
    assert_names(excinfo, field, str(value), "image")


# -------------------------------------------------------------- KV cache spec
def test_cache_spec_defaults():
    spec = ARDiffusionKVCacheSpec(
        num_layers=1,
        num_kv_heads=1,
        head_size=4,
        tokens_per_frame=2,
        frames_per_block=1,
        window_frames=1,
        kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
        session_capacity=1,
    )
    assert spec.sink_frames == 0
    assert spec.reset_at_boundary is False
    assert spec.cross_attention == ()
    assert spec.max_model_len == 1 << 20
    assert spec.max_scratch_tokens_per_branch == 0
    assert spec.model_owned_state_bytes_per_session == 0
    assert spec.num_local_kv_branches == 1
    assert spec.cross_attention_lengths == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.window_frames = 2  # type: ignore[misc]


# The contract's fields in its order, with its defaults (MISSING: required): positional construction stays valid.
SEED_FIELDS = {
    ARDiffusionKVBranchSpec: [("name", dataclasses.MISSING), ("local_index", dataclasses.MISSING)],
    ARDiffusionCrossAttentionKVSpec: [("name", dataclasses.MISSING), ("num_tokens", dataclasses.MISSING)],
    ARDiffusionKVCacheSpec: [
        ("num_layers", dataclasses.MISSING), ("num_kv_heads", dataclasses.MISSING), ("head_size", dataclasses.MISSING),
        ("tokens_per_frame", dataclasses.MISSING), ("frames_per_block", dataclasses.MISSING),
        ("window_frames", dataclasses.MISSING), ("kv_branches", dataclasses.MISSING),
        ("session_capacity", dataclasses.MISSING), ("sink_frames", 0), ("reset_at_boundary", False),
        ("cross_attention", ()), ("max_model_len", 1 << 20), ("max_scratch_tokens_per_branch", 0),
        ("model_owned_state_bytes_per_session", 0),
    ],
}


@pytest.mark.parametrize("cls", list(SEED_FIELDS), ids=lambda cls: cls.__name__)
def test_spec_classes_keep_the_contracts_fields_order_and_defaults(cls):
    fields = [(f.name, f.default) for f in dataclasses.fields(cls)]
    assert fields[: len(SEED_FIELDS[cls])] == SEED_FIELDS[cls]
    # fields ardiff adds come after the contract's and have defaults
    assert all(default is not dataclasses.MISSING for _, default in fields[len(SEED_FIELDS[cls]):])
    assert cls.__dataclass_params__.frozen


def test_cache_spec_built_positionally_as_the_contract_orders_it():
    spec = ARDiffusionKVCacheSpec(2, 4, 16, 8, 3, 6, (ARDiffusionKVBranchSpec("main", 0),), 1, 2)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size, spec.tokens_per_frame, spec.frames_per_block,
            spec.window_frames, spec.session_capacity, spec.sink_frames) == (2, 4, 16, 8, 3, 6, 1, 2)


@pytest.mark.parametrize("field", POSITIVE_FIELDS)
@pytest.mark.parametrize("value", [0, -1, "3", 2.5, 3.0, True, None])
def test_cache_spec_positive_fields(make_spec, field, value):
    with pytest.raises(ValueError) as excinfo:
        make_spec(**{field: value})
    assert_names(excinfo, field, str(value))


@pytest.mark.parametrize("field", NON_NEGATIVE_FIELDS)
@pytest.mark.parametrize("value", [-1, -100, "0", 1.0, True, False, None])
def test_cache_spec_non_negative_fields(make_spec, field, value):
    with pytest.raises(ValueError) as excinfo:
        make_spec(**{field: value})
    assert_names(excinfo, field, str(value))


@pytest.mark.parametrize("field", NON_NEGATIVE_FIELDS)
def test_cache_spec_non_negative_fields_accept_zero(make_spec, field):
    assert getattr(make_spec(**{field: 0}), field) == 0


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_cache_spec_reset_at_boundary_must_be_bool(make_spec, value):
    with pytest.raises(ValueError) as excinfo:
        make_spec(reset_at_boundary=value)
    assert_names(excinfo, "reset_at_boundary", str(value))


@pytest.mark.parametrize(
    "branches",
    [None, ARDiffusionKVBranchSpec("main", 0), 3, {"main": 0}],
    ids=["none", "bare-spec", "int", "dict"],
)
def test_cache_spec_kv_branches_wrong_type(make_spec, branches):
    with pytest.raises(ValueError) as excinfo:
        make_spec(kv_branches=branches)
    assert_names(excinfo, "kv_branches")


@pytest.mark.parametrize("branches", [(), []])
def test_cache_spec_empty_branch_list(make_spec, branches):
    with pytest.raises(ValueError) as excinfo:
        make_spec(kv_branches=branches)
    assert_names(excinfo, "kv_branches", "at least one")


def test_cache_spec_branch_elements_must_be_specs(make_spec):
    with pytest.raises(ValueError) as excinfo:
        make_spec(kv_branches=(ARDiffusionKVBranchSpec("main", 0), ("aux", 1)))
    assert_names(excinfo, "kv_branches", "aux")


def test_cache_spec_duplicate_branch_names(make_spec):
    with pytest.raises(ValueError) as excinfo:
        make_spec(kv_branches=(ARDiffusionKVBranchSpec("main", 0), ARDiffusionKVBranchSpec("main", 1)))
    assert_names(excinfo, "unique", "main")


@pytest.mark.parametrize("indices", [(1,), (0, 2), (1, 2), (0, 0, 2)])
def test_cache_spec_non_contiguous_local_index(make_spec, indices):
    branches = tuple(ARDiffusionKVBranchSpec(f"b{i}", index) for i, index in enumerate(indices))
    with pytest.raises(ValueError) as excinfo:
        make_spec(kv_branches=branches)
    assert_names(excinfo, "local_index", "contiguous", str(sorted(set(indices))))


@pytest.mark.parametrize("cross", [None, ARDiffusionCrossAttentionKVSpec("text", 4), ("text", 4)])
def test_cache_spec_cross_attention_wrong_type(make_spec, cross):
    with pytest.raises(ValueError) as excinfo:
        make_spec(cross_attention=cross)
    assert_names(excinfo, "cross_attention")


def test_cache_spec_duplicate_cross_names(make_spec):
    cross = (ARDiffusionCrossAttentionKVSpec("text", 4), ARDiffusionCrossAttentionKVSpec("text", 8))
    with pytest.raises(ValueError) as excinfo:
        make_spec(cross_attention=cross)
    assert_names(excinfo, "cross-attention", "unique", "text")


def test_numpy_integers_are_taken_as_the_plain_ints_they_hold(make_spec):
    """The contract only compares its integer fields, so a geometry computed with numpy (``np.prod`` of a latent
    grid) is a valid spec, and the rest of the runtime takes numpy integers too. The spec refused them as
    'local_index must be an integer, got np.int64(0)'; kept as numpy, the KV cache's JSON record of the spec
    would fail instead."""
    numpy_spec = make_spec(
        num_layers=np.int64(2), tokens_per_frame=np.int32(4), session_capacity=np.uint16(2), sink_frames=np.int64(1),
        max_scratch_tokens_per_branch=np.int8(0),
        kv_branches=(ARDiffusionKVBranchSpec("positive", np.int64(0)),
                     ARDiffusionKVBranchSpec("negative", np.int64(1))),
        cross_attention=(ARDiffusionCrossAttentionKVSpec("image", np.int64(5), num_kv_heads=np.int64(1),
                                                         head_size=np.int32(4)),),
    )
    plain_spec = make_spec(
        kv_branches=(ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1)),
        cross_attention=(ARDiffusionCrossAttentionKVSpec("image", 5, num_kv_heads=1, head_size=4),),
    )
    assert numpy_spec == plain_spec and hash(numpy_spec) == hash(plain_spec)
    # plain ints: the KV cache records its spec as JSON (a numpy integer is a TypeError there)
    assert json.dumps(dataclasses.asdict(numpy_spec)) == json.dumps(dataclasses.asdict(plain_spec))
    ints = [numpy_spec.num_layers, numpy_spec.tokens_per_frame, numpy_spec.session_capacity, numpy_spec.sink_frames,
            numpy_spec.kv_branches[1].local_index, *dataclasses.astuple(numpy_spec.cross_attention[0])[1:]]
    assert all(type(value) is int for value in ints), ints
    with pytest.raises(ValueError, match=r"local_index must be non-negative, got -1"):
        ARDiffusionKVBranchSpec("main", np.int64(-1))
    with pytest.raises(ValueError, match=r"num_layers must be an integer"):
        make_spec(num_layers=np.float64(2.0))


def test_cache_spec_lists_are_frozen_to_tuples(make_spec):
    spec = make_spec(
        kv_branches=[ARDiffusionKVBranchSpec("main", 0)],
        cross_attention=[ARDiffusionCrossAttentionKVSpec("text", 4)],
    )
    assert isinstance(spec.kv_branches, tuple) and isinstance(spec.cross_attention, tuple)
    assert hash(spec) == hash(make_spec(
        kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
        cross_attention=(ARDiffusionCrossAttentionKVSpec("text", 4),),
    ))


@pytest.mark.parametrize(
    "indices, expected",
    [((0,), 1), ((0, 1), 2), ((0, 0), 1), ((0, 1, 1, 0), 2), ((2, 0, 1), 3)],
)
def test_num_local_kv_branches(make_spec, indices, expected):
    branches = tuple(ARDiffusionKVBranchSpec(f"b{i}", index) for i, index in enumerate(indices))
    assert make_spec(kv_branches=branches).num_local_kv_branches == expected


def test_cross_attention_lengths_and_geometry(make_spec):
    spec = make_spec(
        num_kv_heads=3,
        head_size=16,
        cross_attention=(
            ARDiffusionCrossAttentionKVSpec("text", 12),
            ARDiffusionCrossAttentionKVSpec("image", 5, num_kv_heads=2, head_size=32),
            ARDiffusionCrossAttentionKVSpec("audio", 9, head_size=8),
        ),
    )
    assert spec.cross_attention_lengths == {"text": 12, "image": 5, "audio": 9}
    assert spec.cross_geometry("text") == (3, 12, 16)  # defaults to the self-attention geometry
    assert spec.cross_geometry("image") == (2, 5, 32)
    assert spec.cross_geometry("audio") == (3, 9, 8)
    with pytest.raises(KeyError) as excinfo:
        spec.cross_geometry("video")
    assert_names(excinfo, "video", "text", "image", "audio")


def test_branch_lookup(make_spec):
    spec = make_spec()
    assert spec.branch("negative") == ARDiffusionKVBranchSpec("negative", 1)
    assert spec.branch_names == ("positive", "negative")
    with pytest.raises(KeyError) as excinfo:
        spec.branch("neutral")
    assert_names(excinfo, "neutral", "positive", "negative")


# ------------------------------------------------------------------- protocols
class _FullPipeline:
    def ar_diffusion_kv_cache_spec(self):
        return None

    @contextmanager
    def bind_ar_diffusion_state(self, session_id, state):
        yield

    def reset_ar_diffusion_session(self, session_id):
        pass

    def close_ar_diffusion_session(self, session_id):
        pass


@pytest.mark.parametrize(
    "missing",
    [
        None,
        "ar_diffusion_kv_cache_spec",
        "bind_ar_diffusion_state",
        "reset_ar_diffusion_session",
        "close_ar_diffusion_session",
    ],
)
def test_pipeline_protocol_is_runtime_checkable(missing):
    members = {
        name: getattr(_FullPipeline, name)
        for name in (
            "ar_diffusion_kv_cache_spec",
            "bind_ar_diffusion_state",
            "reset_ar_diffusion_session",
            "close_ar_diffusion_session",
        )
        if name != missing
    }
    pipeline = type("Pipeline", (), members)()
    assert isinstance(pipeline, SupportsARDiffusionPipeline) is (missing is None)
    assert not isinstance(pipeline, SupportsARDiffusionWarmup)


def test_warmup_protocol_is_runtime_checkable():
    class WithWarmup(_FullPipeline):
        def ar_diffusion_warmup_requests(self, session_id):
            return iter(())

    assert isinstance(WithWarmup(), SupportsARDiffusionWarmup)
    assert isinstance(WithWarmup(), SupportsARDiffusionPipeline)
    assert not isinstance(object(), SupportsARDiffusionWarmup)


# The contract's own validation messages: each of ardiff's starts with the contract's (callers match on them).
SEED_MESSAGES = [
    (lambda make_spec: ARDiffusionKVBranchSpec("", 0), "AR-Diffusion KV branch names must be non-empty"),
    (lambda make_spec: ARDiffusionKVBranchSpec("main", -1),
     "AR-Diffusion KV branch local_index must be non-negative, got -1"),
    (lambda make_spec: ARDiffusionCrossAttentionKVSpec("", 4),
     "AR-Diffusion cross-attention cache names must be non-empty"),
    (lambda make_spec: ARDiffusionCrossAttentionKVSpec("text", 0),
     "AR-Diffusion cross-attention num_tokens must be positive, got 0"),
    (lambda make_spec: make_spec(num_layers=0), "AR-Diffusion num_layers must be positive, got 0"),
    (lambda make_spec: make_spec(sink_frames=-1), "AR-Diffusion sink_frames must be non-negative, got -1"),
    (lambda make_spec: make_spec(max_scratch_tokens_per_branch=-1),
     "AR-Diffusion max_scratch_tokens_per_branch must be non-negative, got -1"),
    (lambda make_spec: make_spec(model_owned_state_bytes_per_session=-1),
     "AR-Diffusion model_owned_state_bytes_per_session must be non-negative, got -1"),
    (lambda make_spec: make_spec(kv_branches=()), "AR-Diffusion requires at least one KV branch"),
    (lambda make_spec: make_spec(kv_branches=(ARDiffusionKVBranchSpec("a", 0), ARDiffusionKVBranchSpec("a", 1))),
     "AR-Diffusion KV branch names must be unique, got ['a', 'a']"),
    (lambda make_spec: make_spec(kv_branches=(ARDiffusionKVBranchSpec("a", 1),)),
     "AR-Diffusion KV branch local_index values must be contiguous from zero, got [1]"),
    (lambda make_spec: make_spec(cross_attention=(ARDiffusionCrossAttentionKVSpec("t", 1),
                                                  ARDiffusionCrossAttentionKVSpec("t", 2))),
     "AR-Diffusion cross-attention cache names must be unique, got ['t', 't']"),
]


@pytest.mark.parametrize("build, message", SEED_MESSAGES, ids=[message for _, message in SEED_MESSAGES])
def test_validation_messages_start_with_the_contracts(make_spec, build, message):
    with pytest.raises(ValueError) as excinfo:
        build(make_spec)
    assert str(excinfo.value).startswith(message), f"{str(excinfo.value)!r} does not start with {message!r}"
