"""Reference AR-Diffusion pipelines shipped with ardiff.

- ``pipelines.dreamzero``: a DreamZero-style world-action model (two CFG branches,
  text + image cross-attention, action/state registers, robot observation schema).
- ``pipelines.causal_world``: a single-branch causal DMD world model (Self-Forcing /
  LingBot style: sink + sliding window, three frames per block, few-step sampler).

Each package's ``__init__`` is torch-free (``Config``, ``observation_schema()``,
``pipeline_class()``); the model code imports torch only when ``pipeline_class()``
is called. Shared model code: ``pipelines.wan`` (the causal transformer),
``pipelines.encoders`` (latent codec, text and image encoders),
``pipelines.rollout`` (paged KV and dense reference execution) and
``pipelines.checkpoint`` (safetensors I/O and default checkpoints).
"""
