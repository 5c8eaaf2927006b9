"""The global sample stream: same samples in the same order at any world size, each once per epoch."""

from __future__ import annotations

from collections import Counter

import pytest

from trainer.data.sampler import SampleStream


def consumed(stream, cursor, batch, world, steps):
    out = []
    for _ in range(steps):
        step = []
        for r in range(world):
            step += stream.rank_slice(cursor, batch, r, world)
        out.append(step)
        cursor += batch
    return out, cursor


@pytest.mark.parametrize("world", [1, 2, 3, 6])
def test_step_batches_do_not_depend_on_world_size(world):
    s = SampleStream(50, seed=7)
    one, _ = consumed(s, 0, 12, 1, 9)
    many, _ = consumed(s, 0, 12, world, 9)
    assert [[r.index for r in b] for b in one] == [[r.index for r in b] for b in many]
    assert [[r.position for r in b] for b in many] == [list(range(12))] * 9


def test_each_epoch_uses_every_sample_exactly_once_across_world_size_changes():
    n, batch = 50, 12
    s = SampleStream(n, seed=3)
    cursor, epochs = 0, Counter()
    for world, steps in [(2, 5), (1, 4), (3, 7)]:
        batches, cursor = consumed(s, cursor, batch, world, steps)
        pos = cursor - steps * batch
        for b in batches:
            for r in b:
                epochs[(pos // n, r.index)] += 1
                pos += 1
    full_epochs = cursor // n
    for e in range(full_epochs):
        assert sorted(i for (ep, i) in epochs if ep == e) == list(range(n))
    assert set(epochs.values()) == {1}


def test_permutations_differ_between_epochs_and_seeds():
    a = SampleStream(100, seed=1)
    assert list(a.permutation(0)) != list(a.permutation(1))
    assert list(SampleStream(100, seed=2).permutation(0)) != list(a.permutation(0))
    assert list(SampleStream(100, seed=1).permutation(5)) == list(a.permutation(5))


def test_rank_slices_read_the_stream_as_take_defines_it_across_epoch_ends():
    """rank_slice reads permutation slices (it runs every step in the training process); it must give the
    entries `take` defines, one by one, with each ref's augmentation seed keyed by its epoch and index."""
    from trainer.randomness import Stream, stream_seed

    stream = SampleStream(10, seed=3)
    for cursor in (0, 4, 8, 17, 29):
        for world in (1, 2, 3):
            batch = 6 * world
            for rank in range(world):
                refs = stream.rank_slice(cursor, batch, rank, world)
                want = stream.take(cursor + rank * 6, 6)
                assert [(r.epoch, r.index) for r in refs] == want
                assert [r.position for r in refs] == list(range(rank * 6, rank * 6 + 6))
                assert [r.aug_seed for r in refs] == [stream_seed(3, Stream.AUGMENT, e, i) for e, i in want]
