"""vLLM's FlashAttention backend on CUDA against the torch backend and a dense reference.

UNVERIFIED: written without a GPU (the session that wrote it had none); every test here skips unless a
CUDA device is present and ``vllm.vllm_flash_attn`` imports. Run with ``pytest tests/gpu -m vllm``.

Each check feeds the same q/k/v to two caches on the GPU, one per backend, through rollouts long enough
for the sliding window to wrap, and compares both outputs with a dense float32 reference built from an
independent record of every committed frame.
"""

from __future__ import annotations

import pytest
import torch
from dense_stream import dense_reference

from ardiff_cli.runtime.capability import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
from ardiff_cli.runtime.capacity import plan_capacity
from ardiff_cli.runtime.kv import backends
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.kv.layout import KVLayout

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not backends.vllm_installed(), reason="vLLM is not installed"),
]

CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))
# FlashAttention accumulates in float32 and rounds the output once; the torch path may round
# differently (SDPA's own kernels), so the two backends are compared with the same bounds.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(scope="module", autouse=True)
def _flash_usable():
    probe = backends.probe_vllm_flash(128)
    if not probe.ok:
        pytest.skip(f"vLLM FlashAttention unusable here: {probe.reason}")


def make_spec(**overrides) -> ARDiffusionKVCacheSpec:
    fields = dict(num_layers=2, num_kv_heads=2, head_size=64, tokens_per_frame=220, frames_per_block=2,
                  window_frames=3, sink_frames=1, kv_branches=CFG, session_capacity=2,
                  max_scratch_tokens_per_branch=17)
    fields.update(overrides)
    return ARDiffusionKVCacheSpec(**fields)


class Twin:
    """One (session, branch) run on a torch-backend cache and a vLLM-backend cache with identical inputs."""

    def __init__(self, caches, session, branch, num_q_heads, dtype, seed):
        self.states = [cache.new_state(session) for cache in caches]
        self.branch, self.num_q_heads, self.dtype = branch, num_q_heads, dtype
        self.generator = torch.Generator(device="cuda").manual_seed(seed)
        self.frames = []  # frames[f][layer] = (k, v) on the GPU
        self.worst = {"torch": 0.0, "vllm": 0.0, "between": 0.0}

    def run(self, num_frames, *, commit, num_registers, scale=None):
        spec = self.states[0].spec
        tpf = spec.tokens_per_frame
        seq_len, length = num_frames * tpf, num_frames * tpf + num_registers
        per_backend = [s.get_kv_caches(self.branch, seq_len=seq_len, commit_current=commit) for s in self.states]
        n = len(self.frames)
        kept = list(range(min(n, spec.sink_frames))) + list(range(max(spec.sink_frames, n - spec.window_frames), n))
        new = []
        for layer in range(spec.num_layers):
            def rand(heads):
                return torch.randn((heads, length, spec.head_size), generator=self.generator, device="cuda",
                                   dtype=torch.float32).to(self.dtype)

            q, k, v = rand(self.num_q_heads), rand(spec.num_kv_heads), rand(spec.num_kv_heads)
            keys = torch.cat([self.frames[f][layer][0] for f in kept] + [k], dim=1)
            values = torch.cat([self.frames[f][layer][1] for f in kept] + [v], dim=1)
            expected = dense_reference(q, keys, values, scale)
            outs = [contexts[layer].attend(q, k, v, scale=scale) for contexts in per_backend]
            for name, out in zip(("torch", "vllm"), outs):
                assert out.shape == q.shape and out.dtype == self.dtype and out.is_cuda
                self.worst[name] = max(self.worst[name], (out.float() - expected).abs().max().item())
            self.worst["between"] = max(self.worst["between"], (outs[0].float() - outs[1].float()).abs().max().item())
            new.append((k, v))
        for state in self.states:
            assert state.commit(self.branch) == (num_frames if commit else 0)
        if commit:
            for f in range(num_frames):
                tokens = slice(f * tpf, (f + 1) * tpf)
                self.frames.append([(k[:, tokens].clone(), v[:, tokens].clone()) for k, v in new])
        bound = TOLERANCE[self.dtype]
        assert max(self.worst.values()) <= bound, f"{self.branch}: {self.worst} exceeds {bound}"


