"""Reading one step file of an episode (``.safetensors`` or ``.npz``: :func:`load_step`) and an episode's
``episode.yaml`` (:func:`read_episode_yaml`): the sizes they may have, what a file that is neither is, and the
signature that tells whether a file changed since it was read. Finding episodes and their step files is
:mod:`ardiff_cli.io.episode`'s.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ardiff_cli.io.atomic import TooLarge, open_file, parse_json, read_capped
from ardiff_cli.runtime.errors import (ObservationError, as_typed, link_to_nothing, plural, shown, too_many_open_files,
                                       yaml_problem, yaml_syntax_hint)

METADATA_FILE = "episode.yaml"
MOUNT_HINT = "mount the disk the link points to (or fix the link)"
# How the hint of a step file or an episode.yaml that cannot be read ends: the rollout's says its own resume instead
# (``go_on``), a library caller's this
RERUN = "then rerun with --resume"


@dataclass(slots=True)
class RawStep:
    """What one step file holds, before validation."""

    arrays: dict[str, Any]  # numpy arrays by key
    metadata: dict[str, str]  # safetensors metadata, or 0-d string arrays of an .npz
    sha256: str = ""  # hex digest of the file's bytes: the very bytes parsed (the file is read once)
    signature: tuple[int, ...] | None = None  # (size, mtime_ns, ctime_ns, inode) of the file read: file_signature


# A prompt and a few fields; PyYAML reads about 0.5 MB/s, and reads it twice. A data file of 16 MiB saved as
# episode.yaml stalled the whole run (every episode) for minutes, through a first SIGTERM.
MAX_METADATA_BYTES = 1 << 20


def read_episode_yaml(path: Path) -> dict[str, Any]:
    import yaml

    from ardiff_cli.runtime.config import duplicate_key

    try:
        with open_file(path) as f:
            raw = read_capped(f, MAX_METADATA_BYTES)
    except IsADirectoryError:  # it had the hint about permissions of a folder the user could read
        raise ObservationError(f"{as_typed(path)}: cannot read episode metadata: it is a folder, not a file",
                               hint=f"{METADATA_FILE} is a YAML file (prompt: ...): move that folder out of the "
                                    f"episode folder, {RERUN}") from None
    except OSError as exc:  # its text repeats the path: "[Errno 13] Permission denied: '.../episode.yaml'"
        if too_many_open_files(exc):  # the process's limit, not the file: no invalid input (exit 2)
            raise
        raise ObservationError(f"{as_typed(path)}: cannot read episode metadata: {exc.strerror or exc}",
                               hint="check that the user running ardiff may read it (permissions)") from None
    except TooLarge:
        raise ObservationError(f"{as_typed(path)}: cannot read episode metadata: it takes more than "
                               f"{MAX_METADATA_BYTES >> 20} MiB, which no episode metadata does",
                               hint="episode.yaml holds the prompt and a few fields; per-step data goes in the step "
                                    "files, as arrays") from None
    try:
        text = raw.decode("utf-8")  # UTF-8 whatever the locale, as the writer writes
        data = yaml.safe_load(text)
    except UnicodeDecodeError as exc:
        raise ObservationError(
            f"{as_typed(path)}: episode metadata is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start}); expected a UTF-8 YAML mapping",
            hint="write episode.yaml as UTF-8 text, e.g. `prompt: pick up the red cube` "
                 "(ardiff_cli.io.write_episode does)",
        ) from None
    except yaml.YAMLError as exc:  # one line, as a config's: PyYAML's own text spans five, with a caret drawn
        raise ObservationError(f"{as_typed(path)}: cannot read episode metadata: {yaml_problem(exc, text)}",
                               hint=f"{yaml_syntax_hint(exc)}; episode.yaml holds `key: value` lines, e.g. "
                                    "`prompt: pick up the red cube`") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise ObservationError(f"{as_typed(path)}: cannot read episode metadata: lists or mappings are nested "
                               "too deeply",
                               hint="episode metadata is a few levels deep; look for runaway brackets") from None
    except ValueError as exc:  # a plain scalar YAML types but Python cannot hold: 2024-13-45, a 5000-digit number
        raise ObservationError(f"{as_typed(path)}: cannot read episode metadata: {str(exc).split(';')[0]}",
                               hint="quote the value if it is text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ObservationError(f"{as_typed(path)}: episode metadata must be a YAML mapping, got {type(data).__name__}",
                               hint="write it as `key: value` lines, e.g. `prompt: pick up the red cube`")
    duplicate = duplicate_key(text)
    if duplicate is not None:  # two prompts: which one the episode ran with would be YAML's silent choice
        key, where = duplicate
        raise ObservationError(f"{as_typed(path)}: key {key!r} is given twice ({where}); YAML would keep the "
                               "second silently",
                               hint="keep one of them")
    return data


WRITE_HINT = ("was it written completely? write step files under a temporary name and rename them "
              f"(ardiff_cli.io.write_step does), {RERUN}")
# First bytes of formats that turn up under a step file's suffix, and what to do about each.
_SIGNATURES = (
    (b"PK\x03\x04", "a zip archive (an .npz?)", "if it is an .npz, give it the .npz suffix"),
    (b"\x89PNG", "a PNG image", "store camera frames as uint8 arrays in the step file (ardiff_cli.io.write_step)"),
    (b"\x93NUMPY", "a .npy array file", "store the step's arrays in one .safetensors or .npz file"),
    (b"\x80", "a pickle (torch.save / pickle.dump)",
     "ardiff never unpickles files; convert it with safetensors.numpy.save_file or ardiff_cli.io.write_step"),
)


_TORCH_SAVE = "a torch.save file (a zip holding a pickle)"
_TORCH_SAVE_HINT = ("ardiff never unpickles files; save the tensors with safetensors.torch.save_file, or write the "
                    "step with ardiff_cli.io.write_step")


def _is_torch_save(data: bytes) -> bool:
    """Whether ``data``, a file's bytes or only its first ones, are what torch.save writes: a zip whose first member
    (the one torch.save writes first) or any member is ``<name>/data.pkl``, beside the tensors."""
    import io
    import zipfile

    if not data.startswith(b"PK\x03\x04"):
        return False
    if _is_pickle_member(data[30:30 + int.from_bytes(data[26:28], "little")].decode("latin-1")):  # its local header
        return True
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return any(map(_is_pickle_member, archive.namelist()))
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return False


def _is_pickle_member(name: str) -> bool:
    return name == "data.pkl" or name.endswith("/data.pkl")


def _is_safetensors(data: bytes) -> bool:
    """Whether ``data`` starts as a whole safetensors header: an .npz file that is safetensors renamed."""
    if data[8:9] != b"{":
        return False
    try:
        return isinstance(safetensors_header(data)[1], dict)
    except (ValueError, TypeError):
        return False


def going_on(hint: str | None, go_on: str | None) -> str | None:
    """``hint``, ending with ``go_on`` (how to go on with the run: the rollout's resume to paste) where it ends with
    ``RERUN``; as it is otherwise, or without ``go_on``."""
    if go_on is None or hint is None or not hint.endswith(RERUN):
        return hint
    return f"{hint.removesuffix(RERUN)}then {go_on}"


def load_step(path: str | os.PathLike[str], go_on: str | None = None) -> RawStep:
    """Read one step file; an unreadable file is an ``ObservationError`` naming it and saying why (``go_on``: how
    its hint ends when it says to go on with the run once the file is fixed, ``going_on``).

    The file is read once, and its SHA-256 is that of the bytes parsed: a file replaced meanwhile cannot give
    arrays of one version and the digest of another (``--resume`` and session rebuilds compare digests).
    """
    path = Path(path)
    try:
        data, signature = _read_bytes(path)
        if not data:
            raise _empty(path)
        if path.suffix == ".safetensors":
            raw = _load_safetensors(path, data)
        elif path.suffix == ".npz":
            raw = _load_npz(path, data)
        else:
            raise ObservationError(f"{as_typed(path)}: unsupported step file type {path.suffix!r}; use "
                                   ".safetensors or .npz")
    except ObservationError as exc:
        exc.hint = going_on(exc.hint, go_on)
        raise
    raw.sha256 = hashlib.sha256(data).hexdigest()
    raw.signature = signature
    return raw


def file_signature(path: Path) -> tuple[int, ...] | None:
    """(size, mtime_ns, ctime_ns, inode) of ``path`` now, or None when it cannot be looked at: equal to a step's
    ``RawStep.signature`` while nobody wrote the file since it was read (ctime: also when its mtime was set back,
    as ``cp -p`` sets it)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _signature(st)


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def step_sha256(path: Path) -> str:
    """The SHA-256 of a step file, as :func:`load_step` gives it, without parsing the file or holding it whole: what
    checking that a step is the one that ran needs. An unreadable or empty file is ``load_step``'s
    ``ObservationError`` (an empty one is a write cut short, not a step that changed)."""
    try:
        with open_file(path) as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            size = f.tell()
    except OSError as exc:
        raise _unreadable(path, exc) from None
    if not size:
        raise _empty(path)
    return digest


def _empty(path: Path) -> ObservationError:
    return ObservationError(f"{as_typed(path)}: the file is empty (0 bytes)", hint=WRITE_HINT)


def _read_bytes(path: Path) -> tuple[bytes, tuple[int, ...]]:
    """The whole file and its signature as it was read (see :func:`file_signature`), or an ``ObservationError``
    saying why it cannot be read."""
    try:
        with open_file(path) as f:
            st = os.fstat(f.fileno())  # before the read: a write while or after it is read changes mtime from this
            if path.suffix == ".safetensors":  # before the read: a 100 GB file is not read whole to refuse it
                _refuse_safetensors_of_another_size(path, f, st.st_size)
                f.seek(0)
            if st.st_size > MAX_STEP_BYTES:
                raise _too_large(path, f, st.st_size)
            return f.read(), _signature(st)
    except OSError as exc:
        raise _unreadable(path, exc) from None


# A step file holds one step's observations: a few MB (four 720p frames of three cameras take 33 MB, and the model
# resizes them to its tiles). One past this, or an .npz whose arrays take more unpacked, is refused before it is read
# or unpacked: an 8 GB one (sparse, or a zip of zeros a few MB long) was read whole, a MemoryError (exit 3, a hint to
# lower --session-capacity).
MAX_STEP_BYTES = 1 << 30
_TOO_LARGE_HINT = ("a step file holds one step's observations, a few MB: store camera frames at about the model's size "
                   "(it resizes them to its tiles), one step's frames per file")
_HEAD_BYTES = 4096  # what is read of a step file refused for its size, to say what it is


def _too_large(path: Path, f: BinaryIO, size: int) -> ObservationError:
    """Why the step file ``path`` (open as ``f``, at its start) of ``size`` bytes, more than ``MAX_STEP_BYTES``, is
    not read: a torch.save checkpoint under a step suffix is named as one (from its first member), any other file
    by its size."""
    kind, other = ("safetensors file", "safetensors") if path.suffix == ".safetensors" else (".npz file", "an .npz")
    if _is_torch_save(f.read(_HEAD_BYTES)):
        return ObservationError(f"{as_typed(path)}: cannot read {kind}: it is {_TORCH_SAVE}, "
                                f"not {other}", hint=_TORCH_SAVE_HINT)
    return ObservationError(f"{as_typed(path)}: cannot read {kind}: it takes {size} bytes, more than the "
                            f"{MAX_STEP_BYTES >> 30} GiB a step file may take", hint=_TOO_LARGE_HINT)


def _unreadable(path: Path, exc: OSError) -> ObservationError:
    """Why the step file ``path`` cannot be read; the limit on open files, the process's, is raised again as it is."""
    if too_many_open_files(exc):
        raise exc
    dangling = link_to_nothing(path) if isinstance(exc, FileNotFoundError) else None  # a disk not mounted
    if dangling:
        return ObservationError(f"{as_typed(path)}: cannot read the step file: it is {dangling}",
                                hint=f"{MOUNT_HINT}, {RERUN}")
    if isinstance(exc, IsADirectoryError):
        return ObservationError(f"{as_typed(path)}: cannot read the step file: it is a folder, not a file",
                                hint="move that folder out of the episode folder (every .safetensors and .npz entry "
                                     f"there is a step file), {RERUN}")
    return ObservationError(
        f"{as_typed(path)}: cannot read the step file: {exc.strerror or exc}",
        hint="check that the file exists and that the user running ardiff may read it (permissions)",
    )


# safetensors dtypes numpy has a type for; others (BF16, F8_*, ...) are valid files the numpy reader cannot hold.
# Little-endian, as safetensors stores them.
_NUMPY_DTYPES = {"BOOL": "?", "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "F16": "<f2", "U32": "<u4",
                 "I32": "<i4", "F32": "<f4", "U64": "<u8", "I64": "<i8", "F64": "<f8", "C64": "<c8"}


def looks_whole(path: Path, size: int) -> bool:
    """Whether ``path`` holds as many bytes as its own structure says: a safetensors file its header and every
    tensor's data, an .npz (a zip) its end-of-directory record at the end. Anything unparsable: False (a follower
    waits for the rest; a forced take reports it; a resume runs the step of such an output file again)."""
    if path.suffix == ".safetensors":
        return whole_safetensors_header(path, size) is not None
    try:
        with open_file(path) as f:
            tail_len = min(size, 22 + 0xFFFF)  # the end record (22 bytes) and its comment
            f.seek(size - tail_len)
            tail = f.read(tail_len)
            at = tail.rfind(b"PK\x05\x06")
            return at >= 0 and at + 22 + int.from_bytes(tail[at + 20:at + 22], "little") == len(tail)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False  # unreadable, or cut short


def whole_safetensors_header(path: Path, size: int) -> dict[str, Any] | None:
    """The parsed header of the safetensors file ``path`` of ``size`` bytes when it holds its header and every
    tensor's data, read from the header alone; None when it is cut short or unparsable."""
    try:
        with open_file(path) as f:
            declared, header = _declared_safetensors_size(f, size)
        return header if declared == size else None
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None  # a header cut mid-way


def _declared_safetensors_size(f: BinaryIO, size: int) -> tuple[int, dict[str, Any]]:
    """From the start of the open safetensors file ``f`` of ``size`` bytes: the bytes its header declares in all (the
    header and every tensor's data), and the parsed header; ValueError (or KeyError, TypeError...) when unparsable."""
    head = f.read(8)
    length = int.from_bytes(head, "little")
    if len(head) < 8 or 8 + length > size or length > MAX_HEADER_BYTES:
        raise ValueError(f"the header takes {8 + length} bytes, {size} given")
    _, header = safetensors_header(head + f.read(length))
    return 8 + length + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0), header


