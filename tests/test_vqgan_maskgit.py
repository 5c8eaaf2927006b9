"""VQ-GAN and MaskGIT: two phases with their own optimizers, a late discriminator, the gradient penalty
on its configured steps, the adaptive weight, a frozen tokenizer pinned by digest and kept out of
MaskGIT's checkpoints, geometry mismatches refused, sampling, and exact resume under torchrun."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, clean_env, run_cli
from elastic_helpers import finish, standalone, start_torchrun
from helpers import kill_group, start_cli
from PIL import Image

from trainer.checkpoint import CheckpointStore
from trainer.models.gan import adaptive_weight
from trainer.models.vqgan import VQAutoencoder, VQGANConfig

ENV = clean_env(PYTHONPATH=str(REPO / "tests"))

COMMON = [
    "data.image_size=8",
    "train.batch_size=8",
    "train.warmup_steps=2",
    "train.log_every_steps=1",
    "train.val_every_steps=0",
    "train.threads=1",
    "sample.every_steps=0",
    "sample.num=4",
]
VQGAN = [
    "digits-vqgan",
    *COMMON,
    "model.block_out_channels=[8,16]",
    "model.norm_num_groups=4",
    "model.codebook_size=32",
    "model.codebook_dim=4",
    "model.disc_channels=8",
    "model.disc_layers=1",
    "model.dead_code_threshold=0",
    "model.usage_window=4",
]
MASKGIT = ["digits-maskgit", *COMMON, "model.dim=16", "model.depth=1", "model.heads=2", "sample.inference_steps=2"]


def vqgan_args(root, *extra: str, max_steps: int, seed: int = 0) -> list[str]:
    return [*VQGAN, f"seed={seed}", f"run.dir={root}/run", f"train.max_steps={max_steps}", *extra]


def maskgit_args(root, tokenizer: str, *extra: str, max_steps: int) -> list[str]:
    return [*MASKGIT, f"model.tokenizer.url={tokenizer}", f"run.dir={root}/run", f"train.max_steps={max_steps}", *extra]


def train_vqgan(root, *extra: str, max_steps: int = 3, seed: int = 0) -> str:
    r = run_cli("train", *vqgan_args(root, *extra, max_steps=max_steps, seed=seed))
    assert r.returncode == 0, r.stderr[-3000:]
    return f"{root}/run/checkpoints"


TOKENIZER = ("model.disc_start_step=1",)  # the shared tokenizer's run, 3 steps
PLAIN = ("train.val_every_steps=3",)  # the shared MaskGIT run's, 3 steps


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    return train_vqgan(tmp_path_factory.mktemp("vqgan"), *TOKENIZER)


@pytest.fixture(scope="module")
def maskgit_run(tmp_path_factory, tokenizer) -> str:
    """A plain 3-step MaskGIT run on the shared tokenizer, validated at its last step; its stderr in
    run/train.log. Read by several tests (copy it before changing it)."""
    root = tmp_path_factory.mktemp("maskgit")
    r = run_cli("train", *maskgit_args(root, tokenizer, *PLAIN, max_steps=3), env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    (root / "run" / "train.log").write_text(r.stderr)
    return f"{root}/run/checkpoints"


def tensors(root: str, step: int | None = None) -> dict[str, dict[str, torch.Tensor]]:
    store = CheckpointStore(root)
    info = store.check(step) if step is not None else store.latest_valid()
    assert info is not None and info.valid, info.reason if info else root
    return {n: store.read_tensors(info, n) for n in info.manifest.files if n.endswith(".safetensors")}


def step_lines(log: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"step=(\d+)/\d+ .*", log)}


# ---------------------------------------------------------------- VQ-GAN


@pytest.mark.slow
def test_vqgan_discriminator_starts_late_with_its_own_optimizer_and_penalty_on_configured_steps(tmp_path):
    r = run_cli(
        "train",
        *vqgan_args(
            tmp_path,
            "model.disc_start_step=3",
            "model.grad_penalty_every=2",
            "model.lecam_weight=0.1",
            "checkpoint.every_steps=1",
            "checkpoint.keep=10",
            "train.val_every_steps=7",
            "sample.every_steps=7",
            max_steps=7,
        ),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    root = f"{tmp_path}/run/checkpoints"
    steps = {s: tensors(root, s) for s in range(1, 8)}
    disc = "discriminator.model.safetensors"
    # Untouched before model.disc_start_step: global steps 0, 1, 2 (checkpoints 1..3) leave it as built.
    for s in (2, 3):
        for k, v in steps[1][disc].items():
            assert torch.equal(v, steps[s][disc][k]), f"discriminator {k} changed before disc_start_step (step {s})"
    assert any(not torch.equal(v, steps[4][disc][k]) for k, v in steps[3][disc].items())
    assert "discriminator.ema.safetensors" not in steps[7] and "generator.ema.safetensors" in steps[7]

    info = CheckpointStore(root).check(7)
    doc = CheckpointStore(root).read_json(info, "trainer.json")
    assert doc.parts["generator"].step == 7 and doc.parts["discriminator"].step == 4
    disc_group = doc.parts["discriminator"].optimizer["param_groups"][0]
    assert disc_group["initial_lr"] == 2e-4 and disc_group["betas"] == [0.5, 0.9]
    assert doc.parts["generator"].optimizer["param_groups"][0]["initial_lr"] == 1e-3

    # The penalty runs on the discriminator's own steps 0, 2 (global steps 3, 5 = log lines 4, 6).
    lines = step_lines(r.stderr)
    assert [s for s in sorted(lines) if "discriminator/grad_penalty=" in lines[s]] == [4, 6]
    assert [s for s in sorted(lines) if "discriminator/hinge=" in lines[s]] == [4, 5, 6, 7]
    assert all("generator/adv=" not in lines[s] for s in (1, 2, 3)) and "generator/adv_weight=" in lines[4]
    assert "discriminator/lecam=" in lines[5] and "generator/perplexity=" in lines[1]
    assert "generator/codebook_usage=" in lines[1]
    assert "val/psnr=" in r.stderr and "val/mse=" in r.stderr
    grid = tmp_path / "run" / "samples" / "step-000000007-reconstruction.png"
    assert grid.exists()


def test_adaptive_weight_matches_a_hand_computation():
    """For out = W h, rec = mean((out - y)^2) and adv = -mean(v * out): the gradients at W are
    2 (out - y) h^T / n and -v h^T / n, so the weight is their norm ratio (Esser et al. eq. 7)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    h, y, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, 4), (3, 4), (3, 4)))
    out = w @ h
    rec = ((out - y) ** 2).mean()
    adv = -(v * out).mean()
    got = adaptive_weight(rec, adv, w, max_weight=1e4)
    n = out.numel()
    g_rec = 2 * (out - y).detach() @ h.T / n
    g_adv = -v @ h.T / n
    want = g_rec.norm() / (g_adv.norm() + 1e-4)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert adaptive_weight(rec, adv, w, max_weight=0.01) == 0.01  # clamped


