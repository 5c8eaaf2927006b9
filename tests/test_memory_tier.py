"""The memory tier of checkpoints (trainer.checkpoint.memory): placement, agreement, and exact resume.

One process: a SIGKILL resumes from the memory tier at the last completed step; a digest-failing memory
snapshot is skipped for the one before it; with both tiers' newest snapshots corrupted the older durable
checkpoint is used; every route ends bit-identical to an uninterrupted run. Under torchrun, two agents
on 127.0.0.1 are two nodes (each with its own memory folder): a worker crash, a node lost and replaced,
and a node lost in the middle of a replication, under FSDP and DDP.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env, free_port, run_cli, tiny
from elastic_helpers import start_torchrun
from helpers import kill_group, kill_tree, start_cli, wait_for_log
from test_vqgan_maskgit import tensors

from trainer.checkpoint.memory import KEEP, Topology, agree, memory_root
from trainer.checkpoint.store import CheckpointStore

# ------------------------------------------------------------------ placement and agreement


def test_buddies_are_the_same_local_rank_on_the_next_node_and_cover_every_rank():
    t = Topology(("a", "a", "b", "b", "c", "c"))
    assert t.nodes == [[0, 1], [2, 3], [4, 5]]
    assert [t.buddy(r) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [t.sources(r) for r in range(6)] == [[4], [5], [0], [1], [2], [3]]
    assert [t.leader(r) for r in range(6)] == [0, 0, 2, 2, 4, 4]
    # Ranks need not be contiguous per node; unequal nodes wrap around the smaller one.
    t = Topology(("b", "a", "b", "a", "a"))
    assert t.nodes == [[0, 2], [1, 3, 4]]
    assert t.buddy(0) == 1 and t.buddy(2) == 3 and t.buddy(4) == 0
    # Every rank's piece lives on two different nodes: any single node loss leaves a copy.
    for r in range(5):
        assert t.node_of[t.buddy(r)] != t.node_of[r]
    assert Topology(("a", "a")).buddy(0) is None


def test_agreement_picks_the_newest_step_complete_somewhere_and_newer_than_the_durable_one():
    fsdp = (2, True)
    reports = [
        ({7: {0: fsdp, 1: fsdp}, 8: {0: fsdp}}, 8, 0),  # node of rank 0: step 8 lacks rank 1's piece
        (None, None, 1),
        ({7: {1: fsdp}, 8: {1: fsdp}}, 8, 2),  # ... which the other node has
    ]
    plan = agree(reports, durable=5)
    assert plan.candidates == [8, 7] and plan.reached == 8
    assert plan.holders[8] == {0: [0], 1: [2]} and plan.owners[8] == [0, 1]
    assert agree(reports, durable=7).candidates == [8]
    assert agree(reports, durable=8).candidates == []
    # Rank 1's piece of step 8 lost with its node: step 7 is the newest complete one.
    assert agree([({7: {0: fsdp, 1: fsdp}, 8: {0: fsdp}}, 8, 0)], durable=None).candidates == [7]
    # DDP: one piece holds everything; pieces of different world sizes never combine.
    assert agree([({3: {0: (4, False)}}, 3, 0)], None).owners[3] == [0]
    assert agree([({3: {0: (2, True)}}, 3, 0), ({3: {1: (4, True)}}, 3, 1)], None).candidates == []


# ------------------------------------------------------------------ one process


def _args(root: Path, *extra: str) -> list[str]:
    return tiny(
        root,
        "task=probe_tasks:KillableDDPM",
        "checkpoint.memory=true",
        f"checkpoint.memory_dir={root}/shm",
        "checkpoint.every_steps=4",
        "model.dropout=0.1",
        *extra,
        max_steps=12,
    )


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last byte of the tensor data: the header still parses, the digest does not match
    path.write_bytes(bytes(data))


def _killed(args: list[str], log: Path, env: dict[str, str], piece: Path) -> None:
    kill = {"PROBE_TASK_KILL": "0:10", "PROBE_TASK_KILL_AFTER": str(piece)}
    proc = start_cli("train", *args, env={**env, **kill}, log_path=log, cwd=REPO)
    try:
        assert proc.wait(timeout=600) == -9, log.read_text()[-3000:]
    finally:
        kill_group(proc)


@pytest.mark.slow
def test_one_process_resumes_from_memory_skips_corrupt_snapshots_and_falls_back_to_durable(tmp_path):
    env = clean_env(PYTHONPATH=f"{REPO}/tests")
    r = run_cli("train", *_args(tmp_path / "ref"), env=env)
    assert r.returncode == 0, r.stderr[-3000:]

    root = tmp_path / "killed"
    args = _args(root)
    durable = f"{root}/run/checkpoints"
    mem = Path(memory_root(f"{root}/shm", durable))
    step_dir = lambda s: mem / f"step-{s:09d}"  # noqa: E731

    # SIGKILL in the step after step 10, once step 10's snapshot is in memory: memory holds 9 and 10, the
    # durable tier 4 and 8.
    _killed(args, tmp_path / "k1.log", env, step_dir(10) / "piece-r00000.json")
    assert sorted(p.name for p in mem.glob("step-*")) == [step_dir(s).name for s in (9, 10)]
    assert [i.step for i in CheckpointStore(durable).list()] == [4, 8]
    # Step 10's snapshot fails its digest: the resume skips it for step 9, the newest sound one.
    _corrupt(step_dir(10) / "unet.model.safetensors")
    _killed(args, tmp_path / "k2.log", env, step_dir(10) / "piece-r00000.json")
    text = (tmp_path / "k2.log").read_text()
    assert "memory tier: step 10 cannot be loaded" in text, text[-3000:]
    assert re.search(r"resumed_from=memory:\S+step-000000009 step=9 steps_lost=1 ", text), text[-3000:]
    # Killed again after step 10: both tiers' newest snapshots corrupted, the durable step 4 remains.
    for s in (9, 10):
        _corrupt(step_dir(s) / "unet.optimizer.safetensors")
    _corrupt(Path(durable) / "step-000000008" / "unet.model.safetensors")
    r = run_cli("train", *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(rf"resumed_from={durable}/step-000000004 step=4 steps_lost=6 ", r.stderr), r.stderr[-3000:]
    ref, got = tensors(f"{tmp_path}/ref/run/checkpoints", 12), tensors(durable, 12)
    assert ref.keys() == got.keys()
    for name in ref:
        for key in ref[name]:
            assert torch.equal(ref[name][key], got[name][key]), f"{name}:{key}"
    # The finished run keeps KEEP snapshots in memory, and `checkpoints list` shows both tiers.
    assert len(list(mem.glob("step-*"))) == KEEP
