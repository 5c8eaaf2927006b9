"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for parts: which blocks become units, mixed precision,
CPU offload, and the no_sync equivalent for accumulation.

Each element of a module's top-level `nn.ModuleList`s (a UNet's down and up
blocks, a transformer's layers) becomes its own FSDP unit, then the part
itself (what is left: stems, embeddings, the middle block). Only one unit's
parameters are unsharded at a time, as in TorchTitan. Parameters stay fp32
and sharded; `train.precision=bf16|fp16` sets the dtype they are gathered
in for compute, with gradients reduced in fp32.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

_PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_units(module: nn.Module) -> list[nn.Module]:
    """Blocks sharded as their own units: elements of the outermost ModuleLists that hold parameters."""
    units: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, nn.ModuleList):
                units.extend(b for b in child if b is not None and any(True for _ in b.parameters()))
            else:
                walk(child)

    walk(module)
    return units


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """Compute in bf16/fp16 (parameters gathered in that dtype), reduce gradients in fp32."""
    return MixedPrecisionPolicy(param_dtype=_PARAM_DTYPES.get(precision), reduce_dtype=torch.float32)


def shard_module(module: nn.Module, precision: str, cpu_offload: bool) -> nn.Module:
    """Apply fully_shard per block, then to the whole part (in place; returns the same object).

    FSDP2 gathers a unit's parameters in hooks around `forward`; a part used
    through other methods (a tokenizer's `encode_indices` / `decode_indices`)
    names them in a class attribute `fsdp_forward_methods`, and they get the
    same hooks.
    """
    kwargs = {"mp_policy": mixed_precision(precision)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for unit in fsdp_units(module):
        fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)
    for name in getattr(module, "fsdp_forward_methods", ()):
        register_fsdp_forward_method(module, name)
    return module


def reshard(modules: Iterable[nn.Module]) -> None:
    """Free unsharded parameters left by forwards without a backward (validation, previews).

    FSDP2 keeps the root unit unsharded after its forward (backward would
    gather it again at once); after a no-grad forward nothing reshards it, and
    `parameters()` / `state_dict()` would then see whole plain tensors.
    """
    for module in modules:
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


def is_fsdp(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


@contextmanager
def no_sync(module: nn.Module) -> Iterator[None]:
    """FSDP2's no_sync: gradients accumulate unsharded and are reduce-scattered on the last chunk.

    Trades memory (one unsharded gradient per parameter between chunks) for
    one reduce-scatter per optimizer step, as DDP's no_sync does.
    """
    assert isinstance(module, FSDPModule)
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (e.g. a gradient norm computed over shards); plain tensors as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t
