"""Aspect-ratio buckets (`data.buckets`, trainer/data/buckets.py) for the sources that are not image folders:
Hugging Face datasets (`data.source=hf`), webdataset shards of images and `gentrain data encode`'s latent
shards (`data.source=shards`).

The order is the folder's, `BucketStream` over each bucket's members, so its rules hold unchanged (one bucket
a global batch, every sample once a pass, the same stream at any world size, accumulation and
micro-batching, exact resume). What differs per source is where each sample's size comes from and what
names the dataset's version (the digest the assignment, and so the checkpoints' `data.buckets` order key,
is pinned by):

- hf: integer `width` and `height` columns when the split has both (no image opened), else every row's image
  header (one pass); the version: the listing of `data.path` (each file's path, size and mtime or ETag),
  the split and the image column.
- image shards: the `sizes` a shard's `.idx.json` lists when it has them, else every sample's image header
  (one pass, one shard read at a time); the version: the shard list (URLs, counts, pinned digests) and each
  tar's and index's size and mtime or ETag.
- latent shards: each sample's bucket as `gentrain data encode` recorded it in its shard's index (`buckets`),
  the index checked against the digest `shards.json` pins; the version: those index digests.

Each is read once per version and kept in `run.dir/data/buckets-<digest>.json` (`buckets.cached_sizes`).

Shards and buckets: the shard order's locality (`data.shard_window` shards shuffled together, runs of
`data.shuffle_block` neighbours) cannot hold with buckets: a global batch takes `train.batch_size` samples of
one bucket from anywhere in the set, so a bucketed run reads one byte range per sample (from any shard, all
of a step's concurrently) and both keys do nothing (logged at start when set). No order rule is lost: the
shard source reads any sample by its byte range, so the bucketed stream is the folder's.
"""

from __future__ import annotations

import io
import json
import logging
import posixpath
from dataclasses import replace
from typing import Any

import blake3
import numpy as np
from PIL import Image

from trainer.data.buckets import (
    BucketPlan,
    bucket_list,
    bucket_summary,
    cached_sizes,
    plan_digest,
    refuse_all_skipped,
)
from trainer.data.datasets import IMAGE_EXTENSIONS
from trainer.data.sampler import BucketStream, SampleRef
from trainer.data.shards.encoded import EncodedSettings
from trainer.data.shards.index import digest as blob_digest
from trainer.data.shards.index import index_url, read_index, strip_protocol, url_dir
from trainer.data.shards.tar import parse_samples
from trainer.errors import ConfigError
from trainer.storage import filesystem

log = logging.getLogger(__name__)

_IMAGE_EXTS = tuple(e.lstrip(".") for e in IMAGE_EXTENSIONS)
_SIZE_COLUMNS = ("height", "width")


def _stamp(info: dict) -> str:
    return str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")


def _header_size(raw: bytes) -> list[int] | None:
    """[height, width] from an image's header (PIL opens lazily: no pixels decoded); None: unreadable."""
    try:
        with Image.open(io.BytesIO(raw)) as im:
            w, h = im.size
    except Exception:  # noqa: BLE001 - any defect makes the sample unreadable, counted as such
        return None
    return [int(h), int(w)]


# ------------------------------------------------------------------------------------------------ hf datasets


def hf_digest(ds) -> str:
    """The version of an HF dataset split: every file below `data.path` (or the files its glob names) with
    its size and mtime or ETag, the split and the image column."""
    fs, root = filesystem(ds.path, ds.storage_options)
    if any(c in root for c in "*?["):
        found = fs.glob(root, detail=True)
    elif fs.isfile(root):
        found = {root: fs.info(root)}
    else:
        found = fs.find(root, detail=True)
    h = blake3.blake3()
    h.update(json.dumps([ds.split, ds.image_column, len(ds)]).encode())
    for name in sorted(found):
        info = found[name]
        h.update(
            json.dumps([posixpath.relpath(name, root) if name != root else "", info.get("size"), _stamp(info)]).encode()
        )
    return h.hexdigest()


