"""Diffusion objectives: what a network is trained to predict and how its samples are drawn.

Each objective owns its training scheduler, its per-sample training draw (timesteps or sigmas), the
noisy input and its preconditioning, the target, the loss weight, the inference scheduler and the
sampler loop. They are diffusers' own functions arranged per objective (nothing re-derived):

- `Epsilon` and `VPrediction`: DDPM noise schedule (DDPMScheduler), min-SNR-gamma weighting
  (Hang et al. 2023); DREAM (arXiv:2312.00210) for epsilon, as diffusers implements it;
- `RectifiedFlow`: SD3's timestep densities and loss weights (diffusers' `training_utils`) and the
  flow-matching Euler sampler;
- `EDM`: the elucidated preconditioning (Karras et al. 2022) of diffusers' EDM schedulers, whose
  `precondition_*` functions serve training and sampling alike.

The random calls of `draw` are exactly those the ddpm and cascade tasks make, in the same order, on
the same per-sample generators (trainer/randomness.py), so a task moved onto an objective draws the
same numbers and computes the same loss to the bit.

A network is any callable `net_fn(x, t, cond) -> Tensor` (a `trainer.diffusion.backbones.Backbone`,
or an adapter around a task's own module).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.conditioning.guidance import Guidance
from trainer.errors import ConfigError
from trainer.randomness import SampleDraws
from trainer.task_types import Loss

if TYPE_CHECKING:
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

# The other schedulers are imported where they are built: DPM-Solver's and flow matching's modules import
# scipy whenever it is installed, which a DDPM run with the DDIM sampler never needs (tests/test_startup.py).

Tensor = torch.Tensor
NetFn = Callable[[Tensor, Tensor, Mapping[str, Tensor]], Tensor]
"""A network as an objective calls it: (noisy input, what it is told of the noise level, conditions) -> output."""

SAMPLERS = ("ddim", "dpm")  # `sample.scheduler`


class EDMConfig(BaseModel):
    """`edm.*`: the elucidated preconditioning's constants (Karras et al. 2022, arXiv:2206.00364, table 1),
    the defaults of the paper and of imagen-pytorch's ElucidatedImagen."""

    model_config = ConfigDict(extra="forbid")

    sigma_data: float = Field(0.5, gt=0, description="standard deviation of the data (images in [-1, 1])")
    p_mean: float = Field(-1.2, description="training: ln(sigma) ~ N(p_mean, p_std^2)")
    p_std: float = Field(1.2, gt=0)
    sigma_min: float = Field(0.002, gt=0, description="sampling: the schedule's ends")
    sigma_max: float = Field(80.0, gt=0)
    rho: float = Field(7.0, gt=0, description="sampling: Karras schedule curvature")


class ObjectiveConfig(BaseModel):
    """The objective's keys, with the names, defaults and checks of the cascade's stages (`model.stages[i]`)
    and DDPM's `model.*` today, so either config can be read as one."""

    model_config = ConfigDict(extra="forbid")

    prediction_type: Literal["epsilon", "v_prediction", "flow", "edm"] = "epsilon"
    num_train_timesteps: int = Field(1000, ge=2)
    beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2"] = "squaredcos_cap_v2"
    # linear and scaled_linear run from beta_start to beta_end (DDPMScheduler's defaults; Stable Diffusion's
    # scheduler: scaled_linear 0.00085 .. 0.012, filled from a pipeline folder's scheduler_config.json).
    beta_start: float = Field(0.0001, gt=0, lt=1, description="linear / scaled_linear: the first beta")
    beta_end: float = Field(0.02, gt=0, lt=1, description="linear / scaled_linear: the last beta")
    snr_gamma: float | None = Field(5.0, gt=0, description="min-SNR-gamma weighting; null = off")
    edm: EDMConfig = Field(default_factory=EDMConfig, description="prediction_type=edm: its constants")
    dream: bool = Field(False, description="DREAM (arXiv:2312.00210), epsilon prediction only")
    dream_detail_preservation: float = Field(1.0, gt=0)
    weighting_scheme: Literal["logit_normal", "mode", "sigma_sqrt", "cosmap", "none"] = Field(
        "logit_normal", description="flow: SD3's timestep density and loss weighting"
    )
    logit_mean: float = 0.0
    logit_std: float = Field(1.0, gt=0)
    mode_scale: float = 1.29
    # The flow-matching scheduler's `shift` (SD3/3.5: 3.0, filled from a pipeline folder's scheduler_config.json):
    # sigma' = shift * sigma / (1 + (shift - 1) * sigma), which moves the training draws and the sampler's steps
    # toward more noise, as diffusers' train_dreambooth_lora_sd3.py draws from the shifted scheduler's sigmas.
    flow_shift: float = Field(1.0, gt=0, le=100, description="flow: the scheduler's timestep shift (SD3: 3.0)")

    @model_validator(mode="after")
    def _dream_needs_epsilon(self) -> ObjectiveConfig:
        # The cascade's message, word for word: configs refused today are refused the same way.
        if self.dream and self.prediction_type != "epsilon":
            raise ValueError(
                f"dream=true needs prediction_type=epsilon (diffusers implements DREAM for epsilon only), "
                f"got {self.prediction_type}"
            )
        return self


