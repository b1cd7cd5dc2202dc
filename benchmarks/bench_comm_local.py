"""The local work of the FP8 all-reduce and reduce-scatter on one GPU, against the copy roof, and the 2-GPU time it predicts.

On a multi-GPU host the FP8 hook's time is its local passes (amax, quantize into the send buffer,
the FP32 sum of the received copies with the division and the requantize or the dequantize) plus
the collectives. This program times the first part alone on one GPU: it runs fp8amp's own code
(`fp8amp.distributed._reduce_flat` for both all-reduce methods, `fp8amp.fsdp.fp8_reduce_scatter`)
in one process that stands for rank 0 of --world ranks, with the collectives replaced by no-ops
(the received buffers then hold whatever the allocator hands out: the kernels' time does not
depend on the values). For each bucket it prints

    local ms        median per call (batches of back-to-back calls between CUDA events)
    bytes/element   what the local kernels read and write per element of the bucket, from
                    docs/distributed.md's count (b = the bucket's element size, N = --world)
    of copy         those bytes / local time, as a share of the device-to-device copy bandwidth
                    measured in the same run (the roof of a pass that moves them)
    predicted 2-GPU the local time plus the collectives alone as measured on 2 H200s over NVLink
                    (COLLECTIVES_2XH200, 2026-11-30, `bench_comm.py`), and that sum against the
                    BF16 all_reduce of the same run: the issue's target is <= 0.75x at 2^27-2^29.
                    Only where that run measured the size (2^20, 2^24, 2^27, 2^29) and N = 2. The
                    MAX all-reduce of the amaxes (a few bytes: latency only) is in neither part.
    amax ms         the amax pass over the whole bucket alone (comm_amax)
    pipelined       native only: the chunked reduction's time, against the BF16 all_reduce
                    (docs/distributed.md#pipelined-chunks). The local work (host time included: it
                    is what the calls measure) and the collectives run side by side, so the time is
                    the longer of the two plus one chunk's share of the shorter (the pipeline's fill
                    and drain), never less than the longer: max(W, C) + min(W, C) / chunks. With
                    scales per chunk ("native, scales per chunk"; "native" is the default state,
                    which takes them where chunks hold 2^26 elements or more), W is all the local
                    work, plus one small all-reduce's latency L, not measured here (the first
                    chunk's amaxes; the others' run beside the data collectives). With one scale a
                    gradient ("native, scales per gradient"), the whole amax pass comes first, since
                    every chunk's scale waits for it, and W is the rest. For float32 buckets also
                    against torch's bf16_compress_hook on those 2 H200s (its casts to bfloat16 and
                    back included), the BF16 path such a bucket takes under DDP.

Buckets: float32 and bfloat16 hold plain gradients; "o2" is the float32 bucket of an O1/O2 model
under DDP, holding an E4M3 gradient's dequantized values, whose amax is read from its codes.

--chunks 2,4,8 adds the two explicit native rows (scales per chunk, per gradient) at each of these chunk
counts (FP8CommState(pipeline_chunks=k)) beside the automatic count's: which count is fastest
where the host's launches, not the kernels, set a chunk's time.

Usage: python3 benchmarks/bench_comm_local.py [--sizes 2^24,2^27,2^29] [--dtypes float32,bfloat16,o2]
       [--world 2] [--samples 15] [--chunks 2,4,8]
Prints a markdown table; with $OUT set, also writes it to $OUT/bench_comm_local.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

import torch
import torch.distributed as dist

import fp8amp
from fp8amp import comm_amax, comm_layout
from fp8amp import distributed as fd
from fp8amp.comm_layout import chunk_bounds
from fp8amp.fsdp import fp8_reduce_scatter
from _common import copy_bandwidth, markdown_table, median_seconds, parse_subset, report, require_gpu, warm_up_gpu
from bench_comm import DTYPES, bucket_data, parse_sizes

#: The rows of method "native" with scales per chunk and with one scale a gradient in every chunk
#: (FP8CommState(scales_per_chunk=True / False)), beside the default's (automatic) "native".
PER_CHUNK, PER_GRADIENT = "native, scales per chunk", "native, scales per gradient"
#: The buckets measured: bench_comm's dtypes, and "o2" (float32 holding an E4M3 gradient's values).
BUCKETS = {**DTYPES, "o2": torch.float32}

#: Milliseconds on 2 x H200 (NVLink, NCCL 2.28.9, torch 2.11.0+cu130, 2026-11-30; docs/benchmarks.md
#: "FP8 gradient all-reduce"): the BF16 all_reduce, the float8 all_reduce alone ("native"'s
#: collective), the uint8 all-to-all + all-gather alone ("all_to_all"'s), and torch's
#: bf16_compress_hook on a float32 bucket (its casts included: the BF16 path a float32 bucket takes),
#: by element count.
COLLECTIVES_2XH200 = {
    2**20: dict(bf16=0.078, native=0.075, all_to_all=0.116, bf16_compress=0.169),
    2**24: dict(bf16=0.177, native=0.134, all_to_all=0.169, bf16_compress=0.332),
    2**27: dict(bf16=0.964, native=0.579, all_to_all=0.619, bf16_compress=1.762),
    2**29: dict(bf16=3.375, native=1.805, all_to_all=2.098, bf16_compress=6.620),
}


def local_bytes(method: str, b: int, world: int, coded: bool = False) -> float:
    """Bytes the local kernels read + write per element of the bucket (docs/distributed.md,
    "FP8 communication kernels"; the reduce-scatter per element of its input). ``coded``: the amax
    pass reads FP8 codes (1 byte an element) instead of the bucket (b)."""
    amax = 1 if coded else b
    if method == "native":  # amax; quantize b + 1; sum of the summed codes into the bucket 1 + b
        return amax + 2 * b + 2
    if method == "all_to_all":
        # amax; quantize b + 1; sum + requantize: amax pass 1, store pass 1 + 1/N; dequantize 1 + b
        return amax + 2 * b + 4 + 1 / world
    return 2 * b + 2 + b / world  # reduce-scatter: amax b; quantize b + 1; N codes read (1), b/N written


@contextlib.contextmanager
def one_process_as(world: int):
    """torch.distributed as rank 0 of `world` ranks whose collectives do nothing."""
    class Done:  # the work of a collective issued with async_op=True, already finished
        def wait(self) -> bool:
            return True

    noop = lambda *args, **kwargs: Done()  # noqa: E731
    with mock.patch.multiple(dist, get_world_size=lambda group=None: world, get_rank=lambda group=None: 0,
                             all_reduce=noop, all_to_all_single=noop, all_gather_into_tensor=noop,
                             new_group=lambda *args, **kwargs: None,  # the chunks' amax group
                             get_process_group_ranks=lambda group: list(range(world)),
                             get_backend_config=lambda group=None: "nccl"):
        yield


def parse_chunks(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected chunk counts >= 1 separated by commas, e.g. 2,4,8; got {text!r}")
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=parse_sizes, default=[2**20, 2**24, 2**27, 2**29])
    p.add_argument("--dtypes", default=list(BUCKETS), type=lambda t: parse_subset(t, list(BUCKETS)),
                   help=f"the buckets, of {', '.join(BUCKETS)} (default: all)")
    p.add_argument("--world", type=int, default=2, help="the ranks one process stands for (N)")
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--chunks", type=parse_chunks, default=[],
                   help="also the native rows at these chunk counts, e.g. 2,4,8 (default: the automatic count only)")
    args = p.parse_args()
    if args.world < 2:
        sys.exit(f"bench_comm_local: --world must be at least 2, got {args.world}")
    require_gpu("bench_comm_local")
    warm_up_gpu()
    copy = copy_bandwidth()
    rows = []
    for dtype_name in args.dtypes:
        dtype = BUCKETS[dtype_name]
        b = torch.empty((), dtype=dtype).element_size()
        for n in args.sizes:
            x = bucket_data(n, 0, dtype, torch.device("cuda"))
            grads = None
            if dtype_name == "o2":
                grads = [fp8amp.ScaledTensor.from_tensor(x, fp8amp.E4M3)]
                x = grads[0].dequantize()
            L = -(-n // args.world)
            rs_in = torch.zeros(args.world * L, dtype=dtype, device="cuda")
            rs_in[:n] = x
            rs_out = torch.empty(L, dtype=dtype, device="cuda")
            states = {m: fd.FP8CommState(method=m) for m in fd.METHODS}
            for k in [None] + args.chunks:
                suffix = "" if k is None else f", k={k}"
                states[PER_CHUNK + suffix] = fd.FP8CommState(method="native", pipeline_chunks=k, scales_per_chunk=True)
                states[PER_GRADIENT + suffix] = fd.FP8CommState(method="native", pipeline_chunks=k,
                                                                scales_per_chunk=False)
            for m, state in states.items():
                if state.method == "native":
                    state._backend_checked = True  # no backend to ask: the collective is a no-op
            calls = {m: (lambda i, state=state: fd._reduce_flat(x, (n,), state, grads)) for m, state in states.items()}
            calls["reduce-scatter"] = lambda i: fp8_reduce_scatter(rs_out, rs_in, divisor=float(args.world))
            orders: dict = {}
            sources = comm_amax.code_sources(grads, [x])
            amax_ms = median_seconds(lambda i: comm_amax.local_amax([x], sources, orders), args.samples) * 1e3
            with one_process_as(args.world):
                for method, fn in calls.items():
                    seconds = median_seconds(fn, args.samples)
                    elements = rs_in.numel() if method == "reduce-scatter" else n
                    state = states.get(method)
                    algorithm = "reduce-scatter" if state is None else state.method
                    per_element = local_bytes(algorithm, b, args.world, coded=grads is not None)
                    recorded = COLLECTIVES_2XH200.get(n) if args.world == 2 else None
                    predicted = pipelined = "–"
                    chunks = 1 if state is None else len(chunk_bounds(n, state.pipeline_chunks, algorithm)) - 1
                    if recorded is not None and algorithm in recorded:
                        total = seconds * 1e3 + recorded[algorithm]
                        predicted = f"{total:.3f} ms = {total / recorded['bf16']:.2f}x bf16 ({recorded['bf16']:.3f})"
                        if algorithm == "native":
                            local_ms, whole_amax = seconds * 1e3, 0.0
                            if not comm_layout.uses_chunk_scales(fd._chunks(state, fd._layout(state, (n,), args.world),
                                                                            "native"), state.scales_per_chunk):
                                whole_amax = amax_ms
                            work, wire = local_ms - whole_amax, recorded[algorithm]
                            total = whole_amax + max(work, wire) + min(work, wire) / chunks
                            latency = " + L" if whole_amax == 0.0 else ""
                            pipelined = f"{total:.3f} ms{latency} = {total / recorded['bf16']:.2f}x{latency}"
                            if dtype == torch.float32:
                                pipelined += f"; {total / recorded['bf16_compress']:.2f}x bf16 compress"
                    rows.append([dtype_name, f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else f"{n:,}",
                                 method.split(", k=")[0] + ("" if state is None else f" ({chunks} chunks)"),
                                 f"{seconds * 1e3:.3f}", f"{per_element:.4g}",
                                 f"{per_element * elements / seconds / copy:.0%}",
                                 "–" if method == "reduce-scatter" else f"{amax_ms:.3f}", predicted, pipelined])
            x = grads = rs_in = rs_out = calls = None  # this size's buffers, before the next size's
            torch.cuda.empty_cache()
    text = (f"## Local work of the FP8 all-reduce / reduce-scatter, one {torch.cuda.get_device_name()} standing for "
            f"rank 0 of {args.world}, torch {torch.__version__}; copy {copy / 1e12:.2f} TB/s\n\n"
            + markdown_table(["bucket", "elements", "method", "local ms", "bytes/element", "of copy", "amax ms",
                              "predicted 2-GPU (local + collectives of 2026-11-30)", "pipelined"], rows) + "\n")
    report("comm_local", text)


if __name__ == "__main__":
    main()
