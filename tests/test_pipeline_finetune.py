"""Fine-tuning a released pipeline (issue 48): a StableDiffusionPipeline folder at `model.pretrained` sets the
ddpm run's keys (its UNet's own config and weights, VAE, CLIP text encoder and tokenizer, scheduler), the caption
tokens and the UNet's prediction are diffusers' own, LoRA and full fine-tunes train through the CLI, a SIGKILLed
LoRA run resumes bit-identically, a changed file in the folder is exit 2 naming it, and `gentrain sample` draws
from the run. The pipelines are tiny random ones saved by diffusers' own classes (tests/tiny_pipelines.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import REPO, clean_env, run_cli
from PIL import Image
from safetensors.torch import load_file, save_file
from test_text_encoders import WORDS
from tiny_pipelines import captioned_images, draw, folder_fixture, pipeline_config, train_args

from trainer.checkpoint import CheckpointStore
from trainer.errors import ConfigError
from trainer.registry import task_class
from trainer.runs import load_frozen
from trainer.tasks.base import TaskContext

CPU = torch.device("cpu")
ENV = clean_env(PYTHONPATH=str(REPO / "tests"))  # probe_tasks: KillableDDPM dies where PROBE_TASK_KILL says


sd = folder_fixture("sd")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return captioned_images(tmp_path_factory.mktemp("images"), 6)


def _config(sd, tmp_path, *overrides: str):
    return pipeline_config("sd15-lora", sd, tmp_path, *overrides)


def test_a_pipeline_folder_sets_the_model_keys_and_refuses_contradicting_ones(sd, tmp_path):
    import json

    m = _config(sd, tmp_path).model_cfg
    unet = json.loads((sd / "unet" / "config.json").read_text())
    assert m.backbone.kind == "unet" and m.backbone.unet_config == unet
    assert m.backbone.caption_channels == unet["cross_attention_dim"]
    assert (m.text.kind, m.text.encoder, m.text.tokenizer) == ("sd", f"{sd}/text_encoder", f"{sd}/tokenizer")
    assert (m.text.width, m.text.max_tokens) == (8, 16)  # the CLIP's width, the tokenizer's model_max_length
    assert m.autoencoder.url == f"{sd}/vae"
    # The objective from scheduler/scheduler_config.json (StableDiffusion's betas, not DDPMScheduler's).
    assert (m.prediction_type, m.num_train_timesteps) == ("epsilon", 1000)
    assert (m.beta_schedule, m.beta_start, m.beta_end) == ("scaled_linear", 0.00085, 0.012)
    # The same values stated again are fine; another value is exit 2 naming the key and the folder's value.
    _config(sd, tmp_path, "model.beta_schedule=scaled_linear", f"model.autoencoder.url={sd}/vae")
    with pytest.raises(ConfigError, match=r"model.prediction_type='v_prediction' \(the folder's: 'epsilon'\)"):
        _config(sd, tmp_path, "model.prediction_type=v_prediction")
    with pytest.raises(ConfigError, match=r"model.backbone.block_out_channels \(the folder's unet/config.json"):
        _config(sd, tmp_path, "model.backbone={kind: unet, block_out_channels: [8, 16]}")
    with pytest.raises(ConfigError, match="model.text.encoder="):
        _config(sd, tmp_path, f"model.text.encoder={sd}/unet")


def test_caption_tokens_are_diffusers_encode_prompt(sd, tmp_path):
    from diffusers import StableDiffusionPipeline

    from trainer.conditioning.text import TextEncoder

    text = _config(sd, tmp_path, "model.text.batch_size=1").model_cfg.text
    encoder = TextEncoder(text)
    pipe = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None)
    assert type(encoder.backend.parts[0].model).__name__ == "CLIPTextModel"
    for prompt in ("", "the red photo of a handwritten", " ".join(WORDS * 3)):  # empty, short, truncated
        ours = encoder.encode([prompt], CPU)
        theirs, _ = pipe.encode_prompt(prompt, "cpu", 1, False)
        assert torch.equal(ours.tokens, theirs), prompt
        assert torch.equal(ours.mask, torch.ones(1, 16))


@pytest.mark.parametrize("lora", [True, False])
def test_the_unet_predicts_what_diffusers_unet_predicts(sd, tmp_path, lora):
    """The run's UNet is the folder's: architecture and weights (LoRA starts at B = 0: the same function)."""
    from diffusers import UNet2DConditionModel

    cfg = _config(sd, tmp_path, *([] if lora else ["model.lora=null"]))
    task = task_class("ddpm")(cfg.model_cfg, TaskContext(16, 3, 0))
    frozen = {n: load_frozen(n, s, {}) for n, s in task.frozen_sources().items()}
    modules = task.build(frozen)
    assert task.latent.shape == (4, 8, 8)  # the folder's VAE: 4 latent channels, downsampling 2
    trainable = [n for n, p in modules["unet"].named_parameters() if p.requires_grad]
    assert trainable and all((".lora_" in n) == lora for n in trainable)
    reference = UNet2DConditionModel.from_pretrained(sd / "unet").eval()
    x, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([3, 700])
    cond = task.conditions(2, CPU, torch.zeros(2, dtype=torch.bool), captions=["the red photo", "a blue"])
    assert set(cond) == {"captions"}  # SD's UNet reads the tokens alone, no mask, as the pipeline calls it
    with torch.no_grad():
        ours = task._net(modules["unet"].eval())(x, t, cond)
        theirs = reference(x, t, encoder_hidden_states=cond["captions"]).sample
    assert torch.equal(ours, theirs)
    assert (
        task.inputs()["pipeline"].pin and "unet/diffusion_pytorch_model.safetensors" in task.inputs()["pipeline"].files
    )


sdxl = folder_fixture("sdxl")


def test_an_sdxl_folder_trains_on_both_clips_pooled_caption_and_size_conditions(sdxl, tmp_path):
    """SDXL: the caption tokens and the pooled embedding are StableDiffusionXLPipeline.encode_prompt's, and the
    UNet's prediction with the size micro-conditions is diffusers' UNet2DConditionModel's."""
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel

    cfg = _config(sdxl, tmp_path, "model.text.batch_size=1")
    m = cfg.model_cfg
    assert (m.text.kind, m.text.encoder_2, m.text.tokenizer_2) == (
        "sdxl",
        f"{sdxl}/text_encoder_2",
        f"{sdxl}/tokenizer_2",
    )
    assert (m.text.width, m.text.pooled_width) == (8 + 12, 10)  # CLIP-L + CLIP-G wide; CLIP-G's projection
    task = task_class("ddpm")(m, TaskContext(16, 3, 0))
    modules = task.build({n: load_frozen(n, s, {}) for n, s in task.frozen_sources().items()})
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl)
    for prompt in ("", "the red photo"):
        ours = task.text.encode([prompt], CPU)
        tokens, _, pooled, _ = pipe.encode_prompt(prompt, device="cpu", do_classifier_free_guidance=False)
        assert torch.equal(ours.tokens, tokens) and torch.equal(ours.pooled, pooled), prompt
    cond = task.conditions(2, CPU, torch.zeros(2, dtype=torch.bool), captions=["the red photo", "a blue"])
    assert set(cond) == {"captions", "pooled", "time_ids"}
    time_ids = pipe._get_add_time_ids((16, 16), (0, 0), (16, 16), torch.float32, text_encoder_projection_dim=10)
    reference = UNet2DConditionModel.from_pretrained(sdxl / "unet").eval()
    x, t = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([3, 700])
    with torch.no_grad():
        ours = task._net(modules["unet"].eval())(x, t, cond)
        added = {"text_embeds": cond["pooled"], "time_ids": time_ids.repeat(2, 1)}
        theirs = reference(x, t, encoder_hidden_states=cond["captions"], added_cond_kwargs=added).sample
    assert torch.equal(ours, theirs)


