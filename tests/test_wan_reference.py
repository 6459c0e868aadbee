"""``pipelines/wan.py`` against an independent re-derivation of the public Wan 2.1 forward.

The reference below is written from the formulas of Wan 2.1's ``wan/modules/model.py`` (``WanModel``) and of the
causal KV-cache inference of Self-Forcing's ``causal_model.py``, in their own terms: a Conv3d patch embedding, a
``rope_params`` table of complex numbers (``torch.polar``) split per axis and applied with ``view_as_complex`` in
float64, the ``modulation + e`` chunks ``e[0..5]``, explicit softmax attention, and the ``'fhwpqrc->cfphqwr'``
unpatchify. It reads the weights by their Wan 2.1 checkpoint names, so a renamed parameter fails here too. It shares
no code with the model: a divergence in either shows up as a mismatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from pipelines.config import BackboneConfig, derive
from pipelines.wan import Segment, WanTransformer

pytestmark = pytest.mark.usefixtures("single_thread")

MASK_CHANNELS = 4  # Wan I2V's first-frame mask channels


@dataclass(frozen=True)
class Geometry(BackboneConfig):
    """A small Wan geometry with an uneven RoPE split (head 40: 16 frame / 12 row / 12 col channels) and a
    non-square latent (8 x 6 -> 4 x 3 patches), so swapped axes or splits change the result."""

    dim: int = 80
    ffn_dim: int = 96
    freq_dim: int = 16
    num_heads: int = 2
    num_layers: int = 2
    height: int = 32
    width: int = 24
    text_dim: int = 24
    text_len: int = 7
    image_dim: int = 0  # > 0: Wan I2V (image cross-attention, img_emb, [noise | mask | y] input channels)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.image_dim:
            derive(self, "in_dim", 2 * self.latent_channels + MASK_CHANNELS)


def wan21_keys(g: Geometry) -> set[str]:
    """The state-dict keys of Wan 2.1's ``WanModel`` for this geometry (t2v, or i2v with ``img_emb``)."""
    keys = {"patch_embedding.weight", "patch_embedding.bias", "head.modulation", "head.head.weight", "head.head.bias"}
    for seq, idx in (("text_embedding", (0, 2)), ("time_embedding", (0, 2)), ("time_projection", (1,))):
        keys |= {f"{seq}.{i}.{p}" for i in idx for p in ("weight", "bias")}
    for b in range(g.num_layers):
        p = f"blocks.{b}."
        keys |= {p + "modulation", p + "norm3.weight", p + "norm3.bias"}
        keys |= {f"{p}ffn.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")}
        for attn in ("self_attn", "cross_attn"):
            keys |= {f"{p}{attn}.{lin}.{w}" for lin in "qkvo" for w in ("weight", "bias")}
            keys |= {f"{p}{attn}.norm_q.weight", f"{p}{attn}.norm_k.weight"}
        if g.image_dim:
            keys |= {f"{p}cross_attn.{lin}.{w}" for lin in ("k_img", "v_img") for w in ("weight", "bias")}
            keys.add(f"{p}cross_attn.norm_k_img.weight")
    if g.image_dim:
        keys |= {f"img_emb.proj.{i}.{w}" for i in (0, 1, 3, 4) for w in ("weight", "bias")}
    return keys


