"""benchmarks/profile_train.py's idle summary and mode comparison, on hand-made device intervals (no GPU needed)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from profile_train import compare_modes, idle_summary, kernel_totals  # noqa: E402


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
