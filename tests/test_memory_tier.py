"""The memory tier of checkpoints (trainer.checkpoint.memory): placement, agreement, and exact resume.

One process: a SIGKILL resumes from the memory tier at the last completed step; a digest-failing memory
snapshot is skipped for the one before it; with both tiers' newest snapshots corrupted the older durable
checkpoint is used; every route ends bit-identical to an uninterrupted run. Under torchrun, two agents
on 127.0.0.1 are two nodes (each with its own memory folder): a worker crash, a node lost and replaced,
and a node lost in the middle of a replication, under FSDP and DDP.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env, free_port, run_cli, tiny
from elastic_helpers import start_torchrun
from helpers import kill_group, kill_tree, start_cli, wait_for_log, wait_until
from test_vqgan_maskgit import tensors

from trainer.checkpoint.memory import KEEP, Topology, agree, memory_root, scan
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


def _piece(step: int, owner: int) -> dict:
    return {
        "format_version": 2,
        "step": step,
        "owner": owner,
        "world_size": 2,
        "sharded": True,
        "files": {f"rank-{owner:05d}.json": {"bytes": 2, "blake3": "0" * 64}},
        "index": {},
        "meta": {"task": "ddpm"} if owner == 0 else None,
    }


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"files": {"../x.safetensors": {"bytes": 1, "blake3": "0" * 64}}}, "not a payload file name"),
        ({"files": {"piece-r00000.json": {"bytes": 1, "blake3": "0" * 64}}}, "not a payload file name"),
        ({"owner": 1}, "says rank 1 of 2"),
        ({"step": 4}, "step 4"),
        ({"world_size": 0}, "piece of rank 0"),
        ({"meta": None}, "only rank 0's piece"),
        ({"files": {"a.json": {"bytes": -1, "blake3": "0" * 64}}}, "piece of rank 0"),
        ({"sharded": "yes"}, "piece of rank 0"),
    ],
)
def test_a_piece_that_breaks_its_schema_name_or_dir_is_refused(change, why):
    from trainer.checkpoint.validity import parse_piece
    from trainer.errors import CheckpointCorrupt

    with pytest.raises(CheckpointCorrupt, match=re.escape(why)):
        parse_piece(json.dumps({**_piece(3, 0), **change}).encode(), 3, 0)


def test_scan_holds_only_pieces_whose_commit_file_parses_and_whose_files_are_whole(tmp_path, caplog):
    from trainer.checkpoint.memory import scan

    def put(step: int, owner: int, payload: bytes = b"{}", doc: dict | None = None) -> Path:
        d = tmp_path / f"step-{step:09d}"
        d.mkdir(exist_ok=True)
        (d / f"rank-{owner:05d}.json").write_bytes(payload)
        (d / f"piece-r{owner:05d}.json").write_text(json.dumps(doc or _piece(step, owner)))
        return d

    put(5, 0)
    put(5, 1)
    put(6, 0, payload=b"{")  # torn: one byte where the piece says two
    put(6, 1, doc={"step": 6})  # a commit file that is not a piece
    (put(7, 1).joinpath("rank-00001.json")).unlink()  # a listed file gone
    (tmp_path / "step-000000008").mkdir()  # being written: no commit file yet
    (tmp_path / "step-000000009").symlink_to(tmp_path / "step-000000005")  # links are never followed
    (tmp_path / "not-a-step").mkdir()
    assert {step: sorted(p) for step, p in scan(str(tmp_path)).items()} == {5: [0, 1]}
    assert "missing or has the wrong size" in caplog.text and "piece of rank 1" in caplog.text


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


def _assert_newest_memory_steps(mem: Path, newest: list[int]) -> None:
    """The memory steps holding a committed piece after a SIGKILL: `newest`, and at most the one step
    before them. The writer thread drops the step beyond KEEP (retention) only after it committed the
    newest step's piece, the event the kill waits for, so a kill may land before that step is gone; the
    process is dead then and no later event can be waited for. What is promised: the KEEP newest steps
    are there, nothing older than the step retention was about to drop, nothing newer."""
    held = sorted(scan(str(mem)))
    assert held[-KEEP:] == newest and set(held) <= {newest[0] - 1, *newest}, held


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
    _assert_newest_memory_steps(mem, [9, 10])
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
    r = run_cli("checkpoints", "list", durable, "--memory-dir", f"{root}/shm", env=env)
    assert r.returncode == 0, r.stderr
    memory_part, durable_part = r.stdout.split("durable tier")
    assert re.search(r"^\s+11\s+whole state\s+.*complete here$", memory_part, re.M), r.stdout
    assert re.search(r"^\s+12\s+\S+.*valid \(LATEST\)$", durable_part, re.M), r.stdout


# ------------------------------------------------------------------ two torchrun agents as two nodes


def _two_node_args(root: Path, ckpt: str, parallel: str, steps: int) -> list[str]:
    return tiny(
        root,
        "task=probe_tasks:KillableDDPM",
        f"train.parallel={parallel}",
        "model.dropout=0.1",
        "checkpoint.memory=true",
        f"checkpoint.url={ckpt}",
        "checkpoint.every_steps=0",  # the durable tier only at the end: every resume comes from memory
        "elastic.collective_timeout_seconds=120",  # a hang bound only: lost peers fail at once
        max_steps=steps,
    )


class _Nodes:
    """Two torchrun agents on 127.0.0.1, each a node with its own memory folder; the first hosts the
    c10d rendezvous (as pod 0 does), so the second is the one lost and replaced."""

    def __init__(self, tmp_path: Path, name: str, parallel: str, steps: int):
        self.tmp, self.name, self.parallel, self.steps = tmp_path, name, parallel, steps
        self.ckpt = f"{tmp_path}/{name}/checkpoints"
        port = self.port = free_port()
        self.torchrun = [
            "--nnodes=2",
            "--nproc-per-node=1",
            "--max-restarts=5",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={name}-{port}",
            "--rdzv-conf=join_timeout=120,last_call_timeout=1",
            "--monitor-interval=0.2",
        ]
        self.procs: list = []
        self.logs: list[Path] = []

    def memory(self, node: str) -> Path:
        return Path(memory_root(f"{self.tmp}/{self.name}/shm-{node}", self.ckpt))

    def start(self, node: str, **env: str):
        log = self.tmp / f"{self.name}-{node}.log"
        args = _two_node_args(self.tmp / self.name / node, self.ckpt, self.parallel, self.steps)
        proc = start_torchrun(
            self.torchrun,
            args,
            log,
            PYTHONPATH=f"{REPO}/tests",
            GENTRAIN_CHECKPOINT__MEMORY_DIR=f"{self.tmp}/{self.name}/shm-{node}",
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # a fresh store per round, as `gentrain launch` sets
            **env,
        )
        self.procs.append(proc)
        self.logs.append(log)
        return proc, log

    def hosting(self, proc) -> None:
        """Wait until `proc`'s agent listens on the rendezvous port: it, not the next agent, hosts the store."""

        def listens() -> bool:
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", self.port)) == 0

        wait_until(listens, f"an agent listening on 127.0.0.1:{self.port}", 120, [proc], interval=0.05)

    def text(self) -> str:
        return "\n".join(log.read_text() for log in self.logs if log.exists())

    def close(self) -> None:
        for proc in self.procs:
            kill_group(proc)


