"""Session churn through ARDiffusionEngine with the real DreamZero pipeline, against a reference LRU model.

``test_soak.py`` runs 10,000 Zipf requests through the runner with a tiny test pipeline, and
``test_runner.py::LRUReferenceMachine`` checks LRU decisions there. This machine adds what they cannot:
the real pipeline's own per-session state (anchor latents, text and image caches on two CFG branches,
window resets) under random requests, resets, closes and injected forward failures. After every step:
the LRU table matches the model, the pipeline keeps state for resident sessions only, no page is held
twice or leaked, every resident session holds complete caches. A rule replays a resident session's
history on a separate engine: its last output must be bit-identical (no session ever sees another's KV).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from faulty_pipelines import InjectedFault, block_fault, last_block_kv_fault
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ardiff_cli.runtime.engine import ARDiffusionEngine
from ardiff_cli.runtime.request import ARDiffusionRequest

pytestmark = pytest.mark.usefixtures("single_thread", "ardiff_cache")

CAPACITY = 3
SESSIONS = "aaaabbbccd"  # Zipf-like: a few hot sessions, a cold one that forces evictions
CONFIG = {
    "pipeline": "dreamzero",
    # A 3-frame window so that window resets (text kept, image re-projected) happen within a few requests.
    "model": {"preset": "tiny", "num_inference_steps": 1, "guidance_scale": 2.0, "window_frames": 3},
    "runtime": {"device": "cpu", "session_capacity": CAPACITY, "memory_budget": "256MiB"},
}


def make_engine(capacity: int = CAPACITY) -> ARDiffusionEngine:
    engine = ARDiffusionEngine.from_config({**CONFIG, "runtime": {**CONFIG["runtime"], "session_capacity": capacity}})
    engine.load()
    return engine


class EngineChurn(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = make_engine()
        self.runner, self.pipe = self.engine.runner, self.engine.pipeline
        self.total = self.runner.pool_usage().num_pages
        self.pool_bytes = self.runner.kv_cache.pool.nbytes
        self.plan = self.runner.capacity_plan
        self.replayer: ARDiffusionEngine | None = None  # built on first use
        # session -> (inputs, output) of its requests since admission, least recently used first
        self.model: OrderedDict[str, list[tuple[dict, dict]]] = OrderedDict()
        self.count = 0

    def _inputs(self, session: str, four: bool) -> dict:
        self.count += 1
        return self.pipe.example_inputs(4 if four else 1, prompt=f"task {session}", seed=self.count)

    def _admit(self, session: str) -> None:
        if session in self.model:
            self.model.move_to_end(session)
            return
        if len(self.model) >= CAPACITY:
            self.model.popitem(last=False)  # the least recently used session is evicted
        self.model[session] = []

    @rule(session=st.sampled_from(SESSIONS), four=st.booleans(), kind=st.integers(0, 11),
          layer=st.integers(0, 1), call=st.integers(1, 4))
    def request(self, session, four, kind, layer, call):
        """Mostly plain requests; kind 0 resets the session first, 1 closes it after, 2 fails in a block."""
        reset, close, fail = kind == 0, kind == 1, kind == 2
        inputs = self._inputs(session, four)
        request = ARDiffusionRequest(f"r{self.count}", inputs, {"session_id": session, "reset": reset,
                                                                 "close_session": close})
        if fail:
            # block 0 runs in all four passes of a request; the last block's forward in the two sampling passes,
            # and in the two commit passes only its K/V projection
            fault = (block_fault(self.pipe, layer, call=call) if layer == 0 or call <= 2
                     else last_block_kv_fault(self.pipe, call=call - 2))
            with fault, pytest.raises(InjectedFault):
                self.engine.execute(request)
            self._admit(session)  # admitted (possibly evicting the LRU one), then released by the failure
            del self.model[session]
            return
        out = self.engine.execute(request)
        if reset:
            self.model.pop(session, None)
        self._admit(session)
        self.model[session].append((inputs, out))
        if close:
            del self.model[session]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), how=st.sampled_from(["close", "reset", None, None, None]))
    def release(self, data, how):
        if how is None:
            return
        session = data.draw(st.sampled_from(sorted(self.model)))
        (self.runner.close_session if how == "close" else self.runner.reset_session)(session)
        del self.model[session]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def replay_alone(self, data):
        """A resident session's history, replayed on its own engine, gives bit-identical outputs."""
        session = data.draw(st.sampled_from(sorted(self.model)))
        history = self.model[session]
        if not history:
            return
        if self.replayer is None:
            self.replayer = make_engine(capacity=1)
        for i, (inputs, _) in enumerate(history):
            out = self.replayer.execute(ARDiffusionRequest(f"replay{i}", inputs,
                                                           {"session_id": session, "reset": i == 0}))
        for key, value in history[-1][1].items():
            torch.testing.assert_close(out[key], value, rtol=0, atol=0)

    @invariant()
    def matches_the_model(self):
        resident = list(self.model)
        assert self.runner.session_ids == resident, "LRU table diverged from the reference model"
        assert set(self.pipe.sessions) == set(resident), "pipeline state for a session that is not resident"
        views = self.runner.sessions()
        assert [v.num_requests for v in views] == [len(h) for h in self.model.values()]
        pages = [p for sid in resident for b in self.runner.spec.branch_names
                 for p in self.runner._sessions[sid].state._adapter(b).page_ids]
        assert len(pages) == len(set(pages)) == self.runner.pool_usage().num_used, "page held twice or leaked"
        full_cross = self.plan.cross_attention_bytes_per_session
        assert all(v.cross_attention_bytes == full_cross for v in views)
        assert self.runner.kv_cache.pool.nbytes == self.pool_bytes  # nothing grows

    def teardown(self):
        self.engine.close()
        assert self.runner.pool_usage().num_free == self.total and self.pipe.sessions == {}
        if self.replayer is not None:
            self.replayer.close()


TestEngineChurn = EngineChurn.TestCase
TestEngineChurn.settings = settings(max_examples=15, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
