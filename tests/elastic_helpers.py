"""Start torchrun agents for tests and find their worker processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import clean_env, free_port
from helpers import children, kill_group


def _start_agent(module: str, args: list[str], log_path: Path, env: dict[str, str], fork: bool = True):
    """`python -m MODULE ARGS` as the leader of a new session (killable as a unit), output to `log_path`: forked
    from the test fork server where a CLI run with this environment would fork (`fork`; the handle offers what the
    tests use of Popen, tests/conftest.py ForkedRun), else a fresh interpreter. torchrun's agent imports torch
    (about 1.8 s of CPU here), the suite starts a hundred or more."""
    from conftest import fork_server

    env = clean_env(**env)
    server = fork_server(env) if fork else None
    if server is not None:
        return server.start(args, env, str(log_path), str(log_path), session=True, module=module)
    cmd = [sys.executable, "-m", module, *args]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def worker_command(env: dict[str, str], fork: bool = True, script: str | None = None) -> list[str]:
    """What torchrun runs per rank for `-m trainer` (or `script`): tests/zygote_worker.py, which forks the
    rank from the test fork server (tests/zygote.py), where a CLI run with this environment would fork
    (tests/conftest.py `fork_server`); else `-m trainer` (`script`), a fresh interpreter. Adds the server's
    socket to `env`."""
    from conftest import REPO, fork_server
    from zygote_worker import ZYGOTE

    server = fork_server(clean_env(**env)) if fork else None
    if server is None:
        return [script] if script else ["-m", "trainer"]
    env[ZYGOTE] = server.socket
    return [str(REPO / "tests" / "zygote_worker.py"), script or "trainer"]


def standalone(nproc: int, max_restarts: int = 0) -> list[str]:
    """torchrun's flags for one agent of `nproc` workers on this machine: a c10d rendezvous on a free
    loopback port (its id names the port), `max_restarts` restarts, failures noticed within 0.2 s."""
    port = free_port()
    return [
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=test-{port}",
        "--monitor-interval=0.2",
    ]


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> int:
    """The agent's exit code; its process group killed in any case (a hang bound, not a wait for time)."""
    try:
        return proc.wait(timeout=timeout)
    except Exception:
        raise AssertionError(f"torchrun did not finish in {timeout}s:\n{log.read_text()[-4000:]}") from None
    finally:
        kill_group(proc)


def start_torchrun(
    torchrun_args: list[str],
    train_args: list[str],
    log_path: Path,
    fork: bool = True,
    command: tuple[str, ...] = ("train",),
    script: str | None = None,
    **env: str,
) -> subprocess.Popen:
    """`torchrun ... -m trainer train ...` (`command`: another gentrain command, e.g. ("data", "encode"); with
    `script` and `command=()`: `torchrun ... SCRIPT ...`), the agent and its ranks forked from the test fork server
    unless `fork=False` or the environment needs fresh interpreters (`worker_command`)."""
    worker = worker_command(env, fork, script)
    args = [*torchrun_args, *worker, *command, *train_args]
    return _start_agent("torch.distributed.run", args, log_path, env, fork)


def start_launch(torchrun_args: list[str], train_args: list[str], log_path: Path, **env: str) -> subprocess.Popen:
    """`gentrain launch TORCHRUN_ARGS -- ARGS` (what a pod runs)."""
    return _start_agent("trainer", ["launch", *torchrun_args, "--", *train_args], log_path, env)


def worker_pids(agent_pid: int) -> list[int]:
    """torchrun's workers: python children of the agent running `-m trainer`."""
    pids = []
    for child in children(agent_pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
        except OSError:
            continue
        if b"trainer" in cmdline:
            pids.append(child)
    return pids


def rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env else None
