"""`gentrain checkpoints export`: diffusers folders out of a checkpoint, with a model card.

A task says what to write (`Task.export` -> `trainer.tasks.base.Export`): diffusers models by folder
(`unet`, `transformer`, `vae`, `vqvae`, a cascade's `stage<k>`), schedulers by folder, and the diffusers pipeline
class that runs them, if one does. Everything is written through fsspec (local or remote outputs alike,
with `--storage-options`), as safetensors and JSON only: each model as `config.json` +
`diffusion_pytorch_model.safetensors` (LoRA adapters merged; the adapters also beside it, see
`trainer.models.finetune.write_folder`), each scheduler as `scheduler_config.json`, then `README.md` (the
model card) and last `model_index.json` (only for a pipeline, so a partly written folder never loads as one).
model_index.json is the one diffusers' `save_pretrained` writes: the pipeline object's own config, built
from the components in memory.

The helpers below turn gentrain's modules into what diffusers' pipelines expect: `dit_for_pipeline` pads a
DiT's label tables so DiTPipeline's hard-coded null class 1000 is gentrain's null row; `plain_autoencoder_kl`
is an AutoencoderKL whose config carries the latent scaling factor gentrain measured; `vq_model` is a VQ-GAN's
generator as a diffusers VQModel, its codebook (vector-quantize-pytorch's VQ or LFQ) in
`quantize.embedding.weight`.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping
from typing import Any

import torch
from diffusers import AutoencoderKL, DiTTransformer2DModel, VQModel
from diffusers.models.embeddings import LabelEmbedding
from torch import nn

from trainer.errors import ConfigError
from trainer.models.finetune import merged_state_dict, write_folder

SCHEDULER_CONFIG_NAME = "scheduler_config.json"  # diffusers' name
MODEL_INDEX_NAME = "model_index.json"
CARD_NAME = "README.md"
DIT_PIPELINE_NULL_CLASS = 1000  # DiTPipeline.__call__: class_null = torch.tensor([1000] * batch_size)


def dit_for_pipeline(dit: nn.Module, num_classes: int) -> DiTTransformer2DModel:
    """`dit` (gentrain's: `num_classes` classes, its null class at row `num_classes` of every label table) as
    a DiTTransformer2DModel with `num_embeds_ada_norm=1000`, whose tables have 1001 rows: rows
    0..num_classes-1 are the trained classes, row 1000 (DiTPipeline's null class) is the trained null row,
    and the rows between are copies of the null row (never used by gentrain; a label there is unconditional).
    Every block's `norm1.emb.class_embedder` holds a table (the output layer uses block 0's)."""
    state = merged_state_dict(dit)
    tables = [f"{name}.embedding_table.weight" for name, m in dit.named_modules() if isinstance(m, LabelEmbedding)]
    for key in tables:
        table = state[key]
        null = table[num_classes]
        rows = DIT_PIPELINE_NULL_CLASS + 1
        padded = null.expand(rows, -1).clone()
        padded[:num_classes] = table[:num_classes]
        state[key] = padded
    config = {k: v for k, v in dit.config.items() if not k.startswith("_")}
    out = DiTTransformer2DModel.from_config({**config, "num_embeds_ada_norm": DIT_PIPELINE_NULL_CLASS})
    out.load_state_dict(state, strict=True)
    return out.eval()


def plain_autoencoder_kl(vae: nn.Module, scaling_factor: float, shift_factor: float | None = None) -> AutoencoderKL:
    """A plain diffusers AutoencoderKL with `vae`'s weights and config, its `scaling_factor` (and
    `shift_factor`) the given ones: what pipelines read from vae/config.json."""
    config = {k: v for k, v in vae.config.items() if not k.startswith("_")}
    config["scaling_factor"] = float(scaling_factor)
    if shift_factor is not None:
        config["shift_factor"] = float(shift_factor)
    out = AutoencoderKL.from_config(config)
    out.load_state_dict(merged_state_dict(vae), strict=True)
    return out.eval()


def vq_model(generator: nn.Module, channels: int, image_size: int) -> VQModel:
    """A VQ-GAN generator (`trainer.tasks.vqgan.VQAutoencoder`) as a diffusers VQModel with the same weights.

    The two are the same network: diffusers' Encoder -> quant_conv -> nearest code -> post_quant_conv ->
    Decoder; only the quantizer's layout differs. diffusers' `VectorQuantizer` takes the code nearest to each
    latent vector in Euclidean distance from `quantize.embedding.weight` (num_codes, dim), so
    - vq (vector-quantize-pytorch's `VectorQuantize`, Euclidean, no projection): the codebook as it is;
    - lfq (sign quantization: each latent channel to +-1, no projection, not spherical): the codebook of all
      2^d corners of {-1, 1}^d in LFQ's index order; the corner nearest to z in Euclidean distance is the
      channel-wise sign of z, which is what LFQ picks (a channel exactly 0 goes to -1 in both: the lower index);
    - fsq rounds tanh-bounded latents per channel: its cells are not the Voronoi cells of any codebook
      a linear quant_conv can map the latents onto, so it is refused (ConfigError)."""
    cfg = generator.cfg
    q = generator.quantizer
    if cfg.quantizer == "fsq":
        raise ConfigError(
            "model.quantizer=fsq: FSQ rounds each tanh-bounded latent channel to a grid, which diffusers' VQModel "
            "(the code nearest to the unbounded latent) cannot express exactly; only vq and lfq VQ-GANs export"
        )
    if not isinstance(getattr(q, "project_in", nn.Identity()), nn.Identity) or getattr(q, "spherical", False):
        raise ConfigError("this quantizer projects or normalizes its input, which diffusers' VQModel has no layer for")
    if cfg.quantizer == "vq" and getattr(q._codebook, "use_cosine_sim", False):
        raise ConfigError("a cosine-similarity codebook has no diffusers VQModel equivalent (Euclidean distance)")
    latent = cfg.latent_channels
    out = VQModel(
        **cfg.diffusers_shape(channels, image_size),
        act_fn="silu",
        latent_channels=latent,
        num_vq_embeddings=cfg.num_codes,
        vq_embed_dim=latent,
        scaling_factor=1.0,  # the latents as they are, as a gentrain latent-diffusion run uses a VQ-GAN's
        norm_type="group",
        mid_block_add_attention=False,
    )
    mine = generator.state_dict()
    state = {k: v for k, v in mine.items() if k.startswith(("encoder.", "decoder.", "quant_conv.", "post_quant_conv."))}
    with torch.no_grad():  # every code through the quantizer's own lookup: (1, dim, K, 1) -> (K, dim)
        codes = generator.lookup_codes(torch.arange(cfg.num_codes, device=generator.last_layer.device).view(1, -1, 1))
    state["quantize.embedding.weight"] = codes[0, :, :, 0].t().to(out.quantize.embedding.weight.dtype).contiguous()
    out.load_state_dict(state, strict=True)
    return out.eval()


def model_index(export: Any) -> dict[str, Any]:
    """model_index.json as diffusers' `save_pretrained` writes it: the pipeline's config, from the components."""
    import diffusers

    cls = getattr(diffusers, export.pipeline)
    components = {name: module for name, (module, _) in export.models.items()}
    pipe = cls(**components, **export.schedulers)
    return {**json.loads(pipe.to_json_string()), **export.index_extra}


def write_export(export: Any, out_url: str, card: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Write `export` (a `trainer.tasks.base.Export`) under `out_url` and the model card `card`; returns
    the URLs written, model_index.json last."""
    import fsspec

    out = out_url.rstrip("/")
    index = model_index(export) if export.pipeline else None  # before writing: a pipeline that cannot be built fails
    written: list[str] = []
    for name, (module, extras) in export.models.items():
        written += write_folder(module, f"{out}/{name}", extras, storage_options)
    fs, root = fsspec.core.url_to_fs(out, **dict(storage_options or {}))

    def put(path: str, text: str) -> None:
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.pipe_file(path, text.encode())
        written.append(path)

    for name, scheduler in export.schedulers.items():
        put(posixpath.join(root, name, SCHEDULER_CONFIG_NAME), scheduler.to_json_string())
    put(posixpath.join(root, CARD_NAME), card)
    if index is not None:
        put(posixpath.join(root, MODEL_INDEX_NAME), json.dumps(index, indent=2, sort_keys=True) + "\n")
    return written


def model_card(
    export: Any,
    *,
    task: str,
    step: int,
    use_ema: bool,
    checkpoint_url: str,
    digests: Mapping[str, str],
    config: Mapping[str, Any],
) -> str:
    """The README.md of an export: what was exported from which checkpoint, how to load it, the run's
    config. Every argument must already be free of credentials (the caller redacts)."""
    lines = [
        f"# gentrain {task} export",
        "",
        f"- task: `{task}`, step {step}, {'EMA' if use_ema else 'online'} weights",
        f"- checkpoint: `{checkpoint_url}`",
    ]
    for name, digest in sorted(digests.items()):
        lines.append(f"- weights `{name}`: `{digest}`")
    folders = sorted([*export.models, *export.schedulers])
    lines.append(f"- folders: {', '.join(f'`{f}/`' for f in folders)}")
    if export.pipeline:
        lines.append(f"- diffusers pipeline: `{export.pipeline}` (model_index.json)")
    else:
        lines.append(f"- no diffusers pipeline (no model_index.json): {export.reason}")
    lines += [f"- {note}" for note in export.notes]
    if export.usage:
        lines += ["", "## Loading with diffusers", "", "```python", export.usage.strip(), "```"]
    lines += [
        "",
        "## The run's config",
        "",
        "```json",
        json.dumps(config, indent=2, sort_keys=True, default=str),
        "```",
        "",
    ]
    return "\n".join(lines)
