"""Small conditioning and latent models around the transformer: latent codec, text encoder, image encoder.

They stand in for the Wan VAE, umT5 and CLIP at the same interfaces (shapes,
strides, token counts) so the pipelines run end to end on a laptop CPU. Each
is deterministic: the codec takes the mean instead of sampling, and the
tokenizer is plain UTF-8 bytes.
"""

from __future__ import annotations

import unicodedata

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD_ID = 0  # fills the text cache up to text_len
EOS_ID = 1  # ends every prompt, so "" still has one real token
BYTE_OFFSET = 2  # token id of byte b is b + BYTE_OFFSET
TEXT_VOCAB = 256 + BYTE_OFFSET


def to_unit_range(frames: torch.Tensor) -> torch.Tensor:
    """uint8 RGB -> float32 in [-1, 1]."""
    return frames.float() / 127.5 - 1.0


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """float RGB in [-1, 1] -> uint8, rounded."""
    return ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


class LatentCodec(nn.Module):
    """RGB frames <-> latent frames with Wan VAE strides: ``vae_stride`` spatially, ``temporal_stride`` in time.

    A linear patch codec: one latent pixel is a linear map of a block of
    ``temporal_stride`` frames x ``vae_stride`` x ``vae_stride`` pixels, and the
    decoder is the transposed map. Like the causal Wan VAE (1 + 4k frames ->
    1 + k latents), a single frame encodes alone (repeated to fill its block)
    and any other clip must be a whole number of blocks.
    """

    def __init__(self, latent_channels: int, vae_stride: int, temporal_stride: int) -> None:
        super().__init__()
        self.latent_channels = latent_channels
        self.vae_stride = vae_stride
        self.temporal_stride = temporal_stride
        channels = 3 * temporal_stride  # a block of frames, frame-major then RGB
        self.encoder = nn.Conv2d(channels, latent_channels, kernel_size=vae_stride, stride=vae_stride)
        self.decoder = nn.ConvTranspose2d(latent_channels, channels, kernel_size=vae_stride, stride=vae_stride)

    def init_weights(self) -> None:
        """Small random maps, plus a mean-colour path in latent channels 0-2 so fresh previews resemble the input."""
        s, t = self.vae_stride, self.temporal_stride
        nn.init.normal_(self.encoder.weight, std=0.02 / s)
        nn.init.normal_(self.decoder.weight, std=0.02)
        nn.init.zeros_(self.encoder.bias)
        nn.init.zeros_(self.decoder.bias)
        with torch.no_grad():
            for c in range(min(3, self.latent_channels)):
                self.encoder.weight[c].zero_()
                self.encoder.weight[c, c::3] = 1.0 / (t * s * s)  # mean of colour c over the block
                self.decoder.weight[c].zero_()
                self.decoder.weight[c, c::3] = 1.0  # paint it back on every pixel of every frame

    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """uint8 (T, H, W, 3) with T == 1 or a multiple of temporal_stride -> (C, T', H/s, W/s) float32."""
        T, H, W, _ = frames.shape
        t = self.temporal_stride
        if T != 1 and T % t:
            raise ValueError(f"the codec encodes 1 frame or a multiple of {t} frames, got {T}")
        x = to_unit_range(frames)  # (T, H, W, 3)
        if T == 1:
            x = x.expand(t, H, W, 3)
        blocks = x.reshape(-1, t, H, W, 3).permute(0, 1, 4, 2, 3).reshape(-1, 3 * t, H, W)  # (T', 3t, H, W)
        weight = self.encoder.weight
        z = self.encoder(blocks.to(weight.dtype))  # (T', C, h, w)
        return z.float().permute(1, 0, 2, 3).contiguous()  # (C, T', h, w)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(C, F, h, w) -> uint8 (F * temporal_stride, h * s, w * s, 3)."""
        C, Fr, h, w = latents.shape
        t, s = self.temporal_stride, self.vae_stride
        x = self.decoder(latents.permute(1, 0, 2, 3).to(self.decoder.weight.dtype))  # (F, 3t, H, W)
        x = x.float().view(Fr, t, 3, h * s, w * s).permute(0, 1, 3, 4, 2)  # (F, t, H, W, 3)
        return to_uint8(x.reshape(Fr * t, h * s, w * s, 3))


def tokenize(text: str, length: int) -> list[int]:
    """Deterministic byte tokenizer: NFC, collapsed whitespace, UTF-8 bytes, EOS, padded/truncated to ``length``."""
    clean = " ".join(unicodedata.normalize("NFC", text).split())
    ids = [b + BYTE_OFFSET for b in clean.encode("utf-8")][: length - 1] + [EOS_ID]
    return ids + [PAD_ID] * (length - len(ids))


class TextEncoder(nn.Module):
    """Token + position embeddings and one residual MLP: a stand-in for umT5 with the same output shape."""

    def __init__(self, text_dim: int, text_len: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.text_len = text_len
        self.token_embedding = nn.Embedding(TEXT_VOCAB, text_dim)
        self.position_embedding = nn.Parameter(torch.zeros(text_len, text_dim))
        self.norm = nn.LayerNorm(text_dim, eps=eps)
        self.ffn = nn.Sequential(nn.Linear(text_dim, 2 * text_dim), nn.GELU(), nn.Linear(2 * text_dim, text_dim))

    def init_weights(self) -> None:
        nn.init.normal_(self.token_embedding.weight, std=1.0)
        nn.init.normal_(self.position_embedding, std=0.1)

    def forward(self, prompt: str) -> torch.Tensor:
        """prompt -> (text_len, text_dim). Padding positions are zero, as Wan pads umT5 states."""
        device = self.position_embedding.device
        ids = torch.tensor(tokenize(prompt, self.text_len), device=device)  # (T,)
        h = self.token_embedding(ids) + self.position_embedding  # (T, text_dim)
        h = h + self.ffn(self.norm(h))
        return h * (ids != PAD_ID)[:, None].to(h.dtype)


class ImageEncoder(nn.Module):
    """A CLIP-ViT-shaped encoder: patch embedding, class token, positions, one residual MLP.

    Output has ``1 + (image_size / image_patch) ** 2`` tokens (257 for CLIP
    ViT-H/14 at 224 px, as Wan I2V uses).
    """

    def __init__(self, image_dim: int, image_size: int, image_patch: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.image_size = image_size
        self.image_patch = image_patch
        num_tokens = 1 + (image_size // image_patch) ** 2
        self.patch_embedding = nn.Conv2d(3, image_dim, kernel_size=image_patch, stride=image_patch, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(image_dim))
        self.position_embedding = nn.Parameter(torch.zeros(num_tokens, image_dim))
        self.norm = nn.LayerNorm(image_dim, eps=eps)
        self.mlp = nn.Sequential(nn.Linear(image_dim, 2 * image_dim), nn.GELU(), nn.Linear(2 * image_dim, image_dim))

    def init_weights(self) -> None:
        nn.init.normal_(self.class_embedding, std=0.1)
        nn.init.normal_(self.position_embedding, std=0.1)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 (H, W, 3) -> (image_tokens, image_dim)."""
        x = to_unit_range(image).permute(2, 0, 1)[None]  # (1, 3, H, W)
        x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        x = self.patch_embedding(x.to(self.class_embedding.dtype))  # (1, image_dim, p, p)
        x = torch.cat([self.class_embedding[None], x.flatten(2)[0].T]) + self.position_embedding  # (tokens, dim)
        return x + self.mlp(self.norm(x))
