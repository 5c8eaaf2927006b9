"""Previews: sample grids, reconstructions and videos written to run.dir/samples/ by rank 0."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from trainer.config import SampleConfig
from trainer.data import collate, validation_refs
from trainer.elastic import StopRequest
from trainer.engine.parts import FrozenPart, Part, bare_modules, ema_swapped, eval_mode
from trainer.engine.step import to_device
from trainer.errors import ConfigError
from trainer.media import save_media
from trainer.models.finetune import half_weights_autocast
from trainer.tasks.base import Batch, PreviewContext, Task

if TYPE_CHECKING:
    from trainer.engine.runtime import Runtime

log = logging.getLogger("gentrain")


class Previewer:
    """Every `sample.every_steps` and at the end, rank 0 asks the task for its previews and saves them
    (under FSDP every rank computes them with it, since each forward needs every rank's shards).

    `samples/step-N.png` holds the preview named "samples"; others are
    `samples/step-N-<name>.png` (videos also `.gif`). Reconstruction previews
    get the same real held-out batch every time, so grids compare across steps.

    With `stop` (the run's StopRequest) the samplers check it between their
    steps and a stop cuts the preview short (`StopRequested`, nothing written):
    agreed by every rank under FSDP (each check is collective there), rank 0's
    alone otherwise (the others meet it in the next step's agreement).

    With `sample.prompts` (validation prompts, diffusers' --validation_prompt) each prompt is one row of
    `sample.num` previews: the task draws once per prompt with the same seed, so column k starts from the same
    noise in every row and the rows differ by their prompt alone, and at every step alike. The trackers get the
    prompts as the rows' captions (`report(..., captions)`).
    """

    def __init__(
        self,
        task: Task,
        parts: Mapping[str, Part],
        frozen: Mapping[str, FrozenPart],
        held_out,
        *,
        runtime: Runtime,
        cfg: SampleConfig,
        run_dir: str,
        report: Callable[..., None],
        stop: StopRequest | None = None,
    ):
        self.task = task
        self.parts = parts
        self.modules = bare_modules(parts, frozen)
        self.cfg = cfg
        self.held_out = held_out
        self.seed = runtime.seed
        self.dir = os.path.join(run_dir, "samples")
        self.is_main = runtime.is_main
        self.device = runtime.device
        self.report = report
        # Sharded parts need every rank in each forward: all ranks compute the (identical) previews,
        # rank 0 writes them.
        self.collective = runtime.sharded
        self.stop = stop
        self._batch: Batch | None = None
        if cfg.prompts and "prompts" not in task.sample_accepts():
            raise ConfigError(
                f"sample.prompts={cfg.prompts!r}: this {type(task).__name__} model is not conditioned on captions "
                "(it takes no prompts); unset sample.prompts"
            )

    def maybe_run(self, step: int, last: bool = False) -> list[str]:
        every = self.cfg.every_steps
        if not (self.is_main or self.collective) or not (last or (every and step % every == 0)):
            return []
        return self.run(step)

    def fixed_batch(self) -> Batch | None:
        if self._batch is None and self.held_out is not None and len(self.held_out):
            refs = validation_refs(self.held_out, self.cfg.num, 1, 0, 1)[0]
            self._batch = to_device(collate([self.held_out[r] for r in refs]), 0, len(refs), self.device)
        return self._batch

    @torch.no_grad()
    def run(self, step: int) -> list[str]:
        t0 = time.perf_counter()
        if self.is_main:
            log.info("drawing previews at step %d", step)
        check = None
        if self.stop is not None:
            check = self.stop.checker(f"preview at step {step}", self.device, collective=self.collective)
        rows = self.cfg.prompts or [None]
        contexts = [self._context(check, prompt) for prompt in rows]
        with eval_mode(self.modules), half_weights_autocast(self.modules, self.device):
            drawn = [self.task.previews(self.modules, ctx) for ctx in contexts]
        if not self.is_main:
            return []
        previews = {name: torch.cat([d[name] for d in drawn]) for name in drawn[0]}
        nrow = self.cfg.num if self.cfg.prompts else None
        files = {}
        for name, media in previews.items():
            stem = os.path.join(self.dir, f"step-{step:09d}" + ("" if name == "samples" else f"-{name}"))
            files[name] = save_media(media, stem, nrow=nrow)
        paths = [p for written in files.values() for p in written]
        log.info("sample grid %s (%.1fs)", ", ".join(paths), time.perf_counter() - t0)
        self.report(step, previews, files, captions=list(self.cfg.prompts) if self.cfg.prompts else None)
        return paths

    def _context(self, check: Callable[[], None] | None, prompt: str | None) -> PreviewContext:
        """The preview's context; with `prompt` (a `sample.prompts` entry) its row's."""
        return PreviewContext(
            batch=self.fixed_batch(),
            num=self.cfg.num,
            seed=self.seed,
            device=self.device,
            options={
                "inference_steps": self.cfg.inference_steps,
                "scheduler": self.cfg.scheduler,
                "guidance_scale": self.cfg.guidance_scale,
            },
            use_ema=self.cfg.use_ema,
            weights=lambda ema: ema_swapped(self.parts, ema),
            part_steps={n: p.step for n, p in self.parts.items()},
            between_steps=check,
            prompts=None if prompt is None else [prompt],
        )
