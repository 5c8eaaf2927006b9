"""Image datasets: the built-in UCI digits and a recursive image folder (local or on any fsspec store);
no torchvision."""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
from collections.abc import Mapping
from importlib import resources
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, BinaryIO, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

from trainer.data.sampler import SampleRef, SampleStream
from trainer.errors import ConfigError
from trainer.storage import filesystem

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
METADATA_NAME = "metadata.jsonl"  # Hugging Face ImageFolder's captions file (`file_name` + columns)


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 labelled 8x8 UCI optdigits (as scikit-learn ships them): uint8 0..16, labels."""
    with resources.files("trainer.data").joinpath("digits.npz").open("rb") as f:
        data = np.load(f, allow_pickle=False)
        return data["images"], data["labels"]


DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def digit_caption(label: int) -> str:
    return f"a handwritten {DIGIT_WORDS[label]}"


class DigitsDataset:
    """UCI handwritten digits, upsampled once to `image_size` (bilinear) and scaled to [-1, 1].

    Each sample carries a caption ("a handwritten seven") for text-conditioned models."""

    def __init__(self, image_size: int, channels: int = 1):
        images, labels = load_digits_arrays()
        x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
        if image_size != x.shape[-1]:
            x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
        x = x.clamp(0, 1) * 2 - 1
        self.images = x.expand(-1, channels, -1, -1).contiguous()
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self.num_classes = 10

    def __len__(self) -> int:
        return len(self.images)

    def load(self, index: int, aug_seed: int, flip: bool) -> tuple[torch.Tensor, int, dict] | None:
        img = self.images[index]
        if flip and aug_seed & 1:
            img = img.flip(-1)
        label = int(self.labels[index])
        return img, label, {"caption": digit_caption(label)}


def short_reason(why: str, path: PurePath | None = None) -> str:
    """`why` for the stop message and trainer.json: `path` (named beside it) shortened to its name, and at
    most 200 characters."""
    if path is not None:
        why = why.replace(str(path), path.name)
    return why if len(why) <= 200 else why[:197] + "..."


class FolderStore:
    """Where a folder's files live: the local disk (paths as `Path`), or any fsspec store when the folder is
    a URL (`s3://bucket/images`; paths as the store's `PurePosixPath`s, read whole with `cat_file`). One
    filesystem per process, made again after a fork or unpickling (as the shard reader's)."""

    def __init__(self, root: str, storage_options: Mapping[str, Any] | None = None):
        import fsspec

        protocol = fsspec.core.split_protocol(root)[0]
        self.remote = protocol not in (None, "file", "local")
        self.url = root
        self.options = dict(storage_options or {})
        self._fs, self._pid = None, None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fs": None, "_pid": None}

    @property
    def fs(self):
        if self._fs is None or self._pid != os.getpid():
            self._fs = filesystem(self.url, self.options)[0]
            self._pid = os.getpid()
        return self._fs

    def base(self) -> PurePath:
        if not self.remote:
            import fsspec

            return Path(fsspec.core.strip_protocol(self.url) if "://" in self.url else self.url)
        return PurePosixPath(self.fs._strip_protocol(self.url))

    def listing(self, base: PurePath) -> list[PurePath] | None:
        """Every file below `base`, sorted; None when `base` is no folder (FileNotFoundError: none at all)."""
        if not self.remote:
            assert isinstance(base, Path)
            if not base.exists():
                raise FileNotFoundError(str(base))
            return sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else None
        fs = self.fs
        if not fs.isdir(str(base)):
            if fs.isfile(str(base)):
                return None
            raise FileNotFoundError(str(base))
        return sorted(PurePosixPath(p) for p in fs.find(str(base)))

    def open(self, path: PurePath) -> BinaryIO:
        """A file's bytes: opened on the local disk, fetched whole from a store."""
        if not self.remote:
            return open(path, "rb")  # noqa: SIM115 - the caller closes it
        return io.BytesIO(self.fs.cat_file(str(path)))


# What reading a file of a store may raise besides OSError (a client's own errors): the file is then
# unreadable like a corrupt one. Local files raise OSError only.
_READ_ERRORS = (OSError, ValueError, RuntimeError)


class FolderScan(NamedTuple):
    files: list[PurePath]  # the files with the wanted extensions, sorted
    class_index: dict[str, int]  # first-level subfolder name -> class
    labels: list[int]  # each file's class, -1 at the top level
    others: frozenset[PurePath]  # every other file (sidecars such as <stem>.npy among them)


def scan_folder(
    root: str | None, extensions: tuple[str, ...], key: str = "data.path", store: FolderStore | None = None
) -> FolderScan:
    """Files with `extensions` below `root` (recursive, sorted), the class index of the first-level
    subfolder names (sorted, like torchvision's ImageFolder), each file's label (-1 at the top level) and
    the other files found (one listing serves both). `store`: where `root` is (default: the local disk).
    A `root` that holds none of them is the user's mistake: ConfigError (exit 2) naming `key`, the value
    and what is read, never a traceback."""
    wanted = f"a folder with {'/'.join(extensions)} files in it or below it"
    if not root:
        raise ConfigError(f"{key}={root!r}: empty; set it to {wanted}")
    store = store or FolderStore(root)
    try:
        base = store.base()
        listing = store.listing(base)
    except FileNotFoundError:
        raise ConfigError(f"{key}={root!r}: no such folder; set it to {wanted}") from None
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a store's client errors (credentials, network) name themselves
        raise ConfigError(
            f"{key}={root!r}: cannot list it ({type(e).__name__}: {e}); set it to {wanted} this process can read"
        ) from None
    if listing is None:
        raise ConfigError(f"{key}={root!r} is a file, not a folder; set it to {wanted} (e.g. its parent folder)")
    files = [p for p in listing if p.suffix.lower() in extensions]
    if not files:
        found = f"{len(listing)} other files, e.g. {listing[0].name!r}" if listing else "nothing"
        raise ConfigError(f"{key}={root!r} holds no {'/'.join(extensions)} files ({found}); set it to {wanted}")
    parts = [p.relative_to(base).parts for p in files]
    classes = sorted({ps[0] for ps in parts if len(ps) > 1})
    class_index = {c: i for i, c in enumerate(classes)}
    labels = [class_index[ps[0]] if len(ps) > 1 else -1 for ps in parts]
    return FolderScan(files, class_index, labels, frozenset(listing) - frozenset(files))


def read_embedding(f: BinaryIO) -> np.ndarray:
    """A .npy embedding as float32 (its shape kept); ValueError naming the defect for anything else.

    Never unpickles: the header is read first and an object dtype refused before any data is;
    strings, structured and complex arrays, empty arrays, truncated files and inf or NaN values (also
    float64 values beyond float32's range) are refused too, so a sidecar either gives finite numbers or is
    the reason its sample is skipped."""
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f".npy format {version[0]}.{version[1]} (1.0 and 2.0 are read)")
        if dtype.hasobject:
            raise ValueError("holds Python objects (pickled), which are never loaded")
        if dtype.kind not in "biuf":
            raise ValueError(f"dtype {dtype} is not a real number type")
        if 0 in shape:
            raise ValueError(f"empty array of shape {list(shape)}")
        f.seek(0)
        values = np.asarray(np.lib.format.read_array(f, allow_pickle=False), dtype=np.float32)
    except EOFError as e:
        raise ValueError(f"truncated ({e})") from None
    if not np.isfinite(values).all():  # one inf would make every weight NaN: the sample is skipped instead
        raise ValueError("holds inf or NaN values")
    return values


def read_metadata_captions(
    scan: FolderScan, root: str, column: str, key: str = "data.path", store: FolderStore | None = None
) -> tuple[dict[PurePath, str], list[PurePath]]:
    """Captions from every `metadata.jsonl` below `root` (Hugging Face ImageFolder's convention: one JSON
    object per line, `file_name` the image's path relative to the metadata file's folder, the caption in
    `column`), read once at start in sorted order, the same in every process. Returns (image -> caption,
    the metadata files read). Lines that are blank are ignored; a record without `column` (or with null
    there) gives no caption. Anything else malformed is the folder's mistake, found before training starts:
    ConfigError (exit 2) naming the metadata file, the line and the defect (bad JSON, not an object, no
    string `file_name`, a `file_name` outside the metadata file's folder or naming no image of the folder,
    an image listed twice, a caption that is not a string)."""
    store = store or FolderStore(root)
    images = frozenset(scan.files)
    captions: dict[PurePath, str] = {}
    where: dict[PurePath, str] = {}
    metas = sorted(p for p in scan.others if p.name == METADATA_NAME)
    for meta in metas:
        try:
            with store.open(meta) as f:
                lines = f.read().decode("utf-8").splitlines()
        except (*_READ_ERRORS, UnicodeDecodeError) as e:
            raise ConfigError(f"{key}={root!r}: cannot read {meta} ({e}); fix or remove it") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            at = f"{meta}, line {number}"

            def bad(why: str, at: str = at) -> ConfigError:
                return ConfigError(
                    f"{key}={root!r}: {at}: {why}; every line of a {METADATA_NAME} is a JSON object with "
                    f'"file_name" (an image path relative to its folder) and an optional string "{column}" '
                    "(data.caption_column)"
                )

            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise bad(f"not JSON ({e})") from None
            if not isinstance(record, dict):
                raise bad(f"a JSON {type(record).__name__}, not an object")
            name = record.get("file_name")
            if not isinstance(name, str) or not name:
                raise bad(f'"file_name" is {name!r}, not a non-empty string')
            rel = posixpath.normpath(name)
            if posixpath.isabs(rel) or rel == ".." or rel.startswith("../"):
                raise bad(f'"file_name" {name!r} is outside the folder of {meta.name}')
            image = meta.parent.joinpath(*rel.split("/"))
            if image not in images:
                what = "a file of another type" if image in scan.others else "no file"
                raise bad(f'"file_name" {name!r} names {what}, not a {"/".join(IMAGE_EXTENSIONS)} image of the folder')
            if image in where:
                raise bad(f'"file_name" {name!r}: that image is already listed at {where[image]}')
            where[image] = at
            caption = record.get(column)
            if caption is None:
                continue
            if not isinstance(caption, str):
                raise bad(f'"{column}" is a JSON {type(caption).__name__} ({caption!r}), not a string')
            captions[image] = caption.strip()
    return captions, metas


class ImageFolderDataset:
    """Every png/jpg/jpeg/webp below `root` (recursive), resized on the short side and center-cropped.

    Labels come from the first-level subfolder names when there are any
    (sorted, like torchvision's ImageFolder), else -1. A `.txt` beside an
    image (same stem) is its caption; so is its `caption_column` in a
    `metadata.jsonl` at the root or in any subfolder (Hugging Face
    ImageFolder's convention, `read_metadata_captions`; read at start, a
    malformed line exits 2), where a `.txt` of the same image wins. A `.npy` beside it is its image
    embedding (`image_embed`, a 1-D float vector). Every embedding must have
    as many values as the first well-formed sidecar in file order (one
    header read at start-up, the same in every process, so the choice never
    depends on which sample a worker loads first). Files that cannot be used
    (an undecodable image, an unreadable caption, a sidecar that is
    truncated, pickled, not numeric or of another length) are skipped at load
    time: the slot stays zeros with valid=False, the loop counts it against
    `data.max_skipped_fraction` and each bad file is logged once per process.
    """

    def __init__(
        self,
        root: str,
        image_size: int,
        channels: int = 3,
        key: str = "data.path",
        caption_column: str = "text",
        storage_options: Mapping[str, Any] | None = None,
        crop: str = "center",
        sizes: bool = False,
    ):
        self.store = FolderStore(root, storage_options)  # `root` may be a URL on any fsspec store
        self.crop = crop  # "center" or "random" (data.crop; the offset from the sample's augmentation seed)
        # Each sample's original size, crop offset and target size in its extras (trainer.data.buckets.
        # size_conditions): SDXL's and PixArt's micro-conditions. Off for direct users of the class.
        self.sizes = sizes
        scan = scan_folder(root, IMAGE_EXTENSIONS, key, self.store)
        self.files, self.class_index, self.labels = scan.files, scan.class_index, scan.labels
        self.num_classes = len(self.class_index) or None
        self.image_size = image_size
        self.channels = channels
        self.has_npy = [p.with_suffix(".npy") in scan.others for p in self.files]
        self.has_txt = [p.with_suffix(".txt") in scan.others for p in self.files]
        captions, metas = read_metadata_captions(scan, root, caption_column, key, self.store)
        # Per file: its metadata caption (None: none there). A .txt sidecar of the same image wins.
        self.meta_captions = [captions.get(p) for p in self.files]
        both = sum(1 for c, t in zip(self.meta_captions, self.has_txt, strict=True) if c is not None and t)
        if metas:
            log.info(
                "%s: %d captions (column %r) from %d %s file(s)%s",
                root,
                len(captions),
                caption_column,
                len(metas),
                METADATA_NAME,
                f"; {both} image(s) also have a .txt caption, which is used instead" if both else "",
            )
        self.embed_size, self.embed_source = self._first_embedding_size()
        self._skips: dict[str, str] = {}  # path -> why it was skipped (this process)

    def __len__(self) -> int:
        return len(self.files)

    def _first_embedding_size(self) -> tuple[int | None, str | None]:
        """(values, file name) of the first well-formed .npy sidecar in file order, else (None, None)."""
        for path, has in zip(self.files, self.has_npy, strict=True):
            if has:
                npy = path.with_suffix(".npy")
                try:
                    with self.store.open(npy) as f:
                        return read_embedding(f).size, npy.name
                except _READ_ERRORS:
                    continue  # skipped (and reported) when its own sample is loaded
        return None, None

    def skip_reason(self, index: int) -> str:
        """Why sample `index` was skipped in this process: "path (reason)"."""
        path = str(self.files[index])
        return f"{path} ({self._skips.get(path, 'unreadable')})"

    def _skip(self, path: PurePath, what: str, why: str) -> None:
        """Remember why `path` is skipped and log it, once per process."""
        if str(path) not in self._skips:
            self._skips[str(path)] = f"{what}: {short_reason(why, path)}"
            log.warning("skipping %s %s (pid %d): %s", what, path, os.getpid(), why)

    def load(
        self, index: int, aug_seed: int, flip: bool, size: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, int] | None:
        """The image at (height, width) `size` (default: the data.image_size square), resized to cover it and
        cropped (`self.crop`), its label and extras; None when it cannot be used."""
        # here: buckets.py imports this module
        from trainer.data.buckets import SIZE_CONDITIONS, cover_crop, cover_size, size_conditions, to_tensor

        path = self.files[index]
        height, width = size or (self.image_size, self.image_size)
        try:
            with Image.open(path if not self.store.remote else self.store.open(path)) as im:
                original = (im.size[1], im.size[0])
                if size is None and self.crop == "center":
                    x = image_to_tensor(im, self.image_size, self.channels)
                    resized = cover_size(*original, height, width)
                    top, left = (resized[0] - height) // 2, (resized[1] - width) // 2
                else:
                    im = im.convert("L" if self.channels == 1 else "RGB")
                    cropped, top, left = cover_crop(im, height, width, self.crop, aug_seed)
                    x = to_tensor(cropped, self.channels)
        except (*_READ_ERRORS, UnidentifiedImageError, Image.DecompressionBombError) as e:
            self._skip(path, "unreadable image", str(e))
            return None
        flipped = bool(flip and aug_seed & 1)
        if flipped:
            x = x.flip(-1)
        extras = self._extras(index)
        if extras is None:
            return None
        if self.sizes:
            resized_width = cover_size(*original, height, width)[1]
            extras[SIZE_CONDITIONS] = size_conditions(original, top, left, (height, width), resized_width, flipped)
        return (x.contiguous(), self.labels[index], extras) if extras else (x.contiguous(), self.labels[index])

    def _extras(self, index: int) -> dict | None:
        """Caption from `<stem>.txt` (else from metadata.jsonl), image embedding from `<stem>.npy`, when they
        exist; None: unusable."""
        path = self.files[index]
        extras: dict = {}
        if self.has_txt[index]:
            txt = path.with_suffix(".txt")
            try:
                with self.store.open(txt) as f:
                    # newlines as text mode reads them (Path.read_text): \r\n and \r become \n
                    text = f.read().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
                extras["caption"] = text.strip()
            except (*_READ_ERRORS, UnicodeDecodeError) as e:
                self._skip(path, "image with an unreadable caption", f"{txt.name}: {e}")
                return None
        elif self.meta_captions[index] is not None:
            extras["caption"] = self.meta_captions[index]
        if self.has_npy[index]:
            npy = path.with_suffix(".npy")
            try:
                with self.store.open(npy) as f:
                    embed = read_embedding(f).reshape(-1)
            except _READ_ERRORS as e:
                self._skip(path, "image with an unusable embedding", f"{npy.name}: {e}")
                return None
            if embed.size != self.embed_size:
                self._skip(
                    path,
                    "image with an unusable embedding",
                    f"{npy.name} has {embed.size} values, but the first sidecar ({self.embed_source}) has "
                    f"{self.embed_size}; every embedding needs the same length",
                )
                return None
            extras["image_embed"] = torch.from_numpy(embed)
        return extras


def image_to_tensor(im: Image.Image, size: int, channels: int) -> torch.Tensor:
    """(C, size, size) float in [-1, 1]: short side resized to `size`, center-cropped."""
    im = resize_center_crop(im.convert("L" if channels == 1 else "RGB"), size)
    arr = np.asarray(im, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).reshape(size, size, channels).permute(2, 0, 1).contiguous()


def resize_center_crop(im: Image.Image, size: int) -> Image.Image:
    w, h = im.size
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    im = im.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - size) // 2, (nh - size) // 2
    return im.crop((left, top, left + size, top + size))


