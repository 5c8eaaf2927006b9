"""Import one diffusers class without its package's other hundred: packages whose `__init__` runs on first use.

diffusers' top level is lazy, but a few of its packages are not: `diffusers.models.unets`,
`diffusers.models.transformers`, `diffusers.models.autoencoders` and `diffusers.hooks` import every
module they hold in their `__init__`. So `from diffusers.models.unets.unet_2d import UNet2DModel` (and
`unet_2d_blocks`' import of `transformers.transformer_2d`) imports every UNet, every transformer
(about 100 classes), and with them `diffusers.hooks`, whose layer-wise casting imports peft whenever it
is installed, which imports transformers' model code, scipy and torchao: about 3 of the 6.5 CPU seconds
a digits run spent importing. gentrain uses a handful of those classes.

`install()` (trainer/__init__.py calls it; nothing is imported until diffusers is) puts a finder in front
of the import system for exactly those package names. The package it returns is the real one (same
`__path__`, `__spec__`, file), except that its `__init__` has not run: importing a module inside it
imports that module only. The first time anything asks the package for an attribute it does not hold yet
(`diffusers.models.unets.UNet3DConditionModel`, `from diffusers.models.transformers import X`), the real
`__init__` runs in it then, so every name the package offers is still there; only when differs.
tests/test_private_apis.py checks these packages still exist and that a UNet import stays small, so a
diffusers that moves them fails there, not with a slower start.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types

# diffusers packages whose __init__ imports every module in them (diffusers 0.30-0.42).
LAZY_PACKAGES = frozenset(
    {
        "diffusers.models.unets",
        "diffusers.models.transformers",
        "diffusers.models.autoencoders",
        "diffusers.hooks",
    }
)


class _DeferredInit(importlib.abc.Loader):
    """Loads a package without running its `__init__`; runs it, once, at the first attribute it lacks."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real
        self.lock = threading.RLock()

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        real, lock = self.real, self.lock

        def __getattr__(name: str):  # module-level __getattr__ (PEP 562): only for names not there yet
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


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in LAZY_PACKAGES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or spec.submodule_search_locations is None:
            return spec  # not a package on disk (a namespace, another layout): import it as it is
        spec.loader = _DeferredInit(spec.loader)
        return spec


_FINDER = _Finder()


def install() -> None:
    """Put the finder first on sys.meta_path (idempotent). Packages already imported stay as they are."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
