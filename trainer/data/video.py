"""Video datasets: synthetic Moving Digits and (PyAV) folders of clips. Samples are (T, C, H, W) in [-1, 1]."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from trainer.data.datasets import DIGIT_WORDS, load_digits_arrays

DIRECTIONS = ("left", "right", "up", "down")
VIDEO_EXTENSIONS = (".gif", ".mp4", ".webm", ".mkv", ".mov")

# Fixes the across-the-motion offset of every Moving Digits sample; never the training seed.
_MOVING_SEED = 20250113


def frames_extra(n: int) -> torch.Tensor:
    """`extras["frames"]`: how many leading frames of a sample are real (the rest are zeros)."""
    return torch.tensor(n, dtype=torch.int64)


def moving_caption(digit: int, direction: int) -> str:
    word = DIGIT_WORDS[digit]
    return f"{'an' if word == 'eight' else 'a'} {word} moving {DIRECTIONS[direction]}"


class MovingDigitsDataset:
    """Moving Digits: one UCI digit (upsampled to half the canvas) crossing the canvas in one direction.

    Sample `i` is digit `i // 4` moving `DIRECTIONS[i % 4]`: it starts touching one
    edge and reaches the opposite edge on the last frame, never leaving the
    canvas; its offset across the motion is fixed per sample. Label =
    direction * 10 + digit (40 classes), caption "a seven moving left". Frames
    are drawn at load time from the index alone, so resume is exact.
    `frame_stride` does not apply: the motion always spans the clip.
    """

    def __init__(self, image_size: int, channels: int, num_frames: int):
        images, labels = load_digits_arrays()
        self.size = image_size
        self.digit_size = d = max(4, image_size // 2)
        x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
        self.digits = F.interpolate(x, size=(d, d), mode="bilinear", align_corners=False).clamp(0, 1)[:, 0]
        self.digit_labels = labels.astype(np.int64)
        self.channels = channels
        self.num_frames = num_frames
        self.num_classes = 10 * len(DIRECTIONS)
        n = len(self.digits) * len(DIRECTIONS)
        self.offsets = np.random.default_rng(_MOVING_SEED).integers(0, image_size - d + 1, size=n)

    def __len__(self) -> int:
        return len(self.digits) * len(DIRECTIONS)

    def describe(self, index: int) -> tuple[int, int]:
        """(digit, direction) of sample `index`."""
        return int(self.digit_labels[index // len(DIRECTIONS)]), index % len(DIRECTIONS)

    def positions(self, index: int) -> list[tuple[int, int]]:
        """Top-left (y, x) of the digit in each frame."""
        _, direction = self.describe(index)
        span, t = self.size - self.digit_size, self.num_frames
        along = [round(k * span / (t - 1)) if t > 1 else 0 for k in range(t)]
        if direction in (0, 2):  # left, up: start at the far edge
            along = [span - a for a in along]
        across = int(self.offsets[index])
        return [(across, a) if direction < 2 else (a, across) for a in along]

    def load(self, index: int, aug_seed: int, flip: bool) -> tuple[torch.Tensor, int, dict]:
        digit, direction = self.describe(index)
        d = self.digit_size
        clip = torch.zeros(self.num_frames, 1, self.size, self.size)
        patch = self.digits[index // len(DIRECTIONS)]
        for k, (y, x) in enumerate(self.positions(index)):
            clip[k, 0, y : y + d, x : x + d] = patch
        clip = (clip * 2 - 1).expand(-1, self.channels, -1, -1).contiguous()
        extras = {"caption": moving_caption(digit, direction), "frames": frames_extra(self.num_frames)}
        return clip, direction * 10 + digit, extras
