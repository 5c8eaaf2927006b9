"""gentrain's training step against the loop a user writes by hand, on one GPU, in one call.

The hand-written loop (`hand`, this file's own code: no gentrain import) is what a careful user writes with
torch and diffusers alone: diffusers' `DiTTransformer2DModel` of the shape gentrain builds for
`model.backbone.kind=dit` (1-channel 32x32 images, patch 2, 10 classes), bf16 autocast,
`DDPMScheduler.add_noise`, MSE, `clip_grad_norm_(1.0)`, fused AdamW, EMA by `torch._foreach_lerp_`,
`loss.item()` every step, a fixed batch already on the GPU; compiled variants compile each transformer block
(regional, as gentrain's `train.compile`). gentrain (`gt`) trains the same DiT through `gentrain train
digits-ddpm ...` (its loader, per-sample draws, EMA, progress and stop agreement; checkpoints, previews and
validation off), read back from its step lines.

Each variant is a process of its own (its peak memory is its own). Step time: for `hand`, wall time per step
over the second half of its steps (loss.item() syncs each step); for `gt`, the step lines' samples/s over
the second half (each line covers the steps since the last one, wall time, device included). Printed as JSON
lines, then the ratios (hand step time / gentrain step time: 1.0 or more means gentrain is at least as fast),
peak GPU memory ratios, and MFU against the card's datasheet peak.

`--profile dit-s-eager` instead profiles steps of the two (torch.profiler, after a warm-up, same shapes) and
prints where gentrain's step spends device time the hand-written one does not: wall and summed kernel time per
step (their difference is the device's idle time), and the kernels by their excess per step. Each side's time
is also split into matrix products, attention, float8 casts and the rest (`gemm_share`: the matmuls' share, the
part float8 can shorten; `--profile dit-xl-compile` gives the share bench/float8_roofline.py weighs its ceiling
with; `--profile dit-xl-float8` what the casts take back).

`--levers` sets float8 up each way a user could by hand (LEVERS) and measures each against the bf16 loop in
the same process: whether any setup makes float8 pay at DiT-XL/2.

Usage: python bench/gpu.py [--only dit-s dit-xl-compile hand:dit-xl-compile ...] [--out DIR] [--budget-s 480]
       python bench/gpu.py --only hand:dit-xl-compile dit-xl-float8 --profile dit-xl-compile   # both, one call
       python bench/gpu.py --profile dit-s-eager [dit-xl-compile ...] [--out DIR]
       python bench/gpu.py --levers [float8-nocompile ...] [--budget-s 200]   # float8 by hand, each way, vs bf16
       python bench/gpu.py --quick   # CPU smoke: tiny shapes, a few steps (checks the script, not speed)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

# name: (layers, heads, head dim, batch, steps)
MODELS = {"dit-s": (12, 6, 64, 256, 60), "dit-xl": (28, 16, 72, 128, 30)}
QUICK = {"dit-s": (2, 2, 16, 16, 6), "dit-xl": (2, 2, 16, 16, 6)}
# (model, mode, runner): mode eager | compile | float8 (compile + train.float8=tensorwise) | float8-rowwise
VARIANTS = [  # in order of what matters most, should the time budget run out
    ("dit-s", "eager", "hand"),
    ("dit-s", "eager", "gt"),
    ("dit-xl", "eager", "hand"),
    ("dit-xl", "eager", "gt"),
    ("dit-xl", "compile", "hand"),
    ("dit-xl", "compile", "gt"),
    ("dit-xl", "float8", "gt"),
    ("dit-xl", "float8", "hand"),  # the same float8 lever by hand: is a shortfall torchao's or gentrain's?
    ("dit-s", "compile", "hand"),
    ("dit-s", "compile", "gt"),
    ("dit-xl", "float8-rowwise", "gt"),
]


# ---------------------------------------------------------------------------------------------- hand-written
def hand_loop(model: str, mode: str, quick: bool, on_step=None, lever: str = "", steps: int = 0) -> dict:
    """The hand-written loop; `lever` (see LEVERS) changes how a float8 run is set up, `steps` overrides the
    model's step count."""
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler, DiTTransformer2DModel

    layers, heads, dim, batch, model_steps = (QUICK if quick else MODELS)[model]
    steps = steps or model_steps
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    net = DiTTransformer2DModel(
        num_attention_heads=heads,
        attention_head_dim=dim,
        in_channels=1,
        out_channels=1,
        num_layers=layers,
        sample_size=32,
        patch_size=2,
        num_embeds_ada_norm=10,
    ).to(device)
    if mode == "float8":  # torchao's float8 training on the token-level linears, as a user converts by hand
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.config import Float8GemmConfig

        config = Float8LinearConfig.from_recipe_name("tensorwise")
        if "fast-accum" in lever:  # the backward's two GEMMs accumulate fast too (the forward's already does)
            fast = Float8GemmConfig(use_fast_accum=True)
            config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)

        def token_linear(m, fqn):
            if not isinstance(m, torch.nn.Linear) or m.in_features % 16 or m.out_features % 16:
                return False
            if "mlp" in lever and ".ff." not in fqn:  # the MLP's two linears only (width x 4 width)
                return False
            return "transformer_blocks" in fqn and "norm" not in fqn

        if "nocompile" in lever:  # torchao's prototype: Triton kernels that cast and transpose in one pass
            from torchao.prototype.float8nocompile.float8nocompile_linear_utils import (
                convert_to_float8_nocompile_training,
            )

            convert_to_float8_nocompile_training(net, module_filter_fn=token_linear, config=config)
        else:
            convert_to_float8_training(net, module_filter_fn=token_linear, config=config)
    if "cdt" in lever:  # inductor tunes each generated kernel's launch configuration (the casts' included)
        import torch._inductor.config

        torch._inductor.config.coordinate_descent_tuning = True
    # The nocompile prototype runs eager, as its name says: its own Triton kernels do the fused cast and
    # transpose, and inductor compiling around them failed (InductorError in `_amax_atomic`, 2026-11-28).
    if mode in ("compile", "float8") and "nocompile" not in lever:
        for block in net.transformer_blocks:
            block.compile()
    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    sched.alphas_cumprod = sched.alphas_cumprod.to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=device.type == "cuda")
    params = list(net.parameters())
    ema = [p.detach().clone() for p in params]
    x0 = torch.rand(batch, 1, 32, 32, device=device) * 2 - 1
    labels = torch.randint(0, 10, (batch,), device=device)
    times = []
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        t0 = time.perf_counter()
        noise = torch.randn_like(x0)
        t = torch.randint(0, 1000, (batch,), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = net(sched.add_noise(x0, noise, t), timestep=t, class_labels=labels).sample
            loss = F.mse_loss(pred.float(), noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - 0.9999)
        loss.item()
        times.append(time.perf_counter() - t0)
    late = times[len(times) // 2 :]
    out = {"step_s": statistics.median(late), "params": sum(p.numel() for p in params)}
    if device.type == "cuda":
        out["gpu_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out


# In one process, one after another (coordinate-descent tuning last: inductor's setting is global): the
# hand-written DiT-XL/2 compiled per block in bf16, then float8 set up each way.
# float8-nocompile: torchao's float8nocompile prototype (fused cast + transpose kernels; pytorch/pytorch#130015
# is inductor's slow codegen for that pattern), run eager (the blocks not compiled), as the prototype is meant to.
LEVERS = ("bf16", "float8", "float8-nocompile", "float8-fast-accum", "float8-mlp", "float8-cdt", "bf16-cdt")


def lever_sweep(quick: bool, budget_s: float, out_dir: str, only: list[str] | None = None) -> dict:
    """What, set up by hand, makes float8 pay at DiT-XL/2: each lever's step time and its speedup over the bf16
    compiled loop measured in the same process (bf16 always runs first; `only` picks the others). A lever that
    fails is recorded with its error and the sweep goes on."""
    import gc

    import torch

    float8_cores = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    start, results = time.perf_counter(), {}
    for lever in LEVERS:
        if only and lever != "bf16" and lever not in only:
            continue
        if lever.startswith("float8") and not float8_cores:
            results[lever] = {"skipped": "no float8 tensor cores"}
        elif time.perf_counter() - start > budget_s:
            results[lever] = {"skipped": "over the time budget"}
        else:
            torch._dynamo.reset()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            mode = "float8" if lever.startswith("float8") else "compile"
            try:
                results[lever] = hand_loop("dit-xl", mode, quick, lever=lever, steps=0 if quick else 16)
            except Exception as e:  # a lever torch or torchao cannot run is a finding, not the end
                # the head says where, the tail says why (a Triton or inductor error ends with its cause)
                text = str(e)
                text = text if len(text) <= 1600 else f"{text[:600]} ... {text[-1000:]}"
                results[lever] = {"error": f"{type(e).__name__}: {text}"}
            results[lever]["wall_s"] = round(time.perf_counter() - t0, 1)
            gc.collect()
        print(json.dumps({lever: results[lever]}), flush=True)
    base = results["bf16"].get("step_s")  # none if bf16 itself failed: then no speedups, only the step times
    speedups = {k: round(base / r["step_s"], 3) for k, r in results.items() if base and k != "bf16" and "step_s" in r}
    with open(os.path.join(out_dir, "levers.json"), "w") as f:
        json.dump({"results": results, "speedup_over_bf16": speedups}, f, indent=1)
    return {"speedup_over_bf16": speedups}


# ---------------------------------------------------------------------------------------------- gentrain
_STEP = re.compile(r"step=(\d+)/\d+ (.*)")
_FIELD = re.compile(r"(\w+)=([\d.e+-]+)")


def gentrain_args(model: str, mode: str, quick: bool, run_dir: str) -> list[str]:
    layers, heads, dim, batch, steps = (QUICK if quick else MODELS)[model]
    dit = f"{{kind: dit, num_layers: {layers}, num_attention_heads: {heads}, attention_head_dim: {dim}, patch_size: 2}}"
    args = ["digits-ddpm", f"model.backbone={dit}", "model.num_classes=10", "data.image_size=32"]
    args += [f"train.batch_size={batch}", "train.precision=bf16", f"train.max_steps={steps}"]
    args += ["train.log_every_steps=5", "checkpoint.every_steps=0", "sample.every_steps=0", "sample.num=4"]
    args += ["sample.inference_steps=2", "train.val_every_steps=0", f"run.dir={run_dir}", "train.lr=1e-4"]
    args += ["train.num_workers=4"] if not quick else []
    if mode in ("compile", "float8", "float8-rowwise"):
        args.append("train.compile=true")
    if mode.startswith("float8"):
        args.append("train.float8=" + ("rowwise" if mode == "float8-rowwise" else "tensorwise"))
    return args


def gentrain_run(model: str, mode: str, quick: bool, out_dir: str) -> dict:
    batch, steps = (QUICK if quick else MODELS)[model][3:]
    with tempfile.TemporaryDirectory() as tmp:
        args = gentrain_args(model, mode, quick, f"{tmp}/run")
        r = subprocess.run([sys.executable, "-m", "trainer", "train", *args], capture_output=True, text=True)
    with open(os.path.join(out_dir, f"gt-{model}-{mode}.log"), "w") as f:
        f.write(r.stderr)
    rows = [
        (int(m.group(1)), dict((k, float(v)) for k, v in _FIELD.findall(m.group(2)))) for m in _STEP.finditer(r.stderr)
    ]
    late = [f for s, f in rows if s > steps // 2 and "samples_per_s" in f]
    result: dict = {"exit": r.returncode}
    if late:
        sps = statistics.median(f["samples_per_s"] for f in late)
        result |= {"step_s": batch / sps, "mfu": statistics.median(f.get("mfu", 0.0) for f in late)}
    mem = [f["gpu_mem_gb"] for _, f in rows if "gpu_mem_gb" in f]
    if mem:
        result["gpu_mem_gb"] = max(mem)
    flops = re.search(r"throughput: ([\d.e+]+) GFLOP per step", r.stderr)
    if flops:
        result["gflop_per_step"] = float(flops.group(1))
    peak = re.search(r"peak ([\d.]+) TFLOP/s \(([^)]*)\)", r.stderr)
    if peak:
        result["peak_tflops"], result["card"] = float(peak.group(1)), peak.group(2)
    params = re.search(r"params=([\d.]+)M", r.stderr)
    if params:
        result["params"] = float(params.group(1)) * 1e6
    if r.returncode != 0:
        result["stderr_tail"] = r.stderr[-1500:]
    return result


# ---------------------------------------------------------------------------------------------- profile
class StepProfiler:
    """`on_step(i)` at the start of each step: profiles steps [warm, warm + n) (CPU and CUDA activities), the
    device synchronized at both ends so the wall time covers exactly those steps' work."""

    def __init__(self, warm: int, n: int):
        self.warm, self.n = warm, n
        self.prof = None
        self.t0 = 0.0
        self.result: dict | None = None

    def on_step(self, i: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if i == self.warm:
            self._sync()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif i == self.warm + self.n and self.prof is not None:
            self._sync()
            wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            self.result = self._summary(wall)

    @staticmethod
    def _sync() -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _summary(self, wall: float) -> dict:
        from torch.autograd import DeviceType

        averages = self.prof.key_averages()
        # Kernels, copies and memsets; not the GPU-side spans of annotations (the optimizer's step range).
        cuda = [
            e
            for e in averages
            if e.device_type == DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)
            and not e.key.startswith(("Optimizer.", "ProfilerStep"))
        ]
        # On a CPU there are no kernels: the operators' own (self) times stand in for them.
        rows = cuda or [e for e in averages if e.device_type == DeviceType.CPU and e.key.startswith("aten::")]
        own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        kernels = {e.key[:120]: [own(e) / 1e3 / self.n, e.count / self.n] for e in rows}
        total = sum(v[0] for v in kernels.values())
        by_kind = {"gemm": 0.0, "attention": 0.0, "cast": 0.0, "other": 0.0}
        for name, (ms, _) in kernels.items():
            by_kind[kernel_kind(name)] += ms
        return {
            "device": "cuda" if cuda else "cpu",
            "wall_ms_per_step": wall * 1e3 / self.n,
            "kernel_ms_per_step": total,
            "launches_per_step": sum(v[1] for v in kernels.values()),
            # The matmuls' share of the device's time: what float8 can shorten (bench/float8_roofline.py's
            # share_needed says how large it must be for a given speedup).
            **{f"{kind}_ms_per_step": ms for kind, ms in by_kind.items()},
            "gemm_share": by_kind["gemm"] / total if total else 0.0,
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1][0])),
        }


_ATTENTION = ("flash", "fmha", "attention", "sdpa", "scaled_dot_product")
# cuBLAS (xmma, nvjet, and its split-K reductions), CUTLASS, inductor's matmul templates (triton_tem_), torch's
# float8 GEMM; on a CPU the matrix products' aten operators.
_GEMM = ("gemm", "nvjet", "splitk", "cutlass", "xmma", "triton_tem_", "scaled_mm")
_GEMM += ("aten::mm", "aten::addmm", "aten::bmm")


def kernel_kind(name: str) -> str:
    """gemm, attention, cast or other, by the kernel's (or, on a CPU, the operator's) name. `cast`: inductor's
    generated kernels (triton_poi/red/per) that make float8 operands, by what the fusion's name says they
    compute (an amax, `abs` + `max`; a scale, `reciprocal`; anything feeding `_scaled_mm`). They
    carry the layer norm, GELU or residual add fused into them too, work a bf16 step does in kernels of its own."""
    lower = name.lower()
    if any(s in lower for s in _ATTENTION):  # first: flash attention kernels are CUTLASS kernels too
        return "attention"
    if lower.startswith(("triton_poi_", "triton_red_", "triton_per_")):  # before gemm: `_scaled_mm` in a name
        scaled = "_scaled_mm" in lower or ("abs" in lower and "max" in lower) or "reciprocal" in lower
        return "cast" if scaled else "other"
    return "gemm" if any(s in lower for s in _GEMM) else "other"


def profile_child(runner: str, model: str, mode: str, quick: bool) -> dict:
    """One runner's profile (run in a process of its own)."""
    steps = (QUICK if quick else MODELS)[model][4]
    profiler = StepProfiler(warm=steps // 2, n=max(2, min(10, steps // 4)))
    if runner == "hand":
        hand_loop(model, mode, quick, on_step=profiler.on_step)
    else:
        # Here only: the hand-written side of this file never imports gentrain.
        from trainer.cli import main as gentrain_main
        from trainer.engine.step import StepRunner

        run, calls = StepRunner.run, [0]

        def profiled_run(self, batch, step):  # every optimizer step goes through StepRunner.run once
            profiler.on_step(calls[0])
            calls[0] += 1
            return run(self, batch, step)

        StepRunner.run = profiled_run
        with tempfile.TemporaryDirectory() as tmp:
            code = gentrain_main(["train", *gentrain_args(model, mode, quick, f"{tmp}/run")])
        if code != 0:
            return {"exit": code}
    return profiler.result or {"error": "the run ended before the profiled steps"}


def profile_pair(name: str, quick: bool, out_dir: str) -> dict:
    """Profile the hand-written loop and gentrain at `name` (model-mode); print where gentrain spends more."""
    model, mode = name.rsplit("-", 1)
    found = {}
    for runner in ("hand", "gt"):
        cmd = [sys.executable, __file__, "--profile-child", runner, model, mode] + (["--quick"] if quick else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        with open(os.path.join(out_dir, f"profile-{runner}-{name}.log"), "w") as f:
            f.write(r.stdout + r.stderr)
        lines = [x for x in r.stdout.strip().splitlines() if x.startswith("{")]
        found[runner] = json.loads(lines[-1]) if r.returncode == 0 and lines else {"exit": r.returncode}
    hand, gt = found["hand"], found["gt"]
    report: dict = {"profile": name}
    for runner, res in found.items():
        report[runner] = {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items() if k != "kernels"}
    if "kernels" in hand and "kernels" in gt:
        names = set(hand["kernels"]) | set(gt["kernels"])
        excess = {
            k: [
                round(gt["kernels"].get(k, [0, 0])[0] - hand["kernels"].get(k, [0, 0])[0], 3),
                gt["kernels"].get(k, [0, 0])[1],
                hand["kernels"].get(k, [0, 0])[1],
            ]
            for k in names
        }  # name: [gentrain - hand ms/step, gentrain launches/step, hand launches/step]
        report["excess_ms_per_step"] = dict(sorted(excess.items(), key=lambda kv: -abs(kv[1][0]))[:20])
        for side in ("hand", "gt"):
            report[side]["idle_ms_per_step"] = round(
                found[side]["wall_ms_per_step"] - found[side]["kernel_ms_per_step"], 3
            )
    with open(os.path.join(out_dir, f"profile-{name}.json"), "w") as f:
        json.dump({"report": report, "hand": hand, "gt": gt}, f, indent=1)
    print(json.dumps(report), flush=True)
    return report


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--only",
        nargs="+",
        help="model names, model-mode pairs or runner:model-mode, e.g. dit-s dit-xl-compile hand:dit-xl-compile",
    )
    p.add_argument(
        "--profile", nargs="+", metavar="MODEL-MODE", help="profile hand and gentrain at these, e.g. dit-s-eager"
    )
    p.add_argument("--profile-child", nargs=3, metavar=("RUNNER", "MODEL", "MODE"), help=argparse.SUPPRESS)
    p.add_argument(
        "--levers",
        nargs="*",
        metavar="LEVER",
        help=f"DiT-XL/2 by hand: bf16 and float8 set up each way, one process (all, or some of {LEVERS[1:]})",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(hand_loop(*args.child, quick=args.quick)))
        return
    if args.profile_child:
        print(json.dumps(profile_child(*args.profile_child, quick=args.quick)), flush=True)
        return
    if args.levers is not None:
        unknown = set(args.levers) - set(LEVERS)
        if unknown:
            p.error(f"unknown levers {sorted(unknown)}; known: {', '.join(LEVERS)}")
        print(json.dumps(lever_sweep(args.quick, args.budget_s, args.out, args.levers)), flush=True)
        return
    if args.profile and not args.only:
        for name in args.profile:
            profile_pair(name, args.quick, args.out)
        return
    start = time.perf_counter()
    results: dict[str, dict] = {}
    for model, mode, runner in VARIANTS:
        key = f"{runner}:{model}-{mode}"
        if args.only and not {model, f"{model}-{mode}", key} & set(args.only):
            continue
        if time.perf_counter() - start > args.budget_s:
            results[key] = {"skipped": "over the time budget"}
            continue
        t0 = time.perf_counter()
        if runner == "hand":
            cmd = [sys.executable, __file__, "--child", model, mode] + (["--quick"] if args.quick else [])
            r = subprocess.run(cmd, capture_output=True, text=True)
            lines = r.stdout.strip().splitlines()
            results[key] = (
                json.loads(lines[-1])
                if r.returncode == 0 and lines
                else {"exit": r.returncode, "stderr_tail": r.stderr[-1500:]}
            )
        else:
            results[key] = gentrain_run(model, mode, args.quick, args.out)
        results[key]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({key: results[key]}), flush=True)
    ratios = ratios_of(results)
    print(json.dumps({"ratios": ratios, "total_s": round(time.perf_counter() - start, 1)}), flush=True)
    with open(os.path.join(args.out, "gpu.json"), "w") as f:
        json.dump({"results": results, "ratios": ratios}, f, indent=1)
    # --only with --profile: the profiles after the comparison, in one call, while the budget lasts
    for name in args.profile or []:
        if time.perf_counter() - start > args.budget_s:
            print(json.dumps({"profile": name, "skipped": "over the time budget"}), flush=True)
            continue
        profile_pair(name, args.quick, args.out)


def ratios_of(results: dict[str, dict]) -> dict[str, dict]:
    """hand / gentrain step time (and memory, MFU) per gentrain variant measured with its baseline: float8
    variants against the hand-written bf16 compiled loop, and against the hand-written float8 loop when that
    ran too, which also gives float8's own gain written by hand (`hand:...-float8-vs-hand:...-compile`)."""
    ratios = {}
    for model, mode, runner in VARIANTS:
        if runner != "gt":
            continue
        gt = results.get(f"gt:{model}-{mode}", {})
        hand = results.get(f"hand:{model}-{'compile' if mode.startswith('float8') else mode}", {})
        if "step_s" in gt and "step_s" in hand:
            entry = {"hand_over_gentrain_speed": round(hand["step_s"] / gt["step_s"], 3)}
            if "gpu_mem_gb" in gt and "gpu_mem_gb" in hand:
                entry["gentrain_over_hand_memory"] = round(gt["gpu_mem_gb"] / hand["gpu_mem_gb"], 3)
            if "gflop_per_step" in gt and "peak_tflops" in gt:
                entry["hand_mfu"] = round(gt["gflop_per_step"] * 1e9 / hand["step_s"] / (gt["peak_tflops"] * 1e12), 4)
                entry["gentrain_mfu"] = round(gt["gflop_per_step"] * 1e9 / gt["step_s"] / (gt["peak_tflops"] * 1e12), 4)
            ratios[f"{model}-{mode}"] = entry
        by_hand = results.get(f"hand:{model}-{mode}", {})
        if mode.startswith("float8") and "step_s" in gt and "step_s" in by_hand:
            ratios[f"{model}-{mode}-vs-hand-{mode}"] = {
                "hand_over_gentrain_speed": round(by_hand["step_s"] / gt["step_s"], 3)
            }
        if mode.startswith("float8") and "step_s" in by_hand and "step_s" in hand:
            ratios[f"hand:{model}-{mode}-vs-hand:{model}-compile"] = {
                "speedup": round(hand["step_s"] / by_hand["step_s"], 3)
            }
    return ratios


if __name__ == "__main__":
    main()
