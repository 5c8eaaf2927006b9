"""Adapter-only LoRA checkpoints (issue 48, deliver 3): what a LoRA run's checkpoint holds, in bytes, for a
real-shaped Stable Diffusion 1.5 UNet built on the meta device (no weights: sizes from shapes and dtypes).

The runs themselves (files hold no base tensor, bit-identical resume after SIGKILL, a changed or missing base
folder, sample/export/verify from such a checkpoint) are in tests/test_pipeline_finetune.py and
tests/test_finetune.py. The figures printed here (`pytest -s`) are the ones in docs/tasks/pipelines.md and
docs/benchmarks.md.

Below them, what comes out of such a checkpoint: `checkpoints export --merged` writes the whole released
pipeline (the LoRA merged into its UNet, the other components copied from the pinned base) that diffusers'
`DiffusionPipeline.from_pretrained` loads and draws gentrain's images with; and a base folder changed after
the run is exit 2 naming the file for `sample`, `export` and `export --merged`."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, clean_env, run_cli
from tiny_pipelines import BUILDERS, captioned_images, draw, train_args

from trainer.models.finetune import LoraSettings, apply_lora, saved_keys

CPU = torch.device("cpu")
ENV = clean_env(PYTHONPATH=str(REPO / "tests"))

# runwayml/stable-diffusion-v1-5 unet/config.json: the fields that shape its weights (the rest are defaults).
SD15_UNET = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
    "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
}
SD15_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the sd15-lora preset's, diffusers' train_text_to_image_lora.py


def lora_checkpoint_bytes(rank: int) -> dict[str, int]:
    """The tensor bytes of one checkpoint of a LoRA run on SD 1.5's UNet (bf16 base, fp32 adapters, EMA on,
    AdamW), before (the whole module saved: base in bf16 plus adapters) and now (the adapters only)."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    with init_empty_weights():
        unet = UNet2DConditionModel(**SD15_UNET)
        apply_lora(unet, LoraSettings(rank=rank, targets=SD15_TARGETS), "model.lora", SD15_TARGETS)
    keep = saved_keys(unet)
    assert keep is not None
    state = unet.state_dict()
    adapters = sum(t.numel() for k, t in state.items() if k in keep)
    base = sum(t.numel() for k, t in state.items() if k not in keep)
    assert all(".lora_" in k for k in keep) and not any(".lora_" in k for k in set(state) - keep)
    # model + EMA: weights (base bf16, adapters fp32); optimizer: exp_avg and exp_avg_sq of the adapters (fp32)
    # and a step count (an fp32 scalar) per adapter tensor.
    optimizer = 2 * 4 * adapters + 4 * len(keep)
    return {
        "base_params": base,
        "adapter_params": adapters,
        "whole": 2 * (2 * base + 4 * adapters) + optimizer,
        "adapters_only": 2 * 4 * adapters + optimizer,
    }


@pytest.mark.parametrize("rank", [4, 16])
def test_an_sd15_lora_checkpoint_is_the_adapters_size_not_the_bases(rank):
    b = lora_checkpoint_bytes(rank)
    assert b["base_params"] == 859_520_964  # SD 1.5's UNet
    # Rank r on to_q/to_k/to_v/to_out.0: r * (in + out) per projection, 797,184 at rank 4 (diffusers' 3.2 MB file).
    assert b["adapter_params"] == 797_184 * rank // 4
    assert b["adapters_only"] == 16 * b["adapter_params"] + 4 * 256  # 128 projections: A and B each
    assert b["whole"] > 50 * b["adapters_only"]
    mb = 1e6
    print(
        f"\nSD 1.5 UNet, LoRA rank {rank}: {b['adapter_params']:,} adapter parameters; checkpoint tensors "
        f"{b['adapters_only'] / mb:.1f} MB adapter-only vs {b['whole'] / mb:.1f} MB with the bf16 base "
        f"({b['whole'] / b['adapters_only']:.0f}x)"
    )


