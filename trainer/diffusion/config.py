"""The keys every diffusion model of gentrain has: its UNet's shape (the one UNet schema, `UNetShape`), its
objective (`ObjectiveConfig`) and where its weights start (`pretrained`, `lora`). The ddpm task's `model.*`
and each cascade stage's `model.stages[i]` extend it."""

from __future__ import annotations

from trainer.diffusion.backbones.unet import UNetShape
from trainer.diffusion.objectives import ObjectiveConfig
from trainer.models.finetune import FinetuneFields


class NoiseConfig(UNetShape, FinetuneFields, ObjectiveConfig):
    """The UNet, its objective (the core's `ObjectiveConfig`: epsilon, v_prediction, flow or edm and their
    keys) and where its weights start (`pretrained`, `lora`); shared by DDPM and every cascade stage."""
