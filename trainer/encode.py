"""`gentrain data encode`: a data set through the frozen autoencoder (and text encoder) once, into latent shards.

Why: a latent run otherwise encodes every image with the frozen autoencoder inside every training step (or
hashes every image to find it in a per-node cache). Encoding once, in advance, is what fast-DiT, PixArt,
MosaicML and diffusers' SD3 scripts do; training then reads a few KB of posterior per sample and never runs
the encoder.

What a sample of an encoded shard holds (WebDataset members, `__key__` = its place in the encoded set):
- `mean.npy`, `std.npy`: the autoencoder's posterior q(z | x) at `data.image_size` (float16 or float32,
  `--dtype`); `flip.mean.npy`, `flip.std.npy`: the same of the mirrored image, when encoded with `--flip`
  (a run with `data.flip=true` picks one by the sample's augmentation draw, as it would flip the image);
- `cls` (the label), `txt` (the caption), `src` (the sample's key in the source: a file's relative path, a
  row number, `shard#member`);
- with `--text`: `text.tokens.npy`, `text.mask.npy`, `text.pooled.npy`, the caption's embeddings by the
  configured `model.text` encoder (the empty caption, which classifier-free dropout needs, is embedded by
  the training run itself). With a released pipeline's config (`model.pretrained` a pipeline folder, e.g.
  `gentrain data encode sdxl-lora model.pretrained=PIPELINE ...`) these are the pipeline's own VAE and text
  encoders (its `vae/`, `text_encoder*/`, `tokenizer*/`), the ones its training run loads; the settings pin
  each of those folders by digest, and a run with a pipeline of another one exits 2 naming it.

The posterior noise is not stored: training draws `mean + std * eps` per step from the counter-based
stream exactly as on-the-fly encoding does, so a run from shards and a resumed one draw the same.

Layout and commit rules (those of `gentrain data pack`): shards `000000.tar ...` with their `.idx.json`
byte-offset indexes, then `shards.json`. `encode.json` (the settings and the autoencoder's and text
encoder's digests) is written first; a resume with other settings is refused. Sample i of the source
(permuted by `--shuffle-seed`) goes to shard i // samples_per_shard, and rank r of W encodes the shards
j = r mod W, so ranks never share a shard. A shard is committed by uploading its tar under a temporary
name, moving it in place, then writing its index the same way: a shard without its index is unfinished
(re-encoded on resume), a finished one is kept. `shards.json`, with the `encoded` settings a training run
checks, is written last, by whichever rank finds every shard finished.

With `data.buckets` (aspect-ratio buckets, trainer/data/buckets.py) each sample is loaded at its bucket's
shape (resized to cover it, cropped by `data.crop`: a random crop is drawn once, from the sample's seed) and
its posterior is that bucket's latent shape; samples without a bucket (too extreme, too small, unreadable)
are skipped and counted. The settings record the buckets and each one's latent shape (`buckets`), each
shard's index every sample's bucket number (`buckets`, in sample order), which a training run reads to
put each sample in its bucket (trainer/data/bucket_sources.py); a run whose `data.buckets` are not these
exits 2 naming both. A sample's `size.npy` holds its size micro-conditions (original height and width, crop
top and left, bucket height and width: `trainer.data.buckets.size_conditions`, of the unmirrored image; a
reader of the mirrored posterior mirrors the crop's left).

Pinned by content (issue 47): each shard's index records the settings it was encoded with (the
autoencoder's digest among them), the tar's blake3 and each sample's (see `trainer.data.shards.index`),
and `shards.json` every shard's tar and index digests. A rerun checks every index already in the folder
against the settings asked for before it writes anything, `encode.json` or not: a shard of another encode
(or of `data pack`) exits 2 naming it and what differs, where trusting the folder would have written a
`shards.json` naming this autoencoder over another's latents. Shards of the same settings are kept.
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import re
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.data import build_dataset, sample_shape
from trainer.data.bucket_sources import BucketedShardSplit, hf_sizes, shard_sizes
from trainer.data.buckets import SIZE_CONDITIONS, BucketedSubset, BucketPlan, bucket_list, image_sizes, plan_digest
from trainer.data.datasets import ImageFolderDataset, Subset
from trainer.data.hf import HFDataset
from trainer.data.pack import PackSummary
from trainer.data.sampler import SampleRef
from trainer.data.shards import ShardSet, ShardSplit, load_shard_list
from trainer.data.shards.encoded import (
    ENCODED_FORMAT,
    EncodedAutoencoder,
    EncodedBuckets,
    EncodedSettings,
    EncodedText,
    EncodedTextPart,
    parse_settings,
    settings_in,
)
from trainer.data.shards.index import (
    SHARDLIST_NAME,
    digest,
    filesystem,
    index_json,
    index_url,
    read_index,
    sample_digest,
    shard_list_json,
    strip_protocol,
)
from trainer.data.shards.tar import scan_tar
from trainer.diffusion.latent import PART, LatentSpace, frozen_source
from trainer.engine.parts import FrozenPart
from trainer.errors import ConfigError
from trainer.runs import load_frozen

log = logging.getLogger(__name__)

SETTINGS_NAME = "encode.json"
DTYPES = ("float16", "float32")
# A shard's tar or index in an encode's folder ("000000.tar", "000000.tar.idx.json"; 7 digits past a million).
_SHARD_FILE = re.compile(r"(\d{6,})\.tar(\.idx\.json)?")


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- encoding


@dataclass
class _Source:
    """A source in the order training would read it, with each sample's key."""

    items: Any  # a Subset or ShardSplit over every sample
    keys: Any  # index -> str
    classes: list[str] | None = None
    num_classes: int | None = None

    def __len__(self) -> int:
        return len(self.items)


