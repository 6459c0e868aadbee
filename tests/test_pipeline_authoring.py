"""A third-party pipeline written from the README's "Adding a pipeline" alone, outside the repository: a package
registered through an entry point (a dist-info folder on PYTHONPATH), with a tiny torch model that attends over the
paged KV cache of two CFG branches and reads one cross-attention cache. It runs end to end, and the mistakes its
author plausibly makes are named as what they are."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ardiff_cli.io import write_episode

ENTRY = '''
from dataclasses import dataclass, fields

from ardiff_cli.runtime import (ARDiffusionCrossAttentionKVSpec, ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec,
                                ObservationField, ObservationSchema)
from ardiff_cli.runtime.errors import ConfigError


@dataclass
class Config:
    num_layers: int = 2
    num_heads: int = 2
    head_size: int = 8
    tokens_per_frame: int = 4
    window_frames: int = 2
    sink_frames: int = 1
    text_tokens: int = 3
    model_owned_bytes: int = 0

    @classmethod
    def from_dict(cls, data, *, where):
        unknown = sorted(set(data or {}) - {f.name for f in fields(cls)})
        if unknown:
            raise ConfigError(f"{where}: unknown key model.{unknown[0]}")
        return cls(**(data or {}))

    def kv_cache_spec(self):
        return ARDiffusionKVCacheSpec(
            num_layers=self.num_layers, num_kv_heads=self.num_heads, head_size=self.head_size,
            tokens_per_frame=self.tokens_per_frame, frames_per_block=1, window_frames=self.window_frames,
            sink_frames=self.sink_frames, session_capacity=4,
            kv_branches=(ARDiffusionKVBranchSpec("cond", 0), ARDiffusionKVBranchSpec("uncond", 1)),
            cross_attention=(ARDiffusionCrossAttentionKVSpec("text", self.text_tokens),),
            model_owned_state_bytes_per_session=self.model_owned_bytes)


def observation_schema():
    return ObservationSchema(fields=(ObservationField("state", "float32", ((6,),)),), prompt_key="prompt")


def pipeline_class():
    from lab_world.model import LabPipeline
    return LabPipeline
'''

MODEL = '''
import contextlib
import dataclasses
import functools
import json
import os
import threading
import time
import warnings
import zlib

import numpy as np
import torch

from ardiff_cli.runtime import ARDiffusionRequest, ObservationField, ObservationSchema
from lab_world import Config, observation_schema as _schema


class LabPipeline:
    Config = Config
    observation_schema = staticmethod(_schema)

    def __init__(self, config, device, dtype):
        self.config, self.device, self.dtype = config, device, dtype
        gen = torch.Generator().manual_seed(0)
        dim = config.num_heads * config.head_size
        self.qkv = [torch.randn(dim, 3 * dim, generator=gen, dtype=torch.float32).to(device, dtype) / dim ** 0.5
                    for _ in range(config.num_layers)]
        self.embed = torch.randn(6, dim, generator=gen, dtype=torch.float32).to(device, dtype)
        self.text = torch.randn(256, dim, generator=gen, dtype=torch.float32).to(device, dtype)
        self.counters, self.state = {}, None

    @classmethod
    def from_config(cls, config, *, device, dtype, checkpoint):
        return cls(config, device, dtype)

    def ar_diffusion_kv_cache_spec(self):
        return self.config.kv_cache_spec()

    @contextlib.contextmanager
    def bind_ar_diffusion_state(self, session_id, state):
        self.state = state
        try:
            yield
        finally:
            self.state = None

    def reset_ar_diffusion_session(self, session_id):
        self.counters.pop(session_id, None)

    def close_ar_diffusion_session(self, session_id):
        self.counters.pop(session_id, None)

    def export_ar_diffusion_session(self, session_id):
        return {"counter": self.counters.get(session_id, 0)}

    def import_ar_diffusion_session(self, session_id, snapshot):
        self.counters[session_id] = snapshot["counter"]

    def ar_diffusion_warmup_requests(self, session_id):
        for i in range(2):
            yield ARDiffusionRequest(f"warm{i}", {"state": np.zeros(6, np.float32), "prompt": "warm"},
                                     {"session_id": session_id})

    def _pass(self, x, branch, commit):  # x (L, dim)
        c, state = self.config, self.state
        for qkv, ctx, (ck, cv) in zip(self.qkv, state.get_kv_caches(branch, x.shape[0], commit_current=commit),
                                      state.cross_attention(branch, "text")):
            q, k, v = (x @ qkv).view(x.shape[0], 3, c.num_heads, c.head_size).permute(1, 2, 0, 3)  # (H, L, D)
            x = x + ctx.attend(q.contiguous(), k.contiguous(), v.contiguous()).transpose(0, 1).flatten(1)
            x = x + torch.nn.functional.scaled_dot_product_attention(q, ck, cv).transpose(0, 1).flatten(1)
        if commit:
            state.commit(branch)
        return x

    @torch.inference_mode()
    def forward(self, request):
        c, sid = self.config, request.session_id
        for branch in ("cond", "uncond"):
            if not self.state.has_cross_attention(branch, "text"):
                ids = list(request.inputs["prompt"].encode()[:c.text_tokens]) if branch == "cond" else []
                ids = torch.tensor(ids + [0] * (c.text_tokens - len(ids)), device=self.device)
                kv = self.text[ids].view(c.text_tokens, c.num_heads, c.head_size).transpose(0, 1).contiguous()
                self.state.populate_cross_attention(branch, "text", [(kv, kv)] * c.num_layers)
        x = self.noise(sid, (c.tokens_per_frame, c.num_heads * c.head_size))
        obs = torch.as_tensor(request.inputs["state"]).to(self.device, self.dtype)  # (6,)
        x = x.to(self.device, self.dtype) + obs @ self.embed
        cond, uncond = self._pass(x, "cond", False), self._pass(x, "uncond", False)
        x = uncond + 2.0 * (cond - uncond)
        for branch in ("cond", "uncond"):
            self._pass(x, branch, True)
        self.counters[sid] = self.counters.get(sid, 0) + 1
        return {"frame": x.float().cpu().numpy()}

    def noise(self, sid, shape):  # seeded by the session and its request counter, which the export holds
        gen = torch.Generator().manual_seed(zlib.crc32(sid.encode()) * 1000 + self.counters.get(sid, 0))
        return torch.randn(shape, generator=gen, dtype=torch.float32)


class PlainFromConfig(LabPipeline):
    def from_config(self, config, *, device, dtype, checkpoint):  # no @classmethod
        return LabPipeline(config, device, dtype)


class NeverCommits(LabPipeline):
    def _pass(self, x, branch, commit):  # every pass a denoising one: no block becomes history
        return super()._pass(x, branch, False)


class PlainSchema(LabPipeline):
    def observation_schema(self):  # no @staticmethod
        return _schema()


def _build(config, *, device, dtype):  # no checkpoint keyword: called on the class, a plain function is right
    return LabPipeline(config, device, dtype)


class FactoryFromConfig(LabPipeline):
    from_config = _build


class CommitsNextRequest(LabPipeline):
    """DreamZero's way: a request's block becomes history at the start of the next request of its session."""

    def __init__(self, *args):
        super().__init__(*args)
        self.held, self.sid = {}, None

    def ar_diffusion_warmup_requests(self, session_id):  # then a fresh episode: its block is never committed
        yield from super().ar_diffusion_warmup_requests(session_id)
        yield ARDiffusionRequest("fresh", {"state": np.zeros(6, np.float32), "prompt": "warm"},
                                 {"session_id": session_id, "reset": True})

    def reset_ar_diffusion_session(self, session_id):
        self.held.pop(session_id, None)
        super().reset_ar_diffusion_session(session_id)

    def close_ar_diffusion_session(self, session_id):
        self.held.pop(session_id, None)
        super().close_ar_diffusion_session(session_id)

    def export_ar_diffusion_session(self, session_id):  # the block it holds is the session's state too
        held = self.held.get(session_id)
        return {**super().export_ar_diffusion_session(session_id), "held": None if held is None else held.cpu()}

    def import_ar_diffusion_session(self, session_id, snapshot):
        if snapshot["held"] is not None:
            self.held[session_id] = snapshot["held"].to(self.device)
        super().import_ar_diffusion_session(session_id, snapshot)

    @torch.inference_mode()
    def forward(self, request):
        self.sid = request.session_id
        held = self.held.pop(self.sid, None)
        if held is not None:
            for branch in ("cond", "uncond"):
                super()._pass(held, branch, True)
        return super().forward(request)

    def _pass(self, x, branch, commit):
        if commit:  # the block is committed at the start of the next request
            self.held[self.sid] = x
            return x
        return super()._pass(x, branch, False)


class ReadsObs(LabPipeline):
    def forward(self, request):  # the schema (and its warmup requests) name the input 'state'
        request.inputs["obs"]
        return super().forward(request)


class ReadsObsThroughSelf(LabPipeline):
    def forward(self, request):  # the request kept on the pipeline, for its helpers, and its inputs read there
        self.request = request
        self.request.inputs["obs"]
        return super().forward(request)


class ReadsBracketedKey(LabPipeline):
    def forward(self, request):  # a dataset's field name, brackets and all
        request.inputs[
            "cam[0]"]
        return super().forward(request)


class OwnBracketedKeyError(LabPipeline):
    def forward(self, request):  # the model's own table, under keys with brackets, beside the request it keeps
        self.request, self.table = request, {"blocks[0]": 0}
        return self.table["blocks[9]"]


class OwnKeyError(LabPipeline):
    def forward(self, request):  # a KeyError of the model's own, not of the request's inputs
        return self._weight("blocks.9")

    def _weight(self, name):
        return {"blocks.0": 0}[name]


class KeepsFrames(LabPipeline):
    """Keeps every frame a session made, a tensor growing by 256 bytes a request, and exports it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.kept = {}

    def reset_ar_diffusion_session(self, session_id):
        self.kept.pop(session_id, None)
        super().reset_ar_diffusion_session(session_id)

    def close_ar_diffusion_session(self, session_id):
        self.kept.pop(session_id, None)
        super().close_ar_diffusion_session(session_id)

    def forward(self, request):
        out = super().forward(request)
        frame = torch.as_tensor(out["frame"])  # (4, 16) float32
        self.kept[request.session_id] = torch.cat([self.kept.get(request.session_id, frame[:0]), frame])
        return out

    def export_ar_diffusion_session(self, session_id):
        return {**super().export_ar_diffusion_session(session_id), "frames": self.kept[session_id]}

    def import_ar_diffusion_session(self, session_id, snapshot):
        self.kept[session_id] = snapshot["frames"]
        super().import_ar_diffusion_session(session_id, snapshot)


