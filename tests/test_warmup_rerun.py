"""Warmup runs one request that goes on with its session's history a second time, on the session rebuilt from its
export as a swap restore rebuilds it, and warns when the outputs differ: swapped, replayed and resumed sessions are
bit-identical to uninterrupted ones only for a deterministic forward whose export holds all of a session's state.
The third-party mistakes, through the CLI: test_pipeline_authoring.py."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from ardiff_cli.runtime.config import load_config
from ardiff_cli.runtime.engine import ARDiffusionEngine
from ardiff_cli.runtime.errors import ArdiffWarning, PipelineError
from ardiff_cli.runtime.request import ARDiffusionRequest
from ardiff_cli.runtime.runner import LifecycleHookError
from pipeline_helpers import CONFIGS
from pipelines.causal_world.pipeline import CausalWorldPipeline
from pipelines.dreamzero.pipeline import DreamZeroPipeline

pytestmark = pytest.mark.usefixtures("single_thread", "ardiff_cache")

RERUN = "returned other outputs when run again on its session rebuilt from the session's export"


class _Counted:
    """Counts its forwards and imports."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forwards = self.imports = 0

    def forward(self, request):
        self.forwards += 1
        return super().forward(request)

    def import_ar_diffusion_session(self, session_id, snapshot):
        self.imports += 1
        super().import_ar_diffusion_session(session_id, snapshot)


class CountedDreamZero(_Counted, DreamZeroPipeline):
    pass


class CountedCausalWorld(_Counted, CausalWorldPipeline):
    pass


class _GlobalNoise:
    """Adds noise from torch's global generator to its outputs: a draw no session records."""

    def _step(self, *args, **kwargs):
        return {k: v + torch.randn(v.shape, dtype=torch.float32).to(v.dtype) for k, v in super()._step(*args,
                                                                                                      **kwargs).items()}


class NoisyDreamZero(_GlobalNoise, DreamZeroPipeline):
    pass


class NoisyCausalWorld(_GlobalNoise, CausalWorldPipeline):
    pass


class NoSwapDreamZero(CountedDreamZero):
    export_ar_diffusion_session = None  # its evicted sessions are replayed: nothing to rebuild a session from
    import_ar_diffusion_session = None


class RefusesItsExport(DreamZeroPipeline):
    def import_ar_diffusion_session(self, session_id, snapshot):
        raise ValueError("field 'anchor_latent' is not what this pipeline keeps")


class ExportsAMetaTensor(DreamZeroPipeline):
    def export_ar_diffusion_session(self, session_id):
        # no elements: the spec's model-owned bytes hold with it, so the encoding is the one warning
        return {**super().export_ar_diffusion_session(session_id), "scale": torch.empty(0, device="meta")}


def engine_for(config: str, pipeline: str, dtype: str = "float32",
               swap_dir=None) -> tuple[ARDiffusionEngine, list]:
    source = load_config(CONFIGS / f"{config}.yaml", pipeline=f"test_warmup_rerun:{pipeline}")
    engine = ARDiffusionEngine(source.with_runtime(where="test", device="cpu", memory_budget="1GiB",
                                                   attention_backend="torch", dtype=dtype), swap_dir=swap_dir)
    events: list = []
    engine.subscribe(events.append)
    engine.load()
    return engine, events


BUILT_IN = [("dreamzero-tiny", "DreamZero", "float32"), ("dreamzero-tiny", "DreamZero", "bfloat16"),
            ("causal-world-tiny", "CausalWorld", "float32"), ("causal-world-tiny", "CausalWorld", "bfloat16")]


