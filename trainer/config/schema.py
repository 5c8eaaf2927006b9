"""The config schema: one pydantic section per concern. No torch here, and nothing of gentrain's tasks.

`model.*` is validated by the task's own schema, found through `trainer.registry`
by task name, so the schema of a task lives next to the task; the registry hands
the typed result to `Config.set_model_cfg`. `optim.<part>.*` overrides the
optimizer settings of one part (e.g. a discriminator's lr and betas).
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from trainer.errors import ConfigError  # noqa: F401 (re-exported: older code imports it from trainer.config)

DEFAULT_PRESET = "digits-ddpm"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_betas(betas: tuple[float, float]) -> tuple[float, float]:
    # torch.optim.AdamW raises a bare ValueError (a traceback, exit 1) for these; refuse them as config.
    if not all(0.0 <= b < 1.0 for b in betas):
        raise PydanticCustomError(
            "betas_range", "each of AdamW's two betas must be in [0, 1), e.g. [0.9, 0.999] (decays of its averages)"
        )
    return betas


# AdamW's (beta1, beta2): the decays of its running averages of the gradient and its square.
Betas = Annotated[tuple[float, float], AfterValidator(_check_betas)]
# Optimizer numbers torch takes as they are: NaN or infinity would reach the weights, so they are refused here.
Finite = Annotated[float, Field(allow_inf_nan=False)]


class RunConfig(_Section):
    dir: str | None = Field(None, description="local folder for logs and grids; default runs/<name>")


# After `warmup_steps` of linear warmup: diffusers' `get_scheduler` names (what its training scripts'
# --lr_scheduler takes); `constant` keeps the warmup, as `constant_with_warmup` does.
LrSchedule = Literal["cosine", "constant", "constant_with_warmup", "linear", "cosine_with_restarts", "polynomial"]
# adamw: torch's fused AdamW (float32 state, 8 bytes a parameter). adamw8bit: torchao's AdamW8bit, whose two
# averages are block-quantized to 8 bits (about 2 bytes a parameter); needs the `lowbit` extra.
OptimizerName = Literal["adamw", "adamw8bit"]


class TrainConfig(_Section):
    max_steps: int = Field(1000, ge=1)
    batch_size: int = Field(64, ge=1, description="global batch over all ranks and accumulation")
    grad_accum: int = Field(1, ge=1)
    micro_batch_size: int | None = Field(None, ge=1, description="largest chunk per forward")
    lr: Finite = Field(2e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: LrSchedule = "cosine"
    lr_num_cycles: int = Field(1, ge=1, description="cosine_with_restarts: hard restarts over the run")
    lr_power: Finite = Field(1.0, gt=0, description="polynomial: the decay's power (1 = linear)")
    weight_decay: Finite = Field(0.0, ge=0)
    betas: Betas = (0.9, 0.999)
    max_grad_norm: Finite | None = Field(1.0, gt=0)
    max_nonfinite_steps: int = Field(
        8,
        ge=0,
        description="stop (exit 2) after this many steps in a row whose loss or gradient norm was inf or NaN (such "
        "steps are never applied); 0 = never stop",
    )
    optimizer: OptimizerName = Field(
        "adamw", description="every part's optimizer: adamw, or adamw8bit (8-bit state, the lowbit extra)"
    )
    precision: Literal["no", "fp16", "bf16"] = "no"
    log_every_steps: int = Field(50, ge=1)
    val_every_steps: int = Field(0, ge=0, description="0 = no validation")
    val_batches: int = Field(4, ge=1)
    num_workers: int = Field(0, ge=0)
    prefetch_factor: int = Field(2, ge=1, description="batches each loader worker reads ahead (with num_workers > 0)")
    pin_memory: bool = Field(
        True, description="on CUDA: loader batches in pinned memory, copied to the GPU without blocking; no-op on CPU"
    )
    tf32: bool = Field(True, description="on CUDA (Ampere+): fp32 matmuls and convolutions in TF32; no-op on CPU")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads per process")
    parallel: Literal["ddp", "fsdp"] = Field("ddp", description="replicate parts (ddp) or shard them (fsdp)")
    cpu_offload: bool = Field(False, description="fsdp: keep sharded parameters and optimizer state in CPU memory")
    shard_frozen: bool = Field(
        False,
        description="fsdp: shard frozen parts (a MaskGIT tokenizer) too, each rank keeping 1/world of their weights "
        "and gathering one block at a time when they are used; for frozen parts too large to replicate",
    )
    activation_checkpointing: Literal["none", "blocks", "selective"] = Field(
        "none",
        description="recompute activations in backward: per block (the FSDP units: transformer blocks, a UNet's "
        "down/up blocks) or selective (per block, keeping the matmul and attention outputs)",
    )
    compile: bool = Field(
        False,
        description="torch.compile each block (regional: the activation-checkpointing units) for the training "
        "forward and backward; compile time and graph breaks are logged after the first compiled step",
    )
    float8: Literal["none", "tensorwise", "rowwise"] = Field(
        "none",
        description="transformer backbones' linear layers in float8 (torchao; NVIDIA compute capability 8.9+, "
        "the float8 extra): tensorwise (fastest) or rowwise scaling; true means tensorwise. Best with train.compile",
    )
    stages: list[int] | None = Field(
        None, min_length=1, description="cascade: which stages (1-based) this run trains; null = all"
    )

    @field_validator("float8", mode="before")
    @classmethod
    def _float8_bool(cls, v: Any) -> Any:
        if isinstance(v, bool) or v in ("true", "false"):
            return "tensorwise" if v in (True, "true") else "none"
        return v

    @model_validator(mode="after")
    def _offload_needs_fsdp(self) -> TrainConfig:
        if self.cpu_offload and self.parallel != "fsdp":
            raise ValueError(
                f"train.cpu_offload=true needs train.parallel=fsdp (got train.parallel={self.parallel}); "
                "DDP keeps a full replica on every device"
            )
        if self.shard_frozen and self.parallel != "fsdp":
            raise ValueError(
                f"train.shard_frozen=true needs train.parallel=fsdp (got train.parallel={self.parallel}); "
                "under DDP every rank holds whole frozen parts"
            )
        return self


class EmaConfig(_Section):
    enabled: bool = True
    decay: float = Field(0.999, gt=0, lt=1, description="maximum decay")
    min_decay: float = Field(0.0, ge=0, lt=1)
    warmup: bool = True
    inv_gamma: float = Field(1.0, gt=0)
    power: float = Field(2 / 3, gt=0)
    update_after_step: int = Field(0, ge=0)


class CheckpointConfig(_Section):
    url: str | None = Field(None, description="any fsspec URL; default <run.dir>/checkpoints")
    every_steps: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        500, description="0 = only at the end; auto = from the measured save stall and the MTBF (docs/checkpoints.md)"
    )
    max_interval_minutes: float = Field(
        30.0, gt=0, description="with every_steps=auto: a durable checkpoint lands at least this often"
    )
    keep: int = Field(3, ge=1)
    keep_every_steps: int = Field(0, ge=0, description="0 = no milestones")
    # `async` is a Python keyword: the attribute is async_, the key stays `async`.
    async_: bool = Field(False, alias="async")
    storage_options: dict[str, Any] = Field(default_factory=dict)
    resume: bool = Field(
        True,
        description="resume from the newest valid checkpoint; false starts over, and exits 2 if the root holds "
        "another run's checkpoints (except in a torchrun restart of the job that wrote them: docs/checkpoints.md)",
    )
    lease: bool = Field(
        True,
        description="one trainer per checkpoint root: take an exclusive, renewed lease on it (<url>/lease.json); "
        "a second trainer exits 2 naming the holder (docs/checkpoints.md)",
    )
    lease_seconds: float = Field(
        30.0,
        ge=1,
        le=600,
        description="the lease lapses this long after its holder stopped renewing it (renewed every quarter of it); "
        "a new trainer finding a lease watches it this long before taking it over",
    )
    memory: bool = Field(
        False,
        description="memory tier: keep the newest snapshots in each node's shared memory, replicated to a buddy "
        "node, and resume from them after a worker crash or a node loss (docs/checkpoints.md)",
    )
    memory_every_steps: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        1, description="memory-tier snapshot interval; auto = from the measured snapshot cost and the MTBF"
    )
    memory_dir: str = Field(
        "/dev/shm/gentrain", description="node-local folder of the memory tier (shared memory that outlives workers)"
    )

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)


class SampleConfig(_Section):
    every_steps: int = Field(0, ge=0, description="0 = only at the end")
    num: int = Field(64, ge=1)
    inference_steps: int = Field(50, ge=1)
    scheduler: Literal["ddim", "dpm"] = "ddim"
    guidance_scale: float = Field(1.0, ge=0)
    use_ema: bool = True
    prompts: list[str] | None = Field(
        None,
        min_length=1,
        description="validation prompts: each a row of `num` previews at every_steps (fixed seed: column k draws "
        "the same noise in every row), sent to the trackers with the prompts as captions; null = held-out captions",
    )


class MetricsConfig(_Section):
    port: int = Field(0, ge=0, le=65535, description="0 = off")
    host: str = "0.0.0.0"
    linger_seconds: float = Field(0.0, ge=0, description="keep serving final values this long at exit")


class ElasticConfig(_Section):
    grace_seconds: float = Field(25.0, gt=0)
    collective_timeout_seconds: float = Field(
        600.0, ge=30, description="a hung collective (lost peer, stuck init) fails after this; torchrun restarts"
    )
    step_timeout_seconds: float = Field(
        25.0,
        ge=0,
        description="a training step that runs longer than this (or 5 x the mean step, if larger; saves, "
        "evaluations and compiles excluded) exits 3 so torchrun restarts: how a silent or lost peer is noticed "
        "with several processes; 0 = off",
    )
    phase_timeout_seconds: float = Field(
        300.0,
        ge=0,
        description="outside a training step (resume, saves, evaluations, the data agreement), one collective "
        "call that waits longer than this exits 3 so torchrun restarts: a silent peer noticed there too; above "
        "the longest wait a resume's verification or a synchronous save makes the other ranks do; 0 = off",
    )
    mtbf_hours: float | None = Field(
        None,
        gt=0,
        description="the job's mean time between failures, for auto checkpoint intervals; null = 8,090 GPU-hours "
        "(Meta: 7.9 h at 1,024 GPUs) / world size, updated by the failures the run sees",
    )


TRACKERS = ("tensorboard", "wandb", "mlflow")


class LogConfig(_Section):
    report_to: list[str] = Field(
        default_factory=list,
        description="trackers (accelerate's names): tensorboard, wandb, mlflow; `all` = those installed; a name "
        "or a list",
    )
    tensorboard: bool = Field(False, description="alias of report_to+=[tensorboard]")
    wandb: bool = Field(False, description="alias of report_to+=[wandb]")
    upload_run_dir: bool = Field(
        False, description="copy run.dir (logs, previews, tracker files) to <checkpoint.url>/run after each checkpoint"
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        if isinstance(value, str):  # `log.report_to=wandb`, `log.report_to=tensorboard,mlflow`
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list):
            unknown = [v for v in value if v not in (*TRACKERS, "all", "none")]
            if unknown:
                raise ValueError(f"unknown tracker(s) {unknown}; allowed: {', '.join(TRACKERS)}, all, none")
            value = [v for v in value if v != "none"]
        return value

    @property
    def trackers(self) -> list[str]:
        """The trackers asked for by name (report_to, then the aliases), without `all`; in a stable order."""
        asked = {*self.report_to, *(n for n in ("tensorboard", "wandb") if getattr(self, n))}
        return [n for n in TRACKERS if n in asked]

    @property
    def all_installed(self) -> bool:
        return "all" in self.report_to


class DataConfig(_Section):
    source: Literal["digits", "folder", "shards", "moving-digits", "video", "hf"] = "digits"
    path: str | None = Field(
        None,
        description="folder: images (a local folder or an fsspec URL); video: clips (recursive); hf: a "
        "save_to_disk folder, parquet file/glob/folder (local or an fsspec URL) or a local imagefolder",
    )
    caption_column: str = Field(
        "text",
        min_length=1,
        description="folder: the caption key of metadata.jsonl records (a .txt sidecar wins); hf: the caption "
        "column (the default `text` may be absent: no captions)",
    )
    hf_split: str = Field("train", min_length=1, description="hf: the split read (a DatasetDict's key)")
    image_column: str = Field("image", min_length=1, description="hf: the image column")
    label_column: str | None = Field(
        None, min_length=1, description="hf: the class label column (ClassLabel, int or str); null = no labels"
    )
    urls: str | list[str] | None = Field(
        None, description="shards: tar URLs/brace patterns on any fsspec store, or a shards.json list"
    )
    val_urls: str | list[str] | None = Field(None, description="shards: validation shards (else val_fraction)")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="shards, folder and hf URLs: passed to fsspec"
    )
    shard_window: int = Field(8, ge=0, description="shards: shards shuffled together per epoch; 0 = all")
    read_retries: int = Field(3, ge=0, description="shards: retries (exponential backoff) before a shard is skipped")
    shuffle_block: int = Field(
        8,
        ge=1,
        description="shards: runs of this many consecutive samples of a shard stay together in the shuffle "
        "(a batch of B draws from >= B/N runs, each read with one request); 1 = every sample on its own",
    )
    encoded: bool | None = Field(
        None,
        description="shards: true = they must be `gentrain data encode` latents, false = images (either mismatch "
        "exits 2); null = whatever their shards.json says",
    )
    read_merge_gap: int = Field(
        0, ge=0, description="shards: merge a step's ranges of one shard at most this many bytes apart into one read"
    )
    image_size: int = Field(16, ge=4, description="default 32 for moving-digits")
    channels: Literal[1, 3] = 1
    flip: bool = False
    val_fraction: float = Field(0.05, ge=0, lt=1)
    ledger: bool = Field(False, description="record consumed sample indices in run.dir/ledger")
    # A run whose data is mostly unreadable would otherwise train on zero-weight slots and exit 0.
    max_skipped_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="stop (exit 2, naming the first bad files) once more than this fraction of the samples "
        "consumed were unreadable, counted from the 32nd skipped sample on; 0 = at the first, 1 = never",
    )
    num_frames: int = Field(
        1, ge=1, description="video sources: frames per clip; batches are (N, T, C, H, W); image sources ignore it"
    )
    frame_stride: int = Field(1, ge=1, description="video sources: keep every k-th decoded frame")
    path_jitter: int | None = Field(
        0, ge=0, description="moving-digits: px a clip's path may lie off the canvas centre line; null = anywhere"
    )
    image_ratio: float = Field(
        0.0, ge=0, lt=1, description="video sources: share of every batch that is images (one-frame clips)"
    )
    image_source: Literal["digits", "folder"] = Field("digits", description="image_ratio > 0: where images come from")
    image_path: str | None = Field(None, description="image_source=folder: a folder of images")
    buckets: Literal["auto"] | list[tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]] | None = Field(
        None,
        description="folder, hf, shards: aspect-ratio buckets, a list of [height, width] or auto (image_size^2 "
        "pixels, sides multiples of bucket_step, ratio <= bucket_max_ratio; docs/data.md); null = square "
        "image_size crops",
    )
    bucket_step: int = Field(64, ge=1, description="buckets: every side a multiple of this (the model's factor)")
    bucket_max_ratio: float = Field(
        4.0, ge=1, le=64, description="buckets: auto's widest bucket, and images more extreme are skipped (counted)"
    )
    bucket_min_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="buckets: skip (and count) an image smaller than this fraction of its bucket's side (it would be "
        "upscaled more than 1/fraction); 0 = keep all",
    )
    crop: Literal["center", "random"] = Field(
        "center", description="folder: the crop to data.image_size or the bucket; random: from the sample's seed"
    )
    instance: str | None = Field(
        None,
        description="DreamBooth: the instance images folder (local or an fsspec URL; data.source=folder, it sets "
        "data.path); docs/tasks/pipelines.md",
    )
    instance_prompt: str | None = Field(
        None, description="DreamBooth: every instance image's caption (null: each image's own .txt/metadata)"
    )
    class_images: str | None = Field(
        None,
        description="DreamBooth prior preservation: the class images folder (`gentrain data class-images` fills "
        "it); each step's batch is half instance, half class images",
    )
    class_prompt: str | None = Field(
        None, description="DreamBooth: the class images' caption (and what generates them)"
    )

    @model_validator(mode="after")
    def _folder_needs_path(self) -> DataConfig:
        if self.source == "moving-digits":
            if "image_size" not in self.model_fields_set:
                self.__dict__["image_size"] = 32  # a 16 px digit needs room to move
            if self.image_size < 8:
                raise ValueError(
                    f"data.image_size={self.image_size}: data.source=moving-digits needs at least 8 "
                    "(the digit is half the canvas and must have room to move)"
                )
            if self.flip:
                raise ValueError(
                    "data.flip=true with data.source=moving-digits would mirror the motion the caption and "
                    "label name (left/right); set data.flip=false"
                )
        self._dreambooth()
        if self.source == "folder" and not self.path:
            raise ValueError("data.source=folder needs data.path (a folder of images)")
        if self.source == "hf" and not self.path:
            raise ValueError(
                "data.source=hf needs data.path (a save_to_disk folder, parquet files or a local imagefolder)"
            )
        if self.image_ratio > 0:
            if not (self.source in ("moving-digits", "video") or (self.source == "shards" and self.num_frames > 1)):
                raise ValueError(
                    f"data.image_ratio={self.image_ratio} mixes images into clip batches, but data.source="
                    f"{self.source} gives images; use a video source (moving-digits, video, or shards with "
                    "data.num_frames > 1) or set data.image_ratio=0"
                )
            if self.image_source == "folder" and not self.image_path:
                raise ValueError("data.image_source=folder needs data.image_path (a folder of images)")
        if self.source == "video" and not self.path:
            raise ValueError("data.source=video needs data.path (a folder of .gif/.mp4/.webm/.mkv/.mov clips)")
        if self.buckets is not None and (self.source not in ("folder", "hf", "shards") or self.num_frames > 1):
            raise ValueError(
                f"data.buckets is set but data.source={self.source}"
                f"{f' with data.num_frames={self.num_frames}' if self.num_frames > 1 else ''}: aspect-ratio buckets "
                "are for images (data.source=folder, hf or shards); unset data.buckets"
            )
        if self.source == "shards" and not self.urls:
            raise ValueError(
                "data.source=shards needs data.urls (e.g. s3://bucket/data/{000000..000099}.tar or .../shards.json)"
            )
        return self

    def _dreambooth(self) -> None:
        """data.instance is DreamBooth's name for data.path (one folder, never two); the class side needs its
        prompt and the instance folder; buckets and mixed clip batches are not DreamBooth's (yet)."""
        if self.instance is not None:
            if self.source != "folder":
                raise ValueError(
                    f"data.instance is an image folder but data.source={self.source}; set data.source=folder"
                )
            if self.path is not None and self.path != self.instance:
                raise ValueError(
                    f"data.instance={self.instance!r} and data.path={self.path!r}: data.instance is the run's image "
                    "folder (it sets data.path); set one of them"
                )
            self.__dict__["path"] = self.instance
        if self.class_images is not None:
            if self.instance is None:
                raise ValueError(
                    "data.class_images (prior preservation) needs data.instance (the instance images folder)"
                )
            if not self.class_prompt:
                raise ValueError(
                    "data.class_images needs data.class_prompt (the class images' caption, e.g. 'a photo of a dog')"
                )
        if self.instance_prompt is not None and self.instance is None:
            raise ValueError("data.instance_prompt needs data.instance (the instance images folder)")
        if self.instance is not None and self.buckets is not None:
            raise ValueError("data.instance (DreamBooth) with data.buckets is not supported yet: unset data.buckets")


