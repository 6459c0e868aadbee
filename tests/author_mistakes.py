"""Pipelines with the mistakes a pipeline author makes, for ``--pipeline module:Class`` tests.

Each is the real causal_world pipeline with one thing wrong; none is shipped.
"""

from __future__ import annotations

import dataclasses

from pipelines.causal_world.pipeline import CausalWorldPipeline


class WrongKVHeads(CausalWorldPipeline):
    """Its spec (its config's, so inspect-capacity plans the same) declares twice the KV heads its transformer has."""

    class Config(CausalWorldPipeline.Config):
        def kv_cache_spec(self):
            spec = super().kv_cache_spec()
            return dataclasses.replace(spec, num_kv_heads=2 * spec.num_kv_heads)


class WrongCrossTokens(CausalWorldPipeline):
    """Its spec declares its text cross-attention cache one token longer than the text encoder gives."""

    class Config(CausalWorldPipeline.Config):
        def kv_cache_spec(self):
            spec = super().kv_cache_spec()
            text = dataclasses.replace(spec.cross_attention[0], num_tokens=spec.cross_attention[0].num_tokens + 1)
            return dataclasses.replace(spec, cross_attention=(text,))


class SpecOtherThanItsConfig(CausalWorldPipeline):
    """Its spec holds a longer window than its config's, from which inspect-capacity plans."""

    def ar_diffusion_kv_cache_spec(self):
        return dataclasses.replace(self.spec, window_frames=60)


class DeclaresBatching(CausalWorldPipeline):
    """It declares request batching, which the runner never does (one request per forward)."""

    supports_request_batch = True


class WarmupReturnsNone(CausalWorldPipeline):
    """Its warmup provider forgot to return (or yield) its requests."""

    def ar_diffusion_warmup_requests(self, session_id):
        list(super().ar_diffusion_warmup_requests(session_id))


class WarmupYieldsNothing(CausalWorldPipeline):
    """Its warmup provider is a generator whose loop never runs: it yields no request at all."""

    def ar_diffusion_warmup_requests(self, session_id):
        yield from ()


class WarmupFailsItsOwnCheck(CausalWorldPipeline):
    """Its warmup requests carry a seed its own input check refuses (an ObservationError, as a bad episode file's)."""

    def ar_diffusion_warmup_requests(self, session_id):
        for request in super().ar_diffusion_warmup_requests(session_id):
            yield dataclasses.replace(request, inputs={**request.inputs, "seed": -1})


class WithoutWarmup(CausalWorldPipeline):
    """Not a mistake, for contrast with the two above: no warmup provider at all (it is optional)."""

    ar_diffusion_warmup_requests = None  # a protocol member set to None: the pipeline lacks it


class WarmupMisspeltKey(CausalWorldPipeline):
    """Its warmup requests carry ``closeSession`` for ``close_session``: the runner warns of the key it does not read."""

    def ar_diffusion_warmup_requests(self, session_id):
        for request in super().ar_diffusion_warmup_requests(session_id):
            yield dataclasses.replace(request, extra_args={**request.extra_args, "closeSession": True})


class HooksMissing:
    """Carries what --pipeline checks for, but not the AR-Diffusion capability methods."""

    Config = CausalWorldPipeline.Config
    observation_schema = CausalWorldPipeline.observation_schema

    @classmethod
    def from_config(cls, config, **kwargs):
        return cls()

    def forward(self, request):
        return {}


class BrokenFromConfig(CausalWorldPipeline):
    """Its own loading code raises."""

    @classmethod
    def from_config(cls, config, **kwargs):
        raise KeyError("blocks.0.self_attn.q.weight")


class FromConfigReturnsNothing(CausalWorldPipeline):
    """Its from_config builds the pipeline and forgets to return it."""

    @classmethod
    def from_config(cls, config, **kwargs):
        super().from_config(config, **kwargs)


