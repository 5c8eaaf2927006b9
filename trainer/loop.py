"""The Trainer: one loop for every task, on one CPU, under torchrun, or on a cluster.

Read `fit()` top to bottom: resume, then per step get a batch, run the step
(every phase's forward and backward over every chunk, then the optimizer
steps), report, then maybe stop, checkpoint, validate and preview. Each
component decides its own timing and owns its saved state; the loop never
learns a task's name.
"""

from __future__ import annotations

import json
import logging
import time
from typing import NoReturn

import torch
from accelerate import Accelerator

from trainer import __version__
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.weights import load_frozen
from trainer.config import Config, ConfigError
from trainer.data import build_splits, build_train_loader, is_video
from trainer.elastic import (
    EXIT_OK,
    DistEnv,
    StartupClock,
    StopRequest,
    agree_to_stop,
    barrier,
    exit_now,
    init_process_group,
    run_within,
)
from trainer.engine.evaluate import Evaluator
from trainer.engine.parts import build_parts
from trainer.engine.preview import Previewer
from trainer.engine.progress import TrainProgress, job_skips
from trainer.engine.report import Reporter, flat_hparams
from trainer.engine.shard import (
    build_context,
    is_fsdp,
    no_sync,
    replicate_from_rank0,
    shard_from_rank0,
    shard_module,
    whole_tensors_agree,
)
from trainer.engine.step import StepRunner, check_batch_split
from trainer.engine.validate import Validator
from trainer.hostmem import keep_freed_memory
from trainer.metrics import TrainingMetrics
from trainer.models.finetune import has_lora
from trainer.randomness import seed_everything
from trainer.registry import task_class
from trainer.tasks.base import TaskContext

log = logging.getLogger("gentrain")

