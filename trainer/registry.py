"""Task name -> task class, and a config's `model.*` resolved against its task, without importing torch
until a task is asked for.

A built-in task `foo-bar` lives in `trainer/tasks/foo_bar.py`, which sets
`TASK = FooBarTask`: adding a task is one new file (plus a preset). Only the
modules of `trainer/tasks/` that set `TASK` are tasks (read from their source,
nothing imported); the others (`base.py`, shared code) are not offered. A task
outside this package is named by its import path, `package.module:ClassName`
(the module must be importable in every worker).

The config layer (`trainer.config`) knows nothing of tasks: `load_config` and
`config_from_dict` here read and validate a config there, then validate
`model.*` against the task's schema (`resolve_model`) and hand the typed result
to `Config.set_model_cfg`.

Importing a module runs its code, so an import path is taken only from the
user: their config or `--task`. A config read from storage (a checkpoint's
manifest, a frozen part's source run) passes `check_stored_task` first: it
may name a built-in task, or the import path the user named themselves.
"""

from __future__ import annotations

import ast
import functools
import importlib
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from trainer.config.load import Sources, parse_config, read_layers, validate_model
from trainer.config.schema import Config
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.tasks.base import Task


def _sets_task(source: str) -> bool:
    """True when a module's source assigns `TASK` at its top level (what makes it a task module)."""
    for node in ast.parse(source).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "TASK" for t in targets):
            return True
    return False


@functools.cache
def _task_modules() -> tuple[str, ...]:
    files = resources.files("trainer.tasks").iterdir()
    return tuple(sorted(f.name[:-3] for f in files if f.name.endswith(".py") and _sets_task(f.read_text("utf-8"))))


def builtin_tasks() -> list[str]:
    """Names of the tasks shipped in trainer/tasks/: the modules that set `TASK` (parsed, never imported)."""
    return [m.replace("_", "-") for m in _task_modules()]


def is_import_path(name: object) -> bool:
    """True for a task named by import path (`package.module:ClassName`), which importing would run."""
    return isinstance(name, str) and ":" in name


def check_stored_task(stored: object, given: str | None, where: str, flag: str | None = "--task") -> None:
    """Refuse (exit 2) a task read from storage that would import code the user did not name.

    `stored` is the task in a config read from `where` (a checkpoint); `given` the task the user named
    with `flag` (None: not named). A built-in task is fine when the user named none; an import path only
    when the user named the same one; a task the user named must always match. With `flag` None there is
    no way to name one (a frozen part's source run): only built-in tasks pass.
    """
    if given is not None:
        if stored != given:
            raise ConfigError(
                f"{flag} {given} but {where} was trained with task = {stored!r}: they must be the same. "
                f"Pass {flag} {stored} if you trust that task, or use a checkpoint of a run of {given}."
            )
        return
    if is_import_path(stored):
        trust = (
            f"If you trust that module, pass {flag} {stored}."
            if flag
            else f"Only built-in tasks ({', '.join(builtin_tasks())}) are imported from there."
        )
        raise ConfigError(
            f"{where} names task = {stored!r}, an import path: importing it would run code the checkpoint "
            f"chose, so gentrain imports a task module only when you name it yourself. {trust}"
        )


def task_class(name: str) -> type[Task]:
    if ":" in name:
        module_name, attr = name.split(":", 1)
    else:
        if name not in builtin_tasks():
            raise ConfigError(
                f"task = {name!r} is not allowed: one of {builtin_tasks()}, or an import path module:Class"
            )
        module_name, attr = f"trainer.tasks.{name.replace('-', '_')}", "TASK"
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"task = {name!r}: cannot import {module_name!r}: {e}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ConfigError(f"task = {name!r}: module {module_name!r} has no {attr!r}")
    return cls


