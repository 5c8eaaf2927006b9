"""The diffusion core's transformer backbones under `torchrun --nproc-per-node=2` (gloo, CPU), with DDP and with
FSDP (every transformer block its own unit): a rank SIGKILLed mid-run and restarted ends bit-identical to an
uninterrupted run (every tensor of the final checkpoint: weights, EMA, optimizer, every rank's RNG state)."""

from __future__ import annotations

import re

import pytest
from conftest import tiny
from test_vqgan_maskgit import _kill_and_compare

_TRANSFORMER = "num_layers: 2, num_attention_heads: 2, attention_head_dim: 8"
# dit and pixart with dropout (draws from the global RNG, which the checkpoint's RNG files must restore);
# pixart and mmdit read captions ("a handwritten seven") through the shipped 384-wide sentence encoder.
BACKBONES = {
    "dit": (f"{{kind: dit, {_TRANSFORMER}, dropout: 0.1}}", ["model.num_classes=10"], "DiTTransformer2DModel"),
    "pixart": (
        f"{{kind: pixart, {_TRANSFORMER}, dropout: 0.1, caption_channels: 384}}",
        ["model.num_classes=null", "model.text={max_tokens: 8, cache_dir: TEXT}"],
        "PixArtTransformer2DModel",
    ),
    "mmdit": (
        f"{{kind: mmdit, {_TRANSFORMER}, caption_channels: 384, pooled_channels: 384}}",
        ["model.num_classes=null", "model.text={max_tokens: 8, cache_dir: TEXT}"],
        "SD3Transformer2DModel",
    ),
}
BLOCKS = {"dit": "BasicTransformerBlock", "pixart": "BasicTransformerBlock", "mmdit": "JointTransformerBlock"}


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_a_sigkilled_rank_resumes_bit_identical(tmp_path, backbone, parallel):
    steps = 6
    spec, extra, cls = BACKBONES[backbone]
    text = str(tmp_path / "text")  # one caption cache for both runs: each caption encoded alone, so the same bytes

    def args(root):
        return tiny(
            root,
            "task=probe_tasks:KillableDDPM",
            f"model.backbone={spec}",
            *(e.replace("TEXT", text) for e in extra),
            "checkpoint.every_steps=3",
            f"train.parallel={parallel}",
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
    else:
        assert {
            "transformer.model.safetensors",
            "transformer.ema.safetensors",
            "transformer.optimizer.safetensors",
        } <= set(a)
    assert {"rank-00000.safetensors", "rank-00001.safetensors"} <= set(a)
