"""bench/gpu.py in its --quick mode (tiny shapes, CPU): the comparison and the profile print the JSON the docs
quote. No assertion on speed (the figures mean something only on a GPU, at full size)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import run_bench

pytestmark = pytest.mark.slow


def _lines(stdout: str) -> list[dict]:
    return [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]


def test_the_comparison_runs_both_loops_and_prints_their_ratio(tmp_path):
    r = run_bench("gpu.py", "--quick", "--only", "hand:dit-s-eager", "gt:dit-s-eager", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    *rows, summary = _lines(r.stdout)
    assert [next(iter(row)) for row in rows] == ["hand:dit-s-eager", "gt:dit-s-eager"]  # --only's runner:model-mode
    ratio = summary["ratios"]["dit-s-eager"]["hand_over_gentrain_speed"]
    assert math.isfinite(ratio) and ratio > 0
    assert json.loads((tmp_path / "gpu.json").read_text())["ratios"] == summary["ratios"]


def test_the_profile_compares_the_two_steps_operator_by_operator(tmp_path):
    r = run_bench("gpu.py", "--quick", "--profile", "dit-s-eager", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    (report,) = _lines(r.stdout)
    for side in ("hand", "gt"):
        s = report[side]
        assert s["device"] == "cpu" and s["wall_ms_per_step"] > 0 and 0 < s["kernel_ms_per_step"]
        assert s["launches_per_step"] > 0 and "idle_ms_per_step" in s
    # The same model and optimizer: their matmuls appear on both sides, once per step each as often.
    excess = report["excess_ms_per_step"]
    assert excess and all(len(v) == 3 for v in excess.values())
    full = json.loads((tmp_path / "profile-dit-s-eager.json").read_text())
    assert full["hand"]["kernels"]["aten::mm"][1] == full["gt"]["kernels"]["aten::mm"][1] > 0
