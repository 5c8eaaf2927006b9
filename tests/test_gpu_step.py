"""The step's path never waits on the host (issue 34), checked where it can be on a CPU, and on a GPU when the
suite runs on one:

- per-sample draws (stream 2) are vectorized per block of the global batch on the training device, the same
  numbers for a position at any world size and chunking; the stream is recorded in the checkpoint and a
  checkpoint without it resumes on stream 1 (the per-sample CPU generators older runs trained on);
- a step's logged values stay on the device and are read at the log cadence only;
- FLOPs are counted on fake tensors before the first step: the same count as the real step, no memory, no
  state changed.

float8 (`train.float8`) has its own file: tests/test_float8.py.
"""

from __future__ import annotations

import resource

import pytest
import torch
from conftest import tiny
from torch.overrides import TorchFunctionMode

from trainer.data import build_train_loader
from trainer.elastic import DistEnv
from trainer.engine.progress import TrainProgress
from trainer.engine.throughput import StepFlops
from trainer.errors import ConfigError
from trainer.loop import Trainer
from trainer.randomness import (
    BLOCK_ROWS,
    CURRENT_STREAM,
    STREAM_DEVICE_BLOCKS,
    STREAM_PER_SAMPLE_CPU,
    Stream,
    per_sample_rand,
    per_sample_randn,
    sample_draws,
    sample_generators,
    set_stream_version,
    stream_version,
)
from trainer.registry import load_config

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _current_stream():
    set_stream_version(CURRENT_STREAM)
    yield
    set_stream_version(CURRENT_STREAM)


def _draw(positions, device="cpu", seed=5, step=7):
    d = sample_draws(seed, step, positions, Stream.DIFFUSION, device=device)
    return d.randn((2, 3)), d.randint(1000), d.rand(), d.timestep_density("logit_normal", 0.0, 1.0, 1.29)


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if CUDA else [])])
def test_device_block_draws_depend_on_the_position_only(device):
    whole = _draw(range(0, 3 * BLOCK_ROWS + 5), device)
    # The same positions as 3 ranks' slices, and one rank's slice as micro-batches, straddling block ends.
    for cuts in ([0, 70, 150, 3 * BLOCK_ROWS + 5], [0, 1, BLOCK_ROWS, BLOCK_ROWS + 1, 3 * BLOCK_ROWS + 5]):
        parts = [_draw(range(a, b), device) for a, b in zip(cuts, cuts[1:], strict=False)]
        for k, full in enumerate(whole):
            assert torch.equal(torch.cat([p[k] for p in parts]), full)
    assert all(x.device.type == device for x in whole)
    # Another step, seed or stream draws other numbers; calls of one step draw independently.
    assert not torch.equal(_draw(range(8), device, step=8)[0], whole[0][:8])
    assert not torch.equal(_draw(range(8), device, seed=6)[0], whole[0][:8])
    other = sample_draws(5, 7, range(8), Stream.MASKGIT, device=device).randn((2, 3))
    assert not torch.equal(other, whole[0][:8])
    d = sample_draws(5, 7, range(8), device=device)
    assert not torch.equal(d.rand(), d.rand())


def test_the_draws_look_like_their_distributions():
    n = 64 * BLOCK_ROWS
    d = sample_draws(1, 2, range(n))
    z, u, t = d.randn(()), d.rand(), d.randint(10)
    assert abs(float(z.mean())) < 0.05 and abs(float(z.std()) - 1) < 0.05
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02
    assert set(t.tolist()) == set(range(10))


def test_stream_one_is_the_per_sample_generators_of_older_runs():
    set_stream_version(STREAM_PER_SAMPLE_CPU)
    d = sample_draws(3, 4, [0, 5, 9], Stream.DIFFUSION)
    gens = sample_generators(3, 4, [0, 5, 9])
    assert torch.equal(d.randn((1, 2, 2)), per_sample_randn(gens, (1, 2, 2)))
    assert torch.equal(d.rand(), per_sample_rand(gens))


