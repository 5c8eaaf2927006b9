"""Detection of a lost or silent node (trainer.elastic.StepWatchdog): a training step that hangs past
elastic.step_timeout_seconds exits 3, so torchrun's agent restarts the worker group; saves, evaluations and
compiles are never taken for a hang."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, clean_env, free_port, tiny
from elastic_helpers import start_launch
from helpers import descendants, kill_group, wait_for_log, wait_until

from trainer.elastic import EXIT_STEP_TIMEOUT, STEP_TIMEOUT_FACTOR, StepWatchdog
from trainer.engine.goodput import TimeLedger


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Phases:
    """What the training thread reports (TimeLedger.current()), set by the test."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.kind, self.entered = "startup", clock.now

    def enter(self, kind: str) -> None:
        self.kind, self.entered = kind, self.clock.now

    def current(self) -> tuple[str, float]:
        return self.kind, self.entered


def test_the_watchdog_trips_only_in_a_training_step_that_outlasts_the_timeout():
    clock = Clock()
    phases = Phases(clock)
    dog = StepWatchdog(phases, timeout_seconds=30.0, clock=clock)
    # Before the steady state (the first steps compile, count FLOPs): never, however long.
    phases.enter("train")
    clock.now += 1000
    assert dog.overdue() is None
    dog.on_step(0.5)  # a measured step: armed
    phases.enter("train")
    clock.now += 29.9
    assert dog.overdue() is None
    clock.now += 0.2
    assert dog.overdue() == pytest.approx(30.1)
    # A save, an evaluation or preview, a data wait, FLOP counting or calibration: never a hang.
    for kind in ("checkpoint_stall", "eval", "data_wait", "idle", "restore"):
        phases.enter(kind)
        clock.now += 500
        assert dog.overdue() is None, kind
    # A step trained again after a failure is a step.
    phases.enter("redone")
    clock.now += 31
    assert dog.overdue() == pytest.approx(31)
    # A compile inside a step (a recompile for a new shape): not while it runs, and the step's clock starts
    # again when it ends.
    phases.enter("train")
    dog.compile_started()
    clock.now += 300
    assert dog.overdue() is None
    dog.compile_ended()
    clock.now += 29
    assert dog.overdue() is None
    clock.now += 2
    assert dog.overdue() == pytest.approx(31)
    # Slow steps: the limit is STEP_TIMEOUT_FACTOR x the mean step when that is longer.
    for _ in range(9):
        dog.on_step(20.5)  # mean (0.5 + 9 * 20.5) / 10 = 18.5 s
    assert dog.timeout() == pytest.approx(STEP_TIMEOUT_FACTOR * 18.5)
    phases.enter("train")
    clock.now += STEP_TIMEOUT_FACTOR * 18.5 - 1
    assert dog.overdue() is None
    clock.now += 2
    assert dog.overdue() is not None
    # elastic.step_timeout_seconds=0: off.
    off = StepWatchdog(phases, timeout_seconds=0.0, clock=clock)
    off.on_step(0.1)
    clock.now += 10_000
    assert off.overdue() is None


def test_the_ledger_says_when_the_training_thread_entered_its_kind():
    ledger = TimeLedger(time.time())
    ledger.switch("train")
    kind, entered = ledger.current()
    assert kind == "train" and entered <= time.monotonic()
    ledger.take("checkpoint_stall", 0.0001)  # a fence's wait moved after the fact: still the same step
    assert ledger.current() == (kind, entered)
    ledger.switch("idle")
    assert ledger.current()[0] == "idle" and ledger.current()[1] >= entered


