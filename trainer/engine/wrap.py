"""How the parts are wrapped for the process layout: one process (trained as built), DDP (accelerate's
wrapper around each part that learns) or FSDP2 (each such part sharded in place, see trainer.engine.shard).

`wrapping_for(runtime, train)` picks one. The Trainer then asks it, in this order: where the task
builds its modules (`build_context`), to check what was built (`check_built`, `check_supported`), to set
up the parts kept whole (`prepare`); `build_parts` asks it to `wrap` each part that learns and to
`shard_frozen` each frozen one; the Trainer finally checks every rank starts alike (`check_started`).
The step runner asks it for `no_sync` on every chunk but a step's last.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from trainer.engine.shard import (
    build_context,
    no_sync,
    replicate_from_rank0,
    shard_from_rank0,
    shard_module,
    whole_tensors_agree,
)
from trainer.errors import ConfigError
from trainer.models.finetune import text_children

if TYPE_CHECKING:
    from trainer.config.schema import TrainConfig
    from trainer.engine.runtime import Runtime
    from trainer.tasks.base import Task

log = logging.getLogger("gentrain")


class Wrapping:
    """What every layout does by default: build where the task builds, wrap nothing, check nothing."""

    # True when `wrap` shards a part in place and moves it to the device itself, one unit at a time.
    shards_on_wrap = False

    def __init__(self, runtime: Runtime, train: TrainConfig):
        self.runtime = runtime
        self.train = train

    def build_context(self) -> AbstractContextManager:
        """Where the task builds its modules."""
        return nullcontext()

    def check_built(self, modules: Mapping[str, nn.Module]) -> None:
        """After the task built its modules (every rank)."""

    def check_supported(self, task: Task, modules: Mapping[str, nn.Module], trainable: Collection[str]) -> None:
        """Refuse (ConfigError) a task or model this layout cannot train."""

    def prepare(self, modules: Mapping[str, nn.Module], frozen: Collection[str], learning: Collection[str]) -> None:
        """Before the parts are built: set up the modules that will not be wrapped."""

    def wrap(self, module: nn.Module) -> nn.Module:
        """What forwards use while the part learns."""
        return module

    def shard_frozen(self, module: nn.Module) -> None:
        """A frozen part, its weights loaded."""

    def no_sync(self, wrapped: nn.Module) -> AbstractContextManager:
        """Skip the gradient reduction of a chunk that is not the step's last."""
        return nullcontext()

    def check_started(self, modules: Mapping[str, nn.Module]) -> None:
        """After the parts are built (every rank)."""


class OneProcess(Wrapping):
    """One process: the parts are trained as built."""

    def prepare(self, modules: Mapping[str, nn.Module], frozen: Collection[str], learning: Collection[str]) -> None:
        if self.train.shard_frozen:
            log.warning("train.shard_frozen=true has no effect on one process; frozen parts stay whole")


class DataParallel(Wrapping):
    """DDP through accelerate: every rank holds whole parts; gradients are all-reduced on a step's last chunk."""

    def wrap(self, module: nn.Module) -> nn.Module:
        return self.runtime.accelerator.prepare_model(module)

    def no_sync(self, wrapped: nn.Module) -> AbstractContextManager:
        return self.runtime.accelerator.no_sync(wrapped)


