"""data.source=hf: Hugging Face datasets (save_to_disk folders, parquet files, imagefolder) built here from the
shipped digits, read offline with the pixels, captions and labels of the source; broken rows skipped and
counted like corrupt files; a missing column, a path that is no dataset and a Hub id exit 2; the global
sample stream and exact resume after SIGKILL work on it unchanged."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, clean_env, tiny
from helpers import assert_tensors_equal
from PIL import Image
from test_vqgan_maskgit import _kill_and_resume_one_process

from trainer.data import build_splits, build_train_loader, collate, split
from trainer.data.datasets import digit_caption, load_digits_arrays
from trainer.data.hf import HFDataset
from trainer.data.sampler import SampleRef, SampleStream
from trainer.errors import ConfigError
from trainer.registry import load_config

datasets = pytest.importorskip("datasets")

N = 24  # rows: three batches of 8


def digits(n: int = N) -> tuple[np.ndarray, list[int]]:
    """The first `n` shipped digits as 8x8 uint8 (0..240) and their labels."""
    images, labels = load_digits_arrays()
    return (images[:n].astype(np.uint8) * 15), [int(v) for v in labels[:n]]


def png(image: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image, mode="L").save(out, format="PNG")
    return out.getvalue()


def expected_pixels(image: np.ndarray) -> torch.Tensor:
    """What the folder source makes of the same PNG at its own size: [-1, 1], (1, 8, 8)."""
    return torch.from_numpy(image.astype(np.float32) / 127.5 - 1.0).unsqueeze(0)


def digits_dataset(n: int = N, images: list | None = None):
    """A `datasets.Dataset` of the digits: an `Image()` column, a caption and a ClassLabel."""
    arrays, labels = digits(n)
    features = datasets.Features(
        image=datasets.Image(),
        text=datasets.Value("string"),
        label=datasets.ClassLabel(names=[str(i) for i in range(10)]),
    )
    rows = images if images is not None else [{"bytes": png(a), "path": None} for a in arrays]
    return datasets.Dataset.from_dict(
        {"image": rows, "text": [digit_caption(v) for v in labels], "label": labels}, features=features
    )


def imagefolder(root: Path, n: int = N) -> Path:
    """A flat imagefolder with diffusers' metadata.jsonl (file_name, the caption, an integer label)."""
    arrays, labels = digits(n)
    root.mkdir(parents=True)
    with open(root / "metadata.jsonl", "w") as f:
        for i, (a, v) in enumerate(zip(arrays, labels, strict=True)):
            (root / f"{i:03d}.png").write_bytes(png(a))
            f.write(json.dumps({"file_name": f"{i:03d}.png", "text": digit_caption(v), "label": v}) + "\n")
    return root


def read_all(ds: HFDataset) -> tuple[torch.Tensor, list[int], list[str | None]]:
    items = [ds.load(i, 0, False) for i in range(len(ds))]
    assert all(it is not None for it in items)
    return (
        torch.stack([it[0] for it in items]),
        [it[1] for it in items],
        [it[2]["caption"] if len(it) > 2 else None for it in items],
    )


def assert_reads_the_digits(ds: HFDataset, labelled: bool = True) -> None:
    arrays, labels = digits()
    pixels, got_labels, captions = read_all(ds)
    assert_tensors_equal(pixels, torch.stack([expected_pixels(a) for a in arrays]))
    assert captions == [digit_caption(v) for v in labels]
    assert got_labels == (labels if labelled else [-1] * N)
    assert ds.num_classes == (10 if labelled else None)