class OwnKeyErrorInForward(LabPipeline):
    def forward(self, request):  # the model's own lookups, in the forward itself: not the request's inputs
        if request.request_id.startswith("warm"):
            return {"blocks.0": 0}["blocks.9"]
        return super().forward(request) if request.extra_args["camera"] else None


class GlobalNoise(LabPipeline):
    def noise(self, sid, shape):  # torch's global generator: another draw each time, whatever the session
        return torch.randn(shape, dtype=torch.float32)


class CountsOnItself(LabPipeline):
    drawn = 0  # draws made, on the pipeline, not in the session its export gives

    def noise(self, sid, shape):
        self.drawn += 1
        return torch.randn(shape, generator=torch.Generator().manual_seed(self.drawn), dtype=torch.float32)


class TupleInExport(LabPipeline):
    def export_ar_diffusion_session(self, session_id):
        return {**super().export_ar_diffusion_session(session_id), "grid": (2, 2)}  # JSON gives a list back


class WarmupWrongShape(LabPipeline):
    def ar_diffusion_warmup_requests(self, session_id):  # a state of 4 values, the schema's is (6,)
        for i in range(2):
            yield ARDiffusionRequest(f"warm{i}", {"state": np.zeros(4, np.float32), "prompt": "warm"},
                                     {"session_id": session_id})


class WarmupWrongDtype(LabPipeline):
    def ar_diffusion_warmup_requests(self, session_id):  # integers where the schema says float32: ran silently
        for i in range(2):
            yield ARDiffusionRequest(f"warm{i}", {"state": np.zeros(6, np.int64), "prompt": "warm"},
                                     {"session_id": session_id})


class WarmupNoPrompt(LabPipeline):
    def ar_diffusion_warmup_requests(self, session_id):
        yield ARDiffusionRequest("warm0", {"state": np.zeros(6, np.float32), "seed": 3}, {"session_id": session_id})

    def forward(self, request):
        return super().forward(dataclasses.replace(request, inputs={**request.inputs, "prompt": ""}))


class WarmupTwoPrompts(LabPipeline):
    observation_schema = staticmethod(lambda: ObservationSchema(fields=_schema().fields,
                                                                prompt_aliases=("language_instruction",)))

    def ar_diffusion_warmup_requests(self, session_id):  # two tasks: which one would it warm up?
        yield ARDiffusionRequest("warm0", {"state": np.zeros(6, np.float32), "prompt": "pick",
                                           "language_instruction": "place"}, {"session_id": session_id})


class RecordsInputs(LabPipeline):
    """Its schema takes DROID's keys too, and its warmup gives them, in float64, as a recorder might: one inputs
    mapping, given to each request. Its forward logs what it is given, and what that mapping holds then."""

    observation_schema = staticmethod(lambda: ObservationSchema(
        fields=(ObservationField("state", "float32", ((6,),), aliases=("observation/state",)),),
        prompt_aliases=("language_instruction",)))

    def ar_diffusion_warmup_requests(self, session_id):
        self.given = {"observation/state": np.zeros(6), "language_instruction": "warm", "seed": 3}
        yield ARDiffusionRequest("warm0", self.given, {"session_id": session_id})
        yield ARDiffusionRequest("warm1", self.given, {"session_id": session_id})
        yield ARDiffusionRequest("warm2", {"state": np.zeros(6), "prompt": "warm", "language_instruction": "warm",
                                           "seed": 3}, {"session_id": session_id})

    def forward(self, request):
        def kinds(inputs):
            return {key: [type(v).__name__, str(getattr(v, "dtype", ""))] for key, v in inputs.items()}

        with open(os.environ["LAB_INPUTS"], "a") as log:
            given = kinds(self.given) if request.request_id.startswith("warm") else None
            log.write(json.dumps([request.request_id, kinds(request.inputs), given]) + "\\n")
        return super().forward(request)


class WarmupInputsNone(LabPipeline):
    def ar_diffusion_warmup_requests(self, session_id):  # inputs left out: no mapping to check
        yield ARDiffusionRequest("warm0", None, {"session_id": session_id})


class ClosesBadly(LabPipeline):
    def close_ar_diffusion_session(self, session_id):  # its cleanup reads a table it never filled
        super().close_ar_diffusion_session(session_id)
        raise KeyError(f"frames of {session_id}")


class DivergesThenClosesBadly(ClosesBadly):
    def forward(self, request):  # its second warmup request diverges: every value infinite, its session open
        output = super().forward(request)
        return output if request.request_id == "warm0" else {name: value / 0 for name, value in output.items()}


class PassThrough(LabPipeline):
    def forward(self, *args, **kwargs):  # a wrapper that hands on whatever it is given
        return super().forward(*args, **kwargs)

    def close_ar_diffusion_session(self, *args, **kwargs):
        super().close_ar_diffusion_session(*args, **kwargs)


class PassThroughToNothing(LabPipeline):
    def forward(self, *args, **kwargs):  # hands the request on to a step that takes none
        return self.step(*args, **kwargs)

    def step(self):
        return {}


class PassThroughToNothingUnwarmed(PassThroughToNothing):
    ar_diffusion_warmup_requests = None  # no warmup: a rollout's first step is its first call


def _seeded_any(forward):  # a decorator that hands on whatever it is given, and a seed of its own
    @functools.wraps(forward)
    def seeded(self, *args, **kwargs):
        return forward(self, *args, seed=0, **kwargs)
    return seeded


class SeededPassThrough(LabPipeline):
    @_seeded_any
    def forward(self, request, seed):
        return super().forward(request)


class _Unbound:  # a decorator that is a class with no __get__: what it wraps is called with no self
    def __init__(self, method):
        functools.update_wrapper(self, method)

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)


class _Bound(_Unbound):  # bound to the instance it is read from, as a function is
    def __get__(self, instance, owner=None):
        return self if instance is None else functools.partial(self, instance)


class UnboundForward(LabPipeline):
    @_Unbound
    def forward(self, request):
        return LabPipeline.forward(self, request)


class UnboundClose(LabPipeline):
    @_Unbound
    def close_ar_diffusion_session(self, session_id):
        LabPipeline.close_ar_diffusion_session(self, session_id)


class BoundForward(LabPipeline):
    @_Bound
    def forward(self, request):
        return LabPipeline.forward(self, request)


class InferenceModeWithoutRequest(LabPipeline):
    @torch.inference_mode()  # a decorator that hands on what it is given: the forward takes no request
    def forward(self):
        return {}


class OutputOnMeta(LabPipeline):
    def forward(self, request):  # an output left on the meta device: no values to write
        return {**super().forward(request), "actions": torch.zeros(2, 4, device="meta")}


class KeepsState(LabPipeline):
    """Keeps the state of its first session and uses it in every forward: another session's, outside its request."""

    @contextlib.contextmanager
    def bind_ar_diffusion_state(self, session_id, state):
        self.state = self.__dict__.setdefault("first", state)
        yield


class MisnamesCache(LabPipeline):
    def forward(self, request):  # the spec's cache is 'text'
        self.state.cross_attention("cond", "txt")
        return super().forward(request)


class Warns(LabPipeline):
    def forward(self, request):  # its own warning, one from a thread of its own, torch's deprecation
        warnings.warn("lab: the forward warns")
        thread = threading.Thread(target=lambda: warnings.warn("lab: its thread warns", RuntimeWarning))
        thread.start()
        thread.join()
        torch.range(0, 1)
        return super().forward(request)


class WarnsEachTime(LabPipeline):
    def forward(self, request):  # a text of its own each time, which Python's default filter shows each time
        for i in range(300):
            warnings.warn(f"lab: {request.request_id}: clamped {i} values")
        return super().forward(request)


def _seeded(forward):  # the lab's own decorator: it gives the forward the seed it takes
    @functools.wraps(forward)
    def seeded(self, request):
        return forward(self, request, 0)
    return seeded


class SeededForward(LabPipeline):
    @_seeded
    def forward(self, request, seed):
        return super().forward(request)


class _Closer:
    def __call__(self):  # takes no session id
        pass


class CallableCloser(LabPipeline):
    close_ar_diffusion_session = _Closer()


class CachedCloser(LabPipeline):
    @functools.lru_cache  # a wrapper in C: the function it wraps has the signature
    def close_ar_diffusion_session(self):  # takes no session id
        pass


class CheckFlag(LabPipeline):
    check_ar_diffusion_request = True  # meant as "check my requests": ardiff calls it with each request


