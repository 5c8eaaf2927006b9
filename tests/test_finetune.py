"""Fine-tuning: diffusion UNets start from diffusers-format folders (local or on object storage), fully or
with LoRA (peft); LoRA runs resume bit-exactly after SIGKILL; exported adapters load back in diffusers and
sample like the merged model."""

from __future__ import annotations

import json

import fsspec
import pytest
import torch
from conftest import REPO, clean_env, run_cli
from safetensors.torch import load as load_safetensors

from trainer.checkpoint import CheckpointStore
from trainer.cli import main as cli_main
from trainer.errors import ConfigError
from trainer.registry import load_config, task_class
from trainer.runs import load_for_inference
from trainer.tasks.base import TaskContext
from trainer.tasks.sampling import SampleRequest

YAML = str(REPO / "tests" / "cascade.yaml")


def env(**extra: str) -> dict[str, str]:
    """Built when used: the S3 fixture puts its credentials into os.environ first."""
    return clean_env(PYTHONPATH=str(REPO / "tests"), **extra)


STAGE = "{{image_size: {size}, block_out_channels: [8, 16], norm_num_groups: 4, attention: false{more}}}"
CPU = torch.device("cpu")


def stages(first: str = "", second: str = "") -> str:
    return f"model.stages=[{STAGE.format(size=4, more=first)}, {STAGE.format(size=8, more=second)}]"


def read_all(url: str, options: dict, step: int) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    store = CheckpointStore(url, options)
    info = store.check(step)
    assert info.valid, info.reason
    return {n: store.read_tensors(info, n) for n in info.manifest.files if n.endswith(".safetensors")}, info.manifest


@pytest.fixture(scope="module")
def s3(s3_server):
    bucket = s3_server.make_bucket()
    return f"s3://{bucket}", s3_server.storage_options()


@pytest.fixture(scope="module")
def base_folders(s3):
    """Both stages of a freshly built cascade written as diffusers folders straight to the S3 server."""
    from trainer.models.finetune import write_folder

    bucket, options = s3
    cfg = load_config(YAML, [], {})
    torch.manual_seed(0)
    task = task_class("cascade")(cfg.model_cfg, TaskContext(8, 1, 0, 10))
    for part, (unet, extras) in task.export_unets(task.build({})).items():
        write_folder(unet, f"{bucket}/pretrained/{part}", extras, options)
    return f"{bucket}/pretrained"


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, s3, base_folders):
    """Stage 1 kept as loaded from S3, stage 2 LoRA-tuned from S3; once straight, once SIGKILLed and resumed."""
    bucket, options = s3
    second = f", pretrained: {base_folders}/stage2, lora: {{rank: 4, alpha: 8}}"
    common = [
        stages(f", pretrained: {base_folders}/stage1", second),
        "train.stages=[2]",
        "train.max_steps=6",
        "train.lr=1e-2",
        "checkpoint.every_steps=3",
        f"checkpoint.storage_options={json.dumps(options)}",
        "task=cascade_probe:KillableCascadeTask",
    ]
    root = tmp_path_factory.mktemp("lora")
    runs = {}
    for name in ("straight", "killed"):
        url = f"{bucket}/{name}"
        args = ["train", YAML, f"run.dir={root}/{name}", f"checkpoint.url={url}", *common]
        if name == "killed":
            r = run_cli(*args, env=env(PROBE_TASK_KILL="0:5"))
            assert r.returncode == -9, r.stderr[-3000:]  # SIGKILL inside stage 2's loss at step 5
        r = run_cli(*args, env=env())
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = (url, r.stderr)
    return runs


