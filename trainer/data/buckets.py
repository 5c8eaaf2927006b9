"""Aspect-ratio buckets (`data.buckets`): the bucket list, each image's bucket, the size manifest and the
bucketed training split.

Real photos are not square, and centre-cropping them to squares trains on a fraction of each picture
(a 3:2 photo loses a third). SDXL and PixArt train on buckets instead: a list of (height, width) shapes
of about one pixel budget, each image resized to cover the bucket nearest its aspect ratio and cropped
to it, and every global batch drawn from one bucket so it stacks into one tensor. The order of those
batches is `trainer.data.sampler.BucketStream`'s (a function of (seed, epoch), resumable at any step);
this module decides which image goes where.

The assignment needs each image's size. It is read from the header only (PIL opens lazily: no pixels
are decoded) once per dataset version and kept in a manifest in the run's folder
(`run.dir/data/buckets-<listing digest>.json`), keyed by a digest of the folder listing (every image's
path, byte size and modification time). The digest of (listing, buckets, rules) is the run's
`data.buckets` order key: a checkpoint records it, and a resume on changed data is refused (exit 2)
rather than mixing two assignments in one epoch.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch
from PIL import Image

from trainer.data.sampler import BucketStream, SampleRef
from trainer.errors import ConfigError
from trainer.randomness import derive_seed

log = logging.getLogger(__name__)

Bucket = tuple[int, int]  # (height, width)

MANIFEST_FORMAT = 1
# A generated bucket holds at least this share of the pixel budget (and at most all of it): at 1024^2, step
# 64 and ratio 4 this gives SDXL's list (tests/test_buckets.py).
MIN_FILL = 0.9
_CROP_TAG = 0xC809  # keys a sample's crop offsets apart from its flip (bit 0 of its aug seed)
_RATIO_SLACK = 1e-6  # aspect ratios this close to the limit are within it (float rounding)


def generate_buckets(pixels: int, step: int = 64, max_ratio: float = 4.0, min_fill: float = MIN_FILL) -> list[Bucket]:
    """Every (height, width), both multiples of `step`, whose area lies in [min_fill x pixels, pixels] and
    whose aspect ratio (long side over short) is at most `max_ratio`; sorted by height / width.

    This is the rule SDXL's and PixArt's lists follow: at 1024^2, step 64, ratio 4 it gives SDXL's 40
    buckets (Podell et al. 2023, appendix I) and the mirror (1344, 704) of its (704, 1344); PixArt's
    ASPECT_RATIO_1024_BIN and ASPECT_RATIO_512_BIN (step 32) are subsets of its lists."""
    if pixels < step * step:
        raise ValueError(f"a pixel budget of {pixels} holds no {step}x{step} bucket")
    longest = int(math.sqrt(pixels * max_ratio)) // step * step
    out = [
        (h, w)
        for h in range(step, longest + 1, step)
        for w in range(step, longest + 1, step)
        if min_fill * pixels <= h * w <= pixels and max(h, w) / min(h, w) <= max_ratio + _RATIO_SLACK
    ]
    return sorted(out, key=lambda b: (b[0] / b[1], b[0]))


def bucket_list(data) -> list[Bucket]:
    """The run's buckets (`data.buckets`: a list, or "auto" from data.image_size^2, data.bucket_step and
    data.bucket_max_ratio), sorted by aspect ratio; ConfigError naming the key for any that cannot be used."""
    step = data.bucket_step
    if data.buckets == "auto":
        found = generate_buckets(data.image_size**2, step, data.bucket_max_ratio)
        if not found:
            raise ConfigError(
                f"data.buckets=auto: no bucket of {data.image_size}^2 pixels with sides that are multiples of "
                f"data.bucket_step={step}; lower data.bucket_step or raise data.image_size"
            )
        return found
    buckets = [(int(h), int(w)) for h, w in data.buckets]
    bad = [b for b in buckets if b[0] % step or b[1] % step]
    if bad:
        raise ConfigError(
            f"data.buckets: {', '.join(f'{h}x{w}' for h, w in bad)} are not multiples of data.bucket_step={step} "
            "(the model's downsampling factor must divide both sides): round them, or set data.bucket_step"
        )
    if len(set(buckets)) != len(buckets):
        raise ConfigError("data.buckets lists a (height, width) twice: list each bucket once")
    return sorted(buckets, key=lambda b: (b[0] / b[1], b[0]))


def trained_buckets(data) -> list[Bucket] | None:
    """The buckets a run's config (`data.*`, as a checkpoint records it) trains at; None without data.buckets.
    What the task checks against its model's size factor, and `gentrain sample --height/--width` against."""
    return None if data.buckets is None else bucket_list(data)


