"""A run owns its checkpoints: run and timeline ids in every manifest, and one trainer per root (the lease).

Real training processes on a local root, and the lease itself on loopback S3 (moto) and GCS
(fake-gcs-server) servers. Each test waits for log lines and exits, never for a fixed time; the
only waiting by time is the lease's own lapse, made short with checkpoint.lease_seconds.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from ckpt_tamper import edit_tensors, manifest, read_tensors, step_dir
from conftest import clean_env, run_cli, tiny
from helpers import assert_tensors_equal, kill_group, start_cli, wait_for_log

from trainer.checkpoint import CheckpointStore
from trainer.checkpoint.lease import Holder, Lease, LeaseError, LeaseLost, lease_file
from trainer.errors import CheckpointError
from trainer.storage import filesystem

WEIGHTS = ("unet.model.safetensors", "unet.ema.safetensors", "unet.optimizer.safetensors")


def train(tmp_path: Path, *extra: str, max_steps: int = 4, env: dict | None = None) -> subprocess.CompletedProcess:
    args = tiny(tmp_path, "checkpoint.every_steps=2", "checkpoint.keep=10", *extra, max_steps=max_steps)
    return run_cli("train", *args, env=env)


def root_of(tmp_path: Path) -> Path:
    return tmp_path / "run" / "checkpoints"


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# ------------------------------------------------------------------ runs and timelines


@pytest.mark.slow
def test_resume_false_over_an_older_runs_root_exits_2_and_leaves_it_alone(tmp_path):
    r = train(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    root = root_of(tmp_path)
    before = files_of(step_dir(root, 4))
    assert manifest(root, 4)["run"] and manifest(root, 4)["timeline"]

    r = train(tmp_path, "checkpoint.resume=false", "seed=7", "train.lr=5e-4")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "holds checkpoints of another run" in r.stderr and "own checkpoint.url" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert files_of(step_dir(root, 4)) == before
    assert not (root / "lease.json").exists(), "a trainer that exits 2 releases its lease"


@pytest.mark.slow
def test_resume_false_in_a_torchrun_restart_of_the_same_job_continues_it(tmp_path):
    job = clean_env(TORCHELASTIC_RUN_ID="job-a", TORCHELASTIC_RESTART_COUNT="0")
    r = train(tmp_path, "checkpoint.resume=false", env=job)
    assert r.returncode == 0, r.stderr[-3000:]
    root = root_of(tmp_path)
    first = manifest(root, 4)
    assert first["job"] == "job-a"

    # Another job that says resume=false is refused, restart or not ...
    other = clean_env(TORCHELASTIC_RUN_ID="job-b", TORCHELASTIC_RESTART_COUNT="1")
    r = train(tmp_path, "checkpoint.resume=false", env=other, max_steps=6)
    assert r.returncode == 2 and "holds checkpoints of another run" in r.stderr, r.stderr[-3000:]
    # ... and a worker-group restart of the job that wrote them goes on with it (neither refused nor over again).
    restart = clean_env(TORCHELASTIC_RUN_ID="job-a", TORCHELASTIC_RESTART_COUNT="1")
    r = train(tmp_path, "checkpoint.resume=false", env=restart, max_steps=6)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed_from={step_dir(root, 4)}" in r.stderr, r.stderr[-3000:]
    later = manifest(root, 6)
    assert later["run"] == first["run"] and later["timeline"] != first["timeline"]


def _unloadable(tensors: dict) -> dict:
    """An optimizer state tensor reshaped (its digest recomputed): the file verifies on its own (a valid
    header, the listed size and digest), but it does not fit the model, so a resume cannot load it."""
    name = next(k for k, v in tensors.items() if v.ndim == 4)  # a conv weight's Adam moment
    tensors[name] = tensors[name].reshape(tensors[name].shape[0], -1)
    return tensors


@pytest.mark.slow
def test_a_step_retrained_after_a_fallback_replaces_the_one_that_could_not_be_loaded(tmp_path):
    reference = tmp_path / "reference"
    r = train(reference)
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp_path / "work"
    r = train(work, max_steps=4)
    assert r.returncode == 0, r.stderr[-3000:]
    root = root_of(work)
    edit_tensors(root, 4, "unet.optimizer.safetensors", _unloadable)
    old = manifest(root, 4)
    store = CheckpointStore(str(root))
    assert store.verify(store.check(4)) == [], "the tampered step must verify: only loading it fails"

    r = train(work, max_steps=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step-000000004 cannot be loaded" in r.stderr and f"resumed_from={step_dir(root, 2)}" in r.stderr
    assert "not by this timeline" in r.stderr and "replacing it" in r.stderr, r.stderr[-3000:]
    new = manifest(root, 4)
    assert new["timeline"] != old["timeline"] and new["run"] == old["run"]
    for name in WEIGHTS:  # re-trained from step 2: exactly the uninterrupted run's step 4
        assert_tensors_equal(read_tensors(root, 4, name), read_tensors(root_of(reference), 4, name), name)

    r = train(work, max_steps=4)  # and it loads: no fallback any more
    assert r.returncode == 0 and "cannot be loaded" not in r.stderr, r.stderr[-3000:]
    assert f"resumed_from={step_dir(root, 4)}" in r.stderr


# ------------------------------------------------------------------ one trainer per root


def _long_run(tmp_path: Path, log: Path, *extra: str) -> subprocess.Popen:
    args = tiny(tmp_path, "checkpoint.keep=100", *extra, max_steps=1_000_000)
    return start_cli("train", *args, env=clean_env(), log_path=log)


def _commits(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "checkpoint committed" in line]


@pytest.mark.slow
def test_a_second_trainer_on_the_same_root_exits_2_naming_the_holder(tmp_path):
    log = tmp_path / "a.log"
    a = _long_run(tmp_path, log, "checkpoint.every_steps=2", "checkpoint.lease_seconds=2")
    try:
        wait_for_log(log, "checkpoint committed", a)
        r = train(tmp_path, max_steps=1_000_000)
        assert r.returncode == 2, r.stderr[-3000:]
        assert "in use by another trainer" in r.stderr and f"pid {a.pid}," in r.stderr, r.stderr[-2000:]
        assert "renewed it" in r.stderr and "Traceback" not in r.stderr
        assert a.poll() is None, "the holder goes on"
        a.send_signal(signal.SIGTERM)  # an emergency save, then the lease is released
        assert a.wait(timeout=300) == 143, log.read_text()[-3000:]
    finally:
        kill_group(a)
    assert "released the lease" in log.read_text()
    assert not (root_of(tmp_path) / "lease.json").exists()


@pytest.mark.slow
def test_a_killed_holders_lease_is_taken_over_without_waiting(tmp_path):
    log = tmp_path / "a.log"
    a = _long_run(tmp_path, log, "checkpoint.every_steps=2", "checkpoint.lease_seconds=600")
    try:
        wait_for_log(log, "checkpoint committed", a)
        os.kill(a.pid, signal.SIGKILL)
        a.wait(timeout=60)
    finally:
        kill_group(a)
    assert (root_of(tmp_path) / "lease.json").exists(), "SIGKILL leaves the lease behind"
    # lease_seconds=600 would outlast the test's bound: the process is gone from this host, so no wait.
    r = train(tmp_path, max_steps=8, env=clean_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "took over the lease" in r.stderr and "its process is gone" in r.stderr, r.stderr[-3000:]


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in "Tt"


def _stop_outside_the_lease_lock(proc, root: Path | None) -> None:
    """SIGSTOP `proc` at a moment it does not hold the local root's lock (the renewal's read, compare and
    rename; `root` None: a store without one): a holder stopped inside it is the other case
    (test_a_lock_nobody_releases_stops_a_contender_with_the_reason_and_the_holder_carries_on)."""
    for _ in range(100):
        proc.send_signal(signal.SIGSTOP)
        while not _stopped(proc.pid):  # the signal is delivered asynchronously
            time.sleep(0.001)
        if root is None:
            return
        fd = os.open(root, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return  # free while the holder is stopped (closing the descriptor releases it again)
        except BlockingIOError:
            proc.send_signal(signal.SIGCONT)
        finally:
            os.close(fd)
    raise AssertionError("the holder held the lease's lock at each of 100 stops")


@pytest.mark.slow
def test_a_paused_holder_loses_its_lease_after_the_ttl_and_never_commits_again(tmp_path):
    log = tmp_path / "a.log"
    a = _long_run(tmp_path, log, "checkpoint.every_steps=20", "checkpoint.lease_seconds=3")
    root = root_of(tmp_path)
    try:
        wait_for_log(log, "step-000000020 (", a)  # the commit line of step 20
        _stop_outside_the_lease_lock(a, root)  # alive, but not renewing: like a partitioned or frozen node
        mine = manifest(root, 20)["timeline"]
        r = train(tmp_path, "checkpoint.every_steps=2", "checkpoint.lease_seconds=3", max_steps=24, env=clean_env())
        assert r.returncode == 0, r.stderr[-3000:]
        assert "took over the lease" in r.stderr and "not renewed for 3s" in r.stderr, r.stderr[-3000:]
        assert f"resumed_from={step_dir(root, 20)}" in r.stderr
        commits_before = len(_commits(log))
        a.send_signal(signal.SIGCONT)
        code = a.wait(timeout=600)
    finally:
        kill_group(a)
    text = log.read_text()
    assert code == 2, text[-3000:]
    assert "lost its lease" in text and "Traceback" not in text, text[-3000:]
    assert len(_commits(log)) == commits_before, "the trainer that lost the lease committed after its lease check"
    written = {int(d.name[5:]): json.loads((d / "manifest.json").read_text()) for d in root.glob("step-*")}
    assert [s for s, m in written.items() if m["timeline"] == mine and s > 20] == []
    assert all(written[s]["timeline"] != mine for s in (22, 24))


# ------------------------------------------------------------------ the lease on every store


HOLDER = textwrap.dedent(
    """
    import json, sys
    from trainer.checkpoint import CheckpointStore
    from trainer.checkpoint.lease import Holder, Lease, LeaseLost
    from trainer.storage import filesystem
    url, options, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
    fs, root = filesystem(url, options)
    lease = Lease(fs, root.rstrip("/"), url, seconds, Holder("holder-host", 4242, "job-h", 0))
    lease.acquire()
    print("held", flush=True)
    for line in sys.stdin:
        try:
            lease.check()
            print("ok", flush=True)
        except LeaseLost as e:
            print("lost", e, flush=True)
            sys.exit(2)
    """
)


def _ask(proc: subprocess.Popen) -> str:
    proc.stdin.write("check\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


@pytest.fixture(params=["local", "s3", "gcs"])
def lease_root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "root"), {}
    server = request.getfixturevalue(f"{request.param}_server")
    scheme = "s3" if request.param == "s3" else "gs"
    return f"{scheme}://{server.make_bucket()}/run-{uuid.uuid4().hex[:6]}", server.storage_options()


@pytest.mark.slow
def test_the_lease_refuses_a_renewing_holder_takes_over_a_silent_one_and_fences_it(lease_root):
    url, options = lease_root
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, json.dumps(options), "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        start_new_session=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        fs, root = filesystem(url, options)
        other = Holder("other-host", 1, "job-o", 0)

        # It renews while the newcomer watches: refused, naming it.
        with pytest.raises(LeaseError, match="host holder-host, pid 4242, job job-h") as refused:
            Lease(fs, root, url, 1, other).acquire(poll_seconds=0.02)
        assert "renewed it" in str(refused.value)
        assert _ask(holder) == "ok"

        # Paused (alive, silent) for longer than its lease: taken over, and it never commits again.
        _stop_outside_the_lease_lock(holder, Path(root) if not options else None)
        newcomer = Lease(fs, root, url, 1, other)
        newcomer.acquire(poll_seconds=0.02)
        holder.send_signal(signal.SIGCONT)
        assert _ask(holder).startswith("lost this trainer lost its lease")
        assert holder.wait(timeout=60) == 2
        newcomer.check()  # still the newcomer's
        newcomer.release()
        assert lease_file(fs, root).read() is None
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_nobody_releases_stops_a_contender_with_the_reason_and_the_holder_carries_on(tmp_path):
    """A process stopped while it holds the local root's lock (SIGSTOP, a frozen container; here the test
    holds it): a contender gives up after one lease period naming the folder, never hangs, and changes
    nothing; the holder's renewals wait as long, are retried, and go through once the lock is free."""
    url = str(tmp_path / "root")
    SECONDS = 2.0  # margin for a renewal (with its fsync) on a loaded machine; the contender waits this long
    fs, root = filesystem(url, {})
    holder = Lease(fs, root, url, SECONDS, Holder("holder-host", 4242, "job-h", 0))
    holder.acquire()
    try:
        fd = os.open(root, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # what a process stopped inside its renewal leaves
            before = lease_file(fs, root).read()
            with pytest.raises(LeaseError, match="held its lock .* for 2s without releasing it") as stuck:
                Lease(fs, root, url, SECONDS, Holder("other-host", 1, "job-o", 0)).acquire(poll_seconds=0.02)
            assert root in str(stuck.value) and "Nothing was changed" in str(stuck.value)
            assert lease_file(fs, root).read() == before
        finally:
            os.close(fd)  # the lock is free again
        for _ in range(3000):  # until a renewal has gone through (the holder renews every SECONDS / 4)
            try:
                holder.check()
                break
            except CheckpointError:
                time.sleep(0.01)
        holder.check()
        with pytest.raises(LeaseError, match="renewed it"):  # the holder's still, and renewing
            Lease(fs, root, url, SECONDS, Holder("other-host", 1, "job-o", 0)).acquire(poll_seconds=0.02)
    finally:
        holder.release()
    assert lease_file(fs, root).read() is None


@pytest.mark.parametrize("kind", ["local", "s3", "gs"])
def test_lease_writes_are_conditional_where_the_store_has_preconditions(kind, tmp_path, request):
    """Local disks (link, flock), S3 (If-None-Match, If-Match; moto honours both) and GCS
    (ifGenerationMatch; fake-gcs-server honours it)."""
    if kind == "local":
        url, options = str(tmp_path / "root"), {}
    else:
        server = request.getfixturevalue({"s3": "s3_server", "gs": "gcs_server"}[kind])
        url, options = f"{kind}://{server.make_bucket()}/run", server.storage_options()
    fs, root = filesystem(url, options)
    f = lease_file(fs, root)
    assert f.conditional
    v1 = f.create(b"one")
    with pytest.raises(FileExistsError):
        f.create(b"two")
    v2 = f.replace(b"three", v1)
    from trainer.checkpoint.lease import _Conflict

    with pytest.raises(_Conflict):
        f.replace(b"four", v1)  # made against a version that is gone
    f.delete(v1)  # a stale delete leaves it
    assert f.read()[0] == b"three"
    f.delete(v2)
    assert f.read() is None


def test_a_lost_lease_is_a_usage_error_not_a_crash():
    # exit 2 (never retried by gentrain launch's agent), so a restart cannot take the run back from its new holder
    from trainer.errors import ConfigError

    assert issubclass(LeaseLost, LeaseError) and issubclass(LeaseError, ConfigError)


# ------------------------------------------------------------------ the lease file is data


def _foreign(root: Path, kind: str) -> None:
    root.mkdir(parents=True)
    path = root / "lease.json"
    if kind == "fifo":
        os.mkfifo(path)  # read it blocking and the trainer waits for a writer forever
    elif kind == "link":
        path.symlink_to("/dev/zero")  # follow it and read to the end: MemoryError
    else:
        path.mkdir()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "named"), [("fifo", "a named pipe (FIFO)"), ("link", "a symbolic link"), ("dir", "a directory")]
)
def test_a_lease_file_that_is_not_a_file_exits_2_naming_it_without_opening_it(tmp_path, kind, named):
    root = root_of(tmp_path)
    _foreign(root, kind)
    r = run_cli("train", *tiny(tmp_path, max_steps=1), timeout=300)  # a hang is a failure, not a wait
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"the lease file {root / 'lease.json'} is {named}" in r.stderr and "remove it" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "step=1" not in r.stderr
    assert os.path.lexists(root / "lease.json"), "what stands there is the user's to remove"


