"""What a pipeline's forward must return: a dict of bool, integer or floating arrays, all finite.

One check for the two places that run a forward and use what it returns: a rollout step, which writes it to a
step file (and would send NaN actions to a robot), and the warmup, which exists to find a model that cannot run
before the first step does. No torch import at module level.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ardiff_cli.runtime.errors import plural

EXPECTED = "expected a dict of arrays (name -> tensor or numpy array)"
STORABLE = "expected bool, integer or floating arrays (float16, bfloat16, float32 or float64)"
# The torch dtypes a step file holds: those numpy has, and bfloat16 (written as float32). float8, float4, int4, bits
# and quantized tensors have none: numpy() refused them as the outputs were written, a failure "to check the disk".
TORCH_STORABLE = frozenset({"bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
                            "float16", "bfloat16", "float32", "float64"})
# Added to the hint of a non-finite output in float16, where that is the likeliest cause: one value past float16's
# range (a large input, a large activation) is inf, and inf - inf or 0 * inf is NaN in every output after it.
FLOAT16_OVERFLOW = ("; in float16 a value past 65504 is inf: runtime.dtype (--dtype) bfloat16 keeps float32's range "
                    "at the same size")


def is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def output_problem(output: Any) -> tuple[str, str] | None:
    """Why ``output`` cannot be a step's outputs, as (kind, what forward() returned), or None when it can.

    kind is ``"contract"`` (not a dict, no array in it, an array named by a key that is not text, or arrays a step
    file cannot hold: complex, strings, objects, tensors on the meta device) or ``"non_finite"`` (NaN or infinite
    values: the model diverged); the text reads after "forward() returned ".
    """
    if not isinstance(output, Mapping):  # nothing to write: an "ok" step with an empty file would hide it
        return "contract", f"{type(output).__name__}, {EXPECTED}"
    if not any(is_array(value) for value in output.values()):  # the same
        got = ", ".join(f"{key!r}: {type(value).__name__}" for key, value in output.items()) or "empty"
        return "contract", f"a dict with no array in it ({got}), {EXPECTED}"
    untitled = [f"{key!r} ({type(key).__name__})" for key, value in output.items()
                if is_array(value) and not isinstance(key, str)]
    if untitled:  # written under str(key): None as 'None', and {3: ..} with {'3': ..} one array
        return "contract", (f"arrays named by keys that are not text: {', '.join(untitled)}; {EXPECTED}, each "
                            "name a str")
    unstorable = [f"{key!r} ({value.dtype})" for key, value in output.items()
                  if is_array(value) and not storable(value.dtype)]
    if unstorable:  # safetensors refuses them
        return "contract", f"arrays a step file cannot hold: {', '.join(unstorable)}; {STORABLE}"
    empty = [f"{key!r} (on the meta device)" for key, value in output.items() if getattr(value, "is_meta", False)]
    if empty:  # shapes without storage: checking their values raised "Tensor.item() cannot be called on meta tensors"
        return "contract", (f"arrays with no values: {', '.join(empty)}; expected tensors with data, on any real "
                            "device")
    non_finite = _non_finite(output)
    if non_finite:
        return "non_finite", f"non-finite values: {non_finite}"
    return None


def storable(dtype: Any) -> bool:
    """Whether a step file (safetensors) holds arrays of ``dtype``, a torch or numpy one: bool, integer, floating."""
    if hasattr(dtype, "is_complex"):  # a torch dtype
        return str(dtype).removeprefix("torch.") in TORCH_STORABLE
    return dtype.kind in "biu" or dtype.name in ("float16", "float32", "float64")  # safetensors refuses float128


def _non_finite(output: Mapping[str, Any]) -> str:
    """What of the outputs is NaN or infinite ('actions': 3 NaN, 1 inf of 24 values; ...), or ''."""
    import numpy as np
    import torch

    found = []
    for name, value in output.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            if not bool(torch.isfinite(value).all()):  # one reduction (and one sync) when all is well
                found.append((name, int(torch.isnan(value).sum()), int(torch.isinf(value).sum()), value.numel()))
        elif isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating):
            if not np.isfinite(value).all():
                found.append((name, int(np.isnan(value).sum()), int(np.isinf(value).sum()), value.size))
    return "; ".join(f"{name!r}: " + ", ".join(f"{count} {kind}" for count, kind in ((nan, "NaN"), (inf, "inf"))
                                                if count) + f" of {plural(size, 'value')}"
                     for name, nan, inf, size in found)


def host_arrays(output: Mapping[str, Any]) -> dict[str, Any]:
    """The arrays of a forward's ``output`` as numpy copies of their own on the host, as a step file holds them
    (``as_numpy``: bfloat16 as float32, which holds it exactly; in native byte order): a forward may return views of
    buffers that its next request writes over."""
    import numpy as np

    from ardiff_cli.runtime.observation import as_numpy

    arrays = {name: as_numpy(value) for name, value in output.items() if is_array(value)}
    return {name: np.array(array, dtype=array.dtype.newbyteorder("="), copy=True) for name, array in arrays.items()}


def output_layout(output: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of the arrays of ``output`` (a forward's) as a step file holds them: bfloat16 as
    float32. What a script reading an episode's step files finds; no copy, no device sync."""
    layout = {}
    for name, value in output.items():
        if is_array(value):
            dtype = getattr(value.dtype, "name", None) or str(value.dtype).removeprefix("torch.")  # '>f4': float32
            layout[str(name)] = ("float32" if dtype == "bfloat16" else dtype, tuple(int(n) for n in value.shape))
    return layout


