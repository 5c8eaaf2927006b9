"""Optimizer pieces: param groups, warmup + cosine values."""

from __future__ import annotations

import io
import json
import math
import re
import sys

import pytest
import safetensors.torch
import torch
from torch import nn

from trainer.checkpoint import join_tensors, quantized, split_tensors, write_safetensors
from trainer.optim import build_lr_schedule, build_optimizer, param_groups, state_bytes
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


# ---------------------------------------------------------------- adamw8bit (torchao)


# 8192 and 16384 values: torchao quantizes tensors of at least 4096 values that divide into 256-value blocks;
# the biases (128, 64) stay float32, as in every model.
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(8, 64, generator=g)).square().mean().backward()
        opt.step()


def _cfg(*overrides: str):
    return load_config(None, ["train.weight_decay=0.01", *overrides], environ={})


def test_unknown_optimizer_names_are_config_errors_listing_the_valid_ones():
    from trainer.errors import ConfigError

    for override in ("train.optimizer=lion", "optim.unet.name=adamw4bit"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [override], environ={})
        assert override.split("=")[0] in str(e.value) and "one of 'adamw' or 'adamw8bit'" in str(e.value)


def test_adamw8bit_without_torchao_names_the_extra(monkeypatch):
    from trainer.errors import ConfigError

    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # what `import torchao.optim` meets when absent
    with pytest.raises(ConfigError, match=r"gentrain\[lowbit\]"):
        build_optimizer(_net(), _cfg("train.optimizer=adamw8bit"))


def test_a_part_override_picks_the_optimizer():
    cfg = _cfg("train.optimizer=adamw8bit", "optim.unet.name=adamw")
    assert type(build_optimizer(_net(), cfg, "unet")) is torch.optim.AdamW
    assert type(build_optimizer(_net(), cfg, "disc")).__name__ == "AdamW8bit"


def test_8bit_state_takes_under_0_3_of_adamw_bytes():
    sizes = {}
    for name in ("adamw", "adamw8bit"):
        model = _net()
        opt = build_optimizer(model, _cfg(f"train.optimizer={name}"))
        _steps(model, opt, 1, seed=1)
        sizes[name] = state_bytes(opt)
    # AdamW: 2 float32 averages of 24,768 values + step counts. 8-bit: 1 byte each for the two weights'
    # averages plus a scale per 256 values and the 256-entry map, float32 for the two biases.
    assert sizes["adamw"] == 2 * 4 * (8192 + 128 + 8192 + 64) + 4 * 4
    assert sizes["adamw8bit"] <= 0.3 * sizes["adamw"]


def _through_checkpoint_format(state: dict) -> dict:
    """An optimizer state dict as a checkpoint stores and reads it: flattened, split into a JSON skeleton and
    a safetensors file (gentrain's writer, safetensors' reader), joined and rebuilt."""
    tensors, skeleton = split_tensors(quantized.flatten(state))
    buf = io.BytesIO()
    write_safetensors(buf, tensors, lambda _: None)
    read = safetensors.torch.load(buf.getvalue())
    return json.loads(json.dumps(skeleton)), read