def _source(cfg) -> _Source:
    d = cfg.data
    shape = sample_shape(cfg)
    if d.source in ("moving-digits", "video") or d.num_frames > 1:
        raise ConfigError(f"data encode: data.source={d.source} gives clips; only image sources are encoded")
    if d.source == "shards":
        shards = load_shard_list(d.urls, d.storage_options, "data.urls")
        if shards.encoded is not None:
            raise ConfigError(f"data encode: data.urls={d.urls!r} are already encoded shards, not images")
        ss = ShardSet(shards, d.storage_options, d.image_size, d.channels, retries=d.read_retries, crop=d.crop)
        split = ShardSplit(ss, "all", 0.0, False, shape)

        def shard_key(i: int) -> str:
            shard, member = split.locate(i)
            return f"{posixpath.basename(shards.urls[shard])}#{member}"

        return _Source(split, shard_key, shards.classes, shards.num_classes)
    ds = build_dataset(cfg)
    items = Subset(ds, np.arange(len(ds)), False, shape)
    num_classes = getattr(ds, "num_classes", None)
    if isinstance(ds, ImageFolderDataset):
        base = ds.store.base()
        classes = sorted(ds.class_index, key=ds.class_index.get) or None
        return _Source(items, lambda i: str(ds.files[i].relative_to(base)), classes, num_classes)
    return _Source(items, lambda i: f"{i:09d}", None, num_classes)


def _settings(cfg, ae_record, geometry: tuple[int, ...], text, dtype: str, flip: bool, **how) -> EncodedSettings:
    d = cfg.data
    where = {"source": d.source}
    for k in ("path", "urls", "hf_split", "image_column", "caption_column", "label_column"):
        if getattr(d, k) is not None and (d.source != "digits"):
            where[k] = getattr(d, k)
    return EncodedSettings(
        format=ENCODED_FORMAT,
        kind="latents",
        autoencoder=EncodedAutoencoder(url=ae_record.url, digest=ae_record.digest),
        image_size=d.image_size,
        channels=d.channels,
        latent_shape=tuple(geometry),
        dtype=dtype,
        flip=flip,
        text=None if text is None else _text_record(text),
        data=where,
        **how,
    )


def _text_record(text) -> EncodedText:
    """The caption encoder(s) the stored embeddings are of: the combined digest a run checks, and each folder
    (a pipeline's text_encoder, text_encoder_2, ... and tokenizers) with its own digest, so a run with a pipeline
    of another encoder is told which part differs."""
    parts = {role: EncodedTextPart(url=src, digest=text.part_digests[role]) for role, src in text.cfg.folders()}
    return EncodedText(
        encoder=text.cfg.encoder,
        kind=text.cfg.kind,
        digest=text.digest,
        max_tokens=text.cfg.max_tokens,
        parts=parts,
    )


