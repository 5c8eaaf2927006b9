"""A crash that follows from the checkpoint ends instead of being restarted forever (#47): the third identical
crash in a row from the same resume point exits 2 with the error and what to do, a crash after progress counts
from 1 again, the record it keeps is read as data only, and a store that turns read-only before the final save
ends the run in one line with the last good checkpoint kept."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import REPO, clean_env, run_cli, tiny
from helpers import wait_for_log

from trainer.checkpoint import CheckpointStore
from trainer.checkpoint.attempts import UnusableRecord, read_attempts, write_attempts
from trainer.checkpoint.validity import MAX_ATTEMPTS_BYTES, AttemptsDoc
from trainer.elastic import DistEnv
from trainer.engine.attempts import Attempts, error_signature
from trainer.errors import ConfigError, CrashLoop

ENV = clean_env(PYTHONPATH=str(REPO / "tests"))  # probe_tasks: KillableDDPM raises where PROBE_TASK_RAISE says


def train(tmp_path: Path, crash_at: int, max_steps: int) -> subprocess.CompletedProcess:
    args = tiny(tmp_path, "task=probe_tasks:KillableDDPM", "checkpoint.every_steps=2", max_steps=max_steps)
    return run_cli("train", *args, env={**ENV, "PROBE_TASK_RAISE": str(crash_at)}, timeout=600)


def record(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "checkpoints" / "attempts.json").read_text())


@pytest.mark.slow
def test_the_third_identical_crash_from_one_resume_point_exits_2_and_progress_counts_from_1_again(tmp_path):
    # Each attempt crashes computing step 5 (global step index 4), after step 4 committed: torchrun and
    # Kubernetes restart exit 1, and every restart resumed from step 4 and crashed again, forever.
    codes, outputs = [], []
    for _ in range(3):
        r = train(tmp_path, crash_at=4, max_steps=6)
        codes.append(r.returncode)
        outputs.append(r.stderr)
    assert codes == [1, 1, 2], [o[-2000:] for o in outputs]
    last = outputs[-1].strip().splitlines()[-1]
    assert last.startswith("gentrain: crash loop: this run crashed 3 times in a row"), outputs[-1][-3000:]
    assert "each time from the state of step 4" in last and "probe: a deterministic crash in step 4" in last, last
    assert "Fix the cause" in last and "attempts.json" in last, last
    assert "RuntimeError" in outputs[-1].split(last)[0]  # the traceback of the crash, logged above the line
    crash = record(tmp_path)["crash"]
    assert (crash["count"], crash["resume_step"], crash["step"]) == (3, 4, 4)
    assert crash["signature"].startswith("RuntimeError at trainer/"), crash
    assert CheckpointStore(str(tmp_path / "run" / "checkpoints")).latest_valid().step == 4  # nothing lost

    # Fixed (here: the crash moved past the next checkpoint): the run commits step 6, then crashes at the same
    # place in step 7. That is progress, so the count starts again and the orchestrator may restart it.
    r = train(tmp_path, crash_at=6, max_steps=8)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "crash 1 of 3 in a row from step 6" in r.stderr, r.stderr[-3000:]
    assert (record(tmp_path)["crash"]["count"], record(tmp_path)["crash"]["resume_step"]) == (1, 6)
    r = train(tmp_path, crash_at=6, max_steps=8)
    assert r.returncode == 1 and "crash 2 of 3 in a row from step 6" in r.stderr, r.stderr[-3000:]


def _crash(message: str) -> RuntimeError:
    """A RuntimeError raised (so it has a traceback) always from the same line."""
    try:
        raise RuntimeError(message)
    except RuntimeError as e:
        return e


def test_the_count_continues_only_from_the_same_resume_point_with_nothing_saved_and_secrets_never_reach_the_record(
    tmp_path,
):
    store = CheckpointStore(str(tmp_path / "root"))
    os.makedirs(store.root)
    run = "0123456789abcdef"
    secret = "s3cr3t-token-value"

    def attempt(resume_step, error, step, saved=None):
        a = Attempts(store, DistEnv(), secrets={secret})
        a.start(resume_step, run)
        return a.crashed(error, step, saved)

    boom = _crash(f"cannot reach https://user:{secret}@example.com/x with {secret}")
    assert attempt(None, boom, 5, saved=4) is None  # a fresh start that saved step 4: crash 1 from step 4
    text = (Path(store.root) / "attempts.json").read_text()
    assert secret not in text and "<redacted>" in text, text
    assert attempt(4, boom, 5) is None and read_attempts(store).crash.count == 2
    assert attempt(2, boom, 5) is None and read_attempts(store).crash.count == 1  # resumed elsewhere
    assert attempt(2, boom, 5) is None and read_attempts(store).crash.count == 2
    other = _crash("a different place")  # same type, same line here: the same signature, as intended
    assert error_signature(other) == error_signature(boom)
    assert attempt(2, KeyError("x"), 5) is None and read_attempts(store).crash.count == 1  # another error
    assert attempt(2, KeyError("x"), 5) is None
    loop = attempt(2, KeyError("x"), 5)
    assert isinstance(loop, CrashLoop) and "3 times in a row" in str(loop) and "from the state of step 2" in str(loop)
    assert attempt(2, ConfigError("a refusal"), 5) is None  # exit 2 already: not a crash
    assert read_attempts(store).crash.count == 3  # and nothing recorded for it


def test_the_signature_is_the_exception_type_and_its_innermost_frame_in_gentrain():
    from trainer.checkpoint.validity import parse_json

    try:
        parse_json(b"{", "x.json")
    except Exception as e:  # noqa: BLE001
        signature = error_signature(e)
    assert signature.startswith("trainer.errors.CheckpointCorrupt at trainer/checkpoint/validity.py:"), signature
    try:
        {}["missing"]
    except KeyError as e:
        assert error_signature(e).startswith("KeyError at test_crash_loops.py:")  # no gentrain frame: its own


@pytest.mark.parametrize("kind", ["fifo", "link", "directory", "too-large", "not-json", "wrong-schema"])
def test_an_attempts_record_that_is_not_one_gentrain_wrote_is_not_read_and_never_hangs(tmp_path, kind):
    store = CheckpointStore(str(tmp_path / "root"))
    os.makedirs(store.root)
    path = Path(store.root) / "attempts.json"
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"format_version": 1, "attempt": {}, "crash": None}))
    if kind == "fifo":
        os.mkfifo(path)  # opened for reading, it would block until a writer came
    elif kind == "link":
        path.symlink_to(secret)  # a record gentrain would accept, behind a link: never followed
    elif kind == "directory":
        path.mkdir()
    elif kind == "too-large":
        path.write_bytes(b" " * (MAX_ATTEMPTS_BYTES + 1))
    elif kind == "not-json":
        path.write_bytes(b"\xff{")
    else:
        path.write_text(json.dumps({"format_version": 1, "attempt": {}, "crash": {"count": "three"}}))
    outcome: list = []
    reader = threading.Thread(target=lambda: outcome.append(_read(store)), daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert outcome and isinstance(outcome[0], UnusableRecord), outcome
    if kind in ("fifo", "link"):  # and the next write replaces it (never writes through it)
        write_attempts(store, AttemptsDoc(format_version=1, attempt={"pid": 1}))
        assert read_attempts(store).attempt == {"pid": 1}
        assert json.loads(secret.read_text())["attempt"] == {}


def _read(store):
    try:
        return read_attempts(store)
    except UnusableRecord as e:
        return e


# ------------------------------------------------------------------ a store turned read-only


def _without_root_powers() -> list[str]:
    """A command prefix under which this user's permission bits hold: none for a user, and for root the
    capabilities that override them dropped (setpriv); skip where that cannot be done."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("running as root without setpriv able to drop CAP_DAC_OVERRIDE: a folder cannot be read-only")
    return prefix


