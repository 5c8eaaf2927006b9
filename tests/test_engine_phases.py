"""The engine's phases around the training step, each on its own, in-process, with a real task built by
the Trainer from a tiny digits preset (its task, parts, splits and runtime; nothing of the phase replaced):

- validation (trainer/engine/validate.py): the reported value of each metric is the mean of the task's
  per-sample values over the held-out batches, whatever the chunking, computed in eval mode (a DiT's dropout
  off); its draws do not depend on where the global RNG stands; weights and train mode unchanged;
- previews (trainer/engine/preview.py): `samples/step-N.png` holds the seeded samples of the EMA weights (or
  the online ones with sample.use_ema=false), the same at every call; reconstructions are of the same held-out
  batch every time; `sample.prompts` on a model without captions is refused;
- calibration (trainer/engine/calibrate.py): the first `calibration_size()` training images, in chunks,
  measured with the EMA weights (an autoencoder's 1 / std of its latents), when a checkpoint is due;
- evaluation (trainer/engine/evaluate.py): FID/KID reported and written as `eval-<step>.json` beside the
  checkpoints with the step, world size and feature network, the same for the same weights and seed.

Each phase also runs only when due (`every_steps` and the last step)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import tiny
from PIL import Image
from tiny_backbones import backbone_override

from trainer.data import collate, validation_refs
from trainer.elastic import DistEnv
from trainer.engine.calibrate import Calibrator
from trainer.engine.evaluate import Evaluator
from trainer.engine.parts import eval_mode
from trainer.engine.preview import Previewer
from trainer.engine.step import to_device
from trainer.engine.validate import Validator
from trainer.errors import ConfigError
from trainer.eval.fid import eval_result_name
from trainer.loop import Trainer
from trainer.registry import load_config
from trainer.tasks.sampling import SampleRequest


def build(root, preset: str, *overrides: str) -> Iterator[Trainer]:
    t = Trainer(load_config(preset, tiny(root, *overrides, max_steps=4), environ={}), DistEnv())
    try:
        yield t
    finally:
        t.close()


@pytest.fixture(scope="module")
def autoencoder(tmp_path_factory) -> Iterator[Trainer]:
    """digits-autoencoder: validation without draws (the posterior mean), reconstruction previews, a
    calibrated latent scaling factor (the first 24 training images)."""
    root = tmp_path_factory.mktemp("ae")
    yield from build(
        root, "digits-autoencoder", "model.disc_channels=8", "model.disc_layers=1", "model.scale_samples=24"
    )


@pytest.fixture(scope="module")
def ddpm(tmp_path_factory) -> Iterator[Trainer]:
    """digits-ddpm with a tiny DiT with dropout (off in eval mode, which each phase must set): validation that
    draws noise and timesteps, sampled previews, FID/KID on 16 images."""
    root = tmp_path_factory.mktemp("ddpm")
    dit = backbone_override("dit", dropout=0.5)
    yield from build(root, "digits-ddpm", dit, "model.num_classes=10", "eval.every_steps=2", "eval.num=16")


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {f"{n}.{k}": v.detach().clone() for n, p in t.parts.items() for k, v in p.module.state_dict().items()}


def assert_untouched(t: Trainer, before: dict[str, torch.Tensor]) -> None:
    after = weights(t)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert all(p.module.training for p in t.parts.values())


def batch_of(dataset, indices) -> object:
    refs = [r for group in validation_refs(dataset, 1, max(indices) + 1, 0, 1) for r in group if r.index in indices]
    return to_device(collate([dataset[r] for r in refs]), 0, len(refs), torch.device("cpu"))


class Recorded(list):
    """A phase's `report` callback: the calls' arguments, in order."""

    def __call__(self, *args, **kwargs):
        self.append(args)


def perturbed_online_weights(t: Trainer, part: str):
    """Moves the online weights of `part` away from its EMA weights (equal at the start of a run), so what
    a phase computes tells which it used; returns a function that puts them back."""
    module = t.parts[part].module
    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g) * (p.abs().mean() + 1e-3))
    return lambda: module.load_state_dict(saved)


def with_weights(t: Trainer, part: str, state: dict[str, torch.Tensor]):
    """A context in which `part` holds `state` (the online weights again after)."""
    module = t.parts[part].module
    online = {k: v.detach().clone() for k, v in module.state_dict().items()}

    class _Swap:
        def __enter__(self):
            module.load_state_dict(state)

        def __exit__(self, *exc):
            module.load_state_dict(online)

    return _Swap()


# ---------------------------------------------------------------------------------------------- validation


def validator(t: Trainer, report, *, batches: int, chunk_size: int, every_steps: int = 2) -> Validator:
    return Validator(
        t.task,
        t.parts,
        t.frozen,
        t.val_set,
        runtime=t.runtime,
        every_steps=every_steps,
        batches=batches,
        chunk_size=chunk_size,
        report=report,
    )


def test_validation_reports_each_metrics_mean_over_the_held_out_samples_whatever_the_chunks(autoencoder):
    t = autoencoder
    n = len(t.val_set)
    assert 40 < n < 160  # the chunkings below: 80 + the rest, and all in one
    before = weights(t)
    # The task's per-sample values, one sample at a time (the autoencoder's validation draws nothing).
    per_sample: dict[str, list[float]] = {}
    with torch.no_grad(), eval_mode({k: p.module for k, p in t.parts.items()}):
        for i in range(n):
            for name, v in t.task.validate({k: p.module for k, p in t.parts.items()}, batch_of(t.val_set, [i])).items():
                per_sample.setdefault(name, []).append(float(v))
    expected = {f"val/{k}": sum(v) / n for k, v in per_sample.items()}
    assert {"val/mse", "val/psnr", "val/kl"} <= set(expected)
    for batches, chunk in ((2, 80), (1, n)):  # an 80-sample chunk and a short one; one chunk of all
        report = Recorded()
        values = validator(t, report, batches=batches, chunk_size=chunk).run(2)
        assert report == [(2, values)]
        assert values.keys() == expected.keys()
        for k in expected:  # the mean over samples (a mean of the chunks' means would weigh the short one up)
            assert values[k] == pytest.approx(expected[k], rel=1e-4, abs=1e-6), k
    # Fewer batches: only the first ones of the split.
    first = validator(t, Recorded(), batches=1, chunk_size=8).run(2)
    assert first["val/mse"] == pytest.approx(sum(per_sample["mse"][:8]) / 8, rel=1e-4)
    assert_untouched(t, before)


def test_validation_draws_do_not_depend_on_the_global_rng_and_it_runs_when_due(ddpm):
    t = ddpm
    before = weights(t)
    v = validator(t, Recorded(), batches=2, chunk_size=8, every_steps=2)
    at2 = v.run(2)
    # The task's per-sample losses of the same two chunks (its draws keyed by the samples' positions), dropout off
    modules = {k: p.module for k, p in t.parts.items()}
    with torch.no_grad(), eval_mode(modules):
        losses = [t.task.validate(modules, batch_of(t.val_set, range(i, i + 8)))["loss"] for i in (0, 8)]
    assert at2["val/loss"] == pytest.approx(float(torch.cat(losses).double().mean()), rel=1e-5)
    torch.manual_seed(123)
    torch.rand(100)  # wherever the global RNG stands, validation at a step draws the same
    assert v.run(2) == at2
    assert_untouched(t, before)
    report = Recorded()
    v = validator(t, report, batches=2, chunk_size=8, every_steps=2)
    assert v.maybe_run(3) is None and report == []
    assert v.maybe_run(4) is not None and v.maybe_run(5, last=True) is not None
    assert [step for step, _ in report] == [4, 5]
    assert not validator(t, Recorded(), batches=2, chunk_size=8, every_steps=0).enabled


# ---------------------------------------------------------------------------------------------- previews


def previewer(t: Trainer, tmp_path, report, **changes) -> Previewer:
    cfg = t.cfg.sample.model_copy(update=changes)
    held_out = t.val_set or t.train_set
    return Previewer(
        t.task, t.parts, t.frozen, held_out, runtime=t.runtime, cfg=cfg, run_dir=str(tmp_path), report=report
    )


def test_a_preview_grid_is_the_seeded_samples_of_the_ema_weights_every_time(ddpm, tmp_path):
    t = ddpm
    s = t.cfg.sample
    request = SampleRequest(
        num=s.num,
        seed=t.cfg.seed,
        inference_steps=s.inference_steps,
        scheduler=s.scheduler,
        guidance_scale=s.guidance_scale,
    )
    part = t.task.part
    ema = t.parts[part].ema_weights()
    restore = perturbed_online_weights(t, part)
    try:
        before = weights(t)
        modules = {part: t.parts[part].module}
        with torch.no_grad(), eval_mode(modules):
            with with_weights(t, part, ema):
                from_ema = t.task.sample(modules, request, torch.device("cpu"))
            from_online = t.task.sample(modules, request, torch.device("cpu"))
        assert not torch.equal(from_ema, from_online)

        report = Recorded()
        p = previewer(t, tmp_path, report, every_steps=2)
        paths = p.run(2)
        assert paths == [str(tmp_path / "samples" / "step-000000002.png")]
        (step, previews, files), *_ = report
        assert step == 2 and files == {"samples": paths}
        assert previews["samples"].shape == (s.num, 1, 8, 8)
        assert torch.equal(previews["samples"], from_ema)
        png = Image.open(paths[0])
        assert png.size[0] >= 2 * 8 and png.size[1] >= 2 * 8  # 4 samples: a 2 x 2 grid
        # The same grid at the next call (the seed fixes the noise), and only when due.
        assert p.maybe_run(3) == [] and len(report) == 1
        again = p.maybe_run(4)
        assert torch.equal(report[-1][1]["samples"], from_ema)
        assert open(again[0], "rb").read() == open(paths[0], "rb").read()
        assert p.maybe_run(5, last=True) == [str(tmp_path / "samples" / "step-000000005.png")]
        assert_untouched(t, before)
        # sample.use_ema=false: the online weights
        online = Recorded()
        previewer(t, tmp_path / "online", online, use_ema=False).run(2)
        assert torch.equal(online[0][1]["samples"], from_online)
    finally:
        restore()


def test_reconstruction_previews_show_the_same_held_out_batch_and_prompts_need_captions(autoencoder, tmp_path):
    t = autoencoder
    report = Recorded()
    p = previewer(t, tmp_path, report, num=4)
    first = p.run(2)
    assert first == [str(tmp_path / "samples" / "step-000000002-reconstruction.png")]
    again = p.run(4)
    held = batch_of(t.val_set, range(4)).images
    assert torch.equal(p.fixed_batch().images, held)  # the first `num` held-out images, every call
    cells = report[0][1]["reconstruction"]
    assert cells.shape[0] == 4 and torch.equal(cells, report[1][1]["reconstruction"])
    # Each cell starts with its input image, in [0, 1].
    assert torch.equal(cells[..., : held.shape[-1]], ((held.clamp(-1, 1) + 1) / 2).float())
    assert open(again[0], "rb").read() == open(first[0], "rb").read()
    with pytest.raises(ConfigError, match=r"sample\.prompts"):
        previewer(t, tmp_path, Recorded(), prompts=["a seven"])


# ---------------------------------------------------------------------------------------------- calibration


def test_calibration_measures_the_first_training_images_with_the_ema_weights_when_a_save_is_due(autoencoder):
    t = autoencoder
    generator = t.parts["generator"].module
    c = Calibrator(t.task, t.parts, t.frozen, t.train_set, runtime=t.runtime, every_steps=3, chunk_size=5)
    assert c.enabled and c.size == 24 == t.task.calibration_size()
    chunks = list(c.batches())
    assert [len(b.indices) for b in chunks] == [5, 5, 5, 5, 4]
    first = batch_of(t.train_set, range(24))  # the split's first 24, in order
    assert torch.equal(torch.cat([b.indices for b in chunks]), first.indices)
    images = first.images
    assert torch.equal(torch.cat([b.images for b in chunks]), images)

    def factor(state) -> float:
        """1 / std of the 24 images' posterior means under `state`, in one batch (the task's own formula)."""
        with torch.no_grad(), eval_mode({"generator": generator}), with_weights(t, "generator", state):
            z = generator(images, decode=False)["latents"].double().flatten()
        return float(1 / z.std())

    ema = t.parts["generator"].ema_weights()
    restore = perturbed_online_weights(t, "generator")
    try:
        before = weights(t)
        want, online = factor(ema), factor(generator.state_dict())
        assert abs(want - online) > 1e-3 * want  # the two weights measure apart
        generator.scaling_factor.fill_(0.0)
        assert not c.maybe_run(2) and float(generator.scaling_factor) == 0.0  # no save at step 2
        assert c.maybe_run(3)
        assert float(generator.scaling_factor) == pytest.approx(want, rel=1e-5)
        before["generator.scaling_factor"] = generator.scaling_factor.clone()  # the one thing it changes
        assert_untouched(t, before)
    finally:
        restore()


def test_a_task_without_calibration_is_never_calibrated(ddpm):
    c = Calibrator(
        ddpm.task, ddpm.parts, ddpm.frozen, ddpm.train_set, runtime=ddpm.runtime, every_steps=1, chunk_size=8
    )
    assert ddpm.task.calibration_size() == 0 and not c.enabled and not c.maybe_run(2)


# ---------------------------------------------------------------------------------------------- evaluation


def test_evaluation_reports_and_writes_its_record_beside_the_checkpoints(ddpm):
    t = ddpm
    report = Recorded()
    e = Evaluator(t.task, t.parts, t.frozen, t.val_set, runtime=t.runtime, cfg=t.cfg, report=report)
    assert e.enabled
    before = weights(t)
    values = e.run(2)
    assert {"fid", "kid", "kid_std"} <= set(values) and values["num_generated"] == values["num_real"] == 16
    assert values["fid"] > 0
    assert report == [(2, values)]
    record = json.loads((Path(t.cfg.checkpoint_url) / eval_result_name(2)).read_text())
    assert record["step"] == 2 and record["world_size"] == 1 and record["features"] == "digits"
    assert len(record["digest"]) == 64 and record["seconds"] >= 0
    assert {k: record[k] for k in values} == values
    # Same weights, same seed: the same values; drawn with the EMA weights (sample.use_ema): online weights
    # moved away from them change nothing.
    assert e.run(2) == values
    restore = perturbed_online_weights(t, t.task.part)
    try:
        assert e.run(2) == values
    finally:
        restore()
    # Only when due.
    assert e.maybe_run(3) is None and len(report) == 3
    assert e.maybe_run(3, last=True) is not None and report[-1][0] == 3
    assert_untouched(t, before)
