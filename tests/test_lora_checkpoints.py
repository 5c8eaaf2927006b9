"""Adapter-only LoRA checkpoints (issue 48, deliver 3): what a LoRA run's checkpoint holds, in bytes, for a
real-shaped Stable Diffusion 1.5 UNet built on the meta device (no weights: sizes from shapes and dtypes).

The runs themselves (files hold no base tensor, bit-identical resume after SIGKILL, a changed or missing base
folder, sample/export/verify from such a checkpoint) are in tests/test_pipeline_finetune.py and
tests/test_finetune.py. The figures printed here (`pytest -s`) are the ones in docs/tasks/pipelines.md and
docs/benchmarks.md."""

from __future__ import annotations

import pytest
import torch

from trainer.models.finetune import LoraSettings, apply_lora, saved_keys

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

    from diffusers import UNet2DModel

    from trainer.checkpoint.state import check_fits
    from trainer.errors import CheckpointCorrupt

    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        layers_per_block=1,
    )
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
