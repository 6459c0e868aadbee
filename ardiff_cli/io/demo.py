"""The demo episodes ``ardiff rollout`` uses when given no EPISODE: synthetic, deterministic, cached.

For any pipeline schema: camera fields get frames of coloured shapes moving
over a gradient, numeric fields get smooth trajectories, each episode gets a
prompt. They are generated once into ``$ARDIFF_CACHE_DIR/demo`` (default
``~/.cache/ardiff/demo``), in a temporary folder renamed into place, so a
crash or a concurrent run never leaves a half-written demo set. The set lists
its files with their sizes (``.manifest.json``); one whose files no longer
match it (a file cut short, deleted or added) is built again, and replaces
it unless a concurrent run replaced it first.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ardiff_cli.runtime.errors import (ConfigError, WriteHint, as_typed, expand_home, file_size_hint,
                                      link_to_nothing_on, not_a_folder)
from ardiff_cli.runtime.observation import ObservationField, ObservationSchema

DEMO_VERSION = 1  # bump when the generated content changes
DEMO_STEPS = (6, 5, 7)  # steps per demo episode (5-8, deterministic)
DEMO_PROMPTS = ("pick up the red cube", "push the blue ball to the left", "open the green drawer")
_COLORS = ((220, 50, 47), (38, 139, 210), (133, 153, 0), (181, 137, 0))
CACHE_ENV = "ARDIFF_CACHE_DIR"
MANIFEST = ".manifest.json"  # in a demo set: {"files": {relative path: size in bytes}} of every other file in it


def cache_dir() -> Path:
    """ardiff's cache folder (demo episodes, default checkpoints): $ARDIFF_CACHE_DIR, else ~/.cache/ardiff."""
    root = os.environ.get(CACHE_ENV)
    hint = f"set {CACHE_ENV} to a writable folder (or HOME to this user's home folder)"
    if root:
        return Path(expand_home(root, f"{CACHE_ENV} {root}", hint=hint))
    return Path(expand_home("~/.cache/ardiff", f"ardiff's cache folder (~/.cache/ardiff, as {CACHE_ENV} is not set)",
                            hint=hint))


def is_image_field(f: ObservationField) -> bool:
    return f.dtype == "uint8" and any(len(s) >= 3 and s[-1] == 3 for s in f.shapes)


def concrete_shape(f: ObservationField, image_size: tuple[int, int], num_frames: int = 1) -> tuple[int, ...]:
    """An accepted shape with free sizes filled: image height/width, ``num_frames`` for a leading time axis.

    One frame prefers a shape without a time axis ((H, W, 3) over (T, H, W, 3)); more frames need one.
    """
    if is_image_field(f):
        shapes = sorted((s for s in f.shapes if len(s) >= 3 and s[-1] == 3), key=len)
        shape = list(shapes[0] if num_frames == 1 else shapes[-1])
        for axis, size in ((-3, image_size[0]), (-2, image_size[1])):
            if shape[axis] is None:
                shape[axis] = size
        if len(shape) > 3 and shape[0] is None:
            shape[0] = num_frames
    else:
        shape = list(f.shapes[0])
    return tuple(1 if d is None else d for d in shape)


def frames_per_step(model_config: Any, step: int) -> int:
    """Camera frames in demo step ``step``: pipelines with ``frames_per_request`` (DreamZero: 4) take one
    frame on a session's first request and that many afterwards; others take one frame per step."""
    later = getattr(model_config, "frames_per_request", 1)
    return 1 if step == 0 or not isinstance(later, int) else later


