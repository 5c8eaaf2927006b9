"""How far a step is from the machine's limit: FLOPs per step, achieved FLOP/s and MFU.

The FLOPs of a step are counted once, from the model, with the FLOP formulas of torch's `FlopCounterMode`
(`torch.utils.flop_counter.flop_registry`) around the first training step of a run (forward,
backward and optimizer, every phase and chunk; matmuls, convolutions and attention, which is what peak
figures measure). Not `FlopCounterMode` itself: its per-module tracking hooks into the backward graph and
changed the order gradients are summed in (1e-8 differences in the digits UNet's gradients), which would
break bit-exact resume. `StepFlops` only observes the operators the step dispatches, so the step computes
what it would without it (the exact-resume tests, whose killed and uninterrupted runs count at different
steps, and tests/test_throughput.py check it). The count is this process's: under
DDP every rank runs the whole model on its share of the batch, under FSDP the same compute too.

The peak it is compared with: on CUDA, the dense tensor-core peak of the GPU named by
`torch.cuda.get_device_name` for the run's precision (a table of common data-centre GPUs; unknown GPUs get
FLOP/s and no MFU); on CPU, a matmul of the training dtype timed on the same threads the run uses (the best
of a few), so MFU there reads "of what this CPU's matmul reaches", not of a datasheet. That matmul takes
0.3 s on one thread, so it is timed on first use, not at start-up: when the FLOPs are counted (before the
run's second step, time kept out of the step rates) or at the first rate a resumed process reports (after
its rate window closed). A restart reaches its first step that much sooner, and a one-step run never pays it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

# TorchDispatchMode: the base class of FlopCounterMode itself (underscored module, documented in torch's
# dispatch docs); tests/test_throughput.py fails clearly if an upgrade moves it or the formulas.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

log = logging.getLogger(__name__)

# Dense (no sparsity) peak FLOP/s by GPU name fragment, from the vendors' datasheets:
# (bf16/fp16 tensor cores, tf32 tensor cores, fp32 without tensor cores). The first matching fragment wins.
GPU_PEAKS: tuple[tuple[str, tuple[float, float, float]], ...] = (
    ("H200", (989e12, 494e12, 67e12)),
    ("H100 PCIe", (756e12, 378e12, 51e12)),
    ("H100 NVL", (835e12, 418e12, 60e12)),
    ("H100", (989e12, 494e12, 67e12)),  # SXM
    ("A100", (312e12, 156e12, 19.5e12)),
    ("L40S", (362e12, 183e12, 91.6e12)),
    ("L4", (121e12, 60e12, 30.3e12)),
)


def gpu_peak(name: str, precision: str, tf32: bool) -> float | None:
    """The dense peak FLOP/s of GPU `name` for `precision` (no | fp16 | bf16), None when not in the table."""
    for fragment, (half, tf32_peak, fp32) in GPU_PEAKS:
        if fragment in name:
            if precision in ("fp16", "bf16"):
                return half
            return tf32_peak if tf32 else fp32
    return None


def measure_cpu_matmul_peak(
    dtype: torch.dtype = torch.float32,
    n: int = 1024,
    repeats: int = 10,
    warmup_s: float = 0.15,
    slow_s: float = 0.05,
) -> float:
    """FLOP/s of the best of `repeats` square matmuls in `dtype` on this process's torch threads, after
    `warmup_s` seconds of the same matmul (thread pool, kernel selection, the cores' clocks: with one
    warm-up matmul and 3 repeats, 2 threads here read 0.09-0.10 TFLOP/s where a warm loop reaches
    0.16-0.20, and a step could show an MFU above 1).

    The size doubles from 128 up to `n` while the doubled matmul (8x the work) would take less than `slow_s`: a
    dtype this CPU has no fast kernel for costs a fraction of a second, not `repeats` times a slow one (fp16 on
    this build machine's x86 CPU: 2.1 s per 1024-wide matmul, a 23 s stall in a run's second step; now 256
    wide, 0.3 s in all), while float32 and bfloat16 reach 1024 as before."""
    size = min(128, n)
    while True:
        a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(dtype)
        b = torch.randn(size, size, generator=torch.Generator().manual_seed(1)).to(dtype)
        start = time.perf_counter()
        torch.mm(a, b)
        took = time.perf_counter() - start
        if size >= n or 8 * took >= slow_s:
            break
        size *= 2
    while time.perf_counter() - start < warmup_s:
        torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


class StepFlops(TorchDispatchMode):
    """Sums FlopCounterMode's formulas over the operators dispatched inside it; no hooks, no module tracking."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


