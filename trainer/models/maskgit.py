"""MaskGIT's model (Chang et al. 2022): the bidirectional masked-token transformer with its condition tokens,
the cosine masking schedule, the condition it embeds and the local token cache (`task: maskgit` and
`task: video-maskgit`, trainer/tasks/base_maskgit.py)."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import blake3
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from trainer.conditioning.guidance import labels_or_null
from trainer.conditioning.text import TextEncoderConfig

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
