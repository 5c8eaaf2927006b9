"""Reporting: progress bar or log lines, trackers (TensorBoard, W&B, MLflow via accelerate), Prometheus, ledger."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import secrets
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from accelerate.tracking import get_available_trackers

from trainer.config.redact import redact
from trainer.elastic import broadcast_object
from trainer.engine.progress import TrainProgress
from trainer.engine.step import NONFINITE
from trainer.errors import ConfigError
from trainer.media import contact_sheet, make_grid
from trainer.metrics import TrainingMetrics

if TYPE_CHECKING:
    from trainer.config.schema import LogConfig
    from trainer.engine.runtime import Runtime
    from trainer.engine.throughput import Throughput

log = logging.getLogger("gentrain")

# Tracker -> the modules accelerate's tracker writes through (any one will do). All are in the `trackers` extra.
_TRACKERS = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
}
_EXTRA = "pip install 'gentrain[trackers]'"


def tracker_names(log_cfg: LogConfig) -> list[str]:
    """The trackers `log.report_to` (and its aliases `log.tensorboard`, `log.wandb`) turns on; a ConfigError
    (exit 2) naming the extra when one asked for by name cannot be imported. `all` adds those installed.

    accelerate drops a tracker whose package it does not find (a debug line, nothing else), so a run asked
    for TensorBoard would train for days without writing a curve. Importing is the check that counts: a
    package that is found but broken (a wrong version, a missing dependency) fails here, not mid-run.
    """
    names = log_cfg.trackers
    for name in names:
        errors = _import_errors(name)
        if errors is not None:
            raise ConfigError(
                f"log.report_to names {name}, which needs the {name} package, and it cannot be imported "
                f"({'; '.join(errors)}); {_EXTRA}, or remove {name} from log.report_to"
                + (f" (log.{name}=true adds it)" if getattr(log_cfg, name, False) else "")
            )
        _check_accelerate_sees(name)
    if log_cfg.all_installed:
        seen = {str(t) for t in get_available_trackers()}
        extra = [n for n in _TRACKERS if n not in names and n in seen and _import_errors(n) is None]
        names = [n for n in _TRACKERS if n in names or n in extra]
    if "mlflow" in names:
        _check_mlflow_store()
    return names


def _import_errors(name: str) -> list[str] | None:
    """None when one of the tracker's modules imports, else why each failed."""
    errors = []
    for module in _TRACKERS[name]:
        try:
            importlib.import_module(module)
            return None
        except ImportError as e:
            errors.append(f"{module}: {' '.join(str(e).split())}")
    return errors


def _check_mlflow_store() -> None:
    """MLflow's tracking store must open: MLflow 3 defaults to `sqlite:///mlflow.db`, which mlflow-skinny
    cannot open (no SQLAlchemy), and refuses a `file://` store without MLFLOW_ALLOW_FILE_STORE. Building the
    store reaches no server (a remote one is only contacted when the run starts)."""
    try:
        from mlflow.tracking._tracking_service.utils import _get_store
    except ImportError:  # another MLflow layout: the run start will tell
        return
    try:
        _get_store()
    except Exception as e:
        import mlflow

        raise ConfigError(
            f"log.report_to names mlflow, but its tracking store {mlflow.get_tracking_uri()!r} cannot be opened "
            f"({' '.join(str(e).split())[:300]}); set MLFLOW_TRACKING_URI to a server (http://...), a database "
            "the installed MLflow can open, or file://DIR with MLFLOW_ALLOW_FILE_STORE=true"
        ) from e


def _check_accelerate_sees(name: str) -> None:
    """accelerate also wants the package's installed metadata: without it the tracker is dropped silently."""
    if name not in {str(t) for t in get_available_trackers()}:
        raise ConfigError(
            f"log.report_to names {name}: the {name} package imports, but accelerate does not find it installed "
            f"(no package metadata), so it would log nothing; {_EXTRA}, or remove {name} from log.report_to"
        )


