"""Causal world pipeline: paged rollout == dense recompute, sink + window, conditioning, prompt switch, seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ardiff_cli.runtime.errors import ObservationError
from pipeline_helpers import Driver, RecordingRollout, causal_world
from pipelines.base import noise_generator, shift_sigma, shifted_sigmas
from pipelines.encoders import to_uint8, tokenize
from pipelines.rollout import DenseReferenceRollout
from pipelines.wan import Segment, sinusoidal_embedding

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("cond_dim", [8, 0], ids=["conditioned", "unconditioned"])
@pytest.mark.parametrize("sink, window, block", [(3, 6, 3), (0, 4, 3), (2, 5, 3), (4, 2, 3), (1, 1, 1), (0, 2, 2)],
                         ids=["sink3-window6-block3", "no-sink", "window-not-a-multiple-of-the-block",
                              "sink-over-a-block", "one-frame-blocks", "window-of-one-block"])
def test_paged_rollout_equals_dense_recompute(cond_dim, sink, window, block):
    """Six blocks through a sink + window, paged vs dense with the explicit mask: the window passed several times,
    also where it holds a part of a block or the sink does."""
    pipe = causal_world(cond_dim=cond_dim, sink_frames=sink, window_frames=window, frames_per_block=block)
    driver = Driver(pipe, num_sessions=1)
    reference = DenseReferenceRollout(pipe.transformer, sink_frames=sink, window_frames=window,
                                      cross_names=pipe.cross_names)
    for step in range(6):
        inputs = pipe.example_inputs(prompt="a red car drives through a snowy forest", seed=step)
        paged = driver.run("s", inputs)
        dense = pipe.step("reference", reference, inputs)
        torch.testing.assert_close(paged["latents"], dense["latents"], atol=1e-5, rtol=0)
    adapter = driver.state("s").adapter("main")
    assert adapter.num_committed_frames == reference.num_frames("main") == 6 * block
    assert adapter.num_resident_frames == sink + window < 6 * block


def test_outputs_spec_and_model_owned_state():
    pipe = causal_world()
    driver = Driver(pipe)
    out = driver.run("s", pipe.example_inputs())
    assert out["latents"].shape == (4, 3, 8, 8) and out["latents"].dtype == torch.float32
    assert pipe.decode_latents(out["latents"]).shape == (12, 32, 32, 3)
    spec = pipe.ar_diffusion_kv_cache_spec()
    assert pipe.model_owned_state_bytes("s") == spec.model_owned_state_bytes_per_session == 0
    assert driver.state("s").adapter("main").num_committed_frames == 3
    driver.close("s")
    assert driver.cache.num_free_pages == driver.cache.num_managed_pages


def test_conditioning_and_seed_steer_the_block():
    pipe = causal_world()
    driver = Driver(pipe, num_sessions=4)
    base = {"prompt": "a boat on a lake", "seed": 3, "conditioning": np.zeros(8, np.float32)}
    a = driver.run("a", base)["latents"]
    b = driver.run("b", base)["latents"]
    c = driver.run("c", {**base, "conditioning": np.ones(8, np.float32)})["latents"]
    d = driver.run("d", {**base, "seed": 4})["latents"]
    assert torch.equal(a, b)
    assert not torch.allclose(a, c) and not torch.allclose(a, d)
    no_cond = driver.run("a", {"prompt": "a boat on a lake", "seed": 3})  # a zero vector stands in
    assert no_cond["latents"].shape == a.shape


def test_wrong_conditioning_is_named():
    pipe = causal_world()
    driver = Driver(pipe)
    with pytest.raises(ObservationError, match=r"'conditioning' has shape \(3,\), expected \(8,\)"):
        driver.run("s", {"prompt": "x", "conditioning": np.zeros(3, np.float32)})
    with pytest.raises(ObservationError, match="missing prompt 'prompt' or 'caption'"):
        driver.run("s", {"conditioning": np.zeros(8, np.float32)})
    unconditioned = causal_world(cond_dim=0)
    with pytest.raises(ObservationError, match="unknown key 'conditioning'"):
        Driver(unconditioned).run("s", {"prompt": "x", "conditioning": np.zeros(8, np.float32)})
    assert driver.cache.num_free_pages == driver.cache.num_managed_pages


def test_prompt_switch_keeps_history_and_replaces_text():
    pipe = causal_world()
    driver = Driver(pipe, num_sessions=1)
    for block in range(2):
        driver.run("s", pipe.example_inputs(prompt="a quiet street", seed=block))
    state = driver.state("s")
    text = state.cross_attention("main", "text")
    driver.run("s", pipe.example_inputs(prompt="a quiet street at night", seed=2))
    assert state.adapter("main").num_committed_frames == 9  # history kept
    assert state.cross_attention("main", "text") is not text
    assert not torch.allclose(state.cross_attention("main", "text")[0][0], text[0][0])
    assert pipe.sessions["s"].prompt == "a quiet street at night" and pipe.sessions["s"].num_blocks == 3


def test_reset_and_close_start_over():
    pipe = causal_world()
    driver = Driver(pipe)
    first = driver.run("s", pipe.example_inputs(seed=0))
    driver.run("s", pipe.example_inputs(seed=1))
    driver.reset("s")
    again = driver.run("s", pipe.example_inputs(seed=0))
    torch.testing.assert_close(first["latents"], again["latents"], atol=0, rtol=0)
    assert driver.state("s").adapter("main").num_committed_frames == 3


@pytest.mark.parametrize("cond_dim", [8, 0], ids=["conditioned", "unconditioned"])
def test_sampler_denoises_renoises_and_commits_the_clean_block_it_returns(cond_dim):
    """The DMD sampler checked on the real model's own predictions, two blocks drawn with the same seed.

    Each pass i at sigma_i (the shifted schedule) predicts v; x0 = x - sigma_i v; the next pass sees
    (1 - sigma_{i+1}) x0 + sigma_{i+1} fresh noise; the block returned is the last x0, and the commit pass
    writes exactly that block at timestep 0 with the block's conditioning token. Every block draws its own
    noise: the first pass of block b starts from noise_generator(seed, b). The paged-vs-dense test cannot
    see a wrong update rule, since both sides run the same sampler.
    """
    pipe = causal_world(cond_dim=cond_dim)
    c = pipe.config
    rollout = RecordingRollout(pipe, sink_frames=c.sink_frames, window_frames=c.window_frames)
    shape = (c.latent_channels, c.frames_per_block, c.latent_height, c.latent_width)
    schedule = [shift_sigma(t / 1000.0, c.timestep_shift) for t in c.denoising_timesteps]
    starts = []
    for block in range(2):
        rollout.passes.clear()
        out = pipe.step("s", rollout, pipe.example_inputs(seed=7))
        *denoise, (_, commit, committed, _) = rollout.passes
        assert committed and not any(p[2] for p in denoise) and len(denoise) == len(schedule)
        gen = noise_generator(7, block)
        noise = [torch.randn(shape, generator=gen) for _ in denoise]
        assert torch.equal(denoise[0][1].latents, noise[0])
        starts.append(noise[0])
        sigmas = [seg.timesteps[0].item() / 1000.0 for _, seg, _, _ in denoise]
        np.testing.assert_allclose(sigmas, schedule, rtol=1e-6)
        for i, (_, seg, _, prediction) in enumerate(denoise):
            x0 = seg.latents - sigmas[i] * prediction.video
            if i + 1 < len(denoise):
                renoised = (1.0 - sigmas[i + 1]) * x0 + sigmas[i + 1] * noise[i + 1]
                torch.testing.assert_close(denoise[i + 1][1].latents, renoised)
        torch.testing.assert_close(out["latents"], x0)
        assert torch.equal(commit.latents, out["latents"]) and not commit.timesteps.any()
        assert commit.first_frame == block * c.frames_per_block
        if cond_dim:
            assert torch.equal(commit.registers, denoise[0][1].registers) and not commit.register_timesteps.any()
        else:
            assert commit.registers is None
    assert not torch.equal(starts[0], starts[1])


@pytest.mark.parametrize("backend", ["torch", "kernel"])
def test_commit_pass_without_outputs_writes_what_a_full_commit_pass_writes(backend):
    """``rollout.commit`` (the last layer only projects and stores its K/V) against ``run(commit=True)`` (every
    layer attends, the head runs), on two sessions of one cache fed the same segments, with a register token,
    past several window wraps: every later pass returns bit-identical outputs, so every layer committed the same
    K/V. ``kernel`` is the paged-kernel layout (the stand-in with 3-token blocks, leaving a tail in every page).
    The dense reference's ``run(commit=True)``, which no sampler of ours calls, makes history as the paged one."""
    from ardiff_cli.runtime.kv.cache import ARDiffusionKVCache
    from ardiff_cli.runtime.kv.layout import KVLayout
    from ardiff_cli.runtime.kv.vllm_attention import TorchPagedKernel
    from pipelines.rollout import PagedRollout
    from pipelines.wan import Segment

    pipe = causal_world(cond_dim=8)
    c = pipe.config
    spec = pipe.ar_diffusion_kv_cache_spec()
    cache = ARDiffusionKVCache(spec, KVLayout.from_spec(spec).managed_pages(2), dtype=pipe.dtype,
                               attention_backend="torch" if backend == "torch" else TorchPagedKernel(3))
    full, lean = (PagedRollout(pipe.transformer, cache.new_state(s), pipe.cross_names) for s in ("full", "lean"))
    dense = DenseReferenceRollout(pipe.transformer, sink_frames=c.sink_frames, window_frames=c.window_frames,
                                  cross_names=pipe.cross_names)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        text = list(pipe._text_kv("a lighthouse at dusk"))
        for rollout in (full, lean, dense):
            rollout.set_cross("main", "text", iter(text))
        num_blocks = 3 * (c.sink_frames + c.window_frames) // c.frames_per_block
        for _ in range(num_blocks):
            latents = torch.randn((c.latent_channels, c.frames_per_block, c.latent_height, c.latent_width),
                                  generator=gen)
            registers = pipe.transformer.registers(torch.randn(c.cond_dim, generator=gen))
            first = full.num_frames("main")

            def segment(t: float) -> Segment:
                return Segment(latents=latents, timesteps=torch.full((c.frames_per_block,), t), first_frame=first,
                               registers=registers, register_timesteps=torch.zeros(1))

            a, b = (rollout.run("main", segment(500.0), commit=False) for rollout in (full, lean))
            assert torch.equal(a.video, b.video) and torch.equal(a.registers, b.registers)
            torch.testing.assert_close(dense.run("main", segment(500.0), commit=False).video, a.video, atol=1e-5,
                                       rtol=0)
            committed = full.run("main", segment(0.0), commit=True).video
            torch.testing.assert_close(dense.run("main", segment(0.0), commit=True).video, committed, atol=1e-5, rtol=0)
            assert lean.commit("main", segment(0.0)) is None
    frames = num_blocks * c.frames_per_block
    assert full.num_frames("main") == lean.num_frames("main") == dense.num_frames("main") == frames


