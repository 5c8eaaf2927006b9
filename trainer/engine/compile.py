"""Regional compilation (`train.compile=true`): `torch.compile` per block, as torchtitan does under FSDP2.

The blocks are the activation-checkpointing and FSDP units (`trainer.engine.shard.fsdp_units`: a UNet's down
and up blocks, every transformer block). Each block's `forward` is replaced (by a subclass named as its class,
as for activation checkpointing, so parameter names, state dicts and checkpoints do not change) by one that
calls a compiled version of it while gradients are on:

- Only the `forward` is compiled, not the module's `__call__`: FSDP2's gather and reshard hooks and DDP's run
  eagerly around it, so no collective is traced, and a checkpointed block's `torch.utils.checkpoint` call is
  compiled inside the block (dynamo traces it as one higher-order op) as torchtitan orders them.
- Every block of a class shares one compiled function: dynamo treats a module's parameters as inputs (it
  inlines built-in modules), so the 28 blocks of a DiT compile one graph and reuse it, the point of compiling
  regions rather than the whole model (compile time of one block, not of the model).
- With gradients off (validation loss, sampling, an EMA copy) the block runs eagerly: those are a small share
  of the time, would compile a second graph per block class (grad mode is guarded), and sampling at other
  batch sizes would recompile again.

Exactness: a compiled step is deterministic on CPU for a fixed thread count (inductor's C++ kernels reduce in
a fixed order, random ops draw from the global generator, whose state a checkpoint restores), so a resumed
compiled run is bit-identical to an uninterrupted compiled one. It is not bit-identical to an eager run
(fused kernels round differently); see docs/scaling.md.

Compile time and graph breaks come from dynamo's own counters (`torch._dynamo.utils`: `counters`,
`compilation_time_metrics`; private, covered by tests/test_private_apis.py) and are logged once, after the
first step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from trainer.engine.remat import apply_to_blocks
from trainer.engine.shard import fsdp_units

log = logging.getLogger("gentrain")

# dynamo's timers that together cover a compile: the forward frames (tracing, AOT autograd, inductor's forward)
# and the backward graphs inductor compiles lazily at the first backward.
_COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")

_CLASSES: dict[type, type] = {}
_COMPILED: dict[type, object] = {}


def _compiled_class(cls: type) -> type:
    """`cls` with its forward compiled while gradients are on (one class and one compiled function per class)."""
    if cls not in _CLASSES:
        original = cls.forward
        # Static shapes: blocks of one class at several resolutions (a UNet's ResnetBlock2D) get a graph per
        # shape instead of one with symbolic sizes (automatic dynamic shapes recompiled the second shape with
        # symbols, which inductor 2.13 failed to lower for a UNet block on CPU); `compile_blocks` raises
        # dynamo's per-function recompile limit to the number of blocks so no shape falls back to eager.
        compiled = torch.compile(original, dynamic=False)
        _COMPILED[cls] = compiled

        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled():
                return original(self, *args, **kwargs)
            return compiled(self, *map(_dense, args), **{k: _dense(v) for k, v in kwargs.items()})

        _CLASSES[cls] = type(cls.__name__, (cls,), {"forward": forward, "compiled": True, "__module__": cls.__module__})
    return _CLASSES[cls]


def _dense(value):
    """`value` laid out contiguously if it is a tensor that is not. Dynamo guards on strides: a DiT's first
    block gets its tokens as a transposed view of the patch embedding, the others the contiguous output of the
    block before, so the shared graph was compiled twice (one more graph at the first step: 13.8 s of compile
    instead of 12.0 for a 2-block DiT on CPU) for a copy of one block's input."""
    return value.contiguous() if isinstance(value, torch.Tensor) and not value.is_contiguous() else value


def compile_blocks(module: nn.Module) -> list[nn.Module]:
    """Compile every block (FSDP unit) of `module` in place; returns the blocks (none: nothing done)."""
    units = fsdp_units(module)
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, len(units))
    for unit in units:
        if not getattr(unit, "compiled", False):
            unit.__class__ = _compiled_class(type(unit))
    return units


def compiled_blocks(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if getattr(m, "compiled", False)]


def apply_compile(modules: Mapping[str, nn.Module], learning: Collection[str], task: str) -> None:
    """Compile the blocks of every part this run trains (at their first use); exit 2 (ConfigError) when no
    part has blocks."""
    apply_to_blocks(
        modules,
        learning,
        task,
        lambda _, part: compile_blocks(part),
        setting="train.compile=true",
        off="train.compile=false",
        label="compile",
        verb="compile",
    )


@dataclass(frozen=True)
class CompileStats:
    """What dynamo did so far in this process."""

    seconds: float
    graphs: int
    graph_breaks: int
    recompiles: int
    break_reasons: tuple[str, ...]
    recompile_reasons: tuple[str, ...] = ()

    @classmethod
    def now(cls) -> CompileStats:
        from torch._dynamo.utils import compilation_time_metrics, counters, get_compilation_metrics

        breaks = counters["graph_break"]
        # Recompiles: the compiles dynamo recorded a guard failure for (its per-compile records; it keeps the
        # last 64, and a run compiles one graph per block class and input shape). `counters["recompiles"]`
        # is not incremented by torch 2.13 (it read 0 whatever happened).
        recompiled = [m.recompile_reason for m in get_compilation_metrics() if m.recompile_reason]
        return cls(
            seconds=sum(sum(compilation_time_metrics.get(k, ())) for k in _COMPILE_TIMERS),
            graphs=int(counters["stats"]["unique_graphs"]),
            graph_breaks=int(sum(breaks.values())),
            recompiles=len(recompiled),
            break_reasons=tuple(reason for reason, _ in breaks.most_common(3)),
            recompile_reasons=tuple(dict.fromkeys(r.strip() for r in recompiled))[:3],
        )

    def line(self) -> str:
        text = (
            f"compile: {self.seconds:.1f} s compiling, {self.graphs} graph(s), {self.graph_breaks} graph break(s), "
            f"{self.recompiles} recompile(s)"
        )
        if self.break_reasons:
            text += "; breaks: " + " | ".join(r.replace("\n", " ")[:200] for r in self.break_reasons)
        if self.recompile_reasons:
            text += "; recompiled for: " + " | ".join(r.replace("\n", " ")[:200] for r in self.recompile_reasons)
        return text
