"""Load one part's weights from any run's checkpoint: for sampling, and for frozen parts.

A frozen part (a MaskGIT's tokenizer) is pinned: the first start records the
checkpoint it came from (URL, step, file, digest) in every checkpoint of the
new run, and every resume must get weights with that digest again. If the
source run has moved on, the pinned step is used; if that step is gone or
its file changed, the resume is refused (exit 2) rather than silently
training on different frozen weights.
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Mapping
from typing import Any

import fsspec
import torch

from trainer.checkpoint.format import entry_digest, new_digest, torch_dtype
from trainer.checkpoint.layout import (
    TRAINER_JSON,
    group_name,
    parse_group,
    parse_step_dir,
    parts_with_weights,
    whole_file,
)
from trainer.checkpoint.sharded import ShardIndex, files_of_group, load_group
from trainer.checkpoint.store import CheckpointInfo, CheckpointStore, resolve_checkpoint
from trainer.conditioning.text import check_stored_encoders
from trainer.config import Config
from trainer.config.redact import redact
from trainer.data import is_video
from trainer.errors import CheckpointCorrupt, CheckpointError, ConfigError
from trainer.models.finetune import CONFIG_NAME, WEIGHTS_NAME, read_folder
from trainer.registry import check_stored_task, config_from_dict, task_class
from trainer.tasks.base import FrozenSource, FrozenWeights, TaskContext

log = logging.getLogger(__name__)


def file_digest(info: CheckpointInfo, name: str) -> str:
    """The digest of a part's weights as `algorithm:hex`: the manifest's for a single file (`unet.ema.safetensors`);
    for the shards of a sharded checkpoint (`unet.ema`), a blake3 over their names and digests."""
    files = info.manifest["files"]
    if name in files:
        algorithm, hexdigest = entry_digest(files[name])
        return f"{algorithm}:{hexdigest}"
    parsed = parse_group(name)
    shards = files_of_group(info, parsed.group) if parsed is not None else []
    if not shards:
        raise KeyError(f"{info.url}: manifest has no file or shards {name!r}")
    h = new_digest("blake3")
    for shard in shards:
        algorithm, hexdigest = entry_digest(files[shard])
        h.update(f"{shard} {algorithm}:{hexdigest}\n".encode())
    return f"blake3-shards:{h.hexdigest()}"


def weights_file(info: CheckpointInfo, part: str, use_ema: bool) -> str:
    """The weights of `part`: a file name (`unet.ema.safetensors`) or, sharded, its group (`unet.ema`)."""
    present = {}
    for kind in ("model", "ema"):
        group = group_name(part, kind)
        shards = files_of_group(info, group)
        if shards:
            present[kind] = shards[0] if shards == [whole_file(group)] else group
    if "model" not in present:
        parts = parts_with_weights(info.manifest["files"])
        raise ConfigError(f"{info.url} has no part {part!r} (its parts: {', '.join(parts) or 'none'})")
    return present["ema"] if use_ema and "ema" in present else present["model"]


def read_weights(store: CheckpointStore, info: CheckpointInfo, name: str) -> dict[str, torch.Tensor]:
    """Whole tensors of one weights file, or assembled from the shards of a sharded checkpoint."""
    if name in info.manifest["files"]:
        return store.read_tensors(info, name)
    index = ShardIndex(store, info)
    entries = index.group(name)
    targets = {k: torch.empty(e["shape"], dtype=torch_dtype(e["dtype"])) for k, e in entries.items()}
    return load_group(index, name, targets)


def _kind(name: str) -> str | None:
    """ "model" or "ema" for a weights file or group name that weights_file gave."""
    parsed = parse_group(name)
    return parsed.kind if parsed is not None else None


def config_of(info: CheckpointInfo, task: str | None = None, flag: str | None = "--task") -> Any:
    """The resolved config of a checkpoint's manifest; its task is imported only if it is a built-in or the
    user named the same one (`task`, given with `flag`; see `trainer.registry.check_stored_task`).

    The manifest is whatever the store holds: anyone who can write there chooses it, so it must never
    choose which code runs. Its storage options are redacted (see `trainer.config.redact`): callers use
    the user's own.
    """
    tree = info.manifest.get("config")
    if not isinstance(tree, dict):
        raise ConfigError(f"checkpoint {info.url}: its manifest holds no config (a mapping) to build the model from")
    stored = tree.get("task", Config.model_fields["task"].default)
    check_stored_task(stored, task, f"checkpoint {info.url}", flag)
    try:
        return config_from_dict(tree)
    except ConfigError as e:  # the store's config, not the user's: a checkpoint that cannot be used (exit 1)
        raise CheckpointCorrupt(f"checkpoint {info.url}: the config in its manifest is not valid: {e}") from None


def _load(store: CheckpointStore, info: CheckpointInfo, source: FrozenSource) -> FrozenWeights:
    name = weights_file(info, source.part, source.use_ema)
    record = {"url": info.url, "step": info.step, "file": name, "digest": file_digest(info, name)}
    # A frozen part's source run is named by a URL, not by the user's config: only built-in tasks.
    config = config_of(info, flag=None)
    return FrozenWeights(config, read_weights(store, info, name), record)


def _resolve(url: str, storage_options: Mapping[str, Any]) -> tuple[CheckpointStore, CheckpointInfo | None]:
    try:
        store, info = resolve_checkpoint(url, storage_options)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot open checkpoint URL {url!r}: {e}") from None
    return store, info if info is not None and info.valid else None


def _is_folder(url: str, storage_options: Mapping[str, Any]) -> bool:
    """Whether `url` is a diffusers save_pretrained folder (it holds config.json), not a run's checkpoints."""
    try:
        fs, root = fsspec.core.url_to_fs(url, **dict(storage_options))
        return fs.isfile(f"{root.rstrip('/')}/{CONFIG_NAME}")
    except (OSError, ValueError):
        return False


