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
(URL, step, file, digest) is recorded instead. Nor is a LoRA part's frozen base
(`Part.saved_keys`): its files hold the adapters, their optimizer state and EMA,
trainer.json says `"weights": "trainable"` for the part, and the base is the
pretrained folder the manifest's inputs pin (`<part>.pretrained`, a pipeline's
`pipeline`), rebuilt from it by every resume, sample and export.
"""

from __future__ import annotations

import copy
import json
import math
import types
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from trainer.checkpoint import quantized
from trainer.checkpoint.format import join_tensors, split_tensors, torch_dtype
from trainer.checkpoint.layout import TRAINER_JSON, ema_file, group_name, model_file, optimizer_file, rank_files
from trainer.checkpoint.sharded import ShardIndex, is_sharded, load_group, local_slices
from trainer.checkpoint.store import CheckpointInfo, CheckpointStore, Payload
from trainer.checkpoint.validity import (
    FrozenRecord,
    IndexedTensor,
    PartState,
    TrainerState,
    check_rank_tensors,
    tensor_refs,
    trainer_json,
)
from trainer.checkpoint.writer import storage_key
from trainer.errors import CheckpointCorrupt, ConfigError
from trainer.randomness import rng_state, set_rng_state


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def capture_rank_state() -> dict[str, Any]:
    """This rank's own state (global RNG streams); small, gathered to rank 0 at save time."""
    tensors, values = rng_state()
    return {"tensors": tensors, "values": {"rng": values}}


def _part_meta(state: Mapping[str, Any], opt_skeleton: Any) -> PartState:
    # "weights": "trainable" only when the base is left out (first, where it has always been written): a whole
    # part's entry is as it always was.
    adapters = {"weights": "trainable"} if state.get("weights") == "trainable" else {}
    return PartState(
        **adapters,
        step=state["step"],
        optimizer=opt_skeleton,
        optimizer_name=state["optimizer_name"],
        lr_schedule=_jsonable(state["lr_schedule"]),
        scaler=_jsonable(state["scaler"]),
        ema=state["ema_meta"],
    )


def _trainer_json(progress: Stateful, part_meta: Mapping[str, PartState], frozen: Mapping[str, FrozenRecord]) -> bytes:
    """trainer.json as a `TrainerState` (validity.trainer_json): the progress, the parts' states, frozen records."""
    return trainer_json(progress.state_dict(), part_meta, frozen)


def snapshot_files(
    progress: Stateful,
    parts: Mapping[str, Stateful],
    rank_states: list[dict],
    frozen: Mapping[str, FrozenRecord],
) -> dict[str, Payload]:
    """Every file of a checkpoint. Tensors are the live ones: snapshot them before saving in the background."""
    files: dict[str, Payload] = {}
    part_meta: dict[str, PartState] = {}
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
    progress: Stateful, parts: Mapping[str, Stateful], frozen: Mapping[str, FrozenRecord], rank: int
) -> tuple[dict[str, Payload], dict[str, Any]]:
    """This rank's files of a sharded checkpoint (its slices, its RNG state; rank 0 also trainer.json) and
    its part of the shard index. Tensors are the live local shards: snapshot them before a background save."""
    files: dict[str, Payload] = {}
    index: dict[str, Any] = {}
    part_meta: dict[str, PartState] = {}
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


def read_frozen_records(store: CheckpointStore, info: CheckpointInfo) -> dict[str, FrozenRecord]:
    """The frozen parts' records trainer.json pins (schema-checked when it was read)."""
    return dict(store.read_json(info, TRAINER_JSON).frozen)


class LoadedState:
    """A checkpoint read into memory and checked against the live objects, not yet applied.

    `apply()` loads it into progress, parts and RNG; until then nothing live has changed, so a
    checkpoint that fails on any rank (or in the check of files no rank read) applies nothing anywhere.
    """

    def __init__(self, doc: TrainerState, states, rng, progress, parts):
        self.doc, self._states, self._rng = doc, states, rng
        self._progress, self._parts = progress, parts

    @property
    def frozen(self) -> dict[str, FrozenRecord]:
        """The frozen parts' records its trainer.json pins."""
        return dict(self.doc.frozen)

    def apply(self) -> TrainerState:
        # Progress first: the one refusal left at this point is its own (a changed data order, a config
        # error that ends the run), and it comes before anything else is applied. Everything after it was
        # tried on scratch objects when it was read (read_state), so nothing fails half-way.
        self._progress.load_state_dict(self.doc.progress.model_dump(exclude_unset=True))
        if self._rng is not None:
            set_rng_state(*self._rng)
        for name, state in self._states.items():
            self._parts[name].load_state_dict(state)
        return self.doc


