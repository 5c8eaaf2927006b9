"""The Task interface: what a model family tells the engine. Tasks never touch devices, ranks,
precision, optimizers or checkpoints; the engine never learns a task's name.

A task
- **builds** named parts (`build`): trainable ones get their own optimizer,
  schedule, scaler, EMA and step counter from the engine; *frozen* ones
  (`frozen_sources`) are loaded from another run's checkpoint, digest-checked,
  never optimized, never wrapped in DDP and never saved again;
- says which **phases** run at a step (`phases`): each phase optimizes one
  part (a GAN: generator, then discriminator once its start step is reached);
- runs one **forward** per chunk (`forward`) whose outputs every phase of the
  step shares; phases after the first see them detached;
- returns per-sample **losses** plus named terms for a phase (`loss`);
- returns named per-sample **validation metrics** (`validate`);
- makes **previews** (`previews`): image grids (N, C, H, W) or videos
  (N, T, C, H, W), from noise or from a real held-out batch;
- may **calibrate** (`calibration_size`, `calibrate`): measure its current
  weights on a fixed sample of training images before each checkpoint save
  and keep the result in a part's buffers, saved with that part (an
  autoencoder's latent scaling factor).

Inside `forward` and `loss`, `modules[name]` is the DDP-wrapped part when
that part learns in the current phase, else the bare module with gradients
off: a discriminator called in the generator phase costs no all-reduce and
leaves no unused parameters. For the part's own module (its attributes, a
parameter to differentiate against) a task calls `bare(modules, name)`, the
same call wherever `modules` comes from. What a task needs of the other
processes (do any of them still need to encode?) it asks `ctx.services` by
intent (`trainer.services`); it never sees a rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel
from torch import nn

from trainer.errors import ConfigError
from trainer.services import ProcessServices, process_services
from trainer.task_types import FrozenSource, FrozenWeights, Loss
from trainer.tasks.sampling import SampleRequest

__all__ = [
    "Batch",
    "Export",
    "FrozenSource",
    "FrozenWeights",
    "Loss",
    "Phase",
    "PreviewContext",
    "StepInfo",
    "Task",
    "TaskContext",
    "bare",
]


@dataclass
class Batch:
    """One chunk of a step's batch on the training device.

    `positions` are the samples' places in the step's *global* batch; tasks key
    their per-sample randomness by them (see trainer.randomness). `extras`
    carries per-sample tensors a source provides beyond images and labels
    (image embeddings, ...); `captions` the per-sample text, which tasks embed
    with their own (frozen) text encoder.
    """

    images: torch.Tensor  # (N, C, H, W) or (N, T, C, H, W), in [-1, 1]
    labels: torch.Tensor  # (N,) int64; -1 when unlabelled
    indices: torch.Tensor  # (N,) dataset indices
    positions: list[int]
    valid: torch.Tensor | None = None  # (N,) 1.0 for loaded samples, 0.0 for unreadable ones
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. "image_embed": (N, D)
    captions: list[str] | None = None  # per-sample text ("" when a sample has none); None: no text

    def __len__(self) -> int:
        return len(self.positions)


@dataclass(frozen=True)
class Phase:
    """One optimization phase of a step: the named part it optimizes."""

    name: str
    part: str


@dataclass(frozen=True)
class StepInfo:
    """Where training is: the global step being computed and the phase part's own step count."""

    step: int
    part_step: int = 0


@dataclass
class Export:
    """What `gentrain checkpoints export` writes for a checkpoint (see trainer/models/export.py).

    `models`: folder name -> (a diffusers model, gentrain tensors that belong with it, written beside its
    weights); `schedulers`: folder name -> a diffusers scheduler. With `pipeline` (a diffusers pipeline class
    name) the folders are that pipeline's components and model_index.json is written (plus `index_extra`,
    e.g. DiTPipeline's `id2label`); without it, `reason` says why no diffusers pipeline runs the model.
    `usage` is the Python that loads and runs the export, for the model card. `parts`: folder name -> the
    checkpoint part whose weights a folder holds, where the two names differ (a VQ-GAN's `vqvae` folder is
    its `generator`), so the model card names that part's weights digest."""

    models: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]]
    schedulers: dict[str, Any] = field(default_factory=dict)
    pipeline: str | None = None
    reason: str | None = None
    usage: str = ""
    index_extra: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # more lines for the model card
    parts: dict[str, str] = field(default_factory=dict)  # folder -> checkpoint part, where they differ
    # folder -> the key prefix its `-lora` adapters are written under (a released pipeline's denoiser slot,
    # `unet`: the layout the pipeline's `load_lora_weights` reads); unset: peft's own names
    lora_prefixes: dict[str, str] = field(default_factory=dict)


