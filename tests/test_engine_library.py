"""ardiff as a library inside a long-running process (a robot lab's policy server), through ARDiffusionEngine with the
real causal_world pipeline: what a server author hits over many requests, sessions, subscribers and engines."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import re
import sys
import threading
import types
import warnings
import weakref

import numpy as np
import pytest
import torch

from ardiff_cli.io import read_step, write_step
from ardiff_cli.runtime.config import load_config
from ardiff_cli.runtime.engine import ARDiffusionEngine
from ardiff_cli.runtime.errors import (
    PIPELINE_HINT,
    ArdiffError,
    ArdiffWarning,
    CapacityError,
    CheckpointError,
    ConfigError,
    EngineStateError,
    ObservationError,
    PipelineError,
    RequestError,
    RequestTypeError,
    SessionNotResident,
    StopRequested,
)
from ardiff_cli.runtime.request import ARDiffusionRequest
from ardiff_cli.runtime.runner import MAX_HOOK_ERRORS
from pipelines.causal_world.pipeline import CausalWorldPipeline
from pipeline_helpers import CONFIGS

pytestmark = pytest.mark.usefixtures("single_thread", "ardiff_cache")


def server_engine(capacity: int = 2) -> ARDiffusionEngine:
    engine = ARDiffusionEngine.from_config(CONFIGS / "causal-world-tiny.yaml", device="cpu", memory_budget="64MiB",
                                           session_capacity=capacity)
    return engine


def request(engine: ARDiffusionEngine, request_id: str, session_id: str, seed: int = 0, **flags) -> ARDiffusionRequest:
    inputs = engine.pipeline.example_inputs(seed=seed)
    return ARDiffusionRequest(request_id, inputs, {"session_id": session_id, **flags})


@pytest.mark.parametrize("kind", ["capacity_planned", "session_admitted", "session_evicted", "request_finished",
                                  "session_closed"])
def test_a_subscriber_that_raises_is_a_warning_and_never_fails_or_changes_a_request(kind):
    """A metrics callback that fails (its backend is down) used to fail every request it saw an event of: the caller
    lost the output of a forward whose block was committed anyway, so a retry ran one block further on."""
    reference = server_engine()
    reference.load()
    expected = [reference.execute(request(reference, f"r{i}", sid, seed=i, close_session=i == 3))["latents"]
                for i, sid in enumerate("abca")]

    engine = server_engine()

    def metrics(event):
        if event.kind == kind:
            raise ConnectionError("metrics backend unreachable")

    engine.subscribe(metrics)
    seen = []
    engine.subscribe(seen.append)  # later subscribers still get every event
    with pytest.warns(ArdiffWarning, match=rf"event subscriber .*metrics raised ConnectionError: metrics backend "
                                           rf"unreachable \(on a {kind} event\)"):
        engine.load()
        got = [engine.execute(request(engine, f"r{i}", sid, seed=i, close_session=i == 3))["latents"]
               for i, sid in enumerate("abca")]
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert any(e.kind == kind for e in seen)
    runner = engine.runner
    assert runner.session_ids == ["c"] == sorted(engine.pipeline.sessions)
    assert runner.kv_cache.allocator.num_used == sum(s.state.num_pages for s in runner._sessions.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ArdiffWarning)
        engine.close()
    assert runner.session_ids == [] and runner.kv_cache.allocator.num_used == 0


def test_a_subscriber_failing_on_every_request_is_reported_every_time_and_nothing_accumulates():
    """Each failure is shown (the default filter would show one line per distinct message), and no registry of
    messages grows with the requests served."""
    import ardiff_cli.runtime.runner as runner_module

    engine = server_engine()

    def post(event):
        if event.kind == "request_finished":
            raise ConnectionError(f"cannot post {event.request_id}")

    engine.subscribe(post)
    engine.load()
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        for i in range(20):
            engine.execute(request(engine, f"r{i}", "a", seed=i))
    assert len(shown) == 20
    assert all(f"ConnectionError: cannot post r{i} (on a request_finished event)" in str(w.message)
               for i, w in enumerate(shown))
    assert shown[0].filename == __file__  # where the subscriber is
    assert len(getattr(runner_module, "__warningregistry__", {})) <= 1  # only its version key
    engine.close()


def test_a_subscription_per_request_is_undone_by_the_function_subscribe_returns():
    """A server collecting one request's events subscribes around it; engine.subscribe used to return None, so every
    callback stayed subscribed for the engine's life (and ran on every later event): a leak per request served."""
    engine = server_engine()
    early = []
    unsubscribe_early = engine.subscribe(early.append)  # before load: attached to the runner at load
    engine.load()
    runner = engine.runner
    baseline = len(runner._subscribers)
    for i in range(50):
        finished = []
        unsubscribe = engine.subscribe(lambda e, got=finished: got.append(e) if e.kind == "request_finished" else None)
        engine.execute(request(engine, f"r{i}", "a", seed=i))
        unsubscribe()
        unsubscribe()  # twice is harmless
        assert [e.request_id for e in finished] == [f"r{i}"]
    assert len(runner._subscribers) == baseline and len(engine._subscribers) == 1
    unsubscribe_early()
    seen = len(early)
    engine.execute(request(engine, "after", "a"))
    assert len(early) == seen and runner._subscribers == [] and engine._subscribers == []
    runner.subscribe(early.append)()  # the runner's own unsubscribe function
    assert runner._subscribers == []
    engine.close()


class TelemetryOnClose(CausalWorldPipeline):
    """A lab's pipeline whose close hook reports the session's statistics to a telemetry service that is down."""

    def close_ar_diffusion_session(self, session_id: str) -> None:
        super().close_ar_diffusion_session(session_id)
        statistics = torch.zeros(64, 1024)  # what it meant to upload (256 KiB), a local of the failing frame
        raise ConnectionError(f"telemetry unreachable ({statistics.numel()} values of {session_id!r} not sent)")


def test_failing_close_hooks_over_a_long_run_keep_only_the_latest_errors():
    """runner.hook_errors kept every hook error of the runner's life, each holding its traceback and so the hook's
    locals: a close hook that fails on every eviction grew the process by what it held, without bound."""
    config = load_config(CONFIGS / "causal-world-tiny.yaml", pipeline="test_engine_library:TelemetryOnClose")
    engine = ARDiffusionEngine.from_config(config, device="cpu", memory_budget="64MiB", session_capacity=2)
    engine.load()
    for i in range(MAX_HOOK_ERRORS + 40):  # every request admits a new session: one eviction each
        engine.execute(request(engine, f"r{i}", f"robot-{i}"))
    runner = engine.runner
    assert len(runner.hook_errors) == MAX_HOOK_ERRORS
    assert f"'robot-{i - 2}'" in str(runner.hook_errors[-1])  # the newest kept
    gc.collect()
    statistics = [o for o in gc.get_objects() if type(o) is torch.Tensor and o.shape == (64, 1024)]
    assert len(statistics) <= MAX_HOOK_ERRORS


