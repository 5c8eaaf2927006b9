"""Where the shards are and how many samples each holds: URL helpers, the shard list, per-shard index files.

Files (both JSON):
- `<shard>.idx.json`: {"format": "gentrain-tar-index/1", "shard_bytes": B,
  "offsets": [o_0, ..., o_N]}: sample i is the tar bytes [o_i, o_{i+1}) (its
  members' headers and data; webdataset groups members by key, and a sample's
  members are consecutive). Optional: `sizes` ([height, width] of each
  sample's image, which `gentrain data pack` writes: `data.buckets` reads
  them instead of the images' headers) and `buckets` (each sample's bucket
  number in a `gentrain data encode` set encoded in aspect-ratio buckets).
- `shards.json` (in the shards' folder): the wids shard list
  (`__kind__: wids-shard-index-v1`, `shardlist: [{url, nsamples, filesize}]`),
  plus gentrain's `classes`; lets every rank learn all sample counts with one
  request. Without it, the counts come from the per-shard indexes. Its entries
  name shards in its own folder only (relative paths; no `..`, absolute path,
  other store or wids `base`): a list in a bucket never sends a run to read
  from elsewhere.

Pinned by content (`gentrain data encode`'s shards; optional for others): a
shard list entry carries `digest` (blake3 of the tar) and `index_digest`
(blake3 of its `.idx.json`); that index carries `sample_digests` (the first 16
bytes of the blake3 of each sample's tar bytes [o_i, o_{i+1}), hex) and
`encoded` (the encode's settings, its autoencoder's digest among them). A reader
checks an index against `index_digest` when it loads it (once per shard per
process) and each sample's bytes against the index as it reads them: byte
ranges cannot check a whole-shard digest without reading the whole shard, and
a sample's digest costs a few microseconds of the bytes already in memory.

wids' own indexes are pickles built after downloading whole shards, so they
are neither safe to load from storage nor usable for range reads; only the
shard-list format is shared.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass

import blake3
import numpy as np

from trainer import storage
from trainer.data.shards.encoded import EncodedSettings, settings_in
from trainer.errors import ConfigError

INDEX_FORMAT = "gentrain-tar-index/1"
INDEX_SUFFIX = ".idx.json"
SHARDLIST_NAME = "shards.json"
SHARDLIST_KIND = "wids-shard-index-v1"
# A sample's digest: the first 16 bytes of blake3 (a second preimage of 128 bits is out of reach; the index
# stays about 4 times its offsets' size).
SAMPLE_DIGEST_BYTES = 16
_DIGEST = re.compile(r"blake3:[0-9a-f]{64}")
# A protocol (`s3:`, `file:`), an fsspec chain (`memory::x`) or a Windows drive: not a path in the list's folder.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|::")


def digest(data) -> str:
    """blake3 of bytes (or any buffer), as shard lists and indexes record it."""
    return "blake3:" + blake3.blake3(data).hexdigest()


def sample_digest(data) -> bytes:
    """What an index records of one sample's tar bytes (see `SAMPLE_DIGEST_BYTES`)."""
    return blake3.blake3(data).digest(length=SAMPLE_DIGEST_BYTES)


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


def _inside(rel: object) -> str | None:
    """`rel` normalized when it is a path inside the list's folder, else None."""
    if not isinstance(rel, str) or not rel or rel.startswith(("/", "\\")) or _SCHEME.search(rel):
        return None
    norm = posixpath.normpath(rel)
    if norm in (".", "..") or norm.startswith("../"):
        return None
    return norm


def _entries(listed: object, url: str, key: str) -> list[tuple[str, int, str | None]]:
    """(path in the list's folder, samples, index digest or None) of every entry; ConfigError naming the bad one."""
    if not isinstance(listed, dict):
        raise ConfigError(f"{key}={url!r} is not a shard list (a JSON object with 'shardlist')")
    if listed.get("base"):
        raise ConfigError(
            f"{key}={url!r}: its 'base' {listed['base']!r} points the shards elsewhere; gentrain reads only shards "
            "in the shard list's own folder: list shards of other folders in data.urls itself"
        )
    entries = listed.get("shardlist") or []
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{key}={url!r} lists no shards (expected a wids shard list with 'shardlist')")
    out = []
    for i, e in enumerate(entries):
        where = f"{key}={url!r}: shardlist[{i}]"
        if not isinstance(e, dict):
            raise ConfigError(f"{where} is {e!r}, not an object with 'url' and 'nsamples'")
        rel = _inside(e.get("url"))
        if rel is None:
            raise ConfigError(
                f"{where} has url {e.get('url')!r}: a shard list names shards in its own folder only (a relative "
                "path without '..'; no absolute path or other store); list other shards in data.urls itself"
            )
        n = e.get("nsamples")
        if type(n) is not int or n < 0:
            raise ConfigError(f"{where} ({rel}) has nsamples {n!r}: expected a whole number of samples, 0 or more")
        pin = e.get("index_digest")
        if pin is not None and not (isinstance(pin, str) and _DIGEST.fullmatch(pin)):
            raise ConfigError(f"{where} ({rel}) has index_digest {pin!r}: expected 'blake3:' and 64 hex digits")
        out.append((rel, n, pin))
    return out


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
    encoded: EncodedSettings | None = None
    # Per shard, the blake3 of its `.idx.json` the list pins ("blake3:..."), None where it pins none; None: no pins.
    index_digests: list[str | None] | None = None