def test_save_to_disk_parquet_and_imagefolder_read_the_pixels_captions_and_labels_of_the_source(tmp_path):
    ds = digits_dataset()
    cache = str(tmp_path / "cache")  # parquet and imagefolder are converted to Arrow here, not in ~/.cache

    def read(path, **kw) -> HFDataset:
        return HFDataset(str(path), image_size=8, channels=1, cache_dir=cache, **kw)

    ds.save_to_disk(str(tmp_path / "disk"))
    assert_reads_the_digits(read(tmp_path / "disk", label_column="label"))
    assert_reads_the_digits(read(tmp_path / "disk"), labelled=False)  # no label_column: no labels
    flipped, unflipped = read(tmp_path / "disk").load(3, 1, True), read(tmp_path / "disk").load(3, 1, False)
    assert_tensors_equal(flipped[0], unflipped[0].flip(-1))  # an odd augmentation seed flips, as the folder

    # A DatasetDict: the split named by data.hf_split.
    half = datasets.DatasetDict(train=ds.select(range(4)), test=ds)
    half.save_to_disk(str(tmp_path / "dict"))
    assert len(read(tmp_path / "dict")) == 4
    assert_reads_the_digits(read(tmp_path / "dict", split="test", label_column="label"))

    # Parquet: one file, a glob, a folder in the Hub's layout (data/<split>-*.parquet).
    ds.to_parquet(str(tmp_path / "one.parquet"))
    assert_reads_the_digits(read(tmp_path / "one.parquet", label_column="label"))
    (tmp_path / "hub" / "data").mkdir(parents=True)
    ds.select(range(12)).to_parquet(str(tmp_path / "hub/data/train-00000-of-00002.parquet"))
    ds.select(range(12, N)).to_parquet(str(tmp_path / "hub/data/train-00001-of-00002.parquet"))
    half["train"].to_parquet(str(tmp_path / "hub/data/test-00000-of-00001.parquet"))
    assert_reads_the_digits(read(tmp_path / "hub/data/train-*.parquet", label_column="label"))
    assert_reads_the_digits(read(tmp_path / "hub", label_column="label"))
    assert len(read(tmp_path / "hub", split="test")) == 4

    # imagefolder with metadata.jsonl (diffusers' captions): integer labels from a metadata column.
    assert_reads_the_digits(read(imagefolder(tmp_path / "folder"), label_column="label"))

    # Raw bytes and paths as image cells, string labels (sorted, like the folder's subfolder names).
    arrays, labels = digits()
    raw = datasets.Dataset.from_dict(
        {
            "png": [png(a) for a in arrays],
            "file": [str(tmp_path / "folder" / f"{i:03d}.png") for i in range(N)],
            "caption": [digit_caption(v) for v in labels],
        }
    )
    raw.save_to_disk(str(tmp_path / "raw"))
    for column in ("png", "file"):
        got = read(tmp_path / "raw", image_column=column, caption_column="caption", label_column="caption")
        pixels, classes, captions = read_all(got)
        assert_tensors_equal(pixels, torch.stack([expected_pixels(a) for a in arrays]))
        names = sorted({digit_caption(v) for v in labels})
        assert got.num_classes == len(names) and classes == [names.index(digit_caption(v)) for v in labels]


def test_broken_rows_are_skipped_and_counted_like_corrupt_files_and_name_their_row(tmp_path):
    arrays, _ = digits(6)
    good = [{"bytes": png(a), "path": None} for a in arrays]
    truncated = {"bytes": png(arrays[1])[:30], "path": None}
    images = [good[0], truncated, {"bytes": b"not an image", "path": None}, good[3], None, good[5]]
    digits_dataset(6, images).save_to_disk(str(tmp_path / "disk"))
    ds = HFDataset(str(tmp_path / "disk"), image_size=8, channels=1, label_column="label")
    train, _, _ = split(ds, 0.0, False, (1, 8, 8))
    batch = collate([train[SampleRef(index=i, position=i)] for i in range(6)])
    assert batch["valid"].tolist() == [True, False, False, True, False, True]
    assert batch["skipped"] == 3
    assert batch["images"][~batch["valid"]].abs().sum() == 0 and batch["labels"].tolist()[1] == -1
    files = batch["skipped_files"]
    assert [f.split(" (")[0] for f in files] == [f"row {i} of {tmp_path / 'disk'}" for i in (1, 2, 4)]
    assert "unreadable image" in files[0] and "unreadable image" in files[1] and "no image" in files[2]
    assert batch["captions"][0] == digit_caption(0) and batch["captions"][1] == ""

    # A column of another type (here integers) and a caption that is no string: skipped the same way.
    datasets.Dataset.from_dict({"image": [1, 2], "text": ["a", "b"]}).save_to_disk(str(tmp_path / "ints"))
    assert HFDataset(str(tmp_path / "ints"), 8, 1, check_readable=False).load(0, 0, False) is None
    lists = {"image": [png(arrays[0]), png(arrays[1])], "text": [["a", "b"], ["c"]]}
    datasets.Dataset.from_dict(lists).save_to_disk(str(tmp_path / "cap"))
    bad_caption = HFDataset(str(tmp_path / "cap"), 8, 1)
    assert bad_caption.load(0, 0, False) is None and "list, not a string" in bad_caption.skip_reason(0)


