"""Config plumbing shared by the pipeline packages. No torch import.

A pipeline's ``Config`` is a frozen dataclass in the gpt-fast / nanoGPT style:
init fields are the knobs, ``field(init=False)`` fields are derived in
``__post_init__``, and a dict of named presets runs from a CPU-sized ``tiny``
to published geometries. :func:`config_from_dict` turns the ``model:`` mapping
of a YAML config into a ``Config``; every mistake is one ``ConfigError`` that
names the field, what was expected and what was given.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import sys
import types
import typing
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ardiff_cli.runtime.capability import ARDiffusionKVCacheSpec, array_ndim, as_scalar, is_number
from ardiff_cli.runtime.capacity import MAX_SESSIONS
from ardiff_cli.runtime.errors import (ArdiffWarning, ConfigError, did_you_mean, field_error, meant_key, shown,
                                       yaml_key_note)

C = TypeVar("C")


class InvalidField(ValueError):
    """Raised by ``__post_init__``; ``config_from_dict`` turns it into a ``ConfigError`` with the source."""

    def __init__(self, name: str, expected: str, got: object, *,
                 others: tuple[InvalidField | None, ...] = ()) -> None:
        super().__init__(f"field {name!r}: expected {expected}, got {shown(got)}")
        self.name = name  # the offending field
        self.expected = expected  # what would have been valid, in words
        self.got = got  # the value given
        # the same mistake worded for other fields the check reads (None: no value of that field would do), in the
        # order they are blamed when this one was not set
        self.others = tuple(other for other in others if other is not None)

    def blamed(self, given: Mapping[str, Any]) -> InvalidField:
        """The field to name, of the keys ``given`` in the model: section: this one, unless it was not given (a
        preset's or the default) and another field of the check was, the first such of ``others`` (`vae_stride: 3`
        and `patch_size: [1, 3, 3]` named 'model.height')."""
        if self.name in given:
            return self
        return next((other for other in self.others if other.name in given), self)


def require(ok: bool, name: str, expected: str, got: object) -> None:
    if not ok:
        raise InvalidField(name, expected, got)


def derive(config: object, name: str, value: object) -> None:
    """Set a derived (``init=False``) field of a frozen dataclass."""
    object.__setattr__(config, name, value)


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """``value`` as the type ``hint`` names, or ``InvalidField``. YAML gives ints for floats and lists for tuples; a
    config built in Python may give numpy's numbers or a 0-d tensor (``torch.tensor(7.5)``, ``np.True_``): each is
    the plain value it holds (``as_scalar``), then checked as that value is, and a 1-d one for a tuple the list of
    those. A tuple's items are checked each by its type, an error naming the item (``patch_size[1]``). An error shows
    the value given."""
    given, value = value, as_scalar(value)
    if hint is bool:
        require(isinstance(value, bool), name, "true or false", given)
        return value
    if hint is int:
        # JSON-able, as the plain int YAML gives: a numpy integer made json.dumps of a checkpoint's metadata fail
        require(is_number(value, numbers.Integral), name, "an integer", given)
        value = int(value)
        # Every int here but the seed (checked in __post_init__) becomes a torch size, an int64: a larger one
        # failed in torch as "the pipeline's code failed", far from the config.
        require(name == "seed" or abs(value) < 1 << 63, name, "an integer below 2**63", given)
        return value
    if hint is float:
        require(is_number(value), name, "a number", given)
        # .inf, .nan and an int beyond float's range would reach the sampler as inf or NaN (or not convert at all)
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        require(math.isfinite(number), name, "a finite number", given)
        return number
    if hint is str:
        require(isinstance(value, str), name, "a string", given)
        return value
    if (kinds := _item_types(hint)) is not None:
        # tuple[int, ...]: any number of ints; tuple[str, float]: one item of each type, in that order
        variadic = len(kinds) == 2 and kinds[1] is Ellipsis
        if variadic:
            expected = f"a list of {kinds[0].__name__}s"
        elif len(set(kinds)) == 1:
            expected = f"a list of {len(kinds)} {kinds[0].__name__}s"
        else:
            expected = f"a list of {len(kinds)} items ({', '.join(kind.__name__ for kind in kinds)})"
        # a 1-d tensor or array is the list of the values it holds, as a list of 0-d ones is: its items are checked
        items = list(value) if isinstance(value, (list, tuple)) or array_ndim(value) == 1 else None
        require(items is not None and (variadic or len(items) == len(kinds)), name, expected, given)
        # each item as a field of its type is, named by its index as a YAML path names it: patch_size[1]
        return tuple(_coerce(f"{name}[{i}]", kinds[0] if variadic else kinds[i], item)
                     for i, item in enumerate(items))  # type: ignore[arg-type]
    raise AssertionError(f"config field {name!r} has an unsupported type {hint!r}; extend _coerce")


_PLAIN_TYPES = (bool, int, float, str)  # the types _coerce checks and converts, alone or as a tuple's items


def _item_types(hint: Any) -> tuple[Any, ...] | None:
    """The item types of a tuple of plain types (``tuple[int, ...]``: ``(int, Ellipsis)``; ``tuple[str, float]``),
    else None: a tuple of anything else (``tuple[Path, ...]``) is taken as given, as a field of that type is."""
    kinds = typing.get_args(hint)
    if typing.get_origin(hint) is not tuple or not all(kind in _PLAIN_TYPES for kind in kinds if kind is not Ellipsis):
        return None
    if Ellipsis in kinds and not (len(kinds) == 2 and kinds[1] is Ellipsis):  # not a valid tuple type
        return None
    return kinds


def checked_fields(cls: type) -> dict[str, Any]:
    """Settable field name -> resolved type, of each field ``_coerce`` checks and converts: one of a plain type
    (bool, int, float, str, or a tuple of them: ``tuple[int, ...]``, ``tuple[str, float]``) whose annotation resolves
    at run time. Any other is taken as given, in Python as from YAML (``weights: Path | None``: from YAML it was
    "unsupported type ...; extend _coerce")."""
    return {name: hint for name, hint in _resolved_fields(cls).items()
            if hint in _PLAIN_TYPES or _item_types(hint) is not None}


def _resolved_fields(cls: type) -> dict[str, Any]:
    """Settable field name -> resolved type, of each field whose annotation resolves at run time. One that does not
    (``weights: Path | None``, ``Path`` imported under ``TYPE_CHECKING``; a typo) made ``typing.get_type_hints``
    fail for the whole class, and only BackboneConfig's fields were checked: each field is resolved alone then, as
    ``get_type_hints`` would (in its declaring class's module and class namespace), and each one that does not
    resolve is an ``ArdiffWarning``, once per class, naming it: its value is kept unchecked."""
    try:
        resolved = typing.get_type_hints(cls)
        return {f.name: resolved[f.name] for f in dataclasses.fields(cls) if f.init}
    except Exception:  # NameError mostly; AttributeError for `np.floaty`, TypeError for `int | 'Later'`
        pass
    hints: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        owner = next(k for k in cls.__mro__ if f.name in inspect.get_annotations(k))  # the last declaration's class
        module = vars(sys.modules[owner.__module__]) if owner.__module__ in sys.modules else {}
        try:  # as get_type_hints(cls) resolves it (a quoted type inside one too): the module's names, then the class's
            alone = types.SimpleNamespace(__annotations__={f.name: f.type})
            hints[f.name] = typing.get_type_hints(alone, dict(vars(owner)), module)[f.name]
        except Exception as exc:
            if cls not in _WARNED_UNRESOLVED:
                warnings.warn(f"{cls.__module__}.{cls.__qualname__}: field {f.name!r} (annotation {f.type!r}) is not "
                              f"checked when the config is built: its annotation does not resolve at run time ({exc})",
                              ArdiffWarning, stacklevel=_caller_stacklevel())
    _WARNED_UNRESOLVED.add(cls)
    return hints


def _caller_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel``, in the function that calls this, for the first frame outside this module,
    ``dataclasses``, a dataclass's generated ``__init__`` (a ``<string>``) and any ``__post_init__`` (a built-in
    pipeline's ``Config`` has one that calls its base's): the line that built the config, ``Config(...)``,
    ``config.replace(...)`` or ``config_from_dict(...)``."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename in (__file__, dataclasses.__file__)
                                 or frame.f_code.co_filename.startswith("<")
                                 or frame.f_code.co_name == "__post_init__"):
        frame, level = frame.f_back, level + 1
    return level


_WARNED_UNRESOLVED: weakref.WeakSet[type] = weakref.WeakSet()  # classes whose unresolved fields were warned of


def config_from_dict(cls: type[C], data: Mapping[str, Any], *, where: str, presets: Mapping[str, dict]) -> C:
    """Build ``cls`` from a mapping: an optional ``preset`` first, then explicit keys on top of it."""
    if not isinstance(data, Mapping):
        raise field_error(where, "model", "a mapping", data)
    settable = [f.name for f in dataclasses.fields(cls) if f.init]
    derived = {f.name for f in dataclasses.fields(cls) if not f.init}
    values: dict[str, Any] = {}
    preset = data.get("preset")
    if preset is not None:
        if not isinstance(preset, str) or preset not in presets:
            raise ConfigError(
                f"{where}: field 'model.preset': unknown preset {shown(preset)}"
                f"{did_you_mean(preset, presets) if isinstance(preset, str) else ''}",
                hint=f"valid presets: {', '.join(presets)}",
            )
        values.update(presets[preset])
    for key, value in data.items():
        if key == "preset":
            continue
        if key in derived:
            raise ConfigError(
                f"{where}: field 'model.{key}' is derived, not set",
                hint=f"set the fields it derives from instead; settable fields: {', '.join(settable)}",
            )
        if key not in settable:
            raise ConfigError(
                f"{where}: unknown key 'model.{key}'{yaml_key_note(key)}"
                f"{_meant_field(cls, str(key), value, where=where, presets=presets)}",
                hint=f"valid keys: preset, {', '.join(settable)}",
            )
        values[key] = value
    try:  # __post_init__ checks and converts each value (_coerce), as it does for a config built in Python
        return cls(**values)
    except InvalidField as exc:
        exc = exc.blamed(data)
        raise field_error(where, f"model.{exc.name}", exc.expected, exc.got) from None


def _meant_field(cls: type, key: str, value: Any, *, where: str, presets: Mapping[str, dict]) -> str:
    """' (did you mean 'x'?)' for an unknown key of the model: section with ``value``, where :func:`meant_key` finds
    the key of ``cls`` (or `preset`) it was meant as: `layers` 'num_layers', `prest: tiny` 'preset'; `reset: true`
    none, where `preset` is the only key alike (a name). Else ''."""
    def takes(name: str) -> bool:
        try:
            config_from_dict(cls, {name: value}, where=where, presets=presets)
        except Exception:  # noqa: BLE001 - a config's __post_init__ may be third-party code: whatever it raises is a no
            return False
        return True

    settable = [f.name for f in dataclasses.fields(cls) if f.init]
    match = meant_key(key, ["preset", *settable], takes)
    return f" (did you mean {match!r}?)" if match is not None else ""


def _divisors(number: int) -> str:
    """The divisors of ``number`` up to 64, in words: 'one of 1, 2, 4, 8', 'only 1', 'e.g. 1, 2, ...' past 64."""
    found = [str(d) for d in range(1, min(number, 64) + 1) if number % d == 0]
    return ("e.g. " if number > 64 else "one of " if len(found) > 1 else "only ") + ", ".join(found)


@dataclass(frozen=True)
class BackboneConfig:
    """Geometry of the Wan 2.1 style causal transformer and its latent video, shared by both pipelines.

    Defaults are a CPU-sized model; subclasses re-declare fields to change them.
    """

    # -- transformer (names follow the Wan 2.1 config)
    dim: int = 64  # model width
    ffn_dim: int = 128  # feed-forward hidden width
    freq_dim: int = 32  # width of the sinusoidal timestep features
    num_heads: int = 4  # attention heads (Wan is multi-head: KV heads == query heads)
    num_layers: int = 2  # transformer blocks
    eps: float = 1e-6  # norm epsilon
    qk_norm: bool = True  # RMSNorm on q and k before RoPE
    cross_attn_norm: bool = True  # affine LayerNorm before cross-attention (Wan's norm3)
    # -- latent video
    latent_channels: int = 4  # codec latent channels (Wan VAE: 16)
    patch_size: tuple[int, ...] = (1, 2, 2)  # (frames, rows, cols) per token; frames must be 1
    height: int = 32  # model frame height in pixels
    width: int = 32  # model frame width in pixels
    vae_stride: int = 4  # codec spatial downsampling (Wan VAE: 8)
    temporal_stride: int = 4  # RGB frames per latent frame (Wan VAE: 4)
    # -- text conditioning
    text_dim: int = 32  # text encoder width (umT5-XXL: 4096)
    text_len: int = 16  # text tokens; the text cross-attention cache length (Wan: 512)
    # -- KV retention, in latent frames
    frames_per_block: int = 1
    window_frames: int = 4
    sink_frames: int = 0
    session_capacity: int = 4  # the pipeline's upper bound on resident sessions
    seed: int = 0  # initialisation seed of fresh checkpoints and default noise seed

    # -- derived
    head_size: int = field(init=False)  # dim // num_heads
    latent_height: int = field(init=False)  # height // vae_stride
    latent_width: int = field(init=False)
    tokens_per_frame: int = field(init=False)  # patches per latent frame: the page size
    in_dim: int = field(init=False)  # channels entering patch_embedding
    out_dim: int = field(init=False)  # channels leaving the head (the velocity)

    def __post_init__(self) -> None:
        # Built in Python (Config(guidance_scale="5"), dataclasses.replace), not by from_dict: each field of a plain
        # type checked and converted as from_dict's are. A float size reached torch (empty(): must be tuple of ints),
        # a quoted number failed the range checks below as a TypeError, and True passed as 1 (guidance off).
        for name, hint in checked_fields(type(self)).items():
            derive(self, name, _coerce(name, hint, getattr(self, name)))
        for name in ("dim", "ffn_dim", "freq_dim", "num_heads", "num_layers", "latent_channels", "height", "width",
                     "vae_stride", "temporal_stride", "text_dim", "text_len", "frames_per_block", "window_frames",
                     "session_capacity"):
            value = getattr(self, name)
            require(value >= 1, name, "a positive integer", value)
        # The plan takes at most MAX_SESSIONS (block tables index pages with int32): past it, load and inspect-capacity
        # failed with the planner's message, naming neither this file nor the field.
        require(self.session_capacity <= MAX_SESSIONS, "session_capacity", f"a positive integer up to {MAX_SESSIONS}",
                self.session_capacity)
        require(self.sink_frames >= 0, "sink_frames", "a non-negative integer", self.sink_frames)
        # torch.manual_seed (fresh checkpoints) takes 64 bits; a larger seed would fail there, far from the config.
        require(0 <= self.seed < 1 << 64, "seed", "a non-negative integer below 2**64", self.seed)
        require(0 < self.eps < 1, "eps", "a small positive number", self.eps)
        require(self.freq_dim % 2 == 0, "freq_dim", "an even integer", self.freq_dim)
        require(self.dim % self.num_heads == 0, "num_heads", f"a divisor of dim={self.dim}", self.num_heads)
        head_size = self.dim // self.num_heads
        # 3D RoPE splits each head into (frame, row, col) rotary pairs: 2 * (d // 6) each for rows and cols.
        require(head_size % 2 == 0 and head_size >= 6, "num_heads",
                f"a head size (dim / num_heads) that is even and >= 6, dim={self.dim}", self.num_heads)
        require(len(self.patch_size) == 3 and self.patch_size[0] == 1 and min(self.patch_size) >= 1, "patch_size",
                "[1, rows, cols]: one latent frame per token row (frames are the KV paging unit)",
                list(self.patch_size))
        _, ph, pw = self.patch_size
        for name, pixels, patch in (("height", self.height, ph), ("width", self.width, pw)):
            if pixels % (self.vae_stride * patch):
                raise InvalidField(name, f"a multiple of vae_stride * patch = {self.vae_stride * patch}", pixels,
                                   others=(self._stride_mistake(ph, pw), self._patch_mistake()))
        derive(self, "head_size", head_size)
        derive(self, "latent_height", self.height // self.vae_stride)
        derive(self, "latent_width", self.width // self.vae_stride)
        derive(self, "tokens_per_frame", (self.latent_height // ph) * (self.latent_width // pw))
        derive(self, "in_dim", self.latent_channels)
        derive(self, "out_dim", self.latent_channels)

    def _stride_mistake(self, ph: int, pw: int) -> InvalidField | None:
        """A height or width that is no multiple of vae_stride * patch, said of vae_stride (named when the config set
        it, not height or width: `vae_stride: 3` was blamed on 'model.height'), with the strides that would do; None
        when none would (the patch does not divide height or width)."""
        if self.height % ph or self.width % pw:
            return None
        return InvalidField("vae_stride", f"a value for which height={self.height} and width={self.width} are "
                            f"multiples of vae_stride * patch ({ph} x {pw}): "
                            f"{_divisors(math.gcd(self.height // ph, self.width // pw))}", self.vae_stride)

    def _patch_mistake(self) -> InvalidField | None:
        """A height or width that is no multiple of vae_stride * patch, said of patch_size (named when the config set
        it, not height or width: `patch_size: [1, 3, 3]` was blamed on 'model.height'), with the rows and cols that
        would do; None when none would (vae_stride does not divide height or width)."""
        if self.height % self.vae_stride or self.width % self.vae_stride:
            return None
        rows, cols = (_divisors(pixels // self.vae_stride) for pixels in (self.height, self.width))
        which = f"rows and cols each {rows}" if rows == cols else f"rows {rows} and cols {cols}"
        return InvalidField("patch_size", f"[1, rows, cols] for which height={self.height} and width={self.width} "
                            f"are multiples of vae_stride * patch (vae_stride {self.vae_stride}): {which}",
                            list(self.patch_size))

    def backbone_kv_spec(self, **pipeline_specific: Any) -> ARDiffusionKVCacheSpec:
        """The KV spec's backbone geometry and retention, plus what the pipeline adds (branches, caches, ...)."""
        return ARDiffusionKVCacheSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_heads,
            head_size=self.head_size,
            tokens_per_frame=self.tokens_per_frame,
            frames_per_block=self.frames_per_block,
            window_frames=self.window_frames,
            sink_frames=self.sink_frames,
            session_capacity=self.session_capacity,
            **pipeline_specific,
        )

    def to_dict(self) -> dict[str, Any]:
        """Settable fields, JSON-able (recorded in checkpoint metadata)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def replace(self: C, **changes: Any) -> C:
        return dataclasses.replace(self, **changes)