def _commit(fs, local_or_bytes: str | bytes, url: str) -> None:
    """Put a file (a local path or bytes) at `url` so a reader never sees part of it: under a temporary
    name first, then moved in place (a rename on local disks; an object store's upload is whole anyway)."""
    partial = f"{url}.partial-{os.getpid()}"
    if isinstance(local_or_bytes, bytes):
        fs.pipe_file(strip_protocol(fs, partial), local_or_bytes)
    else:
        fs.put_file(local_or_bytes, strip_protocol(fs, partial))
    fs.mv(strip_protocol(fs, partial), strip_protocol(fs, url))


def _finished(fs, out: str, settings: EncodedSettings) -> dict[int, dict]:
    """The shards already committed in `out` (an interrupted encode's, or other ranks'), as shard list entries
    by shard number, each index checked against `settings`: ConfigError (exit 2) naming the first shard of
    another encode, or of anything else, and what differs. A shard whose tar is missing or not the size its
    index records is unfinished (encoded again)."""
    where = strip_protocol(fs, out)
    fs.invalidate_cache(where)  # an object store's listing cache would hide what other ranks committed since
    try:
        listing = fs.ls(where, detail=True)
    except FileNotFoundError:
        return {}
    sizes = {posixpath.basename(e["name"].rstrip("/")): e.get("size") for e in listing}
    named = sorted((int(m.group(1)), name) for name in sizes if (m := _SHARD_FILE.fullmatch(name)) and m.group(2))
    named = [(j, name) for j, name in named if name == f"{j:06d}.tar.idx.json"]  # names this encode writes
    if not named:
        return {}
    paths = [strip_protocol(fs, posixpath.join(out, name)) for _, name in named]
    blobs = fs.cat(paths, on_error="return", start=0)
    done: dict[int, dict] = {}
    foreign: list[tuple[str, str]] = []  # (shard, what differs)
    for (j, name), path in zip(named, paths, strict=True):
        blob = blobs.get(path, FileNotFoundError(path))
        if isinstance(blob, FileNotFoundError):
            continue  # gone since the listing: unfinished
        if isinstance(blob, BaseException):
            raise blob  # the store failed: not a verdict on the folder
        tar = name.removesuffix(".idx.json")
        try:
            offsets, pins, doc = read_index(blob, name)
        except (ValueError, UnicodeDecodeError) as e:
            foreign.append((tar, f"its index is not one gentrain writes ({e})"))
            continue
        try:
            found = settings_in(doc)
        except ValueError as e:
            foreign.append((tar, f"its index records encode settings this gentrain does not write ({e})"))
            continue
        if found is None:
            why = "its index records no encode settings (shards of data pack or data index, or of an encode"
            foreign.append((tar, f"{why} by a gentrain that did not pin them)"))
            continue
        if found != settings:
            foreign.append((tar, f"encoded with other settings ({found.differences(settings)})"))
            continue
        if pins is None or not isinstance(doc.get("digest"), str) or sizes.get(tar) != doc.get("shard_bytes"):
            continue  # its tar missing or cut short: unfinished
        done[j] = {
            "url": tar,
            "nsamples": len(offsets) - 1,
            "filesize": doc["shard_bytes"],
            "digest": doc["digest"],
            "index_digest": digest(blob),
        }
    if foreign:
        tar, why = foreign[0]
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise ConfigError(
            f"data encode: {posixpath.join(out, tar)}{more} is not a shard of this encode: {why}; encode into an "
            "empty folder, or rerun with the settings those shards were encoded with"
        )
    return done