@dataclass
class TaskContext:
    """What a task knows about its run besides `model.*`."""

    image_size: int
    channels: int
    seed: int
    num_classes: int | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    stages: list[int] | None = None  # `train.stages`: the cascade stages this run trains (None = all)
    num_frames: int = 1  # `data.num_frames`: frames per clip of video sources (batches are (N, T, C, H, W))
    # The settings of `gentrain data encode` when the training data are its latent shards (see
    # trainer/encode.py): batches then carry posteriors, not images. None: images. An EncodedSettings
    # (trainer/data/shards/encoded.py, a layer tasks do not import), read by attribute.
    encoding: Any = None
    # `data.buckets`: the (height, width) aspect-ratio buckets the run trains (trained, when sampling) at, each
    # side in pixels; None: data.image_size squares. A task checks them against its model's size factor.
    buckets: list[tuple[int, int]] | None = None
    # False where a checkpoint's weights replace whatever `build` loads (sampling): pretrained folders
    # (`model.pretrained`) are then not read at all.
    load_pretrained: bool = True
    # Collectives a task asks for by intent (see trainer.services); answered from the process at call time.
    services: ProcessServices = field(default_factory=process_services)


def bare(modules: Mapping[str, nn.Module], name: str) -> nn.Module:
    """Part `name`'s own module, never a DDP wrapper: during training `modules` is the engine's view
    (`bare(name)`), while sampling and validation hand over a plain mapping of bare modules."""
    own = getattr(modules, "bare", None)
    return own(name) if own is not None else modules[name]


@dataclass
class PreviewContext:
    """What a preview gets: a real held-out batch and a way to choose online or EMA weights."""

    batch: Batch | None
    num: int
    seed: int
    device: torch.device
    options: dict[str, Any]  # sampler options from `sample.*` (inference_steps, scheduler, guidance_scale)
    use_ema: bool
    weights: Callable[[bool], AbstractContextManager]  # weights(True): EMA weights swapped in
    part_steps: Mapping[str, int] = field(default_factory=dict)  # each trainable part's own step count
    between_steps: Callable[[], None] | None = None  # raises to cut the preview short (a stop request)
    prompts: list[str] | None = None  # a `sample.prompts` entry: this preview row's prompt, not held-out captions

    def preferred_weights(self) -> AbstractContextManager:
        """EMA weights when `sample.use_ema` (the default), else the online weights."""
        return self.weights(self.use_ema)

    def held_out_prompts(self) -> list[str] | None:
        """`num` prompts cycled from the held-out batch's captions (what a caption-conditioned model previews
        with); None when the batch has none. With `prompts` (the previewer's row of a `sample.prompts`
        entry), those instead."""
        if self.prompts:
            return [self.prompts[i % len(self.prompts)] for i in range(self.num)]
        if self.batch is None or not self.batch.captions:
            return None
        caps = self.batch.captions
        return [caps[i % len(caps)] for i in range(self.num)]

    def request(self, **options: Any) -> SampleRequest:
        """The sampling request of a preview: `num`, `seed`, the sampler options and the stop check, plus
        `options`."""
        return SampleRequest(
            num=self.num, seed=self.seed, between_steps=self.between_steps, **{**self.options, **options}
        )


