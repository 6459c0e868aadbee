"""Pipeline weights: one safetensors file in, one out; every mismatch reported at once.

A pipeline checkpoint is a single ``.safetensors`` file holding all of a
pipeline's modules under their attribute prefixes (``transformer.``, ``vae.``,
``text_encoder.``, ``image_encoder.``); the transformer's own keys follow Wan
2.1. Its metadata records the pipeline, the config's weight fields and a format version.
Nothing is ever unpickled.

Default checkpoints: a config without ``checkpoint:`` uses a freshly
initialised checkpoint built deterministically (the config's ``seed``) on
first use into ``$ARDIFF_CACHE_DIR`` (default ``~/.cache/ardiff``), written to
a temporary file and renamed into place so concurrent first uses are safe.

Command line::

    python -m pipelines.checkpoint init configs/causal-world-tiny.yaml out.safetensors
    python -m pipelines.checkpoint path configs/dreamzero-tiny.yaml     # where the default lives
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ardiff_cli.io.atomic import FILE_MODE, parse_json, remove_temporaries
from ardiff_cli.io.demo import CACHE_ENV, cache_dir, cache_write_error
from ardiff_cli.io.writer import sort_metadata_in_file
from ardiff_cli.runtime.errors import (CheckpointError, ConfigError, NonFiniteWeightsError, as_typed,
                                      link_to_nothing_on, os_error, plural, too_many_open_files, weights_in_folder)
from pipelines.wan import remap_checkpoint_key

# bump when parameter names or meanings change, or what a file records: cached defaults are then rebuilt (2: the
# metadata records the weight fields only)
FORMAT_VERSION = "2"
MAX_DEFAULT_PARAMETERS = 500_000_000  # larger configs are for capacity planning: bring a checkpoint
MISMATCHES_SHOWN = 3  # keys named per kind of mismatch in a load's error; its ``details`` hold them all


def weight_fields(config) -> dict[str, Any]:
    """Everything that decides a fresh checkpoint's tensors (not sampler or KV settings)."""
    return {name: getattr(config, name) for name in config.WEIGHT_FIELDS}


