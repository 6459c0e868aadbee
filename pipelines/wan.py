"""A causal video transformer in the style of Wan 2.1, attending through the runtime's paged KV.

Parameter names follow the Wan 2.1 checkpoints wherever the structure matches
(``patch_embedding``, ``text_embedding.{0,2}``, ``time_embedding.{0,2}``,
``time_projection.1``, ``blocks.N.{norm3, modulation}``,
``blocks.N.self_attn.{q,k,v,o,norm_q,norm_k}``,
``blocks.N.cross_attn.{q,k,v,o,norm_q,norm_k,k_img,v_img,norm_k_img}``,
``blocks.N.ffn.{0,2}``, ``head.{head,modulation}``, ``img_emb.proj.{0,1,3,4}``),
so a Wan-derived checkpoint maps onto it through :func:`remap_checkpoint_key`.

One forward processes one *segment*::

    tokens:  [ video: F frames x (latent_h/ph) x (latent_w/pw) patches | registers: R tokens ]
               frame-major, then row-major                              action / state / conditioning

Video tokens carry their absolute frame index into 3D RoPE (computed from the
positions, no table, so rollouts of any length work). Registers sit after the
video tokens; the KV core never commits them.

Two execution paths share every layer:

- :meth:`WanTransformer.forward`: one segment against the bound KV state, one
  ``attend`` callable per layer (``ARDiffusionLayerContext.attend``).
  :meth:`WanTransformer.commit_forward` is its commit pass with no outputs:
  the last layer only writes its K/V (``ARDiffusionLayerContext.store``).
- :meth:`WanTransformer.reference_forward`: the committed history and the
  segment recomputed densely in one pass with the explicit block-causal
  sink/window mask of :func:`block_causal_mask`. No cache: the equivalence
  tests hold the paged path to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (q, k, v) (H, L, D) -> (H, L, D)
Store = Callable[[torch.Tensor, torch.Tensor], None]  # (k, v) (H, L, D): written to the cache, nothing attended
KVPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # one (k, v) per layer, each (H, T, D)

_CHECKPOINT_PREFIXES = ("module.", "_orig_mod.", "model.")  # DDP / torch.compile / trainer wrappers


def remap_checkpoint_key(key: str) -> str:
    """Checkpoint key -> our parameter name: strips wrapper prefixes that training code adds."""
    changed = True
    while changed:
        changed = False
        for prefix in _CHECKPOINT_PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key


# ----------------------------------------------------------------------------- embeddings
def sinusoidal_embedding(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """(N,) diffusion times -> (N, dim) float32 features [cos | sin], as Wan's ``sinusoidal_embedding_1d``."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=timesteps.device) / half)
    angles = timesteps.to(torch.float64)[:, None] * freqs[None]  # (N, half)
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1).float()


def rope_angles(frames: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, head_size: int) -> torch.Tensor:
    """Rotary angles (L, head_size // 2) for absolute (frame, row, col) positions, Wan's 3D split.

    The head is split into frame / row / col parts of ``d - 4 * (d // 6)``,
    ``2 * (d // 6)``, ``2 * (d // 6)`` channels. Angles are computed in float64
    from the positions themselves, so frame 10**6 is as exact as frame 0 and
    no position table bounds the rollout.
    """
    d = head_size
    parts = (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
    angles = []
    for pos, n in zip((frames, rows, cols), parts):
        inv_freq = 1.0 / torch.pow(10000.0, torch.arange(0, n, 2, dtype=torch.float64, device=pos.device) / n)
        angles.append(pos.to(torch.float64)[:, None] * inv_freq[None])  # (L, n / 2)
    return torch.cat(angles, dim=1)  # (L, d / 2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs of ``x`` (L, H, D) by angles with ``cos``/``sin`` (L, D/2)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (L, H, D/2, 2): Wan's view_as_complex pairing
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None], sin[:, None]  # (L, 1, D/2)
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).to(x.dtype)  # (L, H, D)


# ----------------------------------------------------------------------------- norms
class WanRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class WanLayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 whatever the model dtype (bf16 statistics drift)."""

    def __init__(self, dim: int, eps: float, elementwise_affine: bool = False) -> None:
        super().__init__(dim, eps=eps, elementwise_affine=elementwise_affine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


# ----------------------------------------------------------------------------- attention
class WanSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, eps: float, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        L, H, D = x.shape[0], self.num_heads, self.head_size
        q = apply_rope(self.norm_q(self.q(x)).view(L, H, D), cos, sin)  # (L, H, D)
        out = attend(q.transpose(0, 1).contiguous(), *self.key_values(x, cos, sin))  # (H, L, D)
        return self.o(out.transpose(0, 1).reshape(L, H * D))  # (L, dim)

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(L, dim) -> the (H, L, D) keys (rotated) and values this layer writes to the KV cache."""
        L, H, D = x.shape[0], self.num_heads, self.head_size
        k = apply_rope(self.norm_k(self.k(x)).view(L, H, D), cos, sin)  # (L, H, D)
        v = self.v(x).view(L, H, D)  # (L, H, D)
        return k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()