def read_state(
    store: CheckpointStore, info: CheckpointInfo, progress: Stateful, parts: Mapping[str, Any], rank: int
) -> LoadedState:
    """Read and check everything this rank needs from a checkpoint; apply nothing.

    Raises CheckpointCorrupt if any file fails its digest or structure, or if the saved state does not
    fit the live parts (shapes of weights, EMA and optimizer state; schedule keys). A sharded
    checkpoint, or a sharded part, goes through the chunk reader: this rank reads only its slices,
    whatever the world size at save time.
    """
    doc: TrainerState = store.read_json(info, TRAINER_JSON)  # parsed and checked (trainer.checkpoint.validity)
    files = info.manifest.files
    index = ShardIndex(store, info) if is_sharded(info) or any(p.sharded for p in parts.values()) else None
    states = {}
    for name, part in parts.items():
        if name not in doc.parts:
            raise CheckpointCorrupt(f"checkpoint {info.url} has no part {name!r} (it has {sorted(doc.parts)})")
        meta = doc.parts[name]
        check_optimizer_name(meta, part, f"checkpoint {info.url}")
        if index is not None:
            states[name] = _read_part_slices(index, name, part, meta)
        else:
            opt_tensors = store.read_tensors(info, optimizer_file(name))
            missing = tensor_refs(meta.optimizer) - set(opt_tensors)
            if missing:
                raise CheckpointCorrupt(f"{info.url}/{optimizer_file(name)} lacks tensors {sorted(missing)[:3]}")
            states[name] = {
                "model": store.read_tensors(info, model_file(name)),
                "ema": store.read_tensors(info, ema_file(name)) if ema_file(name) in files and meta.ema else None,
                "optimizer": quantized.rebuild(
                    join_tensors(meta.optimizer, opt_tensors),
                    part.optimizer_params(),
                    f"{info.url}: part {name!r}",
                    quantizes=part.settings.optimizer == "adamw8bit",
                ),
                "optimizer_name": meta.optimizer_name or "adamw",
                "lr_schedule": meta.lr_schedule,
                "scaler": meta.scaler,
                "ema_meta": meta.ema,
                "step": meta.step,
            }
        check_fits(part, states[name], f"{info.url}: part {name!r}")
        check_settings_load(part, states[name], f"{info.url}: part {name!r}")
    tensor_name, json_name = rank_files(rank)
    rng = None
    if tensor_name in files:
        tensors = store.read_tensors(info, tensor_name)
        check_rank_tensors(tensors, f"{info.url}/{tensor_name}")  # set on scratch generators: apply cannot fail
        rng = (tensors, store.read_json(info, json_name)["rng"])  # the values likewise (parse_rank_json)
    return LoadedState(doc, states, rng, progress, parts)


def restore(
    store: CheckpointStore, info: CheckpointInfo, progress: Stateful, parts: Mapping[str, Any], rank: int
) -> TrainerState:
    """Load a checkpoint into `progress` and `parts` (digest- and structure-checked); returns its trainer.json.
    Nothing is applied unless everything this rank needs was read and checked."""
    return read_state(store, info, progress, parts, rank).apply()


def check_optimizer_name(meta: PartState, part: Any, what: str) -> None:
    """The saved part's optimizer is the one this run built (checkpoints from before `train.optimizer`
    were all adamw). Their states differ in kind (float32 averages vs 8-bit codes and scales, a float lr vs
    torchao's lr tensor), and converting one into the other would not continue the same run: a config
    error (exit 2), not a corrupt checkpoint, since an older checkpoint of the same run would not help."""
    saved = meta.optimizer_name or "adamw"
    live = part.settings.optimizer
    if saved != live:
        raise ConfigError(
            f"{what}: part {part.name!r} was trained with optimizer {saved}, this run builds {live}. Resume it "
            f"with train.optimizer={saved} (or optim.{part.name}.name={saved}), or start a new run "
            "(another checkpoint.url, or checkpoint.resume=false)"
        )


