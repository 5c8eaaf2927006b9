"""JobAgreement: the stop flag and the skipped-sample count of every step in one all-reduce, read `lag` steps
later (on CUDA, so the host never waits for the step it just queued). Real processes and a real gloo group:
every rank must settle the same steps with the same values at the same step, and `drain` must settle the
rest, or ranks would stop at different steps (a hang) or save different skip counts."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.engine.progress import JobAgreement

STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, lag: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        agreement = JobAgreement(torch.device("cpu"), lag=lag)
        settled = []
        for step in range(1, STEPS + 1):
            stop = rank == 1 and step == 3  # one rank is asked to stop at step 3
            batch = {"skipped": rank + step, "skipped_files": [f"r{rank}-s{step}"] if rank + step else []}
            settled.append((step, agreement.post(stop, batch)))
        settled.append(("drain", agreement.drain()))
        out.put((rank, settled))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("lag", [0, 1, 2])
def test_every_rank_settles_the_same_steps_with_the_same_values(lag):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, lag, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results[0] == results[1]  # the same settlements at the same steps on both ranks
    settled = results[0]
    # Step s's result arrives at step s + lag (or at the drain), each step exactly once, in order.
    flat = [(at, r) for at, rs in settled for r in rs]
    assert len(flat) == STEPS
    for s, (at, (stop, skipped, files)) in enumerate(flat, start=1):
        assert at == (s + lag if s + lag <= STEPS else "drain")
        assert stop == (s == 3)
        assert skipped == (0 + s) + (1 + s)  # both ranks' counts summed
        assert sorted(files) == sorted(f"r{r}-s{s}" for r in range(2) if r + s)


def test_one_process_settles_at_once_without_a_collective():
    agreement = JobAgreement(torch.device("cpu"), lag=1)
    assert agreement.post(True, {"skipped": 2, "skipped_files": ["a"]}) == [(True, 2, ["a"])]
    assert agreement.drain() == []