def test_outside_a_step_the_watchdog_trips_only_on_one_collective_call_that_outlasts_the_phase_timeout():
    clock = Clock()
    phases = Phases(clock)
    calls: list = [None]  # the main thread's collective call now (what _main_thread_collective returns)
    dog = StepWatchdog(phases, 25.0, clock=clock, wait_timeout_seconds=60.0, collective=lambda: calls[0])
    # Armed from the start (a resume's agreement comes before any step), in every kind but a step's.
    for kind in ("restore", "checkpoint_stall", "eval", "idle", "data_wait"):
        phases.enter(kind)
        clock.now += 500  # a long phase outside any collective: never a hang
        assert dog.waiting_too_long() is None, kind
        calls[0] = object()  # one collective call begins
        assert dog.waiting_too_long() is None
        clock.now += 59
        assert dog.waiting_too_long() is None
        clock.now += 2
        assert dog.waiting_too_long() == pytest.approx(61), kind
        calls[0] = object()  # many short calls in a row (a loop of all-reduces): each its own clock
        assert dog.waiting_too_long() is None
        clock.now += 30
        calls[0] = None
        assert dog.waiting_too_long() is None
    # In a step the step's own limit decides (the collective is the step's); a compile waits as long as it takes.
    phases.enter("train")
    calls[0] = object()
    dog.waiting_too_long()
    clock.now += 100
    assert dog.waiting_too_long() is None
    phases.enter("eval")
    dog.compile_started()
    assert dog.waiting_too_long() is None
    dog.compile_ended()
    assert dog.waiting_too_long() == pytest.approx(100)
    # elastic.phase_timeout_seconds=0: off.
    off = StepWatchdog(phases, 25.0, clock=clock, wait_timeout_seconds=0.0, collective=lambda: calls[0])
    off.waiting_too_long()
    clock.now += 10_000
    assert off.waiting_too_long() is None


# Two processes in one gloo group (a 600 s collective timeout). Both agree once (a save's gather), spend longer
# than the phase timeout outside any collective (an evaluation), then rank 1 stops itself (SIGSTOP: a node gone
# silent, its socket open) and rank 0 enters the next gather, which never returns.
PHASE_SCRIPT = """
import datetime, os, signal, sys, time
import torch.distributed as dist
from trainer.elastic import StepWatchdog, gather_objects
from trainer.engine.goodput import TimeLedger
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
ledger = TimeLedger(time.time())
dog = StepWatchdog(ledger, 25.0, step=lambda: 40, rank=rank, wait_timeout_seconds=1.0)
dog.start()
ledger.switch("checkpoint_stall")
gather_objects(rank)
ledger.switch("eval")
time.sleep(2.5)
print("evaluated", flush=True)
ledger.switch("checkpoint_stall")
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
gather_objects(rank)
print("gathered", flush=True)
"""


