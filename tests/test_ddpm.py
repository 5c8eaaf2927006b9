"""DDPM through the diffusion core (issue 25, trainer/diffusion): the ddpm and cascade tasks compute their losses
and samples through it (the task's result equals the core's, composed here from the same generators, to the bit;
that the core reproduces the tasks as they were before is tests/test_golden.py's job), backbones build tiny and
refuse conditioning they cannot use, and the objectives refuse DREAM where the cascade does. Tiny models, no
subprocesses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import assert_tensors_equal
from pydantic import ValidationError

from trainer.diffusion import (
    EDM,
    OBJECTIVES,
    Backbone,
    DiTBackbone,
    Guidance,
    ObjectiveConfig,
    RectifiedFlow,
    UNetBackbone,
    UNetBackboneConfig,
    VPrediction,
    build_backbone,
    build_objective,
    cfg_batch,
    cfg_combine,
    check_num_classes,
    default_labels,
    labels_or_null,
)
from trainer.errors import ConfigError
from trainer.randomness import Stream, per_sample_randn, sample_draws, sample_generators
from trainer.tasks.base import Batch, Phase, StepInfo, TaskContext
from trainer.tasks.cascade import CascadeConfig, CascadeTask, StageConfig
from trainer.tasks.ddpm import DDPMTask, DiffusionModelConfig
from trainer.tasks.sampling import SampleRequest, check_request

CPU = torch.device("cpu")
SEED, STEP, CLASSES = 7, 3, 10
TINY_UNET = {"block_out_channels": [8, 16], "norm_num_groups": 4}


def _batch(channels: int = 1, size: int = 8) -> Batch:
    g = torch.Generator().manual_seed(0)
    images = torch.rand((4, channels, size, size), generator=g) * 2 - 1
    return Batch(images, torch.tensor([3, -1, 0, 9]), torch.arange(4), positions=[5, 6, 7, 8])


def _unet_fn(unet):
    """The ddpm task's call of its UNet, as a core network."""
    return lambda x, t, cond: unet(x, t, class_labels=cond.get("labels")).sample


def _stage_fn(net):
    """The cascade's call of a StageNet, as a core network."""
    return lambda x, t, cond: net(x, t, cond).sample


def _assert_same_loss(mine, today):
    assert_tensors_equal({"per_sample": mine.per_sample, **mine.terms}, {"per_sample": today.per_sample, **today.terms})


# ---------------------------------------------------------------- config names, defaults and checks


@pytest.mark.parametrize("config", [DiffusionModelConfig, StageConfig], ids=["ddpm", "cascade-stage"])
def test_ddpm_and_cascade_stages_read_the_objective_keys_of_the_core(config):
    """One set of objective keys: `model.*` of ddpm and `model.stages[i].*` take the core's fields as they are
    (names, defaults, descriptions, constraints and the DREAM check)."""
    for name, core in ObjectiveConfig.model_fields.items():
        mine = config.model_fields[name]
        assert (mine.annotation, mine.description, mine.metadata) == (core.annotation, core.description, core.metadata)
        assert mine.get_default(call_default_factory=True) == core.get_default(call_default_factory=True), name
    with pytest.raises(ValidationError, match="dream=true needs prediction_type=epsilon"):
        config(**({"image_size": 8} if config is StageConfig else {}), prediction_type="flow", dream=True)


# ---------------------------------------------------------------- (1) training losses, bit for bit


@pytest.mark.parametrize("snr_gamma", [5.0, None], ids=["min-snr", "plain"])
@pytest.mark.parametrize("prediction_type", list(OBJECTIVES))
def test_the_ddpm_task_loss_is_the_core_objective_on_the_unet_backbone(prediction_type, snr_gamma):
    cfg = DiffusionModelConfig(prediction_type=prediction_type, snr_gamma=snr_gamma, num_classes=CLASSES, **TINY_UNET)
    task = DDPMTask(cfg, TaskContext(8, 1, SEED, num_classes=CLASSES))
    torch.manual_seed(0)
    unet = task.build({})["unet"]
    torch.manual_seed(0)
    net = build_backbone({"kind": "unet", **TINY_UNET}, 8, 1, CLASSES)
    # The unet backbone builds the ddpm task's UNet: the same weights from the same seed.
    theirs, ours = unet.state_dict(), net.model.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)

    batch = _batch()
    today = task.loss(Phase("unet", "unet"), {"unet": unet}, batch, None, StepInfo(STEP))

    objective = build_objective(cfg)
    x0 = batch.images
    draws = sample_draws(SEED, STEP, batch.positions, device=x0.device)
    noise = draws.randn(x0.shape[1:]).to(x0.dtype)
    draw = objective.draw(draws, len(batch), x0.device, x0.dtype)
    drop = draws.rand() < cfg.cond_drop_prob
    labels = labels_or_null(batch.labels, drop, CLASSES)
    _assert_same_loss(objective.loss(net, x0, noise, draw, {"labels": labels}), today)
    assert objective.name == prediction_type


