"""Splitting a step (accumulation, micro-batches) changes memory use, not the gradient.

Why gradients and not weights after a step: Adam divides each gradient by its
own running RMS, so a parameter whose true gradient is zero (an attention key
bias: softmax ignores it) gets a full-size step from float noise, and its
post-Adam value differs between any two summation orders. What splitting a
batch promises is the same *gradient* up to float summation order, so that
is what is compared, with a tolerance relative to the gradient's overall
scale (the same bound holds on any CPU, whatever its SIMD width).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny
from helpers import assert_tensors_close

from trainer.data import build_train_loader
from trainer.elastic import DistEnv
from trainer.loop import Trainer
from trainer.registry import load_config

# float32 sums of the same terms in another order differ by a few ulps of the largest partial sum.
RELATIVE_TOLERANCE = 1e-4


def gradients(tmp_path, name, *extra) -> dict[str, torch.Tensor]:
    """The gradient of the first step's loss, as the engine accumulates it over its chunks."""
    cfg = load_config(None, tiny(tmp_path / name, "checkpoint.every_steps=0", *extra, max_steps=3), environ={})
    t = Trainer(cfg, DistEnv())
    batch = next(iter(build_train_loader(t.train_set, cfg, 0, 0, 1)))
    phases = t.task.phases(0, {})
    t.step_runner.accumulate(batch, 0, phases)
    return {n: p.grad.detach().clone() for n, p in t.parts["unet"].module.named_parameters()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return gradients(tmp_path_factory.mktemp("ref"), "ref", "train.batch_size=8", "model.attention=true")


def assert_same_gradient(a: dict, b: dict) -> None:
    assert_tensors_close(a, b, RELATIVE_TOLERANCE, "gradient ")


def test_grad_accumulation_gives_the_same_gradient(tmp_path, reference):
    got = gradients(tmp_path, "accum", "train.batch_size=8", "model.attention=true", "train.grad_accum=2")
    assert_same_gradient(reference, got)


def test_micro_batching_gives_the_same_gradient_with_uneven_chunks(tmp_path, reference):
    # 8 samples in chunks of 3, 3, 2: each chunk's loss is scaled by its share of the batch.
    got = gradients(tmp_path, "micro", "train.batch_size=8", "model.attention=true", "train.micro_batch_size=3")
    assert_same_gradient(reference, got)


def test_a_different_seed_gives_a_different_gradient(tmp_path, reference):
    got = gradients(tmp_path, "seed", "train.batch_size=8", "model.attention=true", "seed=1")
    scale = max(g.abs().max() for g in reference.values())
    assert any((reference[k] - got[k]).abs().max() > RELATIVE_TOLERANCE * scale for k in reference)
