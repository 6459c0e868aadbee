"""The runner on a GPU: a request's time is its kernels' time, not the time it took to launch them.

UNVERIFIED: written without a GPU (the session that wrote it had none); skips unless a CUDA device is present.
Run with ``pytest tests/gpu``. It needs no vLLM.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch
from tiny_pipeline import tiny_spec

from ardiff_cli.runtime.request import ARDiffusionRequest
from ardiff_cli.runtime.runner import ARDiffusionModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class LeavesItsWorkOnTheGpu:
    """A pipeline whose forward launches a chain of matmuls and returns the result on the GPU, unsynchronised: it
    returns long before its kernels end (tens of ms of work on any GPU, well under one ms to launch)."""

    def __init__(self) -> None:
        self.spec = tiny_spec()
        self.x = torch.randn(4096, 4096, device="cuda") / 4096**0.5  # (N, N) float32

    def ar_diffusion_kv_cache_spec(self):
        return self.spec

    @contextmanager
    def bind_ar_diffusion_state(self, session_id, state):
        yield

    def reset_ar_diffusion_session(self, session_id: str) -> None:
        pass

    def close_ar_diffusion_session(self, session_id: str) -> None:
        pass

    def work(self) -> torch.Tensor:
        y = self.x
        for _ in range(20):
            y = torch.tanh(y @ self.x)  # (N, N)
        return y

    def forward(self, request: ARDiffusionRequest) -> dict[str, torch.Tensor]:
        return {"y": self.work()}


def test_a_forward_that_leaves_its_outputs_on_the_gpu_is_timed_with_its_kernels():
    """forward_s timed the kernels' launch only: the forward returns as soon as they are queued, and their time went
    to whoever used the outputs next (the rollout's write of the step file, whose time no latency counts)."""
    pipeline = LeavesItsWorkOnTheGpu()
    runner = ARDiffusionModelRunner(pipeline, device="cuda", memory_budget="256MiB")
    runner.load()
    finished = []
    runner.subscribe(lambda event: finished.append(event) if event.kind == "request_finished" else None)
    runner.execute_model(ARDiffusionRequest("warm", {}, {"session_id": "a"}))  # cuBLAS's handle, first launches
    torch.cuda.synchronize()
    start = time.perf_counter()
    pipeline.work()
    torch.cuda.synchronize()
    alone = time.perf_counter() - start
    output = runner.execute_model(ARDiffusionRequest("timed", {}, {"session_id": "a"}))
    assert output["y"].is_cuda
    assert finished[-1].request_id == "timed" and finished[-1].forward_s >= 0.5 * alone, (finished[-1], alone)
    runner.close()
