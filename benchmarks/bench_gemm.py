"""FP8 GEMM on the GPU against PyTorch, side by side in one run (DESIGN §8, §9).

For each shape (M tokens x K in -> N out, i.e. y[M, N] = x[M, K] · W[N, K]ᵀ) it times

    fp8amp:       torch.ops.fp8amp.gemm(x8, w8, sx, sw, bfloat16, fast_accum=...)   (cuBLASLt)
    _scaled_mm:   torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=bfloat16,
                                   use_fast_accum=...)                                (the same FP8
                                   operands and flag)
    bf16:         x @ w.t() in bfloat16 (torch.matmul; independent of the flag)

with fast accumulation off and on, E4M3 x E4M3 operands and a bfloat16 output, as a Linear's
forward has them. Times are medians over many samples, each sample a batch of back-to-back calls
bracketed by CUDA events (so launch overhead hides behind the GPU where it can, as in a training
step); operand sets rotate so that small shapes do not run from L2. TFLOP/s counts 2·M·N·K; the
floor is that over the H200's dense FP8 peak (1979 TFLOP/s). "vs _scaled_mm" is its time over
ours (> 1: we are faster); "diff" is ‖ours − _scaled_mm‖ / ‖_scaled_mm‖, a check that both
computed the same product.

Usage: python benchmarks/bench_gemm.py [--shapes 4096x4096x4096,...] [--samples 15]
Prints a markdown table; with $OUT set, also writes it to $OUT/bench_gemm.md.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from typing import Callable

import torch

import fp8amp

FP8_PEAK_FLOPS = 1979e12  # H200 / H100 SXM dense FP8
L2_BYTES = 60 * 2**20  # H200; operand sets rotate through 4x this
E4M3 = torch.float8_e4m3fn
SAMPLE_SECONDS = 0.02  # length of one timed batch

SQUARE = [(n, n, n) for n in (1024, 2048, 4096, 8192, 16384)]
# Linear layers of 1B-8B transformers at 8192 tokens: (M tokens, K in, N out).
LINEAR = [
    (8192, 2048, 2048),  # ~1B attention projection
    (8192, 2048, 8192),  # ~1B MLP up
    (8192, 8192, 2048),  # ~1B MLP down
    (8192, 4096, 4096),  # 7B/8B attention projection
    (8192, 4096, 11008),  # Llama-2-7B MLP up / gate
    (8192, 11008, 4096),  # Llama-2-7B MLP down
    (8192, 4096, 14336),  # Llama-3-8B MLP up / gate
    (8192, 14336, 4096),  # Llama-3-8B MLP down
]


def median_seconds(fn: Callable[[int], object], samples: int) -> float:
    """Median time of one fn(i) call (i rotates the operand set), from batches of calls."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(0)
    end.record()
    torch.cuda.synchronize()
    batch = max(1, min(1000, round(SAMPLE_SECONDS / max(start.elapsed_time(end) * 1e-3, 1e-7))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    for s in range(samples):
        starts[s].record()
        for i in range(batch):
            fn(s * batch + i)
        ends[s].record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(starts, ends)) * 1e-3 / batch


def quantize(x: torch.Tensor):
    """E4M3 with the power-of-two scale of its amax (DESIGN §3)."""
    scale = 2.0 ** math.floor(math.log2(448.0 / x.abs().max().item()))
    return (x * scale).to(E4M3), torch.tensor([1.0 / scale], device=x.device)


def bench_shape(m: int, k: int, n: int, samples: int) -> list[dict]:
    per_set = m * k + n * k  # FP8 bytes of one operand set
    sets = max(1, min(8, math.ceil(4 * L2_BYTES / per_set)))
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(sets)]
    x8 = [quantize(x) for x in xs]
    w8 = [quantize(w) for w in ws]
    flops = 2.0 * m * n * k

    bf16_s = median_seconds(lambda i: xs[i % sets] @ ws[i % sets].t(), samples)
    rows = []
    for fast in (False, True):
        def ours(i, fast=fast):
            (x, sx), (w, sw) = x8[i % sets], w8[i % sets]
            return fp8amp.ops.gemm(x, w, sx, sw, torch.bfloat16, fast_accum=fast)

        def theirs(i, fast=fast):
            (x, sx), (w, sw) = x8[i % sets], w8[i % sets]
            return torch._scaled_mm(x, w.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=fast)

        a, b = ours(0).float(), theirs(0).float()
        diff = ((a - b).norm() / b.norm()).item()
        ours_s = median_seconds(ours, samples)
        theirs_s = median_seconds(theirs, samples)
        rows.append(dict(m=m, k=k, n=n, fast=fast, ours=ours_s, theirs=theirs_s, bf16=bf16_s, flops=flops, diff=diff))
    del xs, ws, x8, w8
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    header = ("| M x K -> N | fast accum | fp8amp ms | TFLOP/s | _scaled_mm ms | TFLOP/s | vs _scaled_mm "
              "| bf16 ms | TFLOP/s | vs bf16 | floor ms | of peak | diff |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        floor = r["flops"] / FP8_PEAK_FLOPS
        ms_and_tflops = {key: f"{r[key] * 1e3:.3f} | {r['flops'] / r[key] / 1e12:.0f}" for key in ("ours", "theirs", "bf16")}
        lines.append(
            f"| {r['m']} x {r['k']} -> {r['n']} | {'on' if r['fast'] else 'off'} | {ms_and_tflops['ours']} "
            f"| {ms_and_tflops['theirs']} | {r['theirs'] / r['ours']:.2f}x "
            f"| {ms_and_tflops['bf16']} | {r['bf16'] / r['ours']:.2f}x "
            f"| {floor * 1e3:.3f} | {floor / r['ours'] * 100:.0f}% | {r['diff']:.1e} |"
        )
    return "\n".join(lines)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"bench_gemm: --shapes takes MxKxN,MxKxN,... (e.g. 8192x4096x14336), got {item!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=SQUARE + LINEAR, help="MxKxN,MxKxN,...")
    parser.add_argument("--samples", type=int, default=15, help="timed batches per measurement")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemm: needs a CUDA GPU (torch.cuda.is_available() is False); nothing to measure")
    if torch.cuda.get_device_capability() < (8, 9):
        sys.exit(f"bench_gemm: {torch.cuda.get_device_name()} has compute capability "
                 f"{torch.cuda.get_device_capability()}; FP8 GEMMs need 8.9 or newer")

    # Clocks up and cuBLASLt loaded before the first timed shape.
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        x @ x
    del x
    rows = []
    for m, k, n in args.shapes:
        rows += bench_shape(m, k, n, args.samples)
        print(f"  {m} x {k} -> {n}: done", file=sys.stderr, flush=True)
    text = (f"FP8 GEMM (E4M3 x E4M3 -> bfloat16) on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"median of {args.samples} batches\n\n{table(rows)}\n")
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_gemm.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
