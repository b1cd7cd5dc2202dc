"""Cast kernels on the GPU against PyTorch, side by side in one run (docs/architecture.md#tests-and-evidence, docs/benchmarks.md#targets).

For bf16 matrices of a few shapes it times fp8amp's quantize, cast+transpose (+amax) and
dequantize, and the plain-PyTorch way of doing the same, eager and under torch.compile:

    quantize:       amax = x.abs().max(); scale = 2^floor(log2(448 / amax));
                    (x * scale).clamp(-448, 448).to(float8_e4m3fn)
    cast+transpose: the same, plus .t().contiguous() of the result
    ... + dbias:    the same, plus x.sum(0, dtype=float32) (a Linear's bias gradient)
    re-scaled transpose (O1/O2's weight transpose from FP16 master codes, cast_transpose_rescaled):
                    (x16.float() * (scale_inv * scale)).clamp(-448, 448).to(float8_e4m3fn).t().contiguous()
    dequantize:     (x8.float() * scale_inv).to(bfloat16)

fp8amp's rows come in two flavours: delayed scaling (the scale is given; the amax is folded in
the same pass, one read of x) and current scaling (an amax pre-pass first, as the PyTorch code
does). Times are GPU times per call: medians over many replays of a CUDA graph of the calls, so
no CPU launch overhead is in them; each graph runs through enough copies of the input to exceed
the L2 cache several times, so no call reads from cache. GB/s counts the bytes an ideal kernel
moves (each input read once, each output written once); "of copy" is that against a
device-to-device tensor copy measured in the same run (bytes read + written). "speedup" is
PyTorch's time over ours.

With --mode tiles it times the tile ops instead (docs/tiles.md): quantize_tiles,
cast_transpose_tiles and scaled_accumulate_tiles (an E4M3 accumulator plus a bf16 update) of bf16
matrices with (1, 128) tiles and (128, 128) blocks, quantize_tiles and cast_transpose_tiles with
rowwise scales, MXFP8's quantize_mx and cast_transpose_mx (1 x 32 blocks), and multi_norm_tiles
of E4M3 codes (128 x 128 blocks, and one scale: a read of 1 byte an element), against a
device-to-device copy of the same bytes (half of them read, half written) in the same run. The
copy runs as direct launches (a copy inside a CUDA graph becomes a memcpy node, which ran slower
on the H200); "of copy" is the copy's time over the op's, the op's fraction of copy bandwidth.

Usage: python benchmarks/bench_cast.py [--mode ops|tiles] [--shapes 4096x4096,16384x4096,8192x8192] [--iters 200]
Prints a markdown table; with $OUT set, also writes it to $OUT/bench_cast.md (bench_cast_tiles.md).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

import fp8amp
from _common import copy_bandwidth, markdown_table, report, require_gpu, rotation_sets

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def median_ms(fn: Callable, inputs: list, iters: int) -> float:
    """Median GPU time of one call of fn in milliseconds.

    The calls of fn on every input are captured in one CUDA graph, so the time holds no CPU
    launch overhead (a Python wrapper costs tens of µs a call, more than a 4096x4096 cast takes
    on the GPU); the graph is replayed iters times, each replay between two CUDA events.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and compilation) outside the capture
        for x in inputs:
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in inputs:
            fn(x)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / len(inputs)


# ---- PyTorch baselines ---------------------------------------------------------------------


