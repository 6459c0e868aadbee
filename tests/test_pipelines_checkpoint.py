"""Checkpoints: Wan names, deterministic fresh weights, the cached default, and one error naming every mismatch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ardiff_cli.runtime.errors import CheckpointError
from pipeline_helpers import CONFIGS, Driver
import pipelines.checkpoint as checkpoint
from pipelines import causal_world, dreamzero
from pipelines.checkpoint import (
    build_on_meta,
    count_config_parameters,
    default_checkpoint_path,
    fresh_modules,
    load_checkpoint,
    main,
    read_metadata,
    write_fresh_checkpoint,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def count_parameters(build):
    """Every parameter of the module ``build`` makes, built whole on the meta device: what the count must equal."""
    return sum(p.numel() for p in build_on_meta(build).parameters())


def tiny(module, **overrides):
    return module.Config.from_dict({"preset": "tiny", **overrides}, where="test")


def test_parameter_names_follow_wan():
    keys = set(dreamzero.pipeline_class().build_modules(tiny(dreamzero)).state_dict())
    for name in ("patch_embedding.weight", "text_embedding.0.weight", "text_embedding.2.weight",
                 "time_embedding.0.weight", "time_embedding.2.weight", "time_projection.1.weight",
                 "blocks.1.self_attn.q.weight", "blocks.1.self_attn.o.bias", "blocks.1.self_attn.norm_q.weight",
                 "blocks.1.self_attn.norm_k.weight", "blocks.1.cross_attn.k_img.weight",
                 "blocks.1.cross_attn.norm_k_img.weight", "blocks.1.norm3.weight", "blocks.1.ffn.0.weight",
                 "blocks.1.ffn.2.weight", "blocks.1.modulation", "head.head.weight", "head.modulation",
                 "img_emb.proj.1.weight", "img_emb.proj.4.weight"):
        assert f"transformer.{name}" in keys, name
    assert tuple(dreamzero.pipeline_class().build_modules(tiny(dreamzero)).transformer.patch_embedding.weight.shape) \
        == (64, 2 * 4 + 4, 1, 2, 2)  # Wan I2V: noisy latents | mask | anchor latent


def test_a_bare_wan_transformer_file_loads_into_the_transformer(tmp_path):
    """Wan-named keys without the pipeline prefix (a converted DiT checkpoint) load into the transformer alone."""
    cls = causal_world.pipeline_class()
    source = fresh_modules(lambda: cls.build_modules(tiny(causal_world)), 0).transformer
    path = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    assert "blocks.0.self_attn.q.weight" in load_file(str(path))
    target = cls.build_modules(tiny(causal_world)).transformer
    load_checkpoint(target, path)
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), source.state_dict().values()))


def test_fresh_checkpoints_are_deterministic(tmp_path):
    cls = causal_world.pipeline_class()
    a = write_fresh_checkpoint(cls, tiny(causal_world), tmp_path / "a.safetensors")
    b = write_fresh_checkpoint(cls, tiny(causal_world), tmp_path / "b.safetensors")
    c = write_fresh_checkpoint(cls, tiny(causal_world, seed=1), tmp_path / "c.safetensors")
    torch.manual_seed(1234)  # the global RNG must not matter
    d = write_fresh_checkpoint(cls, tiny(causal_world), tmp_path / "d.safetensors")
    # The same bytes (safetensors writes its metadata map in hash order; ardiff sorts it), so a checksum compares.
    assert a.read_bytes() == b.read_bytes() == d.read_bytes()
    tensors = [load_file(str(p)) for p in (a, b, c, d)]
    assert tensors[0].keys() == tensors[1].keys() == tensors[3].keys()
    for key in tensors[0]:
        assert torch.equal(tensors[0][key], tensors[1][key]) and torch.equal(tensors[0][key], tensors[3][key]), key
    assert any(not torch.equal(tensors[0][key], tensors[2][key]) for key in tensors[0])
    assert read_metadata(a) == read_metadata(b)


def test_configs_that_share_a_default_checkpoint_build_it_byte_for_byte_alike(tmp_path, ardiff_cache):
    """Sampling settings are not weight fields: configs differing only in them share one default file, and its
    metadata recorded the whole config of whichever built it first. Its header length, and with it where each
    tensor lay in memory once loaded, depended on that, and the outputs of the same config then differed by up to
    8e-7 from one cache to another (a CI run whose earlier test built the cache with guidance_scale 1e30)."""
    import numpy as np

    from ardiff_cli.runtime.engine import ARDiffusionEngine
    from ardiff_cli.runtime.request import ARDiffusionRequest

    cls = dreamzero.pipeline_class()
    plain = tiny(dreamzero, guidance_scale=1.0, num_inference_steps=1)
    other = tiny(dreamzero, guidance_scale=1.0e30, timestep_shift=3.0, negative_prompt="blurry")
    assert default_checkpoint_path(cls, plain) == default_checkpoint_path(cls, other)
    a = write_fresh_checkpoint(cls, plain, tmp_path / "a.safetensors")
    b = write_fresh_checkpoint(cls, other, tmp_path / "b.safetensors")
    assert a.read_bytes() == b.read_bytes()
    outputs = []
    for built_by in (plain, other):  # each cache's default built first by another config, then run with `plain`
        for path in ardiff_cache.glob("*.safetensors"):
            path.unlink()
        write_fresh_checkpoint(cls, built_by, default_checkpoint_path(cls, plain))
        config = {"pipeline": "dreamzero", "model": {"preset": "tiny", "guidance_scale": 1.0, "num_inference_steps": 1}}
        with ARDiffusionEngine.from_config(config, device="cpu", memory_budget="64MiB") as engine:
            engine.load()
            request = ARDiffusionRequest("r0", engine.pipeline.example_inputs(1, seed=3), {"session_id": "a"})
            outputs.append(engine.execute(request)["actions"].numpy())
    np.testing.assert_array_equal(outputs[0], outputs[1])


@pytest.mark.parametrize("module", [causal_world, dreamzero], ids=lambda m: m.__name__.split(".")[-1])
def test_loading_a_checkpoint_initialises_nothing_and_imports_no_dynamo(module, ardiff_cache):
    """The modules a checkpoint fills are built on the meta device with nothing initialised: run there,
    ``torch.nn.init`` and ``torch.randn`` go through torch's Python reference kernels, whose first calls import
    ``torch._dynamo`` and ``symbolic_shapes`` (0.8 s of every rollout's start). A fresh process loads the
    default checkpoint and counts a 40-layer config's parameters without importing either, and the weights it
    loaded are the file's, bit for bit."""
    module.pipeline_class().from_config(tiny(module))  # builds the default checkpoint into the cache first
    code = (
        "import sys\n"
        "from safetensors.torch import load_file\n"
        f"from {module.__name__} import Config, pipeline_class\n"
        "from pipelines.checkpoint import count_config_parameters, default_checkpoint_path\n"
        "cls, config = pipeline_class(), Config.from_dict({'preset': 'tiny'}, where='test')\n"
        "pipe = cls.from_config(config)\n"
        "assert count_config_parameters(cls, config.replace(num_layers=40)) > 0\n"
        "slow = [m for m in ('torch._dynamo', 'torch.fx.experimental.symbolic_shapes') if m in sys.modules]\n"
        "assert not slow, slow\n"
        "saved, loaded = load_file(default_checkpoint_path(cls, config)), pipe.modules.state_dict()\n"
        "assert saved.keys() == loaded.keys() and all(saved[k].equal(loaded[k]) for k in saved)\n"
        "print('ok')\n"
    )
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr


def test_default_checkpoint_is_built_once_into_the_cache(ardiff_cache):
    cls = dreamzero.pipeline_class()
    config = tiny(dreamzero)
    pipe = cls.from_config(config, device="cpu", dtype=torch.float32, checkpoint=None)
    path = pipe.checkpoint
    assert path.parent == ardiff_cache and path.suffix == ".safetensors"
    assert not [p for p in ardiff_cache.iterdir() if p.name.endswith(".tmp")]
    stamp = path.stat().st_mtime_ns
    again = cls.from_config(config.replace(num_inference_steps=2), device="cpu", checkpoint=None)  # same weights
    assert again.checkpoint == path and path.stat().st_mtime_ns == stamp
    fresh = cls.fresh(config)
    for (name, p), q in zip(pipe.modules.state_dict().items(), fresh.modules.state_dict().values()):
        assert torch.equal(p, q), name


def test_a_damaged_default_checkpoint_says_to_delete_it_to_build_it_again(ardiff_cache):
    """A cached default checkpoint cut short (a disk error) failed every run with the hint to check that it is a
    .safetensors file, and nothing said that it is ardiff's own cache, built again once deleted."""
    cls = causal_world.pipeline_class()
    path = cls.from_config(tiny(causal_world), device="cpu", checkpoint=None).checkpoint
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot read checkpoint") as err:
        cls.from_config(tiny(causal_world), device="cpu", checkpoint=None)
    assert err.value.hint == (f"it is the default checkpoint ardiff built in its cache: delete {path}, and it is "
                              "built again")
    path.unlink()
    assert cls.from_config(tiny(causal_world), device="cpu", checkpoint=None).checkpoint == path


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to act as another user")
def test_a_default_checkpoint_another_user_cannot_delete_suggests_a_cache_of_ones_own(monkeypatch):
    """A shared ARDIFF_CACHE_DIR (mode 1777) holding the default checkpoint another account built with umask 077:
    the hint said to delete the file, which this user cannot do in a sticky folder."""
    import shutil
    import tempfile

    shared = Path(tempfile.mkdtemp(dir="/tmp"))  # a folder another user can reach (pytest's are root's alone)
    try:
        shared.chmod(0o1777)
        monkeypatch.setenv("ARDIFF_CACHE_DIR", str(shared))
        cls = causal_world.pipeline_class()
        path = cls.from_config(tiny(causal_world), device="cpu", checkpoint=None).checkpoint  # root's, read once
        path.chmod(0o600)
        os.seteuid(65534)  # nobody: neither reads nor deletes root's file
        try:
            with pytest.raises(CheckpointError, match="cannot read checkpoint") as err:
                cls.from_config(tiny(causal_world), device="cpu", checkpoint=None)
        finally:
            os.seteuid(0)
        assert err.value.hint == (f"it is the default checkpoint ardiff built in the cache {shared}, a file this "
                                  "user cannot delete (a shared cache?): set ARDIFF_CACHE_DIR to a folder of your "
                                  "own, where it is built again")
    finally:
        shutil.rmtree(shared)


def test_the_temporary_file_of_a_killed_checkpoint_build_is_removed_once_an_hour_old(ardiff_cache):
    # A run killed (kill -9) while it built a default checkpoint left its temporary file in the cache for good.
    cls = causal_world.pipeline_class()
    name = default_checkpoint_path(cls, tiny(causal_world)).name
    stale, fresh = ardiff_cache / f".{name}.k1ll3d_x.tmp", ardiff_cache / f".{name}.b0ild1ng.tmp"
    other = ardiff_cache / ".notes.abcdefgh.tmp"  # not a checkpoint's: a cache folder may be shared
    for path in (stale, fresh, other):
        path.write_bytes(b"part of a checkpoint")
    for path in (stale, other):
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    cls.from_config(tiny(causal_world), device="cpu", checkpoint=None)
    assert not stale.exists() and fresh.exists() and other.exists()  # fresh: another run may be writing it


def test_mismatches_are_reported_together(tmp_path):
    cls = dreamzero.pipeline_class()
    state = fresh_modules(lambda: cls.build_modules(tiny(dreamzero)), 0).state_dict()
    del state["transformer.head.head.bias"]
    del state["vae.decoder.bias"]
    state["transformer.blocks.0.extra.weight"] = torch.zeros(1)
    state["transformer.blocks.0.ffn.0.weight"] = torch.zeros(3, 3)
    path = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with pytest.raises(CheckpointError) as err:
        cls.from_config(tiny(dreamzero), device="cpu", checkpoint=path)
    message = str(err.value)
    assert "2 missing keys: transformer.head.head.bias, vae.decoder.bias" in message
    assert "1 unexpected key: transformer.blocks.0.extra.weight" in message
    assert "1 shape mismatch: transformer.blocks.0.ffn.0.weight: checkpoint (3, 3) vs model (128, 64)" in message
    assert "python -m pipelines.checkpoint init" in err.value.hint


def test_many_mismatches_are_counted_with_the_first_few_named_and_all_in_details(tmp_path):
    state = fresh_modules(lambda: causal_world.pipeline_class().build_modules(tiny(causal_world)), 0).state_dict()
    path = tmp_path / "world.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    expected = dreamzero.pipeline_class().build_modules(tiny(dreamzero)).state_dict()
    missing = [k for k in expected if k not in state]
    with pytest.raises(CheckpointError) as err:
        dreamzero.pipeline_class().from_config(tiny(dreamzero), device="cpu", checkpoint=path)
    message = str(err.value)
    assert f"{len(missing)} missing keys: {', '.join(missing[:3])} and {len(missing) - 3} more;" in message
    assert message.endswith(" (--verbose lists them all)") and len(message) < 1500
    assert [line.removeprefix("missing key: ") for line in err.value.details
            if line.startswith("missing key: ")] == missing


def test_integer_tensor_for_a_float_weight_is_a_checkpoint_error(tmp_path):
    """Float weights of another precision are cast on load; an integer tensor is reported, not a torch traceback."""
    cls = causal_world.pipeline_class()
    state = fresh_modules(lambda: cls.build_modules(tiny(causal_world)), 0).state_dict()
    state["transformer.head.head.weight"] = state["transformer.head.head.weight"].to(torch.int64)
    state["transformer.head.head.bias"] = state["transformer.head.head.bias"].to(torch.float16)  # fine: cast
    path = tmp_path / "ints.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    with pytest.raises(CheckpointError,
                       match=r"1 dtype mismatch: transformer\.head\.head\.weight: checkpoint torch\.int64 vs "
                             r"model torch\.float32$"):
        cls.from_config(tiny(causal_world), device="cpu", checkpoint=path)


