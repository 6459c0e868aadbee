"""Write episodes from arrays: the format ``ardiff rollout`` reads.

Example (a robot loop, or a conversion script)::

    from ardiff_cli.io import write_episode, write_step, end_episode

    # all at once
    write_episode("data/pick_cube", steps, prompt="pick up the red cube")
    # where steps = [{"exterior_image": uint8 (H, W, 3), "joint_position": float32 (7,), ...}, ...]

    # or one step at a time, while ``ardiff rollout --follow data/pick_cube`` watches the folder
    write_step("data/pick_cube", 0, step0, prompt="pick up the red cube")  # also goes to episode.yaml
    write_step("data/pick_cube", 1, step1)                                  # so this step has it too
    end_episode("data/pick_cube")

Every file is written under a temporary name and renamed, so a reader never
sees half a step.
"""

from __future__ import annotations

import io
import json
import os
import sys
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ardiff_cli.io.atomic import atomic_write_bytes, atomic_write_text
from ardiff_cli.io import step_file
from ardiff_cli.io.episode import END_MARKER, METADATA_FILE
from ardiff_cli.io.step_file import MAX_METADATA_BYTES, read_episode_yaml, safetensors_header
from ardiff_cli.runtime.capacity import as_int, format_bytes
from ardiff_cli.runtime.errors import as_typed, shown
from ardiff_cli.runtime.observation import lone_surrogate
from ardiff_cli.runtime.outputs import storable

FORMATS = ("safetensors", "npz")


def to_numpy(value: Any):
    """A contiguous numpy array of the same shape from a numpy array or scalar, a torch tensor (any device;
    bfloat16 becomes float32) or a list."""
    from ardiff_cli.runtime.observation import as_numpy

    array = as_numpy(value)
    # Not np.ascontiguousarray: it turns a 0-d array (a scalar reading) into shape (1,).
    return array if array.flags.c_contiguous else array.copy(order="C")


