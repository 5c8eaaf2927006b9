"""Reporting: progress bar or log lines, trackers (TensorBoard, W&B via accelerate), Prometheus, ledger."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import sys
from typing import TYPE_CHECKING, Any

import torch
from accelerate.tracking import get_available_trackers

from trainer.config.redact import redact
from trainer.engine.progress import TrainProgress
from trainer.errors import ConfigError
from trainer.metrics import TrainingMetrics

if TYPE_CHECKING:
    from trainer.config.schema import LogConfig
    from trainer.engine.runtime import Runtime
    from trainer.engine.throughput import Throughput

log = logging.getLogger("gentrain")

# Tracker -> (the modules accelerate's tracker writes through, any one will do; the gentrain extra).
_TRACKERS = {
    "tensorboard": (("torch.utils.tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
}


def tracker_names(log_cfg: LogConfig) -> list[str]:
    """The trackers `log.*` turns on; a ConfigError (exit 2) naming the extra when one cannot be imported.

    accelerate drops a tracker whose package it does not find (a debug line, nothing else), so a run asked
    for TensorBoard would train for days without writing a curve. Importing is the check that counts: a
    package that is found but broken (a wrong version, a missing dependency) fails here, not mid-run.
    """
    names = [n for n, on in (("tensorboard", log_cfg.tensorboard), ("wandb", log_cfg.wandb)) if on]
    for name in names:
        modules, extra = _TRACKERS[name]
        errors = []
        for module in modules:
            try:
                importlib.import_module(module)
                break
            except ImportError as e:
                errors.append(f"{module}: {' '.join(str(e).split())}")
        else:
            raise ConfigError(
                f"log.{name}=true needs the {name} package, which cannot be imported ({'; '.join(errors)}); "
                f"pip install 'gentrain[{extra}]', or set log.{name}=false"
            )
        _check_accelerate_sees(name, extra)
    return names


def _check_accelerate_sees(name: str, extra: str) -> None:
    """accelerate also wants the package's installed metadata: without it the tracker is dropped silently."""
    if name not in {str(t) for t in get_available_trackers()}:
        raise ConfigError(
            f"log.{name}=true: the {name} package imports, but accelerate does not find it installed (no package "
            f"metadata), so it would log nothing; pip install 'gentrain[{extra}]', or set log.{name}=false"
        )


