"""Bad training data: wrong data.path, malformed .npy sidecars, and a run that would train on nothing.

Every case is a user's or a store's doing, so it must end with a message (exit 2) or a counted skip,
never a traceback (exit 1, which torchrun and Kubernetes retry forever).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import clean_env, run_cli, tiny
from elastic_helpers import standalone
from PIL import Image

from trainer.config import ConfigError
from trainer.data.datasets import ImageFolderDataset, collate
from trainer.engine.progress import MAX_SKIPPED_FILES, MIN_SKIPPED_TO_STOP, TrainProgress

EXTENSIONS = ".png/.jpg/.jpeg/.webp"


def write_images(root: Path, names: list[str], size: int = 12) -> None:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in names:
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / name)


def write_npy(path: Path, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=array.dtype == object)
    path.write_bytes(buf.getvalue())


def folder_run(tmp_path: Path, data: Path, *extra: str, max_steps: int) -> subprocess.CompletedProcess:
    """A tiny ddpm run on an image folder (batch 8, no validation split, so a step of 8 files sees each once)."""
    args = tiny(
        tmp_path,
        "data.source=folder",
        f"data.path={data}",
        "data.channels=3",
        "data.val_fraction=0",
        "checkpoint.every_steps=0",
        *extra,
        max_steps=max_steps,
    )
    return run_cli("train", *args)


def progress_of(tmp_path: Path, step: int) -> dict:
    doc = json.loads((tmp_path / "run" / "checkpoints" / f"step-{step:09d}" / "trainer.json").read_text())
    return doc["progress"]


# ---------------------------------------------------------------- data.path


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "empty", "a file", "no images"])
def test_a_data_path_without_images_exits_2_naming_the_key_the_value_and_the_extensions_read(tmp_path, case):
    path = tmp_path / "data"
    if case == "empty":
        path.mkdir()
    elif case == "a file":
        write_images(tmp_path, ["data.png"])
        path = tmp_path / "data.png"
    elif case == "no images":
        path.mkdir()
        (path / "notes.txt").write_text("not an image")
        (path / "cat.bmp").write_bytes(b"BM")
    r = folder_run(tmp_path, path, max_steps=1)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"data.path={str(path)!r}" in r.stderr, r.stderr[-3000:]
    assert EXTENSIONS in r.stderr, r.stderr[-3000:]


def test_an_image_path_without_images_names_data_image_path(tmp_path):
    from trainer.data import build_splits
    from trainer.registry import load_config

    overrides = ["data.image_ratio=0.25", "data.image_source=folder", f"data.image_path={tmp_path / 'nothing'}"]
    cfg = load_config("moving-digits", overrides, environ={})
    with pytest.raises(ConfigError, match=r"data\.image_path=.*nothing.*no such folder"):
        build_splits(cfg)


# ---------------------------------------------------------------- .npy sidecars


def sidecar_folder(root: Path) -> dict[str, str]:
    """Eight images: four with a 4-float embedding beside them, one without, three with a broken one.
    Returns the broken ones' image names -> what is wrong with their sidecar."""
    names = [f"{i}.png" for i in range(8)]
    write_images(root, names)
    for i in (0, 2, 5, 7):
        write_npy(root / f"{i}.npy", np.full(4, float(i), dtype=np.float32))
    write_npy(root / "1.npy", np.ones(5, dtype=np.float32))  # another length than the first one (0.npy)
    write_npy(root / "3.npy", np.array([{"code": "import os"}], dtype=object))  # pickled: never loaded
    (root / "4.npy").write_bytes((root / "0.npy").read_bytes()[:-3])  # truncated
    # 6.png: no sidecar at all (a zero embedding, as before)
    return {"1.png": "5 values", "3.png": "pickled", "4.png": "could only read"}


