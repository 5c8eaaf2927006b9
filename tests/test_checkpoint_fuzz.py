"""Fuzzing real checkpoint roots (hypothesis, fixed seed): whatever a bucket holds, gentrain resumes from
the newest valid checkpoint with that step's state, or says what is wrong; never a traceback, never a
write outside the root, never a lost valid checkpoint.

Mutations are structural (types, fields, headers, file lists, stray entries, links), applied with and
without making the manifest's sizes and digests agree, so only the structure checks can catch them. Value
changes of the right type and range are not among them: a consistently rewritten tensor or counter is a
valid checkpoint of another state, which no check can tell from the real one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import traceback
from pathlib import Path

import blake3
import pytest
import torch
from ckpt_tamper import manifest, read_tensors, replace_file, step_dir, write_manifest
from conftest import run_cli, tiny
from diffusers.training_utils import EMAModel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as safetensors_load

from trainer.checkpoint import CheckpointStore
from trainer.cli import main
from trainer.randomness import rng_state, set_rng_state

# Reported in docs/reliability.md; raise them for a longer hunt (the seed stays fixed: derandomize).
IN_PROCESS_EXAMPLES = int(os.environ.get("GENTRAIN_FUZZ_EXAMPLES", "300"))
END_TO_END_EXAMPLES = int(os.environ.get("GENTRAIN_FUZZ_E2E_EXAMPLES", "8"))

JUNK = [None, "abc", -1, -64, 2**64, 1.5, float("1e308"), [], {}, True, "\x00\xff", [1, 2], {"__tensor__": "nope"}]
# Tampering that the schemas take and a loader may refuse (#35). Each either makes the loader refuse (then
# verify must refuse too) or changes nothing a resume uses, so the end-to-end run still ends bit-identical.
LOADER_REFUSED_JSON = [
    ("trainer.json", ("parts", "unet", "ema", "decay"), 5.0),  # EMAModel: "Decay must be between 0 and 1"
    ("trainer.json", ("parts", "unet", "ema", "decay"), -1),
    ("trainer.json", ("parts", "unet", "ema", "min_decay"), 0),  # an int: EMAModel wants a float
    ("trainer.json", ("parts", "unet", "lr_schedule", "lr_lambdas"), None),  # deleted: LambdaLR needs it
    ("rank-00000.json", ("rng", "python", 1, -1), 625),  # random.setstate: position past the 624 words
    ("rank-00000.json", ("rng", "python", 1, -1), 2**32 - 1),
    ("rank-00000.json", ("rng", "python", 0), 7),  # a state version Python does not know
    ("rank-00000.json", ("rng", "numpy", 0), "PCG64"),  # numpy's legacy setter takes MT19937 only
    ("rank-00000.json", ("rng", "numpy", 3), 2**64),  # has_gauss past a C long
]
# A zero-size tensor appended to the rank file's header, written as raw bytes: spellings of its shape and
# entry that Python's json reads (and gentrain's arithmetic takes) but the safetensors library or torch may
# not. Its data offsets are the end of the data, so the bytes still tile the file; "0" and 2^63-1 load.
RAW_SHAPES = [b"-0", b"0.0", b"0e0", b"18446744073709551616,0", b"9223372036854775808,0", b"4294967296,4294967296,0"]
RAW_SHAPES += [b"0", b"9223372036854775807,0"]


def raw_header_edit(raw: bytes, end: int, rnd) -> bytes:
    entry = b'{"dtype":"U8","shape":[%s],"data_offsets":[%d,%d]}' % (rnd.choice(RAW_SHAPES), end, end)
    how = rnd.choice(["shape", "duplicate-field", "nan-metadata", "lone-surrogate", "utf-16", "utf-32"])
    if how == "duplicate-field":
        entry = entry.replace(b'"dtype":', b'"dtype":"U8","dtype":')
    key = b'"\\ud800"' if how == "lone-surrogate" else b'"zz"'
    raw = b"{" + key + b":" + entry + b"," + raw[1:]
    if how == "nan-metadata":
        raw = b'{"__metadata__":{"a":NaN},' + raw[1:]
    if how in ("utf-16", "utf-32"):
        raw = raw.decode().encode(how)
    return raw


DEEP = json.loads("[" * 200 + "]" * 200)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 6-step run with checkpoints at 2, 4 and 6."""
    base = tmp_path_factory.mktemp("fuzzref")
    r = run_cli("train", *tiny(base, "checkpoint.every_steps=2", "checkpoint.keep=10", max_steps=6))
    assert r.returncode == 0, r.stderr[-3000:]
    return base / "run" / "checkpoints"


