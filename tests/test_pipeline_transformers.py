"""Fine-tuning a released transformer pipeline (issue 48): an SD3/3.5 folder at `model.pretrained` sets the ddpm
run's keys (its SD3Transformer2DModel's own config and weights as the mmdit backbone, the VAE, CLIP-L + CLIP-G + T5
as kind sd3, rectified flow with the scheduler's shift); the caption tokens and pooled embedding are
StableDiffusion3Pipeline.encode_prompt's, the run's first prediction is diffusers' own transformer's, and the
sd3-lora preset trains LoRA on both streams' attention through the CLI. A PixArt-Sigma folder likewise (its
PixArtTransformer2DModel as the pixart backbone, the noise half of its learned-sigma output; T5 with its mask;
epsilon with the scheduler's betas), with the pixart-sigma-lora preset; and Flux.1 dev and schnell folders (the
flux backbone: packed latents, position ids, dev's guidance; CLIP-L pooled + T5 as FluxPipeline.encode_prompt),
with the flux-lora preset. The pipelines are tiny random ones saved
by diffusers' own classes (tests/tiny_pipelines.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, clean_env, run_cli
from safetensors.torch import load_file
from test_text_encoders import WORDS
from tiny_pipelines import BUILDERS, captioned_images, draw, folder_fixture, pipeline_config, train_args

from trainer.checkpoint import CheckpointStore
from trainer.diffusion.backbones import MMDiTBackbone
from trainer.errors import ConfigError
from trainer.registry import task_class
from trainer.runs import load_frozen
from trainer.tasks.base import TaskContext

CPU = torch.device("cpu")
ENV = clean_env(PYTHONPATH=str(REPO / "tests"))
# Every training run here: square 16 px crops (the presets' buckets, auto at step 64, hold no 16 px bucket) and
# 8 T5 tokens.
TINY = ("data.buckets=null", "model.text.max_tokens=8")


sd3 = folder_fixture("sd3")


def _config(folder, tmp_path, *overrides: str, preset: str = "sd3-lora"):
    return pipeline_config(preset, folder, tmp_path, *overrides)


def test_an_sd3_folder_sets_the_model_keys(sd3, tmp_path):
    m = _config(sd3, tmp_path).model_cfg
    transformer = json.loads((sd3 / "transformer" / "config.json").read_text())
    assert m.backbone.kind == "mmdit" and m.backbone.transformer_config == transformer
    assert (m.backbone.caption_channels, m.backbone.pooled_channels) == (24, 6 + 10)  # T5's width; both projections
    assert m.text.kind == "sd3" and m.autoencoder.url == f"{sd3}/vae"
    assert [m.text.encoder, m.text.encoder_2, m.text.encoder_3] == [f"{sd3}/text_encoder{n}" for n in ("", "_2", "_3")]
    assert [m.text.tokenizer, m.text.tokenizer_2, m.text.tokenizer_3] == [
        f"{sd3}/tokenizer{n}" for n in ("", "_2", "_3")
    ]
    assert (m.text.width, m.text.pooled_width, m.text.clip_max_tokens, m.text.max_tokens) == (24, 16, 16, 77)
    # Rectified flow with the folder's scheduler's shift (3.0): the training draws come from its sigmas.
    assert (m.prediction_type, m.flow_shift, m.num_train_timesteps) == ("flow", 3.0, 1000)
    with pytest.raises(ConfigError, match=r"model.flow_shift=1.0 \(the folder's: 3.0\)"):
        _config(sd3, tmp_path, "model.flow_shift=1.0")
    with pytest.raises(ConfigError, match=r"model.backbone.num_layers \(the folder's transformer/config.json"):
        _config(sd3, tmp_path, "model.backbone={kind: mmdit, num_layers: 3}")


def test_an_sd3_folder_without_t5_is_refused_by_name(sd3, tmp_path):
    import shutil

    copy = tmp_path / "sd3"
    shutil.copytree(sd3, copy)
    index = json.loads((copy / "model_index.json").read_text())
    index.update(text_encoder_3=[None, None], tokenizer_3=[None, None])
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="SD3 folder without T5 .*text_encoder_3"):
        _config(copy, tmp_path)


def _task(folder, tmp_path, *overrides, preset: str = "sd3-lora"):
    cfg = _config(folder, tmp_path, "model.text.batch_size=1", "model.text.max_tokens=8", *overrides, preset=preset)
    task = task_class("ddpm")(cfg.model_cfg, TaskContext(16, 3, 0))
    modules = task.build({n: load_frozen(n, s, {}) for n, s in task.frozen_sources().items()})
    return task, modules


def test_sd3_caption_tokens_and_pooled_are_encode_prompts(sd3, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    task, _ = _task(sd3, tmp_path)
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3)
    for prompt in ("", "the red photo", " ".join(WORDS * 2)):  # empty, short, truncated (CLIP's 16, T5's 8)
        ours = task.text.encode([prompt], CPU)
        with torch.no_grad():  # as the pipeline's __call__ runs it (with grad on, T5's attention takes another kernel)
            tokens, _, pooled, _ = pipe.encode_prompt(
                prompt, prompt, prompt, device="cpu", do_classifier_free_guidance=False, max_sequence_length=8
            )
        assert ours.tokens.shape == tokens.shape == (1, 16 + 8, 24), prompt
        assert torch.equal(ours.tokens, tokens) and torch.equal(ours.pooled, pooled), prompt


@pytest.mark.parametrize("lora", [True, False])
def test_the_first_prediction_is_diffusers_sd3_transformers(sd3, tmp_path, lora):
    """The run's transformer is the folder's (architecture and weights; LoRA starts at B = 0), called on the
    noisy latents and timesteps the flow objective draws from the folder's shifted schedule."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    task, modules = _task(sd3, tmp_path, *([] if lora else ["model.lora=null"]))
    assert task.part == "transformer" and task.latent.shape == (4, 8, 8)
    net = modules["transformer"]
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    assert trainable and all((".lora_" in n) == lora for n in trainable)
    if lora:  # the mmdit backbone's targets: both streams' attention projections
        names = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
        assert names == {t.rsplit(".", 1)[-1] for t in MMDiTBackbone.lora_targets}
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(sd3 / "scheduler")
    assert torch.equal(task.objective.train_scheduler.sigmas, scheduler.sigmas)  # shift 3.0
    reference = SD3Transformer2DModel.from_pretrained(sd3 / "transformer").eval()
    x, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), scheduler.timesteps[[3, 700]]
    cond = task.conditions(2, CPU, torch.zeros(2, dtype=torch.bool), captions=["the red photo", "a blue"])
    assert set(cond) == {"captions", "pooled"}
    with torch.no_grad():
        ours = task._net(net.eval())(x, t, cond)
        theirs = reference(
            x, encoder_hidden_states=cond["captions"], pooled_projections=cond["pooled"], timestep=t
        ).sample
    assert torch.equal(ours, theirs)
    pinned = task.inputs()["pipeline"]
    assert pinned.pin and "transformer/diffusion_pytorch_model.safetensors" in pinned.files
    assert "text_encoder_3/model.safetensors" in pinned.files


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return captioned_images(tmp_path_factory.mktemp("images"), 4)