@pytest.mark.parametrize(("inputs", "extra_args", "message"), [
    (None, {"session_id": "a"}, r"request 'bad': inputs must be a mapping \(dict\) of the pipeline's inputs, got None"),
    ([1, 2], {"session_id": "a"}, r"request 'bad': inputs must be a mapping \(dict\) .*got \[1, 2\]"),
    ("ok", None, r"request 'bad': extra_args must be a mapping \(dict\) .*got None"),
    ("ok", {"session_id": 7}, r"request 'bad': extra_args\['session_id'\] must be a non-empty string, got 7"),
    ("ok", {"session_id": "a", "reset": "false"}, r"request 'bad': extra_args\['reset'\] must be True or False, "
                                                  r"got 'false' \(str\)"),
    ("ok", {"session_id": "a", "close_session": "yes"}, r"extra_args\['close_session'\] must be True or False"),
    # a JSON null: taken for False, where a session_id of None was refused
    ("ok", {"session_id": "a", "close_session": None}, r"extra_args\['close_session'\] must be True or False, got "
                                                       r"None \(NoneType\)"),
    ("ok", {"session_id": "a", "reset": None}, r"extra_args\['reset'\] must be True or False, got None"),
])
def test_a_malformed_request_is_a_request_error_and_leaves_its_session_as_it_was(inputs, extra_args, message):
    """A request a JSON client sent with "reset": "false" used to reset the robot's session (a non-empty string is
    true); inputs or extra_args that were not dicts failed inside the forward with a bare AttributeError, which
    also released the session as a failed forward."""
    reference = server_engine()
    reference.load()
    engine = server_engine()
    engine.load()
    for e in (reference, engine):
        e.execute(request(e, "r0", "a", seed=0))
    before = engine.runner.sessions()
    bad = ARDiffusionRequest("bad", engine.pipeline.example_inputs(seed=1) if inputs == "ok" else inputs, extra_args)
    with pytest.raises(RequestError, match=message) as info:
        engine.execute(bad)
    assert isinstance(info.value, ValueError) and info.value.hint
    assert engine.runner.sessions() == before
    expected = reference.execute(request(reference, "r1", "a", seed=1))["latents"]
    assert torch.equal(engine.execute(request(engine, "r1", "a", seed=1))["latents"], expected)


def test_numpy_booleans_are_flags():
    """numpy 2 names its bool type 'bool', not 'bool_': np.True_ read from an array was refused as "must be True or
    False, got np.True_ (bool)"."""
    for value in (np.True_, np.False_, np.array([1, 0], dtype=bool)[0]):
        flags = ARDiffusionRequest("r", {}, {"session_id": "a", "reset": value, "close_session": value})
        assert flags.reset is flags.close_session is bool(value)
    with pytest.raises(RequestError, match=r"extra_args\['reset'\] must be True or False, got np.int64\(1\)"):
        ARDiffusionRequest("r", {}, {"reset": np.int64(1)}).reset


@pytest.mark.parametrize(("value", "hint"), [
    ("false", "a JSON client sends true or false, not a string"),
    (None, "leave the key out for False: None (a JSON null) is refused, not taken for False"),
    (1, "pass True or False"),
    (torch.tensor(1), "pass True or False"),
])
def test_a_flag_that_is_no_bool_has_a_hint_for_what_it_is(value, hint):
    """Every refused flag had the hint for a string ("a JSON client sends true or false, not a string"), a JSON null
    and an int included, where the README tells the caller of a null to leave the key out."""
    for key in ("reset", "close_session"):
        with pytest.raises(RequestError) as info:
            getattr(ARDiffusionRequest("r", {}, {key: value}), key)
        assert info.value.hint == hint


def test_a_0d_bool_tensor_or_array_is_the_flag_it_holds_as_a_config_field_takes_it():
    """A flag read back from a tensor (``done = (t == T - 1)``, ``mask[i]``) was refused ("must be True or False, got
    tensor(True) (Tensor)") where a config's bool field takes it (``as_scalar``): a 0-d bool tensor or numpy array
    is the bool it holds. What holds an int, or more than one value, is refused as a plain int is."""
    engine = server_engine()
    engine.load()
    events = []
    engine.subscribe(events.append)
    engine.execute(request(engine, "r0", "a"))
    engine.execute(request(engine, "r1", "a", reset=torch.tensor(True), close_session=np.array(False)))
    assert [(e.session_id, e.reason) for e in events if e.kind == "session_reset"] == [("a", "request_reset")]
    assert engine.runner.session_ids == ["a"] and engine.runner.sessions()[0].num_requests == 1  # replaced
    engine.execute(request(engine, "r2", "a", reset=torch.tensor(False), close_session=torch.tensor(True)))
    assert [e.kind for e in events if e.kind in ("session_reset", "session_closed")] == ["session_reset",
                                                                                          "session_closed"]
    assert [e.reason for e in events if e.kind == "session_closed"] == ["close_session"]
    assert engine.runner.session_ids == []
    engine.execute(request(engine, "r3", "a"))
    before = engine.runner.sessions()
    for bad, got in ((torch.tensor(1), r"tensor\(1\) \(Tensor\)"), (np.array(0), r"array\(0\) \(ndarray\)"),
                     (torch.tensor([True]), r"tensor\(\[True\]\)"), (np.array([True]), r"array\(\[ True\]\)")):
        for key in ("reset", "close_session"):
            with pytest.raises(RequestError, match=rf"extra_args\['{key}'\] must be True or False, got {got}"):
                engine.execute(request(engine, "bad", "a", **{key: bad}))
    assert engine.runner.sessions() == before


def test_something_other_than_a_request_is_a_type_error_whose_hint_builds_the_request():
    """engine.execute({...}) was a bare TypeError ('execute_model takes an ARDiffusionRequest, got dict'): right, but
    no word of how to build one from the dict in hand, nor of the method the caller had called."""
    engine = server_engine()
    engine.load()
    engine.execute(request(engine, "r0", "a"))
    before = engine.runner.sessions()
    inputs = engine.pipeline.example_inputs(seed=1)
    fields = {"request_id": "r1", "inputs": inputs, "extra_args": {"session_id": "a"}}
    cases = [
        (engine.execute, fields, r"^ARDiffusionEngine.execute\(\) takes an ARDiffusionRequest, got a dict with keys "
                                 r"\['request_id', 'inputs', 'extra_args'\]$", r"ARDiffusionRequest\(\*\*that_dict\)"),
        (engine.runner.execute_model, inputs, r"^ARDiffusionModelRunner.execute_model\(\) takes an ARDiffusionRequest, "
                                              r"got a dict with keys \['prompt'", r"inputs=that_dict, extra_args="),
        (engine.execute, None, r"got None \(NoneType\)$", r"build one: ARDiffusionRequest\('r0', inputs="),
        (engine.execute, [request(engine, "r1", "a")] * 2, r"got a list of 2 ARDiffusionRequest$",
         "one call per request"),
    ]
    for call, value, message, hint in cases:
        with pytest.raises(RequestTypeError, match=message) as info:
            call(value)
        assert isinstance(info.value, TypeError) and isinstance(info.value, RequestError)
        assert re.search(hint, info.value.hint)
    assert engine.runner.sessions() == before
    engine.execute(ARDiffusionRequest(**fields))  # what the first hint says works
    assert engine.runner.sessions()[0].num_requests == 2
    engine.close()


