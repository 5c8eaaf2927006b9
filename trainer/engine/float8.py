"""float8 training (`train.float8`): torchao's `Float8Linear` in place of a transformer backbone's linear layers.

Each converted layer keeps its weight as it was (float32 master weights, the same parameter names) and casts
the matmul's operands to float8 with dynamic scales at every call; the matmul runs on the GPU's float8 tensor
cores, the rest of the model as before (bf16 autocast). Hence:

- **Checkpoints do not change**: weights, EMA and optimizer state are the bf16 run's tensors under the same
  names, so a float8 run resumes without float8 and a bf16 run resumes with it (the step's numbers differ, as
  with any change of kernels; exact resume holds within one setting).
- **Scaling**: `tensorwise` (the default for `true`) takes one scale per tensor and cuBLAS's float8 GEMM, the
  fastest recipe; `rowwise` takes a scale per row of each operand (CUTLASS kernel), more robust to outlier
  rows (large activations in a few tokens), slower (0.78x tensorwise's DiT-XL/2 step on an H200,
  docs/benchmarks.md). torchao's own guidance, which torchtitan follows.
- **Under FSDP2** the weights are gathered as FSDP's mixed precision gathers them (bf16) and cast to float8
  after: torchao's float8 all-gather (`enable_fsdp_float8_all_gather`, tensorwise only) would halve that
  traffic but makes each weight a tensor subclass, which the sharded checkpoint writer has not been tested
  with on a GPU; not turned on.
- **Which layers**: what each backbone declares (`Backbone.float8_per_sample`, set on the model it builds as
  the attribute `float8_per_sample`; this module knows no class or layer name): a part holding a model that
  declares it is a transformer, and its `nn.Linear` layers whose both dimensions are multiples of 16 (the
  float8 GEMM's alignment) convert, except the per-sample ones it names (embeddings, adaLN modulation, the
  final projection): attention projections and MLPs. A UNet declares none: refused. Of those, the ones
  torchao's size thresholds for the recipe say float8 would slow down stay bf16 (`float8_layers`; logged with
  their shapes); a model with none left is refused with the shapes.
- **Where**: NVIDIA GPUs with float8 tensor cores (compute capability 8.9: L4, L40S; 9.0: H100, H200; B200);
  anywhere else exit 2 with the reason. It pays off with `train.compile=true`, which fuses the casts and scales
  into neighbouring kernels (eager, the casts cost more than the faster matmuls save on most shapes).

Applied before DDP/FSDP wrapping, activation checkpointing and compile (torchtitan's order).

The suite setting `GENTRAIN_TEST_FLOAT8_EMULATE=1` (never a config key, docs/development.md) lets float8 run
where there are no float8 tensor cores, with torchao's own test mode (`Float8LinearConfig.emulate`: the same
casts, scales and Float8Linear autograd, the matmul emulated in higher precision). It is how the suite runs
float8 at two FSDP2 ranks with real torchrun processes on CPU (one GPU cannot hold two NCCL
ranks); it gives no speedup.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Collection, Mapping

import torch
from torch import nn

from trainer.errors import ConfigError

log = logging.getLogger("gentrain")

_EXTRA = "pip install 'gentrain[float8]'"
TEST_EMULATE = "GENTRAIN_TEST_FLOAT8_EMULATE"
DECLARED = "float8_per_sample"  # the attribute a backbone sets on its model (Backbone.float8_per_sample)


def check_float8_device(recipe: str, device: torch.device) -> None:
    """ConfigError (exit 2) unless `device` has float8 tensor cores."""
    if device.type != "cuda":
        raise ConfigError(
            f"train.float8={recipe}: float8 matmuls need an NVIDIA GPU with float8 tensor cores (compute capability "
            f"8.9 or newer: L4, L40S, H100, H200, B200); this run is on {device.type}. Remove train.float8 (bf16 "
            "trains the same model: the checkpoints are interchangeable)"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"train.float8={recipe}: {name} (compute capability {major}.{minor}) has no float8 tensor cores (8.9 or "
            "newer needed: L4, L40S, H100, H200, B200). Remove train.float8 (bf16 trains the same model)"
        )


def declared_models(module: nn.Module) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """(name, model, per-sample fragments) of the models inside `module` (itself included) whose backbone
    declares float8: `Backbone.float8_per_sample`, set on the model it builds."""
    return [(name, m, tuple(getattr(m, DECLARED))) for name, m in module.named_modules() if hasattr(m, DECLARED)]


def float8_eligible(module: nn.Module, fqn: str, per_sample: Collection[str]) -> bool:
    """Token-level linears (attention and MLP) whose dims the float8 GEMM accepts; `fqn` is the layer's name in
    the declaring model and `per_sample` that model's declared fragments. Per-sample linears (timestep and
    label embeddings, adaLN modulation, the final projection) multiply a batch-sized M, which the GEMM also
    wants a multiple of 16, for a negligible share of the FLOPs: they stay in bf16."""
    if not isinstance(module, nn.Linear) or module.in_features % 16 or module.out_features % 16:
        return False
    return not any(word in fqn for word in per_sample)


def float8_layers(module: nn.Module, recipe: str, sized: bool = True) -> tuple[list[str], list[str]]:
    """(convert, too_small): the names of `module`'s linears that `train.float8=recipe` converts, and of the
    eligible ones (`float8_eligible`) it keeps in bf16 because torchao's size thresholds for the recipe say
    float8 would be slower there (`sized`; off, every eligible layer converts).

    The thresholds are torchao's `_auto_filter_for_recipe` (exported, marked experimental; guarded by
    tests/test_private_apis.py), drawn from its float8 benchmarks on H100s: the casts float8 adds grow with
    rows x (in + out) and the GEMM time it saves with rows x in x out, so narrow layers lose. Tensorwise keeps
    a layer unless in <= 4096 and out <= 1024; rowwise, whose casts cost more, only layers with out > 2048 and
    in > 1024, and not out <= 4096 with in <= 2048. DiT-XL/2 (width 1,152): every attention and MLP linear
    converts with tensorwise, only the MLP's first (1,152 -> 4,608) with rowwise; a DiT-S/2 (width 384) keeps
    all but that one in bf16 with tensorwise, all with rowwise."""
    fast = None
    if sized:
        from torchao.float8 import _auto_filter_for_recipe

        fast = _auto_filter_for_recipe(recipe, filter_fqns=[])
    convert: list[str] = []
    too_small: list[str] = []
    seen: set[str] = set()
    for prefix, model, per_sample in declared_models(module):
        for name, m in model.named_modules():
            fqn = f"{prefix}.{name}" if prefix and name else prefix or name
            if fqn in seen or not float8_eligible(m, name, per_sample):
                continue
            seen.add(fqn)
            (convert if fast is None or fast(m, fqn) else too_small).append(fqn)
    return convert, too_small


def _shapes(module: nn.Module, names: Collection[str]) -> str:
    """`in x out (x count)` of the named linears, the largest first."""
    counts: dict[tuple[int, int], int] = {}
    for fqn, m in module.named_modules():
        if fqn in names:
            counts[(m.in_features, m.out_features)] = counts.get((m.in_features, m.out_features), 0) + 1
    shapes = sorted(counts, key=lambda s: -s[0] * s[1])
    return ", ".join(f"{i}x{o}" + (f" (x{counts[i, o]})" if counts[i, o] > 1 else "") for i, o in shapes)


def apply_float8(
    modules: Mapping[str, nn.Module], learning: Collection[str], recipe: str, device: torch.device, task: str
) -> int:
    """Convert the learning transformer parts' eligible linear layers that are large enough for float8 to pay
    off (`float8_layers`) to float8; the number converted. Exit 2 where none is."""
    if recipe == "none":
        return 0
    emulate = os.environ.get(TEST_EMULATE) == "1"
    if not emulate:
        check_float8_device(recipe, device)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ConfigError(f"train.float8={recipe} needs torchao: {_EXTRA} ({e})") from e
    parts = [n for n in learning if declared_models(modules[n])]
    if not parts:
        raise ConfigError(
            f"train.float8={recipe}: task {task!r} trains no transformer backbone (parts: {', '.join(learning)}); "
            "float8 applies to transformer backbones (a model.backbone.kind whose linears it declares: see "
            "docs/scaling.md#float8). Remove train.float8"
        )
    # The suite's emulated matmuls run on tiny models, all below the thresholds: every eligible layer converts.
    plans = {name: float8_layers(modules[name], recipe, sized=not emulate) for name in parts}
    if not any(convert for convert, _ in plans.values()):
        small = "; ".join(f"{name}: {_shapes(modules[name], plans[name][1])}" for name in parts)
        other = " (or try train.float8=tensorwise, whose thresholds are lower)" if recipe == "rowwise" else ""
        raise ConfigError(
            f"train.float8={recipe}: no linear layer of {', '.join(parts)} is large enough for float8 to be "
            f"faster than bf16 (in x out: {small or 'none'}; torchao's size thresholds for {recipe} scaling, "
            f"from its H100 benchmarks, see docs/scaling.md#float8). Remove train.float8{other}"
        )
    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
        log.warning(
            "float8: %s=1, matmuls emulated (torchao's test mode) and layers of every size converted: a test "
            "suite setting, no speedup",
            TEST_EMULATE,
        )
    converted = 0
    for name in parts:
        chosen = set(plans[name][0])
        before = sum(1 for m in modules[name].modules() if isinstance(m, nn.Linear))
        convert_to_float8_training(
            modules[name], module_filter_fn=lambda m, fqn, chosen=chosen: fqn in chosen, config=config
        )
        still = sum(1 for m in modules[name].modules() if type(m) is nn.Linear)
        converted += before - still
    kept = {name: plans[name][1] for name in parts if plans[name][1]}
    line = f"float8 ({recipe} scaling): {converted} linear layers of {', '.join(parts)}"
    if kept:
        line += "; kept in bf16, too small for float8 to be faster (torchao's thresholds): " + "; ".join(
            f"{len(names)} of {name} ({_shapes(modules[name], names)})" for name, names in kept.items()
        )
    log.info("%s", line)
    return converted