def weight_digest(pipeline_name: str, config) -> str:
    """Hash of ``weight_fields``: the default checkpoint's name."""
    text = json.dumps({"format": FORMAT_VERSION, "pipeline": pipeline_name, "fields": weight_fields(config)},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _ShapesOnly(torch.overrides.TorchFunctionMode):
    """Building on the meta device, where tensors hold no values: ``torch.nn.init``'s initialisers return their
    tensor untouched and random factories make empty tensors. torch would run both there through its Python
    reference kernels, whose first calls import ``torch._dynamo`` and ``torch.fx.experimental.symbolic_shapes``
    (0.8 s of imports at every ``rollout`` and ``warmup`` start on a 2-core machine, ``python -X importtime``,
    for nothing)."""

    INITIALISERS = frozenset(getattr(nn.init, name) for name in dir(nn.init)
                             if name.endswith("_") and not name.startswith("_"))
    RANDOM_FACTORIES = frozenset((torch.randn, torch.rand))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.INITIALISERS:
            return args[0] if args else kwargs["tensor"]
        if func in self.RANDOM_FACTORIES:
            return torch.empty(*args, **{k: v for k, v in kwargs.items() if k != "generator"})
        return func(*args, **kwargs)


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the meta device with nothing initialised: shapes only, for a checkpoint to fill."""
    with torch.device("meta"), _ShapesOnly():
        return build()


def build_config_on_meta(pipeline_class: Any, config) -> nn.Module:
    """``pipeline_class.build_modules(config)`` on the meta device. A weight of 2**63 bytes or more, which torch cannot
    size even there, is the config's mistake: a ``ConfigError`` naming the model fields of its largest size (a
    ``cond_dim: 2**62`` was "from_config() failed" in warmup, blamed on the pipeline, and a traceback in rollout)."""
    try:
        return build_on_meta(lambda: pipeline_class.build_modules(config))
    except RuntimeError as exc:
        if not _overflowed(exc):
            raise
        sizes = [int(n) for n in re.findall(r"[0-9]+", str(exc).partition("sizes=")[2])]
        fields = config.to_dict() if callable(getattr(config, "to_dict", None)) else {}
        names = [name for name, value in fields.items() if type(value) is int and sizes and value == max(sizes) > 1]
        # Of fields that hold the same size (a seed too), those too large alone: `seed: 2**62` beside `cond_dim: 2**62`
        # was named with it. None alone: together they are (a weight of two of them). A field whose trial the config
        # refused is neither: `seed` beside `dim: 2**62, num_heads: 64` was said "too large alone".
        alone = ({name: _too_large_alone(pipeline_class, config, name, names) for name in names}
                 if len(names) > 1 else {})
        proven = [name for name in names if alone.get(name)]
        named = [f"'model.{name}'" for name in proven or names]
        which = " and ".join(named)
        if not named:
            said = ""
        elif len(named) == 1:
            said = f"{which} ({max(sizes)}) makes "
        elif proven:
            said = f"{which} ({max(sizes)} each) are each too large alone; one makes "
        elif None in alone.values():  # untried: whether one alone or only together is not known
            said = f"one or more of {which} ({max(sizes)} each) make "
        else:
            said = f"{which} ({max(sizes)}) together make "
        raise ConfigError(
            f"the {pipeline_class.name} model is too large for torch: {said}"
            f"a weight of shape {sizes or '?'}, 2**63 bytes or more (torch sizes a tensor in int64)",
            hint=f"lower {' or '.join(named) if named else 'the widths in the model: section'}",
        ) from None


def _overflowed(exc: BaseException) -> bool:
    """Whether ``exc`` is torch refusing a tensor of 2**63 bytes or more."""
    return isinstance(exc, RuntimeError) and "Storage size calculation overflowed" in str(exc)


def _too_large_alone(pipeline_class: Any, config, name: str, names: list[str]) -> bool | None:
    """Whether the model still overflows with ``name`` as it is and the other ``names`` at their defaults (one layer:
    the layer count changes no shape). None when that cannot be told: a config that is no dataclass, or one that
    refuses the trial (``num_heads: 64`` with ``dim`` back at its default of 64)."""
    import dataclasses

    if not dataclasses.is_dataclass(config):
        return None
    defaults = {f.name: f.default for f in dataclasses.fields(config)
                if f.name in names and f.name != name and f.default is not dataclasses.MISSING}
    if isinstance(getattr(config, "num_layers", None), int) and "num_layers" not in names:
        defaults["num_layers"] = 1
    try:
        trial = dataclasses.replace(config, **defaults)
        build_on_meta(lambda: pipeline_class.build_modules(trial))
    except Exception as exc:  # noqa: BLE001 - the overflow (too large alone), or a trial its config refuses
        return True if _overflowed(exc) else None
    return False


def count_config_parameters(pipeline_class: Any, config) -> int:
    """Parameters of ``pipeline_class.build_modules(config)``, nothing allocated. Its blocks are alike, so a model of
    many layers is counted from models of one, two and three layers: building every block, even on the meta
    device, took 12 s for 5,000 layers and never ended for ``num_layers: 10**12``, while ``warmup`` only needed
    the count to refuse the geometry."""
    def count(cfg) -> int:
        return sum(p.numel() for p in build_config_on_meta(pipeline_class, cfg).parameters())

    layers = getattr(config, "num_layers", None)
    if not isinstance(layers, int) or layers <= 3 or not callable(getattr(config, "replace", None)):
        return count(config)
    one, two, three = (count(config.replace(num_layers=n)) for n in (1, 2, 3))
    if two - one != three - two:  # not the same parameters per layer: count the whole model
        return count(config)
    return one + (layers - 1) * (two - one)


def fresh_modules(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """``build()`` initialised from ``seed`` alone, whatever the global RNG state or default dtype (CPU, float32)."""
    # A caller's torch.set_default_dtype(torch.float64) made float64 parameters drawn from other random numbers, and
    # the default checkpoint cached from them gave every later run other weights than the same config's.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = build()
            for sub in module.modules():
                if sub is not module and hasattr(sub, "init_weights"):
                    sub.init_weights()
    finally:
        torch.set_default_dtype(previous)
    return module


def save_checkpoint(module: nn.Module, path: str | Path, metadata: dict[str, str]) -> Path:
    """Write ``module``'s state dict to ``path`` atomically (temporary file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except SafetensorError as exc:  # its I/O errors (a full disk) are no OSError: callers name the folder
            error = os_error(exc, path)
            raise (error if error is not exc else OSError(str(exc).removeprefix("Error while serializing: "))) \
                from exc
        sort_metadata_in_file(tmp)  # safetensors writes metadata in hash order: the same weights, the same bytes
        os.chmod(tmp, FILE_MODE)  # mkstemp made it 0600: give it the mode of every other file ardiff writes
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _check_readable(path: str | Path) -> None:
    """Open ``path`` as Python does: safetensors reports a file it may not read as not found (EACCES as ENOENT)."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {as_typed(path)}: {exc.strerror or exc}",
                              hint="check the file's permissions" if isinstance(exc, PermissionError) else None
                              ) from None


def read_metadata(path: str | Path) -> dict[str, str]:
    _check_readable(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read checkpoint {as_typed(path)}: {exc}") from None


def _read_tensors(path: Path, device: torch.device | str, dtype: torch.dtype | None,
                  expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file's tensors, read into memory of their own. ``load_file``'s map the file: a model on the CPU, of the
    file's dtype, kept reading it for the whole run, so a checkpoint copied or saved over in place (``cp``, a
    training job) changed its weights mid-run, or, truncated first, killed the run with SIGBUS and no summary; for
    an accelerator, one truncated before the weights reached it (they were moved once the whole file was mapped)
    did too. For an accelerator each tensor is read, then moved there (floating ones as ``dtype``) before the next
    is read: the host holds one tensor at a time, the device no weight of the file's dtype beside the run's. Only a
    tensor ``expected`` (the model's, by remapped key) takes in its shape and kind goes there; any other is left on
    the meta device, its shape and dtype enough for load_checkpoint to name it: a file of another model (or with an
    optimizer's state) is refused as one (exit 2), not run out of the device's memory first."""
    if torch.device(device).type != "cpu":
        def moved(key: str, tensor: torch.Tensor) -> torch.Tensor:
            model = expected.get(remap_checkpoint_key(key))
            if model is None or model.shape != tensor.shape or \
                    model.is_floating_point() != tensor.is_floating_point():
                return tensor.to("meta")
            return tensor.to(device, dtype=dtype if dtype is not None and tensor.is_floating_point() else None)

        # only the open is retried: a TypeError of a tensor's move (a dtype that is none) read the whole file again
        try:
            opened = safe_open(str(path), framework="pt", backend="pread")
        except TypeError:  # an older safetensors, without backend: each tensor copied out of the mapping at once
            opened = safe_open(str(path), framework="pt")
        with opened as f:
            return {key: moved(key, f.get_tensor(key)) for key in f.keys()}
    try:
        return load_file(str(path), device="cpu", backend="pread")
    except TypeError:  # an older safetensors, whose load_file has no backend: copy each tensor out of the mapping
        return {key: value.clone() for key, value in load_file(str(path), device="cpu").items()}


