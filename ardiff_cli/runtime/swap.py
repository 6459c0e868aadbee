"""Snapshots of LRU-evicted sessions on disk, so their next request restores them instead of replaying history.

One safetensors file per swapped session (tensors, and string metadata holding JSON), named by a hash of the
session id salted per store, written in a temporary folder beside it and renamed: a reader never sees half a file.
The metadata names the session and the file it was written as, so a file put in its place (another session's, or
another store's of the same session: another run's) is refused when read, not restored as this session's history;
and the CRC-32 of its tensors' bytes, so a file whose data changed on the disk (a flipped bit, bytes overwritten in
place) is refused too, not restored as another history.
The store keeps a byte budget: making room drops the least recently swapped snapshots first, and a snapshot larger
than the whole budget is not written. Nothing here is pickled.

A file is written by a background thread, so the request that evicts a session does not wait for the disk (for a
large session, seconds). One write is in flight at a time: the next snapshot waits for it, so at most one
snapshot's tensors are held in memory beyond what the sessions hold. Reading a snapshot whose write is still in
flight takes its tensors from memory. A write that fails is found by the next call on the store (:meth:`settle`)
and reported in ``failures``; the snapshot is then gone, and its session is rebuilt as one without a snapshot.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import mmap
import os
import re
import secrets
import shutil
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ardiff_cli.runtime.capacity import as_int, checked_bytes
from ardiff_cli.runtime.errors import ConfigError, link_to_nothing_on, os_error, shown

if TYPE_CHECKING:  # torch-free at import: the CLI clears a run's swap folder without loading anything
    import torch

    from ardiff_cli.runtime.kv.state import KVSnapshot

FORMAT = "ardiff-swap-3"  # metadata["format"]; bump when the layout of a snapshot file changes (2: "file", 3: CRC)
FORMAT_NAME = re.compile(r"ardiff-swap-[0-9]{1,6}")  # FORMAT of any version
CRC_KEY = "ardiff_swap_crc32"  # the file's metadata key beside "ardiff_swap": data_crc32 of its tensors, in decimal
# The names SwapStore gives its files (path_for) and the temporary folders they are written in (write).
SNAPSHOT_FILE = re.compile(r"[0-9a-f]{32}\.safetensors")
SNAPSHOT_NAME = re.compile(rf"{SNAPSHOT_FILE.pattern}|\.[0-9a-f]{{32}}\.safetensors\.[0-9a-f]{{8}}\.tmp")


def file_bytes_at_most(tensors: dict[str, torch.Tensor], header: str) -> int:
    """An upper bound on the size of the safetensors file of ``tensors`` with ``header`` as its metadata: 8 bytes of
    length, the JSON header (every tensor's name, dtype, shape and offsets; the metadata string, escaped), padded
    to 8 bytes, then the data."""
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    offset_digits = len(str(data))
    entries = sum(len(json.dumps(name)) + len(',{"dtype":"F8_E4M3","shape":[],"data_offsets":[,]}')
                  + len(",".join(str(n) for n in t.shape)) + 2 * offset_digits for name, t in tensors.items())
    metadata = len('{"__metadata__":{"ardiff_swap":}') + len(json.dumps(header))  # ASCII escapes: never shorter
    metadata += len(f',"{CRC_KEY}":"{2 ** 32 - 1}"')  # the data's CRC-32, at most 10 digits
    return 8 + metadata + entries + 1 + 7 + data  # "}" and at most 7 bytes of padding


def data_crc32(tensors: dict[str, torch.Tensor]) -> int:
    """The CRC-32 of the bytes of ``tensors`` (on the CPU), in name order: what a snapshot file records of its data,
    checked when it is read. zlib's CRC-32 runs at several GB/s, a fraction of the file's read."""
    import torch

    crc = 0
    for name in sorted(tensors):
        data = tensors[name].detach().cpu().reshape(-1).contiguous().view(torch.uint8)  # any dtype, 0-d ones too
        crc = zlib.crc32(data.numpy(), crc)
    return crc


def file_metadata(header: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The safetensors metadata of the snapshot file of ``tensors`` with ``header``."""
    return {"ardiff_swap": header, CRC_KEY: str(data_crc32(tensors))}


# safetensors' dtype names -> torch's: those safetensors.torch.save_file writes (this torch build's, at read time)
_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "C64": "complex64",
                "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
                "U16": "uint16", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
                "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz",
                "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2"}


