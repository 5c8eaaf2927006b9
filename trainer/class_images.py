"""`gentrain data class-images CONFIG [--num N]`: DreamBooth's class images, generated once from the base pipeline.

diffusers' train_dreambooth*.py scripts, given --with_prior_preservation and fewer than --num_class_images images in
--class_data_dir, generate the missing ones with the base pipeline and --class_prompt before training. Here that is a
command of its own, exact and resumable:

- The pipeline is the config's `model.pretrained` folder (checked by `inspect_pipeline`: diffusers and transformers
  classes only, safetensors only), loaded offline by diffusers' own text-to-image class of its family
  (`StableDiffusionPipeline`, `StableDiffusionXLPipeline`, ...), drawing `data.class_prompt` at
  `data.image_size` square with `sample.inference_steps` and `sample.guidance_scale` on the folder's scheduler.
- Image i is `data.class_images/{i:06d}.png`, drawn from its own generator seeded from (seed, i) (random stream
  CLASS_IMAGE). Images are drawn in fixed blocks of `--batch-size` (block k: images kB .. kB + B - 1, always the
  whole block, so an image's batch never depends on N or on what exists): an image's bytes are a function of
  (config, seed, i, batch size) on one machine, as far as its math is deterministic.
- Each image is written under a temporary name and renamed: a file that exists is whole. A killed run is resumed by
  running it again (the blocks whose images all exist are skipped; a block with some missing is drawn again and only
  the missing are written); a finished one generates nothing.
- `class-images.json` in the folder records the settings the images were drawn with (prompt, pipeline, seed, size,
  steps, guidance, batch size, dtype); a rerun with other settings exits 2 naming what differs, never mixing two
  sets in one folder. Other images the user put there are left alone (training reads them too).
"""

from __future__ import annotations

import io
import json
import logging
import posixpath
from dataclasses import dataclass
from typing import Any

import fsspec
import torch

from trainer.config import Config
from trainer.errors import ConfigError
from trainer.models.pipelines import inspect_pipeline
from trainer.randomness import Stream, stream_seed
from trainer.storage import filesystem

log = logging.getLogger(__name__)

SETTINGS_NAME = "class-images.json"
_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ClassImagesSummary:
    wanted: int
    written: int
    kept: int
    folder: str

    def line(self) -> str:
        return f"{self.written} written, {self.kept} already there, {self.wanted} wanted in {self.folder}"


def image_name(index: int) -> str:
    return f"{index:06d}.png"