CASCADE_OBJECTIVES = [
    ({"prediction_type": "epsilon"}, "epsilon"),
    ({"prediction_type": "v_prediction", "snr_gamma": 2.0}, "v"),
    ({"prediction_type": "epsilon", "dream": True, "dream_detail_preservation": 0.8}, "dream"),
    ({"prediction_type": "flow"}, "flow-logit-normal"),
    ({"prediction_type": "flow", "weighting_scheme": "mode", "mode_scale": 0.9}, "flow-mode"),
    ({"prediction_type": "flow", "weighting_scheme": "cosmap"}, "flow-cosmap"),
    ({"prediction_type": "flow", "weighting_scheme": "sigma_sqrt", "logit_std": 0.5}, "flow-sigma-sqrt"),
    ({"prediction_type": "edm"}, "edm"),
    ({"prediction_type": "edm", "edm": {"p_mean": -0.5, "sigma_data": 0.6}}, "edm-constants"),
]


def _cascade(stage: dict) -> tuple[CascadeTask, StageConfig]:
    s = StageConfig(image_size=8, **TINY_UNET, **stage)
    return CascadeTask(CascadeConfig(stages=[s], num_classes=CLASSES), TaskContext(8, 1, SEED, CLASSES)), s


@pytest.mark.parametrize("stage", [s for s, _ in CASCADE_OBJECTIVES], ids=[i for _, i in CASCADE_OBJECTIVES])
def test_every_cascade_stage_loss_is_the_core_objective(stage):
    task, s = _cascade(stage)
    torch.manual_seed(0)
    net = task.build({})["stage1"]
    batch = _batch()
    today = task.stage_loss(1, net, batch, STEP)

    # The objective from the stage config itself and from the core's own config of the same keys.
    own = ObjectiveConfig(**{k: v for k, v in s.model_dump().items() if k in ObjectiveConfig.model_fields})
    for objective in (build_objective(s), build_objective(own)):
        x0 = batch.images
        draws = sample_draws(SEED, STEP, batch.positions, Stream.CASCADE_STAGE, substream=1, device=x0.device)
        noise = draws.randn(x0.shape[1:]).to(x0.dtype)
        draw = objective.draw(draws, len(batch), x0.device, x0.dtype)
        drop = draws.rand() < task.cfg.cond_drop_prob
        cond = {"labels": labels_or_null(batch.labels, drop, CLASSES)}
        assert torch.equal(cond["labels"], task.conditions(4, CPU, drop, batch.labels)["labels"])
        _assert_same_loss(objective.loss(_stage_fn(net), x0, noise, draw, cond), today)


# ---------------------------------------------------------------- (2) samplers, bit for bit


@pytest.mark.parametrize("scale", [1.0, 2.5], ids=["unguided", "cfg"])
@pytest.mark.parametrize("kind", ["ddim", "dpm"])
@pytest.mark.parametrize("prediction_type", list(OBJECTIVES))
def test_the_ddpm_task_samples_with_the_core_sampler(prediction_type, kind, scale):
    cfg = DiffusionModelConfig(prediction_type=prediction_type, num_classes=CLASSES, **TINY_UNET)
    task = DDPMTask(cfg, TaskContext(8, 1, SEED, num_classes=CLASSES))
    torch.manual_seed(0)
    unet = task.build({})["unet"].eval()
    request = SampleRequest(num=4, seed=11, inference_steps=3, scheduler=kind, guidance_scale=scale)
    today = task.sample({"unet": unet}, request, CPU)

    x = torch.randn((4, 1, 8, 8), generator=torch.Generator().manual_seed(11))
    labels = default_labels(4, CLASSES)
    guidance = Guidance({"labels": labels}, {"labels": torch.full_like(labels, CLASSES)}, scale)
    out = build_objective(cfg).denoise(_unet_fn(unet), x, 3, kind, guidance)
    assert torch.equal(((out.float().clamp(-1, 1) + 1) / 2).cpu(), today)


@pytest.mark.parametrize("kind", ["ddim", "dpm"])
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "flow", "edm"])
def test_every_cascade_stage_samples_with_the_core_sampler(prediction_type, kind):
    task, s = _cascade({"prediction_type": prediction_type})
    torch.manual_seed(0)
    net = task.build({})["stage1"].eval()
    labels = default_labels(4, CLASSES)
    cond = task.conditions(4, CPU, torch.zeros(4, dtype=torch.bool), labels)
    with torch.no_grad():
        request = SampleRequest(num=4, seed=11, inference_steps=3, scheduler=kind, guidance_scale=3.0)
        today = task._run_stage(1, net, None, cond, range(4), request, CPU)

    gens = sample_generators(11, 0, range(4), Stream.CASCADE_STAGE, substream=1)
    x = per_sample_randn(gens, (1, 8, 8))
    guidance = Guidance(cond, {"labels": torch.full_like(labels, CLASSES)}, 3.0)
    assert torch.equal(build_objective(s).denoise(_stage_fn(net), x, 3, kind, guidance), today)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("kind", ["ddim", "dpm"])
def test_latent_samplers_never_clip_what_pixel_samplers_clip(prediction_type, kind):
    """An oracle denoiser of one point x0 = 3 (a latent outside [-1, 1]): the latent sampler lands on it; the
    pixel sampler's DDIM clips its x0 prediction to 1 (diffusers' default for images, what golden runs keep)."""
    target = torch.full((2, 4, 2, 2), 3.0)

    def sample(pixels: bool) -> torch.Tensor:
        objective = build_objective(ObjectiveConfig(prediction_type=prediction_type), pixels=pixels)
        abar = objective.train_scheduler.alphas_cumprod

        def oracle(x, t, cond):
            a = abar[int(t)].sqrt()
            s = (1 - abar[int(t)]).sqrt()
            eps = (x - a * target) / s
            return eps if prediction_type == "epsilon" else a * eps - s * target

        return objective.denoise(
            oracle, torch.randn(target.shape, generator=torch.Generator().manual_seed(0)), 10, kind
        )

    torch.testing.assert_close(sample(pixels=False), target, atol=1e-3, rtol=0)
    if kind == "ddim":
        assert sample(pixels=True).max() <= 1.0 + 1e-6