def test_shifted_schedule_is_wans_and_runs_from_pure_noise_to_data():
    """Wan's shift s' = k s / (1 + (k - 1) s): it keeps the ends (1 = noise, 0 = data) and warps the middle."""
    for k in (1.0, 3.0, 5.0):
        sigmas = shifted_sigmas(4, k)
        assert sigmas[0] == pytest.approx(1.0) and sigmas[-1] == 0.0
        assert all(a > b for a, b in zip(sigmas, sigmas[1:]))
    assert shift_sigma(0.5, 5.0) == pytest.approx(2.5 / 3.0)
    assert shift_sigma(0.25, 3.0) == pytest.approx(0.5)


def test_noise_of_neighbouring_seed_counter_pairs_is_independent():
    """(seed 0, request 1) and (seed 1, request 0) are different draws: seed + counter must not collide."""
    draws = {}
    for seed, counter in [(0, 1), (1, 0), (2, 0), (1, 1), (0, 2)]:
        draws[(seed, counter)] = torch.randn(16, generator=noise_generator(seed, counter))
    keys = list(draws)
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            assert not torch.equal(draws[a], draws[b]), (a, b)


def test_a_request_without_seed_uses_the_configs_seed():
    pipe = causal_world(seed=7)
    inputs = pipe.example_inputs(seed=0)
    del inputs["seed"]
    rollout = lambda: RecordingRollout(pipe, sink_frames=pipe.config.sink_frames,  # noqa: E731
                                       window_frames=pipe.config.window_frames)
    default = pipe.step("a", rollout(), inputs)["latents"]
    seven = pipe.step("b", rollout(), {**inputs, "seed": 7})["latents"]
    zero = pipe.step("c", rollout(), {**inputs, "seed": 0})["latents"]
    assert torch.equal(default, seven) and not torch.equal(default, zero)