def _settings(cfg: Config, family: str, pipeline_class: str, batch_size: int, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "prompt": cfg.data.class_prompt,
        "pipeline": cfg.model_cfg.pretrained,
        "pipeline_class": pipeline_class,
        "family": family,
        "seed": cfg.seed,
        "image_size": cfg.data.image_size,
        "inference_steps": cfg.sample.inference_steps,
        "guidance_scale": cfg.sample.guidance_scale,
        "batch_size": batch_size,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _check_config(cfg: Config) -> str:
    """The pipeline folder's local path; ConfigError for a config that cannot generate class images."""
    d = cfg.data
    if d.class_images is None:
        raise ConfigError(
            "data.class_images is not set: set it to the folder the class images go to (and data.class_prompt)"
        )
    pretrained = getattr(cfg.model_cfg, "pretrained", None)
    if not pretrained:
        raise ConfigError(
            "model.pretrained is not set: class images are drawn by the base pipeline, so set it to a diffusers "
            "pipeline folder (e.g. the sd15-dreambooth preset with model.pretrained=FOLDER)"
        )
    protocol, path = fsspec.core.split_protocol(pretrained)
    if protocol not in (None, "file", "local"):
        raise ConfigError(
            f"model.pretrained={pretrained!r}: diffusers loads a pipeline from a local folder; copy it to this "
            "machine and name that folder to generate class images"
        )
    return path


def generate_class_images(cfg: Config, num: int, batch_size: int = 4) -> ClassImagesSummary:
    """Fill data.class_images up to `num` images (see the module doc)."""
    local = _check_config(cfg)
    folder = inspect_pipeline(cfg.model_cfg.pretrained, digests=False)
    family = folder.family
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _DTYPES[cfg.train.precision] if device.type == "cuda" else torch.float32
    pipeline_class = family.pipelines[0]
    settings = _settings(cfg, family.name, pipeline_class, batch_size, dtype)
    url = cfg.data.class_images
    fs, root = filesystem(url, cfg.data.storage_options)
    fs.makedirs(root, exist_ok=True)
    _check_settings(fs, root, url, settings)
    have = {posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)}
    missing = [i for i in range(num) if image_name(i) not in have]
    summary = ClassImagesSummary(num, len(missing), num - len(missing), url)
    if not missing:
        return summary
    pipe = _load(pipeline_class, local, family.ignored, dtype, device)
    blocks = sorted({i // batch_size for i in missing})
    for n, block in enumerate(blocks, 1):
        indices = list(range(block * batch_size, (block + 1) * batch_size))
        generators = [
            torch.Generator(device).manual_seed(stream_seed(cfg.seed, Stream.CLASS_IMAGE, i)) for i in indices
        ]
        images = pipe(
            prompt=[cfg.data.class_prompt] * len(indices),
            generator=generators,
            num_inference_steps=cfg.sample.inference_steps,
            guidance_scale=cfg.sample.guidance_scale,
            height=cfg.data.image_size,
            width=cfg.data.image_size,
            output_type="pil",
        ).images
        for i, image in zip(indices, images, strict=True):
            if i < num and image_name(i) not in have:
                _write_image(fs, root, image_name(i), image)
        log.info("class images: block %d of %d (images %d..%d)", n, len(blocks), indices[0], indices[-1])
    return summary


def _check_settings(fs, root: str, url: str, settings: dict[str, Any]) -> None:
    """Write the settings on a first run; refuse (exit 2) a rerun with other ones, naming each."""
    path = posixpath.join(root, SETTINGS_NAME)
    if not fs.exists(path):
        _atomic_write(fs, root, SETTINGS_NAME, (json.dumps(settings, indent=1) + "\n").encode())
        return
    try:
        stored = json.loads(fs.cat_file(path)[: 1 << 20])
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"data.class_images={url!r}: {SETTINGS_NAME} is not JSON ({e}); remove it or the folder"
        ) from None
    if not isinstance(stored, dict):
        raise ConfigError(f"data.class_images={url!r}: {SETTINGS_NAME} is not a JSON object; remove it or the folder")
    differ = [
        f"{k}={settings[k]!r} (the folder's: {stored.get(k)!r})" for k in settings if stored.get(k) != settings[k]
    ]
    if differ:
        raise ConfigError(
            f"data.class_images={url!r} holds class images drawn with other settings: {', '.join(differ)}; "
            "use those settings, another folder, or empty this one"
        )


def _atomic_write(fs, root: str, name: str, data: bytes) -> None:
    """`name` appears whole or not at all: written under a temporary name, then renamed."""
    tmp = posixpath.join(root, f".{name}.tmp")
    fs.pipe_file(tmp, data)
    fs.mv(tmp, posixpath.join(root, name))


def _write_image(fs, root: str, name: str, image) -> None:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    _atomic_write(fs, root, name, buf.getvalue())


def _load(pipeline_class: str, local: str, ignored: tuple[str, ...], dtype: torch.dtype, device: torch.device):
    """diffusers' pipeline class of the family, from the local folder, offline; the slots gentrain never reads (a
    safety checker, an image processor) are not loaded."""
    import diffusers  # a core dependency, imported here only: the pipeline classes are for generating

    with open(posixpath.join(local, "model_index.json"), encoding="utf-8") as f:
        index = json.load(f)
    skip: dict[str, Any] = {slot: None for slot in ignored if slot in index}
    if "safety_checker" in skip:
        skip["requires_safety_checker"] = False
    cls = getattr(diffusers, pipeline_class)
    pipe = cls.from_pretrained(local, dtype=dtype, use_safetensors=True, local_files_only=True, **skip)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


__all__ = ["SETTINGS_NAME", "ClassImagesSummary", "generate_class_images", "image_name"]