def nearest_buckets(sizes: np.ndarray, buckets: Sequence[Bucket]) -> np.ndarray:
    """Per (height, width) row of `sizes`, the index of the bucket nearest its aspect ratio in log-ratio
    distance |ln(h/w) - ln(bh/bw)| (a 2:1 and a 1:2 image are equally far from a square); ties go to the
    first in the list."""
    log_ratio = np.log(sizes[:, 0] / sizes[:, 1])[:, None]
    bucket_log = np.log(np.asarray([h / w for h, w in buckets]))[None, :]
    return np.abs(log_ratio - bucket_log).argmin(axis=1)


class BucketPlan:
    """Each dataset image's bucket (-1: skipped, with the reason counted), from the images' sizes.

    Skipped, never silently: an image whose aspect ratio is beyond `max_ratio` (`too extreme`), one that
    would need upscaling by more than 1 / `min_fraction` to cover its bucket (`too small`; 0 = never), and
    one whose header cannot be read (`unreadable`). Each is counted and logged at start, and listed in the
    manifest's `skipped`."""

    def __init__(
        self,
        sizes: Sequence[tuple[int, int] | None],
        buckets: Sequence[Bucket],
        max_ratio: float,
        min_fraction: float,
    ):
        self.buckets = list(buckets)
        n = len(sizes)
        self.assign = np.full(n, -1, dtype=np.int64)
        self.reasons: dict[int, str] = {}
        known = [i for i, s in enumerate(sizes) if s is not None and s[0] > 0 and s[1] > 0]
        for i in set(range(n)) - set(known):
            self.reasons[i] = "unreadable"
        if not known:
            return
        hw = np.asarray([sizes[i] for i in known], dtype=np.float64)
        nearest = nearest_buckets(hw, self.buckets)
        table = np.asarray(self.buckets, dtype=np.float64)[nearest]
        ratio = np.maximum(hw[:, 0] / hw[:, 1], hw[:, 1] / hw[:, 0])
        cover = np.maximum(table[:, 0] / hw[:, 0], table[:, 1] / hw[:, 1])  # the upscale covering the bucket
        for row, i in enumerate(known):
            if ratio[row] > max_ratio + _RATIO_SLACK:
                self.reasons[i] = "too extreme"
            elif min_fraction > 0 and cover[row] > 1 / min_fraction + _RATIO_SLACK:
                self.reasons[i] = "too small"
            else:
                self.assign[i] = int(nearest[row])

    @classmethod
    def from_assignment(cls, assign: Sequence[int], buckets: Sequence[Bucket]) -> BucketPlan:
        """A plan whose buckets were decided before (`gentrain data encode`'s, recorded per sample; -1:
        unreadable, its index lost or refused)."""
        plan = cls([], buckets, 64.0, 0.0)
        plan.assign = np.asarray(assign, dtype=np.int64)
        plan.reasons = {int(i): "unreadable" for i in np.flatnonzero(plan.assign < 0)}
        return plan

    def counts(self, indices: Sequence[int] | None = None) -> dict[str, int]:
        """Skipped images by reason (of `indices` only, when given)."""
        chosen = self.reasons if indices is None else {i: self.reasons[i] for i in indices if i in self.reasons}
        out: dict[str, int] = {}
        for why in chosen.values():
            out[why] = out.get(why, 0) + 1
        return dict(sorted(out.items()))


# ------------------------------------------------------------------------------------------------ the manifest


def listing_digest(store, files: Sequence[PurePath]) -> str:
    """blake3 of every image's path (relative to the folder), byte size and modification time: a new,
    removed, renamed or rewritten image changes it. Local folders: one stat per file; stores: one listing."""
    import blake3

    base = store.base()
    h = blake3.blake3()
    if not store.remote:
        for p in files:
            st = os.stat(p)
            h.update(json.dumps([str(PurePath(p).relative_to(base)), st.st_size, st.st_mtime_ns]).encode() + b"\n")
    else:
        details = store.fs.find(str(base), detail=True)
        for p in files:
            info = details.get(str(p), {})
            stamp = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
            h.update(json.dumps([str(p.relative_to(base)), info.get("size"), str(stamp)]).encode() + b"\n")
    return h.hexdigest()


def read_size(store, path: PurePath) -> tuple[int, int] | None:
    """(height, width) from the image's header (PIL's lazy open decodes no pixels); None: unreadable."""
    try:
        if store.remote:
            with store.fs.open(str(path), "rb") as f, Image.open(f) as im:
                w, h = im.size
        else:
            with Image.open(path) as im:
                w, h = im.size
    except Exception:  # noqa: BLE001 - any defect of the file makes it unreadable, counted as such
        return None
    return int(h), int(w)


