"""WebDataset tar shards on any fsspec store, read sample by sample through byte ranges from a per-shard index.

Why byte ranges from an index (and not streaming whole shards, or a local
shard cache): the data position is one global cursor and rank r of W reads
its slice of every step's batch, so a rank uses about 1/W of every shard it
touches. Streaming shards would fetch W times the bytes it uses (or force a
shard-per-rank split that changes the sample order with the world size); a
local cache needs the disk for every shard a window touches. With the byte
offset of every sample (one integer per sample, written by `gentrain data pack`
or `gentrain data index` beside each shard), a rank fetches exactly the tar
bytes of its own samples, one range request per run of neighbouring samples,
all of a step's requests concurrently (fsspec `cat_ranges`).

The order (see `ShardStream`): each epoch permutes the shards, groups them
into windows of `data.shard_window` shards and permutes runs of
`data.shuffle_block` neighbouring samples within each window. It is a
function of (seed, epoch, shard list, window, block) only, so any world size
and any number of loader workers read the same stream; a worker only needs
the indexes of the shards of the current window.

Files (both JSON):
- `<shard>.idx.json`: {"format": "gentrain-tar-index/1", "shard_bytes": B,
  "offsets": [o_0, ..., o_N]}: sample i is the tar bytes [o_i, o_{i+1}) (its
  members' headers and data; webdataset groups members by key, and a sample's
  members are consecutive).
- `shards.json` (in the shards' folder): the wids shard list
  (`__kind__: wids-shard-index-v1`, `shardlist: [{url, nsamples, filesize}]`),
  plus gentrain's `classes`; lets every rank learn all sample counts with one
  request. Without it, the counts come from the per-shard indexes.

wids' own indexes are pickles built after downloading whole shards, so they
are neither safe to load from storage nor usable for range reads; only the
shard-list format is shared.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import posixpath
import tarfile
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from trainer.config import ConfigError
from trainer.data.datasets import IMAGE_EXTENSIONS, image_to_tensor, read_embedding, short_reason, skipped_item
from trainer.data.sampler import SampleRef, SampleStream
from trainer.data.video import VIDEO_EXTENSIONS, decode_clip, frames_extra
from trainer.randomness import derive_seed

log = logging.getLogger(__name__)

INDEX_FORMAT = "gentrain-tar-index/1"
INDEX_SUFFIX = ".idx.json"
SHARDLIST_NAME = "shards.json"
SHARDLIST_KIND = "wids-shard-index-v1"

_IMAGE_EXTS = tuple(e.lstrip(".") for e in IMAGE_EXTENSIONS)
_VIDEO_EXTS = tuple(e.lstrip(".") for e in VIDEO_EXTENSIONS)
_STREAM_SHARDS = 3
_STREAM_WINDOW = 4
_SPLIT_SEED = 20240917
# A shard that failed every retry is skipped for this long before it is tried again.
_DEAD_SECONDS = 300.0
_BLOCK = tarfile.BLOCKSIZE
_ZERO_BLOCK = bytes(_BLOCK)
_PLAIN_TYPES = (b"0", b"\0", b"5")  # regular file (ustar, v7), directory
# npy member names -> extras keys (the DALL·E 2 decoder's embeddings; see trainer.tasks.base.Batch).
_EMBED_NAMES = {"npy": "image_embed", "img_emb": "image_embed", "image_embed": "image_embed",
                "text_emb": "text_embed", "text_embed": "text_embed"}  # fmt: skip


# ---------------------------------------------------------------------------- urls and the shard list


def expand_urls(urls: str | list[str]) -> list[str]:
    """Brace patterns (`s3://b/x/{000000..000099}.tar`) or a list of them, expanded in order."""
    import braceexpand

    out: list[str] = []
    for u in [urls] if isinstance(urls, str) else urls:
        out.extend(braceexpand.braceexpand(u))
    return out


def index_url(shard_url: str) -> str:
    return shard_url + INDEX_SUFFIX


def url_dir(url: str) -> str:
    return url.rsplit("/", 1)[0] if "/" in url else "."


def _join(base: str, rel: str) -> str:
    if "://" in rel or rel.startswith("/"):
        return rel
    return posixpath.join(base, rel)


def filesystem(url: str, storage_options: dict | None):
    import fsspec

    fs, _ = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs


def strip_protocol(fs, url: str) -> str:
    return fs._strip_protocol(url)


@dataclass
class ShardList:
    """The shards of a data set, their sample counts, and the class names when the packer knew them."""

    urls: list[str]
    counts: np.ndarray  # samples per shard
    classes: list[str] | None = None
    num_classes: int | None = None
    index_bytes: int = 0  # bytes read to learn the counts

    @property
    def total(self) -> int:
        return int(self.counts.sum())


def load_shard_list(urls: str | list[str], storage_options: dict | None, key: str = "data.urls") -> ShardList:
    """Resolve `data.urls` (patterns, or one `.json` shard list) to shards with counts; ConfigError if unusable."""
    if isinstance(urls, str) and urls.endswith(".json"):
        listed = _read_json(urls, storage_options, key)
        base = listed.get("base") or url_dir(urls)
        entries = listed.get("shardlist") or []
        if not entries:
            raise ConfigError(f"{key}={urls!r} lists no shards (expected a wids shard list with 'shardlist')")
        shard_urls = [_join(base, e["url"]) for e in entries]
        counts = np.array([int(e["nsamples"]) for e in entries], dtype=np.int64)
        return _shard_list(shard_urls, counts, listed)

    shard_urls = expand_urls(urls)
    if not shard_urls:
        raise ConfigError(f"{key}={urls!r} expands to no shards")
    fs = filesystem(shard_urls[0], storage_options)
    # One request for all counts when the shards' folder has a shard list covering them.
    counts: dict[str, int] = {}
    listed: dict = {}
    nbytes = 0
    folders = {url_dir(u) for u in shard_urls}
    if len(folders) == 1:
        list_url = posixpath.join(folders.pop(), SHARDLIST_NAME)
        try:
            raw = fs.cat_file(strip_protocol(fs, list_url), start=0)
            nbytes += len(raw)
            listed = json.loads(raw)
            base = listed.get("base") or url_dir(list_url)
            for e in listed.get("shardlist", []):
                counts[strip_protocol(fs, _join(base, e["url"]))] = int(e["nsamples"])
        except FileNotFoundError:
            pass
    missing = [u for u in shard_urls if strip_protocol(fs, u) not in counts]
    if missing:
        blobs = fs.cat([strip_protocol(fs, index_url(u)) for u in missing], on_error="return", start=0)
        for u in missing:
            blob = blobs[strip_protocol(fs, index_url(u))]
            if isinstance(blob, BaseException):
                raise ConfigError(
                    f"{key}: shard {u} has no readable index {index_url(u)} ({type(blob).__name__}: {blob}); "
                    f"build it with `gentrain data index {u}` (or pack the data with `gentrain data pack`)"
                )
            nbytes += len(blob)
            counts[strip_protocol(fs, u)] = len(parse_index(blob, index_url(u))) - 1
    result = _shard_list(shard_urls, np.array([counts[strip_protocol(fs, u)] for u in shard_urls]), listed)
    result.index_bytes = nbytes
    return result


def _shard_list(urls: list[str], counts: np.ndarray, listed: dict) -> ShardList:
    classes = listed.get("classes")
    num_classes = listed.get("num_classes") or (len(classes) if classes else None)
    return ShardList(urls, counts.astype(np.int64), classes, num_classes)


def _read_json(url: str, storage_options: dict | None, key: str) -> dict:
    fs = filesystem(url, storage_options)
    try:
        return json.loads(fs.cat_file(strip_protocol(fs, url), start=0))
    except FileNotFoundError:
        raise ConfigError(f"{key}={url!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}={url!r} is not JSON: {e}") from None


def parse_index(blob: bytes, url: str) -> np.ndarray:
    data = json.loads(blob)
    if data.get("format") != INDEX_FORMAT:
        raise ValueError(f"{url}: not a {INDEX_FORMAT} index (format={data.get('format')!r})")
    offsets = np.asarray(data["offsets"], dtype=np.int64)
    if len(offsets) < 1 or np.any(np.diff(offsets) <= 0):
        raise ValueError(f"{url}: offsets must be increasing")
    return offsets


# ---------------------------------------------------------------------------- tar layout (pack, index, read)


@functools.cache
def _base_plus_ext():
    from webdataset.tariterators import base_plus_ext

    return base_plus_ext


def split_name(name: str) -> tuple[str, str]:
    """webdataset's grouping rule: key = path up to the first dot of the file name, ext = the rest."""
    key, ext = _base_plus_ext()(name)
    if key is None:
        return name, ""
    return key, ext


