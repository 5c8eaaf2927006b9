"""FID and KID (torchmetrics) of generated vs real held-out images, split over ranks and gathered.

Work split: the generated images come in fixed chunks, chunk k drawn with
seed (seed, k), and each rank takes a contiguous run of chunks and of real
images; shares may be uneven (48 images over 2 ranks: 2 chunks and 1).
torchmetrics gathers its states over the process group at `compute` (FID:
feature sums and covariance sums added; KID: the features themselves,
concatenated in rank order), so the statistics are those of the whole set:
the same images and the same result at any world size, up to float summation
order. KID's random subsets come from a fixed seed in a forked RNG, so the
training RNG is untouched.

Two things make uneven shares safe. KID keeps its features as a list with no
reduction, and torchmetrics gathers such a list one element at a time, so
ranks holding different numbers of batches would issue different numbers of
collectives and wait on each other forever: each rank's lists are joined into
exactly one tensor (possibly empty) before `compute`. And sampling through an
FSDP-sharded part is itself collective (every forward gathers parameters), so
a rank with fewer chunks draws a throwaway one-image chunk to keep step.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from trainer.checkpoint.layout import eval_result_name
from trainer.data import collate
from trainer.data.sampler import SampleRef
from trainer.elastic import StopRequest, StopRequested
from trainer.errors import ConfigError
from trainer.models.finetune import half_weights_autocast
from trainer.randomness import Stream, stream_seed
from trainer.services import ProcessServices
from trainer.tasks.sampling import SampleRequest

log = logging.getLogger("gentrain")

GEN_CHUNK = 16


def rank_block(n: int, rank: int, world_size: int) -> range:
    """This rank's contiguous share of n items (the first n % W ranks take one more)."""
    per, extra = divmod(n, world_size)
    start = rank * per + min(rank, extra)
    return range(start, start + per + (1 if rank < extra else 0))


class FidKid:
    """torchmetrics FrechetInceptionDistance + KernelInceptionDistance over one feature network."""

    def __init__(self, features: nn.Module, kid_subset_size: int, device: torch.device):
        from torchmetrics.image.fid import FrechetInceptionDistance
        from torchmetrics.image.kid import KernelInceptionDistance

        self.features = features.to(device)
        self.fid = FrechetInceptionDistance(feature=self.features, reset_real_features=False).to(device)
        self.kid = KernelInceptionDistance(
            feature=self.features, subset_size=kid_subset_size, reset_real_features=False
        ).to(device)
        self.kid_subset_size = kid_subset_size
        self.n_real = 0
        self.has_real = False

    @torch.no_grad()
    def update(self, images: torch.Tensor, real: bool) -> None:
        """images: (N, C, H, W) in [0, 1]."""
        if len(images):
            self.fid.update(images, real=real)
            self.kid.update(images, real=real)

    def _one_tensor_per_list(self) -> None:
        """Join each KID feature list into one tensor (empty if this rank saw none), so every rank
        issues the same collectives in torchmetrics' sync (one gather per list element)."""
        # Private: torchmetrics' list states, which it offers no public way to merge; guarded by
        # tests/test_private_apis.py::test_torchmetrics_kid_keeps_features_in_list_states.
        width = self.features.num_features
        for name in ("real_features", "fake_features"):
            parts = getattr(self.kid, name)
            # float64 on every rank (the feature networks return float64): the padded gather needs one dtype.
            joined = torch.cat(parts) if parts else torch.zeros(0, width, device=self.kid.device)
            setattr(self.kid, name, [joined.to(torch.float64)])

    @torch.no_grad()
    def compute(self, n_real: int, n_fake: int) -> dict[str, float]:
        self._one_tensor_per_list()
        fid = float(self.fid.compute())
        self.kid.subset_size = max(2, min(self.kid_subset_size, n_real, n_fake))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(Stream.FID_CHUNK.id)
            kid_mean, kid_std = self.kid.compute()
        # Keep the real statistics (fixed set) for the next evaluation; drop the generated ones.
        self.fid.reset()
        self.kid.reset()
        return {"fid": fid, "kid": float(kid_mean), "kid_std": float(kid_std)}


def real_images(real_set, n: int, rank: int, world_size: int, batch: int = 64):
    """Yield this rank's share of the first n images of a split, in [0, 1] (invalid ones dropped, counted)."""
    block = rank_block(n, rank, world_size)
    for s in range(block.start, block.stop, batch):
        refs = [SampleRef(index=i, position=i) for i in range(s, min(s + batch, block.stop))]
        getter = getattr(real_set, "__getitems__", None)
        items = getter(refs) if getter else [real_set[r] for r in refs]
        b = collate(items)
        yield ((b["images"][b["valid"]] + 1) / 2).clamp(0, 1)