# ----------------------------------------------------------------------------- the reference
def _linear(x, sd, name):
    return x @ sd[name + ".weight"].T + sd[name + ".bias"]


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _softmax_attention(q, k, v):
    """(Lq, n, d), (Lk, n, d), (Lk, n, d) -> (Lq, n * d), no mask."""
    scores = torch.einsum("qnd,knd->nqk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("nqk,knd->qnd", scores.softmax(-1), v).flatten(1)


def _rope_table(d: int, max_len: int = 1024) -> torch.Tensor:
    """Wan's ``self.freqs``: ``rope_params`` for the frame, row and col parts, concatenated: (max_len, d / 2)."""
    def params(n):
        angles = torch.outer(torch.arange(max_len).double(), 1.0 / torch.pow(10000, torch.arange(0, n, 2).double() / n))
        return torch.polar(torch.ones_like(angles), angles)

    return torch.cat([params(d - 4 * (d // 6)), params(2 * (d // 6)), params(2 * (d // 6))], dim=1)


def _rope(x, grid, start_frame):
    """Self-Forcing's ``causal_rope_apply`` (Wan's ``rope_apply`` at ``start_frame = 0``) on (L, n, d)."""
    f, h, w = grid
    L, n, d = x.shape
    c = d // 2
    fr, fh, fw = _rope_table(d).split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    freqs = torch.cat([fr[start_frame:start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
                       fh[:h].view(1, h, 1, -1).expand(f, h, w, -1),
                       fw[:w].view(1, 1, w, -1).expand(f, h, w, -1)], dim=-1).reshape(L, 1, -1)
    rotated = torch.view_as_complex(x.double().reshape(L, n, -1, 2)) * freqs
    return torch.view_as_real(rotated).flatten(2).float()


def wan21_forward(sd, g: Geometry, x, t, context, *, clip_fea=None, y=None, start_frame=0, cache=None, new_kv=None):
    """One clip ``x`` (C, F, H, W) at diffusion time ``t`` through Wan 2.1, returning the (C, F, H, W) prediction.

    Causal inference as Self-Forcing runs it: the clip's frames sit at absolute frames ``start_frame..`` in RoPE;
    ``cache[i]`` is layer i's (k, v) of earlier frames, rotated when they were written; ``new_kv`` (a list)
    receives this pass's per-layer (k, v).
    """
    n, d, eps = g.num_heads, g.dim // g.num_heads, g.eps
    if y is not None:
        x = torch.cat([x, y])
    u = F.conv3d(x[None], sd["patch_embedding.weight"], sd["patch_embedding.bias"], stride=g.patch_size)
    grid = tuple(u.shape[2:])
    u = u.flatten(2).transpose(1, 2)[0]  # (L, dim): frame-major, then rows, then cols
    L = u.shape[0]

    half = g.freq_dim // 2
    sinusoid = torch.outer(torch.tensor([float(t)]).double(), torch.pow(10000, -torch.arange(half).double() / half))
    e = _linear(F.silu(_linear(torch.cat([sinusoid.cos(), sinusoid.sin()], 1).float(), sd, "time_embedding.0")),
                sd, "time_embedding.2")  # (1, dim)
    e0 = _linear(F.silu(e), sd, "time_projection.1").unflatten(1, (6, g.dim))  # (1, 6, dim)

    ctx = _linear(F.gelu(_linear(context, sd, "text_embedding.0"), approximate="tanh"), sd, "text_embedding.2")
    if clip_fea is not None:
        img = F.layer_norm(clip_fea, (g.image_dim,), sd["img_emb.proj.0.weight"], sd["img_emb.proj.0.bias"])
        img = _linear(F.gelu(_linear(img, sd, "img_emb.proj.1")), sd, "img_emb.proj.3")
        img = F.layer_norm(img, (g.dim,), sd["img_emb.proj.4.weight"], sd["img_emb.proj.4.bias"])
        ctx = torch.cat([img, ctx])  # image tokens first, as WanModel.forward concatenates them

    for i in range(g.num_layers):
        p = f"blocks.{i}."
        m = (sd[p + "modulation"] + e0)[0]  # (6, dim): e[0..5]
        h = F.layer_norm(u, (g.dim,), eps=eps) * (1 + m[1]) + m[0]
        q = _rope(_rms(_linear(h, sd, p + "self_attn.q"), sd[p + "self_attn.norm_q.weight"], eps).view(L, n, d),
                  grid, start_frame)
        k = _rope(_rms(_linear(h, sd, p + "self_attn.k"), sd[p + "self_attn.norm_k.weight"], eps).view(L, n, d),
                  grid, start_frame)
        v = _linear(h, sd, p + "self_attn.v").view(L, n, d)
        if new_kv is not None:
            new_kv.append((k, v))
        if cache is not None:
            k, v = torch.cat([cache[i][0], k]), torch.cat([cache[i][1], v])
        u = u + _linear(_softmax_attention(q, k, v), sd, p + "self_attn.o") * m[2]

        h = F.layer_norm(u, (g.dim,), sd[p + "norm3.weight"], sd[p + "norm3.bias"], eps)
        q = _rms(_linear(h, sd, p + "cross_attn.q"), sd[p + "cross_attn.norm_q.weight"], eps).view(L, n, d)
        num_img = ctx.shape[0] - g.text_len
        txt, img = ctx[num_img:], ctx[:num_img]
        k = _rms(_linear(txt, sd, p + "cross_attn.k"), sd[p + "cross_attn.norm_k.weight"], eps).view(-1, n, d)
        out = _softmax_attention(q, k, _linear(txt, sd, p + "cross_attn.v").view(-1, n, d))
        if num_img:
            k = _rms(_linear(img, sd, p + "cross_attn.k_img"), sd[p + "cross_attn.norm_k_img.weight"], eps)
            out = out + _softmax_attention(q, k.view(-1, n, d), _linear(img, sd, p + "cross_attn.v_img").view(-1, n, d))
        u = u + _linear(out, sd, p + "cross_attn.o")

        h = F.layer_norm(u, (g.dim,), eps=eps) * (1 + m[4]) + m[3]
        u = u + _linear(F.gelu(_linear(h, sd, p + "ffn.0"), approximate="tanh"), sd, p + "ffn.2") * m[5]

    shift, scale = (sd["head.modulation"] + e[:, None])[0]  # (2, dim)
    out = _linear(F.layer_norm(u, (g.dim,), eps=eps) * (1 + scale) + shift, sd, "head.head")
    c = g.out_dim
    out = torch.einsum("fhwpqrc->cfphqwr", out.view(*grid, *g.patch_size, c))
    return out.reshape(c, *[a * b for a, b in zip(grid, g.patch_size)])


# ----------------------------------------------------------------------------- the tests
def _model(g: Geometry) -> WanTransformer:
    """Every parameter random (biases, norm weights and modulations too), so none can be misplaced unseen."""
    model = WanTransformer(g)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # norm weights
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("modulation"):
                p.copy_(torch.randn(p.shape, generator=gen) / g.dim**0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p[0].numel() ** 0.5)
    return model.eval()


def _inputs(g: Geometry, num_frames: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(g.latent_channels, num_frames, g.latent_height, g.latent_width, generator=gen)
    text = torch.randn(g.text_len, g.text_dim, generator=gen)
    text[4:] = 0  # padded like umT5 states: Wan attends the zero padding too (context_lens is None)
    return x, text, gen


@pytest.mark.parametrize(("image_dim", "patch_size"), [(0, (1, 2, 2)), (12, (1, 2, 2)), (0, (1, 1, 2))],
                         ids=["t2v", "i2v", "t2v-patch-1x2"])
def test_one_clip_matches_wan21(image_dim, patch_size):
    """A whole 3-frame clip as one segment (no history: plain bidirectional attention) equals WanModel.forward;
    a non-square patch checks the row/col order of patchify and unpatchify."""
    g = Geometry(image_dim=image_dim, patch_size=patch_size)
    model = _model(g)
    sd = model.state_dict()
    assert set(sd) == wan21_keys(g), f"not Wan 2.1's parameter names: {sorted(set(sd) ^ wan21_keys(g))}"
    x, text, gen = _inputs(g, 3, seed=1)
    clip = y = None
    if image_dim:
        clip = torch.randn(5, image_dim, generator=gen)
        y = torch.randn(MASK_CHANNELS + g.latent_channels, 3, g.latent_height, g.latent_width, generator=gen)
    with torch.no_grad():
        expected = wan21_forward(sd, g, x, 700.0, text, clip_fea=clip, y=y)
        text_kv = list(model.project_text(text))
        image_kv = list(model.project_image(clip)) if image_dim else None
        seg = Segment(latents=x if y is None else torch.cat([x, y]), timesteps=torch.full((3,), 700.0), first_frame=0)
        got = model.reference_forward([], seg, sink_frames=0, window_frames=1, text_kv=text_kv, image_kv=image_kv)
    assert got.video.shape == expected.shape == x.shape
    torch.testing.assert_close(got.video, expected, atol=2e-5, rtol=1e-4)


def test_causal_rollout_matches_self_forcing_kv_inference():
    """Six one-frame blocks with a 1-frame sink and a 2-frame window, as Self-Forcing's KV-cache inference runs
    them: each block is denoised at t = 700 against the cached K/V, then its clean latent is re-run at t = 0 and
    that pass's K/V are cached. Keys are rotated at their absolute frame when written and never re-rotated, so a
    block at frame 5 attends frame 0 (the sink) at distance 5, not at its slot in the rolled cache."""
    g = Geometry()
    sink, window = 1, 2
    model = _model(g)
    sd = model.state_dict()
    _, text, gen = _inputs(g, 1, seed=2)
    text_kv = list(model.project_text(text))
    cached: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per committed frame, per layer (k, v)
    history: list[Segment] = []
    with torch.no_grad():
        for frame in range(6):
            retained = [j for j in range(frame) if j < sink or j >= max(sink, frame - window)]
            cache = [(torch.cat([cached[j][i][0] for j in retained] + [torch.zeros(0, g.num_heads, g.head_size)]),
                      torch.cat([cached[j][i][1] for j in retained] + [torch.zeros(0, g.num_heads, g.head_size)]))
                     for i in range(g.num_layers)]
            noisy = torch.randn(g.latent_channels, 1, g.latent_height, g.latent_width, generator=gen)
            expected = wan21_forward(sd, g, noisy, 700.0, text, start_frame=frame, cache=cache)
            seg = Segment(latents=noisy, timesteps=torch.full((1,), 700.0), first_frame=frame)
            got = model.reference_forward(history, seg, sink_frames=sink, window_frames=window, text_kv=text_kv)
            torch.testing.assert_close(got.video, expected, atol=2e-5, rtol=1e-4, msg=lambda m: f"frame {frame}: {m}")
            clean = torch.randn(g.latent_channels, 1, g.latent_height, g.latent_width, generator=gen)
            new_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
            wan21_forward(sd, g, clean, 0.0, text, start_frame=frame, cache=cache, new_kv=new_kv)
            cached.append(new_kv)
            history.append(Segment(latents=clean, timesteps=torch.zeros(1), first_frame=frame))


@pytest.mark.parametrize("has_image", [False, True])
def test_cross_attention_runs_torchs_fused_cpu_kernel_and_matches_the_unfused_one(has_image):
    """Cross-attention over the text (and image) caches passes 4-D inputs: torch's fused CPU kernel takes no 3-D
    ones, and on them fell back to the unfused math path (``aten::_safe_softmax``), 1.5-3.5x slower per call."""
    from pipelines.wan import WanCrossAttention

    torch.manual_seed(0)
    dim, heads = 64, 4
    attn = WanCrossAttention(dim, heads, eps=1e-6, qk_norm=True, has_image=has_image).eval()
    x, text, image = torch.randn(48, dim), torch.randn(20, dim), torch.randn(9, dim)
    with torch.no_grad():
        text_kv, image_kv = attn.project_text(text), attn.project_image(image) if has_image else None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = attn(x, text_kv, image_kv)
        q = attn._heads(attn.norm_q(attn.q(x)))  # (H, L, D): the unfused reference, written out
        expected = sum(torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1) @ v
                       for k, v in [text_kv, *([image_kv] if has_image else [])])
        expected = attn.o(expected.transpose(0, 1).reshape(48, dim))
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops, sorted(ops)
    assert "aten::_safe_softmax" not in ops
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
