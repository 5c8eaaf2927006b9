"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for parts: which blocks become units, mixed precision,
CPU offload, and the no_sync equivalent for accumulation.

Each element of a module's top-level `nn.ModuleList`s (a UNet's down and up
blocks, a transformer's layers) becomes its own FSDP unit, then the part
itself (what is left: stems, embeddings, the middle block). Only one unit's
parameters are unsharded at a time, as in TorchTitan. Parameters stay fp32
(a LoRA base: its half dtype, below) and sharded; `train.precision=bf16|fp16`
sets the dtype they are gathered in for compute, with gradients reduced in fp32.

Initialisation happens on rank 0 only: the other ranks build their parts
with parameters on the meta device (no memory), shard them, allocate just
their own slices, and receive those slices from rank 0's freshly built (or
pretrained-loaded) part. So a rank never holds a whole part it will shard,
and every rank starts from exactly the weights one process would have built
(the same as DDP, which also starts from rank 0's weights).

A LoRA-adapted part (peft adapters on a frozen base) is sharded the same way, units unchanged: its base
is stored in the half dtype of `train.precision` and its adapters in fp32 (diffusers'
`cast_training_params`, done before sharding), so one unit holds both dtypes. FSDP2 all-gathers such a
unit through one byte buffer (its copy-in views every parameter as bytes when their dtypes differ);
with the mixed-precision policy both are gathered in the compute dtype. Only the adapters have
gradients, all fp32, reduce-scattered in fp32; the frozen base never gets one, so never a reduction.
The gain is TorchTitan's: each rank keeps 1/N of the half-precision base between its unit's forwards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, distribute_tensor

log = logging.getLogger("gentrain")

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


def gathered_units(module: nn.Module) -> list[nn.Module]:
    """Units whose parameters stay gathered from their forward until their backward (FSDP2's
    `reshard_after_forward=False`): those the part or any module in it names, by submodule name relative to
    itself, in an attribute `fsdp_gathered_units` (a cascade stage holds the backbone's diffusers module).
    For a unit the model calls again after its own forward (diffusers' DiT runs its first block's embedding
    after the last block): it stays a unit, sharded between steps, its gradient reduced in its own backward,
    and costs one block's whole parameters from its forward to its backward."""
    names: set[str] = set()
    for prefix, m in module.named_modules():
        names.update(f"{prefix}.{n}" if prefix else n for n in getattr(m, "fsdp_gathered_units", ()))
    found = {name: m for name, m in module.named_modules() if name in names}
    units = {id(u) for u in fsdp_units(module)}
    wrong = sorted(names - set(found)) + sorted(n for n, m in found.items() if id(m) not in units)
    if wrong:
        raise ValueError(f"fsdp_gathered_units in {type(module).__name__} name no FSDP unit: {', '.join(wrong)}")
    return [found[n] for n in sorted(found)]


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """Compute in bf16/fp16 (parameters gathered in that dtype), reduce gradients in fp32."""
    return MixedPrecisionPolicy(param_dtype=_PARAM_DTYPES.get(precision), reduce_dtype=torch.float32)


def shard_module(module: nn.Module, precision: str, cpu_offload: bool) -> nn.Module:
    """Apply fully_shard per block, then to the whole part (in place; returns the same object).

    FSDP2 gathers a unit's parameters in hooks around `forward`; a part used
    through other methods (a tokenizer's `encode_indices` / `decode_indices`)
    names them in a class attribute `fsdp_forward_methods`, and they get the
    same hooks. Units a part names in `fsdp_gathered_units` stay gathered after their forward
    (`gathered_units`).
    """
    kwargs = {"mp_policy": mixed_precision(precision)}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    gathered = {id(u) for u in gathered_units(module)}
    units = fsdp_units(module)
    classes = ", ".join(sorted({type(u).__name__ for u in units})) or "none"  # before fully_shard renames them
    for unit in units:
        fully_shard(unit, reshard_after_forward=id(unit) not in gathered, **kwargs)
    log.info(
        "fsdp: %s sharded as %d units (%s) plus the rest%s%s",
        type(module).__name__,
        len(units),
        classes,
        f"; {', '.join(n for n, m in module.named_modules() if id(m) in gathered)} kept gathered after forward"
        if gathered
        else "",
        frozen_split(module),
    )
    fully_shard(module, **kwargs)
    for name in getattr(module, "fsdp_forward_methods", ()):
        register_fsdp_forward_method(module, name)
    return module


def frozen_split(module: nn.Module) -> str:
    """For a part with frozen parameters (a LoRA base) among trainable ones, what each holds and in which
    dtypes, e.g. "; frozen 1024 parameters (bfloat16), trainable 64 (float32)"; "" otherwise."""
    groups: dict[bool, tuple[int, set[str]]] = {}
    for p in module.parameters():
        n, dtypes = groups.get(p.requires_grad, (0, set()))
        groups[p.requires_grad] = (n + p.numel(), dtypes | {str(p.dtype).removeprefix("torch.")})
    if len(groups) < 2:
        return ""
    (frozen, fd), (trained, td) = groups[False], groups[True]
    return f"; frozen {frozen} parameters ({', '.join(sorted(fd))}), trainable {trained} ({', '.join(sorted(td))})"


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


def build_context(rank: int, sharded: bool) -> AbstractContextManager:
    """Where parts are built: on ranks other than 0 of a sharded run, parameters go on the meta device
    (accelerate's init_empty_weights; buffers stay real and small, and are overwritten from rank 0)."""
    if not sharded or rank == 0:
        return nullcontext()
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


@torch.no_grad()
def replicate_from_rank0(module: nn.Module, device: torch.device, rank: int, parameters: bool = True) -> None:
    """A part kept whole on every rank (frozen, or not trained this run): ranks other than 0 allocate it
    and take rank 0's values; `parameters=False` sends buffers only (a frozen part's weights come from
    its file next, on every rank). Every rank must call it, in the same order."""
    if rank != 0:
        module.to_empty(device=device)
    else:
        module.to(device)  # NCCL broadcasts from device memory
    tensors = [*(module.parameters() if parameters else ()), *module.buffers()]
    for t in tensors:
        dist.broadcast(t.data, src=0)


def move_buffers(module: nn.Module, device: torch.device) -> None:
    """Move every buffer of `module` (not its parameters) to `device`, keeping which are persistent.

    Assigning to a registered buffer's name replaces the buffer (`nn.Module.__setattr__`):
    the public way to move buffers only, where `module.to` would move parameters too.
    """
    for m in module.modules():
        for key, b in list(m.named_buffers(recurse=False)):
            setattr(m, key, b.to(device))


def shard_from_rank0(
    module: nn.Module, precision: str, cpu_offload: bool, rank: int, device: torch.device
) -> nn.Module:
    """Shard a part built on rank 0 (and on the meta device elsewhere), then give every rank its slices of
    rank 0's values: one parameter at a time, broadcast whole and cut locally with the parameter's own
    placement (`distribute_tensor` without communication), so no rank holds more than one whole
    parameter beyond its shards. Buffers, which FSDP2 does not shard, are broadcast whole.

    By hand rather than torch.distributed.checkpoint's `set_model_state_dict(broadcast_from_rank0=True)`
    (same scheme), which refuses a state dict on two devices: with CPU offload the sharded parameters
    live on the host and the buffers on the GPU.
    """
    full = {n: p.detach() for n, p in module.named_parameters()} if rank == 0 else {}  # host memory
    shard_module(module, precision, cpu_offload)  # moves one unit at a time to the device as it shards
    if rank != 0:
        module.to_empty(device=torch.device("cpu") if cpu_offload else device)
        if cpu_offload:  # offload keeps parameters on the host; buffers live on the device
            move_buffers(module, device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if rank == 0:
                whole = full.pop(name).to(device)
            else:
                whole = torch.empty(p.shape, dtype=p.dtype, device=device)
            dist.broadcast(whole, src=0)
            if isinstance(p, DTensor):
                whole = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(whole)
            else:
                p.copy_(whole)
            del whole
        for b in module.buffers():
            dist.broadcast(b.data, src=0)
    follow_rank0_buffers(module)
    return module


def follow_rank0_buffers(module: nn.Module) -> None:
    """Before each forward of `module`, give every rank rank 0's buffers, as DDP does (its
    `broadcast_buffers`). FSDP2 leaves buffers to each rank: a buffer a forward updates from the rank's
    own batch (LeCAM's anchors) would drift apart across ranks, and a sharded checkpoint, which keeps
    rank 0's copy, could not resume such a run exactly. Modules without buffers get no hook."""
    if next(module.buffers(), None) is None:
        return

    def broadcast(mod: nn.Module, args: Any) -> None:
        with torch.no_grad():
            for b in mod.buffers():
                dist.broadcast(b, src=0)

    module.register_forward_pre_hook(broadcast)


@torch.no_grad()
def whole_tensors_agree(modules: Iterable[nn.Module], device: torch.device) -> tuple[bool, int]:
    """Whether every rank holds the same values in every tensor that is not sharded (whole parts, all
    buffers): two float64 sums per tensor, all-gathered and compared exactly. (agree, tensors checked)."""
    sums = []
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            if isinstance(t, DTensor) or t.is_meta:
                continue
            v = torch.nan_to_num(t.detach().double(), nan=0.0, posinf=1e300, neginf=-1e300)
            sums += [v.sum(), v.abs().sum()]
    mine = torch.stack(sums).to(device) if sums else torch.zeros(0, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return all(torch.equal(x, every[0]) for x in every), len(sums) // 2


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value (e.g. a gradient norm computed over shards); plain tensors as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t
