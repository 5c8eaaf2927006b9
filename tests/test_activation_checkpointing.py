"""Activation checkpointing (`train.activation_checkpointing`, trainer/engine/remat.py): a tiny DiT and a
tiny UNet (both with dropout) trained a few steps with their blocks checkpointed (`blocks`, and op-level
`selective`) end with the weights of the same steps without checkpointing, to the bit (the recomputation runs
the same ops on the same inputs, and replays the RNG state for dropout); the blocks really run twice per step;
a cascade stage's own diffusers checkpointing is replaced; a task with no blocks is refused naming it. In
process, tiny models. The engine path under torchrun (a SIGKILLed rank resumes bit-identical with
`blocks` under FSDP) is in tests/test_diffusion_fsdp.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.diffusion import build_backbone
from trainer.engine.remat import apply_activation_checkpointing, checkpoint_blocks, checkpointed_blocks
from trainer.engine.shard import fsdp_units
from trainer.errors import ConfigError
from trainer.registry import load_config
from trainer.tasks.base import TaskContext
from trainer.tasks.cascade import CascadeConfig, CascadeTask, StageConfig

CASES = {
    "dit": {"kind": "dit", "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8, "dropout": 0.1},
    "unet": {"kind": "unet", "block_out_channels": [8, 16], "norm_num_groups": 4, "dropout": 0.1},
}


def _inner(case: str, model: nn.Module) -> nn.Module:
    """A module inside the first block: its forward runs once per step, twice when the block is recomputed."""
    return model.transformer_blocks[0].ff if case == "dit" else model.down_blocks[0].resnets[0]


def _train(case: str, mode: str, steps: int = 3):
    """`steps` AdamW steps of a tiny backbone (dropout on); (weights, first step's gradients, inner calls)."""
    torch.manual_seed(0)
    backbone = build_backbone(CASES[case], 8, 1, num_classes=10)
    model = backbone.model
    units = checkpoint_blocks(model, mode)
    assert checkpointed_blocks(model) == (units if mode != "none" else [])
    calls = []
    _inner(case, model).register_forward_hook(lambda *_: calls.append(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    grads = None
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 1, 8, 8, generator=g)
        t = torch.randint(0, 1000, (4,), generator=g)
        labels = torch.randint(0, 10, (4,), generator=g)
        torch.manual_seed(100 + step)  # the engine reseeds the global RNG (dropout) per chunk
        loss = (backbone(x, t, {"labels": labels}) - x).square().mean()
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}, grads, len(calls) // steps


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointed_blocks_train_bit_identical_and_run_twice(case):
    plain, plain_grads, once = _train(case, "none")
    assert once == 1
    for mode in ("blocks", "selective"):
        weights, grads, calls = _train(case, mode)
        assert calls == 2, f"{mode}: the first block's inner module ran {calls} times per step"
        assert grads.keys() == plain_grads.keys()
        for name in plain_grads:  # same ops on the same inputs, dropout masks replayed: equal, not close
            assert torch.equal(grads[name], plain_grads[name]), (mode, name)
        for name in plain:
            assert torch.equal(weights[name], plain[name]), (mode, name)


def test_checkpointing_keeps_names_and_skips_no_grad_forwards():
    torch.manual_seed(0)
    model = build_backbone(CASES["dit"], 8, 1, num_classes=10).model
    names = list(model.state_dict())
    units = checkpoint_blocks(model, "blocks")
    assert units == fsdp_units(model) == list(model.transformer_blocks)
    assert type(units[0]).__name__ == "BasicTransformerBlock" and list(model.state_dict()) == names
    assert checkpoint_blocks(model, "blocks") == units  # idempotent: no block checkpointed twice
    calls = []
    model.transformer_blocks[0].ff.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        model(torch.randn(2, 1, 8, 8), torch.tensor([1, 2]), class_labels=torch.tensor([0, 1]))
    assert len(calls) == 1


def test_a_cascade_stages_own_checkpointing_is_replaced_and_blockless_tasks_are_refused():
    s = StageConfig(image_size=8, block_out_channels=[8, 16], norm_num_groups=4, gradient_checkpointing=True)
    task = CascadeTask(CascadeConfig(stages=[s]), TaskContext(8, 1, 0))
    modules = task.build({})
    stage = modules["stage1"]
    assert stage.unet.is_gradient_checkpointing
    apply_activation_checkpointing(modules, ["stage1"], "blocks", "cascade")
    assert not stage.unet.is_gradient_checkpointing
    units = checkpointed_blocks(stage)
    assert units == fsdp_units(stage) and {*stage.unet.down_blocks, *stage.unet.up_blocks} <= set(units)

    flat = {"net": nn.Sequential(nn.Linear(2, 2), nn.ReLU())}
    apply_activation_checkpointing(flat, ["net"], "none", "probe")  # none: nothing asked, nothing refused
    with pytest.raises(ConfigError, match=r"selective: the probe task's parts \(net\) have no blocks"):
        apply_activation_checkpointing(flat, ["net"], "selective", "probe")


def test_the_key_takes_three_modes():
    assert load_config(None, ["train.activation_checkpointing=selective"], environ={}).train.activation_checkpointing
    assert load_config(None, [], environ={}).train.activation_checkpointing == "none"
    with pytest.raises(ConfigError, match="one of 'none', 'blocks' or 'selective'"):
        load_config(None, ["train.activation_checkpointing=all"], environ={})
