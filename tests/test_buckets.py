"""Aspect-ratio buckets (issue 50): the bucket lists, each image's bucket and crop, the skipped images, the size
manifest, and the bucketed order's invariants (hypothesis): one bucket a batch, every sample once a pass,
the same stream at any world size and after a resume at any step; a SIGKILLed run resumes bit-identical,
and a resume on changed images is refused."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import clean_env, run_cli, tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from trainer.data import build_splits, build_train_loader
from trainer.data.buckets import BucketPlan, cover_crop, generate_buckets, nearest_buckets
from trainer.data.sampler import BucketStream, SampleRef, StepBatchSampler
from trainer.errors import ConfigError
from trainer.registry import load_config

# SDXL's buckets at 1024^2 as (height, width): Podell et al. 2023, "SDXL: Improving Latent Diffusion Models for
# High-Resolution Image Synthesis", appendix I (multi-aspect training), the table of the 40 buckets.
SDXL = [
    tuple(int(side) for side in shape.split("x"))
    for shape in """
    512x2048 512x1984 512x1920 512x1856 576x1792 576x1728 576x1664 640x1600 640x1536 704x1472 704x1408
    704x1344 768x1344 768x1280 832x1216 832x1152 896x1152 896x1088 960x1088 960x1024 1024x1024 1024x960
    1088x960 1088x896 1152x896 1152x832 1216x832 1280x768 1344x768 1408x704 1472x704 1536x640 1600x640
    1664x576 1728x576 1792x576 1856x512 1920x512 1984x512 2048x512
