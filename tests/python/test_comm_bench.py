"""benchmarks/bench_comm.py stays runnable: a CPU smoke run (2 gloo processes, one small bucket,
one timed call) prints every row of its table, FP8 all-reduce and reduce-scatter included, with
FP8's bytes on the wire half of BF16's and accuracy figures in the FP8 range."""

import os
import subprocess
import sys
from pathlib import Path

import fp8amp

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_comm.py"


def test_bench_comm_cpu_smoke_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(Path(fp8amp.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--backend", "gloo", "--sizes", "4096", "--iters",
                    "1"], check=True, env=env, capture_output=True, timeout=600)
    rows = {}
    for line in (tmp_path / "bench_comm.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] == "4,096":
            rows[cells[1]] = cells
    assert set(rows) == {"bf16 all_reduce", "fp32 all_reduce", "bf16 compress", "fp8 all_to_all", "fp8 native",
                         "uint8 a2a + all_gather (comm only)", "fp8 native all_reduce (comm only)",
                         "bf16 reduce_scatter", "fp32 reduce_scatter", "fp8 reduce_scatter",
                         "uint8 all_to_all (comm only)"}
    assert rows["fp8 native"][3].startswith("n/a")  # gloo cannot reduce float8
    for fp8, bf16 in (("fp8 all_to_all", "bf16 all_reduce"), ("fp8 reduce_scatter", "bf16 reduce_scatter")):
        assert float(rows[fp8][2]) <= 0.51 * float(rows[bf16][2]), fp8
        assert 1e-3 < float(rows[fp8][5]) < 6e-2, fp8  # relative RMS error: one or two E4M3 roundings
