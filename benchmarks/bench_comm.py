"""FP8 gradient all-reduce (fp8amp.distributed) and FP8 reduce-scatter (fp8amp.fsdp) against BF16 and FP32, on 2 GPUs.

For buckets of a few sizes (default 2^24 .. 2^29 elements; docs/distributed.md#design measured 537M = 2^29) it
times, per call, on every rank (the table shows the slowest rank's median):

    fp32 all_reduce            dist.all_reduce of the float32 bucket (DDP's default, raw)
    bf16 all_reduce            dist.all_reduce of a bfloat16 tensor of the same size (raw)
    bf16 compress              cast the bucket to bf16, all_reduce, cast back, divide
                               (torch's bf16_compress_hook: the fair end-to-end competitor)
    fp8 all_to_all             fp8amp's hook, method "all_to_all", end to end (amax, MAX all-reduce,
                               comm_quantize into the send buffer, uint8 all-to-all, comm_sum_shards:
                               FP32 sum + requantize, uint8 all-gather, dequantize)
    fp8 native                 fp8amp's hook, method "native", end to end (NCCL only; comm_quantize,
                               float8 all_reduce, comm_sum_shards: dequantize + divide)
    uint8 a2a + all_gather     the two uint8 collectives alone (docs/distributed.md#design's 1.97 ms at 2^29)
    fp8 native all_reduce      dist.all_reduce of a float8_e4m3fn tensor alone (docs/distributed.md#design's 1.75 ms)
    fp32 / bf16 reduce_scatter dist.reduce_scatter_tensor (AVG) of the bucket as FSDP2 does it (raw; the bf16
                               one on a bf16 copy)
    fp8 reduce_scatter         fp8amp.fsdp.fp8_reduce_scatter, end to end (amax of each chunk, MAX
                               all-reduce, comm_quantize, uint8 all-to-all, comm_sum_shards into the
                               output); its accuracy against the exact mean of this rank's chunk
    uint8 all_to_all           the FP8 reduce-scatter's collective alone

"sent/rank" is the bytes one rank puts on the wire (fp8amp.distributed.wire_bytes: ring
all-reduce 2 (N-1)/N of the payload; the FP8 methods include the amax all-reduce and the scales).
For buckets up to --accuracy-max elements, the reduced bucket of each end-to-end method is also
compared with the exact mean (float64) of the ranks' buckets: relative RMS error and max |error| /
max |mean|. The bucket holds --tensors gradients of equal size, each randn x exp(randn) (heavy
tails) from a per-rank seed.

Usage:
    torchrun --nproc-per-node=2 benchmarks/bench_comm.py [--sizes 1048576,...] [--iters 20]
    python3 benchmarks/bench_comm.py            # launches --nproc processes itself (2 GPUs)
    python3 benchmarks/bench_comm.py --device cpu --backend gloo --sizes 65536,1048576   # CPU smoke run
Prints a markdown table (rank 0); with $OUT set, also writes it to $OUT/bench_comm.md. On a
machine with fewer than --nproc GPUs it says so and exits 0 (nothing to measure).
"""

import argparse
import math
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fp8amp
from fp8amp import distributed as fd
from fp8amp.fsdp import fp8_reduce_scatter
from _common import markdown_table, report

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_sizes(text: str) -> list:
    sizes = []
    for item in text.split(","):
        item = item.strip()
        value = 2 ** int(item[2:]) if item.startswith("2^") else int(item) if item.isdigit() else 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"takes positive element counts (or 2^k), comma-separated; got {item!r}")
        sizes.append(value)
    return sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=parse_sizes, default=None,
                   help="bucket sizes in elements (default: 2^24,2^26,2^27,2^28,2^29 on cuda; 2^16,2^20 on cpu)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per method and size (median)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl on cuda, gloo on cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="the bucket's dtype (DDP: the params')")
    p.add_argument("--tensors", type=int, default=1, help="gradients per bucket (each gets its own FP8 scale)")
    p.add_argument("--accuracy-max", type=parse_sizes, default=[2**24],
                   help="measure accuracy for buckets up to this many elements (default 2^24)")
    p.add_argument("--nproc", type=int, default=2, help="processes to launch when not run under torchrun")
    args = p.parse_args(argv)
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.sizes is None:
        args.sizes = [2**24, 2**26, 2**27, 2**28, 2**29] if args.device == "cuda" else [2**16, 2**20]
    if args.iters < 1 or args.tensors < 1 or args.nproc < 1:
        p.error("--iters, --tensors and --nproc must be positive")
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    return args