def encode_arrays(arrays: Mapping[str, Any], *, format: str = "safetensors",
                  metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes of one .safetensors or .npz file holding ``arrays`` (and text ``metadata``)."""
    import numpy as np

    _check_format(format)
    if not isinstance(arrays, Mapping):  # it was an AttributeError: 'NoneType' object has no attribute 'items'
        raise TypeError(f"a step's arrays are a mapping (dict) of name -> array, got {shown(arrays)} "
                        f"({type(arrays).__name__})")
    data = {}
    for key, value in arrays.items():
        if not isinstance(key, str):  # made text, {3: ..} and {"3": ..} were one array, None read back as 'None'
            raise TypeError(f"array name {shown(key)} ({type(key).__qualname__}) is not text: a step file names its "
                            f"arrays with text; give the array a str name ({str(key)!r} if that is what it means)")
        try:
            data[str(key)] = array = to_numpy(value)  # numpy's str_ as str
        except (TypeError, ValueError, RuntimeError) as exc:  # a float8 tensor, a ragged list
            raise TypeError(f"array {str(key)!r}: cannot be a step file's array: {exc}") from None
        if not storable(array.dtype):  # safetensors said only 'Unknown dtype "object"'
            raise TypeError(f"array {str(key)!r} has dtype {array.dtype}: a step file holds bool, integer or "
                            "floating arrays (text goes in metadata, or prompt=)")
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    if format == "safetensors":
        from safetensors.numpy import save

        return _sorted_metadata(save(data, metadata=meta or None))
    # Not np.savez(**arrays): an array named 'file' or 'allow_pickle' was taken for its argument, and an object
    # array was pickled into a file the reader refuses. One .npy member per name, as np.savez writes them.
    clash = sorted(set(data) & set(meta))
    if clash:
        raise ValueError(f"{', '.join(map(repr, clash))}: the name of an array and of a metadata key; an .npz "
                         "holds one member per name")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, array in {**data, **{k: np.array(v) for k, v in meta.items()}}.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                # Never pickles: arrays are of a storable dtype (checked above), metadata values are text.
                np.lib.format.write_array(member, array, allow_pickle=False)
    return buffer.getvalue()


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")


def _folder(folder: str | os.PathLike) -> Path:
    """An episode folder argument as a Path, ``~`` expanded as the command line does (a recorder and a follower given
    the same string use the same folder: ``"./~"`` is a folder named ``~``, but ``Path("./~")`` is ``Path("~")``); a
    path that is a file is an error naming it."""
    if isinstance(folder, (str, os.PathLike)) and os.fspath(folder) in ("", b""):
        # Path("") is the current folder: a recorder given an unset variable would write its steps there
        raise ValueError("the episode folder is empty (''): give the folder the steps go to")
    path = Path(folder)
    if os.fspath(folder).startswith("~"):  # as given: the text "./~" is the folder named ~, as on the command line
        try:
            path = path.expanduser()
        except RuntimeError:  # ~nosuchuser: kept as written, as a shell keeps it
            pass
    if path.exists() and not path.is_dir():  # mkdir's 'File exists', of a path the user thinks is a folder
        raise NotADirectoryError(f"{path}: an episode folder, but it is a file")
    return path


def _step_metadata(metadata: Mapping[str, Any] | None, where: str) -> dict[str, str]:
    """A step file's metadata as text: text as is, numbers (numpy's and 0-d tensors too) written out; ``None``
    (read back as the text 'None') or anything else is a TypeError naming the key, as is a prompt that is not text.
    A key that is not text is a TypeError naming ``where`` (the episode folder and step): made text, ``None`` read
    back as 'None', and ``{3: ...}`` with ``{"3": ...}`` became one key."""
    meta = {}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str):  # numpy's str_ is a str
            kind = type(key)
            got = f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ == "numpy" else kind.__qualname__
            raise TypeError(f"{where}: metadata key {shown(key)} ({got}) is not text; a step file's metadata keys "
                            f"are text: give the field a str name ({str(key)!r} if that is what it means)")
        if key == "prompt":
            if value is None:
                raise TypeError("prompt must be text (str), got None")
            meta[key] = _check_prompt(value)
            continue
        plain = _plain(value)
        if isinstance(plain, (str, int, float)):  # bool too
            meta[str(key)] = str(plain)
            continue
        raise TypeError(f"metadata {str(key)!r}: a step file's metadata is text (or a number, written as text), got "
                        f"{shown(value)} ({type(value).__name__}); other values go in episode.yaml "
                        "(write_episode(metadata=...))")
    return meta


def _check_keys(info: Any, path: Path, where: str = "metadata") -> None:
    """Mapping keys episode.yaml (``path``) can hold and rollout read back: text, numpy's str_ too (a tuple key is
    written as a YAML complex key, which reading refuses). A number or bool, numpy's included, is refused rather than
    made text: ``{3: ...}`` and ``{"3": ...}`` would read back as one key."""
    if isinstance(info, Mapping):
        for key, value in info.items():
            if not isinstance(key, str):
                kind = type(key)
                got = f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ == "numpy" else kind.__qualname__
                numeric = isinstance(key, (int, float)) or kind.__module__ == "numpy"  # np.int64, np.bool_
                hint = f": give str(key) ({str(key)!r}) if it names a field" if numeric else ""
                raise TypeError(f"{where}: key {shown(key)} ({got}) is not text; {path} keys are text{hint}")
            _check_keys(value, path, f"{where}[{key!r}]")
    elif isinstance(info, list):
        for item in info:
            _check_keys(item, path, where)


def _check_prompt(prompt: Any) -> str | None:
    """The prompt as a plain str (numpy's str_, as read from a dataset, too); a TypeError otherwise: episode.yaml
    would record a number, which rollout refuses, and YAML cannot write numpy's string type at all. A lone surrogate
    (bytes decoded with errors="surrogateescape") is a ValueError: rollout refuses such a prompt, and safetensors
    failed on it with a bare UnicodeEncodeError."""
    if prompt is None:
        return None
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be text (str), got {shown(prompt)} ({type(prompt).__name__})")
    if (surrogate := lone_surrogate(prompt)) is not None:
        raise ValueError(f"prompt {surrogate} (text decoded from bytes that are not UTF-8?); rollout would refuse it")
    return str(prompt)


def _sorted_metadata(blob: bytes) -> bytes:
    """``blob`` (a safetensors file) with its metadata keys sorted. safetensors writes the metadata map in hash
    order, which changes from one map to the next, so the same arrays and metadata gave different bytes: a
    resumed run's outputs would differ from an uninterrupted run's checksums. The tensors' bytes are untouched."""
    size, header = safetensors_header(blob)
    if not header.get("__metadata__"):
        return blob
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data stays 8-byte aligned, as safetensors pads it
    return len(text).to_bytes(8, "little") + text + blob[8 + size:]


def sort_metadata_in_file(path: str | os.PathLike) -> None:
    """``_sorted_metadata`` for a file written by ``safetensors.*.save_file``, rewriting only its header: a large
    checkpoint is never held twice in memory. The sorted header has the same keys and values, so it is as long
    as the original; were it ever longer, the whole file is rewritten."""
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        blob = size.to_bytes(8, "little") + f.read(size)
        sorted_header = _sorted_metadata(blob)
        if len(sorted_header) == len(blob):
            f.seek(0)
            f.write(sorted_header)
            return
        f.seek(0)
        whole = _sorted_metadata(f.read())
        f.seek(0)
        f.write(whole)
        f.truncate()


def write_step(folder: str | os.PathLike, step: int, arrays: Mapping[str, Any], *, prompt: str | None = None,
               metadata: Mapping[str, str] | None = None, format: str = "safetensors") -> Path:
    """Write step ``step`` of the episode in ``folder`` (created if needed); returns the file's path.

    ``prompt`` and ``metadata`` go to the safetensors metadata (or 0-d string
    arrays in an .npz); a step's prompt (``prompt=`` or ``metadata["prompt"]``)
    overrides the one in ``episode.yaml``. The prompt is an episode-level field,
    so while ``episode.yaml`` holds no ``prompt`` this one is recorded there too,
    before the step file appears: later steps written without a prompt then use it.
    """
    number = as_int(step)  # numpy's integers too (a step counted with np.arange), never a bool
    if number is None or number < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    step = number
    prompt = _check_prompt(prompt)
    folder = _folder(folder)
    meta = _step_metadata(metadata, f"{folder} step {step}")
    if prompt is not None:
        if meta.get("prompt", prompt) != prompt:
            raise ValueError(f"two prompts for step {step}: prompt={prompt!r} and metadata['prompt']="
                             f"{meta['prompt']!r}; give one")
        meta["prompt"] = prompt
    blob = encode_arrays(arrays, format=format, metadata=meta)  # a step it refuses leaves episode.yaml untouched
    if len(blob) > step_file.MAX_STEP_BYTES:  # an .npz's members are stored: its size is at least what they unpack to
        raise ValueError(f"step {step}: its file would take {len(blob)} bytes, more than the "
                         f"{format_bytes(step_file.MAX_STEP_BYTES)} rollout reads of a step: store camera frames at "
                         "about the model's size, one step's frames per file")
    if "prompt" in meta:
        _record_episode_prompt(folder, meta["prompt"])
    return atomic_write_bytes(folder / f"step_{step:06d}.{format}", blob)


def _record_episode_prompt(folder: Path, prompt: str) -> None:
    """Set ``prompt`` in ``folder/episode.yaml`` unless it has one (its other fields are kept): a later step's own
    prompt is that step's (an instruction that changes mid-episode), never the episode's."""
    import yaml

    path = folder / METADATA_FILE
    if path.is_dir():  # read_episode_yaml's error is the rollout's: its hint says to rerun with --resume
        raise IsADirectoryError(f"{path}: the episode's {METADATA_FILE} is a folder, not a file; move it out of the "
                                "episode folder: write_step records the episode's prompt there")
    info = read_episode_yaml(path) if path.exists() else {}
    if "prompt" not in info:
        atomic_write_text(path, yaml.safe_dump({**info, "prompt": prompt}, sort_keys=False))


def write_episode(folder: str | os.PathLike, steps: Sequence[Mapping[str, Any]], *, prompt: str | None = None,
                  metadata: Mapping[str, Any] | None = None, format: str = "safetensors", first_step: int = 0,
                  end: bool = True) -> list[Path]:
    """Write a whole episode: ``episode.yaml`` (prompt + metadata), one file per step, and the END marker."""
    import yaml

    _check_format(format)
    first = as_int(first_step)
    if first is None or first < 0:  # refused before episode.yaml is written
        raise ValueError(f"first_step must be a non-negative integer, got {first_step!r}")
    if isinstance(steps, (Mapping, str, bytes)):  # one step's arrays given as the episode: each key was a step
        raise TypeError(f"steps is a sequence of steps, each a mapping of name -> array, got a {type(steps).__name__}"
                        " (for one step, pass [arrays])")
    if isinstance(steps, Sequence):
        bad = next((i for i, arrays in enumerate(steps) if not isinstance(arrays, Mapping)), None)
        if bad is not None:
            raise TypeError(f"steps[{bad}]: a step's arrays are a mapping (dict) of name -> array, got "
                            f"{shown(steps[bad])} ({type(steps[bad]).__name__})")
    prompt = _check_prompt(prompt)
    folder = _folder(folder)
    info = _plain(dict(metadata or {}))
    _check_keys(info, folder / METADATA_FILE)
    if prompt is None and "prompt" in info and _check_prompt(info["prompt"]) is None:  # rollout refuses it
        raise TypeError("metadata 'prompt': prompt must be text (str), got None")
    if prompt is not None:
        info["prompt"] = prompt
    try:
        text = yaml.safe_dump(info, sort_keys=False) if info else None
    except yaml.representer.RepresenterError as exc:  # refused before anything is written
        value = exc.args[1] if len(exc.args) > 1 else None
        raise TypeError(f"metadata: episode.yaml cannot hold {shown(value)} ({type(value).__name__}); it holds "
                        "text, numbers, booleans, lists and mappings") from None
    size = len(text.encode()) if text is not None else 0
    if size > MAX_METADATA_BYTES:  # refused before anything is written, as rollout would refuse the file
        raise ValueError(f"metadata: episode.yaml would take {size} bytes, more than the "
                         f"{MAX_METADATA_BYTES >> 20} MiB rollout reads; per-step data goes in the step files, as arrays")
    folder.mkdir(parents=True, exist_ok=True)
    if text is not None:
        atomic_write_text(folder / METADATA_FILE, text)
    # the folder as text that names it again (./~ stays the folder named ~: as a Path, ~/ep was the home folder's)
    typed = as_typed(folder)
    paths = [write_step(typed, first + i, arrays, format=format) for i, arrays in enumerate(steps)]
    if end:
        end_episode(typed)
    return paths


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars and arrays, and torch tensors, as Python numbers and lists (a camera's
    calibration read with numpy), in mappings and lists too: YAML's safe dumper writes only Python's own types. A
    ``np.str_`` key (a name read from a dataset) is made a str: it is text, yet was refused as a value episode.yaml
    "cannot hold"."""
    import numpy as np

    if isinstance(value, Mapping):
        return {(str(key) if isinstance(key, np.str_) else key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    torch = sys.modules.get("torch")  # a tensor means torch was imported: never imported here
    if isinstance(value, (np.generic, np.ndarray)) or (torch is not None and isinstance(value, torch.Tensor)):
        return value.tolist()
    return value


def end_episode(folder: str | os.PathLike) -> Path:
    """Mark the episode complete (``--follow`` stops waiting for it). The folder must exist: a mistyped one would
    be made, holding only END, an episode that fails for having no step."""
    path = _folder(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such episode folder; end_episode marks the end of an episode whose steps "
                                "were written there")
    return atomic_write_bytes(path / END_MARKER, b"")