@pytest.mark.slow
def test_the_sdxl_preset_trains_and_samples_from_an_sdxl_folder(sdxl, images, tmp_path):
    r = _train(sdxl, images, tmp_path / "run", "sample.every_steps=2", steps=2, preset="sdxl-lora")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "run" / "samples" / "step-000000002.png").is_file()
    unet = _files(tmp_path / "run", 2)["unet.model.safetensors"]
    assert any(unet[k].abs().max() > 0 for k in unet if ".lora_B." in k)


def _train(sd, images, root, *extra: str, steps: int = 4, env=None, preset: str = "sd15-lora"):
    args = train_args(
        preset,
        sd,
        images,
        root,
        "data.buckets=null",  # sdxl-lora's buckets (auto, step 64) hold no 16 px bucket: square crops
        "task=probe_tasks:KillableDDPM",
        *extra,
        max_steps=steps,
    )
    return run_cli("train", *args, env=env or ENV)


def _files(root, step: int) -> dict[str, dict[str, torch.Tensor]]:
    store = CheckpointStore(str(root / "checkpoints"), {})
    info = store.check(step)
    assert info.valid, info.reason
    return {n: store.read_tensors(info, n) for n in info.manifest.files if n.endswith(".safetensors")}


@pytest.fixture(scope="module")
def runs(sd, images, tmp_path_factory):
    """LoRA (bf16 base) straight, LoRA SIGKILLed at step 3 and resumed, and a full fine-tune."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    r = _train(sd, images, root / "lora")
    assert r.returncode == 0, r.stderr[-3000:]
    out["lora"] = root / "lora"
    r = _train(sd, images, root / "killed", env=clean_env(PYTHONPATH=str(REPO / "tests"), PROBE_TASK_KILL="0:3"))
    assert r.returncode == -9, r.stderr[-3000:]
    r = _train(sd, images, root / "killed")
    assert r.returncode == 0 and "resumed_from=" in r.stderr and "step-000000002" in r.stderr, r.stderr[-3000:]
    out["killed"] = root / "killed"
    r = _train(sd, images, root / "full", "model.lora=null", "train.precision=no", steps=2)
    assert r.returncode == 0, r.stderr[-3000:]
    out["full"] = root / "full"
    return out


def _raw_header(path) -> dict:
    import json
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _header(path) -> dict[str, tuple[str, int]]:
    """{tensor: (dtype, data bytes)} from a safetensors file's header alone (no tensor is read)."""
    header = _raw_header(path)
    header.pop("__metadata__", None)
    return {k: (e["dtype"], e["data_offsets"][1] - e["data_offsets"][0]) for k, e in header.items()}


