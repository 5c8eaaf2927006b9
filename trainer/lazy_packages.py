"""Import one diffusers class without its package's other hundred: packages whose `__init__` runs on first use.

diffusers' top level is lazy, but a few of its packages are not: `diffusers.models.unets`,
`diffusers.models.transformers`, `diffusers.models.autoencoders` and `diffusers.hooks` import every
module they hold in their `__init__`. So `from diffusers.models.unets.unet_2d import UNet2DModel` (and
`unet_2d_blocks`' import of `transformers.transformer_2d`) imports every UNet, every transformer
(about 100 classes), and with them `diffusers.hooks`, whose layer-wise casting imports peft whenever it
is installed, which imports transformers' model code, scipy and torchao: about 3 of the 6.5 CPU seconds
a digits run spent importing. gentrain uses a handful of those classes. accelerate has one such package too
(`accelerate.commands.config`, whose `__init__` imports boto3 whenever it is installed).

`install()` (trainer/__init__.py calls it; nothing is imported until diffusers is) puts a finder in front
of the import system for exactly those package names. The package it returns is the real one (same
`__path__`, `__spec__`, file), except that its `__init__` has not run: importing a module inside it
imports that module only. Asking the package for a name its `__init__` imports from one of its modules
(`from diffusers.quantizers import DiffusersAutoQuantizer`, `diffusers.models.unets.UNet3DConditionModel`)
imports that module and binds the name; asking for any other name runs the real `__init__` in it then. So
every name the package offers is still there; only when its module is imported differs.
tests/test_private_apis.py checks these packages still exist and that a UNet import stays small, so a
diffusers that moves them fails there, not with a slower start.

One name is offered as a stand-in instead (`ON_FIRST_USE`): `diffusers.quantizers.DiffusersAutoQuantizer`,
which every model module imports and only `from_pretrained` with a quantization config calls. Its module
imports every quantizer backend, torchao's among them, and that imports torchao (0.3 s here, beyond the
torch compiler that training imports anyway). The stand-in imports its module when first asked for an
attribute or called.

And one module's table is built on first use (`PACKAGE_MAP_ON_FIRST_USE`): `diffusers.utils.import_utils`
calls `importlib.metadata.packages_distributions()` when it is imported, which reads the metadata and file
list of every installed distribution (0.19 s with the test extras' 220 here, more in a fuller image). It only
reads the table for packages whose import name differs from their distribution's, and only when such a
package is installed (optimum, flashinfer, modelopt). While that module runs, `packages_distributions`
returns a mapping that calls the real function the first time it is read; afterwards the real function is
back. tests/test_private_apis.py checks that diffusers still calls it there; tests/test_startup.py that every
availability flag and version diffusers computes comes out the same with and without this.
"""

from __future__ import annotations

import ast
import collections.abc
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types

# Packages whose __init__ imports every module in them (diffusers 0.30-0.42, accelerate 1.x).
LAZY_PACKAGES = frozenset(
    {
        "diffusers.models.unets",
        "diffusers.models.transformers",
        "diffusers.models.autoencoders",
        "diffusers.hooks",
        # Every model module imports DiffusersAutoQuantizer from here; its `pipe_quant_config` imports
        # transformers whenever installed (about 0.4 s), for pipelines only.
        "diffusers.quantizers",
        # accelerate's `config` command: accelerate.utils imports one of its modules (write_basic_config), and
        # its `__init__` imports the SageMaker questions, which import boto3 whenever it is installed (0.07 s).
        "accelerate.commands.config",
    }
)
# Names a lazy package offers as a stand-in that imports their module on first use (see the docstring).
ON_FIRST_USE = {"diffusers.quantizers": frozenset({"DiffusersAutoQuantizer"})}
# Modules whose import calls importlib.metadata.packages_distributions(): it returns a table built on first read.
PACKAGE_MAP_ON_FIRST_USE = frozenset({"diffusers.utils.import_utils"})


