"""Aspect-ratio buckets from the sources that are not image folders (issue 50, items 2 and 4): Hugging Face
datasets and webdataset shards of images train in buckets (each sample's size from the data once per version,
kept in the run's manifest), `gentrain data encode` with data.buckets writes each sample's posterior (and its
mirror's) at its bucket's shape and records the bucket in the shard's index, a run from those latents keeps
every order rule and resumes bit-identically after SIGKILL, and a run whose data.buckets are not the encode's
exits 2 naming both. The bucketed order itself is tests/test_buckets.py's; here, the shard split's mapping
onto it (hypothesis)."""

from __future__ import annotations

import io
import json
import re
import tarfile

import datasets
import numpy as np
import pytest
from conftest import run_cli, tiny
from helpers import assert_tensors_equal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from test_buckets import FOLDER_BUCKETS, make_folder
from test_latent import vae_folder
from test_latent_shards import ENV
from test_vqgan_maskgit import _kill_and_resume_one_process

from trainer.data import build_splits, build_train_loader
from trainer.data.bucket_sources import BucketedShardSplit, _shard_sizes, hf_sizes
from trainer.data.buckets import BucketPlan, cover_size
from trainer.data.pack import pack_folder
from trainer.data.sampler import SampleRef
from trainer.data.shards import ShardList, ShardSet, ShardSplit
from trainer.data.shards.encoded import parse_settings
from trainer.data.shards.latents import decode_encoded_sample
from trainer.encode import encode_dataset
from trainer.errors import ConfigError
from trainer.registry import load_config

# make_folder's buckets (12x20, 16x16, 20x12), random crops and flips
BUCKETS = [*FOLDER_BUCKETS, "data.crop=random", "data.flip=true", "train.batch_size=4"]


def config(*args: str):
    return load_config(None, list(args), environ={})


def preset(args: list[str]):
    return load_config(args[0], args[1:], environ={})


def shapes_of(train, cfg, batches: int = 8, sizes: bool = False) -> set[tuple[int, ...]]:
    """The sample shapes of the first batches (each batch one shape: it stacked); with `sizes`, each sample's
    size micro-conditions checked: its original (height, width) (the file's name says it), its crop inside
    the resized image, its bucket as the target."""
    out = set()
    for _, batch in zip(range(batches), build_train_loader(train, cfg, cursor=0, rank=0, world_size=1), strict=False):
        assert batch["valid"].all()
        out.add(tuple(batch["images"].shape[1:]))
        if sizes:
            for caption, row in zip(batch["captions"], batch["extras"]["size_conditions"].tolist(), strict=True):
                h, w = (int(v) for v in caption.split("-")[0].split("x"))
                bh, bw = batch["images"].shape[-2:]
                scale = max(bh / h, bw / w)
                assert row[:2] == [h, w] and row[4:] == [bh, bw]
                assert 0 <= row[2] <= round(h * scale) - bh and 0 <= row[3] <= round(w * scale) - bw
    return out


# ---------------------------------------------------------------------------------------------- the shard split


