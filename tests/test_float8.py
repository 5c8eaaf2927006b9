"""float8 training (`train.float8`): refused where there are no float8 tensor cores, converts only the layers
torchao's size thresholds say it speeds up (refusing a model with none), keeps checkpoint names and dtypes plain;
on a GPU with float8 tensor cores (bench/gpu_owed.sh runs this file there), trains a DiT, resumes without
float8, and composes with compile under DDP and FSDP2. The CPU tests run in every suite.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

from trainer.elastic import DistEnv
from trainer.errors import ConfigError
from trainer.loop import Trainer
from trainer.registry import load_config

CUDA = torch.cuda.is_available()


@pytest.mark.skipif(CUDA and torch.cuda.get_device_capability() >= (8, 9), reason="this GPU has float8")
def test_float8_is_refused_without_float8_tensor_cores(tmp_path):
    dit = "{kind: dit, num_layers: 1, num_attention_heads: 2, attention_head_dim: 16, patch_size: 2}"
    cfg = load_config("digits-ddpm", tiny(tmp_path, f"model.backbone={dit}", "train.float8=true"), environ={})
    assert cfg.train.float8 == "tensorwise"
    with pytest.raises(ConfigError, match="train.float8=tensorwise: float8 matmuls need an NVIDIA GPU"):
        Trainer(cfg, DistEnv())


def test_float8_keeps_the_parameter_names_so_checkpoints_stay_plain():
    from torchao.float8 import convert_to_float8_training

    from trainer.diffusion.backbones.dit import DiTBackbone, DiTBackboneConfig
    from trainer.engine.float8 import float8_layers

    def dit():
        torch.manual_seed(0)
        shape = DiTBackboneConfig(num_attention_heads=2, attention_head_dim=16, num_layers=2, patch_size=2)
        return DiTBackbone.build(shape, sample_size=8, channels=1).model

    chosen = set(float8_layers(dit(), "tensorwise", sized=False)[0])
    plain, converted = dit(), convert_to_float8_training(dit(), module_filter_fn=lambda m, fqn: fqn in chosen)
    assert any(type(m).__name__ == "Float8Linear" for m in converted.modules())
    a, b = plain.state_dict(), converted.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def _meta_dit(layers: int, heads: int, dim: int):
    from trainer.diffusion.backbones.dit import DiTBackbone, DiTBackboneConfig

    shape = DiTBackboneConfig(num_layers=layers, num_attention_heads=heads, attention_head_dim=dim, patch_size=2)
    with torch.device("meta"):  # shapes only: DiT-XL/2's 718M parameters take no memory
        return DiTBackbone.build(shape, sample_size=32, channels=1, num_classes=10).model


def test_float8_converts_the_layers_large_enough_to_be_faster():
    """torchao's size thresholds per recipe (its H100 benchmarks): DiT-XL/2's attention and MLP linears all
    convert with tensorwise, only the MLP's first with rowwise; a DiT-S/2's MLP first layer with tensorwise.
    Without the thresholds (the suite's emulated float8) every eligible layer converts."""
    from trainer.engine.float8 import float8_layers

    xl, small = _meta_dit(28, 16, 72), _meta_dit(12, 6, 64)
    convert, kept = float8_layers(xl, "tensorwise")
    assert len(convert) == 28 * 6 and kept == []
    convert, kept = float8_layers(xl, "rowwise")
    assert len(convert) == 28 and all(n.endswith("ff.net.0.proj") for n in convert) and len(kept) == 28 * 5
    convert, kept = float8_layers(small, "tensorwise")
    assert [n for n in convert if not n.endswith("ff.net.0.proj")] == [] and len(convert) == 12 and len(kept) == 60
    assert float8_layers(small, "rowwise")[0] == []
    assert len(float8_layers(small, "rowwise", sized=False)[0]) == 12 * 6
    assert {n.rsplit(".", 1)[-1] for n in float8_layers(small, "rowwise")[1]} >= {"to_q", "to_k", "to_v", "proj", "2"}


def test_float8_leaves_pixarts_per_sample_adaln_in_bf16():
    from trainer.diffusion import build_backbone
    from trainer.engine.float8 import float8_layers

    spec = {"kind": "pixart", "patch_size": 2, "num_layers": 1, "num_attention_heads": 16, "attention_head_dim": 72}
    with torch.device("meta"):
        model = build_backbone({**spec, "caption_channels": 4096}, 64, 4).model
    convert, kept = float8_layers(model, "tensorwise")
    assert "adaln_single.linear" in dict(model.named_modules())  # batch rows: the timestep's modulation
    assert not [n for n in convert + kept if not n.startswith("transformer_blocks.0.")], convert
    assert len(convert) == 10 and kept == []  # self and cross attention (4 + 4), the MLP (2)


def test_float8_keeps_small_layers_in_bf16_and_refuses_a_model_with_none_large_enough(monkeypatch, caplog):
    import trainer.engine.float8 as float8

    # The device check (a float8 GPU) is not what this tests; past it, the conversion is the real one.
    monkeypatch.setattr(float8, "check_float8_device", lambda recipe, device: None)
    monkeypatch.delenv(float8.TEST_EMULATE, raising=False)
    small = _meta_dit(12, 6, 64)
    with caplog.at_level("INFO", logger="gentrain"):
        assert float8.apply_float8({"transformer": small}, ["transformer"], "tensorwise", torch.device("cpu"), "ddpm")
    assert sum(type(m).__name__ == "Float8Linear" for m in small.modules()) == 12
    assert (
        "float8 (tensorwise scaling): 12 linear layers of transformer; kept in bf16, too small for float8 to be "
        "faster (torchao's thresholds): 60 of transformer (1536x384 (x12), 384x384 (x48))"
    ) in caplog.text
    with pytest.raises(ConfigError) as e:
        float8.apply_float8({"transformer": _meta_dit(12, 6, 64)}, ["transformer"], "rowwise", torch.device("cpu"), "d")
    assert "train.float8=rowwise: no linear layer of transformer is large enough for float8 to be faster" in str(
        e.value
    )
    assert "384x1536 (x12), 1536x384 (x12), 384x384 (x48)" in str(e.value) and "try train.float8=tensorwise" in str(
        e.value
    )
    with pytest.raises(ConfigError, match=r"in x out: transformer: 32x128 \(x2\), 128x32 \(x2\), 32x32 \(x8\)"):
        float8.apply_float8(
            {"transformer": _meta_dit(2, 2, 16)}, ["transformer"], "tensorwise", torch.device("cpu"), "d"
        )


@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() >= (8, 9)), reason="needs float8 tensor cores")
def test_float8_trains_a_dit_on_the_gpu_and_resumes_without_it(tmp_path):
    # width 384: the MLPs' first layers (384 -> 1,536) are above torchao's tensorwise thresholds
    dit = "{kind: dit, num_layers: 2, num_attention_heads: 4, attention_head_dim: 96, patch_size: 2}"
    base = [f"model.backbone={dit}", "model.num_classes=10", "data.image_size=32", "train.precision=bf16"]
    cfg = load_config("digits-ddpm", tiny(tmp_path, *base, "train.float8=tensorwise", max_steps=3), environ={})
    assert Trainer(cfg, DistEnv()).fit() == 0
    cfg = load_config("digits-ddpm", tiny(tmp_path, *base, max_steps=5), environ={})
    trainer = Trainer(cfg, DistEnv())
    assert trainer.fit() == 0 and trainer.checkpoints.resumed_from and trainer.progress.step == 5


