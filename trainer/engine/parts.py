"""Parts: trainable ones (module, DDP wrapper, optimizer, schedule, scaler, EMA, step counter) and
frozen ones (weights from another run, never optimized or saved). Built from a task's modules."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from trainer.checkpoint import quantized
from trainer.config import Config
from trainer.ema import EMAModel
from trainer.engine.shard import full_value, is_fsdp, reshard
from trainer.engine.wrap import Wrapping
from trainer.errors import ConfigError
from trainer.models.finetune import cast_frozen_base, saved_keys
from trainer.optim import OptimSettings, build_ema, build_lr_schedule, build_optimizer, step_unless
from trainer.tasks.base import FrozenWeights

log = logging.getLogger(__name__)


def nonfinite(*values: torch.Tensor) -> torch.Tensor:
    """1.0 when any of `values` (0-d tensors on one device) is inf or NaN, else 0.0: a float32 0-d tensor on
    the device, computed there (the host never waits for it)."""
    return (~torch.isfinite(torch.stack([v.detach().float() for v in values]))).any().float()


class Part:
    """One independently optimized piece of a task (a UNet, a generator, a discriminator, a stage).

    `module` is the bare model; `wrapped` is what forward passes use while the
    part learns (the DDP wrapper when distributed). Under FSDP2 both are the
    same object, sharded in place: its parameters, gradients, optimizer state
    and EMA weights are DTensors holding this rank's slice. Each part keeps its own
    step counter: a discriminator may start later than its generator, and a
    cascade stage not trained in this run keeps its count. Everything it owns
    is saved through `state_dict()` and restored through `load_state_dict()`.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        wrapped: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_schedule: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
        ema: EMAModel | None,
        settings: OptimSettings,
        learning: bool = True,
        fence: Callable[[], None] | None = None,
    ):
        self.name = name
        self.module = module
        self.wrapped = wrapped
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        # One GradScaler per part: accelerate keeps a single scaler for all
        # optimizers, so an overflow in one part would skip every part's step.
        self.scaler = scaler
        self.ema = ema
        self.settings = settings
        # False for a part this run keeps as it is (a cascade stage outside train.stages): never
        # wrapped, stepped or zeroed, so its weights, EMA and optimizer state stay bit-identical.
        self.learning = learning
        # The parameters the task left trainable (all of them, or only the LoRA adapters); the
        # engine toggles exactly these, never the frozen base weights of an adapted model.
        self.params = [p for p in module.parameters() if p.requires_grad]
        # What its checkpoints hold: None, the whole module; for a LoRA-adapted module, the trainable
        # parameters (and buffers) only: the frozen base is rebuilt from the pinned pretrained folder by
        # every start, so checkpoints and memory-tier snapshots are the adapters' size, not the base's.
        self.saved_keys = saved_keys(module)
        self.step = 0
        # The checkpoint manager's: returns once a background save has copied this part's weights,
        # optimizer state and EMA (see trainer.checkpoint.writer); called before changing them.
        self.fence: Callable[[], None] = fence or _no_fence

    def learns_now(self) -> bool:
        """True while this run trains the part and it has not reached its own max steps."""
        return self.learning and self.step < self.settings.max_steps

    def set_learning(self, on: bool) -> None:
        for p in self.params:
            p.requires_grad_(on)

    def optimizer_step(self) -> torch.Tensor:
        """Unscale, clip, step optimizer, schedule and EMA; returns the gradient norm before clipping, a
        0-d tensor on the device (read at the log cadence, never here: see trainer.engine.report). A
        non-finite norm skips the optimizer step (see `apply_step`); a run's steps go through StepRunner,
        which decides for all the step's parts together."""
        norm = self.clip_gradients()
        self.apply_step(nonfinite(norm))
        return norm

    def clip_gradients(self) -> torch.Tensor:
        """The first half of a step: unscale (fp16) and clip; the gradient norm before clipping (0-d, on the
        device, never read here). Over DTensor gradients it is computed over every rank's shard (one
        all-reduce); under DDP every rank holds the same all-reduced gradients: the same norm everywhere."""
        self.fence()  # everything from here on changes state a background save may still be copying
        self.scaler.unscale_(self.optimizer)
        max_norm = self.settings.max_grad_norm
        params = [p for p in self.params if p.grad is not None]
        norm = full_value(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf")))
        return norm.detach()

    def apply_step(self, skip: torch.Tensor) -> None:
        """The second half: the optimizer step, unless `skip` (float32 on the device, 1.0 when the step's loss or
        a gradient norm was not finite) says otherwise, decided on the device (trainer.optim.step_unless); then
        the loss scale, the schedule, the EMA and the part's step count.

        A skipped step still counts: the schedule, the EMA's decay and `step` advance (they are host-side
        counters, and following the device's decision would wait for the device every step). The weights
        and the optimizer's state are left as they were, so the EMA averages in unchanged, finite weights.
        The fp16 scaler's own overflow check (`unscale_`) sets its next scale; its `step` is not used, since
        it would hand the optimizer its own flag only (and read it on the host for other optimizers)."""
        step_unless(self.optimizer, skip)
        self.scaler.update()
        self.lr_schedule.step()
        if self.ema is not None:
            self.ema.step(self.module.parameters())
        self.step += 1

    @property
    def sharded(self) -> bool:
        return is_fsdp(self.module)

    def optimizer_params(self) -> list[torch.Tensor]:
        """Parameters in the optimizer's order: the index its saved state is keyed by."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @property
    def lr(self) -> float:
        return float(self.lr_schedule.get_last_lr()[0])  # a 0-d tensor under torchao's optimizers

    # ---- state
    def stable_tensors(self) -> list[torch.Tensor]:
        """Tensors that change only in `apply_step`, `load_state_dict` or an EMA swap (all behind
        `fence`): parameters, EMA weights, optimizer state. Buffers are not among them."""
        out = list(self.module.parameters())
        if self.ema is not None:
            out += list(self.ema.shadow_params)
        for per_param in self.optimizer.state.values():
            for v in per_param.values():
                if isinstance(v, torch.Tensor):
                    out += quantized.plain_tensors(v)  # an 8-bit state's codes, scale and map
        return out

    def ema_weights(self) -> dict[str, torch.Tensor]:
        """The module's state dict with EMA weights in place of parameters (loadable as the model)."""
        state = dict(self.module.state_dict())
        if self.ema is not None:
            for (name, _), shadow in zip(self.module.named_parameters(), self.ema.shadow_params, strict=True):
                state[name] = shadow
        return state

    def _saved(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        keys = self.saved_keys
        return dict(state) if keys is None else {k: v for k, v in state.items() if k in keys}

    def state_dict(self) -> dict[str, Any]:
        ema_meta = None
        if self.ema is not None:
            ema_meta = self.ema.state_dict()
            ema_meta.pop("shadow_params")
        return {
            "model": self._saved(self.module.state_dict()),
            "ema": self._saved(self.ema_weights()) if self.ema is not None else None,
            # "trainable": the frozen base is not in the checkpoint (see `saved_keys`), trainer.json says so.
            "weights": "all" if self.saved_keys is None else "trainable",
            # Plain tensors only: 8-bit state subclasses become their parts plus a JSON description.
            "optimizer": quantized.flatten(self.optimizer.state_dict()),
            "optimizer_name": self.settings.optimizer,
            "lr_schedule": self.lr_schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema_meta": ema_meta,
            "step": self.step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.fence()
        # An adapter-only state (`saved_keys`, checked by trainer.checkpoint.state.check_fits) goes over the
        # base this start built from the pinned folder; a whole one (written before adapter-only
        # checkpoints, or a full fine-tune) replaces everything.
        whole = set(state["model"]) == set(self.module.state_dict())
        self.module.load_state_dict(state["model"], strict=whole)
        # fused/foreach say how this process steps, not what was learned: keep the ones built here
        # (a checkpoint written by an older version would otherwise switch the fused kernel off).
        impl = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, kept in zip(self.optimizer.param_groups, impl, strict=True):
            group.update(kept)
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.ema is not None and state.get("ema") is not None and state.get("ema_meta"):
            # A frozen base parameter's EMA is the parameter itself (EMAModel.step copies it every step).
            params = [state["ema"].get(name, p.detach()) for name, p in self.module.named_parameters()]
            self.ema.load_state_dict({**state["ema_meta"], "shadow_params": params})
            self.ema.to(next(self.module.parameters()).device)
        self.step = int(state["step"])


def _no_fence() -> None:
    return None


class FrozenPart:
    """A part loaded from another run: eval mode, no gradients, never optimized or saved (under
    train.shard_frozen its module is sharded in place after loading, like a trained FSDP part)."""

    def __init__(self, name: str, module: nn.Module, weights: FrozenWeights):
        self.name = name
        self.module = module
        self.record = weights.record
        missing, unexpected = module.load_state_dict(weights.tensors, strict=False)
        if missing or unexpected:
            raise ConfigError(
                f"frozen part {name!r} from {weights.record.url}: its weights do not fit the model this task "
                f"builds (missing {missing[:5]}, unexpected {unexpected[:5]}). Is the URL a run of the right task?"
            )
        module.requires_grad_(False)
        module.eval()


def build_parts(
    modules: Mapping[str, nn.Module],
    *,
    frozen: Mapping[str, FrozenWeights],
    learning: Collection[str],
    cfg: Config,
    device: torch.device,
    wrapping: Wrapping,
    ema_names: Collection[str] | None = None,
    fence: Callable[[], None] | None = None,
) -> tuple[dict[str, Part], dict[str, FrozenPart]]:
    """Parts from a task's modules: the `frozen` ones (loaded from their weights), the others trainable.

    `wrapping.wrap(module)` makes the DDP wrapper for the parts this run trains (`learning`), or shards
    the module in place under FSDP2 (then optimizer and EMA are built on its DTensors); the other parts
    are kept bare and untouched. `wrapping.shard_frozen(module)` shards a frozen part in place once its
    weights are loaded whole (FSDP with train.shard_frozen). A part keeps an EMA when named in
    `ema_names` (default: every trainable part). `fence`: what each part waits on before it changes its
    state (the checkpoint manager's, see `Part.fence`)."""
    parts: dict[str, Part] = {}
    frozen_parts: dict[str, FrozenPart] = {}
    for name, module in modules.items():
        # A part `wrap` shards stays where it was built (meta off rank 0, host memory on rank 0):
        # fully_shard moves one unit at a time to the device, so no device ever holds it whole.
        if not (wrapping.shards_on_wrap and name in learning):
            module.to(device)
        if name in frozen:
            frozen_parts[name] = FrozenPart(name, module, frozen[name])
            wrapping.shard_frozen(module)
            continue
        cast_frozen_base(module, cfg.train.precision)  # LoRA: half-precision base, fp32 adapters
        wrapped = wrapping.wrap(module) if name in learning else module
        optimizer = build_optimizer(module, cfg, name)
        fp16 = cfg.train.precision == "fp16"
        if is_fsdp(module):
            # Its inf/nan check is all-reduced: every rank skips an overflowing step together.
            scaler = ShardedGradScaler(device.type, enabled=fp16)
        else:
            scaler = torch.amp.GradScaler(device.type, enabled=fp16)
        parts[name] = Part(
            name=name,
            module=module,
            wrapped=wrapped,
            optimizer=optimizer,
            lr_schedule=build_lr_schedule(optimizer, cfg, name),
            scaler=scaler,
            ema=build_ema(module, cfg) if ema_names is None or name in ema_names else None,
            settings=OptimSettings.for_part(cfg, name),
            learning=name in learning,
            fence=fence,
        )
    return parts, frozen_parts


class ModuleView(Mapping):
    """What a task sees as `modules`: the wrapper for parts that learn now, bare modules otherwise."""

    def __init__(self, parts: Mapping[str, Part], frozen: Mapping[str, FrozenPart], learning: set[str]):
        self._parts = parts
        self._frozen = frozen
        self._learning = learning

    def __getitem__(self, name: str) -> nn.Module:
        if name in self._parts:
            part = self._parts[name]
            return part.wrapped if name in self._learning else part.module
        return self._frozen[name].module

    def bare(self, name: str) -> nn.Module:
        """The part's own module, never its DDP wrapper (parameters to differentiate against, attributes)."""
        if name in self._parts:
            return self._parts[name].module
        return self._frozen[name].module

    def __iter__(self) -> Iterator[str]:
        yield from self._parts
        yield from self._frozen

    def __len__(self) -> int:
        return len(self._parts) + len(self._frozen)


def bare_modules(parts: Mapping[str, Part], frozen: Mapping[str, FrozenPart]) -> dict[str, nn.Module]:
    return {**{n: p.module for n, p in parts.items()}, **{n: f.module for n, f in frozen.items()}}


@contextmanager
def ema_swapped(parts: Mapping[str, Part], enabled: bool = True):
    """EMA weights in the modules for the duration (sampling, previews), the online ones after.

    Copies parameter by parameter rather than through EMAModel.store/copy_to,
    which go through `.data` and fail on FSDP2's DTensor parameters.
    """
    swapped = [p for p in parts.values() if p.ema is not None] if enabled else []
    for p in swapped:
        p.fence()  # the online weights are overwritten below
    saved = []
    reshard(p.module for p in swapped)
    with torch.no_grad():
        for p in swapped:
            params = list(p.module.parameters())
            saved.append((params, [t.detach().clone() for t in params]))
            for param, shadow in zip(params, p.ema.shadow_params, strict=True):
                param.copy_(shadow)
    try:
        yield
    finally:
        reshard(p.module for p in swapped)
        with torch.no_grad():
            for params, online in saved:
                for param, value in zip(params, online, strict=True):
                    param.copy_(value)


@contextmanager
def eval_mode(modules: Mapping[str, nn.Module]):
    was = {n: m.training for n, m in modules.items()}
    for m in modules.values():
        m.eval()
    try:
        yield
    finally:
        reshard(modules.values())
        for n, m in modules.items():
            m.train(was[n])