def start_trackers(
    accelerator: Any, project: str, run_dir: str, hparams: dict[str, Any], saved: dict[str, str]
) -> dict[str, str]:
    """Start accelerate's trackers, each continuing its run from `saved` where it has one; the run ids in use.

    W&B: the id is made here at a first start (so it is known before the run exists) and passed with
    resume="allow"; `WANDB_RUN_ID` wins. MLflow makes its own ids: the one it gave at the first start is
    passed as `run_id` (if that tracking server still has it); `MLFLOW_RUN_ID` wins (accelerate reads it).
    MLflow params cannot change once logged: a resumed run gets only the keys it lacks."""
    names = {str(t) for t in accelerator.log_with}
    kwargs: dict[str, dict[str, Any]] = {}
    resumed_mlflow = False
    if "wandb" in names:
        os.makedirs(run_dir, exist_ok=True)
        run_id = os.environ.get("WANDB_RUN_ID") or saved.get("wandb") or secrets.token_hex(8)
        kwargs["wandb"] = {
            "id": run_id,
            "resume": "allow",
            "name": project,
            "dir": run_dir,
            # No system metadata: it holds the command line, where storage options may carry keys.
            "settings": {"x_disable_meta": True},
        }
    if "mlflow" in names:
        run_id = saved.get("mlflow")
        if run_id and not os.environ.get("MLFLOW_RUN_ID") and not _mlflow_run_exists(run_id):
            log.warning(
                "MLflow run %s (from the checkpoint) is not on this tracking server: starting a new one", run_id
            )
            run_id = None
        resumed_mlflow = bool(run_id or os.environ.get("MLFLOW_RUN_ID"))
        kwargs["mlflow"] = {"run_id": run_id} if run_id else {"run_name": project}
    accelerator.init_trackers(project, config=None, init_kwargs=kwargs)
    ids = {}
    for tracker in accelerator.trackers:
        if tracker.name == "mlflow":
            ids["mlflow"] = tracker.active_run.info.run_id
            _mlflow_params(ids["mlflow"], hparams, only_new=resumed_mlflow)
        else:
            tracker.store_init_configuration(hparams)
        if tracker.name == "wandb":
            ids["wandb"] = tracker.run.id
    if ids:
        log.info("tracker runs: %s", " ".join(f"{k}={v}" for k, v in sorted(ids.items())))
    return ids


def _mlflow_run_exists(run_id: str) -> bool:
    from mlflow.tracking import MlflowClient

    try:
        return MlflowClient().get_run(run_id).info.lifecycle_stage != "deleted"
    except Exception:  # MlflowException (not found), an unreachable server: a new run either way
        return False


def _mlflow_params(run_id: str, hparams: dict[str, Any], only_new: bool) -> None:
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

    client = MlflowClient()
    have = client.get_run(run_id).data.params if only_new else {}
    params = [Param(k, str(v)) for k, v in hparams.items() if k not in have and len(str(v)) <= MAX_PARAM_VAL_LENGTH]
    changed = sorted(k for k, v in hparams.items() if k in have and have[k] != str(v))
    if changed:
        log.info("MLflow keeps the first start's params; changed since: %s", ", ".join(changed))
    for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
        client.log_batch(run_id, params=params[i : i + MAX_PARAMS_TAGS_PER_BATCH])