def _frames(shape: tuple[int, ...], episode: int, step: int, camera: int) -> Any:
    """(..., H, W, 3) uint8: a gradient background and a square moving along a per-episode path."""
    import numpy as np

    height, width = shape[-3], shape[-2]
    lead = shape[:-3]
    count = int(np.prod(lead)) if lead else 1
    yy, xx = np.mgrid[0:height, 0:width]
    out = np.empty((count, height, width, 3), np.uint8)
    side = max(2, min(height, width) // 4)
    color = np.array(_COLORS[(episode + camera) % len(_COLORS)], np.uint8)
    for i in range(count):
        t = step * count + i
        out[i, ..., 0] = (xx * 160 // max(1, width - 1) + 20 * camera).astype(np.uint8)
        out[i, ..., 1] = (yy * 160 // max(1, height - 1)).astype(np.uint8)
        out[i, ..., 2] = (60 + 40 * episode) % 256  # any episode index: demo_step makes test data too
        angle = 0.5 * t + 2.0 * episode
        cy = int((height - side) * (0.5 + 0.4 * np.sin(angle)))
        cx = int((width - side) * (0.5 + 0.4 * np.cos(angle * (1 + 0.3 * camera))))
        out[i, cy:cy + side, cx:cx + side] = color
    return out.reshape(shape)


def _trajectory(shape: tuple[int, ...], dtype: str, episode: int, step: int, field_index: int) -> Any:
    import numpy as np

    count = int(np.prod(shape)) if shape else 1
    phase = np.arange(count) * 0.7 + episode * 1.3 + field_index
    values = 0.5 * np.sin(0.4 * step + phase)
    if np.dtype(dtype).kind in "iu":
        values = (values > 0).astype(dtype)
    return values.astype(dtype).reshape(shape)


def demo_step(schema: ObservationSchema, image_size: tuple[int, int], episode: int, step: int,
              num_frames: int = 1) -> dict[str, Any]:
    arrays: dict[str, Any] = {}
    cameras = 0
    for index, f in enumerate(schema.fields):
        shape = concrete_shape(f, image_size, num_frames)
        if is_image_field(f):
            arrays[f.name] = _frames(shape, episode, step, cameras)
            cameras += 1
        else:
            arrays[f.name] = _trajectory(shape, f.dtype, episode, step, index)
    return arrays


def demo_key(pipeline_name: str, schema: ObservationSchema, image_size: tuple[int, int], frames: tuple[int, ...]) -> str:
    """A folder name that changes whenever the generated content would."""
    text = repr((DEMO_VERSION, DEMO_STEPS, schema, tuple(image_size), frames))
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    from ardiff_cli.io.episode import safe_name

    return f"{safe_name(pipeline_name)}-{image_size[0]}x{image_size[1]}-{digest}"


def ensure_demo_episodes(pipeline_name: str, schema: ObservationSchema, image_size: tuple[int, int], *,
                         model_config: Any = None, root: Path | None = None,
                         warn: Callable[[str], None] = lambda message: None) -> Path:
    """The folder of demo episodes for this schema, generated on first use. Returns the set's folder.

    A set whose files differ from its manifest is built again, and ``warn`` told what differed. A cache folder
    that cannot be written (a file, no permission, a full disk) is a ``ConfigError``, as for the default
    checkpoints in the same cache.
    """
    from ardiff_cli.io.atomic import remove_temporaries

    frames = tuple(frames_per_step(model_config, step) for step in range(max(DEMO_STEPS)))
    base = (root or cache_dir()) / "demo"
    target = base / demo_key(pipeline_name, schema, image_size, frames)
    remove_temporaries(base, r".+-\d+x\d+-[0-9a-f]{10}", r"(?:\.old)?")  # sets a killed run was building
    try:
        found = target.is_dir()
    except OSError as exc:  # a demo folder another user made and this one cannot enter (a shared cache, umask 077)
        raise ConfigError(f"cannot look at the demo episodes in {as_typed(base)}: {exc.strerror or exc}",
                          hint=f"set {CACHE_ENV} to a folder this user can read and write") from None
    if found:
        damage = _damage(target)
        if damage is None:
            return target
        warn(f"the demo episodes in {as_typed(target)} were damaged ({damage}): building them again")
    try:
        _generate(target, schema, image_size, frames)
    except OSError as exc:
        raise cache_write_error("the demo episodes", base, exc) from None
    return target


def cache_write_error(what: str, path: Path, exc: OSError) -> ConfigError:
    """``cannot write WHAT to PATH: ...`` for the cache folder, naming a link on its path that leads nowhere
    ($ARDIFF_CACHE_DIR on a scratch disk not mounted) or a file there, of which mkdir's "File exists" read as a file
    in the way of PATH itself. Paths are written as typed (:func:`as_typed`): a cache folder named ``~`` in the current
    folder (``ARDIFF_CACHE_DIR=./~/x``) was named ``~/x``, which, pasted, is the home folder."""
    dangling = link_to_nothing_on(path)
    if dangling is not None:
        return ConfigError(f"cannot write {what} to {as_typed(path)}: {as_typed(dangling[0])} is {dangling[1]}",
                           hint=f"mount the disk it links to (or fix the link), or set {CACHE_ENV} to a writable "
                           "folder")
    in_the_way = not_a_folder(path.parent)
    problem = (f"{as_typed(in_the_way[0])} is {in_the_way[1]}, not a folder" if in_the_way is not None
               else exc.strerror or exc)
    hint = f"set {CACHE_ENV} to a writable folder"
    if exc.errno == errno.EFBIG:  # past this process's `ulimit -f`: a file in any other folder is refused alike
        hint = file_size_hint(WriteHint(hint, "run the same command again"))
    return ConfigError(f"cannot write {what} to {as_typed(path)}: {problem}", hint=hint)


def _generate(target: Path, schema: ObservationSchema, image_size: tuple[int, int], frames: tuple[int, ...]) -> None:
    """Write the demo set into a temporary folder next to ``target``, then rename it into place."""
    from ardiff_cli.io.atomic import DIR_MODE
    from ardiff_cli.io.writer import write_episode

    base = target.parent
    base.mkdir(parents=True, exist_ok=True)
    # Absolute: under ARDIFF_CACHE_DIR=./~/x, ``base`` is Path("~/x/demo"), which write_episode, as the command
    # line does, reads as the home folder's ~/x/demo (the steps went there, and here an empty set).
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=base)).absolute()
    os.chmod(tmp, DIR_MODE)  # mkdtemp makes it 0700; the set is readable as any folder the user makes
    try:
        for episode, num_steps in enumerate(DEMO_STEPS):
            steps = [demo_step(schema, image_size, episode, step, frames[step]) for step in range(num_steps)]
            meta = {schema.prompt_key: DEMO_PROMPTS[episode % len(DEMO_PROMPTS)]} if schema.prompt_key else None
            write_episode(tmp / f"demo_{episode}", steps, metadata=meta)
        (tmp / MANIFEST).write_text(json.dumps({"files": _sizes(tmp)}, indent=1, sort_keys=True), encoding="utf-8")
        if target.is_dir() and _damage(target) is not None:  # damaged still: not a set a concurrent run just made
            try:
                os.rename(target, f"{tmp}.old")  # moved aside, then deleted
            except FileNotFoundError:  # a concurrent run moved it first
                pass
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a concurrent run that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(f"{tmp}.old", ignore_errors=True)


def _sizes(folder: Path) -> dict[str, int]:
    """{path relative to ``folder``: size} of every file under it but the manifest."""
    return {p.relative_to(folder).as_posix(): p.stat().st_size
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}


def _damage(target: Path) -> str | None:
    """How the demo set ``target`` differs from its manifest (the first difference), or None when it does not."""
    from ardiff_cli.io.atomic import parse_json

    try:
        listed = parse_json((target / MANIFEST).read_text(encoding="utf-8"))["files"]
        found = _sizes(target)
    except FileNotFoundError:
        return None  # a set made before ardiff wrote a manifest: used as it is, as it was then
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"cannot read it: {exc}"
    if not isinstance(listed, dict):
        return f"{MANIFEST} holds no file list"
    if not listed:  # a set holds files: an older ardiff wrote this one's steps elsewhere (ARDIFF_CACHE_DIR=./~/x)
        return f"{MANIFEST} lists no files"
    for name in sorted(set(listed) | set(found)):
        if name not in found:
            return f"{name} is missing"
        if name not in listed:
            return f"{name} was not in it"
        if found[name] != listed[name]:
            return f"{name} has {found[name]} bytes, {listed[name]} when built"
    return None
