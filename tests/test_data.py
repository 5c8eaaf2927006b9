"""Datasets: the built-in digits, image folders, corrupt files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli, tiny
from PIL import Image

from trainer.data.datasets import DigitsDataset, ImageFolderDataset, load_digits_arrays


def test_builtin_digits_are_the_uci_set():
    images, labels = load_digits_arrays()
    assert images.shape == (1797, 8, 8) and images.max() == 16
    assert sorted(set(labels.tolist())) == list(range(10))
    ds = DigitsDataset(16)
    img, label, extras = ds.load(0, aug_seed=0, flip=False)
    assert extras == {
        "caption": f"a handwritten {['zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine'][label]}"
    }
    assert img.shape == (1, 16, 16) and -1 <= img.min() and img.max() <= 1
    assert label == 0


def make_folder(root, n=10, size=20):
    rng = np.random.default_rng(0)
    for cls in ("cats", "dogs"):
        (root / cls).mkdir(parents=True)
        for i in range(n // 2):
            arr = rng.integers(0, 255, (size, size + 6, 3), dtype=np.uint8)
            ext = ["png", "jpg", "webp"][i % 3]
            Image.fromarray(arr).save(root / cls / f"{i}.{ext}")


def test_image_folder_is_recursive_with_labels_resize_and_crop(tmp_path):
    make_folder(tmp_path)
    Image.fromarray(np.zeros((30, 30), dtype=np.uint8)).save(tmp_path / "cats" / "gray.PNG")
    (tmp_path / "notes.txt").write_text("not an image")
    ds = ImageFolderDataset(str(tmp_path), image_size=8, channels=3)
    assert len(ds) == 11
    assert ds.num_classes == 2
    for i in range(len(ds)):
        img, label = ds.load(i, aug_seed=0, flip=False)
        assert img.shape == (3, 8, 8)
        assert label in (0, 1)


@pytest.mark.slow
def test_corrupt_image_is_skipped_counted_and_reported_once(tmp_path):
    data = tmp_path / "imgs"
    make_folder(data, n=6)
    (data / "cats" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    (data / "dogs" / "truncated.jpg").write_bytes((data / "dogs" / "1.jpg").read_bytes()[:40])
    # 8 files, batch 8, 3 steps: every step sees both bad files once.
    args = tiny(
        tmp_path,
        "data.source=folder",
        f"data.path={data}",
        "data.channels=3",
        "data.val_fraction=0",
        "model.num_classes=2",
        max_steps=3,
    )
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("skipping unreadable image") == 2, r.stderr
    assert "broken.png" in r.stderr and "truncated.jpg" in r.stderr
    doc = json.loads((tmp_path / "run" / "checkpoints" / "step-000000003" / "trainer.json").read_text())
    assert doc["progress"]["skipped_samples"] == 6
