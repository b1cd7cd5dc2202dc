"""Optimizer step time and model-state bytes per parameter: fp8amp O1/O2 against torch AdamW (docs/benchmarks.md#targets).

The parameters are the Linear weights of a ~1B-parameter GPT (20 layers, d_model 2048: per layer
2048->6144, 2048->2048, 2048->8192, 8192->2048; 1.007B parameters), each with a gradient, stepped
by AdamW (lr 1e-4, weight decay 0.1). Modes:

    torch fused         torch.optim.AdamW(fused=True): float32 params, grads, m, v (the baseline)
    torch foreach       torch.optim.AdamW(foreach=True), the same tensors
    fp8amp fp32         fp8amp.optim.AdamW(state_dtypes="O1") on the same float32 params and grads
    fp8amp O1           FP16 ScaledTensor masters, E4M3 ScaledTensor grads, float32 m and v
    fp8amp O2           FP16 masters, E4M3 grads, E4M3 m, FP16 v (docs/o1_o2.md#optimization-levels's 6 bytes per parameter)
    fp8amp O2 blocks    O2 with the blockwise recipe's E4M3 grads: one scale per 128 x 128 block
                        (fp8amp.BlockScaledTensor), which the step reads per element
    fp8amp O2 + copy    O2 also rewriting each weight's E4M3 copy for the forward GEMM (what an
                        Fp8Linear training step does: its forward reads that copy instead of
                        re-casting the weight)
    fp8amp O2, stochastic rounding
                        O2 with master_rounding="stochastic" (docs/numerics.md#stochastic-rounding):
                        the same bytes, a hash and a few integer operations more per element in pass 2
    fp8amp O2, master read
                        O2 with each master's kept amax made unknown before every step (one
                        foreach add of NaN), so that pass 1 reads the master as a first step, or the
                        step after any other write of it, does (include/fp8amp/optim.h)

Step time: median over timed steps (CUDA events around each step(); the first steps, which create
the states, are untimed). Pass 1 / pass 2: fp8amp's two kernels (amax, then store) per step, GPU
time from torch.profiler over 3 more steps, each against the floor of the bytes it moves. Floor: the bytes a step must move at the measured copy bandwidth
(torch: read p, g, m, v and write p, m, v = 28 B per parameter; fp8amp's two passes: see
include/fp8amp/optim.h). Model-state bytes per parameter: torch.cuda.memory_allocated() after the
first step (params + grads + optimizer states + the weight copy where there is one) over the
parameter count, measured from an empty allocator.

Usage: python benchmarks/bench_optim.py [--layers 20] [--d-model 2048] [--steps 20] [--modes a,b]
Prints a markdown table (last); with $OUT set, also writes it to $OUT/bench_optim.md.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import fp8amp
from _common import copy_bandwidth, markdown_table, parse_subset, report, require_gpu, warm_up_gpu

MODES = ["torch-fused", "torch-foreach", "fp8amp-fp32", "o1", "o2", "o2-stochastic", "o2-read", "o2-blocks",
         "o2-copy"]
LABELS = {
    "torch-fused": "torch AdamW fused", "torch-foreach": "torch AdamW foreach", "fp8amp-fp32": "fp8amp fp32",
    "o1": "fp8amp O1", "o2": "fp8amp O2", "o2-blocks": "fp8amp O2, block-scaled grads",
    "o2-copy": "fp8amp O2 + weight copy", "o2-read": "fp8amp O2, master read",
    "o2-stochastic": "fp8amp O2, stochastic rounding",
}
# Bytes per parameter a step must move (read + write), per pass: torch's one pass; fp8amp's pass 1
# (amax: reads g, m, v, and p unless p is a master with a kept amax, as from the second step on
# here: include/fp8amp/optim.h) and pass 2 (store: reads p, g, m, v, writes p, m, v and the weight copy).
PASS_BYTES = {
    "torch-fused": (28,), "torch-foreach": (28,), "fp8amp-fp32": (16, 28), "o1": (9, 21), "o2": (4, 11),
    "o2-blocks": (4, 11), "o2-copy": (4, 12), "o2-read": (6, 11), "o2-stochastic": (4, 11),
}
# The kernels of fp8amp's passes (src/optim/adam_cuda.cu), as the profiler names them.
PASS_KERNELS = ("adam_amax_kernel", "adam_store_kernel")


def shapes(layers: int, d: int) -> list[tuple[int, int]]:
    return [s for _ in range(layers) for s in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]


def make(mode: str, sizes: list[tuple[int, int]], device: str):
    """Params with grads and the optimizer of `mode`."""
    gen = torch.Generator(device=device).manual_seed(0)
    params = []
    for shape in sizes:
        w = torch.randn(shape, device=device, generator=gen) * 0.02
        g = torch.randn(shape, device=device, generator=gen) * 1e-3
        if mode in ("o1", "o2", "o2-read", "o2-blocks", "o2-copy", "o2-stochastic"):
            master = fp8amp.MasterWeight.from_tensor(w)
            p = torch.nn.Parameter(master if mode == "o2-copy" else master.drop_fp8_copy())
            grad_type = fp8amp.BlockScaledTensor if mode == "o2-blocks" else fp8amp.ScaledTensor
            p.grad = grad_type.from_tensor(g, fp8amp.E4M3)
        else:
            p = torch.nn.Parameter(w)
            p.grad = g
        del w, g
        params.append(p)
    hyper = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if mode == "torch-fused":
        opt = torch.optim.AdamW(params, fused=True, **hyper)
    elif mode == "torch-foreach":
        opt = torch.optim.AdamW(params, foreach=True, **hyper)
    else:
        opt = fp8amp.optim.AdamW(params, state_dtypes="O2" if mode.startswith("o2") else "O1",
                                 master_rounding="stochastic" if mode == "o2-stochastic" else "nearest", **hyper)
    if mode == "o2-read":
        kept = [p.kept_amax() for p in params]
        step = opt.step
        opt.step = lambda: (torch._foreach_add_(kept, float("nan")), step())  # x + NaN: one launch
    return params, opt


def measure(mode: str, sizes, device: str, steps: int) -> tuple[float, float, list[float]]:
    """(median step seconds, model-state bytes per parameter, [seconds per step of each fp8amp pass])."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    params, opt = make(mode, sizes, device)
    numel = sum(p.numel() for p in params)
    opt.step()  # creates the states
    torch.cuda.synchronize()
    state_bytes = (torch.cuda.memory_allocated() - base) / numel
    for _ in range(2):
        opt.step()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.step()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    seconds = statistics.median(s.elapsed_time(e) * 1e-3 for s, e in times)
    pass_seconds = pass_times(opt, 3) if isinstance(opt, fp8amp.optim.Adam) else []
    del params, opt
    return seconds, state_bytes, pass_seconds