def test_a_leases_own_lease_seconds_is_held_to_the_configs_bounds():
    from annotated_types import Le

    from trainer.checkpoint.lease import MAX_LEASE_SECONDS, _Doc
    from trainer.config.schema import CheckpointConfig

    assert MAX_LEASE_SECONDS == next(
        m.le for m in CheckpointConfig.model_fields["lease_seconds"].metadata if isinstance(m, Le)
    )
    lease = json.loads(_Doc(Holder("h", 1, "j", 0), "t", "now", 0, 30.0).to_bytes())
    for claimed, obeyed in ((999_999.0, 600.0), (0.001, 1.0), (30.0, 30.0)):
        assert _Doc.parse(json.dumps({**lease, "lease_seconds": claimed}).encode()).lease_seconds == obeyed
    for unreadable in (float("nan"), -1.0, 0.0):
        assert _Doc.parse(json.dumps({**lease, "lease_seconds": unreadable}).encode()) is None


def test_an_oversized_lease_is_read_no_further_than_a_lease_can_be_and_taken_over_as_unreadable(lease_root, caplog):
    from trainer.checkpoint.lease import MAX_LEASE_BYTES

    url, options = lease_root
    fs, root = filesystem(url, options)
    fs.makedirs(root, exist_ok=True)
    doc = json.loads(Lease(fs, root, url, 1, Holder("h", 1, "j", 0))._doc())
    # A lease that parses, padded to 1 MiB: read whole, it would name a holder who renews nothing.
    fs.pipe_file(f"{root}/lease.json", json.dumps(doc).encode() + b" " * (1 << 20))
    data, _ = lease_file(fs, root).read()
    assert len(data) == MAX_LEASE_BYTES + 1
    newcomer = Lease(fs, root, url, 1, Holder("other-host", 1, "job-o", 0))
    newcomer.acquire(poll_seconds=0.02)  # watched for its own lease_seconds, then taken over
    try:
        assert "took over the lease" in caplog.text and "from an unreadable lease" in caplog.text, caplog.text
        newcomer.check()
    finally:
        newcomer.release()
    assert lease_file(fs, root).read() is None


@pytest.mark.slow
def test_lease_false_warns_naming_a_holder_it_does_not_check(tmp_path):
    fs, root = filesystem(str(root_of(tmp_path)), {})
    held = Lease(fs, root, str(root_of(tmp_path)), 30, Holder.me("job-h", 0))
    held.acquire()  # this test process: alive, so a live holder
    try:
        r = train(tmp_path, "checkpoint.lease=false", max_steps=1)
    finally:
        held.release()
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint.lease=false, but" in r.stderr and f"pid {os.getpid()}, job job-h" in r.stderr, r.stderr[-3000:]
