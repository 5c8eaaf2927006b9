"""Where the shards are and how many samples each holds: URL helpers, the shard list, per-shard index files.

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

import json
import posixpath
from dataclasses import dataclass

import numpy as np

from trainer import storage
from trainer.errors import ConfigError

INDEX_FORMAT = "gentrain-tar-index/1"
INDEX_SUFFIX = ".idx.json"
SHARDLIST_NAME = "shards.json"
SHARDLIST_KIND = "wids-shard-index-v1"


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
    """The fsspec filesystem of `url` (a missing s3fs/gcsfs is a ConfigError naming the extra)."""
    return storage.filesystem(url, storage_options)[0]


def strip_protocol(fs, url: str) -> str:
    return fs._strip_protocol(url)


@dataclass
class ShardList:
    """The shards of a data set, their sample counts, and the class names when the packer knew them."""

    urls: list[str]
    counts: np.ndarray  # samples per shard
    classes: list[str] | None = None
    num_classes: int | None = None
    # `shards.json`'s `encoded` settings when `gentrain data encode` wrote the shards (latents, not images).
    encoded: dict | None = None


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
    folders = {url_dir(u) for u in shard_urls}
    if len(folders) == 1:
        list_url = posixpath.join(folders.pop(), SHARDLIST_NAME)
        try:
            listed = json.loads(fs.cat_file(strip_protocol(fs, list_url), start=0))
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
            counts[strip_protocol(fs, u)] = len(parse_index(blob, index_url(u))) - 1
    return _shard_list(shard_urls, np.array([counts[strip_protocol(fs, u)] for u in shard_urls]), listed)


def _shard_list(urls: list[str], counts: np.ndarray, listed: dict) -> ShardList:
    classes = listed.get("classes")
    num_classes = listed.get("num_classes") or (len(classes) if classes else None)
    encoded = listed.get("encoded")
    return ShardList(
        urls, counts.astype(np.int64), classes, num_classes, encoded if isinstance(encoded, dict) else None
    )


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


def index_json(offsets: list[int], shard_bytes: int) -> bytes:
    return json.dumps({"format": INDEX_FORMAT, "shard_bytes": shard_bytes, "offsets": offsets}).encode()


def shard_list_json(entries: list[dict], classes: list[str] | None, num_classes: int | None) -> bytes:
    doc: dict = {"__kind__": SHARDLIST_KIND, "wids_version": 1, "shardlist": entries}
    if classes:
        doc["classes"] = classes
    if num_classes:
        doc["num_classes"] = num_classes
    return json.dumps(doc, indent=1).encode()
