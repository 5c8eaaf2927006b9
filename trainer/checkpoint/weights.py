"""Load one part's weights from any run's checkpoint: for sampling, and for frozen parts.

A frozen part (a MaskGIT's tokenizer) is pinned: the first start records the
checkpoint it came from (URL, step, file, digest) in every checkpoint of the
new run, and every resume must get weights with that digest again. If the
source run has moved on, the pinned step is used; if that step is gone or
its file changed, the resume is refused (exit 2) rather than silently
training on different frozen weights.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from trainer.checkpoint.state import ema_file, model_file
from trainer.checkpoint.store import CheckpointInfo, CheckpointStore, resolve_checkpoint
from trainer.config import ConfigError
from trainer.tasks.base import FrozenSource, FrozenWeights

log = logging.getLogger(__name__)


def file_digest(info: CheckpointInfo, name: str) -> str:
    """The digest the manifest records for `name`, as `algorithm:hex`."""
    entry = info.manifest["files"][name]
    for algorithm in ("blake3", "sha256"):
        if algorithm in entry:
            return f"{algorithm}:{entry[algorithm]}"
    raise KeyError(f"{info.url}: manifest entry for {name} has no digest")


def weights_file(info: CheckpointInfo, part: str, use_ema: bool) -> str:
    files = info.manifest["files"]
    if model_file(part) not in files:
        parts = sorted(n.split(".")[0] for n in files if n.endswith(".model.safetensors"))
        raise ConfigError(f"{info.url} has no part {part!r} (its parts: {', '.join(parts) or 'none'})")
    if use_ema and ema_file(part) in files:
        return ema_file(part)
    return model_file(part)


def _load(store: CheckpointStore, info: CheckpointInfo, source: FrozenSource) -> FrozenWeights:
    from trainer.config import config_from_dict

    name = weights_file(info, source.part, source.use_ema)
    record = {"url": info.url, "step": info.step, "file": name, "digest": file_digest(info, name)}
    return FrozenWeights(config_from_dict(info.manifest["config"]), store.read_tensors(info, name), record)


def _resolve(url: str, storage_options: Mapping[str, Any]) -> tuple[CheckpointStore, CheckpointInfo | None]:
    try:
        store, info = resolve_checkpoint(url, storage_options)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot open checkpoint URL {url!r}: {e}") from None
    return store, info if info is not None and info.valid else None


def load_frozen(
    part: str, source: FrozenSource, storage_options: Mapping[str, Any], pinned: Mapping[str, Any] | None = None
) -> FrozenWeights:
    """Resolve and load a frozen part; with `pinned` (a resume), insist on the recorded digest."""
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
        return _load(
            pin_store, pin_info, FrozenSource(pinned["url"], source.part, pinned["file"].endswith(".ema.safetensors"))
        )
    found = file_digest(info, weights_file(info, source.part, source.use_ema)) if info is not None else "nothing valid"
    raise ConfigError(
        f"frozen part {part!r}: this run was trained with {pinned['url']}/{pinned['file']} ({want}), but "
        f"{source.url} now gives {found} and the pinned checkpoint is gone or changed. Resuming would train on "
        "different frozen weights. Restore that checkpoint, or start a new run (a new checkpoint.url)."
    )


def load_for_inference(
    store: CheckpointStore, info: CheckpointInfo, use_ema: bool, device: Any
) -> tuple[Any, Any, dict[str, Any]]:
    """(config, task, modules in eval mode) of a checkpoint, EMA weights by default; frozen parts from
    the sources the run recorded (digest-checked)."""
    from trainer.config import config_from_dict
    from trainer.registry import task_class
    from trainer.tasks.base import TaskContext

    cfg = config_from_dict(info.manifest["config"])
    ctx = TaskContext(cfg.data.image_size, cfg.data.channels, cfg.seed, None, cfg.checkpoint.storage_options)
    task = task_class(cfg.task)(cfg.model_cfg, ctx)
    records = info.manifest.get("frozen") or {}
    frozen = {
        name: load_frozen(name, source, store.storage_options, records.get(name))
        for name, source in task.frozen_sources().items()
    }
    modules = task.build(frozen)
    for name, module in modules.items():
        tensors = (
            frozen[name].tensors if name in frozen else store.read_tensors(info, weights_file(info, name, use_ema))
        )
        module.load_state_dict(tensors)
        module.to(device).eval().requires_grad_(False)
    return cfg, task, modules
