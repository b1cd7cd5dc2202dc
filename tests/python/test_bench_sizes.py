"""benchmarks/bench_sizes.py's CPU smoke run (FP8 emulated: it checks that the benchmark runs and
fills its tables, not the speeds), so that a change that breaks the H200 run fails here first."""

import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_sizes.py")


def test_bench_sizes_smoke_run_fills_its_tables(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    run = subprocess.run(
        [sys.executable, BENCH, "--device", "cpu", "--sizes", "64", "--tokens", "256", "--steps", "2", "--warmup", "2",
         "--modes", "bf16,fp8,o1,o2,default"],
        env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    text = (tmp_path / "bench_sizes.md").read_text()
    assert text.strip() in run.stdout
    step_table, speed_table, memory_table = (part for part in text.split("\n\n") if part.startswith("| d |"))
    assert step_table.splitlines()[0] == "| d | layers | tokens | bf16 | fp8 | O1 | O2 | O2 default policy |"
    row = step_table.splitlines()[2].split(" | ")
    assert row[:3] == ["| 64", "2", "256"] and all(float(ms) > 0 for ms in row[3:7])
    speeds = speed_table.splitlines()[2].strip(" |").split(" | ")[3:]
    assert len(speeds) == 4 and all(s.endswith("x") and float(s[:-1]) > 0 for s in speeds)
    assert memory_table.splitlines()[2].count("–") == 4  # no peak memory on a CPU
    assert "8 of 8 Linears in FP8" in text and "error" not in text


def test_bench_sizes_interleaved_rounds_time_every_mode_each_round(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    run = subprocess.run(
        [sys.executable, BENCH, "--device", "cpu", "--sizes", "64", "--tokens", "256", "--steps", "2", "--warmup", "2",
         "--rounds", "3", "--phases", "--modes", "bf16,bf16-again,o2-optim,default"],
        env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    text = (tmp_path / "bench_sizes.md").read_text()
    assert "2 timed steps in each of 3 rounds, the modes interleaved" in text
    step_table = next(part for part in text.split("\n\n") if part.startswith("| d |"))
    row = step_table.splitlines()[2].split(" | ")
    assert row[:3] == ["| 64", "2", "256"] and all(float(ms.strip(" |")) > 0 for ms in row[3:7])
    speed_table = [part for part in text.split("\n\n") if part.startswith("| d |")][1]
    assert speed_table.splitlines()[0] == ("| d | layers | tokens | bf16, a second model | BF16, fp8amp's O2 AdamW | "
                                             "O2 default policy |")
    assert "error" not in text and "not run" not in text
    phase_table = [part for part in text.split("\n\n") if part.startswith("| d |")][3]
    assert phase_table.splitlines()[0].startswith("| d | tokens | mode | forward: host | forward: GPU | backward + clip: host")
    rows = [row.strip(" |").split(" | ") for row in phase_table.splitlines()[2:]]
    assert [row[2] for row in rows] == ["bf16", "bf16, a second model", "BF16, fp8amp's O2 AdamW", "O2 default policy"]
    for row in rows:  # four phases, host then GPU (none on a CPU)
        assert all(float(host) > 0 for host in row[3::2]) and row[4::2] == ["–"] * 4