class ClosesItsWarmupSession(LabPipeline):
    def ar_diffusion_warmup_requests(self, session_id):  # its last request ends the episode, as a rollout's does
        *requests, last = super().ar_diffusion_warmup_requests(session_id)
        yield from requests
        yield ARDiffusionRequest(last.request_id, last.inputs, {**last.extra_args, "close_session": True})

    def close_ar_diffusion_session(self, session_id):
        super().close_ar_diffusion_session(session_id)
        raise TypeError("close() takes 1 positional argument but 2 were given")


class ClosesEachWarmupSessionBadly(LabPipeline):
    def ar_diffusion_warmup_requests(self, session_id):  # each request ends its episode: two closes of the session
        for request in super().ar_diffusion_warmup_requests(session_id):
            yield ARDiffusionRequest(request.request_id, request.inputs, {**request.extra_args, "close_session": True})

    def close_ar_diffusion_session(self, session_id):  # its cleanup reads a table it never filled
        super().close_ar_diffusion_session(session_id)
        self.closes = getattr(self, "closes", 0) + 1
        raise KeyError(f"close {self.closes} of {session_id}")


class WarmupRequest(ARDiffusionRequest):  # the lab's own request type, with a constructor of its own
    def __init__(self, request_id, state, session_id):
        super().__init__(request_id, {"state": state, "prompt": "warm"}, {"session_id": session_id})


class WarmupOwnRequests(LabPipeline):
    def ar_diffusion_warmup_requests(self, session_id):
        yield WarmupRequest("warm0", np.zeros(6), session_id)

    def forward(self, request):
        assert isinstance(request, WarmupRequest) == request.request_id.startswith("warm"), type(request)
        return super().forward(request)


class SlowWarmup(LabPipeline):
    def ar_diffusion_warmup_requests(self, session_id):
        for i in range(40):
            yield ARDiffusionRequest(f"warm{i}", {"state": np.zeros(6, np.float32), "prompt": "warm"},
                                     {"session_id": session_id})

    def forward(self, request):  # each request logged; warm1 waits for the file LAB_LEFT (the reader has gone)
        left = os.environ.get("LAB_LEFT")
        deadline = time.monotonic() + 300  # a bound on a hang, not a timing
        while request.request_id == "warm1" and left and not os.path.exists(left) and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(os.environ["LAB_FORWARDS"], "a") as log:
            log.write(request.request_id + "\\n")
        return super().forward(request)
