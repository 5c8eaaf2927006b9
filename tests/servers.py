"""Real storage protocol servers on 127.0.0.1 for tests: moto (S3) and gcp-storage-emulator (GCS)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

from conftest import free_port

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class Server:
    """A server process we started, killed by its own PID (and group) on stop."""

    def __init__(self, argv: list[str], port: int, ready_path: str = "/"):
        self.argv = argv
        self.port = port
        self.ready_path = ready_path
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> Server:
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[:3]} exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.endpoint + self.ready_path, timeout=1)
                return self
            except OSError as e:
                if getattr(e, "code", None):  # any HTTP answer means it is up
                    return self
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.argv[:3]} did not answer on {self.endpoint} within {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        self.proc = None


class S3Server(Server):
    def __init__(self, port: int | None = None):
        port = port or free_port()
        super().__init__([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port)

    def make_bucket(self) -> str:
        import boto3

        name = f"gentrain-{uuid.uuid4().hex[:10]}"
        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=name)
        return name

    def storage_options(self) -> dict:
        # Fail fast when the server is down: the default retries take minutes.
        return {
            "client_kwargs": {"endpoint_url": self.endpoint},
            "config_kwargs": {"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 2}},
        }


class GCSServer(Server):
    def __init__(self, port: int | None = None):
        port = port or free_port()
        super().__init__(
            [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
            port,
        )

    def make_bucket(self) -> str:
        import gcsfs

        name = f"gentrain-{uuid.uuid4().hex[:10]}"
        gcsfs.GCSFileSystem(**self.storage_options()).mkdir(name)
        return name

    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "token": "anon"}
