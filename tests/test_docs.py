"""The user guide builds, the README stays a short front page, and the contract names what the code has.

`mkdocs build --strict` fails on a broken link or anchor and on a page left out of the nav
(mkdocs.yml's `validation`), so a page that moves or a heading that is renamed fails here, not on
a reader. The contract (docs/contract.md) is checked against the code it describes: every config
key of the core schema and of each built-in task's model schema, and every command and flag of
the command line, must be named there. Every test docs/reliability.md points a guarantee at exists.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import typing

import pytest
from conftest import REPO, clean_env
from pydantic import BaseModel

from trainer.cli import _parser
from trainer.config.schema import Config
from trainer.registry import builtin_tasks, load_config, task_class

README_MAX_LINES = 200
CONTRACT = REPO / "docs" / "contract.md"
# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.slow
def test_the_site_builds_strict_and_offline(tmp_path):
    # The venv's own mkdocs; strict: true in mkdocs.yml. Only offline plugins are configured (search).
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(NO_MKDOCS_2_WARNING="1"),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "site" / "contract" / "index.html").is_file()


def test_readme_is_short_and_links_only_to_files_that_exist():
    text = (REPO / "README.md").read_text()
    lines = text.count("\n") + (not text.endswith("\n"))
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference material into docs/"
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the README itself
        path = target.split("#", 1)[0]
        if not (REPO / path).exists():
            broken.append(target)
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_readme_keeps_the_two_commands_ci_and_the_demo_run():
    text = (REPO / "README.md").read_text()
    assert "bash scripts/demo.sh" in text
    assert "bash scripts/test.sh" in text  # .ci/run runs it verbatim


# ---------------------------------------------------------------- the contract names what the code has


def _models_in(annotation) -> list[type[BaseModel]]:
    found = []
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        found.append(annotation)
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of a schema as the contract spells it: `a.b`, `model.stages[i].x`, `optim.<part>.x`."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        out.append(key)
        subs = _models_in(field.annotation)
        if subs:
            origin = typing.get_origin(field.annotation)
            if origin is list:
                out += _keys(subs[0], f"{key}[i].")
            elif origin is dict:
                out += _keys(subs[0], f"{key}.<part>.")
            else:  # a section, or a union of sections (a kind-discriminated model.backbone): every member's keys
                for sub in subs:
                    out += [k for k in _keys(sub, f"{key}.") if k not in out]
    return out


def _section(text: str, heading: str) -> str:
    """The contract's text under a `### heading`, up to the next heading of level 2 or 3."""
    m = re.search(rf"^### {re.escape(heading)}\n(.*?)(?=^#{{2,3}} )", text, re.S | re.M)
    assert m, f"docs/contract.md has no '### {heading}' section"
    return m.group(1)


def test_the_contract_names_every_config_key_of_the_core_schema():
    core = _section(CONTRACT.read_text(), "Config keys")
    sections = {k for k, f in Config.model_fields.items() if _models_in(f.annotation) and "." not in k}
    missing = [k for k in _keys(Config) if k not in sections and f"`{k}`" not in core]
    assert not missing, f"docs/contract.md (Config keys) does not name: {missing}"


def test_the_contract_names_every_model_key_of_every_built_in_task():
    text = CONTRACT.read_text()
    missing = {}
    for task in builtin_tasks():
        table = _section(text, task)
        gone = [k for k in _keys(task_class(task).ModelConfig, "model.") if f"`{k}`" not in table]
        if gone:
            missing[task] = gone
    assert not missing, f"docs/contract.md does not name these model keys, by task: {missing}"


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """(command words, option strings) of every (sub)command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*words, name))
    if words:
        yield words, [s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")]


def test_the_contract_names_every_command_and_flag():
    cli = CONTRACT.read_text().split("## Command line", 1)[1].split("\n## ", 1)[0]
    missing = []
    for words, flags in _commands(_parser()):
        if len(words) == 1 and words[0] in ("checkpoints", "data"):
            continue  # only their subcommands run
        line = next((ln for ln in cli.splitlines() if ln.startswith(f"gentrain {' '.join(words)} ")), None)
        if line is None and f"gentrain {' '.join(words)}\n" not in cli:
            missing.append(f"gentrain {' '.join(words)}")
            continue
        # A command's flags may wrap onto the lines after it, up to the next command.
        block = cli.split(f"gentrain {' '.join(words)}", 1)[1].split("\ngentrain ", 1)[0]
        missing += [f"gentrain {' '.join(words)} {f}" for f in flags if not re.search(rf"{re.escape(f)}\b", block)]
    assert not missing, f"docs/contract.md (Command line) does not name: {missing}"


# ---------------------------------------------------------------- the diffusers migration page cannot drift

FROM_DIFFUSERS = REPO / "docs" / "from-diffusers.md"
_BACKTICKED = re.compile(r"`([^`]+)`")


def _known_keys() -> set[str]:
    """Every config key as `_keys` spells it: the core schema's, and `model.*` of every built-in task."""
    known = set(_keys(Config))
    for task in builtin_tasks():
        known |= set(_keys(task_class(task).ModelConfig, "model."))
    return known


def _as_schema_key(token: str) -> str:
    """`optim.unet.eps=1e-6` -> `optim.<part>.eps`; `model.stages[0].x` -> `model.stages[i].x`."""
    key = token.split("=", 1)[0]
    key = re.sub(r"^optim\.[^.<]+\.", "optim.<part>.", key)
    return re.sub(r"\[\d+\]", "[i]", key)