def hf_sizes(ds, cache_dir: str | None) -> tuple[list, str]:
    """(each row's (height, width) or None, the dataset version's digest)."""
    from trainer.data.hf import open_split  # here: hf.py imports `datasets` (the hf extra) at its use only

    digest = hf_digest(ds)

    def read() -> list:
        full = open_split(ds.path, ds.split, ds.storage_options)
        named = {c.lower(): c for c in full.column_names}
        if all(c in named for c in _SIZE_COLUMNS):
            table = full.select_columns([named[c] for c in _SIZE_COLUMNS]).with_format("arrow")
            h, w = (table[named[c]].to_pylist() for c in _SIZE_COLUMNS)
            if all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (*h, *w)):
                log.info("%s: sizes from its %r and %r columns", ds.path, named["height"], named["width"])
                return [[a, b] if a and b else None for a, b in zip(h, w, strict=True)]
        out = []
        for cell in ds.rows.with_format("arrow")[ds.image_column].to_pylist():
            try:
                with ds._open_image(cell) as im:
                    w, h = im.size
                out.append([int(h), int(w)])
            except Exception:  # noqa: BLE001 - an unusable cell: its row is counted unreadable
                out.append(None)
        return out

    sizes = cached_sizes(digest, len(ds), cache_dir, read, "rows")
    return [tuple(s) if s else None for s in sizes], digest


# ------------------------------------------------------------------------------------------------ image shards


def shards_digest(shardset) -> str:
    """The version of a shard set: its list (URLs, sample counts, pinned index digests) and each shard's
    tar and index with their size and mtime or ETag (one listing per folder)."""
    shards, fs = shardset.shards, shardset.fs
    h = blake3.blake3()
    h.update(json.dumps([shards.urls, shards.counts.tolist(), shards.index_digests]).encode())
    folders: dict[str, list[str]] = {}
    for url in shards.urls:
        folders.setdefault(url_dir(url), []).append(url)
    for folder, urls in folders.items():
        try:
            listing = {e["name"].rstrip("/"): e for e in fs.ls(strip_protocol(fs, folder), detail=True)}
        except FileNotFoundError:
            listing = {}
        for url in urls:
            for name in (url, index_url(url)):
                info = listing.get(strip_protocol(fs, name), {})
                h.update(json.dumps([name, info.get("size"), _stamp(info)]).encode() + b"\n")
    return h.hexdigest()


def _listed_sizes(listed: Any, count: int) -> list | None:
    """An index's `sizes` ([height, width] or null a sample) when it is well formed, else None."""
    if not isinstance(listed, list) or len(listed) != count:
        return None
    ok = all(
        s is None or (isinstance(s, list) and len(s) == 2 and all(type(v) is int and v > 0 for v in s)) for s in listed
    )
    return listed if ok else None


