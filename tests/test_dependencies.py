"""What pyproject.toml declares is what trainer/ imports, read with `ast`: every import of a third-party
module maps (importlib.metadata.packages_distributions) to a declared distribution; one imported at module
level (every run imports it) is a core dependency, one imported only inside a function may be an extra's;
every core dependency is imported. Optional packages missing at run time are exit 2 naming their extra."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions

import pytest
import tomllib
from conftest import REPO

from trainer.errors import ConfigError

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# components/train.py is a link to trainer/torchx_component.py: the package's files are every source.
SOURCES = sorted((REPO / "trainer").rglob("*.py"))
FIRST_PARTY = {"trainer", "components"}
# Modules of an optional feature, which no other module imports: their imports belong to that extra.
OPTIONAL_MODULES = {"trainer/torchx_component.py": "torchx"}
# Extras that are development tools, not features of the package.
TOOL_EXTRAS = {"test", "docs"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    return canonical(re.match(r"[A-Za-z0-9._-]+", req).group(0))


CORE = {requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
EXTRAS = {
    extra: {requirement_name(r) for r in reqs}
    for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items()
    if extra not in TOOL_EXTRAS
}


def third_party_imports() -> dict[str, list[tuple[str, bool]]]:
    """top-level module -> [(path:line, at module level)] for every import outside the stdlib and gentrain.
    Module level means outside functions and outside `try: ... except ImportError` (an optional import)."""
    found: dict[str, list[tuple[str, bool]]] = {}

    def visit(node: ast.AST, path: str, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            for name in names:
                root = name.split(".")[0]
                if root not in sys.stdlib_module_names and root not in FIRST_PARTY:
                    found.setdefault(root, []).append((f"{path}:{child.lineno}", top))
            guarded = isinstance(child, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in child.handlers
            )
            in_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            typing_only = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            visit(child, path, top and not (in_function or guarded or typing_only))

    for path in SOURCES:
        visit(ast.parse(path.read_text(encoding="utf-8")), str(path.relative_to(REPO)), True)
    return found


IMPORTS = third_party_imports()
DISTRIBUTIONS = packages_distributions()


# Modules whose distribution is named otherwise, for when it is not installed here.
NAMED_OTHERWISE = {"etcd": "python-etcd"}


def distribution_of(module: str) -> str:
    """The distribution that installs `module`; a module not installed here is looked up by its name."""
    dists = DISTRIBUTIONS.get(module)
    return canonical(dists[0]) if dists else canonical(NAMED_OTHERWISE.get(module, module))


def test_every_imported_distribution_is_declared_core_or_in_an_extra():
    assert IMPORTS, "the scan found no imports"
    undeclared, not_core = [], []
    for module, sites in sorted(IMPORTS.items()):
        dist = distribution_of(module)
        if dist in CORE:
            continue
        if not any(dist in reqs for reqs in EXTRAS.values()):
            undeclared.append(f"{module} ({dist}) imported at {sites[0][0]}")
        for site, top in sites:
            optional = OPTIONAL_MODULES.get(site.rpartition(":")[0])
            if optional and dist not in EXTRAS[optional]:
                not_core.append(f"{module} ({dist}) imported at {site}, a module of the {optional} extra")
            elif top and not optional:
                not_core.append(f"{module} ({dist}, an extra's) imported at module level: {site}")
    assert not undeclared, f"declare these in pyproject.toml (dependencies or an extra): {undeclared}"
    assert not not_core, f"import these inside the function that needs them, with an exit-2 message: {not_core}"


def test_optional_feature_modules_are_imported_by_no_other_module():
    names = {path.removesuffix(".py").replace("/", ".") for path in OPTIONAL_MODULES}
    importers = [
        f"{path.relative_to(REPO)} imports {node.module if isinstance(node, ast.ImportFrom) else node.names[0].name}"
        for path in SOURCES
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if (isinstance(node, ast.ImportFrom) and node.module in names)
        or (isinstance(node, ast.Import) and any(a.name in names for a in node.names))
    ]
    assert not importers


def test_every_core_dependency_is_imported():
    imported = {distribution_of(m) for m in IMPORTS}
    unused = sorted(CORE - imported)
    assert not unused, f"declared in [project] dependencies but never imported by trainer/: {unused}"


def test_the_scan_sees_what_it_must():
    # The known cases the scan was written for: imported and undeclared once (braceexpand), declared and
    # never imported once (wids), and the optional ones only inside functions.
    assert "braceexpand" in IMPORTS and "braceexpand" in CORE
    assert "wids" not in CORE and "wids" not in IMPORTS
    for module, extra in [
        ("av", "video"),
        ("torchmetrics", "eval"),
        ("peft", "lora"),
        ("torch_fidelity", "inception"),
        ("datasets", "hf"),
    ]:
        assert distribution_of(module) in EXTRAS[extra]
        assert not any(top for _, top in IMPORTS[module]), module
    assert EXTRAS["trackers"] >= EXTRAS["tensorboard"] | EXTRAS["wandb"]


def pins(name: str) -> dict[str, str]:
    lines = (REPO / name).read_text().splitlines()
    return {canonical(a): b for a, _, b in (line.partition("==") for line in lines if "==" in line and line[0] != "#")}


def test_runtime_constraints_agree_with_the_test_environment_except_for_urllib3():
    runtime, tested = pins("constraints-runtime.txt"), pins("constraints.txt")
    from test_image_install import dockerfile_install, extras_of

    image_extras = extras_of(dockerfile_install()[1])  # the Dockerfile's install line
    needed = CORE - {"torch"} | set().union(*(EXTRAS[e] for e in image_extras))
    assert not needed - set(runtime), f"constraints-runtime.txt does not pin {sorted(needed - set(runtime))}"
    assert "torchx" not in runtime and "pytest" not in runtime
    assert int(runtime["urllib3"].split(".")[0]) >= 2 and tested["urllib3"].startswith("1.26.")
    differ = {k: (v, tested.get(k)) for k, v in runtime.items() if tested.get(k) != v and k != "urllib3"}
    assert not differ, f"pinned differently from constraints.txt (regenerate both): {differ}"


def test_without_torchmetrics_fid_exits_2_naming_the_eval_extra(monkeypatch):
    from trainer.eval.features import load_features

    monkeypatch.setitem(sys.modules, "torchmetrics", None)
    with pytest.raises(ConfigError, match=r"need torchmetrics, which is not installed .*gentrain\[eval\]"):
        load_features("digits", None)


# ---------------------------------------------------------------- the TorchX component as an entry point

ENTRY_POINTS = PYPROJECT["project"]["entry-points"]["torchx.components"]


def test_torchx_finds_the_gentrain_component_and_its_builtins_through_the_entry_points(monkeypatch):
    """TorchX's own discovery (torchx.specs.finder) run on pyproject.toml's `torchx.components` entry points.

    The shared test venv's editable install carries the metadata of its install time, so the entry points
    are read from pyproject.toml and handed to TorchX's loader in its place: what is tested is that they
    import, that TorchX names and validates `gentrain.train` from them, and that its builtins stay listed
    (TorchX 0.7 lists registered components *instead of* its builtins)."""
    import importlib

    from torchx.specs import finder
    from torchx.util import entrypoints

    import trainer.torchx_component as packaged

    def load_group(group: str, default=None):
        assert group == "torchx.components"
        return {name: (lambda m=module: importlib.import_module(m)) for name, module in ENTRY_POINTS.items()}

    monkeypatch.setattr(entrypoints, "load_group", load_group)
    monkeypatch.setattr(finder, "_components", None)
    components = finder.get_components()
    assert components["gentrain.train"].fn is packaged.train
    assert {"dist.ddp", "utils.echo"} <= set(components)
    assert not [name for name in components if name.startswith("gentrain.") and name != "gentrain.train"]
    app = finder.get_component("gentrain.train").fn("digits-ddpm", "train.max_steps=10", j="1x2")
    assert app.roles[0].args[1].startswith("python -m trainer launch ")
    assert app.roles[0].args[1].endswith(" -- digits-ddpm train.max_steps=10")
    # The file path spelling is the same file.
    monkeypatch.setattr(finder, "_components", None)
    by_path = finder.get_component(f"{REPO / 'components' / 'train.py'}:train")
    assert (REPO / "components" / "train.py").resolve() == (REPO / "trainer" / "torchx_component.py").resolve()
    assert by_path.validation_errors == []


def test_installed_torchx_entry_points_match_pyproject_when_the_metadata_has_them():
    from importlib.metadata import entry_points

    installed = {ep.name: ep.value for ep in entry_points(group="torchx.components") if ep.dist.name == "gentrain"}
    if not installed:
        pytest.skip("this install's metadata predates the entry points (reinstall gentrain to regenerate it)")
    assert installed == ENTRY_POINTS