def _train(preset: str, folder, images, root, *extra: str, max_steps: int = 2, env=None):
    """`gentrain train PRESET` on a tiny pipeline folder and captioned images: a few steps, a checkpoint and a
    preview grid at step 2 (unless `extra` says otherwise)."""
    args = train_args(
        preset,
        folder,
        images,
        root,
        *TINY,
        "sample.every_steps=2",
        "sample.inference_steps=2",
        *extra,
        max_steps=max_steps,
    )
    return run_cli("train", *args, env=env or ENV)


# Each family's LoRA run through its preset, trained once in this module (`straight`): the preset tests read its
# step-2 checkpoint and preview, the kill/resume tests compare a SIGKILLed run with it (KillableDDPM dies only where
# PROBE_TASK_KILL says; previews at step 2 in both runs).
LORA_PRESETS = {"sd3": "sd3-lora", "pixart": "pixart-sigma-lora", "flux-dev": "flux-lora"}
FAMILY_FIXTURES = {"sd3": "sd3", "pixart": "pixart", "flux-dev": "flux_dev"}


def _lora_run(family: str, folder, images, root, env=None):
    preset = LORA_PRESETS.get(family, "flux-lora")
    return _train(preset, folder, images, root, "task=probe_tasks:KillableDDPM", max_steps=3, env=env)


