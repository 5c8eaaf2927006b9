"""Checkpoints end to end through the CLI on real S3 and GCS protocol servers: resume, list, verify, outages."""

from __future__ import annotations

import json
import re
import signal

import pytest
from conftest import clean_env, run_cli, tiny
from helpers import kill_group, start_cli, wait_for_log, wait_until
from servers import S3Server

from trainer.checkpoint import CheckpointStore


@pytest.fixture(params=["s3", "gcs"])
def remote(request):
    server = request.getfixturevalue(f"{request.param}_server")
    bucket = server.make_bucket()
    scheme = "s3" if request.param == "s3" else "gs"
    return f"{scheme}://{bucket}/runs/demo", server.storage_options()


@pytest.mark.slow
def test_train_resume_list_verify_and_sample_on_object_storage(tmp_path, remote):
    url, so = remote
    so_arg = f"checkpoint.storage_options={json.dumps(so)}"
    extra = [
        "log.upload_run_dir=true",
        f"checkpoint.url={url}",
        so_arg,
        "checkpoint.every_steps=2",
        "checkpoint.keep=2",
    ]
    args = tiny(tmp_path, *extra)

    r = run_cli("train", *args[:-1], "train.max_steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("train", *args[:-1], "train.max_steps=6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed_from={url}/step-000000004 step=4 cursor=32" in r.stderr

    listing = run_cli("checkpoints", "list", url, "--storage-options", json.dumps(so))
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["4", "6"]  # keep=2 pruned step 2
    assert all("valid" in row for row in rows) and "(LATEST)" in listing.stdout.splitlines()[-1]
    # log.upload_run_dir: run.dir beside the checkpoints (the listing above did not take it for one).
    uploaded = CheckpointStore(url, so)
    grids = uploaded.fs.ls(f"{uploaded.root}/run/samples", detail=False)
    assert any(g.endswith("step-000000006.png") for g in grids), grids

    ok = run_cli("checkpoints", "verify", f"{url}/step-000000006", "--storage-options", json.dumps(so))
    assert ok.returncode == 0 and "blake3 checked" in ok.stdout, ok.stdout + ok.stderr

    out = tmp_path / "grid.png"
    r = run_cli("sample", url, "--num", "4", "--steps", "2", "--out", str(out), "--storage-options", json.dumps(so))
    assert r.returncode == 0 and out.exists(), r.stderr[-2000:]

    # Tamper with one payload file (same size): verify names it and exits 1.
    store = CheckpointStore(url, so)
    path = f"{store.root}/step-000000006/unet.model.safetensors"
    data = bytearray(store.fs.cat_file(path))
    data[-1] ^= 0x01
    store.fs.pipe_file(path, bytes(data))
    bad = run_cli("checkpoints", "verify", f"{url}/step-000000006", "--storage-options", json.dumps(so))
    assert bad.returncode == 1
    assert "unet.model.safetensors" in bad.stdout and "blake3" in bad.stdout

    # Training falls back to the previous checkpoint when the newest fails its digest.
    r = run_cli("train", *args[:-1], "train.max_steps=8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cannot be loaded" in r.stderr and f"resumed_from={url}/step-000000004" in r.stderr


@pytest.mark.slow
def test_verify_a_missing_or_partial_checkpoint_exits_1(tmp_path):
    r = run_cli("checkpoints", "verify", str(tmp_path / "nothing"))
    assert r.returncode == 1 and "no valid checkpoint" in r.stdout
    store = CheckpointStore(str(tmp_path))
    store.write(5, {"a.json": b"{}"}, {})
    (tmp_path / "step-000000005" / "a.json").write_text("{} ")  # one byte longer
    r = run_cli("checkpoints", "verify", str(tmp_path / "step-000000005"))
    assert r.returncode == 1 and "a.json has 3 bytes, manifest says 2" in r.stdout


@pytest.mark.slow
def test_storage_outage_during_async_saves_is_counted_and_training_continues(tmp_path):
    from servers import S3_CREDENTIALS

    server = S3Server().start()
    try:
        bucket = server.make_bucket()
        url = f"s3://{bucket}/run"
        args = tiny(
            tmp_path,
            f"checkpoint.url={url}",
            f"checkpoint.storage_options={json.dumps(server.storage_options())}",
            "checkpoint.async=true",
            "checkpoint.every_steps=5",
            # The in-memory store comes back empty, its lease file gone: to the holder that reads as taken over
            # (another trainer may have taken and released it), so it would stop. This test is about saves
            # failing and resuming; tests/test_ownership.py holds the lease through outages and takeovers.
            "checkpoint.lease=false",
            "train.log_every_steps=5",
            max_steps=1_000_000,
        )
        log = tmp_path / "train.log"
        proc = start_cli("train", *args, env=clean_env(**S3_CREDENTIALS), log_path=log)
        try:
            wait_for_log(log, f"checkpoint committed {url}/step-000000010", proc)
            server.stop()  # outage: saves fail in the background
            text = wait_for_log(log, "checkpoint save failed (1 so far", proc, timeout=300)
            failed_at = int(re.findall(r"step=(\d+)/", text)[-1])
            # Training goes on while the store is down.
            wait_for_log(log, f"step={failed_at + 10}/", proc, timeout=300)
            server.start()  # back, but empty (in-memory server): recreate the bucket
            import boto3

            boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1", **_boto_creds()).create_bucket(
                Bucket=bucket
            )
            before = log.read_text().count("checkpoint committed")
            committed = lambda: log.read_text().count("checkpoint committed") > before  # noqa: E731
            wait_until(committed, "a checkpoint committed after the bucket came back", 120, [proc], [log])
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 143
        finally:
            kill_group(proc)
        text = log.read_text()
        assert "Traceback" not in text
        latest = CheckpointStore(url, server.storage_options()).latest_valid()
        assert latest is not None and latest.step > failed_at
    finally:
        server.stop()


def _boto_creds() -> dict:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
