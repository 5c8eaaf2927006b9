"""A backbone is one module that declares what it takes and offers, and tasks are plug-ins (issue 37): every
registered backbone builds (on the meta device, tiny) and declares everything tasks ask of it; the ddpm and
cascade config unions are derived from the registry; no module of trainer/tasks/ imports a task module, and
task modules import only the layers below them; frozen runs are told by a declared kind."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path
from typing import get_args

import pytest
import torch
from pydantic import BaseModel
from tiny_backbones import TINY, missing_kinds, tiny_backbone

import trainer.diffusion.backbones as backbones_pkg
from trainer.diffusion.backbones import BACKBONES, Backbone, BackboneConfig, backbone_class, kinds, parse_backbone
from trainer.diffusion.stages import StageBackboneConfig
from trainer.registry import builtin_tasks, task_class
from trainer.tasks.ddpm import DiffusionModelConfig

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "trainer" / "tasks"


def test_the_literal_registry_lists_every_module_of_the_package_that_sets_backbone():
    found = {}
    for info in pkgutil.iter_modules(backbones_pkg.__path__):
        cls = getattr(importlib.import_module(f"trainer.diffusion.backbones.{info.name}"), "BACKBONE", None)
        if cls is not None:
            found[cls.kind] = cls
    assert found == BACKBONES, "a backbone module's class is missing from _REGISTERED (or listed without one)"
    assert list(BACKBONES) == sorted(BACKBONES, key=lambda kind: (BACKBONES[kind].order, kind))
    assert not missing_kinds(), f"backbone kinds without an entry in tests/tiny_backbones.py TINY: {missing_kinds()}"
    assert set(TINY) <= set(BACKBONES), f"TINY entries of no registered kind: {sorted(set(TINY) - set(BACKBONES))}"


@pytest.mark.parametrize("kind", list(BACKBONES))
def test_every_backbone_declares_what_it_takes_and_offers_and_builds_tiny(kind):
    cls = BACKBONES[kind]
    assert issubclass(cls, Backbone) and cls.kind == kind
    assert issubclass(cls.Config, BaseModel) and cls.Config.model_fields["kind"].default == kind
    assert isinstance(cls.order, int) and cls.part in ("unet", "transformer")
    assert isinstance(cls.takes_labels, bool) and cls.stage_conditioning in (None, "labels", "tokens")
    assert cls.pipeline is None or cls.pipeline.endswith("Pipeline")
    assert cls.captions() in ("always", "optional", "never")

    c = parse_backbone(tiny_backbone(kind))
    assert type(c) is cls.Config and backbone_class(c) is cls
    assert set(cls.config_hints("model.backbone").values()) >= {"data.channels"}
    with torch.device("meta"):
        b = cls.build(c, 8, 3, num_classes=4 if cls.takes_labels else None)
    assert isinstance(b, cls) and all(p.is_meta for p in b.parameters())
    assert b.fsdp_units and b.fsdp_unit_classes  # FSDP and activation checkpointing have blocks to wrap
    # What it declares is what the built module takes.
    assert ("labels" in b.accepts) == cls.takes_labels
    width = cls.caption_width(c)
    assert ("captions" in b.accepts) == (width is not None)
    assert (cls.captions() == "always") == ("captions" in b.requires)
    assert ("pooled" in b.accepts) == (cls.pooled_width(c) is not None)
    if cls.stage_conditioning == "tokens":
        assert width is not None, "a stage feeds its conditions as caption tokens"
    _check_float8_and_lora_declarations(cls, b.model)


def _check_float8_and_lora_declarations(cls, model: torch.nn.Module) -> None:
    """What a kind declares for float8 and LoRA names layers its model has: every per-sample fragment and
    every LoRA target matches one, and float8 converts attention projections (the engine asks only this)."""
    from trainer.engine.float8 import declared_models, float8_layers

    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)]
    for target in cls.lora_targets:
        assert any(n == target or n.endswith(f".{target}") for n in names), (cls.kind, target)
    if cls.float8_per_sample is None:
        assert declared_models(model) == []
        return
    assert declared_models(model) == [("", model, cls.float8_per_sample)]
    for fragment in cls.float8_per_sample:
        assert any(fragment in n for n in names), f"{cls.kind} declares {fragment!r}, which names no layer"
    convert, kept = float8_layers(model, "tensorwise", sized=False)
    assert kept == [] and {n.rsplit(".", 1)[-1] for n in convert} >= {"to_q", "to_k", "to_v"}
    assert not [n for n in convert if any(f in n for f in cls.float8_per_sample)]


def test_mmdit_converts_both_token_streams_to_float8_and_keeps_its_modulations():
    """Both streams of an MMDiT block are token-level: the caption stream's attention and MLP (`ff_context`)
    convert like the image stream's; the adaLN modulations and embeddings stay in bf16."""
    from trainer.engine.float8 import float8_layers

    spec = tiny_backbone("mmdit", attention_head_dim=16, caption_channels=32, pooled_channels=32)
    with torch.device("meta"):
        model = BACKBONES["mmdit"].build(parse_backbone(spec), 8, 4).model
    convert, _ = float8_layers(model, "tensorwise", sized=False)
    block0 = {n.removeprefix("transformer_blocks.0.") for n in convert if n.startswith("transformer_blocks.0.")}
    assert {"ff_context.net.0.proj", "ff_context.net.2", "attn.add_q_proj", "attn.to_add_out", "ff.net.2"} <= block0
    assert not [n for n in convert if "norm" in n or "embed" in n or n == "proj_out"]