def test_each_objective_names_its_inference_scheduler():
    names = {
        (name, kind): type(cls(ObjectiveConfig(prediction_type=name)).inference_scheduler(kind)).__name__
        for name, cls in OBJECTIVES.items()
        for kind in ("ddim", "dpm")
    }
    assert names == {
        ("epsilon", "ddim"): "DDIMScheduler",
        ("epsilon", "dpm"): "DPMSolverMultistepScheduler",
        ("v_prediction", "ddim"): "DDIMScheduler",
        ("v_prediction", "dpm"): "DPMSolverMultistepScheduler",
        ("flow", "ddim"): "FlowMatchEulerDiscreteScheduler",
        ("flow", "dpm"): "FlowMatchEulerDiscreteScheduler",
        ("edm", "ddim"): "EDMEulerScheduler",
        ("edm", "dpm"): "EDMDPMSolverMultistepScheduler",
    }
    with pytest.raises(ConfigError, match="sample.scheduler='euler'"):
        build_objective(ObjectiveConfig()).inference_scheduler("euler")


# ---------------------------------------------------------------- (3) backbones

TINY_TRANSFORMER = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 12}
BACKBONE_CASES = {
    "unet": ({"kind": "unet", **TINY_UNET}, CLASSES, {"labels"}),
    "unet-uncond": ({"kind": "unet", **TINY_UNET}, None, set()),
    "unet-captions": (
        {"kind": "unet", **TINY_UNET, "caption_channels": 12},
        CLASSES,
        {"labels", "captions", "caption_mask"},
    ),
    "dit": ({"kind": "dit", **TINY_TRANSFORMER}, CLASSES, {"labels"}),
    "dit-uncond": ({"kind": "dit", **TINY_TRANSFORMER}, None, set()),
    "pixart": ({"kind": "pixart", **TINY_TRANSFORMER, "caption_channels": 12}, None, {"captions", "caption_mask"}),
    "pixart-sizes": (
        {
            "kind": "pixart",
            **TINY_TRANSFORMER,
            "caption_channels": 12,
            "use_additional_conditions": True,
            "pixel_scale": 8,
        },
        None,
        {"captions", "caption_mask", "resolution", "aspect_ratio"},
    ),
    "mmdit": (
        {"kind": "mmdit", **TINY_TRANSFORMER, "caption_channels": 12, "pooled_channels": 6},
        None,
        {"captions", "pooled"},
    ),
}
UNITS = {
    "unet": "DownBlock2D",
    "dit": "BasicTransformerBlock",
    "pixart": "BasicTransformerBlock",
    "mmdit": "JointTransformerBlock",
}