def test_malformed_sidecars_skip_their_sample_and_well_formed_ones_load(tmp_path):
    broken = sidecar_folder(tmp_path)
    ds = ImageFolderDataset(str(tmp_path), image_size=8, channels=3)
    loaded = {p.name: ds.load(i, aug_seed=0, flip=False) for i, p in enumerate(ds.files)}
    assert {name for name, item in loaded.items() if item is None} == set(broken)
    for name, why in broken.items():
        assert why in ds.skip_reason([p.name for p in ds.files].index(name))
    assert loaded["0.png"][2]["image_embed"].tolist() == [0.0] * 4
    assert loaded["7.png"][2]["image_embed"].tolist() == [7.0] * 4
    assert "image_embed" not in (loaded["6.png"][2] if len(loaded["6.png"]) > 2 else {})


def test_collate_turns_a_sample_whose_extras_do_not_fit_the_batch_into_a_skipped_slot():
    def item(i: int, embed: list[float]):
        return torch.full((1, 4, 4), float(i)), i, i, i, True, {"image_embed": torch.tensor(embed)}

    batch = collate([item(0, [0.0, 0.0]), item(1, [1.0, 1.0, 1.0]), item(2, [2.0, 2.0])])
    assert batch["valid"].tolist() == [True, False, True]
    assert batch["skipped"] == 1
    assert batch["extras"]["image_embed"].tolist() == [[0.0, 0.0], [0.0, 0.0], [2.0, 2.0]]
    assert batch["images"][1].abs().sum() == 0 and batch["labels"][1] == -1
    assert len(batch["skipped_files"]) == 1 and "image_embed" in batch["skipped_files"][0]


