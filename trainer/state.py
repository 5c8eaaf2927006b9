"""Training state <-> checkpoint files: which file holds what, so the loop never needs to know."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trainer.checkpoint import CheckpointInfo, CheckpointStore, Payload, join_tensors, split_tensors
from trainer.optim import Part
from trainer.randomness import rng_state, set_rng_state

TRAINER_JSON = "trainer.json"


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


def capture_files(
    parts: Mapping[str, Part], progress: Mapping[str, Any], rank_states: list[dict]
) -> dict[str, Payload]:
    """Every file of a checkpoint. Tensors are the live ones: snapshot them before saving in the background."""
    files: dict[str, Payload] = {}
    part_meta: dict[str, Any] = {}
    for name, part in parts.items():
        files[model_file(name)] = dict(part.module.state_dict())
        if part.ema is not None:
            files[ema_file(name)] = part.ema_state_dict()
        opt_tensors, opt_skeleton = split_tensors(part.optimizer.state_dict())
        files[optimizer_file(name)] = opt_tensors
        part_meta[name] = {
            "step": part.step,
            "optimizer": opt_skeleton,
            "lr_schedule": _jsonable(part.lr_schedule.state_dict()),
            "scaler": _jsonable(part.scaler.state_dict()),
            "ema": part.ema_meta(),
        }
    doc = {"progress": dict(progress), "parts": part_meta}
    files[TRAINER_JSON] = json.dumps(doc, indent=1).encode()
    for rank, rs in enumerate(rank_states):
        tensor_name, json_name = rank_files(rank)
        files[tensor_name] = rs["tensors"]
        files[json_name] = json.dumps(rs["values"]).encode()
    return files


def restore(store: CheckpointStore, info: CheckpointInfo, parts: Mapping[str, Part], rank: int) -> dict[str, Any]:
    """Load a checkpoint into `parts` (sha256-verified) and return its progress dict.

    Raises CheckpointCorrupt if any file fails verification; nothing is
    applied to the parts until every shared file has been read and checked.
    """
    doc = store.read_json(info, TRAINER_JSON)
    loaded = {}
    for name, part in parts.items():
        if name not in doc["parts"]:
            raise KeyError(f"checkpoint {info.url} has no part {name!r} (it has {sorted(doc['parts'])})")
        meta = doc["parts"][name]
        model = store.read_tensors(info, model_file(name))
        ema = store.read_tensors(info, ema_file(name)) if (part.ema is not None and meta["ema"]) else None
        opt = join_tensors(meta["optimizer"], store.read_tensors(info, optimizer_file(name)))
        loaded[name] = (meta, model, ema, opt)
    for name, (meta, model, ema, opt) in loaded.items():
        part = parts[name]
        part.module.load_state_dict(model)
        part.optimizer.load_state_dict(opt)
        part.lr_schedule.load_state_dict(meta["lr_schedule"])
        if meta["scaler"]:
            part.scaler.load_state_dict(meta["scaler"])
        if ema is not None:
            part.load_ema(ema, meta["ema"])
        part.step = int(meta["step"])
    tensor_name, json_name = rank_files(rank)
    if tensor_name in info.manifest["files"]:
        values = store.read_json(info, json_name)
        set_rng_state(store.read_tensors(info, tensor_name), values["rng"])
    return doc["progress"]


def _jsonable(x: Any) -> Any:
    tensors, skeleton = split_tensors(x)
    if tensors:
        # Schedulers and scalers keep plain numbers; a tensor here means a new torch version.
        return join_tensors(skeleton, {k: v.item() if v.numel() == 1 else v.tolist() for k, v in tensors.items()})
    return skeleton