def safetensors_header(data: bytes) -> tuple[int, dict[str, Any]]:
    """The length and parsed JSON of the header at the start of safetensors bytes ``data`` (the file, or at
    least its first ``8 + length`` bytes); ``ValueError`` when they are cut short or not JSON."""
    length = int.from_bytes(data[:8], "little")
    if len(data) < 8 or len(data) < 8 + length:
        raise ValueError(f"the header takes {8 + length} bytes, {len(data)} given")
    return length, parse_json(data[8:8 + length])


# safetensors refuses a header longer than this. A file whose header cannot be parsed is read whole to say what it is
# (a torch.save zip is told by its member names), and named from its first bytes when too large to be read.
MAX_HEADER_BYTES = 100_000_000


def _refuse_safetensors_of_another_size(path: Path, f: BinaryIO, size: int) -> None:
    """Refuse, from its header alone, the safetensors file ``path`` (open as ``f``, of ``size`` bytes) whose size is
    not what its header declares (safetensors refuses it too, once it is read whole): a 100 GB file, sparse or a
    valid header before a huge tail, was read whole first, a MemoryError (exit 3, with a hint to lower
    --session-capacity) that did not always name the file."""
    try:
        declared, _ = _declared_safetensors_size(f, size)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        if size <= MAX_STEP_BYTES:
            return  # read whole, the file is named as what it is
        f.seek(0)
        raise _unreadable_safetensors(path, f.read(_HEAD_BYTES), exc, size=size) from None
    if declared > size:
        raise ObservationError(f"{as_typed(path)}: cannot read safetensors file: truncated or corrupt "
                               f"({plural(size, 'byte')}; its header declares {declared})", hint=WRITE_HINT)
    if declared < size:
        raise ObservationError(f"{as_typed(path)}: cannot read safetensors file: it has {size} bytes, "
                               f"{size - declared} more than its header declares ({declared}); safetensors refuses "
                               "data after the last tensor",
                               hint="remove what follows the last tensor, or write the step again (safetensors and "
                                    f"ardiff_cli.io.write_step write nothing after it), {RERUN}")