def check_fits(part: Any, state: Mapping[str, Any], what: str) -> None:
    """Saved state that does not fit the live part is a corrupt checkpoint (or another model's): say which
    tensor, before anything is applied. torch checks a module's weights on load, but an EMA or optimizer
    tensor of the wrong shape would load and fail only at the next update."""
    live = dict(part.module.state_dict())
    saved = set(state["model"])
    # A LoRA part loads its adapters alone (`Part.saved_keys`) or, from a checkpoint written before
    # adapter-only checkpoints, the whole module; nothing in between.
    adapters = getattr(part, "saved_keys", None)
    if saved != set(live) and saved != adapters:
        want = set(live) if adapters is None else adapters
        extra, missing = sorted(saved - want), sorted(want - saved)
        raise CheckpointCorrupt(f"{what}: weights do not match the model (missing {missing[:3]}, extra {extra[:3]})")
    for key, t in state["model"].items():
        if tuple(t.shape) != tuple(live[key].shape):
            raise CheckpointCorrupt(
                f"{what}: model weight {key} has shape {list(t.shape)}, the model's is {list(live[key].shape)}"
            )
    if part.ema is not None and state.get("ema") is not None and state.get("ema_meta"):
        for key, p in part.module.named_parameters():
            if key not in saved:  # a frozen base parameter of an adapter-only state: its EMA is itself
                continue
            t = state["ema"].get(key)
            if t is None or tuple(t.shape) != tuple(p.shape):
                found = "missing" if t is None else f"shape {list(t.shape)}"
                raise CheckpointCorrupt(f"{what}: EMA weight {key} is {found}, the model's is {list(p.shape)}")
    params = part.optimizer_params()
    opt = state["optimizer"]
    if not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
        raise CheckpointCorrupt(f"{what}: optimizer state lacks 'state' or 'param_groups'")
    for idx, per_param in opt["state"].items():
        if not isinstance(idx, int) or not 0 <= idx < len(params) or not isinstance(per_param, dict):
            raise CheckpointCorrupt(f"{what}: optimizer state for parameter {idx!r}, the model has {len(params)}")
        for k, v in per_param.items():
            if isinstance(v, torch.Tensor) and v.numel() != 1 and tuple(v.shape) != tuple(params[idx].shape):
                raise CheckpointCorrupt(
                    f"{what}: optimizer {k} of parameter {idx} has shape {list(v.shape)}, "
                    f"the parameter's is {list(params[idx].shape)}"
                )
    live_groups = part.optimizer.param_groups
    groups = opt["param_groups"]
    if len(groups) != len(live_groups) or any(
        not isinstance(g, dict) or not isinstance(g.get("params"), list) or len(g["params"]) != len(live["params"])
        for g, live in zip(groups, live_groups, strict=False)
    ):
        raise CheckpointCorrupt(f"{what}: optimizer parameter groups do not match the model's")
    _check_like(state.get("lr_schedule"), part.lr_schedule.state_dict(), f"{what}: learning-rate schedule")
    if state.get("scaler"):
        _check_like(state["scaler"], part.scaler.state_dict(), f"{what}: loss scaler")
    if part.ema is not None and state.get("ema_meta"):
        live_meta = {k: v for k, v in part.ema.state_dict().items() if k != "shadow_params"}
        _check_like(state["ema_meta"], live_meta, f"{what}: EMA settings")


def check_settings_load(part: Any, state: Mapping[str, Any], what: str) -> None:
    """The saved schedule loads into this part's: it is loaded into a shallow copy of the live schedule (its
    own attribute dict, stand-ins for the lambdas), so a state with more lambdas than the part has groups
    fails here, before anything is applied. The loaders' own refusals (EMA, scaler, schedule) were found
    when trainer.json was parsed (trainer.checkpoint.validity)."""
    saved = state.get("lr_schedule")
    if saved is None:
        return
    try:
        _scratch_schedule(part.lr_schedule).load_state_dict(dict(saved))
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        raise CheckpointCorrupt(
            f"{what}: its learning-rate schedule cannot be loaded ({type(e).__name__}: {e})"[:300]
        ) from None


def _scratch_schedule(live: Any) -> Any:
    """A copy of a schedule that shares nothing a `load_state_dict` writes to: its own attribute dict, and
    stand-ins for LambdaLR's lambdas (whose `__dict__` a saved state updates)."""
    scratch = copy.copy(live)
    if hasattr(live, "lr_lambdas"):
        scratch.lr_lambdas = [types.SimpleNamespace() for _ in live.lr_lambdas]
    return scratch


