"""Dense references for the lifecycle cases the other equivalence tests leave out.

- A cross-attention cache republished under live history: the causal world pipeline's prompt switch keeps the
  session's frames and publishes a new text cache. The history then holds K/V computed under the *old* text while
  new blocks read the new one. ``DenseReferenceRollout`` refuses that case (it recomputes all history with the
  current caches); ``PerSegmentCrossReference`` here recomputes every committed segment densely under the text
  caches it was committed with. Through the runner with one session slot, so that every request evicts the other
  session to a swap folder and restores its own (its new cache included), several times, with prompts switched
  back and forth, ``reset=True`` and a closed id reused. float32: max abs error <= 1e-5 (measured 2.4e-7; the
  paged path and the dense one differ only in the order of float32 sums). Recomputing the history under the new
  text instead is off by 3e-4 on the tiny model: the tolerance tells the two apart.
- DreamZero's prompt switch (a new task: history dropped, both CFG branches' text and image caches republished)
  and one-frame window restarts, on sessions restored from the swap folder before every request, CFG at 3.0 and
  at 1.0 (one branch).
- Head sizes a config reaches that are not multiples of 8 (6, 10, 14), in float32, float16 and bfloat16 on the
  CPU, with a window smaller than a block.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
import torch
import torch.nn.functional as F
from pipeline_helpers import Driver, causal_world

from ardiff_cli.runtime.request import ARDiffusionRequest
from ardiff_cli.runtime.runner import ARDiffusionModelRunner
from pipelines.causal_world import Config, pipeline_class
from pipelines.rollout import DenseReferenceRollout
from pipelines.wan import Segment, SegmentOutput, block_causal_mask

pytestmark = pytest.mark.usefixtures("single_thread")

TOLERANCE = 1e-5  # float32


def _block_forward(block, x, e, cos, sin, attend, spans, caches):
    """``WanAttentionBlock.forward`` with the cross-attention of each span of tokens read from its own caches
    (``caches[i]`` = (text_kv, image_kv) of ``spans[i]``). Cross-attention is per token, so this is the block a
    model would run on those tokens one segment at a time. ``test_per_segment_block_is_the_models_block`` holds it
    to the model's own block."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (block.modulation.float() + e).unbind(1)
    y = block.self_attn((block.norm1(x).float() * (1 + scale_msa) + shift_msa).to(x.dtype), cos, sin, attend)
    x = x + (y.float() * gate_msa).to(x.dtype)
    normed = block.norm3(x)
    x = x + torch.cat([block.cross_attn(normed[a:b], text, image) for (a, b), (text, image) in zip(spans, caches)])
    y = block.ffn((block.norm2(x).float() * (1 + scale_mlp) + shift_mlp).to(x.dtype))
    return x + (y.float() * gate_mlp).to(x.dtype)


