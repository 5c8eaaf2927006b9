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