@pytest.mark.slow
def test_a_task_that_ignores_embeddings_trains_past_malformed_sidecars_and_counts_them(tmp_path):
    data = tmp_path / "data"
    broken = sidecar_folder(data)
    r = folder_run(tmp_path, data, "checkpoint.every_steps=2", max_steps=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    for name in broken:
        assert f"{Path(name).stem}.npy" in r.stderr, r.stderr[-3000:]
    assert progress_of(tmp_path, 2)["skipped_samples"] == 2 * len(broken)


# ---------------------------------------------------------------- data.max_skipped_fraction


def corrupt_folder(root: Path, names: list[str]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    good = io.BytesIO()
    Image.fromarray(np.zeros((12, 12, 3), dtype=np.uint8)).save(good, format="PNG")
    for name in names:
        (root / name).write_bytes(good.getvalue()[:30])  # a truncated PNG


@pytest.mark.slow
def test_a_folder_of_unreadable_images_stops_with_exit_2_naming_the_count_the_limit_and_the_files(tmp_path):
    data = tmp_path / "data"
    corrupt_folder(data, [f"bad{i}.png" for i in range(8)])
    r = folder_run(tmp_path, data, max_steps=50)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    # Batch 8, every sample skipped: the 32nd skip (step 4) is the first the rule may act on.
    assert f"data.max_skipped_fraction=0.05: {MIN_SKIPPED_TO_STOP} of the 32 samples consumed by step 4" in r.stderr
    assert "bad0.png" in r.stderr and "bad7.png" in r.stderr
    assert "step=5/" not in r.stderr


@pytest.mark.slow
def test_a_few_unreadable_files_in_a_readable_folder_do_not_stop_the_run(tmp_path):
    data = tmp_path / "data"
    write_images(data, [f"{i}.png" for i in range(15)])
    corrupt_folder(data, ["bad.png"])
    # 1 of 16 files (6%, over the 5% limit) skipped once per 2 steps: 5 skips in 10 steps, too few to tell.
    r = folder_run(tmp_path, data, "checkpoint.every_steps=10", max_steps=10)
    assert r.returncode == 0, r.stderr[-3000:]
    assert progress_of(tmp_path, 10)["skipped_samples"] == 5


@pytest.mark.slow
def test_the_first_unreadable_files_are_remembered_across_a_resume(tmp_path):
    data = tmp_path / "data"
    corrupt_folder(data, [f"old{i}.png" for i in range(8)])
    r = folder_run(tmp_path, data, "data.max_skipped_fraction=1", "checkpoint.every_steps=2", max_steps=2)
    assert r.returncode == 0, r.stderr[-3000:]
    recorded = progress_of(tmp_path, 2)["skipped_files"]
    assert len(recorded) == MAX_SKIPPED_FILES and all("/old" in f for f in recorded), recorded
    # Other bad files under other names (same count, so the same sample order): the report still
    # names the ones found before the resume, and the count goes on from the checkpoint's.
    for i in range(8):
        (data / f"old{i}.png").rename(data / f"new{i}.png")
    r = folder_run(tmp_path, data, max_steps=50)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "32 of the 32 samples consumed by step 4" in r.stderr, r.stderr[-3000:]
    message = r.stderr[r.stderr.index("data.max_skipped_fraction=0.05") :]
    assert all(f in message for f in recorded) and "/new" not in message, message


def test_the_skip_rule_needs_both_the_fraction_and_enough_skips_and_0_stops_at_the_first():
    def progress(limit: float, batch: int = 8) -> TrainProgress:
        return TrainProgress(batch, 1000, 1, 0, max_skipped_fraction=limit)

    p = progress(0.05)
    for _ in range(3):
        p.advance(8, ["x.png (broken)"])
    p.check_skipped()  # 24 of 24: all bad, but fewer skips than the rule needs to tell
    p.advance(8)
    with pytest.raises(ConfigError, match=r"data\.max_skipped_fraction=0\.05: 32 of the 32 samples .* x\.png"):
        p.check_skipped()

    p = progress(0.05, batch=64)
    for _ in range(20):
        p.advance(2)  # 40 skips of 1280 (3%): under the limit
    p.check_skipped()

    p = progress(0.0)
    p.advance(0)
    p.check_skipped()
    p.advance(1, ["y.png (broken)"])
    with pytest.raises(ConfigError, match=r"1 of the 16 samples"):
        p.check_skipped()

    p = progress(1.0)
    for _ in range(10):
        p.advance(8)
    p.check_skipped()


def test_progress_state_without_skipped_files_loads_and_a_malformed_list_is_ignored():
    p = TrainProgress(8, 100, 1, 0)
    p.load_state_dict({"step": 3, "cursor": 24, "skipped_samples": 2})
    assert p.skipped_files == []
    p.load_state_dict({"step": 3, "cursor": 24, "skipped_samples": 2, "skipped_files": "not a list"})
    assert p.skipped_files == []
    p.load_state_dict({"step": 3, "cursor": 24, "skipped_samples": 2, "skipped_files": ["a.png (x)", 7]})
    assert p.skipped_files == ["a.png (x)"]
    again = TrainProgress(8, 100, 1, 0)
    again.load_state_dict(p.state_dict())
    assert again.skipped_files == ["a.png (x)"] and again.skipped_samples == 2


@pytest.mark.slow
def test_under_torchrun_every_rank_counts_the_job_s_skips_and_stops_at_the_same_step(tmp_path):
    data = tmp_path / "data"
    corrupt_folder(data, [f"bad{i}.png" for i in range(8)])
    torchrun = standalone(2)
    args = tiny(
        tmp_path,
        "data.source=folder",
        f"data.path={data}",
        "data.channels=3",
        "data.val_fraction=0",
        "checkpoint.every_steps=0",
        max_steps=50,
    )
    r = subprocess.run(
        [sys.executable, "-m", "trainer", "launch", *torchrun, "--", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
    )
    assert r.returncode == 2, r.stderr[-4000:]
    # Each rank skips 4 samples a step: counted per rank, the 32 would come at step 8, not 4.
    assert r.stderr.count("32 of the 32 samples consumed by step 4") == 2, r.stderr[-4000:]
    assert "Traceback" not in r.stderr.split("data.max_skipped_fraction")[0], r.stderr[-4000:]
