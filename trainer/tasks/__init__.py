"""Task registry: a task builds its named parts from config, computes losses and samples images."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from trainer.config import ConfigError
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
    schema = task_class(task).ModelConfig
    try:
        return schema.model_validate(model).model_dump(mode="json")
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = "model." + ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                known = ", ".join(schema.model_fields)
                msgs.append(f"unknown config key {loc!r}. Known keys in model: {known}")
            else:
                msgs.append(f"{loc} = {err.get('input')!r} is not allowed: {err['msg']}")
        raise ConfigError("invalid config:\n  " + "\n  ".join(msgs)) from None