def _load_safetensors(path: Path, data: bytes) -> RawStep:
    import numpy as np
    from safetensors import deserialize

    try:
        # deserialize checks the header and every tensor's offsets against the bytes; by name, as safe_open lists them
        tensors = sorted(deserialize(data), key=lambda t: t[0])
        metadata = dict(safetensors_header(data)[1].get("__metadata__") or {})
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for corrupt files
        raise _unreadable_safetensors(path, data, exc) from None
    dtypes = {key: view["dtype"] for key, view in tensors}
    arrays = {}
    for key, view in tensors:
        if view["dtype"] not in _NUMPY_DTYPES:
            continue
        try:
            arrays[key] = np.frombuffer(view["data"], dtype=_NUMPY_DTYPES[view["dtype"]]).reshape(view["shape"])
        except ValueError as exc:  # a header safetensors takes: no data and a dimension of 2**62, or 100 dimensions
            raise ObservationError(f"{as_typed(path)}: tensor {key!r} has shape {shown(view['shape'])}, which no "
                                   f"array can hold ({exc})",
                                   hint="its header is damaged or was not written by a safetensors writer; write "
                                        "step files with ardiff_cli.io.write_step") from None
    unheld = [(key, "bfloat16" if dtype == "BF16" else dtype) for key, dtype in dtypes.items() if key not in arrays]
    if unheld:
        # Not loaded through torch: read_step stays torch-free and behaves the same in a script as in a rollout.
        raise ObservationError(
            f"{as_typed(path)}: " + ", ".join(f"tensor {key!r} is {dtype}" for key, dtype in unheld)
            + ", which the numpy reader cannot hold; store float32 or float16",
            hint="convert with tensor.float() before saving, or write steps with ardiff_cli.io.write_step "
                 "(it stores bfloat16 tensors as float32)",
        )
    return RawStep(arrays=arrays, metadata=metadata)


