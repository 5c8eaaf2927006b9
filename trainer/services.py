"""What a task may ask of the processes it runs in, by intent: it never learns ranks, world sizes or how
the engine wrapped or sharded its parts (`TaskContext.services`).

- `any_rank(flag)`: is `flag` true in any process of the run? (MaskGIT's token cache: does any rank
  still have images to encode through a sharded tokenizer, whose every call all ranks must join?)
- `calls_are_collective(module)`: is calling `module` a collective, one every process must make the
  same number of times because its weights are sharded across them (FSDP)?

`ProcessServices` answers from the process itself at call time: one process (or torch.distributed not
initialized) is trivially alone; otherwise the default process group all-reduces. The engine needs to
set nothing up: a TaskContext built before the process group exists answers correctly afterwards.

It lives below the tasks (and evaluation, which samples through them) rather than in the engine because it
needs only torch: tasks ask for it without importing the engine that runs them (tests/test_layers.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule


class ProcessServices:
    """The engine services of the current process (see module doc)."""

    @staticmethod
    def _distributed() -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def any_rank(self, flag: bool, device: torch.device | None = None) -> bool:
        """True when `flag` is true in any process of the run. Every process must call it, in the same order
        (it is a collective when there are several). `device`: where the caller's tensors live (NCCL reduces
        device memory); default: the current CUDA device under NCCL, else the CPU."""
        if not self._distributed():
            return bool(flag)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        anyone = torch.tensor([1 if flag else 0], device=device)
        dist.all_reduce(anyone, op=dist.ReduceOp.MAX)
        return bool(anyone.item())

    def calls_are_collective(self, module: nn.Module) -> bool:
        """True when `module` (or a block of it) is sharded across processes: each call gathers weights
        from every process, so all of them must call it the same number of times."""
        return any(isinstance(m, FSDPModule) for m in module.modules())  # engine.shard.is_fsdp's test


def process_services() -> ProcessServices:
    """The default `TaskContext.services`."""
    return ProcessServices()