class FromConfigReturnsClass(CausalWorldPipeline):
    """Its from_config returns the class instead of an instance of it."""

    @classmethod
    def from_config(cls, config, **kwargs):
        return cls


class DeclaresNoSessionLimit(CausalWorldPipeline):
    """Its spec's session_capacity is 2**32, meant as "no limit: as many as fit" (the spec takes any positive bound)."""

    class Config(CausalWorldPipeline.Config):
        def kv_cache_spec(self):
            return dataclasses.replace(super().kv_cache_spec(), session_capacity=2**32)


class ReturnsTensor(CausalWorldPipeline):
    """Its forward returns the latents tensor itself instead of a dict of arrays."""

    def forward(self, request):
        return super().forward(request)["latents"]


class ConfigFromDictRaises(CausalWorldPipeline):
    """Its Config.from_dict refuses a value with a plain ValueError instead of a ConfigError."""

    class Config(CausalWorldPipeline.Config):
        @classmethod
        def from_dict(cls, data, *, where):
            raise ValueError("window_frames must be positive")


class ConfigSpecNotASpec(CausalWorldPipeline):
    """Its Config.kv_cache_spec returns the spec's fields as a dict instead of an ARDiffusionKVCacheSpec."""

    class Config(CausalWorldPipeline.Config):
        def kv_cache_spec(self):
            return dataclasses.asdict(super().kv_cache_spec())


class ConfigSpecRefused(CausalWorldPipeline):
    """Its Config.kv_cache_spec builds a spec the contract refuses (window_frames 0) from the config's values."""

    class Config(CausalWorldPipeline.Config):
        def kv_cache_spec(self):
            return dataclasses.replace(super().kv_cache_spec(), window_frames=0)


class ConfigWithoutSpec(CausalWorldPipeline):
    """Its Config has from_dict but no kv_cache_spec (the README asks for both)."""

    class Config:
        @classmethod
        def from_dict(cls, data, *, where):
            return cls()


class ReturnsLists(CausalWorldPipeline):
    """Its forward returns its outputs as nested lists (``.tolist()``), so no value is an array."""

    def forward(self, request):
        return {name: value.tolist() for name, value in super().forward(request).items()}


class ReturnsNaN(CausalWorldPipeline):
    """Its forward divides by zero: every latent NaN (0/0) or infinite."""

    def forward(self, request):
        return {name: value / 0 for name, value in super().forward(request).items()}


class ReturnsText(CausalWorldPipeline):
    """Its forward adds the prompt as a numpy string array beside the latents."""

    def forward(self, request):
        import numpy as np

        return {**super().forward(request), "caption": np.array([request.inputs["prompt"]])}


class ReturnsFloat8(CausalWorldPipeline):
    """Its forward returns its latents as float8, to halve a file's bytes: no numpy dtype holds them."""

    def forward(self, request):
        import torch

        return {name: value.to(torch.float8_e5m2) for name, value in super().forward(request).items()}


class ForwardExits(CausalWorldPipeline):
    """Its forward gives up with sys.exit(0), as a script's code may."""

    def forward(self, request):
        import sys

        sys.exit(0)


class SchemaNotASchema(CausalWorldPipeline):
    """Its config's observation_schema returns the fields as a plain dict instead of an ObservationSchema."""

    class Config(CausalWorldPipeline.Config):
        def observation_schema(self):
            return {"conditioning": "float32"}


class EntrySchemaNotASchema(CausalWorldPipeline):
    """Its config has no observation_schema of its own, so the class's is asked (what an entry module's
    observation_schema() is), and that returns a plain dict."""

    class Config(CausalWorldPipeline.Config):
        observation_schema = None

    observation_schema = staticmethod(lambda: {"conditioning": "float32"})


class SchemaRaises(CausalWorldPipeline):
    """Its config's observation_schema raises (a field it looks up is missing)."""

    class Config(CausalWorldPipeline.Config):
        def observation_schema(self):
            raise KeyError("conditioning")


