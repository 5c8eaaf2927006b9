"""Hugging Face `datasets` as a source (data.source=hf): a `save_to_disk` folder, parquet files, or an
`imagefolder` directory, read offline, with the same interface as the image folder.

The `datasets` library does the reading (Arrow tables, memory-mapped and in a fixed row order), so the
source has a stable length and index order and the global sample stream (trainer/data/sampler.py) drives
it unchanged: same cursor, exact resume at any world size. Images are decoded here, not by `datasets`
(the image column is cast to `Image(decode=False)`), so a row whose image cannot be used is skipped and
counted like a corrupt file of the folder source instead of raising inside a DataLoader worker.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec
import torch
from PIL import Image, UnidentifiedImageError

from trainer.data.buckets import SIZE_CONDITIONS, load_in_bucket
from trainer.data.datasets import _READ_ERRORS, IMAGE_EXTENSIONS, image_to_tensor, short_reason
from trainer.errors import ConfigError
from trainer.storage import filesystem

log = logging.getLogger(__name__)

# The files `Dataset.save_to_disk` / `DatasetDict.save_to_disk` write (datasets.config's names).
DATASET_FILES = ("dataset_info.json", "state.json")
DATASET_DICT_FILE = "dataset_dict.json"
WANTED = (
    "a folder written by Dataset.save_to_disk or DatasetDict.save_to_disk, a .parquet file, a glob of them or "
    "a folder holding them (local or an fsspec URL), or a local imagefolder directory of images "
    "(with an optional metadata.jsonl)"
)


def import_datasets(needed_by: str = "data.source=hf"):
    """The `datasets` library (the `hf` extra), offline: it never asks the Hub for anything. A ConfigError
    (exit 2) naming the extra when it is not installed."""
    # Read by datasets when it is imported (a user's own setting wins). HF_HUB_OFFLINE is left alone: other
    # parts of a run (a text encoder) may use the Hub, and nothing here passes a Hub id (`resolve_source`
    # refuses one), only local paths, store URLs and the packaged `parquet`/`imagefolder` loaders.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            f"{needed_by} reads Hugging Face datasets with the `datasets` library, which is not installed ({e}): "
            "pip install 'gentrain[hf]'"
        ) from None
    datasets.disable_progress_bars()  # one bar per split and shard would drown the training log
    return datasets


def _is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def resolve_source(path: str, storage_options: Mapping[str, Any], key: str = "data.path") -> tuple[str, Any]:
    """What `path` holds: ("disk", url) for a save_to_disk folder (a Dataset or a DatasetDict), ("parquet",
    files or glob), or ("imagefolder", local folder). Anything else is the user's mistake: ConfigError
    (exit 2) naming `key`, the value and what is read; a Hugging Face Hub id is refused (offline only)."""
    if not path:
        raise ConfigError(f"{key}={path!r}: empty; set it to {WANTED}")
    protocol = fsspec.core.split_protocol(path)[0]
    remote = protocol not in (None, "file", "local")
    try:
        fs, root = filesystem(path, storage_options)
        if _is_glob(root):
            found = sorted(fs.glob(root))
            if not any(p.endswith(".parquet") for p in found):
                raise ConfigError(f"{key}={path!r}: the glob matches no .parquet file; set it to {WANTED}")
            return "parquet", path
        if fs.isfile(root):
            if root.endswith(".parquet"):
                return "parquet", path
            raise ConfigError(f"{key}={path!r} is a file, not a dataset; set it to {WANTED}")
        if not fs.isdir(root):
            raise FileNotFoundError(root)
        names = {PurePosixPath(p).name for p in fs.ls(root, detail=False)}
        if DATASET_DICT_FILE in names or all(n in names for n in DATASET_FILES):
            return "disk", path
        files = [PurePosixPath(p) for p in fs.find(root)]
    except ConfigError:
        raise
    except FileNotFoundError:
        hub = not remote and not Path(path).is_absolute() and path.count("/") <= 1 and not path.startswith(".")
        hint = (
            " It looks like a Hugging Face Hub id: gentrain reads datasets offline only, so download it first "
            "(e.g. `huggingface-cli download --repo-type dataset ID --local-dir DIR`, or load_dataset(ID)"
            ".save_to_disk(DIR) where the Hub is reachable) and set data.path to DIR."
            if hub
            else ""
        )
        raise ConfigError(f"{key}={path!r}: no such file or folder; set it to {WANTED}.{hint}") from None
    except Exception as e:  # noqa: BLE001 - a store's client errors (credentials, network) name themselves
        raise ConfigError(
            f"{key}={path!r}: cannot list it ({type(e).__name__}: {e}); set it to {WANTED} this process can read"
        ) from None
    if any(p.suffix == ".parquet" for p in files):
        return "parquet", path
    if any(p.suffix.lower() in IMAGE_EXTENSIONS for p in files):
        if remote:
            raise ConfigError(
                f"{key}={path!r}: an imagefolder is read from the local disk only; for images on a store use "
                "data.source=folder (it reads metadata.jsonl captions too)"
            )
        return "imagefolder", path
    found = f"{len(files)} other files, e.g. {files[0].name!r}" if files else "nothing"
    raise ConfigError(f"{key}={path!r} is not a dataset ({found}); set it to {WANTED}")


PROBE_ROWS = 32  # rows decoded at start, at most, to find one readable image

# Split names as the Hub's file layout spells them (`data/train-00000-of-00002.parquet`, `test/0.parquet`).
SPLIT_NAMES = ("train", "validation", "valid", "val", "test", "eval", "dev")


def _split_of(rel: PurePosixPath) -> str | None:
    """The split a parquet file's relative path names (a folder or a file-name prefix), else None."""
    for part in (*rel.parent.parts, rel.stem):
        low = part.lower()
        for name in SPLIT_NAMES:
            if low == name or low.startswith((f"{name}-", f"{name}_", f"{name}.")):
                return name
    return None


