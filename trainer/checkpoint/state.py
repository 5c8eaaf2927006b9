"""What is saved, in which file: training state objects <-> checkpoint files.

    trainer.json                 progress, per-part JSON state (step, optimizer skeleton,
                                 schedule, scaler, EMA settings), frozen sources
    <part>.model.safetensors     online weights
    <part>.ema.safetensors       EMA weights only (never the online ones)
    <part>.optimizer.safetensors optimizer tensors (the skeleton is in trainer.json)
    rank-NNNNN.safetensors/.json each rank's global RNG state

Sharded (FSDP) checkpoints split each `<part>.<kind>` into per-rank files
plus an index (see trainer.checkpoint.sharded); each rank writes its own
slices and its own RNG state, and restores read only the slices a rank
needs, at any world size and into DDP or FSDP parts alike.

Every object handed in here has `state_dict()` / `load_state_dict()`; this
module only decides the files. Frozen parts are not saved: their source
(URL, step, file, digest) is recorded instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from trainer.checkpoint.format import join_tensors, split_tensors
from trainer.checkpoint.sharded import ShardIndex, group_name, is_sharded, load_group, local_slices
from trainer.checkpoint.store import CheckpointInfo, CheckpointStore, Payload
from trainer.checkpoint.writer import storage_key
from trainer.randomness import rng_state, set_rng_state

TRAINER_JSON = "trainer.json"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def model_file(part: str) -> str:
    return f"{part}.model.safetensors"


def ema_file(part: str) -> str:
    return f"{part}.ema.safetensors"


def optimizer_file(part: str) -> str:
    return f"{part}.optimizer.safetensors"


def rank_files(rank: int) -> tuple[str, str]:
    return f"rank-{rank:05d}.safetensors", f"rank-{rank:05d}.json"


def capture_rank_state() -> dict[str, Any]:
    """This rank's own state (global RNG streams); small, gathered to rank 0 at save time."""
    tensors, values = rng_state()
    return {"tensors": tensors, "values": {"rng": values}}


def _part_meta(state: Mapping[str, Any], opt_skeleton: Any) -> dict[str, Any]:
    return {
        "step": state["step"],
        "optimizer": opt_skeleton,
        "lr_schedule": _jsonable(state["lr_schedule"]),
        "scaler": _jsonable(state["scaler"]),
        "ema": state["ema_meta"],
    }


def _trainer_json(progress: Stateful, part_meta: Mapping[str, Any], frozen: Mapping[str, Any]) -> bytes:
    doc = {"progress": progress.state_dict(), "parts": dict(part_meta), "frozen": dict(frozen)}
    return json.dumps(doc, indent=1).encode()


def snapshot_files(
    progress: Stateful,
    parts: Mapping[str, Stateful],
    rank_states: list[dict],
    frozen: Mapping[str, dict[str, Any]],
) -> dict[str, Payload]:
    """Every file of a checkpoint. Tensors are the live ones: snapshot them before saving in the background."""
    files: dict[str, Payload] = {}
    part_meta: dict[str, Any] = {}
    for name, part in parts.items():
        state = part.state_dict()
        files[model_file(name)] = state["model"]
        if state["ema"] is not None:
            files[ema_file(name)] = state["ema"]
        opt_tensors, opt_skeleton = split_tensors(state["optimizer"])
        files[optimizer_file(name)] = opt_tensors
        part_meta[name] = _part_meta(state, opt_skeleton)
    files[TRAINER_JSON] = _trainer_json(progress, part_meta, frozen)
    for rank, rs in enumerate(rank_states):
        tensor_name, json_name = rank_files(rank)
        files[tensor_name] = rs["tensors"]
        files[json_name] = json.dumps(rs["values"]).encode()
    return files


def sharded_snapshot_files(
    progress: Stateful, parts: Mapping[str, Stateful], frozen: Mapping[str, dict[str, Any]], rank: int
) -> tuple[dict[str, Payload], dict[str, Any]]:
    """This rank's files of a sharded checkpoint (its slices, its RNG state; rank 0 also trainer.json) and
    its part of the shard index. Tensors are the live local shards: snapshot them before a background save."""
    files: dict[str, Payload] = {}
    index: dict[str, Any] = {}
    part_meta: dict[str, Any] = {}
    for name, part in parts.items():
        state = part.state_dict()
        opt_tensors, opt_skeleton = split_tensors(state["optimizer"])
        groups = {"model": state["model"], "ema": state["ema"], "optimizer": opt_tensors}
        for kind, tensors in groups.items():
            if tensors is not None:
                group_files, group_index = local_slices(group_name(name, kind), tensors, rank)
                files.update(group_files)
                index.update(group_index)
        part_meta[name] = _part_meta(state, opt_skeleton)
    if rank == 0:
        files[TRAINER_JSON] = _trainer_json(progress, part_meta, frozen)
    rs = capture_rank_state()
    tensor_name, json_name = rank_files(rank)
    files[tensor_name] = rs["tensors"]
    files[json_name] = json.dumps(rs["values"]).encode()
    return files, index


