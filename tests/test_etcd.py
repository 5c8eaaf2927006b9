"""torchrun's etcd-v2 rendezvous through `gentrain launch`: a real etcd on 127.0.0.1, two agents, and the
first agent lost (with c10d that one hosts the rendezvous store, and the job stops with it)."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import sys
from collections import defaultdict

import pytest
from conftest import free_port, tiny
from elastic_helpers import start_launch
from helpers import final_weights, kill_group, kill_tree, wait_until

from trainer.checkpoint.memory import memory_root
from trainer.cli import main as cli_main


@pytest.mark.parametrize("backend", ["etcd-v2", "etcd"])
def test_launch_with_an_etcd_rendezvous_and_no_python_etcd_exits_2_naming_the_extra(
    backend, monkeypatch, capsys, tmp_path
):
    monkeypatch.setitem(sys.modules, "etcd", None)  # as where python-etcd is not installed
    argv = ["launch", "--nnodes=1:2", f"--rdzv-backend={backend}", "--rdzv-endpoint=127.0.0.1:2379", "--"]
    assert cli_main([*argv, "digits-ddpm", f"run.dir={tmp_path}", "train.max_steps=1"]) == 2
    err = capsys.readouterr().err
    assert f"--rdzv-backend={backend} needs python-etcd" in err and "pip install 'gentrain[etcd]'" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()


@pytest.fixture
def etcd_server(tmp_path):
    """etcd with the v2 API on free ports of 127.0.0.1, data in tmp_path; killed by its PID afterwards."""
    from servers import EtcdServer

    missing = []
    if shutil.which("etcd") is None:
        missing.append("the etcd binary (Debian's etcd-server)")
    if importlib.util.find_spec("etcd") is None:
        missing.append("python-etcd (the test extra)")
    if missing:
        # CI runs scripts/test.sh, which installs both: there a missing one is a broken set-up, not a skip.
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(
            f"needs {' and '.join(missing)}: run scripts/test.sh"
        )
    server = EtcdServer(tmp_path).start()
    yield server
    server.stop()


@pytest.mark.slow
def test_the_first_agent_is_lost_and_the_second_resumes_from_the_memory_tier_at_world_size_1(etcd_server, tmp_path):
    steps = 300
    rdzv = [
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--max-restarts=3",
        "--rdzv-backend=etcd-v2",
        f"--rdzv-endpoint=127.0.0.1:{etcd_server.port}",
        f"--rdzv-id=etcd-{free_port()}",
        # A lost node leaves the rendezvous once it missed 3 heartbeats a second apart (default: 3 x 5 s).
        "--rdzv-conf=join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
        "--monitor-interval=0.2",
    ]
    # Both "nodes" write to one shared checkpoint root, as pods do with a bucket, and each keeps the memory
    # tier in a folder of its own, as each pod has its own /dev/shm. The durable tier is written only at
    # the end: the survivor can only resume from the memory tier, where it holds the lost node's FSDP
    # shards as that node's buddy.
    ckpt = tmp_path / "shared-ckpts"
    args = [
        f"checkpoint.url={ckpt}",
        "checkpoint.every_steps=0",
        "checkpoint.memory=true",
        "train.parallel=fsdp",
        "train.log_every_steps=5",
        "elastic.collective_timeout_seconds=120",  # a hang bound only: lost peers fail at once
        "data.ledger=true",
    ]
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    shm = {node: tmp_path / f"shm-{node}" for node in "ab"}
    a = start_launch(
        rdzv, tiny(tmp_path / "a", *args, max_steps=steps), log_a, GENTRAIN_CHECKPOINT__MEMORY_DIR=str(shm["a"])
    )
    b = start_launch(
        rdzv, tiny(tmp_path / "b", *args, max_steps=steps), log_b, GENTRAIN_CHECKPOINT__MEMORY_DIR=str(shm["b"])
    )
    agents, logs = [a, b], [log_a, log_b]
    b_step_20 = memory_root(str(shm["b"]), str(ckpt)) + "/step-000000020"
    try:
        wait_until(lambda: "world_size=2 " in log_a.read_text() + log_b.read_text(), "world_size=2", 120, agents, logs)
        wait_until(
            lambda: len(glob.glob(f"{b_step_20}/piece-r*.json")) == 2, "both pieces of step 20 on b", 120, agents, logs
        )
        kill_tree(a)  # the first node disappears, agent and worker at once, and its shared memory with it
        shutil.rmtree(shm["a"])
        rc = b.wait(timeout=180)
    finally:
        kill_group(a)
        kill_group(b)
    text = log_b.read_text()
    assert rc == 0, text[-4000:]
    resumed = re.search(
        r"world_size=1 restart=(\d+) .*train_samples=(\d+) resumed_from=memory:\S+step-(\d+) step=\d+ steps_lost=", text
    )
    assert resumed, text[-4000:]
    restart, n, resumed_step = (int(g) for g in resumed.groups())
    assert resumed_step >= 20 and "resuming a 2-rank checkpoint on 1 ranks" in text
    assert final_weights(str(ckpt))["step"] == steps
    assert_every_sample_once_per_epoch(tmp_path, steps, n, resumed_step, restart)


def assert_every_sample_once_per_epoch(tmp_path, steps: int, n: int, resumed_step: int, restart: int) -> None:
    """The steps that count: both nodes' up to the memory-tier step resumed from, then the survivor's
    from the attempt that resumed (the lost steps in between were trained again). In step and rank
    order they use every sample once per epoch across the change from 2 ranks to 1."""
    per_step: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for f in tmp_path.glob("*/run/ledger/rank-*.jsonl"):
        lines = f.read_text().splitlines()
        for i, line in enumerate(lines):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # only the lost node's last line can be cut short by its kill
                assert i == len(lines) - 1 and f.parts[-4] == "a", f"{f}: {line!r}"
                continue
            attempt = int(rec["attempt"].split("-")[0])
            if (attempt == 0 and rec["step"] <= resumed_step) or (attempt == restart and rec["step"] > resumed_step):
                per_step[rec["step"]][rec["rank"]] = rec["indices"]
    assert sorted(per_step) == list(range(1, steps + 1))
    assert all(len(per_step[s]) == (2 if s <= resumed_step else 1) for s in per_step)
    stream = [i for s in sorted(per_step) for r in sorted(per_step[s]) for i in per_step[s][r]]
    epochs = [stream[e * n : (e + 1) * n] for e in range(len(stream) // n)]
    assert epochs, "the run must cross an epoch boundary for the check to mean anything"
    for e, used in enumerate(epochs):
        assert len(set(used)) == n and set(used) == set(epochs[0]), f"epoch {e}"
    tail = stream[len(epochs) * n :]
    assert len(set(tail)) == len(tail) and set(tail) <= set(epochs[0])
