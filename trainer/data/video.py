"""Video datasets: synthetic Moving Digits and (PyAV) folders of clips. Samples are (T, C, H, W) in [-1, 1]."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from trainer.data.datasets import DIGIT_WORDS, image_to_tensor, load_digits_arrays, scan_folder, short_reason
from trainer.errors import ConfigError

log = logging.getLogger(__name__)

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
    canvas. Its path runs along the canvas centre line, or up to `path_jitter`
    px off it (None: anywhere the digit fits), fixed per sample. With the
    default 0 a clip is a function of (digit image, direction) alone: the
    demo's masked transformer then learns the digit, not where it happens to
    be. Label = direction * 10 + digit (40 classes), caption "a seven moving
    left". Frames are drawn at load time from the index alone, so resume is
    exact. `frame_stride` does not apply: the motion always spans the clip.
    """

    def __init__(self, image_size: int, channels: int, num_frames: int, path_jitter: int | None = 0):
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
        rng = np.random.default_rng(_MOVING_SEED)
        if path_jitter is None:  # anywhere the digit fits
            self.offsets = rng.integers(0, image_size - d + 1, size=n)
        else:  # within path_jitter px of the centre line
            centre = (image_size - d) // 2
            self.offsets = (centre + rng.integers(-path_jitter, path_jitter + 1, size=n)).clip(0, image_size - d)

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


def import_av(needed_by: str):
    """PyAV (the `video` extra), imported when clips are decoded; a ConfigError (exit 2) naming the extra
    and `needed_by` (what in the config or command decodes clips) when it is not installed."""
    try:
        import av
    except ImportError as e:
        raise ConfigError(
            f"{needed_by} decodes video clips with PyAV, which is not installed ({e}): pip install 'gentrain[video]'"
        ) from None
    return av


class ClipError(ValueError):
    """A clip that cannot be used: undecodable, no video stream, or fewer frames than asked for."""


def decode_clip(source, image_size: int, channels: int, num_frames: int, stride: int) -> torch.Tensor:
    """(num_frames, C, size, size) in [-1, 1]: frames 0, stride, 2*stride, ... of the first video stream,
    each resized on the short side and center-cropped (all frames of a clip share a size, so the same crop).

    `source` is a path or a binary file object. Decoding stops at the last frame needed; the container
    is always closed. Raises ClipError when the clip is unreadable or too short.
    """
    av = import_av("decoding a clip")

    need = (num_frames - 1) * stride + 1
    frames: list[torch.Tensor] = []
    seen = 0
    try:
        with av.open(source, mode="r") as container:
            if not container.streams.video:
                raise ClipError("no video stream")
            for frame in container.decode(video=0):
                if seen % stride == 0:
                    frames.append(image_to_tensor(frame.to_image(), image_size, channels))
                    if len(frames) == num_frames:
                        break
                seen += 1
    except av.FFmpegError as e:
        raise ClipError(f"cannot decode ({e})") from None
    except (OSError, EOFError) as e:
        raise ClipError(f"cannot read ({e})") from None
    if len(frames) < num_frames:
        raise ClipError(
            f"too short: {seen} frames decoded, data.num_frames={num_frames} x data.frame_stride={stride} needs {need}"
        )
    return torch.stack(frames)


class VideoFolderDataset:
    """Every gif/mp4/webm/mkv/mov below `root` (recursive), decoded with PyAV (FFmpeg in its wheels).

    A sample is the clip's first `num_frames` frames at `frame_stride`, each resized on the short side
    and center-cropped. Labels come from first-level subfolder names (like the image folder), the
    caption from `<stem>.txt` beside a clip. Broken or too-short clips are skipped at load time (None):
    the slot stays zeros with valid=False, the loop counts it, each bad file is logged once per process.
    """

    def __init__(self, root: str, image_size: int, channels: int, num_frames: int, frame_stride: int):
        import_av("data.source=video")  # at start (exit 2), not in the loader's workers
        scan = scan_folder(root, VIDEO_EXTENSIONS, "data.path")
        self.files, self.class_index, self.labels = scan.files, scan.class_index, scan.labels
        self.num_classes = len(self.class_index) or None
        self.image_size = image_size
        self.channels = channels
        self.num_frames = num_frames
        self.frame_stride = frame_stride
        self._skips: dict[str, str] = {}  # path -> why it was skipped (this process)

    def __len__(self) -> int:
        return len(self.files)

    def skip_reason(self, index: int) -> str:
        """Why sample `index` was skipped in this process: "path (reason)"."""
        path = str(self.files[index])
        return f"{path} ({self._skips.get(path, 'unreadable clip')})"

    def _skip(self, path: Path, why: str) -> None:
        if str(path) not in self._skips:
            self._skips[str(path)] = short_reason(why, path)
            log.warning("skipping clip %s (pid %d): %s", path, os.getpid(), why)

    def load(self, index: int, aug_seed: int, flip: bool) -> tuple[torch.Tensor, int, dict] | None:
        path = self.files[index]
        try:
            clip = decode_clip(str(path), self.image_size, self.channels, self.num_frames, self.frame_stride)
        except ClipError as e:
            self._skip(path, str(e))
            return None
        if flip and aug_seed & 1:
            clip = clip.flip(-1)
        extras: dict = {"frames": frames_extra(self.num_frames)}
        txt = path.with_suffix(".txt")
        try:
            if txt.is_file():
                extras["caption"] = txt.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            self._skip(path, f"unreadable caption {txt.name}: {e}")
            return None
        return clip.contiguous(), self.labels[index], extras
