"""Size and crop conditioning from each sample, and sampling sizes against the trained buckets (issue 50, item 3):
every image-folder sample carries its original size, crop top-left and target size (its bucket, or the
data.image_size square); SDXL's time ids and PixArt's resolution and aspect-ratio conditions are made of them in
training and of (h, w, 0, 0, h, w) in sampling, as diffusers' pipelines make them; bucket sides the model cannot
take and `gentrain sample --height/--width` outside the trained sizes are exit 2 naming them; a SIGKILLed
bucketed SDXL LoRA run resumes bit-identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import REPO, clean_env, run_cli
from PIL import Image
from tiny_pipelines import folder_fixture, train_args

from trainer.data import build_splits, collate
from trainer.data.buckets import bucket_list, cover_crop, cover_size
from trainer.data.datasets import ImageFolderDataset
from trainer.data.sampler import SampleRef
from trainer.errors import ConfigError
from trainer.registry import load_config, task_class
from trainer.runs import load_frozen
from trainer.tasks.base import Batch, TaskContext
from trainer.tasks.sampling import SampleRequest, check_request

CPU = torch.device("cpu")
ENV = clean_env(PYTHONPATH=str(REPO / "tests"))  # probe_tasks: KillableDDPM dies where PROBE_TASK_KILL says
# (height, width) of the images: 24x40 and 20x36 land in the 12x20 bucket, 40x24 in 20x12, 30x30 in 16x16.
SHAPES = [(24, 40), (20, 36), (40, 24), (30, 30), (36, 20), (32, 32)]
# The tiny SDXL's factor is 4 (VAE 2 x UNet 2): at 16^2 pixels, step 4 and ratio 2 these are the buckets.
BUCKETS = [(12, 20), (16, 16), (20, 12)]
BUCKETED = ["data.buckets=auto", "data.bucket_step=4", "data.bucket_max_ratio=2", "data.crop=random"]


sdxl = folder_fixture("sdxl")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate(SHAPES):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text("the red photo")
    return folder


def _config(sdxl, images, tmp_path, *extra: str):
    keys = [
        f"model.pretrained={sdxl}",
        f"data.path={images}",
        "data.image_size=16",
        "data.val_fraction=0",
        "train.batch_size=2",
        f"run.dir={tmp_path}/run",
        f"model.text.cache_dir={tmp_path}/text",
    ]
    return load_config("sdxl-lora", [*keys, *extra], {})


def _task(cfg, buckets):
    task = task_class("ddpm")(cfg.model_cfg, TaskContext(16, 3, 0, buckets=buckets))
    return task, task.build({n: load_frozen(n, s, {}) for n, s in task.frozen_sources().items()})


def test_each_sample_carries_its_size_and_crop_and_sdxl_time_ids_are_made_of_them(sdxl, images, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    cfg = _config(sdxl, images, tmp_path, *BUCKETED, "data.flip=true")
    train, _, _ = build_splits(cfg)
    assert train.plan.buckets == BUCKETS
    refs = {int(train.indices[i]): SampleRef(i, i, 0, 7) for i in range(len(train))}
    for index, ref in refs.items():
        image, *_, extras = train[ref]
        bucket = train.bucket_of(ref.index)
        with Image.open(images / f"{index}.png") as im:
            _, top, left = cover_crop(im.convert("RGB"), *bucket, "random", ref.aug_seed)
        if ref.aug_seed & 1:  # mirrored after the crop: the crop's left counted from the other side
            left = cover_size(*SHAPES[index], *bucket)[1] - bucket[1] - left
        assert tuple(image.shape[-2:]) == bucket
        assert extras["size_conditions"].tolist() == [*SHAPES[index], top, left, *bucket], index
    # Two samples of one bucket, of different original sizes (and crops): different time ids, each the one
    # StableDiffusionXLPipeline makes of that sample's (original size, crop top-left, target size).
    batch = collate([train[refs[0]], train[refs[1]]])
    task, _ = _task(cfg, BUCKETS)
    sizes = batch["extras"]["size_conditions"]
    cond = task.conditions(2, CPU, torch.zeros(2, dtype=torch.bool), captions=batch["captions"], sizes=sizes)
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl)
    for row, values in enumerate(sizes.tolist()):
        (oh, ow, top, left, th, tw) = (int(v) for v in values)
        want = pipe._get_add_time_ids((oh, ow), (top, left), (th, tw), torch.float32, text_encoder_projection_dim=10)
        assert torch.equal(cond["time_ids"][row : row + 1], want)
    assert not torch.equal(cond["time_ids"][0], cond["time_ids"][1])
    # What the training step reads: the batch's sizes; a source that records none (shards) gets its own size.
    pixels, labels, indices = torch.zeros(2, 3, 12, 20), torch.zeros(2, dtype=torch.long), torch.arange(2)
    assert torch.equal(task.sizes(Batch(pixels, labels, indices, [0, 1], extras={"size_conditions": sizes})), sizes)
    assert task.sizes(Batch(pixels, labels, indices, [0, 1])).tolist() == [[12, 20, 0, 0, 12, 20]] * 2

    # The square loader: the image's own size and the centre crop's offset in the resized image.
    square = ImageFolderDataset(str(images), 16, 3, sizes=True)
    assert square.load(0, 0, False)[2]["size_conditions"].tolist() == [24, 40, 0, 5, 16, 16]  # 24x40 -> 16x27


def test_pixart_resolution_and_aspect_ratio_come_from_the_sample_sizes():
    backbone = "model.backbone={kind: pixart, num_layers: 1, num_attention_heads: 2, attention_head_dim: 12, caption_channels: 384, "
    keys = [backbone + "use_additional_conditions: true}", "model.text={}", "data.image_size=8"]
    cfg = load_config("digits-ddpm", keys, {})
    task = task_class("ddpm")(cfg.model_cfg, TaskContext(cfg.data.image_size, cfg.data.channels, 0))
    modules = task.build({})
    sizes = torch.tensor([[30.0, 50.0, 0.0, 3.0, 12.0, 20.0], [40.0, 24.0, 1.0, 0.0, 20.0, 12.0]])
    keep = torch.zeros(2, dtype=torch.bool)
    cond = task.conditions(2, CPU, keep, captions=["a", "b"], sizes=sizes)
    assert cond["resolution"].tolist() == [[30.0, 50.0], [40.0, 24.0]]  # PixArt's img_hw: the original size
    assert torch.equal(cond["aspect_ratio"], torch.tensor([[12 / 20], [20 / 12]]))  # the bucket's height / width
    default = task.conditions(2, CPU, keep, captions=["a", "b"])
    assert "resolution" not in default  # the backbone's own: the input's size, as before
    x, t = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([3, 700])
    with torch.no_grad():
        net = task._net(modules[task.part].eval())
        assert not torch.equal(net(x, t, cond), net(x, t, default))


def test_bucket_sides_the_model_cannot_take_and_sampling_sizes_outside_the_trained_ones_are_refused(
    sdxl, images, tmp_path
):
    cfg = _config(sdxl, images, tmp_path)
    with pytest.raises(
        ConfigError, match=r"data.buckets: 14x18 .* multiples of 4, .*\(autoencoder 2 x UNet downsampling 2\)"
    ):
        _task(cfg, [(16, 16), (14, 18)])
    # No buckets: the data.image_size square, as before; --height/--width are not taken (the one refusal path).
    task, modules = _task(cfg, None)
    request = SampleRequest(num=1, inference_steps=1, prompts=["the red photo"])
    assert task.sample(modules, request, CPU).shape == (1, 3, 16, 16)
    with pytest.raises(ConfigError, match=r"^--height, --width: this ddpm checkpoint .* does not take them"):
        check_request(request.replace(height=16, width=16), task.sample_accepts(), "ddpm")
    # Buckets: each of them, and nothing else (named).
    task, modules = _task(cfg, BUCKETS)
    assert {"height", "width"} <= task.sample_accepts()
    assert task.sample(modules, request.replace(height=12, width=20), CPU).shape == (1, 3, 12, 20)
    with pytest.raises(ConfigError, match=r"--height 16 --width 20: .*\(data.buckets\) 12x20, 16x16, 20x12 \("):
        task.sample(modules, request.replace(height=16, width=20), CPU)


@pytest.mark.parametrize("preset", ["sdxl-lora", "sd3-lora", "flux-lora", "pixart-sigma-lora", "sd15-lora"])
def test_the_pipeline_presets_train_on_buckets_where_their_family_did(preset):
    cfg = load_config(preset, ["data.path=/data/images", "model.pretrained=/models/base"], {})
    if preset == "sd15-lora":  # SD 1.x/2.x trained on squares
        assert cfg.data.buckets is None
        return
    side = cfg.data.image_size
    buckets = bucket_list(cfg.data)  # of the preset's image_size^2 pixels: every family's factor (16, 32) divides 64
    assert (side, side) in buckets and all(h % 64 == 0 and w % 64 == 0 for h, w in buckets)
    assert all(0.9 * side * side <= h * w <= side * side and max(h / w, w / h) <= 4 for h, w in buckets)
    if preset == "sdxl-lora":
        assert len(buckets) == 41  # SDXL's 40 and the mirror of its 704x1344 (tests/test_buckets.py)


def _train(sdxl, images, root, *extra: str, steps: int = 4, env=None):
    args = train_args(
        "sdxl-lora", sdxl, images, root, *BUCKETED, "task=probe_tasks:KillableDDPM", *extra, max_steps=steps
    )
    return run_cli("train", *args, env=env or ENV)


@pytest.mark.slow
def test_a_sigkilled_bucketed_sdxl_run_resumes_bit_identical_and_samples_at_its_buckets(sdxl, images, tmp_path):
    from helpers import assert_identical, final_weights

    r = _train(sdxl, images, tmp_path / "straight")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "in 3 of 3 aspect-ratio buckets" in r.stderr
    killed = tmp_path / "killed"
    r = _train(sdxl, images, killed, env=clean_env(PYTHONPATH=str(REPO / "tests"), PROBE_TASK_KILL="0:3"))
    assert r.returncode == -9, r.stderr[-3000:]
    r = _train(sdxl, images, killed)
    assert r.returncode == 0 and "resumed_from=" in r.stderr and "step-000000002" in r.stderr, r.stderr[-3000:]
    assert_identical(final_weights(f"{tmp_path}/straight/checkpoints", 4), final_weights(f"{killed}/checkpoints", 4))

    sample = ["sample", str(tmp_path / "straight" / "checkpoints"), "--num", "1", "--steps", "2"]
    sample += ["--prompt", "the red photo", "--task", "probe_tasks:KillableDDPM"]
    out = tmp_path / "wide.png"
    r = run_cli(*sample, "--height", "12", "--width", "20", "--out", str(out), env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Image.open(out).size == (5 * 20 + 2, 5 * 12 + 2)  # one 12x20 sample, upscaled 64 // 12 in 2 px padding
    r = run_cli(*sample, "--height", "16", "--width", "20", "--out", str(tmp_path / "no.png"), env=ENV)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "--height 16 --width 20" in r.stderr and "12x20, 16x16, 20x12" in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "no.png").exists()
