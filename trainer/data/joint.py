"""Joint image+video training: images as one-frame clips in a fixed share of every global batch.

Where images go is a function of the global stream position alone, so the
single global cursor stays the whole data state. With ratio r (an exact
fraction), position q of the global stream is an image slot when
floor((q + 1) r) > floor(q r); it then takes entry floor(q r) of the image
stream, and a clip slot takes entry q - floor(q r) of the clip stream. Hence:
- step s (positions sB..sB+B-1) holds floor((s+1)Br) - floor(sBr) images,
  spread evenly over its positions (any n consecutive positions hold
  floor(nr) or ceil(nr)), so every rank gets its share;
- both streams are read in order, each an ordinary per-epoch permutation of
  its own set, so every image and every clip is used once per epoch of its
  own stream, at any world size (positions never depend on it);
- resuming at cursor c needs nothing but c.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from trainer.data.sampler import SampleRef, SampleStream
from trainer.data.video import frames_extra
from trainer.randomness import Stream, stream_seed


def image_slots_before(position: int, ratio: Fraction) -> int:
    """How many of the global stream's positions [0, position) are image slots."""
    return position * ratio.numerator // ratio.denominator


class JointStream(SampleStream):
    """Clip and image streams interleaved by position (see the module docstring).

    Entries are (epoch of the entry's own stream, index in the JointSet): clips
    keep their index, images are shifted by the number of clips.
    """

    def __init__(self, clips: SampleStream, images: SampleStream, ratio: Fraction, seed: int):
        super().__init__(clips.num_samples + images.num_samples, seed)
        self.clips = clips
        self.images = images
        self.ratio = ratio

    def take(self, cursor: int, count: int) -> list[tuple[int, int]]:
        first_image = image_slots_before(cursor, self.ratio)
        n_images = image_slots_before(cursor + count, self.ratio) - first_image
        images = iter(self.images.take(first_image, n_images))
        clips = iter(self.clips.take(cursor - first_image, count - n_images))
        out = []
        for q in range(cursor, cursor + count):
            if image_slots_before(q + 1, self.ratio) > image_slots_before(q, self.ratio):
                epoch, index = next(images)
                out.append((epoch, self.clips.num_samples + index))
            else:
                out.append(next(clips))
        return out


class JointSet:
    """The training set of joint training: a clip split (Subset or ShardSplit) plus an image Subset.

    Items are clips (T, C, H, W): an image becomes frame 0 of an otherwise zero
    clip with `extras["frames"] = 1`. Image labels are shifted past the clip
    classes (`label_offset`) and image dataset indices past the clip dataset's
    (`index_offset`), so labels and the ledger keep the two apart.
    """

    encoding = None  # clips and images, never `gentrain data encode` latents (see ShardSplit.encoding)

    def __init__(self, clips, images, ratio: float, clip_shape: tuple[int, ...], label_offset: int):
        self.clips = clips
        self.images = images
        self.ratio = Fraction(str(ratio))  # exact: the slot pattern must not depend on float rounding
        self.clip_shape = clip_shape
        self.label_offset = label_offset
        self.index_offset = len(clips.dataset)
        self.image_shape = clip_shape

    def __len__(self) -> int:
        return len(self.clips) + len(self.images)

    def make_stream(self, seed: int) -> JointStream:
        images = self.images.make_stream(stream_seed(seed, Stream.JOINT_IMAGES))
        return JointStream(self.clips.make_stream(seed), images, self.ratio, seed)

    def _as_clip(self, item: tuple) -> tuple:
        image, label, index, position, valid, extras = item
        clip = torch.zeros(self.clip_shape, dtype=image.dtype)
        clip[0] = image
        extras = {**extras, "frames": frames_extra(1 if valid else 0)}
        label = label + self.label_offset if label >= 0 else label
        return clip, label, self.index_offset + index, position, valid, extras

    def __getitem__(self, ref: SampleRef):
        return self.__getitems__([ref])[0]

    def __getitems__(self, refs: list[SampleRef]) -> list:
        n = len(self.clips)
        clip_refs = [r for r in refs if r.index < n]
        if hasattr(self.clips, "__getitems__"):  # shards: one concurrent fetch, with its byte counts
            clip_items = self.clips.__getitems__(clip_refs)
        else:
            clip_items = [self.clips[r] for r in clip_refs]
        loaded = iter(clip_items)
        items = type(clip_items)()  # a shard fetch's list type carries `stats` for the loop's I/O metrics
        for r in refs:
            if r.index < n:
                items.append(next(loaded))
            else:
                image_ref = SampleRef(index=r.index - n, position=r.position, fixed_aug_seed=r.aug_seed)
                items.append(self._as_clip(self.images[image_ref]))
        if hasattr(clip_items, "stats"):
            items.stats = clip_items.stats
        return items
