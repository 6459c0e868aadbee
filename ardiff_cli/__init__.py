"""ardiff: run autoregressive video-diffusion world models with persistent paged-KV sessions."""

__version__ = "0.1.0"