def image_sizes(store, files: Sequence[PurePath], cache_dir: str | None) -> tuple[list, str]:
    """(each image's (height, width) or None, the listing digest). Read from the manifest in `cache_dir`
    when one of this listing is there, else from the headers (and written there for the next process:
    atomically, so processes that race write the same file)."""
    digest = listing_digest(store, files)
    sizes = cached_sizes(digest, len(files), cache_dir, lambda: [read_size(store, p) for p in files])
    return [tuple(s) if s else None for s in sizes], digest


def cached_sizes(digest: str, count: int, cache_dir: str | None, read, what: str = "images") -> list:
    """`count` per-sample values (JSON: a size, a bucket number, None) of the dataset version `digest`: from
    the manifest `cache_dir/data/buckets-<digest>.json` when it holds them, else `read()` (one pass over the
    data), written there for the next process (atomically: processes that race write the same file). Every
    source's sizes are kept this way (trainer.data.bucket_sources: HF datasets, shards, latent shards)."""
    path = Path(cache_dir, "data", f"buckets-{digest[:32]}.json") if cache_dir else None
    if path is not None and path.exists():
        try:
            saved = json.loads(path.read_text())
            if saved.get("format") == MANIFEST_FORMAT and saved.get("listing") == digest:
                sizes = saved["sizes"]
                if isinstance(sizes, list) and len(sizes) == count:
                    log.info("sizes of %d %s from %s", count, what, path)
                    return sizes
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged manifest is read again from the data
    sizes = [list(s) if isinstance(s, tuple) else s for s in read()]
    log.info("read the sizes of %d %s from the data", count, what)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"format": MANIFEST_FORMAT, "listing": digest, "sizes": sizes}))
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not write the size manifest %s (%s): sizes are read again next time", path, e)
    return sizes