_CONVERT_HINT = ("ardiff reads weights from .safetensors files only, and pickled checkpoints are never loaded: "
                 "convert it where you trust it, with safetensors.torch.save_file(torch.load(FILE), OUT.safetensors)")
_RECOPY_HINT = "copy or download it again (a copy cut short, or a disk that filled up?)"
_PATH_HINT = "give the path of the .safetensors file of the model's weights"


def _text_start(head: bytes) -> str | None:
    """The first characters of ``head``, a file's first bytes, if they read as UTF-8 text (a config, a README, an
    HTML page: ASCII alone named one with an accent, a BOM or a dash "not a safetensors file" with the hint to
    convert a pickle); None otherwise. A character cut by the end of ``head`` is left out."""
    import codecs

    try:
        text = codecs.getincrementaldecoder("utf-8-sig")().decode(head[:64])
    except UnicodeDecodeError:
        return None
    return text if text and all(c.isprintable() or c in "\t\r\n" for c in text) else None


def _unreadable(path: Path, exc: Exception) -> CheckpointError:
    """Why safetensors refused the checkpoint ``path``, in words: what the file is instead (a torch.save file, a
    pickle, a Git LFS pointer, text), empty, cut short (the size its header declares against the file's), or a header
    safetensors refuses. safetensors' own words ("header too large" for a torch.save file, "incomplete metadata, file
    not fully covered" for a copy cut short) named neither what the file was nor what to do."""
    from ardiff_cli.io.step_file import (MAX_HEADER_BYTES, _SIGNATURES, _TORCH_SAVE, _declared_safetensors_size,
                                         _is_torch_save)

    def error(what: str, hint: str) -> CheckpointError:
        return CheckpointError(f"cannot read checkpoint {as_typed(path)}: {what}", hint=hint)

    plain = error(str(exc), "is it a .safetensors file? pickled checkpoints are never loaded")
    if too_many_open_files(exc):  # the system's say, not the file's bytes (the CLI hints at ulimit -n)
        return plain
    if isinstance(exc, OSError):  # the disk's say (EIO), not the file's bytes (safetensors' SafetensorError)
        return error(str(exc), "the system could not read the file, whatever its bytes are: check the disk or mount "
                               "it is on (dmesg), or copy the file to another disk")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(4096)
            f.seek(0)
            try:
                declared = _declared_safetensors_size(f, size)[0]
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                declared = None  # not a header that parses
    except OSError:
        return plain
    if size == 0:
        return error("the file is empty (0 bytes), not safetensors", _RECOPY_HINT)
    if _is_torch_save(head):
        return error(f"it is {_TORCH_SAVE}, not safetensors", _CONVERT_HINT)
    if head.startswith(b"version https://git-lfs"):
        return error(f"it is a Git LFS pointer ({plural(size, 'byte')}), not the weights",
                     "fetch the file itself: git lfs pull, in the repository it came from")
    for signature, what, _ in _SIGNATURES:  # a header length whose bytes begin so is told apart as episode.py does
        if head.startswith(signature) and head[8:9] != b"{" and head[2:3] != b"\0":
            # a pickle is what torch.save wrote before its zip format (and pickle.dump); a zip that is a torch.save
            # file is told above: another zip (an .npz, a folder zipped) is no torch.load to convert
            return error(f"it is {what.removesuffix(' (an .npz?)')}, not safetensors",
                         _CONVERT_HINT if signature == b"\x80" else _PATH_HINT)
    length = int.from_bytes(head[:8], "little")
    text = _text_start(head)
    if size < 8:
        # 4 bytes of text or more ("none\n") are no header length cut short: bytes of text (\t and up) would give one
        # past the 100 MB safetensors reads. 1 to 3 may be either: not said to be cut short, nor text.
        if text is not None and size >= 4:
            return error(f"it is a text file (it begins {text[:40]!r}), not safetensors", _PATH_HINT)
        if size < 4:
            return error(f"it has {plural(size, 'byte')}, too few to be a safetensors file (one begins with the 8 "
                         "bytes of its header's length)", f"{_PATH_HINT}; or, if it is a copy cut short, copy it again")
        return error(f"truncated: {plural(size, 'byte')}, fewer than the 8 of a safetensors header's length",
                     _RECOPY_HINT)
    if declared is not None and declared > size:
        return error(f"truncated: its header declares {declared} bytes, the file has {size}", _RECOPY_HINT)
    if declared is None and head[8:9] == b"{" and length > MAX_HEADER_BYTES:
        return error(f"its header's length is damaged: it says {length} bytes, more than the {MAX_HEADER_BYTES} "
                     f"safetensors reads (the file has {size})", _RECOPY_HINT)
    if declared is None and head[8:9] == b"{" and 8 + length > size:
        return error(f"truncated or damaged inside its header: the header alone should take {8 + length} bytes, the "
                     f"file has {size}", _RECOPY_HINT)
    if declared is None and text is not None:
        return error(f"it is a text file (it begins {text[:40]!r}), not safetensors", _PATH_HINT)
    if declared is not None and declared < size:
        return error(f"it has {size} bytes, {size - declared} more than its header declares ({declared}); safetensors "
                     "refuses data after the last tensor", _RECOPY_HINT)
    # A length that fits the file, then JSON's "{": safetensors with its header's JSON damaged (a byte flipped on the
    # disk, a hand edit), below. It was "not a safetensors file", with the hint to convert a pickle.
    if declared is None and head[8:9] != b"{":
        return error(f"it is not a safetensors file: its first 8 bytes give a header length of {length} bytes, "
                     f"and the file has {size} ({exc})", _CONVERT_HINT)
    return error(f"its header is damaged: {exc}",
                 "write it again with safetensors.torch.save_file, or copy it again from where it came from")


