"""Video tokenizer and video MaskGIT: causal tokenization (a one-frame clip is the image), padding frames
that change no loss, the frozen tokenizer's geometry checks, GIF samples named by their caption, and exact
resume of both stages under torchrun after a SIGKILL."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import REPO, clean_env, run_cli
from PIL import Image
from test_vqgan_maskgit import VQGAN, _kill_and_compare, tensors

from trainer.cli import main
from trainer.config import ConfigError
from trainer.models.video_tokenizer import CausalVideoAutoencoder, VideoTokenizerConfig
from trainer.tasks.base import Batch, Phase, StepInfo, TaskContext
from trainer.tasks.video_tokenizer import VideoTokenizerTask

ENV = clean_env(PYTHONPATH=str(REPO / "tests"))

COMMON = [
    "data.image_size=8",
    "data.num_frames=3",
    "train.batch_size=8",
    "train.warmup_steps=2",
    "train.log_every_steps=1",
    "train.val_every_steps=0",
    "train.threads=1",
    "sample.every_steps=0",
    "sample.num=2",
]
TOKENIZER = [
    "moving-digits-tokenizer",
    *COMMON,
    "model.dim=16",
    "model.heads=2",
    "model.spatial_depth=1",
    "model.temporal_depth=1",
    "model.pixel_channels=4",
    "model.quantizer=vq",
    "model.codebook_size=32",
    "model.codebook_dim=4",
    "model.disc_channels=8",
    "model.disc_layers=1",
]
MASKGIT = [
    "moving-digits",
    *COMMON,
    "model.dim=16",
    "model.depth=1",
    "model.heads=2",
    "model.text.max_tokens=4",
    "sample.inference_steps=2",
]


def tokenizer_args(root, *extra: str, max_steps: int) -> list[str]:
    return [*TOKENIZER, f"run.dir={root}/run", f"train.max_steps={max_steps}", *extra]


def maskgit_args(root, tokenizer: str, *extra: str, max_steps: int) -> list[str]:
    text_cache = f"model.text.cache_dir={root}/text"
    return [
        *MASKGIT,
        f"model.tokenizer.url={tokenizer}",
        text_cache,
        f"run.dir={root}/run",
        f"train.max_steps={max_steps}",
        *extra,
    ]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("video-tokenizer")
    r = run_cli("train", *tokenizer_args(root, "model.disc_start_step=1", "train.val_every_steps=2", max_steps=2))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "val/psnr=" in r.stderr and "discriminator/hinge=" in r.stderr
    assert (root / "run/samples/step-000000002-reconstruction.gif").exists()
    return f"{root}/run/checkpoints"


def small_tokenizer(quantizer: str = "vq", encoder_context: str = "clip") -> CausalVideoAutoencoder:
    cfg = VideoTokenizerConfig(
        quantizer=quantizer,
        codebook_size=16,
        codebook_dim=4,
        fsq_levels=[5, 3],
        dim=16,
        heads=2,
        spatial_depth=1,
        temporal_depth=1,
        pixel_channels=4,
        patch_size=4,
        temporal_patch=2,
        encoder_context=encoder_context,
    )
    torch.manual_seed(0)
    return CausalVideoAutoencoder(cfg, channels=1, image_size=8)


# ---------------------------------------------------------------- the causal tokenizer


@pytest.mark.parametrize(("quantizer", "context"), [("vq", "clip"), ("fsq", "clip"), ("lfq", "clip"), ("vq", "patch")])
def test_causal_tokenizer_shapes_and_a_one_frame_clip_tokenizes_like_the_image(quantizer, context):
    model = small_tokenizer(quantizer, context).eval()
    video = torch.rand(3, 5, 1, 8, 8) * 2 - 1
    idx = model.encode_indices(video)
    assert idx.shape == (3, 3, 2, 2)  # 1 + (5 - 1) / 2 slices of 2x2 tokens
    assert model.decode_indices(idx).shape == (3, 5, 1, 8, 8)
    image = video[:, :1]
    one = model.encode_indices(image)
    assert one.shape == (3, 1, 2, 2) and model.decode_indices(one).shape == (3, 1, 1, 8, 8)
    # Causality: slice 0 is the first frame alone, whatever follows it (latents and codes), and frame 0
    # decodes from slice 0 alone. Latents agree up to float rounding only: a longer clip runs the same
    # math through matmuls of another shape, and BLAS may block (and so sum) them differently.
    assert torch.equal(idx[:, :1], one)
    torch.testing.assert_close(model.encode(video)[:, :4], model.encode(image), rtol=1e-5, atol=1e-5)
    other = torch.cat([image, torch.rand(3, 4, 1, 8, 8)], dim=1)
    assert torch.equal(model.encode_indices(other)[:, 0], one[:, 0])
    torch.testing.assert_close(model.decode_indices(idx)[:, :1], model.decode_indices(one), rtol=1e-5, atol=1e-5)
    if context == "patch":  # a code sees its own patch only: changing one patch changes that token's latent alone
        changed = video.clone()
        changed[:, 3:5, :, 4:, :4] = torch.rand(3, 2, 1, 4, 4)  # frames 3-4 (slice 2), bottom-left patch (1, 0)
        diff = (model.encode(changed) != model.encode(video)).any(-1).view(3, 3, 2, 2)
        assert diff[:, 2, 1, 0].all() and diff.sum() == 3


def test_padding_frames_do_not_change_the_loss():
    """Samples with 1 and 3 real frames of 5: refilling their padding frames changes no loss term, no
    gradient and no codebook update (the VQ codebook learns by EMA inside the forward)."""
    cfg = VideoTokenizerConfig(
        quantizer="vq",
        codebook_size=16,
        codebook_dim=4,
        dim=16,
        heads=2,
        spatial_depth=1,
        temporal_depth=1,
        pixel_channels=4,
        disc_channels=8,
        disc_layers=1,
        disc_start_step=0,
        grad_penalty_every=1,
        lecam_weight=0.1,
    )
    task = VideoTokenizerTask(cfg, TaskContext(8, 1, 0, num_frames=5))
    torch.manual_seed(0)
    modules = task.build({})
    g = torch.Generator().manual_seed(1)
    video = torch.rand(3, 5, 1, 8, 8, generator=g) * 2 - 1
    frames = torch.tensor([1, 3, 5])
    refilled = video.clone()
    refilled[0, 1:] = torch.rand(4, 1, 8, 8, generator=g)
    refilled[1, 3:] = -1.0

    def run(clip: torch.Tensor):
        mods = copy.deepcopy(modules)
        mods["generator"].train()
        batch = Batch(
            clip, torch.zeros(3, dtype=torch.long), torch.arange(3), [0, 1, 2], torch.ones(3), {"frames": frames}
        )
        out = task.forward(mods, batch, 0)
        gen = task.loss(Phase("generator", "generator"), mods, batch, out, StepInfo(0))
        gen.per_sample.sum().backward()
        grads = {n: p.grad.clone() for n, p in mods["generator"].named_parameters() if p.grad is not None}
        detached = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in out.items()}
        disc = task.loss(Phase("discriminator", "discriminator"), mods, batch, detached, StepInfo(0))
        return gen, disc, grads, mods["generator"].quantizer.state_dict(), task.validate(mods, batch)

    a, b = run(video), run(refilled)
    assert {"adv", "adv_weight", "rec", "commitment"} <= set(a[0].terms)
    assert {"grad_penalty", "lecam", "hinge"} <= set(a[1].terms)
    assert torch.equal(a[0].per_sample, b[0].per_sample), (a[0].per_sample, b[0].per_sample)
    for key in a[0].terms:
        assert torch.equal(a[0].terms[key], b[0].terms[key]), key
    assert torch.equal(a[1].per_sample, b[1].per_sample)
    assert a[2].keys() == b[2].keys() and all(torch.equal(a[2][k], b[2][k]) for k in a[2])
    assert all(torch.equal(a[3][k], b[3][k]) for k in a[3])  # codebook EMA unchanged by padding
    assert all(torch.equal(a[4][k], b[4][k]) for k in a[4])
    # The full clip's padding is real content: refilling it does change that sample.
    full = video.clone()
    full[2, 4:] = 1.0
    assert not torch.equal(run(full)[0].per_sample[2], a[0].per_sample[2])


def test_tokenizer_frames_must_be_one_plus_a_multiple_of_the_temporal_patch(tmp_path):
    with pytest.raises(ConfigError, match=r"data.num_frames=4: .* 1 \+ k \* 2 \(e.g. 3 or 5\)"):
        VideoTokenizerTask(VideoTokenizerConfig(temporal_patch=2), TaskContext(8, 1, 0, num_frames=4))
    assert main(["train", *tokenizer_args(tmp_path, "data.num_frames=4", max_steps=1)]) == 2


def test_video_tokenizer_refuses_image_batches(tmp_path, capsys):
    """An image source gives (N, C, H, W) batches: refused with exit 2 before a step is taken or saved."""
    assert main(["train", *tokenizer_args(tmp_path, "data.source=digits", max_steps=1)]) == 2
    err = capsys.readouterr().err
    assert "task=video-tokenizer needs clips (N, T, C, H, W)" in err and "data.image_ratio" in err, err
    assert not (tmp_path / "run/checkpoints").exists() or not list((tmp_path / "run/checkpoints").iterdir())


# ---------------------------------------------------------------- video MaskGIT


@pytest.mark.slow
def test_video_maskgit_refuses_a_mismatched_tokenizer(tmp_path, tokenizer, capsys):
    cases = {
        "model.codebook_size=64": "has 32 codes",
        "model.temporal_patch=4": "groups 2 frames per token slice",
        "data.num_frames=5": "trained on 3-frame clips",
        "data.image_size=16": "8px",
    }
    for override, why in cases.items():
        assert main(["train", *maskgit_args(tmp_path, tokenizer, override, max_steps=1)]) == 2, override
        err = capsys.readouterr().err
        assert override in err and why in err, err
    # An image MaskGIT refuses a video tokenizer.
    image = ["digits-maskgit", "data.image_size=8", f"model.tokenizer.url={tokenizer}", f"run.dir={tmp_path}/img"]
    assert main(["train", *image]) == 2
    assert "not a vqgan tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "run/checkpoints").exists() or not list((tmp_path / "run/checkpoints").iterdir())


@pytest.mark.slow
def test_video_maskgit_refuses_an_image_tokenizer(tmp_path, capsys):
    """A 2D VQ-GAN run's codes are images, not token slices: exit 2 naming the key, URL and run kind."""
    image = [*VQGAN, f"run.dir={tmp_path}/vqgan", "train.max_steps=1"]
    assert main(["train", *image]) == 0
    url = f"{tmp_path}/vqgan/checkpoints"
    capsys.readouterr()
    assert main(["train", *maskgit_args(tmp_path, url, max_steps=1)]) == 2
    err = capsys.readouterr().err
    assert f"model.tokenizer.url={url}" in err and "'vqgan' run, not a video-tokenizer run" in err, err
    assert not (tmp_path / "run/checkpoints").exists() or not list((tmp_path / "run/checkpoints").iterdir())