class Subset:
    """Training or validation part of a dataset, mapping local to dataset indices."""

    encoding = None  # images, never `gentrain data encode` latents (a ShardSplit's `encoding` may be set)

    def __init__(self, dataset, indices: np.ndarray, flip: bool, image_shape: tuple[int, ...]):
        # image_shape: (C, H, W), or (T, C, H, W) for clips; an unreadable sample's slot is zeros of it.
        self.dataset = dataset
        self.indices = indices
        self.flip = flip
        self.image_shape = image_shape

    def __len__(self) -> int:
        return len(self.indices)

    def make_stream(self, seed: int) -> SampleStream:
        return SampleStream(len(self), seed)

    def __getitem__(self, ref: SampleRef):
        """(image, label, dataset index, position, valid, extras). A source's `load` returns
        (image, label) or (image, label, extras): extras maps a field name to a per-sample value,
        `"caption"` a str, anything else an array/tensor of a fixed shape (e.g. `"image_embed"`).
        It returns None for a sample it cannot use, and says why through `skip_reason(index)`."""
        index = int(self.indices[ref.index])
        item = self.dataset.load(index, ref.aug_seed, self.flip)
        if item is None:
            reason = self.dataset.skip_reason(index) if hasattr(self.dataset, "skip_reason") else f"sample {index}"
            return skipped_item(self.image_shape, index, ref.position, reason)
        image, label, *rest = item
        return image, label, index, ref.position, True, (rest[0] if rest else {})


