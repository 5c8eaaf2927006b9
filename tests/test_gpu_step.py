"""The step's path never waits on the host (issue 34), checked where it can be on a CPU, and on a GPU when the
suite runs on one:

- per-sample draws (stream 2) are vectorized per block of the global batch on the training device, the same
  numbers for a position at any world size and chunking; the stream is recorded in the checkpoint and a
  checkpoint without it resumes on stream 1 (the per-sample CPU generators older runs trained on);
- a step's logged values stay on the device and are read at the log cadence only;
- FLOPs are counted on fake tensors before the first step: the same count as the real step, no memory, no
  state changed;
- `train.float8` refuses where there are no float8 tensor cores, converts only the layers torchao's size
  thresholds say it speeds up (refusing a model with none), and keeps checkpoints plain.
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


@pytest.mark.skipif(CUDA and torch.cuda.get_device_capability() >= (8, 9), reason="this GPU has float8")
def test_float8_is_refused_without_float8_tensor_cores(tmp_path):
    dit = "{kind: dit, num_layers: 1, num_attention_heads: 2, attention_head_dim: 16, patch_size: 2}"
    cfg = load_config("digits-ddpm", tiny(tmp_path, f"model.backbone={dit}", "train.float8=true"), environ={})
    assert cfg.train.float8 == "tensorwise"
    with pytest.raises(ConfigError, match="train.float8=tensorwise: float8 matmuls need an NVIDIA GPU"):
        Trainer(cfg, DistEnv())


def test_float8_keeps_the_parameter_names_so_checkpoints_stay_plain():
    from torchao.float8 import convert_to_float8_training

    from trainer.diffusion.backbones.dit import DiTBackbone, DiTBackboneConfig
    from trainer.engine.float8 import float8_layers

    def dit():
        torch.manual_seed(0)
        shape = DiTBackboneConfig(num_attention_heads=2, attention_head_dim=16, num_layers=2, patch_size=2)
        return DiTBackbone.build(shape, sample_size=8, channels=1).model

    chosen = set(float8_layers(dit(), "tensorwise", sized=False)[0])
    plain, converted = dit(), convert_to_float8_training(dit(), module_filter_fn=lambda m, fqn: fqn in chosen)
    assert any(type(m).__name__ == "Float8Linear" for m in converted.modules())
    a, b = plain.state_dict(), converted.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def _meta_dit(layers: int, heads: int, dim: int):
    from trainer.diffusion.backbones.dit import DiTBackbone, DiTBackboneConfig

    shape = DiTBackboneConfig(num_layers=layers, num_attention_heads=heads, attention_head_dim=dim, patch_size=2)
    with torch.device("meta"):  # shapes only: DiT-XL/2's 718M parameters take no memory
        return DiTBackbone.build(shape, sample_size=32, channels=1, num_classes=10).model


def test_float8_converts_the_layers_large_enough_to_be_faster():
    """torchao's size thresholds per recipe (its H100 benchmarks): DiT-XL/2's attention and MLP linears all
    convert with tensorwise, only the MLP's first with rowwise; a DiT-S/2's MLP first layer with tensorwise.
    Without the thresholds (the suite's emulated float8) every eligible layer converts."""
    from trainer.engine.float8 import float8_layers

    xl, small = _meta_dit(28, 16, 72), _meta_dit(12, 6, 64)
    convert, kept = float8_layers(xl, "tensorwise")
    assert len(convert) == 28 * 6 and kept == []
    convert, kept = float8_layers(xl, "rowwise")
    assert len(convert) == 28 and all(n.endswith("ff.net.0.proj") for n in convert) and len(kept) == 28 * 5
    convert, kept = float8_layers(small, "tensorwise")
    assert [n for n in convert if not n.endswith("ff.net.0.proj")] == [] and len(convert) == 12 and len(kept) == 60
    assert float8_layers(small, "rowwise")[0] == []
    assert len(float8_layers(small, "rowwise", sized=False)[0]) == 12 * 6
    assert {n.rsplit(".", 1)[-1] for n in float8_layers(small, "rowwise")[1]} >= {"to_q", "to_k", "to_v", "proj", "2"}


def test_float8_leaves_pixarts_per_sample_adaln_in_bf16():
    from trainer.diffusion import build_backbone
    from trainer.engine.float8 import float8_layers

    spec = {"kind": "pixart", "patch_size": 2, "num_layers": 1, "num_attention_heads": 16, "attention_head_dim": 72}
    with torch.device("meta"):
        model = build_backbone({**spec, "caption_channels": 4096}, 64, 4).model
    convert, kept = float8_layers(model, "tensorwise")
    assert "adaln_single.linear" in dict(model.named_modules())  # batch rows: the timestep's modulation
    assert not [n for n in convert + kept if not n.startswith("transformer_blocks.0.")], convert
    assert len(convert) == 10 and kept == []  # self and cross attention (4 + 4), the MLP (2)


def test_float8_keeps_small_layers_in_bf16_and_refuses_a_model_with_none_large_enough(monkeypatch, caplog):
    import trainer.engine.float8 as float8

    # The device check (a float8 GPU) is not what this tests; past it, the conversion is the real one.
    monkeypatch.setattr(float8, "check_float8_device", lambda recipe, device: None)
    monkeypatch.delenv(float8.TEST_EMULATE, raising=False)
    small = _meta_dit(12, 6, 64)
    with caplog.at_level("INFO", logger="gentrain"):
        assert float8.apply_float8({"transformer": small}, ["transformer"], "tensorwise", torch.device("cpu"), "ddpm")
    assert sum(type(m).__name__ == "Float8Linear" for m in small.modules()) == 12
    assert (
        "float8 (tensorwise scaling): 12 linear layers of transformer; kept in bf16, too small for float8 to be "
        "faster (torchao's thresholds): 60 of transformer (1536x384 (x12), 384x384 (x48))"
    ) in caplog.text
    with pytest.raises(ConfigError) as e:
        float8.apply_float8({"transformer": _meta_dit(12, 6, 64)}, ["transformer"], "rowwise", torch.device("cpu"), "d")
    assert "train.float8=rowwise: no linear layer of transformer is large enough for float8 to be faster" in str(
        e.value
    )
    assert "384x1536 (x12), 1536x384 (x12), 384x384 (x48)" in str(e.value) and "try train.float8=tensorwise" in str(
        e.value
    )
    with pytest.raises(ConfigError, match=r"in x out: transformer: 32x128 \(x2\), 128x32 \(x2\), 32x32 \(x8\)"):
        float8.apply_float8(
            {"transformer": _meta_dit(2, 2, 16)}, ["transformer"], "tensorwise", torch.device("cpu"), "d"
        )


@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() >= (8, 9)), reason="needs float8 tensor cores")
def test_float8_trains_a_dit_on_the_gpu_and_resumes_without_it(tmp_path):
    # width 384: the MLPs' first layers (384 -> 1,536) are above torchao's tensorwise thresholds
    dit = "{kind: dit, num_layers: 2, num_attention_heads: 4, attention_head_dim: 96, patch_size: 2}"
    base = [f"model.backbone={dit}", "model.num_classes=10", "data.image_size=32", "train.precision=bf16"]
    cfg = load_config("digits-ddpm", tiny(tmp_path, *base, "train.float8=tensorwise", max_steps=3), environ={})
    assert Trainer(cfg, DistEnv()).fit() == 0
    cfg = load_config("digits-ddpm", tiny(tmp_path, *base, max_steps=5), environ={})
    trainer = Trainer(cfg, DistEnv())
    assert trainer.fit() == 0 and trainer.checkpoints.resumed_from and trainer.progress.step == 5


