"""Latent diffusion (`task: ddpm` with `model.autoencoder`): the denoiser learns the latents of a frozen,
digest-pinned KL autoencoder, from a gentrain autoencoder run or a diffusers AutoencoderKL folder (local or
on loopback S3). Its checkpoints never hold the autoencoder; samples are decoded to the data's pixel size;
geometry mismatches and a changed autoencoder at resume exit 2; a SIGKILLed run resumes bit-identically; the
latent cache fills once and changes nothing."""

from __future__ import annotations

import json
import logging
import os

import fsspec
import pytest
import torch
from conftest import REPO, clean_env, run_cli, tiny
from diffusers import AutoencoderKL
from elastic_helpers import standalone
from helpers import assert_tensors_equal
from PIL import Image
from test_vqgan_maskgit import _kill_and_compare, _kill_and_resume_one_process, tensors, train_vqgan
from tiny_backbones import backbone_override

from trainer.checkpoint import CheckpointStore
from trainer.cli import main as cli_main
from trainer.elastic import DistEnv
from trainer.errors import ConfigError
from trainer.loop import Trainer
from trainer.registry import load_config
from trainer.runs import load_for_inference
from trainer.tasks.sampling import SampleRequest

ENV = clean_env(PYTHONPATH=str(REPO / "tests"), HF_HUB_OFFLINE="1")
CPU = torch.device("cpu")
# unet: digits-ddpm's own backbone; the transformers one block on 2x2 latent patches, pixart and mmdit reading
# captions through the shipped 384-wide sentence encoder.
_ONE_BLOCK = {"patch_size": 2, "num_layers": 1}
BACKBONES = {
    "unet": [],
    "dit": [backbone_override("dit", **_ONE_BLOCK), "model.num_classes=10"],
    "pixart": [backbone_override("pixart", text=True, **_ONE_BLOCK)],
    "mmdit": [backbone_override("mmdit", text=True, **_ONE_BLOCK)],
}


@pytest.fixture(scope="module")
def autoencoder_run(tmp_path_factory) -> str:
    """A tiny digits-autoencoder run (8x8 digits -> 4x4x4 latents, downsampling 2), checkpoint at step 3."""
    root = tmp_path_factory.mktemp("ae")
    small = ["model.disc_channels=8", "model.disc_layers=1", "model.scale_samples=24", "checkpoint.every_steps=3"]
    cfg = load_config("digits-autoencoder", tiny(root, *small, max_steps=3), environ={})
    assert Trainer(cfg, DistEnv()).fit() == 0
    return f"{root}/run/checkpoints"


