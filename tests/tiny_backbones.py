"""The suite's one table of tiny backbone configs, one entry per kind of the backbone registry
(trainer.diffusion.backbones.BACKBONES). A new backbone kind adds its entry here: until it does,
tests/test_backbones.py fails naming the kind. Tests that train a backbone take its entry with their own
changes (more layers, dropout, the caption width of the shipped sentence encoder) instead of spelling out a
config of their own."""

from __future__ import annotations

import math

import yaml

from trainer.diffusion.backbones import BACKBONES

# Each kind's smallest config: the keys its schema requires, a tiny shape (8-wide heads, one or two blocks).
TINY: dict[str, dict] = {
    "unet": {"block_out_channels": [8, 16], "norm_num_groups": 4},
    "dit": {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 8},
    "pixart": {"num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 8, "caption_channels": 16},
    "mmdit": {
        "num_layers": 2,  # SD3's last block reads the caption stream only: its LoRA targets need one more
        "num_attention_heads": 2,
        "attention_head_dim": 8,
        "caption_channels": 16,
        "pooled_channels": 12,
    },
    "flux": {
        "num_layers": 1,
        "num_single_layers": 1,
        "num_attention_heads": 2,
        "attention_head_dim": 16,
        "caption_channels": 16,
        "pooled_channels": 12,
        "guidance_embeds": True,
    },
}

# The width of the sentence encoder the suite's captioned runs read (`model.text`, the shipped 384-wide one):
# a backbone that takes its captions has caption (and pooled) channels this wide.
TEXT_WIDTH = 384


def missing_kinds() -> list[str]:
    """The registered kinds without a TINY entry."""
    return [kind for kind in BACKBONES if kind not in TINY]


def tiny_backbone(kind: str, text: bool = False, **changes) -> dict:
    """`kind`'s tiny config (`kind` included) with `changes`; `text`: its caption and pooled widths those of the
    shipped sentence encoder (TEXT_WIDTH)."""
    assert kind in BACKBONES, f"{kind!r} is not a registered backbone kind ({', '.join(BACKBONES)})"
    assert kind in TINY, f"backbone kind {kind!r} has no entry in tests/tiny_backbones.py TINY: add its smallest config"
    spec = {"kind": kind, **TINY[kind]}
    if text:
        spec.update({key: TEXT_WIDTH for key in ("caption_channels", "pooled_channels") if key in spec})
    return {**spec, **changes}


def backbone_override(kind: str, text: bool = False, **changes) -> str:
    """The `model.backbone=...` override of `tiny_backbone(kind, text, **changes)` (YAML flow style)."""
    spec = tiny_backbone(kind, text, **changes)
    return "model.backbone=" + yaml.safe_dump(spec, default_flow_style=True, sort_keys=False, width=math.inf).strip()


def tiny_unet2d(attention: bool = False, seed: int = 0):
    """The `unet` kind's tiny shape as a diffusers UNet2DModel built in the test (1 channel, 8 px, one layer per
    block; `attention`: the inner blocks with attention), its weights drawn from `seed`."""
    import torch
    from diffusers import UNet2DModel

    torch.manual_seed(seed)
    inner = ("AttnDownBlock2D", "AttnUpBlock2D") if attention else ("DownBlock2D", "UpBlock2D")
    return UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        block_out_channels=tuple(TINY["unet"]["block_out_channels"]),
        norm_num_groups=TINY["unet"]["norm_num_groups"],
        layers_per_block=1,
        down_block_types=("DownBlock2D", inner[0]),
        up_block_types=(inner[1], "UpBlock2D"),
    )