def test_8bit_state_round_trips_through_the_checkpoint_format_bit_exactly():
    cfg = _cfg("train.optimizer=adamw8bit", "train.lr=1e-2")
    model = _net()
    opt = build_optimizer(model, cfg)
    _steps(model, opt, 3, seed=2)
    skeleton, tensors = _through_checkpoint_format(opt.state_dict())
    assert {t.dtype for k, t in tensors.items() if k.endswith(".codes")} == {torch.uint8}
    assert sum(k.endswith(".codes") for k in tensors) == 4  # two averages of each weight; no pickled subclass
    again_model = _net()
    again_model.load_state_dict(model.state_dict())
    again = build_optimizer(again_model, cfg)
    params = [p for g in again.param_groups for p in g["params"]]
    again.load_state_dict(quantized.rebuild(join_tensors(skeleton, tensors), params, "test"))
    for p, q in zip(model.parameters(), again_model.parameters(), strict=True):
        for k, v in opt.state[p].items():
            w = again.state[q][k]
            assert type(w) is type(v)
            for a, b in zip(quantized.plain_tensors(v), quantized.plain_tensors(w), strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), k
    # and both continue the same: same weights, bit for bit, after more steps on the same batches
    _steps(model, opt, 2, seed=3)
    _steps(again_model, again, 2, seed=3)
    for a, b in zip(model.parameters(), again_model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda e: e.update(codes=e["codes"].to(torch.int16)), "codes are torch.int16"),
        (lambda e: e.update(codes=e["codes"][:64]), "codes are torch.uint8 [64, 64]"),
        (lambda e: e.update(scale=e["scale"][:-1]), "one value per block"),
        (lambda e: e.update(qmap=e["qmap"][:128]), "qmap is torch.float32 [128]"),
        (lambda e: e.update({quantized.MARK: "torchao.optim.subclass_8bit.OptimState8bit"}), "unknown quantized"),
        (lambda e: e.update(dtype="I64"), "dtype='I64'"),
        (lambda e: e.pop("signed"), "quantized state has fields"),
    ],
)
def test_8bit_state_that_does_not_fit_is_a_corrupt_checkpoint(change, message):
    from trainer.errors import CheckpointCorrupt

    model = _net()
    opt = build_optimizer(model, _cfg("train.optimizer=adamw8bit"))
    _steps(model, opt, 1, seed=4)
    skeleton, tensors = _through_checkpoint_format(opt.state_dict())
    state = join_tensors(skeleton, tensors)
    change(state["state"][0]["exp_avg"])
    params = [p for g in opt.param_groups for p in g["params"]]
    with pytest.raises(CheckpointCorrupt, match=re.escape(message)):
        quantized.rebuild(state, params, "ckpt")


def test_adamw8bit_under_fsdp_is_a_config_error_saying_why():
    from trainer.errors import ConfigError

    for override in ("train.optimizer=adamw8bit", "optim.transformer.name=adamw8bit"):
        with pytest.raises(ConfigError, match=rf"{re.escape(override)} needs train.parallel=ddp: .*quantized per"):
            load_config(None, ["train.parallel=fsdp", override], environ={})


def test_a_checkpoint_resumes_only_with_the_optimizer_that_wrote_it():
    from types import SimpleNamespace

    from trainer.checkpoint.state import check_optimizer_name
    from trainer.checkpoint.validity import PartState
    from trainer.errors import ConfigError

    def part(name: str) -> SimpleNamespace:
        return SimpleNamespace(name="unet", settings=SimpleNamespace(optimizer=name))

    def saved(**fields) -> PartState:  # a part's record in trainer.json, as a resume parses it
        return PartState.model_validate({"step": 1, "optimizer": {}, **fields})

    check_optimizer_name(saved(optimizer_name="adamw8bit"), part("adamw8bit"), "ckpt")
    check_optimizer_name(saved(), part("adamw"), "ckpt")  # written before train.optimizer: adamw
    for record, live in [(saved(), "adamw8bit"), (saved(optimizer_name="adamw8bit"), "adamw")]:
        with pytest.raises(ConfigError, match=r"ckpt: part 'unet' was trained with optimizer \w+, this run builds"):
            check_optimizer_name(record, part(live), "ckpt")


def test_8bit_state_in_a_part_whose_optimizer_keeps_none_is_a_corrupt_checkpoint():
    from trainer.errors import CheckpointCorrupt

    model = _net()
    opt = build_optimizer(model, _cfg("train.optimizer=adamw8bit"))
    _steps(model, opt, 1, seed=5)
    state = join_tensors(*_through_checkpoint_format(opt.state_dict()))
    params = [p for g in opt.param_groups for p in g["params"]]
    with pytest.raises(CheckpointCorrupt, match="this run's optimizer keeps no quantized state"):
        quantized.rebuild(state, params, "ckpt", quantizes=False)


def test_torchaos_import_noise_is_dropped_and_nothing_else(caplog):
    """trainer/__init__.py drops what importing diffusers logs when torchao is installed; the same loggers'
    other warnings still reach the log."""
    import logging

    import trainer  # noqa: F401 (installs the filters)

    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load %s: %s", "/x/torchao/_C_mxfp8.so", "no CUDA")
        logging.getLogger("torchao.kernel.intmm").warning("Warning: Detected no triton, on systems ...")
        logging.getLogger("torch.utils._pytree").warning("%s is an Enum subclass and is ...", "KernelPreference")
        logging.getLogger("torchao").warning("a real torchao warning")
    assert [r.getMessage() for r in caplog.records] == ["a real torchao warning"]
