"""A checkpoint is read through one view (issue 37): no module outside `trainer/checkpoint/` interprets a
manifest; the view gives a part's weights, digests, part steps, identity and the recorded inputs; a
config is parsed once per view (`gentrain sample` parses it once); readers get a store that cannot write."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import REPO

import trainer.runs
from trainer.checkpoint import CheckpointReader, CheckpointStore, CheckpointView, InvalidCheckpoint, resolve_checkpoint
from trainer.checkpoint.format import new_digest
from trainer.checkpoint.store import Timeline
from trainer.cli import main as cli_main
from trainer.errors import CheckpointCorrupt, ConfigError
from trainer.runs import config_of

PACKAGE = REPO / "trainer"
GOLDEN = REPO / "tests" / "golden" / "digits-ddpm" / "checkpoints"


def _manifest_reads(source: str) -> list[int]:
    """Lines that read an attribute named `manifest` (`info.manifest[...]`, `.get(...)`, passing it on)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr == "manifest" and isinstance(node.ctx, ast.Load)
    ]


def test_no_module_outside_the_checkpoint_library_reads_a_manifest():
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if PACKAGE / "checkpoint" not in p.parents]
    assert len(outside) > 50 and PACKAGE / "cli.py" in outside and PACKAGE / "runs.py" in outside
    found = [
        f"{path.relative_to(REPO)}:{line}" for path in outside for line in _manifest_reads(path.read_text("utf-8"))
    ]
    assert found == [], "read the checkpoint through trainer.checkpoint.view.CheckpointView instead"


def test_views_come_from_their_reader_outside_the_checkpoint_library():
    """`reader.view(info)` (or `resolve_checkpoint`, `candidate_views`), never `CheckpointView(reader, info)` by
    hand (issue 51): in the package, its tests and its benchmarks."""
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if PACKAGE / "checkpoint" not in p.parents]
    outside += sorted((REPO / "tests").rglob("*.py")) + sorted((REPO / "bench").rglob("*.py"))
    assert REPO / "tests" / "test_export.py" in outside and REPO / "bench" / "latent_digits.py" in outside
    found = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in outside
        for node in ast.walk(ast.parse(path.read_text("utf-8")))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == "CheckpointView"  # a name or module.name
    ]
    assert found == [], "get the view from its reader or store: reader.view(info)"


def test_the_manifest_check_finds_reads_and_leaves_writes_alone():
    source = "def f(info, other):\n    other.manifest = 1\n    return info.manifest['files'], g(info.manifest)\n"
    assert _manifest_reads(source) == [3, 3]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 2, generator=g), "b": torch.randn(3, generator=g)}


def _blake3(path: Path) -> str:
    return "blake3:" + new_digest("blake3").update(path.read_bytes()).hexdigest()


@pytest.fixture
def written(tmp_path):
    """A committed checkpoint written by a known timeline: `unet` with EMA weights, `vae` without, a frozen
    source record and a pinned input, each with its digest."""
    store = CheckpointStore(str(tmp_path / "root"))
    store.timeline = Timeline("aaaa1111", "bbbb2222", "job-1")
    files = {
        "unet.model.safetensors": _tensors(1),
        "unet.ema.safetensors": _tensors(2),
        "vae.model.safetensors": _tensors(3),
    }
    frozen = {"autoencoder": {"url": "s3://b/ae/step-000000003", "step": 3, "file": "generator.ema.safetensors"}}
    frozen["autoencoder"]["digest"] = "blake3:" + "a" * 64
    inputs = {"text_encoder": {"url": "/enc", "digest": "blake3:" + "b" * 64, "pin": True}}
    meta = {"config": {"task": "ddpm", "seed": 7}, "frozen": frozen, "inputs": inputs, "world_size": 2}
    info = store.write(5, files, {**meta, **store.timeline.fields()}).info  # as CheckpointManager._meta records it
    return CheckpointReader(store.url).view(info), files, tmp_path / "root" / "step-000000005"


