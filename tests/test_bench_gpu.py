"""bench/gpu.py in its --quick mode (tiny shapes, CPU): the comparison and the profile print the JSON the docs
quote. No assertion on speed (the figures mean something only on a GPU, at full size)."""

from __future__ import annotations

import json
import math
import sys

import pytest
from conftest import REPO, run_bench

pytestmark = pytest.mark.slow


def _lines(stdout: str) -> list[dict]:
    return [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]


def test_the_comparison_runs_both_loops_and_prints_their_ratio(tmp_path):
    r = run_bench("gpu.py", "--quick", "--only", "hand:dit-s-eager", "gt:dit-s-eager", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    *rows, summary = _lines(r.stdout)
    assert [next(iter(row)) for row in rows] == ["hand:dit-s-eager", "gt:dit-s-eager"]  # --only's runner:model-mode
    ratio = summary["ratios"]["dit-s-eager"]["hand_over_gentrain_speed"]
    assert math.isfinite(ratio) and ratio > 0
    assert json.loads((tmp_path / "gpu.json").read_text())["ratios"] == summary["ratios"]


def test_the_profile_compares_the_two_steps_operator_by_operator(tmp_path):
    # with --only, one call runs the comparison first and the profile after it
    only = ("--only", "hand:dit-s-eager")
    r = run_bench("gpu.py", "--quick", *only, "--profile", "dit-s-eager", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    hand, summary, report = _lines(r.stdout)
    assert list(hand) == ["hand:dit-s-eager"] and summary["ratios"] == {} and report["profile"] == "dit-s-eager"
    for side in ("hand", "gt"):
        s = report[side]
        assert s["device"] == "cpu" and s["wall_ms_per_step"] > 0 and 0 < s["kernel_ms_per_step"]
        assert s["launches_per_step"] > 0 and "idle_ms_per_step" in s
        # The split adds up to the whole; a DiT's step spends part of it in matrix products, never all.
        parts = s["gemm_ms_per_step"] + s["attention_ms_per_step"] + s["cast_ms_per_step"] + s["other_ms_per_step"]
        assert s["cast_ms_per_step"] == 0  # no float8 here
        assert parts == pytest.approx(s["kernel_ms_per_step"], rel=1e-3, abs=2e-3)
        assert 0 < s["gemm_share"] < 1 and s["gemm_ms_per_step"] > 0
    # The same model and optimizer: their matmuls appear on both sides, once per step each as often.
    excess = report["excess_ms_per_step"]
    assert excess and all(len(v) == 3 for v in excess.values())
    full = json.loads((tmp_path / "profile-dit-s-eager.json").read_text())
    assert full["hand"]["kernels"]["aten::mm"][1] == full["gt"]["kernels"]["aten::mm"][1] > 0


def test_float8_is_compared_with_both_hand_written_loops():
    sys.path.insert(0, str(REPO / "bench"))
    from gpu import ratios_of

    results = {"hand:dit-xl-compile": {"step_s": 0.22}, "gt:dit-xl-float8": {"step_s": 0.2}}
    assert ratios_of(results) == {"dit-xl-float8": {"hand_over_gentrain_speed": 1.1}}
    results["hand:dit-xl-float8"] = {"step_s": 0.176}
    assert ratios_of(results) == {
        "dit-xl-float8": {"hand_over_gentrain_speed": 1.1},  # gentrain float8 against hand-written bf16
        "dit-xl-float8-vs-hand-float8": {"hand_over_gentrain_speed": 0.88},  # ... and hand-written float8
        "hand:dit-xl-float8-vs-hand:dit-xl-compile": {"speedup": 1.25},  # float8's own gain, by hand
    }


def test_kernels_are_told_apart_by_name():
    sys.path.insert(0, str(REPO / "bench"))
    from gpu import kernel_kind

    # cuBLAS and CUTLASS names as torch.profiler reports them on a Hopper card; CPU operators.
    for name in (
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64",
        "nvjet_tst_128x256_64x4_2x1_v_bz_TNT",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>",
    ):
        assert kernel_kind(name) == "gemm", name
    assert kernel_kind("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90>>") == (
        "attention"
    )
    assert kernel_kind("aten::addmm") == kernel_kind("aten::mm") == "gemm"
    assert kernel_kind("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert kernel_kind("triton_poi_fused_add_mul_0") == kernel_kind("aten::native_layer_norm") == "other"
    # float8 on a Hopper card (bench/results/gpu-h200-2026-11-28-float8.json): the GEMMs are cuBLAS's (qq: e4m3 x
    # e4m3, qr: e4m3 x e5m2); inductor's casts carry `_scaled_mm` in their fused names and are no GEMM.
    assert kernel_kind("nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN") == "gemm"
    assert kernel_kind("nvjet_sm90_qrtst_144x128_128x6_1x2_h_bz_coopA_algo2_TNN") == "gemm"
    for name in (
        "triton_poi_fused__scaled_mm__to_copy_add_clamp_gelu_mul_reciprocal_t_view_26",  # scaled cast (+ transpose)
        "triton_red_fused__to_copy_abs_add_gelu_max_view_24",  # the amax, GELU fused in
        "triton_red_fused_abs_max_transpose_view_26",
    ):
        assert kernel_kind(name) == "cast", name
    assert kernel_kind("triton_red_fused__to_copy_add_mul_native_layer_norm_split_unsqueeze_10") == "other"


def test_the_lever_sweep_measures_bf16_first_and_says_why_a_lever_did_not_run(tmp_path):
    r = run_bench("gpu.py", "--quick", "--levers", "float8-nocompile", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    bf16, nocompile, summary = _lines(r.stdout)
    assert bf16["bf16"]["step_s"] > 0  # the baseline, in the same process
    assert nocompile == {"float8-nocompile": {"skipped": "no float8 tensor cores"}}  # a CPU has none
    assert summary == {"speedup_over_bf16": {}}
    assert json.loads((tmp_path / "levers.json").read_text())["results"]["bf16"] == bf16["bf16"]
    r = run_bench("gpu.py", "--levers", "float9")
    assert r.returncode == 2 and "unknown levers ['float9']" in r.stderr


def test_torchaos_float8nocompile_prototype_is_where_the_lever_imports_it():
    """The `float8-nocompile` lever imports a torchao prototype (it needs Triton, so not on this CPU): fail
    here, by name, when an upgrade moves or renames it."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("torchao.prototype.float8nocompile.float8nocompile_linear_utils")
    assert spec is not None, "torchao no longer ships float8nocompile: drop the bench's float8-nocompile lever"
    tree = ast.parse(open(spec.origin).read())
    fn = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "convert_to_float8_nocompile_training"
    )
    assert {"config", "module_filter_fn"} <= {a.arg for a in fn.args.kwonlyargs}


# ---------------------------------------------------------------------------------------------- float8 roofline


def test_the_float8_roofline_prints_each_cards_ceiling_for_the_converted_linears():
    """--quick: gentrain's tiny DiT (bench/gpu.py's quick shapes: 2 blocks of width 32, batch 16, 16x16 tokens),
    every eligible layer (--unsized; the size thresholds keep none this narrow). Checked: the layers are the
    ones float8 converts (6 a block, every one multiplying batch x tokens rows),
    each figure is the roofline's arithmetic on the times it prints, and the step estimate obeys Amdahl."""
    r = run_bench("float8_roofline.py", "--quick", "--unsized", "--step-s", "0.01", "--heads", "2", "4")
    assert r.returncode == 0, r.stderr[-3000:]
    head, *rows, summary = _lines(r.stdout)
    assert head["linears"] == {"tensorwise": 12, "rowwise": 12} and head["batch"] == 16
    shapes = {(16 * 256, 32, 32), (16 * 256, 32, 128), (16 * 256, 128, 32)}
    assert {tuple(s) for s in head["shapes"]["tensorwise"]} == shapes
    assert len(rows) == 3 * 2 * 2  # cards x recipes x fused
    for row in rows:
        fp8 = row["fp8_gemm_ms"] + row["fp8_casts_ms"]
        assert row["linear_speedup"] == pytest.approx(row["bf16_ms"] / fp8, rel=1e-3)
        if row["card"] == head["measured_on"]:
            rest = 10.0 - row["bf16_ms"]
            assert row["step_speedup"] == pytest.approx(10.0 / (rest + fp8), rel=1e-3)
        else:
            assert "step_speedup" not in row
    for card, recipe in {(row["card"], row["recipe"]) for row in rows}:
        plain, fused = (r for r in rows if (r["card"], r["recipe"]) == (card, recipe))
        assert fused["fp8_casts_ms"] <= plain["fp8_casts_ms"] and fused["bf16_ms"] == plain["bf16_ms"]
    on_card = [row for row in rows if row["card"] == head["measured_on"]]
    assert summary["best_step_speedup"] == max(row["step_speedup"] for row in on_card)
    assert set(summary["linear_speedup_by_width"]) == {"32", "64"}
    # Without --unsized, gentrain's own choice: nothing this narrow is above torchao's size thresholds.
    r = run_bench("float8_roofline.py", "--quick", "--step-s", "0.01", "--heads")
    assert r.returncode == 0, r.stderr[-3000:]
    head, summary = _lines(r.stdout)
    assert head["linears"] == {"tensorwise": 0, "rowwise": 0} and summary["best_step_speedup"] is None


def test_the_float8_roofline_follows_the_model_it_names():
    """On a compute-bound shape the model is plain arithmetic: three GEMMs at 78% of 989 (bf16) or 1,979
    (float8) TFLOP/s, and tensorwise casts that read and write each operand a fixed number of bytes per
    element at 92% of the card's bandwidth (4.8 TB/s on the H200 this bench adds). A torchao whose model
    changed fails here, and the docs' figures with it."""
    sys.path.insert(0, str(REPO / "bench"))
    from float8_roofline import model_times, roofline, share_needed

    ru = roofline()
    m, k, n = 32768, 4096, 4096
    t = model_times(ru, {"x": (m, k, n)}, "NVIDIA H200", "tensorwise", fused=False)
    assert t["bf16_s"] == pytest.approx(3 * 2 * m * k * n / (989e12 * 0.78), rel=1e-9)
    assert t["fp8_gemm_s"] == pytest.approx(3 * 2 * m * k * n / (1979e12 * 0.78), rel=1e-9)
    # input and output gradient: an amax pass (2 bytes read) and a cast to two float8 layouts (2 + 2 x 1);
    # the weight: the amax pass and two casts (2 + 1 each); and per operand the amax's second stage, whose
    # traffic the model leaves out, at one kernel launch (2 us).
    casts_bytes = 6 * m * k + 6 * m * n + 8 * k * n
    assert t["fp8_casts_s"] == pytest.approx(casts_bytes / (4.8e12 * 0.92) + 3 * 2e-6, rel=1e-9)
    assert share_needed(1.3, 1.3) is None and share_needed(1.3, 1.1) is None
    s = share_needed(1.3, 2.0)
    assert 1 / (1 - s + s / 2.0) == pytest.approx(1.3)
