"""Process model under torchrun: rank and restart accounting, stop signals, exit codes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from trainer.errors import (  # noqa: F401 (re-exported)
    EXIT_INVALID_CHECKPOINT,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_STEP_TIMEOUT,
    EXIT_USAGE,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """What torchrun tells a worker; a plain `python` run is rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    group_rank: int = 0
    restart_count: int = 0
    run_id: str = "local"

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if env is None else env

        def num(key: str, default: int) -> int:
            return int(env.get(key, default))

        return cls(
            rank=num("RANK", 0),
            world_size=num("WORLD_SIZE", 1),
            local_rank=num("LOCAL_RANK", 0),
            local_world_size=num("LOCAL_WORLD_SIZE", 1),
            group_rank=num("GROUP_RANK", 0),
            restart_count=num("TORCHELASTIC_RESTART_COUNT", 0),
            run_id=env.get("TORCHELASTIC_RUN_ID", "local"),
        )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0


class StopRequest:
    """SIGTERM/SIGINT: stop at the end of the current optimizer step, and be gone within `grace_seconds`.

    The Python handler only sets a flag; the loop agrees on the stop with every
    rank (see `agree_to_stop`) so no rank leaves while others wait in a
    collective, then writes an emergency checkpoint. The grace period is kept
    by a thread of its own, `gentrain-stop-deadline`, that learns of the signal
    through `signal.set_wakeup_fd`: the C-level handler writes the signal's
    number there at once, while Python handlers run only when the main thread
    gets back to bytecode. So the deadline holds whatever the main thread waits
    on: a collective whose peer waits for a stalled store, the next save
    waiting for the one in flight, a fence, pruning, the interpreter's exit
    joining a blocked writer thread. When it runs out the process exits 143 at
    once; the newest committed checkpoint stays valid (a save cut short has no
    manifest, and retention deletes a manifest first). A second signal exits
    at once too.
    """

    def __init__(self, grace_seconds: float = 25.0, rank: int | None = None) -> None:
        self.grace_seconds = grace_seconds
        self.rank = rank  # named in the deadline's message when there are several
        self.signum: int | None = None
        self.received_at: float | None = None
        self._signals = 0
        self._lock = threading.Lock()
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous: dict[int, Any] = {}
        self._previous_wakeup_fd = -1

    def install(self) -> None:
        """Handle SIGTERM/SIGINT (main thread only) and start the deadline thread."""
        for sig in _STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # set_wakeup_fd requires it: the C handler must never block
        self._previous_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._wakeup = (reader, writer)
        threading.Thread(target=self._keep_deadline, args=(reader,), name="gentrain-stop-deadline", daemon=True).start()

    def uninstall(self) -> None:
        """Give the signals back (a run that finished); the deadline thread ends."""
        if self._wakeup is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        reader, writer = self._wakeup
        self._wakeup = None
        try:
            writer.send(bytes([_QUIT]))
        except OSError:
            pass
        writer.close()

    def _handle(self, signum: int, frame) -> None:
        if self._wakeup is None:  # no deadline thread to count signals (install() not called)
            self._count(signum)
        self._mark(signum)

    def _mark(self, signum: int) -> None:
        with self._lock:
            if self.signum is None:
                self.signum = signum
                self.received_at = time.monotonic()

    def _count(self, signum: int) -> None:
        """Count a stop signal; the second one exits at once."""
        self._signals += 1
        if self._signals >= 2:
            _say(f"second signal {signal.Signals(signum).name}, exiting now")
            exit_now(EXIT_PREEMPTED)

    def _keep_deadline(self, reader: socket.socket) -> None:
        while True:
            left = self.seconds_left()
            reader.settimeout(None if self.received_at is None else max(left, 0.001))
            try:
                data = reader.recv(64)
            except TimeoutError:
                self._deadline_passed()
            except OSError:
                return
            if not data or _QUIT in data:
                reader.close()
                return
            for signum in data:
                if signum in _STOP_SIGNALS:
                    self._mark(signum)
                    self._count(signum)

    def _deadline_passed(self) -> None:
        name = signal.Signals(self.signum).name if self.signum else "the stop signal"
        who = f"[rank {self.rank}] " if self.rank is not None else ""
        _say(
            f"{who}the stop did not finish within elastic.grace_seconds={self.grace_seconds:g} of {name} (the main "
            f"thread was in {_main_thread_location()}); exiting 143, the newest committed checkpoint stays valid "
            "(a save cut short has no manifest)"
        )
        exit_now(EXIT_PREEMPTED)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def seconds_left(self) -> float:
        """Seconds of the grace period left (all of it before a signal)."""
        if self.received_at is None:
            return self.grace_seconds
        return self.grace_seconds - (time.monotonic() - self.received_at)

    def checker(self, work: str, device: torch.device, collective: bool = False) -> StopCheck:
        """The check `work` calls between its steps (see `StopCheck`)."""
        return StopCheck(self, work, device, collective)


