"""benchmarks/profile_train.py's idle summary and mode comparison, on hand-made device intervals (no GPU needed)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from profile_train import compare_categories, compare_modes, idle_summary, kernel_category, kernel_totals  # noqa: E402


def test_idle_summary_merges_overlaps_and_groups_gaps():
    intervals = [
        (0.0, 10.0, "a"),
        (5.0, 12.0, "b"),      # overlaps a (another stream): busy 0-12
        (14.0, 20.0, "c"),     # gap 2 us
        (15.0, 16.0, "d"),     # inside c: no gap, c stays the last to end
        (30.0, 40.0, "e"),     # gap 10 us after c
        (540.0, 541.0, "f"),   # gap 500 us after e
    ]
    text = idle_summary(intervals, top=2)
    lines = text.splitlines()
    assert lines[0] == ("device activity over 0.5 ms: busy 0.0 ms, idle 0.5 ms in 3 gaps "
                        "(6 kernels, memsets and copies)")
    assert "0-3 us:      1,    0.00 ms" in lines[1]
    assert "3-20 us:      1,    0.01 ms" in lines[2]
    assert "20-200 us:      0,    0.00 ms" in lines[3]
    assert ">= 200 us:      1,    0.50 ms" in lines[4]
    assert "after e  before f" in lines[6] and "500.0 us" in lines[6]
    assert "after c  before e" in lines[7] and "10.0 us" in lines[7]
    assert len(lines) == 8


def test_idle_summary_busy_is_the_union():
    text = idle_summary([(0.0, 1000.0, "x"), (100.0, 200.0, "y"), (1500.0, 2000.0, "z")])
    assert text.startswith("device activity over 2.0 ms: busy 1.5 ms, idle 0.5 ms in 1 gaps")
    assert "after x  before z" in text


def test_idle_summary_without_activity():
    assert idle_summary([]) == "idle: no device activity recorded"


def test_kernel_totals_per_step():
    totals = kernel_totals([(0.0, 10.0, "a"), (20.0, 50.0, "a"), (60.0, 64.0, "b")], steps=2)
    assert totals == {"a": (1.0, 0.02), "b": (0.5, 0.002)}


def test_compare_modes_orders_by_difference_and_sums():
    totals = {
        "o2": {"gemm": (10.0, 5.0), "amax": (4.0, 1.0)},
        "o2-fp8act": {"gemm": (10.0, 5.1), "amax": (8.0, 3.0), "quantize": (2.0, 0.5)},
    }
    lines = compare_modes(totals, top=2).splitlines()
    assert lines[0] == "### per kernel, a step: each mode against o2 (the 2 largest differences)"
    assert lines[2] == "| kernel | o2 calls | o2 ms | o2-fp8act calls | o2-fp8act ms | o2-fp8act - o2 ms |"
    assert lines[3].count("|---") == 6
    assert lines[4] == "| amax | 4 | 1.00 | 8 | 3.00 | +2.00 |"
    assert lines[5] == "| quantize | 0 | 0.00 | 2 | 0.50 | +0.50 |"
    assert lines[6] == "| all | 14 | 6.00 | 20 | 8.60 | +2.60 |"
    assert len(lines) == 7


def test_kernel_categories_and_their_table():
    names = {
        "void fp8amp::cuda::(anonymous namespace)::cast_transpose_kernel<bf16>": "fp8amp",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16": "attention",
        "nvjet_sm90_qqtst_192x192_128x4_2x1_v_bz_coopB_TNN": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "inductor",
        "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>": "optimizer",
        "Memset (Device)": "other",
    }
    for name, category in names.items():
        assert kernel_category(name) == category, name
    lines = compare_categories({"bf16": {"nvjet_a": (2.0, 3.0), "Memset (Device)": (1.0, 0.25)},
                                "o2": {"fp8amp::cast": (4.0, 1.5), "nvjet_b": (2.0, 2.0)}}).splitlines()
    assert lines[0] == "| kernels | bf16 ms | o2 ms |"
    assert "| fp8amp | 0.00 | 1.50 |" in lines and "| gemm | 3.00 | 2.00 |" in lines
    assert "| other | 0.25 | 0.00 |" in lines and lines[-1] == "| all | 3.25 | 3.50 |"


def test_bench_models_profile_needs_a_gpu():
    import pytest
    from bench_models import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--profile", "2"])
    assert parse_args(["--profile", "3"]).profile == 3


def test_bench_models_profile_section_from_kernel_totals():
    from bench_models import profile_section

    profiles = {"BF16 autocast + compile": ({"nvjet_a": (2.0, 3.0), "triton_b": (1.0, 1.0)}, "idle: a"),
                "fp8amp O2 + compile": ({"nvjet_c": (2.0, 1.5), "fp8amp::cast": (3.0, 0.5)}, "idle: b")}
    text = profile_section(profiles)
    assert "| kernels | BF16 autocast + compile ms | fp8amp O2 + compile ms |" in text
    assert "| gemm | 3.00 | 1.50 |" in text and "| all | 4.00 | 2.00 |" in text
    assert "BF16 autocast + compile: idle: a" in text and "fp8amp O2 + compile: idle: b" in text
    assert "### per kernel, a step: each mode against BF16 autocast + compile" in text