class _HeaderProblem(ValueError):
    """JSON that Python's json reads and safetensors (serde_json) refuses, in a snapshot file's header."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of a safetensors header, refused where a key is given twice, as safetensors refuses it (json
    keeps the last)."""
    header = dict(pairs)
    if len(header) != len(pairs):
        twice = next(key for i, (key, _) in enumerate(pairs) if any(key == k for k, _ in pairs[:i]))
        raise _HeaderProblem(f"gives the key {twice!r} twice")
    return header


# A \uD800-\uDFFF escape: half of a surrogate pair, which json reads alone (a string UTF-8 cannot encode) and
# safetensors refuses unless its other half follows
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (by name) and string metadata of the safetensors file ``path``: views of one private mapping of
    the file, as ``safe_open``'s were, so nothing is copied, and a tensor written to never changes the file.

    Not ``safe_open``: its torch ``get_tensor`` (safetensors 0.8.0) leaks two small Python objects per tensor read,
    about 64 B of memory per tensor per restore, hundreds of MB over a run that restores a session at each step. The
    file is checked as safetensors checks it: a JSON header of string metadata and tensors of known dtypes, each
    shape filling its data_offsets, the offsets following each other from 0 to the file's end. ``ValueError`` for a
    file that is not such a file (truncated, overwritten); ``OSError`` for one that cannot be read."""
    import torch

    from ardiff_cli.io.atomic import parse_json
    from ardiff_cli.io.step_file import MAX_HEADER_BYTES

    def refused(why: str) -> ValueError:
        return ValueError(f"{path}: not a readable safetensors file ({why})")

    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        length = int.from_bytes(f.read(8), "little") if size >= 8 else 0
        if size < 8:
            raise refused(f"{size} bytes: too short for a header's length (8 bytes)")
        if length > MAX_HEADER_BYTES:  # safetensors refuses it, whatever the file's size
            raise refused(f"its header's length says {length} bytes, more than the {MAX_HEADER_BYTES} a safetensors "
                          "header may take")
        if 8 + length > size:
            raise refused(f"{size} bytes: too short for its header ({8 + length} bytes)")
        # UTF-8, as safetensors reads it: json.loads of bytes would take UTF-16 and UTF-32 too
        raw = f.read(length)
        if b"\0" in raw:  # no JSON holds a NUL; UTF-16 and UTF-32 text hold one beside each ASCII letter
            raise refused("its header holds NUL bytes, which no UTF-8 JSON text does (zeroed, or UTF-16 or UTF-32 "
                          "text?)")
        try:
            text = raw.decode("utf-8")
            header = parse_json(text, object_pairs_hook=_unique_keys)
            if _SURROGATE_ESCAPE.search(text):  # rare: looked into only then
                json.dumps(header, ensure_ascii=False).encode("utf-8")
        except UnicodeDecodeError as exc:
            raise refused(f"its header is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start})") from None
        except UnicodeEncodeError as exc:
            raise refused(f"its header holds {exc.object[exc.start]!r}, half a UTF-16 surrogate pair") from None
        except _HeaderProblem as exc:
            raise refused(f"its header {exc}") from None
        except ValueError as exc:
            raise refused(f"its header is not JSON: {type(exc).__name__}") from None
        strings = header.pop("__metadata__", None) if isinstance(header, dict) else None
        if not isinstance(header, dict) or not isinstance(strings, (dict, type(None))) or any(
                not isinstance(v, str) for v in (strings or {}).values()):
            raise refused("its header is not a JSON object of tensors and string metadata")
        entries, end = [], 0  # (begin, name, torch dtype, shape, bytes), sorted into the file's order
        for name, entry in header.items():
            entry = entry if isinstance(entry, dict) else {}
            dtype_name = entry.get("dtype") if isinstance(entry.get("dtype"), str) else ""
            dtype = getattr(torch, _DTYPE_NAMES.get(dtype_name, ""), None)  # None: unknown (to this torch)
            shape, offsets = entry.get("shape"), entry.get("data_offsets")
            if not isinstance(dtype, torch.dtype) or not isinstance(shape, list) or not isinstance(offsets, list) \
                    or len(offsets) != 2 or any(type(n) is not int or n < 0 for n in (*shape, *offsets)):
                raise refused(f"tensor {name!r} is {shown(header[name])}, expected a known dtype, a shape and "
                              "data_offsets")
            packed = dtype == getattr(torch, "float4_e2m1fn_x2", None)  # two values a byte, the header counts values
            if packed and (not shape or shape[-1] % 2):
                raise refused(f"tensor {name!r} of dtype F4 has the shape {shape}, an odd number of values a row")
            torch_shape = [*shape[:-1], shape[-1] // 2] if packed else shape
            nbytes = math.prod(torch_shape) * dtype.itemsize
            if offsets[1] - offsets[0] != nbytes:
                raise refused(f"tensor {name!r} of {dtype_name} {shape} takes {nbytes} bytes, its data_offsets "
                              f"{offsets} give {offsets[1] - offsets[0]}")
            entries.append((offsets[0], name, dtype, torch_shape, nbytes))
        entries.sort()
        for begin, name, _, _, nbytes in entries:
            if begin != end:
                raise refused(f"tensor {name!r} starts at byte {begin} of the data, expected {end}: the tensors' "
                              "data_offsets leave a gap or overlap")
            end += nbytes
        if 8 + length + end != size:
            raise refused(f"{size} bytes, its header declares {8 + length + end}")
        # Views of one private mapping of the file, as safe_open's were: nothing is copied (a restore copies them
        # into its pages), and a write to one never reaches the file.
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if len(mapping) != size:
            raise refused(f"it took {size} bytes, then {len(mapping)}: written to while it was read")
        data = torch.frombuffer(mapping, dtype=torch.uint8)[8 + length:]
    tensors = {}
    for begin, name, dtype, shape, nbytes in entries:
        chunk = data[begin:begin + nbytes]
        if (8 + length + begin) % dtype.itemsize:  # not aligned to its dtype (safetensors aligns every tensor)
            chunk = chunk.clone()
        try:
            tensors[name] = chunk.view(dtype).reshape(shape)
        except (RuntimeError, TypeError) as exc:  # a shape torch cannot hold: 65 dimensions, 0 x 2**63
            raise refused(f"tensor {name!r} has the shape {shown(shape)}: {str(exc).splitlines()[0]}") from None
    return dict(sorted(tensors.items())), dict(strings or {})  # by name, as safe_open lists them


def check_swap_arguments(swap_dir: Any, swap_space: Any, *, where: str) -> tuple[Path | None, int | None]:
    """``swap_dir`` and ``swap_space`` of the engine or runner as (folder, bytes), or a ``ConfigError`` naming the
    argument: bytes >= 0 or a byte size such as ``"2GiB"`` (0: no swapping; None: the default), a folder for any."""
    hint = "e.g. swap_dir='runs/swap', swap_space=2 << 30 (or '2GiB'); leave both out for no swapping"
    if swap_dir is not None and not isinstance(swap_dir, (str, os.PathLike)):
        raise ConfigError(f"{where}: swap_dir must be a folder path (str or os.PathLike) or None, got "
                          f"{shown(swap_dir)}", hint=hint)
    if isinstance(swap_space, str):
        swap_space = checked_bytes(swap_space, f"{where}: swap_space", zero_ok=True)
    elif swap_space is not None:
        number = as_int(swap_space)  # numpy's integers too, as memory_budget takes them; never a bool
        if number is None or number < 0:
            raise ConfigError(f"{where}: swap_space must be a number of bytes >= 0 (0: no swapping) or None, got "
                              f"{shown(swap_space)}", hint=hint)
        swap_space = number
    if swap_dir is None and swap_space:
        raise ConfigError(f"{where}: swap_space={swap_space} without swap_dir: nothing would be swapped",
                          hint="give the folder for the snapshots too: swap_dir='runs/swap'")
    if swap_dir is None:
        return None, swap_space
    folder = Path(swap_dir)
    if swap_space == 0:  # no swapping: never used, so not looked at
        return folder, swap_space
    existing = None
    for path in (folder, *folder.parents):
        try:
            os.lstat(path)
        except (OSError, ValueError) as exc:
            if getattr(exc, "errno", None) in (errno.ENOENT, errno.ENOTDIR):  # not there (yet): its parent decides
                continue
            # a NUL, a name too long: the load raised a bare OSError or ValueError (with swap_space given, every
            # snapshot's write failed, and close() raised it)
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"{where}: swap_dir {shown(str(folder))}: cannot be a folder ({why})", hint=hint) from exc
        existing = path
        break
    if existing is not None and not existing.is_dir():  # every snapshot's write would fail
        raise ConfigError(f"{where}: swap_dir {folder}: {existing} is not a folder", hint=hint)
    return folder, swap_space


def free_disk_bytes(directory: Path) -> int:
    """Free bytes of the filesystem ``directory`` is (or would be) on."""
    path = Path(directory).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _fsync(path: Path) -> None:
    """Flush the file or folder ``path`` (its renames, for a folder) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_snapshot_files(directory: Path, *, keep: frozenset[str] = frozenset()) -> None:
    """Delete the snapshot files any store wrote in ``directory`` (a killed process's too) but the files named in
    ``keep``, then the folder if nothing else is in it: a folder that only shares the name keeps what ardiff did not
    write."""
    try:
        for path in Path(directory).iterdir():
            if SNAPSHOT_NAME.fullmatch(path.name) and path.name not in keep:
                if path.is_dir() and not path.is_symlink():  # a write's folder, with safetensors' own temporary
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        Path(directory).rmdir()
    except OSError:
        pass  # no such folder, or it holds something that is not ours


