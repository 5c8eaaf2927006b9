"""Image datasets: the built-in UCI digits and a recursive image folder; no torchvision."""

from __future__ import annotations

import logging
import os
from importlib import resources
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

from trainer.data.sampler import SampleRef, SampleStream

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")


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


def scan_folder(root: str, extensions: tuple[str, ...]) -> tuple[list[Path], dict[str, int], list[int]]:
    """Files with `extensions` below `root` (recursive, sorted), the class index of the first-level
    subfolder names (sorted, like torchvision's ImageFolder) and each file's label (-1 at the top level)."""
    base = Path(root)
    if not base.is_dir():
        raise FileNotFoundError(f"data.path {root!r} is not a folder")
    files = sorted(p for p in base.rglob("*") if p.is_file() and p.suffix.lower() in extensions)
    if not files:
        raise FileNotFoundError(f"data.path {root!r} holds no {'/'.join(extensions)} files")
    parts = [p.relative_to(base).parts for p in files]
    classes = sorted({ps[0] for ps in parts if len(ps) > 1})
    class_index = {c: i for i, c in enumerate(classes)}
    return files, class_index, [class_index[ps[0]] if len(ps) > 1 else -1 for ps in parts]


class ImageFolderDataset:
    """Every png/jpg/jpeg/webp below `root` (recursive), resized on the short side and center-cropped.

    Labels come from the first-level subfolder names when there are any
    (sorted, like torchvision's ImageFolder), else -1. A `.txt` beside an
    image (same stem) is its caption; a `.npy` beside it is its image
    embedding (`image_embed`, a 1-D float vector). Files that cannot be
    decoded are skipped at load time: the batch is one sample short, the skip
    is counted by the loop and each bad file is logged once per process.
    """

    def __init__(self, root: str, image_size: int, channels: int = 3):
        self.files, self.class_index, self.labels = scan_folder(root, IMAGE_EXTENSIONS)
        self.num_classes = len(self.class_index) or None
        self.image_size = image_size
        self.channels = channels
        self._reported: set[str] = set()

    def __len__(self) -> int:
        return len(self.files)

    def load(self, index: int, aug_seed: int, flip: bool) -> tuple[torch.Tensor, int] | None:
        path = self.files[index]
        try:
            with Image.open(path) as im:
                x = image_to_tensor(im, self.image_size, self.channels)
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError) as e:
            if str(path) not in self._reported:
                self._reported.add(str(path))
                log.warning("skipping unreadable image %s (pid %d): %s", path, os.getpid(), e)
            return None
        if flip and aug_seed & 1:
            x = x.flip(-1)
        extras = self._extras(path)
        if extras is None:
            return None
        return (x.contiguous(), self.labels[index], extras) if extras else (x.contiguous(), self.labels[index])

    def _extras(self, path: Path) -> dict | None:
        """Caption from `<stem>.txt`, image embedding from `<stem>.npy`, when they exist."""
        extras: dict = {}
        txt, npy = path.with_suffix(".txt"), path.with_suffix(".npy")
        try:
            if txt.is_file():
                extras["caption"] = txt.read_text(encoding="utf-8").strip()
            if npy.is_file():
                embed = np.load(npy, allow_pickle=False)
                extras["image_embed"] = torch.from_numpy(np.asarray(embed, dtype=np.float32).reshape(-1))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            if str(path) not in self._reported:
                self._reported.add(str(path))
                log.warning("skipping %s: unreadable caption or embedding beside it (pid %d): %s", path, os.getpid(), e)
            return None
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
        `"caption"` a str, anything else an array/tensor of a fixed shape (e.g. `"image_embed"`)."""
        index = int(self.indices[ref.index])
        item = self.dataset.load(index, ref.aug_seed, self.flip)
        if item is None:
            return torch.zeros(self.image_shape), -1, index, ref.position, False, missing_extras(self.image_shape)
        image, label, *rest = item
        return image, label, index, ref.position, True, (rest[0] if rest else {})


def missing_extras(shape: tuple[int, ...]) -> dict:
    """Extras of an unreadable sample: a clip slot has 0 real frames, so `extras["frames"]` always exists."""
    return {"frames": torch.tensor(0, dtype=torch.int64)} if len(shape) == 4 else {}


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
    loss gives those slots zero weight and the loop counts them as skipped.
    """
    valid = torch.tensor([it[4] for it in items], dtype=torch.bool)
    out = {
        "images": _stack([it[0] for it in items]),
        "labels": torch.tensor([it[1] for it in items], dtype=torch.int64),
        "indices": torch.tensor([it[2] for it in items], dtype=torch.int64),
        "positions": [it[3] for it in items],
        "valid": valid,
        "skipped": int((~valid).sum()),
    }
    extras = [it[5] if len(it) > 5 else {} for it in items]
    keys = sorted({k for e in extras for k in e})
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
    stats = getattr(items, "stats", None)
    if stats is not None:  # a shard source: what this step's reads cost, and shards that failed
        out["io"] = {
            "data_bytes": stats.data_bytes,
            "index_bytes": stats.index_bytes,
            "used_bytes": stats.used_bytes,
            "requests": stats.requests,
            "failed_shards": list(stats.failed_shards),
        }
    return out