@settings(max_examples=40, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=5),  # samples per shard
    st.sampled_from([0.0, 0.3]),  # data.val_fraction
    st.sampled_from([1, 2, 4]),  # global batch
    st.integers(0, 2**16),  # seed (of the assignment and the order)
)
def test_a_bucketed_shard_split_holds_every_training_sample_with_a_bucket_once_in_its_buckets_order(
    counts, fraction, batch, seed
):
    total = sum(counts)
    assign = np.random.default_rng(seed).integers(-1, 3, total)  # -1: no bucket (skipped)
    if not (assign >= 0).any():
        return
    buckets = [(4, 8), (8, 8), (8, 4)]
    shardset = ShardSet(ShardList([f"/nowhere/{i:06d}.tar" for i in range(len(counts))], np.array(counts)), {}, 8, 1)
    split = ShardSplit(shardset, "train", fraction, False, (1, 8, 8))
    train_ids = [shardset.global_id(*split.locate(i)) for i in range(len(split))]
    if not any(assign[g] >= 0 for g in train_ids):
        return
    out = BucketedShardSplit(
        split, BucketPlan.from_assignment(assign, buckets), "d", batch, [(1, *b) for b in buckets], True
    )
    # Every training sample with a bucket exactly once, in its own bucket; the others counted as skipped.
    ids = {k: sorted(train_ids[int(out.local[i])] for i in m) for k, m in enumerate(out.members)}
    assert sorted(g for m in ids.values() for g in m) == sorted(g for g in train_ids if assign[g] >= 0)
    assert all(assign[g] == k for k, m in ids.items() for g in m)
    assert out.skipped == (
        {"unreadable": sum(assign[g] < 0 for g in train_ids)} if any(assign[g] < 0 for g in train_ids) else {}
    )
    # The stream over them: one bucket a batch, each of a pass's entries once, the same at any world size.
    stream = out.make_stream(seed)
    seen = set()
    for number in range(stream.batches_before(3)):
        whole = stream.rank_slice(number * batch, batch, 0, 1)
        assert {int(out.bucket[r.index]) for r in whole} == {stream.batch(number)[0]}
        for r in whole:
            assert (r.epoch, r.index) not in seen
            seen.add((r.epoch, r.index))
        for world in (w for w in (2, 4) if batch % w == 0):
            ranks = [r for rank in range(world) for r in stream.rank_slice(number * batch, batch, rank, world)]
            assert ranks == whole


# ---------------------------------------------------------------------------------------------- hf datasets


def hf_dataset(tmp_path, sizes_columns: bool = False) -> str:
    images = make_folder(tmp_path / "images", copies=2)
    files = sorted(images.glob("*.png"))
    columns = {"image": [{"bytes": f.read_bytes(), "path": None} for f in files], "text": [f.stem for f in files]}
    features = {"image": datasets.Image(), "text": datasets.Value("string")}
    if sizes_columns:  # what the header says, swapped: the columns must be what is read
        columns |= {"height": [int(f.stem.split("x")[1].split("-")[0]) for f in files]}
        columns |= {"width": [int(f.stem.split("x")[0]) for f in files]}
        features |= {"height": datasets.Value("int32"), "width": datasets.Value("int32")}
    out = tmp_path / ("hf-sized" if sizes_columns else "hf")
    datasets.Dataset.from_dict(columns, features=datasets.Features(features)).save_to_disk(str(out))
    return str(out)


def test_an_hf_dataset_trains_in_buckets_with_its_sizes_read_once_and_its_width_height_columns_used(tmp_path):
    path = hf_dataset(tmp_path)
    cfg = config("data.source=hf", f"data.path={path}", "data.val_fraction=0", f"run.dir={tmp_path}/run", *BUCKETS)
    train, _, _ = build_splits(cfg)
    assert train.skipped == {"too extreme": 2} and len(train) == 14
    assert shapes_of(train, cfg, sizes=True) == {(3, 12, 20), (3, 16, 16), (3, 20, 12)}
    assert train[SampleRef(index=0, position=0)][0].shape == (3, 16, 16)  # held out: the square
    manifest = list((tmp_path / "run" / "data").glob("buckets-*.json"))
    assert len(manifest) == 1 and json.loads(manifest[0].read_text())["sizes"][0] == [10, 50]
    assert build_splits(cfg)[0].digest == train.digest  # the same version: the same assignment
    sized = train.dataset.__class__(hf_dataset(tmp_path, sizes_columns=True), 16, 3)
    by_header, _ = hf_sizes(train.dataset, None)
    assert hf_sizes(sized, None)[0] == [(w, h) for h, w in by_header]


# ---------------------------------------------------------------------------------------------- image shards