@dataclass(eq=False)
class _Snapshot:
    """One snapshot file of the store: written (``tensors`` None) or being written by the background thread."""

    path: Path
    written_as: str  # the file name its metadata must hold: this store's (path's), or the earlier store's (adopt)
    write_id: str | None  # the token its metadata must hold: this write's (None: adopted, written by another store)
    nbytes: int  # the file's size once its write is taken in (settle); until then the planned size, at least that
    header: str  # the JSON metadata, as written into the file
    tensors: dict[str, torch.Tensor] | None  # held until the file is written (a read meanwhile takes them)
    written: threading.Event = field(default_factory=threading.Event)  # set when the write ended, either way
    error: BaseException | None = None  # what the write raised
    dropped: bool = False  # discarded: whoever comes last (the write, or discard) deletes the file
    # its data is on the disk already: adopted (the detach that left it flushed it, before its index was written)
    # and not written since, so a detach leaves it without flushing it again
    durable: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)  # orders ``dropped`` against the write's end


class SwapStore:
    """Swapped sessions' snapshot files in ``directory`` (created on the first write), at most ``budget_bytes``.

    Called by one thread at a time (the runner's request lock); ``num_snapshots`` and ``nbytes`` may be read from
    any thread. Files are written by a background thread, one at a time (see the module's docstring)."""

    def __init__(self, directory: str | Path, budget_bytes: int) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"swap budget_bytes must be a positive integer, got {budget_bytes!r}")
        self.directory = Path(directory)  # where the files go; created lazily, removed by clear()
        self.budget_bytes = budget_bytes  # the most bytes of snapshot files at once
        # session id -> its snapshot, least recently swapped first: the order in which room is made.
        self._files: OrderedDict[str, _Snapshot] = OrderedDict()
        self._owners: dict[str, str] = {}  # file name -> session id, of each of _files: adopt() refuses them
        self._nbytes = 0  # sum of the files' bytes, kept as one int so other threads read it whole
        # Files of forgotten snapshots not yet deleted: a stop (Ctrl-C) that lands in discard() between forgetting a
        # snapshot and deleting its file leaves it here, for clear() to delete (else close() left it in the folder).
        self._unlinking: set[Path] = set()
        # The last write started, until settle() takes in its end: (session id, snapshot, its thread). Every
        # earlier write was taken in before it started (write() flushes first).
        self._last_write: tuple[str, _Snapshot, threading.Thread] | None = None
        self.num_dropped = 0  # snapshots deleted to make room for newer ones (their sessions are rebuilt otherwise)
        # (session id, file bytes) of the snapshots dropped since the caller last emptied this list (its events)
        self.dropped: list[tuple[str, int]] = []
        self.refused_bytes = 0  # the planned file size of the last snapshot refused as larger than the whole budget
        # (session id, why) of background writes that failed since the caller last emptied this list: those
        # sessions have no snapshot (the eviction had announced one)
        self.failures: list[tuple[str, BaseException]] = []  # (session id, why its write failed)
        # Hashed into every file name: stores sharing a folder (two engines, two processes) never touch each
        # other's files, even for one session id.
        self._salt = secrets.token_bytes(16)

    @property
    def num_snapshots(self) -> int:
        return len(self._files)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def session_ids(self) -> list[str]:
        """The sessions that have a snapshot, least recently swapped first."""
        return list(self._files)

    def has(self, session_id: str) -> bool:
        self.settle()
        return session_id in self._files

    def path_for(self, session_id: str) -> Path:
        """The file of ``session_id``: a hash (salted per store), so any session id (slashes, control characters) is
        a safe name."""
        digest = hashlib.sha256(self._salt + session_id.encode("utf-8", "surrogatepass")).hexdigest()
        return self.directory / f"{digest[:32]}.safetensors"

    def write(self, session_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any], *,
              drop_older: bool = True) -> int | None:
        """Start writing the snapshot of ``session_id`` (replacing an older one), after the write in flight ends;
        its planned bytes (an upper bound on the file's size), or None when that is larger than the whole budget
        (not written; the bytes in ``refused_bytes``). Older snapshots are dropped first to make room; with
        ``drop_older=False`` they stay, and a snapshot larger than the budget they leave is None too.
        ``tensors`` are the store's from now on: the caller must not change them. A folder that cannot be created
        raises ``OSError`` here; a write that fails later (disk full) is in ``failures`` after the next call."""
        self.flush()
        self.discard(session_id)
        path = self.path_for(session_id)
        write_id = secrets.token_hex(8)  # an older snapshot of the session put back in place of this one is refused
        header = json.dumps({"format": FORMAT, "session_id": session_id, "file": path.name, "write": write_id,
                             **metadata})
        planned = file_bytes_at_most(tensors, header)
        if planned > self.budget_bytes:
            self.refused_bytes = planned
            return None
        if not drop_older and self._nbytes + planned > self.budget_bytes:
            return None
        self._make_room(planned)
        snapshot = _Snapshot(path, path.name, write_id, planned, header, dict(tensors))
        # The file is written in a folder of its own, created here: safetensors writes its own temporary file
        # (.tmpXXXXXX) beside the file it is given, which a killed process would leave where remove_snapshot_files
        # cannot know it; and the swap folder is not empty until the write ends, so another store sharing it (its
        # clear()) cannot remove it under the background write.
        staging = writer = None
        try:
            for attempt in range(3):
                name = snapshot.path.with_name(f".{snapshot.path.name}.{secrets.token_hex(4)}.tmp")
                try:
                    self.directory.mkdir(parents=True, exist_ok=True)
                    name.mkdir()
                    staging = name
                    break
                except (FileNotFoundError, FileExistsError) as exc:
                    # another store's clear() removed the folder, empty then, between its making and the staging
                    # one's (pathlib's exist_ok says FileExistsError when it goes as it looks): make both again
                    dangling = link_to_nothing_on(self.directory)
                    if dangling is not None:  # the folder a link led to was removed: mkdir says "File exists"
                        raise FileNotFoundError(errno.ENOENT, f"{dangling[0]} is {dangling[1]}") from exc
                    if attempt == 2:
                        raise
            writer = threading.Thread(target=self._write_file, args=(snapshot, staging), name="ardiff-swap-writer")
            # known before the thread starts: a stop (KeyboardInterrupt) as it starts must not leave a file no store
            # knows of, written by a thread nobody waits for
            self._files[session_id] = snapshot
            self._owners[path.name] = session_id
            self._nbytes += planned
            self._last_write = (session_id, snapshot, writer)
            writer.start()  # "can't start new thread" raises here
        except BaseException:
            if self._files.get(session_id) is snapshot:
                self.discard(session_id, wait=False)  # a started write deletes its file and folder when it ends
            self._nbytes = sum(s.nbytes for s in self._files.values())  # a stop may have come between the two
            if writer is None or writer.ident is None:  # never started: flush() must not join it
                if self._last_write is not None and self._last_write[1] is snapshot:
                    self._last_write = None
                if staging is not None:
                    shutil.rmtree(staging, ignore_errors=True)
            raise
        return planned

    @staticmethod
    def _write_file(snapshot: _Snapshot, staging: Path) -> None:
        """The background thread: write ``snapshot`` in the folder ``staging``, then rename it into place."""
        path, temporary = snapshot.path, staging / "snapshot.safetensors"
        try:
            if not snapshot.dropped:  # discarded before its write began: nothing to write
                from safetensors.torch import save_file

                try:
                    tensors = {k: t.contiguous() for k, t in snapshot.tensors.items()}
                    save_file(tensors, str(temporary), metadata=file_metadata(snapshot.header, tensors))
                except Exception as exc:  # noqa: BLE001 - its errno, for the runner's full-disk check
                    error = os_error(exc, path)
                    if error is exc:
                        raise
                    raise error from exc
                os.replace(temporary, path)
        except BaseException as exc:  # noqa: BLE001 - reported by settle(), on the caller's thread
            snapshot.error = exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # a failed write's partial files too
            with snapshot.lock:
                snapshot.tensors = None  # the file has them now (or nothing will): their memory goes
                snapshot.written.set()
                if snapshot.dropped:
                    with contextlib.suppress(OSError):  # forgotten either way; the folder goes when the run ends
                        path.unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait for the write in flight, then :meth:`settle`."""
        if self._last_write is not None:
            self._last_write[2].join()
        self.settle()

    def settle(self) -> None:
        """Take in the last write if it ended: the file's real size replaces its planned one; a failed write's
        snapshot is forgotten and named in ``failures``."""
        if self._last_write is None or not self._last_write[1].written.is_set():
            return
        session_id, snapshot, _ = self._last_write
        self._last_write = None
        if self._files.get(session_id) is not snapshot:
            return  # discarded meanwhile: nothing to take in
        error = snapshot.error
        if error is None:
            try:
                size = snapshot.path.stat().st_size
            except OSError:  # written, then deleted (by hand, its folder removed): read() says so, as it does of
                size = snapshot.nbytes  # one deleted after this call; it was a failed write, or not, by the timing
        if error is not None:  # no snapshot
            self.discard(session_id)
            self.failures.append((session_id, error))
            return
        self._nbytes += size - snapshot.nbytes  # at most the planned bytes: the budget holds
        snapshot.nbytes = size

    def _make_room(self, needed: int) -> None:
        """Drop the least recently swapped snapshots until ``needed`` more bytes fit: O(1) per snapshot dropped, and
        for a call that drops none (the file list is not copied: adopting 10,000 kept snapshots copied it each time)."""
        while self._files and self._nbytes + needed > self.budget_bytes:
            session_id = next(iter(self._files))  # the least recently swapped: OrderedDict keeps insertion order
            self.dropped.append((session_id, self._files[session_id].nbytes))
            self.discard(session_id)
            self.num_dropped += 1

    def read(self, session_id: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], int]:
        """The tensors, metadata and bytes of ``session_id``'s snapshot (from memory while its write is in flight);
        raises ``OSError`` or ``ValueError`` for a missing, unreadable or corrupt file (its data too: the CRC-32 it
        records), or one that is not this session's snapshot as written: another session's, or another store's (its
        metadata names another file)."""
        snapshot = self._files[session_id]
        path = snapshot.path
        with snapshot.lock:
            tensors = None if snapshot.tensors is None else dict(snapshot.tensors)
        from_file = tensors is None  # else from memory, as written: nothing to check of its data
        crc = None  # the CRC-32 its file records
        if tensors is not None:
            header = snapshot.header
        else:
            tensors, strings = read_safetensors(path)
            header, crc = (strings.get(key) for key in ("ardiff_swap", CRC_KEY))
        try:
            metadata = json.loads(header) if header is not None else None
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            metadata = None
        written = metadata.get("format") if isinstance(metadata, dict) else None
        if isinstance(written, str) and written != FORMAT and FORMAT_NAME.fullmatch(written):
            # kept for --resume by an older ardiff (or a newer one): ardiff's own, in a layout this one does not read
            age = "an older" if int(written.rpartition("-")[2]) < int(FORMAT.rpartition("-")[2]) else "a newer"
            raise ValueError(f"{path}: a swap snapshot in {age} ardiff's format ({written!r}; this version reads "
                             f"{FORMAT!r})")
        if written != FORMAT:
            got = f", got {shown(written)}" if isinstance(metadata, dict) else ""
            raise ValueError(f"{path}: not an ardiff swap snapshot (format {FORMAT!r} expected{got})")
        if metadata.get("session_id") != session_id:
            raise ValueError(f"{path}: holds session {metadata.get('session_id')!r}, expected {session_id!r}")
        if metadata.get("file") != snapshot.written_as:  # same session, another store's: another run's history
            raise ValueError(f"{path}: was written as {shown(metadata.get('file'))}, expected "
                             f"{snapshot.written_as!r}: another swap store's snapshot of this session (another run's, "
                             "or another engine's) put in its place")
        if snapshot.write_id is not None and metadata.get("write") != snapshot.write_id:
            raise ValueError(f"{path}: is not the snapshot last written of this session (write "
                             f"{shown(metadata.get('write'))}, expected {snapshot.write_id!r}): an older one put back "
                             "in its place")
        if from_file and crc != (computed := str(data_crc32(tensors))):  # the header is whole, the data is not
            raise ValueError(f"{path}: its data is damaged (CRC-32 {computed}, written as {shown(crc)}): its bytes "
                             "changed on the disk since it was written")
        return tensors, metadata, snapshot.nbytes

    def discard(self, session_id: str, *, wait: bool = True, report: bool = False) -> bool:
        """Forget the snapshot of ``session_id``, if any, and delete its file; whether there was one. A write in
        flight is waited for, so the file is gone when this returns; with ``wait=False`` it is deleted when its
        write ends instead (the caller has its tensors already). With ``report``, a write of it that failed and was
        not taken in yet is named in ``failures`` (its session is closed while swapped out)."""
        snapshot = self._files.get(session_id)
        if snapshot is None:
            return False
        with snapshot.lock:  # first: a stop before the pop leaves it known (deleted by clear()), never a lost file
            snapshot.dropped = True  # a write in flight deletes its file when it ends (so, also if a wait is cut)
        self._unlinking.add(snapshot.path)  # before it is forgotten: a stop from here on leaves it to clear()
        del self._files[session_id]
        self._owners.pop(snapshot.path.name, None)
        self._nbytes -= snapshot.nbytes
        if wait:
            snapshot.written.wait()
        if report and snapshot.written.is_set() and snapshot.error is not None:  # settle() would have forgotten it
            self.failures.append((session_id, snapshot.error))
        if snapshot.written.is_set():
            with contextlib.suppress(OSError):  # forgotten either way; the folder goes when the run ends
                snapshot.path.unlink(missing_ok=True)
            self._unlinking.discard(snapshot.path)
        return True

    def detach(self) -> dict[str, str]:
        """Wait for the write in flight, then forget every snapshot but leave its file, flushed to the disk:
        {session id: file name}, least recently swapped first, for a later store to :meth:`adopt` (one adopted and
        not written since goes back to the name it was written as, which its metadata holds). The files are
        written without a flush (a session swapped out in a run is read back by it, or deleted), so a power loss
        after the caller recorded the result (the CLI's kept.json) would have left files it names with their data
        lost, restored as zeros. One adopted and not written since is not flushed again: the detach that left it did,
        before its caller recorded it (a stopped ``--resume`` of 10,000 kept snapshots flushed each again: 16 s); the
        folder is, for the renames. A write that failed, or a file the disk would not flush (deleted), is in
        ``failures``. Later snapshots of this store are named anew, never as a file left."""
        self.flush()
        for session_id, snapshot in list(self._files.items()):
            try:
                if not snapshot.durable:  # an adopted one was flushed by the detach that left it, and not rewritten
                    _fsync(snapshot.path)
                if snapshot.written_as != snapshot.path.name:  # adopted, not written since: its metadata names the
                    # file it was written as, which the next store's adopt checks the name it is given against
                    written_as = self.directory / snapshot.written_as
                    os.replace(snapshot.path, written_as)
                    snapshot.path = written_as
            except OSError as exc:
                self.discard(session_id)
                self.failures.append((session_id, exc))
        if self._files:
            with contextlib.suppress(OSError):  # a rename lost with it leaves no file: that session is replayed
                _fsync(self.directory)
        kept = {session_id: snapshot.path.name for session_id, snapshot in self._files.items()}
        self._unlinking.difference_update(snapshot.path for snapshot in self._files.values())  # kept, not deleted
        self._files.clear()
        self._owners.clear()
        self._nbytes = 0
        # The files left keep their names: this store's later snapshots of those sessions (it may go on serving) get
        # others, or they were written over the files left, and deleted with them by clear().
        self._salt = secrets.token_bytes(16)
        return kept

    def adopt(self, session_id: str, name: str) -> bool:
        """Take the snapshot file ``name`` in this store's folder, which another store (an earlier process) wrote
        for ``session_id`` and :meth:`detach` left, flushed to the disk (so this store's detach does not flush it
        again while it is not written anew), as this store's own; False, and the file deleted, when it is
        larger than the whole budget. Its contents are checked when it is read (:meth:`read`: the session id and
        the file name ``name`` in it, then the runner: geometry, dtype, pipeline record). A missing file raises
        ``OSError``."""
        if not SNAPSHOT_FILE.fullmatch(name):
            raise ValueError(f"{name!r} is not the name of a swap snapshot file")
        owner = self._owners.get(name)
        if owner is not None:  # taking it would lose that session's snapshot
            raise ValueError(f"{name} is this store's snapshot of session {shown(owner)}, not one another store left")
        (self.directory / name).stat()  # a missing file raises before the session's own snapshot is discarded
        self.discard(session_id)
        path = self.path_for(session_id)
        os.replace(self.directory / name, path)
        size = path.stat().st_size
        if size > self.budget_bytes:
            path.unlink(missing_ok=True)
            return False
        self._make_room(size)
        snapshot = _Snapshot(path, name, None, size, header="", tensors=None, durable=True)
        snapshot.written.set()
        self._files[session_id] = snapshot
        self._owners[path.name] = session_id
        self._nbytes += size
        return True

    def clear(self) -> None:
        """Wait for the write in flight, then delete every snapshot, and the folder when nothing else is in it."""
        self.flush()
        for session_id in list(self._files):
            self.discard(session_id)
        for path in list(self._unlinking):  # forgotten by a discard a stop cut short
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            self._unlinking.discard(path)
        self.failures.clear()  # their sessions are closed: a snapshot lost meanwhile is nothing to warn about
        try:
            self.directory.rmdir()
        except OSError:
            pass  # never created, or holds something that is not ours


PLAIN_TYPES = (str, int, float, type(None))  # JSON gives these back equal (a subclass, np.str_ say, as its base)


def check_plain(value: Any, where: str) -> None:
    """A ``TypeError`` naming ``where`` unless JSON gives ``value`` back equal: dicts with str keys, lists and
    :data:`PLAIN_TYPES` (a tuple would come back a list, an int key a str: a silently different session)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} has the key {key!r}, a {type(key).__name__}, which JSON gives back as a str")
            check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
    elif not isinstance(value, PLAIN_TYPES):
        raise TypeError(f"{where} is a {type(value).__name__} ({shown(value)}), which JSON gives back as another "
                        "type or not at all: a snapshot keeps tensors and plain values (dict with str keys, list, str, "
                        "int, float, bool, None)")


