"""The global sample stream: seeded per-epoch permutations read by a cursor that survives restarts.

The stream is the concatenation of one permutation of the training set per
epoch. Training state holds one integer, the global cursor (samples consumed).
Step `s` reads the next `train.batch_size` entries of the stream and rank `r`
of `W` takes its contiguous slice of them, so the same run at 1, 2 or 3 ranks
consumes the same samples in the same order, and resuming is O(1): rebuild
the stream at the cursor, nothing is replayed. A batch that crosses an epoch
boundary takes the end of one permutation and the start of the next, so
within every epoch each sample is used exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from trainer.randomness import Stream, stream_seed


@dataclass(frozen=True)
class SampleRef:
    """One sample of a step: which item, where it sits in the global batch, its augmentation seed."""

    index: int  # position in the training subset
    position: int  # position in the step's global batch
    epoch: int = 0
    seed: int | None = None  # the run's seed; None: no augmentation stream (held-out and preview batches)
    fixed_aug_seed: int | None = None  # a seed carried over from another ref (a joint set's image stream)

    @property
    def aug_seed(self) -> int:
        """Derived where it is used (in a loader worker), not by the sampler in the training process."""
        if self.fixed_aug_seed is not None:
            return self.fixed_aug_seed
        return 0 if self.seed is None else stream_seed(self.seed, Stream.AUGMENT, self.epoch, self.index)


class SampleStream:
    def __init__(self, num_samples: int, seed: int):
        if num_samples <= 0:
            raise ValueError("the training set is empty")
        self.num_samples = num_samples
        self.seed = seed
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng(stream_seed(self.seed, Stream.DATA_ORDER, epoch))
            self._perm = rng.permutation(self.num_samples)
            self._epoch = epoch
        assert self._perm is not None
        return self._perm

    def take(self, cursor: int, count: int) -> list[tuple[int, int]]:
        """(epoch, index) for stream entries [cursor, cursor + count): slices of at most two epochs'
        permutations (this runs in the training process every step)."""
        out: list[tuple[int, int]] = []
        p, end = cursor, cursor + count
        while p < end:
            epoch, offset = divmod(p, self.num_samples)
            stop = min(end, (epoch + 1) * self.num_samples)
            out += [(epoch, i) for i in self.permutation(epoch)[offset : offset + stop - p].tolist()]
            p = stop
        return out

    def rank_slice(self, cursor: int, global_batch: int, rank: int, world_size: int) -> list[SampleRef]:
        """This rank's refs of the step at `cursor` (their augmentation seeds derived where they are used)."""
        per_rank = global_batch // world_size
        start = rank * per_rank
        entries = self.take(cursor + start, per_rank)
        return [SampleRef(index, start + k, epoch, self.seed) for k, (epoch, index) in enumerate(entries)]


class StepBatchSampler:
    """Yields this rank's SampleRefs for each step from `cursor` on (infinite).

    Used as a DataLoader `batch_sampler`: prefetching reads ahead, but the
    training state's cursor only moves when an optimizer step completes.
    """

    def __init__(self, stream: SampleStream, cursor: int, global_batch: int, rank: int, world_size: int):
        self.stream = stream
        self.cursor = cursor
        self.global_batch = global_batch
        self.rank = rank
        self.world_size = world_size

    def __iter__(self) -> Iterator[list[SampleRef]]:
        cursor = self.cursor
        while True:
            yield self.stream.rank_slice(cursor, self.global_batch, self.rank, self.world_size)
            cursor += self.global_batch


