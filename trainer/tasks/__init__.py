"""Task registry: a task builds its named parts from config, computes losses and samples images."""

from __future__ import annotations

from typing import Any

from trainer.config import ConfigError, validate_section
from trainer.tasks.base import Task

_TASKS: dict[str, str] = {
    "ddpm": "trainer.tasks.diffusion:DiffusionTask",
}


def task_class(name: str) -> type[Task]:
    if name not in _TASKS:
        raise ConfigError(f"task = {name!r} is not allowed: one of {sorted(_TASKS)}")
    import importlib

    module, cls = _TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def validate_model_config(task: str, model: dict[str, Any]) -> dict[str, Any]:
    """Validate the `model.*` section against the task's schema; return it with defaults filled."""
    return validate_section(task_class(task).ModelConfig, model, prefix="model").model_dump(mode="json")
