"""Preview images: a PNG encoder (zlib + struct, no imaging library) and the observed/predicted strip."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import Any


def encode_png(image: Any) -> bytes:
    """PNG bytes of a uint8 (H, W, 3) RGB or (H, W) grey image."""
    import numpy as np

    image = np.ascontiguousarray(image)
    if image.dtype != np.uint8 or image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] != 3):
        raise ValueError(f"expected a uint8 (H, W, 3) or (H, W) image, got {image.dtype} {image.shape}")
    height, width = image.shape[:2]
    color_type = 2 if image.ndim == 3 else 0
    # Each scanline starts with filter byte 0 (None).
    rows = np.concatenate([np.zeros((height, 1), np.uint8), image.reshape(height, -1)], axis=1)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
            + chunk(b"IEND", b""))


def as_rgb_frame(array: Any) -> Any | None:
    """The last frame of an image-like uint8 array ((H, W, 3), (T, H, W, 3), ...), or None if it is not one."""
    import numpy as np

    array = np.asarray(array)
    if array.dtype != np.uint8 or array.ndim < 3 or array.shape[-1] != 3:
        return None
    while array.ndim > 3:
        array = array[-1]
    return array


# A preview stays small enough for any image viewer and for memory, however long the episode and large its frames:
# at most MAX_COLUMNS steps, each frame at most MAX_SIDE pixels a side (about 16,500 x 500 pixels, 25 MB in memory).
MAX_COLUMNS = 64
MAX_SIDE = 256


def evenly_spaced(count: int, limit: int = MAX_COLUMNS) -> list[int]:
    """Indices of at most ``limit`` of ``count`` items, evenly spaced, the first and the last included."""
    if count <= limit:
        return list(range(count))
    if limit == 1:
        return [count - 1]
    return [round(i * (count - 1) / (limit - 1)) for i in range(limit)]


def _resize_nearest(image: Any, height: int, width: int) -> Any:
    import numpy as np

    rows = np.arange(height) * image.shape[0] // height
    cols = np.arange(width) * image.shape[1] // width
    return image[rows][:, cols]


def preview_strip(observed: Sequence[Any], predicted: Sequence[Any | None], *, gap: int = 2,
                  min_height: int = 0) -> Any:
    """One column per step: the observed frame on top, the predicted frame below (grey when missing).

    Frames are scaled (nearest) to the largest frame, up by a whole factor to ``min_height`` pixels, then down
    to at most ``MAX_SIDE`` pixels a side, keeping that frame's proportions (at least 1 pixel).
    """
    import numpy as np

    frames = [f for f in (*observed, *predicted) if f is not None]  # one at least: the caller checks
    height = max(f.shape[0] for f in frames)
    width = max(f.shape[1] for f in frames)
    scale = max(1, -(-min_height // height))
    height, width = height * scale, width * scale
    if max(height, width) > MAX_SIDE:  # a 1x1000 frame scaled to 96 pixels high was a 96,000-pixel-wide tile
        longest = max(height, width)
        height, width = max(1, height * MAX_SIDE // longest), max(1, width * MAX_SIDE // longest)
    columns = max(len(observed), len(predicted))
    strip = np.full((2 * height + gap, columns * (width + gap) - gap, 3), 32, np.uint8)
    for row, frames_row in enumerate((observed, predicted)):
        for col, frame in enumerate(frames_row):
            if frame is None:
                continue
            y, x = row * (height + gap), col * (width + gap)
            strip[y:y + height, x:x + width] = _resize_nearest(frame, height, width)
    return strip
