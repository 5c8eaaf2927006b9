"""A checkpoint root holds whatever anyone with write access put there: discovery, verify, resume, sampling,
retention and re-saves agree on what is valid, fall back past anything else, and never lose a valid one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ckpt_tamper import edit_json, edit_tensors, flip_byte, manifest, read_tensors, replace_file, step_dir
from conftest import REPO, clean_env, run_cli, tiny
from helpers import assert_tensors_equal

from trainer.checkpoint import CheckpointStore
from trainer.checkpoint.layout import eval_result_name

STEPS = ("unet.model.safetensors", "unet.ema.safetensors", "unet.optimizer.safetensors")


@pytest.fixture(scope="module")
def run4(tmp_path_factory) -> tuple[Path, list[str]]:
    """A real 4-step digits-ddpm run with checkpoints at steps 2 and 4; its args rerun it."""
    base = tmp_path_factory.mktemp("run4")
    args = tiny(base, "checkpoint.every_steps=2", "checkpoint.keep=10", max_steps=4)
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return base / "run" / "checkpoints", args


@pytest.fixture
def root(run4, tmp_path) -> Path:
    """A private copy of the run's checkpoint root (tests tamper with it)."""
    out = tmp_path / "run" / "checkpoints"
    shutil.copytree(run4[0], out)
    return out


def rerun(root: Path, *extra: str, max_steps: int = 4) -> subprocess.CompletedProcess:
    args = tiny(root.parent.parent, "checkpoint.every_steps=2", "checkpoint.keep=10", *extra, max_steps=max_steps)
    return run_cli("train", *args)


def no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr + r.stdout, (r.stdout + r.stderr)[-3000:]


def assert_same_step(root: Path, reference: Path, step: int) -> None:
    for name in STEPS:
        assert_tensors_equal(
            read_tensors(root, step, name), read_tensors(reference, step, name), f"{name} vs uninterrupted"
        )


# ------------------------------------------------------------------ 1. a re-save replaces an invalid step


@pytest.mark.slow
def test_retrained_step_replaces_the_corrupt_checkpoint_it_fell_back_from(root, run4):
    flip_byte(root, 4, "unet.ema.safetensors")
    r = rerun(root)
    assert r.returncode == 0, r.stderr[-3000:]
    no_traceback(r)
    assert "trying the previous one" in r.stderr
    assert "is invalid" in r.stderr and "replacing it" in r.stderr
    assert run_cli("checkpoints", "verify", str(step_dir(root, 4))).returncode == 0
    assert_same_step(root, run4[0], 4)  # resumed at step 2, re-trained 3-4 exactly