def _finish(proc, log: Path) -> None:
    try:
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        kill_group(proc)


def _lose_node(nodes: _Nodes, proc, node: str) -> None:
    """The node disappears: its agent and workers at once, and its shared memory with it."""
    kill_tree(proc)
    proc.wait(timeout=60)
    shutil.rmtree(nodes.memory(node).parent)


def _resumed(nodes: _Nodes, n: int) -> str:
    """`resumed_from=... step=N` of the n-th start at world size 2 (0: the fresh start), from rank 0's log,
    whichever node it is on (each agent counts its own restarts, so the lines are ordered by time)."""
    pattern = re.compile(r"^(\S+) INFO .* world_size=2 restart=\d+ .*resumed_from=(.+?) step=(\d+)", re.M)
    found = wait_until(lambda: sorted(pattern.findall(nodes.text()))[n:], f"resume number {n}", 300, [], nodes.logs)
    return f"{found[0][1]} step={found[0][2]}"


def _equal_to_reference(tmp_path: Path, parallel: str, steps: int, got: str) -> None:
    ref = _Nodes(tmp_path, "ref", parallel, steps)
    try:
        a, log_a = ref.start("a")
        ref.hosting(a)
        b, log_b = ref.start("b")
        _finish(a, log_a)
        _finish(b, log_b)
    finally:
        ref.close()
    want, have = tensors(ref.ckpt, steps), tensors(got, steps)
    assert want.keys() == have.keys()
    for name in want:
        for key in want[name]:
            assert torch.equal(want[name][key], have[name][key]), f"{name}:{key}"


