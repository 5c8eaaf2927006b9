"""The per-epoch sample order of a shard set: shards permuted, then runs of samples permuted within windows."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from trainer.data.sampler import SampleStream
from trainer.randomness import Stream, stream_seed


class ShardStream(SampleStream):
    """The per-epoch sample order of a shard set: shards permuted, samples permuted within windows of shards.

    Epoch e permutes the shards (seeded by (seed, e)), cuts that order into
    windows of `window` shards (0: one window, a full shuffle) and permutes
    the samples of each window (seeded by (seed, e, window number)); with
    `block` > 1 (the config default is 8) it permutes runs of `block`
    consecutive samples of a shard instead (MosaicML Streaming's shuffle
    block), so a rank's slice of a step, a contiguous part of the stream, is a
    few runs of neighbouring samples, read with a few range requests (block =
    1 is the plain sample permutation). A sample-level shuffle across blocks
    (Streaming's two-level py1br/py1e) would scatter each block's samples
    over steps and ranks: without a local cache of whole blocks, one request
    per sample again. Entry p
    of the stream is found in O(log shards) plus one window permutation, so
    resume at any cursor is O(window), and every sample appears once per epoch.
    """

    def __init__(self, counts: np.ndarray, seed: int, window: int, block: int = 1):
        super().__init__(int(np.sum(counts)), seed)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)])
        self.window = window if window > 0 else len(self.counts)
        self.block = max(1, block)
        self._epoch_layout: tuple[int, np.ndarray, np.ndarray] | None = None
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def _layout(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard order, cumulative samples at each window start) of an epoch."""
        if self._epoch_layout is None or self._epoch_layout[0] != epoch:
            rng = np.random.default_rng(stream_seed(self.seed, Stream.SHARD_ORDER, epoch))
            order = rng.permutation(len(self.counts))
            sizes = [int(self.counts[order[w : w + self.window]].sum()) for w in range(0, len(order), self.window)]
            self._epoch_layout = (epoch, order, np.concatenate([[0], np.cumsum(sizes)]))
        return self._epoch_layout[1], self._epoch_layout[2]

    def _window_ids(self, epoch: int, w: int) -> np.ndarray:
        key = (epoch, w)
        if key not in self._windows:
            order, _ = self._layout(epoch)
            shards = order[w * self.window : (w + 1) * self.window]
            rng = np.random.default_rng(stream_seed(self.seed, Stream.SHARD_WINDOW, epoch, w))
            if self.block == 1:
                ids = np.concatenate([np.arange(self.starts[s], self.starts[s + 1]) for s in shards])
                self._windows[key] = ids[rng.permutation(len(ids))]
            else:
                # Runs of `block` consecutive samples of a shard (the last run of a shard may be shorter).
                runs = [
                    np.arange(a, min(a + self.block, self.starts[s + 1]))
                    for s in shards
                    for a in range(int(self.starts[s]), int(self.starts[s + 1]), self.block)
                ]
                self._windows[key] = np.concatenate([runs[i] for i in rng.permutation(len(runs))])
            while len(self._windows) > 2:
                self._windows.popitem(last=False)
        return self._windows[key]

    def take(self, cursor: int, count: int) -> list[tuple[int, int]]:
        out = []
        for p in range(cursor, cursor + count):
            epoch, offset = divmod(p, self.num_samples)
            _, window_starts = self._layout(epoch)
            w = int(np.searchsorted(window_starts, offset, side="right") - 1)
            out.append((epoch, int(self._window_ids(epoch, w)[offset - window_starts[w]])))
        return out