def test_a_request_whose_id_is_not_a_string_is_refused_before_any_session_is_touched():
    """ARDiffusionRequest(inputs, {'session_id': 'a'}) (the id left out) took the inputs for the id and the extra_args
    for the inputs: the forward refused them as an observation with an unknown key 'session_id', and released the
    default session, which another robot's misspelt key may share."""
    engine = server_engine()
    engine.load()
    inputs = engine.pipeline.example_inputs(seed=0)
    engine.execute(ARDiffusionRequest("r0", inputs))  # the default session
    before = engine.runner.sessions()
    with pytest.raises(RequestError, match=r"^request_id must be a string, got a mapping: was the request id left "
                                           r"out\?$") as info:
        engine.execute(ARDiffusionRequest(inputs, {"session_id": "a"}))
    assert "ARDiffusionRequest(request_id, inputs, extra_args)" in info.value.hint
    with pytest.raises(RequestError, match=r"^request_id must be a string, got 7 \(int\)$") as info:
        engine.execute(ARDiffusionRequest(7, inputs, {"session_id": "a"}))
    assert "str()" in info.value.hint
    assert engine.runner.sessions() == before
    engine.close()


def test_a_session_id_given_to_the_request_as_a_keyword_or_an_attribute_is_refused_saying_it_goes_in_extra_args():
    """ARDiffusionRequest('r0', inputs, session_id='a') was Python's bare TypeError ('unexpected keyword argument
    session_id') and request.session_id = 'a' an AttributeError ('has no setter'): neither said that a request names
    its session in extra_args."""
    engine = server_engine()
    engine.load()
    inputs = engine.pipeline.example_inputs(seed=0)
    cases = [
        (dict(session_id="a"), r"argument 'session_id': a request's fields are request_id, inputs, extra_args, and "
                               r"'session_id' goes in extra_args$", "extra_args={'session_id': 'a'}"),
        (dict(sessionId="a", reset=True),
         r"arguments 'sessionId', 'reset': .* and 'session_id' and 'reset' go in extra_args$",
         "extra_args={'session_id': 'a', 'reset': True}"),
        (dict(observation={}), r"argument 'observation': a request's fields are request_id, inputs, extra_args$",
         "goes in inputs"),
        (dict(input={}), r"argument 'input' \(did you mean 'inputs'\?\)", "goes in inputs"),
    ]
    for kwargs, message, hint in cases:
        with pytest.raises(RequestTypeError, match=r"^ARDiffusionRequest\(\) got an unexpected keyword " + message) \
                as info:
            ARDiffusionRequest("r0", inputs, **kwargs)
        assert isinstance(info.value, TypeError) and hint in info.value.hint
    with pytest.raises(RequestTypeError, match=r"^ARDiffusionRequest\(\) takes at most 3 arguments \(request_id, "
                                               r"inputs, extra_args\), got 4 positional$"):
        ARDiffusionRequest("r0", inputs, {}, "a")
    built = ARDiffusionRequest("r0", inputs)
    for name, value in (("session_id", "a"), ("reset", True), ("close_session", True)):
        with pytest.raises(RequestError, match=rf"^ARDiffusionRequest.{name} is read from extra_args\['{name}'\] "
                                               r"and cannot be set$") as info:
            setattr(built, name, value)
        assert isinstance(info.value, AttributeError) and f"request.extra_args[{name!r}] = {value!r}" in info.value.hint
    with pytest.raises(RequestError, match=r"extra_args must be a mapping \(dict\) .*got 'a'") as info:
        engine.execute(ARDiffusionRequest("r0", inputs, "a"))  # the session id in extra_args' place
    assert info.value.hint == "a session id goes in extra_args as its 'session_id': extra_args={'session_id': 'a'}"
    assert engine.runner.session_ids == []
    built.extra_args["session_id"] = "a"  # as the hints say
    engine.execute(built)
    engine.execute(ARDiffusionRequest("r1", inputs, extra_args={"session_id": "a"}))
    assert [(view.session_id, view.num_requests) for view in engine.runner.sessions()] == [("a", 2)]
    assert str(inspect.signature(ARDiffusionRequest)).startswith("(request_id: 'str', inputs: ")  # help() and IDEs

    @dataclasses.dataclass
    class TracedRequest(ARDiffusionRequest):  # a pipeline's own request type, with a field of its own
        trace_id: str = ""

    # it was refused as it was built: "ARDiffusionRequest() got an unexpected keyword argument 'trace_id'"
    traced = TracedRequest("r2", inputs, {"session_id": "a"}, trace_id="t-1")
    engine.execute(traced)
    engine.execute(TracedRequest("r3", inputs, {"session_id": "a"}, "t-2"))
    assert traced.trace_id == "t-1" and engine.runner.sessions()[0].num_requests == 4
    engine.close()


def test_a_subscriber_that_is_not_callable_is_refused_when_subscribed():
    """engine.subscribe(on_event()) (the callback called, its None passed) was taken; every later event of the
    engine's life was then a warning that 'NoneType' object is not callable, far from the line at fault."""
    engine = server_engine()
    for subscribe in (engine.subscribe, lambda c: (engine.load(), engine.runner.subscribe(c))):
        with pytest.raises(RequestTypeError, match=r"subscribe\(\) takes a callable, called with each RuntimeEvent, "
                                                   r"got None \(NoneType\)") as info:
            subscribe(None)
        assert isinstance(info.value, TypeError) and "subscribe(on_event)" in info.value.hint
    with warnings.catch_warnings():
        warnings.simplefilter("error", ArdiffWarning)
        engine.execute(request(engine, "r0", "a"))  # no subscriber left behind to fail on its events
    engine.close()


def test_a_refused_request_says_which_request_and_session_it_was_for():
    """A robot's malformed observation mid-episode was 'ObservationError: request inputs: missing prompt ...': a
    server logging it could not tell which robot it came from, nor whether the robot's session was kept."""
    engine = server_engine(capacity=3)
    engine.load()
    for i, sid in enumerate(["arm_a", "arm_b"]):
        engine.execute(request(engine, f"r{i}", sid))
    inputs = engine.pipeline.example_inputs(seed=1)
    del inputs["prompt"]
    with pytest.raises(ObservationError, match=r"^request inputs: .*missing prompt") as info:
        engine.execute(ARDiffusionRequest("arm_b/000001", inputs, {"session_id": "arm_b"}))
    assert info.value.__notes__ == ["request 'arm_b/000001' was refused before session 'arm_b' was touched: the "
                                    "session is as it was"]
    assert engine.runner.session_ids == ["arm_a", "arm_b"]
    engine.close()


