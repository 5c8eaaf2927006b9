"""The Trainer: one loop for every task, on one CPU, under torchrun, or on a cluster.

Read `fit()` top to bottom: resume, then per step get a batch, run the step
(every phase's forward and backward over every chunk, then the optimizer
steps), report, then maybe stop, checkpoint, validate and preview. Each
component decides its own timing and owns its saved state; the loop never
learns a task's name.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import NoReturn

import torch

from trainer import __version__
from trainer.config import Config
from trainer.config.redact import secret_values
from trainer.data import build_splits, build_train_loader
from trainer.elastic import (
    EXIT_OK,
    EXIT_PREEMPTED,
    DistEnv,
    StartupClock,
    StepWatchdog,
    StopRequest,
    StopRequested,
    barrier,
    broadcast_object,
    exit_now,
    run_within,
)
from trainer.engine.attempts import Attempts
from trainer.engine.calibrate import Calibrator
from trainer.engine.checkpoints import CheckpointManager
from trainer.engine.compile import CompileStats, apply_compile
from trainer.engine.compile_cache import RunCompileCache
from trainer.engine.evaluate import Evaluator
from trainer.engine.float8 import apply_float8
from trainer.engine.goodput import TimeLedger, goodput, one_line
from trainer.engine.parts import FrozenPart, Part, build_parts
from trainer.engine.preview import Previewer
from trainer.engine.progress import JobAgreement, TrainProgress
from trainer.engine.remat import apply_activation_checkpointing
from trainer.engine.report import Reporter, flat_hparams, tracker_names
from trainer.engine.runtime import start_runtime
from trainer.engine.shard import is_fsdp
from trainer.engine.step import StepRunner, check_batch_split
from trainer.engine.throughput import Throughput
from trainer.engine.upload import run_dir_uploader
from trainer.engine.validate import Validator
from trainer.engine.wrap import wrapping_for
from trainer.errors import ConfigError, CrashLoop
from trainer.hostmem import keep_freed_memory
from trainer.metrics import TrainingMetrics
from trainer.randomness import seed_everything
from trainer.runs import build_task, load_frozen
from trainer.tasks.base import FrozenWeights

log = logging.getLogger("gentrain")

__all__ = ["Trainer", "check_batch_split"]


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv | None = None):
        self.clock = StartupClock()
        self.clock.mark("imports")
        # Every second of this process from its start, by kind (trainer.engine.goodput): start-up until the loop.
        self.ledger = TimeLedger(self.clock.marks[0][1])
        self._time_exported: dict[str, float] = {}
        self.cfg = cfg
        env = env or DistEnv.from_environ()
        self.stop_request = StopRequest(cfg.elastic.grace_seconds, env.rank if env.world_size > 1 else None)
        # With peers, a step that hangs on a lost or silent one exits 3 for torchrun to restart (StepWatchdog).
        self.watchdog = StepWatchdog(
            self.ledger,
            cfg.elastic.step_timeout_seconds if env.world_size > 1 else 0.0,
            lambda: self.progress.step,
            env.rank if env.world_size > 1 else None,
            wait_timeout_seconds=cfg.elastic.phase_timeout_seconds if env.world_size > 1 else 0.0,
        )
        t = cfg.train
        check_batch_split(t.batch_size, env.world_size, t.grad_accum)  # fail before any set-up
        trackers = tracker_names(cfg.log)  # exit 2 now, not a run without its curves
        if t.threads:
            torch.set_num_threads(t.threads)
        keep_freed_memory()  # no page faults for the buffers every step frees and allocates again
        seed_everything(cfg.seed)
        self.runtime = runtime = start_runtime(cfg, env, trackers)
        self.clock.mark("process_group")

        self.metrics = TrainingMetrics(
            env=env,
            port=cfg.metrics.port,
            host=cfg.metrics.host,
            task=cfg.task,
            version=__version__,
            checkpoint_every_steps=cfg.checkpoint.every_steps,
            linger_seconds=cfg.metrics.linger_seconds,
        )
        self.checkpoints = CheckpointManager(cfg, runtime, self.metrics)
        self.attempts = Attempts(self.checkpoints.store, env, secret_values(cfg.to_dict()))
        try:  # a refusal while building (exit 2) gives the root's lease back: nothing of the run stays behind
            self.uploader = run_dir_uploader(cfg) if env.is_main else None
            self.train_set, self.val_set, num_classes = build_splits(cfg)
            held_out = self.val_set or self.train_set
            encoding = self.train_set.encoding  # `gentrain data encode`'s settings (EncodedSettings), or None
            self.task = build_task(cfg, num_classes=num_classes, encoding=encoding, stages=t.stages)
            self.wrapping = wrapping_for(runtime, t)
            self.parts, self.frozen = self._build_parts()
            self.progress = TrainProgress(
                batch_size=t.batch_size,
                epoch_size=len(self.train_set),
                world_size=env.world_size,
                seed=cfg.seed,
                order=self._order_keys(),
                max_skipped_fraction=cfg.data.max_skipped_fraction,
                max_nonfinite_steps=t.max_nonfinite_steps,
            )
            self.progress.ledger = self.checkpoints.ledger = self.ledger
            frozen_records = {n: f.record for n, f in self.frozen.items()}
            self.checkpoints.attach(self.progress, self.parts, frozen_records, self.task.inputs())
            self.step_runner = StepRunner(
                task=self.task,
                parts=self.parts,
                frozen=self.frozen,
                cfg=cfg,
                runtime=runtime,
                no_sync=self.wrapping.no_sync,
            )
            self.throughput = Throughput(self.device, t.precision, t.tf32)
            self.reporter = Reporter(
                runtime=runtime,
                throughput=self.throughput,
                metrics=self.metrics,
                progress=self.progress,
                max_steps=t.max_steps,
                log_every_steps=t.log_every_steps,
                name=cfg.name,
                run_dir=cfg.run_dir,
                ledger=cfg.data.ledger,
            )
            self.validator = Validator(
                self.task,
                self.parts,
                self.frozen,
                self.val_set,
                runtime=runtime,
                every_steps=t.val_every_steps,
                batches=t.val_batches,
                chunk_size=self.step_runner.chunk_size,
                report=self.reporter.on_validation,
                stop=self.stop_request,
            )
            self.previewer = Previewer(
                self.task,
                self.parts,
                self.frozen,
                held_out,
                runtime=runtime,
                cfg=cfg.sample,
                run_dir=cfg.run_dir,
                report=self.reporter.on_previews,
                stop=self.stop_request,
            )
            self.calibrator = Calibrator(
                self.task,
                self.parts,
                self.frozen,
                self.train_set,
                runtime=runtime,
                every_steps=self.checkpoints.every_steps,  # run by the loop when a durable save is due
                chunk_size=self.step_runner.chunk_size,
            )
            self.evaluator = Evaluator(
                self.task,
                self.parts,
                self.frozen,
                held_out,
                runtime=runtime,
                cfg=cfg,
                report=self.reporter.on_eval,
                stop=self.stop_request,
            )
            self.evaluator.prepare()
            self.clock.mark("build")
        except BaseException:
            self.checkpoints.release_lease()
            raise

    @property
    def env(self) -> DistEnv:
        return self.runtime.env

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    # ------------------------------------------------------------------ the loop

    def fit(self) -> int:
        try:
            return self._fit()
        except BaseException as e:  # a refusal (exit 2) or a crash: the next launch need not wait for the lease
            self.watchdog.stop()  # the way out of a crash is no hung step: the crash's exit code stands
            loop = self._record_crash(e)
            self.checkpoints.release_lease()
            if loop is not None:  # the same crash a third time: exit 2, not another restart
                log.error("the crash, as in the attempts before this one:", exc_info=e)
                raise loop from None
            raise

    def _record_crash(self, error: BaseException) -> CrashLoop | None:
        """Record a crash in the run's attempts (trainer.engine.attempts); the CrashLoop to raise instead when it
        is the third in a row. Never raises: the crash itself is what the process exits with."""
        try:
            return self.attempts.crashed(error, self.progress.step, self.checkpoints.saved_step)
        except Exception as e:  # noqa: BLE001 - bookkeeping on the way out
            log.warning("could not record the crash in the run's attempts: %s", e)
            return None

    def _fit(self) -> int:
        cfg, progress = self.cfg, self.progress
        self.stop_request.install()
        self.watchdog.start()
        ledger = self.ledger
        ledger.switch("restore")
        self.checkpoints.resume()
        ledger.switch("startup")
        resumed = progress.step if self.checkpoints.resumed_from is not None else None
        self.attempts.start(resumed, self.checkpoints.store.timeline.run)  # counts crashes from here on
        self._continue_goodput(resumed)
        # After the resume: a restarted or resumed job continues the tracker runs its checkpoint names.
        progress.trackers = self.reporter.start_trackers(flat_hparams(cfg.to_dict()), progress.trackers)
        self.clock.mark("resume")
        self.metrics.on_resume(progress.step, progress.saved_time)
        self.metrics.on_resume_source(self.checkpoints.resumed_tier, self.checkpoints.steps_lost(progress.step))
        self._log_start()
        env = self.env
        loader = build_train_loader(
            self.train_set, cfg, cursor=progress.cursor, rank=env.rank, world_size=env.world_size, device=self.device
        )
        batches = iter(loader)
        self.reporter.start()
        if progress.flops_per_sample is not None:  # counted by an earlier process of this run
            self.throughput.set_flops_per_step(progress.flops_per_sample * progress.batch_size / env.world_size)
        compile_pending = cfg.train.compile and env.is_main
        agreement = self.agreement = JobAgreement(self.device)
        first_step = True
        schedule = self.checkpoints.schedule
        schedule.start(progress.step)

        while progress.step < cfg.train.max_steps:
            t0 = time.perf_counter()
            ledger.switch("data_wait")
            batch = next(batches)
            t_data = time.perf_counter() - t0
            ledger.switch(ledger.step_kind(progress.step))
            # FLOPs, once per run, at the second step this process runs (the first one has moved what libraries
            # keep on the device, a scheduler's tables, which a count before it would leave fake). A compiled run
            # counts on fake tensors before it: a counted step runs eagerly, with an eager step's memory. An eager
            # run counts the step itself, as does one whose shapes fake tensors cannot run: the dispatch mode costs
            # that one step little, where fake tensors cost seconds (1-2 s for the test suite's tiny UNet on CPU,
            # at every process that starts a run).
            timed = not first_step and self.throughput.flops_per_step is not None  # a step's time, nothing else
            if self.throughput.flops_per_step is None and not first_step and cfg.train.compile:
                self._record_flops(functools.partial(self.step_runner.count_flops, batch, progress.step))
            counting = self.throughput.flops_per_step is None and not first_step
            with self.throughput.counting() if counting else contextlib.nullcontext():
                logs = self.step_runner.run(batch, progress.step)
            if counting:
                self._record_flops(lambda: self.throughput.flops_per_step)
            elif compile_pending:  # the first compiled step (a step counted for real runs eagerly)
                compile_pending = False
                compiled = CompileStats.now()
                ledger.take("compile", compiled.seconds)  # the step's compiling, not its training
                log.info("%s", compiled.line())
                if self.compile_cache is not None:
                    self.compile_cache.save_once()
            first_step = False
            progress.advance()
            stop = self._settle(agreement.post(self.stop_request.requested, batch))
            self.reporter.on_step(batch, logs, self._lr(), t_data, t0)
            self._mark_first_step()
            if timed:  # not a process's first step (it compiles, warms up), nor one that counted FLOPs
                schedule.on_step_time(time.perf_counter() - t0)
                self.watchdog.on_step(time.perf_counter() - t0)  # steady state: the watchdog is armed
            ledger.switch("idle")

            if stop or self._saves_at(progress.step):  # the progress to save holds every settled skip
                stop = self._settle(agreement.drain()) or stop
            if stop:
                self.reporter.read()
                return self.stop_for_preemption()
            if progress.step < cfg.train.max_steps:
                t_other = time.perf_counter()
                durable = self.checkpoints.durable_due(progress.step)
                if durable:
                    self.calibrator.run()  # before the save: it holds what was measured
                ledger.switch("checkpoint_stall")
                self.checkpoints.maybe_save(progress.step)
                ledger.switch("eval")
                try:  # a stop cuts these short; one that every rank agreed on stops the run at this step
                    self.validator.maybe_run(progress.step)
                    self.evaluator.maybe_run(progress.step)
                    self.previewer.maybe_run(progress.step)
                except StopRequested as cut:
                    if cut.agreed:
                        self._settle(agreement.drain())
                        self.reporter.read()
                        return self.stop_for_preemption()
                ledger.switch("idle")
                if self.uploader is not None and durable:
                    self.uploader.sync_in_background()
                self.reporter.on_other_work(time.perf_counter() - t_other)
                self._decide_intervals(progress.step, durable)
            self.checkpoints.report_background_failure()
            self._export_time()

        if self._settle(agreement.drain()):
            self.reporter.read()
            return self.stop_for_preemption()
        self.calibrator.run()
        ledger.switch("checkpoint_stall")
        ledger.clean_stop = True  # the next process resuming from this checkpoint follows no failure
        self.checkpoints.save(progress.step, sync=True, final=True)
        ledger.switch("eval")
        try:
            self.validator.maybe_run(progress.step, last=True)
            self.evaluator.maybe_run(progress.step, last=True)
            self.previewer.maybe_run(progress.step, last=True)
        except StopRequested:  # the final checkpoint is committed: close within the grace, exit 143
            run_within(self.stop_request.seconds_left(), self.close, "closing the run")
            exit_now(EXIT_PREEMPTED)
        ledger.switch("idle")
        self.close()
        self.watchdog.stop()
        self.stop_request.uninstall()
        return EXIT_OK

    def _settle(self, agreed: list[tuple[bool, int, list[str]]]) -> bool:
        """Apply the job's agreed skips of the steps now settled; True if any rank was asked to stop. Exit 2
        on every rank at the same step when the run is training on unreadable data."""
        for _, skipped, files in agreed:
            self.progress.add_skipped(skipped, files)
        self.progress.check_skipped()
        return any(stop for stop, _, _ in agreed)

    def _saves_at(self, step: int) -> bool:
        """Whether a checkpoint (durable or memory tier) is written after `step`: its progress must hold every
        skip of its steps, so the agreement is settled first."""
        return self.checkpoints.saves_at(step)

    def _record_flops(self, count: Callable[[], int | None]) -> None:
        """`count()` (on fake tensors, or the count the step just taken holds), logged with the device's peak (a
        CPU's is measured here) and saved with the progress: all off the step's time (idle in the ledger, other
        work for the step rates)."""
        t0 = time.perf_counter()
        kind = self.ledger.switch("idle")
        flops = count()
        if flops is not None:
            self.throughput.set_counted(flops)
            self.progress.flops_per_sample = flops * self.env.world_size / self.progress.batch_size
        self.ledger.switch(kind)
        self.reporter.on_other_work(time.perf_counter() - t0)

    def stop_for_preemption(self) -> NoReturn:
        """Emergency checkpoint, clean-up, exit 143: all within elastic.grace_seconds of the signal.

        Every wait here ends at the grace deadline: the emergency save's (see `emergency_save`), the
        clean-up's (pruning, trackers, the metrics linger, the closing barrier), and the interpreter's
        exit, which is skipped (see `exit_now`); StopRequest's deadline thread bounds the rest.
        """
        stop = self.stop_request
        self.ledger.switch("checkpoint_stall")
        self.ledger.clean_stop = True  # a stop, not a failure: the next process resuming from it counts none
        code = self.checkpoints.emergency_save(self.progress.step, stop)
        self.ledger.switch("idle")
        run_within(stop.seconds_left(), self.close, "closing the run")
        exit_now(code)

    # ------------------------------------------------------------------ set-up

    def _order_keys(self) -> dict:
        """The config keys the sample order is a function of (a resume must not change them)."""
        data = self.cfg.data
        order: dict = {"seed": self.cfg.seed}
        if data.source == "shards":
            order |= {"data.shard_window": data.shard_window, "data.shuffle_block": data.shuffle_block}
        order |= getattr(self.train_set, "order_keys", dict)()  # aspect-ratio buckets: their assignment's digest
        return order

    def _compile_cache(self) -> RunCompileCache | None:
        """The run's compile cache on its checkpoint store (trainer.engine.compile_cache), restored by each
        node's local rank 0 before the wrapper's first collective (DDP's and FSDP2's broadcast of the weights),
        so no rank of the node compiles, at its first step, before the folder is whole."""
        store = self.checkpoints.store
        t = self.cfg.train
        graphs = ("precision", "parallel", "cpu_offload", "activation_checkpointing", "float8", "micro_batch_size")
        what = {"model": self.cfg.model_cfg.model_dump(mode="json"), **{k: getattr(t, k, None) for k in graphs}}
        cache = RunCompileCache.for_run(store.fs, store.root, self.runtime.device, what)
        if cache is not None and self.env.is_local_main:
            cache.restore_if_empty()
        return cache

    def _build_parts(self) -> tuple[dict[str, Part], dict[str, FrozenPart]]:
        """Frozen parts first (pinned to the resume checkpoint's sources), then the task's modules, wrapped
        for the process layout (one process, DDP or FSDP: see trainer.engine.wrap)."""
        wrapping = self.wrapping
        frozen = self._load_frozen()
        with wrapping.build_context():
            try:
                modules = self.task.build(frozen)
            except (torch.OutOfMemoryError, RuntimeError) as e:
                # Sizes a config allows can still exceed the machine: torch's allocators say so in these words.
                if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                    raise
                raise ConfigError(
                    f"the {self.cfg.task} model this config describes does not fit in memory on "
                    f"{self.runtime.device}: {str(e).splitlines()[0][:300]}; give smaller model.* sizes"
                ) from None
        wrapping.check_built(modules)
        trainable = [n for n in modules if n not in frozen]
        wrapping.check_supported(self.task, modules, trainable)
        # Only parts this run trains are wrapped (a cascade stage outside train.stages is not).
        learning = set(self.task.learning_parts())
        apply_float8(modules, learning, self.cfg.train.float8, self.runtime.device, self.cfg.task)
        # Restored before the wrapper's first collective, which every rank waits at (see _compile_cache).
        self.compile_cache = self._compile_cache() if self.cfg.train.compile else None
        wrapping.prepare(modules, frozen=frozen, learning=learning)
        apply_activation_checkpointing(modules, learning, self.cfg.train.activation_checkpointing, self.cfg.task)
        if self.cfg.train.compile:
            apply_compile(modules, learning, self.cfg.task)
        parts, frozen_parts = build_parts(
            modules,
            frozen=frozen,
            learning=learning,
            cfg=self.cfg,
            device=self.runtime.device,
            wrapping=wrapping,
            ema_names=set(self.task.ema_part_names(self.cfg.model_cfg)),
            fence=self.checkpoints.fence,
        )
        wrapping.check_started(modules)
        return parts, frozen_parts

    def _load_frozen(self) -> dict[str, FrozenWeights]:
        """The frozen parts' weights; on a resume, the ones the checkpoint recorded (by digest)."""
        sources = self.task.frozen_sources()
        urls = {n: s.url for n, s in sources.items()}
        pinned = (self.checkpoints.pinned_frozen_sources(urls) if sources else None) or {}
        options = self.cfg.checkpoint.storage_options
        return {n: load_frozen(n, s, options, pinned.get(n)) for n, s in sources.items()}

    # ------------------------------------------------------------------ small things

    def _lr(self) -> float:
        learning = [p for p in self.parts.values() if p.learning] or list(self.parts.values())
        return learning[0].lr

    def _mark_first_step(self) -> None:
        if not self.clock.finished:
            self.clock.mark("first_step", last=True)
            if self.env.is_main:
                # `compile`: seconds dynamo spent compiling before the first step ended (inside first_step).
                compiled = round(CompileStats.now().seconds, 3) if self.cfg.train.compile else 0.0
                log.info("startup timings (s): %s", json.dumps({**self.clock.summary(), "compile": compiled}))

    # ------------------------------------------------------------------ time accounting (trainer.engine.goodput)

    def _continue_goodput(self, resumed: int | None) -> None:
        """After the resume: continue the run's time sums from the checkpoint, count a failure if this process
        follows one, and mark the steps it trains again (up to the newest step the job had reached: the memory
        tier's record, or the step attempts.json recorded for a crash from this resume point)."""
        crash = self.attempts.streak  # a CrashRecord (trainer.checkpoint.validity), None if none
        reached = [self.progress.step, self.checkpoints.steps_reached, crash.step if crash is not None else None]
        self.ledger.redo_until = max(s for s in reached if isinstance(s, int) and not isinstance(s, bool))
        crashes = crash.count if crash is not None else 0
        saved = self.progress.saved_goodput if resumed is not None else None
        self.ledger.continue_from(saved, resumed is not None, crashes)

    def _export_time(self) -> None:
        """The run's seconds by kind to Prometheus (what was added since the last call) and its goodput."""
        if not self.metrics.enabled:
            return
        now = self.ledger.run_seconds()
        added = {k: v - self._time_exported.get(k, 0.0) for k, v in now.items()}
        self._time_exported = now
        self.metrics.on_time(added, goodput(now))

    def _decide_intervals(self, step: int, durable: bool) -> None:
        """`auto` intervals: at the steps every rank knows to decide at, rank 0 decides from what it measured and
        every rank takes its decision (one broadcast), so every rank saves at the same steps."""
        schedule = self.checkpoints.schedule
        if not schedule.decides_at(step, durable):
            return
        decision = None
        if self.env.is_main:
            run = self.ledger.run_seconds()
            decision = schedule.decide(sum(run.values()) / 3600.0, self.ledger.failures)
        schedule.apply(broadcast_object(decision))
        if schedule.auto_durable:
            self.metrics.on_checkpoint_interval(schedule.every_steps)

    def _report_time(self) -> None:
        """The final accounting: this process's seconds by kind and the run's (rank 0's log), and the metrics."""
        try:
            self._export_time()
            if not self.env.is_main:
                return
            mine, run = self.ledger.process_seconds(), self.ledger.run_seconds()
            log.info("time of this process (s): %s goodput=%.4f", one_line(mine), goodput(mine))
            record = self.ledger.record()
            log.info(
                "time of the run (s, %d process(es), %d failure(s)): %s goodput=%.4f",
                record["processes"],
                record["failures"],
                one_line(run),
                goodput(run),
            )
        except Exception as e:  # noqa: BLE001 - accounting never fails a run on its way out
            log.warning("could not report the run's time accounting: %s", e)

    def _log_start(self) -> None:
        if not self.env.is_main:
            return
        r, t, progress, steps = self.runtime, self.cfg.train, self.progress, self.step_runner
        n_params = sum(p.numel() for part in self.parts.values() for p in part.module.parameters())
        n_train = sum(p.numel() for part in self.parts.values() for p in part.params)
        n_frozen = sum(p.numel() for f in self.frozen.values() for p in f.module.parameters())
        kept = [n if p.learning else f"{n}(kept)" for n, p in self.parts.items()]
        frozen = [f"{n}(frozen{', sharded' if is_fsdp(f.module) else ''})" for n, f in self.frozen.items()]
        fields = {
            "task": self.cfg.task,
            "name": self.cfg.name,
            "params": f"{n_params / 1e6:.2f}M (trainable {n_train / 1e6:.2f}M)",
            "frozen_params": f"{n_frozen / 1e6:.2f}M",
            "parts": ",".join([*kept, *frozen]),
            "device": r.device,
            "world_size": r.world_size,
            "restart": r.env.restart_count,
            "parallel": r.parallel,
            "batch": f"{t.batch_size} (per rank {steps.rank_batch}, chunk {steps.chunk_size})",
            "train_samples": len(self.train_set),
            "resumed_from": self.checkpoints.resumed_from or "none (fresh start)",
            "step": progress.step,
            **({"steps_lost": lost} if (lost := self.checkpoints.steps_lost(progress.step)) is not None else {}),
            "cursor": progress.cursor,
            "checkpoints": self.checkpoints.store.url,
        }
        log.info("gentrain %s: %s", __version__, " ".join(f"{k}={v}" for k, v in fields.items()))
        saved = progress.saved_world_size
        if saved is not None and saved != r.world_size:
            log.info(
                "resuming a %s-rank checkpoint on %d ranks: same data cursor, reduction order changes",
                saved,
                r.world_size,
            )

    def close(self) -> None:
        self.ledger.switch("checkpoint_stall")  # waiting for a background save to finish
        self.checkpoints.close()
        self.ledger.switch("idle")
        self._report_time()
        self.reporter.close()
        if self.uploader is not None:
            self.uploader.close()  # after the trackers: their last writes go along
        self.metrics.close()
        barrier()
