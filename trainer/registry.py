"""Task name -> task class, without importing torch until a task is asked for.

A built-in task `foo-bar` lives in `trainer/tasks/foo_bar.py`, which sets
`TASK = FooBarTask`: adding a task is one new file (plus a preset). A task
outside this package is named by its import path, `package.module:ClassName`
(the module must be importable in every worker). Config validation goes
through here, so `trainer.config` never imports a task module at import time.
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
