"""A released pipeline's folder read as data (issue 48, "a pipeline folder in"): every family gentrain fine-tunes
is recognized from the folder diffusers' own `save_pretrained` writes (tiny random pipelines built here,
tests/tiny_pipelines.py), its objective read from its scheduler, every file it will read pinned by digest; and
a folder that is none of them, incomplete, pickled, or naming code of its own is exit 2 naming what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tiny_pipelines import BUILDERS, flux

from trainer.errors import ConfigError
from trainer.models.pipelines import FAMILIES, MODEL_INDEX, changed_files, inspect_pipeline


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipelines")
    return {name: build(root) for name, build in BUILDERS.items()}


def _copy(pipelines, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pipelines[name], tmp_path / name))


# family -> (variant, denoiser slot and class, text encoder slots, objective fields)
EXPECTED = {
    "sd": ("sd", "unet", "UNet2DConditionModel", ["text_encoder"], {"prediction_type": "epsilon"}),
    "sdxl": (
        "sdxl",
        "unet",
        "UNet2DConditionModel",
        ["text_encoder", "text_encoder_2"],
        {"prediction_type": "epsilon"},
    ),
    "sd3": (
        "sd3",
        "transformer",
        "SD3Transformer2DModel",
        ["text_encoder", "text_encoder_2", "text_encoder_3"],
        {"prediction_type": "flow", "shift": 3.0, "dynamic_shift": False},
    ),
    "flux": (
        "dev",
        "transformer",
        "FluxTransformer2DModel",
        ["text_encoder", "text_encoder_2"],
        {"prediction_type": "flow", "dynamic_shift": True, "base_shift": 0.5, "max_shift": 1.15},
    ),
    "pixart-sigma": ("pixart-sigma", "transformer", "PixArtTransformer2DModel", ["text_encoder"], {}),
}


def test_every_family_has_a_tiny_pipeline_here():
    assert set(BUILDERS) == set(EXPECTED) == {f.name for f in FAMILIES}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_each_family_is_recognized_with_its_parts_objective_and_every_file_pinned(pipelines, name):
    variant, slot, cls, encoders, objective = EXPECTED[name]
    p = inspect_pipeline(str(pipelines[name]))
    assert p.family.name == name and p.variant == variant
    assert p.family.denoiser == slot and p.denoiser.cls == cls and p.denoiser.config["_class_name"] == cls
    assert {"vae", "scheduler", *encoders} <= set(p.components)
    assert all(getattr(p.objective, k) == v for k, v in objective.items()), p.objective
    # Every file a run reads is pinned: each component's config, weights and tokenizer files, and the index.
    files = p.record.files
    on_disk = {str(f.relative_to(pipelines[name])) for f in pipelines[name].rglob("*") if f.is_file()}
    assert set(files) <= on_disk and MODEL_INDEX in files
    assert {f"{s}/{n}" for s in ("vae", slot) for n in ("config.json", "diffusion_pytorch_model.safetensors")} <= set(
        files
    )
    assert all(f"{e}/model.safetensors" in files for e in encoders)
    assert all(len(v.blake3) == 64 and v.bytes > 0 for v in files.values())
    assert p.record.family == name and p.record.digest.startswith("blake3:")
    assert inspect_pipeline(str(pipelines[name])).record == p.record  # the same folder pins the same digests


def test_flux_schnell_is_told_from_dev_by_its_guidance_embedding(tmp_path):
    p = inspect_pipeline(str(flux(tmp_path, dev=False)))
    assert p.family.name == "flux" and p.variant == "schnell"
    assert p.objective.prediction_type == "flow" and p.objective.shift == 1.0 and not p.objective.dynamic_shift


def test_an_fsspec_url_reads_the_same_folder(pipelines):
    local = inspect_pipeline(str(pipelines["sd"]))
    url = inspect_pipeline(f"file://{pipelines['sd']}")
    assert url.record.files == local.record.files and url.record.digest == local.record.digest


def test_a_changed_file_changes_the_pin_and_is_named(pipelines, tmp_path):
    folder = _copy(pipelines, "sdxl", tmp_path)
    before = inspect_pipeline(str(folder)).record
    weights = folder / "text_encoder_2" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    after = inspect_pipeline(str(folder)).record
    assert after.digest != before.digest
    assert changed_files(before, after) == ["text_encoder_2/model.safetensors"]


def test_sharded_weights_are_read_through_their_index_and_each_shard_pinned(pipelines, tmp_path):
    from diffusers import SD3Transformer2DModel

    folder = _copy(pipelines, "sd3", tmp_path)
    model = SD3Transformer2DModel.from_pretrained(folder / "transformer")
    shutil.rmtree(folder / "transformer")
    model.save_pretrained(folder / "transformer", max_shard_size="50KB")
    shards = sorted(p.name for p in (folder / "transformer").glob("*.safetensors"))
    assert len(shards) > 1
    files = inspect_pipeline(str(folder)).record.files
    assert "transformer/diffusion_pytorch_model.safetensors.index.json" in files
    assert all(f"transformer/{s}" in files for s in shards)

    index = folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"][next(iter(doc["weight_map"]))] = "../vae/diffusion_pytorch_model.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"transformer/.*index.json names shards outside its folder"):
        inspect_pipeline(str(folder))


def test_every_missing_part_is_named_at_once(pipelines, tmp_path):
    folder = _copy(pipelines, "flux", tmp_path)
    shutil.rmtree(folder / "vae")
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    (folder / "scheduler" / "scheduler_config.json").rename(folder / "scheduler" / "config.json")
    with pytest.raises(ConfigError) as e:
        inspect_pipeline(str(folder))
    message = str(e.value)
    assert "is a FluxPipeline folder (flux) that gentrain cannot use" in message
    assert "vae/ is missing" in message and "scheduler/scheduler_config.json is missing" in message
    assert "transformer has no diffusion_pytorch_model.safetensors" in message


def test_pickled_weights_are_refused_with_the_fix(pipelines, tmp_path):
    folder = _copy(pipelines, "sd", tmp_path)
    weights = folder / "text_encoder" / "model.safetensors"
    weights.rename(weights.with_name("pytorch_model.bin"))
    with pytest.raises(ConfigError, match=r"text_encoder holds only pickled weights .*safe_serialization=True"):
        inspect_pipeline(str(folder))


def test_a_folder_naming_code_of_its_own_is_refused(pipelines, tmp_path):
    folder = _copy(pipelines, "sd", tmp_path)
    index = json.loads((folder / MODEL_INDEX).read_text())
    index["unet"] = ["my_pipeline_code", "MyUNet"]
    (folder / MODEL_INDEX).write_text(json.dumps(index))
    with pytest.raises(
        ConfigError, match=r"unet is my_pipeline_code.MyUNet; .*gentrain imports no class a folder names"
    ):
        inspect_pipeline(str(folder))


@pytest.mark.parametrize(
    "index, match",
    [
        ("{not json", r"model_index.json is not valid JSON"),
        ("[1, 2]", r"model_index.json holds list, not a JSON object"),
        ('{"_class_name": "KandinskyPipeline"}', r"names the pipeline 'KandinskyPipeline'.*StableDiffusionPipeline"),
        ("[" * 5000 + "]" * 5000, r"model_index.json (is not valid JSON|holds list)"),
        ('{"_class_name": "StableDiffusionPipeline", "unet": "UNet2DConditionModel"}', r"is not \[library, class\]"),
    ],
)
def test_a_malformed_model_index_is_exit_2(pipelines, tmp_path, index, match):
    folder = _copy(pipelines, "sd", tmp_path)
    (folder / MODEL_INDEX).write_text(index)
    with pytest.raises(ConfigError, match=match):
        inspect_pipeline(str(folder))


def test_a_single_model_folder_or_nothing_is_told_apart(pipelines, tmp_path):
    with pytest.raises(ConfigError, match=r"has no model_index.json: it is a single model's folder"):
        inspect_pipeline(str(pipelines["sd"] / "unet"))
    with pytest.raises(ConfigError, match=r"no such folder"):
        inspect_pipeline(str(tmp_path / "nowhere"))


def test_the_tiny_pipeline_folders_are_what_diffusers_loads(pipelines):
    """The layout under test is diffusers' own: its loader reads the folder back (the SD family: the rest are
    written by the same save_pretrained)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(pipelines["sd"], safety_checker=None)
    assert type(pipe).__name__ == "StableDiffusionPipeline" and type(pipe.unet).__name__ == "UNet2DConditionModel"