@pytest.mark.parametrize("recorded", ["[" * 5000 + "]" * 5000, '"num_heads"'])
def test_a_checkpoint_whose_recorded_config_is_no_record_is_trusted_like_one_without(tmp_path, recorded):
    """Its shapes are still checked; a record nested deeper than the JSON parser goes (RecursionError), or a string
    that contains a field's name (a TypeError on indexing it), crashed the load."""
    cls = causal_world.pipeline_class()
    path = write_fresh_checkpoint(cls, tiny(causal_world), tmp_path / "world.safetensors")
    save_file(load_file(str(path)), str(path), metadata={**read_metadata(path), "config": recorded})
    pipe = cls.from_config(tiny(causal_world, num_heads=2), device="cpu", checkpoint=path)
    assert pipe.checkpoint == path


def test_checkpoint_of_another_head_count_is_refused(tmp_path):
    """num_heads leaves every tensor shape alone, so only the recorded config can tell the files apart."""
    cls = causal_world.pipeline_class()
    path = write_fresh_checkpoint(cls, tiny(causal_world), tmp_path / "world.safetensors")  # 4 heads
    with pytest.raises(CheckpointError, match=r"written for another causal_world geometry: num_heads: checkpoint 4 "
                                              r"vs config 2$"):
        cls.from_config(tiny(causal_world, num_heads=2), device="cpu", checkpoint=path)
    # Sampler, retention and the noise seed are no part of the weights.
    pipe = cls.from_config(tiny(causal_world, seed=5, window_frames=3, timestep_shift=3.0), device="cpu",
                           checkpoint=path)
    assert pipe.checkpoint == path


