"""Typed training config: presets, YAML files, GENTRAIN_* environment and key=value overrides.

Precedence, lowest first: built-in defaults < preset or YAML file < environment
(`GENTRAIN_<SECTION>__<KEY>`) < `key=value` arguments. Every layer is merged
into one plain dict and validated once by pydantic, so an unknown key, a wrong
type or an out-of-range value is reported the same way wherever it came from,
as a `ConfigError` that names the key, the value seen and what is allowed.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from trainer.config.schema import DEFAULT_PRESET, Config, ConfigError

ENV_PREFIX = "GENTRAIN_"


# ---------------------------------------------------------------- presets


def preset_names() -> list[str]:
    files = resources.files("trainer.presets").iterdir()
    return sorted(p.name[: -len(".yaml")] for p in files if p.name.endswith(".yaml"))


def preset_summary(name: str) -> str:
    """The preset's first comment line, which says what it trains."""
    text = resources.files("trainer.presets").joinpath(f"{name}.yaml").read_text()
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


def _load_yaml_text(text: str, origin: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{origin}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping of config keys, got {type(data).__name__}")
    return data


def load_base(preset_or_yaml: str | None) -> dict[str, Any]:
    """The first layer: a built-in preset by name, or a YAML file by path."""
    name = preset_or_yaml or DEFAULT_PRESET
    if name in preset_names():
        text = resources.files("trainer.presets").joinpath(f"{name}.yaml").read_text()
        return _load_yaml_text(text, f"preset {name}")
    path = Path(name)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {name!r} does not exist")
        return _load_yaml_text(path.read_text(), str(path))
    raise ConfigError(f"{name!r} is neither a preset nor a YAML file; presets: {', '.join(preset_names())}")


# ---------------------------------------------------------------- overrides


def _parse_value(raw: str) -> Any:
    """Values are YAML, so `3e-4`, `[32,64]` and `{"a": 1}` all work."""
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    # PyYAML reads 3e-4 as a string (YAML 1.1 wants a dot); users mean a float.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _set_path(tree: dict[str, Any], dotted: str, value: Any, origin: str) -> None:
    keys = dotted.split(".")
    if any(not k for k in keys):
        raise ConfigError(f"{origin}: {dotted!r} is not a valid key (empty part)")
    node = tree
    for k in keys[:-1]:
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{origin}: cannot set {dotted!r}: {k!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(args: Iterable[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"override {arg!r} must look like key=value (e.g. train.lr=3e-4)")
        key, raw = arg.split("=", 1)
        _set_path(tree, key.strip(), _parse_value(raw), f"argument {arg!r}")
    return tree


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """GENTRAIN_CHECKPOINT__URL=... -> {"checkpoint": {"url": ...}}."""
    tree: dict[str, Any] = {}
    for var, raw in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX) or var in _ENV_NOT_CONFIG:
            continue
        dotted = ".".join(part.lower() for part in var[len(ENV_PREFIX) :].split("__"))
        _set_path(tree, dotted, _parse_value(raw), f"environment {var}")
    return tree


# Variables gentrain itself sets for its workers; never config keys.
_ENV_NOT_CONFIG = {"GENTRAIN_METRICS_DIR"}


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "storage_options":
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------- validation


def _describe(error: dict[str, Any], schema: type[BaseModel], prefix: str) -> str:
    """One pydantic error as a user message: the key, the value seen, what is allowed."""
    path = [str(p) for p in error["loc"]]
    loc = ".".join(([prefix] if prefix else []) + path).replace("async_", "async")
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"unknown config key {loc!r}. {_known_keys_hint(schema, path, prefix)}"
    if kind == "value_error":
        return error["msg"].removeprefix("Value error, ")
    allowed = error["msg"]
    if kind == "literal_error":
        allowed = f"one of {(error.get('ctx') or {}).get('expected')}"
    return f"{loc} = {error.get('input')!r} is not allowed: {allowed}"


def _known_keys_hint(schema: type[BaseModel], path: list[str], prefix: str) -> str:
    model = schema
    keyed = False  # inside a dict[str, Section] field (optim.<part>): the next path item is a key
    for p in path[:-1]:
        if keyed:
            keyed = False
            continue
        field = model.model_fields.get(p)
        ann = getattr(field, "annotation", None) if field else None
        if typing.get_origin(ann) is dict:
            ann, keyed = typing.get_args(ann)[1], True
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return ""
        model = ann
    names = [f.alias or n for n, f in model.model_fields.items()]
    section = ".".join(([prefix] if prefix else []) + path[:-1])
    return f"Known keys{' in ' + section if section else ''}: {', '.join(names)}"


def validate_section(schema: type[BaseModel], tree: dict[str, Any], prefix: str = "") -> BaseModel:
    """Validate `tree` against `schema`; errors name keys as `<prefix>.<key>` (exit 2 in the CLI)."""
    try:
        return schema.model_validate(tree)
    except ValidationError as e:
        msgs = [_describe(err, schema, prefix) for err in e.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(msgs)) from None


def split_preset(args: list[str]) -> tuple[str | None, list[str]]:
    """[PRESET_OR_YAML] [key=value ...] -> (preset or None, overrides)."""
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


def resolve(cfg: Config) -> Config:
    """Validate `model.*` against the task's schema and `optim.*` against its parts (once, typed)."""
    from trainer.registry import task_class  # no torch until a task module is imported

    cls = task_class(cfg.task)
    typed = validate_section(cls.ModelConfig, dict(cfg.model), prefix="model")
    parts = cls.trainable_part_names(typed)
    unknown = sorted(set(cfg.optim) - set(parts))
    if unknown:
        raise ConfigError(
            f"optim.{unknown[0]}: task {cfg.task!r} has no trainable part {unknown[0]!r}; "
            f"its parts are: {', '.join(parts)} (e.g. optim.{parts[-1]}.lr=1e-4)"
        )
    cfg.model = typed.model_dump(mode="json")
    cfg._model_cfg = typed
    return cfg


def config_from_dict(tree: dict[str, Any]) -> Config:
    """A config saved in a checkpoint's manifest, validated and resolved like a loaded one."""
    return resolve(validate_section(Config, tree))


def load_config(
    preset_or_yaml: str | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the run's config from all four layers and validate it, task model included."""
    environ = os.environ if environ is None else environ
    tree = load_base(preset_or_yaml)
    tree = deep_merge(tree, env_overrides(environ))
    tree = deep_merge(tree, parse_overrides(overrides))
    return config_from_dict(tree)
