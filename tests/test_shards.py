"""WebDataset shards: pack/index round trip, the exact order, S3 byte-range reads, faults, world-size changes, resume."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import tarfile
from collections import defaultdict

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from conftest import free_port, run_cli, tiny
from elastic_helpers import finish, rank_of, standalone, start_torchrun, worker_pids
from helpers import assert_identical, final_weights, kill_group, start_cli, wait_for_log
from hypothesis import HealthCheck, given, settings
from PIL import Image

from trainer.config.schema import DataConfig
from trainer.data.datasets import ImageFolderDataset
from trainer.data.sampler import SampleRef
from trainer.data.shards import ShardSet, ShardSplit, ShardStream, filesystem, load_shard_list, parse_sample

DEFAULT_BLOCK = DataConfig().shuffle_block


def make_folder(root, per_class: int = 5, size: int = 24, classes=("cats", "dogs")) -> None:
    """Noise images (incompressible: realistic byte sizes) with a caption and an embedding beside each."""
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            stem = root / c / f"{c}.{i}"  # a dot in the stem: the packer must not split it
            Image.fromarray(rng.integers(0, 255, (size, size + 4, 3), dtype=np.uint8)).save(f"{stem}.png")
            stem.with_name(f"{c}.{i}.txt").write_text(f"a {c[:-1]} number {i}")
            np.save(stem.with_name(f"{c}.{i}.npy"), np.full(4, i, dtype=np.float32))
            np.save(stem.with_name(f"{c}.{i}.text_emb.npy"), np.full(2, -i, dtype=np.float32))


def pack(src, out, per_shard: int, *options: str) -> str:
    r = run_cli("data", "pack", str(src), str(out), "--samples-per-shard", str(per_shard), *options, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def s3_options(server) -> str:
    return json.dumps({"client_kwargs": {"endpoint_url": server.endpoint}})


# ---------------------------------------------------------------- the order


@pytest.mark.parametrize("window,block", [(0, 1), (1, 1), (3, 1), (0, 3), (2, 2)])
def test_shard_order_uses_every_sample_once_per_epoch_and_depends_on_seed_epoch_and_shards_only(window, block):
    counts = np.array([4, 4, 3, 4, 1, 4])
    n = int(counts.sum())
    stream = ShardStream(counts, seed=7, window=window, block=block)
    for epoch in range(3):
        assert sorted(i for _, i in stream.take(epoch * n, n)) == list(range(n))
    # A fresh stream at any cursor (a resume) reads what the running one read; ranks' slices tile the batch.
    full = stream.take(0, 3 * n)
    for cursor in (0, 5, n - 1, n + 3):
        assert ShardStream(counts, 7, window, block).take(cursor, 12) == full[cursor : cursor + 12]
    starts = np.concatenate([[0], np.cumsum(counts)])
    if block > 1:  # the epoch is made of whole runs: `block` consecutive samples of a shard (shorter at its end)
        ids = [i for _, i in full[:n]]
        runs, p = [], 0
        while p < n:
            shard = int(np.searchsorted(starts, ids[p], side="right") - 1)
            assert (ids[p] - starts[shard]) % block == 0, ids
            length = min(block, int(starts[shard + 1] - ids[p]))
            assert ids[p : p + length] == list(range(ids[p], ids[p] + length)), ids
            runs.append(ids[p])
            p += length
        assert runs != sorted(runs)  # the runs themselves are shuffled
    for world in (1, 2, 3):
        tiles = [r.index for rank in range(world) for r in stream.rank_slice(6, 6, rank, world)]
        assert tiles == [i for _, i in full[6:12]]
    assert ShardStream(counts, 8, window, block).take(0, n) != full[:n]
    if window == 1:  # a window of one shard reads shard by shard
        first = [i for _, i in full[:4]]
        shard = int(np.searchsorted(starts, first[0], side="right") - 1)
        assert all(starts[shard] <= i < starts[shard + 1] for i in first[: counts[shard]])


def test_default_shuffle_block_mixes_at_least_8_blocks_into_a_batch_of_64_with_few_requests_per_rank():
    assert DEFAULT_BLOCK == 8
    counts = np.array([100, 37, 128, 128, 64, 90, 128, 5, 77, 128, 128, 60])  # uneven, one shorter than a block
    starts = np.concatenate([[0], np.cumsum(counts)])
    n = int(counts.sum())

    def shard(i: int) -> int:
        return int(np.searchsorted(starts, i, side="right") - 1)

    def requests(ids: list[int]) -> int:  # what ShardSet._fetch sends: runs of touching samples of one shard
        ids = sorted(ids)
        return 1 + sum(1 for a, b in zip(ids, ids[1:], strict=False) if b != a + 1 or shard(a) != shard(b))

    def per_image(block: int, world: int) -> float:
        stream = ShardStream(counts, seed=3, window=8, block=block)
        steps = n // 64
        sent = sum(
            requests([r.index for r in stream.rank_slice(s * 64, 64, rank, world)])
            for s in range(steps)
            for rank in range(world)
        )
        return sent / (steps * 64)

    stream = ShardStream(counts, seed=3, window=8, block=DEFAULT_BLOCK)
    ids = [i for _, i in stream.take(0, 2 * n)]
    for s in range(0, 2 * n - 64, 64):
        batch = ids[s : s + 64]
        blocks = {(shard(i), (i - starts[shard(i)]) // DEFAULT_BLOCK) for i in batch}
        assert len(blocks) >= 8, (s, sorted(blocks))
        assert len({shard(i) for i in batch}) >= 2
    # Requests per image: every sample on its own is about one; default blocks about 1/8 at 1 and 2 ranks.
    assert per_image(1, 1) > 0.8 and per_image(1, 2) > 0.8
    assert per_image(DEFAULT_BLOCK, 1) < 0.16 and per_image(DEFAULT_BLOCK, 2) < 0.2


def tar(members: list[tuple[str, bytes | None]], fmt=tarfile.USTAR_FORMAT) -> bytes:
    """A tar archive of (name, data) members in `fmt`; data None: a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_member_headers_are_read_like_tarfile_and_broken_ones_raise():
    plain = [("a/b/s1.jpg", b"\xff\xd8jpeg" * 100), ("a/b/s1.txt", "ünïcode".encode()), ("a/b/s1.cls", b"3")]
    expect = {"jpg": plain[0][1], "txt": plain[1][1], "cls": b"3"}
    long_dir = "x" * 120 + "/"  # a ustar prefix (USTAR), a pax header (PAX), a GNU long name (GNU)
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        assert parse_sample(tar(plain, fmt)) == expect
        assert parse_sample(tar([(long_dir + n, d) for n, d in plain], fmt)) == expect
    assert parse_sample(tar([("dir", None), *plain], tarfile.USTAR_FORMAT)) == expect
    blob = bytearray(tar(plain, tarfile.USTAR_FORMAT))
    blob[130] ^= 1  # a size digit: the header checksum no longer matches
    with pytest.raises(tarfile.TarError):
        parse_sample(bytes(blob))
    with pytest.raises(ValueError, match="two samples"):
        parse_sample(tar([plain[0], ("a/b/s2.txt", b"x")], tarfile.USTAR_FORMAT))
    with pytest.raises(ValueError, match="truncated"):
        parse_sample(tar(plain, tarfile.USTAR_FORMAT)[:700])

    # A broken checksum in a later header (all of a sample's headers are checked in one sum) is caught too.
    blob = bytearray(tar(plain, tarfile.USTAR_FORMAT))
    third = 512 + 1024 + 512 + 512  # the jpg's header and 1024 bytes of data, the txt's header and data
    assert blob[third : third + 10] == b"a/b/s1.cls"
    blob[third + 5] ^= 1  # a name byte: reading on would file the member under another name
    with pytest.raises(tarfile.TarError):
        parse_sample(bytes(blob))


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["png", "cls", "txt", "mean.npy", "flip.std.npy", "TXT", "a.b.c"]),
            st.binary(max_size=1500),
        ),
        min_size=1,
        max_size=6,
        unique_by=lambda m: m[0].lower(),
    ),
    st.sampled_from(["", "d/", "x" * 120 + "/", "ünï/"]),
    st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
)
def test_a_sample_reads_as_tarfile_reads_it(members, folder, fmt):
    """parse_sample's own header reader (one pass, every checksum in one sum) finds what tarfile finds."""
    from trainer.data.shards.tar import _parse_sample_tarfile

    blob = tar([(f"{folder}000042.{ext}", data) for ext, data in members], fmt)
    assert parse_sample(blob) == _parse_sample_tarfile(blob) == {ext.lower(): data for ext, data in members}


