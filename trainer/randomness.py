"""Counter-based randomness: every random draw of a step is a pure function of (seed, step, sample).

Why not the global RNG: data-loader workers, sampling and library calls all
advance it, so a resumed run would draw different noise than the run it
replaces. Keying each sample's noise, timestep and condition dropout by its
position in the *global* batch also makes the draws independent of world
size, gradient accumulation and micro-batching: the same step consumes the
same randomness whether it runs on 1 rank or 3.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Mapping, Sequence

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*keys: int) -> int:
    """A well-mixed 63-bit seed from a tuple of integers (order matters); draws use it through `stream_seed`."""
    h = 0x243F6A8885A308D3
    for k in keys:
        h = _splitmix64(h ^ (int(k) & _MASK64))
    return h & ((1 << 63) - 1)


@enum.unique
class Stream(enum.Enum):
    """Every random stream keyed from the run's seed: value (id, number of keys after the id[, span]).

    A draw of stream S is seeded with derive_seed(seed, S.id, *keys) (`stream_seed`). The ids are
    the numbers runs have always used, and they must stay: a new id changes every draw of its stream,
    so a resumed run would not continue bit-identically and presets would give other results. Two ids
    are shared, each by streams of different key counts (1: MASKGIT 2 keys, DATA_ORDER 1; 3:
    STEP_GLOBAL 3 keys, SHARD_ORDER 1), which keeps them apart: derive_seed mixes one key per
    splitmix round, so the seed of a longer tuple is the shorter tuple's chain mixed further, equal to
    it only by a 64-bit hash collision, the odds for any two distinct tuples. Hence (id, keys) is what
    must be unique, and it is the enum's value (a plain Enum, not an IntEnum: members that shared an
    int would be aliases, and an int member passed to derive_seed would hash its value; int(member)
    raises instead). A stream with a span owns the ids id .. id + span - 1 (`substream`);
    tests/test_shard_order.py checks that no two streams with the same key count overlap.
    """

    # keys (step, position in the global batch): per-sample generators (`sample_generators`)
    DIFFUSION = (0, 2)  # noise, timestep and condition dropout of the diffusion tasks
    MASKGIT = (1, 2)  # masks and condition dropout
    CASCADE_STAGE = (100, 2, 1000)  # stage k (1, 2, ...) uses id 100 + k: the stages draw independently
    AUTOENCODER = (6, 2)  # a KL posterior sample: the autoencoder task's, and a latent ddpm's frozen one
    # keys (epoch, sample index): SampleRef.aug_seed
    AUGMENT = (2, 2)
    # keys (epoch, window number): the sample order within a window of shards
    SHARD_WINDOW = (4, 2)
    # keys (epoch,): the per-epoch permutations
    DATA_ORDER = (1, 1)  # of the training set
    SHARD_ORDER = (3, 1)  # of the shards
    BUCKET_BATCHES = (8, 1)  # of an epoch's batches of aspect-ratio buckets (trainer.data.sampler.BucketStream)
    # keys (bucket,): the seed of one aspect-ratio bucket's own per-epoch permutations
    BUCKET_MEMBERS = (7, 1)
    # keys (chunk,): the generated images of FID chunk k
    FID_CHUNK = (0xE7A1, 1)
    # keys (step, rank, chunk): the global torch/numpy/random RNGs, reseeded per forward chunk
    STEP_GLOBAL = (3, 3)
    # no keys: the seed of the image stream of a joint image+clip set
    JOINT_IMAGES = (5, 0)
    # no keys: the seed of the class images' stream of a DreamBooth set (trainer.data.dreambooth)
    DREAMBOOTH_CLASS = (0xDB, 0)
    # keys (image index,): the initial noise of class image i (`gentrain data class-images`)
    CLASS_IMAGE = (0xC1A5, 1)

    def __init__(self, id_: int, nkeys: int, span: int = 1):
        self.id = id_
        self.nkeys = nkeys
        self.span = span


# The streams keyed (step, position in the global batch), the only ones `sample_generators` draws.
_PER_SAMPLE = (Stream.DIFFUSION, Stream.MASKGIT, Stream.CASCADE_STAGE, Stream.AUTOENCODER)


def stream_seed(seed: int, stream: Stream, *keys: int, substream: int = 0) -> int:
    """The seed of one draw of `stream`: derive_seed(seed, id + substream, *keys), with exactly its keys."""
    return derive_seed(seed, _stream_id(stream, len(keys), substream), *keys)


def sample_generators(
    seed: int, step: int, positions: Sequence[int], stream: Stream = Stream.DIFFUSION, substream: int = 0
) -> list[torch.Generator]:
    """One CPU generator per sample of `stream` (keys: step, position in the step's global batch)."""
    if stream not in _PER_SAMPLE:
        raise ValueError(f"random stream {stream.name} is not keyed by (step, position)")
    sid = _stream_id(stream, 2, substream)
    gens = []
    for pos in positions:
        g = torch.Generator()
        g.manual_seed(derive_seed(seed, sid, step, pos))
        gens.append(g)
    return gens


def _stream_id(stream: Stream, nkeys: int, substream: int) -> int:
    if nkeys != stream.nkeys:
        raise TypeError(f"random stream {stream.name} takes {stream.nkeys} keys, got {nkeys}")
    if not 0 <= substream < stream.span:
        raise ValueError(f"random stream {stream.name} has substreams 0..{stream.span - 1}, got {substream}")
    return stream.id + substream


def per_sample_randn(gens: Sequence[torch.Generator], shape: Sequence[int]) -> torch.Tensor:
    return torch.stack([torch.randn(tuple(shape), generator=g) for g in gens])


def per_sample_randint(gens: Sequence[torch.Generator], high: int) -> torch.Tensor:
    return torch.cat([torch.randint(0, high, (1,), generator=g) for g in gens])


def per_sample_rand(gens: Sequence[torch.Generator]) -> torch.Tensor:
    return torch.cat([torch.rand(1, generator=g) for g in gens])


# ---------------------------------------------------------------------------------------------- draw streams
# How a training step's per-sample draws are made. The version is recorded in every checkpoint
# (TrainProgress: `rng_stream`), so a run resumes on the stream it started with:
# 1: one CPU torch.Generator per sample, each drawn in turn and the results copied to the device. Exact,
#    but at batch 256 it costs the host ~13 ms a step (768 tiny draws), and the GPU waits for it: every
#    checkpoint written before stream 2 existed (they record no version) stays on it.
# 2: the global batch is cut into blocks of BLOCK_ROWS positions; call k of a step draws block b with one
#    generator on the training device seeded from (seed, stream, step, k, b), so a draw is a few vectorized
#    ops on the device, and position p still gets the same numbers at any world size, accumulation and
#    micro-batching (its block and its row in it depend on p only). A rank draws only the blocks its
#    positions fall in. Different devices (CPU, CUDA) draw different numbers for the same key: exact resume
#    is promised on one kind of device, as before.
STREAM_PER_SAMPLE_CPU = 1
STREAM_DEVICE_BLOCKS = 2
CURRENT_STREAM = STREAM_DEVICE_BLOCKS
STREAMS = (STREAM_PER_SAMPLE_CPU, STREAM_DEVICE_BLOCKS)
BLOCK_ROWS = 64
# Seeds of stream 2 are derive_seed(seed, stream id, step, call, block, _BLOCKS_TAG): six keys after the
# seed, a tuple length no other stream uses, so (see `Stream`) they never coincide with another stream's.
_BLOCKS_TAG = 0xB10C5
_stream_version = CURRENT_STREAM


def set_stream_version(version: int) -> None:
    """Which draw stream `sample_draws` uses in this process (the resumed checkpoint's, or CURRENT_STREAM)."""
    global _stream_version
    if version not in STREAMS:
        raise ValueError(f"unknown per-sample draw stream {version!r}; this gentrain knows {STREAMS}")
    _stream_version = version


def stream_version() -> int:
    return _stream_version


class SampleDraws:
    """The per-sample draws of one step and stream for a chunk's positions, taken in a fixed order.

    Each call returns one value (or tensor) per sample, on `device`: `randn(shape)`, `rand(shape)`,
    `randint(high)`, `timestep_density(...)`. The order of calls is part of a task's contract (a resumed
    run must make the same calls in the same order to draw the same numbers)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def randn(self, shape: Sequence[int] = ()) -> torch.Tensor:
        raise NotImplementedError

    def rand(self, shape: Sequence[int] = ()) -> torch.Tensor:
        raise NotImplementedError

    def randint(self, high: int) -> torch.Tensor:
        raise NotImplementedError

    def timestep_density(self, scheme: str, logit_mean: float, logit_std: float, mode_scale: float) -> torch.Tensor:
        """u in [0, 1] per sample, distributed as diffusers' `compute_density_for_timestep_sampling` (SD3's
        logit-normal, mode, or uniform) draws it."""
        raise NotImplementedError


class _PerSampleCpuDraws(SampleDraws):
    """Stream 1: the generators of `sample_generators`, results copied to the device without a host wait."""

    def __init__(self, gens: list[torch.Generator], device: torch.device):
        super().__init__(device)
        self.gens = gens

    def _to(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, non_blocking=True)

    def randn(self, shape=()):
        return self._to(per_sample_randn(self.gens, shape))

    def rand(self, shape=()):
        shape = tuple(shape)
        if not shape:
            return self._to(per_sample_rand(self.gens))
        return self._to(torch.stack([torch.rand(shape, generator=g) for g in self.gens]))

    def randint(self, high):
        return self._to(per_sample_randint(self.gens, high))

    def timestep_density(self, scheme, logit_mean, logit_std, mode_scale):
        from diffusers.training_utils import compute_density_for_timestep_sampling  # only stream 1 needs it

        u = [
            compute_density_for_timestep_sampling(scheme, 1, logit_mean, logit_std, mode_scale, generator=g)
            for g in self.gens
        ]
        return self._to(torch.cat(u))


class _DeviceBlockDraws(SampleDraws):
    """Stream 2: per-block generators on the training device (see the module's notes on streams)."""

    _pool: dict[torch.device, torch.Generator] = {}

    def __init__(self, prefix: tuple[int, ...], positions: Sequence[int], device: torch.device):
        super().__init__(device)
        self.prefix = prefix
        self.positions = [int(p) for p in positions]
        self.calls = 0
        lo, hi = min(self.positions), max(self.positions)
        self.first_block, self.last_block = lo // BLOCK_ROWS, hi // BLOCK_ROWS
        start = lo - self.first_block * BLOCK_ROWS
        if self.positions == list(range(lo, lo + len(self.positions))):
            self.rows: slice | torch.Tensor = slice(start, start + len(self.positions))
        else:  # not contiguous (no sampler makes such chunks today): gather
            index = torch.tensor([p - self.first_block * BLOCK_ROWS for p in self.positions])
            self.rows = index.to(self.device, non_blocking=True)

    def _generator(self, call: int, block: int) -> torch.Generator:
        g = self._pool.get(self.device)
        if g is None:
            g = self._pool[self.device] = torch.Generator(device=self.device)
        g.manual_seed(derive_seed(*self.prefix, call, block, _BLOCKS_TAG))
        return g

    def _draw(self, fill) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        blocks = [fill(self._generator(call, b)) for b in range(self.first_block, self.last_block + 1)]
        x = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        return x[self.rows]

    def randn(self, shape=()):
        size = (BLOCK_ROWS, *shape)
        return self._draw(lambda g: torch.randn(size, generator=g, device=self.device))

    def rand(self, shape=()):
        size = (BLOCK_ROWS, *shape)
        return self._draw(lambda g: torch.rand(size, generator=g, device=self.device))

    def randint(self, high):
        return self._draw(lambda g: torch.randint(0, high, (BLOCK_ROWS,), generator=g, device=self.device))

    def timestep_density(self, scheme, logit_mean, logit_std, mode_scale):
        # diffusers.training_utils.compute_density_for_timestep_sampling (SD3, Esser et al. 2024, sec. 3.1),
        # vectorized on the device: it draws on the CPU only, one tensor per call.
        def fill(g):
            if scheme == "logit_normal":
                return torch.sigmoid(
                    torch.normal(logit_mean, logit_std, (BLOCK_ROWS,), generator=g, device=self.device)
                )
            u = torch.rand((BLOCK_ROWS,), generator=g, device=self.device)
            if scheme == "mode":
                u = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
            return u

        return self._draw(fill)


def sample_draws(
    seed: int,
    step: int,
    positions: Sequence[int],
    stream: Stream = Stream.DIFFUSION,
    substream: int = 0,
    device: torch.device | str = "cpu",
) -> SampleDraws:
    """The per-sample draws of `stream` at `step` for samples at `positions` of the global batch, on
    `device`, from the process's draw stream version (`set_stream_version`)."""
    if _stream_version == STREAM_PER_SAMPLE_CPU:
        return _PerSampleCpuDraws(sample_generators(seed, step, positions, stream, substream), torch.device(device))
    if stream not in _PER_SAMPLE:
        raise ValueError(f"random stream {stream.name} is not keyed by (step, position)")
    sid = _stream_id(stream, 2, substream)
    return _DeviceBlockDraws((seed, sid, step), positions, torch.device(device))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """Global RNG states as (tensors, json-able values) for the checkpoint."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    np_state = np.random.get_state()
    values = {
        "python": _jsonable(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    return tensors, values


def set_rng_state(tensors: dict[str, torch.Tensor], values: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    random.setstate(_tuplify(values["python"]))
    n = values["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))


def check_rng_state(tensors: Mapping[str, torch.Tensor] | None, values: Mapping | None) -> None:
    """Raise ValueError unless `set_rng_state` accepts these states: each is applied to a scratch generator
    (torch, Python's `random.Random`, numpy's `RandomState`), never to the global ones, so a checkpoint
    whose RNG state the setters refuse is found before anything of it is applied."""
    try:
        if tensors is not None:
            torch.Generator().set_state(tensors["torch_cpu"])
            if "torch_cuda" in tensors and torch.cuda.is_available():
                torch.Generator(device="cuda").set_state(tensors["torch_cuda"])
        if values is not None:
            random.Random().setstate(_tuplify(values["python"]))
            n = values["numpy"]
            np.random.RandomState().set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    except (RuntimeError, ValueError, TypeError, OverflowError, KeyError, IndexError) as e:
        raise ValueError(f"{type(e).__name__}: {str(e)[:200]}") from None


def _jsonable(x):
    if isinstance(x, tuple | list):
        return [_jsonable(v) for v in x]
    return x


def _tuplify(x):
    if isinstance(x, list):
        return tuple(_tuplify(v) for v in x)
    return x
