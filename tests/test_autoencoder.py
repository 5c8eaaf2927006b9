"""The KL autoencoder task: it trains (the reconstruction loss falls), measures its latent scaling factor
(1 / std of the latents of a fixed sample of training images) into its checkpoints, reports PSNR, KL and
latent statistics through validation, samples reconstructions, refuses bad config keys, and resumes
bit-identically after a SIGKILL."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, clean_env, tiny
from helpers import assert_tensors_equal
from PIL import Image
from test_vqgan_maskgit import _kill_and_compare, _kill_and_resume_one_process

from trainer.checkpoint import CheckpointStore
from trainer.cli import main as cli_main
from trainer.data import SampleRef, build_splits
from trainer.elastic import DistEnv
from trainer.errors import ConfigError
from trainer.loop import Trainer
from trainer.models.autoencoder import KLAutoencoder, latent_geometry
from trainer.registry import load_config
from trainer.tasks.autoencoder import AutoencoderTask
from trainer.tasks.base import TaskContext
from trainer.tasks.sampling import SampleRequest

ENV = clean_env(PYTHONPATH=str(REPO / "tests"))

# The tiny model of conftest.TINY (8x8 digits -> 4x4 latents) with a small PatchGAN.
SMALL = ["model.disc_channels=8", "model.disc_layers=1", "model.scale_samples=24"]


def ae_args(root, *extra: str, max_steps: int) -> list[str]:
    return ["digits-autoencoder", *tiny(root, *SMALL, *extra, max_steps=max_steps)]


def trained(tmp_path, *extra: str, max_steps: int) -> Trainer:
    cfg = load_config("digits-autoencoder", tiny(tmp_path, *SMALL, *extra, max_steps=max_steps), environ={})
    return Trainer(cfg, DistEnv())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short in-process run, validated before and after training; checkpoints at steps 10, 20 and 30."""
    root = tmp_path_factory.mktemp("ae")
    t = trained(root, "checkpoint.every_steps=10", "checkpoint.keep=5", "model.disc_start_step=15", max_steps=30)
    before = t.validator.run(0)
    assert t.fit() == 0
    after = t.validator.run(30)
    return t, before, after, f"{root}/run/checkpoints"


def test_the_reconstruction_loss_falls_and_validation_reports_psnr_kl_and_latent_statistics(run):
    t, before, after, _ = run
    assert set(after) == {"val/mse", "val/psnr", "val/kl", "val/latent_mean", "val/latent_std"}
    # At initialization the decoder outputs about 0 (mid-gray) for every image; 30 steps must at least halve
    # that error on the held-out digits, i.e. add 10 log10(2) = 3.0 dB of PSNR.
    assert after["val/mse"] < before["val/mse"] / 2, (before, after)
    assert after["val/psnr"] > before["val/psnr"] + 10 * torch.log10(torch.tensor(2.0)).item()
    assert after["val/kl"] > 0 and after["val/latent_std"] > 0
    assert t.parts["generator"].step == 30 and t.parts["discriminator"].step == 15  # from disc_start_step=15


