"""benchmarks/optim_host_time.py's CPU smoke run (FP8 emulated: it checks that the program runs and
fills its table, not the times), so that a change that breaks the H200 run fails here first."""

import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "optim_host_time.py")


def test_optim_host_time_smoke_run_fills_its_table(tmp_path):
    run = subprocess.run([sys.executable, BENCH, "--repeats", "1", "--profile", "1"],
                         env=dict(os.environ, OUT=str(tmp_path)), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    text = (tmp_path / "bench_optim_host_time.md").read_text()
    assert text.strip() in run.stdout
    profiles, timing = text.rsplit("Host time on", 1)
    assert profiles.count("| host event | calls a step | self µs a step | total µs a step |") == 4
    assert profiles.count("| fp8amp::AdamPlan.step | 1 |") == 2  # the kept fused call, once a step, in both O2
    rows = [line.strip(" |").split(" | ") for line in timing.splitlines() if line.startswith("| ")][1:]
    assert [row[0] for row in rows] == ["torch AdamW(fused)", "O2, Linears kept in BF16 compute",
                                        "O2, every Linear in FP8", "torch AdamW(fused), again"]
    assert all(row[2] == row[3] == row[4] == "–" for row in (rows[0], rows[3]))
    assert all(len(row) == 7 for row in rows)
    # (times only: how they compare is the benchmark's result, not a property a smoke run can hold
    # on a loaded machine)
    assert all(float(value) > 0 for row in rows for value in row[1:] if value != "–")
