"""A test-only task that uses every part of the Task interface the next tasks need.

`probe_tasks:GanProbeTask` (a task named by import path) has
- a frozen `encoder`: a DDPM run's UNet, loaded from that run's checkpoint URL;
- a `generator` that reconstructs images from the image plus the encoder's
  output, with dropout (draws from the global RNG);
- a `discriminator` with its own optimizer settings (`optim.discriminator.*`),
  trained in a second phase from `model.disc_start_step` on, on detached
  reconstructions, and called bare with gradients off in the generator phase.

`PROBE_TASK_KILL=RANK:STEP` makes that rank SIGKILL itself in the middle
of global step STEP on the first attempt, so tests kill at an exact point
instead of racing a running job (`PROBE_TASK_KILL_SIGNAL=TERM` sends SIGTERM
instead). `KillableVQGAN`, `KillableMaskGIT`, `KillableVideoTokenizer`,
`KillableVideoMaskGIT`, `KillableAutoencoder` and `KillableDDPM` are the real tasks plus that switch.

`PROBE_TASK_RAISE=STEP` raises a RuntimeError in global step STEP on every attempt, on every rank: a crash
that follows from the checkpoint, as a bad sample or a bug would (tests/test_crash_loops.py).

`PROBE_TASK_OVERLAP=1` holds every background snapshot copy until the
training thread reaches a fence or an optimizer step has completed (see
`hold_snapshot_copies`): the copy then always overlaps the next step's
forward and backward, and a missing fence shows as a failed or different
checkpoint instead of passing by luck.
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import time
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from trainer.registry import task_class
from trainer.tasks.autoencoder import AutoencoderTask
from trainer.tasks.base import Batch, FrozenSource, Loss, Phase, PreviewContext, StepInfo, Task
from trainer.tasks.ddpm import DDPMTask
from trainer.tasks.maskgit import MaskGITTask
from trainer.tasks.video_maskgit import VideoMaskGITTask
from trainer.tasks.video_tokenizer import VideoTokenizerTask
from trainer.tasks.vqgan import VQGANTask


def maybe_die(step: int) -> None:
    """SIGKILL this process in global step STEP on rank RANK (`PROBE_TASK_KILL=RANK:STEP`; RANK `*`: any rank
    that has the variable, e.g. every worker of one torchrun agent), on the first attempt only
    (`PROBE_TASK_KILL_ATTEMPT=N`: on torchrun's restart N instead; `*`: on whichever attempt gets there, for
    a node whose agent may count a restart of its own when another node's worker dies first).

    With `PROBE_TASK_KILL_AFTER=PATH` it first waits (up to 120 s) for PATH to exist: a background
    (async) save's manifest, so the kill lands after that checkpoint committed, whatever the speed. PATH
    may be a glob; `PROBE_TASK_KILL_AFTER_COUNT=N` waits for N matches. `PROBE_TASK_KILL_SIGNAL=STOP`
    freezes the process instead, after printing "probe: stopped in step STEP" (a node that hangs).
    """
    crash_at = os.environ.get("PROBE_TASK_RAISE")
    if crash_at is not None and step == int(crash_at):
        raise RuntimeError(f"probe: a deterministic crash in step {step}")
    kill = os.environ.get("PROBE_TASK_KILL")
    attempt = os.environ.get("PROBE_TASK_KILL_ATTEMPT", "0")
    if kill and attempt in ("*", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        rank, at = kill.split(":")
        if rank in ("*", os.environ.get("RANK", "0")) and step == int(at):
            after = os.environ.get("PROBE_TASK_KILL_AFTER")
            count = int(os.environ.get("PROBE_TASK_KILL_AFTER_COUNT", "1"))
            deadline = time.monotonic() + 120
            while after and len(glob.glob(after)) < count and time.monotonic() < deadline:
                time.sleep(0.05)
            name = os.environ.get("PROBE_TASK_KILL_SIGNAL", "KILL")
            if name == "STOP":
                print(f"probe: stopped in step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), getattr(signal, "SIG" + name))


def hold_snapshot_copies() -> None:
    """Make each background snapshot copy wait for the next `Checkpointer.fence()` call or completed
    optimizer step, whichever comes first. With the fences in place the copy starts when the training
    thread reaches the next optimizer step (after that step's forward and backward) and the step waits
    for it; without one the optimizer steps first and the copy sees the next step's values. Logs
    "probe: snapshot copy held until a fence" or "... until an optimizer step" for the tests."""
    import threading

    from torch.optim.optimizer import register_optimizer_step_post_hook

    from trainer.checkpoint import writer

    cond = threading.Condition()
    events: list[str] = []

    def record(what: str) -> None:
        with cond:
            events.append(what)
            cond.notify_all()

    register_optimizer_step_post_hook(lambda *_: record("an optimizer step"))
    fence, stage = writer.Checkpointer.fence, writer.SnapshotBuffers.stage

    def fence_first(self):
        record("a fence")
        return fence(self)

    def staged_held(self, files, stable=None):
        snapshot = stage(self, files, stable)
        with cond:
            start = len(events)
        complete = snapshot.complete

        def held_complete() -> None:
            with cond:
                cond.wait_for(lambda: len(events) > start, timeout=120)
                first = events[start] if len(events) > start else "nothing (timed out)"
            sys.stderr.write(f"probe: snapshot copy held until {first}\n")
            complete()

        snapshot.complete = held_complete
        return snapshot

    writer.Checkpointer.fence = fence_first
    writer.SnapshotBuffers.stage = staged_held


if os.environ.get("PROBE_TASK_OVERLAP") == "1":
    hold_snapshot_copies()


class ProbeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    encoder_url: str
    width: int = Field(8, ge=1)
    dropout: float = Field(0.1, ge=0, lt=1)
    disc_start_step: int = Field(2, ge=0)
    adv_weight: float = 0.1


class Generator(nn.Module):
    def __init__(self, channels: int, width: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2 * channels, width, 3, padding=1),
            nn.SiLU(),
            nn.Dropout(dropout),
            nn.Conv2d(width, channels, 3, padding=1),
        )

        # Changes in forward, like a VQ codebook's EMA: a background save must copy it at once.
        self.register_buffer("forwards", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
        return torch.tanh(self.net(torch.cat([x, features], dim=1)))


class Discriminator(nn.Module):
    def __init__(self, channels: int, width: int):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(channels, width, 3, stride=2, padding=1), nn.SiLU(), nn.Conv2d(width, 1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).flatten(1).mean(1)


class GanProbeTask(Task):
    ModelConfig = ProbeConfig
    cfg: ProbeConfig

    @classmethod
    def trainable_part_names(cls, model_cfg: ProbeConfig) -> list[str]:
        return ["generator", "discriminator"]

    def frozen_sources(self) -> dict[str, FrozenSource]:
        return {"encoder": FrozenSource(self.cfg.encoder_url, part="unet")}

    def build(self, frozen) -> dict[str, nn.Module]:
        source = frozen["encoder"].config  # the DDPM run's own config builds its UNet
        encoder = task_class(source.task)(source.model_cfg, self.ctx).build({})["unet"]
        c, w = self.ctx.channels, self.cfg.width
        return {
            "encoder": encoder,
            "generator": Generator(c, w, self.cfg.dropout),
            "discriminator": Discriminator(c, w),
        }

    def phases(self, step: int, part_steps: Mapping[str, int]) -> list[Phase]:
        phases = [Phase("generator", "generator")]
        if step >= self.cfg.disc_start_step:
            phases.append(Phase("discriminator", "discriminator"))
        return phases

    def forward(self, modules, batch: Batch, step: int):
        maybe_die(step)
        with torch.no_grad():
            t = torch.zeros(len(batch), dtype=torch.long, device=batch.images.device)
            features = modules["encoder"](batch.images, t).sample
        return {"reconstruction": modules["generator"](batch.images, features)}

    def loss(self, phase: Phase, modules, batch: Batch, outputs, info: StepInfo) -> Loss:
        recon, real = outputs["reconstruction"], batch.images
        if phase.part == "generator":
            rec = (recon - real).abs().mean(dim=(1, 2, 3))
            adv = -modules["discriminator"](recon)
            return Loss(rec + self.cfg.adv_weight * adv, {"rec": rec.detach(), "adv": adv.detach()})
        assert not recon.requires_grad, "later phases must see detached outputs"
        d_loss = F.relu(1 - modules["discriminator"](real)) + F.relu(1 + modules["discriminator"](recon))
        return Loss(d_loss, {"hinge": d_loss.detach()})

    def validate(self, modules, batch: Batch) -> dict[str, torch.Tensor]:
        recon = self.forward(modules, batch, -1)["reconstruction"]
        mse = ((recon - batch.images) ** 2).mean(dim=(1, 2, 3))
        return {"mse": mse, "psnr": 10 * torch.log10(4.0 / mse.clamp(min=1e-10))}

    def previews(self, modules, ctx: PreviewContext) -> dict[str, torch.Tensor]:
        with ctx.weights(False):
            online = self.forward(modules, ctx.batch, -1)["reconstruction"]
        with ctx.weights(True):
            ema = self.forward(modules, ctx.batch, -1)["reconstruction"]
        rows = torch.cat([ctx.batch.images, online, ema]).float().cpu()
        return {"reconstruction": (rows.clamp(-1, 1) + 1) / 2}

    @torch.no_grad()
    def sample(self, modules, request, device: torch.device) -> torch.Tensor:
        num, g = request.num, torch.Generator().manual_seed(request.seed)
        x = torch.rand((num, self.ctx.channels, self.ctx.image_size, self.ctx.image_size), generator=g) * 2 - 1
        batch = Batch(x.to(device), torch.full((num,), -1), torch.arange(num), list(range(num)))
        return ((self.forward(modules, batch, -1)["reconstruction"].clamp(-1, 1) + 1) / 2).cpu()


class KillableVQGAN(VQGANTask):
    """The real VQ-GAN task with the kill switch (tests name it `probe_tasks:KillableVQGAN`)."""

    def forward(self, modules, batch: Batch, step: int):
        maybe_die(step)
        return super().forward(modules, batch, step)


class KillableMaskGIT(MaskGITTask):
    def forward(self, modules, batch: Batch, step: int):
        maybe_die(step)
        return super().forward(modules, batch, step)


class KillableVideoTokenizer(VideoTokenizerTask):
    def forward(self, modules, batch: Batch, step: int):
        maybe_die(step)
        return super().forward(modules, batch, step)


class KillableVideoMaskGIT(VideoMaskGITTask):
    def forward(self, modules, batch: Batch, step: int):
        maybe_die(step)
        return super().forward(modules, batch, step)


class KillableAutoencoder(AutoencoderTask):
    def forward(self, modules, batch: Batch, step: int):
        maybe_die(step)
        return super().forward(modules, batch, step)


class KillableDDPM(DDPMTask):
    def forward(self, modules, batch: Batch, step: int):
        maybe_die(step)
        return super().forward(modules, batch, step)
