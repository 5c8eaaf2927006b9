"""A fork server for the suite's `gentrain` runs: `python -m trainer ARGS` without paying the imports again.

Nearly all of a tiny CLI run's CPU time is importing torch, diffusers, peft and transformers (about 5 s
of a 6 s run on the 2-core build machine); the suite makes hundreds of such runs. This server imports
them once, then forks per run a monitor, which forks the run and waits for it. The run becomes what
`python -u -m trainer ARGS` would be: the request's environment, working directory, argv and
`sys.path[0]`, stdin from /dev/null, stdout and stderr into the request's files, default SIGCHLD, then
`runpy.run_module("trainer", run_name="__main__")` and a normal interpreter exit. The monitor reports
the run's pid first (so the client can kill it on a timeout) and its exit status last, as `subprocess`
does (minus the signal for a run a signal ended).

What a fork cannot reproduce is left to real processes (tests/conftest.py `run_cli` decides): a run with
its own working directory, import-time settings (HF_*, TORCH*, OMP_*, ...) or PYTHONPATH (beyond this
checkout and its tests/ folder, which a fork puts on sys.path as `python -m` would) starts a fresh
interpreter. A run a test signals (`start_cli`) is forked too, into a session of its own; the signal
reaches it by its pid, as it would a fresh interpreter.

torchrun's workers are forked too (tests/zygote_worker.py, tests/elastic_helpers.py): the process
torchrun starts is a small client that hands this server its stdin, stdout and stderr (SCM_RIGHTS), its
environment (RANK, MASTER_PORT, TORCHELASTIC_*, ...), working directory and argv; the run is forked with
them, in a session of its own. The client forwards every signal torchrun sends it to the run and ends
as the run ended (the same exit code, or killed by the same signal), so the agent's monitoring, restarts
and shutdown see what they would see of a fresh interpreter. Such a run is tied to its client: when the
client dies (SIGKILLed by a test or by torchrun, which cannot be forwarded) the monitor kills the run at
once.
The stdlib's multiprocessing forkserver does the same for its workers; it cannot run a module as
`__main__` with another environment and argv, so this is written here.

Protocol, one connection per run: the client sends one JSON line {args, env, cwd, optionally script (the
run is `python SCRIPT ARGS`, not `-m trainer`) or module (`python -m MODULE ARGS`: torchrun's agent,
tests/elastic_helpers.py), and either stdout and stderr (file paths) or fds (true:
stdin, stdout and stderr come with the line as SCM_RIGHTS); optionally session (the run starts a session
of its own) and tied (the run is SIGKILLed when the client's end of the connection closes)}; the monitor
answers "pid <n>\\n", then "exit <code>\\n".
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys

CPU_LOG = "SUITE_CPU_LOG"  # the server's copy of GENTRAIN_TEST_CPU_LOG (clean_env drops GENTRAIN_*)
PRELOAD = ("torch", "diffusers", "diffusers.training_utils", "peft", "transformers", "accelerate", "safetensors")


def _serve(path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    # Objects that exist now are never collected in a run: a collection in a run then touches only the
    # run's own objects, not every page it shares with this server (CPython's gc.freeze, made for forks).
    gc.freeze()
    # Forking is safe only from a single thread: nothing imported may have started one.
    threads = len(os.listdir(f"/proc/{os.getpid()}/task"))
    if threads != 1:
        print(f"not forking: {threads} threads after the imports", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps finished children
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        # The client's descriptors, if it sent any, arrive with the request's first bytes.
        request, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        while request and not request.endswith(b"\n"):
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            request += chunk
        if not request.endswith(b"\n"):
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        if os.fork() == 0:  # the monitor: starts the run, waits for it, reports how it ended
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            req = json.loads(request)
            pid = os.fork()
            if pid == 0:
                conn.close()
                _run(req, fds)  # never returns
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"pid {pid}\n".encode())
                status, usage = _wait_tied(conn, pid) if req.get("tied") else os.wait4(pid, 0)[1:]
                _log_cpu(req, usage)  # before the answer: a test that reads the log after the run finds it there
                # As subprocess reports it: the exit code, or minus the signal that killed the run.
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass  # the client is gone
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _log_cpu(req: dict, usage) -> None:
    """With CPU_LOG set (GENTRAIN_TEST_CPU_LOG, tests/conftest.py), append the run's CPU seconds (its own and its
    children's) and the test that started it: the suite's profile (scripts/suite_cpu.py)."""
    path = os.environ.get(CPU_LOG)
    if path:
        test = req.get("test") or req["env"].get("PYTEST_CURRENT_TEST", "?")
        record = {"test": test, "kind": "fork", "cpu": usage.ru_utime + usage.ru_stime, "args": req["args"][:2]}
        try:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:
            pass  # a log it cannot write changes no run's exit status


def _wait_tied(conn: socket.socket, pid: int) -> tuple[int, object]:
    """The run's wait status and resource usage; if the client's end closes first (it was killed), SIGKILL the
    run then."""
    try:
        ended = os.pidfd_open(pid)  # readable once the run has exited
    except (AttributeError, OSError):  # no pidfd (Linux before 5.3): look every 50 ms
        ended = None
    while True:
        ready = select.select([conn] if ended is None else [conn, ended], [], [], 0.05 if ended is None else None)[0]
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return status, usage
        if conn in ready and not conn.recv(1 << 12):
            os.kill(pid, signal.SIGKILL)
            return os.wait4(pid, 0)[1:]


def _run(req: dict, fds: list[int]) -> None:
    import runpy

    if req.get("session"):
        os.setsid()  # a process group of its own, as Popen(start_new_session=True) makes
    if req.get("fds"):  # the client's own stdin, stdout and stderr
        stdin, out, err = fds
    else:
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        # stderr into stdout's file shares its offset, as Popen(stderr=STDOUT) does
        same = req["stderr"] == req["stdout"]
        err = out if same else os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    for fd in {stdin, out, err} - {0, 1, 2}:
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    script = req.get("script")  # `python SCRIPT ARGS` instead of `python -m trainer ARGS`
    module = req.get("module", "trainer")  # `python -m MODULE ARGS` (run_module sets argv[0] to its file)
    sys.argv = [script or module, *req["args"]]
    # what `python -m` puts first (`python SCRIPT`: the script's folder), then PYTHONPATH's folders
    sys.path[0] = os.path.dirname(os.path.abspath(script)) if script else req["cwd"]
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    # An uncaught exception prints its traceback and exits 1, SystemExit exits with its code: as in
    # any interpreter, with non-daemon threads joined and atexit handlers run on the way out.
    try:
        if script:
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): printed, exit status 1
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        _exit_by_signal(signal.SIGINT)  # as the interpreter ends on an uncaught KeyboardInterrupt
        code = 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


def _exit(code: int) -> None:
    """What an interpreter's exit does that a run can see: join the non-daemon threads, run the atexit
    handlers, flush stdout and stderr; then end the process without the rest of the finalization. That
    rest (every module torn down, every object of torch, diffusers and transformers freed) writes to each
    page of the heap the run shares with the server, so the kernel copies them all: 1.4 of a forked
    `gentrain presets`' 1.6 s here, for nothing a run or a test can observe."""
    import atexit
    import threading

    try:
        threading._shutdown()  # what Py_Finalize calls first (CPython's private name, 3.4-3.14)
    except AttributeError:
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code & 0xFF)


def _exit_by_signal(sig: int) -> None:
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)


if __name__ == "__main__":
    _serve(sys.argv[1])
