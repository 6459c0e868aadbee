"""Random session lifecycles against a reference model: no page owned twice, none leaked, all returned.

Operations: begin (new_state), forward (get_kv_caches + attend on every layer, committed or left
pending), commit, a partial commit pass, reset (with and without kept cross-attention), populate
cross-attention (complete or failing), close -- over several sessions and branches, including two
branches that share a local storage slot. The cache is deliberately too small for every session to
hold an in-flight block at once, so exhaustion is exercised too and must be predicted exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ardiff_cli.runtime.capability import (
    ARDiffusionCrossAttentionKVSpec,
    ARDiffusionKVBranchSpec,
    ARDiffusionKVCacheSpec,
)
from ardiff_cli.runtime.kv.allocator import KVCacheExhaustedError
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.kv.layout import KVLayout

SESSIONS = ("s0", "s1", "s2")
CROSS_NAMES = ("text", "image")


@dataclass
class BranchModel:
    committed: int = 0  # absolute frames committed
    pending_frames: int = 0  # frames of an allocated, uncommitted commit pass (0: none)


@dataclass
class SessionModel:
    branches: dict[str, BranchModel]
    cross: set[tuple[str, str]] = field(default_factory=set)


class KVLifecycleMachine(RuleBasedStateMachine):
    BRANCHES: tuple[ARDiffusionKVBranchSpec, ...] = (
        ARDiffusionKVBranchSpec("positive", 0),
        ARDiffusionKVBranchSpec("negative", 1),
    )
    PAGE_SIZE: int | None = None

    def __init__(self):
        super().__init__()
        self.spec = ARDiffusionKVCacheSpec(
            num_layers=2,
            num_kv_heads=1,
            head_size=4,
            tokens_per_frame=2,
            frames_per_block=2,
            window_frames=2,
            sink_frames=1,
            kv_branches=self.BRANCHES,
            session_capacity=2,
            max_scratch_tokens_per_branch=2,
            cross_attention=(
                ARDiffusionCrossAttentionKVSpec("text", 3),
                ARDiffusionCrossAttentionKVSpec("image", 2, head_size=2),
            ),
        )
        layout = KVLayout.from_spec(self.spec, page_size=self.PAGE_SIZE, scratch_blocks=1)
        # Room for one resting session and one in-flight block per slot: a second session runs short.
        self.cache = ARDiffusionKVCache(
            self.spec, layout.managed_pages(1), page_size=self.PAGE_SIZE, scratch_blocks=1
        )
        self.ppf = self.cache.layout.pages_per_frame
        self.initial_free = self.cache.num_free_pages
        self.states: dict[str, object] = {}
        self.models: dict[str, SessionModel] = {}
        self.branch_names = [b.name for b in self.BRANCHES]
        self.slot = {b.name: b.local_index for b in self.BRANCHES}

    # ------------------------------------------------------------ model helpers
    def resident_frames(self, committed: int) -> int:
        return min(committed, self.spec.sink_frames + self.spec.window_frames)

    def model_pages(self, model: SessionModel) -> int:
        return sum((self.resident_frames(b.committed) + b.pending_frames) * self.ppf for b in model.branches.values())

    def model_free(self) -> int:
        return self.initial_free - sum(self.model_pages(m) for m in self.models.values())

    def slot_busy(self, model: SessionModel, branch: str) -> bool:
        return any(
            other != branch and self.slot[other] == self.slot[branch] and (b.committed > 0 or b.pending_frames)
            for other, b in model.branches.items()
        )

    def tensors(self, length: int):
        shape = (self.spec.num_kv_heads, length, self.spec.head_size)
        return torch.randn(shape), torch.randn(shape), torch.randn(shape)

    def cross_pairs(self, name: str, count: int):
        heads, tokens, head_size = self.spec.cross_geometry(name)
        return [(torch.randn(heads, tokens, head_size), torch.randn(heads, tokens, head_size)) for _ in range(count)]

    # -------------------------------------------------------------------- rules
    @initialize()
    def two_sessions(self):
        self.begin(SESSIONS[0])
        self.begin(SESSIONS[1])

    @rule(session=st.sampled_from(SESSIONS))
    def begin(self, session):
        if session in self.states:
            return
        free = self.cache.num_free_pages
        self.states[session] = self.cache.new_state(session)
        self.models[session] = SessionModel({name: BranchModel() for name in self.branch_names})
        assert self.cache.num_free_pages == free  # a new state allocates nothing

    @precondition(lambda self: self.states)
    @rule(
        data=st.data(),
        num_frames=st.integers(1, 2),
        commit_pass=st.booleans(),
        then_commit=st.booleans(),
        num_registers=st.integers(0, 2),
    )
    def forward(self, data, num_frames, commit_pass, then_commit, num_registers):
        self.run_forward(data, num_frames, commit_pass, then_commit, num_registers)

    def run_forward(self, data, num_frames, commit_pass, then_commit, num_registers):
        session = data.draw(st.sampled_from(sorted(self.states)))
        branch = data.draw(st.sampled_from(self.branch_names))
        state, model = self.states[session], self.models[session]
        bm = model.branches[branch]
        seq_len = num_frames * self.spec.tokens_per_frame
        if bm.pending_frames:
            with pytest.raises(RuntimeError, match="replaced before"):
                state.get_kv_caches(branch, seq_len=seq_len, commit_current=commit_pass)
            return
        contexts = state.get_kv_caches(branch, seq_len=seq_len, commit_current=commit_pass)
        need = num_frames * self.ppf
        if commit_pass and self.slot_busy(model, branch):
            expected_error = RuntimeError
        elif commit_pass and need > self.model_free():
            expected_error = KVCacheExhaustedError
        else:
            expected_error = None
        for layer, ctx in enumerate(contexts):
            q, k, v = self.tensors(seq_len + num_registers)
            if expected_error is not None:
                with pytest.raises(expected_error):
                    ctx.attend(q, k, v)
                assert state.commit(branch) == 0
                return
            assert ctx.attend(q, k, v).shape == q.shape
        if commit_pass:
            bm.pending_frames = num_frames
        if then_commit:
            self.do_commit(session, branch)

    @precondition(lambda self: self.states)
    @rule(data=st.data(), num_blocks=st.integers(1, 3))
    def rollout(self, data, num_blocks):
        """Several committed full blocks in a row: fills windows, so sessions compete for pages."""
        for _ in range(num_blocks):
            self.run_forward(data, self.spec.frames_per_block, True, True, 0)

    def do_commit(self, session, branch):
        bm = self.models[session].branches[branch]
        assert self.states[session].commit(branch) == bm.pending_frames
        bm.committed += bm.pending_frames
        bm.pending_frames = 0

    @precondition(lambda self: self.states)
    @rule(data=st.data())
    def commit(self, data):
        session = data.draw(st.sampled_from(sorted(self.states)))
        branch = data.draw(st.sampled_from(self.branch_names))
        self.do_commit(session, branch)

    @precondition(lambda self: self.states)
    @rule(data=st.data())
    def partial_commit_pass(self, data):
        """A commit pass where only the first layer ran: commit discards the block loudly."""
        session = data.draw(st.sampled_from(sorted(self.states)))
        branch = data.draw(st.sampled_from(self.branch_names))
        state, model = self.states[session], self.models[session]
        bm = model.branches[branch]
        if bm.pending_frames or self.slot_busy(model, branch) or self.ppf > self.model_free():
            return
        contexts = state.get_kv_caches(branch, seq_len=self.spec.tokens_per_frame, commit_current=True)
        contexts[0].attend(*self.tensors(self.spec.tokens_per_frame))
        with pytest.raises(RuntimeError, match="partial forward"):
            state.commit(branch)

    @precondition(lambda self: self.states)
    @rule(data=st.data(), commit_pass=st.booleans())
    def commit_before_attend(self, data, commit_pass):
        """Contexts committed before any layer ran are stale: attending them allocates nothing."""
        session = data.draw(st.sampled_from(sorted(self.states)))
        branch = data.draw(st.sampled_from(self.branch_names))
        state, bm = self.states[session], self.models[session].branches[branch]
        if bm.pending_frames:
            return
        contexts = state.get_kv_caches(branch, seq_len=self.spec.tokens_per_frame, commit_current=commit_pass)
        assert state.commit(branch) == 0
        with pytest.raises(RuntimeError, match="stale"):
            contexts[-1].attend(*self.tensors(self.spec.tokens_per_frame))

    @precondition(lambda self: self.states)
    @rule(data=st.data(), keep=st.sets(st.sampled_from(CROSS_NAMES)))
    def reset(self, data, keep):
        session = data.draw(st.sampled_from(sorted(self.states)))
        self.states[session].reset(keep_cross_attention=tuple(sorted(keep)))
        model = self.models[session]
        model.branches = {name: BranchModel() for name in self.branch_names}
        model.cross = {key for key in model.cross if key[1] in keep}

    @precondition(lambda self: self.states)
    @rule(data=st.data(), complete=st.booleans())
    def populate_cross(self, data, complete):
        session = data.draw(st.sampled_from(sorted(self.states)))
        branch = data.draw(st.sampled_from(self.branch_names))
        name = data.draw(st.sampled_from(CROSS_NAMES))
        state = self.states[session]
        bytes_before = state.cross_attention_bytes
        if complete:
            state.populate_cross_attention(branch, name, iter(self.cross_pairs(name, self.spec.num_layers)))
            self.models[session].cross.add((branch, name))
        else:
            count = data.draw(st.sampled_from([0, self.spec.num_layers - 1, self.spec.num_layers + 1]))
            with pytest.raises(ValueError):
                state.populate_cross_attention(branch, name, iter(self.cross_pairs(name, count)))
            assert state.cross_attention_bytes == bytes_before

    @precondition(lambda self: self.states)
    @rule(data=st.data())
    def close(self, data):
        session = data.draw(st.sampled_from(sorted(self.states)))
        state = self.states.pop(session)
        self.models.pop(session)
        state.close()
        assert state.closed
        with pytest.raises(RuntimeError, match="closed"):
            state.adapter(self.branch_names[0])

    # --------------------------------------------------------------- invariants
    @invariant()
    def pages_owned_once_and_accounted(self):
        allocator = self.cache.allocator
        resident: list[int] = []
        for session, state in self.states.items():
            model = self.models[session]
            for name in self.branch_names:
                adapter = state.adapter(name)
                bm = model.branches[name]
                assert adapter.num_committed_frames == bm.committed
                assert len(adapter.page_ids) == self.resident_frames(bm.committed) * self.ppf
                resident.extend(adapter.page_ids)
                for cross in CROSS_NAMES:
                    assert state.has_cross_attention(name, cross) == ((name, cross) in model.cross)
            assert state.num_pages == self.model_pages(model)
            heads_tokens = {n: self.spec.cross_geometry(n) for n in CROSS_NAMES}
            expected_cross = sum(
                2 * self.spec.num_layers * h * t * d * 4 for (_, n) in model.cross for h, t, d in [heads_tokens[n]]
            )
            assert state.cross_attention_bytes == expected_cross
        assert len(resident) == len(set(resident)), "a page is resident in two places"
        assert all(allocator.is_owned(page) for page in resident)
        assert allocator.num_used == sum(state.num_pages for state in self.states.values())
        assert self.cache.num_free_pages == self.model_free()

    def teardown(self):
        for state in self.states.values():
            state.close()
        assert self.cache.num_free_pages == self.initial_free
        assert self.cache.allocator.num_used == 0


class SharedSlotMachine(KVLifecycleMachine):
    """CFG branches sharing one storage slot, plus a third branch on its own slot, half-frame pages."""

    BRANCHES = (
        ARDiffusionKVBranchSpec("positive", 0),
        ARDiffusionKVBranchSpec("negative", 0),
        ARDiffusionKVBranchSpec("aux", 1),
    )
    PAGE_SIZE = 1


PROPERTY_SETTINGS = settings(max_examples=80, stateful_step_count=40, deadline=None)

TestKVLifecycle = KVLifecycleMachine.TestCase
TestKVLifecycle.settings = PROPERTY_SETTINGS
TestSharedSlotLifecycle = SharedSlotMachine.TestCase
TestSharedSlotLifecycle.settings = PROPERTY_SETTINGS
