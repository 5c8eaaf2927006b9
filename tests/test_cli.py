"""The CLI end to end: the demo preset trains, checkpoints and samples."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli
from helpers import wait_until
from PIL import Image


@pytest.mark.slow
def test_demo_preset_runs_a_few_steps_end_to_end(tmp_path):
    run_dir = tmp_path / "demo"
    r = run_cli(
        "train",
        "train.max_steps=4",
        "train.log_every_steps=2",
        "checkpoint.every_steps=2",
        "sample.inference_steps=3",
        "sample.num=16",
        f"run.dir={run_dir}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "task=ddpm name=digits-ddpm" in r.stderr
    assert "step=4/4" in r.stderr
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "LATEST").read_text() == "step-000000004"
    manifest = json.loads((ckpts / "step-000000004" / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["world_size"] == 1
    assert manifest["config"]["name"] == "digits-ddpm"
    assert {"unet.model.safetensors", "unet.ema.safetensors", "unet.optimizer.safetensors", "trainer.json"} <= set(
        manifest["files"]
    )
    grid = Image.open(run_dir / "samples" / "step-000000004.png")
    assert grid.size[0] > 64

    out = tmp_path / "grid.png"
    r = run_cli("sample", str(ckpts), "--num", "9", "--out", str(out), "--steps", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 4" in r.stdout
    im = Image.open(out)
    # 3x3 grid of 16x16 images upscaled x4 with 1px padding.
    assert im.size == (3 * 65 + 1, 3 * 65 + 1)


@pytest.mark.slow
def test_sample_from_an_empty_root_fails_clearly(tmp_path):
    r = run_cli("sample", str(tmp_path), "--out", str(tmp_path / "x.png"))
    assert r.returncode == 1
    assert "no valid checkpoint" in r.stderr


@pytest.mark.slow
def test_a_run_forked_by_the_test_server_matches_a_fresh_interpreter(tmp_path):
    """tests/zygote.py stands in for `python -m trainer` in most CLI tests: same exit codes, same output."""
    import conftest
    from conftest import _zygote, clean_env

    server = _zygote()
    assert server is not None, f"the fork server did not start: {conftest._ZYGOTE_FAILED}"

    runs = [
        ["presets"],
        ["train", "digits-ddpm", "train.no_such_key=1", f"run.dir={tmp_path}"],
        ["checkpoints", "verify", str(tmp_path / "none")],
    ]
    for args in runs:
        forked = server.run(args, clean_env(), timeout=300)
        fresh = subprocess.run(
            [sys.executable, "-m", "trainer", *args], capture_output=True, text=True, env=clean_env(), timeout=300
        )
        assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), args
        assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], args
    assert [r.returncode for r in (server.run(a, clean_env(), timeout=300) for a in runs)] == [0, 2, 1]


@pytest.mark.slow
def test_the_suite_cpu_profile_counts_each_forked_run_for_the_test_that_started_it(tmp_path, monkeypatch):
    """GENTRAIN_TEST_CPU_LOG (docs/development.md): a fork server started with it logs every run's CPU seconds
    under the test that asked for it, and scripts/suite_cpu.py sums them for that test's file."""
    from conftest import _Zygote, clean_env

    log = tmp_path / "cpu.jsonl"
    monkeypatch.setenv("GENTRAIN_TEST_CPU_LOG", str(log))
    server = _Zygote()
    try:
        assert [server.run(["presets"], clean_env(), timeout=300).returncode for _ in range(2)] == [0, 0]
    finally:
        server.close()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 2 and all(r["kind"] == "fork" and r["args"] == ["presets"] for r in records), records
    assert all(
        r["test"].startswith(
            f"tests/test_cli.py::{test_the_suite_cpu_profile_counts_each_forked_run_for_the_test_that_started_it.__name__}"
        )
        for r in records
    )
    assert all(r["cpu"] > 0 for r in records)  # a run's own CPU time, from the monitor's wait4
    report = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "suite_cpu.py"), str(log)], capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"^test_cli\.py +\d+ +\d+ +0 +0 +2 +0$", report, re.M), report


RANK_SCRIPT = """\
import os, signal, sys, time
print(f"rank {os.environ['RANK']} pid {os.getpid()} in {os.getcwd()} argv {sys.argv[1:]}", flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
while True:  # until a signal ends it
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_a_rank_forked_through_the_worker_client_gets_its_streams_and_ends_as_it_would_unforked(tmp_path):
    """tests/zygote_worker.py stands in for the process torchrun starts per rank: the rank writes to the
    client's stdout and stderr and sees its environment, argv and working directory; the client exits with
    the rank's code, dies of the signal the rank died of (forwarded to it), and a SIGKILLed client's rank
    is killed with it."""
    import conftest
    from conftest import REPO, _zygote, clean_env
    from zygote_worker import ZYGOTE

    server = _zygote()
    assert server is not None, f"the fork server did not start: {conftest._ZYGOTE_FAILED}"
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = clean_env(RANK="1", **{ZYGOTE: server.socket})
    client = [sys.executable, str(REPO / "tests" / "zygote_worker.py"), str(script)]

    done = subprocess.run([*client, "exit", "3"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 3, done.stderr
    assert re.fullmatch(rf"rank 1 pid \d+ in {re.escape(str(tmp_path))} argv \['exit', '3'\]\n", done.stdout), (
        done.stdout
    )
    assert done.stderr == "to stderr\n"

    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen([*client, "wait"], stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        try:
            rank_pid = int(re.search(r"pid (\d+)", proc.stdout.readline()).group(1))
            assert rank_pid != proc.pid
            os.kill(proc.pid, sig)  # SIGTERM: forwarded to the rank; SIGKILL: the client alone, at once
            assert proc.wait(timeout=60) == -sig
            gone = lambda pid=rank_pid: not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"  # noqa: E731
            wait_until(gone, f"rank {rank_pid}'s end after its client's {sig!r}", 60, interval=0.02)
        finally:
            proc.kill()
            proc.wait()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
