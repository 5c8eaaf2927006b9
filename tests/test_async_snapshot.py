"""Background saves copy parameters, optimizer state and EMA while the next step runs: what is copied
at once and what waits for the fence, a failed copy raised at the fence, a torn copy refused."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from trainer.checkpoint import CheckpointStore
from trainer.checkpoint.writer import Checkpointer, Snapshot, SnapshotError, storage_key


@pytest.fixture
def held_copies(monkeypatch):
    """Background copies wait for `release.set()`: the test decides what happens before they run."""
    release = threading.Event()
    complete = Snapshot.complete

    def held(self):
        assert release.wait(timeout=60), "the test never released the copy"
        complete(self)

    monkeypatch.setattr(Snapshot, "complete", held)
    return release


def stable_set(*tensors: torch.Tensor):
    keys = {storage_key(t) for t in tensors}
    return lambda t: storage_key(t) in keys


def saved(store: CheckpointStore, step: int) -> dict[str, torch.Tensor]:
    info = store.check(step)
    assert info.valid, info.reason
    return store.read_tensors(info, "part.safetensors")


def test_buffers_are_copied_at_save_and_weights_before_the_fence_returns(tmp_path, held_copies):
    weight, running_mean = torch.zeros(1000), torch.zeros(10)
    store = CheckpointStore(str(tmp_path))
    ckpt = Checkpointer(store, async_save=True)
    files = {"part.safetensors": {"weight": weight, "running_mean": running_mean}, "meta.json": b"{}"}
    stall, _ = ckpt.save(1, files, {}, stable=stable_set(weight))
    running_mean.add_(1)  # the next forward updates a buffer before the copy has even started
    held_copies.set()
    ckpt.fence()  # the next optimizer step waits here ...
    weight.add_(1)  # ... and only then changes the weights
    ckpt.wait()
    out = saved(store, 1)
    assert torch.equal(out["weight"], torch.zeros(1000)) and torch.equal(out["running_mean"], torch.zeros(10))
    assert ckpt.take_failure() is None and stall >= 0
    ckpt.close()


def test_a_failed_background_copy_is_raised_at_the_fence_and_nothing_of_it_is_written(tmp_path):
    store = CheckpointStore(str(tmp_path))
    ckpt = Checkpointer(store, async_save=True)
    ckpt.save(1, {"part.safetensors": {"w": torch.ones(4)}}, {})
    ckpt.wait()
    # A tensor without data (meta device) cannot be copied: the writer thread's copy raises.
    ckpt.save(2, {"part.safetensors": {"w": torch.empty(4, device="meta")}}, {}, stable=lambda t: True)
    with pytest.raises(SnapshotError, match="step 2 failed, nothing of it was written") as e:
        ckpt.fence()
    assert "meta" in str(e.value.__cause__).lower()
    ckpt.wait()
    assert ckpt.take_failure() is None  # raised once, at the fence; not reported a second time
    assert [i.step for i in store.list() if i.valid] == [1] and store.steps() == [1]
    # The next save simply tries again.
    w = torch.full((4,), 3.0)
    ckpt.save(3, {"part.safetensors": {"w": w}}, {}, stable=stable_set(w))
    ckpt.close()
    assert torch.equal(saved(store, 3)["w"], w)


def test_a_weight_changed_before_its_copy_fails_the_save_instead_of_mixing_two_steps(tmp_path, held_copies):
    weight = torch.zeros(1000)
    store = CheckpointStore(str(tmp_path))
    ckpt = Checkpointer(store, async_save=True)
    ckpt.save(
        1, {"part.safetensors": {"weight": weight}, "meta.json": json.dumps({}).encode()}, {}, stable=stable_set(weight)
    )
    weight.add_(1)  # an update that did not wait for the fence
    held_copies.set()
    with pytest.raises(SnapshotError, match="part.safetensors:weight changed while it was being copied"):
        ckpt.fence()
    ckpt.close()
    assert store.steps() == []


def test_a_copy_failure_left_unfenced_is_reported_by_the_next_save(tmp_path):
    store = CheckpointStore(str(tmp_path))
    ckpt = Checkpointer(store, async_save=True)
    ckpt.save(1, {"part.safetensors": {"w": torch.empty(4, device="meta")}}, {}, stable=lambda t: True)
    ckpt.save(2, {"part.safetensors": {"w": torch.ones(4)}}, {}, sync=True)  # the final save, no fence before
    assert isinstance(ckpt.take_failure(), SnapshotError)
    ckpt.close()
    assert store.steps() == [2]


# ---------------------------------------------------------------- in the training loop


@pytest.mark.slow
def test_async_saves_copied_during_the_next_step_equal_sync_saves_and_sigterm_mid_copy_keeps_both(tmp_path):
    """VQ-GAN (generator and discriminator: two optimizers per step; a VQ codebook whose EMA and dead-code
    replacement change buffers in forward). With PROBE_TASK_OVERLAP every background copy is held until
    the next step reaches its first optimizer step; SIGTERM arrives in the forward of a step while the
    previous save's copy is still held. Every checkpoint, async, emergency or resumed, equals the sync run's
    at the same step, tensor for tensor."""
    from conftest import REPO, clean_env, run_cli
    from test_vqgan_maskgit import tensors, vqgan_args

    common = [
        "task=probe_tasks:KillableVQGAN",
        "model.disc_start_step=1",
        "model.dead_code_threshold=2",
        "checkpoint.keep=10",
    ]
    ref = run_cli(
        "train",
        *vqgan_args(tmp_path / "ref", *common, "checkpoint.every_steps=1", max_steps=6),
        env=clean_env(PYTHONPATH=str(REPO / "tests")),
    )
    assert ref.returncode == 0, ref.stderr[-3000:]

    run = vqgan_args(tmp_path / "async", *common, "checkpoint.every_steps=2", "checkpoint.async=true", max_steps=6)
    env = clean_env(PYTHONPATH=str(REPO / "tests"), PROBE_TASK_OVERLAP="1")
    stopped = run_cli("train", *run, env={**env, "PROBE_TASK_KILL": "0:4", "PROBE_TASK_KILL_SIGNAL": "TERM"})
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    # Both background saves (steps 2 and 4) had their copy held into the next step, released by its fence.
    assert stopped.stderr.count("probe: snapshot copy held until a fence") == 2, stopped.stderr[-3000:]
    assert "until an optimizer step" not in stopped.stderr and "checkpoint save failed" not in stopped.stderr
    resumed = run_cli("train", *run, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed_from=" in resumed.stderr and "step-000000005" in resumed.stderr

    a_root, b_root = f"{tmp_path}/ref/run/checkpoints", f"{tmp_path}/async/run/checkpoints"
    for step in (2, 4, 5, 6):  # async (copy overlapped the next step), emergency, after the resume
        a, b = tensors(a_root, step), tensors(b_root, step)
        assert a.keys() == b.keys() and "discriminator.optimizer.safetensors" in a
        for name in a:
            assert a[name].keys() == b[name].keys()
            for key in a[name]:
                assert torch.equal(a[name][key], b[name][key]), f"step {step} {name}:{key} differs"
    # The buffers that change in forward are in there (and were copied at save time, not after).
    assert any("quantizer" in k and "embed" in k for k in tensors(b_root, 4)["generator.model.safetensors"])
