"""Latent diffusion's first stage (`model.autoencoder`): a frozen KL autoencoder the denoiser works beneath.

The autoencoder is a frozen part named `autoencoder`, loaded by the engine like MaskGIT's tokenizer (see
`trainer.runs.load_frozen`): from a gentrain `autoencoder` run (a run root or one step dir;
EMA weights by default; its measured `scaling_factor` buffer comes with the weights) or from a diffusers
`AutoencoderKL` folder (config.json + diffusion_pytorch_model.safetensors, e.g. Stable Diffusion's VAE; its
`scaling_factor` and `shift_factor` are read from config.json), on any fsspec store; an image VQ-GAN run
works too (LDM's VQ setting: the diffusion learns the encoder's latents before quantization, scale 1, and
decoding quantizes them first). Which of the two a run is, its task declares (`Task.frozen_kind`:
"kl-autoencoder" or "image-tokenizer"); the modules are trainer/models/autoencoder.py and vqgan.py. Either way it is
digest-pinned in every checkpoint (a changed digest at resume exits 2), never optimized and never saved.

Latents are `(z - shift) * scale`, z a posterior sample `mean + std * eps` (`sample_posterior: true`, the
default, as LDM, DiT and diffusers' training scripts do) or the posterior mean. eps is drawn per sample from
the counter-based stream `Stream.AUTOENCODER`, keyed by the step and the sample's place in the global batch,
so a resumed run (at any world size) draws what an uninterrupted one would. Decoding is `decode(z / scale +
shift)`. `model.autoencoder.cache` keeps each image's posterior (mean and std) on local disk, keyed by the
autoencoder's digest and the image tensor's bytes: the frozen encoder is deterministic in eval mode, so a
cached posterior is the fresh one and the cache never changes what a run trains.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from torch import nn

from trainer.diffusion.config import PART, LatentAutoencoderConfig, frozen_source
from trainer.errors import ConfigError
from trainer.models.autoencoder import KLAutoencoder
from trainer.models.export import plain_autoencoder_kl
from trainer.models.vqgan import VQAutoencoder
from trainer.randomness import Stream, sample_draws
from trainer.task_types import FrozenWeights, frozen_kind_of

__all__ = ["PART", "LatentAutoencoderConfig", "LatentCache", "LatentSpace", "frozen_source"]

log = logging.getLogger(__name__)


class FolderAutoencoderKL(AutoencoderKL):
    """A diffusers AutoencoderKL whose state dict is the folder's; its latent scale and shift are config.json's
    (plain floats, not saved: the folder's digest pins them)."""

    @property
    def latent_scale(self) -> float:
        return float(self.config.scaling_factor if self.config.scaling_factor is not None else 1.0)

    @property
    def latent_shift(self) -> float:
        shift = getattr(self.config, "shift_factor", None)
        return float(shift) if shift is not None else 0.0


@dataclass
class Geometry:
    in_channels: int  # image channels the autoencoder encodes
    latent_channels: int
    downsample: int


def _frozen_kind(config: Any) -> str | None:
    """What the source run's generator is, as its model config declares (`Task.frozen_kind`)."""
    return frozen_kind_of(config)


def _geometry(weights: FrozenWeights, url: str) -> Geometry:
    config = weights.config
    if isinstance(config, dict):  # a diffusers folder's config.json
        blocks = config.get("block_out_channels") or [1]
        return Geometry(
            int(config.get("in_channels", 3)), int(config.get("latent_channels", 4)), 2 ** (len(blocks) - 1)
        )
    if _frozen_kind(config) not in ("kl-autoencoder", "image-tokenizer"):
        raise ConfigError(
            f"model.autoencoder.url={url}: a {config.task!r} run, not an autoencoder (train one with the "
            "digits-autoencoder preset or task: autoencoder) or an image VQ-GAN, nor a diffusers AutoencoderKL folder"
        )
    m = config.model_cfg
    return Geometry(config.data.channels, m.latent_channels, m.downsample)


class LatentSpace:
    """The frozen autoencoder's geometry and the encode/decode of the diffusion task's latent space."""

    def __init__(
        self,
        c: LatentAutoencoderConfig,
        weights: FrozenWeights,
        image_size: int,
        channels: int,
        seed: int,
        services: Any = None,  # TaskContext.services: asked whether calls to a module are collective
        encoding: Any = None,  # TaskContext.encoding: an EncodedSettings (the data layer's), read by attribute
    ):
        self.cfg = c
        self.encoding = encoding  # the data are `gentrain data encode` latents: the encoder is never built
        self.services = services
        self.weights = weights
        self.seed = seed
        url = weights.record.url
        g = _geometry(weights, url)
        if channels != g.in_channels:
            raise ConfigError(
                f"data.channels={channels} but the autoencoder at {url} encodes {g.in_channels}-channel images"
            )
        if image_size % g.downsample:
            raise ConfigError(
                f"data.image_size={image_size} is not divisible by the downsampling factor {g.downsample} of the "
                f"autoencoder at {url}: use a multiple of {g.downsample}"
            )
        side = image_size // g.downsample
        if c.latent_channels is not None and c.latent_channels != g.latent_channels:
            raise ConfigError(
                f"model.autoencoder.latent_channels={c.latent_channels} but the autoencoder at {url} has "
                f"{g.latent_channels} latent channels: set model.autoencoder.latent_channels={g.latent_channels} "
                "(or leave it unset), or point model.autoencoder.url at a matching autoencoder"
            )
        if c.latent_size is not None and c.latent_size != side:
            raise ConfigError(
                f"model.autoencoder.latent_size={c.latent_size} but data.image_size={image_size} through the "
                f"autoencoder at {url} (downsampling factor {g.downsample}) gives {side}x{side} latents: set "
                f"model.autoencoder.latent_size={side} (or leave it unset), or data.image_size="
                f"{c.latent_size * g.downsample}"
            )
        self.geometry = g
        self.side = side
        self.shape = (g.latent_channels, side, side)
        self.cache = LatentCache(c.cache, weights.record.digest) if c.cache and encoding is None else None
        if encoding is not None:
            self._check_encoding(encoding, url)

    def _check_encoding(self, encoding: Any, url: str) -> None:
        """Encoded shards must come from this very autoencoder (digest) at this geometry: exit 2 naming both."""
        made = encoding.autoencoder
        if made.digest != self.weights.record.digest:
            raise ConfigError(
                f"data.urls: the shards were encoded by the autoencoder {made.url} ({made.digest}), but "
                f"model.autoencoder.url={self.cfg.url} is {url} ({self.weights.record.digest}): the latents "
                "would not be this autoencoder's. Point model.autoencoder.url at the autoencoder that encoded them, "
                "or encode the data again with `gentrain data encode`"
            )
        if tuple(encoding.latent_shape) != self.shape:
            raise ConfigError(
                f"data.urls: the shards hold {list(encoding.latent_shape)} latents but this autoencoder at "
                f"data.image_size gives {list(self.shape)}: encode the data again at this size"
            )

    def build(self) -> nn.Module:
        """The autoencoder module, freshly initialized (the engine loads the frozen weights into it). On
        encoded shards it is decoder-only: the encoder submodules are removed and their tensors dropped from
        the frozen weights (read from the file, whose digest covers them, but never put in a module)."""
        config = self.weights.config
        if isinstance(config, dict):
            module = FolderAutoencoderKL.from_config({k: v for k, v in config.items() if not k.startswith("_")})
        elif _frozen_kind(config) == "image-tokenizer":
            module = VQAutoencoder(config.model_cfg, config.data.channels)
        else:
            module = KLAutoencoder(config.model_cfg, config.data.channels, config.data.image_size)
        if self.encoding is not None:
            self._drop_encoder(module)
        return module

    def _drop_encoder(self, module: nn.Module) -> None:
        owner, prefix = (module.vae, "vae.") if isinstance(module, KLAutoencoder) else (module, "")
        gone = [name for name in ("encoder", "quant_conv") if getattr(owner, name, None) is not None]
        for name in gone:
            setattr(owner, name, None)
        prefixes = tuple(f"{prefix}{name}." for name in gone)
        self.weights.tensors = {k: v for k, v in self.weights.tensors.items() if not k.startswith(prefixes)}

    @staticmethod
    def _vae(module: nn.Module) -> AutoencoderKL:
        return module.vae if isinstance(module, KLAutoencoder) else module

    @staticmethod
    def _scale_shift(module: nn.Module) -> tuple[Any, float]:
        if isinstance(module, KLAutoencoder):
            return module.scaling_factor, 0.0
        if isinstance(module, VQAutoencoder):  # LDM's VQ setting: the latents as they are (scale 1)
            return 1.0, 0.0
        return module.latent_scale, module.latent_shift

    def diffusers_vae(self, module: nn.Module) -> tuple[AutoencoderKL | None, str | None]:
        """For `gentrain checkpoints export`: (the autoencoder as a plain diffusers AutoencoderKL whose
        config.json carries the scaling factor decoding uses, or None; why DiTPipeline, which decodes
        `vae.decode(latents / scaling_factor)`, cannot decode these latents, or None when it can)."""
        if isinstance(module, VQAutoencoder):
            return None, (
                "the latents are a VQ-GAN's (decoding quantizes them first), which no diffusers AutoencoderKL "
                "decodes: decode them with the gentrain vqgan run"
            )
        scale, shift = self._scale_shift(module)
        if isinstance(module, KLAutoencoder):  # the measured factor is a float32 buffer; JSON keeps it exactly
            return plain_autoencoder_kl(module.vae, float(scale)), None
        vae = plain_autoencoder_kl(module, float(scale), float(shift) if shift else None)
        if shift:
            return vae, (
                f"the autoencoder's latents are shifted (shift_factor={shift}) and DiTPipeline decodes "
                "latents / scaling_factor without the shift: decode latents / scaling_factor + shift_factor yourself"
            )
        return vae, None

    def _check_whole(self, module: nn.Module) -> None:
        """The encoder and decoder are called outside the module's forward, which a sharded module's weight
        gathering hooks do not see: a sharded autoencoder is refused (every process alike, exit 2)."""
        if self.services is not None and self.services.calls_are_collective(module):
            raise ConfigError(
                "train.shard_frozen=true: the latent diffusion autoencoder cannot be sharded yet; set "
                "train.shard_frozen=false (a KL autoencoder is small next to the denoiser)"
            )

    def _posterior(self, module: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) of q(z | images), float32."""
        self._check_whole(module)
        if isinstance(module, VQAutoencoder):  # the encoder's latents before quantization: no posterior noise
            z = module.quant_conv(module.encoder(images)).float()
            return z, torch.zeros_like(z)
        posterior = self._vae(module).encode(images).latent_dist
        return posterior.mean.float(), posterior.std.float()

    @torch.no_grad()
    def encode(self, module: nn.Module, images: torch.Tensor, step: int, positions: list[int]) -> torch.Tensor:
        """Images in [-1, 1] -> scaled latents the denoiser trains on (see the module docstring); on encoded
        shards `images` are the stored posteriors, mean and std stacked on the channel axis."""
        if self.encoding is not None:
            mean, std = images.float().chunk(2, dim=1)
        elif self.cache is not None:
            mean, std = self.cache.posterior(images, lambda x: self._posterior(module, x))
        else:
            mean, std = self._posterior(module, images)
        z = mean
        if self.cfg.sample_posterior:
            # The batch's own latent shape: an aspect-ratio bucket's (data.buckets), not data.image_size's square.
            z = mean + std * sample_draws(self.seed, step, positions, Stream.AUTOENCODER, device=mean.device).randn(
                tuple(mean.shape[1:])
            )
        scale, shift = self._scale_shift(module)
        return ((z - shift) * scale).to(images.dtype)

    @torch.no_grad()
    def decode(self, module: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents -> images in [-1, 1]."""
        self._check_whole(module)
        scale, shift = self._scale_shift(module)
        if isinstance(module, VQAutoencoder):  # LDM's VQ setting: quantization is the first layer of decoding
            z = latents.to(module.post_quant_conv.weight.dtype)
            return module.decoder(module.post_quant_conv(module.quantize(z)[0])).clamp(-1, 1)
        vae = self._vae(module)
        z = (latents / scale + shift).to(next(vae.parameters()).dtype)
        return vae.decode(z).sample.clamp(-1, 1)


class LatentCache:
    """Each image's posterior (mean and std, float32) on local disk, so later epochs skip the encoder.

    The design of MaskGIT's token cache: a folder per autoencoder digest, an entry per BLAKE3 hash of the
    image tensor's bytes (augmented images get their own entry), written atomically (concurrent ranks may
    write the same entry). The frozen encoder runs in eval mode with no batch statistics, so a cached
    posterior is the one a fresh encode gives (bit-identical weights with and without the cache are tested
    on CPU; a backend whose convolutions round differently by batch size could differ in the last bits,
    as any change of batch composition would).
    """

    def __init__(self, root: str, digest: str):
        self.dir = os.path.join(root, digest.replace(":", "-"))
        os.makedirs(self.dir, exist_ok=True)
        self.hits = self.misses = 0

    def _path(self, image: torch.Tensor) -> str:
        data = image.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
        return os.path.join(self.dir, blake3.blake3(data).hexdigest()[:32] + ".npy")

    def posterior(self, images: torch.Tensor, encode) -> tuple[torch.Tensor, torch.Tensor]:
        paths = [self._path(x) for x in images]
        found = [np.load(p) if os.path.exists(p) else None for p in paths]
        todo = [i for i, t in enumerate(found) if t is None]
        if todo:
            mean, std = encode(images[todo])
            fresh = torch.stack([mean, std], dim=1).cpu().numpy().astype(np.float32)
            for i, t in zip(todo, fresh, strict=True):
                tmp = f"{paths[i]}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    np.save(f, t)
                os.replace(tmp, paths[i])
                found[i] = t
        self.hits += len(paths) - len(todo)
        self.misses += len(todo)
        both = torch.from_numpy(np.stack(found)).to(images.device)
        return both[:, 0], both[:, 1]
