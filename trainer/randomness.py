"""Counter-based randomness: every random draw of a step is a pure function of (seed, step, sample).

Why not the global RNG: data-loader workers, sampling and library calls all
advance it, so a resumed run would draw different noise than the run it
replaces. Keying each sample's noise, timestep and condition dropout by its
position in the *global* batch also makes the draws independent of world
size, gradient accumulation and micro-batching: the same step consumes the
same randomness whether it runs on 1 rank or 3.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive_seed(*keys: int) -> int:
    """A well-mixed 63-bit seed from a tuple of integers (order matters)."""
    h = 0x243F6A8885A308D3
    for k in keys:
        h = _splitmix64(h ^ (int(k) & _MASK64))
    return h & ((1 << 63) - 1)


def sample_generators(seed: int, step: int, positions: Sequence[int], stream: int = 0) -> list[torch.Generator]:
    """One CPU generator per sample, keyed by its position in the step's global batch."""
    gens = []
    for pos in positions:
        g = torch.Generator()
        g.manual_seed(derive_seed(seed, stream, step, pos))
        gens.append(g)
    return gens


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


def _jsonable(x):
    if isinstance(x, tuple | list):
        return [_jsonable(v) for v in x]
    return x


def _tuplify(x):
    if isinstance(x, list):
        return tuple(_tuplify(v) for v in x)
    return x