def vae_folder(path, seed: int = 0, levels: int = 2, **config) -> str:
    """A tiny diffusers AutoencoderKL saved with save_pretrained (1 channel, 4 latent channels)."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=1,
        out_channels=1,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=(8, 16, 16)[:levels],
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=8,
        **config,
    )
    vae.save_pretrained(str(path))
    return str(path)


def ldm(tmp_path, url: str, *extra: str, max_steps: int = 2) -> list[str]:
    return ["digits-ddpm", *tiny(tmp_path, f"model.autoencoder.url={url}", *extra, max_steps=max_steps)]


def train(tmp_path, url: str, *extra: str, max_steps: int = 2) -> Trainer:
    args = ldm(tmp_path, url, *extra, max_steps=max_steps)
    t = Trainer(load_config(args[0], args[1:], environ={}), DistEnv())
    assert t.fit() == 0
    return t


def sample(root: str, storage_options=None) -> torch.Tensor:
    store = CheckpointStore(root, storage_options)
    _, task, modules = load_for_inference(store.view(store.latest_valid()), True, CPU)
    request = SampleRequest(num=4, seed=0, inference_steps=2)
    images = task.sample(modules, request, CPU)
    assert torch.equal(images, task.sample(modules, request, CPU))  # the seed fixes them
    return images


@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_latent_ddpm_trains_checkpoints_without_the_autoencoder_and_samples_pixel_images(
    backbone, tmp_path, autoencoder_run, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = [f"model.text={{cache_dir: {tmp_path}/text, max_tokens: 8}}"] if backbone in ("pixart", "mmdit") else []
    t = train(tmp_path, autoencoder_run, "checkpoint.every_steps=2", *BACKBONES[backbone], *text)
    net = t.parts[t.task.part].module
    # The backbone sees 4x4x4 latents, not 8x8x1 pixels.
    assert net.config.in_channels == 4 and net.config.sample_size == 4
    assert net.config.out_channels in (4, 8)  # 8: a DiT/PixArt that learns its variance too
    root = f"{tmp_path}/run/checkpoints"
    saved = tensors(root, 2)
    ae_keys = set(tensors(autoencoder_run, 3)["generator.ema.safetensors"])
    assert not any(name.startswith("autoencoder") for name in saved), sorted(saved)
    assert all(not (set(ts) & ae_keys) for ts in saved.values())  # no autoencoder tensor in any file
    manifest = json.loads((tmp_path / "run/checkpoints/step-000000002/manifest.json").read_text())
    ae_store = CheckpointStore(autoencoder_run)
    assert manifest["frozen"]["autoencoder"]["digest"] == ae_store.view(ae_store.check(3)).file_digest(
        "generator.ema.safetensors"
    )
    images = sample(root)
    assert images.shape == (4, 1, 8, 8) and 0 <= images.min() and images.max() <= 1


def test_a_diffusers_autoencoderkl_folder_is_the_frozen_autoencoder_with_its_scaling_and_shift(tmp_path):
    folder = vae_folder(tmp_path / "vae", scaling_factor=0.5, shift_factor=0.25)
    t = train(tmp_path, folder, "checkpoint.every_steps=2")
    module = t.frozen["autoencoder"].module
    assert (module.latent_scale, module.latent_shift) == (0.5, 0.25)
    assert not module.training and not any(p.requires_grad for p in module.parameters())
    saved = tensors(f"{tmp_path}/run/checkpoints", 2)
    vae_keys = set(AutoencoderKL.from_pretrained(folder).state_dict())
    assert all(not (set(ts) & vae_keys) for ts in saved.values())
    # Latents are (mean - shift) * scale: encode one image by hand.
    latent = t.task.latent
    image = torch.zeros(1, 1, 8, 8)
    with torch.no_grad():
        mean = AutoencoderKL.from_pretrained(folder).encode(image).latent_dist.mean
    mean_only = type(latent.cfg)(url=folder, sample_posterior=False)
    latent.cfg, kept = mean_only, latent.cfg
    torch.testing.assert_close(latent.encode(module, image, 0, [0]), (mean - 0.25) * 0.5)
    latent.cfg = kept
    assert sample(f"{tmp_path}/run/checkpoints").shape == (4, 1, 8, 8)
    # `gentrain sample` too decodes through the folder's autoencoder (reading it again, digest-checked).
    out = tmp_path / "grid.png"
    assert cli_main(["sample", f"{tmp_path}/run/checkpoints", "--num", "4", "--steps", "2", "--out", str(out)]) == 0
    with Image.open(out) as grid:
        assert grid.size[0] > 0 and grid.size[0] == grid.size[1]


@pytest.mark.slow
def test_a_diffusers_folder_on_loopback_s3_is_the_frozen_autoencoder(tmp_path, s3_server):
    bucket, options = f"s3://{s3_server.make_bucket()}", s3_server.storage_options()
    local = vae_folder(tmp_path / "vae", scaling_factor=0.5)
    fs, _ = fsspec.core.url_to_fs(bucket, **options)
    for name in os.listdir(local):
        fs.put_file(os.path.join(local, name), f"{bucket}/vae/{name}")
    t = train(tmp_path, f"{bucket}/vae", f"checkpoint.storage_options={json.dumps(options)}")
    assert t.frozen["autoencoder"].module.latent_scale == 0.5
    # Sampling reads the autoencoder from S3 again (digest-checked), with the storage options the user gives.
    assert sample(f"{tmp_path}/run/checkpoints", options).shape == (4, 1, 8, 8)


@pytest.mark.slow
def test_an_image_vqgan_run_is_a_frozen_autoencoder_in_ldms_vq_setting(tmp_path):
    """The diffusion learns the VQ-GAN's pre-quantization latents (scale 1); sampling quantizes, then decodes."""
    tokenizer = train_vqgan(tmp_path / "vq")
    t = train(tmp_path / "ld", tokenizer, "checkpoint.every_steps=2")
    assert t.parts["unet"].module.config.in_channels == 4 and t.task.latent.shape == (4, 4, 4)
    saved = tensors(f"{tmp_path}/ld/run/checkpoints", 2)
    assert not any(name.startswith("autoencoder") for name in saved)
    assert sample(f"{tmp_path}/ld/run/checkpoints").shape == (4, 1, 8, 8)


