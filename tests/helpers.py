"""Helpers for tests that drive real training processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import CheckpointStore


def start_cli(*args: str, env: dict[str, str], log_path: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start `python -m trainer ARGS` in its own process group, stderr+stdout to `log_path`: forked from
    the test server where run_cli would fork it (the handle then offers what the tests use of Popen:
    pid, poll, wait, send_signal, kill), else a fresh interpreter."""
    from conftest import fork_server

    server = fork_server(env, cwd)
    if server is not None:
        return server.start([str(a) for a in args], env, str(log_path), str(log_path), session=True)
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


def wait_until(
    condition: Callable[[], Any],
    what: str,
    timeout: float = 120,
    procs: Sequence[subprocess.Popen] = (),
    logs: Sequence[Path] = (),
    interval: float = 0.1,
) -> Any:
    """Poll `condition()` until it is truthy and return that value: tests wait for the event they need, never for
    time to pass (`timeout` is a hang bound only, generous for a loaded machine). A process of `procs` that exits
    first fails the wait at once, with the tail of its log (`logs`, in the same order, when given)."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        for i, proc in enumerate(procs):
            if proc.poll() is not None:
                log = logs[i] if i < len(logs) else None
                tail = f" ({log.name}):\n{log.read_text()[-3000:]}" if log is not None else ""
                raise AssertionError(f"process {proc.pid} exited {proc.returncode} before {what}{tail}")
        if time.monotonic() > deadline:
            tails = "\n".join(log.read_text()[-2000:] for log in logs)
            raise AssertionError(f"no {what} within {timeout}s" + (f":\n{tails}" if tails else ""))
        time.sleep(interval)


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


# ---------------------------------------------------------------- comparing tensors (the one set of helpers)


def assert_tensors_equal(a, b, what: str = "") -> None:
    """Bit-exact equality of two tensors or (nested) mappings of tensors: same keys, dtypes, shapes, values.

    Used wherever the math guarantees identity (a resumed run, a resharded checkpoint, the same
    random draws); the message names the first key that differs."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{what}: tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{what}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        )
        assert torch.equal(a, b), f"{what} differs (largest difference {(a.double() - b.double()).abs().max():.3g})"
        return
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        assert_tensors_equal(a[k], b[k], f"{what}:{k}" if what else str(k))


def assert_tensors_close(a: dict, b: dict, relative: float, what: str = "") -> None:
    """Equality within `relative` x the largest magnitude in `a`, for results float summation order may
    change (accumulation vs one batch, DDP vs FSDP): callers derive `relative` from the math."""
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    scale = max(float(t.abs().max()) for t in a.values())
    for k in a:
        diff = float((a[k] - b[k]).abs().max())
        assert diff <= relative * scale, f"{what}{k}: differs by {diff:.3g} (scale {scale:.3g})"


def assert_identical(a: dict, b: dict) -> None:
    """The model and EMA weights of two `checkpoint_weights` results are bit-identical."""
    assert_tensors_equal({k: a[k] for k in ("model", "ema")}, {k: b[k] for k in ("model", "ema")})


def tracker_settings(run_dir: Path) -> tuple[list[str], dict[str, str], list[str]]:
    """(config settings, environment, trackers) for a run reporting to every tracker installed: TensorBoard,
    W&B offline (its runs under run.dir/wandb) and MLflow's file store (run.dir/mlruns). The `test` extra
    installs all three."""
    import importlib.util

    trackers = [n for n in ("tensorboard", "wandb", "mlflow") if importlib.util.find_spec(n)]
    env = {
        "MLFLOW_TRACKING_URI": f"file://{run_dir}/mlruns",
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3 wants a database; its file store is what a test reads
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }
    return [f"log.report_to=[{','.join(trackers)}]"], env, trackers


def assert_trackers_continued(run_dir: Path, trackers: list[str], steps: list[int], val_steps: list[int]) -> None:
    """Read back what the trackers wrote over two starts (a run, then its resumed continuation): their files
    as the tools read them, one W&B run id and one MLflow run for both, with the metrics of both starts, and
    the previews. MLflow's file store is read back here: MLFLOW_ALLOW_FILE_STORE=true must be set."""
    import json

    last = json.loads((run_dir / "checkpoints" / f"step-{steps[-1]:09d}" / "trainer.json").read_text())
    ids = last["progress"]["trackers"]
    assert sorted(ids) == sorted(n for n in trackers if n != "tensorboard"), ids
    if "tensorboard" in trackers:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = list(run_dir.rglob("events.out.tfevents.*"))
        assert events, list(run_dir.rglob("*"))
        acc = EventAccumulator(str(events[0].parent))
        acc.Reload()
        assert sorted({e.step for e in acc.Scalars("unet/loss")}) == steps
        assert [e.step for e in acc.Scalars("val/loss")] == val_steps
        assert "samples" in acc.Tags()["images"]
    if "wandb" in trackers:  # one offline run directory per start, both with the checkpoint's id
        starts = sorted((run_dir / "wandb").glob("offline-run-*"))
        assert len(starts) == 2 and all(d.name.endswith("-" + ids["wandb"]) for d in starts), starts
        assert all(list(d.glob("files/media/images/samples_*.png")) for d in starts)
    if "mlflow" in trackers:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"file://{run_dir}/mlruns")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert [run.info.run_id for run in runs] == [ids["mlflow"]]
        assert sorted(m.step for m in client.get_metric_history(ids["mlflow"], "unet/loss")) == steps
        assert sorted(m.step for m in client.get_metric_history(ids["mlflow"], "val/loss")) == val_steps
        assert runs[0].data.params["train.max_steps"] == str(val_steps[0])  # params stay the first start's
        images = [a.path for a in client.list_artifacts(ids["mlflow"], "images")]
        assert any(f"samples+step+{steps[-1]}+" in p for p in images), images
