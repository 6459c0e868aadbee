"""What a pipeline's failing forward did wrong, said in its own terms.

The runner passes every exception of a forward through here: a ``KeyError`` for an input the request does not hold
becomes a ``MissingInputError`` that names both names, and an error the KV state raised at the forward's call is
prefixed with the pipeline that made it. Read without running the pipeline's code again (its frames' source and
locals only).
"""

from __future__ import annotations

import ast
import difflib
import inspect
import itertools
import linecache
import os
import traceback
import types
from typing import Any

from ardiff_cli.runtime.capability import ARDiffusionKVCacheSpec
from ardiff_cli.runtime.errors import ArdiffError, PipelineError, is_out_of_memory, shown
from ardiff_cli.runtime.kv.state import ARDiffusionKVState
from ardiff_cli.runtime.request import ARDiffusionRequest


class MissingInputError(PipelineError, KeyError):
    """The forward raised ``KeyError(key)`` for a key its request's ``inputs`` do not hold: it read an input under
    another name than the request gives it (``inputs['obs']`` where the observation schema says ``image``). A
    ``KeyError`` too, as the forward raised it."""

    __str__ = Exception.__str__  # the message as written, not KeyError's repr of it


def _subscripts_inputs(tb: Any, request: ARDiffusionRequest) -> bool:
    """Whether the expression the innermost frame ``tb`` failed in subscripts the request's inputs: its text (from the
    instruction's source position), parsed, is ``X[...]`` where ``X`` is ``request.inputs`` (``R.inputs`` for an
    ``R`` holding the request, ``self.request.inputs`` too) or a name holding its inputs, each read from the frame's
    locals and their attributes without running code. A forward's own lookup beside it (``self.table[name]``,
    ``request.extra_args[k]``, ``os.environ[k]``), whose frame holds the request too, does not; nor one whose source
    cannot be read. Parsed, not split at its last ``[``: a key holding a bracket (``inputs["cam[0]"]``) is a key."""
    code, local = tb.tb_frame.f_code, tb.tb_frame.f_locals
    start, end, first, last = next(itertools.islice(code.co_positions(), tb.tb_lasti // 2, None), (None,) * 4)
    if None in (start, end, first, last):
        return False
    lines = [linecache.getline(code.co_filename, n).encode() for n in range(start, end + 1)]
    lines[-1] = lines[-1][:last]  # byte offsets, as co_positions gives them: the end first, on one line too
    lines[0] = lines[0][first:]
    text = b"".join(lines).decode(errors="replace")
    try:  # in parentheses: an expression over several lines is one
        node = ast.parse(f"({text}\n)", mode="eval").body
    except (SyntaxError, ValueError):  # not an expression of its own: the source changed since, or a statement's part
        return False
    if not isinstance(node, ast.Subscript):
        return False
    container = node.value
    if _local_value(container, local) is request.inputs:
        return True
    return (isinstance(container, ast.Attribute) and container.attr == "inputs"
            and _local_value(container.value, local) is request)


_UNKNOWN = object()  # _local_value's "cannot tell"


def _local_value(node: ast.expr, local: dict[str, Any]) -> Any:
    """The value of ``node``, a local's name or attributes of one (``self.request``), read without running code: an
    attribute found by ``inspect.getattr_static`` (an instance's own, or a slot's), never a property or
    ``__getattr__`` (a pipeline's code, run again while its error is reported); ``_UNKNOWN`` for anything else."""
    if isinstance(node, ast.Name):
        return local.get(node.id, _UNKNOWN)
    if not isinstance(node, ast.Attribute):
        return _UNKNOWN
    owner = _local_value(node.value, local)
    if owner is _UNKNOWN:
        return _UNKNOWN
    try:
        value = inspect.getattr_static(owner, node.attr)
        if isinstance(value, types.MemberDescriptorType):  # a __slots__ attribute (ARDiffusionRequest's): its value
            value = value.__get__(owner, type(owner))
    except (AttributeError, TypeError):  # none, or a slot unset, or the class's own descriptor
        return _UNKNOWN
    return value


def missing_input(pipeline: Any, request: ARDiffusionRequest, exc: KeyError, *,
                  warmup: bool) -> MissingInputError | None:
    """``exc``, raised by ``pipeline``'s forward, as a ``MissingInputError`` when the lookup that raised it subscripts
    the request's inputs (``request.inputs[key]``) and its key is a name they lack; None for any other ``KeyError``
    (a model's own lookup, in the forward or a function of its own; ardiff's unknown KV branch): it stays as it was.
    ``warmup``: whether the request is a warmup request, from its session id as it came in (``check()``), not read
    again: the forward may have rewritten it."""
    inputs = request.inputs
    if len(exc.args) != 1 or not isinstance(exc.args[0], str) or not isinstance(inputs, dict):
        return None
    key = exc.args[0]
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:  # the innermost frame: where the lookup failed
        tb = tb.tb_next
    if key in inputs or tb is None or not _subscripts_inputs(tb, request):
        return None
    name = type(pipeline).__name__
    held = ", ".join(shown(k) for k in inputs) if inputs else "none"
    near = difflib.get_close_matches(key, [k for k in inputs if isinstance(k, str)], n=1)
    what = "warmup request" if warmup else "request"
    return MissingInputError(
        f"{name}.forward() raised KeyError: {key!r}: the forward read input {key!r}, which the inputs of {what} "
        f"{shown(request.request_id)} do not hold (their keys: {held})",
        hint=f"the pipeline's observation_schema and {name}.forward() disagree on the input's name: a step's inputs, "
             "and a warmup request's, hold the schema's fields under its names (aliases resolved); read that "
             f"name in the forward, or rename the schema's field{f' (did you mean {near[0]!r}?)' if near else ''}")


_KV_PACKAGE = os.path.dirname(os.path.abspath(inspect.getfile(ARDiffusionKVState))) + os.sep  # .../runtime/kv/
_CAPABILITY = os.path.abspath(inspect.getfile(ARDiffusionKVCacheSpec))  # .../runtime/capability.py


def name_kv_misuse(pipeline: Any, exc: Exception) -> None:
    """``exc``, raised by the KV state (or its layer contexts) that ``pipeline``'s forward called, named after that
    pipeline in its message, the same exception otherwise: ``get_kv_caches() on the AR-Diffusion KV state of session
    'a' outside its request`` told a failed step what was misused, not which pipeline did it, where its other
    errors say (``DreamZeroPipeline.forward() returned ...``). Memory running out, ardiff's own typed errors and
    what is raised anywhere else are left as they are."""
    if (isinstance(exc, (ArdiffError, MemoryError)) or is_out_of_memory(exc)
            or not isinstance(exc, (RuntimeError, ValueError, KeyError, TypeError))
            or not exc.args or not isinstance(exc.args[0], str)):
        return
    files = [os.path.abspath(frame.f_code.co_filename) for frame, _ in traceback.walk_tb(exc.__traceback__)]
    # where it was raised: in the KV package, or in the spec's lookup of a name the state was given (an unknown
    # cross-attention cache: `unknown cross-attention cache 'txt'`, raised in capability.py)
    if not files or not (files[-1].startswith(_KV_PACKAGE)
                         or (files[-1] == _CAPABILITY and len(files) > 1 and files[-2].startswith(_KV_PACKAGE))):
        return
    name = type(pipeline).__name__
    if not exc.args[0].startswith(f"{name}.forward(): "):  # the same error raised again through another request
        exc.args = (f"{name}.forward(): {exc.args[0]}", *exc.args[1:])