def test_checkpoint_of_another_size_is_named_by_the_fields_it_records_not_by_every_tensor(tmp_path):
    """A `preset: tiny` file loaded with `preset: small` said "64 missing keys: ..., N shape mismatches: ..." in one
    error line of about 11 KB; the file records its geometry, so the error names the fields that differ instead."""
    cls = dreamzero.pipeline_class()
    path = write_fresh_checkpoint(cls, tiny(dreamzero), tmp_path / "tiny.safetensors")
    small = dreamzero.Config.from_dict({"preset": "small"}, where="test")
    with pytest.raises(CheckpointError, match=r"written for another dreamzero geometry: dim: checkpoint 64 vs config "
                                              r"128; ffn_dim: checkpoint 128 vs config 512; ") as err:
        cls.from_config(small, device="cpu", checkpoint=path)
    assert "missing keys" not in str(err.value) and len(str(err.value)) < 1000, str(err.value)[:300]


def test_checkpoint_of_another_pipeline_names_it(tmp_path):
    path = write_fresh_checkpoint(causal_world.pipeline_class(), tiny(causal_world), tmp_path / "world.safetensors")
    with pytest.raises(CheckpointError, match="written for pipeline 'causal_world'.*missing keys"):
        dreamzero.pipeline_class().from_config(tiny(dreamzero), device="cpu", checkpoint=path)


def test_wrapper_prefixes_are_stripped(tmp_path):
    cls = causal_world.pipeline_class()
    modules = fresh_modules(lambda: cls.build_modules(tiny(causal_world)), 0)
    path = tmp_path / "ddp.safetensors"
    save_file({f"module.{k}": v.contiguous() for k, v in modules.state_dict().items()}, str(path))
    target = cls.build_modules(tiny(causal_world))
    load_checkpoint(target, path)
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), modules.state_dict().values()))


def test_a_checkpoint_rewritten_in_place_after_loading_changes_no_loaded_weight(tmp_path):
    """The loaded weights are the file's bytes as read at load, not a mapping of it: ``cp new.safetensors
    model.safetensors`` or a training job saving over the file while a CPU run goes on used to change its weights
    under it mid-run (same size) or kill it with SIGBUS, leaving no summary (truncated first)."""
    cls = causal_world.pipeline_class()
    path = tmp_path / "model.safetensors"
    write_fresh_checkpoint(cls, tiny(causal_world), path)
    pipe = cls.from_config(tiny(causal_world), device="cpu", checkpoint=path)
    before = {k: v.clone() for k, v in pipe.modules.state_dict().items()}
    other = fresh_modules(lambda: cls.build_modules(tiny(causal_world)), 1)
    save_file({k: v.contiguous() for k, v in other.state_dict().items()}, str(tmp_path / "other.safetensors"),
              metadata=read_metadata(path))
    with open(path, "r+b") as f:  # in place, as cp does: the same inode, truncated and written again
        f.truncate(0)
        f.write((tmp_path / "other.safetensors").read_bytes())
    assert all(torch.equal(v, before[k]) for k, v in pipe.modules.state_dict().items())


_TRUNCATED_AFTER_AN_ACCELERATOR_LOAD = """
import os, sys

import torch
from safetensors.torch import save_file

from pipelines.checkpoint import load_checkpoint

path = sys.argv[1]
save_file({"weight": torch.ones(1024, 1024), "bias": torch.ones(1024)}, path)  # 4 MiB: pages past the new end
with torch.device("meta"):
    module = torch.nn.Linear(1024, 1024)
dtype = {"none": (), "float16": (torch.float16,)}[sys.argv[2]]
load_checkpoint(module, path, "meta", *dtype)  # meta: an accelerator every machine has
os.truncate(path, 0)  # a training job saving over it, the run's weights yet to be moved to the device
print(*(p.sum().device.type for p in module.parameters()), module.weight.dtype)
"""


def test_a_checkpoint_of_another_model_for_an_accelerator_is_named_as_one(tmp_path):
    """For an accelerator only the tensors the model takes (its keys, shapes and kinds) are moved there, the rest
    left on the meta device: an optimizer's state or another model's weights are named as a mismatch (exit 2), as
    for the CPU, not first moved to the device (where they could run it out of memory: not shown without a GPU)."""
    path = tmp_path / "m.safetensors"
    save_file({"weight": torch.ones(4, 8), "bias": torch.ones(3), "optimizer.exp_avg": torch.ones(64)}, str(path))
    with torch.device("meta"):
        module = torch.nn.Linear(8, 4)
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load_checkpoint(module, path, "meta", torch.float16)
    assert "unexpected key: optimizer.exp_avg" in caught.value.details
    assert "shape mismatch: bias: checkpoint (3,) vs model (4,)" in caught.value.details


