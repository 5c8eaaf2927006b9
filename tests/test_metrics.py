"""Metrics: a real Prometheus scrapes real training processes on 127.0.0.1."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import urllib.request

import pytest
from conftest import REPO, clean_env, free_port, tiny
from elastic_helpers import start_torchrun
from helpers import final_weights, kill_group, start_cli, wait_for_log, wait_until
from servers import PrometheusServer

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs Debian's prometheus (scripts/test.sh installs it)"
)

REQUIRED = [
    "gentrain_build_info",
    "gentrain_step",
    "gentrain_samples_total",
    "gentrain_loss",
    "gentrain_learning_rate",
    "gentrain_step_duration_seconds",
    "gentrain_data_wait_seconds",
    "gentrain_checkpoint_save_seconds",
    "gentrain_checkpoint_stall_seconds",
    "gentrain_checkpoint_bytes",
    "gentrain_checkpoint_last_success_timestamp_seconds",
    "gentrain_checkpoint_failures_total",
    "gentrain_restarts",
    "gentrain_world_size",
    "gentrain_skipped_samples_total",
    "gentrain_nonfinite_steps_total",
    "gentrain_preemptions_total",
    "gentrain_samples_per_second",
    "gentrain_achieved_flops",
    "gentrain_mfu",
]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def value(prom: PrometheusServer, metric: str) -> float:
    """The last value Prometheus scraped (the target is gone, so its series are marked stale)."""
    result = prom.query(f"last_over_time({metric}[5m])")
    assert len(result) == 1, (metric, result)
    return float(result[0]["value"][1])


@pytest.mark.slow
def test_prometheus_sees_steps_rise_to_the_newest_checkpoint(tmp_path):
    # The run is open-ended and stopped by SIGTERM once Prometheus has seen the step rise, so
    # the test holds on a CPU twice as fast or twice as slow; the exporter lingers until the
    # final value has been scraped.
    port = free_port()
    prom = PrometheusServer([f"127.0.0.1:{port}"], tmp_path).start()
    args = tiny(
        tmp_path,
        f"metrics.port={port}",
        "metrics.host=127.0.0.1",
        "metrics.linger_seconds=60",
        "checkpoint.every_steps=40",
        "train.log_every_steps=20",
        "train.batch_size=16",
        max_steps=1_000_000,
    )
    log = tmp_path / "train.log"
    proc = start_cli("train", *args, env=clean_env(), log_path=log)
    try:
        wait_for_log(log, "step=20/", proc)
        text = scrape(port)
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        for name in REQUIRED:
            assert re.search(rf"^{name}[{{ ]", text, re.M) or f"{name}_bucket" in text, name
        assert 'gentrain_build_info{task="ddpm"' in text or re.search(r'gentrain_build_info\{.*task="ddpm"', text)

        def rising():
            series = prom.query_range("gentrain_step", 600)
            values = [float(v) for _, v in series[0]["values"]] if series else []
            return values if len(set(values)) >= 3 else None

        values = wait_until(rising, "three different scraped values of gentrain_step")
        assert values == sorted(values)
        proc.send_signal(signal.SIGTERM)
        wait_for_log(log, "emergency checkpoint written", proc)
        newest = final_weights(f"{tmp_path}/run/checkpoints")["step"]
        assert newest >= max(values)
        # The exporter lingers: wait until Prometheus has scraped the final step.
        wait_until(lambda: prom.query("gentrain_step") and value(prom, "gentrain_step") == newest, "the final step")
        assert value(prom, "gentrain_samples_total") == newest * 16
        assert value(prom, "gentrain_checkpoint_bytes") > 0
        assert value(prom, "gentrain_world_size") == 1
        assert value(prom, "gentrain_preemptions_total") == 1
        # FLOPs counted on the first step; the CPU peak is a matmul measured on the run's threads
        text = log.read_text()
        assert re.search(r"throughput: [0-9.e+]+ GFLOP per step on this process; peak .*cpu float32 matmul", text)
        assert re.search(r"step=20/\S+ .*samples_per_s=\d+ tflops=[0-9.e+-]+ mfu=[0-9.]+ ", text)
        assert value(prom, "gentrain_mfu") > 0 and value(prom, "gentrain_samples_per_second") > 0
    finally:
        kill_group(proc)
        prom.stop()


@pytest.mark.slow
def test_two_rank_torchrun_job_reports_samples_from_both_ranks_once(tmp_path):
    port = free_port()
    prom = PrometheusServer([f"127.0.0.1:{port}"], tmp_path).start()
    steps, batch = 120, 8
    args = tiny(
        tmp_path,
        f"metrics.port={port}",
        "metrics.host=127.0.0.1",
        "metrics.linger_seconds=4",
        "train.log_every_steps=20",
        # A tracker on rank 0 only: closing it must leave the other rank's closing barrier alone (exit 0).
        "log.report_to=tensorboard",
        max_steps=steps,
    )
    rdzv = free_port()
    log = tmp_path / "torchrun.log"
    proc = start_torchrun(
        ["--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rdzv}", "--max-restarts=0"],
        args,
        log,
        GENTRAIN_METRICS_DIR=str(tmp_path / "mp"),
    )
    try:
        wait_for_log(log, "step=20/", proc, timeout=300)
        text = scrape(port)
        # Both ranks' step histograms are merged into one series by local rank 0.
        assert text.count("gentrain_step_duration_seconds_count") == 1
        assert proc.wait(timeout=400) == 0, log.read_text()[-3000:]

        # The exporter lingered after the last step; Prometheus's last scrape of it may still be landing.
        def final_step_scraped() -> bool:
            return bool(prom.query("last_over_time(gentrain_step[5m])")) and value(prom, "gentrain_step") == steps

        wait_until(final_step_scraped, "Prometheus's scrape of the final step")
        assert value(prom, "gentrain_samples_total") == steps * batch  # each rank adds its half
        assert value(prom, "gentrain_world_size") == 2
        assert value(prom, "gentrain_step") == steps
        # Each rank observed every step once.
        assert value(prom, "gentrain_step_duration_seconds_count") == 2 * steps
    finally:
        kill_group(proc)
        prom.stop()


@pytest.mark.slow
def test_prometheus_sees_the_resume_from_the_memory_tier_and_the_steps_lost(tmp_path):
    # Snapshots every 2 steps; rank 1 dies in step 10 once step 8's snapshot is in memory, so the restarted
    # workers resume from the memory tier at step 8 with step 9 completed before: 1 step lost.
    port = free_port()
    prom = PrometheusServer([f"127.0.0.1:{port}"], tmp_path).start()
    mem = tmp_path / "shm"
    args = tiny(
        tmp_path,
        "task=probe_tasks:KillableDDPM",
        f"metrics.port={port}",
        "metrics.host=127.0.0.1",
        "metrics.linger_seconds=60",
        "checkpoint.memory=true",
        "checkpoint.memory_every_steps=2",
        f"checkpoint.memory_dir={mem}",
        "checkpoint.every_steps=0",
        "train.log_every_steps=20",
        max_steps=1_000_000,
    )
    from trainer.checkpoint.memory import memory_root

    piece = f"{memory_root(str(mem), f'{tmp_path}/run/checkpoints')}/step-000000008/piece-r00000.json"
    rdzv = free_port()
    log = tmp_path / "torchrun.log"
    proc = start_torchrun(
        ["--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rdzv}", "--max-restarts=1"],
        args,
        log,
        GENTRAIN_METRICS_DIR=str(tmp_path / "mp"),
        PYTHONPATH=f"{REPO}/tests",
        PROBE_TASK_KILL="1:9",
        PROBE_TASK_KILL_AFTER=piece,
    )
    try:
        wait_for_log(log, "step=40/", proc, timeout=300)
        text = log.read_text()
        assert re.search(r"restart=1 .*resumed_from=memory:\S+step-000000008 step=8 steps_lost=1 ", text), text[-3000:]

        def scraped(metric: str) -> float | None:
            result = prom.query(metric)
            return float(result[0]["value"][1]) if result else None

        wait_until(lambda: scraped('gentrain_resume_source{tier="memory"}') == 1, "the memory tier as resume source")
        assert scraped('gentrain_resume_source{tier="durable"}') == 0
        assert scraped('gentrain_resume_source{tier="none"}') == 0
        assert scraped("gentrain_steps_lost_total") == 1
    finally:
        kill_group(proc)
        prom.stop()
