"""`gentrain checkpoints export`: diffusers folders out of a checkpoint, with a model card.

A task says what to write (`Task.export` -> `trainer.tasks.base.Export`): diffusers models by folder
(`unet`, `transformer`, `vae`, `vqvae`, a cascade's `stage<k>`), schedulers by folder, and the diffusers pipeline
class that runs them, if one does. Everything is written through fsspec (local or remote outputs alike,
with `--storage-options`), as safetensors and JSON only: each model as `config.json` +
`diffusion_pytorch_model.safetensors` (LoRA adapters merged; the adapters also beside it, see
`trainer.models.finetune.write_folder`), each scheduler as `scheduler_config.json`, then `README.md` (the
model card) and last `model_index.json` (only for a pipeline, so a partly written folder never loads as one).
model_index.json is the one diffusers' `save_pretrained` writes: the pipeline object's own config, built
from the components in memory. `gentrain-export.json` marks the folder as an export (written first with
`complete: false`, last with `complete: true`): a re-export first removes the previous export's index and
card, then its folders, so no failure leaves one export's index or card beside another's weights; a
non-empty folder without the marker is refused (it is not an export to replace).

The helpers below turn gentrain's modules into what diffusers' pipelines expect: `dit_for_pipeline` pads a
DiT's label tables so DiTPipeline's hard-coded null class 1000 is gentrain's null row; `plain_autoencoder_kl`
is an AutoencoderKL whose config carries the latent scaling factor gentrain measured; `vq_model` is a VQ-GAN's
generator as a diffusers VQModel, its codebook (vector-quantize-pytorch's VQ or LFQ) in
`quantize.embedding.weight`.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.checkpoint.format import new_digest
from trainer.checkpoint.validity import InputRecord
from trainer.errors import ConfigError
from trainer.models.finetune import (
    CONFIG_NAME,
    LORA_WEIGHTS_NAME,
    WEIGHTS_NAME,
    has_lora,
    merged_state_dict,
    merged_text_encoder,
    text_children,
    write_folder,
)
from trainer.storage import check_output_folder, filesystem

if TYPE_CHECKING:
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.models.autoencoders.vq_model import VQModel
    from diffusers.models.transformers.dit_transformer_2d import DiTTransformer2DModel

# Each export imports its diffusers class when it runs: the autoencoders' modules import diffusers' loaders,
# and with them peft and scipy whenever installed, which a training run of a task never needs
# (tests/test_startup.py).

SCHEDULER_CONFIG_NAME = "scheduler_config.json"  # diffusers' name
MODEL_INDEX_NAME = "model_index.json"
CARD_NAME = "README.md"
CARD_TITLE = b"# gentrain "  # how every model card starts (`model_card`)
TEXT_WEIGHTS_NAME = "model.safetensors"  # transformers' SAFE_WEIGHTS_NAME: a text encoder's weights
MARKER_NAME = "gentrain-export.json"  # written first (complete: false) and last (complete: true)
_FOLDER_FILES = (CONFIG_NAME, WEIGHTS_NAME, LORA_WEIGHTS_NAME)
# Failpoint (docs/development.md): the export fails right after writing this model folder.
FAULT_EXPORT_AFTER_FOLDER = "GENTRAIN_FAULT_EXPORT_AFTER_FOLDER"
DIT_PIPELINE_NULL_CLASS = 1000  # DiTPipeline.__call__: class_null = torch.tensor([1000] * batch_size)


def dit_for_pipeline(dit: nn.Module, num_classes: int) -> DiTTransformer2DModel:
    """`dit` (gentrain's: `num_classes` classes, its null class at row `num_classes` of every label table) as
    a DiTTransformer2DModel with `num_embeds_ada_norm=1000`, whose tables have 1001 rows: rows
    0..num_classes-1 are the trained classes, row 1000 (DiTPipeline's null class) is the trained null row,
    and the rows between are copies of the null row (never used by gentrain; a label there is unconditional).
    Every block's `norm1.emb.class_embedder` holds a table (the output layer uses block 0's)."""
    from diffusers.models.embeddings import LabelEmbedding
    from diffusers.models.transformers.dit_transformer_2d import DiTTransformer2DModel

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
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL

    config = {k: v for k, v in vae.config.items() if not k.startswith("_")}
    config["scaling_factor"] = float(scaling_factor)
    if shift_factor is not None:
        config["shift_factor"] = float(shift_factor)
    out = AutoencoderKL.from_config(config)
    out.load_state_dict(merged_state_dict(vae), strict=True)
    return out.eval()


def vq_model(generator: nn.Module, channels: int, image_size: int) -> VQModel:
    """A VQ-GAN generator (`trainer.models.vqgan.VQAutoencoder`) as a diffusers VQModel with the same weights.

    The two are the same network: diffusers' Encoder -> quant_conv -> nearest code -> post_quant_conv ->
    Decoder; only the quantizer's layout differs. diffusers' `VectorQuantizer` takes the code nearest to each
    latent vector in Euclidean distance from `quantize.embedding.weight` (num_codes, dim), so
    - vq (vector-quantize-pytorch's `VectorQuantize`, Euclidean, no projection): the codebook as it is;
    - lfq (sign quantization: each latent channel to +-1, no projection, not spherical): the codebook of all
      2^d corners of {-1, 1}^d in LFQ's index order; the corner nearest to z in Euclidean distance is the
      channel-wise sign of z, which is what LFQ picks (a channel exactly 0 goes to -1 in both: the lower index);
    - fsq rounds tanh-bounded latents per channel: its cells are not the Voronoi cells of any codebook
      a linear quant_conv can map the latents onto, so it is refused (ConfigError)."""
    from diffusers.models.autoencoders.vq_model import VQModel

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


def merged_pipeline(export: Any, base: InputRecord | None, storage_options: Mapping[str, Any] | None) -> Any:
    """`--merged`: `export` (a released pipeline's fine-tune) as that whole pipeline: the trained models (its
    `lora_prefixes`' folders: the denoiser) written merged (W + scale * B @ A, by peft), the run's sampling
    scheduler, and every other file of the base pipeline `base` (the checkpoint's pinned `pipeline` input: url,
    per-file digests) copied as it is, checked against its digest while copied (`write_export(base=...)`).
    ConfigError (exit 2) for a run that was not trained from a pipeline folder."""
    if base is None or base.url is None or not isinstance(base.files, Mapping) or not base.files:
        raise ConfigError(
            "--merged writes the released pipeline the run fine-tuned, with the trained weights merged in; this "
            "checkpoint was not trained from a pipeline folder (model.pretrained naming a folder with "
            f"{MODEL_INDEX_NAME}): export it without --merged"
        )
    url = base.url
    fs, root = filesystem(url.rstrip("/"), storage_options)
    try:
        index = json.loads(fs.cat_file(posixpath.join(root, MODEL_INDEX_NAME)))
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--merged: the base pipeline {url} ({base.digest}) has no readable {MODEL_INDEX_NAME} ({e}): "
            "restore that folder (the run's model.pretrained) and export again"
        ) from None
    trained = {name: export.models[name] for name in export.lora_prefixes if name in export.models}
    cls = index.get("_class_name")
    steps = "scheduler/ is the run's sampler (sample.*); a pipeline's __init__ may adjust its config (see docs)"
    return replace(
        export,
        models=trained,
        pipeline=cls,
        reason=None,
        usage="\n".join(
            [
                "import torch",
                "from diffusers import DiffusionPipeline",
                "",
                f'pipe = DiffusionPipeline.from_pretrained("path/to/this/folder")  # {cls}',
                'images = pipe("a prompt", generator=torch.Generator().manual_seed(0)).images',
            ]
        ),
        notes=[
            *export.notes,
            f"the whole {cls} of {url} ({base.digest}), its {', '.join(sorted(trained))} fine-tuned "
            f"(LoRA merged); the other components copied unchanged; {steps}",
        ],
    )


def _copy_base_files(
    base: InputRecord,
    skip: set[str],
    keep_config: set[str],
    out: str,
    storage_options: Mapping[str, Any] | None,
) -> tuple[list[str], list[str]]:
    """Copy the pinned files of the base pipeline `base` (its record) under `out`, but those in the folders
    `skip` and, of the folders `keep_config`, all but config.json, streamed, each checked against its pinned
    blake3 (a changed file: ConfigError naming it, nothing loads the partial copy: no model_index.json yet).
    Returns (URLs written, folders copied)."""
    src_fs, src_root = filesystem(str(base.url).rstrip("/"), storage_options)
    fs, root = filesystem(out, storage_options)
    written, folders = [], set()
    for rel, pinned in sorted(base.files.items() if isinstance(base.files, Mapping) else ()):
        folder = rel.split("/", 1)[0]
        if "/" not in rel or folder in skip or (rel != f"{folder}/{CONFIG_NAME}" and folder in keep_config):
            continue
        h = new_digest("blake3")
        target = posixpath.join(root, rel)
        fs.makedirs(posixpath.dirname(target), exist_ok=True)
        try:
            with src_fs.open(posixpath.join(src_root, rel), "rb") as src, fs.open(target, "wb") as dst:
                while chunk := src.read(16 << 20):
                    h.update(chunk)
                    dst.write(chunk)
        except FileNotFoundError:
            raise ConfigError(
                f"--merged: {base.url}/{rel}, a file of the run's base pipeline, is gone: restore that folder "
                "(the run's model.pretrained) and export again"
            ) from None
        if pinned.blake3 != h.hexdigest():
            raise ConfigError(
                f"--merged: {base.url}/{rel} changed since the run pinned it ({pinned.blake3}, now "
                f"{h.hexdigest()}): restore the folder as it was, or export without --merged"
            )
        written.append(target)
        folders.add(folder)
    return written, sorted(folders)


def _merged_index(base: InputRecord, export: Any, folders: list[str], storage_options) -> dict[str, Any]:
    """The base's model_index.json with the run's scheduler class in `scheduler`, and every component slot
    whose folder the export does not hold (a safety checker, a feature extractor gentrain never read) null."""
    fs, root = filesystem(str(base.url).rstrip("/"), storage_options)
    index = json.loads(fs.cat_file(posixpath.join(root, MODEL_INDEX_NAME)))
    held = {*folders, *export.models, *export.schedulers}
    for slot, entry in list(index.items()):
        if slot.startswith("_") or not (isinstance(entry, list) and len(entry) == 2):
            continue
        if slot in export.schedulers:
            index[slot] = ["diffusers", type(export.schedulers[slot]).__name__]
        elif slot not in held and entry != [None, None]:
            index[slot] = [None, None]
    return index


def _is_gentrain_export(fs: Any, root: str) -> bool:
    """True when folder `root` was written by `gentrain checkpoints export`: it holds the marker, or (an
    export written before the marker existed) a model card of gentrain's."""
    if fs.exists(posixpath.join(root, MARKER_NAME)):
        return True
    card = posixpath.join(root, CARD_NAME)
    try:
        return fs.isfile(card) and fs.cat_file(card, start=0, end=len(CARD_TITLE)) == CARD_TITLE
    except OSError:
        return False


def _previous_folders(fs: Any, root: str) -> list[str]:
    """The folders a previous gentrain export in `root` wrote: the marker's list, or (an older export
    without one) every folder beside its card that holds a diffusers config or LoRA weights."""
    marker = posixpath.join(root, MARKER_NAME)
    if fs.exists(marker):
        try:
            folders = json.loads(fs.cat_file(marker)).get("folders", [])
        except (OSError, ValueError, AttributeError):
            folders = []
        listed = [f for f in folders if isinstance(f, str) and f and "/" not in f and f not in (".", "..")]
        if listed:
            return listed
    found = []
    for entry in fs.ls(root, detail=True):
        name = posixpath.basename(entry["name"].rstrip("/"))
        if entry["type"] == "directory" and any(
            fs.exists(posixpath.join(root, name, f)) for f in (*_FOLDER_FILES, SCHEDULER_CONFIG_NAME)
        ):
            found.append(name)
    return found


def check_export_target(out_url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Refuse (ConfigError, exit 2) an export into a folder that is not one: a file, or a non-empty folder
    that a gentrain export did not write (an export replaces what is there, so it never replaces
    anything else)."""
    fix = "give a new or empty folder, or a previous export's folder"
    check_output_folder(out_url, f"OUT {out_url!r}", fix)  # local: a file or a dangling link on the way
    fs, root = filesystem(out_url.rstrip("/"), storage_options)
    if not fs.exists(root):
        return
    if not fs.isdir(root):
        raise ConfigError(
            f"OUT {out_url!r} is a file, not a folder; give a new or empty folder, or a previous export's folder"
        )
    if fs.ls(root) and not _is_gentrain_export(fs, root):
        raise ConfigError(
            f"OUT {out_url!r} is a folder that holds other files and no gentrain export ({MARKER_NAME} or a "
            f"gentrain {CARD_NAME}); an export replaces its folder's export, so it is written only into a new "
            "or empty folder or over a previous export: give another folder"
        )


def write_export(
    export: Any,
    out_url: str,
    card: str,
    storage_options: Mapping[str, Any] | None = None,
    about: Mapping[str, Any] | None = None,
    base: InputRecord | None = None,
) -> list[str]:
    """Write `export` (a `trainer.tasks.base.Export`) under `out_url` with the model card `card`; returns
    the URLs written, model_index.json last. `about` (step, checkpoint, ...; already redacted) goes into
    the marker. `base` (a `merged_pipeline` export: the pinned base pipeline's record): the models are written
    merged without their adapters, the base's other files copied beside them, its model_index.json adapted.

    A re-export never leaves another export's index or card beside its weights: the previous export's
    model_index.json and README.md are removed first, then its folders; the marker says `complete: false`
    while the folders are written, then the card and the index follow, and the marker last says
    `complete: true`. A write that fails part way leaves weights without an index or a card (never loaded
    as a pipeline, never described as another step's) and the marker, so the next export replaces them."""
    out = out_url.rstrip("/")
    # Before writing: a pipeline that cannot be built fails.
    index = model_index(export) if export.pipeline and base is None else None
    check_export_target(out, storage_options)
    fs, root = filesystem(out, storage_options)
    written: list[str] = []

    def put(path: str, text: str) -> None:
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.pipe_file(path, text.encode())
        written.append(path)

    if fs.exists(root):
        for name in (MODEL_INDEX_NAME, CARD_NAME):  # first: nothing old may describe the new weights
            if fs.exists(posixpath.join(root, name)):
                fs.rm(posixpath.join(root, name))
        for folder in _previous_folders(fs, root):
            if fs.exists(posixpath.join(root, folder)):
                fs.rm(posixpath.join(root, folder), recursive=True)
    lora = [f"{name}-lora" for name, (module, _) in export.models.items() if has_lora(module) and base is None]
    copied = sorted({rel.split("/", 1)[0] for rel in base.files or {} if "/" in rel}) if base is not None else []
    copied = [f for f in copied if f not in export.models and f not in export.schedulers]
    folders = [*export.models, *lora, *export.schedulers, *copied]
    marker = {**dict(about or {}), "format": 1, "complete": False, "folders": folders}
    marker_path = posixpath.join(root, MARKER_NAME)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(marker_path, (json.dumps(marker, indent=2, sort_keys=True) + "\n").encode())
    fault = os.environ.get(FAULT_EXPORT_AFTER_FOLDER)
    for name, (module, extras) in export.models.items():
        prefix = export.lora_prefixes.get(name)
        written += write_folder(
            module, f"{out}/{name}", extras, storage_options, lora_prefix=prefix, adapters=base is None
        )
        if fault == name:
            raise OSError(errno.EIO, f"failpoint {FAULT_EXPORT_AFTER_FOLDER}={name}: failing after {name}/")
    for name, scheduler in export.schedulers.items():
        put(posixpath.join(root, name, SCHEDULER_CONFIG_NAME), scheduler.to_json_string())
    if base is not None:
        # A text encoder LoRA trained with the denoiser: its config copied, its weights merged (transformers').
        texts = {slot: enc for module, _ in export.models.values() for slot, enc in text_children(module).items()}
        files, _ = _copy_base_files(base, {*export.models, *export.schedulers}, set(texts), out, storage_options)
        written += files
        from safetensors.torch import save as save_safetensors  # as finetune.write_folder: only when writing

        for slot, encoder in texts.items():
            data = save_safetensors(merged_text_encoder(encoder), metadata={"format": "pt"})
            fs.pipe_file(posixpath.join(root, slot, TEXT_WEIGHTS_NAME), data)
            written.append(posixpath.join(root, slot, TEXT_WEIGHTS_NAME))
        index = _merged_index(base, export, copied, storage_options)
    put(posixpath.join(root, CARD_NAME), card)
    if index is not None:
        put(posixpath.join(root, MODEL_INDEX_NAME), json.dumps(index, indent=2, sort_keys=True) + "\n")
    fs.pipe_file(marker_path, (json.dumps({**marker, "complete": True}, indent=2, sort_keys=True) + "\n").encode())
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
