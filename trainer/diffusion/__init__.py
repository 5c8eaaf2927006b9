"""The diffusion core: objective x backbone x pixel-or-latent space.

A diffusion model here is three independent choices:

- an **objective** (`objectives.py`, from `prediction_type` and its keys): epsilon, v-prediction,
  rectified flow or EDM. It owns the training draw (timesteps or sigmas) from the per-sample generators,
  the noisy input and preconditioning, the target and loss weight (min-SNR, SD3 weighting, EDM lambda,
  DREAM), the inference scheduler and the sampler loop (`denoise`);
- a **backbone** (`backbones/`, one module per kind, from `model.backbone.*`): unet, dit, pixart or mmdit,
  one call `forward(x, t, cond)` whatever the architecture; its class declares what it takes and offers
  (labels, caption and pooled widths, stage conditioning, export pipeline, FSDP units);
- a **space**: the objective and backbone see tensors (N, C, H, W) and do not know whether they are
  pixels or an autoencoder's latents; the task encodes before training and decodes after sampling
  (`latent.py`: latent diffusion's frozen autoencoder).

`config.py` holds the keys every diffusion model has (`NoiseConfig`), `stages.py` the cascade's stage networks.

Conditioning (class labels, captions, pooled embeddings) reaches the backbone as a mapping; classifier-free
guidance and the class-label helpers are `trainer.conditioning.guidance` (MaskGIT guides with them too),
re-exported here. A task composes the three:

    objective = build_objective(cfg)
    net = build_backbone(cfg.backbone, sample_size, channels, num_classes)
    gens = sample_generators(seed, step, positions, stream)
    noise = per_sample_randn(gens, x0.shape[1:])      # the sample's noise first, then its level
    loss = objective.loss(net, x0, noise, objective.draw(gens, n, device, dtype), cond)
    x = objective.denoise(net, noise, steps, "ddim", Guidance(cond, uncond, scale))
"""

from trainer.conditioning.guidance import (
    Guidance,
    cfg_batch,
    cfg_combine,
    check_num_classes,
    default_labels,
    guide,
    labels_or_null,
)
from trainer.diffusion.backbones import (
    BACKBONES,
    Backbone,
    BackboneConfig,
    DiTBackbone,
    DiTBackboneConfig,
    MMDiTBackbone,
    MMDiTBackboneConfig,
    PixArtBackbone,
    PixArtBackboneConfig,
    UNetBackbone,
    UNetBackboneConfig,
    build_backbone,
    parse_backbone,
)
from trainer.diffusion.objectives import (
    EDM,
    OBJECTIVES,
    SAMPLERS,
    Draw,
    EDMConfig,
    Epsilon,
    NetFn,
    Objective,
    ObjectiveConfig,
    RectifiedFlow,
    VPrediction,
    build_objective,
    edm_loss_weight,
    min_snr_weights,
)

__all__ = [
    "BACKBONES",
    "EDM",
    "OBJECTIVES",
    "SAMPLERS",
    "Backbone",
    "BackboneConfig",
    "DiTBackbone",
    "DiTBackboneConfig",
    "Draw",
    "EDMConfig",
    "Epsilon",
    "Guidance",
    "MMDiTBackbone",
    "MMDiTBackboneConfig",
    "NetFn",
    "Objective",
    "ObjectiveConfig",
    "PixArtBackbone",
    "PixArtBackboneConfig",
    "RectifiedFlow",
    "UNetBackbone",
    "UNetBackboneConfig",
    "VPrediction",
    "build_backbone",
    "build_objective",
    "cfg_batch",
    "cfg_combine",
    "check_num_classes",
    "default_labels",
    "edm_loss_weight",
    "guide",
    "labels_or_null",
    "min_snr_weights",
    "parse_backbone",
]