def test_a_misspelt_runner_key_is_a_warning_once_and_the_request_runs_as_it_did():
    """extra_args={'sesion_id': 'arm_a'} sent every robot whose client misspelt it to the shared default session,
    without a word: the runner cannot refuse keys it does not read (they are the pipeline's)."""
    engine = server_engine()
    engine.load()
    inputs = engine.pipeline.example_inputs(seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.execute(ARDiffusionRequest("r0", inputs, {"sesion_id": "arm_a", "closeSession": True, "seed": 3}))
        engine.execute(ARDiffusionRequest("r1", inputs, {"sesion_id": "arm_b"}))  # the same key: not again
        engine.execute(ARDiffusionRequest("r2", inputs, {"session_id": "arm_c", "Reset": False}))
    assert [str(w.message) for w in caught if issubclass(w.category, ArdiffWarning)] == [
        "request 'r0': extra_args key 'sesion_id' is not one the runner reads (session_id, reset, close_session): "
        "it goes to the pipeline as is, and the request to session 'default'; did you mean 'session_id'?",
        "request 'r0': extra_args key 'closeSession' is not one the runner reads (session_id, reset, close_session): "
        "it goes to the pipeline as is; did you mean 'close_session'?",
        "request 'r2': extra_args key 'Reset' is not one the runner reads (session_id, reset, close_session): "
        "it goes to the pipeline as is; did you mean 'reset'?"]
    assert sorted(view.session_id for view in engine.runner.sessions()) == ["arm_c", "default"]  # routed as before


def test_a_misspelt_runner_key_is_warned_of_at_the_callers_line():
    """The warning pointed at ardiff's own runner.py (`return method(self, *args, **kwargs)`), so a server's log
    did not say which of its calls sent the key, and `warnings.filterwarnings(module=...)` could not single it out."""
    engine = server_engine()
    engine.load()
    inputs = engine.pipeline.example_inputs(seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.execute(ARDiffusionRequest("r0", inputs, {"sesion_id": "arm_a"}))
        engine.runner.execute_model(ARDiffusionRequest("r1", inputs, {"sessionId": "arm_b"}))
    said = [w for w in caught if issubclass(w.category, ArdiffWarning)]
    assert [(w.filename, "extra_args key" in str(w.message)) for w in said] == [(__file__, True)] * 2
    engine.close()


def test_closing_or_resetting_a_session_that_is_not_resident_is_a_typed_key_error_with_a_readable_message():
    """A server closes a robot's session when it disconnects, and LRU may have evicted it already: that was a bare
    KeyError whose message printed in quotes, listing every resident session id whatever their number and length."""
    engine = server_engine(capacity=3)
    engine.load()
    for i, sid in enumerate(["a", "x" * 5000, "c"]):
        engine.execute(request(engine, f"r{i}", sid))
    engine.execute(request(engine, "r3", "d"))  # evicts "a"
    for call in (engine.runner.close_session, engine.runner.reset_session):
        with pytest.raises(SessionNotResident) as info:
            call("a")
        assert isinstance(info.value, KeyError) and isinstance(info.value, ArdiffError)
        text = str(info.value)
        assert text.startswith("no resident session 'a' (never admitted, or evicted, closed or released since)")
        assert len(text) < 400 and info.value.hint
    assert engine.runner.session_ids[1:] == ["c", "d"]


def test_close_gives_the_memory_back_at_once_and_a_closed_engine_refuses_requests_until_loaded_again():
    """engine.close() released the sessions only: the KV pools and the weights stayed until the last reference to
    the engine went (a server's dict of engines, a stored exception's traceback), so a model swap planned the next
    engine with that memory still taken; and a closed engine went on serving requests as if nothing had happened."""
    engine = server_engine(capacity=64)
    with pytest.raises(EngineStateError, match=r"ARDiffusionEngine.load\(\) must run first"):
        engine.execute(ARDiffusionRequest("r", {}, {"session_id": "a"}))
    engine.load()
    with pytest.raises(EngineStateError, match="already loaded"):
        engine.load()
    expected = engine.execute(request(engine, "r0", "a"))["latents"]
    engine.execute(request(engine, "r1", "b"))
    runner, pipeline = engine.runner, engine.pipeline
    pool, weight = weakref.ref(runner.kv_cache.pool.kv), weakref.ref(next(pipeline.transformer.parameters()))
    servers = {"lab": engine}  # still referenced, as a server's registry would
    del pipeline
    engine.close()
    engine.close()  # twice: nothing more to do
    gc.collect()
    assert pool() is None and weight() is None
    assert runner.sessions() == [] and runner.pool_usage().num_used == 0
    closed_request = ARDiffusionRequest("r2", {"prompt": "x"}, {"session_id": "a"})
    for call in (lambda: engine.execute(closed_request), engine.warmup, lambda: runner.close_session("a")):
        with pytest.raises(EngineStateError, match="closed") as info:
            call()
        assert isinstance(info.value, ArdiffError) and isinstance(info.value, RuntimeError) and info.value.hint
    servers["lab"].load()  # loading again after close gives a fresh engine
    assert torch.equal(engine.execute(request(engine, "r0", "a"))["latents"], expected)
    engine.close()


def test_close_frees_the_weights_before_the_runner_empties_torchs_cuda_cache():
    """The runner empties torch's CUDA cache as its close() ends, but the engine dropped its own reference to the
    pipeline only after that: on a GPU the weights went back to torch's cache, not to the device, and the next engine
    (another model, another process) planned its KV without that memory. Here the pipeline must be gone while the
    runner is still closing, which is when it empties the cache."""
    engine = server_engine()
    engine.load()
    engine.execute(request(engine, "r0", "a"))
    runner, died = engine.runner, []
    weakref.finalize(engine.pipeline, lambda: died.append("closed" if runner.closed else "closing"))
    engine.close()
    assert died == ["closing"]


class RecordsItsWeights(CausalWorldPipeline):
    """The causal_world pipeline, keeping a weak reference to the weights of each one built."""

    built: list[weakref.ref] = []

    @classmethod
    def from_config(cls, *args, **kwargs):
        pipeline = super().from_config(*args, **kwargs)
        cls.built.append(weakref.ref(next(pipeline.transformer.parameters())))
        return pipeline


class SpecRaises(CausalWorldPipeline):
    def ar_diffusion_kv_cache_spec(self):
        raise ValueError("no spec for this geometry")


def test_the_pipelines_own_code_failing_at_load_is_a_pipeline_error_naming_it():
    """ar_diffusion_kv_cache_spec() raising, and an entry module's pipeline_class() failing to import the model code
    (a dependency it lacks), were "unexpected ... a bug in ardiff"."""
    config = load_config(CONFIGS / "causal-world-tiny.yaml", pipeline="test_engine_library:SpecRaises")
    engine = ARDiffusionEngine.from_config(config, device="cpu", memory_budget="64MiB")
    with pytest.raises(PipelineError, match=r"^SpecRaises\.ar_diffusion_kv_cache_spec\(\) failed: ValueError: no "
                                            r"spec for this geometry$") as info:
        engine.load()
    assert info.value.hint == PIPELINE_HINT and not engine.loaded

    def pipeline_class():
        import a_model_dependency_not_installed  # noqa: F401

    config = load_config(CONFIGS / "causal-world-tiny.yaml")
    entry = dataclasses.replace(config.entry, module=types.SimpleNamespace(
        Config=config.entry.module.Config, observation_schema=config.entry.module.observation_schema,
        pipeline_class=pipeline_class))
    engine = ARDiffusionEngine(dataclasses.replace(config, entry=entry).with_runtime(where="test", device="cpu"))
    with pytest.raises(PipelineError, match=r"^pipeline 'causal_world': pipeline_class\(\) failed: "
                                            r"ModuleNotFoundError: No module named 'a_model_dependency_not_installed'"):
        engine.load()
    assert not engine.loaded


class SpecWiderThanItsConfig(CausalWorldPipeline):
    def ar_diffusion_kv_cache_spec(self):
        return dataclasses.replace(super().ar_diffusion_kv_cache_spec(), window_frames=60)


def test_a_pipeline_spec_other_than_its_configs_is_refused_at_load():
    """inspect-capacity plans from Config.kv_cache_spec() alone: it planned a few pages where load allocated the
    pools of a 60-frame window, and nothing said so."""
    config = load_config(CONFIGS / "causal-world-tiny.yaml", pipeline="test_engine_library:SpecWiderThanItsConfig")
    engine = ARDiffusionEngine.from_config(config, device="cpu", memory_budget="64MiB")
    with pytest.raises(PipelineError, match=r"^SpecWiderThanItsConfig\.ar_diffusion_kv_cache_spec\(\) differs from "
                                            r"its .*Config\.kv_cache_spec\(\): window_frames 60 \(the config's 6\)$"):
        engine.load()
    assert not engine.loaded


def test_a_load_that_fails_keeps_nothing_loaded_and_may_be_tried_again():
    """A load() refused for memory (CapacityError) kept the pipeline's weights on the engine: a server that retries
    load() until the GPU frees up planned each try with one more copy of the model resident, so it never fitted."""
    config = load_config(CONFIGS / "causal-world-tiny.yaml", pipeline="test_engine_library:RecordsItsWeights")
    engine = ARDiffusionEngine.from_config(config, device="cpu", memory_budget="1KiB")
    RecordsItsWeights.built.clear()
    for attempt in range(2):
        with pytest.raises(CapacityError, match=r"one session needs .* but only 1.00 KiB"):
            engine.load()
        gc.collect()
        assert len(RecordsItsWeights.built) == attempt + 1 and RecordsItsWeights.built[-1]() is None
        assert not engine.loaded
        with pytest.raises(EngineStateError, match=r"load\(\) must run first"):
            engine.execute(ARDiffusionRequest("r", {}, {"session_id": "a"}))
    engine.close()  # nothing to close


def test_a_budget_beyond_the_device_tells_a_library_user_what_to_change_in_their_own_terms():
    """The runtime used without the CLI: a memory budget whose plan needs more than the host has said "lower
    --memory-budget (runtime.memory_budget) or --session-capacity, ...; `ardiff inspect-capacity` plans for any
    amount", the CLI's options and command, to a caller of the engine or the runner who passed neither."""
    from ardiff_cli.runtime.errors import BudgetBeyondDeviceError
    from ardiff_cli.runtime.runner import ARDiffusionModelRunner

    beyond = dict(memory_budget="1PiB", session_capacity=2**31 - 1)
    engine = ARDiffusionEngine.from_config(CONFIGS / "causal-world-tiny.yaml", device="cpu", **beyond)
    with pytest.raises(BudgetBeyondDeviceError, match=r"more than this host's .* of memory$") as info:
        engine.load()
    assert info.value.hint == (
        "lower the config's runtime.memory_budget or runtime.session_capacity (or ARDiffusionEngine.from_config()'s "
        "memory_budget= or session_capacity=), or set memory_budget to None to plan with the free memory; "
        "ardiff_cli.runtime.plan_capacity() plans for any amount")
    assert not engine.loaded
    config = load_config(CONFIGS / "causal-world-tiny.yaml")
    runner = ARDiffusionModelRunner(CausalWorldPipeline.fresh(config.model), **beyond)
    with pytest.raises(BudgetBeyondDeviceError, match=r"more than this host's .* of memory$") as info:
        runner.load()
    assert info.value.hint == (
        "pass ARDiffusionModelRunner a lower memory_budget or session_capacity, or memory_budget=None to plan with "
        "the free memory; ardiff_cli.runtime.plan_capacity() plans for any amount")
    assert "--" not in info.value.hint and runner.kv_cache is None


def test_a_failed_load_frees_the_weights_even_while_its_exception_is_kept():
    """A server keeps the last load error to report it (``last_error = exc``): its traceback holds load()'s frame,
    and a runner left unclosed there kept the pipeline's weights resident for as long as the error was kept."""
    config = load_config(CONFIGS / "causal-world-tiny.yaml", pipeline="test_engine_library:RecordsItsWeights")
    engine = ARDiffusionEngine.from_config(config, device="cpu", memory_budget="1KiB")
    RecordsItsWeights.built.clear()
    with pytest.raises(CapacityError, match=r"one session needs") as info:
        engine.load()
    gc.collect()
    assert info.value.__traceback__ is not None and RecordsItsWeights.built[-1]() is None
    assert not engine.loaded


def test_a_subscriber_whose_error_cannot_be_shown_still_cannot_fail_a_request():
    # Formatting its exception raised (a __str__ that raises) inside the report: the request failed, its session
    # admitted with no forward run
    class Unprintable(Exception):
        def __str__(self):
            raise ValueError("cannot format")

    def metrics(event):
        if event.kind == "session_admitted":
            raise Unprintable

    engine = server_engine()
    engine.load()
    engine.subscribe(metrics)
    with pytest.warns(ArdiffWarning, match=r"event subscriber .*metrics raised Unprintable \(which cannot be shown as "
                                           r"text\) \(on a session_admitted event\)"):
        engine.execute(request(engine, "r0", "a"))
    assert [s.num_requests for s in engine.runner.sessions()] == [1]
    engine.close()


def test_a_session_id_argument_that_is_not_a_string_is_a_request_error():
    # close_session(["a"]) and the others raised a plain TypeError: unhashable type
    engine = server_engine()
    engine.load()
    runner = engine.runner
    for call, name in ((lambda: runner.close_session(["a"]), "close_session"),
                       (lambda: runner.reset_session({"a": 1}), "reset_session"),
                       (lambda: runner.swap_out_sessions([["a"]]), "swap_out_sessions"),
                       (lambda: runner.restore_session(""), "restore_session")):
        with pytest.raises(RequestError, match=rf"^{name}\(\) takes a session id \(a non-empty string\), got "):
            call()
    engine.close()


def test_every_engine_call_before_load_and_after_close_is_an_engine_state_error_naming_what_to_do():
    """engine.runner.sessions() (the README's own line) and engine.pipeline.example_inputs() before load() were an
    AttributeError on None ('NoneType' object has no attribute 'sessions'), which named neither the engine nor
    load(); after close() the pipeline was None the same way."""
    engine = server_engine()
    later = ARDiffusionRequest("r", {}, {"session_id": "a"})
    assert not engine.loaded
    before_load = [("runner", lambda: engine.runner), ("runner", lambda: engine.runner.sessions()),
                   ("pipeline", lambda: engine.pipeline.example_inputs(seed=0)), ("warmup()", engine.warmup),
                   ("execute()", lambda: engine.execute(later))]
    for what, call in before_load:
        with pytest.raises(EngineStateError, match=rf"^ARDiffusionEngine\.{re.escape(what)}: the engine is not "
                                                   r"loaded, ARDiffusionEngine\.load\(\) must run first$") as info:
            call()
        assert isinstance(info.value, RuntimeError) and "engine.load()" in info.value.hint
    engine.close()  # nothing to close
    unsubscribe = engine.subscribe(lambda event: None)
    unsubscribe()
    engine.load()
    assert engine.loaded
    engine.execute(request(engine, "r0", "a"))
    runner = engine.runner
    engine.close()
    assert not engine.loaded and engine.runner is runner and runner.closed  # the closed runner's views stay
    assert runner.sessions() == [] and runner.pool_usage().num_used == 0
    with pytest.raises(EngineStateError, match=r"^ARDiffusionEngine\.pipeline: the engine is closed, and its "
                                               r"pipeline \(weights included\) was released$") as info:
        engine.pipeline
    assert "engine.load()" in info.value.hint
    after_close = [engine.warmup, lambda: engine.execute(later), runner.warmup, lambda: runner.execute_model(later),
                   lambda: runner.reset_session("a"), lambda: runner.close_session("a"),
                   lambda: runner.restore_session("a"), lambda: runner.swap_out_sessions(["a"]),
                   lambda: runner.adopt_snapshot("a", "x.safetensors")]
    for call in after_close:
        with pytest.raises(EngineStateError, match=r"^the runner is closed \(ARDiffusionEngine.close\(\)\)"):
            call()
    assert runner.close_all() == [] and runner.detach_snapshots() == {}  # nothing left to close or detach
    engine.close()  # twice: nothing more to do
    engine.load()  # and loaded again, all works
    assert engine.loaded and engine.runner is not runner and engine.execute(request(engine, "r0", "a"))
    engine.close()


class Boom(Exception):
    """What a server's own code raises inside a `with engine:` block."""


def test_the_engine_is_a_context_manager_that_closes_it_however_the_block_ends():
    """`with ARDiffusionEngine.from_config(...) as engine:` was a TypeError (no context manager protocol): a server
    had to remember engine.close() in a finally, or kept the KV pools and weights until the process ended."""
    with server_engine() as engine:
        assert isinstance(engine, ARDiffusionEngine) and not engine.loaded  # the block loads it
        engine.load()
        engine.execute(request(engine, "r0", "a"))
        pool = weakref.ref(engine.runner.kv_cache.pool.kv)
    gc.collect()
    assert not engine.loaded and engine.runner.closed and pool() is None
    engine.close()  # a second close does nothing
    raised = Boom("the server's own error")
    with pytest.raises(Boom) as info:
        with engine:  # again, after close: loads anew
            engine.load()
            engine.execute(request(engine, "r0", "a"))
            raise raised
    assert info.value is raised and info.value.__context__ is None and not engine.loaded
    with engine:
        pass  # never loaded: nothing to close


@pytest.mark.parametrize(("raised", "reason"), [(None, "explicit"), (KeyboardInterrupt(), "run_stopped"),
                                                (SystemExit(143), "run_stopped"),
                                                (StopRequested("stop"), "run_stopped"),
                                                (Boom("the server's own error"), "run_failed")])
def test_a_with_block_closes_its_sessions_with_the_reason_of_what_ended_it(raised, reason):
    """A block that raised closed the sessions it left as `explicit`, as a caller's own close() of a server that ran
    on: a subscriber could not tell a Ctrl-C or a crash from a clean end. They say `run_stopped`
    (KeyboardInterrupt, SystemExit, a StopRequested such as the CLI's Interrupted) or `run_failed` (any other
    exception), as rollout's close of a stopped or failed run."""
    engine = server_engine()
    closed = []
    engine.subscribe(lambda event: closed.append((event.session_id, event.reason))
                     if event.kind == "session_closed" else None)
    with pytest.raises(type(raised)) if raised is not None else contextlib.nullcontext():
        with engine:
            engine.load()
            engine.execute(request(engine, "r0", "a"))
            if raised is not None:
                raise raised
    assert closed == [("a", reason)] and not engine.loaded


def test_a_close_hook_that_fails_at_the_end_of_a_with_block_never_hides_the_blocks_own_exception():
    """The block's exception is the one the caller must see; a close hook failing as the block ends is a warning then,
    and raised as close() raises it when the block ended normally."""
    config = load_config(CONFIGS / "causal-world-tiny.yaml", pipeline="test_engine_library:TelemetryOnClose")
    engine = ARDiffusionEngine.from_config(config, device="cpu", memory_budget="64MiB", session_capacity=2)
    raised = Boom("the server's own error")
    with pytest.warns(ArdiffWarning, match=r"with` block that raised Boom, and close\(\) failed too: "
                                           r"LifecycleHookError: .*telemetry unreachable"):
        with pytest.raises(Boom) as info:
            with engine:
                engine.load()
                engine.execute(request(engine, "r0", "a"))
                raise raised
    assert info.value is raised and not engine.loaded
    with pytest.raises(ArdiffError, match="telemetry unreachable"):
        with engine:
            engine.load()
            engine.execute(request(engine, "r0", "a"))
    assert not engine.loaded and engine.runner.sessions() == []


def test_warmup_with_every_slot_taken_is_an_engine_state_error_with_a_bounded_message():
    """It was a bare RuntimeError listing every resident session id in full (thousands, of any length)."""
    engine = server_engine(capacity=2)
    engine.load()
    engine.execute(request(engine, "r0", "x" * 5000))
    engine.execute(request(engine, "r1", "b"))
    with pytest.raises(EngineStateError, match=r"warmup needs a free session slot, and all 2 are taken") as info:
        engine.warmup()
    assert len(str(info.value)) < 400 and "close_session" in info.value.hint
    assert engine.runner.session_ids == ["x" * 5000, "b"]
    engine.close()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"sesion_capacity": 2}, r"unknown key 'runtime.sesion_capacity' \(did you mean 'session_capacity'\?\)"),
    ({"memory_budget": "lots"}, r"field 'runtime.memory_budget': expected a byte size"),
])
def test_a_bad_keyword_of_from_config_is_named_as_that_keyword_not_as_the_command_line(overrides, message):
    """A Python caller's keyword argument was reported as 'command line: ...', which no command line was."""
    with pytest.raises(ConfigError, match=r"^ARDiffusionEngine.from_config\(\): " + message) as info:
        ARDiffusionEngine.from_config(CONFIGS / "causal-world-tiny.yaml", **overrides)
    assert info.value.hint and "command line" not in str(info.value)