@pytest.mark.parametrize(("config", "name", "dtype"), BUILT_IN)
def test_the_built_in_pipelines_reproduce_a_request_on_their_rebuilt_session(config, name, dtype):
    """One request more than the provider yields, on a session rebuilt once (one import), and no warning; the
    subscribers see each request once, and one session admitted and closed."""
    engine, events = engine_for(config, f"Counted{name}", dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = engine.warmup()
    pipeline = engine.pipeline
    assert (pipeline.forwards, pipeline.imports) == (len(report.timings) + 1, 1)
    assert [e.request_id for e in events if e.kind == "request_finished"] == [r for r, _, _ in report.timings]
    assert [e.kind for e in events if e.kind.startswith("session_")] == ["session_admitted", "session_closed"]
    assert report.restored and engine.runner.pool_usage().num_used == 0
    engine.close()


@pytest.mark.parametrize(("config", "name", "swapping"), [("dreamzero-tiny", "DreamZero", False),
                                                        ("dreamzero-tiny", "DreamZero", True),
                                                        ("causal-world-tiny", "CausalWorld", False)])
def test_a_built_in_pipeline_drawing_from_the_global_generator_is_one_warning(config, name, swapping, tmp_path):
    """Said so that it holds with no swap space too (--swap-space 0, ``ardiff warmup``), where nothing is swapped
    and every evicted session is replayed: it said those sessions would not reproduce the run when swapped."""
    engine, _ = engine_for(config, f"Noisy{name}", swap_dir=tmp_path / "swap" if swapping else None)
    assert (engine.runner.swap is not None) == swapping
    with pytest.warns(ArdiffWarning) as record:
        engine.warmup()
    said = [str(w.message) for w in record if RERUN in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in record]
    assert said[0].startswith(f"Noisy{name}: warmup request 'warmup-1' {RERUN}, as a swapped-out session is "
                              "restored: '"), said
    assert ("; swapped-out and resumed sessions will not reproduce the run, nor will replayed ones (with no swap "
            "space, every evicted session is) if the forward's noise is what differs. Draw ") in said[0]
    engine.close()


def test_a_pipeline_that_cannot_export_its_sessions_runs_no_request_more():
    engine, _ = engine_for("dreamzero-tiny", "NoSwapDreamZero")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = engine.warmup()
    assert engine.pipeline.forwards == len(report.timings)
    engine.close()


def test_an_import_that_refuses_its_own_export_is_a_warning_and_the_warmup_goes_on():
    """Every restore of a swapped-out session would fail (and replay): said at warmup, which still ends restored."""
    engine, events = engine_for("dreamzero-tiny", "RefusesItsExport")
    with pytest.warns(ArdiffWarning, match=r"^RefusesItsExport: warmup request 'warmup-1' could not run again on its "
                      r"session rebuilt from the session's export, as a swapped-out session is restored: "
                      r"RefusesItsExport.import_ar_diffusion_session\(\) raised ValueError: field 'anchor_latent'"
                      r".*; swapped-out sessions will fail as they are restored or at their next step; with no swap "
                      r"space none is, and evicted sessions are replayed \(README"):
        report = engine.warmup()
    assert report.restored and len(report.timings) == 5 and engine.runner.pool_usage().num_used == 0
    # subscribers saw it admitted: they are told that it went, and that the next request admitted it afresh
    assert [(e.kind, getattr(e, "reason", None)) for e in events if e.kind.startswith("session_")] == [
        ("session_admitted", None), ("session_closed", "restore_failed"), ("session_admitted", None),
        ("session_closed", "warmup_ended")]
    engine.close()


class ClosesAndRefusesItsExport(RefusesItsExport):
    """Its second (and last) warmup request closes the session it goes on with; its import fails."""

    def ar_diffusion_warmup_requests(self, session_id):
        first, second = list(super().ar_diffusion_warmup_requests(session_id))[:2]
        yield first
        yield ARDiffusionRequest(second.request_id, second.inputs, {**second.extra_args, "close_session": True})


def test_a_failed_rerun_of_a_request_that_closed_its_session_does_not_close_it_twice():
    """Subscribers were told the request closed it: the rebuilt session that failed goes unseen (a second
    session_closed counted the one warmup session twice)."""
    engine, events = engine_for("dreamzero-tiny", "ClosesAndRefusesItsExport")
    with pytest.warns(ArdiffWarning, match="could not run again on its session rebuilt"):
        report = engine.warmup()
    assert report.restored and len(report.timings) == 2 and engine.runner.pool_usage().num_used == 0
    assert [(e.kind, getattr(e, "reason", None)) for e in events if e.kind.startswith("session_")] == [
        ("session_admitted", None), ("session_closed", "close_session")]
    engine.close()


class StoppedInItsRerun(CountedDreamZero):
    """Ctrl-C lands in the forward of the request run again (its third forward)."""

    def forward(self, request):
        if self.forwards == 2:
            self.forwards += 1
            raise KeyboardInterrupt
        return super().forward(request)


def test_a_stop_in_the_rerun_propagates_and_subscribers_are_told_the_warmup_session_went():
    """As for a stop in any warmup request: the session they saw admitted is closed for them too (nothing was said,
    and the display and --format json kept a warmup session that was gone)."""
    engine, events = engine_for("dreamzero-tiny", "StoppedInItsRerun")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyboardInterrupt):
            engine.warmup()
    assert engine.runner.session_ids == [] and engine.runner.pool_usage().num_used == 0
    assert [e.kind for e in events if e.kind.startswith("session_")] == ["session_admitted", "session_closed"]
    engine.close()


