"""The `encoded` settings of `gentrain data encode`'s shards, as one typed document from parse to use.

Where they are on disk (the same object in all three): `shards.json`'s `encoded`, each shard index's
`encoded` (what that shard was encoded with), and `encode.json` in the encode's folder. trainer/encode.py
builds an `EncodedSettings` and writes `model_dump(mode="json")`, which is the JSON those files have always
held, key for key and in the same order; `trainer.data.shards.index.load_shard_list` parses a list's once
(a malformed one exits 2 naming the file and the field) and the model is what the loader, the bucket
sources, the task (`TaskContext.encoding`) and the latent space read, by attribute. This module is the only
one that reads the settings by key.

Why strict types: the settings are compared as a whole (a rerun of an encode against the shards in its
folder, a validation set against the training set), so "64" must not pass for 64.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_serializer,
)

ENCODED_FORMAT = "gentrain-encoded/1"

Number = StrictFloat | StrictInt  # a float written by json.dumps (an int one written by hand reads as the same)


class _Open(BaseModel):
    """Known fields are typed; fields a newer gentrain adds are kept (forward compatible) and compared."""

    model_config = ConfigDict(extra="allow", frozen=True)


class EncodedAutoencoder(_Open):
    """The frozen autoencoder the posteriors are of: a run's `model.autoencoder` must have this digest."""

    url: StrictStr
    digest: StrictStr


class EncodedTextPart(_Open):
    """One folder of the text encoder (a pipeline's text_encoder_2, tokenizer, ...) and its digest."""

    url: StrictStr
    digest: StrictStr


class EncodedText(_Open):
    """The caption encoder(s) of the stored embeddings (`--text`): the combined digest a run checks, and each
    folder's own, so a run with another pipeline is told which part differs."""

    encoder: StrictStr
    kind: StrictStr | None = None
    digest: StrictStr
    max_tokens: StrictInt
    parts: dict[StrictStr, EncodedTextPart] = {}


class EncodedBuckets(_Open):
    """Aspect-ratio buckets of a bucketed encode (`data.buckets`): each bucket and its latent shape, and the
    rules that placed the samples (a run's `data.buckets` must give the same list)."""

    list: list[tuple[StrictInt, StrictInt]]
    latent_shapes: list[tuple[StrictInt, StrictInt, StrictInt]]
    step: StrictInt
    max_ratio: Number
    min_fraction: Number
    crop: StrictStr
    crop_seed: StrictInt | None
    assignment: StrictStr

    def latent_shape(self, size) -> tuple[int, ...]:
        """The latent shape of bucket (height, width)."""
        return tuple(self.latent_shapes[self.list.index(tuple(size))])


class EncodedSettings(_Open):
    """What an encode wrote: the format, the autoencoder (and text encoder) by digest, the image geometry, the
    posterior's shape and dtype, whether mirrored posteriors are stored, where the data came from, how the
    samples were laid out, and the buckets of a bucketed encode (absent, not null, in the JSON otherwise)."""

    format: StrictStr
    kind: StrictStr
    autoencoder: EncodedAutoencoder
    image_size: StrictInt
    channels: StrictInt
    latent_shape: tuple[StrictInt, StrictInt, StrictInt]
    dtype: StrictStr
    flip: StrictBool
    text: EncodedText | None
    data: dict[StrictStr, Any]  # the source's data.* keys, as provenance: nothing reads them
    samples: StrictInt
    samples_per_shard: StrictInt
    shuffle_seed: StrictInt | None
    buckets: EncodedBuckets | None = None

    @model_serializer(mode="wrap")
    def _as_written(self, handler) -> dict[str, Any]:
        """The JSON encode has always written: `buckets` only for a bucketed encode (`text` is null without)."""
        out = handler(self)
        if out.get("buckets") is None:
            out.pop("buckets", None)
        return out

    def posterior_shape(self) -> tuple[int, ...]:
        """What the loader yields per sample (mean and std stacked on the channel axis)."""
        c, h, w = self.latent_shape
        return (2 * c, h, w)

    def differences(self, other: EncodedSettings) -> str:
        """The top-level settings that differ, each with both values ("key: X there, Y now"), for messages that
        refuse shards encoded with other settings (`self` is the shards', `other` the asked-for)."""
        found, asked = self.model_dump(mode="json"), other.model_dump(mode="json")
        diff = sorted(k for k in set(found) | set(asked) if found.get(k) != asked.get(k))
        return "; ".join(f"{k}: {found.get(k)!r} there, {asked.get(k)!r} now" for k in diff)


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(["encoded", *(str(p) for p in err["loc"])])
    if err["type"] == "missing":
        return f"{where}: missing"
    value = repr(err.get("input"))
    if len(value) > 60:
        value = value[:57] + "..."
    return f"{where}: {err['msg']} (found {value})"


def parse_settings(raw: object) -> EncodedSettings:
    """An `encoded` object read from JSON as the model; ValueError naming the first bad field (`encoded.<key>`)
    and the value found. Another format is named as such, before its fields are read."""
    if not isinstance(raw, dict):
        raise ValueError(f"encoded: not an object (found {type(raw).__name__})")
    if raw.get("format") != ENCODED_FORMAT:
        raise ValueError(f"encoded shards of format {raw.get('format')!r}, not {ENCODED_FORMAT}")
    try:
        return EncodedSettings.model_validate(raw)
    except ValidationError as e:
        raise ValueError(_first_error(e)) from None
    except RecursionError:
        raise ValueError("encoded: nested too deeply") from None


def settings_in(doc: dict) -> EncodedSettings | None:
    """The `encoded` settings a shard list or a shard index records (None: it records none, as `data pack`'s
    and `data index`'s do); ValueError when they are malformed (see `parse_settings`)."""
    raw = doc.get("encoded")
    return None if raw is None else parse_settings(raw)