@dataclass(frozen=True)
class Draw:
    """One step's per-sample training draw: `t`, what the network is told of the noise level (N,), and
    `sigma`, the noise level itself (flow: the noise's share in [0, 1]; EDM: its standard deviation)."""

    t: Tensor
    sigma: Tensor | None = None


def edm_loss_weight(sigma: Tensor, sigma_data: float) -> Tensor:
    """lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma * sigma_data)^2 (EDM eq. 8, table 1): with it the
    effective target of the network output has unit variance at every noise level."""
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


# diffusers keeps these two in `diffusers.training_utils`, which imports peft, transformers and scipy when
# installed (see trainer/ema.py); their arithmetic, op for op, so losses keep their bits
# (tests/test_startup.py compares them with diffusers').
def compute_snr(noise_scheduler: Any, timesteps: Tensor) -> Tensor:
    """SNR(t) = alpha_t^2 / sigma_t^2 of a DDPM schedule (diffusers.training_utils.compute_snr)."""
    alphas_cumprod = noise_scheduler.alphas_cumprod
    alpha = (alphas_cumprod**0.5).to(device=timesteps.device)[timesteps].float()
    sigma = ((1.0 - alphas_cumprod) ** 0.5).to(device=timesteps.device)[timesteps].float()
    return (alpha / sigma) ** 2


def compute_loss_weighting_for_sd3(weighting_scheme: str, sigmas: Tensor) -> Tensor:
    """SD3's loss weights per sigma (diffusers.training_utils.compute_loss_weighting_for_sd3)."""
    if weighting_scheme == "sigma_sqrt":
        return (sigmas**-2.0).float()
    if weighting_scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    return torch.ones_like(sigmas)


def min_snr_weights(snr: Tensor, gamma: float, prediction_type: str) -> Tensor:
    """Per-sample loss weights of min-SNR-gamma (Hang et al. 2023, arXiv:2303.09556): min(SNR, gamma) / SNR
    for epsilon targets, min(SNR, gamma) / (SNR + 1) for v targets, as in diffusers' training scripts."""
    clipped = torch.clamp(snr, max=gamma)
    if prediction_type == "epsilon":
        return clipped / snr
    return clipped / (snr + 1)


def _per_sample_mse(pred: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=tuple(range(1, pred.ndim)))


def _column(v: Tensor, like: Tensor) -> Tensor:
    """(N,) -> (N, 1, ..., 1), broadcastable against `like`."""
    return v.view(like.shape[0], *([1] * (like.ndim - 1)))