def parquet_split_files(url: str, split: str, storage_options: Mapping[str, Any], key: str) -> list[str]:
    """The .parquet files below folder `url` that make up `split`: those whose folder or file-name prefix is
    the split's name (the Hub's layout), or every one for `train` when none names a split. Written here
    because datasets' own resolution of a `data_dir` also takes every other file of the folder (the
    .arrow files of a save_to_disk beside the parquet, a README) as parquet."""
    fs, root = filesystem(url, storage_options)
    found = sorted(p for p in fs.find(root) if p.endswith(".parquet"))
    by_split: dict[str, list[str]] = {}
    for p in found:
        name = _split_of(PurePosixPath(p).relative_to(PurePosixPath(root)))
        by_split.setdefault(name or "", []).append(fs.unstrip_protocol(p) if "://" in url else p)
    named = sorted(s for s in by_split if s)
    if split in by_split:
        return by_split[split]
    if not named and split == "train":
        return by_split[""]
    raise ConfigError(
        f"data.hf_split={split!r}: no parquet file below {key}={url!r} names that split "
        f"({'the splits named are ' + str(named) if named else 'no file names a split, so all are train'}); "
        "set data.hf_split, or data.path to the split's files (a glob: every file it matches is the split)"
    )


def open_split(
    path: str,
    split: str,
    storage_options: Mapping[str, Any] | None = None,
    key: str = "data.path",
    cache_dir: str | None = None,
):
    """`datasets.Dataset` of `split` read from `path` (see `resolve_source`). `cache_dir`: where parquet and
    imagefolder are converted to Arrow (default: datasets' cache, HF_DATASETS_CACHE); a save_to_disk folder
    is memory-mapped where it is."""
    datasets = import_datasets()
    options = dict(storage_options or {})
    kind, where = resolve_source(path, options, key)
    try:
        if kind == "disk":
            loaded = datasets.load_from_disk(where, storage_options=options or None)
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise ConfigError(
                        f"data.hf_split={split!r}: {key}={path!r} is a DatasetDict with the splits "
                        f"{sorted(loaded)}; set data.hf_split to one of them"
                    )
                return loaded[split]
            return loaded
        if kind == "parquet":
            if _is_glob(where) or where.endswith(".parquet"):
                # Files named one by one are the split asked for, whatever its name.
                return datasets.load_dataset(
                    "parquet", data_files={split: where}, split=split, storage_options=options, cache_dir=cache_dir
                )
            files = parquet_split_files(where, split, options, key)
            return datasets.load_dataset(
                "parquet", data_files={split: files}, split=split, storage_options=options, cache_dir=cache_dir
            )
        return datasets.load_dataset("imagefolder", data_dir=where, split=split, cache_dir=cache_dir)
    except ConfigError:
        raise
    except ValueError as e:
        if "Unknown split" in str(e):  # datasets' own words, which list the splits there are
            raise ConfigError(f"data.hf_split={split!r}: {key}={path!r}: {e}; set data.hf_split") from None
        raise ConfigError(f"{key}={path!r}: cannot read it as a {kind} dataset ({e}); set it to {WANTED}") from None
    except Exception as e:  # noqa: BLE001 - arrow, fsspec and datasets errors for a malformed dataset
        raise ConfigError(
            f"{key}={path!r}: cannot read it as a {kind} dataset ({type(e).__name__}: {e}); set it to {WANTED}"
        ) from None


