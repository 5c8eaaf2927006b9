"""Helpers for tests that drive real training processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from trainer.checkpoint import CheckpointStore


def start_cli(*args: str, env: dict[str, str], log_path: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start `python -m trainer ARGS` in its own process group, stderr+stdout to `log_path`."""
    f = open(log_path, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", *args],
        stdout=f,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )


def wait_for_log(log_path: Path, text: str, proc: subprocess.Popen | None = None, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = log_path.read_text() if log_path.exists() else ""
        if text in content:
            return content
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited {proc.returncode} before logging {text!r}:\n{content[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not logged within {timeout}s:\n{log_path.read_text()[-3000:]}")


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the process group we started (by the PID we hold), if still alive."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def final_weights(url: str, step: int | None = None, part: str = "unet", storage_options=None) -> dict[str, dict[str, torch.Tensor]]:
    store = CheckpointStore(url, storage_options)
    info = store.check(step) if step is not None else store.latest_valid()
    assert info is not None and info.valid, f"no valid checkpoint in {url}"
    return {
        "model": store.read_tensors(info, f"{part}.model.safetensors"),
        "ema": store.read_tensors(info, f"{part}.ema.safetensors"),
        "step": info.step,
    }


def assert_identical(a: dict, b: dict) -> None:
    for kind in ("model", "ema"):
        assert a[kind].keys() == b[kind].keys()
        for k in a[kind]:
            assert torch.equal(a[kind][k], b[kind][k]), f"{kind} tensor {k} differs"
