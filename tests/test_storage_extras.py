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


_GCS_CLASS = """
import os, sys
if sys.argv[1] == "imported":
    import gcsfs  # gs:// already bound to gcsfs's default class
from trainer.storage import filesystem
fs, _ = filesystem("gs://bucket/run", {"endpoint_url": "http://127.0.0.1:9", "token": "anon"})
print(type(fs).__name__, os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setting", "first", "want"),
    [
        (None, "fresh", "GCSFileSystem false"),
        (None, "imported", "GCSFileSystem None"),
        ("true", "fresh", "ExtendedGcsFileSystem true"),  # the user's own setting is kept
    ],
)
def test_a_gcs_store_with_a_custom_endpoint_gets_gcsfs_plain_class_unless_the_user_chose(setting, first, want):
    """gcsfs's ExtendedGcsFileSystem (its default) asks Google's Storage Control API about each bucket and
    waits ~60 s per call on an emulator or a private endpoint; only the tests set the variable before."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "STORAGE_EMULATOR_HOST")
    }
    if setting is not None:
        env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = setting
    r = subprocess.run(
        [sys.executable, "-c", _GCS_CLASS, first], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[-2] == want, r.stdout + r.stderr[-2000:]