'''


@pytest.fixture(scope="module")
def lab(cli_env, tmp_path_factory):
    """The package, its registration (lab_world = lab_world, and lab_world_class naming the class as console scripts
    are registered), a config and four episodes of six steps."""
    root = tmp_path_factory.mktemp("lab")
    (root / "lab_world").mkdir()
    (root / "lab_world" / "__init__.py").write_text(ENTRY)
    (root / "lab_world" / "model.py").write_text(MODEL)
    dist = root / "lab_world-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-world\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ardiff.pipelines]\nlab_world = lab_world\n"
                                           "lab_world_class = lab_world.model:LabPipeline\n")
    for name in ("lab_world", "lab_world_class"):
        (root / f"{name}.yaml").write_text(f"pipeline: {name}\nmodel: {{}}\n"
                                           "runtime: {device: cpu, num_threads: 1, session_capacity: 1}\n")
    (root / "lab_syntax.py").write_text("class LabPipeline(:\n    pass\n")  # modules whose import raises
    (root / "lab_needs.py").write_text("import lab_missing_dependency_xyz\n\n\nclass LabPipeline:\n    pass\n")
    (root / "unnamed.yaml").write_text("model: {}\nruntime: {device: cpu, num_threads: 1}\n")  # for --pipeline
    (root / "owned.yaml").write_text("model: {model_owned_bytes: 1024}\nruntime: {device: cpu, num_threads: 1}\n")
    rng = np.random.default_rng(0)
    for e in range(3):
        write_episode(root / "eps" / f"ep{e}", [{"state": rng.standard_normal(6).astype(np.float32)}
                                               for _ in range(4)], prompt=f"task {e}")
    env = {**cli_env, "PYTHONPATH": os.pathsep.join([str(root), cli_env["PYTHONPATH"]])}
    return root, env


def ardiff(lab, *args: str) -> subprocess.CompletedProcess:
    root, env = lab
    return subprocess.run([sys.executable, "-m", "ardiff_cli", *args, "--format", "plain"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def frames(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted((run / "episodes").rglob("*.safetensors"))}


def test_a_pipeline_written_from_the_readme_plans_warms_up_and_rolls_out_with_eviction(lab):
    root, _ = lab
    assert ardiff(lab, "inspect-capacity", "lab_world.yaml", "--available", "1GiB").returncode == 0
    warmup = ardiff(lab, "warmup", "lab_world.yaml")
    assert warmup.returncode == 0 and "KV pool restored" in warmup.stdout and "warning" not in warmup.stderr, \
        warmup.stderr
    swapped = ardiff(lab, "rollout", "lab_world.yaml", "eps", "-o", "rr")  # capacity 1: every step evicts one
    assert swapped.returncode == 0 and "restored from swap" in swapped.stdout + swapped.stderr, swapped.stderr
    alone = ardiff(lab, "rollout", "lab_world.yaml", "eps", "-o", "seq", "--order", "sequential",
                   "--session-capacity", "4")
    assert alone.returncode == 0, alone.stderr
    assert json.loads((root / "rr" / "summary.json").read_text())["exit_code"] == 0
    assert len(frames(root / "rr")) == 12 and frames(root / "rr") == frames(root / "seq")
    # the class itself, named on the command line, with a config that names no pipeline (README: "may be left out")
    named = ardiff(lab, "rollout", "unnamed.yaml", "eps", "-o", "named", "--pipeline", "lab_world.model:LabPipeline")
    assert named.returncode == 0 and frames(root / "named") == frames(root / "seq"), named.stderr


def test_an_entry_point_that_names_an_object_says_an_entry_point_names_a_module(lab):
    """`lab_world_class = "lab_world.model:LabPipeline"` (how console scripts are registered) was "cannot import
    'lab_world.model:LabPipeline': No module named ...", hint "is the package installed?": it is."""
    for command in (["warmup"], ["inspect-capacity"]):
        proc = ardiff(lab, *command, "lab_world_class.yaml")
        assert proc.returncode == 2, proc.stderr
        assert ("its entry point in group 'ardiff.pipelines' is 'lab_world.model:LabPipeline', an object "
                "('LabPipeline' in module 'lab_world.model'); an ardiff.pipelines entry point names a module"
                in proc.stderr), proc.stderr
        assert "is the package installed" not in proc.stderr and "--pipeline lab_world.model:LabPipeline" in proc.stderr


@pytest.mark.parametrize(("name", "command", "attr", "fix"), [
    ("PlainFromConfig", "warmup", "from_config", "@classmethod, as"),
    # @staticmethod alone, which the hint said, left `def observation_schema(self)` failing as before
    ("PlainSchema", "rollout", "observation_schema",
     "@classmethod, or drop its first parameter and decorate it with @staticmethod, as"),
])
def test_a_method_ardiff_calls_on_the_class_written_without_its_decorator_is_named(lab, name, command, attr, fix):
    """`def from_config(self, ...)` or `def observation_schema(self)` on a --pipeline class: Python's "missing 1
    required positional argument" came with the hint about a Config raising ConfigError, or none at all."""
    args = ["eps", "-o", f"out_{name}"] if command == "rollout" else []
    proc = ardiff(lab, command, "unnamed.yaml", *args, "--pipeline", f"lab_world.model:{name}")
    assert proc.returncode == 1, proc.stderr
    assert (f"hint: {name}.{attr} is a plain method, but ardiff calls it on the class, with no instance: decorate "
            f"it with {fix}" in proc.stderr), proc.stderr
    assert "ConfigError" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_plain_function_whose_signature_is_wrong_is_not_told_to_take_a_decorator(lab):
    """`from_config = _build`, a module's function without the checkpoint keyword, was hinted "a plain method ...
    decorate it with @classmethod", which would have made its first argument the class; its own error is the one."""
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:FactoryFromConfig")
    assert proc.returncode == 1, proc.stderr
    assert "unexpected keyword argument 'checkpoint'" in proc.stderr and "plain method" not in proc.stderr, \
        proc.stderr


def test_a_decorated_forward_that_takes_the_request_loads_and_runs(lab):
    """A functools.wraps decorator that gives the forward an argument of its own (`seeded(self, request)` wrapping
    `forward(self, request, seed)`) was refused at load: the check read the wrapped function's signature, and
    "missing a required argument: 'seed'" refused a forward that takes exactly what ardiff passes."""
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:SeededForward")
    assert proc.returncode == 0 and "KV pool restored" in proc.stdout, proc.stderr


@pytest.mark.parametrize(("name", "defined"), [("CallableCloser", "    def __call__(self):  # takes no session id"),
                                              # a decorated function's line is its first decorator's
                                              ("CachedCloser", "    @functools.lru_cache  # a wrapper in C: the "
                                                               "function it wraps has the signature")])
def test_a_callable_object_of_another_signature_is_refused_naming_where_its_call_is_defined(lab, name, defined):
    """`close_ar_diffusion_session = _Closer()`, an object whose `__call__(self)` takes no session id, was named
    "(defined in native code)": it is Python, defined in the lab's model.py. A method under functools.lru_cache (a
    wrapper in C, which has no signature of its own) is judged by the function it wraps."""
    line = MODEL.splitlines().index(defined) + 1
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", f"lab_world.model:{name}")
    assert proc.returncode == 1, proc.stderr
    assert (f"Error: {name}.close_ar_diffusion_session() ({os.path.join('lab_world', 'model.py')}:{line}) "
            "cannot take the arguments ardiff passes it" in proc.stderr), proc.stderr
    assert "native code" not in proc.stderr and "Traceback" not in proc.stderr


def test_an_optional_capability_method_that_is_no_callable_is_refused_at_load(lab):
    """`check_ar_diffusion_request = True` loaded, and warmup or the first step failed: 'bool' object is not
    callable. It is refused as a capability method of another signature is, before any request."""
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:CheckFlag")
    assert proc.returncode == 1, proc.stderr
    assert ("Error: CheckFlag.check_ar_diffusion_request is True (bool), not a method: ardiff calls it as "
            "check_ar_diffusion_request(request)\nhint: define it as `def check_ar_diffusion_request(self, request)`, "
            "or leave it out" in proc.stderr), proc.stderr
    assert "warm0" not in proc.stderr and "not callable" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("command", [["warmup"], ["rollout", "eps", "-o", "closes_its_warmup_session"]])
def test_a_close_hook_that_fails_as_a_warmup_request_closes_its_session_fails_the_warmup(lab, command):
    """The warmup session's close hook failing as warmup releases the session is a pipeline error (exit 1): so it
    was at warmup's end, but a last request with close_session=True released it in the request, and the hook's
    error was an event line only: `ardiff warmup` said the pool was restored and exited 0. Its kind is the one of the
    pipeline's other failures, `pipeline_error` (it was `error`, ardiff's "another of ardiff's errors"), in a
    rollout's warmup too."""
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *command[:1], "unnamed.yaml", *command[1:],
                           "--pipeline", "lab_world.model:ClosesItsWarmupSession", "--format", "json"], cwd=lab[0],
                          env=lab[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    error = json.loads(proc.stdout.splitlines()[-1])
    assert (error["kind"], error["exit_code"]) == ("pipeline_error", 1) and error["message"] == (
        "ClosesItsWarmupSession.close_ar_diffusion_session('__ardiff_warmup__') raised TypeError: close() takes 1 "
        "positional argument but 2 were given; the session's KV was released"), error


@pytest.mark.parametrize("command", [["warmup"], ["rollout", "eps", "-o", "closes_each_warmup_session"]])
def test_every_close_hook_that_fails_in_a_warmup_reaches_the_user_the_first_as_the_error_the_others_its_notes(lab,
                                                                                                          command):
    """Each warmup request closes its session, and each close hook fails: the warmup raised the first failure alone,
    and the second was an event line only. The others are the raised error's notes (`  note:` lines after its Error
    line, JSON's `notes`), in `ardiff warmup` and in a rollout's warmup."""
    root, env = lab
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", *command[:1], "unnamed.yaml", *command[1:],
                           "--pipeline", "lab_world.model:ClosesEachWarmupSessionBadly", "--format", "json"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    failed = [f"ClosesEachWarmupSessionBadly.close_ar_diffusion_session('__ardiff_warmup__') raised KeyError: 'close "
              f"{n} of __ardiff_warmup__'; the session's KV was released" for n in (1, 2)]
    error = json.loads(proc.stdout.splitlines()[-1])
    assert (error["kind"], error["message"], error["notes"]) == ("pipeline_error", failed[0], failed[1:]), error
    assert f"Error: {failed[0]}\n  note: {failed[1]}\nhint: " in proc.stderr, proc.stderr


def test_a_close_hook_that_fails_after_a_failed_warmup_request_is_a_note_on_the_requests_error(lab):
    """A warmup request that fails (its outputs infinite) leaves the warmup session open; the close hook that fails
    as warmup then releases it was dropped without a word: the request's error is the one reported, the hook's its
    note (the traceback --verbose prints ends with it), as with a failed forward's. The note is a `note:` line after
    the Error line without --verbose too (it showed only in the traceback), and in JSON's error object `notes`."""
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:DivergesThenClosesBadly", "--verbose")
    assert proc.returncode == 1, proc.stderr
    failed = ("warmup request 'warm1' of DivergesThenClosesBadly: DivergesThenClosesBadly.forward() returned "
              "non-finite values: 'frame': 64 inf of 64 values")
    note = ("DivergesThenClosesBadly.close_ar_diffusion_session('__ardiff_warmup__') raised KeyError: 'frames of "
            "__ardiff_warmup__'; the session's KV was released")
    assert f"ardiff_cli.runtime.errors.PipelineError: {failed}\n{note}\nError: {failed}\n  note: {note}\nhint: " in (
        proc.stderr), proc.stderr
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:DivergesThenClosesBadly")
    assert proc.returncode == 1 and f"Error: {failed}\n  note: {note}\nhint: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    root, env = lab
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", "unnamed.yaml", "--pipeline",
                           "lab_world.model:DivergesThenClosesBadly", "--format", "json"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    error = json.loads(proc.stdout.splitlines()[-1])
    assert (error["kind"], error["message"], error["notes"]) == ("pipeline_error", failed, [note]), error


@pytest.mark.parametrize("name", ["PassThrough", "SeededPassThrough"])
def test_a_pass_through_method_taking_args_and_kwargs_loads_and_runs(lab, name):
    """`def forward(self, *args, **kwargs)` takes whatever ardiff passes: the check takes it as able to. A wraps
    decorator's wrapper written so, which hands its arguments on with one of its own (`seed=0`), was refused at
    load: "missing a required argument: 'seed'", judged by the function it wraps as if given nothing more."""
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", f"lab_world.model:{name}")
    assert proc.returncode == 0 and "KV pool restored" in proc.stdout, proc.stderr


def test_a_pass_through_to_code_that_cannot_take_the_request_is_a_pipeline_error_at_its_first_call(lab):
    """A pass-through loads (the check cannot see where it hands its arguments); the code that cannot take them fails
    at the first request, warmup's: the pipeline's error, naming the request and what Python said."""
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", "unnamed.yaml", "--pipeline",
                           "lab_world.model:PassThroughToNothing", "--format", "json"], cwd=lab[0], env=lab[1],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    error = json.loads(proc.stdout.splitlines()[-1])
    assert (error["kind"], error["exit_code"]) == ("pipeline_error", 1), error
    assert error["message"] == ("warmup request 'warm0' of PassThroughToNothing failed: TypeError: "
                                "PassThroughToNothing.step() takes 1 positional argument but 2 were given"), error


def test_a_pass_through_to_code_that_cannot_take_the_request_fails_the_episodes_of_a_rollout_without_warmup(lab):
    """README: what a pass-through hands on fails where it is first called, as the pipeline's code there does. With
    no warmup requests, that is a rollout's first step: each episode fails at it, naming what Python said, and the
    run is episodes_failed, not a pipeline_error (the README said "a pipeline_error" of every first call)."""
    root, env = lab
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "unnamed.yaml", "eps", "-o",
                           "passes_to_nothing", "--pipeline", "lab_world.model:PassThroughToNothingUnwarmed",
                           "--format", "json"], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    error = json.loads(proc.stdout.splitlines()[-1])
    assert (error["kind"], error["exit_code"]) == ("episodes_failed", 1), error
    lines = [json.loads(line) for line in (root / "passes_to_nothing" / "results.jsonl").read_text().splitlines()]
    assert {(line["episode"], line["step"], line["phase"], line["error_type"]) for line in lines} == {
        (f"ep{e}", 0, "forward", "TypeError") for e in range(3)}, lines
    assert all("PassThroughToNothing.step() takes 1 positional argument but 2 were given" in line["error"]
               for line in lines), lines


@pytest.mark.parametrize(("name", "method", "argument"), [("UnboundForward", "forward", "request"),
                                                         ("UnboundClose", "close_ar_diffusion_session", "session_id")])
def test_a_decorator_class_that_is_not_bound_to_the_pipeline_is_refused_at_load(lab, name, method, argument):
    """A decorator that is a class with __call__ and no __get__ is never bound: the method it wraps gets no self, and
    ardiff's argument in its place. Refused at load, as before pass-throughs were judged by what they may add: the
    first warmup request failed "missing 1 required positional argument", and a close hook, in a rollout without
    warmup, failed as a warning at every session's end."""
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", "unnamed.yaml", "--pipeline",
                           f"lab_world.model:{name}", "--format", "json"], cwd=lab[0], env=lab[1],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    error = json.loads(proc.stdout.splitlines()[-1])
    assert (error["kind"], error["exit_code"]) == ("pipeline_error", 1), error
    assert re.fullmatch(rf"{name}\.{method}\(\) \(lab_world/model\.py:\d+\) cannot take the arguments ardiff passes "
                        rf"it: its decorator, a _Unbound, is not bound to the pipeline as a method is \(its class "
                        rf"defines no __get__\), so it hands {method}\(self, {argument}\) no self, and {argument} in "
                        "its place",
                        error["message"]), error
    assert error["hint"].startswith("give _Unbound a __get__ that binds it"), error
    assert "warm0" not in proc.stderr, proc.stderr


def test_a_decorator_class_bound_to_the_pipeline_loads_and_runs(lab):
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:BoundForward")
    assert proc.returncode == 0 and "KV pool restored" in proc.stdout, proc.stderr


def test_a_decorator_handing_on_more_arguments_than_the_method_takes_is_refused_at_load(lab):
    """torch.inference_mode() hands on what it is given: its wrapper takes *args, the forward under it no request.
    Judged by the function it wraps, it is refused at load, not at the first request."""
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:InferenceModeWithoutRequest")
    assert proc.returncode == 1, proc.stderr
    assert ("cannot take the arguments ardiff passes it: expected forward(request), got forward(): too many "
            "positional arguments" in proc.stderr), proc.stderr
    assert "warm0" not in proc.stderr, proc.stderr


def test_a_forward_that_never_commits_a_block_is_a_warmup_warning(lab):
    """A model whose passes all leave commit_current False ran every step on its own block, with no history and no
    word of it: the window it declared was memory spent on nothing."""
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:NeverCommits")
    assert proc.returncode == 0, proc.stderr
    assert ("warning: NeverCommits: its 2 warmup requests committed no frame to the KV cache: if its forwards never "
            "commit, its sessions keep no history" in proc.stderr), proc.stderr


def test_a_warmup_whose_last_request_starts_afresh_is_no_warning_for_a_pipeline_that_commits_on_the_next_request(lab):
    """The warmup session was looked at once, after the last request: one that reset it (a fresh episode) left no
    committed frame in a pipeline that commits a block at the start of the next request, as DreamZero does, and a
    pipeline that keeps its history was told it keeps none."""
    proc = ardiff(lab, "warmup", "owned.yaml", "--pipeline", "lab_world.model:CommitsNextRequest")  # it exports
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr  # its held block: 256 bytes declared


def test_a_forward_reading_an_input_its_request_does_not_hold_is_named_as_such(lab):
    """`request.inputs["obs"]` where the schema says `state`: warmup and every step failed with a bare
    `KeyError: 'obs'`, which reads as a bug in ardiff, not as the schema and the forward disagreeing."""
    root, _ = lab
    said = ("ReadsObs.forward() raised KeyError: 'obs': the forward read input 'obs', which the inputs of "
            "{request} do not hold (their keys: 'state', 'prompt')")
    hint = "the pipeline's observation_schema and ReadsObs.forward() disagree on the input's name"
    warmup = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:ReadsObs")
    assert warmup.returncode == 1, warmup.stderr
    assert "Error: " + said.format(request="warmup request 'warm0'") in warmup.stderr, warmup.stderr
    assert f"hint: {hint}" in warmup.stderr, warmup.stderr
    # not any KeyError: one of the model's own lookups (a missing weight) stays what it is
    own = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:OwnKeyError")
    assert "Error: warmup request 'warm0' of OwnKeyError failed: KeyError: 'blocks.9'" in own.stderr, own.stderr
    assert own.returncode == 1 and "observation_schema" not in own.stderr, own.stderr
    # nor one in the forward itself, of a table of its own or of the request's extra_args: it was said to be an input
    own = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:OwnKeyErrorInForward")
    assert "Error: warmup request 'warm0' of OwnKeyErrorInForward failed: KeyError: 'blocks.9'" in own.stderr, \
        own.stderr
    assert own.returncode == 1 and "observation_schema" not in own.stderr, own.stderr
    own = ardiff(lab, "rollout", "unnamed.yaml", "eps/ep0", "-o", "out_own", "--no-warmup", "--pipeline",
                 "lab_world.model:OwnKeyErrorInForward")
    assert own.returncode == 1 and "observation_schema" not in own.stderr and "KeyError: 'camera'" in own.stderr, \
        own.stderr
    rollout = ardiff(lab, "rollout", "unnamed.yaml", "eps/ep0", "-o", "out_obs", "--no-warmup", "--pipeline",
                     "lab_world.model:ReadsObs")
    assert rollout.returncode == 1, rollout.stderr
    (failed,) = [json.loads(line) for line in (root / "out_obs" / "results.jsonl").read_text().splitlines()]
    assert failed["status"] == "failed" and failed["phase"] == "forward", failed
    assert failed["error"] == ("episode 'ep0' failed at step 0 in the model's forward: "
                               + said.format(request="request 'ep0/000000'")), failed


@pytest.mark.parametrize(("pipeline", "key"), [("ReadsObsThroughSelf", "obs"), ("ReadsBracketedKey", "cam[0]")])
def test_an_input_read_through_the_pipelines_attribute_or_under_a_bracketed_key_is_named_as_missing(lab, pipeline,
                                                                                                    key):
    """`self.request.inputs["obs"]`, and `request.inputs["cam[0]"]` (a key holding a bracket, written over two lines),
    failed with a bare `KeyError`: only `request.inputs[...]` and a local holding the inputs were recognised."""
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", f"lab_world.model:{pipeline}")
    assert proc.returncode == 1, proc.stderr
    assert (f"Error: {pipeline}.forward() raised KeyError: {key!r}: the forward read input {key!r}, which the inputs "
            "of warmup request 'warm0' do not hold (their keys: 'state', 'prompt')") in proc.stderr, proc.stderr
    assert f"hint: the pipeline's observation_schema and {pipeline}.forward() disagree" in proc.stderr, proc.stderr
    # the model's own table, under a bracketed key, in a forward that keeps the request: its KeyError stays its own
    own = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:OwnBracketedKeyError")
    assert "Error: warmup request 'warm0' of OwnBracketedKeyError failed: KeyError: 'blocks[9]'" in own.stderr, \
        own.stderr
    assert own.returncode == 1 and "observation_schema" not in own.stderr, own.stderr


def leave_after_a_warmup_request(args: list[str], root, env) -> tuple[subprocess.Popen, str]:
    """``ardiff ARGS --format json`` whose stdout's reader goes away at its first request_finished line, mid-warmup:
    the finished process and its stderr. SlowWarmup's second request waits for the file ``env["LAB_LEFT"]``, made
    once the reader has gone: a reader slower than the 40 requests (a loaded machine) saw them all run, exit 0."""
    proc = subprocess.Popen([sys.executable, "-m", "ardiff_cli", *args, "--format", "json"], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while json.loads(proc.stdout.readline())["kind"] != "request_finished":
            pass
        proc.stdout.close()
        Path(env["LAB_LEFT"]).touch()
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return proc, stderr


def test_a_reader_that_leaves_stops_warmup_like_sigpipe_as_it_stops_a_rollout(lab, tmp_path):
    """`ardiff warmup --format json | head -1` ran every warmup request after head had gone, then exited 0: under
    `set -o pipefail` the pipeline succeeded, where the same with `rollout` exits 141."""
    root, env = lab
    log = tmp_path / "forwards"
    proc, stderr = leave_after_a_warmup_request(
        ["warmup", "unnamed.yaml", "--pipeline", "lab_world.model:SlowWarmup"], root,
        {**env, "LAB_FORWARDS": str(log), "LAB_LEFT": str(tmp_path / "left")})
    assert proc.returncode == 141, stderr  # 128 + SIGPIPE
    assert "Error: interrupted by SIGPIPE" in stderr and "Traceback" not in stderr, stderr
    assert "hint: warmup keeps nothing: run the same command again" in stderr, stderr
    assert len(log.read_text().splitlines()) < 40  # it stopped at the end of a request, not after all 40


def test_a_reader_that_leaves_during_a_rollouts_warmup_stops_it_there_and_resume_finishes_the_run(lab, tmp_path):
    """`ardiff rollout --format json | head -3`: rollout's own warmup writes its request_finished lines to stdout,
    and a reader gone half way through was acted on only once every warmup request had run (minutes of a 14B
    model's). It stops at the end of the request in flight now, as `ardiff warmup` does: exit 141, with the run's
    run.json written, and --resume gives the outputs of a run never stopped."""
    root, env = lab
    log = tmp_path / "forwards"
    env = {**env, "LAB_FORWARDS": str(log), "LAB_LEFT": str(tmp_path / "left")}
    args = [sys.executable, "-m", "ardiff_cli", "rollout", "unnamed.yaml", "eps/ep0", "--pipeline",
            "lab_world.model:SlowWarmup"]
    run = tmp_path / "run"
    proc, stderr = leave_after_a_warmup_request([*args[3:], "-o", str(run)], root, env)
    assert proc.returncode == 141, stderr  # 128 + SIGPIPE
    assert "Error: interrupted by SIGPIPE" in stderr and "Traceback" not in stderr, stderr
    assert "--resume" in stderr, stderr
    assert len(log.read_text().splitlines()) < 40  # it stopped at the end of a warmup request, not after all 40
    assert (run / "run.json").is_file() and (run / "results.jsonl").read_text() == ""  # no step ran
    resumed = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "--resume", "-o", str(run), "--pipeline",
                              "lab_world.model:SlowWarmup"], cwd=root, env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    whole = subprocess.run([*args, "-o", str(tmp_path / "whole")], cwd=root, env=env, capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0, whole.stderr
    assert len(frames(run)) == 4 and frames(run) == frames(tmp_path / "whole")


RERUN = "returned other outputs when run again on its session rebuilt from the session's export"


@pytest.mark.parametrize("name", ["GlobalNoise", "CountsOnItself"])
def test_a_forward_that_its_rebuilt_session_does_not_reproduce_is_one_warning_at_warmup(lab, name):
    """Noise from torch's global generator, or numbered by a counter on the pipeline that its export leaves out:
    every swapped, replayed or resumed session went on with other outputs than an uninterrupted one, and warmup and
    rollout said nothing of it."""
    warmup = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", f"lab_world.model:{name}")
    said = " ".join(warmup.stderr.split())
    assert warmup.returncode == 0 and warmup.stderr.count("warning:") == 1, warmup.stderr
    assert (f"warning: {name}: warmup request 'warm1' {RERUN}, as a swapped-out session is restored: 'frame' differs "
            "by up to ") in said, warmup.stderr
    assert ("(64 of 64 values); swapped-out and resumed sessions will not reproduce the run, nor will replayed ones "
            "(with no swap space, every evicted session is) if the forward's noise is what differs. Draw the "
            "forward's noise from a generator seeded from the request or its session") in said, warmup.stderr
    # a rollout's warmup runs the same check
    rollout = ardiff(lab, "rollout", "unnamed.yaml", "eps/ep0", "-o", f"out_{name}", "--pipeline",
                     f"lab_world.model:{name}")
    assert rollout.returncode == 0 and rollout.stderr.count(RERUN) == 1, rollout.stderr


def test_an_export_holding_a_value_no_snapshot_keeps_is_a_warning_at_warmup_not_first_at_an_eviction(lab):
    """A tuple in the export passed warmup, and the first eviction warned that it could not be swapped out."""
    root, _ = lab
    warmup = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:TupleInExport")
    said = " ".join(warmup.stderr.split())
    assert warmup.returncode == 0 and warmup.stderr.count("warning:") == 1, warmup.stderr
    assert ("warning: TupleInExport.export_ar_diffusion_session('__ardiff_warmup__')['grid'] is a tuple ((2, 2)), "
            "which JSON gives back as another type or not at all") in said, warmup.stderr
    assert "swapping its sessions out will fail alike" in said, warmup.stderr
    # every step evicts: the swap-outs fail alike, and are counted, not warned about again
    rollout = ardiff(lab, "rollout", "unnamed.yaml", "eps", "-o", "tuple", "--pipeline",
                     "lab_world.model:TupleInExport", "--session-capacity", "1")
    assert rollout.returncode == 0 and rollout.stderr.count("warning:") == 1, rollout.stderr
    assert "'grid'] is a tuple" in rollout.stderr and "cannot swap session" not in rollout.stderr, rollout.stderr
    assert json.loads((root / "tuple" / "summary.json").read_text())["swap"]["swap_failed"] > 0


UNDERCOUNTS = "the capacity plan undercounts"


def test_a_session_keeping_more_than_its_spec_declares_is_one_warning_at_warmup_naming_both_sizes(lab):
    """The plan counts model_owned_state_bytes_per_session for each session, and nothing checked it: a pipeline
    keeping more admitted sessions "within budget" that held more memory than planned, silently."""
    warmup = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:KeepsFrames")
    assert warmup.returncode == 0, warmup.stderr
    assert warmup.stderr.count("warning:") == 1 and warmup.stderr.count(UNDERCOUNTS) == 1, warmup.stderr
    assert ("KeepsFrames: a session keeps 256 B (256 bytes) of tensors outside the KV pools "
            "(KeepsFrames.export_ar_diffusion_session() when warming up), but its KV spec declares "
            "model_owned_state_bytes_per_session = 0 bytes") in " ".join(warmup.stderr.split()), warmup.stderr
    # a rollout that evicts to swap at every step: warned at its warmup, and not again at each swap-out
    rollout = ardiff(lab, "rollout", "unnamed.yaml", "eps", "-o", "kept", "--pipeline", "lab_world.model:KeepsFrames",
                     "--session-capacity", "1")
    assert rollout.returncode == 0 and "restored from swap" in rollout.stdout + rollout.stderr, rollout.stderr
    assert rollout.stderr.count(UNDERCOUNTS) == 1 and "when warming up" in rollout.stderr, rollout.stderr


def test_without_warmup_the_first_swap_out_that_exports_more_than_declared_warns_once(lab):
    proc = ardiff(lab, "rollout", "unnamed.yaml", "eps", "-o", "cold", "--pipeline", "lab_world.model:KeepsFrames",
                  "--session-capacity", "1", "--no-warmup")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(UNDERCOUNTS) == 1, proc.stderr
    assert "when swapping session 'ep0' out" in " ".join(proc.stderr.split()), proc.stderr


def test_a_session_within_its_declared_bytes_is_no_warning(lab):
    """Four requests an episode keep 1 KiB: declared, so neither warmup nor any swap-out warns."""
    proc = ardiff(lab, "rollout", "owned.yaml", "eps", "-o", "declared", "--pipeline", "lab_world.model:KeepsFrames",
                  "--session-capacity", "1")
    assert proc.returncode == 0 and "restored from swap" in proc.stdout + proc.stderr, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("config, dtype", [("dreamzero-tiny", "float32"), ("dreamzero-tiny", "bfloat16"),
                                           ("causal-world-tiny", "float32")])
def test_the_built_in_pipelines_never_keep_more_than_they_declare(cli_env, tmp_path, config, dtype):
    """Their warmup and every swap-out of a demo rollout (capacity 1: each step evicts) are checked: no warning.
    The geometry-only configs are checked without a model in test_pipelines_config.py."""
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", config, "-o", str(tmp_path / "run"),
                           "--session-capacity", "1", "--device", "cpu", "--dtype", dtype, "--format", "plain"],
                          cwd=tmp_path, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "swapped out" in proc.stdout + proc.stderr, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(("name", "problem"), [
    ("WarmupWrongShape", "'state' has shape (4,), expected (6,)"),
    ("WarmupWrongDtype", "'state' has dtype int64, expected a floating dtype (float32)"),  # it passed silently
    ("WarmupNoPrompt", "missing prompt 'prompt'"),  # the seed beside it, no schema field, is left alone
    ("WarmupTwoPrompts", "prompt given twice, differently: 'prompt' is 'pick', 'language_instruction' is 'place'"),
])
def test_warmup_requests_whose_inputs_the_schema_refuses_are_the_pipelines_error(lab, name, problem):
    """A warmup request unlike any step rollout hands the forward warmed up another path than the steps take
    (int64 where the steps get float32: no word), or failed in the model's own code (`mat1 and mat2 shapes cannot be
    multiplied`), naming neither the schema nor the field."""
    root, _ = lab
    said = (f"Error: warmup request 'warm0' of {name}: its inputs do not match the pipeline's observation_schema: "
            f"{problem}")
    warmup = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", f"lab_world.model:{name}")
    assert warmup.returncode == 1 and said in warmup.stderr, warmup.stderr
    assert "hint: make ar_diffusion_warmup_requests() give inputs like a step's" in warmup.stderr, warmup.stderr
    if name == "WarmupWrongShape":  # a rollout stops the same way at its warmup, before any step
        rollout = ardiff(lab, "rollout", "unnamed.yaml", "eps", "-o", f"out_{name}", "--pipeline",
                         f"lab_world.model:{name}")
        assert rollout.returncode == 1 and said in rollout.stderr, rollout.stderr
        assert (root / f"out_{name}" / "results.jsonl").read_text() == ""


def test_warmup_requests_reach_the_forward_as_a_steps_inputs_do(lab, tmp_path):
    """A warmup request's float64 state reached the forward as float64, and one under DROID's keys under those keys
    (a forward reading 'state' failed with KeyError), where a step's reach it as float32 under the schema's names:
    warmup warmed up another path than the steps take. A prompt given under both keys, as one text, was refused, where
    a step file giving both runs. The pipeline's own inputs mapping, which it gives twice, is left as it was."""
    root, env = lab
    log = tmp_path / "inputs"
    env = {**env, "LAB_INPUTS": str(log)}
    both = {"prompt": "warm", "language_instruction": "warm"}
    write_episode(tmp_path / "droid", [{"observation/state": np.zeros(6)}] * 2, metadata=both)

    def run(command, *args):
        return subprocess.run([sys.executable, "-m", "ardiff_cli", command, "unnamed.yaml", *args, "--pipeline",
                               "lab_world.model:RecordsInputs"], cwd=root, env=env, capture_output=True, text=True,
                              timeout=300)

    warmup = run("warmup", "--format", "json")
    assert warmup.returncode == 0, warmup.stderr
    result = json.loads(warmup.stdout.splitlines()[-1])
    # what the forward got, so that the requests of one path are of one shape (steady_s)
    assert [r["shape"] for r in result["requests"]] == [{"state": [6], "prompt": None, "seed": None}] * 3, result
    rollout = run("rollout", str(tmp_path / "droid"), "-o", str(tmp_path / "out"), "--no-warmup")
    assert rollout.returncode == 0, rollout.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = {"state": ["ndarray", "float32"], "prompt": ["str", ""]}
    warm = {**steps, "seed": ["int", ""]}  # the seed, no schema key, the pipeline's own as it gave it
    # warm1 twice: it is run again on its session rebuilt from its export, as it ran the first time
    assert [(rid, inputs) for rid, inputs, _ in records] == [
        ("warm0", warm), ("warm1", warm), ("warm1", warm), ("warm2", warm), ("droid/000000", steps),
        ("droid/000001", steps)], records
    given = {"observation/state": ["ndarray", "float64"], "language_instruction": ["str", ""], "seed": ["int", ""]}
    assert [kept for rid, _, kept in records if rid.startswith("warm")] == [given] * 4, records


def test_an_output_on_the_meta_device_is_named_in_warmup_and_in_a_step(lab):
    """A tensor left on the meta device (no values) failed as `RuntimeError: Tensor.item() cannot be called on meta
    tensors`, ardiff's own check of its values, naming neither the output nor the forward."""
    root, _ = lab
    said = ("OutputOnMeta.forward() returned arrays with no values: 'actions' (on the meta device); expected tensors "
            "with data, on any real device")
    warmup = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:OutputOnMeta")
    assert warmup.returncode == 1 and f"Error: warmup request 'warm0' of OutputOnMeta: {said}" in warmup.stderr, \
        warmup.stderr
    rollout = ardiff(lab, "rollout", "unnamed.yaml", "eps/ep0", "eps/ep1", "-o", "out_meta", "--no-warmup",
                     "--pipeline", "lab_world.model:OutputOnMeta")
    assert rollout.returncode == 1, rollout.stderr
    lines = [json.loads(line) for line in (root / "out_meta" / "results.jsonl").read_text().splitlines()]
    assert [(line["episode"], line["status"]) for line in lines] == [("ep0", "failed"), ("ep1", "failed")], lines
    assert all(said in line["error"] for line in lines), lines
    assert not (root / "out_meta" / "episodes").exists() or not frames(root / "out_meta")


def test_a_kv_state_misused_in_a_step_is_named_after_the_pipeline_that_misused_it(lab):
    """A state kept past its request and used in another session's forward failed the step with `RuntimeError:
    get_kv_caches() on the AR-Diffusion KV state of session 'ep0' outside its request`, naming what was misused but
    not the pipeline, where its other mistakes say `OutputOnMeta.forward() returned ...`."""
    root, _ = lab
    proc = ardiff(lab, "rollout", "unnamed.yaml", "eps/ep0", "eps/ep1", "-o", "out_kept", "--no-warmup",
                  "--pipeline", "lab_world.model:KeepsState")
    said = ("episode 'ep1' failed at step 0 in the model's forward: RuntimeError: KeepsState.forward(): "
            "has_cross_attention() on the AR-Diffusion KV state of session 'ep0' outside its request: ")
    assert proc.returncode == 4 and f"Error: {said}" in proc.stderr, proc.stderr
    lines = [json.loads(line) for line in (root / "out_kept" / "results.jsonl").read_text().splitlines()]
    failed = [line for line in lines if line["status"] == "failed"]
    assert [(line["episode"], line["step"]) for line in failed] == [("ep1", 0)] and failed[0]["error"].startswith(
        said), failed


def test_a_cross_attention_cache_read_under_another_name_is_named_after_the_pipeline(lab):
    """state.cross_attention('cond', 'txt') failed the step with `KeyError: "unknown cross-attention cache 'txt'; valid
    caches: ['text']"`, naming no pipeline, where a misnamed branch said `LabPipeline.forward(): unknown ... branch`:
    the lookup raises in the spec (capability.py), one call below the KV state."""
    root, _ = lab
    proc = ardiff(lab, "rollout", "unnamed.yaml", "eps/ep0", "-o", "out_misnamed", "--no-warmup",
                  "--pipeline", "lab_world.model:MisnamesCache")
    said = ("episode 'ep0' failed at step 0 in the model's forward: KeyError: \"MisnamesCache.forward(): unknown "
            "cross-attention cache 'txt'; valid caches: ['text']\"")
    assert proc.returncode == 1 and f"Error: {said}" in proc.stderr, proc.stderr


def test_a_config_naming_a_pipeline_not_yet_registered_is_told_how_to_register_or_run_it(lab):
    """README's `pipeline: my_world` config, tried before its package was installed, was `unknown pipeline 'my_world'
    (did you mean 'causal_world'?)`, hint `registered pipelines: causal_world, dreamzero`: neither the entry point
    that names it nor --pipeline, which runs it unregistered, was said. What the hint offers then works."""
    root, env = lab
    (root / "my_world.yaml").write_text("pipeline: my_world\nmodel: {}\nruntime: {device: cpu, num_threads: 1}\n")
    proc = ardiff(lab, "inspect-capacity", "my_world.yaml")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "hint: registered pipelines: causal_world, dreamzero, lab_world, lab_world_class; a pipeline of your own gets "
        "its name from an 'ardiff.pipelines' entry point of its installed package (README, 'Adding a pipeline'); "
        "until then, pass its class with --pipeline MODULE:CLASS (in Python: load_config(CONFIG, "
        "pipeline='MODULE:CLASS'))"), proc.stderr
    assert ardiff(lab, "warmup", "my_world.yaml", "--pipeline", "lab_world.model:LabPipeline").returncode == 0
    python = ("from ardiff_cli.runtime import ARDiffusionEngine, load_config\n"
              "config = load_config('my_world.yaml', pipeline='lab_world.model:LabPipeline')\n"
              "with ARDiffusionEngine.from_config(config) as engine:\n"
              "    engine.load()\n"
              "    print(type(engine.pipeline).__name__, engine.warmup() is None)\n")
    ran = subprocess.run([sys.executable, "-c", python], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0 and ran.stdout.startswith("LabPipeline"), ran.stderr


def test_a_pipelines_own_warnings_are_warning_lines_and_listed_in_the_json_result_once_each(lab):
    """A pipeline's warnings.warn() (in its forward, in a thread of its own) and torch's deprecation warning went to
    stderr as Python writes them, and a script reading `warmup --format json` found the result's `warnings` empty.
    Each is a `warning:` line naming where and its category now, once as Python's default filter shows it (two
    requests, one line), and listed in the result; the user's own filter (PYTHONWARNINGS, -W) still decides."""
    root, env = lab
    model = root / "lab_world" / "model.py"
    expected = [f"{model}:{lineno(model, text)}: {category}: {message}" for text, category, message in [
        ('warnings.warn("lab: the forward warns")', "UserWarning", "lab: the forward warns"),
        ('"lab: its thread warns"', "RuntimeWarning", "lab: its thread warns"),
        ("torch.range(0, 1)", "UserWarning", "torch.range is deprecated")]]
    command = [sys.executable, "-m", "ardiff_cli", "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:Warns"]

    def warmup(*args: str, **extra_env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        proc = subprocess.run([*command, *args], cwd=root, env={**env, **extra_env}, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.splitlines()[-1]) if "json" in args else {"warnings": None}
        return proc, result["warnings"]

    proc, listed = warmup("--format", "json")
    assert [w[:len(e)] for w, e in zip(listed, expected)] == expected and len(listed) == 3, listed
    for fmt in ("json", "plain"):  # each once on stderr, as ardiff's lines, never again as Python writes them
        proc, _ = warmup("--format", fmt)
        said = [line for line in proc.stderr.splitlines() if "lab: " in line or "torch.range" in line]
        assert said == [f"warning: {w}" for w in listed], proc.stderr
    proc, listed = warmup("--format", "json", "-q")  # silenced, still listed
    assert proc.stderr == "" and len(listed) == 3, proc.stderr
    proc, listed = warmup("--format", "json", PYTHONWARNINGS="ignore")  # the user's filter decides
    assert listed == [] and "warn" not in proc.stderr, proc.stderr
    rollout = subprocess.run([sys.executable, "-m", "ardiff_cli", "rollout", "unnamed.yaml", "eps/ep0", "eps/ep1", "-o",
                              "out_warns", "--no-warmup", "--pipeline", "lab_world.model:Warns", "--format", "json"],
                             cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert rollout.returncode == 0, rollout.stderr
    summary = json.loads(rollout.stdout.splitlines()[-1])  # eight steps, two sessions, one place each: three lines
    said = summary["warnings"]
    assert summary["kind"] == "summary" and [w[:len(e)] for w, e in zip(said, expected)] == expected, summary
    assert len(said) == 3, said
    assert json.loads((root / "out_warns" / "summary.json").read_text())["warnings"] == summary["warnings"]


def test_a_storm_of_a_pipelines_warnings_lists_a_bounded_number_of_them(lab):
    """A warning whose text changes each time (a count, a step) is shown each time by Python's default filter: each
    one was kept for the result, so that a long run's summary.json, and the command's memory, grew with every step
    (here 300 a forward). The first ones are listed, and one more entry says how many were left out."""
    root, env = lab
    from ardiff_cli.output import CODE_WARNINGS_LISTED

    def listed(command: str, *args: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-m", "ardiff_cli", command, "unnamed.yaml", *args, "--pipeline",
                               "lab_world.model:WarnsEachTime", "--format", "json", "-q"], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        return json.loads(proc.stdout.splitlines()[-1])["warnings"]

    said = listed("warmup")
    assert len(said) == CODE_WARNINGS_LISTED + 1 and said[0].endswith("UserWarning: lab: warm0: clamped 0 values")
    assert all(": UserWarning: lab: " in w for w in said[:-1]), said
    assert re.fullmatch(r"and \d+ more Python warnings of the code the command ran, left out of this list", said[-1])
    said = listed("rollout", "eps/ep0", "-o", "out_storm", "--no-warmup")  # four steps
    assert said[-1] == (f"and {4 * 300 - CODE_WARNINGS_LISTED} more Python warnings of the code the command ran, left "
                        "out of this list") and len(said) == CODE_WARNINGS_LISTED + 1, said[-1]
    assert json.loads((root / "out_storm" / "summary.json").read_text())["warnings"] == said


def test_a_warmup_request_of_the_pipelines_own_request_type_runs_as_that_type(lab):
    """A warmup request of a subclass of ARDiffusionRequest with a constructor of its own failed warmup with
    `TypeError: WarmupRequest.__init__() got an unexpected keyword argument 'inputs'`, as its inputs were put in
    a new request made through the constructor: it ran before, its inputs checked only."""
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:WarmupOwnRequests")
    assert proc.returncode == 0, proc.stderr


def lineno(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize(("module", "raised", "hint"), [
    ("lab_syntax", "SyntaxError: invalid syntax (lab_syntax.py, line 1)", "fix the module"),
    ("lab_needs", "ModuleNotFoundError: No module named 'lab_missing_dependency_xyz'",
     "it imports 'lab_missing_dependency_xyz', which is not installed in this environment"),
])
def test_a_pipeline_module_whose_import_raises_is_the_pipelines_error_not_the_users_input(lab, module, raised, hint):
    """`--pipeline lab_syntax:LabPipeline`, a module with a syntax error or one importing a package not installed, was
    a config error (exit 2, `config_error`), where the same module imported by an entry module's pipeline_class() was
    the pipeline's (exit 1): the pipeline's code failed as it loaded. A module that is not there stays the user's."""
    said = f"Error: --pipeline: pipeline '{module}:LabPipeline': importing '{module}' raised {raised}"
    for command in ("warmup", "inspect-capacity", "rollout"):
        proc = ardiff(lab, command, "unnamed.yaml", "--pipeline", f"{module}:LabPipeline")
        assert proc.returncode == 1 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert f"hint: {hint}" in proc.stderr, proc.stderr
    root, env = lab
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", "unnamed.yaml", "--pipeline",
                           f"{module}:LabPipeline", "--format", "json"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    error = json.loads(proc.stdout.splitlines()[-1])
    assert proc.returncode == 1 and (error["kind"], error["exit_code"]) == ("pipeline_error", 1), proc.stdout
    gone = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_gone_xyz:LabPipeline")
    assert gone.returncode == 2 and "cannot import 'lab_gone_xyz': ModuleNotFoundError" in gone.stderr, gone.stderr


def test_a_warmup_request_whose_inputs_are_no_mapping_is_named_as_such(lab):
    """Its inputs were checked against the schema before the request itself: `AttributeError: 'NoneType' object has
    no attribute 'items'`, where the runner names the request's inputs that are no mapping."""
    warmup = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_world.model:WarmupInputsNone")
    assert warmup.returncode == 1, warmup.stderr
    assert "request 'warm0': inputs must be a mapping (dict) of the pipeline's inputs, got None" in warmup.stderr, \
        warmup.stderr
    assert "AttributeError" not in warmup.stderr, warmup.stderr


def test_a_pipeline_module_importing_a_module_its_own_package_lacks_is_not_told_to_install_it(lab):
    """`lab_pkg.model` importing `lab_pkg.helpers`, a file left out of the package, was told "it imports
    'lab_pkg.helpers', which is not installed in this environment: install it": no install gives it."""
    root, _ = lab
    (root / "lab_pkg").mkdir(exist_ok=True)
    (root / "lab_pkg" / "__init__.py").write_text("")
    (root / "lab_pkg" / "model.py").write_text("import lab_pkg.helpers\n")
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_pkg.model:LabPipeline")
    assert proc.returncode == 1, proc.stderr
    assert "hint: it imports 'lab_pkg.helpers', which its own package 'lab_pkg' does not hold" in proc.stderr, \
        proc.stderr
    assert "install it" not in proc.stderr, proc.stderr


def test_a_pipeline_module_given_as_a_files_name_is_told_its_import_name(lab):
    """`--pipeline lab_plain.py:LabPipeline`, a file's name, was asked "is the package installed?"."""
    root, _ = lab
    (root / "lab_plain.py").write_text("class LabPipeline:\n    pass\n")
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_plain.py:LabPipeline")
    assert proc.returncode == 2 and "cannot import 'lab_plain.py'" in proc.stderr, proc.stderr
    assert ("hint: 'lab_plain.py' is a file's name; MODULE is the name it is imported by: lab_plain (its folder on "
            "PYTHONPATH)") in proc.stderr, proc.stderr


def test_a_pipeline_module_given_as_a_files_path_is_told_its_folder_and_import_name(lab):
    """`--pipeline lab_code/lab_deep.py:LabPipeline`, a path with a folder, got the generic hint (`pass --pipeline
    MODULE:CLASS, e.g. my_lab.models:MyPipeline`), which named neither the folder to put on PYTHONPATH nor the name."""
    root, env = lab
    (root / "lab_code").mkdir(exist_ok=True)
    (root / "lab_code" / "lab_deep.py").write_text("class LabPipeline:\n    pass\n")
    proc = ardiff(lab, "warmup", "unnamed.yaml", "--pipeline", "lab_code/lab_deep.py:LabPipeline")
    assert proc.returncode == 2, proc.stderr
    hint = ("hint: 'lab_code/lab_deep.py' is a file's path; MODULE is the name it is imported by, from a folder on "
            "PYTHONPATH: run with PYTHONPATH=lab_code and --pipeline lab_deep:LabPipeline\n")
    assert hint in proc.stderr, proc.stderr
    # and so it imports: the class is found (and refused as no pipeline class, which it is not)
    env = {**env, "PYTHONPATH": os.pathsep.join(["lab_code", env["PYTHONPATH"]])}
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", "unnamed.yaml", "--pipeline",
                           "lab_deep:LabPipeline", "--format", "plain"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "'lab_deep:LabPipeline' is not a pipeline class" in proc.stderr, proc.stderr


@pytest.mark.parametrize("reference, hint", [
    # a folder that is no package: its modules are imported from it on PYTHONPATH
    ("lab_code/..:LabPipeline", ", from a folder on PYTHONPATH: run with PYTHONPATH=. and --pipeline "
                                "MODULE:LabPipeline, MODULE the name of a .py file in that folder, without .py\n"),
    # a package's folder (it holds __init__.py): imported by its name from the folder above
    ("lab_world/model/..:LabPipeline", ": lab_world is a package: run with PYTHONPATH=. and --pipeline "
                                       "lab_world:LabPipeline (or lab_world.MODULE:LabPipeline for one of its "
                                       "modules)\n"),
])
def test_a_pipeline_given_as_a_path_ending_in_dot_dot_is_told_it_names_a_folder(lab, reference, hint):
    """`--pipeline dir/..:C` was told "'dir/..' is a file's path ..., and '..' is no Python name: rename the file":
    there is no file to rename, the path names a folder."""
    proc = ardiff(lab, "warmup", "unnamed.yaml", f"--pipeline={reference}")
    path = reference.partition(":")[0]
    assert proc.returncode == 2 and f"got {reference!r}\n" in proc.stderr, proc.stderr
    assert f"hint: {path!r} names a folder, not a module file; MODULE is the name a module is imported by{hint}" in \
        proc.stderr, proc.stderr
    assert "rename the file" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("reference, hint", [
    # a folder of modules: told PYTHONPATH=. and --pipeline lab_mods:LabPipeline, which imports no module of it
    ("lab_mods/:LabPipeline", ", from a folder on PYTHONPATH: run with PYTHONPATH=lab_mods and --pipeline "
                              "MODULE:LabPipeline, MODULE the name of a .py file in that folder, without .py\n"),
    # the home folder: told "'~' is no Python name: rename the file"
    ("~/:LabPipeline", ", from a folder on PYTHONPATH: run with PYTHONPATH={home} and --pipeline MODULE:LabPipeline, "
                       "MODULE the name of a .py file in that folder, without .py\n"),
    # a package's folder: as before, by its name from the folder above, but no longer called a file's path
    ("lab_world/:LabPipeline", ": lab_world is a package: run with PYTHONPATH=. and --pipeline lab_world:LabPipeline "
                               "(or lab_world.MODULE:LabPipeline for one of its modules)\n"),
])
def test_a_pipeline_given_as_a_folder_there_is_told_it_names_a_folder(lab, reference, hint):
    """`--pipeline dir/:C` of a folder that is there was told it is "a file's path", to run with PYTHONPATH=. and
    --pipeline dir:C: for a folder of modules that imports it as a namespace package, which has no class C; `~/` was
    told to rename "the file" '~'."""
    root, env = lab
    (root / "lab_mods").mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", "unnamed.yaml", f"--pipeline={reference}",
                           "--format", "plain"], cwd=root, env={**env, "HOME": str(root)}, capture_output=True,
                          text=True, timeout=300)
    path = reference.partition(":")[0]
    assert proc.returncode == 2 and f"got {reference!r}\n" in proc.stderr, proc.stderr
    assert (f"hint: {path!r} names a folder, not a module file; MODULE is the name a module is imported by"
            f"{hint.format(home=root)}") in proc.stderr, proc.stderr


@pytest.mark.parametrize("reference, hint", [
    # a package's folder still to be made, with its trailing /: it was told PYTHONPATH=/ (the root of the file system)
    ("lab_to_be/:LabPipeline", "run with PYTHONPATH=. and --pipeline lab_to_be:LabPipeline"),
    # a package's __init__.py is imported by its folder's name: it was told PYTHONPATH=lab_code and __init__:...
    ("lab_code/pkg/__init__.py:LabPipeline", "run with PYTHONPATH=lab_code and --pipeline pkg:LabPipeline"),
    # `--pipeline=~/...` (no shell expands a ~ there): it was told PYTHONPATH='./~/lab_code', a folder named ~ here
    ("~/lab_code/lab_deep.py:LabPipeline", "run with PYTHONPATH={home}/lab_code and --pipeline lab_deep:LabPipeline"),
    # the class left out too: it was taken for a registered pipeline's name ("unknown pipeline 'lab_code/...'")
    ("lab_code/lab_deep.py", "run with PYTHONPATH=lab_code and --pipeline lab_deep:CLASS"),
])
def test_a_pipeline_given_as_a_folders_or_a_home_files_path_is_told_the_folder_to_put_on_pythonpath(lab, reference,
                                                                                                     hint):
    root, env = lab
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", "unnamed.yaml", f"--pipeline={reference}",
                           "--format", "plain"], cwd=root, env={**env, "HOME": str(root)}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and f"got {reference!r}\n" in proc.stderr, proc.stderr
    assert f"; MODULE is the name it is imported by, from a folder on PYTHONPATH: {hint.format(home=root)}\n" in \
        proc.stderr, proc.stderr