class StopRequested(Exception):
    """A stop request cut `work` short (a preview, a validation, an evaluation).

    `agreed`: every rank raised it at the same point (or there is one rank), so all of them can go
    to the emergency checkpoint together. A rank that raised it alone (rank 0's own preview while
    the others train on) must not: the others meet it in the next step, where the per-step
    agreement (`agree_to_stop`) stops them all.
    """

    def __init__(self, work: str, agreed: bool) -> None:
        super().__init__(f"stop requested: {work} cut short")
        self.work = work
        self.agreed = agreed


class StopCheck:
    """Called between the steps of work a stop must not wait for: sampler steps, validation batches,
    FID chunks. Raises `StopRequested` once a stop was requested, so such work ends within one of its
    steps instead of outlasting `elastic.grace_seconds` (a 1000-step preview grid takes minutes).

    Local (`collective=False`, the default): only this rank's flag is read, no communication. Work
    that all ranks do in step (sharded parts gather their parameters in every forward) passes
    `collective=True`: every call is then an agreement (one all-reduce of an int), so all ranks
    raise at the same call. Work that is local on each rank but ends in a collective (validation's
    all-reduce, FID's gather) checks locally and calls `agree()` before its collective.

    Failpoint `GENTRAIN_FAULT_SIGTERM_DURING=WORK[:RANK]`: on its second call (one step of the work
    done), the check of the work whose name starts with WORK (`preview`, `validation`, `eval`) sends
    SIGTERM to its own process, once per process; tests use it to stop exactly inside such work.
    """

    def __init__(self, stop: StopRequest, work: str, device: torch.device, collective: bool = False) -> None:
        self.stop = stop
        self.work = work
        self.device = device
        self.collective = collective
        self._calls = 0

    def __call__(self) -> None:
        self._calls += 1
        if self._calls == 2:
            _fault_sigterm_during(self.work)
        if self.collective:
            self.agree()
        elif self.stop.requested:
            self._raise(agreed=not _several_ranks())

    def agree(self) -> None:
        """Collective: raise `StopRequested` (agreed) on every rank if any rank was asked to stop."""
        if agree_to_stop(self.stop.requested, self.device):
            self._raise(agreed=True)

    def _raise(self, agreed: bool) -> NoReturn:
        cut = StopRequested(self.work, agreed)
        log.warning("%s", cut)
        raise cut


# The kinds of trainer.engine.goodput.TimeLedger the watchdog watches: a training step (first time or redone).
# Saves (`checkpoint_stall`), evaluations and previews (`eval`), data waits, FLOP counting and calibration
# (`idle`), the resume (`restore`) take as long as they take; what hangs in them is one collective call that
# does not return, bounded by elastic.phase_timeout_seconds (the wait in that one call, not the phase).
WATCHED_KINDS = ("train", "redone")
STEP_TIMEOUT_FACTOR = 5.0  # the timeout is at least this many of the process's mean step
# Where torch.distributed's Python-level collectives run (the calls and their logging wrappers): a main thread
# with one of these files on its stack is waiting in a collective (gloo always; NCCL in barriers and object
# collectives, whose results are copied to the host inside the call).
_COLLECTIVE_FILES = ("distributed_c10d.py", "c10d_logger.py")