class WanCrossAttention(WanSelfAttention):
    """Attention to fixed-length named caches: text, and image tokens when ``has_image`` (Wan's I2V form).

    The same q/k/v/o projections and norms as self-attention (so the same parameter names), plus the
    image projections; ``forward`` reads the caches instead of attending through the KV state.
    """

    def __init__(self, dim: int, num_heads: int, eps: float, qk_norm: bool, has_image: bool) -> None:
        super().__init__(dim, num_heads, eps, qk_norm)
        if has_image:
            self.k_img = nn.Linear(dim, dim)
            self.v_img = nn.Linear(dim, dim)
            self.norm_k_img = WanRMSNorm(dim, eps) if qk_norm else nn.Identity()

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.num_heads, self.head_size).transpose(0, 1).contiguous()  # (H, T, D)

    def project_text(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, dim) embedded text -> cache (k, v), each (H, T, D)."""
        return self._heads(self.norm_k(self.k(context))), self._heads(self.v(context))

    def project_image(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T_img, dim) embedded image tokens -> cache (k, v), each (H, T_img, D)."""
        return self._heads(self.norm_k_img(self.k_img(context))), self._heads(self.v_img(context))

    def forward(self, x: torch.Tensor, text_kv: tuple, image_kv: tuple | None) -> torch.Tensor:
        L = x.shape[0]
        q = self._heads(self.norm_q(self.q(x)))[None]  # (1, H, L, D)
        out = _attend_cache(q, text_kv)  # (H, L, D)
        if image_kv is not None:
            # Text and image are attended separately and summed, as Wan's I2V cross-attention does.
            out = out + _attend_cache(q, image_kv)
        return self.o(out.transpose(0, 1).reshape(L, -1))  # (L, dim)


