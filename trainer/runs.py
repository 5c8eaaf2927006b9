"""A trained run rebuilt from its checkpoint: for sampling, evaluation and export (`load_for_inference`),
for a frozen part of another run (`load_frozen`), for `verify`'s fit check (`fit_problems`) and for
`checkpoints consolidate`. `build_task` is the one way a config becomes its task, for those and for training.

It sits above `trainer.checkpoint` (the storage library) and beside the engine: it needs the task
registry, the tasks and the data to rebuild a model, and reads every checkpoint through
`trainer.checkpoint.view.CheckpointView`, which parses the run's config once per checkpoint (`config_of`).
`cli` and `loop` use it; nothing in `trainer.checkpoint` imports it.

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

from trainer.checkpoint.layout import group_name, parse_group, parse_step_dir, whole_file
from trainer.checkpoint.reader import CheckpointReader, InvalidCheckpoint, resolve_checkpoint
from trainer.checkpoint.store import CheckpointStore
from trainer.checkpoint.validity import FrozenRecord
from trainer.checkpoint.view import CheckpointView, check_pinned_inputs
from trainer.conditioning.text import check_stored_encoders
from trainer.config import Config
from trainer.config.redact import redact
from trainer.data import is_video
from trainer.data.shards.encoded import EncodedSettings
from trainer.errors import CheckpointCorrupt, CheckpointError, ConfigError
from trainer.models.finetune import CONFIG_NAME, WEIGHTS_NAME, cast_frozen_base, read_folder
from trainer.registry import check_stored_task, config_from_dict, task_class
from trainer.tasks.base import FrozenSource, FrozenWeights, Task, TaskContext

log = logging.getLogger(__name__)


def _kind(name: str) -> str | None:
    """ "model" or "ema" for a weights file or group name that `CheckpointView.weights_name` gave."""
    parsed = parse_group(name)
    return parsed.kind if parsed is not None else None


def build_task(
    cfg: Config,
    *,
    num_classes: int | None = None,
    encoding: EncodedSettings | None = None,
    stages: list[int] | None = None,
    load_pretrained: bool = True,
) -> Task:
    """`cfg`'s task with its context: the one way a config becomes a task, so training, inference
    (`load_for_inference`) and shape queries (`fit_problems`, `model_shapes`) build the same model.

    From the config: image size, channels, seed, frames (video sources), the trained buckets (`data.buckets`) and
    the storage options (`checkpoint.storage_options`: a checkpoint's caller sets the user's own there first).
    From the caller: what only training knows (the data's `num_classes` and `encoding`, the `train.stages` it
    trains; a rebuilt run builds every stage) and `load_pretrained` (False where a checkpoint's weights replace
    what `build` would load)."""
    buckets = None
    if cfg.data.buckets is not None:
        from trainer.data.buckets import trained_buckets  # here: only a run with data.buckets imports it

        buckets = trained_buckets(cfg.data)  # checked against the model; the sizes `gentrain sample` takes
    ctx = TaskContext(
        image_size=cfg.data.image_size,
        channels=cfg.data.channels,
        seed=cfg.seed,
        num_classes=num_classes,
        storage_options=cfg.checkpoint.storage_options,
        stages=stages,
        num_frames=cfg.data.num_frames if is_video(cfg) else 1,
        encoding=encoding,
        buckets=buckets,
        load_pretrained=load_pretrained,
    )
    return task_class(cfg.task)(cfg.model_cfg, ctx)


def config_of(view: CheckpointView, task: str | None = None, flag: str | None = "--task") -> Any:
    """The resolved config of a checkpoint, parsed once per view; its task is imported only if it is a
    built-in or the user named the same one (`task`, given with `flag`; see
    `trainer.registry.check_stored_task`).

    The manifest is whatever the store holds: anyone who can write there chooses it, so it must never
    choose which code runs. Its storage options are redacted (see `trainer.config.redact`): callers use
    the user's own.
    """
    return view.derived(("config", task, flag), lambda: _parse_config(view, task, flag))


def _parse_config(view: CheckpointView, task: str | None, flag: str | None) -> Any:
    tree = view.config_tree
    if tree is None:
        raise ConfigError(f"checkpoint {view.url}: its manifest holds no config (a mapping) to build the model from")
    stored = tree.get("task", Config.model_fields["task"].default)
    check_stored_task(stored, task, f"checkpoint {view.url}", flag)
    try:
        return config_from_dict(tree)
    except ConfigError as e:  # the store's config, not the user's: a checkpoint that cannot be used (exit 1)
        raise CheckpointCorrupt(f"checkpoint {view.url}: the config in its manifest is not valid: {e}") from None


def _load(view: CheckpointView, source: FrozenSource) -> FrozenWeights:
    name = view.weights_name(source.part, source.use_ema)
    record = FrozenRecord(url=view.url, step=view.step, file=name, digest=view.file_digest(name))
    # A frozen part's source run is named by a URL, not by the user's config: only built-in tasks.
    config = config_of(view, flag=None)
    return FrozenWeights(config, view.read_weights(name), record)


def _resolve(url: str, storage_options: Mapping[str, Any]) -> CheckpointView | None:
    try:
        return resolve_checkpoint(url, storage_options)
    except InvalidCheckpoint:  # a step dir that is not valid: as a root without a valid checkpoint
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot open checkpoint URL {url!r}: {e}") from None


def _part_digest(view: CheckpointView, source: FrozenSource) -> str:
    return view.file_digest(view.weights_name(source.part, source.use_ema))


def _is_folder(url: str, storage_options: Mapping[str, Any]) -> bool:
    """Whether `url` is a diffusers save_pretrained folder (it holds config.json), not a run's checkpoints."""
    try:
        fs, root = fsspec.core.url_to_fs(url, **dict(storage_options))
        return fs.isfile(f"{root.rstrip('/')}/{CONFIG_NAME}")
    except (OSError, ValueError):
        return False