def test_a_step_of_samples_reads_each_as_alone():
    """parse_samples checks the headers of a whole step in one sum: each sample still gets its own members
    or its own error, whatever its neighbours are (broken, cut short, pax, a directory first)."""
    from trainer.data.shards.tar import parse_samples

    good = [tar([(f"k{i}.png", b"p" * (100 * i + 1)), (f"k{i}.cls", str(i).encode())]) for i in range(4)]
    broken = bytearray(good[1])
    broken[130] ^= 1  # a checksum that no longer matches
    cut = good[2][:700]
    pax = tar([("q" * 120 + "/k.png", b"x" * 10)], tarfile.PAX_FORMAT)
    folder = tar([("d", None), ("d/k.png", b"y")])
    blobs = [good[0], bytes(broken), cut, pax, folder, good[3]]
    got = parse_samples(blobs)
    assert got[0] == {"png": b"p", "cls": b"0"} and got[5] == {"png": b"p" * 301, "cls": b"3"}
    assert isinstance(got[1], tarfile.TarError) and isinstance(got[2], ValueError) and "truncated" in str(got[2])
    assert got[3] == {"png": b"x" * 10} and got[4] == {"png": b"y"}
    for blob, g in zip(blobs, got, strict=True):  # one at a time: the same
        alone = parse_samples([blob])[0]
        assert alone == g if isinstance(g, dict) else type(alone) is type(g)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text(alphabet=["a", "ü", "0", ".", "/", "\n", " "], max_size=12))