def test_image_shards_train_in_buckets_held_out_samples_stay_square_and_changed_shards_are_another_version(tmp_path):
    for image in make_folder(tmp_path / "images", copies=2).glob("*.png"):
        image.with_suffix(".txt").write_text(image.stem)  # the caption names the original size
    pack_folder(str(tmp_path / "images"), str(tmp_path / "shards"), 5, progress=False)
    urls = f"data.urls={tmp_path}/shards/shards.json"
    cfg = config("data.source=shards", urls, "data.val_fraction=0.2", f"run.dir={tmp_path}/run", *BUCKETS)
    train, val, _ = build_splits(cfg)
    assert sum(train.skipped.values()) + len(train) + len(val) == 16 and train.skipped == {"too extreme": 2}
    assert shapes_of(train, cfg, sizes=True) == {(3, 12, 20), (3, 16, 16), (3, 20, 12)}
    assert train[SampleRef(index=0, position=0)][0].shape == val[SampleRef(index=0, position=0)][0].shape == (3, 16, 16)
    assert len(list((tmp_path / "run" / "data").glob("buckets-*.json"))) == 1
    # The sizes data pack lists in each index are the images' headers (read when an index lists none).
    index = tmp_path / "shards" / "000001.tar.idx.json"
    doc = json.loads(index.read_text())
    listed = doc.pop("sizes")
    index.write_text(json.dumps(doc))
    assert _shard_sizes(train.dataset, 1) == listed and len(listed) == 5
    shard = tmp_path / "shards" / "000000.tar"
    shard.write_bytes(shard.read_bytes())  # rewritten (a new mtime): another version of the data
    assert build_splits(cfg)[0].digest != train.digest


@pytest.mark.slow
def test_an_hf_dataset_and_image_shards_train_in_buckets_from_the_command_line(tmp_path):
    shards = tmp_path / "shards"
    pack_folder(str(make_folder(tmp_path / "images", copies=2)), str(shards), 5, progress=False)
    for source in ("data.source=hf", "data.source=shards"):
        where = f"data.path={hf_dataset(tmp_path)}" if source.endswith("hf") else f"data.urls={shards}/shards.json"
        r = run_cli("train", *tiny(tmp_path / source[12:], source, where, *BUCKETS, max_steps=3))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "14 training " in r.stderr and " in 3 of 3 aspect-ratio buckets; skipped 2 too extreme" in r.stderr


# ---------------------------------------------------------------------------------------------- latent shards

LATENT_BUCKETS = ["data.buckets=[[8,8],[8,12],[12,8]]", "data.bucket_step=4", "data.bucket_max_ratio=2"]
# (h, w) -> its bucket; 8x9 is cropped by one column (its mirror's crop is the other column); 10x40 too extreme
BUCKET_OF = {(8, 8): [8, 8], (8, 9): [8, 8], (8, 12): [8, 12], (12, 8): [12, 8], (16, 24): [8, 12], (24, 16): [12, 8]}
GRAY = [*BUCKET_OF, (10, 40)]


def latent_args(root, vae: str, *extra: str, max_steps: int = 2) -> list[str]:
    return [
        "digits-ddpm",
        *tiny(root, f"model.autoencoder.url={vae}", "data.image_size=8", *LATENT_BUCKETS, *extra, max_steps=max_steps),
    ]


def index_of(url: str, shard: int) -> dict:
    return json.loads(open(f"{url}/{shard:06d}.tar.idx.json").read())


@pytest.fixture(scope="module")
def encoded(tmp_path_factory) -> tuple[str, str]:
    """Gray images of GRAY's shapes through the tiny VAE (factor 2) in LATENT_BUCKETS, with mirrors."""
    root = tmp_path_factory.mktemp("bucketed")
    images = root / "images"
    images.mkdir()
    for i in range(3):
        for h, w in GRAY:
            Image.fromarray(((np.arange(h * w).reshape(h, w) * (i + 3)) % 256).astype(np.uint8), mode="L").save(
                images / f"{h}x{w}-{i}.png"
            )
    vae = vae_folder(root / "vae")
    args = latent_args(root, vae, "data.source=folder", f"data.path={images}", "data.channels=1")
    summary = encode_dataset(preset(args), f"{root}/shards", 5, dtype="float32", flip=True, progress=False)
    assert (summary.samples, summary.skipped) == (18, 3)
    return f"{root}/shards", vae


