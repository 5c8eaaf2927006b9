"""Random access to a shard list's samples through byte ranges: index cache, merged range requests, retries,
and a timer that skips a shard for a while after it failed every retry.

Why byte ranges from an index (and not streaming whole shards, or a local
shard cache): the data position is one global cursor and rank r of W reads
its slice of every step's batch, so a rank uses about 1/W of every shard it
touches. Streaming shards would fetch W times the bytes it uses (or force a
shard-per-rank split that changes the sample order with the world size); a
local cache needs the disk for every shard a window touches. With the byte
offset of every sample (one integer per sample, see `trainer.data.shards.index`),
a rank fetches exactly the tar bytes of its own samples, one range request per
run of neighbouring samples, all of a step's requests concurrently (fsspec
`cat_ranges`).

Pinned shards (`gentrain data encode`'s; see `trainer.data.shards.index`): an index whose blake3 is not
the one the shard list pins makes its shard foreign, skipped whole for the rest of the process (a
mismatch does not heal, unlike an unreachable store); a sample whose bytes' digest is not the one its
index records is a corrupt sample. Both are skipped and counted like any unreadable sample (the zero-weight
slot, `skipped_samples`, `data.max_skipped_fraction`'s stop naming them), so their bytes never reach a
step: the policy of every unreadable sample, and a run on many of them stops with exit 2.
"""

from __future__ import annotations

import logging
import math
import os
import tarfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from fsspec.implementations.local import LocalFileSystem
from PIL import Image, UnidentifiedImageError

from trainer.data.datasets import short_reason
from trainer.data.shards.decode import decode_sample
from trainer.data.shards.index import (
    SAMPLE_DIGEST_BYTES,
    ShardList,
    digest,
    filesystem,
    index_url,
    read_index,
    sample_digest,
    strip_protocol,
)
from trainer.data.shards.latents import decode_encoded_sample
from trainer.data.shards.tar import parse_samples

log = logging.getLogger(__name__)

