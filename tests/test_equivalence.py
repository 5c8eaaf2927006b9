"""Splitting a step (accumulation, micro-batches) changes memory use, not the update."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny

from trainer.config import load_config
from trainer.elastic import DistEnv
from trainer.loop import Trainer


def train(tmp_path, name, *extra):
    cfg = load_config(None, tiny(tmp_path / name, "checkpoint.every_steps=0", *extra, max_steps=3), environ={})
    t = Trainer(cfg, DistEnv())
    assert t.fit() == 0
    return {k: v.detach().clone() for k, v in t.parts["unet"].module.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), "ref", "train.batch_size=8", "train.grad_accum=1")


def assert_same_update(a, b):
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-4, atol=2e-6), k


def test_grad_accumulation_gives_the_same_update(tmp_path, reference):
    got = train(tmp_path, "accum", "train.batch_size=8", "train.grad_accum=2")
    assert_same_update(reference, got)


def test_micro_batching_gives_the_same_update_with_uneven_chunks(tmp_path, reference):
    # 8 samples in chunks of 3, 3, 2: each chunk's loss is scaled by its share of the batch.
    got = train(tmp_path, "micro", "train.batch_size=8", "train.micro_batch_size=3")
    assert_same_update(reference, got)


def test_a_different_seed_gives_a_different_update(tmp_path, reference):
    got = train(tmp_path, "seed", "train.batch_size=8", "seed=1")
    assert any(not torch.allclose(reference[k], got[k], rtol=1e-4, atol=2e-6) for k in reference)
