"""Warmup runs one request that goes on with its session's history a second time, on the session rebuilt from its
export as a swap restore rebuilds it, and warns when the outputs differ: swapped, replayed and resumed sessions are
bit-identical to uninterrupted ones only for a deterministic forward whose export holds all of a session's state.
The third-party mistakes, through the CLI: test_pipeline_authoring.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from ardiff_cli.runtime.config import load_config
from ardiff_cli.runtime.engine import ARDiffusionEngine
from ardiff_cli.runtime.errors import ArdiffWarning
from ardiff_cli.runtime.request import ARDiffusionRequest
from pipeline_helpers import CONFIGS, ardiff_cache, single_thread  # noqa: F401 - fixtures
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
        return {**super().export_ar_diffusion_session(session_id), "scale": torch.empty(2, device="meta")}


def engine_for(config: str, pipeline: str, dtype: str = "float32") -> tuple[ARDiffusionEngine, list]:
    source = load_config(CONFIGS / f"{config}.yaml", pipeline=f"test_warmup_rerun:{pipeline}")
    engine = ARDiffusionEngine(source.with_runtime(where="test", device="cpu", memory_budget="1GiB",
                                                   attention_backend="torch", dtype=dtype))
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


@pytest.mark.parametrize(("config", "name"), [("dreamzero-tiny", "DreamZero"), ("causal-world-tiny", "CausalWorld")])
def test_a_built_in_pipeline_drawing_from_the_global_generator_is_one_warning(config, name):
    engine, _ = engine_for(config, f"Noisy{name}")
    with pytest.warns(ArdiffWarning) as record:
        engine.warmup()
    said = [str(w.message) for w in record if RERUN in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in record]
    assert said[0].startswith(f"Noisy{name}: warmup request 'warmup-1' {RERUN}, as a swapped-out session is "
                              "restored: '"), said
    assert "replayed, swapped and resumed sessions will not reproduce the run" in said[0]
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
                      r"RefusesItsExport.import_ar_diffusion_session\(\) raised ValueError: field 'anchor_latent'"):
        report = engine.warmup()
    assert report.restored and len(report.timings) == 4 and engine.runner.pool_usage().num_used == 0
    # subscribers saw it admitted: they are told that it went, and that the next request admitted it afresh
    assert [(e.kind, getattr(e, "reason", None)) for e in events if e.kind.startswith("session_")] == [
        ("session_admitted", None), ("session_closed", "restore_failed"), ("session_admitted", None),
        ("session_closed", "explicit")]
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
