"""The skeleton the MaskGIT tasks share (`maskgit`, `video-maskgit`): not a task itself.

A bidirectional transformer (trainer/models/maskgit.py, Chang et al. 2022) over the codes of a frozen
tokenizer, the `generator` part of another run loaded from `model.tokenizer.url` (a run root or one step dir,
on any fsspec store; EMA weights by default), digest-pinned by the engine and never saved here. The source
run's task declares what its generator is (`Task.frozen_kind`); each MaskGIT task names the kind it takes
(`tokenizer_kind`) and its token layout. Training masks a cosine-scheduled fraction of each sample's tokens
and predicts them; sampling decodes iteratively in parallel (`sample.inference_steps` decoding steps) with
temperature, choice-temperature annealing and classifier-free guidance, then decodes the codes through the
tokenizer.

Conditioning: the task gathers a `Condition` (class labels, caption embeddings from the shared frozen text
encoder, which samples are dropped for guidance); the transformer turns it into context tokens prepended to
the sequence, inside its forward, so DDP and FSDP see every parameter use.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from trainer.conditioning.guidance import check_num_classes, default_labels, guide
from trainer.conditioning.text import TextEncoder
from trainer.errors import ConfigError
from trainer.models.maskgit import Condition, MaskGITConfig, MaskTransformer, TokenCache, cosine_mask_ratio
from trainer.models.quantize import tokenizer_geometry
from trainer.randomness import Stream, sample_draws
from trainer.task_types import frozen_kind_of
from trainer.tasks.base import Batch, FrozenSource, Loss, Phase, PreviewContext, StepInfo, Task, TaskContext
from trainer.tasks.sampling import SampleRequest


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


class MaskedTokenTask(Task):
    """A masked-token transformer over a frozen tokenizer's codes; subclasses name the tokenizer kind they
    take (`tokenizer_kind`, a source task's `frozen_kind`) and their `token_layout`."""

    ModelConfig = MaskGITConfig
    cfg: MaskGITConfig
    tokenizer_kind: ClassVar[str]
    tokenizer_name: ClassVar[str]  # what a refusal calls the runs of that kind

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
        self.num_codes, self.grid = self._check_tokenizer(source, frozen["tokenizer"].record.url)
        c = self.cfg
        if c.token_cache:
            self.cache = TokenCache(c.token_cache, frozen["tokenizer"].record.digest)
        tokenizer = self.build_tokenizer(source)
        cond_tokens = (1 if c.num_classes else 0) + (c.text.tokens if c.text else 0)
        transformer = MaskTransformer(c, self.num_codes, self.token_layout(), cond_tokens)
        return {"tokenizer": tokenizer, "transformer": transformer}

    def build_tokenizer(self, source: Any) -> nn.Module:
        """The frozen tokenizer's generator, built from its run's config `source` (models/, not its task)."""
        raise NotImplementedError

    def _check_tokenizer(self, source: Any, url: str) -> tuple[int, int]:
        """(codebook size, token grid side) of the tokenizer run `source`; ConfigError on any mismatch."""
        if frozen_kind_of(source) != self.tokenizer_kind:
            raise ConfigError(f"model.tokenizer.url={url}: a {source.task!r} run, not a {self.tokenizer_name}")
        return check_tokenizer_geometry(self.cfg, self.ctx, source, url, tokenizer_geometry(source))

    def token_layout(self, frames: int | None = None) -> tuple[int, ...]:
        """Shape of one sample's token grid."""
        raise NotImplementedError

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
        prompts = ctx.held_out_prompts() if self.text is not None else None
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