def test_an_export_a_snapshot_cannot_encode_is_a_warning_at_warmup_not_its_failure():
    """A tensor that cannot be copied to the host (on the meta device) fails every swap-out, which warns and evicts;
    the warmup that encodes the export before its rerun failed (exit 1) instead of saying so."""
    engine, _ = engine_for("dreamzero-tiny", "ExportsAMetaTensor")
    with pytest.warns(ArdiffWarning, match=r"^ExportsAMetaTensor.export_ar_diffusion_session\('__ardiff_warmup__'\) "
                      r"raised NotImplementedError: .*: swapping its sessions out will fail alike"):
        report = engine.warmup()
    assert report.restored and engine.pipeline.__class__ is ExportsAMetaTensor
    engine.close()


class _OneRequest:
    """Its first warmup request alone: none goes on with its session, so none is run again."""

    def ar_diffusion_warmup_requests(self, session_id):
        yield next(iter(super().ar_diffusion_warmup_requests(session_id)))


class _EachResets:
    """Each warmup request resets the session (a fresh episode each): none goes on with its history."""

    def ar_diffusion_warmup_requests(self, session_id):
        for request in super().ar_diffusion_warmup_requests(session_id):
            yield ARDiffusionRequest(request.request_id, request.inputs, {**request.extra_args, "reset": True})


class OneRequestExportsAMetaTensor(_OneRequest, _Counted, ExportsAMetaTensor):
    pass


class EachResetsExportsAMetaTensor(_EachResets, _Counted, ExportsAMetaTensor):
    pass


@pytest.mark.parametrize("name", ["OneRequestExportsAMetaTensor", "EachResetsExportsAMetaTensor"])
def test_an_export_a_snapshot_cannot_encode_is_a_warning_at_warmup_with_no_request_to_run_again(name):
    """With no request run again, nothing copied the export to the host as a swap-out does: warmup passed silently,
    and the run's first swap-out failed. Its last session's export is encoded instead, once, with no forward more."""
    engine, _ = engine_for("dreamzero-tiny", name)
    with pytest.warns(ArdiffWarning) as record:
        report = engine.warmup()
    said = [str(w.message) for w in record if "swapping its sessions out will fail alike" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"{name}.export_ar_diffusion_session('__ardiff_warmup__') raised "
                                                 "NotImplementedError: "), [str(w.message) for w in record]
    assert engine.pipeline.forwards == len(report.timings) and engine.pipeline.imports == 0
    assert report.restored and engine.runner.pool_usage().num_used == 0
    engine.close()


class ClosingFailsOnItsRebuiltSession(DreamZeroPipeline):
    """Two warmup requests, the second closing the session it goes on with; its close hook fails on a session its
    import rebuilt (a record the import forgot to make), as it would for every swapped-in session."""

    rebuilt = False

    def ar_diffusion_warmup_requests(self, session_id):
        first, second = list(super().ar_diffusion_warmup_requests(session_id))[:2]
        yield first
        yield ARDiffusionRequest(second.request_id, second.inputs, {**second.extra_args, "close_session": True})

    def import_ar_diffusion_session(self, session_id, snapshot):
        super().import_ar_diffusion_session(session_id, snapshot)
        self.rebuilt = True

    def close_ar_diffusion_session(self, session_id):
        super().close_ar_diffusion_session(session_id)
        if self.rebuilt:
            raise KeyError("the rebuilt session's record")


def test_a_close_hook_that_fails_on_the_rerun_is_a_warning():
    """The rerun's events are dropped: its hook_failed too, so the failure was only an entry of hook_errors."""
    engine, events = engine_for("dreamzero-tiny", "ClosingFailsOnItsRebuiltSession")
    with pytest.warns(ArdiffWarning) as record:
        report = engine.warmup()
    said = [str(w.message) for w in record]
    assert said == ["ClosingFailsOnItsRebuiltSession: warmup request 'warmup-1', run again on its session rebuilt from "
                    "the session's export as a swapped-out session is restored: ClosingFailsOnItsRebuiltSession."
                    "close_ar_diffusion_session('__ardiff_warmup__') raised KeyError: \"the rebuilt session's record\"; "
                    "the session's KV was released (README, 'Adding a pipeline')"], said
    assert len(engine.runner.hook_errors) == 1
    assert report.restored and engine.runner.pool_usage().num_used == 0
    # subscribers still hear of one session, closed by its request
    assert [(e.kind, getattr(e, "reason", None)) for e in events if e.kind.startswith(("session_", "hook_"))] == [
        ("session_admitted", None), ("session_closed", "close_session")]
    engine.close()