def _main_thread_collective() -> Any:
    """The outermost torch.distributed collective frame on the main thread's stack, or None: the same object
    for as long as that one call lasts, a new one for the next call."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    found = None
    while frame is not None:
        if os.path.basename(frame.f_code.co_filename) in _COLLECTIVE_FILES:
            found = frame
        frame = frame.f_back
    return found


class StepWatchdog:
    """Exit `EXIT_STEP_TIMEOUT` when a training step hangs: how a job notices a lost node in seconds.

    A node that dies closes its sockets and its peers' collectives fail at once. One that goes silent (a
    frozen host, a partition, a stopped process) does not: its peers wait inside the step's all-reduce until
    elastic.collective_timeout_seconds (600 s by default), and torchrun's agent, whose workers are alive,
    restarts nothing. This daemon thread reads the kind the training thread is in (the time ledger's
    `current()`) and, once the process is in its steady state (`on_step` was told a measured step's time: the
    first steps, which compile and count FLOPs, are behind it), exits when one training step has lasted longer
    than `timeout()`: max(elastic.step_timeout_seconds, STEP_TIMEOUT_FACTOR x the mean measured step). Time
    dynamo spends compiling (a recompile for a new shape) does not count: the step's clock starts again when
    a compile ends. It exits the way SIGTERM's deadline does (`_say`, `exit_now`: no interpreter shutdown
    that would wait on the hung collective); torchrun's agent then restarts the worker group, which resumes
    from the newest checkpoint, so exact resume is unaffected.

    Outside a training step (the resume's agreement, a save's gather, an evaluation's all-reduce, the data
    agreement) a phase may rightly take minutes, so its length says nothing; what hangs there is one
    collective call that never returns. The thread samples the main thread's stack (`collective`) and exits
    the same way once one such call has lasted `wait_timeout_seconds` (elastic.phase_timeout_seconds), armed
    from the start: a silent peer is noticed there too, not after elastic.collective_timeout_seconds.
    """

    def __init__(
        self,
        ledger,
        timeout_seconds: float,
        step: Callable[[], int] = lambda: -1,
        rank: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait_timeout_seconds: float = 0.0,
        collective: Callable[[], Any] = _main_thread_collective,
    ) -> None:
        self.ledger = ledger  # anything with current() -> (kind, entered at clock())
        self.timeout_seconds = timeout_seconds
        self.wait_timeout_seconds = wait_timeout_seconds
        self.collective = collective  # the main thread's collective call now (any object), or None
        self._wait: tuple[Any, float] = (None, 0.0)  # that call, and when it was first seen
        self.step = step
        self.rank = rank
        self.clock = clock
        self.armed = False
        self._steps = [0.0, 0]  # sum and count of measured step seconds
        self._compiling = 0
        self._compile_ended = float("-inf")
        self._stopped = threading.Event()
        self._callbacks: tuple | None = None

    # ---- what the training thread tells it
    def on_step(self, seconds: float) -> None:
        """A steady-state step took `seconds` (the loop's timed steps): arms the watchdog."""
        self._steps[0] += seconds
        self._steps[1] += 1
        self.armed = True

    def compile_started(self, *_: Any) -> None:
        self._compiling += 1

    def compile_ended(self, *_: Any) -> None:
        self._compiling = max(0, self._compiling - 1)
        self._compile_ended = self.clock()

    # ---- the decision
    def timeout(self) -> float:
        mean = self._steps[0] / self._steps[1] if self._steps[1] else 0.0
        return max(self.timeout_seconds, STEP_TIMEOUT_FACTOR * mean)

    def overdue(self) -> float | None:
        """Seconds the current training step has run (its clock restarted by a compile's end), if that is past
        `timeout()` while the process is armed, in a watched kind and not compiling; else None."""
        if not self.armed or self.timeout_seconds <= 0 or self._compiling:
            return None
        kind, entered = self.ledger.current()
        if kind not in WATCHED_KINDS:
            return None
        waited = self.clock() - max(entered, self._compile_ended)
        return waited if waited > self.timeout() else None

    def waiting_too_long(self) -> float | None:
        """Seconds the main thread has been in one collective call outside a training step, if that is past
        `wait_timeout_seconds` and no compile runs; else None. Call it once per poll: it notes the call."""
        call = self.collective() if self.wait_timeout_seconds > 0 else None
        if call is None:
            self._wait = (None, 0.0)
            return None
        if call is not self._wait[0]:  # a new call: its clock starts now
            self._wait = (call, self.clock())
            return None
        if self._compiling or self.ledger.current()[0] in WATCHED_KINDS:  # a step's wait is the step's
            return None
        waited = self.clock() - self._wait[1]
        return waited if waited > self.wait_timeout_seconds else None

    # ---- the thread
    def start(self) -> None:
        if self.timeout_seconds <= 0 and self.wait_timeout_seconds <= 0:
            return
        try:  # dynamo's compile callbacks (torch >= 2.5): a recompile inside a step is no hang
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(self.compile_started)
            callback_handler.register_end_callback(self.compile_ended)
            self._callbacks = (callback_handler, self.compile_started, self.compile_ended)
        except (ImportError, AttributeError):
            pass
        threading.Thread(target=self._watch, name="gentrain-step-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        if self._callbacks is not None:
            handler, started, ended = self._callbacks
            self._callbacks = None
            try:
                handler.remove_start_callback(started)
                handler.remove_end_callback(ended)
            except (AttributeError, ValueError):
                pass

    def _watch(self) -> None:
        shortest = min(t for t in (self.timeout_seconds, self.wait_timeout_seconds) if t > 0)
        while not self._stopped.wait(min(0.25, max(shortest / 10, 0.05))):
            waited = self.overdue()
            if waited is not None and not self._stopped.is_set():
                self._trip(waited)
            waited = self.waiting_too_long()
            if waited is not None and not self._stopped.is_set():
                self._trip_waiting(waited)

    def _trip(self, waited: float) -> NoReturn:
        who = f"[rank {self.rank}] " if self.rank is not None else ""
        mean = self._steps[0] / self._steps[1] if self._steps[1] else 0.0
        _say(
            f"{who}step watchdog: the step from step {self.step()} has not finished after {waited:.1f} s "
            f"(elastic.step_timeout_seconds={self.timeout_seconds:g}; the limit is the larger of it and "
            f"{STEP_TIMEOUT_FACTOR:g} x the mean step {mean:.3g} s); the main thread waits in "
            f"{_main_thread_location()}, most likely a collective whose peer is lost or silent. Exiting "
            f"{EXIT_STEP_TIMEOUT} so torchrun restarts the worker group from the newest checkpoint"
        )
        exit_now(EXIT_STEP_TIMEOUT)

    def _trip_waiting(self, waited: float) -> NoReturn:
        who = f"[rank {self.rank}] " if self.rank is not None else ""
        _say(
            f"{who}step watchdog: one collective call outside a training step ({self.ledger.current()[0]}, step "
            f"{self.step()}) has not returned after {waited:.1f} s (elastic.phase_timeout_seconds="
            f"{self.wait_timeout_seconds:g}); the main thread waits in {_main_thread_location()}, most likely for "
            f"a peer that is lost or silent. Exiting {EXIT_STEP_TIMEOUT} so torchrun restarts the worker group "
            "from the newest checkpoint"
        )
        exit_now(EXIT_STEP_TIMEOUT)


FAULT_SIGTERM_DURING = "GENTRAIN_FAULT_SIGTERM_DURING"
_fault_fired = False


def _fault_sigterm_during(work: str) -> None:
    global _fault_fired
    spec = os.environ.get(FAULT_SIGTERM_DURING)
    if not spec or _fault_fired:
        return
    name, _, rank = spec.partition(":")
    if not work.startswith(name) or (rank and int(rank) != int(os.environ.get("RANK", "0"))):
        return
    _fault_fired = True
    _say(f"failpoint {FAULT_SIGTERM_DURING}={spec}: SIGTERM to this process during {work}")
    os.kill(os.getpid(), signal.SIGTERM)


def _several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_QUIT = 0  # not a signal number: tells the deadline thread to end


def _say(message: str) -> None:
    """A line on stderr without the logging module: its handler lock may be held by the blocked main thread."""
    try:
        os.write(2, f"gentrain: {message}\n".encode())
    except OSError:
        pass


def _main_thread_location() -> str:
    """Where the main thread waits: its innermost gentrain frame (file:line function), for the log."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "an unknown place"
    stack = traceback.extract_stack(frame)
    package = os.path.dirname(os.path.abspath(__file__))
    ours = [f for f in stack if f.filename.startswith(package + os.sep)] or stack
    f = ours[-1]
    return f"{os.path.relpath(f.filename, os.path.dirname(package))}:{f.lineno} {f.name}()"


def flush_logs(timeout_seconds: float = 0.5) -> None:
    """Flush every logging handler and the standard streams, skipping a handler whose lock stays busy."""
    for h in logging.getLogger().handlers:
        lock = getattr(h, "lock", None)
        if lock is not None and not lock.acquire(timeout=timeout_seconds):
            continue
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream must not stop the exit
            pass
        finally:
            if lock is not None:
                lock.release()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def exit_now(code: int) -> NoReturn:
    """Flush the logs, then leave without the interpreter's shutdown.

    The shutdown joins every executor thread (a checkpoint writer blocked on a
    stalled store would hold the exit as long as the store stalls) and runs
    process-group destructors that may wait for peers. After a stop, what the
    run had to keep is committed or will never be: nothing there is worth more
    than the grace period.
    """
    flush_logs()
    os._exit(code)


def run_within(seconds: float, work: Callable[[], object], what: str) -> bool:
    """Run `work` on a daemon thread and wait at most `seconds`; False (logged) if it had not finished.

    For clean-up on the way out after a stop: what did not finish is left to
    the process's exit (an unfinished prune is redone by the next run's retention).
    """
    done = threading.Event()

    def run() -> None:
        try:
            work()
        except Exception as e:  # noqa: BLE001 - clean-up on the way out: say it, keep leaving
            log.warning("%s failed: %s", what, e)
        finally:
            done.set()

    threading.Thread(target=run, name=f"gentrain-{what.replace(' ', '-')}", daemon=True).start()
    if done.wait(timeout=max(0.0, seconds)):
        return True
    log.warning("%s did not finish within the %.1fs of grace left; exiting without waiting for it", what, seconds)
    return False


def process_start_time() -> float:
    """Unix time this process started (from /proc on Linux; now elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


class StartupClock:
    """Marks on the way from process start to the first completed step, logged once by rank 0.

    Restart time after a preemption is mostly here (imports, rendezvous,
    checkpoint load), so the log line says where it went.
    """

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = [("process_start", process_start_time())]
        self.finished = False

    def mark(self, name: str, last: bool = False) -> None:
        self.marks.append((name, time.time()))
        self.finished = last

    def summary(self) -> dict[str, float]:
        out = {}
        for (_, t0), (name, t1) in zip(self.marks, self.marks[1:], strict=False):
            out[name] = round(t1 - t0, 3)
        out["total"] = round(self.marks[-1][1] - self.marks[0][1], 3)
        out["process_start_unix"] = round(self.marks[0][1], 3)
        out["first_step_unix"] = round(self.marks[-1][1], 3)
        return out


def init_process_group(env: DistEnv, backend: str, timeout_seconds: float) -> None:
    """Initialize torch.distributed for a torchrun worker, safe across torchrun restarts.

    With the c10d rendezvous, torchrun lends its own rendezvous TCPStore to the
    workers (TORCHELASTIC_USE_AGENT_STORE=True) and torch assumes a fresh store
    per restart, but that store lives as long as the agent: keys such as gloo's
    rank addresses survive from the previous attempt, and a restarted rank 1
    then connects to the dead rank 0's port ("Connection refused", seen here in
    about one restart in three). On a single node the restart count is the
    agent's own, so keys are namespaced per attempt. Across nodes each agent
    counts on its own, so there the fix is TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    in torchrun's environment (`gentrain launch`, the manifests and the TorchX
    component set it): rank 0 then hosts a new store every round.

    The etcd-v2 rendezvous (torch's DynamicRendezvousHandler over etcd, like c10d
    over a TCPStore) shares a TCPStore of rank 0's agent the same way unless that
    variable is set; with it, rank 0's agent publishes a free port through etcd and
    rank 0's worker hosts the store (TORCHELASTIC_USE_AGENT_STORE=False: env://
    below). The older `etcd` backend never shares. So every backend ends in a
    store that is as new as the round.
    """
    from datetime import timedelta

    if env.world_size == 1 or dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_seconds)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
        return
    if env.local_world_size != env.world_size:
        log.warning(
            "torchrun shares its rendezvous store with the workers across nodes; a restart can then read "
            "stale keys. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (gentrain launch does)."
        )
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
        return
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size, is_master=False, timeout=timeout
    )
    prefixed = dist.PrefixStore(f"gentrain/{env.run_id}/attempt-{env.restart_count}", store)
    dist.init_process_group(backend, store=prefixed, rank=env.rank, world_size=env.world_size, timeout=timeout)


def agree_to_stop(local_flag: bool, device: torch.device) -> bool:
    """True on every rank if any rank was asked to stop (one all-reduce of an int)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local_flag
    t = torch.tensor([1 if local_flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_object(obj, src: int = 0, group=None):
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_objects(obj, group=None) -> list:
    """Every rank's `obj`, in rank order, on every rank (small values only)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def new_gloo_group(timeout_seconds: float):
    """A CPU process group of all ranks, for small objects exchanged off the training thread (collective)."""
    from datetime import timedelta

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_seconds))


def barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