def test_a_whole_lora_state_still_loads_and_a_partial_one_is_refused():
    """Checkpoints of LoRA runs written before adapter-only ones hold the whole module: they load as they did.
    A state with some base weights but not all fits neither and is refused naming what is missing."""
    from types import SimpleNamespace

    from tiny_backbones import tiny_unet2d

    from trainer.checkpoint.state import check_fits
    from trainer.errors import CheckpointCorrupt

    unet = tiny_unet2d()
    apply_lora(unet, LoraSettings(rank=2, targets=["conv1"]), "model.lora", ["conv1"])
    keep = saved_keys(unet)
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params)
    part = SimpleNamespace(
        module=unet,
        saved_keys=keep,
        ema=None,
        optimizer=opt,
        optimizer_params=lambda: params,
        lr_schedule=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        scaler=None,
    )
    full = dict(unet.state_dict())
    for model in (full, {k: v for k, v in full.items() if k in keep}):
        state = {"model": model, "optimizer": opt.state_dict(), "lr_schedule": part.lr_schedule.state_dict()}
        check_fits(part, state, "test")
    partial = {k: v for k, v in full.items() if k in keep or k.startswith("conv_in.")}
    state = {"model": partial, "optimizer": opt.state_dict(), "lr_schedule": part.lr_schedule.state_dict()}
    with pytest.raises(CheckpointCorrupt, match="weights do not match the model .*extra \\['conv_in"):
        check_fits(part, state, "test")


# ---------------------------------------------------------------- out of a LoRA checkpoint of a released pipeline


