"""`gentrain data pack` and `gentrain data index`: image (or clip) folders into WebDataset shards, indexes for any shards.

Packing writes each shard with webdataset's `TarWriter` to a local temporary
file, scans it with the same code `data index` uses (so the index always
describes the bytes that were written), then uploads the shard, its
`.idx.json` and finally `shards.json` through fsspec.
"""

from __future__ import annotations

import glob
import logging
import os
import posixpath
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from trainer.data.datasets import IMAGE_EXTENSIONS, read_metadata_captions, scan_folder
from trainer.data.shards.index import (
    SHARDLIST_NAME,
    expand_urls,
    filesystem,
    index_json,
    index_url,
    shard_list_json,
    strip_protocol,
    url_dir,
)
from trainer.data.shards.tar import scan_tar
from trainer.data.video import VIDEO_EXTENSIONS, ClipError, decode_clip, import_av
from trainer.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class PackSummary:
    shards: int = 0
    samples: int = 0
    bytes: int = 0
    skipped: int = 0

    def line(self) -> str:
        return f"{self.shards} shards, {self.samples} samples, {self.bytes} bytes, {self.skipped} skipped"


def folder_samples(src: Path) -> tuple[list[tuple[Path, int]], list[str]]:
    """Every image below `src` (sorted) with its class number (first-level subfolder; -1 when flat), class names.

    A folder without images but with clips (gif/mp4/webm/mkv/mov) gives its clips instead: they are packed
    as they are (not re-encoded) and read back as clips with `data.num_frames` > 1."""
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if not files:
        files = sorted(p for p in src.rglob("*") if p.is_file() and p.suffix.lower() in VIDEO_EXTENSIONS)
        if files:  # every clip is decoded once to check it
            import_av(f"data pack of the clips in {str(src)!r}")
    rel = [p.relative_to(src).parts for p in files]
    classes = sorted({parts[0] for parts in rel if len(parts) > 1})
    index = {c: i for i, c in enumerate(classes)}
    return [(p, index[parts[0]] if len(parts) > 1 else -1) for p, parts in zip(files, rel, strict=True)], classes


def sample_members(image: Path, label: int, caption: str | None = None) -> dict[str, bytes]:
    """The image's own bytes (not re-encoded), `cls`, and the `.txt` / `.npy` / `.NAME.npy` files beside it;
    `caption` (its metadata.jsonl caption) is the `txt` member when no `.txt` is beside it."""
    ext = image.suffix.lower().lstrip(".")
    members = {"jpg" if ext == "jpeg" else ext: image.read_bytes()}
    if label >= 0:
        members["cls"] = str(label).encode()
    stem = image.name[: -len(image.suffix)]
    if (image.parent / f"{stem}.txt").is_file():
        members["txt"] = (image.parent / f"{stem}.txt").read_bytes()
    elif caption is not None:
        members["txt"] = caption.encode()
    for extra in sorted(image.parent.glob(f"{glob.escape(stem)}*.npy")):
        middle = extra.name[len(stem) : -len(".npy")]
        if middle == "":
            members["npy"] = extra.read_bytes()
        elif middle.startswith("."):
            members[middle[1:] + ".npy"] = extra.read_bytes()
    return members


def _readable(image: Path) -> bool:
    if image.suffix.lower() in VIDEO_EXTENSIONS:
        try:  # at least one frame decodes; a clip too short for some data.num_frames is skipped at load time
            decode_clip(str(image), 8, 3, 1, 1)
            return True
        except ClipError:
            return False
    try:
        with Image.open(image) as im:
            im.verify()
        return True
    except Exception:  # noqa: BLE001 - anything PIL cannot verify is skipped and counted
        return False


