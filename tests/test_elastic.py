"""Elastic training with real torchrun processes on 127.0.0.1: kills, node loss, SIGTERM, world-size changes."""

from __future__ import annotations

import json
import os
import re
import signal
from collections import defaultdict

import numpy as np
import pytest
import torch
from conftest import run_cli, tiny
from elastic_helpers import finish, rank_of, standalone, start_launch, start_torchrun, worker_pids
from helpers import assert_identical, final_weights, kill_group, wait_for_log
from PIL import Image

from trainer.checkpoint import CheckpointStore
from trainer.config import ConfigError
from trainer.loop import check_batch_split

pytestmark = pytest.mark.slow


def test_sigkilled_worker_is_restarted_and_the_result_equals_an_uninterrupted_run(tmp_path):
    steps = 120
    # Dropout draws from the global RNG: resume must reproduce those draws too.
    args = ["checkpoint.every_steps=10", "train.log_every_steps=5", "model.dropout=0.1"]
    # The killed run's ranks are fresh interpreters, as torchrun starts them in a pod (fork=False); the suite's
    # other torchrun tests fork theirs from the test fork server (tests/zygote_worker.py), this one keeps the
    # unforked path under a SIGKILL and a restart. The uninterrupted run forks: the weights compared below are
    # also a fork's against a fresh interpreter's.
    ref_log = tmp_path / "ref.log"
    ref = start_torchrun(standalone(2, max_restarts=3), tiny(tmp_path / "ref", *args, max_steps=steps), ref_log)
    assert finish(ref, ref_log) == 0, ref_log.read_text()[-4000:]

    log = tmp_path / "killed.log"
    # `accelerate launch` settings gentrain ignores (tests/test_accelerate_env.py): before they were passed
    # explicitly, this one autocast every DDP forward in bf16 and the weights below differed.
    launch_env = {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "3"}
    proc = start_torchrun(
        standalone(2, max_restarts=3), tiny(tmp_path / "killed", *args, max_steps=steps), log, fork=False, **launch_env
    )
    try:
        wait_for_log(log, "step-000000030", proc, timeout=300)
        victims = [p for p in worker_pids(proc.pid) if rank_of(p) == 1]
        assert victims, "no rank-1 worker found"
        os.kill(victims[0], signal.SIGKILL)
        rc = finish(proc, log)
    finally:
        kill_group(proc)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert "ACCELERATE_MIXED_PRECISION=bf16 is ignored" in text
    # Exactly one restart: stale rendezvous keys from the killed attempt used to make the
    # first restart fail too (see trainer.elastic.init_process_group).
    resumed = re.search(r"world_size=2 restart=1 .*resumed_from=\S+step-(\d+)", text)
    assert resumed and int(resumed.group(1)) >= 30
    assert_identical(
        final_weights(f"{tmp_path}/ref/run/checkpoints", steps),
        final_weights(f"{tmp_path}/killed/run/checkpoints", steps),
    )
    # Every rank's global RNG state at the final step is the uninterrupted run's too.
    for rank in (0, 1):
        name = f"rank-{rank:05d}.safetensors"
        a = CheckpointStore(f"{tmp_path}/ref/run/checkpoints")
        b = CheckpointStore(f"{tmp_path}/killed/run/checkpoints")
        ta, tb = a.read_tensors(a.check(steps), name), b.read_tensors(b.check(steps), name)
        assert torch.equal(ta["torch_cpu"], tb["torch_cpu"]), f"{name} differs"


def test_sigterm_to_torchrun_writes_an_emergency_checkpoint_at_the_step_reached(tmp_path):
    log = tmp_path / "term.log"
    args = tiny(tmp_path, "checkpoint.every_steps=0", "train.log_every_steps=1", max_steps=100000)
    proc = start_torchrun(standalone(2, max_restarts=0), args, log)
    try:
        wait_for_log(log, "step=40/", proc, timeout=300)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        kill_group(proc)
    text = log.read_text()
    steps = [int(s) for s in re.findall(r"step=(\d+)/100000", text)]
    assert "emergency checkpoint written at step" in text, text[-4000:]
    info = final_weights(f"{tmp_path}/run/checkpoints")
    assert info["step"] == max(steps)  # exactly the last completed step
    assert f"emergency checkpoint written at step {max(steps)}; exiting 143" in text
    # torchrun itself re-raises the signal as SignalException (exit 1); Kubernetes
    # classifies the pod by its DisruptionTarget condition, not by this code.
    assert proc.returncode != 0


