"""What `train.float8` can give a DiT step at most, by torchao's own roofline model: no GPU needed.

`bench/gpu.py` measures what float8 gives on a GPU (DiT-XL/2 at batch 128, tensorwise + compile: 1.031x the
hand-written bf16 compiled loop on an H200; issue 34 asks for 1.3x). This script asks what it could give. For
every linear layer gentrain converts with each recipe (`trainer.engine.float8.float8_layers`: the attention
and MLP linears torchao's size thresholds keep; `--unsized`: all of them, as the suite's emulated float8
does), on the DiT that bench/gpu.py trains (built by gentrain's own backbone; each layer's rows recorded from
a forward on the meta device),
torchao's roofline model (`torchao.testing.training.roofline_utils`, the model behind torchao's
benchmarks/float8/float8_roofline.py) gives:

- the three bf16 GEMMs of its forward and backward, at 78% of the card's bf16 peak;
- the three float8 GEMMs at 78% of the float8 peak, plus the memory traffic of the casts float8 adds (the
  amax and cast kernels of the input, the weight and the output gradient) at 92% of the card's bandwidth,
  without and with the amax read fused into the op before it (compile's best case: `fused`).

Printed, per card, recipe and fusion case:

- `linear_speedup`: the layers' bf16 time over their float8 time. A step that were nothing but these
  matmuls would speed up this much: the ceiling for any step of this model.
- `step_speedup` (the measured card only): the measured bf16 compiled step (`--step-s`, or the hand-written
  loop's in `--measured`), its linears' modeled bf16 time replaced by their modeled float8 time, the rest as
  it was (Amdahl).
- `share_needed`: the share of the bf16 step these matmuls would have to take for `--target` to be reachable
  (none: not even a step of nothing but these matmuls reaches it).

Then `--heads` sweeps the width (heads x 72, the depth, tokens and batch kept): the linear ceiling per width on
the measured card, tensorwise with fusion, which tells at what width the target comes into reach.

torchao's table has the H100 as Meta runs it (2.4 TB/s); the H100 SXM (3.35 TB/s) and the H200 (4.8 TB/s) are
added here from NVIDIA's datasheets with the same compute peaks and torchao's H100 efficiencies, as torchao
itself fills in cards it has not measured.

Usage: python bench/float8_roofline.py [--model dit-xl] [--measured bench/results/gpu-h200-2026-11-27b.json]
       [--step-s S --card "NVIDIA H200"] [--target 1.3] [--heads 16 32 48 64] [--unsized]
       python bench/float8_roofline.py --quick --unsized --step-s 0.01   # the suite's smoke run: a tiny DiT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu import MODELS, QUICK  # noqa: E402  (bench/gpu.py: the shapes the GPU comparison trains)

from trainer.diffusion.backbones.dit import DiTBackbone, DiTBackboneConfig  # noqa: E402
from trainer.engine.float8 import float8_layers  # noqa: E402

MEASURED = REPO / "bench" / "results" / "gpu-h200-2026-11-27b.json"
H100 = "NVIDIA H100"
# Cards torchao's table lacks: datasheet memory bandwidths, the H100's compute peaks (the H200 has the same
# tensor cores) and torchao's H100 efficiencies.
EXTRA_CARDS = {"NVIDIA H100 SXM": 3.35e12, "NVIDIA H200": 4.8e12}
CARDS = [H100, *EXTRA_CARDS]
RECIPES = ("tensorwise", "rowwise")
TOKENS_SIDE = 32  # bench/gpu.py's 1-channel 32x32 images


def roofline():
    """torchao's roofline module with the extra cards registered. Its functions are a testing module's, not
    torchao's public API; if an upgrade moves them this says so instead of failing in a traceback."""
    try:
        from torchao.testing.training import roofline_utils as ru

        ru.get_gemm_time_sympy, ru.get_float8_mem_sympy, ru.gpu_name_to_specs[H100]  # noqa: B018
    except (ImportError, AttributeError, KeyError) as e:
        raise SystemExit(
            f"torchao's roofline model (torchao.testing.training.roofline_utils: get_gemm_time_sympy, "
            f"get_float8_mem_sympy, the {H100!r} specs) is not where this bench expects it ({e}); torchao "
            f"{getattr(sys.modules.get('torchao'), '__version__', '?')} moved it: update bench/float8_roofline.py"
        ) from e
    for name, bandwidth in EXTRA_CARDS.items():
        ru.gpu_name_to_specs.setdefault(name, dict(ru.gpu_name_to_specs[H100], peak_mem_bw_bytes_sec=bandwidth))
    return ru


