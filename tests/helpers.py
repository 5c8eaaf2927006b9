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


def wait_for_log(log_path: Path, text: str, proc: subprocess.Popen | None = None, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = log_path.read_text() if log_path.exists() else ""
        if text in content:
            return content
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited {proc.returncode} before logging {text!r}:\n{content[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not logged within {timeout}s:\n{log_path.read_text()[-3000:]}")


def parent_pids() -> dict[int, int]:
    """{pid: parent pid} of every live process (from /proc)."""
    parent_of = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent_of[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    return parent_of


def children(pid: int) -> list[int]:
    return sorted(c for c, parent in parent_pids().items() if parent == pid)


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (torchrun workers live in sessions of their own)."""
    parent_of = parent_pids()
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        out += kids
        frontier += kids
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process we started and everything below it, by the PIDs we find under it."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def kill_group(proc: subprocess.Popen) -> None:
    """Clean-up: kill the process we started and all its descendants, if still alive."""
    if proc.poll() is None:
        kill_tree(proc)


def final_weights(
    url: str, step: int | None = None, part: str = "unet", storage_options=None
) -> dict[str, dict[str, torch.Tensor]]:
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