def _attend_cache(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``q`` (1, H, L, D) over a cross-attention cache's ``(k, v)``, each (H, T, D) -> (H, L, D). Batched (4-D):
    torch's fused CPU kernel takes only 4-D inputs, and 3-D ones ran the unfused math path, 1.5-3.5x slower."""
    k, v = kv
    return F.scaled_dot_product_attention(q, k[None], v[None])[0]


# ----------------------------------------------------------------------------- block, head
class WanAttentionBlock(nn.Module):
    def __init__(self, dim: int, ffn_dim: int, num_heads: int, eps: float, qk_norm: bool, cross_attn_norm: bool,
                 has_image: bool) -> None:
        super().__init__()
        self.norm1 = WanLayerNorm(dim, eps)
        self.self_attn = WanSelfAttention(dim, num_heads, eps, qk_norm)
        self.norm3 = WanLayerNorm(dim, eps, elementwise_affine=True) if cross_attn_norm else nn.Identity()
        self.cross_attn = WanCrossAttention(dim, num_heads, eps, qk_norm, has_image)
        self.norm2 = WanLayerNorm(dim, eps)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        # Learned offsets added to the timestep projection: shift/scale/gate for attention and FFN.
        self.modulation = nn.Parameter(torch.randn(1, 6, dim))  # scaled by 1 / sqrt(dim) in init_weights

    def forward(self, x: torch.Tensor, e: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                text_kv: tuple, image_kv: tuple | None) -> torch.Tensor:
        # e: (L, 6, dim) float32, one modulation per token, because frames of a block and registers may sit at
        # different diffusion times (clean state token, noisy actions).
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (self.modulation.float() + e).unbind(1)
        y = self.self_attn((self.norm1(x).float() * (1 + scale_msa) + shift_msa).to(x.dtype), cos, sin, attend)
        x = x + (y.float() * gate_msa).to(x.dtype)  # (L, dim)
        x = x + self.cross_attn(self.norm3(x), text_kv, image_kv)
        y = self.ffn((self.norm2(x).float() * (1 + scale_mlp) + shift_mlp).to(x.dtype))
        return x + (y.float() * gate_mlp).to(x.dtype)  # (L, dim)

    def key_values(self, x: torch.Tensor, e: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (H, L, D) K/V that :meth:`forward` hands to ``attend``, and nothing after them."""
        shift_msa, scale_msa = (self.modulation[:, :2].float() + e[:, :2]).unbind(1)
        return self.self_attn.key_values((self.norm1(x).float() * (1 + scale_msa) + shift_msa).to(x.dtype), cos, sin)


class Head(nn.Module):
    def __init__(self, dim: int, out_dim: int, patch_size: tuple[int, ...], eps: float) -> None:
        super().__init__()
        self.norm = WanLayerNorm(dim, eps)
        self.head = nn.Linear(dim, out_dim * math.prod(patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, dim))  # scaled by 1 / sqrt(dim) in init_weights

    def forward(self, x: torch.Tensor, e0: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.modulation.float() + e0[:, None]).unbind(1)  # (L, dim) each
        return self.head((self.norm(x).float() * (1 + scale) + shift).to(x.dtype))  # (L, out_dim * prod(patch))


class MLPProj(nn.Module):
    """Image encoder tokens -> model width (Wan's ``img_emb``)."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(in_dim), nn.Linear(in_dim, in_dim), nn.GELU(),
                                  nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


# ----------------------------------------------------------------------------- segments
@dataclass
class Segment:
    """The inputs of one forward: a block of latent frames and optional register tokens."""

    latents: torch.Tensor  # (in_dim, F, H, W) noisy latents plus any channel conditioning
    timesteps: torch.Tensor  # (F,) diffusion time in [0, 1000] of each frame (0 = clean)
    first_frame: int  # absolute frame index of latents[:, 0]: RoPE position and place in sink/window
    registers: torch.Tensor | None = None  # (R, dim) embedded register tokens
    register_timesteps: torch.Tensor | None = None  # (R,) diffusion time of each register

    @property
    def num_frames(self) -> int:
        return self.latents.shape[1]

    @property
    def num_registers(self) -> int:
        return 0 if self.registers is None else self.registers.shape[0]


@dataclass
class SegmentOutput:
    video: torch.Tensor | None  # (out_dim, F, H, W) float32 prediction, None when not asked for
    registers: torch.Tensor | None  # (R, dim) final hidden states of the registers, None without registers


def block_causal_mask(segments: Sequence[Segment], tokens_per_frame: int, sink_frames: int,
                      window_frames: int) -> torch.Tensor:
    """Dense (L, L) bool mask, True where a query may attend a key: the KV core's visibility written out.

    With segments laid out back to back (each: video tokens, then registers),
    a query of segment ``a`` (whose first frame is ``C``, the frames committed
    before it) sees:

    - every token of its own segment, video and registers (non-causal within a block), and
    - the video tokens of earlier frames ``j < C`` still retained at that time::

          j < sink_frames                         the sink, kept forever
          max(sink_frames, C - window) <= j < C   the newest ``window`` frames after the sink

    Registers of earlier segments are never visible: they are never committed.
    """
    seg_ids, frames, is_video = [], [], []
    for i, seg in enumerate(segments):
        n_video = seg.num_frames * tokens_per_frame
        seg_ids.append(torch.full((n_video + seg.num_registers,), i))
        video_frames = seg.first_frame + torch.arange(seg.num_frames).repeat_interleave(tokens_per_frame)
        frames.append(torch.cat([video_frames, torch.full((seg.num_registers,), -1)]))
        is_video.append(torch.arange(n_video + seg.num_registers) < n_video)
    seg_id, frame, video = torch.cat(seg_ids), torch.cat(frames), torch.cat(is_video)
    first = torch.tensor([s.first_frame for s in segments])[seg_id][:, None]  # (L, 1): C of each query
    key_frame = frame[None, :]  # (1, L)
    in_sink = key_frame < sink_frames
    in_window = key_frame >= torch.clamp(first - window_frames, min=sink_frames)
    retained = video[None, :] & (key_frame < first) & (in_sink | in_window)  # (L, L)
    return retained | (seg_id[:, None] == seg_id[None, :])


# ----------------------------------------------------------------------------- model
class WanTransformer(nn.Module):
    """The Wan 2.1 DiT made causal: self-attention through per-layer KV contexts, cross-attention to named caches.

    ``config`` needs the ``pipelines.config.BackboneConfig`` fields; an
    ``image_dim`` attribute > 0 adds Wan's image cross-attention and ``img_emb``.
    """

    def __init__(self, config) -> None:
        super().__init__()
        c = config
        self.config = config
        self.dim = c.dim
        self.freq_dim = c.freq_dim
        self.head_size = c.head_size
        self.patch_size = tuple(c.patch_size)
        self.out_dim = c.out_dim
        image_dim = getattr(c, "image_dim", 0)
        self.patch_embedding = nn.Conv3d(c.in_dim, c.dim, kernel_size=self.patch_size, stride=self.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(c.text_dim, c.dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(c.dim, c.dim))
        self.time_embedding = nn.Sequential(nn.Linear(c.freq_dim, c.dim), nn.SiLU(), nn.Linear(c.dim, c.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(c.dim, 6 * c.dim))
        self.blocks = nn.ModuleList(
            WanAttentionBlock(c.dim, c.ffn_dim, c.num_heads, c.eps, c.qk_norm, c.cross_attn_norm, image_dim > 0)
            for _ in range(c.num_layers)
        )
        self.head = Head(c.dim, c.out_dim, self.patch_size, c.eps)
        if image_dim > 0:
            self.img_emb = MLPProj(image_dim, c.dim)

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def init_weights(self) -> None:
        """Wan's initialisation (Xavier linears, small embeddings) from the global RNG; seed it first."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1))
        for seq in (self.text_embedding, self.time_embedding):
            for module in seq:
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02)
        # A trained head is near zero; a small random one keeps fresh rollouts bounded yet non-trivial.
        nn.init.normal_(self.head.head.weight, std=0.02)
        with torch.no_grad():  # drawn when built, scaled here: built on the meta device, a module does no arithmetic
            for module in self.modules():
                if isinstance(module, (WanAttentionBlock, Head)):
                    module.modulation.div_(module.modulation.shape[-1] ** 0.5)

    # -- conditioning caches
    def project_text(self, text_states: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(text_len, text_dim) text encoder states -> one cache (k, v) per layer, lazily.

        A generator, so ``populate_cross_attention`` copies one layer at a time
        and a failure part-way leaves the published cache untouched.
        """
        context = self.text_embedding(text_states)  # (T, dim)
        for block in self.blocks:
            yield block.cross_attn.project_text(context)

    def project_image(self, image_states: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(image_tokens, image_dim) image encoder states -> one cache (k, v) per layer, lazily."""
        context = self.img_emb(image_states)  # (T_img, dim)
        for block in self.blocks:
            yield block.cross_attn.project_image(context)

    # -- tokens
    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """(in_dim, F, H, W) -> (F * h * w, dim) with the Conv3d weights applied as one matmul (kernel == stride)."""
        C, Fr, H, W = latents.shape
        _, ph, pw = self.patch_size
        h, w = H // ph, W // pw
        patches = latents.reshape(C, Fr, h, ph, w, pw).permute(1, 2, 4, 0, 3, 5)  # (F, h, w, C, ph, pw)
        weight = self.patch_embedding.weight.flatten(1)  # (dim, C * 1 * ph * pw)
        return F.linear(patches.reshape(Fr * h * w, C * ph * pw), weight, self.patch_embedding.bias)  # (N, dim)

    def unpatchify(self, out: torch.Tensor, num_frames: int, h: int, w: int) -> torch.Tensor:
        """(F * h * w, prod(patch) * out_dim) -> (out_dim, F, h * ph, w * pw); channels last per patch, as Wan."""
        _, ph, pw = self.patch_size
        x = out.view(num_frames, h, w, ph, pw, self.out_dim).permute(5, 0, 1, 3, 2, 4)  # (C, F, h, ph, w, pw)
        return x.reshape(self.out_dim, num_frames, h * ph, w * pw)

    def _embed(self, seg: Segment) -> tuple[torch.Tensor, ...]:
        """Tokens, per-token modulation and rotary angles of one segment."""
        _, Fr, H, W = seg.latents.shape
        _, ph, pw = self.patch_size
        h, w = H // ph, W // pw
        tokens_per_frame = h * w
        device = seg.latents.device
        x = self.patchify(seg.latents)  # (N, dim)
        times = seg.timesteps.reshape(Fr)  # (F,)
        group = torch.arange(Fr, device=device).repeat_interleave(tokens_per_frame)  # (N,) token -> frame
        frame_pos = seg.first_frame + group
        rows = torch.arange(h, device=device).repeat_interleave(w).repeat(Fr)
        cols = torch.arange(w, device=device).repeat(h * Fr)
        if seg.num_registers:
            R = seg.num_registers
            x = torch.cat([x, seg.registers.to(x.dtype)])  # (N + R, dim)
            times = torch.cat([times, seg.register_timesteps.reshape(R).to(times)])  # (F + R,)
            group = torch.cat([group, Fr + torch.arange(R, device=device)])
            # Registers take the block's first frame and the origin of the grid: they belong to this block.
            zeros = torch.zeros(R, dtype=torch.long, device=device)
            frame_pos = torch.cat([frame_pos, zeros + seg.first_frame])
            rows, cols = torch.cat([rows, zeros]), torch.cat([cols, zeros])
        # Embed each distinct frame/register time once, then gather per token.
        e0 = self.time_embedding(sinusoidal_embedding(times, self.freq_dim).to(x.dtype))  # (F + R, dim)
        e = self.time_projection(e0).float().unflatten(1, (6, self.dim))  # (F + R, 6, dim)
        angles = rope_angles(frame_pos, rows, cols, self.head_size)  # (L, D/2) float64
        return x, e[group], e0.float()[group], torch.cos(angles).float(), torch.sin(angles).float()

    def _video_out(self, x: torch.Tensor, e0: torch.Tensor, seg: Segment) -> torch.Tensor:
        _, Fr, H, W = seg.latents.shape
        _, ph, pw = self.patch_size
        n = x.shape[0]
        out = self.head(x, e0).float()  # (N, prod(patch) * out_dim)
        assert n == Fr * (H // ph) * (W // pw), "video token count out of sync with the segment's latents"
        return self.unpatchify(out, Fr, H // ph, W // pw)  # (out_dim, F, H, W)

    def forward(self, seg: Segment, attend: Sequence[Attend], text_kv: KVPairs, image_kv: KVPairs | None = None,
                *, return_video: bool = True) -> SegmentOutput:
        """One segment against history held elsewhere: ``attend[i]`` is layer i's paged KV context."""
        assert len(attend) == self.num_layers, f"got {len(attend)} attention contexts for {self.num_layers} layers"
        x, e, e0, cos, sin = self._embed(seg)
        for i, block in enumerate(self.blocks):
            x = block(x, e, cos, sin, attend[i], text_kv[i], None if image_kv is None else image_kv[i])
        n_video = x.shape[0] - seg.num_registers
        video = self._video_out(x[:n_video], e0[:n_video], seg) if return_video else None
        return SegmentOutput(video=video, registers=x[n_video:] if seg.num_registers else None)

    def commit_forward(self, seg: Segment, attend: Sequence[Attend], store: Store, text_kv: KVPairs,
                       image_kv: KVPairs | None = None) -> None:
        """A commit pass whose outputs nobody reads: only what reaches the KV cache is computed.

        Layers before the last run as in :meth:`forward` (``attend[i]``); the last one only projects its K/V and
        hands them to ``store`` (``ARDiffusionLayerContext.store``). Its attention, cross-attention and FFN, and
        the head, feed nothing the cache keeps: the same K/V as a full pass, one layer's work less.
        """
        assert len(attend) == self.num_layers, f"got {len(attend)} attention contexts for {self.num_layers} layers"
        x, e, _, cos, sin = self._embed(seg)
        *body, last = self.blocks
        for i, block in enumerate(body):
            x = block(x, e, cos, sin, attend[i], text_kv[i], None if image_kv is None else image_kv[i])
        store(*last.key_values(x, e, cos, sin))

    def reference_forward(self, history: Sequence[Segment], seg: Segment, *, sink_frames: int, window_frames: int,
                          text_kv: KVPairs, image_kv: KVPairs | None = None) -> SegmentOutput:
        """Recompute ``history`` (the committed segments, in order) and ``seg`` densely; return ``seg``'s outputs.

        No KV cache: every committed frame is re-embedded and re-attended in one
        sequence under :func:`block_causal_mask`, which gives each history
        segment the same view its own commit pass had.
        """
        segments = [*history, seg]
        expected = 0
        for s in segments:
            assert s.first_frame == expected, "history must be contiguous committed frames, then the segment"
            expected += s.num_frames if s is not seg else 0
        embedded = [self._embed(s) for s in segments]
        x, e, e0, cos, sin = (torch.cat(parts) for parts in zip(*embedded))
        tokens_per_frame = (seg.latents.shape[2] // self.patch_size[1]) * (seg.latents.shape[3] // self.patch_size[2])
        mask = block_causal_mask(segments, tokens_per_frame, sink_frames, window_frames).to(x.device)  # (L, L)

        def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (H, L, D)

        for i, block in enumerate(self.blocks):
            x = block(x, e, cos, sin, dense, text_kv[i], None if image_kv is None else image_kv[i])
        start = x.shape[0] - seg.num_frames * tokens_per_frame - seg.num_registers  # the segment is last
        n_video = seg.num_frames * tokens_per_frame
        video = self._video_out(x[start:start + n_video], e0[start:start + n_video], seg)
        return SegmentOutput(video=video, registers=x[start + n_video:] if seg.num_registers else None)
