"""The keys every diffusion model of gentrain has: its UNet's shape (the one UNet schema, `UNetShape`), its
objective (`ObjectiveConfig`) and where its weights start (`pretrained`, `lora`). The ddpm task's `model.*`
and each cascade stage's `model.stages[i]` extend it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from trainer.diffusion.backbones.unet import UNetShape
from trainer.diffusion.objectives import ObjectiveConfig
from trainer.models.finetune import FinetuneFields
from trainer.task_types import FrozenSource


class NoiseConfig(UNetShape, FinetuneFields, ObjectiveConfig):
    """The UNet, its objective (the core's `ObjectiveConfig`: epsilon, v_prediction, flow or edm and their
    keys) and where its weights start (`pretrained`, `lora`); shared by DDPM and every cascade stage."""


# ---------------------------------------------------------------- latent diffusion: the frozen autoencoder
# Its keys and the frozen part they name live here, apart from the latent space (latent.py), whose autoencoder
# classes import diffusers' loaders (peft, scipy): a pixel-space run reads these and never imports those.

PART = "autoencoder"


class LatentAutoencoderConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        description="a gentrain autoencoder run (checkpoint root or step dir) or a diffusers AutoencoderKL folder "
        "(config.json + diffusion_pytorch_model.safetensors), on any fsspec store"
    )
    use_ema: bool = Field(True, description="a gentrain run's EMA weights (false: its online weights)")
    sample_posterior: bool = Field(
        True, description="train on a posterior sample mean + std * eps (counter-based eps); false: the posterior mean"
    )
    # Expected geometry; null = whatever the autoencoder has. Set them to have a mismatch refused.
    latent_channels: int | None = Field(None, ge=1, description="expected latent channels; null = the autoencoder's")
    latent_size: int | None = Field(
        None, ge=1, description="expected latent side; null = data.image_size / downsampling"
    )
    cache: str | None = Field(
        None, description="local folder caching each image's posterior (keyed by autoencoder digest and image bytes)"
    )


def frozen_source(c: LatentAutoencoderConfig) -> FrozenSource:
    return FrozenSource(c.url, part="generator", use_ema=c.use_ema, folder_class="AutoencoderKL")