def _load_folder(
    part: str, source: FrozenSource, storage_options: Mapping[str, Any], pinned: FrozenRecord | None
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
    record = FrozenRecord(url=source.url, step=0, file=WEIGHTS_NAME, digest=folder.record.digest, format="diffusers")
    if pinned is not None and pinned.digest != record.digest:
        raise ConfigError(
            f"frozen part {part!r}: this run was trained with {pinned.url} ({pinned.digest}), but {source.url} "
            f"now gives {record.digest}. Resuming would train on different frozen weights. Restore that "
            "folder, or start a new run (a new checkpoint.url)."
        )
    log.info("frozen part %s: diffusers %s at %s (%s)", part, found, source.url, record.digest)
    return FrozenWeights(folder.config, folder.tensors, record)


def load_frozen(
    part: str, source: FrozenSource, storage_options: Mapping[str, Any], pinned: FrozenRecord | None = None
) -> FrozenWeights:
    """Resolve and load a frozen part; with `pinned` (a resume), insist on the recorded digest. A source with a
    `folder_class` may name a diffusers folder of that class instead of a run."""
    if source.folder_class is not None and _is_folder(source.url, storage_options):
        return _load_folder(part, source, storage_options, pinned)
    view = _resolve(source.url, storage_options)
    if pinned is None:
        if view is None:
            raise ConfigError(
                f"frozen part {part!r}: no valid checkpoint at {source.url!r}. Train that run first, or point the "
                "URL at a run root or one step-NNNNNNNNN dir of it."
            )
        weights = _load(view, source)
        log.info("frozen part %s: %s/%s (%s)", part, view.url, weights.record.file, weights.record.digest)
        return weights
    want = pinned.digest
    if view is not None and _part_digest(view, source) == want:
        return _load(view, source)
    # The source run moved on (or the URL changed): the pinned step still holds the same weights?
    pin_view = _resolve(pinned.url, storage_options)
    if pin_view is not None and pin_view.file_digest(pinned.file) == want:
        log.info("frozen part %s: %s now resolves elsewhere; using the pinned %s", part, source.url, pinned.url)
        return _load(pin_view, FrozenSource(pinned.url, source.part, _kind(pinned.file) == "ema"))
    found = _part_digest(view, source) if view is not None else "nothing valid"
    raise ConfigError(
        f"frozen part {part!r}: this run was trained with {pinned.url}/{pinned.file} ({want}), but "
        f"{source.url} now gives {found} and the pinned checkpoint is gone or changed. Resuming would train on "
        "different frozen weights. Restore that checkpoint, or start a new run (a new checkpoint.url)."
    )


def load_for_inference(
    view: CheckpointView, use_ema: bool, device: Any, task_name: str | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    """(config, task, modules in eval mode) of a checkpoint, EMA weights by default; frozen parts from
    the sources the run recorded (digest-checked).

    `task_name` is the task the user named (`--task`): needed, and compared, when the checkpoint names its
    task by import path. Every store (frozen sources, the text encoder, the data) is opened with the
    storage options the user gave for this checkpoint's store (`view.storage_options`), never with the
    manifest's: those are redacted, and a manifest must not choose where credentials go.
    """
    cfg = config_of(view, task_name)
    options = dict(view.storage_options)
    cfg.checkpoint.storage_options = options
    cfg.data.storage_options = dict(options)
    # A checkpoint of whole parts holds every weight: pretrained folders are not read again. One holding
    # LoRA adapters only needs its frozen base: built from the pinned folder (digest-checked below).
    adapters = view.adapter_only
    check_bases(view)
    task = build_task(cfg, load_pretrained=bool(adapters))
    records = view.frozen_records
    frozen = {
        name: load_frozen(name, source, options, records.get(name)) for name, source in task.frozen_sources().items()
    }
    modules = task.build(frozen)
    check_pinned_inputs(view.inputs, task.inputs(), f"checkpoint {view.url}")
    for name, module in modules.items():
        tensors = frozen[name].tensors if name in frozen else view.part_weights(name, use_ema)
        try:
            if name in adapters:
                # The base as it trained: in train.precision's dtype (cast_frozen_base), then fp32 again, the
                # values a checkpoint holding the whole part gives.
                cast_frozen_base(module, cfg.train.precision)
                module.float()
                _load_adapters(module, tensors)
            else:
                module.load_state_dict(tensors)
        except RuntimeError as e:  # names and shapes that do not fit the model the config builds
            what = "its recorded source" if name in frozen else view.weights_name(name, use_ema)
            raise CheckpointCorrupt(f"{view.url}: the weights of {name!r} ({what}) do not fit its model: {e}") from e
        module.to(device).eval().requires_grad_(False)
    return cfg, task, modules


def check_bases(view: CheckpointView) -> None:
    """A checkpoint that holds LoRA adapters only (`view.adapter_only`) needs the folder its frozen base was
    pinned from: ConfigError (exit 2), one line naming the folder, when it cannot be read any more. Whether it
    still holds the same files is `check_pinned_inputs`' (after the model is built from it)."""
    inputs = view.inputs
    for part, entry in sorted(view.adapter_only.items()):
        record = inputs.get(entry)
        if record is None or record.url is None:
            raise CheckpointCorrupt(f"{view.url}: part {part!r} holds adapters only, but its manifest pins no base")
        if not _is_folder(record.url, view.storage_options):
            raise ConfigError(
                f"checkpoint {view.url} holds only the LoRA adapters of {part!r}; their frozen base, the folder "
                f"{record.url} ({record.digest}), is gone or unreadable: restore that folder (model.pretrained) "
                "and run this again"
            )


def verify_bases(view: CheckpointView) -> list[str]:
    """`checkpoints verify` of an adapter-only checkpoint: its base folders are there (`check_bases`) and hold
    the files it pinned: ConfigError (exit 2) naming the changed file otherwise, as a resume would say. Reads
    and hashes each base (a pipeline folder: every file the run read). Returns a line per base checked."""
    check_bases(view)
    inputs, checked = view.inputs, []
    pipeline = inputs.get("pipeline")
    if view.adapter_only and pipeline is not None and pipeline.pin and pipeline.url is not None:
        from trainer.models.pipelines import inspect_pipeline  # imports diffusers' configs: only here

        now = inspect_pipeline(pipeline.url, "model.pretrained", view.storage_options).record.pinned()
        check_pinned_inputs({"pipeline": pipeline}, {"pipeline": now}, f"checkpoint {view.url}")
        checked.append(f"{pipeline.url} ({pipeline.digest})")
    for entry in sorted(set(view.adapter_only.values())):
        record = inputs[entry]
        assert record.url is not None  # check_bases refused a base without one
        now = read_folder(record.url, entry, view.storage_options).record.pinned()
        check_pinned_inputs({entry: record}, {entry: now}, f"checkpoint {view.url}")
        checked.append(f"{record.url} ({record.digest})")
    return checked


def _load_adapters(module: Any, tensors: Mapping[str, Any]) -> None:
    """Adapters (and the other weights that trained) over the base built from the pinned folder: every saved
    tensor must be one of the module's, and every adapter of the module must be saved."""
    own = module.state_dict()
    extra = sorted(set(tensors) - set(own))
    missing = sorted(k for k in own if ".lora_" in k and k not in tensors)
    if extra or missing:
        raise RuntimeError(f"adapter-only weights do not fit (missing {missing[:3]}, unexpected {extra[:3]})")
    module.load_state_dict(tensors, strict=False)


def _frozen_for_shapes(view: CheckpointView, name: str) -> FrozenWeights:
    """A frozen part's source config and record, without its weights: what `build` needs to shape the
    other parts (a MaskGIT's codebook size). The source is the step the checkpoint recorded, checked
    cheaply (manifest and sizes); its weights are neither read nor hashed."""
    record = view.frozen_record(name)
    if record is None:
        raise ConfigError(f"frozen part {name!r}: {view.url} records no source for it")
    url = record.url.rstrip("/")
    base = posixpath.basename(url)
    step = parse_step_dir(base)
    if step is None:
        raise ConfigError(f"frozen part {name!r}: its recorded source {url!r} is not a step dir")
    try:
        reader = CheckpointReader(url[: -len(base) - 1] or ".", view.storage_options)
        source = reader.check(step)
    except (OSError, ValueError) as e:
        raise ConfigError(f"frozen part {name!r}: cannot open its recorded source {url!r}: {e}") from None
    if not source.valid:
        raise ConfigError(f"frozen part {name!r}: its recorded source {url} is not valid ({source.reason})")
    return FrozenWeights(config_of(reader.view(source), flag=None), {}, record)


def model_shapes(
    view: CheckpointView,
    task_name: str | None = None,
    text_encoder: str | None = None,
    cache: dict[str, Any] | None = None,
) -> dict[str, dict[str, list[int]]]:
    """{part: {key: shape}} of every trainable part the checkpoint's config builds (its state dict: parameters
    and persistent buffers); frozen parts are not in checkpoints and are left out. See `fit_problems`.
    `cache` (a dict the caller keeps) holds the shapes by config and frozen sources: `checkpoints list`
    builds each model once for all the checkpoints of a root."""
    return _model_facts(view, task_name, text_encoder, cache)[0]


def _model_facts(
    view: CheckpointView, task_name: str | None, text_encoder: str | None, cache: dict[str, Any] | None
) -> tuple[dict[str, dict[str, list[int]]], dict[str, list[int]]]:
    """(`model_shapes`, {part: how many parameters each of its optimizer's groups holds}) of the model the
    checkpoint's config builds: its optimizer groups are formed as training forms them (`param_groups`)."""
    records = {name: record.model_dump() for name, record in view.frozen_records.items()}
    key = json.dumps([view.config_tree, records, task_name, text_encoder], sort_keys=True)
    if cache is not None and key in cache:
        return cache[key]
    cfg = config_of(view, task_name)
    options = dict(view.storage_options)
    cfg.checkpoint.storage_options = options
    cfg.data.storage_options = dict(options)
    check_stored_encoders(cfg.model_cfg, text_encoder, f"checkpoint {view.url}")
    from accelerate import init_empty_weights  # about a second to import: only the fit check needs it

    from trainer.optim import param_groups  # diffusers' schedules with it: only the fit check needs it

    try:
        task = build_task(cfg, load_pretrained=False)
        frozen = {name: _frozen_for_shapes(view, name) for name in task.frozen_sources()}
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
    groups = {
        part: [len(g["params"]) for g in param_groups(module, 0.0)]
        for part, module in modules.items()
        if part not in frozen
    }
    if cache is not None:
        cache[key] = shapes, groups
    return shapes, groups


def fit_problems(
    view: CheckpointView,
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
    checkpoint that `CheckpointReader.verify` passed.
    """
    models, group_sizes = _model_facts(view, task_name, text_encoder, cache)
    adapters = view.adapter_only
    problems = []
    for part, want in models.items():
        if view.saved_shapes(part, "model") is None:
            problems.append(f"{view.url}: no weights of part {part!r}, which its config builds")
            continue
        problems += _optimizer_problems(view, part, group_sizes[part])
        for kind in ("model", "ema"):
            found = view.saved_shapes(part, kind)
            if found is None:
                continue
            what, saved = found
            # Adapter-only: the frozen base is the pinned folder's, not the checkpoint's; its adapters must all be.
            needed = {k for k in want if k in saved or ".lora_" in k} if part in adapters else set(want)
            missing, extra = sorted(needed - set(saved)), sorted(set(saved) - set(want))
            if missing or extra:
                problems.append(f"{what}: its names do not fit the model's (missing {missing[:3]}, extra {extra[:3]})")
            for key in sorted(set(want) & set(saved)):
                if saved[key] != want[key]:
                    problems.append(f"{what}: {key} has shape {saved[key]}, the model's is {want[key]}")
    return problems


def _optimizer_problems(view: CheckpointView, part: str, want: list[int]) -> list[str]:
    """The part's saved optimizer groups against the ones its model gets (how many, and how many parameters
    each): what torch's `Optimizer.load_state_dict` refuses at resume. Their settings' types and ranges
    were checked when trainer.json was parsed (`trainer.checkpoint.validity.check_param_groups`). None for
    a checkpoint with weights only (a consolidated copy)."""
    if not view.holds_training_state:
        return []
    saved = view.trainer_state().parts.get(part)
    if saved is None:
        return [f"{view.url}: trainer.json holds no state of part {part!r}, which its config builds"]
    found = [len(g["params"]) for g in saved.optimizer["param_groups"]]
    if found != want:
        return [
            f"{view.url}: trainer.json parts.{part}.optimizer has parameter groups of {found} parameters, "
            f"the model's optimizer has {want}"
        ]
    return []


def consolidate(view: CheckpointView, out_url: str, storage_options: Mapping[str, Any] | None = None) -> CheckpointView:
    """A copy of a (sharded) checkpoint with one file per part and kind (online and EMA weights), for
    inference: `gentrain sample` reads it like any checkpoint; the copy's view is returned. Optimizer state
    is not copied, so training does not resume from it. Memory: one part's weights at a time."""
    files = {}
    for part in view.trainer_state().parts:
        for kind in ("model", "ema"):
            name = view.weights_name(part, use_ema=kind == "ema")
            if _kind(name) == kind:  # no EMA: weights_name falls back to the online weights
                files[whole_file(group_name(part, kind))] = view.read_weights(name)
    # Redacted again: a manifest written before redaction existed still holds its run's credentials.
    meta = redact(view.metadata())
    meta["consolidated_from"] = view.url
    meta["world_size"] = 1
    store = CheckpointStore(out_url, storage_options)
    return store.view(store.write(view.step, files, meta).info)
