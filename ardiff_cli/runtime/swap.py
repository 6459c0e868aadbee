"""Snapshots of LRU-evicted sessions on disk, so their next request restores them instead of replaying history.

One safetensors file per swapped session (tensors, and string metadata holding JSON), named by a hash of the
session id, written under a temporary name and renamed: a reader never sees half a file. The store keeps a byte
budget: making room drops the least recently swapped snapshots first, and a snapshot larger than the whole budget
is not written. Nothing here is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ardiff_cli.runtime.capacity import as_int, parse_bytes
from ardiff_cli.runtime.errors import ConfigError, shown

if TYPE_CHECKING:  # torch-free at import: the CLI clears a run's swap folder without loading anything
    import torch

    from ardiff_cli.runtime.kv.state import KVSnapshot

FORMAT = "ardiff-swap-1"  # metadata["format"]; bump when the layout of a snapshot file changes
HEADER_BYTES_PER_TENSOR = 128  # safetensors header entry (name, dtype, shape, offsets): an upper bound for planning
# The names SwapStore gives its files (path_for) and their temporary names while written (write).
SNAPSHOT_NAME = re.compile(r"[0-9a-f]{32}\.safetensors|\.[0-9a-f]{32}\.safetensors\.[0-9a-f]{8}\.tmp")


def check_swap_arguments(swap_dir: Any, swap_space: Any, *, where: str) -> tuple[Path | None, int | None]:
    """``swap_dir`` and ``swap_space`` of the engine or runner as (folder, bytes), or a ``ConfigError`` naming the
    argument: bytes >= 0 or a byte size such as ``"2GiB"`` (0: no swapping; None: the default), a folder for any."""
    hint = "e.g. swap_dir='runs/swap', swap_space=2 << 30 (or '2GiB'); leave both out for no swapping"
    if swap_dir is not None and not isinstance(swap_dir, (str, os.PathLike)):
        raise ConfigError(f"{where}: swap_dir must be a folder path (str or os.PathLike) or None, got "
                          f"{shown(swap_dir)}", hint=hint)
    if isinstance(swap_space, str):
        try:
            swap_space = parse_bytes(swap_space, zero_ok=True)
        except ConfigError as exc:
            raise ConfigError(f"{where}: swap_space: {exc}", hint=exc.hint) from None
    elif swap_space is not None:
        number = as_int(swap_space)  # numpy's integers too, as memory_budget takes them; never a bool
        if number is None or number < 0:
            raise ConfigError(f"{where}: swap_space must be a number of bytes >= 0 (0: no swapping) or None, got "
                              f"{shown(swap_space)}", hint=hint)
        swap_space = number
    if swap_dir is None and swap_space:
        raise ConfigError(f"{where}: swap_space={swap_space} without swap_dir: nothing would be swapped",
                          hint="give the folder for the snapshots too: swap_dir='runs/swap'")
    return None if swap_dir is None else Path(swap_dir), swap_space


def free_disk_bytes(directory: Path) -> int:
    """Free bytes of the filesystem ``directory`` is (or would be) on."""
    path = Path(directory).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def remove_snapshot_files(directory: Path) -> None:
    """Delete the snapshot files any store wrote in ``directory`` (a killed process's too), then the folder if
    nothing else is in it: a folder that only shares the name keeps what ardiff did not write."""
    try:
        for path in Path(directory).iterdir():
            if SNAPSHOT_NAME.fullmatch(path.name):
                path.unlink(missing_ok=True)
        Path(directory).rmdir()
    except OSError:
        pass  # no such folder, or it holds something that is not ours


class SwapStore:
    """Swapped sessions' snapshot files in ``directory`` (created on the first write), at most ``budget_bytes``."""

    def __init__(self, directory: str | Path, budget_bytes: int) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ValueError(f"swap budget_bytes must be a positive integer, got {budget_bytes!r}")
        self.directory = Path(directory)  # where the files go; created lazily, removed by clear()
        self.budget_bytes = budget_bytes  # the most bytes of snapshot files at once
        # session id -> (file, bytes), least recently swapped first: the order in which room is made.
        self._files: OrderedDict[str, tuple[Path, int]] = OrderedDict()
        self._nbytes = 0  # sum of the files' bytes, kept as one int so other threads read it whole
        self.num_dropped = 0  # snapshots deleted to make room for newer ones (their sessions are rebuilt otherwise)
        self.refused_bytes = 0  # the file size of the last snapshot refused as larger than the whole budget
        # Hashed into every file name: stores sharing a folder (two engines, two processes) never touch each
        # other's files, even for one session id.
        self._salt = secrets.token_bytes(16)

    @property
    def num_snapshots(self) -> int:
        return len(self._files)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def has(self, session_id: str) -> bool:
        return session_id in self._files

    def path_for(self, session_id: str) -> Path:
        """The file of ``session_id``: a hash (salted per store), so any session id (slashes, control characters) is
        a safe name."""
        digest = hashlib.sha256(self._salt + session_id.encode("utf-8", "surrogatepass")).hexdigest()
        return self.directory / f"{digest[:32]}.safetensors"

    def write(self, session_id: str, tensors: dict[str, torch.Tensor], metadata: dict[str, Any]) -> int | None:
        """Write the snapshot of ``session_id`` (replacing an older one); its bytes, or None when it is larger than
        the whole budget (not written; its bytes in ``refused_bytes``). Older snapshots are dropped first to make
        room. An ``OSError`` (disk full, folder not writable) leaves no file of it behind and is raised."""
        self.discard(session_id)
        header = json.dumps({"format": FORMAT, "session_id": session_id, **metadata})
        planned = 8 + len(header) + sum(HEADER_BYTES_PER_TENSOR + len(k) + t.numel() * t.element_size()
                                        for k, t in tensors.items())
        if planned > self.budget_bytes:
            self.refused_bytes = planned
            return None
        self._make_room(planned)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(session_id)
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        from safetensors.torch import save_file

        try:
            save_file({k: t.contiguous() for k, t in tensors.items()}, str(temporary),
                      metadata={"ardiff_swap": header})
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        size = path.stat().st_size
        self._files[session_id] = (path, size)
        self._nbytes += size
        if self._nbytes > self.budget_bytes:  # the header took more than planned: older ones go, else this one
            self._make_room(0, keep=session_id)
            if self._nbytes > self.budget_bytes:
                self.discard(session_id)
                self.refused_bytes = size
                return None
        return size

    def _make_room(self, needed: int, *, keep: str | None = None) -> None:
        for session_id in [s for s in self._files if s != keep]:
            if self._nbytes + needed <= self.budget_bytes:
                return
            self.discard(session_id)
            self.num_dropped += 1

    def read(self, session_id: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The tensors and metadata of ``session_id``'s snapshot; raises ``OSError`` or ``ValueError`` for a
        missing, unreadable or corrupt file, or one that is not this session's."""
        path, _ = self._files[session_id]
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                header = (f.metadata() or {}).get("ardiff_swap")
                tensors = {key: f.get_tensor(key) for key in f.keys()}
        except OSError:
            raise
        except Exception as exc:  # safetensors' own errors: a truncated or overwritten file
            raise ValueError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
        try:
            metadata = json.loads(header) if header is not None else None
        except ValueError:
            metadata = None
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
            raise ValueError(f"{path}: not an ardiff swap snapshot (format {FORMAT} expected)")
        if metadata.get("session_id") != session_id:
            raise ValueError(f"{path}: holds session {metadata.get('session_id')!r}, expected {session_id!r}")
        return tensors, metadata

    def discard(self, session_id: str) -> bool:
        """Delete the snapshot of ``session_id``, if any; whether there was one."""
        entry = self._files.pop(session_id, None)
        if entry is None:
            return False
        self._nbytes -= entry[1]
        try:
            entry[0].unlink(missing_ok=True)
        except OSError:
            pass  # forgotten either way; the folder goes when the run ends
        return True

    def clear(self) -> None:
        """Delete every snapshot, and the folder when nothing else is in it."""
        for session_id in list(self._files):
            self.discard(session_id)
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
    import torch

    tensors = {f"kv/{key}": t for key, t in kv.tensors.items()}
    pipeline = None
    if pipeline_state is not None:
        if not isinstance(pipeline_state, dict):
            raise TypeError(f"{where} returned {type(pipeline_state).__name__}, expected a "
                            "dict (name -> tensor or JSON-able value) or None")
        pipeline = {"tensors": [], "values": {}}
        for name, value in pipeline_state.items():
            if isinstance(value, torch.Tensor):  # a copy of its own: safetensors refuses tensors sharing memory
                tensors[f"pipeline/{name}"] = value.detach().cpu().clone(memory_format=torch.contiguous_format)
                pipeline["tensors"].append(name)
            else:
                check_plain(value, f"{where}[{name!r}]")
                pipeline["values"][name] = value
    return tensors, {"kv": kv.metadata, "pipeline": pipeline, "num_requests": num_requests}


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
        state = {**pipeline["values"], **{name: tensors[f"pipeline/{name}"] for name in names}}
    stray = [k for k in tensors if not k.startswith(("kv/", "pipeline/"))]
    if stray:
        raise ValueError(f"the snapshot holds tensors it cannot have written: {stray}")
    return kv, state, num_requests