class Objective:
    """One training objective (see the module doc). Built from any config that carries the fields of
    `ObjectiveConfig` (an `ObjectiveConfig`, a cascade stage, DDPM's model config); absent fields take
    `ObjectiveConfig`'s defaults."""

    name: ClassVar[str]  # the `prediction_type` that selects it
    supports_dream: ClassVar[bool] = False
    # min-SNR weighting applies to epsilon and v only; flow and EDM ignore `snr_gamma`, as the cascade
    # always has (its default is 5.0, so refusing it there would refuse configs that train today).
    uses_snr_gamma: ClassVar[bool] = False

    def __init__(self, cfg: Any, pixels: bool = True):
        self.cfg = cfg
        # Samplers that predict x0 clip it to [-1, 1] for pixels (diffusers' default), never for latents,
        # whose range is the autoencoder's (clipping them draws noise).
        self.pixels = pixels
        if self._field("dream") and not self.supports_dream:
            raise ConfigError(
                f"dream=true: DREAM applies to the epsilon objective only (diffusers implements it for epsilon), "
                f"not to prediction_type={self.name}; remove dream or use prediction_type=epsilon"
            )
        self.train_scheduler = self._train_scheduler()

    def _field(self, name: str) -> Any:
        if hasattr(self.cfg, name):
            return getattr(self.cfg, name)
        f = ObjectiveConfig.model_fields[name]
        return f.default_factory() if f.default_factory is not None else f.default

    # ---- subclasses
    def _train_scheduler(self):
        raise NotImplementedError

    def draw(self, draws: SampleDraws, n: int, device: torch.device, dtype: torch.dtype) -> Draw:
        """The per-sample training draw, one value per sample (drawn after the sample's noise)."""
        raise NotImplementedError

    def loss(
        self, net_fn: NetFn, x0: Tensor, noise: Tensor, draw: Draw, cond: Mapping[str, Tensor] | None = None
    ) -> Loss:
        """Per-sample weighted loss of `net_fn` on clean `x0` noised with `noise` at `draw`; `mse` is the
        unweighted error (logged)."""
        raise NotImplementedError

    def _inference_scheduler(self, kind: str):
        raise NotImplementedError

    # ---- shared
    def inference_scheduler(self, kind: str):
        """The sampler for `sample.scheduler` (ddim | dpm), with the training schedule's settings."""
        if kind not in SAMPLERS:
            raise ConfigError(f"sample.scheduler={kind!r}: choose one of {', '.join(SAMPLERS)}")
        return self._inference_scheduler(kind)

    def sampler_refusal(self, steps: int, kind: str) -> str | None:
        """Why `steps` steps of sampler `kind` would fail or draw nothing usable (None: they work), asked of a
        fresh sampler as `denoise` builds it. Called when a config is read (`Task.sampling_refusal`), so a
        preview or evaluation does not fail after the checkpoint before it committed."""
        try:
            self.inference_scheduler(kind).set_timesteps(steps)
        except (ValueError, RuntimeError) as e:
            return str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        return None

    @torch.no_grad()
    def denoise(
        self,
        net_fn: NetFn,
        x: Tensor,
        steps: int,
        kind: str = "ddim",
        guidance: Guidance | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> Tensor:
        """Turn unit-variance noise `x` into samples in `steps` sampler steps (classifier-free guided when
        `guidance` says so); returns the raw result (images in about [-1, 1], not clamped). `between_steps`
        is called before each step: it raises to abandon the sample (a training run asked to stop)."""
        sched = self.inference_scheduler(kind)
        sched.set_timesteps(steps)
        # Not every sampler scales its start or its inputs (flow matching does neither).
        x = x * getattr(sched, "init_noise_sigma", 1.0)
        predict = (guidance or Guidance({})).predictor(net_fn)
        for t in sched.timesteps:
            if between_steps is not None:
                between_steps()
            model_in = sched.scale_model_input(x, t) if hasattr(sched, "scale_model_input") else x
            x = sched.step(predict(model_in, t), t, x).prev_sample
        return x

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _DDPMObjective(Objective):
    """Epsilon and v: the DDPM noise schedule, integer timesteps, min-SNR weighting."""

    uses_snr_gamma = True

    def _train_scheduler(self) -> DDPMScheduler:
        return DDPMScheduler(
            num_train_timesteps=self._field("num_train_timesteps"),
            beta_schedule=self._field("beta_schedule"),
            beta_start=self._field("beta_start"),
            beta_end=self._field("beta_end"),
            prediction_type=self.name,
            clip_sample=self.pixels,
        )

    def _inference_scheduler(self, kind: str):
        if kind == "dpm":
            from diffusers.schedulers.scheduling_dpmsolver_multistep import DPMSolverMultistepScheduler

            return DPMSolverMultistepScheduler.from_config(self.train_scheduler.config)
        return _same_schedule(DDIMScheduler, self.train_scheduler.config)

    def draw(self, draws, n, device, dtype) -> Draw:
        return Draw(draws.randint(self.train_scheduler.config.num_train_timesteps).to(device))

    def sampler_refusal(self, steps: int, kind: str) -> str | None:
        # DDIM refuses more steps than the schedule has; DPM-Solver takes them, repeats timesteps and
        # returns NaN images (diffusers 0.36): neither draws anything.
        timesteps = self.train_scheduler.config.num_train_timesteps
        if steps > timesteps:
            return f"its training schedule has {timesteps} steps (num_train_timesteps), the most a sampler takes"
        return super().sampler_refusal(steps, kind)

    def target(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        raise NotImplementedError

    def loss(self, net_fn, x0, noise, draw, cond=None) -> Loss:
        cond = cond if cond is not None else {}
        sched, t = self.train_scheduler, draw.t
        noisy = sched.add_noise(x0, noise, t)
        target = self.target(x0, noise, t)
        if self._field("dream"):

            def unet(x, tt, c):  # diffusers' helper calls `unet(noisy, t, encoder_hidden_states).sample`
                return SimpleNamespace(sample=net_fn(x, tt, c))

            # DREAM only: diffusers.training_utils imports peft and transformers when installed (trainer/ema.py)
            from diffusers.training_utils import compute_dream_and_update_latents

            noisy, target = compute_dream_and_update_latents(
                unet, sched, t, noise, noisy, target, cond, self._field("dream_detail_preservation")
            )
        mse = _per_sample_mse(net_fn(noisy, t, cond), target)
        gamma = self._field("snr_gamma")
        if gamma is None:
            return Loss(mse, {"mse": mse.detach()})
        weight = min_snr_weights(compute_snr(sched, t), gamma, self.name)
        return Loss(mse * weight, {"mse": mse.detach()})


class Epsilon(_DDPMObjective):
    """Predict the noise (Ho et al. 2020)."""

    name = "epsilon"
    supports_dream = True

    def target(self, x0, noise, t):
        return noise


class VPrediction(_DDPMObjective):
    """Predict v = alpha_t * noise - sigma_t * x0 (Salimans & Ho 2022)."""

    name = "v_prediction"

    def target(self, x0, noise, t):
        return self.train_scheduler.get_velocity(x0, noise, t)


def _same_schedule(cls, config: Mapping[str, Any]):
    """`cls.from_config(config)`: a sampler on the training scheduler's schedule, from the keys of
    `config` that `cls` takes. Written out because `from_config` first imports every scheduler listed
    as compatible with `cls` (for DDIM: all twenty, scipy with them, 0.7 s of a process's first preview
    here) only to drop their keys from the config, which taking `cls`'s own keys does as well."""
    takes = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in config.items() if k in takes and k != "self"})