@pytest.mark.parametrize("quantizer", ["vq", "fsq", "lfq"])
def test_quantizers_encode_and_decode_what_the_forward_reconstructs(quantizer):
    cfg = VQGANConfig(
        block_out_channels=[8, 16],
        norm_num_groups=4,
        quantizer=quantizer,
        codebook_size=16,
        codebook_dim=4,
        fsq_levels=[5, 3],
    )
    torch.manual_seed(0)
    model = VQAutoencoder(cfg, channels=1).eval()
    x = torch.rand(4, 1, 8, 8) * 2 - 1
    out = model(x)
    idx = model.encode_indices(x)
    assert idx.shape == (4, 4, 4) and int(idx.min()) >= 0 and int(idx.max()) < cfg.num_codes
    assert torch.equal(idx, out["indices"])
    # The forward's straight-through output equals the looked-up codes up to one rounding of z + (q - z).
    torch.testing.assert_close(model.decode_indices(idx), out["reconstruction"].clamp(-1, 1), rtol=0, atol=1e-5)
    assert out["commitment"].shape == (4,) and torch.isfinite(out["aux"])


# ---------------------------------------------------------------- MaskGIT


@pytest.mark.slow
def test_maskgit_trains_on_a_pinned_frozen_tokenizer_and_samples_through_it(tmp_path, tokenizer, maskgit_run):
    root = maskgit_run
    log = (Path(root).parent / "train.log").read_text()
    assert "tokenizer(frozen)" in log and "val/token_ce=" in log
    store = CheckpointStore(root)
    info = store.latest_valid()
    assert not any(f.startswith("tokenizer") for f in info.manifest.files), info.manifest.files
    record = store.read_json(info, "trainer.json").frozen["tokenizer"].model_dump()
    src = CheckpointStore(tokenizer).latest_valid()
    assert record["file"] == "generator.ema.safetensors" and record["url"] == src.url
    assert record["digest"] == "blake3:" + src.manifest.files["generator.ema.safetensors"].blake3

    grids = {}
    for steps in (1, 8):
        out = tmp_path / f"s{steps}.png"
        r = run_cli("sample", root, "--num", "4", "--steps", str(steps), "--out", str(out), env=ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        with Image.open(out) as im:
            grids[steps] = np.asarray(im.convert("L"), dtype=np.float32)
    assert grids[1].shape == grids[8].shape and grids[1].std() > 0
    assert not np.array_equal(grids[1], grids[8])  # one-shot vs iterative decoding


@pytest.mark.slow
def test_maskgit_refuses_a_tokenizer_of_another_geometry(tmp_path, tokenizer):
    r = run_cli("train", *maskgit_args(tmp_path, tokenizer, "model.codebook_size=8192", max_steps=1), env=ENV)
    assert r.returncode == 2
    assert "model.codebook_size=8192" in r.stderr and "has 32 codes" in r.stderr
    r = run_cli("train", *maskgit_args(tmp_path, tokenizer, "model.latent_size=8", max_steps=1), env=ENV)
    assert r.returncode == 2 and "model.latent_size=8" in r.stderr and "4x4" in r.stderr
    r = run_cli("train", *maskgit_args(tmp_path, tokenizer, "data.image_size=16", max_steps=1), env=ENV)
    assert r.returncode == 2 and "data.image_size=16" in r.stderr and "8px" in r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.slow
def test_maskgit_resume_with_a_changed_tokenizer_is_refused(tmp_path, tokenizer):
    tok_root = tmp_path / "tok"
    shutil.copytree(Path(tokenizer).parent, tok_root / "run")  # the shared tokenizer, at a URL of its own
    url = f"{tok_root}/run/checkpoints"
    args = maskgit_args(tmp_path / "mg", url, max_steps=2)
    assert run_cli("train", *args, env=ENV).returncode == 0
    shutil.rmtree(tok_root)
    train_vqgan(tok_root, *TOKENIZER, seed=1)  # same URL and steps, other weights
    r = run_cli("train", *args[:-1], "train.max_steps=3", env=ENV)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "frozen part 'tokenizer'" in r.stderr and "different frozen weights" in r.stderr
    doc = json.loads((tmp_path / "mg/run/checkpoints/step-000000002/trainer.json").read_text())
    assert doc["progress"]["step"] == 2


# ---------------------------------------------------------------- distributed, exact resume


def _kill_and_compare(tmp_path, make_args, kill_at: int, steps: int, **env: str) -> dict[str, dict[str, torch.Tensor]]:
    ref_log = tmp_path / "ref.log"
    ref = start_torchrun(standalone(2), make_args(tmp_path / "ref"), ref_log, PYTHONPATH=str(REPO / "tests"), **env)
    assert finish(ref, ref_log) == 0, ref_log.read_text()[-4000:]
    log = tmp_path / "killed.log"
    proc = start_torchrun(
        standalone(2, max_restarts=3),
        make_args(tmp_path / "killed"),
        log,
        PYTHONPATH=str(REPO / "tests"),
        PROBE_TASK_KILL=f"1:{kill_at}",
        **env,
    )
    rc = finish(proc, log)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert "world_size=2 restart=1" in text and "find_unused_parameters" not in text
    a = tensors(f"{tmp_path}/ref/run/checkpoints", steps)
    b = tensors(f"{tmp_path}/killed/run/checkpoints", steps)
    assert a.keys() == b.keys()
    for name in a:
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), f"{name}:{key} differs"
    return a


