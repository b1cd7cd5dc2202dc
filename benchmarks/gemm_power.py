"""The SM clock and power while the 8192^3 FP8 GEMM runs back to back: is 1.5 PFLOP/s reachable?

Not a benchmark (gpu_check.sh runs only bench_*.py): the diagnostic behind docs/benchmarks.md's
"Why 1.5 PFLOP/s at 8192^3 is out of reach on this H200". It runs fp8amp's E4M3 GEMM (fast
accumulation, random data) for 6 seconds while nvidia-smi samples the SM clock, the power and the
clock-event reasons every 100 ms, and prints the achieved TFLOP/s against the dense FP8 peak
scaled to the sustained clock (1979 TFLOP/s at the 1980 MHz boost clock of an H100/H200).

Usage: python benchmarks/gemm_power.py
"""

import statistics
import subprocess
import time

import torch

import fp8amp
from _common import require_gpu

N = 8192
PEAK_TFLOPS, PEAK_MHZ = 1979.0, 1980.0  # dense FP8 at the boost clock


def main() -> None:
    require_gpu("gemm_power", min_capability=(8, 9))
    e4m3 = torch.float8_e4m3fn
    x = (torch.randn(N, N, device="cuda") * 0.5).to(e4m3)
    w = (torch.randn(N, N, device="cuda") * 0.5).to(e4m3)
    one = torch.ones(1, device="cuda")

    def gemm():
        return fp8amp.ops.fast.gemm(x, w, one, one, torch.bfloat16, fast_accum=True)

    for _ in range(50):
        gemm()
    torch.cuda.synchronize()
    query = "clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active"
    smi = subprocess.Popen(["nvidia-smi", "-i", str(torch.cuda.current_device()), f"--query-gpu={query}",
                            "--format=csv,noheader,nounits", "-lms", "100"], stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters, t0 = 0, time.perf_counter()
    start.record()
    while time.perf_counter() - t0 < 6.0:
        for _ in range(20):
            gemm()
        iters += 20
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    rows = [line.split(", ") for line in smi.communicate()[0].strip().splitlines()[5:]]  # skip the ramp
    tflops = 2 * N**3 / (start.elapsed_time(end) / 1e3 / iters) / 1e12
    clock, power = [float(r[0]) for r in rows], [float(r[2]) for r in rows]
    peak = PEAK_TFLOPS * statistics.median(clock) / PEAK_MHZ
    print(f"{N}^3 fast-accum FP8 GEMM back to back on {torch.cuda.get_device_name()}: {tflops:.0f} TFLOP/s "
          f"over {iters} GEMMs")
    print(f"SM clock median {statistics.median(clock):.0f} MHz (min {min(clock):.0f}, max {max(clock):.0f}; "
          f"max clock {rows[0][1]} MHz), power median {statistics.median(power):.0f} W of limit {rows[0][3]} W; "
          f"clock-event reasons seen: {sorted(set(r[4] for r in rows))}")
    print(f"dense FP8 peak at the sustained clock: {peak:.0f} TFLOP/s; achieved {tflops / peak:.0%} of it")


if __name__ == "__main__":
    main()