class SchemaMiswritten(CausalWorldPipeline):
    """Its schema's field gives numpy's type for the dtype name, and one shape where a tuple of shapes belongs."""

    class Config(CausalWorldPipeline.Config):
        def observation_schema(self):
            import numpy as np

            from ardiff_cli.runtime.observation import ObservationField, ObservationSchema

            return ObservationSchema((ObservationField("conditioning", np.float32, (None,)),))


class ConfigFromDictReturnsDict(CausalWorldPipeline):
    """Its Config.from_dict validates the mapping, then returns the mapping instead of a Config."""

    class Config(CausalWorldPipeline.Config):
        @classmethod
        def from_dict(cls, data, *, where):
            super().from_dict(data, where=where)
            return dict(data)


class ConfigIgnoresUnknownKeys(CausalWorldPipeline):
    """Its Config.from_dict keeps the keys it knows and drops the rest without a word."""

    class Config(CausalWorldPipeline.Config):
        @classmethod
        def from_dict(cls, data, *, where):
            known = {f.name for f in dataclasses.fields(cls)}
            return super().from_dict({k: v for k, v in data.items() if k in known}, where=where)


class ReturnsNumberedArrays(CausalWorldPipeline):
    """Its forward names its arrays by index: written as "0", and {0: ...} with {'0': ...} one array."""

    def forward(self, request):
        return dict(enumerate(super().forward(request).values()))


class ConfigFromDictWithoutWhere(CausalWorldPipeline):
    """Its Config.from_dict takes the mapping alone, not the `where` keyword ardiff passes."""

    class Config(CausalWorldPipeline.Config):
        @classmethod
        def from_dict(cls, data):
            return super().from_dict(data, where="config")


class ConfigFromDictPlainMethod(CausalWorldPipeline):
    """Its Config.from_dict has the right parameters but no @classmethod."""

    class Config(CausalWorldPipeline.Config):
        def from_dict(cls, data, *, where):
            return CausalWorldPipeline.Config.from_dict(data, where=where)


class BindWithoutSessionId(CausalWorldPipeline):
    """Its bind_ar_diffusion_state takes the KV state alone (it reads the session id off it), where the runner passes
    the session id and the state: it loaded, and failed at its first request."""

    def bind_ar_diffusion_state(self, state):
        return super().bind_ar_diffusion_state(state.session_id, state)


class KVAsNumpy(CausalWorldPipeline):
    """Its first layer hands the KV cache its keys and values as numpy arrays (a port of a numpy reference model)."""

    @classmethod
    def from_config(cls, config, **kwargs):
        pipeline = super().from_config(config, **kwargs)
        attention = pipeline.transformer.blocks[0].self_attn
        key_values = attention.key_values
        attention.key_values = lambda *args: tuple(t.numpy() for t in key_values(*args))
        return pipeline


class NoQueryHeads(CausalWorldPipeline):
    """Its first layer keeps the query heads of one of 8 tensor-parallel ranks, written for a model of 8 or more
    heads: with the tiny preset's 4, none (q of 0 heads, which torch attends to an empty output)."""

    @classmethod
    def from_config(cls, config, **kwargs):
        pipeline = super().from_config(config, **kwargs)
        attention = pipeline.transformer.blocks[0].self_attn
        forward = attention.forward

        def sharded(x, cos, sin, attend):
            return forward(x, cos, sin, lambda q, k, v, *scale: attend(q[: q.shape[0] // 8], k, v, *scale))

        attention.forward = sharded
        return pipeline


class ScalesTextKeysInPlace(CausalWorldPipeline):
    """After its forward, it scales the text keys it read in place (``k.mul_``): those are the session's cache itself,
    so each request scaled them again, and its outputs drifted from request to request without a word."""

    def forward(self, request):
        output = super().forward(request)
        for k, _ in self._bound[1].cross_attention("main", "text"):
            k.mul_(1.5)
        return output