@pytest.mark.slow
def test_pretrained_folders_on_s3_start_the_run_and_lora_trains_only_the_adapters(s3, base_folders, lora_runs):
    bucket, options = s3
    url, _ = lora_runs["straight"]
    files, manifest = read_all(url, options, 6)
    fs, _ = fsspec.core.url_to_fs(bucket, **options)

    def folder(stage: str) -> dict[str, torch.Tensor]:
        unet = load_safetensors(fs.cat_file(f"{base_folders}/{stage}/diffusion_pytorch_model.safetensors"))
        extras = load_safetensors(fs.cat_file(f"{base_folders}/{stage}/gentrain_conditioning.safetensors"))
        return {**{f"unet.{k}": v for k, v in unet.items()}, **extras}

    # Stage 1 was never trained here: its weights are exactly the folder's.
    stage1, want1 = files["stage1.model.safetensors"], folder("stage1")
    assert stage1.keys() == want1.keys()
    assert all(torch.equal(stage1[k], want1[k]) for k in want1)
    # Stage 2: its checkpoint holds the adapters alone (and their EMA), moved away from B = 0; the frozen base
    # (UNet and conditioning layers) is the folder's, pinned: every load rebuilds it from there.
    stage2 = files["stage2.model.safetensors"]
    lora = {k for k in stage2 if ".lora_" in k}
    assert lora and lora == set(stage2) == set(files["stage2.ema.safetensors"])
    assert any(stage2[k].abs().max() > 0 for k in lora if ".lora_B." in k)
    assert manifest.adapter_only == {"stage2": "stage2.pretrained"}
    assert manifest.inputs["stage2.pretrained"].pin is True
    store = CheckpointStore(url, options)
    _, _, modules = load_for_inference(
        store.view(store.check(6)),
        use_ema=False,
        device=CPU,
        task_name="cascade_probe:KillableCascadeTask",
    )
    built = modules["stage2"].state_dict()
    base = {k.replace(".base_layer.", "."): v for k, v in built.items() if ".lora_" not in k}
    assert base.keys() == folder("stage2").keys()
    assert all(torch.equal(base[k], v) for k, v in folder("stage2").items())
    assert all(torch.equal(built[k], v) for k, v in stage2.items())
    # The optimizer holds the adapters and nothing else.
    opt = json.loads(CheckpointStore(url, options).read_file(CheckpointStore(url, options).check(6), "trainer.json"))
    n_opt = sum(len(g["params"]) for g in opt["parts"]["stage2"]["optimizer"]["param_groups"])
    assert n_opt == len(lora)
    # Every checkpoint records where its starting weights came from.
    assert manifest.inputs["stage2.pretrained"].url == f"{base_folders}/stage2"
    assert manifest.inputs["stage2.pretrained"].digest.startswith("blake3:")


@pytest.mark.slow
def test_lora_run_resumes_bit_identically_after_sigkill(s3, lora_runs):
    bucket, options = s3
    (a_url, _), (b_url, resumed) = lora_runs["straight"], lora_runs["killed"]
    assert f"resumed_from={b_url}/step-000000003" in resumed
    a, _ = read_all(a_url, options, 6)
    b, _ = read_all(b_url, options, 6)
    assert a.keys() == b.keys() and "stage2.optimizer.safetensors" in a
    for name in a:  # weights (stage 1 whole, stage 2's adapters), EMA, optimizer, RNG
        assert a[name].keys() == b[name].keys(), name
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), f"{name}: {k}"


@pytest.mark.slow
def test_exported_lora_loads_back_in_diffusers_and_samples_like_the_merged_model(tmp_path, s3, base_folders, lora_runs):
    from diffusers import UNet2DConditionModel

    bucket, options = s3
    url, _ = lora_runs["straight"]
    out = tmp_path / "export"
    opts = json.dumps(options)
    assert (
        cli_main(
            [
                "checkpoints",
                "export",
                url,
                str(out),
                "--storage-options",
                opts,
                "--task",
                "cascade_probe:KillableCascadeTask",
            ]
        )
        == 0
    )
    assert (out / "stage2-lora" / "pytorch_lora_weights.safetensors").exists()
    assert not (out / "stage1-lora").exists()
    fs, _ = fsspec.core.url_to_fs(bucket, **options)
    fs.get(f"{base_folders}/stage2/", str(tmp_path / "base2"), recursive=True)

    store = CheckpointStore(url, options)
    _, task, modules = load_for_inference(
        store.view(store.check(6)), use_ema=True, device=CPU, task_name="cascade_probe:KillableCascadeTask"
    )
    request = SampleRequest(num=3, labels=torch.tensor([1, 7, 3]), inference_steps=3, guidance_scale=2.0)

    def sample_with(unet: torch.nn.Module) -> torch.Tensor:
        net = modules["stage2"]
        kept, net.unet = net.unet, unet.eval()
        try:
            return task.sample(modules, request, CPU)
        finally:
            net.unet = kept

    trained = task.sample(modules, request, CPU)  # gentrain's own adapted module
    # diffusers' own loader: the base folder plus the exported adapters.
    adapted = UNet2DConditionModel.from_pretrained(tmp_path / "base2")
    adapted.load_lora_adapter(str(out / "stage2-lora"), prefix=None, weight_name="pytorch_lora_weights.safetensors")
    merged = UNet2DConditionModel.from_pretrained(out / "stage2")
    base = UNet2DConditionModel.from_pretrained(tmp_path / "base2")
    via_diffusers, via_merged, without = sample_with(adapted), sample_with(merged), sample_with(base)

    # Same layers, same adapter weights, same order of operations: identical.
    assert torch.equal(trained, via_diffusers)
    # Merged W' = W + s*B@A in fp32 differs from W@x + s*B@(A@x) by rounding only: relative ~1e-6 per layer
    # (eps 6e-8 times sums of a few hundred terms), a few dozen layers and 3+3 sampler steps stay far below 1e-4.
    tolerance = 1e-4
    torch.testing.assert_close(via_merged, trained, atol=tolerance, rtol=0)
    # ...while the adapters themselves move the samples by far more than that.
    assert (without - trained).abs().max() > 100 * tolerance


