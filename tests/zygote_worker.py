"""torchrun's worker command in the suite: `zygote_worker.py trainer ARGS` is `python -m trainer ARGS`
(`zygote_worker.py SCRIPT.py ARGS`: `python SCRIPT.py ARGS`), forked from the test fork server
(tests/zygote.py) instead of a fresh interpreter.

torchrun starts this script per rank with the rank's environment; it imports nothing heavy (about 30 ms),
hands the server its stdin, stdout and stderr, environment, working directory and argv, and stays the
process torchrun watches: every signal it gets goes on to the run, and it ends as the run ended (the
exit code, or killed by the run's signal), so torchrun's monitoring, restarts and shutdown see what they
see of a fresh interpreter. A SIGKILL cannot be forwarded: the server kills the run when this process's
end of the connection closes. Without the server's socket (GENTRAIN_TEST_ZYGOTE) it becomes the fresh
interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

ZYGOTE = "GENTRAIN_TEST_ZYGOTE"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    target, args = sys.argv[1], sys.argv[2:]
    script = target if target.endswith(".py") else None
    path = os.environ.pop(ZYGOTE, None)
    if not path:
        os.execv(sys.executable, [sys.executable, "-u", *([script] if script else ["-m", target]), *args])
    assert script or target == "trainer", f"zygote_worker runs the trainer module or a script, not {target!r}"
    # Signals go to the run from the start: one that comes before its pid is known is sent once it is.
    pid: int | None = None
    pending: list[int] = []

    def forward(signum: int, _frame) -> None:
        if pid is None:
            pending.append(signum)
        else:
            os.kill(pid, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = {"args": args, "env": dict(os.environ), "cwd": os.getcwd(), "fds": True, "session": True, "tied": True}
    if script:
        request["script"] = os.path.abspath(script)
    socket.send_fds(conn, [(json.dumps(request) + "\n").encode()], [0, 1, 2])
    replies = conn.makefile("rb")
    first = replies.readline().decode()
    if not first.startswith("pid "):
        print(f"zygote_worker: the test fork server did not start the run ({first!r})", file=sys.stderr)
        sys.exit(1)
    pid = int(first[4:])
    for signum in pending:
        os.kill(pid, signum)
    last = replies.readline().decode()  # a forwarded signal interrupts nothing here: the read resumes (PEP 475)
    code = int(last[5:]) if last.startswith("exit ") else -signal.SIGKILL  # the monitor itself was killed
    if code < 0:  # end as the run ended: by its signal
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # the two no handler can take
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