GEOMETRIES = {
    # name: spec overrides, q heads; the kernel block size follows backends.flash_block_size
    "dreamzero-220-tail12": (dict(num_kv_heads=4, head_size=128), 4),  # 13 x 16 + 12 per frame
    "dreamzero-14b-heads": (dict(num_layers=1, num_kv_heads=40, head_size=128, frames_per_block=4, sink_frames=0,
                                 window_frames=4), 40),
    "self-forcing-1560-tail8": (dict(num_layers=1, num_kv_heads=2, head_size=128, tokens_per_frame=1560,
                                     frames_per_block=3, sink_frames=0, window_frames=3,
                                     max_scratch_tokens_per_branch=0), 2),
    "no-tail-block-32": (dict(tokens_per_frame=224), 2),  # 7 x 32
    "gqa-4": (dict(num_kv_heads=2, head_size=64, tokens_per_frame=20), 8),  # 1 x 16 + 4, GQA 4:1
    "big-block-256": (dict(tokens_per_frame=512, head_size=64, window_frames=2), 2),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_registers", [0, 17])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_flash_backend_matches_torch_and_dense(geometry, num_registers, dtype):
    overrides, num_q_heads = GEOMETRIES[geometry]
    spec = make_spec(**overrides)
    if num_registers > spec.max_scratch_tokens_per_branch:
        pytest.skip("no register room in this geometry")
    layout = KVLayout.from_spec(spec)
    assert backends.select_attention_backend("vllm", "cuda", dtype=dtype, layout=layout)[0] == "vllm"
    caches = [ARDiffusionKVCache(spec, layout.managed_pages(2), dtype=dtype, device="cuda", attention_backend=b)
              for b in ("torch", "vllm")]
    assert caches[1].pool.kernel.name == "vllm-flash-attn"
    twins = [Twin(caches, session, branch, num_q_heads, dtype, seed)
             for seed, (session, branch) in enumerate((s, b) for s in ("a", "b") for b in spec.branch_names)]
    retained = spec.sink_frames + spec.window_frames
    for _ in range(retained // spec.frames_per_block + 2):  # the window wraps
        for session in (twins[: len(spec.branch_names)], twins[len(spec.branch_names) :]):
            for twin in session:
                twin.run(spec.frames_per_block, commit=False, num_registers=num_registers)
            for twin in session:
                twin.run(spec.frames_per_block, commit=True, num_registers=num_registers)
    for twin in twins:  # a one-frame block and an explicit scale
        twin.run(1, commit=False, num_registers=num_registers, scale=0.05)
        twin.run(1, commit=True, num_registers=num_registers)
    torch.cuda.synchronize()


def test_flash_pool_bytes_equal_the_plan():
    spec = make_spec()
    free, _ = torch.cuda.mem_get_info()
    # Plan the vLLM layout: its scratch pages are pool pages (the torch plan stages them in the workspace).
    plan = plan_capacity(spec, torch.bfloat16, min(free, 1 << 30), attention_backend="vllm")
    cache = ARDiffusionKVCache(spec, plan.num_managed_pages, dtype=torch.bfloat16, device="cuda",
                               attention_backend="vllm")
    assert cache.pool.nbytes == plan.pool_bytes
    assert cache.pool.blocks.shape[2] == backends.flash_block_size(220) == 16


def test_auto_selects_flash_on_cuda_in_half_precision_only():
    layout = KVLayout.from_spec(make_spec())
    name, reason = backends.select_attention_backend("auto", torch.device("cuda", 0), dtype=torch.bfloat16,
                                                     layout=layout)
    assert name == "vllm" and "FlashAttention" in reason
    assert backends.probe_vllm_flash(64).fa_version in (2, 3, 4)
    assert backends.select_attention_backend("auto", "cuda", dtype=torch.float32, layout=layout)[0] == "torch"