def _load_folder(
    part: str, source: FrozenSource, storage_options: Mapping[str, Any], pinned: Mapping[str, Any] | None
) -> FrozenWeights:
    """A frozen part from a diffusers folder of `source.folder_class`: its config.json (as the weights' config)
    and weights, pinned by the blake3 digest of both files (a changed config, e.g. a VAE's scaling_factor,
    counts as a change)."""
    folder = read_folder(source.url, f"frozen part {part!r} ({source.url})", storage_options)
    found = folder.config.get("_class_name")
    if found != source.folder_class:
        raise ConfigError(
            f"frozen part {part!r}: the diffusers folder {source.url} holds a {found}, not a {source.folder_class}"
        )
    record = {"url": source.url, "step": 0, "file": WEIGHTS_NAME, "digest": folder.record["digest"]}
    record["format"] = "diffusers"
    if pinned is not None and pinned["digest"] != record["digest"]:
        raise ConfigError(
            f"frozen part {part!r}: this run was trained with {pinned['url']} ({pinned['digest']}), but {source.url} "
            f"now gives {record['digest']}. Resuming would train on different frozen weights. Restore that "
            "folder, or start a new run (a new checkpoint.url)."
        )
    log.info("frozen part %s: diffusers %s at %s (%s)", part, found, source.url, record["digest"])
    return FrozenWeights(folder.config, folder.tensors, record)


def load_frozen(
    part: str, source: FrozenSource, storage_options: Mapping[str, Any], pinned: Mapping[str, Any] | None = None
) -> FrozenWeights:
    """Resolve and load a frozen part; with `pinned` (a resume), insist on the recorded digest. A source with a
    `folder_class` may name a diffusers folder of that class instead of a run."""
    if source.folder_class is not None and _is_folder(source.url, storage_options):
        return _load_folder(part, source, storage_options, pinned)
    store, info = _resolve(source.url, storage_options)
    if pinned is None:
        if info is None:
            raise ConfigError(
                f"frozen part {part!r}: no valid checkpoint at {source.url!r}. Train that run first, or point the "
                "URL at a run root or one step-NNNNNNNNN dir of it."
            )
        weights = _load(store, info, source)
        log.info("frozen part %s: %s/%s (%s)", part, info.url, weights.record["file"], weights.record["digest"])
        return weights
    want = pinned["digest"]
    if info is not None and file_digest(info, weights_file(info, source.part, source.use_ema)) == want:
        return _load(store, info, source)
    # The source run moved on (or the URL changed): the pinned step still holds the same weights?
    pin_store, pin_info = _resolve(pinned["url"], storage_options)
    if pin_info is not None and file_digest(pin_info, pinned["file"]) == want:
        log.info("frozen part %s: %s now resolves elsewhere; using the pinned %s", part, source.url, pinned["url"])
        return _load(pin_store, pin_info, FrozenSource(pinned["url"], source.part, _kind(pinned["file"]) == "ema"))
    found = file_digest(info, weights_file(info, source.part, source.use_ema)) if info is not None else "nothing valid"
    raise ConfigError(
        f"frozen part {part!r}: this run was trained with {pinned['url']}/{pinned['file']} ({want}), but "
        f"{source.url} now gives {found} and the pinned checkpoint is gone or changed. Resuming would train on "
        "different frozen weights. Restore that checkpoint, or start a new run (a new checkpoint.url)."
    )