class TwoRequestsClosingAlwaysFails(DreamZeroPipeline):
    """Two warmup requests, the second going on with the session's history (run again on its rebuilt session); its
    close hook always fails."""

    def ar_diffusion_warmup_requests(self, session_id):
        yield from list(super().ar_diffusion_warmup_requests(session_id))[:2]

    def close_ar_diffusion_session(self, session_id):
        super().close_ar_diffusion_session(session_id)
        raise KeyError("the session's record")


def test_a_close_hook_that_always_fails_fails_the_warmup_also_when_the_rerun_closes_the_session_first():
    """The rerun's check closes the session before its last request ends the warmup: its close hook failing there was
    the rerun's warning only, and with the session gone no close at the warmup's end failed, so the warmup passed.
    It is the warmup's failure, as that close's, and subscribers hear of the close as it went; no rerun warning."""
    engine, events = engine_for("dreamzero-tiny", "TwoRequestsClosingAlwaysFails")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ArdiffWarning)
        with pytest.raises(LifecycleHookError) as info:
            engine.warmup()
    assert str(info.value) == ("TwoRequestsClosingAlwaysFails.close_ar_diffusion_session('__ardiff_warmup__') raised "
                               "KeyError: \"the session's record\"; the session's KV was released")
    assert engine.runner.session_ids == [] and engine.runner.pool_usage().num_used == 0
    assert [(e.kind, getattr(e, "reason", None)) for e in events if e.kind.startswith(("session_", "hook_"))] == [
        ("session_admitted", None), ("hook_failed", None), ("session_closed", "warmup_ended")]
    assert [e.kind for e in events if e.kind == "request_finished"] == ["request_finished"] * 2
    engine.close()


class DivergesThenClosingFails(CausalWorldPipeline):
    """Its second warmup request diverges (its outputs infinite), which fails the warmup with its session open, and
    its close hook fails as the warmup then releases it."""

    def forward(self, request):
        output = super().forward(request)
        return output if request.request_id == "warmup-0" else {name: value / 0 for name, value in output.items()}

    def close_ar_diffusion_session(self, session_id):
        super().close_ar_diffusion_session(session_id)
        raise KeyError("the session's record")


def test_a_close_hook_that_fails_after_a_failed_warmup_request_is_a_note_on_its_error():
    """The request's error is raised; the close hook's failure as the warmup session is then released was dropped
    without a word (warmup raises it only when nothing else failed): it is the error's note, as a failed forward's."""
    engine, events = engine_for("causal-world-tiny", "DivergesThenClosingFails")
    with pytest.raises(PipelineError, match=r"^warmup request 'warmup-1' of DivergesThenClosingFails: "
                                            r"DivergesThenClosingFails\.forward\(\) returned non-finite") as info:
        engine.warmup()
    assert not isinstance(info.value, LifecycleHookError)
    assert info.value.__notes__ == ["DivergesThenClosingFails.close_ar_diffusion_session('__ardiff_warmup__') "
                                    "raised KeyError: \"the session's record\"; the session's KV was released"]
    assert len(engine.runner.hook_errors) == 1 and engine.runner.pool_usage().num_used == 0
    assert [e.kind for e in events if e.kind.startswith("hook_")] == ["hook_failed"]
    engine.close()


class WaitsInItsRerun(CountedDreamZero):
    """Another thread's request starts while warmup runs its request again (its third forward)."""

    other: threading.Thread | None = None

    def forward(self, request):
        if self.forwards == 2 and self.other is not None:
            self.other.start()
            self.other.join(timeout=0.5)
            assert self.other.is_alive(), "another thread's request ran inside the warmup"
        return super().forward(request)


def test_another_threads_request_waits_for_the_warmup_and_its_events_are_not_muted():
    """The rerun mutes the runner's events, runner-wide: that is the rerun's alone since warmup holds the request
    lock, and a request from another thread waits for it to end."""
    engine, events = engine_for("dreamzero-tiny", "WaitsInItsRerun")
    warm = list(engine.pipeline.ar_diffusion_warmup_requests("robot"))[0]
    done = []
    engine.pipeline.other = threading.Thread(target=lambda: done.append(engine.execute(warm)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = engine.warmup()
    engine.pipeline.other.join()
    assert done and engine.pipeline.forwards == len(report.timings) + 2
    finished = [e.request_id for e in events if e.kind == "request_finished"]
    assert finished == [r for r, _, _ in report.timings] + [warm.request_id]
    assert engine.runner.session_ids == ["robot"]
    engine.close()