def test_a_missing_column_or_split_exits_2_naming_what_there_is(tmp_path):
    digits_dataset(4).save_to_disk(str(tmp_path / "disk"))
    path = str(tmp_path / "disk")
    for kw, message in [
        ({"image_column": "img"}, r"data\.image_column='img': .* its columns are \['image', 'text', 'label'\]"),
        ({"label_column": "class"}, r"data\.label_column='class': .* its columns are"),
        ({"caption_column": "caption", "caption_required": True}, r"data\.caption_column='caption': .* columns"),
    ]:
        with pytest.raises(ConfigError, match=message):
            HFDataset(path, 8, 1, **kw)
    # The default caption column may be absent (no captions, as a folder without any); not one set by name.
    assert len(HFDataset(path, 8, 1, caption_column="caption").load(0, 0, False)) == 2
    datasets.DatasetDict(train=digits_dataset(2)).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ConfigError, match=r"data\.hf_split='val': .* DatasetDict with the splits \['train'\]"):
        HFDataset(str(tmp_path / "dict"), 8, 1, split="val")
    datasets.Dataset.from_dict({"image": [b""], "n": [7]}).save_to_disk(str(tmp_path / "ints"))
    with pytest.raises(ConfigError, match=r"data\.caption_column='n': .* holds int64 there, not text"):
        HFDataset(str(tmp_path / "ints"), 8, 1, caption_column="n", caption_required=True)
    with pytest.raises(ConfigError, match=r"data\.label_column='text': the column holds"):
        datasets.Dataset.from_dict({"image": [b""], "text": [0.5]}).save_to_disk(str(tmp_path / "floats"))
        HFDataset(str(tmp_path / "floats"), 8, 1, label_column="text")  # the default caption column: ignored


@pytest.mark.parametrize(
    "path, message",
    [
        ("{tmp}/nothing", r"no such file or folder; set it to a folder written by Dataset\.save_to_disk"),
        ("{tmp}/notes.txt", r"is a file, not a dataset"),
        ("{tmp}", r"is not a dataset \(1 other files, e\.g\. 'notes\.txt'\)"),
        ("{tmp}/*.parquet", r"the glob matches no \.parquet file"),
        ("someone/digits", r"looks like a Hugging Face Hub id: .* download it first"),
    ],
)
def test_a_path_that_is_not_a_dataset_or_a_hub_id_exits_2_saying_what_is_read(tmp_path, path, message):
    (tmp_path / "notes.txt").write_text("no dataset")
    with pytest.raises(ConfigError, match=message):
        HFDataset(path.format(tmp=tmp_path), 8, 1)


def test_without_the_hf_extra_the_source_exits_2_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match=r"data\.source=hf .* not installed .*pip install 'gentrain\[hf\]'"):
        HFDataset(str(tmp_path), 8, 1)


