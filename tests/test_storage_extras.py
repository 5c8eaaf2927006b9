"""A store whose fsspec package is missing is a setup mistake: exit 2 naming the extra, never a traceback.

The packages are made unimportable for real: a directory first on PYTHONPATH holds `s3fs`/`gcsfs`
packages whose import raises ImportError, so fsspec's own lookup fails exactly as on a machine
without them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def env_without_buckets(tmp_path_factory) -> dict[str, str]:
    shadow = tmp_path_factory.mktemp("shadow")
    for name in ("s3fs", "gcsfs"):
        (shadow / name).mkdir()
        (shadow / name / "__init__.py").write_text(
            f'raise ImportError("No module named {name} (hidden by the test)")\n'
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env.get("PYTHONPATH", "")])
    return env


def gentrain(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (["checkpoints", "list", "s3://bucket/run"], "s3"),
        (["sample", "gs://bucket/run", "--num", "1"], "gcs"),
        (["train", "digits-ddpm", "checkpoint.url=s3://bucket/run", "train.max_steps=1"], "s3"),
        (
            [
                "train",
                "digits-ddpm",
                "data.source=shards",
                "data.urls=gs://bucket/{000000..000001}.tar",
                "train.max_steps=1",
            ],
            "gcs",
        ),
    ],
)
def test_a_missing_store_package_exits_2_naming_the_extra(env_without_buckets, tmp_path, args, extra):
    r = gentrain(env_without_buckets, tmp_path, *args, *([f"run.dir={tmp_path}/run"] if args[0] == "train" else []))
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"gentrain[{extra}]" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().count("\n") < 3, r.stderr  # a line, not a log of a failed run
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing started
