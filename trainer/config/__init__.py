"""Typed training config: schema (sections, no torch) and loading (presets, YAML, env, key=value).

Nothing here knows a task: `trainer.registry.load_config` / `config_from_dict` give a config whose
`model.*` is resolved against its task (`cfg.model_cfg`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from trainer.config.load import (
    DEFAULT_PRESET,
    deep_merge,
    env_overrides,
    load_base,
    parse_config,
    parse_overrides,
    preset_names,
    preset_summary,
    read_layers,
    split_preset,
    validate_model,
    validate_section,
)
from trainer.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    ElasticConfig,
    EmaConfig,
    MetricsConfig,
    OptimConfig,
    SampleConfig,
    TrainConfig,
)
from trainer.errors import ConfigError


# Transitional (issue 24): trainer/launch.py, trainer/checkpoint/weights.py and bench/ still import these two
# from here; they belong to trainer.registry (resolving `model.*` needs the task). Remove both once those
# import them from trainer.registry (tests/test_layers.py fails when nothing uses them any more).
def load_config(
    preset_or_yaml: str | None = None, overrides: Iterable[str] = (), environ: Mapping[str, str] | None = None
) -> Config:
    """Use `trainer.registry.load_config`."""
    from trainer.registry import load_config as resolved  # transitional shim, see above (registry imports config)

    return resolved(preset_or_yaml, overrides, environ)


def config_from_dict(tree: dict[str, Any], sources: Any = None) -> Config:
    """Use `trainer.registry.config_from_dict`."""
    from trainer.registry import config_from_dict as resolved  # transitional shim, see above (registry imports config)

    return resolved(tree, sources)


__all__ = [
    "DEFAULT_PRESET",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ElasticConfig",
    "EmaConfig",
    "MetricsConfig",
    "OptimConfig",
    "SampleConfig",
    "TrainConfig",
    "config_from_dict",
    "deep_merge",
    "env_overrides",
    "load_base",
    "load_config",
    "parse_config",
    "parse_overrides",
    "preset_names",
    "preset_summary",
    "read_layers",
    "split_preset",
    "validate_model",
    "validate_section",
]