def _device() -> torch.device:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def encode_dataset(
    cfg,
    out_url: str,
    samples_per_shard: int,
    *,
    storage_options: dict | None = None,
    dtype: str = "float16",
    text: bool = False,
    flip: bool = False,
    batch_size: int = 64,
    shuffle_seed: int | None = 0,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | None = None,
    progress: bool = True,
    stop_after_shards: int | None = None,
) -> PackSummary:
    """Encode every sample of `cfg`'s data into shards at `out_url` (this rank's shards; see the module doc).

    `cfg` is a training config (`task: ddpm` with `model.autoencoder`, and `model.text` for `text`): the
    data are read as that run would read them (`data.*`), through the autoencoder it would load."""
    from tqdm.auto import tqdm
    from webdataset import TarWriter

    if dtype not in DTYPES:
        raise ConfigError(f"data encode: --dtype={dtype!r}; use one of {', '.join(DTYPES)}")
    if samples_per_shard < 1:
        raise ConfigError(f"data encode: --samples-per-shard={samples_per_shard} must be at least 1")
    ae = getattr(cfg.model_cfg, "autoencoder", None)
    if ae is None:
        raise ConfigError(
            f"data encode: the config (task {cfg.task}) has no model.autoencoder: encode with a latent "
            "diffusion config (e.g. the digits-latent-dit preset, or model.autoencoder.url=...)"
        )
    text_cfg = getattr(cfg.model_cfg, "text", None)
    if text and text_cfg is None:
        raise ConfigError("data encode: --text needs model.text in the config (the encoder whose embeddings to store)")
    device = device or _device()
    options = cfg.checkpoint.storage_options
    weights = load_frozen(PART, frozen_source(ae), options)
    latent = LatentSpace(ae, weights, cfg.data.image_size, cfg.data.channels, cfg.seed)
    module = latent.build()
    FrozenPart(PART, module, weights)  # loads the weights, eval mode, no gradients
    module.to(device)
    encoder = None
    if text:
        from trainer.conditioning.text import TextEncoder  # the text extra: only with --text

        encoder = TextEncoder(text_cfg, options, run_on=device)
    src = _source(cfg)
    bucketing = None
    if cfg.data.buckets is not None:
        src, bucketing, unplaced = _bucketed_source(cfg, src, latent)
    n = len(src)
    order = np.random.default_rng(shuffle_seed).permutation(n) if shuffle_seed is not None else np.arange(n)
    settings = _settings(
        cfg,
        weights.record,
        latent.shape,
        encoder,
        dtype,
        flip,
        samples=n,
        samples_per_shard=samples_per_shard,
        shuffle_seed=shuffle_seed,
        **({"buckets": bucketing.settings} if bucketing is not None else {}),
    )
    fs = filesystem(out_url, storage_options)
    out = out_url.rstrip("/")
    fs.makedirs(strip_protocol(fs, out), exist_ok=True)
    recorded = _check_settings(fs, out, settings)
    finished = _finished(fs, out, settings)  # before anything is written: a folder of another encode exits 2
    if not recorded:
        _commit(fs, json.dumps(settings.model_dump(mode="json"), indent=1).encode(), posixpath.join(out, SETTINGS_NAME))
    num_shards = -(-n // samples_per_shard)
    mine = list(range(rank, num_shards, world_size))
    summary = PackSummary()
    if bucketing is not None:
        summary.skipped = sum(unplaced.values())  # the samples without a bucket: never encoded
    np_dtype = np.float16 if dtype == "float16" else np.float32
    done_here = 0

    def posterior(images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        with torch.no_grad():
            mean, std = latent._posterior(module, images.to(device))
        return mean.cpu().numpy().astype(np_dtype), std.cpu().numpy().astype(np_dtype)

    for j in tqdm(mine, desc=f"encoding (rank {rank})", unit="shard", disable=not progress):
        url = posixpath.join(out, f"{j:06d}.tar")
        if j in finished:
            continue
        positions = list(range(j * samples_per_shard, min((j + 1) * samples_per_shard, n)))
        samples: list[dict[str, bytes]] = []
        sample_buckets: list[int] = []  # each written sample's bucket number (a bucketed encode)
        for b in range(0, len(positions), batch_size):
            chunk = positions[b : b + batch_size]
            # A bucketed source loads a ref with a seed at its bucket's shape (its random crop drawn from it).
            seed = cfg.seed if bucketing is not None else None
            refs = [SampleRef(index=int(order[p]), position=k, seed=seed) for k, p in enumerate(chunk)]
            got = src.items.__getitems__(refs) if hasattr(src.items, "__getitems__") else [src.items[r] for r in refs]
            ok = [k for k, item in enumerate(got) if item[4]]
            summary.skipped += len(chunk) - len(ok)
            for k, item in enumerate(got):
                if not item[4]:
                    log.warning("data encode: skipping %s", item[5].get("skip_reason", f"sample {refs[k].index}"))
            if not ok:
                continue
            members = _posteriors(posterior, [got[k][0] for k in ok], flip)
            captions = [str(got[k][5].get("caption", "")) for k in ok]
            emb = encoder.encode(captions, device) if encoder is not None else None
            for i, k in enumerate(ok):
                item = got[k]
                sample: dict[str, bytes] = {"__key__": f"{chunk[k]:09d}", "src": src.keys(refs[k].index).encode()}
                for prefix, (mean, std) in members.items():
                    sample[f"{prefix}mean.npy"] = _npy(mean[i])
                    sample[f"{prefix}std.npy"] = _npy(std[i])
                if item[1] >= 0:
                    sample["cls"] = str(int(item[1])).encode()
                if "caption" in item[5]:
                    sample["txt"] = str(item[5]["caption"]).encode()
                if emb is not None:
                    for name, t in (("tokens", emb.tokens), ("mask", emb.mask), ("pooled", emb.pooled)):
                        sample[f"text.{name}.npy"] = _npy(t[i].float().cpu().numpy().astype(np_dtype))
                samples.append(sample)
                if bucketing is not None:
                    sample_buckets.append(int(bucketing.bucket[refs[k].index]))
                    if SIZE_CONDITIONS in item[5]:  # the unmirrored image's; a reader mirrors its crop's left
                        sample["size.npy"] = _npy(np.asarray(item[5][SIZE_CONDITIONS], dtype=np.float32))
        with tempfile.NamedTemporaryFile(suffix=".tar") as tmp:
            with TarWriter(tmp.name, encoder=False, mtime=0) as writer:
                for sample in samples:
                    writer.write(sample)
            with open(tmp.name, "rb") as f:
                data = f.read()
            offsets, _, _ = scan_tar(io.BytesIO(data))
            view = memoryview(data)
            pins = {
                "digest": digest(data),
                "sample_digests": [sample_digest(view[a:b]).hex() for a, b in zip(offsets, offsets[1:], strict=False)],
                "encoded": settings.model_dump(mode="json"),
                **({"buckets": sample_buckets} if bucketing is not None else {}),
            }
            size = len(data)
            del view, data
            _commit(fs, tmp.name, url)
        _commit(fs, index_json(offsets, size, **pins), index_url(url))
        summary.shards += 1
        summary.samples += len(samples)
        summary.bytes += size
        done_here += 1
        if stop_after_shards is not None and done_here >= stop_after_shards:
            return summary
    _maybe_write_shard_list(fs, out, num_shards, settings, src.classes, src.num_classes)
    return summary


def _posteriors(posterior, images: list[torch.Tensor], flip: bool) -> dict[str, tuple[list, list]]:
    """{"": (means, stds)} of `images` (and "flip.": their mirrors'), one entry an image, in order; the images
    of one shape go through the autoencoder together (a chunk of a bucketed encode holds several shapes, a
    square encode's is one batch as before)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, x in enumerate(images):
        groups.setdefault(tuple(x.shape), []).append(i)
    prefixes = ("", "flip.") if flip else ("",)
    out: dict[str, tuple[list, list]] = {p: ([None] * len(images), [None] * len(images)) for p in prefixes}
    for idx in groups.values():
        batch = torch.stack([images[i] for i in idx])
        for prefix, (means, stds) in out.items():
            mean, std = posterior(batch.flip(-1) if prefix else batch)
            for j, i in enumerate(idx):
                means[i], stds[i] = mean[j], std[j]
    return out


@dataclass
class _Bucketing:
    """A bucketed encode: each sample's bucket number (by the bucketed source's index) and the settings."""

    bucket: np.ndarray
    settings: EncodedBuckets


def _bucketed_source(cfg, src: _Source, latent) -> tuple[_Source, _Bucketing, dict[str, int]]:
    """The source's samples that have a bucket (data.buckets' rules), each loaded at its bucket's shape; the
    buckets' settings (the list, each one's latent shape, the rules); the skipped ones counted by reason."""
    d = cfg.data
    buckets = bucket_list(d)
    factor = latent.geometry.downsample
    bad = [f"{h}x{w}" for h, w in buckets if h % factor or w % factor]
    if bad:
        raise ConfigError(
            f"data encode: data.buckets {', '.join(bad)} are not multiples of the autoencoder's downsampling factor "
            f"{factor}: set data.bucket_step to a multiple of {factor}"
        )
    items = src.items
    if d.source == "shards":
        sizes, listing = shard_sizes(items.shardset, None)
    elif isinstance(items.dataset, HFDataset):
        sizes, listing = hf_sizes(items.dataset, None)
    else:
        sizes, listing = image_sizes(items.dataset.store, items.dataset.files, None)
    plan = BucketPlan(sizes, buckets, d.bucket_max_ratio, d.bucket_min_fraction)
    digest = plan_digest(listing, buckets, d.bucket_max_ratio, d.bucket_min_fraction)
    if d.source == "shards":
        shapes = [(d.channels, h, w) for h, w in buckets]
        placed = BucketedShardSplit(items, plan, digest, 1, shapes, square=True)
        keys, bucket = (lambda i: src.keys(int(placed.local[i]))), placed.bucket
    else:
        placed = BucketedSubset(items.dataset, items.indices, False, d.channels, plan, digest, 1)
        keys, bucket = (lambda i: src.keys(int(placed.indices[i]))), plan.assign[placed.indices]
    settings = EncodedBuckets(
        list=[tuple(b) for b in buckets],
        latent_shapes=[(latent.shape[0], h // factor, w // factor) for h, w in buckets],
        step=d.bucket_step,
        max_ratio=d.bucket_max_ratio,
        min_fraction=d.bucket_min_fraction,
        crop=d.crop,
        crop_seed=cfg.seed if d.crop == "random" else None,  # a random crop is drawn from (seed, sample)
        assignment=digest,
    )
    log.info("data encode: data.buckets: %s", placed.summary())
    return _Source(placed, keys, src.classes, src.num_classes), _Bucketing(bucket, settings), placed.skipped


def _check_settings(fs, out: str, settings: EncodedSettings) -> bool:
    """Whether `encode.json` is there (an earlier, interrupted encode's), checked to hold the same settings.
    Not proof of what the shards are (it may be lost, or never copied with them): `_finished` checks those."""
    url = posixpath.join(out, SETTINGS_NAME)
    try:
        found = json.loads(fs.cat_file(strip_protocol(fs, url), start=0))
    except FileNotFoundError:
        return False
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"data encode: {url} is not JSON ({e}): not an encode's folder; encode into another"
        ) from None
    try:
        recorded = parse_settings(found)
    except ValueError as e:
        raise ConfigError(
            f"data encode: {url} holds settings this gentrain's encode does not write ({e}): not an encode's "
            "folder of this version; encode into another"
        ) from None
    if recorded != settings:
        shown = recorded.differences(settings)
        raise ConfigError(
            f"data encode: {out} holds shards encoded with other settings ({shown}); resume with the same "
            "config and options, or encode into another folder"
        )
    return True


def _maybe_write_shard_list(
    fs, out: str, num_shards: int, settings: EncodedSettings, classes: list[str] | None, num_classes: int | None
) -> bool:
    """`shards.json` with the `encoded` settings and every shard's digests, once every shard is committed (by
    any rank: the same bytes)."""
    done = _finished(fs, out, settings)
    if any(j not in done for j in range(num_shards)):
        return False
    doc = json.loads(shard_list_json([done[j] for j in range(num_shards)], classes, num_classes))
    doc["encoded"] = settings.model_dump(mode="json")
    _commit(fs, json.dumps(doc, indent=1).encode(), posixpath.join(out, SHARDLIST_NAME))
    return True
