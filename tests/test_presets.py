"""Every preset loads; the GPU-sized latent transformer presets (dit-xl-256, mmdit-512, pixart-512) are validated
offline: their configs check out, their backbones, built on the meta device, have the published architectures'
parameter counts (less what gentrain leaves out, counted exactly), and the text encoders they name, at their
published sizes, give the widths the backbones read."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiTTransformer2DModel, PixArtTransformer2DModel, SD3Transformer2DModel

from trainer.conditioning.text_models import encoder_widths
from trainer.config.load import load_base, preset_names
from trainer.diffusion.backbones import build_backbone
from trainer.registry import load_config


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# What a user must add to presets of their own data (the keys their first comment line names).
USER_DATA = {"folder": ["data.path=/data/images"], "shards": ["data.urls=s3://bucket/set/shards.json"]}


# Presets that start from a released pipeline: a folder that is not one (no model_index.json) leaves the model
# keys as the preset sets them (tests/test_pipeline_finetune.py loads them with a real one).
USER_MODEL = {
    "sd15-lora": ["model.pretrained=/models/stable-diffusion-v1-5"],
    "sdxl-lora": ["model.pretrained=/models/stable-diffusion-xl-base-1.0"],
    "sd3-lora": ["model.pretrained=/models/stable-diffusion-3-medium-diffusers"],
    "pixart-sigma-lora": ["model.pretrained=/models/PixArt-Sigma-XL-2-1024-MS"],
    "flux-lora": ["model.pretrained=/models/FLUX.1-dev"],
    "sd15-dreambooth": [
        "model.pretrained=/models/stable-diffusion-v1-5",
        "data.instance=/data/images",  # the folder USER_DATA names
        "data.instance_prompt=a photo of sks dog",
        "data.class_images=/data/dogs",
        "data.class_prompt=a photo of dog",
    ],
}


def _load(name: str):
    extra = USER_DATA.get(load_base(name)["data"]["source"], []) + USER_MODEL.get(name, [])
    return load_config(name, extra, environ={})


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads(name):
    assert _load(name).name == name


def _latent_backbone(name: str):
    cfg = _load(name)
    m = cfg.model_cfg
    assert m.autoencoder is not None, f"{name} is a latent preset"
    assert m.autoencoder.latent_size * 8 == cfg.data.image_size, "the VAEs named downsample by 8"
    with torch.device("meta"):
        return cfg, build_backbone(m.backbone, m.autoencoder.latent_size, m.autoencoder.latent_channels, m.num_classes)


def test_dit_xl_256_is_dit_xl_2_without_learned_sigma():
    cfg, backbone = _latent_backbone("dit-xl-256")
    ours = _params(backbone.model)
    # facebook/DiT-XL-2-256's transformer config: the same network, predicting a variance too (8 output channels).
    with torch.device("meta"):
        reference = DiTTransformer2DModel(
            num_attention_heads=16,
            attention_head_dim=72,
            in_channels=4,
            out_channels=8,
            num_layers=28,
            sample_size=32,
            patch_size=2,
            num_embeds_ada_norm=1000,
        )
    width, patch = 16 * 72, 2
    variance_head = width * patch * patch * 4 + patch * patch * 4  # the final projection's 4 extra channels
    print(f"dit-xl-256: {ours:,} parameters (DiT-XL/2 with learned sigma: {_params(reference):,})")
    assert ours == _params(reference) - variance_head
    # The paper's 675M shares one timestep and class embedder; diffusers' layout repeats them in each of the 28
    # blocks (about 2.8M each), as its converted DiT-XL-2-256 weights do.
    assert 745e6 < ours < 755e6
    assert cfg.model_cfg.num_classes == 1000 and cfg.train.precision == "bf16"


def test_mmdit_512_is_sd3_medium_reading_sd3s_text_encoders():
    cfg, backbone = _latent_backbone("mmdit-512")
    ours = _params(backbone.model)
    # stabilityai/stable-diffusion-3-medium's transformer config (T5 4096-wide tokens, CLIP 2048-wide pooled).
    with torch.device("meta"):
        reference = SD3Transformer2DModel(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=24,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=192,
        )
    # The same network: positions (a smaller grid here) are a buffer, not parameters.
    print(f"mmdit-512: {ours:,} parameters (SD3-medium's transformer: {_params(reference):,})")
    assert ours == _params(reference)
    text = cfg.model_cfg.text
    assert cfg.train.parallel == "fsdp" and text.kind == "sd3" and text.tokens == 77 + 77
    assert (cfg.model_cfg.backbone.caption_channels, cfg.model_cfg.backbone.pooled_channels) == (4096, 2048)
    # SD3's three encoders at their published sizes, on the meta device: the widths they give are the ones the
    # backbone reads, and the folders named are an SD3 diffusers folder's.
    configs = [CLIP_L, CLIP_G, T5_XXL]
    assert encoder_widths("sd3", configs) == (text.width, text.pooled_dim) == (4096, 2048)
    assert [role for role, _ in text.folders()][::2] == ["encoder", "encoder_2", "encoder_3"]
    assert [src.split("/")[-1] for _, src in text.folders()] == [
        "text_encoder",
        "tokenizer",
        "text_encoder_2",
        "tokenizer_2",
        "text_encoder_3",
        "tokenizer_3",
    ]


def test_pixart_512_is_pixart_xl_2_512_without_learned_sigma_reading_t5_xxl():
    cfg, backbone = _latent_backbone("pixart-512")
    ours = _params(backbone.model)
    # PixArt-alpha/PixArt-XL-2-512x512's transformer config: the same network, predicting a variance too.
    with torch.device("meta"):
        reference = PixArtTransformer2DModel(
            num_attention_heads=16,
            attention_head_dim=72,
            in_channels=4,
            out_channels=8,
            num_layers=28,
            cross_attention_dim=1152,
            sample_size=64,
            patch_size=2,
            caption_channels=4096,
            use_additional_conditions=False,
        )
    width, patch = 16 * 72, 2
    variance_head = width * patch * patch * 4 + patch * patch * 4
    print(f"pixart-512: {ours:,} parameters (PixArt-XL-2-512 with learned sigma: {_params(reference):,})")
    assert ours == _params(reference) - variance_head and 600e6 < ours < 620e6
    text = cfg.model_cfg.text
    assert text.kind == "t5" and text.max_tokens == 120  # diffusers' PixArt-alpha max_sequence_length
    assert encoder_widths("t5", [T5_XXL]) == (text.width, text.pooled_dim) == (4096, 4096)
    assert cfg.model_cfg.backbone.caption_channels == text.width


def test_the_published_text_encoders_built_on_the_meta_device_have_their_sizes():
    """The configs the preset tests check widths against are the published encoders (parameter counts)."""
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    with torch.device("meta"):
        t5 = _params(T5EncoderModel(T5_XXL))
        clip_l = _params(CLIPTextModelWithProjection(CLIP_L))
        clip_g = _params(CLIPTextModelWithProjection(CLIP_G))
    print(f"T5-XXL encoder {t5:,}, CLIP-L {clip_l:,}, CLIP-G {clip_g:,}")
    assert 4.7e9 < t5 < 4.8e9 and 123e6 < clip_l < 125e6 and 690e6 < clip_g < 700e6


def _published_text_configs():
    from transformers import CLIPTextConfig, T5Config

    # google/t5-v1_1-xxl (SD3's text_encoder_3, PixArt's text_encoder), openai/clip-vit-large-patch14 (SD3's
    # text_encoder), laion/CLIP-ViT-bigG-14 (SD3's text_encoder_2): their config.json values.
    t5 = T5Config(
        vocab_size=32128,
        d_model=4096,
        d_kv=64,
        d_ff=10240,
        num_layers=24,
        num_heads=64,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
    )
    clip_l = CLIPTextConfig(
        vocab_size=49408,
        hidden_size=768,
        intermediate_size=3072,
        projection_dim=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
    )
    clip_g = CLIPTextConfig(
        vocab_size=49408,
        hidden_size=1280,
        intermediate_size=5120,
        projection_dim=1280,
        num_hidden_layers=32,
        num_attention_heads=20,
        max_position_embeddings=77,
        hidden_act="gelu",
    )
    return t5, clip_l, clip_g


T5_XXL, CLIP_L, CLIP_G = _published_text_configs()
