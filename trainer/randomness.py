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
    # keys (chunk,): the generated images of FID chunk k
    FID_CHUNK = (0xE7A1, 1)
    # keys (step, rank, chunk): the global torch/numpy/random RNGs, reseeded per forward chunk
    STEP_GLOBAL = (3, 3)
    # no keys: the seed of the image stream of a joint image+clip set
    JOINT_IMAGES = (5, 0)

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
