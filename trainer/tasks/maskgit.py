"""MaskGIT task (`task: maskgit`): a bidirectional transformer over a frozen VQ-GAN's codes (Chang et al. 2022).

The tokenizer is the `generator` part of a `vqgan` run, loaded from
`model.tokenizer.url` (a run root or one step dir, on any fsspec store; EMA
weights by default), digest-pinned by the engine and never saved here.
Training masks a cosine-scheduled fraction of each image's tokens and
predicts them; sampling decodes iteratively in parallel (`sample.inference_steps`
decoding steps) with temperature, choice-temperature annealing and
classifier-free guidance, then decodes the codes through the tokenizer.

Conditioning: the task gathers a `Condition` (class labels, caption embeddings
from the shared frozen text encoder, which samples are dropped for guidance);
the transformer turns it into context tokens prepended to the sequence, inside
its forward, so DDP and FSDP see every parameter use.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import blake3
import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from trainer.conditioning.text import TextEncoder, TextEncoderConfig
from trainer.diffusion.guidance import check_num_classes, default_labels, guide, labels_or_null
from trainer.errors import ConfigError
from trainer.randomness import Stream, sample_draws
from trainer.registry import task_class
from trainer.tasks.base import Batch, FrozenSource, Loss, Phase, PreviewContext, StepInfo, Task, TaskContext
from trainer.tasks.sampling import SampleRequest
from trainer.tasks.video_tokenizer import VideoTokenizerTask
from trainer.tasks.vqgan import VQGANTask, tokenizer_geometry

log = logging.getLogger(__name__)


class TokenizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="checkpoint root or step dir of a vqgan run (any fsspec URL)")
    use_ema: bool = True


class MaskGITConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokenizer: TokenizerConfig
    # Expected tokenizer geometry; null = whatever the tokenizer has. Set them to have a mismatch refused.
    codebook_size: int | None = Field(None, ge=2)
    latent_size: int | None = Field(None, ge=1, description="side of the token grid")
    dim: int = Field(256, ge=8)
    depth: int = Field(4, ge=1)
    heads: int = Field(4, ge=1)
    mlp_ratio: float = Field(4.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    label_smoothing: float = Field(0.1, ge=0, lt=1)
    num_classes: int | None = Field(None, ge=2, description="class-conditional when set")
    text: TextEncoderConfig | None = Field(None, description="text-conditional when set (captions of the data)")
    cond_drop_prob: float = Field(0.1, ge=0, lt=1, description="condition dropout for classifier-free guidance")
    token_cache: str | None = Field(
        None, description="local folder caching each image's tokens (keyed by tokenizer digest and image content)"
    )
    positions: Literal["learned", "axial"] = Field(
        "learned",
        description="learned: an embedding per token position; axial: the sum of one per axis of the token grid "
        "(slice, row, column), so a relation such as 'the same place one slice earlier' is learned once",
    )
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the token draws")
    choice_temperature: float = Field(4.5, ge=0, description="randomness of which tokens stay masked, annealed to 0")


def cosine_mask_ratio(r: torch.Tensor) -> torch.Tensor:
    """MaskGIT's schedule: the fraction of tokens masked at progress r in [0, 1)."""
    return torch.cos(r * math.pi / 2)


