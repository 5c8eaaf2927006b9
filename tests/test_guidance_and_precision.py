"""Training features end to end on CPU: v-prediction with classifier-free guidance, mixed precision."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli, tiny
from PIL import Image

from trainer.elastic import DistEnv
from trainer.loop import Trainer
from trainer.registry import load_config
from trainer.tasks.sampling import SampleRequest


@pytest.mark.slow
def test_class_conditional_v_prediction_with_guidance(tmp_path):
    r = run_cli(
        "train",
        "digits-cfg",
        *tiny(tmp_path, "sample.num=10", "sample.guidance_scale=3.0", "model.norm_num_groups=4", max_steps=4),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    grid = Image.open(tmp_path / "run" / "samples" / "step-000000004.png")
    assert grid.size[0] > 0
    out = tmp_path / "g.png"
    r = run_cli(
        "sample",
        str(tmp_path / "run" / "checkpoints"),
        "--num",
        "10",
        "--steps",
        "2",
        "--guidance-scale",
        "5",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-3000:]


def test_guidance_changes_samples_and_labels_select_classes(tmp_path):
    cfg = load_config(
        "digits-cfg", tiny(tmp_path, "model.norm_num_groups=4", "checkpoint.every_steps=0", max_steps=2), environ={}
    )
    t = Trainer(cfg, DistEnv())
    assert t.fit() == 0
    modules = {n: p.module.eval() for n, p in t.parts.items()}
    request = SampleRequest(num=4, seed=3, inference_steps=3)
    plain = t.task.sample(modules, request.replace(guidance_scale=1.0), t.device)
    guided = t.task.sample(modules, request.replace(guidance_scale=4.0), t.device)
    assert not torch.equal(plain, guided)
    again = t.task.sample(modules, request.replace(guidance_scale=4.0), t.device)
    assert torch.equal(guided, again)  # seeded
    fives = t.task.sample(modules, request.replace(guidance_scale=4.0, labels=torch.full((4,), 5)), t.device)
    assert not torch.equal(fives, guided)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_checkpoints_the_loss_scaler(tmp_path, precision):
    cfg = load_config(None, tiny(tmp_path, f"train.precision={precision}", max_steps=3), environ={})
    t = Trainer(cfg, DistEnv())
    assert t.fit() == 0
    part = t.parts["unet"]
    assert all(p.dtype == torch.float32 for p in part.module.parameters())  # fp32 master weights
    assert all(torch.isfinite(p).all() for p in part.module.parameters())
    import json

    doc = json.loads((tmp_path / "run" / "checkpoints" / "step-000000003" / "trainer.json").read_text())
    scaler = doc["parts"]["unet"]["scaler"]
    if precision == "fp16":
        assert scaler["scale"] > 0  # GradScaler state is part of the checkpoint
    else:
        assert scaler == {}