def _flag_table_rows() -> list[tuple[str, str]]:
    """(diffusers flags, gentrain column) of every row of the page's `## Flag by flag` table."""
    text = FROM_DIFFUSERS.read_text().split("## Flag by flag", 1)[1]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3 or set(cells[0]) <= {"-"} or cells[0] == "diffusers flag":
            continue
        rows.append((cells[0], cells[1]))
    return rows


def test_every_key_and_command_the_diffusers_page_maps_a_flag_to_exists():
    """The gentrain column of docs/from-diffusers.md holds only config keys (`key` or `key=value`) and
    `gentrain` commands (with flags), each checked against the schema and the command line."""
    rows = _flag_table_rows()
    assert len(rows) >= 50, f"the flag table has {len(rows)} rows: did the page's table format change?"
    known = _known_keys()
    commands = dict(_commands(_parser()))
    unknown = []
    for flags, cell in rows:
        tokens = _BACKTICKED.findall(cell)
        assert tokens or cell == "—", f"row {flags}: the gentrain column names nothing and is not '—': {cell!r}"
        for token in tokens:
            if token.startswith("gentrain "):
                words = tuple(w for w in token.split()[1:] if not w.startswith("-"))
                opts = [w for w in token.split() if w.startswith("--")]
                if words not in commands or any(o not in commands[words] for o in opts):
                    unknown.append(f"{flags}: {token}")
            elif _as_schema_key(token) not in known:
                unknown.append(f"{flags}: {token}")
    assert not unknown, f"docs/from-diffusers.md maps flags to keys or commands gentrain does not have: {unknown}"


def _train_commands(text: str) -> list[list[str]]:
    """The words after `train` of every `gentrain train` / `torchrun ... -m trainer train` line in the page's
    bash blocks, continuation lines joined."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for i in range(len(words) - 1):
                if words[i : i + 2] in (["gentrain", "train"], ["trainer", "train"]):
                    found.append(words[i + 2 :])
    return found


def test_the_diffusers_page_train_commands_load():
    """Every gentrain run the page shows is a valid config (presets, keys, values, optim part names)."""
    commands = _train_commands(FROM_DIFFUSERS.read_text())
    assert len(commands) >= 2, commands
    for words in commands:
        preset = words[0] if words and "=" not in words[0] else None
        load_config(preset, words[1:] if preset else words, environ={})


@pytest.mark.slow
def test_no_file_refers_to_a_file_outside_the_repository():
    """Code, comments and docs point into the repo: the contract is docs/contract.md, not a design
    note users do not have."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    outside = re.compile(r"\.\./shared/|\bdesign\.md\b|\benvironment\.md\b")
    found = []
    for name in tracked.splitlines():
        path = REPO / name
        if name == "tests/test_docs.py" or not path.is_file() or path.suffix in (".png", ".safetensors", ".npz"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1) if outside.search(line)]
    assert not found, f"these lines refer to a file outside the repository: {found}"


@pytest.mark.slow
def test_no_python_file_needs_a_hand_layout_kept_from_the_formatter():
    """Layout is ruff format's: a `fmt: skip`/`fmt: off` marks code whose shape fights the formatter."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    marker = re.compile(r"#\s*fmt:\s*(skip|off)\b")
    found = [
        f"{name}:{i}"
        for name in tracked.stdout.splitlines()
        if name != "tests/test_docs.py" and (REPO / name).is_file()
        for i, line in enumerate((REPO / name).read_text().splitlines(), 1)
        if marker.search(line)
    ]
    assert not found, f"formatter escapes left: {found}"


RELIABILITY = REPO / "docs" / "reliability.md"
_TEST_REF = re.compile(r"(?:(?:tests/)?(?P<file>test_\w+\.py))?(?P<sep>::)?(?P<name>test_\w+)?(?:\[[^\]]*\])?")


def _test_functions() -> dict[str, set[str]]:
    """Each tests/test_*.py file's test function names (module level and in classes)."""
    import ast  # only this check parses the suite

    return {
        path.name: {
            node.name
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")
        }
        for path in (REPO / "tests").glob("test_*.py")
    }


def test_every_test_reliability_md_names_exists():
    """Each guarantee in docs/reliability.md points at the tests that hold it: `tests/test_x.py`,
    `tests/test_x.py::test_name`, `::test_name` or `...::test_name` (in the file named last before it) and a
    bare `test_name` (in any test file) must name a test file and function that exist, so a renamed or
    removed test cannot leave a guarantee pointing at nothing."""
    tests = _test_functions()
    missing, last = [], None
    for token in _BACKTICKED.findall(RELIABILITY.read_text()):
        m = _TEST_REF.fullmatch(token.removeprefix("..."))
        if m is None or not (m["file"] or m["name"]):
            continue
        if m["file"]:
            last = m["file"]
            if last not in tests:
                missing.append(f"{token} (no such file)")
                continue
        if m["name"] is None:
            continue
        if m["sep"]:  # a test of the file named (or named last)
            if m["name"] not in tests.get(last or "", ()):
                missing.append(f"{token} (not in {last})")
        elif not any(m["name"] in names for names in tests.values()):
            missing.append(f"{token} (no test file defines it)")
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"