def _unreadable_safetensors(path: Path, data: bytes, exc: Exception, *, size: int | None = None) -> ObservationError:
    """Why safetensors refused ``path`` (its bytes ``data``, or their first ones of ``size`` in all), in words: another
    format, a truncated file, or corrupt bytes."""
    head, size = data[:16], len(data) if size is None else size
    if _is_torch_save(data):  # not an .npz: renamed, it would fail again
        return ObservationError(f"{as_typed(path)}: cannot read safetensors file: it is {_TORCH_SAVE}, not safetensors",
                                hint=_TORCH_SAVE_HINT)
    for signature, what, hint in _SIGNATURES:
        # A header length whose low byte is 0x80 (128, 384, ...) starts like a pickle: a safetensors header's "{" at
        # byte 8 tells them apart, and in a file cut before it, the length's zero third byte (a pickle's is an opcode).
        if head.startswith(signature) and head[8:9] != b"{" and head[2:3] != b"\0":
            return ObservationError(f"{as_typed(path)}: cannot read safetensors file: it is {what}, not "
                                    "safetensors", hint=hint)
    header_len = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
    if len(head) >= 8 and 8 + header_len > size and header_len <= MAX_HEADER_BYTES:
        return ObservationError(
            f"{as_typed(path)}: cannot read safetensors file: truncated (its header alone should take {header_len} "
            f"bytes; the file has {plural(size, 'byte')} in all)", hint=WRITE_HINT)
    return ObservationError(f"{as_typed(path)}: cannot read safetensors file: truncated or corrupt "
                            f"({plural(size, 'byte')}): {exc}",
                            hint=WRITE_HINT)


