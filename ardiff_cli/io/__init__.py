"""Episode files and run outputs.

Public helpers for writing episodes in the format ``ardiff rollout`` reads::

    from ardiff_cli.io import write_episode, write_step, end_episode, read_step

Submodules import numpy/safetensors lazily, so importing this package is cheap.
"""

from __future__ import annotations

from ardiff_cli.io.episode import END_MARKER, METADATA_FILE
from ardiff_cli.io.step_file import RawStep, load_step as read_step
from ardiff_cli.io.writer import end_episode, write_episode, write_step

__all__ = ["END_MARKER", "METADATA_FILE", "RawStep", "end_episode", "read_step", "write_episode", "write_step"]