class TokenCache:
    """Each image's tokens on local disk, so later epochs skip the tokenizer.

    Keyed by the tokenizer's weights digest (a folder per tokenizer) and a
    BLAKE3 hash of the image tensor (so augmentations such as flips get their
    own entry). The frozen tokenizer is deterministic in eval mode, so cached
    and fresh tokens are identical and exact resume does not depend on the cache.
    """

    def __init__(self, root: str, digest: str):
        self.dir = os.path.join(root, digest.replace(":", "-"))
        os.makedirs(self.dir, exist_ok=True)
        self.hits = self.misses = self.kept_in_step = 0

    def _path(self, image: torch.Tensor) -> str:
        data = image.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
        return os.path.join(self.dir, blake3.blake3(data).hexdigest()[:32] + ".npy")

    def tokens(
        self, images: torch.Tensor, encode, any_rank: Callable[[bool, torch.device], bool] | None = None
    ) -> torch.Tensor:
        """`any_rank` (`TaskContext.services.any_rank`): given when `encode` is a collective every rank must
        join (a sharded tokenizer, train.shard_frozen); a rank whose images are all cached encodes one
        anyway (and drops the result) when another rank has misses, or the ranks would wait on each other
        forever."""
        paths = [self._path(x) for x in images]
        found = [np.load(p) if os.path.exists(p) else None for p in paths]
        todo = [i for i, t in enumerate(found) if t is None]
        if any_rank is not None:  # every rank asks, misses or not: the question is itself a collective
            if any_rank(bool(todo), images.device) and not todo:
                encode(images[:1])
                if not self.kept_in_step:
                    log.info(
                        "token cache: encoding a cached image to join the sharded tokenizer's all-gathers "
                        "of ranks with misses (logged once)"
                    )
                self.kept_in_step += 1
        if todo:
            fresh = encode(images[todo]).cpu().numpy().astype(np.int32)
            for i, t in zip(todo, fresh, strict=True):
                tmp = f"{paths[i]}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    np.save(f, t)
                os.replace(tmp, paths[i])  # atomic: concurrent ranks may write the same entry
                found[i] = t
        self.hits += len(paths) - len(todo)
        self.misses += len(todo)
        return torch.from_numpy(np.stack(found)).to(images.device, torch.long)


@dataclass
class Condition:
    """What a MaskGIT sample is conditioned on, before the transformer embeds it: class labels (N,) (-1 for
    none), the frozen text encoder's caption token embeddings (N, Lt, width) and mask (N, Lt), and which
    samples get the null condition (N,) bool (classifier-free guidance), or None."""

    labels: torch.Tensor | None = None
    text: torch.Tensor | None = None
    text_mask: torch.Tensor | None = None
    drop: torch.Tensor | None = None


