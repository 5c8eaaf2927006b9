"""The image carries what every shipped preset and every GPU lever needs: each preset's extras, derived from its
loaded config, are in the Dockerfile's install line.

An extra missing from the image is found by a GPU user, not by the suite: the run exits 2 naming
`pip install 'gentrain[X]'` inside an image they cannot pip-install into (seen: adamw8bit, captions for
mmdit-512, trackers, data.source=hf and LoRA). `extras_needed` reads a config the way the code decides
what to import, and the extras it may answer are held to the ones trainer/ names in its messages (every
`gentrain[X]` there, and `trainer.storage.EXTRAS` for store URLs), so a new optional feature fails here until
this table says which config keys turn it on. tests/test_image_install.py installs the same line in a venv and
checks that each extra's own gate in trainer/ passes there.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import tomllib
from conftest import REPO
from pydantic import BaseModel
from test_image_install import DOCKERFILE, dockerfile_install, extras_of
from test_presets import USER_DATA, USER_MODEL

from trainer.conditioning.text import TextEncoderConfig
from trainer.config.load import load_base, preset_names
from trainer.models.finetune import LoraSettings
from trainer.registry import load_config
from trainer.storage import EXTRAS as STORE_EXTRAS

PYPROJECT_EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
IMAGE_EXTRAS = extras_of(dockerfile_install()[1])

# Extras no config key turns on: what they gate is a command-line flag or a tool, not a training setting.
NOT_CONFIG = {"etcd": "`gentrain launch --rdzv-backend=etcd-v2`, a torchrun flag the k8s/overlays/etcd manifests pass"}
# Extras the image leaves out, and why (the Dockerfile says the same beside its install line).
NOT_IN_IMAGE = {
    "torchx": "runs where jobs are submitted, not in the training pods; pins urllib3<1.27",
    "docs": "builds the user guide",
    "test": "the suite's tools and servers",
    "inception": "torch-fidelity needs a torchvision built for the image's exact torch/CUDA build",
}


def _models(node: Any) -> Iterator[BaseModel]:
    """Every pydantic model inside a typed config section (nested sections, lists and dicts of them)."""
    if isinstance(node, BaseModel):
        yield node
        for name in type(node).model_fields:
            yield from _models(getattr(node, name))
    elif isinstance(node, list | tuple):
        for item in node:
            yield from _models(item)
    elif isinstance(node, dict):
        for item in node.values():
            yield from _models(item)


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, list | tuple):
        for item in node:
            yield from _strings(item)
    elif isinstance(node, dict):
        for item in node.values():
            yield from _strings(item)


def _models_of(cfg) -> list[BaseModel]:
    return list(_models(cfg.model_cfg))


# Extra -> whether a loaded config turns it on, decided as trainer/ decides it (each line names the gate).
# Store URLs are not here: any string in the config whose fsspec protocol is in trainer.storage.EXTRAS
# (data.urls, checkpoint.url, model.*.url, ...) needs that extra (trainer.storage.check_protocol).
GATES = {
    # trainer.data.video.import_av: clip folders, and clips in shards (trainer/data/__init__.py).
    "video": lambda cfg: cfg.data.source == "video" or (cfg.data.source == "shards" and cfg.data.num_frames > 1),
    # trainer.data.hf.import_datasets.
    "hf": lambda cfg: cfg.data.source == "hf",
    # trainer.conditioning.text.TextEncoder: a model.text (a TextEncoderConfig) anywhere in the model.
    "text": lambda cfg: any(isinstance(m, TextEncoderConfig) for m in _models_of(cfg)),
    # trainer.models.finetune.apply_lora: a model.lora anywhere in the model.
    "lora": lambda cfg: any(isinstance(m, LoraSettings) for m in _models_of(cfg)),
    # trainer.optim.adamw8bit_class: train.optimizer or any part's optim.<part>.name.
    "lowbit": lambda cfg: "adamw8bit" in (cfg.train.optimizer, *(o.name for o in cfg.optim.values())),
    # trainer.engine.float8.apply_float8: train.float8 other than none.
    "float8": lambda cfg: cfg.train.float8 != "none",
    # trainer.engine.report.tracker_names: log.report_to (and its aliases).
    "trackers": lambda cfg: bool(cfg.log.trackers) or cfg.log.all_installed,
    # trainer.eval.features.require_torchmetrics: FID/KID during training.
    "eval": lambda cfg: cfg.eval.every_steps > 0,
    # trainer.eval.features._inception: during training, or `gentrain eval` with the run's config.
    "inception": lambda cfg: cfg.eval.features == "inception",
}


def extras_needed(cfg) -> set[str]:
    """The extras a loaded config's run imports."""
    needed = {extra for extra, on in GATES.items() if on(cfg)}
    for value in _strings(cfg.to_dict()):
        protocol = fsspec.core.split_protocol(value)[0]
        if protocol in STORE_EXTRAS:
            needed.add(STORE_EXTRAS[protocol])
    return needed


def named_in_trainer() -> set[str]:
    """Every extra trainer/ tells a user to install (`pip install 'gentrain[X]'`), and the stores' extras."""
    named = set(STORE_EXTRAS.values())
    for path in (REPO / "trainer").rglob("*.py"):
        named |= set(re.findall(r"gentrain\[([\w-]+)\]", path.read_text()))
    return named


