"""A small DreamZero config and its episodes for in-process rollouts (typer's CliRunner) in several test files."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from ardiff_cli.app import app
from ardiff_cli.io import write_episode
from ardiff_cli.io.demo import demo_step

runner = CliRunner()
FAST_CONFIG = """\
pipeline: dreamzero
model: {preset: tiny, num_inference_steps: 1, guidance_scale: 1.0}
runtime: {device: cpu, session_capacity: 2}
"""


def write_fast_data(root: Path, episodes: dict[str, int]) -> Path:
    """``root/fast.yaml`` and ``root/eps/<name>`` with that many demo steps each; returns ``root``."""
    from pipelines.dreamzero import observation_schema

    (root / "fast.yaml").write_text(FAST_CONFIG)
    for i, (name, n) in enumerate(episodes.items()):
        steps = [demo_step(observation_schema(), (16, 16), i, s, 1 if s == 0 else 4) for s in range(n)]
        write_episode(root / "eps" / name, steps, prompt=f"task {name}")
    return root


def rollout(data: Path, out: Path, *extra: str):
    return runner.invoke(app, ["rollout", str(data / "fast.yaml"), str(data / "eps"), "--out", str(out),
                               "--no-warmup", "--format", "plain", *extra])
