"""The run's compile cache (trainer/engine/compile_cache.py, issue 49): a replacement worker with an empty local
inductor cache restores what an earlier worker of the run compiled, signed with a key the store never sees;
an unsigned, tampered, foreign or malformed archive is ignored with a warning; results are bit-identical with
and without it."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import fsspec
import pytest
import torch
from conftest import clean_env, run_cli, tiny
from safetensors.torch import load_file

from trainer.engine import compile_cache as cc

KEY = b"a key from a Kubernetes Secret"
IDENT = {"torch": "2.x", "python": "3.x", "device": "cpu:x86_64:AVX2", "model": "m" * 64}


def _cache(folder: Path) -> Path:
    (folder / "fxgraph" / "ab").mkdir(parents=True)
    (folder / "fxgraph" / "ab" / "entry").write_bytes(b"graph entry")
    (folder / "kernel.so").write_bytes(bytes(range(256)) * 10)
    (folder / "locks").mkdir()
    (folder / "locks" / "x.lock").write_bytes(b"")
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def store(tmp_path):
    fs = fsspec.filesystem("file")
    return fs, str(tmp_path / "root")


def test_a_saved_cache_restores_into_an_empty_folder_file_for_file(tmp_path, store):
    fs, root = store
    source = _cache(tmp_path / "source")
    url = cc.save(fs, root, IDENT, KEY, source)
    assert url and url.endswith(".tar") and "/compile-cache/" in url
    assert cc.save(fs, root, IDENT, KEY, source) is None  # once per identity
    target = tmp_path / "target"
    assert cc.is_empty(target)
    restored, why = cc.restore(fs, root, IDENT, KEY, target)
    assert restored, why
    assert _files(target) == {k: v for k, v in _files(source).items() if not k.endswith(".lock")}


def test_without_the_key_nothing_is_saved_or_restored(monkeypatch):
    monkeypatch.delenv(cc.KEY_ENV, raising=False)
    assert cc.cache_key() is None
    assert cc.RunCompileCache.for_run(fsspec.filesystem("file"), "/nowhere", torch.device("cpu"), {}) is None
    monkeypatch.setenv(cc.KEY_ENV, "k")
    assert cc.cache_key() == b"k"


def _tamper_tar(fs, root: str, change) -> None:
    base = f"{root}/{cc.FOLDER}/{cc.archive_name(IDENT)}"
    data = bytearray(fs.cat_file(base + ".tar"))
    change(data)
    fs.pipe_file(base + ".tar", bytes(data))


@pytest.mark.parametrize(
    "how, why",
    [
        ("another key", "signature does not match"),
        ("a flipped byte", "bytes do not match its signed digest"),
        ("a forged digest", "signature does not match"),
        ("another identity", "identity is another"),
        ("a huge json", "over"),
        ("a torn archive", "not the size its JSON records"),
    ],
)
def test_an_unsigned_tampered_or_foreign_archive_is_ignored(tmp_path, store, how, why):
    fs, root = store
    cc.save(fs, root, IDENT, KEY, _cache(tmp_path / "source"))
    base = f"{root}/{cc.FOLDER}/{cc.archive_name(IDENT)}"
    meta = json.loads(fs.cat_file(base + ".json"))
    key = KEY
    if how == "another key":
        key = b"not the run's key"
    elif how == "a flipped byte":
        _tamper_tar(fs, root, lambda d: d.__setitem__(len(d) // 2, d[len(d) // 2] ^ 1))
    elif how == "a forged digest":  # a writer of the store swaps the archive and records its digest
        _tamper_tar(fs, root, lambda d: d.__setitem__(len(d) // 2, d[len(d) // 2] ^ 1))
        meta["sha256"] = hashlib.sha256(fs.cat_file(base + ".tar")).hexdigest()
        fs.pipe_file(base + ".json", json.dumps(meta).encode())
    elif how == "another identity":
        meta["identity"] = {**IDENT, "torch": "9.9"}
        fs.pipe_file(base + ".json", json.dumps(meta).encode())
    elif how == "a huge json":
        fs.pipe_file(base + ".json", b" " * (cc._MAX_JSON + 1))
    elif how == "a torn archive":
        fs.pipe_file(base + ".tar", fs.cat_file(base + ".tar")[:100])
    target = tmp_path / "target"
    restored, reason = cc.restore(fs, root, IDENT, key, target)
    assert not restored and why in reason, reason
    assert cc.is_empty(target)


def test_a_signed_archive_still_unpacks_only_regular_files_inside_the_folder(tmp_path, store):
    """Defence in depth: even an archive signed with the key (a holder's mistake) cannot write outside the
    cache folder or leave links in it."""
    fs, root = store
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, kind in (("ok", tarfile.REGTYPE), ("link", tarfile.SYMTYPE), ("../escape", tarfile.REGTYPE)):
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.SYMTYPE:
                info.linkname = "/etc/passwd"
            else:
                info.size = 2
            tar.addfile(info, io.BytesIO(b"hi") if kind == tarfile.REGTYPE else None)
    data = buffer.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    base = f"{root}/{cc.FOLDER}/{cc.archive_name(IDENT)}"
    fs.makedirs(f"{root}/{cc.FOLDER}", exist_ok=True)
    fs.pipe_file(base + ".tar", data)
    meta = {
        "identity": IDENT,
        "sha256": digest,
        "bytes": len(data),
        "hmac": cc._signature(KEY, IDENT, digest, len(data)),
    }
    fs.pipe_file(base + ".json", json.dumps(meta).encode())
    target = tmp_path / "cache" / "inner"
    with pytest.raises(tarfile.TarError):  # the `data` filter refuses the member outside the folder
        cc.restore(fs, root, IDENT, KEY, target)
    assert not (tmp_path / "cache" / "escape").exists() and cc.is_empty(target)


def test_the_identity_separates_devices_models_and_torch_versions():
    a = cc.identity(torch.device("cpu"), {"model": {"width": 8}})
    assert a == cc.identity(torch.device("cpu"), {"model": {"width": 8}})
    assert a["torch"] == torch.__version__ and a["device"].startswith("cpu:")
    b = cc.identity(torch.device("cpu"), {"model": {"width": 16}})
    assert cc.archive_name(a) != cc.archive_name(b)


@pytest.mark.slow
def test_a_replacement_worker_restores_the_runs_compiled_kernels_and_trains_bit_identically(tmp_path):
    """Worker 1 compiles and saves the signed cache; worker 2 (an empty local cache, the run's key) restores it
    and resumes; worker 3 resumes the same checkpoint compiling from scratch (no key): the same weights."""
    dit = "{kind: dit, num_layers: 2, num_attention_heads: 2, attention_head_dim: 8}"
    base = [f"model.backbone={dit}", "train.compile=true", "checkpoint.every_steps=2", "checkpoint.keep=10"]
    args = tiny(tmp_path, *base, max_steps=2)
    first = run_cli(
        "train",
        "digits-ddpm",
        *args,
        env=clean_env(GENTRAIN_COMPILE_CACHE_KEY="k1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-1")),
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert "compile cache: saved" in first.stderr, first.stderr[-3000:]
    root = tmp_path / "run" / "checkpoints"
    assert list((root / cc.FOLDER).glob("*.tar"))

    import shutil

    shutil.copytree(root, tmp_path / "copy")
    resumed = tiny(tmp_path, *base, max_steps=4)
    second = run_cli(
        "train",
        "digits-ddpm",
        *resumed,
        env=clean_env(GENTRAIN_COMPILE_CACHE_KEY="k1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-2")),
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "compile cache: restored" in second.stderr, second.stderr[-3000:]
    with_cache = load_file(next(root.glob("step-*4")) / "transformer.model.safetensors")

    shutil.rmtree(root)
    shutil.copytree(tmp_path / "copy", root)
    third = run_cli(
        "train",
        "digits-ddpm",
        *resumed,
        env=clean_env(GENTRAIN_COMPILE_CACHE_KEY="wrong key", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-3")),
    )
    assert third.returncode == 0, third.stderr[-3000:]
    assert "compile cache: ignored the store's copy: its signature does not match" in third.stderr
    without = load_file(next(root.glob("step-*4")) / "transformer.model.safetensors")
    assert with_cache.keys() == without.keys() and all(torch.equal(with_cache[k], without[k]) for k in with_cache)
