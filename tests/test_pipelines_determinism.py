"""Same config, inputs and seed in two processes: bit-identical outputs, from independently built checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pipeline_helpers import REPO

ROLLOUT = r"""
import hashlib, json, sys
sys.path.insert(0, "tests")
import torch
torch.set_num_threads(1)
from pipeline_helpers import Driver
from pipelines import causal_world, dreamzero

digests = {}
for name, module in (("dreamzero", dreamzero), ("causal_world", causal_world)):
    config = module.Config.from_dict({"preset": "tiny"}, where="determinism")
    pipe = module.pipeline_class().from_config(config, device="cpu", checkpoint=None)  # built in this process
    driver = Driver(pipe)
    digest = hashlib.sha256()
    for step in range(4):
        if name == "dreamzero":
            inputs = pipe.example_inputs(1 if step == 0 else 4, prompt="wipe the table", seed=step)
        else:
            inputs = pipe.example_inputs(prompt="a lighthouse at dusk", seed=step)
        out = driver.run("s", {**inputs, "seed": 7})
        for key in sorted(out):
            digest.update(key.encode() + out[key].numpy().tobytes())
    digests[name] = digest.hexdigest()
print(json.dumps(digests))
"""


def test_two_processes_give_bit_identical_outputs(tmp_path):
    procs = []
    for i in range(2):
        env = dict(os.environ)
        env["ARDIFF_CACHE_DIR"] = str(tmp_path / f"cache{i}")  # each process initialises its own weights
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        procs.append(subprocess.Popen([sys.executable, "-c", ROLLOUT], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1]
    assert set(results[0]) == {"dreamzero", "causal_world"}


@pytest.mark.parametrize("default", ["float64", "bfloat16"])
def test_a_callers_default_dtype_changes_neither_the_default_weights_nor_the_outputs(tmp_path, monkeypatch, default):
    """A notebook or lab script that ran torch.set_default_dtype(torch.float64) for its own maths: the default
    checkpoint built then used to hold float64 weights drawn from other random numbers (and stayed cached for every
    later run), each request's noise was drawn in float64 and its timesteps rounded to the default dtype, so the same
    config, inputs and seed gave other outputs (3.5 apart in latents; 1e-3 with bfloat16's timesteps)."""
    import torch

    from ardiff_cli.runtime import ARDiffusionEngine, ARDiffusionRequest

    runs = {}
    for dtype in (torch.float32, getattr(torch, default)):
        monkeypatch.setenv("ARDIFF_CACHE_DIR", str(tmp_path / str(dtype)))  # each builds its own checkpoint
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            outputs, files = [], []
            for name in ("dreamzero-tiny", "causal-world-tiny"):
                with ARDiffusionEngine.from_config(name, device="cpu", memory_budget="64MiB", num_threads=1) as engine:
                    engine.load()
                    files.append(engine.pipeline.checkpoint.read_bytes())
                    for step in range(3):
                        if name == "dreamzero-tiny":
                            inputs = engine.pipeline.example_inputs(1 if step == 0 else 4, seed=step)
                        else:
                            inputs = engine.pipeline.example_inputs(seed=step)
                        out = engine.execute(ARDiffusionRequest(f"r{step}", inputs, {"session_id": "s"}))
                        outputs.extend(out[key] for key in sorted(out))
        finally:
            torch.set_default_dtype(previous)
        runs[dtype] = outputs, files
    (expected, expected_files), (got, got_files) = runs.values()
    assert got_files == expected_files  # the same config gives the same checkpoint bytes
    assert len(got) == len(expected) == 9  # dreamzero: actions and latents; causal_world: latents
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