def test_an_engine_or_config_built_from_something_else_is_a_config_error_at_once():
    """ARDiffusionEngine("causal-world-tiny") was accepted, then load() failed with a bare AttributeError ('str'
    object has no attribute 'runtime'); load_config(123) was a TypeError from pathlib."""
    for source in ("causal-world-tiny", {"pipeline": "causal_world"}, CONFIGS / "causal-world-tiny.yaml"):
        with pytest.raises(ConfigError, match=r"ARDiffusionEngine\(\) takes an EngineConfig, got ") as info:
            ARDiffusionEngine(source)
        assert "ARDiffusionEngine.from_config(" in info.value.hint
    for source in (123, [CONFIGS / "causal-world-tiny.yaml"], b"causal-world-tiny"):
        expected = r"a config is a YAML path, a built-in config name or a dict, got "
        with pytest.raises(ConfigError, match=expected) as info:
            load_config(source)
        assert info.value.hint
    assert ARDiffusionEngine(load_config(CONFIGS / "causal-world-tiny.yaml")).config.pipeline_name == "causal_world"


def test_an_engine_built_from_a_plan_only_config_without_its_checkpoint_says_so_at_once(tmp_path):
    """load_config(..., plan_only=True) keeps a checkpoint that is not on this machine, for a plan; an engine built
    from it failed only at load(), in the pipeline's checkpoint loader, with no word of plan_only."""
    text = (CONFIGS / "causal-world-tiny.yaml").read_text()
    config = tmp_path / "cluster.yaml"
    config.write_text(text.replace("checkpoint: null", "checkpoint: weights/model.safetensors"))
    planned = load_config(config, plan_only=True)
    expected = (rf"^ARDiffusionEngine\(\): {re.escape(str(config))}: field 'checkpoint': file not found: "
                rf"{re.escape(str(tmp_path / 'weights' / 'model.safetensors'))}: the config was loaded with "
                r"plan_only=True, for a capacity plan, which reads no weights; an engine loads them$")
    for build in (ARDiffusionEngine, ARDiffusionEngine.from_config):
        with pytest.raises(CheckpointError, match=expected) as info:
            build(planned)
        assert info.value.hint == ("put the checkpoint there, then load the config again without plan_only "
                                   "(load_config(source))")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")  # there when loaded: an engine is built from it
    assert ARDiffusionEngine(load_config(config, plan_only=True)).config.checkpoint_missing is None