def scan_tar(fileobj) -> tuple[list[int], list[str], dict]:
    """Sample offsets [o_0, ..., o_N], keys, and what was seen ({"fields", "max_cls"}) of a tar stream."""
    offsets: list[int] = []
    keys: list[str] = []
    fields: set[str] = set()
    max_cls = -1
    end = 0
    with tarfile.open(fileobj=fileobj, mode="r|") as tf:
        for m in tf:
            if not m.isfile():
                continue
            key, ext = split_name(m.name)
            if not keys or key != keys[-1]:
                keys.append(key)
                offsets.append(m.offset)
            fields.add(ext)
            if ext == "cls":
                f = tf.extractfile(m)
                try:
                    max_cls = max(max_cls, int(f.read().decode().strip()))
                except ValueError:
                    pass
            end = m.offset_data + (m.size + tarfile.BLOCKSIZE - 1) // tarfile.BLOCKSIZE * tarfile.BLOCKSIZE
    offsets.append(end)
    return offsets, keys, {"fields": sorted(fields), "max_cls": max_cls}


def index_json(offsets: list[int], shard_bytes: int) -> bytes:
    return json.dumps({"format": INDEX_FORMAT, "shard_bytes": shard_bytes, "offsets": offsets}).encode()


def shard_list_json(entries: list[dict], classes: list[str] | None, num_classes: int | None) -> bytes:
    doc: dict = {"__kind__": SHARDLIST_KIND, "wids_version": 1, "shardlist": entries}
    if classes:
        doc["classes"] = classes
    if num_classes:
        doc["num_classes"] = num_classes
    return json.dumps(doc, indent=1).encode()