@pytest.mark.slow
def test_video_maskgit_samples_gifs_named_by_caption_with_the_frames_asked_for(tmp_path, tokenizer, capsys):
    r = run_cli("train", *maskgit_args(tmp_path, tokenizer, "train.val_every_steps=2", max_steps=2))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokenizer(frozen)" in r.stderr and "val/token_ce=" in r.stderr
    assert (tmp_path / "run/samples/step-000000002.gif").exists()
    root = f"{tmp_path}/run/checkpoints"
    out = tmp_path / "out" / "sheet.png"
    # 2 frames are off the 1 + 2k grid: sampled as 3 (two slices), trimmed to 2.
    r = run_cli(
        "sample",
        root,
        "--num",
        "3",
        "--prompt",
        "A seven, moving left!",
        "--frames",
        "2",
        "--guidance-scale",
        "2",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    with Image.open(tmp_path / "out" / "a-seven-moving-left.gif") as gif:
        assert gif.n_frames == 2
        sizes = gif.size
    with Image.open(out) as sheet:  # one row of 2 frames per sample, 8 px upscaled 8x, 1 px gaps
        assert sheet.size == (2 * 65 + 1, 3 * 65 + 1)
    assert sizes[0] == sizes[1]
    assert main(["sample", root, "--num", "1", "--prompt", "a one moving up", "--frames", "5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--frames 5" in err and "3-frame clips" in err
    # --temperature reaches the token draws: the same seed and prompt at two temperatures give other clips.
    sheets = {}
    for temperature in ("0.05", "20"):
        t_out = tmp_path / f"t{temperature}" / "sheet.png"
        assert (
            main(
                [
                    "sample",
                    root,
                    "--num",
                    "3",
                    "--prompt",
                    "a two moving up",
                    "--temperature",
                    temperature,
                    "--out",
                    str(t_out),
                ]
            )
            == 0
        )
        sheets[temperature] = np.asarray(Image.open(t_out))
    assert not np.array_equal(sheets["0.05"], sheets["20"])
    assert main(["sample", tokenizer, "--num", "1", "--temperature", "0.5", "--out", str(out)]) == 2
    assert "--temperature: this video-tokenizer checkpoint is unconditional" in capsys.readouterr().err


# ---------------------------------------------------------------- distributed, exact resume


def _files(parallel: str, *names: str) -> set[str]:
    """Checkpoint file names of parts' states: whole files under DDP, rank 1's slices under FSDP."""
    return {f"{n}.safetensors" if parallel == "ddp" else f"{n}.rank-00001.safetensors" for n in names}


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_video_tokenizer_under_torchrun_resumes_bit_identical_after_sigkill(tmp_path, parallel):
    """Joint image+video batches (a quarter one-frame images, padded): padding and all. Under FSDP both
    parts are sharded, without the gradient penalty (refused there: a double backward)."""
    steps = 6
    mode = (
        ["train.parallel=fsdp", "model.grad_penalty_every=0"] if parallel == "fsdp" else ["model.grad_penalty_every=2"]
    )

    def args(root):
        return tokenizer_args(
            root,
            "task=probe_tasks:KillableVideoTokenizer",
            "model.disc_start_step=2",
            *mode,
            "model.dead_code_threshold=0.5",
            "checkpoint.every_steps=2",
            "data.image_ratio=0.25",
            max_steps=steps,
        )

    a = _kill_and_compare(tmp_path, args, kill_at=3, steps=steps)
    assert _files(parallel, "generator.model", "generator.ema", "discriminator.optimizer") | {
        "rank-00001.safetensors"
    } <= set(a)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp"])  # DDP's path, the same for every task, is in the other kill tests
def test_video_maskgit_under_torchrun_resumes_bit_identical_after_sigkill(tmp_path, tokenizer, parallel):
    """Under FSDP the transformer is sharded and so is the frozen video tokenizer (train.shard_frozen)."""
    steps = 5
    mode = ["train.parallel=fsdp", "train.shard_frozen=true"] if parallel == "fsdp" else []

    def args(root):
        return maskgit_args(
            root,
            tokenizer,
            "task=probe_tasks:KillableVideoMaskGIT",
            "model.dropout=0.1",
            "checkpoint.every_steps=2",
            "data.image_ratio=0.25",
            *mode,
            max_steps=steps,
        )

    a = _kill_and_compare(tmp_path, args, kill_at=3, steps=steps)
    assert _files(parallel, "transformer.model", "transformer.ema") <= set(a)
    assert not any(n.startswith("tokenizer") for n in a)
    assert tensors(f"{tmp_path}/ref/run/checkpoints", steps).keys() == a.keys()
