"""What a pipeline's forward must return: a dict of bool, integer or floating arrays, all finite.

One check for the two places that run a forward and use what it returns: a rollout step, which writes it to a
step file (and would send NaN actions to a robot), and the warmup, which exists to find a model that cannot run
before the first step does. No torch import at module level.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EXPECTED = "expected a dict of arrays (name -> tensor or numpy array)"


def is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def output_problem(output: Any) -> tuple[str, str] | None:
    """Why ``output`` cannot be a step's outputs, as (kind, what forward() returned), or None when it can.

    kind is ``"contract"`` (not a dict, no array in it, or arrays a step file cannot hold: complex, strings,
    objects) or ``"non_finite"`` (NaN or infinite values: the model diverged); the text reads after "forward()
    returned ".
    """
    if not isinstance(output, Mapping):  # nothing to write: an "ok" step with an empty file would hide it
        return "contract", f"{type(output).__name__}, {EXPECTED}"
    if not any(is_array(value) for value in output.values()):  # the same
        got = ", ".join(f"{key!r}: {type(value).__name__}" for key, value in output.items()) or "empty"
        return "contract", f"a dict with no array in it ({got}), {EXPECTED}"
    unstorable = [f"{key!r} ({value.dtype})" for key, value in output.items()
                  if is_array(value) and not storable(value.dtype)]
    if unstorable:  # safetensors refuses them
        return "contract", (f"arrays a step file cannot hold: {', '.join(unstorable)}; expected bool, integer or "
                            "floating arrays")
    non_finite = _non_finite(output)
    if non_finite:
        return "non_finite", f"non-finite values: {non_finite}"
    return None


def storable(dtype: Any) -> bool:
    """Whether a step file (safetensors) holds arrays of ``dtype``, a torch or numpy one: bool, integer, floating."""
    return not dtype.is_complex if hasattr(dtype, "is_complex") else dtype.kind in "biuf"


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
                                                if count) + f" of {size} values"
                     for name, nan, inf, size in found)