def per_segment_forward(model, segments, caches, *, sink_frames: int, window_frames: int) -> SegmentOutput:
    """The last of ``segments`` recomputed densely after all the others (its committed history), each segment's
    cross-attention from its own ``caches`` entry (per layer: a list of (text_kv, image_kv))."""
    embedded = [model._embed(s) for s in segments]
    x, e, e0, cos, sin = (torch.cat(parts) for parts in zip(*embedded))
    seg = segments[-1]
    tokens_per_frame = (seg.latents.shape[2] // model.patch_size[1]) * (seg.latents.shape[3] // model.patch_size[2])
    mask = block_causal_mask(segments, tokens_per_frame, sink_frames, window_frames)  # (L, L)
    ends = torch.tensor([parts[0].shape[0] for parts in embedded]).cumsum(0).tolist()
    spans = list(zip([0, *ends[:-1]], ends))

    def dense(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (H, L, D)

    for i, block in enumerate(model.blocks):
        x = _block_forward(block, x, e, cos, sin, dense, spans, [layers[i] for layers in caches])
    start = spans[-1][0]
    n_video = seg.num_frames * tokens_per_frame
    video = model._video_out(x[start:start + n_video], e0[start:start + n_video], seg)
    return SegmentOutput(video=video, registers=x[start + n_video:] if seg.num_registers else None)


class PerSegmentCrossReference(DenseReferenceRollout):
    """``DenseReferenceRollout`` that also models a cache replaced under live history: each committed segment
    keeps the caches it was committed with, and is recomputed under them."""

    def __init__(self, model, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.segment_caches: dict[str, list] = defaultdict(list)  # branch -> per committed segment: per layer caches

    def set_cross(self, branch, name, pairs) -> None:
        self._cross[(branch, name)] = [(k.clone(), v.clone()) for k, v in pairs]

    def _caches(self, branch: str) -> list:
        text = self.cross(branch, "text")
        image = self.cross(branch, "image") if "image" in self.cross_names else [None] * len(text)
        return list(zip(text, image))

    def run(self, branch: str, seg: Segment, *, commit: bool) -> SegmentOutput:
        out = per_segment_forward(self.model, [*self.history[branch], seg],
                                  [*self.segment_caches[branch], self._caches(branch)],
                                  sink_frames=self.sink_frames, window_frames=self.window_frames)
        if commit:
            self.commit(branch, seg)
        return out

    def commit(self, branch: str, seg: Segment) -> None:
        self.history[branch].append(seg)
        self.segment_caches[branch].append(self._caches(branch))

    def reset(self, keep=()) -> None:
        super().reset(keep)
        self.segment_caches.clear()


def test_per_segment_block_is_the_models_block():
    """With one cache for every segment the reference is ``reference_forward`` (which runs the model's own block),
    so it cannot drift from the model unseen."""
    pipe = causal_world(sink_frames=1, window_frames=2, frames_per_block=2)
    plain = DenseReferenceRollout(pipe.transformer, sink_frames=1, window_frames=2, cross_names=pipe.cross_names)
    mine = PerSegmentCrossReference(pipe.transformer, sink_frames=1, window_frames=2, cross_names=pipe.cross_names)
    for step in range(4):
        inputs = pipe.example_inputs(prompt="a boat", seed=step)
        want = pipe.step("plain", plain, inputs)["latents"]
        torch.testing.assert_close(pipe.step("mine", mine, inputs)["latents"], want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("sink, window, block", [(1, 2, 3), (0, 4, 2)], ids=["window-under-a-block", "no-sink"])
def test_prompt_switches_under_live_history_through_evictions_equal_a_per_segment_dense_recompute(
        tmp_path, sink, window, block):
    pipe = causal_world(sink_frames=sink, window_frames=window, frames_per_block=block)
    runner = ARDiffusionModelRunner(pipe, dtype=torch.float32, memory_budget="1GiB", session_capacity=1,
                                    attention_backend="torch", swap_dir=tmp_path / "swap")
    runner.load()
    seen = Counter()
    runner.subscribe(lambda event: seen.update([event.kind + (" swapped" if getattr(event, "swapped", False)
                                                             else "")]))
    references: dict[str, PerSegmentCrossReference] = {}

    def reference(session: str) -> PerSegmentCrossReference:
        if session not in references:
            references[session] = PerSegmentCrossReference(pipe.transformer, sink_frames=sink, window_frames=window,
                                                            cross_names=pipe.cross_names)
        return references[session]

    def restart(session: str) -> None:
        references.pop(session, None)
        pipe.close_ar_diffusion_session(f"ref-{session}")

    # (session, prompt, extra): "a" switches prompts (its text cache is republished, its history kept) while "b"
    # takes the only slot in between, so "a" is evicted to the swap folder and restored before each of its requests.
    plan = [("a", "a street", {}), ("b", "a boat", {}), ("a", "a street", {}), ("b", "a boat", {}),
            ("a", "a street at night", {}), ("b", "a boat", {}), ("a", "a street at night", {}),
            ("a", "a street in snow", {}), ("b", "a boat in fog", {}), ("a", "a street", {}),
            ("b", "a boat in fog", {}), ("a", "a street", {"reset": True}), ("b", "a boat", {}),
            ("a", "a street at dawn", {}), ("a", "a street at dawn", {"close_session": True}),
            ("b", "a boat", {}), ("a", "a street", {}), ("b", "a boat", {}), ("a", "a street at night", {})]
    worst = 0.0
    for i, (session, prompt, extra) in enumerate(plan):
        inputs = pipe.example_inputs(prompt=prompt, seed=i)
        if extra.get("reset"):
            restart(session)
        out = runner.execute_model(ARDiffusionRequest(f"{session}/{i}", inputs, {"session_id": session, **extra}))
        want = pipe.step(f"ref-{session}", reference(session), inputs)
        error = (out["latents"] - want["latents"]).abs().max().item()
        worst = max(worst, error)
        frames = reference(session).num_frames("main")
        assert error <= TOLERANCE, f"request {i} of {session!r} ({prompt!r}, {frames} frames): off by {error}"
        if extra.get("close_session"):
            restart(session)
    runner.close()
    # the plan reached what it is for: swapped evictions and restores, a switch while swapped out
    assert seen["session_evicted swapped"] >= 8 and seen["session_restored"] >= 8, seen


# head sizes a config reaches (dim / num_heads: even, at least 6) that are not multiples of 8, in every dtype a
# config takes on the CPU. float16 and bfloat16 are held to one spacing of their own at the outputs' magnitude
# (|x| < 4: 2**-9 and 2**-6), five and six times what was measured (3.8e-4 and 2.5e-3). A window one frame off moves
# the outputs by 9e-3 to 1.8e-2: float32 and float16 catch that, bfloat16 only gross errors (a head's columns misread)
HALF_TOLERANCE = {torch.float32: TOLERANCE, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.usefixtures("ardiff_cache")
@pytest.mark.parametrize("dtype", list(HALF_TOLERANCE), ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("dim, num_heads", [(30, 5), (40, 4), (42, 3)], ids=["head6", "head10", "head14"])
def test_head_sizes_off_the_kernel_grid_equal_a_dense_recompute_in_every_cpu_dtype(dim, num_heads, dtype):
    config = Config.from_dict({"preset": "tiny", "dim": dim, "num_heads": num_heads, "ffn_dim": 64, "sink_frames": 1,
                               "window_frames": 2, "frames_per_block": 3}, where="test")
    pipe = pipeline_class().from_config(config, dtype=dtype)
    assert pipe.ar_diffusion_kv_cache_spec().head_size == dim // num_heads
    driver = Driver(pipe, num_sessions=1)
    reference = DenseReferenceRollout(pipe.transformer, sink_frames=1, window_frames=2, cross_names=pipe.cross_names)
    for step in range(4):  # 12 frames through a sink of 1 and a window of 2 smaller than the block of 3
        inputs = pipe.example_inputs(prompt="a red car", seed=step)
        paged, dense = driver.run("s", inputs)["latents"], pipe.step("reference", reference, inputs)["latents"]
        error = (paged.float() - dense.float()).abs().max().item()
        assert error <= HALF_TOLERANCE[dtype], f"block {step}: off the dense recompute by {error}"


@pytest.mark.usefixtures("ardiff_cache")
@pytest.mark.parametrize("model", [dict(sink_frames=1, window_frames=3, reset_at_window=False, guidance_scale=3.0),
                                   dict(sink_frames=0, window_frames=3, reset_at_window=True, guidance_scale=1.0)],
                         ids=["cfg3-sliding", "cfg1-window-reset"])
def test_dreamzero_prompt_switches_through_evictions_equal_the_twin_and_a_dense_recompute(tmp_path, model):
    """A new prompt is a new task: DreamZero drops the history and republishes both branches' text and image
    caches. With one slot, each request evicts the other session to the swap folder, so every switch and every
    one-frame window restart happens on a restored session. Bit for bit against a bare-cache twin never evicted,
    and within 1e-5 of the dense recompute (measured 3.6e-6 with CFG at 3.0)."""
    from pipelines.dreamzero import Config as DreamZeroConfig
    from pipelines.dreamzero import pipeline_class as dreamzero_class

    config = DreamZeroConfig.from_dict({"preset": "tiny", "num_inference_steps": 4, **model}, where="test")
    pipe = dreamzero_class().from_config(config, dtype=torch.float32)
    twin = Driver(dreamzero_class().from_config(config, dtype=torch.float32), num_sessions=2)
    runner = ARDiffusionModelRunner(pipe, dtype=torch.float32, memory_budget="1GiB", session_capacity=1,
                                    attention_backend="torch", swap_dir=tmp_path / "swap")
    runner.load()
    seen = Counter()
    runner.subscribe(lambda event: seen.update([event.kind]))
    references: dict[str, DenseReferenceRollout] = {}
    # "a" runs "pour" for six frames past a sink + window of four: its window slides (or restarts) while swapped
    plan = [("a", "pick", 1), ("b", "place", 1), ("a", "pick", 4), ("b", "place", 4), ("a", "pour", 4),
            ("b", "place", 4), ("a", "pour", 4), ("a", "pour", 4), ("b", "stack", 1), ("a", "pour", 4),
            ("b", "stack", 4), ("a", "pour", 4), ("b", "stack", 4), ("a", "pour", 4), ("a", "pick", 4),
            ("b", "stack", 4), ("a", "pick", 4)]
    for i, (session, prompt, num_frames) in enumerate(plan):
        inputs = pipe.example_inputs(num_frames, prompt=prompt, seed=i)
        out = runner.execute_model(ARDiffusionRequest(f"{session}/{i}", inputs, {"session_id": session}))
        reference = references.setdefault(session, DenseReferenceRollout(
            pipe.transformer, sink_frames=config.sink_frames, window_frames=config.window_frames,
            cross_names=pipe.cross_names))
        dense, want = pipe.step(f"ref-{session}", reference, inputs), twin.run(session, inputs)
        for key, value in out.items():
            assert torch.equal(value, want[key]), f"request {i} of {session!r}: {key} differs from the twin"
            error = (value - dense[key]).abs().max().item()
            assert error <= TOLERANCE, f"request {i} of {session!r} ({prompt!r}): {key} off by {error}"
    runner.close()
    assert seen["session_evicted"] >= 8 and seen["session_restored"] >= 8, seen
