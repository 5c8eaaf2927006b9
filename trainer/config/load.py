"""Typed training config: presets, YAML files, GENTRAIN_* environment and key=value overrides.

Precedence, lowest first: built-in defaults < preset or YAML file < environment
(`GENTRAIN_<SECTION>__<KEY>`) < `key=value` arguments. Every layer is merged
into one plain dict and validated once by pydantic, so an unknown key, a wrong
type or an out-of-range value is reported the same way wherever it came from,
as a `ConfigError` that names the key, the value as typed and what is allowed.

How values are read, and why:
- YAML with the scalars of YAML 1.2's core schema: only `true`/`false` are
  booleans and `3e-4` is a float. PyYAML's YAML 1.1 reads `no`, `off`, `y` as
  booleans, so `train.precision=no`, the documented value, arrived as False.
  Fields that are booleans still take yes/no/on/off (pydantic reads those words).
- The text of every scalar is kept next to what YAML made of it (`Typed`): a
  field whose type is a string or a string choice gets the text as typed
  (`name=1e3` is "1e3", `run.dir=2024` is "2024"), and every error message shows
  the value as the user typed it.
- Nesting is bounded (`MAX_DEPTH` levels, `MAX_NODES` values, aliases
  expanded) before anything recursive walks a value, so no input reaches
  Python's recursion limit or expands without bound.
- A section (`train`, `optim.<part>`, ...) is a mapping of keys: a layer that
  sets it to a value is refused instead of replacing the section a lower layer
  filled in.

This module knows nothing of tasks: `model.*` is checked against the task's own
schema by `trainer.registry` (`resolve_model`, `load_config`), which finds the
task; `validate_model` here does the checking, given the schema.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ValidationError

from trainer.config.schema import DEFAULT_PRESET, Config
from trainer.errors import ConfigError

ENV_PREFIX = "GENTRAIN_"

MAX_DEPTH = 64  # levels of mappings and lists, counting the config's own sections and keys
MAX_NODES = 100_000  # values in one file or override, aliases expanded


# ---------------------------------------------------------------- reading YAML


@dataclass(frozen=True)
class Typed:
    """One value as the user typed it: what YAML made of it, its text, and where it came from."""

    value: Any
    text: str
    origin: str


# Path of a value in the config tree (mapping keys, list indices) -> what the user typed there.
Sources = dict[tuple[Any, ...], Typed]


def _shown(text: str, limit: int = 80) -> str:
    """Text short enough for a one-line message (a 40 kB value is cut, its length said)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _shown_path(name: str) -> str:
    """A file name as the user gave it: whole up to PATH_MAX (a path cut short names no file)."""
    return _shown(name, limit=4096)


