"""DDPM task (`task: ddpm`): one denoiser trained on the diffusion core (trainer/diffusion).

The objective (`model.prediction_type`: epsilon, v_prediction, flow or edm, with their keys) and the
backbone (`model.backbone.kind`: unet, dit, pixart or mmdit; the UNet's shape also at `model.*`, as before
the backbone section existed) come from the core; this task adds the conditions: the data's class labels
(`model.num_classes`) and captions embedded by the frozen shared text encoder (`model.text`: caption tokens
for pixart, mmdit or a unet with `caption_channels`, the pooled embedding for mmdit), one dropout draw per
sample dropping them together for classifier-free guidance, and its sampling interface.

Latent diffusion (`model.autoencoder`, see trainer/diffusion/latent.py): the denoiser works on the latents of a
frozen, digest-pinned KL autoencoder (a gentrain autoencoder run or a diffusers AutoencoderKL folder): images
are encoded on the fly (or read from the latent cache) and scaled, the backbone is built for the latent
channels and side, and samples are decoded through the autoencoder.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, Field, model_validator
from torch import nn

from trainer.conditioning.text import TextEmbeddings, TextEncoder, TextEncoderConfig
from trainer.diffusion import (
    Backbone,
    BackboneConfig,
    Guidance,
    UNetBackboneConfig,
    build_backbone,
    build_objective,
    check_num_classes,
    default_labels,
    labels_or_null,
)
from trainer.diffusion.backbones import backbone_class, changed_unet_keys, kinds
from trainer.diffusion.backbones.unet import UNET_SHAPE_KEYS
from trainer.diffusion.config import PART as AUTOENCODER
from trainer.diffusion.config import LatentAutoencoderConfig, NoiseConfig, frozen_source
from trainer.errors import ConfigError
from trainer.models.export import DIT_PIPELINE_NULL_CLASS, dit_for_pipeline
from trainer.models.finetune import InputRecord, attach_text_lora, prepare_unet
from trainer.models.pipelines import expand_ddpm_model, inspect_pipeline, is_pipeline_folder, pipeline_for_text
from trainer.randomness import sample_draws
from trainer.tasks.base import Batch, Export, FrozenSource, Loss, Phase, PreviewContext, StepInfo, Task, TaskContext
from trainer.tasks.sampling import SampleRequest

if TYPE_CHECKING:
    from trainer.diffusion.latent import LatentSpace

log = logging.getLogger(__name__)


class DiffusionModelConfig(NoiseConfig):
    num_classes: int | None = Field(None, ge=2, description="class-conditional when set")
    cond_drop_prob: float = Field(0.1, ge=0, lt=1, description="label (and caption) dropout for CFG")
    text: TextEncoderConfig | None = Field(
        None, description="caption conditioning (pixart, mmdit, or a unet with caption_channels); null = none"
    )
    backbone: BackboneConfig | None = Field(
        None,
        description=f"the denoiser (kind: {' | '.join(kinds())}) and its shape; null = the UNet of "
        "model.block_out_channels etc., which a backbone set here overrides",
    )
    autoencoder: LatentAutoencoderConfig | None = Field(
        None, description="latent diffusion: the frozen autoencoder whose latents the denoiser learns; null = pixels"
    )
    prior_loss_weight: float = Field(
        1.0, ge=0, description="DreamBooth (data.class_images): the class images' loss weight, diffusers' default"
    )

    @model_validator(mode="after")
    def _captions_need_text(self) -> DiffusionModelConfig:
        d = self.denoiser
        kind = backbone_class(d)
        width = kind.caption_width(d)
        what = f"model.backbone.kind={d.kind}" + (" with caption_channels" if kind.captions() == "optional" else "")
        if width is not None and self.text is None:
            raise ValueError(
                f"{what} is conditioned on captions: set model.text (model.text={{}} is the shipped "
                "all-MiniLM-L6-v2 encoder, 384 wide) and give the data captions"
            )
        if width is None and self.text is not None:
            readers = " or ".join(kinds(lambda cls: cls.captions() == "always"))
            raise ValueError(
                f"model.text: this denoiser cannot read captions; use model.backbone.kind {readers}, or a "
                "unet with model.backbone.caption_channels, or remove model.text"
            )
        if width is not None and width != self.text.width:
            raise ValueError(
                f"model.backbone.caption_channels={width} but model.text.width={self.text.width}: the caption "
                "token embeddings are the text encoder's width"
            )
        pooled = kind.pooled_width(d)
        if pooled is not None and pooled != self.text.pooled_dim:
            key = "model.text.width" if self.text.pooled_width is None else "model.text.pooled_width"
            raise ValueError(
                f"model.backbone.pooled_channels={pooled} but {key}={self.text.pooled_dim}: the pooled caption "
                "embedding is the text encoder's (model.text.pooled_width, null = model.text.width)"
            )
        if not kind.takes_labels and self.num_classes is not None:
            raise ValueError(
                f"model.backbone.kind={d.kind} is conditioned on captions, not class labels: unset model.num_classes"
            )
        return self

    @property
    def ignored_shape_keys(self) -> list[str]:
        """UNet keys set at `model.*` that `model.backbone` overrides (a preset's, under a backbone override)."""
        return changed_unet_keys(self) if self.backbone is not None else []

    @property
    def denoiser(self) -> BaseModel:
        """The backbone config: `model.backbone`, else a unet of the shape keys at `model.*`."""
        if self.backbone is not None:
            return self.backbone
        return UNetBackboneConfig(**{k: getattr(self, k) for k in UNET_SHAPE_KEYS})

    @property
    def denoiser_class(self) -> type[Backbone]:
        """The denoiser's backbone class: what its kind takes and offers."""
        return backbone_class(self.denoiser)


def _backbone_hints(c: DiffusionModelConfig) -> dict[str, str]:
    """Hints for the configured denoiser: its diffusers config fields -> the keys that set them (the UNet's at
    `model.*` when `model.backbone` is not set)."""
    return c.denoiser_class.config_hints("model.backbone" if c.backbone is not None else "model")


def part_name(c: DiffusionModelConfig) -> str:
    """The trainable part: `unet` (as before the backbone section, so checkpoints and optim.unet keep their
    names) or `transformer`, as the backbone declares."""
    return c.denoiser_class.part


class DDPMTask(Task):
    """Denoising diffusion (Ho et al. 2020) with one part, `unet` (or `transformer`), on the diffusion core."""

    ModelConfig = DiffusionModelConfig
    cfg: DiffusionModelConfig

    def __init__(self, model_cfg: DiffusionModelConfig, ctx: TaskContext):
        super().__init__(model_cfg, ctx)
        self.image_size = ctx.image_size
        self.channels = ctx.channels
        check_num_classes(self.cfg.num_classes, ctx.num_classes)
        self.objective = build_objective(self.cfg, pixels=self.cfg.autoencoder is None)
        if self.cfg.ignored_shape_keys:
            log.warning(
                "model.backbone (kind %s) is the denoiser; the UNet keys model.%s are ignored",
                self.cfg.backbone.kind,
                ", model.".join(self.cfg.ignored_shape_keys),
            )
        self.part = part_name(self.cfg)
        self.text = TextEncoder(self.cfg.text, ctx.storage_options) if self.cfg.text is not None else None
        # Caption embeddings stored in encoded shards (`gentrain data encode --text`) stand in for the encoder's.
        self.stored_text = self.text is not None and self._check_stored_text(ctx.encoding)
        # The text encoders LoRA trains (model.lora.text_encoder), set by `build`: they encode the captions.
        self.text_lora: dict[str, nn.Module] = {}
        self._check_text_lora()
        self.backbone: Backbone | None = None  # set by `build`: how to call the part
        self.latent: LatentSpace | None = None  # set by `build` in latent diffusion
        self._inputs: dict[str, InputRecord] = {}

    def _check_text_lora(self) -> None:
        """model.lora.text_encoder: the CLIP text encoders of an SD 1.x/2.x or SDXL pipeline, whose captions are
        then encoded in each step (stored embeddings would be the untrained encoder's); exit 2 otherwise."""
        c = self.cfg
        if c.lora is None or not c.lora.text_encoder:
            return
        kind = c.text.kind if c.text is not None else None
        if kind not in ("sd", "sdxl"):
            raise ConfigError(
                f"model.lora.text_encoder=true: LoRA trains the CLIP text encoders of a Stable Diffusion 1.x/2.x or "
                f"SDXL pipeline folder (model.text.kind sd or sdxl); this run's text encoder is {kind!r} (T5 and "
                "SD3's/Flux's encoders are not adapted): set model.lora.text_encoder=false"
            )
        if self.stored_text:
            raise ConfigError(
                "model.lora.text_encoder=true trains the text encoder, so captions are encoded in every step: the "
                "caption embeddings stored in the data (gentrain data encode --text) cannot feed it; use the data "
                "encoded without --text, or set model.lora.text_encoder=false"
            )

    def _check_stored_text(self, encoding) -> bool:
        """Whether the data carry this encoder's caption embeddings; other ones exit 2 naming both digests.
        `encoding`: TaskContext.encoding (an EncodedSettings, read by attribute) or None."""
        made = encoding.text if encoding is not None else None
        if made is None:
            return False
        assert self.text is not None and self.cfg.text is not None
        if made.digest != self.text.digest or made.max_tokens != self.cfg.text.max_tokens:
            # Shards of `data encode` record each folder's digest (a pipeline's text_encoder_2, ...): name those
            # that differ, where a combined digest alone would not say which of a pipeline's encoders changed.
            pinned = made.parts
            differ = [
                f"model.text.{role} is {src} ({self.text.part_digests[role]}), the shards' {pinned[role].url} "
                f"({pinned[role].digest})"
                for role, src in self.cfg.text.folders()
                if role in pinned and pinned[role].digest != self.text.part_digests[role]
            ]
            which = f"other encoder files ({'; '.join(differ)}): " if differ else ""
            raise ConfigError(
                f"data.urls: {which}the shards' caption embeddings are {made.encoder} ({made.digest}, max_tokens "
                f"{made.max_tokens}), but model.text is {self.cfg.text.encoder} ({self.text.digest}, max_tokens "
                f"{self.cfg.text.max_tokens}): set model.text to the encoder that embedded them, or encode the "
                "data again with `gentrain data encode --text`"
            )
        return True

    @classmethod
    def expand_model(cls, model: dict, storage_options: Mapping | None) -> dict:
        """`model.*` of a user's config with what a released pipeline folder at `model.pretrained` implies
        filled in (trainer/models/pipelines.py `expand_ddpm_model`): the backbone's unet_config, the frozen
        autoencoder and text encoder, the objective."""
        return expand_ddpm_model(model, storage_options)

    @classmethod
    def trainable_part_names(cls, model_cfg: DiffusionModelConfig) -> list[str]:
        return [part_name(model_cfg)]

    @classmethod
    def sampling_refusal(cls, model_cfg: DiffusionModelConfig, inference_steps: int, scheduler: str) -> str | None:
        objective = build_objective(model_cfg, pixels=model_cfg.autoencoder is None)
        return objective.sampler_refusal(inference_steps, scheduler)

    @property
    def conditional(self) -> bool:
        return self.cfg.num_classes is not None or self.text is not None

    def frozen_sources(self) -> dict[str, FrozenSource]:
        if self.cfg.autoencoder is None:
            return {}
        return {AUTOENCODER: frozen_source(self.cfg.autoencoder)}

    def build(self, frozen) -> dict[str, nn.Module]:
        c = self.cfg
        size, channels, extra = self.image_size, self.channels, {}
        if c.autoencoder is not None:
            # Imported by latent runs only: its autoencoder classes import diffusers' loaders (peft, scipy),
            # which a pixel-space run never needs (tests/test_startup.py).
            from trainer.diffusion.latent import LatentSpace

            self.latent = LatentSpace(
                c.autoencoder, frozen[AUTOENCODER], size, channels, self.seed, self.ctx.services, self.ctx.encoding
            )
            channels, size = self.latent.shape[0], self.latent.side
            extra[AUTOENCODER] = self.latent.build()
            c.denoiser_class.check_input_side(c.denoiser, size, f"the autoencoder's {size}x{size} latents")
        self.backbone = build_backbone(c.denoiser, size, channels, c.num_classes)
        self._check_buckets()
        # The part is the bare diffusers module: its state-dict keys are those of checkpoints written before
        # the backbone section existed.
        net = self.backbone.model
        within = None
        if c.pretrained is not None and is_pipeline_folder(c.pretrained, self.ctx.storage_options):
            # A released pipeline: every file it gives the run (the UNet's, the VAE's, the text encoder's and
            # tokenizer's, the scheduler's) is pinned by digest, first in the inputs, so a resume or a sample
            # against a changed folder is refused naming the file (check_pinned_inputs).
            pipeline = inspect_pipeline(c.pretrained, "model.pretrained", self.ctx.storage_options)
            self._inputs = {"pipeline": pipeline.record.pinned(), **self._inputs}
            within = pipeline.family.denoiser
        folder = prepare_unet(
            net,
            c,
            "model",
            _backbone_hints(c),
            self.ctx.storage_options,
            self.ctx.load_pretrained,
            c.denoiser_class.lora_targets,
            within=within,
            text_lora=True,
        )
        if c.lora is not None and c.lora.text_encoder and self.text is not None:
            # Adapted copies of the pipeline's CLIPs, children of the part: they train, save and export with it.
            clips = [part.model for part in self.text.backend.parts]
            self.text_lora = attach_text_lora(net, clips, c.lora, "model.lora")
        if folder is not None:
            # LoRA: checkpoints hold the adapters only, the base is this folder's: pinned (a changed one is exit 2).
            self._inputs[f"{self.part}.pretrained"] = folder.record.pinned(c.lora is not None)
        return {self.part: net, **extra}

    def size_factor(self) -> tuple[int, str]:
        """(what every image side must be a multiple of, how it is made): the autoencoder's downsampling times
        the denoiser's (a UNet's 2 ** (levels - 1), a transformer's patch side)."""
        d = self.cfg.denoiser
        vae = self.latent.geometry.downsample if self.latent is not None else 1
        unet = getattr(d, "downsample", None)
        net, what = (unet, "UNet downsampling") if unet else (getattr(d, "patch", 1), f"{d.kind} patch side")
        parts = ([f"autoencoder {vae}"] if self.latent is not None else []) + [f"{what} {net}"]
        return vae * net, " x ".join(parts)

    def _check_buckets(self) -> None:
        """Buckets (ctx.buckets, from data.buckets) whose sides the model cannot take: exit 2 naming them and the
        factor, before a step runs (a bucket's batch would otherwise fail in the denoiser mid-run)."""
        if not self.ctx.buckets:
            return
        factor, how = self.size_factor()
        bad = [f"{h}x{w}" for h, w in self.ctx.buckets if h % factor or w % factor]
        if bad:
            raise ConfigError(
                f"data.buckets: {', '.join(bad)} (height x width) are not multiples of {factor}, the factor this model "
                f"needs ({how}): set data.bucket_step to a multiple of {factor} (data.buckets=auto), or list buckets "
                f"whose sides are multiples of {factor}"
            )

    def inputs(self) -> dict[str, InputRecord]:
        out = dict(self._inputs)
        if self.text is not None:
            out["text_encoder"] = InputRecord(source=self.cfg.text.source, digest=self.text.digest, pin=True)
        return out

    def export_unets(self, modules) -> dict[str, tuple[nn.Module, dict[str, torch.Tensor]]]:
        if self.part != "unet":
            raise ConfigError(
                f"this DDPM model's denoiser is a {self.cfg.denoiser.kind} backbone, not a diffusers UNet: "
                "nothing to export as a UNet"
            )
        return {"unet": (modules["unet"], {})}

    def _no_pipeline(self, vae_problem: str | None) -> str | None:
        """Why no diffusers pipeline samples this model as `gentrain sample` does; None when one does."""
        c, kind, objective = self.cfg, self.cfg.denoiser.kind, self.objective.name
        offered = c.denoiser_class.pipeline  # the pipeline its backbone declares, if the rest allows
        if self._from_pipeline:
            pipe = pipeline_for_text(c.text.kind)
            part, cls = self.part, type(self.backbone.model).__name__ if self.backbone else "UNet2DConditionModel"
            lora = f", or the adapters alone onto it: pipe.load_lora_weights('OUT/{part}-lora')" if c.lora else ""
            return (
                f"gentrain does not write {pipe} folders yet: load the exported {part}/ into the base pipeline, "
                f"{pipe}.from_pretrained({c.pretrained!r}, {part}={cls}.from_pretrained('OUT/{part}'))"
                f"{lora}"
            )
        if self.text is not None:
            pooled = ", plus the pooled embedding" if c.denoiser_class.pooled_width(c.denoiser) else ""
            return (
                f"diffusers' text-to-image pipelines load their own CLIP/T5 text encoder and tokenizer; this {kind} "
                f"is conditioned on the frozen {c.text.kind} encoder {c.text.source!r} ({c.text.width} wide: caption "
                f"token embeddings and mask{pooled}; the empty caption is the unconditional one), which no diffusers "
                "pipeline runs"
            )
        if objective == "edm":
            return (
                "prediction_type=edm: its samplers need the start noise scaled by init_noise_sigma and EDM's input "
                "preconditioning (scheduler.scale_model_input): DDPMPipeline and DDIMPipeline apply neither, "
                "DiTPipeline only the second"
            )
        if offered == "DDIMPipeline" and c.num_classes is not None:
            return (
                "DDIMPipeline and DDPMPipeline call the UNet without class labels; this UNet is class-conditional "
                f"(class_labels 0..{c.num_classes - 1}; row {c.num_classes} of its class table is the null class "
                "for classifier-free guidance)"
            )
        if offered == "DDIMPipeline" and self.latent is not None:
            return (
                "no diffusers pipeline samples a UNet2DModel in an AutoencoderKL's latent space (LDMPipeline decodes "
                "with a VQModel): sample the latents with the UNet and the scheduler, then decode them with the vae"
            )
        if offered == "DDIMPipeline":
            return None
        if offered is None:
            return f"no diffusers pipeline runs a gentrain {kind} backbone without captions"
        if offered != "DiTPipeline":
            return f"gentrain does not export {offered} folders yet"
        if self.latent is None:
            return "DiTPipeline decodes latents through a VAE; this DiT denoises pixels"
        if vae_problem is not None:
            return vae_problem
        if objective == "flow":
            return (
                "prediction_type=flow: DiTPipeline calls scheduler.scale_model_input, which the flow-matching "
                "Euler scheduler lacks"
            )
        if (c.num_classes or 1) > DIT_PIPELINE_NULL_CLASS:
            return f"DiTPipeline's null class is label {DIT_PIPELINE_NULL_CLASS}, one of this model's classes"
        return None

    def export(self, modules, sample, class_names: list[str] | None = None) -> Export:
        """The denoiser, its autoencoder (latent diffusion) and the run's sampling scheduler as diffusers folders,
        and the diffusers pipeline that samples them as `gentrain sample` does, where one exists:

        - an unconditional pixel UNet2DModel: DDIMPipeline (`sample.scheduler=ddim`) or DDPMPipeline (dpm: its
          loop is any scheduler's own steps; rectified flow with its Euler scheduler);
        - a latent DiT on a KL autoencoder: DiTPipeline, its label tables padded so the pipeline's null class
          1000 is gentrain's null row (`trainer.models.export.dit_for_pipeline`);
        - anything else (captions, class-conditional UNets, pixel DiTs, EDM, VQ-GAN or shifted latents): the
          folders only, `Export.reason` says why (`_no_pipeline`)."""
        c, name = self.cfg, self.part
        offered = c.denoiser_class.pipeline
        net = modules[name]
        scheduler = self.objective.inference_scheduler(sample.scheduler)
        sched_name = type(scheduler).__name__
        models: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]] = {name: (net, {})}
        vae, vae_problem = None, None
        if self.latent is not None:
            vae, vae_problem = self.latent.diffusers_vae(modules[AUTOENCODER])
            if vae is not None:
                models["vae"] = (vae, {})
        reason = self._no_pipeline(vae_problem)
        steps, scale = sample.inference_steps, sample.guidance_scale
        gen = "generator=torch.Generator().manual_seed(0)"
        pipeline, notes, extra = None, [], {}
        if reason is None and offered == "DDIMPipeline":
            pipeline = (
                "DDIMPipeline" if sample.scheduler == "ddim" and self.objective.name != "flow" else "DDPMPipeline"
            )
            eta = "eta=0.0, " if pipeline == "DDIMPipeline" else ""
            call = f"images = pipe(batch_size=4, num_inference_steps={steps}, {eta}{gen}).images"
        elif reason is None:
            pipeline = "DiTPipeline"
            classes = c.num_classes or 1  # gentrain's unconditional DiT is a DiT of one class, label 0
            models[name] = (dit_for_pipeline(net, classes), {})
            guide = scale if c.num_classes is not None else 1.0
            labels = list(range(min(4, classes)))
            call = (
                f"images = pipe(class_labels={labels}, guidance_scale={guide}, num_inference_steps={steps}, "
                f"{gen}).images"
            )
            notes.append(
                f"the transformer's label tables have 1001 rows (num_embeds_ada_norm=1000): rows 0..{classes - 1} "
                "are the trained classes, row 1000 (DiTPipeline's null class, used when guidance_scale > 1) is the "
                f"trained null class, rows {classes}..999 are copies of it and unused"
            )
            if c.num_classes is None:
                notes.append("unconditional: use class_labels=[0] * n and guidance_scale=1 (no guidance)")
            elif class_names is not None:
                extra["id2label"] = {str(i): n for i, n in enumerate(class_names[: c.num_classes])}
        else:
            cls = type(models[name][0]).__name__
            imports = sorted({cls, sched_name} | ({"AutoencoderKL"} if vae is not None else set()))
            load = [
                f"from diffusers import {', '.join(imports)}",
                "",
                'folder = "path/to/this/folder"',
                f'{name} = {cls}.from_pretrained(folder, subfolder="{name}")',
                f'scheduler = {sched_name}.from_pretrained(folder, subfolder="scheduler")',
            ]
            if vae is not None:
                shift = " + vae.config.shift_factor" if vae.config.get("shift_factor") else ""
                load.append(
                    'vae = AutoencoderKL.from_pretrained(folder, subfolder="vae")  '
                    f"# images = vae.decode(latents / vae.config.scaling_factor{shift}).sample"
                )
            if offered == "DiTPipeline":
                rows = (c.num_classes or 1) + 1
                notes.append(f"the transformer's label tables have {rows} rows: the classes, then the null class")
            if self.latent is not None and vae is None:
                notes.append("no vae/ folder: the latents are decoded by the gentrain autoencoder run")
        notes.append(
            f"the run samples with {sched_name}, {steps} steps, guidance scale {scale} (sample.*); the denoiser "
            "works on images (or latents) in [-1, 1]"
        )
        if pipeline is not None:
            load = [
                "import torch",
                "from diffusers import DiffusionPipeline",
                "",
                f'pipe = DiffusionPipeline.from_pretrained("path/to/this/folder")  # {pipeline}, {sched_name}',
                call,
            ]
        return Export(
            models=models,
            schedulers={"scheduler": scheduler},
            pipeline=pipeline,
            reason=reason,
            usage="\n".join(load),
            index_extra=extra,
            notes=notes,
            # A released pipeline's fine-tune: its adapters in the layout the pipeline's load_lora_weights reads.
            lora_prefixes={self.part: self.part} if self._from_pipeline else {},
        )

    @property
    def _from_pipeline(self) -> bool:
        """Whether the denoiser is a released pipeline's (model.pretrained a pipeline folder, its keys filled
        in: the denoiser's diffusers config and the pipeline's text encoders)."""
        c = self.cfg
        built_from = getattr(c.denoiser, "unet_config", None) or getattr(c.denoiser, "transformer_config", None)
        return (
            c.pretrained is not None
            and built_from is not None
            and c.text is not None
            and pipeline_for_text(c.text.kind) is not None
        )

    def _net(self, module: nn.Module):
        """The part as the core calls a network: (x, t, conditions) -> output."""
        backbone = self.backbone
        assert backbone is not None, "build() first"
        return lambda x, t, cond: backbone.call(module, x, t, cond)

    def conditions(
        self,
        n: int,
        device: torch.device,
        drop: torch.Tensor,
        labels: torch.Tensor | None = None,
        captions: list[str] | None = None,
        stored: TextEmbeddings | None = None,
        sizes: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The denoiser's conditions; samples with `drop` set get the null class and the empty caption.
        `stored`: the captions' embeddings read from encoded shards (the encoder then embeds only "").
        `sizes`: (n, 6) each sample's original height and width, crop top and left, target height and width in
        pixels (an image folder's samples carry them: `size_conditions` in their extras); None: every sample is
        a data.image_size square, uncropped."""
        cond: dict[str, torch.Tensor] = {}
        drop = drop.to(device)
        if self.cfg.num_classes is not None:
            labels = torch.full((n,), -1, dtype=torch.long) if labels is None else labels
            cond["labels"] = labels_or_null(labels.to(device), drop, self.cfg.num_classes)
        if self.text is not None:
            if stored is not None:
                emb = _with_empty_caption(stored, self.text.encode([""], device), drop)
            elif captions is None:
                raise ConfigError(
                    "model.text is set but the data has no captions: put a .txt beside each image (or use "
                    "shards with a txt field), or remove model.text"
                )
            elif self.text_lora:  # the trained encoders, in the step (with gradients when training), never cached
                kept = ["" if d else cap for cap, d in zip(captions, drop.tolist(), strict=True)]
                emb = TextEmbeddings(*self.text.backend.encode_with(list(self.text_lora.values()), kept, device))
            else:
                emb = self.text.encode(
                    ["" if d else cap for cap, d in zip(captions, drop.tolist(), strict=True)], device
                )
            every = {"captions": emb.tokens, "caption_mask": emb.mask, "pooled": emb.pooled}
            assert self.backbone is not None, "build() first"
            cond.update({k: v for k, v in every.items() if k in self.backbone.accepts})
            if "resolution" in self.backbone.accepts and sizes is not None:
                # PixArt's: the image's original (height, width) and its bucket's height / width, as PixArt's
                # multi-scale training reads them (img_hw, aspect_ratio); sampling gives (h, w, 0, 0, h, w), which
                # is PixArtSigmaPipeline's (height, width) and height / width. None: the backbone's default (the
                # input's size).
                sizes = sizes.to(device, torch.float32)
                cond["resolution"] = sizes[:, 0:2]
                cond["aspect_ratio"] = sizes[:, 4:5] / sizes[:, 5:6]
            if "time_ids" in self.backbone.accepts:
                # SDXL's micro-conditions: original size, crop top-left, target size, in pixels, as its
                # training script and StableDiffusionXLPipeline._get_add_time_ids lay them out.
                if sizes is None:
                    s = float(self.image_size)
                    sizes = torch.tensor([[s, s, 0.0, 0.0, s, s]]).expand(n, 6)
                cond["time_ids"] = sizes.to(device, torch.float32)
        return cond

    def loss(self, phase: Phase, modules: Mapping[str, nn.Module], batch: Batch, outputs, info: StepInfo) -> Loss:
        x0 = batch.images
        if self.latent is not None:
            x0 = self.latent.encode(modules[AUTOENCODER], x0, info.step, batch.positions)
        device = x0.device
        # The sample's noise first, then its noise level, then its condition dropout (the draws' order is the
        # checkpointed runs' contract: a resumed run draws what an uninterrupted one would).
        draws = sample_draws(self.seed, info.step, batch.positions, device=device)
        noise = draws.randn(x0.shape[1:]).to(x0.dtype)
        draw = self.objective.draw(draws, len(batch), device, x0.dtype)
        cond = {}
        if self.conditional:
            drop = draws.rand() < self.cfg.cond_drop_prob
            stored = None
            if self.stored_text:
                e = batch.extras
                stored = TextEmbeddings(e["text_tokens"], e["text_mask"], e["text_pooled"])
            cond = self.conditions(len(batch), device, drop, batch.labels, batch.captions, stored, self.sizes(batch))
        out = self.objective.loss(self._net(modules[self.part]), x0, noise, draw, cond)
        # The extras key is trainer.data.dreambooth.PRIOR (the data layer is below the tasks').
        prior = batch.extras.get("prior")
        return out if prior is None else prior_weighted(out, prior, self.cfg.prior_loss_weight)

    def sizes(self, batch: Batch) -> torch.Tensor | None:
        """The batch's size micro-conditions (see `conditions`): each sample's, where its source records them (an
        image folder); else, for SDXL, the batch's own size in pixels, uncropped (a bucket's on shards and latent
        shards, where data.image_size's square would be the wrong target size); else None."""
        sizes = batch.extras.get("size_conditions")  # trainer.data.buckets.SIZE_CONDITIONS (the data layer's key)
        if sizes is not None or self.backbone is None or "time_ids" not in self.backbone.accepts:
            return sizes
        h, w = batch.images.shape[-2:]
        if self.latent is not None and self.latent.encoding is not None:  # stored posteriors: latent-sized
            h, w = h * self.latent.geometry.downsample, w * self.latent.geometry.downsample
        return torch.tensor([[h, w, 0, 0, h, w]], dtype=torch.float32).expand(len(batch), 6)

    def previews(self, modules, ctx: PreviewContext) -> dict[str, torch.Tensor]:
        """`samples` from noise; a caption-conditioned model draws the held-out batch's captions."""
        prompts = ctx.held_out_prompts() if self.text is not None else None
        with ctx.preferred_weights():
            return {"samples": self.sample(modules, ctx.request(prompts=prompts), ctx.device)}

    def sample_accepts(self) -> frozenset[str]:
        c = self.cfg
        conditions = {"labels": c.num_classes is not None, "prompts": self.text is not None}
        guided = {"guidance_scale"} if self.conditional else set()
        # --height/--width: a model trained on aspect-ratio buckets samples at any of them (`_sample_size`).
        sizes = {"height", "width"} if self.ctx.buckets else set()
        return frozenset({"inference_steps", "scheduler", *sizes, *guided, *(k for k, on in conditions.items() if on)})

    def _sample_size(self, request: SampleRequest) -> tuple[int, int] | None:
        """The (height, width) asked for (`--height`/`--width`, a missing one data.image_size), refused (exit 2)
        unless it is one of the aspect-ratio buckets the model trained at; None when neither was asked for (the
        data.image_size square, as a run without buckets always samples: it takes neither flag)."""
        if request.height is None and request.width is None:
            return None
        size = (request.option("height", self.image_size), request.option("width", self.image_size))
        trained = list(self.ctx.buckets or [])
        if size not in trained:
            listed = ", ".join(f"{h}x{w}" for h, w in trained)
            raise ConfigError(
                f"--height {size[0]} --width {size[1]}: this checkpoint trained at the aspect-ratio buckets "
                f"(data.buckets) {listed} (height x width); sample at one of them"
            )
        return size

    @torch.no_grad()
    def sample(self, modules: Mapping[str, nn.Module], request: SampleRequest, device: torch.device) -> torch.Tensor:
        c = self.cfg
        num, seed, labels, prompts = request.num, request.seed, request.labels, request.prompts
        guidance_scale = request.option("guidance_scale", 1.0)
        g = torch.Generator().manual_seed(seed)
        asked = self._sample_size(request)
        height, width = asked or (self.image_size, self.image_size)
        if self.latent is not None:
            factor = self.latent.geometry.downsample
            shape = (self.latent.shape[0], height // factor, width // factor)
        else:
            shape = (self.channels, height, width)
        # As diffusers' pipelines by default: the original size is the output's, uncropped.
        sizes = None if asked is None else torch.tensor([[height, width, 0, 0, height, width]]).expand(num, 6)
        x = torch.randn((num, *shape), generator=g).to(device)
        guidance = Guidance({})
        if self.conditional:
            if c.num_classes is not None and labels is None:
                labels = default_labels(num, c.num_classes)
            if self.text is not None:
                if prompts is None:
                    log.warning("caption-conditioned DDPM sampled without a prompt: unconditional samples")
                    prompts = [""] * num
                prompts = (list(prompts) * num)[:num]
            cond = self.conditions(num, device, torch.zeros(num, dtype=torch.bool), labels, prompts, sizes=sizes)
            uncond = None
            if guidance_scale != 1.0:
                uncond = self.conditions(num, device, torch.ones(num, dtype=torch.bool), labels, prompts, sizes=sizes)
            guidance = Guidance(cond, uncond, guidance_scale)
        steps, scheduler = request.option("inference_steps", 50), request.option("scheduler", "ddim")
        x = self.objective.denoise(
            self._net(modules[self.part]), x, steps, scheduler, guidance, request.check_between_steps
        )
        if self.text is not None:
            log.info(self.text.usage())
        if self.latent is not None:
            x = self.latent.decode(modules[AUTOENCODER], x)
        return ((x.float().clamp(-1, 1) + 1) / 2).cpu()


def prior_weighted(out: Loss, prior: torch.Tensor, weight: float) -> Loss:
    """DreamBooth's loss, diffusers' `instance_loss + prior_loss_weight * prior_loss`: a step's batch is half
    instance, half class images (`prior` 1) and the engine averages the per-sample losses over the whole batch,
    so each instance sample counts 2 and each class sample 2 * weight. The terms `instance_loss` and
    `prior_loss` average to each half's own mean loss."""
    prior = prior.to(out.per_sample.dtype)
    per = out.per_sample
    terms = {**out.terms, "instance_loss": 2 * (1 - prior) * per.detach(), "prior_loss": 2 * prior * per.detach()}
    return Loss(per * (2 * (1 - prior) + 2 * weight * prior), terms)


def _with_empty_caption(stored: TextEmbeddings, empty: TextEmbeddings, drop: torch.Tensor) -> TextEmbeddings:
    """The stored embeddings, with the empty caption's where `drop` is set (as the encoder would give)."""

    def pick(kept: torch.Tensor, blank: torch.Tensor) -> torch.Tensor:
        where = drop.view(-1, *([1] * (kept.dim() - 1)))
        return torch.where(where, blank.to(kept.dtype), kept)

    return TextEmbeddings(
        pick(stored.tokens, empty.tokens), pick(stored.mask, empty.mask), pick(stored.pooled, empty.pooled)
    )


TASK = DDPMTask