__all__ = ["Trainer", "check_batch_split"]


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv | None = None):
        self.clock = StartupClock()
        self.clock.mark("imports")
        self.cfg = cfg
        self.env = env = env or DistEnv.from_environ()
        self.stop_request = StopRequest(cfg.elastic.grace_seconds, env.rank if env.world_size > 1 else None)
        t = cfg.train
        check_batch_split(t.batch_size, env.world_size, t.grad_accum)  # fail before any set-up
        if t.threads:
            torch.set_num_threads(t.threads)
        keep_freed_memory()  # no page faults for the buffers every step frees and allocates again
        seed_everything(cfg.seed)
        self.accelerator = self._start_processes()
        self.device = self.accelerator.device
        self.clock.mark("process_group")

        self.metrics = TrainingMetrics(
            env, cfg.metrics.port, cfg.metrics.host, cfg.task, __version__,
            checkpoint_every_steps=cfg.checkpoint.every_steps, linger_seconds=cfg.metrics.linger_seconds,
        )  # fmt: skip
        self.checkpoints = CheckpointManager(cfg, env, self.metrics)
        # FSDP parts are sharded across ranks: forwards (validation, previews) run on every rank together.
        self.sharded = t.parallel == "fsdp" and env.world_size > 1
        self.train_set, self.val_set, num_classes = build_splits(cfg)
        ctx = TaskContext(
            cfg.data.image_size, cfg.data.channels, cfg.seed, num_classes, cfg.checkpoint.storage_options, t.stages,
            num_frames=cfg.data.num_frames if is_video(cfg) else 1,
        )  # fmt: skip
        self.task = task_class(cfg.task)(cfg.model_cfg, ctx)
        self.parts, self.frozen = self._build_parts()
        order: dict = {"seed": cfg.seed}
        if cfg.data.source == "shards":
            order |= {"data.shard_window": cfg.data.shard_window, "data.shuffle_block": cfg.data.shuffle_block}
        self.progress = TrainProgress(
            t.batch_size, len(self.train_set), env.world_size, cfg.seed, order, cfg.data.max_skipped_fraction
        )
        frozen_records = {n: f.record for n, f in self.frozen.items()}
        self.checkpoints.attach(self.progress, self.parts, frozen_records, self.task.inputs())
        self.step_runner = StepRunner(
            self.task, self.parts, self.frozen, cfg, env.rank, env.world_size, self.device, self._no_sync
        )
        self.reporter = Reporter(
            self.accelerator, self.metrics, self.progress, t.max_steps, t.log_every_steps, cfg.name, cfg.run_dir,
            env.rank, env.world_size, env.restart_count, cfg.data.ledger,
        )  # fmt: skip
        self.validator = Validator(
            self.task, self.parts, self.frozen, self.val_set, t.val_every_steps, t.val_batches,
            self.step_runner.chunk_size, t.precision, cfg.seed, env.rank, env.world_size, self.device,
            self.reporter.on_validation, collective=self.sharded,
        )  # fmt: skip
        self.previewer = Previewer(
            self.task, self.parts, self.frozen, cfg.sample, self.val_set or self.train_set, cfg.seed, cfg.run_dir,
            env.is_main, self.device, self.reporter.on_previews, collective=self.sharded,
        )  # fmt: skip
        self.evaluator = Evaluator(
            self.task, self.parts, self.frozen, cfg, self.val_set or self.train_set, env.rank, env.world_size,
            self.device, self.reporter.on_eval,
        )  # fmt: skip
        self.evaluator.prepare()
        self.clock.mark("build")

    # ------------------------------------------------------------------ the loop

    def fit(self) -> int:
        cfg, progress = self.cfg, self.progress
        self.stop_request.install()
        self.checkpoints.resume()
        self.clock.mark("resume")
        self.metrics.on_resume(progress.step, progress.saved_time)
        self._log_start()
        batches = iter(build_train_loader(self.train_set, cfg, progress.cursor, self.env.rank, self.env.world_size))
        self.reporter.start()

        while progress.step < cfg.train.max_steps:
            t0 = time.perf_counter()
            batch = next(batches)
            t_data = time.perf_counter() - t0
            logs = self.step_runner.run(batch, progress.step)
            progress.advance(*job_skips(batch, progress, self.device))  # the job's skips, the same on every rank
            self.reporter.on_step(batch, logs, self._lr(), t_data, time.perf_counter() - t0)
            self._mark_first_step()
            progress.check_skipped()  # exit 2 on every rank at the same step when training on unreadable data

            if agree_to_stop(self.stop_request.requested, self.device):
                return self.stop_for_preemption()
            if progress.step < cfg.train.max_steps:
                self.checkpoints.maybe_save(progress.step)
                self.validator.maybe_run(progress.step)
                self.evaluator.maybe_run(progress.step)
                self.previewer.maybe_run(progress.step)
            self.checkpoints.report_background_failure()

        self.checkpoints.save(progress.step, sync=True, final=True)
        self.validator.maybe_run(progress.step, last=True)
        self.evaluator.maybe_run(progress.step, last=True)
        self.previewer.maybe_run(progress.step, last=True)
        self.close()
        self.stop_request.uninstall()
        return EXIT_OK

    def stop_for_preemption(self) -> NoReturn:
        """Emergency checkpoint, clean-up, exit 143: all within elastic.grace_seconds of the signal.

        Every wait here ends at the grace deadline: the emergency save's (see `emergency_save`), the
        clean-up's (pruning, trackers, the metrics linger, the closing barrier), and the interpreter's
        exit, which is skipped (see `exit_now`); StopRequest's deadline thread bounds the rest.
        """
        stop = self.stop_request
        code = self.checkpoints.emergency_save(self.progress.step, stop)
        run_within(stop.seconds_left(), self.close, "closing the run")
        exit_now(code)

    # ------------------------------------------------------------------ set-up

    def _start_processes(self) -> Accelerator:
        cfg, env = self.cfg, self.env
        use_cpu = not torch.cuda.is_available()
        trackers = [n for n, on in (("tensorboard", cfg.log.tensorboard), ("wandb", cfg.log.wandb)) if on]
        # The process group is ours (restart-safe store, finite timeout); accelerate reuses it.
        init_process_group(env, "gloo" if use_cpu else "nccl", cfg.elastic.collective_timeout_seconds)
        # cpu=True on CPU machines: without it accelerate reports a single
        # process under torchrun and every rank would silently train alone.
        accelerator = Accelerator(cpu=use_cpu, log_with=trackers or None, project_dir=cfg.run_dir)
        if accelerator.num_processes != env.world_size:
            raise RuntimeError(
                f"accelerate sees {accelerator.num_processes} processes but torchrun started "
                f"{env.world_size}; refusing to train ranks independently"
            )
        if trackers:
            accelerator.init_trackers(cfg.name, config=flat_hparams(cfg.to_dict()))
        return accelerator

    def _build_parts(self):
        """Frozen parts first (pinned to the resume checkpoint's sources), then the task's modules."""
        sources = self.task.frozen_sources()
        pinned = self.checkpoints.pinned_frozen_sources() if sources else None
        options = self.cfg.checkpoint.storage_options
        frozen = {n: load_frozen(n, s, options, (pinned or {}).get(n)) for n, s in sources.items()}
        with build_context(self.env.rank, self.sharded):  # FSDP: parameters on meta except on rank 0
            modules = self.task.build(frozen)
        if self.sharded:
            self._log_built_bytes(modules)
        trainable = [n for n in modules if n not in frozen]
        refusal = self.task.fsdp_refusal() if self.sharded else None
        if refusal:
            raise ConfigError(f"train.parallel=fsdp: {refusal}")
        if self.sharded and any(has_lora(modules[n]) for n in trainable):
            raise ConfigError(
                "LoRA adapters (lora: under model.*) are not supported with train.parallel=fsdp yet (a unit would "
                "mix a half-precision frozen base with fp32 adapters); use train.parallel=ddp: the adapters are small"
            )
        # Only parts this run trains are wrapped (a cascade stage outside train.stages is not).
        learns = set(self.task.learning_parts())
        t = self.cfg.train
        if self.sharded:
            if t.cpu_offload and self.device.type != "cuda":
                log.warning("train.cpu_offload=true has no effect on a CPU device; parameters already live there")

            offload = t.cpu_offload and self.device.type == "cuda"
            for name, m in modules.items():  # parts kept whole: allocated here, values from rank 0
                if name in frozen or name not in learns:
                    replicate_from_rank0(m, self.device, self.env.rank, parameters=name not in frozen)

            def wrap(m):
                return shard_from_rank0(m, t.precision, offload, self.env.rank, self.device)

            def shard_whole(m):
                return shard_module(m, t.precision, offload)

            shard_frozen = shard_whole if t.shard_frozen else None
        elif self.env.world_size > 1:
            wrap = self.accelerator.prepare_model
        else:
            wrap = lambda m: m  # noqa: E731
        if not self.sharded:
            shard_frozen = None
            if t.shard_frozen:
                log.warning("train.shard_frozen=true has no effect on one process; frozen parts stay whole")
        ema = set(self.task.ema_part_names(self.cfg.model_cfg))
        parts, frozen_parts = build_parts(
            modules, trainable, frozen, learns, self.cfg, self.device, wrap, ema, shard_frozen, self.sharded
        )
        if self.sharded:
            agree, n = whole_tensors_agree(modules.values(), self.device)
            if not agree:
                raise RuntimeError("FSDP start: the ranks hold different values in parts or buffers kept whole")
            log.info("fsdp init: %d whole tensors (kept parts, buffers) identical on every rank", n)
        return parts, frozen_parts

    def _log_built_bytes(self, modules) -> None:
        """Say how much parameter memory each rank allocated while building (FSDP: only rank 0 should)."""
        import torch.distributed as dist

        params = [p for m in modules.values() for p in m.parameters()]
        mine = sum(p.numel() * p.element_size() for p in params if not p.is_meta)
        sizes = [torch.zeros(2, dtype=torch.float64, device=self.device) for _ in range(self.env.world_size)]
        dist.all_gather(sizes, torch.tensor([float(mine), float(len(params))], dtype=torch.float64, device=self.device))
        counts = [int(t[1]) for t in sizes]
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"the task's build made {counts[0]} parameters on rank 0 but {counts} across ranks: parts built with "
                "parameters on the meta device (every rank but 0 under FSDP) lost a weight tie; tie them again after "
                "building (e.g. in the module's forward setup) or train with train.parallel=ddp"
            )
        others = max(float(t[0]) for t in sizes[1:])
        log.info(
            "fsdp init: rank 0 built the parts (%.2f MB of parameters); ranks 1-%d built them on the meta device "
            "(at most %.2f MB allocated) and take their slices from rank 0",
            float(sizes[0][0]) / 1e6, self.env.world_size - 1, others / 1e6,
        )  # fmt: skip

    def _no_sync(self, wrapped):
        """Skip the gradient reduction of a chunk that is not the step's last (DDP or FSDP2)."""
        return no_sync(wrapped) if is_fsdp(wrapped) else self.accelerator.no_sync(wrapped)

    # ------------------------------------------------------------------ small things

    def _lr(self) -> float:
        learning = [p for p in self.parts.values() if p.learning] or list(self.parts.values())
        return learning[0].lr

    def _mark_first_step(self) -> None:
        if not self.clock.finished:
            self.clock.mark("first_step", last=True)
            if self.env.is_main:
                log.info("startup timings (s): %s", json.dumps(self.clock.summary()))

    def _log_start(self) -> None:
        if not self.env.is_main:
            return
        n_params = sum(p.numel() for part in self.parts.values() for p in part.module.parameters())
        n_train = sum(p.numel() for part in self.parts.values() for p in part.params)
        n_frozen = sum(p.numel() for f in self.frozen.values() for p in f.module.parameters())
        t = self.cfg.train
        log.info(
            "gentrain %s: task=%s name=%s params=%.2fM (trainable %.2fM) frozen_params=%.2fM parts=%s device=%s world_size=%d "
            "restart=%d parallel=%s batch=%d (per rank %d, chunk %d) train_samples=%d resumed_from=%s step=%d cursor=%d "
            "checkpoints=%s",
            __version__, self.cfg.task, self.cfg.name, n_params / 1e6, n_train / 1e6, n_frozen / 1e6,
            ",".join([*(n if p.learning else f"{n}(kept)" for n, p in self.parts.items()),
                      *(f"{n}(frozen{', sharded' if is_fsdp(f.module) else ''})" for n, f in self.frozen.items())]), self.device, self.env.world_size,
            self.env.restart_count, t.parallel if self.env.world_size > 1 else "none", t.batch_size,
            self.step_runner.rank_batch, self.step_runner.chunk_size,
            len(self.train_set), self.checkpoints.resumed_from or "none (fresh start)", self.progress.step,
            self.progress.cursor, self.checkpoints.store.url,
        )  # fmt: skip
        saved = self.progress.saved_world_size
        if saved is not None and saved != self.env.world_size:
            log.info(
                "resuming a %s-rank checkpoint on %d ranks: same data cursor, reduction order changes",
                saved, self.env.world_size,
            )  # fmt: skip

    def close(self) -> None:
        self.checkpoints.close()
        self.reporter.close()
        self.metrics.close()
        barrier()
