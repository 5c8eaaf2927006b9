"""Image grids and PNG output with PIL and numpy (no torchvision)."""

from __future__ import annotations

import io
import math
import os
import re

import numpy as np
import torch
from PIL import Image


def make_grid(images: torch.Tensor, nrow: int | None = None, padding: int = 1, upscale: int = 1) -> np.ndarray:
    """(N, C, H, W) floats in [0, 1] -> an (H', W', C) uint8 grid, `nrow` images per row."""
    n, c, h, w = images.shape
    nrow = nrow or math.ceil(math.sqrt(n))
    ncol = math.ceil(n / nrow)
    x = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    if upscale > 1:
        x = x.repeat_interleave(upscale, dim=2).repeat_interleave(upscale, dim=3)
        h, w = h * upscale, w * upscale
    grid = np.zeros((ncol * (h + padding) + padding, nrow * (w + padding) + padding, c), dtype=np.uint8)
    for i in range(n):
        r, col = divmod(i, nrow)
        top, left = padding + r * (h + padding), padding + col * (w + padding)
        grid[top : top + h, left : left + w] = x[i].permute(1, 2, 0).numpy()
    return grid


def grid_png_bytes(images: torch.Tensor, nrow: int | None = None, upscale: int | None = None) -> bytes:
    # Tiny images (8-32 px) are unreadable at 1:1; scale them up with nearest neighbour.
    if upscale is None:
        upscale = max(1, 64 // min(images.shape[-2:]))
    grid = make_grid(images, nrow=nrow, upscale=upscale)
    im = Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def save_grid(images: torch.Tensor, path: str, nrow: int | None = None) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(grid_png_bytes(images, nrow))
    return path


def contact_sheet(videos: torch.Tensor) -> torch.Tensor:
    """(N, T, C, H, W) videos -> (N*T, C, H, W) frames, one video per row of the grid."""
    n, t = videos.shape[:2]
    return videos.reshape(n * t, *videos.shape[2:])


def save_gif(videos: torch.Tensor, path: str, fps: int = 8, nrow: int | None = None) -> str:
    """(N, T, C, H, W) in [0, 1] -> an animated GIF: frame t shows frame t of every video in a grid of `nrow`
    videos per row (default: about square)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    upscale = max(1, 64 // videos.shape[-1])
    frames = []
    for t in range(videos.shape[1]):
        grid = make_grid(videos[:, t], nrow=nrow, upscale=upscale)
        frames.append(Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid))
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    return path


def slugify(text: str, max_length: int = 80) -> str:
    """A file name for a caption: "A seven, moving left!" -> "a-seven-moving-left"."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:max_length].rstrip("-")
    return slug or "untitled"


def save_media(media: torch.Tensor, stem: str, nrow: int | None = None) -> list[str]:
    """Images (N, C, H, W) -> `stem.png`; videos (N, T, C, H, W) -> `stem.gif` + contact sheet `stem.png`.
    `nrow`: images (the GIF's videos) per row; default about square."""
    if media.ndim == 4:
        return [save_grid(media, f"{stem}.png", nrow=nrow)]
    if media.ndim == 5:
        sheet = save_grid(contact_sheet(media), f"{stem}.png", nrow=media.shape[1])
        return [save_gif(media, f"{stem}.gif", nrow=nrow), sheet]
    raise ValueError(f"a preview must be (N, C, H, W) images or (N, T, C, H, W) videos, got shape {tuple(media.shape)}")
