"""Process model under torchrun: rank and restart accounting, stop signals, exit codes."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_INVALID_CHECKPOINT = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 143  # 128 + SIGTERM, what Kubernetes and torchrun expect from a stopped worker


@dataclass(frozen=True)
class DistEnv:
    """What torchrun tells a worker; a plain `python` run is rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0
    restart_count: int = 0
    run_id: str = "local"

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if env is None else env

        def num(key: str, default: int) -> int:
            return int(env.get(key, default))

        return cls(
            rank=num("RANK", 0),
            world_size=num("WORLD_SIZE", 1),
            local_rank=num("LOCAL_RANK", 0),
            local_world_size=num("LOCAL_WORLD_SIZE", 1),
            group_rank=num("GROUP_RANK", 0),
            restart_count=num("TORCHELASTIC_RESTART_COUNT", 0),
            run_id=env.get("TORCHELASTIC_RUN_ID", "local"),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


class StopRequest:
    """SIGTERM/SIGINT set a flag; the loop stops at the end of the current optimizer step.

    The handler does nothing else: the loop agrees on the stop with every rank
    (see `agree_to_stop`) so no rank leaves while others wait in a collective.
    A second signal exits at once with 143 (the last committed checkpoint
    stays valid, since a checkpoint only exists once its manifest is written).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            sys.stderr.write(f"gentrain: second signal {signal.Signals(signum).name}, exiting now\n")
            sys.stderr.flush()
            os._exit(EXIT_PREEMPTED)
        self.signum = signum
        self.received_at = time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def seconds_left(self, grace_seconds: float) -> float:
        if self.received_at is None:
            return grace_seconds
        return grace_seconds - (time.monotonic() - self.received_at)


def process_start_time() -> float:
    """Unix time this process started (from /proc on Linux; now elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


class StartupClock:
    """Marks on the way from process start to the first completed step, logged once by rank 0.

    Restart time after a preemption is mostly here (imports, rendezvous,
    checkpoint load), so the log line says where it went.
    """

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = [("process_start", process_start_time())]
        self.finished = False

    def mark(self, name: str, last: bool = False) -> None:
        self.marks.append((name, time.time()))
        self.finished = last

    def summary(self) -> dict[str, float]:
        out = {}
        for (_, t0), (name, t1) in zip(self.marks, self.marks[1:], strict=False):
            out[name] = round(t1 - t0, 3)
        out["total"] = round(self.marks[-1][1] - self.marks[0][1], 3)
        out["process_start_unix"] = round(self.marks[0][1], 3)
        out["first_step_unix"] = round(self.marks[-1][1], 3)
        return out


def init_process_group(env: DistEnv, backend: str, timeout_seconds: float) -> None:
    """Initialize torch.distributed for a torchrun worker, safe across torchrun restarts.

    With the c10d rendezvous, torchrun lends its own rendezvous TCPStore to the
    workers (TORCHELASTIC_USE_AGENT_STORE=True) and torch assumes a fresh store
    per restart, but that store lives as long as the agent: keys such as gloo's
    rank addresses survive from the previous attempt, and a restarted rank 1
    then connects to the dead rank 0's port ("Connection refused", seen here in
    about one restart in three). On a single node the restart count is the
    agent's own, so keys are namespaced per attempt. Across nodes each agent
    counts on its own, so there the fix is TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    in torchrun's environment (`gentrain launch`, the manifests and the TorchX
    component set it): rank 0 then hosts a new store every round.
    """
    from datetime import timedelta

    if env.world_size == 1 or dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_seconds)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
        return
    if env.local_world_size != env.world_size:
        log.warning(
            "torchrun shares its rendezvous store with the workers across nodes; a restart can then read "
            "stale keys. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (gentrain launch does)."
        )
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
        return
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size, is_master=False, timeout=timeout
    )
    prefixed = dist.PrefixStore(f"gentrain/{env.run_id}/attempt-{env.restart_count}", store)
    dist.init_process_group(backend, store=prefixed, rank=env.rank, world_size=env.world_size, timeout=timeout)


def agree_to_stop(local_flag: bool, device: torch.device) -> bool:
    """True on every rank if any rank was asked to stop (one all-reduce of an int)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local_flag
    t = torch.tensor([1 if local_flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_object(obj, src: int = 0, group=None):
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(obj, group=None) -> list:
    """Every rank's `obj`, in rank order, on every rank (small values only)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def new_gloo_group(timeout_seconds: float):
    """A CPU process group of all ranks, for small objects exchanged off the training thread (collective)."""
    from datetime import timedelta

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