def load_checkpoint(module: nn.Module, path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None) -> dict[str, str]:
    """Load ``path`` into ``module`` strictly; returns the file's metadata.

    Keys pass through ``remap_checkpoint_key`` first (wrapper prefixes).
    Missing keys, unexpected keys, shape mismatches and non-floating tensors
    in place of floating weights are collected and raised together as one
    ``CheckpointError`` (its message counts each kind and names the first
    few, its ``details`` name every one). The file's tensors are adopted, so
    ``module`` may be built on the meta device; ``device`` is where the caller
    then moves them: an accelerator's get them there already, floating ones as
    ``dtype`` (see ``_read_tensors``).
    """
    path = Path(path)
    if not path.is_file():
        # a folder (a model's, that holds its .safetensors file) was "not found", where the config's checkpoint: of
        # the same folder is told to be one (load_config)
        if path.is_dir():
            found = weights_in_folder(path, path)
            raise CheckpointError(f"checkpoint {as_typed(path)} is a folder, not a file",
                                  hint=f"{found}, or use checkpoint: null" if found else
                                  f"{_PATH_HINT}, or use checkpoint: null")
        if path.exists():
            raise CheckpointError(f"checkpoint {as_typed(path)} is not a regular file (a FIFO, socket or device)",
                                  hint=f"{_PATH_HINT}, or use checkpoint: null")
        dangling = link_to_nothing_on(path)  # `ls` lists it, or a folder above it: "not found" reads as a false error
        if dangling:
            link, why = dangling
            raise CheckpointError(f"checkpoint {as_typed(path)} is {why}" if link == path else
                                  f"checkpoint {as_typed(path)} cannot be reached: {as_typed(link)} is {why}",
                                  hint="mount or restore what it links to, or give the .safetensors file's own path")
        raise CheckpointError(f"checkpoint not found: {as_typed(path)}", hint="fix the path, or use checkpoint: null")
    _check_readable(path)
    expected = module.state_dict()
    try:
        raw = _read_tensors(path, device, dtype, expected)
    except (OSError, SafetensorError) as exc:
        raise _unreadable(path, exc) from None
    tensors: dict[str, torch.Tensor] = {}
    duplicates = []
    for key, value in raw.items():
        name = remap_checkpoint_key(key)
        if name in tensors:
            duplicates.append(key)
        tensors[name] = value
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    mismatched = [
        f"{k}: checkpoint {tuple(tensors[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in expected
        if k in tensors and tensors[k].shape != expected[k].shape
    ]
    # A floating weight in another float dtype is fine (from_config casts to the model dtype after loading); an
    # integer or bool tensor in its place is no weight.
    wrong_dtype = [
        f"{k}: checkpoint {tensors[k].dtype} vs model {expected[k].dtype}"
        for k in expected
        if k in tensors and tensors[k].is_floating_point() != expected[k].is_floating_point()
    ]
    problems, details, cut = [], [], False
    for label, one, items in (("missing keys", "missing key", missing),
                              ("unexpected keys", "unexpected key", unexpected),
                              ("shape mismatches", "shape mismatch", mismatched),
                              ("dtype mismatches", "dtype mismatch", wrong_dtype),
                              ("keys duplicated after prefix removal", "key duplicated after prefix removal",
                               duplicates)):
        if items:
            # the first few of each: a tiny file given to a 14B config listed 1,000 keys in one 48 KB line
            cut |= len(items) > MISMATCHES_SHOWN
            more = f" and {len(items) - MISMATCHES_SHOWN} more" if len(items) > MISMATCHES_SHOWN else ""
            problems.append(f"{plural(len(items), one, label)}: {', '.join(items[:MISMATCHES_SHOWN])}{more}")
            details += [f"{one}: {item}" for item in items]
    if problems:
        meta = read_metadata(path)
        written_for = f" (written for pipeline {meta['pipeline']!r})" if "pipeline" in meta else ""
        raise CheckpointError(
            f"checkpoint {as_typed(path)}{written_for} does not match the model config: " + "; ".join(problems)
            + (" (--verbose lists them all)" if cut else ""),
            hint="use the config the checkpoint was written for, or write a fresh one with "
            "`python -m pipelines.checkpoint init CONFIG.yaml OUT.safetensors`",
            details=details,
        )
    module.load_state_dict(tensors, strict=True, assign=True)
    return read_metadata(path)


