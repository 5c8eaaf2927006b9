"""SIGTERM while an async checkpoint save is still in flight: exit 143 within elastic.grace_seconds.

The save is held in flight by the store: the trainer talks to a real S3 server (moto on 127.0.0.1)
through a small proxy that passes reads but, once told to, answers no write (PUT, POST, DELETE),
as a stalled object store does. Resume (reads only) works; the next save's first upload blocks,
and the proxy says so (an event, not a guess of time). The trainer then gets SIGTERM and must exit
143 within the grace period, keeping the newest valid checkpoint: the in-flight one cannot commit,
so the previous one. After the exit the proxy lets the stalled writes through, like a store that
recovers once the process is gone: they leave files without a manifest, which nothing may count
as a checkpoint.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import clean_env, run_cli, tiny
from elastic_helpers import standalone
from helpers import kill_group, wait_for_log
from servers import S3_CREDENTIALS, S3Server

pytestmark = pytest.mark.slow

GRACE_SECONDS = 3
# The stalled upload never ends on its own (the proxy holds it until the test releases it), so an exit
# 143 at all, with the log line naming the cut-short wait, is the proof that the grace period cut it.
# The margin only bounds the interpreter's exit and the launcher's bookkeeping, generously: a loaded CI
# machine must not fail the test for being slow.
EXIT_MARGIN_SECONDS = 30
_WRITES = ("PUT", "POST", "DELETE")


class WriteStallingProxy(ThreadingHTTPServer):
    """HTTP proxy on 127.0.0.1 in front of an S3 server; while `stall` is set, writes wait unanswered."""

    daemon_threads = True

    def __init__(self, upstream_port: int):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream_port = upstream_port
        self.stall = threading.Event()
        self.stalled = threading.Event()  # a write is waiting now
        self.released = threading.Event()
        self._pending = 0
        self._idle = threading.Condition()
        threading.Thread(target=self.serve_forever, name="s3-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def release(self, timeout: float = 60) -> None:
        """Let the stalled writes through to the store and wait until the store has taken them."""
        self.released.set()
        with self._idle:
            assert self._idle.wait_for(lambda: self._pending == 0, timeout), "stalled writes did not finish"

    def track(self, delta: int) -> None:
        with self._idle:
            self._pending += delta
            self._idle.notify_all()


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and `Expect: 100-continue` answered as S3 clients expect
    server: WriteStallingProxy

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            out = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                out += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return out
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self) -> None:
        body = self._body()
        stalled = self.command in _WRITES and self.server.stall.is_set()
        if stalled:
            self.server.track(+1)
            self.server.stalled.set()
            self.server.released.wait()
        try:
            skip = {"connection", "expect", "transfer-encoding", "content-length"}
            headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
            headers["Content-Length"] = str(len(body))
            upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
            upstream.close()
            if stalled:  # the client gave up long ago: nothing to answer
                self.close_connection = True
                return
            self.send_response(response.status, response.reason)
            for k, v in response.getheaders():
                if k.lower() not in {"connection", "transfer-encoding", "content-length"}:
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            if stalled:
                self.server.track(-1)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture
def stalling_s3() -> Iterator[tuple[S3Server, WriteStallingProxy]]:
    os.environ.update(S3_CREDENTIALS)
    server = S3Server().start()
    proxy = WriteStallingProxy(server.port)
    try:
        yield server, proxy
    finally:
        proxy.released.set()
        proxy.shutdown()
        proxy.server_close()
        server.stop()


def _storage_options(endpoint: str) -> dict:
    # No short read timeout: a stalled store must keep the upload blocked, not fail it quickly.
    return {"client_kwargs": {"endpoint_url": endpoint}, "config_kwargs": {"retries": {"max_attempts": 1}}}


def _train_args(url: str, so: dict, tmp_path: Path, every_steps: int, *extra: str, max_steps: int) -> list[str]:
    return tiny(
        tmp_path,
        f"checkpoint.url={url}",
        f"checkpoint.storage_options={json.dumps(so)}",
        "checkpoint.async=true",
        f"checkpoint.every_steps={every_steps}",
        f"elastic.grace_seconds={GRACE_SECONDS}",
        # The store is stalled before the trainer starts: the root's lease (taken at start) would wait on it
        # first. These tests are about a stalled save; tests/test_ownership.py holds the lease.
        "checkpoint.lease=false",
        *extra,
        max_steps=max_steps,
    )


def _start(argv: list[str], log_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", *argv],
        stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT,
        env=clean_env(**S3_CREDENTIALS),
        start_new_session=True,
    )


def _wait(event: threading.Event, what: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not event.wait(0.05):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


def _sigterm_with_a_stalled_async_save(
    tmp_path: Path,
    s3: tuple[S3Server, WriteStallingProxy],
    launcher: Callable[[], list[str]],
    every_steps: int,
    then: str,
) -> str:
    """Commit a checkpoint, resume with writes stalled, SIGTERM once the next save blocks (and the log shows
    `then`); check the exit's bound and the root. Returns the stopped run's log."""
    server, proxy = s3
    url = f"s3://{server.make_bucket()}/run"
    so = _storage_options(proxy.endpoint)
    args = partial(_train_args, url, so, tmp_path, every_steps)
    first = run_cli(*launcher(), *args(max_steps=every_steps), env=clean_env(**S3_CREDENTIALS))
    assert first.returncode == 0, first.stderr[-4000:]
    assert f"checkpoint committed {url}/step-{every_steps:09d}" in first.stderr, first.stderr[-4000:]

    proxy.stall.set()
    log = tmp_path / "stopped.log"
    proc = _start([*launcher(), *args(max_steps=100000)], log)
    try:
        _wait(proxy.stalled, "an upload of the next save reaching the store", proc, log)
        wait_for_log(log, then, proc)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=GRACE_SECONDS + 60)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - signalled
    finally:
        kill_group(proc)
    text = log.read_text()
    assert code == 143, f"exit {code} {took:.1f}s after SIGTERM:\n{text[-4000:]}"
    assert took <= GRACE_SECONDS + EXIT_MARGIN_SECONDS, f"exit came {took:.1f}s after SIGTERM:\n{text[-4000:]}"
    # The exit says which wait the grace period cut short.
    assert "did not finish within elastic.grace_seconds=3" in text, text[-3000:]
    assert "checkpoint committed" not in text

    proxy.release()  # the store recovers: the cut-short save's files arrive, its manifest never does
    so_arg = json.dumps(_storage_options(server.endpoint))
    env = clean_env(**S3_CREDENTIALS)
    verify = run_cli("checkpoints", "verify", url, "--storage-options", so_arg, env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr[-3000:]
    assert f"valid: {url}/step-{every_steps:09d} " in verify.stdout, verify.stdout
    listing = run_cli("checkpoints", "list", url, "--storage-options", so_arg, env=env)
    assert listing.returncode == 0, listing.stderr[-3000:]
    rows = [line.split(None, 1) for line in listing.stdout.splitlines()[1:] if line.strip()]
    valid = [int(step) for step, status in rows if "INVALID" not in status]
    assert valid == [every_steps], listing.stdout  # the save cut short is never counted as valid
    return text


def test_sigterm_soon_after_an_async_save_stalled_on_the_store_exits_143_within_grace(tmp_path, stalling_s3):
    # Saves 100 steps apart: step 200's save is stalled and steps go on. SIGTERM comes during them (then the
    # emergency save waits for the stalled one) or, on a slow machine, once step 300's save waits for it too.
    _sigterm_with_a_stalled_async_save(tmp_path, stalling_s3, lambda: ["train"], 100, "step=201/")


def test_sigterm_while_the_next_save_waits_for_a_stalled_one_exits_143_within_grace(tmp_path, stalling_s3):
    # Saves every step: step 2's save is stalled and the loop waits for it in step 3's save when SIGTERM
    # comes; no Python code on the main thread looks at the stop flag until the store answers.
    _sigterm_with_a_stalled_async_save(tmp_path, stalling_s3, lambda: ["train"], 1, "step=3/")


def test_sigterm_under_torchrun_with_an_async_save_stalled_on_the_store_exits_143_within_grace(tmp_path, stalling_s3):
    # Rank 0 writes; rank 1 goes on to the next collective and waits there for rank 0, in C++, where no
    # Python signal handler runs.
    launcher = lambda: ["launch", *standalone(2), "--"]  # noqa: E731 - a fresh rendezvous port per run
    _sigterm_with_a_stalled_async_save(tmp_path, stalling_s3, launcher, 1, "step=3/")


def test_no_stop_signal_after_a_finished_run_leaves_a_deadline_behind(tmp_path):
    """A run that finished gives the signals back: the process then ends as any other would."""
    code = (
        "import signal, sys\n"
        "from trainer.elastic import StopRequest\n"
        "s = StopRequest(1.0)\n"
        "s.install()\n"
        "s.uninstall()\n"
        "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
        "assert signal.set_wakeup_fd(-1) == -1\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=clean_env())
    assert r.returncode == 0, r.stderr