class RectifiedFlow(Objective):
    """Rectified flow as in SD3 (Esser et al. 2024): x_sigma = (1 - sigma) x0 + sigma noise, target
    noise - x0, timesteps from `weighting_scheme`'s density, loss weighted by it; flow-matching Euler sampler."""

    name = "flow"

    def _train_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

        return FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=self._field("num_train_timesteps"), shift=float(self._field("flow_shift"))
        )

    def _inference_scheduler(self, kind: str):
        from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

        # One sampler whatever `kind` asks, as the cascade samples flow stages today.
        return FlowMatchEulerDiscreteScheduler.from_config(self.train_scheduler.config)

    def draw(self, draws, n, device, dtype) -> Draw:
        sched = self.train_scheduler
        scheme = self._field("weighting_scheme")
        mean, std, mode_scale = self._field("logit_mean"), self._field("logit_std"), self._field("mode_scale")
        u = draws.timestep_density(scheme, mean, std, mode_scale).to(device)
        steps = sched.config.num_train_timesteps
        index = (u * steps).long().clamp(max=steps - 1)
        timesteps, sigmas = self._schedule_on(device)
        return Draw(timesteps[index], sigmas[index].to(dtype))

    def _schedule_on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The training schedule's timesteps and sigmas on `device`, copied there once (an index on the device
        then needs no host round trip)."""
        cached = getattr(self, "_schedule_cache", None)
        if cached is None or cached[0].device != device:
            sched = self.train_scheduler
            cached = (sched.timesteps.to(device), sched.sigmas.to(device))
            self._schedule_cache = cached
        return cached

    def loss(self, net_fn, x0, noise, draw, cond=None) -> Loss:
        cond = cond if cond is not None else {}
        sigma = _column(draw.sigma, x0)
        noisy = (1.0 - sigma) * x0 + sigma * noise
        pred = net_fn(noisy, draw.t, cond)
        weight = compute_loss_weighting_for_sd3(self._field("weighting_scheme"), sigma).view(x0.shape[0])
        mse = _per_sample_mse(pred, noise - x0)
        return Loss(mse * weight, {"mse": mse.detach()})


class EDM(Objective):
    """The elucidated preconditioning (Karras et al. 2022): lognormal training sigmas, c_skip/c_out/c_in/c_noise
    and lambda(sigma) from diffusers' EDM schedulers, sampled by EDMEuler (ddim) or EDM DPM-Solver (dpm)."""

    name = "edm"

    def _edm_scheduler(self, kind: str):
        # prediction_type "epsilon" is diffusers' name for EDM's own F-parametrization (c_out > 0).
        from diffusers.schedulers.scheduling_edm_dpmsolver_multistep import EDMDPMSolverMultistepScheduler
        from diffusers.schedulers.scheduling_edm_euler import EDMEulerScheduler

        e = self._field("edm")
        cls = EDMDPMSolverMultistepScheduler if kind == "dpm" else EDMEulerScheduler
        return cls(
            sigma_min=e.sigma_min, sigma_max=e.sigma_max, sigma_data=e.sigma_data, rho=e.rho, prediction_type="epsilon"
        )

    def _train_scheduler(self):
        return self._edm_scheduler("ddim")

    def _inference_scheduler(self, kind: str):
        return self._edm_scheduler(kind)

    def draw(self, draws, n, device, dtype) -> Draw:
        e = self._field("edm")
        sigma = (e.p_mean + e.p_std * draws.randn((1,))).exp().view(n).to(device, dtype)
        return Draw(self.train_scheduler.precondition_noise(sigma), sigma)

    def loss(self, net_fn, x0, noise, draw, cond=None) -> Loss:
        cond = cond if cond is not None else {}
        sched, sigma = self.train_scheduler, draw.sigma
        sig = _column(sigma, x0)
        noisy = x0 + sig * noise
        out = net_fn(sched.precondition_inputs(noisy, sig), draw.t, cond)
        mse = _per_sample_mse(sched.precondition_outputs(noisy, out, sig), x0)
        return Loss(mse * edm_loss_weight(sigma.float(), self._field("edm").sigma_data), {"mse": mse.detach()})


OBJECTIVES: dict[str, type[Objective]] = {c.name: c for c in (Epsilon, VPrediction, RectifiedFlow, EDM)}


def build_objective(cfg: Any, pixels: bool = True) -> Objective:
    """The objective `cfg.prediction_type` names (default epsilon), configured by `cfg`; `pixels=False` for
    a denoiser of latents (no clipping of predicted samples)."""
    kind = getattr(cfg, "prediction_type", "epsilon")
    if kind not in OBJECTIVES:
        raise ConfigError(f"prediction_type={kind!r}: choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[kind](cfg, pixels)
