"""A shard set's training or validation part: which members of each shard it holds, read a step at a time."""

from __future__ import annotations

import posixpath
import zlib

import numpy as np

from trainer.data.datasets import skipped_item
from trainer.data.sampler import SampleRef
from trainer.data.shards.encoded import EncodedSettings
from trainer.data.shards.fetch import FetchStats, ShardSet
from trainer.data.shards.order import ShardStream

# Seeds the per-shard validation hold-out (with the shard's file name). A constant, not derived from the
# training seed: the held-out samples must not move when the seed does.
_SPLIT_SEED = 20240917


class ShardSplit:
    """The training or validation samples of a ShardSet, numbered 0..len-1 shard by shard.

    `data.val_fraction` holds out round(count * fraction) members of every
    shard, chosen by a permutation seeded from the shard's file name (so the
    split does not move with the training seed or the shard list's order);
    with `data.val_urls` the validation shards are separate and nothing is
    held out. The same interface as `Subset`: `__getitem__(SampleRef)` gives
    (image, label, global sample id, position, valid, extras); `__getitems__`
    reads a whole step's refs with concurrent range requests.
    """

    # `gentrain data encode`'s settings when the shards hold latents (set by `build_shard_splits`), else None.
    encoding: EncodedSettings | None = None

    def __init__(
        self, shardset: ShardSet, part: str, fraction: float, flip: bool, image_shape, window: int = 0, block: int = 1
    ):
        self.shardset = shardset
        self.part = part  # "train" | "val" | "all"
        self.fraction = fraction
        self.flip = flip
        self.image_shape = image_shape
        self.window = window
        self.block = block
        counts = shardset.shards.counts
        n_val = np.round(counts * fraction).astype(np.int64) if part != "all" else np.zeros_like(counts)
        self.counts = counts - n_val if part in ("train", "all") else n_val
        self.starts = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)
        self._members: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def dataset(self) -> ShardSet:
        return self.shardset

    def make_stream(self, seed: int) -> ShardStream:
        return ShardStream(self.counts, seed, self.window, self.block)

    def members(self, shard: int) -> np.ndarray:
        """Member numbers (within the shard) of this part, in shard order."""
        if shard not in self._members:
            count = int(self.shardset.shards.counts[shard])
            if self.part == "all" or self.fraction == 0:
                self._members[shard] = np.arange(count)
            else:
                name = posixpath.basename(self.shardset.shards.urls[shard])
                perm = np.random.default_rng([_SPLIT_SEED, zlib.crc32(name.encode())]).permutation(count)
                n_val = int(np.round(count * self.fraction))
                chosen = perm[:n_val] if self.part == "val" else perm[n_val:]
                self._members[shard] = np.sort(chosen)
        return self._members[shard]

    def locate(self, index: int) -> tuple[int, int]:
        return self.locate_many([index])[0]

    def locate_many(self, indices: list[int]) -> list[tuple[int, int]]:
        """(shard, member within the shard) of each index: one `searchsorted` for a step's indices."""
        idx = np.asarray(indices, dtype=np.int64)
        shards = np.searchsorted(self.starts, idx, side="right") - 1
        within = idx - self.starts[shards]
        return [(s, int(self.members(s)[i])) for s, i in zip(shards.tolist(), within.tolist(), strict=True)]

    def __getitem__(self, ref: SampleRef):
        return self.__getitems__([ref])[0]

    def __getitems__(self, refs: list[SampleRef]) -> FetchedItems:
        return self.load_refs(refs)

    def load_refs(self, refs: list[SampleRef], sizes: list | None = None, shapes: list | None = None) -> FetchedItems:
        """The refs' samples; `sizes`: each one's (height, width) bucket (None: the square data.image_size;
        trainer.data.bucket_sources), `shapes`: each one's slot shape when it cannot be read."""
        where = self.locate_many([r.index for r in refs])
        sizes = sizes or [None] * len(refs)
        stats = FetchStats()
        # A shard sample's augmentation draw only says whether to mirror it (and, in a bucket, where to crop):
        # not derived when nothing is.
        loaded = self.shardset.load_many(
            [
                (s, m, r.aug_seed if self.flip or size is not None else 0, self.flip, size)
                for (s, m), r, size in zip(where, refs, sizes, strict=True)
            ],
            stats,
        )
        items = FetchedItems()
        for slot, ((shard, member), ref, item) in enumerate(zip(where, refs, loaded, strict=True)):
            gid = self.shardset.global_id(shard, member)
            if item is None:
                reason = self.shardset.skip_reason(shard, member)
                shape = shapes[slot] if shapes is not None else self.image_shape
                items.append(skipped_item(shape, gid, ref.position, reason))
            else:
                items.append((item[0], item[1], gid, ref.position, True, item[2]))
        items.stats = stats
        return items


class FetchedItems(list):
    """A step's loaded samples plus what fetching them cost (read by `collate`)."""

    stats: FetchStats | None = None