def test_the_stream_is_recorded_and_a_checkpoint_without_it_resumes_on_stream_one():
    progress = TrainProgress(batch_size=8, epoch_size=100, world_size=1, seed=0)
    assert progress.state_dict()["rng_stream"] == CURRENT_STREAM == STREAM_DEVICE_BLOCKS
    old = {k: v for k, v in progress.state_dict().items() if k != "rng_stream"}
    progress.load_state_dict(old)
    assert progress.rng_stream == stream_version() == STREAM_PER_SAMPLE_CPU
    with pytest.raises(ConfigError, match="draw stream 9"):
        progress.load_state_dict({**old, "rng_stream": 9})


class _Reads(TorchFunctionMode):
    """Records every read of a tensor's value back to the host (the calls that wait for a device)."""

    READS = {"item", "tolist", "__bool__", "__float__", "__int__", "numpy"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def test_a_step_reads_no_value_back_and_the_reporter_reads_at_the_log_cadence(tmp_path):
    cfg = load_config("digits-ddpm", tiny(tmp_path, "train.log_every_steps=4", max_steps=9), environ={})
    trainer = Trainer(cfg, DistEnv())
    batch = next(
        iter(build_train_loader(trainer.train_set, cfg, cursor=0, rank=0, world_size=1, device=trainer.device))
    )
    with _Reads() as mode:
        logs = trainer.step_runner.run(batch, 0)
    assert mode.reads == [] and all(isinstance(v, torch.Tensor) for v in logs.values())
    # Through fit: the values of every step are read in one transfer at steps 1, 4, 8 and the last (9).
    reads: list[int] = []
    original = trainer.reporter.read

    def read():
        reads.append(trainer.progress.step)
        original()

    trainer.reporter.read = read
    assert trainer.fit() == 0
    assert reads == [1, 4, 8, 9]


def test_flops_are_counted_on_fake_tensors_as_the_real_step_counts_them_and_nothing_changes(tmp_path):
    cfg = load_config("digits-ddpm", tiny(tmp_path, max_steps=2), environ={})
    trainer = Trainer(cfg, DistEnv())
    batch = next(
        iter(build_train_loader(trainer.train_set, cfg, cursor=0, rank=0, world_size=1, device=trainer.device))
    )
    part = trainer.parts["unet"]
    trainer.step_runner.run(batch, 0)  # the loop counts before its second step (see Trainer.fit)
    before = {k: v.clone() for k, v in part.module.state_dict().items()}
    opt_state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in part.optimizer.state.items()}
    rng = torch.get_rng_state()
    grads = [p.grad.clone() for p in part.module.parameters()]
    fake = trainer.step_runner.count_flops(batch, 1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in part.module.state_dict().items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, part.module.parameters(), strict=True))
    assert all(
        torch.equal(v, part.optimizer.state[p][k]) for p in part.optimizer.state for k, v in opt_state[id(p)].items()
    )
    counter = StepFlops()
    with counter:
        trainer.step_runner.run(batch, 1)
    assert fake == counter.total > 0


def test_counting_a_large_step_allocates_no_activations(tmp_path):
    """A DiT step at batch 256 whose activations take gigabytes, counted on fake tensors: the process's
    peak resident memory grows by far less than one activation set."""
    dit = "{kind: dit, num_layers: 8, num_attention_heads: 6, attention_head_dim: 64, patch_size: 2}"
    extra = [f"model.backbone={dit}", "model.num_classes=10", "data.image_size=32", "train.batch_size=256"]
    cfg = load_config("digits-ddpm", tiny(tmp_path, *extra, max_steps=1), environ={})
    trainer = Trainer(cfg, DistEnv())
    batch = next(
        iter(build_train_loader(trainer.train_set, cfg, cursor=0, rank=0, world_size=1, device=trainer.device))
    )
    # One block's attention scores alone: 256 samples x 6 heads x 256 x 256 tokens of float32.
    one_tensor_mb = 256 * 6 * 256 * 256 * 4 / 2**20
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    flops = trainer.step_runner.count_flops(batch, 0)
    grown_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - peak_before
    assert flops and flops > 1e12
    assert grown_mb < one_tensor_mb / 4, (grown_mb, one_tensor_mb)
