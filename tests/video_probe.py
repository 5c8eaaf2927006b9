"""A test-only task over clips: exercises the engine (loop, validation, previews) with (N, T, C, H, W) batches.

`video_probe:ClipProbeTask` is a per-frame 3x3 convolution trained to reproduce
its input, with the loss counted over each sample's real frames only
(`extras["frames"]`). It checks what the data contract promises on every batch
and records batch facts for the tests in `$VIDEO_PROBE_LOG` (one JSON line per
training step on rank 0).
"""

from __future__ import annotations

import json
import os

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from trainer.tasks.base import Batch, Loss, PreviewContext, StepInfo, Task


class ClipProbeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


def frame_mask(batch: Batch) -> torch.Tensor:
    """(N, T) 1.0 on each sample's real frames."""
    t = batch.images.shape[1]
    return (torch.arange(t, device=batch.images.device)[None] < batch.extras["frames"][:, None]).float()


class ClipProbeTask(Task):
    ModelConfig = ClipProbeConfig

    @classmethod
    def trainable_part_names(cls, model_cfg) -> list[str]:
        return ["net"]

    def build(self, frozen) -> dict[str, nn.Module]:
        c = self.ctx.channels
        return {"net": nn.Conv2d(c, c, 3, padding=1)}

    def _recon(self, modules, batch: Batch) -> torch.Tensor:
        x = batch.images
        assert x.ndim == 5, f"clips must be (N, T, C, H, W), got {tuple(x.shape)}"
        n, t = x.shape[:2]
        return torch.tanh(modules["net"](x.flatten(0, 1))).unflatten(0, (n, t))

    def _per_sample(self, modules, batch: Batch) -> torch.Tensor:
        err = ((self._recon(modules, batch) - batch.images) ** 2).mean(dim=(2, 3, 4))
        mask = frame_mask(batch)
        return (err * mask).sum(1) / mask.sum(1).clamp(min=1)

    def loss(self, phase, modules, batch: Batch, outputs, info: StepInfo) -> Loss:
        x, frames = batch.images, batch.extras["frames"]
        # Frames past a sample's count are zeros, and unreadable slots are zeros with frames 0.
        for i in range(len(batch)):
            assert bool((x[i, int(frames[i]) :] == 0).all()), "frames after extras['frames'] must be zeros"
            assert (int(frames[i]) > 0) == bool(batch.valid[i]), "a valid sample has frames, a skipped one none"
        path = os.environ.get("VIDEO_PROBE_LOG")
        if path and info.step >= 0 and os.environ.get("RANK", "0") == "0":
            with open(path, "a") as f:
                line = {
                    "step": info.step,
                    "shape": list(x.shape),
                    "frames": frames.tolist(),
                    "valid": batch.valid.tolist(),
                    "captions": batch.captions,
                    "labels": batch.labels.tolist(),
                    "indices": batch.indices.tolist(),
                }
                f.write(json.dumps(line) + "\n")
        return Loss(self._per_sample(modules, batch))

    def validate(self, modules, batch: Batch) -> dict[str, torch.Tensor]:
        return {"mse": self._per_sample(modules, batch)}

    def previews(self, modules, ctx: PreviewContext) -> dict[str, torch.Tensor]:
        with ctx.preferred_weights():
            recon = self._recon(modules, ctx.batch)
        pair = torch.cat([ctx.batch.images, recon], dim=-1)  # input | reconstruction, side by side
        return {"reconstruction": ((pair.clamp(-1, 1) + 1) / 2).float().cpu()}

    @torch.no_grad()
    def sample(self, modules, request, device: torch.device) -> torch.Tensor:
        raise NotImplementedError("the clip probe only reconstructs")