def test_a_run_root_is_pinned_to_its_step_when_the_autoencoder_run_moves_on_and_a_step_dir_works(tmp_path):
    small = ["model.disc_channels=8", "model.disc_layers=1", "model.scale_samples=24", "checkpoint.every_steps=2"]

    def autoencoder(max_steps: int) -> None:
        cfg = load_config("digits-autoencoder", tiny(tmp_path / "ae", *small, max_steps=max_steps), environ={})
        assert Trainer(cfg, DistEnv()).fit() == 0

    autoencoder(2)
    root = f"{tmp_path}/ae/run/checkpoints"
    first = train(tmp_path / "ld", root, "checkpoint.every_steps=2", max_steps=2)
    assert first.frozen["autoencoder"].record.url == f"{root}/step-000000002"
    autoencoder(4)  # the autoencoder run trains on: its root now resolves to step 4
    resumed = train(tmp_path / "ld", root, "checkpoint.every_steps=2", max_steps=3)
    assert resumed.checkpoints.resumed_from.endswith("step-000000002")
    assert resumed.frozen["autoencoder"].record == first.frozen["autoencoder"].record  # the pinned step's weights
    fresh = train(tmp_path / "step", f"{root}/step-000000004", max_steps=1)
    assert fresh.frozen["autoencoder"].record.url == f"{root}/step-000000004"
    assert fresh.frozen["autoencoder"].record.digest != first.frozen["autoencoder"].record.digest


def test_geometry_mismatches_are_refused_naming_both_numbers(tmp_path, autoencoder_run):
    def refused(url: str, *extra: str) -> str:
        args = ldm(tmp_path, url, *extra)
        with pytest.raises(ConfigError) as e:
            Trainer(load_config(args[0], args[1:], environ={}), DistEnv())
        return str(e.value)

    msg = refused(autoencoder_run, "model.autoencoder.latent_channels=8")
    assert "latent_channels=8" in msg and "4 latent channels" in msg
    msg = refused(autoencoder_run, "model.autoencoder.latent_size=8")
    assert "latent_size=8" in msg and "4x4" in msg
    deep = vae_folder(tmp_path / "deep", levels=3)  # downsampling factor 4
    msg = refused(deep, "data.image_size=10")
    assert "data.image_size=10" in msg and "downsampling factor 4" in msg
    msg = refused(autoencoder_run, "data.channels=3")
    assert "data.channels=3" in msg and "1-channel" in msg


@pytest.mark.slow
def test_geometry_mismatch_exits_2_naming_both_numbers(tmp_path, autoencoder_run, capsys):
    # In this process: a config error needs no process of its own.
    assert cli_main(["train", *ldm(tmp_path, autoencoder_run, "model.autoencoder.latent_channels=8")]) == 2
    err = capsys.readouterr().err
    assert "latent_channels=8" in err and "4 latent channels" in err, err[-3000:]


