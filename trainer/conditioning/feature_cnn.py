"""The feature CNN (`gentrain-cnn`): a small convolutional net whose penultimate layer gives image features,
and the trained digits net gentrain ships (`digits_features.safetensors` + `.json` beside this file).

Two readers use it: FID/KID (`eval.features=digits`, or a user's own net of this architecture:
`trainer.eval.features`) and the frozen image encoder of DALL-E 2-style decoders
(`trainer.conditioning.image`). It lives here, below both, so that conditioning (which the tasks use) does
not import evaluation (which samples through the tasks). The shipped net is trained by
`python -m trainer.eval.train_digits_features`.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.errors import ConfigError

ARCHITECTURE = "gentrain-cnn"


class CNNFeatures(nn.Module):
    """A small CNN whose penultimate layer gives the features; images in [0, 1], any size and channel count.

    Inputs are converted to the net's channels (mean or repeat), resized to
    `input_size` (bilinear, antialiased) and scaled to [-1, 1]; a classifier
    head is used only while training the net.
    """

    def __init__(self, channels: int, input_size: int, widths: list[int], feature_dim: int, num_classes: int = 0):
        super().__init__()
        self.channels, self.input_size = channels, input_size
        layers: list[nn.Module] = []
        c = channels
        for w in widths:
            layers += [nn.Conv2d(c, w, 3, padding=1), nn.SiLU(), nn.Conv2d(w, w, 3, stride=2, padding=1), nn.SiLU()]
            c = w
        self.body = nn.Sequential(*layers)
        self.proj = nn.Linear(c, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes) if num_classes else None
        self.num_features = feature_dim  # read by torchmetrics instead of probing with a dummy image

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if x.shape[1] != self.channels:
            x = x.mean(1, keepdim=True) if self.channels == 1 else x.expand(-1, self.channels, -1, -1)
        if x.shape[-1] != self.input_size or x.shape[-2] != self.input_size:
            x = F.interpolate(x, size=(self.input_size, self.input_size), mode="bilinear", antialias=True)
        return x * 2 - 1

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.body(self.prepare(x)).mean(dim=(2, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).double()


def build_cnn(desc: dict[str, Any], tensors: dict[str, torch.Tensor]) -> CNNFeatures:
    if desc.get("architecture") != ARCHITECTURE:
        raise ConfigError(
            f"eval.features: architecture {desc.get('architecture')!r} is unknown; the JSON must say "
            f"architecture: {ARCHITECTURE!r} with channels, input_size, widths, feature_dim"
        )
    net = CNNFeatures(
        desc["channels"], desc["input_size"], list(desc["widths"]), desc["feature_dim"], desc.get("num_classes", 0)
    )
    net.load_state_dict(tensors, strict=False)
    missing = [k for k in net.state_dict() if not k.startswith("head.") and k not in tensors]
    if missing:
        raise ConfigError(f"eval.features: the weights lack {missing[:3]}")
    return net.eval().requires_grad_(False)


def shipped_digits() -> tuple[dict, dict[str, torch.Tensor], bytes]:
    from safetensors.torch import load

    pkg = resources.files("trainer.conditioning")
    raw = pkg.joinpath("digits_features.safetensors").read_bytes()
    return json.loads(pkg.joinpath("digits_features.json").read_text()), load(raw), raw
