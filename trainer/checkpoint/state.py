"""What is saved, in which file: training state objects <-> checkpoint files.

    trainer.json                 progress, per-part JSON state (step, optimizer skeleton,
                                 schedule, scaler, EMA settings), frozen sources
    <part>.model.safetensors     online weights
    <part>.ema.safetensors       EMA weights only (never the online ones)
    <part>.optimizer.safetensors optimizer tensors (the skeleton is in trainer.json)
    rank-NNNNN.safetensors/.json each rank's global RNG state

Every object handed in here has `state_dict()` / `load_state_dict()`; this
module only decides the files. Frozen parts are not saved: their source
(URL, step, file, digest) is recorded instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from trainer.checkpoint.format import join_tensors, split_tensors
from trainer.checkpoint.store import CheckpointInfo, CheckpointStore, Payload
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
        part_meta[name] = {
            "step": state["step"],
            "optimizer": opt_skeleton,
            "lr_schedule": _jsonable(state["lr_schedule"]),
            "scaler": _jsonable(state["scaler"]),
            "ema": state["ema_meta"],
        }
    doc = {"progress": progress.state_dict(), "parts": part_meta, "frozen": dict(frozen)}
    files[TRAINER_JSON] = json.dumps(doc, indent=1).encode()
    for rank, rs in enumerate(rank_states):
        tensor_name, json_name = rank_files(rank)
        files[tensor_name] = rs["tensors"]
        files[json_name] = json.dumps(rs["values"]).encode()
    return files


def read_frozen_records(store: CheckpointStore, info: CheckpointInfo) -> dict[str, dict[str, Any]]:
    return store.read_json(info, TRAINER_JSON).get("frozen", {})


def restore(
    store: CheckpointStore, info: CheckpointInfo, progress: Stateful, parts: Mapping[str, Stateful], rank: int
) -> dict[str, Any]:
    """Load a checkpoint into `progress` and `parts` (digest-verified); returns trainer.json.

    Raises CheckpointCorrupt if any file fails verification; nothing is applied
    until every shared file has been read and checked.
    """
    doc = store.read_json(info, TRAINER_JSON)
    files = info.manifest["files"]
    states = {}
    for name in parts:
        if name not in doc["parts"]:
            raise KeyError(f"checkpoint {info.url} has no part {name!r} (it has {sorted(doc['parts'])})")
        meta = doc["parts"][name]
        states[name] = {
            "model": store.read_tensors(info, model_file(name)),
            "ema": store.read_tensors(info, ema_file(name)) if ema_file(name) in files and meta["ema"] else None,
            "optimizer": join_tensors(meta["optimizer"], store.read_tensors(info, optimizer_file(name))),
            "lr_schedule": meta["lr_schedule"],
            "scaler": meta["scaler"],
            "ema_meta": meta["ema"],
            "step": meta["step"],
        }
    for name, state in states.items():
        parts[name].load_state_dict(state)
    progress.load_state_dict(doc["progress"])
    tensor_name, json_name = rank_files(rank)
    if tensor_name in files:
        values = store.read_json(info, json_name)
        set_rng_state(store.read_tensors(info, tensor_name), values["rng"])
    return doc


def _jsonable(x: Any) -> Any:
    tensors, skeleton = split_tensors(x)
    if tensors:
        # Schedulers and scalers keep plain numbers; a tensor here means a new torch version.
        return join_tensors(skeleton, {k: v.item() if v.numel() == 1 else v.tolist() for k, v in tensors.items()})
    return skeleton