def _shard_sizes(shardset, shard: int) -> list:
    """[height, width] (None: unreadable) of every sample of one shard: its index's `sizes` when listed, else
    each image member's header from the whole shard read once. A shard that cannot be read (or whose index
    is not the one the list pins) gives None for each of its samples: counted unreadable, never silently."""
    shards, fs = shardset.shards, shardset.fs
    url, count = shards.urls[shard], int(shards.counts[shard])
    try:
        blob = fs.cat_file(strip_protocol(fs, index_url(url)), start=0)
        pin = shards.index_digests[shard] if shards.index_digests is not None else None
        if pin is not None and blob_digest(blob) != pin:
            raise ValueError(f"its index is not the one the shard list pins ({pin})")
        offsets, _, doc = read_index(blob, index_url(url))
        if len(offsets) - 1 != count:
            raise ValueError(f"index has {len(offsets) - 1} samples, the shard list says {count}")
        listed = _listed_sizes(doc.get("sizes"), count)
        if listed is not None:
            return listed
        data = fs.cat_file(strip_protocol(fs, url), start=0)
    except Exception as e:  # noqa: BLE001 - a shard unreadable at start: its samples are counted unreadable
        log.warning(
            "data.buckets: cannot read the sizes of shard %s (%s: %s): its samples are skipped",
            url,
            type(e).__name__,
            e,
        )
        return [None] * count
    out: list = []
    for members in parse_samples([data[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]):
        ext = None if isinstance(members, Exception) else next((e for e in _IMAGE_EXTS if e in members), None)
        out.append(_header_size(members[ext]) if ext is not None else None)
    return out


def shard_sizes(shardset, cache_dir: str | None) -> tuple[list, str]:
    """(each sample's (height, width) or None, by global id; the shard set version's digest)."""
    digest = shards_digest(shardset)

    def read() -> list:
        return [s for shard in range(len(shardset.shards.urls)) for s in _shard_sizes(shardset, shard)]

    sizes = cached_sizes(digest, len(shardset), cache_dir, read, "shard samples")
    return [tuple(s) if s else None for s in sizes], digest


# ------------------------------------------------------------------------------------------------ latent shards


def encoded_buckets(encoded: EncodedSettings) -> list[tuple[int, int]] | None:
    """The buckets a `gentrain data encode` set was encoded at (None: square, data.image_size)."""
    return [(h, w) for h, w in encoded.buckets.list] if encoded.buckets is not None else None


def _show(buckets: list[tuple[int, int]] | None) -> str:
    return "null" if buckets is None else "[" + ", ".join(f"[{h},{w}]" for h, w in buckets) + "]"


def check_encoded_buckets(cfg, encoded: EncodedSettings) -> list[tuple[int, int]] | None:
    """The run's buckets when they are the encode's (None: neither has any); ConfigError (exit 2) naming both
    otherwise: latents are at the shape they were encoded at, and no run can put them in other buckets."""
    d = cfg.data
    made = encoded_buckets(encoded)
    want = bucket_list(d) if d.buckets is not None else None
    if want != made:
        asked = "null" if d.buckets is None else f"{d.buckets if d.buckets == 'auto' else ''} {_show(want)}".strip()
        raise ConfigError(
            f"data.buckets={asked} but data.urls={d.urls!r} were encoded with data.buckets={_show(made)}: latents "
            "keep the shape they were encoded at; set data.buckets to the encode's list, or encode the images "
            "again with these buckets"
        )
    return made


def encoded_assignment(shardset, cache_dir: str | None) -> tuple[np.ndarray, str]:
    """(each sample's bucket number by global id, -1 where its shard's index is gone or not the pinned one;
    the digest of the set's pinned index digests)."""
    shards, buckets = shardset.shards, encoded_buckets(shardset.shards.encoded) or []
    digest = blake3.blake3(json.dumps([shards.counts.tolist(), shards.index_digests]).encode()).hexdigest()

    def read() -> list:
        fs = shardset.fs
        paths = [strip_protocol(fs, index_url(u)) for u in shards.urls]
        blobs = fs.cat(paths, on_error="return", start=0)
        out: list = []
        for shard, path in enumerate(paths):
            count, blob = int(shards.counts[shard]), blobs.get(path)
            listed = None
            pin = shards.index_digests[shard] if shards.index_digests is not None else None
            if isinstance(blob, bytes) and blob_digest(blob) == pin:
                try:
                    listed = read_index(blob, path)[2].get("buckets")
                except ValueError:
                    listed = None
            if not (
                isinstance(listed, list)
                and len(listed) == count
                and all(type(k) is int and 0 <= k < len(buckets) for k in listed)
            ):
                log.warning(
                    "data.buckets: shard %s has no readable bucket list: its samples are skipped", shards.urls[shard]
                )
                listed = [None] * count
            out += listed
        return out

    values = cached_sizes(digest, len(shardset), cache_dir, read, "latent samples")
    return np.asarray([-1 if v is None else int(v) for v in values], dtype=np.int64), digest


# ------------------------------------------------------------------------------------------------ the splits


class BucketedShardSplit:
    """A shard split (`ShardSplit`) in aspect-ratio buckets: the samples with a bucket, numbered 0..len-1
    (each one's place in the split in `local`), each loaded at its bucket's shape (`shapes`: the image's
    (C, H, W) or the posterior's (2c, h, w)); `make_stream` gives the bucketed order. A held-out ref (no
    seed: previews, calibration) loads the square data.image_size from image shards; latent shards hold no
    other shape than each sample's bucket's, so there held-out ref i is sample i (cyclically) of the bucket
    holding the most, and a held-out batch stacks."""

    def __init__(self, split, plan: BucketPlan, digest: str, global_batch: int, shapes: list, square: bool):
        self.split = split
        self.plan = plan
        self.digest = digest
        self.global_batch = global_batch
        self.shapes = shapes
        self.square = square
        self.encoding = split.encoding
        self.flip = split.flip
        ss = split.shardset
        parts = [split.members(s) + ss.starts[s] for s in range(len(split.counts))]
        gids = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        assign = plan.assign[gids]
        self.local = np.flatnonzero(assign >= 0)
        self.bucket = assign[self.local]
        self.skipped = plan.counts(gids[assign < 0].tolist())
        self.members = [np.flatnonzero(self.bucket == k) for k in range(len(plan.buckets))]
        self.image_shape = shapes[0]
        self.held = self.members[int(np.argmax([len(m) for m in self.members]))]
        refuse_all_skipped(len(self.local), self.skipped, "sample")

    def __len__(self) -> int:
        return len(self.local)

    @property
    def dataset(self):
        return self.split.shardset

    def make_stream(self, seed: int) -> BucketStream:
        return BucketStream(self.members, seed, self.global_batch)

    def order_keys(self) -> dict[str, Any]:
        """As the folder's (trainer.data.buckets.BucketedSubset.order_keys)."""
        return {"data.buckets": self.digest, "train.batch_size": self.global_batch}

    def summary(self) -> str:
        return bucket_summary(len(self), self.members, len(self.plan.buckets), self.skipped, "sample")

    def __getitem__(self, ref: SampleRef):
        return self.__getitems__([ref])[0]

    def __getitems__(self, refs: list[SampleRef]):
        inner, sizes, shapes = [], [], []
        for r in refs:
            index = r.index if r.seed is not None or self.square else int(self.held[r.index % len(self.held)])
            k = int(self.bucket[index])
            inner.append(replace(r, index=int(self.local[index]), fixed_aug_seed=r.aug_seed))
            if r.seed is None and self.square:
                sizes.append(None)
                shapes.append(self.split.image_shape)
            else:
                sizes.append(self.plan.buckets[k])
                shapes.append(self.shapes[k])
        return self.split.load_refs(inner, sizes, shapes)


class OneBucketSplit:
    """The validation samples of bucketed latent shards that lie in one bucket (the one holding most of them):
    validation batches must stack, and latents exist at their bucket's shape only."""

    def __init__(self, split, assign: np.ndarray, buckets: list, shapes: list):
        ss = split.shardset
        parts = [split.members(s) + ss.starts[s] for s in range(len(split.counts))]
        local_assign = assign[np.concatenate(parts).astype(np.int64)] if parts else np.zeros(0, np.int64)
        found = np.bincount(local_assign[local_assign >= 0], minlength=len(buckets))
        self.k = int(found.argmax()) if len(found) else 0
        self.local = np.flatnonzero(local_assign == self.k)
        self.split, self.size, self.image_shape = split, buckets[self.k], shapes[self.k]
        self.encoding = split.encoding
        self.flip = False

    def __len__(self) -> int:
        return len(self.local)

    @property
    def dataset(self):
        return self.split.shardset

    def __getitem__(self, ref: SampleRef):
        return self.__getitems__([ref])[0]

    def __getitems__(self, refs: list[SampleRef]):
        inner = [replace(r, index=int(self.local[r.index]), fixed_aug_seed=r.aug_seed) for r in refs]
        return self.split.load_refs(inner, [self.size] * len(refs), [self.image_shape] * len(refs))


def bucketed_shards(cfg, train, val):
    """(train, val) of a shard source in buckets: image shards by each sample's size (the run's
    data.buckets rules), latent shards by the bucket the encode recorded (exit 2 when the run's data.buckets
    are not the encode's). Validation stays square on image shards and is one bucket's on latent shards."""
    d = cfg.data
    encoded = train.encoding
    if encoded is not None:
        buckets = check_encoded_buckets(cfg, encoded)
        if buckets is None:
            return train, val
        assign, version = encoded_assignment(train.shardset, cfg.run_dir)
        plan = BucketPlan.from_assignment(assign, buckets)
        made = encoded.buckets
        digest = plan_digest(version, buckets, made.max_ratio, made.min_fraction)
        shapes = [(2 * c, h, w) for c, h, w in made.latent_shapes]
        out = BucketedShardSplit(train, plan, digest, cfg.train.batch_size, shapes, square=False)
        if val is not None:
            val_assign = assign if val.shardset is train.shardset else encoded_assignment(val.shardset, cfg.run_dir)[0]
            val = OneBucketSplit(val, val_assign, buckets, shapes)
            val = val if len(val) else None
    else:
        unused = [f"data.{k}={getattr(d, k)}" for k in ("shard_window", "shuffle_block") if k in d.model_fields_set]
        if unused:
            log.info("data.buckets: %s not used (a bucketed batch draws from the whole set)", ", ".join(unused))
        buckets = bucket_list(d)
        sizes, version = shard_sizes(train.shardset, cfg.run_dir)
        plan = BucketPlan(sizes, buckets, d.bucket_max_ratio, d.bucket_min_fraction)
        digest = plan_digest(version, buckets, d.bucket_max_ratio, d.bucket_min_fraction)
        shapes = [(d.channels, h, w) for h, w in buckets]
        out = BucketedShardSplit(train, plan, digest, cfg.train.batch_size, shapes, square=True)
    log.info("data.buckets: %s (assignment %s)", out.summary(), digest)
    return out, val
