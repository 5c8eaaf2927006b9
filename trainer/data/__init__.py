"""Datasets, the validation split and the resumable per-rank loader."""

from __future__ import annotations

import numpy as np
from torch.utils.data import DataLoader

from trainer.config import Config, ConfigError
from trainer.data.datasets import DigitsDataset, ImageFolderDataset, Subset, collate
from trainer.data.sampler import SampleRef, SampleStream, StepBatchSampler

__all__ = [
    "build_splits",
    "build_train_loader",
    "is_video",
    "sample_shape",
    "SampleStream",
    "SampleRef",
    "Subset",
    "collate",
]

# The train/validation split must not move when the training seed changes.
_SPLIT_SEED = 20240917


VIDEO_SOURCES = ("moving-digits", "video")


def is_video(cfg: Config) -> bool:
    """Whether batches are clips (N, T, C, H, W) rather than images (N, C, H, W)."""
    return cfg.data.source in VIDEO_SOURCES


def sample_shape(cfg: Config) -> tuple[int, ...]:
    """One sample's shape: (C, H, W) for images, (T, C, H, W) for clips."""
    d = cfg.data
    image = (d.channels, d.image_size, d.image_size)
    return (d.num_frames, *image) if is_video(cfg) else image


def build_dataset(cfg: Config):
    d = cfg.data
    if d.source == "digits":
        return DigitsDataset(d.image_size, d.channels)
    if d.source == "moving-digits":
        from trainer.data.video import MovingDigitsDataset

        return MovingDigitsDataset(d.image_size, d.channels, d.num_frames)
    if d.source == "video":
        from trainer.data.video import VideoFolderDataset

        return VideoFolderDataset(d.path, d.image_size, d.channels, d.num_frames, d.frame_stride)
    return ImageFolderDataset(d.path, d.image_size, d.channels)


def build_splits(cfg: Config) -> tuple[Subset, Subset | None, int | None]:
    """(train, validation or None, number of classes or None)."""
    if cfg.data.source == "shards":
        return build_shard_splits(cfg)
    ds = build_dataset(cfg)
    n = len(ds)
    perm = np.random.default_rng(_SPLIT_SEED).permutation(n)
    n_val = int(n * cfg.data.val_fraction)
    train_idx = np.sort(perm[n_val:])
    val_idx = np.sort(perm[:n_val])
    shape = sample_shape(cfg)
    train = Subset(ds, train_idx, cfg.data.flip, shape)
    val = Subset(ds, val_idx, False, shape) if n_val else None
    return train, val, getattr(ds, "num_classes", None)


def build_shard_splits(cfg: Config):
    """Shard source: train and validation `ShardSplit`s (by `data.val_urls`, else `data.val_fraction` per shard)."""
    from trainer.data.shards import ShardSet, ShardSplit, load_shard_list

    d = cfg.data
    shape = (d.channels, d.image_size, d.image_size)

    def shard_set(urls, key: str) -> ShardSet:
        return ShardSet(load_shard_list(urls, d.storage_options, key), d.storage_options, d.image_size,
                        d.channels, retries=d.read_retries)  # fmt: skip

    train_set = shard_set(d.urls, "data.urls")
    if d.val_urls:
        train = ShardSplit(train_set, "all", 0.0, d.flip, shape, d.shard_window)
        val = ShardSplit(shard_set(d.val_urls, "data.val_urls"), "all", 0.0, False, shape)
    else:
        train = ShardSplit(train_set, "train", d.val_fraction, d.flip, shape, d.shard_window)
        val = ShardSplit(train_set, "val", d.val_fraction, False, shape)
    if len(train) == 0:
        raise ConfigError(f"data.urls={d.urls!r}: no training samples")
    return train, (val if len(val) else None), train_set.num_classes


def build_train_loader(train: Subset, cfg: Config, cursor: int, rank: int, world_size: int) -> DataLoader:
    stream = train.make_stream(cfg.seed)
    sampler = StepBatchSampler(stream, cursor, cfg.train.batch_size, rank, world_size)
    workers = cfg.train.num_workers
    return DataLoader(
        train,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=workers,
        persistent_workers=False,
        prefetch_factor=2 if workers else None,
    )


def validation_refs(val: Subset, batch_size: int, batches: int, rank: int, world_size: int) -> list[list[SampleRef]]:
    """Fixed validation batches (the first `batches` of the split, in order), this rank's share."""
    total = min(len(val), batch_size * batches)
    mine = list(range(rank, total, world_size))
    refs = [SampleRef(index=i, position=i, aug_seed=0) for i in mine]
    return [refs[i : i + batch_size] for i in range(0, len(refs), batch_size)]
