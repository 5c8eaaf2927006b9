"""Datasets, the validation split and the resumable per-rank loader."""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.utils.data import DataLoader

from trainer.config import Config
from trainer.data.datasets import DigitsDataset, ImageFolderDataset, Subset, collate
from trainer.data.hf import HFDataset
from trainer.data.joint import JointSet
from trainer.data.sampler import SampleRef, SampleStream, StepBatchSampler
from trainer.data.shards import ShardSet, ShardSplit, load_shard_list
from trainer.data.shards.encoded import EncodedSettings
from trainer.data.video import MovingDigitsDataset, VideoFolderDataset, import_av
from trainer.errors import ConfigError

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
    return cfg.data.source in VIDEO_SOURCES or (cfg.data.source == "shards" and cfg.data.num_frames > 1)


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
        return MovingDigitsDataset(d.image_size, d.channels, d.num_frames, d.path_jitter)
    if d.source == "video":
        return VideoFolderDataset(d.path, d.image_size, d.channels, d.num_frames, d.frame_stride)
    if d.source == "hf":
        return HFDataset(
            d.path,
            d.image_size,
            d.channels,
            split=d.hf_split,
            image_column=d.image_column,
            caption_column=d.caption_column,
            caption_required="caption_column" in d.model_fields_set,
            label_column=d.label_column,
            storage_options=d.storage_options,
            check_readable=d.max_skipped_fraction < 1,
            crop=d.crop,
        )
    return ImageFolderDataset(
        d.path,
        d.image_size,
        d.channels,
        caption_column=d.caption_column,
        storage_options=d.storage_options,
        crop=d.crop,
        sizes=True,  # each sample's size and crop: SDXL's and PixArt's micro-conditions (DDPMTask.conditions)
    )


def build_splits(cfg: Config) -> tuple[Subset, Subset | None, int | None]:
    """(train, validation or None, number of classes or None)."""
    if cfg.data.source == "shards":
        train, val, num_classes = build_shard_splits(cfg)
        if cfg.data.buckets is not None or (train.encoding is not None and train.encoding.buckets is not None):
            # Imported here: only a run in buckets needs it (it reads each sample's size once per data version).
            from trainer.data.bucket_sources import bucketed_shards

            train, val = bucketed_shards(cfg, train, val)
    else:
        train, val, num_classes = split(build_dataset(cfg), cfg.data.val_fraction, cfg.data.flip, sample_shape(cfg))
        if cfg.data.buckets is not None:
            train = bucketed(cfg, train)
        if cfg.data.instance is not None:
            # Imported here: only a DreamBooth run (data.instance) needs it.
            from trainer.data.dreambooth import dreambooth_splits

            train, val = dreambooth_splits(cfg, train, val)
    if cfg.data.image_ratio > 0:
        train, num_classes = joint_split(cfg, train, num_classes)
    return train, val, num_classes


def split(ds, val_fraction: float, flip: bool, shape: tuple[int, ...]) -> tuple[Subset, Subset | None, int | None]:
    n = len(ds)
    perm = np.random.default_rng(_SPLIT_SEED).permutation(n)
    n_val = int(n * val_fraction)
    train_idx = np.sort(perm[n_val:])
    val_idx = np.sort(perm[:n_val])
    train = Subset(ds, train_idx, flip, shape)
    val = Subset(ds, val_idx, False, shape) if n_val else None
    return train, val, getattr(ds, "num_classes", None)


def bucketed(cfg: Config, train: Subset):
    """The training split in aspect-ratio buckets (trainer.data.buckets): each image's size from the run's
    size manifest or its header, its bucket, the skipped ones counted and logged."""
    # Imported here: only a run with data.buckets needs it (it reads image headers once per dataset version).
    from trainer.data.buckets import BucketedSubset, BucketPlan, bucket_list, image_sizes, plan_digest

    d, ds = cfg.data, train.dataset
    buckets = bucket_list(d)
    if isinstance(ds, HFDataset):
        from trainer.data.bucket_sources import hf_sizes  # here: only a bucketed HF run reads its rows' sizes

        sizes, listing = hf_sizes(ds, cfg.run_dir)
    else:
        sizes, listing = image_sizes(ds.store, ds.files, cfg.run_dir)
    plan = BucketPlan(sizes, buckets, d.bucket_max_ratio, d.bucket_min_fraction)
    digest = plan_digest(listing, buckets, d.bucket_max_ratio, d.bucket_min_fraction)
    out = BucketedSubset(ds, train.indices, train.flip, d.channels, plan, digest, cfg.train.batch_size)
    logging.getLogger(__name__).info("data.buckets: %s (assignment %s)", out.summary(), digest)
    return out


def _image_dataset(cfg: Config):
    d = cfg.data
    if d.image_source == "digits":
        return DigitsDataset(d.image_size, d.channels)
    return ImageFolderDataset(
        d.image_path,
        d.image_size,
        d.channels,
        key="data.image_path",
        caption_column=d.caption_column,
        storage_options=d.storage_options,
    )


def joint_split(cfg: Config, clips, clip_classes: int | None):
    """(joint image+video training set, number of classes): the clip training split plus the image source's
    training split (the same held-out fraction as any image set; validation stays on clips). Image labels
    follow the clip classes, so class conditioning tells "a seven" from "a seven moving left"."""
    d = cfg.data
    image_ds = _image_dataset(cfg)
    images, _, image_classes = split(image_ds, d.val_fraction, d.flip, (d.channels, d.image_size, d.image_size))
    joint = JointSet(clips, images, d.image_ratio, sample_shape(cfg), label_offset=clip_classes or 0)
    if clip_classes is None and image_classes is None:
        return joint, None
    return joint, (clip_classes or 0) + (image_classes or 0)


