"""Shared test helpers: a tiny config, a CLI runner with a hard timeout, free ports."""

from __future__ import annotations

import os
import signal
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
    # HF_HUB_OFFLINE: the suite never reaches a model hub (nor does gentrain), and with it in every run's
    # environment the runs that ask for it explicitly are forked like the others (see run_cli). The other two
    # are what gentrain sets in its own process when it reads a dataset or a text encoder (so an in-process
    # test sets them in pytest's environment for good): with them here, an environment made before such a
    # test and one made after are the same, and both fork (a difference would start a fresh interpreter).
    env.update(
        PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1"
    )
    env.update(extra)
    return env


def run_cli(
    *args: str, timeout: float = 900, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` in a process of its own; killed if it outlives `timeout` (a hang bound
    only: loaded or slow machines run these several times slower than a quiet one).

    The process is forked from a server that imported torch and diffusers once (tests/zygote.py) unless
    the run needs a fresh interpreter (its own working directory, PYTHONPATH or import-time settings) or
    GENTRAIN_TEST_FORK=0."""
    env = env or clean_env()
    server = fork_server(env, cwd)
    if server is not None:
        return server.run([str(a) for a in args], env, timeout)
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd or REPO,
    )


def run_bench(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python bench/SCRIPT ARGS` from the checkout, offline, forked from the test server where it can be (as
    run_cli); killed if it outlives `timeout` (a hang bound)."""
    env = clean_env(PYTHONPATH=str(REPO))
    path = str(REPO / "bench" / script)
    server = fork_server(env)
    if server is not None:
        return server.run([str(a) for a in args], env, timeout, script=path)
    return subprocess.run(
        [sys.executable, path, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


# Read when a library is imported, so a forked run would see the server's values, not the run's.
_IMPORT_TIME = (
    "PYTHON",
    "HF_",
    "FSSPEC_",
    "TRANSFORMERS_",
    "DIFFUSERS_",
    "TORCH",
    "PYTORCH_",
    "OMP_",
    "MKL_",
    "CUDA_",
    "LD_",
)


# ... except these, which share a prefix but are read while a run works, never on import: torchrun's own
# (its agent reads them; a rank gets them in its environment like any other variable).
_RUNTIME = ("TORCHELASTIC_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


# Folders a forked run may have on PYTHONPATH beyond the server's: what they hold (the tests' probe tasks,
# this checkout) is imported by the run, never by the server, so the fork puts them on sys.path where
# `python -m` would (tests/zygote.py).
_FORKABLE_PATHS = {str(REPO), str(REPO / "tests")}


def fork_server(env: dict[str, str], cwd: Path | None = None) -> _Zygote | None:
    """The test fork server, where a run with this environment and working directory can be forked from
    it (else None: the run starts a fresh interpreter)."""
    if cwd not in (None, REPO) or os.environ.get("GENTRAIN_TEST_FORK", "1") == "0":
        return None
    server = _zygote()
    return server if server is not None and _forkable(env, server.env) else None


def _forkable(env: dict[str, str], base: dict[str, str]) -> bool:
    """Whether a run with `env` sees what a fresh interpreter would in a fork of the server started with `base`:
    the same import-time settings."""
    keys = {k for k in {*env, *base} if k.startswith(_IMPORT_TIME) and not k.startswith(_RUNTIME)}
    for k in keys:
        if env.get(k) == base.get(k):
            continue
        if k == "PYTHONPATH":
            ours = set(filter(None, base.get(k, "").split(os.pathsep))) | _FORKABLE_PATHS
            if set(filter(None, env[k].split(os.pathsep))) <= ours:
                continue
        return False
    return True


class ForkedRun:
    """A run forked by the test server (tests/zygote.py), with what the tests use of subprocess.Popen:
    pid, poll, wait, send_signal, terminate, kill, returncode. The exit status comes from the run's
    monitor: the exit code, or minus the signal that ended it (-9 too if the monitor itself was killed)."""

    def __init__(self, conn: socket.socket, args: list[str]) -> None:
        self.args = args
        self.returncode: int | None = None
        self.pid: int | None = None
        self._conn: socket.socket | None = conn
        self._buf = b""
        self._read(until_pid=True, timeout=120)
        if self.pid is None:
            raise RuntimeError(f"the test fork server did not start {args!r}")

    def _read(self, until_pid: bool = False, timeout: float | None = None) -> None:
        import select
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self._conn is not None and not (until_pid and self.pid is not None):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return  # nothing more within the timeout
            chunk = self._conn.recv(1 << 12)
            self._buf += chunk
            *lines, self._buf = self._buf.split(b"\n")
            for line in map(bytes.decode, lines):
                if line.startswith("pid "):
                    self.pid = int(line[4:])
                elif line.startswith("exit "):
                    self.returncode = int(line[5:])
            if not chunk or self.returncode is not None:
                self.returncode = -9 if self.returncode is None else self.returncode
                self._conn.close()
                self._conn = None

    def poll(self) -> int | None:
        self._read(timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._read(timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """The client side of tests/zygote.py: one server per pytest process, killed (by its pid) at exit."""

    def __init__(self) -> None:
        import atexit
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="gentrain-zygote-")
        self.socket = os.path.join(self.dir, "s")
        self.env = clean_env()  # what its imports saw (fork_server compares a run's import-time settings)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", str(REPO / "tests" / "zygote.py"), self.socket],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**self.env, "SUITE_CPU_LOG": os.environ.get(CPU_LOG, "")},
        )
        atexit.register(self.close)
        line = self.proc.stdout.readline()  # the event: its imports are done (or it said why not)
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"the test fork server did not start: {line!r} (GENTRAIN_TEST_FORK=0 avoids it)")
        self.runs = 0

    def start(
        self,
        args: list[str],
        env: dict[str, str],
        stdout: str,
        stderr: str,
        session: bool = False,
        module: str = "trainer",
        script: str | None = None,
    ) -> ForkedRun:
        """Fork `python -m MODULE ARGS` (`python SCRIPT ARGS`) writing to the files `stdout` and `stderr` (the
        same path: one file, as Popen(stderr=STDOUT)); `session`: in a session and process group of its own."""
        import json

        for path in {stdout, stderr}:  # there when this returns, as Popen's are (a test may read them at once)
            open(path, "w").close()
        request = {"args": args, "env": env, "cwd": str(REPO), "stdout": stdout, "stderr": stderr}
        request["test"] = os.environ.get("PYTEST_CURRENT_TEST", "?")  # the CPU log's (GENTRAIN_TEST_CPU_LOG)
        if session:
            request["session"] = True
        if module != "trainer":
            request["module"] = module
        if script is not None:
            request["script"] = script
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.socket)
            conn.sendall((json.dumps(request) + "\n").encode())
        except OSError:
            conn.close()
            raise
        return ForkedRun(conn, [script or ("gentrain" if module == "trainer" else module), *args])

    def run(
        self, args: list[str], env: dict[str, str], timeout: float, script: str | None = None
    ) -> subprocess.CompletedProcess:
        """`python -m trainer ARGS` (`python SCRIPT ARGS`) to its end, as subprocess.run(capture_output=True,
        text=True) returns it; killed if it outlives `timeout`."""
        self.runs += 1
        out, err = (os.path.join(self.dir, f"{self.runs}.{n}") for n in ("out", "err"))
        proc = self.start(args, env, out, err, script=script)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        with open(out) as o, open(err) as e:
            result = subprocess.CompletedProcess(proc.args, code, o.read(), e.read())
        os.unlink(out)
        os.unlink(err)
        return result

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


_ZYGOTE: _Zygote | None = None
_ZYGOTE_FAILED: str | None = None


def _zygote() -> _Zygote | None:
    """The fork server, started on first use; None (runs start fresh interpreters) if it cannot start,
    e.g. where a socket path under TMPDIR would be too long."""
    global _ZYGOTE, _ZYGOTE_FAILED
    if _ZYGOTE is None and _ZYGOTE_FAILED is None:
        try:
            _ZYGOTE = _Zygote()
        except (OSError, RuntimeError) as e:
            _ZYGOTE_FAILED = str(e)
            import warnings

            warnings.warn(f"CLI runs start fresh interpreters: {e}", stacklevel=2)
    return _ZYGOTE


# The suite's CPU profile (docs/development.md): with GENTRAIN_TEST_CPU_LOG=FILE, each test appends the CPU seconds
# of its pytest process and of the processes it started and waited for (fresh interpreters: another venv's,
# torchx's pods, ...), and the fork server appends each forked run's (tests/zygote.py); scripts/suite_cpu.py sums
# them per file.
CPU_LOG = "GENTRAIN_TEST_CPU_LOG"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(CPU_LOG)
    if not path:
        yield
        return
    import json
    import resource
    import time

    def cpu(who: int) -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    own, children, t0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.monotonic()
    yield
    record = {"test": item.nodeid, "kind": "pytest", "wall": time.monotonic() - t0}
    record.update(self=cpu(resource.RUSAGE_SELF) - own, children=cpu(resource.RUSAGE_CHILDREN) - children)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


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