def torch_quantize(x: torch.Tensor):
    amax = x.abs().max().float()
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
    return (x * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal()


def torch_cast_transpose(x: torch.Tensor):
    out, scale_inv = torch_quantize(x)
    return out, out.t().contiguous(), scale_inv


def torch_cast_transpose_dbias(x: torch.Tensor):
    return *torch_cast_transpose(x), x.sum(0, dtype=torch.float32)


def torch_transpose_rescaled(args):
    codes, scale_inv, scale = args
    return (codes.float() * (scale_inv * scale)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).t().contiguous()


def torch_dequantize(args):
    x8, scale_inv = args
    return (x8.float() * scale_inv).to(torch.bfloat16)


# ---- fp8amp --------------------------------------------------------------------------------


def scaling_args(current: bool) -> dict:
    """One tensor's scaling buffers as fp8amp.ScalingState passes them: delayed scaling (the
    scale is used as given) or current scaling (warming up: an amax pre-pass sets the scale)."""
    return dict(
        scale=torch.ones(1, device="cuda"),
        amax=torch.zeros(1, 16, device="cuda"),
        dtype=E4M3,
        warmup_counter=torch.zeros(1, dtype=torch.int32, device="cuda"),
        warmup_steps=1 if current else 0,
    )


def ours_quantize(current: bool) -> Callable:
    kwargs = scaling_args(current)
    return lambda x: fp8amp.ops.quantize(x, **kwargs)


def ours_cast_transpose(current: bool) -> Callable:
    kwargs = scaling_args(current)
    return lambda x: fp8amp.ops.cast_transpose(x, **kwargs)


def ours_cast_transpose_dbias(current: bool) -> Callable:
    kwargs = scaling_args(current)
    return lambda x: fp8amp.ops.cast_transpose_dbias(x, **kwargs)


def ours_transpose_rescaled(args):
    return fp8amp.ops.cast_transpose_rescaled(*args, E4M3)


def ours_dequantize(args):
    x8, scale_inv = args
    return fp8amp.ops.dequantize(x8, scale_inv, torch.bfloat16)


# ---- the table -----------------------------------------------------------------------------


@dataclass
class Row:
    op: str
    shape: str
    ours_ms: float
    bytes_moved: int
    eager_ms: float
    compiled_ms: float

    def cells(self, copy_bw: float) -> list[str]:
        gbs = self.bytes_moved / (self.ours_ms * 1e-3) / 1e9
        return [
            self.op, self.shape, f"{self.ours_ms * 1e3:.1f}", f"{gbs:.0f}", f"{gbs * 1e9 / copy_bw:.0%}",
            f"{self.eager_ms * 1e3:.1f}", f"{self.eager_ms / self.ours_ms:.2f}x",
            f"{self.compiled_ms * 1e3:.1f}", f"{self.compiled_ms / self.ours_ms:.2f}x",
        ]


HEADER = ["op", "shape (bf16)", "fp8amp µs", "GB/s", "of copy", "torch eager µs", "speedup",
          "torch.compile µs", "speedup"]


def markdown(rows: list[Row], copy_bw: float) -> str:
    return markdown_table(HEADER, [row.cells(copy_bw) for row in rows])


def bench_shape(rows_n: int, cols_n: int, iters: int) -> list[Row]:
    numel = rows_n * cols_n
    copies = rotation_sets(2 * numel, min_sets=2, max_sets=None)  # bf16 bytes of one input
    xs = [torch.randn(rows_n, cols_n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    scale_inv = torch.full((1,), 2.0**-4, device="cuda")
    fp8s = [((x * 16).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale_inv) for x in xs]
    shape = f"{rows_n}x{cols_n}"

    def measure(op: str, ours: dict[str, Callable], baseline: Callable, inputs: list, bytes_moved: int):
        eager = median_ms(baseline, inputs, iters)
        compiled = median_ms(torch.compile(baseline, dynamic=False), inputs, iters)
        for label, fn in ours.items():
            rows.append(Row(f"{op}{label}", shape, median_ms(fn, inputs, iters), bytes_moved, eager, compiled))

    rows: list[Row] = []
    flavours = {" (delayed)": False, " (current)": True}
    measure("quantize", {k: ours_quantize(v) for k, v in flavours.items()}, torch_quantize, xs, 3 * numel)
    measure("cast+transpose+amax", {k: ours_cast_transpose(v) for k, v in flavours.items()}, torch_cast_transpose,
            xs, 4 * numel)
    measure("cast+transpose+amax+dbias", {" (delayed)": ours_cast_transpose_dbias(False)},
            torch_cast_transpose_dbias, xs, 4 * numel + 4 * cols_n)
    measure("dequantize", {"": ours_dequantize}, torch_dequantize, fp8s, 3 * numel)
    del fp8s
    scale = torch.full((1,), 2.0**4, device="cuda")
    masters = [(x.half(), scale_inv, scale) for x in xs]  # FP16 codes of a master, as O1/O2 keep them
    measure("re-scaled transpose (fp16 codes)", {"": ours_transpose_rescaled}, torch_transpose_rescaled, masters,
            3 * numel)
    del xs, masters
    torch.cuda.empty_cache()
    return rows


# ---- --mode tiles ---------------------------------------------------------------------------


def copy_ms(bytes_moved: int, iters: int) -> float:
    """Median time of a device-to-device copy reading and writing bytes_moved / 2 bytes each: direct
    launches back to back between two events, rotating over enough buffers to miss L2."""
    n = bytes_moved // 2
    pairs = [(torch.empty(n, dtype=torch.uint8, device="cuda").random_(), torch.empty(n, dtype=torch.uint8,
                                                                                       device="cuda"))
             for _ in range(rotation_sets(2 * n, min_sets=2, max_sets=None))]
    for src, dst in pairs:
        dst.copy_(src)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        for src, dst in pairs:
            dst.copy_(src)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / len(pairs)


def tile_row(op: str, tile: str, shape: str, fn: Callable, xs: list, bytes_moved: int, iters: int) -> list[str]:
    """One row of the tiles table: fn's median time against a copy of the same bytes."""
    ours = median_ms(fn, xs, iters)
    copy = copy_ms(bytes_moved, iters)
    return [op, tile, shape, f"{ours * 1e3:.1f}", f"{bytes_moved / (ours * 1e-3) / 1e9:.0f}", f"{copy * 1e3:.1f}",
            f"{copy / ours:.0%}"]


def bench_tiles_shape(rows_n: int, cols_n: int, iters: int) -> list[list[str]]:
    numel = rows_n * cols_n
    xs = [torch.randn(rows_n, cols_n, device="cuda", dtype=torch.bfloat16)
          for _ in range(rotation_sets(2 * numel, min_sets=2, max_sets=None))]
    table = []
    for tile in [(1, 128), (128, 128)]:
        scales = 4 * math.ceil(rows_n / tile[0]) * math.ceil(cols_n / tile[1])  # float32 bytes, either layout
        scales_t = 4 * math.ceil(cols_n / tile[0]) * math.ceil(rows_n / tile[1])
        # scaled_accumulate_tiles adds each x into an E4M3 accumulator of x's tiles.
        acc, acc_scale_inv = fp8amp.ops.quantize_tiles(xs[0], E4M3, tile)
        for op, fn, bytes_moved in [
            ("quantize_tiles", lambda x, tile=tile: fp8amp.ops.quantize_tiles(x, E4M3, tile), 3 * numel + scales),
            ("cast_transpose_tiles", lambda x, tile=tile: fp8amp.ops.cast_transpose_tiles(x, E4M3, tile),
             4 * numel + scales + scales_t),
            ("scaled_accumulate_tiles",
             lambda x, tile=tile, acc=acc, si=acc_scale_inv: fp8amp.ops.scaled_accumulate_tiles(acc, si, x, tile),
             4 * numel + 2 * scales),
        ]:
            table.append(tile_row(op, f"{tile[0]}x{tile[1]}", f"{rows_n}x{cols_n}", fn, xs, bytes_moved, iters))
    # Rowwise: one scale a row of x, and one a column for its transpose.
    for op, fn, bytes_moved in [
        ("quantize_tiles", lambda x: fp8amp.ops.quantize_tiles(x, E4M3, (1, cols_n)), 3 * numel + 4 * rows_n),
        ("cast_transpose_tiles",
         lambda x: fp8amp.ops.cast_transpose_tiles(x, E4M3, (1, cols_n), tile_t=(1, rows_n)),
         4 * numel + 4 * (rows_n + cols_n)),
    ]:
        table.append(tile_row(op, "rowwise", f"{rows_n}x{cols_n}", fn, xs, bytes_moved, iters))
    # MXFP8 (docs/tiles.md#mxfp8): 1 x 32 blocks, one uint8 E8M0 scale each.
    mx_scales, mx_scales_t = rows_n * math.ceil(cols_n / 32), cols_n * math.ceil(rows_n / 32)
    for op, fn, bytes_moved in [
        ("quantize_mx", lambda x: fp8amp.ops.quantize_mx(x, E4M3), 3 * numel + mx_scales),
        ("cast_transpose_mx", lambda x: fp8amp.ops.cast_transpose_mx(x, E4M3), 4 * numel + mx_scales + mx_scales_t),
    ]:
        table.append(tile_row(op, "1x32 E8M0", f"{rows_n}x{cols_n}", fn, xs, bytes_moved, iters))
    # The 2-norm of E4M3 codes (clip_grad_norm_ of FP8 gradients): one read of the codes.
    codes = [fp8amp.ops.quantize_tiles(x, E4M3, (128, 128))[0] for x in xs]
    block_scales = torch.ones(math.ceil(rows_n / 128), math.ceil(cols_n / 128), device="cuda")
    one = torch.ones(1, device="cuda")
    for tile, fn, bytes_moved in [
        ("128x128", lambda c: fp8amp.ops.multi_norm_tiles([c], [block_scales], (128, 128)),
         numel + 4 * block_scales.numel()),
        ("one scale", lambda c: fp8amp.ops.multi_norm_tiles([c], [one]), numel + 4),
    ]:
        table.append(tile_row("multi_norm_tiles", tile, f"{rows_n}x{cols_n}", fn, codes, bytes_moved, iters))
    del xs, codes
    torch.cuda.empty_cache()
    return table


def main_tiles(shapes: list[tuple[int, int]], iters: int) -> None:
    table = []
    for r, c in shapes:
        table += bench_tiles_shape(r, c, iters)
    header = ["op", "tile", "shape (bf16, E4M3 codes)", "fp8amp µs", "GB/s", "copy of the same bytes µs", "of copy"]
    title = (f"Tile casts, {torch.cuda.get_device_name()}, torch {torch.__version__}: GPU time per call "
             f"(CUDA graph replay, median) against a device-to-device copy moving the same bytes\n\n")
    report("cast_tiles", title + markdown_table(header, table) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("ops", "tiles"), default="ops",
                        help="ops: the per-tensor casts against PyTorch; tiles: the tile casts against a copy")
    parser.add_argument("--shapes", default="4096x4096,16384x4096,8192x8192",
                        help="comma-separated ROWSxCOLS of the bf16 input")
    parser.add_argument("--iters", type=int, default=200, help="timed runs per measurement")
    args = parser.parse_args()
    require_gpu("bench_cast")
    shapes = [tuple(int(v) for v in spec.lower().split("x")) for spec in args.shapes.split(",")]
    if args.mode == "tiles":
        main_tiles(shapes, args.iters)
        return 0
    copy_bw = copy_bandwidth(args.iters)
    rows = []
    for r, c in shapes:
        rows += bench_shape(r, c, args.iters)
    device = torch.cuda.get_device_name()
    title = (f"Cast kernels, {device}, torch {torch.__version__}: GPU time per call (CUDA graph replay, "
             f"median); device-to-device copy {copy_bw / 1e12:.2f} TB/s (read + write)\n\n")
    table = title + markdown(rows, copy_bw) + "\n"
    report("cast", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