def json_paths(doc, prefix=(), depth=0) -> list[tuple]:
    out = [prefix]
    if depth > 6:
        return out
    if isinstance(doc, dict):
        for k, v in list(doc.items())[:40]:
            out += json_paths(v, (*prefix, k), depth + 1)
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            out += json_paths(v, (*prefix, i), depth + 1)
    return out


def mutate_json(doc, path: tuple, action: str, junk):
    if not path:
        return junk if action == "replace" else [doc]
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if action == "delete" and isinstance(parent, dict):
        del parent[last]
    elif action == "deep":
        parent[last] = DEEP
    else:
        parent[last] = junk
    return doc


KINDS = ["manifest", "payload-json", "safetensors-header", "file-list", "bytes", "stray", "link-inside", "latest"]


@st.composite
def mutations(draw, loader_refused: bool = True) -> list[tuple]:
    """A list of (kind, step, args) mutations of a root holding steps 2 and 4. `loader_refused`: also the
    tampering only the loaders' own checks find (the in-process test loads every root verify accepts; the
    end-to-end test keeps its examples: a new kind re-draws all of its derandomized ones)."""
    kinds = st.sampled_from([*KINDS, "loader-refused"] if loader_refused else KINDS)
    out = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(kinds)
        step = draw(st.sampled_from([2, 4]))
        out.append((kind, step, draw(st.randoms(use_true_random=False))))
    return out


def apply(root: Path, outside: Path, kind: str, step: int, rnd) -> int | None:
    """Apply one mutation; the step it touched (None: the root around the steps)."""
    d = step_dir(root, step)
    if not d.is_dir() or d.is_symlink():
        return None
    if kind == "manifest":
        doc = manifest(root, step)
        path = rnd.choice(json_paths(doc))
        write_manifest(root, step, mutate_json(doc, path, rnd.choice(["replace", "delete", "deep"]), rnd.choice(JUNK)))
        return step
    if kind == "payload-json":
        name = rnd.choice(["trainer.json", "rank-00000.json"])
        doc = json.loads((d / name).read_text())
        path = rnd.choice(json_paths(doc))
        doc = mutate_json(doc, path, rnd.choice(["replace", "delete", "deep"]), rnd.choice(JUNK))
        replace_file(root, step, name, json.dumps(doc).encode())
        return step
    if kind == "safetensors-header":
        name = rnd.choice(sorted(p.name for p in d.glob("*.safetensors")))
        data = (d / name).read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        choice = rnd.choice(["json", "length", "garbage"])
        if choice == "json":
            path = rnd.choice(json_paths(header))
            header = mutate_json(header, path, rnd.choice(["replace", "delete"]), rnd.choice(JUNK + ["F8_E4M3", "X9"]))
            raw = json.dumps(header).encode()
            data = len(raw).to_bytes(8, "little") + raw + data[8 + n :]
        elif choice == "length":
            data = rnd.choice([0, 1, n - 1, n + 8, 2**62, 2**64 - 1]).to_bytes(8, "little") + data[8:]
        else:
            data = data[: rnd.randrange(0, 16)]
        replace_file(root, step, name, data)
        return step
    if kind == "loader-refused":
        # Consistent sizes and digests, a structure the schemas take: only a check that is the loader's finds it.
        choice = rnd.choice(["header", "header-encoding", "json"])
        if choice == "json":
            name, path, value = rnd.choice(LOADER_REFUSED_JSON)
            doc = json.loads((d / name).read_text())
            parent = doc
            for p in path[:-1]:
                parent = parent[p]
            if value is None:
                del parent[path[-1]]
            else:
                parent[path[-1]] = value
            replace_file(root, step, name, json.dumps(doc).encode())
            return step
        # The rank file takes an extra tensor; any file takes another encoding of the same header.
        name = (
            "rank-00000.safetensors"
            if choice == "header"
            else rnd.choice(sorted(p.name for p in d.glob("*.safetensors")))
        )
        data = (d / name).read_bytes()
        n = int.from_bytes(data[:8], "little")
        raw = data[8 : 8 + n].rstrip(b" ")
        if choice == "header":
            end = max(e["data_offsets"][1] for k, e in json.loads(raw).items() if k != "__metadata__")
            raw = raw_header_edit(raw, end, rnd)
        else:
            raw = raw.decode().encode(rnd.choice(["utf-16", "utf-16-le", "utf-32", "utf-8-sig"]))
        replace_file(root, step, name, len(raw).to_bytes(8, "little") + raw + data[8 + n :])
        return step
    if kind == "file-list":
        doc = manifest(root, step)
        name = rnd.choice(sorted(doc["files"]))
        action = rnd.choice(["delete-file", "unlist", "dir-instead", "extra"])
        if action == "delete-file":
            (d / name).unlink()
        elif action == "unlist":
            del doc["files"][name]
            write_manifest(root, step, doc)
        elif action == "dir-instead":
            (d / name).unlink()
            (d / name).mkdir()
        else:
            (d / "extra.bin").write_bytes(b"x" * 10)
        return step
    if kind == "bytes":
        name = rnd.choice(sorted(p.name for p in d.iterdir() if p.name != "manifest.json"))
        data = bytearray((d / name).read_bytes())
        if rnd.random() < 0.5 and data:
            data[rnd.randrange(len(data))] ^= 1 << rnd.randrange(8)
        else:
            data = data[: rnd.randrange(len(data) + 1)]
        (d / name).write_bytes(bytes(data))
        return step
    if kind == "link-inside":
        name = rnd.choice(sorted(p.name for p in d.iterdir() if p.name != "manifest.json"))
        target = outside / f"copy-{step}-{name}"
        shutil.copy(d / name, target)
        (d / name).unlink()
        os.symlink(target, d / name)
        return step
    if kind == "stray":
        action = rnd.choice(["file", "empty-dir", "link-dir", "link-file", "manifest-dir"])
        if action == "file":
            (root / "step-000000009").write_bytes(os.urandom(16))
        elif action == "empty-dir":
            (root / "step-000000007").mkdir(exist_ok=True)
        elif action == "link-dir":
            target = outside / "linked-step"
            if not target.exists():
                shutil.copytree(d, target)
            if not (root / "step-000000005").exists():
                os.symlink(target, root / "step-000000005")
        elif action == "link-file":
            if not (root / "step-000000003").exists():
                os.symlink(outside / "sentinel", root / "step-000000003")
        else:
            (root / "step-000000008").mkdir(exist_ok=True)
            (root / "step-000000008" / "manifest.json").mkdir(exist_ok=True)
        return None
    if kind == "latest":
        latest = root / "LATEST"
        if latest.is_dir():
            return None
        latest.write_bytes(rnd.choice([b"", os.urandom(8), b"step-000000009", b"../../etc", b"step-000000004"]))
        return None
    raise AssertionError(kind)


