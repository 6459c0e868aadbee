"""Same config, inputs and seed in two processes: bit-identical outputs, from independently built checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