@pytest.mark.slow
def test_a_lora_checkpoint_holds_the_adapters_only_and_resumes_on_the_folders_base(sd, runs, tmp_path):
    """Adapter-only checkpoints (#48 deliver 3): the files hold the adapters, their EMA and optimizer state, no
    tensor of the frozen base; trainer.json and the manifest say so and pin the base; `sample` and export
    rebuild the base from the folder (in the dtype it trained in) and load the adapters over it."""
    import json

    from trainer.runs import load_for_inference

    store = CheckpointStore(str(runs["lora"] / "checkpoints"), {})
    info = store.check(4)
    step_dir = runs["lora"] / "checkpoints" / "step-000000004"
    folder = load_file(sd / "unet" / "diffusion_pytorch_model.safetensors")
    base_names = set(folder) | {k.replace("to_q.", "to_q.base_layer.") for k in folder}
    cfg = _config(sd, tmp_path)
    task = task_class("ddpm")(cfg.model_cfg, TaskContext(16, 3, 0))
    unet = task.build({n: load_frozen(n, s, {}) for n, s in task.frozen_sources().items()})["unet"]
    adapters = {k: p for k, p in unet.named_parameters() if p.requires_grad}
    for name in ("unet.model.safetensors", "unet.ema.safetensors"):
        header = _header(step_dir / name)
        assert set(header) == set(adapters) and not base_names & set(header), name
        # Sizes as computed: each adapter in fp32.
        assert sum(b for _, b in header.values()) == 4 * sum(p.numel() for p in adapters.values()), name
    opt = _header(step_dir / "unet.optimizer.safetensors")
    assert sum(b for _, b in opt.values()) == 2 * 4 * sum(p.numel() for p in adapters.values()) + 4 * len(adapters)
    doc = json.loads(store.read_file(info, "trainer.json"))
    assert doc["parts"]["unet"]["weights"] == "trainable"
    assert info.manifest.adapter_only == {"unet": "unet.pretrained"}
    assert info.manifest.inputs["unet.pretrained"].pin is True
    full = CheckpointStore(str(runs["full"] / "checkpoints"), {}).check(2)
    print(
        f"\ntiny SD pipeline: LoRA checkpoint {info.total_bytes} bytes, full fine-tune's {full.total_bytes} "
        f"(unet.model: {sum(b for _, b in _header(step_dir / 'unet.model.safetensors').values())} vs "
        f"{sum(t.numel() * t.element_size() for t in folder.values())} bytes of tensors)"
    )
    # The base is rebuilt from the folder, in bf16 as it trained; the adapters moved off B = 0.
    view = store.view(info)
    _, _, modules = load_for_inference(view, use_ema=False, device=CPU, task_name="probe_tasks:KillableDDPM")
    state = modules["unet"].state_dict()
    assert all(
        torch.equal(state[k.replace("to_q.", "to_q.base_layer.")], folder[k].bfloat16().float())
        for k in folder
        if "to_q." in k
    )
    saved = load_file(step_dir / "unet.model.safetensors")
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)