def resolve_model(cfg: Config, sources: Sources | None = None) -> BaseModel:
    """`cfg.model` validated against its task's schema, and `optim.*` against the task's parts: the typed
    model config (for `Config.set_model_cfg`). `sources` let messages show values as the user typed them."""
    cls = task_class(cfg.task)
    schema = getattr(cls, "ModelConfig", None)
    is_schema = isinstance(schema, type) and issubclass(schema, BaseModel)
    if not (isinstance(cls, type) and is_schema and callable(getattr(cls, "trainable_part_names", None))):
        raise ConfigError(f"task = {cfg.task!r}: that is not a gentrain task class (one with a ModelConfig schema)")
    typed = validate_model(schema, cfg.model, sources)
    parts = cls.trainable_part_names(typed)
    unknown = sorted(set(cfg.optim) - set(parts))
    if unknown:
        raise ConfigError(
            f"optim.{unknown[0]}: task {cfg.task!r} has no trainable part {unknown[0]!r}; "
            f"its parts are: {', '.join(parts)} (e.g. optim.{parts[-1]}.lr=1e-4)"
        )
    return typed


def config_from_dict(tree: dict[str, Any], sources: Sources | None = None) -> Config:
    """A config tree (a checkpoint manifest's, or the merged layers'), validated and resolved like a loaded one."""
    cfg = parse_config(tree, sources)
    cfg.set_model_cfg(resolve_model(cfg, sources))
    return cfg


def load_config(
    preset_or_yaml: str | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """The run's config from all four layers (preset or YAML, environment, key=value), validated, task model
    included (see `trainer.config.load` for precedence and messages), and the sampler settings its previews
    and evaluations will use (`check_sampling_settings`)."""
    tree, sources = read_layers(preset_or_yaml, overrides, environ)
    cfg = parse_config(tree, sources)
    # A task may fill in the `model.*` keys a user's config implies (ddpm: a released pipeline folder at
    # model.pretrained, trainer/models/pipelines.py), so the run's saved config states them; a stored config
    # (`config_from_dict`) is read as it was saved.
    expand = getattr(task_class(cfg.task), "expand_model", None)
    if expand is not None:
        cfg.model = expand(cfg.model, cfg.checkpoint.storage_options)
    cfg.set_model_cfg(resolve_model(cfg, sources))
    check_sampling_settings(cfg)
    return cfg


def check_sampling_settings(cfg: Config) -> None:
    """Refuse (exit 2) sampler settings the task's sampler would refuse: `sample.inference_steps` (every
    preview, the last one after the final checkpoint) and `eval.inference_steps` (evaluations, `gentrain
    eval`) with `sample.scheduler`, asked of the task (`Task.sampling_refusal`: a DDPM schedule of
    `model.num_train_timesteps` steps takes at most that many). Without this the run trained, committed
    its checkpoint, then crashed in the preview, and every restart did the same. `sample.prompts` for a model
    with no caption encoder (`model.text`) are refused too: its previews would draw them as nothing.

    A user's config only: a checkpoint's stored config (`config_from_dict`) is not refused for it, so a
    run that committed such settings can still be sampled with other flags."""
    if cfg.sample.prompts and getattr(cfg.model_cfg, "text", None) is None:
        raise ConfigError(
            f"sample.prompts={cfg.sample.prompts!r}: this {cfg.task} model is not conditioned on captions (no "
            "model.text), so its previews take no prompts; unset sample.prompts, or set model.text"
        )
    refusal_of = getattr(task_class(cfg.task), "sampling_refusal", None)  # a task class from before it
    if refusal_of is None:
        return
    settings = [("sample.inference_steps", cfg.sample.inference_steps, "the previews")]
    if cfg.eval.inference_steps is not None:
        settings.append(("eval.inference_steps", cfg.eval.inference_steps, "the evaluations"))
    for key, steps, used_by in settings:
        refusal = refusal_of(cfg.model_cfg, steps, cfg.sample.scheduler)
        if refusal is not None:
            raise ConfigError(
                f"{key}={steps}: {used_by} of task {cfg.task!r} cannot sample that many steps with "
                f"sample.scheduler={cfg.sample.scheduler}: {refusal}; set {key} lower"
            )
