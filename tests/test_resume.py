"""Resume is exact: a run stopped and resumed in a new process equals an uninterrupted run."""

from __future__ import annotations

import signal

import pytest
from conftest import clean_env, run_cli, tiny
from helpers import assert_identical, final_weights, kill_group, start_cli, wait_for_log


@pytest.mark.slow
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

    # Another seed is another sample order: resuming under it would repeat and skip samples, so it is refused
    # (exit 2, naming the key) and the checkpoint stays as it was.
    r = run_cli("train", *args, "seed=1")
    assert r.returncode == 2 and "data order changed" in r.stderr and "seed=1" in r.stderr, r.stderr[-3000:]
    assert final_weights(f"{broken}/run/checkpoints")["step"] == stopped["step"]

    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed_from={broken}/run/checkpoints/step-{stopped['step']:09d}" in r.stderr
    assert_identical(
        final_weights(f"{straight}/run/checkpoints", steps), final_weights(f"{broken}/run/checkpoints", steps)
    )


@pytest.mark.slow
def test_a_finished_run_restarted_does_nothing_more(tmp_path):
    args = tiny(tmp_path, max_steps=4)
    assert run_cli("train", *args).returncode == 0
    r = run_cli("train", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step=4 cursor=32" in r.stderr
    assert "step=5/" not in r.stderr


# The demo's model size (~250 ms a step here): slow enough to signal mid-run reliably.
DIGITS_SIZE_MODEL = [
    "model.block_out_channels=[32,64]",
    "model.norm_num_groups=8",
    "data.image_size=16",
    "train.batch_size=64",
]


def start_long_run(tmp_path, *extra: str):
    args = tiny(tmp_path, *extra, *DIGITS_SIZE_MODEL, max_steps=100000)
    log = tmp_path / "train.log"
    return start_cli("train", *args, env=clean_env(), log_path=log), log


@pytest.mark.slow
def test_second_signal_exits_at_once(tmp_path):
    import time

    proc, log = start_long_run(tmp_path, "checkpoint.every_steps=0")
    try:
        wait_for_log(log, "step=3/", proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
    finally:
        kill_group(proc)
    assert "second signal SIGTERM, exiting now" in log.read_text()


@pytest.mark.slow
def test_emergency_save_that_cannot_finish_in_time_keeps_the_previous_checkpoint(tmp_path):
    # A digits-size model (~250 ms/step) and a grace period of 50 ms: by the time all ranks
    # agree to stop at the end of the step, there is no time left to write a checkpoint.
    proc, log = start_long_run(tmp_path, "checkpoint.every_steps=5", "elastic.grace_seconds=0.05")
    try:
        wait_for_log(log, "step-000000005", proc)
        wait_for_log(log, "step=7/", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
    finally:
        kill_group(proc)
    text = log.read_text()
    assert "did not finish within elastic.grace_seconds" in text
    assert final_weights(f"{tmp_path}/run/checkpoints")["step"] == 5


def test_a_changed_shard_order_is_refused_on_resume_and_old_checkpoints_still_load():
    from trainer.config import ConfigError
    from trainer.engine.progress import TrainProgress

    order = {"seed": 0, "data.shard_window": 8, "data.shuffle_block": 8}
    saved = TrainProgress(8, 100, 2, 0, order)
    saved.step, saved.cursor = 3, 24
    state = saved.state_dict()
    same = TrainProgress(8, 100, 1, 0, dict(order))
    same.load_state_dict(state)
    assert (same.step, same.cursor) == (3, 24)
    other = TrainProgress(8, 100, 2, 0, {**order, "data.shuffle_block": 1})
    try:
        other.load_state_dict(state)
    except ConfigError as e:
        assert "data.shuffle_block=1" in str(e) and "8" in str(e)
    else:
        raise AssertionError("a changed shuffle block resumed")
    del state["order"]  # written before the order was recorded
    other.load_state_dict(state)
    assert other.cursor == 24