def pack_folder(
    src: str,
    out_url: str,
    samples_per_shard: int,
    storage_options: dict | None = None,
    progress: bool = True,
    shuffle_seed: int | None = 0,
    caption_column: str = "text",
) -> PackSummary:
    """Pack an image folder into `out_url/000000.tar, ...` with indexes and `shards.json`; captions from
    `.txt` files and, for images without one, from metadata.jsonl files (`caption_column`; as the folder
    source reads them: a malformed line is a ConfigError).

    The samples are written in an order permuted by `shuffle_seed` (None: the
    folder's sorted order). Readers shuffle shards and runs of neighbours
    (`data.shard_window`, `data.shuffle_block`), not whole data sets, so
    neighbours in a shard must be unrelated: in folder order they share a
    class (WebDataset's advice too: shuffle when writing shards)."""
    from tqdm.auto import tqdm
    from webdataset import TarWriter

    base = Path(src)
    if not base.is_dir():
        raise ConfigError(f"data pack: SRC {src!r} is not a folder")
    if samples_per_shard < 1:
        raise ConfigError(f"data pack: --samples-per-shard={samples_per_shard} must be at least 1")
    files, classes = folder_samples(base)
    if not files:
        raise ConfigError(f"data pack: {src!r} holds no {'/'.join(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)} files")
    captions: dict[Path, str] = {}
    if files[0][0].suffix.lower() in IMAGE_EXTENSIONS:
        captions, _ = read_metadata_captions(scan_folder(src, IMAGE_EXTENSIONS, "SRC"), src, caption_column, "SRC")
    if shuffle_seed is not None:
        files = [files[i] for i in np.random.default_rng(shuffle_seed).permutation(len(files))]
    fs = filesystem(out_url, storage_options)
    out = out_url.rstrip("/")
    fs.makedirs(strip_protocol(fs, out), exist_ok=True)
    summary = PackSummary()
    entries: list[dict] = []
    pending: list[dict[str, bytes]] = []
    sizes: list[list[int]] = []  # each pending image's [height, width] (its header): data.buckets reads them

    def flush() -> None:
        name = f"{len(entries):06d}.tar"
        url = posixpath.join(out, name)
        with tempfile.NamedTemporaryFile(suffix=".tar") as tmp:
            with TarWriter(tmp.name, encoder=False, mtime=0) as writer:
                for sample in pending:
                    writer.write(sample)
            with open(tmp.name, "rb") as f:
                offsets, _, _ = scan_tar(f)
            size = os.path.getsize(tmp.name)
            fs.put_file(tmp.name, strip_protocol(fs, url))
        listed = {"sizes": list(sizes)} if len(sizes) == len(pending) else {}  # images, not clips
        fs.pipe_file(strip_protocol(fs, index_url(url)), index_json(offsets, size, **listed))
        entries.append({"url": name, "nsamples": len(pending), "filesize": size})
        summary.shards += 1
        summary.samples += len(pending)
        summary.bytes += size
        pending.clear()
        sizes.clear()

    for image, label in tqdm(files, desc="packing", unit="img", disable=not progress):
        if not _readable(image):
            log.warning("skipping unreadable file %s", image)
            summary.skipped += 1
            continue
        key = f"{summary.samples + len(pending):09d}"
        pending.append({"__key__": key, **sample_members(image, label, captions.get(image))})
        if image.suffix.lower() in IMAGE_EXTENSIONS:
            with Image.open(image) as im:  # the header only: no pixels decoded
                sizes.append([im.size[1], im.size[0]])
        if len(pending) == samples_per_shard:
            flush()
    if pending:
        flush()
    if not entries:
        raise ConfigError(f"data pack: no readable image in {src!r}")
    fs.pipe_file(
        strip_protocol(fs, posixpath.join(out, SHARDLIST_NAME)),
        shard_list_json(entries, classes or None, len(classes) or None),
    )
    return summary


def index_shards(pattern: str, storage_options: dict | None = None, progress: bool = True) -> PackSummary:
    """Write `<shard>.idx.json` for every shard of `pattern`, and `shards.json` when they share a folder.

    For shards made elsewhere (img2dataset, webdataset's ShardWriter): each
    shard is streamed once, headers only are parsed (`cls` members are read
    to learn the number of classes).
    """
    from tqdm.auto import tqdm

    urls = expand_urls(pattern)
    if not urls:
        raise ConfigError(f"data index: {pattern!r} expands to no shards")
    fs = filesystem(urls[0], storage_options)
    summary = PackSummary()
    entries: list[dict] = []
    max_cls = -1
    folders = {url_dir(u) for u in urls}
    for url in tqdm(urls, desc="indexing", unit="shard", disable=not progress):
        path = strip_protocol(fs, url)
        try:
            with fs.open(path, "rb", block_size=1 << 22) as f:
                offsets, _, seen = scan_tar(f)
        except FileNotFoundError:
            raise ConfigError(f"data index: shard {url} does not exist") from None
        except (IsADirectoryError, tarfile.TarError) as e:  # a folder, an empty file, not a tar
            raise ConfigError(
                f"data index: {url} is not a tar shard ({e}); give tar files or a brace pattern"
            ) from None
        size = fs.size(path)
        fs.pipe_file(strip_protocol(fs, index_url(url)), index_json(offsets, size))
        max_cls = max(max_cls, seen["max_cls"])
        rel = posixpath.basename(url) if len(folders) == 1 else url
        entries.append({"url": rel, "nsamples": len(offsets) - 1, "filesize": size})
        summary.shards += 1
        summary.samples += len(offsets) - 1
        summary.bytes += size
    if len(folders) == 1:
        list_url = posixpath.join(folders.pop(), SHARDLIST_NAME)
        fs.pipe_file(strip_protocol(fs, list_url), shard_list_json(entries, None, max_cls + 1 or None))
    return summary