def latents_of_fixed_sample(cfg, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Posterior means of the first model.scale_samples training images, recomputed from saved weights."""
    model = KLAutoencoder(cfg.model_cfg, cfg.data.channels, cfg.data.image_size)
    model.load_state_dict(weights)
    train, _, _ = build_splits(cfg)
    n = cfg.model_cfg.scale_samples
    images = torch.stack([train[SampleRef(index=i, position=i)][0] for i in range(n)])
    with torch.no_grad():
        return model.eval().vae.encode(images).latent_dist.mean.double()


def test_each_checkpoint_holds_one_over_the_std_of_its_own_weights_latents(run):
    t, _, _, root = run
    store = CheckpointStore(root)
    factors = []
    for step in (10, 20, 30):
        info = store.check(step)
        ema = store.read_tensors(info, "generator.ema.safetensors")
        model = store.read_tensors(info, "generator.model.safetensors")
        # Measured with the EMA weights (what sampling and a frozen consumer use), saved in both files.
        assert torch.equal(ema["scaling_factor"], model["scaling_factor"])
        expected = 1 / latents_of_fixed_sample(t.cfg, ema).std()
        # float32 convolutions summed in another order (one batch here, chunks in training): a few ulps.
        assert float(ema["scaling_factor"]) == pytest.approx(float(expected), rel=1e-5), step
        factors.append(float(ema["scaling_factor"]))
    assert len(set(factors)) == 3 and 1.0 not in factors  # measured anew at every save
    # The live module holds the last measurement, and the task's latents use it.
    generator = t.parts["generator"].module
    assert float(generator.scaling_factor) == factors[-1]
    x = torch.zeros(2, 1, 8, 8)
    assert torch.equal(generator.encode_latents(x), generator.posterior(x).mean * factors[-1])


def test_sample_writes_reconstructions_of_held_out_images(run, tmp_path):
    t, _, _, root = run
    out = tmp_path / "recon.png"
    assert cli_main(["sample", root, "--num", "4", "--out", str(out)]) == 0
    assert out.exists()
    # Direct: each cell is the input image | a 1-pixel gap | its reconstruction.
    modules = {n: p.module.eval() for n, p in t.parts.items()}
    images = torch.rand(3, 1, 8, 8) * 2 - 1
    cells = t.task.sample(modules, SampleRequest(num=3, images=images), t.device)
    assert cells.shape == (3, 1, 8, 17)
    assert torch.allclose(cells[..., :8], (images + 1) / 2)
    # Without images (FID evaluation) it decodes draws of the scaled latent space, seeded.
    drawn = t.task.sample(modules, SampleRequest(num=2, seed=1), t.device)
    assert drawn.shape == (2, 1, 8, 8) and torch.equal(
        drawn, t.task.sample(modules, SampleRequest(num=2, seed=1), t.device)
    )
    with Image.open(out) as im:
        assert im.width > im.height  # cells twice as wide as tall


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.no_such_key=1", "model.no_such_key"),
        ("model.kl_weight=-1", "model.kl_weight"),
        ("model.codebook_size=16", "model.codebook_size"),  # a VQ-GAN key: no quantizer here
        ("model.block_out_channels=[8,10]", "model.norm_num_groups"),
    ],
)
def test_bad_config_exits_2_naming_the_key(tmp_path, capsys, override, named):
    assert cli_main(["train", *ae_args(tmp_path, override, max_steps=1)]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and named in err, err


def test_the_task_builds_the_diffusers_autoencoder_with_the_configured_geometry():
    cfg = load_config("digits-autoencoder", [], environ={})
    task = AutoencoderTask(cfg.model_cfg, TaskContext(16, 1, 0))
    parts = task.build({})
    vae = parts["generator"].vae
    assert vae.config.latent_channels == 4 and list(vae.config.block_out_channels) == [32, 64, 64]
    assert task.latent_shape == (4, 4, 4) and task.calibration_size() == 512
    assert latent_geometry(cfg) == (4, 4)  # what a latent-diffusion run checks its backbone against
    with torch.no_grad():
        out = parts["generator"](torch.zeros(2, 1, 16, 16))
    assert out["reconstruction"].shape == (2, 1, 16, 16) and out["latents"].shape == (2, 4, 4, 4)
    with pytest.raises(ConfigError, match="data.image_size=10 is not divisible"):
        AutoencoderTask(cfg.model_cfg, TaskContext(10, 1, 0))  # downsampling factor 4


# ---------------------------------------------------------------- exact resume


RESUME = [
    "task=probe_tasks:KillableAutoencoder",
    "model.disc_start_step=3",
    "model.grad_penalty_every=2",
    "model.lecam_weight=0.1",
    "checkpoint.every_steps=4",
]


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    steps = 10

    def args(root):
        return ae_args(root, *RESUME, max_steps=steps)

    # Killed in global step 6, once the (background) save of step 4 has committed.
    a, b, _ = _kill_and_resume_one_process(tmp_path, args, ENV, kill_step=6, saved_step=4, steps=steps)
    # Generator (its scaling factor too), EMA, discriminator with its LeCAM anchors, both optimizers, RNG.
    assert {"generator.ema.safetensors", "discriminator.optimizer.safetensors", "rank-00000.safetensors"} <= set(a)
    assert_tensors_equal(a, b)
    doc = json.loads((tmp_path / "killed/run/checkpoints/step-000000010/trainer.json").read_text())
    assert doc["parts"]["discriminator"]["step"] == 7


@pytest.mark.slow
def test_under_torchrun_a_sigkilled_rank_resumes_bit_identical(tmp_path):
    steps = 10

    def args(root):
        return ae_args(root, *RESUME, max_steps=steps)

    a = _kill_and_compare(tmp_path, args, kill_at=6, steps=steps)
    assert "generator.ema.safetensors" in a and "rank-00001.safetensors" in a


@pytest.mark.slow
def test_under_fsdp_a_sigkilled_rank_resumes_bit_identical(tmp_path):
    """Sharded generator and discriminator: the scaling factor is measured through sharded forwards on every
    rank and saved with the replicated buffers. Without the gradient penalty (FSDP's one refusal); with LeCAM,
    whose anchors are buffers each rank updates from its own chunk: under FSDP, as under DDP, every forward
    starts from rank 0's buffers (trainer.engine.shard.follow_rank0_buffers), the copy a checkpoint keeps."""
    steps = 10

    def args(root):
        return ae_args(
            root,
            *RESUME,
            "model.grad_penalty_every=0",
            "train.parallel=fsdp",
            max_steps=steps,
        )

    a = _kill_and_compare(tmp_path, args, kill_at=6, steps=steps)
    assert any(name.startswith("generator.ema") for name in a)
