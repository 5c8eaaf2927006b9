"""Checkpoints written before a change still load, sample the same images for the same seed and resume to
the same weights (issue 25: the ddpm and cascade tasks moved onto trainer/diffusion).

The goldens under tests/golden/<case>/ were written by tests/make_golden.py with the code before the move:
a tiny run of a shipped preset (2 steps), what `gentrain sample` drew from it, and the weights one resumed
step later. Here the current code loads the same checkpoint and must reproduce them.

Exactness: the math is unchanged, so on the machine that wrote the goldens (the CPU, torch build and
thread count in their machine.json; an "unknown" CPU never matches) every tensor must be bit-identical.
Elsewhere float32 kernels sum in another order (another SIMD width or blocking), so the comparison falls
back to bounds derived below. The bounds must still catch a change of behaviour, so each one has a test
that runs the same comparison on a deliberately changed run (another noise draw, a step's random stream
shifted, two parameters' optimizer state swapped, the EMA read as the raw weights) and requires it to
fail. What holds bit for bit on every machine is checked too: sampling or resuming twice gives the same
bits.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_tensors_equal
from make_golden import (
    CASES,
    GOLDEN,
    MACHINE_JSON,
    STEPS,
    UNKNOWN,
    config,
    expected,
    machine,
    make,
    recorded_machine,
    sample,
    train,
    weight_files,
)

from trainer.checkpoint.store import CheckpointStore

STEP = STEPS + 1  # the resumed step

# Samples, relative L2 distance per sample set. A float32 network output re-associated elsewhere differs by
# a few ulps (~1e-6 relative); the samplers here (3 steps) amplify an output error by at most
# 1/sqrt(alpha_bar_T) ~ 160 at the noisiest DDPM step (squaredcos_cap_v2, T=1000) or sigma_max/sigma_data
# = 160 for EDM: 1e-6 x 160 x 3 steps < 1e-3. Measured between an Intel Xeon (AVX-512) and the goldens'
# CPU: 1e-7 to 3e-7. The changes it must catch: another noise draw moves a sample set by 0.3 to 0.95, the
# raw weights read for the EMA ones (or back) by 0.011 to 0.021 (after only 2 steps the two are close).
SAMPLE_RELATIVE = 1e-3

# Resumed step, compared as the UPDATE it made (resumed weights minus the stored step-2 weights), relative L2
# distance per tensor. Comparing the weights themselves cannot tell a changed step from float noise (the
# update is ~lr = 2e-3 against weights of ~0.1-1), the update can: everything the step reads (weights,
# Adam moments, EMA, RNG and data position) is loaded bit for bit, so only the recomputed gradient carries
# float noise. Each of its components is a float32 sum of n <= ~300 terms (4 images x 8x8 pixels for a
# conv weight, 16 channels x 9 taps for a conv output) reordered at each of ~20 layers: at most
# ~20 x 300 x 2^-24 ~ 4e-4 relative in the worst case, ~1e-5 when rounding errors do not all align
# (measured per tensor between an Intel Xeon and the goldens' CPU: at most 7e-6). Clipping scales every
# gradient by one factor, and Adam passes a tensor's relative gradient error on at about the same size
# (m_3 = b1 m_2 + (1-b1) g_3 and v_3 likewise, with m_2 and v_2 exact; elements where m_3 nearly cancels
# amplify it, but carry little of the tensor's L2 norm). 1e-3 holds even the worst case. The changes it must catch move some tensor's update by about its
# own size: the random stream shifted by one step by 1.0 to 2.2, two parameters' Adam moments swapped by
# 1.06 to 1.33 (the worst tensor of each case).
UPDATE_RELATIVE = 1e-3

# Parameters whose gradient is exactly zero in exact arithmetic: an attention key's bias adds q.b to every
# logit of a query, which softmax ignores. Their float32 gradient is rounding noise (~1e-10), which Adam
# (|g| << eps = 1e-8) turns into an update of that noise's sign and size (~1e-5, under 1% of a real step),
# different on every CPU: the update of these can only be held to Adam's step bound (below).
ZERO_GRADIENT_SUFFIXES = ("to_k.bias",)


def _adam_step_bound(beta1: float, beta2: float, t: int) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam can take at step t, whatever the gradients (Cauchy-Schwarz on
    m_t = (1-b1) sum b1^(t-i) g_i against v_t = (1-b2) sum b2^(t-i) g_i^2, then the bias corrections)."""
    ratio = sum((beta1**2 / beta2) ** k for k in range(t))
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(ratio) * math.sqrt(1 - beta2**t) / (1 - beta1**t)


