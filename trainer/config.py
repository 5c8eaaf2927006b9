"""Typed training config: presets, YAML files, GENTRAIN_* environment and key=value overrides.

Precedence, lowest first: built-in defaults < preset or YAML file < environment
(`GENTRAIN_<SECTION>__<KEY>`) < `key=value` arguments. Every layer is merged
into one plain dict and validated once by pydantic, so an unknown key, a wrong
type or an out-of-range value is reported the same way wherever it came from,
as a `ConfigError` that names the key, the value seen and what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ENV_PREFIX = "GENTRAIN_"
DEFAULT_PRESET = "digits-ddpm"


class ConfigError(ValueError):
    """A user error in the config; the CLI prints it and exits 2."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    dir: str | None = Field(None, description="local folder for logs and grids; default runs/<name>")


class TrainConfig(_Section):
    max_steps: int = Field(1000, ge=1)
    batch_size: int = Field(64, ge=1, description="global batch over all ranks and accumulation")
    grad_accum: int = Field(1, ge=1)
    micro_batch_size: int | None = Field(None, ge=1, description="largest chunk per forward")
    lr: float = Field(2e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = Field(1.0, gt=0)
    precision: Literal["no", "fp16", "bf16"] = "no"
    log_every_steps: int = Field(50, ge=1)
    val_every_steps: int = Field(0, ge=0, description="0 = no validation")
    val_batches: int = Field(4, ge=1)
    num_workers: int = Field(0, ge=0)
    threads: int | None = Field(None, ge=1, description="torch intra-op threads per process")


class EmaConfig(_Section):
    enabled: bool = True
    decay: float = Field(0.999, gt=0, lt=1, description="maximum decay")
    min_decay: float = Field(0.0, ge=0, lt=1)
    warmup: bool = True
    inv_gamma: float = Field(1.0, gt=0)
    power: float = Field(2 / 3, gt=0)
    update_after_step: int = Field(0, ge=0)


class CheckpointConfig(_Section):
    url: str | None = Field(None, description="any fsspec URL; default <run.dir>/checkpoints")
    every_steps: int = Field(500, ge=0, description="0 = only at the end")
    keep: int = Field(3, ge=1)
    keep_every_steps: int = Field(0, ge=0, description="0 = no milestones")
    # `async` is a Python keyword: the attribute is async_, the key stays `async`.
    async_: bool = Field(False, alias="async")
    storage_options: dict[str, Any] = Field(default_factory=dict)
    resume: bool = True

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)


class SampleConfig(_Section):
    every_steps: int = Field(0, ge=0, description="0 = only at the end")
    num: int = Field(64, ge=1)
    inference_steps: int = Field(50, ge=1)
    scheduler: Literal["ddim", "dpm"] = "ddim"
    guidance_scale: float = Field(1.0, ge=0)
    use_ema: bool = True


class MetricsConfig(_Section):
    port: int = Field(0, ge=0, le=65535, description="0 = off")
    host: str = "0.0.0.0"
    linger_seconds: float = Field(0.0, ge=0, description="keep serving final values this long at exit")


class ElasticConfig(_Section):
    grace_seconds: float = Field(25.0, gt=0)
    collective_timeout_seconds: float = Field(
        600.0, ge=30, description="a hung collective (lost peer, stuck init) fails after this; torchrun restarts"
    )


class LogConfig(_Section):
    tensorboard: bool = False
    wandb: bool = False


class DataConfig(_Section):
    source: Literal["digits", "folder"] = "digits"
    path: str | None = None
    image_size: int = Field(16, ge=4)
    channels: Literal[1, 3] = 1
    flip: bool = False
    val_fraction: float = Field(0.05, ge=0, lt=1)
    ledger: bool = Field(False, description="record consumed sample indices in run.dir/ledger")

    @model_validator(mode="after")
    def _folder_needs_path(self) -> DataConfig:
        if self.source == "folder" and not self.path:
            raise ValueError("data.source=folder needs data.path (a folder of images)")
        return self


class Config(_Section):
    name: str = DEFAULT_PRESET
    task: str = "ddpm"
    seed: int = 0
    run: RunConfig = Field(default_factory=RunConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    ema: EmaConfig = Field(default_factory=EmaConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    # Validated by the task's own model config class (see trainer.tasks).
    model: dict[str, Any] = Field(default_factory=dict)

    @property
    def run_dir(self) -> str:
        return self.run.dir or os.path.join("runs", self.name)

    @property
    def checkpoint_url(self) -> str:
        return self.checkpoint.url or os.path.join(self.run_dir, "checkpoints")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


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
    for p in path[:-1]:
        field = model.model_fields.get(p)
        ann = getattr(field, "annotation", None) if field else None
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
    cfg = validate_section(Config, tree)
    # Local import: tasks import torch and diffusers, config must stay light.
    from trainer.tasks import validate_model_config

    cfg.model = validate_model_config(cfg.task, cfg.model)
    return cfg