def check_share(n_real: int, world_size: int) -> None:
    """Every rank needs at least one real image (torchmetrics' FID learns its dtype from an update)."""
    if n_real < world_size:
        raise ConfigError(
            f"evaluation on {world_size} ranks needs at least {world_size} real images (one per rank); it would use "
            f"{n_real}: raise eval.num (and the held-out split) to at least {world_size}"
        )


def generated_images(
    sample: Callable[[int, int], torch.Tensor],
    n: int,
    seed: int,
    rank: int,
    world_size: int,
    chunk: int = GEN_CHUNK,
    lockstep: bool = False,
):
    """Yield this rank's chunks of n generated images; chunk k is `sample(count, seed(seed, k))` on every world size.

    `lockstep`: every rank calls `sample` the same number of times (sharded parts gather their
    parameters in every forward); a rank with fewer chunks draws one throwaway image per missing chunk.
    """
    chunks = math.ceil(n / chunk)
    mine = rank_block(chunks, rank, world_size)
    for k in mine:
        count = min(chunk, n - k * chunk)
        yield sample(count, stream_seed(seed, Stream.FID_CHUNK, k) % (2**63))
    if lockstep:
        for _ in range(len(mine), len(rank_block(chunks, 0, world_size))):  # rank 0 has the most
            sample(1, stream_seed(seed, Stream.FID_CHUNK, chunks) % (2**63))


def evaluate(
    task,
    modules: Mapping[str, nn.Module],
    metric: FidKid,
    real_set,
    num: int,
    seed: int,
    sample_options: dict[str, Any],
    rank: int,
    world_size: int,
    device: torch.device,
    stop: StopRequest | None = None,
    work: str = "evaluation",
) -> dict[str, float]:
    """FID/KID of `num` generated images vs up to `num` real ones; every rank must call it (collectives).

    With `stop` (a training run's StopRequest), a stop request cuts it short between real batches,
    generated chunks and sampler steps, and every rank raises `StopRequested` (agreed) together: local
    work checks each rank's own flag and the ranks agree before the next collective (under FSDP each
    check is an agreement, since every forward is collective)."""
    n_real = min(num, len(real_set))
    check_share(n_real, world_size)
    if n_real < 2:
        raise ValueError(f"evaluation needs at least 2 real images, the held-out set has {len(real_set)}")
    services = ProcessServices()
    lockstep = world_size > 1 and any(services.calls_are_collective(module) for module in modules.values())
    local = stop.checker(work, device) if stop is not None else None
    check = stop.checker(work, device, collective=lockstep) if stop is not None else None
    if not metric.has_real:
        with _until_stopped():
            for images in real_images(real_set, n_real, rank, world_size):
                if local is not None:
                    local()
                metric.update(images.to(device), real=True)
        if local is not None:
            local.agree()  # before the (possibly collective) sampling: every rank goes on, or none
        metric.has_real = True

    def sample(count: int, s: int) -> torch.Tensor:
        if check is not None:
            check()  # between chunks too: a task may sample in one step (a reconstruction)
        request = SampleRequest(num=count, seed=s, between_steps=check, **sample_options)
        with half_weights_autocast(modules, device):  # a LoRA run's half-precision base
            return task.sample(modules, request, device)

    with _until_stopped():
        for images in generated_images(sample, num, seed, rank, world_size, lockstep=lockstep):
            metric.update(images.to(device), real=False)
    if check is not None and not lockstep:
        check.agree()  # before compute's gather
    values = metric.compute(n_real, num)
    return {**values, "num_generated": num, "num_real": n_real}


@contextlib.contextmanager
def _until_stopped():
    """Leave the loop inside at a stop this rank alone raised (the ranks agree afterwards); an agreed
    one goes on up."""
    try:
        yield
    except StopRequested as cut:
        if cut.agreed:
            raise


def sample_options(cfg) -> dict[str, Any]:
    """The sampler settings of every evaluation request (`SampleRequest` fields): the run's `sample.*`, with
    `eval.inference_steps` first."""
    s = cfg.sample
    return {
        "inference_steps": cfg.eval.inference_steps or s.inference_steps,
        "scheduler": s.scheduler,
        "guidance_scale": s.guidance_scale,
    }


def write_result(root_url: str, storage_options: dict | None, step: int, result: dict[str, Any]) -> str:
    """`<checkpoint root>/eval-<step>.json` (beside the step directories; retention leaves it alone)."""
    import json

    import fsspec

    url = f"{root_url.rstrip('/')}/{eval_result_name(step)}"
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    fs.pipe_file(path, json.dumps(result, indent=1).encode())
    return url