def test_missing_conditioning_is_a_zero_vector():
    pipe = causal_world(cond_dim=8)
    c = pipe.config
    inputs = pipe.example_inputs(seed=3)
    rollout = lambda: RecordingRollout(pipe, sink_frames=c.sink_frames, window_frames=c.window_frames)  # noqa: E731
    without = {k: v for k, v in inputs.items() if k != "conditioning"}
    zeros = {**inputs, "conditioning": np.zeros(8, np.float32)}
    torch.testing.assert_close(pipe.step("a", rollout(), without)["latents"],
                               pipe.step("b", rollout(), zeros)["latents"], atol=0, rtol=0)


def _dense(model):
    return [lambda q, k, v: F.scaled_dot_product_attention(q, k, v)] * model.num_layers


def test_register_timesteps_condition_the_registers():
    """A register's own diffusion time modulates it (not its block's first frame's)."""
    pipe = causal_world(cond_dim=8)
    model, c = pipe.transformer, pipe.config
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(c.in_dim, c.frames_per_block, c.latent_height, c.latent_width, generator=gen)
    regs = torch.randn(1, c.dim, generator=gen)
    text_kv = list(model.project_text(pipe.text_encoder("a street")))

    def registers(t_reg: float) -> torch.Tensor:
        seg = Segment(latents=latents, timesteps=torch.full((c.frames_per_block,), 700.0), first_frame=0,
                      registers=regs, register_timesteps=torch.tensor([t_reg]))
        return model(seg, _dense(model), text_kv).registers

    assert not torch.allclose(registers(0.0), registers(700.0))


