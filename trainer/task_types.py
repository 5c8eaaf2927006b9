"""The plain types a task hands across layers (its per-sample loss, a frozen part's source and weights), in a
leaf every layer may import, like `errors.py`: the diffusion core returns a `Loss` and the latent space reads
`FrozenWeights` without importing `tasks/`. `trainer.tasks.base` re-exports them for tasks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Loss:
    """Per-sample loss (N,) for the phase's part, plus named terms to log (per-sample or scalar)."""

    per_sample: torch.Tensor
    terms: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class FrozenSource:
    """A part whose weights come from another run: `url` is a run's checkpoint root or one step dir."""

    url: str
    part: str  # the part's name in that run
    use_ema: bool = True
    # A diffusers class (e.g. "AutoencoderKL") whose save_pretrained folder (config.json +
    # diffusion_pytorch_model.safetensors) `url` may name instead of a run: `FrozenWeights.config` is then
    # the folder's config.json (a dict) and its tensors the folder's, digest-pinned the same way.
    folder_class: str | None = None


def frozen_kind_of(config: Any) -> str | None:
    """What a frozen source run's generator is (`frozen_kind` of its model config class: "kl-autoencoder",
    "image-tokenizer", "video-tokenizer"), from its typed config; None for anything else (a diffusers
    folder's config.json, a run of another task)."""
    return getattr(type(getattr(config, "model_cfg", None)), "frozen_kind", None)


@dataclass
class FrozenWeights:
    """A resolved frozen source: the source run's config, the weights, and where exactly they came from."""

    config: Any  # trainer.config.Config of the source run; a diffusers folder's config.json (a dict)
    tensors: dict[str, torch.Tensor]
    # Where they came from (url, step, file, digest): a trainer.checkpoint.validity.FrozenRecord, saved in this run's
    # checkpoints (typed Any: this leaf imports no layer above it).
    record: Any