""".split()
]


def test_generated_buckets_are_sdxl_and_pixart_lists():
    generated = generate_buckets(1024 * 1024, step=64, max_ratio=4.0)
    assert len(SDXL) == 40
    # The rule is symmetric; SDXL's table has (704, 1344) but not its mirror.
    assert set(generated) == set(SDXL) | {(1344, 704)}
    ratios = [h / w for h, w in generated]
    assert ratios == sorted(ratios)
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import ASPECT_RATIO_512_BIN, ASPECT_RATIO_1024_BIN

    for table, side, step in ((ASPECT_RATIO_1024_BIN, 1024, 64), (ASPECT_RATIO_512_BIN, 512, 32)):
        pixart = {(int(h), int(w)) for h, w in table.values()}
        assert pixart <= set(generate_buckets(side * side, step=step, max_ratio=4.0))


def test_nearest_bucket_by_log_ratio_and_skips_are_counted():
    buckets = [(12, 20), (16, 16), (20, 12)]
    sizes = np.asarray([[100, 100], [60, 100], [100, 61], [10, 10], [100, 300], [300, 100]], dtype=np.float64)
    assert nearest_buckets(sizes, buckets).tolist()[:3] == [1, 0, 2]
    # 7x7 needs 16/7 > 1/0.5 times upscaling; 1:3 is within ratio 3, 4:1 beyond it
    plan = BucketPlan([(100, 100), (60, 100), (7, 7), (100, 300), None, (400, 100)], buckets, 3.0, 0.5)
    assert plan.assign.tolist() == [1, 0, -1, 0, -1, -1]
    assert plan.counts() == {"too extreme": 1, "too small": 1, "unreadable": 1}
    assert BucketPlan([(8, 8)], buckets, 3.0, 0.0).assign.tolist() == [1]  # 0: never too small


def test_random_crop_is_a_function_of_the_sample_seed():
    arr = (np.arange(40 * 60).reshape(40, 60) % 251).astype(np.uint8)
    im = Image.fromarray(arr)
    a, top_a, left_a = cover_crop(im, 20, 20, "random", 123)
    b, top_b, left_b = cover_crop(im, 20, 20, "random", 123)
    assert (top_a, left_a) == (top_b, left_b) and np.array_equal(np.asarray(a), np.asarray(b))
    offsets = {cover_crop(im, 20, 20, "random", s)[1:] for s in range(20)}
    assert len(offsets) > 1 and all(t == 0 for t, _ in offsets)  # covered on the height: only left moves
    assert cover_crop(im, 20, 20, "center", 7)[1:] == (0, 5)


# ---------------------------------------------------------------------------------------- the order's invariants


def stream_case():
    return st.tuples(
        st.lists(st.integers(0, 23), min_size=1, max_size=5).filter(any),  # samples per bucket
        st.sampled_from([1, 2, 4, 6, 8]),  # global batch
        st.integers(0, 2**32),  # seed
    )


def members_of(sizes: list[int]) -> list[np.ndarray]:
    """Buckets of interleaved local indices (as a real plan gives: sorted, not contiguous)."""
    owner = np.concatenate([np.full(n, k) for k, n in enumerate(sizes)])
    owner = owner[np.random.default_rng(len(owner)).permutation(len(owner))]
    return [np.flatnonzero(owner == k) for k in range(len(sizes))]


def refs(stream: BucketStream, cursor: int, rank: int = 0, world: int = 1) -> list[tuple[int, int, int]]:
    return [(r.index, r.position, r.epoch) for r in stream.rank_slice(cursor, stream.global_batch, rank, world)]


SETTINGS = settings(
    max_examples=60, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)


@SETTINGS
@given(stream_case())
def test_every_batch_is_one_bucket_and_every_sample_is_used_once_a_pass(case):
    sizes, batch, seed = case
    members = members_of(sizes)
    bucket_of = {int(i): k for k, m in enumerate(members) for i in m}
    stream = BucketStream(members, seed, batch)
    epochs = 3 + batch  # enough epochs for a bucket smaller than a batch to complete passes
    total = stream.batches_before(epochs)
    seen: dict[tuple[int, int], int] = {}
    outside = {}  # (bucket, pass) -> entries used in another epoch's batches (its carried tail)
    for number in range(total):
        epoch = stream.epoch_of(number)
        got = refs(stream, number * batch)
        assert len(got) == batch
        assert len({bucket_of[i] for i, _, _ in got}) == 1  # one bucket: one shape
        for index, _, sample_pass in got:
            key = (sample_pass, index)
            assert key not in seen, f"{key} used twice"
            seen[key] = number
            if sample_pass != epoch:
                assert sample_pass < epoch  # a tail only ever moves later
                k = (bucket_of[index], sample_pass)
                outside[k] = outside.get(k, 0) + 1
    for k, m in enumerate(members):
        complete = epochs * len(m) // batch * batch // max(len(m), 1)  # passes whose every entry is in a chunk
        for p in range(complete):
            assert {i for (q, i) in seen if q == p and bucket_of[i] == k} == set(m.tolist())
            assert outside.get((k, p), 0) <= batch - 1  # nothing dropped; at most a batch's tail carried


@SETTINGS
@given(stream_case(), st.data())
def test_the_stream_is_the_same_at_any_world_size_and_after_a_world_size_change(case, data):
    sizes, batch, seed = case
    stream = BucketStream(members_of(sizes), seed, batch)
    worlds = [w for w in range(1, batch + 1) if batch % w == 0]
    steps = 2 * stream.batches_before(2)
    change = data.draw(st.integers(0, steps))
    before, after = data.draw(st.sampled_from(worlds)), data.draw(st.sampled_from(worlds))
    changed = []
    for step in range(steps):
        world = before if step < change else after
        whole = [e for r in range(world) for e in refs(stream, step * batch, r, world)]
        assert whole == refs(stream, step * batch)  # ranks' slices in rank order make the global batch
        changed += whole
    fresh = BucketStream(members_of(sizes), seed, batch)
    assert changed == [e for step in range(steps) for e in refs(fresh, step * batch)]


@SETTINGS
@given(stream_case(), st.data())
def test_a_resume_at_any_cursor_continues_the_uninterrupted_stream(case, data):
    sizes, batch, seed = case
    members = members_of(sizes)
    straight = StepBatchSampler(BucketStream(members, seed, batch), 0, batch, 0, 1)
    steps = 2 * BucketStream(members, seed, batch).batches_before(2) + 2
    uninterrupted = [b for _, b in zip(range(steps), straight, strict=False)]
    at = data.draw(st.integers(0, steps - 1))
    resumed = StepBatchSampler(BucketStream(members, seed, batch), at * batch, batch, 0, 1)
    assert [b for _, b in zip(range(steps - at), resumed, strict=False)] == uninterrupted[at:]


def test_another_seed_or_epoch_is_another_order():
    members = members_of([10, 7, 12])
    a, b = BucketStream(members, 0, 2), BucketStream(members, 1, 2)
    assert [refs(a, c * 2) for c in range(10)] != [refs(b, c * 2) for c in range(10)]
    first, second = a.epoch_batches(0).tolist(), a.epoch_batches(1).tolist()
    assert first != second


# ---------------------------------------------------------------------------------------------- image folders

SHAPES = [(16, 16), (12, 20), (20, 12), (24, 40), (40, 24), (30, 30), (10, 50), (4, 4)]  # (h, w)


def make_folder(root, copies: int = 5):
    """Images of every shape in SHAPES (h, w), each with a gradient so crops differ."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(copies):
        for h, w in SHAPES:
            arr = ((np.arange(h * w).reshape(h, w) * (i + 1)) % 256).astype(np.uint8)
            Image.fromarray(np.stack([arr] * 3, -1)).save(root / f"{h}x{w}-{i}.png")
    return root


# make_folder's images at data.image_size 16, step 4, ratio 2: buckets 12x20, 16x16, 20x12; 10x50 too extreme
FOLDER_BUCKETS = [
    "data.image_size=16",
    "data.channels=3",
    "data.buckets=auto",
    "data.bucket_step=4",
    "data.bucket_max_ratio=2",
    "data.bucket_min_fraction=0.25",
]