def _kill_and_resume_one_process(
    tmp_path, make_args, env: dict[str, str], kill_step: int, saved_step: int, steps: int
) -> tuple[dict, dict, str]:
    """One process, no torchrun: an uninterrupted run (ref), then a run SIGKILLed in global step `kill_step`
    once the checkpoint of `saved_step` has committed, restarted to the end. Returns (ref tensors, resumed
    tensors, the ref run's stderr); the caller compares them."""
    r = run_cli("train", *make_args(tmp_path / "ref"), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    ref_stderr = r.stderr
    args = make_args(tmp_path / "killed")
    killed = f"{tmp_path}/killed/run/checkpoints"
    kill = {"PROBE_TASK_KILL": f"0:{kill_step}"}
    kill["PROBE_TASK_KILL_AFTER"] = f"{killed}/step-{saved_step:09d}/manifest.json"
    log = tmp_path / "killed.log"
    proc = start_cli("train", *args, env={**env, **kill}, log_path=log, cwd=REPO)
    try:
        assert proc.wait(timeout=600) == -9, log.read_text()[-3000:]
    finally:
        kill_group(proc)
    assert CheckpointStore(killed).latest_valid().step == saved_step
    r = run_cli("train", *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed_from={killed}/step-{saved_step:09d}" in r.stderr
    return tensors(f"{tmp_path}/ref/run/checkpoints", steps), tensors(killed, steps), ref_stderr


@pytest.mark.slow
def test_vqgan_under_torchrun_resumes_bit_identical_after_sigkill(tmp_path):
    steps = 10

    def args(root):
        return vqgan_args(
            root,
            "task=probe_tasks:KillableVQGAN",
            "model.disc_start_step=3",
            "model.grad_penalty_every=2",
            "model.dead_code_threshold=0.5",
            "checkpoint.every_steps=4",
            max_steps=steps,
        )

    a = _kill_and_compare(tmp_path, args, kill_at=6, steps=steps)
    # Generator, discriminator, both optimizers, the generator's EMA, every rank's RNG state.
    assert {
        "generator.model.safetensors",
        "generator.ema.safetensors",
        "generator.optimizer.safetensors",
        "discriminator.model.safetensors",
        "discriminator.optimizer.safetensors",
        "rank-00001.safetensors",
    } <= set(a)


@pytest.mark.slow
def test_maskgit_under_torchrun_resumes_bit_identical_after_sigkill(tmp_path, tokenizer):
    steps = 8

    def args(root):
        return maskgit_args(
            root,
            tokenizer,
            "task=probe_tasks:KillableMaskGIT",
            "model.dropout=0.1",
            "checkpoint.every_steps=3",
            max_steps=steps,
        )

    a = _kill_and_compare(tmp_path, args, kill_at=5, steps=steps)
    assert {"transformer.model.safetensors", "transformer.ema.safetensors"} <= set(a)
    assert not any(n.startswith("tokenizer") for n in a)


@pytest.mark.slow
def test_fsdp_sharded_frozen_tokenizer_trains_bit_identical_to_a_whole_one_across_a_sigkill(tmp_path, tokenizer):
    # train.shard_frozen gathers the same fp32 weights the replicated tokenizer holds, so codes, previews
    # and every saved tensor must be bit-identical to FSDP with a whole tokenizer, also across a SIGKILL.
    # The sharded run reads a token cache pre-filled with the first 4 samples of the stream: in step 1
    # rank 0 has only hits while rank 1 has misses, the case where an uncoordinated cache would hang.
    steps = 8
    common = ["train.parallel=fsdp", "model.dropout=0.1", "checkpoint.every_steps=3", "sample.every_steps=4"]
    ref_log = tmp_path / "ref.log"
    ref = start_torchrun(
        standalone(2),
        maskgit_args(tmp_path / "ref", tokenizer, *common, max_steps=steps),
        ref_log,
        PYTHONPATH=str(REPO / "tests"),
    )
    assert finish(ref, ref_log) == 0, ref_log.read_text()[-4000:]
    cache = tmp_path / "cache"
    fill = run_cli(
        "train",
        *maskgit_args(tmp_path / "fill", tokenizer, "train.batch_size=4", f"model.token_cache={cache}", max_steps=1),
        env=ENV,
    )
    assert fill.returncode == 0, fill.stderr[-3000:]
    log = tmp_path / "killed.log"
    args = maskgit_args(
        tmp_path / "killed",
        tokenizer,
        *common,
        "train.shard_frozen=true",
        f"model.token_cache={cache}",
        "task=probe_tasks:KillableMaskGIT",
        max_steps=steps,
    )
    proc = start_torchrun(
        standalone(2, max_restarts=3), args, log, PYTHONPATH=str(REPO / "tests"), PROBE_TASK_KILL="1:5"
    )
    rc = finish(proc, log)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert "tokenizer(frozen, sharded)" in text and "world_size=2 restart=1" in text
    assert "token cache: encoding a cached image to join" in text  # the asymmetric step happened
    assert (tmp_path / "killed/run/samples/step-000000008.png").exists()
    a = tensors(f"{tmp_path}/ref/run/checkpoints", steps)
    b = tensors(f"{tmp_path}/killed/run/checkpoints", steps)
    assert a.keys() == b.keys() and not any(n.startswith("tokenizer") for n in b)
    for name in a:
        for key in a[name]:
            assert torch.equal(a[name][key], b[name][key]), f"{name}:{key} differs"


@pytest.mark.slow
def test_vqgan_under_fsdp_matches_ddp_and_refuses_the_gradient_penalty(tmp_path):
    # Generator and discriminator both sharded, the discriminator from step 1 with the adaptive weight
    # (gradients at the decoder's last layer): same losses as DDP up to float rounding (FSDP2 reduces
    # flat buffers; see test_fsdp for the bound's reasoning).
    def run(name: str, *extra: str) -> tuple[int, str]:
        log = tmp_path / f"{name}.log"
        args = vqgan_args(tmp_path / name, "model.disc_start_step=1", *extra, max_steps=3)
        proc = start_torchrun(standalone(2, max_restarts=0), args, log, PYTHONPATH=str(REPO / "tests"))
        return finish(proc, log), log.read_text()

    rc, text = run("refused", "train.parallel=fsdp", "model.grad_penalty_every=4")
    assert (
        rc != 0 and "set model.grad_penalty_every=0" in text and "Traceback" not in text.split("ConfigError")[0][-200:]
    )
    assert not (tmp_path / "refused/run/checkpoints").exists()
    losses = {}
    for name, extra in (("ddp", ()), ("fsdp", ("train.parallel=fsdp",))):
        rc, text = run(name, "model.grad_penalty_every=0", *extra)
        assert rc == 0, text[-4000:]
        losses[name] = [
            float(v)
            for v in re.findall(r"generator/loss=([0-9.e+-]+).*discriminator/loss=([0-9.e+-]+)", text)
            for v in v
        ]
    assert len(losses["ddp"]) == len(losses["fsdp"]) >= 4  # steps 2 and 3 train both parts
    torch.testing.assert_close(torch.tensor(losses["fsdp"]), torch.tensor(losses["ddp"]), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_token_cache_is_keyed_by_tokenizer_digest_and_changes_nothing(tmp_path, tokenizer, maskgit_run):
    cache = tmp_path / "cache"  # maskgit_run: the same run without the cache
    cached = run_cli(
        "train", *maskgit_args(tmp_path / "b", tokenizer, *PLAIN, f"model.token_cache={cache}", max_steps=3), env=ENV
    )
    assert cached.returncode == 0, cached.stderr[-3000:]
    digest = CheckpointStore(tokenizer).latest_valid().manifest.files["generator.ema.safetensors"].blake3
    entries = list((cache / f"blake3-{digest}").glob("*.npy"))
    assert len(entries) >= 8  # 3 steps of 8 images (flips make their own entries)
    assert all(np.load(e).shape == (16,) for e in entries)
    # A second run reads every token from the cache (no new entries) and trains the same weights.
    again = run_cli(
        "train", *maskgit_args(tmp_path / "c", tokenizer, *PLAIN, f"model.token_cache={cache}", max_steps=3), env=ENV
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted((cache / f"blake3-{digest}").glob("*.npy")) == sorted(entries)
    a = tensors(maskgit_run)["transformer.model.safetensors"]
    for run in ("b", "c"):
        b = tensors(f"{tmp_path}/{run}/run/checkpoints")["transformer.model.safetensors"]
        assert all(torch.equal(a[k], b[k]) for k in a), run


@pytest.mark.slow
def test_perceptual_loss_needs_user_given_vgg_weights(tmp_path):
    from safetensors.torch import save_file

    from trainer.models.perceptual import vgg16_features

    missing = tmp_path / "nope.safetensors"
    r = run_cli("train", *vqgan_args(tmp_path / "a", f"model.perceptual.url={missing}", max_steps=1))
    assert r.returncode == 2 and "model.perceptual.url" in r.stderr and "never downloads" in r.stderr

    torch.manual_seed(0)
    weights = tmp_path / "vgg16.safetensors"  # torchvision's key names; random values stand in for trained ones
    save_file({f"features.{k}": v.contiguous() for k, v in vgg16_features().state_dict().items()}, str(weights))
    r = run_cli("train", *vqgan_args(tmp_path / "b", f"model.perceptual.url={weights}", max_steps=2))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "generator/perceptual=" in r.stderr


@pytest.mark.slow
def test_maskgit_text_conditioning_plugs_in_the_shared_text_encoder(tmp_path, tokenizer):
    """Captions (the digits carry "a handwritten seven"-style ones) through the offline sentence encoder."""
    text = ["model.num_classes=null", "model.text.max_tokens=4", f"model.text.cache_dir={tmp_path}/text"]
    r = run_cli("train", *maskgit_args(tmp_path, tokenizer, *text, max_steps=2), env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    root = f"{tmp_path}/run/checkpoints"
    files = tensors(root)["transformer.model.safetensors"]
    assert "text_proj.weight" in files and files["text_proj.weight"].shape == (16, 384)
    out = tmp_path / "seven.png"
    r = run_cli(
        "sample",
        root,
        "--num",
        "2",
        "--prompt",
        "a handwritten seven",
        "--guidance-scale",
        "3",
        "--out",
        str(out),
        env=ENV,
    )
    assert r.returncode == 0 and out.exists(), r.stderr[-3000:]
    r = run_cli("sample", root, "--num", "2", "--class", "7", "--out", str(out), env=ENV)
    assert r.returncode == 2 and "--class: this maskgit checkpoint is conditioned on captions" in r.stderr
