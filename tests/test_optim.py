"""Optimizer pieces: param groups, warmup + cosine values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer.optim import build_lr_schedule, build_optimizer, param_groups
from trainer.registry import load_config


def test_no_weight_decay_on_biases_and_norms():
    m = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Linear(4, 2))
    decay, no_decay = param_groups(m, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.ndim for p in decay["params"]} == {2, 4}  # conv and linear weights
    assert all(p.ndim == 1 for p in no_decay["params"])  # biases, GroupNorm scale and shift
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(m.parameters()))


def lrs(overrides, steps):
    cfg = load_config(None, overrides, environ={})
    opt = build_optimizer(nn.Linear(2, 2), cfg)
    sched = build_lr_schedule(opt, cfg)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_linear_warmup_then_cosine_to_zero():
    lr, warm, total = 1e-3, 10, 110
    got = lrs([f"train.lr={lr}", f"train.warmup_steps={warm}", f"train.max_steps={total}"], total + 1)
    for s in range(warm):
        assert got[s] == pytest.approx(lr * s / warm)
    for s in range(warm, total + 1):
        progress = (s - warm) / (total - warm)
        assert got[s] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * progress)), abs=1e-12)
    assert got[warm] == pytest.approx(lr)
    assert got[warm + (total - warm) // 2] == pytest.approx(lr / 2)
    assert got[total] == pytest.approx(0.0, abs=1e-12)


def test_constant_schedule_after_warmup():
    got = lrs(["train.lr=0.01", "train.warmup_steps=4", "train.lr_schedule=constant", "train.max_steps=20"], 20)
    assert got[:4] == pytest.approx([0, 0.0025, 0.005, 0.0075])
    assert got[4:] == pytest.approx([0.01] * 16)


def test_diffusers_schedules_after_warmup():
    lr, warm, total = 0.01, 4, 24
    base = [f"train.lr={lr}", f"train.warmup_steps={warm}", f"train.max_steps={total}"]
    steps = range(warm, total + 1)
    progress = [(s - warm) / (total - warm) for s in steps]
    linear = lrs([*base, "train.lr_schedule=linear"], total + 1)
    assert linear[:warm] == pytest.approx([lr * s / warm for s in range(warm)])
    assert linear[warm:] == pytest.approx([lr * (1 - p) for p in progress], abs=1e-12)
    # polynomial decays to diffusers' lr_end (1e-7); power 1 is a line to it, power 2 a parabola
    end = 1e-7
    for power in (1.0, 2.0):
        poly = lrs([*base, "train.lr_schedule=polynomial", f"train.lr_power={power}"], total + 1)
        assert poly[warm:] == pytest.approx([(lr - end) * (1 - p) ** power + end for p in progress], abs=1e-12)
    # two hard restarts: cosine from lr to 0 over each half
    restarts = lrs([*base, "train.lr_schedule=cosine_with_restarts", "train.lr_num_cycles=2"], total)
    half = (total - warm) // 2
    for k, s in enumerate(range(warm, total)):
        within = (k % half) / half
        assert restarts[s] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * within)), abs=1e-12)
    assert lrs([*base, "train.lr_schedule=constant_with_warmup"], total) == lrs(
        [*base, "train.lr_schedule=constant"], total
    )


def test_a_resumed_schedule_continues_exactly():
    cfg = load_config(
        None, ["train.warmup_steps=3", "train.max_steps=30", "train.lr_schedule=cosine_with_restarts"], environ={}
    )
    opt = build_optimizer(nn.Linear(2, 2), cfg)
    sched = build_lr_schedule(opt, cfg)
    for _ in range(11):
        opt.step()
        sched.step()
    state = sched.state_dict()
    again = build_lr_schedule(build_optimizer(nn.Linear(2, 2), cfg), cfg)
    again.load_state_dict(state)
    for _ in range(19):
        assert again.get_last_lr() == sched.get_last_lr()
        opt.step()
        sched.step()
        again.optimizer.step()
        again.step()


def test_min_snr_weights_match_the_paper():
    from trainer.diffusion import min_snr_weights

    snr = torch.tensor([0.5, 5.0, 50.0])
    eps = min_snr_weights(snr, 5.0, "epsilon")
    v = min_snr_weights(snr, 5.0, "v_prediction")
    assert torch.allclose(eps, torch.tensor([1.0, 1.0, 0.1]))
    assert torch.allclose(v, torch.tensor([0.5 / 1.5, 5 / 6, 5 / 51]))