def _same_machine(recorded: dict) -> bool:
    """The goldens' machine.json names this CPU, torch build and thread count (and no field is unknown)."""
    here = machine()
    return UNKNOWN not in here.values() and all(recorded.get(k) == v for k, v in here.items())


def _relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def sample_distance(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest relative L2 distance between two cases' sample sets (the same keys)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max(_relative_l2(got[k], want[k]) for k in want)


def _samples(case: str, root: Path) -> dict[str, torch.Tensor]:
    return {f"samples/{w}": sample(case, root / case / "checkpoints", w == "ema") for w in ("ema", "raw")}


def _resumed(case: str, tmp_path: Path, root: Path = GOLDEN) -> dict[str, torch.Tensor]:
    """The weights after resuming the case's checkpoint for one step, keyed as in expected.safetensors."""
    run = tmp_path / "run"
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(root / case / "checkpoints", run / "checkpoints")
    train(case, run, STEP)
    if root == GOLDEN:  # these goldens predate draw streams (no rng_stream): resumed, they stay on stream 1
        progress = json.loads(next((run / "checkpoints").glob(f"step-*{STEP}/trainer.json")).read_text())
        assert progress["progress"]["rng_stream"] == 1, progress["progress"]
    files = weight_files(run / "checkpoints", STEP)
    return {f"step{STEP}/{file}/{k}": v for file, tensors in files.items() for k, v in tensors.items()}


def update_distance(case: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], root: Path = GOLDEN):
    """(largest relative L2 distance between two resumed steps' updates over the parameters that have a
    gradient, the parameters whose update breaks Adam's step bound): the keys must be the same."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:5]
    stored = {
        f"step{STEP}/{file}/{k}": v
        for file, tensors in weight_files(root / case / "checkpoints", STEPS).items()
        for k, v in tensors.items()
    }
    assert stored.keys() == want.keys()
    train_cfg = config(case, Path("unused"), STEP).train
    # the schedule never exceeds train.lr; decoupled weight decay moves a weight by lr x wd x |w| more
    limit = train_cfg.lr * _adam_step_bound(*train_cfg.betas, STEP)
    worst, unbounded = 0.0, []
    for k in want:
        update_got, update_want = got[k].double() - stored[k].double(), want[k].double() - stored[k].double()
        if k.endswith(ZERO_GRADIENT_SUFFIXES):
            allowed = limit + train_cfg.lr * train_cfg.weight_decay * float(stored[k].abs().max())
            unbounded += [k for u in (update_got, update_want) if float(u.abs().max()) > allowed * (1 + 1e-6)]
        else:
            worst = max(worst, _relative_l2(update_got, update_want))
    return worst, unbounded


@pytest.fixture(params=list(CASES))
def case(request):
    return request.param


def test_the_goldens_are_small_and_complete(case):
    files = [p for p in (GOLDEN / case).rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 1_000_000
    tensors, meta = expected(case)
    assert {"samples/ema", "samples/raw"} <= tensors.keys() and meta["case"] == case
    assert any(k.startswith(f"step{STEP}/") for k in tensors)
    # The machine that computed them, every field named (the goldens of 5a0b3da: CPU unknown).
    recorded = json.loads((GOLDEN / case / MACHINE_JSON).read_text())
    assert recorded.keys() >= machine().keys()
    assert (recorded["torch"], recorded["cpu_capability"]) == (meta["torch"], meta["cpu_capability"])


def test_only_the_machine_a_golden_names_counts_as_the_one_that_wrote_it():
    here = machine()
    assert _same_machine(dict(here)) == (UNKNOWN not in here.values())
    other = {"cpu_model_name": UNKNOWN, "cpu_flags_sha256": "0" * 16, "torch": "2.12.0+cpu", "threads": 2}
    for key, value in other.items():
        assert not _same_machine({**here, key: value}), key


def test_a_checkpoint_written_before_the_change_samples_the_same_images(case):
    want, _ = expected(case)
    got = _samples(case, GOLDEN)
    want = {k: want[k] for k in got}
    # On one machine the same checkpoint and seed give the same bits.
    assert_tensors_equal(_samples(case, GOLDEN), got, f"{case} sampled twice")
    if _same_machine(recorded_machine(case)):
        assert_tensors_equal(got, want, f"{case} samples")
    else:
        assert sample_distance(got, want) <= SAMPLE_RELATIVE, (case, sample_distance(got, want))
    assert not torch.equal(got["samples/ema"], got["samples/raw"])  # both weight sets were read


def test_the_sample_bound_catches_another_noise_draw_and_swapped_weight_sets(case, monkeypatch):
    want, _ = expected(case)
    want = {k: want[k] for k in ("samples/ema", "samples/raw")}
    got = _samples(case, GOLDEN)
    swapped = {"samples/ema": got["samples/raw"], "samples/raw": got["samples/ema"]}
    assert sample_distance(swapped, want) > SAMPLE_RELATIVE
    params = dict(CASES[case].sample, seed=CASES[case].sample["seed"] + 1)
    monkeypatch.setitem(CASES, case, dataclasses.replace(CASES[case], sample=params))
    assert sample_distance(_samples(case, GOLDEN), want) > 10 * SAMPLE_RELATIVE


def test_a_checkpoint_written_before_the_change_resumes_to_the_same_weights(case, tmp_path):
    want, _ = expected(case)
    want = {k: v for k, v in want.items() if k.startswith(f"step{STEP}/")}
    got = _resumed(case, tmp_path)
    # On one machine the same stored state resumes to the same bits.
    assert_tensors_equal(_resumed(case, tmp_path), got, f"{case} resumed twice")
    if _same_machine(recorded_machine(case)):
        assert_tensors_equal(got, want, f"{case} resumed")
        return
    worst, unbounded = update_distance(case, got, want)
    assert worst <= UPDATE_RELATIVE and not unbounded, (case, worst, unbounded)


def _shift_the_training_draws_by_one_step(monkeypatch) -> None:
    """The diffusion tasks' per-sample noise, timesteps and dropout drawn for step + 1 (an off-by-one in
    keying the stream after a resume)."""
    from trainer.randomness import sample_draws

    def shifted(seed, step, *args, **kwargs):
        return sample_draws(seed, step + 1, *args, **kwargs)

    for task in ("ddpm", "cascade"):
        monkeypatch.setattr(f"trainer.tasks.{task}.sample_draws", shifted)


def _swap_two_parameters_adam_state(monkeypatch) -> None:
    """Optimizer state loaded under the wrong keys: the Adam moments of the first two same-shaped conv
    weights trade places (a wrong parameter-to-state mapping)."""
    read = CheckpointStore.read_tensors

    def swapped(self, info, name):
        tensors = read(self, info, name)
        if name.endswith(".optimizer.safetensors"):
            by_shape: dict[tuple, list[str]] = {}
            for k, v in tensors.items():
                if k.endswith(".exp_avg") and v.dim() == 4:
                    by_shape.setdefault(tuple(v.shape), []).append(k.removesuffix(".exp_avg"))
            a, b = next(ids[:2] for ids in by_shape.values() if len(ids) >= 2)
            for moment in (".exp_avg", ".exp_avg_sq"):
                tensors[a + moment], tensors[b + moment] = tensors[b + moment], tensors[a + moment]
        return tensors

    monkeypatch.setattr(CheckpointStore, "read_tensors", swapped)


@pytest.mark.parametrize("change", [_shift_the_training_draws_by_one_step, _swap_two_parameters_adam_state])
def test_the_resume_bound_catches_a_changed_random_stream_and_a_wrong_state_mapping(
    case, change, tmp_path, monkeypatch
):
    want, _ = expected(case)
    want = {k: v for k, v in want.items() if k.startswith(f"step{STEP}/")}
    change(monkeypatch)
    worst, _ = update_distance(case, _resumed(case, tmp_path), want)
    assert worst > 10 * UPDATE_RELATIVE, (case, change.__name__, worst)


def test_goldens_recorded_here_name_this_machine_and_compare_bit_for_bit_here(tmp_path):
    """make_golden.py writes machine.json, and on the machine it names the comparison is bit for bit."""
    case = "digits-ddpm"
    make(case, tmp_path / "golden")
    recorded = recorded_machine(case, tmp_path / "golden")
    assert recorded == machine() and recorded["threads"] == 1
    if UNKNOWN in recorded.values():
        pytest.skip(f"this machine's CPU cannot be identified: {recorded}")
    assert _same_machine(recorded)
    want, _ = expected(case, tmp_path / "golden")
    assert_tensors_equal(_samples(case, tmp_path / "golden"), {k: want[k] for k in ("samples/ema", "samples/raw")})
    got = _resumed(case, tmp_path, tmp_path / "golden")
    assert_tensors_equal(got, {k: v for k, v in want.items() if k.startswith(f"step{STEP}/")})