@pytest.fixture(scope="module")
def sd_run(tmp_path_factory):
    """A 2-step fp32 LoRA run (sd15-lora) on the UNet and the text encoder (model.lora.text_encoder=true) of a
    tiny StableDiffusionPipeline folder: (base, run root)."""
    root = tmp_path_factory.mktemp("sd-lora")
    base = BUILDERS["sd"](root)
    images = captioned_images(tmp_path_factory.mktemp("images"), 4)
    text = f"model.text.cache_dir={root / 'text'}"
    args = train_args(
        "sd15-lora", base, images, root / "run", "train.precision=no", text, "model.lora.text_encoder=true"
    )
    r = run_cli("train", *args, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return base, root / "run"


@pytest.mark.slow
def test_the_merged_export_is_the_whole_pipeline_and_draws_what_gentrain_samples(sd_run, tmp_path):
    """`checkpoints export --merged`: OUT is a StableDiffusionPipeline folder (model_index.json; the UNet and
    the text encoder with their adapters merged, no adapter folder; VAE and tokenizer byte for byte the base's;
    the run's sampler) that `DiffusionPipeline.from_pretrained(OUT)` loads and that draws gentrain's images within
    1/255 (same seed, steps, guidance, prompt)."""
    import json

    from diffusers import DiffusionPipeline, StableDiffusionPipeline

    from trainer.checkpoint import CheckpointStore
    from trainer.runs import load_for_inference
    from trainer.tasks.sampling import SampleRequest

    base, root = sd_run
    out = tmp_path / "merged"
    r = run_cli("checkpoints", "export", str(root / "checkpoints"), str(out), "--merged", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "StableDiffusionPipeline" in r.stdout and not (out / "unet-lora").exists()
    for rel in ("vae/diffusion_pytorch_model.safetensors", "tokenizer/tokenizer.json", "text_encoder/config.json"):
        assert (out / rel).read_bytes() == (base / rel).read_bytes(), rel
    # The text encoder trained too: its weights are the merged ones.
    assert (out / "text_encoder/model.safetensors").read_bytes() != (
        base / "text_encoder/model.safetensors"
    ).read_bytes()
    index = json.loads((out / "model_index.json").read_text())
    # The run's sampler (the preset's sample.scheduler=dpm) in place of the base's DDPMScheduler.
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["scheduler"] == ["diffusers", "DPMSolverMultistepScheduler"]
    assert json.loads((out / "gentrain-export.json").read_text())["complete"] is True

    store = CheckpointStore(str(root / "checkpoints"), {})
    _, task, modules = load_for_inference(store.view(store.check(2)), use_ema=True, device=CPU)
    prompt, steps, scale = "the red photo", 3, 3.0
    request = SampleRequest(
        num=2, seed=7, prompts=[prompt], inference_steps=steps, guidance_scale=scale, scheduler="dpm"
    )
    ours = task.sample(modules, request, CPU)

    pipe = DiffusionPipeline.from_pretrained(out)
    assert isinstance(pipe, StableDiffusionPipeline) and not getattr(pipe.unet, "peft_config", None)

    theirs = draw(pipe, prompt, steps, scale)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1 / 255
    original = StableDiffusionPipeline.from_pretrained(base, scheduler=pipe.scheduler)
    assert (draw(original, prompt, steps, scale) - ours).abs().max() > 1 / 255  # the merged adapters matter


def test_merged_export_of_a_run_without_a_pipeline_folder_is_refused():
    """--merged needs the released pipeline the run fine-tuned (its pinned `pipeline` input): a run without one
    is a ConfigError (exit 2) saying to export without --merged, before anything is written."""
    from torch import nn

    from trainer.checkpoint.validity import InputRecord
    from trainer.errors import ConfigError
    from trainer.models.export import merged_pipeline
    from trainer.tasks.base import Export

    for base in (None, InputRecord(url="/gone")):
        with pytest.raises(ConfigError, match="not trained from a pipeline folder.*without --merged"):
            merged_pipeline(Export(models={"unet": (nn.Linear(1, 1), {})}), base, {})


@pytest.mark.slow
def test_a_changed_base_folder_is_exit_2_naming_the_file_for_sample_and_export(sd_run, tmp_path):
    """An adapter-only checkpoint whose pinned base changed after the run (a file edited): `sample`, `export`
    and `export --merged` exit 2 with one line naming the changed file and what to do (verify, and a gone
    folder for all three: tests/test_pipeline_finetune.py)."""
    import shutil

    base, root = sd_run
    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(root / "checkpoints", ckpt)
    manifest = ckpt / "step-000000002" / "manifest.json"
    manifest.write_text(manifest.read_text().replace(str(base), str(copy)))  # the copy is the pinned base now
    tokens = copy / "tokenizer" / "tokenizer_config.json"
    tokens.write_text(tokens.read_text().replace("{", '{"edited": 99999, ', 1))
    for args in (
        ["sample", str(ckpt), "--num", "1", "--steps", "2", "--out", str(tmp_path / "x.png")],
        ["checkpoints", "export", str(ckpt), str(tmp_path / "out")],
        ["checkpoints", "export", str(ckpt), str(tmp_path / "out"), "--merged"],
    ):
        r = run_cli(*args, env=ENV)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr[-3000:])
        assert "tokenizer/tokenizer_config.json" in last and "Restore the folder" in last, (args, last)
    assert not (tmp_path / "out" / "model_index.json").exists()


@pytest.mark.slow
def test_text_encoder_lora_trains_checkpoints_adapters_only_and_loads_into_diffusers(sd_run, tmp_path):
    """model.lora.text_encoder=true (SD 1.x): LoRA on the CLIP's q/k/v/out projections trains in the step (no
    caption embedding cached), the checkpoint holds its adapters alone (`text_encoder.*`, beside the UNet's), and
    the exported file (`unet.*` and `text_encoder.*` keys) loaded by `StableDiffusionPipeline.load_lora_weights`
    onto the base draws gentrain's images within 1/255; without the text encoder's adapters it draws others."""
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    from trainer.checkpoint import CheckpointStore
    from trainer.runs import load_for_inference
    from trainer.tasks.sampling import SampleRequest

    base, root = sd_run
    assert not list((root.parent / "text").rglob("*.safetensors")), "a caption embedding was cached"
    saved = load_file(root / "checkpoints" / "step-000000002" / "unet.model.safetensors")
    text = {k for k in saved if k.startswith("text_encoder.")}
    assert text and all(".lora_" in k for k in saved)  # adapters only, the text encoder's among them
    assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in text} == {"q_proj", "k_proj", "v_proj", "out_proj"}
    assert any(saved[k].abs().max() > 0 for k in text if ".lora_B." in k)
    out = tmp_path / "export"
    r = run_cli("checkpoints", "export", str(root / "checkpoints"), str(out), env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    adapters = load_file(out / "unet-lora" / "pytorch_lora_weights.safetensors")
    assert {k.split(".", 1)[0] for k in adapters} == {"unet", "text_encoder"}

    store = CheckpointStore(str(root / "checkpoints"), {})
    _, task, modules = load_for_inference(store.view(store.check(2)), use_ema=True, device=CPU)
    prompt, steps, scale = "the red photo", 3, 3.0
    request = SampleRequest(num=2, seed=7, prompts=[prompt], inference_steps=steps, guidance_scale=scale)
    ours = task.sample(modules, request, CPU)
    pipe = StableDiffusionPipeline.from_pretrained(base, safety_checker=None)
    pipe.scheduler = task.objective.inference_scheduler("ddim")  # after construction: it resets steps_offset

    pipe.load_lora_weights(str(out / "unet-lora"))
    assert pipe.unet.peft_config and pipe.text_encoder.peft_config, "diffusers loaded no text encoder adapter"
    theirs = draw(pipe, prompt, steps, scale, eta=0.0)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1 / 255
    pipe.unload_lora_weights()
    unet_only = {k: v for k, v in adapters.items() if k.startswith("unet.")}
    pipe.load_lora_weights(unet_only)
    # The text encoder's adapters matter.
    assert (draw(pipe, prompt, steps, scale, eta=0.0) - ours).abs().max() > 1 / 255


@pytest.mark.slow
def test_sdxl_text_encoder_lora_loads_into_diffusers_on_both_clips(tmp_path):
    """SDXL with model.lora.text_encoder=true: both CLIPs adapted (`text_encoder.*`, `text_encoder_2.*` in the
    exported file), and `StableDiffusionXLPipeline.load_lora_weights` onto the base draws gentrain's images
    within 1/255 (guidance 1: the pipeline's unconditional branch is zeros, gentrain's the empty caption's)."""
    from diffusers import StableDiffusionXLPipeline
    from safetensors.torch import load_file

    from trainer.checkpoint import CheckpointStore
    from trainer.runs import load_for_inference
    from trainer.tasks.sampling import SampleRequest

    base = BUILDERS["sdxl"](tmp_path)
    images = captioned_images(tmp_path, 4)
    root = tmp_path / "run"
    extra = [
        "train.precision=no",
        f"model.text.cache_dir={tmp_path / 'text'}",
        "model.lora.text_encoder=true",
        "data.buckets=null",  # sdxl-lora's buckets (auto, step 64) hold no 16 px bucket: square crops
    ]
    r = run_cli("train", *train_args("sdxl-lora", base, images, root, *extra), env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "export"
    r = run_cli("checkpoints", "export", str(root / "checkpoints"), str(out), env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    adapters = load_file(out / "unet-lora" / "pytorch_lora_weights.safetensors")
    assert {k.split(".", 1)[0] for k in adapters} == {"unet", "text_encoder", "text_encoder_2"}
    store = CheckpointStore(str(root / "checkpoints"), {})
    _, task, modules = load_for_inference(store.view(store.check(2)), use_ema=True, device=CPU)
    request = SampleRequest(num=2, seed=7, prompts=["the red photo"], inference_steps=3, guidance_scale=1.0)
    ours = task.sample(modules, request, CPU)
    pipe = StableDiffusionXLPipeline.from_pretrained(base)
    pipe.scheduler = task.objective.inference_scheduler("ddim")
    pipe.load_lora_weights(str(out / "unet-lora"))
    assert pipe.text_encoder.peft_config and pipe.text_encoder_2.peft_config

    theirs = draw(pipe, "the red photo", 3, 1.0, eta=0.0)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1 / 255
    pipe.unload_lora_weights()
    pipe.load_lora_weights({k: v for k, v in adapters.items() if k.startswith("unet.")})
    # The text encoders' adapters matter.
    assert (draw(pipe, "the red photo", 3, 1.0, eta=0.0) - ours).abs().max() > 1 / 255