def test_ddpm_unet_starts_from_a_folder_with_lora_and_half_precision_base(tmp_path):
    from diffusers import UNet2DModel
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    from trainer.models.finetune import cast_frozen_base, half_weights_autocast, write_folder

    def task(*overrides: str):
        cfg = load_config(
            "digits-ddpm",
            ["model.block_out_channels=[8,16]", "model.norm_num_groups=4", "data.image_size=8", *overrides],
            {},
        )
        return task_class("ddpm")(cfg.model_cfg, TaskContext(8, 1, 0))

    torch.manual_seed(0)
    source = task().build({})["unet"]
    write_folder(source, str(tmp_path / "unet"))
    t = task(f"model.pretrained={tmp_path}/unet", "model.lora={rank: 2, targets: [to_q, to_v, conv1]}")
    unet = t.build({})["unet"]
    base = {k.replace(".base_layer.", "."): v for k, v in unet.state_dict().items() if ".lora_" not in k}
    assert all(torch.equal(base[k], v) for k, v in source.state_dict().items())
    trainable = [n for n, p in unet.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert t.inputs()["unet.pretrained"].url == f"{tmp_path}/unet"
    # Adapters trained a little, exported, put back with peft onto the folder's UNet: the same function.
    with torch.no_grad():
        for n, p in unet.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.05)
    write_folder(unet, str(tmp_path / "out"))
    reloaded = UNet2DModel.from_pretrained(tmp_path / "unet")
    meta = json.loads(
        __import__("safetensors")
        .safe_open(str(tmp_path / "out-lora/pytorch_lora_weights.safetensors"), "pt")
        .metadata()["lora_adapter_metadata"]
    )
    inject_adapter_in_model(
        LoraConfig(r=meta["r"], lora_alpha=meta["lora_alpha"], target_modules=meta["target_modules"]), reloaded
    )
    set_peft_model_state_dict(
        reloaded, load_safetensors((tmp_path / "out-lora/pytorch_lora_weights.safetensors").read_bytes())
    )
    x, tt = torch.randn(2, 1, 8, 8), torch.tensor([10, 500])
    with torch.no_grad():
        assert torch.equal(unet(x, tt).sample, reloaded(x, tt).sample)
        merged = UNet2DModel.from_pretrained(tmp_path / "out")
        torch.testing.assert_close(merged(x, tt).sample, unet(x, tt).sample, atol=1e-5, rtol=0)
    # Under bf16 the frozen base is stored in bf16, the adapters stay fp32 (diffusers' cast_training_params).
    cast_frozen_base(unet, "bf16")
    dtypes = {p.dtype for n, p in unet.named_parameters() if ".lora_" not in n}
    assert dtypes == {torch.bfloat16}
    assert {p.dtype for n, p in unet.named_parameters() if ".lora_" in n} == {torch.float32}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unet(x, tt).sample.float().sum().backward()
    assert all(p.grad is not None for p in unet.parameters() if p.requires_grad)
    # Previews and evaluation (no training autocast) run such a model under its weights' dtype.
    with torch.no_grad(), half_weights_autocast({"unet": unet}, CPU):
        assert torch.isfinite(unet(x, tt).sample).all()


@pytest.mark.slow
def test_pretrained_and_lora_errors_name_the_key(tmp_path, base_folders, s3):
    _, options = s3

    def build(*overrides: str):
        cfg = load_config(YAML, list(overrides), {})
        task = task_class("cascade")(cfg.model_cfg, TaskContext(8, 1, 0, 10, options))
        return task.build({})

    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ConfigError, match=r"model.stages\[0\].pretrained=.*has no config.json and no diffusion_pytorch"
    ):
        build(stages(f", pretrained: {tmp_path}/empty"))
    wide = "{image_size: 4, block_out_channels: [16, 32], norm_num_groups: 4, attention: false, pretrained: X}"
    with pytest.raises(
        ConfigError,
        match=r"block_out_channels: folder \[8, 16\], gentrain builds \[16, 32\] \(set "
        r"model.stages\[0\].block_out_channels\)",
    ):
        build(f"model.stages=[{wide.replace('X', base_folders + '/stage1')}]", "data.image_size=4")
    with pytest.raises(ConfigError, match=r"model.stages\[1\].lora.targets=\['nothing'\]"):
        build(stages("", f", pretrained: {base_folders}/stage2, lora: {{targets: [nothing]}}"))
    with pytest.raises(ConfigError, match="lora adapts pretrained weights: set pretrained"):
        load_config(YAML, [stages("", ", lora: {rank: 2}")], {})
    # The same errors end a training run with exit 2.
    r = run_cli("train", YAML, f"run.dir={tmp_path}/run", stages(f", pretrained: {tmp_path}/empty"), env=env())
    assert r.returncode == 2 and "model.stages[0].pretrained" in r.stderr, r.stderr[-2000:]
