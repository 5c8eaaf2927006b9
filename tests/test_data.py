"""Datasets: the built-in digits, image folders, corrupt files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli, tiny
from PIL import Image

from trainer.data.datasets import DigitsDataset, ImageFolderDataset, load_digits_arrays
from trainer.errors import ConfigError


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


def _captions(ds: ImageFolderDataset, root) -> dict[str, str | None]:
    """Each image's caption as the dataset loads it (None: none), by path relative to `root`."""
    out = {}
    for i, p in enumerate(ds.files):
        item = ds.load(i, aug_seed=0, flip=False)
        out[p.relative_to(root).as_posix()] = "<skipped>" if item is None else (item[2:] or [{}])[0].get("caption")
    return out


def _jsonl(path, *records) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_metadata_jsonl_captions_follow_hugging_face_imagefolder_and_a_txt_sidecar_wins(tmp_path):
    make_folder(tmp_path)  # cats/0.png 1.jpg 2.webp 3.png 4.jpg, dogs/ the same
    _jsonl(
        tmp_path / "metadata.jsonl",
        {"file_name": "cats/0.png", "text": " a cat \n", "prompt": "feline"},
        "",  # blank lines are ignored
        {"file_name": "./cats/1.jpg", "text": "another cat"},
        {"file_name": "cats/2.webp", "text": "metadata loses to the .txt"},
        {"file_name": "cats/3.png", "other": 1},  # no caption column: no caption
        {"file_name": "cats/4.jpg", "text": None},
    )
    (tmp_path / "cats" / "2.txt").write_text("the sidecar\n")
    _jsonl(tmp_path / "dogs" / "metadata.jsonl", {"file_name": "0.png", "text": "a dog"})  # relative to dogs/
    ds = ImageFolderDataset(str(tmp_path), image_size=8, channels=3)
    assert len(ds) == 10 and ds.num_classes == 2  # the metadata files are no images and no classes
    assert _captions(ds, tmp_path) == {
        "cats/0.png": "a cat",
        "cats/1.jpg": "another cat",
        "cats/2.webp": "the sidecar",
        "cats/3.png": None,
        "cats/4.jpg": None,
        "dogs/0.png": "a dog",
        "dogs/1.jpg": None,
        "dogs/2.webp": None,
        "dogs/3.png": None,
        "dogs/4.jpg": None,
    }
    other = ImageFolderDataset(str(tmp_path), image_size=8, channels=3, caption_column="prompt")
    assert _captions(other, tmp_path)["cats/0.png"] == "feline" and _captions(other, tmp_path)["dogs/0.png"] is None


def test_data_pack_keeps_metadata_captions_where_no_txt_is_beside_the_image(tmp_path):
    import tarfile

    from trainer.data.pack import pack_folder

    src = tmp_path / "src"
    make_folder(src, n=4)  # cats/0.png 1.jpg, dogs/0.png 1.jpg
    _jsonl(src / "metadata.jsonl", {"file_name": "cats/0.png", "caption": "a cat"}, {"file_name": "dogs/1.jpg"})
    _jsonl(src / "cats" / "metadata.jsonl", {"file_name": "1.jpg", "caption": "loses"})
    (src / "cats" / "1.txt").write_text("the sidecar")
    pack_folder(str(src), str(tmp_path / "out"), 10, progress=False, shuffle_seed=None, caption_column="caption")
    with tarfile.open(tmp_path / "out" / "000000.tar") as tf:
        members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
    assert len([k for k in members if k.endswith((".png", ".jpg"))]) == 4  # the metadata files are no samples
    assert {k: v.decode() for k, v in members.items() if k.endswith(".txt")} == {
        "000000000.txt": "a cat",
        "000000001.txt": "the sidecar",
    }


def _remote_folder_loads_like_the_local_one(local, url: str, options: dict) -> None:
    """`local` copied to `url`: the folder source reads the same files, labels, pixels and captions from it
    (metadata.jsonl and .txt alike), and skips the same corrupt image."""
    import torch

    from trainer.storage import filesystem

    fs, path = filesystem(url, options)
    fs.put(str(local), path, recursive=True)
    mine = ImageFolderDataset(str(local), image_size=8, channels=3)
    theirs = ImageFolderDataset(url, image_size=8, channels=3, storage_options=options)
    assert [p.relative_to(local) for p in mine.files] == [
        p.relative_to(theirs.store.base()) for p in theirs.files
    ] and (theirs.class_index, theirs.labels) == (mine.class_index, mine.labels)
    assert _captions(theirs, theirs.store.base()) == _captions(mine, local)
    for i in range(len(mine)):
        a, b = mine.load(i, 0, False), theirs.load(i, 0, False)
        assert (a is None) == (b is None), mine.files[i]
        if a is not None:
            assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    broken = [i for i in range(len(theirs)) if theirs.load(i, 0, False) is None]
    assert [theirs.files[i].name for i in broken] == ["broken.png"]
    assert "unreadable image" in theirs.skip_reason(broken[0])


def _captioned_folder(root) -> None:
    make_folder(root, n=4)
    (root / "cats" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    _jsonl(root / "metadata.jsonl", {"file_name": "cats/0.png", "text": "a cat"})
    (root / "dogs" / "1.txt").write_text("a dog")


def test_a_folder_on_an_fsspec_store_loads_like_the_local_one(tmp_path):
    import fsspec

    _captioned_folder(tmp_path / "local")
    url = f"memory://{tmp_path.name}/images"  # the memory store is one per process: a name of this test's own
    try:
        _remote_folder_loads_like_the_local_one(tmp_path / "local", url, {})
    finally:
        fsspec.filesystem("memory").rm(f"/{tmp_path.name}", recursive=True)
    with pytest.raises(ConfigError, match=r"data\.path='memory://nothing': no such folder"):
        ImageFolderDataset("memory://nothing", image_size=8)


@pytest.mark.slow
def test_a_folder_on_s3_loads_like_the_local_one(tmp_path, s3_server):
    _captioned_folder(tmp_path / "local")
    url = f"s3://{s3_server.make_bucket()}/images"
    _remote_folder_loads_like_the_local_one(tmp_path / "local", url, s3_server.storage_options())


@pytest.mark.parametrize(
    "line, defect",
    [
        ('{"file_name": "cats/0.png", "text": "x"', "not JSON"),
        ('["cats/0.png", "x"]', "a JSON list, not an object"),
        ('{"text": "x"}', '"file_name" is None'),
        ('{"file_name": "cats/0.png", "text": 7}', '"text" is a JSON int (7), not a string'),
        ('{"file_name": "../outside.png", "text": "x"}', "outside the folder of metadata.jsonl"),
        ('{"file_name": "cats/missing.png", "text": "x"}', "names no file"),
        ('{"file_name": "notes.txt", "text": "x"}', "names a file of another type"),
        ('{"file_name": "cats/1.jpg", "text": "again"}', "already listed at"),
    ],
)
def test_a_malformed_metadata_line_is_refused_at_start_naming_the_file_and_the_line(tmp_path, line, defect):
    data = tmp_path / "data"
    make_folder(data, n=4)
    (data / "notes.txt").write_text("not an image")
    (data / "metadata.jsonl").write_text('{"file_name": "cats/1.jpg", "text": "fine"}\n\n' + line + "\n")
    with pytest.raises(ConfigError) as e:
        ImageFolderDataset(str(data), image_size=8, channels=3)
    message = str(e.value)
    assert f"{data / 'metadata.jsonl'}, line 3: " in message and defect in message, message
    assert "data.caption_column" in message  # says what a line must hold


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
