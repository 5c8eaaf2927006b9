"""Task name -> task class, without importing torch until a task is asked for.

A built-in task `foo-bar` lives in `trainer/tasks/foo_bar.py`, which sets
`TASK = FooBarTask`: adding a task is one new file (plus a preset). A task
outside this package is named by its import path, `package.module:ClassName`
(the module must be importable in every worker). Config validation goes
through here, so `trainer.config` never imports a task module at import time.

Importing a module runs its code, so an import path is taken only from the
user: their config or `--task`. A config read from storage (a checkpoint's
manifest, a frozen part's source run) passes `check_stored_task` first: it
may name a built-in task, or the import path the user named themselves.
"""

from __future__ import annotations

import importlib
from importlib import resources
from typing import TYPE_CHECKING

from trainer.config.schema import ConfigError

if TYPE_CHECKING:
    from trainer.tasks.base import Task

_NOT_TASKS = {"__init__", "base"}


def builtin_tasks() -> list[str]:
    """Names of the tasks shipped in trainer/tasks/ (from file names; nothing is imported)."""
    files = resources.files("trainer.tasks").iterdir()
    return sorted(
        f.name[:-3].replace("_", "-") for f in files if f.name.endswith(".py") and f.name[:-3] not in _NOT_TASKS
    )


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