# The 2-step fp32 LoRA run on a copy of the folder (with the memory tier) that the pinned-folder tests change
# and put back, and the export test draws from: trained once in this module.
PINNED_RUN = ("train.precision=no", "checkpoint.memory=true")


@pytest.fixture(scope="module")
def pinned(sd, images, tmp_path_factory):
    """(the folder's copy the run pins, the run folder, the memory tier's folder). A test that changes a file of
    the copy, or moves it, puts it back before it ends."""
    root = tmp_path_factory.mktemp("pinned")
    copy, shm = root / "sd", root / "shm"
    shutil.copytree(sd, copy)
    r = _train(copy, images, root / "run", *PINNED_RUN, f"checkpoint.memory_dir={shm}", steps=2)
    assert r.returncode == 0, r.stderr[-3000:]
    return copy, root / "run", shm


@pytest.mark.slow
def test_sample_verify_and_export_need_the_pinned_base_folder(pinned, tmp_path):
    """An adapter-only checkpoint plus its pinned folder verifies; a changed file in the folder is exit 2
    naming it; a folder that is gone is one line, exit 2, naming it, for sample, verify and export alike."""
    copy, run, shm = pinned
    # The memory tier's snapshots hold the adapters alone too.
    snapshots = sorted(shm.rglob("unet.model.safetensors"))
    assert snapshots and all(k == "__metadata__" or ".lora_" in k for f in snapshots for k in _raw_header(f))
    ckpt = str(run / "checkpoints")
    task_flag = ["--task", "probe_tasks:KillableDDPM"]
    r = run_cli("checkpoints", "verify", ckpt, *task_flag, env=ENV)
    assert r.returncode == 0 and f"base: {copy}" in r.stdout and "valid:" in r.stdout, r.stdout + r.stderr
    config = copy / "unet" / "config.json"
    kept = config.read_text()
    try:
        config.write_text(kept.replace("{", '{"_note": "edited", ', 1))
        r = run_cli("checkpoints", "verify", ckpt, *task_flag, env=ENV)
    finally:
        config.write_text(kept)
    assert r.returncode == 2 and "unet/config.json" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    shutil.move(copy, tmp_path / "moved")
    try:
        sample = ["sample", ckpt, "--num", "1", "--steps", "2", "--out", str(tmp_path / "x.png")]
        export = ["checkpoints", "export", ckpt, str(tmp_path / "out")]
        for args in (sample, ["checkpoints", "verify", ckpt], export):
            r = run_cli(*args, *task_flag, env=ENV)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr[-3000:])
            assert "holds only the LoRA adapters" in lines[-1] and f"{copy}/unet" in lines[-1], (args, r.stderr[-3000:])
    finally:
        shutil.move(tmp_path / "moved", copy)


@pytest.mark.slow
def test_a_full_fine_tune_trains_every_unet_weight(sd, runs):
    unet = _files(runs["full"], 2)["unet.model.safetensors"]
    folder = load_file(sd / "unet" / "diffusion_pytorch_model.safetensors")
    assert unet.keys() == folder.keys()
    assert not all(torch.equal(unet[k], folder[k]) for k in folder)


@pytest.mark.slow
def test_a_sigkilled_lora_run_resumes_bit_identically(runs):
    a, b = _files(runs["lora"], 4), _files(runs["killed"], 4)
    assert a.keys() == b.keys() and "unet.optimizer.safetensors" in a
    assert all(".lora_" in k for k in a["unet.model.safetensors"])  # adapter-only: the base is the folder's
    for name in a:  # adapters, their EMA, optimizer, RNG
        assert a[name].keys() == b[name].keys(), name
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), f"{name}: {k}"