class Throughput:
    """FLOPs of a step (counted on the first one), the device's peak, and the rates of each step."""

    def __init__(self, device: torch.device, precision: str, tf32: bool):
        self.flops_per_step: int | None = None
        self._cpu_dtype: torch.dtype | None = None  # set while a CPU peak is still to be measured
        self._peak: float | None = None
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            self._peak = gpu_peak(name, precision, tf32)
            self.peak_source = f"{name} datasheet" if self._peak else f"{name}: not in the peak table"
        elif device.type == "cpu":
            self._cpu_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
            self.peak_source = f"cpu {str(self._cpu_dtype).removeprefix('torch.')} matmul, not measured yet"
        else:
            self.peak_source = f"{device.type}: no peak known"

    @property
    def peak(self) -> float | None:
        """The device's peak FLOP/s (None: unknown). A CPU's is measured here, the first time it is asked for:
        callers ask between steps, where the time is not a step's (see the module docstring)."""
        if self._cpu_dtype is not None:
            dtype, self._cpu_dtype = self._cpu_dtype, None
            self._peak = measure_cpu_matmul_peak(dtype)
            self.peak_source = f"cpu {str(dtype).removeprefix('torch.')} matmul on {torch.get_num_threads()} threads"
        return self._peak

    @peak.setter
    def peak(self, value: float | None) -> None:
        self._cpu_dtype, self._peak = None, value

    def _peak_line(self) -> str:
        peak = self.peak
        return f"{peak / 1e12:.3g} TFLOP/s ({self.peak_source})" if peak else self.peak_source

    def set_counted(self, flops: int) -> None:
        """This process's FLOPs per step, counted once per run (on fake tensors or on the step); logs the peak."""
        self.flops_per_step = int(flops)
        log.info("throughput: %.4g GFLOP per step on this process; peak %s", flops / 1e9, self._peak_line())

    def set_flops_per_step(self, flops: float) -> None:
        """This process's FLOPs per step, from the count an earlier process of the run saved (no counting)."""
        self.flops_per_step = int(flops)
        log.info("throughput: %.4g GFLOP per step on this process (counted at the run's first step)", flops / 1e9)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Around a training step: counts it when no step has been counted yet, else nothing.

        A counted step runs eagerly under `train.compile` (dynamo does not trace inside a dispatch mode), so
        the count is taken once per run, not per process, and saved with the progress (flops_per_sample)."""
        if self.flops_per_step is not None:
            yield
            return
        counter = StepFlops()
        # force_eager: compiled blocks (train.compile) and torchao's compiled optimizer step run their Python
        # code (dynamo would skip frames inside a dispatch mode and remember to skip them for good, leaving a
        # compiled run eager); the count is taken once per run, so only the run's first step is eager.
        with torch.compiler.set_stance("force_eager"), counter:
            yield
        # Not logged here, nor the peak measured: this is inside the step's time (the caller logs it with
        # set_counted after the step, out of the step rates).
        self.flops_per_step = counter.total

    def rates(self, seconds: float) -> dict[str, float]:
        """`flops_per_s` of a step that took `seconds`, and `mfu` (its fraction of the peak) where known."""
        if not self.flops_per_step or seconds <= 0:
            return {}
        achieved = self.flops_per_step / seconds
        out = {"flops_per_s": achieved}
        peak = self.peak
        if peak:
            out["mfu"] = achieved / peak
        return out