@pytest.mark.slow
def test_a_changed_autoencoder_at_resume_exits_2_naming_it_and_keeps_the_last_checkpoint(tmp_path, capsys, caplog):
    """`gentrain train` in this process (its exit code and stderr, its log lines in caplog)."""
    folder = vae_folder(tmp_path / "vae")
    args = ldm(tmp_path, folder, "checkpoint.every_steps=2", max_steps=2)
    assert cli_main(["train", *args]) == 0, capsys.readouterr().err[-3000:]
    # The same folder again: the resume passes the pin.
    caplog.clear()
    caplog.set_level(logging.INFO, logger="gentrain")
    assert cli_main(["train", *ldm(tmp_path, folder, "checkpoint.every_steps=1", max_steps=3)]) == 0
    assert f"resumed_from={tmp_path}/run/checkpoints/step-000000002" in caplog.text
    vae_folder(tmp_path / "vae", seed=1)  # other weights at the same URL
    capsys.readouterr()
    assert cli_main(["train", *ldm(tmp_path, folder, "checkpoint.every_steps=1", max_steps=4)]) == 2
    err = capsys.readouterr().err
    assert "frozen part 'autoencoder'" in err and folder in err, err[-3000:]
    store = CheckpointStore(f"{tmp_path}/run/checkpoints")
    assert store.latest_valid().step == 3


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, autoencoder_run):
    """Posterior samples (counter-based draws), noise, timesteps and label dropout all resume exactly."""
    steps = 4  # a checkpoint (2) before the kill (in 3), a step after it
    extra = ["model.num_classes=10", "checkpoint.every_steps=2", "task=probe_tasks:KillableDDPM"]

    def args(root):
        return ldm(root, autoencoder_run, *extra, max_steps=steps)

    a, b, _ = _kill_and_resume_one_process(tmp_path, args, ENV, kill_step=3, saved_step=2, steps=steps)
    assert {"unet.ema.safetensors", "unet.optimizer.safetensors", "rank-00000.safetensors"} <= set(a)
    assert_tensors_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp"])  # DDP's path, the same for every task, is in the other kill tests
def test_under_torchrun_a_sigkilled_rank_resumes_bit_identical(tmp_path, autoencoder_run, parallel):
    """Two workers (FSDP with the UNet sharded and the frozen autoencoder whole on each): rank 1 dies
    in step 4, torchrun restarts both, the run ends bit-identical to an uninterrupted one; no checkpoint file
    holds the autoencoder."""
    steps = 6

    def args(root):
        extra = ["model.num_classes=10", "checkpoint.every_steps=2", "task=probe_tasks:KillableDDPM"]
        return ldm(root, autoencoder_run, *extra, f"train.parallel={parallel}", max_steps=steps)

    a = _kill_and_compare(tmp_path, args, kill_at=4, steps=steps)
    assert "rank-00001.safetensors" in a and not any(name.startswith("autoencoder") for name in a)


@pytest.mark.slow
def test_a_sharded_autoencoder_is_refused_with_exit_2(tmp_path, autoencoder_run):
    args = ldm(tmp_path, autoencoder_run, "train.parallel=fsdp", "train.shard_frozen=true")
    r = run_cli("launch", *standalone(2, max_restarts=0), "--", *args, env=ENV)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "train.shard_frozen=true: the latent diffusion autoencoder cannot be sharded" in r.stderr


def test_the_latent_cache_fills_once_then_is_reused_and_changes_no_weight(tmp_path, autoencoder_run):
    cache = tmp_path / "cache"
    plain = train(tmp_path / "plain", autoencoder_run, max_steps=3)
    first = train(tmp_path / "first", autoencoder_run, f"model.autoencoder.cache={cache}", max_steps=3)
    (folder,) = os.listdir(cache)  # one folder: the autoencoder's digest
    entries = set(os.listdir(cache / folder))
    assert first.task.latent.cache.misses == len(entries) > 0
    second = train(tmp_path / "second", autoencoder_run, f"model.autoencoder.cache={cache}", max_steps=3)
    assert second.task.latent.cache.misses == 0 and second.task.latent.cache.hits > 0
    assert set(os.listdir(cache / folder)) == entries
    weights = [t.parts["unet"].module.state_dict() for t in (plain, first, second)]
    assert_tensors_equal(weights[0], weights[1], "cache filling")
    assert_tensors_equal(weights[0], weights[2], "cache reused")


def test_the_digits_latent_dit_preset_validates_offline_and_builds_on_the_autoencoder_geometry():
    cfg = load_config("digits-latent-dit", [], environ={})
    assert cfg.task == "ddpm" and cfg.model_cfg.denoiser.kind == "dit" and cfg.model_cfg.num_classes == 10
    assert cfg.model_cfg.autoencoder.url and cfg.model_cfg.autoencoder.latent_channels == 4
    assert cfg.model_cfg.autoencoder.latent_size == 4
    # The preset's DiT on the digits autoencoder's 4x4x4 latents (digits-autoencoder: 16px, downsampling 4).
    from trainer.diffusion import build_backbone  # the diffusion core: this test only

    backbone = build_backbone(cfg.model_cfg.denoiser, 4, 4, 10)
    assert backbone.model.config.in_channels == 4