def test_member_names_split_where_webdataset_splits_them(name):
    """split_name's string searches against webdataset's own regex (`base_plus_ext`), newlines included."""
    from webdataset.tariterators import base_plus_ext

    from trainer.data.shards.tar import split_name

    key, ext = base_plus_ext(name)
    assert split_name(name) == ((name, "") if key is None else (key, ext))


def test_local_range_reads_are_what_fsspec_reads(tmp_path):
    """The local disk's own range reader (one open a file) against fsspec's generic `cat_ranges`: the same
    bytes, short reads past the end, empty ranges, and a missing file's error in its slots only."""
    from fsspec import AbstractFileSystem
    from fsspec.implementations.local import LocalFileSystem

    from trainer.data.shards.fetch import cat_ranges

    (tmp_path / "a.tar").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "b.tar").write_bytes(b"xyz" * 100)
    a, b, gone = (str(tmp_path / n) for n in ("a.tar", "b.tar", "gone.tar"))
    paths = [a, b, a, gone, a, b, gone]
    starts = [0, 10, 2000, 0, 500, 299, 5]
    ends = [512, 20, 2100, 10, 500, 400, 9]
    fs = LocalFileSystem()
    got = cat_ranges(fs, paths, starts, ends)
    want = AbstractFileSystem.cat_ranges(fs, paths, starts, ends, on_error="return")
    assert [g if isinstance(g, bytes) else type(g) for g in got] == [
        w if isinstance(w, bytes) else type(w) for w in want
    ]
    assert got[2] == (bytes(range(256)) * 8)[2000:2048] and got[4] == b"" and isinstance(got[3], FileNotFoundError)