def test_write_step_keeps_every_array_its_shape(tmp_path):
    """A 0-d array (a scalar gripper reading, np.float32(0.5), a 0-d tensor) was written as shape (1,):
    np.ascontiguousarray returns at least one dimension."""
    arrays = {"gripper_position": np.float32(0.5), "scalar": np.array(2.0), "tensor": torch.tensor(1.5),
              "joint_position": np.arange(14, dtype=np.float32)[::2], "image": np.zeros((2, 4, 4, 3), np.uint8)}
    for format in ("safetensors", "npz"):
        got = read_step(write_step(tmp_path / format, 3, arrays, format=format)).arrays
        assert {k: v.shape for k, v in got.items()} == {k: np.shape(v) for k, v in arrays.items()}
        assert got["gripper_position"] == np.float32(0.5) and got["joint_position"].tolist() == list(range(0, 14, 2))


def test_write_step_takes_a_step_number_from_a_numpy_counter(tmp_path):
    """write_step(folder, np.int64(3), ...) (a step counted with numpy, np.arange) was refused as 'step must be a
    non-negative integer, got np.int64(3)'."""
    observation = {"joint_position": np.zeros(7, np.float32)}
    paths = [write_step(tmp_path / "ep", step, observation) for step in np.arange(3)]
    assert [p.name for p in paths] == ["step_000000.safetensors", "step_000001.safetensors", "step_000002.safetensors"]
    for bad in (np.int64(-1), True, np.bool_(True), 1.0, "3"):
        with pytest.raises(ValueError, match="step must be a non-negative integer"):
            write_step(tmp_path / "bad", bad, observation)