def test_the_config_unions_are_derived_from_the_registry():
    assert kinds() == list(BACKBONES)
    ddpm = DiffusionModelConfig.model_fields["backbone"].annotation
    union = get_args(get_args(ddpm)[0])[0]  # Annotated[A | B ..., discriminator] | None
    assert set(get_args(union)) == {cls.Config for cls in BACKBONES.values()}
    assert set(get_args(get_args(BackboneConfig)[0])) == {cls.Config for cls in BACKBONES.values()}
    staged = {cls.Config for cls in BACKBONES.values() if cls.stage_conditioning}
    assert set(get_args(get_args(StageBackboneConfig)[0])) == staged and staged


def test_one_unet_schema():
    from trainer.diffusion.backbones.unet import UNetBackboneConfig, UNetShape
    from trainer.diffusion.config import NoiseConfig
    from trainer.diffusion.stages import StageConfig

    for schema in (UNetBackboneConfig, NoiseConfig, DiffusionModelConfig, StageConfig):
        assert issubclass(schema, UNetShape), schema
    shape = set(UNetShape.model_fields)
    assert shape <= set(DiffusionModelConfig.model_fields) and shape <= set(StageConfig.model_fields)


# ---------------------------------------------------------------- tasks are plug-ins


def _trainer_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a trainer module (`from a import b` also yields `a.b`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, m) for line, m in out if m == "trainer" or m.startswith("trainer.")]


def _task_modules() -> set[str]:
    return {f"trainer.tasks.{name.replace('-', '_')}" for name in builtin_tasks()}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_module_of_tasks_imports_a_task_module():
    tasks = _task_modules()
    assert {"trainer.tasks.ddpm", "trainer.tasks.cascade", "trainer.tasks.vqgan"} <= tasks
    found = [
        f"{path.name}:{line} imports {module}"
        for path in sorted(TASKS.glob("*.py"))
        for line, module in _trainer_imports(path)
        if any(_under(module, t) for t in tasks)
    ]
    assert found == []


# What a task module may import: the Task interface and the bases of tasks/ that are not tasks (base_*.py,
# sampling.py), the model layers beneath, and the leaves.
_TASKS_MAY_IMPORT = (
    "trainer.tasks.base",
    "trainer.tasks.base_gan",
    "trainer.tasks.base_maskgit",
    "trainer.tasks.sampling",
    "trainer.models",
    "trainer.diffusion",
    "trainer.conditioning",
    "trainer.errors",
    "trainer.randomness",
    "trainer.registry",
    "trainer.task_types",
)


def test_modules_of_tasks_import_only_the_interface_models_diffusion_and_conditioning():
    found = [
        f"{path.name}:{line} imports {module}"
        for path in sorted(TASKS.glob("*.py"))
        if path.stem != "base"  # the interface asks the engine's services by intent (docs/architecture.md)
        for line, module in _trainer_imports(path)
        if not any(_under(module, allowed) for allowed in _TASKS_MAY_IMPORT)
    ]
    assert found == []


def test_models_and_the_diffusion_core_import_no_task():
    found = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for folder in ("models", "diffusion")
        for path in sorted((REPO / "trainer" / folder).rglob("*.py"))
        for line, module in _trainer_imports(path)
        if _under(module, "trainer.tasks")
    ]
    assert found == []


def test_frozen_runs_are_told_by_the_kind_their_task_declares():
    declared = {name: task_class(name).frozen_kind for name in builtin_tasks()}
    assert declared == {
        "autoencoder": "kl-autoencoder",
        "cascade": None,
        "ddpm": None,
        "maskgit": None,
        "video-maskgit": None,
        "video-tokenizer": "video-tokenizer",
        "vqgan": "image-tokenizer",
    }
    assert task_class("maskgit").tokenizer_kind == "image-tokenizer"
    assert task_class("video-maskgit").tokenizer_kind == "video-tokenizer"
    # The GAN autoencoders share one skeleton.
    from trainer.tasks.base_gan import GANAutoencoderTask

    assert all(issubclass(task_class(n), GANAutoencoderTask) for n in ("autoencoder", "vqgan", "video-tokenizer"))