def encode_snapshot(kv: KVSnapshot, pipeline_state: dict[str, Any] | None, num_requests: int, *,
                    where: str = "export_ar_diffusion_session()") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One session's snapshot as safetensors tensors and JSON-able metadata: ``kv/...`` its KV, ``pipeline/<name>``
    the pipeline's tensors (its plain values go in the metadata; ``where`` names what returned them)."""
    pipeline_tensors, pipeline = encode_exported(pipeline_state, where)
    tensors = {f"kv/{key}": t for key, t in kv.tensors.items()}
    tensors.update(pipeline_tensors)
    return tensors, {"kv": kv.metadata, "pipeline": pipeline, "num_requests": num_requests}


def encode_exported(pipeline_state: dict[str, Any] | None,
                    where: str) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The pipeline's part of a snapshot: its tensors copied to the host, as ``pipeline/<name>``, and the metadata
    that lists them and holds its plain values (None for a None export)."""
    import torch

    check_exported(pipeline_state, where)
    if pipeline_state is None:
        return {}, None
    tensors, pipeline = {}, {"tensors": [], "values": {}}
    for name, value in pipeline_state.items():
        if isinstance(value, torch.Tensor):  # a copy of its own: safetensors refuses tensors sharing memory
            tensors[f"pipeline/{name}"] = value.detach().cpu().clone(memory_format=torch.contiguous_format)
            pipeline["tensors"].append(name)
        else:
            pipeline["values"][name] = value
    return tensors, pipeline


def check_exported(pipeline_state: Any, where: str) -> None:
    """A ``TypeError`` naming ``where`` (what returned it) unless ``pipeline_state`` is what a snapshot keeps: None,
    or a dict of tensors and :func:`check_plain` values. What :func:`encode_snapshot` checks, without copying."""
    import torch

    if pipeline_state is None:
        return
    if not isinstance(pipeline_state, dict):
        raise TypeError(f"{where} returned {type(pipeline_state).__name__}, expected a "
                        "dict (name -> tensor or JSON-able value) or None")
    for name, value in pipeline_state.items():
        if not isinstance(name, str):  # a snapshot gives every name back as a str
            raise TypeError(f"{where} has the key {name!r}, a {type(name).__name__}, which a snapshot gives back as "
                            "a str")
        if not isinstance(value, torch.Tensor):
            check_plain(value, f"{where}[{name!r}]")


def decode_snapshot(tensors: dict[str, torch.Tensor],
                    metadata: dict[str, Any]) -> tuple[KVSnapshot, dict[str, Any] | None, int]:
    """The inverse of :func:`encode_snapshot`; ``ValueError`` for what it cannot have written."""
    from ardiff_cli.runtime.kv.state import KVSnapshot

    pipeline = metadata.get("pipeline")
    kv_metadata, num_requests = metadata.get("kv"), metadata.get("num_requests")
    if not isinstance(kv_metadata, dict) or not isinstance(num_requests, int) or not (
            pipeline is None or isinstance(pipeline, dict) and isinstance(pipeline.get("values"), dict)
            and isinstance(pipeline.get("tensors"), list)):
        raise ValueError("the snapshot's metadata is malformed (kv, pipeline, num_requests)")
    kv = KVSnapshot({k[3:]: t for k, t in tensors.items() if k.startswith("kv/")}, kv_metadata)
    state = None
    if pipeline is not None:
        names = sorted(k[len("pipeline/"):] for k in tensors if k.startswith("pipeline/"))
        if names != sorted(pipeline["tensors"]):
            raise ValueError(f"the snapshot's pipeline tensors are {names}, its metadata lists "
                             f"{sorted(pipeline['tensors'])}")
        # copies: the pipeline keeps them for the session's life, and a tensor read from a snapshot file is a view of
        # the whole file's mapping, which kept the deleted file's disk space taken as long as the session lived
        state = {**pipeline["values"], **{name: tensors[f"pipeline/{name}"].clone() for name in names}}
    stray = [k for k in tensors if not k.startswith(("kv/", "pipeline/"))]
    if stray:
        raise ValueError(f"the snapshot holds tensors it cannot have written: {stray}")
    return kv, state, num_requests