def make_images(root, n: int) -> None:
    rng = np.random.default_rng(1)
    root.mkdir(parents=True)
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(root / f"{i:03d}.png")


def test_world_size_changes_use_every_sample_once_per_epoch(tmp_path):
    n, batch = 30, 6
    data = tmp_path / "imgs"
    make_images(data, n)
    base = tiny(
        tmp_path,
        "data.source=folder",
        f"data.path={data}",
        "data.channels=1",
        "data.val_fraction=0",
        "data.ledger=true",
        f"train.batch_size={batch}",
        "checkpoint.every_steps=0",
    )
    plan = [(2, 7), (1, 16), (3, 27)]  # world size, run until step
    previous = 0
    for i, (world, until) in enumerate(plan):
        log = tmp_path / f"leg{i}.log"
        proc = start_torchrun(standalone(world, max_restarts=0), [*base, f"train.max_steps={until}"], log)
        assert finish(proc, log) == 0, log.read_text()[-4000:]
        text = log.read_text()
        assert f"world_size={world} restart=0" in text
        if previous:
            assert f"step-{previous:09d}" in text and f"step={previous} cursor={previous * batch}" in text
        previous = until

    per_step: dict[int, dict[int, list[int]]] = defaultdict(dict)
    for f in (tmp_path / "run" / "ledger").glob("rank-*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_step[rec["step"]][rec["rank"]] = rec["indices"]
    assert sorted(per_step) == list(range(1, 28))
    stream = [i for s in sorted(per_step) for r in sorted(per_step[s]) for i in per_step[s][r]]
    assert len(stream) == 27 * batch
    for epoch in range(len(stream) // n):
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == list(range(n)), f"epoch {epoch}"
    tail = stream[(len(stream) // n) * n :]
    assert len(set(tail)) == len(tail)


def test_a_batch_the_world_size_cannot_split_is_a_clear_error():
    assert check_batch_split(12, 3, 2) == 2
    with pytest.raises(ConfigError) as e:
        check_batch_split(6, 4, 1)
    msg = str(e.value)
    assert "train.batch_size=6" in msg and "world size 4" in msg and "[1, 2, 3, 6]" in msg


# ---------------------------------------------------------------- gentrain launch (the container entrypoint)


def launch(tmp_path, *args: str, timeout: float = 180):
    return run_cli("launch", *args, timeout=timeout)


def test_launch_exits_2_on_a_config_error_before_starting_workers(tmp_path):
    r = launch(tmp_path, "--nproc-per-node=2", "--", "train.lrr=1")
    assert r.returncode == 2
    assert "unknown config key 'train.lrr'" in r.stderr
    assert "rank" not in r.stderr  # no worker was started


def test_launch_exits_2_when_workers_find_the_world_size_cannot_split_the_batch(tmp_path):
    r = launch(tmp_path, *standalone(3, max_restarts=0), "--", *tiny(tmp_path, max_steps=2))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "cannot be split evenly over world size 3" in r.stderr


def test_launch_trains_and_exits_0_then_143_on_sigterm(tmp_path):
    r = launch(tmp_path, *standalone(2, max_restarts=3), "--", *tiny(tmp_path / "ok", max_steps=3))
    assert r.returncode == 0, r.stderr[-3000:]

    log = tmp_path / "term.log"
    train = tiny(tmp_path / "term", "checkpoint.every_steps=0", max_steps=100000)
    proc = start_launch(standalone(2, max_restarts=3), train, log)
    try:
        wait_for_log(log, "step=10/", proc, timeout=300)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, log.read_text()[-3000:]
    finally:
        kill_group(proc)
    assert "emergency checkpoint written" in log.read_text()