def test_a_subscriber_may_take_a_lock_that_a_thread_reading_the_runners_views_holds():
    """Events were delivered while the runner held its session-table lock: a server whose event callback updates
    its own table under its lock, and whose /status handler reads runner.sessions() under that same lock,
    deadlocked (the request thread waited for the table lock, the status thread for the runner's)."""
    engine = server_engine(capacity=1)
    table_lock = threading.Lock()
    in_callback, status_holds_lock = threading.Event(), threading.Event()
    acquired: list[bool] = []
    # each thread's wait for the other (a bound on a hang, not a timing): one that ran out let the test go on past
    # the order it is about, the status thread reading before the eviction or the callback locking before it
    waited: dict[str, bool] = {}

    def on_event(event):
        if event.kind == "session_evicted":
            in_callback.set()
            waited["the callback for the status thread to take the table lock"] = status_holds_lock.wait(60)
            # a deadlock guard, not a timing: the status thread holds the lock until its sessions() returns, which a
            # loaded machine (or the switch interval) may delay for seconds; 5 s here read as the deadlock
            got = table_lock.acquire(timeout=60)
            acquired.append(got)
            if got:
                table_lock.release()

    statuses = []

    def status():
        waited["the status thread for the eviction's event"] = in_callback.wait(60)
        with table_lock:
            status_holds_lock.set()
            statuses.append([view.session_id for view in engine.runner.sessions()])

    engine.subscribe(on_event)
    engine.load()
    engine.execute(request(engine, "r0", "a"))
    thread = threading.Thread(target=status)
    thread.start()
    engine.execute(request(engine, "r1", "b"))  # evicts "a"
    thread.join(120)
    assert not thread.is_alive(), "the status thread never read the runner's sessions"
    assert all(waited.values()) and len(waited) == 2, f"a wait ran out (False) or never began: {waited}"
    assert acquired == [True] and statuses == [["b"]]  # delivered once the admission that evicted "a" is done
    assert engine.runner.session_ids == ["b"]
    engine.close()


class HeldInForward(CausalWorldPipeline):
    """The causal_world pipeline whose forward of request 'held' waits until the test lets it go."""

    entered, release = threading.Event(), threading.Event()

    def forward(self, request):
        if request.request_id == "held":
            type(self).entered.set()
            assert type(self).release.wait(30), "the test never released the forward"  # a deadlock guard
        return super().forward(request)


def test_close_from_another_thread_waits_for_the_request_in_progress_and_later_requests_are_refused():
    """What a server's shutdown handler does while a robot's request runs, as the README says: the request ends
    with its output, then the engine closes, and a request after it is an EngineStateError, not a crash."""
    config = load_config(CONFIGS / "causal-world-tiny.yaml", pipeline="test_engine_library:HeldInForward")
    engine = ARDiffusionEngine.from_config(config, device="cpu", memory_budget="64MiB", session_capacity=2)
    engine.load()
    HeldInForward.entered.clear()
    HeldInForward.release.clear()
    outputs, closed = [], []
    robot = threading.Thread(target=lambda: outputs.append(engine.execute(request(engine, "held", "a"))))
    robot.start()
    assert HeldInForward.entered.wait(30)
    closer = threading.Thread(target=lambda: (engine.close(), closed.append(True)))
    closer.start()
    for _ in range(30_000):  # until the closer waits for the request lock (a guard, not a timing)
        frame = sys._current_frames().get(closer.ident)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "exclusive" in names:
            break
        threading.Event().wait(0.001)
    assert "exclusive" in names and not closed  # close() waits for the forward in progress
    HeldInForward.release.set()
    robot.join(30)
    closer.join(30)
    assert closed and outputs and outputs[0]["latents"].shape[0] > 0
    assert engine.runner.closed and engine.runner.sessions() == []
    with pytest.raises(EngineStateError, match="closed"):
        engine.execute(ARDiffusionRequest("r1", {}, {"session_id": "a"}))