def _holds_text(feature, datasets) -> bool:
    """False for a plain column of another type (caught at start); other features (lists) are checked per
    row, where a caption that is not a string skips its row."""
    return not isinstance(feature, datasets.Value) or feature.dtype in ("string", "large_string")


class HFDataset:
    """One split of a Hugging Face dataset: images resized on the short side and center-cropped (as the
    folder source), the caption from `caption_column` when the dataset has it, the label from
    `label_column` (a ClassLabel, integers or strings; none: -1, as the folder's top-level images).

    An image cell may be a `datasets.Image` (read as {"bytes", "path"}), raw bytes or a path. A row whose
    image is missing, of another type or undecodable, or whose caption is not a string, is skipped at load
    time like an unreadable file of the folder source: the slot stays zeros with valid=False, the loop
    counts it against `data.max_skipped_fraction`, and each bad row is logged once per process. A missing
    column is found at start: exit 2 naming the columns there are; so is a split with no readable image
    (`check_readable`, see `_check_readable`)."""

    def __init__(
        self,
        path: str,
        image_size: int,
        channels: int = 3,
        split: str = "train",
        image_column: str = "image",
        caption_column: str | None = "text",
        caption_required: bool = False,
        label_column: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        key: str = "data.path",
        cache_dir: str | None = None,
        check_readable: bool = True,
        crop: str = "center",
    ):
        datasets = import_datasets()
        ds = open_split(path, split, storage_options, key, cache_dir)
        self.path, self.split = path, split
        self.storage_options = dict(storage_options or {})
        self.crop = crop  # data.crop: how an image is cropped to its aspect-ratio bucket (data.buckets)
        columns = list(ds.column_names)

        def missing(column: str, what: str, config_key: str) -> ConfigError:
            return ConfigError(
                f"{config_key}={column!r}: {key}={path!r} (split {split!r}) has no {what} column {column!r}; "
                f"its columns are {columns}; set {config_key} to one of them"
            )

        if image_column not in columns:
            raise missing(image_column, "image", "data.image_column")
        if label_column is not None and label_column not in columns:
            raise missing(label_column, "label", "data.label_column")
        if caption_column is not None and caption_column not in columns:
            if caption_required:
                raise missing(caption_column, "caption", "data.caption_column")
            caption_column = None  # the default name and no such column: no captions, as a folder without any
        if caption_column is not None and not _holds_text(ds.features[caption_column], datasets):
            dtype = ds.features[caption_column].dtype
            if caption_required:
                raise ConfigError(
                    f"data.caption_column={caption_column!r}: {key}={path!r} (split {split!r}) holds {dtype} "
                    f"there, not text; set data.caption_column to a string column of {columns}"
                )
            log.warning("%s: column %r holds %s, not captions; read without captions", path, caption_column, dtype)
            caption_column = None  # the default name, holding something else
        self.image_column, self.caption_column = image_column, caption_column
        keep = [c for c in dict.fromkeys((image_column, caption_column, label_column)) if c is not None]
        ds = ds.select_columns(keep)
        if isinstance(ds.features[image_column], datasets.Image):
            ds = ds.cast_column(image_column, datasets.Image(decode=False))
        self.labels, self.num_classes = self._read_labels(ds, label_column, datasets)
        if label_column is not None:
            ds = ds.remove_columns([label_column]) if label_column not in (image_column, caption_column) else ds
        self.rows = ds.with_format(None)
        self.image_size = image_size
        self.channels = channels
        self._skips: dict[int, str] = {}  # row -> why it was skipped (this process)
        if check_readable:
            self._check_readable(key)
        log.info(
            "%s (split %r): %d rows, image column %r, captions %s, labels %s",
            path,
            split,
            len(self.rows),
            image_column,
            repr(caption_column) if caption_column else "none",
            f"{label_column!r} ({self.num_classes} classes)" if label_column else "none",
        )

    def _check_readable(self, key: str) -> None:
        """Refuse (exit 2) a split none of whose images can be read: up to `PROBE_ROWS` rows spread evenly
        over it are decoded until one reads. Without this an all-broken dataset (images of another column,
        truncated bytes, paths that do not exist here) trained on zero-weight slots and, in a short run
        (fewer skips than `data.max_skipped_fraction` waits for), exited 0."""
        n = len(self.rows)
        if n == 0:
            return
        rows = sorted({round(i * (n - 1) / max(PROBE_ROWS - 1, 1)) for i in range(min(n, PROBE_ROWS))})
        reasons = []
        for index in rows:
            cell = self.rows[index][self.image_column]
            if cell is None:
                reasons.append(f"row {index}: {self.image_column} is null")
                continue
            try:
                with self._open_image(cell) as im:
                    image_to_tensor(im, self.image_size, self.channels)
                return
            except (*_READ_ERRORS, UnidentifiedImageError, Image.DecompressionBombError) as e:
                reasons.append(f"row {index}: {short_reason(str(e))}")
        every = "every one" if len(rows) == n else f"{len(rows)} rows spread over its {n}"
        raise ConfigError(
            f"{key}={self.path!r} (split {self.split!r}): no image in column {self.image_column!r} can be read "
            f"({every} tried; {'; '.join(reasons[:3])}), so the run would train on nothing; fix the images or "
            "set data.image_column to the column that holds them (data.max_skipped_fraction=1 skips this check)"
        )

    def _read_labels(self, ds, column: str | None, datasets) -> tuple[list[int] | None, int | None]:
        """Each row's class (-1: none) and the number of classes: a ClassLabel's own, the largest integer
        + 1, or the sorted distinct strings (like the folder's sorted subfolder names)."""
        if column is None:
            return None, None
        values = ds.with_format("arrow")[column].to_pylist()
        feature = ds.features[column]
        if isinstance(feature, datasets.ClassLabel):
            return [-1 if v is None or v < 0 else int(v) for v in values], feature.num_classes
        present = [v for v in values if v is not None]
        if all(isinstance(v, str) for v in present):
            index = {name: i for i, name in enumerate(sorted(set(present)))}
            return [index[v] if v is not None else -1 for v in values], len(index) or None
        if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
            labels = [-1 if v is None or v < 0 else v for v in values]
            return labels, (max(labels) + 1) if any(v >= 0 for v in labels) else None
        raise ConfigError(
            f"data.label_column={column!r}: the column holds {feature}, not class labels; use a ClassLabel, "
            "integer or string column, or set data.label_column=null"
        )

    def __len__(self) -> int:
        return len(self.rows)

    def skip_reason(self, index: int) -> str:
        """Why row `index` was skipped in this process: "row N of PATH (reason)"."""
        return f"row {index} of {self.path} ({self._skips.get(index, 'unreadable')})"

    def _skip(self, index: int, what: str, why: str) -> None:
        """Remember why row `index` is skipped and log it, once per process."""
        if index not in self._skips:
            self._skips[index] = f"{what}: {short_reason(why)}"
            log.warning("skipping row %d of %s, %s (pid %d): %s", index, self.path, what, os.getpid(), why)

    def _open_image(self, cell: Any) -> Image.Image:
        """The PIL image of an image cell; ValueError naming the defect for a cell that is none."""
        if isinstance(cell, Mapping):  # datasets.Image(decode=False): {"bytes": ..., "path": ...}
            if cell.get("bytes") is not None:
                cell = cell["bytes"]
            elif cell.get("path") is not None:
                cell = cell["path"]
            else:
                raise ValueError("an image cell with neither bytes nor a path")
        if isinstance(cell, Image.Image):
            return cell
        if isinstance(cell, (bytes, bytearray, memoryview)):
            return Image.open(io.BytesIO(bytes(cell)))
        if isinstance(cell, str) and cell:
            if "://" in cell:
                with fsspec.open(cell, "rb") as f:
                    return Image.open(io.BytesIO(f.read()))
            return Image.open(cell)
        raise ValueError(f"{type(cell).__name__} is not an image (bytes, a path or a datasets Image)")

    def load(
        self, index: int, aug_seed: int, flip: bool, size: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, int] | tuple | None:
        """Row `index`'s image (at its (height, width) aspect-ratio bucket `size`, resized to cover it and
        cropped by `self.crop`, with its size micro-conditions in the extras; None: the data.image_size
        square), label and caption; None when unusable."""
        row = self.rows[index]
        cell = row[self.image_column]
        if cell is None:
            self._skip(index, "no image", f"{self.image_column} is null")
            return None
        flipped = bool(flip and aug_seed & 1)
        extras: dict = {}
        try:
            with self._open_image(cell) as im:
                if size is None:
                    x = image_to_tensor(im, self.image_size, self.channels)
                    x = x.flip(-1) if flipped else x
                else:
                    x, extras[SIZE_CONDITIONS] = load_in_bucket(im, size, self.channels, self.crop, aug_seed, flipped)
        except (*_READ_ERRORS, UnidentifiedImageError, Image.DecompressionBombError) as e:
            self._skip(index, "unreadable image", str(e))
            return None
        label = self.labels[index] if self.labels is not None else -1
        caption = row[self.caption_column] if self.caption_column is not None else None
        if caption is not None and not isinstance(caption, str):
            self._skip(index, "unusable caption", f"{self.caption_column} is a {type(caption).__name__}, not a string")
            return None
        if caption is not None:
            extras["caption"] = caption.strip()
        return (x.contiguous(), label, extras) if extras else (x.contiguous(), label)