class MaskTransformer(nn.Module):
    """Token + position embeddings, condition tokens in front, pre-norm encoder, logits over the codebook."""

    def __init__(self, cfg: MaskGITConfig, num_codes: int, layout: tuple[int, ...], cond_tokens: int):
        super().__init__()
        self.num_codes = num_codes
        self.mask_id = num_codes
        self.layout = layout
        self.tokens = nn.Embedding(num_codes + 1, cfg.dim)
        if cfg.positions == "axial":  # condition tokens keep one embedding each
            self.pos = nn.Parameter(torch.zeros(1, cond_tokens, cfg.dim)) if cond_tokens else None
            self.axes = nn.ParameterList(nn.Parameter(torch.zeros(n, cfg.dim)) for n in layout)
        else:
            self.pos = nn.Parameter(torch.zeros(1, cond_tokens + math.prod(layout), cfg.dim))
            self.axes = None
        self.classes = nn.Embedding(cfg.num_classes + 1, cfg.dim) if cfg.num_classes else None
        # One scale for codes, classes and positions (MaskGIT's BERT init): torch's N(0, 1) embeddings would
        # drown the positions at the pre-norm input, and learning where a token is would take thousands of steps.
        extra = [*(self.axes or []), *([self.classes.weight] if self.classes is not None else [])]
        for emb in (self.tokens.weight, *([self.pos] if self.pos is not None else []), *extra):
            nn.init.trunc_normal_(emb, std=0.02)
        if cfg.text is not None:  # caption token embeddings projected to context tokens; a learned null caption
            self.text_proj = nn.Linear(cfg.text.width, cfg.dim)
            self.null_text = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        layer = nn.TransformerEncoderLayer(
            cfg.dim,
            cfg.heads,
            int(cfg.dim * cfg.mlp_ratio),
            dropout=cfg.dropout,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, num_codes)

    def context(self, cond: Condition) -> tuple[torch.Tensor, torch.Tensor]:
        """Context tokens (N, Lc, dim) and their mask (N, Lc): a class token and/or the caption's projected
        token embeddings, the null class / null caption where `cond.drop` (classifier-free guidance)."""
        parts, masks = [], []
        if cond.labels is not None:
            drop = cond.drop if cond.drop is not None else torch.zeros_like(cond.labels, dtype=torch.bool)
            labels = labels_or_null(cond.labels, drop, self.classes.num_embeddings - 1)
            parts.append(self.classes(labels)[:, None])
            masks.append(torch.ones(len(labels), 1, dtype=torch.bool, device=labels.device))
        if cond.text is not None:
            tokens, mask = self.text_proj(cond.text), cond.text_mask.bool()
            if cond.drop is not None:
                null = self.null_text.expand(len(tokens), tokens.shape[1], -1)
                tokens = torch.where(cond.drop[:, None, None], null, tokens)
                first = torch.zeros_like(mask)
                first[:, 0] = True
                mask = torch.where(cond.drop[:, None], first, mask)
            parts.append(tokens)
            masks.append(mask)
        return torch.cat(parts, dim=1), torch.cat(masks, dim=1)

    def forward(
        self, tokens: torch.Tensor, cond: Condition | None = None, token_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens (N, L) with `mask_id` where masked; `cond` the condition (None: unconditional), `token_mask`
        (N, L) True where a token is real (padding of either is not attended, so padded tokens change
        nothing for the others) -> logits (N, L, K). The context is built here, inside forward, so that
        DDP and FSDP see every parameter use (FSDP gathers weights only in forward)."""
        context, context_mask = self.context(cond) if cond is not None else (None, None)
        x = self.tokens(tokens)
        keep = token_mask.bool() if token_mask is not None else None
        if context is not None:
            x = torch.cat([context.to(x.dtype), x], dim=1)
            if context_mask is not None or keep is not None:
                ctx_keep = context_mask if context_mask is not None else torch.ones(context.shape[:2])
                tok_keep = keep if keep is not None else torch.ones(tokens.shape)
                keep = torch.cat([ctx_keep.to(tokens.device, torch.bool), tok_keep.to(tokens.device, torch.bool)], 1)
        pad = None if keep is None else ~keep
        x = self.encoder(x + self.positions()[:, : x.shape[1]], src_key_padding_mask=pad)
        return self.head(self.norm(x[:, x.shape[1] - tokens.shape[1] :]))

    def positions(self) -> torch.Tensor:
        """(1, condition tokens + prod(layout), dim): a shorter sequence (fewer slices) takes a prefix."""
        if self.axes is None:
            return self.pos
        grid = 0
        for a, emb in enumerate(self.axes):
            shape = [1] * len(self.layout) + [emb.shape[-1]]
            shape[a] = self.layout[a]
            grid = grid + emb.view(shape)
        grid = grid.reshape(1, -1, self.axes[0].shape[-1])
        return grid if self.pos is None else torch.cat([self.pos, grid], dim=1)


def check_tokenizer_geometry(
    c: MaskGITConfig, ctx: TaskContext, source: Any, url: str, geometry: tuple[int, int]
) -> tuple[int, int]:
    """The transformer's vocabulary, image size and channels against the tokenizer run's (`geometry`:
    its codebook size and token grid side); the expected `model.codebook_size` / `model.latent_size`
    when set. Returns (codebook size, token grid side)."""
    num_codes, tok_grid = geometry
    if c.codebook_size is not None and c.codebook_size != num_codes:
        raise ConfigError(
            f"model.codebook_size={c.codebook_size} but the tokenizer at {url} has {num_codes} codes: "
            "the transformer's vocabulary must equal the tokenizer's codebook. Set model.codebook_size="
            f"{num_codes} (or leave it unset), or point model.tokenizer.url at a matching tokenizer."
        )
    ds = source.model_cfg.downsample
    grid = ctx.image_size // ds
    if ctx.image_size % ds or grid != tok_grid:
        raise ConfigError(
            f"data.image_size={ctx.image_size} gives a {grid}x{grid} token grid but the tokenizer at {url} "
            f"was trained on {source.data.image_size}px images ({tok_grid}x{tok_grid} tokens). Use "
            f"data.image_size={source.data.image_size}."
        )
    if c.latent_size is not None and c.latent_size != grid:
        raise ConfigError(
            f"model.latent_size={c.latent_size} but the tokenizer at {url} makes a {grid}x{grid} token grid. "
            f"Set model.latent_size={grid} (or leave it unset)."
        )
    if source.data.channels != ctx.channels:
        raise ConfigError(
            f"data.channels={ctx.channels} but the tokenizer at {url} encodes {source.data.channels}-channel images"
        )
    return num_codes, grid


class MaskGITTask(Task):
    ModelConfig = MaskGITConfig
    cfg: MaskGITConfig

    def __init__(self, model_cfg: MaskGITConfig, ctx: TaskContext):
        super().__init__(model_cfg, ctx)
        check_num_classes(model_cfg.num_classes, ctx.num_classes)
        self.num_codes = 0
        self.grid = 0
        self.cache: TokenCache | None = None
        self.text = None
        if model_cfg.text is not None:
            self.text = TextEncoder(model_cfg.text, ctx.storage_options)

    @classmethod
    def trainable_part_names(cls, model_cfg: MaskGITConfig) -> list[str]:
        return ["transformer"]

    def frozen_sources(self) -> dict[str, FrozenSource]:
        t = self.cfg.tokenizer
        return {"tokenizer": FrozenSource(t.url, part="generator", use_ema=t.use_ema)}

    def build(self, frozen) -> dict[str, nn.Module]:
        source = frozen["tokenizer"].config
        tok_task = task_class(source.task)
        self.num_codes, self.grid = self._check_tokenizer(tok_task, source, frozen["tokenizer"].record["url"])
        c = self.cfg
        if c.token_cache:
            self.cache = TokenCache(c.token_cache, frozen["tokenizer"].record["digest"])
        tokenizer = tok_task(source.model_cfg, self._tokenizer_context(source)).build({})["generator"]
        cond_tokens = (1 if c.num_classes else 0) + (c.text.tokens if c.text else 0)
        transformer = MaskTransformer(c, self.num_codes, self.token_layout(), cond_tokens)
        return {"tokenizer": tokenizer, "transformer": transformer}

    def _tokenizer_context(self, source: Any) -> TaskContext:
        return self.ctx

    def _check_tokenizer(self, tok_task: type, source: Any, url: str) -> tuple[int, int]:
        """(codebook size, token grid side) of the tokenizer run `source`; ConfigError on any mismatch."""
        if not issubclass(tok_task, VQGANTask) or issubclass(tok_task, VideoTokenizerTask):
            raise ConfigError(f"model.tokenizer.url={url}: a {source.task!r} run, not a vqgan tokenizer")
        return check_tokenizer_geometry(self.cfg, self.ctx, source, url, tokenizer_geometry(source))

    def token_layout(self, frames: int | None = None) -> tuple[int, ...]:
        """Shape of one sample's token grid; images take no `frames` (see `sample_accepts`)."""
        return (self.grid, self.grid)

    # ---- conditioning
    @property
    def conditional(self) -> bool:
        return self.cfg.num_classes is not None or self.text is not None

    def condition(
        self, labels: torch.Tensor | None, captions: list[str] | None, drop: torch.Tensor | None, device
    ) -> Condition | None:
        """The transformer's condition: class labels and/or the captions' text embeddings (the shared frozen
        text encoder, outside the trained parts). `drop` marks samples given the null condition."""
        if not self.conditional:
            return None
        cond = Condition(labels=labels if self.cfg.num_classes is not None else None, drop=drop)
        if self.text is not None:
            if captions is None:
                raise ConfigError("model.text is set but the data has no captions (.txt beside images, or shards' txt)")
            emb = self.text.encode(captions, device)
            cond.text, cond.text_mask = emb.tokens, emb.mask.bool()
        return cond

    # ---- training
    def forward(self, modules, batch: Batch, step: int) -> dict[str, Any]:
        def encode(x: torch.Tensor) -> torch.Tensor:  # FSQ and LFQ give int32 codes; the losses want int64
            return modules["tokenizer"].encode_indices(x).flatten(1).long()

        if self.cache is None:
            return {"tokens": encode(batch.images)}
        services = self.ctx.services
        together = services.calls_are_collective(modules["tokenizer"])
        return {"tokens": self.cache.tokens(batch.images, encode, services.any_rank if together else None)}

    def token_mask(self, batch: Batch, tokens: torch.Tensor) -> torch.Tensor | None:
        """(N, L) True for real tokens, None when all are (images; videos without padding frames)."""
        return None

    def _masked(
        self, tokens: torch.Tensor, step: int, positions: list[int], real: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample cosine-scheduled masks over the real tokens, drawn from (seed, step, position): exact
        on resume."""
        n, length = tokens.shape
        device = tokens.device
        draws = sample_draws(self.seed, step, positions, Stream.MASKGIT, device=device)
        r = draws.rand()
        drop = draws.rand() < self.cfg.cond_drop_prob
        scores = draws.rand((length,))
        count = torch.full((n,), length, device=device) if real is None else real.sum(1)
        if real is not None:  # padding ranks after every real token, so it is never masked
            scores = torch.where(real, scores, 2.0)
        num_masked = (cosine_mask_ratio(r) * count).ceil().clamp(min=1).minimum(count).long()
        ranks = scores.argsort(dim=1).argsort(dim=1)
        return ranks < num_masked[:, None], drop

    def _token_loss(self, modules, batch: Batch, tokens: torch.Tensor, step: int, smoothing: float):
        real = self.token_mask(batch, tokens)
        mask, drop = self._masked(tokens, step, batch.positions, real)
        inputs = torch.where(mask, self.num_codes, tokens)
        cond = self.condition(batch.labels, batch.captions, drop, tokens.device)
        logits = modules["transformer"](inputs, cond, real).float()
        ce = F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none", label_smoothing=smoothing)
        m = mask.float()
        count = m.sum(1).clamp(min=1)  # 0 only for an unreadable sample (no real tokens, weight 0)
        per_sample = (ce * m).sum(1) / count
        acc = ((logits.argmax(-1) == tokens).float() * m).sum(1) / count
        return per_sample, acc

    def loss(self, phase: Phase, modules, batch: Batch, outputs, info: StepInfo) -> Loss:
        ce, acc = self._token_loss(modules, batch, outputs["tokens"], info.step, self.cfg.label_smoothing)
        return Loss(ce, {"masked_accuracy": acc.detach()})

    def validate(self, modules, batch: Batch) -> dict[str, torch.Tensor]:
        tokens = self.forward(modules, batch, -1)["tokens"]
        ce, acc = self._token_loss(modules, batch, tokens, -1, 0.0)
        return {"token_ce": ce, "masked_accuracy": acc}

    def previews(self, modules, ctx: PreviewContext) -> dict[str, torch.Tensor]:
        """Samples; a text-conditional model draws the captions of the held-out batch."""
        prompts = None
        if self.text is not None and ctx.batch is not None and ctx.batch.captions:
            caps = ctx.batch.captions
            prompts = [caps[i % len(caps)] for i in range(ctx.num)]
        with ctx.preferred_weights():
            return {"samples": self.sample(modules, ctx.request(prompts=prompts), ctx.device)}

    # ---- sampling
    def sample_accepts(self) -> frozenset[str]:
        c = self.cfg
        conditions = {"labels": c.num_classes is not None, "prompts": self.text is not None}
        guided = {"guidance_scale"} if self.conditional else set()
        return frozenset(
            {
                "inference_steps",
                "temperature",
                "choice_temperature",
                *guided,
                *(k for k, on in conditions.items() if on),
            }
        )

    @torch.no_grad()
    def sample(self, modules: Mapping[str, nn.Module], request: SampleRequest, device: torch.device) -> torch.Tensor:
        """Iterative parallel decoding: at step t keep the most confident predictions and re-mask the rest,
        `L * cos(pi/2 * t/T)` of them, with Gumbel noise on the confidences annealed to zero. `frames`:
        video models only (see `token_layout`)."""
        transformer = modules["transformer"]
        num, labels, prompts, frames = request.num, request.labels, request.prompts, request.frames
        temperature = request.option("temperature", self.cfg.temperature)
        choice_temperature = request.option("choice_temperature", self.cfg.choice_temperature)
        guidance_scale = request.option("guidance_scale", 1.0)
        g = torch.Generator().manual_seed(request.seed)
        layout = self.token_layout(frames)
        length = math.prod(layout)
        tokens = torch.full((num, length), self.num_codes, dtype=torch.long)
        cond = uncond = None
        if self.conditional:
            if labels is None:
                labels = default_labels(num, self.cfg.num_classes or 1)
            labels = labels.to(device)
            if self.text is not None and prompts is None:
                prompts = [""] * num
            cond = self.condition(labels, prompts, None, device)
            uncond = replace(cond, drop=torch.ones(num, dtype=torch.bool, device=device))
        guided = cond is not None and guidance_scale != 1.0
        steps = max(1, request.option("inference_steps", 12))
        for t in range(steps):
            request.check_between_steps()
            x = tokens.to(device)
            logits = transformer(x, cond).float()
            if guided:
                uncond_logits = transformer(x, uncond).float()
                # The one guidance formula, uncond + s (cond - uncond); maskgit wrote it as cond + (s - 1)(cond -
                # uncond) before issue 25: the same logits up to rounding in their last bit.
                logits = guide(logits, uncond_logits, guidance_scale)
            logits = logits.cpu()
            probs = F.softmax(logits / temperature, dim=-1)
            drawn = torch.multinomial(probs.view(-1, self.num_codes), 1, generator=g).view(num, length)
            unknown = tokens == self.num_codes
            drawn = torch.where(unknown, drawn, tokens)
            confidence = torch.gather(probs, -1, drawn[..., None])[..., 0].clamp(min=1e-20).log()
            confidence = torch.where(unknown, confidence, torch.inf)
            progress = (t + 1) / steps
            remask = int(math.floor(length * float(cosine_mask_ratio(torch.tensor(progress)))))
            remask = min(remask, int(unknown.sum(1).min()) - 1) if t < steps - 1 else 0
            if remask > 0:
                u = torch.rand(confidence.shape, generator=g).clamp(1e-20, 1 - 1e-7)
                gumbel = -torch.log(-torch.log(u))
                noisy = confidence + choice_temperature * (1 - progress) * gumbel
                cut = noisy.sort(dim=1).values[:, remask - 1 : remask]
                drawn = torch.where(noisy <= cut, self.num_codes, drawn)
            tokens = drawn
        return self.decode_tokens(modules, tokens.view(num, *layout).to(device), frames)

    def decode_tokens(self, modules: Mapping[str, nn.Module], tokens: torch.Tensor, frames: int | None) -> torch.Tensor:
        """Token grids (N, *token_layout) -> media in [0, 1] on CPU, through the frozen tokenizer."""
        return ((modules["tokenizer"].decode_indices(tokens).float() + 1) / 2).cpu()


TASK = MaskGITTask