def _load(preset: str, *overrides: str):
    # The keys a preset's first comment line tells users to add (its data, a released pipeline's folder), as
    # tests/test_presets.py does.
    user = USER_DATA.get(load_base(preset)["data"]["source"], []) + USER_MODEL.get(preset, [])
    return load_config(preset, [*user, *overrides], environ={})


def test_every_extra_trainer_names_is_decided_from_the_config_or_is_a_flag():
    named = named_in_trainer()
    assert {"lowbit", "text", "trackers", "hf", "lora", "eval", "video", "s3", "gcs", "etcd"} <= named, named
    undecided = named - set(GATES) - set(STORE_EXTRAS.values()) - set(NOT_CONFIG)
    assert not undecided, f"trainer/ names extras no config key here turns on: {sorted(undecided)}"
    assert named <= set(PYPROJECT_EXTRAS), (
        f"trainer/ names extras pyproject.toml lacks: {named - set(PYPROJECT_EXTRAS)}"
    )


# Presets that need an extra the image leaves out (NOT_IN_IMAGE), each named here with the extra. shards-ddpm
# measures FID with eval.features=inception: in the image it exits 2 naming gentrain[inception] unless the
# user sets eval.features (digits, their own features URL) or eval.every_steps=0, or builds on the image
# with a torchvision that matches its torch and `pip install 'gentrain[inception]'`.
OUTSIDE_IMAGE = {"shards-ddpm": {"inception"}}


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_runs_with_the_image_extras(name):
    needed = extras_needed(_load(name))
    outside = OUTSIDE_IMAGE.get(name, set())
    assert outside <= needed, f"preset {name} no longer needs {sorted(outside - needed)}: drop it from OUTSIDE_IMAGE"
    assert outside <= set(NOT_IN_IMAGE)
    missing = needed - IMAGE_EXTRAS - outside
    assert not missing, f"preset {name} needs {sorted(missing)}, not in the Dockerfile's install line"


def test_the_presets_need_what_their_keys_say():
    # The derivation on the shipped presets themselves: captions, a shard store, nothing for the digits.
    assert "text" in extras_needed(_load("mmdit-512"))
    assert "text" in extras_needed(_load("digits-cascade-text"))
    assert extras_needed(_load("shards-ddpm")) == {"s3", "eval", "inception"}
    assert extras_needed(_load("digits-ddpm")) == set()


# Each GPU lever (preset, overrides) and the one extra it needs; train.compile needs none (inductor and
# triton come with torch's CUDA wheel).
LEVERS = {
    "adamw8bit": (("digits-ddpm", "train.optimizer=adamw8bit"), {"lowbit"}),
    "adamw8bit-per-part": (("digits-vqgan", "optim.discriminator.name=adamw8bit"), {"lowbit"}),
    "float8": (("dit-xl-256", "train.float8=true"), {"float8"}),
    "float8-rowwise": (("mmdit-512", "train.float8=rowwise"), {"float8", "text"}),
    "compile": (("dit-xl-256", "train.compile=true"), set()),
    "trackers": (("digits-ddpm", "log.report_to=tensorboard,wandb,mlflow"), {"trackers"}),
    "hf": (("digits-ddpm", "data.source=hf", "data.path=/data/set"), {"hf"}),
    "lora": (("digits-ddpm", "model.pretrained=/models/unet", "model.lora.rank=4"), {"lora"}),
    "text": (("digits-latent-mmdit",), {"text"}),
    "eval": (("digits-ddpm", "eval.every_steps=500"), {"eval"}),
    "video": (("moving-digits", "data.source=video", "data.path=/data/clips", "model.text=null"), {"video"}),
    "gcs": (("folder-ddpm", "checkpoint.url=gs://bucket/ckpt"), {"gcs"}),
}


@pytest.mark.parametrize("lever", sorted(LEVERS))
def test_every_gpu_lever_needs_an_extra_the_image_installs(lever):
    (preset, *overrides), extras = LEVERS[lever]
    assert extras_needed(_load(preset, *overrides)) == extras
    assert extras <= IMAGE_EXTRAS, f"{lever} needs {sorted(extras - IMAGE_EXTRAS)}, not in the Dockerfile"


def test_the_image_installs_every_feature_extra_and_says_why_it_leaves_the_rest_out():
    features = {"s3", "gcs", "video", "eval", "etcd", "lowbit", "float8", "text", "trackers", "hf", "lora"}
    assert features <= IMAGE_EXTRAS, f"the Dockerfile lacks {sorted(features - IMAGE_EXTRAS)}"
    assert not IMAGE_EXTRAS & set(NOT_IN_IMAGE), IMAGE_EXTRAS & set(NOT_IN_IMAGE)
    installed = set().union(*(PYPROJECT_EXTRAS[e] for e in IMAGE_EXTRAS))
    for extra, reqs in PYPROJECT_EXTRAS.items():
        if extra in IMAGE_EXTRAS or extra in NOT_IN_IMAGE:
            continue
        # The older single-tracker extras (tensorboard, wandb) are inside `trackers`.
        assert set(reqs) <= installed, f"extra {extra} is neither in the image nor in NOT_IN_IMAGE"
    text = DOCKERFILE.read_text()
    for extra in NOT_IN_IMAGE:
        assert re.search(rf"^#.*\b{extra}\b", text, re.M), f"the Dockerfile does not say why {extra} is left out"