def assert_loads(store: CheckpointStore, info) -> None:
    """Every file of a checkpoint through the loaders themselves, past gentrain's checks: the safetensors
    library on every tensor file, the RNG setters on every rank's state (the process's own RNG restored
    after), and the schedule, scaler and EMA settings through the `load_state_dict` of a fresh part."""
    files = info.manifest.files
    for name in files:
        if name.endswith(".safetensors"):
            safetensors_load(store.read_file(info, name))
    saved_rng = rng_state()
    try:
        for name in files:
            if name.startswith("rank-") and name.endswith(".safetensors"):
                values = json.loads(store.read_file(info, name.removesuffix(".safetensors") + ".json"))
                set_rng_state(safetensors_load(store.read_file(info, name)), values["rng"])
    finally:
        set_rng_state(*saved_rng)
    if "trainer.json" in files:
        for state in json.loads(store.read_file(info, "trainer.json"))["parts"].values():
            sched = torch.optim.lr_scheduler.LambdaLR(
                torch.optim.SGD([torch.zeros(1, requires_grad=True)]), lambda s: 1
            )
            sched.load_state_dict(dict(state["lr_schedule"]))
            if state.get("ema"):
                EMAModel([torch.nn.Parameter(torch.zeros(1))]).load_state_dict(
                    {**state["ema"], "shadow_params": [torch.zeros(1)]}
                )


