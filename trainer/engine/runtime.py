"""The runtime: what every engine component needs to know about the processes it runs in.

Made once by the Trainer (`start_runtime`: process group, accelerate) and handed by keyword
to the checkpoint manager, the reporter, validation, previews and evaluation, so none of them takes a
rank, a world size, a device and a precision as separate arguments, nor works out again whether parts
are sharded.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin

from trainer.accelerate_env import check_accelerate_env
from trainer.elastic import DistEnv, init_process_group

if TYPE_CHECKING:
    from trainer.config import Config

log = logging.getLogger("gentrain")

Parallel = Literal["none", "ddp", "fsdp"]


def parallel_mode(parallel: str, world_size: int) -> Parallel:
    """How the parts run: "none" in one process (train.parallel has no effect there), else train.parallel."""
    if world_size == 1:
        return "none"
    return "fsdp" if parallel == "fsdp" else "ddp"


@dataclass(frozen=True)
class Runtime:
    """The process (rank, world size, restarts), its device, the training precision, how parts run
    (`parallel`), the run's seed, and accelerate's object where trackers and DDP need it."""

    env: DistEnv
    device: torch.device
    precision: Literal["no", "fp16", "bf16"]
    parallel: Parallel
    seed: int
    accelerator: Accelerator | None = field(default=None, compare=False, repr=False)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.is_main

    @property
    def sharded(self) -> bool:
        """FSDP parts are sharded across ranks: their forwards (validation, previews) run on every rank
        together, and checkpoints are written by every rank."""
        return self.parallel == "fsdp"

    @classmethod
    def local(cls, device: torch.device | str = "cpu", precision: str = "no", seed: int = 0) -> Runtime:
        """One process without a process group or accelerate (unit tests, tools)."""
        return cls(DistEnv(), torch.device(device), precision, "none", seed)  # type: ignore[arg-type]


def accelerator_kwargs(use_cpu: bool) -> dict:
    """Every Accelerator setting that accelerate would otherwise read from `ACCELERATE_*` variables
    (`accelerate launch` sets them), given explicitly: the engine autocasts and scales losses itself
    (train.precision), accumulates itself (train.grad_accum) and compiles nothing, so accelerate gets
    "no", 1 and no dynamo whatever the environment says. The plugins it cannot be told to leave off
    (FSDP, DeepSpeed, ...) are refused before this (trainer.accelerate_env)."""
    return {
        "cpu": use_cpu,
        "mixed_precision": "no",
        "gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=1),
        # Backend "no": nothing is compiled, so the other ACCELERATE_DYNAMO_* settings have nothing to act on.
        "dynamo_backend": "no",
    }


def configure_matmul(tf32: bool, cuda: bool) -> None:
    """`train.tf32` on CUDA: fp32 matmuls and cuDNN convolutions in TF32 on Ampere and newer (torch's
    default keeps full fp32 matmuls); on CPU nothing is touched."""
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def start_runtime(cfg: Config, env: DistEnv, trackers: list[str]) -> Runtime:
    """Join the process group, start accelerate on it with the `trackers` (checked importable first, see
    trainer.engine.report.tracker_names: accelerate silently drops one whose package is missing). They are
    started after the resume (Reporter.start_trackers), which knows their run ids."""
    use_cpu = not torch.cuda.is_available()
    # accelerate launch's settings: refused (exit 2) when accelerate would act on them, else ignored.
    for warning in check_accelerate_env(os.environ, cuda=not use_cpu):
        if env.is_main:
            log.warning("%s", warning)
    configure_matmul(cfg.train.tf32, cuda=not use_cpu)
    # The process group is ours (restart-safe store, finite timeout); accelerate reuses it.
    init_process_group(env, "gloo" if use_cpu else "nccl", cfg.elastic.collective_timeout_seconds)
    # cpu=True on CPU machines: without it accelerate reports a single
    # process under torchrun and every rank would silently train alone.
    accelerator = Accelerator(**accelerator_kwargs(use_cpu), log_with=trackers or None, project_dir=cfg.run_dir)
    if accelerator.num_processes != env.world_size:
        raise RuntimeError(
            f"accelerate sees {accelerator.num_processes} processes but torchrun started "
            f"{env.world_size}; refusing to train ranks independently"
        )
    return Runtime(
        env=env,
        device=accelerator.device,
        precision=cfg.train.precision,
        parallel=parallel_mode(cfg.train.parallel, env.world_size),
        seed=cfg.seed,
        accelerator=accelerator,
    )