def test_a_register_sits_at_its_blocks_first_frame_and_the_grid_origin():
    """A register carrying exactly video token 0's embedding, at token 0's time, is indistinguishable from it
    (same position: the block's first frame, row 0, col 0), so it ends with token 0's prediction."""
    pipe = causal_world(cond_dim=8)
    model, c = pipe.transformer, pipe.config
    gen = torch.Generator().manual_seed(1)
    num_frames, t = 2, 600.0
    latents = torch.randn(c.in_dim, num_frames, c.latent_height, c.latent_width, generator=gen)
    text_kv = list(model.project_text(pipe.text_encoder("a street")))
    seg = Segment(latents=latents, timesteps=torch.full((num_frames,), t), first_frame=5,
                  registers=model.patchify(latents)[:1], register_timesteps=torch.tensor([t]))
    out = model(seg, _dense(model), text_kv)
    e0 = model.time_embedding(sinusoidal_embedding(torch.tensor([t]), model.freq_dim)).float()
    _, ph, pw = model.patch_size
    register_patch = model.head(out.registers, e0).float().view(ph, pw, model.out_dim).permute(2, 0, 1)
    torch.testing.assert_close(register_patch, out.video[:, 0, :ph, :pw], atol=1e-5, rtol=1e-5)


def test_to_uint8_rounds():
    assert to_uint8(torch.tensor([0.999 / 127.5 - 1.0])).item() == 1  # 0.999 -> 1, not truncated to 0


def test_prompt_whitespace_and_unicode_form_do_not_change_the_tokens():
    assert tokenize("pick  up\tthe cube ", 32) == tokenize("pick up the cube", 32)
    assert tokenize("cafe\u0301", 16) == tokenize("caf\u00e9", 16)


def test_text_padding_positions_are_zero():
    pipe = causal_world()
    states = pipe.text_encoder("hi")  # 2 bytes + EOS, the rest padding
    assert states[3:].abs().sum() == 0 and states[:3].abs().sum() > 0


@pytest.mark.parametrize("seed", [np.int64(3), np.array(3), torch.tensor(3), torch.tensor(3, dtype=torch.uint8)],
                         ids=["numpy_int", "numpy_0d_array", "tensor", "tensor_uint8"])
def test_a_request_seed_given_as_a_0d_tensor_or_numpy_scalar_is_the_integer_it_holds(seed):
    """A request's noise seed taken from a tensor (``torch.randint(...)[i]``) or a 0-d numpy array was refused as
    "'seed' must be a non-negative integer, got tensor(3)": it is the integer it holds, as a config's seed is."""
    driver = Driver(causal_world(), num_sessions=2)
    plain = driver.run("a", {"prompt": "a boat on a lake", "seed": 3})["latents"]
    assert torch.equal(driver.run("b", {"prompt": "a boat on a lake", "seed": seed})["latents"], plain)


@pytest.mark.parametrize("seed", [torch.tensor(3.0), torch.tensor([3]), np.array([3]), np.bool_(True),
                                  torch.tensor(True), torch.tensor(-1), 3.0, np.timedelta64(3, "ns")],
                         ids=["float_tensor", "tensor_1d", "numpy_1d", "numpy_bool", "tensor_bool", "negative",
                              "float", "numpy_timedelta"])
def test_a_request_seed_that_holds_no_non_negative_integer_is_refused_naming_it(seed):
    driver = Driver(causal_world())
    with pytest.raises(ObservationError, match=r"^request inputs: 'seed' must be a non-negative integer, got "):
        driver.run("a", {"prompt": "a boat on a lake", "seed": seed})
    assert driver.cache.num_free_pages == driver.cache.num_managed_pages