class Task:
    """A generative model made of named parts. Subclasses set `ModelConfig` and implement
    `build`, `loss` and `sample`; the rest has defaults that fit a one-part model."""

    ModelConfig: ClassVar[type[BaseModel]]
    # False when the loss is not a per-sample sum (e.g. a GAN's adaptive weight computed from a
    # chunk's gradients): the engine then refuses train.micro_batch_size instead of changing the update.
    micro_batch_invariant: ClassVar[bool] = True
    # True when `sample` reconstructs real images (an autoencoder): `gentrain sample` then passes
    # held-out images as the request's `images` (N, C, H, W) in [-1, 1].
    samples_reconstruct: ClassVar[bool] = False
    # What this task's `generator` part is to another run that loads it as a frozen part (None: nothing):
    # "kl-autoencoder" (latent diffusion's first stage), "image-tokenizer" (a VQ-GAN: latent diffusion or
    # MaskGIT), "video-tokenizer" (video MaskGIT). Declared by the model config class (`frozen_kind` there),
    # so a consumer reads it from the source run's typed config (`frozen_kind_of`) without the registry.
    frozen_kind: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "ModelConfig" in cls.__dict__:
            cls.frozen_kind = getattr(cls.ModelConfig, "frozen_kind", None)

    def __init__(self, model_cfg: BaseModel, ctx: TaskContext):
        self.cfg = model_cfg
        self.ctx = ctx
        self.seed = ctx.seed

    # ---- parts
    @classmethod
    def trainable_part_names(cls, model_cfg: BaseModel) -> list[str]:
        """Names of the parts that get optimizers (validated against `optim.<part>`)."""
        raise NotImplementedError

    @classmethod
    def ema_part_names(cls, model_cfg: BaseModel) -> list[str]:
        """Trainable parts that keep an EMA when `ema.enabled` (default: all; a GAN: its generator)."""
        return cls.trainable_part_names(model_cfg)

    def fsdp_refusal(self) -> str | None:
        """Why this configuration cannot train under train.parallel=fsdp (None: it can)."""
        return None

    def learning_parts(self) -> list[str]:
        """The trainable parts this run optimizes (and wraps in DDP); the others keep their state untouched.

        Default: all of them. A cascade narrows it with `train.stages`; other tasks refuse that key.
        """
        if self.ctx.stages is not None:
            raise ConfigError(
                f"train.stages={self.ctx.stages}: only cascade tasks have stages; remove train.stages "
                f"(this task trains {', '.join(self.trainable_part_names(self.cfg))} together)"
            )
        return self.trainable_part_names(self.cfg)

    def frozen_sources(self) -> dict[str, FrozenSource]:
        """Parts loaded from other runs, by part name; resolved before `build`."""
        return {}

    def inputs(self) -> dict[str, Any]:
        """What else the run depends on, recorded in every checkpoint (after `build`), each an `InputRecord`
        (trainer.checkpoint.validity, typed Any here: tasks import no checkpoint): a pretrained folder's URL and
        digest, a text encoder's. A pinned record must match on resume (exit 2 otherwise); the others are
        provenance (the checkpoint's weights replace them)."""
        return {}

    def export_unets(self, modules: Mapping[str, nn.Module]) -> dict[str, tuple[nn.Module, dict[str, torch.Tensor]]]:
        """Diffusers UNets to export (`gentrain checkpoints export`), by part: (the UNet, extra tensors that
        belong with it). Tasks without one refuse."""
        raise ConfigError(f"{type(self).__name__} has no diffusers UNet to export")

    def export(self, modules: Mapping[str, nn.Module], sample: Any, class_names: list[str] | None = None) -> Export:
        """What `gentrain checkpoints export` writes (`sample`: the run's `sample.*` section, its scheduler, steps
        and guidance scale; `class_names`: the data's class names by label, when known). Default: the
        UNets of `export_unets`, each in a folder of its part's name, without a pipeline. Tasks without a
        diffusers model refuse (ConfigError)."""
        return Export(
            models=self.export_unets(modules),
            reason=f"no diffusers pipeline runs a gentrain {type(self).__name__}: its UNets are exported on their own",
        )

    def build(self, frozen: Mapping[str, FrozenWeights]) -> dict[str, nn.Module]:
        """Every part, trainable and frozen, freshly initialized (the engine loads frozen weights)."""
        raise NotImplementedError

    # ---- training
    def phases(self, step: int, part_steps: Mapping[str, int]) -> list[Phase]:
        """Phases that run at global step `step`, in order; default: one phase per trainable part."""
        return [Phase(name, name) for name in self.trainable_part_names(self.cfg)]

    def forward(self, modules: Mapping[str, nn.Module], batch: Batch, step: int) -> dict[str, Any]:
        """Work shared by the step's phases (a generator's reconstruction); default none."""
        return {}

    def loss(
        self, phase: Phase, modules: Mapping[str, nn.Module], batch: Batch, outputs: Mapping[str, Any], info: StepInfo
    ) -> Loss:
        raise NotImplementedError

    # ---- measurements saved with the weights
    def calibration_size(self) -> int:
        """How many training images `calibrate` measures (0: the task has nothing to measure)."""
        return 0

    def calibrate(self, modules: Mapping[str, nn.Module], batches: Iterable[Batch]) -> None:
        """Measure the current weights on a fixed sample of training images (the first `calibration_size()`
        of the training set, in chunks, the same on every process) and store the result in a part's buffers,
        which its checkpoint saves. Called by the engine before each checkpoint save, in eval mode, with
        gradients off and the EMA weights swapped in where a part keeps them."""

    # ---- evaluation and output
    def validate(self, modules: Mapping[str, nn.Module], batch: Batch) -> dict[str, torch.Tensor]:
        """Named per-sample validation metrics (averaged over the validation set by the engine)."""
        phase = self.phases(0, {})[0]
        return {"loss": self.loss(phase, modules, batch, self.forward(modules, batch, -1), StepInfo(-1)).per_sample}

    def previews(self, modules: Mapping[str, nn.Module], ctx: PreviewContext) -> dict[str, torch.Tensor]:
        """Named previews: images (N, C, H, W) or videos (N, T, C, H, W) in [0, 1], on CPU."""
        with ctx.preferred_weights():
            return {"samples": self.sample(modules, ctx.request(), ctx.device)}

    @classmethod
    def sampling_refusal(cls, model_cfg: BaseModel, inference_steps: int, scheduler: str) -> str | None:
        """Why this config's sampler would refuse `inference_steps` steps of `scheduler` (`sample.*`,
        `eval.*`), or None. Asked when the config is read (`trainer.registry.check_sampling_settings`), so a
        preview or an evaluation never fails after hours of training. Default: nothing refused."""
        return None

    def sample_accepts(self) -> frozenset[str]:
        """The options of a `SampleRequest` this task's `sample` reads (`trainer.tasks.sampling.OPTIONS`:
        `labels`, `prompts`, `temperature`, ...), as this config builds it. `gentrain sample` refuses any
        other option the user gives (`check_request`, exit 2). Default: none."""
        return frozenset()

    @torch.no_grad()
    def sample(self, modules: Mapping[str, nn.Module], request: SampleRequest, device: torch.device) -> torch.Tensor:
        """`request.num` outputs in [0, 1] on CPU: images (num, C, H, W) or videos (num, T, C, H, W). Reads
        only the options `sample_accepts` declares (each None when not asked for: the task's default)."""
        raise NotImplementedError
