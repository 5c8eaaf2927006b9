"""The diffusion core's transformer backbones under `torchrun --nproc-per-node=2` (gloo, CPU), with DDP and with
FSDP (every transformer block its own unit): a rank SIGKILLed mid-run and restarted ends bit-identical to an
uninterrupted run (every tensor of the final checkpoint: weights, EMA, optimizer, every rank's RNG state); DiT
under DDP also with 8-bit AdamW state (train.optimizer=adamw8bit, torchao)."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import REPO, clean_env, run_cli, tiny
from elastic_helpers import finish, standalone, start_torchrun
from test_vqgan_maskgit import _kill_and_compare
from tiny_backbones import backbone_override

from trainer.checkpoint import CheckpointStore

# Two blocks each (FSDP units); dit and pixart with dropout (draws from the global RNG, which the checkpoint's
# RNG files must restore); pixart and mmdit read captions ("a handwritten seven") through the shipped 384-wide
# sentence encoder.
_TEXT = ["model.num_classes=null", "model.text={max_tokens: 8, cache_dir: TEXT}"]
BACKBONES = {
    "dit": (backbone_override("dit", num_layers=2, dropout=0.1), ["model.num_classes=10"], "DiTTransformer2DModel"),
    "pixart": (backbone_override("pixart", text=True, num_layers=2, dropout=0.1), _TEXT, "PixArtTransformer2DModel"),
    "mmdit": (backbone_override("mmdit", text=True, num_layers=2), _TEXT, "SD3Transformer2DModel"),
}
BLOCKS = {"dit": "BasicTransformerBlock", "pixart": "BasicTransformerBlock", "mmdit": "JointTransformerBlock"}


# DiT with 8-bit AdamW state (torchao): 64-wide, so its attention and feed-forward weights (4096 values and
# more) are quantized; the smaller ones keep float32 state.
_DIT_8BIT = backbone_override("dit", num_layers=2, attention_head_dim=32, dropout=0.1)
# DDP runs every backbone through the same engine path (whole replicas, one gradient all-reduce): the DiT
# case covers it, with 8-bit AdamW state (plain AdamW under DDP is in every other kill test). FSDP shards each
# backbone's own blocks, so every backbone runs under FSDP.
CASES = [("dit", "ddp", "adamw8bit"), ("dit", "fsdp", "adamw"), ("pixart", "fsdp", "adamw"), ("mmdit", "fsdp", "adamw")]


@pytest.mark.slow
@pytest.mark.parametrize("backbone, parallel, optimizer", CASES)
def test_a_sigkilled_rank_resumes_bit_identical(tmp_path, backbone, parallel, optimizer):
    steps = 6
    override, extra, cls = BACKBONES[backbone]
    override = _DIT_8BIT if optimizer == "adamw8bit" else override
    # DiT under FSDP with its blocks checkpointed and compiled inside their units (torchtitan's combination):
    # the recomputation replays dropout's RNG, and the restarted rank's compiled blocks draw what the
    # uninterrupted run's did
    torchtitan = (backbone, parallel) == ("dit", "fsdp")
    checkpointing = ["train.activation_checkpointing=blocks", "train.compile=true"] if torchtitan else []
    text = str(tmp_path / "text")  # one caption cache for both runs: each caption encoded alone, so the same bytes

    def args(root):
        return tiny(
            root,
            "task=probe_tasks:KillableDDPM",
            override,
            *(e.replace("TEXT", text) for e in extra),
            "checkpoint.every_steps=3",
            f"train.parallel={parallel}",
            f"train.optimizer={optimizer}",
            *checkpointing,
            max_steps=steps,
        )

    # Rank 1 dies in step 5; the restart resumes from step 3.
    a = _kill_and_compare(tmp_path, args, kill_at=5, steps=steps, HF_HUB_OFFLINE="1")
    log = (tmp_path / "killed.log").read_text()
    assert re.search(rf"world_size=2 restart=1 parallel={parallel} .*resumed_from=\S+step-000000003", log), log[-3000:]
    if parallel == "fsdp":  # weights, EMA and optimizer state in per-rank slices
        assert {"transformer.model.rank-00001.safetensors", "transformer.ema.rank-00000.safetensors"} <= set(a)
        assert {"transformer.optimizer.rank-00001.safetensors"} <= set(a)
        gathered = "; transformer_blocks.0 kept gathered after forward" if backbone == "dit" else ""
        # the transformer blocks are the units (2 layers), every attempt
        assert log.count(f"fsdp: {cls} sharded as 2 units ({BLOCKS[backbone]}) plus the rest{gathered}\n") == 2
        if checkpointing:
            assert log.count("activation checkpointing (blocks): transformer, 2 blocks (BasicTransformerBlock)") == 2
            assert log.count("compile: transformer, 2 blocks (BasicTransformerBlock)") == 2
            compiled = re.findall(r"compile: [\d.]+ s compiling, (\d+) graph\(s\), (\d+) graph break", log)
            assert len(compiled) == 2 and all(int(g) > 0 and b == "0" for g, b in compiled), compiled
    else:
        assert {
            "transformer.model.safetensors",
            "transformer.ema.safetensors",
            "transformer.optimizer.safetensors",
        } <= set(a)
    assert {"rank-00000.safetensors", "rank-00001.safetensors"} <= set(a)
    if optimizer == "adamw8bit":
        # the 8-bit state was saved as uint8 codes with their scales (and resumed bit-exactly, above) ...
        codes = [t for k, t in a["transformer.optimizer.safetensors"].items() if k.endswith(".codes")]
        assert codes and all(t.dtype == torch.uint8 for t in codes)
        # ... and a run that changes the optimizer refuses the checkpoint (exit 2) instead of mixing states
        env = clean_env(PYTHONPATH=str(REPO / "tests"), HF_HUB_OFFLINE="1")
        r = run_cli("train", *args(tmp_path / "killed"), "train.max_steps=8", "train.optimizer=adamw", env=env)
        assert r.returncode == 2, r.stderr[-3000:]
        assert "was trained with optimizer adamw8bit, this run builds adamw" in r.stderr


@pytest.mark.slow
def test_dit_under_fsdp_takes_the_same_steps_as_under_ddp(tmp_path):
    """DiT's first block is called again after the last (its embedding conditions the output layer) and stays
    gathered for it: the gradients that second call adds must reach the sharded block. Same data, draws and
    per-rank chunks under DDP and FSDP: the logged losses and gradient norms agree to float rounding (the
    norm is summed over shards under FSDP), and the weights to the Adam bound of tests/test_fsdp.py (a weight
    moves at most lr * (1 - b1) / sqrt(1 - b2) per step; twice the sum over steps)."""
    steps, lr, warmup = 4, 1e-3, 2
    override, extra, _ = BACKBONES["dit"]
    logs = {}
    for parallel in ("ddp", "fsdp"):
        args = tiny(
            tmp_path / parallel,
            override,
            *extra,
            f"train.lr={lr}",
            f"train.warmup_steps={warmup}",
            "train.lr_schedule=constant",
            "checkpoint.every_steps=0",
            f"train.parallel={parallel}",
            max_steps=steps,
        )
        log = tmp_path / f"{parallel}.log"
        proc = start_torchrun(standalone(2, max_restarts=0), args, log)
        assert finish(proc, log) == 0, log.read_text()[-4000:]
        logs[parallel] = log.read_text()

    def logged(name: str, text: str) -> torch.Tensor:
        return torch.tensor([float(v) for v in re.findall(rf"transformer/{name}=([0-9.e+-]+)", text)])

    for name in ("loss", "grad_norm"):
        a, b = logged(name, logs["ddp"]), logged(name, logs["fsdp"])
        assert len(a) == len(b) == steps
        torch.testing.assert_close(b, a, rtol=1e-4, atol=0)
    wa, wb = (full_weights(f"{tmp_path}/{p}/run/checkpoints") for p in ("ddp", "fsdp"))
    assert wa.keys() == wb.keys() and any(k.startswith("transformer_blocks.0.norm1.emb.") for k in wa)
    bound = 2 * sum(lr * min(1.0, (t + 1) / warmup) for t in range(steps)) * (1 - 0.9) / (1 - 0.999) ** 0.5
    worst = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert worst <= bound, (worst, bound)


def full_weights(root: str) -> dict[str, torch.Tensor]:
    """The transformer's whole weights, whichever layout wrote the checkpoint."""
    store = CheckpointStore(root)
    info = store.latest_valid()
    files = info.manifest.files
    return store.view(info).read_weights(
        "transformer.model.safetensors" if "transformer.model.safetensors" in files else "transformer.model",
    )


