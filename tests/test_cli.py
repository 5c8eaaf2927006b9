"""The CLI end to end: the demo preset trains, checkpoints and samples."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import run_cli
from PIL import Image


@pytest.mark.slow
def test_demo_preset_runs_a_few_steps_end_to_end(tmp_path):
    run_dir = tmp_path / "demo"
    r = run_cli(
        "train",
        "train.max_steps=4",
        "train.log_every_steps=2",
        "checkpoint.every_steps=2",
        "sample.inference_steps=3",
        "sample.num=16",
        f"run.dir={run_dir}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "task=ddpm name=digits-ddpm" in r.stderr
    assert "step=4/4" in r.stderr
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "LATEST").read_text() == "step-000000004"
    manifest = json.loads((ckpts / "step-000000004" / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 1
    assert manifest["config"]["name"] == "digits-ddpm"
    assert {"unet.model.safetensors", "unet.ema.safetensors", "unet.optimizer.safetensors", "trainer.json"} <= set(
        manifest["files"]
    )
    grid = Image.open(run_dir / "samples" / "step-000000004.png")
    assert grid.size[0] > 64

    out = tmp_path / "grid.png"
    r = run_cli("sample", str(ckpts), "--num", "9", "--out", str(out), "--steps", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 4" in r.stdout
    im = Image.open(out)
    # 3x3 grid of 16x16 images upscaled x4 with 1px padding.
    assert im.size == (3 * 65 + 1, 3 * 65 + 1)


@pytest.mark.slow
def test_sample_from_an_empty_root_fails_clearly(tmp_path):
    r = run_cli("sample", str(tmp_path), "--out", str(tmp_path / "x.png"))
    assert r.returncode == 1
    assert "no valid checkpoint" in r.stderr


@pytest.mark.slow
def test_a_run_forked_by_the_test_server_matches_a_fresh_interpreter(tmp_path):
    """tests/zygote.py stands in for `python -m trainer` in most CLI tests: same exit codes, same output."""
    import conftest
    from conftest import _zygote, clean_env

    server = _zygote()
    assert server is not None, f"the fork server did not start: {conftest._ZYGOTE_FAILED}"

    runs = [
        ["presets"],
        ["train", "digits-ddpm", "train.no_such_key=1", f"run.dir={tmp_path}"],
        ["checkpoints", "verify", str(tmp_path / "none")],
    ]
    for args in runs:
        forked = server.run(args, clean_env(), timeout=300)
        fresh = subprocess.run(
            [sys.executable, "-m", "trainer", *args], capture_output=True, text=True, env=clean_env(), timeout=300
        )
        assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), args
        assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], args
    assert [r.returncode for r in (server.run(a, clean_env(), timeout=300) for a in runs)] == [0, 2, 1]