def _conditions(accepts, n: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    every = {
        "labels": torch.tensor([0, 3, 9, CLASSES])[:n],
        "captions": torch.randn((n, 5, 12), generator=g),
        "caption_mask": torch.tensor([[1, 1, 1, 0, 0]] * n),
        "pooled": torch.randn((n, 6), generator=g),
        "resolution": torch.tensor([[64.0, 64.0]] * n),
        "aspect_ratio": torch.ones(n, 1),
    }
    return {k: v for k, v in every.items() if k in accepts}


@pytest.mark.parametrize("case", list(BACKBONE_CASES))
def test_each_backbone_builds_tiny_runs_with_its_conditioning_and_refuses_the_rest(case):
    cfg, classes, accepts = BACKBONE_CASES[case]
    torch.manual_seed(0)
    net = build_backbone(cfg, 8, 3, classes)
    assert isinstance(net, Backbone) and net.accepts == accepts and net.kind == cfg["kind"]
    assert UNITS[net.kind] in net.fsdp_unit_classes and net.fsdp_units
    x = torch.randn(4, 3, 8, 8)
    cond = _conditions(accepts)
    assert net(x, torch.tensor([1, 10, 100, 999]), cond).shape == x.shape
    assert net(x, torch.tensor(500), cond).shape == x.shape  # a sampler's scalar timestep
    assert torch.equal(net(x, torch.tensor(7), cond), net.call(net.model, x, torch.tensor(7), cond))
    for extra in {"labels", "captions", "pooled"} - accepts:
        with pytest.raises(ConfigError, match=f"the {net.kind} backbone takes .*cannot use {extra}"):
            net(x, torch.tensor(1), {**cond, extra: _conditions({extra}).get(extra, torch.zeros(4))})
    for needed in net.requires:
        with pytest.raises(ConfigError, match=f"the {net.kind} backbone needs {needed}"):
            net(x, torch.tensor(1), {k: v for k, v in cond.items() if k != needed})


@pytest.mark.parametrize("objective", list(OBJECTIVES))
@pytest.mark.parametrize("case", ["unet", "dit", "pixart", "mmdit"])
def test_every_objective_trains_and_samples_every_backbone(objective, case):
    cfg, classes, accepts = BACKBONE_CASES[case]
    torch.manual_seed(0)
    net = build_backbone(cfg, 8, 3, classes)
    obj = build_objective(ObjectiveConfig(prediction_type=objective))
    x0 = torch.rand(4, 3, 8, 8) * 2 - 1
    draws = sample_draws(SEED, STEP, range(4))
    noise = draws.randn(x0.shape[1:])
    cond = _conditions(accepts)
    loss = obj.loss(net, x0, noise, obj.draw(draws, 4, CPU, x0.dtype), cond)
    loss.per_sample.mean().backward()
    assert loss.per_sample.shape == (4,) and torch.isfinite(loss.per_sample).all()
    assert all(p.grad is not None for p in net.parameters() if p.requires_grad)
    uncond = {k: torch.zeros_like(v) for k, v in cond.items() if k != "labels"}
    if "labels" in cond:
        uncond["labels"] = torch.full((4,), CLASSES)
    out = obj.denoise(net.eval(), noise, 2, "dpm", Guidance(cond, uncond, 2.0))
    assert out.shape == x0.shape and torch.isfinite(out).all()


def test_dit_leaves_label_dropout_to_gentrain():
    """diffusers' DiT drops labels in train mode with the global RNG; the core draws dropout per sample itself
    and passes the null class, so a training forward neither consumes the global RNG nor varies with it."""
    torch.manual_seed(0)
    net = build_backbone({"kind": "dit", **TINY_TRANSFORMER}, 8, 3, CLASSES).train()
    assert isinstance(net, DiTBackbone)
    x, t, cond = torch.randn(4, 3, 8, 8), torch.tensor([1, 2, 3, 4]), {"labels": torch.tensor([0, 1, 2, CLASSES])}
    state = torch.get_rng_state()
    first = net(x, t, cond)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(123)
    assert torch.equal(net(x, t, cond), first)
    null = net.model.transformer_blocks[0].norm1.emb.class_embedder.embedding_table
    assert null.num_embeddings == CLASSES + 1


def test_backbone_geometry_and_conditioning_refusals():
    with pytest.raises(ConfigError, match="patch_size=3 does not divide the dit backbone's input size 8"):
        build_backbone({"kind": "dit", **TINY_TRANSFORMER, "patch_size": 3}, 8, 3, CLASSES)
    with pytest.raises(ConfigError, match="pixart backbone is conditioned on captions, not class labels"):
        build_backbone({"kind": "pixart", **TINY_TRANSFORMER, "caption_channels": 12}, 8, 3, CLASSES)
    with pytest.raises(ConfigError, match="mmdit backbone is conditioned on captions"):
        build_backbone({"kind": "mmdit", **TINY_TRANSFORMER, "caption_channels": 4, "pooled_channels": 4}, 8, 3, 5)
    with pytest.raises(ConfigError, match="width divisible by 3: .* = 16"):
        build_backbone(
            {
                "kind": "pixart",
                "num_attention_heads": 2,
                "attention_head_dim": 8,
                "caption_channels": 4,
                "use_additional_conditions": True,
            },
            8,
            3,
        )
    with pytest.raises(ValidationError, match="divisible by model.backbone.norm_num_groups=3"):
        build_backbone({"kind": "unet", "block_out_channels": [8, 16], "norm_num_groups": 3}, 8, 3)
    with pytest.raises(ValidationError, match="'unet', 'dit', 'pixart', 'mmdit'"):
        build_backbone({"kind": "vit"}, 8, 3)
    net = UNetBackbone.build(UNetBackboneConfig(), 8, 1, None)
    assert net.accepts == frozenset() and net.model.config.num_class_embeds is None


# ---------------------------------------------------------------- (4) refusals


@pytest.mark.parametrize("prediction_type", ["v_prediction", "flow", "edm"])
def test_dream_is_refused_for_every_objective_but_epsilon(prediction_type):
    # As a config: the cascade's message, word for word (load_config turns it into exit 2).
    with pytest.raises(ValidationError, match=f"dream=true needs prediction_type=epsilon .*got {prediction_type}"):
        ObjectiveConfig(prediction_type=prediction_type, dream=True)
    with pytest.raises(ValidationError, match=f"dream=true needs prediction_type=epsilon .*got {prediction_type}"):
        StageConfig(image_size=8, prediction_type=prediction_type, dream=True)
    # Built from any config that slipped past validation: a ConfigError naming the objective.
    unchecked = ObjectiveConfig.model_construct(prediction_type=prediction_type, dream=True)
    with pytest.raises(ConfigError, match=f"not to prediction_type={prediction_type}"):
        build_objective(unchecked)
    with pytest.raises(ConfigError, match=f"not to prediction_type={prediction_type}"):
        OBJECTIVES[prediction_type](SimpleNamespace(dream=True))
    assert build_objective(ObjectiveConfig(dream=True)).supports_dream


@pytest.mark.parametrize("cls", [RectifiedFlow, EDM])
def test_snr_gamma_is_ignored_by_flow_and_edm_as_the_cascade_does(cls):
    """The cascade never refused snr_gamma for flow or EDM (its default, 5.0, is on for every stage), so the
    core keeps ignoring it there rather than refusing configs that train today."""
    net = build_backbone({"kind": "unet", **TINY_UNET}, 8, 1)
    x0 = _batch().images
    losses = []
    for gamma in (5.0, None):
        obj = cls(ObjectiveConfig(prediction_type=cls.name, snr_gamma=gamma))
        draws = sample_draws(SEED, STEP, range(4))
        noise = draws.randn(x0.shape[1:])
        losses.append(obj.loss(net, x0, noise, obj.draw(draws, 4, CPU, x0.dtype)).per_sample)
    assert torch.equal(*losses) and not cls.uses_snr_gamma and VPrediction.uses_snr_gamma


def test_unknown_prediction_type_is_refused():
    with pytest.raises(ConfigError, match="prediction_type='x0': choose one of epsilon, v_prediction, flow, edm"):
        build_objective(SimpleNamespace(prediction_type="x0"))


# ---------------------------------------------------------------- guidance helpers


def test_guidance_helpers():
    assert default_labels(7, 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    labels = torch.tensor([4, -1, 2])
    assert labels_or_null(labels, torch.tensor([False, False, True]), 5).tolist() == [4, 5, 5]
    both = cfg_batch({"labels": torch.tensor([1, 2]), "lowres": torch.ones(2, 1)}, {"labels": torch.tensor([9, 9])})
    assert both["labels"].tolist() == [1, 2, 9, 9] and both["lowres"].shape == (4, 1)  # unguided entry shared
    assert cfg_combine(torch.tensor([3.0, 1.0]), 2.0).tolist() == [5.0]  # 1 + 2 * (3 - 1)
    calls = []
    g = Guidance({"labels": torch.tensor([1])}, {"labels": torch.tensor([0])}, 1.0)
    g.predictor(lambda x, t, c: calls.append(len(x)) or x)(torch.zeros(1), 0)
    assert not g.active and calls == [1]  # scale 1: one plain forward
    check_num_classes(10, 10)
    check_num_classes(10, None)
    with pytest.raises(ConfigError) as mine:
        check_num_classes(10, 5)
    with pytest.raises(ConfigError) as today:
        DDPMTask(DiffusionModelConfig(num_classes=10), TaskContext(8, 1, 0, num_classes=5))
    assert str(mine.value) == str(today.value)


# ---------------------------------------------------------------- (5) ddpm trains every objective and the dit backbone


def _best_constant_loss(loss_of, shape) -> float:
    """The lowest held-out loss any input-independent network reaches on these draws.

    Every objective's per-sample loss is w_i * mean_p (F_ip - y_ip)^2 in the network output F (epsilon, v and
    flow: y the target, w the min-SNR or SD3 weight; EDM: D = c_skip x + c_out F, so w = lambda c_out^2 and
    y = (x0 - c_skip x) / c_out). Its value and gradient at F = 0 give w and y; the best F that ignores its
    input is then, per pixel, c_p = sum_i w_i y_ip / sum_i w_i. A trained network below this loss uses its
    input: no constant output, not even one fitted to this very batch, gets there."""
    out = torch.zeros(shape, requires_grad=True)
    loss = loss_of(out)  # per-sample loss of a network whose output is `out` whatever its inputs
    (grad,) = torch.autograd.grad(loss.sum(), out)
    pixels = out[0].numel()
    g = grad.flatten(1).double()
    w = (g**2).sum(1) * pixels / (4 * loss.detach().double())  # sum_p g^2 = 4 w^2 sum_p y^2 / P^2
    y = -g * pixels / (2 * w[:, None])
    c = (w[:, None] * y).sum(0) / w.sum()
    return float((w * ((y - c) ** 2).mean(1)).mean())


_TRANSFORMER = "num_layers: 2, num_attention_heads: 2, attention_head_dim: 12"
DDPM_RUNS = {
    "flow": ["model.prediction_type=flow"],
    "edm": ["model.prediction_type=edm"],
    "dit": [f"model.backbone={{kind: dit, {_TRANSFORMER}}}"],
    # captions ("a handwritten seven") through the shipped 384-wide sentence encoder
    "pixart": [f"model.backbone={{kind: pixart, {_TRANSFORMER}, caption_channels: 384}}"],
    "mmdit": [f"model.backbone={{kind: mmdit, {_TRANSFORMER}, caption_channels: 384, pooled_channels: 384}}"],
}


@pytest.mark.parametrize("run", list(DDPM_RUNS))
def test_ddpm_trains_flow_edm_and_every_backbone_on_the_digits(run, tmp_path, monkeypatch):
    """80 Adam steps on digits batches (8x8, a tiny network, one CPU thread): on a fixed held-out batch with
    fixed draws the loss falls below what the best input-independent output reaches (see above), so the
    network learned to read its inputs; then the objective's own sampler turns noise into images."""
    # The data and engine layers: only this test needs real batches.
    from trainer.data import build_splits, collate
    from trainer.data.sampler import SampleRef
    from trainer.engine.step import to_device
    from trainer.registry import load_config

    torch.manual_seed(0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformer = run in ("dit", "pixart", "mmdit")
    unet = [] if transformer else ["model.block_out_channels=[8,16]", "model.norm_num_groups=4"]
    text = [f"model.text={{cache_dir: {tmp_path}/text, max_tokens: 8}}"] if run in ("pixart", "mmdit") else []
    cfg = load_config("digits-ddpm", ["data.image_size=8", *unet, *text, *DDPM_RUNS[run]], {})
    train_set, val_set, _ = build_splits(cfg)
    task = DDPMTask(cfg.model_cfg, TaskContext(8, 1, 0))
    net = task.build({})[task.part]
    assert task.part == ("transformer" if transformer else "unet")
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    phase, backbone = Phase(task.part, task.part), task.backbone

    def batch(subset, start: int, n: int):
        refs = [SampleRef(index=i, position=i - start) for i in range(start, start + n)]
        return to_device(collate([subset[r] for r in refs]), 0, n, CPU)

    def held_out_loss() -> float:
        with torch.no_grad():
            return task.loss(phase, {task.part: net}, held_out, None, StepInfo(-1)).per_sample.mean().item()

    held_out = batch(val_set, 0, 32)
    before = held_out_loss()
    for step in range(80):
        loss = task.loss(phase, {task.part: net}, batch(train_set, step * 16, 16), None, StepInfo(step))
        opt.zero_grad()
        loss.per_sample.mean().backward()
        # every parameter takes part (DDP would otherwise stall waiting for its gradient)
        assert step or not [n for n, p in net.named_parameters() if p.requires_grad and p.grad is None]
        opt.step()
    after = held_out_loss()

    def loss_of(out):
        task.backbone = SimpleNamespace(call=lambda module, x, t, cond: out, accepts=backbone.accepts)
        return task.loss(Phase("x", "x"), {task.part: None}, held_out, None, StepInfo(-1)).per_sample

    floor = _best_constant_loss(loss_of, held_out.images.shape)
    task.backbone = backbone
    print(f"{run}: held-out loss {before:.3f} -> {after:.3f}; best constant output {floor:.3f}")
    assert after < before and after < floor, (before, after, floor)
    prompts = ["a handwritten seven"] if text else None
    images = task.sample({task.part: net.eval()}, SampleRequest(num=8, inference_steps=10, prompts=prompts), CPU)
    assert images.shape == (8, 1, 8, 8) and torch.isfinite(images).all() and images.std() > 0.05


ENGINE_RUNS = {
    "dit-edm-classes": (
        "{kind: dit, num_layers: 1, num_attention_heads: 2, attention_head_dim: 8}",
        ["model.prediction_type=edm", "model.num_classes=10"],
        "DiTTransformer2DModel",
    ),
    "mmdit-flow-captions": (
        "{kind: mmdit, num_layers: 1, num_attention_heads: 2, attention_head_dim: 8, caption_channels: 384, "
        "pooled_channels: 384}",
        ["model.prediction_type=flow", "model.text={max_tokens: 8}"],
        "SD3Transformer2DModel",
    ),
}


@pytest.mark.parametrize("run", list(ENGINE_RUNS))
def test_ddpm_with_a_transformer_backbone_trains_checkpoints_and_samples_through_the_engine(
    run, tmp_path, caplog, monkeypatch
):
    """The engine's view of a transformer denoiser: part `transformer` (optimizer, EMA, checkpoint files of
    that name), guided samples (class labels or a prompt) from its checkpoint; the tiny config's UNet keys are
    overridden by model.backbone, and the log says so."""
    # The engine and checkpoint layers: an in-process training run.
    from conftest import tiny

    from trainer.checkpoint import CheckpointStore
    from trainer.elastic import DistEnv
    from trainer.loop import Trainer
    from trainer.registry import load_config
    from trainer.runs import load_for_inference

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HOME", str(tmp_path))  # the text encoder's default cache, ~/.cache/gentrain/text
    backbone, extra, cls = ENGINE_RUNS[run]
    cfg = load_config(None, tiny(tmp_path, f"model.backbone={backbone}", *extra, max_steps=2), environ={})
    with caplog.at_level("WARNING", logger="trainer.tasks.ddpm"):
        assert Trainer(cfg, DistEnv()).fit() == 0
    # tiny()'s UNet keys over the default preset's (digits-ddpm): those that differ from the defaults
    assert "the UNet keys model.attention, model.block_out_channels, model.norm_num_groups are ignored" in caplog.text
    store = CheckpointStore(str(tmp_path / "run" / "checkpoints"))
    info = store.latest_valid()
    assert {"transformer.model.safetensors", "transformer.ema.safetensors"} <= set(info.manifest.files)
    _, task, modules = load_for_inference(store.view(info), True, CPU)
    assert list(modules) == ["transformer"] and type(modules["transformer"]).__name__ == cls
    text = task.text is not None
    if text:
        assert info.manifest.inputs["text_encoder"].digest == task.text.digest
    request = SampleRequest(num=4, seed=1, inference_steps=2, prompts=["a handwritten seven"] if text else None)
    guided = task.sample(modules, request.replace(guidance_scale=3.0), CPU)
    assert guided.shape == (4, 1, 8, 8) and torch.isfinite(guided).all()
    assert not torch.equal(guided, task.sample(modules, request.replace(guidance_scale=1.0), CPU))
    with pytest.raises(ConfigError, match="backbone, not a diffusers UNet"):
        task.export_unets(modules)
    # The condition this model lacks is refused by the sampling contract, naming the flag.
    asked = request.replace(labels=torch.zeros(4, dtype=torch.long), prompts=["x"])
    refused, kind = ("--class", "captions") if text else ("--prompt", "class labels")
    with pytest.raises(ConfigError, match=f"^{refused}: this ddpm checkpoint is conditioned on {kind} "):
        check_request(asked, task.sample_accepts(), "ddpm")


@pytest.mark.parametrize(
    ("backbone", "message"),
    [
        ("{kind: pixart, caption_channels: 8}", "kind=pixart is conditioned on captions: set model.text"),
        ("{kind: mmdit, caption_channels: 8, pooled_channels: 8}", "kind=mmdit is conditioned on captions: set"),
        ("{kind: unet, caption_channels: 8}", "kind=unet with caption_channels is conditioned on captions"),
        ("{kind: vit}", "'unet', 'dit', 'pixart', 'mmdit'"),
        ("{kind: dit}\nmodel.text: {}", "model.text: this denoiser cannot read captions"),
        ("{kind: pixart, caption_channels: 8}\nmodel.text: {}", "caption_channels=8 but model.text.width=384"),
        (
            "{kind: mmdit, caption_channels: 384, pooled_channels: 8}\nmodel.text: {}",
            "pooled_channels=8 but model.text.width=384",
        ),
        (
            "{kind: mmdit, caption_channels: 384, pooled_channels: 384}\nmodel.text: {}\nmodel.num_classes: 10",
            "conditioned on captions, not class labels",
        ),
    ],
)
def test_ddpm_refuses_backbones_it_cannot_condition(backbone, message):
    # The config layer: how a user's key reaches the schema.
    from trainer.registry import load_config

    first, *more = backbone.split("\n")
    overrides = [f"model.backbone={first}", *(m.replace(": ", "=", 1) for m in more)]
    with pytest.raises(ConfigError, match=message):
        load_config("digits-ddpm", overrides, {})


# ---------------------------------------------------------------- (6) cascade stages with transformer backbones

_STAGE_UNET = "block_out_channels: [8, 16], norm_num_groups: 4, attention: false"
CASCADE_RUNS = {
    # stage 1, class-conditional DiT (labels through its adaLN)
    "dit-stage-1": (1, [f"model.stages=[{{image_size: 8, backbone: {{kind: dit, {_TRANSFORMER}}}}}]"]),
    # stage 2 super-resolution over a UNet stage 1: conditions as caption tokens
    "pixart-stage-2": (
        2,
        [
            f"model.stages=[{{image_size: 4, {_STAGE_UNET}}}, "
            f"{{image_size: 8, backbone: {{kind: pixart, {_TRANSFORMER}, caption_channels: 24}}}}]"
        ],
    ),
    "mmdit-stage-2": (
        2,
        [
            f"model.stages=[{{image_size: 4, {_STAGE_UNET}}}, "
            f"{{image_size: 8, backbone: {{kind: mmdit, {_TRANSFORMER}, caption_channels: 24, pooled_channels: 16}}}}]"
        ],
    ),
}


@pytest.mark.parametrize("run", list(CASCADE_RUNS))
def test_cascade_stages_train_on_transformer_backbones(run):
    """A cascade stage whose denoiser is a transformer (model.stages[i].backbone), class-conditional on the
    digits: 80 Adam steps take its held-out loss below the best input-independent output's (as for ddpm
    above), and the cascade samples through it with guidance."""
    # The data and engine layers: only this test needs real batches.
    from trainer.data import build_splits, collate
    from trainer.data.sampler import SampleRef
    from trainer.engine.step import to_device
    from trainer.registry import load_config

    torch.manual_seed(0)
    k, overrides = CASCADE_RUNS[run]
    cfg = load_config("digits-cascade", ["data.image_size=8", *overrides], {})
    train_set, val_set, _ = build_splits(cfg)
    task = CascadeTask(cfg.model_cfg, TaskContext(8, 1, 0, num_classes=CLASSES))
    nets = task.build({})
    net = nets[f"stage{k}"]
    assert type(net).__name__ == "TransformerStageNet"
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)

    def batch(subset, start: int, n: int):
        refs = [SampleRef(index=i, position=i - start) for i in range(start, start + n)]
        return to_device(collate([subset[r] for r in refs]), 0, n, CPU)

    held_out = batch(val_set, 0, 32)
    with torch.no_grad():
        before = task.stage_loss(k, net, held_out, -1).per_sample.mean().item()
    for step in range(80):
        loss = task.stage_loss(k, net, batch(train_set, step * 16, 16), step).per_sample.mean()
        opt.zero_grad()
        loss.backward()
        # every parameter takes part (DDP would otherwise stall waiting for its gradient)
        assert step or not [n for n, p in net.named_parameters() if p.requires_grad and p.grad is None]
        opt.step()
    with torch.no_grad():
        after = task.stage_loss(k, net, held_out, -1).per_sample.mean().item()
    floor = _best_constant_loss(
        lambda out: task.stage_loss(k, lambda x, t, c: SimpleNamespace(sample=out), held_out, -1).per_sample,
        held_out.images.shape,
    )
    print(f"{run}: held-out loss {before:.3f} -> {after:.3f}; best constant output {floor:.3f}")
    assert after < before and after < floor, (before, after, floor)
    modules = {name: m.eval() for name, m in nets.items()}
    images = task.sample(modules, SampleRequest(num=4, inference_steps=4, guidance_scale=2.0), CPU)
    assert images.shape == (4, 1, 8, 8) and torch.isfinite(images).all()
    with pytest.raises(ConfigError, match=f"stage{k} of this cascade is a transformer backbone"):
        task.export_unets(modules)


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (
            f"[{{image_size: 4, {_STAGE_UNET}}}, {{image_size: 8, backbone: {{kind: dit}}}}]",
            "stages\\[1\\].backbone.kind=dit: a super-resolution stage",
        ),
        ("[{image_size: 8, attention: false, backbone: {kind: dit}}]", "attention shape the stage's UNet"),
        ("[{image_size: 8, pretrained: /x, backbone: {kind: dit}}]", "a stage with a backbone starts from scratch"),
        ("[{image_size: 8, backbone: {kind: unet}}]", "'dit', 'pixart', 'mmdit'"),
    ],
)
def test_cascade_refuses_backbones_a_stage_cannot_use(stages, message):
    # The config layer: how a user's key reaches the schema.
    from trainer.registry import load_config

    with pytest.raises(ConfigError, match=message):
        load_config("digits-cascade", [f"model.stages={stages}", "data.image_size=8"], {})
    if "dit: a super" in message:
        text = ["model.stages=[{image_size: 8, backbone: {kind: dit}}]", "model.text={}", "model.num_classes=null"]
        with pytest.raises(ConfigError, match="conditions on class labels only"):
            load_config("digits-cascade", [*text, "data.image_size=8"], {})