def folder_config(tmp_path, *extra: str):
    return load_config(
        None,
        [
            "data.source=folder",
            f"data.path={tmp_path / 'images'}",
            *FOLDER_BUCKETS,
            "data.val_fraction=0",
            "train.batch_size=4",
            f"run.dir={tmp_path / 'run'}",
            *extra,
        ],
        environ={},
    )


def test_a_folder_trains_in_buckets_with_counted_skips_and_a_size_manifest(tmp_path, caplog):
    make_folder(tmp_path / "images")
    cfg = folder_config(tmp_path)
    train, _, _ = build_splits(cfg)
    assert train.plan.buckets == [(12, 20), (16, 16), (20, 12)]
    # 10x50 is beyond ratio 2; 4x4 would be upscaled 4x, more than 1/0.25 allows... exactly 4: kept
    assert train.skipped == {"too extreme": 5}
    assert len(train) == 35
    manifest = list((tmp_path / "run" / "data").glob("buckets-*.json"))
    assert len(manifest) == 1
    shapes = set()
    loader = build_train_loader(train, cfg, cursor=0, rank=0, world_size=1)
    for _, batch in zip(range(12), loader, strict=False):
        shapes.add(tuple(batch["images"].shape[-2:]))
        assert batch["valid"].all()
    assert shapes == {(12, 20), (16, 16), (20, 12)}
    # A held-out ref (no seed: previews, calibration) loads the square image_size.
    assert train[SampleRef(index=0, position=0)][0].shape == (3, 16, 16)

    # The sizes come from the manifest while the listing is unchanged: an image rewritten to another
    # shape behind the listing's back (same byte size and mtime) keeps its recorded bucket.
    victim = tmp_path / "images" / "12x20-0.png"
    st = victim.stat()
    Image.fromarray(np.zeros((20, 12, 3), dtype=np.uint8)).save(victim)
    data = victim.read_bytes()[: st.st_size].ljust(st.st_size, b"\0")
    victim.write_bytes(data)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    again, _, _ = build_splits(cfg)
    assert again.digest == train.digest
    # Another image (a new version of the data) is another assignment digest.
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(tmp_path / "images" / "new.png")
    assert build_splits(cfg)[0].digest != train.digest


def test_buckets_not_multiples_of_the_step_are_refused_naming_them(tmp_path):
    make_folder(tmp_path / "images", copies=1)
    cfg = folder_config(tmp_path, "data.buckets=[[16,16],[12,18]]")
    with pytest.raises(ConfigError, match=r"12x18 are not multiples of data.bucket_step=4"):
        build_splits(cfg)
    with pytest.raises(ConfigError, match="data.source=digits"):
        load_config(None, ["data.buckets=auto"], environ={})


def test_too_small_images_are_skipped_below_the_fraction(tmp_path):
    make_folder(tmp_path / "images", copies=1)
    train, _, _ = build_splits(folder_config(tmp_path, "data.bucket_min_fraction=0.5"))
    assert train.skipped == {"too extreme": 1, "too small": 1}  # 10x50 and 4x4


# ---------------------------------------------------------------------------------------------- whole runs

RUN = [
    "data.source=folder",
    "data.image_size=16",
    "data.channels=3",
    "data.buckets=auto",
    "data.bucket_step=4",
    "data.bucket_max_ratio=2",
    "data.crop=random",
    "data.flip=true",
    "data.val_fraction=0",
    "train.batch_size=4",
]


@pytest.mark.slow
def test_a_sigkilled_bucketed_run_resumes_bit_identical_and_refuses_changed_images(tmp_path):
    from helpers import assert_identical, final_weights, kill_tree, start_cli, wait_for_log

    images = make_folder(tmp_path / "images", copies=3)
    steps = 24
    straight = tmp_path / "straight"
    r = run_cli("train", *tiny(straight, *RUN, f"data.path={images}", max_steps=steps))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "aspect-ratio buckets" in r.stderr

    broken = tmp_path / "broken"
    args = tiny(broken, *RUN, f"data.path={images}", "checkpoint.every_steps=4", max_steps=steps)
    log = tmp_path / "first.log"
    proc = start_cli("train", *args, env=clean_env(), log_path=log)
    try:
        wait_for_log(log, "step=10/", proc)
    finally:
        kill_tree(proc)  # SIGKILL: no emergency save, the resume is from the last periodic checkpoint
    stopped = final_weights(f"{broken}/run/checkpoints")
    assert 4 <= stopped["step"] < steps

    # Other images are another assignment: refused (exit 2, naming the key), the checkpoint untouched.
    extra = images / "extra.png"
    Image.fromarray(np.zeros((20, 12, 3), dtype=np.uint8)).save(extra)
    r = run_cli("train", *args)
    assert r.returncode == 2 and "data order changed" in r.stderr and "data.buckets=" in r.stderr, r.stderr[-3000:]
    extra.unlink()

    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed_from={broken}/run/checkpoints/step-{stopped['step']:09d}" in r.stderr
    assert_identical(
        final_weights(f"{straight}/run/checkpoints", steps), final_weights(f"{broken}/run/checkpoints", steps)
    )