@pytest.fixture(scope="module")
def straight(images, tmp_path_factory):
    """`straight(family, folder)`: the run folder of that family's uninterrupted 3-step LoRA run, trained on first
    use."""
    runs = {}

    def get(family: str, folder):
        if family not in runs:
            root = tmp_path_factory.mktemp(f"straight-{family}") / "run"
            r = _lora_run(family, folder, images, root)
            assert r.returncode == 0, r.stderr[-3000:]
            runs[family] = root
        return runs[family]

    return get


def _trained_lora(root) -> tuple:
    """(info, transformer weights) of the step-2 checkpoint, after checking the preview grid and its validity."""
    assert (root / "samples" / "step-000000002.png").is_file()
    store = CheckpointStore(str(root / "checkpoints"), {})
    info = store.check(2)
    assert info.valid, info.reason
    return info, store.read_tensors(info, "transformer.model.safetensors")


@pytest.mark.slow
def test_the_sd3_preset_trains_lora_and_samples_from_an_sd3_folder(sd3, straight):
    info, weights = _trained_lora(straight("sd3", sd3))
    assert info.manifest.config["model"]["flow_shift"] == 3.0
    folder = load_file(sd3 / "transformer" / "diffusion_pytorch_model.safetensors")
    # Whatever of the frozen base a checkpoint holds is the folder's (bf16, train.precision's dtype); the
    # adapters on both streams moved off B = 0.
    base = {k.replace(".base_layer.", "."): k for k in weights if ".lora_" not in k}
    assert set(base) <= set(folder)
    assert all(torch.equal(weights[base[k]], folder[k].to(weights[base[k]].dtype)) for k in base)
    moved = {
        k.split(".lora_B.")[0].rsplit(".", 1)[-1] for k in weights if ".lora_B." in k and weights[k].abs().max() > 0
    }
    assert {"to_q", "add_q_proj"} <= moved


@pytest.mark.slow
def test_the_exported_sd3_lora_loads_into_the_base_pipeline_and_draws_what_gentrain_samples(sd3, images, tmp_path):
    """`checkpoints export` writes the adapters under `transformer.` (diffusers' pipeline LoRA layout): the base
    StableDiffusion3Pipeline plus `load_lora_weights(OUT/transformer-lora)`, on the run's shifted flow-matching
    schedule, draws the images gentrain draws within 1/255 (same seed, steps, guidance, prompt)."""
    from diffusers import StableDiffusion3Pipeline

    prompt, steps, scale = "the red photo", 2, 3.0
    out, _, ours = _exported("sd3-lora", sd3, images, tmp_path, steps, scale)

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3)
    pipe.load_lora_weights(str(out / "transformer-lora"))
    assert pipe.transformer.peft_config, "diffusers loaded no adapter"

    theirs = draw(pipe, prompt, steps, scale, max_sequence_length=8)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1 / 255
    pipe.unload_lora_weights()  # the adapters matter: without them diffusers draws something else
    assert (draw(pipe, prompt, steps, scale, max_sequence_length=8) - ours).abs().max() > 1 / 255


# ---------------------------------------------------------------- PixArt-Sigma


pixart = folder_fixture("pixart-sigma")


def test_a_pixart_sigma_folder_sets_the_model_keys(pixart, tmp_path):
    m = _config(pixart, tmp_path, preset="pixart-sigma-lora").model_cfg
    transformer = json.loads((pixart / "transformer" / "config.json").read_text())
    assert m.backbone.kind == "pixart" and m.backbone.transformer_config == transformer
    assert (m.backbone.caption_channels, m.backbone.pixel_scale) == (16, 2)  # T5's width; the VAE's downsampling
    assert (m.text.kind, m.text.encoder, m.text.tokenizer) == ("t5", f"{pixart}/text_encoder", f"{pixart}/tokenizer")
    assert (m.text.width, m.text.max_tokens) == (16, 300)  # PixArt-Sigma's 300 T5 tokens
    # DPMSolverMultistepScheduler's defaults: epsilon on the linear betas.
    assert (m.prediction_type, m.beta_schedule, m.beta_start, m.beta_end) == ("epsilon", "linear", 0.0001, 0.02)
    with pytest.raises(ConfigError, match=r"model.backbone.num_layers \(the folder's transformer/config.json"):
        _config(pixart, tmp_path, "model.backbone={kind: pixart, caption_channels: 16, num_layers: 3}")


