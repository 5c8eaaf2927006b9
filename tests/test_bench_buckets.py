"""bench/buckets.py's figures of what each loader trains of an image (the steps/s it measures are in
docs/benchmarks.md): the crop loss is computed with the loaders' own cover size."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import buckets as bench  # noqa: E402 (bench/ is not a package)


def test_the_crop_loss_is_the_share_of_the_resized_image_the_crop_leaves_out():
    sizes = [(90, 160), (160, 90), (120, 120)]  # a 16:9 landscape, its portrait, a square
    square = bench.crop_figures(sizes, [(45, 45)] * 3)
    # A 16:9 image covering a square keeps 9/16 of its width (45 of 80): 7/16 lost; the square loses nothing.
    assert square == {
        "padding": 0.0,
        "crop_loss_mean": pytest.approx(2 * 7 / 16 / 3, abs=1e-4),
        "crop_loss_max": 0.4375,
    }
    exact = bench.crop_figures(sizes, [(45, 80), (80, 45), (60, 60)])  # each in a bucket of its own ratio
    assert exact == {"padding": 0.0, "crop_loss_mean": 0.0, "crop_loss_max": 0.0}


def test_the_folder_cycles_through_the_ratios(tmp_path):
    sizes = bench.make_images(tmp_path, len(bench.RATIOS))
    assert [round(h / w, 2) for h, w in sizes] == [round(h / w, 2) for h, w in bench.RATIOS]
    assert len(list(tmp_path.glob("*.png"))) == len(bench.RATIOS)
