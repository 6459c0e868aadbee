"""The attention benchmark runs and reports its fields. Speed is not checked here."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the repo root on sys.path
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_attention  # noqa: E402

FIELDS = {"id", "paged_ms", "contiguous_ms", "ratio", "target", "passed"}


def check_result(result: dict) -> None:
    assert FIELDS <= set(result)
    assert result["id"] == "attention"
    assert result["target"] == 1.10
    for key in ("paged_ms", "contiguous_ms", "ratio"):
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0
    assert result["passed"] is (result["ratio"] <= result["target"])
    assert result["max_abs_diff"] <= 1e-5  # the paged and contiguous outputs agree


def test_run_quick():
    result = bench_attention.run(quick=True)
    check_result(result)
    assert result["quick"] is True and result["repetitions"] == 2


def test_main_quick_writes_json(tmp_path, capsys):
    path = tmp_path / "attention.json"
    assert bench_attention.main(["--quick", "--json", str(path)]) == 0
    check_result(json.loads(path.read_text()))
    assert "ratio" in capsys.readouterr().out
