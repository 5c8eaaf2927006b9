"""Shard data without a store: the held-out split, the rank split and the order of a ShardStream, the tar
reader, and the random stream ids (fast, in-process)."""

from __future__ import annotations

import io
import tarfile
from collections import Counter

import numpy as np
import pytest
import torch

from trainer.data.shards import ShardList, ShardSet, ShardSplit, ShardStream, parse_sample, scan_tar
from trainer.data.shards.index import index_json, parse_index
from trainer.randomness import Stream, derive_seed, sample_generators, stream_seed

COUNTS = np.array([7, 5, 9, 3, 6, 17])  # 47 samples: batches of 60 cross epoch boundaries


def shard_set(counts, names=None) -> ShardSet:
    names = names or [f"{i:06d}.tar" for i in range(len(counts))]
    # Nothing is read: ShardSet opens its filesystem only when a sample is fetched.
    return ShardSet(ShardList([f"/nowhere/{n}" for n in names], np.asarray(counts, dtype=np.int64)), None, 8, 3)


# ---------------------------------------------------------------- the split


def test_held_out_split_is_disjoint_complete_and_follows_shard_names_not_their_order():
    names = [f"{i:06d}.tar" for i in range(len(COUNTS))]
    parts = {p: ShardSplit(shard_set(COUNTS), p, 0.25, False, (3, 8, 8)) for p in ("train", "val", "all")}
    assert len(parts["train"]) + len(parts["val"]) == len(parts["all"]) == COUNTS.sum()
    for shard, count in enumerate(COUNTS):
        train, val = parts["train"].members(shard), parts["val"].members(shard)
        assert len(val) == round(count * 0.25) and not set(train) & set(val)
        assert sorted([*train, *val]) == list(range(count)) == parts["all"].members(shard).tolist()
    for split in parts.values():  # every index of a part names a distinct (shard, member) of that part
        located = [split.locate(i) for i in range(len(split))]
        assert len(set(located)) == len(split) and all(m in split.members(s) for s, m in located)
    # The held-out members of a shard depend on its file name, not on where the list puts it.
    rev = ShardSplit(shard_set(COUNTS[::-1], names[::-1]), "val", 0.25, False, (3, 8, 8))
    for shard in range(len(COUNTS)):
        assert rev.members(len(COUNTS) - 1 - shard).tolist() == parts["val"].members(shard).tolist()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_ranks_read_disjoint_parts_of_the_world_size_1_order_and_every_sample_once_per_epoch(world):
    n, batch, steps = int(COUNTS.sum()), 60, 6
    stream = ShardStream(COUNTS, seed=5, window=2, block=3)
    single = ShardStream(COUNTS, seed=5, window=2, block=3)
    seen: Counter = Counter()
    for step in range(steps):
        cursor = step * batch
        ranks = [stream.rank_slice(cursor, batch, r, world) for r in range(world)]
        refs = [ref for part in ranks for ref in part]
        positions = [ref.position for ref in refs]
        assert sorted(positions) == positions == list(range(batch))  # disjoint, together the whole batch
        assert [r.index for r in refs] == [r.index for r in single.rank_slice(cursor, batch, 0, 1)]
        # ... which is the shard order itself (windows, blocks), not a plain permutation of the samples.
        assert [(cursor + r.position) // n for r in refs] == [e for e, _ in single.take(cursor, batch)]
        assert [r.index for r in refs] == [i for _, i in single.take(cursor, batch)]
        seen.update(((cursor + r.position) // n, r.index) for r in refs)
    full = steps * batch // n
    for epoch in range(full):
        assert sorted(i for (e, i), k in seen.items() if e == epoch and k == 1) == list(range(n))
    assert max(seen.values()) == 1


# ---------------------------------------------------------------- the order


def test_order_is_a_function_of_seed_and_epoch_and_resumes_anywhere():
    n = int(COUNTS.sum())
    one, two = ShardStream(COUNTS, 9, 2, 3), ShardStream(COUNTS, 9, 2, 3)
    epochs = [[i for _, i in one.take(e * n, n)] for e in range(3)]
    assert [sorted(e) for e in epochs] == [list(range(n))] * 3
    assert len({tuple(e) for e in epochs}) == 3  # each epoch its own order
    # A fresh stream read backwards from any cursor (a resume) gives the same entries.
    for cursor in (2 * n + 5, n - 1, 17, 0):
        assert two.take(cursor, 40) == one.take(cursor, 40)
    assert [i for _, i in ShardStream(COUNTS, 10, 2, 3).take(0, n)] != epochs[0]


def test_order_is_pinned():
    """The entries of one epoch as every earlier version drew them: a change here breaks bit-identical resume."""
    stream = ShardStream(np.array([4, 4, 3, 4, 1, 4, 9]), seed=11, window=2, block=2)
    assert [i for _, i in stream.take(0, 29)] == [
        11,
        12,
        6,
        7,
        4,
        5,
        13,
        14,
        16,
        17,
        10,
        8,
        9,
        18,
        19,
        0,
        1,
        15,
        2,
        3,
        20,
        21,
        26,
        27,
        22,
        23,
        28,
        24,
        25,
    ]


# ---------------------------------------------------------------- the tar reader


def write_tar(members: list[tuple[str, bytes]], fmt=tarfile.USTAR_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("folder", ["a/", "p" * 120 + "/"])  # the long one takes a ustar prefix or a pax header
def test_tar_reader_finds_every_sample_of_a_tarfile_archive_and_its_members(fmt, folder):
    samples = {f"{folder}{k:03d}": {"png": bytes([k]) * (100 + 300 * k), "cls": str(k).encode()} for k in range(4)}
    samples[f"{folder}002"]["txt"] = b"a caption"
    raw = write_tar([(f"{key}.{ext}", data) for key, m in samples.items() for ext, data in m.items()], fmt)
    offsets, keys, seen = scan_tar(io.BytesIO(raw))
    assert keys == list(samples) and seen == {"fields": ["cls", "png", "txt"], "max_cls": 3}
    assert parse_index(index_json(offsets, len(raw)), "x").tolist() == offsets
    for i, members in enumerate(samples.values()):
        assert parse_sample(raw[offsets[i] : offsets[i + 1]]) == members


def test_tar_reader_refuses_a_truncated_archive():
    raw = write_tar([("s/000.png", b"x" * 700), ("s/000.cls", b"1"), ("s/001.png", b"y" * 10)])
    offsets, _, _ = scan_tar(io.BytesIO(raw))
    first = raw[offsets[0] : offsets[1]]
    with pytest.raises(tarfile.ReadError):
        scan_tar(io.BytesIO(raw[:1000]))
    for cut in (600, 1000, 1536 + 100):  # inside data, inside data, inside the second member's header
        with pytest.raises(ValueError, match="truncated"):
            parse_sample(first[:cut])
    pax = write_tar([("q" * 120 + "/000.png", b"x" * 700)], tarfile.PAX_FORMAT)
    with pytest.raises(tarfile.TarError):
        parse_sample(pax[:1500])


# ---------------------------------------------------------------- random streams


IDS = {  # every run so far drew with these ids: they never change (see trainer.randomness.Stream)
    Stream.DIFFUSION: 0,
    Stream.MASKGIT: 1,
    Stream.CASCADE_STAGE: 100,
    Stream.AUGMENT: 2,
    Stream.SHARD_WINDOW: 4,
    Stream.DATA_ORDER: 1,
    Stream.SHARD_ORDER: 3,
    Stream.FID_CHUNK: 0xE7A1,
    Stream.STEP_GLOBAL: 3,
    Stream.JOINT_IMAGES: 5,
    Stream.AUTOENCODER: 6,
    Stream.BUCKET_MEMBERS: 7,
    Stream.BUCKET_BATCHES: 8,
    Stream.DREAMBOOTH_CLASS: 0xDB,
    Stream.CLASS_IMAGE: 0xC1A5,
}


def test_stream_ids_are_unique_per_key_count_and_unchanged():
    assert {s: s.id for s in Stream} == IDS
    assert len({(s.id, s.nkeys) for s in Stream}) == len(Stream)
    for a in Stream:  # the ids a stream owns (a span: substreams) meet no other stream of its key count
        for b in Stream:
            if a is not b and a.nkeys == b.nkeys:
                assert a.id + a.span <= b.id or b.id + b.span <= a.id, (a, b)
    with pytest.raises(TypeError):
        derive_seed(1, Stream.DATA_ORDER)  # a member is not an int: it cannot stand in for its id by accident
    assert derive_seed(3, 0, 9, 0) == 4413786117704873481  # the hash itself is pinned too


def test_stream_seed_takes_exactly_the_streams_keys():
    assert stream_seed(7, Stream.SHARD_ORDER, 2) == derive_seed(7, 3, 2)
    assert stream_seed(7, Stream.STEP_GLOBAL, 2, 1, 0) == derive_seed(7, 3, 2, 1, 0)
    assert stream_seed(7, Stream.CASCADE_STAGE, 4, 5, substream=2) == derive_seed(7, 102, 4, 5)
    with pytest.raises(TypeError, match="SHARD_ORDER takes 1 keys, got 3"):
        stream_seed(7, Stream.SHARD_ORDER, 2, 1, 0)
    with pytest.raises(ValueError, match="substreams"):
        stream_seed(7, Stream.MASKGIT, 1, 2, substream=1)


def test_sample_generators_are_keyed_by_stream_step_and_position():
    def first(*args, **kw) -> list[float]:
        return [torch.rand(1, generator=g).item() for g in sample_generators(3, 9, [0, 5], *args, **kw)]

    assert first() == first(Stream.DIFFUSION) != first(Stream.MASKGIT)
    assert first(Stream.CASCADE_STAGE, substream=2) != first(Stream.CASCADE_STAGE, substream=1)
    g = torch.Generator().manual_seed(derive_seed(3, 102, 9, 5))  # the ids of checkpoints written before the enum
    assert first(Stream.CASCADE_STAGE, substream=2)[1] == torch.rand(1, generator=g).item()
    g = torch.Generator().manual_seed(derive_seed(3, 1, 9, 0))
    assert first(Stream.MASKGIT)[0] == torch.rand(1, generator=g).item()
    for wrong in (Stream.AUGMENT, Stream.DATA_ORDER):  # not keyed by (step, position)
        with pytest.raises(ValueError):
            first(wrong)
