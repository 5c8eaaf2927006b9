"""Shared test helpers: a tiny config, a CLI runner with a hard timeout, free ports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """In-process tests use one intra-op thread: their models are tiny, and two OpenMP threads on a
    loaded 2-core machine spin-wait on each other (tiny steps then run 50x slower)."""
    import torch

    torch.set_num_threads(1)


# A model small enough that a step takes milliseconds on one CPU core.
TINY = [
    "model.block_out_channels=[8,16]",
    "model.norm_num_groups=4",
    "model.attention=false",
    "data.image_size=8",
    "train.batch_size=8",
    "train.warmup_steps=2",
    "train.log_every_steps=1",
    "train.val_every_steps=0",
    "train.threads=1",
    "sample.every_steps=0",
    "sample.num=4",
    "sample.inference_steps=2",
]


def tiny(tmp_path: Path, *extra: str, max_steps: int = 6) -> list[str]:
    return [*TINY, f"run.dir={tmp_path}/run", f"train.max_steps={max_steps}", *extra]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GENTRAIN_", "PROMETHEUS_", "TORCHELASTIC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def run_cli(
    *args: str, timeout: float = 900, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` in a fresh process; killed if it outlives `timeout` (a hang bound only:
    loaded or slow machines run these several times slower than a quiet one)."""
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
        cwd=cwd or REPO,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def tiny_args(tmp_path):
    def make(*extra: str, max_steps: int = 6) -> list[str]:
        return tiny(tmp_path, *extra, max_steps=max_steps)

    return make


@pytest.fixture(scope="session")
def s3_server():
    from servers import S3_CREDENTIALS, S3Server

    os.environ.update(S3_CREDENTIALS)
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_server():
    from servers import GCSServer

    server = GCSServer().start()
    yield server
    server.stop()


@pytest.fixture(params=["local", "memory", "s3", "gcs"])
def store_url(request, tmp_path):
    """(url, storage_options) of an empty checkpoint root on each kind of store."""
    import uuid

    kind = request.param
    if kind == "local":
        return str(tmp_path / "ckpts"), {}
    if kind == "memory":
        return f"memory://gentrain-{uuid.uuid4().hex[:8]}/ckpts", {}
    server = request.getfixturevalue(f"{kind}_server")
    bucket = server.make_bucket()
    scheme = "s3" if kind == "s3" else "gs"
    return f"{scheme}://{bucket}/run/ckpts", server.storage_options()
