"""bench/dit.py runs: its --quick mode prints the JSON the docs quote, every figure finite and positive.

No assertion on speed: the figures are only meaningful from the full bench on a quiet machine."""

from __future__ import annotations

import json
import math

import pytest
from conftest import run_bench

VARIANTS = {"handwritten", "gentrain", "gentrain_cached"}
QUARTILES = {"median", "q1", "q3"}


def _positive(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_the_dit_bench_quick_mode_prints_finite_positive_figures():
    r = run_bench("dit.py", "--quick")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["benchmark"] == "dit" and out["quick"] is True
    assert set(out["median_step_seconds"]) == set(out["pooled_median_step_seconds"]) == VARIANTS
    figures = [*out["pooled_median_step_seconds"].values(), out["encode_share_of_handwritten_step"]]
    figures.append(out["cache_fill_median_step_seconds"])
    for summary in [
        *out["median_step_seconds"].values(),
        out["handwritten_encode_seconds"],
        out["handwritten_over_gentrain"],
        out["gentrain_cached_speedup"],
    ]:
        assert set(summary) == QUARTILES, summary
        figures += summary.values()
    assert all(_positive(v) for v in figures), figures
    # The cached runs read every posterior from the cache the fill run wrote.
    assert out["cache"]["fill_run"]["misses"] > 0 and out["cache"]["fill_run"]["hits"] == 0
    assert out["cache"]["measured_runs"]["misses"] == 0 and out["cache"]["measured_runs"]["hits"] > 0
    assert out["setup"]["dit"]["parameters"] > 0 and out["setup"]["autoencoder"]["encoder_parameters"] > 0