class EvalConfig(_Section):
    """FID/KID of generated vs held-out real images (see trainer.eval)."""

    every_steps: int = Field(0, ge=0, description="0 = only `gentrain eval`")
    num: int = Field(256, ge=2, description="generated and real images compared")
    features: str = Field(
        "digits", description="digits (shipped), random (smoke tests only), inception, or a URL of a feature net"
    )
    features_url: str | None = Field(None, description="features=inception: the FID Inception weights (safetensors)")
    inference_steps: int | None = Field(None, ge=1, description="default: sample.inference_steps")
    kid_subset_size: int = Field(50, ge=2)


class OptimConfig(_Section):
    """Per-part overrides of the `train.*` optimizer settings; unset keys inherit them."""

    name: OptimizerName | None = Field(None, description="this part's optimizer (default: train.optimizer)")
    lr: Finite | None = Field(None, gt=0)
    betas: Betas | None = None
    weight_decay: Finite | None = Field(None, ge=0)
    eps: Finite | None = Field(None, gt=0)
    warmup_steps: int | None = Field(None, ge=0)
    lr_schedule: LrSchedule | None = None
    lr_num_cycles: int | None = Field(None, ge=1)
    lr_power: Finite | None = Field(None, gt=0)
    max_grad_norm: Finite | None = Field(None, gt=0)
    max_steps: int | None = Field(
        None, ge=1, description="the part stops learning at this many of its own steps (and its schedule ends there)"
    )