def flat_hparams(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}; trackers take scalars and strings only.

    Credentials are redacted first (storage options, credential-named keys, URL passwords): a tracker's
    hparams end up in TensorBoard event files and on W&B's servers.
    """
    out: dict[str, Any] = {}
    for k, v in redact(tree).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat_hparams(v, key + "."))
        elif isinstance(v, bool | int | float | str):
            out[key] = v
        else:
            out[key] = json.dumps(v)
    return out


class Reporter:
    """Everything a step, a validation or a preview reports, to people and machines.

    Rank 0 logs (tqdm on a terminal, else `key=value` lines every
    `train.log_every_steps`) and feeds trackers; every rank feeds its own
    Prometheus store (summed or maxed by the exporter) and, with
    `data.ledger`, appends the sample indices it consumed.
    """

    def __init__(
        self,
        *,
        runtime: Runtime,
        throughput: Throughput,
        metrics: TrainingMetrics,
        progress: TrainProgress,
        max_steps: int,
        log_every_steps: int,
        name: str,
        run_dir: str,
        ledger: bool,
    ):
        self.accelerator = runtime.accelerator
        self.throughput = throughput
        self.metrics = metrics
        self.progress = progress
        self.max_steps = max_steps
        self.log_every_steps = log_every_steps
        self.name = name
        self.run_dir = run_dir
        self.rank = runtime.rank
        self.world_size = runtime.world_size
        self.restart_count = runtime.env.restart_count
        self.is_main = runtime.is_main
        self._ledger = None
        self._ledger_enabled = ledger
        self._bar = None

    def start(self) -> None:
        if self.is_main and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self.max_steps, initial=self.progress.step, desc=self.name, unit="step", dynamic_ncols=True
            )

    def on_step(self, batch: dict, logs: dict[str, float], lr: float, t_data: float, t_step: float) -> None:
        step = self.progress.step
        losses = {k.rsplit("/", 1)[0]: v for k, v in logs.items() if k.endswith("/loss")}
        perf = {"samples_per_s": self.progress.batch_size / max(t_step, 1e-9), **self.throughput.rates(t_step)}
        self.metrics.on_step(
            step,
            len(batch["positions"]),
            t_data,
            t_step,
            lr,
            losses if self.is_main else None,
            batch["skipped"],
            perf if self.is_main else None,
        )
        if "io" in batch:
            self.metrics.on_data_io(batch["io"])
        if self._ledger_enabled:
            self._write_ledger(batch)
        if not self.is_main:
            return
        if not all(math.isfinite(v) for v in logs.values()):
            log.warning("non-finite loss or grad norm at step %d: %s", step, logs)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({k: f"{v:.4f}" for k, v in logs.items() if k.endswith("loss")}, refresh=False)
        if step % self.log_every_steps == 0 or step == 1:
            self.track(step, {**logs, "lr": lr, **{f"perf/{k}": v for k, v in perf.items()}})
            if self._bar is None:
                fields = " ".join(f"{k}={v:.5f}" for k, v in logs.items())
                rates = f" tflops={perf['flops_per_s'] / 1e12:.4g}" if "flops_per_s" in perf else ""
                rates += f" mfu={perf['mfu']:.4f}" if "mfu" in perf else ""
                log.info(
                    "step=%d/%d %s lr=%.3e samples_per_s=%.0f%s data_wait_s=%.4f epoch=%d",
                    step,
                    self.max_steps,
                    fields,
                    lr,
                    perf["samples_per_s"],
                    rates,
                    t_data,
                    self.progress.epoch,
                )

    def on_validation(self, step: int, values: dict[str, float]) -> None:
        if not self.is_main:
            return
        log.info("validation step=%d %s", step, " ".join(f"{k}={v:.5f}" for k, v in values.items()))
        self.metrics.on_validation(values)
        self.track(step, values)

    def on_eval(self, step: int, values: dict[str, float]) -> None:
        if not self.is_main:
            return
        log.info("eval step=%d fid=%.4f kid=%.5f (±%.5f)", step, values["fid"], values["kid"], values["kid_std"])
        self.metrics.on_eval(values)
        self.track(step, {"eval/fid": values["fid"], "eval/kid": values["kid"]})

    def on_previews(self, step: int, previews: dict[str, torch.Tensor]) -> None:
        for tracker in self.accelerator.trackers:
            if tracker.name != "tensorboard":
                continue
            for name, media in previews.items():
                if media.ndim == 5:
                    tracker.writer.add_video(name, media, step)
                else:
                    tracker.writer.add_images(name, media, step)

    def track(self, step: int, values: dict[str, float]) -> None:
        if self.accelerator.trackers:
            self.accelerator.log(values, step=step)

    def _write_ledger(self, batch: dict) -> None:
        """Append this rank's consumed sample indices (dataset indices) for audits and tests."""
        if self._ledger is None:
            d = os.path.join(self.run_dir, "ledger")
            os.makedirs(d, exist_ok=True)
            self._ledger = open(os.path.join(d, f"rank-{self.rank}.jsonl"), "a")
        line = {
            "step": self.progress.step,
            "attempt": f"{self.restart_count}-{os.getpid()}",
            "world_size": self.world_size,
            "rank": self.rank,
            "epoch_start": (self.progress.cursor - self.progress.batch_size) // self.progress.epoch_size,
            "indices": [int(i) for i in batch["indices"].tolist()],
        }
        if "io" in batch:  # shard sources: bytes fetched by this rank for this step, and bytes it used
            line["io"] = batch["io"]
        self._ledger.write(json.dumps(line) + "\n")
        self._ledger.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._ledger is not None:
            self._ledger.close()
        if self.accelerator.trackers:
            self.accelerator.end_training()