@pytest.mark.parametrize("dtype", ["none", "float16"])
def test_a_checkpoint_truncated_before_an_accelerators_weights_are_moved_leaves_the_process_alive(tmp_path, dtype):
    """For an accelerator the weights are read, then moved to it, one tensor at a time (floating ones as the run's
    dtype): they were views of a mapping of the file until the caller moved the whole model, so a file truncated
    meanwhile (saved over in place by a training job) killed the process with SIGBUS (exit -7) and no summary."""
    done = subprocess.run([sys.executable, "-c", _TRUNCATED_AFTER_AN_ACCELERATOR_LOAD, str(tmp_path / "m.safetensors"),
                           dtype], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["meta", "meta", "torch.float16" if dtype == "float16" else "torch.float32"]


def _buffered() -> torch.nn.Module:
    module = torch.nn.Linear(4, 4)
    module.register_buffer("steps", torch.arange(3))  # int64
    module.register_buffer("mask", torch.tensor([True, False]))
    module.register_buffer("scale", torch.full((2,), 1 / 3, dtype=torch.float64))
    return module


def test_an_accelerators_weights_take_the_dtypes_a_cpu_load_then_the_models_move_gives(tmp_path):
    """Floating tensors are cast to the run's dtype as they are moved, as nn.Module.to(dtype=...) casts the CPU's
    (a float64 one too); integer and bool buffers keep theirs. meta stands in for the accelerator: dtypes only."""
    path = tmp_path / "m.safetensors"
    save_file(_buffered().state_dict(), path)
    cpu = _buffered()
    load_checkpoint(cpu, path, "cpu", torch.float16)
    cpu = cpu.to(torch.float16)  # what from_config does after loading for the CPU
    with torch.device("meta"):
        accelerator = _buffered()
    load_checkpoint(accelerator, path, "meta", torch.float16)
    assert {k: (v.dtype, v.device.type) for k, v in accelerator.state_dict().items()} == {
        k: (v.dtype, "meta") for k, v in cpu.state_dict().items()}
    assert cpu.steps.dtype == torch.int64 and cpu.mask.dtype == torch.bool and cpu.scale.dtype == torch.float16


def test_a_type_error_moving_an_accelerators_tensor_is_raised_once_not_retried_on_the_files_mapping(tmp_path):
    """Only opening the file with backend= is retried without it (an older safetensors): a TypeError of a tensor's
    move (a dtype that is no torch.dtype) read the whole file again through a mapping and raised the same error
    twice, one during the handling of the other."""
    path = tmp_path / "m.safetensors"
    save_file({"weight": torch.ones(4, 4), "bias": torch.ones(4)}, path)
    with torch.device("meta"):
        module = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError) as raised:
        load_checkpoint(module, path, "meta", "float16")
    assert raised.value.__context__ is None


def test_a_checkpoint_deleted_after_loading_leaves_the_model_its_identity(tmp_path):
    """A session's snapshot records the model that made it, the checkpoint by path, size and modification time as
    loaded: a file deleted or moved after the model loaded (a training job rotating its checkpoints) made every
    swap-out of the run fail with FileNotFoundError, its sessions rebuilt by replaying every step instead."""
    cls = causal_world.pipeline_class()
    path = tmp_path / "model.safetensors"
    write_fresh_checkpoint(cls, tiny(causal_world), path)
    data, mtime_ns = path.read_bytes(), path.stat().st_mtime_ns
    pipe = cls.from_config(tiny(causal_world), device="cpu", checkpoint=path)
    path.unlink()
    identity = pipe.model_identity()
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    assert cls.from_config(tiny(causal_world), device="cpu", checkpoint=path).model_identity() == identity