def test_the_config_needs_a_path_and_every_world_size_uses_each_row_once_per_epoch(tmp_path):
    """The hf source through build_splits and the real per-rank loaders: the sampler tests hold for any
    dataset length; here the same rows come out at world sizes 1 and 2, each once per epoch."""
    with pytest.raises(ConfigError, match=r"data\.source=hf needs data\.path"):
        load_config("digits-ddpm", ["data.source=hf"], environ={})
    digits_dataset().save_to_disk(str(tmp_path / "disk"))
    cfg = load_config(
        "digits-ddpm",
        tiny(tmp_path, "data.source=hf", f"data.path={tmp_path / 'disk'}", "data.val_fraction=0.25"),
        environ={},
    )
    train, val, num_classes = build_splits(cfg)
    assert (len(train), len(val), num_classes) == (18, 6, None)
    steps = 9  # four epochs of 18 rows, batch 8

    def consumed(world: int, workers: int) -> list[list[int]]:
        run = cfg.model_copy(update={"train": cfg.train.model_copy(update={"num_workers": workers})})
        loaders = [iter(build_train_loader(train, run, 0, rank, world)) for rank in range(world)]
        return [sum((next(it)["indices"].tolist() for it in loaders), []) for _ in range(steps)]

    one, two = consumed(1, 0), consumed(2, 1)  # a loader worker per rank: the Arrow table in a forked process
    assert one == two
    stream = sum(one, [])
    for epoch in range(len(stream) // len(train)):
        assert sorted(stream[epoch * 18 : (epoch + 1) * 18]) == sorted(train.indices.tolist())


ENV = clean_env(PYTHONPATH=str(REPO / "tests"))


@pytest.mark.slow
def test_sigkill_mid_step_on_an_hf_dataset_then_resume_is_bit_identical_and_counts_broken_rows(tmp_path):
    """Class-conditional DDPM on a save_to_disk dataset with one undecodable row: killed in step 3 once the
    step-2 checkpoint committed, resumed, equal to an uninterrupted run, the broken row counted in both."""
    arrays, _ = digits(40)
    images = [{"bytes": png(a), "path": None} for a in arrays]
    images[7] = {"bytes": b"\x89PNG\r\n\x1a\n" + b"garbage" * 4, "path": None}
    digits_dataset(40, images).save_to_disk(str(tmp_path / "disk"))
    steps = 6
    extra = [
        "data.source=hf",
        f"data.path={tmp_path / 'disk'}",
        "data.label_column=label",
        "data.val_fraction=0",
        "model.num_classes=10",
        "checkpoint.every_steps=2",
        "task=probe_tasks:KillableDDPM",
    ]

    def args_for(root):
        return tiny(root, *extra, max_steps=steps)

    a, b, ref_stderr = _kill_and_resume_one_process(tmp_path, args_for, ENV, kill_step=3, saved_step=2, steps=steps)
    assert "skipping row 7 of" in ref_stderr and "unreadable image" in ref_stderr
    assert {"unet.ema.safetensors", "unet.optimizer.safetensors", "rank-00000.safetensors"} <= set(a)
    assert_tensors_equal(a, b)
    # 48 samples of 40 rows: the broken row is counted each time the stream draws it (once or twice).
    seed = load_config(None, args_for(tmp_path / "killed"), environ={}).seed
    drawn = sum(index == 7 for _, index in SampleStream(40, seed).take(0, steps * 8))
    assert drawn >= 1
    for root in ("ref", "killed"):
        doc = json.loads((tmp_path / root / f"run/checkpoints/step-{steps:09d}/trainer.json").read_text())
        assert doc["progress"]["skipped_samples"] == drawn and "row 7 of" in doc["progress"]["skipped_files"][0]


@pytest.mark.slow
def test_parquet_and_a_save_to_disk_folder_on_s3_read_like_the_local_ones(tmp_path, s3_server):
    import fsspec

    ds = digits_dataset()
    ds.to_parquet(str(tmp_path / "digits.parquet"))
    bucket = s3_server.make_bucket()
    options = s3_server.storage_options()
    fs = fsspec.filesystem("s3", **options)
    fs.put(str(tmp_path / "digits.parquet"), f"{bucket}/data/train-00000-of-00001.parquet")
    ds.save_to_disk(f"s3://{bucket}/disk", storage_options=options)
    urls = (f"s3://{bucket}/data/train-00000-of-00001.parquet", f"s3://{bucket}/data", f"s3://{bucket}/disk")
    for url in urls:
        got = HFDataset(url, 8, 1, label_column="label", storage_options=options, cache_dir=str(tmp_path / "cache"))
        assert_reads_the_digits(got)
