"""WebDataset tar shards on any fsspec store, read sample by sample through byte ranges from a per-shard index.

One module per concern:
- `index`: URLs, the shard list (`shards.json`) and the per-shard `.idx.json` offsets (formats there);
- `tar`: sample offsets of a whole shard (for its index) and the members of one sample's tar bytes;
- `decode`: a sample's members into (image or clip, label, extras);
- `fetch`: `ShardSet`, random access through merged concurrent range requests, retries, dead-shard timers
  (why byte ranges and not whole shards: see there);
- `split`: `ShardSplit`, the training or validation members of every shard, read a step at a time;
- `order`: `ShardStream`, the per-epoch order;
- `encoded`, `latents`: `gentrain data encode`'s settings (`EncodedSettings`, parsed with the list) and its samples.

The order: each epoch permutes the shards, groups them into windows of
`data.shard_window` shards and permutes runs of `data.shuffle_block`
neighbouring samples within each window. It is a function of (seed, epoch,
shard list, window, block) only, so any world size and any number of loader
workers read the same stream; a worker only needs the indexes of the shards of
the current window.
"""

from trainer.data.shards.decode import decode_sample
from trainer.data.shards.fetch import FetchStats, ShardSet
from trainer.data.shards.index import (
    INDEX_FORMAT,
    INDEX_SUFFIX,
    SHARDLIST_KIND,
    SHARDLIST_NAME,
    ShardList,
    expand_urls,
    filesystem,
    index_json,
    index_url,
    load_shard_list,
    parse_index,
    shard_list_json,
    strip_protocol,
    url_dir,
)
from trainer.data.shards.order import ShardStream
from trainer.data.shards.split import FetchedItems, ShardSplit
from trainer.data.shards.tar import parse_sample, scan_tar, split_name

__all__ = [
    "INDEX_FORMAT",
    "INDEX_SUFFIX",
    "SHARDLIST_KIND",
    "SHARDLIST_NAME",
    "FetchStats",
    "FetchedItems",
    "ShardList",
    "ShardSet",
    "ShardSplit",
    "ShardStream",
    "decode_sample",
    "expand_urls",
    "filesystem",
    "index_json",
    "index_url",
    "load_shard_list",
    "parse_index",
    "parse_sample",
    "scan_tar",
    "shard_list_json",
    "split_name",
    "strip_protocol",
    "url_dir",
]
