"""Nothing a checkpoint root holds chooses code, and nothing a run writes holds a credential (#23 defects 7-9).

Anyone who can write to a bucket can rewrite a manifest (its digests cover the payload files, not the
manifest itself), so these tests edit manifests the way such a person would and recompute nothing.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env, run_cli, tiny
from helpers import assert_trackers_continued, tracker_settings

from trainer.config.redact import REDACTED, RedactingFilter, is_credential_key, redact, redact_text
from trainer.engine.report import flat_hparams
from trainer.errors import ConfigError
from trainer.eval.features import load_features
from trainer.registry import config_from_dict, load_config
from trainer.runs import load_frozen
from trainer.tasks.base import FrozenSource

EVIL_TASK = "evilmod:X"
SECRETS = {"key": "AKIAGENTRAINTEST0001", "secret": "s3cr3t-gentrain-test", "session": "FwoGZXIvYXdzEXAMPLE"}


def _storage_options() -> dict:
    return {
        "key": SECRETS["key"],
        "secret": SECRETS["secret"],
        "client_kwargs": {"region_name": "eu-west-1", "aws_session_token": SECRETS["session"]},
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real 2-step digits-ddpm checkpoint root (tiny settings), trained once for this module."""
    tmp = tmp_path_factory.mktemp("trained")
    r = run_cli("train", *tiny(tmp, max_steps=2))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run" / "checkpoints"


