"""Tiny random diffusers pipelines of every family gentrain fine-tunes, built and saved locally (nothing
downloaded): the real pipeline classes' `save_pretrained` around the real model classes at a few channels, with
tokenizers made in the test (tests/test_text_encoders.py). One row per family in `BUILDERS`; a few MB each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_text_encoders import _tokenizer, tiny_clip, tiny_t5

CLIP_L, CLIP_G, T5 = 8, 12, 16  # text widths; the CLIPs' projections are 6 and 10
# SD3 zero-pads CLIP-L and CLIP-G side by side (8 + 12) to T5's width: its T5 is wider, as the real one (4096).
SD3_T5 = 24


def _vae(latent_channels: int = 4, **factors):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=16,
        **factors,  # SD3's and Flux's VAEs shift their latents too (shift_factor); their pipelines read it
    )


def _clip(root: Path, name: str, hidden: int, projection: int, seed: int, with_projection: bool):
    from transformers import AutoTokenizer, CLIPTextModel, CLIPTextModelWithProjection

    folder = tiny_clip(root / "parts" / name, hidden, projection, seed=seed)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.model_max_length = 16  # the tiny CLIP's positions: what the pipelines' encode_prompt pads to
    return cls.from_pretrained(folder), tokenizer


def _t5(root: Path, name: str, width: int, seed: int):
    from transformers import AutoTokenizer, T5EncoderModel

    folder = tiny_t5(root / "parts" / name, width, seed=seed)
    return T5EncoderModel.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def _unet(cross_attention_dim: int, **extra):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=4,
        **extra,
    )


def sd(root: Path) -> Path:
    from diffusers import DDPMScheduler, StableDiffusionPipeline

    text_encoder, tokenizer = _clip(root, "clip_l", CLIP_L, 6, 1, with_projection=False)
    pipe = StableDiffusionPipeline(
        vae=_vae(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=_unet(CLIP_L),
        scheduler=DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(root / "sd")
    return root / "sd"


def sdxl(root: Path) -> Path:
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    text_encoder, tokenizer = _clip(root, "clip_l", CLIP_L, 6, 1, with_projection=False)
    text_encoder_2, tokenizer_2 = _clip(root, "clip_g", CLIP_G, 10, 2, with_projection=True)
    unet = _unet(
        CLIP_L + CLIP_G,
        addition_embed_type="text_time",
        addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=10 + 6 * 4,  # CLIP-G's pooled projection + six size values
    )
    pipe = StableDiffusionXLPipeline(
        vae=_vae(),
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=unet,
        scheduler=EulerDiscreteScheduler(prediction_type="epsilon"),
    )
    pipe.save_pretrained(root / "sdxl")
    return root / "sdxl"


def sd3(root: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    text_encoder, tokenizer = _clip(root, "clip_l", CLIP_L, 6, 1, with_projection=True)
    text_encoder_2, tokenizer_2 = _clip(root, "clip_g", CLIP_G, 10, 2, with_projection=True)
    text_encoder_3, tokenizer_3 = _t5(root, "t5_sd3", SD3_T5, 3)
    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=SD3_T5,
        caption_projection_dim=16,
        pooled_projection_dim=6 + 10,
        pos_embed_max_size=16,
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3,
        tokenizer_3=tokenizer_3,
    )
    pipe.save_pretrained(root / "sd3")
    return root / "sd3"


def flux(root: Path, dev: bool = True) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    text_encoder, tokenizer = _clip(root, "clip_l", CLIP_L, 6, 1, with_projection=False)
    text_encoder_2, tokenizer_2 = _t5(root, "t5", T5, 3)
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels packed 2 x 2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=T5,
        pooled_projection_dim=CLIP_L,
        guidance_embeds=dev,
        axes_dims_rope=(4, 2, 2),
    )
    scheduler = (
        FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
        if dev
        else FlowMatchEulerDiscreteScheduler(shift=1.0)
    )
    pipe = FluxPipeline(
        scheduler=scheduler,
        vae=_vae(scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    name = "flux-dev" if dev else "flux-schnell"
    pipe.save_pretrained(root / name)
    return root / name


def pixart_sigma(root: Path) -> Path:
    from diffusers import DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    text_encoder, tokenizer = _t5(root, "t5", T5, 3)
    torch.manual_seed(0)
    transformer = PixArtTransformer2DModel(
        sample_size=8,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        caption_channels=T5,
        in_channels=4,
        out_channels=8,
        cross_attention_dim=16,
        norm_type="ada_norm_single",
        use_additional_conditions=False,
    )
    pipe = PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=_vae(),
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    )
    pipe.save_pretrained(root / "pixart-sigma")
    return root / "pixart-sigma"


def captioned_images(folder: Path, n: int) -> Path:
    """`n` random 16x16 RGB images in `folder`, a caption of three known words in a .txt beside each."""
    import numpy as np
    from PIL import Image
    from test_text_encoders import WORDS

    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(" ".join(WORDS[i : i + 3]))
    return folder


def pipeline_config(preset: str, folder: Path, tmp_path: Path, *overrides: str):
    """The config `gentrain train PRESET model.pretrained=FOLDER` reads (keys filled from the folder), with no
    data read: what the tests of each family's config expansion load."""
    from trainer.registry import load_config

    keys = [
        f"model.pretrained={folder}",
        "data.path=/unused",
        "data.image_size=16",
        "data.buckets=null",  # the presets' buckets (auto, step 64) hold no 16 px bucket: square crops
        f"model.text.cache_dir={tmp_path}/t",
    ]
    return load_config(preset, [*keys, *overrides], {})