SKIP_REASON = "skip_reason"  # the extras key of a skipped slot: "file (why)", gathered by `collate`


def missing_extras(shape: tuple[int, ...], reason: str | None = None) -> dict:
    """Extras of an unreadable sample: a clip slot has 0 real frames, so `extras["frames"]` always exists;
    `reason` ("file (why)") travels to the loop, which names the first bad files when it stops a run."""
    extras: dict = {"frames": torch.tensor(0, dtype=torch.int64)} if len(shape) == 4 else {}
    if reason is not None:
        extras[SKIP_REASON] = reason
    return extras


def skipped_item(shape: tuple[int, ...], index: int, position: int, reason: str) -> tuple:
    """The slot of a sample that cannot be used: zeros, label -1, valid=False."""
    return torch.zeros(shape), -1, index, position, False, missing_extras(shape, reason)


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack; in a DataLoader worker straight into shared memory (as torch's default_collate does),
    else the batch is copied once more into shared memory when it is sent to the training process."""
    if torch.utils.data.get_worker_info() is None:
        return torch.stack(tensors)
    first = tensors[0]
    storage = first._typed_storage()._new_shared(sum(t.numel() for t in tensors), device=first.device)
    out = first.new(storage).resize_(len(tensors), *first.shape)
    return torch.stack(tensors, out=out)


def collate(items: list) -> dict:
    """Stack a step's samples (images or clips). Unreadable ones stay as zeros with valid=0.

    Keeping their slots (instead of dropping them) keeps every chunk non-empty
    and the same size on every rank, so DDP's collectives never disagree; the
    loss gives those slots zero weight and the loop counts them as skipped
    (`skipped`, with each one's "file (why)" in `skipped_files`). A sample
    whose extras cannot be stacked with the batch's (an embedding of another
    length) becomes such a slot too, so one bad sidecar never stops a run.
    """
    stats = getattr(items, "stats", None)
    items = _fit_extras(list(items))
    valid = torch.tensor([it[4] for it in items], dtype=torch.bool)
    extras = [it[5] if len(it) > 5 else {} for it in items]
    out = {
        "images": _stack([it[0] for it in items]),
        "labels": torch.tensor([it[1] for it in items], dtype=torch.int64),
        "indices": torch.tensor([it[2] for it in items], dtype=torch.int64),
        "positions": [it[3] for it in items],
        "valid": valid,
        "skipped": int((~valid).sum()),
        "skipped_files": [
            str(e.get(SKIP_REASON, f"sample {it[2]}")) for it, e in zip(items, extras, strict=True) if not it[4]
        ],
    }
    keys = sorted({k for e in extras for k in e} - {SKIP_REASON})
    if "caption" in keys:
        # Unreadable samples and samples without a caption get "" (the unconditional prompt).
        out["captions"] = [str(e.get("caption", "")) for e in extras]
    tensors = {}
    for k in (k for k in keys if k != "caption"):
        present = [torch.as_tensor(e[k]) for e in extras if k in e]
        like = torch.zeros_like(present[0])
        tensors[k] = torch.stack([torch.as_tensor(e[k]) if k in e else like for e in extras])
    if tensors:
        out["extras"] = tensors
    if stats is not None:  # a shard source: what this step's reads cost, and shards that failed
        out["io"] = {
            "data_bytes": stats.data_bytes,
            "index_bytes": stats.index_bytes,
            "used_bytes": stats.used_bytes,
            "requests": stats.requests,
            "failed_shards": list(stats.failed_shards),
        }
    return out


def _fit_extras(items: list) -> list:
    """Items whose extra tensors have another shape than most of the batch's valid items (the first
    seen on a tie) become skipped slots, so `torch.stack` below cannot fail. Sources check their own
    files first (the image folder against its first sidecar); this covers every source."""
    extras = [it[5] if len(it) > 5 and it[4] else {} for it in items]
    for key in sorted({k for e in extras for k in e if k not in ("caption", SKIP_REASON)}):
        shapes = [tuple(torch.as_tensor(e[key]).shape) if key in e else None for e in extras]
        seen = [s for s in shapes if s is not None]
        if len(set(seen)) < 2:
            continue
        common = max(dict.fromkeys(seen), key=seen.count)  # dict keeps first-seen order: ties go to the first
        for i, shape in enumerate(shapes):
            if shape is not None and shape != common:
                image, _, index, position, *_ = items[i]
                why = f"{key} of shape {list(shape)} where the batch's others are {list(common)}"
                items[i] = skipped_item(tuple(image.shape), index, position, f"sample {index} ({why})")
                extras[i] = {}
    return items