@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() >= (8, 9)), reason="needs float8 tensor cores")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_float8_with_compile_trains_under_ddp_and_fsdp2_and_the_weights_stay_plain(parallel, tmp_path):
    # The engine's order (trainer.loop: float8, then compile of the blocks, then the wrapper) on a world of one
    # NCCL rank: one GPU cannot hold two NCCL ranks, so this checks the composition (torchao's Float8Linear
    # under DDP's hooks and FSDP2's DTensor parameters, each block compiled), not the collectives across GPUs.
    import torch.distributed as dist
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save
    from torch.nn.parallel import DistributedDataParallel

    from trainer.diffusion.backbones.dit import DiTBackbone, DiTBackboneConfig
    from trainer.engine.compile import compile_blocks
    from trainer.engine.float8 import apply_float8
    from trainer.engine.shard import shard_module

    def dit():  # as the ddpm task builds it (its FSDP units and the unit kept gathered)
        torch.manual_seed(0)
        # width 384: the MLPs' first layers (384 -> 1,536) are above torchao's tensorwise thresholds
        shape = DiTBackboneConfig(num_layers=2, num_attention_heads=4, attention_head_dim=96)
        return DiTBackbone.build(shape, sample_size=16, channels=1, num_classes=10).model

    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1, device_id=device)
    try:
        plain, model = dit().to(device), dit().to(device)
        assert apply_float8({"transformer": model}, {"transformer"}, "tensorwise", device, "ddpm") > 0
        assert compile_blocks(model)
        wrapped = (
            DistributedDataParallel(model, device_ids=[0]) if parallel == "ddp" else shard_module(model, "bf16", False)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator(device).manual_seed(1)
        losses = []
        for _ in range(4):
            x = torch.randn(16, 1, 16, 16, device=device, generator=g)
            t = torch.randint(0, 1000, (16,), device=device, generator=g)
            labels = torch.randint(0, 10, (16,), device=device, generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(wrapped(x, timestep=t, class_labels=labels).sample.float(), x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert all(torch.isfinite(torch.tensor(losses))), losses
        state = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()
        }
        assert state.keys() == plain.state_dict().keys()
        assert all(type(v) is torch.Tensor and v.dtype == plain.state_dict()[k].dtype for k, v in state.items())
        assert any(not torch.equal(state[k], v) for k, v in plain.state_dict().items())  # it learned
        plain.load_state_dict(st_load(st_save({k: v.contiguous() for k, v in state.items()})), strict=True)
    finally:
        dist.destroy_process_group()