def converted_linears(
    layers: int, heads: int, dim: int, batch: int, recipe: str, sized: bool = True
) -> dict[str, tuple[int, int, int]]:
    """{name: (M, K, N)} of the linears `train.float8=recipe` converts in gentrain's DiT of this shape: M the
    rows each multiplies at `batch` (recorded from a forward on the meta device: no memory, no arithmetic)."""
    config = DiTBackboneConfig(num_layers=layers, num_attention_heads=heads, attention_head_dim=dim, patch_size=2)
    with torch.device("meta"):
        backbone = DiTBackbone.build(config, sample_size=TOKENS_SIDE, channels=1, num_classes=10)
    shapes: dict[str, tuple[int, int, int]] = {}

    def record(name):
        def hook(module, args):
            shapes[name] = (args[0].numel() // module.in_features, module.in_features, module.out_features)

        return hook

    convert, _ = float8_layers(backbone.model, recipe, sized)
    for name, module in backbone.model.named_modules():
        if name in convert:
            module.register_forward_pre_hook(record(name))
    x = torch.empty(batch, 1, TOKENS_SIDE, TOKENS_SIDE, device="meta")
    t = torch.zeros(batch, dtype=torch.long, device="meta")
    backbone.call(backbone.model, x, t, {"labels": torch.zeros(batch, dtype=torch.long, device="meta")})
    return shapes


def model_times(ru, shapes, card: str, recipe: str, fused: bool) -> dict[str, float]:
    """The layers' modeled seconds per step: bf16 GEMMs, float8 GEMMs, float8's casts."""
    bf16 = fp8 = casts = 0.0
    for m, k, n in shapes.values():
        bf16 += float(ru.get_gemm_time_sympy(m, k, n, torch.bfloat16, None, None, card))
        fp8 += float(ru.get_gemm_time_sympy(m, k, n, torch.float8_e4m3fn, recipe, None, card))
        casts += float(ru.get_float8_mem_sympy(m, k, n, recipe, None, fused, card))
    return {"bf16_s": bf16, "fp8_gemm_s": fp8, "fp8_casts_s": casts}


def share_needed(target: float, linear_speedup: float) -> float | None:
    """s with 1 / (1 - s + s / r) = target: the linears' share of the step that makes the step `target` times
    faster when they speed up r times. None where r <= target (no share does)."""
    if linear_speedup <= target:
        return None
    return (1 - 1 / target) / (1 - 1 / linear_speedup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dit-xl", choices=sorted(MODELS))
    p.add_argument("--quick", action="store_true", help="a tiny DiT (bench/gpu.py's --quick shapes)")
    p.add_argument("--measured", type=Path, default=MEASURED, help="bench/gpu.py's JSON with the bf16 step")
    p.add_argument("--step-s", type=float, help="the bf16 compiled step's seconds (instead of --measured)")
    p.add_argument("--card", default="NVIDIA H200", choices=CARDS, help="the card --step-s was measured on")
    p.add_argument("--target", type=float, default=1.3)
    p.add_argument("--heads", type=int, nargs="*", default=[16, 32, 48, 64], help="widths to sweep (x 72)")
    p.add_argument(
        "--unsized", action="store_true", help="every eligible linear, not only those torchao's size thresholds keep"
    )
    args = p.parse_args()

    ru = roofline()
    layers, heads, dim, batch, _ = (QUICK if args.quick else MODELS)[args.model]
    step_s = args.step_s
    source = "--step-s"
    if step_s is None:
        results = json.loads(args.measured.read_text())["results"]
        step_s = results[f"hand:{args.model}-compile"]["step_s"]
        source = f"{args.measured.name}: hand:{args.model}-compile"
    shapes = {r: converted_linears(layers, heads, dim, batch, r, not args.unsized) for r in RECIPES}
    print(
        json.dumps(
            {
                "model": args.model + (" (quick)" if args.quick else ""),
                "width": heads * dim,
                "batch": batch,
                "linears": {r: len(v) for r, v in shapes.items()},
                "shapes": {r: sorted(set(v.values())) for r, v in shapes.items()},
                "measured_step_s": step_s,
                "measured_on": args.card,
                "measured_from": source,
            }
        ),
        flush=True,
    )
    rows = []
    for card in CARDS:
        for recipe in RECIPES:
            for fused in (False, True):
                if not shapes[recipe]:
                    continue  # nothing this recipe converts
                t = model_times(ru, shapes[recipe], card, recipe, fused)
                linear = t["bf16_s"] / (t["fp8_gemm_s"] + t["fp8_casts_s"])
                row = {"card": card, "recipe": recipe, "fused": fused} | {k: round(v * 1e3, 3) for k, v in t.items()}
                row = {k.replace("_s", "_ms") if k.endswith("_s") else k: v for k, v in row.items()}
                row["linear_speedup"] = round(linear, 4)
                row["share_needed"] = share_needed(args.target, linear)
                if card == args.card:
                    rest = step_s - t["bf16_s"]
                    row["linear_share_of_step"] = round(t["bf16_s"] / step_s, 4)
                    row["step_speedup"] = round(step_s / (rest + t["fp8_gemm_s"] + t["fp8_casts_s"]), 4)
                rows.append(row)
                print(json.dumps(row), flush=True)
    sweep = {}
    for h in args.heads:
        widened = converted_linears(layers, h, dim, batch, "tensorwise", not args.unsized)
        if widened:
            t = model_times(ru, widened, args.card, "tensorwise", True)
            sweep[h * dim] = round(t["bf16_s"] / (t["fp8_gemm_s"] + t["fp8_casts_s"]), 4)
    on_card = [r for r in rows if r["card"] == args.card]
    if not on_card:
        note = "no linear of this model is above torchao's size thresholds; --unsized models them all"
        print(json.dumps({"target": args.target, "best_step_speedup": None, "note": note}), flush=True)
        return
    best = max(on_card, key=lambda r: r["step_speedup"])
    print(
        json.dumps(
            {
                "target": args.target,
                "best_step_speedup": best["step_speedup"],
                "best_case": f"{best['recipe']}, fused={best['fused']}",
                "linear_ceiling": max(r["linear_speedup"] for r in on_card),
                "linear_speedup_by_width": sweep,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