def test_unreadable_and_missing_files(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x80\x04not a safetensors file")
    cls = causal_world.pipeline_class()
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        cls.from_config(tiny(causal_world), device="cpu", checkpoint=junk)
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        cls.from_config(tiny(causal_world), device="cpu", checkpoint=tmp_path / "nope.safetensors")


def test_a_checkpoint_that_is_a_folder_is_named_a_folder_with_the_file_in_it(tmp_path, monkeypatch, cli_env):
    """from_config(checkpoint=FOLDER) (a model's folder, that holds its .safetensors file) said "checkpoint not found:
    FOLDER", though the folder is there, where a config's `checkpoint: FOLDER` is told "a folder, not a file". Both
    now say it is a folder, and name the .safetensors file in it."""
    monkeypatch.chdir(tmp_path)
    cls = causal_world.pipeline_class()
    (tmp_path / "model").mkdir()
    with pytest.raises(CheckpointError) as raised:
        cls.from_config(tiny(causal_world), device="cpu", checkpoint="model")
    assert str(raised.value) == "checkpoint model is a folder, not a file", str(raised.value)
    assert raised.value.hint == ("give the path of the .safetensors file of the model's weights, or use checkpoint: "
                                 "null")
    write_fresh_checkpoint(cls, tiny(causal_world), tmp_path / "model" / "weights.safetensors")
    with pytest.raises(CheckpointError) as raised:
        cls.from_config(tiny(causal_world), device="cpu", checkpoint="model")
    assert str(raised.value) == "checkpoint model is a folder, not a file", str(raised.value)
    assert raised.value.hint == ("it holds weights.safetensors: give that file's path (model/weights.safetensors), "
                                 "or use checkpoint: null")
    assert cls.from_config(tiny(causal_world), device="cpu", checkpoint="model/weights.safetensors")  # as hinted
    (tmp_path / "c.yaml").write_text("pipeline: causal_world\nmodel: {preset: tiny}\ncheckpoint: model\n")
    proc = subprocess.run([sys.executable, "-m", "ardiff_cli", "warmup", "c.yaml", "--format", "plain"], cwd=tmp_path,
                          env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("Error: c.yaml: field 'checkpoint': a folder, not a file: model\n"
                           "hint: it holds weights.safetensors: give that file's path (model/weights.safetensors), or "
                           "set checkpoint: null to use the pipeline's built-in default\n"), proc.stderr


def test_published_geometries_have_no_default_checkpoint(ardiff_cache):
    config = dreamzero.Config.from_dict({"preset": "14b"}, where="test")
    with pytest.raises(CheckpointError, match=r"no built-in checkpoint .*\(1[0-9]\.\d\dB parameters\)") as err:
        dreamzero.pipeline_class().from_config(config, device="cpu", checkpoint=None)
    assert "checkpoint:" in err.value.hint and "inspect-capacity" in err.value.hint
    assert "pipelines.checkpoint init" not in err.value.hint  # random 14B weights are no answer
    assert not list(ardiff_cache.glob("dreamzero-*14b*"))


@pytest.mark.parametrize("module", [causal_world, dreamzero])
def test_a_config_of_absurdly_many_layers_is_refused_without_building_its_blocks(module, ardiff_cache):
    """`num_layers: 10**12` under checkpoint: null: `warmup` built every block on the meta device to count the
    parameters it then refused (12 s for 5,000 layers; 10**12 never ended). The count comes from models of one,
    two and three layers, and equals the whole model's."""
    built = []

    class Counted(module.pipeline_class()):
        @classmethod
        def build_modules(cls, config):
            built.append(config.num_layers)
            assert config.num_layers <= 7, f"built {config.num_layers} blocks to count parameters"
            return super().build_modules(config)

    cached = set(ardiff_cache.iterdir())
    seven = tiny(module, num_layers=7)
    assert count_config_parameters(Counted, seven) == count_parameters(lambda: Counted.build_modules(seven))
    built.clear()
    with pytest.raises(CheckpointError, match=r"no built-in checkpoint .* \(\d(\.\d+)?e\+\d+ parameters\)"):
        Counted.from_config(tiny(module, num_layers=10**12), device="cpu", checkpoint=None)
    assert max(built) <= 3 and set(ardiff_cache.iterdir()) == cached


def test_a_model_whose_layers_are_not_alike_is_counted_whole():
    """The count from one, two and three layers holds only for a model whose every layer adds the same parameters;
    a third-party model whose don't (here a gate per pair of layers) is counted whole, not extrapolated: the count
    decides the refusal and the host memory fresh weights take."""
    base = causal_world.pipeline_class()

    class Uneven(base):
        @classmethod
        def build_modules(cls, config):
            modules = super().build_modules(config)
            modules.register_parameter("gates", torch.nn.Parameter(torch.zeros(config.num_layers ** 2)))
            return modules

    five = tiny(causal_world, num_layers=5)
    whole = count_parameters(lambda: Uneven.build_modules(five))
    assert count_config_parameters(Uneven, five) == whole == count_config_parameters(base, five) + 25


def test_command_line_init_refuses_weights_the_host_cannot_hold(tmp_path, capsys, monkeypatch):
    """Checked before building: a 14B config would take 57+ GB of float32 on the host."""
    import ardiff_cli.runtime.capacity as capacity

    monkeypatch.setattr(capacity, "available_host_memory", lambda: 1 << 10)  # a host with 1 KiB free
    out = tmp_path / "world.safetensors"
    assert main(["init", str(CONFIGS / "causal-world-tiny.yaml"), str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"Error: fresh causal_world weights for this config take \d+\.\d GiB of host memory "
                     r"\(float32\), more than the 0\.0 GiB available", err), err
    assert "trained weights" in err and not out.exists()


def test_command_line_init(tmp_path, capsys):
    out = tmp_path / "world.safetensors"
    assert main(["init", str(CONFIGS / "causal-world-tiny.yaml"), str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    pipe = causal_world.pipeline_class().from_config(tiny(causal_world), device="cpu", checkpoint=out)
    assert pipe.checkpoint == out
    assert main(["path", str(CONFIGS / "dreamzero-tiny.yaml")]) == 0
    assert capsys.readouterr().out.strip().endswith(".safetensors")
    assert main(["bogus"]) == 2


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_command_line_help_is_the_usage_on_stdout_and_success(flag, capsys):
    assert main([flag]) == 0  # it was the usage error: exit 2, on stderr
    assert capsys.readouterr().out.startswith("usage: python -m pipelines.checkpoint init CONFIG OUT.safetensors")


def test_command_line_takes_builtin_names_and_reports_bad_configs(tmp_path, capsys, ardiff_cache):
    assert main(["path", "dreamzero-tiny"]) == 0  # a built-in name, as everywhere else CONFIG is taken
    assert main(["path", str(CONFIGS / "dreamzero-tiny.yaml")]) == 0
    by_name, by_path = capsys.readouterr().out.split()
    assert by_name == by_path
    assert main(["init", str(tmp_path / "missing.yaml"), str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"Error: config file not found: {tmp_path / 'missing.yaml'}" in err and "Traceback" not in err
    (tmp_path / "bad.yaml").write_text("pipeline: dreamzero\nmodel: {window_frame: 3}\n")
    assert main(["path", str(tmp_path / "bad.yaml")]) == 2
    assert "unknown key 'model.window_frame'" in capsys.readouterr().err


@pytest.mark.parametrize("module", [causal_world, dreamzero], ids=["causal_world", "dreamzero"])
def test_bfloat16_rollout(ardiff_cache, module):
    pipe = module.pipeline_class().from_config(tiny(module), device="cpu", dtype=torch.bfloat16)
    driver = Driver(pipe)
    for block in range(4):
        if module is dreamzero:  # a session's first request carries one frame, the later ones four
            inputs = pipe.example_inputs(1 if block == 0 else 4, seed=block)
        else:
            inputs = pipe.example_inputs(seed=block)
        out = driver.run("s", inputs)
    for value in out.values():
        assert value.dtype == torch.float32 and torch.isfinite(value).all()
    assert driver.cache.pool.dtype == torch.bfloat16


def test_a_checkpoint_key_given_with_and_without_a_wrapper_prefix_is_refused(tmp_path):
    from pipeline_helpers import causal_world as fresh_causal_world

    pipe = fresh_causal_world()
    tensors = {k: v.contiguous().clone() for k, v in pipe.modules.state_dict().items()}
    tensors["module.transformer.head.head.bias"] = torch.ones_like(tensors["transformer.head.head.bias"])
    path = tmp_path / "dup.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="duplicated after prefix removal"):
        load_checkpoint(pipe.modules, path)


def test_a_new_format_version_gives_the_default_checkpoint_a_new_name(monkeypatch):
    # Bumping FORMAT_VERSION must rebuild cached defaults: a file of the old parameter names is never loaded again.
    cls = causal_world.pipeline_class()
    before = default_checkpoint_path(cls, tiny(causal_world))
    monkeypatch.setattr(checkpoint, "FORMAT_VERSION", str(int(checkpoint.FORMAT_VERSION) + 1))
    assert default_checkpoint_path(cls, tiny(causal_world)) != before


def test_building_fresh_weights_leaves_the_callers_random_state_as_it_was(tmp_path):
    # A library caller seeding torch for its own noise gets the same draws whether or not a default was built first.
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    write_fresh_checkpoint(causal_world.pipeline_class(), tiny(causal_world), tmp_path / "w.safetensors")
    assert torch.equal(torch.rand(4), expected)


def test_the_geometry_recorded_by_another_pipeline_is_not_compared_field_by_field(tmp_path):
    # Only a record this pipeline wrote names its fields: another pipeline's 'num_layers' is its own, and refusing
    # with "written for another dreamzero geometry" would blame the wrong thing (load_checkpoint names the pipeline).
    from pipelines import dreamzero
    from pipelines.checkpoint import check_weight_fields, read_metadata

    path = write_fresh_checkpoint(causal_world.pipeline_class(), tiny(causal_world, num_layers=3),
                                  tmp_path / "causal.safetensors")
    check_weight_fields(dreamzero.pipeline_class().name, tiny(dreamzero), read_metadata(path), path)


def test_command_line_refuses_extra_arguments_instead_of_ignoring_them(tmp_path, capsys):
    out = tmp_path / "world.safetensors"
    assert main(["init", "causal-world-tiny", str(out), "--force"]) == 2  # not an option init has: usage, no file
    assert capsys.readouterr().err.startswith("usage: python -m pipelines.checkpoint") and not out.exists()
    assert main(["path", "causal-world-tiny", "extra"]) == 2


def test_command_line_init_never_replaces_an_existing_file(tmp_path, capsys):
    """`init CONFIG OUT` with OUT a checkpoint already there (the trained weights' path, mistyped or given twice)
    replaced it with random weights, silently. It is refused with exit 2, the file left byte for byte."""
    out = tmp_path / "trained.safetensors"
    out.write_bytes(b"trained weights")
    assert main(["init", "causal-world-tiny", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"Error: {out} exists: init writes random weights and does not replace a file\n"), err
    assert out.read_bytes() == b"trained weights" and list(tmp_path.iterdir()) == [out]


def test_command_line_init_into_a_folder_says_so_exits_2_and_leaves_no_temporary_file(tmp_path):
    """`python -m pipelines.checkpoint init CONFIG OUT` with OUT an existing folder: "Error: cannot write OUT: Is a
    directory" and exit status 2 (main()'s return is the process's), and the temporary file the weights were
    written to first is removed, not left beside OUT."""
    out = tmp_path / "world.safetensors"
    out.mkdir()
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "pipelines.checkpoint", "init", "causal-world-tiny", str(out)],
                          cwd=repo, capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout) == (2, "") and done.stderr == f"Error: cannot write {out}: Is a directory\n"
    assert list(tmp_path.iterdir()) == [out] and list(out.iterdir()) == []


def test_command_line_init_needs_four_bytes_of_host_memory_a_parameter(tmp_path, monkeypatch):
    import ardiff_cli.runtime.capacity as capacity
    from pipelines.checkpoint import count_config_parameters

    params = count_config_parameters(causal_world.pipeline_class(), tiny(causal_world))
    out = tmp_path / "world.safetensors"
    monkeypatch.setattr(capacity, "available_host_memory", lambda: 4 * params - 1)  # float32: one byte short
    assert main(["init", "causal-world-tiny", str(out)]) == 2 and not out.exists()
    monkeypatch.setattr(capacity, "available_host_memory", lambda: 4 * params)
    assert main(["init", "causal-world-tiny", str(out)]) == 0 and out.exists()


def test_fresh_weights_get_each_modules_own_initialisation():
    # Wan's: Xavier linears with zero biases and a near-zero head (PyTorch's default would leave biases random and
    # the head at full scale: fresh rollouts far from what the docs describe).
    from pipelines.checkpoint import fresh_modules

    cls = causal_world.pipeline_class()
    modules = fresh_modules(lambda: cls.build_modules(tiny(causal_world)), 0)
    linears = [m for m in modules.transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(torch.count_nonzero(m.bias) == 0 for m in linears if m.bias is not None)
    assert modules.transformer.head.head.weight.std() < 0.03


def test_a_field_whose_trial_the_config_refuses_is_not_said_too_large_alone():
    """Of fields holding the size of a weight torch cannot make, each is tried alone, the others at their defaults.
    `seed` beside `dim: 2**62, num_heads: 64` cannot be: dim at its default of 64 leaves heads of 1, which the config
    refuses. That trial counted as "too large alone", so the error named the seed and hinted to lower it; it is
    untold (None), and only dim, which overflows alone, is named."""
    cfg = causal_world.Config.from_dict({"preset": "tiny", "dim": 2**62, "num_heads": 64, "seed": 2**62}, where="t")
    names = ["dim", "seed"]
    cls = causal_world.pipeline_class()
    assert checkpoint._too_large_alone(cls, cfg, "dim", names) is True
    assert checkpoint._too_large_alone(cls, cfg, "seed", names) is None
    with pytest.raises(checkpoint.ConfigError) as raised:
        checkpoint.build_config_on_meta(cls, cfg)
    assert str(raised.value).startswith(f"the causal_world model is too large for torch: 'model.dim' ({2**62}) makes "
                                        "a weight of shape"), raised.value
    assert raised.value.hint == "lower 'model.dim'"


def _good_checkpoint(tmp_path: Path) -> tuple[Path, bytes]:
    path = write_fresh_checkpoint(causal_world.pipeline_class(), tiny(causal_world), tmp_path / "good.safetensors")
    return path, path.read_bytes()


def _header_length(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


def _zip_of_weights(good: bytes) -> bytes:
    """A zip archive that is no torch.save file: the checkpoint zipped, as a download or a backup may come."""
    import io
    import zipfile

    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as archive:
        archive.writestr("model.safetensors", good)
    return data.getvalue()


# name -> (the file's bytes made from a good checkpoint's, what the error says after "cannot read checkpoint PATH: ",
# what its hint says). safetensors' own words named neither what the file was nor what to do: "header too large" for
# a torch.save file, a text file or a Git LFS pointer, "incomplete metadata, file not fully covered" for a copy cut
# short, each with the hint "is it a .safetensors file?".
UNREADABLE = {
    "empty": (lambda good: b"", r"the file is empty \(0 bytes\), not safetensors", "copy or download it again"),
    "cut_in_length": (lambda good: good[:5], "truncated: 5 bytes, fewer than the 8 of a safetensors header's length",
                      "copy or download it again"),
    # 1 to 3 bytes may be text as well as a header's length cut short: it was "truncated: 2 bytes, fewer than the 8
    # of a safetensors header's length", hint: copy or download it again
    "two_bytes": (lambda good: good[:2], r"it has 2 bytes, too few to be a safetensors file \(one begins with the 8 "
                  r"bytes of its header's length\)$", "give the path of the .safetensors file"),
    # text of fewer than 8 bytes (a placeholder file): it was "truncated: 5 bytes, fewer than the 8 of a safetensors
    # header's length", hint: copy or download it again
    "short_text": (lambda good: b"none\n", r"it is a text file \(it begins 'none\\n'\), not safetensors",
                   "give the path of the .safetensors file"),
    "cut_in_header": (lambda good: good[:100], r"truncated or damaged inside its header: the header alone should "
                      r"take \d+ bytes, the file has 100", "copy or download it again"),
    "cut_in_data": (lambda good: good[:-1], r"truncated: its header declares (\d+) bytes, the file has (\d+)$",
                    "copy or download it again"),
    "bytes_after_the_data": (lambda good: good + b"junk", r"it has \d+ bytes, 4 more than its header declares",
                             "copy or download it again"),
    "huge_header_length": (lambda good: (2**62).to_bytes(8, "little") + good[8:],
                           rf"its header's length is damaged: it says {2**62} bytes, more than the 100000000",
                           "copy or download it again"),
    "text": (lambda good: b"weights are on the shared drive\n", r"it is a text file \(it begins 'weights are on the "
             r"shared drive\\n'\), not safetensors", "give the path of the .safetensors file"),
    # UTF-8 beyond ASCII (an accent, a dash, a BOM): it was "it is not a safetensors file: its first 8 bytes give a
    # header length of ..." with the hint to convert a pickle
    "utf8_text": (lambda good: "poids du modèle — sur le disque partagé\n".encode(),
                  r"it is a text file \(it begins 'poids du modèle — sur le disque partagé\\n'\), not safetensors",
                  "give the path of the .safetensors"),
    "text_with_bom": (lambda good: "\ufeffcheckpoint: /mnt/models/world.safetensors\n".encode(),
                      r"it is a text file \(it begins 'checkpoint: /mnt/models/world.safetensor'\), not safetensors",
                      "give the path of the .safetensors"),
    "git_lfs_pointer": (lambda good: b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64
                        + b"\nsize 650056\n", r"it is a Git LFS pointer \(\d+ bytes\), not the weights",
                        "git lfs pull"),
    "pickle": (lambda good: b"\x80\x04not a safetensors file", r"it is a pickle \(torch.save / pickle.dump\), not "
               "safetensors", "pickled checkpoints are never loaded"),
    # a zip that no torch.save wrote: its hint was to convert it with torch.load, which refuses it
    "zip_not_torch_save": (_zip_of_weights, r"it is a zip archive, not safetensors$",
                           "give the path of the .safetensors file"),
    # its JSON damaged (a byte changed on the disk): it was "it is not a safetensors file", hint: convert a pickle
    "damaged_header_json": (lambda good: good[:9] + b"X" + good[10:], r"its header is damaged: .*invalid JSON",
                            "write it again"),
    "overlapping_offsets": (None, r"its header is damaged: .*offset", "write it again"),
}


def _overlapping(good: bytes) -> bytes:
    import json

    header = json.loads(good[8:8 + _header_length(good)])
    first, second = sorted(k for k in header if k != "__metadata__")[:2]
    header[second]["data_offsets"] = header[first]["data_offsets"]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + good[8 + _header_length(good):]


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_an_unreadable_checkpoint_says_what_the_file_is_and_what_to_do(tmp_path, case):
    make, says, hint = UNREADABLE[case]
    _, good = _good_checkpoint(tmp_path)
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(_overlapping(good) if make is None else make(good))
    with pytest.raises(CheckpointError) as raised:
        causal_world.pipeline_class().from_config(tiny(causal_world), device="cpu", checkpoint=path)
    message = str(raised.value)
    assert message.startswith(f"cannot read checkpoint {path}: "), message
    assert re.search(says, message.removeprefix(f"cannot read checkpoint {path}: ")), message
    assert hint in raised.value.hint, raised.value.hint
    if case == "cut_in_data":
        assert re.search(rf"declares {len(good)} bytes, the file has {len(good) - 1}$", message), message


def test_a_torch_save_checkpoint_is_named_as_one(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"transformer.head.head.weight": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match=r": it is a torch\.save file \(a zip holding a pickle\), not "
                                              r"safetensors$") as raised:
        causal_world.pipeline_class().from_config(tiny(causal_world), device="cpu", checkpoint=path)
    assert "safetensors.torch.save_file" in raised.value.hint


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_as_they_load_naming_the_tensor(tmp_path, value):
    """Weights holding NaN or inf made every output NaN: a rollout failed at its warmup (exit 1, its hint naming the
    sampling settings first) with run.json written, so the same command with the fixed file was refused (a run is
    there) and so was --resume (the checkpoint changed)."""
    cls = causal_world.pipeline_class()
    state = fresh_modules(lambda: cls.build_modules(tiny(causal_world)), 0).state_dict()
    state["transformer.head.head.weight"].view(-1)[3] = value
    path = tmp_path / "diverged.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    kind = "NaN" if value != value else "inf"
    with pytest.raises(CheckpointError, match=rf"^checkpoint {re.escape(str(path))} holds weights that are not finite "
                                              rf"in float32: 1 tensor: transformer\.head\.head\.weight: 1 {kind} of "
                                              rf"\d+ values$"):
        cls.from_config(tiny(causal_world), device="cpu", checkpoint=path)


def test_a_float32_weight_past_float16s_range_is_refused_in_float16_with_bfloat16_named(tmp_path):
    cls = causal_world.pipeline_class()
    state = fresh_modules(lambda: cls.build_modules(tiny(causal_world)), 0).state_dict()
    state["transformer.head.head.weight"].view(-1)[0] = 1e6
    path = tmp_path / "wide.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    cls.from_config(tiny(causal_world), device="cpu", checkpoint=path)  # finite in float32
    with pytest.raises(CheckpointError, match=r"not finite in float16: 1 tensor: transformer\.head\.head\.weight: "
                                              r"1 inf of") as raised:
        cls.from_config(tiny(causal_world), device="cpu", dtype=torch.float16, checkpoint=path)
    assert "bfloat16 keeps float32's range" in raised.value.hint


@pytest.mark.parametrize("case", ["cut_in_data", "nan"])
def test_rollout_of_a_bad_checkpoint_exits_2_with_one_error_line_and_writes_no_run(tmp_path, cli_env, case):
    """Through the real CLI: one `Error:` line naming the file, a hint, exit 2 and no run in --out (only the
    .lock a loading run holds), so the same command runs once the file is fixed."""
    path, good = _good_checkpoint(tmp_path)
    if case == "nan":
        state = load_file(str(path))
        state["transformer.head.head.weight"].view(-1)[0] = float("nan")
        save_file(state, str(path), metadata=read_metadata(path))
    else:
        path.write_bytes(good[:-1])
    config = tmp_path / "world.yaml"
    config.write_text("pipeline: causal_world\ncheckpoint: good.safetensors\nmodel: {preset: tiny}\n")
    out = tmp_path / "out"
    args = [sys.executable, "-m", "ardiff_cli", "rollout", str(config), "--out", str(out), "--format", "plain"]
    proc = subprocess.run(args, env=cli_env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert proc.returncode == 2, proc.stderr
    assert len(errors) == 1 and str(path) in errors[0] and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(r"^hint: ", proc.stderr, re.M), proc.stderr
    assert errors[0].endswith(f"declares {len(good)} bytes, the file has {len(good) - 1}") if case != "nan" \
        else "holds weights that are not finite in float32" in errors[0], errors[0]
    assert sorted(p.name for p in out.iterdir()) == [".lock"]
    plan = subprocess.run([sys.executable, "-m", "ardiff_cli", "inspect-capacity", str(config), "--format", "plain"],
                          env=cli_env, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0 and "Error" not in plan.stderr, plan.stderr  # a plan reads no weights
    path.write_bytes(good)  # fixed: the same command runs
    proc = subprocess.run(args, env=cli_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_finite_weights_whose_sum_overflows_are_accepted():
    """The check sums each tensor first and looks at every value only when the sum is not finite: a float16 weight
    of finite values whose sum passes 65504 is looked at, and accepted."""
    module = torch.nn.Linear(64, 64).half()
    torch.nn.init.constant_(module.weight, 60000.0)
    assert not torch.isfinite(module.weight.sum())
    checkpoint.refuse_non_finite(module, "m.safetensors", torch.float16)
    module.weight.data[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"weight: 1 NaN of 4096 values$"):
        checkpoint.refuse_non_finite(module, "m.safetensors", torch.float16)


def test_a_float16_weight_whose_sum_passes_65504_is_not_looked_at_value_by_value():
    """Its sum overflows float16 (2**20 values of 0.0625: 65536), so the whole-tensor sum was inf and every value was
    looked at with ``isfinite``, 60 times slower than a sum (0.3 against 20 GiB/s on one CPU thread) and a bool copy of
    the weight allocated: seconds more to load a large float16 model. Sums of 4096 values each stay in range."""
    module = torch.nn.Linear(1024, 1024, bias=False).half()
    torch.nn.init.constant_(module.weight, 0.0625)
    assert not torch.isfinite(module.weight.sum())

    class Sizes(torch.overrides.TorchFunctionMode):  # the size of every tensor isfinite is given
        seen: list[int] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.isfinite, torch.Tensor.isfinite):
                self.seen.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    with Sizes() as sizes:
        checkpoint.refuse_non_finite(module, "m.safetensors", torch.float16)
    assert sizes.seen and max(sizes.seen) < module.weight.numel(), sizes.seen
    module.weight.data[1000, 3] = float("inf")
    with pytest.raises(CheckpointError, match=r"weight: 1 inf of 1048576 values$"):
        checkpoint.refuse_non_finite(module, "m.safetensors", torch.float16)


def test_a_buffer_that_holds_inf_on_purpose_is_not_refused_a_parameter_is():
    """The check read the whole state dict: a third-party model's attention mask buffer of -inf (saved with its
    weights, as a persistent buffer is) was refused as "weights that are not finite"."""
    module = torch.nn.Linear(4, 4)
    module.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
    checkpoint.refuse_non_finite(module, "m.safetensors", torch.float32)
    with torch.no_grad():
        module.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"1 tensor: weight: 1 NaN of 16 values"):
        checkpoint.refuse_non_finite(module, "m.safetensors", torch.float32)


def test_a_buffer_that_holds_nan_is_refused_as_a_parameter_is():
    """Parameters only were read (so that a mask of -inf passes): a normalisation's running statistics of a run that
    diverged (NaN, saved with the weights as a persistent buffer is) loaded, and every output was NaN."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    module.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))
    module.register_buffer("scratch", torch.full((2,), float("nan")), persistent=False)  # not the file's: the code's
    checkpoint.refuse_non_finite(module, "m.safetensors", torch.float32)
    module[1].running_var[2] = float("nan")
    with pytest.raises(CheckpointError, match=r"1 tensor: 1\.running_var: 1 NaN of 4 values"):
        checkpoint.refuse_non_finite(module, "m.safetensors", torch.float32)


def test_a_disk_error_reading_a_whole_checkpoint_is_not_said_to_be_its_header(tmp_path):
    """An OSError as the weights are read (EIO from a failing disk) is the disk's say, not the file's bytes: with a
    whole file it was "its header is damaged: [Errno 5] ...", with the hint to write it again; then it was hinted
    "is it a .safetensors file? pickled checkpoints are never loaded"."""
    path, _ = _good_checkpoint(tmp_path)
    error = checkpoint._unreadable(path, OSError(5, "Input/output error"))
    assert str(error) == f"cannot read checkpoint {path}: [Errno 5] Input/output error", error
    assert "damaged" not in str(error) and "write it again" not in (error.hint or ""), error.hint
    # nor asked whether it is a .safetensors file, or told that pickles are never loaded: the disk is named
    assert "pickle" not in error.hint and "safetensors" not in error.hint and "disk" in error.hint, error.hint


def test_checkpoint_messages_name_a_folder_named_tilde_as_dot_slash_tilde(tmp_path, monkeypatch, capsys):
    """A checkpoint in a folder named ``~`` of the working folder (``checkpoint: ./~/w.safetensors``, or ``./~/w``
    given to init) was named ``~/w.safetensors`` (Path drops the ``./``) by every message about it: pasted into a
    shell, that is the home folder's file. They say ``./~/...``, as the config's own messages (``as_typed``) do."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "~").mkdir()
    cls = causal_world.pipeline_class()
    assert main(["init", "causal-world-tiny", "./~/good.safetensors"]) == 0
    assert capsys.readouterr().out == "./~/good.safetensors\n"  # it printed ~/good.safetensors
    assert main(["init", "causal-world-tiny", "./~/good.safetensors"]) == 2
    assert capsys.readouterr().err.startswith("Error: ./~/good.safetensors exists: "), "init over a file"
    good = (tmp_path / "~" / "good.safetensors").read_bytes()
    state = load_file(str(tmp_path / "~" / "good.safetensors"))
    state["transformer.head.head.weight"].view(-1)[0] = float("nan")
    files = {
        "cut short": (good[:-1], r"cannot read checkpoint \./~/w\.safetensors: truncated: "),
        "empty": (b"", r"cannot read checkpoint \./~/w\.safetensors: the file is empty"),
        "text": (b"weights are elsewhere\n", r"cannot read checkpoint \./~/w\.safetensors: it is a text file"),
        "another geometry": (good, r"checkpoint \./~/w\.safetensors was written for another causal_world geometry"),
        "other keys": (None, r"checkpoint \./~/w\.safetensors does not match the model config: "),
        "NaN": (state, r"checkpoint \./~/w\.safetensors holds weights that are not finite in float32: "),
    }
    path = tmp_path / "~" / "w.safetensors"
    for case, (content, says) in files.items():
        if content is None:
            save_file({"x": torch.zeros(2)}, str(path))
        elif isinstance(content, dict):
            save_file(content, str(path))
        else:
            path.write_bytes(content)
        config = tiny(causal_world, num_heads=2) if case == "another geometry" else tiny(causal_world)
        with pytest.raises(CheckpointError) as raised:
            cls.from_config(config, device="cpu", checkpoint=Path("./~/w.safetensors"))
        assert re.match(says, str(raised.value)), (case, str(raised.value))
    path.unlink()
    with pytest.raises(CheckpointError, match=r"^checkpoint not found: \./~/w\.safetensors$"):
        cls.from_config(tiny(causal_world), device="cpu", checkpoint=Path("./~/w.safetensors"))
    path.mkdir()
    with pytest.raises(CheckpointError, match=r"^checkpoint \./~/w\.safetensors is a folder, not a file$"):
        cls.from_config(tiny(causal_world), device="cpu", checkpoint=Path("./~/w.safetensors"))
