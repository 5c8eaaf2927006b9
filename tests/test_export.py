"""`gentrain checkpoints export` writes diffusers pipelines: an unconditional pixel UNet as a DDIMPipeline and a
class-conditional latent DiT as a DiTPipeline (its label tables padded for the pipeline's null class 1000), which
`DiffusionPipeline.from_pretrained` loads and which sample what `gentrain sample` draws for the same seed, steps,
scheduler and guidance; models no diffusers pipeline runs (captions, class-conditional UNets) get their folders
without model_index.json, and the model card says why.

The bound of the comparisons: the pipelines run the same operations in the same order as gentrain's sampler (the
same initial noise: both draw torch.randn of the same shape from a CPU generator seeded alike, the same scheduler
config, the same guided mix of one batched forward, the same [-1, 1] -> [0, 1] map), which the test shows by
running the pipeline with gentrain's own module in memory: bit-identical. A module loaded back from the exported
folder holds the same weights, but its tensors sit elsewhere in memory, and the CPU BLAS's blocking (and so its
rounding) depends on alignment: each matmul may differ by about one float32 ulp (6e-8 relative). Through a few
layers and a few sampler steps that stays below 1e-6 on [0, 1] images here (measured on CPU: 2.4e-7 for the UNet,
4.8e-7 and 8.3e-7 for the DiT at guidance 1 and 2, whose VAE decode also multiplies by 1 / scaling_factor where
gentrain divides by it: one more rounding of the latents). ATOL = 1e-5 leaves a margin of ten over the measured
worst case, while guidance moves the images by far more (asserted).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny
from diffusers import (
    AutoencoderKL,
    DDIMPipeline,
    DiffusionPipeline,
    DiTPipeline,
    DiTTransformer2DModel,
    PixArtTransformer2DModel,
    UNet2DModel,
)

from trainer.checkpoint import resolve_checkpoint
from trainer.cli import main as cli_main
from trainer.elastic import DistEnv
from trainer.errors import ConfigError
from trainer.loop import Trainer
from trainer.models.export import model_card, write_export
from trainer.registry import load_config, task_class
from trainer.runs import load_for_inference
from trainer.tasks.base import TaskContext
from trainer.tasks.sampling import SampleRequest

CPU = torch.device("cpu")
GOLDEN = REPO / "tests" / "golden"
ATOL = 1e-5  # see the module doc


def _export(checkpoints: str, out: Path, capsys) -> str:
    assert cli_main(["checkpoints", "export", checkpoints, str(out)]) == 0
    return capsys.readouterr().out


def _pipeline(out: Path):
    pipe = DiffusionPipeline.from_pretrained(str(out))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _loaded(checkpoints: str):
    return load_for_inference(resolve_checkpoint(checkpoints, {}), True, CPU)


def test_an_unconditional_pixel_unet_exports_as_a_ddim_pipeline_that_samples_like_gentrain(tmp_path, capsys):
    root = str(GOLDEN / "digits-ddpm" / "checkpoints")  # epsilon UNet, sample.scheduler=ddim
    out = tmp_path / "pipe"
    printed = _export(root, out, capsys)
    assert "a diffusers DDIMPipeline: DiffusionPipeline.from_pretrained" in printed, printed
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "DDIMPipeline" and index["unet"] == ["diffusers", "UNet2DModel"]
    pipe = _pipeline(out)
    assert isinstance(pipe, DDIMPipeline) and isinstance(pipe.unet, UNet2DModel)
    cfg, task, modules = _loaded(root)
    sched = pipe.scheduler.config
    train = task.objective.train_scheduler.config
    for key in ("num_train_timesteps", "beta_schedule", "prediction_type", "clip_sample"):
        assert sched[key] == train[key], key
    card = (out / "README.md").read_text()
    assert "DDIMPipeline" in card and "blake3:" in card and "step 2" in card

    seed, steps = 5, 3
    ref = task.sample(modules, SampleRequest(4, seed=seed, inference_steps=steps, scheduler="ddim"), CPU)

    def run(p):
        g = torch.Generator().manual_seed(seed)
        return p(batch_size=4, num_inference_steps=steps, eta=0.0, generator=g, output_type="pt").images

    got = run(pipe)
    print(f"DDIMPipeline vs gentrain sample: max |diff| {(got - ref).abs().max().item():.3g}")
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    # The loop itself is gentrain's: with gentrain's own module, bit-identical.
    pipe.unet = modules["unet"]
    assert torch.equal(run(pipe), ref)


def test_an_export_to_a_remote_url_writes_the_same_files(tmp_path, capsys):
    import fsspec

    root = str(GOLDEN / "digits-ddpm" / "checkpoints")
    _export(root, tmp_path / "local", capsys)
    assert cli_main(["checkpoints", "export", root, "memory://exports/ddpm"]) == 0
    fs = fsspec.filesystem("memory")
    local = sorted(str(p.relative_to(tmp_path / "local")) for p in (tmp_path / "local").rglob("*") if p.is_file())
    remote = sorted(p.removeprefix("/exports/ddpm/") for p in fs.find("/exports/ddpm"))
    assert remote == local and "model_index.json" in remote
    assert fs.cat("/exports/ddpm/model_index.json") == (tmp_path / "local" / "model_index.json").read_bytes()


def test_a_class_conditional_pixel_unet_exports_folders_without_a_pipeline_and_says_why(tmp_path, capsys):
    out = tmp_path / "cfg"
    printed = _export(str(GOLDEN / "digits-cfg" / "checkpoints"), out, capsys)
    assert "without model_index.json" in printed and "class-conditional" in printed, printed
    assert not (out / "model_index.json").exists()
    card = (out / "README.md").read_text()
    assert "no diffusers pipeline (no model_index.json)" in card and "null class" in card
    unet = UNet2DModel.from_pretrained(str(out / "unet"))
    assert unet.config.num_class_embeds == 11
    assert json.loads((out / "scheduler" / "scheduler_config.json").read_text())["prediction_type"] == "v_prediction"


@pytest.mark.parametrize(
    ("prediction", "scheduler", "pipeline"),
    [
        ("epsilon", "dpm", "DDPMPipeline"),
        ("v_prediction", "ddim", "DDIMPipeline"),
        ("flow", "ddim", "DDPMPipeline"),
        ("edm", "ddim", None),
    ],
)
def test_each_objective_and_sampler_of_a_pixel_unet_gets_the_pipeline_that_samples_it(
    tmp_path, prediction, scheduler, pipeline
):
    overrides = [f"model.prediction_type={prediction}", f"sample.scheduler={scheduler}"]
    cfg = load_config("digits-ddpm", tiny(tmp_path, *overrides), environ={})
    task = task_class(cfg.task)(cfg.model_cfg, TaskContext(8, 1, 0, load_pretrained=False))
    modules = task.build({})
    torch.manual_seed(0)
    with torch.no_grad():  # fresh weights, moved off diffusers' initialization (zeroed output layers)
        for p in modules["unet"].parameters():
            p.add_(torch.randn_like(p) * 0.05)
    export = task.export(modules, cfg.sample)
    assert export.pipeline == pipeline, export.reason
    write_export(export, str(tmp_path / "out"), "card")
    if pipeline is None:
        assert "edm" in export.reason and not (tmp_path / "out" / "model_index.json").exists()
        return
    pipe = _pipeline(tmp_path / "out")
    assert type(pipe).__name__ == pipeline
    ref = task.sample(modules, SampleRequest(4, seed=3, inference_steps=4, scheduler=scheduler), CPU)
    got = pipe(batch_size=4, num_inference_steps=4, generator=torch.Generator().manual_seed(3), output_type="pt")
    torch.testing.assert_close(got.images, ref, atol=ATOL, rtol=0)
    assert ref.std() > 0.1


@pytest.fixture(scope="module")
def latent_dit(tmp_path_factory) -> str:
    """A tiny class-conditional latent DiT (v-prediction) on a tiny digits-autoencoder run (measured scaling
    factor), 2 steps each; its checkpoint root."""
    root = tmp_path_factory.mktemp("dit")
    small = ["model.disc_channels=8", "model.disc_layers=1", "model.scale_samples=24", "checkpoint.every_steps=2"]
    ae = load_config("digits-autoencoder", tiny(root / "ae", *small, max_steps=2), environ={})
    assert Trainer(ae, DistEnv()).fit() == 0
    dit = "{kind: dit, patch_size: 2, num_layers: 2, num_attention_heads: 2, attention_head_dim: 8}"
    args = tiny(
        root / "dit",
        f"model.autoencoder.url={root}/ae/run/checkpoints",
        f"model.backbone={dit}",
        "model.num_classes=10",
        "model.prediction_type=v_prediction",
        "checkpoint.every_steps=2",
        max_steps=2,
    )
    assert Trainer(load_config("digits-ddpm", args, environ={}), DistEnv()).fit() == 0
    return f"{root}/dit/run/checkpoints"


def test_a_latent_dit_exports_as_a_dit_pipeline_that_samples_like_gentrain_with_and_without_guidance(
    tmp_path, capsys, latent_dit
):
    out = tmp_path / "dit"
    printed = _export(latent_dit, out, capsys)
    assert "a diffusers DiTPipeline" in printed, printed
    pipe = _pipeline(out)
    assert isinstance(pipe, DiTPipeline) and isinstance(pipe.vae, AutoencoderKL)
    cfg, task, modules = _loaded(latent_dit)
    # The VAE decodes latents / scaling_factor, the factor the autoencoder run measured.
    measured = float(modules["autoencoder"].scaling_factor)
    assert measured != 1.0 and pipe.vae.config.scaling_factor == measured
    # Label tables: 1001 rows; the classes, then the trained null row (10) at 1000 and in between.
    assert pipe.transformer.config.num_embeds_ada_norm == 1000
    ours = modules["transformer"]
    for (name, mine), theirs in zip(
        ((n, p) for n, p in ours.named_parameters() if "class_embedder" in n),
        (p for n, p in pipe.transformer.named_parameters() if "class_embedder" in n),
        strict=True,
    ):
        assert mine.shape[0] == 11 and theirs.shape[0] == 1001, name
        assert torch.equal(theirs[:10], mine[:10]) and torch.equal(theirs[1000], mine[10])
        assert torch.equal(theirs[10:1000], mine[10].expand(990, -1))
    assert pipe.labels == {str(i): i for i in range(10)}  # id2label: the digits
    assert "1001 rows" in (out / "README.md").read_text()

    labels, seed, steps = [3, 7, 0, 9], 11, 3
    diffs = {}
    for scale in (1.0, 2.0):
        request = SampleRequest(
            4,
            seed=seed,
            inference_steps=steps,
            scheduler=cfg.sample.scheduler,
            guidance_scale=scale,
            labels=torch.tensor(labels),
        )
        ref = task.sample(modules, request, CPU)
        g = torch.Generator().manual_seed(seed)
        got = pipe(class_labels=labels, guidance_scale=scale, generator=g, num_inference_steps=steps, output_type="pt")
        diffs[scale] = got.images
        print(f"DiTPipeline vs gentrain sample, guidance {scale}: max |diff| {(got.images - ref).abs().max():.3g}")
        torch.testing.assert_close(got.images, ref, atol=ATOL, rtol=0)
    # Guidance and the labels change the images by far more than the bound.
    assert (diffs[2.0] - diffs[1.0]).abs().max() > 100 * ATOL


def test_a_caption_backbone_exports_its_folders_without_model_index_and_the_card_says_why(tmp_path):
    pixart = "{kind: pixart, patch_size: 2, num_layers: 1, num_attention_heads: 2, attention_head_dim: 8, caption_channels: 384}"
    cfg = load_config(
        "digits-ddpm",
        tiny(tmp_path, f"model.backbone={pixart}", f"model.text={{cache_dir: {tmp_path}/text}}"),
        environ={},
    )
    ctx = TaskContext(cfg.data.image_size, cfg.data.channels, cfg.seed, load_pretrained=False)
    task = task_class(cfg.task)(cfg.model_cfg, ctx)
    modules = task.build({})
    export = task.export(modules, cfg.sample)
    assert export.pipeline is None and "CLIP/T5" in export.reason
    card = model_card(
        export, task="ddpm", step=0, use_ema=True, checkpoint_url="x", digests={}, config={"model": "..."}
    )
    write_export(export, str(tmp_path / "out"), card)
    out = tmp_path / "out"
    assert not (out / "model_index.json").exists()
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "gentrain-export.json", "scheduler", "transformer"]
    assert "CLIP/T5" in (out / "README.md").read_text()
    net = PixArtTransformer2DModel.from_pretrained(str(out / "transformer"))
    mine = modules["transformer"].state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in net.state_dict().items())


def test_export_still_refuses_a_dit_in_pixels_as_a_pipeline_but_writes_its_transformer(tmp_path):
    dit = "{kind: dit, patch_size: 2, num_layers: 1, num_attention_heads: 2, attention_head_dim: 8}"
    cfg = load_config("digits-ddpm", tiny(tmp_path, f"model.backbone={dit}", "model.num_classes=10"), environ={})
    ctx = TaskContext(cfg.data.image_size, cfg.data.channels, cfg.seed, num_classes=10, load_pretrained=False)
    task = task_class(cfg.task)(cfg.model_cfg, ctx)
    export = task.export(task.build({}), cfg.sample)
    assert export.pipeline is None and "denoises pixels" in export.reason
    write_export(export, str(tmp_path / "out"), "card")
    assert DiTTransformer2DModel.from_pretrained(str(tmp_path / "out" / "transformer")).config.num_embeds_ada_norm == 10


def test_a_task_with_nothing_to_export_refuses_with_a_reason():
    cfg = load_config("digits-maskgit", ["data.image_size=8"], {})
    task = task_class(cfg.task)(cfg.model_cfg, TaskContext(8, cfg.data.channels, cfg.seed, load_pretrained=False))
    with pytest.raises(ConfigError, match="has no diffusers UNet to export"):  # the CLI: exit 2 with this line
        task.export({}, cfg.sample)


# ---------------------------------------------------------------- autoencoders
#
# An autoencoder's export is the same network with the same weights: the KL autoencoder *is* a diffusers
# AutoencoderKL, and the VQ-GAN's Encoder, quant_conv, post_quant_conv and Decoder are diffusers' own blocks
# (only the codebook moves, from vector-quantize-pytorch's layout into quantize.embedding.weight). So the
# encoder, the code choice and the decoder agree up to the BLAS alignment rounding of the module doc (about
# one ulp per matmul: below ATOL). The VQModel's forward adds one rounding gentrain's eval forward does not
# make: diffusers' straight-through z + (q - z), which differs from the code q by at most 2 ulp of
# max(|q|, |z - q|) per element (asserted below), about 1e-6 here; through the tiny decoder that moved
# the reconstructions by at most 1.2e-6 (measured on CPU), inside ATOL = 1e-5; the KL autoencoder's
# reconstruction has no such step (measured: identical).


def _digits(cfg, n: int = 8) -> torch.Tensor:
    """n held-out digits in [-1, 1] (the run's validation split)."""
    from trainer.data import SampleRef, build_splits

    _, val, _ = build_splits(cfg)
    return torch.stack([val[SampleRef(index=i, position=i)][0] for i in range(n)])


def _card_names_the_generator_digest(out: Path, root: str) -> str:
    entry = resolve_checkpoint(root, {}).info.manifest.files["generator.ema.safetensors"]
    card = (out / "README.md").read_text()
    assert f"`generator.ema.safetensors`: `blake3:{entry.blake3}`" in card, card
    assert "discriminator" not in {p.name for p in out.iterdir()}
    return card


def test_a_kl_autoencoder_exports_as_an_autoencoder_kl_with_its_measured_scaling_factor(tmp_path, capsys, latent_dit):
    root = str(Path(latent_dit).parents[2] / "ae" / "run" / "checkpoints")  # the fixture's autoencoder run
    out = tmp_path / "ae"
    printed = _export(root, out, capsys)
    assert "without model_index.json" in printed and not (out / "model_index.json").exists(), printed
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "gentrain-export.json", "vae"]
    card = _card_names_the_generator_digest(out, root)
    assert "AutoencoderKL.from_pretrained" in card
    vae = AutoencoderKL.from_pretrained(str(out / "vae")).eval()
    cfg, task, modules = _loaded(root)
    generator = modules["generator"]
    measured = float(generator.scaling_factor)
    assert measured != 1.0 and vae.config.scaling_factor == measured  # float32 -> JSON -> float: exact
    images = _digits(cfg)
    with torch.no_grad():
        ref = generator(images)["reconstruction"]  # gentrain's reconstruction: the posterior mean decoded
        got = vae(images).sample  # sample_posterior=False: the mode, i.e. the mean
        latents = vae.encode(images).latent_dist.mean * vae.config.scaling_factor
    print(f"AutoencoderKL vs gentrain reconstruction: max |diff| {(got - ref).abs().max():.3g}")
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(latents, generator.encode_latents(images), atol=ATOL, rtol=0)
    assert (ref - images).abs().max() > 100 * ATOL  # the bound is far below what the model changes