@pytest.mark.slow
def test_float8_resumes_bit_identical_under_fsdp2(tmp_path):
    """train.float8=tensorwise at two FSDP2 ranks: torchao's Float8Linear (its casts, scales and autograd) on
    sharded DTensor weights, with the matmul emulated (GENTRAIN_TEST_FLOAT8_EMULATE=1, torchao's test mode: a
    CPU has no float8 tensor cores). A rank SIGKILLed mid-run resumes bit-identical; the sharded checkpoint
    holds the plain float32 weights; a run without float8, in one process, resumes from it. DDP, whose
    wrapper leaves the layers whole, and compile run with the float8 matmuls on a GPU (tests/test_float8.py);
    one suite minute is spent on the sharded case only."""
    parallel = "fsdp"
    steps = 4
    env = {"HF_HUB_OFFLINE": "1", "GENTRAIN_TEST_FLOAT8_EMULATE": "1"}

    def args(root):
        return tiny(
            root,
            "task=probe_tasks:KillableDDPM",
            backbone_override("dit", num_layers=2),
            "model.num_classes=10",
            "checkpoint.every_steps=2",
            f"train.parallel={parallel}",
            "train.float8=tensorwise",
            max_steps=steps,
        )

    # Rank 1 dies in step 3; the restart resumes from step 2.
    a = _kill_and_compare(tmp_path, args, kill_at=3, steps=steps, **env)
    log = (tmp_path / "killed.log").read_text()
    assert re.search(rf"world_size=2 restart=1 parallel={parallel} .*resumed_from=\S+step-000000002", log), log[-3000:]
    # 2 layers x (q, k, v, out, two feed-forward linears), on every attempt
    assert log.count("float8 (tensorwise scaling): 12 linear layers of transformer") == 2, log[-3000:]
    weights = [t for name, ts in a.items() if ".model." in name or ".ema." in name for t in ts.values()]
    assert weights and all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in weights)
    assert {"transformer.model.rank-00001.safetensors", "transformer.optimizer.rank-00000.safetensors"} <= set(a)
    # float8 off, one process: the two ranks' slices are gathered into the whole float32 weights
    run_env = clean_env(PYTHONPATH=str(REPO / "tests"), HF_HUB_OFFLINE="1")
    r = run_cli("train", *args(tmp_path / "killed"), "train.max_steps=5", "train.float8=none", env=run_env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"world_size=1 .*resumed_from=\S+step-000000004", r.stderr), r.stderr[-3000:]
    assert "float8 (" not in r.stderr and "GENTRAIN_TEST_FLOAT8_EMULATE" not in r.stderr
