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

With --tiles it times instead the GEMM with tile scales (fp8amp.ops.gemm_tiles, docs/tiles.md)
against per-tensor FP8 and bfloat16 on the same shapes (E4M3 x E4M3 -> bfloat16, no fast
accumulation unless named):

    blockwise:      gemm_tiles with (1, 128) tiles of x and (128, 128) blocks of W
    rowwise:        gemm_tiles with one scale per row of x and of W
    tensor:         fp8amp.ops.fast.gemm (per-tensor), fast accumulation off and on
    _scaled_mm blk: torch._scaled_mm with the same blockwise scales, where torch offers the mode
    bf16:           x @ w.t()

and prints the times with their ratios to per-tensor FP8 (> 1: faster than per-tensor). A mode
cuBLASLt or torch refuses on this GPU is shown as such.

Usage: python benchmarks/bench_gemm.py [--tiles] [--quick] [--shapes 4096x4096x4096,...] [--samples 15]
(--quick: a 2048 and a 4096 square and one Linear shape.) Prints a markdown table; with $OUT set,
also writes it to $OUT/bench_gemm.md (bench_gemm_tiles.md with --tiles).
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


def tiled(x: torch.Tensor, tile):
    return fp8amp.ops.quantize_tiles(x, E4M3, tile)


def scaled_mm_blockwise_scales(sx: torch.Tensor, sw: torch.Tensor):
    """Our (1, 128) and (128, 128) scales in the layouts torch._scaled_mm reads for (x, w.t()):
    x's M-major, w's as [K blocks, N blocks] (a transposed view of ours)."""
    return sx.t().contiguous().t(), sw.t()


def bench_tiles_shape(m: int, k: int, n: int, samples: int) -> dict:
    sets = rotation_sets(m * k + n * k)
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(sets)]
    tensor = [(quantize(x), quantize(w)) for x, w in zip(xs, ws)]
    block = [(tiled(x, (1, 128)), tiled(w, (128, 128))) for x, w in zip(xs, ws)]
    row = [(tiled(x, (1, k)), tiled(w, (1, k))) for x, w in zip(xs, ws)]
    gemm_tiles = fp8amp.ops.gemm_tiles

    def per_tensor(fast):
        def run(i):
            (x, sx), (w, sw) = tensor[i % sets]
            return fp8amp.ops.fast.gemm(x, w, sx, sw, torch.bfloat16, fast_accum=fast)
        return run

    def blockwise(i):
        (x, sx), (w, sw) = block[i % sets]
        return gemm_tiles(x, sx, (1, 128), w, sw, (128, 128))

    def rowwise(i):
        (x, sx), (w, sw) = row[i % sets]
        return gemm_tiles(x, sx, (1, k), w, sw, (1, k))

    def scaled_mm_blockwise(i):
        (x, sx), (w, sw) = block[i % sets]
        a_scale, b_scale = scaled_mm_blockwise_scales(sx, sw)
        return torch._scaled_mm(x, w.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)

    candidates = {"tensor": per_tensor(False), "tensor fast": per_tensor(True), "blockwise": blockwise,
                  "rowwise": rowwise, "_scaled_mm blk": scaled_mm_blockwise,
                  "bf16": lambda i: xs[i % sets] @ ws[i % sets].t()}
    times, refused = {}, {}
    for name, fn in candidates.items():
        try:
            fn(0)
            torch.cuda.synchronize()
        except (RuntimeError, NotImplementedError, ValueError) as e:
            refused[name] = str(e).splitlines()[0][:100]
            continue
        times[name] = median_seconds(fn, samples)
    return dict(m=m, k=k, n=n, flops=2.0 * m * n * k, times=times, refused=refused)


def tiles_table(rows: list[dict]) -> str:
    names = ["tensor", "tensor fast", "blockwise", "rowwise", "_scaled_mm blk", "bf16"]
    header = "| M x K -> N | " + " | ".join(f"{n} ms (TFLOP/s)" for n in names) + \
        " | blockwise / tensor | rowwise / tensor | blockwise / tensor fast | blockwise / _scaled_mm blk | blockwise / bf16 |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    notes = []
    for r in rows:
        t = r["times"]
        cells = [f"{t[n] * 1e3:.3f} ({r['flops'] / t[n] / 1e12:.0f})" if n in t else "refused" for n in names]

        def speed(ours, base):  # > 1: ours is faster
            return f"{t[base] / t[ours]:.2f}x" if ours in t and base in t else "-"
        ratios = [speed("blockwise", "tensor"), speed("rowwise", "tensor"), speed("blockwise", "tensor fast"),
                  speed("blockwise", "_scaled_mm blk"), speed("blockwise", "bf16")]
        lines.append(f"| {r['m']} x {r['k']} -> {r['n']} | " + " | ".join(cells + ratios) + " |")
        notes += [f"- {r['m']} x {r['k']} -> {r['n']}, {name}: {why}" for name, why in r["refused"].items()]
    return "\n".join(lines + ([""] + notes if notes else []))


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
    parser.add_argument("--tiles", action="store_true", help="the GEMM with tile scales against per-tensor FP8")
    parser.add_argument("--quick", action="store_true", help="three shapes only")
    args = parser.parse_args()
    if args.quick:
        args.shapes = [(2048, 2048, 2048), (4096, 4096, 4096), (8192, 4096, 14336)]
    require_gpu("bench_gemm", min_capability=(8, 9))
    warm_up_gpu()
    if args.tiles:
        tile_rows = []
        for m, k, n in args.shapes:
            tile_rows.append(bench_tiles_shape(m, k, n, args.samples))
            torch.cuda.empty_cache()
            print(f"  {m} x {k} -> {n}: done", file=sys.stderr, flush=True)
        report("gemm_tiles", f"FP8 GEMM with tile scales (E4M3 x E4M3 -> bfloat16) on {torch.cuda.get_device_name()}, "
                             f"torch {torch.__version__}, median of {args.samples} batches\n\n{tiles_table(tile_rows)}\n")
        return
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
