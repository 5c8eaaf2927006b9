"""Regional compilation (`train.compile`, trainer/engine/compile.py): every block of a part gets a compiled
forward for training and stays eager without gradients, names and state dicts unchanged; a compiled DiT step
computes what the eager one does within fp32 rounding; a task with no blocks is refused. The engine path (a
SIGKILLed rank of a compiled, checkpointed DiT under FSDP resumes bit-identical) is in
tests/test_diffusion_fsdp.py; dynamo's counters are guarded in tests/test_private_apis.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.diffusion import build_backbone
from trainer.engine.compile import CompileStats, apply_compile, compile_blocks, compiled_blocks
from trainer.engine.shard import fsdp_units
from trainer.errors import ConfigError

DIT = {"kind": "dit", "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8}


def _dit(seed: int = 0):
    torch.manual_seed(seed)
    return build_backbone(DIT, 8, 1, num_classes=10)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 1000, (4,), generator=g), torch.arange(4)


def test_blocks_keep_names_and_run_eagerly_without_gradients():
    eager, compiled = _dit(), _dit()
    before = list(compiled.model.state_dict())
    names = [type(m).__name__ for m in compiled.model.modules()]
    units = compile_blocks(compiled.model)
    assert units == fsdp_units(compiled.model) == compiled_blocks(compiled.model) and len(units) == 2
    assert list(compiled.model.state_dict()) == before
    assert [type(m).__name__ for m in compiled.model.modules()] == names
    assert torch._dynamo.config.recompile_limit >= len(units)
    x, t, labels = _batch()
    graphs = CompileStats.now().graphs
    with torch.no_grad():  # validation, sampling, EMA: no graph, the eager result to the bit
        out = compiled(x, t, {"labels": labels})
        assert torch.equal(out, eager(x, t, {"labels": labels}))
    assert CompileStats.now().graphs == graphs


def test_a_task_without_blocks_is_refused():
    with pytest.raises(ConfigError, match=r"train.compile=true: the probe task's parts \(net\) have no blocks"):
        apply_compile({"net": nn.Sequential(nn.Linear(2, 2))}, ["net"], "probe")


@pytest.mark.slow
def test_a_compiled_step_matches_the_eager_step_within_fp32_rounding():
    """Inductor fuses and reorders the block's float32 arithmetic; the math is the same, so the loss and every
    gradient differ from eager by rounding only. A sum of n float32 terms reordered moves by at most about
    n * eps * sum|terms| (eps = 2**-24 per operation); the block's widest sums have 32 terms (width, heads x
    dim) chained through ~10 ops per block and 2 blocks, so 1e-4 of the largest gradient leaves a wide margin
    (measured here: 2.7e-7) while a wrong graph (a dropped residual, a stale weight) is off by O(1)."""
    before = CompileStats.now()  # dynamo's counters are per process: other tests' compiles count too
    results = []
    for compile_ in (False, True):
        backbone = _dit()
        if compile_:
            compile_blocks(backbone.model)
        x, t, labels = _batch()
        loss = (backbone(x, t, {"labels": labels}) - x).square().mean()
        loss.backward()
        grads = {n: p.grad for n, p in backbone.model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (loss_e, grads_e), (loss_c, grads_c) = results
    assert grads_e.keys() == grads_c.keys()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=0)
    # One scale for all: a key bias's gradient is zero in exact arithmetic (softmax ignores a shift), so its
    # float value is rounding noise on both sides and has no scale of its own.
    scale = max(g.abs().max().item() for g in grads_e.values())
    for name, g in grads_e.items():
        torch.testing.assert_close(grads_c[name], g, rtol=0, atol=1e-4 * scale, msg=name)
    stats = CompileStats.now()
    graphs, breaks = stats.graphs - before.graphs, stats.graph_breaks - before.graph_breaks
    # One graph for both blocks: the first block's input (a transposed view of the patch embedding) is laid
    # out as the second's, so dynamo's stride guards do not compile the block a second time.
    assert graphs == 1 and breaks == 0 and stats.seconds > before.seconds, (before, stats)
    assert stats.recompiles == before.recompiles, stats.recompile_reasons