# A built-in task's name, or the import path of a task class (trainer.registry resolves both).
_TASK_NAME = re.compile(r"[a-z][a-z0-9-]*|[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


class Config(_Section):
    name: str = DEFAULT_PRESET
    task: str = "ddpm"
    # torch.manual_seed's range: a seed outside it fails deep in torch at the first step.
    seed: int = Field(0, ge=-(2**63), le=2**64 - 1)
    run: RunConfig = Field(default_factory=RunConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    ema: EmaConfig = Field(default_factory=EmaConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    optim: dict[str, OptimConfig] = Field(default_factory=dict, description="per-part optimizer overrides")
    # Validated by the task's own schema (trainer.registry); the typed object is `model_cfg`.
    model: dict[str, Any] = Field(default_factory=dict)
    _model_cfg: BaseModel | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _adamw8bit_not_sharded(self) -> Config:
        # torchao's AdamW8bit does step on FSDP2's DTensors, but its quantization blocks (256 values, one
        # scale each) are formed over each rank's local shard, so its state depends on the world size: the
        # sharded checkpoint format, which re-slices every tensor by its global shape to resume at any world
        # size, cannot slice or merge the blocks exactly. Until it can, FSDP runs keep float32 state.
        named = [f"optim.{p}.name" for p, o in self.optim.items() if o.name == "adamw8bit"]
        if self.train.optimizer == "adamw8bit":
            named.insert(0, "train.optimizer")
        if self.train.parallel == "fsdp" and named:
            raise ValueError(
                f"{named[0]}=adamw8bit needs train.parallel=ddp: under fsdp the 8-bit state is quantized per "
                "rank's shard, which the sharded checkpoints (resumable at any world size) cannot re-slice; "
                "use adamw with fsdp (train.cpu_offload=true moves its state to host memory)"
            )
        return self

    @field_validator("task")
    @classmethod
    def _task_names_a_task(cls, task: str) -> str:
        if not _TASK_NAME.fullmatch(task):
            raise PydanticCustomError(
                "task_name", "a built-in task name (e.g. ddpm, vqgan) or an import path package.module:ClassName"
            )
        return task

    def set_model_cfg(self, typed: BaseModel) -> None:
        """Take the task's typed `model.*` (from `trainer.registry.resolve_model`): `model` becomes its JSON
        form, so the config saved in checkpoints holds every default the task filled in."""
        self.model = typed.model_dump(mode="json")
        self._model_cfg = typed

    @property
    def model_cfg(self) -> Any:
        """The task's typed `model.*` section (see `set_model_cfg`)."""
        if self._model_cfg is None:
            raise RuntimeError("config was not resolved against its task; use trainer.registry.load_config")
        return self._model_cfg

    @property
    def run_dir(self) -> str:
        return self.run.dir or os.path.join("runs", self.name)

    @property
    def checkpoint_url(self) -> str:
        return self.checkpoint.url or os.path.join(self.run_dir, "checkpoints")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)