def test_a_bucketed_encode_writes_each_posterior_and_its_mirror_at_its_buckets_shape_and_records_the_bucket(encoded):
    url, _ = encoded
    made = json.loads(open(f"{url}/shards.json").read())["encoded"]["buckets"]
    assert made["list"] == [[8, 12], [8, 8], [12, 8]]  # sorted by height / width
    assert made["latent_shapes"] == [[4, 4, 6], [4, 4, 4], [4, 6, 4]]
    found = []
    mirrored_crops = 0
    for shard in range(4):
        buckets = index_of(url, shard)["buckets"]
        with tarfile.open(f"{url}/{shard:06d}.tar") as tf:
            by_key: dict[str, dict[str, bytes]] = {}
            for m in tf:
                key, ext = m.name.split(".", 1)
                by_key.setdefault(key, {})[ext] = tf.extractfile(m).read()
        for k, members in zip(buckets, by_key.values(), strict=True):
            h, w = (int(v) for v in members["src"].decode().split("-")[0].split("x"))
            expected = BUCKET_OF[h, w]
            assert made["list"][k] == expected
            for name in ("mean.npy", "std.npy", "flip.mean.npy", "flip.std.npy"):
                assert list(np.load(io.BytesIO(members[name])).shape) == made["latent_shapes"][k]
            sizes = np.load(io.BytesIO(members["size.npy"])).tolist()  # original, crop top-left, bucket
            assert sizes[:2] == [h, w] and sizes[4:] == expected
            # Read with the mirrored posterior, the crop's left is the mirror's (counted from the right).
            settings = parse_settings(json.loads(open(f"{url}/shards.json").read())["encoded"])
            plain = decode_encoded_sample(members, settings, True, 0, tuple(expected))[2]["size_conditions"]
            mirrored = decode_encoded_sample(members, settings, True, 1, tuple(expected))[2]["size_conditions"]
            assert plain.tolist() == sizes
            assert mirrored[3] == cover_size(h, w, *expected)[1] - expected[1] - sizes[3]
            mirrored_crops += mirrored[3] != sizes[3]
            found.append(k)
    assert sorted(found) == [0] * 6 + [1] * 6 + [2] * 6 and mirrored_crops == 3  # the 8x9 images


def test_a_run_on_bucketed_latents_needs_the_encodes_buckets_and_validates_on_one_bucket(tmp_path, encoded):
    url, vae = encoded
    shards = ["data.source=shards", f"data.urls={url}/shards.json", "train.batch_size=4"]
    cfg = preset(latent_args(tmp_path, vae, *shards, "data.val_fraction=0.25"))
    train, val, _ = build_splits(cfg)
    assert shapes_of(train, cfg) == {(8, 4, 6), (8, 4, 4), (8, 6, 4)}  # mean and std: 2 x 4 channels
    batch = next(iter(build_train_loader(train, cfg, cursor=0, rank=0, world_size=1)))
    bucket = [2 * side for side in batch["images"].shape[-2:]]  # the autoencoder's factor: 2
    assert all(row[4:] == bucket for row in batch["extras"]["size_conditions"].tolist())
    assert (
        len(train) + len(val) <= 18
        and len({val[SampleRef(index=i, position=i)][0].shape for i in range(len(val))}) == 1
    )
    made = re.escape(" were encoded with data.buckets=[[8,12], [8,8], [12,8]]")
    for other in ("data.buckets=null", "data.buckets=[[8,8]]"):
        with pytest.raises(ConfigError, match=f"{re.escape(other)} but data.urls=.*{made}"):
            build_splits(preset(latent_args(tmp_path, vae, *shards, other)))


@pytest.mark.slow
def test_a_sigkilled_run_on_bucketed_latents_resumes_bit_identical(tmp_path, encoded):
    url, vae = encoded
    steps = 6
    extra = [
        "data.source=shards",
        f"data.urls={url}/shards.json",
        "data.val_fraction=0",
        "data.flip=true",
        "train.batch_size=4",
        "checkpoint.every_steps=2",
        "task=probe_tasks:KillableDDPM",
    ]

    def args(root):
        return latent_args(root, vae, *extra, max_steps=steps)

    a, b, stderr = _kill_and_resume_one_process(tmp_path, args, ENV, kill_step=3, saved_step=2, steps=steps)
    assert "18 training samples in 3 of 3 aspect-ratio buckets" in stderr
    assert_tensors_equal(a, b)