@pytest.mark.slow
def test_fsdp_worker_crash_node_loss_and_loss_mid_replication_resume_from_memory_bit_identical(tmp_path):
    steps = 24
    nodes = _Nodes(tmp_path, "killed", "fsdp", steps)
    step_pieces = lambda node, s: str(nodes.memory(node) / f"step-{s:09d}" / "piece-r*.json")  # noqa: E731
    try:
        # 1. A worker on node a dies in the step after 6, once both pieces of step 6 are on node a: torchrun
        #    restarts the workers, which resume from their own nodes' memory at step 6.
        a, log_a = nodes.start(
            "a", PROBE_TASK_KILL="*:6", PROBE_TASK_KILL_AFTER=step_pieces("a", 6), PROBE_TASK_KILL_AFTER_COUNT="2"
        )
        nodes.hosting(a)
        # 2. Node b hangs in the step after 12 (once node a holds b's piece of step 12), and is lost whole.
        #    On any attempt: when a's worker dies, b's worker may die of the broken collective before b's
        #    agent sees the new round, and then b's agent counts a restart of its own.
        b, log_b = nodes.start(
            "b",
            PROBE_TASK_KILL="*:12",
            PROBE_TASK_KILL_ATTEMPT="*",
            PROBE_TASK_KILL_SIGNAL="STOP",
            PROBE_TASK_KILL_AFTER=step_pieces("a", 12),
            PROBE_TASK_KILL_AFTER_COUNT="2",
        )
        assert re.search(r"memory:\S+step-000000006 step=6$", _resumed(nodes, 1))
        wait_for_log(log_b, "probe: stopped in step 12", b, timeout=300)
        _lose_node(nodes, b, "b")
        # A new node joins with empty memory: it fetches both pieces of step 12 from node a.
        # 3. It stalls while sending its piece of step 18, and is lost too: step 18 is incomplete on
        #    node a, so the resume takes step 17, the previous complete one.
        b2, log_b2 = nodes.start("b2", GENTRAIN_FAULT_STALL_REPLICATION_AT_STEP="18")
        assert re.search(r"memory:\S+step-000000012 step=12$", _resumed(nodes, 2))
        wait_for_log(log_b2, "stalling the replication of step 18", b2, timeout=300)
        _lose_node(nodes, b2, "b2")
        b3, log_b3 = nodes.start("b3")
        assert re.search(r"memory:\S+step-000000017 step=17$", _resumed(nodes, 3))
        _finish(a, log_a)
        _finish(b3, log_b3)
    finally:
        nodes.close()
    assert "copied to the next of 2 nodes" in nodes.text()
    _equal_to_reference(tmp_path, "fsdp", steps, nodes.ckpt)


@pytest.mark.slow
def test_ddp_worker_crash_and_node_loss_resume_from_memory_bit_identical(tmp_path):
    # Under DDP every node writes the whole state from its own replica: nothing travels while training,
    # and the replacement node fetches the one piece from the survivor.
    steps = 16
    nodes = _Nodes(tmp_path, "killed", "ddp", steps)
    piece = lambda node, s: str(nodes.memory(node) / f"step-{s:09d}" / "piece-r00000.json")  # noqa: E731
    try:
        a, log_a = nodes.start("a", PROBE_TASK_KILL="*:5", PROBE_TASK_KILL_AFTER=piece("b", 5))
        nodes.hosting(a)
        b, log_b = nodes.start(
            "b",
            PROBE_TASK_KILL="*:10",
            PROBE_TASK_KILL_ATTEMPT="*",  # whatever restart b's agent counts when a's worker dies (above)
            PROBE_TASK_KILL_SIGNAL="STOP",
            PROBE_TASK_KILL_AFTER=piece("a", 10),
        )
        assert re.search(r"memory:\S+step-000000005 step=5$", _resumed(nodes, 1))
        wait_for_log(log_b, "probe: stopped in step 10", b, timeout=300)
        _lose_node(nodes, b, "b")
        b2, log_b2 = nodes.start("b2")
        assert re.search(r"memory:\S+step-000000010 step=10$", _resumed(nodes, 2))
        _finish(a, log_a)
        _finish(b2, log_b2)
    finally:
        nodes.close()
    assert "every node writes the whole state from its own replica (2 copies)" in nodes.text()
    _equal_to_reference(tmp_path, "ddp", steps, nodes.ckpt)


