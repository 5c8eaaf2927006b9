"""The sampling contract: what a sampler is asked for, what a task declares it takes, and the one refusal.

- **One request** (`SampleRequest`): everything `gentrain sample`, previews, `eval` and the benches ask of
  `Task.sample(modules, request, device)`. An option left at None was not asked for; the task then uses
  its own default (the CLI, previews and eval fill the sampler settings from the run's `sample.*` first).
- **Declared support** (`Task.sample_accepts()`): the options a task's `sample` reads, from its config
  (a DDPM model takes `labels` only when `model.num_classes` is set, `prompts` only with `model.text`).
- **One refusal path** (`check_request`): a request's options outside that set, or values outside their
  range, are a `ConfigError` (exit 2) naming the user's flags and what this checkpoint accepts. Tasks do
  not refuse options themselves; they check only what depends on their own state (a cascade's stage
  count, a video model's trained clip length, an embedding's width).

Nothing here knows ranks, devices or the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch

# Each option of a request -> its `gentrain sample` flag, in the parser's order.
OPTIONS: dict[str, str] = {
    "inference_steps": "--steps",
    "scheduler": "--scheduler",
    "guidance_scale": "--guidance-scale",
    "labels": "--class",
    "prompts": "--prompt",
    "image_embeds": "--embeddings",
    "stop_at_stage": "--stop-at-stage",
    "frames": "--frames",
    "temperature": "--temperature",
    "batch_size": "--batch-size",
    "height": "--height",
    "width": "--width",
    "choice_temperature": "choice_temperature",  # no flag: for programmatic callers (bench/moving_digits.py)
}

# The options that condition a sample, as the refusal describes a checkpoint by them.
_CONDITIONS = {"labels": "class labels", "prompts": "captions", "image_embeds": "image embeddings"}

# Lower bounds of numeric options: (the smallest value, whether it is allowed).
_BOUNDS: dict[str, tuple[float, bool]] = {
    "inference_steps": (1, True),
    "guidance_scale": (0, True),
    "stop_at_stage": (1, True),
    "frames": (1, True),
    "temperature": (0, False),
    "batch_size": (1, True),
    "height": (1, True),
    "width": (1, True),
    "choice_temperature": (0, True),
}


@dataclass(frozen=True, eq=False)
class SampleRequest:
    """What one `Task.sample` call is asked for. `num` and `seed` every task takes; each option (see
    `OPTIONS`) is None when not asked for. `images` and `part_steps` are not the user's to give: held-out
    images for a task that samples by reconstructing (`Task.samples_reconstruct`), each part's step
    count from the checkpoint (a cascade refuses stages that never trained), and `between_steps`, which
    a sampler calls between its steps (`check_between_steps`)."""

    num: int
    seed: int = 0
    inference_steps: int | None = None
    scheduler: str | None = None
    guidance_scale: float | None = None
    labels: torch.Tensor | None = None  # (num,) int64 class labels
    prompts: list[str] | None = None  # captions, repeated to `num`
    image_embeds: torch.Tensor | np.ndarray | None = None  # (D,) or (N, D), repeated to `num`
    stop_at_stage: int | None = None
    frames: int | None = None
    temperature: float | None = None
    batch_size: int | None = None
    height: int | None = None  # pixels; a diffusion model checks it against the sizes it trained at
    width: int | None = None
    choice_temperature: float | None = None
    images: torch.Tensor | None = None  # (N, C, H, W) in [-1, 1]
    part_steps: Mapping[str, int] | None = None
    between_steps: Callable[[], None] | None = None  # see `check_between_steps`

    def given(self) -> list[str]:
        """The options asked for (not None), in `OPTIONS` order."""
        return [name for name in OPTIONS if getattr(self, name) is not None]

    def option(self, name: str, default: Any) -> Any:
        """Option `name`, or the task's `default` when it was not asked for."""
        value = getattr(self, name)
        return default if value is None else value

    def with_defaults(self, **defaults: Any) -> SampleRequest:
        """This request with each option of `defaults` that it leaves at None set to the default's value
        (the run's `sample.*` settings, filled in after `check_request`)."""
        unset = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return dataclasses.replace(self, **unset) if unset else self

    def replace(self, **fields: Any) -> SampleRequest:
        return dataclasses.replace(self, **fields)

    def check_between_steps(self) -> None:
        """Call between sampler steps (denoising steps, decoding iterations, cascade stages). Training's
        previews and evaluations pass a check that raises once the run was asked to stop (a stop must not
        wait for a long grid: see trainer.elastic.StopCheck); `gentrain sample` passes none."""
        if self.between_steps is not None:
            self.between_steps()


def _flag(name: str) -> str:
    return OPTIONS.get(name, name)


def describe(accepts: Iterable[str]) -> str:
    """What a checkpoint is conditioned on, from the options its task accepts."""
    conditions = [what for name, what in _CONDITIONS.items() if name in accepts]
    return f"conditioned on {' and '.join(conditions)}" if conditions else "unconditional"


def check_request(request: SampleRequest, accepts: Iterable[str], what: str) -> None:
    """The one refusal of a sampling request (a `ConfigError`, exit 2): options the task does not accept
    (`accepts`, its `Task.sample_accepts()`; `what` names the checkpoint's task), then values out of range."""
    accepts = frozenset(accepts)
    refused = [name for name in request.given() if name not in accepts]
    if refused:
        flags = ", ".join(_flag(n) for n in refused)
        takes = [flag for n, flag in OPTIONS.items() if n in accepts and flag.startswith("--")]
        offer = f"it accepts {', '.join(takes)}" if takes else "it accepts none of the sampling options"
        raise ConfigError(
            f"{flags}: this {what} checkpoint is {describe(accepts)} and does not take "
            f"{'it' if len(refused) == 1 else 'them'}; {offer} (besides --num, --seed, --out, --no-ema)"
        )
    if request.num < 1:
        raise ConfigError(f"--num {request.num}: must be at least 1")
    for name, (low, inclusive) in _BOUNDS.items():
        value = getattr(request, name)
        if value is None or (value >= low if inclusive else value > low):
            continue
        bound = f"at least {low}" if inclusive else f"greater than {low}"
        raise ConfigError(f"{_flag(name)} {value}: must be {bound}")