class FullySharded(Wrapping):
    """FSDP2: parts that learn are sharded in place from rank 0's values (built on the meta device
    elsewhere); parts kept whole (frozen, not trained this run) are replicated from rank 0, and frozen
    ones sharded too under train.shard_frozen. A LoRA-adapted part is sharded like any other: its frozen
    base in train.precision's dtype and its fp32 adapters share units (see trainer.engine.shard)."""

    shards_on_wrap = True

    def __init__(self, runtime: Runtime, train: TrainConfig):
        super().__init__(runtime, train)
        self.offload = train.cpu_offload and runtime.device.type == "cuda"

    def build_context(self) -> AbstractContextManager:
        return build_context(self.runtime.rank, True)  # parameters on meta except on rank 0

    def check_built(self, modules: Mapping[str, nn.Module]) -> None:
        """Say how much parameter memory each rank allocated while building (only rank 0 should)."""
        world_size, device = self.runtime.world_size, self.runtime.device
        params = [p for m in modules.values() for p in m.parameters()]
        mine = sum(p.numel() * p.element_size() for p in params if not p.is_meta)
        sizes = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world_size)]
        dist.all_gather(sizes, torch.tensor([float(mine), float(len(params))], dtype=torch.float64, device=device))
        counts = [int(t[1]) for t in sizes]
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"the task's build made {counts[0]} parameters on rank 0 but {counts} across ranks: parts built with "
                "parameters on the meta device (every rank but 0 under FSDP) lost a weight tie; tie them again after "
                "building (e.g. in the module's forward setup) or train with train.parallel=ddp"
            )
        others = max(float(t[0]) for t in sizes[1:])
        log.info(
            "fsdp init: rank 0 built the parts (%.2f MB of parameters); ranks 1-%d built them on the meta device "
            "(at most %.2f MB allocated) and take their slices from rank 0",
            float(sizes[0][0]) / 1e6,
            world_size - 1,
            others / 1e6,
        )

    def check_supported(self, task: Task, modules: Mapping[str, nn.Module], trainable: Collection[str]) -> None:
        refusal = task.fsdp_refusal()
        if refusal:
            raise ConfigError(f"train.parallel=fsdp: {refusal}")
        refuse_text_lora_under_fsdp(modules, trainable)

    def prepare(self, modules: Mapping[str, nn.Module], frozen: Collection[str], learning: Collection[str]) -> None:
        if self.train.cpu_offload and self.runtime.device.type != "cuda":
            log.warning("train.cpu_offload=true has no effect on a CPU device; parameters already live there")
        for name, m in modules.items():  # parts kept whole: allocated here, values from rank 0
            if name in frozen or name not in learning:
                replicate_from_rank0(m, self.runtime.device, self.runtime.rank, parameters=name not in frozen)

    def wrap(self, module: nn.Module) -> nn.Module:
        r = self.runtime
        return shard_from_rank0(module, r.precision, self.offload, r.rank, r.device)

    def shard_frozen(self, module: nn.Module) -> None:
        if self.train.shard_frozen:
            shard_module(module, self.runtime.precision, self.offload)

    def no_sync(self, wrapped: nn.Module) -> AbstractContextManager:
        return no_sync(wrapped)

    def check_started(self, modules: Mapping[str, nn.Module]) -> None:
        agree, n = whole_tensors_agree(modules.values(), self.runtime.device)
        if not agree:
            raise RuntimeError("FSDP start: the ranks hold different values in parts or buffers kept whole")
        log.info("fsdp init: %d whole tensors (kept parts, buffers) identical on every rank", n)


def refuse_text_lora_under_fsdp(modules: Mapping[str, nn.Module], trainable: Collection[str]) -> None:
    """LoRA-trained text encoders (children of the denoiser's part, trainer.models.finetune.attach_text_lora) are
    called on their own before the denoiser's forward: under FSDP2 the part's root unit, which holds their
    embeddings, gathers only around the denoiser's forward, and a nested unit run first would take the root's
    place. Refused until they are sharded as roots of their own."""
    slots = sorted({slot for n in trainable for slot in text_children(modules[n])})
    if slots:
        raise ConfigError(
            f"model.lora.text_encoder=true (LoRA on {', '.join(slots)}) is not supported with train.parallel=fsdp "
            "yet: the text encoders run outside the denoiser's forward, which gathers the sharded weights; use "
            "train.parallel=ddp (the adapters are small) or model.lora.text_encoder=false"
        )


def wrapping_for(runtime: Runtime, train: TrainConfig) -> Wrapping:
    """The wrapping for `runtime.parallel` (one process, DDP or FSDP)."""
    kinds: dict[str, type[Wrapping]] = {"none": OneProcess, "ddp": DataParallel, "fsdp": FullySharded}
    return kinds[runtime.parallel](runtime, train)