def test_pixart_captions_are_encode_prompts_and_the_prediction_is_the_transformers_noise_half(pixart, tmp_path):
    """T5's states and mask are PixArtSigmaPipeline.encode_prompt's; the run's prediction is the first half (the
    noise) of diffusers' PixArtTransformer2DModel's learned-sigma output, as the pipeline reads it."""
    from diffusers import PixArtSigmaPipeline, PixArtTransformer2DModel

    task, modules = _task(pixart, tmp_path, preset="pixart-sigma-lora")
    assert task.part == "transformer" and task.latent.shape == (4, 8, 8)
    pipe = PixArtSigmaPipeline.from_pretrained(pixart)
    for prompt in ("", "the red photo", " ".join(WORDS * 2)):
        ours = task.text.encode([prompt], CPU)
        with torch.no_grad():
            tokens, mask, _, _ = pipe.encode_prompt(
                prompt, do_classifier_free_guidance=False, device="cpu", clean_caption=False, max_sequence_length=8
            )
        assert torch.equal(ours.tokens, tokens) and torch.equal(ours.mask, mask.float()), prompt
    reference = PixArtTransformer2DModel.from_pretrained(pixart / "transformer").eval()
    assert reference.config.out_channels == 8  # learned sigma: noise and variance
    x, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([3, 700])
    cond = task.conditions(2, CPU, torch.zeros(2, dtype=torch.bool), captions=["the red photo", "a blue"])
    assert set(cond) == {"captions", "caption_mask"}
    with torch.no_grad():
        ours = task._net(modules["transformer"].eval())(x, t, cond)
        theirs = reference(
            x,
            encoder_hidden_states=cond["captions"],
            encoder_attention_mask=cond["caption_mask"],
            timestep=t,
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
        ).sample
    assert ours.shape == (2, 4, 8, 8)
    assert torch.equal(ours, theirs.chunk(2, dim=1)[0])


def test_text_encoder_lora_on_t5_is_refused_naming_the_key(pixart, tmp_path):
    """model.lora.text_encoder adapts CLIP text encoders (SD 1.x/2.x, SDXL); PixArt's T5 is exit 2 naming it."""
    with pytest.raises(ConfigError, match=r"model.lora.text_encoder=true: .*'t5'.*set model.lora.text_encoder=false"):
        _task(pixart, tmp_path, "model.lora.text_encoder=true", preset="pixart-sigma-lora")


@pytest.mark.slow
def test_the_pixart_sigma_preset_trains_lora_from_a_pixart_folder(pixart, straight):
    info, weights = _trained_lora(straight("pixart", pixart))
    assert any(weights[k].abs().max() > 0 for k in weights if ".lora_B." in k)


# ---------------------------------------------------------------- Flux.1


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    return BUILDERS["flux"](tmp_path_factory.mktemp("pipelines-flux-dev"), dev=True)


@pytest.fixture(scope="module", params=["dev", "schnell"])
def flux(request, tmp_path_factory):
    if request.param == "dev":  # one dev folder for this module's every test (the kill/resume test's too)
        return request.getfixturevalue("flux_dev")
    return BUILDERS["flux"](tmp_path_factory.mktemp("pipelines-flux-schnell"), dev=False)


def test_a_flux_folder_sets_the_model_keys(flux, tmp_path):
    m = _config(flux, tmp_path, preset="flux-lora").model_cfg
    transformer = json.loads((flux / "transformer" / "config.json").read_text())
    dev = transformer["guidance_embeds"]
    assert m.backbone.kind == "flux" and m.backbone.transformer_config == transformer
    assert (m.backbone.caption_channels, m.backbone.pooled_channels, m.backbone.guidance_embeds) == (16, 8, dev)
    assert (m.text.kind, m.text.encoder_2, m.text.tokenizer_2) == (
        "flux",
        f"{flux}/text_encoder_2",
        f"{flux}/tokenizer_2",
    )
    assert (m.text.width, m.text.pooled_width, m.text.clip_max_tokens) == (16, 8, 16)  # T5's; CLIP-L's hidden size
    assert m.text.max_tokens == (512 if dev else 256)
    # dev's scheduler shifts dynamically, by resolution, at sampling only: the training sigmas are unshifted.
    assert (m.prediction_type, m.flow_shift, m.weighting_scheme) == ("flow", 1.0, "none")


