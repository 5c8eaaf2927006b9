"""The Trainer: one loop for every task, on one CPU, under torchrun, or on a cluster.

Read `fit()` top to bottom: resume, then per step get a batch, forward and
backward every chunk for every part that steps, optimizer step, then maybe
stop, checkpoint, validate and sample. Everything clever lives behind a
named method or in its own module.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from accelerate import Accelerator

from trainer import __version__
from trainer.checkpoint import CheckpointCorrupt, CheckpointStore
from trainer.checkpointer import Checkpointer
from trainer.config import Config, ConfigError
from trainer.data import build_splits, build_train_loader, collate, validation_refs
from trainer.elastic import (
    EXIT_OK,
    EXIT_PREEMPTED,
    DistEnv,
    StartupClock,
    StopRequest,
    agree_to_stop,
    barrier,
    broadcast_object,
    gather_objects,
    init_process_group,
)
from trainer.images import save_grid
from trainer.metrics import TrainingMetrics
from trainer.optim import Part, build_ema, build_lr_schedule, build_optimizer
from trainer.randomness import seed_everything
from trainer.state import capture_files, capture_rank_state, restore
from trainer.tasks import task_class
from trainer.tasks.base import Batch

log = logging.getLogger("gentrain")


def check_batch_split(batch_size: int, world_size: int, grad_accum: int) -> int:
    """Samples per forward chunk before micro-batching; a clear error when the split is uneven."""
    if batch_size % (world_size * grad_accum):
        ok = [w for w in range(1, 65) if batch_size % (w * grad_accum) == 0]
        raise ConfigError(
            f"train.batch_size={batch_size} cannot be split evenly over world size {world_size} x "
            f"train.grad_accum={grad_accum}. The global batch stays fixed across restarts so that no "
            f"sample is seen twice; choose a batch size divisible by {world_size * grad_accum}, or run "
            f"at a world size in {ok[:12]}."
        )
    return batch_size // (world_size * grad_accum)


def flat_hparams(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}; trackers take scalars and strings only."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_hparams(v, key + "."))
        elif isinstance(v, bool | int | float | str):
            out[key] = v
        else:
            out[key] = json.dumps(v)
    return out


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv | None = None):
        self.clock = StartupClock()
        self.clock.mark("imports")
        self.cfg = cfg
        self.env = env or DistEnv.from_environ()
        self.stop_request = StopRequest()
        t = cfg.train
        self.chunk_size = check_batch_split(t.batch_size, self.env.world_size, t.grad_accum)
        self.rank_batch = t.batch_size // self.env.world_size
        if t.threads:
            torch.set_num_threads(t.threads)
        seed_everything(cfg.seed)

        use_cpu = not torch.cuda.is_available()
        trackers = [n for n, on in (("tensorboard", cfg.log.tensorboard), ("wandb", cfg.log.wandb)) if on]
        # The process group is ours (restart-safe store, finite timeout); accelerate reuses it.
        init_process_group(self.env, "gloo" if use_cpu else "nccl", cfg.elastic.collective_timeout_seconds)
        # cpu=True on CPU machines: without it accelerate reports a single
        # process under torchrun and every rank would silently train alone.
        self.accelerator = Accelerator(cpu=use_cpu, log_with=trackers or None, project_dir=cfg.run_dir)
        self.device = self.accelerator.device
        self.clock.mark("process_group")
        if self.accelerator.num_processes != self.env.world_size:
            raise RuntimeError(
                f"accelerate sees {self.accelerator.num_processes} processes but torchrun started "
                f"{self.env.world_size}; refusing to train ranks independently"
            )

        self.train_set, self.val_set, num_classes = build_splits(cfg)
        self.task = self._build_task(num_classes)
        self.parts = self._build_parts()
        self.clock.mark("build")
        self.store = CheckpointStore(
            cfg.checkpoint_url, cfg.checkpoint.storage_options, cfg.checkpoint.keep, cfg.checkpoint.keep_every_steps
        )
        self.metrics = TrainingMetrics(
            self.env,
            cfg.metrics.port,
            cfg.metrics.host,
            cfg.task,
            __version__,
            checkpoint_every_steps=cfg.checkpoint.every_steps,
            linger_seconds=cfg.metrics.linger_seconds,
        )
        self.checkpointer = (
            Checkpointer(self.store, cfg.checkpoint.async_, on_done=self.metrics.on_checkpoint_done)
            if self.env.is_main
            else None
        )
        self.step = 0
        self.cursor = 0  # global samples consumed: the data position
        self.skipped_samples = 0
        self.resumed_from: str | None = None
        self._resumed_time: float | None = None
        self.checkpoint_failures = 0
        self._ledger = None
        if trackers:
            self.accelerator.init_trackers(cfg.name, config=flat_hparams(cfg.to_dict()))

    # ------------------------------------------------------------------ setup

    def _build_task(self, num_classes: int | None):
        cls = task_class(self.cfg.task)
        model_cfg = dict(self.cfg.model)
        if model_cfg.get("num_classes") and num_classes and model_cfg["num_classes"] != num_classes:
            raise ConfigError(f"model.num_classes={model_cfg['num_classes']} but the dataset has {num_classes} classes")
        return cls(model_cfg, self.cfg.data.image_size, self.cfg.data.channels, self.cfg.seed)

    def _build_parts(self) -> dict[str, Part]:
        parts = {}
        for name, module in self.task.build_parts().items():
            module.to(self.device)
            optimizer = build_optimizer(module, self.cfg)
            wrapped = self.accelerator.prepare_model(module) if self.env.world_size > 1 else module
            parts[name] = Part(
                name=name,
                module=module,
                wrapped=wrapped,
                optimizer=optimizer,
                lr_schedule=build_lr_schedule(optimizer, self.cfg),
                scaler=torch.amp.GradScaler(self.device.type, enabled=self.cfg.train.precision == "fp16"),
                ema=build_ema(module, self.cfg),
            )
        return parts

    # ------------------------------------------------------------------ the loop

    def fit(self) -> int:
        cfg = self.cfg
        self.stop_request.install()
        self.resume()
        self.clock.mark("resume")
        self.metrics.on_resume(self.step, self._resumed_time)
        self._log_start()
        loader = iter(build_train_loader(self.train_set, cfg, self.cursor, self.env.rank, self.env.world_size))
        progress = self._progress_bar()

        while self.step < cfg.train.max_steps:
            t0 = time.perf_counter()
            batch = next(loader)
            t_data = time.perf_counter() - t0

            losses = self.train_step(batch)
            self.step += 1
            self.cursor += cfg.train.batch_size
            self.skipped_samples += batch["skipped"]
            self._after_step(batch, losses, t_data, time.perf_counter() - t0, progress)
            if not self.clock.finished:
                self.clock.mark("first_step", last=True)
                if self.env.is_main:
                    log.info("startup timings (s): %s", json.dumps(self.clock.summary()))

            if agree_to_stop(self.stop_request.requested, self.device):
                return self.stop_for_preemption()
            if self._due(cfg.checkpoint.every_steps) and self.step < cfg.train.max_steps:
                self.save_checkpoint()
            if self._due(cfg.train.val_every_steps) and self.val_set is not None and self.step < cfg.train.max_steps:
                self.validate()
            if self._due(cfg.sample.every_steps) and self.step < cfg.train.max_steps:
                self.sample_grid()
            self._report_background_failure()

        if progress is not None:
            progress.close()
        self.save_checkpoint(sync=True)
        if self.val_set is not None and cfg.train.val_every_steps:
            self.validate()
        self.sample_grid()
        self.close()
        return EXIT_OK

    def train_step(self, batch: dict) -> dict[str, float]:
        """One optimizer step for every part the task steps now; returns losses of this rank."""
        logs: dict[str, float] = {}
        modules = {n: p.wrapped for n, p in self.parts.items()}
        chunks = list(self._chunks(batch))
        for name in self.task.parts_to_step(self.step):
            part = self.parts[name]
            part.optimizer.zero_grad(set_to_none=True)
            total = torch.zeros((), device=self.device)
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                sync = nullcontext() if last or self.env.world_size == 1 else self.accelerator.no_sync(part.wrapped)
                with sync, self._autocast():
                    per_sample, _ = self.task.loss(name, modules, chunk, self.step)
                    # Sum over this rank's samples / rank batch: DDP's mean over
                    # ranks then gives the mean over the global batch, however
                    # the batch is split into accumulation and micro chunks.
                    loss = (per_sample * chunk.valid).sum() / self.rank_batch
                part.scaler.scale(loss).backward()
                total += loss.detach()
            # One device sync per part and step, not one per chunk.
            logs[f"{name}/loss"] = float(total)
            logs[f"{name}/grad_norm"] = self._optimizer_step(part)
        return logs

    def _optimizer_step(self, part: Part) -> float:
        part.scaler.unscale_(part.optimizer)
        max_norm = self.cfg.train.max_grad_norm
        params = [p for p in part.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
        part.scaler.step(part.optimizer)
        part.scaler.update()
        part.lr_schedule.step()
        if part.ema is not None:
            part.ema.step(part.module.parameters())
        part.step += 1
        return float(norm)

    # ------------------------------------------------------------------ batches

    def _chunks(self, batch: dict):
        """Split this rank's share of the step into accumulation chunks, then micro-batches."""
        n = len(batch["positions"])
        micro = self.cfg.train.micro_batch_size or self.chunk_size
        for start in range(0, n, self.chunk_size):
            stop = min(start + self.chunk_size, n)
            for s in range(start, stop, micro):
                e = min(s + micro, stop)
                yield self._to_device(batch, s, e)

    def _to_device(self, batch: dict, s: int, e: int) -> Batch:
        dev = self.device
        return Batch(
            images=batch["images"][s:e].to(dev, non_blocking=True),
            labels=batch["labels"][s:e].to(dev, non_blocking=True),
            indices=batch["indices"][s:e],
            positions=batch["positions"][s:e],
            valid=batch["valid"][s:e].to(dev, dtype=torch.float32),
        )

    def _autocast(self):
        p = self.cfg.train.precision
        if p == "no":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.float16 if p == "fp16" else torch.bfloat16)

    # ------------------------------------------------------------------ checkpoints

    def resume(self) -> None:
        """Load the newest valid checkpoint: rank 0 picks (sha256-verified), every rank loads that step."""
        if not self.cfg.checkpoint.resume:
            return
        chosen: int | None = None
        progress = None
        if self.env.is_main:
            for info in self.store.valid_candidates():
                try:
                    progress = restore(self.store, info, self.parts, self.env.rank)
                    chosen = info.step
                    break
                except (CheckpointCorrupt, KeyError, ValueError, RuntimeError) as e:
                    log.warning("checkpoint %s cannot be loaded (%s); trying the previous one", info.url, e)
        chosen = broadcast_object(chosen)
        if chosen is None:
            return
        if not self.env.is_main:
            progress = restore(self.store, self.store.check(chosen), self.parts, self.env.rank)
        self.step = int(progress["step"])
        self.cursor = int(progress["cursor"])
        self.skipped_samples = int(progress.get("skipped_samples", 0))
        self.resumed_from = self.store.url_for(chosen)
        self._resumed_time = progress.get("time_unix")
        if progress.get("world_size") != self.env.world_size:
            log.info(
                "resuming a %s-rank checkpoint on %d ranks: same data cursor, reduction order changes",
                progress.get("world_size"),
                self.env.world_size,
            )

    def _progress_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "cursor": self.cursor,
            "epoch": self.cursor // len(self.train_set),
            "skipped_samples": self.skipped_samples,
            "world_size": self.env.world_size,
            "seed": self.cfg.seed,
            "time_unix": time.time(),
        }

    def save_checkpoint(self, sync: bool = False) -> bool:
        """Collective: every rank contributes its own state; rank 0 writes. False if it failed."""
        t0 = time.perf_counter()
        rank_states = gather_objects(capture_rank_state())
        if not self.env.is_main:
            self.metrics.on_checkpoint_stall(time.perf_counter() - t0)
            return True
        files = capture_files(self.parts, self._progress_state(), rank_states)
        meta = {
            "world_size": self.env.world_size,
            "gentrain_version": __version__,
            "torch_version": torch.__version__,
            "task": self.cfg.task,
            "config": self.cfg.to_dict(),
        }
        try:
            # The checkpointer logs the commit and reports it to the metrics itself.
            self.checkpointer.save(self.step, files, meta, sync=sync)
        except Exception as e:  # storage outage, quota, credentials: training goes on
            self._count_checkpoint_failure(e)
            if sync and self.step >= self.cfg.train.max_steps:
                raise  # the final save must not be lost silently: crash, and be retried
            return False
        self.metrics.on_checkpoint_stall(time.perf_counter() - t0)
        return True

    def _count_checkpoint_failure(self, err: BaseException) -> None:
        self.checkpoint_failures += 1
        self.metrics.on_checkpoint_failure()
        log.error(
            "checkpoint save failed (%d so far; training continues, the last committed checkpoint stays valid, "
            "the next save retries): %s",
            self.checkpoint_failures,
            err,
        )

    def _report_background_failure(self) -> None:
        if self.checkpointer is None:
            return
        err = self.checkpointer.take_failure()
        if err is not None:
            self._count_checkpoint_failure(err)

    def stop_for_preemption(self) -> int:
        """All ranks agreed to stop: write an emergency checkpoint within the grace period, exit 143."""
        grace = self.cfg.elastic.grace_seconds
        left = self.stop_request.seconds_left(grace)
        log.warning("stop requested: writing an emergency checkpoint at step %d (%.1fs of grace left)", self.step, left)
        self.metrics.on_preemption()
        done = threading.Event()
        outcome: dict[str, Any] = {}

        def work() -> None:
            try:
                if self.checkpointer is not None:
                    self.checkpointer.wait()
                outcome["ok"] = self.save_checkpoint(sync=True)
            except BaseException as e:  # reported below; exit code stays 143
                outcome["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, name="gentrain-emergency-save", daemon=True).start()
        if not done.wait(timeout=max(0.0, self.stop_request.seconds_left(grace))):
            log.error(
                "emergency checkpoint did not finish within elastic.grace_seconds=%.0f; the previous checkpoint stays valid",
                grace,
            )
            self._flush_logs()
            os._exit(EXIT_PREEMPTED)
        if outcome.get("error") or not outcome.get("ok"):
            log.error("emergency checkpoint failed: %s; the previous checkpoint stays valid", outcome.get("error"))
        else:
            log.warning("emergency checkpoint written at step %d; exiting 143", self.step)
        self.close()
        return EXIT_PREEMPTED

    # ------------------------------------------------------------------ validation and samples

    @torch.no_grad()
    def validate(self) -> float:
        """Mean per-sample loss over fixed validation batches (all ranks share the work)."""
        refs = validation_refs(
            self.val_set, max(1, self.chunk_size), self.cfg.train.val_batches, self.env.rank, self.env.world_size
        )
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        modules = {n: p.module for n, p in self.parts.items()}
        for m in modules.values():
            m.eval()
        for group in refs:
            batch = collate([self.val_set[r] for r in group])
            chunk = self._to_device(batch, 0, len(group))
            with self._autocast():
                # The first part's loss: the model's own (a GAN's generator, a cascade's base stage).
                per_sample, _ = self.task.loss(self.task.part_names[0], modules, chunk, step=-1)
            total[0] += float((per_sample.float() * chunk.valid).sum())
            total[1] += float(chunk.valid.sum())
        for m in modules.values():
            m.train()
        if self.env.world_size > 1:
            torch.distributed.all_reduce(total)
        val = float(total[0] / total[1].clamp(min=1))
        if self.env.is_main:
            log.info("validation step=%d val_loss=%.5f", self.step, val)
            self._track({"val/loss": val})
        return val

    @torch.no_grad()
    def sample_grid(self) -> str | None:
        """Rank 0 samples `sample.num` images with EMA weights into run.dir/samples/step-N.png."""
        if not self.env.is_main:
            return None
        s = self.cfg.sample
        t0 = time.perf_counter()
        with self.ema_weights(s.use_ema):
            modules = {n: p.module for n, p in self.parts.items()}
            for m in modules.values():
                m.eval()
            images = self.task.sample(
                modules,
                s.num,
                seed=self.cfg.seed,
                device=self.device,
                inference_steps=s.inference_steps,
                scheduler=s.scheduler,
                guidance_scale=s.guidance_scale,
            )
            for m in modules.values():
                m.train()
        path = os.path.join(self.cfg.run_dir, "samples", f"step-{self.step:09d}.png")
        save_grid(images, path)
        log.info("sample grid %s (%.1fs)", path, time.perf_counter() - t0)
        self._track_images(images)
        return path

    @contextmanager
    def ema_weights(self, enabled: bool = True):
        """Swap EMA weights into the modules for sampling, and back afterwards."""
        parts = [p for p in self.parts.values() if p.ema is not None] if enabled else []
        for p in parts:
            p.ema.store(p.module.parameters())
            p.ema.copy_to(p.module.parameters())
        try:
            yield
        finally:
            for p in parts:
                p.ema.restore(p.module.parameters())

    # ------------------------------------------------------------------ reporting

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def _after_step(self, batch: dict, losses: dict[str, float], t_data: float, t_step: float, progress) -> None:
        first = next(iter(self.parts.values()))
        lr = first.lr_schedule.get_last_lr()[0]
        loss_names = {k.split("/")[0]: v for k, v in losses.items() if k.endswith("/loss")}
        self.metrics.on_step(
            self.step,
            len(batch["positions"]),
            t_data,
            t_step,
            lr,
            loss_names if self.env.is_main else None,
            batch["skipped"],
        )
        if self.cfg.data.ledger:
            self._write_ledger(batch)
        if not self.env.is_main:
            return
        if not all(math.isfinite(v) for v in losses.values()):
            log.warning("non-finite loss or grad norm at step %d: %s", self.step, losses)
        if progress is not None:
            progress.update(1)
            progress.set_postfix({k: f"{v:.4f}" for k, v in losses.items() if k.endswith("loss")}, refresh=False)
        if self.step % self.cfg.train.log_every_steps == 0 or self.step == 1:
            self._track({**losses, "lr": lr})
            if progress is None:
                rate = self.cfg.train.batch_size / max(t_step, 1e-9)
                fields = " ".join(f"{k}={v:.5f}" for k, v in losses.items())
                log.info(
                    "step=%d/%d %s lr=%.3e samples_per_s=%.0f data_wait_s=%.4f epoch=%d",
                    self.step,
                    self.cfg.train.max_steps,
                    fields,
                    lr,
                    rate,
                    t_data,
                    self.cursor // len(self.train_set),
                )

    def _write_ledger(self, batch: dict) -> None:
        """Append this rank's consumed sample indices (dataset indices) for audits and tests."""
        if self._ledger is None:
            d = os.path.join(self.cfg.run_dir, "ledger")
            os.makedirs(d, exist_ok=True)
            self._ledger = open(os.path.join(d, f"rank-{self.env.rank}.jsonl"), "a")
        line = {
            "step": self.step,
            "attempt": f"{self.env.restart_count}-{os.getpid()}",
            "world_size": self.env.world_size,
            "rank": self.env.rank,
            "epoch_start": (self.cursor - self.cfg.train.batch_size) // len(self.train_set),
            "indices": [int(i) for i in batch["indices"].tolist()],
        }
        self._ledger.write(json.dumps(line) + "\n")
        self._ledger.flush()

    def _progress_bar(self):
        if not (self.env.is_main and sys.stderr.isatty()):
            return None
        from tqdm.auto import tqdm

        return tqdm(
            total=self.cfg.train.max_steps, initial=self.step, desc=self.cfg.name, unit="step", dynamic_ncols=True
        )

    def _track(self, values: dict[str, float]) -> None:
        if self.accelerator.trackers:
            self.accelerator.log(values, step=self.step)

    def _track_images(self, images: torch.Tensor) -> None:
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                tracker.writer.add_images("samples", images, self.step)

    def _log_start(self) -> None:
        if not self.env.is_main:
            return
        n_params = sum(p.numel() for part in self.parts.values() for p in part.module.parameters())
        log.info(
            "gentrain %s: task=%s name=%s params=%.2fM device=%s world_size=%d restart=%d batch=%d "
            "(per rank %d, chunk %d) train_samples=%d resumed_from=%s step=%d cursor=%d checkpoints=%s",
            __version__,
            self.cfg.task,
            self.cfg.name,
            n_params / 1e6,
            self.device,
            self.env.world_size,
            self.env.restart_count,
            self.cfg.train.batch_size,
            self.rank_batch,
            self.chunk_size,
            len(self.train_set),
            self.resumed_from or "none (fresh start)",
            self.step,
            self.cursor,
            self.store.url,
        )

    def _flush_logs(self) -> None:
        for h in logging.getLogger().handlers:
            h.flush()

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self._report_background_failure()
        if self._ledger is not None:
            self._ledger.close()
        if self.accelerator.trackers:
            self.accelerator.end_training()
        self.metrics.close()
        barrier()
