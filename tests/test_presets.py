"""Every preset loads; the GPU-sized latent transformer presets (dit-xl-256, mmdit-512) are validated offline:
their configs check out and their backbones, built on the meta device, have the published architectures'
parameter counts (less what gentrain leaves out, counted exactly)."""

from __future__ import annotations

import pytest
import torch
from diffusers import DiTTransformer2DModel, SD3Transformer2DModel

from trainer.config.load import load_base, preset_names
from trainer.diffusion.backbones import build_backbone
from trainer.registry import load_config


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# What a user must add to presets of their own data (the keys their first comment line names).
USER_DATA = {"folder": ["data.path=/data/images"], "shards": ["data.urls=s3://bucket/set/shards.json"]}


def _load(name: str):
    return load_config(name, USER_DATA.get(load_base(name)["data"]["source"], []), environ={})


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


def test_mmdit_512_is_sd3_medium_with_gentrains_caption_widths():
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
    width, text = 1536, cfg.model_cfg.text.width
    # Only the two projections from the text encoder's widths differ (positions are a buffer, not parameters).
    narrower = (4096 - text) * width + (2048 - text) * width
    print(f"mmdit-512: {ours:,} parameters (SD3-medium's transformer: {_params(reference):,})")
    assert ours == _params(reference) - narrower
    assert cfg.train.parallel == "fsdp" and cfg.model_cfg.backbone.caption_channels == text