def cli(argv: list[str]) -> tuple[int, str]:
    """`gentrain ARGV` in this process (torch is already imported): exit code, stdout + stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except Exception:
            code, _ = -1, err.write(traceback.format_exc())
    return code, out.getvalue() + err.getvalue()


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (not following links) with its digest."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            p = Path(dirpath) / f
            out[str(p)] = "link" if p.is_symlink() else blake3.blake3(p.read_bytes()).hexdigest()
    return out


def prepare(reference: Path, work: Path, muts) -> tuple[Path, Path, set[int]]:
    shutil.rmtree(work, ignore_errors=True)
    root, outside = work / "run" / "checkpoints", work / "outside"
    root.mkdir(parents=True)
    outside.mkdir()
    (outside / "sentinel").write_text("keep me")
    for step in (2, 4):
        shutil.copytree(step_dir(reference, step), step_dir(root, step))
    (root / "LATEST").write_text("step-000000004")
    touched = set()
    for kind, step, rnd in muts:
        if step in touched and kind not in ("stray", "latest"):
            continue  # one mutation per step dir: each starts from what gentrain wrote
        s = apply(root, outside, kind, step, rnd)
        if s is not None:
            touched.add(s)
    return root, outside, touched


@pytest.mark.slow
@settings(
    max_examples=IN_PROCESS_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(muts=mutations())
def test_fuzzed_roots_are_listed_verified_and_pruned_without_errors_or_losses(reference, tmp_path_factory, muts):
    work = tmp_path_factory.getbasetemp() / "fuzz-in-process"
    root, outside, touched = prepare(reference, work, muts)
    before_outside = snapshot(outside)
    store = CheckpointStore(str(root), keep=10)
    valid = {}
    for info in store.list():  # never raises, whatever the root holds
        valid[info.step] = info.valid and not store.verify(info)
        assert info.valid or info.reason
    for step in {2, 4} - touched:
        assert valid.get(step), (
            f"untouched step {step} lost: {store.check(step).reason} {store.verify(store.check(step))}"
        )
    for step, ok in valid.items():  # whatever verify accepts, the loaders load (#35)
        if ok:
            assert_loads(store, store.check(step))
    newest = store.latest_valid(deep=True)
    want = max((s for s, ok in valid.items() if ok), default=None)
    assert (newest.step if newest else None) == want
    # A save after it: replaces an invalid step 4 (or writes step 6), prunes, never touches what lies outside.
    step = 4 if 4 in touched else 6
    store.write(step, {"w.safetensors": {"w": torch.zeros(4)}}, {})
    assert store.check(step).valid and not store.verify(store.check(step))
    for s in {2, 4} - touched:
        assert store.check(s).valid, f"untouched step {s} deleted by retention"
    assert snapshot(outside) == before_outside, "something outside the root changed"


@pytest.mark.slow
@settings(
    max_examples=END_TO_END_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(muts=mutations(loader_refused=False))
def test_training_on_a_fuzzed_root_resumes_exactly_or_starts_over(reference, tmp_path_factory, muts):
    work = tmp_path_factory.getbasetemp() / "fuzz-e2e"
    root, outside, _ = prepare(reference, work, muts)
    before_outside = snapshot(outside)
    store = CheckpointStore(str(root))
    valid_before = {i.step for i in store.list() if i.valid and not store.verify(i)}
    newest = max(valid_before, default=None)
    fingerprints = {s: store.check(s).fingerprint for s in valid_before}
    # The read-only commands on the same root. verify agrees with what training will resume from. A
    # checkpoint whose training state is intact but whose stored config cannot build a model (a fuzzed
    # manifest config) still resumes training (which runs the user's config); verify refuses it with exit 1
    # and a message. sample reads what it loads (#51): it draws from the newest checkpoint whose loaded
    # files pass, which may be newer than verify's (the optimizer state it never reads fails there), never
    # older, and it finds one whenever verify does.
    verified, out = cli(["checkpoints", "verify", str(root)])
    assert verified in (0, 1) and (verified == 0) <= (newest is not None) and "Traceback" not in out, out[-3000:]
    code, out = cli(["sample", str(root), "--num", "1", "--steps", "1", "--out", str(work / "s.png")])
    assert "Traceback" not in out and code in (0, 1) and code <= verified, out[-3000:]
    if code == 0 and newest is not None:
        drawn = re.search(r"\(step (\d+)\)", out)
        assert drawn is not None and int(drawn.group(1)) >= newest, out[-3000:]
    r = run_cli("train", *tiny(work, "checkpoint.every_steps=2", "checkpoint.keep=10", max_steps=6))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    resumed = f"resumed_from={step_dir(root, newest)}" if newest else "resumed_from=none (fresh start)"
    assert resumed in r.stderr, f"expected {resumed}: {r.stderr[-3000:]}"
    for step in valid_before:  # keep=10: every valid checkpoint is still there and still valid
        assert store.check(step).valid and not store.verify(store.check(step)), f"valid step {step} lost"
    # Every step it saved past the one it resumed from is its own timeline's: a step another timeline left
    # there (the reference run's, valid or not) was replaced, never kept; older steps keep their writer.
    start = newest or 0
    ours = {s: store.check(s).manifest.timeline for s in (2, 4, 6) if s > start}
    assert len(set(ours.values())) == 1 and None not in ours.values(), ours
    if start < 6:
        assert ours[6] != manifest(reference, 6)["timeline"], "the reference run's step 6 was kept"
    for s in valid_before:
        if s <= start:  # the step it resumed from and older ones: never rewritten
            assert store.check(s).fingerprint == fingerprints[s], f"step {s} was rewritten"
    # Whatever it resumed from (a valid step 4 or 2, or nothing), step 6 is the uninterrupted run's.
    for name in ("unet.model.safetensors", "unet.ema.safetensors", "unet.optimizer.safetensors"):
        got, want = read_tensors(root, 6, name), read_tensors(reference, 6, name)
        assert all(torch.equal(got[k], want[k]) for k in want), f"{name} differs: a wrong state was loaded"
    assert snapshot(outside) == before_outside