def updated_only_in_steps(parts: Mapping[str, Any]) -> Callable[[torch.Tensor], bool]:
    """True for a tensor that only changes when a part updates (its parameters, optimizer state and EMA
    weights: an optimizer step, an EMA update or swap, a load), so a background save may copy it while
    the next forward and backward run. Buffers and everything else are copied at once: they may change
    in forward (a VQ codebook's EMA and dead-code replacement, BatchNorm statistics, usage rings)."""
    keys = {storage_key(t) for part in parts.values() for t in part.stable_tensors()}
    return lambda t: storage_key(t) in keys


def read_frozen_records(store: CheckpointStore, info: CheckpointInfo) -> dict[str, dict[str, Any]]:
    return store.read_json(info, TRAINER_JSON).get("frozen", {})


def restore(
    store: CheckpointStore, info: CheckpointInfo, progress: Stateful, parts: Mapping[str, Any], rank: int
) -> dict[str, Any]:
    """Load a checkpoint into `progress` and `parts` (digest-verified); returns trainer.json.

    Raises CheckpointCorrupt if any file fails verification; nothing is applied
    until every file this rank needs has been read and checked. A sharded
    checkpoint, or a sharded part, goes through the chunk reader: this rank
    reads only its slices, whatever the world size at save time.
    """
    doc = store.read_json(info, TRAINER_JSON)
    files = info.manifest["files"]
    index = ShardIndex(store, info) if is_sharded(info) or any(p.sharded for p in parts.values()) else None
    states = {}
    for name, part in parts.items():
        if name not in doc["parts"]:
            raise KeyError(f"checkpoint {info.url} has no part {name!r} (it has {sorted(doc['parts'])})")
        meta = doc["parts"][name]
        if index is not None:
            states[name] = _read_part_slices(index, name, part, meta)
            continue
        states[name] = {
            "model": store.read_tensors(info, model_file(name)),
            "ema": store.read_tensors(info, ema_file(name)) if ema_file(name) in files and meta["ema"] else None,
            "optimizer": join_tensors(meta["optimizer"], store.read_tensors(info, optimizer_file(name))),
            "lr_schedule": meta["lr_schedule"],
            "scaler": meta["scaler"],
            "ema_meta": meta["ema"],
            "step": meta["step"],
        }
    tensor_name, json_name = rank_files(rank)
    rng = None
    if tensor_name in files:
        rng = (store.read_tensors(info, tensor_name), store.read_json(info, json_name)["rng"])
    for name, state in states.items():
        parts[name].load_state_dict(state)
    progress.load_state_dict(doc["progress"])
    if rng is not None:
        set_rng_state(*rng)
    return doc


def _read_part_slices(index: ShardIndex, name: str, part: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    """A part's state from either layout, shaped like the live part: DTensor slices for a sharded part."""
    model_targets = dict(part.module.state_dict())
    model = load_group(index, group_name(name, "model"), model_targets)
    ema = None
    if part.ema is not None and meta["ema"] and index.has(group_name(name, "ema")):
        ema = load_group(index, group_name(name, "ema"), part.ema_weights())
    # Optimizer state is keyed by parameter index; each tensor is shaped like its parameter (and sharded
    # like it) or is a small replicated value (a step count).
    params = part.optimizer_params()
    opt_group = group_name(name, "optimizer")
    opt_targets = {}
    for index_key, per_param in meta["optimizer"].get("state", {}).items():
        param = params[int(index_key.removeprefix("__int__"))]
        for value in per_param.values():
            if isinstance(value, dict) and "__tensor__" in value:
                key = value["__tensor__"]
                saved = index.group(opt_group)[key] if key in index.group(opt_group) else None
                if saved is not None and list(saved["shape"]) == list(param.shape):
                    opt_targets[key] = param
                elif saved is not None:
                    opt_targets[key] = torch.empty(saved["shape"], dtype=_saved_dtype(saved))
                else:
                    raise KeyError(f"{index.info.url}: {opt_group} has no tensor {key!r}")
    optimizer = load_group(index, opt_group, opt_targets) if opt_targets else {}
    return {
        "model": model,
        "ema": ema,
        "optimizer": join_tensors(meta["optimizer"], optimizer),
        "lr_schedule": meta["lr_schedule"],
        "scaler": meta["scaler"],
        "ema_meta": meta["ema"],
        "step": meta["step"],
    }


def _saved_dtype(entry: Mapping[str, Any]) -> torch.dtype:
    from trainer.checkpoint.format import _DTYPES

    return {v: k for k, v in _DTYPES.items()}[entry["dtype"]]


def _jsonable(x: Any) -> Any:
    tensors, skeleton = split_tensors(x)
    if tensors:
        # Schedulers and scalers keep plain numbers; a tensor here means a new torch version.
        return join_tensors(skeleton, {k: v.item() if v.numel() == 1 else v.tolist() for k, v in tensors.items()})
    return skeleton