CASCADE_ENGINE_RUNS = {
    "dit-then-mmdit-classes": (
        [
            f"model.stages=[{{image_size: 4, backbone: {{kind: dit, {_TRANSFORMER}}}}}, {{image_size: 8, backbone: "
            f"{{kind: mmdit, {_TRANSFORMER}, caption_channels: 24, pooled_channels: 16}}}}]"
        ],
        {"labels": torch.full((4,), 7)},
    ),
    "pixart-then-unet-captions": (
        [
            f"model.stages=[{{image_size: 4, backbone: {{kind: pixart, {_TRANSFORMER}, caption_channels: 24}}}}, "
            f"{{image_size: 8, {_STAGE_UNET}}}]",
            "model.num_classes=null",
            "model.context_dim=16",
            "model.text={max_tokens: 8}",
        ],
        {"prompts": ["a handwritten seven"] * 4},
    ),
}


@pytest.mark.parametrize("run", list(CASCADE_ENGINE_RUNS))
def test_cascade_with_transformer_stages_trains_checkpoints_and_samples_through_the_engine(run, tmp_path, monkeypatch):
    """Two stages, one or both transformers, trained together by the engine (2 steps), then sampled from the
    checkpoint with guidance on a class or a prompt; a transformer stage's weights are its own part."""
    # The engine and checkpoint layers: an in-process training run.
    from conftest import REPO

    from trainer.checkpoint import CheckpointStore
    from trainer.elastic import DistEnv
    from trainer.loop import Trainer
    from trainer.registry import load_config
    from trainer.runs import load_for_inference

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HOME", str(tmp_path))  # the text encoder's default cache, ~/.cache/gentrain/text
    overrides, conditions = CASCADE_ENGINE_RUNS[run]
    args = [*overrides, f"run.dir={tmp_path}/run", "train.max_steps=2", "sample.inference_steps=2"]
    cfg = load_config(str(REPO / "tests" / "cascade.yaml"), args, environ={})
    assert Trainer(cfg, DistEnv()).fit() == 0
    store = CheckpointStore(str(tmp_path / "run" / "checkpoints"))
    info = store.latest_valid()
    assert {"stage1.model.safetensors", "stage2.model.safetensors"} <= set(info.manifest.files)
    _, task, modules = load_for_inference(store.view(info), True, CPU)
    request = SampleRequest(num=4, seed=1, inference_steps=2, **conditions)
    guided = task.sample(modules, request.replace(guidance_scale=3.0), CPU)
    assert guided.shape == (4, 1, 8, 8) and torch.isfinite(guided).all()
    assert not torch.equal(guided, task.sample(modules, request.replace(guidance_scale=1.0), CPU))