# A shard that failed every retry is skipped for this long before it is tried again.
_DEAD_SECONDS = 300.0


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
        crop: str = "center",
    ):
        self.shards = shards
        self.crop = crop  # data.crop: how an image is cropped to its aspect-ratio bucket
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
        # shard -> (offsets, its samples' digests back to back or None), the shards touched recently
        self._indexes: OrderedDict[int, tuple[np.ndarray, bytes | None]] = OrderedDict()
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

    def _shard_failed(self, shard: int, why: BaseException, stats: FetchStats) -> None:
        url = self.shards.urls[shard]
        self._dead_until[shard] = time.monotonic() + _DEAD_SECONDS
        self._shard_errors[shard] = short_reason(
            f"shard unreadable after {self.retries} retries: {type(why).__name__}: {why}"
        )
        stats.failed_shards.append(url)
        log.warning(
            "skipping shard %s after %d retries (pid %d): %s: %s",
            url,
            self.retries,
            os.getpid(),
            type(why).__name__,
            why,
        )

    def _shard_refused(self, shard: int, why: str, detail: str, stats: FetchStats) -> None:
        """A shard that is not the one the list pins: skipped for the rest of this process (see the module doc)."""
        url = self.shards.urls[shard]
        self._dead_until[shard] = math.inf
        self._shard_errors[shard] = short_reason(why)
        stats.failed_shards.append(url)
        log.warning("skipping shard %s (pid %d): %s; %s", url, os.getpid(), why, detail)

    def _alive(self, shard: int) -> bool:
        until = self._dead_until.get(shard)
        return until is None or time.monotonic() >= until

    def indexes(self, shards: list[int], stats: FetchStats) -> dict[int, tuple[np.ndarray, bytes | None] | None]:
        """(offsets, sample digests or None) of each shard (None: unreadable or refused), the ones not cached
        fetched with concurrent requests."""
        out: dict[int, tuple[np.ndarray, bytes | None] | None] = {}
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

    def _parsed_index(self, shard: int, blob: bytes, stats: FetchStats) -> tuple[np.ndarray, bytes | None] | None:
        url = index_url(self.shards.urls[shard])
        pinned = self.shards.index_digests[shard] if self.shards.index_digests is not None else None
        found = digest(blob) if pinned is not None else None
        if found != pinned:
            self._shard_refused(
                shard,
                "foreign shard: its index is not the one the shard list pins (another encode's, or altered since)",
                f"{url} has digest {found}, the shard list pins {pinned}: restore that shard and its index, "
                "or encode again",
                stats,
            )
            return None
        try:
            offsets, digests, _ = read_index(blob, url)
        except (ValueError, KeyError) as e:
            self._shard_failed(shard, e, stats)
            return None
        if len(offsets) - 1 != self.shards.counts[shard]:
            self._shard_failed(
                shard,
                ValueError(f"index has {len(offsets) - 1} samples, shard list says {self.shards.counts[shard]}"),
                stats,
            )
            return None
        self._indexes[shard] = (offsets, digests)
        while len(self._indexes) > self.index_cache:
            self._indexes.popitem(last=False)
        return offsets, digests

    def load_many(self, wanted: list[tuple], stats: FetchStats) -> list:
        """(shard, member, aug_seed, flip[, (height, width) bucket or None]) -> (image, label, extras) or None,
        fetching all ranges at once."""
        out: list = [None] * len(wanted)
        ranges: list[tuple[int, int, int, int]] = []  # (slot, shard, start, end)
        indexes = self.indexes([w[0] for w in wanted], stats)
        for slot, (shard, member, *_) in enumerate(wanted):
            index = indexes[shard]
            if index is not None:
                ranges.append((slot, shard, int(index[0][member]), int(index[0][member + 1])))
        blobs = self._fetch(ranges, stats)
        forged: set[int] = set()  # ranges whose bytes are not the ones their index records
        for i, ((slot, shard, start, end), blob) in enumerate(zip(ranges, blobs, strict=True)):
            pins = indexes[shard][1]
            if pins is not None and blob is not None and len(blob) == end - start:
                at = wanted[slot][1] * SAMPLE_DIGEST_BYTES
                if sample_digest(blob) != pins[at : at + SAMPLE_DIGEST_BYTES]:
                    forged.add(i)
        whole = [
            i
            for i, (r, blob) in enumerate(zip(ranges, blobs, strict=True))
            if blob is not None and len(blob) == r[3] - r[2] and i not in forged
        ]
        parsed = dict(zip(whole, parse_samples([blobs[i] for i in whole]), strict=True))
        for i, ((slot, shard, start, end), blob) in enumerate(zip(ranges, blobs, strict=True)):
            if blob is None:
                continue
            stats.used_bytes += end - start
            _, member, aug_seed, flip, *bucket = wanted[slot]
            size = bucket[0] if bucket else None
            try:
                if len(blob) != end - start:
                    raise ValueError(f"short read: {len(blob)} of {end - start} bytes")
                if i in forged:
                    raise ValueError(
                        "digest mismatch: its bytes are not those its index records (a corrupt shard, or one "
                        "replaced by another encode's)"
                    )
                members = parsed[i]
                if isinstance(members, Exception):
                    raise members
                if self.shards.encoded is not None:  # `gentrain data encode`'s shards: posteriors, not images
                    out[slot] = decode_encoded_sample(members, self.shards.encoded, flip, aug_seed, size)
                    continue
                out[slot] = decode_sample(
                    members,
                    self.image_size,
                    self.channels,
                    flip,
                    aug_seed,
                    self.num_frames,
                    self.frame_stride,
                    size,
                    self.crop,
                )
            except (
                OSError,
                ValueError,
                KeyError,
                tarfile.TarError,
                UnidentifiedImageError,
                Image.DecompressionBombError,
            ) as e:
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
            local = {shard: strip_protocol(self.fs, self.shards.urls[shard]) for shard in {r[0] for r in reqs}}
            paths = [local[r[0]] for r in reqs]
            try:
                got = cat_ranges(self.fs, paths, [r[1] for r in reqs], [r[2] for r in reqs])
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


def cat_ranges(fs, paths: list[str], starts: list[int], ends: list[int]) -> list:
    """`fs.cat_ranges(paths, starts, ends, on_error="return")`, with each local file opened once.

    Written by hand for the local disk only: fsspec's `LocalFileSystem` has no `cat_ranges` of its own, and
    the generic one opens the file again for every range (22 us a range here: 1.4 ms of a step of 64
    encoded latents, most of what reading them cost). One `os.open` per file and an `os.pread` a range is
    about 2 us a range. Any other store gets its own (concurrent) `cat_ranges`."""
    if type(fs) is not LocalFileSystem:
        return fs.cat_ranges(paths, starts, ends, on_error="return")
    out: list = [None] * len(paths)
    by_path: dict[str, list[int]] = {}
    for i, path in enumerate(paths):
        by_path.setdefault(path, []).append(i)
    for path, ranges in by_path.items():
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            for i in ranges:
                out[i] = e
            continue
        try:
            for i in ranges:
                try:
                    out[i] = os.pread(fd, max(ends[i] - starts[i], 0), starts[i])
                except OSError as e:
                    out[i] = e
        finally:
            os.close(fd)
    return out