@pytest.mark.slow
def test_a_peer_silent_outside_a_step_is_noticed_within_the_phase_timeout(tmp_path):
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PHASE_SCRIPT, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    try:
        out, err = procs[0].communicate(timeout=240)  # a hang bound only: without the bound, 600 s
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert procs[0].returncode == EXIT_STEP_TIMEOUT, err
    assert "evaluated" in out and "gathered" not in out, out  # the long evaluation passed; the hung gather did not
    lines = [line for line in err.splitlines() if "step watchdog" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.search(
        r"\[rank 0\] step watchdog: one collective call outside a training step \(checkpoint_stall, step 40\) "
        r"has not returned after \d+\.\d s \(elastic.phase_timeout_seconds=1\)",
        lines[0],
    ), lines[0]


WATCHDOG_SCRIPT = """
import threading, time
from trainer.elastic import StepWatchdog
from trainer.engine.goodput import TimeLedger
ledger = TimeLedger(time.time())
dog = StepWatchdog(ledger, timeout_seconds=0.5, step=lambda: 7, rank=1)
dog.start()
dog.on_step(0.01)
ledger.switch("train")
threading.Event().wait()  # a collective whose peer is silent
"""


@pytest.mark.slow
def test_a_hung_step_exits_3_with_one_line_naming_the_step_and_the_wait():
    out = subprocess.run(
        [sys.executable, "-c", WATCHDOG_SCRIPT], capture_output=True, text=True, env=clean_env(), timeout=120, cwd=REPO
    )
    assert out.returncode == EXIT_STEP_TIMEOUT == 3, out.stderr
    lines = [line for line in out.stderr.splitlines() if "step watchdog" in line]
    assert len(lines) == 1, out.stderr
    assert re.search(r"\[rank 1\] step watchdog: the step from step 7 has not finished after \d+\.\d s", lines[0])
    assert "elastic.step_timeout_seconds=0.5" in lines[0] and "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_silent_node_is_noticed_and_the_survivor_restarts_without_it(tmp_path):
    """Two agents (c10d on 127.0.0.1); the second one's whole process tree is SIGSTOPped (a node gone silent:
    its sockets stay open, so no collective fails). The survivor's step watchdog exits 3 and its agent
    restarts at world size 1, long before elastic.collective_timeout_seconds (600 s) would have."""
    port = free_port()
    rdzv = [
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--max-restarts=3",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=detect-{port}",
        "--monitor-interval=0.2",
    ]
    # Agent a hosts the rendezvous store, said outright (is_host): both agents run on 127.0.0.1, where c10d
    # lets whichever binds the port first host it, and a store in the stopped agent would stop a too.
    conf = "--rdzv-conf=join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
    ckpt = tmp_path / "ckpts"
    args = [
        f"checkpoint.url={ckpt}",
        "checkpoint.every_steps=20",
        "train.log_every_steps=10",
        "elastic.collective_timeout_seconds=600",
        "elastic.step_timeout_seconds=5",
    ]
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = start_launch([*rdzv, f"{conf},is_host=true"], tiny(tmp_path / "a", *args, max_steps=100_000), log_a)
    b = start_launch([*rdzv, f"{conf},is_host=false"], tiny(tmp_path / "b", *args, max_steps=100_000), log_b)
    stopped: list[int] = []
    try:
        wait_for_log(log_a, "world_size=2 ", a, timeout=240)
        wait_until_checkpoint(ckpt, 40, [a, b])
        stopped = [b.pid, *descendants(b.pid)]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        text = wait_for_log(log_a, "world_size=1 restart=", a, timeout=240)  # a hang bound only
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        kill_group(a)
        kill_group(b)
    assert re.search(r"step watchdog: the step from step \d+ has not finished after [\d.]+ s", text), text[-4000:]
    assert re.search(r"exitcode\s*:\s*3\b", text), text[-4000:]  # the agent's record of the worker's failure
    assert re.search(r"world_size=1 restart=[1-9]\d* .*resumed_from=\S+step-0*(\d+)", text), text[-4000:]


def wait_until_checkpoint(root, step: int, procs, timeout: float = 240) -> None:
    """Until the durable checkpoint of `step` is committed (its manifest written); fail if an agent exits."""
    wait_until(lambda: list(root.glob(f"step-{step:09d}/manifest*.json")), f"checkpoint of step {step}", timeout, procs)


@pytest.mark.slow
def test_the_other_ranks_wait_for_rank_0s_synchronous_save_inside_the_save_not_a_step(tmp_path):
    """Under DDP rank 0 writes a checkpoint alone. Its write of step 4 takes 6 s here (a slow store:
    GENTRAIN_FAULT_SLOW_SAVE), far past elastic.step_timeout_seconds=1. Rank 1 waits for it inside the save,
    where the time is checkpoint stall and the step watchdog does not count it, so the job ends at step 8 with
    exit 0 (before, rank 1 went on into step 5 and waited in its all-reduce: a 'hung step', exit 3)."""
    from elastic_helpers import finish, standalone, start_torchrun

    args = tiny(
        tmp_path,
        "checkpoint.every_steps=4",
        "train.log_every_steps=1",
        "elastic.step_timeout_seconds=1",
        max_steps=8,
    )
    log = tmp_path / "torchrun.log"
    proc = start_torchrun(standalone(2), args, log, GENTRAIN_FAULT_SLOW_SAVE="4:6")
    assert finish(proc, log, timeout=600) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "slowing the save of step 4" in text and "step watchdog" not in text, text[-4000:]