def build_shard_splits(cfg: Config):
    """Shard source: train and validation `ShardSplit`s (by `data.val_urls`, else `data.val_fraction` per shard)."""
    d = cfg.data
    shape = sample_shape(cfg)
    frames = d.num_frames if is_video(cfg) else 1
    if frames > 1:  # clips in the shards: PyAV at start (exit 2 naming the extra), not in the loader's workers
        import_av(f"data.source=shards with data.num_frames={frames}")

    def shard_set(urls, key: str) -> ShardSet:
        return ShardSet(
            load_shard_list(urls, d.storage_options, key),
            d.storage_options,
            d.image_size,
            d.channels,
            retries=d.read_retries,
            num_frames=frames,
            frame_stride=d.frame_stride,
            merge_gap=d.read_merge_gap,
            crop=d.crop,
        )

    train_set = shard_set(d.urls, "data.urls")
    encoded = check_encoded(cfg, train_set.shards.encoded)
    val_set = shard_set(d.val_urls, "data.val_urls") if d.val_urls else None
    if val_set is not None and val_set.shards.encoded != encoded:
        raise ConfigError(
            f"data.val_urls={d.val_urls!r} are {_what(val_set.shards.encoded)} but data.urls={d.urls!r} are "
            f"{_what(encoded)}: validate on shards made the same way"
        )
    if encoded is not None:
        shape = encoded.posterior_shape()
    if val_set is not None:
        train = ShardSplit(train_set, "all", 0.0, d.flip, shape, d.shard_window, d.shuffle_block)
        val = ShardSplit(val_set, "all", 0.0, False, shape)
    else:
        train = ShardSplit(train_set, "train", d.val_fraction, d.flip, shape, d.shard_window, d.shuffle_block)
        val = ShardSplit(train_set, "val", d.val_fraction, False, shape)
    if len(train) == 0:
        raise ConfigError(f"data.urls={d.urls!r}: no training samples")
    train.encoding = val.encoding = encoded
    return train, (val if len(val) else None), train_set.num_classes


def _what(encoded: EncodedSettings | None) -> str:
    if encoded is None:
        return "image shards"
    return f"latents encoded by the autoencoder {encoded.autoencoder.digest}"


def check_encoded(cfg: Config, encoded: EncodedSettings | None) -> EncodedSettings | None:
    """The `encoded` settings of `gentrain data encode`'s shards (None: image shards), checked against the
    run: latents need a latent diffusion model of the same image geometry; `data.encoded` (when set) says
    which kind the run expects. Everything here exits 2 before a model is built."""
    d = cfg.data
    urls = f"data.urls={d.urls!r}"
    if d.encoded is True and encoded is None:
        raise ConfigError(
            f"data.encoded=true but {urls} are image shards (their shards.json has no `encoded` settings): encode "
            "them with `gentrain data encode`, point data.urls at the shards.json it wrote, or set data.encoded=false"
        )
    if encoded is None:
        return None
    if d.encoded is False:
        raise ConfigError(
            f"data.encoded=false but {urls} are {_what(encoded)}, not images: point data.urls at image shards, "
            "or unset data.encoded"
        )
    if getattr(cfg.model_cfg, "autoencoder", None) is None:
        raise ConfigError(
            f"{urls} are {_what(encoded)}, not images, and this {cfg.task} model has no model.autoencoder to "
            "decode them: set model.autoencoder.url to that autoencoder, or point data.urls at image shards"
        )
    for key, made in (("image_size", encoded.image_size), ("channels", encoded.channels)):
        if getattr(d, key) != made:
            raise ConfigError(
                f"data.{key}={getattr(d, key)} but {urls} were encoded from {key}={made}: set "
                f"data.{key}={made}, or encode the images again at {getattr(d, key)}"
            )
    if d.flip and not encoded.flip:
        raise ConfigError(
            f"data.flip=true but {urls} hold no posteriors of the mirrored images (encoded without --flip): "
            "set data.flip=false, or encode again with --flip"
        )
    if d.num_frames > 1:
        raise ConfigError(f"data.num_frames={d.num_frames}: {urls} hold image latents, not clips")
    if cfg.eval.every_steps:
        raise ConfigError(
            f"eval.every_steps={cfg.eval.every_steps}: FID compares samples with real images, and {urls} hold "
            "latents; set eval.every_steps=0 and run `gentrain eval` with data.* naming the images"
        )
    return encoded


def build_train_loader(
    train: Subset, cfg: Config, cursor: int, rank: int, world_size: int, device: torch.device | None = None
) -> DataLoader:
    """This rank's loader from global position `cursor`. On CUDA (`device`) batches come in pinned memory
    (`train.pin_memory`), which the step copies without blocking; on CPU nothing is pinned (a no-op)."""
    stream = train.make_stream(cfg.seed)
    sampler = StepBatchSampler(stream, cursor, cfg.train.batch_size, rank, world_size)
    workers = cfg.train.num_workers
    cuda = device is not None and device.type == "cuda"
    return DataLoader(
        train,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=workers,
        persistent_workers=False,
        prefetch_factor=cfg.train.prefetch_factor if workers else None,
        # No pin_memory_device: torch pins for the current accelerator (this rank's device) and warns, from
        # 2.11, at every iterator a loader given one makes.
        pin_memory=cfg.train.pin_memory and cuda,
    )


def validation_refs(val: Subset, batch_size: int, batches: int, rank: int, world_size: int) -> list[list[SampleRef]]:
    """Fixed validation batches (the first `batches` of the split, in order), this rank's share."""
    total = min(len(val), batch_size * batches)
    mine = list(range(rank, total, world_size))
    refs = [SampleRef(index=i, position=i) for i in mine]
    return [refs[i : i + batch_size] for i in range(0, len(refs), batch_size)]
