"""DreamBooth data (issue 50, deliver 5): the instance images with their prompt and, for prior preservation, the
class images with theirs, in every step's batch.

diffusers' train_dreambooth*.py concatenates, in each batch, `train_batch_size` instance images and as many class
images, and computes the loss as the instance loss plus `prior_loss_weight` times the class loss. Its data set is
`max(instances, class images)` long and takes index i of each side modulo that side's length: the shorter side is
cycled, its order reshuffled with each of the DataLoader's epochs. Here the same pairing is a function of the global
stream position alone, so the one global cursor stays the whole data state (exact resume at any world size):

- The global stream interleaves the two sides one for one (trainer.data.joint's position rule at ratio 1/2):
  even positions are instance slots, odd positions class slots. A step of `train.batch_size` B (even) holds B/2 of
  each, as diffusers' batch of B/2 (its --train_batch_size) plus its B/2 class images.
- Each side is read in order from its own stream: one permutation per epoch *of that side* (seeded from (seed,
  epoch), the class side from its own seed), epochs concatenated. So within every epoch of a side each of its
  samples is used exactly once, and the shorter side simply begins its next epoch sooner: the exact-resume
  equivalent of diffusers' cycling (diffusers' modulo pairing repeats one fixed pairing per epoch; here each pass
  of the shorter side is freshly shuffled).
- Class samples carry `extras["prior"] = 1` (instance samples 0): the ddpm task weights their loss by
  `model.prior_loss_weight`.
"""

from __future__ import annotations

import logging
from fractions import Fraction

import torch

from trainer.config import Config
from trainer.data.datasets import ImageFolderDataset, Subset
from trainer.data.joint import JointStream
from trainer.data.sampler import SampleRef, SampleStream
from trainer.errors import ConfigError
from trainer.randomness import Stream, stream_seed

log = logging.getLogger(__name__)

PRIOR = "prior"  # the extras key: 1.0 for a class image's slot, 0.0 for an instance image's


class Prompted:
    """A Subset whose readable samples all carry one caption (`prompt`; None: their own) and, with `prior` not
    None, the prior flag (`extras["prior"]`)."""

    def __init__(self, subset: Subset, prompt: str | None, prior: bool | None):
        self.subset = subset
        self.prompt = prompt
        self.prior = prior
        self.dataset = subset.dataset
        self.image_shape = subset.image_shape

    def __len__(self) -> int:
        return len(self.subset)

    def make_stream(self, seed: int) -> SampleStream:
        return self.subset.make_stream(seed)

    def __getitem__(self, ref: SampleRef):
        image, label, index, position, valid, extras = self.subset[ref]
        if valid:  # a skipped slot keeps its zeros and reason (its loss weight is 0 anyway)
            extras = dict(extras)
            if self.prompt is not None:
                extras["caption"] = self.prompt
            if self.prior is not None:
                extras[PRIOR] = torch.tensor(float(self.prior))
        return image, label, index, position, valid, extras


class DreamBoothSet:
    """Instance and class samples interleaved one for one by global position (see the module doc). Class items'
    indices in the batch (`indices`, the ledger's) are shifted past the instance dataset's; their labels are -1."""

    encoding = None  # images, never `gentrain data encode` latents (see ShardSplit.encoding)

    def __init__(self, instance: Prompted, classes: Prompted):
        self.instance = instance
        self.classes = classes
        self.dataset = instance.dataset
        self.image_shape = instance.image_shape
        self.index_offset = len(instance.dataset)

    def __len__(self) -> int:
        return len(self.instance) + len(self.classes)

    def make_stream(self, seed: int) -> JointStream:
        classes = self.classes.make_stream(stream_seed(seed, Stream.DREAMBOOTH_CLASS))
        return JointStream(self.instance.make_stream(seed), classes, Fraction(1, 2), seed)

    def order_keys(self) -> dict:
        """What the pairing is a function of besides the seed: a resume with another count of either side would
        continue another order (refused, naming it)."""
        return {"data.instance images": len(self.instance), "data.class_images images": len(self.classes)}

    def __getitem__(self, ref: SampleRef):
        n = len(self.instance)
        if ref.index < n:
            return self.instance[ref]
        class_ref = SampleRef(index=ref.index - n, position=ref.position, fixed_aug_seed=ref.aug_seed)
        image, _, index, position, valid, extras = self.classes[class_ref]
        return image, -1, self.index_offset + index, position, valid, extras


def dreambooth_splits(cfg: Config, train: Subset, val: Subset | None):
    """(train, val) of a run with data.instance: the instance split with its prompt, and with data.class_images
    the DreamBooth set of both sides (every class image trains; none is held out)."""
    d = cfg.data
    if d.class_images is not None:
        if not hasattr(cfg.model_cfg, "prior_loss_weight"):
            raise ConfigError(
                f"data.class_images={d.class_images!r} (prior preservation) needs a task that weights the class "
                f"images' loss (model.prior_loss_weight: task ddpm); task {cfg.task} has none; unset data.class_images"
            )
        if cfg.train.batch_size % 2:
            raise ConfigError(
                f"train.batch_size={cfg.train.batch_size} with data.class_images: every step holds as many class "
                f"images as instance images, so it must be even; set train.batch_size={cfg.train.batch_size + 1} "
                "(diffusers' --train_batch_size is the instance half)"
            )
    instance = Prompted(train, d.instance_prompt, False if d.class_images is not None else None)
    val = Prompted(val, d.instance_prompt, None) if val is not None else None
    if d.class_images is None:
        return instance, val
    ds = ImageFolderDataset(
        d.class_images,
        d.image_size,
        d.channels,
        key="data.class_images",
        caption_column=d.caption_column,
        storage_options=d.storage_options,
        crop=d.crop,
    )
    classes = Prompted(Subset(ds, torch.arange(len(ds)).numpy(), d.flip, train.image_shape), d.class_prompt, True)
    log.info(
        "DreamBooth: %d instance images (%r), %d class images (%r), one of each per pair",
        len(instance),
        d.instance_prompt,
        len(classes),
        d.class_prompt,
    )
    return DreamBoothSet(instance, classes), val
