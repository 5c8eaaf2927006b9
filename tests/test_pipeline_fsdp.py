"""A released pipeline fine-tuned under FSDP2 at two ranks (issue 48, deliver 2): LoRA adapters on a sharded
half-precision base (fp32 adapters, the base never saved) and a full fine-tune, each with one rank SIGKILLed
mid-run under `torchrun --nproc-per-node=2` (gloo, CPU) and the restarted job ending bit-identical to an
uninterrupted one (every tensor of the final checkpoint: adapters or weights, EMA, optimizer, each rank's RNG).
The LoRA runs checkpoint their blocks (train.activation_checkpointing=blocks) and keep memory-tier snapshots,
which hold the adapters alone too and from which the killed run resumes; one process resumes their checkpoint. LoRA with train.compile trains and
resumes on the tiny PixArt-Sigma pipeline (one transformer block: one compiled graph, the cheapest).
The pipelines are the tiny random ones of tests/tiny_pipelines.py."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import REPO, clean_env, run_cli
from safetensors.torch import load_file
from test_pipeline_finetune import _raw_header
from test_vqgan_maskgit import _kill_and_compare
from tiny_pipelines import BUILDERS, captioned_images, folder_fixture, train_args

pytestmark = pytest.mark.slow

STEPS, KILL_AT = 4, 3  # checkpoints at 2 and 4: rank 1 dies in step 3


sd = folder_fixture("sd")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return captioned_images(tmp_path_factory.mktemp("images"), 6)


def _args(sd, images, tmp_path, *extra: str):
    text = tmp_path / "text"  # one caption cache for both runs: each caption encoded alone, so the same bytes

    def make(root):
        return train_args(
            "sd15-lora",  # bf16: the LoRA base in bf16, a full fine-tune's fp32 weights gathered in bf16
            sd,
            images,
            f"{root}/run",
            "sample.num=1",  # the preview drawn at the end: one image, one step
            "sample.inference_steps=1",
            f"model.text.cache_dir={text}",
            "task=probe_tasks:KillableDDPM",
            "train.parallel=fsdp",
            *(e.replace("ROOT", str(root)) for e in extra),
            max_steps=STEPS,
        )

    return make


@pytest.fixture(scope="module")
def lora(sd, images, tmp_path_factory):
    """The LoRA run, uninterrupted and killed-and-restarted: (final checkpoint tensors, the killed run's log, root)."""
    tmp_path = tmp_path_factory.mktemp("lora-fsdp")
    extra = ["train.activation_checkpointing=blocks", "checkpoint.memory=true", "checkpoint.memory_dir=ROOT/shm"]
    # Rank 1 dies once both ranks' memory-tier pieces of step 3 are written (its own alone would race rank 0's):
    # the restart resumes from that snapshot (newer than the store's step 2).
    pieces = f"{tmp_path}/killed/shm/*/step-{KILL_AT:09d}/piece-r0000[01].json"
    make = _args(sd, images, tmp_path, *extra)
    env = {"PROBE_TASK_KILL_AFTER": pieces, "PROBE_TASK_KILL_AFTER_COUNT": "2"}
    a = _kill_and_compare(tmp_path, make, KILL_AT, STEPS, HF_HUB_OFFLINE="1", **env)
    return a, (tmp_path / "killed.log").read_text(), tmp_path


def _adapters(sd) -> tuple[set[str], set[str]]:
    """The base's weight names (as the folder names them and as peft renames the adapted layers) and the
    adapters' names, from a LoRA model built as the run builds it."""
    from diffusers import UNet2DConditionModel

    from trainer.models.finetune import LoraSettings, apply_lora

    targets = ["to_q", "to_k", "to_v", "to_out.0"]  # the sd15-lora preset's
    unet = UNet2DConditionModel.from_pretrained(sd / "unet")
    apply_lora(unet, LoraSettings(rank=4, targets=targets), "model.lora", targets)
    adapters = {n for n, p in unet.named_parameters() if p.requires_grad}
    base = set(unet.state_dict()) - adapters
    base |= set(load_file(sd / "unet" / "diffusion_pytorch_model.safetensors"))
    return base, adapters


def test_a_sigkilled_rank_of_a_lora_run_on_a_sharded_base_resumes_bit_identical(lora):
    a, log, _ = lora
    resumed = r"world_size=2 restart=1 parallel=fsdp .*resumed_from=memory:\S+step-000000003"  # the adapters' snapshot
    assert re.search(resumed, log), log[-3000:]
    # On every attempt: the UNet's blocks are the units, the base in bf16 and the adapters in fp32 within them,
    # and its blocks checkpointed.
    units = "fsdp: UNet2DConditionModel sharded as 7 units "
    found = re.findall(rf"{units}.*; frozen (\d+) parameters \(bfloat16\), trainable (\d+) \(float32\)\n", log)
    assert len(found) == 2 and all(int(f) > 10 * int(t) > 0 for f, t in found), log[-3000:]
    assert log.count("activation checkpointing (blocks): unet, 7 blocks") == 2
    assert {"unet.model.rank-00000.safetensors", "unet.model.rank-00001.safetensors"} <= set(a)
    assert {"unet.optimizer.rank-00001.safetensors", "rank-00001.safetensors"} <= set(a)


def test_a_lora_fsdp_checkpoint_and_its_memory_snapshots_hold_no_base_weight(sd, lora):
    a, _, tmp_path = lora
    base, adapters = _adapters(sd)
    for kind in ("model", "ema"):
        files = [n for n in a if n.startswith(f"unet.{kind}.")]
        assert files and all(n.endswith(".safetensors") and ".rank-" in n for n in files)
        keys = set().union(*(a[n] for n in files))
        assert keys == adapters and not keys & base, kind
        assert all(a[n][k].dtype == torch.float32 for n in files for k in a[n]), kind  # the adapters stay fp32
    step = tmp_path / "killed" / "run" / "checkpoints" / f"step-{STEPS:09d}"
    index = json.loads((step / "shards.json").read_text())["tensors"]
    assert set(index["unet.model"]) == set(index["unet.ema"]) == adapters
    # The node-local snapshots (checkpoint.memory) of either run: the adapters' slices only.
    snapshots = sorted((tmp_path / "killed" / "shm").rglob("unet.model.*safetensors"))
    assert snapshots, "no memory-tier snapshot"
    assert all(k == "__metadata__" or k in adapters for f in snapshots for k in _raw_header(f))


def test_a_lora_fsdp_checkpoint_resumes_in_one_process(sd, images, lora):
    """Another world size: one process gathers the two ranks' adapter slices over the base it rebuilt."""
    _, _, tmp_path = lora
    args = _args(sd, images, tmp_path)(tmp_path / "killed")
    one = [a for a in args if a != "train.parallel=fsdp"]
    env = clean_env(PYTHONPATH=str(REPO / "tests"), HF_HUB_OFFLINE="1")
    r = run_cli("train", *one, f"train.max_steps={STEPS + 1}", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(rf"world_size=1 .*resumed_from=\S+step-{STEPS:09d}", r.stderr), r.stderr[-3000:]


def test_a_sigkilled_rank_of_a_full_fine_tune_resumes_bit_identical(sd, images, tmp_path):
    a = _kill_and_compare(tmp_path, _args(sd, images, tmp_path, "model.lora=null"), KILL_AT, STEPS, HF_HUB_OFFLINE="1")
    log = (tmp_path / "killed.log").read_text()
    assert re.search(r"world_size=2 restart=1 parallel=fsdp .*resumed_from=\S+step-000000002", log), log[-3000:]
    assert log.count("fsdp: UNet2DConditionModel sharded as 7 units ") == 2 and "; frozen " not in log
    folder = load_file(sd / "unet" / "diffusion_pytorch_model.safetensors")
    files = [n for n in a if n.startswith("unet.model.")]
    assert set().union(*(a[n] for n in files)) == set(folder)  # every weight of the UNet, sharded


def test_a_compiled_lora_run_trains_and_resumes(images, tmp_path):
    """train.compile with peft's LoRA layers in the compiled block: one graph, no graph break; a run resumed
    from its checkpoint compiles again and trains on."""
    pixart = BUILDERS["pixart-sigma"](tmp_path / "pipelines")
    env = clean_env(PYTHONPATH=str(REPO / "tests"), HF_HUB_OFFLINE="1")
    base = [
        "train",
        "pixart-sigma-lora",
        f"model.pretrained={pixart}",
        f"data.path={images}",
        "data.image_size=16",
        "data.buckets=null",  # the preset's aspect buckets step 64 pixels
        "data.val_fraction=0",
        "train.batch_size=2",
        "train.num_workers=0",
        "train.val_every_steps=0",
        "train.compile=true",
        "checkpoint.every_steps=1",
        "sample.every_steps=0",
        "sample.num=1",
        "sample.inference_steps=1",
        f"run.dir={tmp_path}/run",
        f"model.text.cache_dir={tmp_path}/text",
        "task=probe_tasks:KillableDDPM",
    ]
    for steps, resumed in ((1, "none"), (2, r"\S+step-000000001")):
        r = run_cli(*base, f"train.max_steps={steps}", env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert re.search(rf"resumed_from={resumed}", r.stderr), r.stderr[-3000:]
        assert "compile: transformer, 1 blocks (BasicTransformerBlock)" in r.stderr
        assert re.search(r"compile: [\d.]+ s compiling, 1 graph\(s\), 0 graph break", r.stderr), r.stderr[-3000:]
        assert re.search(rf"step={steps}/{steps} transformer/loss=\d", r.stderr), r.stderr[-3000:]