@pytest.mark.slow
def test_gentrain_sample_draws_from_the_run(runs, tmp_path):
    out = tmp_path / "grid.png"
    args = ["sample", str(runs["lora"] / "checkpoints"), "--num", "2", "--steps", "3", "--prompt", "the red photo"]
    r = run_cli(*args, "--out", str(out), "--task", "probe_tasks:KillableDDPM", env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "wrote" in r.stdout + r.stderr and Image.open(out).size[0] >= 16


@pytest.mark.slow
def test_a_changed_file_in_the_pipeline_folder_is_refused_on_resume_naming_it(pinned, images, tmp_path):
    copy, run, shm = pinned
    weights = copy / "unet" / "diffusion_pytorch_model.safetensors"
    kept = weights.read_bytes()
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1
    try:
        save_file(tensors, weights)
        r = _train(copy, images, run, *PINNED_RUN, f"checkpoint.memory_dir={shm}", steps=4)
    finally:
        weights.write_bytes(kept)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "unet/diffusion_pytorch_model.safetensors" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_the_exported_lora_loads_into_the_base_pipeline_and_draws_what_gentrain_samples(pinned, tmp_path):
    """`checkpoints export` writes the adapters as `unet.`-prefixed keys (diffusers' pipeline LoRA layout): the
    base StableDiffusionPipeline plus `load_lora_weights(OUT/unet-lora)`, with the run's DDIM schedule, draws
    the images gentrain draws within 1/255 (same seed, steps, guidance, prompt)."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    from trainer.runs import load_for_inference
    from trainer.tasks.sampling import SampleRequest

    sd, run, _ = pinned  # the run's fp32 LoRA and the folder it pins
    out = tmp_path / "export"
    task_flag = ["--task", "probe_tasks:KillableDDPM"]
    r = run_cli("checkpoints", "export", str(run / "checkpoints"), str(out), *task_flag, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(k.startswith("unet.") for k in load_file(out / "unet-lora" / "pytorch_lora_weights.safetensors"))

    store = CheckpointStore(str(run / "checkpoints"), {})
    view = store.view(store.check(2))
    _, task, modules = load_for_inference(view, use_ema=True, device=CPU, task_name="probe_tasks:KillableDDPM")
    prompt, steps, scale = "the red photo", 4, 3.0
    request = SampleRequest(num=2, seed=7, prompts=[prompt], inference_steps=steps, guidance_scale=scale)
    ours = task.sample(modules, request, CPU)

    scheduler = task.objective.inference_scheduler("ddim")
    assert isinstance(scheduler, DDIMScheduler)
    pipe = StableDiffusionPipeline.from_pretrained(sd, safety_checker=None)
    # Set after construction: StableDiffusionPipeline's constructor rewrites a scheduler's steps_offset to 1,
    # and the comparison is on the run's own schedule (gentrain's DDIM: steps_offset 0).
    pipe.scheduler = scheduler
    pipe.load_lora_weights(str(out / "unet-lora"))
    assert pipe.unet.peft_config, "diffusers loaded no adapter"
    theirs = draw(pipe, prompt, steps, scale, eta=0.0)
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1 / 255
    # The adapters matter: without them diffusers draws something else.
    pipe.unload_lora_weights()
    without = draw(pipe, prompt, steps, scale)
    assert (without - ours).abs().max() > 1 / 255


@pytest.mark.slow
def test_a_pipeline_folder_on_object_storage_trains_like_a_local_one(s3_server, sd, images, tmp_path):
    """`model.pretrained` an fsspec URL (S3): the folder's keys are filled from it and every part loads from it."""
    import json

    import fsspec

    bucket, options = f"s3://{s3_server.make_bucket()}", s3_server.storage_options()
    fs, _ = fsspec.core.url_to_fs(bucket, **options)
    fs.put(str(sd) + "/", f"{bucket}/sd", recursive=True)
    env = clean_env(PYTHONPATH=str(REPO / "tests"))  # built here: the S3 fixture put its credentials in os.environ
    extra = [f"checkpoint.storage_options={json.dumps(options)}", "train.precision=no"]
    r = _train(f"{bucket}/sd", images, tmp_path / "run", *extra, steps=2, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = CheckpointStore(str(tmp_path / "run" / "checkpoints"), {}).check(2).manifest
    assert manifest.inputs["pipeline"].url == f"{bucket}/sd"
    assert manifest.config["model"]["autoencoder"]["url"] == f"{bucket}/sd/vae"
    # The checkpoint holds the adapters; the base it needs is the folder on S3, pinned by digest.
    assert manifest.inputs["unet.pretrained"].url == f"{bucket}/sd/unet"
    assert manifest.inputs["unet.pretrained"].pin is True
    assert all(".lora_" in k for k in _files(tmp_path / "run", 2)["unet.model.safetensors"])