def test_every_transformer_block_is_an_fsdp_unit_and_dits_first_stays_gathered_after_forward():
    """What the engine shards (trainer.engine.shard) of a ddpm part and a cascade stage: each transformer block
    is its own FSDP unit. diffusers' DiT calls its first block's embedding again after the last block, so that
    unit keeps its weights gathered from its forward to its backward instead of DiT being refused under FSDP
    (tests/test_diffusion_fsdp.py trains every transformer under torchrun with FSDP)."""
    # The engine layer: the units it makes of a part.
    from trainer.engine.shard import fsdp_units, gathered_units

    dit = DDPMTask(DiffusionModelConfig(backbone={"kind": "dit", **TINY_TRANSFORMER}), TaskContext(8, 1, 0))
    assert dit.fsdp_refusal() is None
    part = dit.build({})[dit.part]
    assert fsdp_units(part) == list(part.transformer_blocks) == dit.backbone.fsdp_units
    assert len(part.transformer_blocks) == TINY_TRANSFORMER["num_layers"]
    assert gathered_units(part) == [part.transformer_blocks[0]]
    for case in ("pixart", "mmdit"):
        net = build_backbone(BACKBONE_CASES[case][0], 8, 3).model
        assert fsdp_units(net) == list(net.transformer_blocks) and gathered_units(net) == []

    stages = [
        StageConfig(image_size=4, backbone={"kind": "dit", **TINY_TRANSFORMER}),
        StageConfig(image_size=8, **TINY_UNET),
    ]
    task = CascadeTask(CascadeConfig(stages=stages), TaskContext(8, 1, 0))
    assert task.fsdp_refusal() is None
    stage = task.build({})["stage1"]
    blocks = stage.backbone.model.transformer_blocks
    assert fsdp_units(stage) == list(blocks) and gathered_units(stage) == [blocks[0]]
    stage.backbone.model.fsdp_gathered_units = ("pos_embed",)
    with pytest.raises(ValueError, match="name no FSDP unit: backbone.model.pos_embed"):
        gathered_units(stage)