def _load_npz(path: Path, data: bytes) -> RawStep:
    """The arrays and text of the .npz bytes ``data``, checked before any array is unpacked: its zip directory (keys,
    a torch.save's pickle, the size of its members unpacked), then each member's .npy header. np.load unpacked every
    member first: a zip of a few MB of zeros became 8 GB, a MemoryError (exit 3, a hint to lower --session-capacity)."""
    import io
    import zipfile
    import zlib

    import numpy as np

    head = data[:16]
    zip_signatures = (b"PK\x03\x04", b"PK\x05\x06")  # a first member, or the end record of a zip of none
    if not head.startswith(zip_signatures) and _is_safetensors(data):  # its header length may start with 0x80
        raise ObservationError(f"{as_typed(path)}: cannot read .npz file: it is a safetensors file, not an .npz",
                               hint="give it the .safetensors suffix")
    if not head.startswith(zip_signatures):  # an .npz is a zip archive; never let np.load guess (pickle)
        unknown = ("neither a zip archive nor a known format",
                   "write .npz files with numpy.savez or ardiff_cli.io.write_step")
        what, hint = next(((w, h) for sig, w, h in _SIGNATURES if head.startswith(sig)), unknown)
        raise ObservationError(f"{as_typed(path)}: cannot read .npz file: it is {what}, not an .npz", hint=hint)
    arrays: dict[str, Any] = {}
    metadata: dict[str, str] = {}
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
            _refuse_npz_directory(path, members)
            headers = {info: _npy_header(path, archive, info) for info in members}
            not_arrays = [info.filename.removesuffix(".npy") for info, header in headers.items() if header is None]
            if not_arrays:  # np.load hands back a member that is not .npy as its bytes, unpacked whole
                raise ObservationError(f"{as_typed(path)}: expected only .npy arrays in the .npz, got other files: "
                                       f"{', '.join(map(repr, not_arrays))}",
                                       hint="write .npz files with numpy.savez or ardiff_cli.io.write_step; put text "
                                            "in episode.yaml")
            for info, (_, _, dtype) in headers.items():
                key = info.filename.removesuffix(".npy")
                try:
                    with archive.open(info) as member:
                        value = np.lib.format.read_array(member, allow_pickle=False)
                except ValueError as exc:
                    if dtype.hasobject:  # its data is a pickle
                        raise ObservationError(f"{as_typed(path)}: cannot read .npz without pickle: {exc} (array "
                                               f"{key!r})",
                                               hint="store plain numeric arrays; put text in episode.yaml") from None
                    raise ObservationError(f"{as_typed(path)}: cannot read .npz file: truncated or corrupt: array "
                                           f"{key!r}: {exc}",
                                           hint=WRITE_HINT) from None
                if value.dtype.kind == "U" and value.ndim == 0:
                    metadata[key] = str(value)  # text (the prompt) stored as a 0-d string array
                else:
                    arrays[key] = value
    except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as exc:
        raise ObservationError(f"{as_typed(path)}: cannot read .npz file: truncated or "
                               f"corrupt: {exc}", hint=WRITE_HINT) from None
    except (RuntimeError, NotImplementedError) as exc:  # zipfile: a member with a password, or packed another way
        raise ObservationError(f"{as_typed(path)}: cannot read .npz file: {exc}",
                               hint="numpy.savez and ardiff_cli.io.write_step write members stored or deflated, "
                                    "without a password: write the step again with one of them") from None
    return RawStep(arrays=arrays, metadata=metadata)