@pytest.mark.skipif(not (CUDA and torch.cuda.get_device_capability() >= (8, 9)), reason="needs float8 tensor cores")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_float8_with_compile_trains_under_ddp_and_fsdp2_and_the_weights_stay_plain(parallel, tmp_path):
    # The engine's order (trainer.loop: float8, then compile of the blocks, then the wrapper) on a world of one
    # NCCL rank: one GPU cannot hold two NCCL ranks, so this checks the composition (torchao's Float8Linear
    # under DDP's hooks and FSDP2's DTensor parameters, each block compiled), not the collectives across GPUs.
    import torch.distributed as dist
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save
    from torch.nn.parallel import DistributedDataParallel

    from trainer.diffusion.backbones.dit import DiTBackbone, DiTBackboneConfig
    from trainer.engine.compile import compile_blocks
    from trainer.engine.float8 import apply_float8
    from trainer.engine.shard import shard_module

    def dit():  # as the ddpm task builds it (its FSDP units and the unit kept gathered)
        torch.manual_seed(0)
        # width 384: the MLPs' first layers (384 -> 1,536) are above torchao's tensorwise thresholds
        shape = DiTBackboneConfig(num_layers=2, num_attention_heads=4, attention_head_dim=96)
        return DiTBackbone.build(shape, sample_size=16, channels=1, num_classes=10).model

    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1, device_id=device)
    try:
        plain, model = dit().to(device), dit().to(device)
        assert apply_float8({"transformer": model}, {"transformer"}, "tensorwise", device, "ddpm") > 0
        assert compile_blocks(model)
        wrapped = (
            DistributedDataParallel(model, device_ids=[0]) if parallel == "ddp" else shard_module(model, "bf16", False)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator(device).manual_seed(1)
        losses = []
        for _ in range(4):
            x = torch.randn(16, 1, 16, 16, device=device, generator=g)
            t = torch.randint(0, 1000, (16,), device=device, generator=g)
            labels = torch.randint(0, 10, (16,), device=device, generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(wrapped(x, timestep=t, class_labels=labels).sample.float(), x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert all(torch.isfinite(torch.tensor(losses))), losses
        state = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.state_dict().items()
        }
        assert state.keys() == plain.state_dict().keys()
        assert all(type(v) is torch.Tensor and v.dtype == plain.state_dict()[k].dtype for k, v in state.items())
        assert any(not torch.equal(state[k], v) for k, v in plain.state_dict().items())  # it learned
        plain.load_state_dict(st_load(st_save({k: v.contiguous() for k, v in state.items()})), strict=True)
    finally:
        dist.destroy_process_group()