def pass_times(opt, steps: int) -> list[float]:
    """GPU seconds per step of each of fp8amp's passes, summed over their launches (profiler)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
    totals = [0.0] * len(PASS_KERNELS)
    for event in prof.key_averages():
        for k, name in enumerate(PASS_KERNELS):
            if name in event.key:
                totals[k] += event.device_time_total * 1e-6  # µs, summed over the launches
    return [t / steps for t in totals]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", type=lambda t: parse_subset(t, MODES), default=MODES)
    args = parser.parse_args()
    require_gpu("bench_optim")
    warm_up_gpu()
    sizes = shapes(args.layers, args.d_model)
    numel = sum(a * b for a, b in sizes)
    bandwidth = copy_bandwidth()
    results = {mode: measure(mode, sizes, "cuda", args.steps) for mode in args.modes}
    base = results.get("torch-fused", (None, None))[0]
    rows = []
    for mode, (seconds, state_bytes, pass_seconds) in results.items():
        floor = sum(PASS_BYTES[mode]) * numel / bandwidth
        # A pass time of 0: the profiler recorded no kernels (under Nsight Compute, which holds CUPTI).
        passes = [f"{t * 1e3:.2f} ({b * numel / bandwidth / t:.0%})" if t > 0 else "-"
                  for t, b in zip(pass_seconds, PASS_BYTES[mode])]
        rows.append([
            LABELS[mode], f"{seconds * 1e3:.2f}", f"{base / seconds:.2f}x" if base else "-",
            f"{floor * 1e3:.2f}", f"{floor / seconds:.0%}", *(passes or ["-", "-"]), f"{state_bytes:.2f}",
        ])
    title = (f"AdamW step on {torch.cuda.get_device_name()}, torch {torch.__version__}: {numel / 1e9:.3f}B parameters "
             f"in {len(sizes)} tensors ({args.layers} layers x d_model {args.d_model}); copy bandwidth "
             f"{bandwidth / 1e12:.2f} TB/s; median of {args.steps} steps\n\n")
    header = ["mode", "step ms", "speedup vs torch fused", "floor ms", "of floor", "pass 1 ms (of its floor)",
              "pass 2 ms (of its floor)", "model-state bytes / param"]
    report("optim", title + markdown_table(header, rows))


if __name__ == "__main__":
    main()
