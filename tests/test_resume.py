"""Resume is exact: a run stopped and resumed in a new process equals an uninterrupted run."""

from __future__ import annotations

import signal

from conftest import clean_env, run_cli, tiny
from helpers import assert_identical, final_weights, kill_group, start_cli, wait_for_log


def test_sigterm_then_resume_in_a_new_process_is_bit_identical(tmp_path):
    steps = 60
    straight = tmp_path / "straight"
    r = run_cli("train", *tiny(straight, "checkpoint.every_steps=0", max_steps=steps))
    assert r.returncode == 0, r.stderr[-3000:]

    broken = tmp_path / "broken"
    args = tiny(broken, "checkpoint.every_steps=0", max_steps=steps)
    log = tmp_path / "first.log"
    proc = start_cli("train", *args, env=clean_env(), log_path=log)
    try:
        wait_for_log(log, "step=10/", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, log.read_text()[-3000:]
    finally:
        kill_group(proc)
    first = log.read_text()
    assert "emergency checkpoint written" in first
    stopped = final_weights(f"{broken}/run/checkpoints")
    assert 10 <= stopped["step"] < steps

    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed_from={broken}/run/checkpoints/step-{stopped['step']:09d}" in r.stderr
    assert_identical(final_weights(f"{straight}/run/checkpoints", steps), final_weights(f"{broken}/run/checkpoints", steps))


def test_a_finished_run_restarted_does_nothing_more(tmp_path):
    args = tiny(tmp_path, max_steps=4)
    assert run_cli("train", *args).returncode == 0
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step=4 cursor=32" in r.stderr
    assert "step=5/" not in r.stderr