def train_args(preset: str, folder, images, root, *extra: str, max_steps: int = 2) -> list[str]:
    """The arguments after `gentrain train` for PRESET on a tiny pipeline folder and captioned images: 16 px,
    batch 2, lr 1e-2, no validation, a checkpoint every 2 steps, no previews, the run in ROOT and its caption
    cache beside it (ROOT-text). `extra` comes last: in gentrain a later key=value wins, so it holds each test's
    own keys and any of these it sets otherwise."""
    return [
        preset,
        f"model.pretrained={folder}",
        f"data.path={images}",
        "data.image_size=16",
        "data.val_fraction=0",
        f"train.max_steps={max_steps}",
        "train.batch_size=2",
        "train.lr=1e-2",
        "train.num_workers=0",
        "train.val_every_steps=0",
        "checkpoint.every_steps=2",
        "sample.every_steps=0",
        f"run.dir={root}",
        f"model.text.cache_dir={root}-text",
        *extra,
    ]


def draw(pipe, prompt: str, steps: int, scale: float, **kwargs) -> torch.Tensor:
    """What diffusers' `pipe` draws for `prompt` x 2 at 16 x 16 px, `steps` steps, guidance `scale`, seed 7, as
    a tensor (output_type="pt"): the images the tests compare with gentrain's samples of the same request.
    `kwargs` are the family's own (eta, max_sequence_length, true_cfg_scale, ...)."""
    return pipe(
        [prompt] * 2,
        height=16,
        width=16,
        num_inference_steps=steps,
        guidance_scale=scale,
        generator=torch.Generator().manual_seed(7),
        output_type="pt",
        **kwargs,
    ).images


BUILDERS = {"sd": sd, "sdxl": sdxl, "sd3": sd3, "flux": flux, "pixart-sigma": pixart_sigma}


def folder_fixture(family: str):
    """A module-scoped fixture of the tiny `family` pipeline folder, built once per test module: `sd =
    folder_fixture("sd")` in a test module (pytest names the fixture after the variable)."""

    @pytest.fixture(scope="module")
    def folder(tmp_path_factory):
        return BUILDERS[family](tmp_path_factory.mktemp(f"pipelines-{family}"))

    return folder


__all__ = ["BUILDERS", "_tokenizer", "captioned_images", "draw", "folder_fixture", "pipeline_config", "train_args"]
