"""Conditioning shared by tasks: a frozen text encoder (captions -> embeddings, cached on disk)."""

from trainer.conditioning.text import TextEmbeddings, TextEncoder, TextEncoderConfig

__all__ = ["TextEmbeddings", "TextEncoder", "TextEncoderConfig"]
