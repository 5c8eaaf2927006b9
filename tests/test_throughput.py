"""FLOPs per step counted once from the model (FlopCounterMode), the peak they are compared with, MFU."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from trainer.engine.throughput import Throughput, gpu_peak, measure_cpu_matmul_peak


def test_gpu_peaks_by_name_and_precision():
    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16", tf32=True) == 989e12
    assert gpu_peak("NVIDIA H100 PCIe", "fp16", tf32=True) == 756e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "no", tf32=True) == 156e12
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "no", tf32=False) == 19.5e12
    assert gpu_peak("NVIDIA L40S", "bf16", tf32=True) == 362e12  # not the L4 entry
    assert gpu_peak("Some Future GPU", "bf16", tf32=True) is None


def test_a_step_is_counted_once_from_its_operators():
    batch, fan_in, fan_out = 8, 32, 16
    net = nn.Linear(fan_in, fan_out)
    x = torch.randn(batch, fan_in)
    tp = Throughput(torch.device("cpu"), "no", tf32=True)
    assert tp.peak > 0 and "cpu float32 matmul" in tp.peak_source
    with tp.counting():
        net(x).square().mean().backward()
    # forward x @ W^T and backward dL/dW (x needs no gradient): two matmuls of 2 * batch * fan_in * fan_out
    assert tp.flops_per_step == 2 * 2 * batch * fan_in * fan_out
    with tp.counting():  # later steps are not counted again
        net(torch.randn(4 * batch, fan_in)).sum().backward()
    assert tp.flops_per_step == 2 * 2 * batch * fan_in * fan_out
    rates = tp.rates(0.5)
    assert rates["flops_per_s"] == tp.flops_per_step / 0.5
    assert rates["mfu"] == pytest.approx(rates["flops_per_s"] / tp.peak)


def test_counting_changes_nothing_the_step_computes():
    def step(count: bool) -> torch.Tensor:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 12), nn.Dropout(0.5), nn.Linear(12, 3))
        tp = Throughput.__new__(Throughput)  # no peak needed here
        tp.flops_per_step, tp.peak, tp.peak_source = (None if count else 0), None, "none"
        with tp.counting():
            net(torch.randn(5, 6)).sum().backward()
        return torch.cat([p.grad.flatten() for p in net.parameters()])

    assert torch.equal(step(count=True), step(count=False))


def test_the_counter_agrees_with_flop_counter_mode_and_leaves_the_gradients_alone():
    """StepFlops (torch's formulas without FlopCounterMode's module hooks) counts what FlopCounterMode counts,
    and the gradients of a UNet with attention are bit-identical with and without it (FlopCounterMode's
    backward hooks changed their summation order)."""
    from tiny_backbones import tiny_unet2d
    from torch.utils.flop_counter import FlopCounterMode

    from trainer.engine.throughput import StepFlops

    def step(mode):
        unet = tiny_unet2d(attention=True)
        x, t = torch.randn(16, 1, 8, 8), torch.randint(0, 1000, (16,))
        with mode:
            unet(x, t).sample.square().mean().backward()
        return torch.cat([p.grad.flatten() for p in unet.parameters()])

    counter, reference = StepFlops(), FlopCounterMode(display=False)
    plain = step(contextlib.nullcontext())
    assert torch.equal(step(counter), plain)
    step(reference)
    assert counter.total == reference.get_total_flops() > 0


def test_the_cpu_matmul_peak_is_measured():
    assert measure_cpu_matmul_peak(n=128, repeats=2, warmup_s=0) > 0


@pytest.mark.parametrize("slow_s, widths", [(0.0, {128}), (float("inf"), {128, 256, 512})])
def test_the_cpu_matmul_grows_only_while_the_next_size_stays_fast(monkeypatch, slow_s, widths):
    """A dtype without a fast CPU kernel (fp16 on x86: 2 s per 1024-wide matmul) is measured at a small size: the
    size doubles only while 8x the last matmul's time stays under `slow_s`."""
    sizes, mm = [], torch.mm

    def spy(a, b):
        sizes.append(a.shape[0])
        return mm(a, b)

    monkeypatch.setattr(torch, "mm", spy)
    assert measure_cpu_matmul_peak(torch.float16, n=512, repeats=2, warmup_s=0, slow_s=slow_s) > 0
    assert set(sizes) == widths and sizes[-1] == max(widths)


def test_the_cpu_peak_is_measured_on_first_use_not_at_start_up(monkeypatch):
    """The 0.3 s matmul is off a run's path to its first step: asked for between steps, once."""
    from trainer.engine import throughput

    measured = []

    def spy(dtype):
        measured.append(dtype)
        return measure_cpu_matmul_peak(dtype, n=128, repeats=2, warmup_s=0)

    monkeypatch.setattr(throughput, "measure_cpu_matmul_peak", spy)
    tp = Throughput(torch.device("cpu"), "bf16", tf32=True)
    tp.set_flops_per_step(1e9)  # a resumed process: the count came from its checkpoint
    assert measured == [] and "not measured yet" in tp.peak_source
    first = tp.rates(0.5)
    assert measured == [torch.bfloat16] and "cpu bfloat16 matmul on" in tp.peak_source
    assert first["mfu"] == pytest.approx(first["flops_per_s"] / tp.peak)
    tp.rates(0.25)
    assert measured == [torch.bfloat16]  # once per process