class BucketStream:
    """The global stream of an aspect-ratio bucketed set: every global batch is `global_batch` samples of one
    bucket, and the order is a function of (seed, epoch) alone.

    Each bucket k (its `members`, local indices) has its own `SampleStream` (seeded from (seed, k)): one
    permutation of its members per pass, passes concatenated, cut into consecutive chunks of `global_batch`.
    A chunk may hold the end of pass e and the start of pass e + 1: that is the bucket's tail carried to
    the next epoch, so no sample is ever dropped and every sample of pass e is used exactly once (in epoch
    e, or in epoch e + 1 when it is in the tail). Epoch e's batches are the chunks of every bucket that end
    in pass e: bucket k's chunks floor(e n_k / B) .. floor((e + 1) n_k / B) - 1, shuffled together by a
    permutation seeded from (seed, epoch). The number of batches before epoch e is sum_k floor(e n_k / B),
    a closed form, so the batch at any cursor is found by a binary search over epochs at O(buckets) a
    probe: a resume replays nothing. The cursor counts samples (global batches x `global_batch`) as the
    plain stream's does, and rank r of W takes its contiguous slice of the global batch, so the stream is
    the same at any world size, accumulation and micro-batching, and a world-size change mid-epoch still
    uses every sample once (the global batches do not depend on W). A bucket of fewer samples than a
    batch repeats samples within a batch (its chunks span passes); docs/data.md says so."""

    def __init__(self, members: list[np.ndarray], seed: int, global_batch: int):
        self.members = [np.asarray(m, dtype=np.int64) for m in members]
        self.sizes = [len(m) for m in self.members]
        if not any(self.sizes):
            raise ValueError("the training set is empty")
        self.seed = seed
        self.global_batch = global_batch
        self.num_samples = sum(self.sizes)
        self._streams = [
            SampleStream(n, stream_seed(seed, Stream.BUCKET_MEMBERS, k)) if n else None
            for k, n in enumerate(self.sizes)
        ]
        self._epoch = -1
        self._batches: np.ndarray | None = None  # (bucket, chunk) rows of the cached epoch, in its order

    def batches_before(self, epoch: int) -> int:
        """Global batches in epochs 0 .. epoch - 1."""
        return sum(epoch * n // self.global_batch for n in self.sizes)

    def epoch_of(self, batch: int) -> int:
        """The epoch that global batch number `batch` belongs to."""
        lo, hi = 0, (batch + 1) * self.global_batch + 1  # batches_before(hi) > batch: some bucket has n >= 1
        while hi - lo > 1:  # invariant: batches_before(lo) <= batch < batches_before(hi)
            mid = (lo + hi) // 2
            if self.batches_before(mid) <= batch:
                lo = mid
            else:
                hi = mid
        return lo

    def epoch_batches(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s batches as (bucket, chunk) rows, in their order."""
        if epoch != self._epoch:
            B = self.global_batch
            rows = [(k, j) for k, n in enumerate(self.sizes) for j in range(epoch * n // B, (epoch + 1) * n // B)]
            table = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
            rng = np.random.default_rng(stream_seed(self.seed, Stream.BUCKET_BATCHES, epoch))
            self._batches = table[rng.permutation(len(table))]
            self._epoch = epoch
        assert self._batches is not None
        return self._batches

    def batch(self, number: int) -> tuple[int, list[tuple[int, int]]]:
        """(bucket, [(pass, local index)] * global_batch) of global batch `number`."""
        epoch = self.epoch_of(number)
        k, chunk = (int(v) for v in self.epoch_batches(epoch)[number - self.batches_before(epoch)])
        stream = self._streams[k]
        assert stream is not None
        members = self.members[k]
        entries = stream.take(chunk * self.global_batch, self.global_batch)
        return k, [(p, int(members[i])) for p, i in entries]

    def rank_slice(self, cursor: int, global_batch: int, rank: int, world_size: int) -> list[SampleRef]:
        """This rank's refs of the step at `cursor` (a multiple of the global batch)."""
        if global_batch != self.global_batch or cursor % global_batch:
            raise ValueError(f"cursor {cursor} is not a multiple of the bucketed global batch {self.global_batch}")
        _, entries = self.batch(cursor // global_batch)
        per_rank = global_batch // world_size
        start = rank * per_rank
        mine = entries[start : start + per_rank]
        return [SampleRef(index, start + k, epoch, self.seed) for k, (epoch, index) in enumerate(mine)]