def test_retention_counts_only_valid_checkpoints(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    for step in (2, 4):
        store.write(step, {"w.safetensors": {"w": torch.full((64,), float(step))}}, {})
    flip_byte(tmp_path, 4, "w.safetensors")  # step 4 keeps its size: only its digest tells
    store2 = CheckpointStore(str(tmp_path), keep=2)  # a new process: nothing verified yet
    store2.write(6, {"w.safetensors": {"w": torch.full((64,), 6.0)}}, {})
    assert store2.steps() == [2, 6], "the corrupt step 4 must not count; step 2 is one of the 2 valid ones"


# ------------------------------------------------------------------ 2. malformed entries anywhere in the root


MALFORMED = {
    "files-is-a-list": lambda m: {**m, "files": list(m["files"])},
    "bytes-is-text": lambda m: {**m, "files": {k: {**v, "bytes": "abc"} for k, v in m["files"].items()}},
    "bytes-missing": lambda m: {**m, "files": {k: {"blake3": v["blake3"]} for k, v in m["files"].items()}},
    "top-level-list": lambda m: [m],
    "path-escape": lambda m: {**m, "files": {"../../x.json": next(iter(m["files"].values()))}},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_manifest_in_an_older_step_is_one_invalid_candidate(root, case):
    path = step_dir(root, 2) / "manifest.json"
    path.write_text(json.dumps(MALFORMED[case](manifest(root, 2))))
    infos = CheckpointStore(str(root)).list()
    assert [(i.step, i.valid) for i in infos] == [(2, False), (4, True)]
    assert infos[0].reason


@pytest.mark.slow
def test_list_verify_sample_and_train_survive_a_stray_file_and_a_malformed_manifest(root, tmp_path):
    (root / "step-000000009").write_text("not a checkpoint")
    path = step_dir(root, 2) / "manifest.json"
    path.write_text(json.dumps(MALFORMED["bytes-is-text"](manifest(root, 2))))
    listed = run_cli("checkpoints", "list", str(root))
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "INVALID" in listed.stdout and "valid (LATEST)" in listed.stdout
    verified = run_cli("checkpoints", "verify", str(root))
    assert verified.returncode == 0 and "step 4" in verified.stdout, verified.stdout + verified.stderr
    sampled = run_cli("sample", str(root), "--num", "2", "--out", str(tmp_path / "g.png"), "--steps", "2")
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    trained = rerun(root, max_steps=6)
    assert trained.returncode == 0, trained.stderr[-3000:]
    for r in (listed, verified, sampled, trained):
        no_traceback(r)
    assert (root / "step-000000009").read_text() == "not a checkpoint"  # not ours to delete


# ------------------------------------------------------------------ 3. digest-consistent but malformed payloads


def _header_too_long(root):
    data = bytearray((step_dir(root, 4) / "unet.ema.safetensors").read_bytes())
    data[:8] = (2**62).to_bytes(8, "little")
    replace_file(root, 4, "unet.ema.safetensors", bytes(data))


def _header_not_json(root):
    data = bytearray((step_dir(root, 4) / "unet.model.safetensors").read_bytes())
    data[8:12] = b"}}}}"
    replace_file(root, 4, "unet.model.safetensors", bytes(data))


def _header_dtype_list(root):
    """Found by the fuzz suite: a dtype that is a JSON list made the header check raise TypeError."""
    data = (step_dir(root, 4) / "unet.model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["dtype"] = ["F32"]
    raw = json.dumps(header).encode()
    replace_file(root, 4, "unet.model.safetensors", len(raw).to_bytes(8, "little") + raw + data[8 + n :])


def _progress(edit):
    def tamper(root):
        edit_json(root, 4, "trainer.json", lambda d: {**d, "progress": edit(d["progress"])})

    return tamper


def _ema_wrong_shape(root):
    def edit(t):
        key = sorted(k for k in t if t[k].ndim == 4)[0]
        t[key] = torch.zeros(t[key].shape[0] + 1, *t[key].shape[1:])
        return t

    edit_tensors(root, 4, "unet.ema.safetensors", edit)


PAYLOADS = {
    "safetensors-header-2^62": _header_too_long,
    "safetensors-header-not-json": _header_not_json,
    "safetensors-dtype-list": _header_dtype_list,
    "trainer-json-list": lambda root: edit_json(root, 4, "trainer.json", lambda d: [d]),
    "step-null": _progress(lambda p: {**p, "step": None}),
    "cursor-negative": _progress(lambda p: {**p, "cursor": -64}),
    "rng-string": lambda root: edit_json(root, 4, "rank-00000.json", lambda d: {"rng": "abc"}),
    "ema-wrong-shape": _ema_wrong_shape,
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_verify_finds_digest_consistent_malformed_payloads(root, case):
    PAYLOADS[case](root)
    store = CheckpointStore(str(root))
    info = store.check(4)
    assert info.valid, "sizes and digests agree: only the structure is wrong"
    assert store.verify(info), f"{case} passed verify"
    assert store.latest_valid(deep=True).step == 2


@pytest.mark.slow
@pytest.mark.parametrize("case", ["safetensors-header-2^62", "cursor-negative", "ema-wrong-shape", "rng-string"])
def test_resume_falls_back_past_a_malformed_payload_and_ends_bit_identical(root, run4, case):
    PAYLOADS[case](root)
    r = rerun(root)
    assert r.returncode == 0, r.stderr[-3000:]
    no_traceback(r)
    assert "trying the previous one" in r.stderr
    assert_same_step(root, run4[0], 4)


# ------------------------------------------------------------------ 4. sample / eval on a corrupt newest


@pytest.mark.slow
def test_sample_on_a_root_whose_newest_fails_its_digest_uses_the_newest_valid(root, tmp_path):
    flip_byte(root, 4, "unet.optimizer.safetensors")
    r = run_cli("sample", str(root), "--num", "2", "--out", str(tmp_path / "g.png"), "--steps", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    no_traceback(r)
    assert "(step 2)" in r.stdout
    named = run_cli("sample", str(step_dir(root, 4)), "--num", "2", "--out", str(tmp_path / "h.png"))
    assert named.returncode == 1 and "does not match" in named.stderr, named.stderr[-2000:]
    no_traceback(named)


@pytest.mark.slow
def test_eval_on_a_root_whose_newest_fails_its_digest_evaluates_the_newest_valid(root, tmp_path):
    flip_byte(root, 4, "unet.model.safetensors")
    r = run_cli("eval", str(root), "--num", "8", "--steps", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    no_traceback(r)
    assert (root / eval_result_name(2)).is_file() and not (root / eval_result_name(4)).exists()
    assert json.loads(r.stdout.splitlines()[0])["step"] == 2


@pytest.mark.slow
def test_sample_says_which_weights_do_not_fit_the_model_when_model_and_ema_agree_on_a_wrong_shape(root, tmp_path):
    # Digest-consistent and self-consistent (model and EMA alike), so only building the model tells.
    def grow(t):
        key = sorted(k for k in t if t[k].ndim == 4)[0]
        t[key] = torch.zeros(t[key].shape[0] + 1, *t[key].shape[1:])
        return t

    for name in ("unet.model.safetensors", "unet.ema.safetensors"):
        edit_tensors(root, 4, name, grow)
    r = run_cli("sample", str(step_dir(root, 4)), "--num", "1", "--out", str(tmp_path / "g.png"), "--steps", "1")
    assert r.returncode == 1, r.stderr[-2000:]
    no_traceback(r)
    assert "gentrain: checkpoint error:" in r.stderr and "do not fit its model" in r.stderr, r.stderr[-2000:]
    assert "unet.ema.safetensors" in r.stderr


# ------------------------------------------------------------------ 5. links are never followed


@pytest.mark.slow
def test_retention_never_deletes_through_a_step_dir_that_is_a_link(root, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(step_dir(root, 2), outside)
    shutil.rmtree(step_dir(root, 2))
    os.symlink(outside, step_dir(root, 2))
    before = sorted(p.name for p in outside.iterdir())
    r = rerun(root, "checkpoint.keep=1", max_steps=8)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in outside.iterdir()) == before, "retention deleted files outside the root"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "step-000000002", "step-000000008"]
    assert CheckpointStore(str(root)).check(2).reason.startswith("is a symbolic link")


@pytest.mark.slow
def test_a_link_named_like_the_step_being_saved_is_replaced_by_a_real_checkpoint_and_its_target_kept(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    CheckpointStore(str(outside)).write(2, {"w.safetensors": {"w": torch.zeros(8)}}, {})
    root.mkdir()
    os.symlink(step_dir(outside, 2), step_dir(root, 2))
    before = sorted(p.name for p in step_dir(outside, 2).iterdir())
    store = CheckpointStore(str(root))
    store.write(2, {"w.safetensors": {"w": torch.ones(8)}}, {})
    assert not os.path.islink(step_dir(root, 2)) and store.check(2).valid
    assert_tensors_equal(read_tensors(root, 2, "w.safetensors")["w"], torch.ones(8), "the new checkpoint")
    assert sorted(p.name for p in step_dir(outside, 2).iterdir()) == before, "the link's target was touched"
    assert_tensors_equal(read_tensors(outside, 2, "w.safetensors")["w"], torch.zeros(8), "the link's target")


# ------------------------------------------------------------------ 6. a failed save leaves no debris


@pytest.mark.slow
def test_a_save_that_fills_the_disk_leaves_no_partial_step_dir(tmp_path):
    # RLIMIT_FSIZE makes the kernel refuse writes past 64 KiB, as a full disk would (EFBIG instead of ENOSPC).
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        from trainer.checkpoint import CheckpointStore, CheckpointError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        store = CheckpointStore({str(tmp_path)!r})
        store.write(1, {{"w.safetensors": {{"w": torch.zeros(16)}}}}, {{}})
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        try:
            store.write(2, {{"a.safetensors": {{"w": torch.zeros(1 << 16)}}}}, {{}})
        except OSError as e:
            print("refused", e.errno)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=clean_env(), timeout=120
    )
    assert "refused" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-000000001"]
