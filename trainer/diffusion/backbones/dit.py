"""`kind: dit`: DiTTransformer2DModel, class-conditional adaLN-zero (Peebles & Xie 2023)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from trainer.diffusion.backbones.base import Backbone, TransformerConfig, per_sample


class DiTBackboneConfig(TransformerConfig):
    """`kind: dit`: class-conditional adaLN-zero transformer (unconditional models use one class)."""

    kind: Literal["dit"] = "dit"
    dropout: float = Field(0.0, ge=0, lt=1)


class DiTBackbone(Backbone):
    kind = "dit"
    Config = DiTBackboneConfig
    order = 10
    takes_labels = True
    stage_conditioning = "labels"  # diffusers' DiT takes a timestep and a class label, nothing else
    pipeline = "DiTPipeline"
    _unit_lists = ("transformer_blocks",)
    # diffusers' DiT conditions its output layer with `transformer_blocks[0].norm1.emb`, called after the last
    # block has run: with every block an FSDP unit, block 0 would have resharded by then (a mixed Tensor/DTensor
    # addmm, seen under torchrun). Block 0 stays a unit (sharded between steps, its gradient reduced in its own
    # backward) but keeps its weights gathered from its forward to its backward (FSDP2's
    # reshard_after_forward=False), so the second call uses them and its gradient joins block 0's. Chosen over
    # leaving block 0 to the root unit (same memory: one block whole from its forward to the end of backward,
    # but not a unit) and over an extra FSDP forward method (the call is to a submodule inside forward, not a
    # method of the part).
    _gathered_units = ("transformer_blocks.0",)
    # Each block's adaLN-zero (`norm1`: its timestep-and-label embedding and modulation) and the output layer.
    float8_per_sample = ("norm1", "proj_out")

    @classmethod
    def build(
        cls,
        c: DiTBackboneConfig,
        sample_size: int,
        channels: int,
        num_classes: int | None = None,
        in_channels: int | None = None,
    ) -> DiTBackbone:
        from diffusers.models.embeddings import LabelEmbedding
        from diffusers.models.transformers.dit_transformer_2d import DiTTransformer2DModel

        cls.check_build(c, sample_size, num_classes)
        model = DiTTransformer2DModel(
            num_attention_heads=c.num_attention_heads,
            attention_head_dim=c.attention_head_dim,
            in_channels=in_channels or channels,
            out_channels=channels,
            num_layers=c.num_layers,
            dropout=c.dropout,
            sample_size=sample_size,
            patch_size=c.patch_size,
            # diffusers' DiT is always class-conditional; an unconditional one is a single class.
            num_embeds_ada_norm=num_classes or 1,
        )
        # diffusers drops labels itself in train mode, drawing from the global RNG in every block; gentrain
        # draws dropout per sample (trainer.randomness) and passes the null row, `num_classes`, which the
        # tables keep (they were built with dropout, hence num_classes + 1 rows).
        for m in model.modules():
            if isinstance(m, LabelEmbedding):
                m.dropout_prob = 0.0
        accepts = {"labels"} if num_classes else set()
        return cls(model, accepts, accepts)

    def call(self, model, x, t, cond):
        labels = cond.get("labels")
        if labels is None:
            labels = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        return model(x, per_sample(t, x), class_labels=labels).sample


BACKBONE = DiTBackbone
