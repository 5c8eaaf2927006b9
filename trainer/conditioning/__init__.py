"""Conditioning shared by tasks: a frozen text encoder (captions -> embeddings, cached on disk: text.py,
text_models.py), the decoders' frozen image encoder (image.py) on the digits feature CNN shipped beside it
(feature_cnn.py, also FID/KID's feature space), and classifier-free guidance with the class-label helpers
(guidance.py: diffusion and MaskGIT alike)."""

from trainer.conditioning.text import TextEmbeddings, TextEncoder, TextEncoderConfig

__all__ = ["TextEmbeddings", "TextEncoder", "TextEncoderConfig"]