def _evil_module(folder: Path) -> Path:
    """`evilmod.py` in `folder`: importing it writes a marker file. Returns the marker's path."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "IMPORTED"
    (folder / "evilmod.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nX = object\n")
    return marker


def _rewrite_manifests(root: Path, edit) -> None:
    for manifest in root.glob("step-*/manifest.json"):
        doc = json.loads(manifest.read_text())
        edit(doc)
        manifest.write_text(json.dumps(doc, indent=1))


def _name_task(doc: dict, task: str = EVIL_TASK) -> None:
    doc["task"] = task
    doc["config"]["task"] = task


def _copy(trained: Path, tmp_path: Path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(trained, root)
    return root


def _run_beside(mods: Path, *args: str):
    """`python -m trainer ARGS` with cwd and PYTHONPATH holding evilmod.py, as in the report."""
    return run_cli(*args, cwd=mods, env=clean_env(PYTHONPATH=os.pathsep.join([str(mods), str(REPO)])))


# ---------------------------------------------------------------- 7: a checkpoint never chooses code


@pytest.mark.slow
def test_sample_refuses_a_task_import_path_that_only_the_checkpoint_names(trained, tmp_path):
    root = _copy(trained, tmp_path)
    _rewrite_manifests(root, _name_task)
    mods = tmp_path / "mods"
    marker = _evil_module(mods)

    r = _run_beside(mods, "sample", str(root), "--num", "2", "--out", str(tmp_path / "g.png"))
    assert r.returncode == 2, r.stderr[-3000:]
    assert EVIL_TASK in r.stderr and "--task" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_a_task_given_on_the_command_line_must_match_the_checkpoints(trained, tmp_path):
    root = _copy(trained, tmp_path)
    _rewrite_manifests(root, _name_task)
    mods = tmp_path / "mods"
    marker = _evil_module(mods)

    r = _run_beside(mods, "sample", str(root), "--task", "othermod:Y", "--out", str(tmp_path / "g.png"))
    assert r.returncode == 2, r.stderr[-3000:]
    assert EVIL_TASK in r.stderr and "othermod:Y" in r.stderr
    assert not marker.exists()

    # A built-in checkpoint with another --task is refused too, naming both.
    r = run_cli("sample", str(trained), "--task", "vqgan", "--out", str(tmp_path / "g.png"))
    assert r.returncode == 2 and "vqgan" in r.stderr and "'ddpm'" in r.stderr, r.stderr[-3000:]

    # The user naming the same import path is trusted: the import happens (this module is no task, so the
    # run then stops with a config error of its own).
    r = _run_beside(mods, "sample", str(root), "--task", EVIL_TASK, "--out", str(tmp_path / "g.png"))
    assert marker.exists(), r.stderr[-3000:]
    assert "must be the same" not in r.stderr and "import path" not in r.stderr


@pytest.mark.slow
def test_eval_and_export_refuse_a_task_import_path_from_the_checkpoint(trained, tmp_path):
    root = _copy(trained, tmp_path)
    _rewrite_manifests(root, _name_task)
    mods = tmp_path / "mods"
    marker = _evil_module(mods)

    r = _run_beside(mods, "eval", str(root), "--num-images", "4")
    assert r.returncode == 2 and EVIL_TASK in r.stderr, r.stderr[-3000:]
    r = _run_beside(mods, "checkpoints", "export", str(root), str(tmp_path / "out"))
    assert r.returncode == 2 and EVIL_TASK in r.stderr, r.stderr[-3000:]
    assert not marker.exists()


@pytest.mark.slow
def test_a_frozen_parts_source_run_may_name_only_built_in_tasks(trained, tmp_path, monkeypatch):
    root = _copy(trained, tmp_path)
    _rewrite_manifests(root, _name_task)
    mods = tmp_path / "mods"
    marker = _evil_module(mods)
    monkeypatch.syspath_prepend(str(mods))

    with pytest.raises(ConfigError, match=EVIL_TASK):
        load_frozen("tokenizer", FrozenSource(str(root), part="unet"), {})
    assert not marker.exists()
    # Unchanged checkpoints of built-in tasks still load as frozen parts.
    weights = load_frozen("tokenizer", FrozenSource(str(trained), part="unet"), {})
    assert weights.config.task == "ddpm" and weights.tensors


# ---------------------------------------------------------------- 8: no credential is ever written


def _all_text(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_credentials_never_reach_checkpoints_trackers_or_logs_and_checkpoints_are_private(tmp_path, monkeypatch):
    options = json.dumps(_storage_options())
    settings = [
        f"checkpoint.storage_options={options}",
        'data.storage_options={"token": "gcs-TOKEN-9f8e7d"}',
        "sample.every_steps=2",
        "train.val_every_steps=2",
    ]
    # Every tracker installed (the `test` extra: all), their files under run.dir to be searched for secrets.
    tracking, tracker_env, trackers = tracker_settings(tmp_path / "run")
    env = clean_env(**tracker_env)
    secrets = [*SECRETS.values(), "gcs-TOKEN-9f8e7d"]
    first = run_cli("train", *tiny(tmp_path, *settings, *tracking, max_steps=2), env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    # The run's own config supplies the options on resume: nothing needs them from the manifest.
    again = run_cli("train", *tiny(tmp_path, *settings, *tracking, max_steps=4), env=env)
    assert again.returncode == 0 and "resum" in again.stderr.lower(), again.stderr[-3000:]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read MLflow's file store here
    # The resumed start continued the trackers' runs (the same W&B id, one MLflow run with both starts' metrics).
    assert_trackers_continued(tmp_path / "run", trackers, steps=[1, 2, 3, 4], val_steps=[2, 4])
    root = tmp_path / "run" / "checkpoints"
    sampled = run_cli("sample", str(root), "--num", "2", "--out", str(tmp_path / "g.png"), "--storage-options", options)
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    copy = run_cli("checkpoints", "consolidate", str(root), str(tmp_path / "copy"))
    assert copy.returncode == 0, copy.stderr[-3000:]

    files = {**_all_text(tmp_path / "run"), **_all_text(tmp_path / "copy")}
    assert any(p.name.startswith("events.out.tfevents") for p in files)  # the tracker wrote its hparams
    for secret in secrets:
        leaked = [str(p) for p, data in files.items() if secret.encode() in data]
        assert not leaked, f"{secret} found in {leaked}"
        for r in (first, again, sampled, copy):
            assert secret not in r.stdout + r.stderr
    manifest = json.loads((root / "step-000000004" / "manifest.json").read_text())
    assert manifest["config"]["checkpoint"]["storage_options"]["key"] == REDACTED

    written = [
        p for base in (root, tmp_path / "copy") for p in (base / "LATEST", *base.glob("step-*"), *base.glob("step-*/*"))
    ]
    assert len(written) > 6
    for path in written:  # the run's root and the consolidated copy alike
        mode = stat.S_IMODE(path.stat().st_mode)
        assert not mode & 0o007, f"{path} is {oct(mode)}: others may read it"


@pytest.mark.slow
def test_consolidate_redacts_a_manifest_written_before_redaction(trained, tmp_path):
    root = _copy(trained, tmp_path)
    _rewrite_manifests(root, lambda doc: doc["config"]["checkpoint"].update(storage_options=_storage_options()))
    r = run_cli("checkpoints", "consolidate", str(root), str(tmp_path / "copy"))
    assert r.returncode == 0, r.stderr[-3000:]
    (manifest,) = (tmp_path / "copy").glob("step-*/manifest.json")
    assert SECRETS["secret"] not in manifest.read_text()


def test_redact_hides_storage_options_credential_keys_and_url_passwords():
    tree = {
        "checkpoint": {"url": "s3://bucket/run", "storage_options": _storage_options()},
        "data": {"storage_options": {"anon": True, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}},
        "headers": {"Authorization": "Bearer abc", "X-Api-Key": "k1", "sessionToken": "t1"},
        "model": {"token_cache": "/cache", "max_tokens": 77, "tokenizer": {"url": "ftp://bob:hunter2@host/tok"}},
        "nested": [{"client_secret": "cs", "password": 1234}],
    }
    out = redact(tree)
    assert out["checkpoint"]["url"] == "s3://bucket/run"
    assert out["checkpoint"]["storage_options"] == {
        "key": REDACTED,
        "secret": REDACTED,
        "client_kwargs": {"region_name": REDACTED, "aws_session_token": REDACTED},
    }
    assert out["data"]["storage_options"] == {"anon": True, "client_kwargs": {"endpoint_url": REDACTED}}
    assert set(out["headers"].values()) == {REDACTED}
    assert out["model"] == {
        "token_cache": "/cache",
        "max_tokens": 77,
        "tokenizer": {"url": f"ftp://{REDACTED}@host/tok"},
    }
    assert out["nested"] == [{"client_secret": REDACTED, "password": REDACTED}]
    assert tree["checkpoint"]["storage_options"]["key"] == SECRETS["key"]  # the input is not changed
    assert (
        redact_text("see https://h/x?X-Amz-Signature=abc&part=2")
        == f"see https://h/x?X-Amz-Signature={REDACTED}&part=2"
    )
    for name in ("author", "keep", "keep_every_steps", "key_file", "monkey", "tokens"):
        assert not is_credential_key(name), name


def test_every_config_key_survives_redaction_and_the_redacted_config_still_validates(tmp_path):
    """No key gentrain itself defines is taken for a credential, so a manifest's config builds the model."""
    for preset in ("digits-ddpm", "digits-maskgit", "digits-cascade-text", "moving-digits"):
        tree = load_config(preset, [f"run.dir={tmp_path}"], environ={}).to_dict()
        out = redact(tree)
        for section in ("checkpoint", "data"):
            tree[section].pop("storage_options")
            out[section].pop("storage_options")
        assert out == tree, preset
        config_from_dict(redact(load_config(preset, [f"run.dir={tmp_path}"], environ={}).to_dict()))