def _check_like(saved: Any, live: Mapping[str, Any], what: str) -> None:
    """Saved JSON state of a torch/diffusers object has only keys the live object has, each of its type
    (an int where a float is expected is fine): loading it then cannot fail half-way or set attributes."""
    if saved is None:
        return
    if not isinstance(saved, dict):
        raise CheckpointCorrupt(f"{what} state is a {type(saved).__name__}, not an object")
    for k, v in saved.items():
        if k not in live:
            raise CheckpointCorrupt(f"{what} state has an unknown entry {k!r}")
        want = live[k]
        same = type(v) is type(want) or (isinstance(want, float) and type(v) is int) or want is None
        if not same:
            raise CheckpointCorrupt(f"{what} state: {k} is a {type(v).__name__}, expected {type(want).__name__}")


def _read_part_slices(index: ShardIndex, name: str, part: Any, meta: PartState) -> dict[str, Any]:
    """A part's state from either layout, shaped like the live part: DTensor slices for a sharded part."""
    model_targets = dict(part.module.state_dict())
    adapters = getattr(part, "saved_keys", None)
    group = group_name(name, "model")
    if adapters is not None and not (index.has(group) and set(model_targets) <= set(index.group(group))):
        model_targets = {k: v for k, v in model_targets.items() if k in adapters}  # adapter-only (Part.saved_keys)
    model = load_group(index, group, model_targets)
    ema = None
    if part.ema is not None and meta.ema and index.has(group_name(name, "ema")):
        ema_targets = {k: v for k, v in part.ema_weights().items() if k in model_targets}
        ema = load_group(index, group_name(name, "ema"), ema_targets)
    # Optimizer state is keyed by parameter index; each tensor is shaped like its parameter (and sharded
    # like it) or is a small replicated value (a step count).
    params = part.optimizer_params()
    opt_group = group_name(name, "optimizer")
    opt_targets = {}
    per_params = meta.optimizer.get("state", {})
    if not isinstance(per_params, dict):
        raise CheckpointCorrupt(f"{index.info.url}: {opt_group} state is not keyed by parameter")
    for index_key, per_param in per_params.items():
        i = index_key.removeprefix("__int__")
        if not i.isdigit() or int(i) >= len(params) or not isinstance(per_param, dict):
            raise CheckpointCorrupt(f"{index.info.url}: {opt_group} has state for parameter {i!r} of {len(params)}")
        param = params[int(i)]
        for value in per_param.values():
            if isinstance(value, dict) and "__tensor__" in value:
                key = value["__tensor__"]
                saved = index.group(opt_group)[key] if key in index.group(opt_group) else None
                if saved is not None and saved.shape == list(param.shape):
                    opt_targets[key] = param
                elif saved is not None and math.prod(saved.shape) <= 1:  # a step count
                    opt_targets[key] = torch.empty(saved.shape, dtype=_saved_dtype(saved))
                elif saved is not None:
                    raise CheckpointCorrupt(
                        f"{index.info.url}: {opt_group}:{key} has shape {saved.shape}, its parameter's is "
                        f"{list(param.shape)}"
                    )
                else:
                    raise CheckpointCorrupt(f"{index.info.url}: {opt_group} has no tensor {key!r}")
    optimizer = load_group(index, opt_group, opt_targets) if opt_targets else {}
    return {
        "model": model,
        "ema": ema,
        "optimizer": join_tensors(meta.optimizer, optimizer),
        "lr_schedule": meta.lr_schedule,
        "scaler": meta.scaler,
        "ema_meta": meta.ema,
        "step": meta.step,
    }


def _saved_dtype(entry: IndexedTensor) -> torch.dtype:
    try:
        return torch_dtype(entry.dtype)
    except ValueError as e:
        raise CheckpointCorrupt(str(e)) from None


def _jsonable(x: Any) -> Any:
    tensors, skeleton = split_tensors(x)
    if tensors:
        # Schedulers and scalers keep plain numbers; a tensor here means a new torch version.
        return join_tensors(skeleton, {k: v.item() if v.numel() == 1 else v.tolist() for k, v in tensors.items()})
    return skeleton
