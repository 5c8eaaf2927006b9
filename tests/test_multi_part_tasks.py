"""The Task interface carries multi-part tasks: two phases (generator, discriminator), per-part
optimizer settings, a frozen encoder from another run, exact resume under torchrun after SIGKILL."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import REPO, clean_env, run_cli, tiny
from elastic_helpers import finish, standalone, start_torchrun

from trainer.checkpoint import CheckpointStore

ENV = clean_env(PYTHONPATH=str(REPO / "tests"))


def train_ddpm(root, seed: int = 0, max_steps: int = 3) -> str:
    r = run_cli("train", *tiny(root, f"seed={seed}", max_steps=max_steps))
    assert r.returncode == 0, r.stderr[-3000:]
    return f"{root}/run/checkpoints"


def probe_args(tmp, encoder_url: str, *extra: str, max_steps: int) -> list[str]:
    return [
        str(REPO / "tests" / "probe.yaml"),
        f"model.encoder_url={encoder_url}",
        f"run.dir={tmp}/run",
        f"train.max_steps={max_steps}",
        *extra,
    ]


@pytest.fixture(scope="module")
def encoder_url(tmp_path_factory) -> str:
    return train_ddpm(tmp_path_factory.mktemp("ddpm"))


def checkpoint_tensors(root: str, step: int) -> dict[str, dict[str, torch.Tensor]]:
    store = CheckpointStore(root)
    info = store.check(step)
    assert info.valid, info.reason
    return {n: store.read_tensors(info, n) for n in info.manifest.files if n.endswith(".safetensors")}


@pytest.mark.slow
def test_two_phases_per_part_optimizers_and_a_frozen_encoder_kept_out_of_checkpoints(tmp_path, encoder_url):
    r = run_cli("train", *probe_args(tmp_path, encoder_url, "train.val_every_steps=3", max_steps=6), env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    root = f"{tmp_path}/run/checkpoints"
    store = CheckpointStore(root)
    info = store.latest_valid()
    files = set(info.manifest.files)
    assert {"generator.model.safetensors", "discriminator.optimizer.safetensors", "generator.ema.safetensors"} <= files
    assert not any(f.startswith("encoder") for f in files), files

    doc = store.read_json(info, "trainer.json")
    # The frozen source is pinned by digest: the DDPM run's EMA weights file.
    src = CheckpointStore(encoder_url).latest_valid()
    assert doc.frozen["encoder"].digest == "blake3:" + src.manifest.files["unet.ema.safetensors"].blake3
    assert doc.frozen["encoder"].url == src.url
    # The discriminator learns from model.disc_start_step=2 on, with its own optimizer settings.
    assert doc.parts["generator"].step == 6 and doc.parts["discriminator"].step == 4
    disc_group = doc.parts["discriminator"].optimizer["param_groups"][0]
    gen_group = doc.parts["generator"].optimizer["param_groups"][0]
    assert disc_group["initial_lr"] == 1e-3 and disc_group["betas"] == [0.5, 0.9]
    assert gen_group["initial_lr"] == 2e-4 and gen_group["betas"] == [0.9, 0.999]
    # Named loss terms and validation metrics reach the log; the preview uses a real batch.
    assert "generator/rec=" in r.stderr and "discriminator/hinge=" in r.stderr
    assert "val/psnr=" in r.stderr and "val/mse=" in r.stderr
    assert (tmp_path / "run" / "samples" / "step-000000006-reconstruction.png").exists()

    out = tmp_path / "s.png"
    r = run_cli("sample", root, "--num", "3", "--out", str(out), "--task", "probe_tasks:GanProbeTask", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.exists()


@pytest.mark.slow
def test_optimizer_override_for_an_unknown_part_is_a_config_error(tmp_path, encoder_url):
    r = run_cli("train", *probe_args(tmp_path, encoder_url, "optim.discriminatr.lr=1e-4", max_steps=2), env=ENV)
    assert r.returncode == 2
    assert "optim.discriminatr" in r.stderr and "generator, discriminator" in r.stderr


@pytest.mark.slow
def test_sigkilled_rank_under_torchrun_resumes_bit_identical_without_unused_parameters(tmp_path, encoder_url):
    steps = 24
    common = ("checkpoint.every_steps=5",)
    ref_log = tmp_path / "ref.log"
    ref = start_torchrun(
        standalone(2),
        probe_args(tmp_path / "ref", encoder_url, *common, max_steps=steps),
        ref_log,
        PYTHONPATH=str(REPO / "tests"),
    )
    assert finish(ref, ref_log) == 0, ref_log.read_text()[-4000:]

    # The killed run saves in the background, each copy held into the next step until its fence
    # (PROBE_TASK_OVERLAP); rank 1 dies in step 13 once the save of step 10 has committed.
    log = tmp_path / "killed.log"
    killed = tmp_path / "killed/run/checkpoints"
    proc = start_torchrun(
        standalone(2, max_restarts=3),
        probe_args(tmp_path / "killed", encoder_url, *common, "checkpoint.async=true", max_steps=steps),
        log,
        PYTHONPATH=str(REPO / "tests"),
        PROBE_TASK_KILL="1:13",
        PROBE_TASK_OVERLAP="1",
        PROBE_TASK_KILL_AFTER=str(killed / "step-000000010/manifest.json"),
    )
    rc = finish(proc, log)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert "world_size=2 restart=1" in text and "step-000000010" in text.split("restart=1")[1].split("\n")[0]
    assert text.count("probe: snapshot copy held until a fence") == 4, text[-3000:]  # steps 5, 10; 15, 20
    assert "until an optimizer step" not in text

    for step in (20, steps):  # written in the background (its copy overlapping step 21), and the end
        a = checkpoint_tensors(f"{tmp_path}/ref/run/checkpoints", step)
        b = checkpoint_tensors(str(killed), step)
        assert a.keys() == b.keys()
        assert {"rank-00000.safetensors", "rank-00001.safetensors", "discriminator.optimizer.safetensors"} <= set(a)
        for name in a:  # weights, EMA, both optimizers, every rank's global RNG state
            for key in a[name]:
                assert torch.equal(a[name][key], b[name][key]), f"step {step} {name}:{key} differs"


@pytest.mark.slow
def test_resume_with_changed_frozen_weights_is_refused_and_a_moved_source_uses_the_pinned_step(tmp_path):
    ddpm_root = tmp_path / "ddpm"
    url = train_ddpm(ddpm_root, max_steps=3)
    args = probe_args(tmp_path / "probe", url, max_steps=3)
    assert run_cli("train", *args, env=ENV).returncode == 0

    # The source run trains on: a newer checkpoint, but the pinned step still holds the same weights.
    train_ddpm(ddpm_root, max_steps=4)
    r = run_cli("train", *args[:-1], "train.max_steps=4", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "using the pinned" in r.stderr and "resumed_from=" in r.stderr

    # The source run is replaced by another one (other seed): same steps, other weights.
    shutil.rmtree(ddpm_root)
    train_ddpm(ddpm_root, seed=1, max_steps=4)
    r = run_cli("train", *args[:-1], "train.max_steps=5", env=ENV)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "frozen part 'encoder'" in r.stderr and "Resuming would train on different frozen weights" in r.stderr
    doc = json.loads((tmp_path / "probe/run/checkpoints/step-000000004/trainer.json").read_text())
    assert doc["progress"]["step"] == 4  # the last good checkpoint is kept
