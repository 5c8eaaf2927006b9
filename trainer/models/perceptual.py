"""Perceptual loss from VGG16 features whose weights the user provides (never downloaded).

LPIPS (Zhang et al. 2018) compares unit-normalized VGG activations; its
libraries fetch the VGG16 backbone through torchvision at run time, which is
neither installable next to the CPU torch wheel nor allowed offline. The
backbone is small and fixed, so it is rebuilt here with torchvision's layer
indices: a `vgg16` state dict's `features.*` tensors, saved as safetensors,
load as they are. Without LPIPS' learned linear heads every channel weighs
the same (the "baseline" variant of the LPIPS paper).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec
import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load as load_safetensors
from torch import nn

from trainer.errors import ConfigError

# torchvision's vgg16 "D" configuration; "M" is a 2x2 max pool.
_VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512]
# Indices (in `features`) of the ReLUs after conv1_2, conv2_2, conv3_3, conv4_3, conv5_3.
_TAPS = (3, 8, 15, 22, 29)
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)


class PerceptualConfig(BaseModel):
    """`model.perceptual.*` of a tokenizer: where the VGG16 weights are, and the loss's weight."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="VGG16 feature weights (torchvision `features.*` keys) as safetensors; path or URL")
    weight: float = Field(1.0, ge=0)


def vgg16_features() -> nn.Sequential:
    layers: list[nn.Module] = []
    c = 3
    for v in _VGG16:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU(inplace=False)]
            c = int(v)
    return nn.Sequential(*layers)


class VGGPerceptual(nn.Module):
    """Per-sample perceptual distance between images in [-1, 1] (N,), frozen, gradients flow to the inputs."""

    def __init__(self, features: nn.Sequential):
        super().__init__()
        self.features = features
        self.register_buffer("mean", torch.tensor(_MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(_STD).view(1, 3, 1, 1))
        self.requires_grad_(False)
        self.eval()

    @classmethod
    def from_url(cls, url: str, storage_options: Mapping[str, Any] | None = None) -> VGGPerceptual:
        try:
            with fsspec.open(url, "rb", **dict(storage_options or {})) as f:
                raw = f.read()
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"model.perceptual.url={url!r}: cannot read the VGG16 weights ({e}). gentrain never downloads "
                "weights: save torchvision's vgg16 `features.*` tensors as safetensors and point the key at that "
                "file, or remove model.perceptual."
            ) from None
        try:
            tensors = load_safetensors(raw)
        except Exception as e:  # safetensors raises its own error types for malformed files
            raise ConfigError(f"model.perceptual.url={url!r} is not a safetensors file: {e}") from None
        state = {k.removeprefix("features."): v for k, v in tensors.items() if not k.startswith("classifier.")}
        features = vgg16_features()
        missing, unexpected = features.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(
                f"model.perceptual.url={url!r}: not VGG16 feature weights (missing {missing[:4]}, "
                f"unexpected {unexpected[:4]})"
            )
        return cls(features)

    def _taps(self, x: torch.Tensor) -> list[torch.Tensor]:
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        x = ((x + 1) / 2 - self.mean) / self.std
        out = []
        for i, layer in enumerate(self.features):
            if isinstance(layer, nn.MaxPool2d) and min(x.shape[-2:]) < 2:
                break  # small images (digits at 8-16 px) run out of resolution before conv5_3
            x = layer(x)
            if i in _TAPS:
                out.append(x / (x.norm(dim=1, keepdim=True) + 1e-10))
            if i >= _TAPS[-1]:
                break
        return out

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        dist = a.new_zeros(a.shape[0])
        for fa, fb in zip(self._taps(a), self._taps(b), strict=True):
            dist = dist + (fa - fb).pow(2).sum(dim=1).mean(dim=(1, 2))
        return dist