def _sources(init_path: str | None) -> dict[str, tuple[str, str]]:
    """name -> (submodule, its name there) for each `from .submodule import name [as alias]` in a package's
    `__init__`, wherever it is (inside `if is_torch_available():` too). A name imported from two places
    (a real class or a dummy) is left out: asking for it runs the whole `__init__`, which decides."""
    if not init_path:
        return {}
    try:
        with open(init_path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return {}
    found: dict[str, set[tuple[str, str]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                if alias.name != "*":
                    found.setdefault(alias.asname or alias.name, set()).add((node.module, alias.name))
    return {name: next(iter(where)) for name, where in found.items() if len(where) == 1}


class _DeferredInit(importlib.abc.Loader):
    """Loads a package without running its `__init__`. A name the `__init__` imports from one of the
    package's modules imports that module alone; any other name runs the whole `__init__`, once."""

    def __init__(self, real: importlib.abc.Loader, init_path: str | None) -> None:
        self.real = real
        self.sources = _sources(init_path)
        self.lock = threading.RLock()

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        real, lock, sources = self.real, self.lock, self.sources

        def __getattr__(name: str):  # module-level __getattr__ (PEP 562): only for names not there yet
            if name.startswith("__") and name.endswith("__") and name != "__all__":
                raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
            if name in sources and module.__dict__.get("__getattr__") is __getattr__:
                submodule, attr = sources[name]
                where = f"{module.__name__}.{submodule}"
                if name in ON_FIRST_USE.get(module.__name__, ()):
                    value = _OnFirstUse(where, attr)
                else:
                    value = getattr(importlib.import_module(where), attr)
                setattr(module, name, value)
                return value
            with lock:
                if module.__dict__.get("__getattr__") is __getattr__:
                    del module.__dict__["__getattr__"]
                    module.__loader__ = real
                    module.__spec__.loader = real
                    real.exec_module(module)  # the package's own __init__, in the module the imports hold
            try:
                return module.__dict__[name]
            except KeyError:
                raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}") from None

        module.__getattr__ = __getattr__


class _OnFirstUse:
    """Stands for a class: the first attribute asked of it, or a call, imports its module; both then go to
    the real class. Not for isinstance or subclassing, which the names in ON_FIRST_USE never see."""

    def __init__(self, module: str, attr: str) -> None:
        self._where = (module, attr)

    def _real(self):
        module, attr = self._where
        return getattr(importlib.import_module(module), attr)

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return getattr(self._real(), name)

    def __call__(self, *args, **kwargs):
        return self._real()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{'.'.join(self._where)}, imported on first use>"


class _PackageMap(collections.abc.Mapping):
    """`importlib.metadata.packages_distributions()`, computed the first time it is read."""

    def __init__(self, compute) -> None:
        self._compute, self._table = compute, None

    def _get(self) -> dict:
        if self._table is None:
            try:
                self._table = dict(self._compute())
            except Exception:  # broken metadata: an empty table, so diffusers looks the import name up as a
                self._table = {}  # distribution name (its own fallback for a failed call would walk them again)
        return self._table

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return "<packages_distributions(), computed on first read>" if self._table is None else repr(self._table)


class _PackageMapOnFirstUse(importlib.abc.Loader):
    """Runs a module with `importlib.metadata.packages_distributions` returning a `_PackageMap`."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # A module attribute, swapped for the length of one import (under the import lock of this module); a
        # thread that calls it meanwhile gets the same table, read on first use.
        import importlib.metadata as metadata  # here: `gentrain --help` imports this module, never diffusers

        real = metadata.packages_distributions
        metadata.packages_distributions = lambda: _PackageMap(real)
        try:
            self.real.exec_module(module)
        finally:
            metadata.packages_distributions = real
            module.__loader__ = module.__spec__.loader = self.real


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in LAZY_PACKAGES and fullname not in PACKAGE_MAP_ON_FIRST_USE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if fullname in PACKAGE_MAP_ON_FIRST_USE:
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PackageMapOnFirstUse(spec.loader)
            return spec
        if spec.loader is None or spec.submodule_search_locations is None:
            return spec  # not a package on disk (a namespace, another layout): import it as it is
        spec.loader = _DeferredInit(spec.loader, spec.origin)
        return spec


_FINDER = _Finder()


def install() -> None:
    """Put the finder first on sys.meta_path (idempotent). Packages already imported stay as they are."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