def _refuse_npz_directory(path: Path, members: list[Any]) -> None:
    """Refuse, from its zip directory ``members`` alone (nothing unpacked), an .npz holding a key twice, a torch.save
    file, or members that take more than a step file may once unpacked."""
    from collections import Counter

    keys = [info.filename.removesuffix(".npy") for info in members]
    twice = next((k for k, count in Counter(keys).items() if count > 1), None)
    if twice is not None:  # a zip may hold two members of one name (numpy.savez never writes it): one ran silently
        raise ObservationError(f"{as_typed(path)}: key {twice!r} is given twice in the .npz (two members named "
                               f"{twice!r} or {twice + '.npy'!r}); np.load would take one of them silently",
                               hint="keep one of them: write the step again with numpy.savez or "
                                    "ardiff_cli.io.write_step")
    if any(_is_pickle_member(info.filename) for info in members):
        raise ObservationError(f"{as_typed(path)}: cannot read .npz file: it is {_TORCH_SAVE}, not an .npz",
                               hint=_TORCH_SAVE_HINT)
    unpacked = sum(info.file_size for info in members)  # what unpacking yields at most: zipfile stops there
    if unpacked > MAX_STEP_BYTES:
        largest = max(members, key=lambda info: info.file_size)
        raise ObservationError(f"{as_typed(path)}: cannot read .npz file: its members take {unpacked} bytes unpacked "
                               f"({largest.filename!r}: {largest.file_size}), more than the {MAX_STEP_BYTES >> 30} "
                               "GiB a step file may take", hint=_TOO_LARGE_HINT)


