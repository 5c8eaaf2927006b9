"""Checkpoints written before a change still load, sample the same images for the same seed and resume to
the same weights (issue 25: the ddpm and cascade tasks moved onto trainer/diffusion).

The goldens under tests/golden/<case>/ were written by tests/make_golden.py with the code before the move:
a tiny run of a shipped preset (2 steps), what `gentrain sample` drew from it, and the weights one resumed
step later. Here the current code loads the same checkpoint and must reproduce them.

Exactness: the math is unchanged, so on the torch build and CPU kernels that wrote the goldens (recorded
in their metadata) every tensor must be bit-identical. Elsewhere float32 kernels may sum in another order
(another SIMD width), so the comparison falls back to bounds derived below; they are far below what any
change of behaviour (another draw, target, weight or schedule) moves.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from helpers import assert_tensors_close, assert_tensors_equal
from make_golden import CASES, GOLDEN, STEPS, config, expected, sample, train, weight_files

# Samples: a network output re-associated elsewhere differs by a few float32 ulps (~1e-6 relative); the
# samplers here (3 steps) amplify an output error by at most 1/sqrt(alpha_bar_T) ~ 160 at the noisiest DDPM
# step (squaredcos_cap_v2, T=1000) or sigma_max / sigma_data = 160 for EDM; 1e-6 x 160 x 3 steps < 1e-3.
SAMPLE_RELATIVE = 1e-3


def _adam_step_bound(beta1: float, beta2: float, t: int) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam can take at step t, whatever the gradients (Cauchy-Schwarz on
    m_t = (1-b1) sum b1^(t-i) g_i against v_t = (1-b2) sum b2^(t-i) g_i^2, then the bias corrections)."""
    ratio = sum((beta1**2 / beta2) ** k for k in range(t))
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(ratio) * math.sqrt(1 - beta2**t) / (1 - beta1**t)


def _same_machine(meta: dict[str, str]) -> bool:
    return meta["torch"] == torch.__version__ and meta["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


@pytest.fixture(params=list(CASES))
def case(request):
    return request.param


def test_the_goldens_are_small_and_complete(case):
    files = [p for p in (GOLDEN / case).rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 1_000_000
    tensors, meta = expected(case)
    assert {"samples/ema", "samples/raw"} <= tensors.keys() and meta["case"] == case
    assert any(k.startswith(f"step{STEPS + 1}/") for k in tensors)


def test_a_checkpoint_written_before_the_change_samples_the_same_images(case):
    want, meta = expected(case)
    got = {f"samples/{w}": sample(case, GOLDEN / case / "checkpoints", w == "ema") for w in ("ema", "raw")}
    want = {k: want[k] for k in got}
    if _same_machine(meta):
        assert_tensors_equal(got, want, f"{case} samples")
    else:
        assert_tensors_close(want, got, SAMPLE_RELATIVE, f"{case} samples ")
    assert not torch.equal(got["samples/ema"], got["samples/raw"])  # both weight sets were read


def test_a_checkpoint_written_before_the_change_resumes_to_the_same_weights(case, tmp_path):
    want, meta = expected(case)
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / case / "checkpoints", run / "checkpoints")
    train(case, run, STEPS + 1)
    step = STEPS + 1
    got = {
        f"step{step}/{file}/{k}": v
        for file, tensors in weight_files(run / "checkpoints", step).items()
        for k, v in tensors.items()
    }
    want = {k: v for k, v in want.items() if k.startswith(f"step{step}/")}
    if _same_machine(meta):
        assert_tensors_equal(got, want, f"{case} resumed")
        return
    # Elsewhere: from the same stored state, one Adam step moves each weight by at most lr x the bound above,
    # so two machines' results differ by at most twice that (the step's direction flipped by float noise).
    train_cfg = config(case, run, step).train
    limit = 2 * train_cfg.lr * _adam_step_bound(*train_cfg.betas, step)
    assert got.keys() == want.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in got)
    assert worst <= limit, (case, worst, limit)
