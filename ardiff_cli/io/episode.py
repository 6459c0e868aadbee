"""Episode folders: finding them, listing their step files, reading one step.

An episode is a folder of step files ordered by their step number (the last
integer in the file name: ``step_000012.safetensors`` is step 12)::

    pick_cube/
      episode.yaml              # optional: prompt and other metadata (yaml.safe_load)
      step_000000.safetensors   # observation arrays under the pipeline's schema keys
      step_000001.safetensors   #   (+ "prompt" etc. in the safetensors metadata)
      step_000002.npz           # .npz works too (np.load, allow_pickle=False)
      END                       # optional end marker (what --follow waits for)

Files whose names start with ``.`` or end in ``.tmp``/``.partial`` are
ignored, so a writer can create a step under a temporary name and rename it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ardiff_cli.runtime.errors import ConfigError, ObservationError

STEP_SUFFIXES = (".safetensors", ".npz")
METADATA_FILE = "episode.yaml"
END_MARKER = "END"
_IGNORED_SUFFIXES = (".tmp", ".partial")
_NUMBER = re.compile(r"(\d+)")


@dataclass(frozen=True, slots=True)
class StepFile:
    """One step file of an episode."""

    path: Path
    step: int  # the step number from the file name (ordering key)


@dataclass(slots=True)
class RawStep:
    """What one step file holds, before validation."""

    arrays: dict[str, Any]  # numpy arrays by key
    metadata: dict[str, str]  # safetensors metadata, or 0-d string arrays of an .npz


@dataclass
class EpisodeSource:
    """One episode folder. ``name`` is unique in a run: it is the session id and the output folder name."""

    name: str
    path: Path
    _metadata: dict[str, Any] | None = field(default=None, repr=False)  # episode.yaml, read once

    def scan(self) -> list[StepFile]:
        """The step files present now, in step order; duplicate step numbers are an error."""
        return scan_steps(self.path)

    def has_end_marker(self) -> bool:
        return (self.path / END_MARKER).exists()

    def metadata(self) -> dict[str, Any]:
        """``episode.yaml`` as a mapping ({} when absent); re-read until it exists (it may arrive late)."""
        if self._metadata is None:
            meta_path = self.path / METADATA_FILE
            if not meta_path.exists():
                return {}
            self._metadata = read_episode_yaml(meta_path)
        return self._metadata


def is_step_file(path: Path) -> bool:
    name = path.name
    return (
        path.suffix in STEP_SUFFIXES
        and not name.startswith(".")
        and not name.endswith(_IGNORED_SUFFIXES)
    )


def step_number(path: Path) -> int:
    """The last integer in the file stem; a name without one is an error naming the file."""
    numbers = _NUMBER.findall(path.stem)
    if not numbers:
        raise ObservationError(
            f"{path}: step file name has no step number",
            hint="name step files by their step, e.g. step_000000.safetensors, step_000001.safetensors, ...",
        )
    return int(numbers[-1])


def scan_steps(folder: Path) -> list[StepFile]:
    steps: dict[int, Path] = {}
    for path in folder.iterdir():
        if not path.is_file() or not is_step_file(path):
            continue
        number = step_number(path)
        if number in steps:
            raise ObservationError(
                f"{folder}: two files for step {number}: {steps[number].name} and {path.name}",
                hint="keep one file per step",
            )
        steps[number] = path
    return [StepFile(path=steps[n], step=n) for n in sorted(steps)]


def _holds_episode(folder: Path) -> bool:
    if (folder / METADATA_FILE).exists() or (folder / END_MARKER).exists():
        return True
    children = list(folder.iterdir())
    return any(p.is_file() and is_step_file(p) for p in children) or not any(p.is_dir() for p in children)


def discover_episodes(paths: list[Path]) -> list[EpisodeSource]:
    """Episode folders from the command line: each path is an episode, or a folder of episode folders.

    Names are the folder names, made unique with a numeric suffix when two collide.
    """
    folders: list[Path] = []
    for path in paths:
        if not path.exists():
            raise ConfigError(f"episode folder not found: {path}")
        if not path.is_dir():
            raise ConfigError(
                f"{path}: an EPISODE is a folder of step files, not a file",
                hint="pass the folder that holds the step files",
            )
        if _holds_episode(path):
            folders.append(path)
        else:
            children = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
            folders.extend(children)
    names: dict[str, int] = {}
    episodes = []
    for folder in folders:
        base = folder.resolve().name or "episode"
        count = names.get(base, 0)
        names[base] = count + 1
        episodes.append(EpisodeSource(name=base if count == 0 else f"{base}-{count + 1}", path=folder))
    return episodes


def read_episode_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ObservationError(f"{path}: cannot read episode metadata: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ObservationError(f"{path}: episode metadata must be a YAML mapping, got {type(data).__name__}")
    return data


def load_step(path: Path) -> RawStep:
    """Read one step file; an unreadable file is an ``ObservationError`` naming it."""
    if path.suffix == ".safetensors":
        return _load_safetensors(path)
    if path.suffix == ".npz":
        return _load_npz(path)
    raise ObservationError(f"{path}: unsupported step file type {path.suffix!r}; use .safetensors or .npz")


def _load_safetensors(path: Path) -> RawStep:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            metadata = dict(f.metadata() or {})
            arrays = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for corrupt files
        raise ObservationError(f"{path}: cannot read safetensors file: {exc}",
                               hint="was the file written completely? (write a temporary name, then rename)") from None
    return RawStep(arrays=arrays, metadata=metadata)


def _load_npz(path: Path) -> RawStep:
    import zipfile

    import numpy as np

    arrays: dict[str, Any] = {}
    metadata: dict[str, str] = {}
    try:
        with np.load(path, allow_pickle=False) as npz:
            for key in npz.files:
                value = npz[key]
                if value.dtype.kind == "U" and value.ndim == 0:
                    metadata[key] = str(value)  # text (the prompt) stored as a 0-d string array
                else:
                    arrays[key] = value
    except ValueError as exc:
        raise ObservationError(f"{path}: cannot read .npz without pickle: {exc}",
                               hint="store plain numeric arrays; put text in episode.yaml") from None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise ObservationError(f"{path}: cannot read .npz file: {exc}") from None
    return RawStep(arrays=arrays, metadata=metadata)