def load_shard_list(urls: str | list[str], storage_options: dict | None, key: str = "data.urls") -> ShardList:
    """Resolve `data.urls` (patterns, or one `.json` shard list) to shards with counts; ConfigError if unusable."""
    if isinstance(urls, str) and urls.endswith(".json"):
        listed = _read_json(urls, storage_options, key)
        entries = _entries(listed, urls, key)
        shard_urls = [posixpath.join(url_dir(urls), rel) for rel, _, _ in entries]
        counts = np.array([n for _, n, _ in entries], dtype=np.int64)
        return _shard_list(shard_urls, counts, listed, [pin for _, _, pin in entries], f"{key}={urls!r}", urls)

    shard_urls = expand_urls(urls)
    if not shard_urls:
        raise ConfigError(f"{key}={urls!r} expands to no shards")
    fs = filesystem(shard_urls[0], storage_options)
    # One request for all counts when the shards' folder has a shard list covering them.
    counts: dict[str, int] = {}
    pins: dict[str, str | None] = {}
    listed: dict = {}
    folders = {url_dir(u) for u in shard_urls}
    list_url = SHARDLIST_NAME  # none read: `listed` stays empty
    if len(folders) == 1:
        list_url = posixpath.join(folders.pop(), SHARDLIST_NAME)
        try:
            listed = json.loads(fs.cat_file(strip_protocol(fs, list_url), start=0))
        except FileNotFoundError:
            pass
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{key}: {list_url} is not JSON: {e}") from None
        listed = listed if isinstance(listed, dict) else {}
        if listed.get("shardlist"):  # none: another tool's shards.json; the counts come from the indexes
            for rel, n, pin in _entries(listed, list_url, key):
                counts[strip_protocol(fs, posixpath.join(url_dir(list_url), rel))] = n
                pins[strip_protocol(fs, posixpath.join(url_dir(list_url), rel))] = pin
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
    counted = np.array([counts[strip_protocol(fs, u)] for u in shard_urls])
    pinned = [pins.get(strip_protocol(fs, u)) for u in shard_urls]
    return _shard_list(shard_urls, counted, listed, pinned, f"{key}={urls!r}", list_url)


def _shard_list(
    urls: list[str], counts: np.ndarray, listed: dict, pins: list[str | None], what: str, list_url: str
) -> ShardList:
    """The list; an encoded set (`encoded` settings, parsed here once: malformed ones exit 2 naming the file
    and the field) must pin every shard's index by digest.

    Why refused, not read with a warning: nothing else proves that the shards of an encoded set are the
    ones that encode wrote (Found 1 of issue 47: another encode's shards under a new shards.json trained
    with exit 0), and encoding again is the way to pins."""
    classes = listed.get("classes")
    num_classes = listed.get("num_classes") or (len(classes) if classes else None)
    try:
        encoded = settings_in(listed)
    except ValueError as e:
        raise ConfigError(
            f"{what}: the `encoded` settings of {list_url} are not ones this gentrain's `data encode` writes "
            f"({e}): encode the images again with `gentrain data encode`, or train from image shards"
        ) from None
    if encoded is not None and None in pins:
        bare = urls[pins.index(None)]
        raise ConfigError(
            f"{what}: encoded shards with no content digests ({bare} has no index_digest in shards.json): "
            "written by a gentrain that did not yet pin encodes by content, or the list does not cover it, so "
            "nothing proves these are the shards that encode wrote; run `gentrain data encode` again into a new "
            "folder and train from the shards.json it writes"
        )
    return ShardList(urls, counts.astype(np.int64), classes, num_classes, encoded, pins if any(pins) else None)


def _read_json(url: str, storage_options: dict | None, key: str) -> dict:
    fs = filesystem(url, storage_options)
    try:
        return json.loads(fs.cat_file(strip_protocol(fs, url), start=0))
    except FileNotFoundError:
        raise ConfigError(f"{key}={url!r} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}={url!r} is not JSON: {e}") from None


def parse_index(blob: bytes, url: str) -> np.ndarray:
    return read_index(blob, url)[0]


def read_index(blob: bytes, url: str) -> tuple[np.ndarray, bytes | None, dict]:
    """(offsets, the samples' digests back to back or None, the whole document); ValueError if malformed."""
    data = json.loads(blob)
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
        raise ValueError(f"{url}: not a {INDEX_FORMAT} index")
    try:
        offsets = np.asarray(data["offsets"], dtype=np.int64)
    except (KeyError, TypeError, OverflowError):
        raise ValueError(f"{url}: no list of whole-number offsets") from None
    if offsets.ndim != 1 or len(offsets) < 1 or np.any(np.diff(offsets) <= 0):
        raise ValueError(f"{url}: offsets must be increasing")
    listed = data.get("sample_digests")
    if listed is None:
        return offsets, None, data
    try:
        digests = bytes.fromhex("".join(listed)) if isinstance(listed, list) else None
    except (TypeError, ValueError):
        digests = None
    if digests is None or len(listed) != len(offsets) - 1 or len(digests) != SAMPLE_DIGEST_BYTES * len(listed):
        raise ValueError(f"{url}: sample_digests must be one {2 * SAMPLE_DIGEST_BYTES}-digit hex string a sample")
    return offsets, digests, data


def index_json(offsets: list[int], shard_bytes: int, **pins) -> bytes:
    """An index; `pins` (`gentrain data encode`'s): `digest`, `sample_digests`, `encoded` (see the module doc)."""
    return json.dumps({"format": INDEX_FORMAT, "shard_bytes": shard_bytes, "offsets": offsets, **pins}).encode()


def shard_list_json(entries: list[dict], classes: list[str] | None, num_classes: int | None) -> bytes:
    doc: dict = {"__kind__": SHARDLIST_KIND, "wids_version": 1, "shardlist": entries}
    if classes:
        doc["classes"] = classes
    if num_classes:
        doc["num_classes"] = num_classes
    return json.dumps(doc, indent=1).encode()