def test_flux_captions_are_encode_prompts_and_the_first_prediction_is_diffusers_transformers(flux, tmp_path):
    """CLIP-L's pooled output and T5's tokens are FluxPipeline.encode_prompt's; the run's prediction on latents
    (N, C, H, W) is the transformer's on FluxPipeline's packed latents, position ids, sigma = t / 1000 and, for
    dev, the guidance 3.5, unpacked as the pipeline unpacks it."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    task, modules = _task(flux, tmp_path, preset="flux-lora")
    pipe = FluxPipeline.from_pretrained(flux)
    for prompt in ("", "the red photo", " ".join(WORDS * 2)):
        ours = task.text.encode([prompt], CPU)
        with torch.no_grad():
            tokens, pooled, _ = pipe.encode_prompt(prompt, None, device="cpu", max_sequence_length=8)
        assert torch.equal(ours.tokens, tokens) and torch.equal(ours.pooled, pooled), prompt
    reference = FluxTransformer2DModel.from_pretrained(flux / "transformer").eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(flux / "scheduler")
    x, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), scheduler.timesteps[[3, 700]]
    cond = task.conditions(2, CPU, torch.zeros(2, dtype=torch.bool), captions=["the red photo", "a blue"])
    assert set(cond) == {"captions", "pooled"}
    dev = reference.config.guidance_embeds
    with torch.no_grad():
        ours = task._net(modules["transformer"].eval())(x, t, cond)
        theirs = reference(
            FluxPipeline._pack_latents(x, 2, 4, 8, 8),
            encoder_hidden_states=cond["captions"],
            pooled_projections=cond["pooled"],
            timestep=t / 1000,
            img_ids=FluxPipeline._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32),
            txt_ids=torch.zeros(cond["captions"].shape[1], 3),
            guidance=torch.full((2,), 3.5) if dev else None,
        ).sample
    assert torch.equal(ours, FluxPipeline._unpack_latents(theirs, 16, 16, 2))
    lora = {n.split(".lora_")[0] for n, p in modules["transformer"].named_parameters() if p.requires_grad}
    assert any(n.startswith("single_transformer_blocks.") for n in lora) and any(
        n.endswith("ff_context.net.2") for n in lora
    )


@pytest.mark.slow
def test_the_flux_preset_trains_lora_from_a_flux_folder(flux, straight):
    dev = json.loads((flux / "transformer" / "config.json").read_text())["guidance_embeds"]
    info, weights = _trained_lora(straight("flux-dev" if dev else "flux-schnell", flux))
    assert any(weights[k].abs().max() > 0 for k in weights if ".lora_B." in k)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(LORA_PRESETS))
def test_a_sigkilled_lora_run_of_each_transformer_family_resumes_bit_identically(
    family, request, straight, images, tmp_path
):
    """An SD3, PixArt-Sigma or Flux.1 dev LoRA run SIGKILLed in its third step (after the step-2 checkpoint) and
    restarted ends at step 3 with the weights, EMA, optimizer state and RNG of a run never interrupted (bf16 base,
    fp32 adapters). Flux dev: packing, position ids and the guidance embedding; SD 1.x and SDXL:
    tests/test_pipeline_finetune.py and tests/test_bucket_conditioning.py."""
    folder = request.getfixturevalue(FAMILY_FIXTURES[family])
    reference = straight(family, folder)  # the uninterrupted run, shared with the preset tests
    killed = tmp_path / "killed"
    kill = clean_env(PYTHONPATH=str(REPO / "tests"), PROBE_TASK_KILL="0:2")  # KillableDDPM's step index 2: the third
    r = _lora_run(family, folder, images, killed, env=kill)
    assert r.returncode == -9, r.stderr[-3000:]
    r = _lora_run(family, folder, images, killed)
    assert r.returncode == 0 and "resumed_from=" in r.stderr, r.stderr[-3000:]
    a, b = (CheckpointStore(str(root / "checkpoints"), {}) for root in (reference, killed))
    ia, ib = a.check(3), b.check(3)
    assert ia.valid and ib.valid
    names = [n for n in ia.manifest.files if n.endswith(".safetensors")]
    assert "transformer.optimizer.safetensors" in names
    for name in names:
        ta, tb = a.read_tensors(ia, name), b.read_tensors(ib, name)
        assert ta.keys() == tb.keys(), name
        assert all(torch.equal(ta[k], tb[k]) for k in ta), name


# ---------------------------------------------------------------- LoRA files out, drawn by diffusers


def _exported(preset: str, folder, images, tmp_path, steps: int, scale: float, *train: str):
    """A 2-step fp32 LoRA run of `preset` on `folder` (no previews; `train`: its own keys), exported: (export
    folder, the run's objective, gentrain's images for "the red photo" x 2 at seed 7, `steps` steps and guidance
    `scale`)."""
    from trainer.runs import load_for_inference
    from trainer.tasks.sampling import SampleRequest

    root = tmp_path / "run"
    r = run_cli("train", *train_args(preset, folder, images, root, *TINY, "train.precision=no", *train), env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "export"
    r = run_cli("checkpoints", "export", str(root / "checkpoints"), str(out), env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    adapters = load_file(out / "transformer-lora" / "pytorch_lora_weights.safetensors")
    assert adapters and all(k.startswith("transformer.") for k in adapters)
    store = CheckpointStore(str(root / "checkpoints"), {})
    _, task, modules = load_for_inference(store.view(store.check(2)), use_ema=True, device=CPU)
    request = SampleRequest(num=2, seed=7, prompts=["the red photo"], inference_steps=steps, guidance_scale=scale)
    return out, task.objective, task.sample(modules, request, CPU)


@pytest.mark.slow
@pytest.mark.parametrize("flux", ["dev"], indirect=True)  # dev: packing, ids and the guidance embedding
def test_the_exported_flux_lora_loads_into_the_base_pipeline_and_draws_what_gentrain_samples(flux, images, tmp_path):
    """Flux.1 dev (its guidance embedding; schnell, without one, shares the rest): the base FluxPipeline plus `load_lora_weights(OUT/
    transformer-lora)` draws gentrain's images within 1/255: the same packed noise, ids and embedded guidance
    (dev: the run's 3.5), gentrain's classifier-free guidance as the pipeline's `true_cfg_scale` with the empty
    negative prompt, on the run's flow schedule (its scheduler and sigmas: FluxPipeline's own are other ones)."""
    from diffusers import FluxPipeline

    steps, scale = 2, 3.0
    out, objective, ours = _exported("flux-lora", flux, images, tmp_path, steps, scale, "sample.inference_steps=2")
    pipe = FluxPipeline.from_pretrained(flux)
    pipe.load_lora_weights(str(out / "transformer-lora"))
    assert pipe.transformer.peft_config, "diffusers loaded no adapter"
    pipe.scheduler = objective.inference_scheduler("ddim")
    probe = objective.inference_scheduler("ddim")
    probe.set_timesteps(steps)

    def draw_flux():
        # guidance_scale: dev's embedded guidance (model.backbone.guidance_scale; schnell ignores it); the run's
        # classifier-free guidance is the pipeline's true_cfg_scale.
        sigmas = probe.sigmas[:-1].tolist()
        kwargs = dict(negative_prompt="", true_cfg_scale=scale, sigmas=sigmas, max_sequence_length=8)
        return draw(pipe, "the red photo", steps, 3.5, **kwargs)

    theirs = draw_flux()
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1 / 255
    pipe.unload_lora_weights()
    assert (draw_flux() - ours).abs().max() > 1 / 255


@pytest.mark.slow
def test_the_exported_pixart_sigma_transformer_draws_what_gentrain_samples(pixart, images, tmp_path):
    """PixArt-Sigma (diffusers has no LoRA loader for its pipeline or transformer): the base PixArtSigmaPipeline
    with the exported transformer (adapters merged) draws gentrain's images within 1/255 on the run's DDIM
    schedule (the noise half of the learned-sigma output, the masked T5 tokens, no resolution binning at 16 px)."""
    from diffusers import PixArtSigmaPipeline, PixArtTransformer2DModel

    steps, scale = 2, 3.0
    out, objective, ours = _exported(
        "pixart-sigma-lora", pixart, images, tmp_path, steps, scale, "sample.inference_steps=2"
    )

    def draw_pixart(pipe):
        pipe.scheduler = objective.inference_scheduler("ddim")
        kwargs = dict(eta=0.0, use_resolution_binning=False, clean_caption=False, max_sequence_length=8)
        return draw(pipe, "the red photo", steps, scale, **kwargs)

    merged = PixArtTransformer2DModel.from_pretrained(out / "transformer")
    theirs = draw_pixart(PixArtSigmaPipeline.from_pretrained(pixart, transformer=merged))
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1 / 255
    assert (draw_pixart(PixArtSigmaPipeline.from_pretrained(pixart)) - ours).abs().max() > 1 / 255  # the base alone
