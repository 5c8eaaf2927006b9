"""Typed training config: schema (sections, no torch) and loading (presets, YAML, env, key=value).

Nothing here knows a task: `trainer.registry.load_config` / `config_from_dict` give a config whose
`model.*` is resolved against its task (`cfg.model_cfg`).
"""

from __future__ import annotations

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
    "deep_merge",
    "env_overrides",
    "load_base",
    "parse_config",
    "parse_overrides",
    "preset_names",
    "preset_summary",
    "read_layers",
    "split_preset",
    "validate_model",
    "validate_section",
]