@pytest.mark.slow
def test_a_memory_snapshot_that_cannot_be_written_is_counted_and_training_goes_on(tmp_path):
    # Something that is not a directory where step 3's snapshot goes (as a full or broken /dev/shm would
    # fail it): that snapshot fails, is logged once, and the others and the durable tier are unaffected.
    args = tiny(tmp_path, "checkpoint.memory=true", f"checkpoint.memory_dir={tmp_path}/shm", max_steps=6)
    mem = Path(memory_root(f"{tmp_path}/shm", f"{tmp_path}/run/checkpoints"))
    mem.mkdir(parents=True)
    (mem / "step-000000003").write_text("not a directory")
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("memory-tier snapshot failed (1 so far; training continues") == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert sorted(p.parent.name for p in mem.glob("step-*/piece-r00000.json")) == ["step-000000004", "step-000000005"]
    assert CheckpointStore(f"{tmp_path}/run/checkpoints").latest_valid().step == 6


# ------------------------------------------------------------------ which run the memory tier belongs to


@pytest.mark.slow
def test_the_memory_tier_resumes_only_the_run_its_root_holds_and_a_deleted_root_starts_over(tmp_path):
    env = clean_env(PYTHONPATH=f"{REPO}/tests")
    root = tmp_path / "r"
    args = _args(root, "checkpoint.every_steps=0")  # the durable tier only at the end
    durable = Path(f"{root}/run/checkpoints")
    mem = Path(memory_root(f"{root}/shm", str(durable)))
    # Killed after step 10's snapshot, before any durable checkpoint: the lease the killed trainer left names
    # its run, so the restart resumes it from memory.
    _killed(args, tmp_path / "k.log", env, mem / "step-000000010" / "piece-r00000.json")
    assert not durable.joinpath("LATEST").exists() and (durable / "lease.json").exists()
    r = run_cli("train", *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"resumed_from=memory:\S+step-000000010 step=10 ", r.stderr), r.stderr[-3000:]
    first = CheckpointStore(str(durable)).latest_valid()
    assert first.step == 12 and sorted(scan(str(mem)))
    # The root deleted to start over (what the resume=false refusal suggests): the memory tier holds the
    # deleted run's snapshots, which must not come back.
    shutil.rmtree(durable)
    r = run_cli("train", *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed_from=none (fresh start) step=0 " in r.stderr, r.stderr[-3000:]
    assert "not resuming from it, its snapshots are not of the run in" in r.stderr, r.stderr[-3000:]
    runs = {json.loads(p.read_text())["meta"]["run"] for p in mem.glob("step-*/piece-r00000.json")}
    assert runs and first.manifest.run not in runs, "the deleted run's snapshots were cleared"


@pytest.mark.slow
def test_reached_advances_only_with_a_snapshot_stored(tmp_path):
    # As a full /dev/shm after step 1: every later snapshot fails. reached.json must not claim steps the
    # memory tier never held (it said 5 with only step 1 stored): the steps completed and the step stored are
    # two fields.
    args = tiny(tmp_path, "checkpoint.memory=true", f"checkpoint.memory_dir={tmp_path}/shm", max_steps=5)
    mem = Path(memory_root(f"{tmp_path}/shm", f"{tmp_path}/run/checkpoints"))
    mem.mkdir(parents=True)
    for step in range(2, 6):
        (mem / f"step-{step:09d}").write_text("not a directory")
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(scan(str(mem))) == [1]
    reached = json.loads((mem / "reached.json").read_text())
    assert reached["stored"] == 1 and reached["step"] >= 4  # step 5, the last, is the final durable save's
