"""Host-side settings for accelerators (train.pin_memory, train.prefetch_factor, train.tf32): what they do on
CUDA, and that on CPU each is a no-op (the same loader batches, no flag touched)."""

from __future__ import annotations

import warnings

import pytest
import torch

from trainer.data import build_splits, build_train_loader
from trainer.engine.runtime import configure_matmul
from trainer.registry import load_config


def _loader(overrides, device):
    cfg = load_config(None, ["train.batch_size=8", *overrides], environ={})
    train, _, _ = build_splits(cfg)
    return build_train_loader(train, cfg, cursor=0, rank=0, world_size=1, device=device)


def _batches(loader, n=3):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_pinned_memory_only_for_cuda():
    assert not _loader([], torch.device("cpu")).pin_memory
    assert not _loader([], None).pin_memory
    cuda = _loader([], torch.device("cuda"))  # built, not iterated: no GPU needed
    # pinned for the current accelerator; naming a device is deprecated (a warning at each iterator, torch 2.11)
    assert cuda.pin_memory and not cuda.pin_memory_device
    assert not _loader(["train.pin_memory=false"], torch.device("cuda")).pin_memory


def test_on_cpu_the_host_side_keys_change_no_batch():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "pin_memory is set but no accelerator is found"
        plain = _batches(_loader(["train.pin_memory=false", "train.prefetch_factor=1"], None))
        keyed = _batches(_loader(["train.pin_memory=true", "train.prefetch_factor=4"], torch.device("cpu")))
    for a, b in zip(plain, keyed, strict=True):
        assert a.keys() == b.keys()
        for key in ("images", "labels", "valid"):
            assert torch.equal(a[key], b[key]), key
            assert not b[key].is_pinned()


@pytest.fixture
def matmul_flags():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_is_set_on_cuda_and_untouched_on_cpu(matmul_flags):
    for before in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = before
        configure_matmul(tf32=not before, cuda=False)
        assert torch.backends.cuda.matmul.allow_tf32 is before and torch.backends.cudnn.allow_tf32 is before
    for tf32 in (True, False):
        configure_matmul(tf32=tf32, cuda=True)  # the flags are settable without a GPU
        assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