class Timer:
    """Median seconds of fn() on this rank: CUDA events on cuda, perf_counter on cpu; every call
    starts after a barrier, so the ranks start together."""

    def __init__(self, device: torch.device, iters: int) -> None:
        self.device, self.iters = device, iters

    def __call__(self, fn) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(self.iters):
            dist.barrier()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e-3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def bucket_data(n: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    x = torch.randn(n, generator=g, device=device) * torch.exp(torch.randn(n, generator=g, device=device))
    return x.to(dtype)


def accuracy(out: torch.Tensor, exact: torch.Tensor) -> tuple:
    err = out.double() - exact
    rms = (err.norm() / exact.norm()).item()
    worst = (err.abs().max() / exact.abs().max()).item()
    return rms, worst


def native_unavailable(backend: str, device: torch.device) -> str:
    """Why method "native" cannot run here, or "" when it can: the backend must be one that reduces
    float8, and this torch and NCCL build must accept a float8 all_reduce (probed once, so that a
    refusal leaves the table's rows marked, not the run stopped)."""
    if backend not in fd.NATIVE_BACKENDS:
        return f"backend {backend}"
    try:
        dist.all_reduce(torch.zeros(1, dtype=fp8amp.E4M3, device=device))
    except RuntimeError as e:  # raised alike on every rank, before any communication
        return f"float8 all_reduce refused: {str(e).splitlines()[0]}"
    return ""


def run(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = DTYPES[args.dtype]
    timer = Timer(device, args.iters)
    why_no_native = native_unavailable(args.backend, device)
    native_ok = not why_no_native
    rows = []
    for n in args.sizes:
        per = max(1, n // args.tensors)
        numels = tuple([per] * (args.tensors - 1) + [n - per * (args.tensors - 1)])
        x = bucket_data(n, rank, dtype, device)
        exact = None
        if n <= args.accuracy_max[0]:
            exact = x.double()
            dist.all_reduce(exact)
            exact /= world

        a2a = fd.FP8CommState(method="all_to_all")
        native = fd.FP8CommState(method="native")
        x32 = x.float() if dtype != torch.float32 else x.clone()
        x16 = x.to(torch.bfloat16, copy=True)  # the raw all-reduces work in place on copies
        codes = torch.zeros(n, dtype=torch.uint8, device=device)
        L = math.ceil(n / world)
        send = torch.zeros(world * L, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        gathered = torch.empty_like(send)
        shard = torch.zeros(L, dtype=torch.uint8, device=device)

        # The reduce-scatter: the bucket (padded to N equal chunks) in, this rank's chunk out.
        rs_in32 = torch.zeros(world * L, dtype=torch.float32, device=device)
        rs_in32[:n] = x32
        rs_in16 = rs_in32.to(torch.bfloat16)
        rs_out32 = torch.empty(L, dtype=torch.float32, device=device)
        rs_out16 = torch.empty(L, dtype=torch.bfloat16, device=device)
        rs_exact = None
        if exact is not None:
            rs_exact = torch.zeros(world * L, dtype=torch.float64, device=device)
            rs_exact[:n] = exact
            rs_exact = rs_exact[rank * L:(rank + 1) * L]
        avg = dist.ReduceOp.AVG if args.backend == "nccl" else dist.ReduceOp.SUM  # gloo has no AVG

        def reduce_scatter(out, inp):
            dist.reduce_scatter_tensor(out, inp, op=avg)
            if avg == dist.ReduceOp.SUM:
                out.div_(world)
            return out

        def fp8_rs():
            fp8_reduce_scatter(rs_out32, rs_in32, divisor=float(world))
            return rs_out32

        # Ring reduce-scatter: (N-1)/N of the payload; FP8 adds the chunks' amax all-reduce.
        rs_bytes = {"fp32": (world - 1) * L * 4, "bf16": (world - 1) * L * 2,
                    "fp8": (world - 1) * L + 2 * (world - 1) * 4 * world // world}

        def bf16_compress(buf=x):
            t = buf.to(torch.bfloat16, copy=True)
            dist.all_reduce(t)
            return t.to(buf.dtype).div_(world)

        methods = [
            # name, fn, end-to-end fn for accuracy (or None), wire bytes
            ("bf16 all_reduce", lambda: dist.all_reduce(x16), None, fd.wire_bytes(numels, world, "all_reduce", torch.bfloat16)),
            ("fp32 all_reduce", lambda: dist.all_reduce(x32), None, fd.wire_bytes(numels, world, "all_reduce", torch.float32)),
            ("bf16 compress", bf16_compress, bf16_compress, fd.wire_bytes(numels, world, "all_reduce", torch.bfloat16)),
            ("fp8 all_to_all", lambda: fd._reduce_flat(x, numels, a2a), lambda: fd._reduce_flat(x, numels, a2a),
             fd.wire_bytes(numels, world, "all_to_all")),
            ("fp8 native", (lambda: fd._reduce_flat(x, numels, native)) if native_ok else None,
             (lambda: fd._reduce_flat(x, numels, native)) if native_ok else None, fd.wire_bytes(numels, world, "native")),
            ("uint8 a2a + all_gather (comm only)",
             lambda: (dist.all_to_all_single(recv, send), dist.all_gather_into_tensor(gathered, shard)), None,
             2 * (world - 1) * L),
            ("fp8 native all_reduce (comm only)",
             (lambda: dist.all_reduce(codes.view(fp8amp.E4M3))) if native_ok else None, None,
             2 * (world - 1) * n // world),
            ("bf16 reduce_scatter", lambda: reduce_scatter(rs_out16, rs_in16), None, rs_bytes["bf16"]),
            ("fp32 reduce_scatter", lambda: reduce_scatter(rs_out32, rs_in32), None, rs_bytes["fp32"]),
            ("fp8 reduce_scatter", fp8_rs, fp8_rs, rs_bytes["fp8"]),
            ("uint8 all_to_all (comm only)", lambda: dist.all_to_all_single(recv, send), None, (world - 1) * L),
        ]
        bf16_time = bf16_rs_time = None
        for name, fn, full, nbytes in methods:
            if fn is None:
                rows.append([f"{n:,}", name, f"{nbytes / 1e6:.4g}", f"n/a ({why_no_native})", "", "", ""])
                continue
            t = slowest(timer(fn), device)
            if name == "bf16 all_reduce":
                bf16_time = t
            if name == "bf16 reduce_scatter":
                bf16_rs_time = t
            reduce_scatters = "reduce_scatter" in name or name.startswith("uint8 all_to_all")
            rms = worst = ""
            if full is not None and exact is not None:
                r, w = accuracy(full(), rs_exact if reduce_scatters else exact)
                rms, worst = f"{r:.2e}", f"{w:.2e}"
            base = bf16_rs_time if reduce_scatters else bf16_time
            rel = f"{t / base:.2f}x" if base else ""
            rows.append([f"{n:,}", name, f"{nbytes / 1e6:.4g}", f"{t * 1e3:.3f}", rel, rms, worst])
        methods = None  # the closures hold this size's buffers
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        where = (f"{world} x {torch.cuda.get_device_name(device)}" if device.type == "cuda" else f"{world} CPU processes")
        text = (f"## FP8 gradient all-reduce and reduce-scatter vs BF16/FP32 ({where}, backend {args.backend}, "
                f"torch {torch.__version__}"
                + (f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" if args.backend == "nccl" else "")
                + f", bucket {args.dtype}, {args.tensors} gradient(s) per bucket, median of {args.iters})\n\n")
        text += ("The reduce-scatter rows compare with the bf16 reduce_scatter, the others with the bf16 "
                 "all_reduce.\n\n")
        text += markdown_table(["elements", "method", "sent/rank (MB)", "time (ms)", "vs bf16 (same collective)",
                                "rel. RMS error", "max err / max|mean|"], rows)
        report("comm", text)


def worker(local_rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world))
    main_in_process(args)


def main_in_process(args) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(args.backend)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        main_in_process(args)
        return
    if args.device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < args.nproc):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        report("comm", f"## FP8 gradient all-reduce: skipped, needs {args.nproc} GPUs (this machine has {count}); "
                       f"run with torchrun --nproc-per-node=2, or --device cpu --backend gloo for a CPU smoke run\n")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.nproc, port, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    sys.exit(main())