@pytest.mark.slow
def test_a_store_turned_read_only_before_the_final_save_exits_2_in_one_line_keeping_the_last_checkpoint(tmp_path):
    prefix = _without_root_powers()
    root = tmp_path / "run" / "checkpoints"
    log_path = tmp_path / "train.log"
    args = tiny(tmp_path, "task=probe_tasks:KillableDDPM", "checkpoint.every_steps=2", max_steps=6)
    env = {**ENV, "PROBE_TASK_KILL": "0:4", "PROBE_TASK_KILL_SIGNAL": "STOP"}  # freezes itself in step 5
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "trainer", "train", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
    try:
        wait_for_log(log_path, "probe: stopped in step 4", proc)
        root.chmod(0o555)  # the store turns read-only: step 6, the final save, cannot be written
        proc.send_signal(signal.SIGCONT)
        code = proc.wait(timeout=600)
    finally:
        root.chmod(0o755)
        if proc.poll() is None:
            proc.kill()
    out = log_path.read_text()
    assert code == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("gentrain: store error: the final checkpoint (step 6) could not be written"), last
    assert "refuses writes" in last and "step-000000004 stays valid" in last, last
    store = CheckpointStore(str(root))
    assert store.steps() == [2, 4] and store.latest_valid(deep=True).step == 4  # the last good one kept