def test_an_empty_session_id_is_refused_not_made_a_session_of_its_own():
    # extra_args={'session_id': ''} (a client's unset variable) must not become a shared nameless session.
    engine = server_engine()
    engine.load()
    engine.execute(request(engine, "r0", "a"))
    before = engine.runner.sessions()
    bad = ARDiffusionRequest("bad", engine.pipeline.example_inputs(seed=1), {"session_id": ""})
    with pytest.raises(RequestError, match=r"^request 'bad': extra_args\['session_id'\] must be a non-empty string, "
                                           r"got ''$"):
        engine.execute(bad)
    assert engine.runner.sessions() == before
    engine.close()


def test_a_dict_holding_a_request_id_among_other_keys_is_not_taken_for_a_requests_fields():
    # ARDiffusionRequest(**that_dict) would fail again on 'prompt' and 'session_id': the hint must not suggest it.
    from ardiff_cli.runtime.errors import RequestTypeError
    from ardiff_cli.runtime.request import require_request

    with pytest.raises(RequestTypeError) as info:
        require_request({"request_id": "r0", "prompt": "go", "session_id": "a"}, "ARDiffusionEngine.execute()")
    assert "ARDiffusionRequest(**that_dict)" not in info.value.hint
    assert "inputs=that_dict" in info.value.hint
    with pytest.raises(RequestTypeError) as info:  # a request's fields and nothing else: that one is right
        require_request({"request_id": "r0", "inputs": {}}, "ARDiffusionEngine.execute()")
    assert "ARDiffusionRequest(**that_dict)" in info.value.hint


def test_an_empty_list_is_named_as_it_is_not_as_a_batch_of_requests():
    from ardiff_cli.runtime.errors import RequestTypeError
    from ardiff_cli.runtime.request import require_request

    with pytest.raises(RequestTypeError) as info:
        require_request([], "ARDiffusionEngine.execute()")
    assert str(info.value) == "ARDiffusionEngine.execute() takes an ARDiffusionRequest, got [] (list)"
    assert "one call per request" not in info.value.hint


def test_a_request_built_from_a_reloaded_module_is_named_as_such(monkeypatch):
    import importlib.util
    import sys

    import ardiff_cli.runtime.request as module
    from ardiff_cli.runtime.errors import RequestTypeError
    from ardiff_cli.runtime.request import require_request

    spec = importlib.util.spec_from_file_location("reloaded_request", module.__file__)
    other = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "reloaded_request", other)  # what importlib.reload or a second import path does
    spec.loader.exec_module(other)
    with pytest.raises(RequestTypeError) as info:
        require_request(other.ARDiffusionRequest("r0"), "ARDiffusionEngine.execute()")
    assert str(info.value) == ("ARDiffusionEngine.execute() takes an ARDiffusionRequest, got an ARDiffusionRequest of "
                               "another module (reloaded_request, not ardiff_cli.runtime.request: a reloaded module?)")
    assert info.value.hint == "import ARDiffusionRequest from ardiff_cli.runtime, as the engine does"


@pytest.mark.parametrize(("key", "meant"), [("SessionId", "session_id"), ("SESSION_ID", "session_id"),
                                            ("Close-Session", "close_session")])
def test_a_runner_key_in_other_capitals_is_warned_of_as_misspelt(key, meant):
    assert ARDiffusionRequest("r0", {}, {key: True}).misspelt_keys() == [(key, meant)]


def test_a_request_returns_non_finite_outputs_as_the_forward_made_them_and_output_problem_names_them():
    """What the README tells a server: the runtime returns a diverged step's outputs as they are (the session goes
    on from its KV), and output_problem is how `rollout` tells them apart, before it releases the session."""
    from ardiff_cli.runtime.outputs import output_problem

    config = {"pipeline": "dreamzero", "model": {"preset": "tiny", "guidance_scale": 1.0e30}}
    with ARDiffusionEngine.from_config(config, device="cpu", memory_budget="64MiB") as engine:
        engine.load()
        out = engine.execute(ARDiffusionRequest("r0", engine.pipeline.example_inputs(1), {"session_id": "a"}))
        assert not torch.isfinite(out["actions"]).all()
        kind, what = output_problem(out)
        assert kind == "non_finite" and "'actions':" in what and "NaN" in what, what
        assert [(view.session_id, view.num_requests) for view in engine.runner.sessions()] == [("a", 1)]
        engine.runner.close_session("a")
        assert engine.runner.sessions() == [] and engine.runner.pool_usage().num_used == 0


def test_a_request_under_autocast_to_another_dtype_is_refused_and_leaves_its_session_as_it_was():
    """A float32 engine's request under torch.autocast(bfloat16) (a notebook's, a server's mixed-precision block)
    made bfloat16 K/V the float32 pools refuse: a ValueError about layer 0's dtypes, half way through the forward,
    and the session's history released. Refused before the session is touched now, naming autocast; autocast to
    the engine's own dtype runs as without it."""
    reference = server_engine()
    reference.load()
    expected = [reference.execute(request(reference, f"r{i}", "a", seed=i))["latents"] for i in range(3)]
    reference.close()
    engine = server_engine()
    engine.load()
    got = [engine.execute(request(engine, "r0", "a", seed=0))["latents"]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RequestError, match=r"request 'r1' runs under torch.autocast\('cpu', dtype=torch.bfloat16"
                                               r"\), and this engine computes .* in torch.float32: the session 'a' "
                                               "is as it was") as refused:
            engine.execute(request(engine, "r1", "a", seed=1))
    assert "outside the autocast block" in refused.value.hint
    assert [view.num_requests for view in engine.runner.sessions()] == [1]
    got += [engine.execute(request(engine, f"r{i}", "a", seed=i))["latents"] for i in (1, 2)]
    engine.close()
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    # autocast to the engine's own dtype runs, as it did
    engine = ARDiffusionEngine.from_config(CONFIGS / "causal-world-tiny.yaml", device="cpu", memory_budget="64MiB",
                                           dtype="bfloat16")
    engine.load()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(engine.execute(request(engine, "r0", "a"))["latents"]).all()
    engine.close()


def test_an_engine_loaded_under_inference_mode_serves_requests_made_with_or_without_it():
    """A server that loads its engine under torch.inference_mode() (a decorated start-up function) and serves outside
    it: the KV pools used to be inference tensors then, which every forward writes in place, so every request failed
    ("Inplace update to inference tensor outside InferenceMode") and released its session."""
    reference = server_engine()
    reference.load()
    expected = [reference.execute(request(reference, f"r{i}", "a", seed=i))["latents"] for i in range(4)]
    reference.close()
    engine = server_engine()
    with torch.inference_mode():
        engine.load()
    got = []
    for i in range(4):
        if i % 2:  # requests alternate: inside inference mode, then outside it
            with torch.inference_mode():
                got.append(engine.execute(request(engine, f"r{i}", "a", seed=i))["latents"])
        else:
            got.append(engine.execute(request(engine, f"r{i}", "a", seed=i))["latents"])
    assert [view.num_requests for view in engine.runner.sessions()] == [4]
    engine.close()
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
