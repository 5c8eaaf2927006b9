"""The registry of backbones: one literal list of the `Backbone` classes, each the `BACKBONE` of its own
module of this package, so adding a backbone is adding one module and one line here (see
docs/architecture.md, "Adding a backbone"). A list rather than a scan of the package: what a run can build
is read here, and a stray module cannot register itself.

`BACKBONES` maps each kind to its class, listed by the classes' `order`; `BackboneConfig` is the union of
their `Config` schemas discriminated by `kind` (`model.backbone.*`), and `backbone_configs` the union of
the kinds that satisfy a condition (a cascade stage's: those with `stage_conditioning`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, Union

from pydantic import BaseModel, Field, TypeAdapter

from trainer.diffusion.backbones.base import Backbone, TransformerConfig
from trainer.diffusion.backbones.dit import DiTBackbone, DiTBackboneConfig
from trainer.diffusion.backbones.flux import FluxBackbone, FluxBackboneConfig
from trainer.diffusion.backbones.mmdit import MMDiTBackbone, MMDiTBackboneConfig
from trainer.diffusion.backbones.pixart import PixArtBackbone, PixArtBackboneConfig
from trainer.diffusion.backbones.unet import (
    UNetBackbone,
    UNetBackboneConfig,
    UNetShape,
    architecture_hints,
    changed_unet_keys,
    unet_block_types,
)

_REGISTERED: tuple[type[Backbone], ...] = (UNetBackbone, DiTBackbone, PixArtBackbone, MMDiTBackbone, FluxBackbone)

BACKBONES: dict[str, type[Backbone]] = {
    cls.kind: cls for cls in sorted(_REGISTERED, key=lambda cls: (cls.order, cls.kind))
}


def backbone_configs(which: Callable[[type[Backbone]], Any] = lambda cls: True) -> Any:
    """The config union (discriminated by `kind`) of the registered backbones for which `which` holds."""
    configs = tuple(cls.Config for cls in BACKBONES.values() if which(cls))
    return Annotated[Union[configs], Field(discriminator="kind")]  # noqa: UP007 (a union built from a tuple)


def kinds(which: Callable[[type[Backbone]], Any] = lambda cls: True) -> list[str]:
    """The registered kinds for which `which` holds, in their order."""
    return [kind for kind, cls in BACKBONES.items() if which(cls)]


BackboneConfig = backbone_configs()
_BACKBONE_CONFIG: TypeAdapter = TypeAdapter(BackboneConfig)


def parse_backbone(value: Mapping | BaseModel) -> BaseModel:
    """A `model.backbone` mapping (or config) as its kind's config."""
    return _BACKBONE_CONFIG.validate_python(value)


def backbone_class(c: BaseModel) -> type[Backbone]:
    """The class of a backbone config's kind."""
    return BACKBONES[c.kind]


def build_backbone(
    cfg: Mapping | BaseModel,
    sample_size: int,
    channels: int,
    num_classes: int | None = None,
    in_channels: int | None = None,
) -> Backbone:
    """The backbone `cfg.kind` names, for inputs of `channels` x `sample_size`^2 (pixels or latents),
    class-conditional on `num_classes` classes when set (and when the kind takes labels). `in_channels`:
    inputs wider than the output (a super-resolution stage's image and its low-resolution condition)."""
    c = parse_backbone(cfg)
    return BACKBONES[c.kind].build(c, sample_size, channels, num_classes, in_channels)


__all__ = [
    "BACKBONES",
    "Backbone",
    "BackboneConfig",
    "DiTBackbone",
    "DiTBackboneConfig",
    "FluxBackbone",
    "FluxBackboneConfig",
    "MMDiTBackbone",
    "MMDiTBackboneConfig",
    "PixArtBackbone",
    "PixArtBackboneConfig",
    "TransformerConfig",
    "UNetBackbone",
    "UNetBackboneConfig",
    "UNetShape",
    "architecture_hints",
    "backbone_class",
    "backbone_configs",
    "build_backbone",
    "changed_unet_keys",
    "kinds",
    "parse_backbone",
    "unet_block_types",
]