def check_pinned_inputs(recorded: Mapping[str, Any], current: Mapping[str, Any], where: str) -> None:
    """Refuse (exit 2) when an input the run pinned (`"pin": True`, e.g. its text encoder) now has another
    digest: the model was trained on the old one's outputs and would silently get different conditions."""
    for name, now in current.items():
        was = recorded.get(name)
        if not now.get("pin") or was is None or was.get("digest") == now.get("digest"):
            continue
        raise ConfigError(
            f"{name}: {where} was trained with {was.get('source') or was.get('url')} ({was.get('digest')}), but "
            f"{now.get('source') or now.get('url')} now gives {now.get('digest')}. Its outputs would differ from the "
            "ones the model learned. Use the same weights again, or start a new run (a new checkpoint.url)."
        )
    for name, now in current.items():
        was = recorded.get(name)
        if not now.get("pin") and was is not None and was.get("digest") != now.get("digest"):
            log.info(
                "%s: %s changed since %s started (%s -> %s); the checkpoint's weights are used",
                name,
                now.get("url"),
                where,
                was.get("digest"),
                now.get("digest"),
            )


def load_for_inference(
    store: CheckpointStore, info: CheckpointInfo, use_ema: bool, device: Any, task_name: str | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    """(config, task, modules in eval mode) of a checkpoint, EMA weights by default; frozen parts from
    the sources the run recorded (digest-checked).

    `task_name` is the task the user named (`--task`): needed, and compared, when the checkpoint names its
    task by import path. Every store (frozen sources, the text encoder, the data) is opened with the
    storage options the user gave for this checkpoint's store (`store.storage_options`), never with the
    manifest's: those are redacted, and a manifest must not choose where credentials go.
    """
    cfg = config_of(info, task_name)
    options = dict(store.storage_options)
    cfg.checkpoint.storage_options = options
    cfg.data.storage_options = dict(options)
    # The checkpoint holds every weight: pretrained folders are not read again.
    frames = cfg.data.num_frames if is_video(cfg) else 1
    ctx = TaskContext(
        cfg.data.image_size, cfg.data.channels, cfg.seed, None, options, num_frames=frames, load_pretrained=False
    )
    task = task_class(cfg.task)(cfg.model_cfg, ctx)
    records = info.manifest.get("frozen") or {}
    frozen = {
        name: load_frozen(name, source, options, records.get(name)) for name, source in task.frozen_sources().items()
    }
    modules = task.build(frozen)
    check_pinned_inputs(info.manifest.get("inputs") or {}, task.inputs(), f"checkpoint {info.url}")
    for name, module in modules.items():
        tensors = (
            frozen[name].tensors if name in frozen else read_weights(store, info, weights_file(info, name, use_ema))
        )
        try:
            module.load_state_dict(tensors)
        except RuntimeError as e:  # names and shapes that do not fit the model the config builds
            what = "its recorded source" if name in frozen else weights_file(info, name, use_ema)
            raise CheckpointCorrupt(f"{info.url}: the weights of {name!r} ({what}) do not fit its model: {e}") from e
        module.to(device).eval().requires_grad_(False)
    return cfg, task, modules


def _frozen_for_shapes(store: CheckpointStore, info: CheckpointInfo, name: str) -> FrozenWeights:
    """A frozen part's source config and record, without its weights: what `build` needs to shape the
    other parts (a MaskGIT's codebook size). The source is the step the checkpoint recorded, checked
    cheaply (manifest and sizes); its weights are neither read nor hashed."""
    record = (info.manifest.get("frozen") or {}).get(name)
    if record is None:
        raise ConfigError(f"frozen part {name!r}: {info.url} records no source for it")
    url = str(record["url"]).rstrip("/")
    base = posixpath.basename(url)
    step = parse_step_dir(base)
    if step is None:
        raise ConfigError(f"frozen part {name!r}: its recorded source {url!r} is not a step dir")
    try:
        source = CheckpointStore(url[: -len(base) - 1] or ".", store.storage_options).check(step)
    except (OSError, ValueError) as e:
        raise ConfigError(f"frozen part {name!r}: cannot open its recorded source {url!r}: {e}") from None
    if not source.valid:
        raise ConfigError(f"frozen part {name!r}: its recorded source {url} is not valid ({source.reason})")
    return FrozenWeights(config_of(source, flag=None), {}, dict(record))


def _saved_shapes(index: ShardIndex, group: str) -> dict[str, list[int]]:
    """{key: global shape} of a group, from shards.json (sharded) or the whole file's safetensors header."""
    return {key: list(entry["shape"]) for key, entry in index.group(group).items()}


def model_shapes(
    store: CheckpointStore,
    info: CheckpointInfo,
    task_name: str | None = None,
    text_encoder: str | None = None,
    cache: dict[str, Any] | None = None,
) -> dict[str, dict[str, list[int]]]:
    """{part: {key: shape}} of every trainable part the checkpoint's config builds (its state dict: parameters
    and persistent buffers); frozen parts are not in checkpoints and are left out. See `fit_problems`.
    `cache` (a dict the caller keeps) holds the shapes by config and frozen sources: `checkpoints list`
    builds each model once for all the checkpoints of a root."""
    key = json.dumps(
        [info.manifest.get("config"), info.manifest.get("frozen"), task_name, text_encoder], sort_keys=True
    )
    if cache is not None and key in cache:
        return cache[key]
    cfg = config_of(info, task_name)
    options = dict(store.storage_options)
    cfg.checkpoint.storage_options = options
    cfg.data.storage_options = dict(options)
    check_stored_encoders(cfg.model_cfg, text_encoder, f"checkpoint {info.url}")
    frames = cfg.data.num_frames if is_video(cfg) else 1
    ctx = TaskContext(
        cfg.data.image_size, cfg.data.channels, cfg.seed, None, options, num_frames=frames, load_pretrained=False
    )
    from accelerate import init_empty_weights  # about a second to import: only the fit check needs it

    try:
        task = task_class(cfg.task)(cfg.model_cfg, ctx)
        frozen = {name: _frozen_for_shapes(store, info, name) for name in task.frozen_sources()}
        with init_empty_weights(include_buffers=False):  # buffers stay real: some builds compute with them
            modules = task.build(frozen)
    except (ConfigError, CheckpointError):  # a ValueError and a RuntimeError: their own messages
        raise
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:  # a config that passed its schema
        raise ConfigError(f"its config builds no model ({type(e).__name__}: {str(e)[:200]})") from None
    shapes = {
        part: {k: list(t.shape) for k, t in module.state_dict().items()}
        for part, module in modules.items()
        if part not in frozen
    }
    if cache is not None:
        cache[key] = shapes
    return shapes


def fit_problems(
    store: CheckpointStore,
    info: CheckpointInfo,
    task_name: str | None = None,
    text_encoder: str | None = None,
    cache: dict[str, Any] | None = None,
) -> list[str]:
    """Weights that do not fit the model the checkpoint's config builds, as `<file>: <what>` lines; none if
    every part's model and EMA weights have exactly the model's names and shapes (what `load_for_inference`
    and a resume would refuse, found from headers alone).

    The modules' parameters are built on the meta device (no memory; buffers, small, stay real), once per
    config with a `cache` (see `model_shapes`); only safetensors headers and shards.json are read. Frozen parts are not in
    checkpoints and are skipped. Raises ConfigError when no model can be built from the checkpoint: its
    config names a task by import path and `task_name` is not that task (nothing is imported), it names a
    text encoder other than the packaged one and `text_encoder` is not that one (none is loaded), it holds
    no config or one that builds no model, or a frozen source it needs is not available. Call it on a
    checkpoint that `CheckpointStore.verify` passed.
    """
    models = model_shapes(store, info, task_name, text_encoder, cache)
    index = ShardIndex(store, info)
    problems = []
    for part, want in models.items():
        if not index.has(group_name(part, "model")):
            problems.append(f"{info.url}: no weights of part {part!r}, which its config builds")
            continue
        for kind in ("model", "ema"):
            group = group_name(part, kind)
            if not index.has(group):
                continue
            shards = files_of_group(info, group)
            what = shards[0] if shards == [whole_file(group)] else group
            saved = _saved_shapes(index, group)
            missing, extra = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
            if missing or extra:
                problems.append(f"{what}: its names do not fit the model's (missing {missing[:3]}, extra {extra[:3]})")
            for key in sorted(set(want) & set(saved)):
                if saved[key] != want[key]:
                    problems.append(f"{what}: {key} has shape {saved[key]}, the model's is {want[key]}")
    return problems


def consolidate(
    store: CheckpointStore, info: CheckpointInfo, out_url: str, storage_options: Mapping[str, Any] | None = None
):
    """A copy of a (sharded) checkpoint with one file per part and kind (online and EMA weights), for
    inference: `gentrain sample` reads it like any checkpoint. Optimizer state is not copied, so training
    does not resume from it. Memory: one part's weights at a time."""
    doc = store.read_json(info, TRAINER_JSON)
    files = {}
    for part in doc["parts"]:
        for kind in ("model", "ema"):
            name = weights_file(info, part, use_ema=kind == "ema")
            if _kind(name) == kind:  # no EMA: weights_file falls back to the online weights
                files[whole_file(group_name(part, kind))] = read_weights(store, info, name)
    skip = {"format_version", "step", "time_utc", "digest", "files"}
    # Redacted again: a manifest written before redaction existed still holds its run's credentials.
    meta = redact({k: v for k, v in info.manifest.items() if k not in skip})
    meta["consolidated_from"] = info.url
    meta["world_size"] = 1
    return CheckpointStore(out_url, storage_options).write(info.step, files, meta)
