"""Detection benchmark: from a node's loss to the survivor's restart, per rendezvous and per failure.

Two torchrun agents (`gentrain launch --nnodes=1:2 --nproc-per-node=1`) are two nodes training the digits-ddpm
preset with a small UNet, durable checkpoints every 50 steps into one shared root; agent a is the survivor,
agent b is lost once the checkpoint of step 50 is committed. The rendezvous settings are `gentrain launch`'s
defaults, as every launch path (the k8s manifests, the TorchX component) runs them: torch's, except
last_call_timeout=2 (trainer.launch.RDZV_DEFAULTS; `--rdzv-conf` here only raises join_timeout) unless
`--rdzv-conf` says otherwise (`last_call_timeout=30` is torch's own). Rendezvous:

  c10d      agent a hosts the rendezvous store (so b is the one lost: losing the host ends a c10d job);
  etcd-v2   a one-member etcd (Debian's etcd-server, v2 API) on a free port of 127.0.0.1, started here.

Failures of agent b:

  kill       SIGKILL of the agent and every process below it (the node died: its sockets close);
  stop       SIGSTOP of the agent and every process below it (the node went silent: its sockets stay open,
             nothing answers); SIGCONT then SIGKILL at the end;
  partition  agent b runs in a network namespace of its own (`ip netns`, root only), joined to this one by a
             veth pair 10.213.0.1 <-> 10.213.0.2 (both ends on this machine), and the link is taken down:
             b's processes keep running but nothing reaches them. Skipped where network namespaces cannot
             be made (not root).

Each with the step watchdog at its default (`elastic.step_timeout_seconds=25`) and, for the silent failures,
without it (`elastic.step_timeout_seconds=0`, `elastic.collective_timeout_seconds=--collective-timeout`, 120 by
default: the lowest the lease check allows; the job's default is 600). Measured (time.time() on this machine):

  exit_s         loss -> the survivor's worker has exited (its agent begins the restart);
  new_worker_s   loss -> the survivor's agent started its new worker (the new rendezvous round included);
  first_step_s   loss -> that worker's first step (its startup timings: start-up and restore included).

Every process is started here and killed by its PID (the agent and the PIDs found under it); nothing listens
beyond 127.0.0.1 but the veth pair of a partition run. Prints one JSON object.

Usage: python bench/detection.py [--rendezvous c10d,etcd-v2] [--failures kill,stop,partition]
                                 [--watchdog on,off] [--rdzv-conf CONF] [--out FILE] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SMALL_UNET = ["model.block_out_channels=[16,32]", "model.norm_num_groups=8", "train.batch_size=16"]
TIMINGS = re.compile(r"startup timings \(s\): (\{.*\})")
START1 = "world_size=1 restart="
WATCHDOG = re.compile(r"step watchdog: the step from step (\d+) has not finished after ([\d.]+) s")
EVERY = 50
NS_HOST, NS_PEER = "10.213.0.1", "10.213.0.2"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GENTRAIN_", "TORCHELASTIC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


def parents() -> dict[int, int]:
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return out


def descendants(pid: int) -> list[int]:
    parent_of = parents()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent_of.items() if pp == p]
        out += kids
        todo += kids
    return out


def workers(agent: subprocess.Popen) -> set[int]:
    """The agent's live training workers (its descendants running `-m trainer train`, not zombies)."""
    out = set()
    for pid in descendants(agent.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"trainer" in cmd and b"launch" not in cmd and state != "Z":
            out.add(pid)
    return out


def started_unix(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return None


def signal_tree(pid: int, sig: int) -> None:
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def kill_tree(proc: subprocess.Popen) -> None:
    if proc.poll() is None or descendants(proc.pid):
        signal_tree(proc.pid, signal.SIGCONT)
        signal_tree(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


class Etcd:
    """A one-member etcd with the v2 API on a free port, data in `workdir`; killed by its PID."""

    def __init__(self, workdir: Path, host: str = "127.0.0.1"):
        self.port = free_port(host)
        client, peer = f"http://{host}:{self.port}", f"http://127.0.0.1:{free_port()}"
        self.host = host
        self.proc = subprocess.Popen(
            [
                shutil.which("etcd") or "etcd",
                "--name=bench",
                f"--data-dir={workdir / 'etcd-data'}",
                "--enable-v2=true",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=bench={peer}",
                "--log-level=warn",
            ],
            stdout=open(workdir / "etcd.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy: {(workdir / 'etcd.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


class Netns:
    """A network namespace joined to this one by a veth pair (`ip`, root only); deleted at the end."""

    def __init__(self) -> None:
        self.name = f"gtdet{os.getpid()}"
        self.host_if, self.peer_if = f"gdh{os.getpid() % 100000}", f"gdp{os.getpid() % 100000}"
        for cmd in (
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if],
            ["ip", "link", "set", self.peer_if, "netns", self.name],
            ["ip", "addr", "add", f"{NS_HOST}/30", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            *(
                ["ip", "netns", "exec", self.name, *c]
                for c in (
                    ["ip", "addr", "add", f"{NS_PEER}/30", "dev", self.peer_if],
                    ["ip", "link", "set", self.peer_if, "up"],
                    ["ip", "link", "set", "lo", "up"],
                    ["ip", "route", "add", "default", "via", NS_HOST],
                )
            ),
        ):
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    def cut(self) -> None:
        subprocess.run(["ip", "link", "set", self.host_if, "down"], check=True, capture_output=True, timeout=30)

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


def netns_works() -> str | None:
    """None if network namespaces can be made here, else why not."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2"
    probe = f"gtdetprobe{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"ip netns add failed: {out.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def one(rendezvous: str, failure: str, watchdog: bool, collective_timeout: float, tmp: Path, conf: str) -> dict:
    """One job, one loss of agent b; the figures of `one`'s doc."""
    ns = Netns() if failure == "partition" else None
    host = NS_HOST if ns else "127.0.0.1"
    etcd = Etcd(tmp, host) if rendezvous == "etcd-v2" else None
    procs: list[subprocess.Popen] = []
    try:
        port = etcd.port if etcd else free_port(host)
        torchrun = [
            "--nnodes=1:2",
            "--nproc-per-node=1",
            "--max-restarts=3",
            f"--rdzv-backend={rendezvous}",
            f"--rdzv-endpoint={host}:{port}",
            f"--rdzv-id=detect-{port}",
            f"--rdzv-conf={conf}",
        ]
        timeouts = (
            []  # the defaults: elastic.step_timeout_seconds=25, elastic.collective_timeout_seconds=600
            if watchdog
            else ["elastic.step_timeout_seconds=0", f"elastic.collective_timeout_seconds={collective_timeout:g}"]
        )
        logs = {node: tmp / f"{node}.log" for node in "ab"}

        def start(node: str) -> subprocess.Popen:
            args = [
                "digits-ddpm",
                *SMALL_UNET,
                "train.threads=1",
                "train.log_every_steps=10",
                "train.val_every_steps=0",
                "sample.every_steps=0",
                "train.max_steps=1000000",
                f"run.dir={tmp}/run-{node}",
                f"checkpoint.url={tmp}/checkpoints",
                f"checkpoint.every_steps={EVERY}",
                *timeouts,
            ]
            # In a namespace the store host cannot be told from the address: say which agent hosts it.
            local = [f"--local-addr={NS_PEER if node == 'b' else NS_HOST}"] if ns else []
            if ns and rendezvous == "c10d":
                local.append(f"--rdzv-conf={conf},is_host={'true' if node == 'a' else 'false'}")
            base = [t for t in torchrun if not (local and t.startswith("--rdzv-conf"))]
            cmd = [sys.executable, "-m", "trainer", "launch", *base, *local, "--", *args]
            extra = {"GLOO_SOCKET_IFNAME": ns.peer_if if node == "b" else ns.host_if} if ns else {}
            if ns and node == "b":
                cmd = ["ip", "netns", "exec", ns.name, *cmd]  # `ip` execs the agent: the PID stays ours
            p = subprocess.Popen(
                cmd,
                stdout=open(logs[node], "w"),
                stderr=subprocess.STDOUT,
                env=clean_env(**extra),
                start_new_session=True,
            )
            procs.append(p)
            return p

        def text(node: str) -> str:
            return logs[node].read_text(errors="replace") if logs[node].exists() else ""

        def wait(what: str, done, timeout: float, watch: list[subprocess.Popen]):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                value = done()
                if value:
                    return value
                for p in watch:
                    if p.poll() is not None:
                        raise RuntimeError(f"an agent exited {p.returncode} before {what}:\n{text('a')[-3000:]}")
                time.sleep(0.05)
            raise TimeoutError(f"{what} not seen within {timeout:g}s:\n{text('a')[-3000:]}\n{text('b')[-3000:]}")

        a = start("a")
        time.sleep(1.0)  # a hosts the c10d store
        b = start("b")
        manifest = tmp / "checkpoints" / f"step-{EVERY:09d}" / "manifest.json"
        wait("world size 2", lambda: "world_size=2 " in text("a") + text("b"), 300, [a, b])
        wait(f"the checkpoint of step {EVERY}", manifest.exists, 300, [a, b])
        old = workers(a)
        timings_before = len(TIMINGS.findall(text("a")))
        if failure == "kill":
            signal_tree(b.pid, signal.SIGKILL)
        elif failure == "stop":
            signal_tree(b.pid, signal.SIGSTOP)
        else:
            ns.cut()
        t_loss = time.time()
        bound = (25 if watchdog else collective_timeout) + 240
        t_exit = wait("the survivor's worker exit", lambda: (not (old & workers(a))) and time.time(), bound, [a])

        def new_worker():
            fresh = workers(a) - old
            return fresh and min(started_unix(p) or time.time() for p in fresh)

        t_new = wait("the survivor's new worker", new_worker, 300, [a])
        timing = wait(
            "the restarted worker's first step",
            lambda: len(TIMINGS.findall(text("a"))) > timings_before and json.loads(TIMINGS.findall(text("a"))[-1]),
            300,
            [a],
        )
        log_a = text("a")
        tripped = WATCHDOG.search(log_a)
        exits = re.findall(r"exitcode\s*:\s*(-?\d+)", log_a)
        return {
            "rendezvous": rendezvous,
            "failure": failure,
            "watchdog": watchdog,
            "settings": timeouts,
            "rdzv_conf": conf,
            "exit_s": round(t_exit - t_loss, 2),
            "new_worker_s": round(t_new - t_loss, 2),
            "first_step_s": round(timing["first_step_unix"] - t_loss, 2),
            "watchdog_line": {"step": int(tripped.group(1)), "waited_s": float(tripped.group(2))} if tripped else None,
            "worker_exit_codes": sorted(set(exits)),
            "resumed_at_world_size_1": START1 in log_a,
        }
    finally:
        for p in procs:
            kill_tree(p)
        if etcd:
            etcd.stop()
        if ns:
            ns.delete()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rendezvous", default="c10d,etcd-v2")
    ap.add_argument("--failures", default="kill,stop,partition")
    ap.add_argument("--watchdog", default="on,off", help="on, off or both; off is run for the silent failures only")
    ap.add_argument("--collective-timeout", type=float, default=120.0)
    ap.add_argument(
        "--rdzv-conf",
        default="join_timeout=300",
        help="torchrun's --rdzv-conf (gentrain launch's defaults otherwise: last_call_timeout=2, keep_alive 5 s x 3)",
    )
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--logs", help="keep every run's agent logs under this folder")
    args = ap.parse_args(argv)
    why_not = netns_works()
    runs, skipped = [], []
    for rdzv in args.rendezvous.split(","):
        for failure in args.failures.split(","):
            for dog in args.watchdog.split(","):
                on = dog == "on"
                if failure == "kill" and not on and "on" in args.watchdog:
                    continue  # a killed node's sockets close: its peers fail at once, with or without the watchdog
                if failure == "partition" and why_not:
                    skipped.append({"rendezvous": rdzv, "failure": failure, "why": why_not})
                    continue
                name = f"{rdzv}-{failure}-{dog}"
                tmp = Path(tempfile.mkdtemp(prefix=f"detect-{name}-"))
                try:
                    row = one(rdzv, failure, on, args.collective_timeout, tmp, args.rdzv_conf)
                except Exception as e:  # noqa: BLE001 - one scenario's failure is a row, not the end of the bench
                    row = {"rendezvous": rdzv, "failure": failure, "watchdog": on, "error": str(e)[-3000:]}
                finally:
                    if args.logs:
                        dest = Path(args.logs) / name
                        dest.mkdir(parents=True, exist_ok=True)
                        for log in tmp.glob("*.log"):
                            shutil.copy(log, dest / log.name)
                    shutil.rmtree(tmp, ignore_errors=True)
                print(json.dumps(row), file=sys.stderr, flush=True)
                runs.append(row)
    out = {
        "bench": "detection",
        "what": "seconds from agent b's loss to the survivor's worker exit, new worker, first step",
        "rdzv_conf": args.rdzv_conf,
        "torch_defaults": "last_call_timeout 30 s, keep-alive 5 s x 3 (a lost node leaves the round after 15 s); "
        "gentrain launch adds last_call_timeout=2 where --rdzv-conf does not set it (trainer.launch.RDZV_DEFAULTS)",
        "runs": runs,
        "skipped": skipped,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