def plan_digest(listing: str, buckets: Sequence[Bucket], max_ratio: float, min_fraction: float) -> str:
    """What the assignment is a function of: the listing and the rules (pinned in checkpoints' order keys)."""
    import blake3

    what = {"listing": listing, "buckets": [list(b) for b in buckets], "max_ratio": max_ratio, "min": min_fraction}
    return blake3.blake3(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------- crop and resize


def cover_size(h: int, w: int, height: int, width: int) -> tuple[int, int]:
    """(height, width) of an h x w image resized to cover height x width (its aspect ratio kept): the
    size `cover_crop` and the square loader (`datasets.resize_center_crop`) resize to."""
    scale = max(height / h, width / w)
    return max(height, round(h * scale)), max(width, round(w * scale))


def cover_crop(im: Image.Image, height: int, width: int, crop: str, aug_seed: int) -> tuple[Image.Image, int, int]:
    """`im` resized (bicubic) so it covers height x width, then cropped to it: centred, or (crop="random")
    at an offset drawn from the sample's augmentation seed, so a resumed run crops what the uninterrupted
    one did. Returns (image, top, left) in the resized image's pixels."""
    w, h = im.size
    nh, nw = cover_size(h, w, height, width)
    im = im.resize((nw, nh), Image.Resampling.BICUBIC)
    if crop == "random":
        g = np.random.default_rng(derive_seed(aug_seed, _CROP_TAG))
        top, left = int(g.integers(0, nh - height + 1)), int(g.integers(0, nw - width + 1))
    else:
        top, left = (nh - height) // 2, (nw - width) // 2
    return im.crop((left, top, left + width, top + height)), top, left


# The extras key of each sample's size micro-conditions (`size_conditions`): what SDXL's time ids and PixArt's
# resolution and aspect-ratio conditions are made of in training (trainer/tasks/ddpm.py, DDPMTask.conditions).
SIZE_CONDITIONS = "size_conditions"


def size_conditions(
    original: tuple[int, int], top: int, left: int, target: tuple[int, int], resized_width: int, flipped: bool
) -> torch.Tensor:
    """(6,) float32: original height and width (before any resize), crop top and left (in the resized image's
    pixels) and target height and width (the bucket), as SDXL defines its micro-conditions (Podell et al.
    2023, 2.2; diffusers' train_text_to_image_sdxl.py). A mirrored sample's crop is the mirror's: diffusers'
    script flips before it crops, so its left is counted from the other side of the resized image."""
    if flipped:
        left = resized_width - target[1] - left
    return torch.tensor([*original, top, left, *target], dtype=torch.float32)


def to_tensor(im: Image.Image, channels: int) -> torch.Tensor:
    """(C, H, W) float in [-1, 1]."""
    im = im.convert("L" if channels == 1 else "RGB")
    arr = np.asarray(im, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).reshape(im.size[1], im.size[0], channels).permute(2, 0, 1).contiguous()


def load_in_bucket(
    im: Image.Image, size: tuple[int, int], channels: int, crop: str, aug_seed: int, flipped: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`im` in its (height, width) bucket `size`: (C, H, W) in [-1, 1], covered and cropped (`cover_crop`),
    mirrored when `flipped`, and its size micro-conditions (`size_conditions`). The HF and shard sources load
    a bucketed sample with it (trainer/data/bucket_sources.py); the folder's loader takes the same steps."""
    original = (im.size[1], im.size[0])
    cropped, top, left = cover_crop(im.convert("L" if channels == 1 else "RGB"), size[0], size[1], crop, aug_seed)
    x = to_tensor(cropped, channels)
    resized_width = cover_size(*original, size[0], size[1])[1]
    conditions = size_conditions(original, top, left, (size[0], size[1]), resized_width, flipped)
    return (x.flip(-1) if flipped else x), conditions


# ------------------------------------------------------------------------------------------------ the training set


class BucketedSubset:
    """The training split of an image folder in aspect-ratio buckets: only the images with a bucket, each
    loaded at its bucket's shape; `make_stream` gives the bucketed order. The validation split, previews
    and FID keep square `data.image_size` crops."""

    encoding = None  # images, never `gentrain data encode` latents (see ShardSplit.encoding)

    def __init__(
        self,
        dataset,
        indices: np.ndarray,
        flip: bool,
        channels: int,
        plan: BucketPlan,
        digest: str,
        global_batch: int,
    ):
        self.dataset = dataset
        self.global_batch = global_batch
        self.flip = flip
        self.channels = channels
        self.plan = plan
        self.digest = digest
        self.indices = np.asarray([i for i in indices.tolist() if plan.assign[i] >= 0], dtype=np.int64)
        self.skipped = plan.counts(indices.tolist())
        self.image_shape = (channels, *plan.buckets[0])  # one bucket's; each sample's is its own bucket's
        local = plan.assign[self.indices]
        self.members = [np.flatnonzero(local == k) for k in range(len(plan.buckets))]
        refuse_all_skipped(len(self.indices), self.skipped, "image")

    def __len__(self) -> int:
        return len(self.indices)

    def bucket_of(self, local: int) -> Bucket:
        return self.plan.buckets[int(self.plan.assign[self.indices[local]])]

    def make_stream(self, seed: int) -> BucketStream:
        return BucketStream(self.members, seed, self.global_batch)

    def order_keys(self) -> dict[str, Any]:
        """What the bucketed order is a function of besides the seed (checkpoints record it): the digest of
        the images' listing and the bucket rules, and the global batch the buckets are cut into."""
        return {"data.buckets": self.digest, "train.batch_size": self.global_batch}

    def summary(self) -> str:
        return bucket_summary(len(self), self.members, len(self.plan.buckets), self.skipped, "image")

    def __getitem__(self, ref: SampleRef):
        """A training ref (it carries the run's seed) loads at its bucket's shape; a held-out ref (no seed:
        previews, calibration or validation batches drawn from the training split) at the square
        `data.image_size`, so those batches, made of any images, stack."""
        from trainer.data.datasets import skipped_item  # here: datasets.py imports this module's crop in its loader

        index = int(self.indices[ref.index])
        if ref.seed is None:
            size = self.dataset.image_size
            height, width = size, size
        else:
            height, width = self.bucket_of(ref.index)
        item = self.dataset.load(index, ref.aug_seed, self.flip, size=(height, width))
        if item is None:
            return skipped_item((self.channels, height, width), index, ref.position, self.dataset.skip_reason(index))
        image, label, *rest = item
        return image, label, index, ref.position, True, (rest[0] if rest else {})


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {why}" for why, n in counts.items()) or "none"


def refuse_all_skipped(kept: int, skipped: dict[str, int], what: str) -> None:
    """Exit 2 when a bucketed training split kept no `what` (image: a folder's, sample: a shard source's)."""
    if kept == 0:
        raise ConfigError(
            f"data.buckets: every training {what} was skipped ({_counts_text(skipped)}): check "
            "data.bucket_max_ratio and data.bucket_min_fraction against the images"
        )


def bucket_summary(kept: int, members: list, n_buckets: int, skipped: dict[str, int], what: str) -> str:
    """A bucketed training split's log line: its `what`s (image, sample), the buckets they fill, the skips."""
    used = sum(1 for m in members if len(m))
    skips = f"; skipped {_counts_text(skipped)}" if skipped else ""
    return f"{kept} training {what}s in {used} of {n_buckets} aspect-ratio buckets{skips}"