def test_the_view_gives_part_weights_digests_identity_and_what_the_run_recorded(written):
    view, files, step_dir = written
    assert (view.step, view.run, view.timeline, view.job, view.world_size) == (5, "aaaa1111", "bbbb2222", "job-1", 2)
    assert "run aaaa1111 (timeline bbbb2222, job job-1" in view.owner
    assert sorted(view.file_names) == sorted(files) and view.digest_algorithms == ["blake3"]
    assert view.parts_with_weights == ["unet", "vae"] and not view.is_sharded
    # EMA weights by default where there are any, the online ones otherwise; a missing part names the others.
    assert view.weights_name("unet", use_ema=True) == "unet.ema.safetensors"
    assert view.weights_name("unet", use_ema=False) == "unet.model.safetensors"
    assert view.weights_name("vae", use_ema=True) == "vae.model.safetensors"
    with pytest.raises(ConfigError, match=r"has no part 'text' \(its parts: unet, vae\)"):
        view.weights_name("text", use_ema=True)
    for part, use_ema, name in (("unet", True, "unet.ema.safetensors"), ("vae", True, "vae.model.safetensors")):
        got = view.part_weights(part, use_ema)
        assert got.keys() == files[name].keys() and all(torch.equal(got[k], files[name][k]) for k in got)
        assert view.file_digest(name) == _blake3(step_dir / name)  # the digest of the bytes on disk
    assert view.whole_file_digests(["unet", "vae"], use_ema=True) == {
        "unet.ema.safetensors": _blake3(step_dir / "unet.ema.safetensors")
    }
    # The digests of what the run was trained with: its frozen autoencoder and its pinned text encoder.
    assert view.frozen_record("autoencoder").digest == "blake3:" + "a" * 64
    assert view.inputs["text_encoder"].digest == "blake3:" + "b" * 64
    view.frozen_records["autoencoder"].digest = "changed"  # a read-only view: callers get copies
    view.inputs["text_encoder"].pin = False
    view.config_tree["seed"] = 8
    assert view.frozen_record("autoencoder").digest == "blake3:" + "a" * 64 and view.inputs["text_encoder"].pin
    assert view.config_tree == {"task": "ddpm", "seed": 7}
    assert "files" not in view.metadata() and view.metadata()["world_size"] == 2
    # As the manifest holds it, in its order (a consolidated copy writes the same JSON).
    assert list(view.metadata()) == ["config", "frozen", "inputs", "world_size", "run", "timeline", "job"]
    # Weights only (no trainer.json): no part steps, as for a consolidated copy.
    assert not view.holds_training_state and view.part_steps() is None


def test_the_view_of_a_sharded_part_names_its_group_and_digests_its_shards(tmp_path):
    store = CheckpointStore(str(tmp_path))
    shards = {f"unet.model.rank-{r:05d}.safetensors": _tensors(r) for r in range(2)}
    view = store.view(store.write(1, shards, {}).info)
    assert view.weights_name("unet", use_ema=True) == "unet.model"
    h = new_digest("blake3")
    for name in sorted(shards):
        h.update(f"{name} {_blake3(tmp_path / 'step-000000001' / name)}\n".encode())
    assert view.file_digest("unet.model") == f"blake3-shards:{h.hexdigest()}"
    with pytest.raises(KeyError):
        view.file_digest("unet.ema")


def test_a_view_needs_a_committed_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path))
    (tmp_path / "step-000000004").mkdir()
    info = store.check(4)
    assert not info.valid
    with pytest.raises(CheckpointCorrupt, match="no manifest.json"):
        store.view(info)


def test_resolve_checkpoint_gives_a_checked_view_or_says_why_there_is_none(tmp_path):
    store = CheckpointStore(str(tmp_path))
    assert resolve_checkpoint(str(tmp_path)) is None  # an empty root
    info = store.write(3, {"unet.model.safetensors": _tensors(1)}, {}).info
    (tmp_path / "step-000000004").mkdir()  # newer, never committed: not the root's checkpoint
    view = resolve_checkpoint(str(tmp_path))
    assert isinstance(view, CheckpointView) and view.step == 3 and view.reader.url == store.url
    assert resolve_checkpoint(info.url).step == 3
    with pytest.raises(InvalidCheckpoint, match="step-000000004: no manifest.json") as e:
        resolve_checkpoint(str(tmp_path / "step-000000004"))
    assert e.value.info.step == 4 and not e.value.info.valid


def test_a_config_is_parsed_once_per_view_and_part_steps_come_from_trainer_json(monkeypatch):
    parses = []
    real = trainer.runs.config_from_dict
    monkeypatch.setattr(trainer.runs, "config_from_dict", lambda tree: parses.append(1) or real(tree))
    view = resolve_checkpoint(str(GOLDEN))
    cfg = config_of(view)
    assert config_of(view) is cfg and cfg.task == "ddpm" and len(parses) == 1
    assert config_of(view.reader.view(view.info)) is not cfg and len(parses) == 2  # a new view parses again
    assert view.holds_training_state and view.part_steps() == {"unet": 2}


def test_gentrain_sample_parses_the_config_once(monkeypatch, tmp_path, capsys):
    parses = []
    real = trainer.runs.config_from_dict
    monkeypatch.setattr(trainer.runs, "config_from_dict", lambda tree: parses.append(1) or real(tree))
    out = tmp_path / "grid.png"
    assert cli_main(["sample", str(GOLDEN), "--num", "2", "--steps", "1", "--out", str(out)]) == 0
    assert out.is_file() and len(parses) == 1, capsys.readouterr().out


def test_readers_get_a_store_that_cannot_write_or_prune():
    view = resolve_checkpoint(str(GOLDEN))
    reader, info = view.reader, view.info
    assert isinstance(reader, CheckpointReader) and not isinstance(reader, CheckpointStore)
    assert not any(hasattr(reader, m) for m in ("write", "commit", "claim", "apply_retention", "_remove_step"))
    assert info.valid and reader.latest_valid().step == info.step == 2
