"""Quantized optimizer state (torchao's 8-bit AdamW) <-> plain tensors plus a JSON description.

torchao keeps each of AdamW8bit's averages of a large parameter as an `OptimState8bit`: a tensor subclass
holding `codes` (uint8, the parameter's shape), `scale` (float32, one per block of `block_size` values)
and `qmap` (float32, the 256 values a code stands for), plus `signed` and the dtype it poses as. torch would
pickle the subclass; safetensors holds only plain tensors. So a saved state replaces each one by

    {"__quantized__": "OptimState8bit", "signed": true, "dtype": "F32", "codes": T, "scale": T, "qmap": T}

(T: the plain tensors, which `split_tensors` sends to safetensors like any other), and a load rebuilds the
subclass through its `__tensor_unflatten__` after checking every field. The kind is a name from the fixed
table below, never an import path: nothing read from storage chooses what code runs.

torchao quantizes only tensors of at least 4096 values whose size divides into its blocks (256 values);
smaller ones (biases, norms) stay plain float32 tensors and are saved as such.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from trainer.checkpoint.format import DTYPE_NAMES, SAFETENSORS_DTYPES
from trainer.errors import CheckpointCorrupt

MARK = "__quantized__"
_FIELDS = {MARK, "signed", "dtype", "codes", "scale", "qmap"}
# The dtypes a quantized state may pose as: those of a trainable parameter.
_POSES = {"F32", "BF16", "F16"}


def _subclasses() -> dict[str, type]:
    """The allow-list: kind name -> class. Empty until torchao's optimizers were imported (an adamw8bit
    part imports them when built), so a run without torchao never imports it here."""
    if "torchao.optim" not in sys.modules:
        return {}
    from torchao.optim.subclass_8bit import OptimState8bit

    return {"OptimState8bit": OptimState8bit}


def _kind_of(t: torch.Tensor) -> str | None:
    for name, cls in _subclasses().items():
        if type(t) is cls:
            return name
    return None


def flatten(optimizer_state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with every quantized state tensor replaced by its plain parts (see module)."""
    out = dict(optimizer_state)
    out["state"] = {
        idx: {k: _flat(v) for k, v in per_param.items()} for idx, per_param in optimizer_state["state"].items()
    }
    return out


def _flat(v: Any) -> Any:
    """A quantized state's description; anything else (plain tensors, FSDP2's DTensors) as it is."""
    kind = _kind_of(v) if isinstance(v, torch.Tensor) and type(v) is not torch.Tensor else None
    if kind is None:
        return v
    names, (signed, dtype) = v.__tensor_flatten__()
    return {MARK: kind, "signed": bool(signed), "dtype": DTYPE_NAMES[dtype], **{n: getattr(v, n) for n in names}}


def plain_tensors(v: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a state value (its codes, scale and qmap if quantized; else itself)."""
    if type(v) is torch.Tensor or _kind_of(v) is None:
        return [v]
    names, _ = v.__tensor_flatten__()
    return [getattr(v, n) for n in names]


def has_quantized(optimizer_state: Mapping[str, Any]) -> bool:
    state = optimizer_state.get("state")
    return isinstance(state, Mapping) and any(
        isinstance(v, Mapping) and MARK in v
        for per_param in state.values()
        if isinstance(per_param, Mapping)
        for v in per_param.values()
    )


def rebuild(
    optimizer_state: Mapping[str, Any], params: list[torch.Tensor], what: str, quantizes: bool = True
) -> dict[str, Any]:
    """The saved optimizer state with every quantized entry checked and rebuilt as its subclass.

    CheckpointCorrupt for an unknown kind, missing or extra fields, parts whose dtype or shape does not
    fit the parameter (codes shaped like it, a whole number of blocks, 256 map values), or any quantized
    entry at all when the live optimizer keeps none (`quantizes` False: torch's AdamW)."""
    state = optimizer_state.get("state")
    if not isinstance(state, Mapping) or not has_quantized(optimizer_state):
        return dict(optimizer_state)
    kinds = _subclasses() if quantizes else {}
    out = dict(optimizer_state)
    out["state"] = {}
    for idx, per_param in state.items():
        if not isinstance(idx, int) or not 0 <= idx < len(params) or not isinstance(per_param, Mapping):
            raise CheckpointCorrupt(f"{what}: optimizer state for parameter {idx!r}, the model has {len(params)}")
        out["state"][idx] = {
            k: _rebuilt(v, kinds, params[idx], f"{what}: optimizer {k} of parameter {idx}") if _marked(v) else v
            for k, v in per_param.items()
        }
    return out


def _marked(v: Any) -> bool:
    return isinstance(v, Mapping) and MARK in v


def _rebuilt(entry: Mapping[str, Any], kinds: Mapping[str, type], param: torch.Tensor, what: str) -> torch.Tensor:
    kind = entry.get(MARK)
    if set(entry) != _FIELDS:
        raise CheckpointCorrupt(f"{what}: quantized state has fields {sorted(entry)}, expected {sorted(_FIELDS)}")
    if kind not in kinds:
        known = ", ".join(kinds) or "none: this run's optimizer keeps no quantized state"
        raise CheckpointCorrupt(f"{what}: unknown quantized state kind {kind!r} (known: {known})")
    if not isinstance(entry["signed"], bool) or entry["dtype"] not in _POSES:
        raise CheckpointCorrupt(f"{what}: quantized state signed={entry['signed']!r} dtype={entry['dtype']!r}")
    codes, scale, qmap = entry["codes"], entry["scale"], entry["qmap"]
    if not all(type(t) is torch.Tensor for t in (codes, scale, qmap)):
        raise CheckpointCorrupt(f"{what}: quantized state's codes, scale and qmap must be tensors")
    shape = tuple(param.shape)
    if codes.dtype != torch.uint8 or tuple(codes.shape) != shape:
        raise CheckpointCorrupt(
            f"{what}: codes are {codes.dtype} {list(codes.shape)}, expected torch.uint8 {list(shape)}"
        )
    if scale.dtype != torch.float32 or scale.ndim != 1 or scale.numel() == 0 or codes.numel() % scale.numel() != 0:
        raise CheckpointCorrupt(
            f"{what}: scale is {scale.dtype} {list(scale.shape)}, expected float32 with one value per block "
            f"of the {codes.numel()} codes"
        )
    if qmap.dtype != torch.float32 or tuple(qmap.shape) != (256,):
        raise CheckpointCorrupt(f"{what}: qmap is {qmap.dtype} {list(qmap.shape)}, expected float32 [256]")
    dtype = SAFETENSORS_DTYPES[entry["dtype"]]
    return kinds[kind].__tensor_unflatten__(
        {"codes": codes, "scale": scale, "qmap": qmap}, [entry["signed"], dtype], None, None
    )
