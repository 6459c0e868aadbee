"""DreamZero pipeline: paged rollout == dense recompute, CFG branches, window and prompt resets, schema."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ardiff_cli.runtime.errors import ObservationError
from ardiff_cli.runtime.request import ARDiffusionRequest
from pipeline_helpers import Driver, RecordingRollout, dreamzero
from pipelines.base import noise_generator, shifted_sigmas
from pipelines.dreamzero import SCHEMA
from pipelines.dreamzero.config import CAMERAS
from ardiff_cli.runtime import validate_observation  # the public name the README gives pipeline authors
from pipelines.rollout import DenseReferenceRollout

pytestmark = pytest.mark.usefixtures("single_thread")


def steps(pipe, n: int, *, prompt: str = "put the cup in the bowl", start: int = 0):
    """Inputs of a session: one frame first, then four-frame requests."""
    return [pipe.example_inputs(1 if i == 0 else 4, prompt=prompt, seed=start + i) for i in range(n)]


@pytest.mark.parametrize("guidance_scale", [3.0, 1.0], ids=["cfg", "no-cfg"])
@pytest.mark.parametrize("reset_at_window", [False, True], ids=["sliding", "window-reset"])
def test_paged_rollout_equals_dense_recompute(guidance_scale, reset_at_window):
    """More requests than sink + window hold, paged KV vs full recompute under the explicit mask (float32).

    CFG multiplies each branch's float32 rounding by about 2 * guidance_scale; at 3.0 the worst difference
    measured is ~3e-6 against the 1e-5 bound (a wrong sink or window is off by > 1e-2).
    """
    pipe = dreamzero(guidance_scale=guidance_scale, reset_at_window=reset_at_window, sink_frames=1, window_frames=3)
    driver = Driver(pipe, num_sessions=1)
    reference = DenseReferenceRollout(pipe.transformer, sink_frames=1, window_frames=3, cross_names=pipe.cross_names)
    for inputs in steps(pipe, 7):
        paged = driver.run("s", inputs)
        dense = pipe.step("reference", reference, inputs)
        torch.testing.assert_close(paged["actions"], dense["actions"], atol=1e-5, rtol=0)
        torch.testing.assert_close(paged["latents"], dense["latents"], atol=1e-5, rtol=0)
    state = driver.state("s")
    if reset_at_window:
        assert state.adapter("positive").num_committed_frames == 3  # restarted after 4 frames: 1 + 2 since
    else:
        assert reference.num_frames("positive") == 7  # more than sink 1 + window 3
        assert state.adapter("positive").num_resident_frames == 4
    assert state.spec.branch_names == (("positive", "negative") if guidance_scale != 1.0 else ("positive",))


def test_outputs_and_model_owned_state():
    pipe = dreamzero()
    driver = Driver(pipe)
    spec = pipe.ar_diffusion_kv_cache_spec()
    out = driver.run("s", steps(pipe, 1)[0])
    assert out["actions"].shape == (8, 8) and out["actions"].dtype == torch.float32
    assert out["latents"].shape == (4, 1, 8, 8)
    rgb = pipe.decode_latents(out["latents"])
    assert rgb.shape == (4, 32, 32, 3) and rgb.dtype == np.uint8
    # The model-owned state is exactly what the spec declares to the capacity planner.
    assert pipe.model_owned_state_bytes("s") == spec.model_owned_state_bytes_per_session > 0
    driver.close("s")
    assert pipe.model_owned_state_bytes("s") == 0
    assert driver.cache.num_free_pages == driver.cache.num_managed_pages


def test_cfg_branches_are_independent():
    """The negative prompt changes the negative branch only: positive pages and caches are bit-identical."""
    a, b = dreamzero(), dreamzero(negative_prompt="blurry, static")
    da, db = Driver(a), Driver(b)
    for inputs in steps(a, 3):
        da.run("s", inputs)
        db.run("s", inputs)
    sa, sb = da.state("s"), db.state("s")

    def pages(driver, state, branch):
        ids = torch.tensor(state.adapter(branch).page_ids)
        return driver.cache.pool.kv[:, :, :, ids]  # (layers, K|V, heads, pages, tokens, dim)

    assert torch.equal(pages(da, sa, "positive"), pages(db, sb, "positive"))
    assert not torch.allclose(pages(da, sa, "negative"), pages(db, sb, "negative"))
    for (ka, _), (kb, _) in zip(sa.cross_attention("positive", "text"), sb.cross_attention("positive", "text")):
        assert torch.equal(ka, kb)
    for (ka, _), (kb, _) in zip(sa.cross_attention("negative", "text"), sb.cross_attention("negative", "text")):
        assert not torch.allclose(ka, kb)
    # Separate storage: disjoint pages, separate cross-attention tensors even for the shared image.
    assert set(sa.adapter("positive").page_ids).isdisjoint(sa.adapter("negative").page_ids)
    (kp, _), (kn, _) = sa.cross_attention("positive", "image")[0], sa.cross_attention("negative", "image")[0]
    assert torch.equal(kp, kn) and kp.data_ptr() != kn.data_ptr()


def test_window_reset_keeps_text_and_reprojects_image():
    pipe = dreamzero()  # window 4, no sink, reset_at_window
    driver = Driver(pipe, num_sessions=1)
    for inputs in steps(pipe, 4):
        driver.run("s", inputs)
    state = driver.state("s")
    assert state.adapter("positive").num_committed_frames == 4  # the window is full
    text = state.cross_attention("positive", "text")
    image = state.cross_attention("negative", "image")

    inputs = pipe.example_inputs(4, prompt="put the cup in the bowl", seed=99)
    driver.run("s", inputs)
    assert state.adapter("positive").num_committed_frames == 1  # a new window: the anchor frame alone
    assert state.cross_attention("positive", "text") is text  # kept as it was
    new_image = state.cross_attention("negative", "image")
    assert new_image is not image
    newest = pipe._camera_frames(validate_observation(SCHEMA, inputs, where="t"))[-1]
    expected = list(pipe.transformer.project_image(pipe.image_encoder(newest)))
    for (k, v), (k_ref, v_ref) in zip(new_image, expected):
        torch.testing.assert_close(k, k_ref)
        torch.testing.assert_close(v, v_ref)
    torch.testing.assert_close(pipe.sessions["s"].anchor_latent, pipe.vae.encode(newest[None])[:, 0])
    assert driver.cache.num_managed_pages - driver.cache.num_free_pages == 2  # one frame per branch


def test_prompt_change_resets_the_session():
    pipe = dreamzero()
    driver = Driver(pipe, num_sessions=1)
    for inputs in steps(pipe, 3, prompt="open the drawer"):
        driver.run("s", inputs)
    state = driver.state("s")
    old_text = state.cross_attention("positive", "text")[0][0].clone()
    driver.run("s", pipe.example_inputs(4, prompt="close the drawer", seed=5))
    assert state.adapter("positive").num_committed_frames == 1
    assert not torch.allclose(state.cross_attention("positive", "text")[0][0], old_text)
    assert pipe.sessions["s"].prompt == "close the drawer" and pipe.sessions["s"].num_requests == 1


def test_evicted_session_asked_with_four_frames_starts_fresh():
    """After eviction a four-frame request is a fresh session anchored on its newest frame."""
    pipe = dreamzero()
    driver = Driver(pipe)
    for inputs in steps(pipe, 3):
        driver.run("s", inputs)
    driver.close("s")  # what LRU eviction does
    four = pipe.example_inputs(4, seed=42)
    out = driver.run("s", four)
    assert driver.state("s").adapter("positive").num_committed_frames == 1
    # Same as a brand-new session given only the newest frame.
    one = {k: (v[-1] if isinstance(v, np.ndarray) and v.ndim == 4 else v) for k, v in four.items()}
    fresh = driver.run("t", one)
    torch.testing.assert_close(out["actions"], fresh["actions"], atol=0, rtol=0)
    torch.testing.assert_close(out["latents"], fresh["latents"], atol=0, rtol=0)


def test_one_frame_request_on_a_live_session_restarts_the_window():
    pipe = dreamzero()
    driver = Driver(pipe, num_sessions=1)
    for inputs in steps(pipe, 3):
        driver.run("s", inputs)
    text = driver.state("s").cross_attention("positive", "text")
    driver.run("s", pipe.example_inputs(1, prompt="put the cup in the bowl", seed=7))
    assert driver.state("s").adapter("positive").num_committed_frames == 1
    assert driver.state("s").cross_attention("positive", "text") is text


def test_seed_input_changes_the_noise_only():
    pipe = dreamzero()
    driver = Driver(pipe)
    inputs = steps(pipe, 1)[0]
    a = driver.run("a", {**inputs, "seed": 1})
    b = driver.run("b", {**inputs, "seed": 1})
    c = driver.run("c", {**inputs, "seed": 2})
    assert torch.equal(a["actions"], b["actions"]) and not torch.equal(a["actions"], c["actions"])


def test_bad_requests_fail_before_any_kv_is_used():
    pipe = dreamzero()
    driver = Driver(pipe)
    inputs = steps(pipe, 1)[0]
    bad = dict(inputs)
    bad["wrist_image"] = inputs["wrist_image"].astype(np.float32)
    bad["joint_positions"] = bad.pop("joint_position")
    with pytest.raises(ObservationError) as err:
        driver.run("s", bad)
    message = str(err.value)
    assert "'wrist_image' has dtype float32, expected uint8" in message
    assert "unknown key 'joint_positions' (did you mean 'joint_position'?)" in message
    assert "missing 'joint_position'" in message
    two = {**inputs, **{k: np.stack([inputs[k]] * 2) for k in ("exterior_image_0", "exterior_image_1", "wrist_image")}}
    with pytest.raises(ObservationError, match="cameras carry 2 frames; expected 1 .* or 4") as err:
        driver.run("s", two)
    assert err.value.hint.endswith("the first step of an episode holds one frame, each later one 4")
    mixed = {**inputs, "wrist_image": np.stack([inputs["wrist_image"]] * 4)}
    with pytest.raises(ObservationError, match="different frame counts"):
        driver.run("s", mixed)
    with pytest.raises(ObservationError, match="'seed' must be a non-negative integer"):
        driver.run("s", {**inputs, "seed": -1})
    assert driver.cache.num_free_pages == driver.cache.num_managed_pages


def test_roboarena_and_droid_keys():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (20, 28, 3), dtype=np.uint8)
    joint, gripper, cartesian = rng.standard_normal(7), rng.random(1), rng.standard_normal(6)
    roboarena = {
        "observation/exterior_image_0_left": image, "observation/exterior_image_1_left": image,
        "observation/wrist_image_left": image, "observation/joint_position": joint.astype(np.float32),
        "observation/gripper_position": gripper.astype(np.float32),
        "observation/cartesian_position": cartesian.astype(np.float32), "prompt": "pick up the block",
    }
    droid = {  # DROID numbers exterior cameras from 1 and stores float64 proprioception
        "exterior_image_1_left": image, "exterior_image_2_left": image, "wrist_image_left": image,
        "joint_position": joint, "gripper_position": gripper, "cartesian_position": cartesian,
        "language_instruction": "pick up the block",
    }
    a = validate_observation(SCHEMA, roboarena, where="roboarena")
    b = validate_observation(SCHEMA, droid, where="droid")
    assert set(a) == set(b) == {"exterior_image_0", "exterior_image_1", "wrist_image", "joint_position",
                                "gripper_position", "cartesian_position", "prompt"}
    assert b["joint_position"].dtype == np.float32
    pipe = dreamzero()
    driver = Driver(pipe)
    out_a, out_b = driver.run("a", roboarena), driver.run("b", droid)  # cameras resized to the 16 x 16 tiles
    torch.testing.assert_close(out_a["actions"], out_b["actions"])


def test_schema_errors_name_keys_dtypes_and_shapes():
    image = np.zeros((8, 8, 3), np.uint8)
    base = {"exterior_image_0": image, "exterior_image_1": image, "wrist_image": image,
            "joint_position": np.zeros(7, np.float32), "gripper_position": np.zeros(1, np.float32), "prompt": "x"}
    validate_observation(SCHEMA, base, where="ok")
    cases = {
        "shape": ({**base, "wrist_image": np.zeros((8, 8, 4), np.uint8)},
                  "'wrist_image' has shape (8, 8, 4), expected (*, *, 3) or (*, *, *, 3)"),
        "joint": ({**base, "joint_position": np.zeros(6, np.float32)},
                  "'joint_position' has shape (6,), expected (7,) or (*, 7)"),
        "int joints": ({**base, "joint_position": np.zeros(7, np.int64)},
                       "'joint_position' has dtype int64, expected a floating dtype (float32)"),
        "alias dtype": ({**{k: v for k, v in base.items() if k != "wrist_image"},
                         "wrist_image_left": np.zeros((8, 8, 3), np.int16)},
                        "'wrist_image_left' (wrist_image) has dtype int16, expected uint8"),
        "twice": ({**base, "observation/joint_position": np.zeros(7, np.float32)},
                  "'joint_position' given twice ('joint_position' and 'observation/joint_position')"),
        "prompt": ({k: v for k, v in base.items() if k != "prompt"},
                   "missing prompt 'prompt' or 'language_instruction'"),
        "prompt type": ({**base, "prompt": 3}, "prompt 'prompt' must be a string, got int"),
    }
    for name, (arrays, expected) in cases.items():
        with pytest.raises(ObservationError) as err:
            validate_observation(SCHEMA, arrays, where="step_000001.npz")
        assert str(err.value).startswith("step_000001.npz: "), name
        assert expected in str(err.value), (name, str(err.value))
        assert name == "prompt" or "missing prompt" not in str(err.value), str(err.value)  # a prompt of 3 was both


def test_sampler_is_guided_euler_flow_matching_on_the_models_velocities():
    """The sampler checked on the real model's own predictions (the paged-vs-dense test cannot see a wrong
    update rule: both sides run the same sampler).

    Step i sees x_i at sigma_i on both CFG branches, the positive one predicting v and the negative one u
    (video; actions decoded from the registers); the guided velocity is u + s (v - u) and one Euler step
    from sigma_i to sigma_{i+1} (flow matching, sigma 1 = noise, 0 = data) gives x_{i+1}; the outputs are
    the last step's. The start is noise_generator(seed, request). Every pass carries the anchor channels:
    a mask that is 1 on absolute frame 0 only, then the anchor latent on every frame.
    """
    pipe = dreamzero(guidance_scale=3.0, num_inference_steps=3)
    c = pipe.config
    s, C, n = c.guidance_scale, c.latent_channels, c.num_inference_steps
    rollout = RecordingRollout(pipe, sink_frames=c.sink_frames, window_frames=c.window_frames)
    for request, inputs in enumerate(steps(pipe, 3)):
        rollout.passes.clear()
        out = pipe.step("s", rollout, inputs)
        anchor = pipe.sessions["s"].anchor_latent
        for _, seg, _, _ in rollout.passes:
            is_anchor = (seg.first_frame + torch.arange(seg.num_frames) == 0).float()
            assert torch.equal(seg.latents[C:C + 4], is_anchor[None, :, None, None].expand(4, -1, *anchor.shape[1:]))
            assert torch.equal(seg.latents[C + 4:], anchor[:, None].expand(-1, seg.num_frames, -1, -1))
        sampling = [p for p in rollout.passes if not p[2]]
        assert [branch for branch, *_ in sampling] == ["positive", "negative"] * n
        gen = noise_generator(c.seed, request)
        x = torch.randn((C, c.frames_per_block, c.latent_height, c.latent_width), generator=gen)
        a = torch.randn((c.action_horizon, c.action_dim), generator=gen)
        sigmas = shifted_sigmas(n, c.timestep_shift)
        for i in range(n):
            (_, pos, _, v), (_, neg, _, u) = sampling[2 * i], sampling[2 * i + 1]
            torch.testing.assert_close(pos.latents[:C], x)
            assert torch.equal(neg.latents, pos.latents) and torch.equal(neg.timesteps, pos.timesteps)
            assert pos.timesteps[0].item() == pytest.approx(sigmas[i] * 1000.0, rel=1e-6)
            v_a, u_a = pipe.transformer.decode_actions(v.registers), pipe.transformer.decode_actions(u.registers)
            dt = sigmas[i + 1] - sigmas[i]
            x = x + dt * (u.video + s * (v.video - u.video))
            a = a + dt * (u_a + s * (v_a - u_a))
        torch.testing.assert_close(out["latents"], x)
        torch.testing.assert_close(out["actions"], a)


def test_the_robot_state_is_the_newest_row_of_each_reading():
    """Proprioception given as (T, 7) / (T, 1) rows (a reading per camera frame) conditions on the newest row."""
    pipe = dreamzero()
    driver = Driver(pipe, num_sessions=3)
    base = steps(pipe, 1)[0]
    rng = np.random.default_rng(3)
    joints, gripper = rng.standard_normal((4, 7)).astype(np.float32), rng.random((4, 1)).astype(np.float32)
    older_changed = {**base, "joint_position": np.concatenate([joints[:-1] + 1, joints[-1:]]),
                     "gripper_position": np.concatenate([gripper[:-1] + 1, gripper[-1:]])}
    newest_changed = {**base, "joint_position": np.concatenate([joints[:-1], joints[-1:] + 1]),
                      "gripper_position": gripper}
    a = driver.run("a", {**base, "joint_position": joints, "gripper_position": gripper})["actions"]
    b = driver.run("b", older_changed)["actions"]
    c = driver.run("c", newest_changed)["actions"]
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.allclose(a, c)


def test_dreamzero_actions_are_as_noisy_as_the_video_and_the_state_token_is_clean():
    pipe = dreamzero(guidance_scale=3.0, num_inference_steps=2)
    c = pipe.config
    rollout = RecordingRollout(pipe, sink_frames=c.sink_frames, window_frames=c.window_frames)
    pipe.step("s", rollout, pipe.example_inputs(1, seed=0))
    sampling = [seg for _, seg, commit, _ in rollout.passes if not commit]
    assert sampling
    for seg in sampling:
        t = seg.timesteps[0].item()
        assert t > 0
        assert torch.equal(seg.register_timesteps[:c.action_horizon], torch.full((c.action_horizon,), t))
        assert seg.register_timesteps[c.action_horizon].item() == 0.0


def test_action_registers_are_ordered_by_their_embedding():
    """Registers share one RoPE position, so the register embedding is their only order: swapping two noisy
    actions does not just swap their tokens."""
    pipe = dreamzero()
    model, c = pipe.transformer, pipe.config
    gen = torch.Generator().manual_seed(2)
    actions, state = torch.randn(c.action_horizon, c.action_dim, generator=gen), torch.randn(c.state_dim, generator=gen)
    perm = torch.arange(c.action_horizon + 1)
    perm[[0, 1]] = perm[[1, 0]]
    tokens = model.registers(actions, state)
    swapped = model.registers(actions[perm[:-1]], state)
    assert not torch.allclose(swapped[perm], tokens)


def test_cameras_are_tiled_left_right_then_wrist_bottom_left():
    pipe = dreamzero()
    c = pipe.config
    th, tw = c.height // 2, c.width // 2
    obs = {key: np.full((th, tw, 3), 50 * (i + 1), np.uint8) for i, key in enumerate(CAMERAS)}
    frames = pipe._camera_frames(obs)[0]  # (H, W, 3)
    assert (frames[:th, :tw] == 50).all() and (frames[:th, tw:] == 100).all()
    assert (frames[th:, :tw] == 150).all() and (frames[th:, tw:] == 0).all()


def test_resized_cameras_are_rounded_not_truncated():
    """Halving a view averages 2 x 2 pixels; 1.75 must become 2 (truncating darkens every resized image)."""
    pipe = dreamzero()
    c = pipe.config
    th, tw = c.height // 2, c.width // 2
    big = np.full((2 * th, 2 * tw, 3), 2, np.uint8)
    big[::2, ::2] = 1  # every 2 x 2 block: 1, 2, 2, 2 -> 1.75
    obs = {key: big for key in CAMERAS}
    frames = pipe._camera_frames(obs)[0]
    assert (frames[:th, :tw] == 2).all()


def test_decoded_frames_keep_their_colour_through_the_codec():
    """Fresh weights carry a mean-colour path: a constant colour survives encode -> decode (RGB order and frame
    order of the decoder's output channels)."""
    pipe = dreamzero()
    c = pipe.config
    frames = np.zeros((4, c.height, c.width, 3), np.uint8)
    frames[..., 0], frames[..., 1], frames[..., 2] = 230, 40, 120
    rgb = pipe.decode_latents(pipe.vae.encode(torch.from_numpy(frames)))
    assert rgb.shape == frames.shape
    assert np.abs(rgb.astype(int) - frames.astype(int)).max() <= 12


def test_an_image_with_a_zero_size_is_refused():
    pipe = dreamzero()
    inputs = pipe.example_inputs(1)
    inputs["wrist_image"] = np.zeros((0, 16, 3), np.uint8)
    with pytest.raises(ObservationError, match="wrist_image"):
        validate_observation(SCHEMA, inputs, where="t")


@pytest.mark.parametrize("window", [{"window_frames": 1}, {"window_frames": 4}, {"window_frames": 1, "sink_frames": 1}],
                         ids=["window-1", "window-4", "sink-1-window-1"])
def test_warmup_runs_every_input_shape_a_rollout_sends_even_when_one_frame_fills_the_window(window):
    """`ardiff warmup` runs each input shape the pipeline will see: a window of one latent frame (sink + window 1)
    is full after the one-frame anchor, and the warmup stopped there, so the four-frame requests that every later
    step of a rollout sends (each restarting the window) were first run by the rollout itself."""
    pipe = dreamzero(**window)
    requests = list(pipe.ar_diffusion_warmup_requests("w"))
    frames = [request.inputs["wrist_image"].shape[0] if request.inputs["wrist_image"].ndim == 4 else 1
              for request in requests]
    assert frames[0] == 1 and pipe.config.frames_per_request in frames[1:], frames
    driver = Driver(pipe, num_sessions=1)
    for request in requests:  # each one runs on the session as the warmup runs it
        driver.run("w", request.inputs)
    assert driver.state("w").adapter("positive").num_committed_frames >= 1


class _SeenWork(TorchDispatchMode):
    """Every (torch op, input shapes) run under it: the kernels and allocations a first run pays for."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add((str(func), tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("window", [{}, {"window_frames": 1}, {"window_frames": 1, "sink_frames": 1},
                                    {"sink_frames": 1, "window_frames": 3, "reset_at_window": False}],
                         ids=["default", "window-1", "sink-1-window-1", "sliding"])
def test_after_warmup_a_rollout_past_its_window_meets_no_shape_or_path_the_warmup_did_not_run(window, monkeypatch):
    """The warmup filled the window and stopped: the window's restart (text cache kept, the anchor sliced out of a
    four-frame request, image cache made again) first ran in a rollout's first step past its window, with its
    first-run costs. Each (torch op, input shapes) and each KV path (a reset keeping caches, a commit that slides
    the window) of a rollout's episode past two windows must have run in the warmup, through the real runner."""
    from ardiff_cli.runtime.kv.state import ARDiffusionKVState, BranchKV
    from ardiff_cli.runtime.runner import ARDiffusionModelRunner

    paths: set[tuple] = set()
    reset, commit = ARDiffusionKVState.reset, BranchKV.commit

    def recorded_reset(self, keep_cross_attention=()):
        paths.add(("reset", tuple(keep_cross_attention)))
        return reset(self, keep_cross_attention)

    def recorded_commit(self, pages, allocator):
        before = self.num_pages
        commit(self, pages, allocator)
        paths.add(("commit", "slides the window" if self.num_pages < before + len(pages) else "appends"))

    monkeypatch.setattr(ARDiffusionKVState, "reset", recorded_reset)
    monkeypatch.setattr(BranchKV, "commit", recorded_commit)
    pipe = dreamzero(**window)
    runner = ARDiffusionModelRunner(pipe, memory_budget="64MiB")
    runner.load()
    with _SeenWork() as warm:
        runner.warmup(SCHEMA)
    warm_paths, warm_work = set(paths), warm.seen
    paths.clear()
    c = pipe.config
    num_steps = 2 * (c.sink_frames + c.window_frames) + 2  # two window boundaries and more
    with _SeenWork() as rollout:
        for i, inputs in enumerate(steps(pipe, num_steps)):
            runner.execute_model(ARDiffusionRequest(f"step-{i}", inputs, {"session_id": "episode"}))
    assert paths - warm_paths == set(), f"warmup ran {sorted(warm_paths)}"
    assert rollout.seen - warm_work == set()