class _ConfigYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 core scalars, JSON-like values only, and bounded nesting.

    PyYAML composes nested nodes recursively, so a value nested 20,000 levels deep
    would raise RecursionError: `compose_node` counts the levels as they open and
    refuses the value before Python's limit. Aliases can nest or multiply an
    earlier value without nesting the text, so each node's depth and expanded
    size are measured when it is complete.
    """

    def __init__(self, stream: str, origin: str, max_depth: int) -> None:
        super().__init__(stream)
        self.origin = origin
        self.max_depth = max_depth
        self._open_levels = 0
        self._shape: dict[int, tuple[int, int]] = {}  # id(node) -> (depth, values), for finished nodes

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        is_alias = self.check_event(yaml.AliasEvent)
        self._open_levels += 1
        try:
            if self._open_levels > self.max_depth:
                raise ConfigError(self._too_deep())
            node = super().compose_node(parent, index)
        finally:
            self._open_levels -= 1
        if is_alias:
            if id(node) not in self._shape:
                raise ConfigError(f"{self.origin}: an alias refers to a value that contains it (a loop)")
            return node
        if isinstance(node, yaml.ScalarNode):
            self._shape[id(node)] = (1, 1)
            return node
        children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
        shapes = [self._shape[id(c)] for c in children]
        depth = 1 + max((d for d, _ in shapes), default=0)
        size = 1 + sum(s for _, s in shapes)
        if depth > self.max_depth:
            raise ConfigError(self._too_deep())
        if size > MAX_NODES:
            raise ConfigError(
                f"{self.origin}: holds more than {MAX_NODES} values (aliases expanded); "
                "a config is small: list many files in a file (e.g. shards.json) instead"
            )
        self._shape[id(node)] = (depth, size)
        return node

    def _too_deep(self) -> str:
        return (
            f"{self.origin}: nested more than {MAX_DEPTH} levels deep (lists and mappings inside one another, "
            f"counting the config's own sections); config values nest at most {MAX_DEPTH} levels"
        )

    # YAML 1.2 core schema constructors: Python's int() and float() raise ValueError on text such as
    # `!!int abc` or 5,000 digits; as YAML errors they are reported (files) or kept as text (overrides).
    def construct_core_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node)
        sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text.lstrip("+"))
        base = {"0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
        try:
            return sign * int(digits[2:] if base != 10 else digits, base)
        except ValueError as e:
            raise yaml.constructor.ConstructorError(None, None, f"not an integer: {e}", node.start_mark) from None

    def construct_core_float(self, node: yaml.ScalarNode) -> float:
        text = self.construct_scalar(node).lower()
        special = {".inf": "inf", "+.inf": "inf", "-.inf": "-inf", ".nan": "nan"}
        try:
            return float(special.get(text, text))
        except ValueError as e:
            raise yaml.constructor.ConstructorError(None, None, f"not a number: {e}", node.start_mark) from None

    def construct_core_bool(self, node: yaml.ScalarNode) -> bool:
        text = self.construct_scalar(node).lower()
        if text not in ("true", "false"):
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not true or false", node.start_mark)
        return text == "true"


_CORE = "tag:yaml.org,2002:"
# Only the YAML 1.2 core schema's implicit types: null, true/false, integers, floats (`3e-4` included).
_ConfigYamlLoader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in [
    ("null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    ("bool", r"true|True|TRUE|false|False|FALSE", list("tTfF")),
    ("int", r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+", list("-+0123456789")),
    (
        "float",
        r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
        list("-+0123456789."),
    ),
    ("merge", r"<<", ["<"]),
]:
    _ConfigYamlLoader.add_implicit_resolver(_CORE + _tag, re.compile(rf"^(?:{_pattern})$"), _first)
# JSON-like values only: binary, timestamps, sets and pairs have no place in a config (and some of PyYAML's
# constructors for them raise plain Python errors on bad text); an unknown tag is a YAML error.
_ConfigYamlLoader.yaml_constructors = {
    _CORE + "null": yaml.SafeLoader.construct_yaml_null,
    _CORE + "bool": _ConfigYamlLoader.construct_core_bool,
    _CORE + "int": _ConfigYamlLoader.construct_core_int,
    _CORE + "float": _ConfigYamlLoader.construct_core_float,
    _CORE + "str": yaml.SafeLoader.construct_yaml_str,
    _CORE + "seq": yaml.SafeLoader.construct_yaml_seq,
    _CORE + "map": yaml.SafeLoader.construct_yaml_map,
    None: yaml.SafeLoader.construct_undefined,
}


def _read_yaml(text: str, origin: str, *, max_depth: int = MAX_DEPTH, lines: bool = False) -> tuple[Any, Sources]:
    """Parse `text`; raises yaml.YAMLError for text that is not YAML, ConfigError for a value too deep or big.

    The sources map every scalar's path inside the value to its text (`lines`: origins say the line).
    """
    loader = _ConfigYamlLoader(text, origin, max_depth)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        value = loader.construct_document(node)
        sources: Sources = {}
        _collect_sources(loader, node, value, (), origin, lines, sources)
        return value, sources
    finally:
        loader.dispose()


def _collect_sources(
    loader: _ConfigYamlLoader, node: yaml.Node, value: Any, path: tuple, origin: str, lines: bool, out: Sources
) -> None:
    # Recursion is bounded: the loader refused anything deeper than MAX_DEPTH.
    if isinstance(node, yaml.ScalarNode):
        where = f"{origin}, line {node.start_mark.line + 1}" if lines else origin
        out[path] = Typed(value, node.value, where)
    elif isinstance(node, yaml.SequenceNode) and isinstance(value, list):
        for i, (child, item) in enumerate(zip(node.value, value, strict=False)):
            _collect_sources(loader, child, item, (*path, i), origin, lines, out)
    elif isinstance(node, yaml.MappingNode) and isinstance(value, dict):
        for key_node, child in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = loader.construct_object(key_node)
            if key in value:
                _collect_sources(loader, child, value[key], (*path, key), origin, lines, out)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's multi-line error as one line: what is wrong, and where."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark else problem


# ---------------------------------------------------------------- presets and files


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


def _yaml_layer(text: str, origin: str) -> tuple[dict[str, Any], Sources]:
    try:
        data, sources = _read_yaml(text, origin, lines=True)
    except yaml.YAMLError as e:
        raise ConfigError(f"{origin}: not valid YAML: {_yaml_problem(e)}") from None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{origin}: expected a mapping of config keys (key: value lines), got a {type(data).__name__}"
        )
    return data, sources


def _file_text(name: str) -> str | None:
    """The text of config file `name`, or None when there is no such file; ConfigError for anything else."""
    what = f"config file {_shown_path(name)!r}"
    try:
        info = os.stat(name)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except ValueError:  # a NUL byte in the name
        return None
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENAMETOOLONG, errno.ELOOP):
            return None
        raise ConfigError(f"{what} cannot be read: {e.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{what} is a directory; give a YAML file of config keys or a preset name")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{what} is not a regular file; give a YAML file of config keys or a preset name")
    try:
        data = Path(name).read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} cannot be read: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} is not a YAML text file (byte {data[e.start]:#04x} at offset {e.start} is not UTF-8 text); "
            "give a YAML file of config keys or a preset name (gentrain presets lists them)"
        ) from None
    if "\x00" in text:
        raise ConfigError(
            f"{what} is not a YAML text file (it holds NUL bytes); "
            "give a YAML file of config keys or a preset name (gentrain presets lists them)"
        )
    return text


def _base_layer(preset_or_yaml: str | None) -> tuple[dict[str, Any], Sources]:
    name = preset_or_yaml or DEFAULT_PRESET
    if name in preset_names():
        text = resources.files("trainer.presets").joinpath(f"{name}.yaml").read_text()
        return _yaml_layer(text, f"preset {name}")
    text = _file_text(name)
    if text is not None:
        return _yaml_layer(text, _shown_path(name))
    if Path(name).suffix in (".yaml", ".yml"):
        raise ConfigError(f"config file {_shown_path(name)!r} does not exist")
    raise ConfigError(f"{_shown(name)!r} is neither a preset nor a YAML file; presets: {', '.join(preset_names())}")


def load_base(preset_or_yaml: str | None) -> dict[str, Any]:
    """The first layer: a built-in preset by name, or a YAML file by path."""
    return _base_layer(preset_or_yaml)[0]


# ---------------------------------------------------------------- overrides


def _parse_value(raw: str, origin: str, keys: list[str]) -> tuple[Any, Sources]:
    """A key=value or environment value: YAML, so `3e-4`, `[32,64]` and `{"a": 1}` all work.

    Text that is not YAML (`a: b: c`) is kept as typed. Sources are relative to the key.
    """
    try:
        value, sources = _read_yaml(raw, origin, max_depth=MAX_DEPTH - len(keys))
    except yaml.YAMLError:
        return raw, {(): Typed(raw, raw, origin)}
    sources.setdefault((), Typed(value, raw.strip(), origin))  # lists and mappings: the whole text as typed
    return value, sources


def _nest(keys: list[str], value: Any, dotted: str, origin: str) -> dict[str, Any]:
    if any(not k for k in keys):
        raise ConfigError(f"{origin}: {_shown(dotted)!r} is not a valid key (empty part)")
    tree: Any = value
    for k in reversed(keys):
        tree = {k: tree}
    return tree


def _override_layer(args: Iterable[str]) -> tuple[dict[str, Any], Sources]:
    tree: dict[str, Any] = {}
    sources: Sources = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"override {_shown(arg)!r} must look like key=value (e.g. train.lr=3e-4)")
        dotted, raw = arg.split("=", 1)
        dotted = dotted.strip()
        origin = f"argument {_shown(arg)!r}"
        keys = dotted.split(".")
        value, found = _parse_value(raw, origin, keys)
        single = _nest(keys, value, dotted, origin)
        found = {(*keys, *p): t for p, t in found.items()}
        tree = deep_merge(tree, single, sources, found)
        sources.update(found)
    return tree, sources


def parse_overrides(args: Iterable[str]) -> dict[str, Any]:
    """`key=value` arguments as a config tree (values parsed as YAML)."""
    return _override_layer(args)[0]


# Variables gentrain itself sets for its workers, secrets that must never reach a config (which checkpoints
# record: the compile cache's HMAC key, trainer/engine/compile_cache.py), test failpoints (GENTRAIN_FAULT_*) and
# the test suite's own settings (GENTRAIN_TEST_*, docs/development.md); never config keys.
_ENV_NOT_CONFIG = {"GENTRAIN_METRICS_DIR", "GENTRAIN_COMPILE_CACHE_KEY"}
_ENV_NOT_CONFIG_PREFIXES = ("GENTRAIN_FAULT_", "GENTRAIN_TEST_")


def _env_layer(environ: Mapping[str, str]) -> tuple[dict[str, Any], Sources]:
    tree: dict[str, Any] = {}
    sources: Sources = {}
    for var, raw in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX) or var in _ENV_NOT_CONFIG or var.startswith(_ENV_NOT_CONFIG_PREFIXES):
            continue
        keys = [part.lower() for part in var[len(ENV_PREFIX) :].split("__")]
        origin = f"environment {_shown(var)}"
        value, found = _parse_value(raw, origin, keys)
        single = _nest(keys, value, ".".join(keys), origin)
        found = {(*keys, *p): t for p, t in found.items()}
        tree = deep_merge(tree, single, sources, found)
        sources.update(found)
    return tree, sources


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """GENTRAIN_CHECKPOINT__URL=... -> {"checkpoint": {"url": ...}}."""
    return _env_layer(environ)[0]


# ---------------------------------------------------------------- merging


def deep_merge(
    base: dict[str, Any],
    top: dict[str, Any],
    base_sources: Sources | None = None,
    top_sources: Sources | None = None,
    _path: tuple[Any, ...] = (),
) -> dict[str, Any]:
    """`top` over `base`, key by key. A section and a value never replace each other silently.

    Without that rule `GENTRAIN_TRAIN=x` plus `train.lr=1` replaced the preset's whole
    train section with defaults. `storage_options` are replaced whole (they go to fsspec
    as one dict). The sources only make the messages name what the user typed, and where.
    """
    out = dict(base)
    for k, v in top.items():
        path = (*_path, k)
        old = out.get(k)
        if isinstance(v, dict) and isinstance(old, dict) and k != "storage_options":
            out[k] = deep_merge(old, v, base_sources, top_sources, path)
            continue
        kind = _section_kind(path)
        if not isinstance(v, dict):
            if (
                kind == "required"
                or (kind == "optional" and v is not None)
                or (kind is None and v is not None and isinstance(old, dict))
            ):
                raise ConfigError(_section_got_value(path, v, top_sources))
        elif k in out and not isinstance(old, dict):
            if kind == "required" or (kind == "optional" and old is not None):
                raise ConfigError(_section_got_value(path, old, base_sources))
            if kind is None and old is not None:
                raise ConfigError(_value_got_keys(path, old, base_sources))
        out[k] = v
    return out


def _section_kind(path: tuple[Any, ...]) -> Literal["required", "optional", "value"] | None:
    """What the schema makes of `path`: a section (a mapping of keys; may null stand for it?), a value,
    or None where it does not say (inside `model.*`, which the task's schema checks later)."""
    ann = _annotation_at(Config, path)
    if ann is None or ann is Any:
        return None
    members = _members(ann)
    if not any(_is_model(m) or typing.get_origin(m) is dict for m in members):
        return "value"
    return "optional" if type(None) in members else "required"


def _who_set(path: tuple[Any, ...], value: Any, sources: Sources | None) -> str:
    typed = _typed_at(sources, path, value)
    return f"{typed.origin} sets it to {_show_typed(value, typed)}" if typed else f"it is set to {_show(value)}"


def _section_got_value(path: tuple[Any, ...], value: Any, sources: Sources | None) -> str:
    dotted = ".".join(map(str, path))
    model = next((m for m in _members(_annotation_at(Config, path)) if _is_model(m)), None)
    if model is not None:
        keys = f"; its keys: {', '.join(f.alias or n for n, f in model.model_fields.items())}"
        example = f"{dotted}.{next(iter(model.model_fields))}=..."
    else:
        keys, example = "", f"{dotted}.KEY=..."
    return (
        f"{dotted} is a section of config keys, not a value: {_who_set(path, value, sources)}; "
        f"set the keys inside it instead, e.g. {example}{keys}"
    )


def _value_got_keys(path: tuple[Any, ...], value: Any, sources: Sources | None) -> str:
    dotted = ".".join(map(str, path))
    return (
        f"{dotted} is a value, not a section of config keys: {_who_set(path, value, sources)}, "
        f"so no {dotted}.KEY can be set in it; give the whole value instead (e.g. {dotted}=[...])"
    )


# ---------------------------------------------------------------- schema walking


def _members(ann: Any) -> list[Any]:
    """The types a field accepts: unions flattened, Annotated unwrapped."""
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _members(typing.get_args(ann)[0])
    if origin is Union or origin is types.UnionType:
        return [m for a in typing.get_args(ann) for m in _members(a)]
    return [ann]


def _is_model(ann: Any) -> bool:
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _annotation_at(schema: Any, path: tuple[Any, ...]) -> Any:
    """The type the schema expects at `path` (keys and list indices), or None where it says nothing."""
    ann = schema
    for key in path:
        inner = None
        for m in _members(ann):
            origin, args = typing.get_origin(m), typing.get_args(m)
            if m is Any:
                inner = Any
            elif _is_model(m) and isinstance(key, str):
                field = m.model_fields.get(key) or next((f for f in m.model_fields.values() if f.alias == key), None)
                inner = field.annotation if field else None
            elif origin is dict and isinstance(key, str):
                inner = args[1] if args else Any
            elif origin is list and isinstance(key, int):
                inner = args[0] if args else Any
            elif origin is tuple and isinstance(key, int):
                if len(args) == 2 and args[1] is Ellipsis:
                    inner = args[0]
                elif 0 <= key < len(args):
                    inner = args[key]
            if inner is not None:
                break
        if inner is None:
            return None
        ann = inner
    return ann


def _wants_text(ann: Any, value: Any) -> bool:
    """True where YAML made a number or boolean of text meant for a string field (`name=123`, `run.dir=2024`)."""
    if not isinstance(value, (bool, int, float)):
        return False
    members = _members(ann)
    if Any in members:
        return False
    literals = [a for m in members if typing.get_origin(m) is Literal for a in typing.get_args(m)]
    if str not in members and not any(isinstance(a, str) for a in literals):
        return False
    t = type(value)
    if t in members or (t is int and float in members):
        return False
    return not any(type(a) is t and a == value for a in literals)


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        if isinstance(tree, dict) and key in tree:
            tree = tree[key]
        elif isinstance(tree, list) and isinstance(key, int) and 0 <= key < len(tree):
            tree = tree[key]
        else:
            return _MISSING
    return tree


_MISSING = object()


def _put(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    """`tree` with `value` at `path`, copying the containers on the way (the caller's tree is left as it is)."""
    if not path:
        return value
    copy = dict(tree) if isinstance(tree, dict) else list(tree)
    copy[path[0]] = _put(tree[path[0]], path[1:], value)
    return copy


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _as_typed_where_text(tree: dict[str, Any], schema: Any, sources: Sources, prefix: tuple = ()) -> dict[str, Any]:
    """Give string fields the text the user typed where YAML made a number or boolean of it."""
    for path, typed in sources.items():
        rel = path[len(prefix) :]
        if path[: len(prefix)] != prefix or not rel or not isinstance(typed.value, (bool, int, float)):
            continue
        if not _same(_get(tree, rel), typed.value):
            continue  # a later layer set something else here
        ann = _annotation_at(schema, rel)
        if ann is not None and _wants_text(ann, typed.value):
            tree = _put(tree, rel, typed.text)
    return tree


INT64 = (-(2**63), 2**63 - 1)
# `seed` alone takes torch.manual_seed's whole range (int64 or uint64); its own schema bound says so.
WIDER_INTS = {("seed",): (-(2**63), 2**64 - 1)}


def _check_nesting(tree: Any, what: str) -> None:
    """Refuse a tree nested deeper than MAX_DEPTH (or looping) before anything recursive walks it, and an
    integer outside 64 bits anywhere in it (torch, numpy and the samplers take int64: a bigger one would
    end as an OverflowError traceback deep in a model's constructor, or a loop that never ends)."""
    stack, seen = [(tree, 1, ())], 0
    while stack:
        node, depth, path = stack.pop()
        low, high = WIDER_INTS.get(path, INT64)
        if isinstance(node, int) and not isinstance(node, bool) and not low <= node <= high:
            key = ".".join(str(p) for p in path) or "(root)"
            shown = _shown(str(node), 40) if node.bit_length() < 4000 else f"(a {node.bit_length()}-bit integer)"
            raise ConfigError(
                f"invalid config:\n  {_shown(key)} = {shown} is not allowed: config integers fit in 64 bits "
                f"(from {low} to {high}); give a value this run can hold"
            )
        if isinstance(node, dict):
            children = [(v, (*path, k)) for k, v in node.items()]
        elif isinstance(node, (list, tuple)):
            children = [(v, (*path, i)) for i, v in enumerate(node)]
        else:
            continue
        seen += 1
        if depth > MAX_DEPTH or seen > MAX_NODES:
            raise ConfigError(f"{what}: nested more than {MAX_DEPTH} levels deep or too large to be a config")
        stack.extend((c, depth + 1, p) for c, p in children)


# ---------------------------------------------------------------- validation


def _loosely(value: Any) -> Any:
    """A value compared as pydantic may hand it back: [2, -1] validates to (2.0, -1.0), which == tells apart
    only by list vs tuple; and NaN equals nothing, not even itself."""
    if isinstance(value, (list, tuple)):
        return tuple(_loosely(v) for v in value)
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def _typed_at(sources: Sources | None, path: tuple[Any, ...], value: Any) -> Typed | None:
    typed = (sources or {}).get(path)
    if typed is None:
        return None
    try:
        return typed if _loosely(typed.value) == _loosely(value) or _same(typed.text, value) else None
    except Exception:  # noqa: BLE001 - values whose == misbehaves are simply not matched
        return None


def _show(value: Any) -> str:
    return _shown(repr(value))


def _show_typed(value: Any, typed: Typed | None) -> str:
    """The value as the user typed it: strings quoted as before, anything else as its text."""
    if typed is None or isinstance(value, str):
        return _show(value)
    return _shown(typed.text) if typed.text.strip() else repr(typed.text)


def _describe(error: dict[str, Any], schema: type[BaseModel], prefix: str, sources: Sources | None = None) -> str:
    """One pydantic error as a user message: the key, the value as typed, what is allowed."""
    path = [str(p) for p in error["loc"]]
    loc = ".".join(([prefix] if prefix else []) + path).replace("async_", "async")
    kind = error["type"]
    if kind == "extra_forbidden":
        return f"unknown config key {_shown(loc)!r}. {_known_keys_hint(schema, path, prefix)}"
    if kind == "value_error":
        return error["msg"].removeprefix("Value error, ")
    full = (*(prefix.split(".") if prefix else ()), *error["loc"])
    value = error.get("input")
    if kind == "missing" and error["loc"] and isinstance(error["loc"][-1], int):  # a tuple given too few items
        shown = _show_typed(value, _typed_at(sources, full[:-1], value))
        return f"{_shown(loc.rsplit('.', 1)[0])} = {shown} is not allowed: it has too few items"
    if kind == "missing":
        return f"{_shown(loc)} is required: it has no default and was not set"
    allowed = error["msg"]
    if kind == "literal_error":
        allowed = f"one of {(error.get('ctx') or {}).get('expected')}"
    return f"{_shown(loc)} = {_show_typed(value, _typed_at(sources, full, value))} is not allowed: {allowed}"


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


def validate_section(
    schema: type[BaseModel], tree: dict[str, Any], prefix: str = "", sources: Sources | None = None
) -> BaseModel:
    """Validate `tree` against `schema`; errors name keys as `<prefix>.<key>` (exit 2 in the CLI).

    `sources` (paths from the config's root) let messages show values as the user typed them.
    """
    try:
        return schema.model_validate(tree)
    except ValidationError as e:
        msgs = list(dict.fromkeys(_describe(err, schema, prefix, sources) for err in e.errors()))
        raise ConfigError("invalid config:\n  " + "\n  ".join(msgs)) from None


def split_preset(args: list[str]) -> tuple[str | None, list[str]]:
    """[PRESET_OR_YAML] [key=value ...] -> (preset or None, overrides)."""
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


def validate_model(schema: type[BaseModel], model: dict[str, Any], sources: Sources | None = None) -> BaseModel:
    """`model.*` validated against a task's schema (the registry finds it): string fields get the text as
    typed, and errors name keys as `model.<key>` with values as the user typed them."""
    model = _as_typed_where_text(dict(model), schema, sources or {}, prefix=("model",))
    return validate_section(schema, model, prefix="model", sources=sources)


def parse_config(tree: dict[str, Any], sources: Sources | None = None) -> Config:
    """A config tree validated against the schema; `model.*` is left to the task's own schema
    (`trainer.registry.resolve_model`, which `trainer.registry.config_from_dict` applies)."""
    _check_nesting(tree, "config")
    if sources:
        tree = _as_typed_where_text(tree, Config, sources)
    return validate_section(Config, tree, sources=sources)


def read_layers(
    preset_or_yaml: str | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], Sources]:
    """The four layers merged into one tree, with what the user typed where (for `parse_config`)."""
    environ = os.environ if environ is None else environ
    tree: dict[str, Any] = {}
    sources: Sources = {}
    for layer, found in (_base_layer(preset_or_yaml), _env_layer(environ), _override_layer(overrides)):
        tree = deep_merge(tree, layer, sources, found)
        sources.update(found)
    return tree, sources