def parse_sample(blob: bytes) -> dict[str, bytes]:
    """The members of one sample's tar bytes, by extension; raises on a broken header.

    Plain ustar/v7 headers of regular files (what webdataset's `TarWriter`,
    img2dataset and GNU tar write for short names) are read here directly:
    `tarfile` spends 0.1-0.3 ms of Python per sample opening a `TarFile` and
    decoding every header field (profiled: a quarter of the loader's CPU for
    a 5 KB JPEG; this reads the same headers in about 15 us). Anything else (pax or GNU long-name headers, base-256 sizes,
    a checksum that does not match) goes to `tarfile`, which raises on a
    broken header.
    """
    members: dict[str, bytes] = {}
    key = None
    pos, n = 0, len(blob)
    while pos + _BLOCK <= n:
        header = blob[pos : pos + _BLOCK]
        if header == _ZERO_BLOCK:
            break
        kind = header[156:157]
        if kind not in _PLAIN_TYPES or header[124] & 0x80:
            return _parse_sample_tarfile(blob)
        try:
            size = int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
            checksum = int(header[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
        except ValueError:
            raise ValueError(f"bad tar header at byte {pos}") from None
        if checksum != int(np.frombuffer(header, np.uint8).sum()) - sum(header[148:156]) + 256:
            return _parse_sample_tarfile(blob)  # old tars' signed checksums; tarfile raises on a bad one
        start = pos + _BLOCK
        pos = start + -(-size // _BLOCK) * _BLOCK
        name = header[:100].split(b"\0", 1)[0]
        if kind == b"5" or name.endswith(b"/"):  # a directory
            continue
        if start + size > n:
            raise ValueError(f"truncated member at byte {start}: {n - start} of {size} bytes")
        prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
        k, ext = split_name((prefix + b"/" + name if prefix else name).decode("utf-8", "surrogateescape"))
        if key is not None and k != key:
            raise ValueError(f"members of two samples in one index entry ({key!r}, {k!r})")
        key = k
        members[ext.lower()] = blob[start : start + size]
    return members


def _parse_sample_tarfile(blob: bytes) -> dict[str, bytes]:
    members: dict[str, bytes] = {}
    key = None
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tf:
        for m in tf:
            if not m.isfile():
                continue
            k, ext = split_name(m.name)
            if key is not None and k != key:
                raise ValueError(f"members of two samples in one index entry ({key!r}, {k!r})")
            key = k
            f = tf.extractfile(m)
            assert f is not None
            members[ext.lower()] = f.read()
    return members


def decode_sample(
    members: dict[str, bytes],
    image_size: int,
    channels: int,
    flip: bool,
    aug_seed: int,
    num_frames: int = 1,
    frame_stride: int = 1,
):
    """(image, label, extras) from a sample's members; ValueError/OSError when it cannot be used.

    With `num_frames` > 1 the sample is a clip: its mp4/gif/webm/mkv/mov member is decoded with PyAV
    into (num_frames, C, H, W) (`extras["frames"]` = num_frames); a too-short clip is a ValueError."""
    if num_frames > 1:
        ext = next((e for e in _VIDEO_EXTS if e in members), None)
        if ext is None:
            raise ValueError(f"no clip member ({'/'.join(_VIDEO_EXTS)}; have {sorted(members)})")
        x = decode_clip(io.BytesIO(members[ext]), image_size, channels, num_frames, frame_stride)
    else:
        ext = next((e for e in _IMAGE_EXTS if e in members), None)
        if ext is None:
            raise ValueError(f"no image member (have {sorted(members)})")
        with Image.open(io.BytesIO(members[ext])) as im:
            x = image_to_tensor(im, image_size, channels)
    if flip and aug_seed & 1:
        x = x.flip(-1)
    label = int(members["cls"].decode().strip()) if "cls" in members else -1
    extras: dict = {"frames": frames_extra(num_frames)} if num_frames > 1 else {}
    if "txt" in members:
        extras["caption"] = members["txt"].decode("utf-8", errors="replace").strip()
    for name, raw in members.items():
        if name == "npy" or name.endswith(".npy"):
            stem = name[: -len(".npy")] if name.endswith(".npy") else name
            try:
                arr = read_embedding(io.BytesIO(raw))
            except ValueError as e:
                raise ValueError(f"member {name}: {e}") from None
            extras[_EMBED_NAMES.get(stem, stem.replace(".", "_"))] = torch.from_numpy(arr)
    return x, label, extras


# ---------------------------------------------------------------------------- reading


@dataclass
class FetchStats:
    """What one batch cost: bytes fetched (data and index), tar bytes of the samples used, failed shards."""

    data_bytes: int = 0
    index_bytes: int = 0
    used_bytes: int = 0
    requests: int = 0  # range requests sent (merged neighbours count once; retries not counted)
    failed_shards: list[str] = field(default_factory=list)


class ShardSet:
    """Random access to the samples of a shard list by (shard, member number), through byte ranges.

    Holds no open connection across fork: the filesystem is created lazily
    in each process (DataLoader workers included). Each process keeps the
    indexes of the shards it touched recently (`index_cache` shards).
    Unreachable shards are retried `retries` times with exponential backoff,
    then skipped for a while; their samples come back as None (counted by
    the loop as skipped samples) and their URLs in `FetchStats.failed_shards`.
    """

    def __init__(
        self,
        shards: ShardList,
        storage_options: dict | None,
        image_size: int,
        channels: int,
        retries: int = 3,
        backoff_seconds: float = 0.2,
        index_cache: int = 64,
        num_frames: int = 1,
        frame_stride: int = 1,
        merge_gap: int = 0,
    ):
        self.shards = shards
        self.num_frames = num_frames  # > 1: samples are clips
        self.frame_stride = frame_stride
        self.storage_options = dict(storage_options or {})
        self.image_size = image_size
        self.channels = channels
        self.retries = retries
        self.backoff_seconds = backoff_seconds
        self.index_cache = max(1, index_cache)
        self.merge_gap = merge_gap
        self.num_classes = shards.num_classes
        self.starts = np.concatenate([[0], np.cumsum(shards.counts)]).astype(np.int64)
        self._fs = None
        self._pid = None
        self._indexes: OrderedDict[int, np.ndarray] = OrderedDict()
        self._dead_until: dict[int, float] = {}
        self._skips: dict[str, str] = {}  # "url#member" -> why that sample was skipped (this process)
        self._shard_errors: dict[int, str] = {}  # shard -> why it was last skipped whole (this process)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_fs=None, _pid=None, _indexes=OrderedDict())
        return state

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def fs(self):
        if self._fs is None or self._pid != os.getpid():
            self._fs = filesystem(self.shards.urls[0], self.storage_options)
            self._pid = os.getpid()
        return self._fs

    def global_id(self, shard: int, member: int) -> int:
        return int(self.starts[shard] + member)

    def _retrying(self, call):
        """call() with backoff; returns the result or the last exception."""
        err: BaseException | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_seconds * 2 ** (attempt - 1))
            try:
                return call()
            except Exception as e:  # noqa: BLE001 - any store error counts as unreachable; the last one is logged
                err = e
        return err

    def _shard_failed(self, shard: int, why: BaseException, stats: FetchStats) -> None:
        url = self.shards.urls[shard]
        self._dead_until[shard] = time.monotonic() + _DEAD_SECONDS
        self._shard_errors[shard] = short_reason(
            f"shard unreadable after {self.retries} retries: {type(why).__name__}: {why}"
        )
        stats.failed_shards.append(url)
        log.warning(
            "skipping shard %s after %d retries (pid %d): %s: %s",
            url, self.retries, os.getpid(), type(why).__name__, why,
        )  # fmt: skip

    def _alive(self, shard: int) -> bool:
        until = self._dead_until.get(shard)
        return until is None or time.monotonic() >= until

    def indexes(self, shards: list[int], stats: FetchStats) -> dict[int, np.ndarray | None]:
        """The offsets of each shard (None: unreachable), the ones not cached fetched with concurrent requests."""
        out: dict[int, np.ndarray | None] = {}
        todo = []
        for shard in dict.fromkeys(shards):
            if shard in self._indexes:
                self._indexes.move_to_end(shard)
                out[shard] = self._indexes[shard]
            elif self._alive(shard):
                todo.append(shard)
            else:
                out[shard] = None
        paths = {shard: strip_protocol(self.fs, index_url(self.shards.urls[shard])) for shard in todo}
        err: dict[int, BaseException] = {}
        for attempt in range(self.retries + 1):
            if not todo:
                break
            if attempt:
                time.sleep(self.backoff_seconds * 2 ** (attempt - 1))
            try:
                # start=0 everywhere a whole small file is read (indexes, shard lists): a plain cat makes
                # s3fs send a HEAD first (to split large objects into parts), a second request per file.
                got = self.fs.cat([paths[s] for s in todo], on_error="return", start=0)
                got = [got.get(paths[s], FileNotFoundError(paths[s])) for s in todo]
            except Exception as e:  # noqa: BLE001 - a failure of the whole call: retry all
                got = [e] * len(todo)
            failed = []
            for shard, blob in zip(todo, got, strict=True):
                if isinstance(blob, BaseException):
                    err[shard] = blob
                    failed.append(shard)
                    continue
                stats.index_bytes += len(blob)
                out[shard] = self._parsed_index(shard, blob, stats)
            todo = failed
        for shard in todo:
            self._shard_failed(shard, err[shard], stats)
            out[shard] = None
        return out

    def _parsed_index(self, shard: int, blob: bytes, stats: FetchStats) -> np.ndarray | None:
        url = index_url(self.shards.urls[shard])
        try:
            offsets = parse_index(blob, url)
        except (ValueError, KeyError) as e:
            self._shard_failed(shard, e, stats)
            return None
        if len(offsets) - 1 != self.shards.counts[shard]:
            self._shard_failed(
                shard, ValueError(f"index has {len(offsets) - 1} samples, shard list says {self.shards.counts[shard]}"),
                stats,
            )  # fmt: skip
            return None
        self._indexes[shard] = offsets
        while len(self._indexes) > self.index_cache:
            self._indexes.popitem(last=False)
        return offsets

    def load_many(self, wanted: list[tuple[int, int, int, bool]], stats: FetchStats) -> list:
        """(shard, member, aug_seed, flip) -> (image, label, extras) or None, fetching all ranges at once."""
        out: list = [None] * len(wanted)
        ranges: list[tuple[int, int, int, int]] = []  # (slot, shard, start, end)
        indexes = self.indexes([w[0] for w in wanted], stats)
        for slot, (shard, member, _, _) in enumerate(wanted):
            offsets = indexes[shard]
            if offsets is not None:
                ranges.append((slot, shard, int(offsets[member]), int(offsets[member + 1])))
        blobs = self._fetch(ranges, stats)
        for (slot, shard, start, end), blob in zip(ranges, blobs, strict=True):
            if blob is None:
                continue
            stats.used_bytes += end - start
            _, member, aug_seed, flip = wanted[slot]
            try:
                if len(blob) != end - start:
                    raise ValueError(f"short read: {len(blob)} of {end - start} bytes")
                out[slot] = decode_sample(
                    parse_sample(blob), self.image_size, self.channels, flip, aug_seed, self.num_frames,
                    self.frame_stride,
                )  # fmt: skip
            except (OSError, ValueError, KeyError, tarfile.TarError, UnidentifiedImageError, Image.DecompressionBombError) as e:  # fmt: skip
                where = f"{self.shards.urls[shard]}#{member}"
                if where not in self._skips:
                    self._skips[where] = f"corrupt sample: {short_reason(str(e))}"
                    log.warning("skipping corrupt sample %s (pid %d): %s", where, os.getpid(), e)
        return out

    def skip_reason(self, shard: int, member: int) -> str:
        """Why (shard, member) came back as None in this process: "url#member (reason)"."""
        where = f"{self.shards.urls[shard]}#{member}"
        return f"{where} ({self._skips.get(where) or self._shard_errors.get(shard) or 'unreadable'})"

    def _fetch(self, ranges: list[tuple[int, int, int, int]], stats: FetchStats) -> list[bytes | None]:
        """All ranges concurrently, neighbours merged; failures retried with backoff, then the shard is skipped.

        Ranges of one shard that touch (or lie within `merge_gap` bytes of
        each other) become one request: request count, not bytes, is what a
        store's per-request latency and rate limits charge for. With
        `merge_gap` = 0 nothing but the samples' own bytes is fetched.
        """
        blobs: list[bytes | None] = [None] * len(ranges)
        # requests: [shard, start, end, [range numbers]]
        requests: list[list] = []
        for i in sorted(range(len(ranges)), key=lambda i: (ranges[i][1], ranges[i][2])):
            _, shard, start, end = ranges[i]
            if not self._alive(shard):
                continue
            last = requests[-1] if requests else None
            if last is not None and last[0] == shard and start - last[2] <= self.merge_gap:
                last[2] = max(last[2], end)
                last[3].append(i)
            else:
                requests.append([shard, start, end, [i]])
        todo = list(range(len(requests)))
        err: dict[int, BaseException] = {}
        for attempt in range(self.retries + 1):
            if not todo:
                break
            if attempt:
                time.sleep(self.backoff_seconds * 2 ** (attempt - 1))
            reqs = [requests[j] for j in todo]
            paths = [strip_protocol(self.fs, self.shards.urls[r[0]]) for r in reqs]
            try:
                got = self.fs.cat_ranges(paths, [r[1] for r in reqs], [r[2] for r in reqs], on_error="return")
            except Exception as e:  # noqa: BLE001 - a failure of the whole call: retry all
                got = [e] * len(todo)
            failed = []
            for j, g in zip(todo, got, strict=True):
                shard, start, _, members = requests[j]
                if isinstance(g, BaseException):
                    err[shard] = g
                    failed.append(j)
                    continue
                stats.data_bytes += len(g)
                view = memoryview(g)
                for i in members:  # a short read leaves the later samples short; load_many reports them
                    blobs[i] = bytes(view[ranges[i][2] - start : ranges[i][3] - start])
            todo = failed
        for shard in sorted({requests[j][0] for j in todo}):
            self._shard_failed(shard, err[shard], stats)
        stats.requests += len(requests)
        return blobs


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
        shard = int(np.searchsorted(self.starts, index, side="right") - 1)
        return shard, int(self.members(shard)[index - self.starts[shard]])

    def __getitem__(self, ref: SampleRef):
        return self.__getitems__([ref])[0]

    def __getitems__(self, refs: list[SampleRef]) -> FetchedItems:
        where = [self.locate(r.index) for r in refs]
        stats = FetchStats()
        loaded = self.shardset.load_many(
            [(s, m, r.aug_seed, self.flip) for (s, m), r in zip(where, refs, strict=True)], stats
        )
        items = FetchedItems()
        for (shard, member), ref, item in zip(where, refs, loaded, strict=True):
            gid = self.shardset.global_id(shard, member)
            if item is None:
                reason = self.shardset.skip_reason(shard, member)
                items.append(skipped_item(self.image_shape, gid, ref.position, reason))
            else:
                items.append((item[0], item[1], gid, ref.position, True, item[2]))
        items.stats = stats
        return items


class FetchedItems(list):
    """A step's loaded samples plus what fetching them cost (read by `collate`)."""

    stats: FetchStats | None = None


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
            order = np.random.default_rng(derive_seed(self.seed, _STREAM_SHARDS, epoch)).permutation(len(self.counts))
            sizes = [int(self.counts[order[w : w + self.window]].sum()) for w in range(0, len(order), self.window)]
            self._epoch_layout = (epoch, order, np.concatenate([[0], np.cumsum(sizes)]))
        return self._epoch_layout[1], self._epoch_layout[2]

    def _window_ids(self, epoch: int, w: int) -> np.ndarray:
        key = (epoch, w)
        if key not in self._windows:
            order, _ = self._layout(epoch)
            shards = order[w * self.window : (w + 1) * self.window]
            rng = np.random.default_rng(derive_seed(self.seed, _STREAM_WINDOW, epoch, w))
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