_SUMMED = 4096  # values summed together by _all_finite: few enough that a float16 weight's sum stays in its range


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite, read at the speed of a sum. A sum is finite unless a value is not,
    or the values overflow it (then each is looked at): ``isfinite`` alone reads 0.2 GiB/s on one CPU thread (a 5 GB
    model took 30 s more to load), a sum 6 to 20 GiB/s. Sums of 4096 values each, not one of the whole tensor: a
    float16 weight's sum passes 65504 from 2**20 values of 0.07 (a mean a trained weight may have), and such a
    weight was looked at value by value, 60 times slower, with a bool copy of it allocated."""
    if tensor.is_contiguous() and tensor.numel() > _SUMMED:
        flat = tensor.view(-1)
        whole = flat.numel() - flat.numel() % _SUMMED
        sums = torch.cat([flat[:whole].view(-1, _SUMMED).sum(1), flat[whole:].sum().reshape(1)])
    else:
        sums = tensor.sum()
    return bool(torch.isfinite(sums).all()) or bool(torch.isfinite(tensor).all())


def refuse_non_finite(module: nn.Module, path: str | Path, dtype: torch.dtype) -> None:
    """Refuse weights that hold NaN or inf once cast to the model's ``dtype``: every output of such a model is NaN,
    so a rollout failed at its warmup (exit 1, blamed on the sampling settings) with ``run.json`` written, and the
    fixed checkpoint was then refused by the same command (a run is there) and by ``--resume`` (the file changed).
    A float32 value past 65504 becomes inf in float16: that is named too. A buffer the file holds may hold inf on
    purpose (an attention mask of -inf), never NaN (a normalisation's running statistics of a run that diverged)."""
    params, saved = dict(module.named_parameters()), module.state_dict().keys()
    buffers = {name: tensor for name, tensor in module.named_buffers() if name in saved}
    state = {**params, **buffers}
    bad = [name for name, tensor in params.items() if tensor.is_floating_point() and not _all_finite(tensor)]
    bad += [name for name, tensor in buffers.items() if tensor.is_floating_point() and bool(tensor.isnan().any())]
    if not bad:
        return
    details = []
    for name in bad:
        tensor = state[name]
        nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
        what = " and ".join(f"{count} {kind}" for count, kind in ((nan, "NaN"), (inf, "inf")) if count)
        details.append(f"{name}: {what} of {tensor.numel()} values")
    more = f" and {len(bad) - MISMATCHES_SHOWN} more" if len(bad) > MISMATCHES_SHOWN else ""
    in_dtype = str(dtype).removeprefix("torch.")
    hint = "use a checkpoint of finite weights (a training run that diverged saves NaN)"
    if dtype == torch.float16:
        hint = ("in float16 a weight past 65504 is inf: runtime.dtype (--dtype) bfloat16 keeps float32's range at the "
                "same size; or " + hint)
    raise NonFiniteWeightsError(
        f"checkpoint {as_typed(path)} holds weights that are not finite in {in_dtype}: {plural(len(bad), 'tensor')}: "
        + ", ".join(details[:MISMATCHES_SHOWN]) + more + (" (--verbose lists them all)" if more else ""),
        hint=hint, details=[f"not finite: {line}" for line in details],
    )


def check_weight_fields(pipeline_name: str, config, metadata: dict[str, str], path: str | Path) -> None:
    """Refuse a checkpoint whose recorded config differs from ``config`` in a field that shapes the weights.

    Shapes catch most geometry changes, not all: ``num_heads`` splits the same
    ``dim x dim`` projections differently, so a file written for 4 heads loads
    into a 2-head model and computes garbage. Files this module wrote record
    their config; ``seed`` is exempt (it is also the default noise seed), and
    files without the record (converted Wan checkpoints) are trusted.
    """
    if metadata.get("pipeline") != pipeline_name or "config" not in metadata:
        return
    try:
        recorded = parse_json(metadata["config"])
    except ValueError:
        return
    if not isinstance(recorded, dict):  # not a record this module wrote
        return
    ours = json.loads(json.dumps(weight_fields(config)))  # as recorded: tuples become lists
    differing = [
        f"{name}: checkpoint {recorded[name]!r} vs config {value!r}"
        for name, value in ours.items()
        if name != "seed" and name in recorded and recorded[name] != value
    ]
    if differing:
        raise CheckpointError(
            f"checkpoint {as_typed(path)} was written for another {pipeline_name} geometry: " + "; ".join(differing),
            hint="use the config the checkpoint was written for, or write a fresh one with "
            "`python -m pipelines.checkpoint init CONFIG.yaml OUT.safetensors`",
        )


def write_fresh_checkpoint(pipeline_class: Any, config, path: str | Path) -> Path:
    """A freshly initialised checkpoint for ``config`` (deterministic: the config's ``seed``)."""
    modules = fresh_modules(lambda: pipeline_class.build_modules(config), config.seed)
    # The fields that decide the tensors, as the default's file name digests them, not the sampler's or the KV's:
    # two configs sharing a default file wrote it with other metadata, so its header, and with it where each tensor
    # lies in memory once loaded, depended on which config built the cache first, and so did the outputs (by up to
    # 8e-7: the matmul kernels round alike only for the same alignment)
    metadata = {
        "format": "pt",
        "ardiff_format": FORMAT_VERSION,
        "pipeline": pipeline_class.name,
        "config": json.dumps(weight_fields(config), sort_keys=True),
    }
    return save_checkpoint(modules, path, metadata)


def default_checkpoint_path(pipeline_class: Any, config) -> Path:
    """Where the built-in checkpoint of ``config`` lives in the cache folder (whether built yet or not)."""
    return cache_dir() / f"{pipeline_class.name}-{weight_digest(pipeline_class.name, config)}.safetensors"


def refuse_too_large_for_default(pipeline_class: Any, config) -> None:
    """Refuse to build the default checkpoint of a config larger than ``MAX_DEFAULT_PARAMETERS``: what
    ``default_checkpoint`` would refuse, and ``rollout`` refuses before it makes demo episodes or ``--out``."""
    num = count_config_parameters(pipeline_class, config)
    if num > MAX_DEFAULT_PARAMETERS:
        raise CheckpointError(
            f"no built-in checkpoint for this {pipeline_class.name} geometry ({parameter_count(num)}): "
            "large configs are for capacity planning",
            hint="set checkpoint: to a .safetensors file of this model's weights; "
            "`ardiff inspect-capacity` plans its memory without them",
        )


def parameter_count(num: int) -> str:
    """'14.29B parameters' for a model's size; past a thousand billion, which only an absurd geometry gives
    (``num_layers: 10**12``), three significant digits: '5.06e+16 parameters', not '50624000.00B parameters'."""
    return f"{num / 1e9:.2f}B parameters" if num < 10**12 else f"{num:.3g} parameters"


def default_checkpoint_hint(path: Path) -> str:
    """The hint for a default checkpoint in the cache that cannot be loaded: delete it, and it is built again; or,
    when it is not this user's to delete (another account's file in a shared cache, a folder this user cannot
    write), a cache folder of one's own."""
    try:
        owner, folder = path.stat().st_uid, path.parent.stat()
    except OSError:
        owner = folder = None
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    sticky = folder is not None and folder.st_mode & stat.S_ISVTX  # a /tmp-like folder: only owners delete
    if uid is None or uid == 0 or (os.access(path.parent, os.W_OK | os.X_OK)
                                   and not (sticky and uid not in (owner, folder.st_uid))):
        return f"it is the default checkpoint ardiff built in its cache: delete {as_typed(path)}, and it is built again"
    return (f"it is the default checkpoint ardiff built in the cache {as_typed(path.parent)}, a file this user cannot "
            f"delete (a shared cache?): set {CACHE_ENV} to a folder of your own, where it is built again")


def default_checkpoint(pipeline_class: Any, config) -> Path:
    """The built-in checkpoint of ``config``: built into the cache folder on first use, then reused."""
    path = default_checkpoint_path(pipeline_class, config)
    remove_temporaries(path.parent, r"[\w.-]+-[0-9a-f]{16}\.safetensors")  # a killed run's, unfinished
    try:
        if path.is_file():
            return path
    except OSError as exc:  # a cache folder this user cannot enter: "from_config() failed", blamed on the pipeline
        raise CheckpointError(f"cannot look at the default checkpoint {as_typed(path)}: {exc.strerror or exc}",
                              hint=f"set {CACHE_ENV} to a folder this user can read and write") from exc
    refuse_too_large_for_default(pipeline_class, config)
    try:
        return write_fresh_checkpoint(pipeline_class, config, path)
    except OSError as exc:
        error = cache_write_error("the default checkpoint", path, exc)
        raise CheckpointError(str(error), hint=error.hint) from None


def _load_yaml_config(config: str):
    """The pipeline class and model config of CONFIG (a YAML path or a built-in name), validated as ardiff does."""
    from ardiff_cli.runtime.config import load_config

    cfg = load_config(config)
    return cfg.entry.pipeline_class(), cfg.model


def _check_room_for_fresh_weights(pipeline_class: Any, config) -> None:
    """Refuse ``init`` before building weights the host cannot hold (a 14B config is 57 GB of float32)."""
    from ardiff_cli.runtime.capacity import available_host_memory

    needed = 4 * count_config_parameters(pipeline_class, config)  # built in float32
    available = available_host_memory()
    if needed > available:
        raise CheckpointError(
            f"fresh {pipeline_class.name} weights for this config take {needed / 2**30:.1f} GiB of host memory "
            f"(float32), more than the {available / 2**30:.1f} GiB available",
            hint="init writes random weights for tests and demos; large configs need the model's trained weights",
        )


def main(argv: list[str] | None = None) -> int:
    from ardiff_cli.runtime.errors import ArdiffError

    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m pipelines.checkpoint init CONFIG OUT.safetensors | path CONFIG  (CONFIG: a YAML path " \
            "or a built-in config name)"
    if argv in (["--help"], ["-h"]):
        print(usage)
        return 0
    try:
        if len(argv) == 3 and argv[0] == "init":
            pipeline_class, config = _load_yaml_config(argv[1])
            if Path(argv[2]).is_file():  # random weights over a trained file (OUT mistyped, or run twice) lose it
                raise CheckpointError(f"{as_typed(argv[2])} exists: init writes random weights and does not replace "
                                      "a file",
                                      hint="choose another OUT, or delete the file first if it is one init wrote")
            _check_room_for_fresh_weights(pipeline_class, config)
            try:
                print(as_typed(write_fresh_checkpoint(pipeline_class, config, argv[2])))
            except OSError as exc:
                raise CheckpointError(f"cannot write {as_typed(argv[2])}: {exc.strerror or exc}") from None
            return 0
        if len(argv) == 2 and argv[0] == "path":
            pipeline_class, config = _load_yaml_config(argv[1])
            print(as_typed(default_checkpoint_path(pipeline_class, config)))
            return 0
    except ArdiffError as exc:
        print(f"Error: {exc}" + (f"\nhint: {exc.hint}" if exc.hint else ""), file=sys.stderr)
        return exc.exit_code
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