def unwritten_arrays(output: Mapping[str, Any]) -> dict[str, str]:
    """{name: what it is} of the values of ``output`` that are no array but hold arrays (a list of per-step tensors,
    a dict of tensors): a step file holds arrays only, so they are skipped, as other values are. Scalars (numpy's,
    0-d tensors: a dict of metrics) are not arrays here. Up to 64 items of each value, two levels deep, are looked
    at."""
    def holds_array(value: Any, depth: int) -> bool:
        if is_array(value):
            return len(value.shape) > 0
        if depth and isinstance(value, Mapping):
            value = value.values()
        elif not (depth and isinstance(value, (list, tuple))):
            return False
        return any(holds_array(item, depth - 1) for _, item in zip(range(64), value))

    return {str(name): type(value).__name__ for name, value in output.items()
            if not is_array(value) and holds_array(value, 2)}


def layout_changes(before: Mapping[str, tuple[str, tuple[int, ...]]],
                   now: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[tuple[str, str, str]]:
    """(name, what it is now, what it was) of each output of ``now`` (``output_layout``) whose dtype or shape is not
    that of ``before``, or that one of them lacks: ``('actions', 'float32 (8, 7)', 'float32 (8, 8)')``, ``missing``
    or ``none``."""
    def shown_layout(layout: tuple[str, tuple[int, ...]] | None, absent: str) -> str:
        return absent if layout is None else f"{layout[0]} {layout[1]}"

    return [(name, shown_layout(now.get(name), "missing"), shown_layout(before.get(name), "none"))
            for name in sorted(before.keys() | now.keys()) if before.get(name) != now.get(name)]


def output_differences(expected: Mapping[str, Any], output: Any) -> list[tuple[float, str]]:
    """How the arrays of ``output`` (a forward's) differ from ``expected`` (``host_arrays`` of the same request's
    first outputs) bit for bit, the largest difference first: (its size, inf for an array missing or of another
    dtype or shape; ``'name' differs by up to D (N of M values)``). Empty when every array is the same."""
    import numpy as np

    got = host_arrays(output) if isinstance(output, Mapping) else {}
    found = []
    for name in sorted(expected.keys() | got.keys(), key=str):
        a, b = expected.get(name), got.get(name)
        if a is None or b is None:
            found.append((float("inf"), f"{name!r} {'is missing' if b is None else 'is new'}"))
        elif a.dtype != b.dtype or a.shape != b.shape:
            found.append((float("inf"), f"{name!r} is {b.dtype} {b.shape}, was {a.dtype} {a.shape}"))
        elif a.tobytes() != b.tobytes():  # bits, not values: -0.0 and 0.0 differ too
            delta = np.abs(a.astype(np.float64) - b.astype(np.float64))
            largest = float(np.nan_to_num(delta, nan=np.inf).max())  # NaN where a number was: inf, for the order
            shown_largest = "NaN" if np.isnan(delta).any() else f"{largest:.3g}"
            count = int(np.count_nonzero(~((a == b) & (np.signbit(a) == np.signbit(b)))))
            found.append((largest, f"{name!r} differs by up to {shown_largest} ({count} of "
                                   f"{plural(a.size, 'value')})"))
    return sorted(found, key=lambda item: -item[0])
