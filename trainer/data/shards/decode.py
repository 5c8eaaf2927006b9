"""A sample's members (by extension) into what the loader yields: the image or clip, the label, the extras."""

from __future__ import annotations

import io

import torch
from PIL import Image

from trainer.data.buckets import SIZE_CONDITIONS, load_in_bucket
from trainer.data.datasets import IMAGE_EXTENSIONS, image_to_tensor, read_embedding
from trainer.data.video import VIDEO_EXTENSIONS, decode_clip, frames_extra

_IMAGE_EXTS = tuple(e.lstrip(".") for e in IMAGE_EXTENSIONS)
_VIDEO_EXTS = tuple(e.lstrip(".") for e in VIDEO_EXTENSIONS)
# npy member names -> extras keys (the DALL·E 2 decoder's embeddings; see trainer.tasks.base.Batch).
_EMBED_NAMES = {
    "npy": "image_embed",
    "img_emb": "image_embed",
    "image_embed": "image_embed",
    "text_emb": "text_embed",
    "text_embed": "text_embed",
}


def decode_sample(
    members: dict[str, bytes],
    image_size: int,
    channels: int,
    flip: bool,
    aug_seed: int,
    num_frames: int = 1,
    frame_stride: int = 1,
    size: tuple[int, int] | None = None,
    crop: str = "center",
):
    """(image, label, extras) from a sample's members; ValueError/OSError when it cannot be used.

    With `num_frames` > 1 the sample is a clip: its mp4/gif/webm/mkv/mov member is decoded with PyAV
    into (num_frames, C, H, W) (`extras["frames"]` = num_frames); a too-short clip is a ValueError. An image
    with a (height, width) `size` (its aspect-ratio bucket) is resized to cover it and cropped (`crop`), its
    size micro-conditions in the extras (`size_conditions`)."""
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
            if size is None:
                x = image_to_tensor(im, image_size, channels)
            else:
                x, conditions = load_in_bucket(im, size, channels, crop, aug_seed, bool(flip and aug_seed & 1))
    if flip and aug_seed & 1 and size is None:
        x = x.flip(-1)
    label = int(members["cls"].decode().strip()) if "cls" in members else -1
    extras: dict = {"frames": frames_extra(num_frames)} if num_frames > 1 else {}
    if size is not None:
        extras[SIZE_CONDITIONS] = conditions
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