# numpy reads an .npy header at most this long unless told to trust the file (allow_pickle=True, which ardiff never
# passes); numpy.savez writes about 120 for any array a step holds.
_MAX_NPY_HEADER_BYTES = 10_000


def _npy_header(path: Path, archive: Any, info: Any) -> tuple[tuple[int, ...], bool, Any] | None:
    """(shape, fortran_order, dtype) from the .npy header of the .npz member ``info`` of the open zip ``archive``, its
    data left packed; None for a member that is not an .npy array. A header numpy would refuse, or one declaring
    more data than its member holds, is an ``ObservationError`` naming the array: np.load allocated the declared size
    first (a 150-byte file declaring 14.6 TiB failed its step as out of memory, exit 3)."""
    import io
    import math
    import tokenize

    import numpy as np

    key = info.filename.removesuffix(".npy")
    with archive.open(info) as member:
        prefix = member.read(10)  # magic (6 bytes), version (2), the header's length (2 bytes; 4 from version 2)
        if not prefix.startswith(np.lib.format.MAGIC_PREFIX):
            return None
        if prefix[6:7] not in (b"", b"\x01"):
            prefix += member.read(2)
        length = int.from_bytes(prefix[8:], "little")
        if length > _MAX_NPY_HEADER_BYTES:  # numpy's own error said to pass allow_pickle=True
            raise ObservationError(f"{as_typed(path)}: cannot read .npz file: array {key!r} has a .npy header of "
                                   f"{length} bytes, more than the {_MAX_NPY_HEADER_BYTES} numpy reads (numpy.savez "
                                   "writes about 120)",
                                   hint="it is damaged or was not written by numpy: write the step again with "
                                        "numpy.savez or ardiff_cli.io.write_step")
        try:
            header = io.BytesIO(prefix + member.read(length))
            version = np.lib.format.read_magic(header)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran_order, dtype = read(header)
        except (ValueError, tokenize.TokenError) as exc:  # a damaged header: numpy tokenizes it, and may not finish
            raise ObservationError(f"{as_typed(path)}: cannot read .npz file: array {key!r} has a .npy header numpy "
                                   f"cannot read: {exc}", hint=WRITE_HINT) from None
    declared = math.prod(shape) * dtype.itemsize
    held = info.file_size - len(prefix) - length
    if declared > held and not dtype.hasobject:  # an object array's data is a pickle: reading it refuses it
        raise ObservationError(f"{as_typed(path)}: cannot read .npz file: truncated or corrupt: array {key!r} "
                               f"declares shape {shape} of {dtype} ({declared} bytes), and its member holds "
                               f"{plural(held, 'byte')}",
                               hint=WRITE_HINT)
    return shape, fortran_order, dtype
