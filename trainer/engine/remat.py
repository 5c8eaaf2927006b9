"""Activation checkpointing, called rematerialization here (`train.activation_checkpointing`): a part's blocks
keep only their inputs in the forward and run again in the backward, trading compute for activation memory.
(Named apart from `trainer.checkpoint`, the storage of training checkpoints, and `engine/checkpoints.py`, which
saves and resumes them: nothing here is written anywhere.)

The blocks are the FSDP units (`trainer.engine.shard.fsdp_units`: the elements of a part's outermost
ModuleLists: a UNet's down and up blocks, every transformer block, a MaskGIT's encoder layers), so under FSDP
each unit is checkpointed inside its own `fully_shard` unit, the torchtitan pattern: FSDP's gather hooks run
around the block's `__call__`, the checkpoint inside its `forward`, and the recomputation in the backward uses
the weights FSDP gathered for that block's backward. The same blocks are checkpointed under DDP and on one
process.

- `blocks`: each block's `forward` runs under `torch.utils.checkpoint.checkpoint(use_reentrant=False,
  preserve_rng_state=True)`: the recomputation replays the RNG state the forward started from, so dropout
  draws the same masks and the gradients are those without checkpointing (tested bit-identical on CPU).
- `selective`: torchtitan's op-level selective checkpointing: inside each block the outputs of the matmul-like
  ops (mm, addmm, bmm, baddbmm, convolutions, scaled-dot-product attention) are saved and everything else
  (norms, activations, elementwise ops, dropout, with its RNG replayed) is recomputed
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`). Less memory saved than `blocks`, less
  recomputation.

A block is checkpointed by giving the instance a subclass of its class (named as its class; FSDP2 swaps
classes the same way) whose `forward` wraps the original one: parameter names, state dicts and checkpoints do
not change, and a copy of the module (EMA) stays checkpointed (harmless: no gradient there, the checkpoint is
skipped). A diffusers model's own gradient checkpointing (a cascade stage's `gradient_checkpointing: true`,
which checkpoints each resnet or transformer block inside diffusers) is turned off where the engine
checkpoints the part, so no block is checkpointed twice.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainer.engine.shard import fsdp_units
from trainer.errors import ConfigError

log = logging.getLogger("gentrain")

MODES = ("none", "blocks", "selective")

_aten = torch.ops.aten
# The ops whose outputs `selective` keeps (torchtitan's op-SAC list, plus convolutions: a UNet's matmuls).
SAVED_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(_aten, name)
)


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls)


_CLASSES: dict[tuple[type, str], type] = {}


def _checkpointed_class(cls: type, mode: str) -> type:
    """`cls` with its forward run under torch's checkpoint (one class per original class and mode)."""
    key = (cls, mode)
    if key not in _CLASSES:
        extra = {"context_fn": _selective_contexts} if mode == "selective" else {}
        original = cls.forward

        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled():  # sampling, validation, EMA: nothing to recompute
                return original(self, *args, **kwargs)
            return checkpoint(original, self, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

        _CLASSES[key] = type(
            cls.__name__, (cls,), {"forward": forward, "activation_checkpointing": mode, "__module__": cls.__module__}
        )
    return _CLASSES[key]


def checkpoint_blocks(module: nn.Module, mode: str) -> list[nn.Module]:
    """Checkpoint every block (FSDP unit) of `module` in place; returns the blocks (none: nothing done)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of {', '.join(MODES)}")
    units = fsdp_units(module) if mode != "none" else []
    for unit in units:
        if getattr(unit, "activation_checkpointing", None) is None:
            unit.__class__ = _checkpointed_class(type(unit), mode)
    return units


def checkpointed_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of `module` the engine checkpoints."""
    return [m for m in module.modules() if getattr(m, "activation_checkpointing", None) is not None]


def apply_to_blocks(
    modules: Mapping[str, nn.Module],
    learning: Collection[str],
    task: str,
    transform: Callable[[str, nn.Module], list[nn.Module]],
    *,
    setting: str,
    off: str,
    label: str,
    verb: str,
) -> dict[str, list[nn.Module]]:
    """`transform(name, part)` on every part this run trains that has blocks (FSDP units); returns the blocks
    per part and logs them under `label`. Exit 2 (ConfigError) naming `setting` and `off` when no part has
    any. Shared by activation checkpointing and regional compilation, which act on the same blocks."""
    done = {name: transform(name, modules[name]) for name in sorted(learning) if fsdp_units(modules[name])}
    if not done:
        raise ConfigError(
            f"{setting}: the {task} task's parts ({', '.join(sorted(learning))}) have no blocks to {verb} "
            f"(no ModuleList of layers); use {off}"
        )
    for name, units in done.items():
        classes = ", ".join(sorted({type(u).__name__ for u in units}))
        log.info("%s: %s, %d blocks (%s)", label, name, len(units), classes)
    rest = sorted(set(learning) - set(done))
    if rest:
        log.info("%s: %s left as they are (no blocks)", label, ", ".join(rest))
    return done


def apply_activation_checkpointing(
    modules: Mapping[str, nn.Module], learning: Collection[str], mode: str, task: str
) -> None:
    """Checkpoint the blocks of every part this run trains; exit 2 (ConfigError) when none has blocks."""
    if mode == "none":
        return

    def checkpoint_part(name: str, part: nn.Module) -> list[nn.Module]:
        for m in part.modules():  # diffusers' own (a cascade stage's gradient_checkpointing): replaced
            if getattr(m, "is_gradient_checkpointing", False) and hasattr(m, "disable_gradient_checkpointing"):
                m.disable_gradient_checkpointing()
                log.info(
                    "activation checkpointing: %s's own gradient checkpointing replaced by train.activation_"
                    "checkpointing=%s",
                    name,
                    mode,
                )
        return checkpoint_blocks(part, mode)

    apply_to_blocks(
        modules,
        learning,
        task,
        checkpoint_part,
        setting=f"train.activation_checkpointing={mode}",
        off="train.activation_checkpointing=none",
        label=f"activation checkpointing ({mode})",
        verb="checkpoint",
    )