def _grid(media: torch.Tensor) -> np.ndarray:
    """A preview as one uint8 picture (H, W) or (H, W, 3): the grid, or a video's contact sheet."""
    upscale = max(1, 64 // min(media.shape[-2:]))  # 16-pixel digits are unreadable at 1:1
    if media.ndim == 5:
        grid = make_grid(contact_sheet(media), nrow=media.shape[1], upscale=upscale)
    else:
        grid = make_grid(media, upscale=upscale)
    return grid[..., 0] if grid.shape[-1] == 1 else grid


# Previews with `captions` (sample.prompts: one prompt per row of the grid) carry them as each tracker records an
# image's text: W&B one image per row with the prompt as its caption (as diffusers' scripts log validation images),
# TensorBoard a text summary `<name>/prompts` beside the images (its images have no caption), MLflow a JSON artifact
# `samples/<name>-step-N-prompts.json` beside the keyed image (neither has one).


def _rows(captions: list[str]) -> str:
    return "\n".join(f"- row {i}: {prompt}" for i, prompt in enumerate(captions))


def _tensorboard_previews(
    tracker: Any, step: int, previews: dict[str, torch.Tensor], files: dict, captions: list[str] | None = None
) -> None:
    for name, media in previews.items():
        if media.ndim == 5:
            tracker.writer.add_video(name, media, step)
        else:
            tracker.writer.add_images(name, media, step)
        if captions:
            tracker.writer.add_text(f"{name}/prompts", _rows(captions), step)


def _wandb_previews(
    tracker: Any, step: int, previews: dict[str, torch.Tensor], files: dict, captions: list[str] | None = None
) -> None:
    import wandb

    data: dict[str, Any] = {}
    for name, media in previews.items():
        gif = next((f for f in files.get(name, []) if f.endswith(".gif")), None)
        if gif:
            data[name] = wandb.Video(gif, format="gif", caption=_rows(captions) if captions else None)
        elif captions:
            per = len(media) // len(captions)
            data[name] = [
                wandb.Image(_grid(media[i * per : (i + 1) * per]), caption=prompt) for i, prompt in enumerate(captions)
            ]
        else:
            data[name] = wandb.Image(_grid(media))
    tracker.run.log(data, step=step)


def _mlflow_previews(
    tracker: Any, step: int, previews: dict[str, torch.Tensor], files: dict, captions: list[str] | None = None
) -> None:
    from mlflow.tracking import MlflowClient

    client, run_id = MlflowClient(), tracker.active_run.info.run_id
    for name, media in previews.items():
        client.log_image(run_id, _grid(media), key=name, step=step)
        if captions:
            rows = {"step": step, "rows": len(captions), "prompts": list(captions)}
            client.log_dict(run_id, rows, f"samples/{name}-step-{step}-prompts.json")
        for path in files.get(name, []):
            if path.endswith(".gif"):
                client.log_artifact(run_id, path, artifact_path="samples")


_PREVIEWS = {"tensorboard": _tensorboard_previews, "wandb": _wandb_previews, "mlflow": _mlflow_previews}


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


def _finite(values: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in values.values())


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
        # Steps run since the values were last read: (step, logs as device tensors, lr, data wait).
        self._pending: list[tuple[int, dict[str, torch.Tensor], float, float]] = []
        self._window_start: float | None = None
        self._window_steps = 0
        self._excluded = 0.0  # seconds of checkpoints, validation and previews inside the window
        # Steps not applied: how many the metric has counted (set at `start`, after the resume: the metric counts
        # this process's), and the values read of non-finite steps, to name in the log.
        self._nonfinite_counted = 0
        self._nonfinite_values: dict[int, dict[str, float]] = {}

    def start(self) -> None:
        self._nonfinite_counted = self.progress.nonfinite_steps
        if self.is_main and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self.max_steps, initial=self.progress.step, desc=self.name, unit="step", dynamic_ncols=True
            )

    def on_step(self, batch: dict, logs: dict[str, torch.Tensor], lr: float, t_data: float, t0: float) -> None:
        """One step done (`t0`: when it started). Host-side counts are recorded now; the step's device values
        (losses, grad norms) are read only at the log cadence, all pending steps in one transfer, so the host
        never waits for the step it just queued (see `read_due`)."""
        step = self.progress.step
        if self._window_start is None:
            self._window_start = t0
        self._window_steps += 1
        self.metrics.on_step(step, len(batch["positions"]), t_data, lr, batch["skipped"])
        verdict = logs.pop(NONFINITE, None)  # every rank holds it (the same value): counted, not logged as a value
        if verdict is not None:
            self.progress.post_verdict(step, verdict)
        if "io" in batch:
            self.metrics.on_data_io(batch["io"])
        if self._ledger_enabled:
            self._write_ledger(batch)
        if self._bar is not None:
            self._bar.update(1)
        if self.is_main:
            self._pending.append((step, logs, lr, t_data))
        if self.read_due(step):
            self.read()
        else:
            self._report_nonfinite()

    def read_due(self, step: int) -> bool:
        """The steps whose values are read (and logged): every `train.log_every_steps`, the first and the last."""
        return step % self.log_every_steps == 0 or step == 1 or step == self.max_steps

    def on_other_work(self, seconds: float) -> None:
        """Checkpoints, validation, previews between steps: kept out of the step rates (only while a rate window
        is open: after a read the next window starts with the next step, after this work)."""
        if self._window_start is not None:
            self._excluded += seconds

    def read(self) -> None:
        """Read every pending step's values (one device-to-host transfer) and the steps' verdicts (counted, the
        steps not applied logged: `_report_nonfinite`), log the newest, and restart the rate window. Every rank calls it at the same steps
        (rank 0 alone holds values); it waits for the device only here."""
        now = time.perf_counter()
        steps_run = max(1, self._window_steps)
        seconds = max(now - (self._window_start or now) - self._excluded, 1e-9) / steps_run
        self._window_start, self._window_steps, self._excluded = None, 0, 0.0
        pending, self._pending = self._pending, []
        self.metrics.on_step_time(seconds, steps_run)
        if not pending:
            self._report_nonfinite(settle=True)
            return
        flat = [v for _, logs, _, _ in pending for v in logs.values()]
        numbers = iter(torch.stack([v.float() for v in flat]).tolist() if flat else [])
        rows = [(s, {k: next(numbers) for k in logs}, lr, t_data) for s, logs, lr, t_data in pending]
        self._nonfinite_values.update({s: values for s, values, _, _ in rows if not _finite(values)})
        self._report_nonfinite(settle=True)
        step, values, lr, t_data = rows[-1]
        perf = {"samples_per_s": self.progress.batch_size / seconds, **self.throughput.rates(seconds)}
        losses = {k.rsplit("/", 1)[0]: v for k, v in values.items() if k.endswith("/loss")}
        self.metrics.on_read(losses, perf)
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4f}" for k, v in values.items() if k.endswith("loss")}, refresh=False)
        self.track(step, {**values, "lr": lr, **{f"perf/{k}": v for k, v in perf.items()}})
        if self._bar is None:
            fields = " ".join(f"{k}={v:.5f}" for k, v in values.items())
            rates = f" tflops={perf['flops_per_s'] / 1e12:.4g}" if "flops_per_s" in perf else ""
            rates += f" mfu={perf['mfu']:.4f}" if "mfu" in perf else ""
            if torch.cuda.is_available() and torch.cuda.is_initialized():  # the peak since start, this rank
                rates += f" gpu_mem_gb={torch.cuda.max_memory_allocated() / 1e9:.2f}"
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

    def _report_nonfinite(self, settle: bool = False) -> None:
        """With `settle`, read every pending verdict first (TrainProgress.settle_verdicts; the reads do, which
        wait for the device anyway). Then log the steps found not applied, count them
        (gentrain_nonfinite_steps_total), then stop the run with exit 2 if too many came in a row. Every rank
        calls it at the same steps with the same verdicts, so every rank stops at the same step."""
        if settle:
            self.progress.settle_verdicts()
        total, news = self.progress.take_nonfinite()
        if self.is_main:
            for s, in_a_row in news:
                values = self._nonfinite_values.get(s)
                log.warning(
                    "step %d not applied: its loss or gradient norm is inf or NaN%s (%d in a row, %d in this run; "
                    "train.max_nonfinite_steps=%d in a row stop the run)",
                    s,
                    f" ({' '.join(f'{k}={v}' for k, v in values.items())})" if values else "",
                    in_a_row,
                    total,
                    self.progress.max_nonfinite_steps,
                )
            self.metrics.on_nonfinite_steps(total - self._nonfinite_counted)
        self._nonfinite_counted = total
        self._nonfinite_values = {}
        self.progress.check_nonfinite()

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

    def on_previews(
        self,
        step: int,
        previews: dict[str, torch.Tensor],
        files: dict[str, list[str]] | None = None,
        captions: list[str] | None = None,
    ) -> None:
        """Every tracker gets the previews: TensorBoard images (videos), W&B images (GIFs), MLflow keyed images
        (and the GIFs as artifacts). `files`: what the previewer wrote for each preview; `captions`: the prompt
        of each row (sample.prompts), recorded as each tracker takes an image's text (see `_rows`)."""
        for tracker in self.accelerator.trackers:
            try:
                _PREVIEWS[tracker.name](tracker, step, previews, files or {}, captions)
            except Exception as e:  # a tracker's hiccup costs a preview, not the run
                log.warning("previews of step %d not sent to %s: %r", step, tracker.name, e)

    def start_trackers(self, hparams: dict[str, Any], saved: dict[str, str]) -> dict[str, str]:
        """Collective: start the trackers (rank 0), continuing the runs whose ids the resumed checkpoint holds
        (`saved`, from TrainProgress.trackers); the ids now in use, on every rank, to be saved with the next
        checkpoint. A first start makes them (W&B: ours; MLflow: the server's)."""
        ids: dict[str, str] = {}
        if self.is_main and self.accelerator.log_with:
            ids = start_trackers(self.accelerator, self.name, self.run_dir, hparams, saved)
        return broadcast_object(ids) if self.world_size > 1 else ids

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
        # Not accelerator.end_training(): it also destroys the process group, on rank 0 only (where the
        # trackers are), and the other ranks' closing barrier then fails: every multi-rank run exited 1.
        for tracker in self.accelerator.trackers:
            tracker.finish()