def test_a_vqgan_exports_as_a_vqmodel_that_reconstructs_like_gentrain(tmp_path, capsys):
    from diffusers import VQModel
    from test_vqgan_maskgit import VQGAN

    args = [*VQGAN[1:], f"run.dir={tmp_path}/run", "train.max_steps=2", "checkpoint.every_steps=2"]
    assert Trainer(load_config("digits-vqgan", [*args, "model.disc_start_step=1"], environ={}), DistEnv()).fit() == 0
    root = f"{tmp_path}/run/checkpoints"
    out = tmp_path / "vq"
    printed = _export(root, out, capsys)
    assert "without model_index.json" in printed, printed
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "gentrain-export.json", "vqvae"]
    assert "VQModel.from_pretrained" in _card_names_the_generator_digest(out, root)
    vq = VQModel.from_pretrained(str(out / "vqvae")).eval()
    cfg, task, modules = _loaded(root)
    generator = modules["generator"]
    assert vq.config.num_vq_embeddings == 32 and vq.config.vq_embed_dim == 4
    assert torch.equal(vq.quantize.embedding.weight, generator.quantizer.codebook)  # the trained EMA codebook
    images = _digits(cfg)
    with torch.no_grad():
        ref = generator(images)  # eval: the looked-up codes themselves, decoded
        z = vq.encode(images).latents
        torch.testing.assert_close(z, generator.quant_conv(generator.encoder(images)), atol=ATOL, rtol=0)
        st, _, (_, _, idx) = vq.quantize(z)
        assert torch.equal(idx.view(ref["indices"].shape), ref["indices"])  # the same codes: gentrain's tokens
        q = generator.lookup_codes(ref["indices"])
        assert ((st - q).abs() <= 2 * torch.finfo(q.dtype).eps * torch.maximum(q.abs(), (z - q).abs())).all()
        got = vq(images).sample
        codes = vq.decode(q, force_not_quantize=True).sample  # decoding the codes alone: no straight-through
    print(f"VQModel vs gentrain reconstruction: max |diff| {(got - ref['reconstruction']).abs().max():.3g}")
    torch.testing.assert_close(got, ref["reconstruction"], atol=ATOL, rtol=0)
    torch.testing.assert_close(codes.clamp(-1, 1), generator.decode_indices(ref["indices"]), atol=ATOL, rtol=0)
    assert (ref["reconstruction"] - images).abs().max() > 100 * ATOL