def test_tracker_hparams_and_log_lines_hide_credentials():
    hparams = flat_hparams({"checkpoint": {"storage_options": _storage_options()}, "train": {"lr": 1e-3}})
    assert hparams["train.lr"] == 1e-3
    assert not any(s in json.dumps(hparams) for s in SECRETS.values())

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    redacting = RedactingFilter()
    redacting.add_secrets({"checkpoint": {"storage_options": _storage_options()}})
    handler.addFilter(redacting)
    logger = logging.getLogger("gentrain.test_redaction")
    logger.addHandler(handler)
    try:
        logger.warning("upload to %s failed: bad key %s", "s3://me:pw123456@host/b", SECRETS["key"])
    finally:
        logger.removeHandler(handler)
    assert records == [f"upload to s3://{REDACTED}@host/b failed: bad key {REDACTED}"]


# ---------------------------------------------------------------- 9: feature weights are never unpickled


class _RunsCode:
    """Unpickling this runs `exec`: what a hostile .pth does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"import pathlib; pathlib.Path({str(self.marker)!r}).write_text('ran')",)


@pytest.mark.parametrize("container", ["torch.save", "plain pickle"])
def test_inception_weights_that_would_run_code_are_refused_unrun(tmp_path, container):
    marker = tmp_path / "UNPICKLED"
    weights = tmp_path / "pt_inception-2015-12-05-6726825d.pth"
    if container == "torch.save":
        torch.save({"fc.weight": _RunsCode(marker)}, weights)
    else:
        weights.write_bytes(pickle.dumps(_RunsCode(marker)))

    with pytest.raises(ConfigError, match="weights_only"):
        load_features("inception", str(weights))
    assert not marker.exists()


@pytest.mark.slow
def test_eval_refuses_inception_weights_named_by_a_checkpoint_that_would_run_code(trained, tmp_path):
    marker = tmp_path / "UNPICKLED"
    weights = tmp_path / "inception.pth"
    torch.save(_RunsCode(marker), weights)
    root = _copy(trained, tmp_path)
    _rewrite_manifests(root, lambda doc: doc["config"]["eval"].update(features="inception", features_url=str(weights)))

    r = run_cli("eval", str(root), "--num-images", "4")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "weights_only" in r.stderr and str(weights) in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists()


def test_inception_weights_load_as_a_state_dict_or_safetensors_without_unpickling_code(tmp_path):
    from safetensors.torch import save_file

    from trainer.eval.features import inception_state_dict

    state = {"fc.weight": torch.randn(3, 2), "fc.bias": torch.zeros(3)}
    torch.save(state, tmp_path / "w.pth")
    save_file(state, tmp_path / "w.safetensors")
    for name in ("w.pth", "w.safetensors"):
        loaded = inception_state_dict((tmp_path / name).read_bytes(), name)
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    torch.save([1, 2], tmp_path / "list.pth")
    with pytest.raises(ConfigError, match="not a state dict"):
        inception_state_dict((tmp_path / "list.pth").read_bytes(), "list.pth")


def test_error_lines_the_cli_prints_pass_the_same_redaction_as_log_lines(capsys):
    from trainer import cli

    cli._REDACT.add_secrets({"storage_options": _storage_options()})
    cli._fail(f"config error: ftp://bob:hunter2@host/tok with key {SECRETS['key']} is not reachable")
    err = capsys.readouterr().err
    assert err.startswith("gentrain: config error: ftp://") and REDACTED in err
    assert "hunter2" not in err and SECRETS["key"] not in err
