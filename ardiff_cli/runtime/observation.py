"""Observation schemas and their validation. No torch import.

A pipeline declares its schema; the CLI validates every step file against it
before anything reaches the model, and pipelines run the same check on
``request.inputs`` so a request built in Python fails with the same message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ardiff_cli.runtime.errors import ObservationError, did_you_mean, plural, shown


@dataclass(frozen=True, slots=True)
class ObservationField:
    """One array (or the prompt) of a robot observation.

    ``shapes`` lists the accepted shapes; ``None`` in a shape is any positive
    size (for example image height and width). ``aliases`` are other key
    conventions (RoboArena, DROID) that mean the same field.
    """

    name: str  # canonical key
    dtype: str  # numpy dtype name: "uint8", "float32", ... (one of ARRAY_DTYPES)
    shapes: tuple[tuple[int | None, ...], ...]  # accepted shapes
    aliases: tuple[str, ...] = ()  # other accepted keys
    required: bool = True  # missing optional fields are simply absent
    description: str = ""  # one line for docs and error hints

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


@dataclass(frozen=True, slots=True)
class ObservationSchema:
    """The fields of one step, plus the text prompt (carried as metadata)."""

    fields: tuple[ObservationField, ...]
    prompt_key: str = "prompt"  # metadata key of the language prompt; "" when the pipeline takes none
    prompt_aliases: tuple[str, ...] = ()

    def field(self, key: str) -> ObservationField | None:
        """The field a key (canonical or alias) names, or None."""
        for f in self.fields:
            if key in f.keys:
                return f
        return None

    def problems(self) -> list[str]:
        """What is wrong with this schema as a pipeline wrote it (empty when nothing is): each would otherwise fail
        every step file as if the file were at fault."""
        if not isinstance(self.fields, (tuple, list)) or not all(isinstance(f, ObservationField) for f in self.fields):
            return [f"fields must be a tuple of ObservationField, got {shown(self.fields)}"]
        problems = []
        if not isinstance(self.prompt_key, str):
            problems.append(f"prompt_key must be text, got {shown(self.prompt_key)}")
        if not isinstance(self.prompt_aliases, (tuple, list)) or not all(
                isinstance(a, str) and a for a in self.prompt_aliases):
            problems.append(f"prompt_aliases must be a tuple of keys (text), got {shown(self.prompt_aliases)}")
        seen: set[object] = set()
        for f in self.fields:
            problems += [f"field {shown(f.name)}: {p}" for p in _field_problems(f)]
            keys = f.keys if isinstance(f.aliases, (tuple, list)) and all(isinstance(k, str) for k in f.keys) else ()
            problems += [f"key {key!r} names two fields" for key in keys if key in seen]
            seen.update(keys)
        return problems


FLOAT_DTYPES = ("float16", "float32", "float64")  # a float field accepts any of these, cast to its dtype
ARRAY_DTYPES = ("bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", *FLOAT_DTYPES)


def _field_problems(f: ObservationField) -> list[str]:
    problems = []
    if not isinstance(f.name, str) or not f.name:
        problems.append("its name must be non-empty text")
    if not isinstance(f.dtype, str) or f.dtype not in ARRAY_DTYPES:
        problems.append(f"dtype must be the name of one, such as 'uint8' or 'float32' ({', '.join(ARRAY_DTYPES)}), "
                        f"got {shown(f.dtype)}")

    def size_ok(n: object) -> bool:
        return n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 0)

    shapes_ok = isinstance(f.shapes, (tuple, list)) and len(f.shapes) > 0 and all(
        isinstance(shape, (tuple, list)) and all(size_ok(n) for n in shape) for shape in f.shapes)
    if not shapes_ok:
        problems.append("shapes must be a tuple of accepted shapes, each a tuple of sizes or None (any size), such "
                        f"as ((None, None, 3),), got {shown(f.shapes)}")
    if not isinstance(f.aliases, (tuple, list)) or not all(isinstance(a, str) and a for a in f.aliases):
        problems.append(f"aliases must be a tuple of keys (text), got {shown(f.aliases)}")
    return problems


def as_numpy(value: Any):
    """numpy view of an array-like; torch tensors are detached and moved to host without importing torch."""
    import numpy as np

    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        value = value.numpy()
    return np.asarray(value)


def format_shape(shape: tuple[int | None, ...]) -> str:
    """``(*, *, 3)``: ``*`` is any positive size."""
    inner = ", ".join("*" if n is None else str(n) for n in shape)
    return f"({inner},)" if len(shape) == 1 else f"({inner})"


def describe_shape(shape: dict[str, list[int] | None]) -> str:
    """A request's input shapes by name (``None``: an input with none, a prompt) in words: 'frames (4, 16), prompt',
    as warmup reports and tables show them. The space lets a narrow table break a line between a name and its shape
    rather than inside the name."""
    return ", ".join(name if dims is None else f"{name} {tuple(dims)}" for name, dims in shape.items())


def shape_matches(shape: tuple[int, ...], accepted: tuple[int | None, ...]) -> bool:
    return len(shape) == len(accepted) and all(
        (want is None and got > 0) or got == want for got, want in zip(shape, accepted)
    )


def _check_field(f: ObservationField, key: str, value: Any) -> tuple[Any, str | None]:
    """(array in the field's dtype, None) or (None, problem)."""
    import numpy as np

    try:
        array = as_numpy(value)
    except Exception as exc:  # noqa: BLE001 - any unconvertible value is a user error worth naming
        return None, f"{key!r} is not an array ({type(value).__name__}: {exc})"
    label = repr(key) if key == f.name else f"{key!r} ({f.name})"
    problem = _layout_problem(f, label, array.dtype.name, array.shape)
    if problem:
        return None, problem
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        # A NaN or Inf would silently poison the session's KV for the rest of the episode.
        bad = ~np.isfinite(array)
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        num_nan, num_inf = int(np.isnan(array).sum()), int(np.isinf(array).sum())
        return None, (f"{label} has {num_nan} NaN and {num_inf} Inf values (first at index {first}), "
                      "expected finite numbers")
    with np.errstate(over="ignore"):  # a float64 past float32's range: said below, not as numpy's RuntimeWarning
        converted = array.astype(f.dtype, copy=False)
    if converted is not array and converted.dtype.kind == "f" and not np.isfinite(converted).all():  # a cast
        first = tuple(int(i) for i in np.argwhere(~np.isfinite(converted))[0])
        past = plural(int((~np.isfinite(converted)).sum()), "value")
        return None, (f"{label} has {past} past {f.dtype}'s range (first at "
                      f"index {first}: {array[first]:.3g}), expected finite numbers of magnitude up to "
                      f"{np.finfo(f.dtype).max:.3g}")
    return converted, None


def _layout_problem(f: ObservationField, label: str, dtype: str, shape: tuple[int, ...]) -> str | None:
    """What is wrong with an array of ``dtype`` and ``shape`` for field ``f`` (None: nothing), its values unread: its
    dtype and its shape in one sentence where both are (a uint16 (H, W) depth frame), not one a run."""
    wrong = []
    if f.dtype in FLOAT_DTYPES:
        if dtype not in FLOAT_DTYPES:
            wrong.append(f"dtype {dtype}, expected a floating dtype ({f.dtype})")
    elif dtype != f.dtype:
        wrong.append(f"dtype {dtype}, expected {f.dtype}")
    if not any(shape_matches(shape, s) for s in f.shapes):
        expected = " or ".join(format_shape(s) for s in f.shapes)
        # (0, 4, 3) read against (*, *, 3) looks like a match: say what the star excludes
        empty = any(len(s) == len(shape) and any(want is None and not got for got, want in zip(shape, s))
                    for s in f.shapes)
        wrong.append(f"shape {format_shape(shape)}, expected {expected}"
                     + (" (an empty array: each * is a size of at least 1)" if empty else ""))
    return f"{label} has {', and '.join(wrong)}" if wrong else None


def _cast(f: ObservationField, problem: str) -> tuple[str, str] | None:
    """(what field ``f`` takes, how to write an array as that) where ``problem`` names a dtype a cast fixes: frames as
    floats or integers, a float field as integers or bool. None where no cast does (a uint16 frame's range is not
    0..255)."""
    if f.dtype == "uint8":
        pixels = "uint8, 0 to 255 (a camera frame's pixels)"
        if " has dtype float" in problem:  # images as most libraries hand them to a recorder
            return pixels, "from floats in [0, 1], write np.clip(np.rint(np.asarray(x) * 255), 0, 255).astype(np.uint8)"
        if " has dtype int" in problem:  # torch's .long(), np.array(image, dtype=int)
            return pixels, "from integers in 0..255, write np.clip(np.asarray(x), 0, 255).astype(np.uint8)"
    elif f.dtype in FLOAT_DTYPES and any(f" has dtype {kind}" in problem for kind in ("int", "uint", "bool")):
        return f.dtype, f"write np.asarray(x).astype(np.{f.dtype})"  # joints as encoder ints, a gripper as bool
    return None


def _prompt_cast(key: str, value: Any) -> tuple[str, str] | None:
    """As ``_cast``, for a prompt given as bytes or an array of one text (``np.savez(..., prompt=b"pick")`` or
    ``prompt=np.array(["pick"])``): an .npz holds the prompt as a 0-d string array, what np.savez makes of a str."""
    kind = "S" if isinstance(value, bytes) else getattr(getattr(value, "dtype", None), "kind", None)
    if kind not in ("S", "U") or getattr(value, "size", 1) != 1:
        return None
    given, text = ("bytes", "np.asarray(x).item().decode()") if kind == "S" else (
        "an array of one string", "str(np.asarray(x).item())")
    return ("text, a str, which np.savez stores as a 0-d string array",
            f"from {given} x, write np.savez(path, **arrays, {key}={text})")


def _channels_first(f: ObservationField, shape: Any) -> bool:
    """Whether an array of ``shape`` holds frames of field ``f`` (3 channels last) with their channels first, (..., 3,
    H, W): its shape with that axis moved last is one ``f`` accepts, and its own is not."""
    if not isinstance(shape, tuple) or len(shape) < 3 or shape[-3] != 3 or shape[-1] == 3:
        return False
    moved = (*shape[:-3], *shape[-2:], 3)
    return any(shape_matches(moved, s) for s in f.shapes)


def takes_layout(schema: ObservationSchema, layout: Mapping[str, tuple[str, tuple[int, ...]]]) -> bool:
    """Whether ``schema`` takes a step file of these arrays (key -> (dtype name, shape)), their values unread: no
    field twice, every required one there, each dtype and shape accepted; a key of none of its fields only beside
    every one of its required fields, as a run ignores it (a timestamp beside a robot's cameras and joints), never
    where none is required (a sensor's 8 floats named 'action' would make any file a causal_world one). A file of no
    array of it is no schema's: a recording is told by the arrays it holds."""
    seen: set[str] = set()
    other = False
    for key, (dtype, shape) in layout.items():
        f = schema.field(key)
        if f is None:
            other = True
        elif f.name in seen or _layout_problem(f, key, dtype, shape) is not None:
            return False
        else:
            seen.add(f.name)
    required = {f.name for f in schema.fields if f.required}
    return bool(seen) and required <= seen and not (other and not required)


def lone_surrogate(text: str) -> str | None:
    """Why ``text`` is no text UTF-8 can encode ("holds '\\udcff' at position 5, a lone surrogate that is no
    character": JSON's or YAML's escape, or bytes decoded with errors="surrogateescape"), or None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"holds {text[exc.start]!r} at position {exc.start}, a lone surrogate that is no character"
    return None


def validate_observation(schema: ObservationSchema, arrays: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """Check ``arrays`` (canonical or alias keys, plus the prompt) against ``schema``.

    Returns canonical key -> numpy array (float fields cast to their declared
    dtype) and ``schema.prompt_key`` -> str. Every problem (unknown or
    duplicate keys, missing fields, wrong dtypes or shapes, a missing prompt,
    two different prompts: one text under two of its keys is one prompt) is
    collected and raised as one ``ObservationError`` that names them all.
    """
    if not isinstance(arrays, Mapping):  # it was an AttributeError: 'NoneType' object has no attribute 'items'
        raise ObservationError(f"{where}: an observation is a mapping (dict) of field name -> array, got "
                               f"{shown(arrays)} ({type(arrays).__name__})",
                               hint=f"pass a dict of its fields: {', '.join(f.name for f in schema.fields)}"
                               + (f", and the prompt {schema.prompt_key!r}" if schema.prompt_key else ""))
    problems: list[str] = []
    casts: dict[tuple[str, str], list[str]] = {}  # (what a field takes, how to write it) -> keys given another dtype
    channels_first: list[str] = []  # frames given (..., 3, H, W), as torchvision holds them: the hint moves the axis
    out: dict[str, Any] = {}
    seen: dict[str, str] = {}  # canonical name -> key it came from
    prompt_keys = (schema.prompt_key, *schema.prompt_aliases) if schema.prompt_key else ()
    valid_keys = {k: f.name for f in schema.fields for k in f.keys} | dict.fromkeys(prompt_keys, schema.prompt_key)
    for key, value in arrays.items():
        if key in prompt_keys:
            if schema.prompt_key in out:  # one text under two keys is one prompt, as in a step file's metadata
                if not isinstance(value, str) or value != out[schema.prompt_key]:
                    problems.append(f"prompt given twice, differently: {seen[schema.prompt_key]!r} is "
                                    f"{shown(out[schema.prompt_key])}, {key!r} is {shown(value)}")
            elif not isinstance(value, str):
                problems.append(f"prompt {key!r} must be a string, got {type(value).__name__}")
                if (cast := _prompt_cast(key, value)) is not None:
                    casts.setdefault(cast, []).append(key)
                seen[schema.prompt_key] = key  # given, if wrongly: not also "missing prompt"
            elif (surrogate := lone_surrogate(value)) is not None:
                # no tokenizer can encode it: the forward failed on it with a UnicodeEncodeError, its session released
                problems.append(f"prompt {key!r} {surrogate} (text decoded from bytes that are not UTF-8?)")
                seen[schema.prompt_key] = key
            else:
                out[schema.prompt_key] = value
                seen[schema.prompt_key] = key
            continue
        f = schema.field(key)
        if f is None:
            problems.append(f"unknown key {key!r}{did_you_mean(key, valid_keys, stands_for=valid_keys)}")
            continue
        if f.name in seen:
            problems.append(f"{f.name!r} given twice ({seen[f.name]!r} and {key!r})")
            continue
        seen[f.name] = key
        array, problem = _check_field(f, key, value)
        if problem:
            problems.append(problem)
            if (cast := _cast(f, problem)) is not None:
                casts.setdefault(cast, []).append(key)
            if _channels_first(f, getattr(value, "shape", None)):
                channels_first.append(key)
        else:
            out[f.name] = array
    for f in schema.fields:
        if f.required and f.name not in seen:
            problems.append(f"missing {f.name!r} (also accepted as: {', '.join(f.aliases) or 'no alias'})")
    if schema.prompt_key and schema.prompt_key not in seen:
        aliases = f" or {', '.join(repr(a) for a in schema.prompt_aliases)}" if schema.prompt_aliases else ""
        problems.append(f"missing prompt {schema.prompt_key!r}{aliases}")
    if problems:
        accepted = ", ".join(f.name for f in schema.fields)
        hint = f"fields: {accepted}" + (f", and the prompt {schema.prompt_key!r}" if schema.prompt_key else "")
        if any("expected finite numbers" in p for p in problems):
            hint += ("; fix or drop the step in the recording (a sensor dropout?): ardiff never feeds "
                     "non-finite values to the model")
        for (takes, write), keys in casts.items():
            hint += f"; {', '.join(map(repr, keys))} {'takes' if len(keys) == 1 else 'take'} {takes}: {write}"
        if channels_first:  # with the dtype's hint above, if any: both fixes at once, not one run each
            hint += (f"; {', '.join(map(repr, channels_first))} {'is' if len(channels_first) == 1 else 'are'} "
                     "channel-first, (..., 3, H, W): channels go last, (..., H, W, 3): write "
                     "np.ascontiguousarray(np.moveaxis(np.asarray(x), -3, -1))")
        raise ObservationError(f"{where}: " + "; ".join(problems), hint=hint)
    return out