@pytest.mark.parametrize("quantizer", ["lfq", "fsq"])
def test_an_lfq_vqgan_exports_its_corner_codebook_and_fsq_is_refused(quantizer):
    from diffusers import VQModel

    from trainer.models.export import vq_model
    from trainer.models.vqgan import VQAutoencoder, VQGANConfig

    cfg = VQGANConfig(block_out_channels=[8, 16], norm_num_groups=4, quantizer=quantizer, codebook_size=16)
    torch.manual_seed(0)
    generator = VQAutoencoder(cfg, channels=1).eval()
    if quantizer == "fsq":
        with pytest.raises(ConfigError, match="fsq.*cannot express exactly"):
            vq_model(generator, 1, 8)
        return
    vq = vq_model(generator, 1, 8)
    assert isinstance(vq, VQModel) and vq.quantize.embedding.weight.shape == (16, 4)
    assert set(vq.quantize.embedding.weight.unique().tolist()) == {-1.0, 1.0}  # the corners of {-1, 1}^4
    x = torch.rand(8, 1, 8, 8) * 2 - 1
    with torch.no_grad():
        ref = generator(x)
        idx = vq.quantize(vq.encode(x).latents)[2][2]
        got = vq(x).sample
    assert torch.equal(idx.view(ref["indices"].shape), ref["indices"])  # nearest corner = LFQ's sign choice
    torch.testing.assert_close(got, ref["reconstruction"], atol=ATOL, rtol=0)