# ---------------------------------------------------------------- pack and index


@pytest.mark.slow
def test_pack_round_trip_keeps_pixels_captions_classes_and_embeddings_and_index_rebuilds_the_same(tmp_path):
    src = tmp_path / "src"
    make_folder(src)
    (src / "dogs" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    out = tmp_path / "shards"
    stdout = pack(src, out, 4, "--no-shuffle")  # the folder's order: compared sample by sample below
    assert re.search(r"3 shards, 10 samples, \d+ bytes, 1 skipped", stdout), stdout

    shards = load_shard_list(f"{out}/{{000000..000002}}.tar", None)
    assert shards.counts.tolist() == [4, 4, 2] and shards.classes == ["cats", "dogs"] and shards.num_classes == 2
    ds = ShardSet(shards, None, image_size=16, channels=3)
    split = ShardSplit(ds, "all", 0.0, False, (3, 16, 16))
    items = split.__getitems__([SampleRef(index=i, position=i) for i in range(len(split))])
    folder = ImageFolderDataset(str(src), image_size=16, channels=3)
    good = [i for i, p in enumerate(folder.files) if p.name != "broken.png"]
    for k, ((image, label, gid, _, valid, extras), fi) in enumerate(zip(items, good, strict=True)):
        assert gid == k  # global sample ids follow the packing order
        ref_image, ref_label, *_ = folder.load(fi, 0, False)
        i = int(folder.files[fi].stem.split(".")[1])
        assert valid and torch.equal(image, ref_image) and label == ref_label
        assert extras["caption"] == f"a {folder.files[fi].parent.name[:-1]} number {i}"
        assert extras["image_embed"].tolist() == [float(i)] * 4
        assert extras["text_embed"].tolist() == [-float(i)] * 2
    records = sum(o[-1] - o[0] for o in (json.loads(p.read_text())["offsets"] for p in out.glob("*.idx.json")))
    assert items.stats.used_bytes == items.stats.data_bytes == records

    # By default the samples are written in a seeded shuffled order: the same samples, classes mixed.
    from trainer.data.pack import pack_folder

    def captions(folder, seed):
        pack_folder(str(src), str(folder), 4, progress=False, shuffle_seed=seed)
        split = ShardSplit(
            ShardSet(load_shard_list(f"{folder}/shards.json", None), None, 16, 3), "all", 0.0, False, (3, 16, 16)
        )
        return [it[5]["caption"] for it in split.__getitems__([SampleRef(i, i, 0) for i in range(len(split))])]

    in_order = [e["caption"] for *_, e in items]
    shuffled = captions(tmp_path / "shuffled", 0)
    assert sorted(shuffled) == sorted(in_order) and shuffled != in_order
    assert captions(tmp_path / "again", 0) == shuffled and captions(tmp_path / "other", 1) != shuffled
    assert pack(src, tmp_path / "cli", 4).splitlines()[-1].endswith("1 skipped")
    assert (tmp_path / "cli" / "000000.tar").read_bytes() == (tmp_path / "shuffled" / "000000.tar").read_bytes()

    # `data index` on the same shards (as if made elsewhere) writes the same offsets. `data pack` also lists each
    # image's [height, width] (aspect-ratio buckets read them); `data index` reads tar headers only, so its
    # indexes have no sizes and a bucketed run reads the images' headers once instead (docs/data.md).
    packed = {p.name: json.loads(p.read_text()) for p in out.glob("*.idx.json")}
    assert all(len(index.pop("sizes")) == len(index["offsets"]) - 1 for index in packed.values()), packed
    for p in out.glob("*.json"):
        p.unlink()
    r = run_cli("data", "index", f"{out}/{{000000..000002}}.tar")
    assert r.returncode == 0 and "3 shards, 10 samples" in r.stdout, r.stderr[-2000:]
    assert {p.name: json.loads(p.read_text()) for p in out.glob("*.idx.json")} == packed
    listed = json.loads((out / "shards.json").read_text())
    assert listed["__kind__"] == "wids-shard-index-v1" and listed["num_classes"] == 2
    assert [e["nsamples"] for e in listed["shardlist"]] == [4, 4, 2]


@pytest.mark.slow
def test_shards_without_index_are_a_config_error_naming_the_fix(tmp_path):
    src = tmp_path / "src"
    make_folder(src, per_class=1)
    pack(src, tmp_path / "s", 1)
    for p in (tmp_path / "s").glob("*.json"):
        p.unlink()
    r = run_cli("train", *tiny(tmp_path, "data.source=shards", f"data.urls={tmp_path}/s/{{000000..000001}}.tar"))
    assert r.returncode == 2
    assert "000000.tar has no readable index" in r.stderr and "gentrain data index" in r.stderr


@pytest.mark.slow
def test_a_shard_list_naming_shards_outside_its_folder_exits_2_naming_the_entry(tmp_path):
    """Found 1 of issue 47: an entry `"url": "../other/000000.tar"` (or an absolute path, another store) was
    read from wherever it pointed. A shard list names shards in its own folder only."""
    src = tmp_path / "src"
    make_folder(src, per_class=2, size=8)
    pack(src, tmp_path / "s", 2)
    shutil.copytree(tmp_path / "s", tmp_path / "other")
    listed = json.loads((tmp_path / "s" / "shards.json").read_text())
    listed["shardlist"][1]["url"] = "../other/000001.tar"
    (tmp_path / "s" / "shards.json").write_text(json.dumps(listed))
    url = f"{tmp_path}/s/shards.json"
    r = run_cli("train", *tiny(tmp_path, "data.source=shards", f"data.urls={url}", max_steps=1))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "../other/000001.tar" in r.stderr and "its own folder" in r.stderr and "Traceback" not in r.stderr
    from trainer.errors import ConfigError

    bad = [
        f"{tmp_path}/other/000001.tar",
        f"file://{tmp_path}/other/000001.tar",
        "s3://bucket/000001.tar",
        "a/../../other/000001.tar",
        "..",
        "",
        "memory::x.tar",
        None,
        7,
    ]
    for value in bad:
        doc = {**listed, "shardlist": [listed["shardlist"][0], {**listed["shardlist"][1], "url": value}]}
        (tmp_path / "s" / "shards.json").write_text(json.dumps(doc))
        with pytest.raises(ConfigError, match=r"shardlist\[1\]") as e:
            load_shard_list(url, None)
        assert repr(value) in str(e.value)
    for entry in ({"url": "000001.tar"}, {"url": "000001.tar", "nsamples": "2"}, {"url": "000001.tar", "nsamples": -1}):
        (tmp_path / "s" / "shards.json").write_text(json.dumps({**listed, "shardlist": [entry]}))
        with pytest.raises(ConfigError, match=r"shardlist\[0\]"):
            load_shard_list(url, None)
    (tmp_path / "s" / "shards.json").write_text(json.dumps({**listed, "base": f"{tmp_path}/other"}))
    with pytest.raises(ConfigError, match=r"base"):
        load_shard_list(url, None)
    listed["shardlist"][1]["url"] = "./sub/../000001.tar"  # inside the folder however written: fine
    (tmp_path / "s" / "shards.json").write_text(json.dumps(listed))
    assert load_shard_list(url, None).urls[1] == f"{tmp_path}/s/000001.tar"


# ---------------------------------------------------------------- S3: bytes, faults


@pytest.mark.slow
def test_s3_reads_fetch_only_the_used_samples_and_faults_are_skipped_counted_and_the_job_finishes(tmp_path, s3_server):
    src = tmp_path / "src"
    make_folder(src, per_class=6)
    bucket = s3_server.make_bucket()
    url = f"s3://{bucket}/digits"
    pack(src, url, 3, "--storage-options", s3_options(s3_server))  # 4 shards of 3
    opts = s3_server.storage_options()
    fs = filesystem(url, opts)
    # Corrupt the image bytes of sample 1 of shard 0 (tar structure intact); delete shard 2.
    offsets = json.loads(fs.cat_file(f"{bucket}/digits/000000.tar.idx.json"))["offsets"]
    blob = bytearray(fs.cat_file(f"{bucket}/digits/000000.tar"))
    with tarfile.open(fileobj=io.BytesIO(bytes(blob))) as tf:
        png = next(m for m in tf.getmembers() if m.offset >= offsets[1] and m.name.endswith(".png"))
    blob[png.offset_data : png.offset_data + png.size] = b"\xff" * png.size
    fs.pipe_file(f"{bucket}/digits/000000.tar", bytes(blob))
    fs.rm_file(f"{bucket}/digits/000002.tar")

    # One epoch (12 samples, batch 4, 3 steps) on one process: 1 corrupt + 3 missing samples.
    port = free_port()
    args = tiny(
        tmp_path,
        "data.source=shards",
        f"data.urls={url}/{{000000..000003}}.tar",
        "data.channels=3",
        f"data.storage_options={json.dumps(opts)}",
        "data.val_fraction=0",
        "data.ledger=true",
        "data.read_retries=2",
        "model.num_classes=2",
        "train.batch_size=4",
        f"metrics.port={port}",
        "metrics.host=127.0.0.1",
        "metrics.linger_seconds=60",
        max_steps=3,
    )
    log = tmp_path / "train.log"
    proc = start_cli("train", *args, env=__import__("conftest").clean_env(), log_path=log)
    try:
        wait_for_log(log, "step-000000003", proc, timeout=300)
        from test_metrics import scrape

        text = scrape(port)
        assert re.search(r"^gentrain_skipped_samples_total 4\.0$", text, re.M), text
        assert re.search(r'^gentrain_skipped_shards_total\{rank="0"\} 1\.0$', text, re.M), text
    finally:
        kill_group(proc)
    out = log.read_text()
    assert "skipping shard s3://" in out and "000002.tar after 2 retries" in out
    assert "skipping corrupt sample s3://" in out and "000000.tar#1" in out
    state = json.loads((tmp_path / "run/checkpoints/step-000000003/trainer.json").read_text())
    assert state["progress"]["skipped_samples"] == 4

    # Bytes: the data fetched are exactly the tar records of the samples read, nothing else.
    ledger = [json.loads(x) for x in (tmp_path / "run/ledger/rank-0.jsonl").read_text().splitlines()]
    sizes = {}
    for s in range(4):
        if s != 2:
            o = json.loads(fs.cat_file(f"{bucket}/digits/{s:06d}.tar.idx.json"))["offsets"]
            sizes.update({s * 3 + j: o[j + 1] - o[j] for j in range(3)})
    used = [i for rec in ledger for i in rec["indices"]]
    assert sorted(used) == list(range(12))
    assert sum(rec["io"]["data_bytes"] for rec in ledger) == sum(sizes.values())
    assert sum(rec["io"]["used_bytes"] for rec in ledger) == sum(sizes.values())


def test_s3_neighbouring_samples_are_read_with_one_request_and_gaps_are_fetched_only_when_asked(tmp_path, s3_server):
    from trainer.data.pack import pack_folder

    src = tmp_path / "src"
    make_folder(src, per_class=6)
    url = f"s3://{s3_server.make_bucket()}/set"
    opts = s3_server.storage_options()
    pack_folder(str(src), url, 6, opts, progress=False)  # 2 shards of 6
    shards = load_shard_list(f"{url}/shards.json", opts)
    offsets = [json.loads(filesystem(url, opts).cat_file(f"{url}/{s:06d}.tar.idx.json"))["offsets"] for s in (0, 1)]
    size = {s * 6 + j: o[j + 1] - o[j] for s, o in enumerate(offsets) for j in range(6)}

    def read(block: int, merge_gap: int, refs=None):
        split = ShardSplit(ShardSet(shards, opts, 16, 3, merge_gap=merge_gap), "all", 0.0, False, (3, 16, 16), 0, block)
        refs = refs or split.make_stream(5).rank_slice(0, 8, 0, 1)
        return refs, split.__getitems__(refs)

    def runs(ids: list[int]) -> int:  # maximal runs of consecutive samples of one shard
        ids = sorted(ids)
        return 1 + sum(1 for a, b in zip(ids, ids[1:], strict=False) if b != a + 1 or a // 6 != b // 6)

    refs, blocks = read(block=3, merge_gap=0)
    ids = [r.index for r in refs]
    # A block-shuffled step is a few runs: one request each, and exactly the samples' own bytes.
    assert blocks.stats.requests == runs(ids) <= 4 and len(ids) == 8
    assert blocks.stats.data_bytes == blocks.stats.used_bytes == sum(size[i] for i in ids)
    _, single = read(block=1, merge_gap=0, refs=refs)  # the same samples read one by one... same results
    for a, b in zip(blocks, single, strict=True):
        assert a[4] and b[4] and torch.equal(a[0], b[0]) and a[1:4] == b[1:4] and a[5]["caption"] == b[5]["caption"]
    # With a gap allowance the holes between runs of a shard are fetched too: one request per shard touched.
    _, gapped = read(block=3, merge_gap=10**9, refs=refs)
    touched = sorted({i // 6 for i in ids})
    spans = sum(
        offsets[s][max(i % 6 for i in ids if i // 6 == s) + 1] - offsets[s][min(i % 6 for i in ids if i // 6 == s)]
        for s in touched
    )
    assert gapped.stats.requests == len(touched) and gapped.stats.data_bytes == spans
    assert gapped.stats.used_bytes == blocks.stats.used_bytes
    assert all(torch.equal(a[0], b[0]) for a, b in zip(gapped, blocks, strict=True))


# ---------------------------------------------------------------- torchrun: world-size changes, SIGKILL


@pytest.mark.slow
def test_s3_shards_every_sample_once_per_epoch_across_2_1_3_ranks_with_workers_and_bytes_within_1_2x(
    tmp_path, s3_server
):
    n, batch = 30, 6
    src = tmp_path / "src"
    make_folder(src, per_class=n // 2)
    url = f"s3://{s3_server.make_bucket()}/set"
    # 3 shards of 10: the default shuffle blocks (8) make runs of 8 and 2 of each shard.
    pack(src, url, 10, "--storage-options", s3_options(s3_server))
    base = tiny(
        tmp_path,
        "data.source=shards",
        f"data.urls={url}/shards.json",
        "data.channels=3",
        "data.image_size=16",
        f"data.storage_options={json.dumps(s3_server.storage_options())}",
        "data.val_fraction=0",
        "data.ledger=true",
        "data.shard_window=2",
        "model.num_classes=2",
        "train.num_workers=2",
        f"train.batch_size={batch}",
        "checkpoint.every_steps=0",
    )
    # Leg boundaries at cursors 42 and 96: mid-epoch, mid-window, mid-shard (96: mid-block too).
    plan = [(2, 7), (1, 16), (3, 27)]
    previous = 0
    for i, (world, until) in enumerate(plan):
        log = tmp_path / f"leg{i}.log"
        proc = start_torchrun(standalone(world), [*base, f"train.max_steps={until}"], log)
        assert finish(proc, log) == 0, log.read_text()[-4000:]
        text = log.read_text()
        assert f"world_size={world} restart=0" in text
        if previous:
            assert f"step={previous} cursor={previous * batch}" in text
        previous = until

    per_step: dict[int, dict[int, dict]] = defaultdict(dict)
    for f in (tmp_path / "run" / "ledger").glob("rank-*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_step[rec["step"]][rec["rank"]] = rec
    assert sorted(per_step) == list(range(1, 28))
    stream = [i for s in sorted(per_step) for r in sorted(per_step[s]) for i in per_step[s][r]["indices"]]
    assert len(stream) == 27 * batch
    for epoch in range(len(stream) // n):
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == list(range(n)), f"epoch {epoch}"
    tail = stream[(len(stream) // n) * n :]
    assert len(set(tail)) == len(tail)
    # The order is the one ShardStream defines (seed 0), whatever the world size and workers.
    assert stream == [i for _, i in ShardStream(np.array([10, 10, 10]), 0, 2, DEFAULT_BLOCK).take(0, 27 * batch)]

    # Per rank and leg: fetched data bytes are exactly the tar records of its own samples (runs of a
    # shuffle block are merged into one request, no gap is fetched); with the indexes each worker
    # reads, within 1.2x of those bytes.
    fs = filesystem(url, s3_server.storage_options())
    offsets = [json.loads(fs.cat_file(f"{url}/{s:06d}.tar.idx.json"))["offsets"] for s in range(3)]
    size = {s * 10 + j: o[j + 1] - o[j] for s, o in enumerate(offsets) for j in range(len(o) - 1)}
    totals: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0, 0])
    for ranks in per_step.values():
        for r, rec in ranks.items():
            t = totals[(rec["world_size"], r)]
            t[0] += rec["io"]["data_bytes"]
            t[1] += rec["io"]["index_bytes"]
            t[2] += sum(size[i] for i in rec["indices"])
            assert rec["io"]["used_bytes"] == sum(size[i] for i in rec["indices"])
    assert len(totals) == 6
    requests = sum(rec["io"]["requests"] for ranks in per_step.values() for rec in ranks.values())
    assert requests < 0.6 * len(stream), requests  # runs of a block merged: fewer requests than samples
    for (world, r), (data, index, used) in totals.items():
        assert data == used, (world, r)
        assert (data + index) / used <= 1.2, (world, r, data, index, used)


@pytest.mark.slow
def test_sigkilled_rank_reading_shards_resumes_bit_identical(tmp_path):
    src = tmp_path / "src"
    make_folder(src, per_class=10, size=12)
    pack(src, tmp_path / "shards", 3)
    steps = 60
    args = [
        "data.source=shards",
        f"data.urls={tmp_path}/shards/{{000000..000006}}.tar",
        "data.channels=3",
        "data.val_fraction=0.1",
        "data.shard_window=2",
        "data.flip=true",
        "model.num_classes=2",
        "train.num_workers=1",
        "checkpoint.every_steps=5",
    ]
    ref_log = tmp_path / "ref.log"
    ref = start_torchrun(standalone(2), tiny(tmp_path / "ref", *args, max_steps=steps), ref_log)
    assert finish(ref, ref_log) == 0, ref_log.read_text()[-4000:]

    log = tmp_path / "killed.log"
    proc = start_torchrun(standalone(2, max_restarts=2), tiny(tmp_path / "killed", *args, max_steps=steps), log)
    try:
        wait_for_log(log, "step-000000010", proc, timeout=300)
        victims = [p for p in worker_pids(proc.pid) if rank_of(p) == 1]
        assert victims, "no rank-1 worker found"
        os.kill(victims[0], signal.SIGKILL)
        rc = finish(proc, log)
    finally:
        kill_group(proc)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    resumed = re.search(r"world_size=2 restart=1 .*resumed_from=\S+step-(\d+)", text)
    assert resumed and 10 <= int(resumed.group(1)) < steps
    assert_identical(
        final_weights(f"{tmp_path}/ref/run/checkpoints", steps),
        final_weights(f"{tmp_path}/killed/run/checkpoints", steps),
    )
