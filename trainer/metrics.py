"""Prometheus exporter: every worker records, local rank 0 of each node serves all local ranks.

Workers record through prometheus_client's multiprocess mode into a directory
shared by the node's workers and fresh for each restart of the worker group
(keyed by torchrun's run id, node rank and restart count), so a restart never
double-counts: counters start again from zero, which `rate()` handles.

prometheus_client picks its multiprocess value store when it is first
imported, so `configure_multiprocess_dir` must run before anything imports it;
`trainer.cli` calls it first thing for `train`.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import tempfile
import time
from typing import Any

import torch

from trainer.elastic import DistEnv
from trainer.errors import ConfigError

log = logging.getLogger(__name__)

# Step time and data wait, seconds: tiny CPU models to multi-second GPU steps.
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def configure_multiprocess_dir(env: DistEnv, enabled: bool) -> str | None:
    """Point PROMETHEUS_MULTIPROC_DIR at this worker group's fresh directory."""
    if not enabled:
        return None
    base = os.environ.get("GENTRAIN_METRICS_DIR") or os.path.join(tempfile.gettempdir(), "gentrain-metrics")
    node_dir = os.path.join(base, f"{env.run_id}-node{env.group_rank}")
    path = os.path.join(node_dir, f"restart-{env.restart_count}" if env.run_id != "local" else f"pid-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    if env.is_local_main:
        # Older restarts of this node's worker group are dead: drop their files.
        for entry in os.listdir(node_dir):
            old = os.path.join(node_dir, entry)
            if old != path and entry.startswith("restart-"):
                shutil.rmtree(old, ignore_errors=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


def _listen_error(host: str, port: int, error: OSError) -> str:
    """What the exporter could not listen on, and what to do (a config error: exit 2, never retried)."""
    if error.errno == errno.EADDRINUSE:
        why = "the port is in use (another run or service on this machine listens there)"
        fix = "set metrics.port to a free port, or metrics.port=0 for no exporter"
    elif isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL:
        why = "the host is not a name or address of this machine"
        fix = "set metrics.host to an address of this machine (0.0.0.0: every interface; 127.0.0.1: this machine)"
    elif error.errno == errno.EACCES:
        why = "this user may not listen on that port (ports below 1024 need privileges)"
        fix = "set metrics.port to a port from 1024 up"
    else:
        why = "the address cannot be listened on"
        fix = "set metrics.host and metrics.port to an address of this machine and a free port"
    return f"metrics.host={host!r} metrics.port={port}: the Prometheus exporter cannot listen there: {why} ({error}); {fix}"


class TrainingMetrics:
    """The gentrain_* metrics; a disabled instance (metrics.port=0) records nothing."""

    def __init__(
        self,
        env: DistEnv,
        port: int,
        host: str,
        task: str,
        version: str,
        checkpoint_every_steps: int | str = 0,
        linger_seconds: float = 0.0,
    ):
        self.enabled = port > 0
        self.env = env
        self.server = None
        self.linger_seconds = linger_seconds
        self._failed_shards: set[str] = set()
        if not self.enabled:
            return
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            raise RuntimeError("configure_multiprocess_dir() must run before TrainingMetrics()")
        import functools

        import prometheus_client
        from prometheus_client import CollectorRegistry, multiprocess, start_http_server

        # Values live in the multiprocess files, which MultiProcessCollector
        # reads; registering in the global registry would only forbid a second
        # Trainer in one process (benchmarks, tests).
        Counter = functools.partial(prometheus_client.Counter, registry=None)
        Gauge = functools.partial(prometheus_client.Gauge, registry=None)
        Histogram = functools.partial(prometheus_client.Histogram, registry=None)

        self.build_info = Gauge(
            "gentrain_build_info",
            "gentrain build and task; value is 1",
            ["version", "torch", "task"],
            multiprocess_mode="max",
        )
        self.step = Gauge("gentrain_step", "Optimizer steps completed", multiprocess_mode="max")
        self.samples = Counter("gentrain_samples", "Training samples consumed (all ranks summed)")
        self.loss = Gauge(
            "gentrain_loss", "Last training loss of rank 0, by loss name", ["name"], multiprocess_mode="max"
        )
        self.lr = Gauge("gentrain_learning_rate", "Learning rate of the first part", multiprocess_mode="max")
        self.samples_per_second = Gauge(
            "gentrain_samples_per_second",
            "Training samples per second, all ranks (rank 0's step time)",
            multiprocess_mode="max",
        )
        self.flops_per_second = Gauge(
            "gentrain_achieved_flops",
            "FLOP/s rank 0 achieved in its last step (FLOPs counted once)",
            multiprocess_mode="max",
        )
        self.mfu = Gauge(
            "gentrain_mfu",
            "Rank 0's model FLOPs utilization: achieved FLOP/s over the device's peak",
            multiprocess_mode="max",
        )
        self.step_seconds = Histogram(
            "gentrain_step_duration_seconds", "Wall time of one optimizer step", buckets=_STEP_BUCKETS
        )
        self.data_wait = Histogram(
            "gentrain_data_wait_seconds", "Time waiting for the next batch", buckets=_STEP_BUCKETS
        )
        self.save_seconds = Histogram(
            "gentrain_checkpoint_save_seconds", "Time to write a checkpoint", buckets=_SAVE_BUCKETS
        )
        self.stall_seconds = Histogram(
            "gentrain_checkpoint_stall_seconds", "Training-thread time spent on a checkpoint", buckets=_SAVE_BUCKETS
        )
        self.ckpt_bytes = Gauge("gentrain_checkpoint_bytes", "Size of the last checkpoint", multiprocess_mode="max")
        self.ckpt_last = Gauge(
            "gentrain_checkpoint_last_success_timestamp_seconds",
            "Unix time of the last committed checkpoint",
            multiprocess_mode="max",
        )
        self.ckpt_failures = Counter("gentrain_checkpoint_failures", "Checkpoint saves that failed")
        self.ckpt_interval = Gauge(
            "gentrain_checkpoint_interval_steps",
            "checkpoint.every_steps of the run (for staleness alerts)",
            multiprocess_mode="max",
        )
        self.restarts = Gauge(
            "gentrain_restarts", "Worker-group restarts (TORCHELASTIC_RESTART_COUNT)", multiprocess_mode="max"
        )
        self.world_size = Gauge("gentrain_world_size", "Processes in the job", multiprocess_mode="max")
        self.skipped = Counter("gentrain_skipped_samples", "Samples skipped because they could not be read")
        # Per rank: each rank reads its own samples of a shard and gives up on it on its own, so a
        # dead shard is usually skipped by every rank; max over ranks = shards skipped by the job.
        self.skipped_shards = Counter(
            "gentrain_skipped_shards",
            "Shards this rank skipped after retries (each shard once per rank; max over ranks for the job)",
            ["rank"],
        )
        self.data_bytes = Counter(
            "gentrain_data_bytes_fetched", "Bytes read from shard storage, by kind (data | index)", ["kind"]
        )
        self.eval_fid = Gauge("gentrain_eval_fid", "FID of the last evaluation", multiprocess_mode="max")
        self.eval_kid = Gauge("gentrain_eval_kid", "KID (mean) of the last evaluation", multiprocess_mode="max")
        self.validation = Gauge(
            "gentrain_validation",
            "Named validation metrics of the task (val/<name>)",
            ["name"],
            multiprocess_mode="max",
        )
        self.resume_source = Gauge(
            "gentrain_resume_source",
            "1 for the checkpoint tier this process resumed from (memory, durable, none), 0 for the others",
            ["tier"],
            multiprocess_mode="livemax",
        )
        self.steps_lost = Counter(
            "gentrain_steps_lost",
            "Steps trained before a restart that were trained again after it (known with the memory tier on)",
        )
        self.preemptions = Counter("gentrain_preemptions", "Stops by SIGTERM/SIGINT with an emergency checkpoint")
        # Rank 0's wall time by kind (trainer.engine.goodput.KINDS), the run's: a resumed process starts from
        # the sums its checkpoint holds, so the counter is summed across restarts (a reset then a jump to them).
        self.time_seconds = Counter(
            "gentrain_time_seconds",
            "Wall time of the run by kind (train, redone, startup, compile, restore, data_wait, checkpoint_stall, "
            "eval, idle): rank 0's, summed across restarts",
            ["kind"],
        )
        self.goodput = Gauge(
            "gentrain_goodput",
            "Share of the run's wall time spent training new steps (rank 0)",
            multiprocess_mode="max",
        )
        self.nonfinite_steps = Counter(
            "gentrain_nonfinite_steps",
            "Optimizer steps not applied because their loss or gradient norm was inf or NaN (rank 0 counts the job's)",
        )
        self.device_memory = None
        if torch.cuda.is_available():
            self.device_memory = Gauge(
                "gentrain_device_memory_bytes",
                "GPU memory allocated by the node's workers",
                multiprocess_mode="livesum",
            )

        self.build_info.labels(version=version, torch=torch.__version__, task=task).set(1)
        self.restarts.set(env.restart_count)
        self.world_size.set(env.world_size)
        self.ckpt_interval.set(checkpoint_every_steps if isinstance(checkpoint_every_steps, int) else 0)
        if env.is_local_main:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            try:
                self.server, _ = start_http_server(port, addr=host, registry=registry)
            except OSError as e:  # in use, not an address of this machine, not a host name at all
                raise ConfigError(_listen_error(host, port, e)) from None
            log.info("metrics on http://%s:%d/metrics", host, port)

    def on_resume(self, step: int, checkpoint_time: float | None) -> None:
        """Start values: the resumed step, and the age of the checkpoint we start from.

        With no checkpoint yet, the start time stands in, so staleness alerts
        measure from the start of the run instead of from 1970.
        """
        if not self.enabled:
            return
        self.step.set(step)
        if self.env.is_main:
            self.ckpt_last.set(checkpoint_time or time.time())

    def on_resume_source(self, tier: str | None, steps_lost: int | None) -> None:
        """Where this process resumed from (memory, durable or none) and the steps it must train again."""
        if not self.enabled:
            return
        for name in ("memory", "durable", "none"):
            self.resume_source.labels(tier=name).set(1 if name == (tier or "none") else 0)
        if steps_lost and self.env.is_main:
            self.steps_lost.inc(steps_lost)

    def on_step(self, step: int, samples: int, data_wait: float, lr: float, skipped: int) -> None:
        """What the host knows of a step as soon as it is queued (no device value is read here)."""
        if not self.enabled:
            return
        self.step.set(step)
        self.samples.inc(samples)
        self.data_wait.observe(data_wait)
        self.lr.set(lr)
        if skipped:
            self.skipped.inc(skipped)
        if self.device_memory is not None:
            self.device_memory.set(torch.cuda.memory_allocated())

    def on_step_time(self, seconds: float, steps: int) -> None:
        """The steps since the last read took `seconds` each on average (wall time, the device's included)."""
        if not self.enabled:
            return
        for _ in range(steps):
            self.step_seconds.observe(seconds)

    def on_read(self, losses: dict[str, float], perf: dict[str, float]) -> None:
        """The newest step's values, read at the log cadence (rank 0)."""
        if not self.enabled:
            return
        for name, value in losses.items():
            self.loss.labels(name=name).set(value)
        if perf is not None:
            self.samples_per_second.set(perf["samples_per_s"])
            if "flops_per_s" in perf:
                self.flops_per_second.set(perf["flops_per_s"])
            if "mfu" in perf:
                self.mfu.set(perf["mfu"])

    def on_validation(self, values: dict[str, float]) -> None:
        if self.enabled:
            for name, value in values.items():
                self.validation.labels(name=name.removeprefix("val/")).set(value)

    def on_data_io(self, io: dict) -> None:
        """A shard source's reads for one step (bytes, and shards it gave up on; each URL counted once)."""
        if not self.enabled:
            return
        self.data_bytes.labels(kind="data").inc(io.get("data_bytes", 0))
        self.data_bytes.labels(kind="index").inc(io.get("index_bytes", 0))
        for url in io.get("failed_shards", ()):
            if url not in self._failed_shards:
                self._failed_shards.add(url)
                self.skipped_shards.labels(rank=str(self.env.rank)).inc()

    def on_eval(self, values: dict[str, float]) -> None:
        if self.enabled:
            self.eval_fid.set(values["fid"])
            self.eval_kid.set(values["kid"])

    def on_checkpoint_stall(self, stall: float) -> None:
        """Training-thread seconds spent on a save (every rank: the gather, rank 0: the snapshot/write)."""
        if self.enabled:
            self.stall_seconds.observe(stall)

    def on_checkpoint_done(self, result: Any) -> None:
        """A committed save (called by the checkpointer, from its worker thread when async)."""
        if not self.enabled:
            return
        self.save_seconds.observe(result.seconds)
        self.ckpt_bytes.set(result.total_bytes)
        self.ckpt_last.set(time.time())

    def on_checkpoint_failure(self) -> None:
        if self.enabled:
            self.ckpt_failures.inc()

    def on_nonfinite_steps(self, steps: int) -> None:
        """`steps` more steps were found not applied (read late, at the reporter's cadence; rank 0)."""
        if self.enabled and steps > 0:
            self.nonfinite_steps.inc(steps)

    def on_checkpoint_interval(self, steps: int) -> None:
        """The durable interval `checkpoint.every_steps=auto` chose."""
        if self.enabled:
            self.ckpt_interval.set(steps)

    def on_time(self, added: dict[str, float], goodput: float) -> None:
        """Seconds by kind since the last call (the first: the run's sums before this process), and the run's
        goodput now. Rank 0 only: the job's figures are its."""
        if not self.enabled or not self.env.is_main:
            return
        for kind, seconds in added.items():
            child = self.time_seconds.labels(kind=kind)  # every kind exported, 0 until it has time
            if seconds > 0:
                child.inc(seconds)
        self.goodput.set(goodput)

    def on_preemption(self) -> None:
        if self.enabled:
            self.preemptions.inc()

    def close(self) -> None:
        if not self.enabled:
            return
        from prometheus_client import multiprocess

        if self.server is not None:
            if self.linger_seconds:
                # Let the last scrape see the final step before the pod goes away.
                time.sleep(self.linger_seconds)
            self.server.shutdown()
        multiprocess.mark_process_dead(os.getpid())
