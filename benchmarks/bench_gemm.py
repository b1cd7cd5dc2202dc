"""FP8 GEMM on the GPU against PyTorch, side by side in one run (docs/architecture.md#tests-and-evidence, docs/benchmarks.md#targets).

For each shape (M tokens x K in -> N out, i.e. y[M, N] = x[M, K] · W[N, K]ᵀ) it times

    fp8amp:       fp8amp.ops.fast.gemm(x8, w8, sx, sw, bfloat16, fast_accum=...)   (cuBLASLt)
    _scaled_mm:   torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=bfloat16,
                                   use_fast_accum=...)                                (the same FP8
                                   operands and flag)
    bf16:         x @ w.t() in bfloat16 (torch.matmul; independent of the flag)

with fast accumulation off and on, E4M3 x E4M3 operands and a bfloat16 output, as a Linear's
forward has them. Times are medians over many samples, each sample a batch of back-to-back calls
bracketed by CUDA events (so launch overhead hides behind the GPU where it can, as in a training
step); operand sets rotate so that small shapes do not run from L2. TFLOP/s counts 2·M·N·K; the
floor is that over the H200's dense FP8 peak (1979 TFLOP/s). "vs _scaled_mm" is its time over
ours (> 1: we are faster), the median of per-sample ratios with the two timed in alternation
(both run the same cuBLASLt kernels; separately timed medians drifted apart by up to 7 %); "diff" is ‖ours − _scaled_mm‖ / ‖_scaled_mm‖, a check that both
computed the same product.

Usage: python benchmarks/bench_gemm.py [--shapes 4096x4096x4096,...] [--samples 15]
Prints a markdown table; with $OUT set, also writes it to $OUT/bench_gemm.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch

import fp8amp
from _common import (FP8_PEAK_FLOPS, interleaved_seconds, median_seconds, parse_mkn, report, require_gpu,
                     rotation_sets, warm_up_gpu)

E4M3 = torch.float8_e4m3fn

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


def quantize(x: torch.Tensor):
    """E4M3 with the power-of-two scale of its amax (docs/numerics.md#numerics)."""
    scale = 2.0 ** math.floor(math.log2(448.0 / x.abs().max().item()))
    return (x * scale).to(E4M3), torch.tensor([1.0 / scale], device=x.device)


def bench_shape(m: int, k: int, n: int, samples: int) -> list[dict]:
    sets = rotation_sets(m * k + n * k)  # FP8 bytes of one operand set
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
            return fp8amp.ops.fast.gemm(x, w, sx, sw, torch.bfloat16, fast_accum=fast)

        def theirs(i, fast=fast):
            (x, sx), (w, sw) = x8[i % sets], w8[i % sets]
            return torch._scaled_mm(x, w.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=fast)

        a, b = ours(0).float(), theirs(0).float()
        diff = ((a - b).norm() / b.norm()).item()
        ours_t, theirs_t = interleaved_seconds([ours, theirs], samples)
        ratio = statistics.median(t / o for o, t in zip(ours_t, theirs_t))
        rows.append(dict(m=m, k=k, n=n, fast=fast, ours=statistics.median(ours_t), theirs=statistics.median(theirs_t),
                         ratio=ratio, bf16=bf16_s, flops=flops, diff=diff))
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
            f"| {ms_and_tflops['theirs']} | {r['ratio']:.2f}x "
            f"| {ms_and_tflops['bf16']} | {r['bf16'] / r['ours']:.2f}x "
            f"| {floor * 1e3:.3f} | {floor / r['ours'] * 100:.0f}% | {r['diff']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_mkn, default=SQUARE + LINEAR, help="MxKxN,MxKxN,...")
    parser.add_argument("--samples", type=int, default=15, help="timed batches per measurement")
    args = parser.parse_args()
    require_gpu("bench_gemm", min_capability=(8, 9))
    warm_up_gpu()
    rows = []
    for m, k, n in args.shapes:
        rows += bench_shape(m, k, n, args.samples)
        torch.cuda.empty_cache()  # the shape's operands died with bench_shape's frame
        print(f"  {m} x {k} -> {n}: done", file=sys.stderr, flush=True)
    text = (f"FP8 GEMM (E4M3 x E4M3 -> bfloat16) on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"median of {args.samples} batches\n\n{table(rows)}\n")
    report("gemm", text)


if __name__ == "__main__":
    main()
