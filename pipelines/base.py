"""What both reference pipelines share: loading, state binding, session records, noise, decoding.

The pipeline sees a session's KV only between ``bind_ar_diffusion_state``
entry and exit, through a :class:`~pipelines.rollout.PagedRollout`. Its own
per-session record (``self.sessions``) is dropped by the reset and close hooks
the runner calls after releasing the KV.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn as nn

from ardiff_cli.runtime.capability import ARDiffusionKVCacheSpec, as_int, as_scalar
from ardiff_cli.runtime.errors import CheckpointError, ObservationError
from ardiff_cli.runtime.observation import ObservationSchema, validate_observation
from ardiff_cli.runtime.request import ARDiffusionRequest
from pipelines.checkpoint import (build_config_on_meta, check_weight_fields, default_checkpoint,
                                  default_checkpoint_hint, fresh_modules, load_checkpoint, read_metadata,
                                  refuse_non_finite)
from pipelines.rollout import PagedRollout

MODEL_KEY = "__model__"  # the exported session's model_identity(), beside its record's fields


def noise_generator(seed: int, counter: int) -> torch.Generator:
    """A CPU generator for draw ``counter`` of a rollout seeded with ``seed``.

    Noise is drawn on the CPU and then moved, so a seed gives the same noise on
    every device; mixing the pair through ``SeedSequence`` keeps neighbouring
    (seed, counter) pairs independent.
    """
    state = np.random.SeedSequence([int(seed), int(counter)]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device="cpu").manual_seed(int(state) & ((1 << 63) - 1))


def shifted_sigmas(num_steps: int, shift: float) -> list[float]:
    """Flow-matching noise levels from 1 to 0 in ``num_steps`` steps, warped as Wan does: s' = k s / (1 + (k - 1) s).

    A shift k > 1 spends more steps at high noise, where large latent grids need them.
    """
    return [shift_sigma(1.0 - i / num_steps, shift) for i in range(num_steps + 1)]


def shift_sigma(sigma: float, shift: float) -> float:
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def tensor_bytes(record: Any) -> int:
    """Bytes of the tensors a session record (a dataclass) holds."""
    return sum(
        value.numel() * value.element_size()
        for value in (getattr(record, f.name) for f in dataclasses.fields(record))
        if isinstance(value, torch.Tensor)
    )


def as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return torch.from_numpy(np.ascontiguousarray(value)).to(device)


def _metadata_or_empty(path: Path) -> dict[str, str]:
    """The checkpoint's metadata, or {} where it cannot be read (the load's own error says why)."""
    try:
        return read_metadata(path)
    except CheckpointError:
        return {}


class ARPipeline(abc.ABC):
    """Base of the reference pipelines. Subclasses set ``name``, ``cross_names`` and implement ``build_modules``
    and ``_step`` (``step`` wraps it in ``torch.no_grad``)."""

    name: ClassVar[str]  # registered pipeline name; also the checkpoint metadata
    cross_names: ClassVar[tuple[str, ...]]  # named cross-attention caches every transformer forward reads
    session_record: ClassVar[type]  # the dataclass of ``self.sessions``' values (what a swapped session keeps)
    supports_request_batch: ClassVar[bool] = False  # request mode only
    supports_step_execution: ClassVar[bool] = False

    def __init__(self, config, modules: nn.Module, *, device: torch.device, dtype: torch.dtype,
                 checkpoint: Path | None = None) -> None:
        self.config = config  # the pipeline's Config (geometry, sampler settings)
        self.modules = modules  # all weights: transformer, vae, encoders
        self.transformer = modules.transformer
        self.vae = modules.vae
        self.text_encoder = modules.text_encoder
        self.device = torch.device(device)
        self.dtype = dtype  # model and KV dtype
        self.checkpoint = checkpoint  # the file the weights came from (None when built in memory)
        self.spec: ARDiffusionKVCacheSpec = config.kv_cache_spec()
        self.sessions: dict[str, Any] = {}  # session id -> the pipeline's own record (model-owned state)
        self._bound: tuple[str, Any] | None = None  # (session id, KV state) during one forward only
        self._checked: tuple[Any, Any] | None = None  # (request, its parsed inputs) from the runner's check
        self._model_identity: str | None = None  # model_identity(), once computed

    # ------------------------------------------------------------------ construction
    @classmethod
    @abc.abstractmethod
    def build_modules(cls, config) -> nn.Module:
        """The pipeline's modules for ``config`` (freshly initialised; weights load afterwards)."""

    @classmethod
    def from_config(cls, config, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    checkpoint: str | Path | None = None):
        """Load ``checkpoint`` (None: the built-in default, built on first use) for ``config``."""
        path = Path(checkpoint) if checkpoint is not None else default_checkpoint(cls, config)
        modules = build_config_on_meta(cls, config)
        try:
            try:
                metadata = load_checkpoint(modules, path, device, dtype)
            except CheckpointError:
                # A file that records another geometry of this pipeline (written for `preset: tiny`, loaded with
                # `preset: small`) is named by the fields that differ, not by its hundreds of mismatched tensors.
                check_weight_fields(cls.name, config, _metadata_or_empty(path), path)
                raise
            check_weight_fields(cls.name, config, metadata, path)
            modules = modules.to(device=device, dtype=dtype).eval().requires_grad_(False)
            refuse_non_finite(modules, path, dtype)
        except CheckpointError as exc:
            if checkpoint is None:  # ardiff's own cached file, damaged (a disk error, an edit): it is only a cache
                exc.hint = default_checkpoint_hint(path)
            raise
        pipeline = cls(config, modules, device=torch.device(device), dtype=dtype, checkpoint=path)
        # The file as loaded: one deleted or moved later (a training job rotating its checkpoints) failed every
        # swap-out of the run, first made after the model loaded
        pipeline.model_identity()
        return pipeline

    @classmethod
    def fresh(cls, config):
        """Freshly initialised weights in memory, CPU float32 (same tensors a fresh checkpoint holds); no file."""
        modules = fresh_modules(lambda: cls.build_modules(config), config.seed).eval().requires_grad_(False)
        return cls(config, modules, device=torch.device("cpu"), dtype=torch.float32)

    # ------------------------------------------------------------------ capability
    def ar_diffusion_kv_cache_spec(self) -> ARDiffusionKVCacheSpec:
        return self.spec

    @contextmanager
    def bind_ar_diffusion_state(self, session_id: str, state) -> Iterator[None]:
        if self._bound is not None:
            raise RuntimeError(
                f"{type(self).__name__} is already bound to session {self._bound[0]!r}: request mode binds "
                "one session per forward"
            )
        self._bound = (session_id, state)
        try:
            yield
        finally:
            self._bound = None

    def reset_ar_diffusion_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def close_ar_diffusion_session(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    # ------------------------------------------------------------------ swap
    def export_ar_diffusion_session(self, session_id: str) -> dict[str, Any] | None:
        """What this pipeline keeps for ``session_id`` outside the runner's pools, for swapping it out: the fields
        of its record (tensors on the CPU, other values as they are), or None when it keeps nothing."""
        record = self.sessions.get(session_id)
        if record is None:
            return None
        values = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
        return {**{k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in values.items()},
                MODEL_KEY: self.model_identity()}

    def model_identity(self) -> str:
        """A digest of this pipeline's config (every field) and checkpoint file (path, size, modification time),
        stored with each exported session: a session goes on only under the model that made its history."""
        if self._model_identity is None:
            weights = None
            if self.checkpoint is not None:
                stat = Path(self.checkpoint).stat()
                weights = [str(Path(self.checkpoint).resolve()), stat.st_size, stat.st_mtime_ns]
            text = json.dumps({"pipeline": self.name, "config": self.config.to_dict(), "weights": weights},
                              sort_keys=True, default=str)
            self._model_identity = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._model_identity

    def import_ar_diffusion_session(self, session_id: str, snapshot: dict[str, Any] | None) -> None:
        """Take back what :meth:`export_ar_diffusion_session` gave for ``session_id``. A snapshot that is not a
        record of this pipeline (other fields, a tensor where a plain value belongs or the reverse, another type)
        is a ``ValueError`` naming the field, and nothing is kept: never a silently different session."""
        where = f"{type(self).__name__}.import_ar_diffusion_session({session_id!r})"
        if snapshot is None:
            self.sessions.pop(session_id, None)
            return
        if isinstance(snapshot, dict) and MODEL_KEY in snapshot:
            snapshot = dict(snapshot)
            model = snapshot.pop(MODEL_KEY)
            if model != self.model_identity():  # another config or checkpoint: its KV is another model's
                raise ValueError(f"{where}: the session was exported by another model (config or checkpoint "
                                 f"{model!r}, this one {self.model_identity()!r}): its history is not this model's")
        record_type = self.session_record
        hints = typing.get_type_hints(record_type)
        names = [f.name for f in dataclasses.fields(record_type)]
        if not isinstance(snapshot, dict) or sorted(snapshot) != sorted(names):
            got = sorted(snapshot) if isinstance(snapshot, dict) else type(snapshot).__name__
            raise ValueError(f"{where}: fields {got}, expected those of {record_type.__name__}: {sorted(names)}")
        values = {}
        for name in names:
            value, hint = snapshot[name], hints[name]
            ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
            if not ok:
                raise ValueError(f"{where}: field {name!r} is {type(value).__name__}, expected {hint.__name__}")
            values[name] = value.to(self.device) if isinstance(value, torch.Tensor) else value
        self.sessions[session_id] = record_type(**values)

    def forward(self, request: ARDiffusionRequest) -> dict[str, Any]:
        if self._bound is None:
            raise RuntimeError(f"{type(self).__name__}.forward() called outside bind_ar_diffusion_state()")
        session_id, state = self._bound
        if request.session_id != session_id:
            raise RuntimeError(f"request names session {request.session_id!r} but {session_id!r} is bound")
        checked, self._checked = self._checked, None
        parsed = checked[1] if checked is not None and checked[0] is request else None
        return self.step(session_id, PagedRollout(self.transformer, state, self.cross_names), request.inputs,
                         parsed=parsed)

    def check_ar_diffusion_request(self, request: ARDiffusionRequest) -> None:
        """Parse the request's inputs as the forward would (``_parse``), before the runner touches its session;
        the forward then takes them as parsed here."""
        self._checked = None
        with torch.no_grad():
            self._checked = (request, self._parse(request.inputs))

    def step(self, session_id: str, rollout, inputs: dict[str, Any], *, parsed: Any = None) -> dict[str, Any]:
        """One request of ``session_id`` against ``rollout`` (paged, or the dense reference in tests); ``parsed``:
        ``_parse(inputs)``, when it ran already."""
        with torch.no_grad():
            return self._step(session_id, rollout, self._parse(inputs) if parsed is None else parsed)

    @abc.abstractmethod
    def _parse(self, inputs: dict[str, Any]) -> Any:
        """The request's inputs checked and converted for ``_step``, touching no session: bad ones raise here."""

    @abc.abstractmethod
    def _step(self, session_id: str, rollout, parsed: Any) -> dict[str, Any]:
        """The pipeline's request logic (no grad), on ``_parse``'s result."""

    def _seed_and_observation(self, inputs: dict[str, Any], schema: ObservationSchema) -> tuple[int, dict[str, Any]]:
        """The request's noise ``seed`` (default: the config's) and its other inputs validated against ``schema``."""
        given = inputs.get("seed", self.config.seed)
        seed = as_int(as_scalar(given))  # numpy's integers and a 0-d integer tensor too, never a bool, as the config's
        if seed is None or seed < 0:
            raise ObservationError(f"request inputs: 'seed' must be a non-negative integer, got {given!r}")
        obs = validate_observation(schema, {k: v for k, v in inputs.items() if k != "seed"}, where="request inputs")
        return seed, obs

    def _text_kv(self, prompt: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The text cross-attention cache of ``prompt``: one (k, v) per layer, lazily."""
        yield from self.transformer.project_text(self.text_encoder(prompt))

    # ------------------------------------------------------------------ views
    def model_owned_state_bytes(self, session_id: str) -> int:
        """Bytes of tensors this pipeline keeps for ``session_id`` outside the runner's pools."""
        record = self.sessions.get(session_id)
        return 0 if record is None else tensor_bytes(record)

    def decode_latents(self, latents: Any) -> np.ndarray:
        """Latent frames (C, F, h, w) -> uint8 RGB (F * temporal_stride, H, W, 3) for previews."""
        with torch.no_grad():
            z = as_tensor(latents, self.device)
            if z.dim() != 4 or z.shape[0] != self.config.latent_channels:
                raise ValueError(
                    f"latents must be shaped (latent_channels={self.config.latent_channels}, frames, h, w), "
                    f"got {tuple(z.shape)}"
                )
            return self.vae.decode(z).cpu().numpy()
